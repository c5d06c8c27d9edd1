"""Targets: the target pass's IR for every shipped example (golden files), the portable lowering against -O0 and
the numpy reference on random chains, which kernel ran (a fallback is a failure, not a slow pass), the target
recorded in a .smpb, and the target's choice from the API, the CLI and SAMPLEC_TARGET."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference as R
import samplec
from samplec.diagnostics import SamplecError
from samplec.frontend.expand import EXPAND
from samplec.ir.ops import STAGE_OPS
from samplec.passes import run_pipeline, run_target
from samplec.passes.target import resolve
from samplec.api import lower_source
from test_differential import EXAMPLES, allow_top, build, cases, family_row

try:
    from .goldens import assert_golden
except ImportError:  # pragma: no cover
    from goldens import assert_golden

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_SAMPLERS = [(p.name, name) for p in sorted((ROOT / "examples").glob("*.smp"))
                    for name in re.findall(r"^sampler\s+(\w+)", p.read_text(), re.M)]
GOLDEN = Path(__file__).parent / "golden" / "targets"
SELECTIONS = ("kth_largest", "mass_threshold", "topk_ids", "topk", "kth_largest_static")


def example_args(prog, B: int = 2, V: int = 1000, seed: int = 0) -> tuple[np.ndarray, dict]:
    """Logits with a tail (a Zipf-like head, a few percent of the mass spread wide) and every parameter a
    user passes: one value per row."""
    rng = np.random.default_rng(seed)
    ranks = np.stack([rng.permutation(V) + 1 for _ in range(B)])
    x = (-1.1 * np.log(ranks) + rng.standard_normal((B, V)) * 0.3 + 8.0).astype(np.float32)
    kw = {}
    for p in prog.params:
        if p.kind == "tokens":
            kw[p.name] = rng.integers(-1, V, (B, 24)).astype(np.int32)
        elif p.kind == "seed":
            kw[p.name] = [int(s) for s in rng.integers(0, 2**63, B)]
        elif p.kind == "mask":
            m = rng.random((B, V)) < 0.8
            m[np.arange(B), x.argmax(-1)] = True
            kw[p.name] = m
        elif p.kind == "bias":
            kw[p.name] = (rng.standard_normal((B, V)) * 0.5).astype(np.float32)
        elif p.kind == "int" and p.name in ("pos", "position"):
            kw[p.name] = [int(v) for v in rng.integers(0, 4000, B)]
    return x, kw


@pytest.mark.parametrize("target", ["cpu", "cuda", "metal", "portable", "portable-on-cpu"])
@pytest.mark.parametrize("example,sampler", EXAMPLE_SAMPLERS, ids=[f"{e}:{s}" for e, s in EXAMPLE_SAMPLERS])
def test_golden_target_ir(example, sampler, target, monkeypatch):
    """The IR each target runs, pinned for every shipped example (re-bless: SAMPLEC_UPDATE_GOLDENS=1): the portable
    target as a GPU lowers it (one sort a chain) and as the CPU does (`portable-on-cpu`: candidates where a chain
    allows them), whichever device this runs on."""
    from samplec.passes import target as target_pass
    monkeypatch.setattr(target_pass, "partitions", lambda: target == "portable-on-cpu")
    graph, _ = lower_source((ROOT / "examples" / example).read_text(), sampler, filename=example)
    text = str(run_target(run_pipeline(graph, 2), target.removesuffix("-on-cpu")))
    assert_golden(GOLDEN / f"{Path(example).stem}.{sampler}.{target}.ir", text)


@pytest.mark.parametrize("example,sampler", EXAMPLE_SAMPLERS, ids=[f"{e}:{s}" for e, s in EXAMPLE_SAMPLERS])
def test_portable_ir_has_no_selection_rounds_and_sorts_a_chain_once(example, sampler, monkeypatch):
    """As a GPU lowers it: one sort of values a chain."""
    from samplec.passes import target as target_pass
    monkeypatch.setattr(target_pass, "partitions", lambda: False)
    prog = samplec.compile_file(ROOT / "examples" / example, sampler=sampler, target="portable")
    ops = [n.op for n in prog.graph.toposort()]
    assert not set(ops) & set(SELECTIONS), prog.ir()
    assert not set(ops) & {"top_k", "top_p", "min_p", "temperature", "sample", "typical_p"}, prog.ir()
    stages = [n.op for n in prog.stage_graph.toposort()]
    chains = sum(1 for op in stages if op in ("sample", "greedy", "argmax"))
    assert ops.count("sort") <= max(1, chains)              # (one sort of values a chain, no argsort of the row)
    assert ops.count("argsort") <= stages.count("typical_p") + ops.count("slice")   # (scores; top_logprobs)
    assert "put_along" not in ops                            # (the id-order form is made, never written back)


# the shipped chains the CPU's portable lowering runs on candidates as they stand (the others do once a call's values
# leave their xtc, typical_p and top_n_sigma off, or not at all: hf_generate's `probs` reads the whole row)
ON_CANDIDATES = {"llama", "nucleus", "llama_cpp_default_short", "mlx_lm_chat", "openai", "openai_constant_bias",
                 "vllm", "vllm_constrained"}


@pytest.mark.parametrize("example,sampler", EXAMPLE_SAMPLERS, ids=[f"{e}:{s}" for e, s in EXAMPLE_SAMPLERS])
def test_portable_on_the_cpu_partitions_rather_than_sorts(example, sampler, monkeypatch):
    """As the CPU lowers it: a chain of value cuts, the temperature and a draw runs on candidates (a partition, no
    sort of the row, no argsort of the row: top_logprobs from the candidates too); the others sort once."""
    from samplec.passes import target as target_pass
    monkeypatch.setattr(target_pass, "partitions", lambda: True)
    prog = samplec.compile_file(ROOT / "examples" / example, sampler=sampler, target="portable")
    ops = [n.op for n in prog.graph.toposort()]
    assert (sampler in ON_CANDIDATES) == ("candidates" in ops), prog.ir()
    if sampler in ON_CANDIDATES:
        assert "sort" not in ops, prog.ir()
        assert ops.count("argsort") == 2 * ops.count("slice"), prog.ir()    # (top_logprobs' two sorts of N)


@pytest.mark.parametrize("example,sampler", EXAMPLE_SAMPLERS, ids=[f"{e}:{s}" for e, s in EXAMPLE_SAMPLERS])
def test_every_example_runs_its_targets_kernels(example, sampler):
    """On the cpu target every region runs the native chain kernel and no stage op its dense definition; on the
    portable target no stage op is left; both give -O0's tokens."""
    source = (ROOT / "examples" / example).read_text()
    cpu = samplec.compile(source, sampler, target="cpu")
    portable = samplec.compile(source, sampler, target="portable")
    dense = samplec.compile(source, sampler, opt_level=0, target="portable")
    x, kw = example_args(cpu)
    got = {t: p(x, **kw) for t, p in (("cpu", cpu), ("portable", portable), ("O0", dense))}
    stage_ops = [n.op for n in cpu.stage_graph.toposort() if n.op in EXPAND]
    trace = cpu.kernel_trace()
    assert not [t for t in trace if t[0] == "definition" or t[1] == "definitions"], trace
    if any(op in STAGE_OPS or op == "sample" for op in stage_ops):
        assert cpu.graph.regions and ("cpu.chain", "kernel") in trace, (cpu.ir(), trace)
    assert not [t for t in portable.kernel_trace() if t[0] == "definition"], portable.kernel_trace()
    for t in ("cpu", "portable"):
        np.testing.assert_array_equal(np.array(got[t].token), np.array(got["O0"].token), err_msg=t)
        if "logprob" in got["O0"].names():
            np.testing.assert_allclose(np.array(got[t].logprob), np.array(got["O0"].logprob), atol=2e-4, rtol=1e-4)


