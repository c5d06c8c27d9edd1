"""samplec against the clean-room reference (tests/cleanroom/): a second reference, written from LANGUAGE.md
alone, independent of tests/reference.py.

`test_random_chains` draws random chains -- every stage of §2 and §6 (dynamic_temperature, epsilon, eta, dry,
mirostat / mirostat_v2 with `state` in and out), in random orders, with literal, run-time scalar and per-row
parameters, over several logit families, B = 1..4, V = 1..5000 -- and compares every output (token, logprob,
raw_logprob, top_logprobs, probs, candidates, the mirostat state) of -O2, and of -O0 for about a third of the
programs, with the reference: tokens and ids exactly, floats within a tolerance.

Knife-edges: the reference records, per row, the relative margin of its closest boundary decision (a cut
threshold, a Gumbel argmax, a coin, mirostat's k; see tests/cleanroom/ref.py). A row that disagrees is excused --
counted, not failed -- only when that margin is below KNIFE = 1e-4: float32 rounding may then decide the other way
(spec §4, "up to float rounding at exact ties"). Excused rows must stay a small fraction of all rows. Any other
disagreement fails the test.

Budget: `SAMPLEC_CLEANROOM_EXAMPLES` examples (default 120; `SAMPLEC_CLEANROOM_EXAMPLES=1200 python -m pytest
tests/test_cleanroom.py` runs longer). The random programs run with MLX's compile off (`@pytest.mark.uncompiled`, tests/conftest.py):
what is checked is their semantics, and compiling each new program's fused CPU kernels (the C++ compiler, seconds
per kernel on a machine with an empty $TMPDIR/mlx cache) would cost minutes on a fresh machine. Literals come from small fixed sets (random values go to run-time parameters) so that
kernels recur. The deterministic tests check RandomBits (the spec's known answers and the
MLX cross-check) with the clean-room Threefry, and the three findings of the clean-room review: the DRY penalty
stays finite at its cap (A1), a row emptied by `penalties` or `dry` is an error (A2), and mirostat's `probs` /
`candidates` are the distribution before the terminal while its `logprob` is under the truncated set (A3).
"""
from __future__ import annotations

import math
import os
import re
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import samplec
from cleanroom import ref as CR
from cleanroom.tf import threefry2x32

EXAMPLES = int(os.environ.get("SAMPLEC_CLEANROOM_EXAMPLES", "120"))
KNIFE = 1e-4               # a mismatching row is excused only if the reference's margin is below this
MAX_EXCUSED = 0.05         # ... and excused rows stay below this fraction of all rows

# ---------------------------------------------------------------------------------------------- logit families


def fam_llm(rng, V):
    """Zipf-like over a random permutation, with a boosted head and noise."""
    r = np.arange(1, V + 1, dtype=np.float64)
    x = -rng.uniform(0.6, 2.5) * np.log(r) + rng.normal(0, rng.uniform(0.05, 0.8), V)
    x[:rng.integers(1, min(V, 20) + 1)] += rng.uniform(0, 8)
    x += rng.uniform(-5, 15)
    return x[rng.permutation(V)].astype(np.float32)


def fam_flat(rng, V):
    return (rng.normal(0, rng.choice([0.0, 1e-3, 0.05, 0.3]), V) + rng.uniform(-3, 3)).astype(np.float32)


def fam_ties(rng, V):
    q = rng.choice([1.0, 2.0, 4.0, 0.5])
    return (np.round(rng.normal(0, 2.5, V) * q) / q).astype(np.float32)


def fam_neginf(rng, V):
    x = fam_llm(rng, V) if rng.random() < 0.5 else fam_ties(rng, V)
    m = rng.random(V) < rng.uniform(0.5, 0.99)
    m[rng.integers(V)] = False
    x[m] = -np.inf
    return x


def fam_one_finite(rng, V):
    x = np.full(V, -np.inf, np.float32)
    x[rng.integers(V)] = np.float32(rng.normal(0, 3))
    return x


FAMILIES = {"llm": fam_llm, "flat": fam_flat, "ties": fam_ties, "neginf": fam_neginf, "one_finite": fam_one_finite}

# ---------------------------------------------------------------------------------------------- chain generation


def f32(v):
    return float(np.float32(v))


def lit(v):
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    v = float(v)
    return "inf" if v == math.inf else "-inf" if v == -math.inf else repr(v)


