"""The chain kernels' part of the target pass: which chains of stage ops a samplec kernel runs as one.

A chain is a draw and the stage ops before it, with what the kernel computes from the same passes over the row
(the penalties, logit_bias and allow nodes below it, the logits checks' maximum, the model's log-softmax and
top_logprobs, a `probs` softmax): `interpreter.find_chains` gives them. On the `cpu` target every chain whose
stages the installed native kernel knows becomes a region `cpu.chain`; on `cuda` (and on `metal` where the chain
kernel's Metal build is asked for), every chain the GPU kernel covers becomes a region `cuda.chain` (`metal.chain`),
and the other stage ops take the portable lowering. Stage ops outside a
region keep their kernels (on the CPU: the native single-op kernels and the dense definitions, which select
without sorting -- a sort of 152k floats costs ~14 ms there).
"""
from __future__ import annotations

from samplec.ir.graph import Graph, Region


def _region(chain, kernel: str, roots: set, users: dict) -> Region:
    inside = {id(n) for n in chain.nodes()}
    results = tuple(n for n in chain.nodes()
                    if id(n) in roots or any(id(u) not in inside for u in users.get(id(n), [])))
    attrs = (("stages", tuple(s.op for s in chain.stages)),
             ("terminal", chain.draw.op if chain.draw is not None else "none"))
    if chain.edits:
        attrs += (("edits", tuple(e.op for e in chain.edits)),)
    if chain.prefix:
        attrs += (("prefix", tuple(p.kind for p in chain.prefix)),)
    return Region(kernel, tuple(chain.nodes()), results, attrs, chain)


def _as_gpu_chain(chain, users: dict):
    """The chain as a GPU target's kernel runs it: the checks of its penalties stages (penalties_overflow on the same
    operands) join it -- the kernel gives them from the passes that penalize the row --; the model's log-softmax
    stays (the kernel gives its maximum and log-sum-exp from one more pass over the logits, and the logit at the
    token: raw_logprob is two subtractions beside it), and top_logprobs' ids and values leave it for one selection
    kernel beside it (`gpu_top_ids`)."""
    chain.overflows = tuple(next((u for u in users.get(id(pen.inputs[0]), [])
                                  if u.op == "penalties_overflow" and u.inputs == pen.inputs), None)
                            for pen in chain.edits)
    chain.top_logprobs = ()
    return chain


def gpu_top_ids(g: Graph) -> list:
    """top_logprobs' ids of a log-softmax, and candidates' ids of a float row, on a GPU target: kept as `topk_ids`,
    which the interpreter runs as one block a row (gpu.top_logprobs) -- ranked by log-probability from the row's
    maximum and log-sum-exp (the chain kernel's where it covers the log-softmax, else two reductions:
    lowering's `_gpu_log_softmax`), or by the row's own values -- where the portable lowering would sort the row."""
    from samplec.backend_mlx.gpu import TOP_LOGPROBS_MAX
    from samplec.backend_mlx.lowering import TIE_MARGIN
    return [n for n in g.toposort() if n.op == "topk_ids" and n.inputs[0].type.dtype == "f32" and
            n.attr("k") + TIE_MARGIN <= TOP_LOGPROBS_MAX]


def fuse_chains(g: Graph, target: str) -> Graph:
    from samplec.backend_mlx import gpu, native
    from samplec.backend_mlx.interpreter import find_chains
    from samplec.passes.portable import lower_portable
    users, roots = g.users(), {id(r) for r in g.roots()}
    chains = find_chains(g, for_gpu=target != "cpu")
    if target == "cpu":
        covered = [c for c in chains if native.installed() and native.knows_stages([s.op for s in c.stages])]
        return Graph(g.name, g.params, g.outputs, g.checks,
                     tuple(_region(c, "cpu.chain", roots, users) for c in covered))
    covered = [_as_gpu_chain(c, users) for c in chains
               if c.draw is not None and gpu.chain_supports([s.op for s in c.stages], c.draw.op)]
    keep = {id(n) for c in covered for n in c.nodes()}
    tops = gpu_top_ids(g)
    keep |= {id(n) for n in tops} | {id(n.inputs[0]) for n in tops if n.inputs[0].op == "log_softmax"}
    keep |= {id(n) for n in g.toposort() if n.op == "dry"}        # (one kernel beside the chain kernel: gpu.dry)
    kept: dict = {}
    low = lower_portable(g, keep, kept)
    # a chain whose nodes all came through the lowering as they were stays as found; another is found again over
    # the lowered graph by its draw: a kept node whose inputs the lowering rewrote (a constant bias row, a history's
    # window) is rebuilt over them, and a node the lowering left unread (the model's log-softmax where its one reader
    # took the lowered normalizer) drops out of the chain
    have = {id(n) for n in low.toposort()}
    again = {id(c.draw): c for c in find_chains(low, for_gpu=True) if c.draw is not None}
    users, roots = low.users(), {id(r) for r in low.roots()}
    chains = []
    for c in covered:
        if all(id(n) in have for n in c.nodes()):
            chains.append(c)
        elif id(c.draw) in kept and id(kept[id(c.draw)]) in again:
            d = again[id(kept[id(c.draw)])]
            if gpu.chain_supports([s.op for s in d.stages], d.draw.op):
                chains.append(_as_gpu_chain(d, users))
    return Graph(low.name, low.params, low.outputs, low.checks,
                 tuple(_region(c, f"{target}.chain", roots, users) for c in chains))
