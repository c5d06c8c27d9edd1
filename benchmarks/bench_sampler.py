"""Sampler benchmark: samplec against its peers, in one process, on the same logits.

    pip install -e ".[bench]"              # mlx-lm, torch==2.13.0 + transformers, llama-cpp-python, matplotlib
    python benchmarks/bench_sampler.py --quick      # V = 152064, B in {1, 8}: under two minutes
    python benchmarks/bench_sampler.py              # V in {32000, 152064, 262144}, B in {1, 8, 64}

Peers: samplec -O2 and -O0; mlx-lm's `make_sampler` (+ `make_logits_processors` for the penalty); Hugging Face
logits processors + `torch.multinomial`; a straightforward MLX composition (full sort + cumsum for top_p, as the
ExecuTorch MLX sampler lowers it); llama.cpp's own sampler chain through llama-cpp-python's `llama_sampler_*` API on
a token-data array. A peer that is not installed is skipped and says so. Each time is the median wall time of one
full call (for lazy frameworks: until the token is on the host). samplec -O2 and llama.cpp, the two closest, are
timed in interleaved rounds (one call each per round) so that a burst of load on a shared machine hits both alike;
the other peers one after the other (interleaving with torch, whose idle worker threads keep spinning, would
measure contention for the two cores rather than the samplers). Ratios are a peer's time divided by samplec
-O2's in the same run. The run checks as it goes that samplec -O2 gives the tokens of -O0 for the same seeds.

Logits: a heavy tail N(0, 1) over the vocabulary plus a Zipf-like head of 64 strong tokens (token i of the head
gets 10 + 12 / i**0.5), fixed seed -- the shape of a confident LLM step. `--flat` uses N(0, 2) with a weak head
(a high-entropy step), where the chain kernel goes past its candidates more often.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import samplec

ROOT = Path(__file__).resolve().parent.parent
CHAINS = {
    "C1": ("greedy", "greedy()"),
    "C2": ("temperature 0.8", "temperature(0.8) sample(seed, position = pos)"),
    "C3": ("top_k 40 + temperature", "top_k(40) temperature(0.8) sample(seed, position = pos)"),
    "C4": ("top_p 0.95 + temperature", "top_p(0.95) temperature(0.8) sample(seed, position = pos)"),
    "C5": ("llama.cpp default", "top_k(40) top_p(0.95) min_p(0.05) temperature(0.8) sample(seed, position = pos)"),
    "C6": ("min_p 0.05 + temperature", "min_p(0.05) temperature(0.8) sample(seed, position = pos)"),
    "C7": ("C5 + repeat penalty 1.1 / 64", "penalties(history, last_n = 64, repeat = 1.1) top_k(40) top_p(0.95) "
                                            "min_p(0.05) temperature(0.8) sample(seed, position = pos)"),
}
HISTORY = 64


def make_logits(B: int, V: int, flat: bool = False, seed: int = 0) -> np.ndarray:
    r = np.random.default_rng(seed)
    x = r.normal(0, 2.0 if flat else 1.0, size=(B, V)).astype(np.float32)
    head = np.arange(1, 65, dtype=np.float32)
    for b in range(B):
        ids = r.choice(V, 64, replace=False)
        x[b, ids] += (4 + 6 / head ** 0.5) if flat else (10 + 12 / head ** 0.5)
    return x


def make_history(B: int, V: int) -> np.ndarray:
    return np.random.default_rng(1).integers(0, V, size=(B, HISTORY)).astype(np.int32)


# ---- peers -------------------------------------------------------------------------------------------------------

class Samplec:
    def __init__(self, level: int):
        self.level = level
        self.name = f"samplec -O{level}"
        self.cache = {}

    def setup(self, chain: str, x: np.ndarray, hist: np.ndarray):
        if chain not in self.cache:
            params = "seed: seed = 0, pos: int = 0" + (", history: tokens" if chain == "C7" else "")
            self.cache[chain] = samplec.compile(f"sampler {chain}({params}) {{ {CHAINS[chain][1]} }}",
                                                opt_level=self.level)
        prog, xm = self.cache[chain], mx.array(x)
        kw = {"history": mx.array(hist)} if chain == "C7" else {}
        if chain != "C1":
            kw["seed"] = np.arange(x.shape[0], dtype=np.uint64)
        self.prog = prog
        return lambda step: prog(xm, **kw, **({"pos": step} if chain != "C1" else {})).token


class MlxLm:
    name = "mlx-lm"

    def __init__(self):
        from mlx_lm.sample_utils import make_logits_processors, make_sampler
        self.make_sampler, self.make_processors = make_sampler, make_logits_processors

    def setup(self, chain, x, hist):
        kw = {"C1": dict(temp=0.0), "C2": dict(temp=0.8), "C3": dict(temp=0.8, top_k=40),
              "C4": dict(temp=0.8, top_p=0.95), "C5": dict(temp=0.8, top_k=40, top_p=0.95, min_p=0.05),
              "C6": dict(temp=0.8, min_p=0.05), "C7": dict(temp=0.8, top_k=40, top_p=0.95, min_p=0.05)}[chain]
        sampler = self.make_sampler(**kw)
        procs = self.make_processors(repetition_penalty=1.1, repetition_context_size=HISTORY) if chain == "C7" else []
        xm, hm = mx.array(x), mx.array(hist)

        def step(_):
            y = xm
            for p in procs:
                y = p(hm, y)
            tok = sampler(y)
            mx.eval(tok)
            return tok
        return step


class HuggingFace:
    name = "HF transformers"

    def __init__(self):
        import torch
        import transformers as tf
        self.torch, self.tf = torch, tf

    def setup(self, chain, x, hist):
        torch, tf = self.torch, self.tf
        procs = {
            "C1": [], "C2": [tf.TemperatureLogitsWarper(0.8)],
            "C3": [tf.TopKLogitsWarper(40), tf.TemperatureLogitsWarper(0.8)],
            "C4": [tf.TopPLogitsWarper(0.95), tf.TemperatureLogitsWarper(0.8)],
            "C5": [tf.TopKLogitsWarper(40), tf.TopPLogitsWarper(0.95), tf.MinPLogitsWarper(0.05),
                   tf.TemperatureLogitsWarper(0.8)],
            "C6": [tf.MinPLogitsWarper(0.05), tf.TemperatureLogitsWarper(0.8)],
        }
        procs["C7"] = [tf.RepetitionPenaltyLogitsProcessor(1.1)] + procs["C5"]
        chain_procs = tf.LogitsProcessorList(procs[chain])
        xt, ht = torch.from_numpy(x), torch.from_numpy(hist.astype(np.int64))
        gen = torch.Generator().manual_seed(0)

        def step(_):
            with torch.no_grad():
                y = chain_procs(ht, xt.clone())
                if chain == "C1":
                    return torch.argmax(y, dim=-1)
                return torch.multinomial(torch.softmax(y, dim=-1), 1, generator=gen)
        return step


class MlxComposition:
    """A straightforward MLX lowering (as the ExecuTorch MLX backend's sampler): full sorts for top_k and top_p."""
    name = "MLX composition"

    def setup(self, chain, x, hist):
        xm, hm = mx.array(x), mx.array(hist)
        ninf = mx.array(-np.inf, dtype=mx.float32)

        def top_k(y, k):
            kth = mx.sort(y, axis=-1)[:, -k][:, None]
            return mx.where(y < kth, ninf, y)

        def top_p(y, p):
            probs = mx.softmax(y, axis=-1)
            order = mx.argsort(-probs, axis=-1)
            sorted_p = mx.take_along_axis(probs, order, axis=-1)
            before = mx.cumsum(sorted_p, axis=-1) - sorted_p
            drop_sorted = before >= p
            drop = mx.put_along_axis(mx.zeros_like(drop_sorted), order, drop_sorted, axis=-1)
            return mx.where(drop, ninf, y)

        def min_p(y, m):
            return mx.where(y < mx.max(y, axis=-1, keepdims=True) + np.log(m), ninf, y)

        def penalty(y):
            vals = mx.take_along_axis(y, hm, axis=-1)
            vals = mx.where(vals > 0, vals / 1.1, vals * 1.1)
            return mx.put_along_axis(y, hm, vals, axis=-1)

        stages = {"C1": [], "C2": [], "C3": [lambda y: top_k(y, 40)], "C4": [lambda y: top_p(y, 0.95)],
                  "C5": [lambda y: top_k(y, 40), lambda y: top_p(y, 0.95), lambda y: min_p(y, 0.05)],
                  "C6": [lambda y: min_p(y, 0.05)]}
        stages["C7"] = [penalty] + stages["C5"]
        key = mx.random.key(0)

        def run(y):
            for f in stages[chain]:
                y = f(y)
            if chain == "C1":
                return mx.argmax(y, axis=-1)
            return mx.random.categorical(y / 0.8, key=key)
        fn = mx.compile(run)

        def step(_):
            tok = fn(xm)
            mx.eval(tok)
            return tok
        return step


class LlamaCpp:
    """llama.cpp's sampler chain on a llama_token_data_array, one row at a time, as llama.cpp samples."""
    name = "llama.cpp"

    def __init__(self):
        import llama_cpp
        self.ll = llama_cpp
        self.token = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])

    def setup(self, chain, x, hist):
        ll = self.ll
        B, V = x.shape
        chains = []
        for b in range(B):
            c = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
            specs = []
            if chain == "C7":
                n = len(ll.llama_sampler_init_penalties.argtypes)
                specs.append(ll.llama_sampler_init_penalties(*((V,) if n == 5 else ()), HISTORY, 1.1, 0.0, 0.0))
            if chain in ("C3", "C5", "C7"):
                specs.append(ll.llama_sampler_init_top_k(40))
            if chain in ("C4", "C5", "C7"):
                specs.append(ll.llama_sampler_init_top_p(0.95, 1))
            if chain in ("C5", "C6", "C7"):
                specs.append(ll.llama_sampler_init_min_p(0.05, 1))
            if chain == "C1":
                specs.append(ll.llama_sampler_init_greedy())
            else:
                specs += [ll.llama_sampler_init_temp(0.8), ll.llama_sampler_init_dist(b)]
            for s in specs:
                ll.llama_sampler_chain_add(c, s)
            if chain == "C7":
                for t in hist[b]:
                    ll.llama_sampler_accept(c, int(t))
            chains.append(c)
        self.chains = chains
        buf = np.zeros(V, self.token)
        ids = np.arange(V, dtype=np.int32)
        ptr = buf.ctypes.data_as(ctypes.POINTER(ll.llama_token_data))

        def step(_):
            out = []
            for b in range(B):
                buf["id"] = ids          # llama.cpp fills the candidate array from the logits every step
                buf["logit"] = x[b]
                cur = ll.llama_token_data_array(data=ptr, size=V, selected=-1, sorted=False)
                ll.llama_sampler_apply(chains[b], ctypes.byref(cur))
                out.append(cur.data[cur.selected].id)
            return out
        return step

    def teardown(self):
        for c in getattr(self, "chains", []):
            self.ll.llama_sampler_free(c)
        self.chains = []


