"""CUDA kernels (`mx.fast.cuda_kernel`): a chain of stages as one kernel, and the selection by count.

On a GPU the native CPU primitives stay off; a stage op the chain kernel (below) does not cover runs its dense
definition in MLX ops. The selection by count (`kth_largest`: top_k's threshold for any per-row k, and
top_logprobs' and candidates' ids) is 32 rounds of a comparison and a reduction over the row -- ~100 small
kernels -- where one block per row finds the same value in four passes of an 8-bit radix histogram over the
float32 values' order-preserving keys (the radix select of FlashInfer's and vLLM's sort-free top-k). Counts are
integers, so the result is the dense definition's, bit for bit: on an H200 it equalled the dense definition and numpy on peaked, tied, -inf-heavy, signed-zero and
one- and two-token rows, and took 0.31 ms at V = 152064 against the dense definition's 1.1-2.0 ms (B = 1..64;
docs/performance.md, GPU). tests/test_gpu.py runs those checks where MLX's default device is a CUDA GPU; the CPU
never takes this path.

A selection by mass (top_p's floor) built the same way -- per-bin sums as 64-bit fixed-point integers, so that
they do not depend on the order threads add in -- was exact but no faster than the dense definition on the H200
(1.24 against 1.31 ms at B = 1: contended 64-bit shared-memory atomics), so a top_p outside a chain keeps its
dense definition.

The chain kernel (`sample_chain`, gpu_chain.cu) runs a chain of temperature, top_k, top_p, min_p, xtc,
top_n_sigma, epsilon and eta stages in any order, with per-row run-time values, and its draw (sample or greedy)
and the token's log-probability (and the final logits or their softmax where a program reads them), as one block
per row: the kept tokens stay an upper set of the raw logits (a threshold rho per row), each stage one or a few
passes over the row (or over the at most 4,096 tokens a cut left, gathered in shared memory), thresholds by radix
selects over the float32 keys: on an H200, HF's and vLLM's orders in ~0.5 ms at B = 1 against 4-5 ms on the dense
definitions (docs/performance.md, GPU). The interpreter gives it a chain's stage ops where MLX's default device is
a CUDA GPU (the CPU has the native chain kernel); the masks, biases and penalties below the stages and the outputs
beside them (raw_logprob, top_logprobs) run as MLX ops.

`SAMPLEC_GPU_KERNELS=0` (or off, false, no) turns the kernels off; `SAMPLEC_GPU_CHAIN=0` the chain kernel alone
(the stages then run their dense definitions, with the radix select for top_k).
"""
from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from samplec.backend_mlx import native

THREADS = 1024

# One block per row. keys: the float32 bits made order-preserving as unsigned ints (-0.0 read as 0.0, as
# kernels._ordered does). Each pass histograms the next 8 bits of the keys that share the prefix found so far
# (warp-aggregated shared-memory atomics: a peaked row puts most keys in one bin), then one warp finds the bin
# holding the need-th largest key by a suffix scan over the 256 bins.
_KTH_SOURCE = r"""
    __shared__ unsigned int hist[256];
    __shared__ unsigned int s_prefix;
    __shared__ unsigned int s_need;
    const int row = blockIdx.x;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int V = x_shape[1];
    const float* xr = x + (size_t)row * V;
    unsigned int need = (unsigned int)k[row];
    unsigned int prefix = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0u;
        __syncthreads();
        const unsigned int himask = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
        for (int base = 0; base < V; base += blockDim.x) {
            const int i = base + tid;
            int bin = -1;
            if (i < V) {
                float v = xr[i];
                unsigned int b = __float_as_uint(v == 0.0f ? 0.0f : v);
                unsigned int key = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
                if ((key & himask) == prefix) bin = (int)((key >> shift) & 255u);
            }
            // (every lane gets here: the loop's trip count is the same for all, blockDim a multiple of 32)
            const unsigned int same = __match_any_sync(0xFFFFFFFFu, bin);
            if (bin >= 0 && lane == __ffs(same) - 1) atomicAdd(&hist[bin], (unsigned int)__popc(same));
        }
        __syncthreads();
        if (tid < 32) {
            // bins 255 - 8 * tid - j, j = 0..7: this lane's slice of the bins from the top
            unsigned int c[8];
            unsigned int mine = 0u;
            for (int j = 0; j < 8; ++j) { c[j] = hist[255 - 8 * tid - j]; mine += c[j]; }
            unsigned int incl = mine;
            for (int off = 1; off < 32; off <<= 1) {
                unsigned int up = __shfl_up_sync(0xFFFFFFFFu, incl, off);
                if (tid >= off) incl += up;
            }
            const unsigned int excl = incl - mine;
            const unsigned int hit = __ballot_sync(0xFFFFFFFFu, incl >= need && excl < need);
            const int owner = hit ? __ffs(hit) - 1 : 31;
            if (tid == owner) {
                unsigned int acc = excl;
                int j = 0;
                for (; j < 7; ++j) { if (acc + c[j] >= need) break; acc += c[j]; }
                s_prefix = prefix | ((unsigned int)(255 - 8 * tid - j) << shift);
                s_need = need - acc;
            }
        }
        __syncthreads();
        prefix = s_prefix;
        need = s_need;
        __syncthreads();
    }
    if (tid == 0) {
        unsigned int bits = (prefix >= 0x80000000u) ? (prefix & 0x7FFFFFFFu) : ~prefix;
        out[row] = prefix < 0x007FFFFFu ? __int_as_float(0xff800000) : __uint_as_float(bits);
    }
"""

