"""The v2 stages (spec §6): dynamic_temperature, epsilon, eta, dry, mirostat, mirostat_v2, and `state` parameters.

Each stage is compared, at -O0 and -O2, with the numpy reference (tests/reference.py, written from the
definitions) and with the system that defined it: transformers' warpers for epsilon and eta, and for the llama.cpp
samplers a direct transcription of `src/llama-sampling.cpp` below (float32, the Z-algorithm as written there), since
llama-cpp-python is not installed in CI (tests/parity/test_llama_cpp.py runs against it where it is).
"""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import samplec
from samplec.diagnostics import SamplecError
from samplec.frontend.check import check
from samplec.frontend.parser import parse

try:
    from . import reference as R
    from .semantics_util import assert_probs_match, mixed_logits, prog
except ImportError:  # pragma: no cover
    import reference as R  # type: ignore[no-redef]
    from semantics_util import assert_probs_match, mixed_logits, prog  # type: ignore[no-redef]

F32 = np.float32
OPTS = (0, 2)
VS = (2, 7, 100, 1000)


def logits_for(V: int, seed: int) -> np.ndarray:
    """Realistic and adversarial rows: normal, peaked, flat, integer ties, -inf entries, ..."""
    return mixed_logits(V, seed)


# ---------------------------------------------------------------------------------------------- llama.cpp, transcribed

def cpp_softmax(logits: np.ndarray) -> np.ndarray:
    """llama_sampler_softmax_impl on a sorted array (float32)."""
    e = np.exp((logits - logits[0]).astype(F32)).astype(F32)
    return (e / np.sum(e, dtype=F32)).astype(F32)


def cpp_sorted(x: np.ndarray):
    """llama.cpp's candidate array after the truncating samplers before it: the kept tokens, sorted by logit
    (descending; ties by id, where llama.cpp's partial sort leaves them in some order)."""
    ids = np.flatnonzero(np.isfinite(x))
    ids = ids[np.argsort(-x[ids].astype(np.float64), kind="stable")]
    return ids, x[ids].astype(F32)


def cpp_temp_ext(x: np.ndarray, temp: float, delta: float, exponent: float) -> np.ndarray:
    """llama_sampler_temp_ext_apply, returning the full-vocabulary logits (removed tokens -inf)."""
    out = np.full_like(x, -np.inf)
    ids, logit = cpp_sorted(x)
    if delta > 0:
        min_temp, max_temp = F32(max(0.0, temp - delta)), F32(temp + delta)
        if len(ids) <= 1:
            return x.copy()
        max_entropy = -np.log(F32(1.0) / F32(len(ids)))
        p = cpp_softmax(logit)
        ent = F32(0.0)
        for pr in p:
            if pr > 0:
                ent = F32(ent - pr * np.log(pr))
        dyn = F32(min_temp + (max_temp - min_temp) * np.power(F32(ent / max_entropy), F32(exponent)))
        temp = dyn
    if temp <= 0:
        out[ids[0]] = logit[0]
        return out
    out[ids] = (logit / F32(temp)).astype(F32)
    return out


