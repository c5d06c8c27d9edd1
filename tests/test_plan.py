"""The -O2 candidate plan: it must give exactly the exact program's outputs, and hand flagged rows back to it."""
from __future__ import annotations

import re

import numpy as np
import pytest

import samplec
from samplec.frontend.plan import PLAN_GUARD

V = 8192   # 128 blocks of 64: large enough that the plan looks at a small part of the vocabulary


def realistic(B: int, seed: int, tail: float = 1.0) -> np.ndarray:
    r = np.random.default_rng(seed)
    x = r.normal(0, tail, size=(B, V)).astype(np.float32)
    for b in range(B):
        x[b, r.choice(V, 40, replace=False)] += (14 / np.arange(1, 41) ** 0.5).astype(np.float32)
    return x


CHAINS = {
    "top_k": "top_k(40) temperature(0.8) sample(seed, position = pos)",
    "llama": "top_k(40) top_p(0.95) min_p(0.05) temperature(0.8) sample(seed, position = pos)",
    "wide_llama": "top_k(100) top_p(0.9) min_p(0.01) temperature(t) sample(seed, position = pos)",  # sorted top_p
    "min_p": "min_p(0.05) temperature(t) sample(seed, position = pos)",
    "top_p": "top_p(0.9) temperature(0.7) sample(seed, position = pos)",
    "window": "temperature(t) sample(seed, position = pos)",
    "plain": "sample(seed, position = pos)",
    "k_then_typical": "top_k(20) typical_p(0.8) top_n_sigma(1.0) xtc(0.05, 0.5, seed) sample(seed, position = pos)",
    "greedy_k": "top_k(5) greedy()",
    "pen": "penalties(h, last_n = 16, repeat = r, frequency = f, presence = q) top_k(30) sample(seed, position = pos)",
    "bias": "logit_bias({5: 3.0, 9: -inf}) min_p(0.1) sample(seed, position = pos)",
}
SIG = "(seed: seed = 0, pos: int = 0, t: float = 0.8, h: tokens, r: float = 1.1, f: float = 0.0, q: float = 0.0)"


def programs(name: str, outputs: str = "token, logprob, raw_logprob"):
    src = f"sampler s{SIG} -> {outputs} {{ {CHAINS[name]} }}"
    return samplec.compile(src, opt_level=0), samplec.compile(src, opt_level=2)


def run_both(p0, p2, x, **params):
    params.setdefault("h", hist(len(x)))
    a, b = p0(x, **params), p2(x, **params)
    for key in a.to_dict():
        va, vb = np.array(a.to_dict()[key]), np.array(b.to_dict()[key])
        if va.dtype.kind in "iu":
            assert np.array_equal(va, vb), (key, va, vb)
        else:
            np.testing.assert_allclose(va, vb, atol=2e-5, rtol=0, err_msg=key)
    return a


def hist(B):
    return np.random.default_rng(3).integers(-1, V, size=(B, 24)).astype(np.int32)


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_plan_matches_exact_program(name):
    p0, p2 = programs(name)
    assert p2.plan is not None and p0.plan is None
    assert [c.message for c in p2.plan.checks] == [PLAN_GUARD]
    x = realistic(8, 1)
    for s in range(6):
        run_both(p0, p2, x, seed=list(range(8 * s, 8 * s + 8)), pos=s, h=hist(8))
    if name not in ("window", "plain", "top_p"):
        assert p2.fallbacks == 0, "the plan should cover these rows"


def test_no_plan_where_it_cannot_be_exact():
    for body, outs in [("top_p(0.9) sample(seed)", "probs"), ("typical_p(0.9) sample(seed)", "token"),
                       ("top_k(k) sample(seed)", "token"), ("temperature(0.5) greedy()", "token")]:
        sig = "(seed: seed = 0, k: int = 4)"
        prog = samplec.compile(f"sampler s{sig} -> {outs} {{ {body} }}")
        assert prog.plan is None, body


def test_ties_across_blocks_fall_back_and_stay_exact():
    p0, p2 = programs("top_k")
    x = np.full((2, V), -5.0, np.float32)
    x[:, ::64] = 3.0          # one equal value in every block: v_k ties far outside the 40 chosen blocks
    run_both(p0, p2, x, seed=[1, 2])
    assert p2.fallbacks == 1


def test_greedy_plan_reads_one_block():
    p0, p2 = programs("greedy_k", "token, raw_logprob, top_logprobs(3)")
    assert "kth_largest" not in str(p2.plan) and "top_blocks %block_max {blocks = 1}" in str(p2.plan)
    x = realistic(8, 11)
    run_both(p0, p2, x)
    assert p2.fallbacks == 0
    x[3, 100] = x[3, 101] = x[3].max() + 1       # the maximum twice, in two blocks: the exact program answers
    run_both(p0, p2, x)
    assert p2.fallbacks == 1


