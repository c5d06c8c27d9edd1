"""The host's share of a call: how long `Program.queue` takes to hand back a call's lazy outputs, and where that
time goes -- the argument checks (`Program._arguments`, the short path) and the compiled graph's replay
(`Executable.queued`) -- for every shipped example on every target, with a server's arguments.

    python benchmarks/bench_host.py --quick                  # this machine: a minute or two
    python benchmarks/bench_host.py --out docs/bench_host    # writes .md and .json

Recipe: bench_targets' (V = 152064, chat-shaped logits, every parameter passed at run time as one value per row,
a 64-token history, per-row seeds, masks and biases as MLX arrays), B = 1 unless --batches says otherwise. Columns,
median us:
- back to back: `Program.queue` called again and again with nothing evaluated in between (bench_targets' queue
  column measures this way): the host's own cost with warm caches, over rounds that each time every program in turn
  (bench_targets.settled_queue_us: the least-disturbed round's median, and the median round's); and the same with the
  position moving every call (a decode loop's pattern);
- queue: `Program.queue` in a loop of whole calls (queue, then the evaluation, with the calls' outputs and flags
  evaluated before the next call is queued), as a decode loop runs it; the evaluation in between leaves the
  host's caches cold, so this is the larger figure;
- args, replay: the two parts of such a queue: the short path's argument checks (`Program._arguments`), and the
  compiled graph's replay (`Executable.queued`, the pre-stage included);
- moving pos: queue when the position changes every call (a decode loop's pattern: one scalar array rebuilt);
- full: `prepare` and the executable, as in a whole-call loop: the path a call takes the first time it meets a
  shape, or with numpy arrays, and the path every call took before the short path existed (it opened a hold on
  MLX's CPU worker as well, for scalar-only programs: not counted here);
- short: whether the timed calls took the short path (`Program.queue_stats`).
The portable target is lowered and traced as a GPU runs it (bench_targets.measure's settings) and timed over fewer calls (its
evaluation on the CPU takes ~0.1 s). Not a test: figures depend on the machine and its load.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import samplec  # noqa: E402
from samplec.backend_mlx import native  # noqa: E402
from bench_real import chat_logits  # noqa: E402
from bench_targets import (QUEUE_REPS, V, arguments, command_line, rows_to_measure, settled_queue_us,  # noqa: E402
                           traced_as_its_device)
from samplec.backend_mlx.launches import launches, primitives  # noqa: E402


class _MovingPos:
    """`prog` whose position parameter moves every call (a decode loop's pattern), in settled_queue_us' shape."""

    def __init__(self, prog, name: str, B: int):
        self.prog, self.name, self.B, self.target = prog, name, B, prog.target
        self.step = iter(range(10**9))

    def queue(self, x, **kw):
        return self.prog.queue(x, **{**kw, self.name: [next(self.step)] * self.B})


# mlx-lm's decode step (mlx_lm.generate.generate_step: the processors on the logits, log-probabilities, the sampler)
# with samplec's adapter on an example and with mlx-lm's own processors and sampler on the same chain
MLX_LM_STEPS = [
    ("mlx_lm_default.smp:mlx_lm", dict(temp=0.7, top_p=0.9, min_p=0.05), {}),
    ("mlx_lm_default.smp:mlx_lm_chat", dict(temp=0.7, top_p=0.9, min_p=0.05, top_k=50),
     dict(repetition_penalty=1.1, repetition_context_size=20)),
]


class _Step:
    """One mlx-lm decode step in `settled_queue_us`' shape: `queue` runs the processors and the sampler on the next
    of a run of growing sequences (evaluated beforehand) and hands back the step's lazy arrays, nothing evaluated.
    samplec's adapter reads a step's check words a few steps later, once mlx-lm has evaluated it: back to back
    nothing is, so that read (of a few evaluated bytes) is left out; and it starts the step's evaluation itself
    (`mx.async_eval`, as mlx-lm's loop does after the sampler), which is left out too (`_QueueOnly`)."""
    target = "portable"

    def __init__(self, processors, sampler, adapter=None):
        self.processors, self.sampler, self.adapter = processors, sampler, adapter
        rng = np.random.default_rng(1)
        prompt = [int(t) for t in rng.integers(0, V, 64)]
        self.seqs = [mx.array(prompt + [int(t) for t in rng.integers(0, V, n)], dtype=mx.int32) for n in range(400)]
        mx.eval(self.seqs)
        self.at = 0

    def queue(self, x, **kw):
        tokens = self.seqs[self.at]
        self.at = (self.at + 1) % len(self.seqs)
        logits = x
        for proc in self.processors:
            logits = proc(tokens, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = self.sampler(logprobs)
        out = [token, logprobs]
        if self.adapter is not None:        # (the step's other outputs and check words, which it evaluates)
            out += list(self.adapter.steps[-1].outputs.to_dict().values())
            out += [f for _, f in self.adapter._unchecked[-1][0]]
            self.adapter.steps.clear()
            self.adapter._unchecked.clear()
        return out


class _QueueOnly:
    """MLX as the adapter sees it while a step is timed: `mx.async_eval` a no-op (its step is only queued; mlx-lm's
    loop starts the evaluation of each step after the sampler, on both sides alike)."""

    def __getattr__(self, name):
        return getattr(mx, name)

    @staticmethod
    def async_eval(*arrays):
        pass


@contextlib.contextmanager
def _no_async_eval():
    import samplec.integrations.mlx_lm as adapter
    adapter.mx = _QueueOnly()
    try:
        yield
    finally:
        adapter.mx = mx


def mlx_lm_step_rows(rounds: int) -> list[dict]:
    """Launches and back-to-back host time of a decode step in mlx-lm's loop: samplec's adapter (the portable target
    as a GPU lowers it) against mlx-lm's own processors and sampler on the same chain."""
    try:
        from mlx_lm.sample_utils import make_logits_processors, make_sampler
    except ImportError:
        return []
    from samplec.integrations.mlx_lm import Sampler
    x = mx.array(chat_logits(1, V, seed=1))
    mx.eval(x)
    rows, entries = [], []
    for example, sampling, processing in MLX_LM_STEPS:
        path, name = example.split(":")
        with traced_as_its_device("portable"):
            prog = samplec.compile_file(ROOT / "examples" / path, sampler=name, target="portable")
            adapter = Sampler(prog, seed=0, **sampling, **({"repetition_penalty": processing["repetition_penalty"]}
                                                           if processing else {}))
        steps = {"samplec": _Step(adapter.logits_processors, adapter, adapter),
                 "mlx-lm": _Step(make_logits_processors(**processing), make_sampler(**sampling))}
        row = {"example": example, "mlx_lm": f"make_sampler({_kw(sampling)})" +
               (f", make_logits_processors({_kw(processing)})" if processing else "")}
        for who, step in steps.items():
            with traced_as_its_device("portable"), _no_async_eval():
                for _ in range(3):
                    mx.eval(step.queue(x))
                row[f"{who}_launches"] = launches(primitives(step.queue(x)))
            entries.append(((len(rows), who, "gpu"), step, x, {}))
        row["short"] = prog.queue_stats["short"] >= 3
        rows.append(row)
    with _no_async_eval():
        times = settled_queue_us(entries, rounds, QUEUE_REPS)
    for (i, who, _), (least, typical) in times.items():
        rows[i][f"{who}_us"], rows[i][f"{who}_median_round_us"] = least, typical
    return rows


def _kw(values: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def _traced(prog, x, kw) -> None:
    """Trace both paths of `prog` (the full one, then the short one) as bench_targets does."""
    with traced_as_its_device(prog.target):
        for _ in range(3):
            prog(x, **kw)


def _timed(step, reps: int) -> float:
    """Median us of `step()`'s timed part: step returns (seconds, lazy arrays), evaluated after the clock stops."""
    times = []
    for _ in range(reps):
        dt, arrays = step()
        native.evaluate(arrays)
        times.append(dt)
    return statistics.median(times) * 1e6


def measure(prog, x, kw, reps: int) -> dict:
    """The columns of a loop of whole calls (each call evaluated before the next is queued); the back-to-back
    columns are main's, over rounds of every program (bench_targets.settled_queue_us)."""
    _traced(prog, x, kw)
    clock = time.perf_counter
    stats = dict(prog.queue_stats)

    def queue(args=kw):
        t0 = clock()
        outs, checks = prog.queue(x, **args)
        return clock() - t0, outs + [f for _, f in checks]

    q = _timed(queue, reps)
    short = prog.queue_stats["short"] - stats["short"] == reps

    def parts(which):
        def step():
            t0 = clock()
            args, _, (exe, _) = prog._arguments(x, kw)
            t1 = clock()
            outs, words = exe.queued(prog._pre, args)
            t2 = clock()
            return (t1 - t0 if which == "args" else t2 - t1), outs + words
        return step
    a = _timed(parts("args"), reps)
    r = _timed(parts("replay"), reps)

    pos = [p.name for p in prog.params if p.kind == "int" and p.name in ("pos", "position")]
    moving = None
    if pos:
        B = x.shape[0]
        step = iter(range(10**9))

        def queue_moving():
            return queue({**kw, pos[0]: [next(step)] * B})
        moving = _timed(queue_moving, reps)

    def full():
        t0 = clock()
        late = []
        args = prog.prepare(x, kw, late)
        outs, flags = prog.exe(*args)
        return clock() - t0, outs + flags + [f for _, f in late]
    _timed(full, 3)
    f = _timed(full, reps)
    return {"queue_us": q, "args_us": a, "replay_us": r, "moving_pos_us": moving,
            "full_us": f, "short": short, "inputs": 1 + len(prog.params)}


def main() -> None:
    args, targets = command_line(__doc__, "1")
    reps = 100 if args.quick else 300
    rng = np.random.default_rng(0)
    print(f"MLX {mx.__version__} on {mx.default_device()}; targets {', '.join(targets)}; V = {V}; {reps} calls each")
    rows, entries = [], []
    for B, x, path, name in rows_to_measure(args):
        for target in targets:
            with traced_as_its_device(target):      # (the portable target as a GPU lowers it)
                prog = samplec.compile_file(path, sampler=name, target=target)
            n = reps if target not in ("portable", "metal") else max(15, reps // 8)
            kw = arguments(prog, B, rng)
            row = {"example": f"{path.name}:{name}", "B": B, "target": target, **measure(prog, x, kw, n)}
            form = "gpu" if target in ("portable", "metal") else "cpu"
            entries.append(((len(rows), "fixed", form), prog, x, kw))
            pos = [p.name for p in prog.params if p.kind == "int" and p.name in ("pos", "position")]
            if pos:
                entries.append(((len(rows), "moving", form), _MovingPos(prog, pos[0], B), x, kw))
            rows.append(row)
            mp = "-" if row["moving_pos_us"] is None else f"{row['moving_pos_us']:.1f}"
            print(f"B={B} {row['example']:40s} {target:9s} "
                  f"queue {row['queue_us']:6.1f} us (args "
                  f"{row['args_us']:5.1f}, replay {row['replay_us']:5.1f}; moving pos {mp}); full "
                  f"{row['full_us']:6.1f} us; short path {'yes' if row['short'] else 'NO'}", flush=True)
    rounds = 15 if args.quick else 40
    for (i, which, _), (least, typical) in settled_queue_us(entries, rounds, QUEUE_REPS).items():
        key = "back_to_back_us" if which == "fixed" else "back_to_back_moving_us"
        rows[i][key], rows[i][key.replace("_us", "_median_round_us")] = least, typical
    print(f"back to back ({rounds} rounds of {QUEUE_REPS} calls: the least-disturbed round's median, the median "
          "round's), fixed and moving position:")
    for r in rows:
        mp = "-" if "back_to_back_moving_us" not in r else \
            f"{r['back_to_back_moving_us']:.1f} ({r['back_to_back_moving_median_round_us']:.1f})"
        print(f"B={r['B']} {r['example']:40s} {r['target']:9s} {r['back_to_back_us']:5.1f} "
              f"({r['back_to_back_median_round_us']:.1f}) us; moving pos {mp}", flush=True)
    steps = mlx_lm_step_rows(rounds)
    for r in steps:
        print(f"mlx-lm's decode step, {r['example']}: samplec's adapter {r['samplec_launches']} launches, "
              f"{r['samplec_us']:.1f} ({r['samplec_median_round_us']:.1f}) us; mlx-lm's {r['mlx_lm']} "
              f"{r['mlx-lm_launches']} launches, {r['mlx-lm_us']:.1f} ({r['mlx-lm_median_round_us']:.1f}) us",
              flush=True)
    if args.out:
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__,
                                                        "V": V, "reps": reps, "rows": rows, "mlx_lm_steps": steps},
                                                       indent=1))
        lines = ["# The host's share of a call", "",
                 f"Generated by `python benchmarks/bench_host.py{' --quick' if args.quick else ''} --out "
                 f"{args.out}` (MLX {mx.__version__} on {mx.default_device()}, V = {V}; median of {reps} calls, "
                 f"{max(15, reps // 8)} on the portable target). Every parameter is passed at run time as one "
                 "value per row, with a 64-token MLX history, per-row seeds, MLX masks and biases.", "",
                 f"- back to back: `Program.queue` again and again, nothing evaluated in between (warm caches: the "
                 f"host's own cost; bench_targets' queue column), over {rounds} rounds of {QUEUE_REPS} calls that "
                 "each time every program in turn: the least-disturbed round's median and, in parentheses, the "
                 "median round's; and the same with the position changing every call (a decode loop's pattern);",
                 "- queue: `Program.queue` in a loop of whole calls, each evaluated before the next is queued (as a "
                 "decode loop runs it: the evaluation leaves the host's caches cold); args and replay are its two "
                 "parts, the argument checks and the compiled graph's replay; moving pos: the same with the "
                 "position changing every call;",
                 "- full path: `prepare` and the executable in the same loop: a call's first time at a shape, or "
                 "with numpy arrays -- the path every call took before the short path;",
                 "- the portable target's whole-call columns follow a ~0.1 s evaluation of MLX ops on both cores of "
                 "this machine (the coldest caches); on a GPU the device runs it and the host's caches stay warmer: "
                 "back to back is the closer figure there.", "",
                 "| example | B | target | inputs | back to back us | back to back us, moving pos | queue us | args us "
                 "| replay us | queue us, moving pos | full path us | short path |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            mp = "-" if r["moving_pos_us"] is None else f"{r['moving_pos_us']:.0f}"
            bm = "-" if "back_to_back_moving_us" not in r else \
                f"{r['back_to_back_moving_us']:.0f} ({r['back_to_back_moving_median_round_us']:.0f})"
            lines.append(f"| {r['example']} | {r['B']} | {r['target']} | {r['inputs']} | {r['back_to_back_us']:.0f} "
                         f"({r['back_to_back_median_round_us']:.0f}) | {bm} | "
                         f"{r['queue_us']:.0f} | {r['args_us']:.0f} | {r['replay_us']:.0f} | {mp} | "
                         f"{r['full_us']:.0f} | {'yes' if r['short'] else 'no'} |")
        if steps:
            lines += ["", "## A decode step in mlx-lm's loop", "",
                      "mlx-lm's `generate_step` runs, each step, its logits processors, log-probabilities and its "
                      "sampler. With samplec's adapter (`samplec.integrations.mlx_lm.Sampler`, the portable target as a "
                      "GPU lowers it) and with mlx-lm's own processors and sampler on the same chain: the step's "
                      "launches (non-view primitives, log-probabilities included) and the host's time to queue it "
                      f"back to back over a run of growing sequences ({rounds} rounds of {QUEUE_REPS} steps: the "
                      "least-disturbed round's median, and in parentheses the median round's).", "",
                      "| example | mlx-lm's processors and sampler | launches samplec | launches mlx-lm | host us "
                      "samplec | host us mlx-lm | samplec's short path |",
                      "|---|---|---|---|---|---|---|"]
            for r in steps:
                lines.append(f"| {r['example']} | `{r['mlx_lm']}` | {r['samplec_launches']} | "
                             f"{r['mlx-lm_launches']} | {r['samplec_us']:.0f} ({r['samplec_median_round_us']:.0f}) | "
                             f"{r['mlx-lm_us']:.0f} ({r['mlx-lm_median_round_us']:.0f}) | "
                             f"{'yes' if r['short'] else 'no'} |")
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
