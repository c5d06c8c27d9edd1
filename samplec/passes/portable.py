"""The portable lowering: what a device without a samplec kernel runs (`target = portable`, and `metal` until a
Metal kernel exists) -- few, large MLX kernels, and the tokens of the dense definitions.

A chain's row is held in two forms. `s` is the row's values sorted (descending; one value sort a chain, where the
first stage that needs the row's order starts it), and every cut on the logit order (`top_k`, `top_k_rank`, `top_p`,
`typical_p`) finds its threshold on it: a place (`top_k`), a running mass (`top_p`), a count (`top_k_rank`) --
instead of the dense definitions' 32 selection rounds. `x` is the same row in id order. Every stage is one
elementwise function of the row and a few per-row values read off `s` (a threshold, a maximum, a sum), applied to
both forms: token by token the two hold the same bits, `s` for the next stage's thresholds and `x` for the draw and
every reader outside the chain. A removed token is -inf in both, so the kept values of `s` stay non-increasing along
the row and each cut is a comparison with a value. `reroot` derives the id-order form of a stage from its sorted
form (module functions below); the few stages whose rule names a place (the first maximum, the k-th place, xtc's
survivor) are given both forms. The draw is the dense definition on `x`: a Gumbel-max with the noise of each id (no
permutation and no gather of the ids: MLX's sort of values is the only sort).

On the CPU (`places`: `target.partitions()`), where a sort of 152064 floats costs ~17 ms and a partition ~2 ms, a chain
whose stages are value cuts the candidates decide (top_k, top_p, min_p), the temperature and a draw -- each stage
read by the next alone, the drawn row by anything (`candidates_fit`) -- runs on its row's candidates instead: the ids of its
N = 4096 largest values (`candidates`: a partition of the row and a sort of N; equal values by id) and `s` their
values. Every cut is a threshold on the value found on them as above; a sum a stage takes of the row before any cut
is the whole row's (in id order), after a cut the candidates'. A removed token past the last candidate holds a value
no larger than the last one's, so where a cut removed the last candidate every kept token is among them (`held`);
the draw (Gumbel-max over the candidates with each id's noise, the lowest id among equal noisy values), the drawn
token's log-probability and top_logprobs of a whole row (ordered by the log-softmax's value, equal values by id) are
then the dense definitions'. A row where that does not hold -- a cut past the candidates, a sum over a row the
candidates may not have held -- is flagged by a check (`UNCOVERED`): `Program` runs such rows again, alone, with the
row sorted. On a GPU, whose partition is a sort, the lowering sorts.

Exactness: every threshold is the dense definition's, taken over the same values; sums are taken in another order
(a running sum in sorted order where the definitions sum a masked row), so a boundary can move only where a mass
lies within float32 rounding of `p`. Ties keep id order where a rule picks among them: the draw and the greedy
token take the lowest id (the id-order argmax), `top_k_rank` the lowest ids at its boundary (a scan in id order),
xtc's survivor the lowest id among the least probable targets.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from samplec.frontend.expand import EXPAND, history_window
from samplec.frontend.lower import NEG_INF, XTC_COUNTER, any_rows, const, gumbel, history_message, penalize, uniform, where
from samplec.ir.graph import INPUT, Check, Graph, Node, make
from samplec.ir.ops import STAGE_OPS
from samplec.ir.types import BOOL, F32, I32, U32
from samplec.passes.rewrite import rebuild

# cuts that need the row's order (their dense definitions select by 32 rounds): they sort the row
SORTING = {"top_k", "top_k_rank", "top_p", "typical_p"}
# stages that do not depend on the order of the row: their dense definitions run on the sorted values as they are
ORDER_FREE = {"dynamic_temperature", "min_p", "top_n_sigma", "epsilon", "eta"}
BIG_ID = 2 ** 31 - 1
# elementwise ops: a stage's rule on the row, the same token by token in either order
ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "maximum", "minimum", "neg", "abs", "lt", "le", "gt", "ge", "eq",
                         "ne", "logical_and", "logical_or", "logical_not", "bit_and", "bit_or", "bit_xor", "shl", "shr",
                         "exp", "log", "sqrt", "isnan", "isposinf", "isfinite", "cast", "where", "filter"})


@dataclass(frozen=True)
class Row:
    """A chain's row: `s` sorted (f32[B,V], descending, removed tokens -inf) and `x` the same row in id order.
    `prefix`: the kept tokens are the first places of `s` from `start` on (every cut so far kept a top set); `head`:
    place `start` of `s` holds the row's maximum. `start` (i32 [B,1]; None: place 0) moves where xtc removes the
    most probable tokens: the survivor, the row's new maximum, is the first place kept."""
    s: Node
    x: Node
    last: Node          # V - 1, i32[1]
    prefix: bool = True
    head: bool = True
    top_: Node | None = None    # the row's maximum where known (a cut keeps it: the row's before the cut)
    # bool [B,1] where a row keeps only its first maximum (temperature 0) while `x` holds every value equal to it:
    # the draw then takes no noise (the lowest id wins), and `exact()` keeps the first alone for other readers
    greedy: Node | None = None
    # what the stages made of this row, by name: "probs" -> (its probabilities in sorted order, their sum's
    # denominator), which a reader of the row's normalizer (raw_logprob, top_logprobs) takes instead of a sum of its own
    made: dict = field(default_factory=dict, compare=False, repr=False)
    start: Node | None = None
    # the candidates form (`places`: the CPU's, module doc): `s` holds the first N places only, `ids` their ids;
    # `whole` ([B,1] bool) where they are the whole row (V <= places), `bad` ([B,1]) where a stage read a sum over
    # the candidates while they may not have held every kept token; `fresh`: no cut yet (`x` is a whole row: its
    # sums are exact)
    ids: Node | None = None
    whole: Node | None = None
    bad: Node | None = None
    fresh: bool = False

    def held(self) -> Node:
        """[B,1] bool: where the candidates hold every kept token -- they are the whole row, or a cut removed the
        last place. Every cut on candidates is a threshold on the value (a token past the last place holds a value
        no larger than it) whose rule they decide exactly, and a removed place stays removed."""
        last = make("place", self.s, index=self.ids.attr("places") - 1)
        return make("logical_or", self.whole, make("le", last, const(NEG_INF)))

    def uncovered(self) -> Node:
        """[B,1] bool: where a draw from the candidates may not be the whole row's."""
        out = make("logical_not", self.held())
        return out if self.bad is None else make("logical_or", out, self.bad)

    def exact(self) -> Node:
        """The id-order row as the dense definitions hold it (where `greedy`: the first maximum alone)."""
        return self.x if self.greedy is None else where(self.greedy, first_max(self.x), self.x)

    def top(self) -> Node:
        """The row's largest value, [B,1]: place `start` where it holds it (place 0: a view, no kernel; before the
        cuts that kept it, so that what reads it fuses with the cut), else a reduction."""
        if self.top_ is not None:
            return self.top_
        if not self.head:
            return make("reduce_max", self.x)
        return make("place", self.s, index=0) if self.start is None else make("gather", self.s, self.start)

    def first(self) -> Node:
        """The first kept place of a contiguous row: `start`, or place 0."""
        return const(0, I32) if self.start is None else self.start

    def place(self, k: Node) -> Node:
        """The place k (i32, [B,1] or a constant) counted from `start`, clamped into the row."""
        at = k if self.start is None else make("add", self.start, k)
        return make("minimum", make("maximum", at, const(0, I32)), self.last)

    def then(self, s: Node, x: Node | None = None, prefix: bool | None = None, head: bool | None = None,
             cut: bool = True, top: Node | None = None, greedy: Node | None = None,
             start: Node | None = None) -> "Row":
        """The row after a stage whose sorted form is `s` and id-order form `x` (by default `s` rerooted at this
        row's `x`): a cut (keeps the maximum where it was), or a monotone map (`cut=False`: the maximum is the map
        of the maximum, `s` rerooted at it, unless given)."""
        head = self.head if head is None else head
        if head and top is None:
            top = self.top() if cut else reroot(s, self.s, self.top())
        if greedy is not None and self.greedy is not None:
            greedy = make("logical_or", self.greedy, greedy)
        return Row(s, flat(reroot(s, self.s, self.x) if x is None else x), self.last,
                   self.prefix if prefix is None else prefix, head, top, self.greedy if greedy is None else greedy,
                   start=self.start if start is None else start, ids=self.ids, whole=self.whole, bad=self.bad, fresh=self.fresh and not cut)


