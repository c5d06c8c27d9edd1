"""Fuzz calls: bad and odd run-time inputs to compiled examples at -O0 and -O2 -- NaN/inf logits, every dtype and
shape, strided views, out-of-range and wrong-length per-row values, history ids >= V or negative or wide,
all-false masks, strings and objects where numbers go, unknown keywords.

A call must return outputs or raise a SamplecError; 'silent' is a call that returned although its input broke
the contract (NaN logits, a value out of range), or that returned other tokens than the same values given in the
canonical form (a view, another integer width)."""
from __future__ import annotations

import random
import time

import mlx.core as mx
import numpy as np

import samplec
from fuzz.common import HANG_S, Counts, Deadline

SRC = """sampler f(t: float = 0.8, k: int = 40, p: float = 0.95, seed: seed = 0, h: tokens, m: mask, b: bias)
        -> token, logprob, top_logprobs(3) {
    allow(m)
    logit_bias(b)
    penalties(h, repeat = 1.2, frequency = 0.1)
    top_k(k)
    top_p(p)
    temperature(t)
    sample(seed)
}"""

BAD_VALUES = {"t": [-1.0, float("nan"), "0.7", "rows+1", object(), 1j, b"1", [[0.5]]],
              "k": [2**31, -2**31 - 1, 2.5, float("inf"), "40", "rows+1"],
              "p": [0.0, 1.5, -0.1, float("nan"), "rows+1"],
              "seed": [-1, 2**64, 1.5, "7", "rows+1"]}


def canonical(B, V, rng):
    x = rng.standard_normal((B, V)).astype(np.float32)
    return x, dict(h=rng.integers(-1, V, (B, 6)).astype(np.int32), m=np.ones((B, V), bool),
                   b=np.zeros((B, V), np.float32), seed=[int(s) for s in rng.integers(0, 2**32, B)])


def variants(x, kw, rng, V):
    """(name, logits, kwargs, expectation): 'same' = the canonical tokens, 'error' = a SamplecError."""
    B = x.shape[0]
    yield "view", np.ascontiguousarray(x[:, ::-1])[:, ::-1], kw, "same"
    yield "f16", x.astype(np.float16), kw, "any"
    yield "f64", x.astype(np.float64), kw, "same"
    yield "mx", mx.array(x), {**kw, "h": mx.array(kw["h"])}, "same"
    yield "int64 h", x, {**kw, "h": kw["h"].astype(np.int64)}, "same"
    neg = kw["h"].astype(np.int64)
    neg[neg < 0] = -(2 ** 40)
    yield "wide negative h", x, {**kw, "h": neg}, "same"
    hbad = kw["h"].astype(np.int64).copy()
    hbad[rng.integers(B), 0] = V + rng.integers(0, 2**33)
    yield "h >= V", x, {**kw, "h": hbad}, "error"
    yield "h >= V mx", x, {**kw, "h": mx.array(hbad)}, "error"
    xn = x.copy()
    xn[rng.integers(B), rng.integers(V)] = rng.choice([np.nan, np.inf])
    yield "nan/inf logits", xn, kw, "error"
    yield "all -inf row", np.where(np.arange(B)[:, None] == 0, -np.inf, x).astype(np.float32), kw, "error"
    m0 = kw["m"].copy()
    m0[rng.integers(B)] = False
    yield "all-false mask", x, {**kw, "m": m0}, "error"
    bn = kw["b"].copy()
    bn[rng.integers(B), rng.integers(V)] = np.nan
    yield "nan bias", x, {**kw, "b": bn}, "error"
    yield "nan bias mx", x, {**kw, "b": mx.array(bn)}, "error"
    yield "wrong B bias", x, {**kw, "b": np.zeros((B + 1, V), np.float32)}, "error"
    yield "3-D logits", x[None], kw, "error"
    yield "empty logits", np.zeros((B, 0), np.float32), kw, "error"
    yield "string logits", "logits", kw, "error"
    yield "unknown keyword", x, {**kw, "tempreature": 0.5}, "error"
    name = rng.choice(list(BAD_VALUES))
    bad = BAD_VALUES[name][rng.integers(len(BAD_VALUES[name]))]
    if isinstance(bad, str) and bad == "rows+1":         # a vector one longer than the batch
        bad = [1] * (B + 1)
    yield f"bad {name}={bad!r}", x, {**kw, name: bad}, "error"


def fuzz(seconds: float, seed: int = 0) -> Counts:
    pick = random.Random(seed)
    progs = {o: samplec.compile(SRC, opt_level=o) for o in (0, 2)}
    counts = Counts("runtime")
    deadline = Deadline(seconds)
    while deadline:
        rng = np.random.default_rng(pick.randrange(2**32))
        B, V = pick.randint(1, 4), pick.choice([5, 64, 1000, 30000])
        x, kw = canonical(B, V, rng)
        opt = pick.choice([0, 2])
        prog = progs[opt]
        want = np.array(prog(x, **kw).token).tolist()
        for name, xs, args, expect in variants(x, kw, rng, V):
            t = time.perf_counter()
            try:
                got = np.array(prog(xs, **args).token).tolist()
                kind = "ok" if expect == "any" or expect == "same" and got == want else "silent"
                what = "" if kind == "ok" else f"{name}: returned {got} (canonical {want})"
            except samplec.SamplecError as e:
                kind, what = ("rejected", "") if expect == "error" else ("traceback", f"{name}: refused: {e}")
            except Exception as e:  # noqa: BLE001
                kind, what = "traceback", f"{name}: {type(e).__name__}: {e}"
            if time.perf_counter() - t > HANG_S:
                kind, what = "hang", f"{name}: {time.perf_counter() - t:.1f} s"
            counts.record(kind, (name, opt, B, V), what)
    return counts
