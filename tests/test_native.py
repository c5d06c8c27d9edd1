"""samplec-native (native/): each C++ primitive against the MLX-ops kernel it replaces, and whole programs with
and without it. Skipped where the package is not built (`.ci/run` builds it, so CI runs these)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import samplec
from samplec.backend_mlx import kernels, native
from samplec.backend_mlx.rng import random_bits

pytestmark = pytest.mark.skipif(not native.installed(), reason="samplec-native is not built (see native/README.md)")


@pytest.fixture
def pure(monkeypatch):
    """Run a block of code with the MLX-ops kernels only."""
    class Pure:
        def __enter__(self):
            monkeypatch.setenv("SAMPLEC_NATIVE", "0")

        def __exit__(self, *exc):
            monkeypatch.setenv("SAMPLEC_NATIVE", "1")
    return Pure()


def both(pure, op, ins, attrs):
    got = np.array(kernels.KERNELS[op]([mx.array(i) if isinstance(i, np.ndarray) else i for i in ins], attrs))
    with pure:
        want = np.array(kernels.KERNELS[op]([mx.array(i) if isinstance(i, np.ndarray) else i for i in ins], attrs))
    return got, want


def logits(B, V, seed, kind="realistic"):
    r = np.random.default_rng(seed)
    x = r.normal(0, 1, size=(B, V)).astype(np.float32)
    if kind == "realistic":
        for b in range(B):
            x[b, r.choice(V, min(V, 30), replace=False)] += 12
    elif kind == "special":
        x = np.round(x * 2) / 2                      # ties
        x[:, ::17] = -np.inf
        x[0, 5] = np.nan
        x[-1, :3] = -0.0
    return x


def test_threefry_bits_equal_and_known_answers():
    r = np.random.default_rng(0)
    seed = np.array([[0], [2 ** 64 - 1], [123456789012345]], dtype=np.uint64)
    ids = r.integers(0, 2 ** 32, size=(3, 50), dtype=np.uint64).astype(np.uint32)
    pos = np.array([[0], [7], [2 ** 32 - 1]], dtype=np.uint32)
    got = np.array(native.threefry_bits(mx.array(seed), mx.array(ids), mx.array(pos)))
    np.testing.assert_array_equal(got, np.array(random_bits(mx.array(seed), mx.array(ids), mx.array(pos))))
    z = lambda v, dt: mx.array(np.array([[v]], dtype=dt))
    assert int(np.array(native.threefry_bits(z(0, np.uint64), z(0, np.uint32), z(0, np.uint32)))[0, 0]) == 0x6b200159
    ones = native.threefry_bits(z(2 ** 64 - 1, np.uint64), z(2 ** 32 - 1, np.uint32), z(2 ** 32 - 1, np.uint32))
    assert int(np.array(ones)[0, 0]) == 0x1cb996fc


@pytest.mark.parametrize("k", [1, 5, 40, 99])
def test_topk_select_equals_the_mlx_kernels(pure, k):
    x = logits(4, 100 + k, k, "special")[1:]             # no NaN rows
    pos, _ = native.topk_select(mx.array(x), k)
    pos = np.array(pos)
    assert (np.diff(pos, axis=1) > 0).all()
    want = -np.sort(-x, axis=1)
    np.testing.assert_array_equal(np.sort(np.take_along_axis(x, pos, 1), 1)[:, ::-1], want[:, :k])
    nxt, nxt_want = both(pure, "kth_largest_static", [x], {"k": k + 1})
    np.testing.assert_array_equal(nxt, nxt_want)
    np.testing.assert_array_equal(nxt[:, 0], want[:, k])


def test_broadcast_threefry():
    seed = mx.array(np.array([[3], [4]], dtype=np.uint64))
    ids = mx.array(np.arange(10, dtype=np.uint32)[None, :])   # [1, C]: broadcast rows inside the primitive
    pos = mx.array(np.array([[1], [2]], dtype=np.uint32))
    np.testing.assert_array_equal(np.array(native.threefry_bits(seed, ids, pos)),
                                  np.array(random_bits(seed, ids, pos)))


def test_strided_inputs():
    """Views (slices, transposes, broadcasts) are read through their strides."""
    x = mx.array(logits(6, 640, 3))
    view = x[::2, :]                                      # a row stride of 2 rows
    np.testing.assert_array_equal(np.array(native.block_max(view, 64)), np.array(native.block_max(mx.contiguous(view), 64)))
    t = mx.array(logits(640, 2, 4)).T                     # column-major
    np.testing.assert_array_equal(np.array(native.block_max(t, 64)), np.array(native.block_max(mx.contiguous(t), 64)))
    pos, nxt = native.topk_select(t, 5)
    pos2, nxt2 = native.topk_select(mx.contiguous(t), 5)
    np.testing.assert_array_equal(np.array(pos), np.array(pos2))


CHAINS = ["top_k(40) temperature(0.8) sample(seed, position = pos)",
          "top_k(40) top_p(0.95) min_p(0.05) temperature(t) sample(seed, position = pos)",
          "min_p(0.05) temperature(t) sample(seed, position = pos)",
          "top_p(0.9) temperature(t) sample(seed, position = pos)",
          "temperature(t) sample(seed, position = pos)",
          "top_k(7) greedy()"]


@pytest.mark.parametrize("body", CHAINS)
def test_programs_give_the_same_tokens_with_and_without_native(pure, body):
    src = f"sampler s(seed: seed = 0, pos: int = 0, t: float = 0.8) -> token, logprob {{ {body} }}"
    for B, V in ((1, 5000), (3, 8192), (2, 50)):
        x = logits(B, V, B * V)
        p_native, p0 = samplec.compile(src), samplec.compile(src, opt_level=0)
        with pure:
            p_pure, p0_pure = samplec.compile(src), samplec.compile(src, opt_level=0)
            want = [p_pure(x, seed=s, pos=s) for s in range(3)]
            exact = [p0_pure(x, seed=s, pos=s) for s in range(3)]
        got = [p_native(x, seed=s, pos=s) for s in range(3)]
        got0 = [p0(x, seed=s, pos=s) for s in range(3)]      # the exact program through the native rules too
        for g, g0, w, e in zip(got, got0, want, exact):
            np.testing.assert_array_equal(np.array(g.token), np.array(w.token))
            np.testing.assert_array_equal(np.array(g.token), np.array(e.token))
            np.testing.assert_array_equal(np.array(g0.token), np.array(e.token))
            np.testing.assert_allclose(np.array(g.logprob), np.array(w.logprob), atol=3e-5)
            np.testing.assert_allclose(np.array(g0.logprob), np.array(e.logprob), atol=3e-5)
            np.testing.assert_allclose(np.array(g.logprob), np.array(e.logprob), atol=3e-5)


def test_argmax_take_is_mlx_argmax():
    """The first maximum, a NaN winning (the first NaN), -0.0 equal to 0.0 -- MLX's argmax -- and gathers there."""
    n, inf = np.nan, np.inf
    rows = [[1, n, 3, n], [n, 1, 2, 2], [-inf, -inf, -inf, -inf], [1, 3, 3, 0], [0.0, -0.0, -0.0, 0.0],
            [-0.0, 0.0, -1, -2], [-inf, n, 5, 5], [2, 1, 0, 7]]
    x = mx.array(np.array(rows, dtype=np.float32))
    ids = mx.array(np.arange(32, dtype=np.int32).reshape(8, 4) * 7)
    pos, got_ids, got_x = native.argmax_take(x, [ids, x])
    want = mx.argmax(x, axis=-1, keepdims=True).astype(mx.int32)
    np.testing.assert_array_equal(np.array(pos), np.array(want))
    np.testing.assert_array_equal(np.array(got_ids), np.take_along_axis(np.array(ids), np.array(want), 1))
    np.testing.assert_array_equal(np.array(got_x), np.take_along_axis(np.array(x), np.array(want), 1))
    big = logits(3, 5000, 9, "special")
    np.testing.assert_array_equal(np.array(native.argmax_take(mx.array(big))[0])[:, 0], np.argmax(big, axis=1))


def test_topk_select_gathers():
    x = logits(5, 300, 4, "special")
    ids = (np.arange(5 * 300, dtype=np.int32).reshape(5, 300) * 3 - 700)
    other = mx.array(logits(5, 600, 5))[:, ::2]                  # a strided view gathers through its strides
    pos, nxt, g_ids, g_x, g_o = native.topk_select(mx.array(x), 40, [mx.array(ids), mx.array(x), other])
    pos = np.array(pos)
    for got, src in ((g_ids, ids), (g_x, x), (g_o, np.array(other))):
        np.testing.assert_array_equal(np.array(got), np.take_along_axis(src, pos, 1))
    assert np.array(g_ids).dtype == np.int32 and np.array(g_x).dtype == np.float32
    with pytest.raises(ValueError):
        native.topk_select(mx.array(x), 4, [mx.array(ids[:, :10])])     # not shaped like x


def _ranked(x: np.ndarray, k: int):
    """Reference top-k: rank by value (a NaN above everything), equal values by position (the lower first); the
    k positions ascending and the (k+1)-th value (-inf past the row)."""
    tops, nexts = [], []
    for row in x:
        order = sorted(range(len(row)), key=lambda i: (not np.isnan(row[i]), -row[i] if not np.isnan(row[i]) else 0, i))
        tops.append(sorted(order[:k]))
        nexts.append(row[order[k]] if len(row) > k else -np.inf)
    return np.array(tops, dtype=np.int32), np.array(nexts, dtype=np.float32)[:, None]


