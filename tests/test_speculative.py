"""Speculative decoding in `samplec.decode.generate(..., draft_model=...)`: the tokens are plain decoding's.

The draft runs the program on its own logits with the target's seed, positions, history and state, so its draw
and the target's share their noise (spec sections 4 and 7); every emitted token is the program's draw from the
target's logits. The exactness tests give the target a forward pass that computes several positions one token
at a time (`OneTokenAtATime`), so its logits are bit-identical to plain decoding's and any difference would be
the loop's; how often the real multi-position pass rounds a token differently is measured by
`benchmarks/bench_speculative.py --rounding` (docs/inference.md).
"""
from __future__ import annotations

import numpy as np
import pytest

mlx_lm = pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import speculative_generate_step  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

import samplec  # noqa: E402
from samplec import SamplecError  # noqa: E402
from samplec.decode import generate  # noqa: E402
from samplec.integrations.mlx_lm import Sampler, local_tokenizer, noisy_copy, random_llama  # noqa: E402

V = 256
PROMPT = [5, 17, 200, 42, 7, 9, 5, 17]

CHAINS = {
    "penalties": ("""sampler s(seed: seed, pos: int = 0, h: tokens, t: float = 1.0) -> token, logprob {
        penalties(h, last_n = 12, repeat = 1.4, frequency = 0.3, presence = 0.2)
        top_k(60) top_p(0.95) temperature(t) sample(seed, position = pos) }""", {}),
    "dry": ("""sampler s(seed: seed, pos: int = 0, h: tokens) -> token {
        dry(h, 0.8, base = 1.75, allowed_length = 2) min_p(0.02) temperature(1.2) sample(seed, position = pos) }""",
            {}),
    "mirostat": ("""sampler s(mu: state, seed: seed, pos: int = 0) -> token, mu {
        temperature(1.1) mirostat(mu, 3.0, 0.3, m = 100, seed = seed, position = pos) }""", {}),
    "mirostat_v2": ("""sampler s(mu: state, seed: seed, pos: int = 0, h: tokens) -> token, mu {
        penalties(h, repeat = 1.2) mirostat_v2(mu, 2.5, 0.4, seed, position = pos) }""", {}),
    "xtc": ("""sampler s(seed: seed, pos: int = 0) -> token {
        top_k(80) xtc(0.02, 0.6, seed, position = pos) temperature(1.3) sample(seed, position = pos) }""", {}),
    "mask": ("""sampler s(seed: seed, pos: int = 0, m: mask) -> token {
        allow(m) top_p(0.9) sample(seed, position = pos) }""", {"m": np.arange(V) % 3 != 1}),
    "temperature_0": ("""sampler s(h: tokens) -> token {
        penalties(h, last_n = 8, repeat = 1.5) temperature(0) sample() }""", {}),
    "greedy": ("sampler s() -> token { greedy() }", {}),
    # vLLM's two histories: the repetition penalty over the prompt and the output, presence/frequency the output
    "two_histories": ("""sampler s(seed: seed, pos: int = 0, prompt_and_output: tokens, output: tokens) -> token {
        penalties(prompt_and_output, repeat = 1.6) penalties(output, frequency = 1.5, presence = 1.0)
        top_k(50) temperature(0.8) sample(seed, position = pos) }""", {}),
}


class OneTokenAtATime:
    """A target whose multi-position forward pass is its one-token pass repeated: plain decoding's logits, bit
    for bit, at every verified position."""

    def __init__(self, model):
        self.model = model
        self.layers = model.layers

    def __call__(self, tokens, cache=None):
        return mx.concatenate([self.model(tokens[:, i:i + 1], cache=cache) for i in range(tokens.shape[1])],
                              axis=1)


class Stubborn:
    """A draft that always proposes `token` (its logits: 0 there, -30 elsewhere)."""

    def __init__(self, token: int, vocab: int = V):
        self.row = mx.where(mx.arange(vocab) == token, 0.0, -30.0)
        self.layers = [None]

    def make_cache(self):
        return [KVCache()]

    def __call__(self, tokens, cache=None):
        return mx.broadcast_to(self.row, (1, tokens.shape[1], self.row.shape[0]))


