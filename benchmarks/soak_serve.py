"""A bounded soak of `samplec serve --demo` on loopback: concurrent clients, streams cut mid-way, malformed and
out-of-range requests mixed in; every good request's answer is checked.

    python benchmarks/soak_serve.py                      # 16 clients, 3000 requests (a few minutes on 2 cores)
    python benchmarks/soak_serve.py --requests 300       # a quick one

The server runs as its own process (`python -m samplec serve --demo --port 0`, on 127.0.0.1). Before the soak each
seeded request template is answered alone, one at a time; during the soak every seeded request must give exactly
that text (and those token log-probabilities), whatever else is in its batch. Structured requests that finish
with "stop" must parse and validate against their schema. Malformed requests must be answered 400 (404 for an
unknown model); hang-ups (a tenth of the requests: a stream read a little and then closed) must not disturb the
others. At the end no row may be left in the batch and the server's thread count must be back to its count after a
warm-up (the templates, twice, concurrently); its resident memory is printed after the warm-up, every 5 s during
the soak and at the end. The loops are bounded (requests and a deadline) and the script stops the server itself.
Exit status 0 when every check held.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                           "tag": {"type": "string", "maxLength": 4}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
MSG = [{"role": "user", "content": "Count the tokens"}]


def templates() -> list[tuple[str, dict]]:
    """Seeded good requests (endpoint, body): each must answer as it did alone."""
    out = []
    for i in range(24):
        kind = i % 6
        seed = 1000 + i
        if kind == 0:
            out.append(("completions", dict(prompt="A sampler chain", max_tokens=16, temperature=0.9, seed=seed)))
        elif kind == 1:
            out.append(("chat", dict(messages=MSG, max_tokens=12, temperature=0.8, seed=seed, logprobs=True,
                                     top_logprobs=3)))
        elif kind == 2:
            out.append(("completions", dict(prompt="Quick brown foxes", max_tokens=24, temperature=1.0, seed=seed,
                                            stop=["e", "q"], top_k=40, repetition_penalty=1.2)))
        elif kind == 3:
            out.append(("chat", dict(messages=MSG, max_tokens=40, temperature=1.0, seed=seed, response_format={
                "type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})))
        elif kind == 4:
            out.append(("completions", dict(prompt="counting one, two", max_tokens=10, temperature=1.1, seed=seed,
                                            n=2, logprobs=2)))
        else:
            out.append(("completions", dict(prompt="answer:", max_tokens=20, temperature=1.0, seed=seed,
                                            grammar={"type": "regex", "value": "[a-z]{2,8}( [0-9]{1,3})?"})))
    return out


BAD = [("completions", b'{"prompt": "x", "max_tokens": '), ("completions", b"\xff\xfe\x00"),
       ("completions", json.dumps(dict(prompt="x", temperature=-1)).encode()),
       ("completions", json.dumps(dict(prompt="x", top_p=7)).encode()),
       ("chat", json.dumps(dict(messages=MSG, n=1000)).encode()),
       ("chat", json.dumps(dict(messages=MSG, logit_bias={"5": 1e9})).encode()),
       ("chat", json.dumps(dict(messages=MSG, response_format={"type": "json_schema", "json_schema": {
           "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}})).encode()),
       ("chat", json.dumps(dict(messages=MSG, grammar={"type": "regex", "value": "(unclosed"})).encode()),
       ("chat", json.dumps(dict(messages=[], max_tokens=3)).encode()),
       ("chat", json.dumps(dict(messages=MSG, tools=[{"type": "function", "function": {"name": "f"}}])).encode()),
       ("completions", json.dumps(dict(prompt="x", max_tokens=10**9)).encode()),
       ("completions", json.dumps(dict(prompt="x", wat=1)).encode()),
       ("chat", json.dumps(dict(messages=MSG, model="gpt-4o")).encode())]


class Client:
    def __init__(self, host: str, port: int):
        self.host, self.port = host, port

    def post(self, kind: str, body, timeout: float = 120):
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            c.request("POST", path, data, {"Content-Type": "application/json"})
            r = c.getresponse()
            raw = r.read()
            return r.status, raw
        finally:
            c.close()

    def hang_up(self, kind: str, body: dict, read: int):
        body = dict(body, stream=True)
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        data = json.dumps(body).encode()
        s = socket.create_connection((self.host, self.port), timeout=60)
        try:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            got = 0
            while got < read:
                chunk = s.recv(read - got)
                if not chunk:
                    break
                got += len(chunk)
        finally:
            s.close()

    def get(self, path: str):
        c = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, json.loads(r.read())
        finally:
            c.close()


def answer_key(kind: str, body: dict) -> list:
    """What must be identical to the solo answer: each choice's text, finish reason and token logprobs."""
    out = []
    for ch in body["choices"]:
        text = ch["message"]["content"] if kind == "chat" else ch["text"]
        lp = ch.get("logprobs")
        toks = None
        if lp:
            toks = [(e["token"], e["logprob"]) for e in lp["content"]] if kind == "chat" else \
                list(zip(lp["tokens"], lp["token_logprobs"]))
        out.append((text, ch["finish_reason"], toks))
    return out


