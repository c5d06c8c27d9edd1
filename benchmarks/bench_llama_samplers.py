"""llama.cpp's other samplers against llama.cpp itself: XTC switched on, dynamic temperature (`--dynatemp-range`),
mirostat (`--mirostat 1`) and mirostat v2 (`--mirostat 2`), each in the chain llama.cpp's common/sampling.cpp builds
for it, with samplec's program of the same stages in the same order (its values passed at run time).

    pip install -e ".[bench]" ./native llama-cpp-python
    python benchmarks/bench_llama_samplers.py [--batch 1 8] [--rounds 30]

Peer: llama-cpp-python's `llama_sampler_*` (llama.cpp's C++ samplers, no model), one chain per row on a token-data
array of the whole vocabulary, as llama.cpp samples. Logits: bench_real.py's recipes (`chat`: a Zipf head and a
1-30% tail; `confident`), V = 152064. Times are medians of interleaved rounds (both in every round, in a shuffled
order); the ratio is llama.cpp / samplec. Not a test: tests/test_native.py checks these programs' tokens against
-O0 and the numpy reference.
"""
from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np

import samplec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_real import chat_logits, confident_logits  # noqa: E402

V = 152064
HIST = 64
PEN = "penalties(h, last_n = 64, repeat = 1.1)"
DEFAULT = f"{PEN} top_k(40) typical_p(1.0) top_p(0.95) min_p(0.05) xtc(0.1, xp, seed, position = 7)"
# name -> (samplec body, its run-time values, llama.cpp's samplers as (name, args))
CHAINS = {
    "default, XTC on (0.1, 0.5)": (
        f"{DEFAULT} temperature(t) sample(seed, position = 7)", dict(xp=0.5, t=0.8),
        [("penalties", ()), ("top_k", (40,)), ("top_p", (0.95, 1)), ("min_p", (0.05, 1)), ("xtc", (0.1, 0.5)),
         ("temp", (0.8,))]),
    "default, dynatemp 0.5": (
        f"{DEFAULT} dynamic_temperature(t, dr) sample(seed, position = 7)", dict(xp=0.0, t=0.8, dr=0.5),
        [("penalties", ()), ("top_k", (40,)), ("top_p", (0.95, 1)), ("min_p", (0.05, 1)),
         ("temp_ext", (0.8, 0.5, 1.0))]),
    "mirostat (v1)": ("temperature(t) mirostat(mu, 5.0, 0.1, 100, seed, position = 7)", dict(t=0.8),
                      [("temp", (0.8,)), ("mirostat", (5.0, 0.1, 100))]),
    "mirostat v2": ("temperature(t) mirostat_v2(mu, 5.0, 0.1, seed, position = 7)", dict(t=0.8),
                    [("temp", (0.8,)), ("mirostat_v2", (5.0, 0.1))]),
}


class LlamaCpp:
    def __init__(self, x: np.ndarray, hist: np.ndarray, samplers):
        import llama_cpp as ll
        self.ll, self.x = ll, x
        B = x.shape[0]
        n_pen = len(ll.llama_sampler_init_penalties.argtypes)
        self.chains = []
        for b in range(B):
            c = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
            drawn = False
            for name, a in samplers:
                if name == "penalties":
                    s = ll.llama_sampler_init_penalties(*((V,) if n_pen == 5 else ()), HIST, 1.1, 0.0, 0.0)
                elif name == "top_k":
                    s = ll.llama_sampler_init_top_k(*a)
                elif name == "top_p":
                    s = ll.llama_sampler_init_top_p(*a)
                elif name == "min_p":
                    s = ll.llama_sampler_init_min_p(*a)
                elif name == "xtc":
                    s = ll.llama_sampler_init_xtc(a[0], a[1], 1, 100 + b)
                elif name == "temp":
                    s = ll.llama_sampler_init_temp(*a)
                elif name == "temp_ext":
                    s = ll.llama_sampler_init_temp_ext(*a)
                elif name == "mirostat":
                    s, drawn = ll.llama_sampler_init_mirostat(V, 100 + b, *a), True
                else:
                    s, drawn = ll.llama_sampler_init_mirostat_v2(100 + b, *a), True
                ll.llama_sampler_chain_add(c, s)
            if not drawn:
                ll.llama_sampler_chain_add(c, ll.llama_sampler_init_dist(100 + b))
            for t in hist[b]:
                ll.llama_sampler_accept(c, int(t))
            self.chains.append(c)
        self.buf = np.zeros(V, np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]))
        self.ids = np.arange(V, dtype=np.int32)
        self.ptr = self.buf.ctypes.data_as(ctypes.POINTER(ll.llama_token_data))

    def __call__(self):
        out = []
        for b, c in enumerate(self.chains):
            self.buf["id"] = self.ids
            self.buf["logit"] = self.x[b]
            cur = self.ll.llama_token_data_array(data=self.ptr, size=V, selected=-1, sorted=False)
            self.ll.llama_sampler_apply(c, ctypes.byref(cur))
            out.append(cur.data[cur.selected].id)
        return out

    def close(self):
        for c in self.chains:
            self.ll.llama_sampler_free(c)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    print(f"MLX {mx.__version__} on {mx.default_device()}; ms, medians of {args.rounds} interleaved rounds")
    print(f"{'logits':9s} {'B':>2s} {'chain':28s} {'llama.cpp':>10s} {'samplec':>9s}  ratio")
    for family, make in (("chat", chat_logits), ("confident", confident_logits)):
        for B in args.batch:
            x = make(B, V, seed=B)
            xm = mx.array(x)
            hist = np.random.default_rng(B).integers(0, V, (B, HIST)).astype(np.int32)
            for name, (body, vals, samplers) in CHAINS.items():
                params = ["h: tokens", "seed: seed", "mu: state"] + [f"{k}: float" for k in vals]
                prog = samplec.compile(f"sampler s({', '.join(params)}) -> token {{ {body} }}")
                kw = {k: [v] * B for k, v in vals.items()} | dict(h=mx.array(hist), seed=list(range(B)))
                peer = LlamaCpp(x, hist, samplers)
                mine = lambda: mx.eval(prog(xm, **kw).token)      # noqa: E731
                for _ in range(3):
                    peer(), mine()
                times = {peer: [], mine: []}
                for _ in range(args.rounds):
                    for f in random.sample(list(times), 2):
                        t0 = time.perf_counter()
                        f()
                        times[f].append(time.perf_counter() - t0)
                a, b = (statistics.median(times[f]) * 1e3 for f in (peer, mine))
                print(f"{family:9s} {B:2d} {name:28s} {a:10.3f} {b:9.3f}  {a / b:5.1f}x", flush=True)
                peer.close()


if __name__ == "__main__":
    main()
