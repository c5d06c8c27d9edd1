"""Importers (`samplec import --from hf|llama-cpp|openai`): the imported program against two oracles.

1. The system's own semantics, written here in numpy from its source (transformers' logits processors and warpers,
   llama.cpp's `llama-sampler.cpp`, OpenAI's documented penalty formula as vLLM applies it), run on the same logits:
   the final distributions must agree (same kept tokens, same probabilities), and drawing from the system's final
   logits with samplec's noise (reference `sample`, same seed and position) must give the program's token.
2. The samplec numpy reference (`tests/reference.py::run_chain`) on the stage list the importer must emit.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import samplec
from samplec import SamplecError
from samplec.importers import from_hf, from_llama_cpp, from_openai, import_source

try:  # works whether or not tests/ is a package
    from .reference import run_chain, sample as ref_sample
except ImportError:  # pragma: no cover
    from reference import run_chain, sample as ref_sample  # type: ignore[no-redef]

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "import"
F32 = np.float32
V = 50304
B = 8
POS = 37


# ---- shared inputs ----

def make_inputs(seed: int = 0, boosted=(7, 1820, 15043, 29871, 50256)):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(B, V)) * 2.0).astype(F32)
    logits[:, list(boosted)] += F32(6.0)                  # make the biased ids matter
    history = []
    for r in range(B):
        top = np.argsort(-logits[r])[:12]
        h = np.concatenate([rng.integers(0, V, 150), rng.choice(top, 40), rng.choice(top[:3], 10)])
        history.append(rng.permutation(h).astype(np.int32))
    return logits, np.stack(history)


def compile_with_probs(source: str):
    """The imported program, with `probs` (the final distribution before the terminal) added to its outputs."""
    src = re.sub(r"-> ([^{]*) \{", lambda m: f"-> {m.group(1).strip()}, probs {{", source, count=1)
    return samplec.compile(src)


def softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - np.max(x))
    return e / e.sum()


def run_program(prog, logits, history, seed):
    kw = {}
    names = {p.name for p in prog.params}
    if "seed" in names:
        kw["seed"] = seed
    if "pos" in names:
        kw["pos"] = POS
    if "history" in names:
        kw["history"] = history
    return prog(logits, **kw)


def check_against_system(prog, logits, history, seed, system_final, greedy=False, boundary_mass=0.0):
    """`boundary_mass`: the kept sets may differ by tokens holding at most this much probability in total (a
    top_p boundary deep in a long tail of tiny probabilities moves with float32 rounding of the running sum)."""
    out = run_program(prog, logits, history, seed)
    probs, tokens = np.array(out.probs), np.array(out.token)
    for r in range(B):
        x = system_final(logits[r], history[r])
        p = softmax(x)
        differ = (probs[r] > 0) != (p > 0)
        if boundary_mass:
            assert p[differ].sum() + probs[r][differ].sum() <= boundary_mass, f"row {r}"
        else:
            np.testing.assert_array_equal(probs[r] > 0, p > 0, err_msg=f"kept tokens differ (row {r})")
        np.testing.assert_allclose(probs[r][~differ], p[~differ], rtol=1e-4 + 2 * boundary_mass, atol=1e-7,
                                   err_msg=f"row {r}")
        expected = int(np.argmax(x)) if greedy else ref_sample(x.astype(F32), seed, POS)
        assert tokens[r] == expected, f"row {r}"
    return out


def check_against_reference(prog, logits, history, seed, stages, terminal="sample", boundary_mass=0.0):
    out = run_program(prog, logits, history, seed)
    for r in range(B):
        st = [(n, {**kw, "history": history[r]} if n == "penalties" else kw) for n, kw in stages]
        if terminal == "sample":
            st_kw = [(n, {**kw, "seed": seed, "position": POS} if n == "xtc" else kw) for n, kw in st]
            ref = run_chain(logits[r], st_kw, ("sample", {"seed": seed, "position": POS}), row=r)
        else:
            ref = run_chain(logits[r], st, ("greedy", {}), row=r)
        assert int(out.token[r]) == ref["token"], f"row {r}"
        key = "logprob" if "logprob" in out.names() else "raw_logprob"
        np.testing.assert_allclose(float(getattr(out, key)[r]), ref[key], rtol=1e-4, atol=1e-5)
        probs = np.array(out.probs[r])
        differ = (probs > 0) != (ref["probs"] > 0)
        assert probs[differ].sum() + ref["probs"][differ].sum() <= boundary_mass, f"row {r}"
        np.testing.assert_allclose(probs[~differ], ref["probs"][~differ], rtol=1e-4 + 2 * boundary_mass, atol=1e-7)


def stage_lines(source: str) -> list[str]:
    body = source[source.index("{") + 1:source.rindex("}")]
    return [ln.strip() for ln in body.strip().splitlines()]


# ---- Hugging Face transformers (generation/logits_process.py), float32 like torch ----

def hf_final(cfg, keep_argmax_in_typical=True):
    """transformers' processors. `keep_argmax_in_typical`: see `llama_final`."""
    def final(logits, input_ids):
        x = logits.astype(F32).copy()
        V_ = x.shape[0]
        r = cfg.get("repetition_penalty", 1.0)
        if r != 1.0:                                     # RepetitionPenaltyLogitsProcessor
            ids = np.unique(input_ids)
            s = x[ids]
            x[ids] = np.where(s < 0, s * F32(r), s / F32(r))
        if not cfg.get("do_sample", False):
            return x
        t = cfg.get("temperature", 1.0)
        if t != 1.0:                                     # TemperatureLogitsWarper
            x = (x / F32(t)).astype(F32)
        k = cfg.get("top_k", 50)
        if k:                                            # TopKLogitsWarper: scores < k-th largest -> -inf
            k = min(max(k, 1), V_)
            kth = np.sort(x)[::-1][k - 1]
            x = np.where(x < kth, -np.inf, x).astype(F32)
        p = cfg.get("top_p", 1.0)
        if p < 1.0:                                      # TopPLogitsWarper: ascending sort, remove cum <= 1 - p
            order = np.argsort(x, kind="stable")
            cum = np.cumsum(softmax(x[order]).astype(F32), dtype=F32)
            remove = cum <= F32(1 - p)
            remove[-1] = False
            x = x.copy()
            x[order[remove]] = -np.inf
        m = cfg.get("min_p")
        if m is not None:                                # MinPLogitsWarper
            probs = softmax(x)
            remove = probs < m * probs.max()
            remove[np.argmax(probs)] = False
            x = np.where(remove, -np.inf, x).astype(F32)
        typ = cfg.get("typical_p", 1.0)
        if typ < 1.0:                                    # TypicalLogitsWarper
            with np.errstate(divide="ignore", invalid="ignore"):
                logp = np.log(softmax(x))
                ent = -np.nansum(logp * np.exp(logp))
                shifted = np.abs(-logp - ent)
            order = np.argsort(shifted, kind="stable")
            cum = np.cumsum(softmax(x[order]))
            last = min(int((cum < typ).sum()), V_ - 1)
            remove = shifted[order] > shifted[order][last]
            remove[0] = False
            if keep_argmax_in_typical:
                remove[order == np.argmax(x)] = False
            x = x.copy()
            x[order[remove]] = -np.inf
        return x
    return final


