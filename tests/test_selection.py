"""The sort-free selections every device runs (samplec/backend_mlx/kernels.py): `kth_largest` (a selection by
count), `mass_threshold` (a selection by mass: top_p's floor, typical_p's cutoff) and `topk_ids` (top_logprobs'
and candidates' ids), each against an independent numpy definition on rows that make selection hard: ties at
every rank, -inf-heavy rows, -0.0 beside 0.0, flat rows, one finite entry, V = 1, per-row parameters."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import samplec
from samplec.backend_mlx.kernels import KERNELS

F32 = np.float32


def row_family(kind: str, V: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "ties":
        x = rng.integers(-2, 3, V).astype(F32)
    elif kind == "neg_inf":
        x = rng.standard_normal(V).astype(F32)
        x[rng.random(V) < 0.9] = -np.inf
        x[rng.integers(V)] = 0.0
    elif kind == "zeros":                                   # -0.0 and 0.0 are equal values
        x = rng.choice(np.array([-0.0, 0.0, 1.0, -1.0], F32), V)
    elif kind == "flat":
        x = np.full(V, 0.5, F32)
    elif kind == "one_finite":
        x = np.full(V, -np.inf, F32)
        x[rng.integers(V)] = 3.0
    else:
        x = (rng.standard_normal(V) * 4).astype(F32)
    return x


FAMILIES = ("ties", "neg_inf", "zeros", "flat", "one_finite", "normal")


@st.composite
def rows(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    V = draw(st.sampled_from([1, 2, 3, 17, 300, 5000]))
    B = draw(st.integers(1, 4))
    return rng, np.stack([row_family(draw(st.sampled_from(FAMILIES)), V, rng) for _ in range(B)])


@settings(max_examples=80, deadline=None, derandomize=True)
@given(rows())
def test_kth_largest_is_the_kth_of_the_sorted_row(case):
    rng, x = case
    B, V = x.shape
    k = rng.integers(-1, V + 3, B).astype(np.int32)
    got = np.array(KERNELS["kth_largest"]([mx.array(x), mx.array(k[:, None])], {}))[:, 0]
    for r in range(B):
        want = np.sort(x[r])[::-1][min(max(k[r], 1), V) - 1]
        assert got[r] == want, (x[r], k[r])


def mass_threshold_reference(key: np.ndarray, w: np.ndarray, target: float) -> float:
    """The largest value t of the row with sum(w[key >= t]) >= target (float64 sums, for sums far from the
    target), -inf if none."""
    best = -np.inf
    for t in np.unique(key):
        if w[key >= t].astype(np.float64).sum() >= target:
            best = max(best, t)
    return best


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rows(), st.sampled_from([0.0, 0.1, 0.5, 0.9, 0.999, 1.0, 2.0]))
def test_mass_threshold_is_the_largest_value_whose_upper_set_holds_the_target(case, target):
    rng, x = case
    B, V = x.shape
    if V > 300:
        x = x[:, :300]
    w = rng.random(x.shape).astype(F32)
    w /= w.sum(axis=-1, keepdims=True)
    got = np.array(KERNELS["mass_threshold"]([mx.array(x), mx.array(w), mx.array(F32(target))], {}))[:, 0]
    for r in range(B):
        want = mass_threshold_reference(x[r], w[r], target)
        # a sum within float32 rounding of the target may fall either way: only clear cases are compared
        sums = sorted(w[r][x[r] >= t].astype(np.float64).sum() for t in np.unique(x[r]))
        if any(abs(s - target) < 1e-5 for s in sums):
            continue
        assert got[r] == want, (x[r], w[r], target)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rows(), st.sampled_from([2, 3, 4, 5]), st.sampled_from([0.0, 0.3, 0.9, 0.999, 1.0, 2.0]))
def test_selection_rounds_of_any_width_give_the_same_threshold(case, bits, target):
    """A GPU decides several key bits per round (2**bits - 1 candidates compared at once): by count and by mass,
    the threshold is the one-bit rounds' bit for bit -- each candidate's reduction is the same as alone."""
    from samplec.backend_mlx.kernels import _lift, _ordered, _reduce_sum, _select
    rng, x = case
    B, V = x.shape
    keys = _ordered(mx.array(x))
    w = mx.array((rng.random(x.shape) * (rng.random(x.shape) < 0.7)).astype(F32))
    w = w / mx.maximum(mx.sum(w, axis=-1, keepdims=True), 1e-30)
    t = _lift(mx.array(np.full((B, 1), target, F32)))
    want = _lift(mx.array(rng.integers(1, V + 1, (B, 1)).astype(np.int32)))

    def by_mass(above):
        return _reduce_sum([mx.where(above, _lift(w), 0.0)], {}) >= t

    def by_count(above):
        return mx.sum(above, axis=-1, keepdims=True) >= want

    for reaches in (by_mass, by_count):
        one, wide = (np.array(_select(keys, reaches, bits=b)).view(np.uint32) for b in (1, bits))
        assert np.array_equal(one, wide), (reaches.__name__, x, bits)


def test_selection_round_widths(monkeypatch):
    """One bit a round on the CPU; on a GPU as many as keep a round within 16 MiB (docs/compiler.md's widths)."""
    from samplec.backend_mlx import kernels
    keys = {B: mx.zeros((B, 152064), dtype=mx.uint32) for B in (1, 2, 3, 4, 9, 10, 64)}
    assert {kernels._select_bits(k) for k in keys.values()} == {1}
    monkeypatch.setattr(kernels.mx, "default_device", lambda: mx.gpu)
    assert {B: kernels._select_bits(k) for B, k in keys.items()} == {1: 4, 2: 3, 3: 3, 4: 2, 9: 2, 10: 1, 64: 1}


def test_mass_threshold_keeps_the_top_for_a_zero_target_and_finds_nothing_past_the_total():
    x = mx.array(np.array([[1.0, 3.0, 2.0, -np.inf]], F32))
    w = mx.array(np.array([[0.2, 0.5, 0.3, 0.0]], F32))
    assert np.array(KERNELS["mass_threshold"]([x, w, mx.array(F32(0.0))], {})).item() == 3.0
    assert np.array(KERNELS["mass_threshold"]([x, w, mx.array(F32(0.6))], {})).item() == 2.0
    assert np.array(KERNELS["mass_threshold"]([x, w, mx.array(F32(1.5))], {})).item() == -np.inf


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rows(), st.integers(1, 8))
def test_topk_ids_is_a_stable_descending_ranking(case, k):
    rng, x = case
    B, V = x.shape
    k = min(k, V)
    got = np.array(KERNELS["topk_ids"]([mx.array(x)], {"k": k}))
    for r in range(B):
        want = np.argsort(-x[r], kind="stable")[:k]       # equal values: lower id first (-0.0 == 0.0)
        assert got[r].tolist() == want.tolist(), x[r]


CHAINS = [
    "temperature(t) top_k(k) top_p(p) min_p(m) sample(seed)",
    "top_k(k) top_p(p) min_p(m) temperature(t) sample(seed)",
    "penalties(h, repeat = 1.1) logit_bias(b) allow(a) top_n_sigma(n) top_p(p) greedy()",
    "top_p(0.9) top_k(40) typical_p(p) temperature(0.7) sample(seed)",
    "top_k(20) temperature(t) sample(seed)",
]


@pytest.mark.parametrize("body", CHAINS)
@pytest.mark.parametrize("opt", [1, 2])
def test_no_vocabulary_sort_in_O1_and_O2_programs(body, opt):
    """No sort or argsort in an -O1 or -O2 program made of these stages, with literal or run-time parameters;
    its kernels select by count and by mass (kth_largest, mass_threshold)."""
    src = ("sampler s(t: float, k: int, p: float, m: float, n: float, seed: seed, h: tokens, b: bias, a: mask) "
           "-> token, logprob, top_logprobs(5) { " + body + " }")
    ops = {n.op for n in samplec.compile(src, opt_level=opt).graph.toposort()}
    assert not ops & {"sort", "argsort"}, ops
