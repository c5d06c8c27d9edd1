"""Hostile sources: numeric literals of any size or form, every line terminator, sizes past the documented limits.
Each gives a program or a located diagnostic (file:line:col and a caret on the right line) -- never another
exception -- with work that grows linearly in the source (counted in function calls, not timed)."""
from __future__ import annotations

import re

import pytest

import samplec
from samplec.frontend.check import LIMITS
from samplec.frontend.parser import MAX_SOURCE_CHARS

BIG = "9" * 5000


def diagnose(src: str) -> str:
    with pytest.raises(samplec.SamplecError) as e:
        samplec.compile(src)
    text = str(e.value)
    assert re.match(r"<string>:\d+:\d+: error: ", text), text[:300]
    return text


@pytest.mark.parametrize("src, words", [
    (f"sampler s() {{ top_k({BIG}) greedy() }}", "does not fit in a 32-bit int"),
    (f"sampler s() {{ top_k(-{BIG}) greedy() }}", "does not fit in a 32-bit int"),
    (f"sampler s(k: int = {BIG}) {{ top_k(k) greedy() }}", "does not fit in a 32-bit int"),
    (f"sampler s(seed: seed = {BIG}) {{ sample(seed) }}", "out of range"),
    (f"sampler s(seed: seed) {{ sample(seed, position = {BIG}) }}", "does not fit in a 32-bit int"),
    (f"sampler s() {{ logit_bias({{{BIG}: 1.0}}) greedy() }}", "out of range"),
    (f"sampler s() {{ logit_bias({{3: {BIG}}}) greedy() }}", "float32 range"),
    ("sampler s() { logit_bias({3: 1e39}) greedy() }", "float32 range"),
    (f"sampler s() {{ temperature({BIG}.5) sample() }}", "float32 range"),
    ("sampler s() { temperature(1e999) sample() }", "float32 range"),
    ("sampler s() { top_p(1e-50) sample() }", "out of range"),          # 0 as a float32
    ("sampler s(t: float = 1e39) { temperature(t) sample() }", "float32 range"),
    (f"sampler s() -> token, top_logprobs({BIG}) {{ greedy() }}", "more than"),
    (f"sampler s() -> candidates({BIG}) {{ top_k(3) }}", "more than"),
    (f"sampler s(h: tokens) {{ dry(h, 0.8, breakers = [{BIG}]) greedy() }}", "out of range"),
])
def test_numeric_literals_of_any_size(src, words):
    assert words in diagnose(src)


def test_inf_written_as_inf_still_means_infinity():
    samplec.compile("sampler s() { temperature(inf) min_p(0) sample() }")


@pytest.mark.parametrize("nl", ["\n", "\r\n", "\r"])
def test_every_line_break_counts_alike(nl):
    src = nl.join(["# a comment", "sampler s() {", "  top_k(40)", "  top_k(2.5)", "  greedy()", "}"])
    text = diagnose(src)
    head, line, caret = text.split("\n")[:3]
    assert head.startswith("<string>:4:9: error:") and line == "  top_k(2.5)" and caret == "        ^~~", text
    samplec.compile(src.replace("top_k(2.5)", "top_k(2)"))


def test_form_feed_is_white_space():
    samplec.compile("sampler s() {\n  top_k(4)\x0c greedy()\n}")


@pytest.mark.parametrize("odd", ["\x0b", "\x85", "\u2028", "\u2029"])
def test_other_terminators_are_characters_on_their_line(odd):
    """Python's splitlines() breaks lines there, lark does not: the caret is drawn under the line the position
    counts (they are characters on the line, and unexpected ones)."""
    src = f"sampler s() {{\n  top_k(4){odd} greedy()\n}}"
    text = diagnose(src)
    head, line, caret = text.split("\n")[:3]
    assert head.startswith("<string>:2:11:"), text
    assert line == f"  top_k(4){odd} greedy()" and caret.index("^") == 10, text


def test_limits_are_located_errors():
    n = LIMITS["stages in a sampler"]
    text = diagnose("sampler s() { " + "top_k(3) " * (n + 1) + "greedy() }")
    assert f"the limit is {n}" in text
    n = LIMITS["parameters of a sampler"]
    text = diagnose("sampler s(" + ", ".join(f"p{i}: float = 1.0" for i in range(n + 1)) + ") { greedy() }")
    assert f"the limit is {n}" in text
    n = LIMITS["samplers in a file"]
    text = diagnose("\n".join(f"sampler s{i}() {{ greedy() }}" for i in range(n + 1)))
    assert text.startswith(f"<string>:{n + 1}:9:")
    text = diagnose("sampler s() { logit_bias({" + ", ".join(f"{i}: 1.0" for i in range(LIMITS[
        "entries in a logit_bias dict"] + 1)) + "}) greedy() }")
    assert "pass a bias parameter" in text
    with pytest.raises(samplec.SamplecError, match="characters; the limit is"):
        samplec.compile("#" * (MAX_SOURCE_CHARS + 1))


def calls_to_compile(src: str) -> int:
    """The Python function calls samplec.compile(src) makes: a measure of its work that does not depend on the
    machine's load."""
    import sys
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        count += event == "call"
    sys.setprofile(profile)
    try:
        samplec.compile(src)
    finally:
        sys.setprofile(None)
    return count


def test_compile_work_is_linear_up_to_the_limit():
    """Ten times the stages (up to the 999-stage limit) cost about ten times the work, not a hundred."""
    def chain(n):
        return "sampler s(t: float, k: int, seed: seed) { " + "top_k(k) temperature(t) " * (n // 2) + "sample(seed) }"
    samplec.compile(chain(10))          # (the first compile's one-time work: the grammar, imports)
    small, large = calls_to_compile(chain(100)), calls_to_compile(chain(999))
    assert large < 15 * small, (small, large)


def test_many_errors_render_briefly():
    """A thousand errors on one long line: each shows a window of the line, and the rendering stops at 50."""
    text = diagnose("sampler s() { " + "top_k(2.5) " * 999 + "greedy() }")
    assert len(text) < 20_000 and text.endswith("... and 949 more")
