"""`samplec serve`: an OpenAI-compatible server (`/v1/chat/completions`, `/v1/completions`, `/v1/models`) that
samples with samplec (docs/serve.md).

Layers, each owned here except the model:
- HTTP: the standard library's ThreadingHTTPServer, one thread per connection; bodies are checked field by field
  (`parse_request`): every OpenAI field is honoured or answered 400 naming it.
- Generation: mlx-lm's public API -- `mlx_lm.load` (model and tokenizer) and `mlx_lm.generate.BatchGenerator`
  (continuous batching, prefill, KV caches) -- driven by one engine thread (`Engine`).
- Sampling: every row of the batch shares one `BatchSampler`, which runs one compiled program call per chain per
  step over the rows its logits processors (`Row.process`) recorded: one value per row for temperature, top_p,
  top_k, min_p, the penalties, the seed, the position (the count of tokens the row has generated) and the allowed
  tokens (a packed bitmask: all ones, or the row's grammar's mask). A row's token depends only on its own logits,
  values, seed, position and mask (spec section 4), so a request gives the same tokens alone or in any batch.
- Text: token bytes (the grammar engine's tokenizer view), UTF-8 decoded incrementally; stop strings are found in
  the text (also across tokens), the text ends just before the one that came (of several within one token, the
  first in the request's list, as vLLM's).
- With `--draft-model`, requests without a grammar are decoded speculatively, each with its own target and draft
  KV caches (`Speculation`, `Engine._speculate`): the draft proposes with the row's chain at the row's seed,
  positions and history, the chain runs once over the target's verified positions (`BatchSampler.draw`, the call
  the batch makes), so the tokens are the ones the batch gives without a draft.
- Under `mlx.launch` the LM head is split over the ranks (`samplec.distributed.shard_lm_head`): rank 0 serves HTTP
  and broadcasts each step's plan (`Engine._plan`), every rank runs the same batch and samples its logits slice
  through `samplec.distributed.shard`, and every rank gets the same tokens.
"""
from __future__ import annotations

import codecs
import json
import logging
import math
import os
import queue
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import mlx.core as mx
import numpy as np

from samplec.decode import GENERATED, step_seeds
from samplec.diagnostics import SamplecError
from samplec import reasoning, responses, tools
from samplec.program import Program
from samplec.reply import Reply
from samplec.tools import ToolError, template_message

SERVER_CHAIN = """
sampler mlx_lm_server(h: tokens, generated: tokens, seed: seed, pos: int, allowed: mask,
                      temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                      repetition_penalty: float = 1.0, repetition_context_size: int = 20,
                      presence_penalty: float = 0.0, presence_context_size: int = -1,
                      frequency_penalty: float = 0.0, frequency_context_size: int = -1,
                      xtc_probability: float = 0.0,
                      xtc_threshold: float = 0.1) -> token, logprob, raw_logprob, top_logprobs(TOP) {
    allow(allowed)
    penalties(h, last_n = repetition_context_size, repeat = repetition_penalty)
    penalties(generated, last_n = presence_context_size, presence = presence_penalty)
    penalties(generated, last_n = frequency_context_size, frequency = frequency_penalty)
    top_p(top_p)
    min_p(min_p)
    xtc(xtc_threshold, xtc_probability, seed, position = pos)
    top_k(top_k)
    temperature(temperature)
    sample(seed, position = pos)
}
"""
TOP = 20                    # the most top_logprobs a request may ask for (OpenAI's limit)
# (`tokens` parameters named in GENERATED get the tokens the choice has generated so far -- OpenAI's "sampled so far":
# what its presence and frequency penalties count; any other `tokens` parameter gets the prompt and the generated
# tokens, as in samplec's decode loops)
TOP_P_GREEDY = 1.1754944e-38    # top_p 0 (OpenAI: the most likely token alone) as the chain's smallest positive p
F32_MAX = 3.4028234663852886e38
MAX_N = 16                  # the most choices one request may ask for per prompt
MAX_PROMPTS = 64            # the most prompts one /v1/completions request may hold
MAX_CHOICES = 256           # the most choices (prompts x n) of one request
MAX_STOP = 16               # the most stop strings
MAX_STOP_IDS = 256          # the most stop_token_ids
MAX_BAD_WORDS = 128         # the most token sequences bad_words may become (vLLM's VLLM_MAX_NUM_BAD_WORDS default)
MAX_BAD_WORD_TOKENS = 1024  # the most tokens in them all (vLLM's VLLM_MAX_BAD_WORDS_TOTAL_TOKENS default)
MAX_TOKENS = 1 << 20
MAX_BODY = 16 << 20
MAX_DRAFT = 64              # the most tokens --num-draft may propose a round

# request field -> how its value becomes the chain's (mlx-lm's off conventions; a context size of 0 is every token)
_WINDOW = lambda v: -1 if int(v) == 0 or int(v) >= 2**31 else int(v)      # noqa: E731  (past int32: every token)
FIELDS = {
    "temperature": lambda v: float(v),
    # (a top_p below float32's smallest normal number keeps the most likely token alone, as 0 does)
    "top_p": lambda v: 1.0 if v >= 1 else max(float(v), TOP_P_GREEDY),
    "top_k": lambda v: max(0, int(v)),      # (-1 and 0: off, as vLLM takes them)
    "min_p": lambda v: float(v),
    "repetition_penalty": lambda v: float(v) if v > 0 else 1.0,
    "repetition_context_size": _WINDOW,
    "presence_penalty": lambda v: float(v),
    "presence_context_size": _WINDOW,
    "frequency_penalty": lambda v: float(v),
    "frequency_context_size": _WINDOW,
    "xtc_probability": lambda v: float(v),
    "xtc_threshold": lambda v: float(v),
}
DEFAULTS = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=0.0,
                repetition_context_size=20, presence_penalty=0.0, presence_context_size=0, frequency_penalty=0.0,
                frequency_context_size=0, xtc_probability=0.0, xtc_threshold=0.1)
WINDOWS = ("repetition_context_size", "presence_context_size", "frequency_context_size")


