"""samplec inside mlx-lm: a compiled sampler program as mlx-lm's `sampler=` (plus its `logits_processors=`).

    from mlx_lm import stream_generate
    from samplec.integrations.mlx_lm import Sampler

    sampler = Sampler(samplec.compile_file("examples/llama.smp"), seed=7, temperature=0.7)
    for r in stream_generate(model, tokenizer, prompt, max_tokens=64,
                             sampler=sampler, logits_processors=sampler.logits_processors):
        print(r.text, end="")
    sampler.check()                       # surface run-time check failures of the last steps
    lp = sampler.output("logprob")        # [steps, 1]: the program's outputs, step by step

One Sampler for the requests of mlx-lm's `BatchGenerator`: give each `logits_processors=
[sampler.logits_processors_for(key)]`; the steps go on across requests that join and leave, each recording its
rows' keys, and `sampler.output("logprob", row=key)` is one request's.

How it fits mlx-lm (mlx_lm/generate.py, `generate_step._step`): for each token, mlx-lm runs the model, calls every
logits processor as `proc(tokens, logits)` with the whole sequence so far (prompt + generated), then calls
`sampler(logprobs)` with `logprobs = logits - logsumexp(logits)`. The adapter's processor does not change the
logits: it records them, raw, together with the sequence. The sampler then runs the program on those raw logits
with `history` = the sequence and `position` = its length (the index of the token being sampled), and ignores the
log-probabilities mlx-lm hands it. So stages that are not shift-invariant (`penalties`: `x / repeat` for positive
logits, `x * repeat` for negative ones) see the model's logits as the language specifies, and the result is
bit-identical to `samplec.decode.generate` for the same seed. Put `sampler.logits_processors` last in the list:
what it records is what the program sees.

Without the processor, the sampler runs the program on mlx-lm's log-probabilities. That gives the same
distribution for shift-invariant programs (every stage but `penalties`), so it is allowed only for programs that
take neither a token history nor a position parameter.

A program that draws at a fixed position (`sample(seed)`: position 0) would take the same noise at every step; the
decode loops advance its seed instead (spec section 4), by the position with the processor and in
`samplec.decode.generate` (`decode.step_seed`), and by the sampler calls since the `Sampler` was made or `reset()`
without it (where mlx-lm hands no position).

Speculative decoding (mlx-lm's `stream_generate(..., draft_model=...)`): pass `**sampler.speculative(prompt_ids)`
instead of `sampler=` and `logits_processors=`. mlx-lm samples the draft's proposals and the target's rows through
this one sampler, so both draw with the program's noise at the same positions and the target's tokens are plain
decoding's; `speculative` supplies the prompt (mlx-lm's speculative loop hands its processors the sequence from
the prompt's last token on) and re-samples a position sampled before (state and steps follow the emitted path).
`speculative_request` does the same for one server request with a server's conventions (docs/inference.md).

`random_llama` and `local_tokenizer` build a small llama with random weights (fixed seed) and a byte-level BPE
tokenizer without downloading anything; tests, `examples/decode_loop.py` and `benchmarks/bench_decode.py` use them;
`noisy_copy` makes a draft that agrees with a model to a chosen degree (its weights plus noise).
"""
from __future__ import annotations

import functools
import hashlib
import warnings
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from samplec.decode import ProgramFeed, pad_history
from samplec.diagnostics import SamplecError
from samplec.program import Outputs, Program

__all__ = ["Sampler", "Step", "speculative_request", "random_llama", "local_tokenizer", "noisy_copy"]

_CHECK_LAG = 2   # a step's check flags are read two steps later, when mlx-lm has already synced on it
_STATE_CALLS = 8    # calls a row's carried state waits for the row (a row that joins takes a step of its own)
_MAX_CAPTURED = 1024    # the processor's records kept between two sampler calls (a batch's rows: one each)
_OWN_PROCESSORS = ("give a request inserted with another sampler its own logits processors "
                   "(BatchGenerator.insert(prompts, samplers=[other], logits_processors=[[]]), or that sampler's), "
                   "or give every request a Sampler of its own with its processors")


@dataclass(frozen=True)
class Step:
    """One sampler call: the position(s) of the token sampled (one per row; -1 when the adapter's logits processor
    was not installed), the program's outputs, and each row's request: the key its processors were made for
    (`Sampler.logits_processors_for(key)`), None for a row recorded by `Sampler.logits_processors`."""
    position: tuple[int, ...]
    outputs: Outputs
    rows: tuple = ()


