"""Tool calling for `samplec serve`: OpenAI's `tools` and `tool_choice`, answered as vLLM's and mlx-lm's servers
answer them.

- `none`: the tools reach the chat template (as vLLM passes them), the answer is text.
- `auto` (the default when tools are given): the model writes its calls in its own format; the tokenizer's tool
  parser (mlx-lm's, inferred from the chat template: `<tool_call>` ... `</tool_call>` for Qwen's and Hermes'
  templates, and others) reads them out of the text (`Calls`). A tokenizer without one cannot answer `auto`.
- `required` and a named function: the output is constrained by a grammar (the JSON schema of `forced_schema`, as
  vLLM's structured outputs build it), so any model answers with well-formed calls (`forced_calls` reads them).

The answer's `tool_calls` are OpenAI's: `{"id", "type": "function", "function": {"name", "arguments"}}`, the
arguments a JSON string.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from samplec.spans import Spans


class ToolError(ValueError):
    """A request's tools or tool_choice at fault: the message and the field."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Tools:
    """A request's tools: `functions` (the request's `tools` as the chat template receives them), `choice` ("none",
    "auto", "required" or "named"), `name` (the named function's) and `parallel` (parallel_tool_calls: false keeps
    one call)."""
    functions: tuple
    choice: str
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def parameters(self, name: str) -> dict:
        for t in self.functions:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object", "properties": {}}
        raise KeyError(name)


