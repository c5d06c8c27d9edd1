"""Structured outputs: JSON schemas, regular expressions and context-free grammars as a per-step allowed-token mask.

The engine is llguidance (Rust, with wheels for Linux and macOS on x86_64 and arm64; the engine behind
constrained decoding in vLLM, SGLang and llama.cpp's `--json-schema` path): it compiles a grammar against a
tokenizer and, at each step, writes the allowed tokens as a packed int32 bitmask `[ceil(V/32)]` (bit `j` of word
`w` is token `32*w + j`) -- the packed form that a samplec program's `mask` parameter takes, so the mask goes into
the sampler's `allow(mask)` stage as it is, in the same call as every other row.

    tok = Tokenizer.of(mlx_lm_tokenizer)                      # once per tokenizer (a second or less)
    g = Grammar.json_schema(tok, {"type": "object", ...})     # GrammarError names what the engine refused
    m = g.matcher()                                           # one per generation
    mask = np.full((1, words), -1, np.int32); m.fill(mask, 0) # before a step
    m.consume(token)                                          # after it

`samplec.decode.generate(..., grammar=g)` drives this loop for one sequence (`generate_constrained` below);
`samplec serve` drives it for a batch (`response_format`, `grammar`).
"""
from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import numpy as np

from samplec.diagnostics import SamplecError

__all__ = ["Tokenizer", "Grammar", "Matcher", "GrammarError", "KINDS", "generate_constrained"]

KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")


class GrammarError(SamplecError):
    """A grammar the engine cannot compile (or no engine): `field` names what to fix."""

    def __init__(self, message: str, field: str = "grammar"):
        super().__init__(message)
        self.field = field


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError:
        raise GrammarError("structured outputs need llguidance: pip install llguidance "
                           "(or pip install -e '.[mlx-lm]' in a checkout)") from None
    return llguidance


class Tokenizer:
    """A tokenizer as the grammar engine sees it (token bytes, end-of-sequence ids), built once."""

    def __init__(self, ll, vocab_size: int):
        self.ll = ll
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._bytes: dict[int, bytes] = {}

    @classmethod
    def of(cls, tokenizer, vocab_size: int | None = None, eos=None) -> "Tokenizer":
        """From an mlx-lm TokenizerWrapper, a Hugging Face fast tokenizer or a `Tokenizer` (returned as is).
        `vocab_size`: the model's vocabulary when it is larger than the tokenizer's (padding rows never allowed)."""
        if isinstance(tokenizer, Tokenizer):
            return tokenizer
        llg = _llguidance()
        import llguidance.hf
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        if eos is None:
            ids = getattr(tokenizer, "eos_token_ids", None)
            eos = sorted(ids) if ids else getattr(hf, "eos_token_id", None)
        try:
            ll = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        except Exception as e:  # noqa: BLE001 - a slow tokenizer, a tokenizer llguidance cannot read
            raise GrammarError(f"the grammar engine cannot use this tokenizer ({type(e).__name__}: {e})") from None
        del llg
        return cls(ll, max(vocab_size or 0, ll.vocab_size))

    @property
    def eos(self) -> list[int]:
        return list(self.ll.eos_tokens)

    def token_bytes(self, token: int) -> bytes:
        b = self._bytes.get(token)
        if b is None:
            b = self._bytes[token] = bytes(self.ll.decode_bytes([int(token)]))
        return b


