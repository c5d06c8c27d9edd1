"""Local rewrite rules, one small function and one comment each, grouped into the named passes."""
from __future__ import annotations

import math

import numpy as np

from samplec import stage_table
from samplec.ir.graph import Node, make
from samplec.ir.ops import STAGE_OPS
from samplec.ir.types import BOOL, F32, I32, U32, U64

NP = {F32: np.float32, I32: np.int32, U32: np.uint32, U64: np.uint64, BOOL: np.bool_}

_FOLD = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "maximum": np.maximum,
    "minimum": np.minimum, "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "eq": np.equal, "ne": np.not_equal, "logical_and": np.logical_and, "logical_or": np.logical_or,
    "logical_not": np.logical_not, "bit_and": np.bitwise_and, "bit_or": np.bitwise_or,
    "bit_xor": np.bitwise_xor, "shl": np.left_shift, "shr": np.right_shift, "neg": np.negative, "abs": np.abs,
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "isnan": np.isnan, "isposinf": np.isposinf,
    "isfinite": np.isfinite,
}


def const_value(n: Node):
    return NP[n.type.dtype](n.attr("value"))


def const_of(value, dtype: str) -> Node:
    v = NP[dtype](value)
    py = float(v) if dtype == F32 else int(v)
    return make("const", value=py, dtype=dtype)


def is_c(n: Node, value=None) -> bool:
    return n.is_const(value)


# ---- fold: evaluate ops whose operands are all scalar constants, in the op's own dtype -----------------------

def fold_constants(n: Node):
    """op(const, const, ...) -> const, computed with numpy scalars of the IR dtype (float32 stays float32)."""
    if n.op in _FOLD and n.inputs and all(i.op == "const" for i in n.inputs):
        with np.errstate(all="ignore"):
            return const_of(_FOLD[n.op](*(const_value(i) for i in n.inputs)), n.type.dtype)
    if n.op == "cast" and n.inputs[0].op == "const":
        with np.errstate(all="ignore"):
            return const_of(const_value(n.inputs[0]).astype(NP[n.attr("dtype")]), n.attr("dtype"))
    if n.op == "where" and all(i.op == "const" for i in n.inputs):
        c, a, b = n.inputs
        return a if const_value(c) else b
    return None


# ---- simplify: identities; with folded stage parameters these remove stages at their off value ---------------

def where_const(n: Node):
    """where(true, a, b) -> a; where(false, a, b) -> b  (an off stage's guard folded to a constant; the guard may
    be `c or true` / `c and false` of a wider shape, which logical_const cannot fold to a constant of that shape:
    temperature 0's `t == 0 or no token left` with t bound to 0)."""
    if n.op == "where" and n.inputs[1].type == n.type == n.inputs[2].type:
        truth = _truth(n.inputs[0])
        if truth is not None:
            return n.inputs[1] if truth else n.inputs[2]
    return None


def _truth(c: Node) -> bool | None:
    """The value of a boolean that is constant whatever its other operands hold (None: it depends on them)."""
    if c.op == "const":
        return bool(const_value(c))
    if c.op in ("logical_or", "logical_and"):
        absorbing = c.op == "logical_or"
        if any(_truth(i) is absorbing for i in c.inputs):
            return absorbing
    return None


def where_same(n: Node):
    """where(c, a, a) -> a."""
    if n.op == "where" and n.inputs[1] is n.inputs[2] and n.inputs[1].type == n.type:
        return n.inputs[1]
    return None


def where_nested(n: Node):
    """where(c, where(c, a, b), d) -> where(c, a, d); where(c, a, where(c, b, d)) -> where(c, a, d): the inner
    select under the same condition picks the same side (a stage's rule guarded twice by its own test: the
    penalties' `seen`). Two selects fewer in a row's kernel, whose depth MLX's compile limits."""
    if n.op != "where":
        return None
    c, a, d = n.inputs
    got = make("where", c, a.inputs[1], d, name=n.name) if a.op == "where" and a.inputs[0] is c else \
        make("where", c, a, d.inputs[2], name=n.name) if d.op == "where" and d.inputs[0] is c else None
    return got if got is not None and got.type == n.type else None     # (the shape the select had)


def reduce_one(n: Node):
    """reduce(x) -> x where x's last axis holds one entry (its maximum, minimum, sum or any is that entry)."""
    if n.op in ("reduce_max", "reduce_min", "reduce_sum", "reduce_any", "sum") and n.inputs[0].type == n.type:
        return n.inputs[0]
    return None


def logical_const(n: Node):
    """x and true -> x; x or false -> x; x and false -> false; x or true -> true (same shape only)."""
    if n.op not in ("logical_and", "logical_or"):
        return None
    absorbing = n.op == "logical_or"
    for a, b in (n.inputs, n.inputs[::-1]):
        if a.op == "const":
            if bool(const_value(a)) == absorbing and a.type == n.type:
                return a
            if bool(const_value(a)) != absorbing and b.type == n.type:
                return b
    return None


def arith_identity(n: Node):
    """x / 1 -> x; x * 1 -> x; x + 0 -> x; x - 0 -> x (exact in IEEE arithmetic, -0.0 aside)."""
    if n.op in ("div", "mul", "add", "sub") and n.type.dtype == F32:
        x, c = n.inputs
        unit = 1.0 if n.op in ("div", "mul") else 0.0
        if c.op == "const" and float(c.attr("value")) == unit and x.type == n.type:
            return x
        if n.op in ("mul", "add") and x.op == "const" and float(x.attr("value")) == unit and c.type == n.type:
            return c
    return None


