"""`shard(program, group)`: a program run on a vocabulary split across the ranks of an `mx.distributed` group.

Each rank passes its contiguous slice of the logits [B, V_r] with `vocab_start=` (the slice's first token id) and
`vocab_size=` (the whole vocabulary, V) and the same parameters; every rank gets the outputs the program gives on
the whole row (spec §7). The program's stages run as their dense definitions (samplec/frontend/expand.py, what
-O0 runs), op by op: an op on slices runs on the slice, and an op that reads across the vocabulary runs its
sharded kernel (samplec/distributed/kernels.py), which exchanges a few values per row instead of the logits.

A call first gathers one small header from every rank (batch size, slice, vocabulary size, a digest of the
program and of each parameter, the call's number) and raises the same error on every rank where they disagree;
then it is one lazy graph, its collectives chained in one order, evaluated under a watchdog, and a trailer of
output digests checks that every rank computed the same outputs.
"""
from __future__ import annotations

import numpy as np
import mlx.core as mx

from samplec.backend_mlx.kernels import KERNELS
from samplec.diagnostics import SamplecError
from samplec.distributed.comm import Comm, Slices, Watchdog, check_headers, check_trailers, digest, header, sealed
from samplec.distributed.kernels import DKERNELS, LOCAL
from samplec.ir.graph import INPUT, Graph, Node
from samplec.ir.ops import OPS
from samplec.ir.printer import Namer, print_graph
from samplec.passes.manager import PASSES
from samplec.program import Outputs, Program, _flagged, _layout, _logits, _mask, _prepare_param, _rows

DEFAULT_TIMEOUT = 60.0      # seconds a call waits for the other ranks


def sharded(n: Node) -> bool:
    """Whether a value's last axis is the vocabulary (held as slices)."""
    return bool(n.type.shape) and n.type.shape[-1] == "V"


def dense_graph(graph: Graph) -> Graph:
    """The graph with every stage op replaced by its dense definition."""
    return PASSES["expand-stages"].run(graph)


