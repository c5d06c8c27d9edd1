"""What tests/test_semantics.py shares: cached compilation, logit generators and reference comparisons.

Everything here compares samplec against the independent numpy oracle in tests/reference.py; nothing
compares samplec with itself (except the explicit -O0 / -O2 and batch-invariance properties).
"""
from __future__ import annotations

import functools

import numpy as np

import samplec

try:  # works whether or not tests/ is a package
    from . import reference as R
except ImportError:  # pragma: no cover
    import reference as R  # type: ignore[no-redef]

F32 = np.float32
NEG_INF = F32(-np.inf)

# A small set of shapes, reused everywhere (MLX retraces per input shape).
VS = (2, 7, 100, 1000)
B = 8


@functools.lru_cache(maxsize=None)
def prog(source: str, opt: int = 2, bindings: tuple = ()):
    """Compile once per (source text, opt level, bindings) and reuse."""
    return samplec.compile(source, opt_level=opt, bindings=dict(bindings) or None)


def np_(a) -> np.ndarray:
    return np.array(a)


# ---------------------------------------------------------------------------------------------- logits

ROW_KINDS = ("normal", "peaked", "flat", "int_ties", "neg_inf", "sharp", "int_ties_neg_inf", "near_flat")


def logit_row(kind: str, V: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "normal":
        x = rng.normal(0.0, 1.5, V)
    elif kind == "peaked":
        x = rng.normal(0.0, 1.0, V)
        x[rng.integers(V)] += 12.0
    elif kind == "flat":
        x = np.full(V, 0.37)
    elif kind == "int_ties":
        x = rng.integers(-3, 3, V).astype(np.float64)
    elif kind == "neg_inf":
        x = rng.normal(0.0, 2.0, V)
        drop = rng.random(V) < 0.4
        drop[rng.integers(V)] = False
        x[drop] = -np.inf
    elif kind == "sharp":
        x = rng.normal(0.0, 4.0, V)
    elif kind == "int_ties_neg_inf":
        x = rng.integers(-2, 2, V).astype(np.float64)
        drop = rng.random(V) < 0.5
        drop[rng.integers(V)] = False
        x[drop] = -np.inf
    elif kind == "near_flat":
        x = 3.0 + rng.normal(0.0, 0.05, V)
    else:  # pragma: no cover
        raise ValueError(kind)
    return x.astype(F32)


def mixed_logits(V: int, seed: int, kinds=ROW_KINDS) -> np.ndarray:
    """One row of each kind: random normal, peaked, flat, integer ties, -inf entries, ..."""
    rng = np.random.default_rng(seed)
    return np.stack([logit_row(k, V, rng) for k in kinds])


# ---------------------------------------------------------------------------------------------- comparisons


# Value tolerances. The contract asks for probabilities within 1e-6 and log-probabilities within 1e-5 of the
# exact values; test_normalizer_precision holds samplec to exactly that. Elsewhere the bound on probs has a
# relative term: samplec normalizes with MLX's float32 `sum`, which on CPU accumulates sequentially (relative
# error ~5e-6 at V = 1000, ~1e-4 at V = 32000), and one cause should fail one test, not a hundred.
P_ATOL, P_RTOL = 1e-6, 8e-6
LP_ATOL = 1e-5


def assert_probs_match(probs, ref_xs, atol=P_ATOL, rtol=P_RTOL, sum_tol=1e-5, ctx=""):
    """Exact kept set (probs > 0 <=> reference x > -inf) and probabilities within atol + rtol * p.

    Tokens whose reference probability is positive but below 1e-30 (float32 underflow territory after a
    small temperature) are exempt from the kept-set check, nothing else is.
    """
    probs = np.asarray(probs)
    assert probs.shape == (len(ref_xs), len(ref_xs[0])), (probs.shape, ctx)
    assert probs.dtype == np.float32, (probs.dtype, ctx)
    for r, x in enumerate(ref_xs):
        x = np.asarray(x, dtype=F32)
        lp = R.log_softmax64(x)
        ref_p = np.exp(lp)
        kept_ref = np.isfinite(x)
        kept_sc = probs[r] > 0
        exempt = kept_ref & (lp < np.log(1e-30))
        bad = (kept_sc != kept_ref) & ~exempt
        assert not bad.any(), (
            f"{ctx} row {r}: kept sets differ at ids {np.flatnonzero(bad)[:10].tolist()}: "
            f"samplec keeps {np.flatnonzero(kept_sc).tolist()[:20]}, reference keeps "
            f"{np.flatnonzero(kept_ref).tolist()[:20]}")
        diff = np.abs(probs[r].astype(np.float64) - ref_p)
        over = np.max(diff - (atol + rtol * ref_p))
        assert over <= 0, (f"{ctx} row {r}: max |probs - reference| = {np.max(diff):.3g} "
                           f"(over the tolerance by {over:.3g})")
        total = float(np.sum(probs[r], dtype=np.float64))
        assert abs(total - 1.0) <= sum_tol, f"{ctx} row {r}: probs sum to 1 {total - 1:+.3g}"


def ref_chain_rows(logits, stages_for_row, terminal_for_row=None):
    """Run the reference over each row; ``stages_for_row(r)`` gives that row's [(name, kwargs), ...]."""
    out = []
    for r in range(logits.shape[0]):
        term = terminal_for_row(r) if terminal_for_row else None
        out.append(R.run_chain(logits[r], stages_for_row(r), term, row=r))
    return out
