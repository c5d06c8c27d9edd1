"""OpenAI's Responses API (`POST /v1/responses`) in `samplec serve`, driven by the official `openai` client and
checked against the chat endpoint it stands on: the same text, finish (status), usage and log-probabilities for
the same request; `text.format` against its schema (jsonschema); function tools' calls against their parameters;
the stream's events against the SDK's own event types, OpenAI's order and the answer not streamed (the SDK's
`responses.stream()` helper included); input items reaching the prompt as chat's messages do; bad requests 400s
naming the Responses field."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pydantic = pytest.importorskip("pydantic")

from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

from serve_util import scripted_server, start, stop  # noqa: E402
from test_serve_tools import CALL, TEMPLATE, TOOLS, WEATHER  # noqa: E402

from samplec import serve  # noqa: E402

FLAT = [{"type": "function", **t["function"]} for t in TOOLS]     # (Responses' tools: flat)
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
STOP = ["e", "o", "a"]      # (stops the demo model's text early: a response that completes)


@pytest.fixture(scope="module")
def server():
    box = start()
    yield box
    stop(box)


def respond(c, x="Tell me about Paris.", y="Be brief.", seed=0, extra=None, **kw):
    return c.responses.create(model="demo", input=x, instructions=y, extra_body={"seed": seed, **(extra or {})},
                              **kw)


def chat(c, x="Tell me about Paris.", y="Be brief.", seed=0, extra=None, **kw):
    return c.chat.completions.create(model="demo", messages=[{"role": "system", "content": y},
                                                             {"role": "user", "content": x}],
                                     seed=seed, extra_body=extra or None, **kw)


def raw(server, body: dict):
    """The server's own JSON (a Response, or the stream's events) checked against the SDK's types by validation
    (the client builds its objects without it)."""
    req = urllib.request.Request(server["url"] + "/responses", json.dumps({"model": "demo", **body}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        text = r.read().decode()
    if not body.get("stream"):
        return Response.model_validate(json.loads(text)).to_dict(), json.loads(text)
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        e = json.loads(lines["data"])
        assert lines["event"] == e["type"]
        EVENT.validate_python(e)
        events.append(e)
    return events


def same(a: dict, b: dict) -> dict:
    """A Response with what differs between two answers to one request left out: ids (a call's too), times, and
    the SDK's parsed_* fields."""
    drop = {"id", "call_id", "created_at", "completed_at", "parsed_arguments", "parsed"}
    if isinstance(a, dict):
        return {k: same(v, None) for k, v in a.items() if k not in drop}
    if isinstance(a, list):
        return [same(v, None) for v in a]
    return a


def check_order(events: list[dict]):
    """OpenAI's order: created, in_progress; each output item added, its content, done (one item at a time, but
    for a message that stays open while calls read out of its text are written); one closing lifecycle event;
    sequence numbers 0, 1, 2, ...; every event of an item naming that item and its place."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    rid = events[0]["response"]["id"]
    assert all(e["response"]["id"] == rid for e in (events[1], events[-1]))
    open_items, seen = {}, []
    for e in events[2:-1]:
        t = e["type"]
        if t == "response.output_item.added":
            assert e["output_index"] == len(seen) and e["item"]["status"] == "in_progress"
            open_items[e["output_index"]] = {"item": e["item"], "parts": [], "text": "", "args": "", "done": []}
            seen.append(e["item"]["id"])
            continue
        o = open_items[e["output_index"]]
        assert e.get("item_id", e.get("item", {}).get("id")) == o["item"]["id"]
        kind = o["item"]["type"]
        if t == "response.content_part.added":
            assert kind == "message" and not o["parts"] and e["content_index"] == 0
            o["parts"].append(e["part"])
        elif t == "response.output_text.delta":
            assert kind == "message" and o["parts"] and not o["done"]
            o["text"] += e["delta"]
        elif t == "response.output_text.done":
            assert kind == "message" and e["text"] == o["text"] and not o["done"]
            o["done"].append(t)
        elif t == "response.content_part.done":
            assert o["done"] == ["response.output_text.done"] and e["part"]["text"] == o["text"]
            o["done"].append(t)
        elif t == "response.function_call_arguments.delta":
            assert kind == "function_call" and not o["done"]
            o["args"] += e["delta"]
        elif t == "response.function_call_arguments.done":
            assert kind == "function_call" and e["arguments"] == o["args"] and not o["done"]
            o["done"].append(t)
        elif t == "response.output_item.done":
            want = ["response.output_text.done", "response.content_part.done"] if kind == "message" else \
                ["response.function_call_arguments.done"]
            assert o["done"] == want
            if kind == "message":
                assert e["item"]["content"][0]["text"] == o["text"]
            else:
                assert e["item"]["arguments"] == o["args"]
            del open_items[e["output_index"]]
        else:
            raise AssertionError(f"unexpected event {t}")
        if kind == "function_call":       # (a call is written whole before the next item begins)
            assert e["output_index"] == len(seen) - 1
    assert not open_items, "items never done"
    final = events[-1]["response"]["output"]
    assert [i["id"] for i in final] == seen


def test_text_is_the_chat_endpoints(server):
    """input "x" with instructions "y" is chat's [system y, user x]: the same text for the same seed and values,
    the finish as the status (length: incomplete, max_output_tokens), the same usage."""
    c = server["client"]
    for seed, extra, n in ((0, None, 12), (1, {"top_k": 5}, 9), (2, {"stop": STOP}, 40), (3, {"min_p": 0.1}, 30)):
        ch = chat(c, seed=seed, extra=extra, max_completion_tokens=n, temperature=0.8)
        r = respond(c, seed=seed, extra=extra, max_output_tokens=n, temperature=0.8)
        want = ch.choices[0].message.content
        assert r.output_text == want and r.object == "response" and r.model == "demo"
        (m,) = r.output
        assert m.type == "message" and m.role == "assistant" and [p.type for p in m.content] == ["output_text"]
        finish = ch.choices[0].finish_reason
        assert r.status == ("incomplete" if finish == "length" else "completed") == m.status
        assert (r.incomplete_details.reason if r.incomplete_details else None) == \
            ("max_output_tokens" if finish == "length" else None)
        assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == \
            (ch.usage.prompt_tokens, ch.usage.completion_tokens, ch.usage.total_tokens)
        assert r.max_output_tokens == n and r.instructions == "Be brief."
        assert r.store is True and c.responses.retrieve(r.id).to_dict() == r.to_dict()      # (kept: OpenAI's default)
    assert respond(c, seed=2, extra={"stop": STOP}, max_output_tokens=40).status == "completed"
    # a list of message items (developer: a system message) is the same conversation
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me about Paris."}]}]
    r = c.responses.create(model="demo", input=items, max_output_tokens=10, extra_body={"seed": 5})
    assert r.output_text == chat(c, seed=5, max_completion_tokens=10).choices[0].message.content


def test_the_response_object_is_the_sdks(server):
    """The JSON the server writes validates as the SDK's Response (not merely built from it)."""
    r, body = raw(server, {"input": "hi", "max_output_tokens": 5, "seed": 0, "metadata": {"k": "v"}})
    assert body["object"] == "response" and body["status"] == "incomplete" and body["metadata"] == {"k": "v"}
    assert body["usage"]["input_tokens_details"]["cached_tokens"] == 0
    r, body = raw(server, {"input": "hi", "max_output_tokens": 60, "seed": 0, "stop": STOP})
    assert body["status"] == "completed" and body["completed_at"] >= body["created_at"]
    assert body["incomplete_details"] is None


def kinds(types: list[str]) -> list[str]:
    """A stream's event types with each run of one kind of delta as one."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


@pytest.mark.parametrize("extra,n", [({"stop": STOP}, 60), (None, 10)])
def test_streamed_is_not_streamed(server, extra, n):
    """The stream's events are the SDK's types, in OpenAI's order, numbered 0, 1, ...; their deltas joined are the
    text not streamed, and the closing event's Response is the one not streamed (response.incomplete where
    max_output_tokens cut it, as OpenAI's: the SDK's stream helper then has no final response)."""
    c = server["client"]
    body = {"input": "Tell me about Paris.", "instructions": "Be brief.", "max_output_tokens": n, "seed": 7,
            **(extra or {})}
    _, whole = raw(server, body)
    events = raw(server, {**body, "stream": True})
    check_order(events)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"]
    want = "response.completed" if whole["status"] == "completed" else "response.incomplete"
    assert events[-1]["type"] == want and (extra is None) == (want == "response.incomplete")
    assert same(events[-1]["response"], None) == same(whole, None)
    # the client's own stream (create(stream=True)) and its helper
    kw = dict(model="demo", input=body["input"], instructions="Be brief.", max_output_tokens=n,
              extra_body={"seed": 7, **(extra or {})})
    got = list(c.responses.create(stream=True, **kw))
    # (how many deltas carry the text depends on when the handler reads the engine's progress: the event kinds,
    # runs of deltas as one, and the text they carry are the same)
    assert kinds([e.type for e in got]) == kinds([e["type"] for e in events])
    assert "".join(e.delta for e in got if e.type == "response.output_text.delta") == text
    with c.responses.stream(**kw) as s:
        seen = list(s)
        assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == text
        if want == "response.completed":
            final = s.get_final_response()
            assert same(final.to_dict(), None) == same(Response.model_validate(whole).to_dict(), None)
            assert final.output_text == text
        else:
            assert seen[-1].type == "response.incomplete"
            assert seen[-1].response.incomplete_details.reason == "max_output_tokens"
            with pytest.raises(RuntimeError, match="response.completed"):
                s.get_final_response()


def test_logprobs_are_the_chat_endpoints(server):
    """include ["message.output_text.logprobs"] with top_logprobs: the output_text part's logprobs are chat's
    for the same request (token, logprob, bytes, alternatives); streamed, the deltas' logprobs joined are
    the same; without include the part has none."""
    c = server["client"]
    ch = chat(c, seed=4, max_completion_tokens=8, logprobs=True, top_logprobs=3)
    want = [(t.token, t.logprob, t.bytes, [(a.token, a.logprob, a.bytes) for a in t.top_logprobs])
            for t in ch.choices[0].logprobs.content]
    assert len(want) == 8
    r = respond(c, seed=4, max_output_tokens=8, include=["message.output_text.logprobs"], top_logprobs=3)
    got = [(t.token, t.logprob, t.bytes, [(a.token, a.logprob, a.bytes) for a in t.top_logprobs])
           for t in r.output[0].content[0].logprobs]
    assert got == want
    events = raw(server, {"input": "Tell me about Paris.", "instructions": "Be brief.", "max_output_tokens": 8,
                          "seed": 4, "include": ["message.output_text.logprobs"], "top_logprobs": 3,
                          "stream": True})
    check_order(events)
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert [(t["token"], t["logprob"], [(a["token"], a["logprob"]) for a in t["top_logprobs"]])
            for t in streamed] == [(t[0], t[1], [(a[0], a[1]) for a in t[3]]) for t in want]
    assert respond(c, seed=4, max_output_tokens=8, top_logprobs=3).output[0].content[0].logprobs == []


def test_text_format_json_schema(server):
    """text.format json_schema: the text is JSON valid against the schema, as chat's response_format gives."""
    c = server["client"]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    for seed in range(3):
        r = respond(c, seed=seed, max_output_tokens=80,
                    text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), schema)
        ch = chat(c, seed=seed, max_completion_tokens=80, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
        assert r.output_text == ch.choices[0].message.content
        assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    r = respond(c, seed=0, max_output_tokens=60, text={"format": {"type": "json_object"}})
    ch = chat(c, seed=0, max_completion_tokens=60, response_format={"type": "json_object"})
    assert r.output_text == ch.choices[0].message.content


def calls_of(resp) -> list[tuple[str, str]]:
    return [(o.name, o.arguments) for o in resp.output if o.type == "function_call"]


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_function_tools_are_called(server, choice):
    """Flat function tools with tool_choice a named function or required: function_call items (call_id, name,
    arguments valid against the tool's parameters), chat's calls for the same seed; streamed the same items, in
    OpenAI's order, and the stream helper's final response the one not streamed."""
    c = server["client"]
    chat_choice = {"type": "function", "function": {"name": "get_weather"}} if isinstance(choice, dict) else choice
    made = 0
    for seed in range(3):
        kw = dict(seed=seed, max_output_tokens=300, temperature=1.0, tools=FLAT, tool_choice=choice)
        r = respond(c, **kw)
        ch = chat(c, seed=seed, max_completion_tokens=300, temperature=1.0, tools=TOOLS, tool_choice=chat_choice)
        want = [(t.function.name, t.function.arguments) for t in ch.choices[0].message.tool_calls or ()]
        assert calls_of(r) == want
        if r.status == "incomplete":        # (cut short)
            continue
        made += 1
        assert want and all(o.type == "function_call" for o in r.output)
        for o in r.output:
            assert o.call_id.startswith("call_") and o.status == "completed"
            jsonschema.validate(json.loads(o.arguments), SCHEMAS[o.name])
        body = {"input": "Tell me about Paris.", "instructions": "Be brief.", "max_output_tokens": 300,
                "temperature": 1.0, "seed": seed, "tools": FLAT, "tool_choice": choice}
        events = raw(server, {**body, "stream": True})
        check_order(events)
        _, whole = raw(server, body)
        assert [(i["name"], i["arguments"]) for i in events[-1]["response"]["output"]] == want
        assert same(events[-1]["response"], None) == same(whole, None)
        sk = {k: v for k, v in kw.items() if k not in ("seed", "max_output_tokens")}
        with c.responses.stream(model="demo", input=body["input"], instructions="Be brief.", max_output_tokens=300,
                                extra_body={"seed": seed}, **sk) as s:
            final = s.get_final_response()
        assert calls_of(final) == want
        assert same(final.to_dict(), None) == same(Response.model_validate(whole).to_dict(), None)
    assert made


@pytest.mark.parametrize("extra", [
    {"tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 5},
    {"tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 5,
     "include": ["message.output_text.logprobs"]},
    {"tool_choice": "required", "max_output_tokens": 300, "include": ["message.output_text.logprobs"]},
    {"tool_choice": "required", "max_output_tokens": 8, "include": ["message.output_text.logprobs"]},
])
def test_forced_calls_streamed_are_not_streamed(server, extra):
    """Forced calls, cut short or not, with logprobs or not: the stream's closing Response is the one not streamed
    (a named call cut by max_output_tokens an incomplete function_call either way, `required`'s calls with no
    message beside them, `required`'s array cut short a message), and chat's answer has the same calls."""
    body = {"input": "Tell me about Paris.", "instructions": "Be brief.", "seed": 0, "tools": FLAT, **extra}
    _, whole = raw(server, body)
    events = raw(server, {**body, "stream": True})
    check_order(events)
    assert same(events[-1]["response"], None) == same(whole, None)
    choice = extra["tool_choice"]
    ch = chat(server["client"], seed=0, max_completion_tokens=extra["max_output_tokens"], tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": choice["name"]}} if isinstance(choice, dict)
              else choice)
    assert calls_of_dict(whole) == [(t.function.name, t.function.arguments)
                                    for t in ch.choices[0].message.tool_calls or ()]
    if isinstance(choice, dict):
        (item,) = whole["output"]
        assert item["type"] == "function_call" and item["status"] == "incomplete" == whole["status"]


def calls_of_dict(resp: dict) -> list[tuple[str, str]]:
    return [(o["name"], o["arguments"]) for o in resp["output"] if o["type"] == "function_call"]


def test_function_call_items_reach_the_prompt(server):
    """function_call and function_call_output input items are chat's assistant tool_calls and tool messages: the
    prompt has chat's token count (and not the count without them)."""
    c = server["client"]
    args = json.dumps({"city": "Paris", "unit": "celsius"})
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
             {"type": "function_call", "call_id": "call_2", "name": "now", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]}]
    messages = [{"role": "system", "content": "Be brief."}, items[0],
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}},
                    {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
    ch = c.chat.completions.create(model="demo", messages=messages, seed=3, max_completion_tokens=6, tools=TOOLS,
                                   tool_choice="none")
    r = c.responses.create(model="demo", instructions="Be brief.", input=items, max_output_tokens=6, tools=FLAT,
                           tool_choice="none", extra_body={"seed": 3})
    assert r.usage.input_tokens == ch.usage.prompt_tokens
    assert r.output_text == ch.choices[0].message.content
    bare = c.responses.create(model="demo", instructions="Be brief.", input=items[:1], max_output_tokens=6,
                              extra_body={"seed": 3})
    assert bare.usage.input_tokens < r.usage.input_tokens


@pytest.mark.parametrize("body,param", [
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "now"}]},
     "input[1].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input[0].output[0]"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": "ten"}, "max_output_tokens"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "parameters": WEATHER}], "tool_choice": "required"}, "tools[0].name"),
    ({"tools": [FLAT[0], FLAT[0]], "tool_choice": "required"}, "tools[1].name"),
    ({"tools": FLAT, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": FLAT, "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"include": ["message.output_text.everything"]}, "include[0]"),
    ({"include": ["message.output_text.logprobs", 3]}, "include"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 50}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"previous_response_id": 1}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
    ({"reasoning": "high"}, "reasoning"),
    ({"store": "yes"}, "store"),
    ({"instructions": ["x"]}, "instructions"),
    ({"temperature": -1}, "temperature"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ({"max_tokens": 5}, "max_tokens"),
])
def test_bad_requests_are_400s_naming_the_responses_field(server, body, param):
    c = server["client"]
    kw = {"input": "hi", **body}
    with pytest.raises(openai.BadRequestError) as e:
        c.post("/responses", cast_to=Response, body={"model": "demo", **kw})
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"


