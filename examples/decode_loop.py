"""Decode with a real mlx-lm model and a compiled samplec sampler -- no downloads.

    pip install 'samplec[mlx-lm]'
    python examples/decode_loop.py [--tokens 128] [--chunk 16] [--layers 4] [--hidden 256] [--vocab 4096]

Builds a small llama (mlx-lm's own `llama.Model`, random weights from a fixed seed) and a byte-level BPE tokenizer
trained locally, compiles `examples/llama.smp` (llama.cpp's default chain with a repetition penalty), and prints
tokens/s for: mlx-lm's default sampler (greedy), samplec through the mlx-lm adapter, and samplec's multi-step
decode loop (`chunk` steps per host sync). The last two give the same tokens for the same seed.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step, stream_generate

import samplec
from samplec.decode import generate
from samplec.integrations.mlx_lm import Sampler, local_tokenizer, random_llama

HERE = Path(__file__).resolve().parent


def timed(fn):
    start = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()

    model = random_llama(0, layers=a.layers, hidden=a.hidden, vocab=a.vocab)
    tokenizer = local_tokenizer(a.vocab)
    program = samplec.compile_file(HERE / "llama.smp", sampler="llama")
    prompt = tokenizer.encode("The sampler chain turns the logits into")
    n = a.tokens

    def mlx_default():
        return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]

    def adapter():
        s = Sampler(program, seed=a.seed)
        out = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=s,
                                           logits_processors=s.logits_processors)]
        s.check()
        return out

    def multi_step():
        return generate(model, program, prompt, n, chunk=a.chunk, seed=a.seed)

    runs = [("mlx-lm default sampler (greedy)", mlx_default), ("samplec via the mlx-lm adapter", adapter),
            (f"samplec multi-step decode (chunk={a.chunk})", multi_step)]
    for _, fn in runs:                       # warm up: compile the programs, allocate the caches
        fn()
    results = {}
    print(f"llama: {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}; {n} tokens; device {mx.default_device()}")
    for name, fn in runs:
        tokens, secs = timed(fn)
        results[name] = tokens
        print(f"  {name:<44} {n / secs:8.1f} tokens/s")
    same = results[runs[1][0]] == results[runs[2][0]]
    print(f"adapter and multi-step decode agree token for token: {same}")

    s = Sampler(program, seed=a.seed)
    text = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=24, sampler=s,
                                                   logits_processors=s.logits_processors))
    print(f"stream_generate text (random weights, so gibberish): {text!r}")
    print(f"its first logprobs: {[round(v, 3) for v in s.output('logprob')[:5, 0].tolist()]}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