# Kernel launches of a repeated portable call as a GPU runs it (samplec.backend_mlx.launches: the primitives of the
# call's lazy outputs that are not views, sums one reduction each, RandomBits in MLX ops), B = 2, with MLX 0.32.4
# (pinned): a ceiling per example that fails when a change adds kernels. benchmarks/bench_targets.py records them at
# V = 152064.
PORTABLE_LAUNCHES = {
    "hf_generate.smp:hf_generate": 50,
    "hf_generate.smp:hf_greedy": 14,
    "llama.smp:llama": 26,
    "llama.smp:nucleus": 31,
    "llama_cpp_default.smp:llama_cpp_default": 80,
    "llama_cpp_default.smp:llama_cpp_default_short": 23,
    "mlx_lm_default.smp:mlx_lm": 22,
    "mlx_lm_default.smp:mlx_lm_chat": 33,
    "openai.smp:openai": 40,
    "openai.smp:openai_constant_bias": 36,
    "vllm.smp:vllm": 39,
    "vllm.smp:vllm_constrained": 43,
}


@pytest.mark.parametrize("example,sampler", EXAMPLE_SAMPLERS, ids=[f"{e}:{s}" for e, s in EXAMPLE_SAMPLERS])
def test_portable_launches_stay_within_their_ceiling(example, sampler, monkeypatch):
    import mlx.core as mx
    from samplec.backend_mlx import kernels
    from samplec.backend_mlx.launches import call_primitives, launches
    monkeypatch.setenv("SAMPLEC_NATIVE", "0")
    monkeypatch.setattr(kernels, "GPU_SUMS", True)
    prog = samplec.compile((ROOT / "examples" / example).read_text(), sampler, target="portable")
    x, kw = example_args(prog)
    counts = call_primitives(prog, mx.array(x), **kw)
    assert not {"Arange", "Full"} & set(counts), counts       # (index and zero rows are constants of the call)
    assert launches(counts) <= PORTABLE_LAUNCHES[f"{example}:{sampler}"], counts


