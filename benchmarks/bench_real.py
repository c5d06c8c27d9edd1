"""Real chains: the shipped examples' chains with every parameter passed at run time, each system's own stage order,
realistic next-token distributions, against each system's own sampler in the same run.

    pip install -e ".[bench]" ./native
    python benchmarks/bench_real.py --quick        # V = 152064, B in {1, 8}, a few minutes
    python benchmarks/bench_real.py --out docs/bench_real     # writes .md and .json

Chains (all parameters are run-time values -- as scalars, and at B > 1 as one value per row, "rows"):
  llama_cpp   examples/llama_cpp_default.smp: penalties, top_n_sigma, top_k 40, typical_p, top_p 0.95, min_p 0.05,
              xtc, temperature 0.8 (llama.cpp's default order and values)
  hf          examples/hf_generate.smp: repetition penalty 1.1, temperature 0.7, top_k 50, top_p 0.9 (HF order)
  vllm        examples/vllm.smp: penalties, temperature 0.7, min_p 0.05, top_k 50, top_p 0.9 (vLLM order)
  openai      examples/openai.smp: frequency/presence penalties, a bias, temperature 0.9, top_p 0.95 (no top_k)
  mlx_lm      examples/mlx_lm_default.smp: top_p 0.9, min_p 0.05, temperature 0.7 (mlx-lm's order: temperature last)
  greedy      examples/hf_generate.smp's hf_greedy: repetition penalty 1.1 over the history, then greedy (HF's
              default generate); its floor peer is one `mx.argmax` over the logits ("mx.argmax")
  server      vllm's chain, B rows each with its own temperature (a quarter of them 0), top_k, top_p and penalty
  constrained examples/vllm.smp's vllm_constrained: vLLM's chain after allowed_token_ids and logit_bias (a mask
              allowing a quarter of the vocabulary, as a grammar state might, and 8 biased tokens per row), which
              vLLM applies before the penalties; llama.cpp's peer holds both in one logit_bias sampler first
              (-inf for each disallowed token), HF's in a processor doing vLLM's masked_fill and add
Peers, each on its own order: llama.cpp's C++ chain (llama-cpp-python `llama_sampler_*`, one row at a time on a
token-data array, as llama.cpp samples) with the same stages in the same order; Hugging Face's processors +
torch.multinomial (hf, vllm, openai, server); mlx-lm's `make_sampler` + `make_logits_processors` (mlx_lm), one
sampler per row as its BatchGenerator does. A peer that is not installed is skipped.

Logits (one family per run of the table, V = 152064, fixed seeds):
  confident   the older benchmark's shape: N(0, 1) over the vocabulary plus a Zipf-like head of 64 strong tokens
  chat        per row: a Zipf head of 1000 tokens (exponent 0.9-1.5) carrying 1 - tau of the mass and a tail
              carrying tau in {1%, 3%, 10%, 30%}, spread log-normally over the other tokens, ids shuffled. The run
              prints each row's nucleus(0.9) size and its mass beyond the top 1000 (the recipe's targets: 1 to
              several thousand tokens, 1-30%).
Times are medians of interleaved rounds (every peer once per round, shuffled): ratios are peer / samplec -O2 in the
same run. samplec runs twice: with the example's outputs (what its users get: logprob, top_logprobs, probs) and
"token only" (the example with `-> token`, the work the peers do: none of them returns logprobs here), and each
ratio is given against both. samplec's tokens are checked against -O0 on the same inputs before timing.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import random
import re
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import samplec
from samplec.backend_mlx import native

ROOT = Path(__file__).resolve().parent.parent
V_DEFAULT = 152064
HIST = 64


# ---- logits ------------------------------------------------------------------------------------------------------

def confident_logits(B, V, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(0, 1.0, size=(B, V)).astype(np.float32)
    head = np.arange(1, 65, dtype=np.float32)
    for b in range(B):
        x[b, r.choice(V, 64, replace=False)] += 10 + 12 / head ** 0.5
    return x


def chat_logits(B, V, seed=0):
    r = np.random.default_rng(seed)
    rows = []
    for b in range(B):
        tau = [0.01, 0.03, 0.10, 0.30][b % 4]
        s = r.uniform(0.9, 1.5)
        head = np.arange(1, 1001, dtype=np.float64) ** -s
        head *= (1 - tau) / head.sum()
        tail = r.lognormal(0.0, 1.0, V - 1000)
        tail *= tau / tail.sum()
        p = np.concatenate([head, tail])[r.permutation(V)]
        rows.append(np.log(p).astype(np.float32))
    return np.stack(rows)


def flat_logits(B, V, seed=0):
    return np.random.default_rng(seed).normal(0, 0.05, (B, V)).astype(np.float32)


def ties_logits(B, V, seed=0):
    return np.random.default_rng(seed).integers(-4, 4, (B, V)).astype(np.float32)


def neg_inf_logits(B, V, seed=0):
    x = confident_logits(B, V, seed)
    x[np.random.default_rng(seed + 1).random((B, V)) < 0.9] = -np.inf
    return x


CLIFF_FAMILIES = {"confident": confident_logits, "chat": chat_logits, "flat": flat_logits, "ties": ties_logits,
                  "neg_inf": neg_inf_logits}


def cliff(budget):
    """No cliff: each chain on each logits family, as a ratio to the same chain on the confident family."""
    print("\n== no cliff: samplec -O2 ms per family (ratio to confident), B = 1")
    rows = []
    for name, spec in chain_specs(1, np.random.default_rng(1))[0].items():
        if name == "server":
            continue
        steps = {}
        for fam, make in CLIFF_FAMILIES.items():
            x = make(1, V_DEFAULT, seed=5)
            steps[fam] = Samplec(2, per_row=False).setup(spec, x, chain_specs(1, np.random.default_rng(1))[1])
        ms = interleaved(steps, budget)
        rows.append({"chain": name, "ms": ms})
        print(f"  {name:10} " + "  ".join(f"{f} {v:.3f} ({v / ms['confident']:.1f}x)" for f, v in ms.items()))
    return rows


def describe(x):
    out = []
    for row in x:
        p = np.exp(row - row.max())
        p /= p.sum()
        s = np.sort(p)[::-1]
        c = np.cumsum(s)
        out.append((int(np.searchsorted(c, 0.9)) + 1, float(1 - c[999])))
    return out


# ---- chains ------------------------------------------------------------------------------------------------------

def chain_specs(B, rng):
    """name -> (file, sampler, run-time params per row, peer stage list per row, the peers that apply)."""
    hist = rng.integers(0, V_DEFAULT, (B, HIST)).astype(np.int32)
    rows = lambda v: [v] * B
    t_server = [0.0 if b % 4 == 0 else float(v) for b, v in enumerate(rng.choice([0.6, 0.8, 1.0, 1.2], B))]
    k_server = [int(v) for v in rng.choice([0, 20, 50, 100], B)]
    p_server = [float(v) for v in rng.choice([0.8, 0.9, 0.95, 1.0], B)]
    r_server = [float(v) for v in rng.choice([1.0, 1.1, 1.2], B)]
    allowed = rng.random((B, V_DEFAULT)) < 0.25
    bias = np.zeros((B, V_DEFAULT), np.float32)
    for b in range(B):
        bias[b, rng.choice(V_DEFAULT, 8, replace=False)] = rng.choice([-5.0, -1.0, 1.0, 5.0], 8)
    specs = {
        "llama_cpp": ("llama_cpp_default.smp", "llama_cpp_default",
                      dict(history=hist, repeat_penalty=rows(1.1), top_k=rows(40), typical_p=rows(1.0),
                           top_p=rows(0.95), min_p=rows(0.05), xtc_probability=rows(0.0), temperature=rows(0.8),
                           top_n_sigma=rows(-1.0)),
                      [[("penalties", 1.1), ("top_k", 40), ("top_p", 0.95), ("min_p", 0.05), ("temp", 0.8)]] * B,
                      ("llama.cpp",)),
        "hf": ("hf_generate.smp", "hf_generate",
               dict(input_ids=hist, repetition_penalty=rows(1.1), temperature=rows(0.7), top_k=rows(50),
                    top_p=rows(0.9)),
               [[("penalties", 1.1), ("temp", 0.7), ("top_k", 50), ("top_p", 0.9)]] * B, ("llama.cpp", "hf")),
        "vllm": ("vllm.smp", "vllm",
                 dict(prompt_and_output=hist, output=hist[:, -16:], repetition_penalty=rows(1.05),
                      temperature=rows(0.7), min_p=rows(0.05), top_k=rows(50), top_p=rows(0.9)),
                 [[("penalties", 1.05), ("temp", 0.7), ("min_p", 0.05), ("top_k", 50), ("top_p", 0.9)]] * B,
                 ("llama.cpp", "hf")),
        "openai": ("openai.smp", "openai",
                   dict(output=hist[:, -16:], bias=np.zeros((B, V_DEFAULT), np.float32),
                        presence_penalty=rows(0.3), frequency_penalty=rows(0.2), temperature=rows(0.9),
                        top_p=rows(0.95)),
                   [[("presence", (0.3, 0.2)), ("temp", 0.9), ("top_p", 0.95)]] * B, ("llama.cpp", "hf")),
        "mlx_lm": ("mlx_lm_default.smp", "mlx_lm",
                   dict(top_p=rows(0.9), min_p=rows(0.05), top_k=rows(0), temp=rows(0.7)),
                   [[("top_p", 0.9), ("min_p", 0.05), ("temp", 0.7)]] * B, ("llama.cpp", "mlx-lm")),
        "greedy": ("hf_generate.smp", "hf_greedy", dict(input_ids=hist, repetition_penalty=rows(1.1)),
                   [[("penalties", 1.1), ("temp", 0.0)]] * B, ("llama.cpp", "hf", "mx.argmax")),
        "server": ("vllm.smp", "vllm",
                   dict(prompt_and_output=hist, output=hist[:, -16:], repetition_penalty=r_server,
                        temperature=t_server, top_k=k_server, top_p=p_server),
                   [[("penalties", r_server[b]), ("temp", t_server[b]), ("top_k", k_server[b]),
                     ("top_p", p_server[b])] for b in range(B)], ("llama.cpp", "hf")),
        "constrained": ("vllm.smp", "vllm_constrained",
                        dict(prompt_and_output=hist, output=hist[:, -16:], allowed=allowed, bias=bias,
                             repetition_penalty=rows(1.05), temperature=rows(0.7), min_p=rows(0.05),
                             top_k=rows(50), top_p=rows(0.9)),
                        [[("allow_bias", (allowed[b], bias[b])), ("penalties", 1.05), ("temp", 0.7),
                          ("min_p", 0.05), ("top_k", 50), ("top_p", 0.9)] for b in range(B)], ("llama.cpp", "hf")),
    }
    return specs, hist


# ---- peers -------------------------------------------------------------------------------------------------------

def token_only(source: str, sampler: str) -> str:
    """The source with `sampler`'s outputs reduced to `-> token` (what the peers return)."""
    head = re.compile(r"(sampler\s+" + sampler + r"\s*\((?:[^()]|\([^()]*\))*\))\s*(->[^{]*)?\{")
    return head.sub(lambda m: m.group(1) + " -> token {", source, count=1)


