"""The portable target as the CPU lowers it (samplec/passes/portable.py, "candidates"): a chain of value cuts, the
temperature and a draw runs on the row's largest values (a partition and a sort of N), the drawn token's
log-probability and top_logprobs come from them, and a call whose kept tokens they may not hold runs again with
its rows sorted. Each case against -O0's program (the spec's dense definitions); `Program.sorted_again` counts the
calls run again, so that a fast path that silently stops being taken fails here."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import samplec
from samplec.diagnostics import SamplecError
from samplec.passes import portable
from samplec.passes import target as target_pass

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_real import chat_logits  # noqa: E402

EXAMPLES = [(p.name, name) for p in sorted((ROOT / "examples").glob("*.smp"))
            for name in re.findall(r"^sampler\s+(\w+)", p.read_text(), re.M)]
# what a server passes (every value at run time, one a row)
VALUES = {"temperature": 0.7, "top_p": 0.9, "min_p": 0.05, "top_k": 50, "typical_p": 1.0, "repetition_penalty": 1.1,
          "presence_penalty": 0.1, "frequency_penalty": 0.1, "temp": 0.7}


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    """Lower as the CPU does, whatever device runs the tests."""
    monkeypatch.setattr(target_pass, "partitions", lambda: True)


def arguments(prog, B: int, V: int, rng) -> dict:
    kw = {}
    for p in prog.params:
        if p.kind == "tokens":
            kw[p.name] = rng.integers(0, V, (B, 32)).astype(np.int32)
        elif p.kind == "seed":
            kw[p.name] = [int(s) for s in rng.integers(0, 2**63, B)]
        elif p.kind == "mask":
            kw[p.name] = rng.random((B, V)) < 0.9
        elif p.kind == "bias":
            kw[p.name] = (rng.standard_normal((B, V)) * 0.1).astype(np.float32)
        elif p.kind in ("float", "int") and p.name in VALUES:
            kw[p.name] = [VALUES[p.name]] * B
        elif p.kind == "int" and p.name in ("pos", "position"):
            kw[p.name] = [int(v) for v in rng.integers(0, 4000, B)]
    return {k: mx.array(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}    # (a server's MLX arrays)


def same(got, want, names) -> None:
    for name in names:
        a, b = getattr(got, name), getattr(want, name)
        if hasattr(a, "ids"):
            np.testing.assert_array_equal(np.array(a.ids), np.array(b.ids), err_msg=name)
            np.testing.assert_allclose(np.array(a.values), np.array(b.values), atol=1e-5, rtol=1e-5, err_msg=name)
        elif name == "token":
            np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=name)
        else:
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=1e-5, err_msg=name)


def peaked(V: int, rng) -> np.ndarray:
    """A model-like row: a Zipf head over shuffled ids."""
    return (-2.0 * np.log(rng.permutation(V) + 1.0) + rng.normal(0, 0.1, V)).astype(np.float32)


ON_CANDIDATES = {"hf_generate", "llama", "nucleus", "llama_cpp_default", "llama_cpp_default_short", "mlx_lm",
                 "mlx_lm_chat", "openai", "openai_constant_bias", "vllm", "vllm_constrained"}


@pytest.mark.parametrize("example,sampler", EXAMPLES, ids=[f"{e}:{s}" for e, s in EXAMPLES])
def test_shipped_chains_run_on_candidates_at_a_servers_call(example, sampler):
    """Chat-shaped rows (V = 32000, tails of 1-10% of the mass) and a server's values: every shipped chain of value
    cuts draws from its candidates -- no call runs again -- and gives -O0's tokens, log-probabilities and
    top_logprobs (hf_generate's probabilities of the whole row too). hf_greedy has no cut: it never sorts."""
    source = (ROOT / "examples" / example).read_text()
    prog = samplec.compile(source, sampler, target="portable")
    dense = samplec.compile(source, sampler, opt_level=0, target="portable")
    rng = np.random.default_rng(3)
    B, V = 3, 32000
    x = mx.array(chat_logits(B, V, seed=5))
    for _ in range(2):
        kw = arguments(prog, B, V, rng)
        got = prog(x, **kw)
        same(got, dense(x, **kw), prog.output_names)
    assert prog.sorted_again == 0
    ran = [prog.graph] + [exe.graph for exe, _ in prog._variants.values()]     # (and the specialized programs)
    assert (sampler in ON_CANDIDATES) == any(n.op == "candidates" for g in ran for n in g.toposort()), prog.ir()


@pytest.mark.parametrize("chain,values", [
    ("top_p(p) temperature(t)", dict(p=[0.999, 0.9], t=[1.0, 1.0])),           # a flat row's top_p keeps nearly all
    ("top_k(k) temperature(t)", dict(k=[64, 3], t=[1.0, 1.0])),                # k past the candidates
    ("temperature(t) top_p(p) min_p(m)", dict(t=[2.0, 1.0], p=[0.95, 0.95], m=[0.0, 0.5])),
])
def test_a_call_the_candidates_may_not_hold_runs_again_sorted(chain, values, monkeypatch):
    """Row 0 keeps more tokens than the candidates hold (16 here), row 1 fewer: row 0 runs again sorted (alone),
    and both rows draw -O0's tokens."""
    monkeypatch.setattr(portable, "PLACES", 16)
    names = ", ".join(f"{k}: {'int' if k == 'k' else 'float'}" for k in values)
    src = f"sampler s({names}, seed: seed, pos: int) -> token, logprob {{ {chain} sample(seed, position = pos) }}"
    prog = samplec.compile(src, target="portable")
    assert "candidates" in prog.ir()
    rng = np.random.default_rng(0)
    x = np.stack([rng.normal(0, 0.01, 500), peaked(500, rng)]).astype(np.float32)
    kw = dict(values, seed=[11, 12], pos=[3, 4])
    again = prog._with_every_check()
    ran = []
    monkeypatch.setattr(again, "_evaluated", lambda x, kw, want, f=again._evaluated: ran.append(x.shape) or
                        f(x, kw, want))
    got = prog(x, **kw)
    assert prog.sorted_again == 1 and ran == [(1, 500)]
    same(got, samplec.compile(src, opt_level=0, target="portable")(x, **kw), ["token", "logprob"])
    kw = {**kw, **{k: [v[1], v[1]] for k, v in values.items()}}     # (row 1's values in both rows: held)
    x2 = np.stack([x[1], x[1]])
    same(prog(x2, **kw), samplec.compile(src, opt_level=0, target="portable")(x2, **kw), ["token", "logprob"])
    assert prog.sorted_again == 1


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_logprobs_from_candidates_keep_id_order_in_ties(k, monkeypatch):
    """Integer logits (ties everywhere, also past the candidates' last place): top_logprobs' ids are -O0's (equal
    values by id), or the call runs again where a tie at the k-th value reaches past the candidates."""
    monkeypatch.setattr(portable, "PLACES", 8)
    src = f"sampler s(k: int, seed: seed) -> token, top_logprobs({k}) {{ top_k(k) sample(seed) }}"
    prog = samplec.compile(src, target="portable")
    dense = samplec.compile(src, opt_level=0, target="portable")
    assert "candidates" in prog.ir()
    rng = np.random.default_rng(k)
    for trial in range(6):
        # pairs of equal values over shuffled ids (a tie at every boundary, the cuts inside the candidates), and on
        # odd trials a row of one value but for one token (every cut past them)
        x = np.stack([(np.arange(40)[::-1] // 2)[rng.permutation(40)] for _ in range(4)]).astype(np.float32)
        if trial % 2:
            x[2] = 0.0
            x[2, 9] = 1.0
        kw = dict(k=[2, 3, 5, 1], seed=[int(s) for s in rng.integers(0, 2**63, 4)])
        same(prog(x, **kw), dense(x, **kw), ["token", "top_logprobs"])
    assert prog.sorted_again == 3


def test_a_vocabulary_within_the_candidates_never_runs_again(monkeypatch):
    """V <= N: the candidates are the whole row, held whatever the values (top_p 1 keeps every token)."""
    monkeypatch.setattr(portable, "PLACES", 64)
    src = "sampler s(p: float, seed: seed) -> token, logprob { top_p(p) temperature(1.5) sample(seed) }"
    prog = samplec.compile(src, target="portable")
    x = np.random.default_rng(0).normal(0, 0.01, (3, 64)).astype(np.float32)
    kw = dict(p=[1.0, 0.999, 0.5], seed=[1, 2, 3])
    same(prog(x, **kw), samplec.compile(src, opt_level=0, target="portable")(x, **kw), ["token", "logprob"])
    assert prog.sorted_again == 0


@pytest.mark.parametrize("bad", ["nan", "+inf", "all -inf"])
def test_bad_rows_raise_what_O0_raises(bad, monkeypatch):
    """A bad row (which also leaves the candidates unsure) is the same error, naming the same rows."""
    monkeypatch.setattr(portable, "PLACES", 16)
    src = "sampler s(p: float, seed: seed) -> token { top_p(p) min_p(0.1) sample(seed) }"
    rng = np.random.default_rng(2)
    x = np.stack([peaked(300, rng) for _ in range(3)])
    x[1, 7] = {"nan": np.nan, "+inf": np.inf, "all -inf": -np.inf}[bad]
    if bad == "all -inf":
        x[1, :] = -np.inf
    kw = dict(p=[0.9, 0.9, 0.9], seed=[1, 2, 3])
    errors = []
    for opt in (2, 0):
        with pytest.raises(SamplecError) as e:
            samplec.compile(src, opt_level=opt, target="portable")(x, **kw)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "row 1" in errors[0]


def test_top_logprobs_ids_where_the_log_softmax_makes_unequal_logits_equal(monkeypatch):
    """Logits one ulp apart whose log-softmax values round to one value: top_logprobs orders them by id (the dense
    definition's stable sort of the log-softmax row), not by logit."""
    monkeypatch.setattr(portable, "PLACES", 8)
    src = "sampler s(seed: seed) -> token, top_logprobs(3) { top_k(2) sample(seed) }"
    x = np.zeros((2, 40), np.float32)
    x[:, 5] = 1.0
    x[:, 2] = np.nextafter(np.float32(1.0), np.float32(0.0))
    x[:, 9], x[:, 11] = 0.9, 0.8
    kw = dict(seed=[1, 2])
    prog = samplec.compile(src, target="portable")
    got = prog(x, **kw)
    want = samplec.compile(src, opt_level=0, target="portable")(x, **kw)
    assert np.array(want.top_logprobs.ids).tolist() == [[2, 5, 9]] * 2       # (the case this pins: 2 before 5)
    same(got, want, ["token", "top_logprobs"])
    assert prog.sorted_again == 0


def test_the_rows_the_candidates_may_not_hold_run_again_alone(monkeypatch):
    """A batch mixing rows the candidates hold and rows they may not, every kind of argument one a row (lists,
    numpy and MLX arrays, a history, a mask) or shared: the rows they may not hold run again sorted, alone, and
    every row's outputs are -O0's."""
    monkeypatch.setattr(portable, "PLACES", 16)
    src = ("sampler s(p: float, t: float, h: tokens, m: mask, seed: seed, pos: int) -> token, logprob, "
           "top_logprobs(2), probs { allow(m) penalties(h, last_n = 4, repeat = 1.2) top_p(p) temperature(t) "
           "sample(seed, position = pos) }")
    prog = samplec.compile(src, target="portable")
    dense = samplec.compile(src, opt_level=0, target="portable")
    rng = np.random.default_rng(4)
    V = 300
    x = np.stack([rng.normal(0, 0.01, V) if r in (0, 3) else peaked(V, rng) for r in range(5)]).astype(np.float32)
    for args in (dict(p=[0.99, 0.9, 0.9, 0.99, 0.5], t=0.8, h=rng.integers(0, V, (5, 6)).astype(np.int32),
                      m=rng.random((5, V)) < 0.9, seed=[1, 2, 3, 4, 5], pos=[0, 1, 2, 3, 4]),
                 dict(p=np.array([0.99, 0.9, 0.9, 0.99, 0.5], np.float32), t=[0.8, 1.0, 1.2, 0.7, 1.0],
                      h=mx.array(rng.integers(0, V, (5, 6)).astype(np.int32)), m=mx.array(rng.random((5, V)) < 0.9),
                      seed=7, pos=9)):
        again = prog._with_every_check()
        ran = []
        monkeypatch.setattr(again, "_evaluated", lambda x, kw, want, f=again._evaluated: ran.append(x.shape) or
                            f(x, kw, want))
        before = prog.sorted_again
        got = prog(x, **args)
        assert prog.sorted_again == before + 1 and ran == [(2, V)]
        same(got, dense(x, **args), ["token", "logprob", "top_logprobs", "probs"])
        monkeypatch.undo()
        monkeypatch.setattr(portable, "PLACES", 16)
