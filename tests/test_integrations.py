"""The mlx-lm adapter and multi-step decoding on a real (tiny, random, local) mlx-lm llama.

Position convention under test: the token at sequence index i (prompt length + tokens generated before it) is
sampled with position = i and history = the whole sequence before it, so every path -- mlx-lm's generate_step with
the adapter, stream_generate, samplec.decode.generate at any chunk size, and plain `prog(...)` calls step by step --
gives the same tokens for the same (prompt, seed).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

mlx_lm = pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step, stream_generate  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import samplec  # noqa: E402
from samplec import SamplecError  # noqa: E402
from samplec.decode import generate, pad_history, position_params  # noqa: E402
from samplec.integrations.mlx_lm import Sampler, local_tokenizer, random_llama  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PROMPT = [5, 17, 300, 42, 7, 9, 5]


@pytest.fixture(scope="module")
def model():
    return random_llama(0, layers=2, hidden=64, vocab=512)


@pytest.fixture(scope="module")
def llama_prog():
    return samplec.compile_file(EXAMPLES / "llama.smp", sampler="llama")


@pytest.fixture(scope="module")
def nucleus_prog():
    return samplec.compile_file(EXAMPLES / "llama.smp", sampler="nucleus")


def adapter_tokens(model, prog, prompt, n, seed, **params):
    s = Sampler(prog, seed=seed, **params)
    toks = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=s,
                                        logits_processors=s.logits_processors)]
    s.check()
    return toks, s


def reference_tokens(model, prog, prompt, n, seed, **params):
    """The contract spelled out: one model step at a time, `prog(...)` with position = index, history = sequence."""
    cache = make_prompt_cache(model)
    seq = list(prompt)
    if len(seq) > 1:
        model(mx.array(seq[:-1])[None], cache=cache)
    logits = model(mx.array(seq[-1:])[None], cache=cache)[:, -1, :]
    out = []
    for _ in range(n):
        kw = dict(params, seed=seed, pos=len(seq))
        if any(p.kind == "tokens" for p in prog.params):
            kw["history"] = np.array(seq, dtype=np.int32)
        tok = int(prog(logits, **kw).token[0])
        out.append(tok)
        seq.append(tok)
        logits = model(mx.array([tok])[None], cache=cache)[:, -1, :]
    return out


def test_adapter_follows_the_position_convention(model, llama_prog):
    toks, s = adapter_tokens(model, llama_prog, PROMPT, 24, seed=7)
    assert toks == reference_tokens(model, llama_prog, PROMPT, 24, seed=7)
    assert [st.position[0] for st in s.steps[:24]] == list(range(len(PROMPT), len(PROMPT) + 24))


@pytest.mark.parametrize("chunk", [1, 3, 8, 40])
def test_decode_any_chunk_gives_the_adapter_tokens(model, llama_prog, chunk):
    expected, _ = adapter_tokens(model, llama_prog, PROMPT, 30, seed=3, temperature=1.2)
    assert generate(model, llama_prog, PROMPT, 30, chunk=chunk, seed=3, temperature=1.2) == expected


def test_decode_single_token_prompt_and_seeds(model, nucleus_prog):
    a = generate(model, nucleus_prog, [11], 16, chunk=4, seed=1)
    assert a == generate(model, nucleus_prog, [11], 16, chunk=1, seed=1)
    assert a == adapter_tokens(model, nucleus_prog, [11], 16, seed=1)[0]
    assert generate(model, nucleus_prog, [11], 16, chunk=4, seed=1, temperature=5.0) != \
        generate(model, nucleus_prog, [11], 16, chunk=4, seed=2, temperature=5.0)
    assert generate(model, nucleus_prog, [11], 0) == []


def test_decode_truncates_after_the_first_eos(model, llama_prog):
    full = generate(model, llama_prog, PROMPT, 30, seed=5, temperature=1.5)
    k = next(i for i in range(3, 30) if full[i] not in full[:i])   # a token whose first occurrence is at i
    for chunk in (1, 4, 16):
        assert generate(model, llama_prog, PROMPT, 30, chunk=chunk, seed=5, temperature=1.5,
                        eos_token_id=[999, full[k]]) == full[:k + 1]


def test_adapter_runs_the_program_on_raw_logits():
    """penalties are not shift-invariant: the adapter must feed the captured raw logits, not mlx-lm's logprobs."""
    prog = samplec.compile("sampler p(seed: seed = 0, pos: int = 0, history: tokens) -> token, logprob {"
                           " penalties(history, repeat = 4.0) greedy() }")
    logits = mx.array([[3.0, 2.0, 1.0, 0.5, -1.0]])
    hist = mx.array([0, 3])
    s = Sampler(prog)
    s.logits_processors[0](hist, logits)
    tok = s(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    # raw logits: 3/4 = 0.75 vs 2.0 -> token 1; on log-probabilities every entry is negative, so the repeated
    # token 0 would be multiplied (x * 4) and token 1 still wins, but the logprob output shows the difference
    assert int(tok[0]) == 1
    direct = prog(logits, history=np.array([0, 3]), pos=2)
    assert int(direct.token[0]) == 1
    np.testing.assert_allclose(np.array(s.last.logprob), np.array(direct.logprob), rtol=1e-6)
    on_logprobs = prog(logits - mx.logsumexp(logits, axis=-1, keepdims=True), history=np.array([0, 3]), pos=2)
    assert not np.allclose(np.array(on_logprobs.logprob), np.array(direct.logprob))


def test_adapter_logprob_outputs_match_mlx_lm(model, nucleus_prog):
    s = Sampler(nucleus_prog, seed=9)
    yielded = list(generate_step(mx.array(PROMPT), model, max_tokens=6, sampler=s,
                                 logits_processors=s.logits_processors))
    ids, vals = s.output("top_logprobs", ids=True), s.output("top_logprobs")
    assert ids.shape == (7, 1, 5) and s.output("logprob").shape == (7, 1)
    for i, (tok, logprobs) in enumerate(yielded):
        assert int(s.steps[i].outputs.token[0]) == tok
        lp = np.array(logprobs)                       # mlx-lm's log-probabilities of the model's distribution
        np.testing.assert_array_equal(np.array(ids[i, 0]), np.argsort(-lp, kind="stable")[:5])
        np.testing.assert_allclose(np.array(vals[i, 0]), lp[np.array(ids[i, 0])], atol=1e-5)


def test_stream_generate_with_a_local_tokenizer(model, llama_prog):
    tok = local_tokenizer(512)
    assert tok.decode(tok.encode("top-p keeps the mass")) == "top-p keeps the mass"
    prompt = tok.encode("The sampler chain")
    s = Sampler(llama_prog, seed=11, temperature=1.3)
    got = [r.token for r in stream_generate(model, tok, prompt, max_tokens=20, sampler=s,
                                            logits_processors=s.logits_processors)]
    expected = generate(model, llama_prog, prompt, 20, chunk=5, seed=11, temperature=1.3,
                        eos_token_id=tok.eos_token_id)
    if expected and expected[-1] == tok.eos_token_id:    # stream_generate stops at EOS without yielding it
        expected = expected[:-1]
    assert got[:len(expected)] == expected


def test_adapter_without_processor(model, llama_prog):
    greedy = samplec.compile("sampler g() -> token, logprob { top_k(5) greedy() }")
    s = Sampler(greedy, seed=None)
    toks = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=8, sampler=s)]
    assert toks == [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=8)]   # mlx-lm's argmax
    assert len(s.steps) == 9 and s.output("token")[:8, 0].tolist() == toks
    s = Sampler(llama_prog)
    with pytest.raises(SamplecError, match="logits_processors"):
        list(generate_step(mx.array(PROMPT), model, max_tokens=2, sampler=s))


