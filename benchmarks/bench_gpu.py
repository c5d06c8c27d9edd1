"""What the selections and the other vocabulary passes cost on a GPU, and whether the CUDA kernels agree with the
dense definitions -- the numbers behind docs/performance.md's GPU section.

    python benchmarks/bench_gpu.py [--json OUT.json]
    SAMPLEC_NATIVE=0 python benchmarks/bench_gpu.py --count     # kernel launches per call, any device
    python benchmarks/bench_gpu.py --calls     # whole calls: synchronous, queued, the host's share; any device
    python benchmarks/bench_gpu.py --issue [--quick] [--torch-device cuda]    # issue 33's figures (below)

--issue: every real chain of bench_real.py (its values, one per row at B > 1; token only), both logits families,
B in {1, 8, 64, 256}, each timed interleaved with `mx.max` over the same logits (one read of B x V floats: the
floor), and at B <= 8 with the peers that run the chain (Hugging Face's processors on --torch-device, mlx-lm's
sampler on MLX, one `mx.argmax` for greedy); then the targets met and missed. --quick: the chat family alone.

Not a test (tests/test_gpu.py checks the kernels where a CUDA device is present). On MLX's default device, V = 152064,
B in {1, 8, 64}, `chat`-like logits (bench_real's recipe), medians of many calls each evaluated and synchronized:
  * one MLX primitive over [B, V] (sort, argpartition, max, logsumexp, RandomBits for every token);
  * top_k's threshold (`kth_largest`, k = 40 and a per-row k) by the dense definition's 32 one-bit rounds, by the
    rounds of several bits a GPU takes (kernels._select_bits) and, on CUDA, by the radix-select kernel
    (samplec.backend_mlx.gpu), each compiled as a program would be;
  * top_p's threshold (`mass_threshold`) by the dense definition, one bit and the device's bits a round.
Before timing, the CUDA kernel's thresholds are compared bit for bit with the dense definition's on peaked, flat,
tied, -inf-heavy and short rows.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import samplec  # noqa: E402
from samplec.backend_mlx import gpu, kernels  # noqa: E402
from samplec.backend_mlx.rng import random_bits  # noqa: E402
from bench_real import chat_logits, chain_specs, confident_logits, interleaved  # noqa: E402

V = 152064


def median_ms(fn, reps=200, budget_s=1.5):
    for _ in range(5):
        mx.eval(fn())
    times = []
    t_end = time.perf_counter() + budget_s
    while len(times) < reps and (len(times) < 10 or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def dense_kth(x, want, bits=1):
    want = kernels._lift(want)
    return kernels._select(kernels._ordered(x), lambda above: mx.sum(above, axis=-1, keepdims=True) >= want,
                           bits=bits)


def dense_mass(key, w, target, bits=1):
    w, target = kernels._lift(w), kernels._lift(target)
    return kernels._select(kernels._ordered(key),
                           lambda above: kernels._reduce_sum([mx.where(above, w, 0.0)], {}) >= target, bits=bits)


def families(rng):
    yield "normal", rng.normal(0, 3, (8, 4096)).astype(np.float32)
    yield "ties", rng.integers(-3, 4, (8, 4096)).astype(np.float32)
    yield "neg_inf", np.where(rng.random((8, 4096)) < 0.9, -np.inf, rng.normal(0, 1, (8, 4096))).astype(np.float32)
    yield "flat", rng.normal(0, 1e-3, (8, 4096)).astype(np.float32)
    yield "zeros_signed", np.where(rng.random((4, 1000)) < 0.5, -0.0, 0.0).astype(np.float32)
    yield "short", rng.normal(0, 1, (3, 1)).astype(np.float32)
    yield "two", rng.normal(0, 1, (5, 2)).astype(np.float32)
    yield "chat", chat_logits(4, V, seed=3)


def check(rng) -> list[str]:
    bad = []
    for name, x in families(rng):
        B, n = x.shape
        xm = mx.array(x)
        for ks in ([1] * B, [n] * B, [min(40, n)] * B, list(rng.integers(1, n + 1, B))):
            want = mx.array(np.array(ks, dtype=np.int32)[:, None])
            got = gpu.kth_largest(xm, want)
            ref = dense_kth(xm, want)
            exp = -np.sort(-x, axis=-1)[np.arange(B), np.array(ks) - 1][:, None]
            if got is None:
                return ["the CUDA kernel did not apply"]
            g, r = np.array(got), np.array(ref)
            if not (np.array_equal(g.view(np.uint32), r.view(np.uint32)) or np.array_equal(g, r)) \
                    or not np.array_equal(g, exp):
                bad.append(f"{name} k={ks[:4]}: kernel {g.ravel()[:4]} dense {r.ravel()[:4]} numpy {exp.ravel()[:4]}")
    return bad


VIEWS = {"Squeeze", "Reshape", "ExpandDims", "Broadcast", "View"}


def launches(example: str, sampler: str, bits: int, B: int = 1) -> collections.Counter:
    """The MLX primitives one call of the example's -O2 program evaluates (`mx.export_to_dot` of its outputs), by
    kind, with the selections deciding `bits` key bits a round -- on a GPU, each one that is not a view is a kernel
    launch."""
    chosen = kernels._select_bits
    kernels._select_bits = lambda keys: bits
    try:
        prog = samplec.compile((ROOT / "examples" / example).read_text(), sampler=sampler)
        kw = {p.name: np.zeros((B, 64), np.int32) for p in prog.params if p.kind == "tokens"}
        outs, flags = prog.exe(*prog.prepare(mx.array(chat_logits(B, V, seed=1)), dict(seed=0, **kw)))
        with tempfile.TemporaryDirectory() as d:
            mx.export_to_dot(str(Path(d) / "g.dot"), *(outs + flags))
            text = (Path(d) / "g.dot").read_text()
    finally:
        kernels._select_bits = chosen
    kinds = re.findall(r'label ="?([A-Za-z]+)', text)
    return collections.Counter("Compiled (fused)" if k.startswith("Compiled") else k for k in kinds)


def count_launches():
    print("Primitives that are not views, one call of the -O2 program, V = 152064, B = 1")
    for example, sampler in (("mlx_lm_default.smp", "mlx_lm"), ("hf_generate.smp", "hf_generate"),
                             ("vllm.smp", "vllm")):
        row = []
        for bits in (1, 2, 4):
            n = sum(v for k, v in launches(example, sampler, bits).items() if k not in VIEWS)
            row.append(f"{bits} bit{'s' if bits > 1 else ''} a round {n:4d}")
        print(f"  {sampler:12s} " + "   ".join(row))


# Chains as servers run them: every value at run time, one per row (bench_real's values), each system's order.
CHAINS = {
    "mlx_lm": ("top_p(p) min_p(m) top_k(k) temperature(t) sample(seed)", "token, logprob"),
    "hf": ("temperature(t) top_k(k) top_p(p) sample(seed)", "token"),
    "vllm": ("temperature(t) top_k(k) top_p(p) min_p(m) sample(seed)", "token, logprob"),
    "llama_cpp": ("top_k(k) top_p(p) min_p(m) temperature(t) sample(seed)", "token"),
}


def chain_values(B: int, rng) -> dict:
    pick = lambda vals, one, cast: [cast(v) for v in rng.choice(vals, B)] if B > 1 else one    # noqa: E731
    return {"t": pick([0.0, 0.6, 0.8, 1.0], 0.8, float), "k": pick([0, 20, 40, 50], 40, int),
            "p": pick([0.8, 0.9, 0.95, 1.0], 0.95, float), "m": pick([0.0, 0.05, 0.1], 0.05, float),
            "seed": list(range(B))}


def stages(result: dict) -> None:
    """The chain kernel alone (gpu.sample_chain, one stage and a greedy draw), so that each stage's passes show."""
    print("\nthe chain kernel alone, V = 152064, chat rows (ms)")
    for B in (1, 64):
        x = mx.array(chat_logits(B, V, seed=B))
        seed, pos = mx.array(np.arange(B, dtype=np.uint64)), mx.array(np.full(B, 7, np.int32))
        f32 = lambda v: mx.array(np.full(B, v, np.float32))        # noqa: E731
        i32 = lambda v: mx.array(np.full(B, v, np.int32))          # noqa: E731
        cases = {"greedy": ([], "greedy", [], False), "sample": ([], "sample", [seed, pos], False),
                 "sample + logprob": ([], "sample", [seed, pos], True),
                 "temperature 0.8": (["temperature"], "greedy", [f32(0.8)], False),
                 "min_p 0.05": (["min_p"], "greedy", [f32(0.05)], False),
                 "top_k 40": (["top_k"], "greedy", [i32(40)], False),
                 "top_k 1000": (["top_k"], "greedy", [i32(1000)], False),
                 "top_p 0.9": (["top_p"], "greedy", [f32(0.9)], False),
                 "top_p 0.9, then sample": (["top_p"], "sample", [f32(0.9), seed, pos], False)}
        for name, (st, term, ps, lp) in cases.items():
            ms = median_ms(lambda: gpu.sample_chain(x, ps, st, term, lp)[0], reps=60, budget_s=0.5)
            result["rows"].append({"B": B, "case": f"kernel {name}", "ms": ms})
            print(f"  B = {B:2d} {name:24s} {ms:7.3f}")
        ms = median_ms(lambda: mx.max(x, axis=-1), reps=60, budget_s=0.5)
        result["rows"].append({"B": B, "case": "mx.max (a call's floor)", "ms": ms})
        print(f"  B = {B:2d} {'mx.max (a call floor)':24s} {ms:7.3f}")


