"""A compiled sampler program: its graph, its run-time interface (spec §5) and its MLX executable.

Calling a program checks and normalizes the inputs (numpy or MLX; scalars or one value per row), runs the
compiled graph once, evaluates outputs and check flags together (the one host synchronization of a call) and
raises a `SamplecError` naming the parameter or stage and the rows when something is wrong.

Queueing a call is host time that a B = 1 call pays in full, so a call whose inputs look like an earlier call's
takes a short path (`Program._arguments`): the scalar parameters as a whole are keyed by their values' bytes and
reuse the arrays of the call before (or rebuild the ones that changed), the MLX arrays of the other parameters
are checked by their shape and dtype against those an earlier call of the same logits shape accepted, and their
own preparation (a history's range check, a bias's NaN check, a packed mask's bits) is traced in front of the
graph (`_PreStage`), so that it replays with it. Any other call -- the first of a shape, numpy inputs, a bad
value -- takes the full path, which raises the errors.
"""
from __future__ import annotations

import marshal
import math
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from samplec.backend_mlx.interpreter import FLAG_BITS, unpack_flags
from samplec.backend_mlx.native import evaluate, history_check, release, row_max, wake
from samplec.diagnostics import SamplecError
from samplec.frontend.lower import OS_SEED, history_message
from samplec.ir.graph import Graph, Param
from samplec.ir.printer import print_graph
from samplec.passes.checks import IMPLIES
from samplec.passes.portable import UNCOVERED
from samplec.passes.specialize import switches
from samplec.stages import Range

SCALAR_NP = {"float": np.float32, "int": np.int32, "seed": np.uint64, "state": np.float32}


@dataclass(frozen=True)
class IdsValues:
    ids: mx.array
    values: mx.array

    def __iter__(self):
        return iter((self.ids, self.values))


def _layout(names) -> tuple:
    """(attribute, key) per output attribute: key is an output name, or (ids, values) names for a pair."""
    attrs = dict.fromkeys(k.split(".")[0] for k in names)
    return tuple((a, (a + ".ids", a + ".values") if a in ("top_logprobs", "candidates") else a) for a in attrs)


class NoOutput(SamplecError, AttributeError):
    """An output the program does not have, asked of a call's Outputs: a SamplecError, as every user-facing
    failure, and an AttributeError, as Python's `hasattr` and `getattr(out, name, default)` expect."""


class Outputs:
    """The outputs of one call, as attributes named like the sampler's outputs (MLX arrays)."""

    def __init__(self, values: dict[str, mx.array], layout: tuple | None = None):
        attrs = self.__dict__
        attrs["_values"] = values
        for attr, key in layout or _layout(values):
            attrs[attr] = values[key] if type(key) is str else IdsValues(values[key[0]], values[key[1]])

    def __getattr__(self, name):
        raise NoOutput(f"this program has no output '{name}' (it has: {', '.join(self.names())})")

    def names(self) -> list[str]:
        return list(dict.fromkeys(k.split(".")[0] for k in self._values))

    def to_dict(self) -> dict[str, mx.array]:
        return dict(self._values)

    def __repr__(self) -> str:
        """One line per output: name, dtype and shape, and the values when there are few (<= 16 per array)."""
        lines = []
        for name in self.names():
            v = self.__dict__[name]
            text = f"ids {_describe(v.ids)}; values {_describe(v.values)}" if isinstance(v, IdsValues) \
                else _describe(v)
            lines.append(f"  {name:<13} {text}")
        return "Outputs(\n" + "\n".join(lines) + "\n)"


def _describe(a: mx.array) -> str:
    text = f"{str(a.dtype).rsplit('.', 1)[-1]}[{', '.join(map(str, a.shape))}]"
    if a.size <= 16:
        text += " " + _fmt(np.array(a).tolist())
    return text


