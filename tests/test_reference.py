"""Self-tests of the numpy oracle in tests/reference.py (independent of samplec/)."""

from __future__ import annotations

import math

import numpy as np
import pytest

try:  # works whether or not tests/ is a package
    from . import reference as R
except ImportError:
    import reference as R  # type: ignore[no-redef]

F32 = np.float32
NI = -np.inf


def f32(*v):
    return np.array(v, dtype=F32)


def kept_ids(x):
    return np.flatnonzero(np.isfinite(x)).tolist()


# ---------------------------------------------------------------------------- §4 randomness


def test_threefry_known_answers():
    a, b = R.threefry2x32((0, 0), (0, 0))
    assert (int(a), int(b)) == (0x6B200159, 0x99BA4EFE)
    a, b = R.threefry2x32((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF))
    assert (int(a), int(b)) == (0x1CB996FC, 0xBB002BE7)


def test_threefry_vectorized_matches_scalar():
    key = (0x12345678, 0x9ABCDEF0)
    c0 = np.arange(50, dtype=np.uint32) * np.uint32(7919)
    c1 = np.full(50, 3, dtype=np.uint32)
    w0, w1 = R.threefry2x32(key, (c0, c1))
    assert w0.dtype == np.uint32 and w0.shape == (50,)
    for i in range(0, 50, 7):
        s0, s1 = R.threefry2x32(key, (int(c0[i]), 3))
        assert (int(s0), int(s1)) == (int(w0[i]), int(w1[i]))
    # negative ints wrap modulo 2**32
    n0, _ = R.threefry2x32((-1, -1), (-1, -1))
    assert int(n0) == 0x1CB996FC


def test_key_of():
    assert R.key_of(0) == (0, 0)
    assert R.key_of(5) == (0, 5)
    assert R.key_of((3 << 32) | 9) == (3, 9)
    assert R.key_of(2**64 - 1) == (0xFFFFFFFF, 0xFFFFFFFF)
    with pytest.raises(ValueError):
        R.key_of(-1)
    with pytest.raises(ValueError):
        R.key_of(2**64)


@pytest.mark.parametrize("seed", [0, 1, 7, 42, 2**31 + 5, 2**32 - 1, 2**32, 2**32 + 7, 123456789012345, 2**63 + 11, 2**64 - 1])
def test_mlx_cross_check(seed):
    mx = pytest.importorskip("mlx.core")
    w0, w1 = R.threefry2x32(R.key_of(seed), (0, 1))
    upper = np.nextafter(F32(1), F32(0))
    want0 = min(F32(w0) / F32(4294967295), upper)
    want1 = min(F32(w1) / F32(4294967295), upper)
    got = np.array(mx.random.uniform(shape=(2,), key=mx.random.key(seed)))
    assert got.dtype == np.float32
    assert got[0] == want0  # the §4 contract
    assert got[1] == want1  # second output word of the same block
    assert np.array(mx.random.key(seed)).tolist() == list(R.key_of(seed))


def test_uniform_exact_and_open_interval():
    u = R.uniform(np.array([0, 511, 512, 0xFFFFFFFF], dtype=np.uint32))
    assert u.dtype == np.float32
    assert u[0] == F32(0.5 * 2**-23) and u[1] == u[0]
    assert u[2] == F32(1.5 * 2**-23)
    assert u[3] == F32((2**23 - 0.5) * 2**-23) and u[3] < 1
    assert np.all((u > 0) & (u < 1))


def test_gumbel_and_bits_for_tokens():
    bits = R.bits_for_tokens(0, 0, 4)
    assert bits.dtype == np.uint32 and int(bits[0]) == 0x6B200159  # KAT: key (0,0), counter (0,0)
    for i in range(4):
        assert int(bits[i]) == int(R.threefry2x32((0, 0), (i, 0))[0])
    g = R.gumbel(bits)
    assert g.dtype == np.float32
    u = ((0x6B200159 >> 9) + 0.5) * 2**-23
    assert abs(float(g[0]) - (-math.log(-math.log(u)))) < 1e-5
    # position changes the counter's second word
    assert not np.array_equal(R.bits_for_tokens(0, 1, 4), bits)


