"""Bad run-time inputs: each gives the exact answer or a SamplecError naming the parameter (and the rows) --
never another exception, never a silently different sampler."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import samplec

SRC = ("sampler s(t: float, k: int, h: tokens, seed: seed) -> token, logprob "
       "{ penalties(h, repeat = 1.5) top_k(k) temperature(t) sample(seed) }")


@pytest.fixture(scope="module", params=[0, 2])
def prog(request):
    return samplec.compile(SRC, opt_level=request.param)


X = np.random.default_rng(0).standard_normal((2, 50)).astype(np.float32)
H = np.array([[1, 2], [3, -1]], dtype=np.int32)


def call(p, **kw):
    args = dict(t=0.7, k=5, h=H, seed=1)
    args.update(kw)
    x = args.pop("x", X)
    out = p(x, **args)
    return np.array(out.token).tolist(), np.array(out.logprob).tolist()


def error(p, **kw) -> str:
    with pytest.raises(samplec.SamplecError) as e:
        call(p, **kw)
    return str(e.value)


def test_views_of_any_stride_are_their_values(prog):
    rev = X[:, ::-1]
    assert call(prog, x=rev) == call(prog, x=np.ascontiguousarray(rev))
    wide = np.repeat(X, 2, axis=1)[:, ::2]
    assert call(prog, x=wide) == call(prog)


@pytest.mark.parametrize("bad", ["abc", b"abc", [["a"] * 50] * 2, np.array([1j] * 50), object()])
def test_logits_that_are_not_numbers(prog, bad):
    assert "logits" in error(prog, x=bad)


@pytest.mark.parametrize("bad", ["0.7", b"1", 1j, [0.7, "1"], None.__class__])
def test_numbers_given_as_strings_or_other_types(prog, bad):
    assert "'t'" in error(prog, t=bad) or error(prog, t=bad).startswith("t:")


def test_history_ids_are_checked_before_narrowing(prog):
    """int64 ids >= 2**32 do not wrap onto small ids; negative int64 ids (any size) are padding."""
    wide = np.array([[2 ** 32 + 5, 1], [1, 1]], dtype=np.int64)
    for h in (wide, mx.array(wide)):
        msg = error(prog, h=h)
        assert msg.startswith("h:") and "row 0" in msg, msg
    neg = np.array([[-2 ** 32 + 5, 1], [3, -(2 ** 40)]], dtype=np.int64)
    pad = np.array([[-1, 1], [3, -1]], dtype=np.int32)
    assert call(prog, h=neg) == call(prog, h=pad)
    assert call(prog, h=mx.array(neg)) == call(prog, h=pad)


@pytest.mark.parametrize("native_on", ["1", "0"])
def test_int32_history_arrays_are_checked_in_the_call(prog, native_on, monkeypatch):
    """An int32 MLX history is checked with the call's outputs (one primitive where the native ones serve, MLX ops
    otherwise): an id >= V names its rows, and a clean history gives the numpy history's answer."""
    monkeypatch.setenv("SAMPLEC_NATIVE", native_on)
    p = samplec.compile(SRC, opt_level=2)
    bad = np.array([[1, 50], [3, 49]], dtype=np.int32)
    msg = error(p, h=mx.array(bad))
    assert msg.startswith("h:") and "row 0" in msg and "row 1" not in msg, msg
    msg = error(p, h=mx.array(np.array([[1, 2], [60, 70]], dtype=np.int32)))
    assert msg.startswith("h:") and "row 1" in msg and "row 0" not in msg, msg
    assert call(p, h=mx.array(H)) == call(p, h=H)
    assert call(p, h=mx.array(H)[:, ::-1]) == call(p, h=np.ascontiguousarray(H[:, ::-1]))   # (a strided view)