def _fmt(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return f"{v:.5g}" if isinstance(v, float) else str(v)


def _rows(mask: np.ndarray, ids: np.ndarray | None = None, limit: int = 16) -> str:
    """`rows 0, 2, 3` -- past `limit` rows, the first ones and the count: `rows 0, 1, ..., 15, ... (40 rows)`."""
    rows = np.nonzero(mask)[0]
    rows = (rows if ids is None else ids[rows]).tolist()
    text = ", ".join(map(str, rows[:limit])) + (f", ... ({len(rows)} rows)" if len(rows) > limit else "")
    return f"row{'s' if len(rows) > 1 else ''} {text}"


class Program:
    """A compiled sampler: its graph and the MLX executable that runs it. A call is queued as one graph and read
    once: every per-row decision (which algorithm a row's chain needs, a row's error flags) is made inside it."""

    def __init__(self, graph: Graph, compile: bool = True, target: str | None = None, after_pass=None,
                 every_check: bool = False):
        """`graph`: the stage-level graph the pipelines give (what `.smpb` holds); the target pass lowers it for
        `target` (samplec.passes.target: None or "auto" is the device MLX runs on). The portable target tests a
        check that a later check implies through that one (samplec.passes.checks), and a call one of those flags
        runs again with every check (`every_check=True`) to raise the one that fired."""
        from samplec.backend_mlx.interpreter import Executable
        from samplec.passes import run_target
        from samplec.passes.target import resolve
        self.target = resolve(target)
        # (a program for another device compiles, prints and saves here; calling it is the error -- also after the
        # default device changed: each call compares it with the one this was last checked on)
        self._device = mx.default_device()
        self._cannot_run = self._device_error()
        self.stage_graph = graph
        self.graph = run_target(graph, self.target, after_pass, every_check)
        self.exe = Executable(self.graph, compile=compile, target=self.target)
        self._compile = compile
        self._every_check = every_check
        self._checked: Program | None = None        # (this program with every check: `_with_every_check`)
        self._max_bias_id = max((max(n.attr("ids"), default=-1) for n in self.graph.toposort() if n.op == "sparse_add"),
                                default=-1)
        self._known = {p.name for p in self.params}
        # `sample()` without a seed draws one from the OS each call; `seed=` sets it (as the CLI's --seed does)
        self._seed_alias = OS_SEED in self._known and "seed" not in self._known
        self._names = [k for k, _ in graph.outputs]
        self._layout = _layout(self._names)
        self._ranges = {p.name: Range.parse(p.range) for p in self.params if p.range and p.kind != "seed"}
        # (name, value, B) or (name, seed bytes) -> a prepared MLX array; at most 256, the oldest dropped first
        self._scalars: OrderedDict = OrderedDict()
        self._scalars_only = all(p.kind in SCALAR_NP for p in self.params)
        # outputs with a count (top_logprobs(n), candidates(k)): checked against V before a call allocates
        self._counts = sorted({(key.split(".")[0], n.type.shape[-1]) for key, n in graph.outputs
                               if len(n.type.shape) == 2 and isinstance(n.type.shape[-1], int)},
                              key=lambda c: -c[1])
        # the short path of `queue` (see the module's docstring): the executable's arguments in the order
        # (logits, scalar parameters, other parameters); `_PreStage` puts them back in declaration order
        scalars = [(i, p) for i, p in enumerate(self.params, 1) if p.kind in SCALAR_NP]
        arrays = [(i, p) for i, p in enumerate(self.params, 1) if p.kind not in SCALAR_NP]
        self._scalar_params = tuple(p for _, p in scalars)
        self._scalar_names = tuple(p.name for _, p in scalars)
        self._array_params = tuple(p for _, p in arrays)
        self._array_names = tuple(p.name for _, p in arrays)
        # the scalar parameters (their places among them) the short path hands in as [B, 1]
        wide = self.exe.wide_params()
        self._wide = frozenset(k for k, p in enumerate(self._scalar_params) if p.name in wide)
        self._check_messages = tuple(c.message for c in self.graph.checks)
        # histories whose range check the graph holds (the portable lowering's, from the penalties' scatter): an
        # int32 MLX history is handed to it as it is
        self._ids_in_graph = frozenset(p.name for p in self.params if p.kind == "tokens" and
                                       history_message(p.name) in self._check_messages)
        self._pre = _PreStage(tuple(i for i, _ in scalars), tuple(arrays), len(self.params),
                              self._ids_in_graph) if arrays else None
        self._words: dict[tuple, tuple] = {}        # (see `_word_messages`)
        self._shapes: dict = {}     # (B, V) -> _Shape: what the full path accepted for that logits shape
        # the stages a call's values can turn off (samplec.passes.specialize): the short path runs the program
        # without those off in every row -- (executable, its checks' messages) per set of them, made at first use
        self._switches = switches(graph, frozenset(self._scalar_names))
        self._scalar_at = {name: k for k, name in enumerate(self._scalar_names)}
        self._switch_at = tuple(tuple(self._scalar_at[name] for name in sw.params) for sw in self._switches)
        self._switched = frozenset(k for at in self._switch_at for k in at)    # (the values a switch reads)
        self._whole = (self.exe, self._check_messages)
        self._variants: dict[frozenset, tuple] = {}
        self._off: dict[tuple, bool] = {}       # (switch, its values' bytes, V) -> off in every row
        # (shape, bytes of the values, arrays, bytes of each value, the program they run): the last short call's
        # the short path's record of the last call at each logits shape (`_rebuild`); the states, whose values are
        # a decode loop's lazy outputs, are compared one by one, never by the key
        self._lasts: dict[tuple, _Last] = {}
        self._lazy = frozenset(k for k, p in enumerate(self._scalar_params) if p.kind == "state")
        # each `int` parameter's valid Python ints, [lo, hi] (the int32 range within its own): a moving position's
        # new array is built from its value without the general checks (`_moved_int`)
        self._int_bounds = tuple(_int_bounds(self._ranges.get(p.name)) if p.kind == "int" else None
                                 for p in self._scalar_params)
        self.queue_stats = {"short": 0, "full": 0, "scalars_rebuilt": 0, "specialized": 0}
        # calls run again with their rows sorted: the portable target's candidates on the CPU did not hold a row's
        # kept tokens (samplec/passes/portable.py)
        self.sorted_again = 0

    def _device_error(self) -> str | None:
        from samplec.passes.target import unavailable
        why = unavailable(self.target)
        return None if why is None else f"target {self.target!r} cannot run here: {why} (compile or load with " \
            "target='auto', or 'portable' for any device)"

    # ---- introspection and persistence ----
    @property
    def name(self) -> str:
        return self.graph.name

    @property
    def params(self) -> tuple[Param, ...]:
        return self.graph.params[1:]

    @property
    def output_names(self) -> list[str]:
        """The sampler's outputs, as a call's `Outputs` names them ("token", "logprob", "top_logprobs", ...)."""
        return list(dict.fromkeys(k.split(".")[0] for k in self._names))

    def ir(self) -> str:
        """The IR that runs: the target pass's (regions of the chain kernels, or the portable lowering)."""
        return print_graph(self.graph)

    def kernel_trace(self) -> list[tuple[str, str]]:
        """How the last traced call ran: (region kernel, "kernel" | "definitions") for each region, and
        ("definition", op) for each stage op run by its dense definition (interpreter.Executable)."""
        return list(self.exe.trace)

    def to_bytes(self) -> bytes:
        from samplec.serialize import to_bytes
        return to_bytes(self.stage_graph, self.target)

    def save(self, path) -> None:
        from samplec.serialize import save
        save(self.stage_graph, path, target=self.target)

    def __repr__(self) -> str:
        ps = ", ".join(p.name for p in self.params)
        return f"<samplec.Program {self.name}({ps}) -> {', '.join(k for k, _ in self.graph.outputs)}>"

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_shapes={}, _lasts={}, queue_stats=dict.fromkeys(self.queue_stats, 0), sorted_again=0, _device=None,
                     _variants={}, _off={}, _checked=None)
        return state

    # ---- running ----
    def __call__(self, logits, **params) -> Outputs:
        if not params and _called_by_mlx_lm():
            raise SamplecError(_MLX_LM_MISUSE.format(name=self.name))
        return self._evaluated(logits, params, None)

    def run(self, logits, names, /, **params) -> Outputs:
        """A call that evaluates the outputs `names` (the sampler's output names: "token", "top_logprobs", ...) and
        the call's checks, and leaves the others lazy -- computed only if read: a server that wants a step's
        logprobs only for some steps keeps one program and skips their work (a sort, on a GPU) on the others."""
        want = set(names)
        unknown = want - set(self.output_names)
        if unknown:
            raise SamplecError(f"this program has no output {', '.join(sorted(map(repr, unknown)))} (it has: "
                               f"{', '.join(self.output_names)})")
        return self._evaluated(logits, params, want)

    def _evaluated(self, logits, params: dict, want: set | None) -> Outputs:
        """A call: the outputs in `want` (None: all) and the checks evaluated, the flagged rows raised."""
        outs, checks = self.queue(logits, **params)
        evaluate((outs if want is None else [o for k, o in zip(self._names, outs) if k.split(".")[0] in want]) +
                 [f for _, f in checks])
        if not any(any(_flagged(flag)) for _, flag in checks):     # (the common case: read as Python values)
            return Outputs(dict(zip(self._names, outs)), self._layout)
        named = named_flags(checks)
        unheld = [fired for message, fired in named if message == UNCOVERED]
        if not self._every_check and unheld and np.logical_or.reduce(unheld).any():
            # (rows whose kept tokens the CPU's candidates may not hold: those rows again, sorted -- the whole call
            # where another check fired too, whose error the program with every check raises)
            self.sorted_again += 1
            rows = np.flatnonzero(np.logical_or.reduce(unheld))
            again = self._with_every_check()
            cut = None if any(fired.any() for message, fired in named if message != UNCOVERED) else \
                _rows_of(logits, params, rows)
            if cut is None:
                return again._evaluated(logits, params, want)
            part = again._evaluated(*cut, want).to_dict()
            B = outs[0].shape[0]
            order = np.arange(B)
            order[rows] = B + np.arange(len(rows))
            order = mx.array(order.astype(np.int32))
            return Outputs({k: mx.take(mx.concatenate([v, part[k]]), order, axis=0)
                            for k, v in zip(self._names, outs)}, self._layout)
        try:
            self.raise_flagged(checks)
        except SamplecError:
            if not self._every_check and any(IMPLIES in m for message, _ in checks
                                             for m in ((message,) if type(message) is str else message)):
                # (a check that stands for others it implies fired: the call again with every check names the
                # first that fired, and its rows, as a program without samplec.passes.checks would)
                self._with_every_check()._evaluated(logits, params, want)
            raise
        return Outputs(dict(zip(self._names, outs)), self._layout)

    def _with_every_check(self) -> "Program":
        if self._checked is None:
            self._checked = Program(self.stage_graph, compile=self._compile, target=self.target, every_check=True)
        return self._checked

    # A call's input checks that need the values of MLX arrays (a history id >= V, a NaN bias) do not read them back
    # while the call is prepared: each is a lazy [B] flag with its message, evaluated with the outputs, and the
    # offending entries are neutralized in the graph meanwhile (an id >= V reads as padding), so that a bad value
    # can make no kernel index out of range before the error is raised.

    def queue(self, logits, **params) -> tuple[list[mx.array], list[tuple[str, mx.array]]]:
        """Check the inputs and build the call's graph without evaluating it: (outputs, checks), lazy MLX arrays,
        each check a (message, flag [B]) pair -- the call's input checks -- then the graph's, packed (a tuple of
        messages and one uint32 word [B]: `interpreter.pack_flags`). `mx.async_eval` on
        them returns before anything ran; `raise_flagged(checks)` after evaluation reports the rows that failed
        a check. A call takes the short path (`_arguments`) or the full one (`prepare`); `queue_stats` counts
        the calls of each, and the short calls whose scalar arrays were rebuilt."""
        if self._cannot_run is not None or self._device is None or mx.default_device() != self._device:
            self._device = mx.default_device()
            self._cannot_run = self._device_error()
            if self._cannot_run is not None:
                raise SamplecError(self._cannot_run)
        if self._seed_alias and "seed" in params:
            params[OS_SEED] = params.pop("seed")
        short = self._arguments(logits, params)
        if short is not None:   # (no hold: measured, it costs such a call more host time than it saves it)
            self.queue_stats["short"] += 1
            args, messages, (exe, checks) = short
            if exe is not self.exe:
                self.queue_stats["specialized"] += 1
            outs, words = exe.queued(self._pre, args)
            return outs, list(zip(self._word_messages(messages, checks, logits.shape[1]), words))
        if self._scalars_only and not any(type(v) is mx.array for v in params.values()):
            wake()      # (preparing such a call never waits for MLX: the worker can wake meanwhile)
        late: list = []
        try:
            args = self.prepare(logits, params, late)
            self._accepted(args[0].shape, params)
        except BaseException:
            release()   # (the worker need not poll for a call that does not come)
            raise
        self.queue_stats["full"] += 1
        outs, flags = self.exe(*args)
        return outs, late + list(zip(self._word_messages((), self._check_messages, args[0].shape[1]), flags))

    def _word_messages(self, first: tuple, checks: tuple, V: int) -> tuple[tuple[str, ...], ...]:
        """The messages of a call's packed check words, FLAG_BITS to a word, bit by bit: `first` (the short path's
        argument checks, traced with the graph) and then the graph's `checks` (a history's range check with the
        call's V)."""
        got = self._words.get((first, checks, V))
        if got is None:
            every = first + tuple(check_message(m, V) for m in checks)
            if len(self._words) > 64:
                self._words.clear()
            got = self._words[first, checks, V] = tuple(every[i:i + FLAG_BITS]
                                                        for i in range(0, len(every), FLAG_BITS))
        return got

    def specialized(self, off: frozenset) -> "Program":
        """This program without the stages at the places `off` of its stage graph's order (`Switch.at`): what a
        call whose values leave those stages off in every row runs."""
        from samplec.passes import run_pipeline
        from samplec.passes.specialize import without
        return Program(run_pipeline(without(self.stage_graph, off), 2), compile=self._compile, target=self.target,
                       every_check=self._every_check)

    def _program_for(self, values: list, keys: list, V: int) -> tuple:
        """(executable, its checks' messages) for a short call's scalar values (their bytes `keys`, None where a
        value is not plain): the program without the switches its values leave off in every row."""
        off = []
        for k, (sw, at) in enumerate(zip(self._switches, self._switch_at)):
            key = (k, tuple(keys[i] for i in at), V)
            got = self._off.get(key) if None not in key[1] else None
            if got is None:
                got = sw.off({name: self._scalar_params[i].default if values[i] is None else values[i]
                              for name, i in zip(sw.params, at)}, V)
                if None not in key[1]:
                    if len(self._off) > 4096:
                        self._off.clear()
                    self._off[key] = got
            if got:
                off.append(sw.at)
        if not off:
            return self._whole
        off = frozenset(off)
        got = self._variants.get(off)
        if got is None:
            if len(self._variants) >= 64:      # (the least recently used goes: a compile costs ~0.3 s)
                del self._variants[next(iter(self._variants))]
            prog = self.specialized(off)
            got = self._variants[off] = (prog.exe, prog._check_messages)
        else:
            self._variants[off] = self._variants.pop(off)
        return got

    def _arguments(self, logits, params: dict) -> tuple[list, tuple] | None:
        """The short path's arguments (logits, scalar parameters, other parameters) and the messages of the
        pre-stage's flags (`_Shape.messages`), or None where the call takes the full path: anything but float32
        logits [B, V] of a shape an earlier call had, plain numbers (or lists of them) for the scalar parameters,
        and MLX arrays of a shape and dtype accepted before for the others -- or any value the full path must look
        at. Raises nothing."""
        x = logits
        if type(x) is not mx.array:
            return None
        shape = x.shape
        known = self._shapes.get(shape)     # (only shapes [B, V] the full path accepted)
        if known is None or x.dtype != _F32 or not params.keys() <= self._known:
            return None
        values = list(map(params.get, self._scalar_names))
        last = self._lasts.get(shape)
        moved = last.moved if last is not None else self._lazy
        try:        # (see `_rebuild`; the values that moved the last call are compared one by one: `_move`)
            key = marshal.dumps(_masked(values, moved) if moved else values, 2)
        except ValueError:                      # (objects marshal cannot write)
            return None
        if last is None or last.key != key:
            scalars = self._rebuild(shape, values, last)
        elif moved:
            scalars = self._move(shape, values, last)
        else:
            scalars = last.arrays
        if scalars is None:
            return None
        args = [x, *scalars]
        for v, ok in zip(map(params.get, self._array_names), known.accepted):
            if type(v) is not mx.array or (v.shape, v.dtype) not in ok:
                return None
            args.append(v)
        return args, known.messages, self._lasts[shape].run

    def _rebuild(self, shape: tuple, values: list, last: "_Last | None") -> list | None:
        """The scalar parameters' arrays where the call's values are not the last call's of the same logits shape:
        the last call's array where a value's bytes are the same, else built (None where a value needs the full
        path: missing, or not valid). A seed drawn from the OS is drawn anew.

        The values are compared by their bytes in marshal's format 2 (no back-references: equal values, equal
        bytes), which say each value's type too (True is not 1, 1.0 is not 1) -- for plain values: Python numbers,
        lists of them and None. Marshal writes any object with a buffer (a numpy array or scalar, bytes) as bytes,
        so such a value's bytes are never kept: the value is built again each call (`_scalar` keeps a numpy
        seed array by its bytes). Bytes kept only from plain values cannot equal those of any other value. An MLX
        array is never marshalled (marshal would evaluate it: a state that is the last step's lazy output would
        make the host wait for that step): it is built again each call.

        The values that changed (the seeds drawn from the OS and the states among them) are the record's `moved`:
        the next call's key leaves them out and `_move` compares them one by one -- a decode loop's position, new
        every call, costs that value's array and not a comparison of every value."""
        self.queue_stats["scalars_rebuilt"] += 1
        try:
            keys = list(map(_bytes, values))
        except ValueError:
            return None
        if last is not None:
            arrays = list(last.arrays)
            todo = tuple(k for k, (now, then) in enumerate(zip(keys, last.keys)) if now is None or now != then)
            # (only values no switch reads changed -- a decode loop's position: the last call's program runs)
            run = last.run if self._switched.isdisjoint(todo) else None
            moved = frozenset(todo) | self._lazy
        else:
            arrays, todo, run, moved = [None] * len(keys), tuple(range(len(keys))), None, self._lazy
        for k in todo:      # (a value that moved the last call too -- a decode loop's position -- is not cached)
            if not self._build(k, values[k], shape[0], arrays, keys, last is None or k not in last.moved):
                return None
        if run is None:
            run = self._program_for(values, keys, shape[1]) if self._switches else self._whole
        self._remember(shape, _Last(None, arrays, keys, run, moved), values)
        return arrays

    def _move(self, shape: tuple, values: list, last: "_Last") -> list | None:
        """`_rebuild` where the values other than the last call's `moved` are the last call's: the moved ones are
        compared one by one and built again where they changed (not cached: they move on)."""
        arrays, keys = list(last.arrays), list(last.keys)
        todo = []
        for k in last.moved:
            value = values[k]
            try:
                now = _bytes(value)
            except ValueError:
                return None
            if now is None or keys[k] is None or now != keys[k]:
                todo.append(k)
                arr = self._moved_int(k, value, shape[0]) if self._int_bounds[k] is not None else None
                if arr is not None:
                    arrays[k], keys[k] = arr, now
                elif not self._build(k, value, shape[0], arrays, keys, False, now):
                    return None
        if todo:
            self.queue_stats["scalars_rebuilt"] += 1
        run = last.run if self._switched.isdisjoint(todo) else \
            self._program_for(values, keys, shape[1]) if self._switches else self._whole
        # (the lazy values are among the last call's `moved` and always move: all of them moved again, the same set)
        moved = last.moved if len(todo) == len(last.moved) else frozenset(todo) | self._lazy
        if moved == last.moved:       # (they all moved again: the key stays)
            self._lasts[shape] = _Last(last.key, arrays, keys, run, moved)
        else:
            self._remember(shape, _Last(None, arrays, keys, run, moved), values)
        return arrays

    def _moved_int(self, k: int, value, B: int) -> mx.array | None:
        """Integer parameter k's array for a value that moved (a decode loop's position): a Python int or a list of
        B of them within the parameter's bounds, as `_scalar` builds it (not cached); None for anything else
        (`_build` then takes it, and the full path any error)."""
        lo, hi = self._int_bounds[k]
        wide = k in self._wide
        if type(value) is list and len(value) == B:
            if B == 1:
                v = value[0]
                if type(v) is not int or not lo <= v <= hi:
                    return None
                return mx.array([[v]] if wide else value, dtype=mx.int32)
            if not all(type(v) is int for v in value) or not (lo <= min(value) and max(value) <= hi):
                return None
            return mx.array([[v] for v in value] if wide else value, dtype=mx.int32)
        if type(value) is int and lo <= value <= hi:
            return mx.array([[value]] * B if wide else [value] * B, dtype=mx.int32)
        return None

    def _build(self, k: int, value, B: int, arrays: list, keys: list, keep: bool, now: bytes | None = None) -> bool:
        """Scalar parameter k's array for `value` into arrays[k], its bytes (`now` where known) into keys[k] (None
        where the value is not plain or is drawn from the OS); False where the value needs the full path (missing,
        or not valid)."""
        p = self._scalar_params[k]
        keys[k] = (now or marshal.dumps(value, 2)) if _plain(value) else None
        if value is None:
            if p.default is None:
                return False
            value = _os_seeds(B) if p.default == "os" else p.default
            if p.default == "os":
                keys[k], keep = None, False     # (drawn anew every call)
        elif keys[k] is None:
            keep = type(value) is not mx.array     # (a numpy seed array: `_scalar` keeps it by its bytes)
        try:
            arrays[k] = self._scalar(p, value, B, k in self._wide, keep)
        except Exception:  # noqa: BLE001 - the full path raises it, in the parameters' order
            return False
        return True

    def _remember(self, shape: tuple, record: "_Last", values: list) -> None:
        """The short path's record of a logits shape after a call, with the key of its values (`moved` left out;
        None where a value that the key compares is not plain): at most 16 shapes (a speculative loop alternates
        two, its draft's and its verification's)."""
        moved = record.moved
        if all(b is not None for k, b in enumerate(record.keys) if k not in moved):
            record.key = marshal.dumps(_masked(values, moved) if moved else values, 2)
        if len(self._lasts) >= 16 and shape not in self._lasts:
            self._lasts.clear()
        self._lasts[shape] = record

    def _accepted(self, shape: tuple, params: dict) -> None:
        """After the full path accepted a call: its logits shape and the shapes and dtypes of its MLX arrays are
        good for the short path (a history only with at least one column: its range check is a flag)."""
        known = self._shapes.get(shape)
        if known is None:
            if len(self._shapes) > 64:
                self._shapes.clear()
            known = self._shapes[shape] = _Shape(self._array_params, shape[1], self._ids_in_graph)
        for p, ok in zip(self._array_params, known.accepted):
            v = params.get(p.name)
            if type(v) is mx.array and (p.kind != "tokens" or v.size and
                                        (p.name not in self._ids_in_graph or v.dtype == mx.int32)):
                if len(ok) > 64:
                    ok.clear()
                ok.add((v.shape, v.dtype))

    def fired(self, checks: list[tuple[str | tuple[str, ...], mx.array]], rows: int | None = None) \
            -> list[tuple[str, np.ndarray]]:
        """The checks of a call (`queue`'s, evaluated) that fired among its first `rows` rows: (message, bool
        [rows]) in the order they are raised (`_argument_first`; a message may come more than once: several
        stages of one kind, such as a run of penalties stages, are one check to the caller). [] where none did."""
        if not any(any(_flagged(flag)) for _, flag in checks):    # (the common case: read as Python values)
            return []
        named = [(m, f.reshape(-1)[:rows]) for m, f in named_flags(checks)]
        return sorted([(m, f) for m, f in named if f.any()], key=lambda mf: self._argument_first(mf[0]))

    def raise_flagged(self, checks: list[tuple[str | tuple[str, ...], mx.array]]) -> None:
        """Raise the first check that fired (after evaluation), naming its rows -- every row that a check of the
        same message flagged."""
        fired = self.fired(checks)
        if fired:
            first = fired[0][0]
            rows = np.logical_or.reduce([f for m, f in fired if m == first])
            raise SamplecError(f"{first} ({_rows(rows)})")

    def _argument_first(self, message: str) -> int:
        """The order in which a call's checks are raised: the arguments' (a history's range, a bias's values) in
        the parameters' order -- wherever they are tested, the call's preparation or the graph -- then the graph's
        in its order (min() keeps the first of equals)."""
        for i, p in enumerate(self._array_params):
            if message == _bias_message(p.name) or p.kind == "tokens" and \
                    message.startswith(history_message(p.name, "").removesuffix(" among its tokens")):
                return i
        return len(self._array_params)

    def prepare(self, logits, params: dict, late: list | None = None) -> list[mx.array]:
        """Check and normalize the call's inputs into the executable's positional arguments. Checks that need
        an MLX array's values go to `late` as (message, lazy flag [B]) -- or, without `late`, are read now."""
        x = logits
        if type(x) is not mx.array or x.ndim != 2 or x.dtype != mx.float32:    # (the decode loop's case skips this)
            x = _logits(x)
        B, V = x.shape
        if B < 1 or V < 1:
            raise SamplecError(f"logits: expected shape [V] or [B, V], got {list(x.shape)}")
        if self._max_bias_id >= V:
            raise SamplecError(f"logit_bias: token id {self._max_bias_id} is out of range for V = {V}")
        if self._counts and self._counts[0][1] > V:
            name, n = self._counts[0]
            raise SamplecError(f"{name}({n}): more entries per row than the vocabulary holds (V = {V})")
        known = self._known
        if not params.keys() <= known:
            unknown = sorted(k for k in params if k not in known)
            names = sorted("seed" if k == OS_SEED else k for k in known)
            hint = f" (parameters: {', '.join(names)})" if known else " (this sampler takes none)"
            raise SamplecError(f"unknown parameter '{unknown[0]}'{hint}")
        args, checks_now = [x], []
        for p in self.params:
            value = params.get(p.name)
            if value is None:
                if p.default is None:
                    raise SamplecError(f"missing required parameter '{p.name}' ({p.kind})")
                value = _os_seeds(B) if p.default == "os" else p.default
            args.append(self._scalar(p, value, B) if p.kind in SCALAR_NP else
                        _prepare_param(p, value, B, V, late if late is not None else checks_now,
                                       p.name in self._ids_in_graph))
        for message, flag in checks_now:
            flagged = np.array(flag)
            if flagged.any():
                raise SamplecError(f"{message} ({_rows(flagged)})")
        return args

    def _scalar(self, p: Param, value, B: int, wide: bool = False, keep: bool = True) -> mx.array:
        """A scalar parameter as an MLX array [B] (`wide`: [B, 1], what an executable that reads it only as [B, 1]
        takes without a view of its own: `Executable.wide_params`). Plain Python numbers (the common case in a
        decode loop) and lists of them, one per row (a server's batch), take a short path and are cached (unless
        not `keep`: a value that moves every call); everything else goes through the full checks of
        `_scalar_param`."""
        t = type(value)
        if t is int or t is float:
            key = (p.name, t, value, B, wide)
            hit = self._scalars.get(key) if keep else None
            if hit is not None:
                return hit
            if self._plain_ok(p, value):
                arr = _np_to_mx(np.full((B, 1) if wide else (B,), value, dtype=np.uint64)) if p.kind == "seed" else \
                    mx.array([[value]] * B if wide else [value] * B, dtype=mx.int32 if p.kind == "int" else _F32)
                return self._cache(key, arr) if keep else arr
        elif t is list and len(value) == B and p.kind in SCALAR_NP and \
                _NUMBERS.issuperset(types := tuple(map(type, value))):
            key = (p.name, types, tuple(value), wide) if keep else None
            hit = self._scalars.get(key) if keep else None
            if hit is not None:
                return hit
            if self._plain_all(p, value, types):
                arr = _np_to_mx(np.array(value, dtype=np.uint64).reshape((B, 1) if wide else (B,))) \
                    if p.kind == "seed" else \
                    mx.array([[v] for v in value] if wide else value, dtype=mx.int32 if p.kind == "int" else _F32)
                return self._cache(key, arr) if keep else arr
        if p.kind == "state" and type(value) is mx.array and value.dtype == mx.float32 and value.shape == (B,):
            return value        # (the previous step's state output, still lazy: no host round trip)
        if type(value) is np.ndarray and value.dtype == np.uint64 and value.shape == (B,) and p.kind == "seed":
            key = (p.name, value.tobytes(), wide)   # (per-row seeds, passed again each step: keyed by their bytes)
            hit = self._scalars.get(key) if keep else None
            if hit is None and not keep:
                return _np_to_mx(value.reshape((B, 1) if wide else (B,)))
            if hit is None:
                hit = self._cache(key, _np_to_mx(value.reshape((B, 1) if wide else (B,))))
            return hit
        return _np_to_mx(_scalar_param(p, value, B).reshape((B, 1) if wide else (B,)))

    def _plain_ok(self, p: Param, v) -> bool:
        """Whether a Python int or float is a valid value of scalar parameter p as is (the checks of
        `_scalar_param` for one plain number: a false answer sends the value there, for its error)."""
        if p.kind == "seed":
            return type(v) is int and 0 <= v < 2 ** 64
        if p.kind == "int":
            return type(v) is int and -2 ** 31 <= v < 2 ** 31 and \
                (p.name not in self._ranges or self._ranges[p.name].contains(v))
        return v == v and abs(v) <= _F32_MAX and \
            (p.name not in self._ranges or self._ranges[p.name].contains(float(np.float32(v))))

    def _plain_all(self, p: Param, value: list, types: tuple) -> bool:
        """`_plain_ok` of every number of a list (one a row), an integer list's bounds by its extremes."""
        if p.kind in ("seed", "int"):
            lo, hi = (0, 2 ** 64) if p.kind == "seed" else (-2 ** 31, 2 ** 31)
            r = self._ranges.get(p.name)
            return float not in types and lo <= min(value) and max(value) < hi and \
                (r is None or all(map(r.contains, value)))
        return all(self._plain_ok(p, v) for v in value)

    def _cache(self, key, arr: mx.array) -> mx.array:
        if len(self._scalars) > 256:     # (the oldest goes: a moving position never frees 256 arrays at once)
            self._scalars.popitem(last=False)
        self._scalars[key] = arr
        return arr


