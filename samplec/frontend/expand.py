"""The dense definitions of the stage ops: each stage op (samplec/ir/ops.py: `temperature`, `top_k`, `top_p`,
`min_p`, `top_n_sigma`, `typical_p`, `xtc`, `dynamic_temperature`, `epsilon`, `eta`, `top_k_rank`, `penalties` and
its check, `dry`, `greedy`, `sample`, `logprob_at`) written with the low-level ops, exactly as spec §2-§4 and §6 define the stage on the whole vocabulary.

These are what -O0 runs (the `expand-stages` pass rewrites every stage op into its definition) and what a stage
op's kernel runs where no faster kernel covers it. Every stage is `where(off, x, stage(x))`: for a constant
parameter the comparison folds, so a stage at its off value disappears by constant folding.
"""
from __future__ import annotations

from typing import Callable

import math

from samplec.frontend.lower import NEG_INF, XTC_COUNTER, any_rows, const, entropy, gumbel, log_softmax, penalize, \
    softmax, uniform, where
from samplec.ir.graph import Node, make
from samplec.ir.types import F32, I32, U32


def temperature(x: Node, t: Node) -> Node:
    # t = 0, or a t so small that the largest logit divided by it leaves the float32 range: the argmax alone (the
    # limit of softmax(x / t) as t -> 0; x / t would hold +-inf)
    top = make("div", make("reduce_max", x), where(make("eq", t, const(0.0)), const(1.0), t))
    zero = make("logical_or", make("eq", t, const(0.0)), make("logical_not", make("isfinite", top)),
                name="t_greedy")
    greedy_x = make("filter", x, make("eq", make("iota", x), make("argmax", x)), name="x_t0")
    # a removed token stays removed even for t = inf (-inf / inf would be NaN)
    scaled = where(make("eq", x, const(NEG_INF)), x, make("div", x, where(zero, const(1.0), t)), name="x_scaled")
    return where(make("eq", t, const(1.0)), x, where(zero, greedy_x, scaled), name="x_temp")


def top_k(x: Node, k: Node) -> Node:
    vk = make("kth_largest", x, k, name="v_k")
    kept = make("filter", x, make("ge", x, vk))
    return where(make("le", k, const(0, I32)), x, kept, name="x_topk")


def top_k_rank(x: Node, k: Node) -> Node:
    """The k largest by rank: every value above the k-th largest, and of those equal to it the lowest ids, as many
    as the k places leave (a scan in id order)."""
    vk = make("kth_largest", x, k, name="v_k")
    above, at = make("gt", x, vk), make("eq", x, vk)
    need = make("sub", k, make("reduce_sum", make("cast", above, dtype=I32)))
    first = make("le", make("cumsum", make("cast", at, dtype=I32)), need)
    kept = make("filter", x, make("logical_or", above, make("logical_and", at, first)))
    return where(make("le", k, const(0, I32)), x, kept, name="x_topk_rank")


def top_p(x: Node, p: Node) -> Node:
    # S_i < p  <=>  p_i >= the largest t whose upper set {p_j >= t} holds mass p (ties at the boundary kept)
    probs = softmax(x)
    floor = make("mass_threshold", probs, probs, p, name="p_min")
    kept = make("filter", x, make("ge", probs, floor))
    return where(make("ge", p, const(1.0)), x, kept, name="x_topp")


def min_p(x: Node, m: Node) -> Node:
    floor = make("add", make("reduce_max", x), make("log", m), name="minp_floor")
    kept = make("filter", x, make("ge", x, floor))
    return where(make("eq", m, const(0.0)), x, kept, name="x_minp")


def top_n_sigma(x: Node, n: Node) -> Node:
    finite = make("isfinite", x)
    count = make("reduce_sum", make("cast", finite, dtype=F32))
    mean = make("div", make("reduce_sum", where(finite, x, const(0.0))), count, name="mean")
    dev = where(finite, make("sub", x, mean), const(0.0))
    std = make("sqrt", make("div", make("reduce_sum", make("mul", dev, dev)), count), name="std")
    top = make("reduce_max", x)
    floor = make("sub", top, make("mul", n, std), name="sigma_floor")
    # the most probable token always stays (n = inf with one kept token gives inf * 0 = NaN)
    kept = make("filter", x, make("logical_or", make("ge", x, floor), make("eq", x, top)))
    return where(make("le", n, const(0.0)), x, kept, name="x_nsigma")


