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
