"""Semantic tests of samplec against the independent numpy oracle (tests/reference.py), spec §2-§5.

Every program is compiled once per (source, opt level, bindings) and reused (``semantics_util.prog``); inputs
use a small set of shapes (V in {2, 7, 100, 1000, 32000, 50257}, B in {1, 8}; a few at V = 262144, one at
B = 1000 for the chi-square test).
"""
from __future__ import annotations

import re
import zlib

import mlx.core as mx
import numpy as np
import pytest

import samplec

try:  # works whether or not tests/ is a package
    from . import reference as R
    from .semantics_util import (B, F32, LP_ATOL, ROW_KINDS, VS, assert_probs_match, mixed_logits, np_, prog,
                                 ref_chain_rows)
except ImportError:  # pragma: no cover
    import reference as R  # type: ignore[no-redef]
    from semantics_util import (B, F32, LP_ATOL, ROW_KINDS, VS, assert_probs_match,  # type: ignore[no-redef]
                                mixed_logits, np_, prog, ref_chain_rows)

OPTS = (0, 2)
U64_MAX = 2**64 - 1


def _h(obj) -> int:
    """A hash that does not change between runs (str hashes are salted per process)."""
    return zlib.crc32(repr(obj).encode())


# =============================================================================================================
# 1. every stage alone, through a `-> probs` sampler, against the reference
# =============================================================================================================
#
# A case is (source, builder). builder(V, logits, variant) -> (kwargs for the program, stages_for_row(r)).
# Per-row parameter vectors are rolled by `variant` so each row kind meets several parameter values.


def _roll(vals, variant):
    return list(np.roll(np.asarray(vals, dtype=object), variant))


def _history(V, rng, H=12):
    h = rng.integers(0, V, (B, H)).astype(np.int32)
    h[:, :3] = rng.integers(0, min(V, 3), (B, 3))         # repeats -> counts > 1
    pad = rng.random((B, H)) < 0.25
    h[pad] = rng.choice([-1, -7], size=int(pad.sum()))    # padding: any entry < 0
    return h


def b_temperature(V, x, variant):
    t = _roll([1.0, 0.0, 0.5, 2.0, 0.7, 0.0, 1.3, 100.0], variant)
    return {"t": np.array(t, dtype=np.float64)}, lambda r: [("temperature", {"t": t[r]})]


def b_temperature_scalar(V, x, variant):
    t = [0.0, 0.25, 1.0, 3.0][variant % 4]
    return {"t": t}, lambda r: [("temperature", {"t": t})]


def b_top_k(V, x, variant):
    k = _roll([-1, 0, 1, 2, 3, V - 1, V, V + 5], variant)
    return {"k": np.array(k, dtype=np.int64)}, lambda r: [("top_k", {"k": k[r]})]


def b_top_k_scalar(V, x, variant):
    k = [1, 3, V, 0][variant % 4]
    return {"k": k}, lambda r: [("top_k", {"k": k})]


def b_top_p(V, x, variant):
    p = _roll([1.0, 0.5, 0.9, 0.1, 1e-9, 0.95, 0.3, 0.999], variant)
    return {"p": p}, lambda r: [("top_p", {"p": p[r]})]


def b_min_p(V, x, variant):
    m = _roll([0.0, 1.0, 0.05, 0.5, 0.1, 0.9, 1e-6, 0.2], variant)
    return {"m": mx.array(np.array(m, dtype=np.float32))}, lambda r: [("min_p", {"m": m[r]})]


def b_typical_p(V, x, variant):
    m = _roll([1.0, 0.5, 0.9, 0.2, 0.0, 1.5, 0.95, 0.05], variant)
    return {"m": np.array(m, dtype=np.float32)}, lambda r: [("typical_p", {"m": m[r]})]


def b_top_n_sigma(V, x, variant):
    n = _roll([0.0, -1.0, 1.0, 1.5, 0.5, 3.0, 0.1, 10.0], variant)
    return {"n": n}, lambda r: [("top_n_sigma", {"n": n[r]})]


def b_xtc(V, x, variant):
    rng = np.random.default_rng(100 + variant)
    th = _roll([0.1, 0.05, 0.2, 0.01, 0.1, 0.3, 0.0, 0.5], variant)
    pr = _roll([1.0, 0.0, 0.5, 1.0, 0.5, 1.0, 0.3, 0.9], variant)
    seed = [int(s) for s in rng.integers(0, 2**63, B, dtype=np.uint64)]
    seed[variant % B] += 2**63
    pos = [int(v) for v in rng.integers(0, 1000, B)]
    kw = {"th": th, "pr": pr, "seed": np.array(seed, dtype=np.uint64), "pos": pos}
    return kw, lambda r: [("xtc", {"threshold": th[r], "probability": pr[r], "seed": seed[r], "position": pos[r]})]


def b_xtc_literal(V, x, variant):
    seed = 1000 + variant
    return {"seed": seed}, lambda r: [("xtc", {"threshold": 0.05, "probability": 1.0, "seed": seed, "position": 0})]


def b_penalties(V, x, variant):
    rng = np.random.default_rng(200 + variant)
    h = _history(V, rng)
    n = _roll([-1, 0, 1, 3, 12, 50, 5, 2], variant)
    rep = _roll([1.0, 1.3, 0.8, 2.0, 1.1, 1.5, 1.0, 3.0], variant)
    fr = _roll([0.0, 0.1, 0.5, -0.2, 0.0, 1.0, 0.3, 0.0], variant)
    pres = _roll([0.0, 0.2, 0.0, 1.0, -0.5, 0.0, 0.7, 0.1], variant)
    kw = {"h": h, "n": n, "rep": rep, "fr": fr, "pres": pres}
    return kw, lambda r: [("penalties", {"history": h[r], "last_n": n[r], "repeat": rep[r],
                                         "frequency": fr[r], "presence": pres[r]})]


def b_penalties_literal(V, x, variant):
    rng = np.random.default_rng(300 + variant)
    h = _history(V, rng, H=20 + variant)
    return {"h": h}, lambda r: [("penalties", {"history": h[r], "last_n": 8, "repeat": 1.3, "frequency": 0.25,
                                               "presence": 0.5})]


def _bias(V, x, rng):
    b = rng.normal(0, 2, (B, V)).astype(F32)
    b[rng.random((B, V)) < 0.2] = -np.inf
    for r in range(B):  # never empty a row (that is an error, tested separately)
        if not np.isfinite(x[r] + b[r]).any():
            b[r, np.flatnonzero(np.isfinite(x[r]))[0]] = 0.0
    return b


def b_logit_bias(V, x, variant):
    b = _bias(V, x, np.random.default_rng(400 + variant))
    return {"b": b}, lambda r: [("logit_bias", {"b": b[r]})]


DICT_BIAS = {0: -1.5, 1: 2.0, 5: -30.0, 6: 0.25}


def b_logit_bias_dict(V, x, variant):
    return {}, lambda r: [("logit_bias", {"b": DICT_BIAS})]


def _bool_mask(V, x, rng):
    m = rng.random((B, V)) < 0.6
    for r in range(B):
        if not (m[r] & np.isfinite(x[r])).any():
            m[r, np.flatnonzero(np.isfinite(x[r]))[-1]] = True
    return m


def pack_mask(m: np.ndarray) -> np.ndarray:
    """bool [B, V] -> int32 [B, ceil(V/32)]; bit j of word w is token 32*w + j."""
    Bm, V = m.shape
    words = (V + 31) // 32
    padded = np.zeros((Bm, words * 32), dtype=np.uint64)
    padded[:, :V] = m
    w = (padded.reshape(Bm, words, 32) << np.arange(32, dtype=np.uint64)).sum(-1)
    return w.astype(np.uint32).view(np.int32)


def b_allow(V, x, variant):
    m = _bool_mask(V, x, np.random.default_rng(500 + variant))
    return {"m": m}, lambda r: [("allow", {"mask": m[r]})]


def b_allow_packed(V, x, variant):
    m = _bool_mask(V, x, np.random.default_rng(600 + variant))
    if variant == 0:
        m[:, ::31] = True  # exercise bit 31 (the int32 sign bit) and bit 0
    packed = pack_mask(m)
    return {"m": packed}, lambda r: [("allow", {"mask": m[r]})]


def _const(stage, **args):
    """Builder of a stage whose arguments are all literals in the source."""
    return lambda V, x, variant: ({}, lambda r: [(stage, args)])


STAGE_CASES = {
    "temperature": ("sampler s(t: float) -> probs { temperature(t) }", b_temperature),
    "temperature_scalar": ("sampler s(t: float) -> probs { temperature(t) }", b_temperature_scalar),
    "temperature_lit0": ("sampler s() -> probs { temperature(0) }", _const("temperature", t=0.0)),
    "temperature_lit": ("sampler s() -> probs { temperature(0.6) }", _const("temperature", t=0.6)),
    "top_k": ("sampler s(k: int) -> probs { top_k(k) }", b_top_k),
    "top_k_scalar": ("sampler s(k: int) -> probs { top_k(k) }", b_top_k_scalar),
    "top_k_lit": ("sampler s() -> probs { top_k(3) }", _const("top_k", k=3)),
    "top_k_lit1": ("sampler s() -> probs { top_k(1) }", _const("top_k", k=1)),
    "top_k_lit_off": ("sampler s() -> probs { top_k(0) }", _const("top_k", k=0)),
    "top_p": ("sampler s(p: float) -> probs { top_p(p) }", b_top_p),
    "top_p_lit": ("sampler s() -> probs { top_p(0.8) }", _const("top_p", p=0.8)),
    "top_p_lit1": ("sampler s() -> probs { top_p(1) }", _const("top_p", p=1.0)),
    "min_p": ("sampler s(m: float) -> probs { min_p(m) }", b_min_p),
    "min_p_lit": ("sampler s() -> probs { min_p(0.1) }", _const("min_p", m=0.1)),
    "min_p_lit1": ("sampler s() -> probs { min_p(1) }", _const("min_p", m=1.0)),
    "typical_p": ("sampler s(m: float) -> probs { typical_p(m) }", b_typical_p),
    "typical_p_lit": ("sampler s() -> probs { typical_p(0.7) }", _const("typical_p", m=0.7)),
    "top_n_sigma": ("sampler s(n: float) -> probs { top_n_sigma(n) }", b_top_n_sigma),
    "top_n_sigma_lit": ("sampler s() -> probs { top_n_sigma(1.0) }", _const("top_n_sigma", n=1.0)),
    "xtc": ("sampler s(th: float, pr: float, seed: seed, pos: int) -> probs "
            "{ xtc(th, pr, seed, position = pos) }", b_xtc),
    "xtc_lit": ("sampler s(seed: seed) -> probs { xtc(0.05, 1.0, seed) }", b_xtc_literal),
    "penalties": ("sampler s(h: tokens, n: int, rep: float, fr: float, pres: float) -> probs "
                  "{ penalties(h, last_n = n, repeat = rep, frequency = fr, presence = pres) }", b_penalties),
    "penalties_lit": ("sampler s(h: tokens) -> probs "
                      "{ penalties(h, last_n = 8, repeat = 1.3, frequency = 0.25, presence = 0.5) }",
                      b_penalties_literal),
    "logit_bias": ("sampler s(b: bias) -> probs { logit_bias(b) }", b_logit_bias),
    "logit_bias_dict": ("sampler s() -> probs { logit_bias({0: -1.5, 1: 2.0, 5: -30.0, 6: 0.25}) }",
                        b_logit_bias_dict),
    "allow": ("sampler s(m: mask) -> probs { allow(m) }", b_allow),
    "allow_packed": ("sampler s(m: mask) -> probs { allow(m) }", b_allow_packed),
}