class _Offset:
    """A trimmable cache that only counts the positions fed (enough for drafts that need no keys or values)."""

    def __init__(self):
        self.offset = 0
        self.state = mx.array(0)

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self.offset, n)
        self.offset -= n
        return n


class Contrarian:
    """A draft that never agrees: at each position it proposes `expected[position] + 3` (mod V; the same residue
    mod 3, so the `mask` chain allows it too), where `expected` is the sequence plain decoding produces."""

    def __init__(self, expected: list[int]):
        self.expected = expected
        self.layers = [None]

    def make_cache(self):
        return [_Offset()]

    def __call__(self, tokens, cache):
        start = cache[0].offset
        cache[0].offset += tokens.shape[1]
        rows = [mx.where(mx.arange(V) == (self.expected[start + i + 1] + 3) % V, 0.0, -30.0)
                for i in range(tokens.shape[1])]
        return mx.stack(rows)[None]


@pytest.fixture(scope="module")
def target():
    return random_llama(0, layers=2, hidden=64, vocab=V)


@pytest.fixture(scope="module")
def exact_target(target):
    return OneTokenAtATime(target)


@pytest.fixture(scope="module")
def drafts(target):
    return {"close": noisy_copy(target, 0.05, seed=1), "far": noisy_copy(target, 0.6, seed=2)}


@pytest.fixture(scope="module")
def programs():
    return {name: samplec.compile(src) for name, (src, _) in CHAINS.items()}


N = 24


@pytest.mark.parametrize("chain", list(CHAINS))
def test_tokens_equal_plain_decoding_with_any_draft(chain, target, exact_target, drafts, programs):
    prog, params = programs[chain], CHAINS[chain][1]
    plain = generate(target, prog, PROMPT, N, seed=11, **params)
    assert generate(exact_target, prog, PROMPT, N, seed=11, **params) == plain
    for name, draft in [*drafts.items(), ("contrarian", Contrarian(PROMPT + plain))]:
        stats = {}
        got = generate(exact_target, prog, PROMPT, N, seed=11, draft_model=draft, num_draft=3, stats=stats,
                       **params)
        assert got == plain, name
        assert stats["tokens"] == N and stats["draft_tokens"] >= stats["accepted_tokens"]
        assert stats["target_forwards"] == N - stats["accepted_tokens"]    # one token per pass + the accepted
        if name == "contrarian":
            assert stats["accepted_tokens"] == 0 and stats["target_forwards"] == N


@pytest.mark.parametrize("chain", ["penalties", "mirostat", "dry"])
def test_the_target_as_its_own_draft_accepts_every_proposal(chain, exact_target, target, programs):
    prog, params = programs[chain], CHAINS[chain][1]
    plain = generate(target, prog, PROMPT, N, seed=4, **params)
    stats = {}
    got = generate(exact_target, prog, PROMPT, N, seed=4, draft_model=exact_target, num_draft=5, stats=stats,
                   **params)
    assert got == plain
    # rounds of 6 tokens (5 accepted + the target's), the last round shortened to the tokens left
    assert stats == {"target_forwards": 4, "draft_forwards": 20, "draft_tokens": 20, "accepted_tokens": 20,
                     "tokens": N}


def test_a_close_draft_saves_target_passes(exact_target, target, drafts, programs):
    stats = {}
    generate(exact_target, programs["penalties"], PROMPT, 40, seed=2, draft_model=drafts["close"], num_draft=4,
             stats=stats)
    assert stats["accepted_tokens"] > 0.5 * stats["draft_tokens"]
    assert stats["target_forwards"] < 0.5 * 40


def test_seed_and_prompt_in_history(exact_target, target, drafts, programs):
    prog = programs["penalties"]
    for seed in (0, 1, 2**63 + 5):
        for in_hist in (True, False):
            plain = generate(target, prog, PROMPT, 16, seed=seed, prompt_in_history=in_hist)
            assert generate(exact_target, prog, PROMPT, 16, seed=seed, prompt_in_history=in_hist,
                            draft_model=drafts["close"], num_draft=2) == plain