# -- conversation state: stored Responses, previous_response_id, retrieve and delete

LOGPROBS = ["message.output_text.logprobs"]


def said(r) -> dict:
    """What a turn said and cost: its text, calls, status, prompt size and log-probabilities."""
    part = [p for o in r.output if o.type == "message" for p in o.content]
    return {"text": r.output_text, "calls": calls_of(r), "status": r.status, "input": r.usage.input_tokens,
            "logprobs": [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                         for p in part for t in p.logprobs or ()]}


def turn(c, x, seed, previous=None, y=None, **kw):
    """One turn, continued from `previous` where given (logprobs included, a few tokens)."""
    kw = {"max_output_tokens": 8, "include": LOGPROBS, "top_logprobs": 2, **kw}
    if y is not None:
        kw["instructions"] = y
    if previous is not None:
        kw["previous_response_id"] = previous
    return c.responses.create(model="demo", input=x, extra_body={"seed": seed}, **kw)


def whole(c, items, seed, y=None, **kw):
    """The same turn with the whole conversation sent as input items (and not stored)."""
    return turn(c, items, seed, y=y, store=False, **kw)


def http(server, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """A request as the server answers it (status, JSON), errors included."""
    req = urllib.request.Request(server["url"] + path, json.dumps(body).encode() if body is not None else None,
                                 {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def gone(c, rid: str):
    """A response not stored: retrieve is a 404, and continuing it a 404 naming previous_response_id."""
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError) as e:
        turn(c, "Go on.", 0, previous=rid)
    assert e.value.status_code == 404 and e.value.body["param"] == "previous_response_id"
    assert rid in e.value.body["message"]


def test_previous_response_id_is_the_whole_conversation(server):
    """Turns chained with previous_response_id are the same turns sent whole (input items, the earlier answers as
    assistant messages), and chat's messages: the same text, prompt size and log-probabilities, three turns on."""
    c = server["client"]
    r1 = turn(c, "Tell me about Paris.", 0, y="Be brief.")
    assert r1.store is True and r1.previous_response_id is None
    r2 = turn(c, "And Rome?", 1, previous=r1.id, y="Be brief.")
    items = [{"role": "user", "content": "Tell me about Paris."}, {"role": "assistant", "content": r1.output_text},
             {"role": "user", "content": "And Rome?"}]
    w2 = whole(c, items, 1, y="Be brief.")
    assert said(r2) == said(w2) and r2.previous_response_id == r1.id
    assert said(r2)["input"] > said(turn(c, "And Rome?", 1, y="Be brief."))["input"]     # (the history is there)
    r3 = turn(c, "And Berlin?", 2, previous=r2.id, y="Be brief.")
    items += [{"role": "assistant", "content": r2.output_text}, {"role": "user", "content": "And Berlin?"}]
    assert said(r3) == said(whole(c, items, 2, y="Be brief."))
    ch = c.chat.completions.create(model="demo", messages=[{"role": "system", "content": "Be brief."}, *items],
                                   seed=2, max_completion_tokens=8, logprobs=True, top_logprobs=2)
    assert (r3.output_text, r3.usage.input_tokens) == (ch.choices[0].message.content, ch.usage.prompt_tokens)
    assert said(r3)["logprobs"] == [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                                    for t in ch.choices[0].logprobs.content]
    # a list of items continued the same: a developer message in the input is the conversation's, carried on
    r4 = turn(c, [{"role": "developer", "content": "Use French."}, {"role": "user", "content": "Lyon?"}], 3,
              previous=r3.id)
    items += [{"role": "assistant", "content": r3.output_text}, {"role": "developer", "content": "Use French."},
              {"role": "user", "content": "Lyon?"}]
    r5 = turn(c, "Nice?", 4, previous=r4.id)
    items += [{"role": "assistant", "content": r4.output_text}, {"role": "user", "content": "Nice?"}]
    assert said(r5) == said(whole(c, items, 4))


def test_instructions_are_not_carried_over(server):
    """As OpenAI's: a previous response's instructions do not reach the next prompt; the new request's are a system
    message first, before the stored conversation."""
    c = server["client"]
    r1 = turn(c, "Tell me about Paris.", 0, y="Be brief.")
    items = [{"role": "user", "content": "Tell me about Paris."}, {"role": "assistant", "content": r1.output_text},
             {"role": "user", "content": "And Rome?"}]
    bare = turn(c, "And Rome?", 5, previous=r1.id)
    assert said(bare) == said(whole(c, items, 5)) and bare.instructions is None
    assert said(bare)["input"] != said(whole(c, items, 5, y="Be brief."))["input"]
    other = turn(c, "And Rome?", 5, previous=r1.id, y="Answer in one word.")
    assert said(other) == said(whole(c, items, 5, y="Answer in one word."))


def test_function_calls_are_carried(server):
    """A turn's function_call items are the conversation's: the next turn gives only a function_call_output naming
    the call_id, and the prompt is the one with the call and its output sent whole (and chat's)."""
    c = server["client"]
    name = {"type": "function", "name": "get_weather"}
    for seed in range(6):
        r1 = turn(c, "What is the weather in Paris?", seed, y="Be brief.", tools=FLAT, tool_choice=name,
                  max_output_tokens=300, include=[], top_logprobs=None)
        if r1.status == "completed":
            break
    (call,) = [o for o in r1.output if o.type == "function_call"]
    out = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    r2 = turn(c, [out], 3, previous=r1.id, y="Be brief.", tools=FLAT, tool_choice="none")
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}, out]
    assert said(r2) == said(whole(c, items, 3, y="Be brief.", tools=FLAT, tool_choice="none"))
    ch = c.chat.completions.create(model="demo", seed=3, max_completion_tokens=8, tools=TOOLS, tool_choice="none",
                                   messages=[{"role": "system", "content": "Be brief."}, items[0],
                                             {"role": "assistant", "content": None, "tool_calls": [
                                                 {"id": call.call_id, "type": "function",
                                                  "function": {"name": call.name, "arguments": call.arguments}}]},
                                             {"role": "tool", "tool_call_id": call.call_id, "content": out["output"]}])
    assert (r2.output_text, r2.usage.input_tokens) == (ch.choices[0].message.content, ch.usage.prompt_tokens)


