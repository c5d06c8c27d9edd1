"""Multi-step decoding on the device: model forward (with its KV cache) + compiled sampler, `chunk` steps per sync.

`generate(model, program, prompt, max_tokens, chunk=k)` builds k decode steps as one lazy MLX graph: each step's
sampled token feeds the next forward pass without a round trip to the host; the host synchronizes once per chunk
(to read the chunk's tokens, look for end-of-sequence and check the program's run-time flags), while the next chunk
is already queued with `mx.async_eval`.

Position convention (the same in the mlx-lm adapter): the token at index `i` of the sequence (prompt length +
tokens generated before it) is sampled with `position = i`, and the token history the program sees is the whole
sequence before it (prompt + generated). A run is therefore reproducible from (prompt, seed) alone, and every
`chunk` gives exactly the tokens of `chunk=1` and of `samplec.integrations.mlx_lm.Sampler`. A program whose draw
has no position parameter (`sample(seed)` draws at position 0) is given the seed `step_seed(seed, i)` instead, so
that it too draws fresh noise at each step (spec section 4: a loop passes the position or advances the seed).

With `draft_model=` the loop decodes speculatively (`_generate_speculative`): the draft proposes tokens with the
program on its own logits at the target's seed, positions and history, the target scores them in one forward pass
and the program runs once over those positions; the emitted tokens are the ones plain decoding emits, whatever the
draft (spec section 7; docs/inference.md, Speculative decoding).

`ProgramFeed` is the small piece the loops share (and the mlx-lm adapter): it finds which program parameters a
decode loop drives (the seed, the position, the token history), checks the other parameters once, and calls the
program with `Program.queue` -- after the first step, its short path: the stages the values leave off removed, the
position a small array of its own, no host synchronization.
"""
from __future__ import annotations

import os
from typing import Sequence

import mlx.core as mx
import numpy as np

from samplec.diagnostics import SamplecError
from samplec.ir.graph import INPUT
from samplec.program import Outputs, Program

__all__ = ["generate", "ProgramFeed", "position_params", "draws_at_fixed_positions", "step_seed", "step_seeds",
           "pad_history", "HISTORY_BLOCK"]

HISTORY_BLOCK = 256      # the token history is left-padded with -1 to a multiple of this (fewer shapes to compile)
PREFILL_STEP = 2048      # prompt tokens per prefill forward pass (mlx-lm's default, for identical logits)


def _draw_positions(program: Program) -> list:
    """What each draw of the program (`sample`, `xtc`, their random bits) reads as its counter's position: the
    `int` parameter it comes from (through views and casts), or None (a literal)."""
    by_node = {id(p.node): p for p in program.params}
    at = {"random_bits": 2, "sample": 2, "xtc": 4}      # the operand that is the counter's position
    out = []
    for node in program.graph.toposort():
        if node.op not in at:
            continue
        src = node.inputs[at[node.op]]
        while src.op in ("expand", "cast", "broadcast", "reshape", "squeeze") and src.inputs:
            src = src.inputs[0]
        p = by_node.get(id(src)) if src.op == INPUT else None
        out.append(p if p is not None and p.kind == "int" else None)
    return out


def position_params(program: Program) -> list[str]:
    """Names of the `int` parameters that reach a random-bits counter (the `position` of `sample` / `xtc`)."""
    return list(dict.fromkeys(p.name for p in _draw_positions(program) if p is not None))


def draws_at_fixed_positions(program: Program) -> bool:
    """Whether a draw of the program reads a position that is no parameter (a literal: `sample(seed)` draws at
    position 0): a decode loop then advances the seed instead (`step_seed`)."""
    return None in _draw_positions(program)


def step_seed(seed: int, step: int) -> int:
    """The seed a decode loop draws with at `step` for a program that draws at fixed positions: splitmix64 of
    seed + golden * (step + 1) mod 2**64 -- every step a seed of its own, and seeds s and s + 1 give unrelated
    streams (not one stream shifted by a step). Spec section 4: a loop passes the position or advances the seed."""
    m = (1 << 64) - 1
    z = (int(seed) + 0x9E3779B97F4A7C15 * (int(step) + 1)) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def step_seeds(seeds, steps) -> np.ndarray:
    """`step_seed` of each (seed, step) pair: uint64 [B]."""
    return np.array([step_seed(seed, step) for seed, step in zip(seeds, steps)], dtype=np.uint64)


