"""OpenAI's Responses API (`POST /v1/responses`) for `samplec serve`, over the chat machinery.

A Responses request is read as the chat request it amounts to (`to_chat`: `instructions` a system message first,
`input` the messages -- a string one user message; `function_call` and `function_call_output` items an assistant's
calls and tool messages --, `max_output_tokens`, `text.format` as `response_format`, flat function tools as chat's
nested ones), so that every check, the sampling, the tools and the log-probabilities are the chat endpoint's; the
answer is written back as a Response object (`response`) or as its stream of typed events (`Events`).

OpenAI's conversation state (`Store`): a Response created with `store` (OpenAI's default) is kept in memory with the
conversation it was generated from -- its input's messages after any previous response's, without `instructions`
-- and its output as the assistant messages that follow (`carried`: text and calls; a reasoning item's thinking is
not carried, as vLLM's); `previous_response_id` starts the next request's messages with them (the new request's
instructions first, as OpenAI's: a previous response's are not carried over). The store is bounded (the least
recently used response goes first) and shared by the server's threads. `conversation` (OpenAI's Conversations API)
is refused.
"""
from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import OrderedDict

# fields taken as they are by the chat request (sampling values of samplec's and vLLM's, the seed, ...)
PASSED = {"model", "temperature", "top_p", "stream", "parallel_tool_calls", "user", "metadata", "service_tier",
          "safety_identifier", "prompt_cache_key", "seed", "samplec_sampler", "logit_bias", "presence_penalty",
          "frequency_penalty", "top_k", "min_p", "repetition_penalty", "repetition_context_size",
          "presence_context_size", "frequency_context_size", "xtc_probability", "xtc_threshold", "stop",
          "stop_token_ids", "min_tokens", "ignore_eos", "skip_special_tokens", "allowed_token_ids",
          "include_stop_str_in_output", "chat_template_kwargs"}
OWN = {"input", "instructions", "max_output_tokens", "text", "tools", "tool_choice", "top_logprobs", "include",
       "store", "truncation", "reasoning", "stream_options", "background", "previous_response_id", "conversation",
       "max_tool_calls", "prompt"}
INCLUDES = {"message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
            "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
            "computer_call_output.output.image_url", "code_interpreter_call.outputs"}
LOGPROBS = "message.output_text.logprobs"
# the chat request's field -> the Responses request's, for the errors the chat checks raise
NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
         "response_format.json_schema": "text.format", "stream_options": "stream_options",
         "reasoning_effort": "reasoning.effort"}


class RequestError(ValueError):
    """A Responses request at fault: the message, the field and the HTTP status (a previous response not stored: 404,
    with OpenAI's code)."""

    def __init__(self, message: str, field: str, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.field, self.status, self.code = field, status, code


class Store:
    """Stored Responses, at most `capacity` (0: none are kept), the least recently used (created, read or continued)
    evicted first: id -> (the Response, the conversation a next response continues: its chat messages, without
    instructions, ending with the response's output). One lock: the server answers on many threads."""

    def __init__(self, capacity: int = 1000):
        self.capacity = capacity
        self.items: OrderedDict[str, tuple[dict, tuple]] = OrderedDict()
        self.lock = threading.Lock()

    def keep(self, answer: "Answer", response: dict) -> None:
        """A finished Response (completed or incomplete) of a request stored (`answer.stored`)."""
        if not answer.stored:
            return
        conversation = tuple(answer.conversation) + tuple(carried(response["output"]))
        with self.lock:
            self.items[answer.id] = (response, conversation)
            self.items.move_to_end(answer.id)
            while len(self.items) > self.capacity:
                self.items.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, tuple] | None:
        with self.lock:
            item = self.items.get(rid)
            if item is not None:
                self.items.move_to_end(rid)
            return item

    def delete(self, rid: str) -> bool:
        with self.lock:
            return self.items.pop(rid, None) is not None

    def __len__(self) -> int:
        return len(self.items)


def carried(output: list[dict]) -> list[dict]:
    """A Response's output as the chat messages a next request continues from: its message and function_call items
    read as input items are (the same conversation sent whole gives the same prompt); a reasoning item is dropped,
    as vLLM drops it (input items cannot carry one either, and chat templates leave earlier turns' thinking out)."""
    items = [i for i in output if i["type"] in ("message", "function_call")]
    return _messages(items, []) if items else []


