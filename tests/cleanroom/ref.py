"""Clean-room numpy reference of the samplec contract (LANGUAGE.md, with the v2 stages of §6).

Written from the language contract alone -- without reading samplec's code, its tests or tests/reference.py.
For the §6 stages, whose contract is "the semantics of the system that defined them", it follows llama.cpp's
`src/llama-sampling.cpp` (temp_ext, DRY, mirostat v1/v2) and transformers' `EpsilonLogitsWarper` /
`EtaLogitsWarper`. It is the second, independent reference of the test suite (tests/test_cleanroom.py);
tests/reference.py is the first.

A chain is a list of `(name, kwargs)` with each row's *resolved* values (Python scalars, numpy arrays); everything
works on one row. Probabilities, entropies and thresholds are computed in float64, logits are kept in float32.

Knife-edge tracking: every boundary decision (a cut threshold, a tie at the top, a Gumbel argmax, a coin, the
mirostat k) records a relative margin in `Ctx.margin` -- the smaller, the closer the decision was to going the
other way. A float32 implementation may legitimately decide such a row differently (spec §4: "up to float rounding
at exact ties"); the differential test excuses a mismatch only on a row whose margin is below its threshold.

Readings of the contract where it leaves a choice (documented so a reader can see what is compared):
- `probs` and `candidates` are the distribution before the terminal, for every terminal (§3), mirostat included;
  `logprob` is taken at the terminal -- for `mirostat` / `mirostat_v2` under the terminal's truncated,
  renormalized set when `MIRO_TRUNC` is true (samplec's documented reading), else under `softmax(x)`.
- A row that any stage leaves with nothing kept is an error (§2, "No stage may leave a row with nothing kept"),
  and so is a stage that produces NaN or `+inf` (§2: logits holding NaN or `+inf` are an error).
- DRY caps its exponent at `int(88.7228391 / ln base)` (float32 arithmetic), as llama.cpp does, and forms the
  penalty `multiplier * base^e` in double, rounded to float32 once (llama.cpp's `std::pow(float, int)` is a
  double): the penalty is finite unless the product itself exceeds FLT_MAX.
- History ids `>= V`: the contract is silent; the reference ignores them (samplec's docs make them an error, so the
  differential test does not draw them).
"""
from __future__ import annotations

import math

import numpy as np

from .tf import threefry2x32

NEG = np.float32(-np.inf)
F32 = np.float32

MIRO_TRUNC = True   # mirostat `logprob` under the truncated set; `probs` / `candidates` are always before it


class RefError(Exception):
    """The contract makes this row an error (emptied row, NaN / +inf logits, a value out of range)."""


class Ctx:
    """Per-row record of the closest boundary decision: `margin` (relative, smaller = nearer a knife-edge) and
    `why` (which decision it was)."""

    def __init__(self):
        self.margin = math.inf
        self.why = ""

    def m(self, v, why=""):
        v = abs(float(v))
        if v < self.margin:
            self.margin = v
            self.why = why


# ---------------------------------------------------------------- randomness (§4)
def key_of(seed):
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return seed >> 32, seed & 0xFFFFFFFF


def bits(seed, c0, c1):
    """RandomBits: the first output word of Threefry at key(seed), counter (c0, c1 mod 2^32)."""
    k0, k1 = key_of(seed)
    c0 = np.asarray(c0, dtype=np.uint64)
    c1 = np.asarray(c1, dtype=np.uint64) & np.uint64(0xFFFFFFFF)
    return threefry2x32(k0, k1, c0, c1)[0]


def uniform_from_bits(b):
    b = np.asarray(b, dtype=np.uint32)
    return ((b >> np.uint32(9)).astype(np.float32) + F32(0.5)) * F32(2.0 ** -23)


def gumbel(seed, V, position):
    u = uniform_from_bits(bits(seed, np.arange(V, dtype=np.uint64), np.uint64(int(position) & 0xFFFFFFFF)))
    return -np.log(-np.log(u, dtype=np.float32), dtype=np.float32)


def coin(seed, position):
    return uniform_from_bits(bits(seed, np.uint64(0xFFFFFFFF), np.uint64(int(position) & 0xFFFFFFFF)))


# ---------------------------------------------------------------- shared pieces
def kept(x):
    return x > NEG


def softmax64(x):
    x64 = x.astype(np.float64)
    k = kept(x)
    mx = x64[k].max()
    e = np.where(k, np.exp(x64 - mx), 0.0)
    return e / e.sum()