def cpp_dry(x: np.ndarray, seq: list[int], multiplier, base, allowed_length, last_n, breakers) -> np.ndarray:
    """llama_sampler_dry_apply with single-token sequence breakers; `seq` the accepted tokens (oldest first)."""
    total_context_size = len(seq) + 10
    if multiplier == 0.0 or base < 1.0 or last_n == 0:
        return x.copy()
    eff = total_context_size if last_n == -1 else max(last_n, 0)
    last_tokens = seq[-eff:] if eff else []
    rat = lambda i: last_tokens[len(last_tokens) - 1 - i]          # noqa: E731
    last_n_repeat = min(min(len(last_tokens), eff), total_context_size)
    if last_n_repeat <= allowed_length:
        return x.copy()
    count = [0] * last_n_repeat
    rep_limit = last_n_repeat
    for i in range(last_n_repeat):
        if rat(i) in breakers:
            rep_limit = i           # longest_match = 0 for a single-token breaker
            break
    if rep_limit < allowed_length:
        return x.copy()
    last, rt, lt = last_n_repeat - 1, 0, 0
    for k in range(1, last_n_repeat):
        if k > rt:
            n = 0
            while n + k < last_n_repeat and rat(n) == rat(n + k):
                n += 1
            count[last - k] = min(n, rep_limit)
            if n > 0:
                lt, rt = k, k + n - 1
        else:
            p = k - lt
            right_part_len = rt - k + 1
            if count[last - p] < right_part_len:
                count[last - k] = min(count[last - p], rep_limit)
            else:
                i = rt + 1
                while i < last_n_repeat and rat(i) == rat(i - k):
                    i += 1
                count[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    max_token_repeat: dict[int, int] = {}
    for i in range(last_n_repeat - 1):
        repeat_len = count[i]
        if repeat_len >= allowed_length:
            token = rat(last_n_repeat - 2 - i)
            if token not in max_token_repeat or max_token_repeat[token] < repeat_len:
                max_token_repeat[token] = repeat_len
    max_exponent = int(F32(88.7228391) / np.log(F32(base))) if base > 1.000001 else 0
    out = x.copy()
    for token, rep in max_token_repeat.items():
        if token in breakers or token >= len(x):
            continue
        repeat_exp = rep - allowed_length
        if max_exponent > 0 and repeat_exp > max_exponent:
            repeat_exp = max_exponent
        penalty = F32(F32(multiplier) * math.pow(F32(base), repeat_exp))     # float * std::pow -> float
        out[token] = F32(out[token] - penalty)
    return out


def cpp_mirostat_keep(x: np.ndarray, mu: float, m: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The candidates llama_sampler_mirostat_apply (m given) or _v2_apply (m None) draws from: (ids, p)."""
    ids, logit = cpp_sorted(x)
    p = cpp_softmax(logit)
    if m is None:
        size = next((i for i, pr in enumerate(p) if -np.log2(pr) > F32(mu)), len(p))
        size = max(size, 1)
    else:
        s_tb, s_tt = F32(0.0), F32(0.0)
        i = 0
        while i < m - 1 and i < len(p) - 1:
            t_i = np.log(F32(i + 2) / F32(i + 1))
            with np.errstate(all="ignore"):
                b_i = np.log(F32(p[i] / p[i + 1]))
            s_tb, s_tt = F32(s_tb + t_i * b_i), F32(s_tt + t_i * t_i)
            i += 1
        with np.errstate(all="ignore"):
            s_hat = F32(s_tb / s_tt)
            eps = F32(s_hat - 1)
            k = np.power(F32(eps * np.power(F32(2), F32(mu))) / F32(1 - np.power(F32(len(x)), -eps)),
                         F32(1) / s_hat)
        # int(k): NaN -> 1 (x86 and ARM agree); past the array -> all of it (ARM's saturation; x86 gives INT_MIN)
        size = 1 if np.isnan(k) else len(p) if k >= len(p) else max(int(k), 1)
    return ids[:size], cpp_softmax(logit[:size])


def cpp_mu_update(mu: float, tau: float, eta: float, p_token: float) -> float:
    return float(F32(F32(mu) - F32(eta) * F32(-np.log2(F32(p_token)) - F32(tau))))


# ---------------------------------------------------------------------------------------------- epsilon, eta

def hf_warp(cls, x: np.ndarray, e: float) -> np.ndarray:
    torch = pytest.importorskip("torch")
    warper = cls(e) if cls.__name__ == "EpsilonLogitsWarper" else cls(e, device="cpu")
    return warper(None, torch.tensor(x)).numpy()


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("V", VS)
@pytest.mark.parametrize("stage", ["epsilon", "eta"])
def test_epsilon_eta_match_transformers(stage, V, opt):
    tr = pytest.importorskip("transformers")
    cls = tr.EpsilonLogitsWarper if stage == "epsilon" else tr.EtaLogitsWarper
    p = prog(f"sampler s(e: float) -> probs {{ {stage}(e) }}", opt)
    x = logits_for(V, 11 + V)
    for e in (1e-4, 3e-3, 0.02, 0.2, 0.9):
        got = np.array(p(x, e=e).probs)
        hf = np.stack([hf_warp(cls, row, e) for row in x])
        ref = [getattr(R, stage)(row, e) for row in x]
        assert_probs_match(got, hf, ctx=f"{stage}({e}) vs transformers")
        assert_probs_match(got, ref, ctx=f"{stage}({e}) vs reference")


@pytest.mark.parametrize("opt", OPTS)
def test_epsilon_eta_off_at_zero_and_after_top_k(opt):
    x = logits_for(100, 3)
    for stage in ("epsilon", "eta"):
        got = np.array(prog(f"sampler s() -> probs {{ {stage}(0) }}", opt)(x).probs)
        assert_probs_match(got, list(x), ctx=f"{stage}(0) is off")
        got = np.array(prog(f"sampler s() -> probs {{ top_k(10) {stage}(0.05) }}", opt)(x).probs)
        ref = [getattr(R, stage)(R.top_k(row, 10), 0.05) for row in x]
        assert_probs_match(got, ref, ctx=f"top_k then {stage}")


# ---------------------------------------------------------------------------------------------- dynamic temperature

@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("V", VS)
def test_dynamic_temperature_matches_llama_cpp(V, opt):
    p = prog("sampler s(t: float, r: float, ex: float = 1) -> probs { dynamic_temperature(t, r, ex) }", opt)
    x = logits_for(V, 5 + V)
    for t, r, ex in ((0.8, 0.5, 1.0), (1.0, 1.0, 2.0), (0.3, 0.5, 0.5), (1.2, 0.4, 0.0), (0.7, 0.0, 1.0),
                     (0.0, 0.0, 1.0), (0.5, 2.0, 1.0)):
        got = np.array(p(x, t=t, r=r, ex=ex).probs)
        cpp = [cpp_temp_ext(row, t, r, ex) for row in x]
        ref = [R.dynamic_temperature(row, t, r, ex) for row in x]
        assert_probs_match(got, cpp, atol=2e-6, rtol=2e-5, ctx=f"dynamic_temperature({t}, {r}, {ex}) vs llama.cpp")
        assert_probs_match(got, ref, atol=2e-6, rtol=2e-5, ctx=f"dynamic_temperature({t}, {r}, {ex}) vs reference")


@pytest.mark.parametrize("opt", OPTS)
def test_dynamic_temperature_counts_only_kept_tokens(opt):
    """N is the number of kept tokens (llama.cpp's array after top_k), not V."""
    x = logits_for(100, 8)
    got = np.array(prog("sampler s() -> probs { top_k(5) dynamic_temperature(1.0, 0.9) }", opt)(x).probs)
    cpp = [cpp_temp_ext(R.top_k(row, 5), 1.0, 0.9, 1.0) for row in x]
    assert_probs_match(got, cpp, atol=2e-6, rtol=2e-5, ctx="top_k then dynamic_temperature")


# ---------------------------------------------------------------------------------------------- DRY

def dry_cases(rng: np.random.Generator):
    """(history rows [B, H] with padding, V): repeats of every length, padding left and in the middle."""
    H, V = 24, 12
    rows = [
        [-1] * 19 + [1, 2, 3, 1, 2],                    # "1 2" repeats: 3 would extend it
        [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7] + [-1] * 13,  # right padding: a long period-4 repeat
        [4] * H,                                        # one token over and over
        list(rng.integers(0, 3, H)),                    # small alphabet: repeats everywhere
        list(rng.integers(0, 5, H)),
        [1, 2, -1, 3, 1, 2, -1, -1, 3, 1, 2] + [-1] * 13,   # padding inside: ignored
        [-1] * H,                                       # empty history
        [0, 9, 9, 0, 9, 9, 0, 9] + list(rng.integers(0, 2, H - 8)),
    ]
    return np.array(rows, dtype=np.int32), V


DRY_SETTINGS = [  # multiplier, base, allowed_length, last_n, breakers
    (0.8, 1.75, 2, -1, []), (0.8, 1.75, 2, 6, []), (1.5, 1.1, 0, -1, []), (0.5, 2.0, 1, -1, [3]),
    (0.8, 1.75, 3, 10, [0, 7]), (0.8, 1.0, 2, -1, []), (0.3, 1e10, 1, -1, []), (0.8, 1.75, 2, 0, []),
    (0.0, 1.75, 2, -1, []), (2.0, 1.75, 2, -1, [4]),
]


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("setting", range(len(DRY_SETTINGS)))
def test_dry_matches_llama_cpp(setting, opt):
    mult, base, allowed, last_n, brk = DRY_SETTINGS[setting]
    hist, V = dry_cases(np.random.default_rng(setting))
    x = np.random.default_rng(100 + setting).normal(0, 2, (hist.shape[0], V)).astype(F32)
    x[1, 3] = -np.inf
    src = (f"sampler s(h: tokens, mult: float, base: float, allowed: int, last_n: int) -> candidates({V}) "
           f"{{ dry(h, mult, base, allowed, last_n, breakers = {brk}) }}")
    out = prog(src, opt)(x, h=hist, mult=mult, base=base, allowed=allowed, last_n=last_n)
    got = np.full_like(x, np.nan)
    np.put_along_axis(got, np.array(out.candidates.ids), np.array(out.candidates.values), axis=-1)
    for r in range(x.shape[0]):
        seq = [int(t) for t in hist[r] if t >= 0]
        cpp = cpp_dry(x[r], seq, mult, base, allowed, last_n, set(brk))
        ref = R.dry(x[r], hist[r], mult, base, allowed, last_n, brk)
        np.testing.assert_allclose(got[r], cpp, rtol=1e-5, atol=1e-6, err_msg=f"row {r} vs llama.cpp")
        np.testing.assert_allclose(got[r], ref, rtol=1e-5, atol=1e-6, err_msg=f"row {r} vs reference")


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("n", [160, 161, 400])
def test_dry_penalty_at_the_exponent_cap_stays_finite(n, opt):
    """A degenerate loop (n repeats of one token): llama.cpp caps the exponent at int(88.7228391 / ln base) = 158
    for base 1.75, a finite penalty of ~2.5e38 -- where float32 exp(158 ln 1.75) = exp(88.42) may overflow (MLX's
    does above 88.0). The token keeps that finite value; a row holding only it still draws it."""
    x = np.array([[1.0, 0.5, 0.2, 0.1], [1.0, -np.inf, -np.inf, -np.inf]], F32)
    hist = np.zeros((2, n), np.int32)
    src = "sampler s(h: tokens) -> token, logprob, candidates(4) { dry(h, 1.0) greedy() }"
    out = prog(src, opt)(x, h=hist)
    got = np.full_like(x, np.nan)
    np.put_along_axis(got, np.array(out.candidates.ids), np.array(out.candidates.values), axis=-1)
    for r in range(2):
        cpp = cpp_dry(x[r], [0] * n, 1.0, 1.75, 2, -1, set())
        assert np.isfinite(cpp[0]) and cpp[0] < -1e38
        np.testing.assert_allclose(got[r], cpp, rtol=1e-5, err_msg=f"row {r}")
    assert np.array(out.token).tolist() == [1, 0] and np.array(out.logprob)[1] == 0.0


@pytest.mark.parametrize("opt", OPTS)
def test_a_row_dry_leaves_without_a_token_is_an_error(opt):
    """A DRY penalty overflowing float32 (multiplier * base^e > 3.4e38) on a row's only kept token: an error naming
    the stage and the row."""
    x = np.array([[1.0, -np.inf, -np.inf, -np.inf], [1.0, 0.5, -np.inf, -np.inf]], F32)
    p = prog("sampler s(h: tokens) -> token { dry(h, 3.0) greedy() }", opt)
    with pytest.raises(samplec.SamplecError, match=r"dry: the penalty leaves no token \(row 0\)"):
        p(x, h=np.zeros((2, 170), np.int32))
    assert np.array(p(x[1:], h=np.zeros((1, 170), np.int32)).token).tolist() == [1]


@pytest.mark.parametrize("opt", OPTS)
def test_dry_breakers_from_a_tokens_parameter(opt):
    """Breakers as a `tokens` parameter: one list per row (padding ignored), the same rule as a constant list."""
    hist, V = dry_cases(np.random.default_rng(7))
    x = np.random.default_rng(8).normal(0, 2, (hist.shape[0], V)).astype(F32)
    brk = np.full((hist.shape[0], 2), -1, dtype=np.int32)
    brk[0] = [3, -1]
    brk[3] = [1, 2]
    brk[4, 0] = 0
    brk[2, 0] = 4
    p = prog(f"sampler s(h: tokens, b: tokens) -> candidates({V}) {{ dry(h, 0.8, breakers = b) }}", opt)
    out = p(x, h=hist, b=brk)
    got = np.full_like(x, np.nan)
    np.put_along_axis(got, np.array(out.candidates.ids), np.array(out.candidates.values), axis=-1)
    changed = 0
    for r in range(x.shape[0]):
        b = {int(t) for t in brk[r] if t >= 0}
        cpp = cpp_dry(x[r], [int(t) for t in hist[r] if t >= 0], 0.8, 1.75, 2, -1, b)
        np.testing.assert_allclose(got[r], cpp, rtol=1e-6, atol=1e-6, err_msg=f"row {r}")
        changed += bool(b) and not np.array_equal(cpp, cpp_dry(x[r], [int(t) for t in hist[r] if t >= 0],
                                                         0.8, 1.75, 2, -1, set()))
    assert changed >= 2      # the breakers matter in these rows


@pytest.mark.uncompiled
@pytest.mark.parametrize("piece", [1 << 22, 50])
def test_dry_repeats_op_random_histories(piece, monkeypatch):
    """The device search (dry_repeats) against llama.cpp's Z-algorithm on many random histories, in one piece and
    in many (the comparison is split into pieces to bound its memory)."""
    from samplec.backend_mlx import kernels
    monkeypatch.setattr(kernels, "DRY_CHUNK", piece)
    rng = np.random.default_rng(0)
    V = 6
    p = samplec.compile(f"sampler s(h: tokens, a: int) -> candidates({V}) {{ dry(h, 1.0, 2.0, a) }}", opt_level=0)
    for trial in range(20):
        H = int(rng.integers(1, 40))
        hist = rng.integers(-1, 4 if trial % 2 else V, (4, H)).astype(np.int32)
        x = rng.normal(0, 1, (4, V)).astype(F32)
        for a in (0, 1, 2):
            out = p(x, h=hist, a=a)
            got = np.full_like(x, np.nan)
            np.put_along_axis(got, np.array(out.candidates.ids), np.array(out.candidates.values), axis=-1)
            for r in range(4):
                cpp = cpp_dry(x[r], [int(t) for t in hist[r] if t >= 0], 1.0, 2.0, a, -1, set())
                np.testing.assert_allclose(got[r], cpp, rtol=1e-6, atol=1e-6, err_msg=f"{trial} {a} row {r}")


# ---------------------------------------------------------------------------------------------- mirostat

MIRO = {
    "mirostat": "sampler s(mu: state, seed: seed, tau: float = 5.0, eta: float = 0.1, m: int = 100) "
                "-> token, mu, probs, logprob { mirostat(mu, tau, eta, m, seed) }",
    "mirostat_v2": "sampler s(mu: state, seed: seed, tau: float = 5.0, eta: float = 0.1) "
                   "-> token, mu, probs, logprob { mirostat_v2(mu, tau, eta, seed) }",
}


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("V", VS)
@pytest.mark.parametrize("stage", ["mirostat", "mirostat_v2"])
def test_mirostat_matches_llama_cpp(stage, V, opt):
    """The truncated set and its probabilities are llama.cpp's, the token is the reference's RandomBits draw from
    it, the updated mu is llama.cpp's rule applied to that token, `logprob` is under the truncated distribution and
    `probs` is the distribution before the terminal (spec section 3)."""
    p = prog(MIRO[stage], opt)
    x = logits_for(V, 21 + V)
    B = x.shape[0]
    for tau, eta, mu, m in ((5.0, 0.1, None, 100), (3.0, 0.2, [1.0, 2.5, 4.0, 8.0, 0.5, 6.0, 3.0, 12.0][:B], 100),
                            (2.0, 0.5, None, 2), (0.5, 1.0, [0.1] * B, 5)):
        kw = dict(seed=np.arange(B) + 7, tau=tau, eta=eta) | ({"m": m} if stage == "mirostat" else {})
        out = p(x, **kw) if mu is None else p(x, mu=np.array(mu, dtype=F32), **kw)
        mus = [2 * tau] * B if mu is None else mu
        tok, new_mu, probs = np.array(out.token), np.array(out.mu), np.array(out.probs)
        for r in range(B):
            ids, pc = cpp_mirostat_keep(x[r], mus[r], m if stage == "mirostat" else None)
            np.testing.assert_allclose(probs[r], R.softmax64(x[r]), rtol=1e-5, atol=1e-7, err_msg=f"row {r}")
            assert tok[r] in set(ids.tolist()), f"row {r}: token {tok[r]} outside llama.cpp's kept set"
            np.testing.assert_allclose(probs[r][ids] / probs[r][ids].sum(dtype=np.float64), pc, rtol=1e-5,
                                       atol=1e-6, err_msg=f"row {r}")
            ref_args = (x[r], mus[r], tau, eta) + ((m,) if stage == "mirostat" else ())
            ref_tok, ref_mu, _ = getattr(R, stage)(*ref_args, seed=7 + r)
            assert tok[r] == ref_tok, f"row {r}: token {tok[r]} != reference {ref_tok}"
            p_tok = pc[list(ids).index(tok[r])]
            assert new_mu[r] == pytest.approx(cpp_mu_update(mus[r], tau, eta, p_tok), abs=2e-5, rel=1e-5)
            assert new_mu[r] == pytest.approx(ref_mu, abs=2e-5, rel=1e-5)
            assert float(np.array(out.logprob)[r]) == pytest.approx(math.log(p_tok), abs=1e-5)


@pytest.mark.parametrize("opt", OPTS)
def test_mirostat_s_hat_over_a_gap_past_float32s_exp(opt):
    """A head of 50 tokens ~100 above the rest (a logit_bias of +100): the probabilities past the gap are below
    float32's smallest normal, which MLX's exp gives as 0. s_hat comes from the logits' differences (ln(p_i /
    p_{i+1}) = x_i - x_{i+1}), so k is the reference's (float64), not NaN -> 1 (the argmax alone)."""
    rng = np.random.default_rng(0)
    V = 50_000
    x = rng.normal(0, 2, V).astype(F32)
    head = rng.choice(V, 50, replace=False)
    x[head] = (F32(100.0) - np.log(np.arange(1, 51))).astype(F32)
    p = prog(MIRO["mirostat"], opt)
    for seed in (1, 2, 3):
        out = p(x[None], mu=np.array([6.0], F32), seed=seed, tau=5.0, eta=0.1, m=100)
        ref_tok, ref_mu, _ = R.mirostat(x, 6.0, 5.0, 0.1, 100, seed=seed)
        assert int(np.array(out.token)[0]) == ref_tok, seed
        assert float(np.array(out.mu)[0]) == pytest.approx(ref_mu, abs=2e-5, rel=1e-5)
        assert float(np.array(out.logprob)[0]) < -1e-3          # (more than the argmax kept)


@pytest.mark.parametrize("stage", ["mirostat", "mirostat_v2"])
def test_mirostat_frequencies_match_the_truncated_distribution(stage):
    """4000 draws (one per seed) from a fixed row: chi-square against llama.cpp's truncated distribution."""
    scipy_stats = pytest.importorskip("scipy.stats")
    x = np.array([3.0, 2.6, 2.2, 2.0, 1.5, 1.0, 0.2, -1.0, -2.0, -4.0, -6.0, -9.0], dtype=F32)
    N, mu = 4000, (5.0 if stage == "mirostat" else 3.0)
    p = prog(MIRO[stage], 2)
    out = p(np.tile(x, (N, 1)), mu=np.full(N, mu, dtype=F32), seed=np.arange(N, dtype=np.uint64) + 1000, m=100) \
        if stage == "mirostat" else p(np.tile(x, (N, 1)), mu=np.full(N, mu, dtype=F32),
                                      seed=np.arange(N, dtype=np.uint64) + 1000)
    ids, pc = cpp_mirostat_keep(x, mu, 100 if stage == "mirostat" else None)
    assert 3 <= len(ids) < len(x)         # a real truncation
    counts = np.bincount(np.array(out.token), minlength=len(x))
    assert counts[np.setdiff1d(np.arange(len(x)), ids)].sum() == 0
    expected = pc.astype(np.float64) / pc.sum() * N
    assert scipy_stats.chisquare(counts[ids], expected).pvalue > 1e-3


def test_missing_state_starts_at_two_tau_and_nan_rows_restart():
    p = prog(MIRO["mirostat_v2"], 2)
    x = logits_for(100, 4)[:3]
    fresh = p(x, seed=1, tau=4.0)
    given = p(x, seed=1, tau=4.0, mu=np.full(3, 8.0, dtype=F32))
    np.testing.assert_array_equal(np.array(fresh.mu), np.array(given.mu))
    mixed = p(x, seed=1, tau=4.0, mu=np.array([np.nan, 1.0, np.nan], dtype=F32))
    np.testing.assert_array_equal(np.array(mixed.mu)[[0, 2]], np.array(fresh.mu)[[0, 2]])
    assert np.array(mixed.mu)[1] != np.array(fresh.mu)[1]


def test_state_threads_through_steps():
    """Feeding the output mu back reproduces llama.cpp's mu sequence over several steps."""
    p = prog(MIRO["mirostat_v2"], 2)
    rng = np.random.default_rng(2)
    mu, ref_mu = None, 2 * 5.0
    for step in range(6):
        x = rng.normal(0, 3, (1, 50)).astype(F32)
        out = p(x, seed=step, **({} if mu is None else {"mu": mu}))
        ids, pc = cpp_mirostat_keep(x[0], ref_mu, None)
        tok = int(np.array(out.token)[0])
        ref_mu = cpp_mu_update(ref_mu, 5.0, 0.1, pc[list(ids).index(tok)])
        mu = out.mu
        assert float(np.array(mu)[0]) == pytest.approx(ref_mu, abs=1e-4)


# ---------------------------------------------------------------------------------------------- checks and errors

@pytest.mark.parametrize("src, call, message", [
    ("sampler s(h: tokens, m: float) -> probs { dry(h, m) }", {"m": -0.5}, "m = -0.5 is out of range"),
    ("sampler s(h: tokens, b: float) -> probs { dry(h, 0.8, b) }", {"b": 0.5}, "b = 0.5 is out of range"),
    ("sampler s(mu: state, t: float) { mirostat_v2(mu, t, 0.1, 1) }", {"t": [1.0, 0.0]},
     r"t = 0 is out of range \(0, inf\) \(row 1\)"),
    ("sampler s(mu: state, e: float) { mirostat(mu, 5, e, seed = 1) }", {"e": -1}, "e = -1 is out of range"),
    ("sampler s(e: float) -> probs { epsilon(e) }", {"e": [0.1, 1.0, 0.2]},
     r"e = 1 is out of range \[0, 1\) \(row 1\)"),
    ("sampler s(e: float) -> probs { eta(e) }", {"e": -0.1}, "e = -0.1 is out of range"),
    ("sampler s(r: float) -> probs { dynamic_temperature(1, r) }", {"r": -1}, "r = -1 is out of range"),
])
def test_run_time_ranges_name_parameter_and_rows(src, call, message):
    x = logits_for(7, 1)[:3] if not any(isinstance(v, list) and len(v) == 2 for v in call.values()) \
        else logits_for(7, 1)[:2]
    if "tokens" in src:
        call = call | {"h": np.zeros((x.shape[0], 3), dtype=np.int32)}
    with pytest.raises(SamplecError, match=message) as e:
        prog(src, 2)(x, **call)
    assert "row" in str(e.value)


@pytest.mark.parametrize("src, message", [
    ("sampler s(h: tokens) { dry(h, -1) greedy() }", "dry: multiplier = -1 is out of range [0.0, inf)"),
    ("sampler s(h: tokens) { dry(h, 1, breakers = [1, -2]) greedy() }", "token id -2 is out of range"),
    ("sampler s() { top_k([1, 2]) greedy() }", "a list literal is only allowed in dry's breakers"),
    ("sampler s(h: tokens) { dry(h, 1, breakers = 3) greedy() }", "breakers must be a list of token ids"),
    ("sampler s(mu: state = 1.0) { mirostat_v2(mu, 5, 0.1) }", "a 'state' parameter cannot have a default"),
    ("sampler s(mu: float) { mirostat_v2(mu, 5, 0.1) }", "mu must be a 'state' parameter"),
    ("sampler s() { mirostat_v2(10.0, 5, 0.1) }", "mu must be a 'state' parameter, not a number"),
    ("sampler s(mu: state) -> token, mu(2) { mirostat_v2(mu, 5, 0.1) }", "takes no argument"),
    ("sampler s(mu: state) -> token, nu { mirostat_v2(mu, 5, 0.1) }", "unknown output 'nu' (outputs: token, logprob, raw_logprob, top_logprobs, probs, candidates, mu)"),
    ("sampler s(mu: state) { top_k(5) mirostat(mu, 5, 0.1) mirostat_v2(mu, 5, 0.1) }",
     "state 'mu' is already read by 'mirostat'"),
    ("sampler s(token: state) { mirostat_v2(token, 5, 0.1) }", "a state parameter cannot be called 'token'"),
    ("sampler s(mu: state) -> token, mu { greedy() }", "output 'mu': no stage reads the state 'mu'"),
    ("sampler s(mu: state) { mirostat_v2(mu, 0, 0.1) }", "mirostat_v2: tau = 0 is out of range (0.0, inf)"),
])
def test_compile_time_errors(src, message):
    with pytest.raises(SamplecError) as e:
        samplec.compile(src)
    assert message in str(e.value)


def test_v2_stages_in_O2_chains_equal_O0():
    """The §6 stages run by their dense definitions inside -O2 programs whose other stages run in the chain kernel:
    the tokens are those of -O0."""
    base = "sampler s(seed: seed, h: tokens) -> token {{ top_k(40) {} temperature(0.9) sample(seed) }}"
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 3000)).astype(np.float32) * 2
    h = rng.integers(0, 3000, (3, 16)).astype(np.int32)
    for stage in ("epsilon(0.01)", "eta(0.01)", "dynamic_temperature(0.8, 0.3)", "dry(h, 0.8)"):
        src = base.format(stage)
        o2, o0 = samplec.compile(src, opt_level=2), samplec.compile(src, opt_level=0)
        for seed in range(3):
            assert np.array(o2(x, seed=seed, h=h).token).tolist() == np.array(o0(x, seed=seed, h=h).token).tolist()


def test_smpb_round_trip_and_inspect(tmp_path):
    src = ("sampler s(h: tokens, b: tokens, mu: state, seed: seed) -> token, mu, logprob {\n"
           "  dry(h, 0.8, breakers = [3, 5]) dry(h, 0.4, breakers = b) epsilon(1e-4) eta(1e-3)\n"
           "  dynamic_temperature(0.9, 0.3, 1.5) mirostat(mu, 4.0, 0.2, 50, seed)\n}")
    p = samplec.compile(src)
    path = tmp_path / "v2.smpb"
    p.save(path)
    q = samplec.load(path)
    assert q.ir() == p.ir()
    assert q.ir().count("= dry %") == 2 and "param %mu: f32[B] state = nan" in q.ir()
    x = logits_for(100, 9)
    kw = dict(h=np.tile(np.arange(20, dtype=np.int32) % 7, (x.shape[0], 1)), b=np.array([[6]] * x.shape[0]),
              seed=3)
    a, b = p(x, **kw), q(x, **kw)
    for name in ("token", "mu", "logprob"):
        np.testing.assert_array_equal(np.array(getattr(a, name)), np.array(getattr(b, name)))
    from typer.testing import CliRunner

    from samplec.cli import app
    res = CliRunner().invoke(app, ["inspect", str(path)])
    assert res.exit_code == 0 and "= dry %" in res.output and "output mu = " in res.output


def test_batch_invariance():
    """A row's token and state do not depend on the other rows."""
    p = prog(MIRO["mirostat"], 2)
    x = logits_for(100, 10)
    seeds = np.arange(x.shape[0], dtype=np.uint64) + 5
    whole = p(x, seed=seeds)
    for r in range(x.shape[0]):
        one = p(x[r:r + 1], seed=seeds[r:r + 1])
        assert int(np.array(one.token)[0]) == int(np.array(whole.token)[r])
        assert float(np.array(one.mu)[0]) == float(np.array(whole.mu)[r])


def test_mlx_inputs():
    p = prog(MIRO["mirostat_v2"], 0)
    out = p(mx.array(logits_for(7, 2)), seed=1, mu=mx.full((8,), 3.0))
    assert out.mu.shape == (8,)


# ---------------------------------------------------------------------------------------------- state in decode loops

STATEFUL = ("sampler m(mu: state, seed: seed, pos: int = 0, history: tokens) -> token, mu {\n"
            "  dry(history, 0.8, breakers = [13]) top_k(50) mirostat_v2(mu, 3.0, 0.5, seed, pos)\n}")
PROMPT = [5, 17, 300, 42, 7, 9, 5]


def stateful_reference(model, prog, prompt, n, seed):
    """The contract by hand: one model step at a time, position = index, history = sequence, mu fed back."""
    from mlx_lm.models.cache import make_prompt_cache
    cache = make_prompt_cache(model)
    seq = list(prompt)
    model(mx.array(seq[:-1])[None], cache=cache)
    logits = model(mx.array(seq[-1:])[None], cache=cache)[:, -1, :]
    toks, mus, mu = [], [], None
    for _ in range(n):
        kw = dict(seed=seed, pos=len(seq), history=np.array(seq, dtype=np.int32))
        out = prog(logits, **kw) if mu is None else prog(logits, mu=mu, **kw)
        mu = out.mu
        toks.append(int(out.token[0]))
        mus.append(float(np.array(mu)[0]))
        seq.append(toks[-1])
        logits = model(mx.array([toks[-1]])[None], cache=cache)[:, -1, :]
    return toks, mus


@pytest.mark.uncompiled
def test_decode_and_adapter_thread_the_state():
    pytest.importorskip("mlx_lm")
    from mlx_lm.generate import generate_step

    from samplec.decode import generate
    from samplec.integrations.mlx_lm import Sampler, random_llama
    model = random_llama(0, layers=2, hidden=64, vocab=512)
    prog = samplec.compile(STATEFUL)
    toks, mus = stateful_reference(model, prog, PROMPT, 16, seed=4)
    assert len(set(np.round(mus, 4))) > 3                     # mu really moves
    for chunk in (1, 5):
        assert generate(model, prog, PROMPT, 16, chunk=chunk, seed=4) == toks
    assert generate(model, prog, PROMPT, 16, chunk=4, seed=4, mu=6.0) == toks        # 2 * tau: the start value
    assert generate(model, prog, PROMPT, 16, chunk=4, seed=4, mu=0.01) != toks      # another start, other tokens
    s = Sampler(prog, seed=4)
    got = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=16, sampler=s,
                                       logits_processors=s.logits_processors)]
    assert got == toks
    np.testing.assert_allclose([float(np.array(st.outputs.mu)[0]) for st in s.steps[:16]], mus, rtol=1e-6)
    with pytest.raises(SamplecError, match="state parameter 'mu' but no output 'mu'"):
        generate(model, samplec.compile(STATEFUL.replace("-> token, mu", "-> token")), PROMPT, 2)