class Builder:
    """Collects the sampler's parameters, their run-time values and, per row, the reference's resolved values."""

    def __init__(self, rng, B, V):
        self.rng, self.B, self.V = rng, B, V
        self.params: list[str] = []
        self.values: dict = {}
        self.n = 0
        self.modes = Counter()

    def newname(self, base):
        self.n += 1
        return f"{base}{self.n}"

    def arg(self, typ, choices, row_choices=None, rand=None):
        """A literal, a run-time scalar or a per-row vector: (source text, per-row values). `rand`, a random value,
        joins the choices of the run-time modes only: a literal is compiled into the program's MLX kernels, and
        literals from a fixed set keep the number of distinct kernels (MLX compiles each one once) down."""
        rng = self.rng
        mode = str(rng.choice(["lit", "scalar", "rows"]))
        self.modes[mode] += 1
        if mode == "lit":
            v = choices[rng.integers(len(choices))]
            return lit(v), [v] * self.B
        name = self.newname(typ[0])
        self.params.append(f"{name}: {typ}")
        extra = [] if rand is None else [rand]
        if mode == "scalar":
            choices = list(choices) + extra
            v = choices[rng.integers(len(choices))]
            self.values[name] = v
            return name, [v] * self.B
        rc = list(row_choices or choices) + extra
        vs = [rc[rng.integers(len(rc))] for _ in range(self.B)]
        self.values[name] = np.array(vs, dtype={"float": np.float32, "int": np.int32, "seed": np.uint64}[typ])
        return name, vs

    def seed(self):
        rng = self.rng
        choices = [0, 1, 7, 42, 2**32 + 3, 2**63 + 11, 2**64 - 1, int(rng.integers(0, 2**62))]
        return self.arg("seed", choices, row_choices=[int(rng.integers(0, 2**63)) for _ in range(8)] + [2**64 - 1])

    def pos(self):
        return self.arg("int", [0, 1, 5, 1000, int(self.rng.integers(0, 2**31 - 1))])

    def tokens(self, kind):
        """A `tokens` parameter: random ids (penalties) or repeating segments (dry), some rows left-padded."""
        rng, B, V = self.rng, self.B, self.V
        H = int(rng.integers(1, 40))
        if kind == "dry":
            alpha = int(rng.integers(1, min(V, 6) + 1))
            seg = rng.integers(0, min(V, alpha + 2), size=int(rng.integers(2, 6)))
            h = np.empty((B, H), np.int32)
            for b in range(B):
                row: list[int] = []
                while len(row) < H:
                    if rng.random() < 0.6:
                        row.extend(seg.tolist())
                    else:
                        row.extend(rng.integers(0, min(V, alpha + 3), size=int(rng.integers(1, 4))).tolist())
                h[b] = row[:H]
        else:
            h = rng.integers(0, V, size=(B, H)).astype(np.int32)
            if rng.random() < 0.5:
                h = np.minimum(h, int(rng.integers(1, V + 1)) - 1)
        for b in range(B):
            if rng.random() < 0.5:
                h[b, :int(rng.integers(0, H + 1))] = -1
        name = self.newname("h")
        self.params.append(f"{name}: tokens")
        self.values[name] = h
        return name, [h[b] for b in range(B)]