HF_CASES = {
    "generation_config.json": (["temperature(0.6)", "top_k(50)", "top_p(0.9)", "sample(seed, position = pos)"],
                               [("temperature", {"t": 0.6}), ("top_k", {"k": 50}), ("top_p", {"p": 0.9})]),
    "generation_config_full.json": (
        ["penalties(history, repeat = 1.05)", "temperature(0.7)", "top_k(20)", "top_p(0.8)", "min_p(0.02)",
         "typical_p(0.95)", "sample(seed, position = pos)"],
        [("penalties", {"repeat": 1.05}), ("temperature", {"t": 0.7}), ("top_k", {"k": 20}), ("top_p", {"p": 0.8}),
         ("min_p", {"m": 0.02}), ("typical_p", {"m": 0.95})]),
    "generation_config_greedy.json": (["penalties(history, repeat = 1.3)", "greedy()"],
                                      [("penalties", {"repeat": 1.3})]),
}


@pytest.mark.parametrize("fixture", sorted(HF_CASES))
def test_hf_import(fixture):
    import json
    source = import_source("hf", FIXTURES / fixture)
    lines, stages = HF_CASES[fixture]
    assert stage_lines(source) == lines
    cfg = json.loads((FIXTURES / fixture).read_text())
    prog = compile_with_probs(source)
    logits, history = make_inputs(1)
    greedy = lines[-1] == "greedy()"
    check_against_system(prog, logits, history, 5, hf_final(cfg), greedy=greedy)
    check_against_reference(prog, logits, history, 5, stages, "greedy" if greedy else "sample")


# ---- llama.cpp (src/llama-sampler.cpp), on the shrinking candidate list ----

def llama_final(stages, keep_argmax_in_typical=True):
    """llama.cpp's chain. `keep_argmax_in_typical`: the one documented divergence -- samplec's typical_p always
    keeps the most probable token (spec section 2); llama.cpp's drops it when it is atypical."""
    def final(logits, history):
        x = logits.astype(F32).copy()
        alive = np.ones(x.shape[0], dtype=bool)

        def probs_desc():
            ids = np.flatnonzero(alive)
            ids = ids[np.argsort(-x[ids], kind="stable")]
            e = np.exp((x[ids] - x[ids][0]).astype(F32)).astype(F32)
            return ids, (e / e.sum(dtype=F32)).astype(F32)

        for name, a in stages:
            if name == "logit_bias":
                for t, b in a.items():
                    x[t] += F32(b)
            elif name == "penalties":
                window = history[-a["last_n"]:] if a["last_n"] > 0 else history
                ids, counts = np.unique(window, return_counts=True)
                s = x[ids]
                s = np.where(s <= 0, s * F32(a["repeat"]), s / F32(a["repeat"])).astype(F32)
                x[ids] = s - (counts.astype(F32) * F32(a["freq"]) + F32(a["present"]))
            elif name == "top_n_sigma":
                v = x[alive]
                thr = v.max() - F32(a) * np.std(v.astype(np.float64))
                alive &= ~(x < thr)
            elif name == "top_k":
                ids, _ = probs_desc()
                alive[:] = False
                alive[ids[:a]] = True
            elif name == "typical":
                ids, p = probs_desc()
                ent = -np.sum(p * np.log(p))
                order = np.argsort(np.abs(-np.log(p) - ent), kind="stable")
                cum = np.cumsum(p[order], dtype=F32)
                last = int(np.argmax(cum > a)) + 1 if (cum > a).any() else len(order)
                alive[:] = False
                alive[ids[order[:last]]] = True
                if keep_argmax_in_typical:
                    alive[ids[0]] = True
            elif name == "top_p":
                ids, p = probs_desc()
                cum = np.cumsum(p, dtype=F32)
                last = int(np.argmax(cum >= a)) + 1 if (cum >= a).any() else len(ids)
                alive[:] = False
                alive[ids[:last]] = True
            elif name == "min_p":
                alive &= x >= x[alive].max() + np.log(F32(a))
            elif name == "xtc":                           # probability 1: the coin always says yes
                ids, p = probs_desc()
                above = np.flatnonzero(p >= F32(a))
                pos_last = int(above[-1]) if above.size and above[0] == 0 else 0
                if pos_last > 0:
                    alive[ids[:pos_last]] = False
            elif name == "temp":
                x = (x / F32(a)).astype(F32)
        return np.where(alive, x, -np.inf).astype(F32)
    return final


LLAMA_CASES = {
    "llama_cpp_flags.txt": (
        1234,
        ["logit_bias({15043: 1.5, 29871: -2.0})",
         "penalties(history, last_n = 128, repeat = 1.15, frequency = 0.2, presence = 0.3)",
         "top_k(50)", "top_p(0.9)", "min_p(0.05)", "temperature(0.7)", "sample(seed, position = pos)"],
        [("logit_bias", {15043: 1.5, 29871: -2.0}),
         ("penalties", {"last_n": 128, "repeat": 1.15, "freq": 0.2, "present": 0.3}),
         ("top_k", 50), ("top_p", 0.9), ("min_p", 0.05), ("temp", 0.7)],
        [("logit_bias", {"b": {15043: 1.5, 29871: -2.0}}),
         ("penalties", {"last_n": 128, "repeat": 1.15, "frequency": 0.2, "presence": 0.3}),
         ("top_k", {"k": 50}), ("top_p", {"p": 0.9}), ("min_p", {"m": 0.05}), ("temperature", {"t": 0.7})]),
    "llama_cpp_custom.txt": (
        42,
        ["top_k(60)", "typical_p(0.9)", "xtc(0.05, 1.0, seed, position = pos)", "top_n_sigma(1.5)",
         "temperature(1.3)", "sample(seed, position = pos)"],
        [("top_k", 60), ("typical", 0.9), ("xtc", 0.05), ("top_n_sigma", 1.5), ("temp", 1.3)],
        [("top_k", {"k": 60}), ("typical_p", {"m": 0.9}), ("xtc", {"threshold": 0.05, "probability": 1.0}),
         ("top_n_sigma", {"n": 1.5}), ("temperature", {"t": 1.3})]),
}


@pytest.mark.parametrize("fixture", sorted(LLAMA_CASES))
def test_llama_cpp_import(fixture):
    seed, lines, system, stages = LLAMA_CASES[fixture]
    source = import_source("llama-cpp", FIXTURES / fixture)
    assert stage_lines(source) == lines
    assert f"seed: seed = {seed}" in source
    prog = compile_with_probs(source)
    logits, history = make_inputs(2)
    check_against_system(prog, logits, history, seed, llama_final(system))
    check_against_reference(prog, logits, history, seed, stages)