def test_xtc_coin_known_answer():
    # seed 2**64-1 -> key (F..F, F..F); position 0xFFFFFFFF -> counter (F..F, F..F): the 2nd KAT
    u = R.xtc_coin(2**64 - 1, 0xFFFFFFFF)
    assert isinstance(u, np.float32)
    assert u == F32(((0x1CB996FC >> 9) + 0.5) * 2**-23)
    w0, _ = R.threefry2x32(R.key_of(9), (0xFFFFFFFF, 4))
    assert R.xtc_coin(9, 4) == R.uniform(w0)


# ---------------------------------------------------------------------------- §2 stages


def test_temperature():
    x = f32(1, 2, 2, NI)
    assert R.temperature(x, 0).tolist() == [NI, 2, NI, NI]  # argmax, lowest id
    assert R.temperature(x, 2).tolist() == [0.5, 1, 1, NI]
    assert np.array_equal(R.temperature(x, 1), x)
    y = R.temperature(f32(1, 2, 3), 0.7)
    assert np.array_equal(y, f32(1, 2, 3) / F32(0.7)) and y.dtype == np.float32
    assert R.temperature(x, np.inf).tolist() == [0, 0, 0, NI]
    with pytest.raises(ValueError):
        R.temperature(x, -1)
    with pytest.raises(ValueError):
        R.temperature(x, float("nan"))
    assert x.tolist() == [1, 2, 2, NI]  # input untouched


def test_top_k():
    x = f32(1, 3, 3, 2, NI)
    assert kept_ids(R.top_k(x, 1)) == [1, 2]  # ties at v_k all kept
    assert kept_ids(R.top_k(x, 2)) == [1, 2]
    assert kept_ids(R.top_k(x, 3)) == [1, 2, 3]
    assert kept_ids(R.top_k(x, 4)) == [0, 1, 2, 3]
    for off in (0, -1, 5, 6):
        assert np.array_equal(R.top_k(x, off), x)
    # fewer kept tokens than k: nothing changes, removed stay removed
    assert R.top_k(f32(0, NI, NI, NI), 2).tolist() == [0, NI, NI, NI]
    assert R.top_k(x, 3).tolist() == [NI, 3, 3, 2, NI]


