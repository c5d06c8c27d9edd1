"""Threefry-2x32 with 20 rounds (Random123), vectorized in numpy: the RandomBits primitive of LANGUAGE.md §4.

Clean-room code: written from the language contract (and Random123's published algorithm) without reading
samplec's code or tests/reference.py. Known answers (spec §4): key (0, 0), counter (0, 0) ->
(0x6b200159, 0x99ba4efe); key and counter all 0xFFFFFFFF -> (0x1cb996fc, 0xbb002be7).
"""
from __future__ import annotations

import numpy as np

_M32 = np.uint64(0xFFFFFFFF)
_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
_PARITY = np.uint64(0x1BD11BDA)


def threefry2x32(k0, k1, c0, c1):
    """Threefry-2x32-20 of key (k0, k1) and counter (c0, c1); arguments are broadcastable integer arrays
    holding 32-bit values. Returns the two output words (x0, x1) as uint32 arrays."""
    k0, k1, c0, c1 = (np.asarray(a, dtype=np.uint64) & _M32 for a in (k0, k1, c0, c1))
    ks = (k0, k1, (_PARITY ^ k0 ^ k1) & _M32)
    x0 = (c0 + ks[0]) & _M32
    x1 = (c1 + ks[1]) & _M32
    for r in range(20):
        x0 = (x0 + x1) & _M32
        rot = np.uint64(_ROTATIONS[r % 8])
        x1 = ((x1 << rot) | (x1 >> (np.uint64(32) - rot))) & _M32
        x1 = x1 ^ x0
        if r % 4 == 3:                                   # key injection every four rounds
            s = (r + 1) // 4
            x0 = (x0 + ks[s % 3]) & _M32
            x1 = (x1 + ks[(s + 1) % 3] + np.uint64(s)) & _M32
    return x0.astype(np.uint32), x1.astype(np.uint32)
