"""The portable target's kernel-count work, each piece against a reference of its own: `counts` (a history counted by
one scatter) against numpy's count, `flat` (a chain row's cuts as one conjunction) against the nested row it
replaces, `pack` (the shared per-row values one kernel a level) against the same program without it, bit for bit,
and constants folded at trace time."""
from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import samplec
from samplec.backend_mlx import kernels
from samplec.backend_mlx.kernels import KERNELS
from samplec.frontend.lower import const, where
from samplec.ir.graph import INPUT, Graph, Node, make
from samplec.ir.types import BOOL, F32, Type
from samplec.passes.portable import flat

ROOT = Path(__file__).resolve().parent.parent
NEG_INF = float("-inf")


def input_node(name: str, t: Type) -> Node:
    return Node(INPUT, (), (), t, name)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("form", range(5))
def test_counts_equal_numpys(seed, form):
    """Each token's count among the valid ids (padding, out-of-window entries and duplicates included), and
    `ids_over`: whether a row holds an id >= V, valid or not -- in every form of the scatter's index."""
    rng = np.random.default_rng(seed)
    B, V, H = 4, 50, 40
    ids = rng.integers(-3, V, (B, H)).astype(np.int32)
    ids[0, :5] = 7                       # (one token many times)
    ids[1, 3], ids[2, 39] = V, 2 ** 31 - 1      # (ids >= V: one valid, one not)
    valid = (ids >= 0) & (rng.random((B, H)) < 0.8)
    valid[2, 39] = False
    ins = [mx.zeros((B, V)), mx.array(ids), mx.array(valid)]
    got = np.array(KERNELS["counts"](ins, {"form": form}))
    want = np.stack([np.bincount(ids[b][valid[b] & (ids[b] < V)], minlength=V) for b in range(B)])
    np.testing.assert_array_equal(got, want.astype(np.float32))
    over = np.array(KERNELS["ids_over"](ins, {"form": form})).reshape(-1)
    np.testing.assert_array_equal(over, (ids >= V).any(axis=1))


def test_nested_selects_under_one_condition():
    """where(c, where(c, a, b), d) is where(c, a, d), and where(c, a, where(c, b, d)) is where(c, a, d) (the same
    values); a select that would change shape is left as it is."""
    from samplec.passes.rules import where_nested
    B, V = 3, 8
    c = input_node("c", Type(BOOL, ("B", "V")))
    a, b, d = (input_node(n, Type(F32, ("B", "V"))) for n in "abd")
    col = input_node("col", Type(F32, ("B", 1)))
    rng = np.random.default_rng(0)
    env = {id(c): mx.array(rng.random((B, V)) < 0.5), id(col): mx.array(rng.standard_normal((B, 1)).astype(np.float32))}
    env.update((id(n), mx.array(rng.standard_normal((B, V)).astype(np.float32))) for n in (a, b, d))
    for n in (make("where", c, make("where", c, a, b), d), make("where", c, a, make("where", c, b, d))):
        got = where_nested(n)
        assert got is not None and got.op == "where" and got.inputs[1].op != "where" and got.inputs[2].op != "where"
        np.testing.assert_array_equal(_run(got, env), _run(n, env))
    narrow = input_node("cc", Type(BOOL, ("B", 1)))
    assert where_nested(make("where", narrow, make("where", narrow, col, b), col)) is None


def _run(root, env: dict) -> np.ndarray:
    """A little IR expression evaluated by the kernels."""
    g = Graph("e", (), (("out", root),))
    vals = dict(env)
    for n in g.toposort():
        if id(n) not in vals:
            vals[id(n)] = KERNELS[n.op]([vals[id(i)] for i in n.inputs], n.attr_dict)
    return np.array(vals[id(root)])


def test_flat_is_the_nested_row():
    """filter(filter(b, c1), c2(...)) and a map that keeps -inf, nested as the lowering writes them, against their
    one-conjunction form, on rows with -inf, ties and a per-row flag."""
    rng = np.random.default_rng(0)
    x = input_node("x", Type(F32, ("B", "V")))
    t = input_node("t", Type(F32, ("B", 1)))
    off = input_node("off", Type(BOOL, ("B", 1)))
    a = make("filter", x, make("ge", x, const(-1.0)))
    b = make("filter", a, make("lt", make("exp", a), const(5.0)))
    scaled = where(make("le", b, const(NEG_INF)), b, make("div", b, t))
    c = where(off, b, make("filter", scaled, make("ge", scaled, const(-0.5))))
    row = rng.standard_normal((4, 30)).astype(np.float32) * 2
    row[:, ::7] = NEG_INF
    row[:, 3] = row[:, 4]
    env = {id(x): mx.array(row), id(t): mx.array(np.array([[0.5], [1.0], [2.0], [0.7]], np.float32)),
           id(off): mx.array(np.array([[True], [False], [False], [True]]))}
    flattened = flat(c)
    assert flattened is not c and sum(n.op == "filter" for n in Graph("e", (), (("o", flattened),)).toposort()) <= 2
    np.testing.assert_array_equal(_run(flattened, env), _run(c, env))