def gen_stage(bd, name, logits):
    """(source text of the stage, per-row kwargs of the reference's stage)."""
    rng, B, V = bd.rng, bd.B, bd.V
    if name == "temperature":
        s, v = bd.arg("float", [0.0, 0.5, 0.7, 1.0, 1.3, 2.0],
                      row_choices=[0.0, 0.5, 0.7, 1.0, 1.5], rand=f32(rng.uniform(0.05, 3)))
        return f"temperature({s})", [dict(t=a) for a in v]
    if name == "top_k":
        s, v = bd.arg("int", [0, 1, 2, 5, 40, V, V + 3, int(rng.integers(1, V + 1))],
                      row_choices=[0, 1, 3, 10, V, int(rng.integers(1, V + 1))])
        return f"top_k({s})", [dict(k=a) for a in v]
    if name == "top_p":
        s, v = bd.arg("float", [1.0, 0.95, 0.9, 0.5, 0.1],
                      row_choices=[1.0, 0.9, 0.5], rand=f32(rng.uniform(0.01, 1)))
        return f"top_p({s})", [dict(p=a) for a in v]
    if name == "min_p":
        s, v = bd.arg("float", [0.0, 0.05, 0.1, 0.3, 1.0],
                      row_choices=[0.0, 0.05, 0.2], rand=f32(rng.uniform(0, 1)))
        return f"min_p({s})", [dict(m=a) for a in v]
    if name == "typical_p":
        s, v = bd.arg("float", [1.0, 0.95, 0.9, 0.5, 0.2],
                      row_choices=[1.0, 0.9, 0.5], rand=f32(rng.uniform(0.01, 1)))
        return f"typical_p({s})", [dict(m=a) for a in v]
    if name == "top_n_sigma":
        s, v = bd.arg("float", [0.0, -1.0, 0.5, 1.0, 2.0],
                      row_choices=[0.0, 1.0, 2.0], rand=f32(rng.uniform(0, 3)))
        return f"top_n_sigma({s})", [dict(n=a) for a in v]
    if name == "xtc":
        s1, v1 = bd.arg("float", [0.05, 0.1, 0.2],
                        row_choices=[0.05, 0.1], rand=f32(rng.uniform(0, 0.5)))
        s2, v2 = bd.arg("float", [0.0, 0.5, 1.0],
                        row_choices=[0.0, 0.5, 1.0], rand=f32(rng.uniform(0, 1)))
        s3, v3 = bd.seed()
        s4, v4 = bd.pos()
        return (f"xtc({s1}, {s2}, {s3}, position = {s4})",
                [dict(threshold=a, probability=b, seed=c, position=d) for a, b, c, d in zip(v1, v2, v3, v4)])
    if name == "penalties":
        hs, hv = bd.tokens("pen")
        parts, kws = [hs], [dict(history=h) for h in hv]
        for key, typ, ch in [("last_n", "int", [-1, 0, 3, 8, 64]), ("repeat", "float", [1.0, 1.1, 1.5, 0.8]),
                             ("frequency", "float", [0.0, 0.1, 0.5, -0.3]), ("presence", "float", [0.0, 0.2, 1.0])]:
            if rng.random() < 0.7:
                s, v = bd.arg(typ, ch)
                parts.append(f"{key} = {s}")
                for kw, a in zip(kws, v):
                    kw[key] = a
        return f"penalties({', '.join(parts)})", kws
    if name == "logit_bias":
        if rng.random() < 0.5:                                     # a dict literal, maybe with a -inf ban
            ids = rng.choice(V, size=int(rng.integers(1, min(V, 5) + 1)), replace=False)
            vals = [float(np.round(rng.normal(0, 3) * 4) / 4) for _ in ids]
            if rng.random() < 0.3:
                vals[0] = -math.inf
            b = np.zeros(V, np.float32)
            b[ids] = vals
            if any(not np.isfinite(logits[r] + b).any() for r in range(B)):   # never empty a row
                vals = [0.5 if v == -math.inf else v for v in vals]
                b[ids] = vals
            txt = "{" + ", ".join(f"{int(i)}: {lit(v)}" for i, v in zip(ids, vals)) + "}"
            return f"logit_bias({txt})", [dict(b=b) for _ in range(B)]
        name_ = bd.newname("bias")
        bd.params.append(f"{name_}: bias")
        b = rng.normal(0, 1, (B, V)).astype(np.float32) * (rng.random((B, V)) < 0.3)
        b[rng.random((B, V)) < 0.1] = -np.inf
        for r in range(B):
            if not np.isfinite(logits[r] + b[r]).any():
                b[r] = 0
        bd.values[name_] = b.astype(np.float32)
        return f"logit_bias({name_})", [dict(b=b[r]) for r in range(B)]
    if name == "allow":
        name_ = bd.newname("mask")
        bd.params.append(f"{name_}: mask")
        m = rng.random((B, V)) < rng.uniform(0.2, 0.9)
        for r in range(B):                                          # never empty a row
            fin = np.where(np.isfinite(logits[r]))[0]
            m[r, fin[rng.integers(len(fin))]] = True
        bd.values[name_] = m
        return f"allow({name_})", [dict(mask=m[r]) for r in range(B)]
    if name == "dynamic_temperature":
        s1, v1 = bd.arg("float", [0.0, 0.5, 1.0, 1.5], rand=f32(rng.uniform(0, 2)))
        s2, v2 = bd.arg("float", [0.0, 0.3, 0.5, 1.0], rand=f32(rng.uniform(0, 2)))
        parts, v3 = [s1, s2], [1.0] * B
        if rng.random() < 0.6:
            s3, v3 = bd.arg("float", [1.0, 0.5, 2.0, 0.0], rand=f32(rng.uniform(0, 3)))
            parts.append(f"exponent = {s3}")
        return (f"dynamic_temperature({', '.join(parts)})",
                [dict(t=a, range_=b, exponent=c) for a, b, c in zip(v1, v2, v3)])
    if name in ("epsilon", "eta"):
        s, v = bd.arg("float", [0.0, 1e-4, 3e-4, 1e-3, 0.01, 0.1], rand=f32(10 ** rng.uniform(-5, -0.5)))
        return f"{name}({s})", [dict(e=a) for a in v]
    if name == "dry":
        hs, hv = bd.tokens("dry")
        s1, v1 = bd.arg("float", [0.0, 0.8, 2.0], rand=f32(rng.uniform(0, 3)))
        parts, kws = [hs, s1], [dict(history=h, multiplier=a) for h, a in zip(hv, v1)]
        for key, typ, ch in [("base", "float", [1.75, 2.0, 1.1, 1.0]), ("allowed_length", "int", [1, 2, 3]),
                             ("last_n", "int", [-1, 0, 4, 16, 64])]:
            if rng.random() < 0.6:
                s, v = bd.arg(typ, ch)
                parts.append(f"{key} = {s}")
                for kw, a in zip(kws, v):
                    kw[key] = a
        u = rng.random()
        if u < 0.2:
            br = sorted({int(t) for t in rng.integers(0, min(V, 6), size=int(rng.integers(1, 3)))})
            parts.append("breakers = [" + ", ".join(map(str, br)) + "]")
            for kw in kws:
                kw["breakers"] = np.array(br)
        elif u < 0.35:
            parts.append("breakers = []")
        elif u < 0.5:
            name_ = bd.newname("brk")
            bd.params.append(f"{name_}: tokens")
            bv = rng.integers(-1, min(V, 6), size=(B, 2)).astype(np.int32)
            bd.values[name_] = bv
            parts.append(f"breakers = {name_}")
            for kw, r_ in zip(kws, bv):
                kw["breakers"] = r_
        return f"dry({', '.join(parts)})", kws
    raise ValueError(name)