# The dict bias names token ids up to 6, so it needs V >= 7.
_STAGE_PARAMS = [(name, opt, V) for name in STAGE_CASES for opt in OPTS for V in VS
                 if not (name == "logit_bias_dict" and V < 7)]


@pytest.mark.parametrize("name,opt,V", _STAGE_PARAMS,
                         ids=[f"{n}-O{o}-V{V}" for n, o, V in _STAGE_PARAMS])
def test_stage_alone(name, opt, V):
    source, builder = STAGE_CASES[name]
    p = prog(source, opt)
    for variant in range(3):
        x = mixed_logits(V, seed=_h((name, V, variant)) % 2**32)
        kw, stages_for_row = builder(V, x, variant)
        ref = ref_chain_rows(x, stages_for_row)
        out = p(x, **kw)
        assert_probs_match(np_(out.probs), [r["x"] for r in ref], ctx=f"{name} O{opt} V={V} variant {variant}")


def test_stage_inputs_are_varied():
    """Sanity of the test data itself: the xtc coin fires and does not fire, top_k cuts at ties."""
    fired = []
    for variant in range(3):
        kw, _ = b_xtc(100, None, variant)
        for r in range(B):
            if 0 < kw["pr"][r] < 1:
                fired.append(bool(R.xtc_coin(int(kw["seed"][r]), kw["pos"][r]) < F32(kw["pr"][r])))
    assert any(fired) and not all(fired)
    x = mixed_logits(100, 1)[3]  # integer ties
    assert np.isfinite(R.top_k(x, 3)).sum() > 3


def test_xtc_coin_on_and_off_exactly():
    """Per-row probability; seeds picked (by the reference coin) so that row 0's coin is on, row 1's off."""
    src = "sampler s(pr: float, seed: seed) -> probs { xtc(0.1, pr, seed) }"
    x = np.tile(np.array([2.0, 1.9, 1.8, 0.5, -1.0, -3.0, 1.0], F32), (B, 1))
    on = next(s for s in range(1000) if R.xtc_coin(s, 0) < F32(0.5))
    off = next(s for s in range(1000) if R.xtc_coin(s, 0) >= F32(0.5))
    seeds = [on, off, on, off, on, off, on, off]
    pr = [0.5, 0.5, 1.0, 1.0, 0.0, 0.0, 0.5, 0.5]
    ref = [R.xtc(x[r], 0.1, pr[r], seeds[r]) for r in range(B)]
    assert not np.isfinite(ref[0][:2]).any() and np.isfinite(ref[1]).all()  # the data does what it says
    for opt in OPTS:
        out = prog(src, opt)(x, pr=pr, seed=seeds)
        assert_probs_match(np_(out.probs), ref, ctx=f"xtc O{opt}")


@pytest.mark.parametrize("opt", OPTS)
def test_temperature_zero_keeps_lowest_id_argmax(opt):
    x = np.array([[1.0, 3.0, 3.0, 2.0, 3.0, -np.inf, 0.0]] * 2, F32)
    out = prog("sampler s(t: float) -> probs { temperature(t) }", opt)(x, t=[0.0, 0.5])
    probs = np_(out.probs)
    assert probs[0].tolist() == [0, 1, 0, 0, 0, 0, 0]
    assert_probs_match(probs, [R.temperature(x[0], 0), R.temperature(x[1], 0.5)])


@pytest.mark.parametrize("opt", (0, 1, 2))
def test_typical_p_zero_keeps_the_least_surprising(opt):
    """typical_p(0): the mass in ascending score reaches 0 at the first score, so the most typical token (and the
    argmax) stay -- by hand: p = [1/2, 1/4, 1/8, 1/8], H = 1.75 ln 2, scores [0.75, 0.25, 1.25, 1.25] ln 2."""
    x = np.log(np.array([[0.5, 0.25, 0.125, 0.125]] * 3, F32))
    for src in ("sampler s(seed: seed) -> token, probs { typical_p(0) sample(seed) }",
                "sampler s(m: float, seed: seed) -> token, probs { typical_p(m) sample(seed) }"):
        out = prog(src, opt)(x, m=[0.0, 0.0, 0.0], seed=[1, 2, 3]) if "m:" in src else prog(src, opt)(x, seed=[1, 2, 3])
        np.testing.assert_allclose(np_(out.probs), [[2 / 3, 1 / 3, 0, 0]] * 3, atol=1e-6)
        assert set(np_(out.token).tolist()) <= {0, 1}


@pytest.mark.parametrize("opt", (0, 1, 2))
def test_temperature_overflow_then_zero(opt):
    """A temperature so small that the top / t leaves float32 keeps the argmax with its value (docs/language.md);
    a temperature 0 before or after it, in the same call, keeps that token and value too (by hand)."""
    x = np.array([[1.0, 2.0, 0.5], [1.0, 2.0, 0.5]], F32)
    for order in ("temperature(u) temperature(t)", "temperature(t) temperature(u)"):
        src = f"sampler s(u: float, t: float, seed: seed) -> token, probs, candidates(2) {{ {order} sample(seed) }}"
        out = prog(src, opt)(x, u=[1e-45, 0.5], t=[0.0, 0.0], seed=[5, 6])
        assert np_(out.token).tolist() == [1, 1], order
        np.testing.assert_array_equal(np_(out.probs), [[0, 1, 0], [0, 1, 0]])
        np.testing.assert_array_equal(np_(out.candidates.values), [[2.0, -np.inf], [4.0, -np.inf]])


@pytest.mark.parametrize("opt", (0, 1, 2))
@pytest.mark.parametrize("terminal", ("sample(seed)", "greedy()"))
def test_temperature_inf_after_a_cut_ties_only_the_kept(opt, terminal):
    """x / inf is 0 for every finite logit: the temperature 0 after it picks the lowest id among the tokens the
    cut kept (ids 1 and 3), never a removed one that divides to the same 0 (by hand)."""
    x = np.array([[0.0, 5.0, 3.0, 4.0]] * 2, F32)
    src = f"sampler s(a: float, b: float, seed: seed) -> token, probs {{ top_k(2) temperature(a) temperature(b) {terminal} }}"
    out = prog(src, opt)(x, a=[np.inf, 1e-45], b=[0.0, 0.0], seed=[1, 2])
    assert np_(out.token).tolist() == [1, 1]
    np.testing.assert_array_equal(np_(out.probs), [[0, 1, 0, 0]] * 2)


@pytest.mark.parametrize("opt", (0, 1, 2))
def test_greedy_after_a_cut_and_a_rounding_temperature(opt):
    """greedy() asked for its token alone, after a cut and a temperature: x / 1e38 rounds 0.001 and the next float32
    to the same (subnormal) float32, so the lower id wins where the cut kept it (row 0: top_k(2) keeps ids 0 and 1) and the top's id
    where it did not (row 1: top_k(1)); a top with no value rounded onto it is the argmax (row 2). By hand."""
    x = np.array([[0.001, np.nextafter(F32(0.001), F32(1.0)), 0.0005]] * 2 + [[0.001, 3.0, 0.0005]], F32)
    src = "sampler s(k: int, t: float) -> token { top_k(k) temperature(t) greedy() }"
    assert (x[:2, 0] / F32(1e38) == x[:2, 1] / F32(1e38)).all()
    out = prog(src, opt)(x, k=[2, 1, 2], t=[1e38, 1e38, 0.5])
    assert np_(out.token).tolist() == [0, 1, 1]


@pytest.mark.parametrize("opt", OPTS)
def test_hand_computed_ties(opt):
    """Kept sets worked out by hand (not by the reference): ties at v_k and at the top_p boundary are kept."""
    x = np.array([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0, -np.inf]] * B, F32)
    kept = lambda src, **kw: (np_(prog(src, opt)(x, **kw).probs) > 0).astype(int).tolist()
    # top_k: the 2nd largest is 2 (ids 2, 3, 5 tie) -> 4 kept; k = 1 -> only id 0; k = 5 -> 5th largest is 1
    ks = [2, 1, 5, 4, 6, 7, 0, -3]
    got = kept("sampler s(k: int) -> probs { top_k(k) }", k=ks)
    assert got[0] == got[3] == [1, 0, 1, 1, 0, 1, 0]
    assert got[1] == [1, 0, 0, 0, 0, 0, 0]
    assert got[2] == [1, 1, 1, 1, 0, 1, 0]
    assert got[4] == got[5] == got[6] == got[7] == [1, 1, 1, 1, 1, 1, 0]
    # top_p: p(id 0) = e^3 / Z ~ 0.43 < 0.5, so the tied ids 2, 3, 5 (S = 0.43 < p) are all kept
    p0 = np.exp(3.0) / (np.exp(3.0) + np.exp(1.0) + 3 * np.exp(2.0) + 1.0)
    pp = [0.5, 0.4, 0.99, 1.0, 0.43, 0.45, 0.9, 0.2]
    got = kept("sampler s(p: float) -> probs { top_p(p) }", p=pp)
    top3 = [1, 0, 1, 1, 0, 1, 0]
    assert 0.42 < p0 < 0.44
    assert got[0] == got[5] == top3
    assert got[1] == got[4] == got[7] == [1, 0, 0, 0, 0, 0, 0]
    assert got[2] == got[3] == [1, 1, 1, 1, 1, 1, 0]   # S(id 4) = 0.978 < 0.99
    assert got[6] == top3                              # S(id 1) = 0.919 >= 0.9
    # min_p(m): keep x >= 3 + ln m; m = e^-1 keeps x >= 2 (the ties), m = 1 keeps the max only
    ms = [float(np.float32(np.exp(-1.0))) * 0.999, 1.0, 0.0, 0.01, 0.5, 0.2, 0.14, 0.13]
    got = kept("sampler s(m: float) -> probs { min_p(m) }", m=ms)
    assert got[0] == top3 and got[1] == [1, 0, 0, 0, 0, 0, 0] and got[2] == [1, 1, 1, 1, 1, 1, 0]
    assert got[3] == [1, 1, 1, 1, 1, 1, 0]     # 3 + ln 0.01 = -1.6
    assert got[4] == [1, 0, 0, 0, 0, 0, 0]     # 3 + ln 0.5 = 2.31
    assert got[5] == got[6] == top3            # 1.39, 1.03
    assert got[7] == [1, 1, 1, 1, 0, 1, 0]     # 0.96


