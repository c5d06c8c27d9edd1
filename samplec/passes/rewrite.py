"""The rewrite driver: apply local (pattern -> replacement) rules bottom-up until nothing changes.

A rule is a function `Node -> Node | None`. The driver rebuilds the graph bottom-up, hash-consing as it goes
(so it also does common-subexpression elimination when asked), and applies the rules to each rebuilt node until
none fires. A replacement must keep the node's type; the whole graph is swept until a fixed point, bounded.
"""
from __future__ import annotations

from typing import Callable, Iterable

from samplec.ir.graph import INPUT, Graph, Node, infer_type

Rule = Callable[[Node], "Node | None"]
MAX_SWEEPS = 16
MAX_RULE_STEPS = 64


class RewriteError(Exception):
    pass


def rebuild(node: Node, inputs: tuple[Node, ...]) -> Node:
    if all(a is b for a, b in zip(inputs, node.inputs)):
        return node
    return Node(node.op, inputs, node.attrs, infer_type(node.op, inputs, node.attr_dict), node.name)


def rewrite(g: Graph, rules: Iterable[Rule], cse: bool = False) -> Graph:
    rules = list(rules)
    for _ in range(MAX_SWEEPS):
        new, changed = _sweep(g, rules, cse)
        g = new
        if not changed:
            return g
    raise RewriteError("rewrite did not reach a fixed point")


def _sweep(g: Graph, rules: list[Rule], cse: bool) -> tuple[Graph, bool]:
    mapping: dict[int, Node] = {}
    memo: dict[tuple, Node] = {}
    changed = False
    for node in g.toposort():
        if node.op == INPUT:
            mapping[id(node)] = node
            continue
        new = rebuild(node, tuple(mapping[id(i)] for i in node.inputs))
        for _ in range(MAX_RULE_STEPS):
            for rule in rules:
                out = rule(new)
                if out is not None and out is not new:
                    if out.type != new.type:
                        raise RewriteError(f"rule {rule.__name__} changed the type of {new.op}: "
                                           f"{new.type} -> {out.type}")
                    new = out
                    break
            else:
                break
        if cse:
            new = memo.setdefault(new.key(), new)
        if new is not node:
            changed = True
        mapping[id(node)] = new
    return g.replace(mapping), changed