_MLX_LM_MISUSE = (
    "a samplec Program was passed to mlx-lm directly as `sampler=`: mlx-lm calls it with log-probabilities only "
    "(no seed, position or history) and expects tokens back, not Outputs. Wrap the program in the adapter: "
    "`from samplec.integrations.mlx_lm import Sampler; s = Sampler(program, seed=0)` and pass "
    "`sampler=s, logits_processors=s.logits_processors` (program: '{name}')")


def _called_by_mlx_lm() -> bool:
    """Whether the caller of Program.__call__ is mlx-lm's code (mlx-lm calls `sampler(logprobs)`)."""
    return sys._getframe(2).f_globals.get("__name__", "").startswith("mlx_lm.")


def named_flags(checks: list[tuple[str | tuple[str, ...], mx.array]]) -> list[tuple[str, np.ndarray]]:
    """`queue`'s checks, evaluated, as (message, bool [B]) in order: a check is (message, flag [B]), or a word of
    packed flags (messages, uint32 [B]) with message i's flag at bit i (`interpreter.pack_flags`)."""
    out = []
    for message, flag in checks:
        if isinstance(message, tuple):
            out += zip(message, unpack_flags([np.array(flag).reshape(-1)], len(message)))
        else:
            out.append((message, np.array(_flagged(flag), dtype=bool)))
    return out


