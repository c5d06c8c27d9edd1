"""One MLX kernel per IR op: `KERNELS[op](inputs, attrs) -> mx.array`. Everything computes in float32."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from samplec.backend_mlx import gpu, native
from samplec.backend_mlx.rng import random_bits

DT = {"f32": mx.float32, "i32": mx.int32, "u32": mx.uint32, "u64": mx.uint64, "bool": mx.bool_}
NP_DT = {"f32": np.float32, "i32": np.int32, "u32": np.uint32, "u64": np.uint64, "bool": np.bool_}


_CONSTANTS: dict[tuple, mx.array] = {}
_KEYS: dict[int, tuple] = {}        # id of each array in _CONSTANTS -> its key
MAX_CONSTANTS = 64


def constant(key: tuple, build) -> mx.array:
    """An array that depends only on shapes or on the program (an index row, a zero row, a literal), built and
    evaluated once: under `mx.compile` it is a constant of the call, not a kernel of its own each time (an `arange`,
    a fill or a cast is a launch on a GPU)."""
    got = _CONSTANTS.get(key)
    if got is None:
        if len(_CONSTANTS) >= MAX_CONSTANTS:
            _KEYS.pop(id(_CONSTANTS.pop(next(iter(_CONSTANTS)))), None)
        got = build()
        mx.eval(got)
        _CONSTANTS[key] = got
        _KEYS[id(got)] = key
    return got


# elementwise ops: of constants only (an index row compared with a literal), their value is a constant too
FOLDABLE = frozenset({"add", "sub", "mul", "div", "maximum", "minimum", "neg", "abs", "lt", "le", "gt", "ge", "eq",
                      "ne", "logical_and", "logical_or", "logical_not", "cast", "where", "filter"})


def folded(op: str, ins: list, attrs: dict) -> mx.array | None:
    """`op` of constants (`constant`'s arrays): a constant of the call itself (no kernel each call -- MLX's compile
    folds no constants), or None where an operand is not one."""
    if op not in FOLDABLE or not ins:
        return None
    keys = tuple(_KEYS.get(id(a)) for a in ins)
    if None in keys or any(_CONSTANTS.get(k) is not a for k, a in zip(keys, ins)):
        return None
    return constant((op, repr(sorted(attrs.items())), keys), lambda: KERNELS[op](ins, attrs))


def constant_as(a: mx.array, dtype) -> mx.array | None:
    """A constant's value in another dtype, itself a constant (no cast a call: what a GPU kernel's slot reads), or
    None where `a` is not one of `constant`'s."""
    key = _KEYS.get(id(a))
    if key is None or _CONSTANTS.get(key) is not a:
        return None
    return constant(("as", key, str(dtype)), lambda: a.astype(dtype))


def _const(ins, a):
    # through numpy: MLX cannot build a uint64 scalar above 2**63 directly (repr: -0.0 and NaN keys of their own)
    return constant(("const", repr(a["value"]), a["dtype"]),
                    lambda: mx.array(np.array(a["value"], dtype=NP_DT[a["dtype"]])))


def _sort(ins, a):
    # values only: equal values are interchangeable, so descending is the ascending sort reversed (a view)
    s = mx.sort(ins[0], axis=-1)
    return s[..., ::-1] if a["descending"] else s


def _argsort(ins, a):
    # MLX's sort is stable, so ties keep id order in both directions
    x = ins[0]
    # (MLX gives uint32 positions; a view, not a conversion kernel, makes them i32: V < 2**31)
    return mx.argsort(-x if a["descending"] else x, axis=-1).view(mx.int32)


def _candidates(ins, a):
    """The ids of the row's `places` largest values (N = min(places, V); a NaN or +inf first), by value descending
    and equal values by id: a partition of the row (linear on the CPU) and a sort of the N it keeps."""
    x = ins[0]
    n = min(a["places"], x.shape[-1])
    key = mx.where(mx.isnan(x), -np.inf, -x)       # (ascending on the negation: a stable sort keeps ids in order)
    if n == x.shape[-1]:
        return mx.argsort(key, axis=-1).view(mx.int32)
    ids = mx.sort(mx.argpartition(key, n - 1, axis=-1)[..., :n], axis=-1)
    return mx.take_along_axis(ids, mx.argsort(mx.take_along_axis(key, ids, axis=-1), axis=-1), axis=-1).view(mx.int32)


