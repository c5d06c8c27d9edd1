"""Structured outputs in the Python API: `samplec.decode.generate(..., grammar=...)` with the grammar's packed mask
as the program's `allow(mask)`: completions that end parse and validate, the unconstrained tokens are unchanged by
an all-allowing grammar, and what the engine or the program cannot do is a SamplecError naming it."""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import samplec  # noqa: E402
from samplec.decode import generate  # noqa: E402
from samplec.structured import Grammar, GrammarError, Tokenizer  # noqa: E402

CHAIN = """
sampler constrained(allowed: mask, seed: seed, pos: int, h: tokens, temperature: float = 1.0) -> token {
    allow(allowed)
    penalties(h, last_n = 16, repeat = 1.2)
    top_k(50)
    temperature(temperature)
    sample(seed, position = pos)
}
"""


@pytest.fixture(scope="module")
def demo():
    from samplec.integrations.mlx_lm import local_tokenizer, random_llama
    tok = local_tokenizer(512)
    return random_llama(0, vocab=512), tok, Tokenizer.of(tok), samplec.compile(CHAIN)


def test_json_schema_completions_validate(demo):
    model, tok, gt, prog = demo
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    g = Grammar.json_schema(gt, schema)
    ended = 0
    for seed in range(4):
        out = generate(model, prog, tok.encode("A sampler chain"), 60, seed=seed, eos_token_id=tok.eos_token_ids,
                       grammar=g)
        if out and out[-1] in tok.eos_token_ids:
            jsonschema.validate(json.loads(tok.decode(out[:-1])), schema)
            ended += 1
    assert ended == 4


def test_regex_and_lark_and_reproducible(demo):
    model, tok, gt, prog = demo
    for g, pattern in ((Grammar.regex(gt, "[a-z]{2,5}@[0-9]{1,3}"), "[a-z]{2,5}@[0-9]{1,3}"),
                       (Grammar.lark(gt, 'start: "x" ("-" "y")*  "!"'), "x(-y)*!")):
        out = generate(model, prog, tok.encode("counting"), 40, seed=3, eos_token_id=tok.eos_token_ids, grammar=g)
        assert out[-1] in tok.eos_token_ids and re.fullmatch(pattern, tok.decode(out[:-1]))
        again = generate(model, prog, tok.encode("counting"), 40, seed=3, eos_token_id=tok.eos_token_ids,
                         grammar=g)
        assert again == out


def test_a_constant_mask_gives_the_tokens_of_plain_decoding_with_that_mask(demo):
    """A grammar whose allowed set never changes (printable ASCII, any length: every token of printable bytes,
    and the end) draws the tokens of the plain loop given that set as its mask: positions, seeds and history
    follow decode.generate's convention, and the mask is the only difference the grammar makes."""
    model, tok, gt, prog = demo
    prompt = tok.encode("Quick brown foxes")
    ascii_ = Grammar.regex(gt, "[ -~]*")
    mask = np.zeros((1, 16), dtype=np.int32)
    ascii_.matcher().fill(mask, 0)
    allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")
    assert 100 < allowed.sum() < 512
    plain = generate(model, prog, prompt, 16, seed=5, allowed=mask)
    constrained = generate(model, prog, prompt, 16, seed=5, grammar=ascii_)
    assert constrained == plain and all(allowed[t] for t in plain)


def test_errors_name_what_is_wrong(demo):
    model, tok, gt, prog = demo
    with pytest.raises(GrammarError, match="regex"):
        Grammar.regex(gt, "[a-")
    with pytest.raises(GrammarError, match="json schema"):
        Grammar.json_schema(gt, {"type": "object", "properties": {"a": {"$ref": "#/missing"}}})
    g = Grammar.regex(gt, "[a-z]+")
    with pytest.raises(samplec.SamplecError, match="mask"):
        generate(model, samplec.compile("sampler s(seed: seed) -> token { sample(seed) }"), [3, 4], 4, grammar=g)
    with pytest.raises(samplec.SamplecError, match="chunk"):
        generate(model, prog, [3, 4], 4, chunk=4, grammar=g)
    with pytest.raises(samplec.SamplecError, match="set by the grammar"):
        generate(model, prog, [3, 4], 4, grammar=g, allowed=np.full((1, 16), -1, np.int32))


FIXED = "sampler fixed(allowed: mask, seed: seed) -> token { allow(allowed) temperature(2.0) sample(seed) }"


@pytest.mark.parametrize("chain", ["positions", "fixed"])
def test_the_mlx_lm_adapter_with_a_grammar_draws_what_decode_generate_draws(demo, chain):
    """`Sampler(program, grammar=g)` inside mlx-lm's own loop: the grammar's mask each step, the same tokens as
    `decode.generate(..., grammar=g)` (same positions and history; a draw at a fixed position with its seed
    advanced by the position in both), a second run starting afresh."""
    from mlx_lm.generate import generate_step

    from samplec.integrations.mlx_lm import Sampler
    model, tok, gt, prog = demo
    if chain == "fixed":
        prog = samplec.compile(FIXED)
    g = Grammar.regex(gt, "[a-z]{2,5}@[0-9]{1,3}")
    prompt = tok.encode("counting")
    want = generate(model, prog, prompt, 30, seed=9, eos_token_id=tok.eos_token_ids, grammar=g)
    sampler = Sampler(prog, seed=9, grammar=g)
    for _ in range(2):
        got = []
        for t, _ in generate_step(mx.array(prompt), model, max_tokens=30, sampler=sampler,
                                  logits_processors=sampler.logits_processors):
            got.append(int(t))
            if got[-1] in tok.eos_token_ids:
                break
        assert got == want and re.fullmatch("[a-z]{2,5}@[0-9]{1,3}", tok.decode(got[:-1]))
    with pytest.raises(samplec.SamplecError, match="mask"):
        Sampler(samplec.compile("sampler s(seed: seed) -> token { sample(seed) }"), grammar=g)


def test_a_batch_of_masks_on_the_thread_pool_equals_one_at_a_time(demo):
    from samplec.structured import fill_batch
    model, tok, gt, prog = demo
    g = Grammar.json_schema(gt, {"type": "object", "properties": {"a": {"type": "string"}}})
    matchers = [g.matcher() for _ in range(3)]
    for m, text in zip(matchers, ["", '{"a":', '{"a":"xy']):
        for t in tok.encode(text) if text else []:
            assert m.consume(t)
    one = np.full((4, 16), -1, dtype=np.int32)
    for i, m in enumerate(matchers):
        m.fill(one, i + 1)
    pool = np.full((4, 16), -1, dtype=np.int32)
    fill_batch([(m, i + 1) for i, m in enumerate(matchers)], pool)
    np.testing.assert_array_equal(pool, one)
    assert len({one[i].tobytes() for i in (1, 2, 3)}) == 3 and (one[0] == -1).all()


def test_a_missing_bias_is_an_error_before_the_prompts_prefill(demo, monkeypatch):
    """The grammar sets the mask each step; any other required array (a bias) not given is an error when the loop
    is set up, before the model runs the prompt."""
    model, tok, gt, _ = demo
    prog = samplec.compile("sampler c(allowed: mask, b: bias, seed: seed, pos: int) -> token "
                           "{ allow(allowed) logit_bias(b) sample(seed, position = pos) }")
    from samplec import decode
    ran = []
    monkeypatch.setattr(decode, "prefill", lambda *a, **k: ran.append(1))
    with pytest.raises(samplec.SamplecError, match="missing required parameter 'b'"):
        generate(model, prog, tok.encode("counting"), 8, seed=1, grammar=Grammar.regex(gt, "[a-z]+"))
    assert not ran