class BadRequest(Exception):
    """A request answered 400 (or `status`), naming the field (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


# ---------------------------------------------------------------------------------------------------------------
# requests

@dataclass
class Request:
    kind: str                          # "chat" or "completion"
    prompts: list[list[int]]           # one (chat, and most completions), or several (completions: a list of them)
    n: int = 1                         # choices per prompt
    max_tokens: int = 16
    limits: list[int] = field(default_factory=list)     # per prompt: its max_tokens (a default one: the room it leaves)
    values: dict = field(default_factory=dict)
    seed: int | None = None
    bias: dict = field(default_factory=dict)
    allowed: np.ndarray | None = None  # (vLLM's allowed_token_ids) the tokens a choice may draw: a packed bitmask
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)     # (vLLM's: token ids that end a choice too)
    bad_words: list[tuple[int, ...]] = field(default_factory=list)  # (vLLM's: token sequences never completed)
    min_tokens: int = 0                # (vLLM's: no end-of-sequence or stop token before this many)
    ignore_eos: bool = False           # (vLLM's: end-of-sequence does not end a choice; stop_token_ids still do)
    include_stop: bool = False         # (vLLM's include_stop_str_in_output: the stop string / stop token's text kept)
    skip_special: bool = True          # (vLLM's skip_special_tokens: special tokens write no text)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False     # (vLLM's continuous_usage_stats: every chunk carries its choice's usage)
    logprobs: bool = False
    top_logprobs: int = 0
    token_ids: bool = False            # (vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N")
    chain: str | None = None
    grammar: object = None             # a samplec.structured.Grammar
    model: str = ""
    role: str = "assistant"            # (chat) the answer's role: the last message's without a generation prompt
    echo: bool = False                 # (completions) each choice's text and logprobs begin with its prompt's
    tools: object = None               # (chat) a samplec.tools.Tools: the request's tools and tool_choice
    echo_message: str = ""             # (chat, vLLM's echo) the last message's content, which each answer begins with
    include_reasoning: bool = True     # (chat, vLLM's) the model's thinking returned as the message's reasoning
    prompt_logprobs: int | None = None  # (vLLM's) each prompt token's log-probability and the top n there
    prompt_texts: list = field(default_factory=list)    # per prompt: the string given, or None (token ids)
    body: dict | None = None           # the request as received (what rank 0 sends the other ranks)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def seeds(self) -> list[int]:
        """Choice i of each prompt samples with seed (seed + i) mod 2**64 (so a prompt gives, among several, what
        it gives alone); without a seed, each choice draws one from the OS."""
        if self.seed is None:
            return [int.from_bytes(os.urandom(8), "little") for _ in range(self.choices)]
        return [(self.seed + i) % 2**64 for _ in self.prompts for i in range(self.n)]


# fields each endpoint accepts; the values are what is checked
CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
             "parallel_tool_calls", "functions", "function_call", "audio", "modalities", "prediction",
             "reasoning_effort", "verbosity", "web_search_options", "store", "chat_template_kwargs",
             "add_generation_prompt", "continue_final_message", "include_reasoning"}
COMPLETION_ONLY = {"prompt", "best_of", "suffix"}
COMMON = {"model", "max_tokens", "n", "seed", "stop", "stream", "stream_options", "logprobs", "logit_bias",
          "temperature", "top_p", "presence_penalty", "frequency_penalty", "user", "metadata", "service_tier",
          "safety_identifier", "prompt_cache_key", "samplec_sampler", "grammar", "response_format",
          "stop_token_ids", "min_tokens", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
          "allowed_token_ids", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "guided_decoding_backend", "structured_outputs", "truncate_prompt_tokens", "return_tokens_as_token_ids",
          "echo", "bad_words", "prompt_logprobs", "spaces_between_special_tokens", *FIELDS}
EFFORTS = ("none", "minimal", "low", "medium", "high")     # OpenAI's reasoning_effort values
INFORMATIONAL = {"user", "metadata", "safety_identifier", "prompt_cache_key"}   # accepted; they change no token
# vLLM's structured-output fields (its older guided_* ones and the keys of its structured_outputs object) -> the
# grammar kind each becomes (`Parser._grammar`); guided_grammar and structured_outputs.grammar are Lark or GBNF text,
# which llguidance tells apart (the gbnf kind converts GBNF to Lark and takes Lark as it is, as vLLM's llguidance
# backend reads them)
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "gbnf"}
STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "gbnf",
              "json_object": "json_object"}
STRUCTURED_OPTIONS = {"disable_any_whitespace", "disable_fallback"}   # accepted: JSON is compact, nothing falls back
GUIDED_BACKENDS = ("auto", "guidance")     # the guided_decoding_backend names that are this server's (llguidance)
# vLLM's request fields this server does not take (answered 400 naming the field, saying whose it is)
VLLM_ONLY = {"truncation_side", "return_token_ids", "use_beam_search",
             "length_penalty", "add_special_tokens", "guided_whitespace_pattern", "logprob_token_ids", "documents",
             "chat_template", "mm_processor_kwargs", "media_io_kwargs", "priority", "cache_salt",
             "kv_transfer_params", "vllm_xargs", "thinking_token_budget", "repetition_detection",
             "prompt_embeds", "watermarking", "stream_interval"}


def _number(body: dict, name: str, lo=None, hi=None, integer=False, default=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or integer and not (
            isinstance(v, int) or float(v).is_integer()):
        raise BadRequest(f"{name} must be {'an integer' if integer else 'a number'}, got {json.dumps(v)}", name)
    if isinstance(v, float) and not math.isfinite(v):     # (an int is finite, however large: math.isfinite
        raise BadRequest(f"{name} must be a finite number", name)   # would overflow converting it)
    if lo is not None and v < lo or hi is not None and v > hi:
        rng = f"[{lo}, {hi}]" if lo is not None and hi is not None else (f">= {lo}" if lo is not None
                                                                          else f"<= {hi}")
        shown = str(v) if len(str(v)) <= 40 else f"{str(v)[:12]}... ({len(str(v))} digits)"
        raise BadRequest(f"{name} must be {rng}, got {shown}", name)
    return int(v) if integer else v


class Parser:
    """Checks a request body and turns it into a `Request` (BadRequest names the field)."""

    def __init__(self, tokenizer, vocab: int, programs: dict[str, Program], model_id: str, grammars=None,
                 grammars_off: str = "no grammar engine"):
        self.tokenizer, self.vocab, self.programs, self.model_id = tokenizer, vocab, programs, model_id
        self.grammars = grammars              # a samplec.structured.Tokenizer, or None (no engine / no tokenizer)
        self.grammars_off = grammars_off      # why there is none
        self.sharded = False                  # the model's LM head is split over ranks (logits slices)
        self.context: int | None = None       # the model's context length, where known
        self.speculative = False              # the server decodes with a draft model
        self.template_args: dict = {}         # --chat-template-args: the template's arguments by default
        # each chain's own scalar parameters that no OpenAI or vLLM field names (a llama.cpp chain's typical_p,
        # mirostat_tau, dry_multiplier, ...): a request sets them by name, as the chain's values for its rows
        self.own = {name: own_params(prog) for name, prog in programs.items() if prog is not None}
        self.chain_fields = set().union(*self.own.values()) if self.own else set()

    def __call__(self, kind: str, body) -> Request:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        allowed = COMMON | (CHAT_ONLY if kind == "chat" else COMPLETION_ONLY) | self.chain_fields
        for name in body:
            if name not in allowed:
                other = "/v1/completions" if name in COMPLETION_ONLY else "/v1/chat/completions"
                hint = f" (a field of {other})" if name in CHAT_ONLY | COMPLETION_ONLY else \
                    " (a field of vLLM's that samplec serve does not support)" if name in VLLM_ONLY else ""
                raise BadRequest(f"unrecognized request argument supplied: {name}{hint}", name)
        req = Request(kind=kind, prompts=[])
        self._served(body)
        req.model = self.model_id
        self._refusals(kind, body)
        if kind == "chat":
            req.tools = self._tools(body)
            req.include_reasoning = body.get("include_reasoning") is None or self._bool(body, "include_reasoning")
        flags = self._template_flags(body) if kind == "chat" else None
        req.prompts, req.prompt_texts = self._truncated(body, *self._prompts(kind, body, req.tools, flags))
        if kind == "chat" and not flags[1]["add_generation_prompt"]:
            req.role = body["messages"][-1]["role"]     # (as vLLM's: the message the prompt leaves open)
        req.n = _number(body, "n", 1, MAX_N, integer=True, default=1)
        if req.choices > MAX_CHOICES:
            raise BadRequest(f"n: {len(req.prompts)} prompts of {req.n} choices each make {req.choices} choices; "
                             f"the limit is {MAX_CHOICES}", "n")
        echo = self._bool(body, "echo")
        req.echo = kind == "completion" and echo
        if kind == "chat" and echo:
            # (vLLM's chat echo: the answer begins with the last message when it is of the answer's role)
            last = body["messages"][-1]
            if last["role"] == req.role:
                c = last.get("content")
                req.echo_message = c if isinstance(c, str) else \
                    "".join(part["text"] for part in c) if isinstance(c, list) else ""     # (calls alone: none)
        mt, mct = body.get("max_tokens"), body.get("max_completion_tokens")
        if mt is not None and mct is not None and mt != mct:
            raise BadRequest("max_tokens and max_completion_tokens differ: give one", "max_completion_tokens")
        name = "max_completion_tokens" if mct is not None else "max_tokens"
        # (max_tokens 0: the prompt alone, scored -- only with echo, as OpenAI's and vLLM's)
        if body.get(name) == 0 and not req.echo:
            raise BadRequest(f"{name} must be >= 1 (0 only with echo: the prompt alone), got 0", name)
        req.max_tokens = _number(body, name, 0 if req.echo else 1, MAX_TOKENS, integer=True,
                                 default=16 if kind == "completion" else 512)
        req.limits = [req.max_tokens] * len(req.prompts)
        if self.context is not None:
            # (OpenAI's and vLLM's rule: the prompt and the completion within the context; a default max_tokens
            # shrinks to the room each prompt leaves, one given is the request's and past the room a 400)
            for i, prompt in enumerate(req.prompts):
                size = len(prompt)
                where = "messages" if kind == "chat" else "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
                room = self.context - size
                if room < (1 if req.max_tokens else 0):
                    raise BadRequest(f"This model's maximum context length is {self.context} tokens. However, "
                                     f"your {where} hold {size} tokens, which leaves no room for a completion.",
                                     where.split("[")[0])
                if body.get(name) is None:
                    req.limits[i] = min(req.max_tokens, room)
                elif req.max_tokens > room:
                    raise BadRequest(f"This model's maximum context length is {self.context} tokens. However, you "
                                     f"requested {size + req.max_tokens} tokens ({size} in the "
                                     f"{where}, {req.max_tokens} in the completion). Please reduce the length of "
                                     f"the {where} or completion.", name)
        # (OpenAI's seed is any integer: a negative one is taken modulo 2^64, as its two's complement)
        seed = _number(body, "seed", -2**63, 2**64 - 1, integer=True)
        req.seed = None if seed is None else seed % 2**64
        req.stream = self._bool(body, "stream")
        so = body.get("stream_options")
        if so is not None:
            if not isinstance(so, dict) or set(so) - {"include_usage", "include_obfuscation",
                                                      "continuous_usage_stats"}:
                raise BadRequest("stream_options: only {\"include_usage\": bool, \"continuous_usage_stats\": bool} "
                                 "is supported", "stream_options")
            if not req.stream:
                raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
            req.include_usage = self._bool(so, "include_usage", "stream_options.include_usage")
            continuous = self._bool(so, "continuous_usage_stats", "stream_options.continuous_usage_stats")
            # (vLLM's: usage on every chunk too; its include_usage defaults to true then -- false turns both off)
            req.include_usage = req.include_usage or continuous and so.get("include_usage") is None
            req.continuous_usage = req.include_usage and continuous
        req.prompt_logprobs = self._prompt_logprobs(body, req.stream)
        req.stop = self._stop(body)
        ids = body.get("stop_token_ids")
        if ids is not None:
            if not isinstance(ids, list) or len(ids) > MAX_STOP_IDS or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab for t in ids):
                raise BadRequest(f"stop_token_ids must be a list of at most {MAX_STOP_IDS} token ids in "
                                 f"[0, {self.vocab})", "stop_token_ids")
            req.stop_token_ids = sorted(set(ids))
        req.min_tokens = _number(body, "min_tokens", 0, req.max_tokens, integer=True, default=0)
        for i, limit in enumerate(req.limits):
            # (vLLM's rule: min_tokens within the effective max_tokens -- a default one shrunk to a prompt's room)
            if req.min_tokens > limit:
                where = "messages" if kind == "chat" else "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
                raise BadRequest(f"min_tokens must be <= max_tokens, got {req.min_tokens}: the {where} leaves room "
                                 f"for {limit} tokens in the model's context length of {self.context}, so a "
                                 "default max_tokens is at most that", "min_tokens")
        req.ignore_eos = self._bool(body, "ignore_eos")
        req.include_stop = self._bool(body, "include_stop_str_in_output")
        req.skip_special = body.get("skip_special_tokens") is None or self._bool(body, "skip_special_tokens")
        # (accepted: a choice's text is its tokens' own bytes, which put no space between special tokens either way
        # -- what vLLM's detokenizer for fast tokenizers gives, docs/serve.md)
        self._bool(body, "spaces_between_special_tokens")
        if req.min_tokens and self.speculative:
            # (a round of proposals shares one bias: positions past min_tokens would stay held)
            raise BadRequest("min_tokens: not supported by a server with a draft model", "min_tokens")
        self._logprobs(kind, body, req)
        req.token_ids = self._bool(body, "return_tokens_as_token_ids")
        self._values(body, req)
        req.bias = self._bias(body)
        req.bad_words = self._bad_words(body)
        chain = body.get("samplec_sampler")
        if chain is not None and not isinstance(chain, str):
            raise BadRequest(f"samplec_sampler must be a string (a chain's name), got {json.dumps(chain)[:100]}",
                             "samplec_sampler")
        if chain is not None and chain not in self.programs:
            raise BadRequest(f"samplec_sampler: no chain named {chain!r} (this server has: "
                             f"{', '.join(self.programs)})", "samplec_sampler")
        req.chain = chain or next(iter(self.programs))
        self._own_values(body, req)
        req.grammar = self._grammar(body, req.chain, req.tools)
        req.allowed = self._allowed(body, req.chain)
        if req.logprobs and self.sharded:
            names = {k.split(".")[0] for k, _ in self.programs[req.chain].graph.outputs}
            if "raw_logprob" not in names or "top_logprobs" not in names:
                raise BadRequest(f"logprobs: the chain '{req.chain}' has no raw_logprob and top_logprobs outputs, "
                                 "which a server with a vocabulary-sharded LM head needs for log-probabilities",
                                 "logprobs")
        if req.echo and req.logprobs and self.sharded:
            raise BadRequest("echo: the prompt's log-probabilities are not available on a server with a "
                             "vocabulary-sharded LM head", "echo")
        if req.prompt_logprobs is not None and self.sharded:
            raise BadRequest("prompt_logprobs: the prompt's log-probabilities are not available on a server with a "
                             "vocabulary-sharded LM head", "prompt_logprobs")
        req.body = body
        return req

    def _served(self, body) -> None:
        """A `model` other than the served one is a 404 naming it."""
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise BadRequest(f"model: '{model}' is not served here (this server serves '{self.model_id}')",
                             "model", 404, "model_not_found")

    def tokenize(self, body) -> dict:
        """vLLM's /tokenize: a prompt's tokens as the completions endpoint reads it (`prompt`; `add_special_tokens`,
        default true: the tokenizer's beginning-of-sequence) or a conversation's as the chat endpoint does
        (`messages`, its template's fields, `tools`); `return_token_strs`: each token's string too."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        self._served(body)
        chat = "messages" in body
        known = {"model", "add_special_tokens", "return_token_strs"} | (
            {"messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools",
             "tool_choice", "parallel_tool_calls"} if chat else {"prompt"})
        for name in body:
            if name not in known:
                raise BadRequest(f"unrecognized request argument supplied: {name}", name)
        specials = body.get("add_special_tokens")
        if specials is not None and not isinstance(specials, bool):
            raise BadRequest("add_special_tokens must be true or false", "add_special_tokens")
        if chat:
            calls = self._tools({k: v for k, v in body.items() if k in ("tools", "parallel_tool_calls")} |
                                {"tool_choice": "none"}) if body.get("tools") else None
            tokens = self._prompts("chat", body, calls)[0][0]
        else:
            p = body.get("prompt")
            if isinstance(p, str) and specials is False:
                tokens = list(self.tokenizer.encode(p, add_special_tokens=False))
            else:
                tokens = self._completion_prompt(p, "prompt") if p != "" else []
        out = {"count": len(tokens), "max_model_len": self.context, "tokens": tokens, "token_strs": None}
        if self._bool(body, "return_token_strs"):
            out["token_strs"] = list(self.tokenizer.convert_ids_to_tokens(tokens))
        return out

    def detokenize(self, body) -> dict:
        """vLLM's /detokenize: token ids' text (`{"tokens": [...]}` -> `{"prompt": text}`)."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        for name in body:
            if name not in ("model", "tokens"):
                raise BadRequest(f"unrecognized request argument supplied: {name}", name)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and
                                                0 <= t < self.vocab for t in ids):
            raise BadRequest(f"tokens must be a list of token ids in [0, {self.vocab})", "tokens")
        return {"prompt": self.tokenizer.decode(ids)}

    @staticmethod
    def _bool(body, name, label=None):
        v = body.get(name)
        if v is None:
            return False
        if not isinstance(v, bool):
            raise BadRequest(f"{label or name} must be true or false, got {json.dumps(v)}", label or name)
        return v

    def _refusals(self, kind, body):
        def off(name, ok=lambda v: v is None):
            if name in body and not ok(body[name]):
                raise BadRequest(f"{name}: not supported by samplec serve", name)
        off("functions", lambda v: v is None or v == [])      # (OpenAI's deprecated forms of tools, tool_choice)
        off("function_call", lambda v: v in (None, "none"))
        for name in ("audio", "prediction", "web_search_options", "suffix", "verbosity"):
            off(name)
        off("modalities", lambda v: v is None or v == ["text"])
        off("store", lambda v: v in (None, False))
        off("best_of", lambda v: v is None or v == body.get("n", 1) or v == 1)
        off("service_tier", lambda v: v in (None, "auto", "default"))
        for name in INFORMATIONAL:     # (accepted as they are typed; a value of another type is a bad request)
            typed, what = (dict, "an object") if name == "metadata" else (str, "a string")
            if body.get(name) is not None and not isinstance(body[name], typed):
                raise BadRequest(f"{name} must be {what}, got {json.dumps(body[name])[:100]}", name)

    def _tools(self, body):
        """The request's tools and tool_choice (samplec.tools); `auto` needs the tokenizer's tool-call format."""
        try:
            t = tools.parse(body)
        except ToolError as e:
            raise BadRequest(str(e), e.field) from None
        if t is not None and t.choice == "auto" and not getattr(self.tokenizer, "has_tool_calling", False):
            raise BadRequest("tool_choice: \"auto\" tool choice needs a model whose tokenizer has a tool-call format "
                             "(mlx-lm reads one from its chat template); this model's has none -- ask for "
                             "\"required\" or a named function (grammar-constrained calls), or \"none\"",
                             "tool_choice")
        return t

    def _prompts(self, kind, body, calls=None, flags=None) -> tuple[list[list[int]], list]:
        """The prompts' tokens, and per prompt the string given (None: given as token ids, or chat's messages);
        `calls`: the request's tools, `flags`: its `_template_flags` (chat)."""
        if kind == "completion":
            if "prompt" not in body:
                raise BadRequest("prompt is required", "prompt")
            p = body["prompt"]
            several = isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p)
            if several and len(p) > MAX_PROMPTS:
                raise BadRequest(f"prompt: {len(p)} prompts in one request; the limit is {MAX_PROMPTS}", "prompt")
            prompts, texts = [], []
            for i, one in enumerate(p if several else [p]):
                where = f"prompt[{i}]" if several and len(p) > 1 else "prompt"
                prompts.append(self._completion_prompt(one, where))
                texts.append(one if isinstance(one, str) else None)
            return prompts, texts
        else:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise BadRequest("messages must be a non-empty list", "messages")
            plain = []
            for i, m in enumerate(msgs):
                where = f"messages[{i}]"
                if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant",
                                                                    "tool"):
                    raise BadRequest(f"{where}: a message is an object with a role of system, developer, user, "
                                     "assistant or tool", where)
                own = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}.get(m["role"], set())
                extra = set(m) - {"role", "content", "name"} - own
                if extra:
                    raise BadRequest(f"{where}.{sorted(extra)[0]}: not supported by samplec serve",
                                     f"{where}.{sorted(extra)[0]}")
                c = m.get("content")
                if c is None and m["role"] == "assistant" and m.get("tool_calls"):
                    c = ""          # (an assistant message of tool calls alone)
                if isinstance(c, list):
                    parts = []
                    for part in c:
                        if not isinstance(part, dict) or part.get("type") != "text" or \
                                not isinstance(part.get("text"), str):
                            raise BadRequest(f"{where}.content: only text parts are supported", f"{where}.content")
                        parts.append(part["text"])
                    c = "".join(parts)
                if not isinstance(c, str):
                    raise BadRequest(f"{where}.content must be a string or a list of text parts",
                                     f"{where}.content")
                name = m.get("name")
                if name is not None and not isinstance(name, str):
                    raise BadRequest(f"{where}.name must be a string, got {json.dumps(name)[:100]}",
                                     f"{where}.name")
                try:
                    fields = template_message(m, where) if own else {}
                except ToolError as e:
                    raise BadRequest(str(e), e.field) from None
                plain.append({"role": "system" if m["role"] == "developer" else m["role"], "content": c,
                              **({"name": name} if name is not None else {}), **fields})
            cont, kwargs = flags if flags is not None else self._template_flags(body)
            kwargs = dict(kwargs)
            if calls is not None:       # (every tool choice's: "none" too, as vLLM passes them)
                kwargs["tools"] = [dict(t) for t in calls.functions]
            if getattr(self.tokenizer, "has_chat_template", False):
                try:
                    tokens = self.tokenizer.apply_chat_template(plain, tokenize=True, **kwargs)
                except Exception as e:  # noqa: BLE001 - a template's own errors (jinja)
                    raise BadRequest(f"messages: the chat template failed: {e}"[:500], "messages") from None
                if isinstance(tokens, dict) or hasattr(tokens, "input_ids"):
                    tokens = tokens["input_ids"]
                tokens = list(tokens)
            else:
                lines = [f"{m['role']}: {m['content']}" + "".join(
                    f"<tool_call>{json.dumps(c['function'])}</tool_call>" for c in m.get("tool_calls", ()))
                    for m in plain]
                # (continue_final_message: the last line left open -- no newline after it)
                text = "\n".join(lines) if cont else "".join(f"{line}\n" for line in lines) + \
                    ("assistant:" if kwargs["add_generation_prompt"] else "")
                tokens = list(self.tokenizer.encode(text))
        if not tokens:
            raise BadRequest("messages: no tokens to start from", "messages")
        return [tokens], [None]

    def _template_flags(self, body) -> tuple[bool, dict]:
        """(continue_final_message, the chat template's keyword arguments): the request's chat_template_kwargs with
        add_generation_prompt and continue_final_message resolved. A top-level field given wins over
        chat_template_kwargs (vLLM's renderer merges its own fields over them); left out, chat_template_kwargs'
        value applies (as vLLM passed them over its own arguments before its renderer), else the default:
        add_generation_prompt true -- false with continue_final_message, which leaves the last message open."""
        user = body.get("chat_template_kwargs")
        if user is not None and not isinstance(user, dict):
            raise BadRequest(f"chat_template_kwargs must be an object, got {json.dumps(user)[:100]}",
                             "chat_template_kwargs")
        effort = body.get("reasoning_effort")
        if effort is not None and effort not in EFFORTS:
            raise BadRequest(f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {json.dumps(effort)[:60]}",
                             "reasoning_effort")
        # (reasoning_effort reaches the template as vLLM passes it -- a template that reads it, gpt-oss's, decides
        # what it means; chat_template_kwargs' own win)
        user = {**self.template_args, **({"reasoning_effort": effort} if effort is not None else {}),
                **(user or {})}      # (the request's win over --chat-template-args)
        fixed = sorted(set(user) & {"tokenize", "conversation", "messages", "chat_template"})
        if fixed:
            raise BadRequest(f"chat_template_kwargs: {fixed[0]} is set by the server", "chat_template_kwargs")
        flags = {}
        for name in ("continue_final_message", "add_generation_prompt"):
            for where, values in ((name, body), (f"chat_template_kwargs.{name}", user)):
                v = values.get(name)
                if v is not None and not isinstance(v, bool):
                    raise BadRequest(f"{where} must be true or false, got {json.dumps(v)[:100]}",
                                     where.split(".")[0])
            top = body.get(name)
            flags[name] = top if top is not None else user.get(name)
        cont = bool(flags["continue_final_message"])
        gen = flags["add_generation_prompt"]
        if cont and gen:
            raise BadRequest("continue_final_message and add_generation_prompt cannot both be true: "
                             "continue_final_message continues the last message, add_generation_prompt begins a "
                             "new one", "continue_final_message")
        kwargs = {**user, "add_generation_prompt": not cont if gen is None else gen}
        kwargs.pop("continue_final_message", None)
        if cont:        # (passed only when asked: a tokenizer's own template function may not take it)
            kwargs["continue_final_message"] = True
        return cont, kwargs

    def _truncated(self, body, prompts: list[list[int]], texts: list) -> tuple[list[list[int]], list]:
        """vLLM's truncate_prompt_tokens: each prompt's last k tokens (after the chat template), -1 as many as the
        model's context length (every token where it is not known); a prompt cut short is echoed as its kept
        tokens' text (the string given no longer writes them)."""
        k = _number(body, "truncate_prompt_tokens", -1, 2**63 - 1, integer=True)
        if k is None:
            return prompts, texts
        if k == 0:
            raise BadRequest("truncate_prompt_tokens must be -1 (the model's context length) or at least 1 (the "
                             "number of prompt tokens kept), got 0", "truncate_prompt_tokens")
        if k == -1:
            if self.context is None:
                return prompts, texts
            k = self.context
        if self.context is not None and k > self.context:
            raise BadRequest(f"truncate_prompt_tokens value ({k}) is greater than the model's maximum context length "
                             f"({self.context}). Please select a smaller truncation size.", "truncate_prompt_tokens")
        kept = [p[-k:] for p in prompts]
        return kept, [t if len(p) == len(q) else None for t, p, q in zip(texts, prompts, kept)]

    def _completion_prompt(self, p, where: str) -> list[int]:
        """One prompt of /v1/completions: a non-empty string, or a non-empty list of token ids."""
        if isinstance(p, str):
            if not p:
                raise BadRequest(f"{where} must be a non-empty string", "prompt")
            tokens = list(self.tokenizer.encode(p))
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if any(not 0 <= t < self.vocab for t in p):
                raise BadRequest(f"{where}: token ids must lie in [0, {self.vocab})", "prompt")
            tokens = list(p)
        else:
            raise BadRequest(f"{where} must be a non-empty string or a list of token ids", "prompt")
        if not tokens:
            raise BadRequest(f"{where}: no tokens to start from", "prompt")
        return tokens

    @staticmethod
    def _stop(body) -> list[str]:
        s = body.get("stop")
        if s is None:
            return []
        items = [s] if isinstance(s, str) else s
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items) or len(items) > MAX_STOP:
            raise BadRequest(f"stop must be a string or a list of at most {MAX_STOP} strings", "stop")
        return list(dict.fromkeys(x for x in items if x))     # (an empty string stops nothing, as OpenAI's)

    def _prompt_logprobs(self, body, stream: bool) -> int | None:
        """vLLM's prompt_logprobs: None, or how many of the most likely tokens each prompt position lists (besides
        the prompt's own token), at most TOP as vLLM's default max_logprobs -- so -1, vLLM's whole vocabulary, is a
        400 too; with stream only 0, as vLLM's."""
        n = _number(body, "prompt_logprobs", -1, None, integer=True)
        if n is None:
            return None
        if stream and n != 0:
            raise BadRequest("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if n == -1 or n > TOP:
            raise BadRequest(f"prompt_logprobs: requested prompt logprobs of {self.vocab if n == -1 else n}, which "
                             f"is greater than max allowed: {TOP}", "prompt_logprobs")
        return n

    def _bad_words(self, body) -> list[tuple[int, ...]]:
        """vLLM's bad_words as the token sequences it bans: each word (its leading spaces stripped) as the tokenizer
        encodes it, and again after one space when that gives as many tokens beginning with another one (the word
        in the middle of a text), as vLLM's SamplingParams.update_from_tokenizer."""
        words = body.get("bad_words")
        if words is None:
            return []
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise BadRequest(f"bad_words must be a list of strings, got {json.dumps(words)[:100]}", "bad_words")
        seqs: list[tuple[int, ...]] = []
        for w in words:
            plain = self._encode(w.lstrip())
            if not plain:
                raise BadRequest(f"bad_words: {json.dumps(w)[:100]} has no tokens (an empty word bans nothing)",
                                 "bad_words")
            seqs.append(plain)
            spaced = self._encode(" " + w.lstrip())
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                seqs.append(spaced)
            if len(seqs) > MAX_BAD_WORDS:
                raise BadRequest(f"bad_words: too many bad words: they make more than {MAX_BAD_WORDS} token "
                                 "sequences (each word and its form after a space)", "bad_words")
        if sum(len(q) for q in seqs) > MAX_BAD_WORD_TOKENS:
            raise BadRequest(f"bad_words: their token sequences hold more than {MAX_BAD_WORD_TOKENS} tokens",
                             "bad_words")
        past = sorted({t for q in seqs for t in q if not 0 <= t < self.vocab})
        if past:
            raise BadRequest(f"bad_words: the tokenizer gives ids past the model's vocabulary of {self.vocab}: "
                             f"{past[:8]}", "bad_words")
        if self.speculative and any(len(q) > 1 for q in seqs):
            # (a round of proposals shares one bias: a ban that follows the proposals before it cannot hold)
            raise BadRequest("bad_words: a word of more than one token is not supported by a server with a draft "
                             "model", "bad_words")
        return seqs

    def _encode(self, text: str) -> tuple[int, ...]:
        """The text's tokens without special tokens (no beginning-of-sequence), as vLLM encodes a bad word."""
        try:
            return tuple(int(t) for t in self.tokenizer.encode(text, add_special_tokens=False))
        except TypeError:       # (a tokenizer whose encode takes no add_special_tokens)
            return tuple(int(t) for t in self.tokenizer.encode(text))

    def _logprobs(self, kind, body, req):
        lp = body.get("logprobs")
        if kind == "chat":
            req.logprobs = self._bool(body, "logprobs")
            top = body.get("top_logprobs")
            if top is not None:
                req.top_logprobs = _number(body, "top_logprobs", 0, TOP, integer=True)
                if not req.logprobs:
                    raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        elif lp is not None:
            if isinstance(lp, bool):
                raise BadRequest("logprobs: on /v1/completions it is an integer in [0, 20] (the number of most "
                                 "likely tokens to list)", "logprobs")
            req.top_logprobs = _number(body, "logprobs", 0, TOP, integer=True)
            req.logprobs = True

    def _values(self, body, req):
        # (OpenAI's ranges for its fields; the others as their chain stages take them, within float32)
        ranges = dict(temperature=(0, 2), top_p=(0, 1), min_p=(0, 1), repetition_penalty=(0, F32_MAX),
                      presence_penalty=(-2, 2), frequency_penalty=(-2, 2), xtc_probability=(0, 1),
                      xtc_threshold=(0, 1))
        raw = dict(DEFAULTS)
        for name in FIELDS:
            if name in WINDOWS or name == "top_k":
                # (top_k 0 or -1: off -- -1 is vLLM's "disabled")
                v = _number(body, name, 0 if name in WINDOWS else -1, None if name in WINDOWS else 2**31 - 1,
                            integer=True)
            else:
                lo, hi = ranges[name]
                v = _number(body, name, lo, hi)
                if name == "repetition_penalty" and v and not np.float32(v):
                    raise BadRequest(f"repetition_penalty must be 0 (off) or at least float32's smallest positive "
                                     f"number, got {v}", name)
            if v is not None:
                raw[name] = v
        req.values = {name: FIELDS[name](raw[name]) for name in FIELDS}

    def _own_values(self, body, req) -> None:
        """The chain's own parameters the request sets (by name; checked by the parameter's own range, as a call
        checks it), into `req.values`; one the chain requires and the request leaves out is a 400 naming it."""
        from samplec.program import _scalar_param
        own = self.own.get(req.chain, {})
        for name in sorted(self.chain_fields - set(own)):
            if name in body:
                raise BadRequest(f"{name}: the chain '{req.chain}' has no parameter of that name (it takes "
                                 f"{', '.join(sorted(own)) or 'none of its own'})", name)
        for name, p in own.items():
            v = body.get(name)
            if v is None:
                if p.required:
                    raise BadRequest(f"{name} is required by the chain '{req.chain}'", name)
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise BadRequest(f"{name} must be a number, got {json.dumps(v)[:60]}", name)
            try:
                _scalar_param(p, v, 1)
            except SamplecError as e:
                raise BadRequest(f"{name}: {str(e).replace(' (row 0)', '')}", name) from None
            req.values[name] = int(v) if p.kind == "int" else float(v)

    def _bias(self, body) -> dict:
        b = body.get("logit_bias")
        if b is None:
            return {}
        if not isinstance(b, dict):
            raise BadRequest("logit_bias must be an object of token id -> bias", "logit_bias")
        out = {}
        for k, v in b.items():
            try:
                t = int(k)
            except (TypeError, ValueError):
                raise BadRequest(f"logit_bias: {k!r} is not a token id", "logit_bias") from None
            if not 0 <= t < self.vocab:
                raise BadRequest(f"logit_bias: token {k}: ids must lie in [0, {self.vocab})", "logit_bias")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise BadRequest(f"logit_bias: token {k}: a bias is a number in [-100, 100], got {json.dumps(v)}",
                                 "logit_bias")
            out[t] = float(v)
        return out

    def _allowed(self, body, chain: str) -> np.ndarray | None:
        """vLLM's allowed_token_ids: the only tokens a choice may draw, as the packed bitmask the chain's mask takes
        (bit j of word w: token 32 w + j), which a grammar's mask narrows further."""
        ids = body.get("allowed_token_ids")
        if ids is None:
            return None
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab for t in ids):
            raise BadRequest(f"allowed_token_ids must be a non-empty list of token ids in [0, {self.vocab})",
                             "allowed_token_ids")
        if not any(p.kind == "mask" for p in self.programs[chain].params):
            raise BadRequest(f"allowed_token_ids: the chain '{chain}' has no mask parameter (add `allowed: mask` and "
                             "`allow(allowed)` to it)", "allowed_token_ids")
        bits = np.zeros(-(-self.vocab // 32) * 32, dtype=bool)
        bits[ids] = True
        return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)

    def _grammar(self, body, chain: str, calls=None):
        """The request's grammar, from whichever field asks for one: response_format (json_object, json_schema),
        samplec's `grammar`, vLLM's guided_* fields, its structured_outputs object or a forced tool_choice (the
        calls' JSON schema, as vLLM's) -- one of them at most (vLLM refuses two kinds of constraint in one request
        too)."""
        specs = self._grammar_specs(body)
        if calls is not None and calls.forced:
            try:
                specs.append(("json_schema", tools.forced_schema(calls), "tool_choice"))
            except ToolError as e:
                raise BadRequest(str(e), e.field) from None
        if len(specs) > 1:
            (_, _, first), (_, _, second) = specs[:2]
            raise BadRequest(f"{second}: only one kind of structured output per request, and {first} is given too",
                             second)
        backend = body.get("guided_decoding_backend")
        if backend is not None and not isinstance(backend, str):
            raise BadRequest(f"guided_decoding_backend must be a string, got {json.dumps(backend)[:100]}",
                             "guided_decoding_backend")
        if not specs:
            return None
        if backend is not None and backend.split(":")[0] not in GUIDED_BACKENDS:
            # (vLLM refuses a backend other than the one it was started with; this server's is llguidance)
            raise BadRequest(f"guided_decoding_backend: request-level backend selection is not supported: the request "
                             f"names {backend!r}, this server's structured outputs run on llguidance (vLLM's "
                             f"'guidance'); leave the field out", "guided_decoding_backend")
        kind, value, name = specs[0]
        if self.grammars is None:
            raise BadRequest(f"{name}: structured outputs are unavailable on this server ({self.grammars_off})",
                             name)
        if not any(p.kind == "mask" for p in self.programs[chain].params):
            raise BadRequest(f"{name}: the chain '{chain}' has no mask parameter (add `allowed: mask` and "
                             "`allow(allowed)` to it)", name)
        if kind == "choice":        # (exactly one of the strings: the alternatives of a Lark start rule)
            kind, value = "lark", "start: " + " | ".join(json.dumps(c) for c in value)
        from samplec.structured import Grammar, GrammarError
        try:
            return Grammar.build(self.grammars, kind, value, name)
        except GrammarError as e:
            raise BadRequest(str(e), e.field) from None

    @staticmethod
    def _grammar_specs(body) -> list[tuple[str, object, str]]:
        """Each structured-output constraint the request gives: (kind, value, the field that gave it)."""
        specs = []
        rf, g = body.get("response_format"), body.get("grammar")
        if rf is not None:
            if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
                raise BadRequest("response_format: type must be text, json_object or json_schema", "response_format")
            if rf["type"] == "json_object":
                specs.append(("json_object", None, "response_format"))
            elif rf["type"] == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or "schema" not in js and "name" not in js:
                    raise BadRequest("response_format.json_schema must be an object with a name and a schema",
                                     "response_format.json_schema")
                specs.append(("json_schema", js.get("schema", {}), "response_format.json_schema"))
        if g is not None:
            if not isinstance(g, dict) or g.get("type") not in ("regex", "lark", "gbnf", "json_schema") or \
                    "value" not in g or set(g) - {"type", "value"}:
                raise BadRequest("grammar must be {\"type\": \"regex\" | \"lark\" | \"gbnf\" | \"json_schema\", "
                                 "\"value\": ...}", "grammar")
            specs.append((g["type"], g["value"], "grammar"))
        for name, kind in GUIDED.items():
            if body.get(name) is not None:
                specs.append((kind, _guided_value(kind, body[name], name), name))
        so = body.get("structured_outputs")
        if so is not None:
            if not isinstance(so, dict):
                raise BadRequest("structured_outputs must be an object: {\"json\" | \"regex\" | \"choice\" | "
                                 "\"grammar\" | \"json_object\": ...}", "structured_outputs")
            for key in so:
                if key not in STRUCTURED and key not in STRUCTURED_OPTIONS:
                    raise BadRequest(f"structured_outputs.{key}: not supported by samplec serve (it takes json, regex, "
                                     "choice, grammar, json_object, disable_any_whitespace and disable_fallback)",
                                     f"structured_outputs.{key}")
                if key in STRUCTURED_OPTIONS and so[key] is not None and not isinstance(so[key], bool):
                    raise BadRequest(f"structured_outputs.{key} must be true or false", f"structured_outputs.{key}")
            given = [(kind, so[key], f"structured_outputs.{key}") for key, kind in STRUCTURED.items()
                     if so.get(key) is not None]
            if not given:
                raise BadRequest("structured_outputs: give one kind of constraint (json, regex, choice, grammar or "
                                 "json_object)", "structured_outputs")
            for kind, value, name in given:
                if kind == "json_object" and value is not True:
                    raise BadRequest(f"{name} must be true (leave it out for no constraint)", name)
                specs.append((kind, _guided_value(kind, value, name), name))
        return specs


def _guided_value(kind: str, value, name: str):
    """A vLLM structured-output field's value checked for its kind (BadRequest names the field): a JSON schema is an
    object or its JSON text, a choice a non-empty list of strings, a regex or grammar a non-empty string."""
    param = name
    if kind == "json_object":
        return None
    if kind == "json_schema":
        if not isinstance(value, (dict, str)):
            raise BadRequest(f"{name} must be a JSON schema: an object, or its JSON text", param)
        return value
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise BadRequest(f"{name} must be a non-empty list of strings", param)
        return value
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{name} must be a non-empty string", param)
    return value


# ---------------------------------------------------------------------------------------------------------------
# sampling

class Row:
    """One choice being generated: its values, its record of each sample, its text."""

    def __init__(self, job: "Job", index: int, seed: int, eos: int, prompt: list[int], split_history: bool = False):
        self.job, self.index, self.seed, self.eos, self.prompt = job, index, seed, eos, prompt
        req = job.req
        self.max_tokens = req.limits[index // req.n] if req.limits else req.max_tokens
        self.echo: Echo | None = None        # its prompt's text and logprobs, with echo
        self.chain, self.values, self.bias, self.allowed = req.chain, req.values, req.bias, req.allowed
        # the ids that end the choice (end-of-sequence, the request's stop_token_ids), held off by a -inf bias
        # until `min_tokens` samples are drawn
        self.stop_ids = (set() if req.ignore_eos else set(job.eos_ids)) | set(req.stop_token_ids)
        self.held = sorted(self.stop_ids) if req.min_tokens else []
        self.min_tokens = req.min_tokens
        # (vLLM's bad_words: a one-token word is banned at every step, a longer one's last token where the tokens
        # the row has generated end with the ones before it)
        self.bad_always = tuple(sorted({q[0] for q in req.bad_words if len(q) == 1}))
        self.bad_after = [(q[:-1], q[-1]) for q in req.bad_words if len(q) > 1]
        self._banned_at: tuple = (-1, ())
        # (how many tokens each history holds, -1: all; in a chain with a generated-tokens history the presence
        # and frequency windows read that one, and its other histories the repetition window alone)
        seq = WINDOWS[:1] if split_history else WINDOWS
        self.context = _widest(self.values[w] for w in seq)
        self.generated_context = _widest(self.values[w] for w in WINDOWS[1:])
        self.matcher = req.grammar.matcher() if req.grammar is not None else None
        self.sampler: BatchSampler | None = None
        self.step = 0                        # samples drawn (the position of the next)
        self.failed = False                  # a sample's call failed: the row ends (its request fails)
        self.records: list = []              # per sample: (token, processed, raw, top ids, top values)
        self.delivered = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""
        self.offsets: list[int] = []         # each delivered token's offset in text
        self.cut = False                     # a stop string ended the text (the tokens after its start are not kept)
        self.stop_token = False              # a stop id ended the row (its last token: no text of its own)
        self.emitted = 0                     # characters of text already streamed
        self.entries_sent = 0
        self.finish: str | None = None
        self.stop_reason: str | int | None = None   # (vLLM's: the stop string or stop token id that ended it)
        self.uid: int | None = None
        self.grammar_error: str | None = None
        self.grammar_logged = False
        self.spec: Speculation | None = None    # its speculative state, when a draft model decodes it
        self.vocab_start = 0                     # the first id of the logits it sees (a rank's slice: its start)
        self._bias_at: tuple | None = None       # (vocab_start, width) of _bias_cols
        self._bias_cols: tuple = ()

    def record(self, draw) -> int:
        """Keep one sample (`BatchSampler.draw`'s entry; a SamplecError: the call failed for this row -- a value the
        request's checks could not foresee -- which then ends with its end-of-sequence token and fails its
        request) and move to the next position. The token."""
        if isinstance(draw, SamplecError):
            self.job.fail(draw, self.index)
            self.failed = True
            draw = (self.eos, None, None, None, None)
        self.records.append(draw)
        self.step += 1
        return draw[0]

    @property
    def biased(self) -> bool:
        """Whether the row's logits take a bias this step (its logit_bias, its stop ids held off, its bad words)."""
        return bool(self.bias) or self.step < self.min_tokens and bool(self.held) or bool(self.banned())

    def banned(self) -> tuple[int, ...]:
        """The tokens the row's bad words ban at this step (ascending): each one-token word's, and the last token
        of each longer word whose other tokens the row's generated tokens end with (vLLM's rule: the prompt's
        tokens do not count)."""
        if not self.bad_after:
            return self.bad_always
        if self._banned_at[0] != self.step:
            out = set(self.bad_always)
            for before, last in self.bad_after:
                k = len(before)
                if len(self.records) >= k and tuple(int(r[0]) for r in self.records[-k:]) == before:
                    out.add(last)
            self._banned_at = (self.step, tuple(sorted(out)))
        return self._banned_at[1]

    def bias_entries(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The row's logit_bias on the logits it sees (`width` ids from `vocab_start`: a rank's slice of them),
        -inf on its stop ids while fewer than `min_tokens` samples are drawn and on the tokens its bad words ban
        (`banned`): (columns int64, values float32), ascending; made once per slice, phase and ban."""
        holding = self.step < self.min_tokens
        banned = self.banned()
        key = (self.vocab_start, width, holding, banned)
        if self._bias_at != key:
            lo = self.vocab_start
            bias = dict(self.bias)
            if holding:
                bias.update((i, -np.inf) for i in self.held)
            bias.update((i, -np.inf) for i in banned)
            ids = sorted(i for i in bias if lo <= i < lo + width)
            self._bias_cols = (np.array([i - lo for i in ids], np.int64), np.array([bias[i] for i in ids],
                                                                                   np.float32))
            self._bias_at = key
        return self._bias_cols

    def history(self, tokens, generated: int) -> tuple[np.ndarray, np.ndarray]:
        """What the chain's windows read of the sequence before the sampled position (`tokens`: prompt + generated,
        the last `generated` of them generated): (its last tokens, the last of the generated ones)."""
        seq = np.array(tokens).reshape(-1)
        gen = seq[len(seq) - generated:] if generated > 0 else seq[:0]
        return _last(seq, self.context), _last(gen, self.generated_context)

    def process(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """The row's logits processor (called by the batch in row order): record the row (its logit_bias is added
        with the batch's, `add_bias`, when its chain runs)."""
        self.sampler.rows.append((self, logits, tokens))
        return logits


def _widest(windows) -> int:
    """The most tokens any of these windows reads (a window of -1: every token)."""
    windows = list(windows)
    return -1 if -1 in windows else max(windows)


def _last(tokens: np.ndarray, n: int) -> np.ndarray:
    """The last n tokens (n = -1: all of them)."""
    return tokens if n < 0 else tokens[max(len(tokens) - n, 0):]


def add_bias(x: mx.array, rows: list[Row]) -> mx.array:
    """x [R, V] (the model's logits, or a rank's slice of them) with row i's logit_bias added to its row i: one
    scatter-add over the batch, whatever the number of biased rows (each entry added as `x + b` adds it)."""
    R, V = x.shape
    cols, vals = [], []
    for i, r in enumerate(rows):
        if r.biased:
            c, v = r.bias_entries(V)
            if c.size:
                cols.append(c + i * V)
                vals.append(v)
    if not cols:
        return x
    flat = np.concatenate(cols)
    flat = flat.astype(np.int32) if R * V < 2**31 else flat
    return x.reshape(-1).at[mx.array(flat)].add(mx.array(np.concatenate(vals))).reshape(R, V)


class BatchSampler:
    """The batch's one sampler: runs each chain once per step over the rows recorded by their processors."""

    def __init__(self, programs: dict[str, Program], grammars=None, vocab_shard=None):
        self.programs = programs
        self.grammars = grammars
        # (a model whose LM head is split over ranks: each chain runs as samplec.distributed.shard on the rank's
        # logits slice, and every rank gets the same tokens)
        self.vocab_shard = vocab_shard
        self.sharded: dict[str, object] = {}
        self.readers: dict[str, dict] = {}     # chain -> `history_readers` of its program
        self.drives: dict[str, tuple] = {}     # chain -> (its position parameters, draws at a fixed position)
        self.rows: list = []
        self.calls = 0              # program calls so far (one per chain per step)
        self.widest = 0             # the most rows one call sampled
        self.mixed = 0              # calls that sampled rows with a grammar and rows without together
        self.grammar_seconds = 0.0  # time in the grammar engine (masks and advancing)
        self.sample_seconds = 0.0   # time in the sampler calls (programs and grammar)

    def __call__(self, logprobs: mx.array) -> mx.array:
        t0 = time.perf_counter()
        rows, self.rows = self.rows, []
        if len(rows) != logprobs.shape[0]:
            raise RuntimeError(f"samplec serve: {len(rows)} recorded rows for a batch of {logprobs.shape[0]}")
        tokens = [None] * len(rows)
        for chain in dict.fromkeys(r.chain for r, _, _ in rows):
            at = [i for i, (r, _, _) in enumerate(rows) if r.chain == chain]
            out = self._run(self.programs[chain], [rows[i] for i in at])
            for i, t in zip(at, out):
                tokens[i] = t
        self.sample_seconds += time.perf_counter() - t0
        return mx.array(tokens, dtype=mx.uint32)

    def _shard(self, prog: Program):
        if prog.name not in self.sharded:
            from samplec.distributed import shard
            # (no bound of its own: the engine's step watch bounds the whole step, its forward pass included,
            # and answers the requests in flight before the rank ends -- samplec.distributed.follow)
            self.sharded[prog.name] = shard(prog, self.vocab_shard.group, timeout=None)
        return self.sharded[prog.name]

    def _masks(self, rows: list, V: int) -> np.ndarray:
        t0 = time.perf_counter()
        mask = np.full((len(rows), (V + 31) // 32), -1, dtype=np.int32)
        if V % 32:
            mask[:, -1] = (1 << (V % 32)) - 1
        from samplec.structured import fill_batch
        fill_batch([(r.matcher, i) for i, r in enumerate(rows) if r.matcher is not None], mask)
        for i, r in enumerate(rows):        # (allowed_token_ids: within the grammar's mask too)
            if r.allowed is not None:
                mask[i] &= r.allowed
        self.grammar_seconds += time.perf_counter() - t0
        return mask

    def _run(self, prog: Program, rows: list) -> list[int]:
        rs = [r for r, _, _ in rows]
        x = add_bias(mx.concatenate([lg.reshape(1, -1) for _, lg, _ in rows], axis=0), rs)
        draws = self.draw(prog, x, rs, [r.history(t, r.step) for r, _, t in rows], [r.step for r in rs],
                          any(r.job.req.logprobs for r in rs))
        t0 = time.perf_counter()
        tokens = []
        for r, d in zip(rs, draws):
            tok = r.record(d)
            tokens.append(tok)
            ok = not isinstance(d, SamplecError)
            if ok and r.matcher is not None and r.grammar_error is None and tok not in r.stop_ids:
                if not r.matcher.consume(tok):
                    r.grammar_error = r.matcher.error or f"token {tok} not allowed"
        self.grammar_seconds += time.perf_counter() - t0
        return tokens

    def draw(self, prog: Program, x: mx.array, rows: list, hist: list, positions: list[int],
             want: bool) -> list:
        """One program call over logits x [R, V] (already biased): row i samples with rows[i]'s seed, values and
        mask, the histories hist[i] (`Row.history`) and the position positions[i]. Per row (token, processed
        logprob, raw logprob, top ids, top values) -- logprobs only when `want` -- or the SamplecError the call
        raised for that row (a value no request check could foresee: the rows are then tried one by one, so that
        only the failing ones fail).
        Pure: neither the rows nor their records change."""
        V = x.shape[-1] if self.vocab_shard is None else self.vocab_shard.vocab
        kw: dict = {}
        readers = self.readers.get(prog.name)
        if readers is None:
            readers = self.readers[prog.name] = history_readers(prog)
        drives = self.drives.get(prog.name)
        if drives is None:      # (its position parameters, and whether a draw's position is none: seeds step)
            from samplec.decode import draws_at_fixed_positions
            drives = self.drives[prog.name] = (positions_of(prog), draws_at_fixed_positions(prog))
        for p in prog.params:
            if p.kind == "tokens":
                # (a row whose penalties over this history are all neutral reads none of it: an empty one;
                # padded to a multiple of 32: fewer shapes for the program's compile cache to hold)
                need = readers[p.name]
                which = [h[p.name in GENERATED] if need is None or any(
                    f not in FIELDS or r.values[f] != neutral for f, neutral in need)
                    else h[0][:0] for r, h in zip(rows, hist)]
                width = -(-max(1, max(len(h) for h in which)) // 32) * 32
                # (an MLX array: the program's short path checks it inside the compiled call)
                kw[p.name] = mx.array(np.stack([np.pad(h.astype(np.int32), (width - len(h), 0), constant_values=-1)
                                                for h in which]))
            elif p.kind == "seed":
                # (a draw at a fixed position -- a chain's `sample(seed)` -- takes the seed advanced by the
                # position instead, as the decode loops do: fresh noise at each step, decode.step_seed)
                # (Python integers: the program's short path compares them by their bytes, and builds a seed that
                # moves every step without keeping it)
                seeds = [int(r.seed) for r in rows]
                kw[p.name] = step_seeds(seeds, positions).tolist() if drives[1] else seeds
            elif p.kind == "mask":
                kw[p.name] = mx.array(self._masks(rows, V))
            elif p.name in drives[0] and p.kind == "int":
                kw[p.name] = list(positions)
            elif p.name in FIELDS:
                kw[p.name] = [r.values[p.name] for r in rows]
            elif p.kind in ("float", "int"):        # (a chain's own parameter: the request's value, or its default)
                kw[p.name] = [r.values.get(p.name, p.default) for r in rows]
        self.calls += 1
        self.widest = max(self.widest, len(rows))
        constrained = sum(r.matcher is not None for r in rows)
        self.mixed += 0 < constrained < len(rows)
        try:
            if self.vocab_shard is None:
                # (the model's logprobs only when a row asks for them: the rest of the time their sort never runs)
                out = prog.run(x, [n for n in prog.output_names
                                   if want or n not in ("raw_logprob", "top_logprobs")], **kw)
            else:
                out = self._shard(prog)(x, vocab_start=self.vocab_shard.start, vocab_size=V, **kw)
            names = out.names()
            tokens = np.array(out.token).reshape(-1).tolist()
            processed = np.array(out.logprob).reshape(-1).tolist() if "logprob" in names else [None] * len(rows)
            if want and "raw_logprob" in names and "top_logprobs" in names:
                raw = np.array(out.raw_logprob).reshape(-1).tolist()
                ids, vals = np.array(out.top_logprobs.ids), np.array(out.top_logprobs.values)
            elif want and self.vocab_shard is None:
                raw, ids, vals = model_logprobs(x, tokens)
            else:
                raw, ids, vals = [None] * len(rows), None, None
        except SamplecError as e:
            if len(rows) == 1:
                logging.error("samplec serve: %s", e)
                return [e]
            return [self.draw(prog, x[i:i + 1], [r], [h], [p], want)[0]
                    for i, (r, h, p) in enumerate(zip(rows, hist, positions))]
        return [(tok, processed[i], raw[i], None if ids is None else ids[i], None if vals is None else vals[i])
                for i, tok in enumerate(tokens)]


def history_readers(prog: Program) -> dict[str, tuple[tuple[str, float], ...] | None]:
    """For each `tokens` parameter of `prog`: the (parameter, neutral value) pairs that decide whether any stage
    reads it -- the penalty values of the penalties stages over it: a row whose values are all neutral reads
    nothing of it -- or None where another stage (or a constant penalty that is not neutral) reads it."""
    from samplec.ir.graph import INPUT
    users = prog.stage_graph.users()
    out: dict = {}
    for p in prog.params:
        if p.kind != "tokens":
            continue
        fields: list | None = []
        for u in users.get(id(p.node), []):
            if u.op not in ("penalties", "penalties_overflow") or u.inputs[1] is not p.node:
                fields = None
                break
            for operand, neutral in zip(u.inputs[3:], (1.0, 0.0, 0.0)):    # (repeat, frequency, presence)
                if operand.op == "const" and operand.attr("value") == neutral:
                    continue
                if operand.op == "expand" and operand.inputs[0].op == INPUT:
                    fields.append((operand.inputs[0].name, neutral))
                    continue
                fields = None
                break
            if fields is None:
                break
        out[p.name] = None if fields is None else tuple(dict.fromkeys(fields))
    return out


def model_logprobs(x: mx.array, tokens: list[int]):
    """The model's log-probabilities (for chains without raw_logprob / top_logprobs outputs): the sampled
    tokens' and the TOP largest, descending, lowest id first on ties (`_tops`)."""
    lp = (x - mx.logsumexp(x, axis=-1, keepdims=True)).astype(mx.float32)
    raw = np.array(mx.take_along_axis(lp, mx.array(tokens, dtype=mx.int32)[:, None], axis=1))[:, 0].tolist()
    tops = _tops(lp, TOP)
    return raw, np.stack([i for i, _ in tops]), np.stack([v for _, v in tops])


def _piece(decoder, b: bytes) -> tuple[int, str]:
    """A token's bytes through a choice's incremental UTF-8 decoder: (where its text starts, counted from the
    text before it; the text it adds). Bytes the previous token left pending that this one does not continue
    become their U+FFFD before its text: they belong to the previous token."""
    pending = decoder.getstate()[0]
    early = len(pending.decode("utf-8", "replace")) if pending and b and b[0] & 0xC0 != 0x80 else 0
    return early, decoder.decode(b)


PROMPT_CHUNK = 64            # prompt positions scored per forward pass (echo's log-probabilities)


@dataclass
class Echo:
    """A prompt as `echo` gives it back: its text (the string sent, or its tokens' text), each token's offset in
    it, and with logprobs each token's entry as a sample's (`Row.records`): its log-probability under the model
    given the tokens before it and the most likely tokens there (None for the first token, which has no context)."""
    text: str
    offsets: list[int]
    records: list


def _top(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest of a row, descending, lowest id first on ties (exact: every value tied with the k-th is a
    candidate)."""
    k = min(k, row.size)
    if k == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.float32)
    kth = np.partition(row, row.size - k)[row.size - k]
    cand = np.flatnonzero(row >= kth)
    ids = cand[np.lexsort((cand, -row[cand]))][:k]
    return ids.astype(np.int32), row[ids]


def _tops(lp: mx.array, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row of lp [R, V]: its k largest values and their ids, descending, lowest id first on ties -- a
    partition on the device, the k found sorted on the host; a row with ties at the k-th value (more than k values
    at least as large) is sorted whole on the host (`_top`): exact either way."""
    R, V = lp.shape
    k = min(k, V)
    if k == 0:
        return [(np.zeros(0, np.int32), np.zeros(0, np.float32))] * R
    ids = mx.argpartition(-lp, kth=k - 1, axis=1)[:, :k]
    vals = mx.take_along_axis(lp, ids, axis=1)
    tied = mx.sum(lp >= mx.min(vals, axis=1, keepdims=True), axis=1) > k
    ids, vals, tied = np.array(ids), np.array(vals), np.array(tied)
    out = []
    for r in range(R):
        if tied[r]:
            out.append(_top(np.array(lp[r]), k))
        else:
            order = np.lexsort((ids[r], -vals[r]))
            out.append((ids[r][order].astype(np.int32), vals[r][order]))
    return out


def prompt_logprobs(model, tokens: list[int], top: int, ranked: bool = False):
    """A prompt's entries as a sample's (`Row.records`): each token's log-probability under the model given the
    tokens before it -- log_softmax of its logits, no logit_bias (the model's own distribution of the prompt, as
    vLLM's prompt_logprobs) -- and its `top` most likely tokens there; the first token's entry is (token, None,
    None, None, None). With `ranked`, each token's rank there too (vLLM's: how many tokens are at least as likely,
    itself included; None for the first). A generator: it scores PROMPT_CHUNK positions a forward pass and yields
    after each (the engine runs the batch's steps in between), and returns (the entries, the ranks or None)."""
    from samplec.decode import _make_cache
    cache = _make_cache(model)
    seq = mx.array(tokens, dtype=mx.int32)
    out = [(tokens[0], None, None, None, None)]
    ranks: list | None = [None] if ranked else None
    for lo in range(0, len(tokens) - 1, PROMPT_CHUNK):
        hi = min(len(tokens) - 1, lo + PROMPT_CHUNK)
        x = model(seq[lo:hi][None], cache=cache)[0].astype(mx.float32)       # (predicts tokens lo+1 .. hi)
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        own = mx.take_along_axis(lp, seq[lo + 1:hi + 1, None], axis=1)
        if ranks is not None:
            ranks.extend(np.array(mx.sum(lp >= own, axis=1)).tolist())
        for t, v, (ids, vals) in zip(tokens[lo + 1:hi + 1], np.array(own)[:, 0], _tops(lp, top)):
            out.append((t, None, float(v), ids, vals))
        yield
    return out, ranks


# ---------------------------------------------------------------------------------------------------------------
# the engine: one thread drives mlx-lm's BatchGenerator

class Speculation:
    """A speculatively decoded row's target and draft KV caches (prefilled with all but the last prompt token, as
    `samplec.decode.prefill` does), the sequence so far, what each model reads next, and the row's counts."""

    def __init__(self, model, draft, prompt: list[int]):
        from samplec.decode import _make_cache, _prefill_all_but_last
        self.cache, self.dcache = _make_cache(model), _make_cache(draft)
        seq = mx.array(prompt, dtype=mx.int32)
        _prefill_all_but_last(model, self.cache, seq)
        _prefill_all_but_last(draft, self.dcache, seq)
        self.tokens = list(prompt)          # prompt + emitted: the history of the next position
        self.pending = [prompt[-1]]         # the target's input next round (not yet in its cache)
        self.dpending = [prompt[-1]]        # the draft's (one or two tokens)
        self.target_forwards = self.draft_tokens = self.accepted_tokens = 0

    def advance(self, target: list[int], kk: int, m: int) -> None:
        """After a round that proposed kk tokens and kept m: trim both caches back to the emitted path."""
        from samplec.decode import _trim
        _trim(self.cache, kk - m, "target")
        if kk:
            c = min(m, kk - 1)                  # kept proposals the draft itself has fed forward
            _trim(self.dcache, kk - 1 - c, "draft")
            self.dpending = target[c:m + 1]
        else:
            self.dpending = self.dpending + target[:1]
        self.pending = [target[m]]

    def release(self) -> None:
        self.cache = self.dcache = None

    def usage(self) -> dict:
        return {"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "target_forwards": self.target_forwards}

    def summary(self) -> str:
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
        return (f"{self.accepted_tokens} of {self.draft_tokens} proposals accepted ({rate:.0%}), "
                f"{self.target_forwards} target forward passes")


class Job:
    """One request in flight: its rows and the events the handler thread reads."""

    def __init__(self, req: Request, eos_ids: set[int]):
        self.req = req
        self.eos_ids = eos_ids
        self.events: queue.Queue = queue.Queue()
        self.cancelled = False
        self.rows: list[Row] = []
        self.error: str | None = None
        self.status = 500                  # the HTTP status of an error (503: a rank of a sharded server stopped)
        self.param: str | None = None      # the request field an error names
        self.number = 0                    # its number in admission order (the same on every rank)
        self.scoring = None                # (echo with logprobs, prompt_logprobs) the generator scoring its prompts
        self.prompt_scores: list = []      # (prompt_logprobs) per prompt: (its entries, their ranks)


    def fail(self, e: SamplecError, index: int) -> None:
        """A row's program call raised at run time (a value the request's checks could not foresee, such as a
        penalty that overflows a logit): the request fails -- a 400 naming the field where one of its values is
        at fault, else a 500 -- instead of the row ending silently."""
        if self.error is not None:
            return
        stage = str(e).split(":", 1)[0].strip()
        if stage == "penalties":
            values = self.req.values
            on = [f for f, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                                       ("frequency_penalty", 0.0)) if values.get(f, neutral) != neutral]
            self.param = on[0] if on else None
        elif stage in FIELDS or stage == "logit_bias":
            self.param = stage
        elif stage == "allow":
            # (the chain's mask and bias are the request's constraints: a grammar's tokens, allowed_token_ids,
            # bad_words and min_tokens' bans, logit_bias -- together they left no token to draw; the fields that
            # narrow a grammar are named first, as the ones to change)
            req = self.req
            given = [name for name, on in (("allowed_token_ids", req.allowed is not None),
                                           ("bad_words", bool(req.bad_words)), ("min_tokens", req.min_tokens > 0),
                                           ("logit_bias", bool(req.bias))) if on]
            grammar = getattr(req.grammar, "field", None)
            named = given + ([grammar] if grammar else [])
            if named:
                self.param = named[0]
                e = SamplecError(f"the request's {' and '.join(named)} leave no token to draw ({e})")
        self.status = 400 if self.param is not None else 500
        self.error = f"choice {index}: {e}"
        self.events.put(("error", index, None))


class Engine:
    def __init__(self, model, tokenizer, programs: dict[str, Program], token_bytes, grammars=None,
                 max_batch: int = 32, draft=None, num_draft: int = 4, parse=None, rank_timeout: float | None = None):
        from mlx_lm.generate import BatchGenerator
        from samplec.distributed.follow import RANK_TIMEOUT, Lifeline, StepWatch
        self.model, self.tokenizer = model, tokenizer
        # a model whose LM head is split over the ranks of a group (samplec.distributed.shard_lm_head): rank 0
        # takes the requests and broadcasts each step's plan, every rank runs the same steps (`_plan`)
        self.vocab_shard = getattr(model, "samplec_vocab", None)
        self.group = self.vocab_shard.group if self.vocab_shard is not None else None
        self.leader = self.group is None or self.group.rank() == 0
        # a rank that stops ends every rank within the bound (`_fail`): each step is watched, rank 0 sends a plan
        # at least every HEARTBEAT seconds, and a rank that dies breaks its lifeline (samplec.distributed.follow)
        self.watch = StepWatch(rank_timeout or RANK_TIMEOUT, self._fail) if self.group is not None else None
        self.lifeline = Lifeline(self.group, self._fail) if self.group is not None else None
        self.failure: str | None = None
        self._failing = threading.Lock()
        self.plans = 0                       # plans sent (rank 0) or received so far
        self.admitting: list = []            # (rank 0) the jobs of the plan under way
        self.parse = parse                   # (the other ranks build each admitted request from its body)
        self.jobs = 0                        # requests admitted so far (their number on every rank)
        self.live: dict[int, Job] = {}       # the admitted requests not yet finished, by number
        self.draft, self.num_draft = draft, num_draft
        self.spec: list[Row] = []            # rows decoded speculatively (with the draft), in admission order
        self.spec_waiting: list[Row] = []    # such rows past --max-batch, waiting for a place
        self.scoring: list[Job] = []         # requests whose prompts are being scored, a chunk a step
        self.eos_ids = set(int(t) for t in (getattr(tokenizer, "eos_token_ids", None) or []))
        # (the tokenizer's own end-of-sequence: a choice it ends has no stop_reason, as vLLM's; the model's other
        # end-of-sequence ids -- its generation config's -- are stop token ids there, named in stop_reason)
        primary = getattr(tokenizer, "eos_token_id", None)
        self.primary_eos = int(primary) if isinstance(primary, int) and not isinstance(primary, bool) else None
        # special tokens (a BOS, a chat template's markers) write no text, as vLLM's skip_special_tokens default:
        # their names stay in the logprobs' token strings
        try:
            special = getattr(tokenizer, "all_special_ids", None) or []
        except Exception:  # noqa: BLE001 - a tokenizer without the attribute
            special = []
        self.special_ids = set(int(t) for t in special) - self.eos_ids
        # (a tool-call format's markers write their text in a choice that reads calls, special tokens or not)
        self.tool_markers = set()
        for name in ("tool_call_start_tokens", "tool_call_end_tokens"):
            marker = getattr(tokenizer, name, None)
            if marker is not None and len(marker) == 1:
                self.tool_markers.add(int(marker[0]))
        # (and a reasoning model's think markers in every chat choice: its thinking is told from its answer)
        self.think_markers = reasoning.marker_ids(tokenizer)
        self.sampler = BatchSampler(programs, grammars, self.vocab_shard)
        self.token_bytes = token_bytes
        self.max_batch = max_batch
        # (no stop tokens of the generator's own: each row ends at its own stop ids, `_emit`, so that a request
        # may ignore end-of-sequence)
        self._make = lambda: BatchGenerator(model, sampler=self.sampler, completion_batch_size=max_batch,
                                            prefill_batch_size=min(8, max_batch))
        self.gen = self._make()
        self.inbox: queue.Queue = queue.Queue()
        self.rows: dict[int, Row] = {}
        self.step_seconds = 0.0
        self.steps = 0
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name="samplec-engine", daemon=True)
        self.thread.start()

    def submit(self, req: Request) -> Job:
        if not self.leader:
            raise RuntimeError("samplec serve: only rank 0 takes requests")
        job = self._job(req, req.seeds())
        self.inbox.put(job)
        return job

    def _job(self, req: Request, seeds: list[int]) -> Job:
        job = Job(req, self.eos_ids)
        eos = min(self.eos_ids) if self.eos_ids else 0
        split = any(p.kind == "tokens" and p.name in GENERATED for p in self.sampler.programs[req.chain].params)
        prompts = [p for p in req.prompts for _ in range(req.n)]      # (choice i: prompt i // n)
        job.rows = [Row(job, i, s, eos, p, split) for i, (s, p) in enumerate(zip(seeds, prompts))]
        for r in job.rows:
            r.sampler = self.sampler
            r.vocab_start = self.vocab_shard.start if self.vocab_shard is not None else 0
        return job

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        self.inbox.put(None)

    def stop(self) -> None:
        """End the engine (rank 0 of a sharded model: every rank's, through the last plan)."""
        self.stopped = True
        self.inbox.put(None)
        self.thread.join(30 if self.leader else None)

    @property
    def active(self) -> int:
        return len(self.rows) + len(self.spec) + len(self.scoring)

    def _loop(self):
        from samplec.distributed.follow import HEARTBEAT, rank_failure
        while True:
            if self.leader:
                if self.stopped:
                    break
                try:        # (idle: a plan every HEARTBEAT seconds all the same, which the other ranks wait for)
                    item = self.inbox.get(timeout=HEARTBEAT) if not self.active else self.inbox.get_nowait()
                except queue.Empty:
                    item = None
                items = [item]
                while True:
                    try:
                        items.append(self.inbox.get_nowait())
                    except queue.Empty:
                        break
                admit = [job for job in items if job is not None and not job.cancelled]
                gone = {i for i, job in self.live.items() if job.cancelled}
            if self.group is not None:
                plan = self._plan(admit if self.leader else None, gone if self.leader else None)
                if plan is None:
                    break
                admit, gone = plan
                self.watch.arm(f"step {self.plans}")     # (its forward pass and sampling: collectives too)
            try:
                for job in admit:
                    self.jobs += 1
                    job.number = self.jobs
                    self.live[job.number] = job
                    self._admit(job)
                self._drop_cancelled(gone)
                if self.rows:
                    t0 = time.perf_counter()
                    _, responses = self.gen.next()
                    self.step_seconds += time.perf_counter() - t0
                    self.steps += 1
                    for r in responses:
                        self._deliver(r)
                self._start_waiting()
                for row in list(self.spec):       # (one round each, in turn with the batch's steps)
                    self._speculate(row)
                self._score()
                self.live = {i: job for i, job in self.live.items() if any(r.finish is None for r in job.rows)}
                if self.watch is not None:
                    self.watch.disarm()
            except Exception as e:  # noqa: BLE001 - the engine must outlive any one batch's failure
                if self.group is not None and rank_failure(e):      # (the group is gone: so is every rank)
                    self._fail(f"{rank_failure(e)}, during step {self.plans}")
                if self.watch is not None:
                    self.watch.disarm()
                logging.exception("samplec serve: the batch failed")
                for row in [*self.rows.values(), *self.spec, *self.spec_waiting]:
                    row.job.error = f"generation failed: {type(e).__name__}: {e}"
                    row.job.events.put(("error", row.index, None))
                for job in self.scoring:
                    job.error = f"generation failed: {type(e).__name__}: {e}"
                    job.events.put(("error", 0, None))
                self.rows.clear()
                self.spec.clear()
                self.spec_waiting.clear()
                self.scoring.clear()
                self.sampler.rows = []
                self.live.clear()
                self.gen = self._make()
        if self.group is not None and self.leader:
            self._plan(None, None, end=True)

    def _plan(self, admit: list | None, gone: set | None, end: bool = False):
        """Rank 0: broadcast this step's plan -- the requests to admit (body and seeds), the numbers of those to
        drop, or the end. The other ranks: receive it and build the same jobs. (admit, gone), or None at the
        end. The exchange is watched (the first waits for every rank to load the model); a plan that fails ends
        the rank."""
        from samplec.distributed.follow import START_TIMEOUT, rank_failure, receive_plan, send_plan
        self.plans += 1
        what = f"plan {self.plans}" if self.leader else f"the wait for rank 0's plan {self.plans}"
        self.watch.arm(what, START_TIMEOUT if self.plans == 1 else None)
        try:
            if self.leader:
                self.admitting = list(admit or ())
                plan = {"end": end, "gone": sorted(gone or ()),
                        "admit": [{"kind": j.req.kind, "body": j.req.body, "seeds": [str(r.seed) for r in j.rows]}
                                  for j in admit or ()]}
                if self.plans == 1:
                    plan["lifeline"] = self.lifeline.port
                if end:
                    self.lifeline.end()
                send_plan(plan, self.group, self.plans)
                self.admitting = []
                self.watch.disarm()
                return None if end else (admit, gone)
            plan = receive_plan(self.group, self.plans)
            self.watch.disarm()
            if self.plans == 1:
                self.lifeline.join(plan.get("lifeline"))
            if plan["end"]:
                return None
            jobs = []
            for a in plan["admit"]:
                req = self.parse(a["kind"], a["body"])        # (checked by rank 0 already: the same request here)
                jobs.append(self._job(req, [int(x) for x in a["seeds"]]))
            return jobs, set(plan["gone"])
        except Exception as e:  # noqa: BLE001 - every rank must take every plan: past one, the ranks part ways
            self._fail(f"{rank_failure(e) or f'{type(e).__name__}: {e}'}, during {what}")

    def _terminated(self) -> None:
        """SIGTERM on a rank of a sharded server (mlx.launch sends it to the other ranks once one exits): end as
        `_fail` does, after giving the engine two heartbeats to find the cause itself (a rank that died breaks
        the next collective at once)."""
        from samplec.distributed.follow import HEARTBEAT
        end = time.monotonic() + 2 * HEARTBEAT
        while self.failure is None and time.monotonic() < end:
            time.sleep(0.05)
        self._fail("ended by SIGTERM (mlx.launch sends it to every rank once one exits)")

    def _fail(self, cause: str) -> None:
        """A rank stopped, stopped answering, or fell out of step: end this rank (the others end the same way, on
        their own connection errors or deadlines). Rank 0 first answers every request in flight with a 503 naming
        the cause. One line on stderr, then exit status EXIT_STATUS; never returns. (The engine thread, the step
        watch and SIGTERM may each get here: the first ends the process, the others wait for it.)"""
        import sys
        from samplec.distributed.follow import EXIT_STATUS
        with self._failing:
            first = self.failure is None
            if first:
                self.failure = cause
        if not first:
            threading.Event().wait()
        where = f"rank {self.group.rank()} of {self.group.size()}"
        sys.stderr.write(f"samplec serve: {where}: {cause}; exiting with status {EXIT_STATUS}\n")
        sys.stderr.flush()
        if self.leader:
            jobs = [*self.live.values(), *self.admitting]
            while True:
                try:
                    jobs.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            failed = [j for j in dict.fromkeys(jobs)
                      if j is not None and not j.cancelled and any(r.finish is None for r in j.rows)]
            for job in failed:
                job.error = f"samplec serve: {where} ended: {cause}"
                job.status = 503
                job.events.put(("error", 0, None))
            end = time.monotonic() + 2.0      # (each handler thread writes its 503; a bounded wait)
            while time.monotonic() < end and any(not j.events.empty() for j in failed):
                time.sleep(0.02)
            time.sleep(0.2 if failed else 0)
        os._exit(EXIT_STATUS)

    def _admit(self, job: Job):
        req = job.req
        echoes = None
        if req.echo:
            echoes = [self._echo_text(tokens, given, req.skip_special)
                      for tokens, given in zip(req.prompts, req.prompt_texts)]
            for r in job.rows:
                r.echo = echoes[r.index // req.n]
        # (echo with logprobs, prompt_logprobs -- not sent in a stream, as vLLM's: scored a chunk at a time between
        # the batch's steps, `_score`)
        if req.echo and req.logprobs or req.prompt_logprobs is not None and not req.stream:
            job.scoring = self._scoring(job, echoes if req.echo and req.logprobs else None)
            self.scoring.append(job)
            return
        if req.echo:
            job.events.put(("echo", 0, None))
        self._start(job)

    def _scoring(self, job: Job, echoes: list | None):
        """Score each prompt once (`prompt_logprobs`), a chunk a step, for echo's logprobs and vLLM's
        prompt_logprobs both: the most likely tokens the larger of the two asks for."""
        req = job.req
        ranked = req.prompt_logprobs is not None
        top = max(req.top_logprobs if echoes is not None else 0, req.prompt_logprobs or 0)
        for i, tokens in enumerate(req.prompts):
            records, ranks = yield from prompt_logprobs(self.model, tokens, top, ranked)
            if echoes is not None:
                echoes[i].records = records
            if ranked:
                job.prompt_scores.append((records, ranks))

    def _score(self) -> None:
        """One chunk of the first request being scored (echo, prompt_logprobs); a request scored whole starts
        decoding."""
        if not self.scoring:
            return
        job = self.scoring[0]
        try:
            next(job.scoring)
            return
        except StopIteration:
            self.scoring.pop(0)
        except Exception as e:  # noqa: BLE001 - the prompt's forward pass failed: this request fails, alone
            self.scoring.pop(0)
            logging.exception("samplec serve: the prompt's log-probabilities failed")
            name = "echo" if job.req.echo else "prompt_logprobs"
            job.error = f"{name}: the prompt's log-probabilities failed: {type(e).__name__}: {e}"
            for r in job.rows:
                r.finish = "error"
            job.events.put(("error", 0, None))
            return
        if job.req.echo:
            job.events.put(("echo", 0, None))
        self._start(job)

    def _start(self, job: Job) -> None:
        """Its rows begin decoding (or, with max_tokens 0, end at once)."""
        req = job.req
        if req.max_tokens == 0:             # (echo alone: every choice is its prompt)
            for r in job.rows:
                r.finish = "length"
                job.events.put(("done", r.index, None))
            return
        if self.draft is not None and req.grammar is None:
            self.spec_waiting.extend(job.rows)
            return
        k = len(job.rows)
        uids = self.gen.insert([list(r.prompt) for r in job.rows], max_tokens=[r.max_tokens for r in job.rows],
                               samplers=[self.sampler] * k, logits_processors=[[r.process] for r in job.rows])
        for r, uid in zip(job.rows, uids):
            r.uid = uid
            self.rows[uid] = r

    def _echo_text(self, tokens: list[int], given: str | None, skip_special: bool = True) -> Echo:
        """A prompt's text as echo gives it back, and its tokens' offsets in it: the string sent where its tokens
        write it back (special tokens written or not: a beginning-of-sequence the tokenizer added writes nothing,
        a `<s>` typed in the string writes itself), else -- token ids, or a tokenizer that does not give the
        string back (SentencePiece's leading space) -- the tokens' text, as a completion's (`_emit`: special
        tokens write theirs with `skip_special_tokens: false`)."""
        for specials in ((False, True) if skip_special else (True, False)):
            text, offsets = self._decode(tokens, specials)
            if given is None or text == given:
                return Echo(text, offsets, [])
        return Echo(*self._decode(tokens, not skip_special), [])

    def _decode(self, tokens: list[int], specials: bool = False) -> tuple[str, list[int]]:
        """Tokens' text and each token's offset in it, by the rules of a choice's text (`_emit`): special tokens
        write none (`specials`: their own text), bytes that are not whole UTF-8 write U+FFFD."""
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        text, offsets = "", []
        quiet = set() if specials else self.special_ids | self.eos_ids
        for t in tokens:
            b = b"" if t in quiet else self.token_bytes(t)
            early, piece = _piece(dec, b)
            offsets.append(len(text) + early)
            text += piece
        return text + dec.decode(b"", final=True), offsets

    def _drop_cancelled(self, numbers: set[int]):
        """Drop the rows of the requests whose clients went away (by number: what rank 0 decided)."""
        if not numbers:
            return
        gone = [uid for uid, r in self.rows.items() if r.job.number in numbers]
        if gone:
            self.gen.remove(gone)
            for uid in gone:
                del self.rows[uid]
        self.spec = [r for r in self.spec if r.job.number not in numbers]
        self.scoring = [j for j in self.scoring if j.number not in numbers]
        self.spec_waiting = [r for r in self.spec_waiting if r.job.number not in numbers]
        for n in numbers:
            self.live.pop(n, None)

    def _finish(self, row: Row, reason: str, in_batch: bool):
        row.finish = reason
        if row.spec is not None:
            self.spec.remove(row)
            row.spec.release()
            logging.info("samplec serve: choice %d, speculative: %s", row.index, row.spec.summary())
        elif in_batch:
            self.gen.remove([row.uid])
        self.rows.pop(row.uid, None)
        row.job.events.put(("done", row.index, None))

    def _deliver(self, resp):
        row = self.rows.get(resp.uid)
        if row is None:
            return
        self._emit(row, int(resp.token), resp.finish_reason)

    def _emit(self, row: Row, token: int, ended: str | None) -> bool:
        """Hand the row its next token; `ended`: the generator's finish reason with it ("length", "stop"; None: the
        row goes on). Whether the row finished."""
        row.delivered += 1
        req = row.job.req
        # (special tokens -- an end-of-sequence a request ignores too -- write no text, as vLLM's
        # skip_special_tokens default; with it false, their own text)
        quiet = req.skip_special and (token in self.special_ids or token in self.eos_ids) and not (
            req.tools is not None and req.tools.choice == "auto" and token in self.tool_markers
            or req.kind == "chat" and token in self.think_markers)
        if token in row.stop_ids or row.failed:     # (end-of-sequence, one of the request's stop_token_ids)
            # (its text only with include_stop_str_in_output, as vLLM's)
            b = self.token_bytes(token) if req.include_stop and not quiet and not row.failed else b""
            early, piece = _piece(row.decoder, b)
            before = len(row.text)
            row.text += piece + row.decoder.decode(b"", final=True)   # (an unfinished character's bytes: U+FFFD)
            row.offsets.append(before + early if b else len(row.text))
            row.stop_token = not b                               # (an entry of no text of its own)
            if not row.failed:
                row.stop_reason = None if token == self.primary_eos and not req.ignore_eos else token
            self._finish(row, "stop", ended is None)
            return True
        b = b"" if quiet else self.token_bytes(token)
        early, piece = _piece(row.decoder, b)
        before = len(row.text)
        text = row.text + piece
        stop = req.stop
        # (the text changes in one assignment, cut before a stop string that came -- after it with
        # include_stop_str_in_output: a handler thread streaming it meanwhile never reads a character past the cut)
        hits = []
        if stop and row.delivered > req.min_tokens:
            # (each stop string where it ends in the text this token added -- it may begin before, and a pending
            # byte's U+FFFD, added now, may begin it; none before the choice has more than min_tokens tokens, as
            # vLLM's detokenizer: one that ends in the first min_tokens tokens' text does not stop it)
            hits = [(i, k) for k, i in enumerate(text.find(s, max(0, before - len(s) + 1)) for s in stop) if i >= 0]
        row.offsets.append(before + early)
        if hits:
            # (several found at once: the first of the request's list wins, wherever it lies in the text -- vLLM's
            # stop checker goes through the list in order)
            i, k = hits[0]
            text = text[:i + len(stop[k]) if req.include_stop else i]
        row.text = text
        if hits:
            row.cut = True
            row.stop_reason = stop[k]
            self._finish(row, "stop", ended is None)
            return True
        if row.grammar_error is not None and not row.grammar_logged:
            logging.error("samplec serve: grammar: %s", row.grammar_error)
            row.grammar_logged = True
        if ended is not None:
            row.text += row.decoder.decode(b"", final=True)
            self._finish(row, "length" if ended == "length" else "stop", False)
            return True
        row.job.events.put(("token", row.index, None))
        return False

    # -- speculative decoding (--draft-model): each such row has its own target and draft KV caches

    def _start_waiting(self):
        """Prefill the waiting speculative rows while there is room (--max-batch rows at once)."""
        while self.spec_waiting and len(self.spec) < self.max_batch:
            row = self.spec_waiting.pop(0)
            row.spec = Speculation(self.model, self.draft, row.prompt)
            self.spec.append(row)

    def _speculate(self, row: Row):
        """One round for one row: the draft proposes up to --num-draft tokens, drawn by the row's chain on the
        draft's logits (biased as the target's) at the row's seed, next positions and history; the target scores
        the pending token and the proposals in one forward pass; the chain runs once over those rows, row j at
        position step + j with the history extended by the first j proposals; proposals are kept while they equal
        the target's draw, and the target's draw at the first disagreement comes too. Each emitted token is the
        chain's draw from the target's logits at plain decoding's position and history: the token the batch
        would give the row (docs/serve.md, Speculative decoding)."""
        sp, req = row.spec, row.job.req
        prog = self.sampler.programs[row.chain]
        kk = min(self.num_draft, row.max_tokens - row.delivered - 1)
        drafts: list[int] = []
        inp = sp.dpending
        for j in range(kk):
            dl = self.draft(mx.array(inp, dtype=mx.int32)[None], cache=sp.dcache)[:, -1, :]
            d = self.sampler.draw(prog, add_bias(dl, [row]), [row], [row.history(sp.tokens + drafts, row.step + j)],
                                  [row.step + j], False)[0]
            drafts.append(row.eos if isinstance(d, SamplecError) else int(d[0]))
            inp = drafts[-1:]
        logits = self.model(mx.array(sp.pending + drafts, dtype=mx.int32)[None], cache=sp.cache)[0]
        rows = kk + 1
        x = add_bias(logits[:rows], [row] * rows)
        draws = self.sampler.draw(prog, x, [row] * rows, [row.history(sp.tokens + drafts[:j], row.step + j)
                                                            for j in range(rows)],
                                  [row.step + j for j in range(rows)], req.logprobs)
        target = [row.eos if isinstance(d, SamplecError) else int(d[0]) for d in draws]
        m = 0
        while m < kk and target[m] == drafts[m]:
            m += 1
        sp.target_forwards += 1
        sp.draft_tokens += kk
        sp.accepted_tokens += m
        for j in range(m + 1):
            tok = row.record(draws[j])
            sp.tokens.append(tok)
            ended = "length" if row.delivered + 1 >= row.max_tokens else None
            if self._emit(row, tok, ended):
                return
        sp.advance(target, kk, m)


# ---------------------------------------------------------------------------------------------------------------
# answers

class Formatter:
    """OpenAI's response shapes from finished (or streaming) rows."""

    def __init__(self, token_bytes):
        self.token_bytes = token_bytes

    def token_text(self, t: int, as_ids: bool = False) -> tuple[str, list[int]]:
        """A token as a logprobs entry writes it: (its text, its bytes); with `as_ids` (vLLM's
        return_tokens_as_token_ids) "token_id:N" and that string's bytes, as vLLM writes them."""
        if as_ids:
            s = f"token_id:{int(t)}"
            return s, list(s.encode())
        b = self.token_bytes(int(t))
        try:
            return b.decode("utf-8"), list(b)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{c:02x}" for c in b), list(b)

    def kept(self, row: Row, upto: int, stop_entry: bool) -> int:
        """How many delivered tokens have an entry: where a stop string cut the text, those starting before `upto`;
        a stop token (end-of-sequence, a stop_token_ids id: no text of its own) only with `stop_entry` -- the
        completions endpoint lists it, as vLLM's (lm-eval-harness reads a request's one generated entry), chat's
        entries are the message's tokens."""
        if row.cut:
            return sum(1 for o in row.offsets if o < upto)
        return len(row.offsets) - (1 if row.stop_token and not stop_entry else 0)

    def chat_entries(self, row: Row, lo: int, hi: int, top: int, as_ids: bool = False) -> list[dict]:
        """Chat's `logprobs.content` entries for the row's tokens lo..hi-1 (`as_ids`: tokens written as ids)."""
        out = []
        for tok, processed, raw, ids, vals in row.records[lo:hi]:
            alternatives = []
            for i, v in zip(ids[:top], vals[:top]) if ids is not None else ():
                t, b = self.token_text(i, as_ids)
                alternatives.append({"token": t, "logprob": float(v), "bytes": b})
            text, b = self.token_text(tok, as_ids)
            out.append({"token": text, "logprob": raw, "bytes": b, "top_logprobs": alternatives,
                        "processed_logprob": processed})
        return out

    def legacy(self, row: Row, lo: int, hi: int, top: int, as_ids: bool = False) -> dict:
        """The completions endpoint's logprobs (tokens, token_logprobs, top_logprobs as dicts, text_offset) of the
        row's samples lo..hi-1 (with echo, their offsets count from the start of the prompt's text)."""
        shift = len(row.echo.text) if row.echo is not None else 0
        return self._legacy(row.records[lo:hi], [o + shift for o in row.offsets[lo:hi]], top, as_ids)

    def echoed(self, row: Row, top: int, as_ids: bool = False) -> dict:
        """The legacy logprobs of the row's prompt (echo)."""
        return self._legacy(row.echo.records, row.echo.offsets, top, as_ids)

    def _legacy(self, recs: list, offsets: list[int], top: int, as_ids: bool) -> dict:
        tops = []
        for tok, _, raw, ids, vals in recs:
            d = {}
            if ids is not None:
                for i, v in zip(ids[:top], vals[:top]):
                    d.setdefault(self.token_text(i, as_ids)[0], float(v))
            if raw is not None:     # (as OpenAI's: the sampled token too, so up to top + 1 entries -- logprobs 0: 1)
                d.setdefault(self.token_text(tok, as_ids)[0], raw)
                d = dict(sorted(d.items(), key=lambda kv: -kv[1]))
            tops.append(d if raw is not None or ids is not None else None)   # (a prompt's first token: null)
        return {"tokens": [self.token_text(r[0], as_ids)[0] for r in recs],
                "token_logprobs": [r[2] for r in recs],
                "top_logprobs": tops,
                "text_offset": offsets,
                "processed_logprobs": [r[1] for r in recs]}

    def prompt_entries(self, records: list, ranks: list, n: int) -> list:
        """vLLM's prompt_logprobs of one prompt: per token, null for the first, else {token id: {"logprob", "rank",
        "decoded_token"}} holding the prompt's token (its rank: `prompt_logprobs`' ranks) and then the n most
        likely tokens there (ranks 1 .. n; the prompt's token among them takes its place there, first in the
        object), as vLLM's logprobs processor builds it; -inf is written -9999.0, as vLLM's chat endpoint clamps it
        (valid JSON)."""
        out: list = [None]
        for (tok, _, raw, ids, vals), rank in zip(records[1:], ranks[1:]):
            d = {str(tok): {"logprob": _finite(raw), "rank": int(rank), "decoded_token": self.token_text(tok)[0]}}
            for k, (i, v) in enumerate(zip(ids[:n], vals[:n])):
                d[str(int(i))] = {"logprob": _finite(float(v)), "rank": k + 1,
                                  "decoded_token": self.token_text(i)[0]}
            out.append(d)
        return out


def _finite(v: float) -> float:
    return -9999.0 if v == -math.inf else v


def _id_offsets(lp: dict, start: int) -> dict:
    """Legacy logprobs whose tokens are written `token_id:N` (return_tokens_as_token_ids) with vLLM's text_offset:
    from `start`, each entry's offset adds the length of the token string before it (not an offset in the text)."""
    offsets, at = [], start
    for t in lp["tokens"]:
        offsets.append(at)
        at += len(t)
    return {**lp, "text_offset": offsets}


def _joined(a: dict, b: dict) -> dict:
    """Two legacy logprobs, one after the other."""
    return {k: a[k] + b[k] for k in a}


# ---------------------------------------------------------------------------------------------------------------
# HTTP

# stored Responses kept by default (--responses-store): each holds its Response and its conversation's messages
RESPONSES_STORE = 1000


class Server:
    """The model, its tokenizer, the engine and the request parser: what each handler thread reads."""

    def __init__(self, model, tokenizer, programs, model_id: str, max_batch: int = 32, draft=None,
                 num_draft: int = 4, rank_timeout: float | None = None, responses_store: int = RESPONSES_STORE):
        self.model_id = model_id
        self.responses = responses.Store(responses_store)     # (stored Responses: previous_response_id, GET)
        self.created = int(time.time())
        self.tokenizer = tokenizer
        shard = getattr(model, "samplec_vocab", None)       # an LM head split over ranks (shard_lm_head)
        vocab = _vocab_size(model, tokenizer) if shard is None else shard.vocab
        self.vocab = vocab
        if draft is not None:
            if shard is not None:
                raise SamplecError("--draft-model: not with an LM head split over ranks (a vocabulary-sharded "
                                   "server decodes without a draft)")
            check_draft(model, draft, vocab)
        self.grammars, off = None, ""
        try:
            from samplec.structured import Tokenizer
            self.grammars = Tokenizer.of(tokenizer, vocab)
        except SamplecError as e:
            off = str(e)
            logging.warning("samplec serve: structured outputs off: %s", e)
        if self.grammars is not None:
            token_bytes = self.grammars.token_bytes
        else:
            cache: dict[int, bytes] = {}

            def token_bytes(t: int) -> bytes:
                if t not in cache:
                    cache[t] = tokenizer.decode([t]).encode("utf-8")
                return cache[t]
        self.token_bytes = token_bytes
        self.programs = programs
        self.parse = Parser(tokenizer, vocab, programs, model_id, self.grammars, off)
        # the model's context length where its config gives one (a request past it is a 400, as OpenAI's and vLLM's)
        limit = getattr(getattr(model, "args", None), "max_position_embeddings", None)
        self.parse.context = limit if isinstance(limit, int) and limit > 0 else None
        self.parse.speculative = draft is not None
        self.parse.sharded = shard is not None
        self.format = Formatter(token_bytes)
        self.engine = Engine(model, tokenizer, programs, token_bytes, self.grammars, max_batch, draft, num_draft,
                             parse=self.parse, rank_timeout=rank_timeout)

    @property
    def sampler(self) -> BatchSampler:
        return self.engine.sampler

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "samplec"}


def check_draft(model, draft, vocab: int) -> None:
    """A draft model must give logits over the target's vocabulary, and both KV caches must be trimmable (each
    round trims them back to the emitted path)."""
    from samplec.decode import _check_trimmable, _make_cache
    width = _vocab_size(draft, None)
    if width != vocab:
        raise SamplecError(f"--draft-model: its vocabulary has {width} entries, the target's {vocab}; a draft "
                           "must share the target's token ids")
    for which, m in (("target", model), ("draft", draft)):
        _check_trimmable(_make_cache(m), which)


def _vocab_size(model, tokenizer) -> int:
    """The model's vocabulary (its logits' width): one forward pass of a single token."""
    from mlx_lm.models.cache import make_prompt_cache
    logits = model(mx.array([[0]], dtype=mx.int32), cache=make_prompt_cache(model))
    return int(logits.shape[-1])


class Handler(BaseHTTPRequestHandler):
    server_version = "samplec"
    protocol_version = "HTTP/1.1"
    # (a connection silent this long -- a body that stops coming, an idle keep-alive -- is closed: its thread
    # does not wait forever; a request generating does not read the connection meanwhile)
    timeout = 120.0
    app: Server = None              # set on the subclass made for each server

    def log_message(self, fmt, *args):   # (quiet: one line per request is noise for a benchmark)
        logging.debug("%s - " + fmt, self.address_string(), *args)

    # -- plumbing
    def _send(self, status: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: BadRequest):
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        self._send(e.status, {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}})

    def send_error(self, code, message=None, explain=None):
        """The standard library's own refusals (a method no endpoint serves, a malformed request line, a header
        too long) in OpenAI's error shape, as every other answer -- not its HTML page; the connection closes."""
        code = int(code)
        message = message or self.responses.get(code, ("error",))[0]
        kind = "invalid_request_error" if code < 500 else "server_error"
        data = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
        self.log_error("code %d, message %s", code, message)
        self.send_response(code, message)
        self.send_header("Connection", "close")
        self.close_connection = True
        if code >= 200 and code not in (204, 205, 304) and self.command != "HEAD":
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self.end_headers()

    def do_GET(self):
        path = self.path.split("?")[0].rstrip("/")
        if path in ("/v1/models", "/models"):
            return self._send(200, self.app.models())
        if path.startswith("/v1/models/"):
            name = path[len("/v1/models/"):]
            if name == self.app.model_id:
                return self._send(200, self.app.model_card())
            return self._error(BadRequest(f"model '{name}' is not served here", "model", 404, "model_not_found"))
        if path in ("/health", "/v1/health"):
            return self._send(200, {"status": "ok", "active_rows": self.app.engine.active})
        rid = self._response_id(path)
        if rid is not None:         # (OpenAI's retrieve: a stored Response)
            item = self.app.responses.get(rid)
            if item is None:
                return self._error(self._no_response(rid))
            return self._send(200, item[0])
        return self._error(BadRequest(f"no such endpoint: GET {path}", None, 404))

    def do_DELETE(self):
        """OpenAI's delete of a stored Response: `{"id", "object": "response.deleted", "deleted": true}`."""
        path = self.path.split("?")[0].rstrip("/")
        if self.headers.get("Content-Length") or self.headers.get("Transfer-Encoding"):
            try:
                self._read_body()       # (a body is not read, but taken off the connection)
            except (BadRequest, OSError) as e:
                self.close_connection = True
                return self._error(e if isinstance(e, BadRequest) else BadRequest("the request body did not "
                                                                                  "arrive in time", None, 408))
        rid = self._response_id(path)
        if rid is None:
            return self._error(BadRequest(f"no such endpoint: DELETE {path}", None, 404))
        if not self.app.responses.delete(rid):
            return self._error(self._no_response(rid))
        return self._send(200, {"id": rid, "object": "response.deleted", "deleted": True})

    @staticmethod
    def _response_id(path: str) -> str | None:
        """The id of `/v1/responses/{id}` (also without `/v1`)."""
        for head in ("/v1/responses/", "/responses/"):
            if path.startswith(head) and "/" not in path[len(head):] and path[len(head):]:
                return path[len(head):]
        return None

    @staticmethod
    def _no_response(rid: str) -> BadRequest:
        return BadRequest(f"Response with id '{rid}' not found.", None, 404, "not_found")

    def _read_body(self) -> bytes:
        """The request body: Content-Length bytes, or the chunks of `Transfer-Encoding: chunked` (HTTP/1.1)."""
        if self.headers.get("Transfer-Encoding", "").strip().lower() == "chunked":
            parts, total = [], 0
            while True:
                line = self.rfile.readline(1024)
                try:
                    size = int(line.split(b";")[0].strip(), 16)
                except ValueError:
                    raise BadRequest("a malformed chunk in the request body (Transfer-Encoding: chunked)") from None
                if size < 0 or total + size > MAX_BODY:
                    raise BadRequest(f"the request body holds more than {MAX_BODY} bytes, the limit")
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):     # (trailers)
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                total += size
                if self.rfile.readline(1024) not in (b"\r\n", b"\n"):
                    raise BadRequest("a malformed chunk in the request body (Transfer-Encoding: chunked)")
        try:
            length = int(self.headers.get("Content-Length") or -1)
        except ValueError:
            length = -1
        if length < 0:
            raise BadRequest("the request needs a Content-Length (or Transfer-Encoding: chunked)")
        if length > MAX_BODY:
            raise BadRequest(f"the request body holds {length} bytes; the limit is {MAX_BODY}")
        return self.rfile.read(length)

    def do_POST(self):
        path = self.path.split("?")[0].rstrip("/")
        kind = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/completions": "completion",
                "/completions": "completion", "/v1/responses": "responses", "/responses": "responses"}.get(path)
        try:
            raw = self._read_body()
        except BadRequest as e:
            self.close_connection = True
            return self._error(e)
        except (TimeoutError, OSError):     # (the body stopped coming: 408, and the connection closes)
            self.close_connection = True
            try:
                return self._error(BadRequest("the request body did not arrive in time", None, 408))
            except OSError:
                return None
        tool = {"/tokenize": "tokenize", "/v1/tokenize": "tokenize", "/detokenize": "detokenize",
                "/v1/detokenize": "detokenize"}.get(path)
        if tool is not None:        # (vLLM's)
            try:
                try:
                    body = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, ValueError, RecursionError) as e:
                    raise BadRequest(f"the request body is not UTF-8 JSON ({type(e).__name__})") from None
                return self._send(200, getattr(self.app.parse, tool)(body))
            except BadRequest as e:
                return self._error(e)
            except Exception as e:  # noqa: BLE001 - a body no check foresaw: answered, never a dropped connection
                logging.exception("samplec serve: a %s request the parser could not read", tool)
                return self._error(BadRequest(f"the request could not be read ({type(e).__name__}: {e})"[:300]))
        if kind is None:
            return self._error(BadRequest(f"no such endpoint: POST {path}", None, 404))
        try:
            try:
                body = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                raise BadRequest(f"the request body is not UTF-8 JSON ({type(e).__name__}: {e})"[:300]) from None
            except RecursionError:
                raise BadRequest("the request body is JSON nested too deeply to read") from None
            answer = None
            if kind == "responses":     # (the chat request it amounts to; errors name the Responses fields)
                origins = []
                try:
                    chat = responses.to_chat(body, origins, self.app.responses)
                    answer = responses.Answer(body, chat, self.app.model_id, self.app.responses)
                    answer.origins = origins
                    req = self.app.parse("chat", chat)
                except responses.RequestError as e:
                    raise BadRequest(str(e), e.field, e.status, e.code) from None
                except BadRequest as e:
                    name = responses.field_name(e.param, origins)
                    if name != e.param:
                        raise BadRequest(str(e).replace(e.param, name), name, e.status, e.code) from None
                    raise
            else:
                req = self.app.parse(kind, body)
        except BadRequest as e:
            return self._error(e)
        except Exception as e:  # noqa: BLE001 - a body no check foresaw: answered, never a dropped connection
            logging.exception("samplec serve: a request the parser could not read")
            return self._error(BadRequest(f"the request could not be read ({type(e).__name__}: {e})"[:300]))
        job = self.app.engine.submit(req)
        try:
            if answer is not None:
                self._respond_stream(job, answer) if req.stream else self._respond(job, answer)
            elif req.stream:
                self._stream(job)
            else:
                self._complete(job)
        except (BrokenPipeError, ConnectionResetError, TimeoutError, OSError):
            self.close_connection = True
        finally:
            if any(r.finish is None for r in job.rows):
                self.app.engine.cancel(job)

    def _wait(self, job: Job, watch: bool = False):
        """The next event of the job (raises if the engine is gone). `watch`: a client that closes its connection
        meanwhile raises ConnectionResetError (the caller cancels the job: a non-streaming request whose client
        timed out or gave up frees its rows, as a stream's does at its next write)."""
        while True:
            if watch and time.monotonic() >= self._next_look:      # (a look at the socket 4 times a second)
                self._next_look = time.monotonic() + 0.25
                if self._client_gone():
                    raise ConnectionResetError("the client closed the connection")
            try:
                return job.events.get(timeout=0.25 if watch else 1.0)
            except queue.Empty:
                if not self.app.engine.thread.is_alive():
                    raise BadRequest("the generation engine stopped", None, 500)

    _next_look = 0.0

    def _client_gone(self) -> bool:
        """Whether the peer has closed the connection: readable with nothing to read (a request a client sent
        after this one is data: still there)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):
            return True

    def _head(self, req: Request) -> dict:
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "chat.completion" if req.kind == "chat"
                else "text_completion", "created": int(time.time()), "model": req.model,
                "system_fingerprint": _FINGERPRINT}

    def _usage(self, job: Job) -> dict:
        done = sum(r.delivered for r in job.rows)
        prompt = sum(len(p) for p in job.req.prompts)
        usage = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        spec = [r.spec for r in job.rows if r.spec is not None]
        if spec:        # (decoded with the draft model: its proposals and how many the target kept)
            total = {k: sum(s.usage()[k] for s in spec) for k in spec[0].usage()}
            total["acceptance"] = total["accepted_tokens"] / total["draft_tokens"] if total["draft_tokens"] else None
            usage["samplec_speculative"] = total
        return usage

    def _complete(self, job: Job):
        req = job.req
        left = len(job.rows)
        while left:
            ev, _, _ = self._wait(job, watch=True)
            if ev == "error":
                return self._error(BadRequest(job.error or "generation failed", job.param, job.status))
            if ev == "done":
                left -= 1
        fmt, choices = self.app.format, []
        prompts = None if req.prompt_logprobs is None else \
            [fmt.prompt_entries(records, ranks, req.prompt_logprobs) for records, ranks in job.prompt_scores]
        for r in job.rows:
            n = fmt.kept(r, len(r.text), req.kind == "completion")
            if req.kind == "chat":
                message, finish = Reply(req, self.app.tokenizer, r.prompt).message(r.text, r.finish)
                if req.echo_message:
                    message["content"] = req.echo_message + (message.get("content") or "")
                c = {"index": r.index, "message": {"role": req.role, **message},
                     "logprobs": {"content": fmt.chat_entries(r, 0, n, req.top_logprobs, req.token_ids)}
                     if req.logprobs
                     else None, "finish_reason": finish, "stop_reason": r.stop_reason}
            else:
                lp = fmt.legacy(r, 0, n, req.top_logprobs, req.token_ids) if req.logprobs else None
                if r.echo is not None and lp is not None:
                    lp = _joined(fmt.echoed(r, req.top_logprobs, req.token_ids), lp)
                if lp is not None and req.token_ids:
                    lp = _id_offsets(lp, 0)
                c = {"index": r.index, "text": (r.echo.text if r.echo is not None else "") + r.text,
                     "logprobs": lp, "finish_reason": r.finish, "stop_reason": r.stop_reason}
                if prompts is not None:     # (vLLM's: on each choice of the completions endpoint)
                    c["prompt_logprobs"] = prompts[r.index // req.n]
            choices.append(c)
        answer = {**self._head(req), "choices": choices, "usage": self._usage(job)}
        if prompts is not None and req.kind == "chat":      # (vLLM's: on the chat answer itself)
            answer["prompt_logprobs"] = prompts[0]
        self._send(200, answer)

    def _events_head(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _pieces(self, job: Job):
        """A streamed job's pieces as the rows grow: ("echo", None, ...) once the prompts are scored; per row
        ("piece", row, text added, first entry, entries so far, final) -- the text a chunk may send (the characters
        that could begin a stop string held back; with include_stop_str_in_output none: the text is cut after the
        stop string, never before a character already sent) and the range of its logprobs entries; ("error", ...)
        when the job failed (its last)."""
        req, fmt = job.req, self.app.format
        hold = 0 if req.include_stop else max((len(s) for s in req.stop), default=1) - 1
        left = len(job.rows)
        while left:
            ev, i, _ = self._wait(job, watch=True)     # (a client that leaves before a chunk is due: noticed)
            if ev == "error":
                yield "error", None, "", 0, 0, True
                return
            if ev == "echo":        # (each choice's first chunk: its prompt)
                yield "echo", None, "", 0, 0, False
                continue
            r = job.rows[i]
            final = ev == "done"
            upto = len(r.text) if final else max(r.emitted, len(r.text) - hold)
            n = fmt.kept(r, upto, req.kind == "completion") if final else sum(1 for o in r.offsets if o < upto)
            n = max(n, r.entries_sent)
            delta, lo = r.text[r.emitted:upto], r.entries_sent
            r.emitted, r.entries_sent = upto, n
            if delta or n > lo or final:
                yield "piece", r, delta, lo, n, final
            if final:
                left -= 1

    def _stream(self, job: Job):
        req = job.req
        self._events_head()
        head = self._head(req)
        head["object"] = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
        fmt = self.app.format

        def send(choices, usage=None):
            chunk = {**head, "choices": choices}
            if req.include_usage:
                chunk["usage"] = usage
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        def so_far(r: Row | None = None):
            """With continuous_usage_stats, a chunk's usage: its choice's prompt and the tokens generated for it so
            far, as vLLM's (None: a chunk of every choice, nothing generated yet)."""
            if not req.continuous_usage:
                return None
            prompt = len(req.prompts[r.index // req.n if r is not None else 0])
            done = r.delivered if r is not None else 0
            return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        replies = {r.index: Reply(req, self.app.tokenizer, r.prompt) for r in job.rows} if req.kind == "chat" else {}
        if req.kind == "chat":
            send([{"index": r.index, "delta": {"role": req.role, "content": ""}, "logprobs": None,
                   "finish_reason": None} for r in job.rows], so_far())
            if req.echo_message:        # (vLLM's chat echo: the last message first, a chunk per choice)
                for r in job.rows:
                    send([{"index": r.index, "delta": {"content": req.echo_message}, "logprobs": None,
                           "finish_reason": None}], so_far())
        for ev, r, delta, lo, n, final in self._pieces(job):
            if ev == "error":
                kind = "invalid_request_error" if job.status < 500 else "server_error"
                self.wfile.write(b"data: " + json.dumps({"error": {"message": job.error, "type": kind,
                                                                    "param": job.param, "code": None}}).encode()
                                 + b"\n\ndata: [DONE]\n\n")      # (the end every stream has, as vLLM's)
                self.wfile.flush()
                return
            if ev == "echo":
                for r in job.rows:
                    lp = fmt.echoed(r, req.top_logprobs, req.token_ids) if req.logprobs else None
                    send([{"index": r.index, "text": r.echo.text,
                           "logprobs": _id_offsets(lp, 0) if lp is not None and req.token_ids else lp,
                           "finish_reason": None, "stop_reason": None}], so_far(r))
                continue
            lp = None
            if req.logprobs:
                lp = {"content": fmt.chat_entries(r, lo, n, req.top_logprobs, req.token_ids)} \
                    if req.kind == "chat" else fmt.legacy(r, lo, n, req.top_logprobs, req.token_ids)
                if req.kind == "completion" and req.token_ids:
                    # (vLLM's stream: a chunk's first offset is the choice's text sent before it)
                    sent = r.emitted - len(delta)
                    lp = _id_offsets(lp, sent + (len(r.echo.text) if r.echo is not None else 0))
            # (stop_reason as vLLM's: on every completions chunk, on chat's last one)
            if req.kind == "chat":
                reply = replies[r.index]
                d = reply.delta(delta, final)
                finish = reply.finish_reason(r.finish) if final else None
                if not d and not final and not (lp or {}).get("content"):
                    continue        # (text held back: a marker or a tool call being written)
                c = {"index": r.index, "delta": d, "logprobs": lp, "finish_reason": finish}
                send([{**c, "stop_reason": r.stop_reason} if final else c], so_far(r))
            else:
                send([{"index": r.index, "text": delta, "logprobs": lp,
                       "finish_reason": r.finish if final else None,
                       "stop_reason": r.stop_reason if final else None}], so_far(r))
        if req.include_usage:
            chunk = {**head, "choices": [], "usage": self._usage(job)}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    # -- OpenAI's Responses API (samplec/responses.py): one choice of the chat machinery, written as a Response

    def _message(self, job: Job, r: Row) -> tuple[dict, str]:
        """A finished chat choice's message fields and finish reason (its reasoning and tool calls read)."""
        return Reply(job.req, self.app.tokenizer, r.prompt).message(r.text, r.finish)

    def _respond(self, job: Job, answer):
        req = job.req
        while True:
            ev, _, _ = self._wait(job, watch=True)
            if ev == "error":
                return self._error(BadRequest(job.error or "generation failed",
                                              responses.field_name(job.param, answer.origins), job.status))
            if ev == "done":
                break
        r, fmt = job.rows[0], self.app.format
        message, finish = self._message(job, r)
        entries = fmt.chat_entries(r, 0, fmt.kept(r, len(r.text), False), req.top_logprobs, req.token_ids) \
            if req.logprobs else None
        usage = answer.usage(len(req.prompts[0]), r.delivered)
        resp = responses.response(answer, message, finish, entries, usage)
        self.app.responses.keep(answer, resp)      # (before it is sent: a client may continue it at once)
        self._send(200, resp)

    def _respond_stream(self, job: Job, answer):
        req, fmt = job.req, self.app.format
        self._events_head()
        events = responses.Events(answer)
        reply = Reply(req, self.app.tokenizer, job.rows[0].prompt)

        def send(evs):
            for e in evs:
                self.wfile.write(responses.stream_lines(e))
            self.wfile.flush()
        send(events.start())
        for ev, r, delta, lo, n, final in self._pieces(job):
            if ev == "error":
                return send(events.error(job.error or "generation failed",
                                         responses.field_name(job.param, answer.origins), job.status or 500))
            entries = fmt.chat_entries(r, lo, n, req.top_logprobs, req.token_ids) if req.logprobs else None
            send(events.delta(reply.delta(delta, final), entries))
            if final:
                finish = reply.finish_reason(r.finish)
                closing = events.finish(finish, answer.usage(len(req.prompts[0]), r.delivered), req.logprobs)
                self.app.responses.keep(answer, closing[-1]["response"])   # (complete or incomplete; before sent)
                send(closing)


def _fingerprint() -> str:
    import samplec
    return f"samplec-{getattr(samplec, '__version__', '0')}"


_FINGERPRINT = _fingerprint()


class HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


# ---------------------------------------------------------------------------------------------------------------
# start-up

def own_params(prog: Program) -> dict:
    """A served chain's own scalar parameters: float and int ones that are not samplec's request fields (FIELDS),
    an OpenAI or vLLM field, or a position."""
    taken = set(FIELDS) | COMMON | CHAT_ONLY | COMPLETION_ONLY | VLLM_ONLY | positions_of(prog)
    return {p.name: p for p in prog.params if p.kind in ("float", "int") and p.name not in taken}


def positions_of(prog: Program) -> set[str]:
    """The parameters a served chain is given the position in: those a draw takes as its position, and any named
    `pos` or `position`."""
    from samplec.decode import position_params
    return set(position_params(prog)) | {"pos", "position"}


def load_programs(specs: list[str], top: int = TOP) -> dict[str, Program]:
    """`--sampler FILE.smp[:NAME]` values (none: SERVER_CHAIN) as name -> program."""
    import samplec
    if not specs:
        return {"mlx_lm_server": samplec.compile(SERVER_CHAIN.replace("(TOP)", f"({top})"))}
    programs = {}
    for spec in specs:
        path, _, name = spec.partition(":")
        prog = samplec.compile_file(Path(path), sampler=name or None)
        if "token" not in [k for k, _ in prog.graph.outputs]:
            raise SamplecError(f"--sampler {spec}: the chain '{prog.name}' has no token output")
        if sum(p.kind == "mask" for p in prog.params) > 1:
            raise SamplecError(f"--sampler {spec}: a served chain has at most one mask parameter")
        driven = positions_of(prog)
        for p in prog.params:       # (what no request fills must have a default: else every request would fail)
            filled = p.kind in ("tokens", "seed", "mask") or p.kind == "int" and p.name in driven or \
                p.kind in ("float", "int") and (p.name in FIELDS or p.name in own_params(prog))
            if not filled and p.required:
                raise SamplecError(f"--sampler {spec}: no request field fills the chain's parameter '{p.name}' "
                                   f"({p.kind}) and it has no default (the fields a chain reads: "
                                   f"{', '.join(FIELDS)}; a seed, a mask, token histories and the position)")
        programs[prog.name] = prog
    return programs


def demo_model():
    """samplec's small random llama and local tokenizer (no download)."""
    from samplec.integrations.mlx_lm import local_tokenizer, random_llama
    return random_llama(0, vocab=512), local_tokenizer(512)


def parse_args(argv: list[str]):
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise SamplecError(f"samplec serve: {message}")
    p = Parser(prog="samplec serve", add_help=False)
    p.add_argument("--model", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--max-batch", type=int, default=32, help="the most rows generated at once")
    p.add_argument("--draft-model", default=None, help="a smaller model over the same vocabulary")
    p.add_argument("--num-draft", default=None, help="tokens the draft proposes per target forward pass")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--rank-timeout", type=float, default=None,
                   help="under mlx.launch: seconds a rank waits for the others in one plan or step")
    p.add_argument("--chat-template", default=None,
                   help="a chat template (Jinja) or the path of a file holding one, over the model's")
    p.add_argument("--chat-template-args", default=None,
                   help="JSON object: the chat template's arguments, under each request's chat_template_kwargs")
    p.add_argument("--tool-call-parser", default=None,
                   help="mlx-lm's tool parser for tool_choice auto (a module of mlx_lm.tool_parsers), over the "
                        "one mlx-lm reads off the chat template")
    p.add_argument("--responses-store", type=int, default=RESPONSES_STORE,
                   help="stored Responses kept in memory (previous_response_id, GET /v1/responses/ID), the least "
                        "recently used evicted first; 0 stores none")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


def serve(argv: list[str], samplers: list[str], demo: bool, ready=None):
    """Serve until interrupted. `ready(httpd, server)`: called once listening (tests, the CLI's message)."""
    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING))
    if not 0 <= args.port <= 65535:
        raise SamplecError(f"--port {args.port}: a port number lies in 0..65535")
    if not 1 <= args.max_batch <= 1024:
        raise SamplecError(f"--max-batch {args.max_batch}: must lie in 1..1024")
    if args.responses_store < 0:
        raise SamplecError(f"--responses-store {args.responses_store}: a count of responses, 0 or more (0: none "
                           "stored)")
    if not demo and not args.model:
        raise SamplecError("samplec serve needs --model PATH (or --demo for the built-in random model)")
    num_draft = 4
    if args.num_draft is not None:
        if args.draft_model is None:
            raise SamplecError("--num-draft: only with --draft-model PATH")
        try:
            num_draft = int(args.num_draft)
        except ValueError:
            raise SamplecError(f"--num-draft {args.num_draft}: must be an integer in 1..{MAX_DRAFT}") from None
        if not 1 <= num_draft <= MAX_DRAFT:
            raise SamplecError(f"--num-draft {num_draft}: must be an integer in 1..{MAX_DRAFT}")
    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        raise SamplecError("samplec serve needs mlx-lm: pip install mlx-lm "
                           "(or pip install -e '.[mlx-lm]' in a checkout)") from None
    programs = load_programs(samplers)
    template, template_args, parser_name = chat_options(args)
    # under mlx.launch (a group of several ranks): the LM head is split over the ranks, rank 0 serves HTTP and
    # the others follow its steps (docs/distributed.md, samplec serve)
    group = mx.distributed.init()
    ranks = group.size() > 1
    if ranks and args.draft_model:
        raise SamplecError("--draft-model: not under mlx.launch (a server whose LM head is split over ranks "
                           "decodes without a draft)")
    if args.rank_timeout is not None:
        from samplec.distributed.follow import HEARTBEAT, MIN_TIMEOUT
        if not ranks:
            raise SamplecError("--rank-timeout: only under mlx.launch (a server whose LM head is split over ranks)")
        if not MIN_TIMEOUT <= args.rank_timeout <= 86400:
            raise SamplecError(f"--rank-timeout {args.rank_timeout:g}: must lie in {MIN_TIMEOUT:g}..86400 seconds "
                               f"(rank 0 sends a plan every {HEARTBEAT:g} s while idle)")
    # everything that can fail at start-up fails before anything is served: the port first (at once, before a long
    # model load), then the model
    httpd = None
    if not ranks or group.rank() == 0:
        try:
            httpd = HTTPServer((args.host, args.port), Handler)
        except OSError as e:
            raise SamplecError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    app = None
    try:
        if demo:
            model, tokenizer = demo_model()
            model_id = "demo"
            if template is not None or parser_name is not None:     # (mlx-lm's load reads them for a model)
                tokenizer = rewrapped(tokenizer, template, parser_name)
        else:
            config = {"trust_remote_code": args.trust_remote_code}
            if template is not None:
                config["chat_template"] = template
            if parser_name is not None:
                config["tool_parser_type"] = parser_name
            try:
                from mlx_lm import load
                model, tokenizer = load(args.model, tokenizer_config=config)
            except Exception as e:  # noqa: BLE001 - mlx-lm and huggingface_hub raise many kinds
                raise SamplecError(f"cannot load the model {args.model!r}: {_first_line(e)}") from None
            model_id = args.model
        draft = load_draft(args.draft_model, args.trust_remote_code) if args.draft_model else None
        if ranks:
            from samplec.distributed import shard_lm_head
            shard_lm_head(model, group)
            s = model.samplec_vocab
            logging.info("samplec serve: rank %d of %d holds token ids [%d, %d) of the LM head", group.rank(),
                         group.size(), s.start, s.start + s.size)
        app = Server(model, tokenizer, programs, model_id, args.max_batch, draft, num_draft, args.rank_timeout,
                     args.responses_store)
        app.parse.template_args = template_args
        if ranks and threading.current_thread() is threading.main_thread():
            # (mlx.launch ends the other ranks with SIGTERM once one exits: rank 0 still answers its requests)
            import signal
            signal.signal(signal.SIGTERM, lambda *_: app.engine._terminated())
        if draft is not None:
            logging.info("samplec serve: speculative decoding with the draft %s, %d proposals a round",
                         args.draft_model, num_draft)
        if httpd is None:                # (a rank after 0: it runs rank 0's steps until rank 0 ends)
            if ready is not None:
                ready(None, app)
            app.engine.thread.join()
            return
        httpd.RequestHandlerClass = type("BoundHandler", (Handler,), {"app": app})
        if ready is not None:
            ready(httpd, app)
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if httpd is not None:
            httpd.server_close()
        if app is not None:
            app.engine.stop()


