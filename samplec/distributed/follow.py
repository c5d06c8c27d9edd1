"""Rank 0's decisions on every rank: how `samplec serve` keeps the ranks of a vocabulary-sharded model in step.

Under `mlx.launch`, only rank 0 serves HTTP. Before each engine step it broadcasts a plan -- the requests to admit
(their bodies, as rank 0 received them, and the seeds rank 0 drew), the requests whose clients went away, or the
end -- and every rank then makes the same calls on its own batch generator in the same order. Each rank's model
gives its slice of every row's logits; the sampler call (`samplec.distributed.shard`) gives every rank the same
tokens, so the batches stay the same everywhere (docs/distributed.md, samplec serve).
"""
from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from samplec.diagnostics import SamplecError


def broadcast(payload: bytes | None, group) -> bytes:
    """Rank 0's `payload` on every rank of `group` (the other ranks pass None): two gathers, the length and then
    the bytes (every rank contributes the same shape; rank 0's row is the result)."""
    if group.rank() == 0 and payload is None:
        raise SamplecError("internal error: rank 0 broadcasts bytes, not None")
    data = np.frombuffer(payload, dtype=np.uint8) if group.rank() == 0 else np.zeros(0, dtype=np.uint8)
    n = mx.distributed.all_gather(mx.array([data.size], dtype=mx.int32)[None], group=group)
    size = int(np.array(n)[0, 0])
    mine = mx.array(data.astype(np.int32)) if group.rank() == 0 else mx.zeros((size,), dtype=mx.int32)
    if size == 0:
        return b""
    rows = mx.distributed.all_gather(mine[None], group=group)
    return np.array(rows)[0].astype(np.uint8).tobytes()


def send_plan(plan: dict, group) -> dict:
    """On rank 0: broadcast the plan (a JSON object); returns it."""
    broadcast(json.dumps(plan, separators=(",", ":")).encode(), group)
    return plan


def receive_plan(group) -> dict:
    """On the other ranks: rank 0's next plan."""
    return json.loads(broadcast(None, group).decode())
