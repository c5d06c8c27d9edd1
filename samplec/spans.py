"""Marked spans of a text that grows: what a model writes between two markers (`<think>` ... `</think>`,
`<tool_call>` ... `</tool_call>`) told from the text around it, as the text arrives in pieces of any size."""
from __future__ import annotations


class Spans:
    """`feed(text)` gives the events of the text added: ("out", text) outside a span, ("in", text) inside one,
    ("close", "") where a span ends; the markers themselves are not given. Characters that might begin a marker
    are held back until the next piece tells (`finish` gives them). `inside`: whether the text starts in a span (a
    prompt that opened one). An empty `end` marker: a span runs to the end of the text."""

    def __init__(self, start: str, end: str, inside: bool = False):
        self.start, self.end, self.inside = start, end, inside
        self.pending = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.pending += text
        out = []
        while True:
            marker = self.end if self.inside else self.start
            i = self.pending.find(marker) if marker else -1
            if i < 0:
                keep = _partial(self.pending, marker)
                given = self.pending[:len(self.pending) - keep]
                if given:
                    out.append(("in" if self.inside else "out", given))
                self.pending = self.pending[len(self.pending) - keep:]
                return out
            if i:
                out.append(("in" if self.inside else "out", self.pending[:i]))
            self.pending = self.pending[i + len(marker):]
            if self.inside:
                out.append(("close", ""))
            self.inside = not self.inside

    def finish(self) -> list[tuple[str, str]]:
        """The events of the characters held back (the text's end: no marker can begin there any more)."""
        out = self.feed("")
        if self.pending:
            out.append(("in" if self.inside else "out", self.pending))
        self.pending = ""
        return out


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