def test_retrieve_and_delete(server):
    """GET /v1/responses/{id} is the stored Response as it was answered (streamed: the closing event's); DELETE
    removes it (OpenAI's `response.deleted` answer), after which it cannot be read, continued or deleted again."""
    c = server["client"]
    r = turn(c, "Tell me about Paris.", 0, y="Be brief.")
    got = c.responses.retrieve(r.id)
    assert got.to_dict() == r.to_dict() and got.store is True
    status, body = http(server, "GET", f"/responses/{r.id}")
    assert status == 200 and Response.model_validate(body).to_dict() == r.to_dict()
    for n, extra in ((60, {"stop": STOP}), (6, None)):      # (completed and incomplete streams both kept)
        events = raw(server, {"input": "Hi", "max_output_tokens": n, "seed": 3, "stream": True, **(extra or {})})
        last = events[-1]["response"]
        assert events[0]["response"]["store"] is True and last["status"] in ("completed", "incomplete")
        assert c.responses.retrieve(last["id"]).to_dict() == Response.model_validate(last).to_dict()
        nxt = turn(c, "Go on.", 4, previous=last["id"])
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        items = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text},
                 {"role": "user", "content": "Go on."}]
        assert said(nxt) == said(whole(c, items, 4))
    status, body = http(server, "DELETE", f"/responses/{r.id}")
    assert status == 200 and body == {"id": r.id, "object": "response.deleted", "deleted": True}
    gone(c, r.id)
    status, body = http(server, "DELETE", f"/responses/{r.id}")
    assert status == 404 and r.id in body["error"]["message"]
    c.responses.delete(last["id"])          # (the client's own delete)
    gone(c, last["id"])