def pad_history(seq: mx.array, length: int) -> mx.array:
    """Left-pad int32 [B, length] with -1 (padding, ignored by `penalties`) to a multiple of HISTORY_BLOCK.

    The most recent tokens stay in the last columns, so `last_n` windows are unchanged.
    """
    cap = max(HISTORY_BLOCK, -(-length // HISTORY_BLOCK) * HISTORY_BLOCK)
    seq = seq.astype(mx.int32)
    if cap == length:
        return seq
    B = seq.shape[0]
    pad = _PADDING.get(B)
    if pad is None:     # (one evaluated block of -1 a batch size, sliced: no op of its own each step)
        if len(_PADDING) > 64:
            _PADDING.clear()
        pad = _PADDING[B] = mx.full((B, HISTORY_BLOCK), -1, dtype=mx.int32)
        mx.eval(pad)
    return mx.concatenate([pad[:, :cap - length], seq], axis=1)


_PADDING: dict[int, mx.array] = {}


# `tokens` parameters that get only the tokens generated so far (OpenAI's and vLLM's "output": what their presence and
# frequency penalties count) where a program has two histories; any other gets the prompt and the generated tokens
GENERATED = ("generated", "output")


class ProgramFeed:
    """Feeds one compiled program step after step: logits, position and history change, the rest is fixed.

    `seed` is given to the program's `seed` parameters (unless one is passed by name in `params`); the positions
    go to the `int` parameters that reach `sample`/`xtc` positions (`position_params`); the histories go to its
    `tokens` parameters: one takes the sequence (prompt and generated tokens; the generated ones alone with
    `prompt_in_history=False`), and a second one, named `generated` or `output` (vLLM's two histories: its
    repetition penalty reads the prompt and the output, its presence and frequency penalties the output), the
    generated tokens. Those driven parameters may not be passed in `params`.
    """

    def __init__(self, program: Program, seed: int | None, params: dict, prompt_in_history: bool = True):
        if not isinstance(program, Program):
            raise SamplecError(f"expected a samplec Program, got {type(program).__name__}")
        self.program = program
        names = [k for k, _ in program.graph.outputs]
        if "token" not in names:
            raise SamplecError(f"the sampler '{program.name}' has no 'token' output (it ends without a terminal); "
                               "a decode loop needs one")
        self.output_names = names
        self.token_index = names.index("token")
        kinds = {p.name: p.kind for p in program.params}
        self.position_names = position_params(program)
        hist = [p.name for p in program.params if p.kind == "tokens"]
        output = [n for n in hist if n in GENERATED]
        if len(hist) > 2 or len(hist) == 2 and len(output) != 1:
            raise SamplecError(f"the sampler '{program.name}' has {len(hist)} token-history parameters "
                               f"({', '.join(hist)}); a decode loop feeds one, or two where one of them is named "
                               f"{' or '.join(GENERATED)} (the generated tokens; the other: the whole sequence)")
        # the sequence's history, and the generated tokens' (its name; None where the program has one history)
        self.history_name = next((n for n in hist if n not in output), None) if len(hist) == 2 else \
            (hist[0] if hist else None)
        self.generated_name = output[0] if len(hist) == 2 else None
        self.prompt_in_history = prompt_in_history
        driven = [n for n in self.position_names + hist if n in params]
        if driven:
            raise SamplecError(f"parameter '{driven[0]}' is set by the decode loop (the position / token history "
                               "of the token being sampled); do not pass it")
        self.params = dict(params)
        if seed is not None:
            for name, kind in kinds.items():
                if kind == "seed" and name not in self.params:
                    self.params[name] = seed
        self._check_scalars(program)
        from samplec.program import SCALAR_NP, _as_mx
        self._kinds = kinds
        for p in program.params:     # (an array value converted once, not at every step)
            if p.kind not in SCALAR_NP and p.name in self.params and not isinstance(self.params[p.name], mx.array):
                self.params[p.name] = _as_mx(self.params[p.name], p.name)
        # a draw at a fixed position (`sample(seed)`) would take the same noise at every step: the loop advances
        # the seed instead, by the position (`step_seed`)
        # (a seed drawn from the OS is drawn once, for the loop's first step: advanced too)
        self.advanced_seeds = [p.name for p in program.params if p.kind == "seed"] \
            if draws_at_fixed_positions(program) else []
        self._drawn_seeds = [p for p in program.params if p.kind == "seed" and p.default == "os"]
        # state parameters (mirostat's mu): each step's updated value (the output of the same name) is the next
        # step's input; the first step gets the value passed in `params`, or the stage's start (NaN = start)
        states = [p.name for p in program.params if p.kind == "state"]
        lost = [n for n in states if n not in names]
        if lost:
            raise SamplecError(f"the sampler '{program.name}' has the state parameter '{lost[0]}' but no output "
                               f"'{lost[0]}': a decode loop carries a state from step to step through its output "
                               f"(add it: -> token, {lost[0]})")
        self.state_names = states
        self.state_outputs = [names.index(n) for n in states]
        self._drawn: dict[int, list[int]] = {}      # B -> the seeds drawn from the OS for B rows (once a loop)

    def _check_scalars(self, program: Program) -> None:
        """The scalar parameters' values checked now, as a call checks them (a missing one, NaN, out of range,
        not an integer): an error when the loop is set up, not at its first step after the prompt's prefill."""
        from samplec.program import SCALAR_NP, _scalar_param
        driven = set(self.position_names)
        for p in program.params:
            if p.kind not in SCALAR_NP or p.name in driven or p.kind == "state":
                continue
            value = self.params.get(p.name)
            if value is None:
                if p.default is None:
                    raise SamplecError(f"missing required parameter '{p.name}' ({p.kind})")
                continue
            rows = len(value) if isinstance(value, (list, tuple)) else \
                value.shape[0] if isinstance(value, (np.ndarray, mx.array)) and value.ndim == 1 else 1
            _scalar_param(p, value, max(rows, 1))

    def request_values(self, values: dict, who: str) -> dict:
        """One request's values of the program's scalar parameters (a seed, a temperature, ...), checked as a call
        checks them; an error names the parameter and `who`."""
        from samplec.program import SCALAR_NP, _scalar_param
        kinds = {p.name: p for p in self.program.params}
        out = {}
        for name, value in values.items():
            p = kinds.get(name)
            if p is None:
                raise SamplecError(f"{who}: unknown parameter '{name}' for the sampler '{self.program.name}' "
                                   f"(parameters: {', '.join(kinds) or 'none'})")
            if p.kind not in SCALAR_NP or p.kind == "state" or name in self.position_names:
                raise SamplecError(f"{who}: '{name}' ({p.kind}) is not a value a request gives (its scalar "
                                   "parameters are: " + ", ".join(q.name for q in self.program.params
                                                                  if q.kind in SCALAR_NP and q.kind != "state" and
                                                                  q.name not in self.position_names) + ")")
            try:
                _scalar_param(p, value, 1)
            except SamplecError as e:       # (one value: the call's "(row 0)" says nothing here)
                raise SamplecError(f"{who}: {str(e).replace(' (row 0)', '')}") from None
            out[name] = int(value) if p.kind in ("seed", "int") else float(value)
        return out

    def rows_values(self, keys: list, values: dict) -> dict | None:
        """The values given per request (`request_values`, by key) as one list a row for the rows' `keys`; a row
        without its own value takes the feed's (None: no row has one)."""
        names = sorted({n for k in keys for n in values.get(k, ())})
        if not names:
            return None
        defaults = {p.name: p.default for p in self.program.params}
        out = {}
        for n in names:
            base = self.params.get(n, defaults.get(n))
            col = []
            for k in keys:
                v = values.get(k, {}).get(n, base)
                if v is None or v == "os":
                    raise SamplecError(f"missing required parameter '{n}' for the row of request {k!r} (give it "
                                       "to the Sampler or to that request's logits_processors_for)")
                col.append(v)
            out[n] = col
        return out

    def check_arrays(self, set_by=()) -> None:
        """A required array parameter (a `mask`, a `bias`) not given is an error when the loop is set up, not at its
        first step after the prompt's prefill; `set_by`: the names the loop sets at each step (a grammar's mask)."""
        for p in self.program.params:
            if p.kind in ("mask", "bias") and p.default is None and self.params.get(p.name) is None and \
                    p.name not in set_by:
                raise SamplecError(f"missing required parameter '{p.name}' ({p.kind})")

    @property
    def needs_history(self) -> bool:
        return self.history_name is not None

    @property
    def needs_generated(self) -> bool:
        """Whether a call needs how many of each row's history tokens were generated (a history of generated
        tokens: the second history, or the one with `prompt_in_history=False`)."""
        return self.generated_name is not None or self.needs_history and not self.prompt_in_history

    def histories(self, history: mx.array, generated, last: int | None = None) -> dict[str, mx.array]:
        """The `tokens` parameters' values from the sequence's history [B, H] (prompt and generated tokens,
        left-padded with -1) and how many of each row's last tokens were generated (`generated`: an int, or one
        per row): the generated ones' history is the last of them, padded as `pad_history` pads. `last`: the
        sequence's history keeps its last `last` tokens only (the generated tokens' history is not cut)."""
        if last is not None and history.shape[1] > last:
            cut = pad_history(history[:, history.shape[1] - last:], last)
        else:
            cut = history
        if not self.needs_generated:
            return {self.history_name: cut}
        if generated is None:
            raise SamplecError("the decode loop did not say how many of the history's tokens were generated")
        B, H = history.shape
        counts = [min(int(g), H) for g in (generated if isinstance(generated, (list, tuple, range)) else
                                            [generated] * B)]
        W = max(counts, default=0)
        tail = history[:, H - W:]
        if any(c != W for c in counts):       # (rows generated different counts: the older tokens masked out)
            lo = mx.array(np.array([W - c for c in counts], dtype=np.int32))[:, None]
            tail = mx.where(mx.arange(W, dtype=mx.int32)[None] >= lo, tail, -1)
        gen = pad_history(tail, W)
        out = {self.history_name: cut if self.prompt_in_history else gen}
        if self.generated_name is not None:
            out[self.generated_name] = gen
        return out

    def check_history(self, tokens, V: int) -> None:
        """Host check (once, on the prompt) that the history holds no id >= V."""
        arr = np.asarray(tokens)
        if arr.size and (arr >= V).any():
            raise SamplecError(f"{self.history_name or 'prompt'}: token id {int(arr.max())} >= V = {V}")

    def next_state(self, outs: list[mx.array]) -> list[mx.array] | None:
        """The state values the next step takes (None when the sampler has no state)."""
        if not self.state_outputs:
            return None
        return [outs[o] for o in self.state_outputs]

    def state_starts(self, B: int) -> list[np.ndarray]:
        """Each state parameter's value for a row that starts: the value passed, else its default (NaN: the
        stage's start), float32 [B]."""
        defaults = {p.name: p.default for p in self.program.params}
        out = []
        for name in self.state_names:
            value = self.params.get(name, defaults[name])
            value = np.array(np.nan if value is None else value, dtype=np.float32).reshape(-1)
            out.append(np.broadcast_to(value, (B,)))
        return out

    def __call__(self, logits: mx.array, positions: Sequence[int], history: mx.array | None = None,
                 state: list[mx.array] | None = None, *, one_sequence: bool = False, generated=None,
                 last: int | None = None, rows: dict | None = None) \
            -> tuple[list[mx.array], list[tuple]]:
        """One lazy call (`Program.queue`: after a loop's first steps, its short path): logits [B, V], positions
        [B] (Python integers), history int32 [B, H] (the sequence's: prompt and generated tokens, already padded;
        or None), `generated`: how many of each row's history tokens were generated (where `needs_generated`),
        state: the previous step's `next_state` (None: the first step). `one_sequence`: the B rows are positions of
        one sequence (speculative verification), so a value given for one row holds on every row. `last`: the
        sequence's history keeps its last `last` tokens (`histories`). `rows`: values one per row over the feed's
        (`rows_values`). (outputs, checks: `Program.queue`'s, read with `first_fired`)."""
        if logits.ndim == 1:
            logits = logits[None]
        if logits.dtype != mx.float32:
            logits = logits.astype(mx.float32)
        B = logits.shape[0]
        call = dict(self.params) if not one_sequence else \
            {k: _one_row_on(v, B, self._kinds[k]) for k, v in self.params.items()}
        if rows:
            call.update(rows)
        for p in self._drawn_seeds:
            if p.name not in call:      # (drawn from the OS once: the loop's draws share it, as a seed passed)
                call[p.name] = self._drawn_for(1 if one_sequence else B) * (B if one_sequence else 1)
        if self.position_names or self.advanced_seeds:
            at = list(map(int, positions))
            for n in self.position_names:
                call[n] = at
            for n in self.advanced_seeds:
                call[n] = step_seeds(_seed_rows(call[n], B), at).tolist()
        if self.history_name is not None:
            if history is None:
                raise SamplecError(f"the sampler needs its token history '{self.history_name}'")
            call.update(self.histories(history, generated, last))
        if state is not None:
            call.update(zip(self.state_names, state))
        return self.program.queue(logits, **call)

    def _drawn_for(self, B: int) -> list[int]:
        got = self._drawn.get(B)
        if got is None:
            got = self._drawn[B] = [int(s) for s in np.frombuffer(os.urandom(8 * B), dtype=np.uint64)]
        return got

    def first_fired(self, checks: list[tuple], rows: int | None = None) -> tuple[str, int] | None:
        """(message, row) of the first check that fired in a call's `checks` (evaluated): the first row where one
        did (among the first `rows`), the program's first check there; None where none fired."""
        fired = self.program.fired(checks, rows)
        if not fired:
            return None
        row = min(int(np.flatnonzero(f)[0]) for _, f in fired)
        return next(m for m, f in fired if f[row]), row

    def outputs(self, outs: list[mx.array]) -> Outputs:
        return Outputs(dict(zip(self.output_names, outs)), self.program._layout)


def _seed_rows(seed, B: int) -> list[int]:
    """A seed parameter's value (a number, or one a row: a list, tuple, numpy or MLX array) as B Python integers
    (checked when the feed was made)."""
    if isinstance(seed, mx.array):
        seed = np.array(seed)
    rows = [int(v) for v in np.asarray(seed, dtype=object).reshape(-1)] \
        if isinstance(seed, (list, tuple, np.ndarray)) else [int(seed)]
    return rows * B if len(rows) == 1 else rows


def _one_row_on(value, B: int, kind: str):
    """A value given for one sequence, on B rows of it: one row's value (a number, a list or vector of one entry;
    a [V] or [1, V] array) on every row."""
    if isinstance(value, mx.array):         # (an array parameter's: made an MLX array with the feed)
        if kind in ("float", "int", "seed", "state"):
            return value if value.ndim == 0 else mx.broadcast_to(value.reshape(-1)[:1], (B,))
        return mx.broadcast_to(value.reshape(1, -1), (B, value.shape[-1]))
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return list(value) * B
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.shape[0] == 1:
        return np.repeat(value, B)
    return value


def _make_cache(model):
    if hasattr(model, "make_cache"):
        return model.make_cache()
    try:
        from mlx_lm.models.cache import make_prompt_cache
    except ImportError:  # pragma: no cover - mlx-lm is an optional dependency
        raise SamplecError("samplec.decode.generate needs mlx-lm for the model's KV cache "
                           "(pip install mlx-lm, or pip install -e '.[mlx-lm]' in a checkout)") from None
    return make_prompt_cache(model)


def _as_prompt(prompt) -> list[int]:
    if isinstance(prompt, mx.array):
        prompt = np.array(prompt)
    arr = np.asarray(prompt)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise SamplecError(f"prompt: expected a non-empty list of token ids, got shape {list(arr.shape)} "
                           f"of {arr.dtype}")
    if (arr < 0).any():
        raise SamplecError("prompt: negative token id")
    return arr.astype(np.int64).tolist()


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, (int, np.integer)):
        return {int(eos_token_id)}
    return {int(t) for t in eos_token_id}


def generate(model, program: Program, prompt, max_tokens: int, *, chunk: int = 1, seed: int = 0,
             eos_token_id=None, prompt_in_history: bool = True, draft_model=None, num_draft: int = 4,
             stats: dict | None = None, grammar=None, **params) -> list[int]:
    """Generate up to `max_tokens` tokens after `prompt`, `chunk` decode steps per host synchronization.

    `model` is an mlx-lm model (`model(tokens[None], cache=cache)` returns logits [1, L, V]); `program` is a
    compiled sampler with a `token` output. `seed` goes to the program's seed parameter(s); `params` are its other
    run-time parameters (its position and token-history parameters are driven by the loop). The token history is
    the prompt and the tokens generated so far; with `prompt_in_history=False` only the generated ones (OpenAI's
    presence/frequency penalties count those). The result is the generated tokens, ending with the first
    end-of-sequence token if one of `eos_token_id` (an id or a list) came.

    With a `draft_model` (an mlx-lm model over the same vocabulary) the loop decodes speculatively, `num_draft`
    proposals per target forward pass (see `_generate_speculative`); the tokens are the ones the program draws
    from the target's logits at each position, so they do not depend on the draft. When `stats` is a dict it
    receives `target_forwards`, `draft_forwards`, `draft_tokens` (proposed), `accepted_tokens` and `tokens`.

    With a `grammar` (a `samplec.structured.Grammar`: a JSON schema, regex or context-free grammar) each step's
    allowed tokens go to the program's one `mask` parameter (`allow(mask)`), one token per step (docs/serve.md).
    """
    if not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise SamplecError(f"chunk must be an integer >= 1, got {chunk!r}")
    if not isinstance(max_tokens, (int, np.integer)) or max_tokens < 0:
        raise SamplecError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
    if stats is not None and not isinstance(stats, dict):
        raise SamplecError(f"stats must be a dict (filled with the loop's counts) or None, got {type(stats).__name__}")
    if draft_model is not None and (not isinstance(num_draft, (int, np.integer)) or isinstance(num_draft, bool)
                                    or num_draft < 1):
        raise SamplecError(f"num_draft must be an integer >= 1, got {num_draft!r}")
    tokens = _as_prompt(prompt)
    if getattr(model, "samplec_vocab", None) is not None:   # an LM head split over ranks (samplec.distributed)
        if grammar is not None or draft_model is not None:
            raise SamplecError("a model whose LM head is split over ranks decodes without grammar= or draft_model=")
        from samplec.distributed.lm_head import generate_sharded
        return generate_sharded(model, program, tokens, max_tokens, seed=seed, eos=_eos_set(eos_token_id),
                                prompt_in_history=prompt_in_history, stats=stats, **params)
    if grammar is not None:
        if chunk != 1 or draft_model is not None:
            raise SamplecError("grammar= decodes one token per step (the next mask needs the token): "
                               "use chunk=1 and no draft_model")
        from samplec.structured import generate_constrained
        return generate_constrained(model, program, tokens, max_tokens, seed=seed, eos=_eos_set(eos_token_id),
                                    prompt_in_history=prompt_in_history, params=params, grammar=grammar)
    feed = ProgramFeed(program, seed, params, prompt_in_history)
    feed.check_arrays()
    eos = _eos_set(eos_token_id)
    counts = {"target_forwards": 0, "draft_forwards": 0, "draft_tokens": 0, "accepted_tokens": 0, "tokens": 0}
    if stats is not None:
        stats.update(counts)
    if max_tokens == 0:
        return []
    if draft_model is not None:
        return _generate_speculative(model, draft_model, feed, tokens, max_tokens, int(num_draft), eos, stats)

    seq = mx.array(tokens, dtype=mx.int32)
    cache, logits = prefill(model, seq)
    V = logits.shape[-1]
    feed.check_history(tokens, V)

    hist = seq[None]                   # the sequence so far, [1, n] lazy
    hist_len = hist.shape[1]
    length = len(tokens)
    y = None
    out: list[int] = []
    pending = None                     # the chunk in flight: its tokens, flags and first position
    state = None                       # the sampler's state (mirostat's mu) after the last step fed
    step = 0
    while True:
        launched = None
        if step < max_tokens:
            toks, flags = [], []
            first = length
            for _ in range(min(chunk, max_tokens - step)):
                if y is not None:
                    logits = model(y[None], cache=cache)[:, -1, :]
                history = pad_history(hist, hist_len) if feed.needs_history else None
                outs, checks = feed(logits, [length], history, state=state, generated=step)
                state = feed.next_state(outs)
                y = outs[feed.token_index].astype(mx.int32)
                if feed.needs_history:
                    hist = mx.concatenate([hist, y[None]], axis=1)
                    hist_len += 1
                length += 1
                step += 1
                toks.append(y)
                flags.append(checks)
            chunk_tokens = mx.concatenate(toks)
            mx.async_eval(chunk_tokens, *(f for checks in flags for _, f in checks))
            launched = (chunk_tokens, flags, first)
        if pending is not None:
            done, done_flags, first = pending
            for j, checks in enumerate(done_flags):
                fired = feed.first_fired(checks)
                if fired is not None:
                    raise SamplecError(f"{fired[0]} (at position {first + j})")
            for t in np.array(done).tolist():
                out.append(int(t))
                if t in eos:
                    return _counted(out, step, stats)
        if launched is None:
            return _counted(out, step, stats)
        pending = launched


def _counted(out: list[int], forwards: int, stats: dict | None) -> list[int]:
    """Plain decoding's counts: one target forward pass per token sampled (a chunk may sample past the end)."""
    if stats is not None:
        stats.update(target_forwards=forwards, tokens=len(out))
    return out


# ---- speculative decoding ----

def _check_trimmable(cache, which: str) -> None:
    bad = sorted({type(c).__name__ for c in cache if not (hasattr(c, "is_trimmable") and c.is_trimmable())})
    if bad:
        raise SamplecError(f"speculative decoding trims the {which} model's KV cache after each round, and its "
                           f"cache ({', '.join(bad)}) cannot be trimmed (a rotating cache that is full, a "
                           "quantized or recurrent one)")


def _trim(cache, n: int, which: str) -> None:
    if n > 0:
        _check_trimmable(cache, which)
        for c in cache:
            c.trim(n)


def prefill(model, seq: mx.array):
    """(a new KV cache, the last prompt token's logits [1, V]): prefilled exactly as mlx-lm's generate_step does
    (all but the last prompt token, in PREFILL_STEP pieces), so that the first logits -- and every later one -- are
    bit-identical to the mlx-lm adapter's."""
    cache = _make_cache(model)
    _prefill_all_but_last(model, cache, seq)
    return cache, model(seq[-1:][None], cache=cache)[:, -1, :]


def _prefill_all_but_last(model, cache, seq: mx.array) -> None:
    """Feed all but the last prompt token, PREFILL_STEP at a time (as the plain loop and mlx-lm do)."""
    while seq.shape[0] > 1:
        n = min(PREFILL_STEP, seq.shape[0] - 1)
        model(seq[:n][None], cache=cache)
        mx.eval([c.state for c in cache])
        seq = seq[n:]


def _row_histories(hist: mx.array, drafts: mx.array, rows: int) -> mx.array:
    """Histories of the verification rows: row j is `hist` + the first j draft tokens, left-padded with -1 to
    one width (int32 [rows, n + rows - 1])."""
    full = mx.concatenate([hist[0], drafts]) if drafts.size else hist[0]
    width = full.shape[0]
    idx = mx.arange(width)[None, :] - (rows - 1 - mx.arange(rows))[:, None]
    picked = full[mx.maximum(idx, 0)] if width else mx.zeros((rows, 0), dtype=mx.int32)
    return mx.where(idx >= 0, picked, -1).astype(mx.int32) if width else picked


def _generate_speculative(model, draft_model, feed: ProgramFeed, tokens: list[int], max_tokens: int, k: int,
                          eos: set[int], stats: dict | None) -> list[int]:
    """Speculative decoding whose tokens are plain decoding's (spec section 7).

    Each round: the draft model proposes up to `k` tokens, drawing each with the program on *its* logits at the
    position and with the history the target would have there (and the target's seed, so the two draws share
    their noise); the target scores the pending token and the proposals in one forward pass; the program runs on
    those k + 1 rows, row j at position `length + j` with the history extended by the first j proposals (one call
    over the rows; a program with a state parameter runs row after row, each row's state from the row before, all
    in the same lazy graph). Proposals are accepted while they equal the target's token at their position; the
    target's token at the first disagreement (or after the last proposal) is emitted too. Every emitted token is
    the program's draw from the target's logits with plain decoding's position, history and state, so the output
    does not depend on the draft. Both KV caches are trimmed back to the accepted path.
    """
    cache, dcache = _make_cache(model), _make_cache(draft_model)
    _check_trimmable(cache, "target")
    _check_trimmable(dcache, "draft")
    seq = mx.array(tokens, dtype=mx.int32)
    _prefill_all_but_last(model, cache, seq)
    _prefill_all_but_last(draft_model, dcache, seq)
    _check_trimmable(cache, "target")
    _check_trimmable(dcache, "draft")

    counts = {"target_forwards": 0, "draft_forwards": 0, "draft_tokens": 0, "accepted_tokens": 0, "tokens": 0}
    hist = seq[None]                  # the sequence before `length`
    length = len(tokens)              # the position of the next token
    pending = [tokens[-1]]            # the target's input next round (the last token, not yet in its cache)
    dpending = [tokens[-1]]           # the draft's input next round (one or two tokens)
    state = None                      # the program's state entering `length` (None: its start)
    checked_vocab = False
    out: list[int] = []
    while len(out) < max_tokens:
        kk = min(k, max_tokens - len(out) - 1)
        # the draft's proposals: the program on the draft's logits, coupled with the target's draws
        drafts, dstate, dhist, inp = [], state, hist, mx.array(dpending, dtype=mx.int32)
        for j in range(kk):
            dlogits = draft_model(inp[None], cache=dcache)[:, -1, :]
            history = pad_history(dhist, dhist.shape[1]) if feed.needs_history else None
            outs, _ = feed(dlogits, [length + j], history, state=dstate,     # (its checks: the draft's business)
                           generated=len(out) + j)
            dstate = feed.next_state(outs)
            inp = outs[feed.token_index].astype(mx.int32)
            drafts.append(inp)
            if feed.needs_history:
                dhist = mx.concatenate([dhist, inp[None]], axis=1)
        proposed = mx.concatenate(drafts) if drafts else mx.zeros((0,), dtype=mx.int32)
        # the target: one forward pass over the pending token and the proposals, the program on its k + 1 rows
        logits = model(mx.concatenate([mx.array(pending, dtype=mx.int32), proposed])[None], cache=cache)[0]
        if not checked_vocab:
            V = logits.shape[-1]
            if drafts and dlogits.shape[-1] != V:
                raise SamplecError(f"draft_model: its vocabulary has {dlogits.shape[-1]} entries, the target's "
                                   f"{V}; a draft must share the target's token ids")
            feed.check_history(tokens, V)
            checked_vocab = True
        rows = kk + 1
        histories = None
        if feed.needs_history:
            histories = pad_history(_row_histories(hist, proposed, rows), hist.shape[1] + kk)
        if not feed.state_names:
            outs, checks = feed(logits, range(length, length + rows), histories, one_sequence=True,
                                generated=[len(out) + j for j in range(rows)])
            picked = outs[feed.token_index].astype(mx.int32)
            states, per_row = None, [checks]
        else:
            picks, per_row, states, s = [], [], [], state
            for j in range(rows):
                o, checks = feed(logits[j:j + 1], [length + j],
                                 histories[j:j + 1] if histories is not None else None, state=s,
                                 generated=len(out) + j)
                s = feed.next_state(o)
                states.append(s)
                picks.append(o[feed.token_index].astype(mx.int32))
                per_row.append(checks)
            picked = mx.concatenate(picks)
        mx.eval(picked, proposed, *(f for checks in per_row for _, f in checks))
        counts["target_forwards"] += 1
        counts["draft_forwards"] += kk
        counts["draft_tokens"] += kk
        target, guess = picked.tolist(), proposed.tolist()
        m = 0
        while m < kk and target[m] == guess[m]:
            m += 1
        counts["accepted_tokens"] += m
        # (rows past m: not on the emitted path; one call over the rows, or one call a row)
        calls = [(0, per_row[0], m + 1)] if states is None else [(j, c, 1) for j, c in enumerate(per_row[:m + 1])]
        for j, checks, n in calls:
            fired = feed.first_fired(checks, n)
            if fired is not None:
                raise SamplecError(f"{fired[0]} (at position {length + j + fired[1]})")
        emitted = target[:m + 1]
        for t in emitted:
            out.append(t)
            if t in eos:
                return _done_speculative(out, counts, stats)
        # trim both caches back to the accepted path; the next round starts after the emitted tokens
        _trim(cache, kk - m, "target")
        if kk:
            c = min(m, kk - 1)                          # accepted proposals the draft itself has fed forward
            _trim(dcache, kk - 1 - c, "draft")
            dpending = target[c:m + 1]
        else:
            dpending = dpending + emitted
        pending = [target[m]]
        if states is not None:
            state = states[m]
        length += m + 1
        if feed.needs_history:
            hist = mx.concatenate([hist, mx.array([emitted], dtype=mx.int32)], axis=1)
    return _done_speculative(out, counts, stats)


def _done_speculative(out: list[int], counts: dict, stats: dict | None) -> list[int]:
    counts["tokens"] = len(out)
    if stats is not None:
        stats.update(counts)
    return out
