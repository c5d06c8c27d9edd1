"""Parity with llama.cpp's own samplers, through llama-cpp-python's low-level `llama_sampler_*` API (no model).

Each test builds a `llama_token_data_array` over the vocabulary with ctypes (the array lives in a numpy buffer
with the same layout), applies llama.cpp samplers to it with `llama_sampler_apply`, and reads back the tokens
that survive. The same rows go through samplec. On tie-free logits the kept sets must be equal, and the
surviving logits must agree.

Install and run (the wheel builds llama.cpp from source, about 5-10 minutes on 2 cores):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=OFF" pip install -e ".[llama]"
    python -m pytest tests/parity/test_llama_cpp.py

`.ci/run` installs it, so CI runs these. Without llama_cpp installed every test here is skipped (an error under
SAMPLEC_REQUIRE_PARITY=1, as in CI). Results and the documented differences are in
docs/parity.md.
"""
from __future__ import annotations

import ctypes
import functools
import re
from contextlib import contextmanager

import numpy as np
import pytest

import samplec

from parity_common import peer

llama_cpp = peer("llama_cpp")

from parity_common import (  # noqa: E402
    EXAMPLE_HISTORY,
    ROOT,
    V,
    R,
    assert_kept_equal,
    clear_min_p,
    clear_top_n_sigma,
    diff_ids,
    kept,
    logit_rows,
    near_cut_top_p,
    near_cut_typical,
    run_stages,
    sweep,
)

F32 = np.float32
TOKEN = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert TOKEN.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


# ------------------------------------------------------------------------------------------- llama.cpp driver


@contextmanager
def samplers(*specs):
    """Create llama.cpp samplers from (init_function_name, *args) and free them afterwards."""
    made = []
    try:
        for name, *args in specs:
            s = getattr(llama_cpp, name)(*args)
            assert s, name
            made.append(s)
        yield made
    finally:
        for s in made:
            llama_cpp.llama_sampler_free(s)


def penalties_spec(last_n: int, repeat: float, freq: float, present: float):
    """llama_sampler_init_penalties: newer llama.cpp takes n_vocab first."""
    n_args = len(llama_cpp.llama_sampler_init_penalties.argtypes)
    if n_args == 5:
        return ("llama_sampler_init_penalties", V, last_n, repeat, freq, present)
    return ("llama_sampler_init_penalties", last_n, repeat, freq, present)


def accept_history(smpls, history_row) -> None:
    """Feed a history to llama.cpp the way an inference loop does (llama_sampler_accept, oldest first)."""
    for s in smpls:
        for tok in history_row:
            if tok >= 0:
                llama_cpp.llama_sampler_accept(s, int(tok))


def llama_apply(row: np.ndarray, smpls) -> np.ndarray:
    """Apply llama.cpp samplers in order to one row. Returns the final logits [V] (removed = -inf)."""
    buf = np.zeros(row.shape[0], TOKEN)
    buf["id"] = np.arange(row.shape[0])
    buf["logit"] = row
    cur = llama_cpp.llama_token_data_array(
        data=buf.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
        size=row.shape[0], selected=-1, sorted=False)
    for s in smpls:
        llama_cpp.llama_sampler_apply(s, ctypes.byref(cur))
    # Samplers shrink `size` and may move `data` forward inside our buffer (xtc does).
    start = (ctypes.addressof(cur.data.contents) - buf.ctypes.data) // TOKEN.itemsize
    assert 0 <= start and start + cur.size <= buf.shape[0]
    view = buf[start:start + cur.size]
    x = np.full(row.shape[0], -np.inf, F32)
    x[view["id"]] = view["logit"]
    return x


def llama_rows(rows: np.ndarray, spec_of_row, history=None) -> np.ndarray:
    out = np.empty_like(rows)
    for i, row in enumerate(rows):
        with samplers(*spec_of_row(i)) as smpls:
            if history is not None:
                accept_history(smpls, history[i])
            out[i] = llama_apply(row, smpls)
    return out


def assert_same_kept(ours: np.ndarray, theirs: np.ndarray, labels, ignore=None) -> None:
    for i, label in enumerate(labels):
        assert_kept_equal(ours[i], theirs[i], label, None if ignore is None else ignore[i])


