"""The -O2 candidate plan: run the chain on a few candidate tokens instead of the whole vocabulary, exactly.

The vocabulary is cut into blocks; one pass computes every block's maximum, and the chain then runs on the tokens
of the `M` blocks with the largest maxima (ids ascending, so ties still resolve to the lowest id, and RandomBits
is indexed by token id, so the noise of a token does not depend on the plan). Every token outside those blocks is
at most `bound`, the (M+1)-th largest block maximum. The plan applies when the first stage that needs the whole
distribution is preceded by a stage that removes everything below a threshold the plan can compute on the
candidates alone:

    top_k(k)      threshold = the k-th largest (exact: the k largest all lie in the k best blocks), then the
                  k survivors are compacted so later stages work on k tokens
    min_p(m)      threshold = max + ln m
    top_p(p)      threshold = the smallest kept probability; the normalizer is summed over the vocabulary
    greedy        (after filters that keep the argmax) the best block alone holds the argmax unless another block
                  ties its maximum
    temperature + sample, nothing else
                  no token whose logit plus the largest possible Gumbel noise stays below the winner's noisy score
                  can win: threshold = t * (winner - g_max)

A row whose `bound` reaches its threshold (ties across blocks, flat distributions), or whose logits are invalid,
raises the plan's guard; the program then runs the exact graph for that call, which also reports real errors.
Leading elementwise stages (penalties, logit_bias, allow) run on the whole vocabulary first.
"""
from __future__ import annotations

import numpy as np

from samplec.frontend.ast import CheckedSampler, DictLit, Literal, Name
from samplec.frontend.lower import (NEG_INF, Lowering, const, last_index, penalize, penalties_neutral, softmax,
                                    top_p_floor, where)
from samplec.ir.graph import Check, Graph, Node, make
from samplec.ir.types import F32, I32, U32
from samplec.stages import V2_STAGES

PLAN_GUARD = "plan: this row needs the exact program"
BLOCK = 64          # tokens per block: divides 32000, 152064 and 262144, so no padding copy
BLOCKS = 16         # candidate blocks when no top_k fixes the count
WINDOW_BLOCKS = 64  # temperature + sample, and top_p with a bounded normalizer: they reach further down
ABSORBED = ("top_k", "top_p", "min_p", "typical_p", "top_n_sigma")   # filters that keep the argmax
MAX_TOP_K = 256     # beyond this a partition over the vocabulary is as cheap
PREFIX = ("penalties", "logit_bias", "allow")
# the largest Gumbel noise float32 can produce: u = (2^23 - 1 + 0.5) * 2^-23
_U_MAX = np.float32((2 ** 23 - 1 + 0.5) * 2.0 ** -23)
G_MAX = float(-np.log(-np.log(_U_MAX)))
MARGIN = 1e-3
PAIRWISE = 64           # top_p on at most this many candidates: pairwise masses (C^2 work), no sort
COMPACT = 64            # survivors of a bounded top_p are compacted to this many positions
TOP_P_MARGIN = 1e-3     # relative: covers float32 prefix sums over the <= 4096 candidates of a top_p plan


def _const_value(expr, bindings: dict):
    if isinstance(expr, Literal):
        return expr.value
    if isinstance(expr, Name) and expr.name in bindings:
        return bindings[expr.name]
    return None


