"""A reasoning model's thinking told from its answer, for `samplec serve`: what the model writes between its think
markers (`<think>` ... `</think>` for Qwen's and DeepSeek's, and the others mlx-lm knows: mlx-lm's TokenizerWrapper
reads them off the vocabulary) is the message's `reasoning` -- as mlx-lm's server and vLLM's reasoning parsers give
it -- and the rest its content. A prompt that opened a think block (a template that writes `<think>` after the
assistant's header) starts the answer in it, as mlx-lm's server reads the prompt."""
from __future__ import annotations

from samplec.spans import Spans


def thinking(tokenizer, prompt: list[int], constrained: bool = False):
    """The choice's splitter, or None for a tokenizer without think markers. `constrained`: a grammar constrains
    the output from its first token (samplec's grammars are not held off until the thinking ends, as vLLM's
    reasoning-aware structured outputs are), so what it writes is the answer, even after a prompt that opened a
    think block (think markers the grammar itself writes are still read)."""
    if not getattr(tokenizer, "has_thinking", False) or not tokenizer.think_start or not tokenizer.think_end:
        return None
    initial = getattr(tokenizer, "response_initial_state", None)
    if constrained:
        inside = False
    elif initial in ("reasoning", "normal"):
        inside = initial == "reasoning"
    else:
        inside = tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)
    return Thinking(tokenizer.think_start, tokenizer.think_end, inside)


def marker_ids(tokenizer) -> set[int]:
    """The think markers' token ids where each is one token (they write their text in a choice that reads them)."""
    ids = set()
    for name in ("think_start_tokens", "think_end_tokens"):
        marker = getattr(tokenizer, name, None) if getattr(tokenizer, "has_thinking", False) else None
        if marker is not None and len(marker) == 1:
            ids.add(int(marker[0]))
    return ids


class Thinking:
    """`feed(text)` -> (reasoning, content) of the text added; `finish()` the rest."""

    def __init__(self, start: str, end: str, inside: bool):
        self.spans = Spans(start, end, inside)

    def feed(self, text: str) -> tuple[str, str]:
        return self._take(self.spans.feed(text))

    def finish(self) -> tuple[str, str]:
        return self._take(self.spans.finish())

    def split(self, text: str) -> tuple[str, str]:
        """A whole text's reasoning and content."""
        r, c = self.feed(text)
        r2, c2 = self.finish()
        return r + r2, c + c2

    @staticmethod
    def _take(events) -> tuple[str, str]:
        reasoning = "".join(t for kind, t in events if kind == "in")
        return reasoning, "".join(t for kind, t in events if kind == "out")