def flat(x: Node) -> Node:
    """The id-order row `x` with its nested cuts as one: filter(filter(b, k), c) is filter(b, k and c') -- c' is c
    reading b where it read filter(b, k) (equal where k holds; elsewhere the token is removed either way) -- and a
    map that keeps -inf, where(eq(y, -inf), y, f(y)), moves inside the filter. Each stage's rule then reads the row
    before the cuts, and the row is one elementwise kernel of a depth that grows with the logarithm of the stages,
    not with their number (MLX's compile stops fusing at depth 11: a nested row of five cuts is cut into kernels
    that each write the row). The same values, token by token."""
    memo: dict[int, tuple[Node, Node | None]] = {}

    def go(n: Node) -> tuple[Node, Node | None]:
        got = memo.get(id(n))
        if got is not None:
            return got
        got = (n, None)
        if n.op == "filter" and n.type.dtype == F32:
            b, k = go(n.inputs[0])
            c = _reading(n.inputs[1], n.inputs[0], b)
            got = (b, c if k is None else make("logical_and", k, c))
        elif n.op == "where" and n.type.dtype == F32 and n.inputs[0].type.shape[-1:] == (1,):
            (b1, k1), (b2, k2) = go(n.inputs[1]), go(n.inputs[2])
            if k1 is not None or k2 is not None:
                p = _mirrored(n.inputs[0])
                k1 = const(True, BOOL) if k1 is None else k1
                k2 = const(True, BOOL) if k2 is None else k2
                got = (b1 if b1 is b2 else make("where", p, b1, b2), make("where", p, k1, k2))
        elif n.op == "where" and n.inputs[0].op in ("eq", "le") and n.inputs[0].inputs[0] is n.inputs[1] and \
                n.inputs[0].inputs[1].is_const(NEG_INF):
            y = n.inputs[1]
            b, k = go(y)
            if k is not None:       # (a map that keeps -inf: where(y == -inf, y, f(y)))
                got = (make("where", make(n.inputs[0].op, b, n.inputs[0].inputs[1]), b, _reading(n.inputs[2], y, b)),
                       k)
        memo[id(n)] = got
        return got
    b, k = go(x)
    return b if k is None else keep(b, k)


MIRROR = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq", "ne": "ne"}


def _mirrored(p: Node) -> Node:
    """A comparison with its operands swapped (the same values): the id-order row's own copy of a per-row flag the
    sorted row reads too -- MLX's compile would merge two equal nodes into one read by two kernels, a kernel of its
    own."""
    return make(MIRROR[p.op], p.inputs[1], p.inputs[0]) if p.op in MIRROR else p


def _reading(n: Node, y: Node, b: Node) -> Node:
    """n with y replaced by b along its elementwise nodes (what it reads through another op stays)."""
    memo: dict[int, Node] = {id(y): b}

    def go(m: Node) -> Node:
        got = memo.get(id(m))
        if got is None:
            got = memo[id(m)] = rebuild(m, tuple(go(i) for i in m.inputs)) if m.op in ELEMENTWISE else m
        return got
    return go(n)


class PlaceBound(Exception):
    """A stage's sorted form reads a value tied to a place (an index row, a scan): it has no rerooted form."""


def _first_max(n: Node, s: Node) -> bool:
    """n is eq(iota(s), argmax(s)): the place of the row's first maximum (the dense temperature's greedy row)."""
    return n.op == "eq" and n.inputs[0].op == "iota" and n.inputs[0].inputs[0] is s and \
        n.inputs[1].op == "argmax" and n.inputs[1].inputs[0] is s


def reroot(out: Node, s: Node, x: Node) -> Node:
    """`out`, an expression of the sorted row `s`, as the same expression of the id-order row `x`: every elementwise
    node that reads `s` through elementwise nodes is rebuilt on `x`; what it reads through a reduction or a view of
    one place (a per-row value) is shared. The first maximum's place becomes the first maximum's id. Any other value
    tied to a place (an index row, a scan, a gather of the row) raises PlaceBound."""
    memo: dict[int, Node] = {id(s): x}
    dep: dict[int, bool] = {id(s): True}

    def depends(n: Node) -> bool:
        got = dep.get(id(n))
        if got is None:
            got = dep[id(n)] = _first_max(n, s) or (n.op in ELEMENTWISE and any(depends(i) for i in n.inputs))
        return got

    def go(n: Node) -> Node:
        got = memo.get(id(n))
        if got is not None:
            return got
        if _first_max(n, s):
            new = make("eq", make("iota", x), make("argmax", x))
        elif depends(n):
            ins = []
            for i in n.inputs:
                if not depends(i) and i.type.shape and i.type.shape[-1] != 1:
                    raise PlaceBound(f"{n.op} reads {i.op} {i.type} by place")
                ins.append(go(i) if depends(i) else i)
            new = rebuild(n, tuple(ins))
        else:
            new = n
        memo[id(n)] = new
        return new
    return go(out)


