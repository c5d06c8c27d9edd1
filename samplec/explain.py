"""`samplec explain`: what the optimizer did to each stage as written, and which kernels run it (text and DOT).

Lowering returns a side table (`lower_traced`): per source stage, the node it ended in. The nodes a stage added
are those reachable from its node and not from the stage before it. To follow them through the passes, a copy of
the lowered graph carries the stage index in each node's name hint (`hint<US>index`); the rewrite driver keeps a
node's name when it rebuilds it, so after every pass a node either still names its stage, or is a new node (a
folded constant, the inside of a dense definition) that is attributed to the earliest stage that uses it. The
pipeline run here is the real one, pass by pass, except that `expand-stages` keeps the stage's tag on the node
its definition ends in; stripped of the tags, the result prints exactly as `samplec compile --emit ir` does
(tests/test_explain.py checks it). Nothing here changes the IR or the `.smpb`.

Kernels: the interpreter (samplec/backend_mlx/interpreter.py) runs a chain of stage ops ending in a draw as one
native kernel where the native primitives serve (on the CPU), each other stage op by its dense definition, and
offers low-level nodes to the native rules of `lowering.RULES`; without the native primitives everything runs
as MLX ops.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from samplec.backend_mlx.lowering import TIE_MARGIN
from samplec.frontend.lower import lower_traced
from samplec.ir.graph import INPUT, Check, Graph, Node, verify
from samplec.ir.ops import DRAW_OPS, OPS, STAGE_OPS
from samplec.ir.printer import Namer, fmt_scalar
from samplec.passes import PASSES, PIPELINES
from samplec.passes import rules as R
from samplec.passes.rewrite import rewrite

SEP = "\x1f"                       # between a node's name hint and its stage tag (never in a printed name)
LOGITS, OUTPUTS = -1, 10 ** 6     # the groups before and after the stages: the logits checks, the outputs
DENSE_OPS = set(STAGE_OPS) | set(DRAW_OPS) | {"logprob_at", "penalties", "penalties_overflow", "dry"}
_SHAPE_OPS = {"const", "expand", "squeeze", "cast", "iota"}

# what each native rule of lowering.RULES computes its node with (the primitive of samplec-native)
NATIVE_PRIMITIVES = {
    "log_softmax": "row_logsumexp", "topk_ids": "top_logprob_ids (ids and values)", "random_bits": "threefry_bits",
    "argmax": "argmax_take (argmax_put after penalties)",
    "take_along": "a gather of x, max and log Z (or a value the chain or top_logprob_ids gave)",
    "reduce_max": "row_max",
    "dry_repeats": "dry_repeats (the Z-algorithm, O(H) per row)",
}
KERNEL_NAMES = {"cpu": "the native chain kernel", "cuda": "the CUDA chain kernel",
                "metal": "the chain kernel's Metal build"}
CHAIN_KERNEL = ("the native chain kernel sample_chain: per row, the tokens above a block bound (a selection over "
                "block maxima), else radix selection over the whole row; no sort")


@dataclass
class Group:
    key: int
    title: str                   # the stage as written, or "logits checks" / "outputs"
    line: int | None = None
    stage: str | None = None     # the stage's name
    became: list[str] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)


@dataclass
class Explained:
    name: str
    level: int
    groups: list[Group]
    final: Graph                   # tagged
    stripped: Graph                # the compiled graph as `compile` prints it
    names: dict[int, str]          # id(tagged node) -> its %name in the printed IR
    group_of: dict[int, int]       # id(tagged node) -> group key
    chains: list                   # the interpreter's chains over the tagged graph
    native: bool
    chain_native: bool             # the native build has the chain kernel
    native_note: str
    changed: list[str]
    unchanged: list[str]
    target: str = "cpu"
    switches: tuple = ()           # (stage, its off rule with the names it reads): samplec.passes.specialize


# ---- tags ------------------------------------------------------------------------------------------------------

def tag_of(node: Node) -> int | None:
    if node.name and SEP in node.name:
        return int(node.name.rpartition(SEP)[2])
    return None


def _hint(node: Node) -> str | None:
    if node.name is None or SEP not in node.name:
        return node.name
    return node.name.rpartition(SEP)[0] or None


def _map_graph(g: Graph, name_of) -> tuple[Graph, dict[int, Node]]:
    """The graph rebuilt bottom-up with each non-input node named `name_of(node)`; and id(old) -> new."""
    new: dict[int, Node] = {}
    for n in g.toposort():
        if n.op == INPUT:
            new[id(n)] = n
        else:
            new[id(n)] = Node(n.op, tuple(new[id(i)] for i in n.inputs), n.attrs, n.type, name_of(n))
    out = Graph(g.name, g.params, tuple((k, new[id(n)]) for k, n in g.outputs),
                tuple(Check(new[id(c.flag)], c.message) for c in g.checks))
    return out, new


def _reach(roots, stop: set[int]) -> set[int]:
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if id(n) in seen or id(n) in stop or n.op == INPUT:
            continue
        seen.add(id(n))
        stack.extend(n.inputs)
    return seen


def _tag_lowered(g: Graph, trace) -> Graph:
    group: dict[int, int] = {}
    ncheck = 2            # (lowering's first two checks are on the logits, made before any stage)
    for c in g.checks[:ncheck]:
        group.update(dict.fromkeys(_reach([c.flag], set(group)), LOGITS))
    for i, (_, node, nchecks) in enumerate(trace):
        roots = [node] + [c.flag for c in g.checks[ncheck:nchecks]]
        group.update(dict.fromkeys(_reach(roots, set(group)), i))
        ncheck = nchecks
    for c in g.checks[ncheck:]:
        group.update(dict.fromkeys(_reach([c.flag], set(group)), LOGITS))
    group.update(dict.fromkeys(_reach([n for _, n in g.outputs], set(group)), OUTPUTS))
    tagged, _ = _map_graph(g, lambda n: f"{n.name or ''}{SEP}{group[id(n)]}")
    return tagged


def attribute(g: Graph, check_groups: list[int]) -> dict[int, int]:
    """Group of every node: its tag (constants aside: CSE shares them between stages), else the earliest group
    among its users; an untagged root is its output's or check's group."""
    users = g.users()
    out: dict[int, int] = {}
    root_group = {id(n): OUTPUTS for _, n in g.outputs}
    for c, grp in zip(g.checks, check_groups):
        root_group.setdefault(id(c.flag), grp)
    for n in reversed(g.toposort()):
        if n.op == INPUT:
            continue
        t = tag_of(n)
        if t is None or n.op == "const":
            cands = [out[id(u)] for u in users.get(id(n), []) if id(u) in out]
            if id(n) in root_group:
                cands.append(root_group[id(n)])
            t = min(cands) if cands else (t if t is not None else OUTPUTS)
        out[id(n)] = t
    return out


def _check_groups(lowered: Graph, trace, final: Graph) -> list[int]:
    """The group of each of `final`'s checks: the passes only drop checks, so match the messages in order."""
    keys = [(c.message, _stage_of_check(trace, i)) for i, c in enumerate(lowered.checks)]
    out, j = [], 0
    for c in final.checks:
        while j < len(keys) and keys[j][0] != c.message:
            j += 1
        out.append(keys[j][1] if j < len(keys) else LOGITS)
        j += 1
    return out


