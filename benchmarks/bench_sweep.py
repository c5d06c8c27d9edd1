"""Sweep: random sampler chains on hard logits, looking for performance cliffs. Each chain runs with its parameters
as literals, as run-time scalars and as run-time per-row vectors, on the five logits families of bench_real's
no-cliff table, at B = 1 and 8, V = 152064; every time is read as a ratio to another time of the same run.

    pip install -e ".[bench]" ./native
    python benchmarks/bench_sweep.py --quick                   # 10 chains, ~2 minutes on 2 cores
    python benchmarks/bench_sweep.py --chains 40 --out sweep.json
    python benchmarks/bench_sweep.py --seed 0 --chain 3 --modes rows --families ties --batch 8   # one case again

Chains (`--seed`, `--chains N`; chain i is drawn from seed and i alone, so `--chain i` rebuilds it): 1 to 5
distinct stages in a random order from
  top_k        k in 1..200                      top_p        p in 0.5..0.99
  min_p        m in 0.01..0.2                   top_n_sigma  n in 0.5..3
  typical_p    m in 0.3..0.99                   temperature  t in 0.3..1.5, 0 (greedy within the chain) one time in 7
  penalties    a 64-token history, last_n in {-1, 32, 64}, repeat 1..1.5, frequency 0..0.5, presence 0..0.5
  logit_bias   8 tokens biased by -5, -1, 1, 5 or -100 (a dict literal; at run time a `bias` [B, V])
  allow        a random mask allowing 25-75% of the vocabulary (always a run-time `mask`: it has no literal)
then `sample(seed, position)` (1/2), `greedy()` (1/4), or no terminal and `-> probs` (1/4).
Modes (the same chain written three ways):
  literal      every number in the source (`top_k(40)`, `sample(1234, position = 7)`)
  scalar       every number a parameter, passed as one Python number (seed and position too)
  rows         every number a parameter, passed as one value per row: row 0 gets the chain's value, the other rows
               fresh draws from the ranges above (a server batch: per-row temperatures, some of them 0, per-row
               top_k...). At B = 1 it is a one-element list, so rows / scalar is the cost of the vector form alone.
Logits (bench_real's families, seed `--seed`): confident (the easy case: N(0, 1) plus a Zipf head of 64 strong
tokens), chat (a Zipf head of 1000 tokens and a 1-30% log-normal tail: long nuclei), flat (N(0, 0.05)),
ties (integers -4..3: every threshold lands on a tie of ~19000 tokens), neg_inf (confident with 90% -inf).

Each (chain, B) builds the 15 (mode, family) cases and times them together: two warm-up calls each, then rounds
in which every case runs once in a shuffled order (`--reps` rounds, fewer for a case past its time budget);
a call is `prog(logits, **params)` and `mx.eval` of its token (or probs), with the logits, histories, masks and
biases already MLX arrays and the numbers passed as Python numbers or lists. Each case keeps its median and its
minimum. Before timing,
each case's -O2 output is compared with one -O0 call on the same inputs (tokens equal; for `-> probs`, the same
support and values within 1e-4): a mismatch is printed with a command line that reruns that case alone.

Ratios (the issue-11 targets; every ratio is within one (chain, B) and one run, so a slow or busy machine cancels
out). A shared machine also stalls a few calls by milliseconds, which can move a median of 7 but rarely both the
median and the minimum: each ratio is taken on medians and on minima, and the one reported and flagged is the
smaller of the two (both are in the lists and the JSON):
  family       t(family) / t(confident) at the same mode and B: a cliff when > 3 ("flat rows, long nuclei, ties
               and -inf-heavy rows cost at most ~3x the easy case of the same chain")
  scalar/lit   t(scalar) / t(literal) at the same family and B: flagged when > 1.5 (run-time values cost what
               literals cost)
  rows/scalar  t(rows) / t(scalar) at the same family and B: flagged when > 1.5 (per-row vectors cost what
               scalars cost)
The report lists, per chain, the worst ratio of each kind, sorted by the worst (as a multiple of its threshold),
then the worst cases of each kind with their absolute milliseconds (a 3x of a 0.2 ms case is a different story
from a 3x of a 20 ms one). `--out FILE.json` writes every time, ratio, source and mismatch. Not a timed test.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import samplec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_real import chat_logits, confident_logits, flat_logits, neg_inf_logits, ties_logits  # noqa: E402

V_DEFAULT = 152064
HIST = 64
FAMILIES = {"confident": confident_logits, "chat": chat_logits, "flat": flat_logits, "ties": ties_logits,
            "neg_inf": neg_inf_logits}
MODES = ("literal", "scalar", "rows")
STAGES = ("top_k", "top_p", "min_p", "top_n_sigma", "typical_p", "temperature", "penalties", "logit_bias", "allow")
CLIFF, RUNTIME = 3.0, 1.5


# ---- chains ------------------------------------------------------------------------------------------------------

def draw_value(kind, arg, r):
    """One realistic value of a stage's numeric argument (r: a numpy Generator)."""
    if kind == "top_k":
        return int(r.integers(1, 201))
    if kind == "top_p":
        return round(float(r.uniform(0.5, 0.99)), 3)
    if kind == "min_p":
        return round(float(r.uniform(0.01, 0.2)), 3)
    if kind == "top_n_sigma":
        return round(float(r.uniform(0.5, 3.0)), 3)
    if kind == "typical_p":
        return round(float(r.uniform(0.3, 0.99)), 3)
    if kind == "temperature":
        return 0.0 if r.random() < 1 / 7 else round(float(r.uniform(0.3, 1.5)), 3)
    if kind == "penalties":
        return {"last_n": int(r.choice([-1, 32, 64])), "repeat": round(float(r.uniform(1.0, 1.5)), 3),
                "frequency": round(float(r.uniform(0.0, 0.5)), 3),
                "presence": round(float(r.uniform(0.0, 0.5)), 3)}[arg]
    raise ValueError(kind)