def gen_terminal(bd, kind, give_mu):
    rng, B = bd.rng, bd.B
    if kind == "greedy":
        return "greedy()", [dict() for _ in range(B)]
    if kind == "sample":
        s, v = bd.seed()
        if rng.random() < 0.5:
            p, pv = bd.pos()
            return f"sample({s}, position = {p})", [dict(seed=a, position=b) for a, b in zip(v, pv)]
        return f"sample({s})", [dict(seed=a) for a in v]
    tau = f32(rng.choice([5.0, 3.0, 1.0, 8.0]))
    eta = f32(rng.choice([0.1, 0.5]))
    bd.params.append("mu: state")
    if give_mu:
        mu = np.array([f32(rng.uniform(0, 12)) for _ in range(B)], np.float32)
        bd.values["mu"] = mu
        mus = [float(m) for m in mu]
    else:
        mus = [2 * tau] * B                      # a state left out starts at 2 * tau
    s, v = bd.seed()
    p, pv = bd.pos()
    if kind == "mirostat":
        m = int(rng.choice([100, 2, 10, 1000]))
        return (f"mirostat(mu, {lit(tau)}, {lit(eta)}, m = {m}, seed = {s}, position = {p})",
                [dict(mu=a, tau=tau, eta=eta, m=m, seed=b, position=c) for a, b, c in zip(mus, v, pv)])
    return (f"mirostat_v2(mu, {lit(tau)}, {lit(eta)}, {s}, position = {p})",
            [dict(mu=a, tau=tau, eta=eta, seed=b, position=c) for a, b, c in zip(mus, v, pv)])


ALL_STAGES = ("temperature", "top_k", "top_p", "min_p", "typical_p", "top_n_sigma", "xtc", "penalties",
              "logit_bias", "allow", "dynamic_temperature", "epsilon", "eta", "dry")
PRESETS = (("temperature", "top_k", "top_p"), ("top_p", "min_p", "top_k", "temperature"),
           ("penalties", "dry", "top_k", "typical_p", "top_p", "min_p", "xtc", "dynamic_temperature"),
           ("penalties", "top_k", "top_p", "min_p", "temperature"))
TERMINALS = ("sample", "sample", "greedy", "mirostat", "mirostat_v2", "none")
V_CHOICES = (1, 2, 3, 5, 8, 16, 50, 200, 1000, 5000)


