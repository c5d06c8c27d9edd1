"""Row values side by side: the per-row values ([B,1]) of the portable lowering that several kernels read, made by one
kernel a level instead of one kernel each -- horizontal fusion, which MLX's `compile` does not do.

MLX's `compile` fuses elementwise ops vertically: a value read by one kernel is computed inside it, and a value that
two kernels read (or a gather, a reduction, an output) is a kernel of its own. The portable lowering makes many such
row values -- the temperature's greedy flag and the row's scaled maximum, min_p's floor, the place top_k reads, the
log-probabilities a call returns -- each a launch of a few bytes on a GPU. This pass makes the shared values of one
level and one dtype one `pack` (a [B,n] row: one kernel computes all n, with the elementwise ops they read at that
level fused in), and every reader reads its column (a `place`, a view).

A value is shared where MLX would make it a kernel of its own: an elementwise [B,1] node read by a node that is not
elementwise (a gather's index, a reduction, an output) or by two or more nodes. A check's flag is not: the checks'
flags are packed into words by one kernel already (interpreter.pack_flags). A node's level is the number of
non-elementwise nodes on its longest path from the inputs; inside a pack, a value of its level is computed, not read
back, so a pack reads only nodes and packs of lower levels, and of its own level only the packs that come before it
(by dtype: `RANK`), which keeps the graph acyclic. Packing moves values and never changes one: the tokens are the
same bits.

A shared flag (a bool row value: the temperature's greedy test, read by every kernel of the chain) is not packed:
each reader computes its own (`mirror_row_flags`), by a form of the same test that shares no node with the others'
-- `v - v != 0`, `v * 0 != 0`, `not (v < inf and v > -inf)`, `not (-inf < v and inf > v)`, ... for
`not isfinite(v)`; `b > a` for `a < b` -- so that MLX's compile, which merges equal nodes, leaves each inside the
kernel that reads it: one launch fewer for every chain with a temperature. The forms give the same bits on every
float, NaN and infinities included (MLX builds its kernels without fast math).
"""
from __future__ import annotations

import math

import numpy as np

from samplec.ir.graph import INPUT, Graph, Node, make
from samplec.ir.types import BOOL, F32
from samplec.passes.portable import ELEMENTWISE, MIRROR
from samplec.passes.rewrite import rebuild, rewrite
from samplec.passes.rules import const_of

VIEWS = frozenset({"expand", "squeeze"})      # (no kernel: what reads them reads the value)
RANK = {"f32": 0, "i32": 1, "u32": 2, "u64": 3, "bool": 4}     # (the order of a level's packs)


def _row_value(n: Node) -> bool:
    return n.op in ELEMENTWISE and len(n.type.shape) == 2 and n.type.shape[1] == 1 and n.type.shape[0] != 1


_F32_MAX = float(np.finfo(np.float32).max)


def _infinite_forms(v: Node) -> list[Node]:
    """`logical_not(isfinite(v))` (v f32) written so that no two forms share a node but v and constants, the
    shallowest first (MLX's compile fuses at most ~11 levels into a kernel): each is true exactly where v is NaN or
    an infinity."""
    c = lambda x: const_of(x, F32)
    no = lambda a, b: make("logical_not", make("logical_and", a, b))
    return [make("ne", make("sub", v, v), c(0.0)),          # (inf - inf and NaN - NaN are NaN)
            make("ne", make("mul", v, c(0.0)), c(0.0)),     # (inf * 0 is NaN; -0.0 == 0)
            make("logical_not", make("lt", make("abs", v), c(math.inf))),
            no(make("lt", v, c(math.inf)), make("gt", v, c(-math.inf))),
            no(make("gt", c(math.inf), v), make("lt", c(-math.inf), v)),
            no(make("le", v, c(_F32_MAX)), make("ge", v, c(-_F32_MAX))),
            no(make("ge", c(_F32_MAX), v), make("le", c(-_F32_MAX), v)),
            make("logical_not", make("isfinite", v))]


def _leaf(n: Node) -> bool:
    """Not computed by the kernel that reads it: an input, a constant, a view, a gather or a reduction."""
    return n.op not in ELEMENTWISE


def forms(n: Node) -> list[Node]:
    """Expressions of the same bits as the bool row value n that share no node but their leaves (`_leaf`): n first,
    then its other forms (n itself where it has none known here, or last)."""
    if n.op == "logical_not" and n.inputs[0].op == "isfinite" and n.inputs[0].inputs[0].type.dtype == F32 and \
            _leaf(n.inputs[0].inputs[0]):
        return _infinite_forms(n.inputs[0].inputs[0])
    if n.op in MIRROR and all(_leaf(i) for i in n.inputs):
        return [n, make(MIRROR[n.op], n.inputs[1], n.inputs[0])]
    if n.op in ("logical_and", "logical_or"):
        (a, *fa), (b, *fb) = forms(n.inputs[0]), forms(n.inputs[1])
        return [n] + [make(n.op, *((x, y) if i % 2 else (y, x))) for i, (x, y) in enumerate(zip(fa, fb))]
    return [n]


