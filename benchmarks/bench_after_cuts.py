"""Chains whose stages end without a draw: a cut before an allow (a grammar mask applied after top_p), a
logit_bias, the penalties or DRY, and a chain with no terminal (`-> probs`). Parameters at run time, one value
per row; `chat` logits (bench_real's recipe), V = 152064, B = 1 and 8; medians of 15 calls after a warm-up, -O2
beside -O0 in one process (-O0 is every stage's dense definition: what -O2 would run for these chains without the
chain kernel). Not a timed test: read the ratio within one run.

    python benchmarks/bench_after_cuts.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import samplec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_real import chat_logits  # noqa: E402

V = 152064
CHAINS = {
    "top_p -> allow": ("sampler s(p: float, mk: mask, seed: seed) -> token "
                       "{ top_p(p) allow(mk) sample(seed, position = 7) }",
                       lambda B, r: dict(p=[0.9] * B, mk=r.random((B, V)) < 0.5)),
    "min_p, top_p -> bias": ("sampler s(m: float, p: float, seed: seed) -> token { min_p(m) top_p(p) "
                             "logit_bias({2: -inf, 99736: 5.0, 151378: 10.0}) sample(seed, position = 7) }",
                             lambda B, r: dict(m=[0.05] * B, p=[0.9] * B)),
    "top_k, top_p -> probs": ("sampler s(p: float) -> probs { top_k(50) top_p(p) }", lambda B, r: dict(p=[0.9] * B)),
    "top_p -> dry": ("sampler s(p: float, h: tokens, seed: seed) -> token, logprob "
                     "{ top_p(p) dry(h, 0.8) sample(seed, position = 7) }",
                     lambda B, r: dict(p=[0.9] * B, h=r.integers(0, V, (B, 512)).astype(np.int32))),
    "top_k -> penalties": ("sampler s(k: int, h: tokens, seed: seed) -> token "
                           "{ top_k(k) penalties(h, repeat = 1.2) top_p(0.9) sample(seed, position = 7) }",
                           lambda B, r: dict(k=[40] * B, h=r.integers(0, V, (B, 64)).astype(np.int32))),
}


def median_ms(prog, x, kw, reps=15):
    def once():
        out = prog(x, **kw)
        mx.eval(out.token if getattr(out, "token", None) is not None else out.probs)
    once()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        once()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def main():
    print("| B | chain | -O2 ms | -O0 ms | -O0 / -O2 |\n|---|---|---|---|---|")
    for B in (1, 8):
        x = mx.array(chat_logits(B, V))
        mx.eval(x)
        for name, (src, make) in CHAINS.items():
            kw = make(B, np.random.default_rng(1))
            if "seed" in src:
                kw["seed"] = list(range(B))
            progs = {o: samplec.compile(src, opt_level=o) for o in (2, 0)}
            outs = [progs[o](x, **kw) for o in (2, 0)]
            same = all(np.array_equal(np.array(getattr(outs[0], k)), np.array(getattr(outs[1], k)))
                       for k in ("token",) if getattr(outs[0], k, None) is not None)
            assert same, f"-O2 and -O0 tokens differ on {name}"
            t2, t0 = median_ms(progs[2], x, kw), median_ms(progs[0], x, kw)
            print(f"| {B} | {name} | {t2:.2f} | {t0:.2f} | {t0 / t2:.0f}x |", flush=True)


if __name__ == "__main__":
    main()