class ShardedProgram:
    """A program over vocabulary slices: call it like the program, with the rank's slice of the logits and
    `vocab_start=`, `vocab_size=`. `last_call` holds the last call's traffic (bytes this rank sent, gathers)."""

    def __init__(self, program: Program, group=None, timeout: float | None = DEFAULT_TIMEOUT,
                 whole_rows: bool = False, on_timeout: str = "exit"):
        if not isinstance(program, Program):
            raise SamplecError(f"shard: expected a samplec Program, got {type(program).__name__}")
        self.program = program
        self.whole_rows = whole_rows
        self.group = group if group is not None else mx.distributed.init()
        stages = getattr(program, "stage_graph", program.graph)     # (the graph before any target's lowering)
        self.graph = dense_graph(stages)
        self.order = self.graph.toposort()
        self._names = [k for k, _ in self.graph.outputs]
        self._layout = _layout(self._names)
        self._digest = digest(np.frombuffer(print_graph(stages).encode(), dtype=np.uint8))
        self._calls = 0
        self.watchdog = Watchdog(timeout, on_timeout)
        self.last_call = {"sent_bytes": 0, "gathers": 0}

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def __repr__(self) -> str:
        return f"<samplec.distributed.ShardedProgram {self.program.name} rank {self.rank} of {self.size}>"

    def __call__(self, logits, *, vocab_start: int, vocab_size: int, **params) -> Outputs:
        outs, flags = self.run(logits, vocab_start=vocab_start, vocab_size=vocab_size, **params)
        for message, flag in flags:
            bad = np.array(_flagged(flag), dtype=bool)
            if bad.any():
                raise SamplecError(f"{message} ({_rows(bad)})")
        return Outputs(dict(zip(self._names, outs)), self._layout)

    def run(self, logits, *, vocab_start: int, vocab_size: int, **params):
        """A call's evaluated outputs and check flags, [(message, flag [B])], without raising the flags."""
        x, args, late, hashed = self._prepare(logits, vocab_start, vocab_size, params)
        mx.eval(x, args, [f for _, f in late])      # (the call's own inputs: the worker evaluates only its graph)
        self._calls += 1
        call = self._calls % (2 ** 31)
        # (MLX keeps streams per thread: where a worker thread runs the call, it builds the graph too)
        return self.watchdog.run(lambda: self._evaluate(x, args, late, hashed, call, int(vocab_start),
                                                        int(vocab_size), params), "a sharded call")

    # ---- a call, step by step ----

    def _prepare(self, logits, vocab_start, vocab_size, params: dict):
        """Check the call's inputs and prepare its parameters as the program does (for the whole vocabulary; a
        mask or bias sliced to this rank's ids): (x, args, late checks [(message, local flag [B])], digests)."""
        x = _logits(logits)
        B, width = x.shape
        for name, v in (("vocab_start", vocab_start), ("vocab_size", vocab_size)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise SamplecError(f"{name}: expected an integer, got {v!r}")
        if width < 1 or not 0 <= vocab_start or vocab_start + width > vocab_size:
            raise SamplecError(f"logits: a slice of {width} ids at vocab_start = {vocab_start} does not lie in the "
                               f"vocabulary [0, {vocab_size}) (each rank holds at least one id)")
        start, vocab = int(vocab_start), int(vocab_size)
        kinds = {p.name: p.kind for p in self.program.params}
        local = {k: v for k, v in params.items() if kinds.get(k) in ("mask", "bias") and v is not None}
        stand_in = mx.broadcast_to(mx.zeros((1, 1)), (B, vocab))
        given = dict(params)
        for name in local:      # (a full-width stand-in: prepared below, on the slice)
            given[name] = mx.ones((B, vocab), dtype=mx.bool_) if kinds[name] == "mask" else stand_in
        checks: list = []
        args = self.program.prepare(stand_in, given, checks)
        stand_ins = tuple(f"{name}: " for name in local)      # (the stand-ins' own checks: dropped)
        late = [("logits: NaN or +inf", mx.any(mx.isnan(x) | mx.isposinf(x), axis=-1))] + \
            [(m, f) for m, f in checks if not m.startswith(stand_ins)]
        args[0] = x
        for i, p in enumerate(self.program.params, start=1):
            if p.name in local:
                args[i] = self._slice_param(p, local[p.name], B, start, width, vocab, late)
        hashed = [(p.name, p.kind not in ("mask", "bias") and not (p.default == "os" and p.name not in params))
                  for p in self.program.params]
        return x, args, late, hashed

    def _evaluate(self, x, args, late, hashed, call: int, start: int, vocab: int, params: dict):
        """On the worker thread: the header, then the call's graph, evaluated."""
        B, width = x.shape
        digests = [(name, digest(np.array(a)) if use else 0) for (name, use), a in zip(hashed, args[1:])]
        mine = mx.array(header(self.rank, B, width, start, vocab, self._digest, digests, call))
        rows = np.array(mx.distributed.all_gather(mine[None], group=self.group))
        starts, sizes, vocab = check_headers(rows, [n for n, _ in hashed])
        comm = Comm(self.group, Slices(self.rank, starts, sizes, vocab))
        env = {id(p.node): a for p, a in zip(self.graph.params, args)}
        self._shared_seeds(comm, env, params)
        for node in self.order:
            if id(node) not in env:
                env[id(node)] = self._run(comm, node, env)
        outs = [(comm.full(env[id(n)]) if self.whole_rows else env[id(n)]) if sharded(n) else env[id(n)]
                for _, n in self.graph.outputs]
        flags = [(m, comm.any(f)) for m, f in late] + [(c.message, env[id(c.flag)]) for c in self.graph.checks]
        mx.eval(outs, [f for _, f in flags])
        # (a trailer: every rank's digest of its outputs, which must agree -- a peer that stopped mid-call can
        # leave a ring's gathers with stale buffers rather than an error)
        same = [np.array(o) for o, (_, n) in zip(outs, self.graph.outputs) if self.whole_rows or not sharded(n)]
        done = sealed([self.rank, digest(*same, *[np.array(f) for _, f in flags])])
        check_trailers(np.array(mx.distributed.all_gather(mx.array(done)[None], group=self.group)))
        self.last_call = {"sent_bytes": comm.sent, "gathers": comm.rounds}
        return outs, flags

    @staticmethod
    def _slice_param(p, value, B: int, start: int, width: int, vocab: int, late: list) -> mx.array:
        """A mask or bias given for the whole vocabulary [B, V] (or a packed bitmask) or for the slice [B, V_r]:
        this rank's part, checked as the program checks it."""
        arr = value if isinstance(value, mx.array) else mx.array(np.asarray(value))
        if arr.ndim == 1 and B == 1:
            arr = arr[None, :]
        if arr.ndim == 2 and arr.shape[0] == B and arr.shape[1] != width:
            if p.kind == "mask":
                arr = _mask(p.name, arr, B, vocab)
            elif arr.shape[1] != vocab:
                raise SamplecError(f"{p.name}: expected shape [{B}, {vocab}] (the whole vocabulary) or "
                                   f"[{B}, {width}] (this rank's slice), got {list(arr.shape)}")
            arr = arr[:, start:start + width]
        return _prepare_param(p, arr, B, width, late)

    def _shared_seeds(self, comm: Comm, env: dict, params: dict) -> None:
        """A seed drawn from the OS (a `sample()` without one): the lowest rank's, on every rank."""
        for p in self.graph.params[1:]:
            if p.default == "os" and p.name not in params:
                env[id(p.node)] = comm.gather(env[id(p.node)])[0]

    def _run(self, comm: Comm, node: Node, env: dict) -> mx.array:
        ins = [env[id(i)] for i in node.inputs]
        attrs = node.attr_dict
        try:
            if not any(sharded(i) for i in node.inputs):
                return _kernel(node, ins, attrs)
            if node.op in DKERNELS and not (node.op == "take_along" and sharded(node)):
                return DKERNELS[node.op](comm, ins, attrs)
            known = OPS.get(node.op)
            if sharded(node) and (known is not None and known.doc == "elementwise" or node.op in LOCAL):
                return _kernel(node, ins, attrs)
            # no sharded kernel: the whole rows (exact, O(V) bytes), this rank's part of a [.., V] result
            whole = [comm.full(a) if sharded(i) else a for i, a in zip(node.inputs, ins)]
            out = _kernel(node, whole, attrs)
            s = comm.slices
            return out[..., s.start:s.start + s.size] if sharded(node) else out
        except SamplecError:
            raise
        except Exception as e:
            raise SamplecError(f"while executing %{Namer()(node)} = {node.op} ({node.type}) on a slice: {e}") from e


def _kernel(node: Node, ins: list, attrs: dict) -> mx.array:
    if node.op == INPUT:
        raise SamplecError(f"internal error: parameter %{node.name} has no value")
    return KERNELS[node.op](ins, attrs)


def shard(program: Program, group=None, timeout: float | None = DEFAULT_TIMEOUT,
          whole_rows: bool = False, on_timeout: str = "exit") -> ShardedProgram:
    """`program` over vocabulary slices held by the ranks of `group` (default: `mx.distributed.init()`).

    An output over the vocabulary (`probs`) is this rank's slice of it [B, V_r]; `whole_rows=True` gathers the
    whole rows [B, V] on every rank instead (O(V) bytes a call).

    `timeout` bounds each wait for the other ranks in seconds (None: no bound): past it, `on_timeout="exit"` ends
    the process with the error on stderr (the other ranks then see a rank that stopped), `"raise"` raises a
    `SamplecError` and leaves the group unusable (see `Watchdog`). A rank that stops, ranks whose calls disagree,
    or slices that do not tile the vocabulary give a `SamplecError` on every rank that still runs."""
    return ShardedProgram(program, group, timeout, whole_rows, on_timeout)