_kernels: dict[str, object] = {}


def switched_off() -> bool:
    return native.switched_off("SAMPLEC_GPU_KERNELS")


def available() -> bool:
    """The CUDA kernel applies: MLX's default device is a CUDA GPU and SAMPLEC_GPU_KERNELS is not switched off."""
    if switched_off():
        return False
    if mx.default_device() != mx.gpu:
        return False
    try:
        return bool(mx.cuda.is_available())
    except AttributeError:
        return False


def _kernel(name: str, inputs: list[str], source: str):
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=["out"], source=source)
    return _kernels[name]


def kth_largest(x: mx.array, want: mx.array) -> mx.array | None:
    """The want-th largest value of each row of x (f32 [B, V]; want i32 broadcastable to [B, 1], already in
    [1, V]) as f32 [B, 1], or None where the kernel does not apply."""
    if not (available() and x.ndim == 2 and x.dtype == mx.float32 and x.shape[0] >= 1 and x.shape[1] >= 1
            and (want.ndim == 0 or (want.ndim <= 2 and want.shape[-1] == 1 and want.size in (1, x.shape[0])))):
        return None         # (k's other shapes broadcast x's rows: the dense definition)
    B = x.shape[0]
    k = mx.broadcast_to(want.astype(mx.int32).reshape(-1), (B,))
    out = _kernel("samplec_kth_largest", ["x", "k"], _KTH_SOURCE)(
        inputs=[x, k], output_shapes=[(B,)], output_dtypes=[mx.float32],
        grid=(B * THREADS, 1, 1), threadgroup=(THREADS, 1, 1))[0]
    return out.reshape(B, 1)


# -- the chain kernel ----------------------------------------------------------------------------------------------

CHAIN_SOURCE = Path(__file__).with_name("gpu_chain.cu")
CHAIN_THREADS = 512             # gpu_chain.cu's SC_T
CHAIN_STAGES = {"temperature": 1, "top_k": 1, "top_p": 1, "min_p": 1, "xtc": 2,       # float operands each
                "top_n_sigma": 1, "epsilon": 1, "eta": 1}
MAX_TEMPERATURES = 8            # gpu_chain.cu's SC_MAX_TEMPS


def chain_header() -> str:
    return CHAIN_SOURCE.read_text()


def chain_supports(stages: list[str], terminal: str) -> bool:
    return all(s in CHAIN_STAGES for s in stages) and terminal in ("sample", "greedy", "argmax") and \
        stages.count("temperature") <= MAX_TEMPERATURES


STAGE_CODES = {name: i for i, name in enumerate(CHAIN_STAGES)}      # gpu_chain.cu's sc_chain switch


def chain_codes(stages: list[str], terminal: str, want_logprob: bool, out_x: int = 0) -> list[int]:
    """The kernel's program for one chain: [#stages, sample?, want_logprob?, #float operands, #u32 operands, out_x
    (0: no [B, V] output, 1: the final logits, 2: their softmax), the stages' codes...] (one kernel serves every
    chain: one NVRTC compile per process)."""
    nf = max(1, sum(CHAIN_STAGES[s] for s in stages))
    nu = max(1, 3 * (stages.count("xtc") + (terminal == "sample")))
    return [len(stages), int(terminal == "sample"), int(want_logprob), nf, nu, out_x] + \
        [STAGE_CODES[s] for s in stages]