def test_run_time_checks_surface(model):
    prog = samplec.compile("sampler a(m: mask, seed: seed = 0, pos: int = 0) -> token { allow(m) sample(seed, "
                           "position = pos) }")
    nothing = np.zeros((1, 512), dtype=bool)
    with pytest.raises(SamplecError, match=r"allow: the mask allows none of the tokens left \(at position 7\)"):
        generate(model, prog, PROMPT, 5, chunk=2, m=nothing)
    s = Sampler(prog, m=nothing)
    with pytest.raises(SamplecError, match="allow: the mask allows none of the tokens left"):
        list(generate_step(mx.array(PROMPT), model, max_tokens=5, sampler=s,
                           logits_processors=s.logits_processors))
        s.check()


def test_driven_and_bad_arguments(model, llama_prog):
    assert position_params(llama_prog) == ["pos"]
    with pytest.raises(SamplecError, match="'pos' is set by the decode loop"):
        generate(model, llama_prog, PROMPT, 3, pos=4)
    with pytest.raises(SamplecError, match="chunk"):
        generate(model, llama_prog, PROMPT, 3, chunk=0)
    with pytest.raises(SamplecError, match="prompt"):
        generate(model, llama_prog, [], 3)
    with pytest.raises(SamplecError, match="unknown parameter 'top_k'"):
        generate(model, llama_prog, PROMPT, 3, top_k=3)
    with pytest.raises(SamplecError, match="no 'token' output"):
        generate(model, samplec.compile("sampler q() -> probs { top_k(3) }"), PROMPT, 3)


def test_history_padding_is_transparent(llama_prog):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 512)).astype(np.float32) * 3
    hist = rng.integers(0, 512, size=(1, 90)).astype(np.int32)
    hist[0, -10:] = np.argsort(-logits[0])[:10]              # recent repeats of the likely tokens
    padded = pad_history(mx.array(hist), 90)
    assert padded.shape == (1, 256)
    a = llama_prog(logits, history=hist, pos=90, seed=4)
    b = llama_prog(logits, history=padded, pos=90, seed=4)
    assert int(a.token[0]) == int(b.token[0])
    np.testing.assert_array_equal(np.array(a.logprob), np.array(b.logprob))


def test_history_without_the_prompt(model):
    """prompt_in_history=False: penalties count generated tokens only (OpenAI's presence/frequency penalties)."""
    prog = samplec.compile("sampler o(seed: seed = 0, pos: int = 0, history: tokens) -> token {"
                           " penalties(history, presence = 2.0, frequency = 1.0) temperature(0.7)"
                           " sample(seed, position = pos) }")
    expected, _ = adapter_tokens_no_prompt(model, prog, PROMPT, 20, seed=2)
    for chunk in (1, 6):
        assert generate(model, prog, PROMPT, 20, chunk=chunk, seed=2, prompt_in_history=False) == expected
    # the contract spelled out, step by step
    cache = make_prompt_cache(model)
    model(mx.array(PROMPT[:-1])[None], cache=cache)
    logits = model(mx.array(PROMPT[-1:])[None], cache=cache)[:, -1, :]
    gen: list[int] = []
    for i in range(20):
        tok = int(prog(logits, seed=2, pos=len(PROMPT) + i, history=np.array(gen, dtype=np.int32)).token[0])
        gen.append(tok)
        logits = model(mx.array([tok])[None], cache=cache)[:, -1, :]
    assert gen == expected


def test_vllms_two_histories(model):
    """vLLM's chain (`samplec import --from vllm`): its repetition penalty reads the prompt and the generated
    tokens (`prompt_and_output`), its presence and frequency penalties the generated ones (`output`). The adapter
    in mlx-lm's loop and `decode.generate` (any chunk, with a grammar's loop too) feed both, as the contract
    spelled out step by step."""
    from samplec.importers import from_vllm
    src = from_vllm({"repetition_penalty": 1.05, "presence_penalty": 1.5, "frequency_penalty": 1.2,
                     "temperature": 0.8, "top_k": 40, "seed": 3})
    prog = samplec.compile(src)
    assert sorted(p.name for p in prog.params if p.kind == "tokens") == ["output", "prompt_and_output"]
    # (a prompt of what the model likes -- its own greedy continuation -- so that penalizing it matters)
    prompt = PROMPT + generate(model, samplec.compile("sampler g() -> token { greedy() }"), PROMPT, 16)
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    logits = model(mx.array(prompt[-1:])[None], cache=cache)[:, -1, :]
    gen: list[int] = []
    for _ in range(24):
        tok = int(prog(logits, seed=3, pos=len(prompt) + len(gen), prompt_and_output=np.array(prompt + gen),
                       output=np.array(gen, dtype=np.int32)).token[0])
        gen.append(tok)
        logits = model(mx.array([tok])[None], cache=cache)[:, -1, :]
    for chunk in (1, 5):
        assert generate(model, prog, prompt, 24, chunk=chunk, seed=3) == gen
    toks, _ = adapter_tokens(model, prog, prompt, 24, seed=3)
    assert toks == gen
    # (the penalties matter here: the tokens differ where the output history is the whole sequence)
    both = samplec.compile(src.replace(", output: tokens", "").replace("penalties(output,",
                                                                       "penalties(prompt_and_output,"))
    assert generate(model, both, prompt, 24, seed=3) != gen