def _iota(n: int) -> mx.array:
    return constant(("iota", n), lambda: mx.arange(n, dtype=mx.int32))


def _zeros(shape: tuple, dtype) -> mx.array:
    return constant(("zeros", tuple(shape), dtype), lambda: mx.zeros(shape, dtype=dtype))


def _in_range(idx: mx.array, n: int) -> mx.array:
    """Indices clamped into [0, n): a program's own indices always are (this costs one small op), but one read
    from a crafted .smpb may compute any value, and MLX's gathers and scatters do not check bounds."""
    return mx.clip(idx, 0, max(n - 1, 0))


def _take_along(ins, a):
    x, idx = ins
    idx = _in_range(idx, x.shape[-1])
    if x.shape[:-1] != idx.shape[:-1]:
        lead = np.broadcast_shapes(x.shape[:-1], idx.shape[:-1])
        x = mx.broadcast_to(x, lead + x.shape[-1:])
        idx = mx.broadcast_to(idx, lead + idx.shape[-1:])
    return mx.take_along_axis(x, idx, axis=-1)


def _lead(x: mx.array, idx: mx.array) -> tuple[mx.array, mx.array]:
    """x and idx broadcast over their leading axes (take_along_axis wants them equal)."""
    if x.shape[:-1] != idx.shape[:-1]:
        lead = np.broadcast_shapes(x.shape[:-1], idx.shape[:-1])
        x, idx = mx.broadcast_to(x, lead + x.shape[-1:]), mx.broadcast_to(idx, lead + idx.shape[-1:])
    return x, idx


# `sum` (the portable lowering's sums): one reduction on a GPU, whose reductions are trees in hardware; on the CPU,
# where MLX sums a row in a few long runs, the float32 tree of reduce_sum (GPU_SUMS: count launches as a GPU would)
GPU_SUMS = False


def _device_sum(x: mx.array) -> mx.array:
    if x.dtype != mx.float32 or GPU_SUMS or mx.default_device() != mx.cpu:
        return mx.sum(x, axis=-1, keepdims=True)
    return _reduce_sum([x], {})


def _cumsum(x: mx.array) -> mx.array:
    """Running sums along the row. A float32 running mass on the CPU, where MLX sums in sequence, drifts ~1e-5 over
    thousands of tail tokens -- enough to move a top_p or typical_p boundary by a token -- so it runs in float64
    there; a GPU's scan adds by a tree, a few ulps from the exact sum."""
    if x.dtype == mx.float32 and mx.default_device() == mx.cpu and not GPU_SUMS:
        return mx.cumsum(x.astype(mx.float64), axis=-1).astype(mx.float32)
    return mx.cumsum(x, axis=-1)


def _topk_ids(ins, a):
    """The k largest without a sort of the vocabulary: their threshold by a selection by count, the tokens above
    it and the lowest ids of those at it (a scan), placed in id order, then ordered by a sort of the k alone."""
    x, k = ins[0], a["k"]
    n = x.shape[-1]
    if k > n:
        raise ValueError(f"k = {k} exceeds the vocabulary size V = {n}")
    v = _kth_largest([x, mx.array(k, dtype=mx.int32)], a)
    above, at = x > v, x == v
    need = k - mx.sum(above, axis=-1, keepdims=True)
    chosen = above | (at & (mx.cumsum(at.astype(mx.int32), axis=-1) <= need))
    slot = mx.where(chosen, mx.minimum(mx.cumsum(chosen.astype(mx.int32), axis=-1) - 1, k), k)   # k: the others
    ids = mx.broadcast_to(mx.arange(n, dtype=mx.int32), x.shape)
    slots = mx.put_along_axis(mx.zeros(x.shape[:-1] + (k + 1,), dtype=mx.int32), slot, ids, axis=-1)[..., :k]
    order = mx.argsort(-mx.take_along_axis(x, slots, axis=-1), axis=-1)    # stable: equal values keep id order
    return mx.take_along_axis(slots, order, axis=-1)


def _topk(ins, a):
    """The k largest values, descending, -inf past the row's length: the native selection (or MLX's partition),
    then a sort of the k alone."""
    x, k = ins[0], a["k"]
    n = x.shape[-1]
    top = min(k, n)
    fast = native.topk_select(x, top, (x,)) if top < n else None
    vals = fast[-1] if fast is not None else x if top == n else mx.topk(x, top, axis=-1)
    vals = -mx.sort(-vals, axis=-1)
    if k > n:
        vals = mx.concatenate([vals, mx.full(x.shape[:-1] + (k - n,), -np.inf, dtype=x.dtype)], axis=-1)
    return vals


