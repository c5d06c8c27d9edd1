"""The MLX interpreter: a loop over the graph's nodes, calling `KERNELS[op]`, optionally under `mx.compile`.

`Executable(graph)` turns a graph into a function of its parameters (in declaration order) returning its
outputs followed by its check flags (bool [B], or [B, 1] where the flag is a squeeze: the squeeze is skipped).
A stage op (`top_p`, `sample`, ...) runs its dense definition (samplec/frontend/expand.py) unless a faster
kernel covers it: where the native primitives serve, a chain of stage ops ending in a draw (`Chain`) is one
primitive that picks its algorithm per row, and `lowering.RULES` cover patterns of low-level nodes with one
primitive each. On failure the error names the IR op and value being executed.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from samplec.backend_mlx import gpu, native
from samplec.backend_mlx.kernels import KERNELS, bias_row, folded
from samplec.backend_mlx.lowering import (MLX_RULES, RULES, TIE_MARGIN, log_softmax_parts, logprob_at_key,
                                         penalty_edits, softmax_pattern, unexpanded)
from samplec.diagnostics import SamplecError
from samplec.frontend.expand import EXPAND
from samplec.ir.graph import INPUT, Graph, Node
from samplec.ir.ops import DRAW_OPS, STAGE_OPS
from samplec.ir.printer import Namer
from samplec.ir.types import Type


class Chain:
    """Stage ops x_0 -> stage_1 -> ... -> stage_n -> draw, and the draw's `logprob_at` users: one kernel runs them
    together. Only the draw and, where something else reads it, stage_n's result leave the chain -- or, where
    that something is only softmax(stage_n) (a `probs` output), the softmax: the kernel writes it directly."""

    def __init__(self, draw: Node | None, stages: list[Node], logprobs: list[Node], want_x: bool,
                 softmax: tuple[Node, ...] = (), edits: tuple[Node, ...] = (), top: tuple[Node, ...] = (),
                 raw: Node | None = None, checks: tuple = (None, None), top_logprobs: tuple[Node, ...] = (),
                 prefix: tuple = (), n_pre: int = 0, base: Node | None = None):
        self.draw, self.stages, self.logprobs, self.want_x = draw, stages, logprobs, want_x and not softmax
        self.softmax = softmax      # (reduce_max, sub, exp, reduce_sum, div) of the probs pattern, or ()
        # the penalties stages read by the chain alone, innermost first: the kernel runs on the logits below them
        # with their edits written in order (lowering.penalty_edits); () without one
        self.edits = edits
        self.top = top              # argmax(x) and its take_along(x, .) users (the logits checks), or ()
        # the logits checks on squeeze(take_along(x, argmax(x))): logical_or(isnan, isposinf) and eq(., -inf); the
        # kernel gives both flags (outside the chain's nodes: they read its result through a squeeze)
        self.checks = checks
        # log_softmax of the logits below the edits (raw_logprob, top_logprobs), or None: the kernel gives their
        # maximum and log-sum-exp, and the token's log-probability under it (its take_along at the token reads it)
        self.raw = raw
        # topk_ids(raw, n) and its take_along(raw, .) users (top_logprobs(n): ids and values), or (): the kernel
        # selects them from its block maxima of the logits (lowering.TIE_MARGIN more, ranked as _topk_ids ranks)
        self.top_logprobs = top_logprobs
        # allow and logit_bias nodes (Prefix) from the logits up, the first n_pre of them below the edits: the
        # kernel applies them as it writes the row and gives the maxima their checks read
        self.prefix, self.n_pre = prefix, n_pre
        self.base = base if base is not None else stages[0].inputs[0] if stages else draw.inputs[0]
        # the penalties_overflow nodes (checks) of the penalties stages, innermost first, where a GPU target's
        # kernel gives them (passes/chains.py sets them; None where a stage has none)
        self.overflows: tuple = ()

    def nodes(self) -> list[Node]:
        ops = lambda ps: [m for p in ps for m in (p.node, *p.maxes)]
        return list(self.top) + ops(self.prefix[:self.n_pre]) + list(self.edits) + ops(self.prefix[self.n_pre:]) + \
            self.stages + ([self.draw] if self.draw is not None else []) + self.logprobs + list(self.softmax) + \
            ([self.raw] if self.raw is not None else []) + list(self.top_logprobs) + \
            [o for o in self.overflows if o is not None]

    def run_gpu(self, env: dict, evaluate) -> dict | None:
        """On a GPU (CUDA, or Metal with its build active): the stages, the draw and its log-probabilities (and the
        final logits or their softmax where something reads them) as gpu.sample_chain's one kernel, with the allow,
        logit_bias and penalties nodes below the stages applied in it (gpu.MAX_PENALTIES stages); the chain's
        other nodes (the edits' own checks, the logits checks' maxima, the model's log-softmax and
        top_logprobs) by `evaluate`, each by its definition. None where the kernel does not apply."""
        terminal = self.draw.op if self.draw is not None else "greedy"      # (no draw: its result unread)
        out_x = 2 if self.softmax else 1 if self.want_x else 0
        if not gpu.chain_supports([s.op for s in self.stages], terminal) or (self.draw is None and not out_x):
            return None
        # the logits' own maximum and log-sum-exp from the kernel's pass over them, where the logits checks or the
        # model's log-softmax read them
        raw = bool(self.top) or self.raw is not None
        core = {id(n) for n in (*self.stages, self.draw, *self.logprobs, *self.softmax, *self.top,
                                *((self.raw,) if self.raw is not None else ()))}
        for m in self.nodes():
            if id(m) not in core:
                env[id(m)] = evaluate(m, env)       # (lazy: what nothing reads, the kernel's edits, never runs)
        x = self.stages[0].inputs[0] if self.stages else self.draw.inputs[0]
        args = (self.params(env), [s.op for s in self.stages], terminal, bool(self.logprobs), out_x)
        out = None
        V = env[id(self.base)].shape[-1]
        if (self.prefix or self.edits) and len(self.edits) <= gpu.MAX_PENALTIES:
            # the allow, logit_bias and penalties nodes below the stages, from the logits up: the kernel applies them
            # as it reads the row
            def edit(p: Prefix) -> tuple[str, mx.array]:
                if p.kind == "sparse":          # (a literal bias: its row, a constant of the call)
                    return "logit_bias", bias_row(p.operand.attr("ids"), p.operand.attr("values"), V)
                return ("allow" if p.kind == "mask" else "logit_bias"), env[id(p.operand)]
            pen = tuple(("penalties", tuple(env[id(unexpanded(i))] for i in e.inputs[1:])) for e in self.edits)
            edits = tuple(map(edit, self.prefix[:self.n_pre])) + pen + tuple(map(edit, self.prefix[self.n_pre:]))
            out = gpu.sample_chain(env[id(self.base)], *args, edits=edits, raw=raw)
        edits_in = out is not None
        # (the kernel reads the logits themselves where it applies the edits or there are none)
        raw = raw and (edits_in or x is self.base)
        if out is None:
            out = gpu.sample_chain(env[id(x)], *args, raw=raw)
        if out is None:
            return None
        bound = {id(n): out[1] for n in self.logprobs}
        if raw:
            m, lz, at = out[-3:]
            bound.update((id(t), m) for t in self.top[1:])
            if self.raw is not None:
                bound.update(log_softmax_parts(self.raw, env[id(self.base)], m, lz))
                if self.draw is not None:       # (raw_logprob: the kernel's logit at the token, no gather)
                    bound[logprob_at_key(self.raw.inputs[0], self.draw)] = (at - m) - lz
        else:
            for m in (*self.top, *((self.raw,) if self.raw is not None else ())):
                env[id(m)] = evaluate(m, env)
        if self.draw is not None:
            bound[id(self.draw)] = out[0]
        if out_x:       # (the final logits for their other readers, or the softmax a `probs` output is)
            bound[id(self.softmax[-1] if self.softmax else self.stages[-1])] = out[2]
        if edits_in:
            # the penalties' checks, and the edited row's maximum for the top edit's checks (an allow or a
            # logit_bias above every other edit)
            at = 2 + bool(out_x)
            if self.edits:
                bound.update((id(o), out[at][:, j]) for j, o in enumerate(self.overflows) if o is not None)
                at += 1
            top = self.prefix[-1] if self.prefix and (len(self.prefix) > self.n_pre or not self.edits) else None
            if top is not None:
                bound.update((id(m), out[at]) for m in top.maxes)
        return bound

    def params(self, env: dict) -> list[mx.array]:
        """The stages' operands after x in order, then the draw's (sample: the seed and the position)."""
        draws = self.draw.inputs[1:] if self.draw is not None else ()
        return [env[id(unexpanded(i))] for s in self.stages for i in s.inputs[1:]] + \
            [env[id(unexpanded(i))] for i in draws]

    def run(self, env: dict) -> dict | None:
        params = self.params(env)
        x, edits = env.get(id(self.base)), ()
        ops = tuple((p.kind, env[id(p.operand)]) for p in self.prefix)
        if self.edits:
            pen = penalty_edits(self.edits[-1], env, (self.base, ops[:self.n_pre]) if self.n_pre else ())
            if pen is None:
                return None
            x, edits = pen[0], pen[1]
        top_n = self.top_logprobs[0].attr("k") if self.top_logprobs else 0
        terminal = "greedy" if self.draw is None or self.draw.op == "argmax" else self.draw.op
        out = native.sample_chain(x, params, [s.op for s in self.stages], terminal, bool(self.logprobs),
                                  self.want_x, bool(self.softmax), tuple(edits), bool(self.top), self.raw is not None,
                                  top_n, TIE_MARGIN, ops, tuple(bool(p.maxes) for p in self.prefix), self.n_pre)
        if out is None:
            return None
        bound = {id(n): out[1] for n in self.logprobs}
        if self.draw is not None:
            bound[id(self.draw)] = out[0]
        at = 2 + (self.want_x or bool(self.softmax))
        if self.top:
            bound[id(self.top[0])] = out[at]
            bound.update((id(t), out[at + 1]) for t in self.top[1:])
            bound.update((id(c), f) for c, f in zip(self.checks, out[at + 2:at + 4]) if c is not None)
            at += 4
        if self.raw is not None:
            logits = self.raw.inputs[0]
            bound.update(log_softmax_parts(self.raw, env[id(logits)], out[at], out[at + 1]))
            bound[logprob_at_key(logits, self.draw)] = out[at + 2]       # (see lowering._take_along)
            if self.top_logprobs:
                bound[id(self.top_logprobs[0])] = out[at + 3]
                bound.update((id(t), out[at + 4]) for t in self.top_logprobs[1:])
        maxima = iter(out[len(out) - sum(bool(p.maxes) for p in self.prefix):])
        for p in self.prefix:
            if p.maxes:
                bound.update((id(m), v) for v in [next(maxima)] for m in p.maxes)
        if self.want_x:
            bound[id(self.stages[-1])] = out[2]
        if self.softmax:
            bound[id(self.softmax[-1])] = out[2]
        return bound


def _ends_stages(n: Node, users: dict) -> bool:
    """Whether n is a stage op no other chain takes: no draw reads it (a draw's chain takes it, and returns it where
    something else reads it too), and it is not the one reader of a stage op above it (that one's chain takes it).
    It is the last of its stages, read by something else: an allow, a logit_bias, the penalties or DRY after a cut,
    the outputs of a chain with no terminal, or a stage op and other readers at once (mirostat's temperature, read
    by its truncation and its estimate)."""
    readers = users.get(id(n), [])
    return n.op in STAGE_OPS and not any(u.op in DRAW_OPS and u.inputs[0] is n for u in readers) and \
        not (len(readers) == 1 and readers[0].op in STAGE_OPS)


def find_chains(graph: Graph, for_gpu: bool = False) -> list[Chain]:
    """Every draw, with the stage ops before it: the last one may be read elsewhere too (the kernel then also
    returns its result, or its softmax where that is all the reader wants: `probs`), the others only by the next.
    An argmax (greedy() after the passes) is a draw where allow or logit_bias nodes lie below it. Stage ops that
    end without a draw (an edit after a cut, a chain with no terminal) are a chain too: the kernel's greedy draw
    runs, unread, beside the result. With for_gpu (a GPU target's kernel, which gives every penalties stage's check
    and applies a literal logit_bias) an argmax right after penalties is a chain too (on the CPU, lowering.RULES'
    argmax_put runs it), a stack of penalties read by their checks is the chain's without an edit below it, and a
    sparse_add is a prefix."""
    users = graph.users()
    roots = {id(r) for r in graph.roots()}
    chains, claimed = [], set()
    for n in graph.toposort():
        drawless = _ends_stages(n, users)
        if n.op not in DRAW_OPS and n.op != "argmax" and not drawless:
            continue
        x = n if drawless else n.inputs[0]
        logprobs = [u for u in users.get(id(x), []) if u.op == "logprob_at" and u.inputs[1] is n]
        stages, want_x, softmax = [], False, ()
        if x.op in STAGE_OPS:
            others = [u for u in users.get(id(x), []) if u is not n and u not in logprobs]
            want_x = bool(others)
            top = next((u for u in others if u.op == "reduce_max"), None)
            pattern = softmax_pattern(top, users) if len(others) == 2 and top is not None else None
            if pattern and pattern[0] in others and not {id(m) for m in (top, *pattern[:-1])} & roots:
                softmax = (top, *pattern)
            stages.append(x)
            x = x.inputs[0]
            while x.op in STAGE_OPS and all(u is stages[-1] for u in users.get(id(x), [])):
                stages.append(x)
                x = x.inputs[0]
        first = stages[-1] if stages else n
        also = () if stages else tuple(logprobs)        # (no stages: the draw's logprob_at read x too)
        post = _prefix_of(x, first, users, roots, also=also, sparse=for_gpu)[:native.MAX_PREFIX]
        if post:
            first, x, also = post[-1].node, post[-1].below, ()
        edits = []
        while x.op == "penalties" and id(x) not in roots and \
                all(u is first or u in also for u in users.get(id(x), [])):
            edits.append(x)
            first, x, also = x, x.inputs[0], ()
        stack = list(edits)
        while edits and x.op == "penalties":     # (one read elsewhere too: its edits are the chain's as well)
            stack.append(x)
            x = x.inputs[0]
        pre = []
        if edits and _owned(stack, users):
            pre = _prefix_of(x, stack[-1], users, roots, {p.inputs for p in stack},
                             sparse=for_gpu)[:native.MAX_PREFIX - len(post)]
            if pre:       # (the penalties read by their checks alone are the chain's too: they read its nodes)
                edits, x = stack, pre[-1].below
            elif for_gpu:     # (the GPU kernel gives every stage's check: the whole stack is the chain's)
                edits = stack
        if n.op == "argmax" and not (pre or post or (for_gpu and edits)):
            continue          # (argmax_take, argmax_put: lowering.RULES)
        if drawless:
            chains.append(Chain(None, stages[::-1], [], want_x, softmax, tuple(edits[::-1]),
                                prefix=tuple(pre[::-1] + post[::-1]), n_pre=len(pre), base=x))
            continue
        top = _top_of(x, users)
        if any(id(t) in claimed for t in top):
            top = ()
        claimed.update(id(t) for t in top)
        raw = next((u for u in users.get(id(x), []) if u.op == "log_softmax" and id(u) not in claimed), None)
        if raw is not None:
            claimed.add(id(raw))
        top_logprobs = _top_logprobs_of(raw, users) if raw is not None else ()
        chains.append(Chain(n, stages[::-1], logprobs, want_x, softmax, tuple(edits[::-1]), top, raw,
                            _checks_of(top, users), top_logprobs, tuple(pre[::-1] + post[::-1]), len(pre), x))
    return chains


class Prefix(NamedTuple):
    """An allow or logit_bias node a chain's kernel applies as it writes the row: where(mask, below, -inf) ("mask")
    or add(below, bias) ("bias") of a mask or bias parameter shaped like the row -- on a GPU target also a literal
    bias, sparse_add(below) with unique ids ("sparse": the operand is the node itself, its row a constant of the
    call) --, and its reduce_max users (checks)."""
    node: Node
    kind: str
    operand: Node
    below: Node
    maxes: tuple[Node, ...]


def _prefix_of(x: Node, first: Node, users: dict, roots: set, overflows: set = frozenset(),
               also: tuple = (), sparse: bool = False) -> list[Prefix]:
    """The allow and logit_bias nodes from x down, each read only by the node above it (`first`, for x; and, for
    x, the chain's nodes in `also`), by reduce_max (their checks) and, the lowest, by penalties_overflow nodes with
    operands in `overflows` (the checks of penalties above, whose edits the kernel computes through them): top
    first."""
    ops = []
    while id(x) not in roots and x.type.dtype == "f32" and len(x.type.shape) == 2:
        if x.op == "where" and len(x.inputs) == 3 and x.inputs[2].op == "const" and \
                x.inputs[2].attr("value") == float("-inf") and x.inputs[0].type.dtype == "bool" and \
                x.inputs[0].op == INPUT and x.inputs[0].type.shape == x.type.shape == x.inputs[1].type.shape:
            kind, operand, below = "mask", x.inputs[0], x.inputs[1]
        elif x.op == "add" and len(x.inputs) == 2 and x.inputs[1].op == INPUT and \
                x.type == x.inputs[0].type == x.inputs[1].type:
            kind, operand, below = "bias", x.inputs[1], x.inputs[0]
        elif sparse and x.op == "sparse_add" and len(set(x.attr("ids"))) == len(x.attr("ids")):
            kind, operand, below = "sparse", x, x.inputs[0]          # (a literal bias: its row is a constant)
        else:
            break
        readers = users.get(id(x), [])
        maxes = tuple(u for u in readers if u.op == "reduce_max" and u.inputs == (x,) and id(u) not in roots)
        if not all(u is first or u in maxes or u in also or (u.op == "penalties_overflow" and u.inputs in overflows)
                   for u in readers) or first not in readers:
            break
        ops.append(Prefix(x, kind, operand, below, maxes))
        first, x, also = x, below, ()
    return ops


def _owned(stack: list[Node], users: dict) -> bool:
    """A chain's penalties nodes, top first, read only by the one above them, the chain (the first) and
    penalties_overflow nodes (checks): the edits' x may then be read through allow and logit_bias nodes below
    them."""
    return all(u is stack[i - 1] or u.op == "penalties_overflow"
               for i, p in enumerate(stack) if i > 0 for u in users.get(id(p), []))


def _top_of(x: Node, users: dict) -> tuple[Node, ...]:
    """argmax(x) and its users take_along(x, argmax(x)) -- the logits checks' maximum -- when nothing else reads
    the argmax: the chain kernel finds them in its own pass over x."""
    for a in users.get(id(x), []):
        if a.op == "argmax" and a.inputs[0] is x:
            takes = users.get(id(a), [])
            if takes and all(t.op == "take_along" and t.inputs == (x, a) for t in takes):
                return (a, *takes)
    return ()


def _top_logprobs_of(raw: Node, users: dict) -> tuple[Node, ...]:
    """topk_ids(raw, n) (n <= 64) and its take_along(raw, ids) users -- top_logprobs(n)'s ids and values -- when
    nothing else reads the ids: the chain kernel gives both."""
    for t in users.get(id(raw), []):
        if t.op == "topk_ids" and t.inputs[0] is raw and 1 <= t.attr("k") <= 64:
            takes = users.get(id(t), [])
            if all(u.op == "take_along" and u.inputs == (raw, t) for u in takes):
                return (t, *takes)
    return ()


def _checks_of(top: tuple[Node, ...], users: dict) -> tuple[Node | None, Node | None]:
    """The logits checks the frontend writes on v = squeeze(take_along(x, argmax(x))) (lower.py): the node
    logical_or(isnan(v), isposinf(v)) and the node eq(v, -inf), each None where the graph does not hold it."""
    bad = ninf = None
    for t in top[1:]:
        for v in users.get(id(t), []):
            if v.op != "squeeze":
                continue
            for u in users.get(id(v), []):
                if u.op == "eq" and u.inputs[0] is v and u.inputs[1].op == "const" and \
                        u.inputs[1].attr("value") == float("-inf") and u.type.shape == v.type.shape:
                    ninf = u
                for w in users.get(id(u), []) if u.op in ("isnan", "isposinf") else ():
                    if w.op == "logical_or" and {i.op for i in w.inputs} == {"isnan", "isposinf"} and \
                            all(i.inputs[0] is v for i in w.inputs) and w.type.shape == v.type.shape:
                        bad = w
    return bad, ninf


def _run_expansion(node: Node, ins: list[mx.array]) -> mx.array:
    """A stage op's dense definition, built over its operands' concrete types and run op by op."""
    holes = [Node(INPUT, (), (), Type(_IR_DTYPE[a.dtype], tuple(a.shape)), f"in{i}") for i, a in enumerate(ins)]
    out = EXPAND[node.op](*holes)
    env = {id(h): a for h, a in zip(holes, ins)}
    for n in Graph("expansion", (), (("out", out),)).toposort():
        if id(n) not in env:
            env[id(n)] = KERNELS[n.op]([env[id(i)] for i in n.inputs], n.attr_dict)
    return env[id(out)]


_IR_DTYPE = {mx.float32: "f32", mx.int32: "i32", mx.uint32: "u32", mx.uint64: "u64", mx.bool_: "bool"}


FLAG_BITS = 32


def pack_flags(flags: list[mx.array]) -> list[mx.array]:
    """A call's check flags (bool [B], or [B, 1] where the graph squeezes them) as uint32 words [B]: flag i is
    bit i % 32 of word i // 32. Where each flag was a kernel of its own (a launch on a GPU, and a node for the
    host to replay each call), they fuse into one kernel with what computed them: each flag as a [B, 1] column
    (`flag_column`), the word reshaped to [B] at the end (a view)."""
    words = []
    for at in range(0, len(flags), FLAG_BITS):
        word = None
        for i, f in enumerate(flags[at:at + FLAG_BITS]):
            bit = (f if f.ndim == 2 else f.reshape(-1, 1)).astype(mx.uint32)
            bit = bit << i if i else bit
            word = bit if word is None else word | bit
        words.append(word.reshape(-1))
    return words


# the ops of a check's flag that `flag_column` computes again on [B, 1] columns
_COLUMN_OPS = frozenset({"isnan", "isposinf", "isfinite", "logical_or", "logical_and", "logical_not", "eq", "ne",
                         "lt", "le", "gt", "ge"})
# each binary op of _COLUMN_OPS: the op that gives the same values with its operands swapped
_MIRRORED = {"eq": "eq", "ne": "ne", "logical_or": "logical_or", "logical_and": "logical_and", "lt": "gt",
             "gt": "lt", "le": "ge", "ge": "le"}


def flag_column(f: Node, env: dict) -> mx.array:
    """A check's flag (bool [B]) as a [B, 1] column, for `pack_flags`: where the graph squeezed a [B, 1] value and
    tested it in [B] (the logits' checks on their row maximum), the same tests run on the column, in the kernel that
    packs the flags -- a [B] value read through a reshape would be a kernel of its own."""
    memo: dict[int, mx.array | None] = {}

    def column(n: Node) -> mx.array | None:
        if id(n) not in memo:
            if n.op == "squeeze" and n.inputs[0].type.shape[-1:] == (1,):
                memo[id(n)] = env.get(id(n.inputs[0]))
            elif n.op == "const" and not n.type.shape:
                memo[id(n)] = env.get(id(n))
            elif n.op in _COLUMN_OPS and len(n.type.shape) == 1:
                ins = [column(i) for i in n.inputs]
                # (a comparison's operands swapped: MLX's compile would merge the same comparison made elsewhere in
                # the call -- the draw's test of the same maximum -- into one node, a kernel of its own)
                op, ins = (_MIRRORED[n.op], ins[::-1]) if n.op in _MIRRORED else (n.op, ins)
                memo[id(n)] = None if any(i is None for i in ins) else KERNELS[op](ins, n.attr_dict)
            else:
                memo[id(n)] = None
        return memo[id(n)]
    got = column(f)
    return got if got is not None else env[id(f)]


def unpack_flags(words, n: int) -> list[np.ndarray]:
    """The n check flags of `pack_flags`' words (host arrays of any shape: a chunk of steps stacks them), as
    bool arrays of the words' shape, in the graph's check order. A word with no bit set (every step where nothing
    fired) gives its flags as one shared all-false array, without unpacking it."""
    host = [np.asarray(w) for w in words]
    clear = [None if w.any() else np.zeros(w.shape, dtype=bool) for w in host]
    return [clear[i // FLAG_BITS] if clear[i // FLAG_BITS] is not None else
            ((host[i // FLAG_BITS] >> (i % FLAG_BITS)) & 1).astype(bool) for i in range(n)]


class Executable:
    """Runs a target-level graph: its regions by their kernels (the CPU's or the CUDA chain kernel), every other
    node by its kernel in KERNELS (a stage op left outside a region: by its dense definition, or on the CPU by a
    native single-op kernel of lowering.RULES). `trace` lists, for the last traced call, each region's kernel
    and whether it ran ("kernel") or fell back to its nodes' definitions ("definitions"), each node a native
    single-op kernel ran ("native", op), and each stage op run by its dense definition ("definition", op): a fast
    path that silently stops shows there."""

    def __init__(self, graph: Graph, compile: bool = True, target: str = "cpu"):
        self.graph = graph
        self.target = target
        self.index = {id(p.node): i for i, p in enumerate(graph.params)}
        self.roots = graph.roots()
        self.covered = {id(n): r for r in graph.regions for n in r.nodes}
        self.order = graph.schedule()
        missing = sorted({n.op for n in self.order} - set(KERNELS) - set(EXPAND))
        if missing:
            raise SamplecError(f"no MLX kernel for op(s): {', '.join(missing)}")
        self.compile = compile
        self.trace: list[tuple[str, str]] = []
        self._n_out = len(graph.outputs)
        self._per_thread = threading.local()
        # a [B] parameter read only by `expand` nodes outside any region ([B] -> [B, 1]) can be handed in as [B, 1]
        # (`run_eager`): the call's graph then has no view of its own for it (a node less for the host to replay)
        users = graph.users()
        self._expands = {}
        for p in graph.params:
            readers = users.get(id(p.node), [])
            if len(p.node.type.shape) == 1 and readers and all(
                    u.op == "expand" and id(u) not in self.covered for u in readers):
                self._expands[id(p.node)] = tuple(readers)

    def wide_params(self) -> frozenset:
        """The names of the parameters this executable takes as [B, 1] as well as [B] (`run_eager`) and reads
        only so: none where the target's rules (native kernels, a GPU chain kernel) read parameters themselves."""
        if self._rules()[0]:
            return frozenset()
        return frozenset(p.name for p in self.graph.params if id(p.node) in self._expands)

    def _rules(self) -> tuple[dict, bool]:
        """(the rules that run nodes by native or GPU kernels here, whether a GPU chain kernel runs)"""
        on_gpu = self.target == "cuda" and gpu.available() or self.target == "metal" and gpu.metal_status()[0]
        return RULES if self.target == "cpu" and native.enabled() else MLX_RULES if on_gpu else {}, on_gpu

    def run_eager(self, *args: mx.array, first: list[mx.array] = ()) -> list[mx.array]:
        """The outputs, then the check flags -- `first` (the arguments' own checks), then the graph's -- packed
        into words (`pack_flags`)."""
        env = {}
        for p, a in zip(self.graph.params, args):
            if a.ndim == 2 and len(p.node.type.shape) == 1:     # (a [B] parameter handed in as [B, 1])
                for e in self._expands.get(id(p.node), ()):
                    env[id(e)] = a
                a = a.reshape(a.shape[0])       # (in the call's graph only where a node reads it)
            env[id(p.node)] = a
        rules, on_gpu = self._rules()
        users = self.graph.users() if rules else {}
        trace = []
        for node in self.order:
            if id(node) in env:         # covered by a native rule of an earlier node, or by its region's kernel
                continue
            try:
                region = self.covered.get(id(node))
                if region is not None:
                    # (the region's first node: everything it reads is computed)
                    chain = region.impl
                    bound = chain.run_gpu(env, self._evaluate) if on_gpu else chain.run(env) if rules else None
                    trace.append((region.kernel, "kernel" if bound else "definitions"))
                    if bound:
                        env.update(bound)
                        for m in chain.nodes():         # (stages read by nothing outside the chain)
                            env.setdefault(id(m), None)
                        continue
                    for s in chain.nodes():      # (the kernel declined: each by its definition, once)
                        if id(s) not in env:
                            if s.op in EXPAND:
                                trace.append(("definition", s.op))
                            env[id(s)] = self._evaluate(s, env)
                    continue
                rule = rules.get(node.op)
                bound = rule(node, users, env) if rule is not None else None
                if bound:
                    trace.append(("native" if rules is RULES else "rule", node.op))
                    env.update(bound)
                elif node.op in EXPAND:
                    trace.append(("definition", node.op))
                    env[id(node)] = _run_expansion(node, [env[id(i)] for i in node.inputs])
                else:
                    ins = [env[id(i)] for i in node.inputs]
                    got = folded(node.op, ins, node.attr_dict)
                    env[id(node)] = got if got is not None else KERNELS[node.op](ins, node.attr_dict)
            except Exception as e:
                raise SamplecError(f"while executing %{Namer()(node)} = {node.op} ({node.type}): {e}") from e
        self.trace = trace
        n = len(self.graph.outputs)
        return [env[id(r)] for r in self.roots[:n]] + \
            pack_flags([*first, *(flag_column(f, env) for f in self.roots[n:])])

    @staticmethod
    def _evaluate(node: Node, env: dict) -> mx.array:
        """A node by its definition (a stage op's dense definition, else its kernel)."""
        ins = [env[id(i)] for i in node.inputs]
        return _run_expansion(node, ins) if node.op in EXPAND else KERNELS[node.op](ins, node.attr_dict)

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_per_thread"]            # (compiled functions stay with the threads that traced them)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._per_thread = threading.local()

    def _fn(self, pre=None):
        """run_eager under `mx.compile` (after `pre`, when given: see `queued`), one compiled function per thread
        and `pre`. MLX keeps its compile cache per thread, and a cache entry holds the Python function: a thread
        that ends while the interpreter shuts down would release it from a C++ thread-exit destructor after Python
        is gone (an abort at exit, "terminate called without an active exception"). A function of the thread's
        own is released with the thread's `threading.local` data, on that thread while Python still runs, and
        takes its cache entry with it."""
        fns = getattr(self._per_thread, "fn", None)
        if fns is None:
            fns = self._per_thread.fn = {}
        fn = fns.get(pre)
        if fn is None:
            run = self.run_eager if pre is None else self._after(pre)
            fn = fns[pre] = mx.compile(run) if self.compile else run
        return fn

    def _after(self, pre):
        def run(*args: mx.array) -> list[mx.array]:
            args, flags = pre(args)
            return self.run_eager(*args, first=flags)
        return run

    def __call__(self, *args: mx.array) -> tuple[list[mx.array], list[mx.array]]:
        """(outputs, the checks' flags packed into words: `pack_flags`)."""
        res = self._fn()(*args)
        n = len(self.graph.outputs)
        return res[:n], res[n:]

    def queued(self, pre, args) -> tuple[list[mx.array], list[mx.array]]:
        """The call with `pre` traced in front of the graph: `pre(args)` gives (the graph's arguments, flags [B])
        from what the caller passes, so that the arguments' own preparation (a history's range check, a bias's
        NaN check, a packed mask's unpacking) replays with the graph instead of costing the host a few MLX ops
        each. `pre` is a key of the compile cache: the same function object every call. (outputs, pre's flags
        and then the graph's, packed into words)."""
        res = self._fn(pre)(*args)
        return res[:self._n_out], res[self._n_out:]