def test_histories_a_decode_loop_cannot_tell_apart_are_an_error():
    two = samplec.compile("sampler s(a: tokens, b: tokens) -> token { penalties(a, repeat = 1.2) "
                          "penalties(b, presence = 1.0) greedy() }")
    with pytest.raises(SamplecError, match=r"2 token-history parameters \(a, b\).*named generated or output"):
        Sampler(two)


def adapter_tokens_no_prompt(model, prog, prompt, n, seed):
    s = Sampler(prog, seed=seed, prompt_in_history=False)
    toks = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=s,
                                        logits_processors=s.logits_processors)]
    s.check()
    return toks, s


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_decode_chunks_of_the_chain_kernel_equal_the_dense_program(chunk):
    """-O2 runs each step's chain as one kernel that decides per row inside the step (no guard read back, no
    replay): k steps queue as one graph and give the tokens of the dense -O1 program, on flat rows too."""
    big = random_llama(1, layers=1, hidden=32, vocab=12288)
    src = ("sampler s(seed: seed = 0, pos: int = 0, h: tokens) { penalties(h, last_n = 8, repeat = 1.3) "
           "min_p(0.02) temperature(1.5) sample(seed, position = pos) }")
    fast, dense = samplec.compile(src, opt_level=2), samplec.compile(src, opt_level=1)
    assert {n.op for n in fast.graph.toposort()} >= {"min_p", "sample"}
    want = samplec.decode.generate(big, dense, [1, 2, 3], 24, chunk=1, seed=5)
    assert samplec.decode.generate(big, fast, [1, 2, 3], 24, chunk=chunk, seed=5) == want
    window = ("sampler w(seed: seed = 0, pos: int = 0) { temperature(3.0) sample(seed, position = pos) }")
    fast_w, dense_w = samplec.compile(window, opt_level=2), samplec.compile(window, opt_level=1)
    assert samplec.decode.generate(big, fast_w, [4, 5], 16, chunk=chunk, seed=2) == \
        samplec.decode.generate(big, dense_w, [4, 5], 16, chunk=1, seed=2)


def test_unknown_parameter_is_rejected_when_the_adapter_is_built(llama_prog):
    with pytest.raises(SamplecError, match=r"unknown parameter 'temprature' for the sampler 'llama' "
                                           r"\(parameters: .*temperature"):
        Sampler(llama_prog, seed=1, temprature=0.7)          # at construction, before any mlx-lm step


def test_program_passed_directly_as_mlx_lm_sampler_points_to_the_adapter(model):
    prog = samplec.compile("sampler g(seed: seed = 0) -> token { top_k(5) sample(seed) }")
    with pytest.raises(SamplecError, match=r"passed to mlx-lm directly as `sampler=`.*samplec\.integrations\.mlx_lm "
                                           r"import Sampler"):
        list(generate_step(mx.array(PROMPT), model, max_tokens=2, sampler=prog))
    assert prog(np.zeros((1, 8), dtype=np.float32)).token.shape == (1,)     # a direct call is unaffected


def test_outputs_repr():
    prog = samplec.compile("sampler r(seed: seed) -> token, logprob, top_logprobs(2), probs { top_k(3) "
                           "sample(seed) }")
    out = prog(np.array([[0.0, 1.0, 2.0, 3.0]], dtype=np.float32), seed=3)
    text = repr(out)
    tok = int(out.token[0])
    assert text.startswith("Outputs(\n") and f"token         int32[1] [{tok}]" in text
    assert "logprob       float32[1] [-" in text
    assert "top_logprobs  ids int32[1, 2] [[3, 2]]; values float32[1, 2] [[-0.44019, -1.4402]]" in text
    assert "probs         float32[1, 4] [[0, 0.090031, 0.24473, 0.66524]]" in text
    big = prog(np.zeros((2, 100), dtype=np.float32), seed=1)
    assert "probs         float32[2, 100]\n" in repr(big)                 # large arrays: shape only


def test_a_state_follows_its_row_through_batch_generators_joins_and_leaves():
    """mirostat's mu under mlx-lm's BatchGenerator: rows that join a running batch (their first step taken apart,
    then merged) and rows that leave it each carry their own state, so every row's tokens are decode.generate's
    for that row alone."""
    from mlx_lm.generate import BatchGenerator
    model = random_llama(0)
    prog = samplec.compile("sampler m(mu: state, seed: seed, pos: int = 0) -> token, mu { temperature(1.5) "
                           "mirostat_v2(mu, 3.0, 1.0, seed, position = pos) }")
    prompts = {"A": [5, 17, 300], "B": [9, 9, 9, 9, 9], "C": [100, 200]}
    alone = {k: generate(model, prog, p, 14, seed=2) for k, p in prompts.items()}

    def batched(plan):
        s = Sampler(prog, seed=2)
        g = BatchGenerator(model, stop_tokens=[], sampler=s, logits_processors=s.logits_processors)
        names, out = {}, {}
        for step in range(40):
            for at, name, m in plan:
                if at == step:
                    names[g.insert([prompts[name]], max_tokens=[m])[0]] = name
            for r in g.next()[1]:
                out.setdefault(names[r.uid], []).append(int(r.token))
        return out
    for plan in ([(0, "A", 14), (0, "B", 14)], [(0, "A", 3), (0, "B", 14)],
                 *([(0, "A", 3), (0, "B", 14), (at, "C", 10)] for at in (2, 4, 6))):
        got = batched(plan)
        assert got.keys() == {name for _, name, _ in plan}
        for name, toks in got.items():
            assert toks == alone[name][:len(toks)] and len(toks) == dict((n, m) for _, n, m in plan)[name], \
                (plan, name)


