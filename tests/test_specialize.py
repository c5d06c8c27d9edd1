"""A call runs its program without the stages its values leave off in every row (samplec/passes/specialize.py):
the same tokens, logprobs and errors as the whole program and as -O0's dense definitions, and fewer kernels."""
from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import samplec
from samplec import stage_table
from samplec.diagnostics import SamplecError
from samplec.passes.specialize import switches
from test_targets import run_time_arrays

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = [(p.name, name) for p in sorted((ROOT / "examples").glob("*.smp"))
            for name in re.findall(r"^sampler\s+(\w+)", p.read_text(), re.M)]
V = 1000
# per operand an off rule reads: a value that leaves the stage off, and one that does not
OFF = {"t": 1.0, "k": 0, "p": 1.0, "m": 0.0, "n": -1.0, "probability": 0.0, "e": 0.0, "range": 0.0,
       "repeat": 1.0, "frequency": 0.0, "presence": 0.0, "multiplier": 0.0}
ON = {("temperature", "t"): 0.7, ("top_k", "k"): 20, ("top_p", "p"): 0.8, ("min_p", "m"): 0.05,
      ("top_n_sigma", "n"): 1.5, ("typical_p", "m"): 0.9, ("xtc", "probability"): 0.6, ("penalties", "repeat"): 1.3,
      ("penalties", "frequency"): 0.2, ("penalties", "presence"): 0.3, ("epsilon", "e"): 1e-4, ("eta", "e"): 1e-3,
      ("top_k_rank", "k"): 20, ("dry", "multiplier"): 0.8}


def logits(B: int, seed: int) -> np.ndarray:
    """A Zipf-like head over a tail that carries a few percent of the mass, ids shuffled."""
    rng = np.random.default_rng(seed)
    ranks = np.stack([rng.permutation(V) + 1 for _ in range(B)])
    return (-1.1 * np.log(ranks) + rng.standard_normal((B, V)) * 0.3 + 8.0).astype(np.float32)


def call_args(prog, B: int, rng, modes: dict) -> dict:
    """Every parameter at run time, one value per row (MLX arrays for histories, masks and biases: the short path):
    each switch's parameters off in every row, on in every row, or mixed, by `modes` (switch -> mode)."""
    kw = run_time_arrays(prog, B, V, rng, history=24)
    kw.update((p.name, [int(v) for v in rng.integers(0, 4000, B)]) for p in prog.params
              if p.kind == "int" and p.name in ("pos", "position"))
    for sw in switches(prog.stage_graph, frozenset(p.name for p in prog.params)):
        mode = modes[sw]
        for operand, param in sw.reads:
            if type(param) is not str:
                continue
            on = ON[sw.stage, operand]
            off = OFF[operand]
            if sw.stage == "penalties" and operand != "repeat":      # (one penalty on is enough)
                on = off
            row = {"off": [off] * B, "on": [on] * B, "mixed": [off] + [on] * (B - 1)}[mode]
            kw[param] = [type(on)(v) for v in row]
    return kw


def off_in_every_row(prog, kw: dict) -> set:
    """The stages the values leave off in every row, read with the stage table's own predicate, row by row."""
    B = len(next(v for v in kw.values() if isinstance(v, list)))
    out = set()
    for sw in switches(prog.stage_graph, frozenset(p.name for p in prog.params)):
        rows = [{o: (kw[v][i] if v in kw else next(p.default for p in prog.params if p.name == v))
                 if type(v) is str else v for o, v in sw.reads} for i in range(B)]
        if all(stage_table.off(sw.stage, V=V, **r) for r in rows):
            out.add(sw.at)
    return out


def outputs(out) -> dict:
    return {k: np.array(v) for k, v in out.to_dict().items()}


def agree(a: dict, b: dict, what) -> None:
    for k in a:
        if k.startswith("token") or k.endswith(".ids"):
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{what}: {k}")
        else:
            np.testing.assert_allclose(a[k], b[k], atol=2e-4, rtol=1e-4, err_msg=f"{what}: {k}")


