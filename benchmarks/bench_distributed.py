"""A program on a vocabulary split over ranks: `samplec.distributed.shard` against all-gathering the logits and
running the program on the whole row, in the same run. Per call: bytes each rank sends, gathers, time.

Run under mlx.launch (the ring backend on loopback here), e.g.

    mlx.launch -n 2 --backend ring -- python benchmarks/bench_distributed.py
    mlx.launch -n 4 --backend ring -- python benchmarks/bench_distributed.py --json docs/bench_distributed_n4.json

Rank 0 prints one line per (program, V, B); the two ways' tokens are checked equal on every call.
"""
from __future__ import annotations

import argparse
import json
import time
import warnings

import mlx.core as mx
import numpy as np

import samplec
from samplec.distributed import shard

PROGRAMS = {
    "sample": "sampler s(seed: seed) -> token { sample(seed) }",
    "top_p": "sampler s(seed: seed) -> token, logprob { top_p(0.9) temperature(0.8) sample(seed) }",
    "llama_cpp": "sampler s(seed: seed, h: tokens) -> token, logprob { penalties(h, last_n = 64, repeat = 1.1) "
                 "top_k(40) top_p(0.95) min_p(0.05) temperature(0.8) sample(seed) }",
}


def gathered(group, prog, x_local: mx.array, widths: list[int], **params):
    """The baseline: every rank all-gathers the logits (padded to the widest slice) and runs the program."""
    pad = max(widths) - x_local.shape[-1]
    if pad:
        x_local = mx.concatenate([x_local, mx.zeros((x_local.shape[0], pad))], axis=-1)
    g = mx.distributed.all_gather(x_local[None], group=group)
    x = mx.concatenate([g[r][:, :widths[r]] for r in range(len(widths))], axis=-1)
    return prog(x, **params), x_local.size * 4


def timed(fn, reps: int):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 152064])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--scale", type=float, default=3.0,
                    help="logits ~ N(0, scale^2): 3 gives a wide nucleus (thousands of tokens), 8 a peaked row")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    warnings.simplefilter("ignore", samplec.SamplecWarning)
    group = mx.distributed.init()
    rank, n = group.rank(), group.size()
    rows = []
    if rank == 0:
        print(f"ranks N = {n}; logits N(0, {args.scale:g}^2); per call: bytes each rank sends, gathers, median time "
              f"of {args.reps} calls")
        print(f"{'program':<10} {'V':>7} {'B':>2} | {'shard bytes':>11} {'gathers':>7} {'ms':>7} | "
              f"{'all-gather bytes':>16} {'ms':>7} | bytes ratio  time ratio")
    for V in args.vocab:
        cuts = [V * r // n for r in range(n + 1)]
        widths = [cuts[r + 1] - cuts[r] for r in range(n)]
        lo, hi = cuts[rank], cuts[rank + 1]
        for B in args.batch:
            rng = np.random.default_rng(B)
            x = (rng.standard_normal((B, V)) * args.scale).astype(np.float32)
            hist = rng.integers(0, V, (B, 64)).astype(np.int32)
            x_local = mx.array(x[:, lo:hi])
            for name, src in PROGRAMS.items():
                prog = samplec.compile(src)
                sp = shard(prog, group)
                params = {"seed": 7, **({"h": hist} if "h: tokens" in src else {})}
                mine, t_shard = timed(lambda: sp(x_local, vocab_start=lo, vocab_size=V, **params), args.reps)
                sent = sp.last_call["sent_bytes"]
                (theirs, sent_all), t_all = timed(lambda: gathered(group, prog, x_local, widths, **params),
                                                  args.reps)
                if np.array(mine.token).tolist() != np.array(theirs.token).tolist():
                    raise SystemExit(f"{name} V={V} B={B}: the sharded tokens differ from the gathered ones")
                row = {"program": name, "V": V, "B": B, "N": n, "scale": args.scale, "shard_bytes": sent,
                       "gathers": sp.last_call["gathers"], "shard_ms": t_shard * 1e3,
                       "allgather_bytes": sent_all, "allgather_ms": t_all * 1e3}
                rows.append(row)
                if rank == 0:
                    print(f"{name:<10} {V:>7} {B:>2} | {sent:>11} {row['gathers']:>7} {t_shard * 1e3:>7.2f} | "
                          f"{sent_all:>16} {t_all * 1e3:>7.2f} | {sent_all / sent:>10.0f}x  {t_all / t_shard:>9.2f}x",
                          flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