def _splitmix(seed: int, step: int) -> int:
    """splitmix64 of seed + golden * (step + 1), in Python integers (the reference for decode.step_seed)."""
    m = 2 ** 64
    z = (seed + 0x9E3779B97F4A7C15 * (step + 1)) % m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % m
    return z ^ (z >> 31)


def test_step_seed_is_splitmix64():
    from samplec.decode import step_seed, step_seeds
    seeds = [0, 1, 7, 2 ** 63 + 5, 2 ** 64 - 1]
    steps = [0, 3, 17, 4095, 2 ** 31 - 1]
    expected = [_splitmix(s, t) for s, t in zip(seeds, steps)]
    assert [step_seed(s, t) for s, t in zip(seeds, steps)] == expected
    assert step_seeds(seeds, steps).tolist() == expected
    # splitmix64's published first outputs from state 0 (step i is the generator's output i + 1)
    assert [step_seed(0, i) for i in range(2)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


FIXED = "sampler fixed(seed: seed) -> token { temperature(1.0) sample(seed) }"


def test_a_draw_at_a_fixed_position_takes_fresh_noise_at_every_step(model):
    """`sample(seed)` draws at position 0: in a decode loop its seed advances by the position instead
    (decode.step_seed), so steps on a flat row differ -- the same tokens in decode.generate and the adapter with its
    processor (each step the direct call with the stepped seed), and fresh ones without the processor too."""
    prog = samplec.compile(FIXED)
    flat = mx.zeros((1, 512))
    s = Sampler(prog, seed=7)
    blind = [int(np.array(s(flat))[0]) for _ in range(20)]
    assert len(set(blind)) >= 15, blind
    assert blind == [int(np.array(prog(flat, seed=_splitmix(7, t)).token)[0]) for t in range(20)]
    s.reset()
    assert [int(np.array(s(flat))[0]) for _ in range(3)] == blind[:3]
    toks = generate(model, prog, PROMPT, 12, seed=3)
    assert toks == adapter_tokens(model, prog, PROMPT, 12, seed=3)[0]
    # (the contract spelled out: at position i the program's own call with seed step_seed(3, i))
    cache = make_prompt_cache(model)
    model(mx.array(PROMPT[:-1])[None], cache=cache)
    logits = model(mx.array(PROMPT[-1:])[None], cache=cache)[:, -1, :]
    want = []
    for i in range(len(PROMPT), len(PROMPT) + 12):
        want.append(int(np.array(prog(logits, seed=_splitmix(3, i)).token)[0]))
        logits = model(mx.array([want[-1]])[None], cache=cache)[:, -1, :]
    assert toks == want


def test_a_fixed_position_draw_advances_a_seed_given_in_any_form(model):
    """The seed of a `sample(seed)` program advances on the host, whatever form it was given in (a number, a list
    or tuple of one, a numpy or MLX array), in plain and speculative decoding alike."""
    from samplec.integrations.mlx_lm import noisy_copy
    prog = samplec.compile(FIXED)
    want = generate(model, prog, PROMPT, 8, seed=5)
    draft = noisy_copy(model, 0.05)
    for seed in ([5], (5,), np.array([5], dtype=np.uint64), mx.array([5], dtype=mx.uint64)):
        assert generate(model, prog, PROMPT, 8, seed=seed) == want, seed
        assert generate(model, prog, PROMPT, 8, seed=seed, draft_model=draft, num_draft=3) == want, seed


def test_a_state_from_the_last_step_is_not_read_while_a_step_is_queued(model, monkeypatch):
    """mirostat's mu is the last step's lazy output: the short path compares it without marshalling it (marshal
    would evaluate it, and a chunk of steps would wait on the host at every step), and still takes the short path."""
    import samplec.program
    src = ("sampler m(mu: state, seed: seed, pos: int = 0) -> token, mu { temperature(1.5) "
           "mirostat_v2(mu, 3.0, 1.0, seed, position = pos) }")
    want = generate(model, samplec.compile(src), PROMPT, 12, seed=4, chunk=1)
    prog = samplec.compile(src)
    real = samplec.program.marshal.dumps
    marshalled = []

    class _Marshal:
        @staticmethod
        def dumps(value, *args):
            marshalled.append(type(value) is mx.array or
                              isinstance(value, list) and any(type(v) is mx.array for v in value))
            return real(value, *args)
    monkeypatch.setattr(samplec.program, "marshal", _Marshal())
    before = dict(prog.queue_stats)
    assert generate(model, prog, PROMPT, 12, seed=4, chunk=4) == want
    assert marshalled and not any(marshalled)
    assert prog.queue_stats["short"] - before["short"] >= 11


def test_a_program_with_a_position_parameter_keeps_its_seed(model, nucleus_prog):
    """Only draws at fixed positions advance the seed: a program with a position parameter is given the position
    and its seed as it is (the reference calls it with the seed itself)."""
    from samplec.decode import ProgramFeed
    assert ProgramFeed(nucleus_prog, 3, {}).advanced_seeds == []
    assert ProgramFeed(samplec.compile(FIXED), 3, {}).advanced_seeds == ["seed"]
    assert generate(model, nucleus_prog, PROMPT, 6, seed=3) == reference_tokens(model, nucleus_prog, PROMPT, 6, 3)


def test_a_later_turn_over_a_prompt_cache_counts_the_earlier_turns():
    """A chat over one prompt_cache hands the processor each turn's new tokens only: `reset(offset=...)` with the
    tokens the cache held makes the turn's positions the whole conversation's -- fresh noise, not turn 1's again."""
    V = 512

    class Flat:     # the same uniform logits at every step: each draw is the noise's alone
        layers = []

        def __call__(self, x, cache=None):
            return mx.zeros((1, x.shape[1], V))
    nucleus = samplec.compile_file(EXAMPLES / "llama.smp", sampler="nucleus")
    s = Sampler(nucleus, seed=7, temperature=1.0)
    cache = make_prompt_cache(Flat())
    first = [t for t, _ in generate_step(mx.array([1, 2, 3]), Flat(), max_tokens=8, prompt_cache=cache, sampler=s,
                                         logits_processors=s.logits_processors)]
    s.reset(offset=3 + len(first))
    second = [t for t, _ in generate_step(mx.array([4, 5, 6]), Flat(), max_tokens=8, prompt_cache=cache,
                                          sampler=s, logits_processors=s.logits_processors)]
    at = [st.position[0] for st in s.steps][:8]
    assert at == list(range(3 + len(first) + 3, 3 + len(first) + 11))
    assert second != first
    flat = mx.zeros((1, V))
    assert second == [int(np.array(nucleus(flat, seed=7, temperature=1.0, pos=p).token)[0]) for p in at]
    with pytest.raises(SamplecError, match="offset"):
        s.reset(offset=-1)


def test_values_one_per_row_name_the_batch_they_were_given_for(model):
    """A Sampler given one value per row fixes the batch size; a call with another (BatchGenerator dropped a
    finished request) says so and what to do, and a log-probability array that is not [B, V] is named."""
    prog = samplec.compile_file(EXAMPLES / "llama.smp", sampler="nucleus")
    s = Sampler(prog, seed=[1, 2, 3, 4], temperature=1.5)
    with pytest.raises(SamplecError, match="one per row for a batch of 4 rows, but mlx-lm called it with 3"):
        s(mx.zeros((3, 512)))
    with pytest.raises(SamplecError, match=r"\[B, V\], got shape \[512\]"):
        Sampler(prog, seed=1)(mx.zeros((512,)))


def test_mlx_lms_speculative_loop_without_speculative_is_an_error(model, llama_prog):
    """mlx-lm's speculative loop given the plain recipe (sampler=, logits_processors=) re-samples positions along
    the same sequence: an error that names **sampler.speculative(prompt), not silently other tokens."""
    from mlx_lm import stream_generate
    from samplec.integrations.mlx_lm import noisy_copy
    tok = local_tokenizer(512)
    s = Sampler(llama_prog, seed=7)
    with pytest.raises(SamplecError, match=r"speculative\(prompt\)"):
        list(stream_generate(model, tok, PROMPT, max_tokens=20, draft_model=noisy_copy(model, 0.05),
                             num_draft_tokens=3, sampler=s, logits_processors=s.logits_processors))
    # (plain decoding twice over the same prompt, without reset: no error -- the first position again)
    first = adapter_tokens(model, llama_prog, PROMPT, 6, seed=7)[0]
    s = Sampler(llama_prog, seed=7)
    for _ in range(2):
        assert [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=6, sampler=s,
                                            logits_processors=s.logits_processors)] == first


