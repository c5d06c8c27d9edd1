"""Parser for the textual IR written by `printer.py`; `parse(print_graph(g))` prints the same text."""
from __future__ import annotations

import json
import re

from samplec.ir.graph import INPUT, Check, Graph, Node, Param, make
from samplec.ir.ops import OPS
from samplec.ir.types import Type


class IRParseError(Exception):
    pass


_PARAM = re.compile(r"param %([\w.]+): (\S+) (\w+)(?: = (\S+))?(?: range (.+))?")
_INSTR = re.compile(r"%([\w.]+) = (\w+)((?: %[\w.]+,?)*)(?: \{(.*)\})? : (\S+)")
_CHECK = re.compile(r"check %([\w.]+) (\".*\")")
_OUTPUT = re.compile(r"output ([\w.]+) = %([\w.]+)")


def parse_scalar(text: str):
    text = text.strip()
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if text in ("inf", "-inf", "nan"):
        return float(text)
    try:
        return float(text)
    except ValueError:
        return text   # a bare word (dtype, "os")


def _split_attrs(text: str) -> list[tuple[str, str]]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        cur += ch
    if cur.strip():
        out.append(cur)
    pairs = []
    for item in out:
        k, _, v = item.partition("=")
        pairs.append((k.strip(), v.strip()))
    return pairs


def _attr_value(kind: str, text: str):
    if kind in ("ints", "floats"):
        inner = text.strip()[1:-1].strip()
        vals = [parse_scalar(x) for x in inner.split(",")] if inner else []
        return tuple(int(v) if kind == "ints" else float(v) for v in vals)
    return parse_scalar(text)


def parse(text: str) -> Graph:
    lines = [ln.strip() for ln in text.strip().splitlines()]
    m = re.fullmatch(r"sampler @([\w.]+) \{", lines[0]) if lines else None
    if not m or lines[-1] != "}":
        raise IRParseError("expected 'sampler @name { ... }'")
    env: dict[str, Node] = {}
    params, checks, outputs = [], [], []
    for lineno, line in enumerate(lines[1:-1], start=2):
        try:
            if mm := _PARAM.fullmatch(line):
                name, typ, kind, default, rng = mm.groups()
                node = Node(INPUT, (), (), Type.parse(typ), name)
                env[name] = node
                params.append(Param(name, kind, node, None if default is None else parse_scalar(default), rng))
            elif mm := _INSTR.fullmatch(line):
                name, op, operands, attrs, typ = mm.groups()
                if op not in OPS:
                    raise IRParseError(f"unknown op {op!r}")
                ins = [env[o.strip().lstrip("%")] for o in operands.replace(",", " ").split()]
                kinds = dict(OPS[op].attrs)
                a = {k: _attr_value(kinds.get(k, ""), v) for k, v in _split_attrs(attrs or "")}
                node = make(op, *ins, name=None if name.isdigit() else name, **a)
                if str(node.type) != typ:
                    raise IRParseError(f"type {typ} does not match the inferred {node.type}")
                env[name] = node
            elif mm := _CHECK.fullmatch(line):
                checks.append(Check(env[mm.group(1)], json.loads(mm.group(2))))
            elif mm := _OUTPUT.fullmatch(line):
                outputs.append((mm.group(1), env[mm.group(2)]))
            else:
                raise IRParseError("unrecognised line")
        except KeyError as e:
            raise IRParseError(f"line {lineno}: undefined value %{e.args[0]}") from None
        except IRParseError as e:
            raise IRParseError(f"line {lineno}: {e}: {line}") from None
        except Exception as e:
            raise IRParseError(f"line {lineno}: {e}: {line}") from None
    return Graph(m.group(1), tuple(params), tuple(outputs), tuple(checks))