# ---- measuring ---------------------------------------------------------------------------------------------------

def median_ms(step, budget_s: float, min_reps: int = 3, max_reps: int = 50) -> float:
    step(0)
    step(1)   # warm-up: compilation, caches
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        step(len(times) + 2)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def interleaved_medians(steps: dict, budget_s: float, min_reps: int = 3, max_reps: int = 2000) -> dict:
    """Median ms of each step, timed in rounds (one call of every step per round) so that a burst of load on this
    shared machine falls on all peers alike. A step stops once it has max_reps calls, or min_reps and budget_s of
    its own time: a 0.2 ms step gets ~1000 calls, so that a burst of noise moves its median little. Each round
    runs the steps in a shuffled (seeded) order: a step that always followed the same neighbor would always find
    the caches as that neighbor left them (llama.cpp's step writes 1.8 MB at V = 152064)."""
    order = random.Random(0)
    for step in steps.values():
        step(0)
        step(1)   # warm-up: compilation, caches
    times = {k: [] for k in steps}
    spent = dict.fromkeys(steps, 0.0)
    active = set(steps)
    n = 2
    while active:
        keys = [k for k in steps if k in active]
        order.shuffle(keys)
        for k in keys:
            t0 = time.perf_counter()
            steps[k](n)
            dt = time.perf_counter() - t0
            times[k].append(dt)
            spent[k] += dt
            if len(times[k]) >= max_reps or len(times[k]) >= min_reps and spent[k] >= budget_s:
                active.discard(k)
        n += 1
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def floors(V: int, B: int, budget: float) -> dict:
    x = mx.array(make_logits(B, V))
    ev = lambda f: (lambda _: mx.eval(f()))
    one = mx.array(1.0)
    return {"one eval": median_ms(ev(lambda: one + 1), budget),
            "mx.max": median_ms(ev(lambda: mx.max(x, axis=-1)), budget),
            "mx.argmax": median_ms(ev(lambda: mx.argmax(x, axis=-1)), budget),
            "mx.topk(40)": median_ms(ev(lambda: mx.topk(x, 40, axis=-1)), budget)}


