"""Speculative decoding: samplec's coupled draws against mlx-lm's speculative generation, same target/draft/chain.

    python benchmarks/bench_speculative.py [--tokens 40] [--prompts 2] [--num-draft 4] [--noise 0.01,0.03,0.1]
                                           [--temps 0,0.7,1.0] [--top-p 0.9] [--draft-layers 0] [--json out.json]
    python benchmarks/bench_speculative.py --rounding [--positions 96]

Not a test. The recipe (no downloads):
- target: mlx-lm's llama (4 layers, hidden 256, vocab 4096, random weights from seed 0) with an output head of its
  own scaled by `--sharpness` (default 6). A random llama's logits have a standard deviation near 1 (entropy
  ~7.8 nats over 4096 tokens, nothing like a language model), and with tied embeddings it mostly predicts its
  input token again (its text is a loop); the scaled untied head gives logits with a standard deviation near 3.5
  and a mean entropy of a few nats along the sampled text (printed with the table);
- drafts: `noisy_copy(target, noise)` -- every weight matrix plus `noise * std(w) * N(0, 1)` -- at a few noise
  levels (the larger, the less the draft agrees); `--draft-layers N` also keeps only its first N layers (a
  cheaper draft, the "early exit" kind);
- chain: top_p then temperature then the draw -- mlx-lm's `make_sampler(temp=T, top_p=P)` (its filters, then its
  temperature in `categorical_sampling`) and samplec's `top_p(P) temperature(T) sample(seed, position = pos)`;
  temperature 0 is greedy in both.

For each draft and temperature it decodes `--tokens` tokens after each of `--prompts` prompts with:
- mlx-lm: `speculative_generate_step(prompt, target, draft, num_draft_tokens=k, sampler=make_sampler(...))` (the
  draft and the target each draw from MLX's global generator; a proposal is kept while it equals the target's
  own draw), and plain `generate_step` with the same sampler;
- samplec: `samplec.decode.generate(target, program, prompt, n, draft_model=draft, num_draft=k)` (the draft draws
  with the program on its logits at the target's seed and positions) and plain `generate` (no draft), and
  mlx-lm's own speculative loop with the adapter (`Sampler.speculative`).
It prints acceptance (accepted proposals / proposals); beside it, averaged over the positions of samplec's text,
what theory expects from the chain's final distributions under the target (p) and the draft (q): the Gumbel-max
coupling's guarantee (1 - TV) / (1 + TV), the best coupling's 1 - TV and independent draws' sum p q (what mlx-lm's
loop gets); target forward passes per generated token, tokens/s, and whether samplec's speculative tokens equal its
plain ones. Timings are the sum over prompts of one run each (after a warm-up run), all on this machine in the
same process.

`--rounding [--dtype bfloat16]` measures what can still differ between speculative and plain decoding: the target's
logits at a position computed by the (k+1)-position forward pass against the one-token pass, on the small model the
tests and `samplec serve --demo` use (`random_llama(0)`: 2 layers, hidden 64, vocab 512) and on the benchmark's
target: the fraction of positions whose logits differ in any bit, the largest difference, and how often the
program's token moves (64 seeds per position, so 64 draws per position).
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

import samplec
from samplec.decode import generate
from samplec.integrations.mlx_lm import Sampler, noisy_copy, random_llama

CHAIN = """
sampler bench(seed: seed, pos: int = 0, temperature: float = 0.8, top_p: float = 0.9) -> token {
    top_p(top_p)
    temperature(temperature)
    sample(seed, position = pos)
}
"""


def sharpened_llama(sharpness: float, *, layers: int = 4, hidden: int = 256, vocab: int = 4096):
    """mlx-lm's llama with random weights (seed 0) and an output head of its own (not the embeddings: a random
    model with tied embeddings mostly predicts its input token again), scaled by `sharpness`."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=vocab, tie_word_embeddings=False)
    mx.random.seed(0)
    model = llama.Model(args)
    model.lm_head.weight = model.lm_head.weight * sharpness
    mx.eval(model.parameters())
    return model