# =============================================================================================================
# 2. chains of several stages against run_chain
# =============================================================================================================

CHAIN_LLAMA = """
sampler llama(t: float = 0.8, seed: seed = 0, pos: int = 0, history: tokens) -> token, logprob, raw_logprob, probs {
    penalties(history, last_n = 64, repeat = 1.1, frequency = 0.1, presence = 0.2)
    top_k(40)
    top_p(0.95)
    min_p(0.05)
    temperature(t)
    sample(seed, position = pos)
}"""

CHAIN_TEMP_FIRST = """
sampler tf(t: float, k: int, p: float, m: float, tp: float, seed: seed, pos: int)
        -> token, logprob, raw_logprob, probs {
    temperature(t); top_k(k); top_p(p); min_p(m); typical_p(tp)
    sample(seed, position = pos)
}"""

CHAIN_MISC = """
sampler misc(b: bias, m: mask, n: float, th: float, pr: float, t: float, seed: seed, pos: int)
        -> token, logprob, raw_logprob, probs {
    logit_bias(b)
    allow(m)
    logit_bias({3: 1.5, 0: -0.5})
    top_n_sigma(n)
    xtc(th, pr, seed, position = pos)
    temperature(t)
    sample(seed, position = pos)
}"""

CHAIN_GREEDY = """
sampler g(h: tokens, k: int, p: float) -> token, logprob, raw_logprob, probs {
    penalties(h, last_n = -1, repeat = 1.5, presence = 0.3)
    top_k(k) top_p(p) min_p(0.02) typical_p(0.95)
    greedy()
}"""


def chain_case(name, V, rng, kinds=ROW_KINDS):
    """(source, logits, kwargs, stages_for_row, terminal_for_row) for one batch of B rows."""
    seeds = [int(s) for s in rng.integers(0, 2**64 - 1, B, dtype=np.uint64)]
    pos = [int(v) for v in rng.integers(0, 5000, B)]
    x = mixed_logits(V, int(rng.integers(2**31)), kinds)
    sample_t = lambda r: ("sample", {"seed": seeds[r], "position": pos[r]})
    if name == "llama":
        h = rng.integers(-1, V, (B, 80)).astype(np.int32)
        t = [float(v) for v in rng.choice([0.0, 0.3, 0.8, 1.0, 1.7], B)]
        kw = {"t": t, "seed": seeds, "pos": pos, "history": h}
        st = lambda r: [("penalties", {"history": h[r], "last_n": 64, "repeat": 1.1, "frequency": 0.1,
                                       "presence": 0.2}),
                        ("top_k", {"k": 40}), ("top_p", {"p": 0.95}), ("min_p", {"m": 0.05}),
                        ("temperature", {"t": t[r]})]
        return CHAIN_LLAMA, x, kw, st, sample_t
    if name == "temp_first":
        t = [float(v) for v in rng.choice([0.0, 0.5, 1.0, 1.5], B)]
        k = [int(v) for v in rng.choice([0, 1, 5, 40, V], B)]
        p = [float(v) for v in rng.choice([0.5, 0.9, 1.0], B)]
        m = [float(v) for v in rng.choice([0.0, 0.05, 0.2], B)]
        tp = [float(v) for v in rng.choice([0.0, 0.5, 0.95, 1.0], B)]
        kw = {"t": t, "k": k, "p": p, "m": m, "tp": tp, "seed": seeds, "pos": pos}
        st = lambda r: [("temperature", {"t": t[r]}), ("top_k", {"k": k[r]}), ("top_p", {"p": p[r]}),
                        ("min_p", {"m": m[r]}), ("typical_p", {"m": tp[r]})]
        return CHAIN_TEMP_FIRST, x, kw, st, sample_t
    if name == "misc":
        b = _bias(V, x, rng)
        msk = _bool_mask(V, x + b, rng)
        dict_b = {3: 1.5, 0: -0.5}
        n = [float(v) for v in rng.choice([0.0, 1.0, 2.5], B)]
        th = [float(v) for v in rng.choice([0.05, 0.1, 0.3], B)]
        pr = [float(v) for v in rng.choice([0.0, 0.5, 1.0], B)]
        t = [float(v) for v in rng.choice([0.7, 1.0, 1.2], B)]
        kw = {"b": b, "m": msk, "n": n, "th": th, "pr": pr, "t": t, "seed": seeds, "pos": pos}
        st = lambda r: [("logit_bias", {"b": b[r]}), ("allow", {"mask": msk[r]}), ("logit_bias", {"b": dict_b}),
                        ("top_n_sigma", {"n": n[r]}),
                        ("xtc", {"threshold": th[r], "probability": pr[r], "seed": seeds[r], "position": pos[r]}),
                        ("temperature", {"t": t[r]})]
        return CHAIN_MISC, x, kw, st, sample_t
    if name == "greedy":
        h = rng.integers(-1, V, (B, 30)).astype(np.int32)
        k = [int(v) for v in rng.choice([0, 2, 10], B)]
        p = [float(v) for v in rng.choice([0.3, 0.9, 1.0], B)]
        kw = {"h": h, "k": k, "p": p}
        st = lambda r: [("penalties", {"history": h[r], "last_n": -1, "repeat": 1.5, "presence": 0.3}),
                        ("top_k", {"k": k[r]}), ("top_p", {"p": p[r]}), ("min_p", {"m": 0.02}),
                        ("typical_p", {"m": 0.95})]
        return CHAIN_GREEDY, x, kw, st, lambda r: ("greedy", {})
    raise ValueError(name)


CHAINS = ("llama", "temp_first", "misc", "greedy")


def check_chain_outputs(out, ref, ctx, lp_atol=LP_ATOL, **probs_tol):
    """Tokens exactly, then kept sets and probs, then logprob and raw_logprob (float32) within lp_atol."""
    tok = np_(out.token)
    assert tok.dtype == np.int32 and tok.shape == (len(ref),)
    assert tok.tolist() == [r["token"] for r in ref], ctx
    assert_probs_match(np_(out.probs), [r["x"] for r in ref], ctx=ctx, **probs_tol)
    for name in ("logprob", "raw_logprob"):
        got = np_(getattr(out, name))
        assert got.dtype == np.float32 and got.shape == (len(ref),), (name, got.dtype, got.shape)
        np.testing.assert_allclose(got, [r[name] for r in ref], atol=lp_atol, rtol=0, err_msg=f"{ctx} {name}")


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("V", (7, 1000))
def test_chain_vs_reference(chain, opt, V):
    rng = np.random.default_rng(_h((chain, V)) % 2**32)
    for rep in range(4):
        src, x, kw, st, term = chain_case(chain, V, rng)
        out = prog(src, opt)(x, **kw)
        check_chain_outputs(out, ref_chain_rows(x, st, term), f"{chain} O{opt} V={V} rep {rep}")


# Semantics at large V, with value tolerances wide enough for float32 sequential summation; the exact
# bounds at large V are test_normalizer_precision's job.
LARGE_V_TOL = dict(lp_atol=2e-3, rtol=1e-3, sum_tol=1e-3)


@pytest.mark.parametrize("chain", CHAINS)
def test_chain_vs_reference_V32000(chain):
    rng = np.random.default_rng(7)
    # No near-flat row here: at V = 32000 it puts thousands of tokens within 1e-4 of a top_p / typical_p
    # cut, where the kept set follows the normalizer's rounding; test_normalizer_precision covers that.
    kinds = tuple(k if k != "near_flat" else "normal" for k in ROW_KINDS)
    src, x, kw, st, term = chain_case(chain, 32000, rng, kinds)
    out = prog(src, 2)(x, **kw)
    check_chain_outputs(out, ref_chain_rows(x, st, term), f"{chain} V=32000", **LARGE_V_TOL)


def test_chain_V262144():
    """One vocabulary the size of Gemma's: a llama chain on a single row."""
    V = 262144
    rng = np.random.default_rng(11)
    x = (rng.normal(0, 3, (1, V))).astype(F32)
    x[0, rng.integers(V, size=5000)] = -np.inf
    h = rng.integers(0, V, (1, 100)).astype(np.int32)
    ref = [R.run_chain(x[0], [("penalties", {"history": h[0], "last_n": 64, "repeat": 1.1, "frequency": 0.1,
                                             "presence": 0.2}),
                              ("top_k", {"k": 40}), ("top_p", {"p": 0.95}), ("min_p", {"m": 0.05}),
                              ("temperature", {"t": 0.7})],
                       ("sample", {"seed": 2**63 + 5, "position": 17}))]
    out = prog(CHAIN_LLAMA, 2)(x, t=0.7, seed=2**63 + 5, pos=17, history=h)
    check_chain_outputs(out, ref, "V=262144", **LARGE_V_TOL)


# =============================================================================================================
# 3. exact tokens: Gumbel-max over §4's bits, and greedy
# =============================================================================================================

SAMPLE_SRC = "sampler s(seed: seed, pos: int) -> token { sample(seed, position = pos) }"
SAMPLE_SEED_ONLY = "sampler s(seed: seed) -> token { sample(seed) }"
SAMPLE_POS_LIT = "sampler s(seed: seed) -> token { sample(seed, position = 5) }"
SAMPLE_LITERAL_SEED = "sampler s() -> token { sample(12345, position = 3) }"
GREEDY_SRC = "sampler g() -> token, logprob { greedy() }"