@pytest.mark.parametrize("native_on", ["1", "0"])
@pytest.mark.parametrize("target", ["portable", "cpu"])
def test_mlx_bias_arrays_are_checked_in_the_call(native_on, target, monkeypatch):
    """A float32 MLX bias is checked with the call's outputs (the row's maximum: one primitive where the native ones
    serve, one MLX reduction of the bias otherwise): a NaN or +inf anywhere in a row names that row, the first and
    the later call alike (the short path traces the check with the graph)."""
    monkeypatch.setenv("SAMPLEC_NATIVE", native_on)
    p = samplec.compile("sampler s(b: bias, seed: seed) -> token { logit_bias(b) sample(seed) }", target=target)
    x = np.random.default_rng(0).standard_normal((4, 300)).astype(np.float32)
    for row, col, value in [(1, 0, np.nan), (2, 299, np.inf), (3, 150, np.nan), (0, 7, -np.inf)]:
        b = np.zeros((4, 300), np.float32)
        b[row, col] = value
        for _ in range(2):
            try:
                p(mx.array(x), b=mx.array(b), seed=1)
                msg = ""
            except samplec.SamplecError as e:
                msg = str(e)
            if np.isneginf(value):
                assert msg == "", msg
            else:
                assert msg == f"b: NaN or +inf bias (row {row})", msg


def test_the_whole_int32_range(prog):
    assert call(prog, k=-2 ** 31) == call(prog, k=0)              # (k <= 0: off)
    assert call(prog, k=[-2 ** 31, 2 ** 31 - 1]) == call(prog, k=0)
    msg = error(prog, k=2 ** 31)
    assert msg.startswith("k:") and "int32" in msg, msg
    msg = error(prog, k=[5, -2 ** 31 - 1])
    assert msg.startswith("k:") and "row 1" in msg, msg


@pytest.mark.parametrize("opt", [0, 2])
def test_overflow_inside_the_chain_is_exact_or_an_error(opt, monkeypatch):
    """temperature(t) with x / t past the float32 range keeps the argmax alone (the limit of softmax(x / t)), at
    every optimization level, with and without the native kernels; a logit_bias or a penalty that overflows to
    +inf is an error naming the stage and the rows (it was token 0 with a NaN logprob)."""
    x = (np.random.default_rng(3).standard_normal((3, 500)) * 5).astype(np.float32)
    x[2, 7] = 3e38
    for native in ("1", "0"):
        monkeypatch.setenv("SAMPLEC_NATIVE", native)
        p = samplec.compile("sampler s(t: float, seed: seed) -> token, logprob { top_p(0.9) temperature(t) "
                            "sample(seed) }", opt_level=opt)
        out = p(x, t=[1e-45, 0.7, 0.5], seed=[1, 2, 3])
        tok, lp = np.array(out.token).tolist(), np.array(out.logprob).tolist()
        assert tok[0] == int(np.argmax(x[0])) and lp[0] == 0.0          # x / 1e-45 overflows: the argmax
        assert tok[2] == 7 and lp[2] == 0.0                              # 3e38 / 0.5 overflows too
        b = np.zeros_like(x)
        b[1, 7] = 3e38
        xb = x.copy()
        xb[1, 7] = 3e38
        q = samplec.compile("sampler s(b: bias) -> token { logit_bias(b) greedy() }", opt_level=opt)
        with pytest.raises(samplec.SamplecError, match=r"logit_bias: .*overflows.*row 1"):
            q(xb, b=b)
        r = samplec.compile("sampler s(h: tokens, r: float) -> token { penalties(h, repeat = r) greedy() }",
                            opt_level=opt)
        h = np.array([[int(np.argmax(x[0]))], [0], [1]], dtype=np.int32)
        with pytest.raises(samplec.SamplecError, match=r"penalties: .*overflows.*row 0"):
            r(x, h=h, r=[1e-38, 1.0, 1.0])