NUMERIC = {"top_k": [("k", "int")], "top_p": [("p", "float")], "min_p": [("m", "float")],
           "top_n_sigma": [("n", "float")], "typical_p": [("m", "float")], "temperature": [("t", "float")],
           "penalties": [("last_n", "int"), ("repeat", "float"), ("frequency", "float"), ("presence", "float")]}


def make_chain(seed, index, V):
    """Chain `index` of the sweep: a list of stages (kind, {arg: value}) and a terminal; drawn from (seed, index)."""
    r = np.random.default_rng([seed, index])
    n = int(r.integers(1, 6))
    kinds = [STAGES[i] for i in r.permutation(len(STAGES))[:n]]
    stages = []
    for kind in kinds:
        vals = {a: draw_value(kind, a, r) for a, _ in NUMERIC.get(kind, [])}
        if kind == "logit_bias":
            ids = r.choice(V, 8, replace=False)
            vals = {"bias": {int(t): float(r.choice([-5.0, -1.0, 1.0, 5.0, -100.0])) for t in ids}}
        stages.append((kind, vals))
    u = r.random()
    terminal = "sample" if u < 0.5 else "greedy" if u < 0.75 else None
    return {"index": index, "stages": stages, "terminal": terminal}


def fmt(v):
    return str(v) if isinstance(v, int) else repr(float(v))


def describe_chain(chain):
    parts = []
    for kind, vals in chain["stages"]:
        if kind == "penalties":
            parts.append("penalties(" + ", ".join(f"{a}={fmt(v)}" for a, v in vals.items()) + ")")
        elif kind == "logit_bias":
            parts.append(f"logit_bias({len(vals['bias'])} ids)")
        elif kind == "allow":
            parts.append("allow(mask)")
        else:
            parts.append(f"{kind}({fmt(next(iter(vals.values())))})")
    parts.append({"sample": "sample", "greedy": "greedy", None: "-> probs"}[chain["terminal"]])
    return " ".join(parts)


