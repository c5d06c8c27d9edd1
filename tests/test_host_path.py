"""The short path of `Program.queue` (samplec/program.py): a call whose inputs look like an earlier call's reuses
its scalar arrays and traces its arrays' checks in front of the graph. It is taken where it should be (the
counters in `Program.queue_stats`), gives the full path's results bit for bit, and never changes an error: a bad
call after good ones says what it says on a fresh program."""
from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import samplec

ROOT = Path(__file__).resolve().parent.parent
V = 3000


def _examples():
    for path in sorted((ROOT / "examples").glob("*.smp")):
        for name in re.findall(r"^sampler\s+(\w+)", path.read_text(), re.M):
            yield path, name


VALUES = {"temperature": 0.7, "top_p": 0.9, "min_p": 0.05, "top_k": 50, "repetition_penalty": 1.1,
          "presence_penalty": 0.1, "frequency_penalty": 0.1, "temp": 0.7, "xtc_probability": 0.5, "typical_p": 0.95}


def server_args(prog, B: int, rng) -> dict:
    """A server's arguments (benchmarks/bench_targets.arguments at a small V): one value per row for every
    parameter, a history of MLX ids, per-row seeds, masks and biases as MLX arrays."""
    kw = {}
    for p in prog.params:
        if p.kind == "tokens":
            kw[p.name] = mx.array(rng.integers(0, V, (B, 16)).astype(np.int32))
        elif p.kind == "seed" and p.default != "os":
            kw[p.name] = [int(s) for s in rng.integers(0, 2 ** 63, B)]
        elif p.kind == "mask":
            kw[p.name] = mx.array(rng.random((B, V)) < 0.9)
        elif p.kind == "bias":
            kw[p.name] = mx.array((rng.standard_normal((B, V)) * 0.5).astype(np.float32))
        elif p.kind in ("float", "int") and p.name in VALUES:
            kw[p.name] = [VALUES[p.name]] * B
        elif p.kind == "int" and p.name in ("pos", "position"):
            kw[p.name] = [int(v) for v in rng.integers(0, 4000, B)]
    return kw


def logits(B: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal((B, V)).astype(np.float32) * 3)