@pytest.mark.parametrize("opt", [0, 2])
@pytest.mark.parametrize("V", [10, 152064])
def test_an_overflowed_row_before_typical_p_is_an_error_not_a_crash(opt, V):
    """A +inf a penalty or a bias wrote, then typical_p with the row's probabilities or log-probabilities read:
    the stage's check names it (the native typical_p ran first on the row and crashed: its scores held no key in
    range)."""
    x = np.zeros((1, V), np.float32)
    x[0, 5] = 2e38
    h = np.array([[5]], np.int32)
    for outs, term in (("probs", ""), ("token, logprob", "greedy()"), ("token, probs", "sample(seed)")):
        p = samplec.compile(f"sampler s(h: tokens, seed: seed) -> {outs} {{ penalties(h, repeat = 0.5) "
                            f"typical_p(0.5) {term} }}", opt_level=opt)
        with pytest.raises(samplec.SamplecError, match=r"penalties: .*overflows.*row 0"):
            p(x, h=h, seed=1)
    b = np.zeros((1, V), np.float32)
    b[0, 5] = 3e38
    q = samplec.compile("sampler s(b: bias) -> probs { top_k(3) logit_bias(b) typical_p(0.5) }", opt_level=opt)
    with pytest.raises(samplec.SamplecError, match=r"logit_bias: .*overflows.*row 0"):
        q(x, b=b)


@pytest.mark.parametrize("opt", [0, 2])
def test_a_penalty_that_makes_nan_is_an_error(opt):
    """count * frequency overflowing to -inf on a token a cut removed makes -inf - (-inf) = NaN: the penalties'
    check names it at every level (the levels drew different tokens from the NaN, or only one flagged a later
    stage)."""
    x = np.array([[0.0, 1.0, 2.0, 3.0]], np.float32)
    h = np.array([[1, 1]], np.int32)
    for src in ("sampler s(h: tokens) -> token, logprob { top_k(1) penalties(h, frequency = -2e38) greedy() }",
                "sampler s(h: tokens) -> token, logprob { top_k(1) penalties(h, frequency = -2e38) sample(7) }",
                "sampler s(h: tokens) -> probs { top_k(1) penalties(h, frequency = -2e38) top_p(0.5) }"):
        with pytest.raises(samplec.SamplecError, match=r"penalties: .*\(\+inf or NaN\).*row 0"):
            samplec.compile(src, opt_level=opt)(x, h=h)


def test_a_one_dimensional_history_is_one_rows_value(prog):
    """A 1-D `tokens` value is one row's history: the value of a one-row call, and for a batch a wrong shape (an
    error naming the parameter) -- not silently every row's history."""
    msg = error(prog, h=np.array([1, 2, 3], np.int32))
    assert msg.startswith("h: expected shape [B, H] with B = 2, got [3]"), msg
    one = call(prog, x=X[:1], h=np.array([1, 2], np.int32), seed=[1])
    assert one == call(prog, x=X[:1], h=H[:1], seed=[1])


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("opt", [0, 2])
def test_a_row_the_penalties_leave_without_a_token_is_an_error(opt, native, monkeypatch):
    """Penalties that overflow float32 to -inf on a row's last kept tokens leave it nothing to draw: an error naming
    the stage and the row (never token 0 with a NaN logprob), whatever other rows hold."""
    monkeypatch.setenv("SAMPLEC_NATIVE", native)
    ninf = -np.inf
    x = np.array([[-10.0, ninf, ninf], [-10.0, 1.0, ninf], [-1e38, ninf, ninf]], np.float32)
    h = np.array([[0, -1], [0, 0], [0, -1]], np.int32)
    for body, rows in (("penalties(h, repeat = 1e38)", "rows 0, 2"), ("penalties(h, presence = 3e38)", "row 2")):
        p = samplec.compile(f"sampler s(h: tokens) -> token, logprob {{ {body} top_k(2) sample(0) }}", opt_level=opt)
        with pytest.raises(samplec.SamplecError, match=rf"penalties: .*no token is left \({rows}\)"):
            p(x, h=h)
        ok = np.array(p(x[1:2], h=h[1:2]).token).tolist()
        assert ok == [1]


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("opt", [0, 2])
@pytest.mark.parametrize("edit", ["logit_bias(b)", "allow(m)"])
def test_a_row_a_cut_an_edit_and_the_penalties_leave_without_a_token_is_an_error(edit, opt, native, monkeypatch):
    """After a cut, a bias or mask under the penalties (the kernel reads the row through them, skipping the cut's
    -inf): a row whose last kept token the edit removes and the penalties overflow is an error naming it; a row
    the edit leaves a token draws it."""
    monkeypatch.setenv("SAMPLEC_NATIVE", native)
    V = 200
    x = np.full((3, V), -np.inf, np.float32)
    x[:, 0] = -10.0
    x[1:, 150] = 1.0
    b = np.zeros((3, V), np.float32)
    b[1, 150] = -np.inf
    m = np.isfinite(b)
    h = np.zeros((3, 1), np.int32)
    p = samplec.compile(f"sampler s(h: tokens, b: bias, m: mask) -> token, logprob {{ top_k(2) {edit} "
                        "penalties(h, repeat = 1e38) sample(0) }", opt_level=opt)
    with pytest.raises(samplec.SamplecError, match=r"penalties: .*no token is left \(rows 0, 1\)"):
        p(x, h=h, b=b, m=m)
    assert np.array(p(x[2:], h=h[2:], b=b[2:], m=m[2:]).token).tolist() == [150]