def make_draft(target, noise: float, layers: int):
    draft = noisy_copy(target, noise, seed=1)
    if layers:
        draft.model.layers = draft.model.layers[:layers]
    return draft


def prompts(count: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(2, vocab, size=24).tolist() for _ in range(count)]


def mlx_lm_speculative(target, draft, prompt, n, k, sampler):
    """mlx-lm's loop; returns (tokens, proposals, accepted, target passes), counted as samplec counts them: a round
    with `left` tokens to go proposes min(k, left) tokens in mlx-lm and min(k, left - 1) in samplec (the last
    token is the target's anyway), so a proposal at the last position is left out of both counts."""
    toks, proposed, accepted, passes = [], 0, 0, 0
    rounds: list[list] = []                      # [tokens left at the round's start, proposals, accepted]
    for t, _, from_draft in speculative_generate_step(mx.array(prompt), target, draft, num_draft_tokens=k,
                                                      max_tokens=n, sampler=sampler):
        if not rounds or rounds[-1][3]:
            left = n - len(toks)
            rounds.append([left, min(k, left), 0, False])
        toks.append(int(t))
        rounds[-1][2] += bool(from_draft)
        rounds[-1][3] = not from_draft             # the target's own token ends a round
    for left, made, took, _ in rounds:
        if made == left:                            # the last proposal is at the last position
            made, took = made - 1, min(took, made - 1)
        proposed, accepted, passes = proposed + made, accepted + took, passes + 1
    return toks, proposed, accepted, passes


def mean_entropy(target, program, prompt, n: int, temp: float) -> float:
    """The target's mean entropy (nats) over the positions of a sampled continuation."""
    seq = generate(target, program, prompt, n, seed=0, temperature=temp, top_p=1.0)
    logits = target(mx.array(prompt + seq)[None])[0, len(prompt) - 1:-1]
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return float(-(mx.exp(logp) * logp).sum(axis=-1).mean())


def coupling(target, draft, probs_program, prompt, seq, temp, top_p) -> tuple[float, float, float]:
    """Along a sampled continuation: the chain's final distributions under the target (p) and the draft (q) at each
    position; returns the sums over positions of the Gumbel-max coupling's guarantee (1 - TV) / (1 + TV), the best
    coupling's 1 - TV, and independent draws' agreement sum p q."""
    full = mx.array(prompt + seq)[None]
    pos = mx.arange(len(prompt), len(prompt) + len(seq))
    kw = dict(seed=0, pos=pos, temperature=temp, top_p=top_p)
    p = probs_program(target(full)[0, len(prompt) - 1:-1], **kw).probs
    q = probs_program(draft(full)[0, len(prompt) - 1:-1], **kw).probs
    tv = 0.5 * mx.abs(p - q).sum(axis=-1)
    return float(((1 - tv) / (1 + tv)).sum()), float((1 - tv).sum()), float((p * q).sum())


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def run_config(target, draft, program, prompt_list, n, k, temp, top_p, probs_program=None) -> dict:
    sampler = make_sampler(temp=temp, top_p=top_p)
    params = dict(temperature=temp, top_p=top_p)
    row = {"mlx_prop": 0, "mlx_acc": 0, "mlx_passes": 0, "s_prop": 0, "s_acc": 0, "s_passes": 0, "tokens": 0,
           "t_mlx_plain": 0.0, "t_mlx_spec": 0.0, "t_s_plain": 0.0, "t_s_spec": 0.0, "t_s_adapter": 0.0,
           "same": True, "adapter_same": True, "gumbel_bound": 0.0, "best": 0.0, "sum_pq": 0.0, "positions": 0}
    for i, prompt in enumerate(prompt_list):
        mx.random.seed(100 + i)
        _, dt = timed(lambda: [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=n,
                                                          sampler=sampler)])
        row["t_mlx_plain"] += dt
        mx.random.seed(100 + i)
        (toks, prop, acc, passes), dt = timed(lambda: mlx_lm_speculative(target, draft, prompt, n, k, sampler))
        row["t_mlx_spec"] += dt
        row["mlx_prop"] += prop
        row["mlx_acc"] += acc
        row["mlx_passes"] += passes
        plain, dt = timed(lambda: generate(target, program, prompt, n, seed=i, **params))
        row["t_s_plain"] += dt
        stats = {}
        spec, dt = timed(lambda: generate(target, program, prompt, n, seed=i, draft_model=draft, num_draft=k,
                                          stats=stats, **params))
        row["t_s_spec"] += dt
        row["s_prop"] += stats["draft_tokens"]
        row["s_acc"] += stats["accepted_tokens"]
        row["s_passes"] += stats["target_forwards"]
        row["tokens"] += len(spec)
        row["same"] &= spec == plain
        if probs_program is not None:
            g, b, pq = coupling(target, draft, probs_program, prompt, plain, temp, top_p)
            row["gumbel_bound"] += g
            row["best"] += b
            row["sum_pq"] += pq
            row["positions"] += len(plain)
        s = Sampler(program, seed=i, **params)
        adapted, dt = timed(lambda: [int(t) for t, _, _ in speculative_generate_step(
            mx.array(prompt), target, draft, num_draft_tokens=k, max_tokens=n, **s.speculative(prompt))])
        row["t_s_adapter"] += dt
        row["adapter_same"] &= adapted == spec
    return row