def test_store_false_is_not_kept(server):
    """store: false is answered store: false and kept nowhere: retrieve and previous_response_id are 404s, as for
    an id never given, streamed or not."""
    c = server["client"]
    r = turn(c, "Tell me about Paris.", 0, store=False)
    assert r.store is False
    gone(c, r.id)
    gone(c, "resp_" + "0" * 32)
    events = raw(server, {"input": "Hi", "max_output_tokens": 6, "seed": 3, "stream": True, "store": False})
    assert events[-1]["response"]["store"] is False
    gone(c, events[-1]["response"]["id"])


def test_a_bounded_store_evicts_the_least_recently_used():
    """--responses-store 2: a third response evicts the least recently used one -- a response read or continued is
    used -- and what is left continues as the whole conversation does; --responses-store 0 keeps nothing (store
    answered false); a negative count is refused."""
    box = start(["--responses-store", "2"])
    try:
        c = box["client"]
        a, b = turn(c, "One.", 0), turn(c, "Two.", 1)
        c.responses.retrieve(a.id)                  # (a used: b is now the least recently used)
        d = turn(c, "Three.", 2)
        gone(c, b.id)
        assert c.responses.retrieve(a.id).to_dict() == a.to_dict()
        e = turn(c, "Four.", 3, previous=d.id)      # (d continued, then e stored: a goes)
        gone(c, a.id)
        items = [{"role": "user", "content": "Three."}, {"role": "assistant", "content": d.output_text},
                 {"role": "user", "content": "Four."}]
        assert said(e) == said(whole(c, items, 3))
        assert len(box["app"].responses) == 2
        assert c.responses.retrieve(d.id).to_dict() == d.to_dict()
    finally:
        stop(box)
    box = start(["--responses-store", "0"])
    try:
        c = box["client"]
        r = turn(c, "One.", 0, store=True)
        assert r.store is False and len(box["app"].responses) == 0
        gone(c, r.id)
    finally:
        stop(box)
    with pytest.raises(serve.SamplecError, match="--responses-store"):
        serve.serve(["--responses-store", "-1"], [], True)


