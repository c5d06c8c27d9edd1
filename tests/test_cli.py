"""The command line end to end, including bad input: every failure is a clear message and a non-zero exit."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import samplec
from samplec.cli import app

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
runner = CliRunner()

CHAIN = """sampler s(t: float = 0.8, p: float = 0.9, seed: seed = 0) -> token, logprob, top_logprobs(2) {
    top_k(20)
    top_p(p)
    temperature(t)
    sample(seed)
}
"""


def cli(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output and "Traceback" not in (result.stderr or "")
    return result


@pytest.fixture
def files(tmp_path):
    src = tmp_path / "s.smp"
    src.write_text(CHAIN)
    x = np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32) * 2
    np.save(tmp_path / "x.npy", x)
    return tmp_path, src, x


def test_compile_writes_smpb_and_inspect_prints_ir(files):
    d, src, _ = files
    r = cli("compile", src, "-o", d / "s.smpb")
    assert r.exit_code == 0, r.output
    assert (d / "s.smpb").read_bytes()[4:8] == b"SMPB"
    r2 = cli("inspect", d / "s.smpb")
    assert r2.exit_code == 0 and r2.stdout.startswith("sampler @s {")
    r3 = cli("compile", src, "--emit", "ir")
    assert r3.stdout == r2.stdout


def test_compile_default_output_path(files):
    d, src, _ = files
    assert cli("compile", src).exit_code == 0
    assert (d / "s.smpb").exists()


def test_emit_variants_and_levels(files):
    d, src, _ = files
    unopt = cli("compile", src, "--emit", "ir-unopt").stdout
    o0 = cli("compile", src, "-O0", "--emit", "ir").stdout
    o2 = cli("compile", src, "-O2", "--emit", "ir").stdout
    # lowering gives stage ops; -O0 runs each by its dense definition; -O2 keeps the chain for one kernel
    assert "top_k %logits" in unopt and "kth_largest %logits" in o0 and "top_k %" not in o0
    assert "top_k %logits" in o2 and "sort" not in o2 and "kth_largest" not in o2 and "check %" in o2
    dot = cli("compile", src, "--emit", "dot").stdout
    assert dot.startswith('digraph "s"') and "->" in dot
    assert not (d / "s.smpb").exists()
    for kind, text in (("ir", o2), ("dot", dot), ("ir-unopt", unopt)):     # (-o: what --emit gives, in a file)
        out = d / f"s.{kind}"
        r = cli("compile", src, "--emit", kind, "-o", out)
        assert r.stdout == "" and out.read_text() == text and not (d / "s.smpb").exists()
    both = cli("compile", src, "--emit", "ir", "--print-after-all", "--print-diff")
    assert both.exit_code != 0 and "pass one" in both.output
    after = cli("compile", src, "--emit", "ir", "--print-after-all")
    # (only the passes that changed something print the IR: here none did; tests/test_explain.py has the rest)
    assert "// ---- passes that changed nothing: stages simplify cse dce" in after.stdout


def test_set_temperature_zero_leaves_no_randomness(files):
    _, src, _ = files
    r = cli("compile", src, "--set", "t=0", "--emit", "ir")
    assert r.exit_code == 0, r.output
    assert "random_bits" not in r.stdout and "%t:" not in r.stdout


def test_set_out_of_range_and_unknown(files):
    _, src, _ = files
    r = cli("compile", src, "--set", "p=1.5")
    assert r.exit_code == 1 and "p=1.5" in r.output and "out of range" in r.output
    r = cli("compile", src, "--set", "q=1")
    assert r.exit_code == 1 and "no parameter 'q'" in r.output
    r = cli("compile", src, "--set", "p")
    assert r.exit_code == 1 and "NAME=VALUE" in r.output


def test_syntax_error_renders_location_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.smp"
    bad.write_text("sampler s() {\n    top_k(40\n    greedy()\n}\n")
    out = tmp_path / "bad.smpb"
    r = cli("compile", bad, "-o", out)
    assert r.exit_code == 1
    first = r.output.splitlines()[0]
    assert first.startswith(f"{bad}:3:5: error:"), r.output
    assert "^" in r.output
    assert not out.exists()


def test_semantic_error(tmp_path):
    bad = tmp_path / "bad.smp"
    bad.write_text("sampler s() {\n    top_p(1.5)\n    greedy()\n}\n")
    r = cli("compile", bad)
    assert r.exit_code == 1 and ":2:11: error:" in r.output and "out of range" in r.output


def test_run_json_text_and_per_row_params(files):
    d, src, x = files
    r = cli("run", src, "--logits", d / "x.npy", "--seed", "5", "--param", "t=0.5,1.0,0", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert set(data) == {"token", "logprob", "top_logprobs"}
    assert len(data["token"]) == 3 and len(data["top_logprobs"]["ids"][0]) == 2
    assert data["token"][2] == int(np.argmax(x[2]))          # t = 0 in row 2 is greedy
    text = cli("run", src, "--logits", d / "x.npy", "--seed", "5", "--param", "t=0.5,1.0,0")
    assert text.exit_code == 0 and "row 2:" in text.stdout


def test_run_json_is_strict_json_with_null_for_removed_candidates(files):
    """Strict JSON (no -Infinity, which JavaScript's and jq's parsers refuse): a removed candidate's -inf is null;
    the text table still prints it as -inf."""
    d, _, x = files
    src = d / "cut.smp"
    src.write_text("sampler s(seed: seed = 0) -> token, candidates(4) {\n    top_k(2)\n    sample(seed)\n}\n")
    r = cli("run", src, "--logits", d / "x.npy", "--seed", "3", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    for ids, values in zip(data["candidates"]["ids"], data["candidates"]["values"]):
        assert values[2:] == [None, None] and all(isinstance(v, float) for v in values[:2])
    assert data["candidates"]["ids"][0][:2] == list(np.argsort(-x[0], kind="stable")[:2])
    text = cli("run", src, "--logits", d / "x.npy", "--seed", "3")
    assert text.exit_code == 0 and ":-inf" in text.stdout


def test_run_smpb_equals_source(files):
    d, src, _ = files
    cli("compile", src, "-o", d / "s.smpb")
    a = json.loads(cli("run", src, "--logits", d / "x.npy", "--seed", "9", "--json").stdout)
    b = json.loads(cli("run", d / "s.smpb", "--logits", d / "x.npy", "--seed", "9", "--json").stdout)
    assert a == b


def test_run_example_with_history():
    r = cli("run", EXAMPLES / "llama.smp", "--logits", EXAMPLES / "logits.npy", "--history",
            EXAMPLES / "history.npy", "--json")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["token"]) == 2


def test_draws_frequencies_match_probabilities(files):
    d, src, _ = files
    r = cli("run", src, "--logits", d / "x.npy", "--seed", "0", "--draws", "400", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["draws"] == 400 and len(data["rows"]) == 3
    for row in data["rows"]:
        assert sum(row["counts"]) == 400
        assert abs(sum(row["probability"]) - 1) < 0.05 or len(row["tokens"]) >= 10
        top = int(np.argmax(row["probability"]))
        assert abs(row["frequency"][top] - row["probability"][top]) < 0.1
    text = cli("run", src, "--logits", d / "x.npy", "--draws", "50")
    assert text.exit_code == 0 and "probability" in text.stdout


def test_bad_smpb(tmp_path, files):
    d, _, _ = files
    bad = tmp_path / "bad.smpb"
    bad.write_bytes(b"\x10\x00\x00\x00SMPB" + b"\xff" * 40)
    for cmd in (["inspect", bad], ["run", bad, "--logits", d / "x.npy"]):
        r = cli(*cmd)
        assert r.exit_code == 1 and "invalid .smpb" in r.output


def test_nan_logits_names_the_row(files, tmp_path):
    _, src, x = files
    y = x.copy()
    y[1, 7] = np.nan
    np.save(tmp_path / "nan.npy", y)
    r = cli("run", src, "--logits", tmp_path / "nan.npy")
    assert r.exit_code == 1 and "NaN" in r.output and "row 1" in r.output


def test_wrong_shaped_logits(files, tmp_path):
    _, src, _ = files
    np.save(tmp_path / "cube.npy", np.zeros((2, 2, 2), np.float32))
    r = cli("run", src, "--logits", tmp_path / "cube.npy")
    assert r.exit_code == 1 and "logits" in r.output and "shape" in r.output
    np.save(tmp_path / "ints.npy", np.zeros((2, 5), np.int32))
    r = cli("run", src, "--logits", tmp_path / "ints.npy")
    assert r.exit_code == 1 and "float32" in r.output and "--logits" in r.output and "ints.npy" in r.output


def test_run_param_errors(files):
    d, src, _ = files
    r = cli("run", src, "--logits", d / "x.npy", "--param", "p=0.5,1.5,0.9")
    assert r.exit_code == 1 and "p = 1.5" in r.output and "row 1" in r.output
    r = cli("run", src, "--logits", d / "x.npy", "--param", "zz=1")
    assert r.exit_code == 1 and "zz" in r.output
    r = cli("run", src, "--logits", d / "x.npy", "--history", d / "x.npy")
    assert r.exit_code == 1 and "tokens" in r.output
    r = cli("run", src, "--logits", d / "missing.npy")
    assert r.exit_code == 1 and "no such file" in r.output


def test_safetensors_and_npz(files, tmp_path):
    import mlx.core as mx
    d, src, x = files
    mx.save_safetensors(str(tmp_path / "x.safetensors"), {"logits": mx.array(x).astype(mx.bfloat16)})
    np.savez(tmp_path / "x.npz", logits=x)
    a = cli("run", src, "--logits", tmp_path / "x.npz", "--seed", "1", "--json")
    b = cli("run", src, "--logits", tmp_path / "x.safetensors", "--seed", "1", "--json")
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output


def test_help_lists_commands():
    r = cli("--help")
    assert r.exit_code == 0
    for cmd in ("compile", "run", "inspect"):
        assert cmd in r.stdout


def test_import_prints_a_source_that_compiles(tmp_path):
    fixtures = Path(__file__).resolve().parent / "fixtures" / "import"
    for kind, name in (("hf", "generation_config.json"), ("llama-cpp", "llama_cpp_flags.txt"),
                       ("openai", "openai_request.json")):
        r = cli("import", "--from", kind, fixtures / name)
        assert r.exit_code == 0, r.output
        src = tmp_path / f"{kind}.smp"
        src.write_text(r.stdout)
        assert cli("compile", src, "-o", tmp_path / f"{kind}.smpb").exit_code == 0
    r = cli("import", "--from", "nope", fixtures / "generation_config.json")
    assert r.exit_code == 1 and "unknown import kind" in r.output


def test_variadic_params_bom_and_float64_logits(tmp_path):
    src = tmp_path / "bom.smp"
    src.write_bytes(b"\xef\xbb\xbf" + CHAIN.encode())
    np.save(tmp_path / "x64.npy", np.random.default_rng(0).standard_normal((2, 50)))   # float64
    r = cli("run", src, "--logits", tmp_path / "x64.npy", "--param", "t=0.5", "p=0.7", "--seed", "3", "--json")
    assert r.exit_code == 0, r.output
    r2 = cli("run", src, "--logits", tmp_path / "x64.npy", "--param", "t=0.5", "--param", "p=0.7", "--seed", "3",
             "--json")
    assert r.stdout == r2.stdout
    r = cli("compile", src, "--set", "t=0", "p=0.5", "--emit", "ir")
    assert r.exit_code == 0 and "%t:" not in r.stdout and "%p:" not in r.stdout
    r = cli("run", src, "--logits", tmp_path / "x64.npy", "stray")
    assert r.exit_code == 1 and "NAME=VALUE" in r.output


def test_draws_of_a_greedy_sampler(tmp_path, files):
    d, _, x = files
    src = tmp_path / "g.smp"
    src.write_text("sampler g() { top_k(3) greedy() }")
    r = cli("run", src, "--logits", d / "x.npy", "--draws", "20", "--json")
    assert r.exit_code == 0, r.output
    row = json.loads(r.stdout)["rows"][0]
    assert row["tokens"][0] == int(np.argmax(x[0])) and row["counts"][0] == 20 and row["probability"][0] == 1.0


# ---- import: flags on the command line, stdin, -o (atomic), every kind ----

def test_import_llama_cpp_flags_on_the_command_line_stdin_and_output(tmp_path):
    from samplec.importers import from_llama_cpp, from_mlx_lm
    r = cli("import", "--from", "llama-cpp", "--", "--top-k", "40", "--temp", "0.7")
    assert r.exit_code == 0, r.output
    assert r.stdout == from_llama_cpp(["--top-k", "40", "--temp", "0.7"])
    assert cli("import", "--from", "llama-cpp", "--top-k", "40", "--temp", "0.7").stdout == r.stdout  # (-- optional)
    r = cli("import", "--from", "llama-cpp", "--", "--top_k", "40")
    assert r.exit_code == 1 and "unknown flag '--top_k' (did you mean '--top-k'?)" in r.output
    r = runner.invoke(app, ["import", "--from", "mlx-lm", "-"], input='{"temp": 0.6, "top_p": 0.9}')
    assert r.exit_code == 0 and r.stdout == from_mlx_lm({"temp": 0.6, "top_p": 0.9})
    r = runner.invoke(app, ["import", "--from", "vllm", "-"], input='{"temprature": 0.6}')
    assert r.exit_code == 1 and "<stdin>: unknown SamplingParams field 'temprature' (did you mean" in r.output
    out = tmp_path / "imported.smp"
    r = cli("import", "--from", "llama-cpp", "-o", out, "--", "--top-k", "7")
    assert r.exit_code == 0 and r.stdout == "" and out.read_text() == from_llama_cpp("--top-k 7")
    assert cli("compile", out, "--emit", "ir").exit_code == 0
    before = out.read_text()
    r = cli("import", "--from", "llama-cpp", "-o", out, "--", "--mirostat", "3")     # a failure leaves it as it was
    assert r.exit_code == 1 and "expected 0 (off), 1 or 2" in r.output and out.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["imported.smp"]                  # no temporary file left
    r = cli("import", "--from", "hf", "-o", tmp_path / "missing-dir" / "x.smp",
            Path(__file__).resolve().parent / "fixtures" / "import" / "generation_config.json")
    assert r.exit_code == 1 and "cannot write" in r.output
    r = cli("import", "--from", "hf")
    assert r.exit_code == 1 and "give a FILE" in r.output
    r = cli("import", "--from", "llama-cpp", "no-such-flags.txt")
    assert r.exit_code == 1 and "cannot read no-such-flags.txt" in r.output


def test_import_every_kind(tmp_path):
    bodies = {"openai": '{"temperature": 0.5, "top_k": 3}', "vllm": '{"temperature": 0.5, "top_k": 3}',
              "mlx-lm": '{"temp": 0.5, "top_k": 3}', "hf": '{"do_sample": true, "top_k": 3}'}
    for kind, body in bodies.items():
        f = tmp_path / f"{kind}.json"
        f.write_text(body)
        r = cli("import", "--from", kind, f)
        if kind == "openai":            # top_k is not OpenAI's: refused by name, pointing to --from vllm
            assert r.exit_code == 1 and "'top_k' is not an OpenAI" in r.output and "--from vllm" in r.output
        else:
            assert r.exit_code == 0 and "top_k(3)" in r.stdout, (kind, r.output)


# ---- --version, doctor, inspect on a source, missing parameters ----

def test_version_and_doctor(monkeypatch):
    import sys

    import mlx.core as mx

    import samplec
    from samplec.cli import doctor_report
    r = cli("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"samplec {samplec.__version__} (MLX {mx.__version__})"
    r = cli("doctor")
    assert r.exit_code == 0
    for what in ("samplec ", "python ", f"mlx             {mx.__version__}", "default device  Device(cpu",
                 "native ", "SAMPLEC_NATIVE", "SAMPLEC_SPIN", "cuda kernels    off (the default device is Device(cpu",
                 "SAMPLEC_GPU_KERNELS (unset: on)", "SAMPLEC_GPU_CHAIN (unset: on)"):
        assert what in r.stdout, what
    monkeypatch.setenv("SAMPLEC_GPU_KERNELS", "no")
    monkeypatch.setenv("SAMPLEC_GPU_CHAIN", "0")
    assert any(ln == "cuda kernels    off (SAMPLEC_GPU_KERNELS=no)" for ln in doctor_report())
    assert "SAMPLEC_GPU_CHAIN 0" in doctor_report()
    monkeypatch.delenv("SAMPLEC_GPU_CHAIN")
    monkeypatch.delenv("SAMPLEC_GPU_KERNELS")
    from samplec.backend_mlx import native
    if native.installed():
        assert "active" in r.stdout and "threefry_bits" in r.stdout
        assert any("stage chains    the native chain kernel" in ln for ln in doctor_report())
        monkeypatch.setenv("SAMPLEC_NATIVE", "0")
        assert any("loaded but off (SAMPLEC_NATIVE=0)" in ln for ln in doctor_report())
        assert any("stage chains    the portable lowering in MLX ops: on this CPU a chain of top_k" in ln
                   for ln in doctor_report())
        monkeypatch.setenv("SAMPLEC_NATIVE", "off")                 # (off, false, no too: not only 0)
        assert any("loaded but off (SAMPLEC_NATIVE=off)" in ln for ln in doctor_report()) and not native.enabled()
    monkeypatch.setitem(sys.modules, "mlx.core", None)               # MLX missing: reported, no traceback
    lines = doctor_report()
    assert any(ln.startswith("mlx             not available") for ln in lines)
    r = cli("doctor")
    assert r.exit_code == 0 and "not available" in r.stdout


def test_inspect_a_source_points_to_compile(files):
    _, src, _ = files
    r = cli("inspect", src)
    assert r.exit_code == 1 and f"is a .smp source; `inspect` reads compiled .smpb programs. To see its IR, run " \
        f"`samplec compile {src} --emit ir`" in r.output


@pytest.mark.parametrize("decl, flag", [
    ("seed: seed", "pass --seed N (or --param s=N)"),
    ("h: tokens", "pass --history FILE.npy (or --param h=FILE.npy)"),
    ("m: mask", "pass --mask FILE.npy"),
    ("b: bias", "pass --bias FILE.npy"),
    ("t: float", "pass --param t=X"),
])
def test_missing_parameter_names_the_flag(tmp_path, files, decl, flag):
    d, _, _ = files
    name = decl.split(":")[0]
    kind = decl.split(": ")[1]
    use = {"seed": "sample(s)", "tokens": "penalties(h, repeat = 1.1) greedy()", "mask": "allow(m) greedy()",
           "bias": "logit_bias(b) greedy()", "float": "temperature(t) greedy()"}[kind]
    src = tmp_path / "need.smp"
    src.write_text(f"sampler need({decl.replace('seed: seed', 's: seed')}) {{ {use} }}")
    r = cli("run", src, "--logits", d / "x.npy")
    shown = "s" if kind == "seed" else name
    assert r.exit_code == 1 and f"missing required parameter '{shown}' ({kind}): {flag}" in r.output, r.output


def test_two_history_parameters_take_param_files(tmp_path, files):
    d, _, x = files
    src = tmp_path / "two.smp"
    src.write_text("sampler two(a: tokens, b: tokens) -> token { penalties(a, repeat = 2.0) "
                   "penalties(b, presence = 1.0) greedy() }")
    np.save(tmp_path / "a.npy", np.array([[1, 2]] * 3, dtype=np.int32))
    r = cli("run", src, "--logits", d / "x.npy", "--param", f"a={tmp_path / 'a.npy'}")
    assert r.exit_code == 1 and "missing required parameter 'b' (tokens): pass --param b=FILE.npy" in r.output
    r = cli("run", src, "--logits", d / "x.npy", "--param", f"a={tmp_path / 'a.npy'}", f"b={tmp_path / 'a.npy'}",
            "--json")
    assert r.exit_code == 0, r.output


def test_hostile_paths_and_exit_statuses(tmp_path):
    """-o onto the source is refused and leaves it untouched; an empty -o is a user error; FIFOs are refused, never
    waited on; a corrupted .smpb is refused; exit 1 for what was given, 2 for a usage error (click's convention)."""
    import os
    import signal
    src = tmp_path / "chain.smp"
    src.write_text(CHAIN)
    r = cli("compile", src, "-o", src)
    assert r.exit_code == 1 and "it is the input file" in r.output and src.read_text() == CHAIN
    for command in (("compile", src), ("explain", src), ("import", "--from", "hf", src)):
        r = cli(*command, "-o", "")
        assert r.exit_code == 1 and "error: -o: an empty file name" in r.output, (command, r.output)
    r = cli("compile", src, "-o", tmp_path)
    assert r.exit_code == 1 and "it is a directory" in r.output, r.output
    r = cli("compile", src, "--no-such-flag")
    assert r.exit_code == 2
    fifo, npy = tmp_path / "pipe.smp", tmp_path / "pipe.npy"
    os.mkfifo(fifo)
    os.mkfifo(npy)
    signal.alarm(20)                  # (a blocking open would hang the test: fail it instead)
    try:
        for args in (("compile", fifo), ("inspect", fifo), ("explain", fifo),
                     ("run", EXAMPLES / "llama.smp", "--logits", npy)):
            r = cli(*args)
            assert r.exit_code == 1 and "not a regular file" in r.output, (args, r.output)
    finally:
        signal.alarm(0)
    out = tmp_path / "chain.smpb"
    assert cli("compile", src, "-o", out).exit_code == 0
    data = bytearray(out.read_bytes())
    data[len(data) // 2] ^= 0x10
    out.write_bytes(bytes(data))
    r = cli("inspect", out)
    assert r.exit_code == 1 and "SHA-256 mismatch" in r.output


def test_short_or_malformed_array_files_name_the_flag(files):
    """MLX reads a .npy lazily: a file cut short is refused when it is read, naming the flag and the file (exit 1),
    not when the program runs (an internal error); a header whose shape is no number says so."""
    d, src, x = files
    data = (d / "x.npy").read_bytes()
    (d / "short.npy").write_bytes(data[:-4])
    (d / "hist.npy").write_bytes(data[:-4])
    r = cli("run", src, "--logits", d / "short.npy")
    assert r.exit_code == 1 and "--logits: cannot read" in r.output and "short.npy" in r.output, r.output
    hist = d / "h.npy"
    np.save(hist, np.zeros((3, 40), np.int32))
    (d / "hshort.npy").write_bytes(hist.read_bytes()[:-8])
    r = cli("run", EXAMPLES / "llama.smp", "--logits", d / "x.npy", "--history", d / "hshort.npy")
    assert r.exit_code == 1 and "--history: cannot read" in r.output, r.output
    assert b"(3, 50)" in data
    (d / "bad.npy").write_bytes(data.replace(b"(3, 50)", b"(3, 5x)", 1))
    r = cli("run", src, "--logits", d / "bad.npy")
    assert r.exit_code == 1 and "--logits: cannot read" in r.output, r.output


def test_array_files_that_hold_no_numbers_say_what_they_hold(files):
    """A text file named .npy, an array of Python objects, a file cut short, integer logits, float history: each
    error says what is wrong in the user's words (not MLX's internals: "[from_str] ...", "mlx.core.int32")."""
    d, src, x = files
    (d / "text.npy").write_text("not an array\n")
    np.save(d / "obj.npy", np.array([["a", 1]], dtype=object), allow_pickle=True)
    (d / "cut.npy").write_bytes((d / "x.npy").read_bytes()[:-40])
    np.save(d / "ints.npy", np.zeros((3, 50), np.int32))
    np.save(d / "fhist.npy", np.zeros((3, 4), np.float32))
    for name, words in (("text.npy", "not a .npy file"), ("obj.npy", "Python objects (dtype object)"),
                        ("cut.npy", "ends before its data does"), ("ints.npy", "got int32")):
        r = cli("run", src, "--logits", d / name)
        assert r.exit_code == 1 and words in r.output and "mlx.core" not in r.output, (name, r.output)
    r = cli("run", EXAMPLES / "llama.smp", "--logits", d / "x.npy", "--history", d / "fhist.npy", "--seed", "1")
    assert r.exit_code == 1 and "must be integers, got float32" in r.output, r.output


def test_probs_as_text_list_only_kept_tokens(tmp_path, files):
    d, _, _ = files
    (d / "c.smp").write_text("sampler c() -> probs { top_k(3) }\n")
    r = cli("run", d / "c.smp", "--logits", d / "x.npy")
    assert r.exit_code == 0, r.output
    for line in (ln for ln in r.output.splitlines() if ln.strip().startswith("probs")):
        assert line.count(":") == 3 and ":0," not in line and line.endswith("(3 tokens > 0)"), line


@pytest.mark.filterwarnings("default::samplec.SamplecWarning")
def test_source_warnings_are_shown_and_the_program_compiles(tmp_path):
    """A parameter never used is a warning (file:line:col and its caret) from the CLI and, as a SamplecWarning,
    from the API; the program compiles all the same."""
    import warnings
    src = tmp_path / "w.smp"
    src.write_text("sampler c(seed: seed, t: float = 1.0) -> probs { top_k(3) }\n")
    r = cli("compile", src, "-o", tmp_path / "w.smpb")
    assert r.exit_code == 0 and (tmp_path / "w.smpb").exists(), r.output
    assert f"{src}:1:11: warning: parameter 'seed' is never used" in r.stderr, r.stderr
    assert "parameter 't' is never used" in r.stderr and "^~~~" in r.stderr, r.stderr
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "samplec", "compile", str(src), "--emit", "dot"],   # (compiles twice)
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr.count("parameter 'seed' is never used") == 1, r.stderr
    (tmp_path / "e.smp").write_text("sampler c(logits: float, t: float = 1.0) -> probs { top_k(3) }\n")
    r = cli("compile", tmp_path / "e.smp")            # (an error: no warnings before it)
    assert r.exit_code == 1 and "never used" not in r.stderr and "may not be called 'logits'" in r.output, r.output
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        samplec.compile(src.read_text())
    assert [w.category for w in got] == [samplec.SamplecWarning] * 2, got
    assert str(got[0].message).startswith("<string>:1:11: warning: parameter 'seed' is never used")


def test_draws_refuses_a_constant_seed(tmp_path, files):
    """--draws advances the seed parameter; a program whose seed is a constant (a literal, or bound with --set)
    would give one token N times beside a spread of probabilities: an error, not misleading statistics."""
    d, src, _ = files
    lit = tmp_path / "lit.smp"
    lit.write_text("sampler lit() -> token { sample(42) }\n")
    r = cli("run", lit, "--logits", d / "x.npy", "--draws", 10)
    assert r.exit_code == 1 and "a seed of this program is a constant" in r.output, r.output
    assert cli("compile", src, "--set", "seed=5", "-o", tmp_path / "s5.smpb").exit_code == 0
    r = cli("run", tmp_path / "s5.smpb", "--logits", d / "x.npy", "--draws", 10)
    assert r.exit_code == 1 and "seed of this program is a constant" in r.output, r.output
    two = tmp_path / "two.smp"          # (one seed a parameter, the xtc coin's a literal)
    two.write_text("sampler s(seed: seed) -> token { xtc(0.1, 0.5, 42) sample(seed) }\n")
    r = cli("run", two, "--logits", d / "x.npy", "--draws", 10)
    assert r.exit_code == 1 and "seed of this program is a constant" in r.output, r.output
    r = cli("run", src, "--logits", d / "x.npy", "--draws", 10, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["draws"] == 10


def test_conflicting_or_misplaced_flags_are_errors(tmp_path, files):
    """A parameter given twice, --seed beside --param of the same seed, -O / --sampler on a compiled program, and a
    compiled program given to compile: each an error naming what was given (never the last value silently)."""
    d, src, _ = files
    x = d / "x.npy"
    r = cli("run", src, "--logits", x, "--param", "t=0.5", "--param", "t=0.6")
    assert r.exit_code == 1 and "--param t: given twice" in r.output, r.output
    r = cli("run", src, "--logits", x, "--seed", "6", "--param", "seed=5")
    assert r.exit_code == 1 and "--seed and --param seed give the same parameter" in r.output, r.output
    r = cli("run", src, "--logits", x, "--seed", "6x")
    assert r.exit_code == 1 and r.output.startswith("error: --seed: expected integers"), r.output
    smpb = tmp_path / "s.smpb"
    assert cli("compile", src, "-o", smpb).exit_code == 0
    for flag in (("-O", "1"), ("--sampler", "s")):
        r = cli("run", smpb, "--logits", x, *flag)
        assert r.exit_code == 1 and f"{flag[0]} applies to a .smp source" in r.output, r.output
    assert cli("run", smpb, "--logits", x).exit_code == 0
    assert cli("run", src, "-O", "1", "--logits", x).exit_code == 0
    r = cli("compile", smpb, "-o", tmp_path / "again.smpb")
    assert r.exit_code == 1 and "a compiled program (.smpb), not a .smp source" in r.output, r.output
    assert not (tmp_path / "again.smpb").exists()


def test_set_temperature_zero_is_greedy_at_o1_and_o2(files):
    """Spec §5: --set temperature=0 leaves a greedy program with no randomness in it (-O1 runs the stage-level
    rewrites before the stages expand; -O0 is the unoptimized definition)."""
    d, src, _ = files
    for level in ("-O1", "-O2"):
        ir = cli("compile", src, level, "--set", "t=0", "--emit", "ir").stdout
        assert "argmax" in ir and "random_bits" not in ir and " sample " not in ir and "exp" not in ir, (level, ir)
    assert "random_bits" in cli("compile", src, "-O0", "--set", "t=0", "--emit", "ir").stdout


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_an_unwritable_stdout_is_an_error_not_an_internal_one():
    import subprocess
    import sys
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "samplec", "compile", str(EXAMPLES / "llama.smp"), "--emit", "ir"],
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 1 and "cannot write the output" in r.stderr and "internal error" not in r.stderr, r.stderr


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_reader_that_leaves_ends_samplec_with_sigpipes_status(tmp_path, json_flag):
    """`samplec run ... | head -1` on an output far larger than a pipe holds: exit 141 and no message (click's echo
    swallowed the broken pipe and exited 0, so `set -o pipefail` could not see the output cut)."""
    import subprocess
    import sys
    x = np.random.default_rng(0).normal(size=(3000, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    p = subprocess.Popen([sys.executable, "-m", "samplec", "run", str(EXAMPLES / "llama.smp"), "--sampler", "nucleus",
                          "--logits", str(tmp_path / "x.npy"), *json_flag],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(10)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(120) == 141 and not err, (p.returncode, err[-1000:])


def test_compile_to_dev_stdout_writes_the_program_to_the_pipe(tmp_path):
    """-o /dev/stdout (a link to /proc/self/fd/1, here a pipe) is written in place: the bytes go down the pipe."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "samplec", "compile", str(EXAMPLES / "llama.smp"), "-o", "/dev/stdout"],
                       capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout[4:8] == b"SMPB" and f"({len(r.stdout)} bytes".encode() in r.stderr
    (tmp_path / "p.smpb").write_bytes(r.stdout)
    assert cli("inspect", tmp_path / "p.smpb").exit_code == 0


def test_dev_stdout_appended_to_a_log_is_appended(tmp_path):
    """`-o /dev/stdout >> log`: the shell's descriptor is written as it is (its append mode kept), never the log
    replaced through /proc/self/fd/1 by a renamed temporary file."""
    import subprocess
    import sys
    log = tmp_path / "log"
    log.write_bytes(b"earlier lines\n")
    with open(log, "ab") as out:
        r = subprocess.run([sys.executable, "-m", "samplec", "compile", str(EXAMPLES / "llama.smp"), "-o",
                            "/dev/stdout"], stdout=out, stderr=subprocess.PIPE, timeout=120)
    assert r.returncode == 0, r.stderr
    data = log.read_bytes()
    assert data.startswith(b"earlier lines\n") and data[len(b"earlier lines\n") + 4:][:4] == b"SMPB"


def test_explain_and_import_refuse_to_overwrite_their_input(tmp_path):
    src = tmp_path / "chain.smp"
    src.write_text(CHAIN)
    for args in (("explain", src, "-o", src), ("compile", src, "--emit", "dot", "-o", src)):
        r = cli(*args)
        assert r.exit_code == 1 and "it is the input file" in r.output, (args, r.output)
        assert src.read_text() == CHAIN
    cfg = tmp_path / "gen.json"
    cfg.write_text('{"do_sample": true, "temperature": 0.7}')
    r = cli("import", "--from", "hf", cfg, "-o", cfg)
    assert r.exit_code == 1 and "it is the input file" in r.output and "0.7" in cfg.read_text()


def test_an_unseeded_draw_says_its_seeds_and_runs_again_with_them(files):
    """`sample()` without a seed draws one a row from the OS: `run` prints them (stderr: --json stays one object),
    and `--seed` with them gives the same tokens and values again; two runs without it draw other seeds."""
    tmp, _, _ = files
    src = tmp / "u.smp"
    src.write_text("sampler u(t: float = 1.0) -> token, logprob {\n    temperature(t)\n    sample()\n}\n")
    first = cli("run", src, "--logits", tmp / "x.npy", "--json")
    assert first.exit_code == 0, first.output
    said = [line for line in first.stderr.splitlines() if line.startswith("seed drawn from the OS: ")]
    assert len(said) == 1, first.stderr
    seeds = said[0].split("--seed ")[1].split()[0]
    assert len(seeds.split(",")) == 3 and all(s.isdigit() for s in seeds.split(","))
    again = cli("run", src, "--logits", tmp / "x.npy", "--json", "--seed", seeds)
    assert again.exit_code == 0 and "seed drawn" not in again.stderr
    assert json.loads(again.stdout) == json.loads(first.stdout)
    other = cli("run", src, "--logits", tmp / "x.npy", "--json")
    assert other.stderr != first.stderr


def test_a_switch_variable_with_another_value_warns_and_reads_as_its_default(monkeypatch):
    """SAMPLEC_NATIVE and the other switches take 1/on/true/yes and 0/off/false/no in any case; anything else warns
    once, naming the variable and the words, and reads as the switch's default (not silently as on)."""
    from samplec.backend_mlx import gpu, native
    from samplec.diagnostics import SamplecWarning
    for value, off in (("OFF", True), (" no ", True), ("0", True), ("Yes", False), ("1", False), ("", False)):
        monkeypatch.setenv("SAMPLEC_NATIVE", value)
        assert native.switched_off("SAMPLEC_NATIVE") is off, value
    monkeypatch.setenv("SAMPLEC_NATIVE", "maybe")
    with pytest.warns(SamplecWarning, match=r"SAMPLEC_NATIVE='maybe' is not a switch value \(1, on, .*read as on"):
        assert not native.switched_off("SAMPLEC_NATIVE")
    monkeypatch.setenv("SAMPLEC_METAL_KERNEL", "2")
    with pytest.warns(SamplecWarning, match="SAMPLEC_METAL_KERNEL='2'.*read as off"):
        assert not gpu._on("SAMPLEC_METAL_KERNEL")
    monkeypatch.setenv("SAMPLEC_METAL_KERNEL", "TRUE")
    assert gpu._on("SAMPLEC_METAL_KERNEL")
