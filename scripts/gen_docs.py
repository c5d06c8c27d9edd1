#!/usr/bin/env python3
"""Fill the generated blocks of the docs from the files they show, so that no figure or example can go stale.

    python scripts/gen_docs.py            # rewrite every generated block in docs/*.md
    python scripts/gen_docs.py --check    # exit 1 (and print a diff) where a block differs from its source

A generated block is everything between a marker line and `<!-- end generated -->`:

    <!-- generated: bench_real (scripts/gen_docs.py; edit the source, not this block) -->
    ...
    <!-- end generated -->

Its name says what fills it: a table from a benchmark's or the fuzzers' JSON record in docs/ (`TABLES` below),
or `golden NAME`: the source and the exact IR of the golden test tests/golden/ir/NAME.{smp,ir}.
tests/test_docs.py runs `--check`'s comparison, so a new record or a re-blessed golden file fails the tests until
the docs are regenerated.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GOLDEN_IR = ROOT / "tests" / "golden" / "ir"
BLOCK = re.compile(r"(<!-- generated: (?P<name>[^()>]+?) \([^)]*\) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)
MARK = "(scripts/gen_docs.py; edit the source, not this block)"


def _load(name: str):
    path = DOCS / name
    if not path.is_file():
        raise SystemExit(f"docs/{name}: no such record (the command that writes it is beside its table)")
    return json.loads(path.read_text())


def _ms(v: float) -> str:
    return f"{v:.3f}"


def _x(v: float) -> str:
    return f"{v:.1f}×"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _peers(rows: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in rows:
        seen += [p for p in r["ratio"] if p not in seen]
    return seen


def real_chains(name: str) -> str:
    """benchmarks/bench_real.py's record: per logits family, batch size and chain, samplec's time with the
    example's outputs and token only, and each peer's time over samplec's (full; token only)."""
    rows = _load(name)
    peers = _peers(rows)
    out = []
    for r in rows:
        ours = [v for k, v in r["ms"].items() if k.startswith("samplec")]     # (at B > 1: "samplec -O2 rows")
        cells = [f"{_x(r['ratio'][p])} / {_x(r['ratio_token'][p])}" if p in r["ratio"] else "" for p in peers]
        out.append([r["family"], str(r["B"]), r["chain"], f"{_ms(ours[0])} / {_ms(ours[1])}", *cells])
    return _table(["logits", "B", "chain", "samplec ms: outputs / token only", *peers], out)


def real_summary(name: str) -> str:
    """One line per peer and batch size: the range of the peer's time over samplec's across the chains it runs."""
    rows = _load(name)
    lines = []
    for p in _peers(rows):
        for b in sorted({r["B"] for r in rows}):
            rs = [r for r in rows if r["B"] == b and p in r["ratio"]]
            if rs:
                full = [r["ratio"][p] for r in rs]
                tok = [r["ratio_token"][p] for r in rs]
                lines.append(f"- {p} ÷ samplec at B = {b} ({len(rs)} chain rows): {_x(min(full))}–{_x(max(full))} "
                             f"with samplec's outputs, {_x(min(tok))}–{_x(max(tok))} token only")
    return "\n".join(lines) + "\n"


def cliffs(name: str) -> str:
    """bench_real.py --cliff: each chain with its outputs at B = 1 on every logits family, ms and the ratio to the
    same chain on `confident` logits."""
    rows = _load(name)
    fams = list(rows[0]["ms"])
    out = []
    for r in rows:
        base = r["ms"][fams[0]]
        out.append([r["chain"], _ms(base)] + [f"{_ms(r['ms'][f])} ({_x(r['ms'][f] / base)})" for f in fams[1:]])
    return _table(["chain", f"{fams[0]} ms", *[f"{f} ms (÷ {fams[0]})" for f in fams[1:]]], out)


