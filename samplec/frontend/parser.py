"""Parse `.smp` source text into the AST of samplec.frontend.ast (syntax only; meaning is checked in check.py).

The grammar lives in grammar/samplec.lark; `ToAst` has one method per rule or alias that survives into the tree.
Syntax errors become a `SamplecError` carrying one `Diagnostic` at the offending token.
"""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

from lark import Lark, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken
from lark.lexer import PatternStr

from samplec.diagnostics import Diagnostic, SamplecError, Span
from samplec.frontend.ast import Arg, DictLit, ListLit, Literal, Module, Name, Output, Param, Sampler, Stage

GRAMMAR_PATH = Path(__file__).resolve().parent.parent / "grammar" / "samplec.lark"


@lru_cache(maxsize=1)
def _lark() -> Lark:
    """The LALR parser, built once per process.

    `strict=True` (which needs the optional `interegular` package) is enforced by a test rather than here, so that
    loading the parser neither needs that package nor pays for its collision search.
    """
    return Lark(GRAMMAR_PATH.read_text(encoding="utf-8"), parser="lalr", lexer="contextual",
                propagate_positions=True, maybe_placeholders=True)


MAX_SOURCE_CHARS = 1 << 20     # a sampler file is a few hundred bytes; the limit bounds every later pass


def parse(source: str, filename: str = "<string>") -> Module:
    """Parse one `.smp` file holding zero or more samplers. Raises SamplecError on a syntax error.

    Line breaks are "\n", "\r\n" and a lone "\r" (classic Mac files), all read as "\n" before parsing, so that
    positions, comments (to the end of the line) and the rendered caret agree; every other character (form feed,
    vertical tab, U+2028, ...) is a character on its line."""
    if len(source) > MAX_SOURCE_CHARS:
        diag = Diagnostic("error", f"the file holds {len(source)} characters; the limit is {MAX_SOURCE_CHARS}",
                          Span(filename, 1, 1, 1, 2))
        raise SamplecError(diag.message, (diag,), "")
    source = source.replace("\r\n", "\n").replace("\r", "\n")
    try:
        tree = _lark().parse(source)
    except UnexpectedInput as e:
        diag = _syntax_diagnostic(e, source, filename)
        raise SamplecError(diag.message, (diag,), source) from None
    return ToAst(filename, source).transform(tree)


# ---- tree -> AST ----------------------------------------------------------------------------------------------

def _span(file: str, m) -> Span:
    """Span of a lark Meta or Token (lark columns are 1-based, end_column exclusive, like ours)."""
    return Span(file, m.line, m.column, m.end_line, m.end_column)


@v_args(meta=True, inline=True)
class ToAst(Transformer):
    def __init__(self, filename: str, source: str):
        super().__init__()
        self.file = filename
        self.source = source

    def module(self, meta, *samplers):
        return Module(tuple(samplers), self.file, self.source)

    def sampler(self, meta, name, params, outputs, body):
        return Sampler(str(name), params, outputs, body, _span(self.file, meta), _span(self.file, name))

    def params(self, meta, *params):
        return tuple(params)

    def param(self, meta, name, type_, default):
        return Param(str(name), str(type_), default, _span(self.file, meta), type_span=_span(self.file, type_))

    def outputs(self, meta, *outputs):
        return tuple(outputs)

    def output(self, meta, name, arg):
        return Output(str(name), None if arg is None else _int(arg), _span(self.file, meta))

    def body(self, meta, *stages):
        return tuple(stages)

    def stage(self, meta, name, *args):
        return Stage(str(name), tuple(args), _span(self.file, meta), _span(self.file, name))

    def positional(self, meta, value):
        return Arg(None, value, _span(self.file, meta))

    def keyword(self, meta, key, value):
        return Arg(str(key), value, _span(self.file, meta))

    def name(self, meta, tok):
        return Name(str(tok), _span(self.file, tok))

    def dict(self, meta, *items):
        return DictLit(tuple((k.value, v.value) for k, v in items), _span(self.file, meta),
                       item_spans=tuple((k.span, v.span) for k, v in items))

    def list_lit(self, meta, *items):
        return ListLit(tuple(_int(t) for t in items), _span(self.file, meta),
                       item_spans=tuple(_span(self.file, t) for t in items))

    def dict_item(self, meta, key, value):
        # Values are stored as floats (a bias is a float); the checker validates both sides using the spans.
        return Literal(_int(key), "int", _span(self.file, key)), Literal(_float(value.value), "float", value.span)

    def int_lit(self, meta, tok):
        return Literal(_int(tok), "int", _span(self.file, tok))

    def float_lit(self, meta, tok):
        return Literal(_float_text(str(tok)), "float", _span(self.file, tok))


class BigInt(int):
    """An integer literal with more digits than any value samplec takes (Python would refuse to convert past
    4300 digits): it stands as +-10**40, out of every range the checks know, and prints as written (shortened)."""

    text: str

    def __new__(cls, text: str):
        self = super().__new__(cls, -10 ** 40 if text.startswith("-") else 10 ** 40)
        self.text = text
        return self

    def __str__(self) -> str:
        digits = self.text.lstrip("+-")
        return f"{self.text[:12]}...({len(digits)} digits)"

    __repr__ = __str__


def _int(tok) -> int:
    text = str(tok)
    return BigInt(text) if len(text.lstrip("+-")) > 40 else int(text)