def check_tokens(o2: Samplec, o0: Samplec, chain: str, x: np.ndarray, hist: np.ndarray, steps: int = 4) -> None:
    a, b = o2.setup(chain, x, hist), o0.setup(chain, x, hist)
    for s in range(steps):
        ta, tb = np.array(a(s)), np.array(b(s))
        if not np.array_equal(ta, tb):
            raise SystemExit(f"{chain}: samplec -O2 and -O0 disagree at step {s}: {ta} vs {tb}")


def peers(wanted: list[str]) -> tuple[list, list[str]]:
    made, skipped = [Samplec(2), Samplec(0)], []
    for cls in (MlxLm, HuggingFace, MlxComposition, LlamaCpp):
        if wanted and cls.name not in wanted:
            continue
        try:
            made.append(cls())
        except ImportError as e:
            skipped.append(f"{cls.name} ({e.name or e} not installed)")
    return made, skipped


def run(args) -> dict:
    sizes = [152064] if args.quick else [32000, 152064, 262144]
    batches = [1, 8] if args.quick else [1, 8, 64]
    chains = args.chains or list(CHAINS)
    budget = 0.25 if args.quick else 0.6
    ps, skipped = peers(args.peers)
    for s in skipped:
        print(f"skipping {s}", file=sys.stderr)
    from samplec.backend_mlx import native
    results = {"machine": f"{platform.machine()} {platform.system()}, MLX {mx.__version__} "
                          f"({mx.default_device()}), samplec-native primitives "
                          f"{'on' if native.enabled() else 'off (not built, or SAMPLEC_NATIVE=0)'}", "flat": args.flat, "rows": [], "floors": [],
               "skipped": skipped}
    for V in sizes:
        for B in batches:
            results["floors"].append({"V": V, "B": B, **floors(V, B, budget)})
            x, hist = make_logits(B, V, args.flat), make_history(B, V)
            for chain in chains:
                check_tokens(ps[0], ps[1], chain, x, hist)
                row = {"chain": chain, "V": V, "B": B, "ms": {}}
                steps = {p.name: p.setup(chain, x, hist) for p in ps}
                o2 = ps[0]
                paired = [k for k in (o2.name, LlamaCpp.name) if k in steps]
                measured = interleaved_medians({k: steps[k] for k in paired}, budget)
                for k in steps:
                    if k not in paired:
                        measured[k] = median_ms(steps[k], budget)
                row["ms"] = {p.name: measured[p.name] for p in ps}
                for p in ps:
                    if hasattr(p, "teardown"):
                        p.teardown()
                base = row["ms"]["samplec -O2"]
                row["ratio"] = {k: v / base for k, v in row["ms"].items()}
                results["rows"].append(row)
                print(format_row(row), flush=True)
    results["compile_load"] = compile_and_load_times()
    return results