# Selection without sorting (what top_k, top_p, typical_p and top_logprobs need on any device): a threshold is
# found bit by bit over the float32 values' order-preserving uint32 keys, from the top bit down, each step one
# comparison of the row with a candidate and one reduction -- 32 passes whose work does not depend on the row's
# shape (flat rows, ties, long nuclei cost what peaked ones do) and which MLX runs as plain ops on the CPU, an
# Apple GPU or CUDA. The reductions are over nonnegative weights, so a larger candidate never gains weight and
# the search is exact for the sums as MLX computes them; counts are exact.

_NEG_INF_KEY = 0x007FFFFF       # the key of -inf; keys below it are NaNs


def _ordered(x: mx.array) -> mx.array:
    """uint32 keys in the order of x's float32 values (-0.0 as 0.0: equal values get equal keys)."""
    bits = mx.where(x == 0, 0.0, x).view(mx.uint32)
    return mx.where(bits >= 0x80000000, ~bits, bits | 0x80000000)


def _select(keys: mx.array, reaches, bits: int | None = None) -> mx.array:
    """The largest value t, at most the row's largest, with `reaches(keys >= key(t))` monotone (true for every
    smaller t once true), or -inf if none does, as float32 [..., 1]. `reaches` takes the comparison of the row with
    c candidates at once, [..., c, V] bool, and answers [..., c, 1].

    `bits` key bits are decided per round: 2**bits - 1 candidates compared in one pass, 32 / bits rounds
    (`_select_bits`: 1 on the CPU; on a GPU, where each round's few kernels cost their launches more than their
    work, as many as keep the round's [..., c, V] comparison within _ROUND_BYTES). The candidates of a round are
    reduced each on its own, in the same order as one candidate's, so every width gives the same threshold
    (tests/test_selection.py, and the differential test runs the MLX-ops path with four bits per round)."""
    if bits is None:
        bits = _select_bits(keys)
    lo = mx.zeros(keys.shape[:-1] + (1,), dtype=mx.uint32)
    rows = keys[..., None, :]
    shift = 32
    while shift > 0:
        b = min(bits, shift)
        shift -= b
        ok = reaches(rows >= (lo[..., None, :] | _steps(b, shift)))                # [..., c, 1], true for a prefix
        lo = lo | (mx.sum(ok.astype(mx.uint32), axis=-2) << shift)
    lo = mx.minimum(lo, mx.max(keys, axis=-1, keepdims=True))      # (an empty upper set may reach a target <= 0)
    value = mx.where(lo >= 0x80000000, lo & 0x7FFFFFFF, ~lo).view(mx.float32)
    return mx.where(lo < _NEG_INF_KEY, -np.inf, value)


# A round's candidates on a GPU: at most 16 MiB of float32 weights between its comparison and its reductions (at
# V = 152064: B = 1 four bits, 8 rounds; B = 2-3 three bits; B = 4-9 two bits; B >= 10 one bit, as on the CPU).
# On an H200 a selection's 32 one-bit rounds were ~240 kernel launches, 1.1-1.3 ms, 7x a full sort of the row
# (docs/performance.md, GPU): launches, not bytes, are the cost there. On the CPU the work is: one bit a round.
_ROUND_BYTES = 1 << 24
_STEPS: dict[tuple[int, int], mx.array] = {}


def _steps(bits: int, shift: int) -> mx.array:
    """A round's candidate digits [c, 1], j << shift for j = 1 .. 2**bits - 1 (a constant: no kernel per round)."""
    if (bits, shift) not in _STEPS:
        _STEPS[bits, shift] = mx.array((np.arange(1, 1 << bits, dtype=np.uint32) << np.uint32(shift))[:, None])
    return _STEPS[bits, shift]


def _select_bits(keys: mx.array) -> int:
    """Key bits a selection decides per round on the current device."""
    if mx.default_device() == mx.cpu:
        return 1
    n = max(1, int(np.prod(keys.shape)))
    for bits in (4, 3, 2):
        if n * ((1 << bits) - 1) * 4 <= _ROUND_BYTES:
            return bits
    return 1