def _rows_of(logits, params: dict, rows: np.ndarray) -> tuple | None:
    """The call's logits and parameters at the rows `rows` alone (None where that is the whole batch, or the logits
    are not an array): what is one value a row (an array or a list with B entries) is cut, the rest kept."""
    if type(logits) not in (mx.array, np.ndarray) or logits.ndim != 2 or len(rows) == logits.shape[0]:
        return None
    B = logits.shape[0]
    at = mx.array(rows.astype(np.int32))

    def cut(v):
        if type(v) is mx.array:
            return v[at] if v.ndim and v.shape[0] == B else v
        if isinstance(v, np.ndarray):
            return v[rows] if v.ndim and v.shape[0] == B else v
        if isinstance(v, (list, tuple)) and len(v) == B:
            return [v[i] for i in rows]
        return v
    return cut(logits), {k: cut(v) for k, v in params.items()}


def _flagged(flag: mx.array) -> list:
    """A check flag ([B], or [B, 1] as the executable leaves it) as a list of B bools -- or a word of packed flags
    as B ints (tolist: a fraction of np.array's cost on a fresh result)."""
    v = flag.tolist()
    return [r[0] for r in v] if flag.ndim == 2 else v


def _logits(value) -> mx.array:
    """Logits of any accepted form as a float32 MLX array [B, V]."""
    x = _as_mx(value, "logits")
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise SamplecError(f"logits: expected shape [V] or [B, V], got {list(x.shape)}")
    if x.dtype not in (mx.float32, mx.float16, mx.bfloat16, mx.float64):
        raise SamplecError(f"logits: expected float32, float16, bfloat16 (or float64), got {dtype_name(x.dtype)}")
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def dtype_name(dtype) -> str:
    """An MLX or numpy dtype as users write it: int32, not mlx.core.int32."""
    return str(dtype).removeprefix("mlx.core.")