SPECIAL_SEEDS = [0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**63 + 1, U64_MAX, 0xDEADBEEFCAFEBABE]


def _seed_batches(rng, n):
    for i in range(n):
        seeds = [int(s) for s in rng.integers(0, 2**64 - 1, B, dtype=np.uint64, endpoint=True)]
        seeds[i % B] = SPECIAL_SEEDS[i % len(SPECIAL_SEEDS)]
        pos = [int(v) for v in rng.integers(0, 2**31 - 1, B)]
        pos[(i + 3) % B] = i  # small positions too
        yield seeds, pos


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("V", (2, 7, 100, 1000))
def test_sample_exact_tokens(opt, V):
    rng = np.random.default_rng(V)
    p = prog(SAMPLE_SRC, opt)
    for i, (seeds, pos) in enumerate(_seed_batches(rng, 30)):
        x = mixed_logits(V, i)
        expect = [R.sample(x[r], seeds[r], pos[r]) for r in range(B)]
        # seeds as a list of Python ints, as uint64 numpy, and (every third batch) as an MLX uint64 array
        seed_arg = seeds if i % 3 == 0 else np.array(seeds, dtype=np.uint64)
        if i % 3 == 2:
            seed_arg = mx.array(np.array(seeds, dtype=np.uint64))
        got = np_(p(x, seed=seed_arg, pos=pos).token).tolist()
        assert got == expect, f"V={V} O{opt} seeds={seeds} pos={pos}"


@pytest.mark.parametrize("opt", OPTS)
def test_sample_scalar_seed_and_default_position(opt):
    x = mixed_logits(100, 5)
    for seed in SPECIAL_SEEDS:
        got = np_(prog(SAMPLE_SEED_ONLY, opt)(x, seed=seed).token).tolist()
        assert got == [R.sample(x[r], seed, 0) for r in range(B)], seed
        got = np_(prog(SAMPLE_POS_LIT, opt)(x, seed=seed).token).tolist()
        assert got == [R.sample(x[r], seed, 5) for r in range(B)], seed
    got = np_(prog(SAMPLE_LITERAL_SEED, opt)(x).token).tolist()
    assert got == [R.sample(x[r], 12345, 3) for r in range(B)]


def test_sample_without_seed_is_fresh_and_valid():
    x = np.zeros((B, 1000), F32)
    x[:, 500:] = -np.inf
    p = prog("sampler s() -> token { sample() }", 2)
    a, b = np_(p(x).token), np_(p(x).token)
    assert ((0 <= a) & (a < 500)).all() and ((0 <= b) & (b < 500)).all()
    assert a.tolist() != b.tolist()
    # seed= sets the seed it would draw (as the CLI's --seed does): then the draw is the spec's at that seed
    y = np.random.default_rng(3).standard_normal((B, 100)).astype(F32)
    assert np_(p(y, seed=77).token).tolist() == [R.sample(y[r], 77, 0) for r in range(B)]
    assert np_(p(y, seed=[5] * B).token).tolist() == np_(p(y, seed=5).token).tolist()


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("V", (2, 7, 100, 1000))
def test_greedy_is_argmax_lowest_id(opt, V):
    for seed in range(4):
        x = mixed_logits(V, seed)
        out = prog(GREEDY_SRC, opt)(x)
        assert np_(out.token).tolist() == [int(np.argmax(r)) for r in x]
        np.testing.assert_allclose(np_(out.logprob), [R.log_softmax64(r)[np.argmax(r)] for r in x], atol=1e-5)
    if V >= 7:
        x = np.full((1, V), -np.inf, F32)
        x[0, [3, 5, 6]] = 2.0
        assert np_(prog(GREEDY_SRC, opt)(x).token).tolist() == [3]


# =============================================================================================================
# 4. statistics: sample frequencies against probs (deterministic: fixed seeds)
# =============================================================================================================

STAT_SRC = """
sampler st(seed: seed, pos: int, pr: float) -> token, probs {
    top_k(5)
    min_p(0.02)
    xtc(0.15, pr, seed, position = pos)
    temperature(0.9)
    sample(seed, position = pos)
}"""


def test_sample_frequencies_chi_square():
    from scipy.stats import chisquare

    x0 = np.array([1.0, 2.5, -0.5, 2.0, 0.3, 1.2, -4.0], F32)
    base = [("top_k", {"k": 5}), ("min_p", {"m": 0.02})]
    N = 1000
    x = np.tile(x0, (N, 1))
    p = prog(STAT_SRC, 2)
    for pr in (0.0, 0.5):
        # the expected distribution: a mixture of xtc on / off with weight pr
        off = R.run_chain(x0, base + [("temperature", {"t": 0.9})])["probs"].astype(np.float64)
        on_x = R.xtc(R.min_p(R.top_k(x0, 5), 0.02), 0.15, 1.0, 0)
        on = R.run_chain(on_x, [("temperature", {"t": 0.9})])["probs"].astype(np.float64)
        expected = (1 - pr) * off + pr * on
        counts = np.zeros(7)
        for rep in range(4):
            out = p(x, seed=np.arange(N, dtype=np.uint64) + rep * N, pos=rep, pr=pr)
            counts += np.bincount(np_(out.token), minlength=7)
            if pr == 0.0:
                assert_probs_match(np_(out.probs)[:2], [R.temperature(R.min_p(R.top_k(x0, 5), 0.02), 0.9)] * 2)
        assert counts[expected == 0].sum() == 0, (counts, expected)
        nz = expected > 0
        stat, pval = chisquare(counts[nz], expected[nz] / expected[nz].sum() * counts.sum())
        assert pval > 1e-3, (pr, counts, expected * counts.sum(), pval)


# =============================================================================================================
# 5. -O0 and -O2 give identical tokens (and both match the reference)
# =============================================================================================================

TOPK_CONST = """sampler c(t: float, seed: seed) -> token { top_k(40) top_p(0.9) temperature(t) sample(seed) }"""
TOPK_PARAM = """sampler c(k: int, t: float, seed: seed) -> token { top_k(k) top_p(0.9) temperature(t) sample(seed) }"""


@pytest.mark.parametrize("chain", CHAINS)
def test_O0_equals_O2_tokens(chain):
    rng = np.random.default_rng(_h(chain) % 2**32)
    for rep in range(10):
        src, x, kw, st, term = chain_case(chain, 100, rng)
        a = np_(prog(src, 0)(x, **kw).token).tolist()
        b = np_(prog(src, 2)(x, **kw).token).tolist()
        ref = [r["token"] for r in ref_chain_rows(x, st, term)]
        assert a == b == ref, (chain, rep)


@pytest.mark.parametrize("opt", OPTS)
def test_bindings_temperature_zero_is_greedy(opt):
    p = prog(CHAIN_TEMP_FIRST, opt, (("t", 0.0),))
    p_rt = prog(CHAIN_TEMP_FIRST, opt)
    rng = np.random.default_rng(3)
    for rep in range(6):
        x = mixed_logits(100, 50 + rep)
        seeds = rng.integers(0, 2**64 - 1, B, dtype=np.uint64)
        kw = {"k": 40, "p": 0.9, "m": 0.05, "tp": 1.0, "pos": rep}
        a = np_(p(x, seed=seeds, **kw).token).tolist()
        b = np_(p_rt(x, seed=seeds, t=0.0, **kw).token).tolist()
        assert a == b == [int(np.argmax(r)) for r in x]


@pytest.mark.parametrize("opt", OPTS)
def test_bindings_and_constant_top_k_match_per_row(opt):
    p_const = prog(TOPK_CONST, opt)
    p_param = prog(TOPK_PARAM, opt)
    p_bound = prog(TOPK_PARAM, opt, (("k", 40),))
    p_bound_t = prog(TOPK_PARAM, opt, (("k", 40), ("t", 0.7)))
    for rep in range(10):
        x = mixed_logits(1000, 70 + rep)
        seeds = np.random.default_rng(rep).integers(0, 2**64 - 1, B, dtype=np.uint64)
        ref = [R.run_chain(x[r], [("top_k", {"k": 40}), ("top_p", {"p": 0.9}), ("temperature", {"t": 0.7})],
                           ("sample", {"seed": int(seeds[r])}))["token"] for r in range(B)]
        toks = [np_(p_const(x, t=0.7, seed=seeds).token).tolist(),
                np_(p_param(x, k=40, t=0.7, seed=seeds).token).tolist(),
                np_(p_param(x, k=[40] * B, t=[0.7] * B, seed=seeds).token).tolist(),
                np_(p_bound(x, t=0.7, seed=seeds).token).tolist(),
                np_(p_bound_t(x, seed=seeds).token).tolist()]
        for tk in toks:
            assert tk == ref, (rep, toks, ref)


# =============================================================================================================
# 6. batch invariance
# =============================================================================================================


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("chain", ("llama", "temp_first", "misc"))
def test_batch_invariance(chain, opt):
    rng = np.random.default_rng(_h(("bi", chain)) % 2**32)
    src, x, kw, _, _ = chain_case(chain, 1000, rng)
    p = prog(src, opt)
    perm = rng.permutation(B)

    def take(rows):  # lists stay lists of Python ints (np.asarray would turn big seeds into float64)
        return {k: ([v[i] for i in rows] if isinstance(v, list) else v[rows]) for k, v in kw.items()}

    full = p(x[perm], **take(perm))
    tok, lp = np_(full.token), np_(full.logprob)
    for i, r in enumerate(perm):
        one = p(x[r:r + 1], **take([r]))
        assert np_(one.token)[0] == tok[i], (chain, r)
        assert np_(one.logprob)[0] == lp[i], (chain, r)
    # and the unshuffled batch agrees row by row
    plain = p(x, **kw)
    assert np.array_equal(np_(plain.token)[perm], tok)
    assert np.array_equal(np_(plain.logprob)[perm], lp)


# =============================================================================================================
# 7. outputs
# =============================================================================================================

