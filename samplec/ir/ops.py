"""The op table: every IR op is declared once here (name, arity, attributes, result type rule).

The verifier, the textual printer and parser, the flatbuffer writer and reader, the passes and the MLX kernels all
read this table; `tests/test_serialize.py` checks that the flatbuffer schema lists exactly these ops.
All ops are pure. Reductions, sorts, scans and gathers work along the last axis; elementwise ops broadcast
numpy-style over symbolic shapes such as `[B,V]`, `[B,1]`, `[V]` and `[]`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from samplec.ir.types import BOOL, F32, I32, U32, U64, DTYPES, Type, TypeError_, broadcast

# attribute kinds: "int", "float", "bool", "str", "dtype", "ints", "floats"


@dataclass(frozen=True)
class OpDef:
    name: str
    arity: int                           # the number of operands (-1: any number)
    attrs: tuple[tuple[str, str], ...]   # (name, kind) in declaration order
    infer: Callable[..., Type]           # infer(input_types, attrs_dict) -> Type
    doc: str


def _same_dtype(ts: list[Type], allowed=None) -> str:
    d = ts[0].dtype
    for t in ts[1:]:
        if t.dtype != d:
            raise TypeError_(f"operand dtypes differ: {d} vs {t.dtype}")
    if allowed and d not in allowed:
        raise TypeError_(f"dtype {d} not allowed here (expects one of {', '.join(allowed)})")
    return d


def _arith(ts, a):
    return Type(_same_dtype(ts, (F32, I32, U32, U64)), broadcast(*(t.shape for t in ts)))


def _compare(ts, a):
    _same_dtype(ts)
    return Type(BOOL, broadcast(*(t.shape for t in ts)))


def _logical(ts, a):
    return Type(_same_dtype(ts, (BOOL,)), broadcast(*(t.shape for t in ts)))


def _bits(ts, a):
    return Type(_same_dtype(ts, (U32, I32)), broadcast(*(t.shape for t in ts)))


def _float_unary(ts, a):
    return Type(_same_dtype(ts, (F32,)), ts[0].shape)


def _float_pred(ts, a):
    _same_dtype(ts, (F32,))
    return Type(BOOL, ts[0].shape)


def _same(ts, a):
    return ts[0]


def _where(ts, a):
    c, x, y = ts
    if c.dtype != BOOL:
        raise TypeError_("where: condition must be bool")
    return Type(_same_dtype([x, y]), broadcast(c.shape, x.shape, y.shape))


def _reduce(dtypes=None, out=None):
    def infer(ts, a):
        t = ts[0]
        if not t.shape:
            raise TypeError_("reduction of a scalar")
        if dtypes and t.dtype not in dtypes:
            raise TypeError_(f"dtype {t.dtype} not allowed here")
        return Type(out or t.dtype, t.shape[:-1] + (1,))
    return infer


def _expand(ts, a):
    return Type(ts[0].dtype, ts[0].shape + (1,))


def _squeeze(ts, a):
    if not ts[0].shape or ts[0].shape[-1] != 1:
        raise TypeError_("squeeze: last dimension must be 1")
    return Type(ts[0].dtype, ts[0].shape[:-1])


def _iota(ts, a):
    if not ts[0].shape:
        raise TypeError_("iota of a scalar")
    return Type(I32, (ts[0].shape[-1],))


def _argsort(ts, a):
    return Type(I32, ts[0].shape)


def _topk(dtype):
    def infer(ts, a):
        if a["k"] < 1:
            raise TypeError_("k must be >= 1")
        return Type(dtype or ts[0].dtype, ts[0].shape[:-1] + (a["k"],))
    return infer


def _slice(ts, a):
    if not 0 <= a["start"] < a["stop"]:
        raise TypeError_("slice: need 0 <= start < stop")
    return Type(ts[0].dtype, ts[0].shape[:-1] + (a["stop"] - a["start"],))


def _take_along(ts, a):
    x, idx = ts
    if idx.dtype != I32:
        raise TypeError_("take_along: indices must be i32")
    lead = broadcast(x.shape[:-1], idx.shape[:-1])
    return Type(x.dtype, lead + idx.shape[-1:])


def _scatter_add(ts, a):
    base, idx, upd = ts
    if idx.dtype != I32 or upd.dtype != base.dtype:
        raise TypeError_("scatter_add: indices must be i32 and updates match the base dtype")
    return base


def _count_at(ts, a):
    ids, w, x = ts
    if ids.dtype != I32 or w.dtype != F32 or x.dtype != F32:
        raise TypeError_("count_at: ids must be i32, weights and x f32")
    return Type(F32, broadcast(ids.shape, w.shape))


def _kth(ts, a):
    x, k = ts
    if k.dtype != I32:
        raise TypeError_("kth_largest: k must be i32")
    return Type(_same_dtype([x], (F32,)), broadcast(x.shape[:-1] + (1,), k.shape))


def _mass_threshold(ts, a):
    key, w, target = ts
    if key.dtype != F32 or w.dtype != F32 or target.dtype != F32:
        raise TypeError_("mass_threshold: key, weight and target must be f32")
    broadcast(key.shape, w.shape)
    return Type(F32, broadcast(key.shape[:-1] + (1,), target.shape))


def _kth_static(ts, a):
    if a["k"] < 1:
        raise TypeError_("k must be >= 1")
    return Type(_same_dtype(ts, (F32,)), ts[0].shape[:-1] + (1,))


def _filter(ts, a):
    x, keep = ts
    if keep.dtype != BOOL:
        raise TypeError_("filter: keep must be bool")
    return Type(_same_dtype([x], (F32,)), broadcast(x.shape, keep.shape))


def _cast(ts, a):
    if a["dtype"] not in DTYPES:
        raise TypeError_(f"unknown dtype {a['dtype']}")
    return Type(a["dtype"], ts[0].shape)


def _const(ts, a):
    return Type(a["dtype"], ())


def _random_bits(ts, a):
    seed, c0, c1 = ts
    if seed.dtype != U64 or c0.dtype != U32 or c1.dtype != U32:
        raise TypeError_("random_bits: operands are (u64 seed, u32 counter0, u32 counter1)")
    return Type(U32, broadcast(seed.shape, c0.shape, c1.shape))


def _stage(param_dtype):
    def infer(ts, a):
        x, v = ts
        if x.dtype != F32 or v.dtype != param_dtype:
            raise TypeError_(f"expects (f32 logits, {param_dtype} parameter)")
        return Type(F32, broadcast(x.shape, v.shape))
    return infer


def _cumsum(ts, a):
    return Type(_same_dtype(ts, (I32, F32)), ts[0].shape)


def _dynamic_temperature(ts, a):
    if any(t.dtype != F32 for t in ts):
        raise TypeError_("dynamic_temperature: operands are (f32 logits, f32 t, f32 range, f32 exponent)")
    return Type(F32, broadcast(*(t.shape for t in ts)))


def _xtc(ts, a):
    x, thr, prob, seed, pos = ts
    if (x.dtype, thr.dtype, prob.dtype, seed.dtype, pos.dtype) != (F32, F32, F32, U64, I32):
        raise TypeError_("xtc: operands are (f32 logits, f32 threshold, f32 probability, u64 seed, i32 position)")
    return Type(F32, broadcast(x.shape, thr.shape, prob.shape, seed.shape, pos.shape))


def _draw(ts, a):
    if ts[0].dtype != F32:
        raise TypeError_("expects f32 logits")
    if len(ts) == 3 and (ts[1].dtype != U64 or ts[2].dtype != I32):
        raise TypeError_("sample: operands are (f32 logits, u64 seed, i32 position)")
    return Type(I32, broadcast(*(t.shape for t in ts))[:-1] + (1,))


def _logprob_at(ts, a):
    x, at = ts
    if x.dtype != F32 or at.dtype != I32:
        raise TypeError_("logprob_at: operands are (f32 logits, i32 positions)")
    return Type(F32, broadcast(x.shape[:-1], at.shape[:-1]) + (1,))


def _sparse_add(ts, a):
    if len(a["ids"]) != len(a["values"]):
        raise TypeError_("sparse_add: ids and values differ in length")
    if any(not 0 <= i < 2 ** 31 for i in a["ids"]):
        raise TypeError_("sparse_add: token ids must lie in [0, 2**31)")
    return Type(_same_dtype(ts, (F32,)), ts[0].shape)


def _dry_repeats(ts, a):
    hist, x = ts
    if hist.dtype != I32 or x.dtype != F32 or len(hist.shape) != 2:
        raise TypeError_("dry_repeats: expects (i32 [B,H] history, f32 [B,V] x)")
    return Type(I32, broadcast(hist.shape[:-1], x.shape[:-1]) + x.shape[-1:])


def _penalties(ts, a):
    x, hist, last_n, *vals = ts
    if (x.dtype, hist.dtype, last_n.dtype) != (F32, I32, I32) or any(v.dtype != F32 for v in vals) \
            or len(hist.shape) != 2:
        raise TypeError_("penalties: operands are (f32 logits, i32 [B,H] history, i32 last_n, f32 repeat, "
                         "f32 frequency, f32 presence)")
    return Type(F32, broadcast(x.shape, hist.shape[:-1] + (1,), last_n.shape, *(v.shape for v in vals)))


def _dry(ts, a):
    x, hist, mult, base, allowed, last_n, breakers = ts
    if (x.dtype, hist.dtype, mult.dtype, base.dtype, allowed.dtype, last_n.dtype, breakers.dtype) != \
            (F32, I32, F32, F32, I32, I32, BOOL) or len(hist.shape) != 2 or len(breakers.shape) > 2:
        raise TypeError_("dry: operands are (f32 logits, i32 [B,H] history, f32 multiplier, f32 base, "
                         "i32 allowed_length, i32 last_n, bool breakers: [] false for none, [V] or [B,V])")
    return Type(F32, broadcast(x.shape, hist.shape[:-1] + (1,), mult.shape, base.shape, allowed.shape, last_n.shape,
                               breakers.shape))


def _penalties_overflow(ts, a):
    out = _penalties(ts, a)
    return Type(BOOL, out.shape[:-1])


_E = "elementwise"
OPS: dict[str, OpDef] = {d.name: d for d in [
    # elementwise arithmetic and comparison (numpy broadcasting)
    OpDef("add", 2, (), _arith, _E), OpDef("sub", 2, (), _arith, _E), OpDef("mul", 2, (), _arith, _E),
    OpDef("div", 2, (), _arith, _E), OpDef("maximum", 2, (), _arith, _E), OpDef("minimum", 2, (), _arith, _E),
    OpDef("lt", 2, (), _compare, _E), OpDef("le", 2, (), _compare, _E), OpDef("gt", 2, (), _compare, _E),
    OpDef("ge", 2, (), _compare, _E), OpDef("eq", 2, (), _compare, _E), OpDef("ne", 2, (), _compare, _E),
    OpDef("logical_and", 2, (), _logical, _E), OpDef("logical_or", 2, (), _logical, _E),
    OpDef("logical_not", 1, (), _logical, _E),
    OpDef("bit_and", 2, (), _bits, _E), OpDef("bit_or", 2, (), _bits, _E), OpDef("bit_xor", 2, (), _bits, _E),
    OpDef("shl", 2, (), _bits, _E), OpDef("shr", 2, (), _bits, _E),
    OpDef("neg", 1, (), _arith, _E), OpDef("abs", 1, (), _arith, _E),
    OpDef("exp", 1, (), _float_unary, _E), OpDef("log", 1, (), _float_unary, _E),
    OpDef("sqrt", 1, (), _float_unary, _E),
    OpDef("isnan", 1, (), _float_pred, _E), OpDef("isposinf", 1, (), _float_pred, _E),
    OpDef("isfinite", 1, (), _float_pred, _E),
    OpDef("cast", 1, (("dtype", "dtype"),), _cast, "convert dtype (float->int truncates)"),
    OpDef("where", 3, (), _where, "select: cond ? a : b"),
    OpDef("const", 0, (("value", "scalar"), ("dtype", "dtype")), _const, "a scalar constant"),
    # shapes
    OpDef("expand", 1, (), _expand, "append a unit axis: [B] -> [B,1]"),
    OpDef("squeeze", 1, (), _squeeze, "drop a unit last axis: [B,1] -> [B]"),
    OpDef("iota", 1, (), _iota, "0..n-1 over the operand's last axis, i32"),
    OpDef("slice", 1, (("start", "int"), ("stop", "int")), _slice, "x[..., start:stop]"),
    # reductions over the last axis, keeping it as size 1
    OpDef("reduce_max", 1, (), _reduce((F32, I32)), "max over the last axis"),
    OpDef("reduce_min", 1, (), _reduce((F32, I32)), "min over the last axis"),
    OpDef("reduce_sum", 1, (), _reduce((F32, I32)), "sum over the last axis"),
    OpDef("reduce_any", 1, (), _reduce((BOOL,)), "any over the last axis"),
    OpDef("argmax", 1, (), _reduce((F32, I32, BOOL), I32), "index of the max, lowest on ties"),
    # ordering, scans and selection
    OpDef("sort", 1, (("descending", "bool"),), _same, "sort along the last axis"),
    OpDef("argsort", 1, (("descending", "bool"),), _argsort, "stable argsort; ties keep id order"),
    OpDef("topk", 1, (("k", "int"),), _topk(None),
          "the k largest values, descending (partition, no sort); -inf past the row's length"),
    OpDef("topk_ids", 1, (("k", "int"),), _topk(I32), "ids of the k largest, descending, lowest id first on ties"),
    OpDef("kth_largest", 2, (), _kth,
          "the min(max(k,1),V)-th largest value of x (k may differ per row); a selection by count, no sort"),
    OpDef("mass_threshold", 3, (), _mass_threshold,
          "(key, weight, target): the largest t <= max(key) with sum(weight[key >= t]) >= target, -inf if none (a cut on the "
          "key's order by the weight above it: top_p's floor, typical_p's cutoff); a selection by mass, no sort"),
    OpDef("kth_largest_static", 1, (("k", "int"),), _kth_static,
          "kth_largest with a constant k, by partial selection (no full sort)"),
    OpDef("filter", 2, (), _filter,
          "where(keep, x, -inf) where keep always holds the argmax of x (top_k/top_p/min_p/... guarantee it)"),
    OpDef("zeros_like", 1, (("dtype", "dtype"),), _cast, "zeros shaped like the operand"),
    OpDef("take_along", 2, (), _take_along, "gather along the last axis"),
    OpDef("scatter_add", 3, (), _scatter_add, "base with updates added at indices along the last axis"),
    OpDef("put_along", 3, (), _scatter_add,
          "base with values written at indices along the last axis (a repeated index gets equal values)"),
    OpDef("sparse_add", 1, (("ids", "ints"), ("values", "floats")), _sparse_add,
          "x[..., ids] += values (a constant logit bias)"),
    # randomness
    OpDef("random_bits", 3, (), _random_bits,
          "first word of Threefry-2x32-20(key(seed), (counter0, counter1)); the only source of randomness"),
    OpDef("count_at", 3, (), _count_at,
          "(ids, weights, x): for each entry, the total weight of the entries with the same id (x: the "
          "vocabulary, for long histories); the counts a penalty reads, without a [B, V] array for short ones"),
    # stages (spec section 2) as ops that say what they mean: the passes rewrite at this level, and each has a
    # kernel that runs its dense definition (its expansion into the ops above: samplec/frontend/expand.py); a
    # chain of them ending in a draw may be covered by one kernel that chooses its algorithm per row
    OpDef("temperature", 2, (), _stage(F32), "stage, monotone map: x / t (t > 0); t == 0 keeps the argmax alone"),
    OpDef("top_k", 2, (), _stage(I32), "stage, cut on the logit order by count: keep x >= the k-th largest"),
    OpDef("top_p", 2, (), _stage(F32), "stage, cut on the logit order by mass: keep S_i < p"),
    OpDef("min_p", 2, (), _stage(F32), "stage, cut on the logit order by value: keep x >= max + ln m"),
    OpDef("top_n_sigma", 2, (), _stage(F32), "stage, cut on the logit order by value: keep x >= max - n * std"),
    OpDef("greedy", 1, (), _draw, "stage, terminal: the position of the maximum, lowest on ties [B,1]"),
    OpDef("sample", 3, (), _draw,
          "stage, terminal (x, seed, position): Gumbel-max draw with RandomBits at (token id, position) [B,1]"),
    OpDef("logprob_at", 2, (), _logprob_at, "log softmax(x) at positions [B,1]: a terminal's logprob"),
    OpDef("log_softmax", 1, (), _float_unary,
          "x - max - log(sum(exp(x - max))) along the last axis (the model's distribution of raw_logprob and "
          "top_logprobs, a terminal's logprob)"),
    OpDef("typical_p", 2, (), _stage(F32), "stage, cut by the score |-log p - H|: keep the typical set"),
    OpDef("penalties", 6, (), _penalties,
          "stage, elementwise edit (x, history, last_n, repeat, frequency, presence): where a token of the history's "
          "last last_n entries (-1: all; ids < 0 are padding) was seen c > 0 times, x -> (x > 0 ? x / repeat : "
          "x * repeat) - (c * frequency + presence); every other logit unchanged"),
    OpDef("penalties_overflow", 6, (), _penalties_overflow,
          "(the operands of a `penalties`): bool [B], whether a logit that stage penalizes is +inf or NaN, or it "
          "leaves the row no finite logit (its check)"),
    OpDef("xtc", 5, (), _xtc,
          "stage (x, threshold, probability, seed, position): with chance `probability`, remove the tokens with "
          "p >= threshold but the least probable of them"),
    OpDef("dry_repeats", 2, (), _dry_repeats,
          "(history h, x): for each token v of x's vocabulary, the largest n such that some h[p] = v (p >= 1, "
          "h[p-1] >= 0) follows a copy of the history's last n entries, h[p-n..p-1] = h[H-n..H-1] (entries < 0 "
          "never match); -1 if v follows no entry. DRY's repeat search: [B, H, H] comparisons"),
    OpDef("epsilon", 2, (), _stage(F32),
          "stage, cut on the logit order by probability: keep p >= e and every token at the maximum"),
    OpDef("eta", 2, (), _stage(F32),
          "stage, cut on the logit order by probability: keep p >= min(e, sqrt(e) * exp(-H)) and every token at "
          "the maximum"),
    # (new ops go last: an op's place here is its number in the .smpb format's union)
    OpDef("dynamic_temperature", 4, (), _dynamic_temperature,
          "stage, monotone map (x, t, range, exponent): llama.cpp temp_ext, temperature(T) with T between "
          "max(0, t - range) and t + range by the kept tokens' normalized entropy; range == 0 is temperature(t)"),
    OpDef("cumsum", 1, (), _cumsum, "inclusive prefix sums along the last axis (i32 or f32)"),
    OpDef("top_k_rank", 2, (), _stage(I32),
          "stage, cut on the logit order by count: keep the k largest by rank, the lowest ids first among equal "
          "values (mirostat's truncation); k <= 0 keeps all"),
    OpDef("dry", 7, (), _dry,
          "stage, edit (x, history, multiplier, base, allowed_length, last_n, breakers): llama.cpp DRY -- a token "
          "that would extend a repeat of the history's last last_n entries (-1: all; ids < 0 are padding) of "
          "length n >= allowed_length (counted back to the last breaker) gets x -= multiplier * base^(n - "
          "allowed_length); every other logit unchanged; multiplier == 0 is off"),
]}

def _coin_ids(ts):
    if len(ts[0].shape) < 1:
        raise TypeError_("coin_ids: the operand is a row")
    return Type(U32, ("V+1",))


def _pack(ts: list[Type]) -> Type:
    if not ts:
        raise TypeError_("pack: no operands")
    d = _same_dtype(ts)
    for t in ts:
        if len(t.shape) != 2 or t.shape[1] != 1:
            raise TypeError_(f"pack: its operands are [B,1] row values, got {t}")
    return Type(d, (broadcast(*(t.shape for t in ts))[0], len(ts)))


# Target-level ops: made only by the target pass (samplec/passes/target.py), never stored in a .smpb (a file holds
# the stage-level graph and is lowered again when loaded) and never read from one.
TARGET_OPS: dict[str, OpDef] = {d.name: d for d in [
    OpDef("gather", 2, (), _take_along,
          "take_along at indices the target pass made (in range by construction: no clamp)"),
    OpDef("candidates", 1, (("places", "int"),), lambda ts, a: Type(I32, ts[0].shape[:-1] + ("N",)),
          "the ids of the row's N = min(places, V) largest values (NaN first), by value descending and equal values "
          "by id: a partition and a sort of N (the portable lowering on the CPU)"),
    OpDef("sum", 1, (), _reduce((F32, I32)), "sum over the last axis in the device's order: one reduction"),
    OpDef("place", 1, (("index", "int"),), lambda ts, a: Type(ts[0].dtype, ts[0].shape[:-1] + (1,)),
          "x[..., min(index, V - 1)] as [..., 1]: a view (index >= 0)"),
    OpDef("coin_ids", 1, (), lambda ts, a: _coin_ids(ts),
          "u32[V+1]: xtc's coin counter 0xFFFFFFFF, then every token id of the operand's row (spec §4; a constant)"),
    OpDef("tail", 1, (("start", "int"),), lambda ts, a: Type(ts[0].dtype, ts[0].shape[:-1] + ("V",)),
          "x[..., start:] (a view; the row the lowering widened by `start` columns)"),
    OpDef("last_index", 1, (), lambda ts, a: Type(I32, (1,)), "V - 1 for the operand's last axis, i32[1] (a constant once traced)"),
    OpDef("pack", -1, (), lambda ts, a: _pack(ts),
          "pack(a, b, ...): [B,1] values of one dtype side by side, [B,n] (any n >= 1): one kernel makes row values "
          "that several kernels read, each its column (a `place`)"),
    OpDef("counts", 3, (("form", "int"),), lambda ts, a: Type(F32, ts[0].shape),
          "counts(x, ids, valid): per token of x's row, how many of the ids (i32 [B,H]) where valid (bool [B,H]) "
          "name it -- one scatter of ones; an entry not valid counts in a column past the row, an id >= V in the "
          "one after it. `form`: which of equal ways the scatter's index is computed (the counts of one history "
          "over several windows share no node, each fused into its own kernel)"),
    OpDef("ids_over", 3, (("form", "int"),), lambda ts, a: Type(BOOL, (ts[0].shape[0], 1)),
          "ids_over(x, ids, valid): whether a row of ids names a token >= V, valid or not -- the column after the "
          "row of counts(x, ids, valid)'s scatter (the same scatter: no kernel of its own)"),
]}
ALL_OPS: dict[str, OpDef] = {**OPS, **TARGET_OPS}

STAGE_OPS = ("temperature", "top_k", "top_p", "min_p", "top_n_sigma", "typical_p", "xtc", "epsilon", "eta",
             "dynamic_temperature", "top_k_rank")  # x -> x
DRAW_OPS = ("greedy", "sample")


def op(name: str) -> OpDef:
    return OPS[name]


def markdown_table() -> str:
    """The op table as the markdown table in docs/compiler.md (a test keeps the doc equal to it)."""
    rows = ["| op | operands | attributes | meaning |", "|---|---|---|---|"]
    for d in OPS.values():
        rows.append(f"| `{d.name}` | {d.arity} | {', '.join(a for a, _ in d.attrs) or '—'} | {d.doc} |")
    return "\n".join(rows)

