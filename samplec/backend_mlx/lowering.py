"""Native instruction selection: IR patterns that `samplec-native` computes as one MLX primitive on the CPU.

On MLX's CPU backend every primitive of a compiled call costs its dispatch, and the call's arrays are rebuilt
each step, however small the work. Where the native primitives are in use (`native.enabled()` when the graph is
traced), the executable first offers each node to the rule registered for its op. A rule looks at the node, the
nodes that use it (or the nodes that produce its inputs) and the values computed so far, and returns the value of
every node it covers, computed by one primitive; the executable then skips those nodes. A rule that does not
apply returns None and the node's kernel runs as usual. The IR is untouched: `--emit ir` shows the same program,
and `SAMPLEC_NATIVE=0` runs every node through its MLX-ops kernel.

    log_softmax(x)                                   -> row_logsumexp(x), then two subtractions; its
      take_along users read (x[idx] - max) - log Z, its topk_ids users select on x
    topk_ids(log_softmax(x), k)                      -> top_logprob_ids(x, max, log Z, k): select, then rank;
      its take_along(log_softmax(x), ids) user (the values) from the same primitive
    topk_ids(x, k)                                   -> topk_select(x, k) and pairwise ranks of the k
    random_bits(expand(seed), cast<u32>(ids), cast<u32>(expand(pos)))  -> threefry_bits(seed, ids, pos)
    argmax(x), take_along(a_i, it)..., squeeze(those)                   -> argmax_take(x, [a_i...], flat)
    penalties(x, history, ...), penalties_overflow   -> penalty_edits(x, history, ...): the window's ids, their
      penalized logits and the check's flag in one primitive, shared by both ops (and by a chain that reads the
      stage: `interpreter.Chain` runs on x with the edits); a penalty after a penalty reads the first one's edits
    argmax(penalties(x, ...)), argmax(put_along(x, ids, vals))  -> argmax_put(x, ids, vals) (greedy after
      penalties), without writing the [B, V] result
    reduce_max(x) (f32 [B, V])                       -> row_max(x); of a softmax (`probs`): row_softmax(x)
    logprob_at(x, idx) outside a chain              -> row_logsumexp(x) and a gather; of penalties(logits, ...):
      edited_logsumexp(logits, edits, idx) -- both rows' normalizers from one pass, a log_softmax(logits) reads
      the logits' one

A chain of stage ops ending in a draw is covered by the interpreter itself (`interpreter.Chain`: the native
`sample_chain` kernel). Each primitive gives exactly what the nodes it covers give through their kernels (tests/test_native.py).
"""
from __future__ import annotations

from typing import Callable

import mlx.core as mx

from samplec.backend_mlx import native
from samplec.ir.graph import Node

Env = dict          # id(node) -> mx.array, the values computed so far
Users = dict        # id(node) -> the nodes using it, in graph order
Rule = Callable[[Node, Users, Env], "dict[int, mx.array] | None"]

GATHERABLE = (mx.float32, mx.int32)


def _look_through(node: Node) -> Node | None:
    """The value a 2-D RandomBits operand reads, past the broadcast and bit-preserving casts the native primitive
    does itself: expand of a 1-D value (the primitive reads [B] as [B, 1]) and casts to u32 of i32 or u32 values.
    None for a 1-D operand (it broadcasts as [1, C], not as [B, 1])."""
    expanded = False
    while True:
        if node.op == "expand" and len(node.inputs[0].type.shape) == 1:
            node, expanded = node.inputs[0], True
        elif node.op == "cast" and node.attr("dtype") == "u32" and node.inputs[0].type.dtype in ("i32", "u32"):
            node = node.inputs[0]
        else:
            return node if len(node.type.shape) == 2 or expanded else None


def _random_bits(node: Node, users: Users, env: Env):
    ops = [_look_through(i) for i in node.inputs]
    if len(node.type.shape) != 2 or None in ops:
        return None
    seed, c0, c1 = (env[id(o)] for o in ops)
    if seed.dtype != mx.uint64:
        return None
    out = native.threefry_bits(seed, c0, c1)
    return None if out is None else {id(node): out}


