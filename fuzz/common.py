"""What every fuzz target reports: how many cases it tried and what became of each.

A case ends one of four ways:
- ok: it did what the spec says (a valid input ran and matched the expectation, or a bad input was refused
  with samplec's own error that names what was wrong),
- traceback: an exception that is not a `SamplecError` (or, for the CLI/server, a traceback printed / a 5xx),
- hang: it took longer than the per-case limit,
- silent: no error, but the result is wrong (different tokens, a corrupted program that loads as another one,
  a bad value accepted).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

HANG_S = 2.0


@dataclass
class Counts:
    target: str
    cases: int = 0
    ok: int = 0
    rejected: int = 0          # of the ok cases, how many were bad inputs refused with a clear error
    tracebacks: int = 0
    hangs: int = 0
    silent: int = 0
    examples: list = field(default_factory=list)    # up to 10 (kind, input repr, what happened)

    def record(self, kind: str, case=None, what: str = "") -> None:
        """kind: 'ok', 'rejected', 'traceback', 'hang' or 'silent'."""
        self.cases += 1
        if kind in ("ok", "rejected"):
            self.ok += 1
            self.rejected += kind == "rejected"
            return
        setattr(self, {"traceback": "tracebacks", "hang": "hangs", "silent": "silent"}[kind],
                getattr(self, {"traceback": "tracebacks", "hang": "hangs", "silent": "silent"}[kind]) + 1)
        if len(self.examples) < 10:
            self.examples.append((kind, repr(case)[:300], what[:300]))

    @property
    def failures(self) -> int:
        return self.tracebacks + self.hangs + self.silent

    def line(self) -> str:
        return (f"{self.target:<12} cases {self.cases:>7}  ok {self.ok:>7} (rejected {self.rejected})  "
                f"tracebacks {self.tracebacks}  hangs {self.hangs}  silent {self.silent}")


class Deadline:
    """`while deadline:` runs until `seconds` have passed (at least one case)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.first = True

    def __bool__(self) -> bool:
        if self.first:
            self.first = False
            return True
        return time.monotonic() < self.end
