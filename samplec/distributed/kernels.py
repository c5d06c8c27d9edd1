"""Sharded kernels: `DKERNELS[op](comm, ins, attrs)` for the IR ops that read across the vocabulary axis.

A value whose last dimension is the vocabulary `V` is held as each rank's slice of it; every other value is the
same on every rank. An elementwise op on slices is the op itself (token ids come from the sharded `iota`, so the
noise of token i is the noise of its global id). The ops here read across the axis and exchange a few values per
row: reductions gather one per row, the argmax a (value, id) pair per row, the gathers at token ids the entries
each rank holds, the k largest (`topk`, `topk_ids`, a constant `kth_largest_static`) each rank's k largest, and
the selections by count or by mass (`kth_largest`, `mass_threshold`: top_k with a per-row k, top_p, typical_p)
first gather each rank's CANDIDATES largest keys with their weights: a row whose answer lies above every key a
rank left out is decided from them (a peaked row's nucleus, a small k). Only where some row is not do they run
the 32-bit search of samplec/backend_mlx/kernels.py with each round's counts or masses summed over the
ranks: b key bits a round (4, or up to 8 while a round's comparison stays within ROUND_ELEMENTS: 8 on slices of a
few hundred ids; long slices, where the comparison's work outweighs a gather, keep 4), 2**b - 1 values per row
exchanged per round, ceil(32 / b) rounds. An op with no kernel
here gathers its operands' whole rows (`Comm.full`, exact, O(V) bytes) -- none of the stage definitions needs
it today.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from samplec.backend_mlx.kernels import KERNELS, _NEG_INF_KEY, _ordered, _reduce_sum
from samplec.distributed.comm import I32_MAX, Comm

ROUND_ELEMENTS = 1 << 18    # a selection round compares at most this many (candidate, token) pairs per rank
EXACT_IDS = 1 << 24         # ids below this are exact in float32: a (value, id) pair travels as one gather
TOPK_GATHER_MAX = 256       # a constant k up to this gathers each rank's k largest; above it, selection rounds
CANDIDATES = 128            # a selection first gathers each rank's this many largest (key, weight) pairs per row


def _iota(c: Comm, ins, a):
    s = c.slices
    return mx.arange(s.start, s.start + s.size, dtype=mx.int32)


def _reduce(combine, local):
    return lambda c, ins, a: combine(c)(local(ins[0]))


_max = _reduce(lambda c: c.max, lambda x: mx.max(x, axis=-1, keepdims=True))
_min = _reduce(lambda c: c.min, lambda x: mx.min(x, axis=-1, keepdims=True))
_any = _reduce(lambda c: c.any, lambda x: mx.any(x, axis=-1, keepdims=True))


def _sum(c: Comm, ins, a):
    return c.sum(_reduce_sum(ins, a))


def _argmax(c: Comm, ins, a):
    """The global id of the row's maximum, the lowest on ties (a NaN counts as the largest value: the logits
    checks read it)."""
    x = ins[0]
    at = mx.argmax(x, axis=-1, keepdims=True).astype(mx.int32)
    val = mx.take_along_axis(x, at, axis=-1)
    if val.dtype == mx.bool_:
        val = val.astype(mx.int32)
    elif val.dtype == mx.float32:
        val = mx.where(mx.isnan(val), np.inf, val)
    vals, ids = _pairs(c, val, at + c.slices.start)
    best = mx.max(vals, axis=0)
    return mx.min(mx.where(vals == best, ids, I32_MAX), axis=0)


def _pairs(c: Comm, vals: mx.array, ids: mx.array) -> tuple[mx.array, mx.array]:
    """Every rank's (values, ids), [N, ...] each: one gather where float32 holds both exactly."""
    if vals.dtype == mx.float32 and c.slices.vocab < EXACT_IDS:
        g = c.gather(mx.stack([vals, ids.astype(mx.float32)]))
        return g[:, 0], mx.where(g[:, 1] >= EXACT_IDS, I32_MAX, g[:, 1].astype(mx.int32))
    return c.gather(vals), c.gather(ids)