def sort_row(x: Node, places: int = 0) -> Row:
    """The row's values sorted descending (a view of MLX's ascending sort, reversed: what reads it is elementwise,
    a view of a place or a gather); with `places`, its candidates: the first N = min(places, V) places and their
    ids (a partition and a sort of N), contained from the start where V <= places."""
    if not places:
        return Row(make("sort", x, descending=True, name="s"), x, make("last_index", x))
    ids = make("candidates", x, places=places, name="candidate_ids")
    s = make("gather", x, ids, name="s")
    # (V <= places, [1], as a [B,1] flag: ids are never negative)
    whole = make("logical_and", make("lt", make("last_index", x), const(places, I32)),
                 make("ge", make("place", ids, index=0), const(0, I32)))
    return Row(s, x, make("last_index", s), ids=ids, whole=whole, fresh=True)


def kept(s: Node) -> Node:
    return make("ne", s, const(NEG_INF))


def keep(s: Node, flag: Node, name: str | None = None) -> Node:
    return make("filter", s, flag, name=name)


def probs_of(r: Row) -> Node:
    got = r.made.get("probs")
    if got is None:
        e = make("exp", make("sub", r.s, r.top()))
        # (the candidates of a row no cut touched: the sum of the whole row, in id order)
        total = make("sum", make("exp", make("sub", r.x, r.top())) if r.ids is not None and r.fresh else e)
        got = r.made["probs"] = (make("div", e, total, name="p"), total)
    return got[0]


def first_max(x: Node) -> Node:
    """The row with only its first maximum kept (the lowest id among equal maxima)."""
    return keep(x, make("eq", make("iota", x), make("argmax", x)))


# ---- the cuts on the logit order, in sorted order -----------------------------------------------------------------

def top_k(r: Row, k: Node) -> Row:
    """keep x >= v_k, v_k the k-th largest (-inf past the kept tokens): with the kept tokens first it is s at place
    k - 1; else the k-th kept value in place order."""
    if r.prefix and k.op == "const" and k.attr("value") <= 0:
        return r
    if r.prefix and k.op == "const" and r.start is None:
        vk = make("place", r.s, index=k.attr("value") - 1, name="v_k")
    elif r.prefix:
        vk = make("gather", r.s, r.place(make("sub", k, const(1, I32))), name="v_k")
    else:
        live = kept(r.s)
        rank = make("cumsum", make("cast", live, dtype=I32))
        vk = make("reduce_max", where(make("logical_and", live, make("eq", rank, k)), r.s, const(NEG_INF)),
                  name="v_k")
    return r.then(where(make("le", k, const(0, I32)), r.s, keep(r.s, make("ge", r.s, vk)), name="x_topk"))


def top_k_rank(r: Row, k: Node) -> Row:
    """the first k kept places (equal values in id order: the lowest ids first). In id order: every value above the
    k-th kept value v, and of those equal to v the lowest ids, as many as the k places leave (the dense rule with
    v read off the sorted row)."""
    live = kept(r.s)
    rank = (make("iota", r.s) if r.start is None else make("sub", make("iota", r.s), r.start)) if r.prefix else \
        make("sub", make("cumsum", make("cast", live, dtype=I32)), const(1, I32))
    off = make("le", k, const(0, I32))
    s = where(off, r.s, keep(r.s, make("lt", rank, k)), name="x_topk_rank")
    if r.prefix:
        v = make("gather", r.s, r.place(make("sub", k, const(1, I32))), name="v_k")
    else:
        v = make("reduce_max", where(make("logical_and", live, make("eq", rank, make("sub", k, const(1, I32)))),
                                     r.s, const(NEG_INF)), name="v_k")
    need = make("sub", k, make("sum", make("cast", make("gt", r.s, v), dtype=I32)))
    above, at = make("gt", r.x, v), make("eq", r.x, v)
    first = make("le", make("cumsum", make("cast", at, dtype=I32)), need)
    x = where(off, r.x, keep(r.x, make("logical_or", above, make("logical_and", at, first))), name="x_topk_rank")
    return r.then(s, x, prefix=False)


def top_p(r: Row, p: Node) -> Row:
    """keep i iff S_i < p, S_i the mass of the more probable tokens: at the first place of a run of equal
    probabilities S_i is the running mass before it, so the kept probabilities are those at least the smallest
    probability whose place has a running mass before it below p (ties at the boundary kept; every token where the
    rounded mass never reaches p)."""
    if p.op == "const" and p.attr("value") >= 1.0:
        return r
    q = probs_of(r)
    before = make("sub", make("cumsum", q), q, name="mass_before")
    open_ = make("logical_and", make("lt", before, p), make("gt", q, const(0.0)))     # (a removed place: q = 0)
    if p.op != "const":     # (p >= 1 is off: every place counts, the floor is the row's least probability)
        open_ = make("logical_or", open_, make("ge", p, const(1.0)))
    floor = make("reduce_min", where(open_, q, const(float("inf"))), name="p_min")
    out = r.then(keep(r.s, make("ge", q, floor), name="x_topp"))
    if r.ids is not None and not r.fresh:   # (a running mass over the candidates: exact where they hold the row)
        unheld = make("logical_not", r.held())
        out = replace(out, bad=unheld if r.bad is None else make("logical_or", r.bad, unheld))
    return out