def log_softmax64(x):
    x64 = x.astype(np.float64)
    k = kept(x)
    mx = x64[k].max()
    lse = mx + math.log(np.exp(x64[k] - mx).sum())
    return np.where(k, x64 - lse, -np.inf)


def argmax_low(x):
    return int(np.argmax(x))  # numpy returns the first occurrence: lowest id on ties


def entropy64(p):
    q = p[p > 0]
    return float(-(q * np.log(q)).sum())


def order_desc(x):
    """ids sorted by x descending, lowest id first on ties"""
    return np.lexsort((np.arange(len(x)), -x.astype(np.float64)))


# ---------------------------------------------------------------- stages (§2)
def st_temperature(x, c, t):
    t = float(t)
    if t < 0 or math.isnan(t):
        raise RefError("temperature < 0")
    if t == 0:
        i = argmax_low(x)
        y = np.full_like(x, NEG)
        y[i] = x[i]
        top = np.sort(x[kept(x)])[::-1]
        if len(top) > 1 and top[0] != top[1]:       # (an exact tie is no knife-edge: lowest id)
            c.m((top[0] - top[1]) / max(1.0, abs(top[0])), "temperature(0) tie")
        return y
    with np.errstate(all="ignore"):
        return (x / F32(t)).astype(np.float32)


def st_top_k(x, c, k):
    k = int(k)
    if k <= 0 or k >= len(x):
        return x
    vk = np.sort(x)[::-1][k - 1]
    return np.where(x >= vk, x, NEG).astype(np.float32)


def st_top_p(x, c, p):
    p = float(p)
    if not (0 < p <= 1):
        raise RefError("top_p out of (0, 1]")
    if p >= 1:
        return x
    pr = softmax64(x)
    ids = np.where(kept(x))[0]
    o = ids[np.argsort(-x[ids].astype(np.float64), kind="stable")]
    xs, ps = x[o], pr[o]
    # tokens of equal x form one group: S_i is the mass of the groups strictly above i's
    gstart = np.where(np.concatenate([[True], xs[1:] != xs[:-1]]))[0]
    gmass = np.add.reduceat(ps, gstart)
    S = np.concatenate([[0.0], np.cumsum(gmass)[:-1]])
    if len(S) > 1:
        c.m(np.min(np.abs(S[1:] - p)) / max(p, 1e-30), "top_p mass")
    keepg = S < p
    thr = xs[gstart[keepg]].min()
    nk = int(keepg.sum())
    if nk < len(gstart):   # float32 probabilities can tie two logits one ulp apart at the boundary
        a, b = float(xs[gstart[nk - 1]]), float(xs[gstart[nk]])
        c.m((a - b) / max(1.0, abs(a)) * 10, "top_p near-tie at the boundary")
    return np.where(x >= thr, x, NEG).astype(np.float32)


def st_min_p(x, c, m):
    m = float(m)
    if not (0 <= m <= 1):
        raise RefError("min_p out of [0, 1]")
    if m == 0:
        return x
    k = kept(x)
    mx = float(x[k].max())
    thr = mx + math.log(m)
    below = x[k & (x < mx)].astype(np.float64)      # (tokens equal to the maximum are always kept)
    if len(below):
        c.m(np.min(np.abs(below - thr)) / max(1.0, abs(mx)), "min_p")
    keep = k & (x.astype(np.float64) >= thr)
    keep[np.argmax(x)] = True
    return np.where(keep, x, NEG).astype(np.float32)


def st_typical_p(x, c, m):
    m = float(m)
    if m >= 1:
        return x
    pr = softmax64(x)
    k = kept(x)
    H = entropy64(pr)
    with np.errstate(divide="ignore"):
        s = np.where(k, np.abs(-np.log(np.where(k, pr, 1.0)) - H), np.inf)
    ids = np.where(k)[0]
    order = ids[np.argsort(s[ids], kind="stable")]
    cum = np.cumsum(pr[order])
    j = min(int(np.searchsorted(cum, m, side="left")), len(order) - 1)   # first index with cum >= m
    sstar = s[order[j]]
    c.m(np.min(np.abs(cum - m)) / max(m, 1e-30), "typical_p mass")
    gaps = np.abs(s[ids] - sstar)
    gaps = gaps[gaps > 0]
    if len(gaps):
        c.m(gaps.min() / max(1.0, sstar), "typical_p score gap")
    keep = k & (s <= sstar)
    keep |= x == x[k].max()
    return np.where(keep, x, NEG).astype(np.float32)