@pytest.mark.parametrize("chunk", [1, 5])
def test_eos_max_tokens_and_chunk_behave_as_without_a_draft(chunk, exact_target, target, drafts, programs):
    prog = programs["penalties"]
    full = generate(target, prog, PROMPT, 30, seed=5)
    k = next(i for i in range(4, 30) if full[i] not in full[:i])
    for n in (1, 2, 7):
        assert generate(exact_target, prog, PROMPT, n, seed=5, chunk=chunk, draft_model=drafts["close"],
                        num_draft=4) == full[:n]
    assert generate(exact_target, prog, PROMPT, 30, seed=5, chunk=chunk, eos_token_id=[V + 9, full[k]],
                    draft_model=drafts["close"], num_draft=4) == full[:k + 1]
    assert generate(exact_target, prog, PROMPT, 0, draft_model=drafts["close"]) == []


def test_single_token_prompt_and_long_history(exact_target, target, drafts, programs):
    prog = programs["dry"]
    assert generate(exact_target, prog, [3], 12, seed=9, draft_model=drafts["far"], num_draft=4) == \
        generate(target, prog, [3], 12, seed=9)
    long_prompt = (PROMPT * 40)[:300]        # history rows cross a padding block (256)
    assert generate(exact_target, prog, long_prompt, 10, seed=9, draft_model=drafts["close"], num_draft=4) == \
        generate(target, prog, long_prompt, 10, seed=9)


def test_run_time_checks_name_the_target_position(target, drafts):
    prog = samplec.compile("sampler s(seed: seed, pos: int = 0, m: mask) -> token { allow(m) sample(seed, "
                           "position = pos) }")
    with pytest.raises(SamplecError, match=r"at position 8\b|position 8\)"):
        generate(target, prog, PROMPT, 4, seed=1, m=np.zeros(V, dtype=bool), draft_model=drafts["close"])


def test_bad_arguments(target, drafts, programs):
    prog = programs["greedy"]
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(SamplecError, match="num_draft"):
            generate(target, prog, PROMPT, 4, draft_model=drafts["close"], num_draft=bad)
    with pytest.raises(SamplecError, match="stats"):
        generate(target, prog, PROMPT, 4, draft_model=drafts["close"], stats=[])
    with pytest.raises(SamplecError, match="vocabulary"):
        generate(target, prog, PROMPT, 4, draft_model=Stubborn(3, vocab=V + 8))
    rotating = random_llama(0, layers=1, hidden=32, vocab=V)
    from mlx_lm.models.cache import RotatingKVCache
    rotating.make_cache = lambda: [RotatingKVCache(max_size=4, keep=0) for _ in rotating.layers]
    with pytest.raises(SamplecError, match="cannot be trimmed"):
        generate(target, prog, PROMPT * 2, 8, draft_model=rotating)


def test_plain_decoding_fills_stats(target, programs):
    stats = {}
    out = generate(target, programs["greedy"], PROMPT, 6, stats=stats)
    assert stats == {"target_forwards": 6, "draft_forwards": 0, "draft_tokens": 0, "accepted_tokens": 0,
                     "tokens": len(out)}


# ---- mlx-lm's own speculative loop with the adapter (Sampler.speculative) ----

def mlx_lm_speculative(target, draft, prog, prompt, n, seed, k=3, **params):
    s = Sampler(prog, seed=seed, **params)
    out = [(int(t), bool(d)) for t, _, d in speculative_generate_step(
        mx.array(prompt), target, draft, num_draft_tokens=k, max_tokens=n, **s.speculative(prompt))]
    s.check()
    return [t for t, _ in out], sum(d for _, d in out), s


@pytest.mark.parametrize("chain", ["penalties", "mirostat", "mirostat_v2", "dry", "xtc", "mask", "temperature_0"])
def test_mlx_lm_speculative_loop_with_the_adapter_gives_plain_tokens(chain, target, exact_target, drafts,
                                                                      programs):
    prog, params = programs[chain], CHAINS[chain][1]
    plain = generate(target, prog, PROMPT, 16, seed=2, **params)
    for draft in (drafts["close"], drafts["far"], exact_target):
        toks, from_draft, s = mlx_lm_speculative(exact_target, draft, prog, PROMPT, 16, 2, **params)
        assert toks == plain
        assert [st.position[0] for st in s.steps[:16]] == list(range(len(PROMPT), len(PROMPT) + 16))
        if draft is exact_target:
            assert from_draft == 12           # rounds of 3 proposals + the target's token, all accepted
    _, accepted_far, _ = mlx_lm_speculative(exact_target, drafts["far"], prog, PROMPT, 16, 2, **params)
    _, accepted_close, _ = mlx_lm_speculative(exact_target, drafts["close"], prog, PROMPT, 16, 2, **params)
    assert accepted_close >= accepted_far


