"""AST of a `.smp` file: small frozen dataclasses, each with the source span it came from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from samplec.diagnostics import Span


@dataclass(frozen=True)
class Literal:
    value: int | float
    kind: str  # "int" | "float"   (`inf`, `-inf`, `1e-3`, `0.5` are floats)
    span: Span


@dataclass(frozen=True)
class Name:
    name: str
    span: Span


@dataclass(frozen=True)
class DictLit:
    items: tuple[tuple[int, float], ...]  # (token_id, bias) in source order
    span: Span
    item_spans: tuple[tuple[Span, Span], ...] = ()  # (key span, value span) per item, for diagnostics


@dataclass(frozen=True)
class ListLit:
    """A list of token ids, `[13, 198]` (dry's breakers)."""
    items: tuple[int, ...]
    span: Span
    item_spans: tuple[Span, ...] = ()


Expr = Union[Literal, Name, DictLit, ListLit]


@dataclass(frozen=True)
class Arg:
    key: str | None  # None for a positional argument
    value: Expr
    span: Span


@dataclass(frozen=True)
class Stage:
    name: str
    args: tuple[Arg, ...]
    span: Span          # the whole call
    name_span: Span     # just the stage name


@dataclass(frozen=True)
class Param:
    name: str
    type: str                 # float | int | seed | tokens | mask | bias (checked later)
    default: Literal | None
    span: Span
    type_span: Span | None = None  # just the type name, for diagnostics


@dataclass(frozen=True)
class Output:
    name: str                 # token | logprob | raw_logprob | top_logprobs | probs | candidates
    arg: int | None           # n of top_logprobs(n), k of candidates(k)
    span: Span


@dataclass(frozen=True)
class Sampler:
    name: str
    params: tuple[Param, ...]
    outputs: tuple[Output, ...] | None   # None when the `-> ...` clause is absent (means `-> token`)
    stages: tuple[Stage, ...]
    span: Span
    name_span: Span


@dataclass(frozen=True)
class Module:
    samplers: tuple[Sampler, ...]
    filename: str
    source: str


# ---- after checking -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BoundStage:
    """A stage whose arguments are matched to its signature: every signature parameter present, defaults filled."""
    name: str
    args: dict          # signature parameter name -> Literal | Name | DictLit
    span: Span


@dataclass(frozen=True)
class CheckedSampler:
    name: str
    params: tuple[Param, ...]
    outputs: tuple[Output, ...]          # never None: the default `token` is filled in
    stages: tuple[BoundStage, ...]
    span: Span