def typical_p(r: Row, m: Node) -> Row:
    """the dense definition's score |mean(d) - d_i|; s* = the score where the mass in ascending score first reaches
    m, found by one sort of the scores."""
    q = probs_of(r)
    live = make("gt", q, const(0.0))
    top = r.top()
    d = make("sub", r.s, top)
    mean_d = make("sum", where(live, make("mul", q, d), const(0.0)), name="mean_d")
    score = where(live, make("abs", make("sub", mean_d, d)), const(float("inf")), name="score")
    by_score = make("argsort", score, descending=False)
    mass = make("cumsum", make("gather", q, by_score))
    t = make("sum", make("cast", make("lt", mass, m), dtype=I32))
    reached = make("gather", score, make("gather", by_score, make("minimum", t, r.last)))
    # (where the mass never reaches m, or reaches it on a removed token's place, the cutoff is +inf: every kept
    # token is kept, and a removed one's +inf score passing it keeps it at -inf -- the dense rule's largest finite
    # score, without a reduction of its own)
    cutoff = where(make("le", t, r.last), reached, const(float("inf")), name="score_cutoff")
    flag = make("logical_or", make("le", score, cutoff), make("eq", r.s, top))
    return r.then(where(make("ge", m, const(1.0)), r.s, keep(r.s, flag), name="x_typical"), prefix=False)


def noise_bits(x: Node, seed: Node, position: Node, with_coin: bool = False,
               ids: bool = False) -> tuple[Node, Node | None]:
    """RandomBits at (id, position) for every id of the row -- the draw's noise (`ids`: x is the ids themselves, a
    row's candidates) -- and, with `with_coin`, at (0xFFFFFFFF, position) too -- xtc's coin -- from one RandomBits
    over both counters (20 Threefry rounds are ~10 kernels: one set for the two)."""
    pos = make("cast", position, dtype=U32)
    if not with_coin:
        return make("random_bits", seed, make("cast", x if ids else make("iota", x), dtype=U32), pos,
                    name="bits"), None
    both = make("random_bits", seed, make("coin_ids", x), pos, name="bits")
    return make("tail", both, start=1), make("place", both, index=0, name="xtc_bits")


def xtc(r: Row, thr: Node, prob: Node, seed: Node, position: Node, coin_bits: Node | None = None) -> Row:
    """the dense definition. The targets (probability >= thr) are the first kept places of the sorted row, the
    least probable last: the sorted form keeps the last target place, the id-order form the lowest id among the
    least probable targets (the same value: the two forms hold the same values). Where it fires, the survivor is
    the row's maximum and the first place kept: the row's `start` (a contiguous row stays contiguous from it)."""
    if coin_bits is None:
        coin_bits = make("random_bits", seed, const(XTC_COUNTER, U32), make("cast", position, dtype=U32),
                         name="xtc_bits")
    coin = uniform(coin_bits)
    q = probs_of(r)
    target = make("logical_and", make("ge", q, thr), kept(r.s), name="xtc_top")
    n_top = make("sum", make("cast", target, dtype=I32))
    p_least = make("reduce_min", where(target, q, const(float("inf"))))
    fire = make("logical_and", make("lt", coin, prob), make("ge", n_top, const(2, I32)))
    start = r.first()
    last = make("add", start, make("sub", n_top, const(1, I32))) if r.prefix else \
        make("reduce_max", where(target, make("iota", r.s), const(-1, I32)))
    remove_s = make("logical_and", target, make("ne", make("iota", r.s), last))
    target_x, q_x = reroot(target, r.s, r.x), reroot(q, r.s, r.x)
    survivor = make("reduce_min", where(make("logical_and", target_x, make("eq", q_x, p_least)), make("iota", r.x),
                                        const(BIG_ID, I32)), name="xtc_survivor")
    remove_x = make("logical_and", target_x, make("ne", make("iota", r.x), survivor))
    # (prob = 0 is off: the coin, in (0, 1), is never below it)
    s = where(make("logical_and", fire, remove_s), const(NEG_INF), r.s, name="x_xtc")
    x = where(make("logical_and", fire, remove_x), const(NEG_INF), r.x, name="x_xtc")
    if not (r.head and r.prefix):   # (a row already cut apart: its maximum by a reduction, as every later reader's)
        return r.then(s, x, prefix=False, head=False)
    # (the maximum's value read off the row before the cut, which is made anyway: the survivor's where it fired)
    moved = where(fire, last, start, name="xtc_start")
    return r.then(s, x, top=make("gather", r.s, moved), start=moved)


def temperature(r: Row, t: Node) -> Row:
    """the dense definition, with the row's maximum read at place 0 where it holds it: t = 0 keeps the first
    maximum's place of the sorted row, and every value equal to the maximum in the id-order row with the row marked
    `greedy` (the first of them is the token: the draw takes no noise there)."""
    top = r.top()
    # (the dense rule's t = 0 or max / t out of range, in one test: max / 0 is not finite either -- a row whose
    # maximum is not finite is an error of its own)
    zero = make("logical_not", make("isfinite", make("div", top, t)), name="t_greedy")

    def form(row: Node, greedy_row: Node) -> Node:
        # (t = 1 needs no case of its own: x / 1 is x; where the row is greedy, row / t is not read)
        # (-inf as x <= -inf: MLX's isfinite holds an x == -inf of its own, which its compile would merge with this
        # one on the row's maximum, a value the checks read too -- a kernel of its own)
        scaled = where(make("le", row, const(NEG_INF)), row, make("div", row, t))
        return where(zero, greedy_row, scaled, name="x_temp")
    first = r.first() if r.head else make("argmax", r.s)     # (the first maximum's place)
    s = form(r.s, keep(r.s, make("eq", make("iota", r.s), first)))
    return r.then(s, form(r.x, keep(r.x, make("eq", r.x, top))), cut=False, top=form(top, top), greedy=zero)


SORTED_STAGES = {"top_k": top_k, "top_k_rank": top_k_rank, "top_p": top_p, "typical_p": typical_p, "xtc": xtc,
                 "temperature": temperature}
# stages that run in sorted order only where their row already is (alone, they need no sort)
FOLLOWERS = {"xtc", "temperature"}


MAPS = {"temperature", "dynamic_temperature"}     # (monotone maps: every other stage is a cut that keeps the top)


def min_p(r: Row, m: Node) -> Row:
    """the dense definition (keep x >= max + log m) with the maximum at place 0 where it holds it; m = 0 needs no
    case of its own: log 0 = -inf keeps every token (a row whose maximum is +inf is an error of its own)."""
    floor = make("add", r.top(), make("log", m), name="minp_floor")
    return r.then(keep(r.s, make("ge", r.s, floor), name="x_minp"))


def order_free(op: str, r: Row, operands: list[Node]) -> Row:
    """The dense definition on the sorted values, its maximum of the row read at place 0 where that holds it."""
    if op == "min_p":
        return min_p(r, *operands)
    out = EXPAND[op](r.s, *operands)
    if r.head:
        out = _substitute(out, lambda n: r.top() if n.op == "reduce_max" and n.inputs[0] is r.s else None)
    return r.then(out, cut=op not in MAPS)


