"""Optional native MLX primitives (the `samplec-native` package in native/): used on the CPU when installed.

MLX's CPU backend charges microseconds per primitive however small its input, so the ops of a -O2 plan that
expand into many MLX primitives cost more than their arithmetic. `samplec_native` implements them as single MLX
primitives (C++, built against the installed MLX) with exactly the same results; samplec uses them when the
package imports, the default device is the CPU and `SAMPLEC_NATIVE` is not `0` (or off/false/no). Everything works without it.

    pip install nanobind==3.1.0 && pip install --no-build-isolation ./native
"""
from __future__ import annotations

import os

import mlx.core as mx

from samplec import stage_table

try:
    import samplec_native as _native
except (ImportError, OSError):   # not built (or built against another MLX): the MLX-ops kernels serve
    _native = None


_OFF, _ON = ("0", "off", "false", "no"), ("1", "on", "true", "yes")
_unread: set = set()     # (variable, value) pairs already warned of


def switch(var: str, default: bool) -> bool:
    """The environment variable read as a switch: 1, on, true, yes or 0, off, false, no (any case); unset or empty,
    `default`. Any other value warns once, naming the words it takes, and reads as `default`."""
    raw = os.environ.get(var, "")
    value = raw.strip().lower()
    if value in _ON or value in _OFF:
        return value in _ON
    if value and (var, raw) not in _unread:
        _unread.add((var, raw))
        import warnings
        from samplec.diagnostics import SamplecWarning
        warnings.warn(f"{var}={raw!r} is not a switch value ({', '.join(_ON)} or {', '.join(_OFF)}): read as "
                      f"{'on' if default else 'off'}", SamplecWarning, stacklevel=2)
    return default


def switched_off(var: str) -> bool:
    """Whether the environment variable turns a feature off (on by default: `switch`)."""
    return not switch(var, True)


def enabled() -> bool:
    """Whether the native primitives serve the kernels traced now."""
    return _native is not None and not switched_off("SAMPLEC_NATIVE") and mx.default_device() == mx.cpu


def installed() -> bool:
    return _native is not None


def threefry_bits(seed: mx.array, c0: mx.array, c1: mx.array) -> mx.array | None:
    """RandomBits as one primitive, or None where the native path does not apply (the caller falls back). Each
    operand is [B, C] or [B] (read as [B, 1]); int32 counters are read as their uint32 bits."""
    if not (enabled() and all(a.ndim in (1, 2) for a in (seed, c0, c1))):
        return None
    c0, c1 = (c if c.dtype in (mx.uint32, mx.int32) else c.astype(mx.uint32) for c in (c0, c1))
    return _native.threefry_bits(seed.astype(mx.uint64), c0, c1)


SPIN_US = 300.0     # how long a wait polls before it blocks (a -O2 plan at B = 1 evaluates in ~0.1 ms)
HOLD_US = 300.0     # how long MLX's CPU worker is kept awake for a call's dispatch at most
_SPIN = (os.cpu_count() or 1) > 1 and not switched_off("SAMPLEC_SPIN")


def _polling() -> bool:
    return _native is not None and _SPIN and mx.default_device() == mx.cpu


def wake() -> None:
    """Wake MLX's CPU worker thread now and keep it polling (up to HOLD_US) until the next `evaluate` has
    dispatched its work: on a VM a sleeping thread takes ~10-30 us to wake, a fifth of a B = 1 call, and this way
    it wakes while the caller still prepares the call. The caller must not wait for the CPU stream in between
    (it would wait for the hold to time out)."""
    if _polling():
        _native.wake(HOLD_US)


def release() -> None:
    """End a `wake` hold now (a call that fails before its dispatch)."""
    if _native is not None:
        _native.release()


def evaluate(arrays: list[mx.array]) -> None:
    """mx.eval, but on the CPU with the native package the calling thread polls for the result (up to SPIN_US,
    then it sleeps as mx.eval does) instead of sleeping until MLX's worker thread wakes it, and a `wake` hold
    ends once the work is queued. Not on a single core (polling would hold the core the worker needs), nor with
    SAMPLEC_SPIN=0. While it polls, the calling thread also runs parts of the kernels' work (a batch's rows, a
    long row's spans) beside MLX's worker: the results are the same whoever runs which part (`helped`)."""
    if not _polling():
        mx.eval(arrays)
        return
    _native.evaluate(arrays, SPIN_US)