def _gathers(node: Node, users: Users, env: Env, like: mx.array) -> list[Node]:
    """The take_along users of `node` (as the index) whose gathered value is already computed and shaped like
    `like`, float32 or int32: the native selections gather them as they select."""
    out = []
    for u in users.get(id(node), ()):
        if u.op == "take_along" and u.inputs[1] is node and u.inputs[0] is not node:
            a = env.get(id(u.inputs[0]))
            if a is not None and a.shape == like.shape and a.dtype in GATHERABLE:
                out.append(u)
    return out


def unexpanded(node: Node) -> Node:
    """A parameter's [B] value itself rather than its expand to [B, 1]: the native primitives read [B] as a column,
    and an expand that nothing else reads is never computed (each would be a primitive of its own in a call)."""
    return node.inputs[0] if node.op == "expand" and len(node.inputs[0].type.shape) <= 1 else node


def penalty_edits(node: Node, env: Env, pre: tuple = ()):
    """(x, (ids, values), overflow [B]) of a `penalties` node or its `penalties_overflow` (the same operands): the
    logits below every penalties stage and the edits of all of them, in order (the primitive puts a prior stage's
    edits first in its own), which written in order give the node's value -- computed once per operands (the env
    keeps them), None where the native primitive does not apply. `pre` (a chain's): (the node below the allow and
    logit_bias nodes under the penalties, their (kind, array)s from it up) -- x is then that node, the edits read
    through them (the chain owns every reader of the stages' values, so nothing reads that x as theirs)."""
    key = ("pen", *(id(i) for i in node.inputs))
    if key not in env:
        x = node.inputs[0]
        ops = pre[1] if pre else ()
        if x.op == "penalties":
            inner = penalty_edits(x, env, pre)
            if inner is None:
                return None
            base, prior = inner[0], inner[1]
        else:
            base, prior = env[id(pre[0] if pre else x)], ()
        out = native.penalty_edits(base, *(env[id(unexpanded(i))] for i in node.inputs[1:]), prior=prior, pre=ops)
        if out is None:
            return None
        env[key] = (base, tuple(out[:2]), out[2])
    return env[key]


def _penalties(node: Node, users: Users, env: Env):
    """penalties(x, ...) where something reads the whole result: x with the edits written in (MLX scatters)."""
    edits = penalty_edits(node, env)
    if edits is None:
        return None
    return {id(node): mx.put_along_axis(edits[0], *edits[1], axis=-1)}


def _penalties_overflow(node: Node, users: Users, env: Env):
    edits = penalty_edits(node, env)
    return None if edits is None else {id(node): edits[2]}


def _argmax(node: Node, users: Users, env: Env):
    src = node.inputs[0]
    edited = None
    if src.op == "penalties":
        edits = penalty_edits(src, env)
        edited = edits and (edits[0], *edits[1])
    elif src.op == "put_along":
        edited = tuple(env[id(i)] for i in src.inputs)
    if edited is not None and not _gathers(node, users, env, edited[0]):
        # greedy after penalties: the argmax of the logits with the history's penalized values written in, read
        # without writing them (the [B, V] copy is lazy: made only if something else reads it)
        base, ids, vals = edited
        out = native.argmax_put(base, ids, vals) if ids.ndim == 2 and vals.ndim == 2 else None
        if out is not None:
            return {id(node): out}
    x = env[id(src)]
    if not (x.ndim == 2 and x.dtype == mx.float32 and x.shape[-1] >= 1):
        return None
    takes = _gathers(node, users, env, x)
    # gathers used only through a squeeze (a sampled token) come out flat: no Squeeze primitive after them
    flat = bool(takes) and all(users.get(id(t)) and all(u.op == "squeeze" for u in users[id(t)]) for t in takes)
    out = native.argmax_take(x, [env[id(t.inputs[0])] for t in takes], flat=flat)
    if out is None:
        return None
    bound = {id(node): out[0]}
    for t, v in zip(takes, out[1:]):
        if flat:
            bound.update((id(u), v) for u in users[id(t)])
            v = mx.expand_dims(v, -1)       # (unused: the squeezes were its only users)
        bound[id(t)] = v
    return bound