def _stage_of_check(trace, i: int) -> int:
    """The stage that added the lowered graph's check i (the first two check the logits, before any stage)."""
    before = 2
    for s, (_, _, nchecks) in enumerate(trace):
        if before <= i < nchecks:
            return s
        before = nchecks
    return LOGITS


# ---- the pipeline, pass by pass --------------------------------------------------------------------------------

def _expand_keeping_tags(n: Node):
    """expand_stage, with every node of the definition tagged with the stage op's stage."""
    out = R.expand_stage(n)
    t = tag_of(n)
    if out is None or t is None:
        return out
    inner = _reach([out], {id(i) for i in n.inputs})
    new: dict[int, Node] = {}
    for m in Graph("d", (), (("o", out),)).toposort():
        if id(m) in inner:
            new[id(m)] = Node(m.op, tuple(new.get(id(i), i) for i in m.inputs), m.attrs, m.type,
                              f"{_hint(m) or ''}{SEP}{t}")
    return new[id(out)]


def _run_pass(name: str, g: Graph) -> Graph:
    if name == "expand-stages":
        return rewrite(g, [_expand_keeping_tags])
    return PASSES[name].run(g)


def strip(g: Graph) -> tuple[Graph, dict[int, Node]]:
    return _map_graph(g, _hint)