def test_typical_p_keeps_the_most_likely_token_unlike_llama_cpp():
    """The documented divergence: when the most likely token is atypical, llama.cpp (and transformers) drop it;
    samplec keeps it (spec section 2), so the imported chain keeps one more token on such rows."""
    source = import_source("llama-cpp", FIXTURES / "llama_cpp_custom.txt")
    assert "typical_p" in source and "keeps the most likely token" in source
    logits, history = make_inputs(2)
    chain = [("top_k", 60), ("typical", 0.9)]
    strict, ours = llama_final(chain, keep_argmax_in_typical=False), llama_final(chain)
    prog = compile_with_probs(from_llama_cpp("--samplers 'top_k;typ_p' --top-k 60 --typical 0.9 -s 1"))
    probs = np.array(run_program(prog, logits, history, 1).probs)
    diverged = 0
    for r in range(B):
        np.testing.assert_array_equal(probs[r] > 0, np.isfinite(ours(logits[r], history[r])))
        a, b = np.isfinite(strict(logits[r], history[r])), np.isfinite(ours(logits[r], history[r]))
        if (a != b).any():
            assert (b & ~a).sum() == 1 and np.argmax(np.where(b & ~a, 1, 0)) == np.argmax(logits[r])
            diverged += 1
    assert diverged >= 1


def test_llama_cpp_defaults_and_flag_forms():
    src = from_llama_cpp("llama-cli -m m.gguf -n -1 --color -p 'a # b'")
    assert stage_lines(src) == ["top_k(40)", "top_p(0.95)", "min_p(0.05)", "temperature(0.8)",
                                "sample(seed, position = pos)"]
    assert "sampler llama_cpp(seed: seed, pos: int = 0)" in src            # random seed: required
    assert "-n -1" in src and "--color" in src                             # listed as ignored
    src = from_llama_cpp(["--sampler-seq", "tkep", "--temp=-1", "--seed", "-1", "--repeat-penalty", "1.2"])
    assert stage_lines(src) == ["temperature(0.0)", "greedy()"]      # (what follows temperature 0 is dropped)
    assert "top_k(40), penalties(history, last_n = 64, repeat = 1.2), top_p(0.95) after it cannot change" in src
    samplec.compile(src)
    src = from_llama_cpp("--samplers 'Top-K;nucleus;TEMP' --top-k 0 --top-p 1 --temp 1")
    assert stage_lines(src) == ["sample(seed, position = pos)"]


@pytest.mark.parametrize("flags, message", [
    ("--top_k 40", "unknown flag '--top_k' (did you mean '--top-k'?)"),
    ("--temprature 0.7", "unknown flag '--temprature' (did you mean '--temperature'?)"),
    ("--Min-P 0.1", "did you mean '--min-p'"),
    ("--mirostat 3", "expected 0 (off), 1 or 2"),
    ("--adaptive-target 0.5", "adaptive-p"),
    ("--samplers 'top_k;infill'", "infill"),
    ("--json-schema {}", "JSON schemas"),
    ("--grammar 'root ::= \"a\"'", "grammars"),
    ("--ignore-eos", "ignore-eos"),
    ("--samplers 'top_k;bogus'", "unknown sampler 'bogus'"),
    ("--sampler-seq kq", "unknown sampler letter 'q'"),
    ("--top-k", "missing value"),
    ("--top-k many", "expected an integer"),
    ("--logit-bias 15043", "TOKEN_ID"),
    ("--logit-bias 15043+inf", "number or -inf"),
    ("--min-p 1.5", "out of range"),
    ("--repeat-penalty 0", "greater than 0"),
])
def test_llama_cpp_errors(flags, message):
    with pytest.raises(SamplecError, match=re.escape(message)):
        from_llama_cpp(flags)


# ---- OpenAI chat completions (documented formula; vLLM's order) ----

def openai_final(body):
    def final(logits, generated):
        x = logits.astype(F32).copy()
        for t, b in (body.get("logit_bias") or {}).items():
            x[int(t)] += F32(b)
        ids, counts = np.unique(generated, return_counts=True)
        x[ids] -= counts.astype(F32) * F32(body.get("frequency_penalty", 0)) + F32(body.get("presence_penalty", 0))
        t = body.get("temperature", 1.0)
        if t == 0:
            keep = np.zeros_like(x, dtype=bool)
            keep[np.argmax(x)] = True
            return np.where(keep, x, -np.inf).astype(F32)
        x = (x / F32(t)).astype(F32)
        p = body.get("top_p", 1.0)
        if p < 1.0:                       # smallest set of most likely tokens whose mass reaches top_p
            order = np.argsort(-x, kind="stable")
            cum = np.cumsum(softmax(x[order]).astype(F32), dtype=F32)
            last = int(np.argmax(cum >= F32(p))) + 1
            keep = np.zeros_like(x, dtype=bool)
            keep[order[:last]] = True
            x = np.where(keep, x, -np.inf).astype(F32)
        return x
    return final


def test_openai_import():
    import json
    body = json.loads((FIXTURES / "openai_request.json").read_text())
    source = import_source("openai", FIXTURES / "openai_request.json")
    assert stage_lines(source) == ["logit_bias({7: -2.5, 1820: 5.0, 50256: -100.0})",
                                   "penalties(history, frequency = 0.4, presence = 0.6)", "temperature(0.8)",
                                   "top_p(0.95)", "sample(seed, position = pos)"]
    assert "seed: seed = 2024" in source and "-> token, raw_logprob, top_logprobs(4)" in source
    prog = compile_with_probs(source)
    logits, history = make_inputs(3)
    generated = history[:, -60:]                       # OpenAI counts the generated tokens only
    out = check_against_system(prog, logits, generated, 2024, openai_final(body), boundary_mass=1e-4)
    lsm = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    np.testing.assert_allclose(np.array(out.top_logprobs.values), -np.sort(-lsm, axis=1)[:, :4], atol=1e-4)
    np.testing.assert_allclose(np.array(out.raw_logprob), lsm[np.arange(B), np.array(out.token)], atol=1e-4)
    stages = [("logit_bias", {"b": {7: -2.5, 1820: 5.0, 50256: -100.0}}),
              ("penalties", {"frequency": 0.4, "presence": 0.6}), ("temperature", {"t": 0.8}), ("top_p", {"p": 0.95})]
    check_against_reference(prog, logits, generated, 2024, stages, boundary_mass=1e-4)


def test_openai_greedy_and_defaults():
    import json
    body = json.loads((FIXTURES / "openai_greedy.json").read_text())
    source = import_source("openai", FIXTURES / "openai_greedy.json")
    assert stage_lines(source) == ["temperature(0.0)", "greedy()"]
    prog = compile_with_probs(source)
    logits, history = make_inputs(4)
    check_against_system(prog, logits, history, 0, openai_final(body), greedy=True)
    assert stage_lines(from_openai({"messages": []})) == ["sample(seed, position = pos)"]
    assert "seed: seed = 9223372036854775813," in from_openai({"seed": 2 ** 63 + 5})      # exact, not via float
    assert "seed: seed = 1," in from_llama_cpp("--seed 4294967297")                       # llama.cpp's uint32