def st_top_n_sigma(x, c, n):
    n = float(n)
    if n <= 0:
        return x
    k = kept(x)
    v = x[k].astype(np.float64)
    mx = v.max()
    thr = mx - n * v.std()
    if (v < mx).any():                              # (tokens equal to the maximum are always kept)
        c.m(np.min(np.abs(v[v < mx] - thr)) / max(1.0, abs(mx)), "top_n_sigma")
    keep = k & (x.astype(np.float64) >= thr)
    return np.where(keep, x, NEG).astype(np.float32)


def st_xtc(x, c, threshold, probability, seed, position):
    probability, threshold = float(probability), float(threshold)
    if probability == 0:
        return x
    u = float(coin(seed, position))
    c.m((u - probability) / max(probability, 1e-30), "xtc coin")
    if not u < probability:
        return x
    pr = softmax64(x)
    k = kept(x)
    c.m(np.min(np.abs(pr[k] - threshold)) / max(threshold, 1e-30), "xtc threshold")
    targets = np.where(k & (pr >= threshold))[0]
    if len(targets) < 2:
        return x
    xv = x[targets]
    keep_id = targets[xv == xv.min()][0]   # the least probable target, lowest id among equals
    y = x.copy()
    y[targets[targets != keep_id]] = NEG
    return y


def st_penalties(x, c, history, last_n=-1, repeat=1.0, frequency=0.0, presence=0.0):
    h = np.asarray(history).reshape(-1)
    last_n = int(last_n)
    if last_n >= 0:
        h = h[max(0, len(h) - last_n):] if last_n > 0 else h[:0]
    h = h[h >= 0]
    V = len(x)
    cnt = np.bincount(h[h < V], minlength=V)[:V]
    y = x.copy()
    rep = F32(repeat)
    with np.errstate(all="ignore"):
        for i in np.where(cnt > 0)[0]:
            xi = y[i]
            xi = F32(xi / rep) if xi > 0 else F32(xi * rep)
            y[i] = F32(xi - F32(F32(F32(cnt[i]) * F32(frequency)) + F32(presence)))
    return y


def st_logit_bias(x, c, b):
    with np.errstate(all="ignore"):
        return (x + np.asarray(b, dtype=np.float32)).astype(np.float32)


def st_allow(x, c, mask):
    return np.where(np.asarray(mask, dtype=bool), x, NEG).astype(np.float32)


# ---------------------------------------------------------------- v2 stages (§6)
def st_dynamic_temperature(x, c, t, range_, exponent=1.0):
    """llama.cpp temp_ext: T = min_t + (max_t - min_t) * (H / ln n)^exponent over the n kept tokens."""
    t, r, e = float(t), float(range_), float(exponent)
    if r <= 0:
        return st_temperature(x, c, t)
    n = int(kept(x).sum())
    if n <= 1:
        return x   # llama.cpp leaves a row of one candidate unchanged
    lo, hi = max(0.0, t - r), t + r
    ne = entropy64(softmax64(x)) / math.log(n)
    dyn = lo + (hi - lo) * ne ** e
    return st_temperature(x, c, dyn if dyn > 0 else 0.0)


def _keep_probable(x, c, pr, thr, why):
    """Keep p_i >= thr, the most probable token always (HF's epsilon and eta warpers)."""
    k = kept(x)
    c.m(np.min(np.abs(pr[k] - thr)) / thr, why)
    keep = k & ((pr >= thr) | (x == x[k].max()))
    return np.where(keep, x, NEG).astype(np.float32)


def st_epsilon(x, c, e):
    e = float(e)
    return x if e == 0 else _keep_probable(x, c, softmax64(x), e, "epsilon")


def st_eta(x, c, e):
    e = float(e)
    if e == 0:
        return x
    pr = softmax64(x)
    return _keep_probable(x, c, pr, min(e, math.sqrt(e) * math.exp(-entropy64(pr))), "eta")


DRY_FLOAT_MAX_LOG = 88.7228391   # llama.cpp's cap: base^exponent stays below FLT_MAX