def source(chain, mode):
    """The chain in the samplec language, its numbers written as literals or as parameters."""
    params, body = [], []
    lit = mode == "literal"
    for i, (kind, vals) in enumerate(chain["stages"]):
        if kind == "allow":
            params.append(f"mk{i}: mask")
            body.append(f"allow(mk{i})")
            continue
        if kind == "logit_bias":
            if lit:
                body.append("logit_bias({" + ", ".join(f"{t}: {fmt(b)}" for t, b in vals["bias"].items()) + "})")
            else:
                params.append(f"b{i}: bias")
                body.append(f"logit_bias(b{i})")
            continue
        args = []
        for a, typ in NUMERIC[kind]:
            if lit:
                text = fmt(vals[a])
            else:
                text = f"{a}{i}"
                params.append(f"{a}{i}: {typ}")
            args.append(text if kind != "penalties" else f"{a} = {text}")
        if kind == "penalties":
            params.append(f"h{i}: tokens")
            args.insert(0, f"h{i}")
        body.append(f"{kind}({', '.join(args)})")
    if chain["terminal"] == "sample":
        if lit:
            body.append("sample(1234, position = 7)")
        else:
            params += ["seed: seed", "pos: int"]
            body.append("sample(seed, position = pos)")
    elif chain["terminal"] == "greedy":
        body.append("greedy()")
    out = "token" if chain["terminal"] else "probs"
    return f"sampler sweep{chain['index']}({', '.join(params)}) -> {out} {{ {' '.join(body)} }}"


def run_params(chain, mode, B, V, seed):
    """The call's keyword arguments: arrays (histories, masks, biases) as MLX arrays, numbers as Python values."""
    r = np.random.default_rng([seed, chain["index"], B, 7])
    kw = {}
    for i, (kind, vals) in enumerate(chain["stages"]):
        if kind == "allow":
            kw[f"mk{i}"] = mx.array(r.random((B, V)) < r.uniform(0.25, 0.75))
        elif kind == "logit_bias":
            bias = np.zeros((B, V), np.float32)
            for b in range(B):
                if mode == "rows" and b > 0:
                    ids = r.choice(V, 8, replace=False)
                    bias[b, ids] = r.choice([-5.0, -1.0, 1.0, 5.0, -100.0], 8)
                else:
                    for t, v in vals["bias"].items():
                        bias[b, t] = v
            if mode != "literal":
                kw[f"b{i}"] = mx.array(bias)
        else:
            if kind == "penalties":
                kw[f"h{i}"] = mx.array(r.integers(0, V, (B, HIST)).astype(np.int32))
            if mode == "literal":
                continue
            for a, _ in NUMERIC[kind]:
                if mode == "scalar":
                    kw[f"{a}{i}"] = vals[a]
                else:
                    kw[f"{a}{i}"] = [vals[a]] + [draw_value(kind, a, r) for _ in range(B - 1)]
    if chain["terminal"] == "sample" and mode != "literal":
        kw["seed"], kw["pos"] = (1234, 7) if mode == "scalar" else (list(range(1234, 1234 + B)),
                                                                      list(range(7, 7 + B)))
    for v in kw.values():
        if isinstance(v, mx.array):
            mx.eval(v)
    return kw


# ---- running -----------------------------------------------------------------------------------------------------

def result_array(out):
    return out.token if getattr(out, "token", None) is not None else out.probs