class Sampler:
    """A compiled samplec program usable as mlx-lm's `sampler=`; pass `logits_processors=s.logits_processors`.

    `seed` goes to the program's `seed` parameter(s); `params` are its other run-time parameters. The program's
    position parameters (the `int` parameters used as `position =` of `sample`/`xtc`) and its `tokens`
    parameters are driven by the adapter: the history is the whole sequence before the token (prompt + generated),
    or only the generated tokens with `prompt_in_history=False`; a second history named `generated` or `output`
    gets the generated tokens (vLLM's chain). `steps` lists the program's outputs for every
    sampler call of the current generation (mlx-lm samples one token ahead, so there may be one more step than
    tokens it yielded); a new generation (one sequence at a position that follows none of the last step's) starts
    a new list. Under mlx-lm's BatchGenerator the list goes on across requests that join (their first step a call
    of its own) and leave; `logits_processors_for(key)` makes one request's steps readable by its key.
    """

    def __init__(self, program: Program, seed: int | None = 0, *, prompt_in_history: bool = True, grammar=None,
                 **params):
        self.program = program
        self.prompt_in_history = prompt_in_history
        self._prompt_len = 0
        self._feed = ProgramFeed(program, seed, params, prompt_in_history)
        # a samplec.structured.Grammar: its mask is the program's `mask` parameter at each call (docs/serve.md)
        self._grammar = None
        if grammar is not None:
            from samplec.structured import FeedGrammar
            self._grammar = FeedGrammar(program, grammar, params)
        self._feed.check_arrays(set_by=(self._grammar.name,) if self._grammar is not None else ())
        unknown = sorted(set(params) - {p.name for p in program.params})
        if unknown:      # (found here, when the adapter is built, not at mlx-lm's first step)
            names = ", ".join(p.name for p in program.params) or "none"
            raise SamplecError(f"unknown parameter '{unknown[0]}' for the sampler '{program.name}' "
                               f"(parameters: {names})")
        # the processor's records of this step not yet taken by a sampler call (sequence, logits, the request's
        # key): mlx-lm runs every row's processors, then the samplers (BatchGenerator: one call for the batch, or
        # one call per row, in row order, where the rows' samplers differ); a call takes the first B records left
        self._captured: list[tuple[mx.array, mx.array, object]] = []
        self._sampled = False       # whether the sampler was called since the processor's last record
        self._step_calls = 0        # the sampler's calls on this step's records so far
        self._warned = False
        # values given one per row (a list): the batch size they fix (`__call__` checks each call's)
        scalar = {p.name for p in program.params if p.kind in ("float", "int", "seed")}
        self._rows = {len(v) for k, v in [("seed", seed), *params.items()] if (k == "seed" or k in scalar) and
                      (isinstance(v, (list, tuple)) or isinstance(v, np.ndarray) and v.ndim == 1)}
        self._state: list[mx.array] | None = None     # the state outputs of the last step (mirostat's mu)
        self._one: tuple | None = None  # (sequence, state after) of the last call where it was one sequence
        # a state carried row by row: each call's (rows' sequences hashed, tokens, state), not yet read; and what
        # they left, by the sequence each row then has (its call's number and its state values)
        self._left: list[tuple] = []
        self._carried: dict[bytes, tuple[int, list]] = {}
        self._calls = 0
        self._blind_calls = 0       # sampler calls without the processor (see __call__)
        self._offset = 0            # tokens before the sequence mlx-lm hands the processor (`reset(offset=)`)
        # (flags, positions, step, the rows' request keys)
        self._unchecked: list[tuple[list[mx.array], tuple[int, ...], int, tuple]] = []
        self._step_no = 0           # the sampler's steps (a step sampled row by row is several calls)
        # whether a step since the generation's start sampled several rows (mlx-lm's BatchGenerator): a sequence
        # that follows none of the last step's is then a request joining the batch, never a new generation
        self._batched = False
        # a one-sequence generation's sequence that follows none of the last step's: the Step of that call, until
        # the next step says whether it starts a new generation (one row again: the steps before it go) or was a
        # request joining BatchGenerator's batch of one (two rows: nothing goes)
        self._restart: Step | None = None
        self._last_position: int | None = None
        self._last_positions: frozenset = frozenset()
        # the last call's sequence (one row, lazy: read only by `_resampled`, so that a step never waits for the
        # last step's token -- mlx-lm queues the next step while the last one runs)
        self._sequence: mx.array | None = None
        self._draft: _DraftRun | None = None          # set by `speculative(prompt)`
        self._history_last: int | None = None         # the history's last entries only (`speculative_request`)
        self.steps: list[Step] = []
        self.logits_processors = [self._capture]
        self._values: dict = {}     # a request's key -> its own values (`logits_processors_for`)

    def logits_processors_for(self, key, **values) -> list:
        """The adapter's processors for one request of a batch, the steps recording `key` for its row
        (`Step.rows`; `output(name, row=key)` stacks that request's outputs), and the request's own values of the
        program's scalar parameters (its seed, temperature, top_p, ...: a server's per-request values; the others
        are the Sampler's):

            g.insert([prompt], logits_processors=[sampler.logits_processors_for("req-1", seed=7, temp=0.8)])

        Each call then runs the program once for the batch with one value a row, whichever requests it holds. The
        same as `logits_processors` otherwise; the key is any hashable value (the same for the request's whole
        run, each running request its own). A request's first step never starts a new generation: the steps go on
        over the generator's whole run, requests one at a time too, until `reset()` or a new generation of rows
        without a key."""
        hash(key)
        if values:
            self._values[key] = self._feed.request_values(values, f"request {key!r}")
            if self._rows:
                raise SamplecError(f"request {key!r}: values one per request with a Sampler given values one per "
                                   "row: give the Sampler plain values and each request its own")
        else:
            self._values.pop(key, None)
        return [functools.partial(self._capture, key=key)]

    def release(self, key) -> None:
        """Forget a finished request's values (`logits_processors_for(key, ...)`): a long-running generator's
        requests are many, and mlx-lm does not tell the sampler when one ends (its response's `finish_reason`
        tells the caller)."""
        self._values.pop(key, None)

    def speculative(self, prompt, *, first_position: int | None = None) -> dict:
        """Arm the sampler for one run of mlx-lm's speculative decoding; returns the keyword arguments to give it:

            for r in stream_generate(model, tokenizer, prompt_ids, draft_model=draft, num_draft_tokens=3,
                                     **sampler.speculative(prompt_ids)):

        mlx-lm's `speculative_generate_step` samples the draft's proposals and then each of the target's k + 1
        rows through this one sampler, so the draft's draws and the target's share the program's noise (same seed
        and positions); the target's token at each position is then the one plain decoding draws from its
        logits. Two things its loop does not give a sampler, and this method supplies: the prompt (the
        sequence it hands the logits processors starts at the prompt's last token) and which call is which (a
        call at a position already sampled re-samples it: the state -- mirostat's `mu` -- entering a position
        is the one left by the latest call at the position before, `steps` and the pending check flags from that
        position on are dropped). `prompt` is the token ids given to mlx-lm (with a prompt cache: the whole
        sequence the cache and the new tokens hold); `first_position` is the position of the first generated
        token (default: `len(prompt)`, the convention of samplec's decode loop). One sequence (batch size 1).
        """
        ids = np.asarray(np.array(prompt) if isinstance(prompt, mx.array) else prompt)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer) or (ids < 0).any():
            raise SamplecError("speculative(prompt): expected a non-empty list of token ids (tokenize text first)")
        first = len(ids) if first_position is None else first_position
        if not isinstance(first, (int, np.integer)) or first < 0:
            raise SamplecError(f"speculative: first_position must be an integer >= 0, got {first_position!r}")
        self.reset()
        self._draft = _DraftRun(mx.array(ids[:-1].astype(np.int32)), int(first), ids)
        self._prompt_len = int(first)
        return {"sampler": self, "logits_processors": self.logits_processors}

    # ---- the logits processor: record the raw logits and the sequence ----
    def _capture(self, tokens: mx.array, logits: mx.array, key=None) -> mx.array:
        if self._sampled:       # a new step: the last one's records were all taken, one per row sampled
            self._sampled, self._step_calls = False, 0
            if self._captured:
                n, self._captured = len(self._captured), []
                raise SamplecError(f"the adapter's logits processor ran on {n} row(s) that this Sampler did not "
                                   "sample (mlx-lm's BatchGenerator gives a request inserted with samplers= but "
                                   "without logits_processors= the default processors): " + _OWN_PROCESSORS)
        if len(self._captured) >= _MAX_CAPTURED:     # (the processor without its sampler: the oldest go)
            if not self._warned:
                self._warned = True
                warnings.warn("samplec: the adapter's logits processor runs without its sampler (pass "
                              "sampler=sampler with logits_processors=sampler.logits_processors); it keeps only "
                              f"its last {_MAX_CAPTURED} records", stacklevel=2)
            del self._captured[:len(self._captured) - _MAX_CAPTURED + 1]
        self._captured.append((tokens, logits, key))
        return logits

    # ---- the sampler ----
    def __call__(self, logprobs: mx.array) -> mx.array:
        if logprobs.ndim != 2:
            raise SamplecError(f"the sampler takes mlx-lm's log-probabilities [B, V], got shape "
                               f"{list(logprobs.shape)}")
        B, V = logprobs.shape
        if self._rows and B not in self._rows:
            raise SamplecError(f"this Sampler was given values one per row for a batch of {min(self._rows)} rows, "
                               f"but mlx-lm called it with {B} (BatchGenerator drops finished requests and adds "
                               "new ones): give each request a Sampler of its own with plain values "
                               "(BatchGenerator.insert(prompts, samplers=[...], logits_processors=[...]))")
        # (this call's rows are the step's first B records left: BatchGenerator samples row by row, in row order,
        # where its rows' samplers differ; a call that leaves records, or follows one, is one row of such a step)
        captured, self._captured = self._captured[:B], self._captured[B:]
        row_by_row = bool(captured) and bool(self._step_calls or self._captured)
        self._sampled, self._step_calls = True, self._step_calls + 1
        self._step_no += not captured or self._step_calls == 1
        if self._draft is not None and captured and not self._on_draft_path(captured):
            self._draft = None      # (a plain generation after the speculative run: its sequence has the prompt)
        rows_tokens = None
        if captured:
            logits, positions, history, rows_tokens = self._from_captured(captured, B, V)
        else:
            if self._feed.needs_history or self._feed.position_names:
                needs = [*self._feed.position_names, *([self._feed.history_name] if self._feed.needs_history else [])]
                raise SamplecError(f"the sampler '{self.program.name}' needs the token history / position "
                                   f"({', '.join(needs)}): pass logits_processors=sampler.logits_processors "
                                   "to mlx-lm together with sampler=sampler (BatchGenerator.insert: "
                                   "logits_processors=[sampler.logits_processors] for each request it samples)")
            logits, positions, history = logprobs, (-1,) * B, None     # positions unknown (and unused)
        starting = False        # (a one-sequence start the next step settles: this call's Step becomes `_restart`)
        if self._draft is not None:
            self._rewind(captured, positions)
        elif captured and B == 1 and not row_by_row and positions[0] - 1 not in self._last_positions:
            self._resampled(rows_tokens[0], positions[0])
            starting = self._start(captured)
            self._prompt_len = positions[0]
        elif captured:
            self._batched |= B > 1 or row_by_row
            if self._restart is not None and self._step_calls == 1:      # (the step after the start)
                self._settle()
        one = B == 1 and not row_by_row         # (one sequence)
        self._last_position = positions[0] if one else None
        # (a batch that shrinks to one row -- BatchGenerator's other requests finished -- goes on: its position
        # follows one of the last step's)
        if not captured:
            self._last_positions = frozenset()
        elif self._step_calls == 1:
            self._last_positions = frozenset(positions)
        else:
            self._last_positions |= frozenset(positions)
        self._sequence = rows_tokens[0] if captured and one else None
        generated = None
        if history is not None and self._feed.needs_generated:
            if not one:
                which = f"the '{self._feed.generated_name}' history" if self._feed.generated_name else \
                    f"'{self._feed.history_name}' with prompt_in_history=False"
                raise SamplecError(f"the sampler '{self.program.name}' reads the generated tokens alone ({which}), "
                                   "which needs one sequence per Sampler: mlx-lm's batch does not say where each "
                                   "row's prompt ends; give each request a Sampler of its own "
                                   "(BatchGenerator.insert(prompts, samplers=[...], logits_processors=[...]))")
            generated = positions[0] - self._prompt_len
        # (a state carried row by row -- mlx-lm's BatchGenerator joins and drops rows between steps -- each row
        # finds the state its own previous step left by its sequence; a speculative run keeps its own by position)
        by_row = bool(self._feed.state_names) and self._draft is None and rows_tokens is not None
        # (one sequence one token longer than the last call's, which was one sequence too: the state the last call
        # left, where the sequence is that one and the token it drew -- compared on the device: the token is still
        # being computed, which hashing the sequence would wait for -- else the start)
        follows = by_row and one and self._one is not None and \
            rows_tokens[0].shape[0] == self._one[0].shape[0] + 1
        if follows:
            seq, drawn, state = self._one
            same = mx.logical_and(mx.array_equal(rows_tokens[0][:seq.shape[0]], seq),
                                  mx.all(rows_tokens[0][-1:] == drawn.reshape(-1)))
            self._state = [mx.where(same, v, mx.array(start.reshape(v.shape)))
                           for v, start in zip(state, self._feed.state_starts(1))]
            rows = rows_tokens
        elif by_row:
            rows = [hashlib.blake2b(np.array(t).astype(np.int64).tobytes(), digest_size=16) for t in rows_tokens]
            self._state = self._rows_state(rows, B, V, new_step=self._step_calls == 1)
        elif self._state is not None and self._state[0].shape[0] != B:
            self._state = None          # (another batch: its rows start afresh)
        if self._grammar is not None:
            self._grammar.before(self._feed, B, V)
        # (without the processor the positions are unknown: a program that draws at fixed positions advances its
        # seed by the calls since the Sampler was made or reset -- fresh noise each step, `decode.step_seed`)
        at = [max(p, 0) for p in positions] if captured else [self._blind_calls] * B
        self._blind_calls += not captured
        per_request = self._feed.rows_values([c[2] for c in captured], self._values) \
            if captured and self._values else None
        outs, flags = self._feed(logits, at, history, state=self._state, generated=generated,
                                 last=self._history_last, rows=per_request)
        if self._grammar is not None:
            self._grammar.after(outs[self._feed.token_index])
        self._state = self._feed.next_state(outs)       # a state output (mirostat's mu) feeds the next step
        if by_row:
            # (a row's sequences as they are, or hashed where this call hashed them: `_rows_state` reads a row's
            # entry when a later call needs it, by then long evaluated; a run of one sequence keeps its last few)
            self._left = self._left[-_STATE_CALLS:] + [(rows, outs[self._feed.token_index], self._state)]
        self._one = (rows_tokens[0], outs[self._feed.token_index], self._state) if by_row and one else None
        if self._draft is not None:
            self._draft.drawn.setdefault(positions[0], []).append(outs[self._feed.token_index])
            if self._state is not None:
                self._draft.states[positions[0]] = self._state
        # materialize every output with the token: a kept step then holds small arrays, not a graph over [B, V]
        mx.async_eval(*outs, *[f for _, f in flags])
        keys = tuple(c[2] for c in captured) if captured else (None,) * B
        self._unchecked.append((flags, positions, self._step_no, keys))
        self.steps.append(Step(positions, self._feed.outputs(outs), keys))
        if starting:
            self._restart = self.steps[-1]
        while self._draft is None and self._unchecked and self._unchecked[0][2] <= self._step_no - _CHECK_LAG:
            self._check_one(self._unchecked.pop(0))
        return outs[self._feed.token_index]

    def _resampled(self, tokens: mx.array, p: int) -> None:
        """A call at a position of the current generation after its first, along its sequence: mlx-lm's speculative
        loop re-sampling what the draft sampled (plain decoding never goes back), here without `speculative()`,
        whose positions and history would be wrong: an error that says what to pass instead."""
        seq = self._sequence
        if seq is None or self._last_position is None or not self._prompt_len < p <= self._last_position:
            return
        now, seq = np.array(tokens).reshape(-1), np.array(seq).reshape(-1)
        if now.size == p - self._offset and seq.size >= now.size - 1 and \
                np.array_equal(now[:-1], seq[:now.size - 1]):
            raise SamplecError("the sampler was called again at a position it sampled, along the same sequence: "
                               "mlx-lm's speculative decoding (draft_model=) needs **sampler.speculative(prompt) "
                               "in place of sampler= and logits_processors= (a new generation from part of the "
                               "last one's sequence: call sampler.reset() before it)")

    def _rows_state(self, rows: list, B: int, V: int, new_step: bool = True) -> list[mx.array] | None:
        """The state entering each row of this call: what an earlier call left to the row whose sequence then,
        with the token it drew, is this row's (`rows`: each row's sequence hashed; a row that joins a batch takes
        its first step in a call of its own); a row new to the batch starts where a first step does (the value
        passed as a parameter, else the stage's start). None: every row starts."""
        for before, token, state in self._left:
            drawn = np.array(token).reshape(-1).astype(np.int64)
            values = [np.array(v).reshape(-1) for v in state]
            for i, h in enumerate(before):
                h = h.copy() if not isinstance(h, mx.array) else \
                    hashlib.blake2b(np.array(h).astype(np.int64).tobytes(), digest_size=16)
                h.update(drawn[i:i + 1].tobytes())
                self._carried[h.digest()] = (self._calls, [v[i] for v in values])
        self._left = []
        self._calls += new_step       # (steps: a step sampled row by row is several calls)
        found = [self._carried.pop(h.digest(), (0, None))[1] for h in rows]
        # (a row that left the batch: its state is dropped a few calls later)
        self._carried = {k: v for k, v in self._carried.items() if self._calls - v[0] <= _STATE_CALLS}
        if all(f is None for f in found):
            return None
        out = []
        for j, start in enumerate(self._feed.state_starts(B)):
            out.append(mx.array(np.array([start[r] if f is None else f[j] for r, f in enumerate(found)],
                                         dtype=np.float32)))
        return out

    def _on_draft_path(self, captured) -> bool:
        """Whether this call belongs to the armed speculative run: mlx-lm's speculative loop hands the sequence
        from the prompt's last token on, along the tokens emitted so far (the latest call's token at each
        position). A sequence of one other token is another run's start (an error: it needs its own
        `speculative(prompt)`); any other sequence is a plain generation's (the run is over)."""
        run = self._draft
        seen = np.array(captured[0][0]).reshape(-1)
        if seen.size == 0:
            return True
        # (after the prompt's last token, each token is one a call of this run drew at its position: an emitted
        # one, or a proposal the target's rows read after it)
        path = int(seen[0]) == int(run.prompt[-1]) and all(
            int(t) in run.drawn_at(run.first + j) for j, t in enumerate(seen[1:]))
        if not path and seen.size == 1:
            raise SamplecError(f"the sampler was armed by speculative() for a prompt ending in token "
                               f"{int(run.prompt[-1])}, but mlx-lm's sequence starts at token {int(seen[0])}: call "
                               "sampler.speculative(prompt) with this generation's prompt")
        return path

    def _rewind(self, captured, positions) -> None:
        """Speculative decoding: place a call at its position (see `speculative`)."""
        run = self._draft
        if not captured:
            raise SamplecError("speculative decoding with the adapter needs logits_processors="
                               "sampler.logits_processors (pass **sampler.speculative(prompt) to mlx-lm)")
        if len(positions) != 1:
            raise SamplecError("speculative decoding with the adapter samples one sequence (batch size 1)")
        p = positions[0]
        if not run.first <= p <= run.first + len(self.steps):
            raise SamplecError(f"the sampler was armed by speculative() for a prompt of {len(run.prompt)} tokens "
                               f"(first position {run.first}) but was called at position {p}: call "
                               "sampler.speculative(prompt) with this generation's prompt")
        if p < run.first + len(self.steps):            # a position sampled before: its calls from p on are void
            del self.steps[p - run.first:]
            pending, self._unchecked = self._unchecked, []
            for entry in pending:                        # (positions before p are on the emitted path now)
                if entry[1][0] < p:
                    self._check_one(entry)
            run.states = {q: v for q, v in run.states.items() if p - 1 <= q < p}
        elif p == run.first and not self.steps:      # the first call: mlx-lm's sequence is the prompt's last token
            seen = np.array(captured[0][0]).reshape(-1)
            if seen.size != 1 or int(seen[0]) != int(run.prompt[-1]):
                raise SamplecError(f"the sampler was armed by speculative() for a prompt ending in token "
                                   f"{int(run.prompt[-1])}, but mlx-lm's prompt ends in {seen[-1:].tolist()}: call "
                                   "sampler.speculative(prompt) with this generation's prompt")
            if self._feed.needs_history:
                self._feed.check_history(run.prompt, captured[0][1].shape[-1])
        self._state = run.states.get(p - 1)              # None before the first position: the stage's start

    def _from_captured(self, captured, B: int, V: int):
        if B == 1 and len(captured) == 1 and self._draft is None:     # (mlx-lm's generate_step: one sequence)
            tokens, logits, _ = captured[0]
            if tokens.ndim == 1 and logits.shape == (1, V):
                n = tokens.shape[0]
                history = pad_history(tokens[None], n) if self._feed.needs_history else None
                return logits, (n + self._offset,), history, [tokens]
        rows_logits, rows_tokens = [], []
        for tokens, logits, _ in captured:
            logits = logits if logits.ndim == 2 else logits[None]
            if self._draft is not None:     # (mlx-lm's speculative loop hands the sequence from the prompt's end)
                tokens = mx.concatenate([self._draft.prefix, tokens.reshape(-1).astype(mx.int32)])
            rows_logits.append(logits)
            if tokens.ndim == 1 and logits.shape[0] == 1:       # (mlx-lm's generate_step: one sequence)
                rows_tokens.append(tokens)
                continue
            tokens = tokens if tokens.ndim == 2 else tokens[None]
            if tokens.shape[0] != logits.shape[0]:
                tokens = mx.broadcast_to(tokens, (logits.shape[0], tokens.shape[1]))
            rows_tokens.extend(tokens[i] for i in range(tokens.shape[0]))
        logits = rows_logits[0] if len(rows_logits) == 1 else mx.concatenate(rows_logits, axis=0)
        if logits.shape != (B, V):
            raise SamplecError(f"the adapter's logits processor saw logits of shape {list(logits.shape)} but the "
                               f"sampler was called with [{B}, {V}]; was sampler.logits_processors passed to "
                               "this generation only?")
        shift = self._offset if self._draft is None else self._draft.first - len(self._draft.prompt)
        positions = tuple(int(t.shape[0]) + shift for t in rows_tokens)
        history = None
        if self._feed.needs_history and len(rows_tokens) == 1:     # (one sequence: its row as it is)
            history = pad_history(rows_tokens[0][None], rows_tokens[0].shape[0])
        elif self._feed.needs_history:
            width = max(positions)
            rows = [mx.concatenate([mx.full((width - p,), -1, dtype=mx.int32), t.astype(mx.int32)])
                    if p < width else t.astype(mx.int32) for t, p in zip(rows_tokens, positions)]
            history = pad_history(mx.stack(rows), width)
        return logits, positions, history, rows_tokens

    def _start(self, captured) -> bool:
        """A call of one sequence that follows none of the last step's: a new generation, or a request joining
        mlx-lm's BatchGenerator mid-run (its first step is a call of its own, after the batch's). A join keeps
        everything: the steps and the check flags still to read are the running rows' (the flags are read at their
        usual lag: the running rows' last step may still be queued). Once a step has sampled several rows, or for
        a row recorded with a key (`logits_processors_for`: a request of a batch), it is a join; before, the next
        step tells (`_settle`): True."""
        for tokens, logits, _ in captured if self._feed.needs_history else ():   # (the sequence is the prompt)
            self._feed.check_history(np.array(tokens), logits.shape[-1])
        if self._batched or captured[0][2] is not None:
            return False
        self._state = None
        if self._grammar is not None:
            self._grammar.restart()
        return True

    def _settle(self) -> None:
        """The step after a one-sequence start: several rows (a request joined a batch of one) keep every step;
        one row (a new generation) drops the steps before the start's."""
        start, self._restart = self._restart, None
        if self._batched:
            return
        at = next((i for i in range(len(self.steps) - 1, -1, -1) if self.steps[i] is start), 0)
        del self.steps[:at]

    def _check_one(self, entry) -> None:
        checks, positions, _, keys = entry
        fired = self._feed.first_fired(checks)
        if fired is not None:
            message, row = fired
            where = f"at position {positions[row]}" if len(positions) == 1 else \
                f"at position {positions[row]} (row {row} of {len(positions)})"
            if keys[row] is not None:
                where += f" of request {keys[row]!r}"
            raise SamplecError(f"{message} ({where})")

    # ---- results ----
    def check(self) -> None:
        """Read the run-time check flags not yet read (the last steps') and raise the first that fired."""
        pending, self._unchecked = self._unchecked, []
        for entry in pending:
            self._check_one(entry)

    @property
    def last(self) -> Outputs:
        if not self.steps:
            raise SamplecError("the sampler has not been called yet")
        return self.steps[-1].outputs

    def output(self, name: str, ids: bool = False, *, row=None) -> mx.array:
        """One output stacked over the steps: [steps, B] (or [steps, B, n] for top_logprobs / candidates,
        their values, or their ids with `ids=True`). `row=key`: one request's, over the steps that sampled it
        (its processors made by `logits_processors_for(key)`): [steps] (or [steps, n])."""
        self.check()
        if not self.steps:
            raise SamplecError("the sampler has not been called yet")
        steps = self.steps if row is None else [s for s in self.steps if row in s.rows]
        if not steps:
            raise SamplecError(f"output('{name}', row={row!r}): no step sampled that request (pass "
                               f"logits_processors=[sampler.logits_processors_for({row!r})] for it)")
        vals = [getattr(s.outputs, name) for s in steps]
        if hasattr(vals[0], "ids"):
            vals = [v.ids if ids else v.values for v in vals]
        if row is not None:
            return mx.stack([v[s.rows.index(row)] for v, s in zip(vals, steps)])
        sizes = sorted({v.shape[0] for v in vals})
        if len(sizes) > 1:
            raise SamplecError(f"output('{name}'): the steps have batches of {sizes} rows (mlx-lm's BatchGenerator "
                               "changed the batch): give each request logits_processors_for(key) and read "
                               "output(name, row=key), or read each step's outputs, positions and rows")
        return mx.stack(vals)

    def reset(self, offset: int = 0) -> None:
        """Forget the current generation (its steps and unread flags). `offset`: how many tokens come before the
        sequence mlx-lm will hand the processor -- a multi-turn chat over one `prompt_cache` hands only each turn's
        new tokens, so give the tokens the cache held before the turn: positions then count them (the index of the
        token in the whole conversation, as `samplec.decode.generate` on the whole sequence numbers it), and the
        turn draws fresh noise. The history is still the sequence mlx-lm hands (the turn's tokens)."""
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
            raise SamplecError(f"reset: offset must be an integer >= 0, got {offset!r}")
        self._captured, self._unchecked, self.steps, self._last_position = [], [], [], None
        self._sampled, self._step_calls = False, 0
        self._batched, self._restart = False, None
        self._sequence, self._last_positions = None, frozenset()
        self._blind_calls, self._offset = 0, int(offset)
        self._state, self._left, self._carried, self._one = None, [], {}, None
        self._draft = None
        if self._grammar is not None:
            self._grammar.restart()


