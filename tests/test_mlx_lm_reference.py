"""The adapter's tokens inside mlx-lm's own loops against an independent numpy computation of the spec.

Each step's logits are recorded as mlx-lm hands them over (a logits processor placed before the adapter's, which
sees the raw logits, and a wrapper around the sampler, which sees mlx-lm's log-probabilities). The expected token
is then computed here from those logits alone, in numpy, with the language's definitions (LANGUAGE.md sections 2
and 4): the stages in the program's order and a Gumbel-max draw whose noise is Threefry-2x32-20 at counter
(token id, position), position = the index of the token in the sequence. Nothing of samplec is used for the
expectation, so a wrong position, history, seed or order of rows in the adapter shows up as other tokens.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402

import samplec  # noqa: E402
from samplec.integrations.mlx_lm import Sampler, random_llama  # noqa: E402

M32 = 0xFFFFFFFF


def threefry(seed: int, c0: np.ndarray, c1: int) -> np.ndarray:
    """Threefry-2x32 with 20 rounds, key = (seed >> 32, seed & M32): the first output word for each counter."""
    rot = ((13, 15, 26, 6), (17, 29, 16, 24))
    k = [seed >> 32 & M32, seed & M32]
    k.append(k[0] ^ k[1] ^ 0x1BD11BDA)
    x0 = (np.asarray(c0, dtype=np.uint64) + k[0]) & M32
    x1 = (np.full_like(x0, c1) + k[1]) & M32
    for i in range(5):
        for r in rot[i % 2]:
            x0 = (x0 + x1) & M32
            x1 = (((x1 << r) | (x1 >> (32 - r))) & M32) ^ x0
        x0 = (x0 + k[(i + 1) % 3]) & M32
        x1 = (x1 + k[(i + 2) % 3] + i + 1) & M32
    return x0.astype(np.uint32)


def test_threefry_known_answers():
    assert int(threefry(0, np.array([0]), 0)[0]) == 0x6B200159
    assert int(threefry(2 ** 64 - 1, np.array([M32]), M32)[0]) == 0x1CB996FC


def gumbel(seed: int, position: int, V: int) -> np.ndarray:
    bits = threefry(seed, np.arange(V), position)
    u = ((bits >> 9).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -23)
    return -np.log(-np.log(u))


def expected_token(logits, *, seed, position, temperature=1.0, top_p=1.0, min_p=0.0, top_k=0, history=(),
                   repeat=1.0, last_n=-1, cut=None):
    """temperature, top_p, min_p, top_k (this order), then sample(seed, position): one row, numpy. With `history`,
    a repetition penalty first (`penalties(history, last_n, repeat)`). `cut`: a dict counting what each stage
    removed (to show the test exercises every stage)."""
    x = np.asarray(logits, dtype=np.float32).copy()
    if repeat != 1.0:
        window = list(history)[-last_n:] if last_n > 0 else list(history)
        for t in set(window):
            x[t] = x[t] / np.float32(repeat) if x[t] > 0 else x[t] * np.float32(repeat)
    x = x / np.float32(temperature)

    def keep(mask, name):
        mask = mask | (x == x.max())
        if cut is not None:
            cut[name] = cut.get(name, 0) + int((np.isfinite(x) & ~mask).sum())
        return np.where(mask, x, -np.inf).astype(np.float32)

    p = np.exp(x.astype(np.float64) - x.max())
    p /= p.sum()
    mass_above = np.array([p[p > q].sum() for q in p])
    x = keep(mass_above < top_p, "top_p")
    p = np.exp(x.astype(np.float64) - x.max())
    x = keep(p >= min_p * p.max(), "min_p")
    kth = np.sort(x)[::-1][top_k - 1] if 0 < top_k < x.size else -np.inf
    x = keep(x >= kth, "top_k")
    return int(np.argmax(x + gumbel(seed, position, x.size)))


CHAIN = ("sampler c(t: float, p: float, m: float, k: int, seed: seed, pos: int) -> token {"
         " temperature(t) top_p(p) min_p(m) top_k(k) sample(seed, position = pos) }")
VALUES = dict(t=0.9, p=0.9, m=0.05, k=30)
REFERENCE = dict(temperature=0.9, top_p=0.9, min_p=0.05, top_k=30)


@pytest.fixture(scope="module")
def model():
    return random_llama(3, layers=2, hidden=64, vocab=512)


class Recorder:
    """What mlx-lm hands the processors (sequence, raw logits) and the sampler (log-probabilities), per call."""

    def __init__(self, sampler):
        self.sampler, self.seen, self.logprobs = sampler, [], []

    def processor(self, tokens, logits):
        self.seen.append((np.array(tokens).reshape(-1).tolist(), np.array(logits.astype(mx.float32))))
        return logits

    def __call__(self, logprobs):
        self.logprobs.append(np.array(logprobs.astype(mx.float32)))
        return self.sampler(logprobs)


def test_generate_step_tokens_are_the_specs_draws(model):
    prompt = [5, 17, 300, 42, 7, 9]
    s = Sampler(samplec.compile(CHAIN), seed=11, **VALUES)
    rec = Recorder(s)
    toks = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=40, sampler=rec,
                                        logits_processors=[rec.processor, *s.logits_processors])]
    cut = {}
    for i, tok in enumerate(toks):
        seq, _ = rec.seen[i]
        assert seq == prompt + toks[:i]                    # the sequence mlx-lm hands: prompt and tokens so far
        want = expected_token(rec.logprobs[i][0], seed=11, position=len(prompt) + i, cut=cut, **REFERENCE)
        assert tok == want, i
    assert all(cut[name] > 0 for name in ("top_p", "min_p", "top_k")), cut


def test_a_penalty_reads_the_raw_logits_and_the_whole_sequence(model):
    """`penalties` is not shift-invariant: the expected token is computed from the raw logits (what the
    processor sees), with the history = prompt + generated tokens, in order."""
    prog = samplec.compile("sampler r(seed: seed, pos: int, h: tokens) -> token { penalties(h, last_n = 8, "
                           "repeat = 3.0) temperature(0.9) top_p(0.9) min_p(0.05) top_k(30) "
                           "sample(seed, position = pos) }")
    prompt = [5, 17, 300, 42, 7, 9, 5, 17]
    s = Sampler(prog, seed=4)
    rec = Recorder(s)
    toks = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=40, sampler=rec,
                                        logits_processors=[rec.processor, *s.logits_processors])]
    for i, tok in enumerate(toks):
        seq, raw = rec.seen[i]
        assert seq == prompt + toks[:i]
        assert tok == expected_token(raw[0], seed=4, position=len(seq), history=seq, repeat=3.0, last_n=8,
                                     **REFERENCE), i


def test_batch_generator_rows_are_the_specs_draws(model):
    """One Sampler for the batch (values one per row) and one Sampler per request: each row's token is the draw
    at that row's position with that row's seed, from that row's logits."""
    prompts = [[5, 17, 300, 42], [9, 9, 9, 9, 9, 9, 9], [100, 200]]
    seeds = [3, 8, 21]
    for shared in (True, False):
        rows: dict[int, list] = {}

        def record(uid):
            def processor(tokens, logits):
                rows.setdefault(uid, []).append((np.array(tokens).reshape(-1).tolist(),
                                                 np.array(logits.astype(mx.float32))[0]))
                return logits
            return processor
        if shared:
            s = Sampler(samplec.compile(CHAIN), seed=seeds, **VALUES)
            g = BatchGenerator(model, stop_tokens=[], sampler=s)
            samplers = None
        else:
            samplers = [Sampler(samplec.compile(CHAIN), seed=seed, **VALUES) for seed in seeds]
            g = BatchGenerator(model, stop_tokens=[])
        uids = list(range(len(prompts)))
        procs = [[record(u), *(s if shared else samplers[u]).logits_processors] for u in uids]
        assert g.insert(prompts, max_tokens=[16] * 3, samplers=samplers, logits_processors=procs) == uids
        out = {u: [] for u in uids}
        while responses := g.next_generated():
            for r in responses:
                out[r.uid].append(r.token)
        g.close()
        for u in uids:
            assert len(out[u]) == 16
            for i, tok in enumerate(out[u]):
                seq, raw = rows[u][i]
                assert seq == prompts[u] + out[u][:i]
                assert tok == expected_token(raw, seed=seeds[u], position=len(seq), **REFERENCE), (shared, u, i)


