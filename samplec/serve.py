"""`samplec serve`: mlx-lm's OpenAI-compatible server (mlx_lm.server, mlx-lm 0.32.2 pinned) sampling with samplec.

mlx-lm's BatchGenerator samples a batch with one call only when every request shares one sampler object; its
server builds a sampler per request (so it samples row by row) and never batches a request that carries a seed
(it seeds MLX's global generator). Here every request gets the same `BatchSampler` and its own `RowMarker`, a
logits processor that the batch calls row by row, in row order, just before sampling. The marker applies the
request's `logit_bias` and records the row (its raw logits, its token context and its parameters); the sampler,
called once per step for the whole batch, runs one compiled program over those rows with one value per row --
temperature, top_p, top_k, min_p, the penalties, the seed and the position (the count of tokens the request has
generated). A row's token depends only on its own logits, values, seed and position (spec section 4), so a
seeded request gives the same tokens alone or in any batch, and seeded requests are batched like the others.

The chain is `SERVER_CHAIN` (mlx-lm's order: its three penalties, each over its own window, top_p, min_p, xtc,
top_k, temperature, sample), or the chains named with `--sampler FILE.smp[:NAME]` (the first is the default; a
request picks another with the field `"samplec_sampler": "NAME"`). A chain's parameters take the request's fields
by name; a `tokens` parameter gets the request's recent tokens (as many as the largest of its three context sizes;
0: all), a `seed` parameter the request's seed (or one drawn from the OS for the request), an `int` parameter named
`pos` or `position` the position. Request values are checked when the request arrives (400 naming the field);
mlx-lm's conventions hold (`top_p` 0 or 1 and `top_k` 0 are off, `temperature` 0 is greedy, a context size of 0 is
every token).
"""
from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from samplec.diagnostics import SamplecError
from samplec.program import Program

SERVER_CHAIN = """
sampler mlx_lm_server(h: tokens, seed: seed, pos: int, temperature: float = 0.0, top_p: float = 1.0,
                      top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                      repetition_context_size: int = 20, presence_penalty: float = 0.0,
                      presence_context_size: int = 20, frequency_penalty: float = 0.0,
                      frequency_context_size: int = 20, xtc_probability: float = 0.0,
                      xtc_threshold: float = 0.1) -> token, logprob {
    penalties(h, last_n = repetition_context_size, repeat = repetition_penalty)
    penalties(h, last_n = presence_context_size, presence = presence_penalty)
    penalties(h, last_n = frequency_context_size, frequency = frequency_penalty)
    top_p(top_p)
    min_p(min_p)
    xtc(xtc_threshold, xtc_probability, seed, position = pos)
    top_k(top_k)
    temperature(temperature)
    sample(seed, position = pos)
}
"""

