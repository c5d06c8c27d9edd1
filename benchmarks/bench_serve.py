"""Serving throughput: `samplec serve` against mlx-lm's own server (mlx_lm.server), same model, same requests.

    pip install -e ".[mlx-lm]" ./native
    python benchmarks/bench_serve.py                  # ~2 minutes on 2 cores
    python benchmarks/bench_serve.py --clients 16 --requests 64 --max-tokens 32

Recipe: the small random llama of the tests (samplec.integrations.mlx_lm.random_llama, vocabulary 512) saved in
mlx-lm's format to a temporary directory, so both servers load the same weights from disk; each server is started
as its own process on a loopback port and warmed up with 4 requests; then `--clients` threads send `--requests`
completion requests in total, each with its own values (temperature 0.6-1.2, top_p 0.8-1.0, top_k 0/20/50, min_p
0/0.05, repetition penalty 1.0-1.2) -- a server's realistic mix -- and half of them with a `seed`. Reported: generated
tokens per second of wall time, per server, and the ratio samplec / mlx-lm in the same run (the two servers run one
after the other, in alternating order over `--rounds`). mlx-lm's server serves a seeded request alone (it seeds the
global generator), and samples every row with its own sampler call; samplec serves them all in one batch with one
program call per step.

Second part (in-process, no HTTP): the grammar's share of a step. B requests at once (B = 1 and 8) under a JSON
schema (an object holding a list of at least 30 {name, n} objects: no row can finish before `--grammar-tokens`
tokens, so the batch stays B wide), on samplec serve's engine with the demo model. Reported: the time in the
grammar engine (llguidance's masks and advancing the matchers) over the time of the engine's steps (model,
sampler, grammar, bookkeeping), and tokens/s against the same requests without the schema.
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def save_demo_model(path: Path) -> None:
    from mlx_lm.utils import save_config, save_model
    from samplec.integrations.mlx_lm import local_tokenizer, random_llama
    save_model(path, random_llama(0, vocab=512))
    save_config(dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                     tie_word_embeddings=True), path / "config.json")
    local_tokenizer(512)._tokenizer.save_pretrained(str(path))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, model: Path, port: int) -> subprocess.Popen:
    cmd = ([sys.executable, "-m", "samplec.cli", "serve"] if kind == "samplec" else
           [sys.executable, "-m", "mlx_lm", "server"]) + ["--model", str(model), "--port", str(port),
                                                           "--log-level", "ERROR"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            post(port, dict(prompt="warm up", max_tokens=2))
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{kind} server did not start")


def post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def requests(n: int, max_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = dict(prompt=rng.choice(["A sampler chain", "The compiler reads", "Quick brown foxes"]),
                    max_tokens=max_tokens, temperature=rng.choice([0.6, 0.8, 1.0, 1.2]),
                    top_p=rng.choice([0.8, 0.9, 1.0]), top_k=rng.choice([0, 20, 50]), min_p=rng.choice([0.0, 0.05]),
                    repetition_penalty=rng.choice([1.0, 1.1, 1.2]))
        if i % 2:
            body["seed"] = rng.randrange(2**31)
        out.append(body)
    return out


def measure(port: int, reqs: list[dict], clients: int) -> float:
    for r in reqs[:4]:
        post(port, dict(r, max_tokens=2))
    t = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda r: post(port, r), reqs))
    wall = time.perf_counter() - t
    return sum(a["usage"]["completion_tokens"] for a in answers) / wall


GRAMMAR_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 30, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False}


def grammar_share(widths: list[int], tokens: int, rounds: int) -> None:
    from samplec import serve
    model, tok = serve.demo_model()
    app = serve.Server(model, tok, serve.load_programs([]), "demo")
    try:
        def run(B: int, constrained: bool) -> tuple[float, float, float]:
            body = dict(prompt="A sampler chain", max_tokens=tokens, temperature=1.0)
            if constrained:
                body["grammar"] = {"type": "json_schema", "value": GRAMMAR_SCHEMA}
            reqs = [app.parse("completion", dict(body, seed=i)) for i in range(B)]
            eng, smp = app.engine, app.sampler
            g0, s0, t0 = smp.grammar_seconds, eng.step_seconds, time.perf_counter()
            jobs = [eng.submit(r) for r in reqs]
            for j in jobs:
                while j.rows[0].finish is None:
                    j.events.get(timeout=300)
            wall = time.perf_counter() - t0
            assert not constrained or all(j.rows[0].finish == "length" for j in jobs)
            return smp.grammar_seconds - g0, eng.step_seconds - s0, sum(j.rows[0].delivered for j in jobs) / wall
        run(1, True)                                  # warm-up: compile the program's shapes
        run(8, False)
        # (unconstrained rows may end early at their end-of-sequence token: tokens/s counts what was generated)
        for B in widths:
            best = None
            for _ in range(rounds):
                g, step, rate = run(B, True)
                _, _, plain = run(B, False)
                share = g / step
                if best is None or share < best[0]:
                    best = (share, g, step, rate, plain)
            share, g, step, rate, plain = best
            print(f"B = {B}: grammar {1e3 * g / tokens:.2f} ms of {1e3 * step / tokens:.2f} ms per step "
                  f"({100 * share:.1f}%); {rate:.0f} tokens/s constrained, {plain:.0f} unconstrained "
                  f"({rate / plain:.2f}x)", flush=True)
    finally:
        app.engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--grammar-tokens", type=int, default=64)
    ap.add_argument("--only", choices=["throughput", "grammar"], default=None)
    args = ap.parse_args()
    if args.only != "throughput":
        grammar_share([1, 8], args.grammar_tokens, args.rounds)
        if args.only == "grammar":
            return
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "demo"
        model.mkdir()
        save_demo_model(model)
        reqs = requests(args.requests, args.max_tokens, 0)
        rates = {"samplec": [], "mlx-lm": []}
        for rnd in range(args.rounds):
            for kind in (("samplec", "mlx-lm") if rnd % 2 == 0 else ("mlx-lm", "samplec")):
                port = free_port()
                proc = start(kind, model, port)
                try:
                    rates[kind].append(measure(port, reqs, args.clients))
                finally:
                    proc.terminate()
                    proc.wait(30)
                print(f"round {rnd + 1}: {kind:8} {rates[kind][-1]:8.1f} tokens/s", flush=True)
        best = {k: max(v) for k, v in rates.items()}
        print(f"\n{args.requests} requests, {args.clients} clients, {args.max_tokens} tokens each, half seeded: "
              f"samplec serve {best['samplec']:.1f} tokens/s, mlx-lm server {best['mlx-lm']:.1f} tokens/s "
              f"({best['samplec'] / best['mlx-lm']:.2f}x)")


if __name__ == "__main__":
    main()