def test_concurrent_conversations_stay_their_own(server):
    """Several threads each chaining their own conversation (store and continue at once): every turn is its
    conversation sent whole."""
    import threading
    c = server["client"]
    runs, errors = {}, []

    def run(k):
        try:
            previous, said_turns = None, []
            for t in range(3):
                r = turn(c, f"Conversation {k}, turn {t}.", 10 * k + t, previous=previous)
                said_turns.append(r)
                previous = r.id
            runs[k] = said_turns
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for k, turns in runs.items():
        items = []
        for t, r in enumerate(turns):
            items.append({"role": "user", "content": f"Conversation {k}, turn {t}."})
            assert said(r) == said(whole(c, items, 10 * k + t))
            items.append({"role": "assistant", "content": r.output_text})
    assert len(runs) == 5


# -- auto: a model scripted to write calls in its tokenizer's format

@pytest.fixture(scope="module")
def scripted():
    box = scripted_server(TEMPLATE)
    yield box
    stop(box)


def say(box, text: str):
    tok = box["tok"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about Paris."}]
    prompt = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    box["model"].expect(len(prompt), tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("text,content,calls", [
    (CALL, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("\n" + CALL + "\n", None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("Let me look. " + CALL, "Let me look. ", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
])
def test_auto_calls_read_from_the_text(scripted, text, content, calls):
    """auto: the calls the model wrote are function_call items after the message of the text around them (none
    where that text is blank), as chat's tool_calls and content; streamed, the same output in OpenAI's order."""
    c = scripted["client"]
    say(scripted, text)
    ch = chat(c, max_completion_tokens=200, tools=TOOLS)
    m = ch.choices[0].message
    assert m.content == content
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or ()] == calls
    say(scripted, text)
    r = respond(c, max_output_tokens=200, tools=FLAT)
    assert r.status == "completed"
    assert [o.type for o in r.output] == ["message"] * (content is not None) + ["function_call"] * len(calls)
    assert r.output_text == (content or "")
    assert [(n, json.loads(a)) for n, a in calls_of(r)] == calls
    say(scripted, text)
    _, whole = raw(scripted, {"input": "Tell me about Paris.", "instructions": "Be brief.", "max_output_tokens": 200,
                              "seed": 0, "tools": FLAT})
    say(scripted, text)
    events = raw(scripted, {"input": "Tell me about Paris.", "instructions": "Be brief.", "max_output_tokens": 200,
                            "seed": 0, "tools": FLAT, "stream": True})
    check_order(events)
    assert same(events[-1]["response"], None) == same(whole, None)


def test_chat_field_names_are_the_input_items():
    """A chat check's field (messages[k]..., tools[i].function..., response_format...) named as the Responses
    request has it: the input item chat message k came from (instructions first; consecutive function_call items
    one assistant message, its calls by position)."""
    from samplec import responses
    origins = []
    items = [{"role": "user", "content": "hi"},
             {"type": "function_call", "call_id": "a", "name": "now", "arguments": "{}"},
             {"type": "function_call", "call_id": "b", "name": "now", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "b", "output": "noon"}]
    chat = responses.to_chat({"instructions": "Be brief.", "input": items}, origins)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    name = responses.field_name
    assert name("messages[0].content", origins) == "instructions"
    assert name("messages[1].content", origins) == "input[0].content"
    assert name("messages[2].tool_calls[1].function.arguments", origins) == "input[2].arguments"
    assert name("messages[2].tool_calls[0].id", origins) == "input[1].call_id"
    assert name("messages[3].tool_call_id", origins) == "input[3].call_id"
    assert name("tools[2].function.parameters") == "tools[2].parameters"
    assert name("response_format.json_schema.schema") == "text.format.schema"
    assert name("max_completion_tokens") == "max_output_tokens" and name("messages") == "input"
