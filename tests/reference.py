"""Independent numpy reference implementation (test oracle) of the samplec semantics.

Written from the language contract (LANGUAGE.md §2-§4) only; it deliberately does not import
or look at anything in ``samplec/``. Everything works on ONE row at a time: ``x`` is a float32
vector of shape [V] where ``-inf`` means "removed". Every stage returns a new array (never
mutates its input). Arithmetic the spec declares float32 is done in float32.

Public API
----------
Randomness (§4):
    threefry2x32(key, counter) -> (uint32 array, uint32 array)
    key_of(seed) -> (hi, lo)
    bits_for_tokens(seed, position, V) -> uint32[V]
    uniform(bits) -> float32
    gumbel(bits) -> float32
    xtc_coin(seed, position) -> float32
Stages (§2), each ``f(x, ...) -> new x``:
    temperature, top_k, top_p, min_p, typical_p, top_n_sigma, xtc, penalties, logit_bias, allow
Terminals: greedy(x) -> int, sample(x, seed, position=0) -> int
Outputs (§3): run_chain, top_logprobs, candidates, softmax32, softmax64, log_softmax64
Checks: check_logits(row)
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = [
    "MASK32",
    "threefry2x32",
    "key_of",
    "bits_for_tokens",
    "uniform",
    "gumbel",
    "xtc_coin",
    "softmax32",
    "softmax64",
    "log_softmax64",
    "check_logits",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "top_n_sigma",
    "xtc",
    "penalties",
    "logit_bias",
    "allow",
    "greedy",
    "sample",
    "run_chain",
    "top_logprobs",
    "candidates",
    "STAGES",
    "TERMINALS",
]

MASK32 = 0xFFFFFFFF
F32 = np.float32
NEG_INF = F32(-np.inf)

# --------------------------------------------------------------------------------------------
# §4 Randomness: Threefry-2x32, 20 rounds (Random123), as used by MLX's random::bits.
# --------------------------------------------------------------------------------------------

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_SKEIN_PARITY = 0x1BD11BDA


def _as_u32(v: Any) -> np.ndarray:
    """Int / int array -> uint32 array, reducing modulo 2**32 (so -1 -> 0xFFFFFFFF)."""
    if isinstance(v, (int, np.integer)):
        return np.asarray(int(v) & MASK32, dtype=np.uint32)
    a = np.asarray(v)
    if a.dtype == np.uint32:
        return a
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"counter must be integer, got dtype {a.dtype}")
    if np.issubdtype(a.dtype, np.unsignedinteger):
        return (a.astype(np.uint64) & np.uint64(MASK32)).astype(np.uint32)
    return (a.astype(np.int64) & np.int64(MASK32)).astype(np.uint32)


def _rotl32(v: np.ndarray, r: int) -> np.ndarray:
    return (v << np.uint32(r)) | (v >> np.uint32(32 - r))


def threefry2x32(key: tuple[int, int], counter: tuple[Any, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Threefry-2x32-20 block function, vectorized over the (broadcast) counter words.

    ``key`` = (k0, k1) 32-bit words; ``counter`` = (c0, c1), ints or integer arrays.
    Returns the two 32-bit output words as uint32 arrays of the broadcast counter shape.
    """
    k0 = np.uint32(int(key[0]) & MASK32)
    k1 = np.uint32(int(key[1]) & MASK32)
    ks = (k0, k1, np.uint32(int(k0) ^ int(k1) ^ _SKEIN_PARITY))
    c0, c1 = np.broadcast_arrays(_as_u32(counter[0]), _as_u32(counter[1]))
    with np.errstate(over="ignore"):
        x0 = (c0 + ks[0]).astype(np.uint32)
        x1 = (c1 + ks[1]).astype(np.uint32)
        for i in range(5):  # 5 x 4 = 20 rounds, key injection after every 4
            for r in _ROTATIONS[i % 2]:
                x0 = (x0 + x1).astype(np.uint32)
                x1 = _rotl32(x1, r) ^ x0
            x0 = (x0 + ks[(i + 1) % 3]).astype(np.uint32)
            x1 = (x1 + ks[(i + 2) % 3] + np.uint32(i + 1)).astype(np.uint32)
    return np.asarray(x0, dtype=np.uint32), np.asarray(x1, dtype=np.uint32)


