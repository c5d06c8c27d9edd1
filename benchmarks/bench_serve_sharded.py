"""`samplec serve --demo` with the LM head split over the ranks of `mlx.launch`, against the one-process server.

    mlx.launch -n 2 --backend ring -- python benchmarks/bench_serve_sharded.py [--tokens 32] [--requests 4]
                                                                              [--concurrent 4]

Not a test. Every rank runs the server as the CLI does (rank 0 listens, the others follow its steps). Rank 0 then
sends `--requests` seeded chat requests one after another and `--concurrent` at once (one batch), each of
`--tokens` tokens, and times them; afterwards it builds the one-process server (the unsharded demo model, no
collectives) in the same process and times the same requests on it. It prints tokens/s both ways and whether every
text is the same.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from samplec import serve  # noqa: E402

MSG = [{"role": "user", "content": "Count the tokens"}]


def body(i: int, tokens: int) -> dict:
    return {"model": "demo", "messages": MSG, "max_tokens": tokens, "temperature": 1.0, "top_p": 0.9,
            "seed": 50 + i}


def post(base: str, b: dict) -> dict:
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(b).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def timed(base: str, a) -> tuple[list[str], float, list[str], float, int]:
    post(base, body(99, 4))                                # (warm-up)
    t0 = time.perf_counter()
    seq = [post(base, body(i, a.tokens)) for i in range(a.requests)]
    t_seq = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.concurrent) as ex:
        con = list(ex.map(lambda i: post(base, body(100 + i, a.tokens)), range(a.concurrent)))
    t_con = time.perf_counter() - t0
    tokens = sum(r["usage"]["completion_tokens"] for r in seq)
    ctok = sum(r["usage"]["completion_tokens"] for r in con)
    return ([r["choices"][0]["message"]["content"] for r in seq], tokens / t_seq,
            [r["choices"][0]["message"]["content"] for r in con], ctok / t_con, tokens + ctok)


def start_plain():
    model, tok = serve.demo_model()          # (no samplec_vocab: the one-process engine)
    app = serve.Server(model, tok, serve.load_programs([]), "demo")
    httpd = serve.HTTPServer(("127.0.0.1", 0), type("H", (serve.Handler,), {"app": app}))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return {"httpd": httpd, "app": app}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--concurrent", type=int, default=4)
    a = ap.parse_args()
    group = mx.distributed.init()

    def bench(httpd):
        try:
            host, port = httpd.server_address[:2]
            sharded = timed(f"http://{host}:{port}", a)
        finally:
            httpd.shutdown()
        plain = start_plain()
        host, port = plain["httpd"].server_address[:2]
        one = timed(f"http://{host}:{port}", a)
        plain["httpd"].shutdown()
        plain["app"].engine.stop()
        print(f"demo model, {group.size()} ranks (ring, loopback), {a.tokens} tokens a request, top_p 0.9, T 1.0")
        print("| server | sequential tokens/s | concurrent tokens/s |")
        print("|---|---:|---:|")
        print(f"| one process | {one[1]:.1f} | {one[3]:.1f} |")
        print(f"| LM head over {group.size()} ranks | {sharded[1]:.1f} | {sharded[3]:.1f} |")
        print(f"same texts: {sharded[0] == one[0] and sharded[2] == one[2]} ({sharded[4]} tokens)")

    threads = []

    def ready(httpd, app):
        if httpd is not None:
            threads.append(threading.Thread(target=bench, args=(httpd,)))
            threads[-1].start()
    serve.serve(["--port", "0"], [], True, ready)
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