# The cuda target's launches a call (the same for metal with SAMPLEC_METAL_KERNEL=1), counted with the chain kernel
# stood in by one launch (launches.chain_kernel_stood_in): the MLX ops the kernel leaves beside it, and those that make
# the kernels' inputs (a penalty's values packed; an integer value goes into a float slot as it is, a literal's cast
# is a constant of the call). A chain that falls out of its region (to the portable lowering, or to its definitions) fails here. benchmarks/bench_launches.py prints
# them at V = 152064 with a server's arguments.
GPU_LAUNCHES = {
    "hf_generate.smp:hf_generate": 3,
    "hf_generate.smp:hf_greedy": 4,
    "llama.smp:llama": 3,
    "llama.smp:nucleus": 3,
    "llama_cpp_default.smp:llama_cpp_default": 4,
    "llama_cpp_default.smp:llama_cpp_default_short": 2,
    "mlx_lm_default.smp:mlx_lm": 3,
    "mlx_lm_default.smp:mlx_lm_chat": 4,
    "openai.smp:openai": 8,
    "openai.smp:openai_constant_bias": 4,
    "vllm.smp:vllm": 6,
    "vllm.smp:vllm_constrained": 14,
}


@pytest.mark.parametrize("target", ["cuda", "metal"])
@pytest.mark.parametrize("example,sampler", EXAMPLE_SAMPLERS, ids=[f"{e}:{s}" for e, s in EXAMPLE_SAMPLERS])
def test_gpu_launches_stay_within_their_ceiling(example, sampler, target, monkeypatch):
    import mlx.core as mx
    from samplec.backend_mlx import kernels
    from samplec.backend_mlx.launches import call_primitives, chain_kernel_stood_in, launches
    monkeypatch.setenv("SAMPLEC_NATIVE", "0")
    monkeypatch.setattr(kernels, "GPU_SUMS", True)
    with chain_kernel_stood_in(target) as stood_in:
        prog = samplec.compile((ROOT / "examples" / example).read_text(), sampler, target=target)
        x, kw = example_args(prog)
        counts = call_primitives(prog, mx.array(x), **kw)
    assert "chain" in stood_in and [r.kernel for r in prog.graph.regions] == [f"{target}.chain"]
    assert not {"Arange", "Full"} & set(counts), counts       # (placeholders and literals are constants of the call)
    assert launches(counts) + len(stood_in) <= GPU_LAUNCHES[f"{example}:{sampler}"], counts


def test_a_declined_kernel_shows_in_the_trace(monkeypatch):
    """The trace is what the fallback tests read: a chain kernel that declines is reported, not hidden."""
    prog = samplec.compile_file(ROOT / "examples" / "llama.smp", sampler="llama", target="cpu")
    x, kw = example_args(prog)
    from samplec.backend_mlx import native
    monkeypatch.setattr(native, "sample_chain", lambda *a, **k: None)
    prog.exe._per_thread.fn = None          # (trace again)
    out = prog(x, **kw)
    assert ("cpu.chain", "definitions") in prog.kernel_trace()
    assert ("definition", "top_p") in prog.kernel_trace()
    ref = samplec.compile_file(ROOT / "examples" / "llama.smp", sampler="llama", opt_level=0)(x, **kw)
    np.testing.assert_array_equal(np.array(out.token), np.array(ref.token))


