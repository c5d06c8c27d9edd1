"""Lowering: a checked sampler becomes a graph of low-level ops, stage by stage, exactly as spec §2–§4 define them.

Every stage is written as `x' = where(off, x, stage(x))`, where `off` compares the stage's parameter with its off
value; for a constant parameter that comparison folds, so removing a stage at its off value is ordinary constant
folding. Masking filters that are guaranteed to keep the argmax use the `filter` op, so the passes can see that
`greedy` does not need them. `--set` bindings are applied here: a bound parameter becomes a constant node.
"""
from __future__ import annotations

import math

from samplec import stage_table
from samplec.diagnostics import SamplecError
from samplec.frontend.ast import BoundStage, CheckedSampler, DictLit, ListLit, Literal, Name
from samplec.ir.graph import INPUT, Check, Graph, Node, Param, make
from samplec.ir.types import BOOL, F32, I32, U32, U64, Type
from samplec.stages import STAGES, Range

PARAM_IR_TYPES = {
    "float": Type(F32, ("B",)), "int": Type(I32, ("B",)), "seed": Type(U64, ("B",)),
    "tokens": Type(I32, ("B", "H")), "mask": Type(BOOL, ("B", "V")), "bias": Type(F32, ("B", "V")),
    "state": Type(F32, ("B",)),
}
NEG_INF = -math.inf
XTC_COUNTER = 0xFFFFFFFF
LN2 = math.log(2.0)
OS_SEED = "_os_seed"    # implicit parameter of `sample()` without a seed: fresh OS entropy per call


# ---- small op builders -----------------------------------------------------------------------------------------

def const(value, dtype=F32) -> Node:
    value = float(value) if dtype == F32 else int(value)
    return make("const", value=value, dtype=dtype)


def where(c, a, b, name=None):
    return make("where", c, a, b, name=name)


def softmax(x: Node, name="p", row_max: Node | None = None) -> Node:
    e = make("exp", make("sub", x, make("reduce_max", x) if row_max is None else row_max))
    return make("div", e, make("reduce_sum", e), name=name)


def log_softmax(x: Node, name="logp") -> Node:
    return make("log_softmax", x, name=name)


def uniform(bits: Node) -> Node:
    """u = ((bits >> 9) + 0.5) * 2**-23, exact in float32 and never 0 or 1 (spec §4)."""
    mant = make("cast", make("shr", bits, const(9, U32)), dtype=F32)
    return make("mul", make("add", mant, const(0.5)), const(2.0 ** -23), name="u")


def gumbel(bits: Node) -> Node:
    return make("neg", make("log", make("neg", make("log", uniform(bits)))), name="gumbel")


def penalize(x: Node, counts: Node, rep: Node, freq: Node, pres: Node) -> Node:
    """Where a token was seen (count > 0): x > 0 ? x / repeat : x * repeat, then minus count * frequency + presence.
    A constant part that changes no bit is left out: a repeat of 1 (x / 1 and x * 1 are x), a frequency of 0 with a
    presence of +0 (a finite count times 0 plus +0 is +0, and x - +0 is x, -0 included)."""
    seen = make("gt", counts, const(0.0))
    x1 = x
    if not rep.is_const(1.0):
        x1 = where(seen, where(make("gt", x, const(0.0)), make("div", x, rep), make("mul", x, rep)), x)
    if freq.is_const(0.0) and pres.is_const(0.0) and not math.copysign(1.0, pres.attr("value")) < 0:
        return x1
    return where(seen, make("sub", x1, make("add", make("mul", counts, freq), pres)), x1)


def penalties_neutral_values(rep: Node, freq: Node, pres: Node) -> bool:
    """Whether constant penalty values leave every logit as it was (the stage table's off rule)."""
    return stage_table.off("penalties", repeat=rep.attr("value"), frequency=freq.attr("value"),
                           presence=pres.attr("value"))


def last_index(x: Node) -> Node:
    """V - 1 for an operand whose last axis has V entries, as i32[1]."""
    return make("reduce_max", make("iota", x))


def history_message(name: str, V: int | str = "{V}") -> str:
    """The message of a history's range check (a program's graph holds it with "{V}", filled in when raised)."""
    return f"{name}: token id >= V = {V} among its tokens"


def any_rows(flags: Node) -> Node:
    """bool[B,V] -> bool[B]: does the row hold any true entry."""
    return make("squeeze", make("reduce_any", flags))


