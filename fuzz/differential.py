"""Differential fuzzing: random chains in random orders, literal / scalar / per-row parameters, logit families
(peaked, flat, ties, -inf heavy, long tails, one finite, tiny V), allow masks and biases before or after the
penalties: -O2 must give -O0's token on every row, and so
must -O1 on the MLX-ops path a GPU runs (SAMPLEC_NATIVE=0: sort-free selections), and the numpy reference's
(tests/reference.py). 'silent' counts rows where they differ; a row whose reference decision
lies within float rounding of a boundary still counts (the report's examples show them)."""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np

import samplec
from fuzz.common import Counts, Deadline

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import reference as R  # noqa: E402
from test_differential import EDITS, FAMILIES, ORDER_STAGES, allow_top, build, family_row  # noqa: E402


def fuzz(seconds: float, seed: int = 0) -> Counts:
    pick = random.Random(seed)
    counts = Counts("differential")
    deadline = Deadline(seconds)
    while deadline:
        rng = np.random.default_rng(pick.randrange(2**32))
        V = pick.choice([1, 2, 7, 100, 1000, 5000, 40000, 152064])   # (152064: the kernels split long rows)
        B = pick.randint(1, 4)
        stages = [pick.choice(ORDER_STAGES) for _ in range(pick.randint(0, 4))]
        modes = [pick.choice(["literal", "scalar", "rows"]) for _ in stages]
        terminal = pick.choice(["sample", "greedy"])
        edits = [(pick.choice(EDITS), pick.random() < 0.5) for _ in range(pick.choice([0, 0, 1, 2, 3]))]
        split = pick.randint(0, len(stages)) if pick.random() < 0.5 else 0     # (penalties and edits after cuts)
        src, kw, per_row = build(V, B, stages, modes, terminal, pick.random() < 0.5, rng, pick.random() < 0.3,
                                 edits, split)
        kinds = [pick.choice(FAMILIES) for _ in range(B)]
        x = np.stack([family_row(k, V, rng) for k in kinds])
        allow_top(kw, x)
        def tokens(opt):
            try:
                return np.array(samplec.compile(src, opt_level=opt)(x, **kw).token).tolist()
            except samplec.SamplecError as e:     # (a mask after an xtc that removed all it allows: an error)
                return str(e)

        try:
            t2, t0 = tokens(2), tokens(0)
            before, os.environ["SAMPLEC_NATIVE"] = os.environ.get("SAMPLEC_NATIVE"), "0"
            try:
                t1 = tokens(1)
            finally:
                os.environ.pop("SAMPLEC_NATIVE") if before is None else os.environ.update(SAMPLEC_NATIVE=before)
        except Exception as e:  # noqa: BLE001
            counts.record("traceback", src, f"{type(e).__name__}: {e}")
            continue
        if any(isinstance(t, str) for t in (t0, t1, t2)):
            ok = t0 == t1 == t2
            counts.record("ok" if ok else "silent", (src, kinds, V), "" if ok else f"-O2 {t2}, -O0 {t0}, -O1 {t1}")
            continue
        for r in range(B):
            term = ("sample", {"seed": kw["seed"][r], "position": kw["pos"][r]}) if terminal == "sample" else \
                ("greedy", {})
            ref = R.run_chain(x[r], per_row[r], term, row=r)["token"]
            ok = t2[r] == t0[r] == t1[r] == ref
            counts.record("ok" if ok else "silent", (src, kinds[r], V),
                          "" if ok else f"row {r}: -O2 {t2[r]}, -O0 {t0[r]}, -O1 MLX ops {t1[r]}, reference {ref}")
    return counts
