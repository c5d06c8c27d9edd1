"""Importers: the sampling settings of another system as an equivalent `.smp` sampler, in that system's stage order.

    import_source("hf", "generation_config.json")    # Hugging Face transformers' generation config
    import_source("llama-cpp", "flags.txt")           # a llama.cpp command line (its sampling flags)
    import_source("openai", "request.json")           # an OpenAI chat-completions request body

Each importer reads what decides the next-token distribution, applies the system's own defaults, and writes the
stages in the order that system applies them (documented beside each importer below). Settings samplec cannot
express (beam search, mirostat, DRY, grammars, ...) are errors rather than silently dropped; settings that do not
touch sampling (model, messages, max_tokens, eos ids, ...) are ignored, and listed in a comment where useful.
Every imported sampler takes `seed: seed` (the system's seed as default when it has one), `pos: int = 0` (pass
the token's position, spec §4) and, when it penalizes repeats, `history: tokens`.
"""
from __future__ import annotations

import json
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from samplec.diagnostics import SamplecError

__all__ = ["import_source", "from_hf", "from_llama_cpp", "from_openai", "KINDS"]


# ---- the sampler being written ----

def _num(v) -> str:
    """A literal the DSL reads back exactly (ints as ints, floats by repr: 0.95, 1e-05, inf)."""
    if isinstance(v, bool):
        raise SamplecError(f"expected a number, got {v!r}")
    if isinstance(v, int):
        return str(v)
    f = float(v)
    if math.isnan(f):
        raise SamplecError("NaN is not a valid setting")
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    return repr(f)


@dataclass
class _Sampler:
    name: str
    origin: str
    stages: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=lambda: ["token", "logprob"])
    seed: int | None = None          # the default of `seed`, None: required
    sampled: bool = True             # False: greedy() terminal
    notes: list[str] = field(default_factory=list)

    def stage(self, name: str, *args, **kw) -> None:
        parts = [a if isinstance(a, str) else _num(a) for a in args]
        parts += [f"{k} = {v if isinstance(v, str) else _num(v)}" for k, v in kw.items()]
        self.stages.append(f"{name}({', '.join(parts)})")

    def render(self) -> str:
        if self.sampled and self.stages and self.stages[-1] == "temperature(0.0)":
            self.sampled = False             # only the most likely token is left: no draw, no seed
            self.notes.append("temperature 0: greedy decoding")
        body = "\n".join(self.stages)
        uses_history = "history" in body
        uses_seed = self.sampled or "seed" in body
        params = []
        if uses_seed:
            params.append("seed: seed" + ("" if self.seed is None else f" = {self.seed}"))
            params.append("pos: int = 0")
        if uses_history:
            params.append("history: tokens")
        terminal = "sample(seed, position = pos)" if self.sampled else "greedy()"
        lines = [f"# {self.origin}", *(f"# {n}" for n in self.notes)]
        lines.append(f"sampler {self.name}({', '.join(params)}) -> {', '.join(self.outputs)} {{")
        lines += [f"    {s}" for s in [*self.stages, terminal]]
        lines.append("}")
        return "\n".join(lines) + "\n"


def _number(name: str, value, kind: type = float, lo: float = -math.inf, hi: float = math.inf,
            lo_open: bool = False):
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SamplecError(f"{name}: expected a number, got {value!r}")
    try:
        if kind is int and isinstance(value, int):
            v = value
        elif kind is int and isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            v = int(value.strip())                      # exact, even past 2**53 (seeds)
        else:
            v = float(value)
            if kind is int:
                if v != int(v):
                    raise ValueError
                v = int(v)
    except (TypeError, ValueError, OverflowError):
        raise SamplecError(f"{name}: expected {'an integer' if kind is int else 'a number'}, got {value!r}") \
            from None
    if v != v or v < lo or v > hi or (lo_open and v == lo):
        lo_b = "(" if lo_open else "["
        raise SamplecError(f"{name} = {value!r} is out of range {lo_b}{_num(lo)}, {_num(hi)}]")
    return v