OUT_SRC = """
sampler o(k: int, t: float, seed: seed) -> token, logprob, raw_logprob, top_logprobs(5), candidates(10), probs {
    top_k(k) temperature(t) sample(seed)
}"""
NO_TERMINAL_SRC = "sampler nt(p: float) -> probs, candidates(12) { top_p(p) temperature(0.5) }"


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("V", (100, 1000))
def test_outputs_vs_reference(opt, V):
    p = prog(OUT_SRC, opt)
    for rep in range(4):
        x = mixed_logits(V, 90 + rep)
        k = [3, 0, 12, 1, 7, V, 20, 2]
        t = [1.0, 0.5, 2.0, 1.0, 0.0, 0.8, 1.0, 1.5]
        seeds = [rep * 100 + r for r in range(B)]
        out = p(x, k=k, t=t, seed=seeds)
        ref = ref_chain_rows(x, lambda r: [("top_k", {"k": k[r]}), ("temperature", {"t": t[r]})],
                             lambda r: ("sample", {"seed": seeds[r]}))
        check_chain_outputs(out, ref, f"outputs O{opt} V={V}")
        ids, vals = np_(out.top_logprobs.ids), np_(out.top_logprobs.values)
        assert ids.dtype == np.int32 and ids.shape == (B, 5) and vals.shape == (B, 5)
        cids, cvals = np_(out.candidates.ids), np_(out.candidates.values)
        assert cids.dtype == np.int32 and cids.shape == (B, 10)
        for r in range(B):
            rid, rval = R.top_logprobs(x[r], 5)
            assert ids[r].tolist() == rid.tolist(), (r, ids[r], rid)
            np.testing.assert_allclose(vals[r], rval, atol=1e-5, rtol=0)
            check_candidates(cids[r], cvals[r], ref[r]["x"], 10, ctx=f"row {r}")


def check_candidates(cids, cvals, xr, k, ctx=""):
    rid, rval = R.candidates(xr, k)
    n_kept = int(np.isfinite(rval).sum())
    # kept candidates: exact ids (lowest id first on ties) and values
    assert cids[:n_kept].tolist() == rid[:n_kept].tolist(), (ctx, cids, rid)
    np.testing.assert_allclose(cvals[:n_kept], rval[:n_kept], atol=1e-5, rtol=0)
    # removed ones: -inf, distinct, in range and really removed
    assert np.all(cvals[n_kept:] == -np.inf), (ctx, cvals)
    rest = cids[n_kept:]
    assert len(set(cids.tolist())) == k and ((0 <= rest) & (rest < len(xr))).all()
    assert not np.isfinite(xr[rest]).any()


@pytest.mark.parametrize("opt", OPTS)
def test_outputs_without_terminal(opt):
    p = prog(NO_TERMINAL_SRC, opt)
    for V in (100, 1000):
        x = mixed_logits(V, 3)
        pp = [0.5, 0.9, 1.0, 0.2, 0.7, 0.99, 0.05, 0.6]
        out = p(x, p=pp)
        xs = [R.temperature(R.top_p(x[r], pp[r]), 0.5) for r in range(B)]
        assert_probs_match(np_(out.probs), xs)
        cids, cvals = np_(out.candidates.ids), np_(out.candidates.values)
        assert cids.dtype == np.int32 and cids.shape == (B, 12) and cvals.dtype == np.float32
        for r in range(B):
            check_candidates(cids[r], cvals[r], xs[r], 12, ctx=f"row {r}")


def test_probs_sum_to_one():
    src, x, kw, _, _ = chain_case("temp_first", 1000, np.random.default_rng(1))
    probs = np_(prog(src, 2)(x, **kw).probs)
    assert probs.dtype == np.float32
    np.testing.assert_allclose(probs.sum(-1, dtype=np.float64), 1.0, atol=1e-5)
    assert (probs >= 0).all()


# =============================================================================================================
# 8. input dtypes and shapes
# =============================================================================================================

DTYPE_SRC = """sampler d(seed: seed, t: float) -> token, logprob, raw_logprob, probs {
    top_k(50) top_p(0.9) temperature(t) sample(seed)
}"""


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_half_precision_logits_equal_float32_of_same_values(dtype, opt):
    p = prog(DTYPE_SRC, opt)
    x32 = mixed_logits(1000, 9) * F32(2)
    half = mx.array(x32).astype(getattr(mx, dtype))
    same = np.array(half.astype(mx.float32))  # the same values, in float32
    seeds = list(range(B))
    a = p(half, seed=seeds, t=0.8)
    b = p(same, seed=seeds, t=0.8)
    for name in ("token", "logprob", "raw_logprob", "probs"):
        assert np.array_equal(np_(getattr(a, name)), np_(getattr(b, name))), name
    assert np_(a.logprob).dtype == np.float32
    ref = ref_chain_rows(same, lambda r: [("top_k", {"k": 50}), ("top_p", {"p": 0.9}), ("temperature", {"t": 0.8})],
                         lambda r: ("sample", {"seed": seeds[r]}))
    check_chain_outputs(a, ref, dtype)
    if dtype == "float16":  # numpy float16 input too
        c = p(same.astype(np.float16), seed=seeds, t=0.8)
        assert np.array_equal(np_(c.token), np_(b.token))


@pytest.mark.parametrize("opt", OPTS)
def test_numpy_mlx_and_1d_inputs(opt):
    p = prog(DTYPE_SRC, opt)
    x = mixed_logits(1000, 10)
    a = p(x, seed=3, t=0.9)
    b = p(mx.array(x), seed=mx.array(3), t=mx.array(np.float32(0.9)))
    c = p(x, seed=np.uint64(3), t=np.float32(0.9))
    for name in ("token", "logprob", "raw_logprob", "probs"):
        assert np.array_equal(np_(getattr(a, name)), np_(getattr(b, name))), name
        assert np.array_equal(np_(getattr(a, name)), np_(getattr(c, name))), name
    for r in (0, 4):
        one = p(x[r], seed=3, t=0.9)
        assert np_(one.token).shape == (1,)
        assert np_(one.token)[0] == np_(a.token)[r]
        assert np_(one.logprob)[0] == np_(a.logprob)[r]
        assert np_(one.probs).shape == (1, 1000)
        one_mx = p(mx.array(x[r]), seed=3, t=0.9)
        assert np_(one_mx.token)[0] == np_(a.token)[r]


# =============================================================================================================
# 9. run-time errors
# =============================================================================================================

ERR_SRC = """sampler e(pp: float = 0.9, t: float = 1.0, seed: seed = 0, h: tokens, msk: mask, need: int)
        -> token, probs {
    penalties(h, repeat = 1.2)
    allow(msk)
    top_k(need)
    top_p(pp)
    temperature(t)
    sample(seed)
}"""


def _err_inputs(V=100, Bn=4):
    x = mixed_logits(V, 1)[:Bn]
    return x, {"h": np.zeros((Bn, 3), np.int32), "msk": np.ones((Bn, V), bool), "need": 5}


def _rows_re(*rows):
    return re.compile(r"\brows?\s+" + r"\s*,\s*".join(map(str, rows)) + r"\b")


def raises(p, x, **kw):
    with pytest.raises(samplec.SamplecError) as e:
        p(x, **kw)
    return str(e.value)


@pytest.mark.parametrize("opt", OPTS)
def test_error_nan_and_posinf_logits(opt):
    p = prog(ERR_SRC, opt)
    x, kw = _err_inputs()
    y = x.copy()
    y[1, 7] = np.nan
    msg = raises(p, y, **kw)
    assert "nan" in msg.lower() and _rows_re(1).search(msg), msg
    y = x.copy()
    y[3, 0] = np.inf
    msg = raises(p, y, **kw)
    assert "inf" in msg.lower() and _rows_re(3).search(msg), msg
    y = x.copy()
    y[2, :] = -np.inf
    msg = raises(p, y, **kw)
    assert _rows_re(2).search(msg), msg


@pytest.mark.parametrize("opt", OPTS)
def test_error_parameter_out_of_range_names_param_and_row(opt):
    p = prog(ERR_SRC, opt)
    x, kw = _err_inputs()
    msg = raises(p, x, pp=[0.9, 0.5, 1.5, 1.0], **kw)
    assert "pp" in msg and _rows_re(2).search(msg), msg
    msg = raises(p, x, pp=[0.9, 0.0, 0.5, 0.5], **kw)
    assert "pp" in msg and _rows_re(1).search(msg), msg
    msg = raises(p, x, t=-1, **kw)
    assert re.search(r"\bt\b", msg), msg
    msg = raises(p, x, t=[1.0, 1.0, 1.0, -1.0], **kw)
    assert re.search(r"\bt\b", msg) and _rows_re(3).search(msg), msg
    msg = raises(p, x, t=[1.0, float("nan"), 1.0, 1.0], **kw)
    assert re.search(r"\bt\b", msg) and _rows_re(1).search(msg), msg


@pytest.mark.parametrize("opt", OPTS)
def test_error_keywords_and_shapes(opt):
    p = prog(ERR_SRC, opt)
    x, kw = _err_inputs()
    msg = raises(p, x, temperatur=0.5, **kw)
    assert "temperatur" in msg, msg
    msg = raises(p, x, h=kw["h"], msk=kw["msk"])  # `need` missing
    assert "need" in msg, msg
    msg = raises(p, x, **{**kw, "need": [5, 5, 5]})  # wrong length per-row vector
    assert "need" in msg, msg
    msg = raises(p, x, pp=[0.5, 0.5], **kw)
    assert "pp" in msg, msg
    msg = raises(p, x, **{**kw, "msk": np.ones((4, 99), bool)})  # wrong-shaped mask
    assert "msk" in msg, msg
    msg = raises(p, x, **{**kw, "msk": np.ones((3, 100), bool)})
    assert "msk" in msg, msg
    msg = raises(p, x, **{**kw, "h": np.zeros((5, 3), np.int32)})
    assert re.search(r"\bh\b", msg), msg


@pytest.mark.parametrize("opt", OPTS)
def test_error_history_id_out_of_range(opt):
    p = prog(ERR_SRC, opt)
    x, kw = _err_inputs()
    h = kw["h"].copy()
    h[2, 1] = 100  # == V
    msg = raises(p, x, **{**kw, "h": h})
    assert re.search(r"\bh\b", msg) and _rows_re(2).search(msg), msg


@pytest.mark.parametrize("opt", OPTS)
def test_error_history_id_out_of_range_as_mlx_arrays(opt):
    """A history passed as an MLX array is checked with the call's outputs (no read-back while it is prepared):
    the error names the parameter and the rows, ids far past V included; the same program then runs a good call."""
    import mlx.core as mx
    p = prog(ERR_SRC, opt)
    x, kw = _err_inputs()
    h = kw["h"].copy()
    h[2, 1] = 100                    # == V
    h[3, 0] = 2 ** 31 - 1
    msg = raises(p, x, **{**kw, "h": mx.array(h)})
    assert re.search(r"\bh\b", msg) and _rows_re(2, 3).search(msg), msg
    good = p(x, **{**kw, "h": mx.array(kw["h"])})
    assert np.array(good.token).shape == (x.shape[0],)


