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
"""
from __future__ import annotations

from samplec.ir.graph import INPUT, Graph, Node, make
from samplec.passes.portable import ELEMENTWISE
from samplec.passes.rewrite import rebuild, rewrite

VIEWS = frozenset({"expand", "squeeze"})      # (no kernel: what reads them reads the value)
RANK = {"f32": 0, "i32": 1, "u32": 2, "u64": 3, "bool": 4}     # (the order of a level's packs)


def _row_value(n: Node) -> bool:
    return n.op in ELEMENTWISE and len(n.type.shape) == 2 and n.type.shape[1] == 1 and n.type.shape[0] != 1


def pack_row_values(g: Graph) -> Graph:
    """g with its shared row values packed a level and a dtype at a time (module doc)."""
    g = rewrite(g, (), cse=True)    # (equal nodes are one value: MLX's compile merges them too)
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