def _substitute(root: Node, swap) -> Node:
    """root with every node for which swap(node) gives a node replaced by it."""
    new: dict[int, Node] = {}
    for n in Graph("expression", (), (("out", root),)).toposort():
        got = swap(n)
        new[id(n)] = got if got is not None else rebuild(n, tuple(new[id(i)] for i in n.inputs)) \
            if n.op != INPUT else n
    return new[id(root)]


# ---- the pass ----------------------------------------------------------------------------------------------------

# the check of the rows whose kept tokens the candidates may not hold: `Program` runs such a call again with the
# row sorted (it is never an error)
UNCOVERED = ("the CPU's candidates may not hold every kept token: calling the program runs such a call again with "
             "the rows sorted (a caller of Program.queue calls the program for these rows)")


class NotCandidates(Exception):
    """Something reads a candidates row other than the stages and draws that run on them."""


# what runs on a row's candidates (the CPU's portable lowering): cuts by a value threshold the candidates decide
# (top_k, top_p, min_p), the temperature and the draws; the drawn row's other readers (its log-probability, `probs`)
# read it exact where the draw's flag holds; a chain with any other stage, or a reader of a row before the draw,
# sorts its row
CANDIDATE_STAGES = frozenset({"top_k", "top_p", "min_p", "temperature"})
CANDIDATE_DRAWS = frozenset({"sample", "argmax"})
# N: 4096 places hold the kept tokens of every cut but a wide top_k or top_p on a flat row (those are run again
# with the sort); a partition of 152064 floats and a sort of 4096 take ~2 ms on one core, a sort of the row ~17 ms
PLACES = 4096


def drawn_rows(g: Graph) -> set[int]:
    """ids of g's stage nodes a draw reads: the rows whose draw's flag covers every reader."""
    return {id(n.inputs[0]) for n in g.toposort() if n.op in CANDIDATE_DRAWS and n.inputs[0].op in STAGE_OPS}


def candidates_fit(g: Graph) -> bool:
    """Whether every chain of g runs on candidates: its stages CANDIDATE_STAGES, each read by the next stage and a
    draw alone -- the drawn row by anything (its id-order form, exact where the draw's flag holds: `probs`)."""
    users = g.users()
    stages = [n for n in g.toposort() if n.op in STAGE_OPS]
    drawn = drawn_rows(g)

    def reads(u: Node, n: Node) -> bool:
        return u.op in CANDIDATE_STAGES | CANDIDATE_DRAWS and u.inputs[0] is n and n not in u.inputs[1:]
    return bool(stages) and all(n.op in CANDIDATE_STAGES and (id(n) in drawn or all(
        reads(u, n) for u in users.get(id(n), []))) for n in stages)


