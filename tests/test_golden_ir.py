"""Golden IR: each tests/golden/ir/CASE.smp holds one behaviour; CASE.ir is the exact IR after its `# RUN:` passes.

`# RUN: lower` is the IR straight from lowering; `# RUN: O2` is the whole -O2 pipeline; otherwise the named passes
run in order. `# SET: name=value ...` binds parameters as `samplec compile --set` does. The verifier runs after
every pass, and every printed IR must parse back to the same text.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from samplec.api import lower_source
from samplec.ir.parser import parse as parse_ir
from samplec.ir.printer import print_graph
from samplec.passes import PIPELINES, run_pipeline

try:
    from .goldens import assert_golden
except ImportError:  # pragma: no cover - tests run without a package
    from goldens import assert_golden

CASES = sorted((Path(__file__).parent / "golden" / "ir").glob("*.smp"))


def _directives(source: str) -> tuple[list[str], dict]:
    run, binds = [], {}
    for line in source.splitlines():
        if line.startswith("# RUN:"):
            run = line.split(":", 1)[1].split()
        elif line.startswith("# SET:"):
            binds = dict(item.split("=") for item in line.split(":", 1)[1].split())
    return run, binds


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_golden_ir(case: Path):
    source = case.read_text()
    run, binds = _directives(source)
    graph, _ = lower_source(source, bindings=binds, filename=case.name)
    if run == ["O2"]:
        graph = run_pipeline(graph, passes=PIPELINES[2])
    elif run != ["lower"]:
        graph = run_pipeline(graph, passes=tuple(run))
    text = print_graph(graph)
    assert print_graph(parse_ir(text)) == text, "the printed IR does not round-trip"
    assert_golden(case.with_suffix(".ir"), text)


def test_temperature_zero_has_no_randomness():
    text = (Path(__file__).parent / "golden" / "ir" / "temperature_zero.ir").read_text()
    assert "random_bits" not in text and "sort" not in text


def test_off_values_leave_plain_softmax():
    text = (Path(__file__).parent / "golden" / "ir" / "off_values.ir").read_text()
    for op in ("sort", "filter", "random_bits", "scatter_add", "kth_largest"):
        assert op not in text
