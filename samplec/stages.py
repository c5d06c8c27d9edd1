"""The stage library's signatures: one table that the checker, the lowering and the docs read.

Each stage parameter names the kinds of argument it accepts (a literal of some type, or a sampler parameter of
some type), its default, and the range its values must lie in (checked at compile time for literals and at run
time for parameters).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

NO_DEFAULT = object()

PARAM_TYPES = ("float", "int", "seed", "tokens", "mask", "bias", "state")
SCALAR_TYPES = ("float", "int", "seed")


@dataclass(frozen=True)
class Range:
    """A closed/open interval check. `lo_open`/`hi_open` make an end exclusive. NaN is always out of range."""
    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, v: float) -> bool:
        if v != v:
            return False
        if self.lo_open and not v > self.lo or not self.lo_open and not v >= self.lo:
            return False
        if self.hi_open and not v < self.hi or not self.hi_open and not v <= self.hi:
            return False
        return True

    def describe(self) -> str:
        lo = "(" if self.lo_open else "["
        hi = ")" if self.hi_open else "]"
        f = lambda v: "inf" if v == math.inf else "-inf" if v == -math.inf else repr(v)
        return f"{lo}{f(self.lo)}, {f(self.hi)}{hi}"


    @staticmethod
    def parse(text: str) -> "Range":
        """Inverse of describe(): "(0.0, 1.0]" -> Range(0.0, 1.0, lo_open=True)."""
        lo, hi = text.strip()[1:-1].split(",")
        return Range(float(lo), float(hi), text.strip()[0] == "(", text.strip()[-1] == ")")


ANY = Range()


@dataclass(frozen=True)
class StageParam:
    name: str
    type: str                     # float | int | seed | tokens | mask | bias | bias_or_dict | state | tokens_or_list
    default: object = NO_DEFAULT  # a Python number; NO_DEFAULT (required); None (sample's seed: fresh OS entropy)
    range: Range = ANY
    literal_ok: bool = True       # False: must be a sampler parameter (tokens, mask)


@dataclass(frozen=True)
class StageSig:
    name: str
    params: tuple[StageParam, ...]
    terminal: bool = False
    doc: str = ""


def _sig(name, *params, terminal=False, doc=""):
    return StageSig(name, tuple(params), terminal, doc)


U64 = Range(0, 2**64 - 1)
FINITE = Range(lo_open=True, hi_open=True)

STAGES: dict[str, StageSig] = {s.name: s for s in [
    _sig("temperature", StageParam("t", "float", range=Range(0)),
         doc="t > 0: x / t; t == 0: keep only argmax"),
    _sig("top_k", StageParam("k", "int"), doc="keep x >= k-th largest (ties kept); k <= 0 or k >= V is off"),
    _sig("top_p", StageParam("p", "float", range=Range(0, 1, lo_open=True)), doc="nucleus; p >= 1 is off"),
    _sig("min_p", StageParam("m", "float", range=Range(0, 1)), doc="keep p >= m * max(p)"),
    _sig("typical_p", StageParam("m", "float", range=Range(0)), doc="locally typical sampling; m >= 1 is off"),
    _sig("top_n_sigma", StageParam("n", "float"), doc="keep x >= max - n * std; n <= 0 is off"),
    _sig("xtc", StageParam("threshold", "float"), StageParam("probability", "float", range=Range(0, 1)),
         StageParam("seed", "seed", range=U64), StageParam("position", "int", default=0),
         doc="exclude top choices"),
    _sig("penalties", StageParam("history", "tokens", literal_ok=False),
         StageParam("last_n", "int", default=-1, range=Range(-1)),
         StageParam("repeat", "float", default=1.0, range=Range(0, lo_open=True, hi_open=True)),
         StageParam("frequency", "float", default=0.0, range=FINITE),
         StageParam("presence", "float", default=0.0, range=FINITE),
         doc="repetition / frequency / presence penalties over a token history"),
    _sig("logit_bias", StageParam("b", "bias_or_dict"), doc="x + b"),
    _sig("allow", StageParam("mask", "mask", literal_ok=False), doc="remove tokens whose mask is false"),
    # v2 (spec §6): the samplers of llama.cpp and Hugging Face, with the semantics of the system that defined them
    _sig("dynamic_temperature", StageParam("t", "float", range=Range(0)),
         StageParam("range", "float", range=Range(0, hi_open=True)),
         StageParam("exponent", "float", default=1.0, range=Range(0, hi_open=True)),
         doc="llama.cpp temp_ext: temperature by normalized entropy; range == 0 is temperature(t)"),
    _sig("epsilon", StageParam("e", "float", range=Range(0, 1, hi_open=True)),
         doc="HF EpsilonLogitsWarper: keep p >= e (and the most probable); e == 0 is off"),
    _sig("eta", StageParam("e", "float", range=Range(0, 1, hi_open=True)),
         doc="HF EtaLogitsWarper: keep p >= min(e, sqrt(e) exp(-H)) (and the most probable); e == 0 is off"),
    _sig("dry", StageParam("history", "tokens", literal_ok=False),
         StageParam("multiplier", "float", range=Range(0, hi_open=True)),
         StageParam("base", "float", default=1.75, range=Range(1, hi_open=True)),
         StageParam("allowed_length", "int", default=2, range=Range(0)),
         StageParam("last_n", "int", default=-1, range=Range(-1)),
         StageParam("breakers", "tokens_or_list", default=()),
         doc="llama.cpp DRY: penalize tokens that would extend a repeat of the history; multiplier == 0 is off"),
    _sig("mirostat", StageParam("mu", "state", literal_ok=False),
         StageParam("tau", "float", range=Range(0, lo_open=True, hi_open=True)),
         StageParam("eta", "float", range=Range(0, hi_open=True)),
         StageParam("m", "int", default=100, range=Range(1)),
         StageParam("seed", "seed", default=None, range=U64), StageParam("position", "int", default=0),
         terminal=True, doc="llama.cpp mirostat v1: top-k from the estimated Zipf exponent, draw, update mu"),
    _sig("mirostat_v2", StageParam("mu", "state", literal_ok=False),
         StageParam("tau", "float", range=Range(0, lo_open=True, hi_open=True)),
         StageParam("eta", "float", range=Range(0, hi_open=True)),
         StageParam("seed", "seed", default=None, range=U64), StageParam("position", "int", default=0),
         terminal=True, doc="llama.cpp mirostat v2: keep -log2 p <= mu, draw, update mu"),
    _sig("greedy", terminal=True, doc="argmax, lowest id on ties"),
    _sig("sample", StageParam("seed", "seed", default=None, range=U64), StageParam("position", "int", default=0),
         terminal=True, doc="Gumbel-max draw from softmax(x)"),
]}

# Outputs: name -> (takes an integer argument, needs a terminal)
OUTPUTS: dict[str, tuple[bool, bool]] = {
    "token": (False, True),
    "logprob": (False, True),
    "raw_logprob": (False, True),
    "top_logprobs": (True, True),
    "probs": (False, False),
    "candidates": (True, False),
}

# Stages the foundation supports end to end; the rest parse and type-check and are refused with a clear message.
SUPPORTED = {"temperature", "top_k", "top_p", "min_p", "greedy", "sample",
             "typical_p", "top_n_sigma", "xtc", "penalties", "logit_bias", "allow",
             "dynamic_temperature", "epsilon", "eta", "dry", "mirostat", "mirostat_v2"}


# Stateful stages: slot holding the state -> how a missing state starts (a function of the stage's other args).
# A `state` parameter is f32 [B]; left out at run time (or NaN in a row) it starts at this value.
STATE_START = {"mirostat": "2 * tau", "mirostat_v2": "2 * tau"}
