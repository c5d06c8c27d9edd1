"""`samplec serve`'s chat options: --chat-template (a template, or a file holding one), --chat-template-args (the
template's arguments, under each request's chat_template_kwargs, as mlx-lm's server) and --tool-call-parser (one
of mlx-lm's tool parsers for tool_choice auto); each bad value a clear error before anything is served."""
from __future__ import annotations

import pytest

pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai")

from samplec import serve  # noqa: E402
from samplec.diagnostics import SamplecError  # noqa: E402
from serve_util import start, stop  # noqa: E402

TEMPLATE = ("{% if tools %}[tools: {{ tools | length }}]{% endif %}{% for m in messages %}<{{ m.role }}>"
            "{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% if think %}<think>{% endif %}"
            "{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("t") / "template.jinja"
    path.write_text(TEMPLATE)
    box = start(["--chat-template", str(path), "--chat-template-args", '{"think": true}',
                 "--tool-call-parser", "json_tools"])
    yield box
    stop(box)


def test_the_template_and_its_arguments_make_the_prompt(server):
    tok, c = server["app"].tokenizer, server["client"]

    def prompt_tokens(**kw):
        return c.chat.completions.create(model="demo", messages=MSG, max_tokens=1, seed=0, **kw).usage.prompt_tokens
    assert prompt_tokens() == len(tok.encode("<user>hi\n<assistant><think>"))
    # (a request's chat_template_kwargs win over --chat-template-args)
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"think": False}}) == \
        len(tok.encode("<user>hi\n<assistant>"))
    # (the tools reach the template; auto is served: the tool parser was given)
    r = c.chat.completions.create(model="demo", messages=MSG, max_tokens=3, seed=0, tools=TOOLS)
    assert r.usage.prompt_tokens == len(tok.encode("[tools: 1]<user>hi\n<assistant><think>"))
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"


def test_the_template_given_as_text(tmp_path):
    box = start(["--chat-template", "{% for m in messages %}{{ m.content }}|{% endfor %}"])
    try:
        tok = box["app"].tokenizer
        r = box["client"].chat.completions.create(model="demo", messages=MSG * 2, max_tokens=1, seed=0)
        assert r.usage.prompt_tokens == len(tok.encode("hi|hi|"))
        with pytest.raises(openai.BadRequestError) as e:     # (no tool parser: auto is a 400)
            box["client"].chat.completions.create(model="demo", messages=MSG, max_tokens=1, tools=TOOLS)
        assert e.value.body["param"] == "tool_choice"
    finally:
        stop(box)


@pytest.mark.parametrize("argv,message", [
    (["--chat-template-args", "{think"], "--chat-template-args: not JSON"),
    (["--chat-template-args", "[1]"], "a JSON object"),
    (["--chat-template-args", '{"messages": []}'], "messages is set by the server"),
    (["--tool-call-parser", "hermes9"], "no such tool parser (it has: "),
    (["--chat-template", "  "], "the template is empty"),
])
def test_bad_options_are_clear_errors(argv, message):
    with pytest.raises(SamplecError, match=message.replace("(", r"\(").replace("[", r"\[")):
        serve.serve(["--host", "127.0.0.1", "--port", "0", *argv], [], True, lambda *a: None)


def test_reasoning_effort_reaches_the_template(server):
    """Chat's reasoning_effort and the Responses API's reasoning.effort are the template's `reasoning_effort` (as
    vLLM passes it: a template that reads it decides what it means); chat_template_kwargs' own wins."""
    tok, c, app = server["app"].tokenizer, server["client"], server["app"]
    app.tokenizer._tokenizer.chat_template = "{{ reasoning_effort or 'unset' }}|" + TEMPLATE
    try:
        def prompt_tokens(**kw):
            return c.chat.completions.create(model="demo", messages=MSG, max_tokens=1, seed=0,
                                             **kw).usage.prompt_tokens
        base = "<user>hi\n<assistant><think>"
        assert prompt_tokens() == len(tok.encode("unset|" + base))
        assert prompt_tokens(reasoning_effort="low") == len(tok.encode("low|" + base))
        assert prompt_tokens(reasoning_effort="low", extra_body={"chat_template_kwargs": {
            "reasoning_effort": "high"}}) == len(tok.encode("high|" + base))
        r = c.responses.create(model="demo", input="hi", max_output_tokens=1, reasoning={"effort": "medium"},
                               extra_body={"seed": 0})
        assert r.usage.input_tokens == len(tok.encode("medium|" + base)) and r.reasoning.effort == "medium"
        with pytest.raises(openai.BadRequestError) as e:
            prompt_tokens(reasoning_effort="extreme")
        assert e.value.body["param"] == "reasoning_effort"
    finally:
        app.tokenizer._tokenizer.chat_template = TEMPLATE


def test_a_chains_own_parameters_are_request_fields(tmp_path):
    """A served chain's own scalar parameters (llama.cpp's typical_p, top_n_sigma, repeat_penalty, penalty_last_n
    here) are request fields of their names: a request's values give the tokens the same chain gives with those
    values as its defaults; each is checked by the parameter's own range; another chain's is a 400."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    source = (root / "examples" / "llama_cpp_default.smp").read_text()
    own = {"typical_p": 0.5, "top_n_sigma": 1.5, "repeat_penalty": 1.3, "penalty_last_n": 8}
    fixed = source
    for name, value in own.items():
        before = fixed
        fixed = __import__("re").sub(rf"({name}: (?:float|int) = )[-0-9.]+", rf"\g<1>{value}", fixed, count=1)
        assert fixed != before, name
    (tmp_path / "fixed.smp").write_text(fixed)
    a = start(samplers=[str(root / "examples" / "llama_cpp_default.smp") + ":llama_cpp_default",
                        str(root / "examples" / "llama.smp") + ":nucleus"])
    b = start(samplers=[str(tmp_path / "fixed.smp") + ":llama_cpp_default"])
    try:
        def text(box, **kw):
            r = box["client"].chat.completions.create(model="demo", messages=MSG, max_tokens=24, seed=3,
                                                      temperature=1.0, **kw)
            return r.choices[0].message.content
        given = text(a, extra_body=own)
        assert given == text(b)
        assert given != text(a)         # (the values matter: the chain's defaults give other tokens)
        for bad, param in (({"typical_p": -0.5}, "typical_p"), ({"penalty_last_n": 2.5}, "penalty_last_n"),
                           ({"typical_p": "x"}, "typical_p"),
                           ({"samplec_sampler": "nucleus", "typical_p": 0.5}, "typical_p")):
            with pytest.raises(openai.BadRequestError) as e:
                text(a, extra_body=bad)
            assert e.value.body["param"] == param, (bad, e.value.body)
    finally:
        stop(a)
        stop(b)


def test_a_required_parameter_of_the_chains_own_is_required_of_each_request(tmp_path):
    (tmp_path / "own.smp").write_text("sampler c(seed: seed, t: float) -> token { temperature(t) sample(seed) }\n")
    box = start(samplers=[str(tmp_path / "own.smp")])
    try:
        c = box["client"]
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="demo", messages=MSG, max_tokens=2)
        assert e.value.body["param"] == "t" and "required by the chain 'c'" in e.value.body["message"]
        assert c.chat.completions.create(model="demo", messages=MSG, max_tokens=2, extra_body={"t": 0.5}).usage
    finally:
        stop(box)
