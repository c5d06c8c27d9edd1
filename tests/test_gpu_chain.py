"""The chain kernel (samplec/backend_mlx/gpu_chain.cu) on the CPU, in both of its dialects: its own source, with the
CUDA layer (simt_cuda.h) or the Metal one (simt_metal.h), compiled with g++ over a thread-per-GPU-thread emulation
of each language's primitives (tests/simt_emulation.h, cuda_emulation.h, metal_emulation.h: the Metal kernel under
the signature MLX's metal_kernel writes), against the numpy reference (tests/reference.py) and the dense
definitions (-O0), token for token, on random chains of its stages in random orders with one value per row, on the
differential test's logit families. Every test runs in both dialects (the `dialect` fixture).

What this cannot show -- the kernel's speed, NVRTC's or Metal's compile, the GPUs' expf/logf -- tests/test_gpu.py
shows on a CUDA GPU (docs/performance.md, GPU); tests/test_cuda_compile.py compiles the CUDA dialect and
tests/test_gpu_dialects.py checks the Metal one's address spaces. No Apple GPU has run the Metal dialect. Blocks
here have 64 threads (two warps: the cross-warp reductions run) or the GPU's block size (a few cases:
gpu.CHAIN_THREADS, gpu.METAL_THREADS)."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import reference as R
import samplec
from samplec.backend_mlx import gpu
from samplec.backend_mlx.lowering import TIE_MARGIN
from test_differential import EXTREME_CUTS, EXTREME_T, XTC_THRESHOLD, build, family_row

HERE = Path(__file__).parent
CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
pytestmark = [pytest.mark.skipif(CXX is None, reason="no C++ compiler to build the emulation"),
              pytest.mark.uncompiled]          # (many distinct -O0 programs: conftest.py)

STAGES = tuple(s for s in gpu.CHAIN_STAGES if s not in ("dynamic_temperature", "top_k_rank"))   # (the
# differential builder's stages; those two have tests of their own below)
FAMILIES = ("peaked", "flat", "ties", "neg_inf", "normal", "tail", "one_finite")
_BUILT: dict = {}


INPUTS = gpu.INPUT_NAMES
EDIT_TYPES = {"EB": "float", "EM": "bool", "EW": "int", "PH": "int", "PV": "float"}


def metal_attributes(body: str) -> list[str]:
    """The kernel attributes MLX's metal_kernel declares for a body: those whose names the body contains, in its
    order (mlx/backend/common/metal_kernel.cpp)."""
    names = [("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
             ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
             ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
             ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
             ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
             ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
             ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
             ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"),
             ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"), ("threads_per_threadgroup", "uint3")]
    return [f"{dtype} {name}" for name, dtype in names if name in body]


def metal_signature(sizes: dict[str, int]) -> str:
    """The parameters MLX's metal_kernel writes for the chain kernel (write_signature): an input of fewer than eight
    elements in the constant address space, else device memory, each of its array's type; x's shape; the outputs;
    the attributes."""
    dtypes = {"x": "float", "S": "int", **{f"F{i}": "float" for i in range(gpu.CHAIN_FLOAT_SLOTS)},
              **{f"K{i}": "uint64_t" for i in range(gpu.CHAIN_KEY_SLOTS)},
              **{f"Q{i}": "int" for i in range(gpu.CHAIN_KEY_SLOTS)}, **EDIT_TYPES}
    params = []
    for name in INPUTS:
        params.append(f"const {'constant' if sizes[name] < 8 else 'device'} {dtypes[name]}* {name}")
        if name in ("x", "PH"):         # (the inputs whose shapes the body reads)
            params.append(f"const constant int* {name}_shape")
    params += ["device int* tok", "device float* lp", "device float* xo", "device bool* pf", "device float* rs",
               "device int* ws"]
    return ", ".join(params + metal_attributes(gpu.chain_entry("metal")))


def source(dialect: str, threads: int, defines: str = "", sizes: dict | None = None) -> str:
    """The kernel as a C++ translation unit over the emulation of `dialect`: the header and body MLX would compile,
    as sc_body, and run(...) launching it on the CPU (every float slot float: an integer operand comes as its bits)."""
    slots = ", ".join([f"const float* F{i}" for i in range(gpu.CHAIN_FLOAT_SLOTS)] +
                      [f"const uint64_t* K{i}" for i in range(gpu.CHAIN_KEY_SLOTS)] +
                      [f"const int* Q{i}" for i in range(gpu.CHAIN_KEY_SLOTS)] +
                      [f"const {EDIT_TYPES[n]}* {n}" + (", const int* PH_shape" if n == "PH" else "")
                       for n in gpu.EDIT_SLOTS])
    names = ", ".join(gpu._SLOTS + [n + (", PH_shape" if n == "PH" else "") for n in gpu.EDIT_SLOTS])
    if dialect == "cuda":
        signature = (f"const float* x, const int* x_shape, {slots}, const int* S, int* tok, float* lp, float* xo, "
                     "bool* pf, float* rs, int* ws")
        call = f"sc_body(x, shape, {names}, S, tok, lp, xo, pf, rs, ws)"
    else:
        signature = metal_signature(sizes or {name: 8 for name in INPUTS})
        call = (f"sc_body(x, shape, {names}, S, tok, lp, xo, pf, rs, ws, uint3{{threadIdx.x, 0, 0}}, "
                "uint3{blockIdx.x, 0, 0}, 32u)")
    head = (f"#define SC_T {threads}\n{defines}#include \"{dialect}_emulation.h\"\n{gpu.chain_header(dialect)}\n"
            f"static void sc_body({signature}) {{\n{gpu.chain_entry(dialect)}}}\n")
    if "SC_CHECK_ADDRESS_SPACES" in defines:
        return head                     # (a syntax check: nothing runs it)
    return (head + f"extern \"C\" void run(const float* x, int B, int V, {slots}, const int* S,\n"
            "                      int* tok, float* lp, float* xo, bool* pf, float* rs, int* ws) {\n"
            "  const int shape[2] = {B, V};\n"
            f"  sc_launch(B * (S[6] > 0 ? S[6] : 1), [&] {{ {call}; }});\n}}\n")


EMULATION_HEADERS = ("simt_emulation.h", "cuda_emulation.h", "metal_emulation.h")


def built(src: str, stem: str):
    """The `run` function of a translation unit over the emulation headers, compiled once (by its text's digest,
    cached on disk across processes: PYTEST_TMP, else /tmp)."""
    headers = b"".join((HERE / h).read_bytes() for h in EMULATION_HEADERS)
    digest = hashlib.sha256(src.encode() + headers).hexdigest()[:16]
    if digest not in _BUILT:
        out = Path(os.environ.get("PYTEST_TMP", "/tmp")) / f"samplec_{stem}_{digest}"
        out.mkdir(parents=True, exist_ok=True)
        lib = out / f"{stem}.so"
        if not lib.exists():
            (out / f"{stem}.cpp").write_text(src)
            tmp = out / f"{stem}.{os.getpid()}.so"
            subprocess.run([CXX, "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", f"-I{HERE}",
                            str(out / f"{stem}.cpp"), "-o", str(tmp)], check=True)
            os.replace(tmp, lib)
        fn = ctypes.CDLL(str(lib)).run
        fn.restype = None
        _BUILT[digest] = fn
    return _BUILT[digest]


def emulated(threads: int = 64, defines: str = "", dialect: str = "cuda"):
    """The kernel (one for every chain) in `dialect` (cuda, metal), built for the CPU: f(x [B, V], inputs) with
    inputs gpu.chain_inputs' F0..F9, K0, K1, Q0, Q1, S -> (tok [B], lp [B]), and where S asks for it the final
    logits (1) or their softmax (2), [B, V]. S's split (slices a row, candidates a slice) runs each row as that many
    blocks."""
    def run(x: np.ndarray, inputs: list):
        x = np.ascontiguousarray(x.astype(np.float32))
        ins = [np.ascontiguousarray(np.array(a)) for a in inputs]
        assert all(a.dtype == np.float32 for a in ins[:gpu.CHAIN_FLOAT_SLOTS])     # (MLX's signature: one kernel)
        fn = built(source(dialect, threads, defines), "gpu_chain")
        B, V = x.shape
        S = ins[-1]
        out_x, split = int(S[5]), (int(S[6]), int(S[7]))
        tok, lp = np.zeros(B, dtype=np.int32), np.zeros(B, dtype=np.float32)
        xo = np.full((B, V) if out_x else (B, 1), np.nan, dtype=np.float32)
        edits = S[8 + int(S[0]) + len(gpu._SLOTS):]
        # (zeros: as init_value=0 leaves it on the GPU)
        ws = np.zeros(gpu.scratch_size(B, split, V if edits[:gpu.EDIT_CODES].any() else 0,
                                       bool(edits[gpu.EDIT_CODES])), np.int32)
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)      # noqa: E731
        args, keep = [], []
        for name, a in zip(INPUTS[1:], ins):
            args.append(ptr(a))
            if name == "PH":            # (its shape after it, as MLX passes the shapes a body reads)
                keep.append(np.array(a.shape, np.int32))
                args.append(ptr(keep[-1]))
        pf = np.zeros((B, max(1, int(edits[4]))), dtype=np.bool_)
        rs = np.full((B, 4), np.nan, dtype=np.float32)
        fn(ptr(x), ctypes.c_int(B), ctypes.c_int(V), *args, ptr(tok), ptr(lp), ptr(xo), ptr(pf), ptr(rs), ptr(ws))
        # (as gpu.sample_chain gives them: the penalties' checks, then with edits the edited row's maximum, then
        # where asked the logits' maximum and log-sum-exp)
        return (tok, lp) + ((xo,) if out_x else ()) + ((pf,) if edits[4] else ()) + \
            ((rs[:, 0:1],) if edits[:gpu.EDIT_CODES].any() else ()) + \
            ((rs[:, 1:2], rs[:, 2:3], rs[:, 3:4]) if edits[gpu.EDIT_CODES] else ())
    return run


DIALECTS = ("cuda", "metal")
_DIALECT = ["cuda"]


@pytest.fixture(params=DIALECTS, autouse=True)
def dialect(request):
    """Every test here runs the kernel source in both dialects: the CUDA one and the Metal one."""
    _DIALECT[0] = request.param
    yield request.param
    _DIALECT[0] = "cuda"


def block() -> int:
    """The threads of a block on the GPU in the current dialect (gpu.CHAIN_THREADS, gpu.METAL_THREADS)."""
    return gpu.DIALECT_THREADS[_DIALECT[0]]


def gpu_split(B: int, V: int, threads: int | None = None) -> tuple[int, int]:
    """gpu.split_of within the current dialect's shared candidates."""
    return gpu.split_of(B, V, threads or block(), gpu.DIALECT_CAP[_DIALECT[0]])