def parse(body: dict) -> Tools | None:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls` (ToolError names the field at fault); None
    without tools (tool_choice then "none" or absent)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(f"parallel_tool_calls must be true or false, got {json.dumps(parallel)[:100]}",
                        "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ToolError("tool_choice: a tool choice other than \"none\" needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    names, functions = set(), []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"),
                                                                                                  dict):
            raise ToolError(f"{where}: a tool is {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            "\"parameters\": ...}}}} (function tools only)", where)
        f = t["function"]
        extra = set(f) - {"name", "description", "parameters", "strict"}
        if extra:
            raise ToolError(f"{where}.function.{sorted(extra)[0]}: not a field of a function", f"{where}.function")
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        if name in names:
            raise ToolError(f"{where}.function.name: {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema (an object)",
                            f"{where}.function.parameters")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise ToolError(f"{where}.function.strict must be true or false", f"{where}.function.strict")
        functions.append({"type": "function", "function": {k: v for k, v in f.items() if v is not None}})
    if choice is None or choice in ("none", "auto", "required"):
        return Tools(tuple(functions), choice or "auto", None, parallel is not False)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        name = choice["function"]["name"]
        if name not in names:
            raise ToolError(f"tool_choice: no tool named {name!r} among the request's tools", "tool_choice")
        return Tools(tuple(functions), "named", name, parallel is not False)
    raise ToolError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
                    "{\"name\": ...}}", "tool_choice")


def forced_schema(tools: Tools) -> dict:
    """The JSON schema a forced choice's output follows: a named function's parameters; for `required` an array of
    at least one {"name", "parameters"} object of the tools' (vLLM's), at most one without parallel tool calls."""
    if tools.choice == "named":
        return tools.parameters(tools.name)
    one = [{"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                           "parameters": tools.parameters(t["function"]["name"])},
            "required": ["name", "parameters"]} for t in tools.functions]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": one}}
    if not tools.parallel:
        schema["maxItems"] = 1
    defs = {}
    for i, t in enumerate(tools.functions):   # (each function's own $defs, where its parameters refer to them, at
        own = (t["function"].get("parameters") or {}).get("$defs", {})      # the root; one name, one schema: vLLM's)
        for name, d in own.items() if isinstance(own, dict) else ():
            if name in defs and defs[name] != d:
                raise ToolError(f"tools[{i}].function.parameters: the definition '{name}' differs from another "
                                "tool's of that name, which tool_choice \"required\" cannot tell apart (rename it)",
                                f"tools[{i}].function.parameters")
            defs[name] = d
    if defs:
        schema["$defs"] = defs
    return schema


def call(name: str, arguments) -> dict:
    """One entry of an answer's `tool_calls` (arguments: a JSON string, or a value written as one)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name,
                                                                                    "arguments": args}}


def forced_calls(tools: Tools, text: str) -> list[dict] | None:
    """A forced choice's output read as its calls. A named function's output is its call's arguments however far
    they came (one cut by max_tokens or a stop string too, as vLLM's: the stream has sent them as the call's; no
    output, no call); `required`'s is None where it is not the array the grammar writes (cut short: it stays
    text)."""
    if tools.choice == "named":
        return [call(tools.name, text)] if text else None
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                              for c in calls):
        return None
    return [call(c["name"], c.get("parameters", {})) for c in calls]


def template_message(m: dict, where: str) -> dict:
    """A tool message or an assistant message's tool_calls, checked, as chat templates read them (the arguments a
    JSON object where they are one, as vLLM and mlx-lm pass them)."""
    out = {}
    if m["role"] == "tool":
        tid = m.get("tool_call_id")
        if tid is not None and not isinstance(tid, str):
            raise ToolError(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        if tid is not None:
            out["tool_call_id"] = tid
        return out
    calls = m.get("tool_calls")
    if calls is None:
        return out
    if not isinstance(calls, list):
        raise ToolError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out["tool_calls"] = []
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
            raise ToolError(f"{w}: a tool call is {{\"id\", \"type\": \"function\", \"function\": {{\"name\": str, "
                            "\"arguments\": str}}}}", w)
        try:
            args = json.loads(f["arguments"])
        except ValueError:
            args = f["arguments"]
        entry = {"type": "function", "function": {"name": f["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            entry["id"] = c["id"]
        out["tool_calls"].append(entry)
    return out


class Calls:
    """`auto`: a choice's text split, as it grows, into its content and the calls the model wrote in its tokenizer's
    format (between `start` and `end`; `parse` is the tokenizer's tool parser). `feed` takes the text added and
    gives back the content that can be sent and the calls completed; `finish` the rest. Text that might begin a
    call is held back; a call that does not parse -- or that the choice's end cut short and does not parse -- is
    given back as content, markers included (nothing the model wrote is lost)."""

    def __init__(self, start: str, end: str, parse, tools: Tools):
        self.spans, self.parse, self.tools = Spans(start, end), parse, tools
        self.body, self.calls = "", 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        return self._take(self.spans.feed(text))

    def finish_with(self, text: str) -> tuple[str, list[dict]]:
        """A whole text's content and calls."""
        content, calls = self.feed(text)
        more, rest = self.finish()
        return content + more, calls + rest

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = self._take(self.spans.finish())
        if self.spans.inside:       # (a call the choice's end left open: read if it parses, else text)
            got = self._parsed(self.body)
            if got is None:
                content += self.spans.start + self.body
            else:
                calls += got
            self.spans.inside = False
        self.body = ""
        return content, calls

    def _take(self, events) -> tuple[str, list[dict]]:
        content, calls = "", []
        for kind, text in events:
            if kind == "out":
                content += text
            elif kind == "in":
                self.body += text
            else:
                got = self._parsed(self.body)
                if got is None:
                    content += self.spans.start + self.body + self.spans.end
                else:
                    calls += got
                self.body = ""
        return content, calls

    def _parsed(self, body: str) -> list[dict] | None:
        if not self.tools.parallel and self.calls:
            return []            # (parallel_tool_calls false: the first call only)
        try:
            got = self.parse(body, list(self.tools.functions))
        except Exception:  # noqa: BLE001 - a parser's own errors (JSON, a format it does not know): the text stays
            return None
        got = got if isinstance(got, list) else [got]
        if not all(isinstance(g, dict) and isinstance(g.get("name"), str) for g in got):
            return None
        if not self.tools.parallel:
            got = got[:1]
        self.calls += len(got)
        return [call(g["name"], g.get("arguments", {})) for g in got]


def splitter(tokenizer, tools: Tools) -> Calls:
    """`auto`'s reader of the calls in a choice's text, in the tokenizer's format (mlx-lm's TokenizerWrapper)."""
    return Calls(tokenizer.tool_call_start, tokenizer.tool_call_end or "", tokenizer.tool_parser, tools)


def finish_reason(tools: Tools, finish: str, called: bool) -> str:
    """vLLM's: "tool_calls" where a choice that stopped on its own made calls under `auto` or `required`; a named
    function's answer keeps "stop" (as OpenAI's forced function calls do)."""
    return "tool_calls" if called and finish == "stop" and tools.choice in ("auto", "required") else finish


def answer(tools: Tools, tokenizer, text: str, finish: str) -> tuple[dict, str]:
    """A finished choice's message fields (content, and tool_calls where it made calls) and its finish reason."""
    if tools.choice == "none":
        return {"content": text}, finish
    if tools.choice == "auto":
        content, calls = splitter(tokenizer, tools).finish_with(text)
    else:
        calls = forced_calls(tools, text)
        content = text if calls is None else ""
    if not calls:
        return {"content": content}, finish
    return {"content": content if content.strip() else None, "tool_calls": calls}, finish_reason(tools, finish, True)


class Stream:
    """A streamed choice's deltas with tool calls: `delta(text, final)` turns the text the choice added into the
    chunk's delta -- content, and each call as one `tool_calls` entry once it is whole (`auto`, `required`); a named
    function's arguments stream as they come, as vLLM's."""

    def __init__(self, tools: Tools, tokenizer):
        self.tools = tools
        self.split = splitter(tokenizer, tools) if tools.choice == "auto" else None
        self.held, self.calls, self.called = "", 0, False

    def delta(self, text: str, final: bool) -> dict:
        t = self.tools
        if t.choice == "none":
            return {"content": text} if text else {}
        if t.choice == "named":
            if not text:
                return {}
            entry = {"index": 0, "function": {"arguments": text}}
            if not self.called:
                first = call(t.name, "")
                entry = {"index": 0, "id": first["id"], "type": "function",
                         "function": {"name": t.name, "arguments": text}}
                self.called = True
            return {"tool_calls": [entry]}
        if t.choice == "auto":
            content, calls = self.split.feed(text)
            if final:
                more, rest = self.split.finish()
                content, calls = content + more, calls + rest
        else:           # (required: the calls are read from the whole output)
            self.held += text
            if not final:
                return {}
            calls = forced_calls(t, self.held)
            content = self.held if calls is None else ""
            calls = calls or []
        out = {"content": content} if content else {}
        if calls:
            out["tool_calls"] = [{"index": self.calls + i, **c} for i, c in enumerate(calls)]
            self.calls += len(calls)
            self.called = True
        return out

    def finish_reason(self, finish: str) -> str:
        return finish_reason(self.tools, finish, self.called)