@pytest.mark.parametrize("opt", OPTS)
def test_error_nan_bias_as_mlx_array(opt):
    import mlx.core as mx
    p = prog("sampler s(b: bias) -> probs { logit_bias(b) }", opt)
    x = mixed_logits(7, 2)
    b = np.zeros_like(x)
    b[3, 4] = np.nan
    b[6, 0] = np.inf
    msg = raises(p, x, b=mx.array(b))
    assert re.search(r"\bb\b", msg) and _rows_re(3, 6).search(msg), msg


@pytest.mark.parametrize("opt", OPTS)
def test_error_mask_allows_nothing(opt):
    p = prog(ERR_SRC, opt)
    x, kw = _err_inputs()
    m = kw["msk"].copy()
    m[1, :] = False
    msg = raises(p, x, **{**kw, "msk": m})
    assert _rows_re(1).search(msg), msg
    packed = pack_mask(m)
    msg = raises(p, x, **{**kw, "msk": packed})
    assert _rows_re(1).search(msg), msg
    # a packed mask with the wrong number of words
    msg = raises(p, x, **{**kw, "msk": packed[:, :3]})
    assert "msk" in msg, msg


@pytest.mark.parametrize("opt", OPTS)
def test_error_bias_empties_row(opt):
    p = prog("sampler s(b: bias) -> probs { logit_bias(b) }", opt)
    x = mixed_logits(7, 2)
    b = np.zeros_like(x)
    b[5, :] = -np.inf
    msg = raises(p, x, b=b)
    assert _rows_re(5).search(msg), msg
    # a dict bias naming a token id >= V
    msg = raises(prog("sampler s() -> probs { logit_bias({0: -1.5, 1: 2.0, 5: -30.0, 6: 0.25}) }", opt),
                 mixed_logits(2, 0))
    assert "6" in msg, msg


# =============================================================================================================
# extra contract points found while writing the suite
# =============================================================================================================

PRECISION_SRC = "sampler pr(seed: seed) -> token, logprob, raw_logprob, probs { sample(seed) }"


def _typical_scores64(row, m):
    x = row.astype(np.float64)
    p = np.exp(x - x.max())
    p /= p.sum()
    s = np.abs(-np.log(p) + (p * np.log(p)).sum())
    order = np.argsort(s, kind="stable")
    at = min(int(np.searchsorted(np.cumsum(p[order]), m)), len(s) - 1)
    return s, s[order[at]]


@pytest.mark.parametrize("V", (1000, 32000, 262144))
def test_normalizer_precision(V):
    """probs within 1e-6 and logprob / raw_logprob within 1e-5 of the exact values, at every vocabulary size.

    (float32 can do this easily: numpy's float32 pairwise sum is within ~1e-7 relative even at V = 262144.)
    """
    if V == 262144:
        x = np.random.default_rng(4).normal(0, 2, (1, V)).astype(F32)
        x[0, 17] += 9.0
    else:
        x = mixed_logits(V, 21)
    seeds = list(range(x.shape[0]))
    out = prog(PRECISION_SRC, 2)(x, seed=seeds)
    ref = ref_chain_rows(x, lambda r: [], lambda r: ("sample", {"seed": seeds[r]}))
    check_chain_outputs(out, ref, f"precision V={V}", lp_atol=1e-5, atol=1e-6, rtol=0.0, sum_tol=1e-5)
    if V == 32000:
        # the consequence for cut-offs that sum probabilities: on a near-flat row (every p ~ 1/V) the kept
        # sets of typical_p and top_p must still be the reference's
        y = mixed_logits(V, 22, ("near_flat",) * B)
        tp = [0.95, 0.5, 0.9, 0.3, 0.99, 0.7, 0.8, 0.6]
        got = np_(prog("sampler t(m: float) -> probs { typical_p(m) }", 2)(y, m=tp).probs)
        # near-flat rows make typical_p ill-conditioned: scores are within 1e-6 of one another around s*, below
        # float32's resolution of -log p - H. Outside that band the kept sets must be the reference's; inside it
        # they must be the float64 truth's or the reference's.
        for r in range(B):
            ref = R.typical_p(y[r], tp[r])
            s, s_star = _typical_scores64(y[r], tp[r])
            band = np.abs(s - s_star) < 1e-5
            ours, theirs, truth = got[r] > 0, np.isfinite(ref), s <= s_star
            assert np.array_equal(ours[~band], theirs[~band]), f"typical_p near-flat row {r}"
            assert np.all((ours == truth) | (ours == theirs)), f"typical_p near-flat row {r} (band)"
        got = prog("sampler t(p: float) -> probs { top_p(p) }", 2)(y, p=tp)
        assert_probs_match(np_(got.probs), [R.top_p(y[r], tp[r]) for r in range(B)], ctx="top_p near-flat")


@pytest.mark.parametrize("opt", OPTS)
def test_logit_bias_dict_neg_inf_bans_token(opt):
    """`-inf` is a literal (spec §1) and a -inf bias removes a token (spec §2: a row that a -inf bias
    empties is an error), so a constant dict may ban a token with -inf, as llama.cpp's `--logit-bias 5-inf`."""
    p = prog("sampler s() -> probs { logit_bias({0: -1.5, 5: -inf}) }", opt)
    x = mixed_logits(7, 12)
    out = p(x)
    assert_probs_match(np_(out.probs), [R.logit_bias(x[r], {0: -1.5, 5: -np.inf}) for r in range(B)])


@pytest.mark.parametrize("opt", OPTS)
def test_error_non_integer_seed(opt):
    """A seed is an unsigned 64-bit integer; 1.5 must not silently become 1 (int parameters already refuse it)."""
    p = prog(SAMPLE_SRC, opt)
    x = mixed_logits(100, 1)
    msg = raises(p, x, seed=1.5, pos=0)
    assert "seed" in msg, msg
    msg = raises(p, x, seed=np.array([1.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]), pos=0)
    assert "seed" in msg, msg
    msg = raises(p, x, seed=0, pos=1.5)
    assert "pos" in msg, msg


@pytest.mark.parametrize("opt", OPTS)
def test_xtc_threshold_zero_never_empties_a_row(opt):
    """xtc keeps the least probable token it targets, a kept one: with threshold <= 0 every kept token is a
    target, and a removed token (p = 0) must not be chosen as the survivor. (Or the value is refused.)"""
    x = np.array([[1.0, -np.inf, 2.0, 0.5, 1.5, -np.inf, 0.0]] * 2, F32)
    p = prog("sampler s(th: float) -> probs { xtc(th, 1.0, 3) }", opt)
    for th in (0.0, -1.0):
        try:
            out = p(x, th=th)
        except samplec.SamplecError as e:
            assert "th" in str(e)
            continue
        assert_probs_match(np_(out.probs), [R.xtc(x[r], th, 1.0, 3) for r in range(2)], ctx=f"xtc({th})")


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("stage,name", (("temperature", "t"), ("top_n_sigma", "n")))
def test_infinite_parameter_keeps_a_token(stage, name, opt):
    """t = inf and n = inf are inside the declared ranges ([0, inf] and any float): they must either give the
    reference's result (removed tokens stay removed; top_n_sigma keeps the max even when std = 0) or be
    refused naming the parameter -- never a row of NaN."""
    x = np.array([[1.0, -np.inf, 2.0, 0.5], [-np.inf, -np.inf, 3.0, -np.inf]], F32)
    src = f"sampler s({name}: float) -> probs {{ {stage}({name}) }}"
    try:
        out = prog(src, opt)(x, **{name: np.inf})
    except samplec.SamplecError as e:
        assert re.search(rf"\b{name}\b", str(e)), str(e)
        return
    assert_probs_match(np_(out.probs), [R.STAGES[stage](x[r], np.inf) for r in range(2)], ctx=f"{stage}(inf)")


# =============================================================================================================
# -O2 candidate plan: outputs without `probs` let -O2 run the chain on a few blocks of candidates; it must be
# exact (the same tokens and log-probabilities as the reference) on every row, friendly or adversarial.
# =============================================================================================================

PLAN_OUT = "token, logprob, raw_logprob, top_logprobs(3)"
PLAN_CHAINS = {
    "top_k": (f"""sampler a(t: float, seed: seed, pos: int) -> {PLAN_OUT} {{
        top_k(40) top_p(0.95) min_p(0.05) temperature(t) sample(seed, position = pos) }}""",
              lambda kw, r: [("top_k", {"k": 40}), ("top_p", {"p": 0.95}), ("min_p", {"m": 0.05}),
                             ("temperature", {"t": kw["t"][r]})]),
    "top_k1_greedy": (f"""sampler a() -> {PLAN_OUT}, candidates(1) {{ top_k(1) greedy() }}""",
                      lambda kw, r: [("top_k", {"k": 1})]),
    "penalties_top_k": (f"""sampler a(t: float, seed: seed, pos: int, h: tokens) -> {PLAN_OUT} {{
        penalties(h, last_n = 64, repeat = 1.1, frequency = 0.1, presence = 0.2)
        top_k(20) temperature(t) sample(seed, position = pos) }}""",
                        lambda kw, r: [("penalties", {"history": kw["h"][r], "last_n": 64, "repeat": 1.1,
                                                      "frequency": 0.1, "presence": 0.2}),
                                       ("top_k", {"k": 20}), ("temperature", {"t": kw["t"][r]})]),
    "penalties_rt": (f"""sampler a(t: float, seed: seed, pos: int, h: tokens, rep: float, fr: float, pr: float)
        -> {PLAN_OUT} {{ penalties(h, repeat = rep, frequency = fr, presence = pr)
        top_k(8) temperature(t) sample(seed, position = pos) }}""",
                     lambda kw, r: [("penalties", {"history": kw["h"][r], "repeat": kw["rep"][r],
                                                   "frequency": kw["fr"][r], "presence": kw["pr"][r]}),
                                    ("top_k", {"k": 8}), ("temperature", {"t": kw["t"][r]})]),
    "min_p": (f"""sampler a(t: float, seed: seed, pos: int) -> {PLAN_OUT} {{
        min_p(0.05) temperature(t) sample(seed, position = pos) }}""",
              lambda kw, r: [("min_p", {"m": 0.05}), ("temperature", {"t": kw["t"][r]})]),
    "top_p": (f"""sampler a(t: float, seed: seed, pos: int) -> {PLAN_OUT} {{
        top_p(0.9) temperature(t) sample(seed, position = pos) }}""",
              lambda kw, r: [("top_p", {"p": 0.9}), ("temperature", {"t": kw["t"][r]})]),
    "window": (f"""sampler a(t: float, seed: seed, pos: int) -> {PLAN_OUT} {{
        temperature(t) sample(seed, position = pos) }}""",
               lambda kw, r: [("temperature", {"t": kw["t"][r]})]),
    "prefix_greedy": (f"""sampler a(b: bias, m: mask) -> {PLAN_OUT} {{
        logit_bias(b) allow(m) top_k(10) min_p(0.1) greedy() }}""",
                      lambda kw, r: [("logit_bias", {"b": kw["b"][r]}), ("allow", {"mask": kw["m"][r]}),
                                     ("top_k", {"k": 10}), ("min_p", {"m": 0.1})]),
}
PLAN_TERMINAL = {"top_k1_greedy": "greedy", "prefix_greedy": "greedy"}
FRIENDLY = ("normal", "peaked", "sharp", "neg_inf", "normal", "peaked", "sharp", "neg_inf")
ADVERSARIAL = ROW_KINDS