def kernel(x, operands, stages, terminal, want_logprob=True, out_x=0, threads=64, split=(0, 0), defines="",
           edits=(), raw=False):
    """The emulated kernel in the current dialect on a chain's operands as gpu.sample_chain passes them (split:
    slices a row and candidates a slice, as gpu.split_of gives them; (0, 0): one block a row; edits: logit_bias's
    and allow's (kind, array) before the stages)."""
    assert split[0] * split[1] <= gpu.DIALECT_CAP[_DIALECT[0]], split      # (the last block's shared candidates)
    inputs = gpu.chain_inputs(operands, stages, terminal, want_logprob, out_x, x.shape[0], split, edits, x.shape[1],
                              raw)
    assert inputs is not None
    return emulated(threads, defines, _DIALECT[0])(x, inputs)


def chain_case(seed: int, V: int, B: int, n_stages: int, terminal: str):
    """A random chain of the kernel's stages with one run-time value per row, as the differential test builds it
    (its stage values, at their edges too): (stages, source, kwargs, per-row reference stages, the chain's
    operands as the interpreter hands them to gpu.sample_chain, x)."""
    rng = np.random.default_rng(seed)
    stages = [str(s) for s in rng.choice(STAGES, n_stages)]
    while not gpu.chain_supports(stages, terminal):      # (at most one xtc before a sample: the kernel's key slots)
        stages = [str(s) for s in rng.choice(STAGES, n_stages)]
    x = np.stack([family_row(str(rng.choice(FAMILIES)), V, rng) for _ in range(B)])
    src, kw, per_row = build(V, B, stages, ["rows"] * n_stages, terminal, False, rng)
    return stages, src, kw, per_row, operands_of(stages, kw, terminal), x


def operands_of(stages: list[str], kw: dict, terminal: str) -> list:
    """A chain's operands from the differential builder's arguments, as the interpreter hands them to the kernel."""
    operands = []
    for i, name in enumerate(stages):
        if name == "xtc":
            operands += [mx.array(np.float32(XTC_THRESHOLD)), mx.array(kw[f"a{i}"], dtype=mx.float32),
                         mx.array(np.array(kw["xs"], dtype=np.uint64)), mx.array(kw["xp"], dtype=mx.int32)]
        else:
            operands.append(mx.array(kw[f"a{i}"], dtype=mx.int32 if name == "top_k" else mx.float32))
    if terminal == "sample":
        operands += [mx.array(np.array(kw["seed"], dtype=np.uint64)), mx.array(kw["pos"], dtype=mx.int32)]
    return operands


CASES = [(seed, V, B, n, term) for seed, (V, B, n, term) in enumerate(
    [(1, 2, 2, "sample"), (2, 3, 3, "greedy"), (7, 3, 4, "sample"), (100, 3, 2, "sample"), (100, 2, 5, "greedy"),
     (600, 3, 3, "sample"), (600, 3, 4, "sample"), (600, 2, 1, "greedy"), (2500, 2, 3, "sample"),
     (2500, 2, 4, "sample"), (5000, 1, 5, "sample"), (333, 3, 0, "sample"), (333, 2, 0, "greedy")] * 2)]


@pytest.mark.parametrize("seed,V,B,n,terminal", CASES)
def test_emulated_chain_kernel_equals_reference_and_O0(seed, V, B, n, terminal):
    stages, src, kw, per_row, ops, x = chain_case(seed, V, B, n, terminal)
    tok, lp = kernel(x, ops, stages, terminal)
    o0 = samplec.compile(src, opt_level=0)(x, **kw)
    assert tok.tolist() == np.array(o0.token).tolist(), src
    for r in range(B):
        term = ("sample", {"seed": kw["seed"][r], "position": kw["pos"][r]}) if terminal == "sample" else \
            ("greedy", {})
        ref = R.run_chain(x[r], per_row[r], term, row=r)
        assert tok[r] == ref["token"], (src, r)
        np.testing.assert_allclose(lp[r], ref["logprob"], atol=2e-3, rtol=1e-3, err_msg=f"{src} row {r}")
        np.testing.assert_allclose(lp[r], np.array(o0.logprob)[r], atol=2e-4, rtol=1e-4, err_msg=f"{src} row {r}")


TYPICAL = [(s, V, B, n, term) for s, (V, B, n, term) in enumerate(
    [(300, 3, 1, "sample"), (300, 3, 2, "greedy"), (1000, 3, 3, "sample"), (50, 3, 2, "sample"),
     (2500, 2, 4, "sample"), (600, 3, 3, "greedy"), (7, 3, 2, "sample"), (5000, 2, 2, "sample")] * 3, start=700)]


@pytest.mark.parametrize("seed,V,B,n,terminal", TYPICAL)
def test_emulated_typical_p_in_any_place_equals_reference_and_O0(seed, V, B, n, terminal):
    """typical_p's band (the tokens between it and the maximum removed) in random places of random chains, with
    xtc in many, and two or three typical_p in some: the kernel, one block a row and split, against -O0 and the
    numpy reference."""
    rng = np.random.default_rng(seed)
    stages, _, _, _, _, x = chain_case(seed, V, B, n, terminal)
    stages2 = [s for s in stages if s != "typical_p"]
    for _ in range(1 + (seed % 3 == 0) + (seed % 5 == 0)):        # (one, two or three typical_p: a band each)
        stages2.insert(int(rng.integers(0, len(stages2) + 1)), "typical_p")
    if rng.random() < 0.3:
        stages2.insert(int(rng.integers(0, len(stages2) + 1)), "xtc")
    while not gpu.chain_supports(stages2, terminal):     # (the key slots: one xtc before a sample)
        stages2.remove("xtc")
    src, kw, per_row = build(V, B, stages2, ["rows"] * len(stages2), terminal, False, rng)
    tok, lp = kernel(x, operands_of(stages2, kw, terminal), stages2, terminal,
                     split=(0, 0) if seed % 2 else (int(rng.integers(1, 6)), int(rng.choice([4, 32, 256]))))
    o0 = samplec.compile(src, opt_level=0)(x, **kw)
    assert tok.tolist() == np.array(o0.token).tolist(), src
    for r in range(B):
        term = ("sample", {"seed": kw["seed"][r], "position": kw["pos"][r]}) if terminal == "sample" else \
            ("greedy", {})
        assert tok[r] == R.run_chain(x[r], per_row[r], term, row=r)["token"], (src, r)
    np.testing.assert_allclose(lp, np.array(o0.logprob), atol=2e-4, rtol=1e-4, err_msg=src)