def dry_penalties(hist, V, multiplier, base, allowed_length, last_n, breakers):
    """{token: penalty} following llama.cpp's llama_sampler_dry_apply (Z-algorithm repeat lengths)."""
    multiplier, base = float(multiplier), float(base)
    allowed_length, last_n = int(allowed_length), int(last_n)
    h = [int(t) for t in np.asarray(hist).reshape(-1) if t >= 0]
    brk = set() if breakers is None else {int(b) for b in np.asarray(breakers).reshape(-1) if b >= 0}
    if multiplier == 0 or base < 1 or last_n == 0:
        return {}
    N = len(h) if last_n == -1 else min(len(h), max(last_n, 0))
    if N <= allowed_length:
        return {}
    w = h[len(h) - N:]

    def rat(i):   # the i-th token counting back from the most recent
        return w[N - 1 - i]

    rep_limit = N
    for i in range(N):
        if rat(i) in brk:
            rep_limit = i
            break
    if rep_limit < allowed_length:
        return {}
    cnt = [0] * N
    for k in range(1, N):
        n = 0
        while n + k < N and rat(n) == rat(n + k):
            n += 1
        cnt[N - 1 - k] = min(n, rep_limit)
    longest = {}
    for i in range(N - 1):
        rl = cnt[i]
        if rl >= allowed_length:
            tok = rat(N - 2 - i)
            if longest.get(tok, -1) < rl:
                longest[tok] = rl
    max_exp = 0
    if base > 1.000001:
        max_exp = int(np.float32(DRY_FLOAT_MAX_LOG) / np.float32(math.log(np.float32(base))))
    out = {}
    with np.errstate(over="ignore"):
        for tok, rl in longest.items():
            if tok in brk or tok >= V:
                continue
            ex = rl - allowed_length
            if max_exp > 0 and ex > max_exp:
                ex = max_exp
            # llama.cpp: `float penalty = multiplier * std::pow(base, exp)` -- pow(float, int) is computed in
            # double, so the product is rounded to float32 once (and is +inf only if it exceeds FLT_MAX)
            out[tok] = float(np.float32(float(np.float32(multiplier)) * float(np.float32(base)) ** ex))
    return out


def st_dry(x, c, history, multiplier, base=1.75, allowed_length=2, last_n=-1, breakers=None):
    y = x.copy()
    with np.errstate(all="ignore"):
        for tok, p in dry_penalties(history, len(x), multiplier, base, allowed_length, last_n, breakers).items():
            y[tok] = F32(y[tok] - F32(p))
    return y


# ---------------------------------------------------------------- terminals
def term_greedy(x, c):
    top = np.sort(x[kept(x)])[::-1]
    if len(top) > 1 and top[0] != top[1]:
        c.m((top[0] - top[1]) / max(1.0, abs(top[0])), "greedy")
    return argmax_low(x), {}


def _gumbel_pick(x, c, sel, seed, position):
    """Gumbel-max over the ids `sel`."""
    g = gumbel(seed, len(x), position)
    z = np.full(len(x), -np.inf, dtype=np.float32)
    z[sel] = (x[sel] + g[sel]).astype(np.float32)
    tok = argmax_low(z)
    s = np.sort(z[sel])[::-1]
    if len(s) > 1:
        c.m((s[0] - s[1]) / max(1.0, abs(s[0])), "gumbel")
    return tok


def term_sample(x, c, seed, position=0):
    return _gumbel_pick(x, c, np.where(kept(x))[0], seed, position), {}


def _truncated(x, sel):
    y = np.full_like(x, NEG)
    y[sel] = x[sel]
    return y


def term_mirostat(x, c, mu, tau, eta, m=100, seed=0, position=0):
    """llama.cpp mirostat v1: estimate s_hat from the top m probabilities, keep the top k, draw, update mu."""
    mu, tau, eta, m = float(mu), float(tau), float(eta), int(m)
    V = len(x)
    order = order_desc(x)
    order = order[kept(x)[order]]
    n = len(order)
    ps = softmax64(x)[order]
    sum_tb = sum_t2 = 0.0
    for i in range(min(m - 1, n - 1)):
        ti = math.log((i + 2) / (i + 1))
        sum_tb += ti * math.log(ps[i] / ps[i + 1])
        sum_t2 += ti * ti
    with np.errstate(all="ignore"):   # IEEE: s_hat = 0 / 0 or x / 0 gives NaN / inf, as in C
        s_hat = np.float64(sum_tb) / np.float64(sum_t2)
        eps_hat = s_hat - 1
        kf = float(np.power(eps_hat * np.power(2.0, mu) / (1 - np.power(np.float64(V), -eps_hat)),
                            np.float64(1) / s_hat))
    if math.isnan(kf):
        kint = 1
    elif kf >= 2 ** 31:
        kint = n
    else:
        kint = max(int(kf), 1)
        if 1 - 1e-3 <= kf < n + 1e-3:                # (where the floor decides how many tokens are kept)
            c.m((kf - round(kf)) / max(1.0, kf), "mirostat k")
    sel = order[:min(kint, n)]
    y = _truncated(x, sel)
    tok = _gumbel_pick(x, c, sel, seed, position)
    mu_new = mu - eta * (-math.log2(softmax64(y)[tok]) - tau)
    return tok, {"mu": mu_new, "trunc": y}


