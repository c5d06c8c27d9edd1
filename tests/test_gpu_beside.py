"""The kernels beside the chain kernel on the GPU targets, on the CPU, in both dialects: top_logprobs' selection
(samplec/backend_mlx/gpu_top_logprobs.cu: the k largest log-probabilities of a row) and DRY's repeat lengths
(gpu_dry.cu: the `dry_repeats` op), each one block a row, their sources over the CUDA layer (simt_cuda.h) or the Metal
one (simt_metal.h) compiled with g++ over the thread-per-GPU-thread emulation (tests/simt_emulation.h), at each
dialect's block size. top_logprobs against numpy's exact answer (a stable sort of the log-probabilities MLX computes)
and the CPU's native top_logprob_ids, on rows of ties, flat rows, -inf-heavy rows, signed zeros, chat-shaped tails,
logits that round to one log-probability and rows shorter than a block; dry_repeats against a numpy reading of its
definition and the MLX ops', on random, periodic and one-token histories with padding. tests/test_cuda_compile.py
compiles the CUDA dialects with NVRTC; nothing here runs on a GPU (tests/test_gpu.py does, where one is), and no
Apple GPU has run the Metal ones."""
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
        params = [("h", "int", space), ("h_shape", "int", "constant"), ("n", "int", "constant"), ("out", "int", None)]
        run = ("const int* h, int B, int H, const int* n, int* out", "const int shape[2] = {B, H};",
               "h, shape, n, out")
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
    """DRY's kernel in `dialect`, built for the CPU: f(h [B, H] int32, V) -> the repeat lengths [B, V] int32."""
    fn = built(unit(dialect, "dry"), "dry")

    def run(h: np.ndarray, V: int) -> np.ndarray:
        h = np.ascontiguousarray(h, dtype=np.int32)
        B, H = h.shape
        out = np.full((B, V), -7, np.int32)
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)      # noqa: E731
        fn(ptr(h), ctypes.c_int(B), ctypes.c_int(H), ptr(np.array([V], np.int32)), ptr(out))
        return out
    return run


def dry_reference(h: np.ndarray, V: int) -> np.ndarray:
    """The `dry_repeats` op read off its definition: at the token h[p] of each position p >= 1 (h[p], h[p - 1] not
    padding), the largest S[p] -- how many of the tokens before p, walking back, equal the history's last ones
    (not padding) -- and -1 at the other tokens."""
    B, H = h.shape
    out = np.full((B, V), -1, np.int64)
    for b in range(B):
        for p in range(1, H):
            if h[b, p] < 0 or h[b, p - 1] < 0:
                continue
            s = 0
            while s < p and h[b, H - 1 - s] >= 0 and h[b, p - 1 - s] == h[b, H - 1 - s]:
                s += 1
            t = min(int(h[b, p]), V - 1)
            out[b, t] = max(out[b, t], s)
    return out.astype(np.int32)


def histories(rng, B: int, H: int, V: int) -> list[np.ndarray]:
    random = rng.integers(0, V, (B, H))
    periodic = np.tile(rng.integers(0, V, (B, 7)), (1, H // 7 + 1))[:, :H]       # long repeats at every phase
    same = np.full((B, H), int(rng.integers(0, V)))                             # one token: every suffix repeats
    padded = random.copy()
    padded[:, : H // 3] = -1                                                    # padding first, as a window's
    holes = periodic.copy()
    holes[:, rng.choice(H, max(1, H // 10), replace=False)] = -1
    return [random, periodic, same, padded, holes]


@pytest.mark.parametrize("dialect", ["cuda", "metal"])
def test_dry_kernel_equals_its_definition_and_the_mlx_ops(dialect, monkeypatch):
    from samplec.backend_mlx import kernels
    monkeypatch.setenv("SAMPLEC_NATIVE", "0")           # (kernels._dry_repeats: the MLX ops, O(H^2))
    run = emulated_dry(dialect)
    rng = np.random.default_rng(9)
    for B, H, V in ((2, 64, 50), (3, 700, 300), (1, 1, 10), (2, 2, 5), (1, 1500, 9)):
        for h in histories(rng, B, H, V):
            got = run(h, V)
            np.testing.assert_array_equal(got, dry_reference(h, V), err_msg=f"B={B} H={H} V={V}")
            ops = np.array(kernels._dry_repeats([mx.array(h.astype(np.int32)), mx.zeros((B, V))], {}))
            np.testing.assert_array_equal(got, ops, err_msg=f"B={B} H={H} V={V}")


@pytest.mark.skipif(CLANG is None, reason="no clang++ to check the Metal dialect's address spaces")
@pytest.mark.parametrize("kernel,small", [("top_logprobs", False), ("top_logprobs", True), ("dry", False)])
def test_metal_dialect_address_spaces(kernel, small, tmp_path):
    """The Metal dialect type-checks with device, constant and threadgroup memory as distinct address spaces
    (tests/metal_emulation.h's SC_CHECK_ADDRESS_SPACES), with a few rows' maximum and log-sum-exp in device memory or
    in the constant address space. (A history of fewer than eight entries, which MLX would pass as constant, the
    Metal build of dry_repeats declines: gpu.dry_repeats.)"""
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
    ones): its outputs are -O0's, and the repeat lengths come from the DRY kernel."""
    import samplec
    from test_gpu_chain import assert_outputs_equal, emulated_sample_chain, fake_cuda
    x, kw = dry_case()
    want = samplec.compile(DRY_CHAIN, opt_level=0)(x, **kw).to_dict()
    fake_cuda(monkeypatch)
    dry, calls = gpu.dry_repeats, []
    monkeypatch.setattr(gpu, "dry_repeats", lambda hh, n: calls.append(n) or dry(hh, n))
    monkeypatch.setattr(gpu, "sample_chain", emulated_sample_chain())
    got = samplec.compile(DRY_CHAIN, target="cuda")(x, **kw).to_dict()
    assert calls == [x.shape[1]]
    assert_outputs_equal(got, want, DRY_CHAIN)


def test_a_dry_chain_on_the_cuda_target_launches(monkeypatch):
    """Its launches on the cuda target (the kernels stood in, one launch each): the DRY kernel, the chain kernel and
    the MLX ops of DRY's penalty and of top_logprobs (over the logits the chain kernel does not read) beside them --
    24, where DRY's repeat lengths in MLX ops made it 32."""
    import samplec
    from samplec.backend_mlx import kernels
    from samplec.backend_mlx.launches import call_primitives, chain_kernel_stood_in, launches
    monkeypatch.setenv("SAMPLEC_NATIVE", "0")
    monkeypatch.setattr(kernels, "GPU_SUMS", True)
    x, kw = dry_case()
    with chain_kernel_stood_in("cuda") as stood_in:
        prog = samplec.compile(DRY_CHAIN, target="cuda")
        counts = call_primitives(prog, mx.array(x), **kw)
    assert sorted(stood_in) == ["chain", "dry_repeats"] and launches(counts) + len(stood_in) <= 24, \
        (stood_in, counts)
