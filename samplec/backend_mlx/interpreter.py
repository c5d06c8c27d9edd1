"""The MLX interpreter: a loop over the graph's nodes, calling `KERNELS[op]`, optionally under `mx.compile`.

`Executable(graph)` turns a graph into a function of its parameters (in declaration order) returning its
outputs followed by its check flags (bool [B], or [B, 1] where the flag is a squeeze: the squeeze is skipped).
Where the native primitives serve, `lowering.RULES` first cover patterns of nodes with one primitive each. On
failure the error names the IR op and value being executed.
"""
from __future__ import annotations

import mlx.core as mx

from samplec.backend_mlx import native
from samplec.backend_mlx.kernels import KERNELS
from samplec.backend_mlx.lowering import RULES
from samplec.diagnostics import SamplecError
from samplec.ir.graph import INPUT, Graph
from samplec.ir.printer import Namer


class Executable:
    def __init__(self, graph: Graph, compile: bool = True):
        self.graph = graph
        self.order = [n for n in graph.toposort() if n.op != INPUT]
        self.index = {id(p.node): i for i, p in enumerate(graph.params)}
        self.roots = graph.roots()
        missing = sorted({n.op for n in self.order} - set(KERNELS))
        if missing:
            raise SamplecError(f"no MLX kernel for op(s): {', '.join(missing)}")
        self._fn = mx.compile(self.run_eager) if compile else self.run_eager

    def run_eager(self, *args: mx.array) -> list[mx.array]:
        env = {id(p.node): args[i] for i, p in enumerate(self.graph.params)}
        rules = RULES if native.enabled() else {}
        users = self.graph.users() if rules else {}
        for node in self.order:
            if id(node) in env:         # covered by a native rule of an earlier node
                continue
            try:
                rule = rules.get(node.op)
                bound = rule(node, users, env) if rule is not None else None
                if bound:
                    env.update(bound)
                else:
                    env[id(node)] = KERNELS[node.op]([env[id(i)] for i in node.inputs], node.attr_dict)
            except Exception as e:
                raise SamplecError(f"while executing %{Namer()(node)} = {node.op} ({node.type}): {e}") from e
        n = len(self.graph.outputs)
        return [env[id(r)] for r in self.roots[:n]] + \
            [env[id(f.inputs[0] if f.op == "squeeze" else f)] for f in self.roots[n:]]

    def __call__(self, *args: mx.array) -> tuple[list[mx.array], list[mx.array]]:
        res = self._fn(*args)
        n = len(self.graph.outputs)
        return res[:n], res[n:]