class Samplec:
    target = None       # (--target: the compile target; None: auto)

    def __init__(self, level, per_row, token_only=False):
        self.level, self.per_row, self.token_only = level, per_row, token_only
        self.name = f"samplec -O{level}" + (" rows" if per_row else "") + (" token" if token_only else "")

    def setup(self, spec, x, hist):
        file, sampler, params, _, _ = spec
        source = (ROOT / "examples" / file).read_text()
        if self.token_only:
            source = token_only(source, sampler)
        prog = samplec.compile(source, sampler=sampler, opt_level=self.level,
                               target=self.target if self.level else None)
        self.prog = prog
        kw = {}
        for k, v in params.items():
            if isinstance(v, list):
                kw[k] = v if self.per_row or len(set(v)) > 1 else v[0]
            else:
                kw[k] = mx.array(v)
        xm = mx.array(x)
        mx.eval(xm, *[v for v in kw.values() if isinstance(v, mx.array)])
        self.xm, self.kw = xm, kw
        self.last = None
        takes_seed = any(p.name == "seed" for p in prog.params)

        def step(i):
            draw = dict(seed=[i] * x.shape[0] if self.per_row else i, pos=7) if takes_seed else {}
            out = prog(xm, **draw, **kw)
            self.last = np.array(out.token)
            return self.last
        return step


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self):
        import llama_cpp
        self.ll = llama_cpp
        self.token = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])

    def setup(self, spec, x, hist):
        ll, (B, V) = self.ll, x.shape
        self.chains = []
        for b in range(B):
            c = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
            greedy = False
            for name, v in spec[3][b]:
                n = len(ll.llama_sampler_init_penalties.argtypes)
                extra = (V,) if n == 5 else ()
                if name == "allow_bias":      # (one logit_bias sampler: -inf where disallowed, then the bias)
                    entries = {int(t): float("-inf") for t in np.flatnonzero(~v[0])}
                    for t in np.flatnonzero(v[1]):
                        entries[int(t)] = entries.get(int(t), 0.0) + float(v[1][t])
                    arr = (ll.llama_logit_bias * len(entries))(*[ll.llama_logit_bias(t, bv)
                                                                 for t, bv in entries.items()])
                    self.keep = getattr(self, "keep", []) + [arr]
                    s = ll.llama_sampler_init_logit_bias(V, len(entries), arr)
                elif name == "penalties":
                    s = ll.llama_sampler_init_penalties(*extra, HIST, v, 0.0, 0.0)
                elif name == "presence":
                    s = ll.llama_sampler_init_penalties(*extra, 16, 1.0, v[1], v[0])
                elif name == "top_k":
                    s = ll.llama_sampler_init_top_k(v) if v > 0 else None
                elif name == "top_p":
                    s = ll.llama_sampler_init_top_p(v, 1)
                elif name == "min_p":
                    s = ll.llama_sampler_init_min_p(v, 1)
                elif name == "temp":
                    greedy = v == 0
                    s = ll.llama_sampler_init_temp(v) if v > 0 else None
                if s is not None:
                    ll.llama_sampler_chain_add(c, s)
            ll.llama_sampler_chain_add(c, ll.llama_sampler_init_greedy() if greedy else ll.llama_sampler_init_dist(b))
            for t in hist[b]:
                ll.llama_sampler_accept(c, int(t))
            self.chains.append(c)
        buf = np.zeros(V, self.token)
        ids = np.arange(V, dtype=np.int32)
        ptr = buf.ctypes.data_as(ctypes.POINTER(ll.llama_token_data))

        def step(_):
            out = []
            for b in range(B):
                buf["id"] = ids
                buf["logit"] = x[b]
                cur = ll.llama_token_data_array(data=ptr, size=V, selected=-1, sorted=False)
                ll.llama_sampler_apply(self.chains[b], ctypes.byref(cur))
                out.append(cur.data[cur.selected].id)
            return out
        return step

    def teardown(self):
        for c in self.chains:
            self.ll.llama_sampler_free(c)