def typical_p(x: Node, m: Node) -> Node:
    probs = softmax(x)
    # -log p_i - H = (log Z - d_i) - (log Z - sum_j p_j d_j) with d = x - max: log Z cancels, so the score is
    # |mean(d) - d_i|, computed without the cancellation of two numbers near log V (float32 loses ~1e-6 there)
    live = make("gt", probs, const(0.0))
    d = make("sub", x, make("reduce_max", x))
    mean_d = make("reduce_sum", where(live, make("mul", probs, d), const(0.0)), name="mean_d")
    score = where(live, make("abs", make("sub", mean_d, d)), const(math.inf), name="score")
    # s* = the score where the mass in ascending score first reaches m = the smallest s whose lower set
    # {s_j <= s} holds mass m: a selection by mass on -s; never reached (rounding): the largest finite score
    reached = make("neg", make("mass_threshold", make("neg", score), probs, m))
    top_finite = make("reduce_max", where(make("isfinite", score), score, const(-math.inf)))
    cutoff = make("minimum", reached, top_finite, name="score_cutoff")
    keep = make("logical_or", make("le", score, cutoff), make("eq", x, make("reduce_max", x)))
    return where(make("ge", m, const(1.0)), x, make("filter", x, keep), name="x_typical")


def xtc(x: Node, thr: Node, prob: Node, seed: Node, position: Node) -> Node:
    pos = make("cast", position, dtype=U32)
    coin = uniform(make("random_bits", seed, const(XTC_COUNTER, U32), pos, name="xtc_bits"))
    probs = softmax(x)
    top = make("logical_and", make("ge", probs, thr), make("isfinite", x), name="xtc_top")
    n_top = make("reduce_sum", make("cast", top, dtype=I32))
    p_least = make("reduce_min", where(top, probs, const(math.inf)))
    survivor = make("argmax", make("logical_and", top, make("eq", probs, p_least)), name="xtc_survivor")
    remove = make("logical_and", top, make("ne", make("iota", x), survivor))
    fire = make("logical_and", make("lt", coin, prob), make("ge", n_top, const(2, I32)))
    cut = where(make("logical_and", fire, remove), const(NEG_INF), x)
    return where(make("eq", prob, const(0.0)), x, cut, name="x_xtc")


def dynamic_temperature(x: Node, t: Node, r: Node, ex: Node) -> Node:
    """llama.cpp temp_ext. r == 0: temperature(x, t). Over the n kept tokens (n <= 1: x unchanged),
    T = max(0, t - r) + (t + r - max(0, t - r)) * (H / ln n)^ex (0^0 = 1), then temperature(x, T) -- T <= 0 (or
    NaN) keeps the argmax alone, and so does a T so small that the largest logit divided by it leaves float32."""
    n = make("reduce_sum", make("cast", make("isfinite", x), dtype=F32), name="n_kept")
    norm = make("div", entropy(x), make("log", n), name="norm_entropy")
    powed = where(make("eq", ex, const(0.0)), const(1.0), make("exp", make("mul", ex, make("log", norm))))
    lo = make("maximum", const(0.0), make("sub", t, r))
    dyn = make("add", lo, make("mul", make("sub", make("add", t, r), lo), powed), name="dyn_temp")
    dyn_x = temperature(x, where(make("gt", dyn, const(0.0)), dyn, const(0.0)))
    return where(make("eq", r, const(0.0)), temperature(x, t), where(make("le", n, const(1.0)), x, dyn_x),
                 name="x_dyntemp")


