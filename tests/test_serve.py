"""`samplec serve` over real HTTP on loopback, with the small random model (`--demo`): seeded requests batched and
giving exactly the tokens each gives alone, one program call per step for a batch with different values, bad
sampling values answered 400 naming the field while the server keeps serving."""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("mlx_lm")

from samplec import serve  # noqa: E402


@pytest.fixture(scope="module")
def server():
    ready = threading.Event()
    box = {}

    def on_ready(httpd, sampler):
        box.update(httpd=httpd, sampler=sampler)
        ready.set()
    t = threading.Thread(target=serve.serve, args=(["--host", "127.0.0.1", "--port", "0"], [], True, on_ready),
                         daemon=True)
    t.start()
    assert ready.wait(120), "the server did not start"
    host, port = box["httpd"].server_address[:2]
    box["url"] = f"http://{host}:{port}/v1/completions"
    yield box
    box["httpd"].shutdown()
    t.join(60)


def post(url: str, body, timeout: float = 120):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


REQUESTS = [dict(prompt="A sampler chain", max_tokens=12, temperature=0.8, seed=1),
            dict(prompt="The compiler reads", max_tokens=12, temperature=1.2, top_p=0.9, seed=2),
            dict(prompt="Quick brown foxes", max_tokens=12, temperature=0.7, top_k=20, min_p=0.05, seed=3,
                 repetition_penalty=1.3),
            dict(prompt="counting one, two", max_tokens=12, temperature=0.0),
            dict(prompt="A sampler chain", max_tokens=12, temperature=1.0, seed=5, logit_bias={"7": -100.0},
                 presence_penalty=0.5, frequency_penalty=0.3)]


def test_concurrent_seeded_requests_give_the_tokens_each_gives_alone(server):
    alone = [post(server["url"], r)[1]["choices"][0]["text"] for r in REQUESTS]
    calls_before = server["sampler"].calls
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        together = list(pool.map(lambda r: post(server["url"], r), REQUESTS))
    assert [s for s, _ in together] == [200] * len(REQUESTS)
    assert [b["choices"][0]["text"] for _, b in together] == alone
    assert alone[0] != alone[4] or REQUESTS[0] == REQUESTS[4]      # (different values: different draws)
    steps = server["sampler"].calls - calls_before
    generated = sum(b["usage"]["completion_tokens"] for _, b in together)
    assert server["sampler"].widest >= 2 and steps < generated, (steps, generated)


@pytest.mark.parametrize("body, field", [
    (dict(prompt="x", max_tokens=4, temperature=-1.0), "temperature"),
    (b'{"prompt": "x", "max_tokens": 4, "temperature": NaN}', "temperature"),
    (dict(prompt="x", max_tokens=4, top_p=1.5), "top_p"),
    (dict(prompt="x", max_tokens=4, seed=-3), "seed"),
    (dict(prompt="x", max_tokens=4, logit_bias={"-3": 1.0}), "logit_bias"),
    (dict(prompt="x", max_tokens=4, samplec_sampler="nope"), "samplec_sampler"),
    (dict(prompt="x", max_tokens=10**9), "max_tokens"),
    (dict(prompt="x", max_tokens=4, top_logprobs=1000), "top_logprobs"),
    (b'{"prompt": "x", "max_tokens": ', "JSON"),
])
def test_bad_values_are_400_naming_the_field_and_the_server_keeps_serving(server, body, field):
    status, answer = post(server["url"], body)
    assert status == 400 and field in answer.get("error", ""), (status, answer)
    status, answer = post(server["url"], dict(prompt="still here", max_tokens=3, temperature=0.5, seed=9))
    assert status == 200 and answer["usage"]["completion_tokens"] == 3


