"""Golden tests of rendered diagnostics: each tests/golden/diagnostics/NAME.smp shows one behaviour, and NAME.txt
holds every diagnostic the frontend prints for it (errors and warnings, `Diagnostic.render` joined by newlines).

Re-bless after an intended change: SAMPLEC_UPDATE_GOLDENS=1 python -m pytest tests/test_golden_diagnostics.py
"""
from __future__ import annotations

from pathlib import Path

import pytest

from goldens import UPDATE_ENV, assert_golden
from samplec.diagnostics import SamplecError
from samplec.frontend.check import check_module
from samplec.frontend.parser import parse

CASES = sorted((Path(__file__).parent / "golden" / "diagnostics").glob("*.smp"))


def render_diagnostics(path: Path) -> str:
    source = path.read_text(encoding="utf-8")
    try:
        module = parse(source, filename=path.name)
    except SamplecError as e:
        diagnostics = e.diagnostics
    else:
        diagnostics = check_module(module)
    return "\n".join(d.render(source) for d in diagnostics)


def test_there_are_enough_cases():
    assert len(CASES) >= 12


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_diagnostics_golden(path: Path):
    actual = render_diagnostics(path)
    assert actual, f"{path.name} should produce at least one diagnostic"
    assert_golden(path.with_suffix(".txt"), actual)


# ---- the golden comparison itself -----------------------------------------------------------------------------

def test_mismatch_shows_diff_and_how_to_rebless(tmp_path, monkeypatch):
    monkeypatch.delenv(UPDATE_ENV, raising=False)
    golden = tmp_path / "case.txt"
    golden.write_text("line one\nline two\n")
    with pytest.raises(pytest.fail.Exception) as info:
        assert_golden(golden, "line one\nline 2\n")
    message = str(info.value)
    assert "-line two" in message and "+line 2" in message
    assert f"{UPDATE_ENV}=1" in message


def test_missing_golden_fails(tmp_path, monkeypatch):
    monkeypatch.delenv(UPDATE_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception, match="missing golden"):
        assert_golden(tmp_path / "nope.txt", "x")


def test_match_passes_and_trailing_newline_is_implied(tmp_path, monkeypatch):
    monkeypatch.delenv(UPDATE_ENV, raising=False)
    golden = tmp_path / "case.txt"
    golden.write_text("same\n")
    assert_golden(golden, "same")


def test_update_mode_writes(tmp_path, monkeypatch):
    monkeypatch.setenv(UPDATE_ENV, "1")
    monkeypatch.delenv("CI", raising=False)
    golden = tmp_path / "sub" / "case.txt"
    assert_golden(golden, "new text")
    assert golden.read_text() == "new text\n"


def test_update_mode_refuses_in_ci(tmp_path, monkeypatch):
    monkeypatch.setenv(UPDATE_ENV, "1")
    monkeypatch.setenv("CI", "true")
    golden = tmp_path / "case.txt"
    golden.write_text("old\n")
    with pytest.raises(pytest.fail.Exception, match="never updated in CI"):
        assert_golden(golden, "new")
    assert golden.read_text() == "old\n"