def field_name(chat_field: str | None, origins: list | None = None) -> str | None:
    """The Responses request's name for a field the chat checks named: `messages[k]...` the input item (or
    `instructions`) chat message k came from (`origins`, as `to_chat` filled it: a merged assistant message's
    `tool_calls[j]` is its j-th function_call item), a tool's `tools[i].function.X` the flat tool's `tools[i].X`,
    `response_format...` `text.format...`."""
    if chat_field is None:
        return None
    m = re.match(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function)?)?(.*)$", chat_field)
    if m:
        k, j, rest = int(m.group(1)), m.group(2), m.group(3)
        if origins is None or k >= len(origins):
            return "input"
        where = origins[k][int(j)] if j is not None and int(j) < len(origins[k]) else origins[k][0]
        rest = {".tool_call_id": ".call_id", ".id": ".call_id"}.get(rest, rest)
        return where + ("" if where in ("instructions", "previous_response_id") else rest)
    m = re.match(r"(tools\[\d+\])\.function(.*)$", chat_field)
    if m:
        return m.group(1) + m.group(2)
    for chat, own in (("response_format.json_schema", "text.format"), ("response_format", "text.format")):
        if chat_field.startswith(chat + "."):
            return own + chat_field[len(chat):]
    return NAMES.get(chat_field, chat_field)


def to_chat(body, origins: list | None = None, store: Store | None = None) -> dict:
    """The chat request a Responses request amounts to (RequestError names the Responses field at fault);
    `origins`, where given, is filled with where each chat message came from (for `field_name`). A
    `previous_response_id` is looked up in `store`: its conversation follows the instructions, before the input."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    for name in body:
        if name not in PASSED and name not in OWN:
            raise RequestError(f"unrecognized request argument supplied: {name}", name)
    if body.get("conversation") is not None:
        raise RequestError("conversation: not supported by samplec serve (OpenAI's Conversations API: continue a "
                           "stored response with previous_response_id, or send the whole conversation in input)",
                           "conversation")
    if body.get("prompt") is not None:
        raise RequestError("prompt: not supported by samplec serve (it stores no prompts)", "prompt")
    previous = body.get("previous_response_id")
    history: tuple = ()
    if previous is not None:
        if not isinstance(previous, str):
            raise RequestError("previous_response_id must be a string", "previous_response_id")
        item = store.get(previous) if store is not None else None
        if item is None:        # (OpenAI's answer: never stored, stored with store false, evicted or deleted)
            raise RequestError(f"Previous response with id '{previous}' not found.", "previous_response_id", 404,
                               "previous_response_not_found")
        history = item[1]
    if body.get("background"):
        raise RequestError("background: not supported by samplec serve", "background")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
            raise RequestError("reasoning must be {\"effort\": ..., \"summary\": ...}", "reasoning")
        if reasoning.get("summary") not in (None, "auto", "concise", "detailed") or \
                reasoning.get("generate_summary") not in (None, "auto", "concise", "detailed"):
            raise RequestError("reasoning.summary must be auto, concise or detailed", "reasoning.summary")
    if body.get("truncation") not in (None, "disabled"):
        raise RequestError("truncation: only \"disabled\" is supported (a conversation past the context is a 400)",
                           "truncation")
    if body.get("max_tool_calls") is not None:
        raise RequestError("max_tool_calls: not supported by samplec serve", "max_tool_calls")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise RequestError("store must be true or false", "store")
    chat = {k: v for k, v in body.items() if k in PASSED}
    if reasoning is not None and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]      # (the chat request's: checked there)
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict) or set(so) - {"include_obfuscation"}:
            raise RequestError("stream_options: only {\"include_obfuscation\": bool} is supported", "stream_options")
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("instructions must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    where = [["instructions"]] if instructions is not None else []
    messages += history
    where += [["previous_response_id"] for _ in history]
    messages += _messages(body.get("input"), where)
    if origins is not None:
        origins[:] = where
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise RequestError("include must be a list of strings", "include")
    for i, name in enumerate(include):
        if name not in INCLUDES:
            raise RequestError(f"include[{i}]: unknown value {name!r}", f"include[{i}]")
    top = body.get("top_logprobs")
    if LOGPROBS in include:
        chat["logprobs"] = True
        if top is not None:
            chat["top_logprobs"] = top
    elif top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise RequestError(f"top_logprobs must be an integer in [0, 20], got {json.dumps(top)[:40]}",
                               "top_logprobs")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and not isinstance(body["text"], dict):
        raise RequestError("text must be an object: {\"format\": ...}", "text")
    if isinstance(body.get("text"), dict) and set(body["text"]) - {"format", "verbosity"}:
        raise RequestError(f"text.{sorted(set(body['text']) - {'format', 'verbosity'})[0]}: not supported", "text")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise RequestError("text.format: type must be text, json_object or json_schema", "text.format")
        if fmt["type"] == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise RequestError("text.format: a json_schema format has a schema (an object)", "text.format")
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "response"), "schema": fmt["schema"], "strict": fmt.get("strict")}}
        elif fmt["type"] == "json_object":
            chat["response_format"] = {"type": "json_object"}
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        if isinstance(choice, dict) and choice.get("type") == "function":
            if not isinstance(choice.get("name"), str):
                raise RequestError("tool_choice: {\"type\": \"function\", \"name\": ...}", "tool_choice")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif choice in ("none", "auto", "required"):
            chat["tool_choice"] = choice
        else:
            raise RequestError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                               "\"name\": ...}", "tool_choice")
    return chat


def _text(content, where: str, key: str = "content") -> str:
    """A message item's content (or a function_call_output's `output`: `key`) as text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") or \
                    not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.{key}[{j}]: only text parts (input_text, output_text) are supported",
                                   f"{where}.{key}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}.{key} must be a string or a list of text parts", f"{where}.{key}")


