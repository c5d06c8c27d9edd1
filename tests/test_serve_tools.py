"""Tool calling in `samplec serve` (OpenAI's `tools` / `tool_choice`), driven by the official `openai` client:
forced calls (a named function, `required`) constrained by their JSON schema on any model; `auto` read out of the
model's text by its tokenizer's tool parser (mlx-lm's), shown with a model scripted to write a call; `none`; tool
messages and earlier calls reaching the chat template; streamed answers equal to non-streamed ones; bad tools and
tool choices answered 400 naming the field."""
from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from samplec import serve, tools  # noqa: E402
from serve_util import scripted_server, start, stop  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "description": "The time",
                                           "parameters": {"type": "object", "properties": {},
                                                          "additionalProperties": False}}}]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
# a ChatML template that writes the tools and earlier calls as Qwen's and Hermes' do (mlx-lm reads the json_tools
# format off such a template: `<tool_call>` and `tool_call.name`)
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t.function | tojson }}{% endfor %}"
    "\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}{% endif %}"
    "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def server():
    box = start()
    yield box
    stop(box)


def create(c, **kw):
    return c.chat.completions.create(model="demo", messages=kw.pop("messages", MSG), **kw)


def streamed(c, **kw):
    """A streamed answer put together as a client does: content, and each call by its index."""
    content, calls, finish = "", {}, None
    for chunk in create(c, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or ():
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or tc.id
                entry["name"] += tc.function.name or "" if tc.function else ""
                entry["arguments"] += tc.function.arguments or "" if tc.function else ""
            finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def named(name):
    return {"type": "function", "function": {"name": name}}


def test_a_named_function_is_called_with_arguments_of_its_schema(server):
    """tool_choice naming a function: the output is that function's arguments, constrained by its parameters'
    JSON schema (any model writes a valid call), finish_reason "stop" (as OpenAI's and vLLM's forced calls)."""
    c = server["client"]
    for seed in range(4):
        r = create(c, tools=TOOLS, tool_choice=named("get_weather"), seed=seed, max_tokens=200, temperature=1.0)
        m = r.choices[0].message
        assert m.content is None and r.choices[0].finish_reason == "stop"
        (call,) = m.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        content, calls, finish = streamed(c, tools=TOOLS, tool_choice=named("get_weather"), seed=seed,
                                          max_tokens=200, temperature=1.0)
        assert (content, finish) == ("", "stop")
        assert [(x["name"], x["arguments"]) for x in calls] == [("get_weather", call.function.arguments)]
    r = create(c, tools=TOOLS, tool_choice=named("now"), seed=0, max_tokens=50)
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {}


def test_a_named_call_cut_short_is_the_same_call_streamed_or_not(server):
    """A named function's arguments cut by max_tokens: the call with its arguments as far as they came
    (finish_reason "length"), as vLLM's -- the stream has sent them as the call's, and the answer not streamed is
    what the stream put together gives."""
    c = server["client"]
    kw = dict(tools=TOOLS, tool_choice=named("get_weather"), seed=0, max_tokens=5)
    ch = create(c, **kw).choices[0]
    assert ch.finish_reason == "length" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    content, calls, finish = streamed(c, **kw)
    assert (content, finish) == ("", "length")
    assert [(x["name"], x["arguments"]) for x in calls] == [("get_weather", call.function.arguments)]


def test_required_makes_one_or_more_calls_of_the_tools(server):
    """tool_choice "required": a JSON array of {name, parameters} (vLLM's schema) read as the calls, each name one
    of the tools and its arguments valid for it; finish_reason "tool_calls"; parallel_tool_calls false: one call."""
    c = server["client"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(4):
        kw = dict(tools=TOOLS, tool_choice="required", seed=seed, max_tokens=400, temperature=1.0)
        r = create(c, **kw)
        ch = r.choices[0]
        if ch.finish_reason == "length":        # (cut short: the text stays text)
            assert ch.message.tool_calls is None and ch.message.content
            continue
        assert ch.finish_reason == "tool_calls" and ch.message.content is None and ch.message.tool_calls
        for call in ch.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        content, calls, finish = streamed(c, **kw)
        assert (content, finish) == ("", "tool_calls")
        assert [(x["name"], json.loads(x["arguments"])) for x in calls] == \
            [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls]
        one = create(c, **kw, parallel_tool_calls=False).choices[0]
        assert one.finish_reason == "length" or len(one.message.tool_calls) == 1


def test_tool_choice_none_and_no_tools_answer_text(server):
    c = server["client"]
    plain = create(c, seed=3, max_tokens=12)
    r = create(c, tools=TOOLS, tool_choice="none", seed=3, max_tokens=12)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    # (the demo tokenizer has no chat template: its `role: content` lines do not write tools -- same prompt)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens


def test_auto_needs_a_tool_call_format(server):
    """The demo tokenizer has no tool-call format: auto (the default with tools) is a 400 naming tool_choice."""
    c = server["client"]
    for kw in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError, match="tool-call format") as e:
            create(c, tools=TOOLS, max_tokens=4, **kw)
        assert e.value.body["param"] == "tool_choice"


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": named("nope")}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": {"get_weather": WEATHER}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"parameters": WEATHER}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameter": {}}}]}, "tools[0].function"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "noon", "tool_call_id": 7}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "now"}}]}]},
     "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": {"name": "now"}}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [{"type": "function", "function": {"name": n, "parameters": {
        "$defs": {"Unit": {"enum": [u]}}, "type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}}}}}
        for n, u in (("f", "c"), ("g", "f"))], "tool_choice": "required"}, "tools[1].function.parameters"),
])
def test_bad_tools_are_400s_naming_the_field(server, body, param):
    c = server["client"]
    kw = {"messages": MSG, **body}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="demo", max_tokens=4, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_tool_messages_and_calls_reach_the_chat_template(server, monkeypatch):
    """The tools, an assistant message's calls (arguments as an object) and a tool message's id are the
    template's to write, as vLLM and mlx-lm pass them."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    hf = server["app"].tokenizer._tokenizer
    monkeypatch.setattr(hf, "has_chat_template", hf.has_chat_template)
    monkeypatch.setattr(hf, "chat_template", TEMPLATE)
    tok = TokenizerWrapper(hf)
    msgs = MSG + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    parse = serve.Parser(tok, 512, {"c": None}, "demo")
    ids = parse._prompts("chat", {"messages": msgs}, tools.parse({"tools": TOOLS, "tool_choice": "none"}))[0][0]
    text = tok.decode(ids)
    assert "<tools>" in text and json.dumps(TOOLS[0]["function"]) in text
    assert "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>" in text
    assert "<|im_start|>tool\nsunny [call_1]<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


# -- auto: a model scripted to write a given text, and the tokenizer's own tool parser

@pytest.fixture(scope="module")
def scripted():
    box = scripted_server(TEMPLATE)
    yield box
    stop(box)


def say(box, text: str, messages=MSG, tool_list=TOOLS):
    tok = box["tok"]
    prompt = tok.apply_chat_template(messages, tools=tool_list, add_generation_prompt=True, tokenize=True)
    box["model"].expect(len(prompt), tok.encode(text, add_special_tokens=False))


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@pytest.mark.parametrize("text,content,calls", [
    (CALL, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("Let me look. " + CALL + "\n" + CALL.replace("get_weather", "now").replace(
        '{"city": "Paris", "unit": "celsius"}', "{}"), "Let me look. \n",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("now", {})]),
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
    ("<tool_call>not json</tool_call> sorry", "<tool_call>not json</tool_call> sorry", []),
])
def test_auto_reads_the_models_calls(scripted, text, content, calls):
    """auto: the calls the model wrote in its tokenizer's format (json_tools' `<tool_call>`), the text around them
    the content (null when blank), finish_reason "tool_calls" when it made any; a call that does not parse stays
    text. Streamed: the same content and calls."""
    c = scripted["client"]
    say(scripted, text)
    r = create(c, tools=TOOLS, seed=0, max_tokens=200)
    ch = r.choices[0]
    assert ch.message.content == content
    got = [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls or ()]
    assert got == calls
    assert ch.finish_reason == ("tool_calls" if calls else "stop")
    say(scripted, text)
    s_content, s_calls, finish = streamed(c, tools=TOOLS, seed=0, max_tokens=200)
    assert s_content == (content or "")
    assert [(x["name"], json.loads(x["arguments"])) for x in s_calls] == calls
    assert finish == ch.finish_reason
    say(scripted, text)
    r = create(c, tools=TOOLS, tool_choice="none", seed=0, max_tokens=200)
    assert r.choices[0].message.content == text and r.choices[0].message.tool_calls is None


def test_auto_with_a_call_cut_short_by_max_tokens(scripted):
    """A call the length limit cut is text: finish_reason "length", nothing parsed, nothing lost."""
    c = scripted["client"]
    tok = scripted["tok"]
    n = len(tok.encode(CALL, add_special_tokens=False))
    say(scripted, CALL)
    r = create(c, tools=TOOLS, seed=0, max_tokens=n - 3)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and ch.message.tool_calls is None
    assert CALL.startswith(ch.message.content) and ch.message.content.startswith("<tool_call>")


def test_calls_split_the_same_however_the_text_arrives():
    """samplec.tools.Calls over random cuts of a text (markers cut anywhere) gives what it gives the whole text."""
    from mlx_lm.tool_parsers import json_tools
    t = tools.parse({"tools": TOOLS})
    text = "a<tool" + CALL + " b <tool_call>{bad}</tool_call>" + CALL + "<tool_c"
    whole = tools.Calls(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call, t)
    want_content, want_calls = whole.finish_with(text)
    assert want_content == "a<tool b <tool_call>{bad}</tool_call><tool_c"
    assert [c["function"]["name"] for c in want_calls] == ["get_weather", "get_weather"]
    pick = random.Random(0)
    for _ in range(200):
        cuts = sorted(pick.sample(range(1, len(text)), pick.randint(1, 12)))
        parts = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        split = tools.Calls(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call, t)
        content, calls = "", []
        for p in parts:
            more, got = split.feed(p)
            content, calls = content + more, calls + got
        more, got = split.finish()
        assert content + more == want_content
        assert [c["function"] for c in calls + got] == [c["function"] for c in want_calls]
    one = tools.Calls(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call,
                      tools.parse({"tools": TOOLS, "parallel_tool_calls": False}))
    assert len(one.finish_with(CALL + CALL)[1]) == 1


def test_required_schema_is_vllms():
    s = tools.forced_schema(tools.parse({"tools": TOOLS, "tool_choice": "required"}))
    assert s["type"] == "array" and s["minItems"] == 1 and "maxItems" not in s
    assert [a["properties"]["name"]["enum"] for a in s["items"]["anyOf"]] == [["get_weather"], ["now"]]
    jsonschema.validate([{"name": "now", "parameters": {}}], s)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], s)
    s1 = tools.forced_schema(tools.parse({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}))
    assert s1["maxItems"] == 1


def test_auto_reads_calls_whose_markers_are_special_tokens():
    """A format whose markers are special tokens (skipped from text by default): under auto they are written into
    the text the parser reads, and the content around the calls has none of them."""
    from samplec.integrations.mlx_lm import local_tokenizer
    hf = local_tokenizer(510)._tokenizer
    hf.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    box = scripted_server(TEMPLATE, hf)
    assert box["tok"].tool_call_start_tokens == (510,) and 510 in hf.all_special_ids
    try:
        text = "Sure. " + CALL
        say(box, text)
        r = create(box["client"], tools=TOOLS, seed=0, max_tokens=200)
        m = r.choices[0].message
        assert m.content == "Sure. " and r.choices[0].finish_reason == "tool_calls"
        assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == \
            [("get_weather", {"city": "Paris", "unit": "celsius"})]
        say(box, text)      # (tool_choice none: special tokens write no text, as always)
        r = create(box["client"], tools=TOOLS, tool_choice="none", seed=0, max_tokens=200)
        assert r.choices[0].message.content == text.replace("<tool_call>", "").replace("</tool_call>", "")
    finally:
        stop(box)


def test_echo_after_an_assistant_message_of_calls_alone(server):
    """vLLM's chat echo continuing an assistant message that holds calls and no content: nothing to echo."""
    c = server["client"]
    msgs = MSG + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}]
    kw = dict(messages=msgs, tools=TOOLS, tool_choice="none", seed=5, max_tokens=6)
    alone = create(c, **kw, extra_body={"add_generation_prompt": False})
    r = create(c, **kw, extra_body={"add_generation_prompt": False, "echo": True})
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == alone.choices[0].message.content



