"""`samplec explain` and the compile flags that show what the optimizer did (docs/cli.md, docs/compiler.md).

Golden cases: each tests/golden/explain/CASE.smp holds one behaviour; its `# RUN:` line gives the arguments of
`samplec explain CASE.smp ...`; the expected output is CASE.txt (text) or CASE.dot (`--emit dot`).
Re-bless with SAMPLEC_UPDATE_GOLDENS=1 (never in CI).
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

import samplec
from samplec.api import _front
from samplec.backend_mlx import native as native_mod
from samplec.cli import app
from samplec.explain import _cluster, explain, render_dot, render_text
from samplec.frontend.lower import lower, lower_traced
from samplec.ir.ops import DRAW_OPS, STAGE_OPS
from samplec.ir.printer import print_graph
from samplec.passes import PASSES, PIPELINES

try:
    from .goldens import assert_golden
except ImportError:  # pragma: no cover - tests run without a package
    from goldens import assert_golden

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "explain"
CASES = sorted(GOLDEN.glob("*.smp"))
EXAMPLES = sorted((ROOT / "examples").glob("*.smp"))
runner = CliRunner()


@pytest.fixture(autouse=True)
def portable_as_the_cpu_lowers_it(monkeypatch):
    """The portable target's explanation as the CPU lowers it (candidates where a chain allows), whatever device
    runs the tests: the golden files are one machine's."""
    from samplec.passes import target
    monkeypatch.setattr(target, "partitions", lambda: True)