def helped() -> int:
    """How many parts of the native kernels' work a waiting caller has run in this process (0 without them)."""
    return int(_native.helped()) if _native is not None else 0


def _rows(*arrays, dtype=mx.float32) -> bool:
    return enabled() and all(a.ndim == 2 for a in arrays) and arrays[0].dtype == dtype


def block_max(x: mx.array, block_size: int) -> mx.array | None:
    return _native.block_max(x, block_size) if _rows(x) else None


def topk_select(x: mx.array, k: int, gathers=(), low: bool = False) -> tuple[mx.array, ...] | None:
    """(positions of the k largest ascending, the (k+1)-th largest, with `low` the smallest of the k (NaN if one
    is), then each of `gathers` at those positions): topk_positions, `kth_largest_static(k + 1)`, a
    reduce_min of the selected values and take_along users in one primitive."""
    if not (_rows(x) and 1 <= k <= x.shape[-1]):
        return None
    return tuple(_native.topk_select(x, k, list(gathers), low))


def argmax_take(x: mx.array, gathers=(), flat: bool = False) -> tuple[mx.array, ...] | None:
    """(argmax int32 [B, 1] -- MLX's: the first maximum, a NaN winning -- then each of `gathers` there, [B, 1] or
    with `flat` [B])."""
    return tuple(_native.argmax_take(x, list(gathers), flat)) if _rows(x) and x.shape[-1] >= 1 else None


def argmax_put(x: mx.array, ids: mx.array, vals: mx.array) -> mx.array | None:
    """argmax of put_along(x, ids, vals) ([B, 1] int32, MLX's argmax), without writing the [B, V] result."""
    if not (_rows(x) and ids.ndim == 2 and vals.ndim == 2 and hasattr(_native, "argmax_put")):
        return None
    B = x.shape[0]
    ids = mx.broadcast_to(ids.astype(mx.int32), (B, ids.shape[-1]))
    vals = mx.broadcast_to(vals.astype(mx.float32), (B, ids.shape[-1]))
    return _native.argmax_put(x, ids, vals)[0]


def dry_repeats(w: mx.array, x: mx.array) -> mx.array | None:
    """DRY's repeat lengths [B, V] int32 (the `dry_repeats` op) in O(H) per row, or None (the MLX ops' O(H^2))."""
    if not (enabled() and w.ndim == 2 and x.ndim == 2 and w.shape[0] == x.shape[0] and x.shape[-1] >= 1 and
            hasattr(_native, "dry_repeats")):
        return None
    return _native.dry_repeats(w.astype(mx.int32), x)


PREFIX = {"mask": stage_table.EDIT_CODES["allow"], "bias": stage_table.EDIT_CODES["logit_bias"]}   # the prefix ops' codes
MAX_PREFIX = 8          # prefix ops a chain kernel applies (native/src/prefix.h's kMaxPrefix); more are MLX ops


def _prefix_ok(kind: str, a: mx.array, x: mx.array) -> bool:
    """A prefix op's array as the kernels take it: a mask bool, a bias float32, [B, V] or [1, V] like x."""
    return a.dtype == (mx.bool_ if kind == "mask" else mx.float32) and a.ndim == 2 and \
        a.shape[-1] == x.shape[-1] and a.shape[0] in (1, x.shape[0])


def penalty_edits(x: mx.array, hist: mx.array, last_n: mx.array, repeat: mx.array, frequency: mx.array,
                  presence: mx.array, prior: tuple = (), pre: tuple = ()) -> tuple[mx.array, mx.array, mx.array] | None:
    """penalties(x, hist, last_n, repeat, frequency, presence) as its edits, in one primitive: (ids [B, H] int32,
    values [B, H] float32, overflow [B] bool) with put_along(x, ids, values) the stage's result and `overflow` its
    check (a penalized logit is +inf). The parameters are [B, 1], [B], [1] or scalars. `prior` (ids, values):
    earlier edits of x, read first (a penalty after a penalty) and put first in the result (ids and values are
    then [B, P + H]: every edit so far, in order). `pre`: sample_chain's prefix ops below the penalties, x read
    through them."""
    if not (_rows(x) and hist.ndim == 2 and hist.dtype == mx.int32 and hasattr(_native, "penalty_edits")):
        return None
    if not all(_prefix_ok(kind, a, x) for kind, a in pre):
        return None
    B = x.shape[0]
    if hist.shape[0] != B or any(p.size not in (1, B) for p in (last_n, repeat, frequency, presence)):
        return None
    if any(p.ndim > 2 or (p.ndim == 2 and p.shape[-1] != 1) for p in (last_n, repeat, frequency, presence)):
        return None
    col = lambda p, dt: p if p.dtype == dt else p.astype(dt)      # (the kernel reads [B], [1], scalars as columns)
    return tuple(_native.penalty_edits(x, hist, col(last_n, mx.int32), col(repeat, mx.float32),
                                       col(frequency, mx.float32), col(presence, mx.float32), list(prior),
                                       [PREFIX[kind] for kind, _ in pre], [a for _, a in pre]))


