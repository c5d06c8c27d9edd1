"""Stages that a call turns off in every row are not run: the program a call takes is specialized on which of its
stages its run-time values leave off.

A server passes every parameter at run time, and most requests leave most stages at their off value (top_p 1, no
penalties, xtc's probability 0): the stage table's off rule says the stage then changes nothing. A program compiled
for any values runs such a stage anyway -- on a GPU its launches, on the CPU its passes over the row. vLLM's sampler
skips top-k and top-p when no request of the batch asks for them, and mlx-lm's `make_sampler` builds its chain of
the stages it is given; samplec does the same per call, from the values alone: a stage whose off rule reads only
parameters and constants is a *switch*, a call whose values (plain Python numbers or lists of them, one per row)
put a switch off in every row runs the program without that stage (compiled once per set of switches off, then
cached), and any other call runs the whole program. Removing a stage that is off changes no token, logprob or check:
the off rule is the identity by the stage's definition (spec §2), so both programs give the same bits.

A penalties stage's check ("a penalized logit overflows float32, or no token is left") goes with the stage where it
reads the logits themselves: the logits' own checks, which come first, then fire on exactly its rows. Elsewhere the
check stays, reading the row as the stage left it (unchanged).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from samplec import stage_table
from samplec.ir.graph import INPUT, Graph, Node
from samplec.ir.ops import STAGE_OPS
from samplec.passes.rewrite import rebuild

SWITCHED = frozenset(STAGE_OPS) | {"penalties", "dry"}


@dataclass(frozen=True)
class Switch:
    """A stage whose off rule reads parameters and constants only: its place in the graph's order, its stage, and
    per name its rule reads, a parameter's name (str) or a constant's value."""
    at: int
    stage: str
    reads: tuple[tuple[str, object], ...]

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(v for _, v in self.reads if type(v) is str)

    def off(self, values: dict, V: int) -> bool:
        """Whether the stage is off in every row for these parameter values (name -> a number or a sequence of
        numbers, one per row)."""
        env = {name: (np.asarray(values[v]) if type(v) is str else v) for name, v in self.reads}
        return bool(np.all(_vectorized(self.stage)(V=V, **env)))


_RULES: dict[str, object] = {}


def _vectorized(stage: str):
    """The stage table's off rule as a function of numpy arrays (its `and` / `or` between comparisons made
    elementwise)."""
    got = _RULES.get(stage)
    if got is None:
        rule = stage_table.stage(stage).off
        parts = re.split(r"\s+(and|or)\s+", rule)
        text = "".join(f"({p})" if i % 2 == 0 else {"and": " & ", "or": " | "}[p] for i, p in enumerate(parts))
        code = compile(text, f"<off rule of {stage}>", "eval")
        got = _RULES[stage] = lambda **env: eval(code, {"__builtins__": {}}, env)   # (the table's own rule)
    return got


def _operand(n: Node):
    """A parameter's name where n is the parameter (or its [B, 1] view), a constant's value, else None."""
    if n.op == "expand":
        n = n.inputs[0]
    if n.op == INPUT:
        return n.name
    if n.op == "const":
        return n.attr("value")
    return None


def switches(g: Graph, scalars: frozenset[str]) -> tuple[Switch, ...]:
    """The stages of g whose off rule reads only the scalar parameters `scalars` and constants."""
    out = []
    for at, n in enumerate(g.toposort()):
        if n.op not in SWITCHED:
            continue
        s = stage_table.stage(n.op)
        names = [o.name for o in s.operands]
        reads = []
        for name in stage_table.off_names(s):
            if name == "V":
                continue
            got = _operand(n.inputs[1 + names.index(name)])
            if got is None or type(got) is str and got not in scalars:
                break
            reads.append((name, got))
        else:
            if any(type(v) is str for _, v in reads):    # (all constants: the stages pass decided it already)
                out.append(Switch(at, n.op, tuple(reads)))
    return tuple(out)


def without(g: Graph, off: frozenset[int]) -> Graph:
    """g with the stages at these places of its order (Switch.at) replaced by the row they read (module doc)."""
    order = g.toposort()
    drop = {id(order[i]) for i in off}
    logits = g.params[0].node
    dropped_penalties = {tuple(map(id, n.inputs)) for n in order if id(n) in drop and n.op == "penalties"}
    new: dict[int, Node] = {}
    gone = set()        # (the penalties checks that go with their stage)
    for n in order:
        if n.op == INPUT:
            new[id(n)] = n
            continue
        ins = tuple(new[id(i)] for i in n.inputs)
        if id(n) in drop:
            new[id(n)] = ins[0]
        elif n.op == "penalties_overflow" and tuple(map(id, n.inputs)) in dropped_penalties and \
                n.inputs[0] is logits:
            gone.add(id(n))
        else:
            new[id(n)] = rebuild(n, ins)
    out = g.replace(new)
    return Graph(out.name, out.params, out.outputs,
                 tuple(c for c, old in zip(out.checks, g.checks) if id(old.flag) not in gone))

