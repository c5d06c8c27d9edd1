"""Fuzz the `.smpb` loader: truncated, bit-flipped and spliced copies of the examples' compiled programs.

Accidents (bytes changed after the seal was written) must be refused with SamplecError, or load as exactly the
program that was saved (same IR text, same tokens). Crafted files (changed bytes, then sealed again) may load as
another program -- someone wrote it -- but must never crash: they load and run in a child process, so that a
crash is counted rather than fatal. Anything else is a traceback; silent: an accident that loads as another program.
"""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import samplec
from samplec import serialize
from fuzz.common import HANG_S, Counts, Deadline

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CHILD_BATCH = 40


def programs() -> list[tuple[str, bytes]]:
    out = []
    for path in sorted(EXAMPLES.glob("*.smp")):
        src = path.read_text(encoding="utf-8")
        for name in re.findall(r"^sampler\s+(\w+)", src, re.M):
            prog = samplec.compile(src, sampler=name)
            out.append((prog.ir(), prog.to_bytes()))
    return out


def damage(data: bytes, rng: random.Random, other: bytes) -> bytes:
    b = bytearray(data)
    r = rng.random()
    if r < 0.3:
        return bytes(b[:rng.randrange(len(b))])
    if r < 0.7:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    i, j = rng.randrange(len(b)), rng.randrange(len(other))
    return bytes(b[:i] + other[j:j + rng.randint(1, 64)] + b[i + rng.randint(0, 64):])


_CHILD = r"""
import json, sys, numpy as np, samplec
from samplec import serialize
from samplec.program import Program
x = np.random.default_rng(0).standard_normal((2, 600)).astype(np.float32)
for line in sys.stdin:
    data = bytes.fromhex(line.strip())
    try:
        p = Program(serialize.from_bytes(data))
    except samplec.SamplecError:
        print(json.dumps("rejected"), flush=True); continue
    except Exception as e:
        print(json.dumps(f"traceback: {type(e).__name__}: {e}"[:300]), flush=True); continue
    kw = {}
    for q in p.params:
        if q.kind == "tokens": kw[q.name] = np.array([[1, 2], [3, -1]], np.int32)
        elif q.kind == "bias": kw[q.name] = np.zeros_like(x)
        elif q.kind == "mask": kw[q.name] = np.ones(x.shape, bool)
        elif q.default is None and q.kind != "state": kw[q.name] = 1
    try:
        p(x, **kw)
        print(json.dumps("ok"), flush=True)
    except samplec.SamplecError:
        print(json.dumps("rejected"), flush=True)
    except Exception as e:
        print(json.dumps(f"traceback: {type(e).__name__}: {e}"[:300]), flush=True)
"""


def crafted_batch(files: list[bytes], counts: Counts) -> None:
    """Load and run re-sealed files in a child; a crash there counts for the file it was on."""
    proc = subprocess.run([sys.executable, "-c", _CHILD], input="\n".join(f.hex() for f in files) + "\n",
                          capture_output=True, text=True, timeout=max(60, HANG_S * len(files)))
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    for f, res in zip(files, results):
        counts.record("rejected" if res == "rejected" else "ok" if res == "ok" else "traceback", f[:64], res)
    for f in files[len(results):]:
        counts.record("traceback", f[:64], f"the child process died (status {proc.returncode}): "
                      f"{proc.stderr.strip()[-200:]}")
        break          # (the files after the one that crashed were not tried)


def fuzz(seconds: float, seed: int = 0) -> Counts:
    rng = random.Random(seed)
    progs = programs()
    counts = Counts("smpb")
    deadline = Deadline(seconds)
    pending: list[bytes] = []
    while deadline:
        ir, data = rng.choice(progs)
        bad = damage(data, rng, rng.choice(progs)[1])
        t = time.perf_counter()
        try:
            g = serialize.from_bytes(bad)
            same = serialize.to_bytes(g) == data
            kind, what = ("ok", "") if same else ("silent", "an accident loaded as another program")
        except samplec.SamplecError:
            kind, what = "rejected", ""
        except Exception as e:  # noqa: BLE001
            kind, what = "traceback", f"{type(e).__name__}: {e}"
        if time.perf_counter() - t > HANG_S:
            kind, what = "hang", f"{time.perf_counter() - t:.1f} s"
        counts.record(kind, bad[:64], what)
        if rng.random() < 0.25:            # the same damage, sealed again: a crafted file
            pending.append(serialize.seal(bad[:-serialize.SEAL_SIZE]) if len(bad) > serialize.SEAL_SIZE else bad)
            if len(pending) == CHILD_BATCH:
                crafted_batch(pending, counts)
                pending = []
    if pending:
        crafted_batch(pending, counts)
    return counts
