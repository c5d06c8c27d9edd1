"""The portable target's checks: those a later check implies are tested through it (samplec.passes.checks), and a
call that check flags runs again with every check -- the error names the same check and rows as -O0's program and
the cpu target's, whatever mix of bad rows a batch holds; a history that only penalties stages read is range-checked
by their scatter (`ids_over`), not by a reduction of its own."""
from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import samplec
from samplec.ir.graph import INPUT, Node, make
from samplec.ir.types import BOOL, F32, Type
from samplec.passes.checks import EMPTY, HOT, IMPLIES, kept_bad, row_test

ROOT = Path(__file__).resolve().parents[1]
B, V = 6, 64

# each row's trouble: (what, how it is made)
TROUBLES = ["none", "nan", "nan masked", "+inf masked", "+inf", "all -inf", "mask empties", "bias -inf", "overflow", "nan + mask empties",
            "all -inf + bias -inf", "mask empties + bias -inf"]


def _inputs(prog, troubles: list[str], rng) -> tuple[np.ndarray, dict]:
    x = rng.standard_normal((B, V)).astype(np.float32)
    mask = np.ones((B, V), bool)
    bias = (rng.standard_normal((B, V)) * 0.1).astype(np.float32)
    rep = np.full(B, 1.1, np.float32)
    hist = rng.integers(-1, V, (B, 12)).astype(np.int32)
    for r, what in enumerate(troubles):
        for part in what.split(" + "):
            if part == "nan":
                x[r, rng.integers(V)] = np.nan
            elif part == "+inf":
                x[r, rng.integers(V)] = np.inf
            elif part in ("nan masked", "+inf masked"):    # (what an allow removes: the logits' check still fires)
                j = rng.integers(V)
                x[r, j] = np.nan if part == "nan masked" else np.inf
                mask[r, j] = False
            elif part == "all -inf":
                x[r] = -np.inf
            elif part == "mask empties":
                mask[r] = False
            elif part == "bias -inf":
                bias[r] = -np.inf
            elif part == "overflow":            # (a penalized logit past float32: 3e38 / 0.01)
                x[r, hist[r, -1] if hist[r, -1] >= 0 else 0] = 3e38
                hist[r, -1] = max(hist[r, -1], 0)
                rep[r] = 0.01
    kw = {}
    for p in prog.params:
        if p.kind == "tokens":
            kw[p.name] = mx.array(hist)
        elif p.kind == "mask":
            kw[p.name] = mx.array(mask)
        elif p.kind == "bias":
            kw[p.name] = mx.array(bias)
        elif p.kind == "seed":
            kw[p.name] = list(range(1, B + 1))
        elif p.name == "repetition_penalty":
            kw[p.name] = rep.tolist()
        elif p.name in ("temperature", "top_p"):
            kw[p.name] = [0.8] * B
    return x, kw


def _error(prog, x, kw) -> str | None:
    try:
        prog(mx.array(x), **kw)
    except samplec.SamplecError as e:
        return str(e)
    return None


CHAINS = [("vllm.smp", "vllm_constrained"), ("vllm.smp", "vllm"), ("openai.smp", "openai"),
          ("llama.smp", "llama"), ("hf_generate.smp", "hf_generate"), ("mlx_lm_default.smp", "mlx_lm_chat")]


@pytest.mark.parametrize("example,sampler", CHAINS)
def test_errors_name_the_check_that_fired(example, sampler):
    """Batches mixing bad rows of every kind: the portable program (checks implied by the penalties check dropped)
    raises what -O0's program and the cpu target's raise, on its first call (the full path) and on the next (the
    short path, where a call runs the program traced once)."""
    src = (ROOT / "examples" / example).read_text()
    portable = samplec.compile(src, sampler, target="portable")
    references = [samplec.compile(src, sampler, opt_level=0, target="portable"),
                  samplec.compile(src, sampler, target="cpu")]
    rng = np.random.default_rng(7)
    fired = set()
    for trial in range(16):
        troubles = [TROUBLES[0]] * B
        for r in rng.choice(B, size=rng.integers(1, 3), replace=False):
            troubles[r] = TROUBLES[rng.integers(1, len(TROUBLES))]
        x, kw = _inputs(portable, troubles, rng)
        want = [_error(ref, x, kw) for ref in references]
        assert want[0] == want[1], (troubles, want)
        for _ in range(2):
            assert _error(portable, x, kw) == want[0], troubles
        fired.add(want[0].split(":")[0] if want[0] else None)
    assert len(fired) >= 2          # (the trials hit more than one check)