def test_disconnects_and_bursts_leave_the_others_unchanged(server):
    """A client that goes away mid-stream, then a burst of concurrent requests with every kind of value: every
    answer is 200 or 400, and a seeded request gives the tokens it gave alone."""
    import socket
    host, port = server["httpd"].server_address[:2]
    for _ in range(3):                                   # ask for a long stream, read a little, hang up
        s = socket.create_connection((host, port), timeout=30)
        body = json.dumps(dict(prompt="A sampler chain", max_tokens=200, stream=True, temperature=0.9,
                               seed=11)).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        s.recv(64)
        s.close()
    want = post(server["url"], REQUESTS[1])[1]["choices"][0]["text"]
    burst = [dict(r, seed=i) if "seed" in r else r for i, r in enumerate(REQUESTS * 3)]
    burst += [dict(prompt="x", max_tokens=3, top_p=7), b"{not json", dict(prompt="y", max_tokens=2, top_k=-5)]
    burst.append(REQUESTS[1])
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda r: post(server["url"], r), burst))
    assert all(s in (200, 400) for s, _ in answers), [s for s, _ in answers]
    assert answers[-1][0] == 200 and answers[-1][1]["choices"][0]["text"] == want


def test_logprobs_of_the_model_and_of_the_chain(server):
    """With logprobs, each token carries mlx-lm's `logprob` (the model's distribution) and samplec's
    `processed_logprob` (the distribution the chain sampled from): 0 for a greedy row, and never below the model's
    for a token kept by a top_k cut (the cut only removes mass)."""
    status, greedy = post(server["url"], dict(prompt="A sampler chain", max_tokens=4, temperature=0.0,
                                              logprobs=True))
    assert status == 200
    content = greedy["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(e["processed_logprob"] == 0.0 for e in content), content
    status, cut = post(server["url"], dict(prompt="A sampler chain", max_tokens=4, temperature=1.0, top_k=5,
                                           seed=3, logprobs=True))
    content = cut["choices"][0]["logprobs"]["content"]
    assert all(e["processed_logprob"] >= e["logprob"] - 1e-4 for e in content), content


@pytest.mark.parametrize("fields", [
    dict(repetition_penalty=1.5, repetition_context_size=20),
    dict(repetition_penalty=1.5, repetition_context_size=0),              # 0: every token (mlx-lm's tokens[-0:])
    dict(presence_penalty=1.5, presence_context_size=40),
    dict(frequency_penalty=1.0, frequency_context_size=0, repetition_penalty=1.2, repetition_context_size=5),
    dict(xtc_probability=1.0, xtc_threshold=0.02),
    dict(top_p=0.8, min_p=0.05, top_k=10, temperature=0.7),
])
def test_server_chain_is_mlx_lms_processors_and_sampler(fields):
    """The server's chain on a request's fields gives the distribution mlx-lm's own processors and filters give
    (make_logits_processors, then apply_top_p / apply_min_p / apply_xtc / apply_top_k and the temperature):
    each penalty over its own window, a context size of 0 meaning every token, xtc applied."""
    import re
    import types

    import mlx.core as mx
    import numpy as np
    from mlx_lm import sample_utils as su
    from mlx_lm import server as S

    import samplec
    V = 64
    logits = mx.array(np.random.default_rng(0).normal(size=(1, V)).astype(np.float32) * 2)
    tokens = mx.array(np.r_[np.arange(30, 60), np.arange(0, 10)].astype(np.int32))
    samp = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, xtc_probability=0.0, xtc_threshold=0.1)
    lg = dict(logit_bias=None, repetition_penalty=0.0, repetition_context_size=20, presence_penalty=0.0,
              presence_context_size=20, frequency_penalty=0.0, frequency_context_size=20)
    samp.update({k: v for k, v in fields.items() if k in samp})
    lg.update({k: v for k, v in fields.items() if k in lg})
    args = types.SimpleNamespace(sampling=S.SamplingArguments(**samp), logits=S.LogitsProcessorArguments(**lg),
                                 seed=1)
    marker = serve.BatchSampler(serve.load_programs([])).marker(args)
    prog = samplec.compile(re.sub(r"-> [^{]*\{", "-> token, probs {", serve.SERVER_CHAIN))
    hist = np.array(tokens)[-marker.context if marker.context > 0 else 0:][None]
    ours = np.array(prog(logits, h=hist, seed=1, pos=0, **marker.values).probs)[0]

    x = logits
    for p in su.make_logits_processors(None, lg["repetition_penalty"], lg["repetition_context_size"],
                                       lg["presence_penalty"], lg["presence_context_size"],
                                       lg["frequency_penalty"], lg["frequency_context_size"]):
        x = p(tokens, x)
    lp = x - mx.logsumexp(x, keepdims=True)
    if 0 < samp["top_p"] < 1:
        lp = su.apply_top_p(lp, samp["top_p"])
    if samp["min_p"]:
        lp = su.apply_min_p(lp, samp["min_p"])
    if samp["xtc_probability"]:
        lp = su.apply_xtc(lp, samp["xtc_probability"], samp["xtc_threshold"], [])
    if samp["top_k"]:
        lp = su.apply_top_k(lp, samp["top_k"])
    y = np.array(lp / samp["temperature"], dtype=np.float64)[0]
    theirs = np.exp(y - y.max())
    theirs /= theirs.sum()
    np.testing.assert_array_equal(ours > 0, theirs > 0)
    np.testing.assert_allclose(ours, theirs, atol=2e-6)