def test_a_batch_that_shrinks_keeps_its_steps_and_output_says_why_it_cannot_stack(nucleus_prog):
    """mlx-lm's BatchGenerator calls the processor once per row, then the sampler: rows that finish leave the
    batch. A batch down to one row goes on (its steps kept); `output()` over steps of several widths names the
    cause. A call takes the step's first records; one the step's calls left (a row another sampler sampled) is an
    error at the next step."""
    s = Sampler(nucleus_prog, seed=3)
    rng = np.random.default_rng(0)
    seqs = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    for width in (3, 2, 1):
        rows = seqs[:width]
        logits = mx.array(rng.standard_normal((width, 64)).astype(np.float32))
        for i, seq in enumerate(rows):
            s.logits_processors[0](mx.array(seq), logits[i:i + 1])
        tokens = np.array(s(logits)).tolist()
        for seq, t in zip(rows, tokens):
            seq.append(int(t))
    assert [len(st.position) for st in s.steps] == [3, 2, 1]
    with pytest.raises(SamplecError, match=r"batches of \[1, 2, 3\] rows"):
        s.output("token")
    s = Sampler(nucleus_prog, seed=3)
    x = mx.array(rng.standard_normal((2, 64)).astype(np.float32))
    s.logits_processors[0](mx.array([4, 5, 6]), x[:1])
    s.logits_processors[0](mx.array([1, 2]), x[1:])      # (a row another sampler samples)
    assert np.array(s(x[:1])).tolist() == np.array(nucleus_prog(x[:1], seed=3, pos=3).token).tolist()
    with pytest.raises(SamplecError, match="ran on 1 row"):
        s.logits_processors[0](mx.array([4, 5, 6, 7]), x[:1])


def test_bad_values_are_errors_when_the_sampler_is_made(model):
    """A missing, NaN, out-of-range or mistyped value is an error when the Sampler (or the decode loop) is set up,
    not at mlx-lm's first step after the prompt's prefill; the messages are a call's."""
    prog = samplec.compile_file(EXAMPLES / "mlx_lm_default.smp", sampler="mlx_lm")
    for kw, message in ((dict(top_p=0.0), "top_p = 0 is out of range"), (dict(temp=-1.0), "temp = -1"),
                        (dict(seed="abc"), "seed"), (dict(temp=[0.5, float("nan")]), r"temp: NaN \(row 1\)")):
        with pytest.raises(SamplecError, match=message):
            Sampler(prog, **kw)
    needs = samplec.compile("sampler s(t: float, seed: seed, pos: int) -> token "
                            "{ temperature(t) sample(seed, position = pos) }")
    with pytest.raises(SamplecError, match="missing required parameter 't'"):
        Sampler(needs, seed=1)
    with pytest.raises(SamplecError, match="missing required parameter 't'"):
        generate(model, needs, PROMPT, 4, seed=1)
    assert Sampler(needs, seed=1, t=mx.array([0.5, 0.7])) is not None     # (an MLX array of per-row values)
    masked = samplec.compile("sampler a(m: mask, b: bias, seed: seed = 0, pos: int = 0) -> token { logit_bias(b) "
                             "allow(m) sample(seed, position = pos) }")
    ones, zeros = np.ones(512, dtype=bool), np.zeros(512, dtype=np.float32)
    for given, missing in (({"b": zeros}, "m"), ({"m": ones}, "b")):
        with pytest.raises(SamplecError, match=f"missing required parameter '{missing}'"):
            Sampler(masked, **given)
        with pytest.raises(SamplecError, match=f"missing required parameter '{missing}'"):
            generate(model, masked, PROMPT, 4, **given)


