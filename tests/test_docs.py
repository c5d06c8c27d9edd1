"""The docs' generated blocks (tables of figures from the benchmarks' and fuzzers' JSON records, IR examples from
the golden files) are what scripts/gen_docs.py makes of their sources today, so no figure or example in the docs
can go stale."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
gen_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_docs)


def test_generated_blocks_match_their_sources():
    stale = gen_docs.stale()
    assert not stale, ("generated blocks differ from their sources -- run `python scripts/gen_docs.py`:\n" +
                       "\n".join(stale.values()))


def test_the_docs_keep_their_generated_blocks():
    """The figures and examples stay generated: removing a block's markers (and pasting its text) fails here."""
    want = {"performance.md": {"bench_real", "bench_real_cliff", "bench_quick", "bench_gpu_h200"},
            "reliability.md": {"fuzz"},
            "compiler.md": {"golden o2_llama"}}
    for doc, names in want.items():
        assert names <= set(gen_docs.blocks(ROOT / "docs" / doc)), doc


def test_a_changed_record_changes_the_table(tmp_path, monkeypatch):
    """The check compares against the record's current content (not a copy made when the docs were written)."""
    rec = gen_docs._load("bench_real.cliff.json")
    rec[0]["ms"]["chat"] *= 3
    (tmp_path / "bench_real.cliff.json").write_text(json.dumps(rec))
    before = gen_docs.render("bench_real_cliff")
    monkeypatch.setattr(gen_docs, "DOCS", tmp_path)
    assert gen_docs.render("bench_real_cliff") != before
