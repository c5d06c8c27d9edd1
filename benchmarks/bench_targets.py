"""Targets: what one call of each shipped example costs on each target -- kernel launches, the host's time to queue
it, and the call's time -- and the portable target against mlx-lm's sampler on mlx-lm's own chain.

    python benchmarks/bench_targets.py --quick                    # this machine (MLX's CPU): a minute or two
    python benchmarks/bench_targets.py --out docs/bench_targets   # writes .md and .json

Recipe: V = 152064 (Qwen's vocabulary); chat-shaped logits (a Zipf head carrying most of the mass, a tail carrying
1-30% spread over the vocabulary, ids shuffled: benchmarks/bench_real.py's `chat_logits`); every parameter passed
at run time as one value per row (a server's call), a 64-token history, per-row seeds and positions.
- launches: the primitives of one call's lazy outputs that are not views (samplec.backend_mlx.launches); the portable
  target is lowered and traced as a GPU runs it (one sort a chain, its sums one reduction each, RandomBits in MLX ops
  rather than the native CPU primitive), so its counts are a GPU's; on a GPU each is a launch;
- queue: the host's time for `Program.queue` (argument checks and the lazy graph, nothing evaluated): median us --
  for the portable target both the GPU's program (as a GPU lowers it) and this CPU's (candidates where a chain
  allows: samplec/passes/portable.py);
- call: a whole call (queue, evaluation, the token read back) as this machine runs it: median ms;
- mlx-lm: `make_sampler(temp=0.7, top_p=0.9, min_p=0.05)` on log-probabilities, one call per row as mlx-lm's
  BatchGenerator samples per-request samplers, against samplec's portable target on the same chain (MLX_LM_CHAIN:
  top_p, min_p, temperature, sample; the token alone) with the same values at run time, one per row (ratio =
  mlx-lm / samplec, in the same run, interleaved): as this CPU lowers it (candidates) and as a GPU does (one sort
  a row, timed on this CPU).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import samplec  # noqa: E402
from samplec.backend_mlx import kernels, native  # noqa: E402
from samplec.backend_mlx.launches import call_primitives, launches  # noqa: E402
from bench_real import chat_logits  # noqa: E402

V = 152064
QUEUE_REPS = 20     # back-to-back queue calls a round (settled_queue_us)
VALUES = {"temperature": 0.7, "top_p": 0.9, "min_p": 0.05, "top_k": 50, "typical_p": 1.0, "repetition_penalty": 1.1,
          "presence_penalty": 0.1, "frequency_penalty": 0.1, "t": 0.7, "p": 0.9, "k": 40, "m": 0.05}


def examples():
    for path in sorted((ROOT / "examples").glob("*.smp")):
        for name in re.findall(r"^sampler\s+(\w+)", path.read_text(), re.M):
            yield path, name


def arguments(prog, B: int, rng) -> dict:
    kw = {}
    for p in prog.params:
        if p.kind == "tokens":
            kw[p.name] = mx.array(rng.integers(0, V, (B, 64)).astype(np.int32))
        elif p.kind == "seed":
            kw[p.name] = [int(s) for s in rng.integers(0, 2**63, B)]
        elif p.kind == "mask":
            kw[p.name] = mx.array(rng.random((B, V)) < 0.9)
        elif p.kind == "bias":
            kw[p.name] = mx.array((rng.standard_normal((B, V)) * 0.1).astype(np.float32))
        elif p.kind in ("float", "int") and p.name in VALUES:
            kw[p.name] = [VALUES[p.name]] * B
        elif p.kind == "int" and p.name in ("pos", "position"):
            kw[p.name] = [int(v) for v in rng.integers(0, 4000, B)]
    mx.eval(*[v for v in kw.values() if isinstance(v, mx.array)])
    return kw


def median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


@contextlib.contextmanager
def traced_as_its_device(target: str):
    """While a program is compiled and traced: the portable and metal targets as a GPU lowers and runs them (one
    sort a chain, their sums one reduction each, RandomBits in MLX ops rather than the native CPU primitive)."""
    gpu_like = target in ("portable", "metal")
    kernels.GPU_SUMS = gpu_like
    before = os.environ.get("SAMPLEC_NATIVE")
    if gpu_like:
        os.environ["SAMPLEC_NATIVE"] = "0"
    try:
        yield
    finally:
        kernels.GPU_SUMS = False
        if before is None:
            os.environ.pop("SAMPLEC_NATIVE", None)
        else:
            os.environ["SAMPLEC_NATIVE"] = before


def queue_us(prog, x, kw, reps: int) -> float:
    """Median us of `reps` back-to-back `Program.queue` calls, each call's lazy outputs dropped unevaluated before
    the next call, as a decode loop drops each step's graph once it ran: the host's own cost, not the evaluation's.
    (Kept until the last call, the graphs would leave the next calls fresh memory rather than the freed nodes of the
    last one: ~2x faster, and not what a loop meets.)"""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        got = prog.queue(x, **kw)
        times.append(time.perf_counter() - t0)
        del got
    return statistics.median(times) * 1e6


def settled_queue_us(entries: list, rounds: int, reps: int) -> dict:
    """{key: (least-disturbed, median round)} over `rounds` rounds that each time every entry (key, program, logits,
    arguments; the key's last item "gpu" where the program was traced as a GPU runs it) once (`queue_us`): the
    rounds spread each entry's samples over the whole run, so that a burst of this shared machine's other work lands
    in some rounds of every entry rather than in all of one. The least-disturbed round's median is the host's own
    cost; the median round's is what the machine gave in this run."""
    got = {key: [] for key, *_ in entries}
    for _ in range(rounds):
        for key, prog, x, kw in entries:
            with traced_as_its_device(prog.target if key[-1] == "gpu" else "cpu"):
                got[key].append(queue_us(prog, x, kw, reps))
    return {key: (min(v), statistics.median(v)) for key, v in got.items()}


def measure(path, name: str, target: str, x, rng, reps: int) -> tuple[dict, list]:
    """Launches and call time of the example on `target`, and the programs whose queue time `settled_queue_us` takes
    ((form, program, arguments): "gpu" or "cpu"). The portable target is lowered and traced as a GPU runs it for
    its launches and queue time (one sort a chain, its sums one reduction each, RandomBits in MLX ops), and its call
    is timed as this CPU runs it (`cpu_queue_us`, `call_ms`: candidates where a chain allows)."""
    gpu_like = target in ("portable", "metal")
    with traced_as_its_device(target):
        prog = samplec.compile_file(path, sampler=name, target=target)
        kw = arguments(prog, x.shape[0], rng)
        n = launches(call_primitives(prog, x, **kw))
        for _ in range(3):          # (the traced call is cached: every later call runs the same graph)
            prog(x, **kw)
    queued = [("gpu" if gpu_like else "cpu", prog, kw)]
    if gpu_like:
        prog = samplec.compile_file(path, sampler=name, target=target)
        prog(x, **kw)
        queued.append(("cpu", prog, kw))
    return {"launches": n, "call_ms": median_us(lambda: np.array(prog(x, **kw).token), reps) / 1e3}, queued


# the chain mlx-lm's make_sampler(temp, top_p, min_p) builds (top_p, then min_p, then a categorical draw of
# logprobs / temp), every value at run time, the token alone (what mlx-lm's sampler returns)
MLX_LM_CHAIN = """sampler mlx_lm_sampler(temperature: float, top_p: float, min_p: float, seed: seed, pos: int) -> token {
    top_p(top_p)
    min_p(min_p)
    temperature(temperature)
    sample(seed, position = pos)
}"""


def mlx_lm_ratio(B: int, reps: int, rng) -> dict | None:
    try:
        from mlx_lm.sample_utils import make_sampler
    except ImportError:
        return None
    x = mx.array(chat_logits(B, V, seed=B))
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    mx.eval(x, lp)
    sampler = make_sampler(temp=0.7, top_p=0.9, min_p=0.05)
    prog = samplec.compile(MLX_LM_CHAIN, target="portable")
    with traced_as_its_device("portable"):
        sorting = samplec.compile(MLX_LM_CHAIN, target="portable")      # (as a GPU lowers it: one sort a row)
    kw = arguments(prog, B, rng)

    def peer():
        mx.eval([sampler(lp[i:i + 1]) for i in range(B)])

    def mine():
        np.array(prog(x, **kw).token)

    def gpu_form():
        np.array(sorting(x, **kw).token)
    for fn in (peer, mine, gpu_form):
        fn()
    a, b, c = [], [], []
    for _ in range(reps):           # (interleaved: the machine's load hits all alike)
        a.append(median_us(peer, 1))
        b.append(median_us(mine, 1))
        c.append(median_us(gpu_form, 1))
    pm, sm, gm = (statistics.median(t) / 1e3 for t in (a, b, c))
    assert prog.sorted_again == 0, "the candidates did not hold mlx-lm's chain's rows"
    # the host's share: the time to hand back the call's lazy token, nothing evaluated -- mlx-lm's sampler building
    # its ops row by row, samplec's call as a GPU lowers it (what an Apple GPU's host does; least-disturbed rounds)
    with traced_as_its_device("portable"):
        sorting.queue(x, **kw)

    def peer_queue():
        return [sampler(lp[i:i + 1]) for i in range(B)] if B > 1 else sampler(lp)
    rounds = max(5, reps)
    peer_key, mine_key = ("mlx-lm", "cpu"), ("samplec", "gpu")
    q = settled_queue_us([(peer_key, _Lazy(peer_queue), x, {}), (mine_key, sorting, x, kw)], rounds, QUEUE_REPS)
    return {"B": B, "mlx_lm_ms": pm, "samplec_portable_ms": sm, "ratio": pm / sm, "gpu_form_ms": gm,
            "gpu_form_ratio": pm / gm, "mlx_lm_queue_us": q[peer_key][0], "gpu_form_queue_us": q[mine_key][0],
            "queue_ratio": q[peer_key][0] / q[mine_key][0]}


class _Lazy:
    """A peer's sampler in `settled_queue_us`'s shape: `queue` builds its lazy outputs."""
    target = "cpu"

    def __init__(self, fn):
        self.fn = fn

    def queue(self, x, **kw):
        return self.fn()


def command_line(doc: str, batches: str) -> tuple[argparse.Namespace, list[str]]:
    """The options bench_targets and bench_host share, parsed, and the targets to measure (default: the cpu target
    where samplec-native runs it, the cuda target on a CUDA device, and the portable target)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    ap.add_argument("--targets", default=None, help="comma-separated (default: cpu where it runs, and portable)")
    ap.add_argument("--examples", default=None, help="comma-separated sampler names (default: every example's)")
    ap.add_argument("--batches", default=batches, help="comma-separated batch sizes")
    args = ap.parse_args()
    targets = args.targets.split(",") if args.targets else \
        (["cpu"] if mx.default_device() == mx.cpu and native.installed() else []) + \
        (["cuda"] if mx.default_device() != mx.cpu and mx.cuda.is_available() else []) + ["portable"]
    return args, targets


def rows_to_measure(args):
    """(B, logits [B, V], example path, sampler name) for each batch size and chosen example, in order."""
    for B in [int(b) for b in args.batches.split(",")]:
        x = mx.array(chat_logits(B, V, seed=B))
        mx.eval(x)
        for path, name in examples():
            if not args.examples or name in args.examples.split(","):
                yield B, x, path, name


def main() -> None:
    args, targets = command_line(__doc__, "1,8")
    reps = 15 if args.quick else 60
    rng = np.random.default_rng(0)
    print(f"MLX {mx.__version__} on {mx.default_device()}; targets {', '.join(targets)}; V = {V}")
    rows, entries = [], []
    for B, x, path, name in rows_to_measure(args):
        row = {"example": f"{path.name}:{name}", "B": B}
        for target in targets:
            row[target], queued = measure(path, name, target, x, rng, reps)
            entries += [((len(rows), target, form), prog, x, kw) for form, prog, kw in queued]
        rows.append(row)
        print(f"B={B} {row['example']:40s} " + "  ".join(
            f"{t}: {row[t]['launches']:4d} launches, call {row[t]['call_ms']:7.3f} ms" for t in targets), flush=True)
    rounds = 15 if args.quick else 40
    print(f"queue times: {rounds} rounds of {QUEUE_REPS} calls each (us: the least-disturbed round's median, "
          "the median round's)")
    for (i, target, form), (least, typical) in settled_queue_us(entries, rounds, QUEUE_REPS).items():
        got = rows[i][target]
        key = "cpu_queue_us" if form == "cpu" and target in ("portable", "metal") else "queue_us"
        got[key], got[key.replace("_us", "_median_round_us")] = least, typical
    for row in rows:
        print(f"B={row['B']} {row['example']:40s} " + "  ".join(
            f"{t}: queue {row[t]['queue_us']:6.1f} ({row[t]['queue_median_round_us']:6.1f}) us"
            + (f", on this CPU {row[t]['cpu_queue_us']:.1f} ({row[t]['cpu_queue_median_round_us']:.1f}) us"
               if "cpu_queue_us" in row[t] else "") for t in targets), flush=True)
    peers = [r for r in (mlx_lm_ratio(int(B), reps, rng) for B in args.batches.split(",")) if r is not None]
    for r in peers:
        print(f"mlx-lm's sampler on its chain, B = {r['B']}: mlx-lm {r['mlx_lm_ms']:.3f} ms, samplec portable "
              f"{r['samplec_portable_ms']:.3f} ms: {r['ratio']:.2f}x (as a GPU lowers it, one sort a row: "
              f"{r['gpu_form_ms']:.3f} ms, {r['gpu_form_ratio']:.2f}x); the host's queue: mlx-lm "
              f"{r['mlx_lm_queue_us']:.0f} us, samplec as a GPU lowers it {r['gpu_form_queue_us']:.0f} us "
              f"({r['queue_ratio']:.2f}x)")
    if args.out:
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__,
                                                        "rows": rows, "mlx_lm": peers}, indent=1))
        def cols(t):
            if t in ("portable", "metal"):
                return [f"{t} (as a GPU runs it): launches", f"{t} (as a GPU runs it): queue us",
                        f"{t} on this CPU: queue us", f"{t} on this CPU: call ms"]
            return [f"{t}: launches", f"{t}: queue us", f"{t}: call ms"]

        def cells(r, t):
            got = r[t]
            return [str(got["launches"]), f"{got['queue_us']:.0f}"] + \
                ([f"{got['cpu_queue_us']:.0f}"] if "cpu_queue_us" in got else []) + [f"{got['call_ms']:.3f}"]
        head = ["example", "B"] + [c for t in targets for c in cols(t)]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            lines.append("| " + " | ".join([r["example"], str(r["B"])] + [c for t in targets for c in cells(r, t)])
                         + " |")
        lines += ["", "| B | mlx-lm's sampler ms | samplec portable ms | mlx-lm / samplec | portable as a GPU lowers it "
                  "ms | mlx-lm / that | host queue us: mlx-lm | host queue us: portable (GPU) | mlx-lm / that |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['B']} | {r['mlx_lm_ms']:.3f} | {r['samplec_portable_ms']:.3f} | {r['ratio']:.2f}x | "
                  f"{r['gpu_form_ms']:.3f} | {r['gpu_form_ratio']:.2f}x | {r['mlx_lm_queue_us']:.0f} | "
                  f"{r['gpu_form_queue_us']:.0f} | {r['queue_ratio']:.2f}x |" for r in peers]
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