def test_adapter_outputs_follow_the_emitted_path(target, exact_target, drafts, programs):
    prog = programs["mirostat"]
    plain = Sampler(prog, seed=6)
    from mlx_lm.generate import generate_step
    ref = [t for t, _ in generate_step(mx.array(PROMPT), exact_target, max_tokens=12, sampler=plain,
                                       logits_processors=plain.logits_processors)]
    toks, _, s = mlx_lm_speculative(exact_target, drafts["far"], prog, PROMPT, 12, 6)
    assert toks == ref
    np.testing.assert_array_equal(np.array(s.output("mu")[:12]), np.array(plain.output("mu")[:12]))


def test_stream_generate_with_a_draft_and_prompt_options(target, exact_target, drafts, programs):
    big = random_llama(3, layers=1, hidden=32, vocab=512)
    tokenizer = local_tokenizer(512)
    prog = programs["penalties"]
    for in_hist in (True, False):
        plain = generate(big, prog, PROMPT, 10, seed=3, prompt_in_history=in_hist, eos_token_id=1)
        plain = plain[:-1] if plain[-1] == 1 else plain
        s = Sampler(prog, seed=3, prompt_in_history=in_hist)
        got = [r.token for r in mlx_lm.stream_generate(OneTokenAtATime(big), tokenizer, PROMPT, max_tokens=10,
                                                      draft_model=noisy_copy(big, 0.05), num_draft_tokens=2,
                                                      **s.speculative(PROMPT))]
        assert got == plain
    # a position convention of the server's kind: the first generated token at position 0
    s = Sampler(prog, seed=3)
    toks = [int(t) for t, _, _ in speculative_generate_step(
        mx.array(PROMPT), exact_target, drafts["close"], num_draft_tokens=2, max_tokens=6,
        **s.speculative(PROMPT, first_position=0))]
    assert [st.position[0] for st in s.steps[:6]] == list(range(6))
    assert toks == [int(t) for t, _, _ in speculative_generate_step(
        mx.array(PROMPT), exact_target, exact_target, num_draft_tokens=3, max_tokens=6,
        **Sampler(prog, seed=3).speculative(PROMPT, first_position=0))]


def test_adapter_speculative_misuse(target, drafts, programs):
    s = Sampler(programs["penalties"], seed=1)
    for bad in ([], [[1, 2]], "text", [-1, 3]):
        with pytest.raises(SamplecError, match="token ids"):
            s.speculative(bad)
    with pytest.raises(SamplecError, match="first_position"):
        s.speculative(PROMPT, first_position=-2)
    kw = s.speculative(PROMPT + [3])              # armed for another prompt
    with pytest.raises(SamplecError, match="speculative"):
        list(speculative_generate_step(mx.array(PROMPT), target, drafts["close"], max_tokens=4, **kw))
    with pytest.raises(SamplecError, match="logits_processors"):
        list(speculative_generate_step(mx.array(PROMPT), target, drafts["close"], max_tokens=4,
                                       sampler=s.speculative(PROMPT)["sampler"]))


