"""`samplec serve --demo` over real HTTP on loopback, driven by the official `openai` client (pinned in
pyproject.toml): logprobs (the sampled token, sorted alternatives, bytes, the model's distribution), the
completions endpoint's integer logprobs, n, stop, usage, /v1/models, streaming, structured outputs, refusals that
name their field, and batching (concurrent seeded requests, constrained or not, give what each gives alone)."""
from __future__ import annotations

import json
import re
import socket
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from samplec import serve  # noqa: E402


@pytest.fixture(scope="module")
def server():
    ready = threading.Event()
    box = {}

    def on_ready(httpd, app):
        box.update(httpd=httpd, app=app)
        ready.set()
    t = threading.Thread(target=serve.serve, args=(["--host", "127.0.0.1", "--port", "0"], [], True, on_ready),
                         daemon=True)
    t.start()
    assert ready.wait(120), "the server did not start"
    host, port = box["httpd"].server_address[:2]
    box["base"] = f"http://{host}:{port}"
    box["client"] = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0, timeout=60)
    yield box
    box["httpd"].shutdown()
    t.join(60)


def post(url: str, body, timeout: float = 60):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


MSG = [{"role": "user", "content": "Count the tokens"}]


def text_of(entries) -> str:
    return b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace")


# ---- /v1/models

def test_models_lists_the_demo_model(server):
    c = server["client"]
    assert [m.id for m in c.models.list().data] == ["demo"]
    assert c.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")


# ---- logprobs

def test_chat_logprobs_are_the_sampled_tokens_with_sorted_alternatives(server):
    r = server["client"].chat.completions.create(model="demo", messages=MSG, max_tokens=12, temperature=1.0,
                                                 seed=4, logprobs=True, top_logprobs=5)
    ch = r.choices[0]
    entries = ch.logprobs.content
    assert len(entries) == r.usage.completion_tokens == 12 and ch.finish_reason == "length"
    assert text_of(entries) == ch.message.content          # each entry is the sampled token
    for e in entries:
        vals = [t.logprob for t in e.top_logprobs]
        assert len(vals) == 5 and vals == sorted(vals, reverse=True)
        assert e.logprob <= vals[0] + 1e-6
        same = [t for t in e.top_logprobs if t.token == e.token]
        if e.logprob >= vals[-1]:                             # in the top 5: the same number there
            assert same and same[0].logprob == e.logprob
        b = bytes(e.bytes)
        assert e.token == (b.decode() if b.decode("utf-8", "ignore").encode() == b else e.token)
        assert e.model_extra["processed_logprob"] <= 0


def test_logprobs_are_the_models_distribution_and_processed_is_the_chains(server):
    """The first token's logprob equals log_softmax of the model's own logits for the prompt; greedy: the sampled
    token is the first alternative and its processed log-probability is 0; a top_k cut only raises it."""
    app = server["app"]
    prompt = "A sampler chain"
    r = server["client"].completions.create(model="demo", prompt=prompt, max_tokens=4, temperature=0.0, logprobs=5)
    lp = r.choices[0].logprobs
    ids = app.tokenizer.encode(prompt)
    from mlx_lm.models.cache import make_prompt_cache
    model = app.engine.model
    logits = model(mx.array([ids]), cache=make_prompt_cache(model))[0, -1].astype(mx.float32)
    want = np.array(logits - mx.logsumexp(logits))
    first = int(np.argmax(want))
    assert lp.token_logprobs[0] == pytest.approx(float(want[first]), abs=1e-4)
    assert list(lp.top_logprobs[0].values())[0] == lp.token_logprobs[0]
    assert lp.model_extra["processed_logprobs"] == [0.0] * 4
    r = server["client"].completions.create(model="demo", prompt=prompt, max_tokens=6, temperature=1.0,
                                            seed=3, logprobs=1, extra_body={"top_k": 5})
    lp = r.choices[0].logprobs
    assert all(p >= m - 1e-5 for p, m in zip(lp.model_extra["processed_logprobs"], lp.token_logprobs))


def test_completions_integer_logprobs_have_the_legacy_shape(server):
    r = server["client"].completions.create(model="demo", prompt="The compiler reads", max_tokens=10,
                                            temperature=0.9, seed=8, logprobs=3)
    ch = r.choices[0]
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert all(isinstance(d, dict) and len(d) <= 4 for d in lp.top_logprobs)     # (the 3 and the sampled token)
    for d in lp.top_logprobs:
        assert list(d.values()) == sorted(d.values(), reverse=True)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, off in zip(lp.tokens, lp.text_offset):
        if not tok.startswith("bytes:"):
            assert ch.text[off:off + len(tok)] == tok


# ---- several prompts, echo (lm-eval-harness's loglikelihood requests)