def chat_options(args) -> tuple[str | None, dict, str | None]:
    """--chat-template (a template, or a file's path: read), --chat-template-args (a JSON object) and
    --tool-call-parser (a module of mlx_lm.tool_parsers), checked before anything loads."""
    template = args.chat_template
    if template is not None:
        path = Path(template)
        try:
            if path.is_file():
                template = path.read_text()
        except OSError as e:
            raise SamplecError(f"--chat-template {template}: cannot read it: {e.strerror or e}") from None
        if not template.strip():
            raise SamplecError("--chat-template: the template is empty")
    template_args = {}
    if args.chat_template_args is not None:
        try:
            template_args = json.loads(args.chat_template_args)
        except ValueError as e:
            raise SamplecError(f"--chat-template-args: not JSON ({e})") from None
        if not isinstance(template_args, dict):
            raise SamplecError("--chat-template-args: a JSON object of the template's arguments, as "
                               "'{\"enable_thinking\": false}'")
        fixed = sorted(set(template_args) & {"tokenize", "conversation", "messages", "chat_template"})
        if fixed:
            raise SamplecError(f"--chat-template-args: {fixed[0]} is set by the server")
    name = args.tool_call_parser
    if name is not None:
        import importlib
        import pkgutil

        import mlx_lm.tool_parsers as parsers
        names = sorted(m.name for m in pkgutil.iter_modules(parsers.__path__) if not m.name.startswith("_"))
        if name not in names:
            raise SamplecError(f"--tool-call-parser {name}: mlx-lm has no such tool parser (it has: "
                               f"{', '.join(names)})")
        importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    return template, template_args, name


def rewrapped(tokenizer, template: str | None, parser_name: str | None):
    """A TokenizerWrapper over the same Hugging Face tokenizer with another chat template and tool parser (the
    demo model's; a model's are read by mlx-lm's load)."""
    import importlib

    from mlx_lm.tokenizer_utils import TokenizerWrapper
    hf = tokenizer._tokenizer
    if template is not None:
        hf.chat_template = template
    kw = {}
    if parser_name is not None:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{parser_name}")
        kw = dict(tool_parser=module.parse_tool_call, tool_call_start=module.tool_call_start,
                  tool_call_end=module.tool_call_end)
    return TokenizerWrapper(hf, eos_token_ids=tokenizer.eos_token_ids, **kw)


def load_draft(path: str, trust_remote_code: bool = False):
    """The draft model at PATH (a local folder or a Hugging Face repository, as --model): its weights only (it
    reads the target's tokens, so its tokenizer is not needed)."""
    try:
        from mlx_lm.utils import _download, load_model
        model, _ = load_model(_download(path), trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - mlx-lm and huggingface_hub raise many kinds
        raise SamplecError(f"--draft-model: cannot load {path!r}: {_first_line(e)}") from None
    return model


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
