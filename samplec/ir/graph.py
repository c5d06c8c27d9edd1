"""The graph IR: immutable nodes in SSA form and a plain graph of inputs, outputs and run-time checks.

A `Node` is a frozen value (op, inputs, attrs, type, name hint); the graph is its parameters, its named outputs
and its checks (per-row failure flags with a message). Nodes compare by identity; `key()` gives the structural
identity that CSE and hash-consing use. networkx is only a view for analysis (`to_networkx`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

from samplec.ir.ops import ALL_OPS as OPS
from samplec.ir.types import Type, TypeError_

INPUT = "input"   # the pseudo-op of a graph parameter; every other op is in OPS


@dataclass(frozen=True, eq=False)
class Node:
    op: str
    inputs: tuple["Node", ...]
    attrs: tuple[tuple[str, object], ...]
    type: Type
    name: str | None = None

    def attr(self, key: str):
        for k, v in self.attrs:
            if k == key:
                return v
        raise KeyError(key)

    @property
    def attr_dict(self) -> dict:
        return dict(self.attrs)

    def key(self) -> tuple:
        """Structural identity (inputs by identity): equal keys compute equal values."""
        if self.op == INPUT:
            return (INPUT, self.name)
        return (self.op, tuple(id(i) for i in self.inputs), _attr_key(self.attrs))

    def is_const(self, value=None) -> bool:
        if self.op != "const":
            return False
        return value is None or _same_number(self.attr("value"), value)

    def __repr__(self) -> str:
        return f"Node({self.op}{'' if self.name is None else ' ' + self.name}: {self.type})"


def _same_number(a, b) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


def _attr_key(attrs):
    # distinguish 1 from 1.0 and -0.0 from 0.0 so CSE never merges different constants
    return tuple((k, type(v).__name__, repr(v)) for k, v in attrs)


@dataclass(frozen=True)
class Param:
    """A program input. `kind` is the source type (logits, float, int, seed, tokens, mask, bias)."""
    name: str
    kind: str
    node: Node
    default: object = None        # None: required; "os": fresh OS entropy per call (implicit sample seed)
    range: str | None = None      # e.g. "(0.0, 1.0]", checked at run time

    @property
    def required(self) -> bool:
        return self.default is None


@dataclass(frozen=True)
class Check:
    """A run-time check: `flag` is bool[B] (true = the row fails); `message` names the parameter or stage."""
    flag: Node
    message: str


@dataclass(frozen=True, eq=False)
class Region:
    """Nodes that one kernel runs together, chosen by the target pass (a chain kernel: samplec/passes/chains.py).
    The nodes stay in the graph with their definitions (what runs if the kernel declines a call); the region
    says which kernel computes them and which of them the rest of the graph reads (`results`). `impl` is the
    backend's runner for it."""
    kernel: str                             # e.g. "cpu.chain", "cuda.chain"
    nodes: tuple[Node, ...]                 # in run order
    results: tuple[Node, ...]
    attrs: tuple[tuple[str, object], ...] = ()
    impl: object = None


@dataclass(frozen=True)
class Graph:
    name: str
    params: tuple[Param, ...]
    outputs: tuple[tuple[str, Node], ...]
    checks: tuple[Check, ...] = ()
    regions: tuple[Region, ...] = ()       # (target-level graphs only; a rewrite of the graph drops them)

    @property
    def logits(self) -> Node:
        return self.params[0].node

    def roots(self) -> list[Node]:
        return [n for _, n in self.outputs] + [c.flag for c in self.checks]

    def toposort(self) -> list[Node]:
        """Every node reachable from the outputs and checks, inputs before users, in a deterministic order."""
        return list(self._order)

    @cached_property
    def _order(self) -> tuple[Node, ...]:       # (a graph is immutable: sort it once)
        order: list[Node] = []
        seen: set[int] = set()
        for root in self.roots():
            stack: list[tuple[Node, int]] = [(root, 0)]
            while stack:
                node, i = stack.pop()
                if i == 0 and id(node) in seen:
                    continue
                if i < len(node.inputs):
                    stack.append((node, i + 1))
                    child = node.inputs[i]
                    if id(child) not in seen:
                        stack.append((child, 0))
                else:
                    seen.add(id(node))
                    order.append(node)
        return tuple(order)

    def schedule(self) -> list[Node]:
        """The computation in run order: each region's nodes together, after everything they read."""
        if not self.regions:
            return [n for n in self.toposort() if n.op != INPUT]
        unit = {id(n): ("r", i) for i, r in enumerate(self.regions) for n in r.nodes}
        key = lambda n: unit.get(id(n), ("n", id(n)))
        members: dict = {}
        for n in self.toposort():
            if n.op != INPUT:
                members.setdefault(key(n), []).append(n)
        deps = {k: {key(i) for m in ms for i in m.inputs if i.op != INPUT} - {k} for k, ms in members.items()}
        order, done, pending = [], set(), list(members)     # (first appearance order: deterministic)
        while pending:
            rest = []
            for k in pending:
                if deps[k] <= done:
                    order += members[k] if k[0] == "n" else list(self.regions[k[1]].nodes)
                    done.add(k)
                else:
                    rest.append(k)
            if len(rest) == len(pending):
                raise VerifyError("a cycle through a region")
            pending = rest
        return order

    def nodes(self) -> list[Node]:
        """Parameters first (in declaration order), then the computation."""
        params = [p.node for p in self.params]
        pids = {id(n) for n in params}
        return params + [n for n in self.toposort() if id(n) not in pids]

    def replace(self, mapping: dict[int, Node]) -> "Graph":
        """The graph with outputs and checks redirected through `mapping` (id(old) -> new)."""
        get = lambda n: mapping.get(id(n), n)
        return Graph(self.name, self.params, tuple((k, get(n)) for k, n in self.outputs),
                     tuple(Check(get(c.flag), c.message) for c in self.checks))

    def to_networkx(self):
        import networkx as nx
        g = nx.DiGraph()
        for n in self.nodes():
            g.add_node(id(n), op=n.op)
            for i in n.inputs:
                g.add_edge(id(i), id(n))
        return g

    def users(self) -> dict[int, list[Node]]:
        out: dict[int, list[Node]] = {}
        for n in self.toposort():
            for i in n.inputs:
                out.setdefault(id(i), []).append(n)
        return out

    def __str__(self) -> str:
        from samplec.ir.printer import print_graph
        return print_graph(self)