MIROSTAT = ("sampler m(mu: state, seed: seed, pos: int = 0) -> token, mu { temperature(1.5) "
            "mirostat_v2(mu, 3.0, 1.0, seed, position = pos) }")


@pytest.mark.parametrize("stateful", [False, True], ids=["llama", "mirostat"])
def test_a_step_reads_nothing_back_but_earlier_steps_check_words(model, llama_prog, monkeypatch, stateful):
    """mlx-lm queues a step while the last one runs; a step that read the sequence (whose last token is the last
    step's, still running) would wait for it. After the first step (which checks the prompt's ids) the adapter
    reads only the check flags of steps a few calls back (packed uint32 words, or bools), never a token sequence,
    and gives the same tokens -- a program with a state (mirostat's mu) too: one sequence's state follows it by a
    comparison on the device, and its tokens are decode.generate's."""
    import samplec.decode
    import samplec.integrations.mlx_lm as adapter
    import samplec.program

    if stateful:
        llama_prog = samplec.compile(MIROSTAT)

    real, flagged = np.array, samplec.program._flagged
    read = []
    s = None

    class _Numpy:
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def array(a, *args, **kw):
            if isinstance(a, mx.array) and s is not None and s.steps:
                read.append(a.dtype)
            return real(a, *args, **kw)

    def _flagged(flag):
        if s is not None and s.steps:
            read.append(flag.dtype)
        return flagged(flag)

    expected, _ = adapter_tokens(model, llama_prog, PROMPT, 16, seed=5)
    if stateful:
        assert expected == generate(model, samplec.compile(MIROSTAT), PROMPT, 16, seed=5)
    for module in (adapter, samplec.decode, samplec.program):
        monkeypatch.setattr(module, "np", _Numpy())
    monkeypatch.setattr(samplec.program, "_flagged", _flagged)
    s = Sampler(llama_prog, seed=5)
    steps = generate_step(mx.array(PROMPT), model, max_tokens=16, sampler=s, logits_processors=s.logits_processors)
    assert [t for t, _ in steps] == expected
    assert read and set(read) <= {mx.uint32, mx.bool_}, read


@pytest.mark.parametrize("loop", ["adapter", "generate"])
def test_a_decode_loops_steps_take_the_programs_short_path(model, loop):
    """Each step of a decode loop is a `Program.queue` call on its short path (the values checked once, the stages
    the values leave off removed, the arguments' checks replayed with the graph), not a slower path beside it: only
    the first step and the first at each new history width take the full path."""
    prog = samplec.compile_file(EXAMPLES / "mlx_lm_default.smp", sampler="mlx_lm")
    n = 20
    if loop == "adapter":
        toks, _ = adapter_tokens(model, prog, PROMPT, n, seed=3)
    else:
        toks = generate(model, prog, PROMPT, n, seed=3, chunk=4)
    assert len(toks) == n
    stats = prog.queue_stats
    # (mlx-lm's loop samples one step past the last token it yields)
    assert stats["full"] == 1 and stats["short"] == n - (loop == "generate"), stats
    assert stats["specialized"] == stats["short"], stats      # (mlx_lm's defaults leave stages off)


def _batch_tokens(g, uids, steps=40):
    out = {u: [] for u in uids}
    for _ in range(steps):
        for r in g.next_generated():
            out.setdefault(r.uid, []).append(int(r.token))
    g.close()
    return [out[u] for u in uids]


@pytest.mark.parametrize("src", ["nucleus", FIXED])
def test_a_shared_sampler_beside_a_request_with_another_sampler(model, src):
    """BatchGenerator's default Sampler for some requests and another sampler (with its own processors) for
    another: mlx-lm then calls each row's sampler on its own row, after every row's processors. Each call of the
    shared Sampler takes its own row's record (in row order), so its rows draw decode.generate's tokens alone."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler
    prog = samplec.compile_file(EXAMPLES / "llama.smp", sampler=src) if src == "nucleus" else samplec.compile(src)
    prompts = [[5, 17, 300], [9, 9, 9, 9, 9], [100, 200]]
    s = Sampler(prog, seed=2, temperature=1.5) if src == "nucleus" else Sampler(prog, seed=2)
    for other_first in (False, True):
        s.reset()
        g = BatchGenerator(model, stop_tokens=[], sampler=s, logits_processors=s.logits_processors)
        greedy = g.insert([prompts[2]], max_tokens=[8], samplers=[make_sampler(temp=0.0)],
                          logits_processors=[[]]) if other_first else []
        uids = g.insert(prompts[:2], max_tokens=[8, 8])
        if not other_first:
            greedy = g.insert([prompts[2]], max_tokens=[8], samplers=[make_sampler(temp=0.0)],
                              logits_processors=[[]])
        got = _batch_tokens(g, uids + greedy)
        params = dict(temperature=1.5) if src == "nucleus" else {}
        for p, toks in zip(prompts[:2], got[:2]):
            assert toks == generate(model, prog, p, 8, seed=2, **params), other_first
        assert got[2] == [t for t, _ in generate_step(mx.array(prompts[2]), model, max_tokens=8)]


def test_the_processor_on_a_row_another_sampler_samples_is_an_error(model, nucleus_prog):
    """A request inserted with another sampler but BatchGenerator's default processors (the shared Sampler's)
    gives the adapter a record of a row it does not sample: an error that says to give that request its own
    logits_processors, not another row's logits for one of the Sampler's rows."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler
    s = Sampler(nucleus_prog, seed=2)
    g = BatchGenerator(model, stop_tokens=[], sampler=s, logits_processors=s.logits_processors)
    g.insert([[5, 17, 300], [9, 9, 9, 9]], max_tokens=[8, 8])
    g.insert([[100, 200]], max_tokens=[8], samplers=[make_sampler(temp=0.0)])
    with pytest.raises(SamplecError, match=r"did not sample.*logits_processors=\[\[\]\]"):
        _batch_tokens(g, [])


