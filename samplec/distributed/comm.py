"""The collectives a sharded call makes, over an `mx.distributed` group, and the call's header check.

Every collective is an `all_gather` whose result every rank combines the same way, in the order of the slices'
starts: a float sum of per-rank partial sums is added rank by rank in that order, so that every rank holds the
same bits whatever the group's size or its ranks' numbering (an `all_sum` may leave ranks with different
roundings). The collectives of a call are chained with `mx.depends`, so that every rank runs them in the same
order however MLX schedules the rest of its graph, and the whole call is one lazy graph evaluated once (a
selection reads its candidates' verdict on the host: every rank reads the same gathered values).
"""
from __future__ import annotations

import hashlib
import os
import queue
import sys
import time
import threading
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from samplec.diagnostics import SamplecError

I32_MAX = 2 ** 31 - 1
HEADER_WORDS = 32       # fixed: ranks that disagree about everything still exchange the same shape
_MAGIC = 0x5A3C0001     # (a rank running another version of this header sends another number)


@dataclass(frozen=True)
class Slices:
    """Which contiguous slice of the vocabulary each rank holds: rank r holds ids [starts[r], starts[r] +
    sizes[r]) of a vocabulary of `vocab` ids."""
    rank: int
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    vocab: int

    @property
    def start(self) -> int:
        return self.starts[self.rank]

    @property
    def size(self) -> int:
        return self.sizes[self.rank]

    @property
    def order(self) -> list[int]:
        """The ranks in the order of their slices."""
        return sorted(range(len(self.starts)), key=lambda r: self.starts[r])

    @property
    def before(self) -> np.ndarray:
        """[N] 1 for the ranks whose slices lie before this rank's, else 0."""
        return np.array([1 if s < self.start else 0 for s in self.starts], dtype=np.int32)


class Comm:
    """One group's collectives for one call: ordered gathers and the reductions built on them. `sent` counts the
    bytes this rank contributes to the call's gathers (each rank receives N - 1 times as much)."""

    def __init__(self, group, slices: Slices):
        self.group, self.slices = group, slices
        self.n = group.size()
        self._last: mx.array | None = None
        self.sent = 0
        self.rounds = 0

    def gather(self, a: mx.array) -> mx.array:
        """[N, *a.shape]: every rank's `a`, by rank (a's shape must be the same on every rank)."""
        if self._last is not None:
            a = mx.depends(a, self._last)
        out = mx.distributed.all_gather(a[None], group=self.group)
        self._last = out
        self.sent += a.size * a.itemsize
        self.rounds += 1
        return out

    def in_order(self, g: mx.array) -> list[mx.array]:
        return [g[r] for r in self.slices.order]

    def max(self, a: mx.array) -> mx.array:
        return mx.max(self.gather(a), axis=0)

    def min(self, a: mx.array) -> mx.array:
        return mx.min(self.gather(a), axis=0)

    def any(self, a: mx.array) -> mx.array:
        return mx.any(self.gather(a), axis=0)

    def sum(self, a: mx.array) -> mx.array:
        """The sum over ranks: integers exactly, floats added rank by rank in the slices' order."""
        g = self.gather(a)
        if a.dtype != mx.float32:
            return mx.sum(g, axis=0)
        parts = self.in_order(g)
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        return acc

    def owner(self, ids: mx.array) -> mx.array:
        """The rank holding each (global, in range) token id."""
        own = mx.zeros(ids.shape, dtype=mx.int32)
        for r, (s, n) in enumerate(zip(self.slices.starts, self.slices.sizes)):
            if r:
                own = mx.where((ids >= s) & (ids < s + n), r, own)
        return own

    def pick(self, g: mx.array, owner: mx.array) -> mx.array:
        """From gathered [N, ...] values, each entry's owner's."""
        return mx.take_along_axis(g, owner[None], axis=0)[0]

    def full(self, a: mx.array) -> mx.array:
        """The whole row from the slices (the fallback of an op with no sharded kernel): [..., V_r] -> [..., V]."""
        width = max(self.slices.sizes)
        pad = width - a.shape[-1]
        if pad:
            a = mx.concatenate([a, mx.zeros(a.shape[:-1] + (pad,), dtype=a.dtype)], axis=-1)
        g = self.gather(a)
        return mx.concatenate([g[r][..., :self.slices.sizes[r]] for r in self.slices.order], axis=-1)