TIE_MARGIN = 8      # top_logprobs on a log-softmax: this many more of x's largest are ranked by their log-probs


def _topk_ids(node: Node, users: Users, env: Env):
    """topk_ids(x, k) (top_logprobs): on a log-softmax, one primitive that selects on its input x (the same order,
    as x - c rounds monotonically) with TIE_MARGIN more and orders those by their log-probabilities, lower id first
    (rounding can tie two logits that differ; a tie group reaching past k + TIE_MARGIN would need that many logits
    within one rounding step). Elsewhere the k largest by one selection (ties at the k-th: the lower ids), then
    those k ordered by value descending, lower id first, by pairwise ranks -- no sort of the vocabulary."""
    src, k = node.inputs[0], node.attr("k")
    lse = env.get(("lse", id(src))) if src.op == "log_softmax" else None
    x = env[id(src)] if lse is None else lse[0]
    n = x.shape[-1] if x.ndim == 2 else 0
    if not (x.ndim == 2 and x.dtype == mx.float32 and k < n and k <= 64):
        return None
    if lse is not None:
        out = native.top_logprob_ids(x, lse[1], lse[2], k, TIE_MARGIN)
        if out is None:
            return None
        # the values too: its take_along(log_softmax(x), ids) users (top_logprobs' values) need no gather
        values = {id(u): out[1] for u in users.get(id(node), ()) if u.op == "take_along" and u.inputs == (src, node)}
        return {id(node): out[0], **values}
    out = native.topk_select(x, k, [x])
    if out is None:
        return None
    pos, vals = out[0], out[2]                       # positions ascending, and x there
    vi, vj = vals[:, :, None], vals[:, None, :]
    j_lt_i = mx.arange(k)[None, :] < mx.arange(k)[:, None]
    rank = mx.sum((vj > vi) | ((vj == vi) & j_lt_i[None]), axis=-1)       # distinct ranks 0..k-1
    order = mx.argsort(rank, axis=-1)
    return {id(node): mx.take_along_axis(pos, order, axis=-1).astype(mx.int32)}


def _log_softmax(node: Node, users: Users, env: Env):
    """log_softmax(x): the row maximum and the log of the normalizer in one vectorized pass (the exp pass is most
    of a log-softmax's cost on the CPU), then two subtractions -- over the vocabulary only where something reads
    the whole result: its `take_along` users get (x[idx] - max) - log Z at their few positions (the same float
    operations), and its `topk_ids` users select on x, whose order log-softmax keeps (see `_topk_ids`)."""
    x = env[id(node.inputs[0])]
    if ("row_lse", id(node.inputs[0])) in env:            # (computed beside a penalized row's: `_logprob_at`)
        m, lz = env[("row_lse", id(node.inputs[0]))]
    else:
        lse = native.row_logsumexp(x)
        if lse is None:
            return None
        m, lz = lse[:, :1], lse[:, 1:]
    return log_softmax_parts(node, x, m, lz)


def log_softmax_parts(node: Node, x: mx.array, m: mx.array, lz: mx.array) -> dict:
    """The values of log_softmax(x) given x's row maximum and log-sum-exp ([B, 1] each): the full result is lazy
    (computed only if something else reads it); the parts go beside it in the env for its take_along and
    topk_ids users."""
    return {id(node): (x - m) - lz, ("lse", id(node)): (x, m, lz)}