class HF:
    name = "hf"

    def __init__(self, device="cpu"):
        import torch
        import transformers.generation.logits_process as lp
        self.torch, self.lp, self.device = torch, lp, device
        if device == "cpu":
            torch.set_num_threads(1)

    def setup(self, spec, x, hist):
        torch, lp = self.torch, self.lp
        B = x.shape[0]
        procs = []
        for b in range(B):
            ps = []
            for name, v in spec[3][b]:
                if name == "allow_bias":       # (vLLM's allowed_token_ids mask and logit_bias, as a processor)
                    mask = torch.from_numpy(~v[0])[None].to(self.device)
                    add = torch.from_numpy(v[1])[None].to(self.device)
                    ps.append(lambda ids, s, mask=mask, add=add: s.masked_fill(mask, float("-inf")) + add)
                elif name == "penalties" and v != 1.0:
                    ps.append(lp.RepetitionPenaltyLogitsProcessor(v))
                elif name == "temp" and v not in (0.0, 1.0):
                    ps.append(lp.TemperatureLogitsWarper(v))
                elif name == "top_k" and v > 0:
                    ps.append(lp.TopKLogitsWarper(v))
                elif name == "top_p" and v < 1:
                    ps.append(lp.TopPLogitsWarper(v))
                elif name == "min_p" and v > 0:
                    ps.append(lp.MinPLogitsWarper(v))
            procs.append((lp.LogitsProcessorList(ps), any(n == "temp" and v == 0 for n, v in spec[3][b])))
        xt = torch.from_numpy(x).to(self.device)
        ht = torch.from_numpy(hist.astype(np.int64)).to(self.device)
        gen = torch.Generator(device=self.device).manual_seed(0)

        def step(_):
            out = []
            for b, (ps, greedy) in enumerate(procs):
                s = ps(ht[b:b + 1], xt[b:b + 1].clone())
                out.append(int(s.argmax()) if greedy else
                           int(torch.multinomial(torch.softmax(s, -1), 1, generator=gen)))
            return out
        return step


