"""Run under `mlx.launch -n N`: every program of cases.py (on every kind of row with the argument `all`, else on
one kind per program, in turn), the rank's slice through
`samplec.distributed.shard` against the unsharded program on the whole row. Writes OUT/rank<r>.json:
{"rank", "size", "cases", "mismatches"}."""
from __future__ import annotations

import json
import os
import sys
import warnings

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

import samplec  # noqa: E402
from samplec.distributed import shard  # noqa: E402
from cases import PROGRAMS, bounds, compare, params_for, rows  # noqa: E402


def main(out_dir: str, every_kind: bool) -> None:
    mx.disable_compile()        # (many distinct programs: MLX's compile of each would dominate the run)
    warnings.simplefilter("ignore", samplec.SamplecWarning)
    group = mx.distributed.init()
    rank, n = group.rank(), group.size()
    B, V = 4, 257
    cut = bounds(n, V)
    lo, hi = cut[rank], cut[rank + 1]
    cases, bad = 0, []
    for j, (name, src) in enumerate(PROGRAMS.items()):
        prog = samplec.compile(src)
        sharded = shard(prog, group, timeout=60, whole_rows=name == "probs_whole")
        for i, kind in enumerate(("normal", "ties", "sparse")):
            if not every_kind and i != j % 3:       # (one kind of row per program, in turn)
                continue
            rng = np.random.default_rng(1000 * i + len(name))
            x = rows(kind, rng, B, V)
            params = params_for(name, rng, B, V)
            try:
                want = prog(x, **params)
            except samplec.SamplecError as e:
                want = e
            mine = {k: (v[:, lo:hi] if k in ("b", "mask") and rank % 2 else v) for k, v in params.items()}
            try:
                got = sharded(x[:, lo:hi], vocab_start=lo, vocab_size=V, **mine)
            except samplec.SamplecError as e:
                got = e
            cases += 1
            if isinstance(want, Exception) or isinstance(got, Exception):
                if str(want) != str(got):
                    bad.append(f"{name}/{kind}: {want!r} vs {got!r}")
                continue
            bad += [f"{kind}: {b}" for b in compare(name, want, got, None if sharded.whole_rows else (lo, hi))]
    # a longer vocabulary, cut unevenly: slices of different lengths must still run the same collectives (a
    # selection's rounds, its candidates) on every rank; flat rows leave the candidates short of the answer
    V = 3001
    cuts = {1: [0, V], 2: [0, 900, V], 3: [0, 700, 2000, V]}.get(n) or [V * r // n for r in range(n + 1)]
    lo, hi = cuts[rank], cuts[rank + 1]
    for name in ("top_p", "top_k", "typical_p", "mirostat"):
        prog = samplec.compile(PROGRAMS[name])
        rng = np.random.default_rng(7)
        x = (rng.standard_normal((B, V)) * np.array([[0.2], [1.0], [4.0], [0.5]])).astype(np.float32)
        params = params_for(name, rng, B, V)
        want = prog(x, **params)
        got = shard(prog, group, timeout=60)(x[:, lo:hi], vocab_start=lo, vocab_size=V, **params)
        cases += 1
        bad += [f"V={V}: {b}" for b in compare(name, want, got)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "size": n, "cases": cases, "mismatches": bad}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["all"])