class _Lowering:
    def __init__(self, g: Graph, keep: set = frozenset(), places: int = 0):
        self.places = places                    # the candidates form where > 0 (module doc)
        self.drawn_rows = drawn_rows(g)         # (on candidates: the rows whose id-order form may be read)
        self.uncovered: list[Node] = []         # its draws' flags: where the row is drawn again from a sort
        self.keep = keep                        # ids of nodes kept as they are (a kernel's region)
        self.users = g.users()
        self.dense: dict[int, Node] = {}        # id(old) -> the new node in id order
        self.sorted: dict[int, Row] = {}        # id(old) -> the new row in both orders
        self.drawn: dict[int, tuple[Node | None, Row]] = {}     # id(old draw) -> (its token [B,1] or None: greedy, its row)
        self.noise: dict[int, Node] = {}        # id(old sample) -> its noise bits, where xtc's RandomBits made them
        self.totals: dict[int, tuple[Node, Node]] = {}      # id(row) -> (its maximum, its exponentials' sum)
        self.in_range: set[int] = set()     # ids of new index nodes in [0, V) by construction (draws, argmax)
        self.ids_over: dict[int, Node] = {}     # id(old history) -> its ids >= V flag from a penalties' scatter
        self.windows: dict[int, int] = {}       # id(old history) -> the windows of it counted so far, less one
        # a penalties stage's check where another penalties stage reads its row: the check of the last stage of
        # the run (penalties_overflow by the operands' ids), whose flag holds its rows (`penalties`)
        stages = [n for n in g.toposort() if n.op in ("penalties", "penalties_overflow")]
        checks = {_operands(n): n for n in stages if n.op == "penalties_overflow"}
        then = {_operands(n.inputs[0]): _operands(n) for n in stages if n.op == "penalties" and
                n.inputs[0].op == "penalties"}
        # x -> its log-softmax, where a `topk_ids` (top_logprobs' argsort) writes that row anyway: what else reads
        # the log-softmax of x at some ids gathers from the written row (the same bits; no kernel of its own)
        self.written: dict[int, Node] = {id(n.inputs[0].inputs[0]): n.inputs[0] for n in g.toposort()
                                         if n.op == "topk_ids" and n.inputs[0].op == "log_softmax" and
                                         id(n.inputs[0]) not in keep and not places}
        self.nan_free: set[int] = set()     # ids of new rows that hold no NaN (their maximum: a sort's place 0)
        self.inner = set(then)      # the operands of penalties stages another penalties stage reads
        self.checked_later: dict[int, Node] = {}
        for n in checks.values():
            last = _operands(n)
            while last in then:
                last = then[last]
            if last != _operands(n) and last in checks and not {id(n), id(checks[last])} & keep:
                self.checked_later[id(n)] = checks[last]

    def value(self, n: Node) -> Node:
        """n in id order (of a chain's row: its id-order form as the dense definitions hold it)."""
        got = self.dense.get(id(n))
        if got is None:
            if self.sorted[id(n)].ids is not None and id(n) not in self.drawn_rows:
                raise NotCandidates(n.op)
            got = self.dense[id(n)] = self.sorted[id(n)].exact()
        return got

    def normalizer(self, n: Node) -> tuple[Node, Node]:
        """(maximum, log-sum-exp) of n's row, [B,1] each; of a chain's row, its maximum and `total`."""
        r = self.sorted.get(id(n))
        if r is not None:
            top, total = self.total(r)
            lse = make("log", total)        # (a greedy row holds one token: its log-sum-exp is 0)
            return top, lse if r.greedy is None else where(r.greedy, const(0.0), lse)
        top = self.top_of(n)
        # (x + (-top) is x - top bit for bit -- IEEE's subtraction adds the negation --, written apart from the
        # log-softmax's own x - top: MLX's compile merges equal nodes, and the merged one, read by two kernels,
        # would be a kernel of its own and split the exponential from its sum)
        return top, make("log", make("sum", make("exp", make("add", self.value(n), make("neg", top)))))

    def total(self, r: Row) -> tuple[Node, Node]:
        """(maximum, sum of exp(x - maximum)) of a chain's row, made once: the sum a stage took of it in sorted
        order where one did, else in id order (the sorted form of the stages after the last cut is then not made
        at all)."""
        got = self.totals.get(id(r))
        if got is None:
            top = r.top()
            made = r.made.get("probs") if r.greedy is None else None     # (a stage summed the row already)
            # (a chain's row on candidates: their sum, the row's where they hold every kept token -- what the draw's
            # flag tests)
            row = r.s if r.ids is not None and not r.fresh else r.x
            got = self.totals[id(r)] = (top, made[1] if made else make("sum", make("exp", make("sub", row, top))))
        return got

    def softmax_of(self, n: Node) -> Node | None:
        """x where n is div(exp(sub(x, reduce_max(x))), reduce_sum(that exp)) of a chain's row."""
        e, total = n.inputs
        if e.op != "exp" or total.op != "reduce_sum" or total.inputs[0] is not e or e.inputs[0].op != "sub":
            return None
        x, top = e.inputs[0].inputs
        return x if top.op == "reduce_max" and top.inputs[0] is x and id(x) in self.sorted else None

    def draw_sharing_noise(self, n: Node) -> Node | None:
        """The `sample` that ends n's chain (stage ops each read by the next alone) where it draws with n's seed and
        position (xtc's operands 3 and 4)."""
        m = n
        while True:
            readers = [u for u in self.users.get(id(m), []) if u.op != "logprob_at"]
            if len(readers) != 1 or readers[0].inputs[0] is not m:
                return None
            m = readers[0]
            if m.op == "sample":
                return m if m.inputs[1] is n.inputs[3] and m.inputs[2] is n.inputs[4] else None
            if m.op not in STAGE_OPS:
                return None

    def sorts_later(self, n: Node) -> bool:
        """Whether a stage after n, in a chain of stage ops each read by the next alone, sorts the row: the stages
        from n on then run in sorted order (a map or a cut before the sort commutes with it)."""
        while True:
            readers = self.users.get(id(n), [])
            if len(readers) != 1 or readers[0].op not in STAGE_OPS or readers[0].inputs[0] is not n:
                return False
            n = readers[0]
            if n.op in SORTING:
                return True

    def row(self, n: Node) -> Row:
        r = self.sorted.get(id(n))
        if r is None:
            r = self.sorted[id(n)] = sort_row(self.value(n), self.places)
        return r

    def visit(self, n: Node) -> None:
        if n.op == INPUT:
            self.dense[id(n)] = n
            return
        self.lower(n)
        if n.op in ("sample", "argmax", "topk_ids", "squeeze", "expand") and id(n) in self.dense and \
                (n.op not in ("squeeze", "expand") or id(self.value(n.inputs[0])) in self.in_range):
            self.in_range.add(id(self.dense[id(n)]))

    def lower(self, n: Node) -> None:
        x = n.inputs[0] if n.inputs else None
        in_sorted = x is not None and id(x) in self.sorted
        if id(n) in self.keep:
            self.dense[id(n)] = rebuild(n, tuple(self.value(i) for i in n.inputs))
        elif n.op == "expand" and x.op == "squeeze" and x.inputs[0].type == n.type:
            self.dense[id(n)] = self.value(x.inputs[0])     # (a [B,1] value squeezed and expanded again: itself)
        elif n.op == "xtc" and (in_sorted or self.sorts_later(n)) and self.draw_sharing_noise(n) is not None:
            # the chain's draw takes its noise from the same seed and position: one RandomBits for both
            r = self.row(x)
            thr, prob, seed, position = (self.value(i) for i in n.inputs[1:])
            noise, coin = noise_bits(r.x, seed, position, with_coin=True)
            self.noise[id(self.draw_sharing_noise(n))] = noise
            self.sorted[id(n)] = xtc(r, thr, prob, seed, position, coin)
        elif n.op in SORTED_STAGES and (n.op not in FOLLOWERS or in_sorted or self.sorts_later(n)):
            self.sorted[id(n)] = SORTED_STAGES[n.op](self.row(x), *[self.value(i) for i in n.inputs[1:]])
        elif n.op in ORDER_FREE and (in_sorted or self.sorts_later(n)):
            self.row(x)
            self.sorted[id(n)] = order_free(n.op, self.sorted[id(x)], [self.value(i) for i in n.inputs[1:]])
        elif n.op == "sample" and in_sorted:
            r = self.sorted[id(x)]
            seed, position = (self.value(i) for i in n.inputs[1:])
            bits = noise_bits(r.ids, seed, position, ids=True)[0] if r.ids is not None else \
                self.noise.get(id(n)) or noise_bits(r.x, seed, position)[0]
            g = gumbel(bits) if r.greedy is None else where(r.greedy, const(0.0), gumbel(bits))
            if r.ids is not None:
                # on the candidates: the lowest id among the largest noisy values
                noisy = make("add", r.s, g, name="noisy")
                best = make("eq", noisy, make("reduce_max", noisy))
                token = make("reduce_min", where(best, r.ids, const(BIG_ID, I32)), name=n.name)
                self.uncovered.append(r.uncovered())
            else:
                # the dense definition on the id-order row: ties between noisy values go to the lowest id
                token = make("argmax", make("add", r.x, g, name="noisy"), name=n.name)
            self.drawn[id(n)] = (token, r)
            self.dense[id(n)] = token
        elif n.op == "argmax" and in_sorted and (self.sorted[id(x)].ids is None or x.op in STAGE_OPS):
            r = self.sorted[id(x)]
            if r.ids is not None:   # (equal values in id order: place 0 holds the lowest id at the maximum)
                self.uncovered.append(r.uncovered())
                self.dense[id(n)] = make("place", r.ids, index=0, name=n.name)
            else:
                self.dense[id(n)] = make("argmax", r.x, name=n.name)       # (the lowest id at the maximum)
            self.drawn[id(n)] = (None, r)
        elif n.op == "logprob_at" and in_sorted and id(n.inputs[1]) in self.drawn and \
                self.drawn[id(n.inputs[1])][1] is self.sorted[id(x)]:
            token, r = self.drawn[id(n.inputs[1])]
            top, lse = self.normalizer(x)
            value = top if token is None else make("gather", r.x, token) if r.ids is None else \
                make("reduce_max", where(make("eq", r.ids, token), r.s, const(NEG_INF)))
            self.dense[id(n)] = make("sub", make("sub", value, top), lse, name=n.name)
        elif n.op == "logprob_at" or n.op == "take_along" and n.inputs[0].op == "log_softmax" and \
                id(n.inputs[0]) not in self.keep:     # (a kernel's log-softmax: its parts come from the kernel)
            # log_softmax(x) at some ids: x there less the maximum and the log-sum-exp, [B,1] parts (the full row's
            # log-softmax is never written)
            src = x if n.op == "logprob_at" else x.inputs[0]
            at = self.value(n.inputs[1])
            gather = "gather" if id(at) in self.in_range else "take_along"
            if id(src) in self.written and id(src) not in self.sorted:
                row = self.written[id(src)]
                if id(row) not in self.dense:       # (read before the log-softmax's own place in the order)
                    self.lower(row)
                self.dense[id(n)] = make(gather, self.dense[id(row)], at, name=n.name)
            else:
                top, lse = self.normalizer(src)
                picked = make(gather, self.value(src), at)
                self.dense[id(n)] = make("sub", make("sub", picked, top), lse, name=n.name)
        elif n.op == "log_softmax":
            if id(n) in self.dense:         # (lowered already, where a gather of it came first)
                return
            top, lse = self.normalizer(x)
            self.dense[id(n)] = make("sub", make("sub", self.value(x), top), lse, name=n.name)
        elif n.op == "div" and self.softmax_of(n) is not None:
            # softmax(x) of a chain's row (a `probs` output): its exponentials over their sum, which the draw's
            # log-probability shares
            r = self.sorted[id(self.softmax_of(n))]
            top, total = self.total(r)
            if r.greedy is not None:        # (the first maximum alone: its own sum)
                e = make("exp", make("sub", self.value(self.softmax_of(n)), top))
                total = make("sum", e)
            else:
                e = make("exp", make("sub", r.x, top))
            self.dense[id(n)] = make("div", e, total, name=n.name)
        elif n.op in ("penalties", "penalties_overflow"):
            self.penalties(n)
        elif n.op == "take_along" and n.inputs[1].op == "argmax" and n.inputs[1].inputs[0] is x and \
                x.type.dtype == "f32":
            # x at its argmax (the logits checks' maximum): the maximum itself (a NaN anywhere is the maximum)
            self.dense[id(n)] = self.top_of(x)
        elif n.op == "topk_ids" and self.candidates_of(x) is not None:
            self.dense[id(n)] = self.top_ids(n, x, self.candidates_of(x))
        elif n.op == "topk_ids":
            # the n largest, lowest id first on ties: a stable sort of the row (MLX partitions by a sort on a GPU)
            ids = make("argsort", self.value(x), descending=True)
            self.dense[id(n)] = make("slice", ids, start=0, stop=n.attr("k"), name=n.name)
        else:
            new = tuple(self.value(i) for i in n.inputs)
            self.dense[id(n)] = rebuild(n, new) if n.op not in EXPAND else _expanded(n, new)


    def candidates_of(self, n: Node) -> Row | None:
        """The candidates of the whole row x where n is log_softmax(x) (not a chain's row: a chain's input, or a row
        no chain reads)."""
        if not self.places or n.op != "log_softmax" or id(n) in self.keep or n.inputs[0].op in STAGE_OPS:
            return None
        r = self.sorted.get(id(n.inputs[0]))
        if r is None:       # (a row no chain reads: the raw logits' top_logprobs)
            r = self.sorted[id(n.inputs[0])] = sort_row(self.value(n.inputs[0]), self.places)
        return r if r.ids is not None and r.fresh else None

    def top_ids(self, n: Node, x: Node, r: Row) -> Node:
        """topk_ids(log_softmax(row)) from the row's candidates: their log-softmax values ordered by value (equal
        values by id: a log-softmax can make unequal logits equal) -- exact, and flagged otherwise, where the k-th
        value is above the last candidate's."""
        k = n.attr("k")
        if k >= self.places:
            raise NotCandidates("topk_ids")
        top, lse = self.normalizer(x.inputs[0])
        f = make("sub", make("sub", r.s, top), lse)
        by_id = make("argsort", r.ids, descending=False)
        f_id = make("gather", f, by_id)
        order = make("argsort", f_id, descending=True)
        kth = make("gather", f_id, make("gather", order, make("minimum", const(k - 1, I32), r.last)))
        held = make("logical_or", r.whole, make("gt", kth, make("place", f, index=self.places - 1)))
        self.uncovered.append(make("logical_not", held))
        return make("slice", make("gather", make("gather", r.ids, by_id), order), start=0, stop=k, name=n.name)

    def top_of(self, n: Node) -> Node:
        """n's row maximum: place 0 of its sorted row where the lowering sorted it, else a reduction."""
        r = self.sorted.get(id(n))
        return r.top() if r is not None and r.head else make("reduce_max", self.value(n))

    def penalties(self, n: Node) -> None:
        """penalties and its check, over the row: each token's count in the window by one scatter (the dense
        definition gathers the history's tokens, counts them pairwise and writes them back), then the penalty of
        spec §2 where the count is positive. The scatter (`counts`) adds ones at the window's ids and puts every other
        entry in a column past the row, so that where the ids go is one kernel and what they add none. The check
        is one maximum of the penalized row with NaN read as +inf (the row the chain reads: a row with a NaN
        fails; where the chain sorts the row, its first place): where the logits are valid (their own check
        comes first) a +inf or NaN there is a penalty's overflow, and -inf a row with nothing left. In a run of
        penalties stages each reading the row the one before wrote, the run's last check is every stage's (one
        maximum for the run): a later stage keeps a +inf, NaN or -inf token non-finite (its division, product and
        subtraction of a finite or infinite penalty give +inf, NaN or -inf again), and changes no token it does not
        count, so a row that fails an earlier stage's check fails the last one's, whose rows are then exactly the
        union of the stages' -- and the stages' checks have one message."""
        x, hist, last_n, rep, freq, pres = (self.value(i) for i in n.inputs)
        key = ("penalties", *(id(i) for i in n.inputs))
        if key not in self.dense:
            # (the k-th window of one history: its own forms of the same tests, so that no node of its index is
            # another window's -- each fuses into its scatter's index kernel)
            form = self.windows[id(n.inputs[1])] = self.windows.get(id(n.inputs[1]), -1) + 1
            valid = _window(hist, last_n, form)
            counts = make("counts", x, hist, valid, form=form, name="counts")
            self.ids_over.setdefault(id(n.inputs[1]), make("ids_over", x, hist, valid, form=form))
            pen = where(make("gt", counts, const(0.0)), penalize(x, counts, rep, freq, pres), x, name="x_pen")
            if _operands(n) not in self.inner:
                # (the row the chain reads with a NaN read as +inf: it holds no NaN, so its maximum is its sorted
                # row's first place on any device; a row with a NaN fails this check, and its outputs are not read)
                pen = where(make("isnan", pen), const(float("inf")), pen, name="x_pen")
                self.nan_free.add(id(pen))
            self.dense[key] = pen
        penalized = self.dense[key]
        if n.op == "penalties":
            self.dense[id(n)] = penalized
            return
        if id(n) in self.checked_later:     # (its flag is the run's last check's: set by lower_portable)
            return
        top = make("reduce_max", penalized if id(penalized) in self.nan_free else
                   where(make("isnan", penalized), const(float("inf")), penalized))
        self.dense[id(n)] = make("squeeze", make("logical_not", make("isfinite", top)), name=n.name)


