"""The kernels beside the chain kernel on the GPU targets, on the CPU, in both dialects: top_logprobs' selection
(samplec/backend_mlx/gpu_top_logprobs.cu: the k largest log-probabilities of a row) and DRY (gpu_dry.cu: the `dry`
op, the row with its penalties), each one block a row, their sources over the CUDA layer (simt_cuda.h) or the Metal
one (simt_metal.h) compiled with g++ over the thread-per-GPU-thread emulation (tests/simt_emulation.h), at each
dialect's block size. top_logprobs against numpy's exact answer (a stable sort of the log-probabilities MLX computes)
and the CPU's native top_logprob_ids, on rows of ties, flat rows, -inf-heavy rows, signed zeros, chat-shaped tails,
logits that round to one log-probability and rows shorter than a block; DRY against its rule read off in Python and
against the op's definition in MLX ops, on random, periodic, one-token and padded histories, with breakers, per-row
values and overflowing penalties. tests/test_cuda_compile.py compiles the CUDA dialects with NVRTC; nothing here
runs on a GPU (tests/test_gpu.py does, where one is), and no Apple GPU has run the Metal ones."""
from __future__ import annotations

import ctypes
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from samplec.backend_mlx import gpu
from samplec.backend_mlx.lowering import TIE_MARGIN
from test_gpu_chain import CXX, HERE, built, metal_attributes
from test_gpu_dialects import CLANG

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler to build the emulation")


def unit(dialect: str, kernel: str, defines: str = "", small: bool = False) -> str:
    """A kernel beside the chain (`kernel`: top_logprobs, dry) as a C++ translation unit over the emulation of
    `dialect`: the header and body MLX would compile (under the signature MLX writes: the inputs, the shapes the body
    reads, the outputs, and on Metal the attributes the body names), and run(...) launching one block a row. `small`:
    the inputs of fewer than eight elements MLX passes in Metal's constant address space."""
    space = "constant" if small else "device"
    if kernel == "top_logprobs":
        entry, header = gpu.top_logprobs_entry(dialect), gpu.top_logprobs_header(dialect)
        params = [("x", "float", "device"), ("x_shape", "int", "constant"), ("m", "float", space),
                  ("lz", "float", space), ("K", "int", "constant"), ("ids", "int", None), ("vals", "float", None)]
        run = ("const float* x, int B, int V, const float* m, const float* lz, const int* K, int* ids, float* vals",
               "const int shape[2] = {B, V};", "x, shape, m, lz, K, ids, vals")
    else:
        entry, header = gpu.dry_entry(dialect), gpu.dry_header(dialect)
        params = [("x", "float", "device"), ("x_shape", "int", "constant"), ("h", "int", "device"),
                  ("h_shape", "int", "constant"), ("mult", "float", space), ("base", "float", space),
                  ("allowed", "int", space), ("last_n", "int", space), ("brk", "bool", "device"),
                  ("n", "int", "constant"), ("out", "float", None), ("rep", "int", None), ("win", "int", None)]
        run = ("const float* x, int B, int V, const int* h, int H, const float* mult, const float* base, "
               "const int* allowed, const int* last_n, const bool* brk, const int* n, float* out, int* rep, int* win",
               "const int xs[2] = {B, V}, hs[2] = {B, H};",
               "x, xs, h, hs, mult, base, allowed, last_n, brk, n, out, rep, win")
    if dialect == "cuda":
        signature = ", ".join(f"{'' if sp is None else 'const '}{t}* {name}" for name, t, sp in params)
        call = f"body({run[2]})"
    else:
        signature = ", ".join([f"const {sp} {t}* {name}" if sp else f"device {t}* {name}" for name, t, sp in params] +
                              metal_attributes(entry))
        call = f"body({run[2]}, uint3{{threadIdx.x, 0, 0}}, uint3{{blockIdx.x, 0, 0}})"
    head = (f"#define SC_T {gpu.DIALECT_THREADS[dialect]}\n{defines}#include \"{dialect}_emulation.h\"\n{header}\n"
            f"static void body({signature}) {{\n{entry}}}\n")
    if defines:
        return head                     # (a syntax check: nothing runs it)
    return head + f"extern \"C\" void run({run[0]}) {{\n  {run[1]}\n  sc_launch(B, [&] {{ {call}; }});\n}}\n"