def _lift(a: mx.array) -> mx.array:
    """A [..., 1] operand of a round's test, lifted over its candidate axis ([..., 1, 1])."""
    return a if a.ndim == 0 else mx.expand_dims(a, -2)


def _kth_largest(ins, a):
    x, k = ins
    want = mx.clip(k.astype(mx.int32), 1, x.shape[-1])
    fast = gpu.kth_largest(x, want)         # (a CUDA device: one radix-select block per row)
    if fast is not None:
        return fast
    want = _lift(want)
    return _select(_ordered(x), lambda above: mx.sum(above, axis=-1, keepdims=True) >= want)


def _mass_threshold(ins, a):
    key, w, target = ins
    w, target = _lift(mx.broadcast_to(w, key.shape)), _lift(target)
    # (the tree sum of reduce_sum: a few ulps where a sequential float32 sum would move a boundary by ~1e-5)
    return _select(_ordered(key), lambda above: _reduce_sum([mx.where(above, w, 0.0)], a) >= target)


def _kth_largest_static(ins, a):
    """The k-th largest value; -inf past the row: one partition of the values (short rows: the native selection,
    or a partition of packed keys)."""
    x, k = ins[0], a["k"]
    n = x.shape[-1]
    if k > n:
        return mx.full(x.shape[:-1] + (1,), -np.inf, dtype=x.dtype)
    if k == n:
        return mx.min(x, axis=-1, keepdims=True)
    if mx.default_device() != mx.cpu:       # MLX partitions by a full sort on the GPU
        return _kth_largest([x, mx.array(k, dtype=mx.int32)], a)
    if n > PACKED_MAX:
        return mx.partition(x, kth=n - k, axis=-1)[..., n - k:n - k + 1]
    fused = native.topk_select(x, k - 1) if k >= 2 else None
    if fused is not None:
        return fused[1]
    return mx.take_along_axis(x, _partition_positions(x, n - k, n - k, n - k + 1), axis=-1)


PACKED_MAX = 1 << 16      # rows up to this long are partitioned by the functions below


def _partition_positions(x: mx.array, kth: int, lo: int, hi: int) -> mx.array:
    """Positions [lo, hi) of an ascending argpartition of x's rows at kth (uint32 or int32: callers index with
    them or cast them). A batch goes through one
    partition of packed keys (on MLX's CPU backend a partition of values is ~1.6x faster than an argpartition:
    B = 8, 2376 floats, 0.16 against 0.25 ms); a single row, where the five extra primitives that build and unpack
    the keys cost more than the partition saves, through `argpartition`. Which of equal values lands where is
    unspecified either way (the plans guard every tie that could matter)."""
    if x.ndim < 2 or x.shape[0] < 2:
        return mx.argpartition(x, kth=kth, axis=-1)[..., lo:hi]
    return _key_positions(_partition_keys(x, kth)[..., lo:hi])


def _partition_keys(x: mx.array, kth: int) -> mx.array:
    """A partition of uint64 keys (order-preserving bits of the float32 value, position) along the last axis.
    Equal values order by position; -0.0 sorts below 0.0."""
    bits = x.view(mx.uint32)
    ordered = mx.where(bits >= 0x80000000, ~bits, bits | 0x80000000).astype(mx.uint64)
    return mx.partition((ordered << 32) | _positions64(x.shape[-1]), kth=kth, axis=-1)


def _key_positions(keys: mx.array) -> mx.array:
    return (keys & 0xFFFFFFFF).astype(mx.uint32)


_POSITIONS64: dict[int, mx.array] = {}


def _positions64(n: int) -> mx.array:
    # one array per length, so that two kernels partitioning the same row build identical keys (and MLX's
    # compile merges them)
    if n not in _POSITIONS64:
        _POSITIONS64[n] = mx.array(np.arange(n, dtype=np.uint64))
    return _POSITIONS64[n]


def _place(x: mx.array, j: int) -> mx.array:
    """`place`: column `j` of `x`, [B, 1] -- one slice (one node for the host to replay)."""
    return x[..., j:j + 1]


def _pack(ins: list) -> mx.array:
    """`pack`: [B,1] values side by side, [B,n] -- a balanced tree of selections on the column (constants), so that
    MLX's compile fuses it and the values' own elementwise ops into one kernel (log2(n) levels deep)."""
    n = len(ins)

    def tree(lo: int, hi: int) -> mx.array:
        if hi - lo == 1:
            return ins[lo]
        mid = (lo + hi) // 2
        below = constant(("columns below", n, mid), lambda: mx.arange(n) < mid)
        return mx.where(below, tree(lo, mid), tree(mid, hi))
    out = tree(0, n)
    return out if out.shape[-1] == n else mx.broadcast_to(out, (*out.shape[:-1], n))