def key_of(seed: int) -> tuple[int, int]:
    """MLX ``random::key(seed)``: (seed >> 32, seed & 0xFFFFFFFF) of an unsigned 64-bit seed."""
    s = int(seed)
    if s < 0 or s >= 1 << 64:
        raise ValueError(f"seed {seed} is not an unsigned 64-bit integer")
    return (s >> 32) & MASK32, s & MASK32


def bits_for_tokens(seed: int, position: int, V: int) -> np.ndarray:
    """RandomBits of ``sample``: token i uses counter (i, position), first output word."""
    ids = np.arange(V, dtype=np.uint32)
    return threefry2x32(key_of(seed), (ids, position))[0]


_TWO_M23 = F32(2.0**-23)


def uniform(bits: Any) -> np.ndarray:
    """u = ((bits >> 9) + 0.5) * 2**-23 in float32; strictly inside (0, 1). Exact in float32."""
    b = _as_u32(bits)
    return ((b >> np.uint32(9)).astype(F32) + F32(0.5)) * _TWO_M23


def gumbel(bits: Any) -> np.ndarray:
    """g = -log(-log(u)) computed in float32."""
    u = uniform(bits)
    return -np.log(-np.log(u))


def xtc_coin(seed: int, position: int = 0) -> np.float32:
    """The xtc coin u: counter (0xFFFFFFFF, position), first word, mapped by ``uniform``."""
    w0, _ = threefry2x32(key_of(seed), (MASK32, position))
    return F32(uniform(w0))


# --------------------------------------------------------------------------------------------
# shared pieces
# --------------------------------------------------------------------------------------------


def _row(x: Any) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"expected a 1-D row, got shape {a.shape}")
    return a.astype(F32, copy=True)


def _kept(x: np.ndarray) -> np.ndarray:
    return np.isfinite(x)


def _require_nonempty(x: np.ndarray, what: str, row: int | None = None) -> None:
    if not np.any(_kept(x)):
        where = f"row {row}" if row is not None else "row"
        raise ValueError(f"{where}: {what} left nothing kept")


def _num(name: str, v: Any) -> float:
    f = float(v)
    if np.isnan(f):
        raise ValueError(f"{name} is NaN")
    return f


def softmax32(x: Any) -> np.ndarray:
    """p = exp(x - max) / sum over kept tokens, all in float32 (removed tokens get 0)."""
    x = np.asarray(x, dtype=F32)
    m = np.max(x)
    e = np.exp(x - m)  # exp(-inf) = 0
    return (e / np.sum(e, dtype=F32)).astype(F32)