def _local_ids(c: Comm, idx: mx.array):
    """(position in this rank's slice, whether this rank holds it) of global token ids (clipped into [0, V) as the
    dense kernels clip them)."""
    s = c.slices
    idx = mx.clip(idx, 0, s.vocab - 1)
    own = (idx >= s.start) & (idx < s.start + s.size)
    return idx, mx.where(own, idx - s.start, 0), own


def _take_along(c: Comm, ins, a):
    x, idx = ins
    idx, pos, _ = _local_ids(c, idx)
    return c.pick(c.gather(KERNELS["take_along"]([x, pos], a)), c.owner(idx))


def _writer(kernel):
    """put_along / scatter_add at global ids: each rank writes the entries it holds (the others into a spare
    column it drops)."""
    def run(c: Comm, ins, a):
        base, idx, vals = ins
        _, pos, own = _local_ids(c, idx)
        n = base.shape[-1]
        wide = mx.concatenate([base, mx.zeros(base.shape[:-1] + (1,), dtype=base.dtype)], axis=-1)
        return KERNELS[kernel]([wide, mx.where(own, pos, n), vals], a)[..., :n]
    return run


def _whole(c: Comm, x: mx.array) -> mx.array:
    """A stand-in for the whole row's shape (for kernels that read only the vocabulary's size)."""
    return mx.broadcast_to(mx.zeros((1,) * x.ndim, dtype=x.dtype), x.shape[:-1] + (c.slices.vocab,))


def _count_at(c: Comm, ins, a):
    ids, w, x = ins
    return KERNELS["count_at"]([ids, w, _whole(c, x)], a)


def _dry_repeats(c: Comm, ins, a):
    """DRY's repeat lengths over the whole vocabulary (computed from the history alone: no exchange), sliced."""
    h, x = ins
    s = c.slices
    return KERNELS["dry_repeats"]([h, _whole(c, x)], a)[..., s.start:s.start + s.size]


def _sparse_add(c: Comm, ins, a):
    s, x = c.slices, ins[0]
    mine = [(i - s.start, v) for i, v in zip(a["ids"], a["values"]) if s.start <= i < s.start + s.size]
    if not mine:
        return x
    ids = mx.array(np.array([i for i, _ in mine], dtype=np.int32))
    return x.at[..., ids].add(mx.array(np.array([v for _, v in mine], dtype=np.float32)))


def _log_softmax(c: Comm, ins, a):
    x = ins[0]
    top = c.max(mx.max(x, axis=-1, keepdims=True))
    shifted = x - top
    return shifted - mx.log(c.sum(_reduce_sum([mx.exp(shifted)], a)))


def _cumsum(c: Comm, ins, a):
    x = ins[0]
    local = mx.cumsum(x, axis=-1)
    totals = c.gather(local[..., -1:])
    before = mx.array(c.slices.before).reshape((-1,) + (1,) * (totals.ndim - 1)).astype(totals.dtype)
    return local + mx.sum(totals * before, axis=0)


def _top_values(c: Comm, x: mx.array, k: int) -> mx.array:
    """The k largest values of the whole row, descending, -inf past it: each rank's k largest, merged."""
    mine = KERNELS["topk"]([x], {"k": k})                               # (-inf past the slice)
    g = c.gather(mine)                                                  # [N, ..., k]
    merged = mx.concatenate([g[r] for r in range(c.n)], axis=-1)
    return -mx.sort(-merged, axis=-1)[..., :k]


def _topk(c: Comm, ins, a):
    return _top_values(c, ins[0], a["k"])