def _hard_rows(n: int, seed: int) -> np.ndarray:
    """Rows that stress the vectorized maxima and the bounded selection: ties at every rank (values on a coarse
    grid), mostly -inf, +inf beside -inf (the NaN probe's false alarm), a NaN in the middle and at the very end,
    all equal, and a plain normal row."""
    r = np.random.default_rng(seed)
    rows = [np.round(r.normal(0, 1, n) * 2) / 2,
            np.where(r.random(n) < 0.97, -np.inf, r.normal(0, 1, n)),
            np.where(r.random(n) < 0.5, -np.inf, np.inf),
            r.normal(0, 1, n), r.normal(0, 1, n), np.full(n, 0.25), r.normal(0, 1, n)]
    rows[3][n // 2] = np.nan
    rows[4][-1] = np.nan
    rows[2][: n // 3] = r.normal(0, 1, n // 3)
    return np.array(rows, dtype=np.float32)


@pytest.mark.parametrize("n,k", [(2560, 40), (2376, 40), (5000, 1), (700, 5), (329, 40)])
def test_topk_select_on_long_rows_matches_a_reference(n, k):
    """Rows at least 8 (k + 1) long take the bounded path (a lower bound on the (k+1)-th value from chunk maxima,
    then a heap over the values at or above it); a NaN row takes the plain heap. Both give the reference's exact
    positions, ties included."""
    x = _hard_rows(n, n + k)
    pos, nxt = native.topk_select(mx.array(x), k)
    want_pos, want_next = _ranked(x, k)
    np.testing.assert_array_equal(np.array(pos), want_pos)
    np.testing.assert_array_equal(np.array(nxt), want_next)


@pytest.mark.parametrize("V", [152064, 64 * 16 * 3, 64 * 16 * 3 + 5, 1000, 17])
def test_block_max_matches_a_reference(V):
    """Block c holds tokens 64 c .. 64 c + 63 (NB = ceil(V / 64) blocks, the last partial): against numpy's max
    over that layout, NaN in a whole block and in the partial last one, +inf beside -inf."""
    x = _hard_rows(V, V)
    x[6, -1] = np.nan                                    # the partial block (when V % 64 != 0)
    nb = -(-V // 64)
    padded = np.concatenate([x, np.full((len(x), 64 * nb - V), -np.inf, np.float32)], 1)
    want = padded.reshape(len(x), nb, 64).max(axis=2)
    np.testing.assert_array_equal(np.array(native.block_max(mx.array(x), 64)), want)
    np.testing.assert_array_equal(np.array(native.block_max(mx.array(x)[:, ::1], 64)), want)


def test_threefry_reads_1d_operands_as_columns_and_int32_as_bits():
    r = np.random.default_rng(3)
    seed = np.array([5, 2 ** 64 - 1, 0], dtype=np.uint64)
    ids = r.integers(-2 ** 31, 2 ** 31, size=(3, 20), dtype=np.int64).astype(np.int32)
    pos = np.array([0, -1, 2 ** 31 - 1], dtype=np.int32)
    got = native.threefry_bits(mx.array(seed), mx.array(ids), mx.array(pos))
    want = random_bits(mx.array(seed[:, None]), mx.array(ids.view(np.uint32)), mx.array(pos.view(np.uint32)[:, None]))
    np.testing.assert_array_equal(np.array(got), np.array(want))


def _primitives(outputs, path) -> list[str]:
    import re
    mx.export_to_dot(str(path), *outputs)
    return re.findall(r'label ="?([A-Za-z]+)', path.read_text())


def test_evaluate_polls_then_blocks(monkeypatch):
    """Whatever the poll budget (none, shorter than the work, longer), evaluate gives mx.eval's values."""
    x = mx.array(logits(2, 3000, 12))
    want = np.array(mx.argmax(x * 2, axis=-1))
    for spin_us in (0.0, 5.0, 300.0):
        monkeypatch.setattr(native, "SPIN_US", spin_us)
        y = mx.argmax(x * 2, axis=-1)
        native.evaluate([y, x])
        np.testing.assert_array_equal(np.array(y), want)
    native.evaluate([x])                                  # already evaluated


def test_wake_holds_the_worker_until_the_dispatch_or_its_time_limit(monkeypatch):
    """A wake ends with the next evaluate; without one it ends on its own (after HOLD_US), so a caller that waits
    for MLX in between is delayed, never stuck."""
    x = mx.array(logits(1, 2000, 13))
    native.wake()
    y = mx.max(x, axis=-1)
    native.evaluate([y])
    assert float(np.array(y)[0]) == float(np.array(x).max())
    monkeypatch.setattr(native, "HOLD_US", 20_000.0)
    import time
    native.wake()
    t0 = time.perf_counter()
    mx.eval(mx.sum(x))                                    # queued behind the hold: runs once it times out
    assert time.perf_counter() - t0 < 5.0


def test_native_tasks_under_a_hold_linger_until_the_release(monkeypatch):
    """Under an open hold the worker runs each native task as it comes and then polls (rather than sleeps) until
    another is queued or the caller releases: the release ends it at once, and a late one is bounded by HOLD_US."""
    import time
    x = mx.array(logits(1, 3000, 16))
    want = np.array(native.block_max(x, 64))
    monkeypatch.setattr(native, "HOLD_US", 2_000_000.0)
    native.wake()
    bm = native.block_max(x, 64)
    mx.async_eval(bm)
    time.sleep(0.05)
    native.release()
    t0 = time.perf_counter()
    mx.eval(bm)
    assert time.perf_counter() - t0 < 1.0
    np.testing.assert_array_equal(np.array(bm), want)
    monkeypatch.setattr(native, "HOLD_US", 30_000.0)
    native.wake()
    bm = native.block_max(x, 64)
    t0 = time.perf_counter()
    mx.eval(bm)                                           # never released: the linger times out (30 ms)
    assert time.perf_counter() - t0 < 1.0
    np.testing.assert_array_equal(np.array(bm), want)


def test_calls_with_array_parameters_do_not_wake(monkeypatch):
    """Preparing a history waits for MLX (its range check): such a program does not hold the worker, nor does a
    call given an MLX array for a scalar parameter; a call with plain scalars wakes it once. Results are the same
    either way."""
    import samplec.program as program_mod
    woke = []
    real = program_mod.wake
    monkeypatch.setattr(program_mod, "wake", lambda: woke.append(1) or real())
    src = "sampler s(h: tokens, seed: seed = 0) { penalties(h, repeat = 1.3) top_k(5) sample(seed) }"
    prog = samplec.compile(src)
    assert not prog._scalars_only
    x = logits(2, 300, 14)
    with_native = prog(x, h=np.array([[1, 2], [3, 4]]), seed=1).token
    assert woke == []
    exact = samplec.compile(src, opt_level=0)(x, h=np.array([[1, 2], [3, 4]]), seed=1).token
    np.testing.assert_array_equal(np.array(with_native), np.array(exact))
    scalars = samplec.compile("sampler s(t: float = 1.0, seed: seed = 0) { top_k(5) temperature(t) sample(seed) }")
    assert scalars._scalars_only
    token = scalars(x, t=0.7, seed=1).token
    assert woke == [1]
    assert np.array(scalars(x, t=mx.array([0.7, 0.7]), seed=1).token).tolist() == np.array(token).tolist()
    assert woke == [1]


def test_a_call_that_fails_before_its_dispatch_ends_its_hold(monkeypatch):
    """A hold lasts until the call dispatches; a call rejected while preparing releases it at once, so the next
    evaluation is not queued behind a worker polling for HOLD_US (here made long enough to notice: 2 s)."""
    import time
    monkeypatch.setattr(native, "HOLD_US", 2_000_000.0)
    prog = samplec.compile("sampler s(t: float = 1.0, seed: seed = 0) { temperature(t) sample(seed) }")
    x = logits(1, 500, 15)
    with pytest.raises(samplec.SamplecError, match="unknown parameter 'temp'"):
        prog(x, temp=5.0)
    t0 = time.perf_counter()
    mx.eval(mx.sum(mx.array(x)))
    assert time.perf_counter() - t0 < 1.0
    assert prog(x, t=0.5, seed=3).token.shape == (1,)


def test_argmax_put_is_the_argmax_of_the_written_row():
    """argmax(put_along(x, ids, vals)) without writing it: the first maximum (a NaN wins), repeated ids, padding
    ids (< 0 point at token 0 in the IR; here out-of-row ids are skipped), ties between a written and a plain value."""
    r = np.random.default_rng(11)
    x = np.round(r.normal(0, 1, (6, 300)) * 2).astype(np.float32) / 2
    ids = r.integers(0, 300, (6, 20)).astype(np.int32)
    ids[:, 1] = ids[:, 0]                                      # a repeated id (equal values, as the IR writes)
    vals = np.round(r.normal(0, 1, (6, 20)) * 2).astype(np.float32) / 2 + 1
    vals[:, 1] = vals[:, 0]
    x[2, 7] = np.nan
    vals[3, 4] = x[3].max()                                    # a written value tying the plain maximum
    x[4] = 0.5
    want_rows = x.copy()
    np.put_along_axis(want_rows, ids, vals, axis=1)
    want = np.array(mx.argmax(mx.array(want_rows), axis=-1, keepdims=True))
    got = native.argmax_put(mx.array(x), mx.array(ids), mx.array(vals))
    np.testing.assert_array_equal(np.array(got), want)


def test_greedy_after_penalties_equals_the_dense_program():
    src = "sampler s(h: tokens, r: float) { penalties(h, last_n = 64, repeat = r) greedy() }"
    p2, p0 = samplec.compile(src), samplec.compile(src, opt_level=0)
    r = np.random.default_rng(12)
    for _ in range(10):
        x = r.standard_normal((3, 5000)).astype(np.float32)
        h = r.integers(-1, 5000, (3, 70)).astype(np.int32)
        h[:, :5] = np.argsort(-x, axis=1)[:, :5]               # the top tokens are in the history
        x[1, :100] = 3.0                                       # ties
        kw = dict(h=h, r=[1.3, 0.7, 2.0])
        assert np.array(p2(x, **kw).token).tolist() == np.array(p0(x, **kw).token).tolist()


def test_rows_at_temperature_zero_equal_the_dense_program_and_the_reference():
    """A per-row zero temperature after cuts and an xtc (its coin firing in some rows, not in others) and before
    more stages: those rows keep the argmax of the current values alone (the kernel's shortcut); the other rows run
    the chain. Token, logprob and the final distribution equal -O0 and the numpy reference, with ties at the top
    (lowest id wins), a temperature that rounds distinct values together, and -inf entries."""
    import reference as R
    src = ("sampler s(t0: float, t: float, k: int, p: float, xp: float, seed: seed) -> token, logprob, probs {"
           " temperature(t0) top_p(p) xtc(0.01, xp, seed) min_p(0.05) temperature(t) top_k(k) sample(seed) }")
    p2, p0 = samplec.compile(src), samplec.compile(src, opt_level=0)
    r = np.random.default_rng(21)
    B, V = 8, 3000
    x = r.standard_normal((B, V)).astype(np.float32)
    x[1, [10, 400, 2999]] = 9.0                               # a tie at the top: id 10 wins
    x[2, ::3] = -np.inf
    x[3, [5, 6]] = [np.nextafter(np.float32(24.44), np.float32(0)), np.float32(24.44)]   # equal after / 3: id 5
    kw = dict(t0=[1.0, 0.7, 1.0, 3.0, 2.0, 1.0, 0.5, 1.0], t=[0.0, 0.0, 0.0, 0.0, 0.0, 0.8, 0.0, 1.3],
              k=[0, 5, 40, 0, 3, 10, 0, 0], p=[0.9, 1.0, 0.5, 0.95, 0.3, 0.9, 1.0, 0.8],
              xp=[0.0, 1.0, 0.0, 0.0, 1.0, 0.5, 1.0, 0.0], seed=[3, 4, 5, 6, 7, 8, 9, 10])
    o2, o0 = p2(x, **kw), p0(x, **kw)
    for name in ("token", "logprob", "probs"):
        np.testing.assert_array_equal(np.array(getattr(o2, name)), np.array(getattr(o0, name)), err_msg=name)
    for b in range(B):
        stages = [("temperature", {"t": kw["t0"][b]}), ("top_p", {"p": kw["p"][b]}),
                  ("xtc", {"threshold": 0.01, "probability": kw["xp"][b], "seed": kw["seed"][b]}),
                  ("min_p", {"m": 0.05}), ("temperature", {"t": kw["t"][b]}), ("top_k", {"k": kw["k"][b]})]
        ref = R.run_chain(x[b], stages, ("sample", {"seed": kw["seed"][b]}))
        assert int(np.array(o2.token)[b]) == ref["token"], b


def test_rows_at_temperature_zero_after_edits_take_the_top_from_the_block_maxima(pure):
    """A row written through edits (penalties, a bias) before a per-row zero temperature: the kernel finds its top
    and the top's first token from the rewritten row's block maxima and one block. A tie at the top across blocks
    whose first holder a penalty lowers, a bias lifting the last token to the top, the top at token 0, a -inf heavy
    row and a row that samples: each as -O0 and the numpy reference."""
    import reference as R
    src = ("sampler s(h: tokens, b: bias, n: float, t: float, k: int, seed: seed) -> token, logprob, probs {"
           " penalties(h, repeat = 1.5, presence = 0.5) logit_bias(b) top_n_sigma(n) temperature(t) top_k(k)"
           " sample(seed) }")
    p2 = samplec.compile(src)
    with pure:
        p0 = samplec.compile(src, opt_level=0)
    r = np.random.default_rng(4)
    B, V = 5, 10000
    x = r.standard_normal((B, V)).astype(np.float32)
    h = np.full((B, 4), -1, np.int32)
    b = np.zeros((B, V), np.float32)
    x[0, [70, 3000, 9000]] = 6.0                      # tied across blocks; the penalty lowers the first
    h[0, 0] = 70
    b[1, V - 1] = 20.0                                # the bias lifts the last token to the top
    x[2, 0] = 9.0                                     # the top at token 0
    x[3, r.random(V) < 0.95] = -np.inf                # -inf heavy
    x[3, 5] = 7.0
    kw = dict(h=h, b=b, n=[2.0, 0.0, 3.0, 1.0, 2.0], t=[0.0, 0.0, 0.0, 0.0, 0.9], k=[0, 5, 0, 3, 40],
              seed=[1, 2, 3, 4, 5])
    o2 = p2(x, **kw)
    with pure:
        o0 = p0(x, **kw)
    np.testing.assert_array_equal(np.array(o2.token), np.array(o0.token))
    for name in ("logprob", "probs"):           # (the sampling row's softmax: float rounding)
        np.testing.assert_allclose(np.array(getattr(o2, name)), np.array(getattr(o0, name)), rtol=1e-6, atol=1e-7)
    assert np.array(o2.token)[:4].tolist() == [3000, V - 1, 0, 5]
    for row in range(B):
        stages = [("penalties", {"history": h[row], "repeat": 1.5, "presence": 0.5}), ("logit_bias", {"b": b[row]}),
                  ("top_n_sigma", {"n": kw["n"][row]}), ("temperature", {"t": kw["t"][row]}),
                  ("top_k", {"k": kw["k"][row]})]
        ref = R.run_chain(x[row], stages, ("sample", {"seed": kw["seed"][row]}))
        assert int(np.array(o2.token)[row]) == ref["token"], row


@pytest.mark.parametrize("V", [1, 63, 64, 200, 5000])
def test_row_softmax_matches_mlx_softmax(V):
    """The `probs` pattern's primitive against exp(x - max) / sum in MLX ops: rows mostly -inf (whole 64-blocks
    skipped), ties, one finite entry, and rows whose maximum is not finite (NaN there, as in MLX)."""
    r = np.random.default_rng(V)
    x = (r.standard_normal((7, V)) * 3).astype(np.float32)
    x[1, r.random(V) < 0.9] = -np.inf
    x[1, 0] = 2.0
    x[2] = np.round(x[2])
    x[3] = -np.inf
    x[3, V // 2] = 0.5
    x[4] = -np.inf
    x[5, V - 1] = np.nan
    x[6, 0] = np.inf
    xm = mx.array(x)
    e = mx.exp(xm - mx.max(xm, axis=-1, keepdims=True))
    mlx_ops = np.array(e / mx.sum(e, axis=-1, keepdims=True))
    x64 = x[:4].astype(np.float64)
    e64 = np.exp(x64 - x64.max(axis=-1, keepdims=True))
    exact = e64 / e64.sum(axis=-1, keepdims=True)
    got = np.array(native.row_softmax(xm))
    np.testing.assert_allclose(got[:4], exact, rtol=2e-6, atol=1e-30)         # (MLX's float32 sum: ~3e-5)
    np.testing.assert_allclose(mlx_ops[:4], exact, rtol=1e-4, atol=1e-30)
    assert np.isnan(got[4:]).all() and np.isnan(mlx_ops[4:]).all()
    np.testing.assert_array_equal(got[:4] == 0, mlx_ops[:4] == 0)
    strided = mx.array(x[:4, ::-1].copy())[:, ::-1]                  # a view: read through its strides
    np.testing.assert_allclose(np.array(native.row_softmax(strided)), exact, rtol=2e-6, atol=1e-30)


def test_probs_output_comes_from_the_chain_kernel_and_equals_the_dense_program(pure, tmp_path):
    """A `probs` output (softmax of the chain's final logits) is written by the chain kernel itself, not by MLX's
    exp, sum and divide over the final logits; its values equal the MLX-ops program's (rows on the candidates, on
    the whole row, and at temperature 0)."""
    src = "sampler s(t: float, k: int, seed: seed) -> token, probs { temperature(t) top_k(k) sample(seed) }"
    prog = samplec.compile(src)
    x = logits(4, 3000, 5)
    kw = dict(t=[0.7, 1.0, 1.3, 0.0], k=[5, 0, 3000, 7], seed=[1, 2, 3, 4])
    got = prog(x, **kw)
    with pure:
        want = samplec.compile(src)(x, **kw)
    np.testing.assert_array_equal(np.array(got.token), np.array(want.token))
    np.testing.assert_allclose(np.array(got.probs), np.array(want.probs), rtol=1e-4, atol=1e-12)
    from samplec.backend_mlx.interpreter import Executable
    outs, _ = Executable(prog.graph, compile=False)(*prog.prepare(x, kw))
    prims = _primitives([outs[1]], tmp_path / "g.dot")
    assert "SamplecSampleChain" in prims and not {"Exp", "Sum", "Divide", "SamplecRowSoftmax"} & set(prims), prims


@pytest.mark.parametrize("V", [1, 7, 64, 5000])
def test_row_max_is_mlx_max(V):
    """reduce_max over a float32 [B, V]: MLX's max, a NaN winning, -inf rows, -0.0, strided views."""
    r = np.random.default_rng(V + 1)
    x = (r.standard_normal((5, V)) * 3).astype(np.float32)
    x[1] = -np.inf
    x[2, V // 2] = np.nan
    x[3] = -0.0
    x[4, -1] = np.inf
    xm = mx.array(x)
    want = np.array(mx.max(xm, axis=-1, keepdims=True))
    np.testing.assert_array_equal(np.array(native.row_max(xm)), want)
    view = mx.array(x[:, ::-1].copy())[:, ::-1]
    np.testing.assert_array_equal(np.array(native.row_max(view)), want)


def test_chain_on_edits_equals_the_chain_on_the_written_row():
    """sample_chain(x, ..., edits=(ids, values)) runs on put_along(x, ids, values) (a repeated id carries equal
    values, as the penalties write them): token, logprob and final logits equal those of the written row."""
    r = np.random.default_rng(31)
    x = logits(4, 3000, 31)
    ids = r.integers(0, 3000, (4, 40)).astype(np.int32)
    ids[:, :5] = np.argsort(-x, axis=1)[:, :5]                  # edits on the top tokens
    ids[:, 6] = ids[:, 5]
    vals = (np.take_along_axis(x, ids, axis=1) / 1.3 - 0.5).astype(np.float32)
    written = x.copy()
    np.put_along_axis(written, ids, vals, axis=1)
    params = [mx.array([[40], [5], [0], [3000]], dtype=mx.int32), mx.array([[0.8], [1.0], [0.5], [2.0]]),
              mx.array([[1], [2], [3], [4]], dtype=mx.uint64), mx.array([[7], [7], [7], [7]], dtype=mx.uint32)]
    got = native.sample_chain(mx.array(x), params, ["top_k", "temperature"], "sample", True, True,
                              edits=(mx.array(ids), mx.array(vals)))
    want = native.sample_chain(mx.array(written), params, ["top_k", "temperature"], "sample", True, True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.array(g), np.array(w))


def test_top_logprob_ids_orders_by_rounded_logprobs_lower_id_first():
    """top_logprobs' ids and values: the k largest of (x - max) - log Z as MLX computes them, descending, the lower id first
    among equal values -- also where distinct logits round to one log-probability (a higher id with a larger logit
    then follows a lower id), with exact ties at the k-th, -inf entries and a one-token row."""
    r = np.random.default_rng(41)
    x = (r.standard_normal((4, 5000)) * 3).astype(np.float32)
    x[0, [7, 9, 4000]] = 20.0                                      # an exact tie at the top
    x[1, 100] = np.float32(30.0)
    x[1, 50] = np.nextafter(np.float32(30.0), np.float32(0))      # rounds onto id 100's log-prob
    x[2, ::2] = -np.inf
    x[3] = -np.inf
    x[3, 17] = 1.0
    xm = mx.array(x)
    lse = native.row_logsumexp(xm)
    ids, vals = native.top_logprob_ids(xm, lse[:, :1], lse[:, 1:], 6, 8)
    got, got_vals = np.array(ids), np.array(vals)
    lp = np.array((xm - lse[:, :1]) - lse[:, 1:])                 # MLX's own log-softmax values
    for b in range(4):
        want = sorted(range(5000), key=lambda i: (-lp[b, i], i))[:6]
        assert got[b].tolist() == want, (b, got[b].tolist(), want)
        np.testing.assert_array_equal(got_vals[b], lp[b, want])   # (the values: the same floats, no gather)


def test_chain_reports_the_argmax_of_its_input_as_mlx_does():
    """want_top: the chain's own pass over x gives MLX's argmax of x (first maximum; the first NaN wins; -0.0 and
    0.0 tie, the first one wins) and the value there -- what the logits checks read -- on rows that take the
    candidate path, the whole-row path and the temperature-0 shortcut -- and the logits checks' two flags there."""
    r = np.random.default_rng(51)
    x = r.standard_normal((6, 3000)).astype(np.float32)
    x[0, [100, 2000]] = 9.0                                     # a tie: the first
    x[1, 1500] = np.nan                                         # a NaN wins
    x[1, 2500] = np.nan
    x[2] = -np.inf
    x[2, 2999] = 0.0                                            # in the last block
    x[3] = 0.0
    x[3, 0], x[3, 5] = -0.0, -1.0                               # -0.0 first among the zeros
    x[4] = np.round(x[4])
    xm = mx.array(x)
    params = [mx.array([[0.0], [1.0], [1.0], [1.0], [0.5], [1.0]]), mx.array([[1], [2], [3], [4], [5], [6]],
              dtype=mx.uint64), mx.array([[0]] * 6, dtype=mx.uint32)]
    out = native.sample_chain(xm, params, ["temperature"], "sample", False, want_top=True)
    want_pos = np.array(mx.argmax(xm, axis=-1, keepdims=True))
    np.testing.assert_array_equal(np.array(out[2]), want_pos)
    got_val = np.array(out[3])[:, 0]
    want_val = np.take_along_axis(x, want_pos, axis=1)[:, 0]
    np.testing.assert_array_equal(np.isnan(got_val), np.isnan(want_val))
    ok = ~np.isnan(want_val)
    np.testing.assert_array_equal(got_val[ok], want_val[ok])
    assert np.signbit(got_val[3]) == np.signbit(want_val[3])
    # and the logits checks' flags on it, as the checks compute them
    np.testing.assert_array_equal(np.array(out[4]), np.isnan(want_val) | (want_val == np.inf))
    np.testing.assert_array_equal(np.array(out[5]), want_val == -np.inf)


@pytest.mark.parametrize("tail", ["top_k(k) sample(seed)", "sample(seed)", "top_p(0.9) sample(seed)",
                                  "temperature(0.5) top_k(k) greedy()"])
def test_min_p_keeping_the_tail_then_more_stages_equals_the_dense_program(tail):
    """min_p whose floor lies below the candidates' bound (a flat row keeps almost everything) leaves a tail that
    is no longer "every token below the bound": a later cut by count or a draw may still end above the bound, what
    needs the tail's mass (top_p, logprob, probs) falls back to the whole row -- token, logprob and probs equal -O0."""
    src = (f"sampler s(m: float, k: int, seed: seed) -> token, logprob, probs {{ temperature(0.8) min_p(m) {tail} }}")
    r = np.random.default_rng(61)
    x = (r.standard_normal((4, 20000)) * np.array([[0.05], [0.3], [3.0], [0.01]])).astype(np.float32)
    kw = dict(m=[0.05, 0.5, 0.05, 0.9], k=[50, 3, 7, 1000], seed=[1, 2, 3, 4])
    o2, o0 = samplec.compile(src)(x, **kw), samplec.compile(src, opt_level=0)(x, **kw)
    np.testing.assert_array_equal(np.array(o2.token), np.array(o0.token))
    np.testing.assert_allclose(np.array(o2.logprob), np.array(o0.logprob), atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(o2.probs), np.array(o0.probs), atol=1e-5)
    lean = src.replace("-> token, logprob, probs", "-> token")        # (no mass needed: the floored tail path)
    for seed in range(6):
        kw["seed"] = [seed * 4 + i for i in range(4)]
        t2 = np.array(samplec.compile(lean)(x, **kw).token)
        t0 = np.array(samplec.compile(lean, opt_level=0)(x, **kw).token)
        np.testing.assert_array_equal(t2, t0)


@pytest.mark.parametrize("kind", ["ties", "neg_inf", "sparse_top"])
def test_draw_over_compacted_kept_tokens_equals_the_reference(kind):
    """A cut that keeps thousands of tokens spread over the row (a value 19k tokens share; a -inf-heavy row) draws
    over the kept tokens' ids compacted, sixteen RandomBits at a time: the spec's Gumbel-max token all the same."""
    import reference as R
    rng = np.random.default_rng(11)
    V = 152064
    if kind == "ties":
        x = rng.integers(-4, 4, (1, V)).astype(np.float32)
    elif kind == "neg_inf":
        x = rng.standard_normal((1, V)).astype(np.float32)
        x[rng.random((1, V)) < 0.9] = -np.inf
    else:                                   # a few strong tokens far apart, the rest far below them
        x = rng.standard_normal((1, V)).astype(np.float32) - 30
        x[0, rng.choice(V, 3000, replace=False)] = rng.standard_normal(3000).astype(np.float32)
    prog = samplec.compile("sampler s(k: int, seed: seed, pos: int) -> token, logprob "
                           "{ top_k(k) min_p(0.01) sample(seed, position = pos) }", opt_level=2)
    for seed in range(40):
        out = prog(x, k=2000 + seed, seed=seed, pos=seed * 7)
        ref = R.run_chain(x[0], [("top_k", {"k": 2000 + seed}), ("min_p", {"m": 0.01})],
                          ("sample", {"seed": seed, "position": seed * 7}))
        assert int(np.array(out.token)[0]) == ref["token"], (kind, seed)
        np.testing.assert_allclose(np.array(out.logprob)[0], ref["logprob"], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("cut", ["top_k(k)", "min_p(0.3)", "top_p(0.9)", "top_k(k) top_p(0.95)"])
def test_a_tied_top_under_a_few_biased_tokens_equals_the_reference(pure, cut):
    """Integer logits (a top value ~19,000 tokens share, in every block) with a few tokens biased above it: the
    candidates' bound is that value across more blocks than a second attempt adds, so the tokens at it join the
    candidates. Tokens and logprobs are the spec's, and the probs -O0's."""
    import reference as R
    rng = np.random.default_rng(5)
    V = 152064
    x = rng.integers(-4, 4, (1, V)).astype(np.float32)
    ids = rng.choice(V, 4, replace=False)
    bias = np.zeros((1, V), np.float32)
    bias[0, ids] = [5.0, 1.0, 1.0, -1.0]
    src = ("sampler s(b: bias, k: int, t: float, seed: seed, pos: int) -> token, logprob, probs "
           f"{{ temperature(t) logit_bias(b) {cut} sample(seed, position = pos) }}")
    prog = samplec.compile(src, opt_level=2)
    with pure:
        dense = samplec.compile(src, opt_level=0)
    stages = {"top_k(k)": [("top_k", {"k": None})], "min_p(0.3)": [("min_p", {"m": 0.3})],
              "top_p(0.9)": [("top_p", {"p": 0.9})],
              "top_k(k) top_p(0.95)": [("top_k", {"k": None}), ("top_p", {"p": 0.95})]}[cut]
    for seed in range(12):
        k, t = [1, 2, 10, 3000][seed % 4], [1.0, 0.7, 1.5][seed % 3]
        out = prog(x, b=bias, k=k, t=t, seed=seed, pos=seed)
        with pure:
            want = dense(x, b=bias, k=k, t=t, seed=seed, pos=seed)
        chain = [("temperature", {"t": t}), ("logit_bias", {"b": bias[0]})]
        chain += [(n, {"k": k} if n == "top_k" else kw) for n, kw in stages]
        ref = R.run_chain(x[0], chain, ("sample", {"seed": seed, "position": seed}))
        assert int(np.array(out.token)[0]) == ref["token"] == int(np.array(want.token)[0]), (cut, seed)
        np.testing.assert_allclose(np.array(out.logprob)[0], ref["logprob"], atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(np.array(out.probs), np.array(want.probs), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chain", ["temperature(t) min_p(m) -> probs", "temperature(t) min_p(m) -> token, probs",
                                   "temperature(t) min_p(m) top_n_sigma(1) top_k(11) -> token, logprob",
                                   "min_p(m) top_k(k) temperature(t) -> token, logprob, probs",
                                   "min_p(m) temperature(t) top_p(0.8) -> token",
                                   "min_p(m) greedy_terminal -> token", "min_p(m) greedy_terminal -> token, logprob",
                                   "min_p(m) min_p(0.5) -> token, logprob"])
def test_a_tied_top_a_min_p_reads_past_equals_the_dense_program(pure, chain):
    """Integer logits: the top value is held by ~19,000 tokens in every block, so the candidates are the tokens at
    it, and a min_p that keeps the next value down (m = 0.2 at t >= 0.7) leaves the chain reading the row below
    them -- the kernel goes to the whole row without gathering the tie (and gathers it where a later stage may end
    the tail: a top_k within the tie, a greedy token). A min_p of 0.5 keeps the tie alone. Each as -O0."""
    rng = np.random.default_rng(8)
    V = 152064
    x = rng.integers(-4, 4, (2, V)).astype(np.float32)
    body, outs = chain.split(" -> ")
    terminal = "greedy()" if "greedy_terminal" in body else "sample(seed)" if "token" in outs else ""
    body = body.replace("greedy_terminal", "")
    src = f"sampler s(m: float, k: int, t: float, seed: seed) -> {outs} {{ {body} {terminal} }}"
    prog = samplec.compile(src, opt_level=2)
    with pure:
        dense = samplec.compile(src, opt_level=0)
    for m, k, t in [(0.2, 11, 1.0), (0.2, 30000, 0.7), (0.5, 30000, 1.0), (0.2, 11, 1.5)]:
        kw = dict(m=m, k=k, t=t, seed=[int(k + 10 * m), int(3 * t + 1)])     # (some unused: a warning)
        got = prog(x, **kw)
        with pure:
            want = dense(x, **kw)
        for name in outs.replace(" ", "").split(","):
            g, w = np.array(getattr(got, name)), np.array(getattr(want, name))
            if name == "token":
                np.testing.assert_array_equal(g, w, err_msg=f"{chain} {m} {k} {t}")
            else:
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=f"{chain} {m} {k} {t} {name}")


@pytest.mark.parametrize("chain", ["temperature(t) epsilon(0.0003) temperature(t) greedy()",
                                   "temperature(t) eta(0.0003) temperature(t) greedy()",
                                   "temperature(t) epsilon(0.0003) temperature(t) sample(seed)",
                                   "temperature(t) epsilon(0.0003) greedy()"])
def test_epsilon_keeps_a_tail_at_the_maximum(pure, chain):
    """temperature(inf) makes every finite logit 0: every token is at the maximum, which epsilon and eta always
    keep. The candidates' tail (everything at or below their bound) is at the maximum too, whatever its p: the row
    is not decided by the candidates alone (-O2 kept 33 tokens here)."""
    import reference as R
    x = np.random.default_rng(0).normal(0, 1, (1, 40000)).astype(np.float32)
    src = f"sampler s(t: float, seed: seed) -> token, logprob, probs {{ {chain} }}"
    got = samplec.compile(src, opt_level=2)(x, t=np.inf, seed=3)
    with pure:
        want = samplec.compile(src, opt_level=0)(x, t=np.inf, seed=3)
    stages = [("temperature", {"t": np.inf}), (chain.split()[1].split("(")[0], {"e": 0.0003})]
    stages += [("temperature", {"t": np.inf})] * (chain.count("temperature") - 1)
    ref = R.run_chain(x[0], stages, ("sample", {"seed": 3}) if "sample" in chain else ("greedy", {}))
    assert int(np.array(got.token)[0]) == int(np.array(want.token)[0]) == ref["token"]
    assert int((np.array(got.probs) > 0).sum()) == int((np.array(want.probs) > 0).sum()) == 40000
    np.testing.assert_allclose(np.array(got.logprob), np.array(want.logprob), rtol=1e-6)


@pytest.mark.parametrize("t", [1.0, 0.7, np.inf])
@pytest.mark.parametrize("chain", ["top_k(k)", "top_k(k) top_p(0.9)"])
def test_a_masked_row_with_top_k_past_its_tokens_equals_the_dense_program(pure, t, chain):
    """Ten allowed tokens of 152,064 (a grammar's mask) and a top_k of 40: the candidates' bound is -inf in
    thousands of blocks, which are no candidates (gathered, they were 152,064 tokens of -inf: a temperature of inf
    made them NaN, and a call hung or drew a removed token)."""
    rng = np.random.default_rng(3)
    V = 152064
    x = np.full((2, V), -np.inf, np.float32)
    for r in range(2):
        ids = rng.choice(V, 10, replace=False)
        x[r, ids] = rng.normal(0, 1, 10).astype(np.float32)
    src = (f"sampler s(t: float, k: int, seed: seed) -> token, logprob, probs "
           f"{{ temperature(t) {chain} sample(seed) }}")
    got = samplec.compile(src, opt_level=2)(x, t=t, k=40, seed=[5, 6])
    with pure:
        want = samplec.compile(src, opt_level=0)(x, t=t, k=40, seed=[5, 6])
    np.testing.assert_array_equal(np.array(got.token), np.array(want.token))
    assert np.isfinite(x[[0, 1], np.array(got.token)]).all()
    np.testing.assert_allclose(np.array(got.probs), np.array(want.probs), atol=1e-7)
    np.testing.assert_allclose(np.array(got.logprob), np.array(want.logprob), rtol=1e-5, atol=1e-6)


def _dense_penalties(op, *ins):
    from samplec.backend_mlx.interpreter import _run_expansion
    return np.array(_run_expansion(type("N", (), {"op": op}), [mx.array(i) for i in ins]))


def test_penalty_edits_are_the_dense_penalties(pure):
    """penalty_edits: the window's ids and penalized logits written into x give the stage's dense definition bit for
    bit, and its flag is the check's -- per-row last_n (-1, 0, inside and beyond H), padding, a row of padding only,
    token 0 counted and not, repeats, -inf and tied logits, an overflow to +inf; then a second stage reading the
    first one's edits (prior), where both histories hold the same tokens."""
    rng = np.random.default_rng(4)
    B, V, H = 5, 400, 48
    x = (np.round(rng.standard_normal((B, V)) * 6) / 2).astype(np.float32)
    x[0, ::7] = -np.inf
    x[3, 10] = 3e38                                                   # / 0.7 overflows
    hist = rng.integers(-1, 60, (B, H)).astype(np.int32)
    hist[2] = -1
    hist[3, ::2] = 0
    hist[3, -1] = 10
    hist[1, 3] = 0
    cols = lambda *v, dt=np.float32: np.array(v, dtype=dt)[:, None]
    args = [hist, cols(-1, 0, 5, 100, 48, dt=np.int32), cols(1.3, 0.5, 1.0, 0.7, 2.0), cols(0.5, 0.0, 1.0, -0.5, 0.25),
            cols(0.0, 1.0, 0.5, 0.0, -1.0)]
    ids, vals, over = native.penalty_edits(mx.array(x), *(mx.array(a) for a in args))
    got = np.array(mx.put_along_axis(mx.array(x), ids, vals, axis=-1))
    with pure:
        want = _dense_penalties("penalties", x, *args)
        want_over = _dense_penalties("penalties_overflow", x, *args)
    assert np.array_equal(got, want, equal_nan=True) and np.array_equal(np.signbit(got), np.signbit(want))
    assert np.array(over).tolist() == want_over.tolist() == [False, False, False, True, False]
    assert not np.array_equal(want, x)

    hist2 = rng.integers(-1, 60, (B, 8)).astype(np.int32)
    args2 = [hist2, cols(-1, -1, 4, 8, 0, dt=np.int32), cols(1.0, 1.0, 1.0, 1.0, 1.0), cols(0.5, 1.0, 2.0, 0.1, 0.5),
             cols(1.0, 0.0, 0.5, 2.0, 1.0)]
    ids2, vals2, _ = native.penalty_edits(mx.array(x), *(mx.array(a) for a in args2), prior=(ids, vals))
    got2 = np.array(mx.put_along_axis(mx.array(got), ids2, vals2, axis=-1))
    with pure:
        want2 = _dense_penalties("penalties", want, *args2)
    assert np.array_equal(got2, want2, equal_nan=True)


def test_penalty_edits_flag_a_row_left_with_no_token_as_the_dense_check_does(pure):
    """After a cut a row holds a few finite logits among -inf: the flag (penalties_overflow) is set exactly where
    the penalized row has no finite value left -- the survivors all in the history and sent to -inf, or one
    survivor outside it (at the row's first or last position, V not a multiple of the scan's chunks, a NaN),
    through a prior stage's edits and through an allow mask and a bias below the penalties."""
    rng = np.random.default_rng(8)
    B, V, H = 8, 1000, 6
    x = np.full((B, V), -np.inf, np.float32)
    hist = np.full((B, H), -1, np.int32)
    x[0, [3, 500]] = -3e38; hist[0, :2] = [3, 500]                  # both survivors overflow to -inf: flagged
    x[1, [3, 500, V - 1]] = [-3e38, -3e38, 0.5]; hist[1, :2] = [3, 500]   # the last token is left
    x[2, [0, 77]] = [1.0, -3e38]; hist[2, 0] = 77                  # the first token is left
    x[3, 10] = -3e38; x[3, 20] = np.nan; hist[3, 0] = 10            # a NaN is not -inf
    x[4] = rng.standard_normal(V).astype(np.float32)                # a whole row, nothing cut
    x[5, 999] = -3e38; hist[5, 0] = 999                             # one survivor, the last token, in the history
    x[6, [64, 128]] = [2.0, -3e38]; hist[6, 0] = 128                # at a chunk's start
    x[7, 0] = -3e38                                                 # padding only: token 0 counts nothing, stays
    args = [hist, np.full((B, 1), -1, np.int32), np.full((B, 1), 1.5, np.float32), np.zeros((B, 1), np.float32),
            np.zeros((B, 1), np.float32)]
    ids, vals, over = native.penalty_edits(mx.array(x), *(mx.array(a) for a in args))
    with pure:
        want = _dense_penalties("penalties_overflow", x, *args)
        pen = _dense_penalties("penalties", x, *args)
    assert np.array(over).tolist() == want.tolist() == [True, False, False, False, False, True, False, False]

    # a second stage after the first one's edits: row 1's last token now in the second history and sent to -inf
    hist2 = np.full((B, 2), -1, np.int32)
    hist2[1, 0] = V - 1
    x2 = x.copy(); x2[1, V - 1] = -3e38
    args1 = [a.copy() for a in args]
    ids1, vals1, _ = native.penalty_edits(mx.array(x2), *(mx.array(a) for a in args1))
    args2 = [hist2] + args[1:3] + [np.zeros((B, 1), np.float32)] * 2
    _, _, over2 = native.penalty_edits(mx.array(x2), *(mx.array(a) for a in args2), prior=(ids1, vals1))
    with pure:
        first = _dense_penalties("penalties", x2, *args1)
        want2 = _dense_penalties("penalties_overflow", first, *args2)
    assert np.array(over2).tolist() == want2.tolist()
    assert want2[1] and not want2[2]

    # through an allow mask and a bias: the mask removes row 2's survivor, the bias keeps row 4 whole
    mask = np.ones((B, V), bool); mask[2, 0] = False
    bias = np.zeros((B, V), np.float32); bias[1, V - 1] = -np.inf
    _, _, over3 = native.penalty_edits(mx.array(x), *(mx.array(a) for a in args),
                                       pre=(("mask", mx.array(mask)), ("bias", mx.array(bias))))
    with pure:
        seen = np.where(mask, x, -np.inf) + bias
        want3 = _dense_penalties("penalties_overflow", seen, *args)
    assert np.array(over3).tolist() == want3.tolist()
    assert want3[1] and want3[2] and not want3[4]


def test_argmax_put_takes_the_last_write_of_an_id():
    """Edits of two penalty stages, one list: an id written twice holds its second value (put_along in order)."""
    x = np.zeros((2, 200), np.float32)
    ids = np.array([[5, 9, 5], [7, 7, 3]], np.int32)
    vals = np.array([[4.0, 2.0, 1.0], [1.0, 3.0, 2.0]], np.float32)      # 5: 4 then 1 -> 9 wins; 7: 1 then 3
    assert np.array(native.argmax_put(mx.array(x), mx.array(ids), mx.array(vals))).ravel().tolist() == [9, 7]


def test_penalties_after_penalties_are_one_list_of_edits(pure):
    """vLLM's two penalty stages: the chain kernel takes both stages' edits as one list, in order (the second
    computed from the first's values) -- the same tokens, logprobs and final distribution as
    without the native primitives and as -O0, with tokens in both histories (the second stage's value wins)."""
    src = ("sampler s(a: tokens, b: tokens, r: float, f: float, seed: seed) -> token, logprob, probs { "
           "penalties(a, repeat = r) penalties(b, frequency = f, presence = 2.0) temperature(0.8) sample(seed) }")
    rng = np.random.default_rng(2)
    V = 3000
    x = rng.standard_normal((4, V)).astype(np.float32) * 2
    a = rng.integers(-1, 50, (4, 32)).astype(np.int32)            # the same few tokens in both histories
    b = rng.integers(-1, 50, (4, 8)).astype(np.int32)
    x[:, :50] += 6                                                  # ... and the likely ones
    kw = dict(a=a, b=b, r=[1.3, 1.1, 2.0, 0.8], f=[0.5, 0.0, 1.0, 0.2])
    for seed in range(5):
        got = samplec.compile(src, opt_level=2)(x, seed=seed, **kw)
        with pure:
            want = samplec.compile(src, opt_level=2)(x, seed=seed, **kw)
        ref = samplec.compile(src, opt_level=0)(x, seed=seed, **kw)
        assert np.array(got.token).tolist() == np.array(want.token).tolist() == np.array(ref.token).tolist()
        np.testing.assert_allclose(np.array(got.logprob), np.array(ref.logprob), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.array(got.probs), np.array(ref.probs), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("temp", [1.0, 0.7])
@pytest.mark.parametrize("kind", ["flat", "ties", "flat_ties", "wide"])
def test_top_p_over_the_whole_row_keeps_the_reference_nucleus(kind, temp):
    """A leading top_p whose nucleus is most of the row runs on the whole row: its mass selection histograms the
    probabilities' bits straight from the row and refines only the boundary bucket (one value in it: a tied row's
    cut at once). The kept set (probs > 0) is the contract's -- every token whose mass strictly above, summed
    exactly, is below p, up to rounding within 1e-6 of p (the reference's float32 cumsum drifts by a few tokens'
    mass on a flat row: tests/reference.py is not the judge at the boundary) -- and the token is the reference's."""
    import reference as R
    rng = np.random.default_rng(23)
    V = 152064
    if kind == "flat":
        x = rng.normal(0, 0.05, (1, V)).astype(np.float32)
    elif kind == "ties":
        x = rng.integers(-4, 4, (1, V)).astype(np.float32)
    elif kind == "flat_ties":                # equal values inside a boundary bucket of many values
        x = (np.round(rng.normal(0, 0.05, (1, V)) * 400) / 400).astype(np.float32)
    else:                                    # probabilities over many binades, a fifth of the row removed
        x = rng.normal(0, 3.0, (1, V)).astype(np.float32)
        x[rng.random((1, V)) < 0.2] = -np.inf
    prog = samplec.compile("sampler s(t: float, p: float, seed: seed) -> token, probs "
                           "{ temperature(t) top_p(p) sample(seed) }")
    xt = x[0] / np.float32(temp) if temp != 1.0 else x[0]
    for i, p in enumerate([0.1, 0.5, 0.9, 0.95, 0.999]):
        out = prog(x, t=temp, p=p, seed=i)
        kept = np.array(out.probs)[0] > 0
        q = np.exp(xt.astype(np.float64) - xt.max())
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        above = np.concatenate([[0.0], np.cumsum(q[order])[:-1]])
        first = np.concatenate([[True], q[order][1:] != q[order][:-1]])
        S = np.empty_like(q)
        S[order] = above[np.maximum.accumulate(np.where(first, np.arange(V), 0))]
        sure_in, sure_out = S < p - 1e-6, S > p + 1e-6
        assert kept[sure_in].all() and not kept[sure_out].any(), (kind, p)
        assert sure_in.sum() > 0 and (sure_in | sure_out).sum() >= V - 64, (kind, p)   # (not vacuous)
        ref = R.run_chain(x[0], [("temperature", {"t": temp}), ("top_p", {"p": p})],
                          ("sample", {"seed": i, "position": 0}))
        assert int(np.array(out.token)[0]) == ref["token"], (kind, p)


def test_edited_logsumexp_is_the_normalizers_of_both_rows(pure):
    """edited_logsumexp (greedy after penalties with logprob and raw_logprob): the log-probabilities at idx under
    the logits and under the logits with the edits written in (a later write of an id winning), from one pass:
    the raw row's maximum and log-sum-exp bit for bit row_logsumexp's, the edited row's equal to row_logsumexp
    of the written row -- through the cases where the row's sum less the edited terms would not do: the maximum
    edited (with and without another token at it), a new value above the maximum, a penalized top holding nearly
    all the mass, -inf written, edits in the last partial block, duplicates, idx out of the row."""
    r = np.random.default_rng(5)
    B, V, H = 9, 1000 + 37, 12
    x = r.standard_normal((B, V)).astype(np.float32) * 3
    ids = r.integers(-1, V, (B, H)).astype(np.int32)
    vals = (r.standard_normal((B, H)) * 3).astype(np.float32)
    top = np.argmax(x, axis=1)
    ids[1, 0], vals[1, 0] = top[1], x[1, top[1]] - 5            # the maximum edited, no other token at it
    x[2, 7] = x[2, top[2]]
    ids[2, 0], vals[2, 0] = top[2], -1.0                        # ... another token at it stays
    ids[3, 0], vals[3, 0] = 5, x[3].max() + 2                    # a new value above the maximum
    x[4, 9] = 60.0
    ids[4, :3], vals[4, :3] = 9, [59.0, 0.0, -40.0]              # the top, nearly all the mass, penalized (last wins)
    ids[5, 0], vals[5, 0] = 3, -np.inf                           # -inf written
    ids[6, :4] = [V - 1, V - 2, V - 3, 1000]                     # edits in the last partial block
    ids[7, :] = -1                                               # no edit at all
    idx = np.concatenate([top[:, None][:7], [[V + 5]], [[-3]]]).astype(np.int32)
    idx[3, 0], idx[6, 0] = 5, V - 2
    lp, raw_lp, m, lz = (np.array(a) for a in native.edited_logsumexp(mx.array(x), mx.array(ids), mx.array(vals),
                                                                        mx.array(idx)))
    lse = np.array(native.row_logsumexp(mx.array(x)))
    np.testing.assert_array_equal(m[:, 0], lse[:, 0])
    np.testing.assert_array_equal(lz[:, 0], lse[:, 1])
    xp = x.copy()
    for b in range(B):
        for j in range(H):
            if 0 <= ids[b, j] < V:
                xp[b, ids[b, j]] = vals[b, j]
    lse_p = np.array(native.row_logsumexp(mx.array(xp)))
    at = np.clip(idx[:, 0], 0, V - 1)
    want = (xp[np.arange(B), at] - lse_p[:, 0]) - lse_p[:, 1]
    want_raw = (x[np.arange(B), at] - lse[:, 0]) - lse[:, 1]
    np.testing.assert_allclose(lp[:, 0], want, rtol=1e-6, atol=2e-6)
    np.testing.assert_array_equal(raw_lp[:, 0], want_raw)
    # and against float64: the values, not only the agreement of two float32 paths
    x64 = xp.astype(np.float64)
    ref = x64[np.arange(B), at] - (np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1)) + x64.max(1))
    np.testing.assert_allclose(lp[:, 0], ref, rtol=1e-5, atol=1e-5)


def test_greedy_after_penalties_logprobs_equal_the_dense_program():
    src = ("sampler s(h: tokens, r: float) -> token, logprob, raw_logprob "
           "{ penalties(h, last_n = 64, repeat = r) greedy() }")
    p2, p0 = samplec.compile(src), samplec.compile(src, opt_level=0)
    r = np.random.default_rng(13)
    for _ in range(6):
        x = (r.standard_normal((3, 5000)) * 4).astype(np.float32)
        h = r.integers(-1, 5000, (3, 70)).astype(np.int32)
        h[:, :3] = np.argsort(-x, axis=1)[:, :3]                # the top tokens are penalized
        kw = dict(h=h, r=[1.3, 0.7, 20.0])
        o2, o0 = p2(x, **kw), p0(x, **kw)
        assert np.array(o2.token).tolist() == np.array(o0.token).tolist()
        np.testing.assert_allclose(np.array(o2.logprob), np.array(o0.logprob), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.array(o2.raw_logprob), np.array(o0.raw_logprob), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pen", ["", "penalties(h, repeat = 1.3) "])
def test_chain_gives_the_logits_normalizer_raw_logprob_and_top_logprobs(pure, pen):
    """raw_logprob and top_logprobs read log_softmax(logits): the chain kernel gives its maximum and log-sum-exp
    (row_logsumexp's, bit for bit) and the token's log-probability under it; top_logprob_ids the ids and values.
    Against the MLX-ops program: the same tokens and ids, the values to float rounding (MLX's own log_softmax)."""
    src = ("sampler s(h: tokens, t: float, k: int, seed: seed) -> token, logprob, raw_logprob, top_logprobs(5) "
           f"{{ {pen}top_k(k) temperature(t) sample(seed) }}")
    r = np.random.default_rng(71)
    x = (r.standard_normal((4, 3000)) * 2).astype(np.float32)
    x[1, ::3] = -np.inf
    x[2, [5, 9, 13]] = 9.0                                   # a tie at the top
    h = r.integers(-1, 3000, (4, 20)).astype(np.int32)
    kw = dict(h=h, t=[0.7, 1.0, 0.0, 1.5], k=[5, 0, 40, 1], seed=[1, 2, 3, 4])
    got = samplec.compile(src)(x, **kw).to_dict()
    with pure:
        want = samplec.compile(src)(x, **kw).to_dict()
    for field in ("token", "top_logprobs.ids"):
        np.testing.assert_array_equal(np.array(got[field]), np.array(want[field]))
    for field in ("logprob", "raw_logprob", "top_logprobs.values"):
        np.testing.assert_allclose(np.array(got[field]), np.array(want[field]), rtol=1e-5, atol=1e-5)
    lse = np.array(native.row_logsumexp(mx.array(x)))
    tok = np.array(got["token"])
    np.testing.assert_array_equal(np.array(got["raw_logprob"]), (x[np.arange(4), tok] - lse[:, 0]) - lse[:, 1])


def test_two_penalties_written_out_give_the_second_stages_values(pure):
    """Where something reads the penalized row itself (here `probs` without a terminal), the edits of both stages
    are written by one put_along: a token in both histories carries the second stage's value however the scatter
    orders its writes (the primitive gives every entry of an id the final value)."""
    src = ("sampler s(a: tokens, b: tokens, r: float, f: float) -> probs { "
           "penalties(a, repeat = r) penalties(b, frequency = f, presence = 2.0) }")
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 400)) * 2).astype(np.float32)
    a = rng.integers(-1, 30, (3, 40)).astype(np.int32)
    b = rng.integers(-1, 30, (3, 12)).astype(np.int32)
    kw = dict(a=a, b=b, r=[1.3, 0.5, 3.0], f=[0.5, 1.0, 0.0])
    got = np.array(samplec.compile(src)(x, **kw).probs)
    with pure:
        want = np.array(samplec.compile(src)(x, **kw).probs)
    ref = np.array(samplec.compile(src, opt_level=0)(x, **kw).probs)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-8)


def test_a_tie_across_the_last_partial_block_stays_one_group():
    """The row's last partial block goes through the same vectorized exp as the others: tied logits on both sides
    of the boundary get the same probability, and the whole-row top_p keeps or cuts them together (a scalar exp
    there rounded -1.7647058 differently: token 64 was cut while token 1 stayed)."""
    import reference as R
    x = np.full((1, 65), -np.inf, np.float32)
    x[0, 0], x[0, 1], x[0, 64] = 0.0, np.float32(-1.7647058), np.float32(-1.7647058)
    prog = samplec.compile("sampler s(seed: seed) -> token, probs { top_p(0.8) sample(seed) }")
    probs = np.array(prog(x, seed=0).probs)[0]
    assert np.flatnonzero(probs > 0).tolist() == [0, 1, 64]
    assert probs[1] == probs[64]
    seeds = list(range(200))
    toks = np.array(prog(np.repeat(x, 200, 0), seed=seeds).token)
    for sd in seeds:
        assert toks[sd] == R.run_chain(x[0], [("top_p", {"p": 0.8})], ("sample", {"seed": sd, "position": 0}))["token"]
    # integer logits over a row of 200 (three blocks and a partial one), a temperature first
    r = np.random.default_rng(8)
    y = r.integers(-3, 3, (1, 200)).astype(np.float32)
    prog2 = samplec.compile("sampler s(seed: seed) -> token { temperature(1.7) top_p(0.9) sample(seed) }")
    toks = np.array(prog2(np.repeat(y, 300, 0), seed=list(range(300))).token)
    for sd in range(300):
        want = R.run_chain(y[0], [("temperature", {"t": 1.7}), ("top_p", {"p": 0.9})],
                           ("sample", {"seed": sd, "position": 0}))["token"]
        assert toks[sd] == want, sd
    # the exps of a partial block are the blocks' exps (row_softmax, the normalizers)
    z = np.tile(np.float32([-0.3, -1.7647058, -2.5]), 43)[None, :129]
    sm = np.array(native.row_softmax(mx.array(z)))[0]
    for v in (-0.3, -1.7647058, -2.5):
        assert len(set(sm[z[0] == np.float32(v)].tolist())) == 1


_PART_CHAINS = {
    "mlx_lm": "sampler s(seed: seed, t: float, p: float) -> token, logprob, raw_logprob "
              "{ top_p(p) min_p(0.05) temperature(t) sample(seed, position = 3) }",
    "hf": "sampler s(seed: seed, t: float, h: tokens) -> token, logprob, probs "
          "{ penalties(h, repeat = 1.1) temperature(t) top_k(50) top_p(0.9) sample(seed) }",
    "vllm": "sampler s(seed: seed, t: float, p: float, h: tokens) -> token, logprob, raw_logprob, top_logprobs(5) "
            "{ penalties(h, repeat = 1.05) temperature(t) min_p(0.05) top_k(50) top_p(p) sample(seed) }",
    "dense": "sampler s(seed: seed, t: float, p: float) -> token, logprob "
             "{ temperature(t) top_n_sigma(3.0) typical_p(0.95) top_p(p) sample(seed) }",
}


@pytest.mark.parametrize("chain", sorted(_PART_CHAINS))
def test_parts_give_the_same_outputs_whoever_runs_them(monkeypatch, chain):
    """The chain kernel splits a batch into rows and a long row's passes into fixed spans, run by MLX's worker and
    by the caller while it waits: the outputs are bit-for-bit the same at B = 1, in a batch of four, and with the
    caller not helping (no polling), and the tokens those of -O0."""
    rng = np.random.default_rng(5)
    V = 152064
    x = np.stack([rng.normal(0, 0.05, V), rng.integers(-4, 4, V), rng.normal(0, 1, V),
                  np.where(rng.random(V) < 0.9, -np.inf, rng.normal(0, 2, V))]).astype(np.float32)
    x[2, rng.choice(V, 40, replace=False)] += 9
    hist = rng.integers(0, V, (4, 64)).astype(np.int32)
    src = _PART_CHAINS[chain]
    prog, prog0 = samplec.compile(src), samplec.compile(src, opt_level=0)
    names = {p.name for p in prog.params}
    kw = {k: v for k, v in dict(t=[0.7, 1.0, 0.8, 1.3], p=[0.9, 0.95, 0.5, 0.99]).items() if k in names}

    spin = native._SPIN                        # (off on a single core, or with SAMPLEC_SPIN=0)

    def run(rows, polling=True):
        monkeypatch.setattr(native, "_SPIN", spin and polling)
        extra = dict(h=hist[rows]) if "h" in names else {}
        out = prog(x[rows], seed=[11 + r for r in rows], **{k: [v[r] for r in rows] for k, v in kw.items()}, **extra)
        outputs = {k.split(".")[0] for k, _ in prog.graph.outputs}
        got = {f: np.array(getattr(out, f)) for f in ("token", "logprob", "raw_logprob", "probs") if f in outputs}
        if "top_logprobs" in outputs:
            got["top_ids"], got["top_values"] = np.array(out.top_logprobs.ids), np.array(out.top_logprobs.values)
        return got

    batch = run([0, 1, 2, 3])
    alone = [run([r]) for r in range(4)]
    unhelped = run([0, 1, 2, 3], polling=False)
    for name, v in batch.items():
        np.testing.assert_array_equal(v, np.concatenate([a[name] for a in alone]), err_msg=name)
        np.testing.assert_array_equal(v, unhelped[name], err_msg=name)
    want = np.array(prog0(x, seed=[11, 12, 13, 14], **kw, **(dict(h=hist) if "h" in names else {})).token)
    np.testing.assert_array_equal(batch["token"], want)
    monkeypatch.setattr(native, "_SPIN", spin)
    if native._polling():
        # the caller does take parts: the worker waits for it first and the caller polls all the while (a loaded
        # machine may not run the caller during a short call, or may run the worker's earlier steps past a short
        # poll: both waits end as soon as a part is taken, so long ones cost nothing), and the outputs are the same
        before = native.helped()
        monkeypatch.setattr(native, "SPIN_US", 5e6)
        native._native.set_parts_wait(5e6)
        try:
            again = run([0, 1, 2, 3])
        finally:
            native._native.set_parts_wait(0.0)
        assert native.helped() > before
        for name, v in batch.items():
            np.testing.assert_array_equal(v, again[name], err_msg=name)


def test_chain_top_logprobs_from_its_block_maxima_equal_top_logprob_ids():
    """top_logprobs read by the chain kernel come from its block maxima of the logits (the edited blocks' maxima
    made again from the logits, none where a greedy row skipped them): bit for bit top_logprob_ids's ids and
    values, and the reference's ids (the largest log-probabilities, lower id first among equals)."""
    from samplec.backend_mlx.lowering import TIE_MARGIN
    src = ("sampler s(h: tokens, t: float, seed: seed) -> token, raw_logprob, top_logprobs(5) "
           "{ penalties(h, repeat = 3.0) top_k(20) temperature(t) sample(seed) }")
    r = np.random.default_rng(3)
    V = 20000
    x = r.standard_normal((5, V)).astype(np.float32)
    x[1, r.choice(V, 12, replace=False)] = 7.0               # a tie at the top over many blocks
    top2 = np.argsort(-x[2], kind="stable")[:6]              # the penalties hit the top tokens
    x[3, r.random(V) < 0.95] = -np.inf
    x[4, [64, 65, 640, 6400]] = 5.0                          # ties inside and across blocks; row 4 is greedy
    h = r.integers(0, V, (5, 16)).astype(np.int32)
    h[2, :6] = top2
    h[4, :2] = [64, 640]
    out = samplec.compile(src)(x, h=h, t=[0.8, 1.0, 0.7, 1.2, 0.0], seed=[1, 2, 3, 4, 5])
    lse = native.row_logsumexp(mx.array(x))
    ids, vals = native.top_logprob_ids(mx.array(x), lse[:, :1], lse[:, 1:], 5, TIE_MARGIN)
    np.testing.assert_array_equal(np.array(out.top_logprobs.ids), np.array(ids))
    np.testing.assert_array_equal(np.array(out.top_logprobs.values), np.array(vals))
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64) - x.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - x.max(1, keepdims=True)
    np.testing.assert_array_equal(np.array(ids), np.argsort(-ref, axis=1, kind="stable")[:, :5])
    np.testing.assert_allclose(np.array(vals), np.take_along_axis(ref, np.array(ids), 1), rtol=1e-5, atol=1e-5)