def test_a_history_of_generated_tokens_in_a_shared_batch_names_itself(model):
    """One Sampler for BatchGenerator's rows cannot tell where each row's prompt ends: a program reading the
    generated tokens alone is an error that names the history and how it reads them, and what to do."""
    from mlx_lm.generate import BatchGenerator
    prog = samplec.compile("sampler o(seed: seed = 0, pos: int = 0, history: tokens) -> token {"
                           " penalties(history, presence = 2.0) sample(seed, position = pos) }")
    s = Sampler(prog, prompt_in_history=False)
    g = BatchGenerator(model, stop_tokens=[], sampler=s, logits_processors=s.logits_processors)
    g.insert([[5, 17, 300], [9, 9, 9, 9]], max_tokens=[4, 4])
    with pytest.raises(SamplecError, match=r"'history' with prompt_in_history=False\).*samplers=\[\.\.\.\]"):
        _batch_tokens(g, [])


def test_the_python_blocks_of_docs_inference_run(model, monkeypatch, capsys):
    """Every ```python block of docs/inference.md runs as written, each on its own, with the names its prose
    leaves to the reader (the model and tokenizer `load` would give, a program, prompt ids, a draft model) and
    `mlx_lm.load` returning the small local model."""
    import re

    from samplec.integrations.mlx_lm import noisy_copy
    text = (EXAMPLES.parent / "docs" / "inference.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 4
    tok = local_tokenizer(512)
    monkeypatch.setattr(mlx_lm, "load", lambda *a, **k: (model, tok))
    monkeypatch.chdir(EXAMPLES.parent)            # (the blocks name examples/*.smp from the checkout's root)
    given = dict(model=model, tokenizer=tok, tok=tok, prompt_ids=tok.encode("A sampler chain"),
                 program=samplec.compile_file(EXAMPLES / "llama.smp"), draft=noisy_copy(model, 0.05))
    for block in blocks:
        exec(compile(block, "docs/inference.md", "exec"), dict(given))
    assert capsys.readouterr().out


def test_the_decode_loop_example_runs(monkeypatch, capsys):
    """examples/decode_loop.py as the README runs it (smaller): the adapter and the multi-step loop agree."""
    import runpy
    import sys
    monkeypatch.setattr(sys, "argv", ["decode_loop.py", "--tokens", "8", "--layers", "1", "--hidden", "32",
                                      "--vocab", "512"])
    runpy.run_path(str(EXAMPLES / "decode_loop.py"), run_name="__main__")
    assert "agree token for token: True" in capsys.readouterr().out


class Counted:
    """A model that counts the decode steps (one-token forward passes) mlx-lm has run."""

    def __init__(self, inner):
        self.inner, self.steps = inner, 0
        self.layers = inner.layers

    def __call__(self, x, cache=None):
        self.steps += x.shape[1] == 1
        return self.inner(x, cache=cache)


class Watched:
    """The adapter's ProgramFeed, watched: when each call's check flags were made (`made`: id -> (flags, the
    model's decode steps then)) and read (`read`: (id, decode steps since they were made))."""

    def __init__(self, feed, counted: Counted):
        self.feed, self.counted, self.made, self.read = feed, counted, {}, []

    def __getattr__(self, name):
        return getattr(self.feed, name)

    def __call__(self, *a, **k):
        outs, checks = self.feed(*a, **k)
        self.made[id(checks)] = (checks, self.counted.steps)
        return outs, checks

    def first_fired(self, checks, *a):
        self.read.append((id(checks), self.counted.steps - self.made[id(checks)][1]))
        return self.feed.first_fired(checks, *a)


def test_rows_sampled_one_by_one_read_check_flags_of_finished_steps_only(model, nucleus_prog):
    """Sampled row by row (a shared Sampler beside a request with another sampler), a step is several calls; the
    flags read after a call are those of steps two model steps back (mlx-lm has synced on them), not of an
    earlier row of the step still queued."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    counted = Counted(model)
    s = Sampler(nucleus_prog, seed=1)
    watched = s._feed = Watched(s._feed, counted)
    g = BatchGenerator(counted, stop_tokens=[], sampler=s, logits_processors=s.logits_processors)
    g.insert([[5, 17, 300, 4], [9, 9, 9, 9, 9], [1, 2, 3, 4]], max_tokens=[10] * 3)
    g.insert([[100, 200, 7]], max_tokens=[10], samplers=[make_sampler(temp=0.0)], logits_processors=[[]])
    _batch_tokens(g, [])
    read = [lag for _, lag in watched.read]
    assert read and min(read) >= 2, read


def test_one_sequences_state_follows_only_the_sequence_it_drew_for():
    """A state carried from one call of one sequence to the next (mirostat's mu): where the next sequence is the
    last one and the token drawn for it, the state it left; where it is any other sequence one token longer (another
    request's, a token the caller chose), the start -- as a fresh Sampler gives."""
    prog = samplec.compile(MIROSTAT)
    V = 64
    x = mx.array(np.random.default_rng(3).standard_normal((1, V)).astype(np.float32) * 3)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)

    def call(s, seq):
        s.logits_processors[0](mx.array(seq, dtype=mx.int32), x)
        token = int(np.array(s(lp)).reshape(-1)[0])
        return token, float(np.array(s.steps[-1].outputs.mu).reshape(-1)[0])

    first = [5, 9, 1, 7]
    s = Sampler(prog, seed=2)
    drawn, mu = call(s, first)
    followed = call(s, first + [drawn])
    for other in ([5, 9, 1, 8, drawn], first + [(drawn + 1) % V]):
        s = Sampler(prog, seed=2)
        assert call(s, first)[0] == drawn
        assert call(s, other) == call(Sampler(prog, seed=2), other), other     # (the start: a fresh Sampler's)
    s = Sampler(prog, seed=2)
    call(s, first)
    assert call(s, first + [drawn]) == followed != call(Sampler(prog, seed=2), first + [drawn])


def _joined_run(model, s, plan, steps=30):
    """BatchGenerator with one Sampler `s` for every request; `plan`: {step: [(prompt, max_tokens, key)]} inserted
    at that step (key None: the default processors). The tokens per uid, and `len(s.steps)` after each step."""
    from mlx_lm.generate import BatchGenerator
    g = BatchGenerator(model, stop_tokens=[], sampler=s, logits_processors=s.logits_processors)
    out, counts = {}, []
    for step in range(steps):
        for prompt, m, key in plan.get(step, ()):
            procs = None if key is None else [s.logits_processors_for(key)]
            out[g.insert([prompt], max_tokens=[m], logits_processors=procs)[0]] = []
        for r in g.next_generated():
            out[r.uid].append(int(r.token))
        counts.append(len(s.steps))
    g.close()
    return list(out.values()), counts


def test_a_request_joining_a_shared_samplers_batch_keeps_the_running_rows_steps(model, nucleus_prog):
    """mlx-lm's BatchGenerator samples a joining request's first step in a call of its own: one row at a position
    that follows none of the last step's, as a new generation's first step looks. The steps of the rows already
    running stay (they were dropped, the join taken for a new generation), the join's step records its own row, and
    the batch's later steps every row -- a batch of one joined as well. Plain decoding's new generation (one row
    again at the next step) still starts a new list."""
    A, B, C = [5, 17, 300], [9, 9, 9, 9, 9], [100, 200]
    for plan in ({0: [(A, 8, None), (B, 8, None)], 3: [(C, 4, None)]}, {0: [(A, 8, None)], 3: [(C, 4, None)]}):
        s = Sampler(nucleus_prog, seed=2)
        toks, counts = _joined_run(model, s, plan)
        widths = [len(st.position) for st in s.steps]
        assert counts == sorted(counts) and sum(widths) == sum(m + 1 for at in plan.values() for _, m, _ in at)
        first = [st.position[0] for st in s.steps if len(st.position) == len(plan[0])]
        assert first[:3] == [3, 4, 5] and 1 in widths and max(widths) == len(plan[0]) + 1, widths
        joined = [st.position for st in s.steps].index((2,))            # (C's first step: its prompt's length)
        assert joined >= 3 and s.steps[joined + 1].position[-1] == 3
        assert all(st.rows == (None,) * len(st.position) for st in s.steps)
        for prompt, got in zip([p for at in plan.values() for p, _, _ in at], toks):
            assert got == generate(model, nucleus_prog, prompt, len(got), seed=2)
        with pytest.raises(SamplecError, match=r"batches of \[1, .*logits_processors_for\(key\).*row=key"):
            s.output("token")
    s = Sampler(nucleus_prog, seed=2)
    for prompt in (A, C):
        toks = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=5, sampler=s,
                                            logits_processors=s.logits_processors)]
        assert [st.position for st in s.steps] == [(len(prompt) + i,) for i in range(6)]
        assert s.output("token")[:5, 0].tolist() == toks
    for key in (None, "a"):         # (requests one at a time: separate generations, unless they have keys)
        s = Sampler(nucleus_prog, seed=2)
        _joined_run(model, s, {0: [(A, 4, key)], 10: [(C, 4, key and "c")]})
        assert [st.position for st in s.steps] == [(3 + i,) for i in range(5) if key] + [(2 + i,) for i in range(5)]
        if key:
            assert s.output("token", row="a").shape == (5,) and s.output("token", row="c").shape == (5,)