def batch_run(model, s, prompts: dict, plan: dict, processors) -> tuple[dict, dict]:
    """A BatchGenerator sampled by the shared Sampler `s`, the requests of `plan` ({step: [(name, max_tokens)]})
    inserted at their steps with `processors(name)` after a recorder, each released as it finishes: (what each
    request's processors saw -- its sequence and raw logits -- step by step, the tokens each got)."""
    g = BatchGenerator(model, stop_tokens=[], sampler=s)
    seen: dict[str, list] = {}

    def record(name):
        def processor(tokens, logits):
            seen.setdefault(name, []).append((np.array(tokens).reshape(-1).tolist(),
                                              np.array(logits.astype(mx.float32))[0]))
            return logits
        return processor
    names, out = {}, {}
    for step in range(40):
        for name, m in plan.get(step, ()):
            procs = [record(name), *processors(name)]
            names[g.insert([prompts[name]], max_tokens=[m], logits_processors=[procs])[0]] = name
        for r in g.next_generated():
            out.setdefault(names[r.uid], []).append(r.token)
            if r.finish_reason is not None:
                s.release(names[r.uid])
    g.close()
    return seen, out


def test_requests_that_join_and_leave_a_shared_samplers_batch_keep_their_steps(model):
    """One Sampler for a BatchGenerator whose requests join mid-run (mlx-lm samples a joining request's first
    step in a call of its own, after the running rows') and leave: every row's token is still the spec's draw at
    its position, and the steps keep accumulating -- each request's outputs (read by the key its processors were
    made for) are the tokens mlx-lm yielded for it, at its positions, those of the rows already running kept
    across every join."""
    prompts = {"A": [5, 17, 300, 42], "B": [9, 9, 9, 9, 9, 9, 9], "C": [100, 200], "D": [7, 8, 9]}
    plan = {0: [("A", 6), ("B", 14)], 3: [("C", 8)], 7: [("D", 10)]}     # step: (request, max_tokens) inserted
    s = Sampler(samplec.compile(CHAIN), seed=11, **VALUES)
    seen, out = batch_run(model, s, prompts, plan, s.logits_processors_for)
    s.check()
    for name, m in (x for at in plan.values() for x in at):
        assert len(out[name]) == m
        for i, tok in enumerate(out[name]):
            seq, raw = seen[name][i]
            assert seq == prompts[name] + out[name][:i]
            assert tok == expected_token(raw, seed=11, position=len(seq), **REFERENCE), (name, i)
        # (mlx-lm samples one token ahead: a request's last step is sampled, then dropped with the request)
        mine = [st for st in s.steps if name in st.rows]
        assert [st.position[st.rows.index(name)] for st in mine] == \
            list(range(len(prompts[name]), len(prompts[name]) + m + 1))
        assert s.output("token", row=name)[:m].tolist() == out[name]
    rows = [st.rows for st in s.steps]
    assert rows[0] == ("A", "B") and ("C",) in rows and ("D",) in rows          # (the joins: calls of their own)
    assert rows.index(("C",)) > rows.index(("A", "B")) + 2                     # (... mid-run, the steps kept)
    assert ("B", "C", "D") in rows and ("B", "D") in rows and rows[-1] == ("D",)   # (A, C, then B left)
    assert sum(map(len, rows)) == sum(m + 1 for at in plan.values() for _, m in at)   # (no row's step lost)


