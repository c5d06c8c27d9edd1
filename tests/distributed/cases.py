"""The programs and rows the sharded tests run: every stage and every output, on rows with ties and with mostly
-inf logits, over uneven slices (a slice of one id included). Shared by the workers under tests/distributed/."""
from __future__ import annotations

import numpy as np

OUTS = "token, logprob, raw_logprob, top_logprobs(3), candidates(5)"
P = "seed: seed, pos: int = 3"

# name -> (source, run-time parameters beside seed/pos; a callable of (rng, B, V) for per-row values)
PROGRAMS = {
    "greedy": f"sampler s() -> token, logprob, raw_logprob, top_logprobs(4), candidates(6) {{ greedy() }}",
    "sample": f"sampler s({P}) -> {OUTS} {{ sample(seed, position = pos) }}",
    "temperature": f"sampler s({P}, t: float) -> {OUTS} {{ temperature(t) sample(seed, position = pos) }}",
    "temperature_0": f"sampler s({P}) -> {OUTS} {{ top_k(20) temperature(0) sample(seed) }}",
    "top_k": f"sampler s({P}, k: int) -> {OUTS} {{ top_k(k) sample(seed, position = pos) }}",
    "top_k_const": f"sampler s({P}) -> {OUTS} {{ top_k(7) temperature(0.9) sample(seed, position = pos) }}",
    "top_p": f"sampler s({P}, p: float) -> {OUTS} {{ top_p(p) sample(seed, position = pos) }}",
    "min_p": f"sampler s({P}, m: float) -> {OUTS} {{ min_p(m) sample(seed, position = pos) }}",
    "typical_p": f"sampler s({P}, m: float) -> {OUTS} {{ typical_p(m) sample(seed, position = pos) }}",
    "top_n_sigma": f"sampler s({P}) -> {OUTS} {{ top_n_sigma(1.0) sample(seed, position = pos) }}",
    "xtc": f"sampler s({P}) -> {OUTS} {{ xtc(0.05, 0.7, seed, position = pos) sample(seed, position = pos) }}",
    "penalties": f"sampler s({P}, h: tokens) -> {OUTS} "
                 f"{{ penalties(h, last_n = 12, repeat = 1.3, frequency = 0.2, presence = 0.4) sample(seed) }}",
    "bias": f"sampler s({P}, b: bias) -> {OUTS} "
            f"{{ logit_bias({{0: 2.5, 5: -1.0, 130: 4.0, 256: 1.5}}) logit_bias(b) sample(seed) }}",
    "allow": f"sampler s({P}, mask: mask) -> {OUTS} {{ allow(mask) top_k(5) sample(seed, position = pos) }}",
    "dynamic_temperature": f"sampler s({P}) -> {OUTS} {{ top_k(40) dynamic_temperature(0.8, 0.5, 1.3) "
                           f"sample(seed, position = pos) }}",
    "epsilon": f"sampler s({P}) -> {OUTS} {{ epsilon(0.004) sample(seed, position = pos) }}",
    "eta": f"sampler s({P}) -> {OUTS} {{ eta(0.002) sample(seed, position = pos) }}",
    "dry": f"sampler s({P}, h: tokens) -> {OUTS} {{ dry(h, 0.8, 1.75, 2, -1, breakers = [7, 200]) "
           f"sample(seed) }}",
    "dry_tokens": f"sampler s({P}, h: tokens, br: tokens) -> {OUTS} {{ dry(h, 1.2, breakers = br) greedy() }}",
    "mirostat": f"sampler s({P}, mu: state) -> token, logprob, raw_logprob, mu "
                f"{{ mirostat(mu, 3.0, 0.1, 50, seed, position = pos) }}",
    "mirostat_v2": f"sampler s({P}, mu: state) -> token, logprob, candidates(4), mu "
                   f"{{ temperature(0.9) mirostat_v2(mu, 3.0, 0.1, seed, position = pos) }}",
    "llama_cpp": f"sampler s({P}, h: tokens) -> {OUTS} {{ penalties(h, last_n = 64, repeat = 1.1) top_k(40) "
                 f"top_p(0.95) min_p(0.05) temperature(0.8) sample(seed, position = pos) }}",
    "probs": "sampler s() -> probs, candidates(8) { top_k(30) top_p(0.9) temperature(0.7) }",
    "probs_whole": "sampler s(t: float = 1.3) -> probs { min_p(0.02) temperature(t) }",
}