def _stage_nodes(g: Graph, groups: dict[int, int], key: int) -> list[Node]:
    return [n for n in g.toposort() if n.op not in (INPUT, "const") and groups.get(id(n)) == key]


def native_state(native: bool | None) -> tuple[bool, str]:
    """Whether the kernels on the CPU are the native ones, and why (for the header)."""
    from samplec.backend_mlx import native as nat
    if native is not None:
        return native, "with the native primitives (as asked)" if native else "without the native primitives " \
            "(as asked)"
    if not nat.installed():
        return False, "without the native primitives (samplec-native is not installed)"
    if nat.switched_off("SAMPLEC_NATIVE"):
        return False, f"without the native primitives (SAMPLEC_NATIVE={os.environ['SAMPLEC_NATIVE']})"
    if not hasattr(nat._native, "sample_chain"):
        return True, "with the native primitives (installed; this build has no chain kernel)"
    return True, "with the native primitives (samplec-native installed and on)"


# the portable lowering's algorithm for each stage op (samplec/passes/portable.py), and why
PORTABLE = {
    "top_k": "the k-th place of the chain's one sorted row (a view, or a gather for a run-time k): no selection "
             "rounds; the id-order row keeps what is at least that value",
    "top_k_rank": "the first k kept places of the sorted row; in id order the values above the k-th and the lowest "
                  "ids at it (one scan)",
    "top_p": "a running sum of the sorted probabilities (one cumsum) and one min: the first place whose mass "
             "before it reaches p",
    "typical_p": "its score on the sorted row, one sort of the scores and a running sum",
    "min_p": "its dense definition on the sorted row (max + log m: place 0)",
    "top_n_sigma": "its dense definition on the sorted row (three reductions)",
    "epsilon": "its dense definition on the sorted row", "eta": "its dense definition on the sorted row",
    "temperature": "a map of both forms of the row (the maximum at place 0; t = 0 marks the row greedy)",
    "dynamic_temperature": "its dense definition on the sorted row",
    "xtc": "on the sorted row: its targets and their least probable; in id order the survivor the lowest id among "
           "them; the coin and the draw's noise from one RandomBits",
    "sample": "the dense definition on the id-order row: Gumbel-max with each id's noise (no permutation)",
    "penalties": "one scatter of the window's counts over the row, then the penalty where a count is positive",
    "penalties_overflow": "from the penalties' counts: one reduction over the row, the maximum at place 0",
    "dry": "its dense definition: a stable sort of the history, the repeat lengths (every pair of its positions "
           "compared), the penalties at the window's tokens put back into the row",
}
# ... where the CPU's lowering runs the chain on candidates (samplec/passes/portable.py: CANDIDATE_STAGES)
ON_CANDIDATES = {
    "top_k": "the k-th of the candidates (the row's N largest by a partition and a sort of N): the row's k-th "
             "value where k <= N",
    "top_p": "a running sum of the candidates' probabilities over the row's sum (one cumsum of N) and one min",
    "min_p": "max + log m, the maximum the first candidate",
    "temperature": "a map of the candidates (t = 0 keeps the first: the lowest id at the maximum)",
    "sample": "Gumbel-max over the candidates with each id's noise, the lowest id among equal noisy values; a "
              "row whose kept tokens they may not hold (its last candidate kept) runs the call again sorted",
    "argmax": "the first candidate (equal values in id order)",
}
COST = {"cpu": "selection without a sort: a sort of 152k floats costs ~14 ms on MLX's CPU, the chain kernel's "
               "block bound ~0.1 ms",
        "portable": "one sort of values a chain (on a GPU a sort of the row is one cheap kernel, while each "
                    "selection round is several launches); on the CPU, where a sort of 152k floats costs ~17 ms and a "
                    "partition ~2 ms, a chain of value cuts, the temperature and a draw runs on its row's 4096 "
                    "largest (candidates)",
        "metal": "the portable lowering; with SAMPLEC_METAL_KERNEL=1 the chain kernel's Metal build where it covers "
                 "the chain",
        "cuda": "the CUDA chain kernel where it covers the chain, the portable lowering elsewhere"}


def _on_candidates(g: Graph) -> bool:
    return any(n.op == "candidates" for n in g.toposort())


