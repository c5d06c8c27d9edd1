"""`samplec serve` in a test: started on a loopback port in a thread (`start`, `stop`), on the demo model or on a
model and tokenizer of the test's -- `Scripted`, the demo model pushed to write a given text, with a tokenizer
whose chat template and tool parser the test chooses (`scripted_server`)."""
from __future__ import annotations

import threading

import mlx.core as mx
import openai

from samplec import serve


def start(argv=(), model=None, tokenizer=None, samplers=()) -> dict:
    """A server (`serve.serve` with `argv` and the chains `samplers` -- `--sampler` values --, the demo model's
    place taken by `model` and `tokenizer` where given):
    {"httpd", "app", "client" (the openai client), "thread", "url"}."""
    box, ready = {}, threading.Event()

    def on_ready(httpd, app):
        box.update(httpd=httpd, app=app)
        ready.set()
    saved = serve.demo_model
    if model is not None:
        serve.demo_model = lambda: (model, tokenizer)
    try:
        t = threading.Thread(target=serve.serve, args=(["--host", "127.0.0.1", "--port", "0", *argv], list(samplers),
                                                       True, on_ready), daemon=True)
        t.start()
        assert ready.wait(120), "the server did not start"
    finally:
        serve.demo_model = saved
    host, port = box["httpd"].server_address[:2]
    box["url"] = f"http://{host}:{port}/v1"
    box["client"] = openai.OpenAI(base_url=box["url"], api_key="none", max_retries=0, timeout=120)
    box["thread"] = t
    return box


def stop(box: dict) -> None:
    box["httpd"].shutdown()
    box["thread"].join(60)


class Scripted:
    """The demo model with its logits pushed toward a script: after the prompt, the script's tokens, then
    end-of-sequence (whatever the sampler's values: the push is 10^4). `expect(prompt_length, script)` before
    each request."""

    def __init__(self, model, eos: int):
        self.model, self.eos, self.prompt, self.script, self.seen = model, eos, 0, [], []

    def expect(self, prompt: int, script: list[int]):
        self.prompt, self.script, self.seen = prompt, script, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs, cache=None, **kw):
        logits = self.model(inputs, cache=cache, **kw)
        self.seen += inputs[0].tolist()
        step = len(self.seen) - self.prompt
        if step < 0:
            return logits
        t = self.script[step] if step < len(self.script) else self.eos
        push = mx.zeros((logits.shape[-1],)).at[t].add(1e4)
        return logits + push


def scripted_server(template: str, hf=None) -> dict:
    """A server on the demo model scripted (`box["model"].expect(...)`), its tokenizer (`hf`: a Hugging Face
    tokenizer of 512 ids, else the demo's) given `template` and mlx-lm's json_tools tool parser."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_lm.tool_parsers import json_tools

    model, tok = serve.demo_model()
    hf = hf if hf is not None else tok._tokenizer
    hf.chat_template = template
    tok = TokenizerWrapper(hf, tool_parser=json_tools.parse_tool_call, tool_call_start=json_tools.tool_call_start,
                           tool_call_end=json_tools.tool_call_end)
    s = Scripted(model, tok.eos_token_id)
    box = start(model=s, tokenizer=tok)
    box.update(model=s, tok=tok)
    return box