def params_for(name: str, rng: np.random.Generator, B: int, V: int) -> dict:
    """The run-time values of a program's parameters (the same on every rank for the same rng)."""
    out: dict = {}
    src = PROGRAMS[name]
    if "seed: seed" in src:
        out["seed"] = rng.integers(0, 2 ** 63, size=B, dtype=np.uint64)
        out["pos"] = int(rng.integers(0, 1000))
    extra = {
        "temperature": lambda: {"t": rng.uniform(0.3, 2.0, B).astype(np.float32)},
        "top_k": lambda: {"k": rng.integers(-1, 60, B).astype(np.int32)},
        "top_p": lambda: {"p": rng.uniform(0.2, 1.0, B).astype(np.float32)},
        "min_p": lambda: {"m": rng.uniform(0.0, 0.3, B).astype(np.float32)},
        "typical_p": lambda: {"m": rng.uniform(0.2, 1.0, B).astype(np.float32)},
        "bias": lambda: {"b": np.where(rng.random((B, V)) < 0.1, rng.normal(0, 3, (B, V)), 0).astype(np.float32)},
        "allow": lambda: {"mask": rng.random((B, V)) < 0.4},
        "mirostat": lambda: {"mu": rng.uniform(4.0, 8.0, B).astype(np.float32)},
        "mirostat_v2": lambda: {"mu": rng.uniform(4.0, 8.0, B).astype(np.float32)},
    }.get(name)
    if extra:
        out.update(extra())
    if "h: tokens" in src:
        hist = rng.integers(0, V, (B, 24)).astype(np.int32)
        hist[:, 12:18] = hist[:, 2:8]               # (a repeat for DRY to find)
        hist[0, :3] = -1                             # (padding)
        out["h"] = hist
    if "br: tokens" in src:
        out["br"] = np.array([[3, 100, -1]] * B, dtype=np.int32)
    return out


def rows(kind: str, rng: np.random.Generator, B: int, V: int) -> np.ndarray:
    """Logits [B, V]: `normal` (distinct values), `ties` (a few distinct values: ties everywhere, at the cuts
    too) or `sparse` (mostly -inf; a row with one finite entry)."""
    if kind == "normal":
        return (rng.standard_normal((B, V)) * 3).astype(np.float32)
    if kind == "ties":
        return rng.integers(0, 6, (B, V)).astype(np.float32) * 0.5
    x = np.where(rng.random((B, V)) < 0.1, rng.standard_normal((B, V)) * 2, -np.inf).astype(np.float32)
    x[:, 0] = np.where(np.isinf(x[:, 0]), 1.0, x[:, 0])     # (every row keeps a finite entry)
    x[-1, :] = -np.inf
    x[-1, V - 1] = 0.5                                        # (the last row: one finite entry, in the last slice)
    return x


def bounds(n: int, V: int) -> list[int]:
    """Uneven slice boundaries for n ranks: the first slice holds one id where n >= 3."""
    if n == 1:
        return [0, V]
    if n == 2:
        return [0, V // 3, V]
    cuts = [0, 1] + [1 + (V - 1) * i // (n - 1) for i in range(1, n)]
    return cuts[:n] + [V]


def compare(name: str, want, got, span: tuple[int, int] | None = None) -> list[str]:
    """Differences between the unsharded outputs and the sharded ones: ids and tokens exactly, floats to a few
    float32 ulps (the sums are added in another order), -inf where -inf. `span`: the rank's slice, which is what
    a sharded `probs` holds."""
    bad = []
    for key, w in want.to_dict().items():
        w, g = np.array(w), np.array(got.to_dict()[key])
        if key == "probs" and span is not None:
            w = w[:, span[0]:span[1]]
        if w.shape != g.shape or w.dtype != g.dtype:
            bad.append(f"{name}.{key}: shape/dtype {w.shape} {w.dtype} vs {g.shape} {g.dtype}")
        elif w.dtype.kind in "iub":
            if not np.array_equal(w, g):
                bad.append(f"{name}.{key}: {w.tolist()} vs {g.tolist()}")
        elif not np.array_equal(np.isneginf(w), np.isneginf(g)) or \
                not np.allclose(w, g, rtol=2e-5, atol=2e-6, equal_nan=True):
            bad.append(f"{name}.{key}: {w.tolist()} vs {g.tolist()}")
    return bad
