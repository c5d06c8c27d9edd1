"""The compile targets on a CUDA GPU (MLX's CUDA backend as the default device; skipped elsewhere): the portable
target (what an Apple GPU runs, MLX ops only) and the cuda target give, for every shipped example, the tokens of
-O0 on MLX's CPU, and which kernels ran is what the IR says."""
from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import samplec
from samplec.backend_mlx import gpu
from test_gpu import on_the_cpu
from test_targets import example_args

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = [(p.name, n) for p in sorted((ROOT / "examples").glob("*.smp"))
            for n in re.findall(r"^sampler\s+(\w+)", p.read_text(), re.M)]
cuda = pytest.mark.skipif(not gpu.available(), reason="needs MLX's CUDA backend as the default device")


@cuda
@pytest.mark.parametrize("target", ["portable", "cuda"])
@pytest.mark.parametrize("example,sampler", EXAMPLES, ids=[f"{e}:{s}" for e, s in EXAMPLES])
def test_target_on_the_gpu_equals_O0_on_the_cpu(example, sampler, target):
    source = (ROOT / "examples" / example).read_text()
    prog = samplec.compile(source, sampler, target=target)
    x, kw = example_args(prog, B=4, V=32000)
    got = prog(x, **kw)
    with mx.stream(mx.cpu), on_the_cpu():
        want = samplec.compile(source, sampler, opt_level=0, target="portable")(x, **kw)
    np.testing.assert_array_equal(np.array(got.token), np.array(want.token))
    if "logprob" in want.names():
        np.testing.assert_allclose(np.array(got.logprob), np.array(want.logprob), atol=2e-4, rtol=1e-4)
    trace = prog.kernel_trace()
    assert not [t for t in trace if t[1] == "definitions"], trace
    if target == "portable":
        assert not [t for t in trace if t[0] == "definition"], trace
    else:
        assert all(how == "kernel" for kernel, how in trace if kernel == "cuda.chain"), trace
