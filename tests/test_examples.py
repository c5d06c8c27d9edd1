"""Every sampler of every `examples/*.smp` compiles, runs on `examples/logits.npy` and agrees with the numpy oracle.

For each sampler the test reads the stage list straight from the source text with a small parser of its own
(independent of samplec's frontend), runs the compiled program on the example logits [2, 32000], and runs the
same chain row by row through `tests/reference.py`'s `run_chain`. Tokens must be equal. logprob and raw_logprob
must agree within 1e-5. top_logprobs, probs and candidates are checked too when a sampler outputs them.

Each sampler runs twice: once with its defaults (only the required parameters given) and once with "exercised"
values, one per row, chosen by parameter name (temperature, top_p, penalties, ...), so that every stage actually
filters something.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import pytest

import samplec

try:  # works whether or not tests/ is a package
    from . import reference as R
except ImportError:  # pragma: no cover
    import reference as R  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.smp"))

# The examples this issue adds. If one disappears, the test says so rather than silently testing less.
REQUIRED = {"llama_cpp_default.smp", "mlx_lm_default.smp", "openai.smp", "hf_generate.smp", "vllm.smp"}

# ------------------------------------------------------------------------------------------ a tiny .smp reader
# Independent of samplec.frontend: enough for the examples (comments, multi-line parameter lists, `;`,
# keyword arguments, dict literals).

# Positional parameter order of each stage (spec §2); names are those tests/reference.py accepts.
SIGNATURES = {
    "temperature": ("t",),
    "top_k": ("k",),
    "top_p": ("p",),
    "min_p": ("m",),
    "typical_p": ("m",),
    "top_n_sigma": ("n",),
    "xtc": ("threshold", "probability", "seed", "position"),
    "penalties": ("history", "last_n", "repeat", "frequency", "presence"),
    "logit_bias": ("b",),
    "allow": ("mask",),
    "greedy": (),
    "sample": ("seed", "position"),
}
TERMINALS = {"greedy", "sample"}


def _strip_comments(text: str) -> str:
    return re.sub(r"#[^\n]*", "", text)


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside {...}."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def _literal(tok: str):
    tok = tok.strip()
    if tok.startswith("{"):
        items = _split_top(tok[1:-1])
        return {"dict": {int(k): float(v) for k, v in (i.split(":") for i in items)}}
    if re.fullmatch(r"[+-]?inf", tok):
        return {"lit": float(tok)}
    if re.fullmatch(r"[+-]?[0-9]+", tok):
        return {"lit": int(tok)}
    if re.fullmatch(r"[+-]?([0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)([eE][+-]?[0-9]+)?", tok):
        return {"lit": float(tok)}
    assert re.fullmatch(r"[A-Za-z_]\w*", tok), tok
    return {"name": tok}


def read_samplers(path: Path) -> dict[str, dict]:
    """name -> {"params": {name: (type, default or None)}, "outputs": [(name, arg)], "stages": [(name, {k: v})]}"""
    text = _strip_comments(path.read_text(encoding="utf-8"))
    out = {}
    for m in re.finditer(r"sampler\s+(\w+)\s*\(([^)]*)\)\s*(->([^{]*))?\{((?:[^{}]|\{[^{}]*\})*)\}", text):
        name, params_src, _, outs_src, body = m.groups()
        params = {}
        for p in _split_top(params_src):
            pm = re.fullmatch(r"(\w+)\s*:\s*(\w+)\s*(=\s*(.+))?", p, re.S)
            assert pm, p
            params[pm.group(1)] = (pm.group(2), _literal(pm.group(4))["lit"] if pm.group(4) else None)
        outputs = []
        for o in _split_top(outs_src or "token"):
            om = re.fullmatch(r"(\w+)\s*(\(\s*(\d+)\s*\))?", o)
            outputs.append((om.group(1), int(om.group(3)) if om.group(3) else None))
        stages = []
        for sm in re.finditer(r"(\w+)\s*\(((?:[^(){}]|\{[^}]*\})*)\)", body):
            sname, args_src = sm.groups()
            sig = SIGNATURES[sname]
            args, pos = {}, 0
            for a in _split_top(args_src):
                km = re.fullmatch(r"(\w+)\s*=\s*(.+)", a, re.S)
                if km and not a.startswith("{"):
                    args[km.group(1)] = _literal(km.group(2))
                else:
                    args[sig[pos]] = _literal(a)
                    pos += 1
            stages.append((sname, args))
        out[name] = {"params": params, "outputs": outputs, "stages": stages}
    return out


def all_samplers() -> list[tuple[str, str]]:
    return [(f.name, s) for f in EXAMPLE_FILES for s in read_samplers(f)]


# ------------------------------------------------------------------------------------------ inputs

LOGITS = np.load(EXAMPLES / "logits.npy")
HISTORY = np.load(EXAMPLES / "history.npy")
B, V = LOGITS.shape


def _history_with_padding() -> np.ndarray:
    h = HISTORY.copy()
    h[1, :8] = -1  # row 1: a shorter history, left-padded
    return h


def _mask() -> np.ndarray:
    rng = np.random.default_rng(5)
    m = rng.random((B, V)) < 0.5
    m[np.arange(B), LOGITS.argmax(axis=1)] = False  # forbid each row's favourite: the chain must cope
    return m


def _bias() -> np.ndarray:
    rng = np.random.default_rng(6)
    b = np.zeros((B, V), np.float32)
    ids = rng.integers(0, V, (B, 20))
    for r in range(B):
        b[r, ids[r]] = rng.uniform(-100, 100, 20).astype(np.float32)
        b[r, LOGITS[r].argmax()] = -100.0  # ban each row's favourite
        b[r, np.argsort(-LOGITS[r])[7]] = 6.0  # promote the 8th-best token
    return b


def array_value(kind: str, name: str) -> np.ndarray:
    if kind == "tokens":
        # An "output" history (OpenAI / vLLM) is the tail of the whole one; every other history is all of it.
        return _history_with_padding()[:, -16:] if name == "output" else _history_with_padding()
    if kind == "mask":
        return _mask()
    if kind == "bias":
        return _bias()
    raise AssertionError(kind)


# Per-row values that make each stage do something on these logits (row 0, row 1), by parameter name.
EXERCISED = {
    "temperature": [0.7, 1.3], "temp": [0.7, 1.3],
    "top_k": [40, 7], "top_p": [0.9, 0.5], "min_p": [0.05, 0.2], "typical_p": [0.9, 0.5],
    "top_n_sigma": [1.5, 0.8],
    "xtc_probability": [1.0, 0.5], "xtc_threshold": [0.001, 0.01],
    "penalty_last_n": [64, 16], "repeat_penalty": [1.3, 0.9], "repetition_penalty": [1.3, 0.9],
    "frequency_penalty": [0.5, -0.25], "presence_penalty": [0.75, 1.5],
    "seed": [7, 12345678901234567], "pos": [3, 0],
}
# For a required scalar parameter with no entry above: a value inside the range of every stage argument.
SCALAR_FALLBACK = {"float": 1.0, "int": 0, "seed": 0}


def param_sets(params: dict) -> dict[str, dict]:
    """{"defaults": {...}, "exercised": {...}}: keyword arguments for the compiled program."""
    required = {n: array_value(k, n) for n, (k, d) in params.items() if k in ("tokens", "mask", "bias")}
    for n, (k, d) in params.items():
        if k in SCALAR_FALLBACK and d is None:  # a required scalar: a value by name, else one in every range
            required[n] = np.array(EXERCISED[n], dtype=np.uint64 if k == "seed" else None) if n in EXERCISED \
                else SCALAR_FALLBACK[k]
    exercised = dict(required)
    for n, (k, d) in params.items():
        if n in EXERCISED:
            exercised[n] = np.array(EXERCISED[n], dtype=np.uint64 if k == "seed" else None)
    return {"defaults": required, "exercised": exercised}


def row_value(params: dict, kwargs: dict, name: str, row: int):
    kind, default = params[name]
    if name in kwargs:
        v = np.asarray(kwargs[name])
        return v[row] if kind in ("tokens", "mask", "bias") or v.ndim == 1 else v[()]
    return default


def reference_row(sampler: dict, kwargs: dict, row: int) -> dict:
    params = sampler["params"]

    def resolve(arg):
        if "lit" in arg:
            return arg["lit"]
        if "dict" in arg:
            return arg["dict"]
        v = row_value(params, kwargs, arg["name"], row)
        kind = params[arg["name"]][0]
        if kind == "seed":
            return int(v)
        if kind == "int":
            return int(v)
        if kind == "float":
            return float(v)
        return v

    stages, terminal = [], None
    for name, args in sampler["stages"]:
        kw = {k: resolve(v) for k, v in args.items()}
        if name in TERMINALS:
            terminal = (name, kw)
        else:
            stages.append((name, kw))
    return R.run_chain(LOGITS[row], stages, terminal, row=row)


@functools.lru_cache(maxsize=None)
def compiled(file: str, sampler: str, opt: int) -> samplec.Program:
    return samplec.compile_file(EXAMPLES / file, sampler=sampler, opt_level=opt)


# ------------------------------------------------------------------------------------------ tests


def test_required_examples_exist():
    names = {f.name for f in EXAMPLE_FILES}
    assert REQUIRED <= names, f"missing examples: {sorted(REQUIRED - names)}"
    assert (EXAMPLES / "logits.npy").exists() and LOGITS.dtype == np.float32 and LOGITS.shape == (2, 32000)
    assert HISTORY.dtype == np.int32 and HISTORY.shape == (2, 64)


def test_reader_sees_every_sampler():
    """The test's own reader finds exactly the samplers samplec finds (nothing is skipped silently)."""
    from samplec.frontend.parser import parse

    for f in EXAMPLE_FILES:
        ours = list(read_samplers(f))
        theirs = [s.name for s in parse(f.read_text(encoding="utf-8"), str(f)).samplers]
        assert ours == theirs, f.name
        for name, s in read_samplers(f).items():
            ast = next(x for x in parse(f.read_text(encoding="utf-8"), str(f)).samplers if x.name == name)
            assert [st[0] for st in s["stages"]] == [st.name for st in ast.stages], (f.name, name)