# request field -> how mlx-lm's value becomes the chain's (its off conventions; a context size of 0 is every token,
# mlx-lm's `tokens[-0:]`)
_WINDOW = lambda v: -1 if int(v) == 0 or int(v) >= 2**31 else int(v)      # noqa: E731  (past int32: every token)
FIELDS = {
    "temperature": lambda v: float(v),
    "top_p": lambda v: 1.0 if v <= 0 or v >= 1 else float(v),
    "top_k": lambda v: max(0, int(v)),
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
WINDOWS = ("repetition_context_size", "presence_context_size", "frequency_context_size")


@dataclass
class RowMarker:
    """One request's logits processor: applies its logit_bias, records its row for the batch's one sampler call."""
    sampler: "BatchSampler"
    chain: str
    values: dict
    seed: int
    context: int                # how many of the recent tokens the chain's `tokens` parameter gets (-1: all)
    bias: dict = field(default_factory=dict)
    eos: int = 0
    step: int = 0
    logprobs: list = field(default_factory=list)     # each token's log-probability under the chain's distribution

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.bias:
            V = logits.shape[-1]
            ids = [i for i in self.bias if 0 <= i < V]
            if ids:
                logits = logits.at[..., mx.array(ids)].add(mx.array([self.bias[i] for i in ids], mx.float32))
        self.sampler.rows.append((self, logits, tokens))
        return logits


class BatchSampler:
    """The batch's one sampler: runs each chain once per step over the rows its markers recorded."""

    def __init__(self, programs: dict[str, Program]):
        self.programs = programs
        self.default = next(iter(programs))
        self.rows: list = []
        self.calls = 0              # program calls so far (one per chain per step)
        self.widest = 0             # the most rows one call sampled
        self.provider = None        # mlx-lm's ModelProvider (its tokenizer's end-of-sequence id)

    def marker(self, args) -> RowMarker:
        s, lg = args.sampling, args.logits
        values = {name: FIELDS[name](getattr(s if hasattr(s, name) else lg, name)) for name in FIELDS}
        chain = getattr(args, "samplec_sampler", None) or self.default
        seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(8), "little")
        eos = next(iter(getattr(getattr(self.provider, "tokenizer", None), "eos_token_ids", None) or [0]))
        windows = [values[w] for w in WINDOWS]
        return RowMarker(self, chain, values, seed, -1 if -1 in windows else max(windows),
                         dict(lg.logit_bias or {}), eos)

    def __call__(self, logprobs: mx.array) -> mx.array:
        rows, self.rows = self.rows, []
        if len(rows) != logprobs.shape[0]:
            raise RuntimeError(f"samplec serve: {len(rows)} recorded rows for a batch of {logprobs.shape[0]}")
        tokens = [None] * len(rows)
        for chain in dict.fromkeys(m.chain for m, _, _ in rows):
            at = [i for i, (m, _, _) in enumerate(rows) if m.chain == chain]
            out = self._run(self.programs[chain], [rows[i] for i in at])
            for i, t in zip(at, out):
                tokens[i] = t
        return mx.array(tokens, dtype=mx.uint32)

    def _run(self, prog: Program, rows: list) -> list[int]:
        x = mx.concatenate([lg.reshape(1, -1) for _, lg, _ in rows], axis=0)
        kw: dict = {}
        for p in prog.params:
            if p.kind == "tokens":
                hist = [np.array(t).reshape(-1)[-m.context if m.context > 0 else 0:] for m, _, t in rows]
                width = max(1, max(len(h) for h in hist))
                kw[p.name] = np.stack([np.pad(h.astype(np.int32), (width - len(h), 0), constant_values=-1)
                                       for h in hist])
            elif p.kind == "seed":
                kw[p.name] = np.array([m.seed for m, _, _ in rows], dtype=np.uint64)
            elif p.name in ("pos", "position") and p.kind == "int":
                kw[p.name] = [m.step for m, _, _ in rows]
            elif p.name in FIELDS:
                kw[p.name] = [m.values[p.name] for m, _, _ in rows]
        self.calls += 1
        self.widest = max(self.widest, len(rows))
        try:
            out = prog(x, **kw)
            tokens = np.array(out.token).reshape(-1).tolist()
            lps = np.array(out.logprob).reshape(-1).tolist() if "logprob" in out.names() else [None] * len(rows)
        except SamplecError as e:
            # (a value no request check could foresee -- a row that logit_bias empties: that row alone, each on
            # its own, and a failing row ends its request with its end-of-sequence token rather than the server)
            if len(rows) == 1:
                logging.error("samplec serve: %s", e)
                tokens, lps = [rows[0][0].eos], [None]
            else:
                tokens = [self._run(prog, [r])[0] for r in rows]
                return tokens
        for (m, _, _), lp in zip(rows, lps):
            m.step += 1
            m.logprobs.append(lp)
        return tokens