def draw_case(seed):
    """Everything of one case from one seed: numpy draws it uniformly (Hypothesis's own choices favour the first
    entries of a list and small values, which left whole stages and terminals out of a short run)."""
    rng = np.random.default_rng(seed)
    V = int(rng.choice(V_CHOICES)) if rng.random() < 0.7 else int(rng.integers(1, 5001))
    B = int(rng.integers(1, 5))
    families = [str(rng.choice(sorted(FAMILIES))) for _ in range(B)]
    if rng.random() < 0.2:
        stages = list(PRESETS[rng.integers(len(PRESETS))])
    else:
        stages = [str(s) for s in rng.choice(ALL_STAGES, size=int(rng.integers(0, 6)))]
    terminal = str(rng.choice(TERMINALS))
    flags = dict(top_logprobs=rng.random() < 0.6, probs=rng.random() < 0.6, candidates=rng.random() < 0.6,
                 give_mu=rng.random() < 0.7, o0=rng.random() < 1 / 3)
    return int(rng.integers(0, 2**63)), V, B, families, stages, terminal, flags


def build_case(seed, V, B, families, stages, terminal, flags):
    rng = np.random.default_rng(seed)
    logits = np.stack([FAMILIES[f](rng, V) for f in families])
    bd = Builder(rng, B, V)
    body, chains = [], [[] for _ in range(B)]
    for name in stages:
        s, kws = gen_stage(bd, name, logits)
        body.append(s)
        for r in range(B):
            chains[r].append((name, kws[r]))
    outs = []
    if terminal != "none":
        s, kws = gen_terminal(bd, terminal, flags["give_mu"])
        body.append(s)
        for r in range(B):
            chains[r].append((terminal, kws[r]))
        outs = ["token", "logprob", "raw_logprob"]
        if flags["top_logprobs"]:
            outs.append(f"top_logprobs({int(rng.integers(1, min(V, 64) + 1))})")
        if terminal.startswith("mirostat"):
            outs.append("mu")
    if terminal == "none" or flags["probs"]:
        outs.append("probs")
    if terminal == "none" or flags["candidates"]:
        outs.append(f"candidates({int(rng.integers(1, min(V, 300) + 1))})")
    sep = str(rng.choice(["\n    ", " ", "; "]))
    src = f"sampler s({', '.join(bd.params)}) -> {', '.join(outs)} {{\n    " + sep.join(body) + "\n}\n"
    return src, logits, bd.values, chains, outs, bd.modes


def parse_outs(outs):
    d = {}
    for o in outs:
        name, _, n = o.partition("(")
        d[name] = int(n[:-1]) if n else None
    return d


# ---------------------------------------------------------------------------------------------- comparison


def close(a, b, rtol=2e-4, atol=2e-5):
    a, b = float(a), float(b)
    if a == b:
        return True
    if not (math.isfinite(a) and math.isfinite(b)):
        return False
    return abs(a - b) <= atol + rtol * abs(b)