def _messages(items, origins: list) -> list[dict]:
    """`input` as chat messages: a string one user message; each message item a message, consecutive
    function_call items one assistant message of calls, each function_call_output a tool message (`origins`:
    each message's input items, appended)."""
    if isinstance(items, str):
        origins.append(["input"])
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("input must be a string or a non-empty list of items", "input")
    out = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where}: an item is an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{where}.role must be user, assistant, system or developer", f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), where)})
            origins.append([where])
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise RequestError(f"{where}.{key} must be a string", f"{where}.{key}")
            c = {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(c)
                origins[-1].append(where)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [c]})
                origins.append([where])
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{where}.call_id must be a string", f"{where}.call_id")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(output, where, "output")})
            origins.append([where])
        else:
            raise RequestError(f"{where}: items of type {kind!r} are not supported (message, function_call and "
                               "function_call_output are)", where)
    return out


def _tools(given) -> list[dict]:
    """Responses' flat function tools as chat's (`{"type": "function", "function": {...}}`)."""
    if not isinstance(given, list):
        raise RequestError("tools must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(given):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise RequestError(f"tools[{i}]: only function tools are supported", f"tools[{i}]")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Answer:
    """One Response being written: its request, its id and the fields every event repeats. `named`: a function
    named by tool_choice is called (its arguments stream, and a call cut short is `incomplete`); `auto`: calls are
    read out of the model's text (blank text around them is no message). `stored`: kept once finished (`store`
    not false, and a store that keeps any); `conversation`: the chat messages it is generated from, without the
    instructions (what a next response continues, before this one's output)."""

    def __init__(self, body: dict, chat: dict, model: str, store: Store | None = None):
        self.body, self.chat = body, chat
        self.stored = body.get("store") is not False and store is not None and store.capacity > 0
        self.conversation = chat["messages"][1:] if body.get("instructions") is not None else chat["messages"]
        self.id, self.created = _id("resp"), int(time.time())
        self.model = model
        self.message_id, self.reasoning_id = _id("msg"), _id("rs")
        self.origins: list = []         # (where each chat message came from: to_chat's, for field_name)
        choice = chat.get("tool_choice", "auto" if chat.get("tools") else "none")
        self.named = isinstance(choice, dict)
        self.auto = choice == "auto" and bool(chat.get("tools"))

    def frame(self, status: str, output: list, usage: dict | None, finish: str | None = None,
              error: dict | None = None) -> dict:
        """The Response object (`status`: in_progress, completed, incomplete or failed)."""
        b = self.body
        text = b.get("text") if isinstance(b.get("text"), dict) else {}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "max_tool_calls": None, "model": self.model, "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "reasoning": {"effort": (b.get("reasoning") or {}).get("effort"),
                          "summary": (b.get("reasoning") or {}).get("summary")},
            "service_tier": b.get("service_tier") or "default",
            "store": self.stored, "temperature": b.get("temperature", 1.0),
            "text": {"format": text.get("format") or {"type": "text"}, "verbosity": text.get("verbosity", "medium")},
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
            "top_logprobs": b.get("top_logprobs", 0), "top_p": b.get("top_p", 1.0), "truncation": "disabled",
            "usage": usage, "user": b.get("user"), "metadata": b.get("metadata") or {},
        }

    @staticmethod
    def usage(prompt: int, done: int) -> dict:
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": done, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + done}

    @staticmethod
    def status(finish: str) -> str:
        return "incomplete" if finish == "length" else "completed"

    def message(self, text: str, logprobs, status: str) -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": [part]}

    def call_status(self, status: str) -> str:
        """A finished call's status: a named function's arguments the length limit cut are incomplete (a call read
        out of the text, or `required`'s, is whole when it is read at all)."""
        return "incomplete" if self.named and status == "incomplete" else "completed"

    def reasoning(self, text: str, status: str) -> dict:
        """A reasoning model's thinking as a reasoning item (its text the content, no summary)."""
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}

    def function_call(self, c: dict, status: str = "completed") -> dict:
        return {"type": "function_call", "id": _id("fc"), "call_id": c["id"], "name": c["function"]["name"],
                "arguments": c["function"]["arguments"], "status": status}