def _topk_ids(c: Comm, ins, a):
    """Ids of the k largest, descending, lowest id first among equal values: each rank's own (padded with ids
    past every real one), merged by id and then, stably, by value."""
    x, k = ins[0], a["k"]
    s = c.slices
    mine = min(k, s.size)
    pos = KERNELS["topk_ids"]([x], {"k": mine})
    vals, ids = mx.take_along_axis(x, pos, axis=-1), pos + s.start
    if mine < k:
        pad = x.shape[:-1] + (k - mine,)
        vals = mx.concatenate([vals, mx.full(pad, -np.inf, dtype=x.dtype)], axis=-1)
        past = EXACT_IDS if s.vocab < EXACT_IDS else I32_MAX       # (an id past every real one)
        ids = mx.concatenate([ids, mx.full(pad, past, dtype=mx.int32)], axis=-1)
    gv, gi = _pairs(c, vals, ids)
    vals = mx.concatenate([gv[r] for r in range(c.n)], axis=-1)
    ids = mx.concatenate([gi[r] for r in range(c.n)], axis=-1)
    by_id = mx.argsort(ids, axis=-1)
    vals, ids = mx.take_along_axis(vals, by_id, axis=-1), mx.take_along_axis(ids, by_id, axis=-1)
    order = mx.argsort(-vals, axis=-1)[..., :k]         # (stable: equal values keep id order)
    return mx.take_along_axis(ids, order, axis=-1)


def _steps(bits: int, shift: int) -> mx.array:
    return mx.array((np.arange(1, 1 << bits, dtype=np.uint32) << np.uint32(shift))[:, None])


def _select(c: Comm, keys: mx.array, reaches) -> mx.array:
    """samplec/backend_mlx/kernels.py's `_select` with each round's per-row counts or masses summed over the
    ranks: the largest t (at most the row's largest) whose upper set reaches the target, -inf if none."""
    lo = mx.zeros(keys.shape[:-1] + (1,), dtype=mx.uint32)
    rows = keys[..., None, :]
    # (the same on every rank: from the widest slice, not this rank's -- every rank must run as many rounds)
    work = int(np.prod(keys.shape[:-1])) * max(c.slices.sizes)
    bits = max(4, min(8, int(np.log2(ROUND_ELEMENTS / max(1, work) + 1))))
    shift = 32
    while shift > 0:
        b = min(bits, shift)
        shift -= b
        ok = reaches(rows >= (lo[..., None, :] | _steps(b, shift)))                # [..., c, 1]
        lo = lo | (mx.sum(ok.astype(mx.uint32), axis=-2) << shift)
    lo = mx.minimum(lo, c.max(mx.max(keys, axis=-1, keepdims=True)))
    value = mx.where(lo >= 0x80000000, lo & 0x7FFFFFFF, ~lo).view(mx.float32)
    return mx.where(lo < _NEG_INF_KEY, -np.inf, value)


def _lift(a: mx.array) -> mx.array:
    return a if a.ndim == 0 else mx.expand_dims(a, -2)


def _by_candidates(c: Comm, key: mx.array, w: mx.array, target: mx.array, rounds) -> mx.array:
    """The largest key value t whose upper set {key >= t} holds weight >= target (-inf if none) from each rank's
    CANDIDATES largest keys and their weights: exact for the rows where the answer lies above every key a rank
    did not send (or no rank left one out); the other rows take `rounds()`, the selection rounds. Whether any row
    needs them is read on the host (every rank reads the same gathered values, so every rank takes the same
    branch)."""
    s = c.slices
    n, lead = min(CANDIDATES, s.size), key.shape[:-1]
    w = mx.broadcast_to(w, key.shape)
    if n < s.size:
        pos = mx.argpartition(-key, kth=n - 1, axis=-1)[..., :n]
        ck, cw = mx.take_along_axis(key, pos, axis=-1), mx.take_along_axis(w, pos, axis=-1)
        low = mx.min(ck, axis=-1, keepdims=True)                # (every key left out is <= this)
        unsent = mx.ones(lead + (1,), dtype=mx.float32)
    else:
        ck, cw = key, w
        low = mx.full(lead + (1,), -np.inf, dtype=mx.float32)
        unsent = mx.zeros(lead + (1,), dtype=mx.float32)
    if n < CANDIDATES:
        pad = lead + (CANDIDATES - n,)
        ck = mx.concatenate([ck, mx.full(pad, -np.inf, dtype=mx.float32)], axis=-1)
        cw = mx.concatenate([cw, mx.zeros(pad, dtype=mx.float32)], axis=-1)
    g = c.gather(mx.concatenate([ck, cw, low, unsent], axis=-1))
    keys = mx.concatenate([g[r][..., :CANDIDATES] for r in range(c.n)], axis=-1)
    ws = mx.concatenate([g[r][..., CANDIDATES:2 * CANDIDATES] for r in range(c.n)], axis=-1)
    bound = mx.max(g[..., 2 * CANDIDATES:2 * CANDIDATES + 1], axis=0)            # [..., 1]
    partial = mx.max(g[..., 2 * CANDIDATES + 1:], axis=0) > 0                    # some rank left keys out
    order = mx.argsort(-keys, axis=-1)
    keys, ws = mx.take_along_axis(keys, order, axis=-1), mx.take_along_axis(ws, order, axis=-1)
    mass = mx.cumsum(ws, axis=-1)
    # the weight of {key >= keys[j]}: the running sum at the end of keys[j]'s run of equal keys
    last = mx.concatenate([keys[..., 1:] != keys[..., :-1], mx.ones(lead + (1,), dtype=mx.bool_)], axis=-1)
    upper = mx.cummin(mx.where(last, mass, np.inf), axis=-1, reverse=True)
    ok = (upper >= target) & ((keys > bound) | ~partial)
    found = mx.any(ok, axis=-1, keepdims=True)
    value = mx.where(found, mx.take_along_axis(keys, mx.argmax(ok, axis=-1, keepdims=True), axis=-1), -np.inf)
    resolved = found | ~partial
    mx.eval(resolved)
    if bool(mx.all(resolved)):
        return value
    return mx.where(resolved, value, rounds())