def emulated_top_logprobs(dialect: str):
    """top_logprobs' kernel in `dialect`, built for the CPU: f(x [B, V], m, lz [B, 1], k) -> (ids, values [B, k])."""
    fn = built(unit(dialect, "top_logprobs"), "top_logprobs")

    def run(x: np.ndarray, m: np.ndarray, lz: np.ndarray, k: int):
        x = np.ascontiguousarray(x, dtype=np.float32)
        B, V = x.shape
        m, lz = (np.ascontiguousarray(a, dtype=np.float32).reshape(B) for a in (m, lz))
        K = np.array([k, min(V, k + TIE_MARGIN)], np.int32)
        ids, vals = np.full((B, k), -7, np.int32), np.full((B, k), np.nan, np.float32)
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)      # noqa: E731
        fn(ptr(x), ctypes.c_int(B), ctypes.c_int(V), ptr(m), ptr(lz), ptr(K), ptr(ids), ptr(vals))
        return ids, vals
    return run


def normalizer(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The row's maximum and log-sum-exp as MLX computes them (what the chain kernel gives beside the token)."""
    xm = mx.array(x)
    m = mx.max(xm, axis=-1, keepdims=True)
    return np.array(m), np.array(mx.log(mx.sum(mx.exp(xm - m), axis=-1, keepdims=True)))


def exact(x: np.ndarray, m: np.ndarray, lz: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest log-probabilities (x - m) - lz, descending, the lower id first among equal ones: a stable
    sort of the whole row."""
    lp = (x.astype(np.float32) - m.astype(np.float32)) - lz.astype(np.float32)
    order = np.argsort(-lp, axis=-1, kind="stable")[:, :k]
    return order.astype(np.int32), np.take_along_axis(lp, order, axis=-1)


def rows(family: str, B: int, V: int, rng) -> np.ndarray:
    if family == "normal":
        return rng.standard_normal((B, V)).astype(np.float32) * 3
    if family == "tail":            # chat-shaped: a few tokens carry most of the mass, a long tail a few percent
        x = rng.standard_normal((B, V)).astype(np.float32) - 8
        x[:, rng.choice(V, 5, replace=False)] += rng.uniform(8, 14, (B, 5)).astype(np.float32)
        return x
    if family == "ties":            # a few distinct values: long runs of equal logits at every boundary
        return rng.choice(np.array([2.0, 1.0, 0.5, -0.0, 0.0, -3.0], np.float32), (B, V))
    if family == "flat":
        return np.zeros((B, V), np.float32)
    if family == "neg_inf":         # most of the row masked; some rows with fewer live tokens than k
        x = np.full((B, V), -np.inf, np.float32)
        for b in range(B):
            live = rng.choice(V, rng.integers(1, min(V, 12)), replace=False)
            x[b, live] = rng.standard_normal(len(live)).astype(np.float32)
        return x
    if family == "rounding":
        # distinct logits that round to one log-probability (x - 30 loses their last bits), larger ids larger: the
        # selection takes them by logit, the ranking puts the lower ids first (a group within TIE_MARGIN)
        x = np.full((B, V), -10.0, np.float32)
        x[:, 0] = 30.0
        group = np.sort(rng.choice(np.arange(1, V), min(V - 1, 4), replace=False))
        x[:, group] = np.float32(1e-3) + np.arange(len(group), dtype=np.float32) * np.spacing(np.float32(1e-3))
        return x
    raise ValueError(family)


FAMILIES = ("normal", "tail", "ties", "flat", "neg_inf", "rounding")


@pytest.mark.parametrize("dialect", ["cuda", "metal"])
@pytest.mark.parametrize("family", FAMILIES)
def test_selection_kernel_equals_numpy_and_the_native_kernel(dialect, family):
    run = emulated_top_logprobs(dialect)
    rng = np.random.default_rng(FAMILIES.index(family))
    for B, V, k in ((3, 5000, 5), (2, 700, 20), (2, 100, 1), (1, 9, 9), (2, 3000, 64)):
        x = rows(family, B, V, rng)
        m, lz = normalizer(x)
        ids, vals = run(x, m, lz, k)
        want_ids, want_vals = exact(x, m, lz, k)
        np.testing.assert_array_equal(ids, want_ids, err_msg=f"{family} B={B} V={V} k={k}")
        np.testing.assert_array_equal(vals, want_vals, err_msg=f"{family} B={B} V={V} k={k}")
        from samplec.backend_mlx import native
        got = native.top_logprob_ids(mx.array(x), mx.array(m), mx.array(lz), k, TIE_MARGIN)
        if got is not None:         # (the CPU's primitive: the same candidates, the same ranks)
            np.testing.assert_array_equal(ids, np.array(got[0]))


@pytest.mark.parametrize("dialect", ["cuda", "metal"])
def test_selection_kernel_ranks_a_row_itself_for_candidates(dialect):
    """candidates(k) on a GPU target: the same kernel with a maximum and log-sum-exp of 0 ranks x itself -- the k
    largest values, descending, the lower id first among equal ones (-inf past the kept tokens), as a stable sort
    of the row gives them, on every family of rows."""
    run = emulated_top_logprobs(dialect)
    rng = np.random.default_rng(11)
    for family in FAMILIES:
        for B, V, k in ((3, 5000, 5), (2, 100, 1), (1, 9, 9), (2, 3000, 64)):
            x = rows(family, B, V, rng)
            zero = np.zeros((B, 1), np.float32)
            ids, vals = run(x, zero, zero, k)
            order = np.argsort(-x, axis=-1, kind="stable")[:, :k]
            np.testing.assert_array_equal(ids, order, err_msg=f"{family} B={B} V={V} k={k}")
            np.testing.assert_array_equal(vals, np.take_along_axis(x, order, axis=-1))


@pytest.mark.uncompiled         # (the emulated kernels read their inputs on the host: conftest.py)
@pytest.mark.parametrize("terminal", ["sample(seed)", "", "greedy()"])
def test_candidates_on_the_cuda_target_run_the_selection_kernel(terminal, monkeypatch):
    """candidates(k) on the cuda target (a CUDA device faked, the kernels the emulated ones): its ids and values are
    -O0's, from the selection kernel (no sort of the row), after a chain kernel's row or the portable lowering's (no
    terminal: no chain)."""
    import samplec
    from test_gpu_chain import assert_outputs_equal, emulated_sample_chain, fake_cuda
    outs = "token, candidates(6)" if terminal else "candidates(6)"
    src = (f"sampler s(seed: seed, t: float) -> {outs} {{ top_k(50) top_p(0.9) temperature(t) {terminal} }}")
    rng = np.random.default_rng(3)
    x = rows("ties", 3, 400, rng) + rows("normal", 3, 400, rng) * (rng.random((3, 400)) < 0.3)
    kw = dict(seed=[1, 2, 3], t=[0.7, 0.0, 1.3])
    want = samplec.compile(src, opt_level=0)(x, **kw).to_dict()
    tops = fake_cuda(monkeypatch)
    monkeypatch.setattr(gpu, "sample_chain", emulated_sample_chain())
    prog = samplec.compile(src, target="cuda")
    assert "topk_ids" in prog.ir() and "argsort" not in prog.ir()
    got = prog(x, **kw).to_dict()
    assert tops == [6]
    assert_outputs_equal(got, want, src)


def test_a_gpu_target_runs_top_logprobs_as_the_selection_kernel():
    """On the cuda and metal targets top_logprobs' ids stay `topk_ids` beside the chain kernel (the interpreter runs
    it as gpu.top_logprobs, one launch: tests/test_targets.py counts them), where the portable target sorts the
    row's log-probabilities; a k past the kernel's candidates (k + TIE_MARGIN > TOP_LOGPROBS_MAX) sorts there too."""
    import samplec
    from samplec.backend_mlx.launches import chain_kernel_stood_in
    src = ("sampler s(seed: seed) -> token, logprob, top_logprobs(K) "
           "{ top_k(40) top_p(0.9) temperature(0.8) sample(seed) }")
    for target in ("cuda", "metal"):
        with chain_kernel_stood_in(target):
            ir = samplec.compile(src.replace("K", "5"), target=target).ir()
            assert "topk_ids %raw_logp {k = 5}" in ir and "argsort" not in ir, ir
            far = gpu.TOP_LOGPROBS_MAX - TIE_MARGIN + 1
            ir = samplec.compile(src.replace("K", str(far)), target=target).ir()
            assert "argsort %raw_logp" in ir and "topk_ids" not in ir, ir
    assert "argsort" in samplec.compile(src.replace("K", "5"), target="portable").ir()


def emulated_dry(dialect: str):
    """DRY's kernel in `dialect`, built for the CPU: f(x [B, V], h [B, H], mult, base, allowed, last_n (each one
    value, or one a row as [B] or [B, 1]), breakers (bool [V] or [B, V], or None)) -> the penalized rows [B, V] --
    its inputs packed by gpu.dry_inputs, as on a device."""
    fn = built(unit(dialect, "dry"), "dry")

    def run(x, h, mult, base, allowed, last_n, breakers=None) -> np.ndarray:
        (B, V), H = np.shape(x), np.shape(h)[1]
        values = [mx.array(np.asarray(a, dt)) for a, dt in ((mult, np.float32), (base, np.float32),
                                                            (allowed, np.int32), (last_n, np.int32))]
        inputs = gpu.dry_inputs(mx.array(np.asarray(x, np.float32)), mx.array(np.asarray(h, np.int32)), *values,
                                None if breakers is None else mx.array(np.asarray(breakers, bool)))
        ins = [np.ascontiguousarray(np.array(a)) for a in inputs]
        out = np.full((B, V), np.nan, np.float32)
        rep = np.full((B, V), -7, np.int32)
        win = np.full((B, H), -7, np.int32)
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)      # noqa: E731
        fn(ptr(ins[0]), ctypes.c_int(B), ctypes.c_int(V), ptr(ins[1]), ctypes.c_int(H), *(ptr(a) for a in ins[2:]),
           ptr(out), ptr(rep), ptr(win))
        return out
    return run


def dry_reference(x, h, mult, base, allowed, last_n, breakers=None) -> np.ndarray:
    """DRY read off its rule (spec §6, llama.cpp's DRY), row by row in plain Python: the history's tokens without
    padding, the last last_n of them (-1: all) the window; the repeat a window token t would extend is the longest
    run of tokens before one of its places that equals the window's end (counted back no further than the last
    breaker); at n >= allowed t loses mult * base^(n - allowed), in float32 as the definition rounds it. (exp: numpy's,
    so the penalties agree with the kernels' to a float32 rounding, not bit for bit.)"""
    B, V = x.shape
    out = x.astype(np.float32).copy()
    f32 = np.float32
    for b in range(B):
        m, bs, al, ln = (np.broadcast_to(np.reshape(v, -1), B)[b] for v in (mult, base, allowed, last_n))
        m, bs, al, ln = f32(m), f32(bs), int(al), int(ln)
        if m == 0:
            continue
        toks = [int(t) for t in h[b] if t >= 0]
        c = toks if ln == -1 else toks[len(toks) - min(len(toks), ln):]
        L = len(c)
        brk = None if breakers is None else np.asarray(breakers) if np.ndim(breakers) == 1 else \
            np.asarray(breakers)[b if np.shape(breakers)[0] == B else 0]
        last = max((j for j in range(L) if brk is not None and brk[c[j]]), default=-1)
        limit = L - 1 - last if last >= 0 else L
        if not (L > al and limit >= al):
            continue
        rep: dict[int, int] = {}
        for p in range(1, L):
            s = 0
            while s < p and c[p - 1 - s] == c[L - 1 - s]:
                s += 1
            rep[c[p]] = max(rep.get(c[p], -1), s)
        log_base = np.log(bs)
        max_exp = int(f32(88.7228391) / log_base) if bs > f32(1.000001) else 0
        for t in set(c):
            n = min(rep.get(t, -1), limit)
            if n < al or (brk is not None and brk[t]):
                continue
            e = n - al
            if max_exp > 0 and e > max_exp:
                e = max_exp
            arg = f32(e) * log_base
            half = np.exp(arg * f32(0.5))
            pen = (m * half) * half if arg > 80 else m * np.exp(arg)
            out[b, t] = x[b, t] - pen
    return out


def dry_definition(x, h, mult, base, allowed, last_n, breakers=None) -> np.ndarray:
    """The `dry` op's dense definition (samplec/frontend/expand.py) run by MLX: what -O0 computes."""
    from samplec.backend_mlx.interpreter import _run_expansion
    from samplec.ir.graph import Node, make
    from samplec.ir.types import Type
    B = x.shape[0]
    col = lambda v, dt: mx.array(np.broadcast_to(np.reshape(v, -1), B).reshape(B, 1), dtype=dt)     # noqa: E731
    ins = [mx.array(x, dtype=mx.float32), mx.array(h, dtype=mx.int32), col(mult, mx.float32), col(base, mx.float32),
           col(allowed, mx.int32), col(last_n, mx.int32),
           mx.array(False) if breakers is None else mx.array(np.asarray(breakers, bool))]
    node = make("dry", *(Node("input", (), (), Type({mx.float32: "f32", mx.int32: "i32", mx.bool_: "bool"}[a.dtype],
                                                     tuple(a.shape)), f"in{i}") for i, a in enumerate(ins)))
    return np.array(_run_expansion(node, ins))


def histories(rng, B: int, H: int, V: int) -> list[np.ndarray]:
    random = rng.integers(0, V, (B, H))
    periodic = np.tile(rng.integers(0, V, (B, 7)), (1, H // 7 + 1))[:, :H]       # long repeats at every phase
    same = np.full((B, H), int(rng.integers(0, V)))                             # one token: every suffix repeats
    padded = periodic.copy()
    padded[:, : H // 3] = -1                                                    # padding first, as a server's
    holes = periodic.copy()
    holes[:, rng.choice(H, max(1, H // 10), replace=False)] = -1                # padding anywhere
    return [random, periodic, same, padded, holes]


DRY_VALUES = [  # (mult, base, allowed, last_n) -- one value for every row, or one a row
    (0.8, 1.75, 2, -1), (0.8, 1.75, 2, 40), (1.5, 1.0, 0, -1), (2.0, 3.0, 1, 9),
    ([0.8, 0.0, 1.2], 1.75, [2, 3, 1], [-1, 16, 0]),      # (a row off, a row with no window)
    (1e30, 60.0, 1, -1),                                  # (the exponent capped, the product in halves: overflow)
]


@pytest.mark.parametrize("dialect", ["cuda", "metal"])
def test_dry_kernel_equals_its_rule_and_its_definition(dialect):
    """The kernel's rows against the rule read off in Python and against the op's definition in MLX ops: every
    logit it leaves alone bit for bit, every penalized one within a float32 rounding of the penalty; on random,
    periodic, one-token and padded histories, with and without breakers (a list's flags [V], a parameter's [B, V]),
    per-row values, a row switched off and penalties that overflow."""
    run = emulated_dry(dialect)
    rng = np.random.default_rng(9)
    changed = 0
    for H, V in ((64, 50), (700, 300), (1, 10), (2, 9), (1500, 40)):
        B = 3
        x = (rng.standard_normal((B, V)) * 3).astype(np.float32)
        for h in histories(rng, B, H, V):
            for i, (mult, base, allowed, last_n) in enumerate(DRY_VALUES):
                for breakers in (None, rng.random(V) < 0.05, rng.random((B, V)) < 0.1)[:3 if i < 2 else 1]:
                    args = (x, h, np.array(mult, np.float32), np.array(base, np.float32), np.array(allowed),
                            np.array(last_n), breakers)
                    with np.errstate(over="ignore"):
                        got, want, dense = run(*args), dry_reference(*args), dry_definition(*args)
                    changed += int((got != x).sum())
                    where = f"H={H} V={V} values={(mult, base, allowed, last_n)} breakers={np.shape(breakers)}"
                    np.testing.assert_array_equal(got == x, want == x, err_msg=where)      # (which tokens changed)
                    np.testing.assert_allclose(got, want, rtol=2e-6, err_msg=where)
                    np.testing.assert_array_equal(got == x, dense == x, err_msg=where)
                    np.testing.assert_allclose(got, dense, rtol=2e-6, err_msg=where)
    assert changed > 1000, changed          # (the cases penalize: the comparisons are not of unchanged rows)


def test_the_dry_rule_penalizes_what_llama_cpp_does():
    """The reference itself on a hand-worked history (so the comparisons above cannot pass on a rule that does
    nothing): history a b c a b, allowed 2 -- token c would extend the repeat `a b` (n = 2: penalty mult * base^0),
    a breaker at b cuts it (n = 0 after the breaker: nothing), a window of the last 3 entries (c a b) holds no
    earlier `a b` (nothing)."""
    a, b, c = 1, 2, 3
    x = np.zeros((1, 5), np.float32)
    h = np.array([[a, b, c, a, b]])
    out = dry_reference(x, h, 0.5, 2.0, 2, -1)
    assert out[0, c] == np.float32(-0.5) and (np.delete(out[0], c) == 0).all()
    assert (dry_reference(x, h, 0.5, 2.0, 2, -1, np.eye(5, dtype=bool)[b]) == 0).all()
    assert (dry_reference(x, h, 0.5, 2.0, 2, 3) == 0).all()
    longer = dry_reference(x, np.array([[a, b, c, 4, a, b, c]]), 0.5, 2.0, 2, -1)      # (n = 3: 0.5 * 2^1)
    assert longer[0, 4] == np.float32(-1.0)


@pytest.mark.skipif(CLANG is None, reason="no clang++ to check the Metal dialect's address spaces")
@pytest.mark.parametrize("kernel,small", [("top_logprobs", False), ("top_logprobs", True), ("dry", False),
                                          ("dry", True)])
def test_metal_dialect_address_spaces(kernel, small, tmp_path):
    """The Metal dialect type-checks with device, constant and threadgroup memory as distinct address spaces
    (tests/metal_emulation.h's SC_CHECK_ADDRESS_SPACES), with a few rows' maximum and log-sum-exp in device memory or
    in the constant address space, and DRY's per-row values in either. (A history, a row or breaker flags of fewer than
    eight entries, which MLX would pass as constant, the Metal build of DRY declines: gpu.dry.)"""
    (tmp_path / "metal.cpp").write_text(unit("metal", kernel, "#define SC_CHECK_ADDRESS_SPACES\n", small))
    r = subprocess.run([CLANG, "-std=c++20", "-fsyntax-only", f"-I{HERE}", str(tmp_path / "metal.cpp")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]


DRY_CHAIN = ("sampler s(h: tokens, seed: seed) -> token, logprob, top_logprobs(3) "
             "{ dry(h, 0.8, 1.75, 2) top_k(40) temperature(0.8) sample(seed) }")


def dry_case():
    rng = np.random.default_rng(4)
    V = 300
    x = rng.standard_normal((3, V)).astype(np.float32) * 2
    x[:, :40] += 3                                                                   # (the repeated tokens in play)
    h = np.tile(rng.integers(0, 40, (3, 9)), (1, 8))[:, :64].astype(np.int32)     # repeats at every phase
    return x, dict(h=h, seed=[1, 2, 3])


@pytest.mark.uncompiled         # (the emulated kernels read their inputs on the host: conftest.py)
def test_a_dry_chain_on_the_cuda_target_runs_the_dry_kernel(monkeypatch):
    """A chain with DRY on the cuda target (a CUDA device faked; the chain kernel and the DRY kernel the emulated
    ones): its outputs are -O0's, and the penalized row comes from the DRY kernel."""
    import samplec
    from test_gpu_chain import assert_outputs_equal, emulated_sample_chain, fake_cuda
    x, kw = dry_case()
    want = samplec.compile(DRY_CHAIN, opt_level=0)(x, **kw).to_dict()
    fake_cuda(monkeypatch)
    dry, calls = gpu.dry, []
    monkeypatch.setattr(gpu, "dry", lambda xx, *a: calls.append(xx.shape) or dry(xx, *a))
    monkeypatch.setattr(gpu, "sample_chain", emulated_sample_chain())
    prog = samplec.compile(DRY_CHAIN, target="cuda")
    assert "= dry %logits" in prog.ir() and "dry_repeats" not in prog.ir()
    got = prog(x, **kw).to_dict()
    assert calls == [x.shape]
    assert_outputs_equal(got, want, DRY_CHAIN)


def test_a_dry_chain_on_the_cuda_target_launches(monkeypatch):
    """Its launches on the cuda target (the kernels stood in, one launch each): the DRY kernel, the chain kernel,
    top_logprobs' kernel, its maximum and log-sum-exp of the logits (which the chain kernel, reading DRY's row, does
    not give; the logits checks share the maximum) and the checks: 9 (the portable target's: 50)."""
    import samplec
    from samplec.backend_mlx import kernels
    from samplec.backend_mlx.launches import call_primitives, chain_kernel_stood_in, launches
    monkeypatch.setenv("SAMPLEC_NATIVE", "0")
    monkeypatch.setattr(kernels, "GPU_SUMS", True)
    x, kw = dry_case()
    with chain_kernel_stood_in("cuda") as stood_in:
        prog = samplec.compile(DRY_CHAIN, target="cuda")
        counts = call_primitives(prog, mx.array(x), **kw)
    assert sorted(stood_in) == ["chain", "dry", "top_logprobs"] and launches(counts) + len(stood_in) <= 9, \
        (stood_in, counts)