def edited_logsumexp(x: mx.array, ids: mx.array, vals: mx.array, idx: mx.array) -> tuple | None:
    """(log-prob at idx [B, 1] under put_along(x, ids, vals) -- a later write of an id wins --, the same under x,
    x's maximum [B, 1], its log-sum-exp [B, 1]: row_logsumexp's), from one exp pass over x."""
    if not (_rows(x) and ids.ndim == 2 and vals.ndim == 2 and idx.ndim == 2 and idx.shape[-1] == 1 and
            hasattr(_native, "edited_logsumexp")):
        return None
    B = x.shape[0]
    ids = mx.broadcast_to(ids.astype(mx.int32), (B, ids.shape[-1]))
    vals = mx.broadcast_to(vals.astype(mx.float32), (B, ids.shape[-1]))
    return tuple(_native.edited_logsumexp(x, ids, vals, mx.broadcast_to(idx.astype(mx.int32), (B, 1))))


def history_check(ids: mx.array, V: int) -> tuple[mx.array, mx.array] | None:
    """(ids int32 [B, H] with every id >= V read as padding -1, flag [B]: the rows that held one) in one
    primitive; None where it does not apply (the caller uses MLX ops)."""
    if not (enabled() and ids.ndim == 2 and ids.dtype == mx.int32 and hasattr(_native, "history_check")):
        return None
    return tuple(_native.history_check(ids, V))


def row_logsumexp(x: mx.array) -> mx.array | None:
    """[B, 2]: each row's maximum and log sum exp(x - maximum), in one vectorized pass."""
    if not (_rows(x) and x.shape[-1] >= 1 and hasattr(_native, "row_logsumexp")):
        return None
    return _native.row_logsumexp(x)[0]


def top_logprob_ids(x: mx.array, m: mx.array, lz: mx.array, k: int, margin: int) -> tuple | None:
    """(ids [B, k] int32, values [B, k]): the k largest log-probabilities (x - m) - lz (m, lz [B, 1]: the row's
    maximum and log-sum-exp), descending, the lower id first on ties; None where it does not apply."""
    if not (_rows(x, m, lz) and 1 <= k <= x.shape[-1] and hasattr(_native, "top_logprob_ids")):
        return None
    return tuple(_native.top_logprob_ids(x, m, lz, k, margin))


def row_max(x: mx.array) -> mx.array | None:
    """The maximum of each row, [B, 1] (a NaN wins, as in MLX), in one vectorized pass."""
    if not (_rows(x) and x.shape[-1] >= 1 and hasattr(_native, "row_max")):
        return None
    return _native.row_max(x)[0]


def row_softmax(x: mx.array) -> mx.array | None:
    """softmax along the rows (exp(x - max) / sum) in one vectorized exp pass; None where it does not apply."""
    if not (_rows(x) and x.shape[-1] >= 1 and hasattr(_native, "row_softmax")):
        return None
    return _native.row_softmax(x)[0]


# The chain kernel's codes and operand dtypes: the stage table's (samplec/stage_table.py; the C++ reads the same
# codes from the generated stage_table.h)
CHAIN_STAGES = dict(stage_table.STAGE_CODES)
_DTYPES = {"f32": mx.float32, "i32": mx.int32, "u32": mx.uint32, "u64": mx.uint64}
_PARAM_DTYPES = {s.name: [_DTYPES[o.type] for o in s.operands] for s in stage_table.STAGES}
CHAIN_TERMINALS = dict(stage_table.TERMINAL_CODES)