EXAMPLES = [("llama_cpp_default.smp", "llama_cpp_default"), ("mlx_lm_default.smp", "mlx_lm_chat"),
            ("vllm.smp", "vllm"), ("openai.smp", "openai")]


@pytest.mark.parametrize("example,sampler", EXAMPLES)
def test_pack_changes_no_bit_and_saves_launches(example, sampler, monkeypatch):
    """The program with its row values packed and the same program without the pass: the same outputs bit for bit,
    and fewer launches with it."""
    import samplec.passes.pack as pack
    from samplec.backend_mlx.launches import call_primitives, launches
    src = (ROOT / "examples" / example).read_text()
    rng = np.random.default_rng(1)
    B, V = 3, 2000
    x = mx.array((rng.standard_normal((B, V)) * 3).astype(np.float32))
    values = {"temperature": [0.7, 0.0, 1.3], "top_p": [0.9, 0.5, 1.0], "min_p": [0.05, 0.0, 0.1],
              "top_k": [50, 0, 5], "repetition_penalty": [1.1, 1.0, 1.3], "frequency_penalty": [0.1, 0.0, 0.5],
              "presence_penalty": [0.1, 0.2, 0.0], "temp": [0.7, 0.0, 1.3], "typical_p": [0.9, 1.0, 0.5],
              "top_n_sigma": [1.0, -1.0, 2.0], "xtc_probability": [0.5, 0.0, 1.0], "xtc_threshold": [0.05] * 3}

    def call(prog):
        kw = {}
        for p in prog.params:
            if p.kind == "tokens":
                kw[p.name] = mx.array(np.random.default_rng(2).integers(-1, V, (B, 16)).astype(np.int32))
            elif p.kind == "seed":
                kw[p.name] = [5, 6, 7]
            elif p.kind == "bias":
                kw[p.name] = mx.array(np.random.default_rng(3).standard_normal((B, V)).astype(np.float32))
            elif p.name in values:
                kw[p.name] = values[p.name]
        return {k: np.array(v) for k, v in prog(x, **kw).to_dict().items()}, kw

    packed = samplec.compile(src, sampler, target="portable")
    assert "pack" in {n.op for n in packed.graph.toposort()}
    monkeypatch.setattr(pack, "pack_row_values", lambda g: g)
    plain = samplec.compile(src, sampler, target="portable")
    assert "pack" not in {n.op for n in plain.graph.toposort()}
    (a, kw), (b, _) = call(packed), call(plain)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    monkeypatch.setenv("SAMPLEC_NATIVE", "0")
    monkeypatch.setattr(kernels, "GPU_SUMS", True)
    assert launches(call_primitives(packed, x, **kw)) < launches(call_primitives(plain, x, **kw))


def test_ops_of_constants_are_constants():
    """An index row compared with a literal is made once, not a kernel each call."""
    iota = kernels._iota(10)
    zero = KERNELS["const"]([], {"value": 0, "dtype": "i32"})
    got = kernels.folded("eq", [iota, zero], {})
    assert got is not None and id(got) in kernels._KEYS
    np.testing.assert_array_equal(np.array(got), np.arange(10) == 0)
    assert kernels.folded("eq", [iota, zero], {}) is got
    assert kernels.folded("eq", [mx.arange(10), zero], {}) is None       # (not a constant: left to the call)


def _run_node(n: Node, env: dict) -> mx.array:
    """n evaluated with MLX from the values of its inputs in `env` (by id)."""
    if id(n) not in env:
        env[id(n)] = KERNELS[n.op]([_run_node(i, env) for i in n.inputs], n.attr_dict)
    return env[id(n)]


