"""Golden-file comparison shared by the golden tests (diagnostics, IR, ...).

`assert_golden(path, actual)` compares text with the file at `path`; on a mismatch it fails with a unified diff.
Re-bless with `SAMPLEC_UPDATE_GOLDENS=1 pytest ...`, which rewrites the files instead of comparing. Nothing is
blessed in CI: with `CI` set, update mode fails the test.
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

UPDATE_ENV = "SAMPLEC_UPDATE_GOLDENS"


def updating() -> bool:
    return os.environ.get(UPDATE_ENV, "") not in ("", "0")


def assert_golden(path: Path, actual: str) -> None:
    """Compare `actual` (a trailing newline is added if missing) with the golden file at `path`."""
    path = Path(path)
    if not actual.endswith("\n"):
        actual += "\n"
    rebless = f"re-bless with: {UPDATE_ENV}=1 python -m pytest {_test_hint()}"
    if updating():
        if os.environ.get("CI"):
            pytest.fail(f"{UPDATE_ENV} is set but so is CI: golden files are never updated in CI")
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text(encoding="utf-8") != actual:
            path.write_text(actual, encoding="utf-8")
        return
    if not path.exists():
        pytest.fail(f"missing golden file {path}\n{rebless}", pytrace=False)
    expected = path.read_text(encoding="utf-8")
    if expected != actual:
        diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True), actual.splitlines(keepends=True),
                                            fromfile=f"{path} (expected)", tofile="actual"))
        pytest.fail(f"output differs from golden file {path}:\n{diff}\n{rebless}", pytrace=False)


def _test_hint() -> str:
    """The test file being run, for the re-bless command line."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    return current.split("::")[0] if current else "tests/"