@pytest.mark.uncompiled
@settings(max_examples=max(EXAMPLES // 2, 10), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_portable_equals_O0_equals_reference(case):
    """The portable lowering on random chains in random orders, literal and per-row values, every logits family
    (ties at every boundary, -inf-heavy, flat, tiny V): -O0's tokens and the reference's -- as a GPU lowers it (one
    sort a chain)."""
    from samplec.passes import target as target_pass
    with mock.patch.object(target_pass, "partitions", lambda: False):
        portable_case(case)


@pytest.mark.uncompiled
@settings(max_examples=max(EXAMPLES // 2, 10), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_portable_on_candidates_equals_O0_equals_reference(data):
    """The same as the CPU lowers it, with 8 candidates a row (V >= 8 here): chains of value cuts run on the
    candidates, and a call whose kept tokens they may not hold runs again with its rows sorted -- either way -O0's
    tokens, ids and log-probabilities."""
    from samplec.passes import portable
    from samplec.passes import target as target_pass
    rng, V, B, _, _, terminal, penalties, kinds, _, edits, split = data.draw(cases())
    stages = data.draw(st.lists(st.sampled_from(sorted(portable.CANDIDATE_STAGES)), min_size=1, max_size=4))
    modes = [data.draw(st.sampled_from(["literal", "scalar", "rows"])) for _ in stages]
    case = rng, V, B, stages, modes, terminal, penalties, kinds, False, edits, min(split, len(stages))
    with mock.patch.object(target_pass, "partitions", lambda: True), mock.patch.object(portable, "PLACES", 8):
        portable_case(case)


def portable_case(case):
    rng, V, B, stages, modes, terminal, penalties, kinds, probs, edits, split = case
    src, kw, per_row = build(V, B, stages, modes, terminal, penalties, rng, probs, edits, split)
    x = np.stack([family_row(k, V, rng) for k in kinds])
    allow_top(kw, x)
    outs = []
    for opt, target in ((2, "portable"), (0, "cpu")):
        try:
            outs.append(samplec.compile(src, opt_level=opt, target=target)(x, **kw))
        except SamplecError as e:
            outs.append(str(e))
    got, dense = outs
    if isinstance(dense, str):
        assert got == dense, src
        return
    assert not isinstance(got, str), (src, got)
    np.testing.assert_array_equal(np.array(got.token), np.array(dense.token), err_msg=src)
    for r in range(B):
        term = ("sample", {"seed": kw["seed"][r], "position": kw["pos"][r]}) if terminal == "sample" else \
            ("greedy", {})
        ref = R.run_chain(x[r], per_row[r], term, row=r)
        assert int(np.array(got.token)[r]) == ref["token"], (src, r, kinds[r])
        np.testing.assert_allclose(np.array(got.logprob)[r], np.array(dense.logprob)[r], atol=2e-4, rtol=1e-4,
                                   err_msg=f"{src} row {r}")
        if probs:
            np.testing.assert_allclose(np.array(got.probs)[r], np.array(dense.probs)[r], atol=1e-5)


@pytest.mark.parametrize("chain", [
    "top_k(k) top_p(p) min_p(m) temperature(t) sample(seed, position = pos)",         # llama.cpp's order
    "temperature(t) top_k(k) top_p(p) sample(seed, position = pos)",                  # Hugging Face's
    "top_p(p) min_p(m) top_k(k) temperature(t) sample(seed, position = pos)",         # mlx-lm's
    "temperature(t) top_k(k) top_p(p) min_p(m) sample(seed, position = pos)",         # vLLM's
    "top_k(k) typical_p(p) top_p(p) xtc(0.1, 0.5, seed, position = pos) temperature(t) sample(seed, position = pos)",
])
def test_portable_on_wide_rows_with_tails(chain):
    """Rows shaped like a model's (V = 32000, a tail carrying a few percent of the mass), every value at run time
    and one per row: the portable target draws -O0's tokens."""
    src = f"sampler s(k: int, p: float, m: float, t: float, seed: seed, pos: int) -> token, logprob {{ {chain} }}"
    B, V = 8, 32000
    rng = np.random.default_rng(7)
    ranks = np.stack([rng.permutation(V) + 1 for _ in range(B)])
    x = (-1.2 * np.log(ranks) + rng.standard_normal((B, V)) * 0.5 + 10.0).astype(np.float32)
    kw = dict(k=[0, 20, 40, 100, 1000, 0, 50, 32000], p=[0.9, 0.95, 1.0, 0.5, 0.99, 0.8, 0.95, 0.999],
              m=[0.05, 0.0, 0.1, 0.01, 0.0, 0.2, 0.05, 0.0], t=[0.7, 1.0, 0.0, 1.3, 0.8, 1.0, 2.0, 0.5],
              seed=[int(s) for s in rng.integers(0, 2**63, B)], pos=[int(p) for p in rng.integers(0, 4000, B)])
    a = samplec.compile(src, target="portable")(x, **kw)
    b = samplec.compile(src, opt_level=0, target="portable")(x, **kw)
    np.testing.assert_array_equal(np.array(a.token), np.array(b.token))
    np.testing.assert_allclose(np.array(a.logprob), np.array(b.logprob), atol=2e-4, rtol=1e-4)


def test_smpb_records_the_target_and_loads_it_again(tmp_path):
    prog = samplec.compile_file(ROOT / "examples" / "llama.smp", target="portable")
    prog.save(tmp_path / "p.smpb")
    again = samplec.load(tmp_path / "p.smpb")
    assert again.target == "portable" and again.ir() == prog.ir()
    assert samplec.load(tmp_path / "p.smpb", target="cpu").target == "cpu"
    x, kw = example_args(prog)
    np.testing.assert_array_equal(np.array(again(x, **kw).token), np.array(prog(x, **kw).token))


def test_smpb_for_another_device_is_lowered_for_this_one(tmp_path):
    from samplec.serialize import save
    prog = samplec.compile_file(ROOT / "examples" / "llama.smp")
    save(prog.stage_graph, tmp_path / "c.smpb", target="cuda")
    with pytest.warns(samplec.SamplecWarning, match="compiled for target 'cuda'"):
        again = samplec.load(tmp_path / "c.smpb")
    assert again.target == resolve("auto")
    other = samplec.load(tmp_path / "c.smpb", target="cuda")        # (it lowers and prints; it cannot run here)
    assert other.target == "cuda" and ("region cuda.chain" in other.ir() or "argsort" in other.ir())
    x, kw = example_args(again)
    with pytest.raises(SamplecError, match="target 'cuda' cannot run here"):
        other(x, **kw)


def test_a_bad_target_in_a_smpb_is_rejected(tmp_path):
    from samplec.serialize import from_bytes, seal, to_bytes, _unseal
    prog = samplec.compile("sampler s() { greedy() }")
    body = bytearray(_unseal(to_bytes(prog.stage_graph, "portable")))
    at = bytes(body).index(b"portable")
    body[at:at + 8] = b"tpu_v5e!"
    with pytest.raises(SamplecError, match="invalid .smpb: target 'tpu_v5e!'"):
        from_bytes(seal(bytes(body)))


def test_bad_target_names_are_errors(monkeypatch):
    with pytest.raises(SamplecError, match="target 'tpu'"):
        samplec.compile("sampler s() { greedy() }", target="tpu")
    monkeypatch.setenv("SAMPLEC_TARGET", "gpu")
    with pytest.raises(SamplecError, match="SAMPLEC_TARGET='gpu'"):
        samplec.compile("sampler s() { greedy() }")
    monkeypatch.setenv("SAMPLEC_TARGET", "portable")
    assert samplec.compile("sampler s() { greedy() }").target == "portable"


def test_auto_is_the_device_mlx_runs_on(monkeypatch):
    monkeypatch.delenv("SAMPLEC_TARGET", raising=False)
    from samplec.backend_mlx import native
    assert resolve("auto") == ("cpu" if native.installed() else "portable")
    monkeypatch.setenv("SAMPLEC_NATIVE", "0")
    assert resolve("auto") == "portable"


def test_cli_target_and_emit_ir(tmp_path):
    def cli(*args, env=None):
        return subprocess.run([sys.executable, "-m", "samplec", *args], capture_output=True, text=True,
                              cwd=ROOT, env={**os.environ, **(env or {})}, timeout=120)
    r = cli("compile", "examples/llama.smp", "--target", "portable", "--emit", "ir")
    assert r.returncode == 0, r.stderr
    # (the portable target as this machine's device lowers it: on the CPU the chain runs on candidates)
    assert (" = candidates " if mx.default_device() == mx.cpu else " = sort ") in r.stdout
    assert "region" not in r.stdout
    r = cli("compile", "examples/llama.smp", "--target", "cpu", "--emit", "ir")
    assert r.returncode == 0 and "region cpu.chain" in r.stdout, r.stderr
    r = cli("compile", "examples/llama.smp", "-o", str(tmp_path / "l.smpb"), env={"SAMPLEC_TARGET": "portable"})
    assert r.returncode == 0, r.stderr
    assert samplec.load(tmp_path / "l.smpb").target == "portable"
    r = cli("run", "examples/llama.smp", "--target", "portable", "--logits", "examples/logits.npy",
            "--history", "examples/history.npy", "--seed", "7", "--json")
    assert r.returncode == 0, r.stderr
    r = cli("compile", "examples/llama.smp", "--target", "metal", "--emit", "ir")       # (for another machine)
    assert r.returncode == 0 and " = sort " in r.stdout, r.stderr
    r = cli("run", "examples/llama.smp", "--target", "metal", "--logits", "examples/logits.npy",
            "--history", "examples/history.npy", "--seed", "7")
    assert r.returncode == 1 and "target 'metal' cannot run here" in r.stderr and "Traceback" not in r.stderr
    r = cli("compile", "examples/llama.smp", "--target", "tpu")
    assert r.returncode != 0 and "target 'tpu'" in r.stderr and "Traceback" not in r.stderr


def test_draws_give_the_same_distribution_on_every_target():
    """`samplec run --draws` shows each token's exact probability from the stage-level program lowered for the
    program's own target: the same on the cpu and portable targets."""
    import mlx.core as mx
    from samplec import runner
    x = mx.array(np.load(ROOT / "examples" / "logits.npy"))
    got = {}
    for target in ("cpu", "portable"):
        prog = samplec.compile_file(ROOT / "examples" / "llama.smp", sampler="nucleus", target=target)
        got[target] = runner.draws(prog, x, {"seed": 3}, 50)
    a, b = got["cpu"]["rows"], got["portable"]["rows"]
    assert [(r["tokens"], r["counts"]) for r in a] == [(r["tokens"], r["counts"]) for r in b]
    for ra, rb in zip(a, b):        # (the exact probabilities: up to the float rounding of their sums)
        np.testing.assert_allclose(ra["probability"], rb["probability"], rtol=1e-5, atol=1e-7)


def test_passes_lists_the_target_passes():
    r = subprocess.run([sys.executable, "-m", "samplec", "passes"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("target-cpu", "target-cuda", "target-metal", "target-portable"):
        assert f"\n{name} " in r.stdout
    assert "-O2: stages simplify cse dce, then target-" in r.stdout and "fold " not in r.stdout


def test_metal_target_hands_chains_to_the_metal_build_where_asked(monkeypatch):
    """SAMPLEC_METAL_KERNEL=1: the metal target's chains the GPU kernel covers become regions `metal.chain` (else
    the portable lowering), and the interpreter runs them through gpu.sample_chain when the Metal build is active
    -- its answer is the call's; a declined call runs the chain's definitions. (An Apple GPU is faked: nothing here
    has run Metal.)"""
    import mlx.core as mx
    from samplec.backend_mlx import gpu
    from samplec.backend_mlx.interpreter import Executable
    source = (ROOT / "examples" / "llama.smp").read_text()
    monkeypatch.delenv("SAMPLEC_METAL_KERNEL", raising=False)
    assert not samplec.compile(source, "nucleus", target="metal").graph.regions
    monkeypatch.setenv("SAMPLEC_METAL_KERNEL", "1")
    prog = samplec.compile(source, "nucleus", target="metal")
    assert [r.kernel for r in prog.graph.regions] == ["metal.chain"] and "region metal.chain" in prog.ir()
    x, kw = example_args(prog)
    args = samplec.compile(source, "nucleus", target="portable").prepare(mx.array(x), kw)
    monkeypatch.setattr(gpu, "metal_status", lambda: (True, "faked"))
    calls = []

    def kernel(x, params, stages, terminal, want_logprob, out_x=0, edits=(), raw=False):
        calls.append((tuple(stages), terminal))
        B = x.shape[0]
        return (mx.full((B, 1), 3, dtype=mx.int32), mx.full((B, 1), -1.0)) + ((x,) if out_x else ()) + \
            ((mx.max(x, axis=-1, keepdims=True), mx.logsumexp(x - mx.max(x, axis=-1, keepdims=True), axis=-1,
                                                             keepdims=True)) if raw else ())
    monkeypatch.setattr(gpu, "sample_chain", kernel)

    def top_logprobs(x, m, lz, k, margin):      # (top_logprobs' selection kernel beside the chain's)
        calls.append(("top_logprobs", k))
        return mx.zeros((x.shape[0], k), dtype=mx.int32), mx.zeros((x.shape[0], k))
    monkeypatch.setattr(gpu, "top_logprobs", top_logprobs)
    exe = Executable(prog.graph, compile=False, target="metal")
    outs, _ = exe(*args)
    stages = dict(prog.graph.regions[0].attrs)["stages"]
    assert calls == [(stages, "sample"), ("top_logprobs", 5)] and "top_p" in stages and \
        ("metal.chain", "kernel") in exe.trace
    assert np.array(outs[0]).reshape(-1).tolist() == [3] * x.shape[0]
    monkeypatch.setattr(gpu, "sample_chain", lambda *a, **k: None)
    outs, _ = exe(*args)
    assert ("metal.chain", "definitions") in exe.trace
    dense = samplec.compile(source, "nucleus", opt_level=0)(x, **kw)
    np.testing.assert_array_equal(np.array(outs[0]).reshape(-1), np.array(dense.token))


def test_a_program_called_after_the_default_device_changed_is_checked_again(monkeypatch):
    """A program compiled for the device it was made on, called after `mx.set_default_device` moved MLX elsewhere,
    is the same error as one compiled for another device (it would otherwise run its target's ops where they do not
    belong: the chain kernel's regions by their definitions, the CPU's primitives on a GPU stream); back on its
    device it runs again."""
    import mlx.core as mx
    prog = samplec.compile("sampler s(seed: seed) -> token { top_k(40) sample(seed) }", target="portable")
    cpu = samplec.compile("sampler s(seed: seed) -> token { top_k(40) sample(seed) }", target="cpu")
    x = mx.array(np.random.default_rng(0).normal(size=(2, 100)).astype(np.float32))
    want = np.array(cpu(x, seed=[1, 2]).token).tolist()
    real = mx.default_device
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    with pytest.raises(SamplecError, match="target 'cpu' cannot run here: MLX's default device is"):
        cpu(x, seed=[1, 2])
    monkeypatch.setattr(mx, "default_device", real)
    assert np.array(cpu(x, seed=[1, 2]).token).tolist() == want
    assert np.array(prog(x, seed=[1, 2]).token).tolist() == want


def test_portable_penalties_check_flags_the_rows_the_dense_check_does():
    """The portable lowering checks the penalties with one maximum of the penalized row (NaN read as +inf); the
    dense definition looks at the history's tokens and the row's maximum. Rows where a penalty overflows to +inf,
    where one makes NaN (-inf logits seen, an infinite frequency term), where no token is left, and rows without
    a fault: the same rows are named, and a good batch gives -O0's tokens."""
    src = ("sampler s(h: tokens, r: float, f: float, seed: seed) -> token { penalties(h, repeat = r, frequency = f) "
           "top_k(5) sample(seed) }")
    B, V = 6, 64
    x = np.tile(np.linspace(-2, 2, V, dtype=np.float32), (B, 1))
    h = np.full((B, 4), -1, np.int32)
    r, f = [1.0] * B, [0.0] * B
    x[1, 7] = 3e38; h[1, 0] = 7; r[1] = 0.5                              # 3e38 / 0.5 = +inf
    x[2, 9] = -np.inf; h[2, :2] = 9; f[2] = -3e38                        # -inf - (2 * -3e38) = -inf + inf = NaN
    x[4] = -np.inf; x[4, [3, 5]] = -3e38; h[4, :2] = [3, 5]; r[4] = 1.5  # both survivors overflow to -inf
    assert_penalties_rows_as_dense(src, x, dict(h=h, r=r, f=f, seed=list(range(B))), "rows 1, 2, 4",
                                   dict(h=h[[0, 3, 5]], r=[1.3] * 3, f=[0.2] * 3, seed=[1, 2, 3]), [0, 3, 5])


def assert_penalties_rows_as_dense(src: str, x, bad: dict, rows: str, good: dict, good_rows: list) -> None:
    """The portable target names the rows -O0 names for the values `bad`, and gives -O0's tokens for `good`."""
    errors = []
    for opt, target in ((2, "portable"), (0, "cpu")):
        with pytest.raises(SamplecError) as e:
            samplec.compile(src, opt_level=opt, target=target)(x, **bad)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "penalties" in errors[0] and rows in errors[0], errors
    got, want = (samplec.compile(src, opt_level=opt, target=target)(x[good_rows], **good)
                 for opt, target in ((2, "portable"), (0, "cpu")))
    np.testing.assert_array_equal(np.array(got.token), np.array(want.token))


def test_a_run_of_penalties_stages_is_checked_once_for_the_same_rows():
    """`samplec serve`'s three penalties stages (repetition over one history, presence and frequency over another):
    the portable lowering checks the run with its last stage's maximum; the rows each stage's own check names
    (an overflow in the first stage, another in the second, no token left after the third, rows without a fault)
    are the rows named, as -O0 names them, with fewer launches than a check per stage."""
    import mlx.core as mx

    from samplec.backend_mlx.launches import call_primitives, launches
    src = ("sampler s(h: tokens, g: tokens, r: float, p: float, f: float, seed: seed) -> token { "
           "penalties(h, repeat = r) penalties(g, presence = p) penalties(g, frequency = f) top_k(5) sample(seed) }")
    B, V = 6, 64
    x = np.tile(np.linspace(-2, 2, V, dtype=np.float32), (B, 1))
    h, g = np.full((B, 4), -1, np.int32), np.full((B, 4), -1, np.int32)
    r, p, f = [1.0] * B, [0.0] * B, [0.0] * B
    x[1, 7] = 3e38; h[1, 0] = 7; r[1] = 0.5                                  # stage 1: 3e38 / 0.5 = +inf
    x[2, 9] = 3e38; g[2, 0] = 9; p[2] = -3e38                                # stage 2: 3e38 + 3e38 = +inf
    x[4] = -np.inf; x[4, [3, 5]] = -3e38; g[4, :2] = [3, 5]; f[4] = 3e38     # stage 3: both survivors -> -inf
    good = [0, 3, 5]
    vals = dict(h=h[good], g=g[good], r=[1.3] * 3, p=[0.4] * 3, f=[0.2] * 3, seed=[1, 2, 3])
    assert_penalties_rows_as_dense(src, x, dict(h=h, g=g, r=r, p=p, f=f, seed=list(range(B))), "rows 1, 2, 4",
                                   vals, good)
    one = src.replace("penalties(g, presence = p) penalties(g, frequency = f) ", "")
    xs = mx.array(x[good])
    counts = [launches(call_primitives(samplec.compile(s, target="portable"), xs, **vals)) for s in (src, one)]
    # (two more stages over another history: 10 more launches with a check each, 6 with the run's one check)
    assert counts[0] - counts[1] <= 6, counts


def test_portable_dry_chain_builds_no_index_rows_each_call(monkeypatch):
    """DRY's history search in MLX ops (the portable target's, and a GPU's beside the chain kernel): its index rows
    and fill are constants of the call, so a repeated call launches none of them, and the chain stays within its
    ceiling (46 at B = 2: the breakers, the history's alignment, the search and the draw)."""
    import mlx.core as mx
    from samplec.backend_mlx import kernels
    from samplec.backend_mlx.launches import call_primitives, launches
    monkeypatch.setenv("SAMPLEC_NATIVE", "0")
    monkeypatch.setattr(kernels, "GPU_SUMS", True)
    src = """sampler s(history: tokens, multiplier: float, seed: seed, pos: int) -> token {
        dry(history, multiplier, 1.75, 2, breakers = [1, 2])
        top_k(40)
        sample(seed, position = pos)
    }"""
    prog = samplec.compile(src, target="portable")
    x, kw = example_args(prog)
    kw["multiplier"] = [0.8, 0.5]
    counts = call_primitives(prog, mx.array(x), **kw)
    assert not {"Arange", "Full"} & set(counts), counts
    assert launches(counts) <= 46, counts
    dense = samplec.compile(src, opt_level=0, target="portable")
    np.testing.assert_array_equal(np.array(prog(x, **kw).token), np.array(dense(x, **kw).token))


@pytest.mark.parametrize("after", ["top_k(k) temperature(t)", "temperature(t) top_k(k)", "min_p(m) top_k(k)",
                                   "typical_p(0.9) top_k(k)", "top_p(0.8) temperature(t)"])
def test_portable_cuts_after_xtc_start_at_its_survivor(after):
    """Where xtc fires on a contiguous row, the survivor is the row's maximum and its first kept place: the cuts
    and maps after it count from there (top_k's k-th place, temperature 0's first maximum, min_p's and top_p's
    maximum). Rows where it fires and rows where it does not (the coin, fewer than two targets), k = 1 and 0, t = 0,
    ties among the targets: the portable target draws -O0's tokens with -O0's log-probabilities."""
    src = (f"sampler s(thr: float, prob: float, k: int, t: float, m: float, seed: seed, pos: int) -> token, logprob "
           f"{{ top_p(0.95) xtc(thr, prob, seed, position = pos) {after} sample(seed, position = pos) }}")
    B, V = 12, 300
    rng = np.random.default_rng(11)
    ranks = np.stack([rng.permutation(V) + 1 for _ in range(B)])
    x = (-1.5 * np.log(ranks) + rng.standard_normal((B, V)) * 0.2 + 6.0).astype(np.float32)
    x[3, :4] = x[3].max() + 0.5                              # four tied targets
    kw = dict(thr=[0.02, 0.05, 0.1, 0.01, 0.02, 0.3, 0.05, 0.02, 0.04, 0.02, 0.5, 0.03],
              prob=[1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0],
              k=[1, 5, 0, 3, 40, 2, 1, 10, 300, 2, 4, 7],
              t=[0.7, 0.0, 1.0, 0.0, 1.3, 0.8, 0.0, 1.0, 2.0, 0.5, 1.0, 0.9],
              m=[0.05, 0.0, 0.2, 0.1, 0.0, 0.5, 0.05, 0.0, 0.01, 0.3, 0.0, 0.1],
              seed=[int(s) for s in rng.integers(0, 2**63, B)], pos=list(range(B)))
    got = samplec.compile(src, target="portable")(x, **kw)
    want = samplec.compile(src, opt_level=0, target="portable")(x, **kw)
    np.testing.assert_array_equal(np.array(got.token), np.array(want.token))
    np.testing.assert_allclose(np.array(got.logprob), np.array(want.logprob), atol=2e-4, rtol=1e-4)


def run_time_arrays(prog, B: int, V: int, rng, history: int = 64) -> dict:
    """A server's arguments other than its numbers: MLX histories (padding included), per-row seeds, masks and biases
    as MLX arrays -- what takes the short path of a repeated call."""
    import mlx.core as mx
    kw = {}
    for p in prog.params:
        if p.kind == "tokens":
            kw[p.name] = mx.array(rng.integers(-1, V, (B, history)).astype(np.int32))
        elif p.kind == "seed":
            kw[p.name] = [int(s) for s in rng.integers(0, 2 ** 63, B)]
        elif p.kind == "mask":
            kw[p.name] = mx.array(rng.random((B, V)) < 0.9)
        elif p.kind == "bias":
            kw[p.name] = mx.array((rng.standard_normal((B, V)) * 0.1).astype(np.float32))
    return kw


# The same at a server's call (benchmarks/bench_launches.py's arguments: every parameter at run time, one value per
# row, MLX histories): at most 40 launches a call, every shipped example. The call runs without the stages its values leave
# off in every row (typical_p 1, top_n_sigma -1, xtc's probability 0: samplec/passes/specialize.py).
SERVER_VALUES = {"temperature": 0.7, "top_p": 0.9, "min_p": 0.05, "top_k": 50, "typical_p": 1.0,
                 "repetition_penalty": 1.1, "presence_penalty": 0.1, "frequency_penalty": 0.1}
SERVER_LAUNCHES = {
    "hf_generate.smp:hf_generate": 33, "hf_generate.smp:hf_greedy": 14, "llama.smp:llama": 26,
    "llama.smp:nucleus": 31, "llama_cpp_default.smp:llama_cpp_default": 35,
    "llama_cpp_default.smp:llama_cpp_default_short": 23, "mlx_lm_default.smp:mlx_lm": 27,
    "mlx_lm_default.smp:mlx_lm_chat": 33, "openai.smp:openai": 37, "openai.smp:openai_constant_bias": 36,
    "vllm.smp:vllm": 39, "vllm.smp:vllm_constrained": 40,
}


@pytest.mark.parametrize("example,sampler", EXAMPLE_SAMPLERS, ids=[f"{e}:{s}" for e, s in EXAMPLE_SAMPLERS])
def test_portable_launches_at_a_servers_call(example, sampler, monkeypatch):
    import mlx.core as mx
    from samplec.backend_mlx import kernels
    from samplec.backend_mlx.launches import call_primitives, launches
    monkeypatch.setenv("SAMPLEC_NATIVE", "0")
    monkeypatch.setattr(kernels, "GPU_SUMS", True)
    prog = samplec.compile((ROOT / "examples" / example).read_text(), sampler, target="portable")
    V, B = 152064, 2
    rng = np.random.default_rng(0)
    kw = run_time_arrays(prog, B, V, rng)
    kw.update((p.name, [SERVER_VALUES[p.name]] * B) for p in prog.params if p.name in SERVER_VALUES)
    x = mx.array(rng.standard_normal((B, V)).astype(np.float32))
    counts = call_primitives(prog, x, **kw)
    assert prog.queue_stats["short"] == 1
    assert launches(counts) <= SERVER_LAUNCHES[f"{example}:{sampler}"], counts


def test_portable_launches_of_samplec_serves_chain(monkeypatch):
    """`samplec serve`'s chain (an allow, three penalties stages over two histories, every value at run time) at a
    server's call: at most 41 launches (what it launches now)."""
    import mlx.core as mx
    from samplec.backend_mlx import kernels
    from samplec.backend_mlx.launches import call_primitives, launches
    from samplec.serve import SERVER_CHAIN, TOP
    monkeypatch.setenv("SAMPLEC_NATIVE", "0")
    monkeypatch.setattr(kernels, "GPU_SUMS", True)
    prog = samplec.compile(SERVER_CHAIN.replace("TOP", str(TOP)), "mlx_lm_server", target="portable")
    V, B = 152064, 2
    rng = np.random.default_rng(0)
    kw = run_time_arrays(prog, B, V, rng)
    kw.update((p.name, [SERVER_VALUES[p.name]] * B) for p in prog.params if p.name in SERVER_VALUES)
    kw["pos"] = [17, 4000]
    counts = call_primitives(prog, mx.array(rng.standard_normal((B, V)).astype(np.float32)), **kw)
    assert prog.queue_stats["short"] == 1
    assert launches(counts) <= 41, counts