def test_flags_of_steps_before_a_join_or_a_leave_are_all_read_and_never_waited_for(model, nucleus_prog):
    """Rows joining and leaving a shared Sampler's batch: every call's check flags are read once (none dropped
    with the steps of a join, none read twice), and during the run only those of calls two model steps back
    (mlx-lm has synced on them) -- a join reads no flag of the running rows' step still queued."""
    counted = Counted(model)
    s = Sampler(nucleus_prog, seed=1)
    watched = s._feed = Watched(s._feed, counted)
    made, read = watched.made, watched.read
    plan = {0: [([5, 17, 300, 4], 4, None), ([9, 9, 9, 9, 9], 12, None)], 2: [([1, 2, 3], 6, None)],
            5: [([7, 7], 5, None)]}
    _joined_run(counted, s, plan)
    during = [lag for _, lag in read]
    s.check()
    assert during and min(during) >= 2, during
    assert sorted(i for i, _ in read) == sorted(made) and len(made) == len(s.steps)


def test_a_check_that_fires_names_the_request_and_output_reads_one_request(nucleus_prog):
    """A row recorded by `logits_processors_for(key)`: the step records the key, a run-time check that fires on
    the row names it, and `output(name, row=key)` stacks that request's outputs alone."""
    s = Sampler(nucleus_prog, seed=3)
    x = mx.array(np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32))
    bad = mx.concatenate([x[:1], mx.full((1, 64), float("nan"))])
    for step, logits in enumerate([x, x, bad]):
        for i, (key, seq) in enumerate([("a", [4, 5, 6]), ("b", [1, 2])]):
            s.logits_processors_for(key)[0](mx.array(seq + [0] * step), logits[i:i + 1])
        s(logits)
    assert [st.rows for st in s.steps] == [("a", "b")] * 3
    with pytest.raises(SamplecError, match=r"at position 4 \(row 1 of 2\) of request 'b'"):
        s.check()
    assert s.output("token", row="b").shape == (3,)
    assert s.output("token", row="a").tolist() == s.output("token")[:, 0].tolist()
    assert s.output("top_logprobs", ids=True, row="b").shape == (3, 5)
    with pytest.raises(SamplecError, match=r"row='c'\): no step sampled that request.*logits_processors_for\('c'\)"):
        s.output("token", row="c")