_TYPICAL_NOTE = ("typical_p: samplec always keeps the most likely token; {} drops it when it is atypical "
                 "(the only difference)")

# ---- Hugging Face transformers: generation_config.json ----

# GenerationConfig's defaults (transformers 5.x `_get_default_generation_params`)
_HF_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None,
                "typical_p": 1.0, "repetition_penalty": 1.0, "num_beams": 1}
# settings that change the distribution but have no samplec equivalent: (key, value that means "off")
_HF_UNSUPPORTED = {
    "num_beams": 1, "penalty_alpha": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None,
    "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0,
    "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "guidance_scale": None, "min_length": 0,
    "min_new_tokens": None, "exponential_decay_length_penalty": None, "watermarking_config": None,
    "force_words_ids": None, "constraints": None, "dola_layers": None, "assistant_model": None,
}


def from_hf(config: dict, name: str = "hf_generation") -> str:
    """transformers' `generate()` with this generation config.

    Order (transformers `GenerationMixin._get_logits_processor`): the repetition penalty (over all input ids,
    prompt included, multiplicative: `x < 0 ? x * r : x / r`) comes first; then, only when `do_sample`, the
    warpers temperature, top-k (default 50 when unset), top-p, min-p, typical-p; then a draw from the result.
    Without `do_sample` the result is the argmax (greedy) of the penalized logits.
    """
    if not isinstance(config, dict):
        raise SamplecError("a generation config must be a JSON object")
    cfg = {**_HF_DEFAULTS, **{k: v for k, v in config.items() if v is not None or k not in _HF_DEFAULTS}}
    for key, off in _HF_UNSUPPORTED.items():
        value = config.get(key, off)
        if value is None or value == off or value in ([], {}) or \
                (key == "penalty_alpha" and value == 0) or (key == "guidance_scale" and value == 1):
            continue
        raise SamplecError(f"{key} = {value!r}: not expressible as a samplec sampler chain "
                           "(only per-token sampling settings can be imported)")
    out = _Sampler(name, "imported from a Hugging Face generation config (transformers' processor order)")
    do_sample = cfg["do_sample"]
    if not isinstance(do_sample, bool):
        raise SamplecError(f"do_sample: expected true or false, got {do_sample!r}")
    r = _number("repetition_penalty", cfg["repetition_penalty"], lo=0.0, lo_open=True)
    if r != 1.0:
        out.stage("penalties", "history", repeat=r)
        out.notes.append("history = the prompt and the generated tokens (transformers penalizes all input ids)")
    if not do_sample:
        out.sampled = False
        out.notes.append("do_sample is false: greedy decoding (temperature, top_k, top_p, ... do not apply)")
        return out.render()
    t = _number("temperature", cfg["temperature"], lo=0.0, lo_open=True)
    if t != 1.0:
        out.stage("temperature", t)
    k = _number("top_k", cfg["top_k"], int, lo=0)
    if k != 0:
        out.stage("top_k", k)
    p = _number("top_p", cfg["top_p"], lo=0.0, hi=1.0, lo_open=True)
    if p < 1.0:
        out.stage("top_p", p)
    if cfg["min_p"] is not None:
        m = _number("min_p", cfg["min_p"], lo=0.0, hi=1.0)
        if m > 0:
            out.stage("min_p", m)
    typ = _number("typical_p", cfg["typical_p"], lo=0.0, hi=1.0, lo_open=True)
    if typ < 1.0:
        out.stage("typical_p", typ)
        out.notes.append(_TYPICAL_NOTE.format("transformers"))
    eos = config.get("eos_token_id")
    if eos is not None:
        out.notes.append(f"eos_token_id: {eos}")
    return out.render()


# ---- llama.cpp: a command line's sampling flags ----