def explain(source: str, sampler: str | None = None, level: int = 2, bindings: dict | None = None,
            filename: str = "<string>", native: bool | None = None, target: str | None = None) -> Explained:
    from samplec.api import _front
    from samplec.passes import run_target
    from samplec.passes.target import resolve
    checked, _, binds = _front(source, sampler, bindings, filename)
    lowered, trace = lower_traced(checked, binds)
    g = _tag_lowered(lowered, trace)
    lines = source.splitlines()
    groups = [Group(LOGITS, "logits checks")]
    for i, (st, _, _) in enumerate(trace):
        sp = st.span
        text = lines[sp.line - 1][sp.col - 1:sp.end_col - 1] if sp.end_line == sp.line and sp.line <= len(lines) \
            else st.name
        groups.append(Group(i, text, sp.line, st.name))
    groups.append(Group(OUTPUTS, "outputs: " + ", ".join(o.name + (f"({o.arg})" if o.arg is not None else "")
                                                        for o in checked.outputs)))
    history = [("lower", g)]
    verify(g)
    changed, unchanged = [], []
    for name in PIPELINES[level]:
        before = strip(g)[0]
        g = _run_pass(name, g)
        verify(g)
        history.append((name, g))
        from samplec.ir.printer import print_graph
        (changed if print_graph(strip(g)[0]) != print_graph(before) else unchanged).append(name)
    attrs = [attribute(h, _check_groups(lowered, trace, h)) for _, h in history]
    if native is not None and target is None:
        target = "cpu" if native else "portable"
    target = resolve(target)
    stage_level, smap = strip(g)
    stripped = run_target(stage_level, target)       # (what `compile` prints: the target's IR)
    # names as the printed IR gives them (in run order); where the target rewrote the stage ops (the portable
    # lowering), the stage-level graph's names
    named = stripped if stripped.regions or target == "cpu" else stage_level
    namer = Namer()
    for p in named.params:
        namer(p.node)
    for n in named.schedule():
        namer(n)
    names = {id(p.node): namer(p.node) for p in stripped.params}
    names.update((tid, namer(node)) for tid, node in smap.items())
    use_native, note = native_state(native)
    if target != "cpu":
        use_native, note = False, f"not used by the target: {note}"
    # (the chains are the target pass's regions: what runs, not a re-derivation)
    chains = [r.impl for r in run_target(g, target).regions] if target in ("cpu", "cuda") else []
    chain_native = target == "cuda" or use_native
    from samplec import stage_table
    from samplec.passes.specialize import switches
    scalars = frozenset(p.name for p in stage_level.params[1:] if p.kind in ("float", "int"))
    offs = tuple((sw.stage, rule) for sw in switches(stage_level, scalars)
                 if (rule := _rule(stage_table.stage(sw.stage).off, sw.reads)) is not None)
    ex = Explained(checked.name, level, groups, g, stripped, names, attrs[-1], chains, use_native, chain_native, note,
                   changed, unchanged, target, offs)
    for grp in groups:
        _became(grp, history, attrs, trace)
        _runs(grp, ex)
    return ex


def _rule(rule: str, reads: tuple) -> str | None:
    """A stage table's off rule with its operands' names replaced by what the stage reads (a parameter's name or a
    constant's value), the tests of constants that hold left out -- None where one does not (the stage is never
    off)."""
    import re
    got = dict(reads)
    text = re.sub(r"\b([A-Za-z_]\w*)\b", lambda m: str(got.get(m.group(1), m.group(1))), rule)
    if " or " in text:
        return text
    parts = text.split(" and ")
    kept = [q for q in parts if re.search(r"[A-Za-z_]", q.replace("inf", ""))]
    constant = [q for q in parts if q not in kept]
    if not all(eval(q, {"__builtins__": {}}, {"inf": float("inf")}) for q in constant):   # (the table's own text)
        return None         # (a constant that keeps the stage on: no call turns it off)
    return " and ".join(kept or parts)


# ---- what each stage became ------------------------------------------------------------------------------------

