"""Fuzz `samplec serve` (the demo model, in this process, on a loopback port): malformed JSON, wrong types, absurd
max_tokens / top_logprobs, bad sampling values, unknown chains, clients that hang up mid-stream, and bursts of
concurrent requests. A 4xx answer naming the problem is 'rejected'; a 5xx, a dead server or a refused connection
is a 'traceback'; over the limit is a 'hang'; 'silent' is a 200 to a bad request, or a seeded control request
whose text changes while the others run."""
from __future__ import annotations

import json
import random
import socket
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from fuzz.common import Counts, Deadline

LIMIT_S = 60.0           # per request: generation of a few tokens on the demo model under a burst
CONTROL = dict(prompt="The compiler reads", max_tokens=6, temperature=1.1, top_p=0.9, seed=4)


def start():
    from samplec import serve
    ready, box = threading.Event(), {}

    def on_ready(httpd, sampler):
        box.update(httpd=httpd, sampler=sampler)
        ready.set()
    thread = threading.Thread(target=serve.serve, args=(["--host", "127.0.0.1", "--port", "0"], [], True,
                                                         on_ready), daemon=True)
    thread.start()
    if not ready.wait(120):
        raise RuntimeError("samplec serve did not start")
    return box["httpd"], thread


def post(url, body, timeout=LIMIT_S):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


BAD = [("temperature", -1), ("temperature", "hot"), ("top_p", 3), ("top_p", "high"), ("top_k", -4), ("top_k", 1.5),
       ("min_p", 2), ("seed", -2**63 - 1), ("seed", 2**70), ("seed", "7"), ("max_tokens", 0), ("max_tokens", 10**12),
       ("top_logprobs", 99), ("logprobs", "yes"), ("logit_bias", {"-1": 1}), ("logit_bias", {"3": "x"}),
       ("logit_bias", []), ("repetition_penalty", -2), ("presence_penalty", "a"), ("samplec_sampler", "nope"),
       ("samplec_sampler", 3), ("stream", "maybe"), ("prompt", 12), ("prompt", ""), ("messages", [])]


def case(rng: random.Random):
    """(body, expect): expect 'bad' (4xx) or 'good' (200)."""
    r = rng.random()
    if r < 0.15:
        return rng.choice([b"{", b"[]", b"null", b'{"prompt": "x", "max_tokens": NaN', b"\xff\xfe",
                           b'{"prompt": "x", "max_tokens": 2' + b" " * rng.randint(0, 50)]), "bad"
    body = dict(prompt=rng.choice(["A sampler chain", "x", "quick brown"]), max_tokens=rng.randint(1, 6),
                temperature=rng.choice([0.0, 0.5, 1.0, 1.5]), top_p=rng.choice([0.0, 0.5, 0.95, 1.0]),
                top_k=rng.choice([0, 5, 50]), seed=rng.randrange(2**32))
    if r < 0.6:
        name, value = rng.choice(BAD)
        body[name] = value
        return body, "bad"
    return body, "good"


def hang_up(host, port, rng):
    s = socket.create_connection((host, port), timeout=10)
    body = json.dumps(dict(prompt="A sampler chain", max_tokens=100, stream=True, seed=rng.randrange(100))).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    s.recv(32)
    s.close()


def fuzz(seconds: float, seed: int = 0) -> Counts:
    rng = random.Random(seed)
    counts = Counts("server")
    httpd, thread = start()
    host, port = httpd.server_address[:2]
    url = f"http://{host}:{port}/v1/completions"
    want = json.loads(post(url, CONTROL)[1])["choices"][0]["text"]
    deadline = Deadline(seconds)
    try:
        with ThreadPoolExecutor(8) as pool:
            while deadline:
                if rng.random() < 0.1:
                    hang_up(host, port, rng)
                batch = [case(rng) for _ in range(rng.randint(1, 12))]
                results = list(pool.map(lambda be: _one(url, be[0]), batch))
                for (body, expect), (status, text) in zip(batch, results):
                    if status is None:
                        kind, what = ("hang" if "timed out" in text else "traceback"), text
                    elif status >= 500:
                        kind, what = "traceback", f"{status}: {text[:200]}"
                    elif expect == "bad":
                        kind, what = ("rejected", "") if 400 <= status < 500 else ("silent", f"{status} to a bad request")
                    else:
                        kind, what = ("ok", "") if status == 200 else ("traceback", f"{status}: {text[:200]}")
                    counts.record(kind, body if isinstance(body, bytes) else json.dumps(body)[:200], what)
                status, text = post(url, CONTROL)
                got = json.loads(text)["choices"][0]["text"] if status == 200 else None
                counts.record("ok" if got == want else "silent", "control", f"{status}: {got!r} != {want!r}")
    finally:
        httpd.shutdown()
        thread.join(120)            # (the generation thread stops before the process may exit)
    return counts


def _one(url, body):
    try:
        status, text = post(url, body)
        return status, text.decode("utf-8", "replace")
    except Exception as e:  # noqa: BLE001 - a refused or dropped connection, a timeout
        return None, f"{type(e).__name__}: {e}"
