"""`samplec serve --demo --draft-model PATH [--num-draft K]` over real HTTP, driven by the official `openai` client:
a seeded request gives the tokens the server gives without a draft (the target's own draws at the same positions,
whatever the draft proposes), with the target as its own draft every proposal is kept, with a draft that never
agrees none is and the tokens are still the same; streaming, n, stop, logprobs and structured requests beside
speculative ones; bad --num-draft values and a draft over another vocabulary are clear start-up errors."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai")

import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.utils import save_config, save_model  # noqa: E402

from samplec import SamplecError, serve  # noqa: E402
from samplec.integrations.mlx_lm import noisy_copy, random_llama  # noqa: E402
from serve_util import start, stop  # noqa: E402

V = 512                   # the demo model's vocabulary
NEVER = 7                 # the token the stubborn draft always proposes (requests bias it away from the target)
DEMO = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=V, tie_word_embeddings=True)


def save(model, config: dict, path):
    path.mkdir()
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    return str(path)


def stubborn(token: int, vocab: int = V):
    """A llama whose logits are 640 at `token` and 0 elsewhere at every position: attention and MLP write
    nothing, every embedding is ones, and the untied head has one non-zero row."""
    cfg = dict(DEMO, tie_word_embeddings=False, vocab_size=vocab)
    m = llama.Model(llama.ModelArgs(**cfg))
    m.model.embed_tokens.weight = mx.ones_like(m.model.embed_tokens.weight)
    for layer in m.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    m.model.norm.weight = mx.ones_like(m.model.norm.weight)
    m.lm_head.weight = mx.zeros_like(m.lm_head.weight).at[token].add(10.0)
    mx.eval(m.parameters())
    return m, cfg


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    target = random_llama(0, vocab=V)              # the demo model's weights: the target as its own draft
    never, never_cfg = stubborn(NEVER)
    return {"own": save(target, DEMO, root / "own"),
            "noisy": save(noisy_copy(random_llama(0, vocab=V), 0.5, seed=1), DEMO, root / "noisy"),
            "never": save(never, never_cfg, root / "never"),
            "other_vocab": save(random_llama(1, vocab=256), dict(DEMO, vocab_size=256), root / "other_vocab")}


@pytest.fixture(scope="module")
def servers(drafts):
    boxes = {"plain": start([]),
             "own": start(["--draft-model", drafts["own"], "--num-draft", "4"]),
             "noisy": start(["--draft-model", drafts["noisy"], "--num-draft", "3"]),
             "never": start(["--draft-model", drafts["never"]])}
    yield boxes
    for box in boxes.values():
        stop(box)


MSG = [{"role": "user", "content": "Count the tokens"}]

REQUESTS = {
    "sampled": dict(temperature=1.0, top_p=0.9, seed=11),
    "hot": dict(temperature=1.4, seed=5, extra_body={"top_k": 50, "min_p": 0.01}),
    "penalties": dict(temperature=0.8, seed=2, frequency_penalty=0.6, presence_penalty=0.4,
                      extra_body={"repetition_penalty": 1.3, "repetition_context_size": 8}),
    "greedy": dict(temperature=0.0),
    "xtc": dict(temperature=1.0, seed=9, extra_body={"xtc_probability": 0.7, "xtc_threshold": 0.05}),
}


def chat(box, max_tokens=24, **kw):
    kw.setdefault("logit_bias", {str(NEVER): -100})
    return box["client"].chat.completions.create(model="demo", messages=MSG, max_tokens=max_tokens, logprobs=True,
                                                 top_logprobs=3, **kw)


def tokens_of(choice) -> list[tuple]:
    return [(tuple(e.bytes), e.logprob) for e in choice.logprobs.content]


def spec_usage(r) -> dict:
    return r.usage.model_extra["samplec_speculative"]


@pytest.mark.parametrize("name", list(REQUESTS))
def test_a_draft_does_not_change_the_tokens(servers, name):
    want = chat(servers["plain"], **REQUESTS[name])
    assert "samplec_speculative" not in (want.usage.model_extra or {})
    for draft in ("own", "noisy", "never"):
        got = chat(servers[draft], **REQUESTS[name])
        assert got.choices[0].message.content == want.choices[0].message.content, (name, draft)
        assert tokens_of(got.choices[0]) == tokens_of(want.choices[0]), (name, draft)
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
        assert got.usage.completion_tokens == want.usage.completion_tokens
        s = spec_usage(got)
        assert s["target_forwards"] >= 1 and 0 <= s["accepted_tokens"] <= s["draft_tokens"]


def test_the_requests_give_varied_text(servers):
    """(the comparisons above can tell samplers apart: the sampled requests are not all one token)"""
    texts = {n: chat(servers["plain"], **REQUESTS[n]).choices[0].message.content for n in ("sampled", "hot")}
    assert all(len(set(t)) > 4 for t in texts.values()) and texts["sampled"] != texts["hot"], texts


def test_the_target_as_its_own_draft_keeps_every_proposal(servers):
    r = chat(servers["own"], max_tokens=20, temperature=1.0, seed=3)
    s = spec_usage(r)
    assert s["draft_tokens"] > 0 and s["accepted_tokens"] == s["draft_tokens"] and s["acceptance"] == 1.0
    # k + 1 = 5 tokens per target forward pass (up to the end)
    assert s["target_forwards"] == -(-r.usage.completion_tokens // 5)


def test_a_draft_that_never_agrees_keeps_nothing(servers):
    r = chat(servers["never"], max_tokens=20, temperature=1.0, seed=3)
    s = spec_usage(r)
    assert s["draft_tokens"] > 0 and s["accepted_tokens"] == 0 and s["acceptance"] == 0.0
    assert s["target_forwards"] == r.usage.completion_tokens            # one token per target forward pass


def test_a_noisy_draft_keeps_some(servers):
    s = spec_usage(chat(servers["noisy"], max_tokens=40, temperature=0.7, seed=8))
    assert 0 < s["accepted_tokens"] < s["draft_tokens"]


def test_n_stop_and_completions(servers):
    for box in ("own", "never"):
        kw = dict(temperature=1.0, seed=21, n=3)
        want, got = chat(servers["plain"], **kw), chat(servers[box], **kw)
        assert [c.message.content for c in got.choices] == [c.message.content for c in want.choices]
        text = want.choices[1].message.content
        stop = text[5:7]
        want = chat(servers["plain"], stop=[stop], **kw)
        got = chat(servers[box], stop=[stop], **kw)
        assert [(c.message.content, c.finish_reason) for c in got.choices] == \
            [(c.message.content, c.finish_reason) for c in want.choices]
        assert got.choices[1].finish_reason == "stop"
        kw = dict(prompt="A sampler chain", max_tokens=17, temperature=0.9, seed=4, logprobs=2)
        want = servers["plain"]["client"].completions.create(model="demo", **kw)
        got = servers[box]["client"].completions.create(model="demo", **kw)
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].logprobs.token_logprobs == want.choices[0].logprobs.token_logprobs
        assert got.choices[0].logprobs.top_logprobs == want.choices[0].logprobs.top_logprobs
        # several prompts, echoed: each choice decodes speculatively from its own prompt
        kw = dict(prompt=["A sampler chain", [5, 6, 7]], n=2, max_tokens=9, temperature=0.9, seed=4, logprobs=1,
                  echo=True)
        want = servers["plain"]["client"].completions.create(model="demo", **kw)
        got = servers[box]["client"].completions.create(model="demo", **kw)
        assert [(c.text, c.logprobs.token_logprobs) for c in got.choices] == \
            [(c.text, c.logprobs.token_logprobs) for c in want.choices]
        assert len({c.text for c in got.choices}) == 4


def test_streaming_gives_the_same_text(servers):
    kw = dict(temperature=1.0, seed=13, n=2)
    want = chat(servers["plain"], **kw)
    for box in ("own", "noisy"):
        parts, usage = {0: "", 1: ""}, None
        stream = chat(servers[box], stream=True, stream_options={"include_usage": True}, **kw)
        for chunk in stream:
            for c in chunk.choices:
                parts[c.index] += c.delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        assert [parts[0], parts[1]] == [c.message.content for c in want.choices]
        assert usage.completion_tokens == want.usage.completion_tokens
        assert usage.model_extra["samplec_speculative"]["target_forwards"] >= 1


def test_concurrent_requests_give_what_each_gives_alone(servers):
    seeds = list(range(30, 36))
    alone = {s: chat(servers["plain"], temperature=1.0, seed=s).choices[0].message.content for s in seeds}
    with ThreadPoolExecutor(6) as ex:
        got = dict(zip(seeds, ex.map(lambda s: chat(servers["noisy"], temperature=1.0, seed=s)
                                     .choices[0].message.content, seeds)))
    assert got == alone


def test_structured_requests_decode_beside_speculative_ones(servers):
    pytest.importorskip("llguidance")
    kw = dict(temperature=1.0, seed=6, max_tokens=40,
              response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
                  "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}})
    want = chat(servers["plain"], **kw)
    got = chat(servers["own"], **kw)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert "samplec_speculative" not in (got.usage.model_extra or {})      # (a grammar's request: the batch)
    if got.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(got.choices[0].message.content)["a"], int)


# ---- start-up errors

def failure(argv: list[str]) -> str:
    with pytest.raises(SamplecError) as e:
        serve.serve(["--host", "127.0.0.1", "--port", "0", *argv], [], True, ready=lambda *_: None)
    return str(e.value)


def test_bad_num_draft_is_a_clear_error(drafts):
    for bad in ("0", "-2", "65", "four"):
        msg = failure(["--draft-model", drafts["own"], "--num-draft", bad])
        assert msg.startswith(f"--num-draft {bad}") and "1..64" in msg, msg
    assert "only with --draft-model" in failure(["--num-draft", "3"])


def test_a_draft_over_another_vocabulary_is_a_clear_error(drafts):
    msg = failure(["--draft-model", drafts["other_vocab"]])
    assert msg == ("--draft-model: its vocabulary has 256 entries, the target's 512; a draft must share the "
                   "target's token ids"), msg


def test_a_draft_that_does_not_load_is_a_clear_error(tmp_path):
    msg = failure(["--draft-model", str(tmp_path / "nothing-here")])
    assert msg.startswith("--draft-model: cannot load"), msg


def test_the_cli_reports_a_bad_num_draft(drafts):
    p = subprocess.run([sys.executable, "-m", "samplec", "serve", "--demo", "--port", "0", "--draft-model",
                        drafts["own"], "--num-draft", "0"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "--num-draft 0: must be an integer in 1..64" in p.stderr, p.stderr[-2000:]


def test_min_tokens_is_refused_with_a_draft_model(servers):
    """A round of proposals shares one bias, so min_tokens (held stop ids) is a 400 naming it with a draft;
    stop_token_ids need no bias and are served."""
    with pytest.raises(openai.BadRequestError) as e:
        chat(servers["own"], extra_body={"min_tokens": 2})
    assert e.value.body["param"] == "min_tokens"
    assert chat(servers["plain"], extra_body={"min_tokens": 2}).choices[0].message.content is not None
    assert chat(servers["own"], extra_body={"stop_token_ids": [7]}).choices[0].finish_reason in ("stop", "length")
