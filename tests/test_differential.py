"""Differential test: random chains in random orders, literal and run-time (scalar and per-row) parameters,
logit families (peaked, flat, ties, -inf heavy, long tails, tiny V) -- -O2 = -O0 = the numpy reference
(tests/reference.py), token for token, on every row.

-O2 keeps the stages as stage ops and, on the CPU with the native primitives, runs a chain of them ending in a
draw as one kernel that picks its algorithm per row (candidates above a block bound, growing where a cut may reach
below it); -O0 runs every stage by its dense definition. The budget is small in CI; `SAMPLEC_FUZZ_EXAMPLES=5000
python -m pytest tests/test_differential.py` runs longer.
"""
from __future__ import annotations

import os
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference as R
import samplec
from samplec.backend_mlx import kernels

EXAMPLES = int(os.environ.get("SAMPLEC_FUZZ_EXAMPLES", "60"))
ORDER_STAGES = ("temperature", "top_k", "top_p", "min_p", "top_n_sigma", "typical_p", "xtc", "epsilon", "eta")
FAMILIES = ("peaked", "flat", "ties", "neg_inf", "normal", "tail", "one_finite")


def family_row(kind: str, V: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "peaked":
        x = rng.standard_normal(V) * 0.5
        x[rng.integers(V)] += 12.0
    elif kind == "flat":
        x = np.full(V, 0.25) + (rng.standard_normal(V) * 1e-3 if rng.random() < 0.5 else 0.0)
    elif kind == "ties":
        x = rng.integers(-3, 3, V).astype(np.float64)
    elif kind == "neg_inf":
        x = rng.standard_normal(V) * 2
        x[rng.random(V) < 0.8] = -np.inf
        x[rng.integers(V)] = 1.0
    elif kind == "tail":      # a Zipf-like head over a wide tail that carries a few percent of the mass
        ranks = rng.permutation(V) + 1
        x = -1.1 * np.log(ranks) + rng.standard_normal(V) * 0.3 + 8.0
    elif kind == "one_finite":
        x = np.full(V, -np.inf)
        x[rng.integers(V)] = 0.5
    else:
        x = rng.standard_normal(V) * 3
    return x.astype(np.float32)


def stage_value(name: str, V: int, rng: np.random.Generator):
    if name == "temperature":       # (1e-30: the row's maximum over it overflows -- the argmax alone)
        return float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.3, 2.5, 1e-30]))
    if name == "top_k":
        return int(rng.choice([-1, 0, 1, 2, 5, 40, max(1, V // 2), V, V + 3]))
    if name == "top_p":
        return float(rng.choice([0.1, 0.5, 0.9, 0.95, 0.999, 1.0]))
    if name == "min_p":
        return float(rng.choice([0.0, 0.01, 0.05, 0.2, 1.0]))
    if name == "typical_p":
        return float(rng.choice([0.2, 0.5, 0.9, 1.0]))
    if name == "xtc":                                        # the probability; the threshold is fixed below
        return float(rng.choice([0.0, 0.5, 1.0]))
    if name in ("epsilon", "eta"):
        return float(rng.choice([0.0, 1e-4, 3e-4, 2e-3, 0.02, 0.2]))
    return float(rng.choice([-1.0, 0.0, 0.5, 1.0, 2.0, np.inf]))          # top_n_sigma


PTYPE = {"temperature": "float", "top_k": "int", "top_p": "float", "min_p": "float", "top_n_sigma": "float",
         "typical_p": "float", "xtc": "float", "epsilon": "float", "eta": "float"}
ARG = {"temperature": "t", "top_k": "k", "top_p": "p", "min_p": "m", "top_n_sigma": "n", "typical_p": "m",
       "xtc": "probability", "epsilon": "e", "eta": "e"}
XTC_THRESHOLD = 0.1


@st.composite
def cases(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    V = int(draw(st.sampled_from([1, 2, 7, 100, 1000, 5000, 40000])))
    B = int(draw(st.integers(1, 4)))
    stages = draw(st.lists(st.sampled_from(ORDER_STAGES), min_size=0, max_size=4))
    modes = [draw(st.sampled_from(["literal", "scalar", "rows"])) for _ in stages]
    terminal = draw(st.sampled_from(["sample", "greedy"]))
    penalties = draw(st.booleans())
    probs = draw(st.booleans())
    kinds = [draw(st.sampled_from(FAMILIES)) for _ in range(B)]
    edits = draw(st.lists(st.tuples(st.sampled_from(EDITS), st.booleans()), max_size=3)) if draw(st.booleans()) else []
    split = draw(st.integers(0, len(stages))) if draw(st.booleans()) else 0
    return rng, V, B, stages, modes, terminal, penalties, kinds, probs, edits, split


EDITS = ("allow", "bias", "dict_bias")


def build(V, B, stages, modes, terminal, penalties, rng, probs=False, edits=(), split=0):
    """The source, its run-time arguments, and each row's reference stage list. `edits`: (kind, before) pairs,
    kind in EDITS -- allow(mask), logit_bias(bias parameter), logit_bias({dict}) -- written before the penalties
    (`before`, vLLM's order) or after them (OpenAI's), in the order given; the penalties and the edits after them
    come after the first `split` stages (a grammar mask after a cut). A mask allows each token with chance 0.7;
    `allow_top` makes it allow each row's maximum (never emptied where it comes first)."""
    params, body, kw = ["xs: seed", "xp: int"], [], {}
    kw["xs"] = [int(s) for s in rng.integers(0, 2**63, B)]
    kw["xp"] = [int(s) for s in rng.integers(0, 100, B)]
    per_row: list[list] = [[] for _ in range(B)]

    def edit(i, kind):
        if kind == "allow":
            mask = rng.random((B, V)) < 0.7
            params.append(f"e{i}: mask")
            body.append(f"allow(e{i})")
            kw[f"e{i}"] = mask
            for r in range(B):
                per_row[r].append(("allow", {"mask": mask[r]}))       # (the same array: allow_top edits both)
        elif kind == "bias":
            b = (rng.standard_normal((B, V)) * 2).astype(np.float32)
            b[rng.random((B, V)) < 0.05] = -100.0                     # (OpenAI's ban)
            b[rng.random((B, V)) < 0.5] = 0.0
            params.append(f"e{i}: bias")
            body.append(f"logit_bias(e{i})")
            kw[f"e{i}"] = b
            for r in range(B):
                per_row[r].append(("logit_bias", {"bias": b[r]}))
        else:
            d = {int(t): float(np.float32(rng.standard_normal() * 3)) for t in rng.integers(0, V, 3)}
            body.append("logit_bias({" + ", ".join(f"{t}: {v!r}" for t, v in d.items()) + "})")
            for r in range(B):
                per_row[r].append(("logit_bias", {"bias": d}))

    def stage(i, name, mode):
        extra = f"{XTC_THRESHOLD!r}, " if name == "xtc" else ""
        tail = ", xs, position = xp" if name == "xtc" else ""
        if mode == "literal":
            v = stage_value(name, V, rng)
            body.append(f"{name}({extra}{v!r}{tail})")
            vals = [v] * B
        else:
            pname = f"a{i}"
            params.append(f"{pname}: {PTYPE[name]}")
            body.append(f"{name}({extra}{pname}{tail})")
            vals = [stage_value(name, V, rng) for _ in range(B)] if mode == "rows" else [stage_value(name, V, rng)] * B
            kw[pname] = vals if mode == "rows" else vals[0]
        for r in range(B):
            args = {ARG[name]: vals[r]}
            if name == "xtc":
                args.update(threshold=XTC_THRESHOLD, seed=kw["xs"][r], position=kw["xp"][r])
            per_row[r].append((name, args))

    for i, (kind, before) in enumerate(edits):
        if before:
            edit(i, kind)
    for i in range(split):
        stage(i, stages[i], modes[i])
    if penalties:
        params.append("h: tokens")
        hist = rng.integers(-1, V, (B, 12)).astype(np.int32)
        kw["h"] = hist
        body.append("penalties(h, last_n = 8, repeat = 1.3, frequency = 0.1, presence = 0.2)")
        for r in range(B):
            per_row[r].append(("penalties", {"history": hist[r], "last_n": 8, "repeat": 1.3, "frequency": 0.1,
                                             "presence": 0.2}))
    for i, (kind, before) in enumerate(edits):
        if not before:
            edit(i, kind)
    for i in range(split, len(stages)):
        stage(i, stages[i], modes[i])
    if terminal == "sample":
        params += ["seed: seed", "pos: int"]
        body.append("sample(seed, position = pos)")
        kw["seed"] = [int(s) for s in rng.integers(0, 2**63, B)]
        kw["pos"] = [int(p) for p in rng.integers(0, 5000, B)]
    else:
        body.append("greedy()")
    outs = "token, logprob" + (", probs" if probs else "")
    src = f"sampler s({', '.join(params)}) -> {outs} {{\n    " + "\n    ".join(body) + "\n}\n"
    return src, kw, per_row


def _run(prog, x, kw):
    try:
        return prog(x, **kw)
    except samplec.SamplecError as e:
        return str(e)


def allow_top(kw: dict, x: np.ndarray) -> None:
    """Every mask in `kw` allows its row's maximum (the reference's stage lists hold the same arrays)."""
    for name, v in kw.items():
        if name.startswith("e") and isinstance(v, np.ndarray) and v.dtype == bool:
            v[np.arange(x.shape[0]), np.argmax(x, axis=-1)] = True


@pytest.mark.uncompiled
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_O2_equals_O0_equals_reference(case):
    rng, V, B, stages, modes, terminal, penalties, kinds, probs, edits, split = case
    src, kw, per_row = build(V, B, stages, modes, terminal, penalties, rng, probs, edits, split)
    x = np.stack([family_row(k, V, rng) for k in kinds])
    allow_top(kw, x)
    o2, o0 = (_run(samplec.compile(src, opt_level=opt), x, kw) for opt in (2, 0))
    if isinstance(o0, str):         # (a mask after an xtc that removed every token it allows: the same error)
        assert o2 == o0, src
        return
    t2, t0 = np.array(o2.token).tolist(), np.array(o0.token).tolist()
    assert t2 == t0, src
    for r in range(B):
        term = ("sample", {"seed": kw["seed"][r], "position": kw["pos"][r]}) if terminal == "sample" else \
            ("greedy", {})
        ref = R.run_chain(x[r], per_row[r], term, row=r)
        assert t2[r] == ref["token"], (src, r, kinds[r])
        np.testing.assert_allclose(np.array(o2.logprob)[r], ref["logprob"], atol=2e-3, rtol=1e-3,
                                   err_msg=f"{src} row {r}")
        np.testing.assert_allclose(np.array(o2.logprob)[r], np.array(o0.logprob)[r], atol=2e-4, rtol=1e-4)
        if probs:
            np.testing.assert_allclose(np.array(o2.probs)[r], np.array(o0.probs)[r], atol=1e-5)
            if not split:   # (two cuts that each renormalize: a boundary mass within float32 rounding of p -- the
                #             reference sums in sequence, samplec by a tree -- moves a token; -O2 = -O0 holds)
                np.testing.assert_allclose(np.array(o2.probs)[r], ref["probs"], atol=2e-4)


@pytest.mark.uncompiled
@settings(max_examples=max(EXAMPLES // 2, 10), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_mlx_ops_path_equals_reference(case):
    """What a GPU runs (no native primitives: every stage op by its sort-free dense definition in MLX ops), at
    -O1 and -O2, against the numpy reference, token for token."""
    _mlx_ops_case(case, None)


@pytest.mark.uncompiled
@settings(max_examples=max(EXAMPLES // 4, 10), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_mlx_ops_path_with_a_gpus_selection_rounds_equals_reference(case):
    """The same with the selections deciding four key bits per round (15 candidates at once), as a GPU runs them."""
    _mlx_ops_case(case, 4)


def _mlx_ops_case(case, bits):
    rng, V, B, stages, modes, terminal, penalties, kinds, probs, edits, split = case
    src, kw, per_row = build(V, B, stages, modes, terminal, penalties, rng, probs, edits, split)
    x = np.stack([family_row(k, V, rng) for k in kinds])
    allow_top(kw, x)
    before = os.environ.get("SAMPLEC_NATIVE")
    os.environ["SAMPLEC_NATIVE"] = "0"
    chosen = kernels._select_bits
    if bits is not None:
        kernels._select_bits = lambda keys: bits
    try:
        outs = {opt: _run(samplec.compile(src, opt_level=opt), x, kw) for opt in (1, 2)}
    finally:
        kernels._select_bits = chosen
        os.environ.pop("SAMPLEC_NATIVE") if before is None else os.environ.__setitem__("SAMPLEC_NATIVE", before)
    if any(isinstance(o, str) for o in outs.values()):
        assert outs[1] == outs[2], src
        return
    for r in range(B):
        term = ("sample", {"seed": kw["seed"][r], "position": kw["pos"][r]}) if terminal == "sample" else \
            ("greedy", {})
        ref = R.run_chain(x[r], per_row[r], term, row=r)
        for opt, out in outs.items():
            assert np.array(out.token)[r] == ref["token"], (src, opt, r, kinds[r])
            np.testing.assert_allclose(np.array(out.logprob)[r], ref["logprob"], atol=2e-3, rtol=1e-3,
                                       err_msg=f"{src} -O{opt} row {r}")


def test_O2_program_has_no_vocabulary_sort():
    """The -O2 program of a server chain keeps its stages as stage ops (no sort, argsort or cumsum over the
    vocabulary in the program), whatever the order and whether the parameters are literals or run-time values."""
    for src in ["sampler s(t: float, k: int, p: float, seed: seed) { temperature(t) top_k(k) top_p(p) sample(seed) }",
                "sampler s(seed: seed) { top_p(0.9) min_p(0.05) top_k(20) temperature(0.7) sample(seed) }",
                "sampler s(n: float, seed: seed) { top_n_sigma(n) temperature(1.5) sample(seed) }"]:
        g = samplec.compile(src, opt_level=2).graph
        ops = {n.op for n in g.toposort()}
        assert not ops & {"sort", "argsort", "cumsum", "kth_largest", "mass_threshold"}, ops
        stages = set(re.findall(r"(\w+)\(", src.split("{", 1)[1])) - {"sample"}
        assert stages <= ops, (stages, ops)                 # every stage kept as its stage op
        o0 = {n.op for n in samplec.compile(src, opt_level=0).graph.toposort()}
        assert not o0 & stages, o0                          # -O0: every stage by its dense definition
        assert ("kth_largest" in o0) == ("top_k" in stages) and ("mass_threshold" in o0) == ("top_p" in stages)


@pytest.mark.parametrize("src", [
    "sampler s(temp: float, seed: seed) -> token, logprob { temperature(temp) top_p(0.8) top_k(20) sample(seed) }",
    "sampler s(temp: float, seed: seed) -> token, logprob { top_k(20) temperature(temp) min_p(0.1) sample(seed) }",
])
def test_bound_zero_temperature_is_greedy(src):
    """--set temp=0: no randomness, no sort and no exp over the vocabulary is left, and the token is the argmax."""
    prog = samplec.compile(src, opt_level=2, bindings={"temp": 0})
    ops = {n.op for n in prog.graph.toposort()}
    assert not ops & {"random_bits", "sort", "argsort", "cumsum", "exp", "sample", "top_p", "top_k", "min_p"}, ops
    x = np.random.default_rng(1).standard_normal((3, 500)).astype(np.float32)
    out = prog(x, seed=0)       # (the parameter stays in the interface, unused)
    assert np.array(out.token).tolist() == np.argmax(x, axis=-1).tolist()
    assert np.array(out.logprob).tolist() == [0.0, 0.0, 0.0]


def test_per_row_zero_temperature_rows_are_greedy():
    """A run-time temperature of 0 in some rows of a batch makes those rows greedy, the others sample."""
    src = "sampler s(t: float, p: float, seed: seed) { temperature(t) top_p(p) sample(seed) }"
    prog = samplec.compile(src, opt_level=2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 3000)).astype(np.float32)
    t = [0.0, 1.0, 0.0, 0.7, 0.0, 2.0]
    out = np.array(prog(x, t=t, p=[0.9] * 6, seed=list(range(6))).token)
    assert [out[r] for r in (0, 2, 4)] == [int(np.argmax(x[r])) for r in (0, 2, 4)]
    for r in (1, 3, 5):
        ref = R.run_chain(x[r], [("temperature", {"t": t[r]}), ("top_p", {"p": 0.9})],
                          ("sample", {"seed": r, "position": 0}))
        assert out[r] == ref["token"]


def test_row_independent_of_batch():
    """A row's token does not depend on the other rows (the kernel decides per row)."""
    src = "sampler s(k: int, p: float, t: float, seed: seed) { top_k(k) top_p(p) temperature(t) sample(seed) }"
    prog = samplec.compile(src, opt_level=2)
    rng = np.random.default_rng(9)
    x = np.stack([family_row(k, 20000, rng) for k in ("flat", "peaked", "tail", "ties", "neg_inf")])
    kw = dict(k=[0, 40, 5000, 3, 20000], p=[0.95, 0.5, 0.99, 1.0, 0.9], t=[1.0, 0.7, 0.0, 1.3, 2.0],
              seed=[5, 6, 7, 8, 9])
    whole = np.array(prog(x, **kw).token).tolist()
    for r in range(5):
        alone = prog(x[r:r + 1], **{k: v[r:r + 1] for k, v in kw.items()})
        assert int(np.array(alone.token)[0]) == whole[r]


EXTREME_T = (0.0, 1e-45, 1e-38, 1e-20, 0.5, 1.0, 2.0, 1e30, np.inf)
EXTREME_CUTS = ("top_k(3)", "top_p(0.9)", "min_p(0.1)", "typical_p(0.5)", "typical_p(0)", "xtc(0.1, 1.0, seed)")


@pytest.mark.uncompiled
def test_extreme_temperatures_O2_equals_O0():
    """Temperatures at the edges of float32 (a top / t that overflows keeps the argmax; x / inf rounds every
    kept logit to 0; subnormal results) between cuts, per row and in several places of one chain: -O2 (the chain
    kernel's greedy and chain paths) gives -O0's tokens, kept sets and values."""
    rng = np.random.default_rng(11)
    for case in range(40):
        chain, names = [], []
        for i in range(int(rng.integers(1, 4))):
            if rng.random() < 0.5:
                chain.append(str(rng.choice(EXTREME_CUTS)))
            chain.append(f"temperature(t{i})")
            names.append(f"t{i}")
        outs = str(rng.choice(["token, probs", "token, logprob, candidates(3)"]))
        term = str(rng.choice(["sample(seed)", "greedy()"]))
        src = f"sampler s({', '.join(n + ': float' for n in names)}, seed: seed) -> {outs} {{ {' '.join(chain)} {term} }}"
        B, V = 6, int(rng.choice([3, 50, 300]))
        x = rng.normal(0, float(rng.choice([1.0, 1e3])), (B, V)).astype(np.float32)
        kw = {n: [float(v) for v in rng.choice(EXTREME_T, B)] for n in names}
        got = [samplec.compile(src, opt_level=o)(x, seed=list(range(B)), **kw) for o in (0, 2)]
        for name in ("token", "probs", "logprob", "candidates"):
            a, b = (getattr(o, name, None) for o in got)
            if a is None:
                continue
            a, b = (np.array(v.values if name == "candidates" else v) for v in (a, b))
            if name == "token":
                assert a.tolist() == b.tolist(), (case, src, kw)
            else:
                np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6, err_msg=f"{case} {src} {kw}")


def _levels_agree(progs, x, kw, what, logprob=True):
    """-O0 and -O2 (`progs`) on the same call: the same tokens and kept sets, probs (and logprob) within rounding."""
    a, b = (p(x, **kw) for p in progs)
    assert np.array(a.token).tolist() == np.array(b.token).tolist(), what
    np.testing.assert_array_equal(np.array(a.probs) > 0, np.array(b.probs) > 0, err_msg=str(what))
    np.testing.assert_allclose(np.array(a.probs), np.array(b.probs), atol=1e-6, rtol=1e-5)
    if logprob:
        np.testing.assert_allclose(np.array(a.logprob), np.array(b.logprob), atol=1e-5, rtol=1e-5)


@pytest.mark.uncompiled
def test_leading_top_n_sigma_O2_equals_O0():
    """top_n_sigma as the first cut (temperatures before it, other cuts after): the chain kernel computes the
    whole row's moments and ends the cut among its candidates when the floor lies above their bound, else runs the
    whole row -- the same tokens and kept sets as -O0, on rows wide enough (V = 20000: 313 blocks) for both."""
    rng = np.random.default_rng(23)
    src = ("sampler s(t: float, n: float, k: int, seed: seed) -> token, probs "
           "{ temperature(t) top_n_sigma(n) top_k(k) sample(seed) }")
    progs = [samplec.compile(src, opt_level=o) for o in (0, 2)]
    for case in range(12):
        B, V = 4, 20000
        x = np.stack([family_row(str(rng.choice(["peaked", "tail", "flat", "ties", "normal"])), V, rng)
                      for _ in range(B)])
        kw = dict(t=[float(v) for v in rng.choice([0.5, 1.0, 1.7], B)],
                  n=[float(v) for v in rng.choice([0.5, 1.0, 2.0, 3.0], B)],
                  k=[int(v) for v in rng.choice([0, 20, 500], B)], seed=list(range(case, case + B)))
        _levels_agree(progs, x, kw, (case, kw), logprob=False)


@pytest.mark.uncompiled
@pytest.mark.parametrize("chain", ["top_k(k) typical_p(m) sample(seed)",
                                   "min_p(q) temperature(t) typical_p(m) top_p(p) sample(seed)",
                                   "top_k(k) typical_p(m) top_k(j) greedy()"])
def test_typical_p_after_a_cut_O2_equals_O0(chain):
    """typical_p after a cut that ends among the chain kernel's candidates runs on them (their entropy and scores;
    the kept candidates stay in value order, no longer an upper set) -- the same tokens, kept sets, values and
    logprob as -O0, on rows wide enough (V = 20000) for the candidates."""
    rng = np.random.default_rng(29)
    names = [n for n in ("k", "j", "q", "t", "m", "p") if f"({n})" in chain]
    types = {"k": "int", "j": "int"}
    decl = ", ".join(f"{n}: {types.get(n, 'float')}" for n in names)
    src = f"sampler s({decl}, seed: seed) -> token, probs, logprob {{ {chain} }}"
    progs = [samplec.compile(src, opt_level=o) for o in (0, 2)]
    values = dict(k=[1, 5, 40, 200], j=[1, 3, 10], q=[0.02, 0.1, 0.3], t=[0.5, 1.0, 1.5], m=[0.0, 0.2, 0.5, 0.9, 0.99],
                  p=[0.5, 0.9, 1.0])
    for case in range(8):
        B, V = 4, 20000
        x = np.stack([family_row(str(rng.choice(["peaked", "tail", "ties", "normal"])), V, rng) for _ in range(B)])
        kw = {n: [v.item() for v in rng.choice(values[n], B)] for n in names}
        _levels_agree(progs, x, dict(kw, seed=list(range(case, case + B))), (case, kw))


@pytest.mark.uncompiled
def test_tied_top_that_holds_the_nucleus():
    """A top value tied across every block (thousands of tokens) whose group holds the nucleus alone: the chain
    kernel gathers the tie whole and ends top_p at it (the next group is past the nucleus) -- kept set by hand (the
    top group exactly, where its mass reaches p; else the next group too), tokens and probs as -O0."""
    rng = np.random.default_rng(31)
    B, V = 4, 20000
    x = rng.integers(-3, 3, (B, V)).astype(np.float32)               # top value 2 in ~1/6 of the tokens
    src = "sampler s(t: float, p: float, seed: seed) -> token, probs { temperature(t) top_p(p) sample(seed) }"
    t, p = [0.3, 0.3, 1.0, 0.5], [0.9, 0.97, 0.5, 0.95]
    out = [samplec.compile(src, opt_level=o)(x, t=t, p=p, seed=[1, 2, 3, 4]) for o in (0, 2)]
    assert np.array(out[0].token).tolist() == np.array(out[1].token).tolist()
    for r in range(B):
        w = np.exp((x[r].astype(np.float64) - 2) / t[r])
        top_mass = w[x[r] == 2].sum() / w.sum()
        kept = x[r] >= (2 if top_mass >= p[r] else 1)
        for o in out:
            np.testing.assert_array_equal(np.array(o.probs)[r] > 0, kept, err_msg=f"row {r}")
    np.testing.assert_allclose(np.array(out[0].probs), np.array(out[1].probs), atol=1e-7, rtol=1e-5)


@pytest.mark.uncompiled
@pytest.mark.parametrize("chain", ["epsilon(e) sample(seed)", "temperature(t) eta(e) sample(seed)",
                                   "top_k(k) eta(e) top_p(p) sample(seed)", "min_p(q) epsilon(e) greedy()",
                                   "top_p(p) epsilon(e) temperature(t) sample(seed)"])
def test_epsilon_and_eta_in_the_chain_O2_equals_O0(chain):
    """epsilon and eta are cuts on the logit order by probability: the chain kernel finds their floor from the
    whole row's normalizer (and entropy) while no cut has ended yet, from the candidates' after one did, else on
    the whole row -- the same tokens, kept sets, values and logprob as -O0 (their dense definitions in MLX ops), on
    rows wide enough (V = 20000) for every path, per-row values including the off value 0."""
    rng = np.random.default_rng(37)
    names = [n for n in ("k", "q", "t", "e", "p") if f"({n})" in chain]
    types = {"k": "int"}
    decl = ", ".join(f"{n}: {types.get(n, 'float')}" for n in names)
    src = f"sampler s({decl}, seed: seed) -> token, probs, logprob {{ {chain} }}"
    progs = [samplec.compile(src, opt_level=o) for o in (0, 2)]
    values = dict(k=[5, 40, 200], q=[0.02, 0.1], t=[0.5, 1.0, 1.5], e=[0.0, 3e-4, 2e-3, 0.02, 0.2], p=[0.5, 0.9, 1.0])
    for case in range(8):
        B, V = 4, 20000
        x = np.stack([family_row(str(rng.choice(["peaked", "tail", "flat", "ties", "normal"])), V, rng)
                      for _ in range(B)])
        kw = {n: [v.item() for v in rng.choice(values[n], B)] for n in names}
        _levels_agree(progs, x, dict(kw, seed=list(range(case, case + B))), (case, kw))


@pytest.mark.uncompiled
def test_top_p_groups_by_the_float32_probability_on_near_flat_rows():
    """After a huge temperature (or on logits a few float32 steps apart) exp(x - max) takes a few values, and the
    float32 division by Z rounds neighbouring ones to one probability: they are one group, kept or removed together
    (the contract's p), in the chain kernel as in the dense definition -- -O2 = -O0, kept sets and tokens; found by a
    review where -O2 kept 110 tokens and -O0 751."""
    rng = np.random.default_rng(41)
    temp = "sampler s(t: float, p: float, seed: seed) -> token, probs { temperature(t) top_p(p) sample(seed) }"
    flat = "sampler s(p: float, seed: seed) -> token, probs { top_p(p) sample(seed) }"
    greedy = "sampler s(p: float) -> token { top_p(p) temperature(1e38) greedy() }"
    for src, make, kw in [(temp, lambda V: rng.normal(0, 1, (4, V)),
                           dict(t=[3e7, 1e7, 1e5, 3e7], p=[0.1, 0.3, 0.3, 0.9])),
                          (flat, lambda V: rng.uniform(0, 3e-7, (4, V)), dict(p=[0.1, 0.5, 0.9, 0.3])),
                          (greedy, lambda V: rng.uniform(0, 1e-6, (4, V)), dict(p=[0.01, 0.1, 0.5, 0.9]))]:
        progs = [samplec.compile(src, opt_level=o) for o in (0, 2)]
        for V in (1000, 20000):
            x = make(V).astype(np.float32)
            args = dict(kw, seed=[1, 2, 3, 4]) if "seed" in src else kw
            a, b = (p(x, **args) for p in progs)
            assert np.array(a.token).tolist() == np.array(b.token).tolist(), (src, V)
            if "probs" in src:
                np.testing.assert_array_equal(np.array(a.probs) > 0, np.array(b.probs) > 0, err_msg=f"{src} {V}")


@pytest.mark.uncompiled
@pytest.mark.parametrize("chain", ["typical_p(m) sample(seed)", "temperature(t) typical_p(m) top_k(k) sample(seed)"])
def test_leading_typical_p_O2_equals_O0(chain):
    """typical_p while nothing is cut yet: the chain kernel takes the whole row's normalizer and mean(d), and ends
    the cut among its candidates where they reach the mass below the least score a tail token can have (else the
    whole row) -- -O0's tokens, kept sets, values and logprob, per-row values including the off value 1."""
    rng = np.random.default_rng(43)
    names = [n for n in ("t", "m", "k") if f"({n})" in chain]
    decl = ", ".join(f"{n}: {'int' if n == 'k' else 'float'}" for n in names)
    src = f"sampler s({decl}, seed: seed) -> token, probs, logprob {{ {chain} }}"
    progs = [samplec.compile(src, opt_level=o) for o in (0, 2)]
    values = dict(t=[0.5, 1.0, 1.5], m=[0.2, 0.5, 0.9, 0.99, 1.0], k=[0, 5, 100])
    for case in range(8):
        B, V = 4, 20000
        x = np.stack([family_row(str(rng.choice(["peaked", "tail", "normal", "ties"])), V, rng) for _ in range(B)])
        kw = {n: [v.item() for v in rng.choice(values[n], B)] for n in names}
        _levels_agree(progs, x, dict(kw, seed=list(range(case, case + B))), (case, kw))
