"""Targets: which kernels run a program is decided at compilation, by the target pass after the stage passes.

| target | what a chain of stage ops becomes |
|---|---|
| `cpu` | the native chain kernel (one `chain` op per chain: samplec_native's primitive picks an algorithm per row) |
| `cuda` | the CUDA chain kernel where it covers the chain (`chain` ops), the portable lowering elsewhere |
| `metal` | the chain kernel's Metal build where it is asked for (SAMPLEC_METAL_KERNEL=1: `chain` ops for the chains it |
|          covers, as on `cuda`), else the portable lowering (`metal_kernel`) |
| `portable` | the portable lowering (samplec/passes/portable.py): one sort a chain, every cut a threshold on it; |
|          | the per-row values several kernels read made a level at a time (samplec/passes/pack.py); on the CPU a |
|          | chain of value cuts, the temperature and a draw runs on its row's 4096 largest values (`partitions()`) |
| `auto` | the device MLX runs on: `cpu` (the portable lowering where the native kernels are not installed or are
|          switched off), `cuda` on a CUDA GPU, `metal` on an Apple GPU |

`SAMPLEC_TARGET` overrides `auto`. -O0 is the spec's dense reading on every target: the target pass changes only
the stage ops the -O1/-O2 pipelines keep.
"""
from __future__ import annotations

import os

import mlx.core as mx

from samplec.diagnostics import SamplecError

TARGETS = ("auto", "cpu", "cuda", "metal", "portable")


def resolve(target: str | None = None) -> str:
    """The concrete target `target` names (None and "auto": SAMPLEC_TARGET, else the device MLX runs on)."""
    if target is None or target == "auto":
        target = os.environ.get("SAMPLEC_TARGET", "").strip().lower() or "auto"
        if target not in TARGETS:
            raise SamplecError(f"SAMPLEC_TARGET={target!r}: expected one of {', '.join(TARGETS)}")
    if target not in TARGETS:
        raise SamplecError(f"target {target!r}: expected one of {', '.join(TARGETS)}")
    if target != "auto":
        return target
    from samplec.backend_mlx import native
    if mx.default_device() == mx.cpu:
        return "cpu" if native.installed() and not native.switched_off("SAMPLEC_NATIVE") else "portable"
    return "cuda" if _cuda() else "metal"


def _cuda() -> bool:
    try:
        return bool(mx.cuda.is_available())
    except AttributeError:
        return False


def unavailable(target: str) -> str | None:
    """Why a program compiled for `target` cannot run here (None: it can)."""
    from samplec.backend_mlx import native
    gpu = mx.default_device() != mx.cpu
    if target == "cpu":
        if gpu:
            return f"MLX's default device is {mx.default_device()}, and the cpu target's kernels run on the CPU"
        if not native.installed():
            return "samplec's native CPU kernels are not installed (pip install ./native)"
    elif target == "cuda" and not (gpu and _cuda()):
        return f"MLX's default device is {mx.default_device()}, not a CUDA GPU"
    elif target == "metal" and not (gpu and mx.metal.is_available()):
        return f"MLX's default device is {mx.default_device()}, not an Apple GPU"
    return None


def lower(g, target: str, every_check: bool = False):
    """The target pass: the stage ops of g rewritten into what `target` runs. The portable lowering tests a check
    that a later one implies through that one (samplec.passes.checks), unless `every_check`."""
    from samplec.passes.chains import fuse_chains
    from samplec.passes.checks import cover_checks
    from samplec.passes.pack import pack_row_values
    from samplec.passes.portable import PLACES, lower_portable
    if target == "portable" or target == "metal" and not metal_kernel():
        places = PLACES if target == "portable" and not every_check and partitions() else 0
        return pack_row_values(lower_portable(g if every_check else cover_checks(g), check_ids=True, places=places))
    return fuse_chains(g, target)


def partitions() -> bool:
    """Whether the portable lowering runs a chain on candidates (a partition of the row) rather than a sort of the
    row: on the CPU, where a sort of 152064 floats costs ~17 ms and a partition ~2 ms -- not on a GPU, whose
    partition is a sort (nor where `kernels.GPU_SUMS` traces a program as a GPU runs it)."""
    from samplec.backend_mlx import kernels
    return mx.default_device() == mx.cpu and not kernels.GPU_SUMS


def metal_kernel() -> bool:
    """Whether the metal target hands chains to the chain kernel's Metal build: it is asked for
    (SAMPLEC_METAL_KERNEL=1: it has not run on Apple hardware) and, on an Apple GPU, it builds and answers its check
    (`gpu.metal_status`; elsewhere -- a program compiled here for a Mac -- the request alone decides)."""
    from samplec.backend_mlx import gpu
    if not gpu.metal_requested():
        return False
    return gpu.metal_status()[0] if gpu.apple_gpu() else True