def _became(grp: Group, history, attrs, trace) -> None:
    first = _stage_nodes(history[0][1], attrs[0], grp.key)
    if grp.stage is not None:
        own = [n for n in first if n.op == grp.stage]
        grp.became.append(f"lowered to the stage op `{grp.stage}`" if own else
                          f"lowered to low-level ops ({_summary(first)})")
    prev = first
    for (pname, g), a in zip(history[1:], attrs[1:]):
        now = _stage_nodes(g, a, grp.key)
        if _sig(now) == _sig(prev):
            continue
        if not now and prev:
            grp.became.append(f"{pname}: {_why_removed(grp, prev, pname)}")
        elif pname == "expand-stages" and any(n.op in DENSE_OPS for n in prev):
            grp.became.append(f"{pname}: expanded to its dense definition ({_summary(now)})")
        elif grp.stage and [n.op for n in prev if n.op in DENSE_OPS] != [n.op for n in now if n.op in DENSE_OPS]:
            grp.became.append(f"{pname}: {_why_changed(grp, prev, now)}")
        elif any(n.op == "logprob_at" for n in prev) and any(n.op == "zeros_like" for n in now):
            grp.became.append(f"{pname}: the logprob is 0 (temperature 0 leaves one token)")
        else:
            grp.became.append(f"{pname}: {len(prev)} -> {_summary(now)}{_PASS_WHAT.get(pname, '')}")
        prev = now
    if grp.stage is not None:
        ops = [n.op for n in prev if n.op in DENSE_OPS]
        if not prev:
            grp.became.append("result: removed")
        elif grp.stage in ops:
            grp.became.append(f"result: kept as the stage op `{grp.stage}`")
        elif ops:
            grp.became.append(f"result: the stage op `{ops[-1]}`")
        else:
            grp.became.append(f"result: low-level ops ({_summary(prev)})")


_PASS_WHAT = {"stages": " (constants folded)", "simplify": " (constants folded, identities)",
              "cse": " (equal nodes shared)", "partition-topk": " (top_k's threshold by partial selection)"}


def _sig(nodes: list[Node]) -> list:
    return [(n.op, n.attrs) for n in nodes]


def _summary(nodes: list[Node], most: int = 6) -> str:
    if not nodes:
        return "none"
    kinds = list(dict.fromkeys(n.op for n in nodes))
    notable = [k for k in kinds if k not in _SHAPE_OPS and OPS[k].doc != "elementwise" and k != "where"]
    ops = notable + [k for k in kinds if k not in notable and k not in _SHAPE_OPS] or kinds   # (the costly first)
    head = ", ".join(ops[:most]) + (", ..." if len(ops) > most else "")
    return f"{len(nodes)} op{'s' if len(nodes) > 1 else ''}: {head}"


def _const_arg(node: Node, i: int):
    a = node.inputs[i]
    return R.const_value(a) if a.op == "const" else None


def _chain_below(node: Node):
    x = node.inputs[0] if node.inputs else None
    while x is not None and x.op in STAGE_OPS:
        yield x
        x = x.inputs[0]


def _why_removed(grp: Group, prev: list[Node], pname: str) -> str:
    op = next((n for n in prev if n.op == grp.stage), None)
    if op is not None and op.op in R._OFF and _const_arg(op, 1) is not None and R._OFF[op.op](_const_arg(op, 1)):
        return f"removed: {_fmt(_const_arg(op, 1))} is its off value"
    if op is not None and op.op == "xtc" and _const_arg(op, 2) == 0.0:
        return "removed: probability 0 is its off value"
    if op is not None and any(R._is_t0(x) for x in _chain_below(op)):
        return "removed: a temperature 0 before it leaves one token (the rest of the chain is greedy)"
    if op is not None and op.op == "temperature" and _const_arg(op, 1) == 0.0:
        return "removed: temperature 0 made the draw greedy (one token left, which greedy picks)"
    if op is not None and pname == "stages":
        return "removed: greedy takes the argmax, which this cut always keeps"
    if pname == "simplify":
        return "folded away at its off value (its guard became a constant)"
    return f"removed by the {pname} pass"


def _why_changed(grp: Group, prev: list[Node], now: list[Node]) -> str:
    before = [n.op for n in prev if n.op in DENSE_OPS]
    after = [n.op for n in now if n.op in DENSE_OPS]
    if before and before[-1] == "sample" and "greedy" in after:
        return "sample became greedy: temperature 0 before it leaves one token, no noise needed"
    if before and before[-1] == "sample" and not after and any(n.op == "argmax" for n in now):
        return "sample became a plain argmax: temperature 0 before it leaves one token (no noise, no RandomBits)"
    if before and before[-1] == "greedy" and not after:
        return "greedy became a plain argmax (no stage op before it to fuse with)"
    return f"{', '.join(before) or 'low-level ops'} -> {', '.join(after) or 'low-level ops'} ({_summary(now)})"