@pytest.mark.parametrize("target", ["portable", "auto"])
@pytest.mark.parametrize("example,sampler", EXAMPLES, ids=[f"{e}:{s}" for e, s in EXAMPLES])
def test_specialized_calls_give_the_whole_programs_and_O0s_outputs(example, sampler, target):
    """Each example with its switches off in every row, on, or mixed (three draws of modes on the portable target,
    one on the device's): the short path's call
    (the program without the stages off in every row) equals the full path's (the whole program) and -O0's."""
    src = (ROOT / "examples" / example).read_text()
    prog = samplec.compile(src, sampler, target=target)
    dense = samplec.compile(src, sampler, opt_level=0, target=target)
    sws = switches(prog.stage_graph, frozenset(p.name for p in prog.params))
    rng = np.random.default_rng(len(sampler))
    for draw in range(3 if target == "portable" else 1):
        modes = {sw: ("off", "on", "mixed")[(draw + i) % 3] for i, sw in enumerate(sws)}
        kw = call_args(prog, 3, rng, modes)
        x = mx.array(logits(3, draw))
        fresh = samplec.compile(src, sampler, target=target)
        whole = outputs(fresh(x, **kw))                     # (a first call: the full path, the whole program)
        assert fresh.queue_stats["full"] == 1 and fresh.queue_stats["specialized"] == 0
        before = dict(prog.queue_stats)
        prog(x, **kw)
        got = outputs(prog(x, **kw))                        # (a repeated call: the short path)
        assert prog.queue_stats["short"] > before["short"]
        expect = 1 if off_in_every_row(prog, kw) else 0
        assert prog.queue_stats["specialized"] - before["specialized"] >= expect, (modes, prog.queue_stats)
        if not expect:
            assert prog.queue_stats["specialized"] == before["specialized"]
        agree(got, whole, (sampler, draw, "whole"))
        agree(got, outputs(dense(x, **kw)), (sampler, draw, "O0"))


def test_the_switches_of_llama_cpps_chain():
    prog = samplec.compile_file(ROOT / "examples" / "llama_cpp_default.smp", "llama_cpp_default", target="portable")
    sws = switches(prog.stage_graph, frozenset(p.name for p in prog.params))
    assert [s.stage for s in sws] == ["penalties", "top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc",
                                      "temperature"]
    assert dict(sws[0].reads) == {"repeat": "repeat_penalty", "frequency": "frequency_penalty",
                                  "presence": "presence_penalty"}


def test_a_specialized_program_runs_fewer_kernels():
    """llama.cpp's default chain with typical_p, top_n_sigma and xtc off (llama.cpp's defaults) and the penalties
    neutral: the call runs the program without them -- fewer launches than the whole program, no such stage op."""
    from samplec.backend_mlx import kernels
    from samplec.backend_mlx.launches import call_primitives, launches
    prog = samplec.compile_file(ROOT / "examples" / "llama_cpp_default.smp", "llama_cpp_default", target="portable")
    x = mx.array(logits(2, 0))
    kw = dict(history=mx.array(np.full((2, 8), 5, np.int32)), seed=[1, 2], pos=[3, 4])
    saved = kernels.GPU_SUMS
    kernels.GPU_SUMS = True
    try:
        whole = launches(call_primitives(prog, x, **kw, top_n_sigma=[1.0, 1.0], typical_p=[0.9, 0.9],
                                         xtc_probability=[0.5, 0.5], repeat_penalty=[1.2, 1.2]))
        some = launches(call_primitives(prog, x, **kw))
    finally:
        kernels.GPU_SUMS = saved
    assert prog.queue_stats["specialized"] >= 1
    assert some < whole - 20, (some, whole)
    (off, (exe, _)), = prog._variants.items()
    ops = {n.op for n in exe.graph.toposort()}
    assert not {"penalties", "top_n_sigma", "typical_p", "xtc", "scatter_add"} & ops, ops