def test_run_draws_threads_the_state(tmp_path):
    """`samplec run --draws` with mirostat: draw i takes the mu of draw i - 1; the expected frequencies are the
    mean of the steps' distributions (checked against a loop by hand)."""
    from typer.testing import CliRunner

    from samplec import runner
    from samplec.cli import app
    src = "sampler m(mu: state, seed: seed) -> token, mu { mirostat_v2(mu, 2.0, 0.3, seed) }"
    x = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=F32)
    p = samplec.compile(src)
    res = runner.draws(p, mx.array(x), {"seed": 10}, 50)
    mu, counts, mean = None, np.zeros(7, int), np.zeros(7)
    for i in range(50):
        out = p(x, seed=10 + i, **({} if mu is None else {"mu": mu}))
        mu = out.mu
        counts[int(out.token[0])] += 1
        _, _, xt = R.mirostat_v2(x, 4.0 if i == 0 else float(prev), 2.0, 0.3, 10 + i)
        mean += R.softmax64(xt) / 50
        prev = float(np.array(mu)[0])
    row = res["rows"][0]
    assert {t: c for t, c in zip(row["tokens"], row["counts"]) if c} == {i: int(c) for i, c in enumerate(counts) if c}
    for t, pr in zip(row["tokens"], row["probability"]):
        assert pr == pytest.approx(mean[t], abs=1e-5)
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "m.smp").write_text(src)
    r = CliRunner().invoke(app, ["run", str(tmp_path / "m.smp"), "--logits", str(tmp_path / "x.npy"),
                                 "--seed", "10", "--draws", "50", "--json"])
    assert r.exit_code == 0, r.output
    assert '"draws": 50' in r.output
    r = CliRunner().invoke(app, ["run", str(tmp_path / "m.smp"), "--logits", str(tmp_path / "x.npy"),
                                 "--seed", "1", "--param", "mu=3.5", "--json"])
    assert r.exit_code == 0 and '"mu"' in r.output, r.output