def knows_stages(stages) -> bool:
    """Whether the installed build's chain kernel has a code for each of these stage ops (epsilon and eta came
    after the first builds' 7 codes, dynamic_temperature and top_k_rank after those 9)."""
    return all(CHAIN_STAGES[s] < getattr(_native, "chain_stages", 7) for s in stages)


def sample_chain(x: mx.array, params: list[mx.array], stages: list[str], terminal: str, want_logprob: bool,
                 want_x: bool = False, want_probs: bool = False, edits: tuple = (),
                 want_top: bool = False, want_raw: bool = False, top_n: int = 0,
                 margin: int = 0, prefix: tuple = (), prefix_max: tuple = (),
                 n_pre: int = 0) -> tuple[mx.array, ...] | None:
    """A chain of stage ops ending in a draw, per row, in one primitive: (token position [B, 1], logprob of it
    under the chain's final distribution [B, 1], with `want_x` the final logits [B, V], with `want_probs` their
    softmax). `params`: each stage's operands after x ([B, 1], [B], [1] or scalars), then (sample) the seed and
    the position. `edits` (ids, values), [B, H] each: the chain runs on put_along(x, ids, values). `want_top`: two
    more outputs, MLX's argmax of x [B, 1] and x there [B, 1] (from the chain's own pass over x), then the logits
    checks' flags on that value: NaN or +inf, and -inf (every entry -inf), [B] bool each. `want_raw`: three
    more, x's maximum, its log-sum-exp (row_logsumexp's) and the token's log-probability under softmax(x), [B, 1].
    `top_n` > 0 (with want_raw): two more, top_logprob_ids(x, max, log-sum-exp, top_n, margin)'s ids and values,
    [B, top_n] each, found from the chain's block maxima of x. `prefix`: allow and logit_bias ops ("mask" or "bias",
    array: bool or f32, [B, V] or [1, V]) in order from x up, the first `n_pre` below the edits (which were then
    computed through them: penalty_edits' `pre`), the others above; the stages start from the result. One more
    output [B, 1] for each op with `prefix_max` true: its result's maximum."""
    if not (_rows(x) and x.shape[-1] >= 1 and hasattr(_native, "sample_chain")):
        return None     # (also a build of samplec-native older than the chain kernel)
    if not knows_stages(stages):
        return None     # (a build older than a stage's code: the stages run by their definitions)
    if top_n and not (want_raw and top_n <= x.shape[-1]):
        return None
    if len(prefix) > MAX_PREFIX or not all(_prefix_ok(kind, a, x) for kind, a in prefix):
        return None
    if edits:
        ids, vals = edits
        if not (ids.ndim == 2 and ids.shape == vals.shape and ids.shape[0] == x.shape[0] and
                ids.dtype == mx.int32 and vals.dtype == mx.float32):
            return None
    B = x.shape[0]
    dtypes = [dt for s in stages for dt in _PARAM_DTYPES[s]]
    if terminal == "sample":
        dtypes += [_DTYPES[o.type] for o in stage_table.stage("sample").operands]
    args = []
    for p, dt in zip(params, dtypes):      # (as they are: the kernel reads [B], [1] and scalars as columns)
        if not (p.ndim <= 2 and p.size in (1, B) and (p.ndim < 2 or p.shape[-1] == 1)):
            return None
        args.append(p if p.dtype == dt or (p.dtype == mx.int32 and dt == mx.uint32) else p.astype(dt))
    more = dict(top_n=top_n, margin=margin) if top_n else {}
    if prefix:
        more.update(prefix=[PREFIX[kind] for kind, _ in prefix], prefix_arrays=[a for _, a in prefix],
                    prefix_max=[bool(w) for w in prefix_max], n_pre=n_pre)
    return tuple(_native.sample_chain(x, args, [CHAIN_STAGES[s] for s in stages], CHAIN_TERMINALS[terminal],
                                      want_logprob, want_x, want_probs, list(edits), want_top, want_raw, **more))


__all__ = ["enabled", "installed", "knows_stages", "wake", "release", "evaluate", "helped", "threefry_bits", "block_max", "topk_select",
           "argmax_take", "sample_chain", "CHAIN_STAGES", "row_logsumexp", "row_max", "row_softmax", "argmax_put", "penalty_edits",
           "top_logprob_ids", "edited_logsumexp", "history_check", "dry_repeats"]