@pytest.mark.parametrize("extra,param", [({"allowed_token_ids": [5]}, "allowed_token_ids"),
                                         ({"bad_words": ["["]}, "bad_words")])
def test_constraints_that_leave_no_token_are_a_400_naming_them(server, extra, param):
    """A forced call's grammar with allowed_token_ids or bad_words that leave none of its tokens: the request's
    fault, a 400 (an error event, streamed) naming the field that narrows the grammar -- not a server error."""
    c = server["client"]
    kw = dict(tools=TOOLS, tool_choice="required", max_tokens=20, seed=0, extra_body=extra)
    with pytest.raises(openai.BadRequestError) as e:
        create(c, **kw)
    assert e.value.body["param"] == param and "tool_choice" in e.value.body["message"]
    with pytest.raises(openai.APIError, match=f"{param} and tool_choice leave no token to draw"):
        for _ in create(c, stream=True, **kw):
            pass


def test_the_python_blocks_of_docs_serve_run(server):
    """Every ```python block of docs/serve.md runs as written against the demo server, with the names its prose
    leaves to the reader (the client, a context and continuation, a model, program, schema)."""
    import re
    from pathlib import Path

    import samplec
    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "serve.md").read_text().replace("http://127.0.0.1:8080/v1", str(server["client"].base_url))
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 5
    tok = server["app"].tokenizer
    model, _ = serve.demo_model()
    given = dict(client=server["client"], context_ids=tok.encode("The compiler"), continuation_ids=[300, 12],
                 tokenizer=tok, model=model, prompt_ids=tok.encode("A sampler chain"),
                 program=samplec.compile("sampler g(allowed: mask, seed: seed = 0, pos: int = 0) -> token { "
                                         "allow(allowed) temperature(0.8) sample(seed, position = pos) }"),
                 schema={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    for block in blocks:
        exec(compile(block, "docs/serve.md", "exec"), dict(given))
