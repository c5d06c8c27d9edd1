"""What the parity suite shares (tests/parity/): test logits, running one samplec stage, boundary margins.

Each parity test runs ONE samplec program per stage over a batch of rows. Every row has its own parameter value
(sampler parameters take one value per row), so a whole parameter sweep is a single call. The final logits `x`
come back through `candidates(V)` (every token, removed ones as -inf). From them the tests compare the kept set
and the surviving logits. The distribution comes back through `probs`.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import samplec

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import reference as R  # noqa: E402  (tests/reference.py, the numpy oracle of the spec)

F32 = np.float32
V = 32000
EXAMPLE_LOGITS = np.load(ROOT / "examples" / "logits.npy")
EXAMPLE_HISTORY = np.load(ROOT / "examples" / "history.npy")


def peer(module: str):
    """Import a peer library a parity suite compares with. Without it the suite's tests skip -- except under
    SAMPLEC_REQUIRE_PARITY=1 (what `.ci/run` sets, having installed every peer), where a missing peer is an error,
    so that CI cannot pass with a parity suite that never ran."""
    if os.environ.get("SAMPLEC_REQUIRE_PARITY", "").strip() == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)


def tie_free(row: np.ndarray) -> np.ndarray:
    """The row with every duplicate value moved up to the next distinct float32 (order otherwise unchanged)."""
    row = np.asarray(row, F32).copy()
    order = np.argsort(row, kind="stable")
    s = row[order]
    for i in range(1, s.shape[0]):
        if s[i] <= s[i - 1]:
            s[i] = np.nextafter(s[i - 1], F32(np.inf))
    row[order] = s
    assert np.unique(row).shape[0] == row.shape[0]
    return row


@functools.lru_cache(maxsize=1)
def logit_rows() -> tuple[np.ndarray, tuple[str, ...]]:
    """Tie-free float32 test rows [N, V]: the two example rows (a real model's logits) and synthetic ones with
    different shapes: a wide normal, a peaked row (one dominant token), a sharp row, and a flat row."""
    rng = np.random.default_rng(20240611)
    rows, names = [], []
    for i, r in enumerate(EXAMPLE_LOGITS):
        rows.append(tie_free(r))
        names.append(f"example{i}")
    normal = rng.normal(0.0, 2.0, V)
    peaked = rng.normal(0.0, 1.0, V)
    peaked[rng.integers(V)] += 9.0
    sharp = rng.normal(0.0, 4.0, V)
    flat = rng.normal(0.0, 0.3, V)
    for name, r in (("normal", normal), ("peaked", peaked), ("sharp", sharp), ("flat", flat)):
        rows.append(tie_free(r.astype(F32)))
        names.append(name)
    return np.stack(rows).astype(F32), tuple(names)


@functools.lru_cache(maxsize=None)
def program(source: str) -> samplec.Program:
    return samplec.compile(source)


def run_stages(decls: str, body: str, logits: np.ndarray, **params) -> tuple[np.ndarray, np.ndarray]:
    """Compile `sampler s(DECLS) -> probs, candidates(V) { BODY }` once and run it on `logits` [N, V].

    Returns (x, probs): the final logits [N, V] (removed = -inf) and samplec's final distribution [N, V].
    """
    n, v = logits.shape
    src = f"sampler s({decls}) -> probs, candidates({v}) {{ {body} }}"
    out = program(src)(np.ascontiguousarray(logits, F32), **params)
    ids = np.array(out.candidates.ids)
    vals = np.array(out.candidates.values)
    x = np.full((n, v), -np.inf, F32)
    np.put_along_axis(x, ids.astype(np.int64), vals, axis=1)
    return x, np.array(out.probs)


def sweep(rows: np.ndarray, values) -> tuple[np.ndarray, np.ndarray]:
    """Every row with every value: (logits [len(values) * N, V], per-row values)."""
    values = list(values)
    batch = np.concatenate([rows] * len(values), axis=0)
    per_row = np.repeat(np.asarray(values), rows.shape[0])
    return batch, per_row


def kept(x: np.ndarray) -> np.ndarray:
    return np.isfinite(x)


def diff_ids(a: np.ndarray, b: np.ndarray) -> str:
    """A short description of where two kept masks differ (for assertion messages)."""
    only_a, only_b = np.flatnonzero(a & ~b), np.flatnonzero(b & ~a)
    return (f"only in first: {only_a[:10].tolist()} ({only_a.size}), "
            f"only in second: {only_b[:10].tolist()} ({only_b.size})")


def assert_kept_equal(ours: np.ndarray, theirs: np.ndarray, label, ignore: np.ndarray | None = None,
                      values_too: bool = True) -> None:
    """Same kept set (outside `ignore`), and the same surviving logits (rtol 1e-6)."""
    a, b = kept(ours), kept(theirs)
    if ignore is not None:
        a, b = a & ~ignore, b & ~ignore
    assert np.array_equal(a, b), f"{label}: kept sets differ ({diff_ids(a, b)})"
    if values_too:
        np.testing.assert_allclose(ours[a], theirs[a], rtol=1e-6, atol=1e-6, err_msg=str(label))


# ---------------------------------------------------------------------------------------- boundary margins
# Two correct implementations of the same rule can disagree about a token sitting within float rounding of the
# cut (float32 cumulative sums in a different order, probabilities vs logits). For cuts on a logit or a
# probability (min_p, top_n_sigma, xtc) the tests move the parameter until no token is within `tol` of the cut
# and then demand exact equality. For cuts on a cumulative mass (top_p, typical_p), where tokens of 3e-5 each
# may sit closer together than the rounding of the sum, the tests exclude the few tokens near the cut
# (`near_cut_*`) and demand equality everywhere else.


def mass_above(row: np.ndarray) -> np.ndarray:
    """S_i = total probability of the tokens more probable than i (float64)."""
    p = R.softmax64(row)
    order = np.argsort(-p, kind="stable")
    excl = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
    s = np.empty_like(p)
    s[order] = excl
    return s


def near_cut_top_p(row: np.ndarray, p: float, tol: float = 1e-4) -> np.ndarray:
    """Tokens whose S_i lies within tol of p: top_p (keep S_i < p) may decide them either way under float32
    rounding of a cumulative sum over thousands of tokens."""
    return np.abs(mass_above(row) - p) < tol


def clear_min_p(row: np.ndarray, m: float, tol: float = 1e-4) -> float:
    """m nudged up until no logit lies within tol of max + ln m."""
    x = row.astype(np.float64)
    while np.any(np.abs(x - (x.max() + np.log(m))) < tol) and m < 1.0:
        m *= 1.0 + 2 * tol
    return min(m, 1.0)


def clear_top_n_sigma(row: np.ndarray, n: float, tol: float = 1e-4) -> float:
    x = row[np.isfinite(row)].astype(np.float64)
    sd = x.std()
    while np.any(np.abs(x - (x.max() - n * sd)) < tol):
        n += 3 * tol / max(sd, 1e-6)
    return n


def typical_scores(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(s_i, p_i) of locally typical sampling in float64."""
    lp = R.log_softmax64(row)
    p = np.exp(lp)
    h = -np.sum(np.where(p > 0, p * lp, 0.0))
    return np.abs(-lp - h), p


def near_cut_typical(row: np.ndarray, m: float, tol: float = 1e-4) -> np.ndarray:
    """Tokens float rounding may put on either side of typical_p's cut: those whose exclusive cumulative mass
    (ascending s) lies within tol of m, and those whose score s_i lies within tol of the score at the cut. (A
    likely and an unlikely token can have nearly equal s, one on each side of the entropy. Then the float32
    order of the two decides which one the cumulative sum reaches first.)"""
    s, p = typical_scores(row)
    order = np.argsort(s, kind="stable")
    cs = np.cumsum(p[order])
    excl = np.concatenate([[0.0], cs[:-1]])
    near = np.zeros(row.shape[0], bool)
    near[order] = np.abs(excl - m) < tol
    hit = np.flatnonzero(cs >= m)
    s_star = s[order][hit[0]] if hit.size else s[order][-1]
    return near | (np.abs(s - s_star) < tol)