@pytest.mark.parametrize("file,sampler", all_samplers())
@pytest.mark.parametrize("which", ["defaults", "exercised"])
def test_example_matches_reference(file, sampler, which):
    spec = read_samplers(EXAMPLES / file)[sampler]
    kwargs = param_sets(spec["params"])[which]
    prog = compiled(file, sampler, 2)
    out = prog(LOGITS, **kwargs)
    outputs = dict(spec["outputs"])
    for row in range(B):
        ref = reference_row(spec, kwargs, row)
        where = f"{file}:{sampler} ({which}) row {row}"
        if "token" in outputs:
            assert int(np.array(out.token)[row]) == ref["token"], where
        if "logprob" in outputs:
            assert abs(float(np.array(out.logprob)[row]) - ref["logprob"]) <= 1e-5, where
        if "raw_logprob" in outputs:
            assert abs(float(np.array(out.raw_logprob)[row]) - ref["raw_logprob"]) <= 1e-5, where
        if "top_logprobs" in outputs:
            ids, vals = R.top_logprobs(LOGITS[row], outputs["top_logprobs"])
            np.testing.assert_array_equal(np.array(out.top_logprobs.ids)[row], ids, err_msg=where)
            np.testing.assert_allclose(np.array(out.top_logprobs.values)[row], vals, atol=1e-5, err_msg=where)
        if "probs" in outputs:
            np.testing.assert_allclose(np.array(out.probs)[row], ref["probs"], atol=1e-6, err_msg=where)
        if "candidates" in outputs:
            ids, vals = R.candidates(ref["x"], outputs["candidates"])
            np.testing.assert_array_equal(np.array(out.candidates.ids)[row], ids, err_msg=where)
            np.testing.assert_allclose(np.array(out.candidates.values)[row], vals, atol=1e-5, err_msg=where)