# ---- the header: one small gather that checks a call before anything else is exchanged ----

def digest(*parts) -> int:
    """A 31-bit digest of arrays and values (their dtype, shape and bytes)."""
    h = hashlib.blake2b(digest_size=4)
    for p in parts:
        arr = np.asarray(p)
        h.update(str(arr.dtype).encode() + str(arr.shape).encode() + np.ascontiguousarray(arr).tobytes())
    return int.from_bytes(h.digest(), "little") & I32_MAX


PARAM_WORDS = HEADER_WORDS - 10       # parameters named in a mismatch (the rest share the combined digest)


def header(rank: int, B: int, width: int, start: int, vocab: int, program: int, params: list[tuple[str, int]],
           call: int) -> np.ndarray:
    words = [_MAGIC, B, width, start, vocab, program, call, digest(*[h for _, h in params]), rank]
    words += [h for _, h in params][:PARAM_WORDS]
    return sealed(words + [0] * (HEADER_WORDS - 1 - len(words)))


def sealed(words: list[int]) -> np.ndarray:
    """int32 words and, last, their digest (a row that arrives damaged or from another call's buffer fails it)."""
    arr = np.array(words, dtype=np.int32)
    return np.append(arr, np.int32(digest(arr)))


def intact(rows: np.ndarray, rank_col: int, what: str) -> None:
    """Every rank's row arrived whole: its digest holds and it names its rank. A ring whose peer stopped may fill
    a gather with stale or partial buffers instead of failing."""
    for r, row in enumerate(rows):
        if digest(row[:-1]) != int(row[-1]) or int(row[rank_col]) != r:
            raise SamplecError(f"sharded call: rank {r}'s {what} did not arrive intact (a rank stopped, or the "
                               f"connection failed)")


def check_headers(rows: np.ndarray, names: list[str]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(starts, sizes, vocab) from every rank's header [N, HEADER_WORDS], or the error every rank raises."""
    def differ(col: int, what: str):
        vals = rows[:, col]
        if (vals != vals[0]).any():
            per = ", ".join(f"rank {r}: {v}" for r, v in enumerate(vals.tolist()))
            raise SamplecError(f"sharded call: {what} differs across ranks ({per})")

    if (rows[:, 0] != _MAGIC).any():
        bad = [r for r in range(len(rows)) if rows[r, 0] != _MAGIC]
        raise SamplecError(f"sharded call: rank {bad[0]}'s header is not a samplec.distributed header of this "
                           f"version (another version, or a rank stopped)")
    intact(rows, 8, "header")
    if (rows[:, 5] != rows[0, 5]).any():
        raise SamplecError("sharded call: the ranks run different programs (their IR differs)")
    differ(6, "the call's number (a rank stopped, skipped or repeated a call)")
    differ(1, "the batch size B")
    differ(4, "vocab_size")
    if (rows[:, 7] != rows[0, 7]).any():
        bad = [n for i, n in enumerate(names[:PARAM_WORDS]) if (rows[:, 9 + i] != rows[0, 9 + i]).any()]
        which = ", ".join(f"'{n}'" for n in bad) if bad else "some"
        raise SamplecError(f"sharded call: parameter {which} differs across ranks (every rank must pass the same "
                           f"values; only logits, mask and bias are given per slice)")
    vocab = int(rows[0, 4])
    starts, sizes = tuple(int(v) for v in rows[:, 3]), tuple(int(v) for v in rows[:, 2])
    span = lambda r: f"rank {r} holds [{starts[r]}, {starts[r] + sizes[r]})"
    at = 0
    for r in sorted(range(len(starts)), key=lambda r: starts[r]):
        if starts[r] != at:
            what = f"a gap [{at}, {starts[r]})" if starts[r] > at else f"an overlap at [{starts[r]}, {at})"
            raise SamplecError(f"sharded call: the slices do not tile the vocabulary [0, {vocab}): {what} "
                               f"({'; '.join(span(q) for q in range(len(starts)))})")
        at = starts[r] + sizes[r]
    if at != vocab:
        raise SamplecError(f"sharded call: the slices do not tile the vocabulary [0, {vocab}): they end at {at} "
                           f"({'; '.join(span(q) for q in range(len(starts)))})")
    return starts, sizes, vocab


def check_trailers(rows: np.ndarray) -> None:
    """Every rank computed the same outputs (trailer rows: rank, digest of the outputs, seal)."""
    intact(rows, 0, "result")
    if (rows[:, 1] != rows[0, 1]).any():
        raise SamplecError("sharded call: the ranks' outputs differ (a rank stopped during the call, or a rank's "
                           "collectives failed)")


# ---- bounded waits ----

class Deadline:
    """A monitor thread that calls `expired(timeout, what)` once an armed deadline passes; `disarm()` first, and
    nothing happens. A collective blocked on a peer that stopped answering cannot be interrupted: `expired` must
    end the process."""

    def __init__(self, expired, name: str):
        self.expired, self.name = expired, name
        self._cond = threading.Condition()
        self._deadline: tuple[float, float, str] | None = None
        self._thread: threading.Thread | None = None

    def arm(self, what: str, timeout: float) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._monitor, name=self.name, daemon=True)
                self._thread.start()
            self._deadline = (time.monotonic() + timeout, timeout, what)
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None
            self._cond.notify()

    def _monitor(self) -> None:
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                at, timeout, what = self._deadline
                left = at - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._deadline = None
                break
        self.expired(timeout, what)