@pytest.mark.parametrize("body, message", [
    ({"temperature": 2.5}, "temperature = 2.5 is out of range"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"12": 101}}, "logit_bias[12]"),
    ({"logit_bias": {"abc": 1}}, "logit_bias token 'abc'"),
    ({"top_logprobs": 3}, "needs logprobs"),
    ({"response_format": {"type": "json_schema"}}, "constrained decoding"),
    ([1, 2], "JSON object"),
])
def test_openai_errors(body, message):
    with pytest.raises(SamplecError, match=re.escape(message)):
        from_openai(body)


# ---- Hugging Face errors and the entry point ----

@pytest.mark.parametrize("cfg, message", [
    ({"num_beams": 4}, "num_beams"),
    ({"do_sample": True, "temperature": 0}, "temperature = 0 is out of range"),
    ({"do_sample": True, "top_k": -1}, "top_k"),
    ({"no_repeat_ngram_size": 3}, "no_repeat_ngram_size"),
    ({"suppress_tokens": 5}, "suppress_tokens"),
    ({"do_sample": "yes"}, "do_sample"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_hf_errors(cfg, message):
    with pytest.raises(SamplecError, match=re.escape(message)):
        from_hf(cfg)


def test_hf_defaults():
    assert stage_lines(from_hf({"do_sample": True})) == ["top_k(50)", "sample(seed, position = pos)"]
    assert stage_lines(from_hf({"do_sample": True, "top_k": None, "min_p": 0.1, "penalty_alpha": 0,
                                "guidance_scale": 1})) == ["top_k(50)", "min_p(0.1)", "sample(seed, position = pos)"]
    assert stage_lines(from_hf({})) == ["greedy()"]


def test_import_source_entry_point(tmp_path):
    with pytest.raises(SamplecError, match="unknown import kind 'vlm' \\(did you mean 'vllm'\\?\\)"):
        import_source("vlm", FIXTURES / "openai_request.json")
    with pytest.raises(SamplecError, match="cannot read"):
        import_source("hf", tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SamplecError, match=r"bad\.json: invalid JSON"):
        import_source("hf", bad)
    assert import_source("llama_cpp", FIXTURES / "llama_cpp_custom.txt") == \
        import_source("llama-cpp", FIXTURES / "llama_cpp_custom.txt")
    for kind, name in (("hf", "generation_config.json"), ("llama-cpp", "llama_cpp_flags.txt"),
                       ("openai", "openai_request.json")):
        samplec.compile(import_source(kind, FIXTURES / name))       # every fixture compiles as is


def test_llama_cpp_negative_infinite_bias_bans_the_token():
    src = from_llama_cpp("--logit-bias 3-inf --temp 0")
    assert "3: -inf" in src


# ==== every field of every format: mapped, refused by name, or listed as outside the sampler ====

from samplec.importers import (  # noqa: E402
    HF_FIELDS, LLAMA_CPP_FLAGS, MLX_LM_PROCESSOR_ARGS, MLX_LM_SAMPLER_ARGS, OPENAI_FIELDS, VLLM_FIELDS,
    from_mlx_lm, from_vllm, import_text,
)

SMALL_V, SMALL_B = 1000, 6


def small_inputs(seed: int):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(SMALL_B, SMALL_V)) * 2.5).astype(F32)
    history = np.stack([np.concatenate([rng.integers(0, SMALL_V, 30),
                                        rng.choice(np.argsort(-logits[r])[:8], 20)]).astype(np.int32)
                        for r in range(SMALL_B)])
    return logits, history


def final_probs(prog, logits, history, seed=3, **extra):
    kw = {"seed": seed, "pos": 5} if "seed" in {p.name for p in prog.params} else {}
    kw.update({k: v for k, v in (("history", history),) if k in {p.name for p in prog.params}})
    kw.update(extra)
    out = prog(logits, **kw)
    return np.array(out.probs), np.array(out.token)


def assert_same_distribution(ours, theirs, label, boundary_mass=1e-5):
    """Same kept set (up to tokens of negligible total mass at a float boundary) and the same probabilities."""
    differ = (ours > 0) != (theirs > 0)
    assert ours[differ].sum() + theirs[differ].sum() <= boundary_mass, f"{label}: kept sets differ"
    np.testing.assert_allclose(ours[~differ], theirs[~differ], rtol=2e-4, atol=1e-6, err_msg=label)


# ---- Hugging Face: GenerationConfig's fields, enumerated from the installed transformers ----

# a value of each refused field that turns it on (the test checks that this covers every refused field)
HF_REFUSED_EXAMPLES = {
    "num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5, "penalty_alpha": 0.6, "top_h": 0.4,
    "no_repeat_ngram_size": 3, "encoder_no_repeat_ngram_size": 2, "encoder_repetition_penalty": 1.2,
    "bad_words_ids": [[5, 6]], "sequence_bias": [[[5], 1.0]],
    "begin_suppress_tokens": [3], "forced_bos_token_id": 0, "forced_eos_token_id": 2, "guidance_scale": 1.5,
    "min_length": 10, "min_new_tokens": 5, "exponential_decay_length_penalty": [10, 1.1],
    "watermarking_config": {"greenlist_ratio": 0.25}, "force_words_ids": [[7]], "constraints": [{"x": 1}],
    "dola_layers": "high", "remove_invalid_values": True, "token_healing": True, "num_return_sequences": 3,
    "assistant_ensemble_weight": 0.5,
}


def test_hf_every_generation_config_field_is_classified():
    transformers = pytest.importorskip("transformers")
    fields = set(transformers.GenerationConfig().to_dict())
    groups = [set(v) for v in HF_FIELDS.values()]
    assert sum(len(g) for g in groups) == len(set().union(*groups)), "a field is in two groups"
    assert set().union(*groups) == fields, "GenerationConfig's fields changed: classify the new ones"
    assert set(HF_REFUSED_EXAMPLES) == set(HF_FIELDS["refused"])


@pytest.mark.parametrize("key", sorted(HF_REFUSED_EXAMPLES))
def test_hf_refused_field_is_named(key):
    with pytest.raises(SamplecError, match=f"^{re.escape(key)} = "):
        from_hf({"do_sample": True, key: HF_REFUSED_EXAMPLES[key]})


def test_hf_off_values_and_outside_fields():
    base = stage_lines(from_hf({"do_sample": True}))
    # refused fields at their off value (transformers' defaults) map to nothing
    off = {"num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "penalty_alpha": 0,
           "no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0, "bad_words_ids": None,
           "remove_invalid_values": False, "token_healing": False, "num_return_sequences": 1, "min_length": 0,
           "guidance_scale": 1, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}
    assert stage_lines(from_hf({"do_sample": True, **off})) == base
    for key in HF_FIELDS["outside"]:                      # listed in a comment, never silently dropped
        src = from_hf({"do_sample": True, key: 1})
        assert stage_lines(src) == base and re.search(rf"outside the sampler.*\b{re.escape(key)} = 1", src), key


@pytest.mark.parametrize("key, stage", [("epsilon_cutoff", "epsilon"), ("eta_cutoff", "eta")])
def test_hf_epsilon_eta_map_to_their_stages(key, stage):
    src = from_hf({"do_sample": True, key: 3e-4})
    assert f"{stage}(0.0003)" in stage_lines(src)
    samplec.compile(src)
    assert stage_lines(from_hf({key: 3e-4})) == ["greedy()"]      # transformers applies warpers only when sampling
    both = stage_lines(from_hf({"do_sample": True, "typical_p": 0.9, "epsilon_cutoff": 1e-3, "eta_cutoff": 1e-3}))
    assert both.index("typical_p(0.9)") < both.index("epsilon(0.001)") < both.index("eta(0.001)")   # HF's order


def test_llama_cpp_v2_flags_map_to_their_stages():
    src = from_llama_cpp("--dry-multiplier 0.8 --dry-base 2 --dry-allowed-length 3 --dry-penalty-last-n 64 "
                         "--dynatemp-range 0.5 --dynatemp-exp 1.5 --temp 0.7")
    lines = stage_lines(src)
    assert lines[0] == "dry(history, 0.8, base = 2.0, allowed_length = 3, last_n = 64, breakers = dry_breakers)"
    assert "dynamic_temperature(0.7, 0.5, 1.5)" in lines and not any(l.startswith("temperature") for l in lines)
    assert "dry_breakers: tokens" in src and '"\\n"' in src          # the default breaker strings are named
    samplec.compile(src)
    for mode, terminal in ((1, "mirostat(mu, 4.0, 0.2, 100, seed, position = pos)"),
                           (2, "mirostat_v2(mu, 4.0, 0.2, seed, position = pos)")):
        src = from_llama_cpp(f"--mirostat {mode} --mirostat-ent 4 --mirostat-lr 0.2 --temp 0.9 --top-k 10")
        assert stage_lines(src) == ["temperature(0.9)", terminal]     # mirostat replaces the chain
        prog = samplec.compile(src)
        assert "mu" in [k for k, _ in prog.graph.outputs] and any(p.kind == "state" for p in prog.params)
    assert stage_lines(from_llama_cpp("--mirostat 0 --dry-multiplier 0 --dynatemp-range 0 --temp 0.5")) == \
        ["top_k(40)", "top_p(0.95)", "min_p(0.05)", "temperature(0.5)", "sample(seed, position = pos)"]


def test_hf_typo_suggests_the_field():
    with pytest.raises(SamplecError, match=r"unknown generation config field 'temprature' \(did you mean "
                                           r"'temperature'\?\)"):
        from_hf({"do_sample": True, "temprature": 0.7})


def _transformers_processors(cfg: dict):
    """transformers' own processor list for this config (GenerationMixin._get_logits_processor, with generate()'s
    defaults filled in)."""
    import types
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.generation.utils import GenerationMixin

    class Shell(GenerationMixin):
        def __init__(self):
            self.config = types.SimpleNamespace(is_encoder_decoder=False)

    full = {**transformers.GenerationConfig._get_default_generation_params(), **cfg}
    gc = transformers.GenerationConfig(**full)
    return torch, Shell()._get_logits_processor(generation_config=gc, input_ids_seq_length=1,
                                                 encoder_input_ids=torch.zeros((1, 1), dtype=torch.long),
                                                 prefix_allowed_tokens_fn=None, logits_processor=None, device="cpu")


@pytest.mark.parametrize("cfg", [
    {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
     "suppress_tokens": [3, 40]},
    {"do_sample": True, "top_p": 0.8},
    {"do_sample": False, "repetition_penalty": 1.3, "suppress_tokens": [0, 1, 2]},
], ids=["full", "top_p", "greedy"])
def test_hf_import_matches_transformers(cfg):
    torch, procs = _transformers_processors(cfg)
    logits, history = small_inputs(11)
    prog = compile_with_probs(from_hf(cfg))
    probs, tokens = final_probs(prog, logits, history)
    for r in range(SMALL_B):
        scores = torch.tensor(logits[r:r + 1])
        for proc in procs:
            scores = proc(torch.tensor(history[r:r + 1], dtype=torch.long), scores)
        x = scores[0].numpy().astype(np.float64)
        if cfg["do_sample"]:
            assert_same_distribution(probs[r], softmax(x), f"row {r}")
        else:
            assert tokens[r] == int(np.argmax(x)), f"row {r}"


# ---- OpenAI ----

def test_openai_every_field_is_classified_and_typos_are_errors():
    assert not set(OPENAI_FIELDS["mapped"]) & set(OPENAI_FIELDS["outside"])
    src = from_openai({k: 1 for k in OPENAI_FIELDS["outside"]} | {"messages": [{"role": "user"}]})
    for key in OPENAI_FIELDS["outside"]:
        assert re.search(rf"outside the sampler.*\b{key} = ", src), key
    with pytest.raises(SamplecError, match=r"unknown OpenAI request field 'temprature' \(did you mean "
                                           r"'temperature'\?\)"):
        from_openai({"temprature": 0.7})


@pytest.mark.parametrize("key, value", [("top_k", 40), ("min_p", 0.1), ("repetition_penalty", 1.1),
                                        ("min_tokens", 3), ("stop_token_ids", [2])])
def test_openai_vllm_extensions_are_refused_by_name(key, value):
    with pytest.raises(SamplecError, match=rf"'{key}' is not an OpenAI chat-completions field .*--from vllm"):
        from_openai({key: value})


@pytest.mark.parametrize("body, message", [
    ({"best_of": 3}, "best_of = 3: several completions"), ({"n": 2}, "n = 2: several completions"),
    ({"response_format": {"type": "json_object"}}, "constrained decoding"),
])
def test_openai_refused(body, message):
    with pytest.raises(SamplecError, match=re.escape(message)):
        from_openai(body)


def test_openai_off_values():
    assert stage_lines(from_openai({"n": 1, "best_of": 1, "response_format": {"type": "text"}, "top_p": 1,
                                    "presence_penalty": 0, "logit_bias": {}})) == ["sample(seed, position = pos)"]


# ---- llama.cpp: every sampling flag of common/arg.cpp ----

LLAMA_FLAG_EXAMPLES = {   # flag -> (value, whether the chain changes)
    "--min-keep": ("1", False),     # (0 or 1: what every stage keeps anyway; more is refused, below)
    "--temp": ("0.5", True), "--temperature": ("0.5", True), "--top-k": ("7", True), "--top-p": ("0.5", True),
    "--min-p": ("0.2", True), "--top-nsigma": ("1.5", True), "--top-n-sigma": ("1.5", True),
    "--xtc-probability": ("0.5", True), "--xtc-threshold": ("0.2", False), "--typical": ("0.9", True),
    "--typical-p": ("0.9", True), "--repeat-last-n": ("32", False), "--repeat-penalty": ("1.1", True),
    "--presence-penalty": ("0.5", True), "--frequency-penalty": ("0.5", True), "--samplers": ("top_k;temp", True),
    "--sampler-seq": ("kt", True), "--sampling-seq": ("kt", True), "-s": ("5", False), "--seed": ("5", False),
    "-l": ("3+1", True), "--logit-bias": ("3+1", True), "--dry-multiplier": ("0", False),
    "--dry-base": ("2.0", False), "--dry-allowed-length": ("3", False), "--dry-penalty-last-n": ("64", False),
    "--dry-sequence-breaker": ("none", False), "--dynatemp-range": ("0", False), "--dynatemp-exp": ("2", False),
    "--mirostat": ("0", False), "--mirostat-lr": ("0.2", False), "--mirostat-ent": ("4", False),
    "--adaptive-target": ("-1", False), "--adaptive-decay": ("0.5", False), "-bs": (None, False),
    "--backend-sampling": (None, False),
}


def test_llama_cpp_every_sampling_flag():
    assert set(LLAMA_FLAG_EXAMPLES) == set(LLAMA_CPP_FLAGS["mapped"])
    base = from_llama_cpp("")
    for flag, (value, changes) in LLAMA_FLAG_EXAMPLES.items():
        src = from_llama_cpp([flag] + ([value] if value is not None else []))
        samplec.compile(src)
        assert (stage_lines(src) != stage_lines(base)) == changes or flag in ("-s", "--seed"), flag
        assert "outside the sampler" not in src, flag
    for flag in LLAMA_CPP_FLAGS["refused"]:
        with pytest.raises(SamplecError, match=re.escape(flag)):
            from_llama_cpp([flag, "x"])
    assert "seed: seed = 5" in from_llama_cpp("-s 5")


def test_llama_cpp_flags_one_edit_from_a_sampling_flag_and_min_keep_are_errors():
    """A flag one edit from a sampling flag (a letter swapped, dropped, added or changed) is a misspelling, not one
    of llama.cpp's other flags; --min-keep above 1 has no equivalent."""
    for typo, meant in (("--tmep", "--temp"), ("--top-kk", "--top-k"), ("--min-q", "--min-p"),
                        ("--mirostta", "--mirostat")):
        with pytest.raises(SamplecError, match=f"did you mean '{meant}'"):
            from_llama_cpp(f"{typo} 0.5")
    with pytest.raises(SamplecError, match="--min-keep 5"):
        from_llama_cpp("--min-keep 5")
    assert "outside the sampler (not sampling flags): --foo 1 --ctx-size 4096" in \
        from_llama_cpp("--foo 1 --ctx-size 4096")


def test_llama_cpp_other_flags_are_listed():
    src = from_llama_cpp("llama-cli -m m.gguf -c 4096 --top-k 3")
    assert "outside the sampler (not sampling flags): -m m.gguf -c 4096" in src


# ---- mlx-lm ----

def test_mlx_lm_arguments_are_the_installed_signatures():
    import inspect
    su = pytest.importorskip("mlx_lm.sample_utils")
    for fn, table in ((su.make_sampler, MLX_LM_SAMPLER_ARGS), (su.make_logits_processors, MLX_LM_PROCESSOR_ARGS)):
        sig = inspect.signature(fn).parameters
        assert {k: v.default for k, v in sig.items()} == table, fn.__name__


def test_mlx_lm_order_and_off_values():
    src = from_mlx_lm({"temp": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "xtc_probability": 0.5,
                       "logit_bias": {"3": 2.0}, "repetition_penalty": 1.1, "frequency_penalty": 0.2})
    assert stage_lines(src) == ["logit_bias({3: 2.0})", "penalties(history, last_n = 20, repeat = 1.1, "
                                "frequency = 0.2)", "top_p(0.9)", "min_p(0.05)",
                                "xtc(0.1, 0.5, seed, position = pos)", "top_k(20)", "temperature(0.7)",
                                "sample(seed, position = pos)"]
    assert stage_lines(from_mlx_lm({})) == ["greedy()"]                            # temp 0.0: mlx-lm's default
    assert stage_lines(from_mlx_lm({"temp": 0.0, "top_p": 0.5})) == ["greedy()"]
    assert stage_lines(from_mlx_lm({"temp": 1.0, "top_p": 0.0, "min_p": 0.0, "top_k": 0, "xtc_probability": 0.0,
                                    "repetition_penalty": 0, "presence_penalty": None,
                                    "min_tokens_to_keep": 3})) == ["sample(seed, position = pos)"]
    assert stage_lines(from_mlx_lm({"temp": 1.0, "top_p": 1.0})) == ["sample(seed, position = pos)"]
    two = from_mlx_lm({"temp": 1, "repetition_penalty": 1.2, "repetition_context_size": 0,
                       "presence_penalty": 0.5, "presence_context_size": 10})
    assert stage_lines(two)[:2] == ["penalties(history, last_n = -1, repeat = 1.2)",
                                    "penalties(history, last_n = 10, presence = 0.5)"]


@pytest.mark.parametrize("args, message", [
    ({"temperature": 0.7}, "unknown mlx-lm argument 'temperature' (did you mean 'temp'?)"),
    ({"temp": 1, "min_p": 0.1, "min_tokens_to_keep": 2}, "min_tokens_to_keep = 2"),
    ({"temp": 1, "xtc_probability": 0.5, "xtc_special_tokens": [1]}, "xtc_special_tokens = [1]"),
    ({"temp": -1}, "temp = -1 is out of range"),
    ({"temp": 1, "min_p": 2}, "min_p = 2 is out of range"),
    ({"repetition_penalty": 1.1, "repetition_context_size": None}, "repetition_context_size = null"),
])
def test_mlx_lm_errors(args, message):
    with pytest.raises(SamplecError, match=re.escape(message)):
        from_mlx_lm(args)


def _mlx_lm_final(args: dict, logits_row, history_row):
    """mlx-lm's own processors and sampler chain (the closures make_sampler builds), up to the draw."""
    import mlx.core as mx
    su = pytest.importorskip("mlx_lm.sample_utils")
    proc_args = {k: v for k, v in args.items() if k in MLX_LM_PROCESSOR_ARGS}
    samp_args = {k: v for k, v in args.items() if k in MLX_LM_SAMPLER_ARGS}
    x = mx.array(logits_row[None])
    for proc in su.make_logits_processors(**proc_args):
        x = proc(mx.array(history_row), x)
    logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
    sampler = su.make_sampler(**samp_args)
    if sampler is su.greedy_sampler:
        return None, int(sampler(logprobs)[0])
    cells = dict(zip(sampler.__code__.co_freevars, (c.cell_contents for c in sampler.__closure__)))
    for method in cells["sampling_methods"]:
        logprobs = method(logprobs)
    return np.array(logprobs[0] * (1.0 / cells["temp"])).astype(np.float64), None


@pytest.mark.parametrize("args", [
    {"temp": 0.7, "top_p": 0.9, "min_p": 0.02, "top_k": 30, "repetition_penalty": 1.3, "frequency_penalty": 0.3,
     "presence_penalty": 0.2, "logit_bias": {"5": 3.0, "17": -1.5}},
    {"temp": 1.3, "min_p": 0.1, "xtc_probability": 1.0, "xtc_threshold": 0.05, "repetition_penalty": 0.8,
     "repetition_context_size": 0, "presence_penalty": 0.4, "presence_context_size": 7},
    {"temp": 0.0, "repetition_penalty": 1.5, "logit_bias": {"9": 4.0}},
], ids=["chain", "xtc-and-windows", "greedy"])
def test_mlx_lm_import_matches_mlx_lm(args):
    logits, history = small_inputs(12)
    prog = compile_with_probs(from_mlx_lm({k: v for k, v in args.items()}))
    probs, tokens = final_probs(prog, logits, history)
    for r in range(SMALL_B):
        x, greedy = _mlx_lm_final({**args, "logit_bias": {int(k): v for k, v in args.get("logit_bias", {}).items()}}
                                  if "logit_bias" in args else args, logits[r], history[r])
        if greedy is not None:
            assert tokens[r] == greedy, f"row {r}"
        else:
            assert_same_distribution(probs[r], softmax(x), f"row {r}")


# ---- vLLM ----

def _vllm_model():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "vllm_semantics", Path(__file__).resolve().parent / "parity" / "test_vllm_semantics.py")
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent / "parity"))
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.pop(0)
    return mod