def _window(hist: Node, last_n: Node, form: int) -> Node:
    """history_window's `valid` (not padding, in the last last_n), its padding test in the form `form` of equal ones
    (`le(0, h)`, `gt(h, -1)`, ...: no node shared with another window's)."""
    zero, minus = const(0, I32), const(-1, I32)
    nonneg = [lambda: make("ge", hist, zero), lambda: make("le", zero, hist), lambda: make("gt", hist, minus),
              lambda: make("lt", minus, hist)][form % 4]()
    return history_window(hist, last_n, make("last_index", hist), nonneg)[1]


def ids_checked(g: Graph, over: dict[int, Node]) -> tuple[Check, ...]:
    """The range checks (an id >= V) of g's histories that only penalties stages read: a history's ids are then
    the scatter's alone, which counts an id >= V in a column of its own (`ids_over`: no kernel), where the call's
    preparation would take a reduction of the history (`Program` leaves these histories to the graph: those
    whose check it holds). A history nothing reads (a penalties stage a call turned off) is checked by its maximum."""
    users = g.users()
    logits = g.params[0].node
    out = []
    for p in g.params:
        readers = users.get(id(p.node), [])
        if p.kind != "tokens" or any(u.op not in ("penalties", "penalties_overflow") or
                                     [i is p.node for i in u.inputs] != [False, True, False, False, False, False]
                                     for u in readers):
            continue
        flag = over.get(id(p.node))
        if flag is None:
            flag = make("gt", make("reduce_max", p.node), make("last_index", logits))
        out.append(Check(make("squeeze", flag), history_message(p.name)))
    return tuple(out)