def agrees_with_mlx_ops(pure, prog, src, x, kw, o0=True) -> dict:
    """prog's outputs (token, logprob, raw_logprob, top_logprobs) on x: the MLX-ops program's, and its tokens
    -O0's; returned as a dict."""
    got = prog(x, **kw).to_dict()
    with pure:
        want = samplec.compile(src)(x, **kw).to_dict()
    np.testing.assert_array_equal(np.array(got["token"]), np.array(want["token"]))
    if o0:
        t0 = samplec.compile(src, opt_level=0)(x, **kw).token
        np.testing.assert_array_equal(np.array(got["token"]), np.array(t0))
    np.testing.assert_array_equal(np.array(got["top_logprobs.ids"]), np.array(want["top_logprobs.ids"]))
    for field in ("logprob", "raw_logprob", "top_logprobs.values"):
        np.testing.assert_allclose(np.array(got[field]), np.array(want[field]), rtol=1e-5, atol=1e-5)
    return got


def test_a_dense_bias_is_added_by_the_chain_kernel(pure):
    """logit_bias with a bias parameter between the penalties and the stages (OpenAI's chain): the chain kernel
    adds it as it writes the row (after the penalties' edits) and gives that row's maximum to the bias checks --
    the same outputs as the MLX-ops program, top_logprobs of the logits themselves, and the checks' errors."""
    src = ("sampler s(h: tokens, b: bias, t: float, p: float, seed: seed) -> token, logprob, raw_logprob, "
           "top_logprobs(5) "
           "{ penalties(h, frequency = 0.5, presence = 0.3) logit_bias(b) temperature(t) top_p(p) sample(seed) }")
    from samplec.backend_mlx.interpreter import find_chains
    prog = samplec.compile(src)
    (chain,) = find_chains(prog.graph)
    assert [(p.kind, [m.op for m in p.maxes]) for p in chain.prefix] == [("bias", ["reduce_max"])]
    assert chain.n_pre == 0 and chain.edits and chain.top_logprobs
    r = np.random.default_rng(9)
    B, V = 4, 30000
    x = r.standard_normal((B, V)).astype(np.float32)
    x[1, r.choice(V, 20, replace=False)] += 8
    b = np.where(r.random((B, V)) < 0.01, r.normal(0, 3, (B, V)), 0).astype(np.float32)
    b[2, :V // 2] = -np.inf                                  # half the row removed
    b[3, np.argsort(-x[3])[:3]] = -5.0                       # the top tokens pushed down
    b[0] -= 100.0                                            # every logit far down (the logits' own max stays)
    h = r.integers(-1, V, (B, 24)).astype(np.int32)
    h[3, :3] = np.argsort(-x[3])[:3]                         # ... and penalized too
    kw = dict(h=h, b=b, t=[0.8, 1.0, 0.7, 1.2], p=[0.9, 0.5, 0.95, 0.99], seed=[1, 2, 3, 4])
    got = agrees_with_mlx_ops(pure, prog, src, x, kw)
    for pen in ("", "penalties(h, repeat = 1.2) "):           # (no edits: the bias alone; greedy rows too)
        alt = src.replace("penalties(h, frequency = 0.5, presence = 0.3) ", pen).replace("temperature(t)",
                                                                                        "temperature(t) top_k(30)")
        agrees_with_mlx_ops(pure, samplec.compile(alt), alt, x, {**kw, "t": [0.8, 0.0, 0.7, 1.2]}, o0=False)
    bad = b.copy()
    bad[1] = -np.inf
    with pytest.raises(samplec.SamplecError, match=r"logit_bias: a -inf bias removed every token.*row"):
        prog(x, **{**kw, "b": bad})
    bad, big = b.copy(), x.copy()
    bad[2, 7] = big[2, 7] = 3e38                            # finite, their sum +inf
    with pytest.raises(samplec.SamplecError, match=r"logit_bias: a biased logit overflows float32 \(\+inf\).*row"):
        prog(big, **{**kw, "b": bad})


@pytest.mark.parametrize("body, prefix, n_pre", [
    # vLLM's order: allowed_token_ids, logit_bias, then the penalties (which read the masked, biased row)
    ("allow(m) logit_bias(b) penalties(h, repeat = 1.3) penalties(o, frequency = 0.4, presence = 0.2) "
     "temperature(t) min_p(0.05) top_k(k) top_p(p) sample(seed)", ["mask", "bias"], 2),
    # a grammar's mask after the penalties (HF's processors), a bias before them
    ("logit_bias(b) penalties(h, repeat = 0.7) allow(m) top_k(k) temperature(t) sample(seed)", ["bias", "mask"], 1),
    # allow alone (constrained decoding), and bias then allow without penalties
    ("allow(m) temperature(t) top_k(k) top_p(p) sample(seed)", ["mask"], 0),
    ("logit_bias(b) allow(m) top_p(p) min_p(0.1) temperature(t) sample(seed)", ["bias", "mask"], 0),
    # greedy (an argmax after the passes): a grammar's mask alone, and vLLM's order
    ("allow(m) greedy()", ["mask"], 0),
    ("allow(m) logit_bias(b) penalties(h, repeat = 1.3) greedy()", ["mask", "bias"], 2),
    # no stages, a draw: its logprob reads the biased row too
    ("logit_bias(b) sample(seed)", ["bias"], 0),
])
def test_allow_and_bias_around_the_penalties_are_applied_by_the_chain_kernel(pure, body, prefix, n_pre):
    """allow(mask) and logit_bias(bias) before or after the penalties are applied by the chain kernel as it writes
    the row (the penalties' edits read through those below them) and give their checks' maxima: the same outputs
    as the MLX-ops program and -O0 (flat, tied, peaked and -inf rows; greedy rows), and the checks' errors."""
    names = dict(m="m: mask", b="b: bias", h="h: tokens", o="o: tokens")
    params = ", ".join(v for k, v in names.items() if f"({k})" in body or f"({k}," in body)
    src = (f"sampler s({params}, t: float, k: int, p: float, seed: seed) -> token, logprob, raw_logprob, "
           f"top_logprobs(4) {{ {body} }}")
    from samplec.backend_mlx.interpreter import find_chains
    prog = samplec.compile(src)
    (chain,) = find_chains(prog.graph)
    assert [p.kind for p in chain.prefix] == prefix and chain.n_pre == n_pre
    assert all([m.op for m in p.maxes] == ["reduce_max"] for p in chain.prefix) and chain.top_logprobs
    r = np.random.default_rng(len(body))
    B, V = 6, 40000
    x = r.standard_normal((B, V)).astype(np.float32)
    x[1] = np.round(x[1])                                     # ties
    x[2] = 0.25                                               # flat
    x[3, r.choice(V, 12, replace=False)] += 9                 # peaked
    x[4, r.random(V) < 0.9] = -np.inf                         # -inf heavy
    mask = r.random((B, V)) < 0.6
    mask[np.arange(B), np.argmax(x, axis=-1)] = True
    mask[5, :] = False                                        # one allowed token: its row is greedy in effect
    mask[5, 17] = True
    b = np.where(r.random((B, V)) < 0.05, r.normal(0, 3, (B, V)), 0).astype(np.float32)
    b[0, np.argsort(-x[0])[:4]] = -100.0                      # OpenAI's ban on the top tokens
    h = r.integers(-1, V, (B, 32)).astype(np.int32)
    h[3, :6] = np.argsort(-x[3])[:6]                          # the peak penalized
    o = r.integers(-1, V, (B, 8)).astype(np.int32)
    kw = dict(m=mask, b=b, h=h, o=o, t=[0.8, 1.0, 0.0, 1.3, 0.7, 1.0], k=[0, 40, 5, V, 3, 50],
              p=[0.9, 0.5, 0.95, 1.0, 0.8, 0.3], seed=[1, 2, 3, 4, 5, 6])
    kw = {k: v for k, v in kw.items() if f"{k}:" in src}
    got = agrees_with_mlx_ops(pure, prog, src, x, kw)
    if "m" in kw:
        assert np.array(got["token"])[5] == 17
        empty = mask.copy()
        empty[2] = False
        with pytest.raises(samplec.SamplecError, match=r"allow: the mask allows none of the tokens left \(row 2\)"):
            prog(x, **{**kw, "m": empty})
    if "b" in kw:
        bad = b.copy()
        bad[4] = -np.inf
        with pytest.raises(samplec.SamplecError, match=r"logit_bias: a -inf bias removed every token \(row 4\)"):
            prog(x, **{**kw, "b": bad})


@pytest.mark.parametrize("n, pen", [(9, ""), (12, ""), (9, "penalties(h, repeat = 1.3) "),
                                    (5, "penalties(h, presence = 0.5) ")])
def test_a_long_run_of_allow_and_bias_ops_is_fused_up_to_the_kernels_limit(pure, n, pen):
    """More allow / logit_bias ops than the chain kernel takes (MAX_PREFIX): the kernel applies the last ones, MLX
    ops the others -- the same outputs as the MLX-ops program (a review found the kernel writing past its maxima
    for 9 or more)."""
    from samplec.backend_mlx import native
    from samplec.backend_mlx.interpreter import find_chains
    ops = " ".join(f"allow(m{i})" if i % 2 else f"logit_bias(b{i})" for i in range(n))
    params = ", ".join(f"m{i}: mask" if i % 2 else f"b{i}: bias" for i in range(n))
    src = f"sampler s({params}, h: tokens) -> token, logprob {{ {ops} {pen}top_k(3) sample(1) }}"
    prog = samplec.compile(src)
    (chain,) = find_chains(prog.graph)
    assert len(chain.prefix) == min(n, native.MAX_PREFIX) and chain.n_pre == (len(chain.prefix) if pen else 0)
    r = np.random.default_rng(n)
    B, V = 3, 20000
    x = r.standard_normal((B, V)).astype(np.float32)
    kw = {f"m{i}": r.random((B, V)) < 0.9 for i in range(1, n, 2)}
    for m in kw.values():
        m[:, 0] = True
    kw.update({f"b{i}": r.standard_normal((B, V)).astype(np.float32) for i in range(0, n, 2)})
    kw["h"] = r.integers(0, V, (B, 5)).astype(np.int32) if pen else np.full((B, 1), -1, np.int32)
    got = prog(x, **kw)
    with pure:
        want = samplec.compile(src)(x, **kw)
    np.testing.assert_array_equal(np.array(got.token), np.array(want.token))
    np.testing.assert_allclose(np.array(got.logprob), np.array(want.logprob), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("last_n", (-1, 700))
def test_penalties_over_long_histories_equal_the_dense_definition(pure, last_n):
    """penalty_edits over histories of hundreds to thousands of entries (the ids sorted by a radix pass, the rows
    split between threads): repeated ids, padding anywhere, a window, a second penalties stage reading the first's
    edits, and a greedy chain after them -- the same tokens as -O0 and the MLX ops, the same penalized logits."""
    rng = np.random.default_rng(last_n + 5)
    B, V, H = 5, 20000, 1500
    x = rng.normal(0, 2, (B, V)).astype(np.float32)
    h1 = rng.integers(0, 300, (B, H)).astype(np.int32)           # (many repeats: counts up to ~20)
    h1[rng.random((B, H)) < 0.1] = -1
    h1[1, :] = -1                                                # (a row with no history at all)
    h2 = rng.integers(0, V, (B, 400)).astype(np.int32)
    x[:, :300] += 3.0                                            # (the repeated tokens lead, so they matter)
    kw = dict(h1=h1, h2=h2, rp=rng.uniform(1.05, 1.5, B).astype(np.float32),
              fp=rng.uniform(0, 0.3, B).astype(np.float32), pp=rng.uniform(0, 0.5, B).astype(np.float32),
              t=np.full(B, 0.8, np.float32), seed=np.arange(B, dtype=np.uint64))
    head = "sampler s(h1: tokens, h2: tokens, rp: float, fp: float, pp: float, t: float, seed: seed) "
    pens = (f"penalties(h1, last_n = {last_n}, repeat = rp, frequency = fp) "
            "penalties(h2, presence = pp) ")
    for src in (head + "-> token, logprob, raw_logprob, top_logprobs(3) { " + pens + "temperature(t) top_k(40) "
                "sample(seed) }",
                head + "-> token, logprob, raw_logprob, top_logprobs(3) { " + pens + "greedy() }"):
        agrees_with_mlx_ops(pure, samplec.compile(src), src, x, kw)
    src = head + "-> candidates(400) { " + pens + "}"
    got = samplec.compile(src)(x, **kw)
    want = samplec.compile(src, opt_level=0)(x, **kw)
    np.testing.assert_array_equal(np.array(got.candidates.ids), np.array(want.candidates.ids))
    np.testing.assert_array_equal(np.array(got.candidates.values), np.array(want.candidates.values))


@pytest.mark.parametrize("H", (40, 1000))
def test_edits_with_repeated_ids_last_write_wins(H):
    """argmax_put and edited_logsumexp read put_along(x, ids, vals) without writing it: a repeated id takes its
    last entry's value (put_along's order), whether the edits are sorted by a comparison sort (a few) or by the
    radix pass (many) -- against numpy writing the row."""
    from samplec.backend_mlx import native
    rng = np.random.default_rng(H)
    B, V = 3, 5000
    x = rng.normal(0, 1, (B, V)).astype(np.float32)
    ids = rng.integers(0, 60, (B, H)).astype(np.int32)         # (each id written many times, values differing)
    vals = rng.normal(0, 4, (B, H)).astype(np.float32)
    want = x.copy()
    for r in range(B):
        for j in range(H):
            want[r, ids[r, j]] = vals[r, j]
    got = native.argmax_put(mx.array(x), mx.array(ids), mx.array(vals))
    assert np.array(got).reshape(-1).tolist() == np.argmax(want, axis=1).tolist()
    idx = np.argmax(want, axis=1).astype(np.int32)[:, None]
    lp = native.edited_logsumexp(mx.array(x), mx.array(ids), mx.array(vals), mx.array(idx))
    m = want.max(axis=1, keepdims=True)
    ref = (np.take_along_axis(want, idx, 1) - m - np.log(np.exp(want.astype(np.float64) - m).sum(1, keepdims=True)))
    np.testing.assert_allclose(np.array(lp[0]), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not native.installed(), reason="samplec-native is not installed")
def test_a_build_without_a_stage_code_leaves_that_chain_to_the_definitions(monkeypatch):
    """A samplec-native built before epsilon and eta had codes (7 stage codes): the chain with them runs by the
    dense definitions -- the same tokens as -O0 -- `samplec explain` claims no chain kernel for it, and `samplec
    doctor` says which stages the build predates."""
    from samplec.cli import doctor_report
    from samplec.explain import explain
    monkeypatch.setenv("SAMPLEC_NATIVE", "1")
    monkeypatch.setattr(native._native, "chain_stages", 7, raising=False)
    src = "sampler s(e: float, seed: seed) -> token, probs { top_k(50) eta(e) sample(seed) }"
    x = np.random.default_rng(3).normal(0, 2, (3, 5000)).astype(np.float32)
    a, b = (samplec.compile(src, opt_level=o)(x, e=[0.0, 0.002, 0.02], seed=[1, 2, 3]) for o in (0, 2))
    assert np.array(a.token).tolist() == np.array(b.token).tolist()
    np.testing.assert_array_equal(np.array(a.probs) > 0, np.array(b.probs) > 0)
    assert explain(src).chains == []
    assert any("predates epsilon, eta" in ln for ln in doctor_report())
    monkeypatch.setattr(native._native, "chain_stages", 9, raising=False)
    assert len(explain(src).chains) == 1


@pytest.mark.skipif(not native.installed(), reason="samplec-native is not installed")
def test_top_n_sigma_past_the_float32_variance_keeps_what_O0_and_the_reference_keep(monkeypatch):
    """Logits spread past ~1.8e19 overflow top_n_sigma's float32 sum of squares: the standard deviation is inf, the
    floor -inf, and every token stays -- in -O0's float32 sums, the numpy reference's, the GPU kernel's and
    llama.cpp's float loop, and so in the CPU chain kernel's (its squares are float32, its sums double, and a sum
    past float32 is the overflow). A differential fuzz found the kernel keeping the exact-arithmetic set instead:
    after top_p(0.9) temperature(1e-30), one row drew another token than -O0 and the reference."""
    import reference as R
    monkeypatch.setenv("SAMPLEC_NATIVE", "1")
    rng = np.random.default_rng(0)
    x = (rng.uniform(-1, 1, (2, 32000)) * 1e20).astype(np.float32)
    for body in ("top_n_sigma(0.5) temperature(1e20) sample(seed)",
                 "top_k(4000) temperature(1e20) top_n_sigma(0.5) temperature(1e20) sample(seed)"):
        src = f"sampler s(seed: seed) -> token, probs {{ {body} }}"
        out, o0 = (samplec.compile(src, opt_level=o)(x, seed=[1, 2]) for o in (2, 0))
        np.testing.assert_array_equal(np.array(out.probs) > 0, np.array(o0.probs) > 0)
        assert np.array(out.token).tolist() == np.array(o0.token).tolist()
        stages = [(s.split("(")[0], {"k": 4000} if s.startswith("top_k") else {"n": 0.5}
                   if s.startswith("top_n") else {"t": 1e20}) for s in body.split()[:-1]]
        for b in range(2):
            assert R.run_chain(x[b], stages, ("sample", {"seed": b + 1}))["token"] == int(np.array(out.token)[b])
    # the fuzz's row: a spread of ~1e31 after temperature(1e-30), the deviation's squares past float32
    y = np.random.default_rng(1).normal(0, 3, (1, 100)).astype(np.float32)
    src = "sampler s(h: tokens) -> token { top_p(0.9) temperature(1e-30) top_n_sigma(0.5) penalties(h, last_n = 8, " \
          "repeat = 1.3, frequency = 0.1, presence = 0.2) greedy() }"
    h = np.array([[18, 64, 59, 2, 19, 83, 44, 46, 15, 72, 25, 49]], dtype=np.int32)
    assert np.array(samplec.compile(src)(y, h=h).token).tolist() == \
        np.array(samplec.compile(src, opt_level=0)(y, h=h).token).tolist()


@pytest.mark.parametrize("family", ["ties", "flat", "tied_top", "normal"])
def test_typical_p_on_the_whole_row_is_O0s(family):
    """typical_p where the chain kernel's candidates fall short (a tied top above its band, a flat row) and it
    runs on the whole row -- mass_select over the scores, the band's mean reused from the candidates' attempt, the
    draw over the kept ids or the block walk (under or over half the row kept) -- the same kept sets and tokens as
    -O0, at typical_p 0 (the least score alone) through 0.9, after a temperature too."""
    rng = np.random.default_rng(31)
    V = 152064
    if family == "ties":
        x = rng.integers(-4, 4, (3, V)).astype(np.float32)
    elif family == "flat":
        x = rng.normal(0, 0.05, (3, V)).astype(np.float32)
    elif family == "tied_top":
        x = rng.normal(0, 1, (3, V)).astype(np.float32)
        x[:, rng.choice(V, 20000, replace=False)] = 4.0
    else:
        x = rng.normal(0, 3, (3, V)).astype(np.float32)
    for chain in ("typical_p(m) sample(seed)", "temperature(0.7) typical_p(m) sample(seed)"):
        src = f"sampler s(m: float, seed: seed) -> token, probs {{ {chain} }}"
        progs = [samplec.compile(src, opt_level=o) for o in (0, 2)]
        for m in ([0.0, 0.3, 0.6], [0.9, 0.2, 0.75]):
            a, b = (p(x, m=m, seed=[3, 4, 5]) for p in progs)
            np.testing.assert_array_equal(np.array(a.probs) > 0, np.array(b.probs) > 0, err_msg=f"{chain} {m}")
            assert np.array(a.token).tolist() == np.array(b.token).tolist(), (chain, m)


def _o2_equals_dense_and_O0(pure, src, x, kw):
    """-O2's outputs on x (the chain kernel's) and -O0's, after checking -O2's tokens and `probs` kept sets against
    the MLX-ops program's (the dense definitions) and -O0's."""
    got = samplec.compile(src)(x, **kw)
    with pure:
        want = samplec.compile(src)(x, **kw)
    o0 = samplec.compile(src, opt_level=0)(x, **kw)
    for out in (want, o0):
        assert np.array(got.token).tolist() == np.array(out.token).tolist()
        np.testing.assert_array_equal(np.array(got.probs) > 0, np.array(out.probs) > 0)
    return got, o0


# (t, range, exponent) per row: llama.cpp's defaults, range 0 (plain temperature), a T driven toward 0 (t = range,
# a steep exponent: the argmax alone where the largest logit over T leaves float32), exponent 0 (T = t + range), t 0
# with a range, a wide range, t = inf (T NaN: the argmax alone), a tiny t and range
_DYN_ROWS = [(0.8, 0.5, 1.0), (0.8, 0.0, 1.0), (0.5, 0.5, 40.0), (1.0, 1.0, 0.0), (0.0, 0.3, 1.0), (2.0, 1.5, 0.5),
             (np.inf, 0.5, 1.0), (1e-30, 1e-30, 1.0)]


def _dyn_rows(kind: str, V: int) -> np.ndarray:
    r = np.random.default_rng({"realistic": 1, "flat": 2, "ties": 3, "neg_inf": 4}[kind])
    x = r.normal(0, 1, (len(_DYN_ROWS), V)).astype(np.float32)
    if kind == "realistic":
        for b in range(len(x)):
            x[b, r.choice(V, 30, replace=False)] += r.uniform(4, 12)
    elif kind == "flat":
        x *= 0.05
    elif kind == "ties":
        x = np.round(x * 2) / 2
    else:
        x[r.random(x.shape) < 0.9] = -np.inf
        x[0, :] = -np.inf           # (a row of one token: N = 1, nothing changes)
        x[0, 7] = 1.5
    return x


@pytest.mark.parametrize("chain", ["dynamic_temperature(t, r, e) sample(seed)",
                                   "top_k(k) top_p(0.95) min_p(0.05) dynamic_temperature(t, r, e) sample(seed)",
                                   "dynamic_temperature(t, r, e) top_k(k) top_p(0.9) sample(seed)",
                                   "top_k(k) dynamic_temperature(t, r, e) temperature(0.7) min_p(0.1) greedy()",
                                   "typical_p(0.9) dynamic_temperature(t, r, e) sample(seed)",
                                   "min_p(0.02) dynamic_temperature(t, r, e) top_p(0.8) sample(seed)"])
@pytest.mark.parametrize("kind", ["realistic", "flat", "ties", "neg_inf"])
def test_dynamic_temperature_in_the_chain_kernel_equals_the_dense_program_and_the_reference(pure, chain, kind):
    """dynamic_temperature is a stage op the chain kernel runs (its T from the kept set's count and entropy: the
    candidates', or the whole row's while nothing is cut), per row, in any place of a chain: the tokens, logprobs
    and final distributions of -O2 equal the dense definition's (MLX ops), -O0's and the numpy reference's."""
    import reference as R
    V = 5000
    x = _dyn_rows(kind, V)
    t, r, e = (list(map(float, c)) for c in zip(*_DYN_ROWS))
    kw = dict(t=t, r=r, e=e, k=[40] * len(x), seed=list(range(11, 11 + len(x))))
    src = f"sampler s(t: float, r: float, e: float, k: int, seed: seed) -> token, logprob, probs {{ {chain} }}"
    assert "dynamic_temperature" in samplec.compile(src).ir()
    got, o0 = _o2_equals_dense_and_O0(pure, src, x, kw)
    tokens = np.array(got.token).tolist()
    np.testing.assert_allclose(np.array(got.logprob), np.array(o0.logprob), rtol=1e-4, atol=1e-5)
    names = {"t": "t", "r": "range", "e": "exponent", "k": "k"}
    for b in range(len(x)):
        stages = []
        for st in chain.split(")")[:-1]:
            name, _, args = st.strip().partition("(")
            if name in ("sample", "greedy"):
                continue
            vals = {"t": t[b], "r": r[b], "e": e[b], "k": 40}
            stages.append((name, {(names[a] if name == "dynamic_temperature" else R_ARG.get(name, a)):
                                  vals[a] if a in vals else float(a) for a in (s.strip() for s in args.split(","))}))
        term = ("sample", {"seed": 11 + b}) if "sample" in chain else ("greedy", {})
        assert R.run_chain(x[b], stages, term)["token"] == tokens[b], (b, _DYN_ROWS[b])


R_ARG = {"top_k": "k", "top_p": "p", "min_p": "m", "typical_p": "m", "temperature": "t"}


def test_dynamic_temperature_of_range_zero_is_temperature_and_an_older_build_runs_its_definition(monkeypatch):
    """A literal range of 0 is llama.cpp's plain temperature: the `stages` pass leaves a `temperature` op. A
    native build that predates dynamic_temperature's code (9 stage codes) leaves its chain to the dense
    definitions: -O0's tokens, and `samplec explain` claims no chain kernel."""
    from samplec.explain import explain
    plain = samplec.compile("sampler s(t: float, seed: seed) -> token { dynamic_temperature(t, 0.0) sample(seed) }")
    assert "temperature %logits" in plain.ir() and "dynamic_temperature" not in plain.ir()
    x = np.random.default_rng(5).normal(0, 2, (4, 3000)).astype(np.float32)
    ref = samplec.compile("sampler s(t: float, seed: seed) -> token { temperature(t) sample(seed) }")
    kw = dict(t=[0.0, 0.7, 1.0, 2.5], seed=[1, 2, 3, 4])
    assert np.array(plain(x, **kw).token).tolist() == np.array(ref(x, **kw).token).tolist()
    if not native.installed():
        return
    src = "sampler s(t: float, r: float, seed: seed) -> token, probs { top_k(50) dynamic_temperature(t, r) sample(seed) }"
    monkeypatch.setenv("SAMPLEC_NATIVE", "1")
    monkeypatch.setattr(native._native, "chain_stages", 9, raising=False)
    kw = dict(t=[0.8, 0.8, 1.5, 0.3], r=[0.0, 0.5, 1.0, 0.3], seed=[1, 2, 3, 4])
    a, b = (samplec.compile(src, opt_level=o)(x, **kw) for o in (0, 2))
    assert np.array(a.token).tolist() == np.array(b.token).tolist()
    np.testing.assert_array_equal(np.array(a.probs) > 0, np.array(b.probs) > 0)
    assert explain(src).chains == []
    monkeypatch.setattr(native._native, "chain_stages", 10, raising=False)
    assert len(explain(src).chains) == 1


@pytest.mark.parametrize("kind", ["ties", "rounded", "neg_inf", "realistic"])
def test_mirostat_keeps_the_k_largest_by_rank_as_the_reference_does(pure, kind):
    """mirostat's truncation is the stage op top_k_rank (the k largest, the lowest ids first among equal values),
    which the chain kernel runs: on rows whose k-th value is shared by many tokens, on values a temperature rounds
    together, and on -inf-heavy rows, the tokens and updated mu of -O2 equal the dense definition's (a selection and
    a scan, no sort), -O0's and the numpy reference's (mu's update reads the token's log-probability under the
    kept set; `probs` is the distribution before the terminal); s_hat comes from the m largest values, selected."""
    import reference as R
    V, mus = 3000, [1.0, 3.0, 6.0, 10.0, 15.0, 8.0]
    r = np.random.default_rng(7)
    x = r.normal(0, 1.5, (len(mus), V)).astype(np.float32)
    t = 1.0
    if kind == "ties":
        x = np.round(x * 2) / 2
    elif kind == "rounded":         # consecutive floats just below 2: divided by 0.99, neighbours round together
        x = (np.float32(1.99) + np.float32(2.0 ** -23) * r.integers(0, 400, x.shape)).astype(np.float32)
        t = 0.99
    elif kind == "neg_inf":
        x[r.random(x.shape) < 0.95] = -np.inf
    else:
        x[:, :40] += 8.0
    src = ("sampler s(t: float, mu: state, seed: seed) -> token, mu, probs "
           "{ temperature(t) mirostat(mu, 5.0, 0.1, 100, seed) }")
    ir = samplec.compile(src).ir()
    assert "top_k_rank" in ir and "sort" not in ir
    kw = dict(t=t, mu=np.array(mus, dtype=np.float32), seed=list(range(3, 3 + len(mus))))
    got, o0 = _o2_equals_dense_and_O0(pure, src, x, kw)
    np.testing.assert_allclose(np.array(got.mu), np.array(o0.mu), rtol=1e-5)
    xt_rows = (x / np.float32(t)).astype(np.float32) if t != 1.0 else x
    for b, mu in enumerate(mus):        # (mu's update reads the token's log-probability under the kept set)
        tok, new_mu, _ = R.mirostat(xt_rows[b], mu, 5.0, 0.1, 100, seed=3 + b)
        assert tok == int(np.array(got.token)[b])
        np.testing.assert_allclose(float(np.array(got.mu)[b]), new_mu, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chain", ["top_k(k) xtc(thr, xp, seed) temperature(0.8) sample(seed)",
                                   "top_k(k) top_p(0.95) min_p(0.02) xtc(thr, xp, seed) sample(seed)",
                                   "min_p(0.01) xtc(thr, xp, seed) top_k(3) greedy()",
                                   "top_k(k) xtc(thr, xp, seed) xtc(0.05, 1.0, seed) sample(seed)"])
@pytest.mark.parametrize("kind", ["realistic", "ties", "flat"])
def test_xtc_whose_coin_fires_after_a_cut_runs_on_the_candidates_as_O0_and_the_reference_do(pure, chain, kind):
    """An xtc whose coin fires after a cut that ended among the chain kernel's candidates (llama.cpp's order: top_k
    first) removes its top choices there, not over the whole row: thresholds that target none, one, several, tokens
    of equal probability (ties) and every token (0, -1), per row; the tokens and kept sets equal the dense
    program's, -O0's and the numpy reference's."""
    import reference as R
    thr = [0.05, 0.1, 0.0, -1.0, 0.3, 0.01, 0.02, 0.2]
    B, V = len(thr), 4000
    r = np.random.default_rng(11)
    x = r.normal(0, 1, (B, V)).astype(np.float32)
    if kind == "realistic":
        x[:, :12] += np.linspace(6, 3, 12, dtype=np.float32)
    elif kind == "ties":
        x = np.round(x * 2) / 2
        x[:, :6] = 4.0                          # (six tokens of one probability at the top)
    else:
        x *= 0.02
    xp = [1.0] * (B - 2) + [0.5, 0.5]
    kw = dict(thr=thr, xp=xp, k=[40, 50, 40, 40, 100, 40, 8, 40], seed=list(range(21, 21 + B)))
    src = f"sampler s(thr: float, xp: float, k: int, seed: seed) -> token, probs {{ {chain} }}"
    got, _ = _o2_equals_dense_and_O0(pure, src, x, kw)
    for b in range(B):
        stages = []
        for st in chain.split(")")[:-1]:
            name, _, args = st.strip().partition("(")
            a = [s.strip() for s in args.split(",")]
            if name == "top_k":
                stages.append(("top_k", {"k": kw["k"][b] if a[0] == "k" else int(a[0])}))
            elif name == "xtc":
                stages.append(("xtc", {"threshold": thr[b] if a[0] == "thr" else float(a[0]),
                                       "probability": xp[b] if a[1] == "xp" else float(a[1]), "seed": 21 + b}))
            elif name in R_ARG:
                stages.append((name, {R_ARG[name]: float(a[0])}))
        term = ("sample", {"seed": 21 + b}) if "sample" in chain else ("greedy", {})
        ref = R.run_chain(x[b], stages, term)
        assert ref["token"] == int(np.array(got.token)[b]), (b, thr[b])
        np.testing.assert_array_equal(np.array(got.probs)[b] > 0, ref["probs"] > 0)