def bench(a) -> list[dict]:
    target = sharpened_llama(a.sharpness)
    program = samplec.compile(CHAIN)
    probs_program = samplec.compile(CHAIN.replace("-> token {", "-> token, probs {"))
    prompt_list = prompts(a.prompts, 4096)
    rows = []
    noises = [float(x) for x in a.noise.split(",")]
    temps = [float(x) for x in a.temps.split(",")]
    a.entropy = mean_entropy(target, program, prompt_list[0], a.tokens, 1.0)
    warm = make_draft(target, noises[0], a.draft_layers)
    run_config(target, warm, program, prompt_list[:1], 8, a.num_draft, temps[0], a.top_p)     # warm-up
    for noise in noises:
        draft = make_draft(target, noise, a.draft_layers)
        for temp in temps:
            r = run_config(target, draft, program, prompt_list, a.tokens, a.num_draft, temp, a.top_p,
                           probs_program)
            r.update(noise=noise, temperature=temp, top_p=a.top_p)
            rows.append(r)
            print(f"  noise {noise:g} T {temp:g}: acceptance samplec {r['s_acc'] / r['s_prop']:.2f}, "
                  f"mlx-lm {r['mlx_acc'] / max(r['mlx_prop'], 1):.2f}", flush=True)
    return rows


def table(rows: list[dict], a) -> str:
    out = [f"target: 4 layers, hidden 256, vocab 4096, output head x{a.sharpness:g}; draft: noisy copy"
           + (f", first {a.draft_layers} layers" if a.draft_layers else "")
           + f"; k = {a.num_draft}; {a.prompts} prompts x {a.tokens} tokens; top_p {a.top_p}; the target's mean "
           f"entropy along its text at T = 1: {a.entropy:.2f} nats; "
           f"MLX {mx.__version__} on {platform.machine()} ({mx.default_device()})", "",
           "| draft noise | T | acceptance samplec | acceptance mlx-lm | ratio | (1-TV)/(1+TV) / 1-TV / sum pq "
           "| target passes/token samplec | mlx-lm | tokens/s samplec plain / spec / adapter spec "
           "| mlx-lm plain / spec | samplec spec = plain |",
           "|---:|---:|---:|---:|---:|---|---:|---:|---|---|---|"]
    for r in rows:
        sa, ma = r["s_acc"] / r["s_prop"], r["mlx_acc"] / max(r["mlx_prop"], 1)
        n = r["tokens"]
        out.append(f"| {r['noise']:g} | {r['temperature']:g} | {sa:.2f} | {ma:.2f} | "
                   f"{sa / ma if ma else float('inf'):.2f} | {r['gumbel_bound'] / r['positions']:.2f} / "
                   f"{r['best'] / r['positions']:.2f} / {r['sum_pq'] / r['positions']:.2f} | "
                   f"{r['s_passes'] / n:.2f} | {r['mlx_passes'] / n:.2f} | "
                   f"{n / r['t_s_plain']:.0f} / {n / r['t_s_spec']:.0f} / {n / r['t_s_adapter']:.0f} | "
                   f"{n / r['t_mlx_plain']:.0f} / {n / r['t_mlx_spec']:.0f} | "
                   f"{'yes' if r['same'] and r['adapter_same'] else 'NO'} |")
    return "\n".join(out)