def test_a_decode_loop_builds_its_program_once():
    """The position changes every step; the stages off stay off: one specialized program, reused."""
    prog = samplec.compile_file(ROOT / "examples" / "mlx_lm_default.smp", "mlx_lm", target="portable")
    x = mx.array(logits(1, 1))
    tokens = [int(np.array(prog(x, temp=0.8, top_p=0.9, seed=3, pos=step).token)[0]) for step in range(6)]
    dense = samplec.compile_file(ROOT / "examples" / "mlx_lm_default.smp", "mlx_lm", opt_level=0, target="portable")
    assert tokens == [int(np.array(dense(x, temp=0.8, top_p=0.9, seed=3, pos=step).token)[0]) for step in range(6)]
    assert prog.queue_stats["specialized"] == 5 and len(prog._variants) == 1


def test_off_rules_that_read_the_vocabulary():
    """top_k's k >= V is off (the rule reads V): a call with every k at least V runs without it."""
    prog = samplec.compile("sampler s(k: int, seed: seed) -> token, logprob { top_k(k) temperature(0.7) sample(seed) }",
                           target="portable")
    x = mx.array(logits(2, 3))
    prog(x, k=[V, V + 5], seed=[1, 2])
    got = outputs(prog(x, k=[V, V + 5], seed=[1, 2]))
    assert prog.queue_stats["specialized"] == 1
    (off, (exe, _)), = prog._variants.items()
    assert "top_k" not in {n.op for n in exe.graph.toposort()}
    agree(got, outputs(samplec.compile("sampler s(seed: seed) -> token, logprob { temperature(0.7) sample(seed) }",
                                       opt_level=0, target="portable")(x, seed=[1, 2])), "top_k off")


@pytest.mark.parametrize("bad", ["nan", "all -inf"])
def test_errors_are_the_whole_programs(bad):
    """A bad row under a specialized program (the penalties neutral: their check goes with them) raises what the
    whole program raises: the logits' own checks name the rows."""
    src = (ROOT / "examples" / "mlx_lm_default.smp").read_text()
    prog = samplec.compile(src, "mlx_lm_chat", target="portable")
    x = logits(3, 4)
    kw = dict(tokens=mx.array(np.full((3, 4), 7, np.int32)), repetition_penalty=[1.0] * 3, seed=[1, 2, 3],
              pos=[0, 0, 0])
    prog(mx.array(x), **kw)
    if bad == "nan":
        x[1, 7] = np.nan
    else:
        x[2] = -np.inf
    errors = []
    for p in (samplec.compile(src, "mlx_lm_chat", target="portable"), prog):
        with pytest.raises(SamplecError) as e:
            p(mx.array(x), **kw)
        errors.append(str(e.value))
    assert prog.queue_stats["specialized"] >= 1
    assert errors[0] == errors[1] and ("row 1" if bad == "nan" else "row 2") in errors[0], errors


def test_a_switch_turned_on_between_moving_positions_takes_effect(monkeypatch):
    """A decode loop's position changes every call: the switches are not read again for it (the last call's
    program runs), and a call that changes a switch's value does read them: top_k turned on mid-loop cuts."""
    src = "sampler s(k: int, seed: seed, pos: int) -> token, logprob { top_k(k) temperature(0.7) sample(seed, position = pos) }"
    prog = samplec.compile(src, target="portable")
    dense = samplec.compile(src, opt_level=0, target="portable")
    read = []
    program_for = prog._program_for
    monkeypatch.setattr(prog, "_program_for", lambda *a: read.append(a[0]) or program_for(*a))
    x = mx.array(logits(2, 5))
    for step, k in enumerate([0, 0, 0, 2, 2, 0]):
        kw = dict(k=[k, k], seed=[1, 2], pos=[step, step])
        got = outputs(prog(x, **kw))
        agree(got, outputs(dense(x, **kw)), ("step", step))
        if k:
            assert set(got["token"]) <= set(np.argsort(-np.array(x), axis=1)[:, :2].ravel())
    # (the first call takes the full path; then the switch is read where k changed, and not where only pos did)
    assert [v[0] for v in read] == [[0, 0], [2, 2], [0, 0]], read