class MlxLm:
    name = "mlx-lm"

    def __init__(self):
        from mlx_lm.sample_utils import make_sampler
        self.make_sampler = make_sampler

    def setup(self, spec, x, hist):
        B = x.shape[0]
        samplers = []
        for b in range(B):
            kw = dict(spec[3][b])
            samplers.append(self.make_sampler(temp=kw.get("temp", 0.0), top_p=kw.get("top_p", 0.0),
                                              min_p=kw.get("min_p", 0.0), top_k=kw.get("top_k", 0)))
        xm = mx.array(x)
        lps = xm - mx.logsumexp(xm, axis=-1, keepdims=True)
        mx.eval(lps)

        def step(_):          # one call per row, as mlx-lm's BatchGenerator does with per-request samplers
            toks = [s(lps[b:b + 1]) for b, s in enumerate(samplers)]
            mx.eval(toks)
            return [int(t.item()) for t in toks]
        return step


class MxArgmax:
    """The floor for greedy: one `mx.argmax` over the logits, read back (no penalties, no checks)."""
    name = "mx.argmax"

    def setup(self, spec, x, hist):
        xm = mx.array(x)
        mx.eval(xm)
        return lambda _: np.array(mx.argmax(xm, axis=-1)).tolist()


# ---- measuring ---------------------------------------------------------------------------------------------------