def test_top_p_hand():
    x = np.log(f32(4, 2, 1, 1))  # p = .5, .25, .125, .125; S = 0, .5, .75, .75
    assert kept_ids(R.top_p(x, 0.45)) == [0]
    assert kept_ids(R.top_p(x, 0.55)) == [0, 1]
    assert kept_ids(R.top_p(x, 0.7)) == [0, 1]
    assert kept_ids(R.top_p(x, 0.8)) == [0, 1, 2, 3]  # the tie group shares S = .75: both kept
    assert kept_ids(R.top_p(x, 1e-9)) == [0]
    assert kept_ids(R.top_p(f32(1, 1, 0), 1e-9)) == [0, 1]  # most probable group always kept
    assert np.array_equal(R.top_p(x, 1.0), x)
    for bad in (0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            R.top_p(x, bad)
    # removed tokens are ignored and stay removed
    assert kept_ids(R.top_p(f32(NI, 0, 0, NI), 0.3)) == [1, 2]


def test_top_p_matches_definition():
    rng = np.random.default_rng(1)
    for _ in range(200):
        V = int(rng.integers(2, 12))
        x = (rng.integers(-4, 4, size=V) * 0.5).astype(F32)  # many ties
        x[rng.random(V) < 0.2] = NI
        if not np.isfinite(x).any():
            x[0] = 0
        p = float(rng.choice([0.1, 0.3, 0.5, 0.7, 0.9, 0.99]))
        probs = R.softmax32(x)
        want = []
        for i in range(V):
            if not np.isfinite(x[i]):
                continue
            order = np.argsort(-probs, kind="stable")
            S = F32(0)
            for j in order:  # descending p, float32 accumulation
                if probs[j] > probs[i]:
                    S = F32(S + probs[j])
            if S < F32(p):
                want.append(i)
        assert kept_ids(R.top_p(x, p)) == want, (x, p)


def test_top_p_mass_does_not_drift_on_long_nuclei():
    """A head of 99% of the mass, then 152,063 tail tokens of ~6.6e-8 each: a sequential float32 running sum adds
    each as one ulp of its ~0.99 (5.96e-8) and crosses 0.999 ~14,000 tokens late. The reference's S_i is the exact
    mass above (a float64 sum of the float32 p), and samplec at -O0 and -O2 keeps the same tokens."""
    import samplec
    V = 152064
    x = np.random.default_rng(3).uniform(-0.01, 0.01, V).astype(F32)
    x[0] = F32(math.log(99 * (V - 1)))
    probs = R.softmax32(x)
    u, inverse, counts = np.unique(probs, return_inverse=True, return_counts=True)
    mass = u.astype(np.float64) * counts
    above = np.cumsum(mass[::-1])[::-1] - mass             # (the mass of strictly larger probabilities)
    want = above[inverse] < float(F32(0.999))
    assert 130_000 < want.sum() < 145_000
    kept = np.isfinite(R.top_p(x, 0.999))
    assert np.array_equal(kept, want)
    for opt in (0, 2):
        out = samplec.compile("sampler s() -> probs { top_p(0.999) }", opt_level=opt)(x[None])
        assert np.array_equal(np.array(out.probs)[0] > 0, kept), opt


def test_min_p():
    m = 0.5
    x = np.array([0, np.log(F32(m)), np.log(F32(0.1)), NI], dtype=F32)
    assert kept_ids(R.min_p(x, m)) == [0, 1]  # x_1 == max + ln m exactly: kept
    assert kept_ids(R.min_p(x, 0.51)) == [0]
    assert kept_ids(R.min_p(x, 0.05)) == [0, 1, 2]
    assert np.array_equal(R.min_p(x, 0), x)
    assert kept_ids(R.min_p(f32(3, 1, 3), 1)) == [0, 2]
    # shift invariance: uses max(x) + ln m, not absolute values
    assert kept_ids(R.min_p(x + F32(10), 0.3)) == [0, 1]
    for bad in (-0.1, 1.01, 2, float("nan")):
        with pytest.raises(ValueError):
            R.min_p(x, bad)


def test_typical_p_hand():
    # p = .4 .3 .2 .1: H = 1.2799; s = .3636 .0759 .3296 1.0227; ascending ids 1, 2, 0, 3
    x = np.log(f32(0.4, 0.3, 0.2, 0.1))
    assert kept_ids(R.typical_p(x, 0.25)) == [0, 1]  # s* = s_1; token 0 kept as the max
    assert kept_ids(R.typical_p(x, 0.4)) == [0, 1, 2]  # s* = s_2
    assert kept_ids(R.typical_p(x, 0.85)) == [0, 1, 2]  # s* = s_0 (cumsum .9 >= .85)
    assert kept_ids(R.typical_p(x, 0.95)) == [0, 1, 2, 3]
    assert np.array_equal(R.typical_p(x, 1.0), x)
    assert np.array_equal(R.typical_p(x, 1.5), x)
    # p = .7 .2 .1: s ascending in id order
    y = np.log(f32(0.7, 0.2, 0.1))
    assert kept_ids(R.typical_p(y, 0.5)) == [0]
    assert kept_ids(R.typical_p(y, 0.8)) == [0, 1]
    # tie in s at the boundary: p = .4 .3 .3, s_1 == s_2 < s_0; both tied tokens kept
    z = np.log(f32(0.4, 0.3, 0.3, 0.0001))
    assert kept_ids(R.typical_p(z, 0.2)) == [0, 1, 2]
    with pytest.raises(ValueError):
        R.typical_p(x, -0.1)


def test_typical_p_underflow_and_never_reached():
    # exp(-200) underflows in float32: p = 0, s = inf, never kept (0 log 0 = 0 in H)
    assert kept_ids(R.typical_p(f32(0, -200, NI), 0.9)) == [0]
    # a row whose float32 cumulative mass (in ascending-s order) stays below m: s* = largest
    # FINITE s -> every token with p > 0 kept, the underflowed one (s = inf) removed
    x = f32(0.8, -1.0, -1.7, -3.2, -3.4, -200.0)
    probs = R.softmax32(x)
    assert probs[5] == 0
    order = np.argsort(-probs, kind="stable")  # here ascending s coincides with descending p
    m = 0.99999994
    assert np.cumsum(probs[order], dtype=F32)[-1] < F32(m)
    assert kept_ids(R.typical_p(x, m)) == [0, 1, 2, 3, 4]


def test_top_n_sigma():
    x = f32(2, 0, -2, NI)  # mean 0, population std sqrt(8/3) = 1.633
    assert kept_ids(R.top_n_sigma(x, 1)) == [0]
    assert kept_ids(R.top_n_sigma(x, 1.5)) == [0, 1]
    assert kept_ids(R.top_n_sigma(x, 3)) == [0, 1, 2]
    assert np.array_equal(R.top_n_sigma(x, 0), x)
    assert np.array_equal(R.top_n_sigma(x, -1), x)
    assert kept_ids(R.top_n_sigma(f32(1, -1), 2)) == [0, 1]  # threshold exactly -1: kept
    assert kept_ids(R.top_n_sigma(f32(1, -1), 1.99)) == [0]
    assert R.top_n_sigma(f32(1, NI), 1).tolist() == [1, NI]  # std 0
    assert R.top_n_sigma(f32(1, NI), np.inf).tolist() == [1, NI]  # inf * 0: max still kept
    assert kept_ids(R.top_n_sigma(f32(5, 5, 0), 0.1)) == [0, 1]


def test_xtc():
    x = np.log(f32(0.5, 0.3, 0.2))
    # probability 1: the coin (u < 1) always fires
    assert kept_ids(R.xtc(x, 0.25, 1.0, seed=0)) == [1, 2]  # targets {0,1}: keep 1
    assert kept_ids(R.xtc(x, 0.1, 1.0, seed=0)) == [2]  # targets all: keep least probable
    assert np.array_equal(R.xtc(x, 0.4, 1.0, seed=0), x)  # one target: nothing
    assert np.array_equal(R.xtc(x, 0.25, 0.0, seed=0), x)  # off
    # least probable tie: lowest id survives
    y = np.log(f32(0.4, 0.3, 0.3))
    assert kept_ids(R.xtc(y, 0.25, 1.0, seed=3)) == [1]
    assert R.xtc(y, 0.25, 1.0, seed=3)[1] == y[1]
    # the coin: u < probability decides
    fired = 0
    for seed in range(40):
        for pos in (0, 5):
            u = R.xtc_coin(seed, pos)
            out = R.xtc(x, 0.25, 0.5, seed=seed, position=pos)
            if u < F32(0.5):
                fired += 1
                assert kept_ids(out) == [1, 2]
            else:
                assert np.array_equal(out, x)
    assert 20 < fired < 60
    with pytest.raises(ValueError):
        R.xtc(x, 0.1, 1.5, seed=0)


def test_penalties_hand():
    x = f32(2, -2, 1, 0, 3, NI)
    hist = np.array([-1, 0, 0, 1, 3, 5, -1], dtype=np.int32)  # counts: 0:2 1:1 3:1 5:1
    out = R.penalties(x, hist, repeat=2, frequency=0.5, presence=0.25)
    # 0: 2/2 - (2*.5+.25) = -.25 ; 1: -2*2 - .75 = -4.75 ; 3: 0*2 - .75 ; 5 stays -inf
    assert out.tolist() == [-0.25, -4.75, 1, -0.75, 3, NI]
    assert R.penalties(x, hist, repeat=2).tolist() == [1, -4, 1, 0, 3, NI]
    assert R.penalties(x, hist, frequency=1).tolist() == [0, -3, 1, -1, 3, NI]
    assert R.penalties(x, hist, presence=1).tolist() == [1, -3, 1, -1, 3, NI]
    # last_n = 3 -> last three columns [3, 5, -1]
    assert R.penalties(x, hist, last_n=3, presence=1).tolist() == [2, -2, 1, -1, 3, NI]
    assert R.penalties(x, hist, last_n=4, presence=1).tolist() == [2, -3, 1, -1, 3, NI]
    assert np.array_equal(R.penalties(x, hist, last_n=0, repeat=2, presence=1), x)
    assert R.penalties(x, hist, last_n=-1, presence=1).tolist() == R.penalties(x, hist, last_n=100, presence=1).tolist()
    assert np.array_equal(R.penalties(x, hist), x)  # all neutral
    assert np.array_equal(R.penalties(x, np.full(4, -1), repeat=3, presence=1), x)  # all padding
    assert np.array_equal(R.penalties(x, np.zeros(0, np.int32), repeat=3), x)
    with pytest.raises(ValueError):
        R.penalties(x, hist, last_n=-2)
    with pytest.raises(ValueError):
        R.penalties(x, hist, repeat=0)


def test_logit_bias_and_allow():
    x = f32(1, 2, 3)
    assert R.logit_bias(x, f32(0.5, -1, 0)).tolist() == [1.5, 1, 3]
    assert R.logit_bias(x, {2: -np.inf, 0: 1}).tolist() == [2, 2, NI]
    with pytest.raises(ValueError):
        R.logit_bias(x, {0: NI, 1: NI, 2: NI})
    with pytest.raises(ValueError):
        R.logit_bias(x, {3: 1.0})
    with pytest.raises(ValueError):
        R.logit_bias(x, f32(np.inf, 0, 0))
    assert R.allow(x, [True, False, True]).tolist() == [1, NI, 3]
    with pytest.raises(ValueError):
        R.allow(x, [False, False, False])
    with pytest.raises(ValueError):
        R.allow(f32(NI, 1), [True, False])


def test_check_logits():
    R.check_logits(f32(0, NI))
    with pytest.raises(ValueError):
        R.check_logits(f32(0, np.nan))
    with pytest.raises(ValueError):
        R.check_logits(f32(0, np.inf))


def test_stages_keep_most_probable_always():
    rng = np.random.default_rng(2)
    for _ in range(100):
        V = int(rng.integers(1, 30))
        x = (rng.normal(size=V) * 3).astype(F32)
        x[rng.random(V) < 0.3] = NI
        x[int(rng.integers(V))] = F32(rng.normal())
        mx_ids = set(np.flatnonzero(x == np.max(x)).tolist())
        for y in (
            R.top_k(x, int(rng.integers(1, 4))),
            R.top_p(x, float(rng.uniform(1e-6, 1))),
            R.min_p(x, float(rng.uniform(0, 1))),
            R.typical_p(x, float(rng.uniform(0, 1))),
            R.top_n_sigma(x, float(rng.uniform(0.01, 3))),
        ):
            assert mx_ids <= set(kept_ids(y))
            assert set(kept_ids(y)) <= set(kept_ids(x))
            assert np.array_equal(y[np.isfinite(y)], x[np.isfinite(y)])  # filters never change values
        y = R.xtc(x, float(rng.uniform(0, 1)), 1.0, seed=int(rng.integers(100)))
        assert len(kept_ids(y)) >= 1


# ---------------------------------------------------------------------------- terminals


def test_greedy():
    assert R.greedy(f32(1, 3, 3, NI)) == 1
    assert R.greedy(f32(NI, NI, -5)) == 2


def test_sample_definition_and_determinism():
    x = f32(0.5, NI, 1.0, 0.2, 0.2)
    for seed in (0, 1, 2**40 + 3):
        for pos in (0, 9):
            g = R.gumbel(R.bits_for_tokens(seed, pos, 5))
            want = int(np.argmax((x + g).astype(F32)))
            assert R.sample(x, seed, pos) == want == R.sample(x, seed, pos)
            assert R.sample(x, seed, pos) != 1
    assert R.sample(f32(NI, 0, NI), 5) == 1
    # the token depends only on the row: a prefix does not change the noise of token i
    assert np.array_equal(R.bits_for_tokens(7, 3, 10)[:4], R.bits_for_tokens(7, 3, 4))


def _chi2_ok(tokens, probs):
    from scipy.stats import chisquare

    n = len(tokens)
    obs = np.bincount(tokens, minlength=len(probs)).astype(float)
    exp = probs * n
    mask = probs > 0
    assert obs[~mask].sum() == 0
    return chisquare(obs[mask], exp[mask]).pvalue


def test_sample_chi_square_over_seeds():
    x = f32(1.0, 0.0, -0.5, 2.0, NI, 0.3)
    probs = R.softmax64(x)
    toks = [R.sample(x, seed, 0) for seed in range(6000)]
    assert _chi2_ok(toks, probs) > 1e-3


def test_sample_chi_square_over_positions():
    x = f32(0.0, 0.1, -1.0, 1.0)
    probs = R.softmax64(x)
    toks = [R.sample(x, 12345, pos) for pos in range(6000)]
    assert _chi2_ok(toks, probs) > 1e-3


# ---------------------------------------------------------------------------- outputs / run_chain


def test_run_chain_llama_like():
    rng = np.random.default_rng(3)
    V = 50
    logits = (rng.normal(size=V) * 2).astype(F32)
    hist = np.array([-1, -1, 3, 7, 7, 12], dtype=np.int32)
    stages = [
        ("penalties", {"history": hist, "last_n": 64, "repeat": 1.1}),
        ("top_k", {"k": 40}),
        ("top_p", {"p": 0.95}),
        ("min_p", {"m": 0.05}),
        ("temperature", {"t": 0.8}),
    ]
    out = R.run_chain(logits, stages, ("sample", {"seed": 11, "position": 4}))
    x = logits
    x = R.penalties(x, hist, 64, 1.1)
    x = R.top_k(x, 40)
    x = R.top_p(x, 0.95)
    x = R.min_p(x, 0.05)
    x = R.temperature(x, 0.8)
    assert np.array_equal(out["x"], x)
    assert out["token"] == R.sample(x, 11, 4)
    assert np.isfinite(x[out["token"]])
    assert out["logprob"] == pytest.approx(float(R.log_softmax64(x)[out["token"]]))
    assert out["raw_logprob"] == pytest.approx(float(R.log_softmax64(logits)[out["token"]]))
    assert out["probs"].dtype == np.float32 and abs(out["probs"].sum() - 1) < 1e-5
    assert np.all(out["probs"][~np.isfinite(x)] == 0)


def test_run_chain_greedy_and_no_terminal():
    logits = f32(0.0, 2.0, 2.0, 1.0)
    out = R.run_chain(logits, [("temperature", {"t": 0})], ("greedy", {}))
    assert out["token"] == 1 and out["logprob"] == 0.0
    assert out["raw_logprob"] == pytest.approx(2 - math.log(1 + 2 * math.e**2 + math.e))
    out = R.run_chain(logits, [("top_k", {"k": 2})], None)
    assert "token" not in out
    assert out["probs"].tolist() == pytest.approx([0, 0.5, 0.5, 0])


def test_run_chain_errors_name_row():
    with pytest.raises(ValueError, match="row 3"):
        R.run_chain(f32(0, np.nan), [], ("greedy", {}), row=3)
    with pytest.raises(ValueError, match="row 2"):
        R.run_chain(f32(0, np.inf), [], ("greedy", {}), row=2)
    with pytest.raises(ValueError, match="row 1"):
        R.run_chain(f32(0, 1), [("allow", {"mask": [False, False]})], ("greedy", {}), row=1)
    with pytest.raises(ValueError):
        R.run_chain(f32(0, 1), [("nope", {})], None)


def test_top_logprobs_and_candidates():
    logits = f32(1, 3, 3, 0, 3)
    ids, vals = R.top_logprobs(logits, 4)
    assert ids.tolist() == [1, 2, 4, 0] and ids.dtype == np.int32
    lse = math.log(math.e + 3 * math.e**3 + 1)
    assert vals.dtype == np.float32
    assert vals.tolist() == pytest.approx([3 - lse] * 3 + [1 - lse], rel=1e-6)
    x = f32(NI, 2, NI, 5, 2)
    ids, vals = R.candidates(x, 5)
    assert ids.tolist() == [3, 1, 4, 0, 2]
    assert vals.tolist() == [5, 2, 2, NI, NI]
    ids, vals = R.candidates(x, 2)
    assert ids.tolist() == [3, 1]


def test_large_vocab_runs_every_stage():
    """Every stage and output at V = 262144 (the reference is vectorized numpy; how fast is not asserted here)."""
    rng = np.random.default_rng(4)
    V = 262144
    x = (rng.normal(size=V) * 3).astype(F32)
    hist = rng.integers(-1, V, size=(256,)).astype(np.int32)
    stages = [
        ("penalties", {"history_row": hist, "repeat": 1.1, "frequency": 0.1, "presence": 0.1}),
        ("top_n_sigma", {"n": 3.0}),
        ("typical_p", {"m": 0.95}),
        ("top_p", {"p": 0.9}),
        ("min_p", {"m": 0.01}),
        ("top_k", {"k": 1000}),
        ("xtc", {"threshold": 0.1, "probability": 1.0, "seed": 1}),
        ("temperature", {"t": 0.7}),
    ]
    out = R.run_chain(x, stages, ("sample", {"seed": 3, "position": 2}))
    R.top_logprobs(x, 20)
    R.candidates(out["x"], 20)
    assert np.isfinite(out["x"][out["token"]])
