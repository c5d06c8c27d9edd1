"""Run under `mlx.launch -n N`: a small random llama (the same weights on every rank), tied and untied LM head.
`samplec.decode.generate` on the whole model, then on the model after `shard_lm_head`: every rank must emit the
same tokens as the one-process loop. Also records how far the sliced head's logits are from the whole head's
(the rounding a vocabulary-parallel head may add). Writes OUT/rank<r>.json."""
from __future__ import annotations

import json
import os
import sys
import warnings

import mlx.core as mx
from mlx_lm.models import llama

import samplec
from samplec.decode import generate
from samplec.distributed import shard_lm_head

SOURCES = {
    "llama_cpp": "sampler s(seed: seed, pos: int, h: tokens) -> token { penalties(h, last_n = 64, repeat = 1.3) "
                 "top_k(40) top_p(0.95) min_p(0.05) temperature(1.5) sample(seed, position = pos) }",
    "mirostat_v2": "sampler s(seed: seed, pos: int, mu: state) -> token, mu "
                   "{ mirostat_v2(mu, 5.0, 0.1, seed, position = pos) }",
    "greedy_dry": "sampler s(h: tokens) -> token { dry(h, 0.8) greedy() }",
    # (a draw at a fixed position: the loop advances the seed by the position, decode.step_seed)
    "fixed_position": "sampler s(seed: seed) -> token { top_k(40) temperature(1.5) sample(seed) }",
}


def model(tied: bool, V: int = 611):
    mx.random.seed(7)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=V,
                           tie_word_embeddings=tied)
    m = llama.Model(args)
    if not tied:        # (spread the logits: cuts that cut something; a tied head is peaked at the last token)
        m.lm_head.weight = m.lm_head.weight * 4
    mx.eval(m.parameters())
    return m


def main(out_dir: str) -> None:
    mx.disable_compile()
    warnings.simplefilter("ignore", samplec.SamplecWarning)
    group = mx.distributed.init()
    rank = group.rank()
    prompt = [5, 17, 300, 42, 17, 300, 9]
    results = []
    for tied in (True, False):
        whole = model(tied)
        split = shard_lm_head(model(tied), group)
        s = split.samplec_vocab
        x = mx.array([prompt])
        full = whole(x)[0, -1]
        part = split(x)[0, -1]
        gap = float(mx.max(mx.abs(full[s.start:s.start + s.size] - part)))
        for name, src in SOURCES.items():
            prog = samplec.compile(src)
            want = generate(whole, prog, prompt, 16, seed=3)
            got = generate(split, prog, prompt, 16, seed=3)
            results.append({"tied": tied, "program": name, "want": want, "got": got, "logit_gap": gap,
                            "rows": s.size, "head_rows": int(split.lm_head.weight.shape[0]) if not tied else
                            int(split.model.embed_tokens.rows.weight.shape[0])})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "size": group.size(), "results": results}, f)


if __name__ == "__main__":
    main(sys.argv[1])