def _operands(n: Node) -> tuple[int, ...]:
    return tuple(id(i) for i in n.inputs)


def _expanded(n: Node, inputs: tuple[Node, ...]) -> Node:
    out = EXPAND[n.op](*inputs)
    return out if out.name or not n.name else Node(out.op, out.inputs, out.attrs, out.type, n.name)


def _lowered(g: Graph, keep: set, places: int) -> "_Lowering":
    """The lowering of every node of g: on candidates where `places` (falling back to the sort where something
    reads their rows otherwise)."""
    low = _Lowering(g, keep, places)
    try:
        for n in g.toposort():
            low.visit(n)
        for k, last in low.checked_later.items():
            low.dense[k] = low.dense[id(last)]
        for n in g.roots():
            low.value(n)
    except NotCandidates:
        return _lowered(g, keep, 0)
    return low


def lower_portable(g: Graph, keep: set = frozenset(), kept: dict | None = None, check_ids: bool = False,
                   places: int = 0) -> Graph:
    """Every stage op of g as the sorted-order lowering (module doc); other ops (and those in `keep`, ids) as they
    are. `kept`, where given, receives id(old) -> its node in the result for each node of `keep` (rebuilt over
    lowered inputs where those changed). `check_ids`: the range checks of the histories only penalties stages read
    are the graph's (`ids_checked`)."""
    low = _lowered(g, keep, places if places and not keep and candidates_fit(g) else 0)
    out = g.replace({id(n): low.value(n) for n in g.roots()})
    if check_ids:
        out = Graph(out.name, out.params, out.outputs, ids_checked(g, low.ids_over) + out.checks)
    if low.uncovered:
        flag = low.uncovered[0]
        for f in low.uncovered[1:]:
            flag = make("logical_or", flag, f)
        out = Graph(out.name, out.params, out.outputs, out.checks + (Check(make("squeeze", flag), UNCOVERED),))
    new: dict[int, Node] = {}
    out = _device_sums(out, {id(n) for n in g.toposort()}, new, low.nan_free)
    if kept is not None:
        kept.update((k, new.get(id(low.dense[k]), low.dense[k])) for k in keep if k in low.dense)
    return out


def _device_sums(g: Graph, old: set, new: dict | None = None, nan_free: set = frozenset()) -> Graph:
    """The lowering's own float sums (the dense definitions it applied to sorted rows included) as `sum`: one
    reduction in the device's order; sums that were in g before stay the definitions' reduce_sum. The maximum of a
    row without NaN (`nan_free`, ids) that is sorted anyway: the sorted row's first place. `new` receives id(node of
    g) -> its node in the result."""
    new = {} if new is None else new
    order = g.toposort()
    sorts = {id(n.inputs[0]): n for n in order if n.op == "sort" and n.attr("descending")}
    for n in order:
        ins = tuple(new.get(id(i), i) for i in n.inputs)
        m = rebuild(n, ins) if n.op != INPUT else n
        if m.op == "reduce_sum" and id(n) not in old:
            m = Node("sum", m.inputs, (), m.type, m.name)
        elif n.op == "reduce_max" and id(n.inputs[0]) in nan_free and id(n.inputs[0]) in sorts and \
                id(sorts[id(n.inputs[0])]) in new:
            m = make("place", new[id(sorts[id(n.inputs[0])])], index=0, name=n.name)
        new[id(n)] = m
    return g.replace(new)