def row_problems(out, r, e, od, x0):
    """The differences between samplec's row `r` and the reference's outputs `e` (empty: the row agrees)."""
    bad = []
    if "token" in od:
        tok = int(np.array(out.token)[r])
        if tok != e["token"]:
            return [f"token {tok} != {e['token']}"]
    for key in ("logprob", "raw_logprob"):
        if key in od:
            g = float(np.array(getattr(out, key))[r])
            if not close(g, e[key]):
                bad.append(f"{key} {g!r} != {e[key]!r}")
    if "mu" in od:
        g = float(np.array(out.mu)[r])
        if not close(g, e["mu"], rtol=1e-3, atol=1e-3):
            bad.append(f"mu {g!r} != {e['mu']!r}")
    if "probs" in od:
        g = np.array(out.probs)[r].astype(np.float64)
        d = np.abs(g - e["probs"]) > 2e-6 + 2e-4 * np.abs(e["probs"])
        if d.any():
            i = int(np.argmax(np.abs(g - e["probs"])))
            bad.append(f"probs differ at {int(d.sum())} ids, e.g. [{i}] {g[i]!r} != {e['probs'][i]!r}")
    for key in ("top_logprobs", "candidates"):
        if key not in od:
            continue
        o = getattr(out, key)
        gi, gv = np.array(o.ids)[r].astype(np.int64), np.array(o.values)[r].astype(np.float64)
        ei, ev = e[key]
        if len(gi) != len(ei):
            bad.append(f"{key}: {len(gi)} entries != {len(ei)}")
            continue
        if len(set(gi.tolist())) != len(gi) or gi.min() < 0 or gi.max() >= len(x0):
            bad.append(f"{key}: ids {gi.tolist()} are not distinct token ids")
            continue
        j = next((j for j in range(len(ev)) if not close(gv[j], ev[j])), None)
        if j is not None:
            bad.append(f"{key}[{j}] value {gv[j]!r} (id {gi[j]}) != {ev[j]!r} (id {ei[j]})")
            continue
        # an id that differs must carry (in the reference) the value of the reference's id at that place, within
        # float rounding; on an exact tie (both removed included) the lowest id comes first
        score = e["_x"] if key == "candidates" else CR.log_softmax64(x0)
        raw = e["_x"] if key == "candidates" else x0
        for j in range(len(ei)):
            if gi[j] == ei[j]:
                continue
            if not close(float(score[gi[j]]), ev[j], rtol=1e-6, atol=1e-7):
                bad.append(f"{key}[{j}] id {gi[j]} != {ei[j]}")
                break
            if raw[gi[j]] == raw[ei[j]]:
                # top_logprobs read the logits themselves: their ties are exact in samplec too. The final x of
                # candidates may differ from the reference's by rounding (dynamic_temperature's T, dry's power):
                # the tie counts where samplec's own values show it.
                k = np.nonzero(gi == ei[j])[0]
                if key == "top_logprobs" or (gv[k[0]] == gv[j] if len(k) else gv[j] == ev[j]):
                    bad.append(f"{key}[{j}] id {gi[j]} != {ei[j]} (tied: lowest id first)")
                    break
    return bad


_ROWS_RE = re.compile(r"\(rows? ([0-9, ]+)\)")


def check_case(src, logits, values, chains, outs, opt_level, tally):
    """Run one program at `opt_level` and compare every row; returns the list of failures (strings)."""
    od = parse_outs(outs)
    B = logits.shape[0]
    ref_rows, ref_err = [], {}
    for r in range(B):
        try:
            ref_rows.append(CR.run_row(logits[r], chains[r], od))
        except CR.RefError as ex:
            ref_rows.append(None)
            ref_err[r] = str(ex)
    try:
        out = samplec.compile(src, opt_level=opt_level)(logits, **values)
    except samplec.SamplecError as ex:
        tally["error rows"] += B
        if not ref_err:
            return [f"-O{opt_level}: samplec raised {ex!s} where the reference accepts every row"]
        m = _ROWS_RE.search(str(ex))
        named = {int(t) for t in m.group(1).split(",")} if m else set()
        if not named or not named <= set(ref_err):
            return [f"-O{opt_level}: samplec's error {ex!s} names rows {sorted(named)}; the reference rejects "
                    f"{ref_err}"]
        return []
    fails = []
    for r in range(B):
        tally["rows"] += 1
        if r in ref_err:
            fails.append(f"-O{opt_level} row {r}: samplec gave a result; the reference: {ref_err[r]}")
            continue
        e = ref_rows[r]
        ctx = e["_ctx"]
        if ctx.margin < KNIFE:
            tally["near rows"] += 1
        bad = row_problems(out, r, e, od, logits[r])
        if not bad:
            continue
        if ctx.margin < KNIFE:
            tally["excused rows"] += 1
            continue
        fails.append(f"-O{opt_level} row {r} (margin {ctx.margin:.3g} at {ctx.why or '-'}): " + "; ".join(bad))
    return fails


TALLY: Counter = Counter()


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate],    # (shrinking a seed gives another case, not a smaller one)
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.integers(0, 2**64 - 1))
def _random_chains(case_seed):
    seed, V, B, families, stages, terminal, flags = draw_case(case_seed)
    src, logits, values, chains, outs, modes = build_case(seed, V, B, families, stages, terminal, flags)
    TALLY["programs"] += 1
    TALLY.update(f"stage {s}" for s in stages)
    TALLY[f"terminal {terminal}"] += 1
    TALLY.update(f"param {m}" for m in modes.elements())
    fails = check_case(src, logits, values, chains, outs, 2, TALLY)
    if flags["o0"]:
        TALLY["-O0 programs"] += 1
        fails += check_case(src, logits, values, chains, outs, 0, TALLY)
    assert not fails, f"case seed {case_seed}\n{src}families {families}\n" + "\n".join(fails)