def epsilon(x: Node, e: Node) -> Node:
    """HF EpsilonLogitsWarper: keep p >= e and every token at the maximum."""
    keep = make("logical_or", make("ge", softmax(x), e), make("eq", x, make("reduce_max", x)))
    return where(make("eq", e, const(0.0)), x, make("filter", x, keep), name="x_epsilon")


def eta(x: Node, e: Node) -> Node:
    """HF EtaLogitsWarper: keep p >= min(e, sqrt(e) * exp(-H)) and every token at the maximum."""
    cut = make("minimum", e, make("mul", make("sqrt", e), make("exp", make("neg", entropy(x)))), name="eta_cut")
    keep = make("logical_or", make("ge", softmax(x), cut), make("eq", x, make("reduce_max", x)))
    return where(make("eq", e, const(0.0)), x, make("filter", x, keep), name="x_eta")


def greedy(x: Node) -> Node:
    return make("argmax", x)


def sample(x: Node, seed: Node, position: Node) -> Node:
    ids = make("cast", make("iota", x), dtype=U32)
    bits = make("random_bits", seed, ids, make("cast", position, dtype=U32), name="bits")
    return make("argmax", make("add", x, gumbel(bits), name="noisy"))


def logprob_at(x: Node, at: Node) -> Node:
    return make("take_along", log_softmax(x), at)


def history_window(hist: Node, last_n: Node, last: Node | None = None,
                   not_padding: Node | None = None) -> tuple[Node, Node]:
    """The history's ids (0 where not counted) and which entries count: not padding, in the last last_n. `last`:
    H - 1 (default: the largest column index; a target may give it as a constant of the traced shape).
    `not_padding`: the test hist >= 0 (default), where a target writes it in a form of its own."""
    col = make("iota", hist)
    h = make("add", make("reduce_max", col) if last is None else last, const(1, I32))
    in_window = make("logical_or", make("eq", last_n, const(-1, I32)), make("ge", col, make("sub", h, last_n)))
    nonneg = make("ge", hist, const(0, I32)) if not_padding is None else not_padding
    valid = make("logical_and", nonneg, in_window, name="hist_valid")
    return where(valid, hist, const(0, I32)), valid


def penalized(x: Node, hist: Node, last_n: Node, rep: Node, freq: Node, pres: Node) -> tuple[Node, Node]:
    """(ids, values): the window's tokens and their penalized logits -- sparsely: only the history's tokens
    change, so their gathered logits are penalized and written back (every write of a token carries the same
    value; uncounted entries point at token 0 and carry its own value)."""
    ids, valid = history_window(hist, last_n)
    counts = make("count_at", ids, make("cast", valid, dtype=F32), x, name="counts")
    return ids, penalize(make("take_along", x, ids), counts, rep, freq, pres)


def penalties(x: Node, hist: Node, last_n: Node, rep: Node, freq: Node, pres: Node) -> Node:
    ids, vals = penalized(x, hist, last_n, rep, freq, pres)
    return make("put_along", x, ids, vals, name="x_pen")


def penalties_overflow(x: Node, hist: Node, last_n: Node, rep: Node, freq: Node, pres: Node) -> Node:
    """Whether a penalized logit is +inf or NaN (a count times a frequency overflowing to -inf, taken from a
    removed token's -inf), or the penalties leave the row no finite logit (-inf everywhere: a penalty overflowing
    float32 on the last kept tokens)."""
    ids, vals = penalized(x, hist, last_n, rep, freq, pres)
    empty = make("squeeze", make("eq", make("reduce_max", make("put_along", x, ids, vals)), const(NEG_INF)))
    bad = make("logical_or", make("isposinf", vals), make("isnan", vals))
    return make("logical_or", any_rows(bad), empty)


