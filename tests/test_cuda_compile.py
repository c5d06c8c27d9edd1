"""The CUDA kernels' sources (the chain kernel: its one source in the CUDA dialect, simt_cuda.h) compiled by NVRTC
(NVIDIA's runtime compiler, the `nvidia-cuda-nvrtc` wheel of the cuda extra) for the GPUs MLX's CUDA backend
targets -- no GPU needed: a syntax or type error in a path only a GPU runs fails here, in CI, not on a user's
machine; and each kernel's register count must let its block size launch (65,536 registers per SM: a block of 512
threads may use 128 a thread, of 1024 64). MLX wraps a kernel's body in its own signature and headers; the wrapper
below declares the same parameters."""
from __future__ import annotations

import ctypes
import importlib.util
import struct
from pathlib import Path

import pytest

from samplec.backend_mlx import gpu


def _nvrtc():
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for lib in sorted(Path(root).glob("*/lib/libnvrtc.so*")):
            if "builtins" not in lib.name:
                return ctypes.CDLL(str(lib))
    return None


NVRTC = _nvrtc()
pytestmark = pytest.mark.skipif(NVRTC is None, reason="no NVRTC (the cuda extra's nvidia-cuda-nvrtc, Linux x86-64)")


def compile_cubin(source: str, arch: str) -> bytes:
    """The source compiled to a cubin for `arch` (sm_XX: NVRTC's front end, NVVM and ptxas -- what MLX's CUDA
    backend runs the first time a machine meets the kernel)."""
    prog = ctypes.c_void_p()
    assert NVRTC.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"samplec.cu", 0, None, None) == 0
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"-default-device"]
    rc = NVRTC.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    NVRTC.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode()
    NVRTC.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    out = ctypes.create_string_buffer(n.value)
    NVRTC.nvrtcGetCUBIN(prog, out)
    NVRTC.nvrtcDestroyProgram(ctypes.byref(prog))
    return out.raw


def registers(cubin: bytes) -> list[int]:
    """Each kernel's register count: EIATTR_REGCOUNT (0x2f) entries of the ELF's .nv.info sections."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    size, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * size) for i in range(count)]
    strtab = sections[names][4]
    found = []
    for sh in sections:
        name = cubin[strtab + sh[0]:cubin.index(b"\0", strtab + sh[0])]
        if not name.startswith(b".nv.info"):
            continue
        at, end = sh[4], sh[4] + sh[5]
        while at < end:
            fmt, attr = cubin[at], cubin[at + 1]
            if fmt == 4:                                   # (EIFMT_SVAL: a 16-bit size, then the value)
                n, = struct.unpack_from("<H", cubin, at + 2)
                if attr == 0x2F:
                    found.append(struct.unpack_from("<II", cubin, at + 4)[1])
                at += 4 + n
            else:
                at += 4
    return found


def chain_source() -> str:
    """The chain kernel under the signature MLX writes (every float slot float: an integer operand comes as its
    bits)."""
    return (gpu.chain_header() + '\nextern "C" __global__ void samplec_chain(const float* x, const int* x_shape, ' +
            "".join(f"const float* F{i}, " for i in range(gpu.CHAIN_FLOAT_SLOTS)) +
            "".join(f"const unsigned long long* K{i}, " for i in range(gpu.CHAIN_KEY_SLOTS)) +
            "".join(f"const int* Q{i}, " for i in range(gpu.CHAIN_KEY_SLOTS)) +
            "const float* EB, const bool* EM, const int* EW, const int* PH, const int* PH_shape, const float* PV, " +
            "const int* S, int* tok, float* lp, float* xo, bool* pf, float* rs, int* ws) {\n" + gpu.CHAIN_BODY + "}\n")


KERNELS = {
    "chain": (chain_source(), gpu.CHAIN_THREADS),
    "kth_largest": ('extern "C" __global__ void samplec_kth_largest(const float* x, const int* x_shape, const int* k, '
                    "float* out) {\n" + gpu._KTH_SOURCE + "}\n", gpu.THREADS),
    "top_logprobs": (gpu.top_logprobs_header() + '\nextern "C" __global__ void samplec_top_logprobs(const float* x, '
                     "const int* x_shape, const float* m, const float* lz, const int* K, int* ids, float* vals) {\n" +
                     gpu.top_logprobs_entry("cuda") + "}\n", gpu.CHAIN_THREADS),
    "dry": (gpu.dry_header() + '\nextern "C" __global__ void samplec_dry(const float* x, const int* x_shape, '
            "const int* h, const int* h_shape, const float* mult, const float* base, const int* allowed, "
            "const int* last_n, const bool* brk, const int* n, "
            "float* out, int* rep, int* win) {\n" + gpu.dry_entry("cuda") + "}\n", gpu.CHAIN_THREADS),
}


ARCHS = ("sm_80", "sm_90")


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_cuda_kernel_compiles_and_fits_its_block(kernel):
    """For each architecture (A100's, H100's), compiled side by side (NVRTC runs outside the GIL)."""
    from concurrent.futures import ThreadPoolExecutor
    source, threads = KERNELS[kernel]
    archs = ARCHS
    with ThreadPoolExecutor(len(archs)) as pool:
        cubins = dict(zip(archs, pool.map(lambda arch: compile_cubin(source, arch), archs)))
    for arch, cubin in cubins.items():
        regs = registers(cubin)
        assert regs, ("no register count in the cubin", arch)
        assert max(regs) <= 65536 // threads, (kernel, arch, regs, threads)
