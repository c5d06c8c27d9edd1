"""The stage table: every stage a kernel runs is declared once here (code, operands, off rule, algebra).

Beside the op table (samplec/ir/ops.py, which says what each IR op *is*), this table says how the kernels run the
stage ops: the number a kernel's switch reads for each (the chain's stage list, its terminal, its prefix edits),
the operands a kernel takes after the logits, the value at which a stage changes nothing (its off rule), and its
algebra -- a cut on the logit order (and by what), a monotone map, an elementwise edit, or a terminal draw.

`scripts/gen_stage_table.py` writes it into samplec/backend_mlx/stage_table.h, the header that the CPU's C++
kernel (native/) and the GPU source include: every kernel reads the same codes and the same off predicates, and
tests/test_stage_table.py fails where a kernel or the Python side disagrees with this table.

Codes are numbered per algebra group, since each group is a different argument of the kernels: cuts and maps
(`STAGES`: the chain's stage list) in the op table's order, which is also the order of their members in the
.smpb `union Op` (`smpb_type`: no file format change); terminals (`TERMINALS`); edits (`EDITS`: the prefix ops a
chain kernel applies as it reads the row, and penalties, which it reads as a list of edits).

An off rule is written once, as an expression over the stage's operand names (and `V`, the vocabulary size) in the
small common subset of Python and C: comparisons, numbers, `and` / `or`. The header gets it as a C macro, Python
as a predicate (`off`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from samplec.ir.ops import OPS

ALGEBRAS = ("cut", "map", "edit", "terminal")
CUT_KINDS = ("count", "mass", "value", "probability", "score", "coin")
OPERAND_TYPES = ("f32", "i32", "u32", "u64", "tokens", "mask", "bias")


@dataclass(frozen=True)
class Operand:
    name: str
    type: str          # as a kernel reads it: one of OPERAND_TYPES


@dataclass(frozen=True)
class StageDef:
    name: str                     # the stage (for cuts, maps and terminals: its IR op)
    code: int                     # the kernels' number for it, within its algebra group
    algebra: str                  # one of ALGEBRAS
    operands: tuple[Operand, ...]  # after the logits, in the kernels' order
    off: str | None               # the rule under which it changes nothing (None: it always acts)
    cut: str | None = None        # for a cut: what it cuts by (CUT_KINDS)
    op: str | None = None         # the IR op that carries it (None: a prefix edit built from plain ops)
    doc: str = ""


def _ops(*spec: str) -> tuple[Operand, ...]:
    """'name:type' each."""
    return tuple(Operand(*s.split(":")) for s in spec)


# The chain's stages: codes 0.. in the op table's order (the .smpb union's order).
STAGES: tuple[StageDef, ...] = (
    StageDef("temperature", 0, "map", _ops("t:f32"), "t == 1", op="temperature",
             doc="x / t; t == 0 (or a t the largest logit overflows under) keeps the argmax alone"),
    StageDef("top_k", 1, "cut", _ops("k:i32"), "k <= 0 or k >= V", cut="count", op="top_k",
             doc="keep x >= the k-th largest (ties at it kept)"),
    StageDef("top_p", 2, "cut", _ops("p:f32"), "p >= 1", cut="mass", op="top_p",
             doc="keep i iff the mass strictly above p_i is below p"),
    StageDef("min_p", 3, "cut", _ops("m:f32"), "m == 0", cut="value", op="min_p",
             doc="keep x >= max + ln m"),
    StageDef("top_n_sigma", 4, "cut", _ops("n:f32"), "n <= 0", cut="value", op="top_n_sigma",
             doc="keep x >= max - n * std (over the kept tokens)"),
    StageDef("typical_p", 5, "cut", _ops("m:f32"), "m >= 1", cut="score", op="typical_p",
             doc="keep the scores |-log p - H| up to where their ascending mass reaches m"),
    StageDef("xtc", 6, "cut", _ops("threshold:f32", "probability:f32", "seed:u64", "position:u32"),
             "probability == 0", cut="coin", op="xtc",
             doc="with chance probability: of two or more tokens with p >= threshold, keep the least probable"),
    StageDef("epsilon", 7, "cut", _ops("e:f32"), "e == 0", cut="probability", op="epsilon",
             doc="keep p >= e and every token at the maximum"),
    StageDef("eta", 8, "cut", _ops("e:f32"), "e == 0", cut="probability", op="eta",
             doc="keep p >= min(e, sqrt(e) * exp(-H)) and every token at the maximum"),
    StageDef("dynamic_temperature", 9, "map", _ops("t:f32", "range:f32", "exponent:f32"),
             "t == 1 and range == 0", op="dynamic_temperature",
             doc="temperature(T), T from the kept tokens' normalized entropy between t - range and t + range"),
    StageDef("top_k_rank", 10, "cut", _ops("k:i32"), "k <= 0 or k >= V", cut="count", op="top_k_rank",
             doc="keep the k largest by rank, the lowest ids first among equal values"),
)

TERMINALS: tuple[StageDef, ...] = (
    StageDef("greedy", 0, "terminal", (), None, op="greedy", doc="the argmax, lowest id on ties"),
    StageDef("sample", 1, "terminal", _ops("seed:u64", "position:u32"), None, op="sample",
             doc="Gumbel-max with RandomBits at (token id, position)"),
)

EDITS: tuple[StageDef, ...] = (
    StageDef("allow", 0, "edit", _ops("mask:mask"), None, doc="x_i -> -inf where the mask is false"),
    StageDef("logit_bias", 1, "edit", _ops("b:bias"), None, doc="x -> x + b"),
    StageDef("penalties", 2, "edit",
             _ops("history:tokens", "last_n:i32", "repeat:f32", "frequency:f32", "presence:f32"),
             "repeat == 1 and frequency == 0 and presence == 0", op="penalties",
             doc="the counted history's tokens: x / repeat (x > 0) or x * repeat, minus c * frequency + presence"),
    StageDef("dry", 3, "edit",
             _ops("history:tokens", "multiplier:f32", "base:f32", "allowed_length:i32", "last_n:i32", "breakers:mask"),
             "multiplier == 0", op="dry",
             doc="a token extending a repeat of the history of length n >= allowed_length: x - multiplier * "
                 "base^(n - allowed_length) (a GPU target's DRY kernel, beside the chain kernel)"),
)

TABLE: tuple[StageDef, ...] = STAGES + TERMINALS + EDITS
BY_NAME: dict[str, StageDef] = {s.name: s for s in TABLE}

# What the kernels read per group (name -> code): the chain's stages, its terminal, its prefix edits.
STAGE_CODES: dict[str, int] = {s.name: s.code for s in STAGES}
TERMINAL_CODES: dict[str, int] = {s.name: s.code for s in TERMINALS}
EDIT_CODES: dict[str, int] = {s.name: s.code for s in EDITS}

# Thresholds of spec section 4 that every kernel's draw and coin use.
XTC_COUNTER = 0xFFFFFFFF          # the xtc coin's first counter word
THREEFRY_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
THREEFRY_PARITY = 0x1BD11BDA


def stage(name: str) -> StageDef:
    if name not in BY_NAME:
        raise KeyError(f"no stage {name!r} in the stage table")
    return BY_NAME[name]


_WORDS = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def off_names(s: StageDef) -> list[str]:
    """The names an off rule reads, in operand order (then V)."""
    used = set(_WORDS.findall(s.off or "")) - {"and", "or"}
    return [o.name for o in s.operands if o.name in used] + (["V"] if "V" in used else [])


def off_c(s: StageDef, names: dict[str, str] | None = None) -> str:
    """The off rule as a C expression, each name in parentheses (or replaced by `names`)."""
    names = names or {}
    text = _WORDS.sub(lambda m: {"and": "&&", "or": "||"}.get(m[0], f"({names.get(m[0], m[0])})"), s.off)
    return f"({text})"


def off(name: str, **values) -> bool:
    """Whether the stage changes nothing for these operand values (and V), as the kernels' predicate decides."""
    s = stage(name)
    if s.off is None:
        return False
    return bool(eval(s.off, {"__builtins__": {}}, values))   # (an expression of this module's own table)


def smpb_type(name: str) -> int:
    """The .smpb `union Op` member (its type number: 1 + the op's place in the op table) that carries the stage."""
    s = stage(name)
    if s.op is None:
        raise KeyError(f"stage {name!r} is not one op in .smpb")
    return list(OPS).index(s.op) + 1


def check() -> None:
    """The table's own consistency: codes dense per group, known kinds, rules over known names."""
    for group in (STAGES, TERMINALS, EDITS):
        assert [s.code for s in group] == list(range(len(group))), "codes must be 0.. in order within a group"
    for s in TABLE:
        assert s.algebra in ALGEBRAS and all(o.type in OPERAND_TYPES for o in s.operands), s.name
        assert (s.cut in CUT_KINDS) == (s.algebra == "cut"), s.name
        assert s.op is None or s.op in OPS, s.name
        names = {o.name for o in s.operands} | {"V", "and", "or"}
        assert set(_WORDS.findall(s.off or "")) <= names, s.name
    order = [list(OPS).index(s.op) for s in STAGES]
    assert order == sorted(order), "the chain stages' codes follow the op table's (the .smpb union's) order"


check()