def _take_along(node: Node, users: Users, env: Env):
    """take_along(log_softmax(x), idx) -> (x[idx] - max) - log Z: a gather, not a pass over the vocabulary."""
    src = node.inputs[0]
    if src.op != "log_softmax" or ("lse", id(src)) not in env:
        return None
    done = env.get(logprob_at_key(src.inputs[0], node.inputs[1]))
    if done is not None and tuple(done.shape) == tuple(env[id(node.inputs[1])].shape):
        return {id(node): done}                         # (computed beside a penalized row's: `_logprob_at`)
    x, m, lz = env[("lse", id(src))]
    idx = env[id(node.inputs[1])]
    if idx.ndim != 2 or idx.shape[0] not in (1, x.shape[0]):
        return None
    idx = mx.clip(idx, 0, x.shape[-1] - 1)          # (see kernels._in_range)
    return {id(node): (mx.take_along_axis(x, idx, axis=-1) - m) - lz}


def _only_user(node: Node, users: Users, op: str, *inputs) -> Node | None:
    """The one user of `node`, when it is `op` reading exactly `inputs`."""
    us = users.get(id(node), ())
    return us[0] if len(us) == 1 and us[0].op == op and us[0].inputs == inputs else None


def softmax_pattern(node: Node, users: Users) -> tuple[Node, Node, Node, Node] | None:
    """(sub, exp, reduce_sum, div) when `node` is the reduce_max of softmax(x) = exp(x - max) / sum (a `probs`
    output) and nothing else reads those values."""
    if node.op != "reduce_max":
        return None
    x = node.inputs[0]
    sub = _only_user(node, users, "sub", x, node)
    exp = sub and _only_user(sub, users, "exp", sub)
    if exp is None or len(users.get(id(exp), ())) != 2:
        return None
    total = next((u for u in users[id(exp)] if u.op == "reduce_sum"), None)
    div = total and _only_user(total, users, "div", exp, total)
    return (sub, exp, total, div) if div is not None and div in users[id(exp)] else None


def _reduce_max(node: Node, users: Users, env: Env):
    """reduce_max of a float32 [B, V]: one vectorized pass (MLX's CPU max reduction is scalar); and where it is
    the maximum of softmax(x) (a `probs` output) the whole softmax as one primitive, its exps vectorized (MLX's CPU
    exp is scalar: a pass over the vocabulary costs ~2 ms at V = 152064). The softmax pattern's inner values are
    bound lazily: nothing else reads them, so MLX never computes them."""
    xa = env[id(node.inputs[0])]
    if not (xa.ndim == 2 and xa.dtype == mx.float32):
        return None
    pattern = softmax_pattern(node, users)
    probs = native.row_softmax(xa) if pattern else None
    if probs is None:
        m = native.row_max(xa)
        return None if m is None else {id(node): m}
    sub, exp, total, div = pattern
    m = mx.max(xa, axis=-1, keepdims=True)
    e = mx.exp(xa - m)
    return {id(node): m, id(sub): xa - m, id(exp): e, id(total): mx.sum(e, axis=-1, keepdims=True),
            id(div): probs}


def logprob_at_key(logits: Node, idx: Node) -> tuple:
    """The env key of a log-probability under log_softmax(logits) at a token computed beside other work (the chain
    kernel's, `edited_logsumexp`'s), for the take_along that reads it: the token's node past the expand / squeeze
    that read it back as [B, 1] or [B]."""
    while idx.op in ("expand", "squeeze") and idx.inputs[0].type.dtype == "i32":
        idx = idx.inputs[0]
    return ("logprob_at", id(logits), id(idx))


def _below_penalties(node: Node) -> Node:
    while node.op == "penalties":
        node = node.inputs[0]
    return node


