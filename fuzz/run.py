"""Run samplec's fuzzers for as long as you like and print what became of every case.

    python -m fuzz.run --seconds 60                      # every target, 60 s each
    python -m fuzz.run --seconds 600 --target smpb --seed 3

Each target is a module of this package with `fuzz(seconds: float, seed: int) -> common.Counts`. Exit status 1
when any case ended as a traceback, a hang or silent garbage. The short budget the tests run lives in
tests/test_fuzz.py; docs/reliability.md records long runs.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

TARGETS = ("source", "smpb", "runtime", "server", "differential")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fuzz.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="time per target")
    ap.add_argument("--target", action="append", choices=TARGETS, help="one target (repeatable); default all")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import warnings
    from samplec.diagnostics import SamplecWarning
    warnings.filterwarnings("ignore", category=SamplecWarning)   # (generated sources leave parameters unused)
    bad = 0
    for name in args.target or TARGETS:
        try:
            mod = importlib.import_module(f"fuzz.{name}")
        except ModuleNotFoundError as e:
            print(f"{name:<12} unavailable ({e})")
            continue
        counts = mod.fuzz(args.seconds, args.seed)
        print(counts.line(), flush=True)
        for kind, case, what in counts.examples:
            print(f"    {kind}: {case}\n      -> {what}")
        bad += counts.failures
    return 1 if bad else 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # (without teardown: the server target leaves mlx-lm's handler threads of hung-up clients parked on their
    # queues, and tearing MLX down under them at exit aborts the process after the counts are printed)
    os._exit(status)