def compare(o2, o0):
    """None when -O2 agrees with -O0, else a description of the difference."""
    a, b = np.array(result_array(o2)), np.array(result_array(o0))
    if a.ndim == 1:
        rows = np.flatnonzero(a != b)
        return None if rows.size == 0 else {"rows": rows.tolist(), "O2": a[rows].tolist(), "O0": b[rows].tolist()}
    support = np.flatnonzero(((a > 0) != (b > 0)).any(axis=1))
    diff = float(np.abs(a - b).max())
    if support.size == 0 and diff <= 1e-4:
        return None
    return {"rows": support.tolist(), "support_diff": [int(((a[r] > 0) != (b[r] > 0)).sum()) for r in support],
            "kept_O2": [int((a[r] > 0).sum()) for r in support], "kept_O0": [int((b[r] > 0).sum()) for r in support],
            "max_abs_diff": diff}


def time_cases(steps, reps, budget_s):
    """Median ms of each step: 2 warm-up calls, then rounds running every live step once in a shuffled order."""
    rng = random.Random(0)
    for s in steps.values():
        s()
        s()
    times = {k: [] for k in steps}
    spent = {k: 0.0 for k in steps}
    for _ in range(reps):
        live = [k for k in steps if len(times[k]) < 3 or spent[k] < budget_s]
        if not live:
            break
        rng.shuffle(live)
        for k in live:
            t0 = time.perf_counter()
            steps[k]()
            dt = time.perf_counter() - t0
            times[k].append(dt * 1e3)
            spent[k] += dt
    return times


def repro_cmd(args, chain, mode, fam, B):
    return (f"python benchmarks/bench_sweep.py --seed {args.seed} --vocab {args.vocab} --chain {chain['index']} "
            f"--modes {mode} --families {fam} --batch {B} --reps 3")


def run_chain(chain, args, logits, families, modes, batches):
    progs = {}
    srcs = {m: source(chain, m) for m in modes}
    for m in modes:
        progs[m] = {lvl: samplec.compile(srcs[m], opt_level=lvl) for lvl in (2, 0)}
    cases, mismatches = [], []
    for B in batches:
        steps, meta = {}, {}
        for m in modes:
            kw = run_params(chain, m, B, args.vocab, args.seed)
            for fam in families:
                x = logits[fam, B]
                key = (m, fam)
                try:
                    o2 = progs[m][2](x, **kw)
                    mx.eval(result_array(o2))
                except Exception as e:      # noqa: BLE001 -- a failing case is reported, not fatal
                    cases.append({"B": B, "mode": m, "family": fam, "error": f"{type(e).__name__}: {e}"})
                    print(f"  [error] chain {chain['index']} {m} {fam} B={B}: {type(e).__name__}: {e}", flush=True)
                    continue
                diff = None
                if not args.no_check:
                    o0 = progs[m][0](x, **kw)
                    mx.eval(result_array(o0))
                    diff = compare(o2, o0)
                    if diff is not None:
                        mm = {"chain": chain["index"], "source": srcs[m], "mode": m, "family": fam, "B": B,
                              "diff": diff, "repro": repro_cmd(args, chain, m, fam, B)}
                        mismatches.append(mm)
                        print(f"  !!! -O2 != -O0: chain {chain['index']} mode {m} family {fam} B={B}: {diff}\n"
                              f"      {srcs[m]}\n      repro: {mm['repro']}", flush=True)

                def step(p=progs[m][2], x=x, kw=kw):
                    mx.eval(result_array(p(x, **kw)))
                steps[key] = step
                meta[key] = diff
        times = time_cases(steps, args.reps, args.budget)
        for (m, fam), ts in times.items():
            cases.append({"B": B, "mode": m, "family": fam, "ms": statistics.median(ts), "ms_min": min(ts),
                          "times_ms": [round(t, 4) for t in ts], "O0_mismatch": meta[m, fam]})
    return srcs, cases, mismatches


