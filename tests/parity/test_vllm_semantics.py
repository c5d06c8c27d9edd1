"""vLLM's sampling semantics, encoded as examples/vllm.smp, against an independent model of vLLM's documented
operations and against values computed by hand from vLLM's formulas. vLLM itself is not installable here (it
needs CUDA or a platform build), so the model below re-implements, in numpy float32, what vLLM's v1 sampler
does (vllm/v1/sample/sampler.py, vllm/model_executor/layers/utils.py apply_penalties,
vllm/v1/sample/ops/topk_topp_sampler.py apply_top_k_top_p):

    logits (float32)
    -> allowed_token_ids / logit_bias
    -> penalties: repetition over prompt + output (x > 0 ? x * (1/r) : x * r),
                  then x -= frequency * count_in_output, then x -= presence * (count_in_output > 0)
    -> temperature (x / t; t < 1e-5 means greedy)
    -> min_p (probs < min_p * max(probs) removed)
    -> top_k (sorted ascending; x < k-th largest removed: ties kept)
    -> top_p (sorted ascending; cumulative probability <= 1 - p removed; the last one always kept)
    -> sample

The examples file models the two histories vLLM uses with two `penalties` stages: `prompt_and_output` for the
repetition penalty and `output` for frequency and presence. These tests need only numpy (no torch, no vLLM).
"""
from __future__ import annotations

import functools
import re

import numpy as np
import pytest

import samplec
from parity_common import (
    EXAMPLE_HISTORY,
    ROOT,
    R,
    assert_kept_equal,
    kept,
    logit_rows,
    near_cut_top_p,
)

F32 = np.float32
NEG_INF = F32(-np.inf)

# ------------------------------------------------------------------------------------------- a model of vLLM


def vllm_penalties(x, prompt, output, rep, freq, pres):
    x = np.asarray(x, F32).copy()
    n = x.shape[0]
    prompt_mask = np.bincount(prompt[(prompt >= 0) & (prompt < n)], minlength=n)[:n] > 0
    counts = np.bincount(output[(output >= 0) & (output < n)], minlength=n)[:n]
    out_mask = counts > 0
    pen = np.where(prompt_mask | out_mask, F32(rep), F32(1.0)).astype(F32)
    scaling = np.where(x > 0, (F32(1.0) / pen).astype(F32), pen).astype(F32)
    x = (x * scaling).astype(F32)
    x = (x - F32(freq) * counts.astype(F32)).astype(F32)
    x = (x - F32(pres) * out_mask.astype(F32)).astype(F32)
    return x


def vllm_filters(x, temp, min_p, top_k, top_p):
    """temperature -> min_p -> top_k -> top_p. Returns (final x, x as top_p saw it)."""
    x = (np.asarray(x, F32) / F32(temp)).astype(F32)
    if min_p > 0:
        probs = R.softmax32(x)
        x = np.where(probs < F32(min_p) * probs.max(), NEG_INF, x).astype(F32)
    if 0 < top_k < x.shape[0]:
        kth = np.sort(x)[x.shape[0] - top_k]
        x = np.where(x < kth, NEG_INF, x).astype(F32)
    before_top_p = x.copy()
    if top_p < 1.0:
        order = np.argsort(x, kind="stable")
        probs_sort = R.softmax32(x[order])
        cs = np.cumsum(probs_sort, dtype=F32)
        remove = cs <= F32(1.0) - F32(top_p)
        remove[-1] = False
        x = x.copy()
        x[order[remove]] = NEG_INF
    return x, before_top_p


# ------------------------------------------------------------------------------------------- samplec side


@functools.lru_cache(maxsize=None)
def vllm_program(outputs: str) -> samplec.Program:
    """examples/vllm.smp's `vllm` sampler, with extra outputs appended."""
    src = (ROOT / "examples" / "vllm.smp").read_text(encoding="utf-8")
    src, n = re.subn(r"-> token, logprob, raw_logprob, top_logprobs\(5\) \{",
                     f"-> token, logprob, raw_logprob, top_logprobs(5), {outputs} {{", src, count=1)
    assert n == 1
    return samplec.compile(src, sampler="vllm")


def run_vllm_example(logits, prompt, output, **params):
    """Runs the example with prompt+output and output histories (padded with -1). Returns (x, outputs)."""
    n, v = logits.shape
    both = np.concatenate([prompt, output], axis=1).astype(np.int32)
    out = vllm_program(f"probs, candidates({v})")(logits, prompt_and_output=both,
                                                   output=output.astype(np.int32), **params)
    x = np.full((n, v), -np.inf, F32)
    np.put_along_axis(x, np.array(out.candidates.ids).astype(np.int64), np.array(out.candidates.values), axis=1)
    return x, out