def test_top_p_tiers_bounded_normalizer_then_exact_sum():
    p0, p2 = programs("top_p")
    assert len(p2.plans) == 2 and "block_max" in str(p2.plans[0]) and "%z =" in str(p2.plans[1])
    run_both(p0, p2, realistic(4, 3), seed=[1, 2, 3, 4])
    assert p2.last_tier == 0                   # a peaked row: the bound on the normalizer decides the cut
    wide = realistic(4, 3, tail=2.5)           # a heavy tail: the bound is too loose, the exact sum decides
    run_both(p0, p2, wide, seed=[1, 2, 3, 4])
    assert p2.last_tier in (1, 2)


def test_flat_rows_fall_back():
    for name in ("window", "min_p"):
        p0, p2 = programs(name)
        x = np.zeros((3, V), np.float32)
        run_both(p0, p2, x, seed=[4, 5, 6], t=[0.5, 1.0, 0.0])
        assert p2.fallbacks == 1


def test_window_plan_with_per_row_temperature_and_zero():
    p0, p2 = programs("window")
    x = realistic(4, 7, tail=0.5)
    for s in range(5):
        run_both(p0, p2, x, seed=[s, s + 10, s + 20, s + 30], t=[0.0, 0.3, 0.6, 1.0])


def test_penalties_run_on_the_vocabulary_first():
    p0, p2 = programs("pen")
    x = realistic(4, 9)
    h = hist(4)
    h[:, -1] = np.argmax(x, axis=1)            # the history holds each row's top token, as in a decode loop
    h[:, -4:-1] = [[0, -1, 0]]                 # token 0 twice, and padding (both written back sparsely)
    h[1, -6:-4] = h[1, -1]                     # a repeated top token
    run_both(p0, p2, x, seed=[1, 2, 3, 4], h=h)
    run_both(p0, p2, x, seed=[1, 2, 3, 4], h=h, q=[0.0, -2.0, 0.0, 0.0], r=[1.0, 0.5, 3.0, 1.1])
    assert p2.fallbacks == 0


def test_errors_still_come_from_the_exact_program():
    _, p2 = programs("llama")
    x = realistic(3, 2)
    x[2, 17] = np.nan
    with pytest.raises(samplec.SamplecError, match="NaN.*row 2"):
        p2(x, seed=0, h=hist(3))


def test_candidates_output_with_few_survivors():
    p0, p2 = programs("min_p", "token, candidates(8)")
    x = realistic(2, 5)
    x[1] = -30.0
    x[1, :3] = 0.0                     # row 1 keeps 3 tokens: the plan's candidates differ, so it falls back
    out = run_both(p0, p2, x, seed=[1, 2])
    assert np.isneginf(np.array(out.candidates.values)[1, 3:]).all()
    assert p2.fallbacks == 1
    assert programs("greedy_k", "token, candidates(8)")[1].plan is None


def test_plan_survives_save_and_load(tmp_path):
    _, p2 = programs("llama")
    p2.save(tmp_path / "p.smpb")
    loaded = samplec.load(tmp_path / "p.smpb")
    assert loaded.ir() == p2.ir() and loaded.plan is not None
    x = realistic(2, 4)
    h = hist(2)
    assert np.array_equal(np.array(loaded(x, seed=3, h=h).token), np.array(p2(x, seed=3, h=h).token))


def test_only_flagged_rows_move_on():
    p0, p2 = programs("llama", "token, logprob, raw_logprob, top_logprobs(3)")
    x = realistic(5, 21)
    x[1] = -5.0
    x[1, ::64] = 3.0            # row 1 ties across blocks: only it is answered by the exact program
    x[3] = 0.0                  # a flat row, likewise
    out = run_both(p0, p2, x, seed=[9, 8, 7, 6, 5])
    assert p2.fallbacks == 1 and p2.last_tier == len(p2.plans)
    assert np.array(out.top_logprobs.ids).shape == (5, 3)