_LLAMA_SAMPLER_NAMES = {
    "penalties": "penalties", "dry": "dry", "top_n_sigma": "top_n_sigma", "top_k": "top_k", "typ_p": "typ_p",
    "top_p": "top_p", "min_p": "min_p", "xtc": "xtc", "temperature": "temperature", "infill": "infill",
    "adaptive_p": "adaptive_p", "nucleus": "top_p", "temp": "temperature", "typ": "typ_p",
}
for _canon in list(_LLAMA_SAMPLER_NAMES):
    if "_" in _canon:
        _LLAMA_SAMPLER_NAMES.setdefault(_canon.replace("_", "-"), _LLAMA_SAMPLER_NAMES[_canon])
        _LLAMA_SAMPLER_NAMES.setdefault(_canon.replace("_", ""), _LLAMA_SAMPLER_NAMES[_canon])
_LLAMA_SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                        "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}
# common/common.h `common_params_sampling`
_LLAMA_DEFAULTS = {"temp": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typ_p": 1.0, "top_n_sigma": -1.0,
                   "xtc_probability": 0.0, "xtc_threshold": 0.1, "penalty_last_n": 64, "penalty_repeat": 1.0,
                   "penalty_freq": 0.0, "penalty_present": 0.0, "dry_multiplier": 0.0, "dynatemp_range": 0.0,
                   "mirostat": 0, "adaptive_target": -1.0, "seed": 0xFFFFFFFF,
                   "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                                "temperature"]}
_LLAMA_FLAGS = {   # flag -> setting (all take a value)
    "--temp": "temp", "--temperature": "temp", "--top-k": "top_k", "--top-p": "top_p", "--min-p": "min_p",
    "--top-nsigma": "top_n_sigma", "--top-n-sigma": "top_n_sigma", "--xtc-probability": "xtc_probability",
    "--xtc-threshold": "xtc_threshold", "--typical": "typ_p", "--typical-p": "typ_p",
    "--repeat-last-n": "penalty_last_n", "--repeat-penalty": "penalty_repeat",
    "--presence-penalty": "penalty_present", "--frequency-penalty": "penalty_freq", "--samplers": "samplers",
    "--sampler-seq": "sampler_seq", "--sampling-seq": "sampler_seq", "-s": "seed", "--seed": "seed",
    "-l": "logit_bias", "--logit-bias": "logit_bias", "--dry-multiplier": "dry_multiplier",
    "--dynatemp-range": "dynatemp_range", "--mirostat": "mirostat", "--adaptive-target": "adaptive_target",
    # read but without effect while the feature above is off
    "--dry-base": None, "--dry-allowed-length": None, "--dry-penalty-last-n": None,
    "--dry-sequence-breaker": None, "--dynatemp-exp": None, "--mirostat-lr": None, "--mirostat-ent": None,
    "--adaptive-decay": None,
}
_LLAMA_REFUSED = {   # flags that constrain or change sampling in ways a sampler chain cannot express
    "--grammar": "grammars", "--grammar-file": "grammars", "-j": "JSON schemas", "--json-schema": "JSON schemas",
    "-jf": "JSON schemas", "--json-schema-file": "JSON schemas",
    "--ignore-eos": "--ignore-eos (it biases the model's EOS token to -inf; use allow(mask) with your model's "
                    "EOS id)",
}


def _llama_argv(text: str) -> list[str]:
    lines = [ln for ln in text.replace("\\\r\n", " ").replace("\\\n", " ").splitlines()
             if not ln.lstrip().startswith("#")]
    try:
        return shlex.split(" ".join(lines))
    except ValueError as e:
        raise SamplecError(f"cannot split the command line: {e}") from None


def _is_value(tok: str) -> bool:
    if not tok.startswith("-"):
        return True
    try:
        float(tok)
        return True
    except ValueError:
        return False


def from_llama_cpp(argv: list[str] | str, name: str = "llama_cpp") -> str:
    """llama.cpp (`llama-cli`, `llama-server`, ...) with these flags.

    Order (common/sampling.cpp `common_sampler_init`): `--logit-bias` first, then the `--samplers` list (default
    `penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature`), then the final draw. Defaults are
    llama.cpp's (temp 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat-last-n 64, no repeat penalty). The penalties
    count the last `--repeat-last-n` tokens of the sequence, prompt included (llama.cpp feeds the prompt to the
    sampler). `--temp 0` (or less) keeps only the most likely token. A seed of -1 / 4294967295 (llama.cpp's
    "random") leaves the sampler's seed required.
    """
    args = _llama_argv(argv) if isinstance(argv, str) else list(argv)
    if args and not args[0].startswith("-"):
        args = args[1:]                      # the program name
    s = dict(_LLAMA_DEFAULTS)
    biases: dict[int, float] = {}
    ignored: list[str] = []
    i = 0
    while i < len(args):
        tok = args[i]
        flag, eq, inline = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        if flag in _LLAMA_REFUSED:
            raise SamplecError(f"{flag}: {_LLAMA_REFUSED[flag]} cannot be imported into a sampler chain")
        if flag not in _LLAMA_FLAGS:
            if not tok.startswith("-"):
                raise SamplecError(f"unexpected argument {tok!r} (expected llama.cpp flags)")
            has_value = not eq and i + 1 < len(args) and _is_value(args[i + 1])
            ignored.append(tok + (f" {args[i + 1]}" if has_value else ""))
            i += 2 if has_value else 1
            continue
        if eq:
            value = inline
            i += 1
        elif i + 1 < len(args):
            value = args[i + 1]
            i += 2
        else:
            raise SamplecError(f"{flag}: missing value")
        key = _LLAMA_FLAGS[flag]
        if key is None:
            continue
        if key == "samplers":
            names = [n.strip().lower() for n in value.split(";") if n.strip()]
            bad = [n for n in names if n not in _LLAMA_SAMPLER_NAMES]
            if bad:
                raise SamplecError(f"--samplers: unknown sampler '{bad[0]}' "
                                   f"(llama.cpp knows: {', '.join(_LLAMA_DEFAULTS['samplers'])}, ...)")
            s["samplers"] = [_LLAMA_SAMPLER_NAMES[n] for n in names]
        elif key == "sampler_seq":
            bad = [c for c in value if c not in _LLAMA_SAMPLER_CHARS]
            if bad:
                raise SamplecError(f"{flag}: unknown sampler letter '{bad[0]}' "
                                   f"(known: {''.join(_LLAMA_SAMPLER_CHARS)})")
            s["samplers"] = [_LLAMA_SAMPLER_CHARS[c] for c in value]
        elif key == "logit_bias":
            tid, bias = _llama_bias(value)
            biases[tid] = biases.get(tid, 0.0) + bias
        elif key == "seed":
            s["seed"] = _number(flag, value, int) & 0xFFFFFFFF     # llama.cpp keeps a uint32 (-1: random)
        else:
            s[key] = _number(flag, value, int if key in ("top_k", "penalty_last_n", "mirostat") else float)

    for key, what in (("mirostat", "--mirostat"), ("dry_multiplier", "--dry-multiplier (DRY)"),
                      ("dynatemp_range", "--dynatemp-range (dynamic temperature)")):
        if s[key] != 0:
            raise SamplecError(f"{what} = {s[key]}: not expressible as a samplec sampler chain")
    if s["adaptive_target"] >= 0 or "adaptive_p" in s["samplers"]:
        raise SamplecError("the adaptive-p sampler is not expressible as a samplec sampler chain")
    if "infill" in s["samplers"]:
        raise SamplecError("the infill sampler is not expressible as a samplec sampler chain")

    out = _Sampler(name, "imported from llama.cpp sampling flags (common_sampler_init's order)")
    if biases:
        out.stage("logit_bias", "{" + ", ".join(f"{t}: {_num(b)}" for t, b in sorted(biases.items())) + "}")
    for smp in s["samplers"]:
        if smp == "penalties":
            last_n = s["penalty_last_n"]
            if last_n < -1:
                raise SamplecError(f"--repeat-last-n = {last_n}: expected -1 (whole context), 0 (off) or more")
            if last_n == 0 or (s["penalty_repeat"] == 1 and s["penalty_freq"] == 0 and s["penalty_present"] == 0):
                continue
            if not (s["penalty_repeat"] > 0 and math.isfinite(s["penalty_repeat"])):
                raise SamplecError("--repeat-penalty must be finite and greater than 0")
            kw = {"last_n": last_n}
            if s["penalty_repeat"] != 1:
                kw["repeat"] = s["penalty_repeat"]
            if s["penalty_freq"] != 0:
                kw["frequency"] = s["penalty_freq"]
            if s["penalty_present"] != 0:
                kw["presence"] = s["penalty_present"]
            out.stage("penalties", "history", **kw)
        elif smp == "dry":
            continue                                        # off (dry_multiplier == 0, checked above)
        elif smp == "top_n_sigma":
            if s["top_n_sigma"] > 0:
                out.stage("top_n_sigma", s["top_n_sigma"])
        elif smp == "top_k":
            if s["top_k"] > 0:
                out.stage("top_k", s["top_k"])
        elif smp == "typ_p":
            if s["typ_p"] < 1:
                out.stage("typical_p", _number("--typical", s["typ_p"], lo=0.0, lo_open=True))
                out.notes.append(_TYPICAL_NOTE.format("llama.cpp"))
        elif smp == "top_p":
            if s["top_p"] < 1:
                out.stage("top_p", _number("--top-p", s["top_p"], lo=0.0, lo_open=True))
        elif smp == "min_p":
            if s["min_p"] > 0:
                out.stage("min_p", _number("--min-p", s["min_p"], hi=1.0))
        elif smp == "xtc":
            if s["xtc_probability"] > 0 and s["xtc_threshold"] <= 0.5:
                out.stage("xtc", s["xtc_threshold"], min(s["xtc_probability"], 1.0), "seed", position="pos")
        elif smp == "temperature":
            t = max(s["temp"], 0.0)                         # llama.cpp clamps --temp to >= 0
            if t != 1.0:
                out.stage("temperature", t)
    if s["seed"] != 0xFFFFFFFF:
        out.seed = s["seed"]
    else:
        out.notes.append("llama.cpp's seed was random (-1): pass seed=")
    if any("history" in st for st in out.stages):
        out.notes.append("history = the sequence so far, prompt included (llama.cpp feeds the prompt to its "
                         "penalties)")
    if ignored:
        out.notes.append("ignored (not sampling flags): " + " ".join(ignored))
    return out.render()


def _llama_bias(value: str) -> tuple[int, float]:
    """`TOKEN_ID(+/-)BIAS`, e.g. `15043+1`, `15043-0.5`."""
    for j, ch in enumerate(value):
        if j > 0 and ch in "+-":
            tid, sign, mag = value[:j], ch, value[j + 1:]
            break
    else:
        raise SamplecError(f"--logit-bias {value!r}: expected TOKEN_ID(+/-)BIAS, e.g. 15043+1")
    token = _number("--logit-bias token", tid.strip(), int, lo=0)
    try:
        bias = float(mag) * (-1.0 if sign == "-" else 1.0)
    except ValueError:
        raise SamplecError(f"--logit-bias {value!r}: expected TOKEN_ID(+/-)BIAS, e.g. 15043+1") from None
    if math.isnan(bias) or bias == math.inf:
        raise SamplecError(f"--logit-bias {value!r}: the bias must be a number or -inf (which bans the token)")
    return token, bias


# ---- OpenAI chat completions: a request body ----

def from_openai(body: dict, name: str = "openai_chat") -> str:
    """An OpenAI chat-completions request's sampling fields.

    Order: `logit_bias` is added to the logits, the presence/frequency penalties are subtracted
    (`x_j -= c_j * frequency + (c_j > 0) * presence`, c_j counting the tokens sampled so far -- the generated ones,
    not the prompt), then temperature (0: the most likely token) and nucleus `top_p`, then the draw. OpenAI does
    not publish its implementation; this is its documented formula in the order vLLM's OpenAI-compatible server
    applies it. `logprobs` / `top_logprobs` become the `raw_logprob` / `top_logprobs(n)` outputs (the model's
    distribution).
    """
    if not isinstance(body, dict):
        raise SamplecError("an OpenAI request body must be a JSON object")
    out = _Sampler(name, "imported from an OpenAI chat-completions request (logit_bias, penalties, temperature, "
                         "top_p)")
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema"):
        raise SamplecError(f"response_format {rf.get('type')}: constrained decoding is not a sampler chain")
    bias = body.get("logit_bias")
    if bias:
        if not isinstance(bias, dict):
            raise SamplecError("logit_bias: expected an object mapping token ids to biases")
        items = []
        for key, val in bias.items():
            tid = _number(f"logit_bias token {key!r}", key, int, lo=0)
            items.append((tid, _number(f"logit_bias[{key}]", val, lo=-100.0, hi=100.0)))
        out.stage("logit_bias", "{" + ", ".join(f"{t}: {_num(b)}" for t, b in sorted(items)) + "}")
    freq = _number("frequency_penalty", body.get("frequency_penalty") or 0, lo=-2.0, hi=2.0)
    pres = _number("presence_penalty", body.get("presence_penalty") or 0, lo=-2.0, hi=2.0)
    if freq or pres:
        kw = {}
        if freq:
            kw["frequency"] = freq
        if pres:
            kw["presence"] = pres
        out.stage("penalties", "history", **kw)
        out.notes.append("history = the generated tokens only (prompt_in_history=False in samplec's decode "
                         "loops)")
    t = body.get("temperature")
    t = 1.0 if t is None else _number("temperature", t, lo=0.0, hi=2.0)
    if t != 1.0:
        out.stage("temperature", t)
    p = body.get("top_p")
    p = 1.0 if p is None else _number("top_p", p, lo=0.0, hi=1.0, lo_open=True)
    if p < 1.0:
        out.stage("top_p", p)
    if body.get("seed") is not None:
        seed = _number("seed", body["seed"], int)
        out.seed = seed % 2 ** 64
    n_top = body.get("top_logprobs")
    if body.get("logprobs"):
        out.outputs = ["token", "raw_logprob"]
        if n_top:
            out.outputs.append(f"top_logprobs({_number('top_logprobs', n_top, int, lo=0, hi=20)})")
    elif n_top:
        raise SamplecError("top_logprobs needs logprobs: true")
    return out.render()


# ---- entry point ----

KINDS = {"hf": "a Hugging Face generation_config.json", "llama-cpp": "a file holding llama.cpp sampling flags",
         "openai": "an OpenAI chat-completions request body (JSON)"}


def import_source(kind: str, path: str | os.PathLike) -> str:
    """The `.smp` source equivalent to the settings in `path`; `kind` is one of `hf`, `llama-cpp`, `openai`."""
    kind = kind.lower().replace("_", "-").replace("llamacpp", "llama-cpp").replace("llama.cpp", "llama-cpp")
    if kind not in KINDS:
        raise SamplecError(f"unknown import kind {kind!r} (expected one of: {', '.join(KINDS)})")
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SamplecError(f"cannot read {path}: {e}") from None
    try:
        if kind == "llama-cpp":
            return from_llama_cpp(text)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SamplecError(f"invalid JSON: {e}") from None
        return from_hf(data) if kind == "hf" else from_openai(data)
    except SamplecError as e:
        raise SamplecError(f"{path}: {e}") from None
