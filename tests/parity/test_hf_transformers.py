"""Parity with Hugging Face transformers' logits processors (TemperatureLogitsWarper, TopK, TopP, MinP, Typical,
RepetitionPenalty, Epsilon, Eta) on the same logits.

Where the semantics are the same, the final distributions agree: equal kept sets and probabilities within 1e-6.
Where they differ, the difference is written down in docs/parity.md, and a test here shows exactly that
difference and nothing more:
  - TopP keeps a token when its ascending cumulative probability is > 1 - top_p. This is samplec's rule
    (S_i < p) up to float rounding. At a tie on the cut, HF keeps only the tied tokens its sort happens to reach;
    samplec keeps the whole tie. top_p = 0 keeps the argmax in HF and is an error in samplec.
  - min_tokens_to_keep (HF) has no samplec parameter: HF's set is samplec's set plus the top min_tokens_to_keep.
  - Typical keeps the most *typical* token; samplec keeps the most likely token as well.
  - TopK with top_k = 0 is an error in HF and "off" in samplec. Ties at the k-th value are kept by both.
  - RepetitionPenalty looks at all of `input_ids` and has no window or padding; samplec's `last_n` and
    negative (padding) history entries express a window and a shorter history.
  - Epsilon/Eta: the same kept set (p_i >= the cut, and the argmax) with min_tokens_to_keep = 1, HF's only
    behaviour samplec has; e = 0 is off in samplec and an error in HF.

Needs `pip install -e ".[parity]"` (torch==2.13.0 CPU and a pinned transformers). Skipped without them, an
error under SAMPLEC_REQUIRE_PARITY=1 (CI).
"""
from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from parity_common import peer

torch = peer("torch")
transformers = peer("transformers")