@pytest.mark.uncompiled     # (the programs' semantics, op by op: no CPU JIT compile of each new program's kernels)
def test_random_chains():
    TALLY.clear()
    _random_chains()
    rows, excused = TALLY["rows"], TALLY["excused rows"]
    print("\ncleanroom tally:", dict(sorted(TALLY.items())))
    assert rows > 0
    assert excused <= MAX_EXCUSED * rows, f"{excused} of {rows} rows excused as knife-edges"
    if EXAMPLES >= 100:                               # a run of the default size draws every stage and terminal
        for key in [f"stage {s}" for s in ALL_STAGES] + [f"terminal {t}" for t in set(TERMINALS)]:
            assert TALLY[key] > 0, f"{key} never drawn"


# ---------------------------------------------------------------------------------------------- RandomBits (§4)


def test_threefry_known_answers():
    assert [int(v) for v in threefry2x32(0, 0, 0, 0)] == [0x6B200159, 0x99BA4EFE]
    f = 0xFFFFFFFF
    assert [int(v) for v in threefry2x32(f, f, f, f)] == [0x1CB996FC, 0xBB002BE7]


@pytest.mark.parametrize("seed", [0, 1, 7, 123456789, 2**32 - 1, 2**32, 2**40 + 5, 2**63, 2**64 - 1])
def test_threefry_cross_check_with_mlx(seed):
    """spec §4: mlx.random.uniform(shape=(2,), key=key(s))[0] is built from the bits at counter (0, 1)."""
    bits = np.uint32(CR.bits(seed, 0, 1))
    expected = min(np.float32(bits) / np.float32(4294967295), np.nextafter(np.float32(1), np.float32(0)))
    assert np.array(mx.random.uniform(shape=(2,), key=mx.random.key(seed)))[0] == expected
    assert list(CR.key_of(seed)) == np.array(mx.random.key(seed)).tolist()


@pytest.mark.parametrize("seed,position", [(0, 0), (2**64 - 1, 2**31 - 1), (2**63 + 11, 7), (12345, 4096)])
def test_sample_is_gumbel_max_of_randombits(seed, position):
    """A flat row: `sample` picks argmax of the Gumbel noise itself, which the reference derives from tf.py."""
    V = 257
    prog = samplec.compile("sampler s(seed: seed, p: int) -> token { sample(seed, position = p) }")
    tok = int(np.array(prog(np.zeros((1, V), np.float32), seed=seed, p=position).token)[0])
    assert tok == int(np.argmax(CR.gumbel(seed, V, position)))


# ---------------------------------------------------------------------------------------------- review findings


def _one_row(src, x, chain, **values):
    """samplec's outputs and the reference's for a one-row program."""
    x = np.asarray(x, np.float32)[None]
    out = samplec.compile(src)(x, **values)
    names = src.split("->")[1].split("{")[0]
    return out, CR.run_row(x[0], chain, parse_outs([o.strip() for o in names.split(",")]))


@pytest.mark.parametrize("L,multiplier", [(160, 1.0), (161, 1.0), (400, 1.0), (161, 0.5), (200, 1.3)])
def test_A1_dry_penalty_stays_finite_at_its_cap(L, multiplier):
    """With the default base 1.75 the exponent caps at int(88.7228391 / ln 1.75) = 158: a repeat of 161 zeros
    (n = 159 ... capped) subtracts a finite multiplier * 1.75^158 ~ 2.5e38, never -inf."""
    src = f"sampler s(h: tokens) -> token, logprob, probs, candidates(4) {{ dry(h, {multiplier!r}) greedy() }}"
    h = np.zeros((1, L), np.int32)
    chain = [("dry", dict(history=h[0], multiplier=multiplier)), ("greedy", {})]
    out, e = _one_row(src, [1.0, 0.5, 0.2, 0.1], chain, h=h)
    ei, ev = e["candidates"]
    assert np.isfinite(ev).all()
    assert np.array(out.candidates.ids)[0].tolist() == ei.tolist()
    np.testing.assert_allclose(np.array(out.candidates.values)[0], ev, rtol=1e-5)
    # the only kept token penalized at the cap: still kept, token 0 with probability 1
    out, e = _one_row(src, [1.0, -np.inf, -np.inf, -np.inf], chain, h=h)
    assert (int(np.array(out.token)[0]), float(np.array(out.logprob)[0])) == (e["token"], e["logprob"]) == (0, 0.0)
    np.testing.assert_array_equal(np.array(out.probs)[0], e["probs"])