def partition_top_k(n: Node):
    """kth_largest(x, const k) -> kth_largest_static{k}: select the k largest without sorting the vocabulary."""
    if n.op == "kth_largest" and n.inputs[1].op == "const" and int(n.inputs[1].attr("value")) >= 1:
        out = make("kth_largest_static", n.inputs[0], k=int(n.inputs[1].attr("value")), name=n.name)
        return out if out.type == n.type else None
    return None


# ---- stage level: rules over the stage ops, where the chain's algebra is visible ---------------------------------

# they keep the argmax (its lowest id), its value unchanged
CUTS = ("top_k", "top_p", "min_p", "top_n_sigma", "typical_p", "epsilon", "eta", "top_k_rank")
# a stage at its off value is the identity: the stage table's off rule, for the stages whose rule reads their first
# value (V is not known here: top_k's k >= V is left to the kernels)
_OFF = {s.name: (lambda v, s=s: stage_table.off(s.name, V=math.inf, **{s.operands[0].name: v}))
        for s in stage_table.STAGES if [n for n in stage_table.off_names(s) if n != "V"] == [s.operands[0].name]}


def xtc_off(n: Node):
    """xtc(x, thr, 0, ...) -> x: a coin that never fires."""
    if n.op == "xtc" and n.inputs[2].op == "const" and stage_table.off("xtc", probability=const_value(n.inputs[2])) \
            and n.inputs[0].type == n.type:
        return n.inputs[0]
    return None


def stage_off(n: Node):
    """stage(x, c) -> x where the constant c is the stage's off value (top_k(0), top_p(1), temperature(1), ...)."""
    if n.op in _OFF and n.inputs[1].op == "const" and _OFF[n.op](const_value(n.inputs[1])) \
            and n.inputs[0].type == n.type:
        return n.inputs[0]
    return None


def dry_off(n: Node):
    """dry(x, h, 0, ...) -> x: a multiplier of 0 penalizes nothing (the stage table's off rule)."""
    if n.op == "dry" and n.inputs[2].op == "const" and stage_table.off("dry", multiplier=const_value(n.inputs[2])) \
            and n.inputs[0].type == n.type:
        return n.inputs[0]
    return None


def dynamic_temperature_plain(n: Node):
    """dynamic_temperature(x, t, 0, e) -> temperature(x, t): a range of 0 is llama.cpp's plain temperature."""
    if n.op == "dynamic_temperature" and n.inputs[2].op == "const" and const_value(n.inputs[2]) == 0.0:
        out = make("temperature", n.inputs[0], n.inputs[1], name=n.name)
        return out if out.type == n.type else None
    return None


def empty_through_cuts(n: Node):
    """eq(reduce_max(cut(x)), -inf) -> eq(reduce_max(x), -inf): a cut keeps the row's maximum, so a row is empty
    after it only if it was before. (A "no token left" check reading a folded stage's result -- DRY at multiplier
    0 -- then leaves the cut one reader, the chain. A softmax's reduce_max is left alone: it must read its x.)"""
    if n.op == "eq" and n.inputs[1].is_const(-math.inf) and n.inputs[0].op == "reduce_max":
        x = n.inputs[0].inputs[0]
        while x.op in CUTS and x.inputs[0].type == x.type:
            x = x.inputs[0]
        if x is not n.inputs[0].inputs[0]:
            out = make("eq", make("reduce_max", x), n.inputs[1], name=n.name)
            return out if out.type == n.type else None
    return None


def _is_t0(x: Node) -> bool:
    return x.op == "temperature" and x.inputs[1].is_const(0.0)


def cut_after_t0(n: Node):
    """cut(temperature(x, 0)) -> temperature(x, 0): one token is left, and every cut keeps the most probable (xtc
    needs two tokens above its threshold to remove any)."""
    if (n.op in CUTS or n.op == "xtc") and _is_t0(n.inputs[0]) and n.inputs[0].type == n.type:
        return n.inputs[0]
    return None


def sample_t0(n: Node):
    """sample(temperature(x, 0), seed, pos) -> greedy(x): a draw from one token needs no noise."""
    if n.op == "sample" and _is_t0(n.inputs[0]):
        out = make("greedy", n.inputs[0].inputs[0], name=n.name)
        return out if out.type == n.type else None
    return None


def greedy_cuts(n: Node):
    """greedy(cut(x)) -> greedy(x), greedy(temperature(x, 0)) -> greedy(x): they all keep the argmax of x (lowest
    id on ties) with its value unchanged. (A temperature t > 0 stays: x / t can tie two different logits.)"""
    if n.op == "greedy":
        x = n.inputs[0]
        while x.op in CUTS or _is_t0(x):
            x = x.inputs[0]
        if x is not n.inputs[0]:
            out = make("greedy", x, name=n.name)
            return out if out.type == n.type else None
    return None


def greedy_plain(n: Node):
    """greedy(x) -> argmax(x) where x is no stage: nothing to fuse, and the argmax is shared with the logits check."""
    if n.op == "greedy" and n.inputs[0].op not in STAGE_OPS:
        return make("argmax", n.inputs[0], name=n.name)
    return None


def logprob_one_token(n: Node):
    """logprob_at(temperature(x, 0), pos) -> 0: the final distribution holds one token."""
    if n.op == "logprob_at" and _is_t0(n.inputs[0]):
        return make("zeros_like", n.inputs[1], dtype="f32")
    return None


def expand_stage(n: Node):
    """stage op -> its dense definition (samplec/frontend/expand.py)."""
    from samplec.frontend.expand import EXPAND, expand
    return expand(n) if n.op in EXPAND else None
