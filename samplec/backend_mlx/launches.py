"""What one call hands MLX: the primitives of its lazy outputs (`mx.export_to_dot`), by kind.

On a GPU each primitive that is not a view is a kernel launch (~5-10 us each on an Apple GPU or CUDA), and the
host replays each node of a compiled call (~1-4 us each): the count is the GPU's cost proxy on a machine without
one. `kernels.GPU_SUMS` makes the portable lowering's sums count as a GPU runs them (one reduction each).
"""
from __future__ import annotations

import collections
import re
import tempfile
from pathlib import Path

import mlx.core as mx

# primitives that are views of their input (no kernel of their own on any device)
VIEWS = frozenset({"Squeeze", "Reshape", "ExpandDims", "Broadcast", "View", "Slice", "Transpose", "AsStrided"})


def primitives(arrays: list[mx.array]) -> collections.Counter:
    """The primitives that computing `arrays` evaluates, by kind (fused kernels as "Compiled")."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "g.dot"
        mx.export_to_dot(str(path), *arrays)
        text = path.read_text()
    kinds = re.findall(r'label ="?([A-Za-z]+)', text)
    return collections.Counter("Compiled" if k.startswith("Compiled") else k for k in kinds)


def launches(counts: collections.Counter) -> int:
    """The primitives that are not views: the kernel launches of a call on a GPU."""
    return sum(n for kind, n in counts.items() if kind not in VIEWS)


def call_primitives(prog, logits, **params) -> collections.Counter:
    """The primitives of one call of `prog` (its outputs and its checks' flags), without evaluating it."""
    outs, checks = prog.queue(logits, **params)
    return primitives(outs + [f for _, f in checks])