def floor(result: dict) -> None:
    """Where a chain call's time goes at B = 1: MLX's own one-pass reductions, the chain kernel with its operands
    built once (greedy: two passes over the row) on the whole row and on a short one (the kernel's fixed cost), k
    calls queued before one evaluation (the GPU's time a call, without the host's wait), the whole
    gpu.sample_chain as a program calls it, and a program's whole call."""
    print("\nwhere a call's time goes, B = 1 (ms)")
    x = mx.array(chat_logits(1, V, seed=1))
    xs = x[:, :1024]
    mx.eval(xs)
    seed, pos = mx.array(np.arange(1, dtype=np.uint64)), mx.array(np.full(1, 7, np.int32))
    gpu.sample_chain(x, [], [], "greedy", False)
    kern = gpu._kernels["samplec_chain"]
    prog = samplec.compile("sampler s(seed: seed) -> token { sample(seed) }")

    def call(v, split=(0, 0)):
        """The kernel's greedy draw alone, its operands built once: one block a row, or split as sample_chain
        splits a B = 1 row of v's length."""
        ins = gpu.chain_inputs([], [], "greedy", False, 0, 1, split)
        return kern(inputs=[v, *ins], output_shapes=[(1,), (1,), (1, 1), (gpu.scratch_size(1, split),)],
                    output_dtypes=[mx.int32, mx.float32, mx.float32, mx.int32],
                    grid=(max(split[0], 1) * gpu.CHAIN_THREADS, 1, 1), threadgroup=(gpu.CHAIN_THREADS, 1, 1),
                    init_value=0 if split[0] else None)[0]

    def queued(k):
        def run():
            outs = []
            for _ in range(k):
                outs.append(call(x))
            return outs
        return run
    cases = {"mx.max": lambda: mx.max(x, axis=-1), "mx.argmax": lambda: mx.argmax(x, axis=-1),
             "mx.max, V = 1024": lambda: mx.max(xs, axis=-1),
             "kernel greedy, operands built": lambda: call(x),
             "kernel greedy, split": lambda: call(x, gpu.split_of(1, V)),
             "kernel greedy, V = 1024": lambda: call(xs),
             "kernel greedy x8 queued (/8)": queued(8),
             "a program: sample(seed), token only": lambda: prog(x, seed=[3]).token,
             "sample_chain greedy": lambda: gpu.sample_chain(x, [], [], "greedy", False)[0],
             "sample_chain sample": lambda: gpu.sample_chain(x, [seed, pos], [], "sample", False)[0]}
    for name, fn in cases.items():
        ms = median_ms(fn, reps=100, budget_s=0.6) / (8 if "x8" in name else 1)
        result["rows"].append({"B": 1, "case": f"floor {name}", "ms": ms})
        print(f"  {name:40s} {ms:7.3f}")