# a history's id >= V, and the id clamped into [0, V - 1], in equal forms no two of which share a node: the counts of
# one history over several windows (their `form`s) each compute their index in a kernel of their own (MLX's compile
# merges equal nodes, and a node two kernels read is a kernel of its own)
_OVER = (lambda i, V: i >= V, lambda i, V: mx.less_equal(V, i), lambda i, V: i > V - 1,
         lambda i, V: mx.logical_not(i < V))
_CLAMP = (lambda i, V: mx.clip(i, 0, V - 1), lambda i, V: mx.maximum(mx.minimum(i, V - 1), 0),
          lambda i, V: mx.where(i < 0, 0, mx.where(i > V - 1, V - 1, i)),
          lambda i, V: mx.where(i >= V, V - 1, mx.maximum(i, 0)))


def _count_row(ins, form: int = 0) -> mx.array:
    """[B, V + 2]: each valid id's column (clamped into the row), an id >= V column V + 1, every other entry column
    V, in one elementwise kernel; a scatter of ones (a constant) into a zero row. `counts` and `ids_over` of one
    form build the same nodes, which MLX's compile merges: one scatter for both."""
    x, ids, valid = ins
    B, V = x.shape
    ids, valid = mx.broadcast_to(ids, (B, ids.shape[-1])), mx.broadcast_to(valid, (B, ids.shape[-1]))
    k = form % len(_OVER)
    at = mx.where(_OVER[k](ids, V), V + 1, mx.where(valid, _CLAMP[k](ids, V), V))
    rows = constant(("rows", B, ids.shape[-1]), lambda: mx.broadcast_to(mx.arange(B)[:, None], ids.shape))
    return _zeros((B, V + 2), mx.float32).at[rows, at].add(_one())


def _counts(ins, a):
    """`counts`: the first V columns of the scatter (a view)."""
    return _count_row(ins, a.get("form", 0))[:, :ins[0].shape[1]]


def _ids_over(ins, a):
    """`ids_over`: the scatter's last column, positive where an id >= V was counted there."""
    V = ins[0].shape[1]
    return _count_row(ins, a.get("form", 0))[:, V + 1:] > 0


def _one() -> mx.array:
    return constant(("one",), lambda: mx.array(1.0, dtype=mx.float32))


def _scatter_add(ins, a):
    base, idx, upd = ins
    idx = _in_range(idx, base.shape[-1])
    lead = base.shape[:-1]
    idx = mx.broadcast_to(idx, lead + idx.shape[-1:])
    upd = mx.broadcast_to(upd, idx.shape)
    rows = mx.broadcast_to(_iota(base.shape[0])[:, None], idx.shape) if lead else None
    return base.at[rows, idx].add(upd) if lead else base.at[idx].add(upd)


def _put_along(ins, a):
    base, idx, vals = ins
    idx = mx.broadcast_to(_in_range(idx, base.shape[-1]), base.shape[:-1] + idx.shape[-1:])
    return mx.put_along_axis(base, idx, mx.broadcast_to(vals, idx.shape), axis=-1)


def _sparse_add(ins, a):
    x = ins[0]
    if max(a["ids"], default=-1) >= x.shape[-1]:       # (a call checks this first: a direct kernel call too)
        raise ValueError(f"logit_bias: token id {max(a['ids'])} is out of range for V = {x.shape[-1]}")
    if len(set(a["ids"])) == len(a["ids"]):
        # one row of the biases, built once: adding it (0 elsewhere) is a plain add that fuses with its neighbours
        return x + bias_row(a["ids"], a["values"], x.shape[-1])
    ids = mx.array(np.array(a["ids"], dtype=np.int32))
    vals = mx.array(np.array(a["values"], dtype=np.float32))
    return x.at[..., ids].add(vals)


def bias_row(ids, values, V: int) -> mx.array:
    """A literal logit_bias's row (unique ids; 0 elsewhere) [V]: a constant of the call, built once."""
    key = ("sparse_add", tuple(ids), tuple(values), V)
    return constant(key, lambda: _bias_row(ids, values, V))