def entropy(x: Node) -> Node:
    """H = -sum p log p over the kept tokens, [B,1], as ln Z - sum p d (d = x - max, Z = sum exp(d), removed tokens
    count 0): on a peaked row the top tokens' -p log p is about the tail's mass, which a float32 sum of p log p loses
    (ln Z rounds to 0 once the tail is below 2^-24 of the top's mass). Z = n + t (n tokens at the maximum, t the
    tail's sum), ln Z = ln n + log1p(t / n), log1p(r) = log(u) * r / (u - 1) with u = 1 + r (r itself where u rounds
    to 1): the tail survives in float32, as in the native kernel's double."""
    m = make("reduce_max", x)
    d = make("sub", x, m)
    e = make("exp", d)
    at_top = make("eq", x, m)
    n = make("reduce_sum", make("cast", at_top, dtype=F32))
    tail = make("reduce_sum", where(at_top, const(0.0), e))
    r = make("div", tail, n)
    u = make("add", const(1.0), r)
    log1p = where(make("eq", u, const(1.0)), r, make("div", make("mul", make("log", u), r), make("sub", u, const(1.0))))
    pd = make("mul", make("div", e, make("add", n, tail)), d)
    mean_d = make("reduce_sum", where(make("isfinite", pd), pd, const(0.0)))
    return make("sub", make("add", make("log", n), log1p), mean_d, name="entropy")


def empty_rows(x: Node) -> Node:
    return any_rows(make("eq", make("reduce_max", x), const(NEG_INF)))


# ---- the lowering ----------------------------------------------------------------------------------------------