def chains(result: dict, dense: bool) -> None:
    """Each chain with the chain kernel (one block per row) and, with `dense`, the same program on the dense
    definitions (SAMPLEC_GPU_CHAIN=0; a cold NVRTC cache spends a minute or more compiling each), tokens compared
    first."""
    import os
    rng = np.random.default_rng(1)
    print("\nchains, V = 152064, run-time values (one per row at B > 1): chain kernel" +
          (" vs dense definitions" if dense else "") + " (ms)")
    for B in (1, 8, 64):
        x = mx.array(chat_logits(B, V, seed=B))
        kw = chain_values(B, rng)
        for name, (body, outs) in CHAINS.items():
            src = f"sampler s(t: float, k: int, p: float, m: float = 0.0, seed: seed) -> {outs} {{ {body} }}"
            progs = {}
            for mode in ("kernel", "dense") if dense else ("kernel",):
                os.environ["SAMPLEC_GPU_CHAIN"] = "1" if mode == "kernel" else "0"
                progs[mode] = samplec.compile(src)
                mx.eval(progs[mode](x, **kw).token)        # (traced under this setting)
            os.environ.pop("SAMPLEC_GPU_CHAIN")
            ms = {mode: median_ms(lambda: progs[mode](x, **kw).token, reps=100, budget_s=1.0) for mode in progs}
            row = {"B": B, "case": f"chain {name}", "ms": ms["kernel"]}
            line = f"  B = {B:2d} {name:10s} kernel {ms['kernel']:7.3f}"
            if dense:
                same = np.array_equal(np.array(progs["kernel"](x, **kw).token),
                                      np.array(progs["dense"](x, **kw).token))
                row.update(dense_ms=ms["dense"], same_tokens=bool(same))
                line += (f"  dense {ms['dense']:7.3f}  ({ms['dense'] / ms['kernel']:4.1f}x)  tokens "
                         f"{'equal' if same else 'DIFFER'}")
            result["rows"].append(row)
            print(line)


