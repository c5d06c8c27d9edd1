"""What one MLX primitive costs, and how many a compiled -O2 program holds -- the numbers behind docs/performance.md.

    python benchmarks/bench_primitives.py

Not a test. Prints, for the current MLX device:
  * the cost of one more primitive of each kind in a compiled chain of 24 on a [1, 64] array, after subtracting
    an empty compiled call;
  * for each benchmark chain, how many MLX primitives one call of its -O2 program evaluates (`mx.export_to_dot`
    of the compiled outputs), by kind.
"""
from __future__ import annotations

import collections
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import samplec  # noqa: E402
from bench_sampler import CHAINS, make_logits  # noqa: E402

STEPS = 24


def median_us(fn, reps: int = 1500) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def primitive_costs() -> dict[str, float]:
    a = mx.random.normal((1, 64))
    idx = mx.array(np.arange(64, dtype=np.int32)[None, ::-1].copy())
    ops = {
        "sort": lambda x: mx.sort(x, axis=-1),
        "argpartition": lambda x: mx.argpartition(x, kth=10, axis=-1).astype(mx.float32),
        "max + broadcast add": lambda x: x + mx.max(x, axis=-1, keepdims=True),
        "gather (take_along_axis)": lambda x: mx.take_along_axis(x, idx, axis=-1),
        "cumsum": lambda x: mx.cumsum(x, axis=-1),
        "reshape, reshape back": lambda x: x.reshape(64, 1).reshape(1, 64),
        "fused elementwise (exp, mul)": lambda x: mx.exp(x) * 0.5,
    }
    mx.eval(a)
    empty = mx.compile(lambda x: x + 1)
    base = median_us(lambda: mx.eval(empty(a)))
    out = {"(empty compiled call + eval)": base}
    for name, op in ops.items():
        def chain(x, op=op):
            for _ in range(STEPS):
                x = op(x)
            return x
        fn = mx.compile(chain)
        out[name] = (median_us(lambda: mx.eval(fn(a))) - base) / STEPS
    return out


def plan_primitives(chain: str) -> collections.Counter:
    prog = samplec.compile(f"sampler {chain}(seed: seed = 0, pos: int = 0) {{ {CHAINS[chain][1]} }}")
    args = prog.prepare(mx.array(make_logits(1, 152064)), {"seed": 0, "pos": 3})
    outs, flags = prog.exe(*args)
    with tempfile.TemporaryDirectory() as d:
        mx.export_to_dot(str(Path(d) / "g.dot"), *(outs + flags))
        text = (Path(d) / "g.dot").read_text()
    kinds = re.findall(r'label ="?([A-Za-z]+)', text)
    return collections.Counter("Compiled (fused)" if k.startswith("Compiled") else k for k in kinds)


def main() -> None:
    print(f"MLX {mx.__version__} on {mx.default_device()}\n")
    print(f"Cost of one more primitive in a compiled chain of {STEPS} on [1, 64] (median, µs):\n")
    for name, us in primitive_costs().items():
        print(f"  {name:32s} {us:6.2f}")
    print("\nMLX primitives one call of the -O2 program evaluates (V = 152064, B = 1):\n")
    for chain in ("C1", "C2", "C3", "C5", "C6"):
        c = plan_primitives(chain)
        top = ", ".join(f"{k} {n}" for k, n in c.most_common(6))
        print(f"  {chain}: {sum(c.values()):3d}  ({top}, ...)")


if __name__ == "__main__":
    main()