def test_vllm_order_two_histories_and_parity():
    params = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.02, "repetition_penalty": 1.2,
              "frequency_penalty": 0.3, "presence_penalty": 0.4, "seed": 77, "logprobs": 3,
              "logit_bias": {"4": 150.0}, "max_tokens": 20, "stop": ["\n"]}
    src = from_vllm(params)
    assert stage_lines(src) == ["logit_bias({4: 100.0})", "penalties(prompt_and_output, repeat = 1.2)",
                                "penalties(output, frequency = 0.3, presence = 0.4)", "temperature(0.8)",
                                "min_p(0.02)", "top_k(40)", "top_p(0.9)", "sample(seed, position = pos)"]
    assert "seed: seed = 77" in src and "-> token, raw_logprob, top_logprobs(3)" in src
    assert re.search(r"outside the sampler.*max_tokens = 20", src) and re.search(r"outside.*stop = \(list\)", src)
    m = _vllm_model()
    logits, history = small_inputs(13)
    prompt, output = history[:, :30], history[:, 30:]
    prog = compile_with_probs(src)
    out = prog(logits, prompt_and_output=history, output=output, seed=77, pos=5)
    for r in range(SMALL_B):
        x = logits[r].copy()
        x[4] += 100.0
        x = m.vllm_penalties(x, prompt[r], output[r], 1.2, 0.3, 0.4)
        x, _ = m.vllm_filters(x, 0.8, 0.02, 40, 0.9)
        assert_same_distribution(np.array(out.probs[r]), softmax(x), f"row {r}")


