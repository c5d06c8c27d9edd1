"""`samplec serve --draft-model`: acceptance, target forward passes per token and time, against the same server
without a draft, over HTTP on loopback.

    python benchmarks/bench_serve_speculative.py [--tokens 48] [--requests 6] [--num-draft 4]
                                                 [--noise 0,0.1,0.3,1.0] [--temps 0,0.7,1.0] [--top-p 0.9]

Not a test. The target is the demo model (`samplec serve --demo`: `random_llama(0)`, 2 layers, hidden 64, vocab
512); each draft is `noisy_copy(target, noise)` saved to a temporary folder and loaded with `--draft-model` (noise
0: the target's own weights). For each draft and temperature, `--requests` seeded chat requests (top_p as given)
go to the server one after another; the table gives the proposals accepted over all requests
(`usage.samplec_speculative`), target forward passes per generated token, the wall time against the server
without a draft, and whether every request's text equals the plain server's.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai
from mlx_lm.utils import save_config, save_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from samplec import serve  # noqa: E402
from samplec.integrations.mlx_lm import noisy_copy, random_llama  # noqa: E402

DEMO = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512, tie_word_embeddings=True)
MSG = [{"role": "user", "content": "Count the tokens"}]


def start(argv):
    ready, box = threading.Event(), {}

    def on_ready(httpd, app):
        box.update(httpd=httpd, app=app)
        ready.set()
    t = threading.Thread(target=serve.serve, args=(["--port", "0", *argv], [], True, on_ready), daemon=True)
    t.start()
    ready.wait(120)
    host, port = box["httpd"].server_address[:2]
    box["client"] = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0, timeout=300)
    box["thread"] = t
    return box


def run(box, n: int, tokens: int, temp: float, top_p: float):
    texts, usage, t0 = [], [], time.perf_counter()
    for i in range(n):
        r = box["client"].chat.completions.create(model="demo", messages=MSG, max_tokens=tokens, temperature=temp,
                                                  top_p=top_p, seed=100 + i)
        texts.append(r.choices[0].message.content)
        usage.append(r.usage)
    return texts, usage, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--noise", default="0,0.1,0.3,1.0")
    ap.add_argument("--temps", default="0,0.7,1.0")
    ap.add_argument("--top-p", type=float, default=0.9)
    a = ap.parse_args()
    temps = [float(t) for t in a.temps.split(",")]
    plain = start([])
    base = {}
    for t in temps:
        run(plain, 1, a.tokens, t, a.top_p)                     # (warm-up: the chain's shapes compiled)
        base[t] = run(plain, a.requests, a.tokens, t, a.top_p)
    print(f"target: the demo model; {a.requests} requests x {a.tokens} tokens, top_p {a.top_p}, "
          f"--num-draft {a.num_draft}")
    print("| draft noise | temperature | accepted / proposed | target passes / token | time vs no draft | "
          "same text |")
    print("|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for noise in [float(x) for x in a.noise.split(",")]:
            path = Path(tmp) / f"draft{noise}"
            path.mkdir()
            save_model(path, noisy_copy(random_llama(0, vocab=512), noise, seed=1))
            save_config(dict(DEMO), path / "config.json")
            box = start(["--draft-model", str(path), "--num-draft", str(a.num_draft)])
            for t in temps:
                run(box, 1, a.tokens, t, a.top_p)
                texts, usage, secs = run(box, a.requests, a.tokens, t, a.top_p)
                spec = [u.model_extra["samplec_speculative"] for u in usage]
                prop = sum(s["draft_tokens"] for s in spec)
                acc = sum(s["accepted_tokens"] for s in spec)
                passes = sum(s["target_forwards"] for s in spec)
                toks = sum(u.completion_tokens for u in usage)
                print(f"| {noise} | {t} | {acc / max(prop, 1):.2f} ({acc}/{prop}) | {passes / toks:.2f} | "
                      f"{secs / base[t][2]:.2f}x | {'yes' if texts == base[t][0] else 'NO'} |")
            box["httpd"].shutdown()
            box["thread"].join(60)
    plain["httpd"].shutdown()
    plain["thread"].join(60)


if __name__ == "__main__":
    main()