def labels_for(values, names):
    return [f"{n} @ {v}" for v in values for n in names]


# ------------------------------------------------------------------------------------------- single stages


def test_version_recorded():
    """docs/parity.md records the llama-cpp-python version the suite was run against."""
    doc = (ROOT / "docs" / "parity.md").read_text(encoding="utf-8")
    assert "llama-cpp-python" in doc
    assert re.search(r"llama-cpp-python[^\n]*\d+\.\d+\.\d+", doc)


def test_temperature():
    rows, names = logit_rows()
    values = [0.0, 0.25, 0.8, 1.0, 1.7]
    batch, t = sweep(rows, values)
    ours, _ = run_stages("t: float", "temperature(t)", batch, t=t)
    theirs = llama_rows(batch, lambda i: [("llama_sampler_init_temp", float(t[i]))])
    assert_same_kept(ours, theirs, labels_for(values, names))


def test_top_k():
    rows, names = logit_rows()
    values = [1, 2, 10, 40, 100, 1000, V - 1, V, V + 10, 0, -1]
    batch, k = sweep(rows, values)
    ours, _ = run_stages("k: int", "top_k(k)", batch, k=k)
    theirs = llama_rows(batch, lambda i: [("llama_sampler_init_top_k", int(k[i]))])
    assert_same_kept(ours, theirs, labels_for(values, names))


def test_top_p():
    rows, names = logit_rows()
    values = [0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0]
    batch, p = sweep(rows, values)
    ours, _ = run_stages("p: float", "top_p(p)", batch, p=p)
    theirs = llama_rows(batch, lambda i: [("llama_sampler_init_top_p", float(p[i]), 1)])
    near = np.stack([near_cut_top_p(batch[i], float(p[i])) for i in range(len(p))])
    assert_same_kept(ours, theirs, labels_for(values, names), ignore=near)


def test_ties_at_the_cut_documented_difference():
    """At a tie on the cut, llama.cpp's sort decides: top_k keeps exactly k tokens and top_p only as many tied
    tokens as it needs. samplec keeps the whole tie in both (spec §2). The difference is tied tokens only."""
    x = np.full(100, -5.0, F32)
    x[0] = 2.0
    x[1:11] = 1.0  # ten tokens tied at 1.0
    ours, _ = run_stages("k: int", "top_k(k)", x[None, :], k=4)
    with samplers(("llama_sampler_init_top_k", 4)) as s:
        theirs = llama_apply(x, s)
    assert kept(ours[0]).sum() == 11 and kept(theirs).sum() == 4
    assert not (kept(theirs) & ~kept(ours[0])).any() and kept(theirs)[0]

    ours, _ = run_stages("p: float", "top_p(p)", x[None, :], p=0.45)
    with samplers(("llama_sampler_init_top_p", 0.45, 1)) as s:
        theirs = llama_apply(x, s)
    a, b = kept(ours[0]), kept(theirs)
    assert np.flatnonzero(a).tolist() == list(range(11))
    assert b[0] and b.sum() < a.sum() and not (b & ~a).any()


def test_min_p():
    rows, names = logit_rows()
    values = [0.0, 0.01, 0.05, 0.1, 0.3, 0.9, 1.0]
    batch, m = sweep(rows, values)
    m = np.array([clear_min_p(batch[i], float(m[i])) if m[i] > 0 else 0.0 for i in range(len(m))])
    ours, _ = run_stages("m: float", "min_p(m)", batch, m=m)
    theirs = llama_rows(batch, lambda i: [("llama_sampler_init_min_p", float(m[i]), 1)])
    assert_same_kept(ours, theirs, labels_for(values, names))


def test_top_n_sigma():
    rows, names = logit_rows()
    values = [-1.0, 0.0, 0.5, 1.0, 2.0, 3.0]
    batch, n = sweep(rows, values)
    n = np.array([clear_top_n_sigma(batch[i], float(n[i])) if n[i] > 0 else float(n[i]) for i in range(len(n))])
    ours, _ = run_stages("n: float", "top_n_sigma(n)", batch, n=n)
    theirs = llama_rows(batch, lambda i: [("llama_sampler_init_top_n_sigma", float(n[i]))])
    assert_same_kept(ours, theirs, labels_for(values, names))


