"""Fuzz the front end: mutated and generated `.smp` sources through `samplec.compile`.

Every case must give a Program or a SamplecError whose message starts with a location (`<fuzz>:line:col:`) -- or
an error about the whole file (no sampler, too large). Anything else is a traceback; over HANG_S is a hang.
"""
from __future__ import annotations

import random
import re
import time
from pathlib import Path

import samplec
from fuzz.common import HANG_S, Counts, Deadline

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LOCATED = re.compile(r"^<fuzz>:\d+:\d+: (error|warning): ")
WHOLE_FILE = ("no sampler", "characters; the limit is")
PIECES = ["9" * 5000, "-" + "9" * 60, "1e999", "-1e-999", "inf", "-inf", "nan", "0x10", "1_000", "\r", "\r\n",
          "\x0b", "\x0c", "\x85", "\u2028", "\u2029", "\t", "\x00", "{", "}", "(", ")", "[", "]", ",", ";", ":",
          "->", "=", "#", "sampler", "top_k", "logit_bias({1: 2.0})", "{2: 1e39}", "[3, -4]", "seed", "tokens",
          "state", "float", "int", "é", "\ufeff", "'", '"', "top_logprobs(99999999999)", "candidates(0)"]


def mutate(src: str, rng: random.Random) -> str:
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(src) + 1)
        op = rng.random()
        if op < 0.35:
            src = src[:i] + rng.choice(PIECES) + src[i:]
        elif op < 0.55:
            src = src[:i] + src[i + rng.randint(1, 8):]
        elif op < 0.75 and src:
            j = rng.randrange(len(src))
            src = src[:i] + src[j:j + rng.randint(1, 40)] + src[i:]
        elif op < 0.9 and src:
            j = rng.randrange(len(src))
            src = src[:j] + chr(rng.randrange(32, 0x3000)) + src[j + 1:]
        else:
            src = src[:i] + re.sub(r"\d+(\.\d+)?", lambda m: rng.choice(PIECES[:6]), src[i:i + 80], count=1) + \
                src[i + 80:]
    return src


STAGE_FORMS = ["temperature({f})", "top_k({i})", "top_p({p})", "min_p({p})", "typical_p({p})", "top_n_sigma({f})",
               "xtc({p}, {p}, seed)", "penalties(h, last_n = {i}, repeat = {f})", "logit_bias({{{i}: {f}}})",
               "epsilon({p})", "eta({p})", "dynamic_temperature({f}, {f})"]


def generate(rng: random.Random) -> str:
    num = {"f": lambda: rng.choice(["0.7", "1", "2.5", "0", "1e-3", "inf"]),
           "i": lambda: rng.choice(["0", "1", "40", "-1", "100000"]),
           "p": lambda: rng.choice(["0.1", "0.9", "1.0", "0.5"])}
    stages = []
    for _ in range(rng.randint(0, 6)):
        form = rng.choice(STAGE_FORMS)
        stages.append(re.sub(r"\{(\w)\}", lambda m: num[m.group(1)](), form))
    stages.append(rng.choice(["greedy()", "sample(seed)", "sample(seed, position = 3)"]))
    outs = rng.choice(["", "-> token", "-> token, logprob", "-> token, top_logprobs(3)", "-> token, probs"])
    return f"sampler g(seed: seed, h: tokens) {outs} {{ {' '.join(stages)} }}"


def one(src: str, counts: Counts) -> None:
    t = time.perf_counter()
    try:
        samplec.compile(src, filename="<fuzz>")
        kind, what = "ok", ""
    except samplec.SamplecError as e:
        text = str(e)
        located = LOCATED.match(text) or any(w in text for w in WHOLE_FILE)
        kind, what = ("rejected", "") if located else ("traceback", "unlocated error: " + text[:200])
    except Exception as e:  # noqa: BLE001 - counted, not raised
        kind, what = "traceback", f"{type(e).__name__}: {e}"
    if time.perf_counter() - t > HANG_S:
        kind, what = "hang", f"{time.perf_counter() - t:.1f} s"
    counts.record(kind, src, what)


def fuzz(seconds: float, seed: int = 0) -> Counts:
    rng = random.Random(seed)
    seeds = [p.read_text(encoding="utf-8") for p in sorted(EXAMPLES.glob("*.smp"))]
    counts = Counts("source")
    deadline = Deadline(seconds)
    while deadline:
        src = generate(rng) if rng.random() < 0.3 else mutate(rng.choice(seeds), rng)
        one(src, counts)
    return counts