def validate(handler, programs: dict[str, Program]) -> None:
    """samplec's checks on a request's sampling fields, where mlx-lm's own leave a value the chain refuses (a
    ValueError: mlx-lm answers 400 with its message)."""
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        v = getattr(handler, name, None)
        if isinstance(v, (int, float)) and not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number")
    if getattr(handler, "repetition_penalty", 1) is not None and handler.repetition_penalty < 0:
        raise ValueError("repetition_penalty must be positive (0 turns it off)")
    if not -2**31 <= handler.top_k < 2**31:
        raise ValueError("top_k must fit in a 32-bit int")
    if handler.seed is not None and not 0 <= handler.seed < 2**64:
        raise ValueError("seed must be in [0, 2**64)")
    if handler.max_tokens > 1 << 20:
        raise ValueError("max_tokens must be at most 1048576")
    for k, v in (handler.logit_bias or {}).items():
        if k < 0 or not (math.isfinite(v) or v == -math.inf):
            raise ValueError(f"logit_bias: token {k}: ids must be >= 0 and biases finite or -inf")
    prompt, messages = handler.body.get("prompt"), handler.body.get("messages")
    if "prompt" in handler.body and not (isinstance(prompt, str) and prompt or isinstance(prompt, list) and prompt):
        raise ValueError("prompt must be a non-empty string")     # (mlx-lm's generation thread dies on one)
    if "messages" in handler.body and not (isinstance(messages, list) and messages):
        raise ValueError("messages must be a non-empty list")
    chain = handler.body.get("samplec_sampler")
    if chain is not None and chain not in programs:
        raise ValueError(f"samplec_sampler: no chain named {chain!r} (this server has: {', '.join(programs)})")


def load_programs(specs: list[str]) -> dict[str, Program]:
    """`--sampler FILE.smp[:NAME]` values (none: SERVER_CHAIN) as name -> program."""
    import samplec
    if not specs:
        return {"mlx_lm_server": samplec.compile(SERVER_CHAIN)}
    programs = {}
    for spec in specs:
        path, _, name = spec.partition(":")
        prog = samplec.compile_file(Path(path), sampler=name or None)
        programs[prog.name] = prog
    return programs


def install(server, programs: dict[str, Program]) -> BatchSampler:
    """Make mlx_lm.server (the module) sample with samplec: one BatchSampler for every request, a RowMarker each,
    seeded requests batchable, samplec's checks when a request arrives."""
    sampler = BatchSampler(programs)
    local = threading.local()
    server._make_sampler = lambda args, tokenizer: sampler
    def processors(args):
        marker = sampler.marker(args)
        box = getattr(args, "samplec_box", None)
        if box is not None:
            box["marker"] = marker          # (the handler thread reads the processed log-probabilities there)
        return [marker]
    server._make_logits_processors = processors
    server.ResponseGenerator._is_batchable = lambda self, args: (
        self.model_provider.is_batchable and self.cli_args.kv_bits is None)
    original_validate = server.APIHandler.validate_model_parameters

    def validate_model_parameters(handler):
        original_validate(handler)
        validate(handler, programs)
        local.chain = handler.body.get("samplec_sampler")
        local.handler = handler
    server.APIHandler.validate_model_parameters = validate_model_parameters
    original_generate = server.ResponseGenerator.generate

    def generate(self, request, args, *a, **kw):
        args.samplec_sampler = getattr(local, "chain", None)     # (the handler thread's request)
        args.samplec_box = getattr(local, "handler", None).__dict__.setdefault("samplec_box", {}) \
            if getattr(local, "handler", None) is not None else {}
        return original_generate(self, request, args, *a, **kw)
    server.ResponseGenerator.generate = generate
    original_response = server.APIHandler.generate_response

    def generate_response(handler, *a, **kw):
        """mlx-lm's answer; with logprobs, each token also carries `processed_logprob`: its log-probability
        under the distribution the chain sampled from (mlx-lm's `logprob` is the model's, after logit_bias)."""
        response = original_response(handler, *a, **kw)
        marker = getattr(handler, "samplec_box", {}).get("marker")
        content = (response.get("choices") or [{}])[0].get("logprobs", {}).get("content")
        if marker is not None and content:
            done = marker.logprobs[-len(content):] if handler.stream else marker.logprobs
            for entry, lp in zip(content, done):
                entry["processed_logprob"] = lp
        return response
    server.APIHandler.generate_response = generate_response
    return sampler