def test_typical_p():
    """Same kept set, except that samplec always keeps the most likely token as well (spec §2). llama.cpp keeps
    the most *typical* tokens, which need not include the argmax. So ours == llama.cpp's + argmax, and where
    llama.cpp kept the argmax, the sets are identical."""
    rows, names = logit_rows()
    values = [0.2, 0.5, 0.9, 0.95, 0.99, 1.0]
    batch, m = sweep(rows, values)
    ours, _ = run_stages("m: float", "typical_p(m)", batch, m=m)
    theirs = llama_rows(batch, lambda i: [("llama_sampler_init_typical", float(m[i]), 1)])
    same = 0
    for i, label in enumerate(labels_for(values, names)):
        top = np.argmax(batch[i])
        near = near_cut_typical(batch[i], float(m[i])) if m[i] < 1 else np.zeros(V, bool)
        near[top] = False
        expected = kept(theirs[i]).copy()
        same += int(expected[top])
        expected[top] = True
        a, b = kept(ours[i]) & ~near, expected & ~near
        assert np.array_equal(a, b), f"{label}: {diff_ids(a, b)}"
    assert same >= len(m) // 2  # most cases keep the argmax anyway: the sets are then equal outright


def test_typical_p_documented_difference():
    """A row where llama.cpp's typical set leaves out the most likely token, and samplec keeps it: one token with
    p = 0.4 and 1000 tokens with p = 0.0006 each. The entropy is about 4.5 nats, so the small tokens
    (-log p ≈ 7.4) are more typical than the big one (-log p ≈ 0.9)."""
    x = np.full(1001, np.log(0.6 / 1000), np.float64)
    x[0] = np.log(0.4)
    x = x.astype(F32) + np.linspace(0, 1e-3, 1001, dtype=F32)  # tie-free
    ours, _ = run_stages("m: float", "typical_p(m)", x[None, :], m=0.5)
    with samplers(("llama_sampler_init_typical", 0.5, 1)) as s:
        theirs = llama_apply(x, s)
    assert not kept(theirs)[0] and kept(ours[0])[0]
    expected = kept(theirs).copy()
    expected[0] = True
    assert np.array_equal(kept(ours[0]), expected)


def test_xtc_when_it_fires():
    """With probability 1 the coin always fires (llama.cpp: chance <= 1; samplec: u < 1), so the kept sets can be
    compared. The coin itself comes from different RNGs (llama.cpp: mt19937; samplec: Threefry, spec §4)."""
    rows, names = logit_rows()
    values = [0.001, 0.01, 0.05, 0.1, 0.2, 0.6]
    batch, t = sweep(rows, values)
    probs = np.stack([R.softmax64(r) for r in batch])
    t = np.array([t[i] * (1.001 if np.any(np.abs(probs[i] - t[i]) < 1e-6) else 1.0) for i in range(len(t))])
    ours, _ = run_stages("t: float", "xtc(t, 1.0, 0)", batch, t=t)
    theirs = llama_rows(batch, lambda i: [("llama_sampler_init_xtc", 1.0, float(t[i]), 1, 0)])
    assert_same_kept(ours, theirs, labels_for(values, names))
    assert any(kept(ours[i]).sum() < V - 1 for i in range(len(t)))  # it really removed tokens somewhere


# ------------------------------------------------------------------------------------------- penalties

PENALTY_CASES = [  # (last_n, repeat, frequency, presence)
    (64, 1.1, 0.0, 0.0),
    (16, 1.3, 0.5, 0.25),
    (1, 0.8, -0.5, 1.0),
    (40, 1.0, 0.3, 0.0),
    (64, 1.0, 0.0, 0.7),
    (100, 1.5, 0.2, 0.2),
]


def _histories(rows: np.ndarray) -> np.ndarray:
    """A history per row that repeats some of the row's most likely tokens (counts up to 4), so that the
    penalties reach tokens that matter, with the example history for the rest."""
    h = np.empty((rows.shape[0], 64), np.int32)
    rng = np.random.default_rng(3)
    for i, row in enumerate(rows):
        top = np.argsort(-row)[:12]
        h[i] = EXAMPLE_HISTORY[i % 2]
        pos = rng.choice(64, 24, replace=False)
        h[i, pos] = rng.choice(top, 24)
    return h