class Grammar:
    """A compiled grammar (checked against the tokenizer); `matcher()` starts one generation."""

    def __init__(self, tokenizer: Tokenizer, text: str, kind: str, field: str = "grammar"):
        llg = _llguidance()
        self.tokenizer, self.kind, self.field = tokenizer, kind, field
        self.text = text
        try:
            error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, tokenizer.ll)
        except Exception as e:  # noqa: BLE001 - the engine's own parse errors
            error, messages = True, [str(e)]
        if error:
            raise GrammarError(f"{field}: the {kind.replace('_', ' ')} cannot be compiled: "
                               f"{(messages or ['unknown error'])[0].strip()}"[:1000], field)

    @classmethod
    def build(cls, tokenizer, kind: str, spec: Any, field: str = "grammar") -> "Grammar":
        """kind: 'json_schema' (a dict or its JSON text), 'json_object' (any JSON object), 'regex', 'lark' (a
        Lark grammar, llguidance's dialect) or 'gbnf' (llama.cpp's grammar format)."""
        llg = _llguidance()
        tokenizer = Tokenizer.of(tokenizer)
        if kind not in KINDS:
            raise GrammarError(f"{field}: unknown grammar kind {kind!r} (one of {', '.join(KINDS)})", field)
        compact = {"whitespace_flexible": False}
        try:
            if kind == "json_object":
                text = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
            elif kind == "json_schema":
                schema = json.loads(spec) if isinstance(spec, str) else spec
                if not isinstance(schema, (dict, bool)):
                    raise GrammarError(f"{field}: a JSON schema is an object, got {type(schema).__name__}", field)
                text = llg.LLMatcher.grammar_from_json_schema(schema, defaults=compact)
            else:
                if not isinstance(spec, str) or not spec:
                    raise GrammarError(f"{field}: a {kind} grammar is a non-empty string", field)
                text = llg.grammar_from(kind, spec)
        except GrammarError:
            raise
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{field}: the {kind.replace('_', ' ')} cannot be compiled: {e}"[:1000],
                               field) from None
        return cls(tokenizer, text, kind, field)

    @classmethod
    def json_schema(cls, tokenizer, schema) -> "Grammar":
        return cls.build(tokenizer, "json_schema", schema)

    @classmethod
    def regex(cls, tokenizer, pattern: str) -> "Grammar":
        return cls.build(tokenizer, "regex", pattern)

    @classmethod
    def lark(cls, tokenizer, grammar: str) -> "Grammar":
        return cls.build(tokenizer, "lark", grammar)

    def matcher(self) -> "Matcher":
        return Matcher(self)