def calls(result: dict, only: str | None = None) -> None:
    """Where a whole program's call goes, per chain (run-time values; chat rows): one call evaluated and
    synchronized; eight queued (`Program.queue`) and evaluated together, per call -- the GPU's rate or the host's,
    whichever is slower; and the host's queueing alone (`queue`, nothing evaluated), per call. Where the queued
    rate is near the host's alone, the host is the cost; where near the synchronous call, the GPU is."""
    print("\nwhere a program's call goes (ms): synchronous / 8 queued, per call / the host's queueing alone, per call")
    for B in (1,) if only else (1, 8):
        x = mx.array(chat_logits(B, V, seed=B))
        hist = mx.array(np.random.default_rng(B).integers(0, V, (B, 64)).astype(np.int32))
        mx.eval(x, hist)
        kw = chain_values(B, np.random.default_rng(B))
        cases = {name: (f"sampler s(t: float, k: int, p: float, m: float = 0.0, seed: seed) -> {outs} {{ {body} }}",
                        kw) for name, (body, outs) in CHAINS.items()}
        cases["greedy + penalty"] = ("sampler s(h: tokens) -> token { penalties(h, repeat = 1.1) greedy() }",
                                     {"h": hist})
        cases["sample"] = ("sampler s(seed: seed) -> token { sample(seed) }", {"seed": kw["seed"]})
        for name, (src, args) in cases.items():
            if only and name != only:
                continue
            prog = samplec.compile(src)

            def queue(n):
                outs = []
                for _ in range(n):
                    o, checks = prog.queue(x, **args)
                    outs += o + [f for _, f in checks]
                return outs
            sync = median_ms(lambda: queue(1), reps=60, budget_s=0.5)
            q8 = median_ms(lambda: queue(8), reps=20, budget_s=0.5) / 8
            host = []
            for _ in range(20):
                t0 = time.perf_counter()
                outs = queue(8)
                host.append((time.perf_counter() - t0) / 8)
                mx.eval(outs)
            host_ms = statistics.median(host) * 1e3
            result["rows"].append({"B": B, "case": f"call {name}", "ms": sync, "queued_ms": q8, "host_ms": host_ms})
            print(f"  B = {B:2d} {name:18s} {sync:7.3f} / {q8:7.3f} / {host_ms:7.3f}")