def test_penalties():
    rows, names = logit_rows()
    batch, case_idx = sweep(rows, range(len(PENALTY_CASES)))
    cases = np.array([PENALTY_CASES[c] for c in case_idx])
    hist = _histories(batch)
    ours, _ = run_stages(
        "h: tokens, n: int, r: float, f: float, pr: float",
        "penalties(h, last_n = n, repeat = r, frequency = f, presence = pr)",
        batch, h=hist, n=cases[:, 0].astype(np.int64), r=cases[:, 1], f=cases[:, 2], pr=cases[:, 3])
    theirs = llama_rows(batch, lambda i: [penalties_spec(int(cases[i, 0]), *map(float, cases[i, 1:]))], hist)
    assert_same_kept(ours, theirs, labels_for(PENALTY_CASES, names))
    assert not np.array_equal(ours, batch)  # the penalties did something


def test_penalties_last_n_minus_one_differs():
    """Documented difference: llama_sampler_init_penalties clamps penalty_last_n = -1 to 0, which switches the
    sampler off. (llama.cpp's common code and server map -1 to the context size before calling it.) In samplec,
    last_n = -1 means the whole history. samplec's last_n = H matches llama.cpp's penalty_last_n = H."""
    rows, _ = logit_rows()
    row, hist = rows[0], _histories(rows[:1])
    with samplers(penalties_spec(-1, 1.5, 0.5, 0.5)) as s:
        accept_history(s, hist[0])
        theirs_off = llama_apply(row, s)
    np.testing.assert_array_equal(theirs_off, row)
    with samplers(penalties_spec(64, 1.5, 0.5, 0.5)) as s:
        accept_history(s, hist[0])
        theirs_all = llama_apply(row, s)
    ours, _ = run_stages("h: tokens", "penalties(h, last_n = -1, repeat = 1.5, frequency = 0.5, presence = 0.5)",
                         row[None, :], h=hist)
    np.testing.assert_allclose(ours[0], theirs_all, rtol=1e-6, atol=1e-6)
    assert not np.array_equal(ours[0], row)


# ------------------------------------------------------------------------------------------- the default chain


def _default_chain_source() -> str:
    """examples/llama_cpp_default.smp's main sampler, with its terminal replaced by a distribution output."""
    src = (ROOT / "examples" / "llama_cpp_default.smp").read_text(encoding="utf-8")
    src, n_out = re.subn(r"\)\s*->[^{]*\{", f") -> probs, candidates({V}) {{", src, count=1)
    src, n_term = re.subn(r"\n\s*sample\(seed, position = pos\)\n\}", "\n}", src, count=1)
    assert n_out == 1 and n_term == 1
    return src


CHAIN_CASES = [
    {},  # llama.cpp's defaults
    dict(penalty_last_n=32, repeat_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.2,
         top_k=100, top_p=0.9, min_p=0.02, temperature=0.7),
    dict(top_n_sigma=1.5, top_k=0, typical_p=1.0, top_p=0.8, min_p=0.0, temperature=1.2),
    dict(repeat_penalty=1.3, top_k=20, top_p=1.0, min_p=0.1, temperature=0.0),
]
LLAMA_DEFAULTS = dict(penalty_last_n=64, repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                      top_n_sigma=-1.0, top_k=40, typical_p=1.0, top_p=0.95, min_p=0.05, temperature=0.8)


def _llama_default_chain(p: dict):
    return [
        penalties_spec(p["penalty_last_n"], p["repeat_penalty"], p["frequency_penalty"], p["presence_penalty"]),
        # dry: not in samplec (off by default in llama.cpp)
        ("llama_sampler_init_top_n_sigma", p["top_n_sigma"]),
        ("llama_sampler_init_top_k", p["top_k"]),
        ("llama_sampler_init_typical", p["typical_p"], 0),
        ("llama_sampler_init_top_p", p["top_p"], 0),
        ("llama_sampler_init_min_p", p["min_p"], 0),
        ("llama_sampler_init_xtc", 0.0, 0.1, 0, 0),
        ("llama_sampler_init_temp", p["temperature"]),
    ]