def test_an_error_in_many_rows_names_the_first_and_counts_them():
    """A run-time error names the offending rows; past sixteen it names the first sixteen and says how many."""
    p = samplec.compile("sampler s(t: float) -> token { temperature(t) sample(1) }")
    t = np.full(40, 0.7, np.float32)
    t[3::2] = -1.0
    with pytest.raises(samplec.SamplecError) as e:
        p(np.zeros((40, 10), np.float32), t=t)
    assert "rows 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, ... (19 rows)" in str(e.value)
    # (the values out of range are named once each, in the order of their first row: not once a row)
    t[4] = -2.0
    with pytest.raises(samplec.SamplecError, match=r"^t = -1, -2 is out of range \[0, inf\] \(rows 3, 4, 5, "):
        p(np.zeros((40, 10), np.float32), t=t)


def test_float_values_are_checked_as_the_float32_they_become(prog):
    """A run-time float is the float32 a literal would be: checked after rounding (docs/language.md), so a value
    a float64 sum lands one ulp past a bound is that bound, and one past the float32 range is an error."""
    nucleus = samplec.compile("sampler s(q: float, m: float, seed: seed) -> token { top_p(q) min_p(m) sample(seed) }")
    ok = np.array(nucleus(X, q=0.1 + 0.2 + 0.7, m=1.00000001, seed=3).token).tolist()
    assert ok == np.array(nucleus(X, q=1.0, m=1.0, seed=3).token).tolist()
    with pytest.raises(samplec.SamplecError, match=r"q = 0 is out of range \(0, 1\] \(row 1\)"):
        nucleus(X, q=[0.5, 1e-300], m=0.0, seed=3)       # 1e-300 is 0 in float32, as top_p(1e-50) is
    msg = error(prog, t=[0.7, 1e39])
    assert msg.startswith("t:") and "float32 range" in msg and "row 1" in msg, msg
    assert call(prog, t=-1e-50) == call(prog, t=0.0)  # -0.0: greedy, as the literal temperature(-1e-50)


def test_set_floats_are_float32_too():
    src = "sampler s(t: float, seed: seed) -> token { temperature(t) sample(seed) }"
    with pytest.raises(samplec.SamplecError, match="float32 range"):
        samplec.compile(src, bindings={"t": 1e39})
    with pytest.raises(samplec.SamplecError, match="NaN"):
        samplec.compile(src, bindings={"t": float("nan")})
    bound = samplec.compile("sampler s(q: float, seed: seed) -> token { top_p(q) sample(seed) }",
                            bindings={"q": 0.1 + 0.2 + 0.7})
    assert "top_p" not in bound.ir()                      # float32(1.0000000000000002) = 1: top_p is off