TARGETS = "B = 1 <= 0.3 ms, >= 2x hf and mlx-lm; B = 8 >= 5x mlx-lm; B >= 64 <= 3x mx.max; greedy <= 2x mx.argmax"


def issue(result: dict, quick: bool, torch_device: str, batches=(1, 8, 64, 256), chains_only=None,
          json_out=None) -> None:
    """Issue 33's benchmarks (module docstring, --issue): one compact line a case, then the targets' verdicts."""
    import bench_real
    peers = {}
    for cls in (bench_real.HF, bench_real.MlxLm, bench_real.MxArgmax):
        try:
            peers[cls.name] = cls(torch_device) if cls is bench_real.HF else cls()
        except ImportError as e:
            print(f"[skip] {cls.name}: {e}")
    split = "off (SAMPLEC_GPU_SPLIT=0)" if os.environ.get("SAMPLEC_GPU_SPLIT", "1") in ("0", "off") else "on"
    print(f"\nissue 33: real chains, V = {V}, token only, ms (peer / samplec); split mode {split}; {TARGETS}")
    verdicts = []
    for family, make in (("chat", chat_logits),) + (() if quick else (("confident", confident_logits),)):
        for B in batches:
            x = make(B, V, seed=B)
            xm = mx.array(x)
            mx.eval(xm)
            specs, hist = chain_specs(B, np.random.default_rng(B))
            for name, spec in specs.items():
                if (name == "server" and B == 1) or (chains_only and name not in chains_only):
                    continue
                mine = bench_real.Samplec(2, per_row=B > 1, token_only=True)
                steps = {"samplec": mine.setup(spec, x, hist),
                         "mx.max": lambda i: np.array(mx.max(xm, axis=-1))}
                for pname in spec[4]:
                    if pname in peers and B <= 8:
                        steps[pname] = peers[pname].setup(spec, x, hist)
                ms = interleaved(steps, 0.12 if quick else 0.2, max_reps=200)
                me = ms["samplec"]
                ratio = {k: v / me for k, v in ms.items() if k != "samplec"}
                result["rows"].append({"issue": True, "family": family, "B": B, "chain": name, "ms": ms})
                print(f"  {family:9s} B = {B:3d} {name:11s} samplec {me:7.3f}  = {me / ms['mx.max']:4.1f}x mx.max  " +
                      "  ".join(f"{k} {v:.2f}x" for k, v in ratio.items() if k != "mx.max"), flush=True)
                if B == 1:
                    verdicts.append((f"{family} B=1 {name} <= 0.3 ms", me <= 0.3))
                for peer, want in (("hf", 2.0), ("mlx-lm", 5.0 if B == 8 else 2.0)):
                    if peer in ratio:
                        verdicts.append((f"{family} B={B} {name} >= {want:g}x {peer}", ratio[peer] >= want))
                if B >= 64:
                    verdicts.append((f"{family} B={B} {name} <= 3x mx.max", me <= 3 * ms["mx.max"]))
                if "mx.argmax" in ratio:
                    verdicts.append((f"{family} B={B} {name} <= 2x mx.argmax", ratio["mx.argmax"] >= 0.5))
                if json_out:         # (after each case: a run its time limit ends keeps what it measured)
                    Path(json_out).write_text(json.dumps(result, indent=1))
    met = [v for v, ok in verdicts if ok]
    missed = [v for v, ok in verdicts if not ok]
    result["targets"] = {"met": met, "missed": missed}
    print(f"targets met {len(met)} of {len(verdicts)}; missed: " + ("; ".join(missed) if missed else "none"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--count", action="store_true", help="only count the example chains' kernel launches")
    ap.add_argument("--dense", action="store_true", help="time each chain on the dense definitions too")
    ap.add_argument("--chains-only", action="store_true", help="only the kernel's check and the chains")
    ap.add_argument("--floor", action="store_true", help="only the kernel's check and a call's fixed costs")
    ap.add_argument("--calls", action="store_true",
                    help="only where whole programs' calls go: synchronous, queued, the host's share (any device)")
    ap.add_argument("--only", default=None, help="with --calls: one chain, B = 1 (for a profiler's per-kernel summary)")
    ap.add_argument("--issue", action="store_true", help="issue 33's figures: real chains at B = 1, 8, 64, 256")
    ap.add_argument("--quick", action="store_true", help="with --issue: the chat family alone, shorter timings")
    ap.add_argument("--torch-device", default="cuda", help="with --issue: where Hugging Face's processors run")
    ap.add_argument("--chains", default=None, help="with --issue: a comma-separated subset of bench_real's chains")
    ap.add_argument("--batches", default="1,8,64,256", help="with --issue: batch sizes")
    args = ap.parse_args()
    if args.issue:
        result = {"device": str(mx.default_device()), "kernels": gpu.available(), "rows": []}
        issue(result, args.quick, args.torch_device, tuple(int(b) for b in args.batches.split(",")),
              args.chains.split(",") if args.chains else None, args.json)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return
    if args.count:
        count_launches()
        return
    if args.calls:
        result = {"device": str(mx.default_device()), "kernels": gpu.available(), "rows": []}
        calls(result, args.only)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return
    print(f"MLX {mx.__version__} on {mx.default_device()}; CUDA kernels: {'on' if gpu.available() else 'off'}")
    rng = np.random.default_rng(0)
    result = {"device": str(mx.default_device()), "kernels": gpu.available(), "rows": []}
    if gpu.available():
        bad = check(rng)
        print("kernel vs dense definition vs numpy:", "all equal" if not bad else f"{len(bad)} MISMATCHES")
        for b in bad[:20]:
            print("  ", b)
        result["check"] = bad
        floor(result)
        if not args.floor:
            stages(result)
            chains(result, args.dense)
    if args.chains_only or args.floor:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return
    for B in (1, 8, 64):
        x = mx.array(chat_logits(B, V, seed=B))
        k40 = mx.array(np.full((B, 1), 40, dtype=np.int32))
        krow = mx.array(rng.integers(1, 200, (B, 1)).astype(np.int32))
        seed = mx.array(np.arange(B, dtype=np.uint64)[:, None])
        ids = mx.arange(V, dtype=mx.uint32)[None, :]
        pos = mx.array(np.full((B, 1), 7, dtype=np.uint32))
        w = mx.softmax(x, axis=-1)
        target = mx.array(np.full((B, 1), 0.9, dtype=np.float32))
        mx.eval(x, k40, krow, seed, w, target)
        wide = kernels._select_bits(x)
        dense_1 = mx.compile(lambda x, k: dense_kth(x, k, 1))
        dense_w = mx.compile(lambda x, k: dense_kth(x, k, wide))
        mass_1 = mx.compile(lambda key, w, t: dense_mass(key, w, t, 1))
        mass_w = mx.compile(lambda key, w, t: dense_mass(key, w, t, wide))
        rb_c = mx.compile(lambda s, i, p: random_bits(s, i, p))
        cases = {
            "sort": lambda: mx.sort(x, axis=-1),
            "argpartition(k=40)": lambda: mx.argpartition(-x, kth=39, axis=-1),
            "max": lambda: mx.max(x, axis=-1),
            "logsumexp": lambda: mx.logsumexp(x, axis=-1),
            "RandomBits [B, V]": lambda: rb_c(seed, ids, pos),
            "kth_largest k=40, dense, 1 bit a round": lambda: dense_1(x, k40),
            "kth_largest per-row k, dense, 1 bit a round": lambda: dense_1(x, krow),
            "mass_threshold p=0.9, dense, 1 bit a round": lambda: mass_1(x, w, target),
        }
        if wide > 1:
            cases[f"kth_largest k=40, dense, {wide} bits a round"] = lambda: dense_w(x, k40)
            cases[f"mass_threshold p=0.9, dense, {wide} bits a round"] = lambda: mass_w(x, w, target)
        if gpu.available():
            gk = mx.compile(gpu.kth_largest)
            cases["kth_largest k=40, CUDA radix select"] = lambda: gk(x, k40)
            cases["kth_largest per-row k, CUDA radix select"] = lambda: gk(x, krow)
        print(f"\nB = {B}, V = {V} (median ms)")
        for name, fn in cases.items():
            ms = median_ms(fn, budget_s=0.5)
            result["rows"].append({"B": B, "case": name, "ms": ms})
            print(f"  {name:46s} {ms:8.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