class Lowering:
    def __init__(self, sampler: CheckedSampler, bindings: dict):
        self.sampler = sampler
        self.bindings = bindings
        self.params: list[Param] = []
        self.nodes: dict[str, Node] = {}
        self.checks: list[Check] = []
        self.state_out: dict[str, Node] = {}     # state parameter -> its updated value (an output may name it)
        # the distribution a truncating terminal (mirostat) draws from: `logprob` is under it; `probs` and
        # `candidates` are x before the terminal (spec section 3)
        self.terminal_x: Node | None = None
        # provenance, for `samplec explain` only (never part of the graph): per source stage, the node it ended
        # in and how many checks existed once it was lowered
        self.trace: list[tuple[BoundStage, Node, int]] = []
        ranges = _param_ranges(sampler)
        logits = Node(INPUT, (), (), Type(F32, ("B", "V")), "logits")
        self.params.append(Param("logits", "logits", logits))
        for p in sampler.params:
            if p.name == "logits":
                raise SamplecError("a sampler parameter may not be called 'logits' (the logits are its input)")
            if p.name in bindings:
                continue
            node = Node(INPUT, (), (), PARAM_IR_TYPES[p.type], p.name)
            default = None if p.default is None else p.default.value
            if p.type == "state":
                default = math.nan      # a missing state (or a NaN row) starts where its stage says (stage_mirostat)
            rng = ranges.get(p.name)
            self.params.append(Param(p.name, p.type, node, default, rng.describe() if rng else None))
            self.nodes[p.name] = node

    # -- arguments --
    def scalar(self, expr, dtype: str) -> Node:
        """A scalar stage argument as a node broadcastable against [B,V]: const [] or param [B,1]."""
        if isinstance(expr, Literal):
            return const(expr.value, dtype)
        if expr.name in self.bindings:
            return const(self.bindings[expr.name], dtype)
        node = self.nodes[expr.name]
        if node.type.dtype != dtype:
            node = make("cast", node, dtype=dtype)
        return make("expand", node)

    def tensor(self, expr: Name) -> Node:
        if expr.name in self.bindings:
            raise SamplecError(f"parameter '{expr.name}' is a tensor and cannot be bound with --set")
        return self.nodes[expr.name]

    def seed(self, expr) -> Node:
        if expr is None:   # sample() without a seed
            if OS_SEED not in self.nodes:
                node = Node(INPUT, (), (), PARAM_IR_TYPES["seed"], OS_SEED)
                self.params.append(Param(OS_SEED, "seed", node, "os"))
                self.nodes[OS_SEED] = node
            return make("expand", self.nodes[OS_SEED])
        return self.scalar(expr, U64)

    # -- the chain --
    def run(self) -> Graph:
        logits = self.params[0].node
        # argmax returns the position of a NaN (else of a +inf) when there is one, so one gathered value per row
        # checks the whole row -- and greedy shares the argmax
        top = make("squeeze", make("take_along", logits, make("argmax", logits)), name="logits_top")
        self.checks.append(Check(make("logical_or", make("isnan", top), make("isposinf", top)),
                                 "logits: NaN or +inf"))
        self.checks.append(Check(make("eq", top, const(NEG_INF)), "logits: every entry is -inf"))
        x, token = logits, None
        for st in self.sampler.stages:
            fn = getattr(self, "stage_" + st.name)
            if STAGES[st.name].terminal:
                self.token_position = fn(x, **st.args)
                token = self.to_token(self.token_position)
            else:
                x = fn(x, **st.args)
            self.trace.append((st, self.token_position if STAGES[st.name].terminal else x, len(self.checks)))
        return Graph(self.sampler.name, tuple(self.params), self.outputs(logits, x, token), tuple(self.checks))

    def outputs(self, logits: Node, x: Node, token: Node | None):
        out = []
        tok2 = None if token is None else make("expand", token)
        for o in self.sampler.outputs:
            if o.name == "token":
                out.append(("token", token))
            elif o.name == "logprob":       # (under the distribution the terminal draws from: mirostat's truncated one)
                drawn = x if self.terminal_x is None else self.terminal_x
                out.append(("logprob", make("squeeze", make("logprob_at", drawn, self.token_position),
                                            name="logprob")))
            elif o.name == "raw_logprob":
                out.append(("raw_logprob", make("squeeze", make("take_along", log_softmax(logits, "raw_logp"), tok2),
                                                 name="raw_logprob")))
            elif o.name == "top_logprobs":
                lp = log_softmax(logits, "raw_logp")
                ids = make("topk_ids", lp, k=o.arg, name="top_ids")
                out += [("top_logprobs.ids", ids), ("top_logprobs.values", make("take_along", lp, ids, name="top_lp"))]
            elif o.name == "probs":
                out.append(("probs", softmax(x, "probs")))
            elif o.name in self.state_out:
                out.append((o.name, self.state_out[o.name]))
            elif o.name == "candidates":
                pos = make("topk_ids", x, k=o.arg, name="cand_pos")
                out += [("candidates.ids", pos),
                        ("candidates.values", make("take_along", x, pos, name="cand_x"))]
        return tuple(out)

    # -- stages (spec §2) --
    def stage_temperature(self, x, t):
        return make("temperature", x, self.scalar(t, F32), name="x_temp")

    def stage_top_k(self, x, k):
        return make("top_k", x, self.scalar(k, I32), name="x_topk")

    def stage_top_p(self, x, p):
        return make("top_p", x, self.scalar(p, F32), name="x_topp")

    def stage_min_p(self, x, m):
        return make("min_p", x, self.scalar(m, F32), name="x_minp")

    def stage_typical_p(self, x, m):
        return make("typical_p", x, self.scalar(m, F32), name="x_typical")

    def stage_top_n_sigma(self, x, n):
        return make("top_n_sigma", x, self.scalar(n, F32), name="x_nsigma")

    def stage_xtc(self, x, threshold, probability, seed, position):
        return make("xtc", x, self.scalar(threshold, F32), self.scalar(probability, F32), self.seed(seed),
                    self.scalar(position, I32), name="x_xtc")

    def stage_penalties(self, x, history, last_n, repeat, frequency, presence):
        rep, freq, pres = self.scalar(repeat, F32), self.scalar(frequency, F32), self.scalar(presence, F32)
        if all(v.op == "const" for v in (rep, freq, pres)) and penalties_neutral_values(rep, freq, pres):
            return x                    # (repeat 1, frequency 0, presence 0: every logit stays as it was)
        operands = (x, self.tensor(history), self.scalar(last_n, I32), rep, freq, pres)
        self.checks.append(Check(make("penalties_overflow", *operands),
                                 "penalties: a penalized logit overflows float32 (+inf or NaN), or no token is left"))
        return make("penalties", *operands, name="x_pen")

    def stage_logit_bias(self, x, b):
        if isinstance(b, DictLit):
            ids = tuple(int(k) for k, _ in b.items)
            vals = tuple(float(v) for _, v in b.items)
            out = make("sparse_add", x, ids=ids, values=vals, name="x_bias")
        else:
            out = make("add", x, self.tensor(b), name="x_bias")
        self.checks.append(Check(empty_rows(out), "logit_bias: a -inf bias removed every token"))
        self.checks.append(Check(any_rows(make("isposinf", make("reduce_max", out))),
                                 "logit_bias: a biased logit overflows float32 (+inf)"))
        return out

    def stage_allow(self, x, mask):
        out = where(self.tensor(mask), x, const(NEG_INF), name="x_allowed")
        self.checks.append(Check(empty_rows(out), "allow: the mask allows none of the tokens left"))
        return out

    def stage_greedy(self, x):
        return make("greedy", x)

    def stage_sample(self, x, seed, position):
        return make("sample", x, self.seed(seed), self.scalar(position, I32))

    # -- v2 stages (spec §6): the exact rules are in docs/language.md, "Stages from llama.cpp and Hugging Face" --
    def stage_dynamic_temperature(self, x, t, range, exponent):
        """llama.cpp temp_ext (its definition: samplec/frontend/expand.py)."""
        return make("dynamic_temperature", x, self.scalar(t, F32), self.scalar(range, F32),
                    self.scalar(exponent, F32), name="x_dyntemp")

    def stage_epsilon(self, x, e):
        """HF EpsilonLogitsWarper (its definition: samplec/frontend/expand.py)."""
        return make("epsilon", x, self.scalar(e, F32), name="x_epsilon")

    def stage_eta(self, x, e):
        """HF EtaLogitsWarper (its definition: samplec/frontend/expand.py)."""
        return make("eta", x, self.scalar(e, F32), name="x_eta")

    def stage_dry(self, x, history, multiplier, base, allowed_length, last_n, breakers):
        """llama.cpp DRY (its definition: samplec/frontend/expand.py), with its check: a penalty that overflows
        float32 (multiplier * base^e above 3.4e38) on the row's last kept tokens."""
        is_breaker = self.breaker_tokens(x, breakers)                      # bool [V] or [B, V]; None: no breakers
        x_dry = make("dry", x, self.tensor(history), self.scalar(multiplier, F32), self.scalar(base, F32),
                     self.scalar(allowed_length, I32), self.scalar(last_n, I32),
                     const(0, BOOL) if is_breaker is None else is_breaker, name="x_dry")
        self.checks.append(Check(make("squeeze", make("eq", make("reduce_max", x_dry), const(NEG_INF))),
                                 "dry: the penalty leaves no token"))
        return x_dry

    def breaker_tokens(self, x: Node, breakers) -> Node | None:
        """Which tokens are sequence breakers: bool [V] for a constant list (None for an empty one), [B, V] for a
        `tokens` parameter."""
        if isinstance(breakers, ListLit):
            ids, flag = make("iota", x), None
            for tok in dict.fromkeys(breakers.items):
                is_tok = make("eq", ids, const(tok, I32))
                flag = is_tok if flag is None else make("logical_or", flag, is_tok)
            return flag
        b = self.tensor(breakers)
        ok = make("ge", b, const(0, I32))
        marks = make("scatter_add", make("zeros_like", self.params[0].node, dtype=F32), where(ok, b, const(0, I32)),
                     make("cast", ok, dtype=F32))
        return make("gt", marks, const(0.0), name="breakers")

    def stage_mirostat(self, x, mu, tau, eta, m, seed, position):
        """llama.cpp mirostat v1: s_hat from the m most probable tokens, k from s_hat and mu, the k most probable
        (ties: lowest id first), a draw, and mu updated by the drawn token's surprise."""
        tau_, mu_ = self.scalar(tau, F32), self.scalar(mu, F32)
        mu_ = where(make("isnan", mu_), make("mul", const(2.0), tau_), mu_, name="mu")
        n = make("reduce_sum", make("cast", make("isfinite", x), dtype=I32), name="n_kept")
        # b_i = ln(p_i / p_{i+1}) = x_i - x_{i+1} over the logits sorted descending: exact, where float32
        # probabilities a gap of more than ~88 apart underflow to 0 (ln(p / 0) = inf: s_hat NaN, k = 1). Only the
        # m largest are read: with m a literal (llama.cpp's 100) they are selected, not sorted (-inf past V)
        if isinstance(m, Literal) and 1 <= int(m.value) <= 4096:
            xs = make("topk", x, k=int(m.value), name="x_top_m")
        else:
            xs = make("sort", x, descending=True)
        i = make("iota", xs)
        xs_next = make("take_along", xs, make("minimum", make("add", i, const(1, I32)), last_index(xs)))
        fi = make("cast", i, dtype=F32)
        t_i = make("log", make("div", make("add", fi, const(2.0)), make("add", fi, const(1.0))))
        b_i = make("sub", xs, xs_next)
        top = make("minimum", make("sub", self.scalar(m, I32), const(1, I32)), make("sub", n, const(1, I32)))
        used = make("lt", i, top)
        s_hat = make("div", make("reduce_sum", where(used, make("mul", t_i, b_i), const(0.0))),
                     make("reduce_sum", where(used, make("mul", t_i, t_i), const(0.0))), name="s_hat")
        eps = make("sub", s_hat, const(1.0))
        two_mu = make("exp", make("mul", mu_, const(LN2)))
        v = make("cast", make("add", last_index(x), const(1, I32)), dtype=F32)
        v_eps = make("exp", make("mul", make("neg", eps), make("log", v)))
        ratio = make("div", make("mul", eps, two_mu), make("sub", const(1.0), v_eps))
        k = make("exp", make("div", make("log", ratio), s_hat), name="k_real")
        nf = make("cast", n, dtype=F32)
        k = make("maximum", where(make("isnan", k), const(1.0), make("minimum", k, nf)), const(1.0))
        k = make("cast", k, dtype=I32, name="k")
        kept = make("top_k_rank", x, k, name="x_mirostat")
        return self.mirostat_draw(kept, mu, mu_, tau_, eta, seed, position)

    def stage_mirostat_v2(self, x, mu, tau, eta, seed, position):
        """llama.cpp mirostat v2: keep the tokens whose surprise -log2 p is at most mu (at least the most
        probable), draw, and update mu by the drawn token's surprise under the renormalized distribution."""
        tau_, mu_ = self.scalar(tau, F32), self.scalar(mu, F32)
        mu_ = where(make("isnan", mu_), make("mul", const(2.0), tau_), mu_, name="mu")
        surprise = make("div", log_softmax(x), const(-LN2), name="surprise")
        keep = make("logical_or", make("le", surprise, mu_), make("eq", make("iota", x), make("argmax", x)))
        kept = make("filter", x, keep, name="x_mirostat")
        return self.mirostat_draw(kept, mu, mu_, tau_, eta, seed, position)

    def mirostat_draw(self, kept, mu_expr, mu, tau, eta, seed, position) -> Node:
        """Draw from the truncated row (`sample`), and mu' = mu - eta * (-log2 p_token - tau), p renormalized."""
        pos = self.stage_sample(kept, seed, position)
        surprise = make("div", make("logprob_at", kept, pos), const(-LN2))
        new_mu = make("sub", mu, make("mul", self.scalar(eta, F32), make("sub", surprise, tau)))
        if isinstance(mu_expr, Name):
            self.state_out[mu_expr.name] = make("squeeze", new_mu, name=mu_expr.name + "_next")
        self.terminal_x = kept
        return pos


    def to_token(self, position: Node) -> Node:
        """[B,1] argmax position in x -> int32 [B] token id."""
        return make("squeeze", position, name="token")