def test_vllm_greedy_single_history_and_off_values():
    assert stage_lines(from_vllm({"temperature": 0, "top_p": 0.5, "repetition_penalty": 1.1})) == \
        ["penalties(history, repeat = 1.1)", "greedy()"]
    assert stage_lines(from_vllm({"presence_penalty": 0.5})) == ["penalties(history, presence = 0.5)",
                                                                 "sample(seed, position = pos)"]
    assert stage_lines(from_vllm({"top_k": -1, "min_tokens": 0, "n": 1, "best_of": 1, "use_beam_search": False,
                                  "seed": -1})) == ["sample(seed, position = pos)"]
    assert "temperature(0.01)" in from_vllm({"temperature": 0.001})


@pytest.mark.parametrize("params, message", [
    ({"n": 4}, "n = 4: several completions"), ({"best_of": 2}, "best_of = 2"),
    ({"use_beam_search": True}, "use_beam_search = true: beam search"), ({"min_tokens": 5}, "min_tokens = 5"),
    ({"logits_processors": ["f"]}, "logits_processors"), ({"structured_outputs": {"regex": "a+"}}, "constrained"),
    ({"bad_words": ["x"]}, "bad_words"), ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"logprobs": -1}, "logprobs = -1"), ({"prompt_logprobs": 2}, "prompt_logprobs"),
    ({"temprature": 0.5}, "unknown SamplingParams field 'temprature' (did you mean 'temperature'?)"),
    ({"top_p": 0}, "top_p = 0 is out of range"), ({"temperature": 3}, "temperature = 3 is out of range"),
])
def test_vllm_errors(params, message):
    with pytest.raises(SamplecError, match=re.escape(message)):
        from_vllm(params)