def values(out) -> dict:
    return {k: np.array(v) for k, v in out.to_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("target", ["cpu", "portable"])
@pytest.mark.parametrize("path,name", list(_examples()), ids=lambda v: getattr(v, "name", v))
def test_every_example_takes_the_short_path_with_the_full_paths_results(path, name, target):
    """Every shipped example, with a server's arguments at B = 1 and 3: the first call of a shape takes the full
    path, the next ones the short path, and every output equals a fresh program's (the full path's) bit for bit,
    also when the position moves each call (one scalar array rebuilt)."""
    prog = samplec.compile_file(path, sampler=name, target=target)
    rng = np.random.default_rng(1)
    for B in (1, 3):
        x = logits(B, B)
        kw = server_args(prog, B, rng)
        before = dict(prog.queue_stats)
        runs = [values(prog(x, **kw)) for _ in range(3)]
        assert prog.queue_stats["full"] - before["full"] == 1
        assert prog.queue_stats["short"] - before["short"] == 2
        fresh = samplec.compile_file(path, sampler=name, target=target)
        want = values(fresh(x, **kw))
        for got in runs:
            assert_same(got, want)
        pos = [p.name for p in prog.params if p.name in ("pos", "position")]
        if pos:
            rebuilt = prog.queue_stats["scalars_rebuilt"]
            for step in (5, 6):
                moved = {**kw, pos[0]: [step] * B}
                assert_same(values(prog(x, **moved)), values(fresh(x, **moved)))
            assert prog.queue_stats["scalars_rebuilt"] - rebuilt == 2


# values a server's rows send, each leaving some stage on or off (temperature 0 greedy, top_p 1, top_k 0 or -1, ...)
ROW_VALUES = {"temperature": [0.0, 0.7, 1.0, 1.3], "temp": [0.0, 0.7, 1.0], "top_p": [1.0, 0.9, 0.5],
              "min_p": [0.0, 0.05], "top_k": [0, 1, 50, -1], "typical_p": [1.0, 0.95], "xtc_probability": [0.0, 0.5],
              "repetition_penalty": [1.0, 1.1], "presence_penalty": [0.0, 0.5], "frequency_penalty": [0.0, 0.3]}


@pytest.mark.parametrize("target", ["cpu", "portable"])
@pytest.mark.parametrize("path,name", list(_examples()), ids=lambda v: getattr(v, "name", v))
def test_a_rows_outputs_do_not_depend_on_the_other_rows_values(path, name, target):
    """A call runs without the stages its values leave off in every row, so a row alone and the same row among
    rows that leave other stages on run different graphs. The token is the same (spec section 4); on the cpu target
    every output is the same bit for bit; on the portable target a value read through a row's normalizer
    (logprob, raw_logprob, top_logprobs' values, probs) may be a few float32 steps apart: its sum is taken in
    sorted order where a stage of the call sorted the row, in id order where none did (docs/reliability.md)."""
    prog = samplec.compile_file(path, sampler=name, target=target)
    rng = np.random.default_rng(11)
    B = 4
    for step in range(4):
        x = mx.array((rng.standard_normal((B, V)) * (1, 3, 8, 3)[step]).astype(np.float32))
        kw = server_args(prog, B, rng)
        kw.update((k, [v[i] for i in rng.integers(0, len(v), B)]) for k, v in ROW_VALUES.items() if k in kw)
        batch = values(prog(x, **kw))
        for i in range(B):
            alone = values(prog(x[i:i + 1], **{k: v[i:i + 1] for k, v in kw.items()}))
            for k, v in batch.items():
                if target == "cpu" or k in ("token", "top_logprobs.ids", "candidates.ids"):
                    np.testing.assert_array_equal(v[i], alone[k][0], err_msg=f"{k} of row {i}, step {step}")
                else:
                    np.testing.assert_allclose(v[i], alone[k][0], rtol=0, atol=2e-6, err_msg=f"{k} of row {i}")


SRC = ("sampler s(t: float, k: int, h: tokens, allowed: mask, b: bias, seed: seed, pos: int = 0) "
       "-> token, logprob { allow(allowed) logit_bias(b) penalties(h, repeat = 1.5) top_k(k) temperature(t) "
       "sample(seed, position = pos) }")
X = logits(2, 7)
GOOD = dict(t=[0.7, 0.9], k=[5, 8], h=mx.array(np.array([[1, 2, 3], [4, -1, 5]], np.int32)),
            allowed=mx.array(np.random.default_rng(2).random((2, V)) < 0.8),
            b=mx.array(np.zeros((2, V), np.float32)), seed=[1, 2], pos=[3, 4])
WORDS = (V + 31) // 32
BAD = {
    "nan": dict(t=[0.7, float("nan")]),
    "out of range": dict(t=[-1.0, 0.7]),
    "flags for ints": dict(k=[True, True]),
    "a float for an int": dict(k=[5, 2.5]),
    "a string": dict(t="0.7"),
    "a ragged list": dict(t=[[0.7], [0.9, 1.0]]),
    "ragged seeds": dict(seed=[[1], [2, 3]]),
    "too few rows": dict(t=[0.7]),
    "a negative seed": dict(seed=[-1, 2]),
    "a seed past 64 bits": dict(seed=[1, 2 ** 64]),
    "an int past int32": dict(k=[5, 2 ** 31]),
    "an int below int32": dict(k=[-2 ** 31 - 1, 5]),
    "a missing parameter": dict(t=None),
    "an unknown parameter": dict(temperature=0.7),
    "an id >= V": dict(h=mx.array(np.array([[1, 2, 3], [4, V, 5]], np.int32))),
    "an id >= V from numpy": dict(h=np.array([[V + 1, 2, 3], [4, 1, 5]], np.int32)),
    "float ids": dict(h=mx.array(np.ones((2, 3), np.float32))),
    "a history of another batch": dict(h=mx.array(np.ones((3, 3), np.int32))),
    "a NaN bias": dict(b=mx.array(np.where(np.arange(V) == 7, np.nan, 0).astype(np.float32)[None].repeat(2, 0))),
    "a bias of another width": dict(b=mx.array(np.zeros((2, V + 1), np.float32))),
    "a float mask": dict(allowed=mx.array(np.ones((2, V), np.float32))),
    "a bitmask of the wrong width": dict(allowed=mx.array(np.ones((2, WORDS + 1), np.int32))),
    "a mask that allows nothing": dict(allowed=mx.array(np.zeros((2, V), np.bool_))),
    "logits of another shape": dict(x=logits(2, 1)[:, :100]),
}


def outcome(prog, **kw):
    args = {**GOOD, **kw}
    args = {k: v for k, v in args.items() if v is not None}
    x = args.pop("x", X)
    try:
        return values(prog(x, **args))
    except samplec.SamplecError as e:
        return str(e)


@pytest.mark.parametrize("case", list(BAD))
def test_an_error_after_good_calls_is_the_fresh_programs_error(case):
    """A bad value after good calls (the short path primed for this shape) gives exactly the error a fresh
    program gives; and the good call after it still gives the good call's results."""
    primed = samplec.compile(SRC)
    good = outcome(primed)
    assert isinstance(good, dict)
    outcome(primed)
    assert primed.queue_stats["short"] == 1
    got, want = outcome(primed, **BAD[case]), outcome(samplec.compile(SRC), **BAD[case])
    assert isinstance(want, str), want
    assert got == want
    assert_same(outcome(primed), good)


def test_the_arrays_forms_each_take_the_short_path_once_accepted():
    """An int64 history, a packed bitmask and a float16 bias: prepared in the traced pre-stage once the full path
    has accepted their shape and dtype, with the full path's results."""
    bits = np.packbits(np.array(GOOD["allowed"]), axis=-1, bitorder="little")
    packed = np.zeros((2, WORDS * 4), np.uint8)
    packed[:, :bits.shape[1]] = bits
    forms = dict(h=mx.array(np.array(GOOD["h"]).astype(np.int64)), allowed=mx.array(packed.view(np.int32)),
                 b=mx.array(np.full((2, V), 0.25, np.float16)))
    prog = samplec.compile(SRC)
    first = outcome(prog, **forms)
    assert isinstance(first, dict) and prog.queue_stats == {"short": 0, "full": 1, "scalars_rebuilt": 0, "specialized": 0}
    assert_same(outcome(prog, **forms), first)
    assert prog.queue_stats["short"] == 1
    assert_same(first, outcome(samplec.compile(SRC, opt_level=0), **forms))


def test_a_list_changed_in_place_is_read_anew():
    """The scalar values are keyed by their bytes at the call, not by the list objects."""
    prog = samplec.compile(SRC)
    k = [1, 1]
    one = outcome(prog, k=k)
    k[1] = 50
    wide = outcome(prog, k=k)
    assert_same(wide, outcome(samplec.compile(SRC), k=[1, 50]))
    assert one["logprob"][0] == wide["logprob"][0] and one["logprob"][1] != wide["logprob"][1]
    assert prog.queue_stats["short"] == 1


def test_a_decode_loop_moves_its_position_with_the_full_paths_results():
    """A decode loop's call: the same number objects each step (its constants) and a position that moves. Each step
    rebuilds the position alone and gives a fresh program's results; a value that moves every call is not cached
    (the cache holds the constants and the position's first move)."""
    src = ("sampler s(t: float, k: int, seed: seed, pos: int) -> token, logprob "
           "{ top_k(k) temperature(t) sample(seed, position = pos) }")
    prog, fresh = samplec.compile(src), samplec.compile(src)
    x = logits(1, 3)
    t, k, seed = 0.7, 40, 12345
    for step in range(300):
        got = values(prog(x, t=t, k=k, seed=seed, pos=step))
        if step % 75 == 0 or step == 299:
            assert_same(got, values(fresh(x, t=t, k=k, seed=seed, pos=step)))
    assert prog.queue_stats["short"] == 299 and prog.queue_stats["scalars_rebuilt"] == 299
    assert len(prog._scalars) <= 6 and prog._lasts[x.shape].moved == {prog._scalar_names.index("pos")}
    # a constant changed to an equal value of another type is another value (1 is not 1.0): the full path's error
    with pytest.raises(samplec.SamplecError, match="k"):
        prog(x, t=t, k=40.5, seed=seed, pos=300)


@pytest.mark.parametrize("target", ["cpu", "portable"])     # (the portable target takes them as [B, 1] columns)
def test_a_moving_integer_out_of_its_range_takes_the_full_paths_error(target):
    """A value that moves every call is built from the Python ints given (`Program._moved_int`) only within its
    parameter's range and int32's: a moving `last_n` that leaves [-1, inf), a position past int32, a bool, a numpy
    integer -- the full path's error, or the results of a fresh program (which reads a bool in a list as 1)."""
    src = ("sampler s(h: tokens, n: int, seed: seed, pos: int) -> token, logprob "
           "{ penalties(h, last_n = n, repeat = 1.3) sample(seed, position = pos) }")
    prog, fresh = samplec.compile(src, target=target), samplec.compile(src, target=target)
    x = logits(2, 9)
    h = mx.array(np.random.default_rng(3).integers(0, V, (2, 40)).astype(np.int32))
    for step in range(6):       # (both move: each call's values are built by `_moved_int`)
        kw = dict(h=h, n=[step - 1, 2 * step], seed=5, pos=[step, step + 7])
        assert_same(values(prog(x, **kw)), values(fresh(x, **kw)))
    assert prog._lasts[x.shape].moved == {prog._scalar_names.index("n"), prog._scalar_names.index("pos")}
    with pytest.raises(samplec.SamplecError, match=r"n = -2 is out of range \[-1"):
        prog(x, h=h, n=[3, -2], seed=5, pos=[6, 13])
    with pytest.raises(samplec.SamplecError, match="pos: integer out of the int32 range"):
        prog(x, h=h, n=[3, 4], seed=5, pos=[2 ** 31, 13])
    for kw in (dict(h=h, n=[3, 4], seed=5, pos=[True, 13]), dict(h=h, n=[3, 4], seed=5, pos=[np.int64(8), 15]),
               dict(h=h, n=5, seed=5, pos=9),
               dict(h=h, n=6, seed=5, pos=2 ** 31 - 1)):
        assert_same(values(prog(x, **kw)), values(fresh(x, **kw)))
    x, h = x[:1], h[:1]         # (one row: a decode loop's list of one position)
    for step in range(5):
        kw = dict(h=h, n=4, seed=5, pos=[step * 1000])
        assert_same(values(prog(x, **kw)), values(fresh(x, **kw)))
    with pytest.raises(samplec.SamplecError, match="pos: integer out of the int32 range"):
        prog(x, h=h, n=4, seed=5, pos=[-2 ** 31 - 1])


def test_calls_that_change_any_values_any_way_give_a_fresh_programs_results():
    """A run of calls, each changing some scalar values from the last call's -- a value that moves every call, one
    that stops moving, one that moves again, a type that changes (1 to 1.0), per-row lists, numpy seeds, a value
    left to its default -- gives at every call a fresh program's results: the short path never hands a call an
    array of an earlier value."""
    src = ("sampler s(t: float = 1.0, k: int = 0, p: float = 1.0, seed: seed, pos: int = 0) -> token, logprob "
           "{ top_k(k) top_p(p) temperature(t) sample(seed, position = pos) }")
    prog = samplec.compile(src)
    x = logits(2, 5)
    rng = np.random.default_rng(7)
    choices = {"t": [0.5, 0.7, 1.3, [0.7, 1.3], [1.3, 0.7], None],
               "k": [0, 5, 40, [5, 40], [40, 5], None],
               "p": [1.0, 0.5, 0.9, [0.5, 0.9], 1, None],
               "seed": [3, 11, [3, 11], np.array([3, 11], dtype=np.uint64), np.array([11, 3], dtype=np.uint64)],
               "pos": list(range(40)) + [[1, 2], [2, 1], None]}
    kw = {"t": 0.7, "k": 40, "p": 0.9, "seed": 3, "pos": 0}
    for step in range(160):
        for name, options in choices.items():
            # the position moves most calls; the other values change now and then
            if name == "pos" and rng.random() < 0.8 or rng.random() < 0.15:
                kw[name] = options[rng.integers(len(options))]
        call = {k: v for k, v in kw.items() if v is not None}
        assert_same(values(prog(x, **call)), values(samplec.compile(src)(x, **call))), (step, call)
    assert prog.queue_stats["short"] >= 150


def test_seeds_drawn_from_the_os_are_new_each_call():
    """`sample()` without a seed draws one from the OS every call, on the short path too."""
    prog = samplec.compile("sampler s(t: float) -> token { temperature(t) sample() }")
    x = mx.zeros((1, V))
    tokens = {int(np.array(prog(x, t=1.0).token)[0]) for _ in range(8)}
    assert prog.queue_stats["short"] == 7
    assert len(tokens) > 1


def test_numpy_histories_stay_on_the_full_path():
    """A numpy history is checked on the host at once (the error raised by the call that passes it): such calls
    take the full path."""
    prog = samplec.compile(SRC)
    kw = dict(h=np.array(GOOD["h"]))
    assert_same(outcome(prog, **kw), outcome(prog, **kw))
    assert prog.queue_stats["short"] == 0


def test_the_checks_queue_returns_name_every_flag():
    """`queue` on the short path names the full path's checks, in its order, with the same flags (the short path
    packs its arguments' checks with the graph's into words)."""
    from samplec.program import named_flags
    prog = samplec.compile(SRC)
    args = {k: v for k, v in GOOD.items()}
    full = prog.queue(X, **args)
    short = prog.queue(X, **args)
    assert prog.queue_stats == {"short": 1, "full": 1, "scalars_rebuilt": 1, "specialized": 0}
    mx.eval(full[0], short[0], [f for _, f in full[1]], [f for _, f in short[1]])
    a, b = named_flags(full[1]), named_flags(short[1])
    assert [m for m, _ in a] == [m for m, _ in b] and len(a) >= 3
    for (_, fa), (_, fb) in zip(a, b):
        np.testing.assert_array_equal(fa, fb)


def test_copies_start_with_empty_caches():
    prog = samplec.compile(SRC)
    good = outcome(prog)
    outcome(prog)
    for other in (pickle.loads(pickle.dumps(prog)), copy.deepcopy(prog)):
        assert other.queue_stats["short"] == 0
        assert_same(outcome(other), good)
        assert_same(outcome(other), good)
        assert other.queue_stats["short"] == 1


def test_values_marshal_writes_as_bytes_are_never_mistaken_for_bytes():
    """A numpy seed array or a numpy scalar is written by marshal as its buffer's bytes: a bytes value with the
    same content, passed after it, is still refused as the fresh program refuses it."""
    src = "sampler s(t: float, seed: seed) -> token { temperature(t) sample(seed) }"
    x = logits(2, 3)
    seeds = np.array([1, 2], np.uint64)
    t = np.float64(0.7)
    f32 = np.float32(0.7)
    for good, bad in ((dict(t=0.7, seed=seeds), dict(t=0.7, seed=seeds.tobytes())),
                      (dict(t=t, seed=[1, 2]), dict(t=t.tobytes(), seed=[1, 2])),
                      (dict(t=[f32] * 2, seed=[1, 2]), dict(t=[f32.tobytes()] * 2, seed=[1, 2]))):
        prog = samplec.compile(src)
        want = values(prog(x, **good))
        assert_same(values(prog(x, **good)), want)
        assert prog.queue_stats["short"] == 1
        with pytest.raises(samplec.SamplecError) as fresh:
            samplec.compile(src)(x, **bad)
        with pytest.raises(samplec.SamplecError) as primed:
            prog(x, **bad)
        assert str(primed.value) == str(fresh.value)
        assert_same(values(prog(x, **good)), want)


def test_only_the_full_path_opens_a_hold(monkeypatch):
    """A scalar-only call on the full path wakes MLX's CPU worker while it prepares (native.wake); a short call
    does not: its preparation is shorter than the hold's own cost (benchmarks/bench_host.py)."""
    import samplec.program as program_mod
    woke = []
    real = program_mod.wake
    monkeypatch.setattr(program_mod, "wake", lambda: woke.append(1) or real())
    prog = samplec.compile("sampler s(t: float, seed: seed) -> token { top_k(5) temperature(t) sample(seed) }")
    x = logits(2, 4)
    first = values(prog(x, t=0.7, seed=[1, 2]))
    assert woke == [1]
    assert_same(values(prog(x, t=0.7, seed=[1, 2])), first)
    assert woke == [1] and prog.queue_stats["short"] == 1


@pytest.mark.parametrize("target", ["portable", "cpu"])
def test_a_call_of_some_outputs_leaves_the_others_lazy(target):
    """`Program.run(x, names)` evaluates the outputs named and the call's checks; the others stay lazy (their work
    -- top_logprobs' sort on the portable target -- runs only if they are read), and read later they are a full
    call's."""
    from samplec.backend_mlx.launches import primitives
    src = "sampler s(seed: seed) -> token, logprob, top_logprobs(3) { top_k(40) temperature(0.8) sample(seed) }"
    prog = samplec.compile(src, target=target)
    assert prog.output_names == ["token", "logprob", "top_logprobs"]
    x = mx.array(np.random.default_rng(1).normal(0, 2, (3, 500)).astype(np.float32))
    full = prog(x, seed=[1, 2, 3])
    some = prog.run(x, ["token"], seed=[1, 2, 3])
    assert not primitives([some.token])                 # (evaluated: no graph left)
    if target == "portable":                            # (the cpu target's primitive gives them all at once)
        assert primitives([some.top_logprobs.ids]), "top_logprobs was evaluated"
    for name in ("token", "logprob"):
        assert np.array_equal(np.array(getattr(some, name)), np.array(getattr(full, name))), name
    assert np.array_equal(np.array(some.top_logprobs.ids), np.array(full.top_logprobs.ids))
    with pytest.raises(samplec.SamplecError, match="no output 'probs'"):
        prog.run(x, ["token", "probs"], seed=[1, 2, 3])
    bad = np.array(x)
    bad[1, 7] = np.nan
    with pytest.raises(samplec.SamplecError, match="NaN"):       # (the checks run whatever is asked)
        prog.run(mx.array(bad), [], seed=[1, 2, 3])


def test_check_flags_come_back_packed_and_unpack_to_each_check():
    """The graph's check flags come back as uint32 words (one kernel for them on a GPU), flag i at bit i % 32 of
    word i // 32: 70 flags of both shapes ([B] and [B, 1]) round-trip through pack_flags and unpack_flags, and a
    call that fails its second check names that check and its rows."""
    from samplec.backend_mlx.interpreter import pack_flags, unpack_flags
    rng = np.random.default_rng(3)
    B = 5
    want = rng.random((70, B)) < 0.3
    flags = [mx.array(w) if i % 3 else mx.array(w[:, None]) for i, w in enumerate(want)]
    words = pack_flags(flags)
    assert len(words) == 3 and all(w.dtype == mx.uint32 and w.shape == (B,) for w in words)
    got = unpack_flags([np.array(w) for w in words], 70)
    assert np.array_equal(np.stack(got), want)
    stacked = unpack_flags([np.stack([np.array(w)] * 4) for w in words], 70)   # (a chunk of steps stacks words)
    assert all(s.shape == (4, B) and np.array_equal(s[2], w) for s, w in zip(stacked, want))

    prog = samplec.compile("sampler s(t: float, seed: seed) -> token { temperature(t) sample(seed) }")
    x = np.zeros((3, 8), np.float32)
    x[[0, 2]] = -np.inf
    with pytest.raises(samplec.SamplecError, match=r"logits: every entry is -inf \(rows 0, 2\)"):
        prog(x, t=0.7, seed=1)


@pytest.mark.parametrize("target,opt", [("cpu", 2), ("portable", 2), ("cpu", 0)])
@pytest.mark.parametrize("native", ["0", "1"])
def test_replayed_calls_name_the_rows_of_each_logits_check(target, opt, native, monkeypatch):
    """The logits' checks test the row maximum as a [B, 1] column in the kernel that packs the flags
    (`interpreter.flag_column`): on every target, in a call the compiled graph replays (the short path, after two
    good calls) as in the first, each check names exactly its rows -- a NaN and a +inf row for the first, the rows
    with every entry -inf for the second -- and a history id past V names its row beside them."""
    monkeypatch.setenv("SAMPLEC_NATIVE", native)
    src = ("sampler s(h: tokens, t: float, seed: seed) -> token, logprob "
           "{ penalties(h, repeat = 1.3) top_p(0.9) temperature(t) sample(seed) }")
    prog = samplec.compile(src, opt_level=opt, target=target)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    h = mx.array(rng.integers(0, 64, (5, 6)).astype(np.int32))
    for _ in range(2):
        prog(mx.array(x), h=h, t=0.7, seed=3)
    bad = x.copy()
    bad[1, 9], bad[3, 0] = np.nan, np.inf
    with pytest.raises(samplec.SamplecError, match=r"^logits: NaN or \+inf \(rows 1, 3\)$"):
        prog(mx.array(bad), h=h, t=0.7, seed=3)
    bad = x.copy()
    bad[[0, 4]] = -np.inf
    with pytest.raises(samplec.SamplecError, match=r"^logits: every entry is -inf \(rows 0, 4\)$"):
        prog(mx.array(bad), h=h, t=0.7, seed=3)
    far = np.array(h)
    far[2, 1] = 64
    with pytest.raises(samplec.SamplecError, match=r"^h: token id >= V = 64 among its tokens \(row 2\)$"):
        prog(mx.array(x), h=mx.array(far), t=0.7, seed=3)
    assert prog.queue_stats["short"] >= 4


@pytest.mark.parametrize("path,name", list(_examples()), ids=lambda v: getattr(v, "name", v))
def test_the_short_path_hands_the_portable_graph_its_scalars_as_columns(path, name):
    """On the portable target every scalar parameter the graph reads only as [B, 1] comes in as [B, 1] on the
    short path: the call's graph holds no view of a parameter of its own (no ExpandDims: a node less each for the
    host to replay), and an executable handed [B, 1] for every scalar parameter -- also those it reads as [B] --
    gives what it gives for [B] bit for bit."""
    from samplec.backend_mlx.launches import call_primitives
    from samplec.program import SCALAR_NP
    prog = samplec.compile_file(path, sampler=name, target="portable")
    rng = np.random.default_rng(3)
    x = logits(2, 4)
    kw = server_args(prog, 2, rng)
    assert prog.exe.wide_params(), name
    assert call_primitives(prog, x, **kw)["ExpandDims"] == 0
    args = prog.prepare(x, dict(kw))
    narrow, _ = prog.exe(*args)
    wide = [args[0]] + [a.reshape(2, 1) if p.kind in SCALAR_NP and a.ndim == 1 else a
                        for p, a in zip(prog.params, args[1:])]
    got, _ = prog.exe(*wide)
    for a, b in zip(narrow, got):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_the_cpu_target_takes_its_scalars_as_they_are():
    """Where native kernels read the parameters themselves (the cpu target), nothing is widened; handed [B, 1]
    anyway, its executable reads each as [B] and gives the same bits."""
    from samplec.backend_mlx import native
    from samplec.program import SCALAR_NP
    if not native.enabled():
        pytest.skip("samplec-native is not built here")
    prog = samplec.compile_file(ROOT / "examples" / "llama.smp", sampler="llama", target="cpu")
    assert prog.exe.wide_params() == frozenset() and not prog._wide
    x = logits(2, 5)
    args = prog.prepare(x, server_args(prog, 2, np.random.default_rng(4)))
    wide = [args[0]] + [a.reshape(2, 1) if p.kind in SCALAR_NP and a.ndim == 1 else a
                        for p, a in zip(prog.params, args[1:])]
    for a, b in zip(prog.exe(*args)[0], prog.exe(*wide)[0]):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_an_output_the_program_lacks_is_a_samplec_error_and_an_attribute_error():
    """`out.probs` of a program without a probs output: a SamplecError naming the outputs it has (as every user-facing
    failure), which `hasattr` and `getattr(out, name, default)` still read as a missing attribute."""
    prog = samplec.compile(SRC)
    out = prog(X, **GOOD)
    with pytest.raises(samplec.SamplecError, match=r"no output 'probs' \(it has: token, logprob\)"):
        out.probs
    assert not hasattr(out, "probs") and getattr(out, "probs", None) is None and hasattr(out, "logprob")


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32", "uint64"])
def test_an_unsigned_mlx_history_reads_as_its_ids(dtype):
    """An MLX history of an unsigned dtype (no padding in it) gives the int32 history's results, and an id >= V --
    past int32's range too -- the error naming its row, never MLX's own error."""
    prog = samplec.compile(SRC)
    h = np.array([[1, 2, 3], [4, 9, 5]])
    want = outcome(prog, h=mx.array(h.astype(np.int32)))
    assert_same(outcome(prog, h=mx.array(h.astype(dtype))), want)
    for bad in (V, 2 ** 40):
        if bad <= np.iinfo(dtype).max:      # (uint8 holds no id >= V = 3000)
            got = outcome(prog, h=mx.array(np.array([[1, 2, 3], [4, bad, 5]], dtype=np.uint64).astype(dtype)))
            assert isinstance(got, str) and "token id >= V" in got and "row 1" in got, (bad, got)
