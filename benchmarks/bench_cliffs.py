"""Cliffs: chains that a sweep (benchmarks/bench_sweep.py) or a review once found running far slower than the same
chain on easy logits or with literal values, kept as a guard against their return. One median of 21 calls per chain, V = 152064,
B = 1 and 8, the logits family where the cliff was; tokens only. Run it with two builds (the A/B recipe in
docs/performance.md) and compare the columns; it prints JSON {"B|chain|family": ms}.

    python benchmarks/bench_cliffs.py > new.json
"""
from __future__ import annotations

import json
import sys
import time

import mlx.core as mx
import numpy as np

from pathlib import Path

import samplec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_real import chat_logits, confident_logits, flat_logits, ties_logits  # noqa: E402

CASES = [  # (label, body, params, family)
 ("top_p, dry(h, 0), temperature (literals)", "top_p(0.9) dry(h, 0.0) temperature(0.7) sample(seed)", {}, "chat"),
 ("top_n_sigma", "top_n_sigma(n) sample(seed)", dict(n=2.0), "confident"),
 ("top_p, top_n_sigma", "top_p(p) top_n_sigma(n) sample(seed)", dict(p=0.5, n=2.0), "flat"),
 ("top_k, typical_p", "top_k(k) typical_p(m) sample(seed)", dict(k=40, m=0.5), "confident"),
 ("typical_p", "typical_p(m) sample(seed)", dict(m=0.9), "chat"),
 ("temperature, top_p (tied top)", "temperature(t) top_p(p) sample(seed)", dict(t=0.3, p=0.856), "ties"),
 ("allow, min_p, top_p, top_k, temperature, greedy",
  "allow(mk) min_p(q) top_p(p) top_k(k) temperature(t) greedy()", dict(q=0.08, p=0.735, k=78, t=1.344), "flat"),
 ("eta", "eta(e) sample(seed)", dict(e=0.002), "chat"),
 ("top_p, epsilon at off values", "top_p(p) epsilon(e) sample(seed)", dict(p=1.0, e=0.0), "chat"),
 ("temperature, eta, top_p", "temperature(t) eta(e) top_p(p) sample(seed)", dict(t=0.7, e=0.002, p=0.9), "chat"),
 ("typical_p, top_k, greedy (per-row lists)", "typical_p(m) top_k(k) greedy()", dict(m=0.575, k=119), "confident"),
]
FAM = dict(confident=confident_logits, chat=chat_logits, flat=flat_logits, ties=ties_logits)


def main():
    out = {}
    V = 152064
    rng = np.random.default_rng(0)
    for B in (1, 8):
        xs = {k: mx.array(f(B, V)) for k, f in FAM.items()}
        h = mx.array(rng.integers(0, V, (B, 64)).astype(np.int32))
        mk = mx.array(rng.random((B, V)) < 0.5)
        for label, body, kw, fam in CASES:
            types = {"k": "int"}
            decl = [f"{k}: {types.get(k, 'float')}" for k in kw] + ["seed: seed"]
            decl += (["h: tokens"] if "(h" in body else []) + (["mk: mask"] if "mk" in body else [])
            decl = ", ".join(decl)
            p = samplec.compile(f"sampler s({decl}) -> token {{ {body} }}")
            args = {k: [v] * B for k, v in kw.items()}
            if "(h" in body: args["h"] = h
            if "mk" in body: args["mk"] = mk
            args["seed"] = list(range(B))
            x = xs[fam]
            for _ in range(3): mx.eval(p(x, **args).token)
            ts = []
            for _ in range(21):
                a = time.perf_counter(); mx.eval(p(x, **args).token); ts.append(time.perf_counter() - a)
            out[f"{B}|{label}|{fam}"] = sorted(ts)[10] * 1e3
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