def test_A1_dry_penalty_at_the_cap_of_base_2():
    """At the cap of base 2 (e = 128), 2^128 is past float32 while llama.cpp's multiplier * pow (a double) is
    0.5 * 2^128 = 1.7e38: finite."""
    src = "sampler s(h: tokens) -> candidates(4) { dry(h, 0.5, base = 2.0) }"
    h = np.zeros((1, 131), np.int32)                     # n - allowed_length = 129 -> capped at 128
    out, e = _one_row(src, [1.0, 0.5, 0.2, 0.1], [("dry", dict(history=h[0], multiplier=0.5, base=2.0))], h=h)
    assert e["candidates"][1][-1] == np.float32(-(2.0**127))
    np.testing.assert_allclose(np.array(out.candidates.values)[0], e["candidates"][1], rtol=1e-6)


@pytest.mark.parametrize("src,x,h", [
    ("sampler s(h: tokens) -> token, logprob, probs { penalties(h, presence = 3e38) greedy() }",
     [[0.5, 0.25, 0.125], [-1e38, -np.inf, -np.inf]], [[1], [0]]),
    ("sampler s(h: tokens) -> token, logprob { penalties(h, repeat = 1e38) greedy() }",
     [[1.0, 2.0], [-10.0, -np.inf]], [[0], [0]]),
    ("sampler s(h: tokens) -> token, logprob { dry(h, 3e38, base = 1.0) greedy() }",
     [[1.0, 2.0, 3.0], [-2e38, -np.inf, -np.inf]], [[1, 2, 1, 2], [0, 0, 0, 0]]),
])
def test_A2_rows_emptied_by_penalties_or_dry_are_errors(src, x, h):
    """§2: no stage may leave a row with nothing kept -- row 0 is fine, row 1 loses its only token."""
    x, h = np.array(x, np.float32), np.array(h, np.int32)
    stage = "dry" if "dry(" in src else "penalties"
    kw = dict(multiplier=3e38, base=1.0) if stage == "dry" else (
        dict(presence=3e38) if "presence" in src else dict(repeat=1e38))
    CR.run_row(x[0], [(stage, dict(history=h[0], **kw)), ("greedy", {})], {"token": None})
    with pytest.raises(CR.RefError, match="emptied"):
        CR.run_row(x[1], [(stage, dict(history=h[1], **kw)), ("greedy", {})], {"token": None})
    with pytest.raises(samplec.SamplecError, match=r"\(row 1\)"):
        samplec.compile(src)(x, h=h)


@pytest.mark.parametrize("terminal", ["mirostat_v2(mu, 5.0, 0.1, seed)", "mirostat(mu, 5.0, 0.1, seed = seed)"])
def test_A3_mirostat_probs_are_before_the_terminal(terminal):
    """§3: `probs` and `candidates` are softmax(x) / x before the terminal, mirostat included; `logprob` is under
    the terminal's truncated set (the reference's MIRO_TRUNC reading)."""
    assert CR.MIRO_TRUNC
    src = f"sampler s(mu: state, seed: seed) -> token, logprob, probs, candidates(4), mu {{ {terminal} }}"
    x = np.array([3.0, 2.0, 1.0, 0.0], np.float32)
    name = terminal.split("(")[0]
    kw = dict(mu=1.0, tau=5.0, eta=f32(0.1), seed=0)
    out, e = _one_row(src, x, [(name, kw)], mu=np.array([1.0], np.float32), seed=0)
    x64 = x.astype(np.float64)
    sm = np.exp(x64 - x64.max()) / np.exp(x64 - x64.max()).sum()
    np.testing.assert_allclose(e["probs"], sm, rtol=1e-12)
    np.testing.assert_allclose(np.array(out.probs)[0], sm, rtol=1e-6)
    assert np.array(out.candidates.ids)[0].tolist() == e["candidates"][0].tolist() == [0, 1, 2, 3]
    np.testing.assert_array_equal(np.array(out.candidates.values)[0], x)
    assert int(np.array(out.token)[0]) == e["token"]
    # mu = 1 keeps only the top token (-log2 0.644 = 0.63 <= 1 < -log2 0.237): logprob 0 under the truncated set
    assert float(np.array(out.logprob)[0]) == pytest.approx(e["logprob"], abs=1e-6)
    if name == "mirostat_v2":
        assert e["logprob"] == 0.0
    assert float(np.array(out.mu)[0]) == pytest.approx(e["mu"], abs=1e-5)