def test_greedy_flag_forms_agree_on_every_float():
    """Each form of `not isfinite(v)` that mirror_row_flags hands a reader is the same test on NaN, the infinities,
    the largest finite floats, signed zeros and subnormals; no two share a node but v and constants."""
    from samplec.passes.pack import forms
    vals = np.array([np.nan, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 0.0, -0.0, 1e-45, -1e-45, 1.5, -3.0,
                     1e30, -1e-30], dtype=np.float32)[:, None]
    v = Node(INPUT, (), (("index", 0),), Type(F32, ("B", 1)), "v")
    flag = make("logical_not", make("isfinite", v))
    fs = forms(flag)
    assert len(fs) >= 6
    want = ~np.isfinite(vals)
    for f in fs:
        got = np.array(_run_node(f, {id(v): mx.array(vals)}))
        np.testing.assert_array_equal(got, want, err_msg=str(f.op))
    inner = [{id(m) for m in Graph("f", (), (("o", f),)).toposort() if m.op not in (INPUT, "const")} for f in fs]
    assert all(not (a & b) for i, a in enumerate(inner) for b in inner[i + 1:])


@pytest.mark.parametrize("example,sampler", [("llama.smp", "llama"), ("vllm.smp", "vllm"),
                                             ("hf_generate.smp", "hf_generate")])
def test_mirrored_greedy_flag_changes_no_bit_and_saves_a_launch(example, sampler, monkeypatch):
    """The temperature's greedy flag computed inside each kernel that reads it (its own form each) and the same
    program with the flag shared: the same outputs bit for bit, greedy rows (temperature 0) included, and one
    launch fewer."""
    import samplec.passes.pack as pack
    from samplec.backend_mlx.launches import call_primitives, launches
    src = (ROOT / "examples" / example).read_text()
    rng = np.random.default_rng(4)
    B, V = 4, 3000
    x = rng.standard_normal((B, V)).astype(np.float32) * 2
    x[3, :] = np.float32(-np.inf)
    x[3, 7] = 1.0                     # (one finite entry: every temperature leaves its row greedy)
    x = mx.array(x)
    kw = {}
    on = {"top_p": 0.9, "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.1, "frequency_penalty": 0.1,
          "presence_penalty": 0.1, "typical_p": 0.95}     # (no stage left off: no specialized variant)
    for p in samplec.compile(src, sampler, target="portable").params:
        if p.kind == "tokens":
            kw[p.name] = mx.array(rng.integers(-1, V, (B, 24)).astype(np.int32))
        elif p.kind == "seed":
            kw[p.name] = [1, 2, 3, 4]
        elif p.name in ("temperature", "temp"):
            kw[p.name] = [0.7, 0.0, 1e-30, 1.0]
        elif p.name in on:
            kw[p.name] = [on[p.name]] * B
    mirrored = samplec.compile(src, sampler, target="portable")
    monkeypatch.setattr(pack, "mirror_row_flags", lambda g: g)
    shared = samplec.compile(src, sampler, target="portable")
    a, b = mirrored(x, **kw).to_dict(), shared(x, **kw).to_dict()
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)
    monkeypatch.setenv("SAMPLEC_NATIVE", "0")
    monkeypatch.setattr(kernels, "GPU_SUMS", True)
    assert launches(call_primitives(mirrored, x, **kw)) == launches(call_primitives(shared, x, **kw)) - 1


@pytest.mark.parametrize("target", ["portable", "cpu"])
@pytest.mark.parametrize("rep,freq,pres", [(1.3, 0.0, 0.0), (1.3, 0.0, -0.0), (1.3, -0.0, 0.0),
                                           (1.0, 0.5, 0.0), (1.0, -0.0, 0.25)])
def test_constant_penalty_parts_left_out_change_no_bit(target, rep, freq, pres):
    """A penalties stage with constant values: the parts that change nothing (a repeat of 1; a frequency of 0 with a
    presence of +0) are left out of the lowering, and the penalized row -- signed zeros and -inf included --
    is the numpy reference's bit for bit (`candidates` returns it)."""
    import sys
    sys.path.insert(0, str(ROOT / "tests"))
    import reference as ref
    V, H = 12, 6
    src = (f"sampler s(h: tokens) -> candidates({V}) {{ penalties(h, repeat = {rep!r}, frequency = {freq!r}, "
           f"presence = {pres!r}) }}")
    x = np.array([[-0.0, 0.0, 1.5, -2.0, 3e38, -np.inf, 3.0, -0.0, 0.5, -1e-30, 7.0, 0.0]] * 2, np.float32)
    h = np.array([[0, 1, 4, 5, 9, -1], [7, 7, 11, -1, -1, 3]], np.int32)
    prog = samplec.compile(src, target=target)
    got = prog(x, h=h).candidates
    for b in range(2):
        want = ref.penalties(x[b], h[b], repeat=rep, frequency=freq, presence=pres)
        ids, vals = np.array(got.ids[b]), np.array(got.values[b])
        np.testing.assert_array_equal(vals, want[ids])
        np.testing.assert_array_equal(np.signbit(vals), np.signbit(want[ids]))