def interleaved(steps, budget_s, max_reps=400, trace=None):
    rng = random.Random(0)
    for k, s in steps.items():
        t0 = time.perf_counter()
        s(0)
        s(1)
        if trace:
            trace(f"{k}: first two calls {time.perf_counter() - t0:.2f} s")
    times = {k: [] for k in steps}
    spent = {k: 0.0 for k in steps}
    i = 2
    while True:
        live = [k for k in steps if len(times[k]) < max_reps and (len(times[k]) < 3 or spent[k] < budget_s)]
        if not live:
            break
        rng.shuffle(live)
        for k in live:
            t0 = time.perf_counter()
            steps[k](i)
            dt = time.perf_counter() - t0
            times[k].append(dt)
            spent[k] += dt
        i += 1
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=None, help="seconds of timing per peer and case")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    ap.add_argument("--chains", default=None, help="comma-separated subset")
    ap.add_argument("--cliff", action="store_true", help="only the no-cliff table (each chain on each family)")
    ap.add_argument("--torch-device", default="cpu",
                    help="where Hugging Face's processors run (cuda: beside MLX's CUDA backend)")
    ap.add_argument("--check-device", choices=("same", "cpu"), default="same",
                    help="where the -O0 program that checks -O2's tokens runs (cpu: MLX's CPU, where a GPU would "
                         "spend its first minutes compiling the dense definitions' kernels)")
    ap.add_argument("--lean", action="store_true",
                    help="samplec token only, no -O0 check (a short GPU lease: tests/test_gpu.py checks tokens)")
    ap.add_argument("--history", type=int, default=HIST,
                    help="token history length (default 64; a prompt of thousands for HF's and vLLM's "
                         "repetition penalty over the whole sequence)")
    ap.add_argument("--trace", action="store_true", help="print each step's start time (where a cold GPU waits)")
    ap.add_argument("--target", default=None, help="compile samplec's programs for this target (auto, cpu, cuda, "
                    "metal, portable); with a target, each chain's launches and host queue time are printed too")
    args = ap.parse_args()
    Samplec.target = args.target
    globals()["HIST"] = args.history
    t_start = time.perf_counter()

    def trace(what):
        if args.trace:
            print(f"  [{time.perf_counter() - t_start:7.1f} s] {what}", flush=True)
    budget = args.budget if args.budget is not None else (0.6 if args.quick else 2.0)
    batches = (1, 8)
    peers = {}
    for cls in (LlamaCpp, HF, MlxLm, MxArgmax):
        try:
            peers[cls.name] = cls(args.torch_device) if cls is HF else cls()
        except ImportError as e:
            print(f"[skip] {cls.name}: {e}")
    print(f"MLX {mx.__version__} on {mx.default_device()}; Hugging Face's processors on torch {args.torch_device}")
    results = []
    print(f"native kernels: {'on' if native.enabled() else 'off'}")
    if args.cliff:
        rows = cliff(budget)
        if args.out:
            Path(args.out).with_suffix(".cliff.json").write_text(json.dumps(rows, indent=1))
        return
    for family, make in (("chat", chat_logits), ("confident", confident_logits)):
        for B in batches:
            x = make(B, V_DEFAULT, seed=B)
            desc = describe(x)
            print(f"\n== {family}, B = {B}: nucleus(0.9) sizes {[d[0] for d in desc]}, "
                  f"mass beyond top 1000 {[round(d[1], 3) for d in desc]}")
            specs, hist = chain_specs(B, np.random.default_rng(B))
            for name, spec in specs.items():
                if args.chains and name not in args.chains.split(","):
                    continue
                if name == "server" and B == 1:
                    continue
                lean = Samplec(2, per_row=B > 1, token_only=True)
                mine = lean if args.lean else Samplec(2, per_row=B > 1)
                trace(f"{name}: samplec setup")
                steps = {mine.name: mine.setup(spec, x, hist), lean.name: lean.setup(spec, x, hist)}
                if not args.lean:
                    trace(f"{name}: -O2 = -O0 check")
                    t2 = steps[mine.name](123)
                    prev = mx.default_device()
                    if args.check_device == "cpu":
                        mx.set_default_device(mx.cpu)
                    try:
                        t0 = Samplec(0, per_row=B > 1).setup(spec, x, hist)(123)
                    finally:
                        mx.set_default_device(prev)
                    assert t2.tolist() == t0.tolist(), (name, family, B, t2, t0)
                for pname in spec[4]:
                    if pname in peers:
                        trace(f"{name}: {pname} setup")
                        steps[pname] = peers[pname].setup(spec, x, hist)
                trace(f"{name}: timing")
                ms = interleaved(steps, budget, trace=trace if args.trace else None)
                for p in spec[4]:
                    if p in peers and hasattr(peers[p], "teardown"):
                        peers[p].teardown()
                row = {"family": family, "B": B, "chain": name, "ms": ms,
                       "ratio": {k: v / ms[mine.name] for k, v in ms.items() if k not in (mine.name, lean.name)},
                       "ratio_token": {k: v / ms[lean.name] for k, v in ms.items()
                                       if k not in (mine.name, lean.name)}}
                if args.target:
                    from samplec.backend_mlx import kernels
                    from samplec.backend_mlx.launches import call_primitives, launches
                    # (launches as a GPU lowers and runs the program: one sort a chain, where this CPU's portable
                    # program runs candidates)
                    kernels.GPU_SUMS = args.target in ("portable", "metal")
                    prog, kw = mine.prog, mine.kw
                    gpu_prog = samplec.Program(prog.stage_graph, target=prog.target)
                    row["launches"] = launches(call_primitives(gpu_prog, mine.xm, seed=0, pos=7, **kw)
                                               if any(p.name == "seed" for p in prog.params) else
                                               call_primitives(gpu_prog, mine.xm, **kw))
                    kernels.GPU_SUMS = False
                    t0 = time.perf_counter()
                    for _ in range(20):
                        prog.queue(mine.xm, **kw)
                    row["queue_us"] = (time.perf_counter() - t0) / 20 * 1e6
                    print(f"  {name:10} target {prog.target}: {row['launches']} launches, queue {row['queue_us']:.0f} us")
                results.append(row)
                print(f"  {name:10} samplec {ms[mine.name]:7.3f} ms (token only {ms[lean.name]:7.3f})  " +
                      "   ".join(f"{k} {v:8.3f} ms ({row['ratio'][k]:.1f}x; {row['ratio_token'][k]:.1f}x)"
                                 for k, v in ms.items() if k not in (mine.name, lean.name)))
    if args.out:
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))
        lines = ["| logits | B | chain | samplec -O2 ms | token only ms | peers: ms (peer / samplec; peer / token only) |",
                 "|---|---|---|---|---|---|"]
        for r in results:
            lean = next(k for k in r["ms"] if k.endswith("token"))
            mine = next((k for k in r["ms"] if k.startswith("samplec") and not k.endswith("token")), lean)
            peers_txt = "; ".join(f"{k} {v:.3f} ({r['ratio'][k]:.1f}x; {r['ratio_token'][k]:.1f}x)"
                                  for k, v in r["ms"].items() if k not in (mine, lean))
            lines.append(f"| {r['family']} | {r['B']} | {r['chain']} | {r['ms'][mine]:.3f} | {r['ms'][lean]:.3f} | "
                         f"{peers_txt or '—'} |")
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