def handler_class(server):
    """mlx-lm's APIHandler, but a body that is not UTF-8 JSON is answered 400 before mlx-lm reads it (its own
    error path decodes the raw bytes for its log, and a non-UTF-8 body ended the connection without an answer)."""
    import io
    import json

    class Handler(server.APIHandler):
        def do_POST(self):
            try:
                length = int(self.headers.get("Content-Length") or -1)
            except ValueError:
                length = -1
            if 0 <= length <= MAX_BODY:
                body = self.rfile.read(length)
                try:
                    json.loads(body.decode("utf-8"))
                except (UnicodeDecodeError, ValueError) as e:
                    return self._refuse(f"the request body is not UTF-8 JSON ({type(e).__name__}: {e})"[:300])
                self.rfile = io.BytesIO(body)
            elif length > MAX_BODY:
                return self._refuse(f"the request body holds {length} bytes; the limit is {MAX_BODY}")
            return super().do_POST()

        def _refuse(self, message: str):
            self._set_completion_headers(400)
            self.end_headers()
            self.wfile.write(json.dumps({"error": message}).encode())

    return Handler


MAX_BODY = 16 << 20


def demo_provider(server, cli_args):
    """A ModelProvider serving samplec's small random llama and local tokenizer (no download)."""
    from samplec.integrations.mlx_lm import local_tokenizer, random_llama

    class DemoProvider(server.ModelProvider):
        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            self.reset()
            self.model_key = ("demo", None, None)
            self.model = random_llama(0, vocab=512)
            self.tokenizer = local_tokenizer(512)
            self.processor = None
            self.draft_model = None
            self.is_batchable = True

    cli_args.model = "demo"
    return DemoProvider(cli_args)


def server_args(argv: list[str]):
    """mlx-lm's own server flags, parsed by its parser (`--model`, `--host`, `--port`, ...)."""
    import argparse
    import sys
    from mlx_lm import server
    parser_holder = {}
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        parser_holder["ns"] = original(self, argv, namespace)
        raise _Parsed()
    argparse.ArgumentParser.parse_args = capture
    saved = sys.argv
    try:
        sys.argv = ["samplec serve", *argv]
        server.main()
    except _Parsed:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = saved
    return parser_holder["ns"]


class _Parsed(Exception):
    pass


def serve(argv: list[str], samplers: list[str], demo: bool, ready=None):
    """Run mlx-lm's server with samplec sampling until interrupted. `ready(httpd_address, sampler)`: for tests."""
    try:
        from mlx_lm import server
    except ImportError:
        raise SamplecError("samplec serve needs mlx-lm: pip install mlx-lm "
                           "(or pip install -e '.[mlx-lm]' in a checkout)") from None
    args = server_args(argv)
    if not 0 <= args.port <= 65535:
        raise SamplecError(f"--port {args.port}: a port number lies in 0..65535")
    if not demo and not args.model:
        raise SamplecError("samplec serve needs --model PATH (or --demo for the built-in random model)")
    programs = load_programs(samplers)
    sampler = install(server, programs)
    provider = sampler.provider = demo_provider(server, args) if demo else server.ModelProvider(args)
    # everything that can fail at start-up fails before the generation thread starts (a thread that outlived the
    # error kept the process alive): the port is bound (at once: before a long model load), then the model loads
    # here, not on the first request
    handler = handler_class(server)
    generator = None
    try:
        httpd = server.ThreadingHTTPServer(
            (args.host, args.port),
            lambda *a, **kw: handler(generator, *a, system_fingerprint=server.get_system_fingerprint(), **kw))
    except OSError as e:
        raise SamplecError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    try:
        try:
            provider.load_default()
        except Exception as e:  # noqa: BLE001 - mlx-lm and huggingface_hub raise many kinds
            raise SamplecError(f"cannot load the model {args.model!r}: {_first_line(e)}") from None
        generator = server.ResponseGenerator(provider, server.LRUPromptCache(args.prompt_cache_size))
        if ready is not None:
            ready(httpd, sampler)
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        if generator is not None:
            generator.stop_and_join()


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