def mirror_row_flags(g: Graph) -> Graph:
    """g with each bool row value that two or more elementwise nodes read, and nothing else, computed by each of them
    in a form of its own (`forms`, module doc), where it has enough forms."""
    users = g.users()
    roots = {id(n) for _, n in g.outputs} | {id(c.flag) for c in g.checks}
    order = g.toposort()
    plan: dict[int, list[int]] = {}        # flag -> its readers, in the order of its forms
    for n in order:
        if not _row_value(n) or n.type.dtype != BOOL or id(n) in roots:
            continue
        got = list(dict.fromkeys(id(u) for u in users.get(id(n), [])))
        if len(got) >= 2 and all(u.op in ELEMENTWISE for u in users[id(n)]) and len(forms(n)) >= len(got):
            plan[id(n)] = got
    if not plan:
        return g
    new: dict[int, Node] = {}
    made: dict[int, list[Node]] = {}        # flag -> its forms (of the flag as rebuilt)
    for n in order:
        if n.op == INPUT:
            continue
        ins = []
        for i in n.inputs:
            i2 = new.get(id(i), i)
            if id(i) in plan:
                fs = made.get(id(i)) or made.setdefault(id(i), forms(i2))
                i2 = fs[plan[id(i)].index(id(n))]
            ins.append(i2)
        if any(a is not b for a, b in zip(ins, n.inputs)):
            new[id(n)] = rebuild(n, tuple(ins))
    return g.replace(new)


def pack_row_values(g: Graph) -> Graph:
    """g with its shared row values packed a level and a dtype at a time, its shared flags computed by each reader
    (module doc)."""
    return mirror_row_flags(_packed(rewrite(g, (), cse=True)))  # (equal nodes are one value: MLX merges them too)


def _packed(g: Graph) -> Graph:
    order = g.toposort()
    users = g.users()
    outputs = {id(n) for _, n in g.outputs}
    flags = {id(c.flag) for c in g.checks}

    def readers(n: Node) -> list[Node]:
        """What reads n, seen through views (an output or a check's flag that is a view counts as a reader)."""
        out = []
        for u in users.get(id(n), []):
            out.extend(readers(u) if u.op in VIEWS and id(u) not in outputs | flags else [u])
        return out

    def shared(n: Node) -> bool:
        if not _row_value(n) or id(n) in flags or any(id(u) in flags for u in users.get(id(n), [])):
            return False
        got = readers(n)
        return id(n) in outputs or len(got) > 1 or any(u.op not in ELEMENTWISE or id(u) in outputs for u in got)
    level: dict[int, int] = {}
    for n in order:
        up = max((level[id(i)] for i in n.inputs), default=0)
        level[id(n)] = up + (n.op != INPUT and n.op not in ELEMENTWISE and n.op not in VIEWS)
    groups: dict[tuple, list[Node]] = {}
    for n in order:
        if shared(n):
            groups.setdefault((level[id(n)], n.type.dtype), []).append(n)
    at = {id(m): (key, j) for key, members in groups.items() if len(members) > 1 for j, m in enumerate(members)}
    if not at:
        return g
    new: dict[int, Node] = {}
    within: dict[int, Node] = {}
    packs: dict[tuple, Node] = {}

    def pack(key: tuple) -> Node:
        got = packs.get(key)
        if got is None:
            got = packs[key] = make("pack", *(inside(m, key) for m in groups[key]))
        return got

    def inside(n: Node, key: tuple) -> Node:
        """n as the pack `key` computes it: its members, the elementwise nodes of its level they read, and the
        members of the packs of its level that come after it (a pack reads only those before it: no cycle)."""
        other = at.get(id(n), (key,))[0]
        if other != key and (other[0] != key[0] or RANK[other[1]] < RANK[key[1]]) or n.op == INPUT or \
                (n.op not in ELEMENTWISE and n.op not in VIEWS) or level[id(n)] > key[0] or \
                (level[id(n)] != key[0] and id(n) not in at):
            return value(n)
        got = within.get(id(n))
        if got is None:
            got = within[id(n)] = rebuild(n, tuple(inside(i, key) for i in n.inputs))
        return got

    def value(n: Node) -> Node:
        got = new.get(id(n))
        if got is None:
            if id(n) in at:
                key, j = at[id(n)]
                got = make("place", pack(key), index=j, name=n.name)
            else:
                got = rebuild(n, tuple(value(i) for i in n.inputs)) if n.op != INPUT else n
            new[id(n)] = got
        return got

    for n in order:          # (in order: the recursion stays shallow)
        value(n)
    return g.replace(new)
