"""Rank 0's decisions on every rank: how `samplec serve` keeps the ranks of a vocabulary-sharded model in step.

Under `mlx.launch`, only rank 0 serves HTTP. Before each engine step it broadcasts a plan -- the requests to admit
(their bodies, as rank 0 received them, and the seeds rank 0 drew), the requests whose clients went away, or the
end -- and every rank then makes the same calls on its own batch generator in the same order. Each rank's model
gives its slice of every row's logits; the sampler call (`samplec.distributed.shard`) gives every rank the same
tokens, so the batches stay the same everywhere (docs/distributed.md, samplec serve).

A rank that stops must not leave the others blocked in a collective: rank 0 sends a plan at least every `HEARTBEAT`
seconds, requests or none, and every rank bounds each step -- the plan and the step's forward pass and sampling --
with a `StepWatch`. A rank that dies is seen at once: its `Lifeline` to rank 0 (a TCP connection beside the
collectives, which the kernel closes with the process) breaks, and the ring backend's collectives fail
(`rank_failure`) -- though a collective already under way may instead wait forever on the dead peer; a rank that
stops answering, at the step's deadline. Either way the engine ends its rank with one line on stderr and exit status
`EXIT_STATUS`, rank 0 after answering its requests in flight with a 503 naming the cause.
"""
from __future__ import annotations

import json
import os
import select
import socket
import struct
import threading
import time

import mlx.core as mx
import numpy as np

from samplec.diagnostics import SamplecError
from samplec.distributed.comm import Deadline, digest, sealed

HEARTBEAT = 1.0         # seconds: rank 0 sends a plan at least this often, so an idle server is never silent
RANK_TIMEOUT = 30.0     # seconds: the default bound on one engine step (`samplec serve --rank-timeout`); it covers
                        # the step's own forward pass, so it is generous -- a long prefill of a large model
MIN_TIMEOUT = 3 * HEARTBEAT     # a bound of fewer heartbeats would end an idle server on a late plan
START_TIMEOUT = 600.0   # seconds: the first plan waits for every rank to load the model
EXIT_STATUS = 70        # (the status `samplec.distributed.comm.Watchdog` ends a rank with, EX_SOFTWARE)

_MAGIC = 0x5A3C0F01     # a plan's header (another number: another version, or a stale buffer)


class PlanError(SamplecError):
    """A plan that did not arrive whole on every rank (a rank stopped, or the connection failed)."""


def broadcast(payload: bytes | None, group, number: int = 0) -> bytes:
    """Rank 0's `payload` on every rank of `group` (the other ranks pass None): two gathers, a sealed header
    (magic, the plan's `number`, the length, a digest of the bytes, the rank) from every rank, then the bytes as
    int32 words (every rank contributes the same shape; rank 0's row is the result). Raises `PlanError` where a
    header or the bytes did not arrive intact, or a rank sent another plan number (a ring whose peer stopped may
    fill a gather with stale or partial buffers instead of failing)."""
    rank = group.rank()
    if rank == 0 and payload is None:
        raise SamplecError("internal error: rank 0 broadcasts bytes, not None")
    data = np.frombuffer(payload, dtype=np.uint8) if rank == 0 else np.zeros(0, dtype=np.uint8)
    head = sealed([_MAGIC, number, data.size, digest(data) if rank == 0 else 0, rank])
    rows = np.array(mx.distributed.all_gather(mx.array(head)[None], group=group))
    for r, row in enumerate(rows):
        if int(row[0]) != _MAGIC or digest(row[:-1]) != int(row[-1]) or int(row[4]) != r:
            raise PlanError(f"rank {r}'s header of plan {number} did not arrive intact (a rank stopped, or the "
                            f"connection failed)")
        if int(row[1]) != number:
            raise PlanError(f"rank {r} is at plan {int(row[1])}, this rank at plan {number} (a rank stopped or "
                            f"restarted)")
    size = int(rows[0, 2])
    if size == 0:
        return b""
    words = (size + 3) // 4
    if rank == 0:
        mine = np.frombuffer(data.tobytes() + bytes(4 * words - size), dtype=np.int32)
    else:
        mine = np.zeros(words, dtype=np.int32)
    out = np.array(mx.distributed.all_gather(mx.array(mine)[None], group=group))[0].tobytes()[:size]
    if digest(np.frombuffer(out, dtype=np.uint8)) != int(rows[0, 3]):
        raise PlanError(f"plan {number} did not arrive intact (a rank stopped, or the connection failed)")
    return out


def send_plan(plan: dict, group, number: int = 0) -> dict:
    """On rank 0: broadcast the plan (a JSON object) as plan `number`; returns it."""
    broadcast(json.dumps(plan, separators=(",", ":")).encode(), group, number)
    return plan