def test_every_problem_of_a_value_is_named_with_its_rows():
    """One error names each problem and its rows (a NaN does not hide an out-of-range row); a scalar's problem is
    every row's; a bool is not a number."""
    nucleus = samplec.compile("sampler s(a: float, k: int, s: seed) -> token { top_k(k) top_p(a) sample(s) }")
    x = np.zeros((3, 5), np.float32)
    with pytest.raises(samplec.SamplecError) as e:
        nucleus(x, a=[np.nan, 1.5, 0.5], k=1, s=1)
    assert str(e.value) == "a: NaN (row 0); a = 1.5 is out of range (0, 1] (row 1)"
    with pytest.raises(samplec.SamplecError) as e:
        nucleus(x, a=0.5, k=[1.5, 2 ** 40, np.nan], s=1)
    assert str(e.value) == ("k: NaN (row 2); k: expected an integer (row 0); "
                            "k: integer out of the int32 range [-2**31, 2**31 - 1] (row 1)")
    for seed in (-1, 2 ** 64):
        with pytest.raises(samplec.SamplecError, match=r"s: seeds must be in \[0, 2\*\*64\) \(rows 0, 1, 2\)"):
            nucleus(x, a=0.5, k=1, s=seed)
    for flag in (True, np.array([True, False, True])):
        with pytest.raises(samplec.SamplecError, match="a: expected a number"):
            nucleus(x, a=flag, k=1, s=1)


def test_per_row_lists_are_checked_and_never_stale():
    """Per-row lists of plain numbers take a cached short path: a list of flags is still refused after the same
    numbers were accepted (True == 1 in a tuple key), a value out of range still names its row, and a list changed
    in place between calls is read anew."""
    prog = samplec.compile("sampler s(k: int, t: float, seed: seed) -> token, probs { top_k(k) temperature(t) "
                           "sample(seed) }")
    x = np.array([[0.0, 1.0, 2.0, 3.0]] * 2, np.float32)
    k = [1, 1]
    assert np.array(prog(x, k=k, t=[1.0, 1.0], seed=[1, 2]).token).tolist() == [3, 3]
    with pytest.raises(samplec.SamplecError, match="k: expected a number"):
        prog(x, k=[True, True], t=[1.0, 1.0], seed=[1, 2])
    with pytest.raises(samplec.SamplecError, match=r"t = -1 is out of range \[0, inf\] \(row 1\)"):
        prog(x, k=k, t=[1.0, -1.0], seed=[1, 2])
    with pytest.raises(samplec.SamplecError, match=r"seed: seeds must be in \[0, 2\*\*64\) \(row 0\)"):
        prog(x, k=k, t=[1.0, 1.0], seed=[-1, 2])
    k[1] = 4
    probs = np.array(prog(x, k=k, t=[1.0, 1.0], seed=[1, 2]).probs)
    assert (probs[0] > 0).sum() == 1 and (probs[1] > 0).sum() == 4