def test_a_window_past_int32_is_every_token_and_a_failing_row_ends_its_request():
    """mlx-lm accepts any context size >= 0: past int32 it is every token (as 0 is), not a run-time error; and a
    row whose chain fails at run time ends with its end-of-sequence token (the fallback returns a token and no
    log-probability instead of raising)."""
    import types

    import mlx.core as mx
    import numpy as np
    from mlx_lm import server as S
    samp = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, xtc_probability=0.0, xtc_threshold=0.1)
    lg = dict(logit_bias=None, repetition_penalty=1.3, repetition_context_size=3_000_000_000,
              presence_penalty=0.0, presence_context_size=20, frequency_penalty=0.0, frequency_context_size=0)
    args = types.SimpleNamespace(sampling=S.SamplingArguments(**samp), logits=S.LogitsProcessorArguments(**lg),
                                 seed=1)
    sampler = serve.BatchSampler(serve.load_programs([]))
    marker = sampler.marker(args)
    assert marker.values["repetition_context_size"] == -1 and marker.values["frequency_context_size"] == -1
    assert marker.context == -1
    x = np.random.default_rng(0).normal(size=(1, 64)).astype(np.float32)
    x[0, :10] += 3.0                        # (the history's tokens lead until the penalty over all of them)
    marker(mx.array(np.arange(10, dtype=np.int32)), mx.array(x))
    pen = x[0].copy()
    pen[:10] = np.where(pen[:10] > 0, pen[:10] / np.float32(1.3), pen[:10] * np.float32(1.3))
    assert np.array(sampler(mx.array(x))).tolist() == [int(np.argmax(pen))]
    marker.eos = 7
    marker(mx.array(np.arange(10, dtype=np.int32)), mx.full((1, 64), float("nan")))
    assert np.array(sampler(mx.zeros((1, 64)))).tolist() == [7]
    assert marker.logprobs[-1] is None


@pytest.mark.parametrize("argv, message", [
    (["--port", "99999"], "--port 99999: a port number lies in 0..65535"),
    (["--model", "/nonexistent/model"], "cannot load the model '/nonexistent/model'"),
    (["taken"], "cannot listen on 127.0.0.1:"),
])
def test_start_up_errors_exit_at_once_with_one_line(server, argv, message):
    """A port in use, a port out of range, a model that cannot load: one line, exit 1, before anything listens
    (the generation thread started first and kept the process alive after the error)."""
    import subprocess
    import sys
    if argv == ["taken"]:
        argv = ["--demo", "--port", str(server["httpd"].server_address[1])]
    run = subprocess.run([sys.executable, "-m", "samplec", "serve", "--host", "127.0.0.1", *argv],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
    assert message in run.stderr and "Traceback" not in run.stderr and "listening" not in run.stderr, run.stderr