def _kth_largest(c: Comm, ins, a):
    x, k = ins
    want = mx.clip(k.astype(mx.int32), 1, c.slices.vocab)
    rounds = lambda: _select(c, _ordered(x), lambda above: c.sum(mx.sum(above, axis=-1, keepdims=True)
                                                                 .astype(mx.int32)) >= _lift(want))
    return _by_candidates(c, x, mx.ones((1,), dtype=mx.float32), want.astype(mx.float32), rounds)


def _kth_largest_static(c: Comm, ins, a):
    x, k = ins[0], a["k"]
    if k > c.slices.vocab:
        return mx.full(x.shape[:-1] + (1,), -np.inf, dtype=x.dtype)
    if k <= TOPK_GATHER_MAX:
        return _top_values(c, x, k)[..., k - 1:k]
    return _kth_largest(c, [x, mx.array(k, dtype=mx.int32)], a)


def _mass_threshold(c: Comm, ins, a):
    key, w, target = ins
    lifted_w, lifted_t = _lift(mx.broadcast_to(w, key.shape)), _lift(target)
    rounds = lambda: _select(c, _ordered(key), lambda above: c.sum(_reduce_sum([mx.where(above, lifted_w, 0.0)],
                                                                               a)) >= lifted_t)
    return _by_candidates(c, key, w, target, rounds)


def _random_bits(c: Comm, ins, a):
    """RandomBits at the slice's global ids (2-D operands: the native primitive serves where it is built)."""
    seed, c0, c1 = (v if v.ndim == 2 else v.reshape((1,) * (2 - v.ndim) + v.shape) if v.ndim < 2 else v
                    for v in ins)
    return KERNELS["random_bits"]([seed, c0, c1], a)


DKERNELS = {
    "iota": _iota, "reduce_max": _max, "reduce_min": _min, "reduce_any": _any, "reduce_sum": _sum,
    "argmax": _argmax, "take_along": _take_along, "put_along": _writer("put_along"),
    "scatter_add": _writer("scatter_add"), "count_at": _count_at, "dry_repeats": _dry_repeats,
    "sparse_add": _sparse_add, "log_softmax": _log_softmax, "cumsum": _cumsum, "topk": _topk,
    "topk_ids": _topk_ids, "kth_largest": _kth_largest, "kth_largest_static": _kth_largest_static,
    "mass_threshold": _mass_threshold, "random_bits": _random_bits,
}

# ops whose result at a token reads only that token's operands (on slices: the op itself)
LOCAL = {"where", "cast", "filter", "zeros_like"}
