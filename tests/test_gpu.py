"""The CUDA kernels (samplec.backend_mlx.gpu) against the dense definitions and numpy, and a program's tokens on the
GPU against the same program on the CPU. These run where MLX's default device is a CUDA GPU (a machine with
`mlx[cuda13]`); elsewhere only the first test runs -- the kernel must stay off the CPU path."""
from __future__ import annotations

import contextlib
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import samplec
from samplec.backend_mlx import gpu, kernels, native

ROOT = Path(__file__).resolve().parent.parent
cuda = pytest.mark.skipif(not gpu.available(), reason="needs MLX's CUDA backend as the default device")


def chat_rows(rng, B: int, V: int) -> np.ndarray:
    """B chat-like rows: N(0, 1) under a Zipf-like head of 300 tokens."""
    x = rng.normal(0, 1, (B, V)).astype(np.float32)
    for b in range(B):
        x[b, rng.choice(V, 300, replace=False)] += 6 + 10 / np.arange(1, 301) ** 0.6
    return x


@contextlib.contextmanager
def on_the_cpu():
    """MLX's CPU as the default device, uncompiled (MLX's CPU compiles each fused kernel with a C++ compiler: minutes
    on a machine that has not seen them): where the device tests' references run."""
    prev = mx.default_device()
    mx.set_default_device(mx.cpu)
    mx.disable_compile()
    try:
        yield
    finally:
        mx.enable_compile()
        mx.set_default_device(prev)


def o0_on_the_cpu(src: str, x, sampler: str | None = None, **kw):
    """The dense definitions' outputs (-O0) on MLX's CPU, whatever the default device."""
    with on_the_cpu():
        return samplec.compile(src, sampler, opt_level=0)(x, **kw)


def test_kernels_off_the_cpu():
    with mx.stream(mx.cpu):
        prev = mx.default_device()
        mx.set_default_device(mx.cpu)
        try:
            x = mx.array(np.arange(12, dtype=np.float32).reshape(2, 6))
            assert gpu.kth_largest(x, mx.array([[2], [3]])) is None
        finally:
            mx.set_default_device(prev)


def _rows(rng):
    yield rng.normal(0, 3, (8, 4096)).astype(np.float32)
    yield rng.integers(-3, 4, (8, 4096)).astype(np.float32)                       # ties
    yield np.where(rng.random((8, 4096)) < 0.9, -np.inf, rng.normal(0, 1, (8, 4096))).astype(np.float32)
    yield np.where(rng.random((4, 1000)) < 0.5, -0.0, 0.0).astype(np.float32)     # signed zeros
    yield rng.normal(0, 1, (3, 1)).astype(np.float32)
    yield rng.normal(0, 1, (5, 2)).astype(np.float32)


@cuda
def test_kth_largest_kernel_equals_dense_and_numpy():
    rng = np.random.default_rng(0)
    for x in _rows(rng):
        B, n = x.shape
        xm = mx.array(x)
        for ks in ([1] * B, [n] * B, [min(40, n)] * B, list(rng.integers(1, n + 1, B))):
            want = mx.array(np.array(ks, dtype=np.int32)[:, None])
            got = np.array(gpu.kth_largest(xm, want))
            lifted = kernels._lift(want)
            dense = np.array(kernels._select(kernels._ordered(xm),
                                             lambda above: mx.sum(above, axis=-1, keepdims=True) >= lifted))
            exp = -np.sort(-x, axis=-1)[np.arange(B), np.array(ks) - 1][:, None]
            assert np.array_equal(got, dense) and np.array_equal(got, exp), (x[:, :4], ks)