@dataclass
class _DraftRun:
    """What `Sampler.speculative` knows of one speculative run: the prompt but its last token (mlx-lm's sequence
    starts there), the first generated position, and the state left by the latest call at each position."""
    prefix: mx.array
    first: int
    prompt: np.ndarray
    states: dict = None
    drawn: dict = None      # position -> the tokens the run's calls drew there (lazy [1] arrays)
    read: dict = None       # position -> (how many of them are read, the set of those tokens)

    def __post_init__(self):
        self.states, self.drawn, self.read = {}, {}, {}

    def drawn_at(self, position: int) -> set[int]:
        """The tokens the run's calls drew at `position` (each read once)."""
        arrays = self.drawn.get(position, ())
        n, tokens = self.read.get(position, (0, set()))
        if n < len(arrays):
            tokens |= {int(np.array(a).reshape(-1)[0]) for a in arrays[n:]}
            self.read[position] = (len(arrays), tokens)
        return tokens


def speculative_request(program: Program, prompt, seed: int, *, params: dict | None = None,
                        logit_bias: dict | None = None, context: int = -1, first_position: int = 0) -> dict:
    """One server request decoded speculatively by mlx-lm (`stream_generate(..., draft_model=...)`, the path
    mlx_lm.server takes when it has a draft model): the keyword arguments `sampler` and `logits_processors` to
    pass it, the request's draws coupled between draft and target (see `Sampler.speculative`).

    `prompt` is the request's whole token sequence before the first generated token (the cached part and the
    part mlx-lm still prefills), `seed` the request's seed, `params` the program's other parameters by name;
    `logit_bias` ({id: bias}) is added to the raw logits before the program sees them (ids >= V are ignored);
    `context` keeps only the last `context` tokens of the sequence's history (-1: all; a history of the generated
    tokens is not cut); `first_position` is the position of
    the first generated token (0: a server's count of the tokens generated; `len(prompt)`: samplec's decode
    loop). `result["sampler"].steps[i].outputs` holds the program's outputs for the i-th generated token (its
    `logprob`, ...). The tokens are those the same program draws for the request without a draft model.
    """
    sampler = Sampler(program, seed=seed, **(params or {}))
    if context is not None and context >= 0:
        sampler._history_last = int(context)
    kw = sampler.speculative(prompt, first_position=first_position)
    if logit_bias:
        bias = {int(i): float(b) for i, b in logit_bias.items()}

        def add_bias(tokens: mx.array, logits: mx.array) -> mx.array:
            ids = [i for i in bias if 0 <= i < logits.shape[-1]]
            if not ids:
                return logits
            return logits.at[..., mx.array(ids)].add(mx.array([bias[i] for i in ids], mx.float32))
        kw["logits_processors"] = [add_bias, *kw["logits_processors"]]
    return kw


