"""top_logprobs' selection kernel (samplec/backend_mlx/gpu_top_logprobs.cu: the k largest log-probabilities of a row,
one block a row, beside the chain kernel on the GPU targets) on the CPU, in both dialects: its source over the CUDA
layer (simt_cuda.h) or the Metal one (simt_metal.h), compiled with g++ over the thread-per-GPU-thread emulation
(tests/simt_emulation.h), at each dialect's block size, against numpy's exact answer (a stable sort of the
log-probabilities MLX computes) and the CPU's native top_logprob_ids, on rows of ties, flat rows, -inf-heavy rows,
signed zeros, chat-shaped tails, logits that round to one log-probability and rows shorter than a block.
tests/test_cuda_compile.py compiles the CUDA dialect with NVRTC; nothing here runs on a GPU (tests/test_gpu.py does,
where one is), and no Apple GPU has run the Metal one."""
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


def source(dialect: str, defines: str = "", small: bool = False) -> str:
    """The kernel as a C++ translation unit over the emulation of `dialect`: the header and body MLX would compile
    (under the signature MLX writes: the inputs, x's shape -- the body reads it --, the outputs, and on Metal the
    attributes the body names), and run(...) launching one block a row."""
    entry = gpu.top_logprobs_entry(dialect)
    if dialect == "cuda":
        signature = ("const float* x, const int* x_shape, const float* m, const float* lz, const int* K, int* ids, "
                     "float* vals")
        call = "tl_body(x, shape, m, lz, K, ids, vals)"
    else:
        space = "constant" if small else "device"       # (MLX passes an input of fewer than 8 elements as constant)
        signature = ", ".join(["const device float* x", "const constant int* x_shape", f"const {space} float* m",
                               f"const {space} float* lz", "const constant int* K", "device int* ids",
                               "device float* vals", *metal_attributes(entry)])
        call = "tl_body(x, shape, m, lz, K, ids, vals, uint3{threadIdx.x, 0, 0}, uint3{blockIdx.x, 0, 0})"
    threads = gpu.DIALECT_THREADS[dialect]
    head = (f"#define SC_T {threads}\n{defines}#include \"{dialect}_emulation.h\"\n{gpu.top_logprobs_header(dialect)}\n"
            f"static void tl_body({signature}) {{\n{entry}}}\n")
    if defines:
        return head                     # (a syntax check: nothing runs it)
    return (head +
            "extern \"C\" void run(const float* x, int B, int V, const float* m, const float* lz, const int* K,\n"
            "                      int* ids, float* vals) {\n"
            "  const int shape[2] = {B, V};\n"
            f"  sc_launch(B, [&] {{ {call}; }});\n}}\n")


def emulated(dialect: str):
    """The kernel in `dialect`, built for the CPU: f(x [B, V], m, lz [B, 1], k) -> (ids [B, k], values [B, k])."""
    fn = built(source(dialect), "top_logprobs")

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
    run = emulated(dialect)
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


@pytest.mark.skipif(CLANG is None, reason="no clang++ to check the Metal dialect's address spaces")
@pytest.mark.parametrize("small", [False, True])
def test_metal_dialect_address_spaces(small, tmp_path):
    """The Metal dialect type-checks with device, constant and threadgroup memory as distinct address spaces
    (tests/metal_emulation.h's SC_CHECK_ADDRESS_SPACES), with the row's maximum and log-sum-exp in device memory or
    (small: fewer than eight rows) in the constant address space."""
    (tmp_path / "metal.cpp").write_text(source("metal", "#define SC_CHECK_ADDRESS_SPACES\n", small))
    r = subprocess.run([CLANG, "-std=c++20", "-fsyntax-only", f"-I{HERE}", str(tmp_path / "metal.cpp")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
