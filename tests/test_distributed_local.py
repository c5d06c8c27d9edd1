"""samplec.distributed in one process (a group of one rank, no launcher): the argument checks of a sharded call,
the whole-vocabulary case against the program, and shard_lm_head's refusals. The multi-rank behaviour is in
tests/test_distributed.py."""
from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

import samplec
from samplec.distributed import shard, shard_lm_head

SRC = ("sampler s(seed: seed, b: bias, h: tokens) -> token, logprob, top_logprobs(2), probs "
       "{ penalties(h, repeat = 1.2) logit_bias(b) top_k(5) sample(seed) }")


@pytest.fixture(scope="module")
def group():
    return mx.distributed.init()


@pytest.fixture(scope="module")
def prog():
    return samplec.compile(SRC)


def _args(V=50, B=2):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, V)).astype(np.float32),
            {"seed": 3, "b": np.zeros((B, V), np.float32), "h": np.array([[1, 2, 3]] * B, np.int32)})


def test_one_rank_holding_the_whole_vocabulary_is_the_program(group, prog):
    x, params = _args()
    want, got = prog(x, **params), shard(prog, group)(x, vocab_start=0, vocab_size=50, **params)
    for key, w in want.to_dict().items():
        np.testing.assert_allclose(np.array(got.to_dict()[key]), np.array(w), rtol=1e-6)


@pytest.mark.parametrize("call, message", [
    (lambda s, x, p: s(x, vocab_start=-1, vocab_size=50, **p), "does not lie in the vocabulary"),
    (lambda s, x, p: s(x, vocab_start=0, vocab_size=49, **p), "does not lie in the vocabulary"),
    (lambda s, x, p: s(x, vocab_start=1.0, vocab_size=50, **p), "vocab_start: expected an integer"),
    (lambda s, x, p: s(x, vocab_start=0, vocab_size="50", **p), "vocab_size: expected an integer"),
    (lambda s, x, p: s(x[:, :10], vocab_start=0, vocab_size=50, **p), "the slices do not tile the vocabulary"),
    (lambda s, x, p: s(x, vocab_start=0, vocab_size=50, **{**p, "b": np.zeros((2, 7), np.float32)}),
     "b: expected shape [2, 50] (the whole vocabulary) or [2, 50]"),
    (lambda s, x, p: s(x, vocab_start=0, vocab_size=50, **{**p, "h": np.array([[1, 99]] * 2, np.int32)}),
     "token id >= V = 50"),
    (lambda s, x, p: s(np.where(np.arange(50) == 7, np.nan, x).astype(np.float32), vocab_start=0, vocab_size=50,
                       **p), "logits: NaN or +inf"),
    (lambda s, x, p: s(x, vocab_start=0, vocab_size=50, temperature=1.0, **p), "unknown parameter 'temperature'"),
])
def test_bad_calls_are_clear_errors(group, prog, call, message):
    x, params = _args()
    with pytest.raises(samplec.SamplecError, match=re.escape(message)):
        call(shard(prog, group), x, params)


def test_shard_refuses_what_is_not_a_program(group):
    with pytest.raises(samplec.SamplecError, match="expected a samplec Program"):
        shard("sampler s() { greedy() }", group)
    with pytest.raises(samplec.SamplecError, match="on_timeout must be"):
        shard(samplec.compile("sampler s() { greedy() }"), group, on_timeout="wait")


def test_shard_lm_head_refusals(group, monkeypatch):
    import mlx.nn as nn
    with pytest.raises(samplec.SamplecError, match="found no LM head"):
        shard_lm_head(nn.Linear(4, 4), group)
    llama = pytest.importorskip("mlx_lm.models.llama")
    args = llama.ModelArgs(model_type="llama", hidden_size=16, num_hidden_layers=1, intermediate_size=32,
                           num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=40,
                           tie_word_embeddings=False)
    model = llama.Model(args)
    full = model(mx.array([[1, 2, 3]]))
    shard_lm_head(model, group)
    assert model.samplec_vocab.start == 0 and model.samplec_vocab.size == 40
    assert mx.array_equal(model(mx.array([[1, 2, 3]])), full)          # (one rank: the whole head)
    with pytest.raises(samplec.SamplecError, match="already sharded"):
        shard_lm_head(model, group)
    from samplec.decode import generate
    prog = samplec.compile("sampler s(seed: seed) -> token { sample(seed) }")
    with pytest.raises(samplec.SamplecError, match="without grammar= or draft_model="):
        generate(model, prog, [1, 2], 3, draft_model=model)
    assert len(generate(model, prog, [1, 2], 3)) == 3
    biased = samplec.compile("sampler b(bias: bias, seed: seed) -> token { logit_bias(bias) sample(seed) }")
    calls, forward = [], type(model).__call__
    monkeypatch.setattr(type(model), "__call__", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    with pytest.raises(samplec.SamplecError, match="missing required parameter 'bias'"):
        generate(model, biased, [1, 2], 3)
    assert not calls        # (an error when the loop is set up: the model never ran the prompt)