def _os_seeds(B: int) -> np.ndarray:
    return np.frombuffer(os.urandom(8 * B), dtype=np.uint64).copy()


def _as_mx(value, name: str) -> mx.array:
    if isinstance(value, mx.array):
        return value
    try:
        arr = np.asarray(value)
    except Exception as e:  # noqa: BLE001 - anything numpy cannot read is a bad value
        raise SamplecError(f"{name}: cannot convert {type(value).__name__} to an array ({e})") from None
    if arr.dtype.kind not in "biuf":       # (strings, objects, complex, datetimes: not numbers)
        raise SamplecError(f"{name}: expected numbers, got {type(value).__name__} of {arr.dtype}")
    if arr.dtype == np.float64:
        with np.errstate(over="ignore"):    # (past float32's range: +-inf, which the checks name)
            arr = arr.astype(np.float32)
    return _np_to_mx(arr)


def _np_to_mx(arr: np.ndarray) -> mx.array:
    """A numpy array as an MLX array: a reversed or strided view copied first (MLX takes contiguous memory with
    nonnegative strides -- numpy calls a view reversed along an axis of one entry contiguous, so the strides decide)."""
    if any(st < 0 for st in arr.strides) or not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        arr = np.array(arr, order="C", copy=True)
    return mx.array(arr)