class Watchdog:
    """Bounds each wait for the other ranks to `timeout` seconds (None: unbounded). A collective blocked on a peer
    that stopped answering cannot be interrupted, so past the deadline:

    - `on_timeout="exit"` (the default): the call runs on the calling thread, and a monitor thread prints the
      error to stderr and ends the process (exit status 70) -- the other ranks then see a rank that stopped;
    - `on_timeout="raise"`: the call runs on a worker thread and the caller gets a `SamplecError`; the worker stays
      blocked and the group is unusable (every later call fails at once). A thread hand-off per call costs more.

    A ring error (a peer's connection lost) is a `SamplecError` either way."""

    def __init__(self, timeout: float | None, on_timeout: str = "exit"):
        if on_timeout not in ("exit", "raise"):
            raise SamplecError(f"on_timeout must be 'exit' or 'raise', got {on_timeout!r}")
        self.timeout, self.on_timeout = timeout, on_timeout
        self.broken: str | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._deadline = Deadline(self._end, "samplec-shard-watchdog")

    def run(self, fn, what: str):
        if self.broken:
            raise SamplecError(f"sharded call: the group is unusable after an earlier failure ({self.broken})")
        with self._lock:
            try:
                if self.timeout is None:
                    return fn()
                return self._in_worker(fn, what) if self.on_timeout == "raise" else self._monitored(fn, what)
            except RuntimeError as e:
                if "[ring]" in str(e) or "peer" in str(e):
                    self.broken = f"{e} during {what}"
                    raise SamplecError(f"sharded call: {self.broken} (a rank stopped)") from None
                raise

    # on_timeout="exit": the calling thread runs the call; a monitor thread watches the deadline

    def _monitored(self, fn, what: str):
        self._deadline.arm(what, self.timeout)
        try:
            return fn()
        finally:
            self._deadline.disarm()

    @staticmethod
    def _end(timeout: float, what: str) -> None:
        sys.stderr.write(f"samplec.distributed: no answer from the other ranks within {timeout:g} s during {what} "
                         f"(a rank stopped, or the ranks make different calls): ending this process\n")
        sys.stderr.flush()
        os._exit(70)

    # on_timeout="raise": a worker thread runs the call; the caller waits for it with a timeout

    def _serve(self) -> None:
        while True:
            fn, done = self._jobs.get()
            try:
                done["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                done["error"] = e
            done["event"].set()

    def _in_worker(self, fn, what: str):
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="samplec-shard", daemon=True)
            self._thread.start()
        done = {"event": threading.Event()}
        self._jobs.put((fn, done))
        if not done["event"].wait(self.timeout):
            self.broken = f"no answer from the other ranks within {self.timeout:g} s during {what}"
            raise SamplecError(f"sharded call: {self.broken} (a rank stopped, or the ranks make different calls)")
        if "error" in done:
            raise done["error"]
        return done["value"]