def ratios(chain_index, desc, cases):
    """Every ratio of the chain, on medians ("ratio") and on minima ("ratio_min"); "robust" is the smaller of the
    two, and a flag needs it over the threshold (a shared machine adds ms-long stalls to a few calls: they can move
    a median of 7 but not both statistics at once)."""
    ms = {(c["mode"], c["family"], c["B"]): (c["ms"], c["ms_min"]) for c in cases if "ms" in c}
    out = []

    def entry(kind, m, fam, B, t, base, base_name, thr):
        rmed, rmin = t[0] / base[0], t[1] / base[1]
        return {"kind": kind, "chain": chain_index, "desc": desc, "mode": m, "family": fam, "B": B,
                "ratio": rmed, "ratio_min": rmin, "robust": min(rmed, rmin), "ms": t[0], "base_ms": base[0],
                "ms_min": t[1], "base_ms_min": base[1], "base": base_name, "flag": min(rmed, rmin) > thr}
    for (m, fam, B), t in ms.items():
        if fam != "confident" and (m, "confident", B) in ms:
            out.append(entry("family", m, fam, B, t, ms[m, "confident", B], f"confident {m}", CLIFF))
        for kind, num, den in (("scalar/literal", "scalar", "literal"), ("rows/scalar", "rows", "scalar")):
            if m == num and (den, fam, B) in ms:
                out.append(entry(kind, m, fam, B, t, ms[den, fam, B], f"{fam} {den}", RUNTIME))
    return out