def _plan_kwargs(chain, V, x, rng):
    kw = {"t": [float(v) for v in rng.choice([0.0, 0.4, 0.8, 1.0, 1.5, 3.0], B)],
          "seed": [int(s) for s in rng.integers(0, 2**64 - 1, B, dtype=np.uint64)],
          "pos": [int(v) for v in rng.integers(0, 10000, B)]}
    src = PLAN_CHAINS[chain][0]
    if "h: tokens" in src:
        kw["h"] = rng.integers(-1, V, (B, 100)).astype(np.int32)
        # repeat the argmax so the penalties change the winner
        kw["h"][:, :5] = np.argmax(x, axis=1)[:, None]
    if "rep: float" in src:
        kw["rep"] = [float(v) for v in rng.choice([1.0, 1.3, 0.7], B)]    # 0.7 raises negative logits
        kw["fr"] = [float(v) for v in rng.choice([0.0, 0.5, -0.5], B)]
        kw["pr"] = [float(v) for v in rng.choice([0.0, 0.3], B)]
    if "b: bias" in src:
        kw["b"] = np.zeros((B, V), F32)
        kw["b"][:, rng.integers(V, size=50)] = 20.0                          # lift tokens out of weak blocks
        kw["m"] = rng.random((B, V)) < 0.9
        for r in range(B):
            kw["m"][r, np.argmax(x[r] + kw["b"][r])] = True
    return {k: v for k, v in kw.items() if re.search(rf"\b{k}:", src)}


def _check_plan(p, x, kw, chain, ctx, tol):
    stages = PLAN_CHAINS[chain][1]
    term = PLAN_TERMINAL.get(chain, "sample")
    ref = [R.run_chain(x[r], stages(kw, r),
                       ("greedy", {}) if term == "greedy" else ("sample", {"seed": kw["seed"][r],
                                                                          "position": kw["pos"][r]}))
           for r in range(x.shape[0])]
    out = p(x, **kw)
    assert np_(out.token).tolist() == [r["token"] for r in ref], ctx
    for name in ("logprob", "raw_logprob"):
        np.testing.assert_allclose(np_(getattr(out, name)), [r[name] for r in ref], atol=tol, rtol=0,
                                   err_msg=f"{ctx} {name}")
    ids, vals = np_(out.top_logprobs.ids), np_(out.top_logprobs.values)
    for r in range(x.shape[0]):
        rid, rval = R.top_logprobs(x[r], 3)
        assert ids[r].tolist() == rid.tolist(), (ctx, r)
        np.testing.assert_allclose(vals[r], rval, atol=tol, rtol=0)
    if "candidates(1)" in PLAN_CHAINS[chain][0]:
        cids, cvals = np_(out.candidates.ids), np_(out.candidates.values)
        for r in range(x.shape[0]):
            check_candidates(cids[r], cvals[r], ref[r]["x"], 1, ctx=f"{ctx} row {r}")


@pytest.mark.parametrize("V", (100, 1000, 32000, 50257))
@pytest.mark.parametrize("chain", list(PLAN_CHAINS))
def test_O2_plan_exact(chain, V):
    rng = np.random.default_rng(_h(("plan", chain, V)) % 2**32)
    p = prog(PLAN_CHAINS[chain][0], 2)
    tol = LP_ATOL if V <= 1000 else LARGE_V_TOL["lp_atol"]
    for rep, kinds in enumerate((FRIENDLY, ADVERSARIAL, FRIENDLY)):
        x = mixed_logits(V, int(rng.integers(2**31)), kinds)
        kw = _plan_kwargs(chain, V, x, rng)
        _check_plan(p, x, kw, chain, f"{chain} V={V} rep {rep}", tol)


@pytest.mark.parametrize("chain", list(PLAN_CHAINS))
def test_O2_plan_is_exercised(chain, monkeypatch):
    """test_O2_plan_exact tests the fast path, not a fallback: on the CPU with samplec-native, each of its -O2
    programs runs its stages and draw as one call of the native chain kernel, which answers (returns outputs),
    and no stage op runs by its dense definition. A chain the kernel silently declined would pass
    test_O2_plan_exact through the dense definitions; it fails here."""
    from samplec.backend_mlx import interpreter, native
    from samplec.ir.ops import STAGE_OPS
    if not (native.installed() and hasattr(native._native, "sample_chain")):
        pytest.skip("samplec-native (with the chain kernel) is not installed")
    ran, dense = [], []
    real_chain, real_dense = native.sample_chain, interpreter._run_expansion

    def chain_spy(x, params, stages, terminal, *a, **k):
        out = real_chain(x, params, stages, terminal, *a, **k)
        ran.append((list(stages), terminal, out is not None))
        return out

    monkeypatch.setattr(native, "sample_chain", chain_spy)
    monkeypatch.setattr(interpreter, "_run_expansion", lambda node, ins: dense.append(node.op) or real_dense(node, ins))
    monkeypatch.setenv("SAMPLEC_NATIVE", "1")
    src = PLAN_CHAINS[chain][0]
    p = samplec.compile(src, opt_level=2)        # (a program of its own: traced under the spies)
    want = [n.op for n in p.graph.toposort() if n.op in STAGE_OPS]
    assert want, p.ir()
    rng = np.random.default_rng(5)
    with mx.stream(mx.cpu):
        for kinds in (FRIENDLY, ADVERSARIAL):
            x = mixed_logits(32000, 3, kinds)
            p(x, **_plan_kwargs(chain, 32000, x, rng))
    assert ran and all(r == (want, PLAN_TERMINAL.get(chain, "sample"), True) for r in ran), ran
    assert not set(dense) & set(STAGE_OPS), dense