def test_reference_dry_equals_the_llama_cpp_transcription():
    """The reference's naive search and the transcribed Z-algorithm agree on many random histories (pure numpy:
    the two oracles the device search is held to are themselves consistent)."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        V = int(rng.integers(2, 8))
        hist = rng.integers(-1, V, int(rng.integers(0, 30)))
        x = rng.normal(0, 1, V).astype(F32)
        allowed, last_n = int(rng.integers(0, 4)), int(rng.choice([-1, 0, 3, 8, 20]))
        brk = set(rng.choice(V, int(rng.integers(0, 3)), replace=False).tolist())
        base = float(rng.choice([1.0, 1.75, 3.0]))
        cpp = cpp_dry(x, [int(t) for t in hist if t >= 0], 0.7, base, allowed, last_n, brk)
        ref = R.dry(x, hist, 0.7, base, allowed, last_n, sorted(brk))
        np.testing.assert_allclose(ref, cpp, rtol=1e-6, atol=1e-6)


@pytest.mark.uncompiled
def test_dry_repeats_native_equals_the_mlx_ops(monkeypatch):
    """The native dry_repeats (the Z-algorithm over the reversed window, O(H)) gives the MLX ops' [B, H, H]
    comparison's result: windows right-aligned behind padding, repeats, a token alphabet of 2 to V, ids past V
    read at V - 1."""
    import mlx.core as mx

    from samplec.backend_mlx import kernels, native
    if not native.enabled():
        pytest.skip("the native primitives are not built")
    rng = np.random.default_rng(3)
    for trial in range(60):
        B, H, V = int(rng.integers(1, 5)), int(rng.integers(1, 300)), int(rng.integers(2, 400))
        w = rng.integers(0, int(rng.choice([2, 5, V + 3])), (B, H)).astype(np.int32)
        for r in range(B):
            w[r, :int(rng.integers(0, H + 1))] = -1                  # (the window behind its padding)
        x = mx.zeros((B, V))
        fast = np.array(kernels._dry_repeats([mx.array(w), x], {}))
        monkeypatch.setenv("SAMPLEC_NATIVE", "0")
        slow = np.array(kernels._dry_repeats([mx.array(w), x], {}))
        monkeypatch.setenv("SAMPLEC_NATIVE", "1")
        np.testing.assert_array_equal(fast, slow, err_msg=f"trial {trial}")


@pytest.mark.parametrize("opt,target", [(0, "cpu"), (2, "cpu"), (2, "portable")])
def test_dynamic_temperature_entropy_on_peaked_rows(opt, target, monkeypatch):
    """On a peaked row the entropy is about the tail's mass (below 2^-24 of the top's here): every path computes
    it as float64 does -- the dense definition as ln Z - sum p d with the tail kept (a float32 sum of p log p lost
    the top token's term: T ~5% off) -- so T, and the final logits, agree with float64 to float32 precision."""
    monkeypatch.setenv("SAMPLEC_NATIVE", "1" if opt == 2 and target == "cpu" else "0")
    rows = np.array([[25, 5, 5, 5], [30, 10, 9, 8], [12, -4, -5, -30], [3, 3, -20, -21]], np.float32)
    prog = samplec.compile("sampler s() -> candidates(4) { dynamic_temperature(0.5, 2.0, 1.5) }",
                           opt_level=opt, target=target)
    got = prog(rows).candidates
    for b, row in enumerate(rows.astype(np.float64)):
        d = row - row.max()
        p = np.exp(d) / np.exp(d).sum()
        H = -(p * np.log(p)).sum()
        lo = max(0.0, 0.5 - 2.0)
        T = lo + (0.5 + 2.0 - lo) * (H / math.log(len(row))) ** 1.5
        ids = np.array(got.ids[b])
        np.testing.assert_allclose(np.array(got.values[b]), (row / T)[ids], rtol=2e-6)
