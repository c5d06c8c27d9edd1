"""Diagnostics: source spans, the one error type samplec raises, and `file:line:col` rendering with a caret."""
from __future__ import annotations

from dataclasses import dataclass, field


LINE_WIDTH = 120       # a rendered source line longer than this is shown as a window around the caret
MAX_SHOWN = 50         # diagnostics rendered for one error; the rest are counted


@dataclass(frozen=True)
class Span:
    """A source range; lines and columns are 1-based, `end_col` is exclusive."""
    file: str
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Diagnostic:
    severity: str  # "error" | "warning"
    message: str
    span: Span | None = None

    def render(self, source: str | list[str] | None = None) -> str:
        """`file:line:col: error: message`, then the source line and a caret under the span. `source`: the text,
        or its lines split at "\n" (the parser's only line break: see frontend.parser.parse)."""
        if self.span is None:
            return f"{self.severity}: {self.message}"
        head = f"{self.span}: {self.severity}: {self.message}"
        lines = source if isinstance(source, list) else (source or "").split("\n")
        if not (1 <= self.span.line <= len(lines)):
            return head
        text = lines[self.span.line - 1].expandtabs(1)
        width = 1
        if self.span.end_line == self.span.line and self.span.end_col > self.span.col:
            width = self.span.end_col - self.span.col
        width = max(1, min(width, len(text) - self.span.col + 1))
        col = self.span.col
        if len(text) > LINE_WIDTH:          # a window of the line around the span, marked where it is cut
            start = max(0, min(col - 1 - LINE_WIDTH // 3, len(text) - LINE_WIDTH))
            cut = text[start:start + LINE_WIDTH]
            text = ("..." if start else "") + cut + ("..." if start + LINE_WIDTH < len(text) else "")
            col = col - start + (3 if start else 0)
            width = max(1, min(width, LINE_WIDTH - (col - 1)))
        caret = " " * (col - 1) + "^" + "~" * (width - 1)
        return f"{head}\n{text}\n{caret}"


class SamplecError(ValueError):
    """Every user-facing failure: compile errors (with diagnostics), bad programs, bad run-time values."""

    def __init__(self, message: str, diagnostics: tuple[Diagnostic, ...] = (), source: str | None = None):
        self.diagnostics = tuple(diagnostics)
        self.source = source
        super().__init__(message)

    def render(self) -> str:
        if self.diagnostics:
            lines = (self.source or "").split("\n")       # (once for all: a file may hold many errors)
            shown = [d.render(lines) for d in self.diagnostics[:MAX_SHOWN]]
            if len(self.diagnostics) > MAX_SHOWN:
                shown.append(f"... and {len(self.diagnostics) - MAX_SHOWN} more")
            return "\n".join(shown)
        return f"error: {self}"

    def __str__(self) -> str:  # a diagnostic-carrying error prints as its rendered diagnostics
        if self.diagnostics:
            return self.render()
        return super().__str__()


class SamplecWarning(UserWarning):
    """A source warning (`file:line:col: warning: ...` with its caret), e.g. a parameter that is never used: the
    program compiles. `samplec.compile` issues one per warning through Python's `warnings`; the CLI prints them."""


@dataclass
class DiagnosticSink:
    """Collects diagnostics during checking; `raise_if_errors` turns them into one SamplecError."""
    source: str
    items: list[Diagnostic] = field(default_factory=list)

    def error(self, message: str, span: Span | None) -> None:
        self.items.append(Diagnostic("error", message, span))

    def warning(self, message: str, span: Span | None) -> None:
        self.items.append(Diagnostic("warning", message, span))

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.items if d.severity == "error"]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.items if d.severity == "warning"]

    def raise_if_errors(self) -> None:
        if self.errors:
            first = self.errors[0]
            raise SamplecError(first.message, tuple(self.errors), self.source)
