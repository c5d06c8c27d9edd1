"""The chain kernel's one source in its two dialects (samplec/backend_mlx/gpu_chain.cu over simt_cuda.h or
simt_metal.h), checked where no GPU is: the source names nothing of either language outside the dialect layer;
the Metal dialect's address spaces type-check (clang's address_space attributes standing for Metal's device,
constant and threadgroup memory, under the signature MLX's metal_kernel writes); each dialect's shared state fits
its GPU; the Metal build's opt-in and its fallbacks (`samplec doctor`'s report). tests/test_gpu_chain.py runs both
dialects on the CPU against the dense definitions; tests/test_cuda_compile.py compiles the CUDA one with NVRTC.
Nothing here runs on Apple hardware: Metal's own compiler, its expf/logf and its timing are unchecked."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from samplec.backend_mlx import gpu
from test_gpu_chain import CXX, HERE, INPUTS, metal_attributes, source

CLANG = shutil.which("clang++") or shutil.which("clang++-14") or shutil.which("clang++-15")


def test_kernel_source_names_no_language_outside_the_dialect_layer():
    """gpu_chain.cu: no CUDA names, no Metal names, no lambdas (Metal has none), no double (Metal has none)."""
    text = gpu.CHAIN_SOURCE.read_text()
    code = "\n".join(line.split("//")[0] for line in text.splitlines())
    for name in ("__syncthreads", "__shfl", "threadIdx", "blockIdx", "__device__", "__shared__", "atomicAdd",
                 "__threadfence", "__fdiv_rn", "__float_as", "__int_as", "threadgroup_barrier", "simd_shuffle",
                 "metal::", "[&]", "[=]", "double", "expf(", "logf(", "nextafterf", "make_float4"):
        assert name not in code, name
    # Metal has no 64-bit `long long` (its 64-bit integers are long and ulong): neither the body nor the entries
    # name it, nor an `ull` literal
    for text in (code, gpu.CHAIN_ENTRY):
        assert not re.search(r"long\s+long|\b0x[0-9a-fA-F]+ull\b|\b[0-9]+ull\b", text, re.I)
    # every pointer or reference parameter names its address space (Metal needs one)
    for m in re.finditer(r"\b(SC_FN|SC_INLINE)\b[^;{]*?\(([^)]*)\)\s*(const\s*)?\{", code):
        for param in m.group(2).split(","):
            if re.search(r"[*&]\s*\w+\s*$", param.strip()):
                assert re.search(r"\bSC_(DEV|TG|THR)\b", param), (param.strip(), m.group(0)[:80])


def test_dialect_entries_differ_only_in_their_fields():
    """One body text (gpu.CHAIN_ENTRY): with its dialect fields left out it names neither language; each dialect's
    entry is that text with its fields."""
    neutral = gpu.CHAIN_ENTRY.format(**{field: f"<{field}>" for field in gpu.DIALECTS["cuda"]})
    for name in ("threadIdx", "blockIdx", "__shared__", "threadgroup", "thread_position", "simdgroup", "device ",
                 "__global__", "[[", "cuda", "metal"):
        assert name not in neutral, name
    for dialect, fields in gpu.DIALECTS.items():
        assert fields.keys() == gpu.DIALECTS["cuda"].keys()
        assert gpu.chain_entry(dialect) == gpu.CHAIN_ENTRY.format(**fields)
    assert gpu.CHAIN_BODY == gpu.chain_entry("cuda")


def test_metal_entry_declares_its_attributes():
    """MLX's metal_kernel declares the attributes whose names the body contains: the thread's index in its
    threadgroup, the threadgroup's in the grid, the simdgroup's width -- and no other."""
    assert metal_attributes(gpu.chain_entry("metal")) == [
        "uint3 thread_position_in_threadgroup", "uint3 threadgroup_position_in_grid", "uint threads_per_simdgroup"]
    assert "x_shape" in gpu.chain_entry("metal")


@pytest.mark.skipif(CLANG is None, reason="no clang++ to check the Metal dialect's address spaces")
@pytest.mark.parametrize("small", [False, True])
def test_metal_dialect_address_spaces(small, tmp_path):
    """The Metal dialect type-checks with device (1), constant (2) and threadgroup (3) memory as distinct address
    spaces, under MLX's signature: every input in device memory, or (small) the operand slots in the constant
    address space, as MLX passes inputs of fewer than eight elements."""
    sizes = {name: 1 if small and name[0] in "FKQ" else 100 for name in INPUTS}
    src = source("metal", 64, "#define SC_CHECK_ADDRESS_SPACES\n", sizes)
    (tmp_path / "metal.cpp").write_text(src)
    r = subprocess.run([CLANG, "-std=c++20", "-fsyntax-only", f"-I{HERE}", str(tmp_path / "metal.cpp")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.skipif(CLANG is None, reason="no clang++ to check the Metal dialect's address spaces")
def test_metal_address_space_check_fails_where_metal_would(tmp_path):
    """The check is not vacuous: a threadgroup array read through a plain pointer, a device row through a plain
    pointer, each fails it."""
    src = source("metal", 64, "#define SC_CHECK_ADDRESS_SPACES\n")
    for old, new in [("const SC_TG float* temps;", "const float* temps;"),
                     ("float sc_norm(const SC_DEV float* xr", "float sc_norm(const float* xr")]:
        assert old in src
        (tmp_path / "bad.cpp").write_text(src.replace(old, new, 1))
        r = subprocess.run([CLANG, "-std=c++20", "-fsyntax-only", f"-I{HERE}", str(tmp_path / "bad.cpp")],
                           capture_output=True, text=True)
        assert r.returncode != 0 and "error:" in r.stderr, new


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_shared_state_fits_each_gpu(tmp_path):
    """The block's shared state at each dialect's block size and candidates: within CUDA's 48 KB of static shared
    memory and Metal's 32 KB of threadgroup memory (the same struct layout: floats and ints)."""
    sizes = {}
    for dialect in ("cuda", "metal"):
        src = (f"#include <cstdio>\n#include \"{dialect}_emulation.h\"\n{gpu.chain_header(dialect)}\n"
               "int main() { std::printf(\"%zu %d %d\\n\", sizeof(ScShared), SC_T, SC_CAP); }\n")
        (tmp_path / f"{dialect}.cpp").write_text(src)
        subprocess.run([CXX, "-std=c++20", "-pthread", f"-I{HERE}", str(tmp_path / f"{dialect}.cpp"), "-o",
                        str(tmp_path / dialect)], check=True)
        size, threads, cap = map(int, subprocess.run([str(tmp_path / dialect)], capture_output=True, text=True,
                                                     check=True).stdout.split())
        assert (threads, cap) == (gpu.DIALECT_THREADS[dialect], gpu.DIALECT_CAP[dialect])
        sizes[dialect] = size
    assert sizes["cuda"] <= 48 * 1024 and sizes["metal"] <= 32 * 1024, sizes