def _prepare_param(p: Param, value, B: int, V: int, late: list, ids_in_graph: bool = False) -> mx.array:
    """A parameter's value as the graph's argument; checks that need an MLX array's values go to `late` (message,
    lazy flag). `ids_in_graph`: the graph checks this history's range itself (an int32 MLX history is its argument
    as it is)."""
    if p.kind in SCALAR_NP:
        return _np_to_mx(_scalar_param(p, value, B))
    host = None if isinstance(value, mx.array) else np.asarray(value) if isinstance(value, np.ndarray) else None
    arr = value if isinstance(value, mx.array) else _as_mx(value, p.name)
    if arr.ndim == 1 and B == 1:            # (one row's value for a one-row call)
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[0] != B:
        what = {"tokens": "[B, H]", "mask": f"[B, {V}] (or packed: [B, {(V + 31) // 32}])"}.get(p.kind, f"[B, {V}]")
        raise SamplecError(f"{p.name}: expected shape {what} with B = {B}, got {list(arr.shape)}")
    if p.kind == "tokens":
        if not mx.issubdtype(arr.dtype, mx.integer):
            raise SamplecError(f"{p.name}: token history must be integers, got {dtype_name(arr.dtype)}")
        message = _history_message(p.name, V)
        if mx.issubdtype(arr.dtype, mx.unsignedinteger):
            # (no padding in an unsigned history: its ids as int32, one past int32's range kept >= V for the check)
            arr = mx.minimum(arr, mx.array(2 ** 31 - 1, dtype=arr.dtype)).astype(mx.int32)
        if host is not None and host.ndim == 2:      # (a host array: checked here, without MLX)
            over = (host >= V).any(axis=-1)
            if over.any():
                raise SamplecError(f"{message} ({_rows(over)})")
        elif arr.shape[1] and not (ids_in_graph and arr.dtype == mx.int32):
            checked = history_check(arr, V)           # (one primitive where the native ones serve)
            if checked is None:     # (the flag from the row's largest id, a [B, 1] column: no kernel of its own
                checked = mx.where(arr >= V, -1, arr), mx.max(arr, axis=-1, keepdims=True) >= V   # beside the word)
            arr = checked[0]                          # (an id >= V reads as padding until the error is raised)
            late.append((message, checked[1]))
        if arr.dtype != mx.int32:                     # (every negative id is padding: none may wrap to an id)
            if mx.issubdtype(arr.dtype, mx.signedinteger):
                arr = mx.where(arr < 0, -1, arr)
            arr = arr.astype(mx.int32)
        if arr.shape[1] == 0:
            arr = mx.full((B, 1), -1, dtype=mx.int32)
        return arr
    if p.kind == "mask":
        return _mask(p.name, arr, B, V)
    if p.kind == "bias":
        if arr.dtype == mx.bool_:       # (a mask given for the bias: its trues would add 1, silently)
            raise SamplecError(f"{p.name}: expected a float bias [{B}, {V}], got bool (a mask?)")
        if arr.shape[1] != V:
            raise SamplecError(f"{p.name}: expected shape [{B}, {V}], got {list(arr.shape)}")
        arr = arr.astype(mx.float32)
        top = row_max(arr)          # (a NaN wins its row's maximum: one vectorized pass where native serves;
        if top is None:             # MLX's maximum too, one reduction of the bias as it is -- no kernel before it)
            top = mx.max(arr, axis=-1, keepdims=True)
        bad = mx.logical_not(top < _INF)            # (NaN or +inf; [B, 1]: in the kernel that packs the flags)
        late.append((_bias_message(p.name), bad))
        return arr
    raise SamplecError(f"{p.name}: unsupported parameter kind {p.kind}")