def _sampler_chains() -> dict:
    """benchmarks/bench_sampler.py's CHAINS, read from its source (importing it needs the peers)."""
    tree = ast.parse((ROOT / "benchmarks" / "bench_sampler.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CHAINS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit("benchmarks/bench_sampler.py: no CHAINS table")


def c_chains(name: str) -> str:
    """bench_sampler.py's record: C1-C7 with literal parameters, samplec -O2's time and each other system's time
    over it."""
    rec = _load(name)
    chains = _sampler_chains()
    peers = [p for p in rec["rows"][0]["ms"] if p != "samplec -O2"]
    out = [[f"{r['chain']} {chains[r['chain']][0]}", str(r["V"]), str(r["B"]), _ms(r["ms"]["samplec -O2"]),
            *[_x(r["ratio"][p]) if p in r["ratio"] else "" for p in peers]] for r in rec["rows"]]
    return _table(["chain", "V", "B", "samplec -O2 ms", *[f"{p} (÷ -O2)" for p in peers]], out)


def c_chains_by_size(name: str) -> str:
    """bench_sampler.py's full record, one line per (V, B): llama.cpp's time over samplec -O2's for each chain."""
    rec = _load(name)
    sizes = sorted({(r["V"], r["B"]) for r in rec["rows"]})
    chains = sorted({r["chain"] for r in rec["rows"]})
    cell = {(r["V"], r["B"], r["chain"]): r for r in rec["rows"]}
    out = []
    for v, b in sizes:
        row = [str(v), str(b)]
        for c in chains:
            r = cell.get((v, b, c))
            row.append(_x(r["ratio"]["llama.cpp"]) if r and "llama.cpp" in r["ratio"] else "")
        out.append(row)
    return _table(["V", "B", *chains], out)


def floors(name: str) -> str:
    """bench_sampler.py's primitive floors: one evaluation of nothing, and MLX's own reductions over the row."""
    rec = _load(name)
    keys = [k for k in rec["floors"][0] if k not in ("V", "B")]
    return _table(["V", "B", *keys], [[str(f["V"]), str(f["B"]), *[_ms(f[k]) for k in keys]] for f in rec["floors"]])


def compile_load(name: str) -> str:
    rec = _load(name)
    return _table(["example", "compile ms", "load .smpb ms"],
                  [[ex, f"{v['compile_ms']:.1f}", f"{v['load_ms']:.2f}"] for ex, v in rec["compile_load"].items()])


def fuzz_runs(name: str) -> str:
    """scripts/fuzz_record.py's record: each target's run and what became of its cases."""
    rec = _load(name)
    out = [[f"`{r['target']}`", f"`{r['command']}`", f"{r['cases']:,}", f"{r['rejected']:,}", str(r["tracebacks"]),
            str(r["hangs"]), str(r["silent"])] for r in rec["runs"]]
    return _table(["target", "command", "cases", "refused with samplec's error", "tracebacks", "hangs", "silent"], out)


def fuzz_silent(name: str) -> str:
    """The cases a fuzz run counted as silent, as the target described them (none: a line saying so)."""
    rec = _load(name)
    code = lambda text: "`" + text.replace("`", "'") + "`"
    lines = [f"- `{r['target']}`: {code(e['case'])} -> {e['what']}" for r in rec["runs"] for e in r["examples"]
             if e["kind"] == "silent"]
    return "\n".join(lines) + "\n" if lines else "No case ended silent.\n"


def targets(name: str) -> str:
    """benchmarks/bench_targets.py's record: per example and batch size, each target's launches (primitives that are
    not views), the host's queue time and the call's time; then the portable target against mlx-lm's sampler."""
    rec = _load(name)
    names = [k for k in rec["rows"][0] if k not in ("example", "B")] if rec["rows"] else []
    # (the portable target: launches and queue time as a GPU lowers and runs it, queue and call as this CPU does)
    two = {t for t in names if "cpu_queue_us" in rec["rows"][0][t]}

    def cols(t: str) -> list[str]:
        if t in two:
            return [f"{t} (GPU): launches", f"{t} (GPU): queue µs", f"{t} on this CPU: queue µs",
                    f"{t} on this CPU: call ms"]
        return [f"{t}: {what}" for what in ("launches", "queue µs", "call ms")]

    def queue(got: dict, key: str) -> str:
        # (the least-disturbed round's median, and the median round's where the record has it: bench_targets'
        # settled_queue_us)
        typical = got.get(key.replace("_us", "_median_round_us"))
        return f"{got[key]:.0f}" + (f" ({typical:.0f})" if typical is not None else "")

    def cells(got: dict) -> list[str]:
        return [str(got["launches"]), queue(got, "queue_us")] + \
            ([queue(got, "cpu_queue_us")] if "cpu_queue_us" in got else []) + [_ms(got["call_ms"])]
    header = ["example", "B"] + [c for t in names for c in cols(t)]
    rows = [[r["example"], str(r["B"])] + [c for t in names for c in cells(r[t])] for r in rec["rows"]]
    out = f"{rec['device']}, MLX {rec['mlx']}\n\n" + _table(header, rows)
    if rec.get("mlx_lm"):
        host = all("queue_ratio" in r for r in rec["mlx_lm"])
        out += "\n\n" + _table(["B", "mlx-lm's sampler ms", "samplec portable ms", "mlx-lm ÷ samplec",
                                 "portable as a GPU lowers it ms", "mlx-lm ÷ that"] +
                                (["host queue µs: mlx-lm", "host queue µs: portable (GPU)", "mlx-lm ÷ that"]
                                 if host else []),
                                [[str(r["B"]), _ms(r["mlx_lm_ms"]), _ms(r["samplec_portable_ms"]), _x(r["ratio"]),
                                  _ms(r["gpu_form_ms"]), _x(r["gpu_form_ratio"])] +
                                 ([f"{r['mlx_lm_queue_us']:.0f}", f"{r['gpu_form_queue_us']:.0f}",
                                   _x(r["queue_ratio"])] if host else []) for r in rec["mlx_lm"]])
    return out


def gpu_record(name: str) -> str:
    """scripts/gpu_run.sh's record on a lent GPU: each real chain's call (token only, chat logits) at each batch size,
    its time over one `mx.max` of the same logits and the peers' time over samplec's; then where a call's time goes
    (synchronous, queued, the host's queueing); then the portable target against mlx-lm's sampler."""
    rec = _load(name)
    batches = sorted({r["B"] for r in rec["issue"]})
    chains = list(dict.fromkeys(r["chain"] for r in rec["issue"]))
    by = {(r["chain"], r["B"]): r["ms"] for r in rec["issue"]}

    def cell(ms: dict | None) -> str:
        if ms is None:
            return ""
        peers = "".join(f"; {k} {_x(v / ms['samplec'])}" for k, v in ms.items() if k not in ("samplec", "mx.max"))
        return f"{_ms(ms['samplec'])} ({ms['samplec'] / ms['mx.max']:.0f}× mx.max{peers})"
    out = f"{rec['device']}.\n\n`{rec['commands']['issue']}` (chat logits, token only; ms a call, peer ÷ samplec):\n\n"
    out += _table(["chain", *[f"B = {b}" for b in batches]], [[c, *[cell(by.get((c, b))) for b in batches]]
                                                               for c in chains])
    out += f"\n`{rec['commands']['calls']}` (ms a call: synchronous / eight queued, per call / the host's queueing " \
           "alone):\n\n"
    out += _table(["B", "chain", "synchronous", "queued", "host"],
                  [[str(r["B"]), r["chain"], _ms(r["ms"]), _ms(r["queued_ms"]), _ms(r["host_ms"])] for r in rec["calls"]])
    out += "\nThe portable target (MLX ops alone) against mlx-lm's sampler on its chain, one call a row for mlx-lm:\n\n"
    out += _table(["B", "mlx-lm's sampler ms", "samplec portable ms", "mlx-lm ÷ samplec"],
                  [[str(r["B"]), _ms(r["mlx_lm_ms"]), _ms(r["samplec_portable_ms"]), _x(r["ratio"])]
                   for r in rec["mlx_lm_portable"]])
    return out


def machine(name: str) -> str:
    rec = _load(name)
    return f"Machine: {rec['machine']}.\n"


TABLES = {
    "bench_real": (real_chains, "bench_real.json"),
    "bench_targets": (targets, "bench_targets.json"),
    "bench_real_summary": (real_summary, "bench_real.json"),
    "bench_gpu_h200": (gpu_record, "bench_gpu_h200.json"),
    "bench_real_cliff": (cliffs, "bench_real.cliff.json"),
    "bench_quick": (c_chains, "bench_quick.json"),
    "bench_quick_machine": (machine, "bench_quick.json"),
    "bench_quick_floors": (floors, "bench_quick.json"),
    "bench_quick_compile": (compile_load, "bench_quick.json"),
    "bench_full_llama_cpp": (c_chains_by_size, "bench_full.json"),
    "bench_full_machine": (machine, "bench_full.json"),
    "fuzz": (fuzz_runs, "fuzz.json"),
    "fuzz_machine": (machine, "fuzz.json"),
    "fuzz_silent": (fuzz_silent, "fuzz.json"),
}


def golden(case: str) -> str:
    """A golden IR case: its source (without the test's `#` lines) and the IR the compiler prints for it."""
    src = (GOLDEN_IR / f"{case}.smp").read_text()
    directive = {ln.split(":", 1)[0]: ln.split(":", 1)[1].split() for ln in src.splitlines()
                 if ln.startswith(("# RUN:", "# SET:"))}
    run, binds = directive.get("# RUN", []), directive.get("# SET", [])
    body = "".join(ln for ln in src.splitlines(True) if not ln.startswith("#"))
    ir = (GOLDEN_IR / f"{case}.ir").read_text()
    sets = "".join(f" --set {b}" for b in binds)
    how = {("lower",): f"`samplec compile FILE{sets} --emit ir-unopt` (the lowering, before any pass) prints",
           ("O2",): f"`samplec compile FILE{sets} --emit ir` (-O2, the default) prints"}.get(
        tuple(run), (f"With `{sets.strip()}`, the" if binds else "The") + f" passes `{' '.join(run)}` give")
    return f"```\n{body.rstrip()}\n```\n\n{how} (`tests/golden/ir/{case}.ir`):\n\n```\n{ir.rstrip()}\n```\n"


def render(name: str) -> str:
    if name.startswith("golden "):
        return golden(name.split(None, 1)[1])
    if name not in TABLES:
        raise SystemExit(f"unknown generated block {name!r} (known: {', '.join(TABLES)}, golden CASE)")
    fn, src = TABLES[name]
    return fn(src)


def regenerate(text: str) -> str:
    return BLOCK.sub(lambda m: f"<!-- generated: {m['name']} {MARK} -->\n{render(m['name'])}{m.group(4)}", text)


def blocks(path: Path) -> list[str]:
    return [m["name"] for m in BLOCK.finditer(path.read_text())]


def stale() -> dict[str, str]:
    """{doc path: unified diff} for every doc whose generated blocks differ from what their sources give."""
    out = {}
    for doc in sorted(DOCS.glob("*.md")):
        old = doc.read_text()
        new = regenerate(old)
        if new != old:
            rel = str(doc.relative_to(ROOT))
            out[rel] = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), rel, rel + " (generated)"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 where a block differs; write nothing")
    args = ap.parse_args(argv)
    diffs = stale()
    if args.check:
        for d in diffs.values():
            sys.stdout.write(d)
        if diffs:
            print(f"stale generated blocks in {', '.join(diffs)}: run python scripts/gen_docs.py")
        return 1 if diffs else 0
    for rel in diffs:
        path = ROOT / rel
        path.write_text(regenerate(path.read_text()))
        print(f"rewrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
