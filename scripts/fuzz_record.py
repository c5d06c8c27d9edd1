#!/usr/bin/env python3
"""Run the fuzzers (fuzz/) one target at a time and record what became of their cases in docs/fuzz.json, the
record docs/reliability.md's tables are generated from (scripts/gen_docs.py).

    python scripts/fuzz_record.py --seconds 60 --seed 1          # every target, 60 s each
    python scripts/fuzz_record.py --seconds 120 --target differential --seed 7   # rerun one row of the record
    python scripts/gen_docs.py                                    # then refresh the docs' tables

Each target's row gives the `python -m fuzz.run` command that repeats it. A target that cannot run here (its
libraries missing) is left out of the record and says so. Exit status 1 when any case ended as a traceback, a
hang or silent garbage (the record is written either way).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fuzz.run import TARGETS  # noqa: E402


def machine() -> str:
    import mlx.core as mx

    from samplec.backend_mlx import native
    return (f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"MLX {mx.__version__} ({mx.default_device()}), samplec-native "
            f"{'on' if native.enabled() else 'off'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="time per target")
    ap.add_argument("--target", action="append", choices=TARGETS, help="one target (repeatable); default all")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "fuzz.json")
    args = ap.parse_args(argv)
    from samplec.diagnostics import SamplecWarning
    warnings.filterwarnings("ignore", category=SamplecWarning)   # (generated sources leave parameters unused)
    runs, bad = [], 0
    for name in args.target or TARGETS:
        try:
            mod = importlib.import_module(f"fuzz.{name}")
        except ModuleNotFoundError as e:
            print(f"{name:<12} unavailable ({e}): not recorded")
            continue
        counts = mod.fuzz(args.seconds, args.seed)
        print(counts.line(), flush=True)
        bad += counts.failures
        seconds = f"{args.seconds:g}"
        runs.append({"target": name, "seconds": args.seconds, "seed": args.seed,
                     "command": f"python -m fuzz.run --target {name} --seconds {seconds} --seed {args.seed}",
                     "cases": counts.cases, "ok": counts.ok, "rejected": counts.rejected,
                     "tracebacks": counts.tracebacks, "hangs": counts.hangs, "silent": counts.silent,
                     "examples": [{"kind": k, "case": c, "what": w} for k, c, w in counts.examples]})
    if args.target and args.out.is_file():       # (one target rerun: the record's other rows stay)
        done = {r["target"] for r in runs}
        kept = [r for r in json.loads(args.out.read_text())["runs"] if r["target"] not in done]
        runs = sorted(kept + runs, key=lambda r: TARGETS.index(r["target"]))
    args.out.write_text(json.dumps({"machine": machine(), "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    # (as fuzz.run: the server target leaves mlx-lm's handler threads of hung-up clients parked; no teardown)
    os._exit(status)