_NUMBERS = frozenset({int, float})


class _Last:
    """The short path's record of the last call at a logits shape: the key of its scalar values (None: never
    equal), their arrays, each value's bytes (None where it is not plain), the executable it ran and its checks'
    messages, and the values it changed (compared one by one at the next call)."""
    __slots__ = ("key", "arrays", "keys", "run", "moved")

    def __init__(self, key, arrays, keys, run, moved):
        self.key, self.arrays, self.keys, self.run, self.moved = key, arrays, keys, run, moved


def _int_bounds(r: Range | None) -> tuple[int, int]:
    """The Python ints an `int` parameter with range `r` takes, [lo, hi]: the int32 range within `r`'s."""
    lo, hi = -2 ** 31, 2 ** 31 - 1
    if r is not None:
        if r.lo > -_INF:
            lo = max(lo, math.floor(r.lo) + 1 if r.lo_open else math.ceil(r.lo))
        if r.hi < _INF:
            hi = min(hi, math.ceil(r.hi) - 1 if r.hi_open else math.floor(r.hi))
    return lo, hi


def _bytes(value) -> bytes | None:
    """A scalar value's bytes in marshal's format 2, None for an MLX array (marshal would evaluate it)."""
    return None if type(value) is mx.array else marshal.dumps(value, 2)


def _masked(values: list, moved: frozenset) -> list:
    """`values` with those at the places `moved` left out (None): what `Program._arguments`' key compares."""
    values = values.copy()
    for k in moved:
        values[k] = None
    return values


def _plain(v) -> bool:
    """Whether marshal writes `v` with its type: a Python number, a list of them, or None (`Program._rebuild`)."""
    t = type(v)
    return t is float or t is int or v is None or (t is list and set(map(type, v)) <= _NUMBERS)


def check_message(message: str, V: int | None = None) -> str:
    """A graph check's message as raised: a history's range check ("... V = {V} ...") with the call's V where it
    is known (a decode loop's raise: without it)."""
    return message.replace(" = {V}", "" if V is None else f" = {V}")


def _history_message(name: str, V: int) -> str:
    return history_message(name, V)


def _bias_message(name: str) -> str:
    return f"{name}: NaN or +inf bias"


class _Shape:
    """What the full path accepted for one logits shape [B, V]: per parameter that is not a scalar, the (shape,
    dtype) of the MLX arrays it took, and the messages of the pre-stage's flags (each history's range check, then
    each bias's NaN check, in the parameters' order: `_prepare_param`'s `late`)."""

    def __init__(self, params: tuple, V: int, ids_in_graph: frozenset = frozenset()):
        self.accepted = tuple(set() for _ in params)
        self.messages = tuple(_history_message(p.name, V) if p.kind == "tokens" else _bias_message(p.name)
                              for p in params if p.kind == "bias" or p.kind == "tokens" and p.name not in ids_in_graph)