def receive_plan(group, number: int = 0) -> dict:
    """On the other ranks: rank 0's plan `number`."""
    return json.loads(broadcast(None, group, number).decode())


def rank_failure(e: BaseException) -> str | None:
    """What an exception says about the group, where it says a rank stopped or the ranks fell out of step (the
    ring backend's connection errors, a plan or a sharded call that did not arrive whole or disagrees across
    ranks); None for any other error."""
    text = str(e)
    if isinstance(e, PlanError) or isinstance(e, SamplecError) and text.startswith("sharded call:"):
        return text
    if isinstance(e, RuntimeError) and ("[ring]" in text or "peer" in text):
        return f"a rank stopped ({text})"
    return None


class StepWatch(Deadline):
    """Bounds each engine step's wait for the other ranks: `arm(what)` before the step's first collective,
    `disarm()` after its last. Past the deadline the monitor thread calls `expired(cause)`, which must end the
    process. (`comm.Watchdog` bounds one call the same way but can only print and exit; a server first answers its
    requests.)"""

    def __init__(self, timeout: float, expired):
        super().__init__(lambda t, what: expired(f"no answer from the other ranks within {t:g} s during {what} "
                                                 f"(a rank stopped or hangs)"), "samplec-step-watch")
        self.timeout = timeout

    def arm(self, what: str, timeout: float | None = None) -> None:
        super().arm(what, self.timeout if timeout is None else timeout)


class Lifeline:
    """One TCP connection from each other rank to rank 0, beside the collectives: the kernel closes it the moment a
    process ends, so rank 0 learns at once which rank died and the others that rank 0 did (a collective on a dead
    peer may wait forever instead of failing). Rank 0 listens on its address in the ring backend's hostfile
    (`MLX_HOSTFILE`) and sends its port in the first plan; without such a file there is no lifeline and the step
    watch alone bounds the wait. `end()` (rank 0, before the last plan) tells the others that the connection
    closing next is the normal end. `lost(cause)` must end the process."""

    def __init__(self, group, lost):
        self.group, self.lost = group, lost
        self.rank, self.ended = group.rank(), False
        self.host = _rank0_host()
        self.port: int | None = None
        self._peers: dict[socket.socket, int] = {}
        self._lock = threading.Lock()
        if self.rank == 0 and self.host is not None:
            try:
                self._server = socket.create_server((self.host, 0))
            except OSError:
                return
            self.port = self._server.getsockname()[1]
            threading.Thread(target=self._watch_ranks, name="samplec-lifeline", daemon=True).start()

    def join(self, port: int | None) -> None:
        """(another rank, on the first plan) Connect to rank 0's `port`; no lifeline where that fails."""
        if port is None or self.host is None:
            return
        try:
            conn = socket.create_connection((self.host, port), timeout=10)
            conn.settimeout(None)
            conn.sendall(struct.pack("<i", self.rank))
        except OSError:
            return
        threading.Thread(target=self._watch_rank0, args=(conn,), name="samplec-lifeline", daemon=True).start()

    def end(self) -> None:
        with self._lock:
            self.ended = True
            for conn in self._peers:
                try:
                    conn.sendall(b"E")
                except OSError:
                    pass

    def _watch_rank0(self, conn: socket.socket) -> None:
        try:
            got = conn.recv(1)
        except OSError:
            got = b""
        if got != b"E":
            self.lost("rank 0 stopped (its connection to this rank closed)")

    def _watch_ranks(self) -> None:
        while True:
            ready, _, _ = select.select([self._server, *self._peers], [], [])
            for conn in ready:
                if conn is self._server:
                    peer, _ = self._server.accept()
                    try:
                        peer.settimeout(10)
                        (r,) = struct.unpack("<i", peer.recv(4, socket.MSG_WAITALL))
                        peer.settimeout(None)
                    except (OSError, struct.error):
                        peer.close()
                        continue
                    with self._lock:
                        self._peers[peer] = r
                        if self.ended:
                            peer.sendall(b"E")
                    continue
                try:
                    got = conn.recv(1)
                except OSError:
                    got = b""
                if not got:
                    with self._lock:
                        r, ended = self._peers.pop(conn), self.ended
                    conn.close()
                    if not ended:
                        self.lost(f"rank {r} stopped (its connection to rank 0 closed)")


def _rank0_host() -> str | None:
    """Rank 0's address in the ring backend's hostfile (a JSON list, per rank, of "ip:port"), or None."""
    path = os.environ.get("MLX_HOSTFILE")
    try:
        with open(path) as f:
            hosts = json.load(f)
        return str(hosts[0][0]).rsplit(":", 1)[0]
    except (TypeError, OSError, ValueError, IndexError, KeyError):
        return None