@cuda
def test_dry_kernel_equals_its_definition():
    """gpu.dry (DRY beside the chain kernel: the penalized row) against the op's definition in MLX ops on the CPU,
    on random, periodic and padded histories, with and without breakers."""
    from test_gpu_beside import dry_definition
    rng = np.random.default_rng(5)
    for B, H, V in ((2, 64, 50), (3, 700, 32000), (1, 1, 10)):
        x = (rng.standard_normal((B, V)) * 3).astype(np.float32)
        periodic = np.tile(rng.integers(0, V, (B, 7)), (1, H // 7 + 1))[:, :H]
        padded = periodic.copy()
        padded[:, : H // 3] = -1
        for h in (rng.integers(0, V, (B, H)), periodic, padded):
            for breakers in (None, rng.random(V) < 0.01):
                args = (x, h.astype(np.int32), np.float32(0.8), np.float32(1.75), np.int32(2), np.int32(-1),
                        breakers)
                got = np.array(gpu.dry(*(None if a is None else mx.array(a) for a in args)))
                with on_the_cpu():
                    want = dry_definition(*args)
                assert np.array_equal(got == x, want == x), (B, H, V)
                np.testing.assert_allclose(got, want, rtol=2e-6)


@cuda
def test_top_logprobs_kernel_equals_numpy_and_the_programs_outputs():
    """gpu.top_logprobs (top_logprobs beside the chain kernel) against numpy's stable sort of the log-probabilities,
    and a program's top_logprobs on the GPU against the same program's -O0 on the CPU."""
    rng = np.random.default_rng(3)
    for x in _rows(rng):
        B, n = x.shape
        xm = mx.array(x)
        m = mx.max(xm, axis=-1, keepdims=True)
        lz = mx.log(mx.sum(mx.exp(xm - m), axis=-1, keepdims=True))
        for k in sorted({1, min(5, n), min(20, n)}):
            ids, vals = gpu.top_logprobs(xm, m, lz, k, 8)
            lp = (x - np.array(m)) - np.array(lz)
            want = np.argsort(-lp, axis=-1, kind="stable")[:, :k]
            assert np.array_equal(np.array(ids), want), (x[:, :4], k)
            assert np.array_equal(np.array(vals), np.take_along_axis(lp, want, axis=-1))
    src = "sampler s(seed: seed) -> token, top_logprobs(5) { top_k(40) temperature(0.8) sample(seed) }"
    x = chat_rows(rng, 4, 32000)
    got = samplec.compile(src)(x, seed=[1, 2, 3, 4])
    want = o0_on_the_cpu(src, x, seed=[1, 2, 3, 4])
    assert np.array_equal(np.array(got.top_logprobs.ids), np.array(want.top_logprobs.ids))
    np.testing.assert_allclose(np.array(got.top_logprobs.values), np.array(want.top_logprobs.values), atol=1e-5)


@cuda
@pytest.mark.parametrize("example", ["llama.smp", "hf_generate.smp", "vllm.smp", "openai.smp", "mlx_lm_default.smp",
                                     "llama_cpp_default.smp"])
def test_gpu_tokens_equal_cpu_tokens(example):
    """§4: a row's token does not depend on the device. Chat-like rows away from knife-edges (a Zipf head)."""
    rng = np.random.default_rng(7)
    B, V = 4, 32000
    x = rng.normal(0, 1, (B, V)).astype(np.float32)
    for b in range(B):
        x[b, rng.choice(V, 200, replace=False)] += 6 + 10 / np.arange(1, 201) ** 0.6
    hist = rng.integers(0, V, (B, 64)).astype(np.int32)
    src = (ROOT / "examples" / example).read_text()
    for name in re.findall(r"^sampler\s+(\w+)", src, re.M):
        prog = samplec.compile(src, sampler=name)
        kw = {}
        for p in prog.params:
            if p.kind == "seed":
                kw[p.name] = list(range(B))
            elif p.kind == "tokens":
                kw[p.name] = hist
            elif p.kind == "mask":
                kw[p.name] = rng.random((B, V)) < 0.5
            elif p.kind == "bias":
                kw[p.name] = np.zeros((B, V), np.float32)
        on_gpu = {k: np.array(v) for k, v in prog(x, **kw).to_dict().items()}
        # (the same stage-level program, lowered for the CPU: the device's own target runs nowhere else)
        with on_the_cpu():
            cpu = samplec.compile(src, sampler=name, target="cpu" if native.installed() else "portable")
            on_cpu = {k: np.array(v) for k, v in cpu(x, **kw).to_dict().items()}
        assert on_gpu["token"].tolist() == on_cpu["token"].tolist(), (example, name)
        for k, v in on_cpu.items():          # ids exactly (top_logprobs, candidates); values to float rounding
            if v.dtype.kind in "iu":
                assert np.array_equal(on_gpu[k], v), (example, name, k)
            else:
                np.testing.assert_allclose(on_gpu[k], v, rtol=1e-4, atol=1e-5, err_msg=f"{example} {name} {k}")


@cuda
def test_selection_rounds_on_the_gpu_equal_one_bit_rounds():
    """The GPU's several-bit rounds (kernels._select_bits) against one-bit rounds on the GPU itself, by mass (the
    reductions' order could differ with the shape there) and by count."""
    rng = np.random.default_rng(2)
    for x in _rows(rng):
        B, n = x.shape
        xm = mx.array(x)
        keys = kernels._ordered(xm)
        wide = kernels._select_bits(keys)
        w = kernels._lift(mx.softmax(xm, axis=-1))
        want = kernels._lift(mx.array(rng.integers(1, n + 1, (B, 1)).astype(np.int32)))
        for p in (0.0, 0.3, 0.9, 0.95, 1.0):
            t = kernels._lift(mx.array(np.full((B, 1), p, np.float32)))
            by_mass = lambda above: kernels._reduce_sum([mx.where(above, w, 0.0)], {}) >= t        # noqa: E731
            by_count = lambda above: mx.sum(above, axis=-1, keepdims=True) >= want                   # noqa: E731
            for reaches in (by_mass, by_count):
                one, many = (np.array(kernels._select(keys, reaches, bits=b)).view(np.uint32) for b in (1, wide))
                assert np.array_equal(one, many), (x[:, :4], p, wide)


@cuda
@pytest.mark.uncompiled
@pytest.mark.parametrize("seed", range(16))
def test_gpu_chain_kernel_equals_cpu_O0(seed, monkeypatch):
    """The chain kernel (gpu_chain.cu) on the GPU -- random chains of its stages in random orders, one value per
    row, the differential test's logit families, V up to 152064 -- against the dense definitions on the CPU."""
    from test_gpu_chain import chain_case
    rng = np.random.default_rng(seed)
    V = int(rng.choice([1, 2, 50, 1000, 5000, 40000, 152064]))
    B, n = int(rng.integers(1, 5)), int(rng.integers(0, 6))
    terminal = str(rng.choice(["sample", "greedy"]))
    stages, src, kw, _, _, x = chain_case(seed, V, B, n, terminal)
    calls = []
    real = gpu.sample_chain
    monkeypatch.setattr(gpu, "sample_chain", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    on_gpu = samplec.compile(src)(x, **kw)
    assert calls or terminal == "greedy"         # (greedy after cuts is the logits' argmax: no chain to run)
    on_cpu = o0_on_the_cpu(src, x, **kw)
    assert np.array(on_gpu.token).tolist() == np.array(on_cpu.token).tolist(), src
    np.testing.assert_allclose(np.array(on_gpu.logprob), np.array(on_cpu.logprob), rtol=1e-4, atol=2e-4, err_msg=src)


@cuda
@pytest.mark.uncompiled
@pytest.mark.parametrize("B", [1, 3, 8])
def test_gpu_split_rows_equal_one_block_rows_and_cpu_O0(B, monkeypatch):
    """Split mode (a row over many blocks, the last block of the row running the chain over their candidates)
    against one block a row (SAMPLEC_GPU_SPLIT=0) on the GPU, and the token against -O0 on the CPU: the server
    chains, dynamic_temperature, typical_p twice and top_k_rank, chat-like rows at V = 152064."""
    from test_gpu_chain import SERVER_CHAINS, top_k_rank_rows
    rng = np.random.default_rng(B)
    V = 152064
    x = chat_rows(rng, B, V)
    chains = dict(SERVER_CHAINS)
    chains.update({"dyntemp": (["dynamic_temperature", "top_k", "top_p"], [0.8, 0.5, 1.0, 50, 0.9]),
                   "typical2": (["typical_p", "temperature", "typical_p"], [0.9, 0.7, 0.95]),
                   "rank": (["top_k_rank", "temperature"], [30, 0.8])})
    seeds = list(range(B))
    for name, (stages, vals) in chains.items():
        ops = [mx.array(v, dtype=mx.float32) for v in vals] + \
            [mx.array(np.array(seeds, dtype=np.uint64)), mx.array(3, dtype=mx.int32)]
        split = gpu.sample_chain(mx.array(x), ops, stages, "sample", True)
        monkeypatch.setenv("SAMPLEC_GPU_SPLIT", "0")
        one = gpu.sample_chain(mx.array(x), ops, stages, "sample", True)
        monkeypatch.delenv("SAMPLEC_GPU_SPLIT")
        assert np.array(split[0]).tolist() == np.array(one[0]).tolist(), name
        np.testing.assert_allclose(np.array(split[1]), np.array(one[1]), rtol=1e-4, atol=2e-4, err_msg=name)
        ranked = stages[:1] == ["top_k_rank"]
        rest, it, args, names = [], iter(vals[1:] if ranked else vals), {}, []
        for s in stages[1:] if ranked else stages:
            n = {"dynamic_temperature": 3, "xtc": 2}.get(s, 1)
            got = [next(it) for _ in range(n)]
            rest.append(f"{s}({', '.join(repr(int(v) if s == 'top_k' else v) for v in got)})")
        src = f"sampler s(seed: seed) -> token {{ {' '.join(rest)} sample(seed, position = 3) }}"
        with on_the_cpu():
            o0 = samplec.compile(src, opt_level=0, target="portable")(
                top_k_rank_rows(x, [int(vals[0])] * B) if ranked else x, seed=seeds)
        assert np.array(split[0]).ravel().tolist() == np.array(o0.token).tolist(), (name, src)


@cuda
@pytest.mark.uncompiled
@pytest.mark.parametrize("B,H,split", [(1, 300, "1"), (4, 64, "1"), (4, 2000, "0")])
def test_gpu_penalties_in_the_chain_kernel_equal_cpu_O0(B, H, split, monkeypatch):
    """A program's penalties (one a row), logit_bias and allow go into the chain kernel on the GPU (the region runs
    as its kernel, the edits handed to it) and give -O0's tokens on the CPU: V = 152064, padded, repeating
    histories; raw_logprob and top_logprobs read the kernel's maximum and log-sum-exp of the logits."""
    from test_gpu_chain import penalty_case
    monkeypatch.setenv("SAMPLEC_GPU_SPLIT", split)
    rng = np.random.default_rng(H)
    V = 152064
    x = chat_rows(rng, B, V)
    hist, pk = penalty_case(H, V, B, H, False)
    hist[:, :H // 2] = np.argsort(-x, axis=-1)[:, :H // 2]        # (the likely tokens penalized)
    src = ("sampler s(h: tokens, eb: bias, em: mask, ln: int, rp: float, fq: float, ps: float, seed: seed) "
           "-> token, logprob, raw_logprob, top_logprobs(5) {\n    logit_bias(eb)\n    allow(em)\n"
           "    penalties(h, last_n = ln, repeat = rp, frequency = fq, presence = ps)\n"
           "    top_k(50)\n    top_p(0.9)\n    temperature(0.8)\n    sample(seed, position = 3)\n}")
    kw = dict(h=hist, eb=(rng.standard_normal((B, V)) * 0.5).astype(np.float32), em=rng.random((B, V)) < 0.9,
              ln=pk["last_n"], rp=pk["rep"], fq=pk["freq"], ps=pk["pres"], seed=list(range(B)))
    kw["em"][np.arange(B), np.argmax(x, axis=-1)] = True
    edits = []
    real = gpu.sample_chain
    monkeypatch.setattr(gpu, "sample_chain",
                        lambda *a, **k: edits.append(tuple(e for e, _ in k.get("edits", ()))) or real(*a, **k))
    prog = samplec.compile(src, target="cuda")
    on_gpu = prog(x, **kw)
    assert ("cuda.chain", "kernel") in prog.kernel_trace() and edits[0] == ("logit_bias", "allow", "penalties")
    on_cpu = o0_on_the_cpu(src, x, **kw)
    assert np.array(on_gpu.token).tolist() == np.array(on_cpu.token).tolist()
    np.testing.assert_allclose(np.array(on_gpu.logprob), np.array(on_cpu.logprob), rtol=1e-4, atol=2e-4)
    # (the logits' maximum and log-sum-exp from the kernel, before the edits: raw_logprob and top_logprobs)
    np.testing.assert_allclose(np.array(on_gpu.raw_logprob), np.array(on_cpu.raw_logprob), rtol=1e-4, atol=2e-4)
    assert np.array(on_gpu.top_logprobs.ids).tolist() == np.array(on_cpu.top_logprobs.ids).tolist()
    np.testing.assert_allclose(np.array(on_gpu.top_logprobs.values), np.array(on_cpu.top_logprobs.values),
                               rtol=1e-4, atol=2e-4)


@cuda
@pytest.mark.parametrize("B,split", [(1, "1"), (4, "1"), (4, "0")])
def test_gpu_chain_kernel_writes_the_probs(B, split, monkeypatch):
    """The chain kernel's softmax of the final logits (a `probs` output: every token of the row written by the row's
    last block) after penalties and Hugging Face's stages, per-row values and large seeds, the program compiled as a
    user's is (MLX's compile on), against -O0 on the CPU."""
    monkeypatch.setenv("SAMPLEC_GPU_SPLIT", split)
    rng = np.random.default_rng(B)
    V = 152064
    x = chat_rows(rng, B, V)
    src = (ROOT / "examples" / "hf_generate.smp").read_text()
    rows = lambda v: [v] * B     # noqa: E731
    kw = dict(input_ids=rng.integers(0, V, (B, 64)).astype(np.int32), repetition_penalty=rows(1.1),
              temperature=rows(0.7), top_k=rows(50), top_p=rows(0.9), min_p=rows(0.05), typical_p=rows(1.0),
              seed=[int(s) for s in rng.integers(0, 2**63, B)], pos=[int(p) for p in rng.integers(0, 4000, B)])
    prog = samplec.compile(src, sampler="hf_generate", target="cuda")
    on_gpu = prog(x, **kw)
    assert ("cuda.chain", "kernel") in prog.kernel_trace()
    on_cpu = o0_on_the_cpu(src, x, "hf_generate", **kw)
    assert np.array(on_gpu.token).tolist() == np.array(on_cpu.token).tolist()
    np.testing.assert_allclose(np.array(on_gpu.logprob), np.array(on_cpu.logprob), rtol=1e-4, atol=2e-4)
    np.testing.assert_allclose(np.array(on_gpu.probs), np.array(on_cpu.probs), rtol=1e-4, atol=1e-6)
