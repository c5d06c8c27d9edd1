"""Fuzz `samplec serve` (the demo model, in this process, on a loopback port): malformed JSON, wrong types, absurd
max_tokens / top_logprobs, bad sampling values, unknown chains, tools and tool choices, the Responses API's fields,
clients that hang up mid-stream, and bursts of concurrent requests on the three endpoints. A 4xx answer naming the problem is 'rejected'; a 5xx, a dead server or a refused connection
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


TOOL = {"type": "function", "function": {"name": "count", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
# chat's tools and the fields beside them: (field, value) good and bad
CHAT_GOOD = [("tools", [TOOL]), ("tool_choice", "none"), ("tool_choice", "required"),
             ("tool_choice", {"type": "function", "function": {"name": "count"}}), ("parallel_tool_calls", False),
             ("include_reasoning", False), ("reasoning_effort", "low"), ("bad_words", ["the", " a"]),
             ("echo", True), ("prompt_logprobs", 2), ("logprobs", True)]
CHAT_BAD = [("tools", {"count": 1}), ("tools", [{"type": "function", "function": {}}]), ("tools", [TOOL, TOOL]),
            ("tool_choice", "sometimes"), ("tool_choice", {"type": "function", "function": {"name": "nope"}}),
            ("parallel_tool_calls", "yes"), ("include_reasoning", 1), ("reasoning_effort", "max"),
            ("bad_words", [3]), ("prompt_logprobs", 99), ("messages", [{"role": "tool", "content": 5}]),
            ("messages", [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "x"}}]}])]
# the Responses API's fields
RESP_GOOD = [("instructions", "Be brief."), ("text", {"format": {"type": "json_object"}}),
             ("tools", [{"type": "function", "name": "count", "parameters": TOOL["function"]["parameters"]}]),
             ("include", ["message.output_text.logprobs"]), ("top_logprobs", 3), ("store", False),
             ("reasoning", {"effort": "low"}), ("temperature", 0.5),
             ("input", [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                        {"type": "function_call", "call_id": "c", "name": "count", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": "c", "output": "3"}])]
RESP_BAD = [("input", 5), ("input", []), ("input", [{"type": "image"}]), ("max_output_tokens", 0),
            ("text", {"format": {"type": "xml"}}), ("tools", [{"type": "web_search"}]), ("include", ["nope"]),
            ("previous_response_id", "resp_never"), ("n", 2), ("messages", []), ("truncation", "auto"),
            ("tool_choice", {"type": "function"}), ("top_logprobs", 30), ("conversation", "c")]


def case(rng: random.Random):
    """(path, body, expect): expect 'bad' (4xx) or 'good' (200)."""
    r = rng.random()
    if r < 0.3:         # (chat, with tools and the fields beside them)
        body = dict(messages=[{"role": "user", "content": rng.choice(["Count", "hi"])}], max_tokens=rng.randint(1, 24),
                    seed=rng.randrange(2**32), temperature=rng.choice([0.0, 0.7, 1.2]))
        body.update(rng.sample(CHAT_GOOD, rng.randint(0, 3)))
        if body.get("tool_choice") not in (None, "none") and "tools" not in body:
            body["tools"] = [TOOL]
        if "tools" in body and "tool_choice" not in body:       # (auto needs a tool-call format: the demo's has none)
            body["tool_choice"] = rng.choice(["none", "required"])
        if body.get("tool_choice") not in (None, "none"):       # (bans could leave a forced call's grammar no token)
            body.pop("bad_words", None)
        return ("/v1/chat/completions", *_spoiled(body, CHAT_BAD, rng))
    if r < 0.45:        # (the Responses API)
        body = dict(input=rng.choice(["Count", "hi"]), max_output_tokens=rng.randint(1, 24),
                    seed=rng.randrange(2**32), stream=rng.random() < 0.3)
        body.update(rng.sample(RESP_GOOD, rng.randint(0, 3)))
        if "tools" in body:         # (a forced call: auto needs a tool-call format; one constraint a request)
            body["tool_choice"] = "required"
            body.pop("text", None)
        return ("/v1/responses", *_spoiled(body, RESP_BAD, rng))
    return "/v1/completions", *_completion(rng)


def _spoiled(body: dict, bad: list, rng: random.Random):
    """(body, expect): half the time one of `bad`'s fields set over it."""
    if rng.random() < 0.5:
        name, value = rng.choice(bad)
        return {**body, name: value}, "bad"
    return body, "good"


def _completion(rng: random.Random):
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
    base = f"http://{host}:{port}"
    url = base + "/v1/completions"
    want = json.loads(post(url, CONTROL)[1])["choices"][0]["text"]
    deadline = Deadline(seconds)
    try:
        with ThreadPoolExecutor(8) as pool:
            while deadline:
                if rng.random() < 0.1:
                    hang_up(host, port, rng)
                batch = [case(rng) for _ in range(rng.randint(1, 12))]
                results = list(pool.map(lambda c: _one(base + c[0], c[1]), batch))
                for (_, body, expect), (status, text) in zip(batch, results):
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