def _logprob_at(node: Node, users: Users, env: Env):
    """logprob_at(x, idx) (a logprob outside a chain: greedy written as argmax): (x[idx] - max) - log Z from one
    vectorized pass, not the log-softmax of the whole row. Where x is a penalties stage, from its edits: the
    penalized row's normalizer and the logits' own (which a raw_logprob's log_softmax then reads) from one pass
    over the logits (`edited_logsumexp`), the penalized row never written."""
    x, idx = env[id(node.inputs[0])], env[id(node.inputs[1])]
    if not (idx.ndim == 2 and idx.shape[0] in (1, x.shape[0])):
        return None
    src = node.inputs[0]
    pen = penalty_edits(src, env) if src.op == "penalties" else None
    if pen is not None:
        out = native.edited_logsumexp(pen[0], *pen[1], idx)
        if out is not None:
            env[("row_lse", id(_below_penalties(src)))] = out[2:]
            env[logprob_at_key(_below_penalties(src), node.inputs[1])] = out[1]
            return {id(node): out[0]}
    lse = native.row_logsumexp(x)
    if lse is None:
        return None
    idx = mx.clip(idx, 0, x.shape[-1] - 1)          # (see kernels._in_range)
    return {id(node): (mx.take_along_axis(x, idx, axis=-1) - lse[:, :1]) - lse[:, 1:]}


RULES: dict[str, Rule] = {
    "penalties": _penalties,
    "penalties_overflow": _penalties_overflow,
    "logprob_at": _logprob_at,
    "reduce_max": _reduce_max,
    "log_softmax": _log_softmax,
    "take_along": _take_along,
    "topk_ids": _topk_ids,
    "random_bits": _random_bits,
    "argmax": _argmax,
}

# the rules made of MLX ops alone, which a GPU target's interpreter takes too: a log-probability at some ids read off
# the log-softmax's parts where the chain kernel gave them (Chain.run_gpu), a gather instead of the full row
def _gpu_topk_ids(node: Node, users: Users, env: Env):
    """topk_ids(log_softmax(x), k) on a GPU (top_logprobs): one block a row selects on x with TIE_MARGIN more and
    ranks those by their log-probabilities (gpu.top_logprobs: the CPU's `_topk_ids` on a GPU), from the maximum and
    log-sum-exp the chain kernel (or `_gpu_log_softmax`) gave; topk_ids(x, k) of any other float row (candidates)
    by the same kernel with a maximum and log-sum-exp of 0, so that it ranks x itself -- and its values for the
    take_along users that read them."""
    from samplec.backend_mlx import gpu, kernels
    src = node.inputs[0]
    if src.op == "log_softmax":
        lse = env.get(("lse", id(src)))
    else:
        x = env[id(src)]
        B = x.shape[0] if x.ndim == 2 else 0
        zeros = kernels.constant(("zeros", B), lambda: mx.zeros((B,), dtype=mx.float32))
        lse = (x, zeros, zeros) if B and x.dtype == mx.float32 else None
    if lse is None:
        return None
    out = gpu.top_logprobs(*lse, node.attr("k"), TIE_MARGIN)
    if out is None:
        return None
    values = {id(u): out[1] for u in users.get(id(node), ()) if u.op == "take_along" and u.inputs == (src, node)}
    return {id(node): out[0], **values}


def _gpu_dry(node: Node, users: Users, env: Env):
    """dry(x, history, ...) on a GPU: one block a row writes the penalized row (gpu.dry), where the definition runs
    ~30 MLX ops."""
    from samplec.backend_mlx import gpu
    x, h, mult, base, allowed, last_n, breakers = (env[id(i)] for i in node.inputs)
    out = gpu.dry(x, h, mult, base, allowed, last_n, breakers if breakers.ndim else None)
    return None if out is None else {id(node): out}


def _gpu_log_softmax(node: Node, users: Users, env: Env):
    """log_softmax(x) outside a GPU chain kernel (a chain reads an edited row: DRY before it): its maximum and
    log-sum-exp as the definition computes them, two reductions, the parts beside it for its topk_ids (the selection
    kernel) and take_along users, the full row lazy."""
    x = env[id(node.inputs[0])]
    if x.ndim != 2 or x.dtype != mx.float32:
        return None
    m = mx.max(x, axis=-1, keepdims=True)
    return log_softmax_parts(node, x, m, mx.log(mx.sum(mx.exp(x - m), axis=-1, keepdims=True)))


MLX_RULES = {"take_along": _take_along, "topk_ids": _gpu_topk_ids, "dry": _gpu_dry, "log_softmax": _gpu_log_softmax}

__all__ = ["MLX_RULES", "RULES"]
