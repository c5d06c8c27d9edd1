"""`samplec run` against spec §5 as written, checked against tests/reference.py (the spec's own numpy reading):
token histories of any integer dtype, `--seed` and the seeds `sample()` draws from the OS, seed spellings, and
`--draws` keeping standard error clean."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from samplec.cli import app

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference as R  # noqa: E402

runner = CliRunner()

PENALIZED = """sampler pen(h: tokens, seed: seed = 0) -> token, probs {
    penalties(h, repeat = 1.5, presence = 0.5)
    top_k(10)
    sample(seed, position = 3)
}
"""


def cli(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output and "Traceback" not in (result.stderr or "")
    return result


@pytest.fixture
def logits(tmp_path):
    x = np.random.default_rng(11).normal(size=(3, 40)).astype(np.float32) * 2
    np.save(tmp_path / "x.npy", x)
    return tmp_path, x


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int64])
def test_history_of_any_integer_dtype_gives_the_tokens_of_the_spec(logits, dtype):
    """A history .npy written as uint8/uint16/uint32 (what `np.save` of a small-id array often holds) was an internal
    error (exit 3); any integer dtype is the token ids it holds, and the tokens are those of the spec's reading."""
    d, x = logits
    hist = np.array([[1, 2, 3, 3], [30, 30, 30, 30], [5, 6, 7, 8]])
    np.save(d / "h.npy", hist.astype(dtype))
    (d / "pen.smp").write_text(PENALIZED)
    r = cli("run", d / "pen.smp", "--logits", d / "x.npy", "--history", d / "h.npy", "--seed", "9", "--json")
    assert r.exit_code == 0, r.output
    want = [R.run_chain(x[b], [("penalties", dict(history_row=hist[b], repeat=np.float32(1.5),
                                                  presence=np.float32(0.5))), ("top_k", dict(k=10))],
                        ("sample", dict(seed=9, position=3)))["token"] for b in range(3)]
    assert json.loads(r.stdout)["token"] == want


def test_unsigned_history_ids_past_the_vocabulary_are_an_error_naming_the_rows(logits):
    d, _ = logits
    (d / "pen.smp").write_text(PENALIZED)
    np.save(d / "h.npy", np.array([[1, 2], [40, 1], [2**32 - 1, 0]], dtype=np.uint32))
    r = cli("run", d / "pen.smp", "--logits", d / "x.npy", "--history", d / "h.npy")
    assert r.exit_code == 1 and "rows 1, 2" in r.output and "h:" in r.output, r.output
    np.save(d / "h.npy", np.array([[1, 2], [3, 1], [2**64 - 1, 0]], dtype=np.uint64))
    r = cli("run", d / "pen.smp", "--logits", d / "x.npy", "--param", f"h={d / 'h.npy'}")
    assert r.exit_code == 1 and "row 2" in r.output, r.output


@pytest.mark.parametrize("source", [
    "sampler u(t: float = 1.0) -> token, logprob { temperature(t) sample() }",
    "sampler mix(s: seed = 5) -> token, logprob { xtc(0.02, 0.5, s) sample() }",
])
def test_the_os_seed_hint_runs_the_same_draw_again(logits, source):
    """`sample()` without a seed draws from the OS and `run` prints how to run that draw again. Beside another seed
    parameter `--seed` is ambiguous (an error, spec §5), so the hint must name a flag that works."""
    d, _ = logits
    (d / "u.smp").write_text(source)
    first = cli("run", d / "u.smp", "--logits", d / "x.npy", "--json")
    assert first.exit_code == 0, first.output
    said = [line for line in first.stderr.splitlines() if line.startswith("seed drawn from the OS: ")]
    assert len(said) == 1, first.stderr
    flag, value = said[0].split("(", 1)[1].removesuffix(" runs this draw again)").split()
    again = cli("run", d / "u.smp", "--logits", d / "x.npy", "--json", flag, value)
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout) == json.loads(first.stdout) and "seed drawn" not in again.stderr


def test_seed_beside_the_implicit_seed_of_sample_is_an_error_that_says_what_to_pass(logits):
    d, _ = logits
    (d / "u.smp").write_text("sampler mix(s: seed) { xtc(0.02, 0.5, s) sample() }")
    r = cli("run", d / "u.smp", "--logits", d / "x.npy", "--seed", "3")
    assert r.exit_code == 1
    assert "--param s=N" in r.output and "--param _os_seed=N" in r.output and "sample()" in r.output, r.output


