"""A chat choice's text as the message it answers with, for `samplec serve`: the model's thinking as `reasoning`
(samplec.reasoning), the rest as `content`, and the tool calls in it (samplec.tools) -- whole (`message`) or as
the deltas of a stream (`delta`), which put together are the whole."""
from __future__ import annotations

from samplec import reasoning, tools


class Reply:
    def __init__(self, req, tokenizer, prompt: list[int]):
        self.req, self.tokenizer = req, tokenizer
        self.think = reasoning.thinking(tokenizer, prompt, req.grammar is not None)
        self.calls = tools.Stream(req.tools, tokenizer) if req.tools is not None else None

    def _reasoning(self, text: str) -> dict:
        # (mlx-lm's server names it `reasoning`, vLLM's parsers `reasoning_content` and now `reasoning` too:
        # both, where the model thought and the request did not turn it off)
        if not text or not self.req.include_reasoning:
            return {}
        return {"reasoning": text, "reasoning_content": text}

    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """A finished choice's message fields (content, tool_calls, reasoning) and its finish reason."""
        thought = ""
        if self.think is not None:
            thought, text = self.think.split(text)
        if self.req.tools is None:
            message = {"content": text}
        else:
            message, finish = tools.answer(self.req.tools, self.tokenizer, text, finish)
        return {**message, **self._reasoning(thought)}, finish

    def delta(self, text: str, final: bool) -> dict:
        """The delta of a chunk that adds `text` to the choice (`final`: its last)."""
        thought = ""
        if self.think is not None:
            thought, text = self.think.feed(text)
            if final:
                more, rest = self.think.finish()
                thought, text = thought + more, text + rest
        if self.calls is not None:
            d = self.calls.delta(text, final)
        else:
            d = {"content": text} if text else {}
        return {**self._reasoning(thought), **d}

    def finish_reason(self, finish: str) -> str:
        return self.calls.finish_reason(finish) if self.calls is not None else finish
