"""Importers: the sampling settings of another system as an equivalent `.smp` sampler, in that system's stage order.

    import_source("hf", "generation_config.json")    # Hugging Face transformers' generation config
    import_source("llama-cpp", "flags.txt")           # a llama.cpp command line (its sampling flags)
    import_source("openai", "request.json")           # an OpenAI chat-completions request body
    import_source("mlx-lm", "args.json")              # mlx-lm make_sampler / make_logits_processors keywords
    import_source("vllm", "sampling_params.json")     # vLLM SamplingParams fields

Each importer reads what decides the next-token distribution, applies the system's own defaults, and writes the
stages in the order that system applies them (documented beside each importer below). No setting is dropped
without a word. Each field/flag of a format is in exactly one of three groups, declared in one table per format:
  - mapped: becomes stages, outputs or the seed's default (or nothing, at its off value);
  - refused: changes the distribution (or the tokens chosen) in a way a sampler chain cannot express -- an error
    naming it (unless it is at its off value), e.g. beam search, grammars, `n > 1`; settings that need a stage
    samplec does not have are refused by name;
  - outside the sampler: the prompt, length limits, stop conditions, transport (model, messages, max_tokens, stop,
    stream, ...): accepted and listed in a comment of the output.
A name in none of the groups (a typo such as `temprature`) is an error that suggests the closest known name.
Every imported sampler takes `seed: seed` (the system's seed as default when it has one), `pos: int = 0` (pass
the token's position, docs/language.md) and, when it penalizes repeats, `history: tokens`.
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass, field

from samplec.files import read_source
from samplec.diagnostics import SamplecError

__all__ = ["import_source", "import_text", "from_hf", "from_llama_cpp", "from_openai", "from_mlx_lm", "from_vllm",
           "KINDS"]


# ---- settings that need a stage samplec does not have yet ----
def _unknown(what: str, name: str, known, extra: str = "", aliases: dict | None = None) -> SamplecError:
    """An unknown field/flag, with the closest known name (or the format's name for another system's spelling,
    `aliases`) as a suggestion."""
    close = [aliases[name]] if aliases and name in aliases else \
        difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return SamplecError(f"unknown {what} '{name}'{hint}{extra}")


def _refuse(name: str, value, why: str) -> SamplecError:
    return SamplecError(f"{name} = {json.dumps(value) if not isinstance(value, str) else repr(value)}: {why}")


def _outside(notes: list[str], body: dict, names) -> None:
    """List the settings that are outside the sampler (set in the body) in a comment."""
    given = []
    for k in names:
        if k in body:
            v = body[k]
            text = json.dumps(v, ensure_ascii=False) if v is None or isinstance(v, (bool, int, float, str)) \
                else f"({type(v).__name__})"
            given.append(f"{k} = {text if len(text) <= 40 else text[:37] + '...'}")
    if given:
        notes.append("outside the sampler (the prompt, the decode loop or the transport): " + ", ".join(given))


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
    seed_note: str | None = None     # what to say of a required seed (when the sampler has one)
    sampled: bool = True             # False: greedy() terminal
    notes: list[str] = field(default_factory=list)
    terminal: str | None = None      # a terminal other than sample(seed, position = pos) / greedy()
    params: list[str] = field(default_factory=list)      # parameters beyond seed, pos and the histories

    def stage(self, name: str, *args, **kw) -> None:
        parts = [a if isinstance(a, str) else _num(a) for a in args]
        parts += [f"{k} = {v if isinstance(v, str) else _num(v)}" for k, v in kw.items()]
        self.stages.append(f"{name}({', '.join(parts)})")

    def render(self) -> str:
        if self.sampled and self.terminal is None and "temperature(0.0)" in self.stages:
            # only the most likely token is left: no draw, no seed; what follows cannot change it (a cut keeps it,
            # xtc needs two tokens, a temperature or a penalty leaves it the only finite logit)
            at = self.stages.index("temperature(0.0)")
            dropped, self.stages = self.stages[at + 1:], self.stages[:at + 1]
            self.sampled = False
            self.notes.append("temperature 0: greedy decoding" +
                              (f" ({', '.join(dropped)} after it cannot change the token)" if dropped else ""))
        body = "\n".join(self.stages)
        uses_seed = self.sampled or "seed" in body
        params = []
        if uses_seed and self.seed is None and self.seed_note:
            self.notes.append(self.seed_note)
        if uses_seed:
            params.append("seed: seed" + ("" if self.seed is None else f" = {self.seed}"))
            params.append("pos: int = 0")
        for history in ("history", "prompt_and_output", "output"):      # token histories, as stages name them
            if f"({history}," in body or f"({history})" in body:
                params.append(f"{history}: tokens")
        terminal = self.terminal or ("sample(seed, position = pos)" if self.sampled else "greedy()")
        used = body + "\n" + terminal + "\n" + " ".join(self.outputs)      # (stages dropped after temperature 0)
        params += [p for p in self.params if re.search(rf"\b{re.escape(p.split(':')[0].strip())}\b", used)]
        lines = [f"# {self.origin}", *(f"# {n}" for n in self.notes)]
        lines.append(f"sampler {self.name}({', '.join(params)}) -> {', '.join(self.outputs)} {{")
        lines += [f"    {s}" for s in [*self.stages, terminal]]
        lines.append("}")
        return "\n".join(lines) + "\n"


def _number(name: str, value, kind: type = float, lo: float = -math.inf, hi: float = math.inf,
            lo_open: bool = False, wide: bool = False):
    """A field's number, checked (`kind` int: an integer that fits the 32-bit int a stage takes, unless `wide`:
    a seed)."""
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
    if kind is int and not wide and not -2 ** 31 <= v < 2 ** 31:
        raise SamplecError(f"{name} = {value!r} does not fit in a 32-bit int")
    if v != v or v < lo or v > hi or (lo_open and v == lo):
        lo_b = "(" if lo_open else "["
        raise SamplecError(f"{name} = {value!r} is out of range {lo_b}{_num(lo)}, {_num(hi)}]")
    return v


def _top_p(out: "_Sampler", name: str, p: float, system: str) -> None:
    """A nucleus cut of p in [0, 1]: 1 is off; 0 (refused by samplec's top_p, whose p lies in (0, 1]) keeps the one
    most probable token in these systems (their cut keeps at least one): top_k(1), which also keeps the tokens
    tied with it."""
    if p <= 0.0:
        out.stage("top_k", 1)
        out.notes.append(f"{name} = {_num(p)}: {system} keeps the most probable token alone; top_k(1) (which also "
                         "keeps any token tied with it)")
    elif p < 1.0:
        out.stage("top_p", p)


_TYPICAL_NOTE = ("typical_p: samplec always keeps the most likely token; {} drops it when it is atypical "
                 "(the only difference)")

# ---- Hugging Face transformers: generation_config.json ----

# Every field of transformers' GenerationConfig (5.23.0; tests/test_importers.py checks the installed version's
# fields against these tables), in one of three groups.
# GenerationConfig's defaults (transformers 5.x `_get_default_generation_params`) for the mapped fields
_HF_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None,
                "typical_p": 1.0, "repetition_penalty": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                "suppress_tokens": None}
# refused: field -> (values that mean "off" besides None, what it does that a sampler chain cannot)
_HF_REFUSED = {
    "num_beams": ((1,), "beam search is not a sampler chain"),
    "num_beam_groups": ((1,), "group beam search is not a sampler chain"),
    "diversity_penalty": ((0,), "group beam search is not a sampler chain"),
    "penalty_alpha": ((0,), "contrastive search needs the model's hidden states"),
    "top_h": ((), "top-H sampling has no samplec stage"),
    "no_repeat_ngram_size": ((0,), "n-gram bans have no samplec stage"),
    "encoder_no_repeat_ngram_size": ((0,), "n-gram bans have no samplec stage"),
    "encoder_repetition_penalty": ((1,), "it penalizes the encoder's input ids (encoder-decoder models)"),
    "bad_words_ids": (([],), "token-sequence bans have no samplec stage"),
    "sequence_bias": (({}, []), "biases of token sequences have no samplec stage"),
    "begin_suppress_tokens": (([],), "suppressing tokens at the first step depends on the step"),
    "forced_bos_token_id": ((), "forcing a token at a given step depends on the step"),
    "forced_eos_token_id": ((), "forcing a token at a given step depends on the step"),
    "guidance_scale": ((1,), "classifier-free guidance needs a second model call"),
    "min_length": ((0,), "banning EOS below a length depends on the step"),
    "min_new_tokens": ((0,), "banning EOS below a length depends on the step"),
    "exponential_decay_length_penalty": ((), "a length-dependent EOS boost depends on the step"),
    "watermarking_config": ((), "watermarking has no samplec stage"),
    "force_words_ids": (([],), "constrained beam search is not a sampler chain"),
    "constraints": (([],), "constrained beam search is not a sampler chain"),
    "dola_layers": ((), "DoLa decoding needs the model's hidden layers"),
    "remove_invalid_values": ((False,), "it replaces NaN/inf logits; samplec reports them as errors"),
    "token_healing": ((False,), "token healing rewrites the prompt"),
    "num_return_sequences": ((1,), "several sequences per prompt: run the sampler on that many rows, each with "
                                   "its own seed"),
    "assistant_ensemble_weight": ((), "ensemble speculative decoding mixes the assistant's distribution in"),
}
# outside the sampler: length, stopping, special ids, caching, outputs of generate(), lossless speculative decoding
# (it changes the speed, not the distribution), metadata. renormalize_logits: a final log_softmax, no change to the
# distribution; length_penalty and early_stopping: beam search only.
_HF_OUTSIDE = (
    "max_length", "max_new_tokens", "max_time", "stop_strings", "eos_token_id", "pad_token_id", "bos_token_id",
    "decoder_start_token_id", "early_stopping", "length_penalty", "renormalize_logits", "use_cache",
    "cache_implementation", "cache_config", "max_cache_len", "compile_config", "disable_compile",
    "prefill_chunk_size", "continuous_batching_config", "low_memory", "return_dict_in_generate",
    "output_attentions", "output_hidden_states", "output_logits", "output_scores", "is_assistant",
    "assistant_confidence_threshold", "assistant_early_exit", "assistant_lookbehind", "target_lookbehind",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "prompt_lookup_num_tokens", "max_matching_ngram_size",
    "speculation_type", "use_mtp", "transformers_version", "_from_model_config",
)
HF_FIELDS = {"mapped": tuple(_HF_DEFAULTS), "refused": tuple(_HF_REFUSED), "outside": _HF_OUTSIDE}


def _is_off(value, offs) -> bool:
    """None, or one of `offs` (booleans compared by identity: `0 == False` must not count)."""
    if value is None:
        return True
    return any(value is o if isinstance(o, bool) or isinstance(value, bool) else value == o for o in offs)


def from_hf(config: dict, name: str = "hf_generation") -> str:
    """transformers' `generate()` with this generation config.

    Order (transformers `GenerationMixin._get_logits_processor`): the repetition penalty (over all input ids,
    prompt included, multiplicative: `x < 0 ? x * r : x / r`) comes first, `suppress_tokens` (a -inf bias) next;
    then, only when `do_sample`, the
    warpers temperature, top-k (default 50 when unset), top-p, min-p, typical-p, epsilon, eta; then a draw from
    the result. Without `do_sample` the result is the argmax (greedy) of the penalized logits.
    """
    if not isinstance(config, dict):
        raise SamplecError("a generation config must be a JSON object")
    for key in config:
        if key not in _HF_DEFAULTS and key not in _HF_REFUSED and key not in _HF_OUTSIDE:
            raise _unknown("generation config field", key, [*_HF_DEFAULTS, *_HF_REFUSED, *_HF_OUTSIDE],
                           " (transformers' GenerationConfig has no such field)")
    for key, (offs, why) in _HF_REFUSED.items():
        value = config.get(key)
        if not _is_off(value, offs):
            raise _refuse(key, value, why)
    cfg = {**_HF_DEFAULTS, **{k: v for k, v in config.items() if v is not None or k not in _HF_DEFAULTS}}
    out = _Sampler(name, "imported from a Hugging Face generation config (transformers' processor order)")
    do_sample = cfg["do_sample"]
    if not isinstance(do_sample, bool):
        raise SamplecError(f"do_sample: expected true or false, got {do_sample!r}")
    r = _number("repetition_penalty", cfg["repetition_penalty"], lo=0.0, lo_open=True)
    if r != 1.0:
        out.stage("penalties", "history", repeat=r)
        out.notes.append("history = the prompt and the generated tokens (transformers penalizes all input ids)")
    suppress = cfg["suppress_tokens"]
    if suppress:                     # SuppressTokensLogitsProcessor: -inf, after the penalty (where is immaterial)
        if not isinstance(suppress, list):
            raise SamplecError("suppress_tokens: expected a list of token ids")
        ids = sorted({_number("suppress_tokens", t, int, lo=0) for t in suppress})
        out.stage("logit_bias", "{" + ", ".join(f"{t}: -inf" for t in ids) + "}")
    if not do_sample:
        out.sampled = False
        out.notes.append("do_sample is false: greedy decoding (temperature, top_k, top_p, ... do not apply)")
        _outside(out.notes, config, _HF_OUTSIDE)
        return out.render()
    t = _number("temperature", cfg["temperature"], lo=0.0, lo_open=True)
    if t != 1.0:
        out.stage("temperature", t)
    k = _number("top_k", cfg["top_k"], int, lo=0)
    if k != 0:
        out.stage("top_k", k)
    _top_p(out, "top_p", _number("top_p", cfg["top_p"], lo=0.0, hi=1.0), "transformers")
    if cfg["min_p"] is not None:
        m = _number("min_p", cfg["min_p"], lo=0.0, hi=1.0)
        if m > 0:
            out.stage("min_p", m)
    typ = _number("typical_p", cfg["typical_p"], lo=0.0, hi=1.0, lo_open=True)
    if typ < 1.0:
        out.stage("typical_p", typ)
        out.notes.append(_TYPICAL_NOTE.format("transformers"))
    for key, stage in (("epsilon_cutoff", "epsilon"), ("eta_cutoff", "eta")):   # in transformers' warper order
        e = _number(key, cfg[key] if cfg[key] is not None else 0.0, lo=0.0, hi=1.0)
        if 0.0 < e < 1.0:                              # transformers applies them for 0 < value < 1 only
            out.stage(stage, e)
    _outside(out.notes, config, _HF_OUTSIDE)
    return out.render()


# ---- llama.cpp: a command line's sampling flags ----

_LLAMA_SAMPLER_NAMES = {
    "penalties": "penalties", "dry": "dry", "top_n_sigma": "top_n_sigma", "top_k": "top_k", "typ_p": "typ_p",
    "top_p": "top_p", "min_p": "min_p", "xtc": "xtc", "temperature": "temperature", "infill": "infill",
    "adaptive_p": "adaptive_p", "nucleus": "top_p", "temp": "temperature", "typ": "typ_p", "typical": "typ_p",
    "typical-p": "typ_p",
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
                   "penalty_freq": 0.0, "penalty_present": 0.0, "dry_multiplier": 0.0, "dry_base": 1.75,
                   "dry_allowed_length": 2, "dry_penalty_last_n": -1, "dry_sequence_breakers": None,
                   "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "mirostat": 0, "mirostat_eta": 0.1,
                   "mirostat_tau": 5.0, "adaptive_target": -1.0, "adaptive_decay": 0.9, "seed": 0xFFFFFFFF,
                   "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                                "temperature"]}
# Every sampling option of llama.cpp's common/arg.cpp (the `.set_sampling()` ones, read at ggml-org/llama.cpp
# commit 0017d6f): flag -> setting. All take a value except the switches below.
_LLAMA_FLAGS = {
    "--temp": "temp", "--temperature": "temp", "--top-k": "top_k", "--top-p": "top_p", "--min-p": "min_p",
    "--top-nsigma": "top_n_sigma", "--top-n-sigma": "top_n_sigma", "--xtc-probability": "xtc_probability",
    "--xtc-threshold": "xtc_threshold", "--typical": "typ_p", "--typical-p": "typ_p",
    "--repeat-last-n": "penalty_last_n", "--repeat-penalty": "penalty_repeat",
    "--presence-penalty": "penalty_present", "--frequency-penalty": "penalty_freq", "--samplers": "samplers",
    "--sampler-seq": "sampler_seq", "--sampling-seq": "sampler_seq", "-s": "seed", "--seed": "seed",
    "-l": "logit_bias", "--logit-bias": "logit_bias",
    "--dry-multiplier": "dry_multiplier", "--dry-base": "dry_base", "--dry-allowed-length": "dry_allowed_length",
    "--dry-penalty-last-n": "dry_penalty_last_n", "--dry-sequence-breaker": "dry_sequence_breakers",
    "--dynatemp-range": "dynatemp_range", "--dynatemp-exp": "dynatemp_exponent", "--mirostat": "mirostat",
    "--mirostat-lr": "mirostat_eta", "--mirostat-ent": "mirostat_tau", "--adaptive-target": "adaptive_target",
    "--adaptive-decay": "adaptive_decay",
}
_LLAMA_INT = {"top_k", "penalty_last_n", "mirostat", "dry_allowed_length", "dry_penalty_last_n"}
_LLAMA_SWITCHES = {"-bs": None, "--backend-sampling": None}  # where the chain runs, not what it computes
_LLAMA_REFUSED = {   # flags that constrain or change sampling in ways a sampler chain cannot express
    "--grammar": "grammars", "--grammar-file": "grammars", "-j": "JSON schemas", "--json-schema": "JSON schemas",
    "-jf": "JSON schemas", "--json-schema-file": "JSON schemas",
    "--ignore-eos": "--ignore-eos (it biases the model's EOS token to -inf; use allow(mask) with your model's "
                    "EOS id)",
}
LLAMA_CPP_FLAGS = {"mapped": tuple(_LLAMA_FLAGS) + tuple(_LLAMA_SWITCHES) + ("--min-keep",),
                   "refused": tuple(_LLAMA_REFUSED)}


def _llama_unknown_flag(flag: str) -> SamplecError | None:
    """An unknown flag that looks like a misspelt sampling flag (`--top_k`, `--temprature`) is an error; any other
    unknown flag is taken as one of llama.cpp's many non-sampling flags (model, context, threads, ...)."""
    known = [*_LLAMA_FLAGS, *_LLAMA_SWITCHES, *_LLAMA_REFUSED, "--min-keep"]
    if not flag.startswith("--"):
        return None
    norm = flag.lower().replace("_", "-")
    if norm != flag and norm in known:
        return SamplecError(f"unknown flag '{flag}' (did you mean '{norm}'?)")
    close = difflib.get_close_matches(norm, [k for k in known if k.startswith("--")], n=1, cutoff=0.85) or \
        [k for k in known if k.startswith("--") and _one_edit(norm, k)][:1]
    if close:
        return SamplecError(f"unknown flag '{flag}' (did you mean '{close[0]}'?)")
    return None


def _one_edit(a: str, b: str) -> bool:
    """Whether a and b differ by one edit: a letter changed, added or dropped, or two neighbours swapped
    (`--tmep` for `--temp`)."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or len(diff) == 2 and diff[1] == diff[0] + 1 and \
            a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))


def _llama_argv(text: str) -> list[str]:
    """The flags of a command line or a flags file, split as a POSIX shell would: `\\` continues a line, a quoted
    value may span lines, and `#` starts a comment only at the start of a word outside quotes (a whole line, or
    after a flag; `models/#1.gguf` is one word)."""
    text = text.replace("\\\r\n", " ").replace("\\\n", " ")
    kept, quote, escaped, word_start = [], None, False, True
    i = 0
    while i < len(text):
        c = text[i]
        if escaped:
            escaped = False
        elif c == "\\" and quote != "'":
            escaped = True
        elif quote is not None:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and word_start:
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        kept.append(c)
        word_start = quote is None and not escaped and c.isspace()
        i += 1
    try:
        return shlex.split("".join(kept))
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
    "random") leaves the sampler's seed required. Unknown flags that look like a misspelt sampling flag are errors;
    other flags (model, context, threads, ...) are listed in a comment as outside the sampler.
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
        if flag in _LLAMA_SWITCHES:
            i += 1
            continue
        if flag == "--min-keep":    # (every stage keeps at least its most likely token: a minimum of 0 or 1 is that)
            value = inline if eq else args[i + 1] if i + 1 < len(args) else None
            if value is None:
                raise SamplecError(f"{flag}: missing value")
            if _number(flag, value, int) > 1:
                raise SamplecError(f"{flag} {value}: samplec's stages keep at least the most likely token, and no "
                                   "larger minimum (spec section 2): it cannot be imported into a sampler chain")
            i += 1 if eq else 2
            continue
        if flag not in _LLAMA_FLAGS:
            if not tok.startswith("-"):
                raise SamplecError(f"unexpected argument {tok!r} (expected llama.cpp flags)")
            err = _llama_unknown_flag(flag)
            if err:
                raise err
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
        if key == "samplers":
            names = [n.strip().lower() for n in value.split(";") if n.strip()]
            bad = [n for n in names if n not in _LLAMA_SAMPLER_NAMES]
            if bad:
                raise _unknown("sampler", bad[0], _LLAMA_SAMPLER_NAMES,
                               f" in --samplers (llama.cpp knows: {', '.join(_LLAMA_DEFAULTS['samplers'])}, ...)")
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
            s["seed"] = _number(flag, value, int, wide=True) & 0xFFFFFFFF     # llama.cpp keeps a uint32 (-1: random)
        elif key == "dry_sequence_breakers":
            s[key] = [*(s[key] or []), value]                        # strings; used with DRY only
        else:
            s[key] = _number(flag, value, int if key in _LLAMA_INT else float)

    if s["mirostat"] not in (0, 1, 2):
        raise SamplecError(f"--mirostat = {s['mirostat']}: expected 0 (off), 1 or 2")
    if s["adaptive_target"] >= 0 or "adaptive_p" in s["samplers"]:
        raise SamplecError("--adaptive-target: the adaptive-p sampler has no samplec stage")
    if "infill" in s["samplers"]:
        raise SamplecError("--samplers infill: the infill sampler needs the vocabulary's text; it has no samplec "
                           "stage")

    out = _Sampler(name, "imported from llama.cpp sampling flags (common_sampler_init's order)")
    if biases:
        out.stage("logit_bias", "{" + ", ".join(f"{t}: {_num(b)}" for t, b in sorted(biases.items())) + "}")
    if s["mirostat"] != 0:       # replaces the whole chain (after --logit-bias) by temperature + mirostat
        tau = _number("--mirostat-ent", s["mirostat_tau"], lo=0.0, lo_open=True)
        eta = _number("--mirostat-lr", s["mirostat_eta"], lo=0.0)
        out.stage("temperature", max(s["temp"], 0.0))
        out.terminal = (f"mirostat(mu, {_num(tau)}, {_num(eta)}, 100, seed, position = pos)" if s["mirostat"] == 1
                        else f"mirostat_v2(mu, {_num(tau)}, {_num(eta)}, seed, position = pos)")
        out.params.append("mu: state")
        out.outputs.append("mu")
        out.notes.append("mirostat: mu is state, threaded step to step by samplec's decode loops (left out: 2 * tau)")
        s["samplers"] = []
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
            if s["dry_multiplier"] != 0 and s["dry_penalty_last_n"] != 0:
                out.stage("dry", "history", _number("--dry-multiplier", s["dry_multiplier"], lo=0.0),
                          base=_number("--dry-base", s["dry_base"], lo=1.0),
                          allowed_length=_number("--dry-allowed-length", s["dry_allowed_length"], int, lo=0),
                          last_n=_number("--dry-penalty-last-n", s["dry_penalty_last_n"], int, lo=-1),
                          breakers="dry_breakers")
                out.params.append("dry_breakers: tokens")
                given = s["dry_sequence_breakers"]
                strings = ", ".join(json.dumps(b) for b in (given or ["\n", ":", "\"", "*"]))
                out.notes.append(f"dry_breakers: the token ids of llama.cpp's sequence breakers {strings} in your "
                                 "tokenizer, one list per row (breakers of several tokens are not supported)")
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
                _top_p(out, "--top-p", _number("--top-p", s["top_p"]), "llama.cpp")
        elif smp == "min_p":
            if s["min_p"] > 0:
                out.stage("min_p", _number("--min-p", s["min_p"], hi=1.0))
        elif smp == "xtc":
            if s["xtc_probability"] > 0 and s["xtc_threshold"] <= 0.5:
                out.stage("xtc", s["xtc_threshold"], min(s["xtc_probability"], 1.0), "seed", position="pos")
        elif smp == "temperature":
            t = s["temp"] if s["temp"] > 0 else 0.0          # llama.cpp clamps --temp to >= 0 (and -0.0 is 0)
            if s["dynatemp_range"] > 0:                     # temp_ext: dynamic whenever range > 0
                out.stage("dynamic_temperature", t, s["dynatemp_range"],
                          _number("--dynatemp-exp", s["dynatemp_exponent"], lo=0.0))
            elif t != 1.0:
                out.stage("temperature", t)
    if s["seed"] != 0xFFFFFFFF:
        out.seed = s["seed"]
    else:
        out.seed_note = "llama.cpp's seed was random (-1): pass seed="
    if any("history" in st for st in out.stages):
        out.notes.append("history = the sequence so far, prompt included (llama.cpp feeds the prompt to its "
                         "penalties)")
    if ignored:
        out.notes.append("outside the sampler (not sampling flags): " + " ".join(ignored))
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

# Every field of OpenAI's chat-completions request (and the legacy completions request's), in one of three groups.
_OPENAI_MAPPED = ("logit_bias", "frequency_penalty", "presence_penalty", "temperature", "top_p", "seed", "logprobs",
                  "top_logprobs", "response_format", "n", "best_of")
_OPENAI_OUTSIDE = ("model", "messages", "prompt", "audio", "function_call", "functions", "max_completion_tokens",
                   "max_tokens", "metadata", "modalities", "parallel_tool_calls", "prediction", "prompt_cache_key",
                   "reasoning_effort", "safety_identifier", "service_tier", "stop", "store", "stream",
                   "stream_options", "tool_choice", "tools", "user", "verbosity", "web_search_options", "echo",
                   "suffix")
OPENAI_FIELDS = {"mapped": _OPENAI_MAPPED, "outside": _OPENAI_OUTSIDE}


def from_openai(body: dict, name: str = "openai_chat") -> str:
    """An OpenAI chat-completions request's sampling fields.

    Order: `logit_bias` is added to the logits, the presence/frequency penalties are subtracted
    (`x_j -= c_j * frequency + (c_j > 0) * presence`, c_j counting the tokens sampled so far -- the generated ones,
    not the prompt), then temperature (0: the most likely token) and nucleus `top_p`, then the draw. OpenAI does
    not publish its implementation; this is its documented formula in the order vLLM's OpenAI-compatible server
    applies it. `logprobs` / `top_logprobs` become the `raw_logprob` / `top_logprobs(n)` outputs (the model's
    distribution). Fields that are not OpenAI's (`top_k`, `min_p`, `repetition_penalty`: vLLM's extensions) are
    errors that point to `--from vllm`.
    """
    if not isinstance(body, dict):
        raise SamplecError("an OpenAI request body must be a JSON object")
    for key in body:
        if key in _OPENAI_MAPPED or key in _OPENAI_OUTSIDE:
            continue
        if key in VLLM_FIELDS["mapped"] or key in VLLM_FIELDS["refused"] or key in VLLM_FIELDS["outside"]:
            raise SamplecError(f"'{key}' is not an OpenAI chat-completions field (vLLM's OpenAI-compatible server "
                               "takes it as an extension: import the request with --from vllm)")
        raise _unknown("OpenAI request field", key, [*_OPENAI_MAPPED, *_OPENAI_OUTSIDE])
    for key in ("n", "best_of"):
        if body.get(key) is not None and body[key] != 1:
            raise _refuse(key, body[key], "several completions per request: run the sampler on that many rows, "
                                          "each with its own seed" + (" (and pick the best yourself)"
                                                                      if key == "best_of" else ""))
    out = _Sampler(name, "imported from an OpenAI chat-completions request (logit_bias, penalties, temperature, "
                         "top_p)")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        what = rf.get("type") if isinstance(rf, dict) else rf
        raise SamplecError(f"response_format {what}: constrained decoding is not a sampler chain")
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
    _top_p(out, "top_p", 1.0 if p is None else _number("top_p", p, lo=0.0, hi=1.0), "OpenAI")
    if body.get("seed") is not None:
        seed = _number("seed", body["seed"], int, wide=True)
        out.seed = seed % 2 ** 64
    n_top = body.get("top_logprobs")
    if body.get("logprobs"):
        out.outputs = ["token", "raw_logprob"]
        if n_top:
            out.outputs.append(f"top_logprobs({_number('top_logprobs', n_top, int, lo=0, hi=20)})")
    elif n_top:
        raise SamplecError("top_logprobs needs logprobs: true")
    _outside(out.notes, body, _OPENAI_OUTSIDE)
    return out.render()


# ---- mlx-lm: make_sampler / make_logits_processors keyword arguments ----

# mlx_lm/sample_utils.py (mlx-lm 0.32.2): every argument with its default (tests check them against the installed
# signatures)
MLX_LM_SAMPLER_ARGS = {"temp": 0.0, "top_p": 0.0, "min_p": 0.0, "min_tokens_to_keep": 1, "top_k": 0,
                       "xtc_probability": 0.0, "xtc_threshold": 0.1, "xtc_special_tokens": None}
MLX_LM_PROCESSOR_ARGS = {"logit_bias": None, "repetition_penalty": None, "repetition_context_size": 20,
                         "presence_penalty": None, "presence_context_size": 20, "frequency_penalty": None,
                         "frequency_context_size": 20}


def from_mlx_lm(kwargs: dict, name: str = "mlx_lm") -> str:
    """mlx-lm's `make_logits_processors(**kw)` followed by `make_sampler(**kw)` (one JSON object holding the
    keyword arguments of both).

    Order (mlx_lm/generate.py and sample_utils.py): the logits processors run on the raw logits, in this order:
    `logit_bias`, repetition penalty (`x < 0 ? x * r : x / r`), presence penalty, frequency penalty, each over the
    last `*_context_size` tokens of the sequence (prompt included; 0 means all). The sampler then gets
    log-probabilities and applies top-p (`0 < top_p < 1`), min-p (`min_p != 0`), XTC (`xtc_probability > 0`),
    top-k (`top_k > 0`), and only then the temperature, in the draw (`categorical(x / temp)`). `temp = 0` (the
    default) is greedy: the argmax, the filters unused. Off values are mlx-lm's: `top_p` 0 or >= 1, `min_p` 0,
    `top_k` 0, penalties None or 0.
    """
    if not isinstance(kwargs, dict):
        raise SamplecError("mlx-lm arguments must be a JSON object of make_sampler / make_logits_processors "
                           "keyword arguments")
    known = {**MLX_LM_SAMPLER_ARGS, **MLX_LM_PROCESSOR_ARGS}
    for key in kwargs:
        if key not in known:
            raise _unknown("mlx-lm argument", key, known,
                           " (make_sampler and make_logits_processors take: " + ", ".join(known) + ")",
                           aliases={"temperature": "temp"})
    a = {**known, **kwargs}
    out = _Sampler(name, "imported from mlx-lm make_logits_processors + make_sampler arguments (mlx-lm's order)")
    bias = a["logit_bias"]
    if bias:
        if not isinstance(bias, dict):
            raise SamplecError("logit_bias: expected an object mapping token ids to biases")
        items = [(_number(f"logit_bias token {k!r}", k, int, lo=0), _number(f"logit_bias[{k}]", v))
                 for k, v in bias.items()]
        out.stage("logit_bias", "{" + ", ".join(f"{t}: {_num(b)}" for t, b in sorted(items)) + "}")
    active = []                                 # (samplec keyword, value, context) in mlx-lm's order
    for key, kw in (("repetition_penalty", "repeat"), ("presence_penalty", "presence"),
                    ("frequency_penalty", "frequency")):
        value = a[key]
        if value is None or value == 0:         # mlx-lm: `penalty is not None and penalty != 0`
            continue
        value = _number(key, value, lo=0.0 if key == "repetition_penalty" else -math.inf,
                        lo_open=key == "repetition_penalty")
        ctx_key = key.replace("_penalty", "_context_size")
        ctx = a[ctx_key]
        if ctx is None:
            raise SamplecError(f"{ctx_key} = null: mlx-lm needs a number of tokens (0: the whole sequence)")
        ctx = _number(ctx_key, ctx, int, lo=0)
        active.append((kw, value, -1 if ctx == 0 else ctx))        # tokens[-0:] is the whole sequence
    if active and len({c for _, _, c in active}) == 1:
        out.stage("penalties", "history", last_n=active[0][2], **{kw: v for kw, v, _ in active})
    else:
        for kw, value, ctx in active:
            out.stage("penalties", "history", last_n=ctx, **{kw: value})
    if active:
        out.notes.append("history = the sequence so far, prompt included (mlx-lm's processors see all tokens)")
    t = _number("temp", a["temp"], lo=0.0)
    if t == 0:
        out.sampled = False
        out.notes.append("temp = 0: greedy decoding (mlx-lm's default; its filters are not used)")
        return out.render()
    top_p = _number("top_p", a["top_p"])
    if 0 < top_p < 1:
        out.stage("top_p", top_p)
    min_p = _number("min_p", a["min_p"], lo=0.0, hi=1.0)
    keep = _number("min_tokens_to_keep", a["min_tokens_to_keep"], int, lo=1)
    if min_p != 0:
        if keep != 1:
            raise _refuse("min_tokens_to_keep", keep, "min-p keeping more than the most likely token has no "
                                                      "samplec stage")
        out.stage("min_p", min_p)
    xtc_p = _number("xtc_probability", a["xtc_probability"], lo=0.0, hi=1.0)
    if xtc_p > 0:
        threshold = _number("xtc_threshold", a["xtc_threshold"], lo=0.0, hi=0.5)
        if a["xtc_special_tokens"]:
            raise _refuse("xtc_special_tokens", a["xtc_special_tokens"], "exempting tokens from XTC has no "
                                                                          "samplec stage")
        out.stage("xtc", threshold, xtc_p, "seed", position="pos")
        out.notes.append("xtc: samplec draws the coin from (seed, position); mlx-lm from MLX's global generator")
    top_k = _number("top_k", a["top_k"], int)
    if top_k > 0:
        out.stage("top_k", top_k)
    if t != 1.0:
        out.stage("temperature", t)
    return out.render()


# ---- vLLM: SamplingParams ----

# Every field of vLLM's SamplingParams (vllm/sampling_params.py, read at vllm-project/vllm commit 00388f6, 2026;
# vLLM is not installable here), plus fields of older releases (0.6-0.10: best_of, use_beam_search, ...).
# mapped: become stages, outputs or the seed's default
_VLLM_MAPPED = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
                "min_p", "seed", "logprobs", "logit_bias", "n")
# refused unless at their off value: field -> (off values besides None, why)
_VLLM_REFUSED = {
    "best_of": ((1,), "choosing the best of several completions is not a sampler chain"),
    "use_beam_search": ((False,), "beam search is not a sampler chain"),
    "length_penalty": ((1,), "beam search is not a sampler chain"),
    "early_stopping": ((False,), "beam search is not a sampler chain"),
    "min_tokens": ((0,), "banning EOS / stop tokens below a length depends on the step"),
    "bad_words": (([],), "bad words need the tokenizer (token sequences have no samplec stage)"),
    "allowed_token_ids": (([],), "not imported: use allow(mask) with a mask parameter"),
    "structured_outputs": ((), "constrained decoding is not a sampler chain"),
    "guided_decoding": ((), "constrained decoding is not a sampler chain"),
    "logits_processors": (([],), "custom logits processors are Python code"),
    "thinking_token_budget": ((-1,), "forcing the end of thinking depends on the step"),
    "trace_decode_token_ids": (([],), "forcing a token sequence is not sampling"),
    "prompt_logprobs": ((), "log-probabilities of the prompt are not a sampler output"),
    "prompt_logprob_token_ids": (([],), "log-probabilities of the prompt are not a sampler output"),
    "prompt_logprob_start": ((), "log-probabilities of the prompt are not a sampler output"),
    "logprob_token_ids": (([],), "log-probabilities of chosen ids are not a samplec output (use probs)"),
    "output_text_buffer_length": ((0,), "internal to vLLM"),
    "_eos_token_id": ((), "internal to vLLM"),
    "_all_stop_token_ids": (([],), "internal to vLLM"),
    "_bad_words_token_ids": (([],), "internal to vLLM"),
}
# outside the sampler: stopping and length, what is returned and how, caching, metadata for plugins
_VLLM_OUTSIDE = ("stop", "stop_token_ids", "ignore_eos", "max_tokens", "include_stop_str_in_output", "detokenize",
                 "skip_special_tokens", "spaces_between_special_tokens", "output_kind", "stream_interval",
                 "skip_clone", "flat_logprobs", "extra_args", "skip_reading_prefix_cache", "repetition_detection",
                 "routed_experts_prompt_start", "truncate_prompt_tokens")
VLLM_FIELDS = {"mapped": _VLLM_MAPPED, "refused": tuple(_VLLM_REFUSED), "outside": _VLLM_OUTSIDE}
_VLLM_SAMPLING_EPS = 1e-5      # temperature below it: greedy
_VLLM_MAX_TEMP = 1e-2          # temperature in (0, 1e-2) is raised to 1e-2


def from_vllm(params: dict, name: str = "vllm") -> str:
    """vLLM (v1 engine) with these SamplingParams.

    Order (vllm/v1/sample/sampler.py): `logit_bias` (clamped to [-100, 100]), then the penalties
    (vllm/model_executor/layers/utils.py `apply_penalties`): repetition over the prompt AND the output
    (`x > 0 ? x / r : x * r`), frequency and presence over the output only; then temperature (0: greedy, the
    argmax after the penalties; (0, 0.01) is raised to 0.01 first, as SamplingParams does), min-p, top-k (0 or -1: off), top-p, and the draw. When both kinds of
    penalty are on, the sampler takes two histories: `prompt_and_output` and `output`. `logprobs = N` gives the
    `raw_logprob` and `top_logprobs(N)` outputs (vLLM's default `raw_logprobs` mode).
    """
    if not isinstance(params, dict):
        raise SamplecError("vLLM sampling parameters must be a JSON object of SamplingParams fields")
    for key in params:
        if key not in _VLLM_MAPPED and key not in _VLLM_REFUSED and key not in _VLLM_OUTSIDE:
            raise _unknown("SamplingParams field", key, [*_VLLM_MAPPED, *_VLLM_REFUSED, *_VLLM_OUTSIDE])
    for key, (offs, why) in _VLLM_REFUSED.items():
        if not _is_off(params.get(key), offs):
            raise _refuse(key, params[key], why)
    p = {k: params.get(k) for k in _VLLM_MAPPED}
    n = _number("n", 1 if p["n"] is None else p["n"], int, lo=1)
    if n != 1:
        raise _refuse("n", n, "several completions per request: run the sampler on that many rows, each with its "
                              "own seed")
    out = _Sampler(name, "imported from vLLM SamplingParams (vLLM v1's sampler order)")
    bias = p["logit_bias"]
    if bias:
        if not isinstance(bias, dict):
            raise SamplecError("logit_bias: expected an object mapping token ids to biases")
        items = [(_number(f"logit_bias token {k!r}", k, int, lo=0), min(100.0, max(-100.0, _number(
            f"logit_bias[{k}]", v)))) for k, v in bias.items()]
        out.stage("logit_bias", "{" + ", ".join(f"{t}: {_num(b)}" for t, b in sorted(items)) + "}")
    rep = _number("repetition_penalty", 1.0 if p["repetition_penalty"] is None else p["repetition_penalty"],
                  lo=0.0, hi=math.inf, lo_open=True)
    freq = _number("frequency_penalty", p["frequency_penalty"] or 0.0, lo=-2.0, hi=2.0)
    pres = _number("presence_penalty", p["presence_penalty"] or 0.0, lo=-2.0, hi=2.0)
    if not math.isfinite(rep):
        raise SamplecError("repetition_penalty must be finite")
    both = rep != 1.0 and (freq != 0 or pres != 0)
    if rep != 1.0:
        out.stage("penalties", "prompt_and_output" if both else "history", repeat=rep)
        out.notes.append(f"{'prompt_and_output' if both else 'history'} = the prompt and the generated tokens "
                         "(vLLM's repetition penalty)")
    if freq != 0 or pres != 0:
        kw = {}
        if freq:
            kw["frequency"] = freq
        if pres:
            kw["presence"] = pres
        out.stage("penalties", "output" if both else "history", **kw)
        out.notes.append(f"{'output' if both else 'history'} = the generated tokens only (vLLM's frequency and "
                         "presence penalties)")
    t = _number("temperature", 1.0 if p["temperature"] is None else p["temperature"], lo=0.0, hi=2.0)
    if 0 < t < _VLLM_MAX_TEMP:          # (SamplingParams.__post_init__ raises it first: only 0 stays greedy)
        out.notes.append(f"temperature {_num(t)} raised to 0.01 as vLLM does")
        t = _VLLM_MAX_TEMP
    if t < _VLLM_SAMPLING_EPS:
        out.sampled = False
        out.notes.append("temperature 0: vLLM samples greedily (top_p, top_k, min_p unused)")
    else:
        if t != 1.0:
            out.stage("temperature", t)
        m = _number("min_p", p["min_p"] or 0.0, lo=0.0, hi=1.0)
        if m > 0:
            out.stage("min_p", m)
        k = _number("top_k", p["top_k"] or 0, int, lo=-1)
        if k > 0:
            out.stage("top_k", k)
        top_p = _number("top_p", 1.0 if p["top_p"] is None else p["top_p"], lo=0.0, hi=1.0, lo_open=True)
        if top_p < 1.0:
            out.stage("top_p", top_p)
    seed = p["seed"]
    if seed is not None and seed != -1:
        out.seed = _number("seed", seed, int, wide=True) % 2 ** 64
    if p["logprobs"] is not None:
        nl = _number("logprobs", 1 if p["logprobs"] is True else p["logprobs"], int, lo=-1)   # (True: 1, as vLLM)
        if nl == -1:
            raise _refuse("logprobs", -1, "the whole vocabulary's log-probabilities: use top_logprobs(V) in the "
                                          "sampler")
        out.outputs = ["token", "raw_logprob"] + ([f"top_logprobs({nl})"] if nl > 0 else [])
    _outside(out.notes, params, _VLLM_OUTSIDE)
    return out.render()


# ---- entry point ----

KINDS = {"hf": "a Hugging Face generation_config.json", "llama-cpp": "llama.cpp sampling flags (a file, or the "
          "flags themselves)", "openai": "an OpenAI chat-completions request body (JSON)",
          "mlx-lm": "mlx-lm make_sampler / make_logits_processors keyword arguments (JSON)",
          "vllm": "vLLM SamplingParams fields (JSON)"}
_IMPORTERS = {"hf": from_hf, "openai": from_openai, "mlx-lm": from_mlx_lm, "vllm": from_vllm}


def _kind(kind: str) -> str:
    k = kind.lower().replace("_", "-").replace("llamacpp", "llama-cpp").replace("llama.cpp", "llama-cpp") \
        .replace("mlxlm", "mlx-lm")
    if k not in KINDS:
        raise _unknown("import kind", kind, KINDS, f" (expected one of: {', '.join(KINDS)})")
    return k


def _no_repeats(pairs: list) -> dict:
    """A JSON object whose keys are given once (a repeated key is an error: which value was meant is not known)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise SamplecError(f"the key {k!r} is given twice (with {json.dumps(out[k])[:40]} and "
                               f"{json.dumps(v)[:40]}): give it once")
        out[k] = v
    return out


def import_text(kind: str, text: str, where: str = "<input>") -> str:
    """The `.smp` source equivalent to the settings in `text` (what a file of that kind holds)."""
    kind = _kind(kind)
    try:
        if kind == "llama-cpp":
            return from_llama_cpp(text)
        try:
            data = json.loads(text, object_pairs_hook=_no_repeats)
        except json.JSONDecodeError as e:
            raise SamplecError(f"invalid JSON: {e}") from None
        return _IMPORTERS[kind](data)
    except SamplecError as e:
        raise SamplecError(f"{where}: {e}") from None


def import_source(kind: str, path: str | os.PathLike) -> str:
    """The `.smp` source equivalent to the settings in `path` (`-`: standard input); `kind` is one of `hf`,
    `llama-cpp`, `openai`, `mlx-lm`, `vllm`."""
    _kind(kind)
    if str(path) == "-":
        return import_text(kind, sys.stdin.read(), "<stdin>")
    return import_text(kind, read_source(path), str(path))