@pytest.mark.parametrize("body, outs", [
    ("penalties(h, repeat = 3.0) greedy()", "token"),
    ("penalties(h, repeat = 3.0) top_k(5) greedy()", "token"),
    ("penalties(h, repeat = 3.0) top_p(0.5) sample(seed)", "token, logprob"),
    ("penalties(h, repeat = 2.0) sample(seed)", "token, logprob"),
    ("penalties(h, repeat = 2.0) temperature(0) sample(seed)", "token, logprob"),
    ("penalties(h, repeat = 2.0) temperature(0.9) sample(seed)", "token, logprob"),
])
def test_deferred_penalties_that_change_the_top(body, outs):
    """Penalizing the strongest token: the plan must see the penalized maximum (review findings D1-D3)."""
    src = f"sampler s(h: tokens, seed: seed = 0) -> {outs} {{ {body} }}"
    p0, p2 = samplec.compile(src, opt_level=0), samplec.compile(src, opt_level=2)
    x = np.zeros((3, V), np.float32)
    x[:, :6] = [10, 9.7, 9.4, 9.1, 8.8, 8.5]
    x[2, 7] = 30
    h = np.array([[0], [0], [7]], np.int32)
    for seed in range(12):
        run_both(p0, p2, x, h=h, seed=[seed, seed + 1, seed + 2])


def test_window_plan_refuses_candidates_output():
    src = "sampler s(seed: seed = 0) -> token, candidates(10) { sample(seed) }"
    assert samplec.compile(src).plan is None


def test_api_spec_names_and_error_type():
    prog = samplec.compile(source_text="sampler s() { greedy() }", sampler=None, opt_level=2, bindings=None)
    assert np.array(prog(np.array([0.0, 2.0, 1.0], np.float64)).token).tolist() == [1]
    with pytest.raises(ValueError):          # SamplecError is a ValueError
        samplec.compile("sampler s() { top_p(1.5) greedy() }")
    with pytest.raises(samplec.SamplecError, match=r"f = inf is out of range .*row 0"):
        samplec.compile("sampler s(h: tokens, f: float) { penalties(h, frequency = f) greedy() }")(
            np.zeros((1, 8), np.float32), h=[[1]], f=np.inf)


def test_mass_above_is_the_spec_definition_with_ties():
    """mass_above (top_p on a plan's candidates): S_i = sum of p_j over p_j > p_i, ties excluded, any order."""
    import mlx.core as mx
    from samplec.backend_mlx.kernels import KERNELS
    r = np.random.default_rng(5)
    p = r.choice(np.float32([0.0, 0.05, 0.1, 0.1, 0.2, 0.25]), size=(4, 40)).astype(np.float32)
    got = np.array(KERNELS["mass_above"]([mx.array(p)], {}))
    want = np.array([[sum(float(q) for q in row if q > v) for v in row] for row in p])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert (got[p == p.max(axis=1, keepdims=True)] == 0).all()


def test_top_p_after_top_k_with_tied_probabilities():
    """Ties at the top_p boundary on the candidates: all kept or none, as the exact program decides."""
    src = "sampler s(seed: seed = 0, p: float = 0.5) { top_k(8) top_p(p) sample(seed) }"
    p0, p2 = samplec.compile(src, opt_level=0), samplec.compile(src, opt_level=2)
    x = np.full((6, V), -5.0, np.float32)
    x[:, [3, 700, 1400, 2100]] = 2.0          # four equal tokens: 0.25 each (nearly)
    x[:, [9, 4000]] = 1.0
    x[:, [11, 5000]] = 0.5                    # the 8 best are unambiguous; four of them tie
    for p in (0.2, 0.25, 0.5, 0.75, 0.9, 1.0):
        for s in range(5):
            a, b = p0(x, seed=s, p=p), p2(x, seed=s, p=p)
            assert np.array_equal(np.array(a.token), np.array(b.token)), (p, s)
    assert p2.last_tier == 0 and p2.fallbacks == 0


def test_temperature_known_maximum_edge_values():
    """The plan derives the maximum after temperature from vmax; t = 0, tiny, huge and inf must agree with
    the exact program (including rows whose scaled logits overflow)."""
    src = ("sampler s(seed: seed = 0, t: float = 1.0) -> token, logprob "
           "{ top_k(16) min_p(0.01) temperature(t) sample(seed) }")
    p0, p2 = samplec.compile(src, opt_level=0), samplec.compile(src, opt_level=2)
    x = realistic(5, 11)
    x[3] -= 3e38 / 2            # very negative finite logits: x / tiny t overflows to -inf
    for t in ([0.0, 1e-30, 0.7, 1e30, np.inf], [1.0] * 5, [1e-30] * 5):
        for s in range(3):
            try:
                a = p0(x, seed=s, t=t)
            except samplec.SamplecError as e:
                with pytest.raises(samplec.SamplecError, match=re.escape(str(e)[:20])):
                    p2(x, seed=s, t=t)
                continue
            b = p2(x, seed=s, t=t)
            assert np.array_equal(np.array(a.token), np.array(b.token)), (t, s)


