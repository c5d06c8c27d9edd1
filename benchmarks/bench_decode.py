"""Decode throughput: mlx-lm's default sampler vs samplec (adapter, multi-step) on random local llamas.

    python benchmarks/bench_decode.py [--tokens 64] [--repeats 3] [--chunk 16] [--json out.json]

Not a test: it prints a Markdown table (tokens/s, ratios to mlx-lm's default sampler, and the sampler's share of a
decode step) for two model sizes x two vocabulary sizes. The samplec sampler is `examples/llama.smp`'s `llama`
chain (repetition penalty over the last 64 tokens, top-k 40, top-p 0.95, min-p 0.05, temperature 0.8); "mlx-lm
llama chain" is the nearest mlx-lm equivalent (`make_sampler(temp=0.8, top_p=0.95, min_p=0.05, top_k=40)` with
`make_logits_processors(repetition_penalty=1.1, repetition_context_size=64)`). Each
configuration is timed `repeats` times, interleaved with the others, and the best time is kept (the machine may
be shared). The sampler's share of a step is its own time -- the sampler alone on one row of logits, synced after
every call -- divided by the step time (1 / tokens per second).
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import samplec
from samplec.decode import ProgramFeed, generate, pad_history
from samplec.integrations.mlx_lm import Sampler, random_llama

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"2L-256": dict(layers=2, hidden=256, heads=4, kv_heads=2),
          "8L-1024": dict(layers=8, hidden=1024, heads=16, kv_heads=4)}
VOCABS = (32000, 128256)


def sampler_seconds(fn, calls: int = 30) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _normalized(logits):
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def bench(model_name: str, vocab: int, program, tokens: int, repeats: int, chunk: int) -> dict:
    model = random_llama(0, vocab=vocab, **MODELS[model_name])
    prompt = list(range(3, 35))
    seed = 1

    def mlx_default():
        return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=tokens)]

    chain = make_sampler(temp=0.8, top_p=0.95, min_p=0.05, top_k=40)
    chain_procs = make_logits_processors(repetition_penalty=1.1, repetition_context_size=64)

    def mlx_chain():
        return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=tokens, sampler=chain,
                                            logits_processors=chain_procs)]

    def adapter():
        s = Sampler(program, seed=seed)
        out = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=tokens, sampler=s,
                                           logits_processors=s.logits_processors)]
        s.check()
        return out

    runs = {"mlx-lm default": mlx_default, "mlx-lm llama chain": mlx_chain, "samplec adapter": adapter,
            "samplec decode chunk=1": lambda: generate(model, program, prompt, tokens, chunk=1, seed=seed),
            f"samplec decode chunk={chunk}": lambda: generate(model, program, prompt, tokens, chunk=chunk, seed=seed)}
    best = {k: float("inf") for k in runs}
    outputs = {}
    for fn in runs.values():
        fn()                                          # warm-up (compilation, allocation)
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            outputs[name] = fn()
            best[name] = min(best[name], time.perf_counter() - start)
    assert outputs["samplec adapter"] == outputs["samplec decode chunk=1"] == outputs[f"samplec decode chunk={chunk}"]

    logits = mx.random.normal((1, vocab))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    feed = ProgramFeed(program, seed, {})
    history = pad_history(mx.array([prompt + list(range(64))], dtype=mx.int32), len(prompt) + 64)
    t_argmax = sampler_seconds(lambda: mx.eval(mx.argmax(logprobs, axis=-1)))
    def samplec_step():
        outs, checks = feed(logits, [96], history)
        mx.eval(*outs, *(flag for _, flag in checks))
    t_samplec = sampler_seconds(samplec_step)
    seq = mx.array(prompt + list(range(64)))
    t_chain = sampler_seconds(lambda: mx.eval(chain(_normalized(chain_procs[0](seq, logits)))))
    tps = {k: tokens / v for k, v in best.items()}
    own = {"mlx-lm default": t_argmax, "mlx-lm llama chain": t_chain}
    share = {k: own.get(k, t_samplec) * tps[k] for k in tps}
    return {"model": model_name, "vocab": vocab, "tokens_per_s": tps, "sampler_share": share}


def table(results: list[dict]) -> str:
    names = list(results[0]["tokens_per_s"])
    base = names[0]
    head = "| model | vocab | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (2 + len(names))]
    for r in results:
        cells = []
        for n in names:
            ratio = r["tokens_per_s"][n] / r["tokens_per_s"][base]
            cells.append(f"{r['tokens_per_s'][n]:.0f} tok/s ({ratio:.2f}x, sampler {100 * r['sampler_share'][n]:.0f}%)")
        lines.append(f"| {r['model']} | {r['vocab']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    program = samplec.compile_file(ROOT / "examples" / "llama.smp", sampler="llama")
    results = []
    for model_name in MODELS:
        for vocab in VOCABS:
            results.append(bench(model_name, vocab, program, a.tokens, a.repeats, a.chunk))
            print(f"done {model_name} V={vocab}", flush=True)
    print(f"\nMLX {mx.__version__} on {mx.default_device()} ({platform.machine()}), {a.tokens} tokens, "
          f"best of {a.repeats}\n")
    print(table(results))
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
