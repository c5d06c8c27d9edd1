"""Faults on a sharded call, each rank reporting what it saw in OUT/rank<r>.json ({"rank", "size", "events"}).

mode `mismatch` (under mlx.launch): slices with a gap, slices that overlap, different batch sizes, a parameter that
differs, a different program -- every rank gets the same error -- and then a good call, which still works, and
calls of a `sample()` without a seed (every rank must draw the same token).
mode `die`: the last rank exits before the second call; mode `hang`: the last rank sleeps instead of calling. The
others must get an error within their timeout (3 s), not hang; in mode `hang_exit` (on_timeout="exit") they end
with the error on stderr and exit status 70. (These are started one process per rank, not by mlx.launch, which ends
every rank once one exits.)
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings

import mlx.core as mx
import numpy as np

import samplec
from samplec.distributed import shard

SRC = "sampler s(seed: seed, t: float) -> token, logprob { top_k(20) top_p(0.9) temperature(t) sample(seed) }"


def main(out_dir: str, mode: str) -> None:
    mx.disable_compile()
    warnings.simplefilter("ignore", samplec.SamplecWarning)
    group = mx.distributed.init(strict=True, backend="ring")
    rank, n = group.rank(), group.size()
    last = rank == n - 1
    events: list = []

    def report():
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "size": n, "events": events}, f)

    prog = samplec.compile(SRC)
    sharded = shard(prog, group, timeout=60.0, on_timeout="exit" if mode == "hang_exit" else "raise")
    V, B = 100, 2
    x = np.random.default_rng(0).standard_normal((B, V)).astype(np.float32)
    cut = [V * r // n for r in range(n + 1)]
    lo, hi = cut[rank], cut[rank + 1]
    want = np.array(prog(x, seed=11, t=0.9).token).tolist()

    def call(label, logits, start, vocab=V, **kw):
        t0 = time.monotonic()
        try:
            out = sharded(logits, vocab_start=start, vocab_size=vocab, **{"seed": 11, "t": 0.9, **kw})
            events.append([label, "ok", np.array(out.token).tolist() == want, time.monotonic() - t0])
        except samplec.SamplecError as e:
            events.append([label, "error", str(e), time.monotonic() - t0])
        report()

    if mode == "mismatch":
        call("gap", x[:, lo:hi - (1 if last else 0)], lo)
        call("overlap", x[:, max(lo - 1, 0):hi], max(lo - 1, 0) if last else lo)
        call("batch", x[:1 if last else B, lo:hi], lo)
        call("param", x[:, lo:hi], lo, t=1.0 if last else 0.9)
        call("vocab", x[:, lo:hi], lo, vocab=V + 1 if last else V)
        other = shard(samplec.compile(SRC.replace("0.9", "0.8")) if last else prog, group, timeout=30.0)
        try:
            other(x[:, lo:hi], vocab_start=lo, vocab_size=V, seed=11, t=0.9)
            events.append(["program", "ok", None, 0])
        except samplec.SamplecError as e:
            events.append(["program", "error", str(e), 0])
        call("good", x[:, lo:hi], lo)
        # a sample() without a seed: each rank draws an OS seed, and the lowest rank's is used (the trailer would
        # report ranks whose tokens differ)
        fresh = shard(samplec.compile("sampler s() -> token, logprob { top_k(50) sample() }"), group, timeout=30.0,
                      on_timeout="raise")
        try:
            toks = [np.array(fresh(x[:, lo:hi], vocab_start=lo, vocab_size=V).token).tolist() for _ in range(3)]
            events.append(["os_seed", "ok", toks, 0])
        except samplec.SamplecError as e:
            events.append(["os_seed", "error", str(e), 0])
    else:
        call("good", x[:, lo:hi], lo)
        sharded.watchdog.timeout = 3.0          # (the first call may be slow on a loaded machine; the rest wait 3 s)
        if last:
            report()
            if mode == "die":
                os._exit(0)
            time.sleep(60)
        call("after", x[:, lo:hi], lo)
        call("again", x[:, lo:hi], lo)
    report()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
