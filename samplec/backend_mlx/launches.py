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
VIEWS = frozenset({"Squeeze", "Reshape", "ExpandDims", "Broadcast", "View", "Slice", "Transpose", "AsStrided",
                   "Depends"})


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
    outs, checks = prog.queue(logits, **params)
    if _stood_in is not None and len(_stood_in) > before:   # (the repeated call was traced: its own kernels)
        del _stood_in[:before]
    return primitives(outs + [f for _, f in checks])


_stood_in: list[str] | None = None      # the kernels `chain_kernel_stood_in` stood in for, while it is active


@contextlib.contextmanager
def chain_kernel_stood_in(target: str = "cuda", inputs: bool = True):
    """A GPU target's calls traced on a machine without the GPU: the device faked where the target pass and the
    interpreter ask, the chain kernel (gpu.sample_chain) and the radix select (gpu.kth_largest) stood in by evaluated
    placeholders of their outputs -- shaped as theirs, computed before the call, so no primitive of the call's graph
    -- and counted in `stood_in` (the kernels beside it, gpu.top_logprobs and gpu.dry, too; by `call_primitives`:
    the counted call's), each placeholder depending on the inputs the kernel would read, made as its wrapper makes
    them (`mx.depends`: no computation), so that what packs or computes them counts with the call's graph as MLX
    compiles it (`inputs=False`: placeholders independent of those inputs, whose making then drops out of the call's
    replay -- the host's time without it). A call's launches on that GPU are then
    `launches(call_primitives(...))` plus `len(stood_in)`: the MLX ops the kernel leaves beside it, and one launch
    each for the kernels. (The kernel declines what gpu.chain_inputs declines, as on the device.)"""
    import samplec.passes.target as passes_target
    from samplec.backend_mlx import gpu
    stood_in: list[str] = []

    def placeholder(*shapes_dtypes, reads: list = ()):
        out = [mx.zeros(s, dtype=d) for s, d in shapes_dtypes]
        mx.eval(out)
        return mx.depends(out, list(reads)) if reads and inputs else out

    def sample_chain(x, params, stages, terminal, want_logprob, out_x=0, edits=(), raw=False):
        B, V = x.shape
        inputs = gpu.chain_inputs(params, stages, terminal, want_logprob, out_x, B, (0, 0), tuple(edits), V, raw)
        if inputs is None:
            return None
        stood_in.append("chain")
        n_pen = sum(kind == "penalties" for kind, _ in edits)
        return tuple(placeholder(((B, 1), mx.int32), ((B, 1), mx.float32),
                                 *([((B, V), mx.float32)] if out_x else []),
                                 *([((B, n_pen), mx.bool_)] if n_pen else []),
                                 *([((B, 1), mx.float32)] if edits else []),
                                 *([((B, 1), mx.float32)] * 3 if raw else []), reads=[x, *inputs]))

    def kth_largest(x, want):
        stood_in.append("kth_largest")
        return placeholder(((x.shape[0], 1), mx.float32), reads=[x])[0]

    def top_logprobs(x, m, lz, k, margin):
        stood_in.append("top_logprobs")
        return tuple(placeholder(((x.shape[0], k), mx.int32), ((x.shape[0], k), mx.float32), reads=[x, m, lz]))

    def dry(x, h, *values):
        inputs = gpu.dry_inputs(x, h, *values)
        if inputs is None:
            return None
        stood_in.append("dry")
        return placeholder((x.shape, mx.float32), reads=inputs)[0]

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
        for n, f in zip(names, saved):
            setattr(gpu, n, f)
        passes_target.unavailable = saved[-1]