class Matcher:
    """One generation's place in a grammar."""

    def __init__(self, grammar: Grammar):
        llg = _llguidance()
        self.grammar = grammar
        self.m = llg.LLMatcher(grammar.tokenizer.ll, grammar.text, log_level=0)
        if self.m.is_error():
            raise GrammarError(f"grammar: {self.m.get_error()}")

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed tokens into `bitmask[row]` (int32, C-contiguous; at least ceil(V/32) words: the
        words past the tokenizer's vocabulary are set to 0)."""
        words = (self.grammar.tokenizer.ll.vocab_size + 31) // 32
        view = bitmask[row, :words]
        self.m.unsafe_compute_mask_ptr(view.ctypes.data, words * 4)
        bitmask[row, words:] = 0

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; False (and `error` set) when the grammar does not allow it."""
        return bool(self.m.consume_token(int(token)))

    @property
    def error(self) -> str | None:
        return self.m.get_error() if self.m.is_error() else None

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (only an end-of-sequence token is allowed)."""
        return bool(self.m.is_stopped())


_EXECUTOR = []


def fill_batch(matchers: list[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
    """Fill several rows' masks: on llguidance's thread pool when the rows are as wide as the tokenizer's masks
    (its parallel call writes whole masks), else one call each."""
    if len(matchers) < 2:
        for m, row in matchers:
            m.fill(bitmask, row)
        return
    words = (matchers[0][0].grammar.tokenizer.ll.vocab_size + 31) // 32
    if bitmask.shape[1] != words or not bitmask.flags["C_CONTIGUOUS"] or bitmask.dtype != np.int32:
        for m, row in matchers:
            m.fill(bitmask, row)
        return
    llg = _llguidance()
    if not _EXECUTOR:
        _EXECUTOR.append(llg.LLExecutor())
    llg.numpy.fill_next_token_bitmask_par(_EXECUTOR[0], [(m.m, row) for m, row in matchers], bitmask)


def mask_param(program, grammar, params: dict) -> str:
    """The name of the program's one `mask` parameter, which the grammar sets each step (clear errors otherwise)."""
    if not isinstance(grammar, Grammar):
        raise SamplecError(f"grammar: expected a samplec.structured.Grammar, got {type(grammar).__name__}")
    masks = [p.name for p in program.params if p.kind == "mask"]
    if len(masks) != 1:
        raise SamplecError(f"grammar= needs a sampler with one `mask` parameter (for `allow(mask)`); "
                           f"'{program.name}' has {len(masks)}")
    if masks[0] in params:
        raise SamplecError(f"parameter '{masks[0]}' is set by the grammar; do not pass it")
    return masks[0]


def generate_constrained(model, program, tokens: list[int], max_tokens: int, *, seed, eos: set[int],
                         prompt_in_history: bool, params: dict, grammar: Grammar) -> list[int]:
    """`samplec.decode.generate(..., grammar=...)`: one token per step (the next mask needs the token), each step a
    call of the program (`ProgramFeed`: position, history, state and a fixed-position draw's seed as in
    `decode.generate`) with the grammar's packed mask as its `mask` parameter; prefill as `decode.generate`'s."""
    from samplec.decode import ProgramFeed, pad_history, prefill
    name = mask_param(program, grammar, params)
    feed = ProgramFeed(program, seed, params, prompt_in_history)
    feed.check_arrays(set_by=(name,))
    matcher = grammar.matcher()
    cache, logits = prefill(model, mx.array(tokens, dtype=mx.int32))
    V = logits.shape[-1]
    if grammar.tokenizer.vocab_size > ((V + 31) // 32) * 32:
        raise SamplecError(f"grammar: the tokenizer has {grammar.tokenizer.vocab_size} tokens, the model {V}")
    feed.check_history(tokens, V)
    hist = mx.array(tokens, dtype=mx.int32)[None]      # the sequence so far
    out: list[int] = []
    state = None
    bitmask = np.zeros((1, (V + 31) // 32), dtype=np.int32)
    for step in range(max_tokens):
        matcher.fill(bitmask, 0)
        feed.params[name] = mx.array(bitmask)
        history = pad_history(hist, hist.shape[1]) if feed.needs_history else None
        outs, checks = feed(logits, [len(tokens) + step], history, state=state, generated=step)
        token = outs[feed.token_index]
        mx.eval(token, *(flag for _, flag in checks))
        fired = feed.first_fired(checks)
        if fired is not None:
            raise SamplecError(f"{fired[0]} (at position {len(tokens) + step})")
        state = feed.next_state(outs)
        t = int(np.array(token).reshape(-1)[0])
        out.append(t)
        if t in eos or t in grammar.tokenizer.eos:
            return out
        if not matcher.consume(t):
            raise SamplecError(f"grammar: the sampled token {t} is not allowed ({matcher.error})")
        if feed.needs_history:
            hist = mx.concatenate([hist, mx.array([[t]], dtype=mx.int32)], axis=1)
        logits = model(mx.array([[t]], dtype=mx.int32), cache=cache)[:, -1, :]
    return out


class FeedGrammar:
    """A grammar inside mlx-lm's loop (`samplec.integrations.mlx_lm.Sampler(..., grammar=g)`): before each sampler
    call the program's `mask` parameter becomes the grammar's packed mask; after it the matcher takes the token
    (read on the host: one sequence, one token per call)."""

    def __init__(self, program, grammar: Grammar, params: dict):
        self.name, self.grammar, self.matcher = mask_param(program, grammar, params), grammar, None

    def restart(self) -> None:
        self.matcher = None

    def before(self, feed, B: int, V: int) -> None:
        if B != 1:
            raise SamplecError("a grammar constrains one sequence per Sampler (batch size 1)")
        if self.matcher is None:
            self.matcher = self.grammar.matcher()
        bits = np.zeros((1, (V + 31) // 32), dtype=np.int32)
        self.matcher.fill(bits, 0)
        feed.params[self.name] = mx.array(bits)

    def after(self, token) -> None:
        t = int(np.array(token).reshape(-1)[0])
        if t not in self.grammar.tokenizer.eos and not self.matcher.consume(t):
            raise SamplecError(f"grammar: the sampled token {t} is not allowed ({self.matcher.error})")