def _fmt(v) -> str:
    return fmt_scalar(v.item() if hasattr(v, "item") else v)


# ---- which kernels run it --------------------------------------------------------------------------------------

def chain_of(ex: Explained, node: Node):
    """The chain (the target pass's region) that runs `node`: the node itself, or the copy the target pass made of
    it (same op and tagged name) where it rebuilt the chain over another input."""
    for i, c in enumerate(ex.chains):
        if any(m is node or (m.op == node.op and m.name is not None and m.name == node.name) for m in c.nodes()):
            return i, c
    return None


def _dense_ops(node: Node) -> str:
    from samplec.frontend.expand import EXPAND
    out = EXPAND[node.op](*node.inputs)
    inner = _reach([out], {id(i) for i in node.inputs})
    nodes = [n for n in Graph("d", (), (("o", out),)).toposort() if id(n) in inner and n.op != "const"]
    return _summary(nodes)


def _runs(grp: Group, ex: Explained) -> None:
    nodes = _stage_nodes(ex.final, ex.group_of, grp.key)
    low = []
    kernel = KERNEL_NAMES.get(ex.target, KERNEL_NAMES["cpu"])
    for n in nodes:
        chain = chain_of(ex, n)
        name = "%" + ex.names[id(n)]
        if chain is not None and ex.chain_native and chain[1].softmax and n in chain[1].softmax:
            if n is chain[1].softmax[-1]:
                grp.runs.append(f"{name} = softmax of the chain's final logits "
                                f"({', '.join(m.op for m in chain[1].softmax)}): written by chain #{chain[0] + 1}, "
                                f"{kernel}")
        elif chain is not None and ex.chain_native and n is chain[1].raw:
            grp.runs.append(f"{name} = log_softmax: its maximum, log-sum-exp and the token's value from chain "
                            f"#{chain[0] + 1}, {kernel} (the full row only where something reads it)")
        elif chain is not None and ex.chain_native and n in chain[1].top_logprobs:
            what = "ids" if n is chain[1].top_logprobs[0] else "values"
            grp.runs.append(f"{name} = {n.op}: top_logprobs' {what} from chain #{chain[0] + 1}, {kernel} "
                            "(selected from its block maxima of the logits)")
        elif chain is not None and ex.chain_native:
            grp.runs.append(f"{name} = {n.op}: chain #{chain[0] + 1}, {kernel}")
        elif n.op in ("penalties", "penalties_overflow") and ex.native:
            grp.runs.append(f"{name} = {n.op}: the native penalty_edits (the window's ids, their penalized logits "
                            "and the check's flag in one primitive, shared by the stage and its check)")
        elif n.op == "logprob_at" and ex.native and n.inputs[0].op == "penalties":
            grp.runs.append(f"{name} = logprob_at: the native edited_logsumexp (the penalized row's and the logits' "
                            "normalizers from one pass)")
        elif n.op == "logprob_at" and ex.native:
            grp.runs.append(f"{name} = logprob_at: the native row_logsumexp and a gather")
        elif ex.target in ("cuda", "metal") and n.op == "topk_ids" and n.inputs[0].op == "log_softmax":
            grp.runs.append(f"{name} = topk_ids: top_logprobs' ids and values by one block a row beside the chain "
                            f"kernel (gpu.top_logprobs: a radix select of the k + {TIE_MARGIN} largest logits, ranked "
                            "by their log-probabilities from the kernel's maximum and log-sum-exp)")
        elif ex.target in ("cuda", "metal") and n.op == "topk_ids" and n.inputs[0].type.dtype == "f32":
            grp.runs.append(f"{name} = topk_ids: the ids and values by one block a row (gpu.top_logprobs on the row "
                            "itself: a radix select of its k largest, lowest id first among equal ones; no sort)")
        elif ex.target in ("cuda", "metal") and n.op == "dry":
            grp.runs.append(f"{name} = dry: one block a row beside the chain kernel writes the penalized row (gpu.dry: "
                            "the history's window gathered, each position walked back while its tokens repeat the "
                            "window's end, the penalties of the tokens that would extend a repeat)")
        elif ex.target == "portable" and n.op in ON_CANDIDATES and _on_candidates(ex.stripped) and chain is None \
                and (n.op != "argmax" or n.inputs[0].op in STAGE_OPS):
            grp.runs.append(f"{name} = {n.op}: the portable lowering on the CPU's candidates: {ON_CANDIDATES[n.op]}")
        elif ex.target in ("portable", "metal") and n.op in PORTABLE and chain is None:
            grp.runs.append(f"{name} = {n.op}: the portable lowering: {PORTABLE[n.op]}")
        elif n.op in DENSE_OPS:
            grp.runs.append(f"{name} = {n.op}: its dense definition in MLX ops ({_dense_ops(n)})")
        else:
            low.append(n)
    if low:
        covered = lambda n: ex.native and n.op in NATIVE_PRIMITIVES and \
            (n.op != "take_along" or n.inputs[0].op == "log_softmax") and \
            (n.op != "reduce_max" or n.type.dtype == "f32" and len(n.inputs[0].type.shape) == 2)   # (the rules' conditions)
        natives = [f"{NATIVE_PRIMITIVES[n.op]} ({n.op})" for n in low if covered(n)]
        rest = [n for n in low if not covered(n)]
        if natives:
            grp.runs.append("native primitives where their rule applies: " + ", ".join(dict.fromkeys(natives)))
        if rest:
            grp.runs.append(f"MLX ops ({_summary(rest)})")