def test_emulated_sample_skips_only_tokens_that_cannot_win():
    """The draw skips the Threefry of a token whose logit plus the largest noise stays below its thread's best:
    rows whose logits spread over tens (most tokens skipped) draw what -O0 draws, over many seeds."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 3000)) * np.array([[1.0], [8.0], [20.0], [40.0]])).astype(np.float32)
    prog = samplec.compile("sampler s(seed: seed) -> token, logprob { sample(seed) }", opt_level=0)
    for seed in range(6):
        seeds = [seed * 4 + r for r in range(4)]
        ops = [mx.array(np.array(seeds, dtype=np.uint64)), mx.array(np.zeros(4, dtype=np.int32))]
        tok, lp = kernel(x, ops, [], "sample")
        o0 = prog(x, seed=seeds)
        assert tok.tolist() == np.array(o0.token).tolist(), seed
        np.testing.assert_allclose(lp, np.array(o0.logprob), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("terminal", ["greedy", "sample"])
def test_emulated_typical_p_zero_keeps_the_most_typical(terminal):
    """typical_p(0): a selection whose target an empty set reaches answers the row's largest key (the dense
    definition's clamp), so only the most typical tokens and the maximum stay -- not the whole row."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 300)) * 2).astype(np.float32)
    src = "sampler s(m: float, seed: seed) -> token, logprob { typical_p(m) " + \
        ("sample(seed) }" if terminal == "sample" else "greedy() }")
    ops = [mx.array(0.0, dtype=mx.float32)] + \
        ([mx.array(np.array([5, 6], dtype=np.uint64)), mx.array(0, dtype=mx.int32)] if terminal == "sample" else [])
    tok, lp = kernel(x, ops, ["typical_p"], terminal)
    o0 = samplec.compile(src, opt_level=0)(x, m=0.0, seed=[5, 6])
    assert tok.tolist() == np.array(o0.token).tolist()
    np.testing.assert_allclose(lp, np.array(o0.logprob), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("V,k", [(20001, 600), (20001, 2000), (20000, 1500)])
def test_emulated_top_k_bound_between_the_block_and_four_maxima_a_thread(V, k):
    """top_k from 513 to 2,048 at the GPU's block size, the row 16-byte aligned or not (a float4 pass or a scalar
    one): the bound from four maxima a thread, then the selection, against -O0."""
    rng = np.random.default_rng(V + k)
    x = np.stack([family_row(f, V, rng) for f in ("normal", "tail")])
    ops = [mx.array(k, dtype=mx.int32), mx.array(np.array([1, 2], dtype=np.uint64)), mx.array(3, dtype=mx.int32)]
    tok, lp = kernel(x, ops, ["top_k"], "sample", threads=block())
    src = "sampler s(k: int, seed: seed) -> token, logprob { top_k(k) sample(seed, position = 3) }"
    o0 = samplec.compile(src, opt_level=0)(x, k=k, seed=[1, 2])
    assert tok.tolist() == np.array(o0.token).tolist()
    np.testing.assert_allclose(lp, np.array(o0.logprob), atol=2e-4, rtol=1e-4)


def _cut_operands(cut: str, seeds: list[int]) -> tuple[str, list]:
    """One of test_differential's EXTREME_CUTS as the kernel's stage and operands (literals: one value a row)."""
    name, args = cut.rstrip(")").split("(")
    vals = [a.strip() for a in args.split(",")]
    if name == "xtc":
        return name, [mx.array(float(vals[0]), dtype=mx.float32), mx.array(float(vals[1]), dtype=mx.float32),
                      mx.array(np.array(seeds, dtype=np.uint64)), mx.array(0, dtype=mx.int32)]
    return name, [mx.array(int(vals[0]), dtype=mx.int32) if name == "top_k" else mx.array(float(vals[0]), mx.float32)]


def test_emulated_extreme_temperatures_between_cuts_equal_O0():
    """test_differential's extreme temperatures (0, subnormal, 1e30, inf: a top that overflows, logits rounded
    together) between its cuts (typical_p(0) and xtc among them), per row, through the emulated kernel: tokens and
    the final softmax against -O0's (chains the kernel declines -- typical_p twice -- skipped)."""
    rng = np.random.default_rng(11)
    ran = ties = 0
    for case in range(60):
        chain, names, stages, ops = [], [], [], []
        B, seeds = 6, list(range(6))
        for i in range(int(rng.integers(1, 4))):
            if rng.random() < 0.5:
                cut = str(rng.choice(EXTREME_CUTS))
                chain.append(cut)
                st, o = _cut_operands(cut, seeds)
                stages.append(st)
                ops += o
            chain.append(f"temperature(t{i})")
            names.append(f"t{i}")
            stages.append("temperature")
            ops.append(None)                       # (the temperature's per-row values, below)
        term = str(rng.choice(["sample", "greedy"]))
        V = int(rng.choice([3, 50, 300]))
        x = rng.normal(0, float(rng.choice([1.0, 1e3])), (B, V)).astype(np.float32)
        kw = {n: [float(v) for v in rng.choice(EXTREME_T, B)] for n in names}
        if not gpu.chain_supports(stages, term):
            continue
        temps = iter(names)
        ops = [mx.array(kw[next(temps)], dtype=mx.float32) if o is None else o for o in ops]
        if term == "sample":
            ops += [mx.array(np.array(seeds, dtype=np.uint64)), mx.array(0, dtype=mx.int32)]
        src = (f"sampler s({', '.join(n + ': float' for n in names)}, seed: seed) -> token, probs "
               f"{{ {' '.join(chain)} {'sample(seed)' if term == 'sample' else 'greedy()'} }}")
        o0 = samplec.compile(src, opt_level=0)(x, seed=seeds, **kw)
        tok, _, probs = kernel(x, ops, stages, term, out_x=2)
        want_tok, want = np.array(o0.token), np.array(o0.probs)
        for r in range(B):
            if tok[r] == want_tok[r] and np.allclose(probs[r], want[r], atol=1e-6, rtol=1e-6):
                continue
            # (a temperature that rounds every kept logit together leaves equal probabilities: a top_p or typical_p
            # cut then lands where the cumulative mass equals p exactly, and sums in another order than MLX's may
            # keep a token more or less -- spec section 4's "up to float rounding at exact ties")
            support = want[r][want[r] > 0]
            tied = support.size > 0 and support.max() == support.min() and {"top_p", "typical_p"} & set(stages)
            assert tied, (case, r, src, {n: v[r] for n, v in kw.items()}, tok[r], want_tok[r])
            ties += 1
        ran += 1
    assert ran >= 30 and ties <= ran


def test_emulated_chain_kernel_at_the_gpus_block_size():
    """gpu.CHAIN_THREADS threads a block, as on the GPU (V above 16 * 512: the unrolled float4 loads run too)."""
    stages, src, kw, per_row, ops, x = chain_case(99, 9000, 2, 4, "sample")
    tok, lp = kernel(x, ops, stages, "sample", threads=block())
    o0 = samplec.compile(src, opt_level=0)(x, **kw)
    assert tok.tolist() == np.array(o0.token).tolist(), src
    np.testing.assert_allclose(lp, np.array(o0.logprob), atol=2e-4, rtol=1e-4)


def test_emulated_chain_kernel_without_logprob_writes_zero():
    stages, src, kw, per_row, ops, x = chain_case(5, 300, 2, 2, "sample")
    tok, lp = kernel(x, ops, stages, "sample", False)
    assert lp.tolist() == [0.0, 0.0]
    assert tok.tolist() == np.array(samplec.compile(src, opt_level=0)(x, **kw).token).tolist()


def test_chain_supports_and_body():
    assert gpu.chain_supports(["temperature", "top_k", "top_p", "min_p", "xtc", "top_n_sigma", "epsilon", "eta"],
                              "sample")
    assert gpu.chain_supports(["typical_p", "top_k"], "sample") and not gpu.chain_supports(["penalties"], "sample")
    assert gpu.chain_supports(["xtc", "typical_p", "xtc"], "greedy")
    assert gpu.chain_supports(["typical_p", "temperature", "typical_p"], "greedy")          # (a band each)
    assert not gpu.chain_supports(["typical_p"] * 5, "greedy")
    assert gpu.chain_supports(["dynamic_temperature", "top_k_rank"], "sample")
    assert not gpu.chain_supports(["top_k_rank", "top_k_rank"], "sample")                 # (one tie rule)
    assert not gpu.chain_supports(["temperature"] * 4 + ["dynamic_temperature"] * 5, "greedy")
    assert not gpu.chain_supports(["temperature"] * 9, "greedy")
    assert not gpu.chain_supports(["xtc", "xtc"], "sample") and gpu.chain_supports(["xtc", "xtc"], "greedy")
    assert not gpu.chain_supports(["xtc"] * 5 + ["top_k"], "greedy")           # (11 float operands)
    assert gpu.chain_codes(["top_k", "xtc", "temperature"], "sample", True) == [3, 1, 1, 4, 6, 0, 0, 0, 1, 6, 0] + \
        [0] * 14 + [0] * gpu.EDIT_CODES + [0]
    assert gpu.chain_codes([], "greedy", False, 2, split=(8, 512)) == [0, 0, 0, 1, 1, 2, 8, 512] + [0] * 14 + \
        [0] * gpu.EDIT_CODES + [0]
    edits = (1, 0, 2, 1, 3, 1, 1, 0, 1)
    assert gpu.chain_codes([], "greedy", False, edits=edits)[-gpu.EDIT_CODES - 1:] == list(edits) + [0]
    assert gpu.chain_codes([], "greedy", False, edits=edits, raw=True)[-1] == 1        # (the logits' normalizer)
    # split mode: about one block a multiprocessor over the batch, at most MAX_SLICES a row, the slices'
    # candidates fitting one block's shared memory together
    assert gpu.split_of(1, 152064) == (128, 32) and gpu.split_of(8, 152064) == (17, 240)
    assert gpu.split_of(64, 152064) == (3, 1365) and gpu.split_of(256, 152064) == (1, 2048)
    assert gpu.split_of(1, 1000) == (1, 2048)


def test_chain_inputs_pass_operands_as_they_are():
    """The operands go to the kernel as the program holds them: an f32 value per row or one value, top_k's i32 k
    (its bits viewed as f32: every slot float, one kernel for every chain), a u64 seed and an i32 position without
    an op; another dtype is cast; S flags which slots hold one value per row and which hold an integer's bits."""
    k, p, seed, pos = (mx.array([5, 7, 9], dtype=mx.int32), mx.array([0.9, 0.5, 1.0], dtype=mx.float32),
                       mx.array(np.array([1, 2, 3], dtype=np.uint64)), mx.array(4, dtype=mx.int32))
    t = mx.array(0.7, dtype=mx.float32)
    ins = gpu.chain_inputs([t, k, p, seed, pos], ["temperature", "top_k", "top_p"], "sample", False, 0, 3)
    assert ins[0] is t and ins[2] is p and ins[gpu.CHAIN_FLOAT_SLOTS] is seed
    assert ins[gpu.CHAIN_FLOAT_SLOTS + gpu.CHAIN_KEY_SLOTS] is pos
    assert all(a.dtype == mx.float32 for a in ins[:gpu.CHAIN_FLOAT_SLOTS])
    assert np.array(ins[1].view(mx.int32)).tolist() == [5, 7, 9]
    f64 = mx.array([5, 7, 9], dtype=mx.int64)
    cast = gpu.chain_inputs([t, f64, p, seed, pos], ["temperature", "top_k", "top_p"], "sample", False, 0, 3)
    assert cast[1].dtype == mx.float32 and np.array(cast[1]).tolist() == [5.0, 7.0, 9.0]
    S = np.array(ins[-1]).tolist()
    assert S[11:] == [0, 1 | gpu.INT_BITS, 1] + [0] * 7 + [1, 0] + [0, 0] + [0] * gpu.EDIT_CODES + [0]
    assert np.array(cast[-1]).tolist()[12] == 1        # (a cast operand: floats)
    assert gpu.chain_inputs([mx.array([[1.0, 2.0]])], ["temperature"], "greedy", False, 0, 3) is None


def test_emulated_chain_kernel_scalar_and_per_row_operands_agree():
    """One value for every row (stride 0) reads as that value repeated per row."""
    rng = np.random.default_rng(7)
    x = np.stack([family_row(f, 500, rng) for f in ("peaked", "flat", "tail")])
    stages = ["top_k", "temperature", "top_p", "min_p"]
    vals = [mx.array(40, dtype=mx.int32), mx.array(0.8, dtype=mx.float32), mx.array(0.9, dtype=mx.float32),
            mx.array(0.05, dtype=mx.float32), mx.array(np.array(11, dtype=np.uint64)), mx.array(3, dtype=mx.int32)]
    rows = [mx.broadcast_to(v, (3,)) for v in vals]
    one = kernel(x, vals, stages, "sample")
    each = kernel(x, rows, stages, "sample")
    assert one[0].tolist() == each[0].tolist() and np.array_equal(one[1], each[1])


@pytest.mark.parametrize("split", [(0, 0), (3, 16)])
@pytest.mark.parametrize("seed,V,n", [(40, 300, 3), (41, 300, 4), (42, 7, 2), (43, 1000, 5), (44, 300, 1), (45, 300, 0)])
def test_emulated_chain_kernel_final_logits_and_probs(seed, V, n, split):
    """The [B, V] output: the chain's final logits (a chain whose last stage something else reads) and their
    softmax (a `probs` output), against -O0's `candidates(V)` and `probs`; one block a row and split (the last
    block of a row writes it, its softmax's normalizer from the slices where no cut settled the row)."""
    stages, src, kw, per_row, ops, x = chain_case(seed, V, 3, n, "sample")
    src = src.replace("-> token, logprob", f"-> token, logprob, probs, candidates({V})")
    o0 = samplec.compile(src, opt_level=0)(x, **kw)
    tok, lp, probs = kernel(x, ops, stages, "sample", out_x=2, split=split)
    assert tok.tolist() == np.array(o0.token).tolist(), src
    np.testing.assert_allclose(probs, np.array(o0.probs), atol=1e-6, rtol=1e-5, err_msg=src)
    _, _, final = kernel(x, ops, stages, "sample", out_x=1, split=split)
    assert np.array_equal(-np.sort(-final, axis=-1), np.array(o0.candidates.values)), src


def assert_outputs_equal(got: dict, want: dict, src: str) -> None:
    """A program's outputs (to_dict) against -O0's: ids exactly, floats to float32 rounding."""
    assert got.keys() == want.keys(), src
    for k, v in want.items():
        v, g = np.array(v), np.array(got[k])
        if v.dtype.kind in "iu":
            assert np.array_equal(g, v), (src, k)
        else:
            np.testing.assert_allclose(g, v, atol=2e-4, rtol=1e-4, err_msg=f"{src} {k}")


def fake_cuda(monkeypatch):
    """The cuda target on the CPU: a CUDA device faked where the interpreter and the target pass ask, the kernels
    beside the chain kernel (top_logprobs' selection, DRY) the emulated ones (tests/test_gpu_beside.py)
    in the current dialect."""
    import samplec.passes.target as target
    from test_gpu_beside import emulated_dry
    from test_gpu_beside import emulated_top_logprobs as emulated_top
    monkeypatch.setenv("SAMPLEC_NATIVE", "0")
    monkeypatch.setattr(gpu, "available", lambda: True)
    monkeypatch.setattr(gpu, "kth_largest", lambda x, want: None)
    monkeypatch.setattr(target, "unavailable", lambda t: None)
    run, tops = emulated_top(_DIALECT[0]), []

    def top_logprobs(x, m, lz, k, margin):
        assert margin == TIE_MARGIN
        tops.append(k)
        ids, vals = run(np.array(x), np.array(m), np.array(lz), k)
        return mx.array(ids), mx.array(vals)
    monkeypatch.setattr(gpu, "top_logprobs", top_logprobs)
    dry = emulated_dry(_DIALECT[0])
    monkeypatch.setattr(gpu, "dry", lambda x, h, *v: mx.array(dry(np.array(x), np.array(h), *(
        None if a is None else np.array(a) for a in v))) if gpu.dry_inputs(x, h, *v) is not None else None)
    return tops         # (the k of each call of top_logprobs' kernel)


def on_fake_cuda(src: str, x, kw: dict, monkeypatch) -> tuple:
    """(the program compiled for cuda, its outputs, the edits' kinds of each kernel call): a CUDA device faked, its
    chain kernel the emulated one."""
    calls: list = []
    fake_cuda(monkeypatch)
    monkeypatch.setattr(gpu, "sample_chain", emulated_sample_chain(calls))
    prog = samplec.compile(src, target="cuda")
    return prog, prog(x, **kw).to_dict(), calls


def emulated_sample_chain(calls: list | None = None):
    """gpu.sample_chain with the emulated kernel in the current dialect: None where the kernel does not take the
    operands or edits (as the real one answers), else its outputs as MLX arrays; `calls` records the edits' kinds."""
    def sample_chain(x, params, stages, terminal, want_logprob, out_x=0, edits=(), raw=False):
        B, V = x.shape
        if gpu.chain_inputs(params, stages, terminal, want_logprob, out_x, B, (0, 0), tuple(edits), V) is None:
            return None
        out = kernel(np.array(x), params, stages, terminal, want_logprob, out_x, edits=tuple(edits), raw=raw)
        if calls is not None:
            calls.append(tuple(kind for kind, _ in edits))
        return (mx.array(out[0])[:, None], mx.array(out[1])[:, None]) + tuple(mx.array(o) for o in out[2:])
    return sample_chain


@pytest.mark.parametrize("seed,V,n,terminal,outs", [
    (60, 300, 3, "sample", "token, logprob"), (61, 1000, 4, "sample", "token, logprob, probs"),
    (62, 300, 2, "greedy", "token, logprob"), (63, 500, 3, "greedy", "token, logprob, probs"),
    (64, 300, 0, "sample", "token, logprob, raw_logprob, top_logprobs(3)"), (65, 7, 3, "sample", "token")])
def test_interpreter_hands_chains_to_the_kernel(seed, V, n, terminal, outs, monkeypatch):
    """The interpreter's side (Chain.run_gpu, gpu.sample_chain's operands and outputs) on the CPU: a CUDA device
    faked, its kernel the emulated one; a program's outputs against -O0's. Greedy chains after cuts have no draw
    node (the passes take the logits' argmax): the kernel gives their final logits for the logprob."""
    stages, src, kw, per_row, ops, x = chain_case(seed, V, 2, n, terminal)
    src = src.replace("-> token, logprob", f"-> {outs}")
    want = samplec.compile(src, opt_level=0)(x, **kw).to_dict()
    calls = []

    def fake(x, params, stages, terminal, want_logprob, out_x=0, raw=False):
        out = kernel(np.array(x), params, stages, terminal, want_logprob, out_x, raw=raw)
        calls.append((tuple(stages), terminal, out_x))
        return (mx.array(out[0])[:, None], mx.array(out[1])[:, None]) + tuple(mx.array(o) for o in out[2:])

    tops = fake_cuda(monkeypatch)
    monkeypatch.setattr(gpu, "sample_chain", fake)
    got = samplec.compile(src, target="cuda")(x, **kw).to_dict()
    assert calls and tops == ([3] if "top_logprobs" in outs else []), src
    assert_outputs_equal(got, want, src)


@pytest.mark.parametrize("terminal", ["sample", "greedy"])
def test_emulated_chain_kernel_on_a_row_with_no_finite_logit(terminal):
    """A row the checks reject (every logit -inf: an allow or a -inf bias emptied it) must not send the kernel out
    of the row before the error is raised: token 0 (the dense argmax), a finite or NaN logprob, no fault."""
    x = np.full((2, 300), -np.inf, dtype=np.float32)
    x[1, 17] = 2.0
    stages = ["top_k", "top_p"]
    ops = [mx.array([5, 5], dtype=mx.int32), mx.array([0.9, 0.9], dtype=mx.float32)]
    if terminal == "sample":
        ops += [mx.array(np.array([3, 4], dtype=np.uint64)), mx.array([0, 0], dtype=mx.int32)]
    tok, lp = kernel(x, ops, stages, terminal)
    assert tok.tolist() == [0, 17]


SPLIT = [(s, V, B, n, term, nb, cap) for s, (V, B, n, term, nb, cap) in enumerate(
    [(300, 2, 3, "sample", 3, 16), (1000, 3, 2, "greedy", 5, 4), (3000, 1, 4, "sample", 8, 64),
     (7, 2, 2, "sample", 1, 256), (1000, 2, 0, "sample", 4, 16), (3000, 2, 5, "greedy", 2, 256),
     (300, 3, 1, "sample", 2, 4), (1000, 1, 3, "sample", 16, 16)] * 2, start=900)]


@pytest.mark.parametrize("seed,V,B,n,terminal,nb,cap", SPLIT)
def test_emulated_split_rows_equal_O0(seed, V, B, n, terminal, nb, cap):
    """Split mode: each row over nb blocks, each keeping cap candidates of its slice, the last block of the row
    running the chain over them (or the whole row where a stage needs the tokens outside): random chains of the
    kernel's stages, per-row values, the differential test's families, against -O0."""
    stages, src, kw, per_row, ops, x = chain_case(seed, V, B, n, terminal)
    tok, lp = kernel(x, ops, stages, terminal, split=(nb, cap))
    o0 = samplec.compile(src, opt_level=0)(x, **kw)
    assert tok.tolist() == np.array(o0.token).tolist(), src
    np.testing.assert_allclose(lp, np.array(o0.logprob), atol=2e-4, rtol=1e-4, err_msg=src)


SERVER_CHAINS = {       # (bench_gpu's CHAINS: each system's order, its usual values)
    "mlx_lm": (["top_p", "min_p", "top_k", "temperature"], [0.95, 0.05, 40, 0.8]),
    "hf": (["temperature", "top_k", "top_p"], [0.8, 50, 0.9]),
    "vllm": (["temperature", "top_k", "top_p", "min_p"], [0.7, 40, 0.95, 0.05]),
    "llama_cpp": (["top_k", "top_p", "min_p", "temperature"], [40, 0.95, 0.05, 0.8]),
    "min_p": (["min_p", "temperature"], [0.1, 1.2]),
    "sigma": (["top_n_sigma", "temperature"], [1.0, 0.7]),
    "eta": (["temperature", "eta"], [1.0, 0.0009]),
    "plain": ([], []),
    "temperature": (["temperature"], [0.7]),
    "off": (["top_p", "min_p", "top_k", "temperature"], [1.0, 0.0, 0, 0.6]),
}


@pytest.mark.parametrize("name", sorted(SERVER_CHAINS))
@pytest.mark.parametrize("terminal", ["sample", "greedy"])
def test_emulated_split_settles_server_chains_on_the_candidates(name, terminal):
    """The chains servers run, on chat-like rows (a Zipf head over a wide tail), split as a B = 1 call is on the GPU
    (gpu.split_of at the emulation's block size): settled from the slices' candidates and aggregates alone -- the
    build marks a row that needed the whole row with token -1 -- and equal to -O0."""
    stages, vals = SERVER_CHAINS[name]
    rng = np.random.default_rng(len(name))
    V, B = 6000, 2
    x = np.stack([family_row("tail", V, rng) for _ in range(B)]) * 2.0
    ops = [mx.array(v, dtype=mx.int32 if s == "top_k" else mx.float32) for s, v in zip(stages, vals)]
    seeds = [11, 12]
    if terminal == "sample":
        ops += [mx.array(np.array(seeds, dtype=np.uint64)), mx.array(5, dtype=mx.int32)]
    split = gpu_split(1, V, 64)
    assert split[0] > 1
    tok, lp = kernel(x, ops, stages, terminal, split=split, defines="#define SC_SPLIT_ONLY\n")
    body = " ".join(f"{s}({v})" for s, v in zip(stages, vals))
    src = f"sampler s(seed: seed) -> token, logprob {{ {body} " + \
        ("sample(seed, position = 5) }" if terminal == "sample" else "greedy() }")
    o0 = samplec.compile(src, opt_level=0)(x, seed=seeds)
    assert tok.tolist() == np.array(o0.token).tolist(), src
    np.testing.assert_allclose(lp, np.array(o0.logprob), atol=2e-4, rtol=1e-4, err_msg=src)


def test_emulated_split_at_the_gpus_block_size():
    """The GPU's threads a block (gpu.CHAIN_THREADS, gpu.METAL_THREADS) and gpu.split_of's slices for B = 1 and
    B = 2, as on the GPU."""
    stages, src, kw, per_row, ops, x = chain_case(98, 12000, 2, 3, "sample")
    for B in (1, 2):
        tok, lp = kernel(x[:B], ops if B == 2 else [o[:1] if o.size == 2 else o for o in ops], stages, "sample",
                         threads=block(), split=gpu_split(B, 12000))
        o0 = samplec.compile(src, opt_level=0)(x, **kw)
        assert tok.tolist() == np.array(o0.token).tolist()[:B], src
        np.testing.assert_allclose(lp, np.array(o0.logprob)[:B], atol=2e-4, rtol=1e-4)


MAPS_AND_RANKS = [
    "dynamic_temperature(t, r, ex) top_k(k)", "top_k(k) dynamic_temperature(t, r, ex) top_p(p)",
    "dynamic_temperature(t, r, ex)", "top_k_rank(k) temperature(t)", "top_k_rank(k) top_p(p) temperature(t)",
    "top_k_rank(k) dynamic_temperature(t, r, ex) min_p(0.05)", "typical_p(p) dynamic_temperature(t, r) typical_p(p)",
]


def top_k_rank_rows(x: np.ndarray, ks: list[int]) -> np.ndarray:
    """top_k_rank's definition per row in numpy: every value above the k-th largest, and of the values equal to it
    the lowest ids, as many as the k places leave (k <= 0 or k >= V: the row as it is)."""
    out = x.copy()
    for r, k in enumerate(ks):
        if 0 < k < x.shape[1]:
            vk = np.sort(x[r])[::-1][k - 1]
            ties = np.flatnonzero(x[r] == vk)
            keep = (x[r] > vk)
            keep[ties[:k - int(keep.sum())]] = True
            out[r, ~keep] = -np.inf
    return out


@pytest.mark.parametrize("body", MAPS_AND_RANKS)
@pytest.mark.parametrize("terminal", ["sample", "greedy"])
def test_emulated_dynamic_temperature_and_top_k_rank_equal_O0(body, terminal):
    """dynamic_temperature (its entropy and count over the kept tokens; range 0: temperature(t)) and top_k_rank (the
    lowest ids among the ties at the k-th) in the kernel, per-row values at their edges, on rows with ties and
    flat rows, one block a row and split, against -O0."""
    rng = np.random.default_rng(len(body) + len(terminal))
    B, V = 6, 400
    x = np.stack([family_row(f, V, rng) for f in ("ties", "tail", "flat", "normal", "peaked", "ties")])
    kw = {"t": [0.0, 0.7, 1.0, 1.5, 0.3, 2.0], "r": [0.5, 0.0, 1.5, 0.3, 0.1, 1.0], "ex": [1.0, 0.0, 2.0, 1.0, 0.5, 1.0],
          "k": [3, 40, 1, 399, 0, 17], "p": [0.9, 0.5, 1.0, 0.95, 0.3, 0.8], "seed": list(range(B))}
    # (top_k_rank is no source stage -- mirostat's lowering writes it -- so -O0 runs the rest of the chain on its
    # definition's result)
    ranked = body.startswith("top_k_rank(k) ")
    rest = body.removeprefix("top_k_rank(k) ")
    names = [n for n in ("t", "r", "ex", "k", "p") if f"{n})" in rest or f"{n}," in rest]
    params = "".join(f"{n}: {'int' if n == 'k' else 'float'}, " for n in names)
    src = f"sampler s({params}seed: seed) -> token, logprob {{ {rest} " + \
        ("sample(seed, position = 2) }" if terminal == "sample" else "greedy() }")
    o0 = samplec.compile(src, opt_level=0)(top_k_rank_rows(x, kw["k"]) if ranked else x,
                                           **{n: kw[n] for n in names + ["seed"]})
    stages, ops = [], []
    for st in body.split(") "):
        name, args = st.rstrip(")").split("(")
        stages.append(name)
        for a in [a.strip() for a in args.split(",")]:
            ops.append(mx.array(kw[a], dtype=mx.float32) if a in kw else mx.array(float(a), dtype=mx.float32))
        if name == "dynamic_temperature" and len(args.split(",")) == 2:
            ops.append(mx.array(1.0, dtype=mx.float32))            # (exponent's default)
    if terminal == "sample":
        ops += [mx.array(np.array(kw["seed"], dtype=np.uint64)), mx.array(2, dtype=mx.int32)]
    for split in ((0, 0), (3, 16)):
        tok, lp = kernel(x, ops, stages, terminal, split=split)
        assert tok.tolist() == np.array(o0.token).tolist(), (src, split)
        np.testing.assert_allclose(lp, np.array(o0.logprob), atol=2e-4, rtol=1e-4, err_msg=f"{src} {split}")


EDITS = [(s, V, B, n, term, bias, allow, shared, split) for s, (V, B, n, term, bias, allow, shared, split) in enumerate(
    [(300, 2, 3, "sample", True, None, False, (0, 0)), (300, 3, 2, "greedy", False, "bool", False, (0, 0)),
     (1000, 2, 3, "sample", False, "bits", False, (0, 0)), (1000, 3, 4, "sample", True, "bool", True, (0, 0)),
     (333, 2, 2, "sample", True, "bits", False, (0, 0)), (500, 2, 0, "greedy", True, "bits", True, (0, 0)),
     (300, 2, 3, "sample", True, "bool", False, (3, 16)), (1000, 2, 2, "greedy", False, "bits", True, (4, 64)),
     (7, 2, 2, "sample", True, "bits", False, (0, 0)), (3000, 1, 3, "sample", True, "bool", False, (5, 256))],
    start=1100)]


@pytest.mark.parametrize("seed,V,B,n,terminal,bias,allow,shared,split", EDITS)
def test_emulated_logit_bias_and_allow_in_the_kernel_equal_O0(seed, V, B, n, terminal, bias, allow, shared, split):
    """logit_bias (a dense bias, -inf in places) and allow (a bool mask, or a packed int32 bitmask: bit j of word w
    for token 32 w + j) before random chains, applied in the kernel (each block edits its part of the row into the
    scratch before the stages), one row for every row or one per row, one block a row and split: against -O0's
    `logit_bias(b) allow(m)` in front of the same chain."""
    stages, src, kw, per_row, ops, x = chain_case(seed, V, B, n, terminal)
    rng = np.random.default_rng(seed)
    R = 1 if shared else B
    b = (rng.standard_normal((R, V)) * 2).astype(np.float32)
    top = np.argmax(np.broadcast_to(x, (B, V)), axis=-1)
    b[rng.random((R, V)) < 0.05] = -np.inf
    for r in range(R):              # (b finite at each row's maximum: no row is left without a finite logit)
        b[r, top if shared else top[r]] = 0.0
    if not bias:
        b[:] = 0.0
    m = rng.random((R, V)) < 0.6
    e = np.broadcast_to(x + b, (B, V))
    for r in range(B):
        m[0 if shared else r, int(np.argmax(e[r]))] = True
    edits, names, body = [], [], []
    if bias:
        edits.append(("logit_bias", mx.array(b)))
        names.append("eb: bias")
        body.append("logit_bias(eb)")
        kw["eb"] = np.broadcast_to(b, (B, V)).copy()
    if allow:
        mb = np.broadcast_to(m, (B, V))
        if allow == "bits":
            W = -(-V // 32)
            padded = np.zeros((R, W * 32), bool)
            padded[:, :V] = m
            words = (padded.reshape(R, W, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
            packed = words.astype(np.uint32).view(np.int32)
            edits.append(("allow", mx.array(packed)))
            kw["em"] = np.broadcast_to(packed, (B, W)).copy()
        else:
            edits.append(("allow", mx.array(m)))
            kw["em"] = mb.copy()
        names.append("em: mask")
        body.append("allow(em)")
    src = src.replace("sampler s(", f"sampler s({', '.join(names)}, ", 1).replace(
        "{\n", "{\n" + "".join(f"    {s}\n" for s in body), 1)
    o0 = samplec.compile(src, opt_level=0)(x, **kw)
    tok, lp, top = kernel(x, ops, stages, terminal, split=split, edits=tuple(edits))
    kept = np.broadcast_to(m if allow else True, (B, V))
    np.testing.assert_array_equal(top[:, 0], np.where(kept, e, -np.inf).max(-1))     # (the edited row's maximum)
    assert tok.tolist() == np.array(o0.token).tolist(), src
    np.testing.assert_allclose(lp, np.array(o0.logprob), atol=2e-4, rtol=1e-4, err_msg=src)


def test_edit_slots_take_the_shapes_the_program_holds():
    """A bias [B, V] or [1, V], a bool mask, a packed bitmask [B, ceil(V / 32)]; two of a kind, or another width,
    is not the kernel's (the chain keeps its MLX ops)."""
    B, V = 3, 70
    bias, mask = mx.zeros((B, V)), mx.ones((B, V), dtype=mx.bool_)
    bits = mx.zeros((1, 3), dtype=mx.int32)
    ins, codes = gpu._edit_slots([("logit_bias", bias), ("allow", bits)], B, V)
    assert ins[0] is bias and ins[2] is bits and codes == (1, 1, 2, 0) + (0,) * 5
    assert gpu._edit_slots([("allow", mask)], B, V)[1] == (0, 0, 1, 1) + (0,) * 5
    hist, one, rows = mx.zeros((B, 5), dtype=mx.int32), mx.array(1.0), mx.ones((B,))
    pen = ("penalties", (hist, mx.array(-1, dtype=mx.int32), one, rows, one))
    ins, codes = gpu._edit_slots([("logit_bias", bias), pen], B, V)
    assert ins[3] is hist and codes == (1, 1, 0, 0, 1, 1, 0, 1, 0)       # (the bias before the penalties)
    # PV: (last_n, repeat, frequency, presence, the history's offset and length) a stage as floats, a row each where
    # one operand is (at least 8 wide)
    assert np.array(ins[4]).tolist() == [[-1.0, 1.0, 1.0, 1.0, 0.0, 5.0, 0.0, 0.0]] * B
    assert gpu._edit_slots([pen, ("logit_bias", bias[:1])], B, V)[1] == (1, 0, 0, 0, 1, 1, 1, 1, 0)
    assert gpu._edit_slots([pen, ("allow", mask)], B, V)[1][8] == 1           # (the allow after them)
    two = (hist, mx.array(3, dtype=mx.int32), mx.array(1.5), one, mx.array(0.25))
    ins, codes = gpu._edit_slots([("allow", mask), ("penalties", two), pen, ("penalties", two)], B, V)
    assert codes[4] == 3 and np.array(ins[4]).shape == (B, 18)               # (three stages in a row)
    assert np.array(ins[4])[0, :4].tolist() == [3.0, 1.5, 1.0, 0.25]
    assert gpu._edit_slots([pen, ("logit_bias", bias), pen], B, V) is None   # (a bias between two stages)
    assert gpu._edit_slots([pen] * 5, B, V) is None                          # (MAX_PENALTIES)
    other = ("penalties", (mx.ones((1, 3), dtype=mx.int32), *pen[1][1:]))
    ins, codes = gpu._edit_slots([pen, other, pen], B, V)                  # (two histories side by side)
    assert np.array(ins[3]).tolist() == [[0] * 5 + [1] * 3] * B and codes[4:6] == (3, 1)
    assert np.array(ins[4])[0, 4:6].tolist() == [0.0, 5.0] and np.array(ins[4])[0, 10:12].tolist() == [5.0, 3.0]
    assert gpu._edit_slots([("penalties", (hist[0], *pen[1][1:]))], B, V) is None      # (a 2-D history)
    assert gpu._edit_slots([("penalties", (hist, mx.ones((B, 2)), one, one, one))], B, V) is None
    assert gpu._edit_slots([("logit_bias", bias), ("logit_bias", bias)], B, V) is None
    assert gpu._edit_slots([("allow", mx.zeros((B, 2), dtype=mx.int32))], B, V) is None
    assert gpu._edit_slots([("allow", mx.zeros((B, V), dtype=mx.float32))], B, V) is None
    assert gpu._edit_slots([("penalties", bias)], B, V) is None


def bias_and_mask(seed: int, x: np.ndarray, V: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(B, a bias a row, a mask a row keeping each row's maximum with and without the bias)."""
    rng = np.random.default_rng(seed)
    B = x.shape[0] if x.ndim == 2 else 1
    b = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    m = rng.random((B, V)) < 0.6
    m[np.arange(B), np.argmax(np.broadcast_to(x, (B, V)) + b, axis=-1)] = True
    m[np.arange(B), np.argmax(np.broadcast_to(x, (B, V)), axis=-1)] = True
    return B, b, m


@pytest.mark.parametrize("seed,V,n,terminal,edit", [
    (70, 300, 3, "sample", "allow(em)"), (71, 500, 2, "sample", "logit_bias(eb)"),
    (72, 300, 3, "sample", "logit_bias(eb)\n    allow(em)"), (73, 1000, 1, "sample", "allow(em)\n    logit_bias(eb)")])
def test_interpreter_hands_allow_and_logit_bias_to_the_kernel(seed, V, n, terminal, edit, monkeypatch):
    """A program's allow and logit_bias right below its chain go to the kernel as its edits (the row below them as
    its x): a CUDA device faked, its kernel the emulated one; the outputs against -O0's, and the edits' own checks
    (a mask that leaves no token) still raised."""
    stages, src, kw, per_row, ops, x = chain_case(seed, V, 2, n, terminal)
    B, b, m = bias_and_mask(seed, x, V)
    kw.update(eb=b, em=m)
    src = src.replace("sampler s(", "sampler s(eb: bias, em: mask, ", 1).replace("{\n", "{\n    " + edit + "\n", 1)
    want = samplec.compile(src, opt_level=0)(x, **kw).to_dict()
    prog, got, calls = on_fake_cuda(src, x, kw, monkeypatch)
    assert calls and sorted(calls[0]) == sorted(("allow" if "allow" in e else "logit_bias") for e in edit.split("\n"))
    assert_outputs_equal(got, want, src)
    if "allow" in edit:
        kw["em"] = np.zeros_like(m)
        with pytest.raises(samplec.SamplecError, match="allow"):
            prog(x, **kw)


def penalty_case(seed: int, V: int, B: int, H: int, shared: bool):
    """A history of H entries a row (or one for every row) that repeats tokens and pads with -1, and the penalties'
    operands (one value a row, or one), as a server passes them."""
    rng = np.random.default_rng(seed)
    R = 1 if shared else B
    hist = rng.integers(0, V, (R, H)).astype(np.int32)
    hist[:, 1::3] = hist[:, ::3][:, :hist[:, 1::3].shape[1]]          # (repeats)
    hist[rng.random((R, H)) < 0.15] = -1                                # (padding)
    ops = dict(last_n=rng.choice([-1, 0, 1, 3, H, H + 7], B).astype(np.int32),
               rep=rng.choice([1.0, 1.1, 1.5, 0.7], B).astype(np.float32),
               freq=rng.choice([0.0, 0.5, -0.25, 1.25], B).astype(np.float32),
               pres=rng.choice([0.0, 0.4, -1.0, 2.0], B).astype(np.float32))
    return hist, ops


PENALTIES = [(s, V, B, n, term, H, shared, bias, split) for s, (V, B, n, term, H, shared, bias, split) in enumerate(
    [(300, 2, 3, "sample", 40, False, None, (0, 0)), (300, 3, 2, "greedy", 9, True, None, (0, 0)),
     (1000, 2, 3, "sample", 200, False, "before", (0, 0)), (1000, 3, 2, "sample", 64, False, "after", (0, 0)),
     (500, 2, 0, "greedy", 30, False, "after", (0, 0)), (300, 2, 3, "sample", 50, False, "before", (3, 16)),
     (1000, 2, 2, "greedy", 120, True, "after", (4, 64)), (7, 2, 2, "sample", 5, False, None, (0, 0)),
     (3000, 1, 3, "sample", 300, False, "after", (5, 256)), (300, 2, 2, "sample", 1, False, None, (2, 32)),
     (3000, 2, 2, "sample", 5000, False, "before", (0, 0)), (3000, 3, 2, "greedy", 4500, True, None, (3, 64))],
    start=1300)]


@pytest.mark.parametrize("seed,V,B,n,terminal,H,shared,bias,split", PENALTIES)
def test_emulated_penalties_in_the_kernel_equal_O0(seed, V, B, n, terminal, H, shared, bias, split):
    """The penalties counted per row in the kernel from the history (repeats, padding, last_n -1, 0, past the
    history's length; windows that fit shared memory and windows past it; repeat, frequency and presence one a
    row), with a logit_bias before or after them and an allow, one block a row and split: against -O0's
    `penalties(h, ...)` in front of the same chain."""
    stages, src, kw, per_row, ops, x = chain_case(seed, V, B, n, terminal)
    hist, pk = penalty_case(seed, V, B, H, shared)
    rng = np.random.default_rng(seed + 1)
    b = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    m = rng.random((B, V)) < 0.7
    m[np.arange(B), np.argmax(np.broadcast_to(x, (B, V)), axis=-1)] = True
    m[:, :V // 3] = True            # (the history's tokens mostly kept: the penalties decide)
    if bias is None:
        b[:] = 0.0
    pen = ("penalties", (mx.array(hist), mx.array(pk["last_n"]), mx.array(pk["rep"]), mx.array(pk["freq"]),
                         mx.array(pk["pres"])))
    edits = [("allow", mx.array(m)), pen]
    body = ["allow(em)", "penalties(h, last_n = ln, repeat = rp, frequency = fq, presence = ps)"]
    if bias == "before":
        edits.insert(0, ("logit_bias", mx.array(b)))
        body.insert(0, "logit_bias(eb)")
    elif bias == "after":
        edits.append(("logit_bias", mx.array(b)))
        body.append("logit_bias(eb)")
    kw.update(em=m, eb=b, h=np.broadcast_to(hist, (B, H)).copy(), ln=pk["last_n"], rp=pk["rep"], fq=pk["freq"],
              ps=pk["pres"])
    src = src.replace("sampler s(", "sampler s(em: mask, eb: bias, h: tokens, ln: int, rp: float, fq: float, "
                      "ps: float, ", 1).replace("{\n", "{\n" + "".join(f"    {s}\n" for s in body), 1)
    o0 = samplec.compile(src, opt_level=0)(x, **kw)
    tok, lp, flag, _ = kernel(x, ops, stages, terminal, split=split, edits=tuple(edits))
    assert tok.tolist() == np.array(o0.token).tolist(), src
    np.testing.assert_allclose(lp, np.array(o0.logprob), atol=2e-4, rtol=1e-4, err_msg=src)
    assert flag.shape == (B, 1) and not flag.any(), src          # (the check: -O0 raised nothing)
    # the edited row itself (the final logits of no stage) against the spec's penalties in numpy
    _, _, final, _, top = kernel(x, [], [], "greedy", out_x=1, split=split, edits=tuple(edits))
    pen_row = penalized_rows(x, hist, pk, b if bias else None, bias, m)
    np.testing.assert_array_equal(final, pen_row)
    np.testing.assert_array_equal(top[:, 0], pen_row.max(-1))          # (the edited row's maximum)


@pytest.mark.parametrize("split", [(0, 0), (3, 16)])
@pytest.mark.parametrize("allow_after", [False, True])
def test_emulated_penalties_check_in_the_kernel(split, allow_after):
    """The penalties' check from the kernel (penalties_overflow: a penalized logit at +inf or NaN, or the penalized
    row left with no value above -inf) against -O0's, row by row: a frequency that sends a repeated token to +inf, one
    that sends every kept token to -inf, and rows that pass; the allow below or above the penalties (the check reads
    the row between)."""
    B, V, H = 4, 300, 12
    rng = np.random.default_rng(7)
    x = rng.standard_normal((B, V)).astype(np.float32)
    hist = np.tile(np.arange(H, dtype=np.int32), (B, 1))
    hist[:, H // 2:] = hist[:, :H // 2]                 # (every token of the window twice)
    m = np.ones((B, V), bool)
    m[3, H // 2:] = False                               # (row 3 keeps only the history's tokens)
    freq = np.array([0.5, -3e38, 0.0, 3e38], np.float32)
    pk = dict(last_n=np.full(B, -1, np.int32), rep=np.ones(B, np.float32), freq=freq, pres=np.zeros(B, np.float32))
    pen = ("penalties", (mx.array(hist), mx.array(pk["last_n"]), mx.array(pk["rep"]), mx.array(freq),
                         mx.array(pk["pres"])))
    edits = (pen, ("allow", mx.array(m))) if allow_after else (("allow", mx.array(m)), pen)
    _, _, flag, _ = kernel(x, [], [], "greedy", split=split, edits=edits)
    body = "allow(em)\n    penalties(h, frequency = fq)" if not allow_after else \
        "penalties(h, frequency = fq)\n    allow(em)"
    src = f"sampler s(em: mask, h: tokens, fq: float) -> token {{\n    {body}\n    greedy()\n}}"
    prog = samplec.compile(src, opt_level=0)
    want = []
    for r in range(B):
        try:
            prog(x[r:r + 1], em=m[r:r + 1], h=hist[r:r + 1], fq=freq[r:r + 1])
            want.append(False)
        except samplec.SamplecError as e:
            want.append("penalt" in str(e))
    # row 3: allow first, every kept token to -inf (the check fires); allow after, the row between keeps the rest
    assert flag[:, 0].tolist() == want == [False, True, False, not allow_after]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("edited", [False, True])
def test_emulated_kernel_gives_the_logits_maximum_and_log_sum_exp(split, edited):
    """The logits' own maximum and log-sum-exp from the kernel (raw_logprob's and top_logprobs' normalizer, the
    logits checks' maximum), before the edits, against numpy: a row with a -inf tail, one with a NaN (the maximum is
    NaN, as MLX's reduction gives it), one with +inf, one all -inf; one block a row and split over blocks (each
    block's part combined by the row's last)."""
    B, V = 5, 3000
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((B, V)) * 4).astype(np.float32)
    x[1, 40:] = -np.inf
    x[2, 2500] = np.nan
    x[3, 17] = np.inf
    x[4] = -np.inf
    bias = (rng.standard_normal((1, V)) * 50).astype(np.float32)
    edits = (("logit_bias", mx.array(bias)),) if edited else ()
    out = kernel(x, [], [], "greedy", split=gpu_split(B, V) if split else (0, 0), threads=block(), edits=edits,
                 raw=True)
    m, lz, at = out[-3][:, 0], out[-2][:, 0], out[-1][:, 0]
    np.testing.assert_array_equal(at, x[np.arange(B), out[0]])       # (the logit at the token: raw_logprob's)
    want_m = x.max(axis=-1)
    assert np.isnan(m[2]) and m[3] == np.inf and m[4] == -np.inf
    np.testing.assert_array_equal(m[[0, 1]], want_m[[0, 1]])
    want_lz = np.log(np.exp((x[:2] - want_m[:2, None]).astype(np.float64)).sum(-1))
    np.testing.assert_allclose(lz[:2], want_lz, rtol=2e-6, atol=2e-6)
    if split:
        assert gpu_split(B, V)[0] > 1


def penalized_rows(x, hist, pk, b, where, m):
    """The spec's penalties (section 2) in numpy, float32, with the bias before or after and the mask."""
    B, V = x.shape
    out = np.broadcast_to(x, (B, V)).astype(np.float32).copy()
    if where == "before":
        out = (out + b).astype(np.float32)
    for r in range(B):
        h = hist[0 if hist.shape[0] == 1 else r]
        n = int(pk["last_n"][r])
        window = h if n == -1 else h[max(0, len(h) - n):] if n > 0 else h[:0]
        ids, counts = np.unique(window[window >= 0], return_counts=True)
        rep, freq, pres = (np.float32(pk[k][r]) for k in ("rep", "freq", "pres"))
        for t, c in zip(ids, counts):
            v = out[r, t]
            v = v / rep if v > 0 else v * rep
            out[r, t] = np.float32(v - np.float32(np.float32(c) * freq + pres))
    if where == "after":
        out = (out + b).astype(np.float32)
    out[~np.broadcast_to(m, (B, V))] = -np.inf
    return out


@pytest.mark.parametrize("seed,V,n,terminal,edit", [
    (80, 300, 3, "sample", "penalties(h, last_n = 8, repeat = 1.3, frequency = fq)"),
    (81, 500, 2, "greedy", "logit_bias(eb)\n    penalties(h, repeat = 1.2, presence = 0.5)"),
    (82, 300, 3, "sample", "penalties(h, frequency = fq, presence = 0.25)\n    logit_bias(eb)\n    allow(em)"),
    (83, 1000, 1, "sample", "allow(em)\n    penalties(h, last_n = 20, repeat = 1.1)")])
def test_interpreter_hands_penalties_to_the_kernel(seed, V, n, terminal, edit, monkeypatch):
    """A program's penalties (with a logit_bias before or after, an allow) below its chain go to the kernel as its
    edits, the logits below them as its x: a CUDA device faked, its kernel the emulated one; the outputs against
    -O0's, and the penalties' own check (a frequency that overflows a logit) still raised."""
    stages, src, kw, per_row, ops, x = chain_case(seed, V, 2, n, terminal)
    B, b, m = bias_and_mask(seed, x, V)
    hist, _ = penalty_case(seed, V, B, 30, False)
    kw.update(eb=b, em=m, h=hist, fq=np.array([0.5, -0.75][:B], np.float32))
    src = src.replace("sampler s(", "sampler s(eb: bias, em: mask, h: tokens, fq: float, ", 1).replace(
        "{\n", "{\n    " + edit + "\n", 1)
    want = samplec.compile(src, opt_level=0)(x, **kw).to_dict()
    prog, got, calls = on_fake_cuda(src, x, kw, monkeypatch)
    assert calls and "penalties" in calls[0], calls
    assert_outputs_equal(got, want, src)
    if "fq" in edit:
        kw["fq"] = np.array([-3e38, -3e38][:B], np.float32)        # (a repeated token's logit to +inf)
        kw["h"][:, -2:] = kw["h"][:, -3:-2]
        for p in (prog, samplec.compile(src, opt_level=0)):
            with pytest.raises(samplec.SamplecError, match="penalt"):
                p(x, **kw)


from test_targets import EXAMPLE_SAMPLERS, ROOT, example_args  # noqa: E402


@pytest.mark.parametrize("example,sampler", EXAMPLE_SAMPLERS, ids=[f"{e}:{s}" for e, s in EXAMPLE_SAMPLERS])
def test_every_example_runs_its_chain_in_the_kernel(example, sampler, monkeypatch):
    """Every shipped example on the cuda target (a CUDA device faked, its kernel the emulated one): its chain is a
    region the kernel runs -- with the edits it takes; greedy right after the penalties (hf_greedy) is a chain of no
    stage -- and the outputs equal -O0's, on logits with a tail and every
    parameter one value a row. A chain the target pass leaves to the portable lowering fails here."""
    src = (ROOT / "examples" / example).read_text()
    prog0 = samplec.compile(src, sampler, opt_level=0)
    x, kw = example_args(prog0, B=2, V=600, seed=len(sampler))
    want = prog0(x, **kw).to_dict()
    calls = []

    fake = emulated_sample_chain(calls)

    fake_cuda(monkeypatch)
    monkeypatch.setattr(gpu, "sample_chain", fake)
    prog = samplec.compile(src, sampler, target="cuda")
    got = prog(x, **kw).to_dict()
    assert_outputs_equal(got, want, f"{example}:{sampler}")
    assert [r.kernel for r in prog.graph.regions] == ["cuda.chain"] and calls, prog.kernel_trace()
    assert ("cuda.chain", "kernel") in prog.kernel_trace()
    pen = dict(prog.graph.regions[0].attrs).get("edits", ())
    if len(pen) == 1:               # (one penalties stage: the kernel counts them and gives their check)
        assert "penalties" in calls[0], calls
        assert "penalties_overflow" in [n.op for n in prog.graph.regions[0].nodes]


@pytest.mark.parametrize("seed", range(5000, 5016))
def test_edits_in_random_orders_through_the_kernel_equal_O0(seed, monkeypatch):
    """penalties, logit_bias and allow in a random order below a random chain, random outputs (raw_logprob,
    top_logprobs, probs), one value a row: the cuda target through the emulated kernel (a CUDA device faked) gives
    -O0's outputs, or the same error."""
    rng = np.random.default_rng(seed)
    V, n = int(rng.choice([7, 64, 300, 1000])), int(rng.integers(0, 4))
    stages, src, kw, per_row, ops, x = chain_case(seed, V, 2, n, str(rng.choice(["sample", "greedy"])))
    B = 2
    hist, pk = penalty_case(seed, V, B, int(rng.integers(1, 60)), bool(rng.integers(0, 2)))
    m = rng.random((B, V)) < 0.7
    m[np.arange(B), np.argmax(np.broadcast_to(x, (B, V)), -1)] = True
    parts = ["penalties(h, last_n = ln, repeat = rp, frequency = fq, presence = ps)"] + \
        [p for p in ("logit_bias(eb)", "allow(em)") if rng.random() < 0.6]
    rng.shuffle(parts)
    kw.update(em=m, eb=(rng.standard_normal((B, V)) * 2).astype(np.float32),
              h=np.broadcast_to(hist, (B, hist.shape[1])), ln=pk["last_n"], rp=pk["rep"], fq=pk["freq"], ps=pk["pres"])
    outs = str(rng.choice(["token, logprob", "token, logprob, raw_logprob", "token, logprob, top_logprobs(3)",
                           "token, logprob, probs"]))
    src = src.replace("-> token, logprob", f"-> {outs}").replace(
        "sampler s(", "sampler s(em: mask, eb: bias, h: tokens, ln: int, rp: float, fq: float, ps: float, ", 1).replace(
        "{\n", "{\n" + "".join(f"    {p}\n" for p in parts), 1)

    def run(prog):
        try:
            return prog(x, **kw).to_dict()
        except samplec.SamplecError as e:
            return str(e).splitlines()[0]

    want = run(samplec.compile(src, opt_level=0))

    fake = emulated_sample_chain()

    fake_cuda(monkeypatch)
    monkeypatch.setattr(gpu, "sample_chain", fake)
    got = run(samplec.compile(src, target="cuda"))
    if isinstance(want, str) or isinstance(got, str):
        assert got == want, src
    else:
        assert_outputs_equal(got, want, src)


STACKS = [(s, V, B, n, term, H, k, where, split) for s, (V, B, n, term, H, k, where, split) in enumerate(
    [(300, 2, 2, "sample", 40, 2, "before", (0, 0)), (1000, 3, 3, "sample", 120, 3, "after", (3, 64)),
     (500, 2, 0, "greedy", 30, 4, "before", (0, 0)), (300, 2, 2, "greedy", 25, 3, "after", (2, 32)),
     (3000, 1, 3, "sample", 5000, 2, "after", (0, 0))], start=1400)]


@pytest.mark.parametrize("seed,V,B,n,terminal,H,k,where,split", STACKS)
def test_emulated_penalties_stages_in_a_row_equal_O0(seed, V, B, n, terminal, H, k, where, split):
    """Up to four penalties stages over one history (each its own last_n, repeat, frequency and presence, one value
    a row) as the server chain writes them, with an allow and a logit_bias before or after them: the kernel against
    -O0, and each stage's check against the rows -O0 raises on (a frequency that overflows one stage's logits)."""
    stages, src, kw, per_row, ops, x = chain_case(seed, V, B, n, terminal)
    rng = np.random.default_rng(seed)
    hist, _ = penalty_case(seed, V, B, H, False)
    m = rng.random((B, V)) < 0.7
    m[np.arange(B), np.argmax(np.broadcast_to(x, (B, V)), -1)] = True
    m[:, :V // 3] = True
    b = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    pens, names, body, h = [], [], [], mx.array(hist)
    for j in range(k):
        pk = penalty_case(seed + 10 * j, V, B, H, False)[1]
        pens.append(("penalties", (h, *(mx.array(pk[n]) for n in ("last_n", "rep", "freq", "pres")))))
        names.append(f"ln{j}: int, rp{j}: float, fq{j}: float, ps{j}: float")
        body.append(f"penalties(h, last_n = ln{j}, repeat = rp{j}, frequency = fq{j}, presence = ps{j})")
        kw.update({f"ln{j}": pk["last_n"], f"rp{j}": pk["rep"], f"fq{j}": pk["freq"], f"ps{j}": pk["pres"]})
    edits = [("allow", mx.array(m)), ("logit_bias", mx.array(b))]
    edits = edits + pens if where == "before" else pens + edits
    body = ["allow(em)", "logit_bias(eb)"] + body if where == "before" else body + ["allow(em)", "logit_bias(eb)"]
    kw.update(em=m, eb=b, h=hist)
    src = src.replace("sampler s(", f"sampler s(em: mask, eb: bias, h: tokens, {', '.join(names)}, ", 1).replace(
        "{\n", "{\n" + "".join(f"    {s}\n" for s in body), 1)
    o0 = samplec.compile(src, opt_level=0)(x, **kw)
    tok, lp, flags, _ = kernel(x, ops, stages, terminal, split=split, edits=tuple(edits))
    assert tok.tolist() == np.array(o0.token).tolist(), src
    np.testing.assert_allclose(lp, np.array(o0.logprob), atol=2e-4, rtol=1e-4, err_msg=src)
    assert flags.shape == (B, k) and not flags.any(), src
    # one stage's frequency overflowing the logits of a repeated token (to +inf) in row 0: that stage's check alone
    j = k - 1
    bad = np.array(kw[f"fq{j}"])
    bad[0] = -3e38
    kw[f"fq{j}"], kw[f"ln{j}"] = bad, np.full(B, -1, np.int32)
    kw["h"] = hist.copy()
    kw["h"][0, -2:] = 0                             # (token 0 twice in the window)
    h = mx.array(kw["h"])
    edits = [e if e[0] != "penalties" else ("penalties", (h,) + e[1][1:]) for e in edits]
    last = [i for i, e in enumerate(edits) if e[0] == "penalties"][-1]
    edits[last] = ("penalties", (edits[last][1][0], mx.array(kw[f"ln{j}"]), edits[last][1][2], mx.array(bad),
                                 edits[last][1][4]))
    _, _, flags, _ = kernel(x, ops, stages, terminal, split=split, edits=tuple(edits))
    with pytest.raises(samplec.SamplecError, match="penalt"):
        samplec.compile(src, opt_level=0)(x, **kw)
    assert flags[:, :j].sum() == 0 and flags[:, j].tolist() == [True] + [False] * (B - 1), src


def test_the_server_chain_runs_in_the_kernel(monkeypatch):
    """`samplec serve`'s chain (an allow, three penalties stages over the request's history, the stages, raw_logprob
    and top_logprobs): on the cuda target (a CUDA device faked, its kernel the emulated one) the allow and the three
    stages go into the kernel with their checks, and the outputs equal -O0's."""
    from samplec.serve import SERVER_CHAIN, TOP
    src = SERVER_CHAIN.replace("TOP", str(TOP))
    prog0 = samplec.compile(src, opt_level=0)
    x, kw = example_args(prog0, B=3, V=700, seed=3)
    kw.update(temperature=np.array([0.7, 1.0, 0.0], np.float32), top_p=np.array([0.9, 1.0, 0.8], np.float32),
              top_k=np.array([0, 40, 5], np.int32), min_p=np.array([0.05, 0.0, 0.1], np.float32),
              repetition_penalty=np.array([1.1, 1.0, 1.3], np.float32),
              presence_penalty=np.array([0.5, 0.0, -0.5], np.float32),
              frequency_penalty=np.array([0.25, 1.0, 0.0], np.float32),
              repetition_context_size=np.array([20, 64, 5], np.int32),
              frequency_context_size=np.array([3, 20, -1], np.int32))
    want = prog0(x, **kw).to_dict()
    calls = []
    fake_cuda(monkeypatch)
    monkeypatch.setattr(gpu, "sample_chain", emulated_sample_chain(calls))
    prog = samplec.compile(src, target="cuda")
    got = prog(x, **kw).to_dict()
    assert_outputs_equal(got, want, "server chain")
    assert calls and calls[0] == ("allow", "penalties", "penalties", "penalties"), calls
    region = prog.graph.regions[0]
    assert [n.op for n in region.nodes].count("penalties_overflow") == 3


@pytest.mark.parametrize("split", [(0, 0), (3, 32)])
@pytest.mark.parametrize("shared_first", [False, True])
def test_emulated_penalties_over_two_histories_equal_O0(split, shared_first):
    """vLLM's chain: a repetition penalty over the prompt and the output, then frequency and presence over the output
    alone (two histories side by side in the kernel's row, one of them shared by every row or not), against -O0."""
    B, V = 3, 400
    stages, src, kw, per_row, ops, x = chain_case(1500 + int(shared_first), V, B, 2, "sample")
    rng = np.random.default_rng(9)
    prompt = rng.integers(0, V, (1 if shared_first else B, 50)).astype(np.int32)
    out = rng.integers(0, V // 4, (B, 12)).astype(np.int32)
    out[:, ::4] = -1
    both = np.concatenate([np.broadcast_to(prompt, (B, 50)), out], axis=1)
    rp, fq, ps = (np.array(v, np.float32) for v in ([1.2, 1.0, 0.8], [0.5, -0.2, 1.5], [0.3, 0.0, -1.0]))
    hb, ho = mx.array(both if not shared_first else prompt), mx.array(out)
    if shared_first:        # (the prompt alone, shared: the first stage's own history)
        both = np.broadcast_to(prompt, (B, 50)).copy()
    edits = (("penalties", (hb, mx.array(-1, dtype=mx.int32), mx.array(rp), mx.array(np.float32(0)),
                            mx.array(np.float32(0)))),
             ("penalties", (ho, mx.array(-1, dtype=mx.int32), mx.array(np.float32(1)), mx.array(fq), mx.array(ps))))
    tok, lp, flags, _ = kernel(x, ops, stages, "sample", split=split, edits=edits)
    body = "penalties(hb, repeat = rp)\n    penalties(ho, frequency = fq, presence = ps)\n"
    src = src.replace("sampler s(", "sampler s(hb: tokens, ho: tokens, rp: float, fq: float, ps: float, ", 1).replace(
        "{\n", "{\n    " + body, 1)
    o0 = samplec.compile(src, opt_level=0)(x, **kw, hb=both, ho=out, rp=rp, fq=fq, ps=ps)
    assert tok.tolist() == np.array(o0.token).tolist(), src
    np.testing.assert_allclose(lp, np.array(o0.logprob), atol=2e-4, rtol=1e-4, err_msg=src)
    assert flags.shape == (B, 2) and not flags.any()


def test_the_chain_kernels_first_compile_is_announced_once_and_named_as_mlx_keeps_it(tmp_path, monkeypatch, capsys):
    """NVRTC takes minutes over the chain kernel: where MLX's cache (MLX_PTX_CACHE_DIR) does not hold it under the
    name the kernel is made with, its first use says so on stderr (and `samplec doctor` says whether it is built);
    once the cache holds it, nothing is said."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    made = {}
    monkeypatch.setattr(gpu, "_kernels", {})
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.update(kw) or "kernel", raising=False)
    gpu._kernel("samplec_chain", gpu.INPUT_NAMES, gpu.CHAIN_BODY, gpu.CHAIN_OUTPUTS, gpu.chain_header())
    gpu._kernel("samplec_chain", gpu.INPUT_NAMES, gpu.CHAIN_BODY, gpu.CHAIN_OUTPUTS, gpu.chain_header())
    assert made["name"] == gpu.chain_kernel_name()
    err = capsys.readouterr().err
    assert err.count("compiling the CUDA chain kernel with NVRTC") == 1 and str(tmp_path) in err
    (tmp_path / f"custom_kernel_{made['name']}.ptx").write_bytes(b"")
    monkeypatch.setattr(gpu, "_kernels", {})
    gpu._kernel("samplec_chain", gpu.INPUT_NAMES, gpu.CHAIN_BODY, gpu.CHAIN_OUTPUTS, gpu.chain_header())
    assert capsys.readouterr().err == "" and gpu.first_compile_notice(made["name"]) is None