class BigFloat(float):
    """A float literal past the float64 range (1e999): the largest float64 -- past the float32 range, so the
    checks refuse it -- printed as written. (`inf` is written as inf.)"""

    text: str

    def __new__(cls, text: str):
        self = super().__new__(cls, -1.7976931348623157e308 if text.startswith("-") else 1.7976931348623157e308)
        self.text = text
        return self

    def __str__(self) -> str:
        return self.text if len(self.text) <= 24 else f"{self.text[:12]}...({len(self.text)} characters)"

    __repr__ = __str__


def _float_text(text: str) -> float:
    value = float(text)                 # (float() reads `inf`, `-inf`, `+inf` too)
    return BigFloat(text) if math.isinf(value) and "inf" not in text.lower() else value


def _float(v) -> float:
    """A float of a literal: a finite number, or +-inf for one past the float range (the checks then refuse it
    where a finite value is needed)."""
    try:
        return float(v)
    except OverflowError:
        return float("inf") if v > 0 else float("-inf")


# ---- syntax errors --------------------------------------------------------------------------------------------

# How expected tokens are named in messages; string tokens are shown quoted ('(' , '->').
_TOKEN_WORDS = {"NAME": "a name", "INT": "an integer", "FLOAT": "a number", "INF": "a number", "$END": "end of file"}

# Where the bare list of expected tokens reads poorly, a hint chosen by the LALR state the error happened in; the
# message is "unexpected <what>; <hint>". Like `UnexpectedInput.match_examples`, but keyed by the state alone:
# match_examples also compares stack depth, so its examples would only match at the same nesting depth.
# A hint mentioning {prev} is the whole message and points at the token before the error (the stage's name).
_HINTS = {
    "expected the sampler's name after 'sampler'": ["sampler (", "sampler {"],
    "expected '(' and a parameter list after the sampler's name, e.g. sampler name() { ... }": [
        "sampler s {", "sampler s -> token"],
    "expected a parameter type after ':' (float, int, seed, tokens, mask, bias or state)": ["sampler s(x: )"],
    "a parameter needs a type, e.g. 'temperature: float'": ["sampler s(x)"],
    "expected a stage or '}'": ["sampler s() { ,", "sampler s() { top_k(1) ,"],
    "stage '{prev}' needs parentheses: {prev}(...)": ["sampler s() { greedy }"],
    "expected '{' and the sampler's stages": ["sampler s() )", "sampler s() -> token )"],
    "expected an argument (a number, a parameter name or a {token_id: bias} dict)": [
        "sampler s() { top_k(k = )", "sampler s() { top_k(1, ,", "sampler s() { top_k(,"],
    "expected an integer token id": ["sampler s() { logit_bias({x", "sampler s() { logit_bias({1: 2, x"],
    "expected ':' after the token id (token ids are integers)": ["sampler s() { logit_bias({1 2"],
}


@lru_cache(maxsize=1)
def _hint_states() -> dict[int, str]:
    """LALR state number -> hint, found by parsing each example (each fails in the state its hint is for)."""
    states: dict[int, str] = {}
    for hint, examples in _HINTS.items():
        for example in examples:
            try:
                _lark().parse(example)
            except UnexpectedInput as e:
                states.setdefault(e.state.position, hint)
            else:
                raise AssertionError(f"hint example parses: {example!r}")
    return states


def _describe(term: str) -> str:
    if term in _TOKEN_WORDS:
        return _TOKEN_WORDS[term]
    pattern = _lark().get_terminal(term).pattern
    return f"'{pattern.value}'" if isinstance(pattern, PatternStr) else term


def _expected(names) -> str:
    words = {_describe(n) for n in names}
    if "a number" in words:
        words.discard("an integer")
    words = sorted(words, key=lambda w: (not w.startswith("'"), w))
    if not words:
        return ""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _syntax_diagnostic(e: UnexpectedInput, source: str, filename: str) -> Diagnostic:
    if isinstance(e, UnexpectedCharacters):
        found = f"character {source[e.pos_in_stream]!r}"
        expected = e.allowed
    elif isinstance(e, UnexpectedToken):
        found = "end of file" if e.token.type == "$END" else f"'{e.token.value}'"
        expected = e.accepts or e.expected
    else:  # UnexpectedEOF is raised only by the Earley parser; kept for completeness
        found, expected = "end of file", getattr(e, "expected", ())
    head = "unexpected end of file" if found == "end of file" else f"unexpected {found}"
    hint = _hint_states().get(e.state.position) if getattr(e, "state", None) is not None else None
    if hint and "{prev}" in hint:
        prev = e.state.value_stack[-1]
        return Diagnostic("error", hint.format(prev=prev), _span(filename, prev))
    if hint is None:
        want = _expected(t for t in expected if t not in ("WS", "COMMENT"))
        hint = f"expected {want}" if want else None
    return Diagnostic("error", f"{head}; {hint}" if hint else head, _error_span(e, filename))


def _error_span(e: UnexpectedInput, filename: str) -> Span:
    if isinstance(e, UnexpectedToken) and e.token.type == "$END":
        # The end token borrows the last real token's position: point just past that token.
        tok = e.token
        if tok.end_line is None:  # empty input
            return Span(filename, 1, 1, 1, 1)
        return Span(filename, tok.end_line, tok.end_column, tok.end_line, tok.end_column + 1)
    if isinstance(e, UnexpectedToken):
        return _span(filename, e.token)
    return Span(filename, e.line, e.column, e.line, e.column + 1)