class _PreStage:
    """The short path's pre-stage, traced in front of the graph (`Executable.queued`): from (logits, the scalar
    parameters, the other parameters) to the graph's arguments in declaration order and the flags of the other
    parameters' checks -- `_prepare_param` on each, the full path's own code, run where it replays with the graph.
    The short path passes only arrays whose shape and dtype `_prepare_param` accepted, so it raises nothing here."""

    def __init__(self, scalar_at: tuple, arrays: tuple, n: int, ids_in_graph: frozenset = frozenset()):
        self.scalar_at, self.arrays, self.n, self.ids_in_graph = scalar_at, arrays, n, ids_in_graph

    def __call__(self, args) -> tuple[list, list]:
        x = args[0]
        B, V = x.shape
        m = len(self.scalar_at)
        out = [x] + [None] * self.n
        for i, a in zip(self.scalar_at, args[1:1 + m]):
            out[i] = a
        late: list = []
        for (i, p), a in zip(self.arrays, args[1 + m:]):
            out[i] = _prepare_param(p, a, B, V, late, p.name in self.ids_in_graph)
        return out, [f for _, f in late]


def _mask(name: str, arr: mx.array, B: int, V: int) -> mx.array:
    """A bool [B, V] mask, or a packed int32 bitmask [B, ceil(V/32)] (bit j of word w is token 32*w + j)."""
    words = (V + 31) // 32
    if arr.dtype == mx.bool_:
        if arr.shape[1] != V:
            raise SamplecError(f"{name}: expected a bool mask of shape [{B}, {V}], got {list(arr.shape)}")
        return arr
    if not mx.issubdtype(arr.dtype, mx.integer):
        raise SamplecError(f"{name}: expected bool [B, V] or a packed int32 bitmask [B, {words}], "
                           f"got {dtype_name(arr.dtype)}")
    if arr.shape[1] == V and V != words:
        return arr != 0
    if arr.shape[1] != words:
        raise SamplecError(f"{name}: a packed bitmask needs ceil(V/32) = {words} words per row, "
                           f"got {arr.shape[1]}")
    bits = (arr.astype(mx.uint32)[..., None] >> mx.arange(32, dtype=mx.uint32)) & 1
    return (bits.reshape(B, words * 32)[:, :V]) != 0


_F32_MAX = float(np.finfo(np.float32).max)
_INF = float("inf")
_F32 = mx.float32


def _show(v: float, kind: str) -> str:
    """A value as short as it reads unambiguously (as the float32 it is, for a float)."""
    if kind != "float":
        return f"{int(v)}"
    short = f"{float(v):g}"
    return short if np.float32(short) == np.float32(v) else str(np.float32(v))


def _scalar_param(p: Param, value, B: int) -> np.ndarray:
    """A scalar parameter's run-time value as [B] numbers, or one error naming the parameter and, for each
    problem found (NaN, out of range, past float32 or int32, not an integer), its rows."""
    if isinstance(value, mx.array):
        value = np.array(value)
    if p.kind == "seed":
        arr = np.asarray(value, dtype=object if not isinstance(value, np.ndarray) else None)
        if any(isinstance(v, (str, bytes, bool, np.bool_)) or not isinstance(v, (int, np.integer)) and
               not (isinstance(v, (float, np.floating)) and float(v).is_integer()) for v in np.ravel(arr)):
            raise SamplecError(f"{p.name}: seeds must be integers, got {value!r}")
        arr = np.vectorize(int, otypes=[object])(arr) if arr.size else arr.astype(object)
    else:
        try:
            raw = np.asarray(value) if not isinstance(value, (str, bytes)) else None
        except ValueError:      # (a ragged list)
            raw = None
        if raw is None or raw.dtype.kind not in "iuf":     # ('0.7' is a string, True a flag: not numbers)
            raise SamplecError(f"{p.name}: expected a number or one number per row, got {value!r}")
        arr = raw.astype(np.float64)
    if arr.ndim == 0:
        arr = np.broadcast_to(arr, (B,))
    if arr.ndim != 1 or arr.shape[0] != B:
        raise SamplecError(f"{p.name}: expected a scalar or {B} value{'s' if B != 1 else ''} (one per row), "
                           f"got shape {list(arr.shape)}")
    if p.kind == "seed":
        bad = np.array([not 0 <= v < 2 ** 64 for v in arr], dtype=bool)
        if bad.any():
            raise SamplecError(f"{p.name}: seeds must be in [0, 2**64) ({_rows(bad)})")
        return np.array([int(v) for v in arr], dtype=np.uint64)
    problems = []                        # every problem with its rows, in one error
    if p.kind in ("float", "state"):     # the float32 the program computes with, checked as such (a literal's)
        with np.errstate(over="ignore"):
            f32 = arr.astype(np.float32)
        over = np.isfinite(arr) & ~np.isfinite(f32)
        if over.any():
            problems.append(f"{p.name}: out of the float32 range (|x| <= 3.4028235e38; pass inf for infinity) "
                            f"({_rows(over)})")
        arr = np.where(over, np.nan, f32.astype(np.float64))
    else:
        over = np.zeros(B, dtype=bool)
    nan = np.isnan(arr) & ~over & (p.kind != "state")     # (a state's NaN: left out, its stage's start value)
    if nan.any():
        problems.append(f"{p.name}: NaN ({_rows(nan)})")
    ok = ~nan & ~over
    if p.kind == "int":
        frac = ok & (~np.isfinite(arr) | (arr != np.round(arr)))
        if frac.any():
            problems.append(f"{p.name}: expected an integer ({_rows(frac)})")
        ok &= ~frac
    if p.range:
        r = Range.parse(p.range)
        bad = ok & np.array([not r.contains(float(v)) for v in arr], dtype=bool)
        if bad.any():
            vals = ", ".join(list(dict.fromkeys(_show(v, p.kind) for v in arr[bad]))[:4])    # (each value once)
            hint = ""
            if r.lo == 0 and r.lo_open and r.hi == 1 and not r.hi_open and (arr[bad] == 0).any():
                # (top_p's range: mlx-lm and vLLM's servers read 0 as "off", OpenAI's as the most likely token)
                hint = "; top_p's off value is 1 (mlx-lm's top_p = 0), and top_k(1) keeps the most likely token alone"
            problems.append(f"{p.name} = {vals} is out of range {p.range} ({_rows(bad)}){hint}")
        ok &= ~bad
    if p.kind == "int":
        wide = ok & ((arr < -2 ** 31) | (arr > 2 ** 31 - 1))
        if wide.any():
            problems.append(f"{p.name}: integer out of the int32 range [-2**31, 2**31 - 1] ({_rows(wide)})")
    if problems:
        raise SamplecError("; ".join(problems))
    return arr.astype(SCALAR_NP[p.kind])


__all__ = ["Program", "Outputs", "IdsValues"]
