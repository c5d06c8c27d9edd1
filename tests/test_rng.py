"""RandomBits in MLX (samplec.backend_mlx.rng) against the known answers of spec §4 and MLX's own generator."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from samplec.backend_mlx.rng import key_words, random_bits, threefry2x32

try:
    from . import reference as R
except ImportError:  # pragma: no cover
    import reference as R

U32 = lambda v: mx.array(np.array(v, dtype=np.uint32))
U64 = lambda v: mx.array(np.array(v, dtype=np.uint64))


def test_known_answers():
    a = threefry2x32(U32(0), U32(0), U32(0), U32(0))
    assert [int(v) for v in a] == [0x6B200159, 0x99BA4EFE]
    f = 0xFFFFFFFF
    b = threefry2x32(U32(f), U32(f), U32(f), U32(f))
    assert [int(v) for v in b] == [0x1CB996FC, 0xBB002BE7]


@pytest.mark.parametrize("seed", [0, 1, 7, 12345, 2**32 - 1, 2**32, 2**40 + 3, 2**63, 2**64 - 1])
def test_key_is_mlx_random_key(seed):
    hi, lo = key_words(U64(seed))
    assert [int(hi), int(lo)] == np.array(mx.random.key(seed)).tolist()


@pytest.mark.parametrize("seed", [0, 3, 99, 2**33 + 5, 2**64 - 2])
def test_cross_check_with_mlx_uniform(seed):
    """mlx.random.uniform(shape=(2,), key=key(s))[0] is built from the first word at counter (0, 1)."""
    bits = np.uint32(int(random_bits(U64(seed), U32(0), U32(1))))
    expected = min(np.float32(bits) / np.float32(4294967295), np.nextafter(np.float32(1), np.float32(0)))
    got = np.array(mx.random.uniform(shape=(2,), key=mx.random.key(seed)))[0]
    assert got == expected


def test_vectorized_bits_match_the_reference():
    V, seeds, positions = 1000, [5, 2**63 + 9], [0, 17, 2**31]
    for s in seeds:
        for pos in positions:
            ours = np.array(random_bits(U64([[s]]), mx.arange(V).astype(mx.uint32), U32([[pos]])))[0]
            assert np.array_equal(ours, R.bits_for_tokens(s, pos, V))


def test_xtc_coin_counter():
    ours = int(random_bits(U64(11), U32(0xFFFFFFFF), U32(4)))
    u = ((ours >> 9) + 0.5) * 2.0 ** -23
    assert np.float32(u) == R.xtc_coin(11, 4)


# Threefry is written once per language: MLX ops (above), the CPU kernel's C++ (native/src/rng.h) and the GPU
# source (samplec/backend_mlx/gpu_chain.cu). Each is checked against spec section 4's known answers.
KNOWN = [((0, 0, 0, 0), (0x6B200159, 0x99BA4EFE)),
         ((0xFFFFFFFF,) * 4, (0x1CB996FC, 0xBB002BE7))]


def test_cpu_kernel_threefry_known_answers():
    native = pytest.importorskip("samplec_native")
    for (k0, k1, c0, c1), words in KNOWN:
        out = native.threefry_words(k0, k1, c0, c1)
        assert tuple(out[:2]) == words
        assert out[2:] == [words[0]] * 16          # the draws' sixteen-lane path, every lane
    with mx.stream(mx.cpu):                        # the primitive: key (seed >> 32, seed & 0xFFFFFFFF)
        bits = native.threefry_bits(U64([[0], [2**64 - 1]]), U32([[0], [0xFFFFFFFF]]), U32([[0], [0xFFFFFFFF]]))
    assert np.array(bits).ravel().tolist() == [0x6B200159, 0x1CB996FC]


def test_cpu_kernel_threefry_equals_mlx_on_many_counters():
    native = pytest.importorskip("samplec_native")
    rng = np.random.default_rng(3)
    for k0, k1, c0, c1 in rng.integers(0, 2**32, size=(40, 4), dtype=np.uint64).tolist():
        w0, w1 = threefry2x32(U32(k0), U32(k1), U32(c0), U32(c1))
        out = native.threefry_words(k0, k1, c0, c1)
        assert out[:2] == [int(w0), int(w1)] and out[2:] == [int(w0)] * 16


def _gpu_threefry():
    """The GPU source's sc_threefry, compiled for the CPU over the CUDA emulation the chain kernel's tests use."""
    import ctypes
    import os
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from samplec.backend_mlx import gpu
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the emulation")
    here = Path(__file__).parent
    out = Path(tempfile.mkdtemp(prefix="samplec_gpu_rng_"))
    (out / "rng.cpp").write_text(
        f"#define SC_T 64\n#include \"cuda_emulation.h\"\n{gpu.chain_header()}\n"
        "extern \"C\" unsigned first_word(unsigned k0, unsigned k1, unsigned c0, unsigned c1) {\n"
        "  return sc_threefry(k0, k1, c0, c1);\n}\n")
    subprocess.run([cxx, "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", f"-I{here}",
                    f"-I{here.parent / 'samplec' / 'backend_mlx'}", str(out / "rng.cpp"), "-o", str(out / "rng.so")],
                   check=True)
    fn = ctypes.CDLL(str(out / "rng.so")).first_word
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32] * 4
    return fn


def test_gpu_source_threefry_known_answers():
    fn = _gpu_threefry()
    for args, words in KNOWN:
        assert fn(*args) == words[0]
    rng = np.random.default_rng(4)
    for k0, k1, c0, c1 in rng.integers(0, 2**32, size=(40, 4), dtype=np.uint64).tolist():
        assert fn(k0, k1, c0, c1) == int(threefry2x32(U32(k0), U32(k1), U32(c0), U32(c1))[0])