def term_mirostat_v2(x, c, mu, tau, eta, seed=0, position=0):
    """llama.cpp mirostat v2: keep the leading tokens with -log2 p <= mu (at least one), draw, update mu."""
    mu, tau, eta = float(mu), float(tau), float(eta)
    order = order_desc(x)
    order = order[kept(x)[order]]
    with np.errstate(divide="ignore"):
        sur = -np.log2(softmax64(x)[order])
    c.m(np.abs(sur - mu).min() / max(1.0, abs(mu)), "mirostat_v2 mu")
    bad = np.where(sur > mu)[0]
    n = max(bad[0] if len(bad) else len(order), 1)
    sel = order[:n]
    y = _truncated(x, sel)
    tok = _gumbel_pick(x, c, sel, seed, position)
    mu_new = mu - eta * (-math.log2(softmax64(y)[tok]) - tau)
    return tok, {"mu": mu_new, "trunc": y}


STAGES = {
    "temperature": st_temperature, "top_k": st_top_k, "top_p": st_top_p, "min_p": st_min_p,
    "typical_p": st_typical_p, "top_n_sigma": st_top_n_sigma, "xtc": st_xtc,
    "penalties": st_penalties, "logit_bias": st_logit_bias, "allow": st_allow,
    "dynamic_temperature": st_dynamic_temperature, "epsilon": st_epsilon, "eta": st_eta, "dry": st_dry,
}
TERMS = {"greedy": term_greedy, "sample": term_sample, "mirostat": term_mirostat,
         "mirostat_v2": term_mirostat_v2}


def run_row(logits_row, chain, outputs):
    """Run one row. `chain`: list of (name, kwargs) with the row's values, at most one terminal, last.
    `outputs`: {name: n} for top_logprobs / candidates, {name: None} for the others.
    Returns {output: value} (top_logprobs / candidates as (ids, values)), plus `mu` for mirostat terminals,
    `_x` (the final x before the terminal) and `_ctx` (the row's Ctx). Raises RefError where the contract
    makes the row an error."""
    c = Ctx()
    x0 = np.asarray(logits_row, dtype=np.float32)
    if np.isnan(x0).any() or np.isposinf(x0).any():
        raise RefError("NaN or +inf in the logits")
    if not kept(x0).any():
        raise RefError("a row with nothing kept in the logits")
    x = x0.copy()
    tok, extra = None, {}
    for name, kw in chain:
        if name in TERMS:
            tok, extra = TERMS[name](x, c, **kw)
            continue
        x = STAGES[name](x, c, **kw)
        if np.isnan(x).any() or np.isposinf(x).any():
            raise RefError(f"{name} produced NaN or +inf")
        if not kept(x).any():
            raise RefError(f"row emptied by {name}")
    out = {}
    if "probs" in outputs:
        out["probs"] = softmax64(x)
    if tok is not None:
        out["token"] = tok
        if "logprob" in outputs:
            at = extra["trunc"] if MIRO_TRUNC and "trunc" in extra else x
            out["logprob"] = float(log_softmax64(at)[tok])
        if "raw_logprob" in outputs:
            out["raw_logprob"] = float(log_softmax64(x0)[tok])
    if "top_logprobs" in outputs:
        ls = log_softmax64(x0)
        o = order_desc(ls)[:outputs["top_logprobs"]]
        out["top_logprobs"] = (o, ls[o])
    if "candidates" in outputs:
        o = order_desc(x)[:outputs["candidates"]]
        out["candidates"] = (o, x[o])
    if "mu" in extra:
        out["mu"] = extra["mu"]
    out["_ctx"] = c
    out["_x"] = x
    return out
