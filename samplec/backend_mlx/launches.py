"""What one call hands MLX: the primitives of its lazy outputs (`mx.export_to_dot`), by kind.

On a GPU each primitive that is not a view is a kernel launch (~5-10 us each on an Apple GPU or CUDA), and the
host replays each node of a compiled call (~1-4 us each): the count is the GPU's cost proxy on a machine without
one. `kernels.GPU_SUMS` makes the portable lowering's sums count as a GPU runs them (one reduction each).
"""
from __future__ import annotations

import collections
import contextlib
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
    """The primitives of a repeated call of `prog` (its outputs and its checks' flags), without evaluating it: the
    call a decode loop or a server makes each step (`Program.queue`'s short path, where the arguments' checks are
    traced with the graph; a first call of a shape takes the full path once)."""
    prog.queue(logits, **params)
    before = len(_stood_in) if _stood_in is not None else 0
    read = len(_reads)
    outs, checks = prog.queue(logits, **params)
    if _stood_in is not None and len(_stood_in) > before:   # (the repeated call was traced: its own kernels)
        del _stood_in[:before]
        del _reads[:read]
    return primitives(outs + [f for _, f in checks] + (_reads if _stood_in is not None else []))


_stood_in: list[str] | None = None      # the kernels `chain_kernel_stood_in` stood in for, while it is active
_reads: list[mx.array] = []             # ... and the inputs they were given (what computes them is the call's too)


@contextlib.contextmanager
def chain_kernel_stood_in(target: str = "cuda"):
    """A GPU target's calls traced on a machine without the GPU: the device faked where the target pass and the
    interpreter ask, the chain kernel (gpu.sample_chain) and the radix select (gpu.kth_largest) stood in by evaluated
    placeholders of their outputs -- shaped as theirs, computed before the call, so no primitive of the call's graph
    -- and counted in `stood_in` (the kernels beside it, gpu.top_logprobs and gpu.dry, too; by `call_primitives`:
    the counted call's), the inputs each would read made as the kernel's wrapper makes them and counted with the
    call's graph (what packs or computes them is launched by the call; counted as traced, before MLX's compile fuses
    them with their neighbours: a bound from above). A call's launches on that GPU are then
    `launches(call_primitives(...))` plus `len(stood_in)`: the MLX ops the kernel leaves beside it, and one launch
    each for the kernels. (The kernel declines what gpu.chain_inputs declines, as on the device.)"""
    import samplec.passes.target as passes_target
    from samplec.backend_mlx import gpu
    stood_in: list[str] = []

    def placeholder(*shapes_dtypes):
        out = [mx.zeros(s, dtype=d) for s, d in shapes_dtypes]
        mx.eval(out)
        return out

    def stand_in(name: str, inputs: list) -> None:
        stood_in.append(name)
        _reads.extend(inputs)

    def sample_chain(x, params, stages, terminal, want_logprob, out_x=0, edits=(), raw=False):
        B, V = x.shape
        inputs = gpu.chain_inputs(params, stages, terminal, want_logprob, out_x, B, (0, 0), tuple(edits), V, raw)
        if inputs is None:
            return None
        stand_in("chain", [x, *inputs])
        n_pen = sum(kind == "penalties" for kind, _ in edits)
        return tuple(placeholder(((B, 1), mx.int32), ((B, 1), mx.float32),
                                 *([((B, V), mx.float32)] if out_x else []),
                                 *([((B, n_pen), mx.bool_)] if n_pen else []),
                                 *([((B, 1), mx.float32)] if edits else []),
                                 *([((B, 1), mx.float32)] * 3 if raw else [])))

    def kth_largest(x, want):
        stand_in("kth_largest", [x])
        return placeholder(((x.shape[0], 1), mx.float32))[0]

    def top_logprobs(x, m, lz, k, margin):
        stand_in("top_logprobs", [x, m, lz])
        return tuple(placeholder(((x.shape[0], k), mx.int32), ((x.shape[0], k), mx.float32)))

    def dry(x, h, *values):
        inputs = gpu.dry_inputs(x, h, *values)
        if inputs is None:
            return None
        stand_in("dry", inputs)
        return placeholder((x.shape, mx.float32))[0]

    global _stood_in
    _stood_in = stood_in
    names = ("available", "metal_status", "metal_requested", "apple_gpu", "sample_chain", "kth_largest",
             "top_logprobs", "dry")
    saved = [getattr(gpu, n) for n in names] + [passes_target.unavailable]
    gpu.available = (lambda: True) if target == "cuda" else (lambda: False)
    gpu.metal_status = (lambda: (target == "metal", "stood in"))
    gpu.metal_requested = gpu.apple_gpu = (lambda: target == "metal")
    gpu.sample_chain, gpu.kth_largest, gpu.top_logprobs, gpu.dry = \
        sample_chain, kth_largest, top_logprobs, dry
    passes_target.unavailable = lambda t: None
    try:
        yield stood_in
    finally:
        _stood_in = None
        _reads.clear()
        for n, f in zip(names, saved):
            setattr(gpu, n, f)
        passes_target.unavailable = saved[-1]