def _param_ranges(sampler: CheckedSampler) -> dict[str, Range]:
    """The run-time range of each scalar parameter: the intersection of the ranges of the stage slots it feeds."""
    out: dict[str, Range] = {}
    for st in sampler.stages:
        sig = {p.name: p for p in STAGES[st.name].params}
        for slot, expr in st.args.items():
            if isinstance(expr, Name) and sig[slot].range != Range() and sig[slot].type != "seed":
                r = sig[slot].range
                prev = out.get(expr.name)
                out[expr.name] = r if prev is None else _intersect(prev, r)
    return out


def _intersect(a: Range, b: Range) -> Range:
    lo, lo_open = max((a.lo, a.lo_open), (b.lo, b.lo_open))
    hi, hi_open = min((a.hi, not a.hi_open), (b.hi, not b.hi_open))
    return Range(lo, hi, lo_open, not hi_open)


def lower(sampler: CheckedSampler, bindings: dict | None = None) -> Graph:
    return Lowering(sampler, dict(bindings or {})).run()


def lower_traced(sampler: CheckedSampler, bindings: dict | None = None) -> tuple[Graph, list]:
    """`lower`, and per source stage (BoundStage, the node it ended in, the number of checks after it): the side
    table `samplec explain` traces the stages through the passes with."""
    lowering = Lowering(sampler, dict(bindings or {}))
    return lowering.run(), lowering.trace