@pytest.mark.parametrize("V", (1000, 32000))
def test_O2_plan_ties_across_blocks(V):
    """The maximum (or the k-th value) tied in blocks far apart: the lowest id must still win (greedy, t = 0)
    and ties at v_k must all be kept."""
    x = np.random.default_rng(8).normal(0, 1, (B, V)).astype(F32)
    hi = [V - 1, V - 70, V // 2, 700, 64, 63, 1, 0]
    for r in range(B):
        x[r, [hi[r], (hi[r] + V // 3) % V, (hi[r] + 2 * V // 3) % V]] = 9.0
    for chain in ("top_k1_greedy", "window", "top_k"):
        rng = np.random.default_rng(1)
        kw = _plan_kwargs(chain, V, x, rng)
        if "t" in kw:
            kw["t"] = [0.0, 0.0, 1.0, 0.0, 0.5, 0.0, 1.0, 0.0]
        _check_plan(prog(PLAN_CHAINS[chain][0], 2), x, kw, chain, f"ties {chain} V={V}",
                    LP_ATOL if V <= 1000 else LARGE_V_TOL["lp_atol"])


# =============================================================================================================
# random chains: stages in random order, arguments as literals, bound parameters or per-row parameters;
# -O0, -O1 and -O2 against the reference (tokens, probs, logprobs)
# =============================================================================================================

_POOL = {  # stage -> [(argument, keyword or None, values to draw from)]
    "temperature": [("t", None, [0.0, 0.5, 1.0, 1.7])],
    "top_k": [("k", None, [-1, 0, 1, 3, 20, 100, 5000])],
    "top_p": [("p", None, [0.2, 0.9, 1.0])],
    "min_p": [("m", None, [0.0, 0.05, 0.3, 1.0])],
    "typical_p": [("m", None, [0.0, 0.4, 0.9, 1.0])],
    "top_n_sigma": [("n", None, [0.0, 0.5, 2.0])],
    "xtc": [("threshold", None, [0.02, 0.1, 0.3]), ("probability", None, [0.0, 0.5, 1.0])],
    "penalties": [("last_n", "last_n", [-1, 0, 4, 30]), ("repeat", "repeat", [1.0, 1.2, 0.9]),
                  ("frequency", "frequency", [0.0, 0.4]), ("presence", "presence", [0.0, 0.3, -0.2])],
    "logit_bias": [],
    "allow": [],
}
_INT_ARGS = {"k", "last_n"}


def _fmt(v):
    return repr(int(v)) if isinstance(v, (int, np.integer)) else repr(float(v))


def random_chain(seed):
    """(source, bindings, plan, terminal, outputs, used params) of a random sampler.

    plan: [(stage, index, [(reference keyword, DSL keyword or None, mode, value)])], mode one of
    "lit" (a literal), "name" (a parameter bound at compile time), "param" (one run-time value for the batch),
    "row" (one run-time value per row).
    """
    rng = np.random.default_rng(seed)
    names = list(_POOL)
    stages = [names[i] for i in rng.choice(len(names), int(rng.integers(1, 6)), replace=True)]
    params, bindings, plan = [], {}, []   # plan: per stage (name, [(ref_key, kind, value_or_param)])
    for si, st in enumerate(stages):
        args = []
        for arg, kw, values in _POOL[st]:
            mode = rng.choice(["literal", "param", "row", "bound"])
            typ = "int" if arg in _INT_ARGS else "float"
            pname = f"{st[:3]}{si}_{arg[:3]}"
            if mode == "literal":
                args.append((arg, kw, "lit", values[int(rng.integers(len(values)))]))
            elif mode == "bound":
                params.append(f"{pname}: {typ}")
                bindings[pname] = values[int(rng.integers(len(values)))]
                args.append((arg, kw, "name", pname))
            else:
                params.append(f"{pname}: {typ}")
                args.append((arg, kw, mode, (pname, values)))
        plan.append((st, si, args))
    terminal = rng.choice(["sample", "greedy", "none"])
    choices = [["token", "logprob", "raw_logprob", "probs"], ["token", "logprob", "raw_logprob"], ["token"]]
    outputs = ["probs"] if terminal == "none" else choices[int(rng.integers(len(choices)))]
    params += ["seed: seed", "pos: int", "h: tokens", "b: bias", "msk: mask"]
    body = []
    for st, si, args in plan:
        pieces = []
        if st == "penalties":
            pieces.append("h")
        if st == "logit_bias":
            pieces.append("b")
        if st == "allow":
            pieces.append("msk")
        for arg, kw, mode, val in args:
            text = _fmt(val) if mode == "lit" else (val if mode == "name" else val[0])
            pieces.append(f"{kw} = {text}" if kw else text)
        if st == "xtc":
            pieces += ["seed", "position = pos"]
        body.append(f"{st}({', '.join(pieces)})")
    body.append({"sample": "sample(seed, position = pos)", "greedy": "greedy()", "none": ""}[str(terminal)])
    used = [p for p in params if re.search(rf"\b{p.split(':')[0]}\b", " ".join(body))]
    src = f"sampler r{seed}({', '.join(used)}) -> {', '.join(outputs)} {{\n    " + "\n    ".join(body) + "\n}"
    return src, tuple(sorted(bindings.items())), plan, str(terminal), list(outputs), used


def _random_chain_inputs(plan, bindings, used, V, x, rng):
    kw, per_row = {}, {}
    for st, si, args in plan:
        for arg, k, mode, val in args:
            if mode in ("param", "row"):
                pname, values = val
                if mode == "param":
                    v = values[int(rng.integers(len(values)))]
                    kw[pname], per_row[pname] = v, [v] * B
                else:
                    vs = [values[int(i)] for i in rng.integers(len(values), size=B)]
                    kw[pname], per_row[pname] = vs, vs
    seeds = [int(s) for s in rng.integers(0, 2**64 - 1, B, dtype=np.uint64)]
    pos = [int(p) for p in rng.integers(0, 1000, B)]
    h = rng.integers(-2, V, (B, 24)).astype(np.int32)
    b = rng.normal(0, 1, (B, V)).astype(F32)   # finite: never empties a row
    msk = rng.random((B, V)) < 0.7             # made all-true in rows where it would empty the row (below)
    extra = {"seed": seeds, "pos": pos, "h": h, "b": b, "msk": msk}
    for p in used:
        n = p.split(":")[0]
        if n in extra:
            kw[n] = extra[n]
    bound = dict(bindings)

    def stages_for_row(r):
        out = []
        for st, si, args in plan:
            a = {}
            for arg, k, mode, val in args:
                if mode == "lit":
                    a[arg] = val
                elif mode == "name":
                    a[arg] = bound[val]
                else:
                    a[arg] = per_row[val[0]][r]
            if st == "penalties":
                a["history"] = h[r]
            elif st == "logit_bias":
                a["b"] = b[r]
            elif st == "allow":
                a["mask"] = msk[r]
            elif st == "xtc":
                a.update(seed=seeds[r], position=pos[r])
            out.append((st, a))
        return out
    return kw, stages_for_row, seeds, pos


@pytest.mark.uncompiled
@pytest.mark.parametrize("seed", range(24))
def test_random_chain(seed):
    src, bindings, plan, terminal, outputs, used = random_chain(seed)
    for V in (100, 1000):
        rng = np.random.default_rng(seed * 7 + V)
        x = mixed_logits(V, seed + V)
        # an emptying mask or bias is an error tested elsewhere; -inf-heavy rows with allow can empty a row
        kw, stages_for_row, seeds, pos = _random_chain_inputs(plan, bindings, used, V, x, rng)
        term = None if terminal == "none" else (lambda r: ("greedy", {})) if terminal == "greedy" else \
            (lambda r: ("sample", {"seed": seeds[r], "position": pos[r]}))
        for r in range(B):
            try:
                R.run_chain(x[r], stages_for_row(r))
            except ValueError:   # `allow` emptied the row (an error, tested elsewhere): allow everything
                kw["msk"][r] = True
        ref = ref_chain_rows(x, stages_for_row, term)
        for opt in (0, 1, 2):
            out = prog(src, opt, bindings)(x, **kw)
            ctx = f"\n{src}\nbindings={bindings} O{opt} V={V}"
            if "token" in outputs:
                assert np_(out.token).tolist() == [r["token"] for r in ref], ctx
            if "probs" in outputs:
                assert_probs_match(np_(out.probs), [r["x"] for r in ref], ctx=ctx)
            for name in ("logprob", "raw_logprob"):
                if name in outputs:
                    np.testing.assert_allclose(np_(getattr(out, name)), [r[name] for r in ref], atol=LP_ATOL,
                                               rtol=0, err_msg=f"{ctx} {name}")


@pytest.mark.parametrize("cut", ("top_k(5)", "top_p(0.9)", "min_p(0.05)"))
@pytest.mark.parametrize("late", ("allow(m)", "logit_bias(b)", "penalties(h, repeat = 1.3)"))
def test_O2_tensor_stage_after_a_cut(cut, late):
    """A mask / bias / history stage after a truncating stage, without a `probs` output (so -O2 may plan)."""
    src = f"sampler a(m: mask, b: bias, h: tokens, seed: seed) -> token, logprob {{ {cut} {late} sample(seed) }}"
    used = [n for n in ("m", "b", "h") if re.search(rf"\b{n}\b", late)]
    src = src.replace("m: mask, b: bias, h: tokens", ", ".join({"m": "m: mask", "b": "b: bias", "h": "h: tokens"}[n]
                                                               for n in used))
    V = 1000
    rng = np.random.default_rng(0)
    x = mixed_logits(V, 4, FRIENDLY)
    m = np.ones((B, V), bool)
    b = rng.normal(0, 1, (B, V)).astype(F32)
    h = rng.integers(0, V, (B, 10)).astype(np.int32)
    h[:, 0] = np.argmax(x, axis=1)
    m[:, np.argsort(-x, axis=1)[:, 1:3]] = False   # drops some of the best tokens (never the best)
    m[np.arange(B), np.argmax(x, axis=1)] = True
    kw = {"m": m, "b": b, "h": h, "seed": list(range(B))}
    kw = {k: v for k, v in kw.items() if k in used + ["seed"]}
    name, arg = cut.rstrip(")").split("(")
    first = (name, {"top_k": {"k": 5}, "top_p": {"p": 0.9}, "min_p": {"m": 0.05}}[name])
    late_ref = {"allow(m)": lambda r: ("allow", {"mask": m[r]}), "logit_bias(b)": lambda r: ("logit_bias", {"b": b[r]}),
                "penalties(h, repeat = 1.3)": lambda r: ("penalties", {"history": h[r], "repeat": 1.3})}[late]
    ref = ref_chain_rows(x, lambda r: [first, late_ref(r)], lambda r: ("sample", {"seed": r}))
    for opt in OPTS:
        out = prog(src, opt)(x, **kw)
        assert np_(out.token).tolist() == [r["token"] for r in ref], (src, opt)
        np.testing.assert_allclose(np_(out.logprob), [r["logprob"] for r in ref], atol=LP_ATOL, rtol=0)


@pytest.mark.parametrize("chain", ("top_k", "window", "prefix_greedy"))
def test_O2_plan_reports_run_time_errors(chain):
    """Programs that -O2 plans (no `probs` output) still report bad logits and empty masks by row."""
    V = 1000
    p = prog(PLAN_CHAINS[chain][0], 2)
    x = mixed_logits(V, 6, FRIENDLY)
    kw = _plan_kwargs(chain, V, x, np.random.default_rng(0))
    for r, bad in ((1, np.nan), (6, np.inf)):
        y = x.copy()
        y[r, 500] = bad
        msg = raises(p, y, **kw)
        assert _rows_re(r).search(msg), msg
    y = x.copy()
    y[3] = -np.inf
    msg = raises(p, y, **kw)
    assert _rows_re(3).search(msg), msg
    if "m" in kw:
        m = kw["m"].copy()
        m[5] = False
        msg = raises(p, x, **{**kw, "m": m})
        assert _rows_re(5).search(msg), msg


@pytest.mark.parametrize("chain", list(PLAN_CHAINS))
def test_O0_equals_O2_tokens_planned(chain):
    """The programs -O2 plans: identical tokens (and log-probabilities) at -O0 and -O2 over many seeds."""
    V = 1000
    rng = np.random.default_rng(_h(("o0o2", chain)) % 2**32)
    p0, p2 = prog(PLAN_CHAINS[chain][0], 0), prog(PLAN_CHAINS[chain][0], 2)
    for rep in range(8):
        x = mixed_logits(V, int(rng.integers(2**31)), FRIENDLY if rep % 2 else ADVERSARIAL)
        kw = _plan_kwargs(chain, V, x, rng)
        a, b = p0(x, **kw), p2(x, **kw)
        assert np_(a.token).tolist() == np_(b.token).tolist(), (chain, rep)
        np.testing.assert_allclose(np_(a.logprob), np_(b.logprob), atol=LP_ATOL, rtol=0)


@pytest.mark.parametrize("opt", OPTS)
def test_typical_p_orders_scores_as_exact_arithmetic_does(opt):
    """typical_p's scores |-log p_i - H| computed as |mean(d) - d_i| (log Z cancels): two near-equal logits whose
    scores differ by ~2 float32 ulps of log 2 are ordered as exact (float64) arithmetic orders them -- the likelier
    token alone reaches m = 0.2 -- where the literal float32 formula rounds the two scores together (and keeps
    both). The decision documented in docs/language.md (typical_p)."""
    x = np.array([[0.25039512, 0.25088045]], dtype=np.float32)
    p = prog("sampler s(m: float, seed: seed) -> token, probs { typical_p(m) sample(seed) }", opt)
    x64 = x[0].astype(np.float64)
    q = np.exp(x64 - x64.max())
    q /= q.sum()
    s = np.abs(-np.log(q) + (q * np.log(q)).sum())
    assert s[1] < s[0]                                        # exact arithmetic: token 1's score is the lower
    for seed in range(8):
        out = p(x, m=0.2, seed=seed)
        assert (np.array(out.probs)[0] > 0).tolist() == [False, True]
        assert int(np.array(out.token)[0]) == 1