# ---- rounding: the (k+1)-position pass against the one-token pass ----

def rounding(model, program, k: int, positions: int, seeds: int = 64, temp: float = 0.8) -> dict:
    prompt = list(range(3, 19))
    seq = generate(model, program, prompt, positions, seed=0, temperature=temp)
    full = prompt + seq
    one = make_prompt_cache(model)                       # one token at a time (plain decoding)
    model(mx.array(full[:len(prompt) - 1])[None], cache=one)
    rows_one = [model(mx.array([t])[None], cache=one)[0, -1] for t in full[len(prompt) - 1:-1]]
    many = make_prompt_cache(model)                      # k + 1 positions per pass (every proposal accepted)
    model(mx.array(full[:len(prompt) - 1])[None], cache=many)
    rows_many, at = [], len(prompt) - 1
    while at < len(full) - 1:
        block = full[at:min(at + k + 1, len(full) - 1)]
        rows_many.extend(model(mx.array(block)[None], cache=many)[0])
        at += len(block)
    a, b = mx.stack(rows_one).astype(mx.float32), mx.stack(rows_many).astype(mx.float32)
    differ = np.array((a != b).any(axis=-1))
    largest = float(mx.abs(a - b).max())
    moved = {"sampled": 0, "greedy": 0}
    seed_vec = np.arange(seeds, dtype=np.uint64)
    for i in range(a.shape[0]):
        kw = dict(seed=seed_vec, pos=len(prompt) + i, temperature=temp)
        ta = np.array(program(mx.broadcast_to(a[i], (seeds, a.shape[1])), **kw).token)
        tb = np.array(program(mx.broadcast_to(b[i], (seeds, b.shape[1])), **kw).token)
        moved["sampled"] += int((ta != tb).sum())
        moved["greedy"] += int(mx.argmax(a[i]).item() != mx.argmax(b[i]).item())
    return {"positions": int(a.shape[0]), "differ": int(differ.sum()), "largest": largest,
            "draws": int(a.shape[0]) * seeds, **moved}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--noise", default="0.01,0.03,0.1")
    ap.add_argument("--temps", default="0,0.7,1.0")
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--sharpness", type=float, default=6.0)
    ap.add_argument("--draft-layers", type=int, default=0)
    ap.add_argument("--rounding", action="store_true")
    ap.add_argument("--positions", type=int, default=96)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="--rounding: the models' weights in this type (real models run in bfloat16/float16)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.rounding:
        program = samplec.compile(CHAIN)
        results = {}
        for name, model in (("random_llama(0): 2 layers, hidden 64, vocab 512", random_llama(0)),
                            ("the benchmark's target", sharpened_llama(a.sharpness))):
            model.set_dtype(getattr(mx, a.dtype))
            name = f"{name}, {a.dtype}, {mx.default_device()}"
            r = rounding(model, program, a.num_draft, a.positions)
            results[name] = r
            print(f"{name}: k = {a.num_draft}; {r['differ']} of {r['positions']} positions' logits differ in some "
                  f"bit (largest difference {r['largest']:.3g}); tokens moved: {r['sampled']} of {r['draws']} "
                  f"draws (top_p 0.9, T 0.8, 64 seeds per position), greedy {r['greedy']} of {r['positions']}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)
        return
    rows = bench(a)
    print(table(rows, a))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