def compile_and_load_times() -> dict:
    """Median of 3 compiles and of 7 loads (after one warm-up load) of each example."""
    import tempfile
    out = {}
    for path in sorted((ROOT / "examples").glob("*.smp")):
        compile_ms = []
        for _ in range(3):
            t0 = time.perf_counter()
            prog = samplec.compile_file(path)
            compile_ms.append((time.perf_counter() - t0) * 1e3)
        load_ms = []
        with tempfile.TemporaryDirectory() as d:
            prog.save(Path(d) / "p.smpb")
            samplec.load(Path(d) / "p.smpb")   # warm the import path
            for _ in range(7):
                t0 = time.perf_counter()
                samplec.load(Path(d) / "p.smpb")
                load_ms.append((time.perf_counter() - t0) * 1e3)
        out[path.name] = {"compile_ms": statistics.median(compile_ms), "load_ms": statistics.median(load_ms)}
    return out


def format_row(row: dict) -> str:
    cells = "  ".join(f"{k}: {v:8.3f} ms ({row['ratio'][k]:6.1f}x)" for k, v in row["ms"].items())
    return f"{row['chain']} V={row['V']:<6} B={row['B']:<2} {cells}"


def write_docs(results: dict, out_dir: Path, tag: str) -> None:
    names = list(dict.fromkeys(k for r in results["rows"] for k in r["ms"]))
    lines = [f"Machine: {results['machine']}. Logits: {'flat' if results['flat'] else 'realistic'} "
             f"(see `benchmarks/bench_sampler.py`). Times are medians in ms; in parentheses each peer's time "
             "divided by samplec -O2's in the same run (higher = samplec faster).", ""]
    if results["skipped"]:
        lines += ["Skipped peers: " + "; ".join(results["skipped"]), ""]
    lines.append("| chain | V | B | " + " | ".join(names) + " |")
    lines.append("|---|---|---|" + "---|" * len(names))
    for r in results["rows"]:
        cells = [f"{r['ms'][n]:.3f} ({r['ratio'][n]:.1f}x)" if n in r["ms"] else "—" for n in names]
        lines.append(f"| {r['chain']} {CHAINS[r['chain']][0]} | {r['V']} | {r['B']} | " + " | ".join(cells) + " |")
    lines += ["", "Primitive floors (ms):", "", "| V | B | one eval | mx.max | mx.argmax | mx.topk(40) |",
              "|---|---|---|---|---|---|"]
    for f in results["floors"]:
        lines.append(f"| {f['V']} | {f['B']} | {f['one eval']:.3f} | {f['mx.max']:.3f} | {f['mx.argmax']:.3f} "
                     f"| {f['mx.topk(40)']:.3f} |")
    lines += ["", "Compile and load times (ms; medians of 3 compiles and 7 loads):", "", "| example | compile | load .smpb |", "|---|---|---|"]
    for name, t in results["compile_load"].items():
        lines.append(f"| {name} | {t['compile_ms']:.1f} | {t['load_ms']:.2f} |")
    (out_dir / f"bench_{tag}.md").write_text("\n".join(lines) + "\n")
    (out_dir / f"bench_{tag}.json").write_text(json.dumps(results, indent=1) + "\n")
    try:
        plot(results, out_dir / f"bench_{tag}.png")
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in results["rows"] if r["V"] == 152064]
    configs = [f"{r['chain']}\nB={r['B']}" for r in rows]
    names = [n for n in dict.fromkeys(k for r in rows for k in r["ms"]) if n != "samplec -O2"]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.8), 4.5))
    width = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        vals = [r["ratio"].get(n, np.nan) for r in rows]
        ax.bar(np.arange(len(rows)) + i * width, vals, width, label=n)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2)
    ax.set_xticklabels(configs, fontsize=8)
    ax.set_ylabel("peer time / samplec -O2 time")
    ax.set_title(f"V = 152064 — {results['machine']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="V = 152064, B in {1, 8}: under two minutes")
    ap.add_argument("--flat", action="store_true", help="high-entropy logits")
    ap.add_argument("--chains", nargs="*", help="subset of C1..C7")
    ap.add_argument("--peers", nargs="*", default=[], help="subset of peers by name (samplec always runs)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs", help="where the table, JSON and plot go")
    ap.add_argument("--tag", default=None, help="file name tag (default: quick/full, + _flat)")
    args = ap.parse_args()
    results = run(args)
    tag = args.tag or ("quick" if args.quick else "full") + ("_flat" if args.flat else "")
    args.out.mkdir(parents=True, exist_ok=True)
    write_docs(results, args.out, tag)
    print(f"wrote {args.out}/bench_{tag}.md, .json, .png")


if __name__ == "__main__":
    main()
