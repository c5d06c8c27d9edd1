"""Launches of one call of each shipped example (and `samplec serve`'s chain) on the GPU targets, counted on a
machine without the GPU: the chain kernel stood in by one launch (samplec.backend_mlx.launches.chain_kernel_stood_in),
every MLX op beside it counted as `mx.export_to_dot` shows the call's lazy outputs, next to the portable target
(what a GPU without samplec's kernel runs); and the host's time to queue a call on the cuda target (`Program.queue`,
median of --reps: the traced call replayed), with the kernels stood in by dependency nodes on the inputs their
wrappers make (the replay makes those inputs, as on a device, where each kernel is one node with those inputs) and
without them (the stood-in kernels independent of their inputs: what makes the inputs is not replayed).

    python benchmarks/bench_launches.py                    # V = 152064, B = 1 and 8: under a minute

On a GPU each launch costs ~5-10 us of the device's time and ~1-4 us of the host's, whatever its work: the count is
the cost proxy where no GPU runs (docs/performance.md). The portable target's nodes are every primitive of the
call, views included: what the host replays to queue it (~0.5-1 us each on this machine's CPU). `metal` is the
metal target with SAMPLEC_METAL_KERNEL=1 (the chain kernel's Metal build, opt-in: it has not run on Apple
hardware).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("SAMPLEC_NATIVE", "0")       # (the portable target as a GPU traces it: no CPU primitive)
sys.path.insert(0, str(Path(__file__).parent))

import mlx.core as mx  # noqa: E402

import samplec  # noqa: E402
from bench_targets import V, arguments, chat_logits, examples, median_us  # noqa: E402
from samplec.backend_mlx import kernels  # noqa: E402
from samplec.backend_mlx.launches import call_primitives, chain_kernel_stood_in, launches  # noqa: E402


def gpu_call(src: str, name: str, target: str, B: int, x: mx.array, rng, reps: int) -> tuple[int, float, float]:
    """(launches, the host's median us to queue a call -- `Program.queue` replaying the traced call -- with the
    kernels' inputs made in the replay, and without)."""
    with chain_kernel_stood_in(target) as stood_in:
        prog = samplec.compile(src, name, target=target)
        kw = arguments(prog, B, rng)
        n = launches(call_primitives(prog, x, **kw)) + len(stood_in)
        with_inputs = median_us(lambda: prog.queue(x, **kw), reps)      # (queued, never evaluated)
    with chain_kernel_stood_in(target, inputs=False):
        prog = samplec.compile(src, name, target=target)
        prog.queue(x, **kw)
        return n, with_inputs, median_us(lambda: prog.queue(x, **kw), reps)


def main() -> None:
    import numpy as np
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=100, help="queue calls timed a row (the median is printed)")
    args = ap.parse_args()
    kernels.GPU_SUMS = True
    from samplec.serve import SERVER_CHAIN, TOP
    chains = [(p.name, name, p.read_text()) for p, name in examples()] + \
        [("samplec serve", "mlx_lm_server", SERVER_CHAIN.replace("TOP", str(TOP)))]
    print("| example | B | cuda: launches | cuda: queue us | cuda: queue us, inputs not made | "
          "metal (SAMPLEC_METAL_KERNEL=1): launches | portable: launches | portable: nodes |\n"
          "|---|---|---|---|---|---|---|---|")
    for B in [int(b) for b in args.batches.split(",")]:
        x = mx.array(chat_logits(B, V, seed=B))
        for where, name, src in chains:
            rng = np.random.default_rng(0)
            (cuda, queue_us, bare_us), (metal, _, _) = (gpu_call(src, name, t, B, x, rng, args.reps)
                                                        for t in ("cuda", "metal"))
            prog = samplec.compile(src, name, target="portable")
            counts = call_primitives(prog, x, **arguments(prog, B, rng))
            print(f"| {where}:{name} | {B} | {cuda} | {queue_us:.0f} | {bare_us:.0f} | {metal} | {launches(counts)} | "
                  f"{sum(counts.values())} |", flush=True)


if __name__ == "__main__":
    main()