@pytest.mark.parametrize("case", range(len(CHAIN_CASES)))
def test_default_chain(case):
    """examples/llama_cpp_default.smp against llama.cpp's default chain (common/sampling.cpp order), with
    llama.cpp's defaults and with other settings: same kept set, same final distribution."""
    rows, names = logit_rows()
    hist = _histories(rows)
    p = {**LLAMA_DEFAULTS, **CHAIN_CASES[case]}
    ours, probs = run_stages_from_source(_default_chain_source(), rows, history=hist, **p)
    theirs = llama_rows(rows, lambda i: _llama_default_chain(p), hist)
    assert_same_kept(ours, theirs, [f"{n} {p}" for n in names])
    for i in range(rows.shape[0]):
        np.testing.assert_allclose(probs[i], R.softmax64(theirs[i]), atol=1e-6)


def test_default_chain_dist_draws_from_the_kept_set():
    """llama.cpp's own `dist` sampler, appended to the default chain, only ever picks tokens samplec keeps."""
    rows, _ = logit_rows()
    hist = _histories(rows)
    ours, _ = run_stages_from_source(_default_chain_source(), rows, history=hist, **LLAMA_DEFAULTS)
    for i, row in enumerate(rows):
        for seed in range(5):
            with samplers(*_llama_default_chain(LLAMA_DEFAULTS), ("llama_sampler_init_dist", seed)) as s:
                accept_history(s, hist[i])
                buf_x = row.copy()
                buf = np.zeros(V, TOKEN)
                buf["id"] = np.arange(V)
                buf["logit"] = buf_x
                cur = llama_cpp.llama_token_data_array(
                    data=buf.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
                    size=V, selected=-1, sorted=False)
                for smpl in s:
                    llama_cpp.llama_sampler_apply(smpl, ctypes.byref(cur))
                token = cur.data[cur.selected].id
            assert kept(ours[i])[token]


@functools.lru_cache(maxsize=None)
def _compile(src: str, sampler: str) -> samplec.Program:
    return samplec.compile(src, sampler=sampler)


def run_stages_from_source(src: str, logits: np.ndarray, **params):
    """Like parity_common.run_stages, for the llama_cpp_default sampler of a source text that outputs
    probs, candidates(V)."""
    prog = _compile(src, "llama_cpp_default")
    out = prog(np.ascontiguousarray(logits, F32), **{k: v for k, v in params.items()
                                                     if k in {q.name for q in prog.params}})
    ids = np.array(out.candidates.ids)
    vals = np.array(out.candidates.values)
    x = np.full(logits.shape, -np.inf, F32)
    np.put_along_axis(x, ids.astype(np.int64), vals, axis=1)
    return x, np.array(out.probs)


# ------------------------------------------------------------------------------------------- v2 stages (spec §6)


def llama_temp_ext_temperature(row: np.ndarray, t: float, r: float, ex: float) -> np.float32:
    """The temperature llama_sampler_temp_ext_apply computes, step for step in float32: the candidates sorted by
    logit (descending), softmax with a float32 sum one token after another, the entropy summed the same way, then
    min_temp + (max_temp - min_temp) * powf(H / ln N, exponent)."""
    f = np.float32
    x = np.sort(row.astype(f))[::-1]
    e = np.exp(x - x[0]).astype(f)
    p = (e / np.cumsum(e, dtype=f)[-1]).astype(f)
    h = -np.cumsum(np.where(p > 0, p * np.log(p), f(0)).astype(f), dtype=f)[-1]
    lo, hi = f(max(0.0, t - r)), f(t + r)
    return f(lo + (hi - lo) * np.power(f(h / -np.log(f(1) / f(x.size))), f(ex)))