def test_implied_checks_leave_the_program_and_its_launches():
    """vllm_constrained on the portable target: allow's and logit_bias' checks and the logits' -inf check are
    tested through the penalties check, whose message names them; it launches fewer kernels than the program with
    every check; a caller of `queue` who raises the flags itself gets the message naming every check it stands
    for."""
    from samplec.backend_mlx import kernels
    from samplec.backend_mlx.launches import call_primitives, launches
    from samplec.passes import target as target_pass
    src = (ROOT / "examples" / "vllm.smp").read_text()
    graph = samplec.compile(src, "vllm_constrained", target="portable").stage_graph
    with pytest.MonkeyPatch.context() as m:
        m.setattr(target_pass, "partitions", lambda: False)     # (as a GPU lowers it: the launches are a GPU's)
        prog = samplec.Program(graph, target="portable")
        every = samplec.Program(graph, target="portable", every_check=True)
    messages = [c.message for c in prog.graph.checks]
    assert not any(m.startswith(("allow:", "logit_bias:")) for m in messages)
    assert "logits: NaN or +inf" in messages        # (allow may remove a NaN: not implied)
    (covering,) = [m for m in messages if IMPLIES in m]
    for name in ("logits: every entry is -inf", "allow: the mask allows", "logit_bias: a -inf bias",
                 "logit_bias: a biased logit overflows"):
        assert name in covering
    assert any(c.message.startswith("allow:") for c in every.graph.checks)
    x, kw = _inputs(prog, ["none"] * B, np.random.default_rng(1))
    kw.update(frequency_penalty=[0.1] * B, presence_penalty=[0.1] * B, top_k=[20] * B, min_p=[0.05] * B)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SAMPLEC_NATIVE", "0")
        m.setattr(kernels, "GPU_SUMS", True)
        assert launches(call_primitives(prog, mx.array(x), **kw)) <= \
            launches(call_primitives(every, mx.array(x), **kw)) - 4
    x, kw = _inputs(prog, ["none", "mask empties"] + ["none"] * (B - 2), np.random.default_rng(2))
    outs, checks = prog.queue(mx.array(x), **kw)
    mx.eval(outs + [f for _, f in checks])
    with pytest.raises(samplec.SamplecError, match=r"\(or a check it implies: .*allow: the mask allows .*\(row 1\)"):
        prog.raise_flagged(checks)
    with pytest.raises(samplec.SamplecError, match=r"^allow: the mask allows none of the tokens left \(row 1\)$"):
        prog(mx.array(x), **kw)


def _param(name: str, shape=("B", "V"), dtype=F32) -> Node:
    return Node(INPUT, (), (("index", 0),), Type(dtype, shape), name)


def test_what_a_bad_row_stays_through():
    """bad-ness walked back from a penalties stage's row: through a bias add (either operand) and a penalties stage
    both ways; through an allow only a row with no finite entry (an allow may remove the NaN or +inf); not through
    a cut."""
    x, b, m = _param("x"), _param("b"), _param("m", dtype=BOOL)
    inf = make("const", value=-math.inf, dtype=F32)
    allowed = make("where", m, x, inf)
    biased = make("add", allowed, b)
    reach = kept_bad(biased)
    assert reach[id(biased)] == {HOT, EMPTY} and reach[id(b)] == {HOT, EMPTY}
    assert reach[id(allowed)] == {HOT, EMPTY} and reach[id(x)] == {EMPTY}
    k = make("expand", _param("k", ("B",), "i32"))
    cut = make("top_k", x, k)
    assert id(x) not in kept_bad(cut)
    top = make("squeeze", make("reduce_max", x))
    assert row_test(make("eq", top, inf)) == (x, EMPTY)
    assert row_test(make("logical_or", make("isnan", top), make("isposinf", top))) == (x, HOT)
    assert row_test(make("squeeze", make("isposinf", make("reduce_max", x)))) == (x, HOT)
    assert row_test(make("isnan", top)) is None       # (a NaN alone: not a test this pass knows)


HISTORY_CHAINS = [
    ("sampler s(h: tokens, g: tokens, r: float = 1.1, f: float = 0.1, seed: seed = 0) -> token, logprob "
     "{ penalties(h, repeat = r) penalties(g, last_n = 4, frequency = f) top_k(20) sample(seed) }", {"h", "g"}),
    # (g read by DRY too: its check stays the call's; h read by penalties alone: the graph's)
    ("sampler s(h: tokens, g: tokens, seed: seed = 0) -> token "
     "{ penalties(h, repeat = 1.2) dry(g, 0.8) top_k(20) sample(seed) }", {"h"}),
]


@pytest.mark.parametrize("src,in_graph", HISTORY_CHAINS)
def test_history_range_checked_by_the_penalties_scatter(src, in_graph):
    """An id >= V anywhere in a history (in the penalties' window or not, beside padding of any negative value): the
    portable program names the history and its rows as the cpu target does -- int32 MLX histories on the short
    path and the full path, int64 and numpy ones, and a call whose values turn the penalties off (its program reads
    no history: the check is the history's maximum). The histories only penalties stages read are checked by the
    graph (no reduction of their own); a clean call gives the cpu target's tokens."""
    portable = samplec.compile(src, target="portable")
    cpu = samplec.compile(src, target="cpu")
    assert portable._ids_in_graph == in_graph and cpu._ids_in_graph == frozenset()
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((4, V)).astype(np.float32))

    def histories(bad: dict) -> dict:
        out = {}
        for name in ("h", "g"):
            a = rng.integers(-3, V, (4, 10)).astype(np.int32)
            for row, col in bad.get(name, []):
                a[row, col] = V + row
            out[name] = a
        return out

    cases = [{}, {"h": [(1, 9)]}, {"g": [(2, 0)]}, {"h": [(0, 0), (3, 5)], "g": [(3, 9)]}, {"g": [(0, 9), (1, 1)]}]
    for bad in cases:
        hs = histories(bad)
        for kind in ("mlx", "mlx", "int64", "numpy"):
            kw = {k: mx.array(v) if kind == "mlx" else mx.array(v.astype(np.int64)) if kind == "int64" else v
                  for k, v in hs.items()}
            for values in ({"seed": [1, 2, 3, 4]}, {"seed": [1, 2, 3, 4], "r": 1.0, "f": 0.0}):
                if not values.keys() <= {p.name for p in portable.params}:
                    continue
                want, got = _error(cpu, x, {**kw, **values}), _error(portable, x, {**kw, **values})
                assert got == want, (bad, kind, values)
                if not bad:
                    assert want is None
                    np.testing.assert_array_equal(np.array(portable(x, **kw, **values).token),
                                                  np.array(cpu(x, **kw, **values).token))
    assert portable.queue_stats["short"] > 0
    assert portable.queue_stats["specialized"] > 0 or "r" not in {p.name for p in portable.params}
