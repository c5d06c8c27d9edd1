"""A reasoning model's thinking in `samplec serve`'s chat answers: what the model writes between its think markers
is the message's `reasoning` (and `reasoning_content`), the rest its content, as mlx-lm's server and vLLM's
reasoning parsers answer; a prompt that opened a think block starts the answer in it; tool calls are read from the
content only; streamed deltas put together are the whole answer; `include_reasoning: false` leaves it out. Shown
with the demo model scripted to write given text (tests/serve_util.py's `Scripted`) and a tokenizer whose
vocabulary has `<think>` and `</think>` (mlx-lm reads the markers off it)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

from serve_util import scripted_server, stop  # noqa: E402
from test_serve_tools import CALL, TOOLS  # noqa: E402

MSG = [{"role": "user", "content": "Why?"}]
# a ChatML template; `think` in the template's arguments opens the answer's think block (as DeepSeek-R1's does)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if think %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module", params=["plain", "special"])
def server(request):
    """Markers as ordinary added tokens (Qwen's) and as special tokens (skipped from text by default)."""
    from samplec.integrations.mlx_lm import local_tokenizer
    hf = local_tokenizer(510)._tokenizer
    if request.param == "special":
        hf.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    else:
        hf.add_tokens(["<think>", "</think>"])
    box = scripted_server(TEMPLATE, hf)
    assert box["tok"].has_thinking and box["tok"].think_start_tokens == (510,)
    yield box
    stop(box)


def ask(box, text: str, think: bool = False, stream: bool = False, **kw):
    tok = box["tok"]
    prompt = tok.apply_chat_template(MSG, add_generation_prompt=True, tokenize=True, think=think)
    box["model"].expect(len(prompt), tok.encode(text, add_special_tokens=False))
    args = dict(model="demo", messages=MSG, seed=0, max_tokens=200, stream=stream, **kw)
    if think:
        args["extra_body"] = {**args.get("extra_body", {}), "chat_template_kwargs": {"think": True}}
    return box["client"].chat.completions.create(**args)


def fields(m) -> tuple:
    extra = m.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or ()]
    return extra.get("reasoning"), m.content, calls


def joined(stream) -> tuple:
    thought, content, calls, finish = "", "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            extra = d.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            thought += extra.get("reasoning") or ""
            content += d.content or ""
            for tc in d.tool_calls or ():
                calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return thought or None, content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))], finish


@pytest.mark.parametrize("text,think,want", [
    ("<think>\nLet me see.\n</think>\n\nBecause.", False, ("\nLet me see.\n", "\n\nBecause.", [])),
    ("Let me see.\n</think>\n\nBecause.", True, ("Let me see.\n", "\n\nBecause.", [])),
    ("Because.", False, (None, "Because.", [])),
    ("Still thinking", True, ("Still thinking", "", [])),
    ("<think>Weather.</think>" + CALL, False, ("Weather.", None, [("get_weather", {"city": "Paris",
                                                                                   "unit": "celsius"})])),
])
def test_thinking_is_the_messages_reasoning(server, text, think, want):
    tools = {"tools": TOOLS} if want[2] else {}
    r = ask(server, text, think, **tools)
    assert fields(r.choices[0].message) == want
    assert r.choices[0].finish_reason == ("tool_calls" if want[2] else "stop")
    thought, content, calls, finish = joined(ask(server, text, think, stream=True, **tools))
    assert (thought, content or None, calls) == (want[0], want[1] or None, want[2])
    assert finish == r.choices[0].finish_reason


def test_include_reasoning_false_leaves_it_out(server):
    text = "<think>Hmm.</think>Because."
    r = ask(server, text, extra_body={"include_reasoning": False})
    assert fields(r.choices[0].message) == (None, "Because.", [])
    assert joined(ask(server, text, stream=True, extra_body={"include_reasoning": False}))[:2] == (None, "Because.")
    with pytest.raises(openai.BadRequestError) as e:
        ask(server, text, extra_body={"include_reasoning": "no"})
    assert e.value.body["param"] == "include_reasoning"


def test_completions_keep_the_text_as_written(server):
    """The completions endpoint answers text: the markers stay (special ones written as skip_special_tokens says)."""
    tok = server["tok"]
    prompt = "Why?"
    text = "<think>Hmm.</think>Because."
    server["model"].expect(len(tok.encode(prompt)), tok.encode(text, add_special_tokens=False))
    r = server["client"].completions.create(model="demo", prompt=prompt, seed=0, max_tokens=50)
    special = 510 in tok._tokenizer.all_special_ids
    assert r.choices[0].text == ("Hmm.Because." if special else text)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_after_an_opened_think_block_is_the_content(server, stream):
    """A grammar constrains the output from its first token (not after the thinking, as vLLM's reasoning-aware
    structured outputs): after a prompt that opened a think block, what it writes is the content, never the
    reasoning."""
    text = '{"a":1}'
    r = ask(server, text, think=True, stream=stream, response_format={"type": "json_object"})
    got = joined(r)[:2] if stream else fields(r.choices[0].message)[:2]
    assert got == (None, text)


@pytest.mark.parametrize("text,think,want", [
    ("<think>Hmm, rain.</think>Because.", False, ("Hmm, rain.", "Because.")),
    ("Cut short while thinking", True, ("Cut short while thinking", "")),
    ("Because.", False, (None, "Because.")),
])
@pytest.mark.parametrize("logprobs", [False, True])
def test_responses_answer_thinking_as_a_reasoning_item(server, text, think, want, logprobs):
    """The Responses API: the thinking is a reasoning item (its content one reasoning_text) before the message;
    streamed, its reasoning_text deltas put together are the same, and the stream helper's final response the
    non-streamed one's output. With logprobs, every token's entry is the message's, streamed (the message opened
    only once the thinking is done) or not."""
    tok, c = server["tok"], server["client"]

    def respond(stream=False):
        prompt = tok.apply_chat_template(MSG, add_generation_prompt=True, tokenize=True, think=think)
        server["model"].expect(len(prompt), tok.encode(text, add_special_tokens=False))
        extra = {"seed": 0, **({"chat_template_kwargs": {"think": True}} if think else {})}
        return c.responses.create(model="demo", input=MSG[0]["content"], max_output_tokens=200, stream=stream,
                                  extra_body=extra, include=["message.output_text.logprobs"] if logprobs else None)
    r = respond()
    kinds = [o.type for o in r.output]
    if want[0] is None:
        assert kinds == ["message"]
    else:
        assert kinds == ["reasoning", "message"] and r.output[0].summary == []
        assert [(p.type, p.text) for p in r.output[0].content] == [("reasoning_text", want[0])]
    assert r.output_text == want[1] and r.status == "completed"
    thought, said, types = "", "", []
    for e in respond(stream=True):
        types.append(e.type)
        thought += e.delta if e.type == "response.reasoning_text.delta" else ""
        said += e.delta if e.type == "response.output_text.delta" else ""
        if e.type == "response.completed":
            final = e.response
    assert (thought or None, said) == want
    assert [o.type for o in final.output] == kinds and final.output_text == r.output_text
    if want[0] is not None:
        assert types.index("response.reasoning_text.done") < types.index("response.output_item.done") < \
            types.index("response.content_part.added", types.index("response.output_item.done"))
    if logprobs:
        entries = r.output[-1].content[0].logprobs
        assert len(entries) == r.usage.output_tokens - 1        # (every token's but the end-of-sequence)
        assert [e.token for e in final.output[-1].content[0].logprobs] == [e.token for e in entries]
