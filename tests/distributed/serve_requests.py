"""The requests the sharded-server test sends (tests/distributed/worker_serve.py) and the plain server answers in
one process (tests/test_distributed_serve.py): seeded chat and completions, logprobs, n, stop, logit_bias on ids
of both ranks' slices, penalties, xtc, greedy, several prompts echoed, streaming and a structured request."""
from __future__ import annotations

MSG = [{"role": "user", "content": "Count the tokens"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

# name -> (endpoint, arguments of the openai client's create)
REQUESTS = {
    "sampled": ("chat", dict(messages=MSG, max_tokens=14, temperature=1.0, top_p=0.9, seed=11, logprobs=True,
                             top_logprobs=3)),
    "penalties": ("chat", dict(messages=MSG, max_tokens=14, temperature=0.8, seed=2, frequency_penalty=0.6,
                               presence_penalty=0.4, logit_bias={"7": -100, "300": 4, "40": 3},
                               extra_body={"repetition_penalty": 1.3, "repetition_context_size": 8})),
    "greedy": ("chat", dict(messages=MSG, max_tokens=10, temperature=0.0, logprobs=True, top_logprobs=2)),
    "hot": ("chat", dict(messages=MSG, max_tokens=14, temperature=1.4, seed=5,
                         extra_body={"top_k": 50, "min_p": 0.01, "xtc_probability": 0.7, "xtc_threshold": 0.05})),
    "completion_n": ("completion", dict(prompt="A sampler chain", max_tokens=10, temperature=0.9, seed=4, n=2,
                                        logprobs=2)),
    "stop": ("completion", dict(prompt="The compiler reads", max_tokens=16, temperature=1.0, seed=6, stop=["a"])),
    "prompts_echo": ("completion", dict(prompt=["A sampler chain", [5, 6, 7]], n=2, max_tokens=8, temperature=1.0,
                                        seed=3, echo=True)),
    "structured": ("chat", dict(messages=MSG, max_tokens=16, temperature=1.0, seed=6,
                                response_format={"type": "json_schema",
                                                 "json_schema": {"name": "n", "schema": SCHEMA}})),
    "tools": ("chat", dict(messages=MSG, max_tokens=40, temperature=1.0, seed=8, tool_choice="required",
                           tools=[{"type": "function", "function": {"name": "count", "parameters": SCHEMA}}])),
    "responses": ("responses", dict(instructions="Be brief.", input="Count the tokens", max_output_tokens=12,
                                    temperature=1.0, extra_body={"seed": 9})),
}
STREAMED = ("sampled", "completion_n")      # sent again with stream: true
# sent again all at once (one batch)
CONCURRENT = ("sampled", "penalties", "hot", "completion_n", "greedy", "prompts_echo")


def send(client, name: str, stream: bool = False) -> dict:
    """The response as a dict; a streamed one as {"texts": [...], "usage": ...}."""
    kind, kw = REQUESTS[name]
    create = {"chat": client.chat.completions.create, "completion": client.completions.create,
              "responses": client.responses.create}[kind]
    if not stream:
        return create(model="demo", **kw).model_dump()
    texts: dict[int, str] = {}
    usage = None
    for chunk in create(model="demo", stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            piece = (c.delta.content if kind == "chat" else c.text) or ""
            texts[c.index] = texts.get(c.index, "") + piece
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    return {"texts": [texts[i] for i in sorted(texts)], "usage": usage}


def text_of(response: dict) -> list[str]:
    """Each choice's text (non-streamed response): a chat message's content and its calls' names and arguments; a
    Response's output text."""
    if response.get("object") == "response":
        return ["".join(p["text"] for o in response["output"] if o["type"] == "message" for p in o["content"])]
    return [(c["message"]["content"] or "") + "".join(t["function"]["name"] + t["function"]["arguments"]
                                                    for t in c["message"].get("tool_calls") or ())
            if "message" in c else c["text"] for c in response["choices"]]


def finishes_of(response: dict) -> list:
    """Each choice's finish reason (a Response's status)."""
    if response.get("object") == "response":
        return [response["status"]]
    return [c["finish_reason"] for c in response["choices"]]