class PlanLowering(Lowering):
    """Lowering on a candidate domain: `ids` (i32 [B,C], ascending) are the token ids of the positions of x."""

    def __init__(self, sampler: CheckedSampler, bindings: dict, bounded_z: bool = False):
        super().__init__(sampler, bindings)
        self.ids: Node | None = None
        self.guards: list[Node] = []
        self.bounded_z = bounded_z     # top_p: bound the normalizer from block maxima instead of an exp pass
        self.used_bounded = False
        self._known_max: dict[int, tuple[Node, Node]] = {}   # id(x) -> (x, a node holding x's row maximum)

    def known_max(self, x: Node) -> Node | None:
        entry = self._known_max.get(id(x))
        return entry[1] if entry is not None and entry[0] is x else None

    def set_known_max(self, x: Node, m: Node) -> None:
        self._known_max[id(x)] = (x, m)      # (x is kept, so its id cannot be reused by another node)

    def row_max(self, x):
        m = self.known_max(x)
        return super().row_max(x) if m is None else m

    def stage_top_p(self, x, p):
        """On at most PAIRWISE candidates, S_i (the mass above token i) pairwise, as the spec defines it: one
        [C, C] comparison instead of a sort, a cumulative sum and a gather."""
        n = x.type.shape[-1]
        if self.ids is None or not isinstance(n, int) or n > PAIRWISE:
            return super().stage_top_p(x, p)
        p = self.scalar(p, F32)
        probs = softmax(x, row_max=self.row_max(x))
        kept = make("filter", x, make("lt", make("mass_above", probs, name="mass_above"), p))
        return self.keeps_max(x, where(make("ge", p, const(1.0)), x, kept, name="x_topp"))

    def stage_temperature(self, x, t):
        """x / t is monotone for t > 0 (and float division rounds monotonically), so a known maximum m of x
        gives the maximum of the result as the same stage applied to m (t = 0 keeps the argmax: m)."""
        out = super().stage_temperature(x, t)
        m = self.known_max(x)
        if m is not None:
            t = self.scalar(t, F32)
            zero = make("eq", t, const(0.0))
            scaled = where(make("eq", m, const(NEG_INF)), m, make("div", m, where(zero, const(1.0), t)))
            self.set_known_max(out, where(make("eq", t, const(1.0)), m, where(zero, m, scaled)))
        return out

    def keeps_max(self, x, out):
        m = self.known_max(x)
        if m is not None:
            self.set_known_max(out, m)
        return out

    # -- domain hooks --
    def token_ids(self, x):
        return make("cast", self.ids, dtype=U32) if self.ids is not None else super().token_ids(x)

    def to_token(self, position):
        if self.ids is None:
            return super().to_token(position)
        return make("squeeze", make("take_along", self.ids, position), name="token")

    def stage_penalties(self, x, history, last_n, repeat, frequency, presence):
        """On the whole vocabulary, sparsely: only the history's tokens change, so penalize their gathered logits
        and write them back (every write of a token carries the same value; uncounted entries point at token 0 and
        carry token 0's own final value)."""
        if self.ids is not None:
            return super().stage_penalties(x, history, last_n, repeat, frequency, presence)
        rep, freq, pres = self.scalar(repeat, F32), self.scalar(frequency, F32), self.scalar(presence, F32)
        ids, valid = self.history_window(history, last_n)
        counts = make("count_at", ids, make("cast", valid, dtype=F32), x, name="counts")
        penalized = penalize(make("take_along", x, ids), counts, rep, freq, pres)
        return where(penalties_neutral(rep, freq, pres), x, make("put_along", x, ids, penalized), name="x_pen")

    def on_domain(self, tensor):
        return tensor if self.ids is None else make("take_tokens", tensor, self.ids)

    def positions_to_ids(self, positions):
        return positions if self.ids is None else make("take_along", self.ids, positions)

    def token_counts(self, ids, weights, x):
        if self.ids is None:
            return super().token_counts(ids, weights, x)
        full = make("scatter_add", make("zeros_like", self.params[0].node, dtype=F32), ids, weights, name="counts")
        return make("take_tokens", full, self.ids)

    def guard(self, flag: Node) -> None:
        """flag: bool [B,1] or [B] -- true where the row must run the exact program."""
        if len(flag.type.shape) == 1:
            flag = make("expand", flag)
        self.guards.append(flag)

    # -- the plan --
    def plan(self) -> Graph | None:
        stages = list(self.sampler.stages)
        outputs = {o.name for o in self.sampler.outputs}
        if not stages or stages[-1].name != "sample" and stages[-1].name != "greedy" or "probs" in outputs:
            return None
        body, terminal = stages[:-1], stages[-1]
        i = 0
        while i < len(body) and body[i].name in PREFIX:
            i += 1
        prefix, rest = body[:i], body[i:]
        mode = self._mode(rest, terminal)
        if mode is None or any(st.name == "logit_bias" and isinstance(st.args["b"], DictLit) for st in rest):
            return None     # (a constant bias addresses token ids, not candidate positions)
        m = {"top_k": lambda: int(_const_value(rest[0].args["k"], self.bindings)), "window": lambda: WINDOW_BLOCKS,
             "greedy": lambda: 1, "top_p": lambda: WINDOW_BLOCKS if self.bounded_z else BLOCKS}
        m = m.get(mode, lambda: BLOCKS)()
        domain = m if mode == "top_k" else m * BLOCK
        if any(o.name == "candidates" and (o.arg > domain or mode == "window") for o in self.sampler.outputs):
            return None     # more candidates than the domain holds; or untruncated ones, whose order reaches past it
        # leading elementwise stages (penalties, logit_bias, allow) run on the whole vocabulary, so the block
        # maxima bound the values the chain sees. (Penalties only on the candidates would be cheaper, but in a
        # decode loop the history *is* the top tokens: penalizing them drops the threshold below the bound of
        # the unpenalized blocks and the guard would fire on most steps.)
        only_penalties = all(st.name == "penalties" for st in prefix)

        logits = self.params[0].node
        x = logits
        if prefix and not only_penalties:      # allow / -inf biases could hide a NaN logit from the maxima
            self._exact_checks(logits)
        for st in prefix:
            x = getattr(self, "stage_" + st.name)(x, **st.args)
        bm = make("block_max", x, block_size=BLOCK, name="block_max")
        vmax = make("reduce_max", bm, name="vmax")
        if only_penalties:                     # penalties keep NaN, +inf and -inf as they are
            self.guard(make("logical_not", make("isfinite", vmax)))     # NaN, +inf, or an empty row
        else:
            self.guard(make("eq", vmax, const(NEG_INF)))
        k = m if mode == "top_k" else 0
        top = make("top_blocks", bm, blocks=m)
        bound = make("block_bound", bm, blocks=m, name="bound")
        self.ids = make("block_ids", top, bm, block_size=BLOCK, name="cand_ids")
        xc = make("take_tokens", x, self.ids, name="cand_x")
        top_c = vmax                 # the maximum of the logits the chain sees
        self.set_known_max(xc, vmax)       # (the best block is a candidate)

        if mode == "top_k":
            xc = self._top_k(xc, k, bound)
            self.set_known_max(xc, vmax)       # the k largest hold the largest
            rest = rest[1:]
        elif mode == "min_p":
            xc = self.stage_min_p(xc, **rest[0].args)
            floor = make("add", self.row_max(xc), make("log", self.scalar(rest[0].args["m"], F32)))
            self.guard(make("ge", bound, floor))
            rest = rest[1:]
        elif mode == "top_p":
            top_p = self._top_p_bounded if self.bounded_z else self._top_p
            self.used_bounded = self.bounded_z
            xc = top_p(x if not self.bounded_z else bm, xc, vmax, bound, rest[0].args["p"])
            if self.bounded_z:
                xc = self._compact(xc, COMPACT)
            rest = rest[1:]
        elif mode == "greedy":   # the filters keep the argmax; it lies in the best block unless another ties it
            self.guard(make("ge", bound, top_c))
            rest = []
        x_final_full = None
        if mode == "window":
            t = self.scalar(rest[0].args["t"], F32) if rest else const(1.0)
            for st in rest:
                xc = self.stage_temperature(xc, **st.args)
            if "logprob" in outputs:       # the normalizer of an untruncated row spans the vocabulary
                x_final_full = x
                for st in rest:
                    x_final_full = Lowering.stage_temperature(self, x_final_full, **st.args)
            rest = []
        for st in rest:
            xc = getattr(self, "stage_" + st.name)(xc, **st.args)
        if self.known_max(xc) is not vmax:       # (vmax is guarded above)
            self.guard(make("eq", self.row_max(xc), const(NEG_INF)))      # emptied: the exact program says why
        position = self.token_position = getattr(self, "stage_" + terminal.name)(xc, **terminal.args)
        if mode == "window":
            self._window_guard(xc, position, bound, top_c, t)
        token = self.to_token(position)
        self._candidates_guard(xc)
        outs = self.outputs(logits, xc, token, logprob_x=x_final_full)
        flag = self.guards[0]
        for g in self.guards[1:]:
            flag = make("logical_or", flag, g)
        flag = make("squeeze", flag)       # (one squeeze: every guard is [B,1] until here)
        return Graph(self.sampler.name, tuple(self.params), outs, (Check(flag, PLAN_GUARD),))

    def _mode(self, rest, terminal) -> str | None:
        if terminal.name == "greedy" and all(st.name in ABSORBED for st in rest) and \
                {o.name for o in self.sampler.outputs} <= {"token", "raw_logprob", "top_logprobs"}:
            return "greedy"
        if rest and rest[0].name == "top_k":
            k = _const_value(rest[0].args["k"], self.bindings)
            return "top_k" if k is not None and 1 <= int(k) <= MAX_TOP_K else None
        if rest and rest[0].name == "min_p":
            m = _const_value(rest[0].args["m"], self.bindings)
            return "min_p" if m is not None and 0 < float(m) else None
        if rest and rest[0].name == "top_p":
            p = _const_value(rest[0].args["p"], self.bindings)
            return "top_p" if p is not None and float(p) < 1 else None
        if terminal.name == "sample" and len(rest) <= 1 and all(st.name == "temperature" for st in rest):
            return "window"
        return None

    def _exact_checks(self, logits: Node) -> None:
        """With leading stages on the whole vocabulary, check the raw logits as the exact program does."""
        top = make("take_along", logits, make("argmax", logits))
        self.guard(make("logical_not", make("isfinite", top)))

    def _top_k(self, xc: Node, k: int, bound: Node) -> Node:
        pos = make("topk_positions", xc, k=k)
        vals = make("take_along", xc, pos)
        v_k = make("reduce_min", vals, name="v_k")
        # a token outside the blocks reaching v_k, or a (k+1)-th candidate tying it (one partition gives both
        # the k largest and the next one)
        nxt = make("kth_largest_static", xc, k=k + 1, name="v_next")
        self.guard(make("ge", make("maximum", bound, nxt), v_k))
        self.ids = make("take_along", self.ids, pos, name="topk_ids")
        return vals

    def _compact(self, xc: Node, k: int) -> Node:
        """Keep the k best positions (ids ascending) when at most k tokens survive; else the guard fires."""
        alive = make("reduce_sum", make("cast", make("isfinite", xc), dtype=I32))
        self.guard(make("gt", alive, const(k, I32)))
        pos = make("topk_positions", xc, k=k)
        self.ids = make("take_along", self.ids, pos, name="kept_ids")
        return make("take_along", xc, pos, name="kept_x")

    def _top_p(self, x: Node, xc: Node, vmax: Node, bound: Node, p_expr) -> Node:
        p = self.scalar(p_expr, F32)
        z = make("reduce_sum", make("exp", make("sub", x, vmax)), name="z")      # over the whole vocabulary
        probs = make("div", make("exp", make("sub", xc, vmax)), z, name="p")
        p_min = top_p_floor(probs, p)
        p_bound = make("div", make("exp", make("sub", bound, vmax)), z)
        self.guard(make("ge", p_bound, p_min))
        return make("filter", xc, make("ge", probs, p_min), name="x_topp")

    def _top_p_bounded(self, bm: Node, xc: Node, vmax: Node, bound: Node, p_expr) -> Node:
        """top_p without an exp pass over the vocabulary: the normalizer Z lies between the candidates' mass and
        that plus BLOCK * exp(block max - max) for every other block. Where that uncertainty (with a margin for
        float32 rounding) could change the cut, or rounding could merge the last kept probability with the next,
        the guard hands the row on."""
        p = self.scalar(p_expr, F32)
        e = make("exp", make("sub", xc, vmax), name="e")
        es = make("sort", e, descending=True)
        before = make("cumsum", es, exclusive=True, name="mass_before")
        z_lo = make("reduce_sum", e, name="z_cand")
        others = where(make("le", bm, bound), make("exp", make("sub", bm, vmax)), const(0.0))
        z_hi = make("add", z_lo, make("mul", make("reduce_sum", others), const(float(BLOCK))), name="z_hi")
        count = lambda cond: make("reduce_sum", make("cast", cond, dtype=I32))
        n_sure = count(make("lt", make("mul", before, const(1 + TOP_P_MARGIN)), make("mul", p, z_lo)))
        n_maybe = count(make("lt", make("mul", before, const(1 - TOP_P_MARGIN)), make("mul", p, z_hi)))
        self.guard(make("ne", n_sure, n_maybe))
        last = make("maximum", make("sub", n_sure, const(1, I32)), const(0, I32))
        e_min = make("take_along", es, last, name="e_min")
        self.guard(make("ge", make("exp", make("sub", bound, vmax)), e_min))
        nxt = make("take_along", es, make("minimum", n_sure, last_index(es)))      # the first probability cut
        close = make("logical_and", make("lt", nxt, e_min), make("ge", make("mul", nxt, const(1 + 2.0 ** -20)), e_min))
        self.guard(close)
        return make("filter", xc, make("ge", e, e_min), name="x_topp")

    def _window_guard(self, xc, position, bound, top_c, t) -> None:
        """No token outside the candidates can beat the winner's noisy score (t == 0: the argmax is inside)."""
        noisy = position.inputs[0]                      # argmax(add(x, gumbel))
        best = make("take_along", noisy, position, name="winner")
        zero = make("eq", t, const(0.0))
        reach = make("add", make("div", bound, where(zero, const(1.0), t)), const(G_MAX + MARGIN))
        slack = make("mul", make("abs", best), const(1e-6))
        hot = make("ge", reach, make("sub", best, slack))
        cold = make("ge", bound, top_c)
        self.guard(where(zero, cold, hot))

    def _candidates_guard(self, xc: Node) -> None:
        for o in self.sampler.outputs:
            if o.name == "candidates":
                finite = make("reduce_sum", make("cast", make("isfinite", xc), dtype=I32))
                self.guard(make("lt", finite, const(o.arg, I32)))


def plans(sampler: CheckedSampler, bindings: dict | None = None) -> list[Graph]:
    """The candidate plans of a checked sampler, tried in order before the exact program (none: not applicable).
    A leading top_p gets two: one that bounds the normalizer from block maxima, then one that sums it exactly."""
    if any(st.name in V2_STAGES for st in sampler.stages):
        return []       # (the plans do not know the v2 stages: DRY reads token ids, mirostat draws its own way)
    first = PlanLowering(sampler, dict(bindings or {})).plan()
    if first is None:
        return []
    bounded = PlanLowering(sampler, dict(bindings or {}), bounded_z=True)
    fast = bounded.plan()
    return [fast, first] if fast is not None and bounded.used_bounded else [first]


__all__ = ["plans", "PLAN_GUARD", "G_MAX"]