def histories(rows: np.ndarray, n_prompt: int = 48, n_output: int = 16):
    """A prompt (the example history plus some of the row's likely tokens) and an output that repeats a few
    likely tokens several times, each padded with -1 on the left in row 1 (shorter sequences)."""
    rng = np.random.default_rng(8)
    prompt = np.empty((rows.shape[0], n_prompt), np.int64)
    output = np.empty((rows.shape[0], n_output), np.int64)
    for i, row in enumerate(rows):
        top = np.argsort(-row)[:12]
        prompt[i] = EXAMPLE_HISTORY[i % 2][:n_prompt]
        prompt[i, rng.choice(n_prompt, 6, replace=False)] = top[:6]
        output[i] = rng.choice(np.concatenate([top[3:9], EXAMPLE_HISTORY[i % 2][-4:]]), n_output)
    prompt[1, :10] = -1
    output[1, :5] = -1
    return prompt, output


CASES = [
    dict(),  # SamplingParams defaults
    dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3, temperature=0.7, top_p=0.9),
    dict(repetition_penalty=0.9, frequency_penalty=-0.4, presence_penalty=1.0, temperature=1.3,
         min_p=0.05, top_k=50),
    dict(repetition_penalty=1.5, frequency_penalty=1.0, temperature=0.5, min_p=0.1, top_k=20, top_p=0.8),
    dict(presence_penalty=2.0, temperature=1.0, top_k=1000, top_p=0.95),
]
DEFAULTS = dict(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, temperature=1.0,
                min_p=0.0, top_k=0, top_p=1.0)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_vllm_example_matches_the_vllm_model(case):
    """Kept sets equal (outside tokens float rounding may put on either side of the top_p cut). Surviving
    logits within 1e-6 relative: vLLM multiplies by 1/r where samplec divides by r, so the last bit may
    differ. samplec's token is one of them."""
    rows, names = logit_rows()
    prompt, output = histories(rows)
    c = {**DEFAULTS, **CASES[case]}
    ours, out = run_vllm_example(rows, prompt, output, seed=np.arange(rows.shape[0]), **c)
    for i, name in enumerate(names):
        pen = vllm_penalties(rows[i], prompt[i], output[i], c["repetition_penalty"], c["frequency_penalty"],
                             c["presence_penalty"])
        theirs, before = vllm_filters(pen, c["temperature"], c["min_p"], c["top_k"], c["top_p"])
        near = near_cut_top_p(before, c["top_p"]) if c["top_p"] < 1 else None
        assert_kept_equal(ours[i], theirs, f"{name} {c}", ignore=near)
        assert kept(theirs)[int(np.array(out.token)[i])]


def test_two_histories_are_needed():
    """Frequency and presence count the OUTPUT only. Feeding them the prompt as well (one history for all
    penalties, as llama.cpp does) gives a different result on these rows, and the example does not."""
    rows, _ = logit_rows()
    prompt, output = histories(rows)
    c = {**DEFAULTS, "frequency_penalty": 0.5, "presence_penalty": 0.5}
    ours, _ = run_vllm_example(rows, prompt, output, seed=0, **c)
    both = np.concatenate([prompt, output], axis=1)
    for i in range(rows.shape[0]):
        right = vllm_penalties(rows[i], prompt[i], output[i], 1.0, 0.5, 0.5)
        wrong = vllm_penalties(rows[i], np.array([], np.int64), both[i], 1.0, 0.5, 0.5)
        np.testing.assert_allclose(ours[i], right, rtol=1e-6)
        assert not np.allclose(ours[i], wrong)


