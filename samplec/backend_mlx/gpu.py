"""GPU kernels (`mx.fast.cuda_kernel`) for the selection the dense definitions make in 32 dependent passes.

On a GPU every stage op runs its dense definition in MLX ops (the native CPU primitives stay off there). The
selection by count (`kth_largest`: top_k's threshold for any per-row k, and top_logprobs' and candidates' ids) is
32 rounds of a comparison and a reduction over the row -- ~100 small kernels -- where one block per row finds the
same value in four passes of an 8-bit radix histogram over the float32 values' order-preserving keys (the radix
select of FlashInfer's and vLLM's sort-free top-k). Counts are integers, so the result is the dense definition's,
bit for bit: on an H200 it equalled the dense definition and numpy on peaked, tied, -inf-heavy, signed-zero and
one- and two-token rows, and took 0.31 ms at V = 152064 against the dense definition's 1.1-2.0 ms (B = 1..64;
docs/performance.md, GPU). tests/test_gpu.py runs those checks where MLX's default device is a CUDA GPU; the CPU
never takes this path.

A selection by mass (top_p's floor) built the same way -- per-bin sums as 64-bit fixed-point integers, so that
they do not depend on the order threads add in -- was exact but no faster than the dense definition on the H200
(1.24 against 1.31 ms at B = 1: contended 64-bit shared-memory atomics), so top_p keeps its dense definition.

`SAMPLEC_GPU_KERNELS=0` (or off, false, no) turns the kernel off.
"""
from __future__ import annotations

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