def test_vllm_every_field_is_classified():
    groups = [set(v) for v in VLLM_FIELDS.values()]
    assert sum(len(g) for g in groups) == len(set().union(*groups))
    for key in VLLM_FIELDS["outside"]:
        assert re.search(rf"outside the sampler.*\b{key} = 1", from_vllm({key: 1})), key


def test_import_text_entry_point():
    assert import_text("mlx_lm", '{"temp": 0.5}') == from_mlx_lm({"temp": 0.5})
    assert import_text("llama.cpp", "--top-k 3") == from_llama_cpp("--top-k 3")
    with pytest.raises(SamplecError, match=r"^<input>: invalid JSON"):
        import_text("vllm", "{")
    # (a key given twice: which value was meant is not known -- an error, not the last one silently)
    for kind in ("hf", "openai", "mlx-lm", "vllm"):
        with pytest.raises(SamplecError, match=r"^<input>: the key 'temperature' is given twice"):
            import_text(kind, '{"temperature": 0.5, "top_p": 0.9, "temperature": 1.5}')
    with pytest.raises(SamplecError, match=r"the key 'a' is given twice"):
        import_text("openai", '{"logit_bias": {"a": 1, "a": 2}}')


# ---- each mapped field changes the chain (or is refused as pending); each refused vLLM field is named ----

HF_MAPPED_EXAMPLES = {"do_sample": False, "temperature": 0.5, "top_k": 7, "top_p": 0.5, "min_p": 0.2,
                      "typical_p": 0.5, "repetition_penalty": 1.2, "epsilon_cutoff": 0.01, "eta_cutoff": 0.01,
                      "suppress_tokens": [1, 2]}


def test_hf_each_mapped_field_maps():
    assert set(HF_MAPPED_EXAMPLES) == set(HF_FIELDS["mapped"])
    base = from_hf({"do_sample": True, "top_k": 0})
    for key, value in HF_MAPPED_EXAMPLES.items():
        cfg = {"do_sample": True, "top_k": 0, key: value}
        assert from_hf(cfg) != base, key