def test_a_plain_generation_after_a_speculative_run_is_plain(target, exact_target, drafts, programs):
    """One Sampler, reused: a speculative run, then plain runs on other prompts (each its own positions and
    history, as decode.generate gives them), then another speculative run armed for its own prompt."""
    from mlx_lm.generate import generate_step
    prog, params = programs["penalties"], CHAINS["penalties"][1]
    s = Sampler(prog, seed=4, **params)
    spec = [int(t) for t, _, _ in speculative_generate_step(mx.array(PROMPT), exact_target, drafts["far"],
                                                            num_draft_tokens=3, max_tokens=8,
                                                            **s.speculative(PROMPT))]
    assert spec == generate(exact_target, prog, PROMPT, 8, seed=4, **params)
    for other in ([9, 3, 3, 81, 12], [5, 17, 200]):
        plain = [int(t) for t, _ in generate_step(mx.array(other), exact_target, max_tokens=8, sampler=s,
                                                  logits_processors=s.logits_processors)]
        assert plain == generate(exact_target, prog, other, 8, seed=4, **params)
        assert [st.position[0] for st in s.steps[:8]] == list(range(len(other), len(other) + 8))
    again = [int(t) for t, _, _ in speculative_generate_step(mx.array(PROMPT[:5]), exact_target, drafts["close"],
                                                             num_draft_tokens=2, max_tokens=6,
                                                             **s.speculative(PROMPT[:5]))]
    assert again == generate(exact_target, prog, PROMPT[:5], 6, seed=4, **params)


def test_speculative_request_follows_the_servers_conventions(target, exact_target, drafts, programs):
    """position = tokens generated so far, history = the last `context` tokens, logit_bias before the program."""
    from mlx_lm.models.cache import make_prompt_cache
    prog, bias, context = programs["penalties"], {7: 3.0, 9: -2.0, V + 50: 1.0}, 5
    cache, seq = make_prompt_cache(target), list(PROMPT)
    target(mx.array(seq[:-1])[None], cache=cache)
    logits = target(mx.array(seq[-1:])[None], cache=cache)[:, -1, :]
    expected = []
    for i in range(10):
        biased = logits.at[..., mx.array([7, 9])].add(mx.array([3.0, -2.0]))
        tok = int(prog(biased, seed=21, pos=i, h=np.array(seq[-context:], dtype=np.int32), t=0.9).token[0])
        expected.append(tok)
        seq.append(tok)
        logits = target(mx.array([tok])[None], cache=cache)[:, -1, :]
    from samplec.integrations.mlx_lm import speculative_request
    kw = speculative_request(prog, PROMPT, 21, params={"t": 0.9}, logit_bias=bias, context=context)
    got = [int(t) for t, _, _ in speculative_generate_step(mx.array(PROMPT), exact_target, drafts["close"],
                                                           num_draft_tokens=3, max_tokens=10, **kw)]
    assert got == expected
    assert [s.position[0] for s in kw["sampler"].steps[:10]] == list(range(10))
    # two histories (the server's chain, vLLM's): `context` cuts the sequence's, never the generated tokens'
    prog = programs["two_histories"]
    cache, seq, gen = make_prompt_cache(target), list(PROMPT), []
    target(mx.array(seq[:-1])[None], cache=cache)
    logits = target(mx.array(seq[-1:])[None], cache=cache)[:, -1, :]
    for i in range(10):
        tok = int(prog(logits, seed=21, pos=i, prompt_and_output=np.array(seq[-context:], dtype=np.int32),
                       output=np.array(gen, dtype=np.int32)).token[0])
        seq.append(tok)
        gen.append(tok)
        logits = target(mx.array([tok])[None], cache=cache)[:, -1, :]
    kw = speculative_request(prog, PROMPT, 21, context=context)
    got = [int(t) for t, _, _ in speculative_generate_step(mx.array(PROMPT), exact_target, drafts["close"],
                                                           num_draft_tokens=3, max_tokens=10, **kw)]
    assert got == gen


def test_one_program_call_per_target_pass(exact_target):
    """The k + 1 verified rows are one program call (a stateful program: one call per row, chained)."""
    for chain, rows_per_call in (("penalties", 4), ("mirostat", 1)):
        prog = samplec.compile(CHAINS[chain][0])
        widths, queue = [], prog.queue

        def counting(logits, queue=queue, widths=widths, **params):
            widths.append(logits.shape[0])
            return queue(logits, **params)
        prog.queue = counting
        stats = {}
        generate(exact_target, prog, PROMPT, 12, seed=1, draft_model=exact_target, num_draft=3, stats=stats)
        assert stats["target_forwards"] == 3 and stats["draft_forwards"] == 9
        if rows_per_call == 4:
            assert sorted(widths) == [1] * 9 + [4] * 3
        else:
            assert widths == [1] * (9 + 12)