def severity(r):
    return r["robust"] / (CLIFF if r["kind"] == "family" else RUNTIME)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 chains, 7 rounds (~2 minutes on 2 cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chains", type=int, default=None, help="number of random chains (default 30; --quick 10)")
    ap.add_argument("--chain", type=int, action="append", default=None,
                    help="run only chain INDEX of the seed's sweep (repeatable; for a repro)")
    ap.add_argument("--vocab", type=int, default=V_DEFAULT)
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes (default 1,8)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of literal,scalar,rows")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset of " +
                    ",".join(FAMILIES) + " (confident is the base of the family ratios)")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds per case (default 15; --quick 7)")
    ap.add_argument("--budget", type=float, default=None, help="seconds of timing per case before it stops "
                    "repeating (default 1.0; --quick 0.4)")
    ap.add_argument("--no-check", action="store_true", help="skip the -O2 vs -O0 comparison")
    ap.add_argument("--top", type=int, default=15, help="rows of each worst-case list")
    ap.add_argument("--out", default=None, help="write all numbers to this JSON file")
    args = ap.parse_args()
    n_chains = args.chains if args.chains is not None else (10 if args.quick else 30)
    args.reps = args.reps if args.reps is not None else (7 if args.quick else 15)
    args.budget = args.budget if args.budget is not None else (0.4 if args.quick else 1.0)
    batches = [int(b) for b in args.batch.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    families = [f for f in args.families.split(",") if f]
    bad = [m for m in modes if m not in MODES] + [f for f in families if f not in FAMILIES]
    if bad:
        ap.error(f"unknown mode or family: {bad}")
    indices = args.chain if args.chain else list(range(n_chains))

    from samplec.backend_mlx import native
    print(f"native kernels: {'on' if native.enabled() else 'off'}; V = {args.vocab}, B in {batches}, "
          f"modes {modes}, families {families}, {len(indices)} chains, {args.reps} rounds", flush=True)
    t_start = time.perf_counter()
    logits = {}
    for fam in families:
        for B in batches:
            logits[fam, B] = mx.array(FAMILIES[fam](B, args.vocab, seed=args.seed))
            mx.eval(logits[fam, B])

    report = {"args": vars(args), "chains": [], "mismatches": []}
    all_ratios = []
    for idx in indices:
        chain = make_chain(args.seed, idx, args.vocab)
        desc = describe_chain(chain)
        print(f"chain {idx}: {desc}", flush=True)
        srcs, cases, mism = run_chain(chain, args, logits, families, modes, batches)
        rs = ratios(idx, desc, cases)
        all_ratios += rs
        report["chains"].append({"index": idx, "desc": desc, "sources": srcs, "cases": cases, "ratios": rs})
        report["mismatches"] += mism
        worst = max(rs, key=severity, default=None)
        if worst:
            print(f"  worst: {worst['kind']} {worst['robust']:.2f}x ({worst['mode']}, {worst['family']}, "
                  f"B={worst['B']}: {worst['ms']:.3f} ms vs {worst['base']} {worst['base_ms']:.3f} ms; minima "
                  f"{worst['ms_min']:.3f} vs {worst['base_ms_min']:.3f})", flush=True)

    # ---- report ----
    print(f"\n== per chain: worst ratio of each kind (family: x / confident, cliff > {CLIFF}; scalar/literal and "
          f"rows/scalar: flagged > {RUNTIME}), sorted by the worst as a multiple of its threshold")
    print(f"{'chain':>5}  {'family':>22}  {'scalar/lit':>20}  {'rows/scalar':>20}  stages")
    per_chain = []
    for c in report["chains"]:
        w = {}
        for kind in ("family", "scalar/literal", "rows/scalar"):
            rk = [r for r in c["ratios"] if r["kind"] == kind]
            w[kind] = max(rk, key=lambda r: r["robust"]) if rk else None
        sev = max((severity(r) for r in w.values() if r), default=0)
        per_chain.append((sev, c, w))
    per_chain.sort(key=lambda t: -t[0])

    def cell(r, fam=True):
        if r is None:
            return "-"
        flag = "!" if r["flag"] else " "
        where = f"{r['mode'][:3]} {r['family'][:5]}" if fam else f"{r['family'][:5]}"
        return f"{r['robust']:5.2f}x{flag} {where} B{r['B']}"
    for sev, c, w in per_chain:
        print(f"{c['index']:>5}  {cell(w['family']):>22}  {cell(w['scalar/literal'], False):>20}  "
              f"{cell(w['rows/scalar'], False):>20}  {c['desc']}")

    for kind, thr in (("family", CLIFF), ("scalar/literal", RUNTIME), ("rows/scalar", RUNTIME)):
        rk = sorted((r for r in all_ratios if r["kind"] == kind), key=lambda r: -r["robust"])
        n_flag = sum(r["flag"] for r in rk)
        print(f"\n== worst {kind} ratios ({n_flag} of {len(rk)} over {thr}x; ratio = the smaller of median / median "
              f"and min / min; ms = medians, then minima)")
        print(f"{'ratio':>7} {'med':>6} {'min':>6} {'ms':>8} {'base ms':>8} {'min ms':>8} {'base min':>8}  "
              f"{'mode':7} {'family':9} {'B':>2}  chain")
        for r in rk[:args.top]:
            print(f"{r['robust']:6.2f}{'!' if r['flag'] else ' '} {r['ratio']:6.2f} {r['ratio_min']:6.2f} "
                  f"{r['ms']:8.3f} {r['base_ms']:8.3f} {r['ms_min']:8.3f} {r['base_ms_min']:8.3f}  {r['mode']:7} "
                  f"{r['family']:9} {r['B']:>2}  #{r['chain']} {r['desc']}")

    errors = [(c["index"], k) for c in report["chains"] for k in c["cases"] if "error" in k]
    if errors:
        print(f"\n== {len(errors)} cases raised")
        for i, k in errors:
            print(f"  chain {i} {k['mode']} {k['family']} B={k['B']}: {k['error']}")
    if report["mismatches"]:
        print(f"\n!!! {len(report['mismatches'])} -O2 vs -O0 MISMATCHES")
        for mm in report["mismatches"]:
            print(f"  chain {mm['chain']} {mm['mode']} {mm['family']} B={mm['B']}: {mm['diff']}\n"
                  f"    {mm['source']}\n    repro: {mm['repro']}")
    elif not args.no_check:
        print("\n-O2 tokens equal -O0 tokens in every case")
    print(f"\n{time.perf_counter() - t_start:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