def test_programs_called_from_threads_exit_cleanly(tmp_path):
    """Worker threads that called a program, then a process that ends: MLX keeps its compile cache per thread,
    and an entry released after Python shut down aborted the process ("terminate called without an active
    exception", 9 runs in 10 before the fix). Each thread now releases its own compiled function as it ends."""
    import subprocess
    import sys
    script = tmp_path / "threads.py"
    script.write_text(
        "import threading, numpy as np, samplec\n"
        "prog = samplec.compile('sampler s(t: float, seed: seed) -> token { top_k(5) temperature(t) sample(seed) }')\n"
        "x = np.random.default_rng(0).normal(size=(2, 300)).astype(np.float32)\n"
        "want = [np.array(prog(x, t=0.9, seed=s).token).tolist() for s in range(6)]\n"
        "bad = []\n"
        "def work(k):\n"
        "    for i in range(20):\n"
        "        s = (k + i) % 6\n"
        "        if np.array(prog(x, t=0.9, seed=s).token).tolist() != want[s]: bad.append(s)\n"
        "ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "assert not bad, bad\n")
    for _ in range(3):
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (run.returncode, run.stderr[-2000:])


def test_a_program_pickles_and_copies_after_calls_from_threads():
    """A program sent to a process pool or deep-copied: its per-thread compiled functions stay behind, the copy
    traces its own and gives the same tokens."""
    import copy
    import pickle
    import threading
    prog = samplec.compile("sampler s(t: float, seed: seed) -> token { top_k(5) temperature(t) sample(seed) }")
    x = np.random.default_rng(0).normal(size=(2, 300)).astype(np.float32)
    want = np.array(prog(x, t=0.9, seed=1).token).tolist()
    t = threading.Thread(target=lambda: prog(x, t=0.9, seed=1))
    t.start()
    t.join()
    for other in (pickle.loads(pickle.dumps(prog)), copy.deepcopy(prog), copy.copy(prog)):
        assert np.array(other(x, t=0.9, seed=1).token).tolist() == want


@pytest.mark.parametrize("target", ["cpu", "portable"])
def test_arrays_reversed_along_an_axis_of_one_entry(target):
    """numpy calls a view reversed along an axis of one entry contiguous, but its stride is negative, which MLX
    refuses: every array argument (logits, history, mask, bias, per-row seeds and values) reversed that way reads as
    its values -- the plain arrays' tokens, not an error."""
    src = ("sampler s(h: tokens, seed: seed, m: mask, b: bias, t: float = 1.0) -> token "
           "{ allow(m) logit_bias(b) penalties(h, repeat = 2.0) temperature(t) sample(seed) }")
    p = samplec.compile(src, target=target)
    x = np.array([[1.0, 2.0, 3.0]], np.float32)
    h, m, b = np.array([[2, 1]], np.int32), np.ones((1, 3), bool), np.zeros((1, 3), np.float32)
    seed, t = np.array([7], np.uint64), np.array([0.5], np.float32)
    want = np.array(p(x, h=h, seed=seed, m=m, b=b, t=t).token)
    for kw in ({"x": x[::-1]}, {"h": h[::-1]}, {"seed": seed[::-1]}, {"m": m[::-1]}, {"b": b[::-1]}, {"t": t[::-1]}):
        args = {"x": x, "h": h, "seed": seed, "m": m, "b": b, "t": t, **kw}
        np.testing.assert_array_equal(np.array(p(args.pop("x"), **args).token), want)


def test_top_p_zero_names_the_off_value():
    """mlx-lm's and vLLM's servers read top_p = 0 as off: samplec's error says 1 is the off value."""
    nucleus = samplec.compile("sampler s(a: float, s: seed) -> token { top_p(a) sample(s) }")
    with pytest.raises(samplec.SamplecError) as e:
        nucleus(np.zeros((2, 5), np.float32), a=[0.0, 0.5], s=1)
    assert str(e.value).startswith("a = 0 is out of range (0, 1] (row 0); top_p's off value is 1")


@pytest.mark.parametrize("target", ["cpu", "portable"])
def test_a_bool_bias_is_an_error_naming_it(target):
    """A mask given for a bias (numpy or MLX, on the full path and after good calls) would add 1 where it is true:
    an error naming the parameter."""
    prog = samplec.compile("sampler s(b: bias, seed: seed) -> token { logit_bias(b) sample(seed) }", target=target)
    x = np.zeros((2, 8), np.float32)
    prog(mx.array(x), b=mx.array(np.zeros((2, 8), np.float32)), seed=[1, 2])
    for mask in (np.ones((2, 8), bool), mx.array(np.ones((2, 8), bool))):
        with pytest.raises(samplec.SamplecError, match="b: expected a float bias .* got bool"):
            prog(mx.array(x), b=mask, seed=[1, 2])