def cli(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output and "Traceback" not in (result.stderr or "")
    return result


def _run_args(case: Path) -> list[str]:
    line = next(l for l in case.read_text().splitlines() if l.startswith("# RUN:"))
    return shlex.split(line.split(":", 1)[1])


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_golden_explain(case: Path):
    args = _run_args(case)
    result = cli("explain", case, *args)
    assert result.exit_code == 0, result.output
    assert_golden(case.with_suffix(".dot" if "dot" in args else ".txt"), result.stdout)


def _samplers(path: Path) -> list[str]:
    return re.findall(r"^sampler (\w+)", path.read_text(), re.M)


@pytest.mark.parametrize("path", EXAMPLES + CASES, ids=[p.stem for p in EXAMPLES + CASES])
def test_traced_pipeline_is_the_compiled_program(path: Path):
    """explain follows the real pipeline: stripped of its stage tags, its graph prints exactly as `compile`."""
    source = path.read_text()
    args = _run_args(path) if path.parent == GOLDEN else []
    binds = dict(a.split("=") for a in args[args.index("--set") + 1:args.index("--set") + 2]) if "--set" in args \
        else {}
    for name in _samplers(path):
        for level in (0, 1, 2):
            ex = explain(source, name, level, binds)
            assert print_graph(ex.stripped) == samplec.compile(source, name, level, binds).ir()


def test_lowering_side_table_leaves_the_graph_unchanged():
    source = (ROOT / "examples" / "llama.smp").read_text()
    checked, _, binds = _front(source, "llama", {}, "llama.smp")
    graph, trace = lower_traced(checked, binds)
    assert print_graph(graph) == print_graph(lower(checked, binds))
    assert [st.name for st, _, _ in trace] == ["penalties", "top_k", "top_p", "min_p", "temperature", "sample"]
    assert [node.op for _, node, _ in trace][1:] == ["top_k", "top_p", "min_p", "temperature", "sample"]
    assert [st.span.line for st, _, _ in trace] == [4, 5, 6, 7, 8, 9]


def _kept_ops(ex, key):
    return [n.op for n in ex.final.toposort() if ex.group_of.get(id(n)) == key and n.op in STAGE_OPS + DRAW_OPS]


def test_each_kept_stage_owns_exactly_its_stage_op():
    source = "sampler s(seed: seed = 0) { top_k(3); typical_p(0.9); top_n_sigma(1.5); temperature(0.7); sample(seed) }"
    ex = explain(source, level=2, native=True)
    for grp in ex.groups:
        if grp.stage is not None:
            assert _kept_ops(ex, grp.key) == [grp.stage]
            assert grp.became[-1] == f"result: kept as the stage op `{grp.stage}`"
    chain = ex.chains[0]
    assert [s.op for s in chain.stages] == ["top_k", "typical_p", "top_n_sigma", "temperature"]
    # without the native primitives (the portable target) each stage op takes the portable lowering
    text = render_text(explain(source, level=2, native=False))
    assert "native chain kernel" not in text and text.count("the portable lowering:") == 5


def test_removed_stages_leave_no_node_of_their_own():
    source = "sampler s(seed: seed = 0) { top_k(0); top_p(0.9); temperature(0); min_p(0.1); sample(seed) }"
    ex = explain(source, level=2, native=True)
    kept = {g.key for g in ex.groups if any(v == g.key for v in ex.group_of.values())}
    assert kept & {0, 1, 2, 3} == set()
    assert [n.op for n in ex.final.toposort() if ex.group_of.get(id(n)) == 4] == ["argmax"]
    became = {g.stage: g.became for g in ex.groups if g.stage}
    assert "0 is its off value" in became["top_k"][1]
    assert "greedy" in became["top_p"][1]
    assert "temperature 0 made the draw greedy" in became["temperature"][1]
    assert "temperature 0 before it" in became["min_p"][1]


def test_dot_clusters_every_node_by_stage_and_inlines_constants():
    source = (GOLDEN / "dot_chain.smp").read_text()
    ex = explain(source, level=2)
    dot = render_dot(ex)
    assert "const" not in dot                               # constants are inline values, not nodes
    assert "top_k(%" in dot and ", 40)" in dot
    for grp in ex.groups:
        nodes = [n for n in ex.final.toposort() if ex.group_of.get(id(n)) == grp.key and n.op not in ("input",
                                                                                                           "const")]
        if nodes:
            assert f'"cluster_{_cluster(grp.key)}"' in dot
    assert dot.count("shape=octagon") == len(ex.final.checks)
    assert all(f'"output {k}"' in dot for k, _ in ex.final.outputs)


needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")


@needs_dot
@pytest.mark.parametrize("case", [c for c in CASES if "dot" in _run_args(c)], ids=lambda c: c.stem)
def test_golden_dot_renders(case):
    res = subprocess.run(["dot", "-Tsvg"], input=case.with_suffix(".dot").read_bytes(), capture_output=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr


@needs_dot
def test_emit_svg_and_png(tmp_path):
    src = ROOT / "examples" / "llama.smp"
    result = cli("compile", src, "--emit", "svg")
    assert result.exit_code == 0 and "<svg" in result.stdout
    result = cli("explain", src, "--emit", "png", "-o", tmp_path / "g.png")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_emit_svg_without_graphviz_names_what_to_install(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    result = cli("explain", ROOT / "examples" / "llama.smp", "--emit", "svg")
    assert result.exit_code == 1
    assert "graphviz" in result.stderr and "apt-get install graphviz" in result.stderr


def test_bad_arguments_are_errors(tmp_path):
    src = ROOT / "examples" / "llama.smp"
    assert cli("compile", src, "-o", tmp_path / "l.smpb").exit_code == 0
    result = cli("explain", tmp_path / "l.smpb")
    assert result.exit_code == 1 and "explain reads the .smp source" in result.stderr
    assert "--emit must be" in cli("explain", src, "--emit", "jpg").stderr
    assert "--native must be" in cli("explain", src, "--native", "maybe").stderr
    assert "no such file" in cli("explain", "nope.smp").stderr
    result = cli("explain", src, "--sampler", "nope")
    assert result.exit_code == 1 and "nope" in result.stderr


def _expected_changes(source: str, level: int) -> tuple[list[str], dict[str, str]]:
    """Independently: run the pipeline pass by pass and see which passes change the printed IR."""
    checked, _, binds = _front(source, None, {}, "s.smp")
    g = lower(checked, binds)
    text, changed = print_graph(g), {}
    unchanged = []
    from samplec.passes import TARGET_PASSES
    from samplec.passes.target import resolve
    for name in PIPELINES[level] + (f"target-{resolve()}",):
        g = (PASSES.get(name) or TARGET_PASSES[name]).run(g)
        new = print_graph(g)
        if new == text:
            unchanged.append(name)
        else:
            changed[name] = new
        text = new
    return unchanged, changed


@pytest.mark.parametrize("level", [0, 1, 2])
def test_print_after_all_shows_only_passes_that_changed_something(tmp_path, level):
    src = tmp_path / "s.smp"
    src.write_text("sampler s(seed: seed = 0) { top_k(0); top_p(0.9); temperature(0.8); sample(seed) }\n")
    unchanged, changed = _expected_changes(src.read_text(), level)
    result = cli("compile", src, f"-O{level}", "--emit", "ir", "--print-after-all")
    assert result.exit_code == 0, result.output
    shown = re.findall(r"^// ---- after (\S+) ----$", result.stdout, re.M)
    assert shown == list(changed)
    for name, text in changed.items():
        assert f"// ---- after {name} ----\n{text}" in result.stdout
    assert f"// ---- passes that changed nothing: {' '.join(unchanged) or '(none)'}" in result.stdout


def test_print_diff_gives_unified_diffs(tmp_path):
    src = tmp_path / "s.smp"
    src.write_text("sampler s(seed: seed = 0) { top_k(0); top_p(0.9); sample(seed) }\n")
    unchanged, changed = _expected_changes(src.read_text(), 2)
    result = cli("compile", src, "--emit", "ir", "--print-diff")
    assert result.exit_code == 0, result.output
    assert re.findall(r"^--- before (\S+)$", result.stdout, re.M) == list(changed)
    assert "-  %x_topk = top_k" in result.stdout          # the stage at its off value, removed by `stages`
    assert f"passes that changed nothing: {' '.join(unchanged)}" in result.stdout


def test_without_emit_the_pass_output_goes_to_stderr(tmp_path):
    src = tmp_path / "s.smp"
    src.write_text("sampler s(seed: seed = 0) { top_k(0); sample(seed) }\n")
    result = cli("compile", src, "--print-after-all")
    assert result.exit_code == 0 and "// ---- after stages" in result.stderr and not result.stdout
    assert (tmp_path / "s.smpb").exists()


def test_native_auto_follows_the_installation(monkeypatch):
    native = native_mod
    source = (GOLDEN / "chain_native.smp").read_text()
    monkeypatch.setenv("SAMPLEC_NATIVE", "0")
    assert "SAMPLEC_NATIVE=0" in render_text(explain(source))
    monkeypatch.delenv("SAMPLEC_NATIVE")
    text = render_text(explain(source))
    assert ("native chain kernel" in text) == (native.installed() and hasattr(native._native, "sample_chain"))


# ---- what explain says runs a stage is what the interpreter runs --------------------------------------------------

def _spy_run(monkeypatch, source: str, **kw):
    """Run the compiled program once on the CPU with the native primitives on, recording which stage ops the chain
    kernel ran and which ran by their dense definition."""
    import mlx.core as mx
    import numpy as np
    from samplec.backend_mlx import interpreter, native
    ran = {"chain": [], "dense": []}
    real_chain, real_dense = native.sample_chain, interpreter._run_expansion

    def chain(x, params, stages, terminal, *a, **k):
        ran["chain"].append(list(stages) + [terminal])
        return real_chain(x, params, stages, terminal, *a, **k)

    def dense(node, ins):
        ran["dense"].append(node.op)
        return real_dense(node, ins)

    monkeypatch.setattr(native, "sample_chain", chain)
    monkeypatch.setattr(interpreter, "_run_expansion", dense)
    monkeypatch.setenv("SAMPLEC_NATIVE", "1")
    with mx.stream(mx.cpu):
        prev = mx.default_device()
        mx.set_default_device(mx.cpu)
        try:
            prog = samplec.Program(samplec.compile(source).stage_graph, compile=False)
            prog(np.random.default_rng(0).normal(size=(2, 300)).astype(np.float32), **kw)
        finally:
            mx.set_default_device(prev)
    return ran


needs_chain = pytest.mark.skipif(not (native_mod.installed() and hasattr(native_mod._native, "sample_chain")),
                                 reason="samplec-native (with the chain kernel) is not installed")


@needs_chain
def test_chain_kernel_claim_matches_the_interpreter(monkeypatch):
    source = "sampler s(seed: seed = 0) -> token, logprob { top_k(0); top_k(30); top_p(0.9); temperature(0.7); " \
             "sample(seed) }"
    ex = explain(source, native=True)
    claimed = [[s.op for s in c.stages] + [c.draw.op] for c in ex.chains]
    assert claimed == [["top_k", "top_p", "temperature", "sample"]]
    assert "chain #1, the native chain kernel" in render_text(ex)
    ran = _spy_run(monkeypatch, source)
    assert ran["chain"] == claimed and ran["dense"] == []


@needs_chain
def test_drawless_chain_claim_matches_the_interpreter(monkeypatch):
    """Stages with no draw after them (a chain with no terminal; a cut before an allow) are a chain too: the
    kernel's greedy draw runs unread beside the result the next op reads."""
    for source, claimed in [("sampler s() -> probs { top_k(5); top_p(0.9) }", [["top_k", "top_p", "greedy"]]),
                            ("sampler s(m: mask, seed: seed) -> token { top_p(0.9) allow(m) sample(seed) }",
                             [["top_p", "greedy"], ["sample"]])]:
        ex = explain(source, native=True)
        assert [[s.op for s in c.stages] + [c.draw.op if c.draw is not None else "greedy"] for c in ex.chains] \
            == claimed
        assert "its dense definition in MLX ops" not in render_text(ex)
        kw = dict(m=[[i % 3 > 0 for i in range(300)]] * 2, seed=1) if "allow" in source else {}
        ran = _spy_run(monkeypatch, source, **kw)
        assert ran["chain"] == claimed and ran["dense"] == []


@needs_chain
def test_folded_stage_check_leaves_the_cut_to_the_chain(monkeypatch):
    """DRY at multiplier 0 folds away but keeps its "no token left" check; that check reads the row's maximum,
    which every cut keeps, so it reads the logits' and top_p runs in the chain, not by its dense definition."""
    source = "sampler s(h: tokens, seed: seed) -> token { top_p(0.9) dry(h, 0.0) temperature(0.7) sample(seed) }"
    ran = _spy_run(monkeypatch, source, h=[[1, 2, 1, 2]] * 2, seed=3)
    assert ran["chain"] == [["top_p", "temperature", "sample"]] and ran["dense"] == []


@needs_chain
def test_portable_claim_matches_the_interpreter(monkeypatch):
    """Without the native primitives (the portable target) explain names the portable lowering for each stage, and
    the program runs no stage op by its dense definition."""
    import numpy as np
    source = "sampler s() -> probs { top_k(5); top_p(0.9) }"
    text = render_text(explain(source, native=False))
    assert text.count("the portable lowering:") == 2 and "its dense definition" not in text
    prog = samplec.compile(source, target="portable")
    prog(np.random.default_rng(0).normal(size=(2, 300)).astype(np.float32))
    assert [t for t in prog.kernel_trace() if t[0] == "definition"] == []


@pytest.mark.parametrize("terminal", ["mirostat(mu, 5.0, 0.1, seed = seed)", "mirostat_v2(mu, 5.0, 0.1, seed)"])
@pytest.mark.parametrize("target", ["cpu", "portable", "metal", "cuda"])
def test_explain_a_chain_the_target_pass_rebuilt(terminal, target):
    """Mirostat's temperature is read by its s_hat as well as by the chain: the cuda target's pass rebuilds the
    chain over the temperature's row (new nodes). explain names the chain kernel for the rebuilt chain's stage ops
    and never fails on a node it did not tag."""
    source = f"sampler m(mu: state, seed: seed) -> token, logprob, mu {{ temperature(0.8) {terminal} }}"
    text = render_text(explain(source, target=target))
    assert "runs as:" in text
    if target == "cuda":
        assert "chain #1: mirostat" in text
        assert "sample: chain #1, the CUDA chain kernel" in text
        assert "top_k_rank: its dense definition" not in text and "sample: its dense definition" not in text


def test_explain_names_the_stages_a_call_turns_off():
    """explain lists the program's switches (samplec.passes.specialize) with their off rules over the names the
    stage reads; a stage whose constant keeps it on is not listed; the list is the program's own."""
    source = ("sampler s(h: tokens, t: float = 1.0, p: float = 1.0, r: float = 0.0) -> token "
              "{ penalties(h, repeat = 1.1, presence = r) top_p(p) temperature(t) greedy() }")
    text = render_text(explain(source, target="portable"))
    line = next(ln for ln in text.splitlines() if ln.startswith("stages a call runs without"))
    assert "top_p (p >= 1)" in line and "temperature (t == 1)" in line and "penalties" not in line
    prog = samplec.compile(source, target="portable")
    assert sorted(sw.stage for sw in prog._switches if sw.stage != "penalties") == ["temperature", "top_p"]
    assert "stages a call runs without" not in render_text(explain("sampler s() -> token { top_p(0.9) greedy() }"))
