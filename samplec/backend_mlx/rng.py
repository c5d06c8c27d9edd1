"""RandomBits: Threefry-2x32 with 20 rounds (Random123), the generator behind MLX's `random::bits` (spec §4).

Written with MLX uint32 ops so it runs on any device and fuses under `mx.compile`; the key of a 64-bit seed is
`(seed >> 32, seed & 0xFFFFFFFF)`, exactly `mlx.core.random.key(seed)`.
"""
from __future__ import annotations

import mlx.core as mx

ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
PARITY = 0x1BD11BDA
FUSE_ROUNDS = 3


def _rotl(x: mx.array, r: int) -> mx.array:
    return (x << r) | (x >> (32 - r))


def threefry2x32(k0: mx.array, k1: mx.array, c0: mx.array, c1: mx.array) -> tuple[mx.array, mx.array]:
    """Both output words of Threefry-2x32-20 for key (k0, k1) and counter (c0, c1), all uint32, broadcasting.

    Every `FUSE_ROUNDS` rounds the two words are packed into one uint64 array behind a view (as int64):
    MLX's `compile` fuses at most ~11 levels of elementwise ops into one kernel and splits a two-word state into
    many small ones (37 kernels for the 20 rounds); one packed value per cut gives it clean boundaries (7 fused
    kernels; a view is no kernel of its own on any device -- without it, the
    packed uint64 value read twice fuses worse: 17 more launches a call of llama.smp's chain). The values are
    unchanged."""
    u = lambda v: mx.array(v, dtype=mx.uint32)
    # the key's third word, k0 ^ k1 ^ PARITY, written apart at each of its four uses (no two share a node, so MLX's
    # compile cannot merge them): a [B, 1] value read by several kernels is a kernel of its own, each use computed
    # in the kernel that reads it is none (xor is associative and commutative: the same bits)
    third = iter((lambda: (k0 ^ k1) ^ u(PARITY), lambda: (k0 ^ u(PARITY)) ^ k1, lambda: (k1 ^ u(PARITY)) ^ k0,
                  lambda: (k1 ^ k0) ^ u(PARITY)))
    ks = lambda j: k0 if j == 0 else k1 if j == 1 else next(third)()
    x0, x1 = c0 + k0, c1 + k1
    n = 0
    for i in range(5):
        for r in ROTATIONS[(i % 2) * 4:(i % 2) * 4 + 4]:
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
            n += 1
            if n % FUSE_ROUNDS == 0:
                # (int64 behind the view: an arithmetic shift sign-extends, and the conversion keeps the low word)
                packed = ((x0.astype(mx.uint64) << 32) | x1.astype(mx.uint64)).view(mx.int64)
                x0, x1 = (packed >> 32).astype(mx.uint32), packed.astype(mx.uint32)
        x0 = x0 + ks((i + 1) % 3)
        x1 = x1 + (ks((i + 2) % 3) + u(i + 1))
    # (the first word behind a view: the kernel that reads it -- the draw's noise, ~10 levels of its own -- starts
    # there, and MLX's compile does not split the last injection's key words into a kernel of their own)
    return x0.view(mx.int32).view(mx.uint32), x1


def key_words(seed: mx.array) -> tuple[mx.array, mx.array]:
    """A uint64 seed -> the (hi, lo) uint32 key words: views of its two halves (little-endian), so no kernel of
    their own (the shifts and masks they replace were two launches on a GPU)."""
    seed = seed if seed.dtype == mx.uint64 else seed.astype(mx.uint64)
    if seed.ndim and seed.shape[-1] == 1:   # (a seed per row [B, 1]: its words side by side, [B, 2] -- no reshape)
        words = seed.view(mx.uint32)
        return words[..., 1:2], words[..., 0:1]
    words = seed.reshape(*seed.shape, 1).view(mx.uint32)
    return words[..., 1], words[..., 0]


def random_bits(seed: mx.array, c0: mx.array, c1: mx.array) -> mx.array:
    """The first output word for counter (c0, c1) under key(seed)."""
    k0, k1 = key_words(seed)
    return threefry2x32(k0, k1, c0.astype(mx.uint32), c1.astype(mx.uint32))[0]