def test_metal_build_is_opt_in_and_falls_back(monkeypatch):
    """On an Apple GPU (faked): without SAMPLEC_METAL_KERNEL the portable ops run and the report says how to opt
    in; with it, a build MLX refuses or a wrong check leaves the portable ops with the reason; a good check
    activates it. Elsewhere the report names the device."""
    monkeypatch.setattr(gpu, "available", lambda: False)
    monkeypatch.delenv("SAMPLEC_GPU_KERNELS", raising=False)
    monkeypatch.setattr(gpu, "apple_gpu", lambda: False)
    assert "not a CUDA GPU or an Apple GPU" in gpu.path_report()
    monkeypatch.setattr(gpu, "apple_gpu", lambda: True)
    monkeypatch.delenv("SAMPLEC_METAL_KERNEL", raising=False)
    ok, why = gpu.metal_status()
    assert not ok and "SAMPLEC_METAL_KERNEL=1" in why and "portable" in gpu.path_report()
    monkeypatch.setenv("SAMPLEC_METAL_KERNEL", "1")
    import mlx.core as mx

    def refuse(*a, **k):
        raise RuntimeError("program_source:12:3: error: unknown type name 'float4'")
    def top(ids):       # (top_logprobs' kernel: its answer on the check's row)
        return lambda: lambda **k: (mx.array([ids], dtype=mx.int32), mx.zeros((1, 3)))
    good = lambda *a, **k: (mx.array([[255]]), mx.array([[0.0]]))     # noqa: E731
    for fake, top_ids, want in [
            (refuse, [255, 254, 253], "MLX refused to build it: RuntimeError: program_source:12:3"),
            (lambda *a, **k: (mx.array([[-2]]), mx.array([[0.0]])), [255, 254, 253], "not 32 lanes wide"),
            (lambda *a, **k: (mx.array([[7]]), mx.array([[0.0]])), [255, 254, 253], "answered token 7"),
            (good, [255, 253, 254], "its top_logprobs check answered [255, 253, 254]"),
            (good, [255, 254, 253], "built and checked")]:
        monkeypatch.setattr(gpu, "_METAL", {})
        monkeypatch.setattr(gpu, "_metal_chain", fake)
        monkeypatch.setattr(gpu, "_metal_top_logprobs_kernel", top(top_ids))
        ok, why = gpu.metal_status()
        assert want in why and ok == (want == "built and checked"), why
        assert (want in gpu.path_report()) and (("portable target's MLX ops" in gpu.path_report()) != ok)
    monkeypatch.setenv("SAMPLEC_GPU_KERNELS", "0")
    assert gpu.metal_status() == (False, "off (SAMPLEC_GPU_KERNELS=0)")