def _model_logprobs(app, ids: list[int]) -> np.ndarray:
    """log_softmax of the model's logits at every position of `ids`, one forward pass without a cache (an
    independent computation of what echo reports)."""
    logits = app.engine.model(mx.array([ids]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def test_several_prompts_give_what_each_gives_alone_in_prompt_order(server):
    c = server["client"]
    prompts = ["A sampler chain", [5, 6, 7, 8], "The cat"]
    kw = dict(model="demo", max_tokens=6, temperature=1.0, seed=21)
    r = c.completions.create(prompt=prompts, n=2, **kw)
    assert [ch.index for ch in r.choices] == list(range(6))
    for i, ch in enumerate(r.choices):          # (choice i: prompt i // n at seed + i % n)
        alone = c.completions.create(prompt=prompts[i // 2], **{**kw, "seed": 21 + i % 2}).choices[0]
        assert (ch.text, ch.finish_reason) == (alone.text, alone.finish_reason), i
    tok = server["app"].tokenizer
    assert r.usage.prompt_tokens == len(tok.encode(prompts[0])) + 4 + len(tok.encode(prompts[2]))
    assert r.usage.completion_tokens == 36
    streamed = {}
    for chunk in c.completions.create(prompt=prompts, stream=True, **kw):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert streamed == {i: ch.text for i, ch in enumerate(c.completions.create(prompt=prompts, **kw).choices)}


def test_echo_scores_the_prompt_under_the_model(server):
    """lm-eval-harness's loglikelihood request (token ids, echo, max_tokens 1, logprobs 1, several prompts): each
    prompt token's logprob and top alternatives are log_softmax of the model's logits given the tokens before it,
    computed here by one forward pass; the first token's are null; the text is the prompt's then the completion's."""
    app, c = server["app"], server["client"]
    prompts = [[3, 70, 71, 200, 9, 44, 300, 12], [400, 1, 2], list(range(100, 100 + 150))]   # (past a chunk)
    r = c.completions.create(model="demo", prompt=prompts, max_tokens=1, logprobs=1, echo=True, temperature=0,
                             seed=1234)
    for ids, ch in zip(prompts, r.choices):
        lp = ch.logprobs
        want = _model_logprobs(app, ids)
        assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = np.array(lp.token_logprobs[1:len(ids)])
        assert np.allclose(got, want[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
        for j in range(1, len(ids)):
            best = int(np.argmax(want[j - 1]))
            top = lp.top_logprobs[j]
            assert app.format.token_text(best)[0] in top and max(top.values()) == pytest.approx(
                float(want[j - 1, best]), abs=1e-4)
            assert lp.tokens[j] == app.format.token_text(ids[j])[0]
        # (the completion's token: what the same prompt gives without echo)
        alone = c.completions.create(model="demo", prompt=ids, max_tokens=1, logprobs=1, temperature=0).choices[0]
        assert ch.text.endswith(alone.text) and lp.token_logprobs[-1] == alone.logprobs.token_logprobs[0]
        text = app.engine._decode(ids)[0]
        assert ch.text == text + alone.text and lp.text_offset[len(ids)] == len(text)
        assert lp.text_offset == sorted(lp.text_offset)
    # lm-eval-harness's reading of it (ctxlen: the context's tokens; the continuation's logprobs and greediness)
    ctx, cont = [3, 70, 71, 200], [9, 44, 300, 12]
    ch = c.completions.create(model="demo", prompt=[ctx + cont], max_tokens=1, logprobs=1, echo=True,
                              temperature=0).choices[0]
    want = _model_logprobs(app, ctx + cont)
    total = sum(ch.logprobs.token_logprobs[len(ctx):-1])
    assert total == pytest.approx(sum(float(want[len(ctx) - 1 + j, t]) for j, t in enumerate(cont)), abs=1e-3)


def test_echo_text_offsets_index_the_echoed_text(server):
    """A string whose tokens write it back only with their special tokens' text (`<s>` typed in it) is echoed as
    sent; token ids are echoed as their text; either way each token's offset points at its text."""
    c, tok = server["client"], server["app"].tokenizer
    for prompt in ("<s>hello</s> world", "plain words", [0, *tok.encode("hi"), 1, *tok.encode(" there")]):
        ch = c.completions.create(model="demo", prompt=prompt, echo=True, max_tokens=0, logprobs=0).choices[0]
        if isinstance(prompt, str):
            assert ch.text == prompt
        lp = ch.logprobs
        quiet = server["app"].engine.special_ids | server["app"].engine.eos_ids
        ids = prompt if isinstance(prompt, list) else list(server["app"].tokenizer.encode(prompt))
        for t, tok, off in zip(ids, lp.tokens, lp.text_offset):
            if isinstance(prompt, str) or t not in quiet:
                assert ch.text[off:off + len(tok)] == tok, (prompt, tok, off)


def test_a_generated_stop_token_has_its_completions_entry(server):
    """lm-eval-harness reads one generated entry after the prompt's: an end-of-sequence (or a stop_token_ids id)
    that ends the choice is listed on the completions endpoint (no text of its own), as vLLM does; chat's entries
    are the message's tokens."""
    c, eos = server["client"], min(server["app"].engine.eos_ids)
    ctx = [3, 70, 71, 200, 9, 44]
    for stream in (False, True):
        kw = dict(model="demo", prompt=[ctx], echo=True, max_tokens=1, logprobs=1, temperature=0,
                  logit_bias={str(eos): 100})
        if stream:
            chunks = [ch.choices[0] for ch in c.completions.create(**kw, stream=True) if ch.choices]
            lps = sum((ch.logprobs.token_logprobs for ch in chunks if ch.logprobs), [])
            assert chunks[-1].finish_reason == "stop" and len(lps) == len(ctx) + 1
            continue
        r = c.completions.create(**kw)
        lp = r.choices[0].logprobs
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
        assert len(lp.token_logprobs) == len(ctx) + 1 and lp.text_offset[-1] == len(r.choices[0].text)
        assert max(lp.top_logprobs[-1].values()) == lp.token_logprobs[-1]       # (greedy: it is the top one)
    r = c.completions.create(model="demo", prompt="The cat", max_tokens=5, temperature=1.0, seed=2, logprobs=0,
                             extra_body={"stop_token_ids": [65], "logit_bias": {"65": 100}})
    assert r.choices[0].finish_reason == "stop" and len(r.choices[0].logprobs.tokens) == 1
    chat = c.chat.completions.create(model="demo", messages=MSG, max_tokens=5, logprobs=True,
                                     logit_bias={str(eos): 100})
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].logprobs.content == []


def test_a_default_max_tokens_shrinks_to_each_prompts_own_room(server):
    """With a context length, a default max_tokens is the room each prompt leaves: a short prompt among long ones
    gives what it gives alone."""
    parse = server["app"].parse
    saved, parse.context = parse.context, 40
    try:
        short, long = [5, 6, 7], list(range(10, 40))
        alone = post(server["base"] + "/v1/completions", {"model": "demo", "temperature": 0, "prompt": short})[1]
        both = post(server["base"] + "/v1/completions", {"model": "demo", "temperature": 0,
                                                          "prompt": [short, long]})[1]
        assert alone["usage"]["completion_tokens"] == 16
        assert [c["text"] for c in both["choices"]][0] == alone["choices"][0]["text"]
        assert both["usage"]["completion_tokens"] == 16 + 10
        status, err = post(server["base"] + "/v1/completions", {"model": "demo", "prompt": [short, long],
                                                                 "max_tokens": 11})
        assert status == 400 and err["error"]["param"] == "max_tokens" and "prompt[1]" in err["error"]["message"]
    finally:
        parse.context = saved


def _token_id(s: str) -> int:
    assert s.startswith("token_id:"), s
    return int(s[len("token_id:"):])


def test_return_tokens_as_token_ids_names_every_logprobs_token_by_its_id(server):
    """vLLM's return_tokens_as_token_ids: each token of the logprobs -- the sampled one and the alternatives, the
    completions endpoint's `tokens` and `top_logprobs` keys, an echoed prompt's -- is written "token_id:N" (chat's
    `bytes` are that string's, as vLLM's); the ids decode to the text, the log-probabilities are the same."""
    from samplec.integrations.mlx_lm import local_tokenizer
    tok = local_tokenizer(512)
    c = server["client"]
    ids = [(i * 41) % 500 + 3 for i in range(6)]
    kw = dict(model="demo", prompt=ids, max_tokens=8, temperature=1.0, seed=8, logprobs=3, echo=True)
    plain = c.completions.create(**kw).choices[0].logprobs
    for stream in (False, True):
        got = c.completions.create(**kw, stream=stream, extra_body={"return_tokens_as_token_ids": True})
        chunks = [ch.choices[0] for ch in got] if stream else got.choices
        tokens = [t for ch in chunks for t in (ch.logprobs.tokens if ch.logprobs else [])]
        tops = [d for ch in chunks for d in (ch.logprobs.top_logprobs if ch.logprobs else [])]
        lps = [v for ch in chunks for v in (ch.logprobs.token_logprobs if ch.logprobs else [])]
        text = "".join(ch.text for ch in chunks)
        sampled = [_token_id(t) for t in tokens]
        assert sampled[:len(ids)] == ids and lps == plain.token_logprobs
        # (vLLM's text_offset: the lengths of the token strings added up -- in a stream from each chunk's first
        # entry, which is the text sent before the chunk)
        sent = 0
        for ch in chunks:
            if ch.logprobs and ch.logprobs.tokens:
                want = [sent + sum(len(t) for t in ch.logprobs.tokens[:j]) for j in range(len(ch.logprobs.tokens))]
                assert ch.logprobs.text_offset == want
            sent += len(ch.text)
        assert tok.decode(sampled) == text
        assert tops[0] is None
        for d, pd, t in zip(tops[1:], plain.top_logprobs[1:], tokens[1:]):
            assert t in d and sorted(d.values()) == sorted(pd.values())
            assert {tok.decode([_token_id(k)]) for k in d} >= {k for k in pd if not k.startswith("bytes:")}
    chat = dict(model="demo", messages=MSG, max_tokens=8, temperature=1.0, seed=8, logprobs=True, top_logprobs=2)
    plain = c.chat.completions.create(**chat).choices[0]
    for stream in (False, True):
        got = c.chat.completions.create(**chat, stream=stream, extra_body={"return_tokens_as_token_ids": True})
        chunks = [ch.choices[0] for ch in got if ch.choices] if stream else got.choices
        entries = [e for ch in chunks for e in ((ch.logprobs.content or []) if ch.logprobs else [])]
        text = "".join((ch.delta.content or "") if stream else ch.message.content for ch in chunks)
        assert text == plain.message.content and tok.decode([_token_id(e.token) for e in entries]) == text
        for e, pe in zip(entries, plain.logprobs.content, strict=True):
            assert e.bytes == list(e.token.encode()) and e.logprob == pe.logprob
            assert [a.logprob for a in e.top_logprobs] == [a.logprob for a in pe.top_logprobs]
            assert all(a.bytes == list(a.token.encode()) and _token_id(a.token) >= 0 for a in e.top_logprobs)


def test_truncate_prompt_tokens_keeps_the_last_k_prompt_tokens(server):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are the prompt -- the same completion as those
    tokens sent alone, usage counting them -- on both endpoints; -1 is the model's context length."""
    from samplec.integrations.mlx_lm import local_tokenizer
    tok = local_tokenizer(512)              # (the demo's tokenizer, loaded apart from the server's)
    c = server["client"]
    kw = dict(model="demo", max_tokens=6, temperature=1.0, seed=5, logprobs=1)
    ids = [(i * 37) % 500 + 2 for i in range(30)]
    for prompt in (ids, "A sampler chain reads the logits of every row and draws one token"):
        full = prompt if isinstance(prompt, list) else list(tok.encode(prompt))
        assert len(full) > 7
        cut = c.completions.create(prompt=prompt, extra_body={"truncate_prompt_tokens": 7}, **kw)
        alone = c.completions.create(prompt=full[-7:], **kw)
        assert cut.usage.prompt_tokens == 7 and cut.choices[0].text == alone.choices[0].text
        assert cut.choices[0].logprobs.token_logprobs == alone.choices[0].logprobs.token_logprobs
        more = c.completions.create(prompt=prompt, extra_body={"truncate_prompt_tokens": 1000}, **kw)
        assert more.usage.prompt_tokens == len(full)
    # (echo: the kept tokens, written back as their text and scored as a prompt of their own)
    e = c.completions.create(model="demo", prompt=ids, max_tokens=0, echo=True, logprobs=0,
                             extra_body={"truncate_prompt_tokens": 5}).choices[0]
    assert e.text == tok.decode(ids[-5:]) and len(e.logprobs.tokens) == 5 and e.logprobs.token_logprobs[0] is None
    # chat: the last k tokens of the templated conversation (the demo tokenizer has no template: role lines)
    chat = c.chat.completions.create(model="demo", messages=MSG, max_tokens=6, temperature=1.0, seed=5,
                                     extra_body={"truncate_prompt_tokens": 4})
    lines = list(tok.encode(f"user: {MSG[0]['content']}\nassistant:"))
    assert len(lines) > 4 and chat.usage.prompt_tokens == 4
    assert chat.choices[0].message.content == c.completions.create(prompt=lines[-4:], **kw).choices[0].text
    parse = server["app"].parse
    saved, parse.context = parse.context, 20
    try:
        url = server["base"] + "/v1/completions"
        status, r = post(url, {"model": "demo", "prompt": ids, "max_tokens": 0, "echo": True,
                               "truncate_prompt_tokens": -1})
        assert status == 200 and r["usage"]["prompt_tokens"] == 20, r
        status, err = post(url, {"model": "demo", "prompt": ids, "truncate_prompt_tokens": 21})
        assert status == 400 and err["error"]["param"] == "truncate_prompt_tokens", err
        status, r = post(url, {"model": "demo", "prompt": ids, "truncate_prompt_tokens": 12, "temperature": 0})
        assert status == 200 and r["usage"] == {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}, r
    finally:
        parse.context = saved
    status, r = post(server["base"] + "/v1/completions", {"model": "demo", "prompt": ids, "max_tokens": 1,
                                                          "truncate_prompt_tokens": -1})
    assert status == 200 and r["usage"]["prompt_tokens"] == 30      # (no context length known: every token)
    for bad in (0, -2, 2.5, True, "4"):
        status, err = post(server["base"] + "/v1/chat/completions", {"model": "demo", "messages": MSG,
                                                                     "truncate_prompt_tokens": bad})
        assert status == 400 and err["error"]["param"] == "truncate_prompt_tokens", (bad, err)


def test_min_tokens_past_a_default_max_tokens_shrunk_to_the_room_is_a_400(server):
    """vLLM checks min_tokens against the effective max_tokens: a default one that shrinks to the room a prompt
    leaves in the context bounds min_tokens too (a 400 naming it, and the prompt whose room is short), not the
    default 16 it shrank from."""
    parse = server["app"].parse
    saved, parse.context = parse.context, 40
    try:
        short, long = [5, 6, 7], list(range(10, 40))          # (rooms of 37 and 10 tokens)
        url = server["base"] + "/v1/completions"
        for prompt, where in ((long, "prompt"), ([short, long], "prompt[1]")):
            status, err = post(url, {"model": "demo", "prompt": prompt, "min_tokens": 12})
            assert status == 400 and err["error"]["param"] == "min_tokens", err
            assert where in err["error"]["message"] and "10" in err["error"]["message"]
        status, r = post(url, {"model": "demo", "prompt": [short, long], "min_tokens": 10, "temperature": 0,
                               "logit_bias": {"1": 100}})          # (end-of-sequence held off 10 tokens)
        assert status == 200 and r["usage"]["completion_tokens"] == 11 + 10, r
        assert [c["finish_reason"] for c in r["choices"]] == ["stop", "length"]
        status, err = post(server["base"] + "/v1/chat/completions", {"model": "demo", "min_tokens": 30,
                                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and err["error"]["param"] == "min_tokens" and "messages" in err["error"]["message"]
    finally:
        parse.context = saved


def test_a_long_echo_is_scored_between_the_batchs_steps(server):
    """A prompt's scoring runs a chunk at a time between the batch's decode steps: a request sent while a long
    prompt is scored is answered before it, and a scored request whose client leaves is dropped."""
    c, app = server["client"], server["app"]
    long = [int(t) for t in np.random.default_rng(3).integers(2, 500, size=1500)]
    done = []
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(lambda: (c.completions.create(model="demo", prompt=[long] * 3, echo=True, max_tokens=0,
                                                         logprobs=5), done.append("long")))
        import time
        deadline = time.monotonic() + 30
        while not app.engine.scoring and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.engine.scoring, "the long request was not being scored"
        short = c.completions.create(model="demo", prompt="quick", max_tokens=2, temperature=0)
        done.append("short")
        r = slow.result()[0]
    assert done == ["short", "long"] and short.usage.completion_tokens == 2
    assert len(r.choices) == 3 and len(r.choices[0].logprobs.token_logprobs) == 1500
    want = _model_logprobs(app, long[:300])
    assert np.allclose(r.choices[2].logprobs.token_logprobs[1:300], want[np.arange(299), long[1:300]], atol=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_stops_its_prompts_scoring(server, stream):
    """A request whose client closes the connection while its prompt is scored (nothing written yet, streaming or
    not) is dropped within a look at the socket, not scored to the end."""
    import time
    eng = server["app"].engine
    host, port = server["httpd"].server_address[:2]
    body = json.dumps(dict(model="demo", prompt=[(i * 7) % 500 + 2 for i in range(6000)], echo=True, logprobs=1,
                           max_tokens=5, stream=stream)).encode()
    s = socket.create_connection((host, port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 30
    while not eng.scoring and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.scoring
    job = eng.scoring[0]
    s.close()
    while eng.scoring and time.monotonic() < deadline + 120:
        time.sleep(0.02)
    assert not eng.scoring
    # (dropped part of the way -- its prompt's scores never completed, no row started -- where a scoring that went
    # on after its client left would have completed them: ~2-5 s of scoring on this model)
    assert job.rows[0].echo.records == [] and all(r.uid is None for r in job.rows), \
        "the scoring went on after its client left"


def test_a_prompt_positions_top_is_the_k_largest_lowest_id_first():
    """(echo's top_logprobs: exact at ties, -inf rows included, k past V; checked against a full lexsort)"""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        V = int(rng.integers(1, 40))
        row = rng.integers(-3, 3, size=V).astype(np.float32)
        if rng.random() < 0.3:
            row[rng.random(V) < 0.3] = -np.inf
        k = int(rng.integers(0, V + 2))
        ids, vals = serve._top(row, k)
        want = np.lexsort((np.arange(V), -row))[:min(k, V)]
        assert ids.tolist() == want.tolist() and vals.tolist() == row[want].tolist()
    # (the device's form, rows at once: ties at the k-th value go to the whole-row sort)
    rows = rng.integers(-4, 4, size=(64, 37)).astype(np.float32)
    rows[rng.random(rows.shape) < 0.2] = -np.inf
    for k in (0, 1, 2, 5, 36, 37, 40):
        for r, (ids, vals) in enumerate(serve._tops(mx.array(rows), k)):
            want = np.lexsort((np.arange(37), -rows[r]))[:min(k, 37)]
            assert ids.tolist() == want.tolist() and vals.tolist() == rows[r][want].tolist(), (k, r)


def test_the_servers_model_logprobs_for_a_chain_without_them():
    """(a --sampler chain without raw_logprob / top_logprobs: the server's own, against log_softmax and a full sort;
    rows with ties at the TOP-th value)"""
    rng = np.random.default_rng(1)
    x = rng.integers(-5, 5, size=(4, 300)).astype(np.float32)
    tokens = [3, 0, 299, 17]
    raw, ids, vals = serve.model_logprobs(mx.array(x), tokens)
    lp = np.array(mx.array(x) - mx.logsumexp(mx.array(x), axis=-1, keepdims=True))
    assert np.allclose(raw, lp[np.arange(4), tokens])
    for r in range(4):
        want = np.lexsort((np.arange(300), -lp[r]))[:serve.TOP]
        assert ids[r].tolist() == want.tolist() and vals[r].tolist() == lp[r][want].tolist()


def test_echo_with_max_tokens_0_is_the_prompt_alone_and_streams_the_same(server):
    app, c = server["app"], server["client"]
    kw = dict(model="demo", prompt=["The cat sat", [7, 8, 9]], max_tokens=0, echo=True, logprobs=3,
              extra_body={"logit_bias": {"65": 5.0}})
    r = c.completions.create(**kw)
    tok = app.tokenizer
    assert [ch.text for ch in r.choices] == ["The cat sat", app.engine._decode([7, 8, 9])[0]]
    assert [ch.finish_reason for ch in r.choices] == ["length", "length"]
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(tok.encode("The cat sat")) + 3
    ids = list(tok.encode("The cat sat"))
    want = _model_logprobs(app, ids)        # (the model's own distribution: the request's logit_bias is not in it)
    lp = r.choices[0].logprobs
    assert np.allclose(lp.token_logprobs[1:], want[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
    assert all(len(d) <= 4 for d in lp.top_logprobs[1:])
    chunks = list(c.completions.create(**kw, stream=True))
    got = {}
    for chunk in chunks:
        for ch in chunk.choices:
            e = got.setdefault(ch.index, ["", [], None])
            e[0] += ch.text
            e[1] += ch.logprobs.token_logprobs if ch.logprobs else []
            e[2] = ch.finish_reason or e[2]
    assert got == {i: [ch.text, ch.logprobs.token_logprobs, "length"] for i, ch in enumerate(r.choices)}


def test_echo_streams_the_prompt_first_then_the_completion(server):
    c = server["client"]
    kw = dict(model="demo", prompt="A sampler chain", max_tokens=5, temperature=1.0, seed=4, echo=True, logprobs=2)
    whole = c.completions.create(**kw).choices[0]
    chunks = [ch.choices[0] for ch in c.completions.create(**kw, stream=True) if ch.choices]
    assert chunks[0].text == "A sampler chain"
    assert "".join(ch.text for ch in chunks) == whole.text
    assert sum((ch.logprobs.text_offset for ch in chunks), []) == whole.logprobs.text_offset
    plain = c.completions.create(**{**kw, "echo": False}).choices[0]
    assert whole.text == "A sampler chain" + plain.text
    assert whole.logprobs.token_logprobs[-5:] == plain.logprobs.token_logprobs


def _check_prompt_logprobs(app, ids: list[int], plp: list, n: int) -> None:
    """vLLM's prompt_logprobs of one prompt against log_softmax of the model's logits (one forward pass here): null
    first, then per token {id: {logprob, rank, decoded_token}} holding the prompt's token first (its rank: how many
    tokens are at least as likely) and the n most likely tokens (ranks 1 .. n)."""
    want = _model_logprobs(app, ids)
    assert len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):
        d, row = plp[j], want[j - 1]
        assert list(d)[0] == str(ids[j])
        own = d[str(ids[j])]
        assert own["logprob"] == pytest.approx(float(row[ids[j]]), abs=1e-4)
        assert np.sum(row >= own["logprob"] + 1e-4) < own["rank"] <= np.sum(row >= own["logprob"] - 1e-4)
        top = {int(k): v for k, v in d.items() if v["rank"] <= n}
        assert sorted(v["rank"] for v in top.values()) == list(range(1, n + 1))
        assert len(d) == n + (ids[j] not in top)
        assert np.allclose(sorted((v["logprob"] for v in top.values()), reverse=True), np.sort(row)[::-1][:n],
                           atol=1e-4)
        for k, v in d.items():
            assert v["decoded_token"] == app.format.token_text(int(k))[0]
            assert v["logprob"] == pytest.approx(float(row[int(k)]), abs=1e-4)


def test_vllms_prompt_logprobs_score_each_prompt_token_under_the_model(server):
    """vLLM's prompt_logprobs on both endpoints -- each completions choice its own prompt's, chat's on the answer --
    with echo's logprobs from the same scoring; 0 lists the prompt's tokens alone; past 20 (-1, vLLM's whole
    vocabulary, too) or with a stream (but 0) a 400 naming it."""
    app, url = server["app"], server["base"]
    prompts = ["A sampler chain", [400, 1, 2, 77, 300]]
    status, r = post(url + "/v1/completions", {"model": "demo", "prompt": prompts, "n": 2, "max_tokens": 2,
                                               "temperature": 0, "prompt_logprobs": 3})
    assert status == 200, r
    for ch in r["choices"]:
        p = prompts[ch["index"] // 2]
        _check_prompt_logprobs(app, app.tokenizer.encode(p) if isinstance(p, str) else p, ch["prompt_logprobs"], 3)
    chat = {"model": "demo", "messages": MSG, "max_tokens": 2, "temperature": 0}
    status, r = post(url + "/v1/chat/completions", {**chat, "prompt_logprobs": 2})
    ids = app.parse("chat", chat).prompts[0]
    assert status == 200 and "prompt_logprobs" not in r["choices"][0]
    _check_prompt_logprobs(app, ids, r["prompt_logprobs"], 2)
    status, r = post(url + "/v1/completions", {"model": "demo", "prompt": prompts[1], "max_tokens": 1,
                                               "prompt_logprobs": 0, "echo": True, "logprobs": 1})
    assert all(len(d) == 1 for d in r["choices"][0]["prompt_logprobs"][1:])
    assert all(len(d) <= 2 for d in r["choices"][0]["logprobs"]["top_logprobs"][1:])
    status, r = post(url + "/v1/completions", {"model": "demo", "prompt": prompts[1], "max_tokens": 1,
                                               "prompt_logprobs": 5, "echo": True, "logprobs": 1})
    _check_prompt_logprobs(app, prompts[1], r["choices"][0]["prompt_logprobs"], 5)
    assert all(len(d) <= 2 for d in r["choices"][0]["logprobs"]["top_logprobs"][1:])   # (echo's own top 1)
    status, r = post(url + "/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 2})
    assert "prompt_logprobs" not in r["choices"][0]
    chunks = list(server["client"].completions.create(model="demo", prompt="x", max_tokens=2, stream=True,
                                                      extra_body={"prompt_logprobs": 0}))
    assert chunks[-1].choices[0].finish_reason == "length"
    for body in ({"prompt_logprobs": -1}, {"prompt_logprobs": 21}, {"prompt_logprobs": -2},
                 {"prompt_logprobs": "1"}, {"prompt_logprobs": True}, {"prompt_logprobs": 1, "stream": True}):
        for path, base in (("/v1/completions", {"model": "demo", "prompt": "x"}), ("/v1/chat/completions", chat)):
            status, err = post(url + path, {**base, **body})
            assert status == 400 and err["error"]["param"] == "prompt_logprobs", (body, err)
    import copy
    parse = copy.copy(app.parse)
    parse.sharded = True
    with pytest.raises(serve.BadRequest) as err:
        parse("completion", {"prompt": "x", "prompt_logprobs": 1})
    assert err.value.param == "prompt_logprobs"


def test_echo_logprobs_are_refused_by_a_vocabulary_sharded_server(server):
    import copy
    parse = copy.copy(server["app"].parse)
    parse.sharded = True        # (the prompt's distribution would need every rank's slice of the logits)
    with pytest.raises(serve.BadRequest) as err:
        parse("completion", {"prompt": "x", "echo": True, "logprobs": 1})
    assert err.value.param == "echo"
    assert parse("completion", {"prompt": ["x", "y"], "echo": True}).echo       # (the text alone: served)


@pytest.mark.parametrize("body,param", [
    (dict(prompt="x", max_tokens=0), "max_tokens"),
    (dict(prompt=["x"] * 65), "prompt"),
    (dict(prompt=["x"] * 20, n=16), "n"),
    (dict(prompt=[[1, 2], []]), "prompt"),
    (dict(prompt=["x", ""]), "prompt"),
    (dict(prompt=[[1, 2], [99999]]), "prompt"),
    (dict(prompt=["x", 3]), "prompt"),
    (dict(prompt="x", echo="yes"), "echo"),
    (dict(prompt="x", ignore_eos=1), "ignore_eos"),
])
def test_bad_prompts_and_echo_are_400_naming_the_field(server, body, param):
    status, answer = post(server["base"] + "/v1/completions", {"model": "demo", **body})
    assert status == 400 and answer["error"]["param"] == param, answer
    status, answer = post(server["base"] + "/v1/chat/completions", {"model": "demo", "messages": MSG,
                                                                     "echo": "yes"})
    assert status == 400 and answer["error"]["param"] == "echo", answer


# ---- n, seeds, stop, usage

def test_n_choices_are_rows_of_one_request_with_derived_seeds(server):
    c = server["client"]
    r = c.completions.create(model="demo", prompt="A sampler chain", max_tokens=8, temperature=1.0, seed=40, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    texts = [ch.text for ch in r.choices]
    for i, t in enumerate(texts):            # choice i samples with seed + i
        alone = c.completions.create(model="demo", prompt="A sampler chain", max_tokens=8, temperature=1.0,
                                     seed=40 + i)
        assert alone.choices[0].text == t
    assert len(set(texts)) > 1
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(server["app"].tokenizer.encode(
        "A sampler chain"))
    chat = c.chat.completions.create(model="demo", messages=MSG, max_tokens=5, temperature=1.0, seed=2, n=2)
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == 10


def test_stop_ends_the_text_before_a_stop_string_that_spans_tokens(server):
    c = server["client"]
    kw = dict(model="demo", prompt="Quick brown foxes", max_tokens=30, temperature=1.0, seed=12, logprobs=0)
    full = c.completions.create(**kw).choices[0]
    offs = full.logprobs.text_offset
    cut = next(o for o in offs[3:] if o > 2)                # a token boundary inside the text
    stop = full.text[cut - 2:cut + 1]                       # two characters of one token, one of the next
    assert stop not in full.text[:cut - 2]
    for s in (stop, [stop, "\u2603never"]):
        r = c.completions.create(**{**kw, "stop": s}).choices[0]
        assert r.text == full.text[:full.text.index(stop)] and r.finish_reason == "stop"
        assert len(r.logprobs.tokens) == sum(1 for o in offs if o < len(r.text))
        streamed = list(c.completions.create(**{**kw, "stop": s}, stream=True))
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == r.text
        assert [ch.choices[0].finish_reason for ch in streamed if ch.choices][-1] == "stop"


def test_min_tokens_holds_stop_strings_off_too_as_vllms(server):
    """vLLM looks for stop strings only once a choice has more than min_tokens tokens (its detokenizer: a stop
    string that ends in the first min_tokens tokens' text does not stop it): the text ends at the first one
    that ends past them, streamed alike."""
    c = server["client"]
    k = 4
    for seed in range(20):
        kw = dict(model="demo", prompt="Quick brown foxes", max_tokens=30, temperature=1.0, seed=seed,
                  extra_body={"min_tokens": k})
        base = c.completions.create(**kw, logprobs=0).choices[0]
        held = base.text[:base.logprobs.text_offset[k]]
        later = base.text[base.logprobs.text_offset[k]:]
        stop = next((ch for ch in held if ch in later and ch != "\ufffd"), None)
        if stop is not None:
            break
    want = base.text[:base.text.index(stop, base.logprobs.text_offset[k])]
    r = c.completions.create(**kw, stop=stop).choices[0]
    assert r.text == want and r.finish_reason == "stop"
    streamed = [ch.choices[0] for ch in c.completions.create(**kw, stop=stop, stream=True)]
    assert "".join(x.text for x in streamed) == want and streamed[-1].finish_reason == "stop"
    kw["extra_body"] = {}                                   # (without min_tokens: the first one stops it)
    assert c.completions.create(**kw, stop=stop).choices[0].text == base.text[:base.text.index(stop)]


def test_vllms_include_stop_str_in_output_keeps_the_stop_string_and_stop_token(server):
    """vLLM's include_stop_str_in_output: the text ends just after the first stop string (streamed alike, nothing
    held back past it), and a stop_token_ids token that ends a choice writes its text."""
    c = server["client"]
    kw = dict(model="demo", prompt="Quick brown foxes", max_tokens=30, temperature=1.0, seed=12, logprobs=0)
    full = c.completions.create(**kw).choices[0]
    offs = full.logprobs.text_offset
    cut = next(o for o in offs[3:] if o > 2)
    stop = full.text[cut - 2:cut + 1]                       # (spans two tokens)
    want = full.text[:full.text.index(stop) + len(stop)]
    on = {"include_stop_str_in_output": True}
    r = c.completions.create(**kw, stop=[stop, "\u2603never"], extra_body=on).choices[0]
    assert r.text == want and r.finish_reason == "stop"
    assert len(r.logprobs.tokens) == sum(1 for o in offs if o < len(want))
    streamed = [ch.choices[0] for ch in c.completions.create(**kw, stop=stop, stream=True, extra_body=on)]
    assert "".join(x.text for x in streamed) == want and streamed[-1].finish_reason == "stop"
    chat = dict(model="demo", messages=MSG, max_tokens=20, temperature=1.0, seed=3)
    text = c.chat.completions.create(**chat).choices[0].message.content
    stop = text[4:6]
    r = c.chat.completions.create(**chat, stop=stop, logprobs=True, extra_body=on).choices[0]
    assert r.message.content == text[:text.index(stop) + 2] and r.finish_reason == "stop"
    assert text_of(r.logprobs.content).startswith(r.message.content)
    # a stop token's text: kept with the field, left out without it
    k = next(k for k in range(1, 6) if full.logprobs.tokens[k] not in full.logprobs.tokens[:k])
    fmt = server["app"].format
    ids = [i for i in range(512) if fmt.token_text(i)[0] == full.logprobs.tokens[k]]
    upto = "".join(full.logprobs.tokens[:k])
    for extra, text in (({}, upto), (on, upto + full.logprobs.tokens[k])):
        r = c.completions.create(**kw, extra_body={"stop_token_ids": ids, **extra}).choices[0]
        assert r.finish_reason == "stop" and r.text == text and len(r.logprobs.tokens) == k + 1


def test_vllms_skip_special_tokens_false_writes_special_tokens(server):
    """vLLM's skip_special_tokens (default true: special tokens write no text); false: they write their text --
    an end-of-sequence that ends the choice still writes none unless include_stop_str_in_output."""
    c = server["client"]
    off = {"skip_special_tokens": False}
    r = c.chat.completions.create(model="demo", messages=MSG, max_tokens=3, temperature=0, logit_bias={"0": 100},
                                  logprobs=True, extra_body=off).choices[0]
    assert r.message.content == "<s>" * 3 and text_of(r.logprobs.content) == r.message.content
    kw = dict(model="demo", prompt="hi", max_tokens=3, temperature=0)
    assert c.completions.create(**kw, logit_bias={"0": 100}, extra_body={"skip_special_tokens": True}) \
        .choices[0].text == ""
    streamed = c.completions.create(**kw, logit_bias={"0": 100}, extra_body=off, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == "<s>" * 3
    r = c.completions.create(**kw, logit_bias={"1": 100}, extra_body=off).choices[0]         # (</s>: it ends)
    assert r.text == "" and r.finish_reason == "stop"
    r = c.completions.create(**kw, logit_bias={"1": 100}, extra_body={**off, "include_stop_str_in_output": True})
    assert r.choices[0].text == "</s>" and r.choices[0].finish_reason == "stop"
    r = c.completions.create(**kw, logit_bias={"1": 100}, extra_body={**off, "ignore_eos": True}).choices[0]
    assert r.text == "</s>" * 3 and r.finish_reason == "length"
    r = c.completions.create(model="demo", prompt=[0, 104, 105], max_tokens=0, echo=True, extra_body=off)
    assert r.choices[0].text.startswith("<s>")
    for bad in ({"skip_special_tokens": 1}, {"include_stop_str_in_output": "yes"}):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(**kw, extra_body=bad)
        assert e.value.body["param"] == next(iter(bad))


def test_vllms_spaces_between_special_tokens_is_accepted_and_changes_no_text(server):
    """spaces_between_special_tokens: true or false, the text is the same -- each token writes its own bytes, so
    special tokens written one after another (skip_special_tokens false) have no space between them either way, as
    vLLM's detokenizer for fast tokenizers writes them."""
    c = server["client"]
    kw = dict(model="demo", prompt=[0, 1, 0, 5, 6], max_tokens=6, temperature=1.0, seed=3, echo=True)
    for skip in (True, False):
        base = c.completions.create(**kw, extra_body={"skip_special_tokens": skip}).choices[0].text
        assert ("<s></s><s>" in base) == (not skip)
        for between in (True, False):
            assert c.completions.create(**kw, extra_body={"skip_special_tokens": skip,
                                                          "spaces_between_special_tokens": between}
                                        ).choices[0].text == base


def test_a_stop_string_that_ends_in_a_replaced_byte_is_found(server):
    """A token that ends a pending UTF-8 sequence early adds its U+FFFD before its own text: a stop string that
    ends there is found too."""
    c = server["client"]
    kw = dict(model="demo", prompt="The cat", max_tokens=24, temperature=1.0, seed=12)
    full = c.completions.create(**kw).choices[0].text
    ends = [i for i, ch in enumerate(full) if ch == "\ufffd" and i >= 2]
    assert len(ends) >= 2, full            # (the demo model's text at this seed has some: '..za\ufffd$\ufffdavo')
    for i in ends:                          # (each a stop string of three characters ending in one)
        stop = full[i - 2:i + 1]
        r = c.completions.create(**kw, stop=stop).choices[0]
        assert r.text == full[:full.index(stop)] and r.finish_reason == "stop", (stop, r.text)


def test_ignore_eos_decodes_past_end_of_sequence(server):
    """vLLM's ignore_eos: end-of-sequence (here made certain by a logit_bias) no longer ends the choice, writes no
    text and is counted; stop_token_ids still end it."""
    c = server["client"]
    eos = min(server["app"].engine.eos_ids)
    kw = dict(model="demo", prompt="A sampler chain", max_tokens=7, temperature=1.0, seed=3, logprobs=0,
              logit_bias={str(eos): 100})
    r = c.completions.create(**kw)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 1)
    for stream in (False, True):
        r = c.completions.create(**kw, extra_body={"ignore_eos": True}, stream=stream)
        if stream:
            r = list(r)
            assert "".join(ch.choices[0].text for ch in r if ch.choices) == ""
            assert [ch.choices[0].finish_reason for ch in r if ch.choices][-1] == "length"
            continue
        assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "length", 7)
        assert len(r.choices[0].logprobs.tokens) == 7
    r = c.completions.create(**kw, extra_body={"ignore_eos": True, "stop_token_ids": [eos]})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 1)
    # (without the bias: what the request gives without ignore_eos, up to where end-of-sequence would end it)
    kw = dict(model="demo", prompt="The cat", max_tokens=40, temperature=1.0, seed=12)
    plain = c.completions.create(**kw).choices[0]
    longer = c.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0]
    assert longer.text.startswith(plain.text) and longer.finish_reason == "length"


def test_openai_seed_and_stop_forms(server):
    c = server["client"]
    kw = dict(model="demo", prompt="A sampler chain", max_tokens=6, temperature=1.0)
    assert c.completions.create(**kw, seed=-1).choices[0].text == \
        c.completions.create(**kw, seed=2**64 - 1).choices[0].text          # (modulo 2^64)
    plain = c.completions.create(**kw, seed=5).choices[0]
    for stop in ("", [""]):                                                 # (an empty stop string stops nothing)
        r = c.completions.create(**kw, seed=5, stop=stop).choices[0]
        assert (r.text, r.finish_reason) == (plain.text, plain.finish_reason)


def test_top_p_0_keeps_the_most_likely_token(server):
    c = server["client"]
    kw = dict(model="demo", prompt="Quick brown foxes", max_tokens=10)
    greedy = c.completions.create(**kw, temperature=0).choices[0].text
    assert c.completions.create(**kw, temperature=1.0, top_p=0, seed=3).choices[0].text == greedy
    assert c.completions.create(**kw, temperature=1.0, seed=3).choices[0].text != greedy
    # (a top_p that float32 holds as 0 or a subnormal: the most likely token alone too, not a failed chain)
    for tiny in (1e-40, 1e-46, 5e-324):
        assert c.completions.create(**kw, temperature=1.0, top_p=tiny, seed=3).choices[0].text == greedy


def test_special_tokens_write_no_text(server):
    """A special token that does not end the sequence (the demo tokenizer's <s>, id 0) adds nothing to the text,
    as vLLM's skip_special_tokens default; the logprobs still name it."""
    c = server["client"]
    r = c.chat.completions.create(model="demo", messages=MSG, max_tokens=3, temperature=0, logit_bias={"0": 100},
                                  logprobs=True).choices[0]
    assert r.message.content == "" and [e.token for e in r.logprobs.content] == ["<s>"] * 3
    r = c.completions.create(model="demo", prompt="hi", max_tokens=3, temperature=0, logit_bias={"0": 100})
    assert r.choices[0].text == "" and r.usage.completion_tokens == 3


def test_vllms_stop_token_ids_and_min_tokens(server):
    """stop_token_ids end a choice as end-of-sequence does (finish "stop", the token counted, no text of it);
    min_tokens holds end-of-sequence and the stop ids off until that many tokens are drawn."""
    c = server["client"]
    kw = dict(model="demo", prompt="Quick brown foxes", temperature=1.0, seed=8)
    first = c.completions.create(**kw, max_tokens=6, logprobs=0).choices[0]
    tokens = first.logprobs.tokens
    assert first.finish_reason == "length" and len(tokens) == 6
    k = next(k for k in range(1, 6) if tokens[k] not in tokens[:k])
    fmt = server["app"].format
    ids = [i for i in range(512) if fmt.token_text(i)[0] == tokens[k]]
    r = c.completions.create(**kw, max_tokens=6, extra_body={"stop_token_ids": ids}).choices[0]
    assert r.finish_reason == "stop" and r.text == "".join(tokens[:k])
    eos = {"1": 100}                                       # (</s>, the demo's end-of-sequence, at every step)
    assert c.completions.create(**kw, max_tokens=6, logit_bias=eos).usage.completion_tokens == 1
    r = c.completions.create(**kw, max_tokens=9, logit_bias=eos, extra_body={"min_tokens": 4})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"
    for bad, param in (({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": "3"}, "stop_token_ids"),
                       ({"min_tokens": 10}, "min_tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(**kw, max_tokens=6, extra_body=bad)
        assert e.value.body["param"] == param


def _stop_reasons(c, kind: str, **kw) -> list:
    """The choice's (finish_reason, stop_reason): answered whole, then streamed (the last chunk's; on the
    completions endpoint every earlier chunk says null)."""
    create = c.chat.completions.create if kind == "chat" else c.completions.create
    ch = create(**kw).choices[0]
    out = [(ch.finish_reason, ch.model_extra["stop_reason"])]
    chunks = [x.choices[0] for x in create(**kw, stream=True) if x.choices]
    if kind == "completion":
        assert all(x.model_extra["stop_reason"] is None for x in chunks[:-1])
    return out + [(chunks[-1].finish_reason, chunks[-1].model_extra["stop_reason"])]


def test_of_stop_strings_one_token_completes_the_first_listed_wins(server):
    """vLLM's stop checker goes through the request's stop list in order: when one new token completes two stop
    strings, the first of the list wins -- its stop_reason, the text cut at it -- even where the other begins
    earlier in the text; streamed and not the same."""
    c = server["client"]
    found = None
    for seed in range(40):
        kw = dict(model="demo", prompt="Quick brown foxes", max_tokens=30, temperature=1.0, seed=seed, logprobs=0)
        full = c.completions.create(**kw).choices[0]
        text, offs = full.text, full.logprobs.text_offset
        for a, b in zip(offs, offs[1:]):     # (a token of two characters or more, each stop string new there)
            if b - a >= 2 and text.find(text[a]) == a and text.find(text[a + 1:b]) == a + 1:
                found = kw, text, text[a], text[a + 1:b], a
                break
        if found:
            break
    assert found, "no token of two new characters"
    kw, text, early, late, at = found
    for stop, reason, cut in (([late, early], late, at + 1), ([early, late], early, at)):
        r = c.completions.create(**kw, stop=stop).choices[0]
        assert (r.text, r.finish_reason, r.model_extra["stop_reason"]) == (text[:cut], "stop", reason), stop
        streamed = [ch.choices[0] for ch in c.completions.create(**kw, stop=stop, stream=True) if ch.choices]
        assert "".join(ch.text for ch in streamed) == r.text and streamed[-1].model_extra["stop_reason"] == reason
        kept = c.completions.create(**kw, stop=stop, extra_body={"include_stop_str_in_output": True}).choices[0]
        assert kept.text == text[:cut + len(reason)] and kept.model_extra["stop_reason"] == reason


def test_vllms_stop_reason_names_the_stop_string_or_token_id(server):
    """vLLM's stop_reason on each choice: the stop string that ended it, or the stop_token_ids id; null for the
    tokenizer's end-of-sequence and for length (vLLM's check_stop sets it for stop ids only). A model's other
    end-of-sequence id (its generation config's: a stop token id in vLLM) is named too."""
    c, app = server["client"], server["app"]
    eos = min(app.engine.eos_ids)
    ck = dict(model="demo", prompt="Quick brown foxes", max_tokens=12, temperature=1.0, seed=8)
    text = c.completions.create(**ck).choices[0].text
    for kind, kw in (("completion", ck), ("chat", dict(model="demo", messages=MSG, max_tokens=12,
                                                         temperature=1.0, seed=8))):
        plain = (c.chat.completions.create(**kw).choices[0].message.content if kind == "chat" else text)
        assert _stop_reasons(c, kind, **kw) == [("length", None)] * 2
        s = plain[4:6]
        assert len(s) == 2
        assert _stop_reasons(c, kind, **kw, stop=["zzzq", s]) == [("stop", s)] * 2
        assert _stop_reasons(c, kind, **kw, stop=s, extra_body={"include_stop_str_in_output": True}) == \
            [("stop", s)] * 2
        assert _stop_reasons(c, kind, **kw, logit_bias={str(eos): 100}) == [("stop", None)] * 2
        assert _stop_reasons(c, kind, **kw, extra_body={"stop_token_ids": [65], "logit_bias": {"65": 100}}) == \
            [("stop", 65)] * 2
        # (with ignore_eos, end-of-sequence among stop_token_ids ends the choice as a stop id: named)
        assert _stop_reasons(c, kind, **kw, extra_body={"ignore_eos": True, "stop_token_ids": [eos],
                                                        "logit_bias": {str(eos): 100}}) == [("stop", eos)] * 2
    saved = app.engine.primary_eos
    try:
        app.engine.primary_eos = None        # (as a model whose end-of-sequence is its generation config's)
        assert _stop_reasons(c, "completion", **ck, logit_bias={str(eos): 100}) == [("stop", eos)] * 2
    finally:
        app.engine.primary_eos = saved


def test_logit_bias_keys_are_read_as_vllm_reads_them(server):
    """vLLM reads a logit_bias key with Python's int(): " 5" and "+5" are token 5, so they bias what "5" biases;
    a key that is no integer is a 400 naming logit_bias."""
    c = server["client"]
    kw = dict(model="demo", prompt="Quick brown foxes", max_tokens=4, temperature=0)
    plain = c.completions.create(**kw, logit_bias={"65": 100}).choices[0].text
    assert plain != c.completions.create(**kw).choices[0].text
    for key in (" 65", "+65", "65 "):
        assert c.completions.create(**kw, logit_bias={key: 100}).choices[0].text == plain, key
    for key in ("65.0", "x", "", "0x41"):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(**kw, logit_bias={key: 1})
        assert e.value.body["param"] == "logit_bias", key


def test_vllms_allowed_token_ids_keep_the_draws_to_those_tokens(server):
    """vLLM's allowed_token_ids: every token drawn is one of them (end-of-sequence too: left out, the choice runs
    to max_tokens), the tokens a logit_bias of -100 on every other token gives at the same seed; with a grammar, both
    hold. An empty list or an id past the vocabulary is a 400 naming the field."""
    c, fmt = server["client"], server["app"].format
    allowed = [65, 70, 200, 300, 301]
    kw = dict(model="demo", prompt="Quick brown foxes", max_tokens=12, temperature=1.0, seed=6, logprobs=0)
    for stream in (False, True):
        r = c.completions.create(**kw, extra_body={"allowed_token_ids": allowed}, stream=stream)
        if stream:
            r = [ch for ch in r if ch.choices]
            tokens = sum((ch.choices[0].logprobs.tokens for ch in r), [])
            finish = r[-1].choices[0].finish_reason
        else:
            tokens, finish = r.choices[0].logprobs.tokens, r.choices[0].finish_reason
        assert finish == "length" and len(tokens) == 12
        assert set(tokens) <= {fmt.token_text(t)[0] for t in allowed}
        if not stream:
            others = {str(t): -100 for t in range(512) if t not in allowed}
            assert c.completions.create(**kw, logit_bias=others).choices[0].text == r.choices[0].text
    r = c.chat.completions.create(model="demo", messages=MSG, max_tokens=8, temperature=1.0, seed=2, logprobs=True,
                                  extra_body={"allowed_token_ids": allowed,
                                              "grammar": {"type": "regex", "value": "[a-z ]*"}})
    assert re.fullmatch("[a-z ]*", r.choices[0].message.content)
    assert {e.token for e in r.choices[0].logprobs.content} <= {fmt.token_text(t)[0] for t in allowed}
    for bad in ([], [512], [-1], "65", [True]):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(**kw, extra_body={"allowed_token_ids": bad})
        assert e.value.body["param"] == "allowed_token_ids", bad


def _bad_word_sequences(tok, word: str) -> list[tuple[int, ...]]:
    """vLLM's SamplingParams.update_from_tokenizer, written out: the word (leading spaces stripped) and, when it
    gives as many tokens beginning with another one, the word after a space."""
    plain = tuple(tok.encode(word.lstrip(), add_special_tokens=False))
    spaced = tuple(tok.encode(" " + word.lstrip(), add_special_tokens=False))
    return [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])


def _holds(ids: list[int], seq: tuple[int, ...]) -> bool:
    return any(tuple(ids[i:i + len(seq)]) == seq for i in range(len(ids) - len(seq) + 1))


def test_vllms_bad_words_never_complete_a_bad_word(server):
    """vLLM's bad_words: a one-token word's token is never drawn -- the tokens a logit_bias of -100 on it gives --
    and a longer word's last token is banned where the tokens generated so far end with its others (the prompt's
    do not count), so the word never appears; what greedy decoding gave up to there is unchanged, and the token
    after is what a logit_bias of -100 on that last token gives. Streamed and not the same; with n = 2 each choice
    has its own history (each is what its seed gives alone). A bad value is a 400 naming bad_words."""
    c, tok = server["client"], server["app"].tokenizer

    def gen(prompt, stream=False, **extra):
        r = c.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0, logprobs=0,
                                 stream=stream, extra_body={"return_tokens_as_token_ids": True, **extra})
        chunks = [ch.choices[0] for ch in r if ch.choices] if stream else r.choices
        return [_token_id(t) for ch in chunks for t in (ch.logprobs.tokens if ch.logprobs else [])]
    single = pair = None
    for prompt in ("Quick brown foxes", "A sampler chain", "The compiler reads", "Count the tokens"):
        greedy = gen(prompt)
        for j, t in enumerate(greedy):
            w = tok.decode([t])
            seqs = _bad_word_sequences(tok, w) if w.strip() else []
            if single is None and seqs and all(len(q) == 1 for q in seqs) and (t,) in seqs:
                single = prompt, greedy, w, {q[0] for q in seqs}
        for p in range(len(greedy) - 1):
            w = tok.decode(greedy[p:p + 2])
            seqs = _bad_word_sequences(tok, w) if w.strip() else []
            if tuple(greedy[p:p + 2]) not in seqs or any(len(q) != 2 for q in seqs) or \
                    any(_holds(greedy[:p + 1], q) for q in seqs):
                continue
            last = {q[1] for q in seqs if q[0] == greedy[p]}
            if not last & set(greedy[:p + 1]):
                pair = prompt, greedy, w, p, last
                break
        if single and pair:
            break
    assert single and pair, "no bad word candidates in the greedy texts"
    prompt, greedy, w, banned = single
    got = gen(prompt, bad_words=[w])
    assert not banned & set(got) and got != greedy
    assert got == gen(prompt, logit_bias={str(t): -100 for t in banned}) == gen(prompt, True, bad_words=[w])
    prompt, greedy, w, p, last = pair
    got = gen(prompt, bad_words=[w])
    assert not any(_holds(got, q) for q in _bad_word_sequences(tok, w))
    ref = gen(prompt, logit_bias={str(t): -100 for t in last})
    assert got[:p + 1] == greedy[:p + 1] and got[p + 1] != greedy[p + 1] and got[:p + 2] == ref[:p + 2]
    assert got == gen(prompt, True, bad_words=[w])
    # n = 2: each choice bans by its own tokens
    kw = dict(model="demo", prompt=prompt, max_tokens=24, temperature=1.0, seed=5, logprobs=0)
    both = c.completions.create(**kw, n=2, extra_body={"bad_words": [w, "the"], "return_tokens_as_token_ids": True})
    for i, ch in enumerate(both.choices):
        alone = c.completions.create(**{**kw, "seed": 5 + i}, extra_body={"bad_words": [w, "the"]}).choices[0]
        assert ch.text == alone.text
        ids = [_token_id(t) for t in ch.logprobs.tokens]
        assert not any(_holds(ids, q) for q in _bad_word_sequences(tok, w) + _bad_word_sequences(tok, "the"))
    r = c.chat.completions.create(model="demo", messages=MSG, max_tokens=8, temperature=0,
                                  extra_body={"bad_words": [w]})
    assert r.choices[0].finish_reason in ("length", "stop")
    for bad in ("x", [1], [""], ["   "], [None], {"x": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="demo", prompt="x", max_tokens=2, extra_body={"bad_words": bad})
        assert e.value.body["param"] == "bad_words", bad


def test_top_k_minus_one_is_off_as_in_vllm(server):
    c = server["client"]
    kw = dict(model="demo", prompt="Quick brown foxes", max_tokens=8, temperature=1.0, seed=5)
    off = c.completions.create(**kw).choices[0].text
    assert c.completions.create(**kw, extra_body={"top_k": -1}).choices[0].text == off
    assert c.completions.create(**kw, extra_body={"top_k": 0}).choices[0].text == off
    with pytest.raises(openai.BadRequestError, match="top_k"):
        c.completions.create(**kw, extra_body={"top_k": -2})


def test_openai_penalties_count_the_generated_tokens_only(server):
    """OpenAI: mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, c[j] the count of token j in
    the tokens sampled so far (not the prompt), over the whole completion: a greedy reference loop on the demo
    model's logits, against the server's tokens."""
    app, c = server["app"], server["client"]
    model, n = app.engine.model, 10

    def greedy(seq: list[int], counted_prompt: bool) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            x = np.array(model(mx.array(seq + out)[None])[0, -1].astype(mx.float32))
            seen = (seq if counted_prompt else []) + out
            counts = np.bincount(np.array(seen, dtype=np.int64), minlength=x.size)[:x.size].astype(np.float32)
            out.append(int(np.argmax(x - (counts * np.float32(0.6) + (counts > 0) * np.float32(1.5)))))
        return out
    # a prompt whose greedy text the penalties would change if they counted the prompt's tokens too
    for prompt in ("Quick brown foxes jump", "A sampler chain", "The cat sat on the mat", "aaaa bbbb aaaa"):
        seq = list(app.tokenizer.encode(prompt))
        expected = greedy(seq, False)
        if expected != greedy(seq, True):
            break
    else:
        pytest.fail("no prompt tells the two conventions apart")
    r = c.completions.create(model="demo", prompt=prompt, max_tokens=n, temperature=0, presence_penalty=1.5,
                             frequency_penalty=0.6, logprobs=0).choices[0]
    assert r.logprobs.tokens == [app.format.token_text(t)[0] for t in expected]


def test_legacy_top_logprobs_hold_the_sampled_token_too(server):
    c = server["client"]
    r = c.completions.create(model="demo", prompt="Hello world", max_tokens=12, seed=4, temperature=2.0,
                             logprobs=1).choices[0]
    lp = r.logprobs
    assert all(t in d and d[t] == v and len(d) <= 2 for t, v, d in zip(lp.tokens, lp.token_logprobs,
                                                                           lp.top_logprobs))
    assert any(len(d) == 2 for d in lp.top_logprobs)         # (at temperature 2, not always the most likely)
    # (logprobs 0: the sampled token alone, as OpenAI's "always the logprob of the sampled token")
    lp0 = c.completions.create(model="demo", prompt="Hello world", max_tokens=12, seed=4, temperature=2.0,
                               logprobs=0).choices[0].logprobs
    assert lp0.tokens == lp.tokens and [dict(d) for d in lp0.top_logprobs] == \
        [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]


def test_a_value_that_fails_at_run_time_is_a_400_naming_it(server):
    """A repetition penalty so small that a penalized logit overflows float32: the program's check fires during
    generation, and the request is answered 400 naming the field (not a silent end of the text)."""
    c = server["client"]
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="demo", prompt="A sampler chain", max_tokens=4, temperature=1.0, seed=1,
                             extra_body={"repetition_penalty": 1e-40, "repetition_context_size": 0})
    assert err.value.body["param"] == "repetition_penalty" and "overflow" in err.value.body["message"]
    stream = c.completions.create(model="demo", prompt="A sampler chain", max_tokens=4, temperature=1.0, seed=1,
                                  stream=True, extra_body={"repetition_penalty": 1e-40,
                                                           "repetition_context_size": 0})
    with pytest.raises(openai.APIError, match="overflow"):
        list(stream)
    # (a plain SSE reader: the error event, then data: [DONE] as every stream ends -- vLLM's too)
    req = urllib.request.Request(server["base"] + "/v1/completions", data=json.dumps(dict(
        prompt="A sampler chain", max_tokens=4, seed=1, stream=True, repetition_penalty=1e-40,
        repetition_context_size=0)).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as answer:
        events = [line[6:] for line in answer.read().decode().split("\n") if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["param"] == "repetition_penalty" and events[-1] == "[DONE]"
    r = c.completions.create(model="demo", prompt="still here", max_tokens=3, temperature=0.5, seed=9)
    assert r.usage.completion_tokens == 3


def test_streaming_gives_the_same_text_logprobs_and_usage(server):
    c = server["client"]
    kw = dict(model="demo", messages=MSG, max_tokens=10, temperature=0.8, seed=21, logprobs=True, top_logprobs=2)
    whole = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    entries = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert text == whole.choices[0].message.content
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    ck = dict(model="demo", prompt="counting one, two", max_tokens=9, temperature=0.7, seed=5, logprobs=2)
    whole = c.completions.create(**ck).choices[0]
    chunks = [ch for ch in c.completions.create(**ck, stream=True) if ch.choices]
    assert "".join(ch.choices[0].text for ch in chunks) == whole.text
    assert sum((ch.choices[0].logprobs.token_logprobs for ch in chunks if ch.choices[0].logprobs), []) == \
        whole.logprobs.token_logprobs



def test_vllms_continuous_usage_stats_put_each_choices_usage_on_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries usage -- its choice's prompt tokens and the
    tokens generated for that choice so far (0 on chat's first, role chunk) -- and the last chunk the request's
    whole usage, as without it. Alone it implies include_usage (vLLM's default there); include_usage false turns
    both off."""
    c, app = server["client"], server["app"]
    both = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(model="demo", messages=MSG, max_tokens=6, temperature=1.0, seed=3, n=2)
    whole = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(**kw, stream=True, stream_options=both))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert chunks[0].usage.completion_tokens == 0 and chunks[0].usage.prompt_tokens == whole.usage.prompt_tokens
    last = {}
    for ch in chunks[1:-1]:
        (choice,) = ch.choices
        u = ch.usage
        assert u.prompt_tokens == whole.usage.prompt_tokens and u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert u.completion_tokens >= last.get(choice.index, 0)
        last[choice.index] = u.completion_tokens
    assert sorted(last) == [0, 1] and sum(last.values()) == whole.usage.completion_tokens
    prompts = ["A b", "A longer prompt of several words"]
    ck = dict(model="demo", prompt=prompts, max_tokens=5, temperature=1.0, seed=3)
    counts = {ch.index: len(ch.logprobs.tokens) for ch in c.completions.create(**ck, logprobs=0).choices}
    for so in (both, {"continuous_usage_stats": True}):
        chunks = list(c.completions.create(**ck, stream=True, stream_options=so))
        seen = {}
        for ch in chunks[:-1]:
            (choice,) = ch.choices
            assert ch.usage.prompt_tokens == len(app.tokenizer.encode(prompts[choice.index]))
            seen[choice.index] = ch.usage.completion_tokens
        assert seen == counts and chunks[-1].usage.completion_tokens == sum(counts.values())
    chunks = list(c.completions.create(**ck, stream=True, stream_options={"include_usage": False,
                                                                        "continuous_usage_stats": True}))
    assert all(ch.usage is None for ch in chunks) and all(ch.choices for ch in chunks)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(**ck, stream=True, stream_options={"continuous_usage_stats": "yes"})
    assert e.value.body["param"] == "stream_options.continuous_usage_stats"

# ---- structured outputs

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                           "tag": {"type": "string", "maxLength": 4}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}


def test_json_schema_and_json_object_outputs_parse_and_validate(server):
    c = server["client"]
    stopped = 0
    for seed in range(4):
        for stream in (False, True):
            kw = dict(model="demo", messages=MSG, max_tokens=60, temperature=1.0, seed=seed,
                      response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
            if stream:
                chunks = [ch for ch in c.chat.completions.create(**kw, stream=True) if ch.choices]
                text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
                finish = chunks[-1].choices[0].finish_reason
            else:
                ch = c.chat.completions.create(**kw).choices[0]
                text, finish = ch.message.content, ch.finish_reason
            if finish == "stop":
                jsonschema.validate(json.loads(text), SCHEMA)
                stopped += 1
    assert stopped >= 4
    r = c.chat.completions.create(model="demo", messages=MSG, max_tokens=40, temperature=0.5, seed=1,
                                  response_format={"type": "json_object"})
    ch = r.choices[0]
    assert ch.finish_reason == "length" or isinstance(json.loads(ch.message.content), dict)


@pytest.mark.parametrize("grammar, check", [
    ({"type": "regex", "value": "[a-z]{2,4}-[0-9]{2}"}, lambda t: re.fullmatch("[a-z]{2,4}-[0-9]{2}", t)),
    ({"type": "lark", "value": 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'},
     lambda t: re.fullmatch("yes|no|maybe [0-9]", t)),
    ({"type": "gbnf", "value": 'root ::= "(" [a-c]+ ")"'}, lambda t: re.fullmatch(r"\([a-c]+\)", t)),
])
def test_regex_and_cfg_grammars(server, grammar, check):
    c = server["client"]
    for seed in range(3):
        r = c.completions.create(model="demo", prompt="answer:", max_tokens=30, temperature=1.0, seed=seed,
                                 extra_body={"grammar": grammar})
        ch = r.choices[0]
        assert ch.finish_reason == "length" or check(ch.text), ch.text


# vLLM's structured-output fields, each checked against the constraint it names: (extra_body, check of the text)
ARRAY = {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}
VLLM_STRUCTURED = [
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_json": json.dumps(ARRAY)}, lambda t: jsonschema.validate(json.loads(t), ARRAY) is None),
    ({"guided_regex": "[a-z]{2,4}-[0-9]{2}"}, lambda t: re.fullmatch("[a-z]{2,4}-[0-9]{2}", t)),
    ({"guided_grammar": 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'},
     lambda t: re.fullmatch("yes|no|maybe [0-9]", t)),
    ({"guided_grammar": 'root ::= "(" [a-c]+ ")"', "guided_decoding_backend": "guidance"},
     lambda t: re.fullmatch(r"\([a-c]+\)", t)),
    ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda t: re.fullmatch("[0-9]{3}", t)),
    ({"structured_outputs": {"grammar": 'root ::= "x" "-"? "y"'}}, lambda t: t in ("xy", "x-y")),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     lambda t: isinstance(json.loads(t), dict)),
]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("extra, check", VLLM_STRUCTURED)
def test_vllm_structured_output_fields_constrain_the_text(server, kind, extra, check):
    """vLLM's guided_* fields and its structured_outputs object become the grammar response_format and `grammar`
    give: a completion that ends by itself (finish "stop") parses, validates, matches -- streamed and not."""
    c = server["client"]
    stopped = 0
    for seed in range(3):
        for stream in (False, True):
            kw = dict(model="demo", max_tokens=60, temperature=0.7, seed=seed, extra_body=extra, stream=stream)
            r = c.chat.completions.create(messages=MSG, **kw) if kind == "chat" else \
                c.completions.create(prompt="answer:", **kw)
            if stream:
                chunks = [ch for ch in r if ch.choices]
                text = "".join((ch.choices[0].delta.content if kind == "chat" else ch.choices[0].text) or ""
                               for ch in chunks)
                finish = chunks[-1].choices[0].finish_reason
            else:
                ch = r.choices[0]
                text, finish = ch.message.content if kind == "chat" else ch.text, ch.finish_reason
            if finish == "stop":
                assert check(text), (extra, text)
                stopped += 1
    assert stopped >= 3


@pytest.mark.parametrize("field", ["guided_choice", "structured_outputs"])
def test_guided_choice_gives_exactly_one_of_the_choices(server, field):
    choices = ["red", "green", "blue", "x y", "quote\"d"]
    extra = {"guided_choice": choices} if field == "guided_choice" else {"structured_outputs": {"choice": choices}}
    c = server["client"]
    seen = set()
    for seed in range(6):
        for stream in (False, True):
            kw = dict(model="demo", max_tokens=30, temperature=1.5, seed=seed, n=2, extra_body=extra)
            if stream:
                parts = {}
                for ch in c.chat.completions.create(messages=MSG, stream=True, **kw):
                    for x in ch.choices:
                        parts[x.index] = parts.get(x.index, "") + (x.delta.content or "")
                texts = list(parts.values())
            else:
                r = c.completions.create(prompt="Pick one:", **kw)
                assert [x.finish_reason for x in r.choices] == ["stop", "stop"]
                texts = [x.text for x in r.choices]
            assert len(texts) == 2 and all(t in choices for t in texts), texts
            seen.update(texts)
    assert len(seen) >= 2           # (the sampler picks among them: not a fixed one)


@pytest.mark.parametrize("extra, param", [
    ({"guided_json": SCHEMA, "guided_regex": "[a-z]+"}, "guided_regex"),
    ({"guided_choice": ["a", "b"], "guided_grammar": 'start: "a"'}, "guided_grammar"),
    ({"guided_regex": "[a-z]+", "structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "[a-z]+", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"grammar": {"type": "regex", "value": "a"}, "guided_regex": "b"}, "guided_regex"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": ["regex"]}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_json": 5}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "?start: x"}, "guided_grammar"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}},
     "structured_outputs.json"),
    ({"guided_regex": "[a-z]+", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"guided_regex": "[a-z]+", "guided_decoding_backend": 3}, "guided_decoding_backend"),
])
def test_vllm_structured_output_refusals_name_the_field(server, extra, param):
    """One kind of constraint per request (vLLM's rule), a constraint with a JSON response_format too, a backend other
    than this server's, and values the engine cannot compile: a 400 naming the field."""
    c = server["client"]
    for kind in ("chat", "completion"):
        with pytest.raises(openai.BadRequestError) as err:
            if kind == "chat":
                c.chat.completions.create(model="demo", messages=MSG, max_tokens=4, extra_body=extra)
            else:
                c.completions.create(model="demo", prompt="x", max_tokens=4, extra_body=extra)
        assert err.value.body["param"] == param and param in err.value.body["message"], err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="demo", messages=MSG, max_tokens=4, extra_body={"guided_regex": "[a-z]+"},
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "t", "schema": SCHEMA}})
    assert err.value.body["param"] == "guided_regex" and "response_format" in err.value.body["message"]
    # (a text response_format is no constraint; a backend named without a constraint is what vLLM ignores)
    r = c.chat.completions.create(model="demo", messages=MSG, max_tokens=8, seed=1, response_format={"type": "text"},
                                  extra_body={"guided_regex": "[a-z]{3}"})
    assert r.choices[0].finish_reason == "length" or re.fullmatch("[a-z]{3}", r.choices[0].message.content)
    assert c.completions.create(model="demo", prompt="x", max_tokens=2,
                                extra_body={"guided_decoding_backend": "xgrammar",
                                            "ignore_eos": True}).usage.completion_tokens == 2


# ---- refusals

@pytest.mark.parametrize("kind, fields, param", [
    ("chat", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tool_choice"),
    ("chat", dict(audio={"voice": "x", "format": "wav"}), "audio"),
    ("chat", dict(modalities=["text", "audio"]), "modalities"),
    ("chat", dict(store=True), "store"),
    ("chat", dict(n=0), "n"),
    ("chat", dict(n=99), "n"),
    ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", dict(top_logprobs=2), "top_logprobs"),
    ("chat", dict(temperature=-1.0), "temperature"),
    ("chat", dict(top_p=1.5), "top_p"),
    ("chat", dict(seed=-2**63 - 1), "seed"),
    ("chat", dict(max_tokens=10**9), "max_tokens"),
    ("chat", dict(max_completion_tokens=0), "max_completion_tokens"),
    ("chat", dict(logit_bias={"3": 101}), "logit_bias"),
    ("chat", dict(logit_bias={"-3": 1.0}), "logit_bias"),
    ("chat", dict(logit_bias={"99999": 1.0}), "logit_bias"),
    ("chat", dict(stream_options={"include_usage": True}), "stream_options"),
    ("chat", dict(stop=[3]), "stop"),
    ("chat", dict(temperature=2.5), "temperature"),
    ("chat", dict(user=5), "user"),
    ("chat", dict(presence_penalty=5), "presence_penalty"),
    ("completion", dict(frequency_penalty=-3), "frequency_penalty"),
    ("completion", dict(extra_body={"repetition_penalty": 1e39}), "repetition_penalty"),
    ("chat", dict(response_format={"type": "xml"}), "response_format"),
    ("chat", dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}), "response_format.json_schema"),
    ("chat", dict(extra_body={"grammar": {"type": "regex", "value": "[a-"}}), "grammar"),
    ("chat", dict(extra_body={"grammar": {"type": "prolog", "value": "x"}}), "grammar"),
    ("chat", dict(extra_body={"samplec_sampler": "nope"}), "samplec_sampler"),
    ("chat", dict(extra_body={"frobnicate": 1}), "frobnicate"),
    ("chat", dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
    ("chat", dict(extra_body={"length_penalty": 1.0}), "length_penalty"),
    ("completion", dict(extra_body={"use_beam_search": True}), "use_beam_search"),
    ("completion", dict(extra_body={"bad_words": "x"}), "bad_words"),
    ("completion", dict(extra_body={"spaces_between_special_tokens": "no"}), "spaces_between_special_tokens"),
    ("completion", dict(suffix="x"), "suffix"),
    ("completion", dict(max_tokens=0), "max_tokens"),
    ("completion", dict(best_of=3), "best_of"),
    ("completion", dict(logprobs=21), "logprobs"),
    ("completion", dict(extra_body={"top_k": 2.5}), "top_k"),
    ("completion", dict(extra_body={"top_k": -4}), "top_k"),
])
def test_refused_fields_are_400_naming_the_field_and_the_server_keeps_serving(server, kind, fields, param):
    c = server["client"]
    with pytest.raises(openai.BadRequestError) as err:
        if kind == "chat":
            c.chat.completions.create(**{"model": "demo", "messages": MSG, "max_tokens": 4, **fields})
        else:
            c.completions.create(**{"model": "demo", "prompt": "x", "max_tokens": 4, **fields})
    assert err.value.body["param"] == param and param.split(".")[0] in err.value.body["message"], err.value.body
    if param in serve.VLLM_ONLY:        # (a vLLM client learns the field is vLLM's, not misspelt)
        assert "vLLM" in err.value.body["message"]
    r = c.completions.create(model="demo", prompt="still here", max_tokens=3, temperature=0.5, seed=9)
    assert r.usage.completion_tokens == 3


def test_an_unknown_model_is_404_and_malformed_bodies_are_400(server):
    with pytest.raises(openai.NotFoundError):
        server["client"].chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=2)
    for body in (b'{"prompt": "x", "max_tokens": ', b"\xff\xfe", b"[1, 2]", b'{"prompt": ""}',
                 b'{"prompt": "x", "temperature": NaN}'):
        status, answer = post(server["base"] + "/v1/completions", body)
        assert status == 400 and answer["error"]["message"], (body, status, answer)
    assert post(server["base"] + "/v1/nothing", {})[0] == 404
    # (bodies no check foresaw once: an integer past float's range, a chain's name of another type, JSON nested
    # past the parser's recursion -- each a 400 naming the field, never a dropped connection)
    huge = 10 ** 400
    for body, param in ((dict(prompt="x", n=huge), "n"), (dict(prompt="x", temperature=huge), "temperature"),
                        (dict(prompt="x", seed=huge), "seed"), (dict(prompt="x", top_k=huge), "top_k"),
                        (dict(prompt="x", max_tokens=-huge), "max_tokens"),
                        (dict(prompt="x", samplec_sampler=[]), "samplec_sampler"),
                        (dict(prompt="x", samplec_sampler={"a": 1}), "samplec_sampler"),
                        (dict(prompt="x", repetition_penalty=5e-324), "repetition_penalty")):
        status, answer = post(server["base"] + "/v1/completions", body)
        assert status == 400 and answer["error"]["param"] == param and len(answer["error"]["message"]) < 200, \
            (param, status, answer)
    status, answer = post(server["base"] + "/v1/chat/completions", b'{"messages": ' + b"[" * 100000)
    assert status == 400 and "nested" in answer["error"]["message"]


# ---- batching

REQUESTS = [dict(prompt="A sampler chain", max_tokens=12, temperature=0.8, seed=1),
            dict(prompt="The compiler reads", max_tokens=12, temperature=1.2, top_p=0.9, seed=2),
            dict(prompt="Quick brown foxes", max_tokens=12, temperature=0.7, top_k=20, min_p=0.05, seed=3,
                 repetition_penalty=1.3),
            dict(prompt="counting one, two", max_tokens=12, temperature=0.0),
            dict(prompt="A sampler chain", max_tokens=12, temperature=1.0, seed=5, logit_bias={"7": -100.0},
                 presence_penalty=0.5, frequency_penalty=0.3),
            dict(prompt="answer:", max_tokens=20, temperature=1.0, seed=6, n=2,
                 grammar={"type": "regex", "value": "[a-z]{3,6}( [a-z]{2})?"}),
            dict(prompt="A sampler chain", max_tokens=30, temperature=0.9, seed=7,
                 response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})]


def test_concurrent_requests_constrained_or_not_give_what_each_gives_alone(server):
    url = server["base"] + "/v1/completions"
    alone = [post(url, r) for r in REQUESTS]
    assert all(s == 200 for s, _ in alone), alone
    sampler = server["app"].sampler
    calls_before, mixed_before, sampler.widest = sampler.calls, sampler.mixed, 0
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        together = list(pool.map(lambda r: post(url, r), REQUESTS))
    assert [s for s, _ in together] == [200] * len(REQUESTS)
    texts = lambda answers: [[ch["text"] for ch in b["choices"]] for _, b in answers]  # noqa: E731
    assert texts(together) == texts(alone)
    steps = sampler.calls - calls_before
    generated = sum(b["usage"]["completion_tokens"] for _, b in together)
    assert sampler.widest >= 2 and steps < generated, (steps, generated)
    assert sampler.mixed > mixed_before          # grammar rows and free rows shared program calls


def test_streamed_choices_carry_their_index_text_and_logprobs(server):
    c = server["client"]
    kw = dict(model="demo", messages=MSG, max_tokens=8, temperature=1.0, seed=77, n=3, logprobs=True,
              top_logprobs=1)
    whole = c.chat.completions.create(**kw)
    chunks = [ch for ch in c.chat.completions.create(**kw, stream=True) if ch.choices]
    for i, want in enumerate(whole.choices):
        mine = [ch.choices[0] for ch in chunks if ch.choices[0].index == i]
        assert "".join(d.delta.content or "" for d in mine) == want.message.content
        assert [e.token for d in mine if d.logprobs for e in d.logprobs.content] == \
            [e.token for e in want.logprobs.content]
        assert mine[-1].finish_reason == want.finish_reason


def test_disconnects_and_bursts_leave_the_others_unchanged(server):
    """Clients that go away mid-stream, then a burst of concurrent requests with every kind of value: every answer
    is 200 or 400, a seeded request gives the tokens it gave alone, and no row is left behind."""
    host, port = server["httpd"].server_address[:2]
    for _ in range(3):                                   # ask for a long stream, read a little, hang up
        s = socket.create_connection((host, port), timeout=30)
        body = json.dumps(dict(prompt="A sampler chain", max_tokens=200, stream=True, temperature=0.9,
                               seed=11)).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        s.recv(64)
        s.close()
    url = server["base"] + "/v1/completions"
    want = post(url, REQUESTS[1])[1]["choices"][0]["text"]
    burst = [dict(r, seed=i) if "seed" in r else r for i, r in enumerate(REQUESTS * 2)]
    burst += [dict(prompt="x", max_tokens=3, top_p=7), b"{not json", dict(prompt="y", max_tokens=2, top_k=-5.5)]
    burst.append(REQUESTS[1])
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda r: post(url, r), burst))
    assert all(s in (200, 400) for s, _ in answers), [s for s, _ in answers]
    assert answers[-1][0] == 200 and answers[-1][1]["choices"][0]["text"] == want
    import time
    for _ in range(600):                                 # (up to 30 s on a loaded machine)
        if server["app"].engine.active == 0:
            break
        time.sleep(0.05)
    assert server["app"].engine.active == 0


def test_a_non_streaming_request_whose_client_left_frees_its_row(server):
    """A client that sends a long non-streaming request and hangs up (a timeout, a retry) leaves no row behind:
    the server looks at the connection while it waits and cancels the request."""
    import time
    host, port = server["httpd"].server_address[:2]
    body = json.dumps(dict(prompt="A sampler chain", max_tokens=100000, temperature=0.9, seed=12)).encode()
    s = socket.create_connection((host, port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    for _ in range(400):                                 # (the request is generating)
        if server["app"].engine.active:
            break
        time.sleep(0.05)
    assert server["app"].engine.active
    s.close()
    for _ in range(600):                                 # (up to 30 s on a loaded machine)
        if server["app"].engine.active == 0:
            break
        time.sleep(0.05)
    assert server["app"].engine.active == 0


def test_a_body_that_stops_coming_is_a_408_and_frees_the_connection(server, monkeypatch):
    """A client that promises more body than it sends: after the connection's silence limit the server answers
    408 and closes it (its thread does not wait forever); the server keeps serving."""
    monkeypatch.setattr(server["httpd"].RequestHandlerClass, "timeout", 1.0)
    host, port = server["httpd"].server_address[:2]
    s = socket.create_connection((host, port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\"")
    answer = b""
    while True:
        got = s.recv(4096)
        if not got:
            break
        answer += got
    s.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive" in answer, answer[:200]
    monkeypatch.undo()
    assert post(server["base"] + "/v1/completions", dict(prompt="x", max_tokens=2))[0] == 200


def test_requests_past_the_models_context_length(server, monkeypatch):
    """Where the model's config gives a context length: a max_tokens past the room the prompt leaves is a 400
    naming it (OpenAI's and vLLM's message), a default one shrinks to the room, and a prompt that fills the
    context is a 400 naming the prompt."""
    c = server["client"]
    prompt = server["app"].tokenizer.encode("A sampler chain turns logits into tokens")
    monkeypatch.setattr(server["app"].parse, "context", len(prompt) + 5)
    with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
        c.completions.create(model="demo", prompt=prompt, max_tokens=6)
    assert e.value.body["param"] == "max_tokens"
    r = c.completions.create(model="demo", prompt=prompt, max_tokens=5, temperature=0)
    assert r.usage.completion_tokens <= 5
    r = c.completions.create(model="demo", prompt=prompt, temperature=0, logit_bias={"1": -100})   # (default 16)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    monkeypatch.setattr(server["app"].parse, "context", len(prompt))
    with pytest.raises(openai.BadRequestError, match="no room") as e:
        c.completions.create(model="demo", prompt=prompt)
    assert e.value.body["param"] == "prompt"


def test_messages_go_through_the_tokenizers_chat_template(server, monkeypatch):
    """With a chat template (here one set on the demo tokenizer), messages -- developer as system, text parts
    joined -- are the template's text; without one, `role: content` lines."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    hf = server["app"].tokenizer._tokenizer
    plain = serve.Parser(server["app"].tokenizer, 512, {"c": None}, "demo")._prompts("chat", {"messages": MSG})[0][0]
    assert server["app"].tokenizer.decode(plain) == "user: Count the tokens\nassistant:"
    saved = hf.chat_template
    # (a TokenizerWrapper stores has_chat_template on the tokenizer it wraps: the server's wrapper reads it too)
    monkeypatch.setattr(hf, "has_chat_template", hf.has_chat_template)
    try:
        hf.chat_template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}")
        tok = TokenizerWrapper(hf)
        ids = serve.Parser(tok, 512, {"c": None}, "demo")._prompts("chat", {"messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]})[0][0]
        assert tok.decode(ids) == "<system> be brief\n<user> hi there\n<assistant>"
    finally:
        hf.chat_template = saved


def test_chat_template_kwargs_override_the_templates_defaults(server, monkeypatch):
    """As vLLM's, chat_template_kwargs are passed to the template over the server's own arguments:
    add_generation_prompt false leaves the assistant's header out; a key the server must set itself (tokenize,
    the conversation) is a 400 naming chat_template_kwargs, not a Python error blamed on messages."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    plain = serve.Parser(server["app"].tokenizer, 512, {"c": None}, "demo")._prompts("chat", {
        "messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}})[0][0]
    assert server["app"].tokenizer.decode(plain) == "user: Count the tokens\n"       # (no template: the lines)
    hf = server["app"].tokenizer._tokenizer
    monkeypatch.setattr(hf, "has_chat_template", hf.has_chat_template)     # (a wrapper writes it on hf)
    monkeypatch.setattr(hf, "chat_template", "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n"
                                             "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = TokenizerWrapper(hf)
    monkeypatch.setattr(server["app"].parse, "tokenizer", tok)
    url = server["base"] + "/v1/chat/completions"
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for kwargs, text in (({}, "<user> hi\n<assistant>"), ({"add_generation_prompt": True}, "<user> hi\n<assistant>"),
                         ({"add_generation_prompt": False}, "<user> hi\n")):
        status, r = post(url, {**body, "chat_template_kwargs": kwargs})
        assert status == 200 and r["usage"]["prompt_tokens"] == len(tok.encode(text)), (kwargs, r)
    for bad in ({"tokenize": False}, {"conversation": []}, {"add_generation_prompt": "no"}):
        status, err = post(url, {**body, "chat_template_kwargs": bad})
        assert status == 400 and err["error"]["param"] == "chat_template_kwargs", (bad, err)


def test_vllms_add_generation_prompt_and_continue_final_message(server, monkeypatch):
    """vLLM's top-level add_generation_prompt (default true) and continue_final_message (the last message left
    open, no generation prompt): through a chat template (Hugging Face cuts the text after the last message's
    content) and through the `role: content` lines; a top-level field given wins over chat_template_kwargs; both
    true is a 400, as vLLM's check. Without a generation prompt the answer's role is the last message's, as vLLM's.
    The continued chat gives what the completions endpoint gives for the same text."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    c, app = server["client"], server["app"]
    url = server["base"] + "/v1/chat/completions"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Count the"}]
    kw = dict(model="demo", max_tokens=6, temperature=1.0, seed=4)
    # no template: the lines, the last one left open
    r = c.chat.completions.create(**kw, messages=chat, extra_body={"continue_final_message": True})
    alone = c.completions.create(**kw, prompt="user: hi\nassistant: Count the").choices[0]
    assert (r.choices[0].message.content, r.choices[0].message.role) == (alone.text, "assistant")
    assert r.usage.prompt_tokens == len(app.tokenizer.encode("user: hi\nassistant: Count the"))
    r = c.chat.completions.create(**kw, messages=MSG, extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(app.tokenizer.encode("user: Count the tokens\n"))
    assert r.choices[0].message.role == "user"
    first = next(iter(c.chat.completions.create(**kw, messages=MSG, stream=True,
                                                extra_body={"add_generation_prompt": False})))
    assert first.choices[0].delta.role == "user"
    # a chat template
    hf = app.tokenizer._tokenizer
    monkeypatch.setattr(hf, "has_chat_template", hf.has_chat_template)     # (a wrapper writes it on hf)
    monkeypatch.setattr(hf, "chat_template", "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n"
                                             "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = TokenizerWrapper(hf)
    monkeypatch.setattr(app.parse, "tokenizer", tok)
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for fields, text in (({"add_generation_prompt": False}, "<user> hi\n"),
                         ({"add_generation_prompt": True, "chat_template_kwargs": {"add_generation_prompt": False}},
                          "<user> hi\n<assistant>"),
                         ({"add_generation_prompt": False, "chat_template_kwargs": {"add_generation_prompt": True}},
                          "<user> hi\n"),
                         ({"messages": chat, "continue_final_message": True}, "<user> hi\n<assistant> Count the"),
                         ({"messages": chat, "chat_template_kwargs": {"continue_final_message": True}},
                          "<user> hi\n<assistant> Count the"),
                         ({"messages": chat, "continue_final_message": True, "add_generation_prompt": False},
                          "<user> hi\n<assistant> Count the")):
        status, r = post(url, {**body, **fields})
        assert status == 200 and r["usage"]["prompt_tokens"] == len(tok.encode(text)), (fields, r)
    for fields, param in (({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
                          ({"continue_final_message": True, "chat_template_kwargs": {"add_generation_prompt": True}},
                           "continue_final_message"),
                          ({"continue_final_message": "yes"}, "continue_final_message"),
                          ({"add_generation_prompt": 1}, "add_generation_prompt"),
                          ({"chat_template_kwargs": {"continue_final_message": 1}}, "chat_template_kwargs")):
        status, err = post(url, {**body, "messages": chat, **fields})
        assert status == 400 and err["error"]["param"] == param, (fields, err)
    status, err = post(server["base"] + "/v1/completions", {"model": "demo", "prompt": "x",
                                                             "continue_final_message": True})
    assert status == 400 and err["error"]["param"] == "continue_final_message"


def test_vllms_chat_echo_begins_the_answer_with_the_last_message_of_its_role(server):
    """vLLM's chat echo: each answer begins with the last message's content when that message is of the answer's
    role (a continued assistant message; without a generation prompt, any); streamed, the echoed content comes
    first, a chunk per choice after the role chunk. Another role's last message echoes nothing."""
    c = server["client"]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Count the"}]
    kw = dict(model="demo", messages=chat, max_tokens=6, temperature=1.0, seed=4, n=2)
    for extra in ({"continue_final_message": True}, {}):
        plain = c.chat.completions.create(**kw, extra_body=extra)
        echoed = c.chat.completions.create(**kw, extra_body={**extra, "echo": True})
        assert [e.message.content for e in echoed.choices] == ["Count the" + p.message.content
                                                               for p in plain.choices]
        assert echoed.usage == plain.usage
        chunks = list(c.chat.completions.create(**kw, stream=True, extra_body={**extra, "echo": True}))
        assert [(x.index, x.delta.content) for ch in chunks[1:3] for x in ch.choices] == \
            [(0, "Count the"), (1, "Count the")]
        got: dict = {}
        for ch in chunks:
            for x in ch.choices:
                got[x.index] = got.get(x.index, "") + (x.delta.content or "")
        assert got == {e.index: e.message.content for e in echoed.choices}
    one = dict(model="demo", messages=MSG, max_tokens=4, temperature=0)
    assert c.chat.completions.create(**one, extra_body={"echo": True}).choices[0].message.content == \
        c.chat.completions.create(**one).choices[0].message.content
    r = c.chat.completions.create(**one, extra_body={"echo": True, "add_generation_prompt": False})
    plain = c.chat.completions.create(**one, extra_body={"add_generation_prompt": False})
    assert r.choices[0].message.content == MSG[0]["content"] + plain.choices[0].message.content


def test_a_messages_name_is_a_string_passed_to_the_template(server, monkeypatch):
    """A message's name (OpenAI's participant name) must be a string (400 naming messages[i].name); the chat template
    reads it, as vLLM passes it on."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    url = server["base"] + "/v1/chat/completions"
    for name in (5, ["x"], {"a": 1}, True):
        status, err = post(url, {"model": "demo", "max_tokens": 1,
                                 "messages": [{"role": "system", "content": "s"},
                                              {"role": "user", "content": "hi", "name": name}]})
        assert status == 400 and err["error"]["param"] == "messages[1].name", (name, err)
    hf = server["app"].tokenizer._tokenizer
    monkeypatch.setattr(hf, "has_chat_template", hf.has_chat_template)
    monkeypatch.setattr(hf, "chat_template", "{% for m in messages %}<{{ m['name'] or m['role'] }}> "
                                             "{{ m['content'] }}\n{% endfor %}")
    tok = TokenizerWrapper(hf)
    ids = serve.Parser(tok, 512, {"c": None}, "demo")._prompts("chat", {"messages": [
        {"role": "user", "content": "hi", "name": "ada"}, {"role": "user", "content": "yo"}]})[0][0]
    assert tok.decode(ids) == "<ada> hi\n<user> yo\n"


# ---- the chain

@pytest.mark.parametrize("fields", [
    dict(repetition_penalty=1.5, repetition_context_size=20),
    dict(repetition_penalty=1.5, repetition_context_size=0),              # 0: every token (mlx-lm's tokens[-0:])
    dict(presence_penalty=1.5, presence_context_size=40),
    dict(presence_penalty=1.5, frequency_penalty=-0.5, repetition_penalty=1.3),      # (OpenAI's: every token)
    dict(frequency_penalty=1.0, frequency_context_size=0, repetition_penalty=1.2, repetition_context_size=5),
    dict(xtc_probability=1.0, xtc_threshold=0.02),
    dict(top_p=0.8, min_p=0.05, top_k=10, temperature=0.7),
])
def test_server_chain_is_mlx_lms_processors_and_sampler(fields):
    """The server's chain on a request's fields gives the distribution mlx-lm's own processors and filters give
    (make_logits_processors, then apply_top_p / apply_min_p / apply_xtc / apply_top_k and the temperature):
    each penalty over its own window, a context size of 0 meaning every token, xtc applied."""
    from mlx_lm import sample_utils as su

    import samplec
    V = 64
    logits = mx.array(np.random.default_rng(0).normal(size=(1, V)).astype(np.float32) * 2)
    tokens = mx.array(np.r_[np.arange(30, 60), np.arange(0, 10)].astype(np.int32))
    body = {"temperature": 1.0, **fields}
    req = serve.Request(kind="completion", prompts=[[1]])
    serve.Parser(None, V, {}, "demo")._values(body, req)
    # (every token of the history taken as generated: the repetition penalty reads the sequence, the presence and
    # frequency penalties the generated tokens, each history as long as its windows read)
    seq = serve._last(np.array(tokens), serve._widest(req.values[w] for w in serve.WINDOWS[:1]))
    gen = serve._last(np.array(tokens), serve._widest(req.values[w] for w in serve.WINDOWS[1:]))
    prog = samplec.compile(re.sub(r"-> [^{]*\{", "-> token, probs {", serve.SERVER_CHAIN))
    ours = np.array(prog(logits, h=seq[None], generated=gen[None], seed=1, pos=0,
                         allowed=np.full((1, 2), -1, np.int32), **req.values).probs)[0]
    samp = {k: body.get(k, d) for k, d in dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, xtc_probability=0.0,
                                               xtc_threshold=0.1).items()}
    lg = {k: body.get(k, d) for k, d in dict(repetition_penalty=0.0, repetition_context_size=20,
                                             presence_penalty=0.0, presence_context_size=0, frequency_penalty=0.0,
                                             frequency_context_size=0).items()}
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


@pytest.mark.parametrize("argv, message", [
    (["--port", "99999"], "--port 99999: a port number lies in 0..65535"),
    (["--model", "/nonexistent/model"], "cannot load the model '/nonexistent/model'"),
    (["--demo", "--max-batch", "0"], "--max-batch 0"),
    (["--demo", "--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_start_up_errors_are_one_samplec_error(argv, message):
    from samplec.diagnostics import SamplecError
    demo = "--demo" in argv
    with pytest.raises(SamplecError) as err:
        serve.serve(["--host", "127.0.0.1", *[a for a in argv if a != "--demo"]], [], demo)
    assert message in str(err.value)


def test_a_chain_with_a_parameter_no_request_fills_is_refused_at_start_up(tmp_path):
    """A `--sampler` chain whose required parameter no request field fills (a bias) would fail every request: the
    server refuses it before it listens, naming the parameter. A required float of the chain's own is a request
    field (each request must give it)."""
    from samplec.diagnostics import SamplecError
    own = tmp_path / "own.smp"
    own.write_text("sampler c(seed: seed, t: float) -> token { temperature(t) sample(seed) }\n")
    assert list(serve.load_programs([str(own)])) == ["c"]
    for decl, name in (("b: bias", "b"),):
        src = tmp_path / f"{name}.smp"
        src.write_text(f"sampler c(seed: seed, {decl}) -> token {{ temperature(0.7) sample(seed) }}\n")
        with pytest.raises(SamplecError, match=f"parameter '{name}'"):
            serve.load_programs([str(src)])
    ok = tmp_path / "ok.smp"
    ok.write_text("sampler c(seed: seed, t: float = 0.7, temperature: float, step: int) -> token "
                  "{ temperature(temperature) sample(seed, position = step) }\n")
    assert list(serve.load_programs([str(ok)])) == ["c"]


def test_a_port_in_use_exits_at_once_with_one_line(server):
    """The CLI: one line, exit 1, before anything listens (the port is bound before the model loads)."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "samplec", "serve", "--host", "127.0.0.1", "--demo", "--port",
                          str(server["httpd"].server_address[1])], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
    assert "cannot listen on 127.0.0.1:" in run.stderr and "Traceback" not in run.stderr and \
        "listening" not in run.stderr, run.stderr


def test_the_batchs_logit_bias_is_one_scatter_equal_to_each_rows_addition():
    """`add_bias`: every row's logit_bias (a rank's slice of the ids where `vocab_start` says so, a row repeated as
    a speculative round repeats it, rows without one) added to its row as `x + b` adds it, and -inf on the tokens
    its bad words ban at this step, in one scatter."""
    from samplec.backend_mlx.launches import launches, primitives
    V = 1000
    rng = np.random.default_rng(0)

    class R:            # (the fields of serve.Row that add_bias reads)
        bias_entries = serve.Row.bias_entries
        biased = serve.Row.biased
        banned = serve.Row.banned

        def __init__(self, bias, start=0, bad=(), generated=()):
            self.bias, self.vocab_start, self._bias_at, self._bias_cols = bias, start, None, ()
            self.step, self.min_tokens, self.held = len(generated), 0, []
            self.bad_always = tuple(sorted(q[0] for q in bad if len(q) == 1))
            self.bad_after = [(q[:-1], q[-1]) for q in bad if len(q) > 1]
            self.records, self._banned_at = [(t,) for t in generated], (-1, ())
    a = R({3: 1.5, 999: -100.0, 17: 0.25})
    b = R({})
    c = R({1200: 2.0, 1000: -1.0, 5: 7.0}, start=1000)      # (a second rank's slice: ids 1000..1999)
    d = R({}, bad=[(40,), (7, 9), (8, 11)], generated=[5, 7])     # (bans 40 and 9; 11 only after 8)
    rows = [a, b, c, a, c, d]
    x = rng.normal(0, 3, (len(rows), V)).astype(np.float32)
    got = serve.add_bias(mx.array(x), rows)
    ops = primitives([got])         # (the lazy graph, before it is evaluated)
    assert launches(ops) == 1 and sum(n for op, n in ops.items() if "catter" in op) == 1, ops
    want = x.copy()
    for i, r in enumerate(rows):
        for tok, v in r.bias.items():
            if r.vocab_start <= tok < r.vocab_start + V:
                want[i, tok - r.vocab_start] = want[i, tok - r.vocab_start] + np.float32(v)
    want[5, [9, 40]] = -np.inf
    assert d.banned() == (9, 40) and np.array_equal(np.array(got), want)
    xm = mx.array(x)
    assert serve.add_bias(xm, [b] * len(rows)) is xm         # (no row biased: the logits as they are)


def test_steps_without_logprobs_leave_the_models_logprobs_unevaluated(server, monkeypatch):
    """The batch's call evaluates raw_logprob and top_logprobs (a sort of the row on the portable target) only on the
    steps where a row asks for logprobs; with them the answer is the one a request always got."""
    import samplec.program as program
    asked = []
    real = program.Program.run
    monkeypatch.setattr(program.Program, "run", lambda self, x, names, **kw: asked.append(list(names)) or
                        real(self, x, names, **kw))
    c = server["client"]            # (the openai package, as a client calls)
    body = dict(model="demo", prompt="A sampler chain", max_tokens=4, temperature=0.9, seed=3)
    plain = c.completions.create(**body)
    assert asked and all("top_logprobs" not in n and "raw_logprob" not in n for n in asked), asked
    asked.clear()
    with_lp = c.completions.create(**body, logprobs=2)
    assert asked and all("top_logprobs" in n for n in asked), asked
    assert with_lp.choices[0].text == plain.choices[0].text
    lp = with_lp.choices[0].logprobs
    assert len(lp.top_logprobs) == 4 and all(len(t) in (2, 3) for t in lp.top_logprobs)   # (and the sampled one)


def test_a_chunked_request_body_is_read(server):
    """Transfer-Encoding: chunked (curl's, for a body from a pipe): the same answer as with a Content-Length; a
    malformed chunk is a 400."""
    import http.client
    host, port = server["httpd"].server_address[:2]
    body = json.dumps(dict(prompt="A sampler chain", max_tokens=5, temperature=1.0, seed=7)).encode()

    def send(chunks: bytes):
        conn = http.client.HTTPConnection(host, port, timeout=60)
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        conn.send(chunks)
        r = conn.getresponse()
        answer = r.status, json.loads(r.read())
        conn.close()
        return answer
    cut = len(body) // 3
    good = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:cut], body[cut:])) + b"0\r\n\r\n"
    status, answer = send(good)
    assert status == 200 and answer["choices"][0]["text"] == post(server["base"] + "/v1/completions",
                                                                  body)[1]["choices"][0]["text"]
    status, answer = send(b"zz\r\n" + body + b"\r\n0\r\n\r\n")
    assert status == 400 and "chunk" in answer["error"]["message"]


def test_a_history_no_stage_reads_for_a_row_is_sent_empty():
    """The histories a row's chain reads only through penalties that are neutral for the row are sent empty (no
    host work that grows with the completion): the default chain's `h` is read by the repetition penalty alone,
    `generated` by the presence and frequency penalties; a history another stage reads (DRY) is always sent."""
    import samplec
    prog = samplec.compile(serve.SERVER_CHAIN.replace("TOP", str(serve.TOP)))
    assert serve.history_readers(prog) == {"h": (("repetition_penalty", 1.0),),
                                           "generated": (("presence_penalty", 0.0), ("frequency_penalty", 0.0))}
    dry = samplec.compile("sampler d(h: tokens, r: float, seed: seed) -> token { penalties(h, repeat = r) "
                          "dry(h, 0.8) sample(seed) }")
    assert serve.history_readers(dry) == {"h": None}


def test_a_served_chain_that_draws_at_a_fixed_position_takes_fresh_noise(tmp_path):
    """A `--sampler` chain whose draw has no position (`sample(seed)`) takes the row's seed advanced by the
    position each step (decode.step_seed, as the decode loops): the steps of a flat-ish row are not one token
    repeated, and a seeded request is reproducible."""
    from samplec.decode import step_seeds
    src = tmp_path / "fixed.smp"
    src.write_text("sampler fixed(seed: seed, temperature: float) -> token, logprob "
                   "{ temperature(temperature) sample(seed) }\n")
    ready = threading.Event()
    box = {}

    def on_ready(httpd, app):
        box.update(httpd=httpd, app=app)
        ready.set()
    t = threading.Thread(target=serve.serve, args=(["--host", "127.0.0.1", "--port", "0"], [str(src)], True,
                                                   on_ready), daemon=True)
    t.start()
    assert ready.wait(120)
    try:
        host, port = box["httpd"].server_address[:2]
        c = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0, timeout=60)
        kw = dict(model="demo", prompt="A sampler chain", max_tokens=16, temperature=2.0, seed=4,
                  logit_bias={"1": -100})
        first = c.completions.create(**kw, logprobs=0).choices[0]
        assert len(set(first.logprobs.tokens)) > 8, first.logprobs.tokens
        assert c.completions.create(**kw).choices[0].text == first.text
        assert box["app"].sampler.drives["fixed"][1]
        assert step_seeds([4], [0])[0] != 4
    finally:
        box["httpd"].shutdown()
        t.join(60)


def test_the_http_layers_own_refusals_are_json_errors(server):
    """What the HTTP layer refuses before a handler runs -- a method no endpoint serves, a header line too long --
    is answered in OpenAI's error shape (JSON, as every other answer), not an HTML page."""
    import http.client
    host, port = server["httpd"].server_address[:2]
    for method, path, headers in (("DELETE", "/v1/models", {}), ("PUT", "/v1/completions", {}),
                                  ("GET", "/v1/models", {"X-Long": "x" * 70000})):
        conn = http.client.HTTPConnection(host, port, timeout=60)
        conn.request(method, path, headers=headers)
        r = conn.getresponse()
        status, kind, body = r.status, r.getheader("Content-Type"), r.read()
        conn.close()
        assert 400 <= status < 600 and kind == "application/json", (method, status, kind, body[:200])
        err = json.loads(body)["error"]
        assert err["type"] in ("invalid_request_error", "server_error") and err["message"]
    assert post(server["base"] + "/v1/completions", dict(prompt="x", max_tokens=2))[0] == 200


def test_tokenize_and_detokenize_as_vllms(server):
    """vLLM's /tokenize (a prompt as the completions endpoint reads it, a conversation as chat's) and
    /detokenize; the same request's usage counts the same tokens; bad fields are 400s naming them."""
    c, base, tok = server["client"], server["base"], server["app"].tokenizer
    status, t = post(base + "/tokenize", {"prompt": "Count the tokens", "return_token_strs": True})
    r = c.completions.create(model="demo", prompt="Count the tokens", max_tokens=1, seed=0)
    assert status == 200 and t["count"] == len(t["tokens"]) == r.usage.prompt_tokens == len(t["token_strs"])
    assert t["token_strs"] == tok.convert_ids_to_tokens(t["tokens"])
    assert post(base + "/detokenize", {"tokens": t["tokens"]})[1]["prompt"] == tok.decode(t["tokens"])
    assert post(base + "/v1/tokenize", {"prompt": "Count", "add_special_tokens": False})[1]["tokens"] == \
        list(tok.encode("Count", add_special_tokens=False))
    status, t = post(base + "/tokenize", {"messages": MSG})
    r = c.chat.completions.create(model="demo", messages=MSG, seed=0, max_tokens=1)
    assert status == 200 and t["count"] == r.usage.prompt_tokens
    for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": "x", "n": 2}, "n"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/tokenize", {"messages": [{"role": "wizard"}]}, "messages[0]"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
                              ("/tokenize", {"messages": MSG, "chat_template_kwargs": "x"}, "chat_template_kwargs"),
                              ("/tokenize", {"messages": MSG, "chat_template_kwargs": [1]},
                               "chat_template_kwargs"),
                              ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": [1]},
                               "chat_template_kwargs")):
        status, err = post(base + path, body)
        assert status in (400, 404) and err["error"]["param"] == param, (body, err)