def proc_status(pid: int) -> tuple[int, int]:
    """(threads, resident KiB) of a process."""
    threads = rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return threads, rss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--deadline", type=float, default=1500.0, help="seconds; the soak stops sending after it")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import jsonschema

    server = subprocess.Popen([sys.executable, "-m", "samplec", "serve", "--demo", "--host", "127.0.0.1",
                               "--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        port = None
        t0 = time.time()
        while time.time() - t0 < 180:
            line = server.stderr.readline()
            if not line:
                break
            m = re.search(r"listening on http://[^:]+:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        if port is None:
            print("the server did not start", file=sys.stderr)
            return 1
        threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()   # (drain)
        client = Client("127.0.0.1", port)
        tpl = templates()
        solo = []
        for kind, body in tpl:                      # each alone, one at a time
            status, raw = client.post(kind, body)
            assert status == 200, (status, raw[:300])
            solo.append(answer_key(kind, json.loads(raw)))
        with ThreadPoolExecutor(args.clients) as pool:    # warm-up: batches as wide as the soak's
            list(pool.map(lambda kb: client.post(*kb), tpl * 2))
        time.sleep(1.0)
        idle_threads, rss_warm = proc_status(server.pid)

        rng = random.Random(args.seed)
        plan = []
        for i in range(args.requests):
            u = rng.random()
            if u < 0.1:
                plan.append(("hangup", rng.randrange(len(tpl))))
            elif u < 0.2:
                plan.append(("bad", rng.randrange(len(BAD))))
            elif u < 0.3:
                plan.append(("unseeded", rng.randrange(len(tpl))))
            else:
                plan.append(("seeded", rng.randrange(len(tpl))))
        counts: Counter = Counter()
        failures: list[str] = []
        lock = threading.Lock()
        stop_at = time.time() + args.deadline

        def run(item):
            what, i = item
            if time.time() > stop_at:
                with lock:
                    counts["skipped (deadline)"] += 1
                return
            try:
                if what == "hangup":
                    kind, body = tpl[i]
                    client.hang_up(kind, dict(body, max_tokens=200), read=rng.randrange(1, 400))
                    key = "hung up mid-stream"
                elif what == "bad":
                    kind, data = BAD[i]
                    status, raw = client.post(kind, data)
                    want = 404 if b"gpt-4o" in data else 400
                    ok = status == want and json.loads(raw)["error"]["message"]
                    key = f"malformed -> {want}" if ok else "malformed: WRONG ANSWER"
                    if not ok:
                        failures.append(f"bad #{i}: {status} {raw[:200]!r}")
                else:
                    kind, body = tpl[i]
                    if what == "unseeded":
                        body = {k: v for k, v in body.items() if k != "seed"}
                    status, raw = client.post(kind, body)
                    ans = json.loads(raw)
                    ok = status == 200
                    if ok and what == "seeded":
                        ok = answer_key(kind, ans) == solo[i]
                    if ok and "response_format" in body:
                        for ch in ans["choices"]:
                            if ch["finish_reason"] == "stop":
                                jsonschema.validate(json.loads(ch["message"]["content"]), SCHEMA)
                                with lock:
                                    counts["structured answers validated"] += 1
                    key = f"{what} good request answered correctly" if ok else f"{what}: WRONG ANSWER"
                    if not ok:
                        failures.append(f"{what} #{i}: {status} {raw[:300]!r}")
            except Exception as e:  # noqa: BLE001 - a soak counts every failure
                key = f"{what}: EXCEPTION {type(e).__name__}"
                failures.append(f"{what} #{i}: {type(e).__name__}: {e}")
            with lock:
                counts[key] += 1

        rss_series: list[int] = []
        soaking = threading.Event()

        def watch():                                # resident memory every 5 s while the soak runs
            while not soaking.wait(5.0):
                rss_series.append(proc_status(server.pid)[1])
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t1 = time.time()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(run, plan))
        wall = time.time() - t1
        soaking.set()
        watcher.join(10)
        for _ in range(200):                        # the rows of the hung-up streams leave the batch
            if client.get("/health")[1]["active_rows"] == 0:
                break
            time.sleep(0.05)
        active = client.get("/health")[1]["active_rows"]
        time.sleep(0.5)
        threads, rss_end = proc_status(server.pid)
        print(f"samplec serve --demo soak: {args.requests} requests from {args.clients} clients in {wall:.1f} s")
        for k, v in sorted(counts.items()):
            print(f"  {v:6d}  {k}")
        print(f"  rows left in the batch: {active}; server threads idle after warm-up {idle_threads}, after {threads}")
        print(f"  resident memory after warm-up {rss_warm / 1024:.0f} MiB, at the end {rss_end / 1024:.0f} MiB")
        print("  resident memory every 5 s during the soak (MiB): "
              + " ".join(f"{r / 1024:.0f}" for r in rss_series))
        for f in failures[:20]:
            print("  FAIL", f)
        ok = not failures and active == 0 and threads <= idle_threads
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