class VerifyError(Exception):
    pass


def infer_type(op: str, inputs: Iterable[Node], attrs: dict) -> Type:
    d = OPS[op]
    ins = list(inputs)
    if len(ins) != d.arity and d.arity >= 0:       # (-1: any number)
        raise TypeError_(f"{op}: expects {d.arity} operands, got {len(ins)}")
    for name, kind in d.attrs:
        if name not in attrs:
            raise TypeError_(f"{op}: missing attribute {name}")
        if not _attr_ok(kind, attrs[name]):
            raise TypeError_(f"{op}: attribute {name} = {attrs[name]!r} is not a {kind}")
    extra = set(attrs) - {n for n, _ in d.attrs}
    if extra:
        raise TypeError_(f"{op}: unknown attributes {sorted(extra)}")
    return d.infer([i.type for i in ins], attrs)


def _attr_ok(kind: str, v) -> bool:
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "dtype":
        return isinstance(v, str)
    if kind == "scalar":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == "ints":
        return isinstance(v, tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    if kind == "floats":
        return isinstance(v, tuple) and all(isinstance(x, float) for x in v)
    return False


def make(op: str, *inputs: Node, name: str | None = None, **attrs) -> Node:
    """Build a node, inferring (and so checking) its type from the op table."""
    d = OPS[op]
    ordered = tuple((k, attrs[k]) for k, _ in d.attrs if k in attrs)
    t = infer_type(op, inputs, attrs)
    return Node(op, tuple(inputs), ordered, t, name)


def verify(g: Graph, infer: bool = True) -> None:
    """Check every node against the op table; raise VerifyError naming the first bad node. `infer=False` skips
    re-inferring node types, for graphs whose nodes were all built by `make` (the .smpb reader's)."""
    params = {id(p.node) for p in g.params}
    if not g.params or g.params[0].kind != "logits":
        raise VerifyError("the first parameter must be the logits")
    names = [p.name for p in g.params]
    if len(set(names)) != len(names):
        raise VerifyError("duplicate parameter names")
    for p in g.params:
        if p.node.op != INPUT or p.node.name != p.name:
            raise VerifyError(f"parameter {p.name} is not an input node")
    for n in g.toposort():
        if n.op == INPUT:
            if id(n) not in params:
                raise VerifyError(f"input {n.name} is not a declared parameter")
            continue
        if n.op not in OPS:
            raise VerifyError(f"unknown op {n.op}")
        if not infer:
            continue
        try:
            t = infer_type(n.op, n.inputs, n.attr_dict)
        except TypeError_ as e:
            raise VerifyError(f"{n.op}: {e}") from None
        if t != n.type:
            raise VerifyError(f"{n.op}: recorded type {n.type} but operands give {t}")
    if g.regions:
        present = {id(n) for n in g.toposort()}
        for r in g.regions:
            if not all(id(n) in present for n in r.nodes) or not {id(n) for n in r.results} <= present:
                raise VerifyError(f"region {r.kernel}: a node is not in the graph")
        g.schedule()
    for c in g.checks:
        if c.flag.type.dtype != "bool" or len(c.flag.type.shape) != 1:
            raise VerifyError(f"check {c.message!r}: flag must be bool[B]")
    if len({k for k, _ in g.outputs}) != len(g.outputs):
        raise VerifyError("duplicate output names")


__all__ = ["Node", "Param", "Check", "Region", "Graph", "make", "verify", "VerifyError", "INPUT", "infer_type"]