def _bias_row(ids, values, V: int) -> mx.array:
    row = np.zeros(V, dtype=np.float32)
    row[np.array(ids, dtype=np.int64)] = np.array(values, dtype=np.float32)
    return mx.array(row)


GROUP = 32


def _reduce_sum(ins, a):
    """Tree summation in float32: partial sums over strided groups of GROUP, level after level, then the rest.
    A sequential float32 sum loses ~1e-5 at V = 32000 and, on a peaked row (one 1 and many tiny terms), most of
    the tiny terms' mass; here each level's groups hold like-sized terms and the error stays a few ulps."""
    x = ins[0]
    if x.dtype != mx.float32 or x.shape[-1] <= 2 * GROUP:
        return mx.sum(x, axis=-1, keepdims=True)
    while x.shape[-1] > GROUP:
        n = x.shape[-1]
        if n % GROUP:
            x = mx.concatenate([x, mx.zeros(x.shape[:-1] + (GROUP - n % GROUP,), dtype=x.dtype)], axis=-1)
            n = x.shape[-1]
        x = mx.sum(x.reshape(x.shape[:-1] + (GROUP, n // GROUP)), axis=-2)
    return mx.sum(x, axis=-1, keepdims=True)


PAIRWISE_COUNTS = 512     # histories up to this long count by pairwise comparison, longer ones by a scatter


def _count_at(ins, a):
    ids, w, x = ins
    w = mx.broadcast_to(w, ids.shape) if w.shape != ids.shape else w
    if ids.shape[-1] <= PAIRWISE_COUNTS:
        same = mx.expand_dims(ids, -1) == mx.expand_dims(ids, -2)
        return mx.sum(mx.where(same, mx.expand_dims(w, -2), 0.0), axis=-1)
    counts = _scatter_add([_zeros(x.shape, mx.float32), ids, w], a)
    return _take_along([counts, ids], a)


DRY_CHUNK = 1 << 22        # compared entries per piece of dry_repeats' [B, H-1, H] comparison (bounds its memory)


def _dry_repeats(ins, a):
    """Pairwise over the history: S[p] = length of the common suffix of h[:p] and h (the reverse Z-array), from
    [B, P, H] comparisons over pieces of P positions, then a scatter-max of S onto the token at p. Index rows and
    the fill are constants of the call (built once: no kernel each call)."""
    h, x = ins
    fast = native.dry_repeats(h, x)                 # (on the CPU: the Z-algorithm, O(H) per row)
    if fast is not None:
        return fast
    B, H = h.shape
    V = x.shape[-1]
    out = constant(("full", (B, V), -1), lambda: mx.full((B, V), -1, dtype=mx.int32))
    if H < 2:
        return out
    ends = h[:, ::-1][:, None, :]                                 # [B, 1, H]: h[H-1-j] (a view)
    step = max(1, DRY_CHUNK // max(1, B * H))
    pieces = []
    for lo in range(1, H, step):
        hi = min(H, lo + step)

        def back_rows(lo=lo, hi=hi):
            back = mx.arange(lo, hi)[:, None] - 1 - mx.arange(H)[None, :]    # [P, H]: h[p-1-j] against h[H-1-j]
            return mx.maximum(back, 0), back >= 0
        at, inside = constant(("dry_back", lo, hi, H), back_rows)
        early = mx.take(h, at, axis=1)                            # [B, P, H]
        miss = mx.logical_not((early == ends) & (ends >= 0) & inside)
        pieces.append(mx.where(mx.any(miss, axis=-1), mx.argmax(miss.astype(mx.int32), axis=-1), H - 1))
    s = (pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=1)).astype(mx.int32)   # [B, H-1]
    nxt = h[:, 1:]
    s = mx.where((nxt >= 0) & (h[:, :-1] >= 0), s, -1)
    rows = constant(("rows", B, H - 1), lambda: mx.broadcast_to(mx.arange(B)[:, None], (B, H - 1)))
    return out.at[rows, _in_range(nxt, V)].maximum(s)


def _random_bits(seed, c0, c1):
    # one primitive on the CPU when samplec-native is built (it reads a 1-D operand as [B, 1]: only 2-D ones here)
    out = native.threefry_bits(seed, c0, c1) if seed.ndim == c0.ndim == c1.ndim == 2 else None
    return random_bits(seed, c0, c1) if out is None else out


def _log_softmax(ins, a):
    shifted = ins[0] - mx.max(ins[0], axis=-1, keepdims=True)
    return shifted - mx.log(_reduce_sum([mx.exp(shifted)], a))


def _red(fn):
    return lambda ins, a: fn(ins[0], axis=-1, keepdims=True)


KERNELS = {
    "add": lambda i, a: i[0] + i[1], "sub": lambda i, a: i[0] - i[1], "mul": lambda i, a: i[0] * i[1],
    "div": lambda i, a: i[0] / i[1], "maximum": lambda i, a: mx.maximum(*i), "minimum": lambda i, a: mx.minimum(*i),
    "lt": lambda i, a: i[0] < i[1], "le": lambda i, a: i[0] <= i[1], "gt": lambda i, a: i[0] > i[1],
    "ge": lambda i, a: i[0] >= i[1], "eq": lambda i, a: i[0] == i[1], "ne": lambda i, a: i[0] != i[1],
    "logical_and": lambda i, a: mx.logical_and(*i), "logical_or": lambda i, a: mx.logical_or(*i),
    "logical_not": lambda i, a: mx.logical_not(i[0]),
    "bit_and": lambda i, a: i[0] & i[1], "bit_or": lambda i, a: i[0] | i[1], "bit_xor": lambda i, a: i[0] ^ i[1],
    "shl": lambda i, a: i[0] << i[1], "shr": lambda i, a: i[0] >> i[1],
    "neg": lambda i, a: -i[0], "abs": lambda i, a: mx.abs(i[0]), "exp": lambda i, a: mx.exp(i[0]),
    "log": lambda i, a: mx.log(i[0]), "sqrt": lambda i, a: mx.sqrt(i[0]),
    "isnan": lambda i, a: mx.isnan(i[0]), "isposinf": lambda i, a: mx.isposinf(i[0]),
    "isfinite": lambda i, a: mx.isfinite(i[0]),
    "cast": lambda i, a: i[0].astype(DT[a["dtype"]]),
    "where": lambda i, a: mx.where(*i),
    "const": _const,
    "expand": lambda i, a: mx.expand_dims(i[0], -1),
    "squeeze": lambda i, a: mx.squeeze(i[0], -1),
    "iota": lambda i, a: _iota(i[0].shape[-1]),
    "slice": lambda i, a: i[0][..., a["start"]:a["stop"]],
    "reduce_max": _red(mx.max), "reduce_min": _red(mx.min), "reduce_sum": _reduce_sum, "reduce_any": _red(mx.any),
    "argmax": lambda i, a: mx.argmax(i[0], axis=-1, keepdims=True).view(mx.int32),
    "sort": _sort, "argsort": _argsort, "candidates": _candidates, "topk": _topk, "topk_ids": _topk_ids,
    "cumsum": lambda i, a: _cumsum(i[0]),
    "kth_largest": _kth_largest, "kth_largest_static": _kth_largest_static, "mass_threshold": _mass_threshold,
    "filter": lambda i, a: mx.where(i[1], i[0], mx.array(-np.inf, dtype=mx.float32)),
    "zeros_like": lambda i, a: _zeros(i[0].shape, DT[a["dtype"]]),
    "take_along": _take_along, "scatter_add": _scatter_add, "put_along": _put_along, "sparse_add": _sparse_add,
    "random_bits": lambda i, a: _random_bits(*i),
    "count_at": _count_at, "log_softmax": _log_softmax, "dry_repeats": _dry_repeats,
    # target-level ops (samplec/ir/ops.py's TARGET_OPS)
    "gather": lambda i, a: mx.take_along_axis(*_lead(i[0], i[1]), axis=-1),
    "sum": lambda i, a: _device_sum(i[0]),
    "last_index": lambda i, a: constant(("last_index", i[0].shape[-1]),
                                        lambda: mx.array([max(i[0].shape[-1] - 1, 0)], dtype=mx.int32)),
    "coin_ids": lambda i, a: constant(("coin_ids", i[0].shape[-1]), lambda: mx.concatenate(
        [mx.array([0xFFFFFFFF], dtype=mx.uint32), mx.arange(i[0].shape[-1], dtype=mx.uint32)])),
    "tail": lambda i, a: i[0][..., a["start"]:],
    "place": lambda i, a: _place(i[0], min(a["index"], i[0].shape[-1] - 1)),
    "counts": _counts, "ids_over": _ids_over,
    "pack": lambda i, a: _pack(i),
}
