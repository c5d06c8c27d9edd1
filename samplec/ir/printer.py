"""Deterministic textual IR: one instruction per line, attributes in declaration order, exact floats.

    sampler @name {
      param %logits: f32[B,V] logits
      param %t: f32[B] float = 0.8 range [0.0, inf]
      %x = div %logits, %t.1 : f32[B,V]
      region cpu.chain {stages = [top_k], terminal = sample} {
        %x_topk = top_k %x, %k : f32[B,V]
        %tok = sample %x_topk, %seed, %pos : i32[B,1]
      } -> %tok
      check %bad "message"
      output token = %tok
    }

A region (target-level graphs only) is the nodes one kernel runs together, and the results the rest reads.
"""
from __future__ import annotations

import json
import math
import re

from samplec.ir.graph import Graph, Node


def fmt_scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    return str(v)


def fmt_attr(v) -> str:
    if isinstance(v, tuple):
        return "[" + ", ".join(fmt_scalar(x) for x in v) + "]"
    return fmt_scalar(v)


class Namer:
    """Assigns `%name` to nodes: the name hint where unique, else hint.N; unnamed nodes get numbers."""

    def __init__(self):
        self.names: dict[int, str] = {}
        self.used: set[str] = set()
        self.counter = 0

    def __call__(self, node: Node) -> str:
        if id(node) not in self.names:
            self.names[id(node)] = self._fresh(node.name)
        return self.names[id(node)]

    def _fresh(self, hint: str | None) -> str:
        if hint:
            base = re.sub(r"[^A-Za-z0-9_.]", "_", hint)
            if base[0].isdigit():
                base = "v" + base
            name, i = base, 1
            while name in self.used:
                name, i = f"{base}.{i}", i + 1
        else:
            while str(self.counter) in self.used:
                self.counter += 1
            name = str(self.counter)
            self.counter += 1
        self.used.add(name)
        return name


def print_graph(g: Graph) -> str:
    name = Namer()
    lines = [f"sampler @{g.name} {{"]
    for p in g.params:
        line = f"  param %{name(p.node)}: {p.node.type} {p.kind}"
        if p.default is not None:
            line += f" = {fmt_scalar(p.default)}"
        if p.range:
            line += f" range {p.range}"
        lines.append(line)
    region = {id(n): r for r in g.regions for n in r.nodes}
    open_ = None
    for n in g.schedule():
        r = region.get(id(n))
        if r is not open_:
            if open_ is not None:
                lines.append("  } -> " + ", ".join("%" + name(m) for m in open_.results))
            if r is not None:
                attrs = " {" + ", ".join(f"{k} = {fmt_attr(v)}" for k, v in r.attrs) + "}" if r.attrs else ""
                lines.append(f"  region {r.kernel}{attrs} {{")
            open_ = r
        ops = ", ".join("%" + name(i) for i in n.inputs)
        attrs = ""
        if n.attrs:
            attrs = " {" + ", ".join(f"{k} = {fmt_attr(v)}" for k, v in n.attrs) + "}"
        lines.append(f"{'    ' if r is not None else '  '}%{name(n)} = {n.op}{' ' + ops if ops else ''}{attrs} : {n.type}")
    if open_ is not None:
        lines.append("  } -> " + ", ".join("%" + name(m) for m in open_.results))
    for c in g.checks:
        lines.append(f"  check %{name(c.flag)} {json.dumps(c.message)}")
    for k, n in g.outputs:
        lines.append(f"  output {k} = %{name(n)}")
    lines.append("}")
    return "\n".join(lines) + "\n"