def dry(x: Node, hist: Node, mult: Node, base: Node, allowed: Node, last_n: Node, breakers: Node) -> Node:
    """llama.cpp DRY: the history right-aligned (padding dropped), its last L entries the window, `dry_repeats` the
    longest repeat each token would extend, clamped at the most recent breaker (`breakers`: bool [V] or [B, V]
    marking the breaker tokens; a scalar, the constant false: none)."""
    valid = make("ge", hist, const(0, I32))
    # stable argsort on (valid): padding first, the tokens after it in their order
    aligned = make("take_along", hist, make("argsort", make("cast", valid, dtype=I32), descending=False))
    n = make("reduce_sum", make("cast", valid, dtype=I32))
    length = where(make("eq", last_n, const(-1, I32)), n, make("minimum", n, last_n), name="dry_window")
    col = make("iota", aligned)
    h = make("add", make("reduce_max", col), const(1, I32))
    w = where(make("ge", col, make("sub", h, length)), aligned, const(-1, I32), name="dry_hist")
    is_breaker = breakers if breakers.type.shape else None           # (a scalar: the constant false, no breakers)
    rep_limit = length
    if is_breaker is not None:
        present = make("ge", w, const(0, I32))
        at_breaker = make("logical_and", present, make("take_along", is_breaker, where(present, w, const(0, I32))))
        last_breaker = make("reduce_max", where(at_breaker, col, const(-1, I32)))
        rep_limit = where(make("ge", last_breaker, const(0, I32)),
                          make("sub", make("sub", h, const(1, I32)), last_breaker), length, name="rep_limit")
    # Only tokens of the window can be penalized: the penalty is computed at the window's positions [B, H] (a
    # padding position reads token 0, like every entry of token 0: all entries of a token agree) and put back into
    # the row -- two exps per history entry instead of per vocabulary entry.
    at = where(make("ge", w, const(0, I32)), w, const(0, I32), name="dry_ids")
    longest = make("take_along", make("minimum", make("dry_repeats", w, x), rep_limit), at, name="dry_len")
    hit = make("ge", longest, allowed)
    if is_breaker is not None:
        hit = make("logical_and", hit, make("logical_not", make("take_along", is_breaker, at)))
    active = make("logical_and", make("gt", length, allowed), make("ge", rep_limit, allowed))
    log_base = make("log", base)
    max_exp = where(make("gt", base, const(1.000001)),
                    make("cast", make("div", const(88.7228391), log_base), dtype=I32), const(0, I32))
    exp_ = make("sub", longest, allowed)
    exp_ = where(make("logical_and", make("gt", max_exp, const(0, I32)), make("gt", exp_, max_exp)), max_exp, exp_)
    # multiplier * base^e, base^e = exp(e ln base); near the cap (e ln base up to 88.72, where float32 exp may
    # already overflow: MLX's does above 88.0, and 2^128 is past float32) as (multiplier * exp(e ln base / 2))
    # * exp(e ln base / 2): finite wherever llama.cpp's product (pow in double) is
    arg = make("mul", make("cast", exp_, dtype=F32), log_base)
    half = make("exp", make("mul", arg, const(0.5)))
    penalty = where(make("gt", arg, const(80.0)), make("mul", make("mul", mult, half), half),
                    make("mul", mult, make("exp", arg)), name="dry_pen")
    x_at = make("take_along", x, at)
    out = make("put_along", x, at, where(make("logical_and", active, hit), make("sub", x_at, penalty), x_at))
    return where(make("eq", mult, const(0.0)), x, out, name="x_dry")


EXPAND: dict[str, Callable[..., Node]] = {
    "temperature": temperature, "top_k": top_k, "top_k_rank": top_k_rank, "top_p": top_p, "min_p": min_p,
    "top_n_sigma": top_n_sigma, "typical_p": typical_p, "xtc": xtc, "dynamic_temperature": dynamic_temperature,
    "epsilon": epsilon, "eta": eta, "greedy": greedy, "sample": sample, "logprob_at": logprob_at,
    "penalties": penalties, "penalties_overflow": penalties_overflow, "dry": dry,
}


def expand(n: Node) -> Node:
    """A stage op's dense definition (the node itself for any other op)."""
    fn = EXPAND.get(n.op)
    if fn is None:
        return n
    out = fn(*n.inputs)
    return out if out.name or not n.name else Node(out.op, out.inputs, out.attrs, out.type, n.name)