# ---- text ------------------------------------------------------------------------------------------------------

def render_text(ex: Explained) -> str:
    out = [f"sampler {ex.name}: -O{ex.level}, target {ex.target} ({COST[ex.target]}); native CPU kernels "
           f"{ex.native_note}",
           f"passes that changed something: {' '.join(ex.changed) or '(none)'}"
           + (f"; no change: {' '.join(ex.unchanged)}" if ex.unchanged else "")]
    if ex.switches:
        out.append("stages a call runs without when its values leave them off in every row: " +
                   ", ".join(f"{stage} ({rule})" for stage, rule in ex.switches))
    if ex.chains:
        for i, c in enumerate(ex.chains):
            covered = sorted({ex.group_of.get(id(n), tag_of(n)) for n in c.nodes()} - {LOGITS, OUTPUTS, None})
            titles = [g.title for g in ex.groups if g.key in covered]
            how = "the CUDA chain kernel (region cuda.chain)" if ex.target == "cuda" else CHAIN_KERNEL \
                if ex.chain_native else "no native kernel: each stage op runs its dense definition"
            out.append(f"chain #{i + 1}: {' -> '.join(titles) or (c.draw.op if c.draw is not None else 'stages')}"
                       f"{' (and the logprob)' if c.logprobs else ''}: {how}")
    for grp in ex.groups:
        if grp.key == LOGITS:
            head = grp.title
        elif grp.key == OUTPUTS:
            head = grp.title
        else:
            head = f"{grp.key + 1}. {grp.title}  (line {grp.line})"
        if grp.key in (LOGITS, OUTPUTS) and not grp.runs and not grp.became:
            continue
        out.append("")
        out.append(head)
        out += [f"   {b}" for b in grp.became]
        if grp.runs:
            out += ["   runs as: " + grp.runs[0]] + [f"            {r}" for r in grp.runs[1:]]
        elif grp.key not in (LOGITS, OUTPUTS):
            out.append("   runs as: nothing (no node is left)")
    checks = [c.message for c in ex.final.checks]
    out += ["", "checks: " + ("; ".join(checks) if checks else "none")]
    return "\n".join(out) + "\n"


# ---- DOT -------------------------------------------------------------------------------------------------------