def log_softmax64(x: Any) -> np.ndarray:
    """log_softmax in float64 (removed tokens -> -inf)."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x)
    z = x - m
    return z - np.log(np.sum(np.exp(z)))


def softmax64(x: Any) -> np.ndarray:
    return np.exp(log_softmax64(x))


def check_logits(row: Any) -> None:
    """Logits holding NaN or +inf are an error (-inf is allowed: already removed)."""
    a = np.asarray(row)
    if np.any(np.isnan(a)):
        raise ValueError("logits contain NaN")
    if np.any(np.isposinf(a)):
        raise ValueError("logits contain +inf")


def _keep_max(keep: np.ndarray, x: np.ndarray) -> np.ndarray:
    """OR-in the most probable token(s) (all tokens equal to max(x))."""
    return keep | (x == np.max(x))


def _apply(x: np.ndarray, keep: np.ndarray) -> np.ndarray:
    return np.where(keep & _kept(x), x, NEG_INF).astype(F32)


# --------------------------------------------------------------------------------------------
# §2 stages
# --------------------------------------------------------------------------------------------


def temperature(x: Any, t: float) -> np.ndarray:
    """t > 0: x / t (float32). t == 0: keep only argmax (lowest id). t < 0: error. t == 1 identity."""
    x = _row(x)
    t = _num("temperature", t)
    if t < 0:
        raise ValueError(f"temperature must be >= 0, got {t}")
    if t == 0:
        out = np.full_like(x, NEG_INF)
        i = int(np.argmax(x))
        out[i] = x[i]
        return out
    if t == 1:
        return x
    kept = _kept(x)
    with np.errstate(invalid="ignore", over="ignore"):  # -inf / inf; a tiny t
        y = x / F32(t)
        top = np.max(np.where(kept, x, NEG_INF)) / F32(t)
    if not np.isfinite(top):   # the row's largest over t leaves float32 (docs/language.md): the argmax alone
        return temperature(x, 0.0)
    return np.where(kept, y, NEG_INF).astype(F32)  # keeps -inf removed even for t = inf


def top_k(x: Any, k: int) -> np.ndarray:
    """Keep x_i >= v_k, v_k the k-th largest of x (ties at v_k kept). Off: k <= 0 or k >= V."""
    x = _row(x)
    k = int(k)
    V = x.shape[0]
    if k <= 0 or k >= V:
        return x
    vk = np.partition(x, V - k)[V - k]  # k-th largest (may be -inf: then keep all kept)
    return _apply(x, _keep_max(x >= vk, x))


def top_p(x: Any, p: float) -> np.ndarray:
    """Keep i iff S_i < p, S_i = sum of p_j over p_j > p_i (p_j float32; the running sum in float64: a sequential
    float32 cumsum drifts by ~1e-3 over 10^5 tokens -- a flat row at top_p(0.999) summed to 0.99873 and kept every
    token -- where the contract's sums are accurate to a few ulps). p in (0, 1]; off: p >= 1."""
    x = _row(x)
    p = _num("top_p", p)
    if not (0.0 < p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    if p >= 1.0:
        return x
    probs = softmax32(x)
    order = np.argsort(-probs, kind="stable")  # descending, ties by id
    ps = probs[order]
    csum = np.cumsum(ps, dtype=np.float64)
    excl = np.concatenate([np.zeros(1), csum[:-1]])
    n = ps.shape[0]
    idx = np.arange(n)
    new_group = np.ones(n, dtype=bool)
    new_group[1:] = ps[1:] != ps[:-1]
    group_start = np.maximum.accumulate(np.where(new_group, idx, 0))
    s_sorted = excl[group_start]
    S = np.empty(n)
    S[order] = s_sorted
    keep = S < float(F32(p))
    return _apply(x, _keep_max(keep, x))


def min_p(x: Any, m: float) -> np.ndarray:
    """Keep x_i >= max(x) + log(m) (float32). m in [0, 1]; off: m == 0."""
    x = _row(x)
    m = _num("min_p", m)
    if not (0.0 <= m <= 1.0):
        raise ValueError(f"min_p must be in [0, 1], got {m}")
    if m == 0.0:
        return x
    thr = F32(np.max(x)) + np.log(F32(m))
    return _apply(x, _keep_max(x >= thr, x))


def typical_p(x: Any, m: float) -> np.ndarray:
    """Locally typical sampling. Off: m >= 1. m < 0 or NaN: error (see module notes).

    H = -sum p log p over kept tokens (0 log 0 = 0), s_i = |-log p_i - H| (float32);
    sort kept tokens ascending by s (stable, ties by id); s* = s at the first index where the
    float32 cumulative p >= m (never reached: s* = largest finite s); keep s_i <= s*, plus
    every token equal to max(x).
    """
    x = _row(x)
    m = _num("typical_p", m)
    if m < 0:
        raise ValueError(f"typical_p must be >= 0, got {m}")
    if m >= 1.0:
        return x
    kept = _kept(x)
    probs = softmax32(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.log(probs)  # -inf where p == 0
        plogp = np.where(probs > 0, probs * logp, F32(0)).astype(F32)
    H = -np.sum(plogp[kept], dtype=F32)
    s = np.abs(-logp - H).astype(F32)  # inf where p underflowed to 0
    ids = np.flatnonzero(kept)
    sk = s[ids]
    order = np.argsort(sk, kind="stable")
    cs = np.cumsum(probs[ids][order], dtype=np.float64)     # (float64: see top_p)
    hit = np.flatnonzero(cs >= float(F32(m)))
    if hit.size:
        s_star = sk[order][hit[0]]
    else:
        fin = sk[np.isfinite(sk)]
        s_star = np.max(fin)
    keep = kept & (s <= s_star)
    return _apply(x, _keep_max(keep, x))


def top_n_sigma(x: Any, n: float) -> np.ndarray:
    """Keep x_i >= max(x) - n * std(x), population std over kept (finite) x, float32. Off: n <= 0."""
    x = _row(x)
    n = _num("top_n_sigma", n)
    if n <= 0:
        return x
    kept = _kept(x)
    vals = x[kept]
    sd = np.std(vals, dtype=F32)  # ddof = 0
    with np.errstate(invalid="ignore"):
        thr = F32(np.max(vals)) - F32(n) * F32(sd)  # inf*0 -> NaN: comparisons false, max OR-ed in
    return _apply(x, _keep_max(x >= thr, x))


def xtc(x: Any, threshold: float, probability: float, seed: int, position: int = 0) -> np.ndarray:
    """Exclude Top Choices. Off: probability == 0.

    Coin u = xtc_coin(seed, position); if u < probability and at least two kept tokens have
    p_i >= threshold (float32), remove all of them except the one with the smallest p
    (lowest id among equals).
    """
    x = _row(x)
    threshold = _num("xtc threshold", threshold)
    probability = _num("xtc probability", probability)
    if not (0.0 <= probability <= 1.0):
        raise ValueError(f"xtc probability must be in [0, 1], got {probability}")
    if probability == 0.0:
        return x
    u = xtc_coin(seed, position)
    if not (u < F32(probability)):
        return x
    probs = softmax32(x)
    targets = np.flatnonzero(_kept(x) & (probs >= F32(threshold)))
    if targets.size < 2:
        return x
    tp = probs[targets]
    survivor = targets[np.flatnonzero(tp == np.min(tp))[0]]
    out = x.copy()
    out[targets] = NEG_INF
    out[survivor] = x[survivor]
    return out


def penalties(
    x: Any,
    history_row: Any,
    last_n: int = -1,
    repeat: float = 1.0,
    frequency: float = 0.0,
    presence: float = 0.0,
) -> np.ndarray:
    """Repetition / frequency / presence penalties.

    c_i = count of i among the last ``last_n`` columns of ``history_row`` (-1 = all, 0 = none),
    entries < 0 (padding) and >= V ignored. Where c_i > 0:
    x_i <- x_i > 0 ? x_i / repeat : x_i * repeat, then x_i -= c_i * frequency + presence (float32).
    """
    x = _row(x)
    V = x.shape[0]
    last_n = int(last_n)
    repeat = _num("repeat", repeat)
    frequency = _num("frequency", frequency)
    presence = _num("presence", presence)
    if last_n < -1:
        raise ValueError(f"last_n must be >= -1, got {last_n}")
    if not (repeat > 0 and np.isfinite(repeat)):
        raise ValueError(f"repeat must be a finite number > 0, got {repeat}")
    if not (np.isfinite(frequency) and np.isfinite(presence)):
        raise ValueError("frequency and presence must be finite")
    h = np.asarray(history_row).reshape(-1).astype(np.int64)
    if last_n == 0:
        window = h[:0]
    elif last_n == -1:
        window = h
    else:
        window = h[-last_n:] if last_n < h.shape[0] else h
    valid = window[(window >= 0) & (window < V)]
    counts = np.bincount(valid, minlength=V)[:V]
    hit = counts > 0
    if not np.any(hit):
        return x
    xi = x[hit]
    r = F32(repeat)
    xi = np.where(xi > 0, xi / r, xi * r).astype(F32)
    sub = (counts[hit].astype(F32) * F32(frequency) + F32(presence)).astype(F32)
    xi = (xi - sub).astype(F32)
    out = x.copy()
    out[hit] = xi
    return out


def logit_bias(x: Any, b: Any) -> np.ndarray:
    """x + b in float32. ``b`` is a length-V array or a dict {token_id: bias}.

    A NaN or +inf bias is an error; a row emptied by -inf biases is an error.
    """
    x = _row(x)
    V = x.shape[0]
    if isinstance(b, Mapping):
        bb = np.zeros(V, dtype=F32)
        for tok, val in b.items():
            t = int(tok)
            if not (0 <= t < V):
                raise ValueError(f"logit_bias token id {t} outside [0, {V})")
            bb[t] = F32(val)
    else:
        bb = np.asarray(b, dtype=F32).reshape(-1)
        if bb.shape[0] != V:
            raise ValueError(f"bias has length {bb.shape[0]}, expected {V}")
    if np.any(np.isnan(bb)) or np.any(np.isposinf(bb)):
        raise ValueError("bias contains NaN or +inf")
    out = (x + bb).astype(F32)
    _require_nonempty(out, "logit_bias")
    return out


def allow(x: Any, mask_row: Any) -> np.ndarray:
    """x_i <- -inf where mask is false; an emptied row is an error."""
    x = _row(x)
    mk = np.asarray(mask_row, dtype=bool).reshape(-1)
    if mk.shape[0] != x.shape[0]:
        raise ValueError(f"mask has length {mk.shape[0]}, expected {x.shape[0]}")
    out = np.where(mk, x, NEG_INF).astype(F32)
    _require_nonempty(out, "allow")
    return out


# --------------------------------------------------------------------------------------------
# terminals
# --------------------------------------------------------------------------------------------


def greedy(x: Any) -> int:
    """argmax(x), lowest id on ties."""
    x = np.asarray(x, dtype=F32)
    _require_nonempty(x, "greedy")
    return int(np.argmax(x))


def sample(x: Any, seed: int, position: int = 0) -> int:
    """Gumbel-max: argmax(x + g) (float32 add), g = gumbel(bits_for_tokens(seed, position, V))."""
    x = np.asarray(x, dtype=F32)
    _require_nonempty(x, "sample")
    g = gumbel(bits_for_tokens(seed, position, x.shape[0]))
    return int(np.argmax((x + g).astype(F32)))


# --------------------------------------------------------------------------------------------
# §6 stages (v2), straight from their definitions (llama.cpp's and Hugging Face's), in float64 where it helps
# --------------------------------------------------------------------------------------------


def entropy64(x: Any) -> float:
    """H = -sum p log p over the kept tokens (float64)."""
    lp = log_softmax64(x)
    p = np.exp(lp)
    live = p > 0
    return float(-np.sum(p[live] * lp[live]))


def dynamic_temperature(x: Any, t: float, range: float, exponent: float = 1.0) -> np.ndarray:  # noqa: A002
    """llama.cpp temp_ext. range == 0: temperature(t). With N kept tokens (N <= 1: unchanged),
    T = max(0, t - range) + (2 range or t + range - max(0, t - range)) * (H / ln N) ** exponent, then temperature(T)
    (T <= 0 or NaN keeps only the argmax)."""
    x = _row(x)
    if range == 0:
        return temperature(x, t)
    n = int(np.sum(_kept(x)))
    if n <= 1:
        return x
    lo, hi = max(0.0, t - range), t + range
    T = lo + (hi - lo) * (entropy64(x) / np.log(n)) ** exponent
    return temperature(x, T if T > 0 else 0.0)      # (NaN -- t = inf -- too: the argmax alone)


def epsilon(x: Any, e: float) -> np.ndarray:
    """HF epsilon sampling: keep p >= e, and every token at the maximum. e == 0: off."""
    x = _row(x)
    if e == 0:
        return x
    return _apply(x, _keep_max(softmax64(x) >= e, x))


def eta(x: Any, e: float) -> np.ndarray:
    """HF eta sampling: keep p >= min(e, sqrt(e) exp(-H)), and every token at the maximum. e == 0: off."""
    x = _row(x)
    if e == 0:
        return x
    cut = min(e, np.sqrt(e) * np.exp(-entropy64(x)))
    return _apply(x, _keep_max(softmax64(x) >= cut, x))


def dry(x: Any, history_row: Any, multiplier: float, base: float = 1.75, allowed_length: int = 2,
        last_n: int = -1, breakers: Any = ()) -> np.ndarray:
    """DRY: the history without padding, its last L = last_n (-1: all) tokens the window. A token w[p] of the window
    (p >= 1) follows a copy of the window's last n tokens when w[p-n..p-1] == w[L-n..L-1] (n < p); its repeat length
    is the largest such n, capped at the distance from the end to the most recent breaker. A token whose repeat
    length reaches allowed_length, and that is not itself a breaker, gets x -= multiplier * base^(n - allowed),
    the exponent capped at int(88.7228391 / ln base) when base > 1.000001. Off when L <= allowed_length or the
    most recent breaker is closer to the end than allowed_length."""
    x = _row(x)
    if multiplier == 0:
        return x
    seq = [int(t) for t in np.asarray(history_row).reshape(-1) if t >= 0]
    L = len(seq) if last_n == -1 else min(len(seq), int(last_n))
    if L <= allowed_length:
        return x
    w = seq[len(seq) - L:]
    brk = {int(b) for b in np.asarray(breakers).reshape(-1) if b >= 0}
    limit = next((i for i in range(L) if w[L - 1 - i] in brk), L)
    if limit < allowed_length:
        return x
    longest: dict[int, int] = {}
    for p in range(1, L):
        n = 0
        while n < p and w[p - 1 - n] == w[L - 1 - n]:
            n += 1
        n = min(n, limit)
        if n >= allowed_length:
            longest[w[p]] = max(longest.get(w[p], -1), n)
    max_exp = int(F32(88.7228391) / np.log(F32(base))) if base > 1.000001 else 0
    out = x.copy()
    for tok, n in longest.items():
        if tok in brk or tok >= x.shape[0]:
            continue
        e = n - allowed_length
        if max_exp > 0 and e > max_exp:
            e = max_exp
        out[tok] = F32(out[tok] - F32(multiplier * float(base) ** e))
    return out



def mirostat_v2(x: Any, mu: float, tau: float, eta: float, seed: int, position: int = 0):  # noqa: A002
    """Keep the tokens with -log2 p <= mu (none: the most probable, lowest id), draw with `sample`, and return
    (token, mu - eta * (-log2 p'_token - tau), truncated x), p' the renormalized probability."""
    x = _row(x)
    surprise = -log_softmax64(x) / np.log(2.0)
    keep = surprise <= mu
    if not keep.any():
        keep = np.arange(x.shape[0]) == int(np.argmax(x))
    xt = _apply(x, keep)
    tok = sample(xt, seed, position)
    return tok, mu - eta * (-log_softmax64(xt)[tok] / np.log(2.0) - tau), xt


def mirostat(x: Any, mu: float, tau: float, eta: float, m: int = 100, seed: int = 0, position: int = 0):  # noqa: A002
    """Mirostat v1: over the N kept tokens sorted by probability, s_hat = sum t_i b_i / sum t_i^2 over
    i < min(m - 1, N - 1), t_i = ln((i + 2) / (i + 1)), b_i = ln(p_i / p_{i+1}); eps = s_hat - 1;
    k = (eps 2^mu / (1 - V^-eps))^(1 / s_hat) (NaN: 1; >= N: N; else max(floor(k), 1)); keep the k most probable
    (lowest id first on ties), then as mirostat_v2's draw and update."""
    x = _row(x)
    V = x.shape[0]
    n = int(np.sum(_kept(x)))
    order = np.argsort(-x.astype(np.float64), kind="stable")
    p = softmax64(x)[order]
    top = min(m - 1, n - 1)
    with np.errstate(all="ignore"):
        t = np.log((np.arange(top) + 2.0) / (np.arange(top) + 1.0))
        b = np.log(p[:top] / p[1:top + 1])
        s_hat = np.sum(t * b) / np.sum(t * t)
        e = s_hat - 1
        k = np.power(e * np.power(2.0, np.float64(mu)) / (1 - np.power(np.float64(V), -e)), 1 / s_hat)
    if np.isnan(k):
        k = 1
    k = n if k >= n else max(int(k), 1)
    keep = np.zeros(V, dtype=bool)
    keep[order[:k]] = True
    xt = _apply(x, keep)
    tok = sample(xt, seed, position)
    return tok, mu - eta * (-log_softmax64(xt)[tok] / np.log(2.0) - tau), xt


# --------------------------------------------------------------------------------------------
# §3 outputs
# --------------------------------------------------------------------------------------------

STAGES = {
    "temperature": temperature,
    "top_k": top_k,
    "top_p": top_p,
    "min_p": min_p,
    "typical_p": typical_p,
    "top_n_sigma": top_n_sigma,
    "xtc": xtc,
    "penalties": penalties,
    "logit_bias": logit_bias,
    "allow": allow,
    "dynamic_temperature": dynamic_temperature,
    "epsilon": epsilon,
    "eta": eta,
    "dry": dry,
}
TERMINALS = {"greedy": greedy, "sample": sample}

# DSL-style keyword names accepted as aliases of the Python parameter names.
_ALIASES = {
    "penalties": {"history": "history_row"},
    "allow": {"mask": "mask_row"},
    "logit_bias": {"bias": "b"},
    "dry": {"history": "history_row"},
}


def _kwargs(name: str, kw: Mapping[str, Any] | None) -> dict[str, Any]:
    kw = dict(kw or {})
    for a, real in _ALIASES.get(name, {}).items():
        if a in kw:
            kw[real] = kw.pop(a)
    return kw


def run_chain(
    logits_row: Any,
    stages: list[tuple[str, dict]],
    terminal: tuple[str, dict] | None = None,
    row: int = 0,
) -> dict[str, Any]:
    """Apply ``stages`` in order to one row of logits, then the optional terminal.

    Returns a dict with
      ``x``      final float32 logits (before the terminal; the terminal does not change x),
      ``probs``  float32 softmax(x) (computed in float64, then cast),
    and, when a terminal is given,
      ``token``       int,
      ``logprob``     float (float64 log_softmax(x)[token]),
      ``raw_logprob`` float (float64 log_softmax(logits)[token]).
    Errors are ValueError whose message names ``row``.
    """
    logits = np.asarray(logits_row)
    try:
        check_logits(logits)
    except ValueError as e:
        raise ValueError(f"row {row}: {e}") from None
    logits = logits.astype(F32)
    if not np.any(_kept(logits)):
        raise ValueError(f"row {row}: logits have nothing kept (all -inf)")
    x = logits.copy()
    for name, kw in stages:
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}")
        try:
            x = STAGES[name](x, **_kwargs(name, kw))
        except ValueError as e:
            raise ValueError(f"row {row}: {name}: {e}") from None
        if not np.any(_kept(x)):  # defensive: only allow / logit_bias can empty a row
            raise ValueError(f"row {row}: {name} left nothing kept")
    out: dict[str, Any] = {"x": x, "probs": softmax64(x).astype(F32)}
    if terminal is not None:
        tname, tkw = terminal
        if tname not in TERMINALS:
            raise ValueError(f"unknown terminal {tname!r}")
        tok = TERMINALS[tname](x, **dict(tkw or {}))
        out["token"] = tok
        out["logprob"] = float(log_softmax64(x)[tok])
        out["raw_logprob"] = float(log_softmax64(logits)[tok])
    return out


def _desc_order(v: np.ndarray) -> np.ndarray:
    """Indices sorting v descending, lowest id first on ties (v float, no NaN)."""
    return np.argsort(-np.asarray(v), kind="stable")


def top_logprobs(logits_row: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """ids (int32) and values (float32) of the n largest log_softmax(logits), descending,
    lowest id first on ties. Ranking is by the float32 logits themselves (exactly the order of
    the true log-probabilities); values are float64 log_softmax cast to float32."""
    logits = np.asarray(logits_row, dtype=F32)
    n = int(n)
    if not (0 <= n <= logits.shape[0]):
        raise ValueError(f"top_logprobs n must be in [0, {logits.shape[0]}], got {n}")
    ids = _desc_order(logits)[:n]
    vals = log_softmax64(logits)[ids]
    return ids.astype(np.int32), vals.astype(F32)


def candidates(x: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """ids (int32) and logits (float32) of the k largest entries of the final x, descending,
    lowest id first on ties; if fewer than k are kept, removed ones follow as -inf (by id)."""
    x = np.asarray(x, dtype=F32)
    k = int(k)
    if not (0 <= k <= x.shape[0]):
        raise ValueError(f"candidates k must be in [0, {x.shape[0]}], got {k}")
    ids = _desc_order(x)[:k]
    return ids.astype(np.int32), x[ids].astype(F32)