def test_scalar_parameters_short_path_checks_and_caches():
    src = "sampler s(seed: seed = 0, pos: int = 0, t: float = 0.8) { top_k(40) temperature(t) sample(seed, position = pos) }"
    p0, p2 = samplec.compile(src, opt_level=0), samplec.compile(src, opt_level=2)
    x = realistic(3, 2)
    toks = {s: np.array(p2(x, seed=s, pos=s, t=0.5).token) for s in range(4)}
    for s in range(4):      # cached arrays give the same answers, and each value its own
        assert np.array_equal(np.array(p2(x, seed=s, pos=s, t=0.5).token), toks[s])
        assert np.array_equal(np.array(p0(x, seed=s, pos=s, t=0.5).token), toks[s])
    for bad, match in ((dict(t=-1.0), "t = -1"), (dict(t=float("nan")), "t: NaN"), (dict(seed=-1), "seed"),
                       (dict(seed=2 ** 64), "seed"), (dict(pos=2 ** 40), "pos"), (dict(pos=True), None),
                       (dict(seed=1.5), "seed")):
        if match is None:
            p2(x, **bad)             # a bool is an int for numpy: the full path decides, as before
            continue
        with pytest.raises(samplec.SamplecError, match=match):
            p2(x, **bad)
    assert np.array_equal(np.array(p2(x, seed=np.uint64(3), pos=np.int32(3), t=np.float32(0.5)).token), toks[3])


def test_per_row_seed_arrays_are_cached_by_their_values():
    """Per-row seeds passed as a uint64 array are converted once per distinct value: an array changed in place
    gives its new seeds' tokens, the same values give the same tokens."""
    src = "sampler s(seed: seed = 0, pos: int = 0) { top_k(40) temperature(2.0) sample(seed, position = pos) }"
    p0, p2 = samplec.compile(src, opt_level=0), samplec.compile(src, opt_level=2)
    x = realistic(4, 5)
    seeds = np.arange(4, dtype=np.uint64)
    first = np.array(p2(x, seed=seeds, pos=1).token)
    seeds += np.uint64(1000)                       # in place: the same object, other values
    moved = np.array(p2(x, seed=seeds, pos=1).token)
    np.testing.assert_array_equal(moved, np.array(p0(x, seed=seeds.copy(), pos=1).token))
    assert not np.array_equal(first, moved)
    seeds -= np.uint64(1000)
    np.testing.assert_array_equal(np.array(p2(x, seed=seeds, pos=1).token), first)


def test_batched_partition_keys_order_like_values():
    """The batched partition (packed value/position keys) selects exactly the k largest, -inf, -0.0 and ties
    included, like an argpartition of the values."""
    import mlx.core as mx
    from samplec.backend_mlx.kernels import KERNELS
    r = np.random.default_rng(8)
    x = r.choice(np.float32([-np.inf, -3.5, -0.0, 0.0, 1e-30, 2.0, 7.25, 1e30]), size=(6, 300)).astype(np.float32)
    x[:, 5] = np.float32(9.0)
    for k in (1, 5, 40, 299):
        pos = np.array(KERNELS["topk_positions"]([mx.array(x)], {"k": k}))
        kth = np.array(KERNELS["kth_largest_static"]([mx.array(x)], {"k": k}))[:, 0]
        want = -np.sort(-x, axis=1)
        assert (np.diff(pos, axis=1) > 0).all()                     # ascending positions
        got = np.sort(np.take_along_axis(x, pos, axis=1), axis=1)[:, ::-1]
        np.testing.assert_array_equal(got, want[:, :k])             # the k largest values
        np.testing.assert_array_equal(kth, want[:, k - 1])


@pytest.mark.parametrize("H", [1, 24, 600])
def test_penalty_counts_short_and_long_histories(H):
    """count_at: pairwise for short histories, a scatter over the vocabulary for long ones -- same counts."""
    import mlx.core as mx
    from samplec.backend_mlx.kernels import KERNELS
    r = np.random.default_rng(H)
    ids = r.integers(0, 50, size=(3, H)).astype(np.int32)
    w = (r.random((3, H)) < 0.8).astype(np.float32)
    got = np.array(KERNELS["count_at"]([mx.array(ids), mx.array(w), mx.zeros((3, 50))], {}))
    want = np.array([[w[b][ids[b] == i].sum() for i in ids[b]] for b in range(3)])
    np.testing.assert_array_equal(got, want)
    p0, p2 = programs("pen")
    x = realistic(4, H)
    h = np.random.default_rng(H).integers(-1, V, size=(4, H)).astype(np.int32)
    h[:, ::7] = np.argmax(x, axis=1)[:, None]      # the top token, repeated, in the window
    for s in range(3):
        run_both(p0, p2, x, seed=[s, s + 1, s + 2, s + 3], pos=s, h=h, r=1.3, f=0.2, q=0.1)
