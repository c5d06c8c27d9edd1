"""Checks a later check implies: the portable target tests them through that check, and a call it flags is run
again with every check to name the one that fired.

A row is *bad* when it holds a NaN or a +inf, or no finite entry (every entry -inf). A penalties stage's check
(`penalties_overflow`) tests exactly that of the row it writes, and the stages between the logits and a penalties
stage keep a bad row bad:

- `add` (logit_bias, dense) and `sparse_add` (logit_bias, a dict): NaN + b is NaN, +inf + b is +inf or NaN, and a row
  of -inf plus any b holds only -inf and NaN -- whichever operand was bad;
- `penalties` with its finite parameters (repeat in (0, inf), frequency and presence finite): NaN stays NaN, +inf
  divided by repeat and less a finite amount stays +inf, -inf times repeat and less a finite amount stays -inf, and a
  token the window does not hold is unchanged;
- `allow` (where(mask, x, -inf)) keeps a row of -inf a row of -inf -- but it may remove the NaN or +inf of a row.

So where an earlier check tests that a row is bad in one of those ways (the logits' checks, allow's and logit_bias'
checks: a row maximum that is NaN, +inf or -inf) and the stages from that row to a penalties stage keep it so, every
row the earlier check flags the penalties check flags too. On the portable target that earlier check costs a
reduction over the row (and, where the row is read by the chain too, the row written out for it: one more kernel);
`cover_checks` drops it, and the penalties check's message says which checks it stands for. A call that such a check
flags is rare (bad input): `Program` runs it again with every check (a program compiled with `every_check=True`) and
raises the first that fired, naming its rows, exactly as without this pass.
"""
from __future__ import annotations

import math

from samplec.ir.graph import Check, Graph, Node

IMPLIES = " (or a check it implies: "
HOT, EMPTY = "NaN or +inf", "no finite entry"


def _row_of_max(m: Node) -> Node | None:
    """The row whose maximum m is ([B,1] or squeezed): a reduce_max, or the row at its argmax (a NaN's place)."""
    if m.op == "squeeze":
        m = m.inputs[0]
    if m.op == "reduce_max":
        return m.inputs[0]
    if m.op == "take_along" and m.inputs[1].op == "argmax" and m.inputs[1].inputs[0] is m.inputs[0]:
        return m.inputs[0]
    return None


def row_test(flag: Node) -> tuple[Node, str] | None:
    """(row, HOT or EMPTY) where the flag is true only on rows whose row is bad that way: its maximum is -inf
    (EMPTY), +inf, or NaN or +inf (HOT)."""
    f = flag
    while f.op == "squeeze" or f.op == "reduce_any" and f.inputs[0].type.shape[-1] == 1:    # (one value a row)
        f = f.inputs[0]
    if f.op == "eq" and f.inputs[1].is_const(-math.inf):
        m, kind = f.inputs[0], EMPTY
    elif f.op == "isposinf":
        m, kind = f.inputs[0], HOT
    elif f.op == "logical_or" and sorted(i.op for i in f.inputs) == ["isnan", "isposinf"] and \
            f.inputs[0].inputs[0] is f.inputs[1].inputs[0]:
        m, kind = f.inputs[0].inputs[0], HOT
    else:
        return None
    row = _row_of_max(m)
    return None if row is None else (row, kind)


def kept_bad(x: Node) -> dict[int, set[str]]:
    """id(row) -> the ways a row that bad makes `x` bad (module doc): x itself, and the rows the stages before it
    read, walked back while they keep a bad row bad."""
    out: dict[int, set[str]] = {}
    stack = [(x, frozenset((HOT, EMPTY)))]
    while stack:
        n, kinds = stack.pop()
        if kinds <= out.get(id(n), set()):
            continue
        out.setdefault(id(n), set()).update(kinds)
        if n.op == "add" and n.type.shape[-1] == "V":
            stack += [(i, kinds) for i in n.inputs if i.type.dtype == "f32" and i.type.shape[-1:] == ("V",)]
        elif n.op in ("sparse_add", "penalties"):
            stack.append((n.inputs[0], kinds))
        elif n.op == "where" and n.inputs[2].is_const(-math.inf) and n.inputs[0].type.dtype == "bool":
            if EMPTY in kinds:
                stack.append((n.inputs[1], frozenset((EMPTY,))))
    return out


def cover_checks(g: Graph) -> Graph:
    """g without the checks a penalties stage's check implies (module doc); each penalties check that stands for
    some names them in its message (the penalties checks of a run are one check: they all do)."""
    covering = [c for c in g.checks if c.flag.op == "penalties_overflow"]
    if not covering:
        return g
    reach = [kept_bad(c.flag.inputs[0]) for c in covering]
    implied, kept = [], []
    for c in g.checks:
        t = row_test(c.flag)
        if t is not None and any(t[1] in r.get(id(t[0]), ()) for r in reach):
            implied.append(c.message)
        else:
            kept.append(c)
    if not implied:
        return g
    names = "; ".join(dict.fromkeys(implied))
    stands = {c.message for c in covering}
    checks = tuple(Check(c.flag, f"{c.message}{IMPLIES}{names})") if c.message in stands else c for c in kept)
    return Graph(g.name, g.params, g.outputs, checks, g.regions)
