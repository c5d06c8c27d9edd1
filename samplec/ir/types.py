"""IR value types: a dtype and a symbolic shape such as `f32[B,V]` (dims are symbols or integers)."""
from __future__ import annotations

import re
from dataclasses import dataclass

F32, I32, U32, U64, BOOL = "f32", "i32", "u32", "u64", "bool"
DTYPES = (F32, I32, U32, U64, BOOL)

Dim = str | int


class TypeError_(Exception):
    """A typing rule was violated while building or verifying IR."""


@dataclass(frozen=True)
class Type:
    dtype: str
    shape: tuple[Dim, ...]

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"

    @staticmethod
    def parse(text: str) -> "Type":
        m = re.fullmatch(r"(\w+)\[([\w,]*)\]", text.strip())
        if not m or m.group(1) not in DTYPES:
            raise ValueError(f"bad type {text!r}")
        dims = tuple(int(d) if d.isdigit() else d for d in m.group(2).split(",") if d)
        return Type(m.group(1), dims)


def broadcast(*shapes: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """numpy broadcasting over symbolic dims: equal dims, or one of them 1."""
    first = shapes[0]
    if len(shapes) == 2 and shapes[1] == first or all(s == first for s in shapes):
        return first
    rank = max(len(s) for s in shapes)
    out: list[Dim] = []
    for i in range(rank):
        dims = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0} - {1}
        if len(dims) > 1:
            raise TypeError_(f"shapes do not broadcast: {', '.join(str(list(s)) for s in shapes)}")
        out.append(dims.pop() if dims else 1)
    return tuple(out)