def test_seed_and_integer_values_with_leading_zeros_are_decimal(logits):
    """`--seed 007` is seed 7 and `--param pos=010` position 10 (decimal, as every sampler CLI reads them; Python's
    int(text, 0) refused a leading zero); 0x10 stays hexadecimal."""
    d, x = logits
    (d / "s.smp").write_text("sampler s(seed: seed, pos: int = 0) { top_k(20) sample(seed, position = pos) }")
    outs = [cli("run", d / "s.smp", "--logits", d / "x.npy", "--seed", seed, "--param", f"pos={pos}", "--json")
            for seed, pos in (("007", "010"), ("7", "10"), ("0x7", "0xa"))]
    assert all(r.exit_code == 0 for r in outs), [r.output for r in outs]
    want = [R.run_chain(x[b], [("top_k", dict(k=20))], ("sample", dict(seed=7, position=10)))["token"]
            for b in range(3)]
    assert [json.loads(r.stdout)["token"] for r in outs] == [want] * 3
    bound = cli("compile", d / "s.smp", "--set", "seed=007", "--set", "pos=010", "-o", d / "s.smpb")
    assert bound.exit_code == 0, bound.output
    r = cli("run", d / "s.smpb", "--logits", d / "x.npy", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["token"] == want, r.output


def test_draws_in_sequence_leave_standard_error_empty(logits):
    """A stateful sampler draws one step at a time; its progress display must not leave a stray blank line on a
    standard error that is not a terminal (scripts read it for errors)."""
    d, _ = logits
    (d / "m.smp").write_text("sampler m(mu: state, seed: seed) -> token, mu { mirostat_v2(mu, 5.0, 0.1, seed) }")
    r = cli("run", d / "m.smp", "--logits", d / "x.npy", "--seed", "3", "--draws", "4", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["draws"] == 4 and r.stderr == ""


@pytest.mark.parametrize("decl, first", [("seed: seed = 5", 5), ("seed: seed", 0)])
def test_draws_without_seed_start_at_the_default_and_count_the_specs_tokens(logits, decl, first):
    """--draws N uses seeds N0..N0+N-1 (spec §5); without --seed N0 is the parameter's default (0 for a required
    one). The counts are those of the spec's draws at those seeds, beside the exact probabilities."""
    d, x = logits
    (d / "d.smp").write_text(f"sampler d({decl}) {{ top_k(6) temperature(1.5) sample(seed, position = 2) }}")
    r = cli("run", d / "d.smp", "--logits", d / "x.npy", "--draws", "40", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]
    for b in range(3):
        chain = [("top_k", dict(k=6)), ("temperature", dict(t=np.float32(1.5)))]
        toks = [R.run_chain(x[b], chain, ("sample", dict(seed=first + i, position=2)))["token"] for i in range(40)]
        ids, counts = np.unique(toks, return_counts=True)
        got = {t: c for t, c in zip(rows[b]["tokens"], rows[b]["counts"]) if c}
        assert got == dict(zip(ids.tolist(), counts.tolist()))
        probs = R.run_chain(x[b], chain)["probs"]
        np.testing.assert_allclose(rows[b]["probability"], probs[rows[b]["tokens"]], rtol=1e-5)


def test_run_takes_a_compiled_program_by_its_contents_whatever_its_name(logits):
    """A .smpb saved under another name (`prog.bin`) was refused by `run` with "`samplec run` takes it"; run reads a
    compiled program by what the file holds (as inspect does), and gives the tokens of the source."""
    d, _ = logits
    (d / "s.smp").write_text("sampler s(seed: seed = 4) { top_k(9) sample(seed) }")
    assert cli("compile", d / "s.smp", "-o", d / "prog.bin").exit_code == 0
    via_bin = cli("run", d / "prog.bin", "--logits", d / "x.npy", "--json")
    via_src = cli("run", d / "s.smp", "--logits", d / "x.npy", "--json")
    assert via_bin.exit_code == 0, via_bin.output
    assert json.loads(via_bin.stdout) == json.loads(via_src.stdout)
    r = cli("run", d / "prog.bin", "--logits", d / "x.npy", "-O", "1")
    assert r.exit_code == 1 and "compiled program" in r.output


def test_array_files_by_suffix_in_any_case_and_a_broken_npz_says_so(logits):
    """`X.NPY` (a suffix in capitals, as some tools write it) is a .npy file; an .npz whose member is not an array
    is a clear error naming the flag and the file, not MLX's "python stream" message."""
    import zipfile
    d, x = logits
    np.save(d / "x.npy", x)
    (d / "x.npy").rename(d / "X.NPY")
    (d / "g.smp").write_text("sampler g() { greedy() }")
    r = cli("run", d / "g.smp", "--logits", d / "X.NPY", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["token"] == np.argmax(x, axis=-1).tolist(), r.output
    with zipfile.ZipFile(d / "junk.npz", "w") as z:
        z.writestr("logits.npy", b"not an array")
    r = cli("run", d / "g.smp", "--logits", d / "junk.npz")
    assert r.exit_code == 1 and "--logits" in r.output and "junk.npz" in r.output
    assert "python stream" not in r.output and ".npy" in r.output, r.output