def test_hand_computed_values():
    """vLLM's formulas on 8 tokens, worked out by hand.

    logits = [2.0, 1.0, -0.5, 0.0, 3.0, -2.0, 0.5, 1.5], prompt = [1, 2, 2], output = [4, 4, 6],
    repetition 1.2, frequency 0.5, presence 0.3:
      token 1 (prompt, 1.0 > 0):      1.0 / 1.2                    =  0.833333
      token 2 (prompt, -0.5 <= 0):   -0.5 * 1.2                    = -0.6
      token 4 (output x2, 3.0 > 0):   3.0 / 1.2 - 2 * 0.5 - 0.3    =  1.2
      token 6 (output x1, 0.5 > 0):   0.5 / 1.2 - 1 * 0.5 - 0.3    = -0.383333
      token 3 (0.0, not seen) and the rest: unchanged
    temperature 0.5 doubles everything: [4.0, 1.666667, -1.2, 0.0, 2.4, -4.0, -0.766667, 3.0]
    top_k 3 keeps 4.0 (token 0), 3.0 (token 7), 2.4 (token 4); their probabilities are
      e^0, e^-1, e^-1.6 over their sum 1.569776 = 0.637034, 0.234352, 0.128615
    top_p 0.8: ascending cumulative 0.128615 <= 0.2 removes token 4; tokens 0 and 7 remain, with
      probabilities 1 / (1 + e^-1) = 0.731059 and 0.268941.
    """
    x = np.array([[2.0, 1.0, -0.5, 0.0, 3.0, -2.0, 0.5, 1.5]], F32)
    prompt = np.array([[1, 2, 2]], np.int32)
    output = np.array([[4, 4, 6]], np.int32)
    src = (ROOT / "examples" / "vllm.smp").read_text(encoding="utf-8")
    src = re.sub(r"-> token, logprob, raw_logprob, top_logprobs\(5\) \{",
                 "-> token, logprob, raw_logprob, top_logprobs(5), probs, candidates(8) {", src, count=1)
    prog = samplec.compile(src, sampler="vllm")

    def final_x(out):
        got = np.full(8, -np.inf, F32)
        got[np.array(out.candidates.ids)[0]] = np.array(out.candidates.values)[0]
        return got

    both = np.concatenate([prompt, output], axis=1)
    pen = dict(prompt_and_output=both, output=output, repetition_penalty=1.2, frequency_penalty=0.5,
               presence_penalty=0.3)
    out = prog(x, **pen)
    np.testing.assert_allclose(final_x(out), [2.0, 0.833333, -0.6, 0.0, 1.2, -2.0, -0.383333, 1.5], atol=1e-6)

    out = prog(x, temperature=0.5, **pen)
    np.testing.assert_allclose(final_x(out), [4.0, 1.666667, -1.2, 0.0, 2.4, -4.0, -0.766667, 3.0], atol=1e-5)

    out = prog(x, temperature=0.5, top_k=3, **pen)
    np.testing.assert_allclose(np.array(out.probs)[0], [0.637034, 0, 0, 0, 0.128615, 0, 0, 0.234352], atol=1e-6)

    out = prog(x, temperature=0.5, top_k=3, top_p=0.8, seed=1, **pen)
    np.testing.assert_allclose(np.array(out.probs)[0], [0.731059, 0, 0, 0, 0, 0, 0, 0.268941], atol=1e-6)
    assert int(np.array(out.token)[0]) in (0, 7)
    # vLLM returns raw logprobs by default: the model's log_softmax of the unprocessed logits
    tok = int(np.array(out.token)[0])
    np.testing.assert_allclose(float(np.array(out.raw_logprob)[0]), R.log_softmax64(x[0])[tok], atol=1e-6)
    np.testing.assert_allclose(float(np.array(out.logprob)[0]), np.log([0.731059, 0.268941][tok == 7]), atol=1e-5)
    np.testing.assert_array_equal(np.array(out.top_logprobs.ids)[0], [4, 0, 7, 1, 6])

    # min_p 0.3 after temperature 0.5: keep p >= 0.3 * p_max, i.e. x >= 4.0 + ln 0.3 = 2.796: tokens 0 and 7
    out = prog(x, temperature=0.5, min_p=0.3, **pen)
    np.testing.assert_array_equal(np.flatnonzero(np.isfinite(final_x(out))), [0, 7])


def test_greedy_is_argmax_after_penalties():
    """vLLM samples greedily for temperature < 1e-5, taking the argmax of the penalized logits. samplec does
    so for temperature = 0 (temperature(0) keeps only the argmax)."""
    rows, _ = logit_rows()
    prompt, output = histories(rows)
    c = {**DEFAULTS, "repetition_penalty": 1.3, "frequency_penalty": 0.7, "temperature": 0.0}
    _, out = run_vllm_example(rows, prompt, output, seed=np.arange(rows.shape[0]), **c)
    expected = [int(np.argmax(vllm_penalties(rows[i], prompt[i], output[i], 1.3, 0.7, 0.0)))
                for i in range(rows.shape[0])]
    np.testing.assert_array_equal(np.array(out.token), expected)


def test_matches_reference_chain():
    """The example against the numpy oracle with the same stage list, token for token."""
    rows, _ = logit_rows()
    prompt, output = histories(rows)
    c = {**DEFAULTS, **CASES[3]}
    seeds = np.array([5, 6, 7, 8, 9, 10], np.uint64)
    _, out = run_vllm_example(rows, prompt, output, seed=seeds, pos=4, **c)
    both = np.concatenate([prompt, output], axis=1)
    for i in range(rows.shape[0]):
        ref = R.run_chain(rows[i], [
            ("penalties", dict(history=both[i], repeat=c["repetition_penalty"])),
            ("penalties", dict(history=output[i], frequency=c["frequency_penalty"], presence=c["presence_penalty"])),
            ("temperature", dict(t=c["temperature"])),
            ("min_p", dict(m=c["min_p"])),
            ("top_k", dict(k=c["top_k"])),
            ("top_p", dict(p=c["top_p"])),
        ], ("sample", dict(seed=int(seeds[i]), position=4)), row=i)
        assert int(np.array(out.token)[i]) == ref["token"]
        assert abs(float(np.array(out.logprob)[i]) - ref["logprob"]) <= 1e-5