def test_a_shared_samplers_requests_give_their_own_values(model):
    """One Sampler for a BatchGenerator whose requests each give their own seed and sampling values
    (`logits_processors_for(key, seed=..., t=...)`, a server's per-request values), joining and leaving: every
    row's token is the spec's draw with its request's values, and a request without values of its own takes the
    Sampler's."""
    prompts = {"A": [5, 17, 300, 42], "B": [9, 9, 9, 9, 9, 9, 9], "C": [100, 200], "D": [7, 8, 9]}
    own = {"A": dict(seed=3, t=0.7, k=5), "B": dict(seed=2**64 - 5, p=0.5), "C": {}, "D": dict(seed=12, m=0.2)}
    plan = {0: [("A", 6), ("B", 14)], 2: [("C", 8)], 5: [("D", 10)]}
    s = Sampler(samplec.compile(CHAIN), seed=11, **VALUES)
    seen, out = batch_run(model, s, prompts, plan, lambda name: s.logits_processors_for(name, **own[name]))
    s.check()
    field = dict(t="temperature", p="top_p", m="min_p", k="top_k")
    for name, m in (x for at in plan.values() for x in at):
        values = {**REFERENCE, **{field[k]: v for k, v in own[name].items() if k != "seed"}}
        seed = own[name].get("seed", 11)
        assert len(out[name]) == m
        for i, tok in enumerate(out[name]):
            seq, raw = seen[name][i]
            assert tok == expected_token(raw, seed=seed, position=len(seq), **values), (name, i)
    assert s._values == {}      # (each released as it finished)
    with pytest.raises(samplec.SamplecError, match="request 'X': unknown parameter 'tempo'"):
        s.logits_processors_for("X", tempo=1.0)
    with pytest.raises(samplec.SamplecError, match=r"request 'X': t = -1 is out of range \[0, inf\]$"):
        s.logits_processors_for("X", t=-1.0)
    with pytest.raises(samplec.SamplecError, match="'pos' .* is not a value a request gives"):
        s.logits_processors_for("X", pos=3)
