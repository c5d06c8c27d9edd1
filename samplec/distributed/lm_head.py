"""A vocabulary-parallel LM head for mlx-lm models, and the decode loop over it.

`shard_lm_head(model, group)` keeps on each rank only its contiguous rows of the LM head: the model then returns
the rank's slice of the logits [.., V_r]. An untied head (`model.lm_head`) is replaced by its rows; a tied one (the
input embedding read as the head, `model.model.embed_tokens.as_linear`) by `VocabParallelEmbedding`, which holds
the same rows for both uses -- an input token's embedding comes from the rank that holds its row (the others add
zeros: an exact sum). `samplec.decode.generate` notices such a model (its `samplec_vocab` attribute) and decodes
with `generate_sharded`: the program runs through `samplec.distributed.shard`, and every rank emits the same
tokens.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from samplec.diagnostics import SamplecError
from samplec.distributed.sharded import DEFAULT_TIMEOUT, shard


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows [start, start + size) of a vocabulary of `vocab` ids, over `group`."""
    start: int
    size: int
    vocab: int
    group: object


def vocab_slices(vocab: int, n: int) -> list[tuple[int, int]]:
    """(start, size) of n contiguous slices of as equal sizes as the vocabulary allows."""
    cuts = [vocab * r // n for r in range(n + 1)]
    return [(cuts[r], cuts[r + 1] - cuts[r]) for r in range(n)]


def _rows(module: nn.Module, start: int, stop: int, vocab: int) -> nn.Module:
    """A copy of a Linear / Embedding (plain or quantized) holding only rows [start, stop) of its arrays with one
    row per token."""
    out = copy.copy(module)
    for name, value in module.items():
        if isinstance(value, mx.array) and value.ndim >= 1 and value.shape[0] == vocab:
            out[name] = mx.array(value[start:stop])     # (a copy: the whole head can be freed)
    return out


class VocabParallelEmbedding(nn.Module):
    """A tied embedding / LM head of which this rank holds rows [start, start + size)."""

    def __init__(self, rows: nn.Module, shard_: VocabShard):
        super().__init__()
        self.rows = rows
        self._shard = shard_

    def __call__(self, ids: mx.array) -> mx.array:
        s = self._shard
        own = (ids >= s.start) & (ids < s.start + s.size)
        e = self.rows(mx.where(own, ids - s.start, 0))
        e = mx.where(own[..., None], e, mx.zeros((), dtype=e.dtype))
        return mx.distributed.all_sum(e, group=s.group)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.rows.as_linear(x)


def shard_lm_head(model, group=None):
    """Keep on this rank only its rows of `model`'s LM head (an mlx-lm model; its untied `lm_head`, or its tied
    `model.embed_tokens`), the vocabulary split evenly and contiguously over `group` (default:
    `mx.distributed.init()`). The model then returns this rank's slice of the logits; `model.samplec_vocab`
    says which. Returns the model."""
    group = group if group is not None else mx.distributed.init()
    if getattr(model, "samplec_vocab", None) is not None:
        raise SamplecError("shard_lm_head: this model's LM head is already sharded")
    head = model.get("lm_head") if isinstance(model, nn.Module) else None
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if isinstance(head, (nn.Linear, nn.QuantizedLinear)):
        vocab = head.weight.shape[0]
    elif embed is not None and hasattr(embed, "as_linear"):
        vocab = embed.weight.shape[0]
    else:
        raise SamplecError("shard_lm_head: found no LM head on this model (expected an mlx-lm model with an "
                           "`lm_head` Linear, or tied embeddings at `model.embed_tokens`)")
    if vocab < group.size():
        raise SamplecError(f"shard_lm_head: a vocabulary of {vocab} ids cannot give each of {group.size()} ranks "
                           f"a slice")
    start, size = vocab_slices(vocab, group.size())[group.rank()]
    where = VocabShard(start, size, vocab, group)
    if isinstance(head, (nn.Linear, nn.QuantizedLinear)):
        model.lm_head = _rows(head, start, start + size, vocab)
    else:
        inner.embed_tokens = VocabParallelEmbedding(_rows(embed, start, start + size, vocab), where)
    model.samplec_vocab = where
    mx.eval(model.parameters())     # (the rows now: an array left lazy belongs to this thread's stream)
    return model


def generate_sharded(model, program, tokens: list[int], max_tokens: int, *, seed: int = 0, eos: set[int] = (),
                     prompt_in_history: bool = True, stats: dict | None = None,
                     timeout: float | None = DEFAULT_TIMEOUT, **params) -> list[int]:
    """`samplec.decode.generate` for a model whose LM head `shard_lm_head` split: the same positions, history
    and state as the one-process loop, each step's logits slice sampled through `shard(program)`; one host
    synchronization per token (the next forward pass needs the token that every rank agreed on)."""
    from samplec.decode import PREFILL_STEP, ProgramFeed, _make_cache, pad_history, step_seeds
    where: VocabShard = model.samplec_vocab
    feed = ProgramFeed(program, seed, params, prompt_in_history)
    feed.check_arrays()
    sharded = shard(program, where.group, timeout=timeout)
    if stats is not None:
        stats.update({"target_forwards": 0, "draft_forwards": 0, "draft_tokens": 0, "accepted_tokens": 0,
                      "tokens": 0})
    if max_tokens == 0:
        return []
    if any(t >= where.vocab for t in tokens):
        raise SamplecError(f"prompt: token id {max(tokens)} >= V = {where.vocab}")
    cache = _make_cache(model)
    seq = mx.array(tokens, dtype=mx.int32)
    rest = seq
    while rest.shape[0] > 1:        # (the prefill of samplec.decode.generate: the same logits)
        n = min(PREFILL_STEP, rest.shape[0] - 1)
        model(rest[:n][None], cache=cache)
        mx.eval([c.state for c in cache])
        rest = rest[n:]
    logits = model(rest[None], cache=cache)[:, -1, :]
    history = list(tokens)          # the sequence so far
    length, out = len(tokens), []
    state: dict = {}
    fixed = dict(feed.params)
    for _ in range(max_tokens):
        call = dict(fixed, **{n: length for n in feed.position_names}, **state)
        for n in feed.advanced_seeds:       # (a draw at a fixed position: the seed advances by the position)
            if n in fixed:
                seeds = np.asarray(fixed[n], dtype=np.uint64).reshape(-1).tolist()
                call[n] = step_seeds(seeds, [length] * len(seeds))
        if feed.history_name:
            call.update(feed.histories(pad_history(mx.array(np.array(history, dtype=np.int32)[None]), len(history)),
                                       len(out)))
        res = sharded(logits, vocab_start=where.start, vocab_size=where.vocab, **call)
        state = {p.name: res.to_dict()[p.name] for p in program.params if p.kind == "state"}
        token = int(np.array(res.token)[0])
        out.append(token)
        history.append(token)
        length += 1
        if token in eos or len(out) == max_tokens:
            break
        logits = model(mx.array([[token]], dtype=mx.int32), cache=cache)[:, -1, :]
    if stats is not None:
        stats.update({"target_forwards": len(out), "tokens": len(out)})
    return out