@pytest.mark.parametrize("file,sampler", [("vllm.smp", "vllm"), ("llama_cpp_default.smp", "llama_cpp_default")])
def test_example_opt_levels_agree(file, sampler):
    """-O0 and -O2 give the same tokens on the example chains (the semantics do not depend on the passes)."""
    spec = read_samplers(EXAMPLES / file)[sampler]
    kwargs = param_sets(spec["params"])["exercised"]
    a, b = compiled(file, sampler, 0)(LOGITS, **kwargs), compiled(file, sampler, 2)(LOGITS, **kwargs)
    np.testing.assert_array_equal(np.array(a.token), np.array(b.token))
    np.testing.assert_allclose(np.array(a.logprob), np.array(b.logprob), atol=1e-5)


def test_exercised_values_change_the_result():
    """The exercised parameter values really act: they change the chosen tokens of the chains with filters."""
    changed = 0
    for file, sampler in all_samplers():
        spec = read_samplers(EXAMPLES / file)[sampler]
        if not any(n in EXERCISED and n not in ("seed", "pos") for n in spec["params"]):
            continue
        sets = param_sets(spec["params"])
        d = reference_row(spec, sets["defaults"], 1)
        e = reference_row(spec, sets["exercised"], 1)
        changed += int(not np.array_equal(np.isfinite(d["x"]), np.isfinite(e["x"])))
    assert changed >= 5


def _bits(out) -> dict:
    """Every output of a call as numpy arrays (top_logprobs / candidates as their ids and values)."""
    return {name: np.array(v) for name, v in out.to_dict().items()}


@pytest.mark.parametrize("opt", (0, 1, 2))
@pytest.mark.parametrize("file,sampler", all_samplers())
def test_compiled_equals_uncompiled(file, sampler, opt):
    """A program under mx.compile (what users run) gives the same bits as op by op (what the tests marked
    `uncompiled` run, tests/conftest.py): every output, exercised values, the example logits and a flat row."""
    import mlx.core as mx
    spec = read_samplers(EXAMPLES / file)[sampler]
    kwargs = param_sets(spec["params"])["exercised"]
    x = LOGITS.copy()
    x[1] = np.random.default_rng(3).normal(0, 0.05, V).astype(np.float32)
    prog = compiled(file, sampler, opt)
    fused = _bits(prog(x, **kwargs))
    mx.disable_compile()
    try:
        plain = _bits(samplec.compile_file(EXAMPLES / file, sampler=sampler, opt_level=opt)(x, **kwargs))
    finally:
        mx.enable_compile()
    assert fused.keys() == plain.keys()
    for name in fused:
        np.testing.assert_array_equal(fused[name], plain[name], err_msg=f"{file} {sampler} -O{opt} {name}")