def test_dynamic_temperature():
    """temp_ext on tie-free rows: the same kept set, and the same rule -- each logit divided by one temperature from
    the normalized entropy. The two temperatures differ by llama.cpp's float32 arithmetic alone: it sums the softmax
    normalizer and the entropy in float32, one token after another, which moves its temperature away from the exact
    one (1.6e-4 relative on the sharp row at exponent 2, where H / ln N is small and squared); samplec's is the
    exact one to float32 rounding (its sums are in double). So: llama.cpp's output is x / (that float32
    computation, transcribed above), samplec's is x / (the exact temperature), and samplec's equals llama.cpp's
    rescaled from the one temperature to the other."""
    rows, names = logit_rows()
    drift = []
    for t, r, ex in ((0.8, 0.5, 1.0), (1.0, 1.0, 2.0), (0.3, 0.5, 0.5)):
        ours, _ = run_stages("t: float, r: float, ex: float", "dynamic_temperature(t, r, ex)", rows, t=t, r=r, ex=ex)
        theirs = llama_rows(rows, lambda i: [("llama_sampler_init_temp_ext", t, r, ex)])
        for i, name in enumerate(names):
            a = kept(ours[i])
            assert np.array_equal(a, kept(theirs[i])), name
            x = rows[i].astype(np.float64)
            p = np.exp(x - x.max())
            p /= p.sum()
            lo = max(0.0, t - r)
            exact_t = lo + (t + r - lo) * (-(p * np.log(p)).sum() / np.log(x.size)) ** ex
            llama_t = float(llama_temp_ext_temperature(rows[i], t, r, ex))
            label = f"{name} t={t} range={r} exponent={ex}"
            np.testing.assert_allclose(theirs[i][a], x[a] / llama_t, rtol=1e-5, atol=0, err_msg=f"llama.cpp {label}")
            np.testing.assert_allclose(ours[i][a], x[a] / exact_t, rtol=2e-6, atol=2e-6, err_msg=f"samplec {label}")
            np.testing.assert_allclose(ours[i][a], theirs[i][a] * (llama_t / exact_t), rtol=1e-5, atol=0,
                                       err_msg=label)
            drift.append(abs(llama_t / exact_t - 1))
    assert max(drift) > 1e-4      # (the sharp row: the comparison above is tighter than the drift it accounts for)


def test_dry_without_breakers():
    """DRY's penalties after llama.cpp accepted the same history (no breakers: they would need a vocabulary)."""
    rows, names = logit_rows()
    rng = np.random.default_rng(3)
    history = np.stack([np.tile(rng.integers(0, 50, 7), 6)[:40] for _ in range(rows.shape[0])]).astype(np.int32)
    for mult, base, allowed, last_n in ((0.8, 1.75, 2, -1), (1.0, 2.0, 1, 16), (0.5, 1.5, 3, 30)):
        ours, _ = run_stages("h: tokens", f"dry(h, {mult}, {base}, {allowed}, {last_n})", rows, h=history)
        # (llama-cpp-python 0.3.36 dropped the n_ctx_train argument of older releases, which last_n = -1 meant;
        # without it -1 is the whole history it was given)
        old_api = len(llama_cpp.llama_sampler_init_dry.argtypes) == 8
        ctx = (4096,) if old_api else ()
        window = last_n if old_api or last_n != -1 else history.shape[1]
        theirs = llama_rows(rows, lambda i: [("llama_sampler_init_dry", None, *ctx, mult, base, allowed, window,
                                              None, 0)], history=history)
        for i, name in enumerate(names):
            np.testing.assert_allclose(ours[i], theirs[i], rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("version", ["mirostat", "mirostat_v2"])
def test_mirostat_kept_set(version):
    """The candidates llama.cpp's mirostat leaves (its array after the call, truncated to the drawn-from set) are
    the set samplec draws from, at the starting mu = 2 tau: the token lies in it, and its mass under `probs` (the
    distribution before the terminal) is the token's probability over its `logprob` (under the truncated one)."""
    rows, names = logit_rows()
    src = (f"sampler s(mu: state) -> token, logprob, probs {{ {version}(mu, 3.0, 0.1, seed = 1) }}")
    out = samplec.compile(src)(rows)
    probs, token, logprob = np.array(out.probs), np.array(out.token), np.array(out.logprob)
    spec = (lambda i: [("llama_sampler_init_mirostat", V, 1, 3.0, 0.1, 100)]) if version == "mirostat" else \
        (lambda i: [("llama_sampler_init_mirostat_v2", 1, 3.0, 0.1)])
    theirs = llama_rows(rows, spec)
    for i, name in enumerate(names):
        keep = kept(theirs[i])
        assert keep[token[i]], name
        mass = float(np.sum(probs[i][keep], dtype=np.float64))
        np.testing.assert_allclose(probs[i][token[i]] / np.exp(logprob[i]), mass, rtol=2e-4, err_msg=name)