def logprobs(entries: list[dict]) -> list[dict]:
    """Chat's logprobs entries as an output_text part's."""
    return [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
             "top_logprobs": [{"token": a["token"], "logprob": a["logprob"], "bytes": a["bytes"]}
                              for a in e["top_logprobs"]]} for e in entries]


def response(answer: Answer, message: dict, finish: str, entries: list | None, usage: dict) -> dict:
    """A finished Response: the message's text (where it has any, or where it made no call) and its calls."""
    status = answer.status(finish)
    output = [answer.reasoning(message["reasoning"], status)] if message.get("reasoning") else []
    content = message.get("content")
    if content or not message.get("tool_calls"):
        output.append(answer.message(content or "", logprobs(entries) if entries is not None else None, status))
    output += [answer.function_call(c, answer.call_status(status)) for c in message.get("tool_calls") or ()]
    return answer.frame(status, output, usage, finish)


class Events:
    """A Response's stream of typed events, each numbered from 0 (`sequence_number`), from the chat stream's deltas
    (`tools.Stream`'s), in OpenAI's order: `response.created`, `response.in_progress`; per output item
    `response.output_item.added`, its content (`response.content_part.added`, `response.output_text.delta`...,
    `response.output_text.done`, `response.content_part.done`; or `response.function_call_arguments.delta`...,
    `response.function_call_arguments.done`), `response.output_item.done`; then `response.completed` (or
    `response.incomplete` where max_output_tokens cut it, as OpenAI's). A call read whole out of the text is done
    at once; the message stays open to the end (text the model writes between its calls is the one message's, as
    the answer not streamed has it); under `auto` blank text is held until more comes (blank text beside calls is
    no message)."""

    def __init__(self, answer: Answer):
        self.answer, self.n = answer, 0
        self.output: list[dict] = []
        self.text, self.text_index = None, None        # the message item being written, and its place
        self.calls: dict[int, int] = {}                 # a call's index -> its output item's place
        self.arguments: dict[int, str] = {}
        self.done: set[int] = set()                     # the places of the items already done
        self.entries: list = []
        self.held, self.held_entries = "", []           # (auto: blank text not yet a message)
        self.thought, self.thought_place = None, None   # the reasoning item being written, and its place

    def _event(self, kind: str, **fields) -> dict:
        e = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return e

    def start(self) -> list[dict]:
        frame = self.answer.frame("in_progress", [], None)
        return [self._event("response.created", response=frame), self._event("response.in_progress", response=frame)]

    def delta(self, d: dict, entries: list | None) -> list[dict]:
        """The events of one chat delta (content, tool_calls) and its tokens' logprobs entries."""
        out = []
        if d.get("reasoning"):
            out += self._think(d["reasoning"])
        lp = logprobs(entries) if entries is not None else []
        text = d.get("content") or ""
        if (text or d.get("tool_calls")) and self.thought is not None and self.thought_place not in self.done:
            out += self._close(self.thought_place, "completed")
        if text:
            if self.text is None and self.answer.auto and not (self.held + text).strip():
                self.held, self.held_entries = self.held + text, self.held_entries + lp
            else:
                out += self._write(text, lp)
        elif lp:
            # (tokens of no text of the message's: thinking, a call being written, `required`'s array -- their
            # entries go to the message, as the answer not streamed has them all, once there is one: none is
            # opened for them)
            if self.text is not None:
                out += self._write("", lp)
            else:
                self.held_entries += lp
        for c in d.get("tool_calls") or ():
            k = c["index"]
            if k not in self.calls:
                item = {"type": "function_call", "id": _id("fc"), "call_id": c["id"], "name": c["function"]["name"],
                        "arguments": "", "status": "in_progress"}
                self.calls[k], self.arguments[k] = len(self.output), ""
                self.output.append(item)
                out.append(self._event("response.output_item.added", output_index=self.calls[k], item=dict(item)))
            piece = c["function"].get("arguments") or ""
            if piece:
                self.arguments[k] += piece
                item = self.output[self.calls[k]]
                out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=self.calls[k], delta=piece))
            if not self.answer.named:       # (read whole out of the text: done now)
                out += self._close(self.calls[k], "completed")
        return out

    def _think(self, text: str) -> list[dict]:
        out = []
        if self.thought is None:
            self.thought, self.thought_place = "", len(self.output)
            item = {"type": "reasoning", "id": self.answer.reasoning_id, "summary": [], "content": [],
                    "status": "in_progress"}
            self.output.append(item)
            out += [self._event("response.output_item.added", output_index=self.thought_place, item=dict(item)),
                    self._event("response.content_part.added", item_id=item["id"], output_index=self.thought_place,
                                content_index=0, part={"type": "reasoning_text", "text": ""})]
        self.thought += text
        out.append(self._event("response.reasoning_text.delta", item_id=self.answer.reasoning_id,
                               output_index=self.thought_place, content_index=0, delta=text))
        return out

    def _write(self, text: str, lp: list) -> list[dict]:
        out = []
        if self.text is None:
            out += self._open_message()
        text, lp = self.held + text, self.held_entries + lp
        self.held, self.held_entries = "", []
        self.text += text
        self.entries += lp
        out.append(self._event("response.output_text.delta", item_id=self.answer.message_id,
                               output_index=self.text_index, content_index=0, delta=text, logprobs=lp))
        return out

    def _open_message(self) -> list[dict]:
        self.text, self.text_index = "", len(self.output)
        item = {"type": "message", "id": self.answer.message_id, "status": "in_progress", "role": "assistant",
                "content": []}
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=self.text_index, item=dict(item)),
                self._event("response.content_part.added", item_id=self.answer.message_id,
                            output_index=self.text_index, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _close(self, place: int, status: str, with_logprobs: bool = False) -> list[dict]:
        """An output item's closing events (its content's, then `response.output_item.done`)."""
        out, item = [], self.output[place]
        if item["type"] == "reasoning":
            done = self.answer.reasoning(self.thought, status)
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=place,
                                   content_index=0, text=self.thought))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=place,
                                   content_index=0, part=done["content"][0]))
        elif item["type"] == "message":
            done = self.answer.message(self.text, self.entries if with_logprobs else None, status)
            part = done["content"][0]
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=place,
                                   content_index=0, text=self.text, logprobs=part["logprobs"]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=place,
                                   content_index=0, part=part))
        else:
            k = next(k for k, p in self.calls.items() if p == place)
            done = {**item, "arguments": self.arguments[k], "status": self.answer.call_status(status)}
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=place, arguments=self.arguments[k], name=item["name"]))
        self.output[place] = done
        self.done.add(place)
        out.append(self._event("response.output_item.done", output_index=place, item=done))
        return out

    def finish(self, finish: str, usage: dict, with_logprobs: bool) -> list[dict]:
        """The closing events: each item not yet done, then the whole Response."""
        status = self.answer.status(finish)
        out = []
        if self.thought is not None and self.thought_place not in self.done:
            out += self._close(self.thought_place, status)
        if self.text is None and not self.calls:        # (no call: the text is the message, however blank)
            out += self._open_message()
        if self.text is not None and (self.held or self.held_entries):
            out += self._write("", [])
        for place in range(len(self.output)):
            if place not in self.done:
                out += self._close(place, status, with_logprobs)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self._event(kind, response=self.answer.frame(status, self.output, usage, finish)))
        return out

    def error(self, message: str, param: str | None, status: int) -> list[dict]:
        """A generation that failed: OpenAI's `error` event, then `response.failed` (the Response with its error)."""
        code = "invalid_prompt" if status < 500 else "server_error"
        e = self._event("error", code=code, message=message, param=param)
        return [e, self._event("response.failed", response=self.answer.frame(
            "failed", self.output, None, error={"code": code, "message": message}))]


def stream_lines(event: dict) -> bytes:
    """One event as server-sent events write it (its type as the event's name, as OpenAI's)."""
    return f"event: {event['type']}\n".encode() + b"data: " + json.dumps(event).encode() + b"\n\n"