MLX_LM_EXAMPLES = {   # arg -> (value, other arguments that make it matter)
    "temp": (0.5, {}), "top_p": (0.5, {"temp": 1}), "min_p": (0.2, {"temp": 1}),
    "min_tokens_to_keep": (3, {"temp": 1, "min_p": 0.1}), "top_k": (5, {"temp": 1}),
    "xtc_probability": (0.5, {"temp": 1}), "xtc_threshold": (0.2, {"temp": 1, "xtc_probability": 0.5}),
    "xtc_special_tokens": ([1], {"temp": 1, "xtc_probability": 0.5}), "logit_bias": ({"1": 2.0}, {}),
    "repetition_penalty": (1.2, {}), "repetition_context_size": (5, {"repetition_penalty": 1.2}),
    "presence_penalty": (0.5, {}), "presence_context_size": (5, {"presence_penalty": 0.5}),
    "frequency_penalty": (0.5, {}), "frequency_context_size": (5, {"frequency_penalty": 0.5}),
}


def test_mlx_lm_each_argument_maps_or_is_refused():
    assert set(MLX_LM_EXAMPLES) == set(MLX_LM_SAMPLER_ARGS) | set(MLX_LM_PROCESSOR_ARGS)
    for key, (value, ctx) in MLX_LM_EXAMPLES.items():
        try:
            src = from_mlx_lm({**ctx, key: value})
        except SamplecError as e:
            assert str(e).startswith(f"{key} = "), key          # refused by name
            continue
        assert src != from_mlx_lm(ctx), key
        samplec.compile(src)


VLLM_REFUSED_EXAMPLES = {
    "best_of": 2, "use_beam_search": True, "length_penalty": 0.5, "early_stopping": True, "min_tokens": 3,
    "bad_words": ["x"], "allowed_token_ids": [1], "structured_outputs": {"json": {}}, "guided_decoding": {"regex": "a"},
    "logits_processors": ["p"], "thinking_token_budget": 10, "trace_decode_token_ids": [1, 2],
    "prompt_logprobs": 1, "prompt_logprob_token_ids": [3], "prompt_logprob_start": 2, "logprob_token_ids": [4],
    "output_text_buffer_length": 3, "_eos_token_id": 2, "_all_stop_token_ids": [2], "_bad_words_token_ids": [[1]],
}
VLLM_MAPPED_EXAMPLES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
                        "temperature": 0.5, "top_p": 0.5, "top_k": 5, "min_p": 0.2, "seed": 3, "logprobs": 2,
                        "logit_bias": {"1": 2.0}, "n": 2}


@pytest.mark.parametrize("key", sorted(VLLM_REFUSED_EXAMPLES))
def test_vllm_refused_field_is_named(key):
    with pytest.raises(SamplecError, match=f"^{re.escape(key)} = "):
        from_vllm({key: VLLM_REFUSED_EXAMPLES[key]})


def test_vllm_each_mapped_field_maps():
    assert set(VLLM_REFUSED_EXAMPLES) == set(VLLM_FIELDS["refused"])
    assert set(VLLM_MAPPED_EXAMPLES) == set(VLLM_FIELDS["mapped"])
    base = from_vllm({})
    for key, value in VLLM_MAPPED_EXAMPLES.items():
        if key == "n":
            with pytest.raises(SamplecError, match="^n = 2"):
                from_vllm({key: value})
        else:
            assert from_vllm({key: value}) != base, key


def test_imports_follow_their_systems_at_the_edges():
    """An imported config behaves as its system does: vLLM raises a temperature in (0, 0.01) to 0.01 before its
    greedy test (only 0 is greedy); temperature 0 anywhere gives greedy() with no seed whatever follows it; top_p 0
    keeps the one most probable token in transformers, llama.cpp and OpenAI (top_k(1)); llama.cpp's `typical`
    sampler name; a `#` comment after a flag in a flags file."""
    src = from_vllm({"temperature": 1e-6})
    assert stage_lines(src) == ["temperature(0.01)", "sample(seed, position = pos)"] and "raised to 0.01" in src
    assert stage_lines(from_vllm({"temperature": 0})) == ["greedy()"]
    src = from_openai({"temperature": 0, "top_p": 0.9})
    assert stage_lines(src) == ["temperature(0.0)", "greedy()"] and "seed" not in src.split("{")[0]
    samplec.compile(src)
    for src in (from_hf({"do_sample": True, "top_k": 0, "top_p": 0.0}), from_openai({"top_p": 0}),
                from_llama_cpp("--samplers top_p --top-p 0")):
        assert "top_k(1)" in stage_lines(src) and "top_p(" not in src, src
        samplec.compile(src)
    assert stage_lines(from_llama_cpp("--samplers 'typical;temperature' --typical 0.9 --temp 0.7")) == \
        ["typical_p(0.9)", "temperature(0.7)", "sample(seed, position = pos)"]
    src = from_llama_cpp("--top-k 7   # a comment after a flag\n# a whole line\n--top-p 0.5 --min-p 0 --temp 1\n")
    assert stage_lines(src) == ["top_k(7)", "top_p(0.5)", "sample(seed, position = pos)"]


def test_llama_cpp_flags_split_as_a_shell_would():
    """`#` starts a comment only at the start of a word outside quotes; a quoted value may span lines; a negative
    zero temperature is temperature 0; stages dropped after temperature 0 take their parameters with them."""
    from samplec.importers import _llama_argv
    assert _llama_argv("llama-cli -m models/#1.gguf --temp 0.2 --top-k 5") == \
        ["llama-cli", "-m", "models/#1.gguf", "--temp", "0.2", "--top-k", "5"]
    assert _llama_argv('-p "one\ntwo" --top-k 5 # note\n# line\n--temp 0.5 \\\n --seed 3 \'#q\' a#b') == \
        ["-p", "one\ntwo", "--top-k", "5", "--temp", "0.5", "--seed", "3", "#q", "a#b"]
    src = from_llama_cpp("-m models/#1.gguf --temp 0.2 --top-k 5")
    assert "top_k(5)" in src and "temperature(0.2)" in src
    assert stage_lines(from_llama_cpp("--temp -0.0 --samplers temperature")) == ["temperature(0.0)", "greedy()"]
    src = from_llama_cpp('--samplers "temperature;dry" --dry-multiplier 0.8 --temp 0')
    assert "dry_breakers: tokens" not in src and stage_lines(src) == ["temperature(0.0)", "greedy()"]
    samplec.compile(src)


def test_integers_past_32_bits_are_import_errors_not_programs_that_do_not_compile():
    """An integer field a stage takes as a 32-bit int is checked at import (the program would not compile); seeds
    take 64 bits."""
    with pytest.raises(SamplecError, match="top_k = 99999999999999999999 does not fit in a 32-bit int"):
        from_hf({"do_sample": True, "top_k": 99999999999999999999})
    with pytest.raises(SamplecError, match="--top-k = '4294967296' does not fit"):
        from_llama_cpp("--top-k 4294967296")
    assert "seed: seed = 18446744073709551615" in from_openai({"seed": 2 ** 64 - 1})