def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render_dot(ex: Explained) -> str:
    g = ex.final
    name = lambda n: "%" + ex.names[id(n)]
    pnodes = {id(p.node) for p in g.params}

    def operand(i: Node) -> str:
        return fmt_scalar(i.attr("value")) if i.op == "const" else name(i)

    def node_line(n: Node) -> str:
        attrs = ", ".join(f"{k}={v}" for k, v in n.attrs)
        label = f"{name(n)} = {n.op}({', '.join(operand(i) for i in n.inputs)})" + (f" {{{attrs}}}" if attrs else "")
        extra = ""
        c = chain_of(ex, n)
        if c is not None:
            extra = ', style=filled, fillcolor="#dbe8ff"'
        elif n.op in DENSE_OPS:
            extra = ', style=filled, fillcolor="#fff2cc"'
        return f"    {_q(name(n))} [label={_q(label + chr(10) + str(n.type))}{extra}];"

    legend = (f"sampler {ex.name} (-O{ex.level}); blue: covered by the native chain kernel on the CPU, "
              "yellow: a stage op run by its dense definition")
    lines = [f"digraph {_q(ex.name)} {{", "  rankdir=TB;", "  node [shape=box, fontname=monospace, fontsize=10];",
             f"  label={_q(legend)};",
             "  labelloc=t;", '  subgraph "cluster_params" {', '    label="parameters"; style=dotted;']
    for p in g.params:
        lines.append(f"    {_q(name(p.node))} [shape=ellipse, label={_q(f'{name(p.node)}: {p.node.type} {p.kind}')}];")
    lines.append("  }")
    by_group: dict[int, list[Node]] = {}
    for n in g.toposort():
        if id(n) in pnodes or (n.op == "const" and not _is_root(g, n)):
            continue
        by_group.setdefault(ex.group_of[id(n)], []).append(n)
    for grp in ex.groups:
        nodes = by_group.get(grp.key, [])
        title = grp.title if grp.line is None else f"{grp.key + 1}. {grp.title} (line {grp.line})"
        if not nodes:
            if grp.stage is not None:
                why = grp.became[-2] if len(grp.became) >= 2 else "removed"
                lines.append(f"  {_q(f'removed_{grp.key}')} [shape=note, style=dashed, "
                             f"label={_q(title + chr(10) + why)}];")
            continue
        chains = sorted({chain_of(ex, n)[0] + 1 for n in nodes if chain_of(ex, n) is not None})
        style = "style=rounded"
        if chains:
            title += f"\nchain #{', #'.join(map(str, chains))}: native chain kernel on the CPU"
            style = 'style="rounded,bold"; color="#3366cc"'
        lines.append(f'  subgraph "cluster_{_cluster(grp.key)}" {{')
        lines.append(f"    label={_q(title)}; {style};")
        lines += [node_line(n) for n in nodes]
        lines.append("  }")
    for n in g.toposort():
        if id(n) in pnodes or (n.op == "const" and not _is_root(g, n)):
            continue
        for i in n.inputs:
            if i.op != "const":
                lines.append(f"  {_q(name(i))} -> {_q(name(n))};")
    for k, c in enumerate(g.checks):
        lines.append(f"  {_q(f'check {k}')} [shape=octagon, label={_q('check: ' + c.message)}];")
        lines.append(f"  {_q(name(c.flag))} -> {_q(f'check {k}')};")
    for k, n in g.outputs:
        lines.append(f"  {_q('output ' + k)} [shape=ellipse, style=bold, label={_q('output ' + k)}];")
        lines.append(f"  {_q(name(n))} -> {_q('output ' + k)};")
    return "\n".join(lines) + "\n}\n"


def _cluster(key: int) -> str:
    return "logits" if key == LOGITS else "outputs" if key == OUTPUTS else str(key)


def _is_root(g: Graph, n: Node) -> bool:
    return any(r is n for r in g.roots())


def render_image(dot_text: str, fmt: str) -> bytes:
    """DOT text rendered by graphviz's `dot` binary (svg or png)."""
    import shutil
    import subprocess
    from samplec.diagnostics import SamplecError
    exe = shutil.which("dot")
    if exe is None:
        raise SamplecError(f"--emit {fmt} needs graphviz's `dot` program, which is not installed (Debian/Ubuntu: "
                           f"apt-get install graphviz; macOS: brew install graphviz); --emit dot prints the DOT text "
                           f"without it")
    try:
        res = subprocess.run([exe, f"-T{fmt}"], input=dot_text.encode(), capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SamplecError(f"graphviz's dot failed: {e}") from None
    if res.returncode != 0:
        raise SamplecError(f"graphviz's dot failed: {res.stderr.decode(errors='replace').strip()}")
    return res.stdout


__all__ = ["explain", "render_text", "render_dot", "render_image", "Explained", "native_state"]