# The body: inputs x [B, V] f32, P [B, nf] f32 (the stages' float operands in order; top_k's k as a float), U [B,
# nu] u32 (each xtc's and the sample's key words and position), S (chain_codes); outputs tok [B] i32, lp [B] f32,
# xo [B, V] f32 where S asks for the final logits or their softmax (else [B, 1], unwritten).
CHAIN_BODY = """
    __shared__ ScShared sh;
    const int V = x_shape[1];
    sc_chain(x + (size_t)blockIdx.x * V, V, P, U, S, blockIdx.x, sh, tok + blockIdx.x, lp + blockIdx.x,
             xo + (S[5] != 0 ? (size_t)blockIdx.x * V : (size_t)blockIdx.x));
"""


def _column(p: mx.array, B: int, dtype) -> mx.array | None:
    if not (p.ndim <= 2 and p.size in (1, B) and (p.ndim < 2 or p.shape[-1] == 1)):
        return None
    return mx.broadcast_to(p.reshape(-1).astype(dtype), (B,))


def chain_operands(params: list[mx.array], stages: list[str], terminal: str, B: int):
    """(P, U) for the chain kernel from a chain's stage operands in order (then the sample's seed and position),
    or None where one is not a scalar or one value per row."""
    fcols, ucols, it = [], [], iter(params)

    def key_and_position():
        seed, pos = next(it), next(it)
        s, q = _column(seed, B, mx.uint64), _column(pos, B, mx.int32)
        if s is None or q is None:
            return False
        ucols.extend([(s >> 32).astype(mx.uint32), (s & 0xFFFFFFFF).astype(mx.uint32), q.astype(mx.uint32)])
        return True

    for s in stages:
        for _ in range(CHAIN_STAGES[s]):
            c = _column(next(it), B, mx.float32)
            if c is None:
                return None
            fcols.append(c)
        if s == "xtc" and not key_and_position():
            return None
    if terminal == "sample" and not key_and_position():
        return None
    P = mx.stack(fcols, axis=1) if fcols else mx.zeros((B, 1), dtype=mx.float32)
    U = mx.stack(ucols, axis=1) if ucols else mx.zeros((B, 1), dtype=mx.uint32)
    return P, U


def sample_chain(x: mx.array, params: list[mx.array], stages: list[str], terminal: str,
                 want_logprob: bool, out_x: int = 0) -> tuple[mx.array, ...] | None:
    """The chain's token [B, 1] i32 and its log-probability under the final softmax [B, 1] f32 (0 without
    want_logprob), and with out_x the final logits (1) or their softmax (2) [B, V]; or None where the kernel does
    not apply (not a CUDA device, a stage it does not run, operands of other shapes)."""
    if not (available() and not native.switched_off("SAMPLEC_GPU_CHAIN") and x.ndim == 2 and
            x.dtype == mx.float32 and x.shape[0] >= 1 and x.shape[1] >= 1 and chain_supports(stages, terminal)):
        return None
    B = x.shape[0]
    ops = chain_operands(params, stages, terminal, B)
    if ops is None:
        return None
    if "samplec_chain" not in _kernels:
        _kernels["samplec_chain"] = mx.fast.cuda_kernel(
            name="samplec_chain", input_names=["x", "P", "U", "S"], output_names=["tok", "lp", "xo"],
            source=CHAIN_BODY, header=chain_header())
    codes = mx.array(chain_codes(stages, terminal, want_logprob, out_x), dtype=mx.int32)
    tok, lp, xo = _kernels["samplec_chain"](
        inputs=[x, *ops, codes], output_shapes=[(B,), (B,), x.shape if out_x else (B, 1)],
        output_dtypes=[mx.int32, mx.float32, mx.float32],
        grid=(B * CHAIN_THREADS, 1, 1), threadgroup=(CHAIN_THREADS, 1, 1))
    return (tok.reshape(B, 1), lp.reshape(B, 1)) + ((xo,) if out_x else ())
