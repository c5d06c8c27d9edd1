"""The pass manager: a registry of named passes, the -O0/-O1/-O2 pipelines, and IR printing after each pass.

The verifier runs after every pass, so a pass that breaks the IR is caught where it happens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from samplec.ir.graph import Check, Graph, verify
from samplec.passes import rules as R
from samplec.passes.rewrite import rewrite


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[..., Graph]       # (graph) -> graph; a target pass takes every_check= too
    doc: str


def _rules(*rules, cse=False):
    return lambda g: rewrite(g, rules, cse=cse)


def dce(g: Graph) -> Graph:
    """Drop checks that can never fire and duplicates; unreachable nodes are gone by construction."""
    seen, checks = set(), []
    for c in g.checks:
        if c.flag.is_const(False) or (id(c.flag), c.message) in seen:
            continue
        seen.add((id(c.flag), c.message))
        checks.append(c)
    return Graph(g.name, g.params, g.outputs, tuple(checks))


PASSES: dict[str, Pass] = {p.name: p for p in [
    Pass("stages", _rules(R.fold_constants, R.stage_off, R.xtc_off, R.dry_off, R.dynamic_temperature_plain, R.cut_after_t0,
                          R.sample_t0, R.greedy_cuts, R.greedy_plain, R.logprob_one_token, R.empty_through_cuts),
         "stage level: stages at their off value removed (DRY at multiplier 0 too; dynamic_temperature of range 0: temperature), temperature "
         "0 makes the rest of the chain greedy, cuts before greedy dropped, a 'no token left' check reads past the "
         "cuts"),
    Pass("expand-stages", _rules(R.expand_stage), "every stage op into its dense definition (what -O0 runs)"),
    Pass("simplify", _rules(R.fold_constants, R.where_const, R.where_same, R.where_nested, R.logical_const,
                              R.arith_identity, R.reduce_one, R.empty_through_cuts),
         "constant folding (partial evaluation of bound parameters) and algebraic identities (an off stage's folded "
         "guard, a reduction over one entry, a 'no token left' check past the cuts)"),
    Pass("partition-topk", _rules(R.partition_top_k), "top_k with a constant k by partial selection"),
    Pass("cse", _rules(cse=True), "common-subexpression elimination"),
    Pass("dce", dce, "dead-code elimination (dead nodes, constant-false checks)"),
]}

def _target_pass(target: str) -> Callable[..., Graph]:
    def run(g: Graph, every_check: bool = False) -> Graph:
        from samplec.passes.target import lower
        low = lower(g, target, every_check)
        if target == "cpu":
            return low
        tidy = dce(PASSES["cse"].run(PASSES["simplify"].run(Graph(low.name, low.params, low.outputs, low.checks))))
        if low.regions and not {id(n) for r in low.regions for n in r.nodes} <= {id(n) for n in tidy.toposort()}:
            return low          # (the clean-up rewrote a region's node: keep the graph as lowered)
        return Graph(tidy.name, tidy.params, tidy.outputs, tidy.checks, low.regions)
    return run


TARGET_PASSES: dict[str, Pass] = {p.name: p for p in [
    Pass("target-cpu", _target_pass("cpu"),
         "the CPU's chain kernel: each chain of stage ops ending in a draw becomes a region cpu.chain"),
    Pass("target-cuda", _target_pass("cuda"),
         "the CUDA chain kernel for the chains it covers (regions cuda.chain), the portable lowering elsewhere"),
    Pass("target-metal", _target_pass("metal"), "the portable lowering (SAMPLEC_METAL_KERNEL=1: the chain kernel's Metal "
         "build where it covers the chain)"),
    Pass("target-portable", _target_pass("portable"),
         "the portable lowering: one sort of values a chain, every cut a threshold on the sorted row, the draw on "
         "the row in id order"),
]}

PIPELINES: dict[int, tuple[str, ...]] = {
    0: ("expand-stages",),
    1: ("stages", "expand-stages", "simplify", "partition-topk", "cse", "dce"),
    2: ("stages", "simplify", "cse", "dce"),      # (then the target pass: run_target)
}


def run_target(g: Graph, target: str, after: Callable[[str, Graph], None] | None = None,
               every_check: bool = False) -> Graph:
    """The target pass (after a pipeline): `target` is a concrete one (samplec.passes.target.resolve);
    `every_check`: no check tested through a later one that implies it (samplec.passes.checks)."""
    p = TARGET_PASSES[f"target-{target}"]
    g = p.run(g, every_check=every_check)
    verify(g)
    if after:
        after(p.name, g)
    return g


def run_pipeline(g: Graph, level: int = 2, after: Callable[[str, Graph], None] | None = None,
                 passes: tuple[str, ...] | None = None) -> Graph:
    verify(g)
    for name in passes if passes is not None else PIPELINES[level]:
        g = PASSES[name].run(g)
        verify(g)
        if after:
            after(name, g)
    return g


__all__ = ["Pass", "PASSES", "TARGET_PASSES", "PIPELINES", "run_pipeline", "run_target", "Check"]