# ---- a small random llama and a local tokenizer (no downloads) ----

def random_llama(seed: int = 0, *, layers: int = 2, hidden: int = 64, vocab: int = 512, heads: int = 4,
                 kv_heads: int = 2, intermediate: int | None = None):
    """An `mlx_lm.models.llama.Model` with random weights drawn from `seed` (deterministic; re-seeds MLX's
    global random generator)."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=intermediate or 2 * hidden, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, rms_norm_eps=1e-5, vocab_size=vocab,
                           tie_word_embeddings=True)
    mx.random.seed(seed)          # nn layers draw their initial weights from MLX's global generator
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def noisy_copy(model, noise: float, seed: int = 0):
    """A draft for `model`: the same architecture with every weight matrix w replaced by
    `w + noise * std(w) * N(0, 1)` (noise drawn from `seed`; norms and other vectors are kept). `noise = 0` is an
    exact copy; the larger `noise`, the less often the copy's draws agree with the original's. Used by the
    speculative-decoding tests and benchmark as drafts that agree with a target to a chosen degree."""
    import copy

    from mlx.utils import tree_flatten, tree_unflatten

    if not isinstance(noise, (int, float)) or not noise >= 0:
        raise SamplecError(f"noisy_copy: noise must be a number >= 0, got {noise!r}")
    draft = copy.deepcopy(model)
    flat = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(flat))
    params = []
    for i, (name, w) in enumerate(flat):
        if w.ndim >= 2 and noise > 0:
            w32 = w.astype(mx.float32)
            g = mx.random.normal(w.shape, dtype=mx.float32, key=keys[i])
            w = (w32 + noise * mx.std(w32) * g).astype(w.dtype)
        params.append((name, w))
    draft.update(tree_unflatten(params))
    mx.eval(draft.parameters())
    return draft


_CORPUS = """\
A sampler chain turns the logits of a language model into the next token. Penalties push down tokens that were
already generated; top-k keeps the k most likely tokens; top-p keeps the smallest set whose probability mass
reaches p; min-p drops tokens much less likely than the best one; temperature sharpens or flattens what is left,
and the last stage draws a token. The compiler reads the chain, checks it, lowers it to a graph of simple ops,
folds what it can and runs the rest on the device. The same seed and position always give the same token, on any
batch size and at any optimization level. Quick brown foxes jump over lazy dogs while the model keeps talking,
counting one, two, three, four, five, six, seven, eight, nine, ten tokens per step.
"""


def _pseudo_words(count: int, seed: int = 0) -> str:
    """Deterministic made-up words (syllables drawn from a fixed seed): enough distinct pairs for big vocabularies."""
    rng = np.random.default_rng(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"] + ["th", "sh", "ch", "qu", "ng", "st"]
    lengths = rng.integers(1, 5, size=count)
    picks = rng.integers(0, len(syllables), size=int(lengths.sum()))
    words, at = [], 0
    for n in lengths:
        words.append("".join(syllables[i] for i in picks[at:at + n]))
        at += n
    return " ".join(words)


def local_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on a built-in paragraph and made-up words, wrapped for mlx-lm (exactly
    `vocab_size` ids; id 1 is `</s>`, the end-of-sequence token)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 260:
        raise SamplecError("local_tokenizer: vocab_size must be at least 260 (256 bytes and special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4 + [_pseudo_words(max(0, vocab_size - 400) * 20)], trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<extra_{i}>" for i in range(missing)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    return TokenizerWrapper(fast)