from transformers import (  # noqa: E402
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

import samplec  # noqa: E402
from parity_common import (  # noqa: E402
    EXAMPLE_HISTORY,
    ROOT,
    V,
    R,
    assert_kept_equal,
    clear_min_p,
    kept,
    logit_rows,
    near_cut_top_p,
    near_cut_typical,
    run_stages,
    sweep,
)

F32 = np.float32


def hf(processor, rows: np.ndarray, input_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Run an HF processor (or LogitsProcessorList) on rows [N, V]. Returns (scores, softmax(scores))."""
    scores = torch.from_numpy(np.array(rows, F32, copy=True))
    ids = torch.zeros((rows.shape[0], 0), dtype=torch.long) if input_ids is None else torch.from_numpy(
        np.asarray(input_ids, np.int64))
    with torch.no_grad():
        out = processor(ids, scores)
        probs = torch.softmax(out, dim=-1)
    return out.numpy(), probs.numpy()


def hf_blocks(make, values, rows: np.ndarray, batch: np.ndarray, input_ids=None):
    """Apply make(value) to each block of `batch` (the layout of parity_common.sweep: one block of rows per value)."""
    n = rows.shape[0]
    xs, ps = [], []
    for j, v in enumerate(values):
        ids = None if input_ids is None else input_ids[j * n:(j + 1) * n]
        x, p = hf(make(v), batch[j * n:(j + 1) * n], ids)
        xs.append(x)
        ps.append(p)
    return np.concatenate(xs), np.concatenate(ps)


def labels_for(values, names):
    return [f"{n} @ {v}" for v in values for n in names]


class Case:
    """One stage sweep: samplec's and HF's final logits and probabilities for the same rows."""

    def __init__(self, ours, ours_p, theirs, theirs_p, labels, ignore=None):
        self.ours, self.ours_p, self.theirs, self.theirs_p = ours, ours_p, theirs, theirs_p
        self.labels = list(labels)
        self.ignore = ignore

    def assert_same_kept(self) -> None:
        """Kept sets equal (outside `ignore`: tokens float rounding may put on either side of a cut), and equal
        surviving logits."""
        for i, label in enumerate(self.labels):
            assert_kept_equal(self.ours[i], self.theirs[i], label, None if self.ignore is None else self.ignore[i])

    def assert_same_distribution(self) -> int:
        """Where the kept sets are fully equal, samplec's `probs` lie within 1e-6 of the exact distribution HF
        defines (softmax of HF's processed scores in float64), and within 1e-5 of HF's own float32 softmax.
        (Comparing the two float32 outputs at 1e-6 would test torch's rounding: on the sharpest row HF's
        float32 softmax is itself 4e-6 from the exact values.) Returns how many rows were compared."""
        n = 0
        for i, label in enumerate(self.labels):
            if not np.array_equal(kept(self.ours[i]), kept(self.theirs[i])):
                continue
            n += 1
            exact = R.softmax64(self.theirs[i])
            np.testing.assert_allclose(self.ours_p[i], exact, atol=1e-6, rtol=0,
                                       err_msg=f"{label}: samplec probs vs exact HF distribution")
            np.testing.assert_allclose(self.ours_p[i], self.theirs_p[i], atol=1e-5, rtol=0,
                                       err_msg=f"{label}: samplec probs vs HF float32 probs")
        return n


# ---------------------------------------------------------------------------------------------- stage sweeps
# Each sweep runs once (cached). test_<stage> checks its kept sets; test_final_distribution[<stage>] checks its
# probabilities.

CASES = {}


def case(fn):
    CASES[fn.__name__] = functools.lru_cache(maxsize=None)(fn)
    return CASES[fn.__name__]


@case
def temperature() -> Case:
    rows, names = logit_rows()
    values = [0.25, 0.7, 1.0, 1.5, 3.0]
    batch, t = sweep(rows, values)
    ours, ours_p = run_stages("t: float", "temperature(t)", batch, t=t)
    theirs, theirs_p = hf_blocks(lambda v: TemperatureLogitsWarper(float(v)), values, rows, batch)
    return Case(ours, ours_p, theirs, theirs_p, labels_for(values, names))


@case
def top_k() -> Case:
    rows, names = logit_rows()
    values = [1, 2, 10, 40, 50, 1000, V - 1, V, V + 5]
    batch, k = sweep(rows, values)
    ours, ours_p = run_stages("k: int", "top_k(k)", batch, k=k)
    theirs, theirs_p = hf_blocks(lambda v: TopKLogitsWarper(int(v)), values, rows, batch)
    return Case(ours, ours_p, theirs, theirs_p, labels_for(values, names))


@case
def top_k_ties() -> Case:
    """Integer logits: heavy ties at the k-th value."""
    rng = np.random.default_rng(1)
    rows = rng.integers(-4, 5, (3, 1000)).astype(F32)
    values = [1, 3, 10, 100]
    batch, k = sweep(rows, values)
    ours, ours_p = run_stages("k: int", "top_k(k)", batch, k=k)
    theirs, theirs_p = hf_blocks(lambda v: TopKLogitsWarper(int(v)), values, rows, batch)
    c = Case(ours, ours_p, theirs, theirs_p, labels_for(values, range(3)))
    c.k = k
    return c


@case
def top_p() -> Case:
    rows, names = logit_rows()
    values = [0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0]
    batch, p = sweep(rows, values)
    ours, ours_p = run_stages("p: float", "top_p(p)", batch, p=p)
    theirs, theirs_p = hf_blocks(lambda v: TopPLogitsWarper(float(v)), values, rows, batch)
    near = np.stack([near_cut_top_p(batch[i], float(p[i])) for i in range(len(p))])
    return Case(ours, ours_p, theirs, theirs_p, labels_for(values, names), near)


@case
def min_p() -> Case:
    rows, names = logit_rows()
    values = [0.0, 0.01, 0.05, 0.1, 0.3, 0.9, 1.0]
    batch, m = sweep(rows, values)
    m = np.array([clear_min_p(batch[i], float(m[i])) if m[i] > 0 else 0.0 for i in range(len(m))])
    ours, ours_p = run_stages("m: float", "min_p(m)", batch, m=m)
    # HF takes one min_p per processor: run it row by row with the (nudged) per-row value.
    theirs, theirs_p = zip(*(hf(MinPLogitsWarper(float(m[i])), batch[i:i + 1]) for i in range(len(m))))
    return Case(ours, ours_p, np.concatenate(theirs), np.concatenate(theirs_p), labels_for(values, names))


@case
def typical_p() -> Case:
    """HF's result with the argmax put back (the documented difference), so that the sets can be compared."""
    rows, names = logit_rows()
    values = [0.2, 0.5, 0.9, 0.95, 0.99]
    batch, m = sweep(rows, values)
    ours, ours_p = run_stages("m: float", "typical_p(m)", batch, m=m)
    theirs, theirs_p = hf_blocks(lambda v: TypicalLogitsWarper(float(v)), values, rows, batch)
    near = np.stack([near_cut_typical(batch[i], float(m[i])) for i in range(len(m))])
    dropped_top = 0
    for i in range(len(m)):
        top = int(np.argmax(batch[i]))
        near[i, top] = False
        if not kept(theirs[i])[top]:
            dropped_top += 1
            theirs[i, top] = batch[i, top]
            theirs_p[i] = R.softmax64(theirs[i]).astype(F32)  # HF's distribution over its set + the argmax
    c = Case(ours, ours_p, theirs, theirs_p, labels_for(values, names), near)
    c.dropped_top = dropped_top
    return c


def _input_ids(rows: np.ndarray) -> np.ndarray:
    """Histories that repeat some of each row's likely tokens, so the penalty reaches tokens that matter."""
    rng = np.random.default_rng(11)
    h = np.empty((rows.shape[0], 64), np.int64)
    for i, row in enumerate(rows):
        h[i] = EXAMPLE_HISTORY[i % 2]
        h[i, rng.choice(64, 20, replace=False)] = rng.choice(np.argsort(-row)[:10], 20)
    return h


@case
def repetition_penalty() -> Case:
    """HF's RepetitionPenaltyLogitsProcessor == penalties(input_ids, repeat = r) over the whole history."""
    rows, names = logit_rows()
    values = [1.1, 1.3, 0.8, 2.0, 1.0]
    batch, r = sweep(rows, values)
    ids = np.concatenate([_input_ids(rows)] * len(values))
    ours, ours_p = run_stages("h: tokens, r: float", "penalties(h, repeat = r)", batch, h=ids.astype(np.int32), r=r)
    theirs, theirs_p = hf_blocks(lambda v: RepetitionPenaltyLogitsProcessor(float(v)), values, rows, batch, ids)
    return Case(ours, ours_p, theirs, theirs_p, labels_for(values, names))


def near_cut_probability(row: np.ndarray, cut: float, tol: float = 1e-4) -> np.ndarray:
    """Tokens whose probability lies within tol (relative) of an absolute cut: HF's float32 softmax and samplec's
    kernel may put them on either side."""
    return np.abs(R.softmax64(row) - cut) < tol * cut


def eta_cut(row: np.ndarray, e: float) -> float:
    """EtaLogitsWarper's cut in float64: min(e, sqrt(e) * exp(-H))."""
    lp = R.log_softmax64(row)
    return float(min(e, np.sqrt(e) * np.exp(np.sum(np.exp(lp) * lp))))


@case
def epsilon() -> Case:
    """samplec's epsilon(e) against EpsilonLogitsWarper(e): keep p_i >= e, and the argmax (min_tokens_to_keep = 1).
    Each row has its own e; HF takes one per processor, so it runs block by block."""
    rows, names = logit_rows()
    values = [1e-5, 1e-4, 3e-4, 1e-3, 0.05, 0.9]
    batch, e = sweep(rows, values)
    ours, ours_p = run_stages("e: float", "epsilon(e)", batch, e=e)
    theirs, theirs_p = hf_blocks(lambda v: EpsilonLogitsWarper(float(v)), values, rows, batch)
    near = np.stack([near_cut_probability(batch[i], float(e[i])) for i in range(len(e))])
    return Case(ours, ours_p, theirs, theirs_p, labels_for(values, names), near)


@case
def eta() -> Case:
    """samplec's eta(e) against EtaLogitsWarper(e): keep p_i >= min(e, sqrt(e) * exp(-H)), and the argmax."""
    rows, names = logit_rows()
    values = [1e-4, 1e-3, 0.01, 0.1, 0.5]
    batch, e = sweep(rows, values)
    ours, ours_p = run_stages("e: float", "eta(e)", batch, e=e)
    theirs, theirs_p = hf_blocks(lambda v: EtaLogitsWarper(float(v)), values, rows, batch)
    near = np.stack([near_cut_probability(batch[i], eta_cut(batch[i], float(e[i]))) for i in range(len(e))])
    return Case(ours, ours_p, theirs, theirs_p, labels_for(values, names), near)


def assert_cuts_bite(c: Case) -> None:
    """The sweep is not vacuous: most rows lose tokens, some keep only the argmax, and float rounding leaves
    only a handful of tokens near the cut (ignored by the comparison)."""
    n_kept = np.array([kept(c.theirs[i]).sum() for i in range(len(c.labels))])
    assert (n_kept < V).mean() > 0.8 and (n_kept == 1).any() and (n_kept > 1).any(), n_kept
    assert c.ignore.sum() <= len(c.labels), c.ignore.sum()


# ---------------------------------------------------------------------------------------------- kept sets


def test_temperature():
    temperature().assert_same_kept()


def test_top_k():
    top_k().assert_same_kept()


def test_top_k_ties_are_kept_by_both():
    """HF removes `scores < kth value`, so ties at the k-th value survive, as in samplec (spec §2)."""
    c = top_k_ties()
    c.assert_same_kept()
    assert all(kept(c.ours[i]).sum() > c.k[i] for i in range(len(c.k)))  # the ties really were kept


def test_top_p():
    c = top_p()
    c.assert_same_kept()
    full = sum(np.array_equal(kept(c.ours[i]), kept(c.theirs[i])) for i in range(len(c.labels)))
    assert full >= 0.75 * len(c.labels)  # float rounding at the cut changes a token only now and then


def test_min_p():
    min_p().assert_same_kept()


def test_typical_p():
    """Same kept set, except that samplec always keeps the most likely token as well: ours == HF's + argmax,
    outside the few tokens float rounding may put on either side of the cut. On real logits the argmax is
    usually NOT locally typical: HF drops it in most of these cases."""
    c = typical_p()
    c.assert_same_kept()
    assert c.dropped_top >= 5


def test_repetition_penalty():
    c = repetition_penalty()
    c.assert_same_kept()
    assert not np.array_equal(c.ours, np.concatenate([logit_rows()[0]] * 5))


def test_epsilon():
    c = epsilon()
    c.assert_same_kept()
    assert_cuts_bite(c)


def test_eta():
    c = eta()
    c.assert_same_kept()
    assert_cuts_bite(c)


@pytest.mark.parametrize("name", sorted(CASES))
def test_final_distribution(name):
    """Probabilities within 1e-6 of the exact distribution HF defines, wherever the kept sets are equal."""
    assert CASES[name]().assert_same_distribution() >= 1


# ---------------------------------------------------------------------------------------------- differences


def test_temperature_zero():
    """HF rejects temperature 0 ("use do_sample=False"). samplec's temperature(0) keeps only the argmax, which
    is what greedy decoding samples from."""
    with pytest.raises(ValueError):
        TemperatureLogitsWarper(0.0)
    rows, _ = logit_rows()
    ours, _ = run_stages("t: float", "temperature(t)", rows, t=0.0)
    for i, row in enumerate(rows):
        assert np.flatnonzero(kept(ours[i])).tolist() == [int(torch.argmax(torch.from_numpy(row)))]


def test_top_k_zero():
    """top_k = 0: an error in HF's warper (generate() skips the warper instead); samplec's top_k(0) is off."""
    with pytest.raises(ValueError):
        TopKLogitsWarper(0)
    rows, _ = logit_rows()
    ours, _ = run_stages("k: int", "top_k(k)", rows, k=0)
    assert kept(ours).all()


def _tied_cut_row() -> tuple[np.ndarray, float]:
    """Token 0 with logit 2 and tokens 1..10 tied at logit 1 (and 89 tokens at -5). top_p = p lands inside the
    tie group: after token 0 (mass ~0.19) the group's tokens are worth ~0.07 each."""
    x = np.full(100, -5.0, F32)
    x[0] = 2.0
    x[1:11] = 1.0
    return x, 0.45


def test_top_p_tie_at_the_cut_differs():
    """Documented difference: at a tie on the cut, HF keeps the tied tokens its (unstable) sort reaches first,
    a subset of the tie. samplec keeps every token of the tie (spec §2: S_i counts only strictly more probable
    tokens, so the whole group has the same S_i)."""
    x, p = _tied_cut_row()
    ours, _ = run_stages("p: float", "top_p(p)", x[None, :], p=p)
    theirs, _ = hf(TopPLogitsWarper(p), x[None, :])
    a, b = kept(ours[0]), kept(theirs[0])
    assert np.flatnonzero(a).tolist() == list(range(11))  # token 0 and the whole tie
    assert b[0] and b.sum() < a.sum() and not (b & ~a).any()  # HF: token 0 and part of the tie
    assert set(np.flatnonzero(a & ~b)) <= set(range(1, 11))  # the difference is tied tokens only


def test_top_p_zero_and_min_tokens_to_keep():
    """top_p = 0: HF keeps the argmax (min_tokens_to_keep = 1). It is a compile-time error in samplec (p must be
    in (0, 1]); top_k(1) is the samplec way to say it.
    min_tokens_to_keep = n: HF keeps samplec's top_p set plus the n most likely tokens."""
    rows, names = logit_rows()
    theirs, _ = hf(TopPLogitsWarper(0.0), rows)
    ours_k1, _ = run_stages("k: int", "top_k(k)", rows, k=1)
    np.testing.assert_array_equal(kept(theirs), kept(ours_k1))
    with pytest.raises(samplec.SamplecError):
        samplec.compile("sampler s() -> probs { top_p(0.0) }")

    theirs, _ = hf(TopPLogitsWarper(0.3, min_tokens_to_keep=20), rows)
    ours_p, _ = run_stages("p: float", "top_p(p)", rows, p=0.3)
    ours_k, _ = run_stages("k: int", "top_k(k)", rows, k=20)
    for i, n in enumerate(names):
        union = np.where(kept(ours_p[i]) | kept(ours_k[i]), rows[i], -np.inf).astype(F32)
        assert_kept_equal(union, theirs[i], n, ignore=near_cut_top_p(rows[i], 0.3))


def test_typical_p_documented_difference():
    """HF's typical set can leave out the most likely token (one token with p = 0.4, 1000 with p = 0.0006).
    samplec adds it back (spec §2), and nothing else changes."""
    x = np.full(1001, np.log(0.6 / 1000), np.float64)
    x[0] = np.log(0.4)
    x = x.astype(F32) + np.linspace(0, 1e-3, 1001, dtype=F32)
    ours, _ = run_stages("m: float", "typical_p(m)", x[None, :], m=0.5)
    theirs, _ = hf(TypicalLogitsWarper(0.5), x[None, :])
    assert not kept(theirs[0])[0] and kept(ours[0])[0]
    expected = kept(theirs[0]).copy()
    expected[0] = True
    np.testing.assert_array_equal(kept(ours[0]), expected)


def test_repetition_penalty_window_padding_and_prompt_ignore():
    """HF has no window and no padding: samplec's last_n = n equals HF on input_ids[:, -n:]; padding entries
    (< 0) equal HF on the unpadded ids; HF's prompt_ignore_length = k equals samplec on input_ids[:, k:]."""
    rows, names = logit_rows()
    ids = _input_ids(rows)
    ours, _ = run_stages("h: tokens", "penalties(h, last_n = 16, repeat = 1.4)", rows, h=ids.astype(np.int32))
    theirs, _ = hf(RepetitionPenaltyLogitsProcessor(1.4), rows, ids[:, -16:])
    for i, n in enumerate(names):
        assert_kept_equal(ours[i], theirs[i], n)

    padded = ids.copy().astype(np.int32)
    padded[:, :24] = -1  # a history of 40 real tokens, left-padded to 64
    ours, _ = run_stages("h: tokens", "penalties(h, repeat = 1.4)", rows, h=padded)
    theirs, _ = hf(RepetitionPenaltyLogitsProcessor(1.4), rows, ids[:, 24:])
    for i, n in enumerate(names):
        assert_kept_equal(ours[i], theirs[i], n)

    theirs, _ = hf(RepetitionPenaltyLogitsProcessor(1.4, prompt_ignore_length=24), rows, ids)
    for i, n in enumerate(names):
        assert_kept_equal(ours[i], theirs[i], n)


def test_repetition_penalty_counts_once():
    """HF has no frequency/presence processor. Its repetition penalty ignores counts (a token seen five times
    is penalized as once), and so does samplec's `repeat`. `frequency` is the count-sensitive one (vLLM,
    OpenAI)."""
    rows, _ = logit_rows()
    once = np.full((rows.shape[0], 5), -1, np.int32)
    once[:, 0] = 7
    five = np.full((rows.shape[0], 5), 7, np.int32)
    a, _ = run_stages("h: tokens", "penalties(h, repeat = 1.5)", rows, h=once)
    b, _ = run_stages("h: tokens", "penalties(h, repeat = 1.5)", rows, h=five)
    theirs, _ = hf(RepetitionPenaltyLogitsProcessor(1.5), rows, five.astype(np.int64))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, theirs, rtol=1e-6)


# ---------------------------------------------------------------------------------------------- generate()


@functools.lru_cache(maxsize=None)
def _hf_generate_program() -> samplec.Program:
    src = (ROOT / "examples" / "hf_generate.smp").read_text(encoding="utf-8")
    src, n = re.subn(r"-> token, logprob, probs \{", f"-> token, logprob, probs, candidates({V}) {{", src, count=1)
    assert n == 1
    return samplec.compile(src, sampler="hf_generate")


def _hf_processors(c: dict) -> LogitsProcessorList:
    """The processors generate() builds for do_sample=True (GenerationMixin._get_logits_processor order)."""
    procs = []
    if c["repetition_penalty"] != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(c["repetition_penalty"]))
    if c["temperature"] != 1.0:
        procs.append(TemperatureLogitsWarper(c["temperature"]))
    if c["top_k"] != 0:
        procs.append(TopKLogitsWarper(c["top_k"]))
    if c["top_p"] < 1.0:
        procs.append(TopPLogitsWarper(c["top_p"]))
    if c["min_p"] > 0.0:
        procs.append(MinPLogitsWarper(c["min_p"]))
    if c["typical_p"] < 1.0:
        procs.append(TypicalLogitsWarper(c["typical_p"]))
    return LogitsProcessorList(procs)


GENERATE_CASES = [
    {},  # GenerationConfig defaults: temperature 1.0, top_k 50, top_p 1.0
    dict(repetition_penalty=1.2, temperature=0.7, top_k=100, top_p=0.9, min_p=0.02),
    dict(temperature=1.3, top_k=0, top_p=0.95, min_p=0.05),
    dict(repetition_penalty=1.1, top_k=500, typical_p=0.95),
]
HF_DEFAULTS = dict(repetition_penalty=1.0, temperature=1.0, top_k=50, top_p=1.0, min_p=0.0, typical_p=1.0)


@functools.lru_cache(maxsize=None)
def generate_case(case: int):
    rows, names = logit_rows()
    ids = _input_ids(rows)
    c = {**HF_DEFAULTS, **GENERATE_CASES[case]}
    out = _hf_generate_program()(rows, input_ids=ids.astype(np.int32), **c)
    ours = np.full(rows.shape, -np.inf, F32)
    np.put_along_axis(ours, np.array(out.candidates.ids).astype(np.int64), np.array(out.candidates.values), axis=1)
    theirs, theirs_p = hf(_hf_processors(c), rows, ids)
    if c["typical_p"] < 1.0:  # the documented typical difference: put HF's dropped argmax back
        for i in range(rows.shape[0]):
            top = int(np.argmax(ours[i]))
            if not kept(theirs[i])[top]:
                theirs[i, top] = ours[i, top]
                theirs_p[i] = R.softmax64(theirs[i]).astype(F32)
    labels = [f"{n} {c}" for n in names]
    return Case(ours, np.array(out.probs), theirs, theirs_p, labels), np.array(out.token)


@pytest.mark.parametrize("case", range(len(GENERATE_CASES)))
def test_generate_chain(case):
    """examples/hf_generate.smp keeps the same tokens as the processors generate() runs, in generate()'s
    order, and draws its token from them."""
    c, tokens = generate_case(case)
    c.assert_same_kept()
    assert all(kept(c.ours[i])[tokens[i]] for i in range(len(tokens)))


@pytest.mark.parametrize("case", range(len(GENERATE_CASES)))
def test_generate_chain_distribution(case):
    c, _ = generate_case(case)
    assert c.assert_same_distribution() == len(c.labels)


def test_generate_greedy():
    """do_sample=False: the token is torch.argmax of the processed scores (hf_greedy in the example)."""
    rows, _ = logit_rows()
    ids = _input_ids(rows)
    prog = samplec.compile_file(ROOT / "examples" / "hf_generate.smp", sampler="hf_greedy")
    for r in (1.0, 1.3):
        out = prog(rows, input_ids=ids.astype(np.int32), repetition_penalty=r)
        procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(r)] if r != 1.0 else [])
        theirs, _ = hf(procs, rows, ids)
        np.testing.assert_array_equal(np.array(out.token), np.argmax(theirs, axis=1))
