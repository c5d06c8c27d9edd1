"""GPU kernels (`mx.fast.cuda_kernel`, `mx.fast.metal_kernel`): a chain of stages as one kernel, top_logprobs' ids and
values and DRY beside it, and the selection by count (CUDA).

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
top_n_sigma, epsilon, eta, typical_p (up to four), dynamic_temperature and top_k_rank stages in any order, with
per-row run-time values, and its draw (sample or greedy) and the token's log-probability (and the final logits or
their softmax where a program reads them). The kept tokens stay an upper set of the raw logits (a threshold rho per
row; xtc's survivor, typical_p's bands and top_k_rank's ties remove ranges below the maximum); each stage is one or a
few passes over the row, or over the at most 4,096 candidates a cut left in shared memory; thresholds come from radix
selects over the float32 keys. The stage codes, off rules and Threefry constants are the stage table's
(samplec/stage_table.py, generated into stage_table.h, which chain_header() puts before the source).

At small B one block a row leaves most of the GPU idle, so the kernel runs in split mode (`split_of`): each row over
up to 128 blocks, about one a multiprocessor over the batch. Each block reads its slice once -- its largest logits
(each thread its four, then the block's `cap` by a radix select in shared memory) and the slice's softmax, entropy,
Welford and Gumbel aggregates under the chain's prologue (its leading temperatures and the stages off for the row)
-- into a scratch buffer; the block that arrives last for its row (a counter per row; MLX zeroes the outputs first:
init_value) runs the chain over the gathered candidates. Every token outside them lies at or below beta, the largest
logit a slice left out, so once a cut's threshold is above beta the candidates are exact; before that, a stage that
needs the tokens outside (a cut at or below beta, typical_p, an xtc that fires, a normalizer under a later
temperature) reruns the row on the whole-row passes, so tokens never depend on the split. `SAMPLEC_GPU_SPLIT=0` runs
one block a row; `SAMPLEC_GPU_SMS` sets the multiprocessors to fill (default 132, an H100's).

The interpreter gives the kernel a chain's stage ops on the `cuda` target (the CPU has the native chain kernel), with
the edits below them: a logit_bias (a dense bias, or a literal one's constant row), an allow (a bool mask or a
packed int32 bitmask) and up to MAX_PENALTIES penalties stages (their histories side by side in one row;
sample_chain's `edits`: each block
writes its part of the edited row to the scratch, counts the history's tokens in its part and writes their
penalized logits, before the stages read it), each stage's check (pf) and the edited row's maximum (rs[0]: the top
edit's check); and, asked for, the logits' own maximum and log-sum-exp (rs[1], rs[2]: the logits checks' maximum,
raw_logprob's and top_logprobs' normalizer) from one more pass over the row as the model gave it, and the logit at
the token (rs[3]: raw_logprob is (rs[3] - rs[1]) - rs[2], no gather beside the kernel). top_logprobs' ids and values
are one more kernel beside it (`top_logprobs`, gpu_top_logprobs.cu: one block a row selects the k + 8 largest logits
and ranks them by their log-probabilities), and so is DRY (the `dry` op, gpu_dry.cu: one block a row walks the
history's window back and writes the penalized row the chain kernel reads). The stage operands go in as the program holds
them (ten f32 slots, two seed and position slots, each one value or one per row): at B = 1 a few small ops to pack
them cost more than the kernel's work.

One kernel source serves CUDA and Metal: gpu_chain.cu is written over a thin dialect layer (simt_cuda.h,
simt_metal.h: address spaces, barriers, shuffles, atomics, float math), and chain_entry(dialect) writes each
language's body around it (its indices, its shared-state declaration). The Metal build (`mx.fast.metal_kernel`,
one threadgroup a row) has not run on Apple hardware: it is opt-in (SAMPLEC_METAL_KERNEL=1, metal_status), and the
metal target's pass does not hand chains to it yet, so Apple GPUs run the portable target's MLX ops (`samplec
doctor` says which path is active and why). tests/test_gpu_chain.py runs both dialects on the CPU against the dense
definitions; tests/test_cuda_compile.py compiles the CUDA one with NVRTC and checks the Metal one's address spaces
with clang.

`SAMPLEC_GPU_KERNELS=0` (or off, false, no) turns the kernels off; `SAMPLEC_GPU_CHAIN=0` the chain kernel alone
(the stages then run their dense definitions, with the radix select for top_k).
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from samplec import stage_table
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


def ptx_cache_dir() -> Path:
    """Where MLX's CUDA backend keeps the kernels NVRTC compiled (its jit_module's rule): MLX_PTX_CACHE_DIR, else
    $TMPDIR (or /tmp)/mlx/<MLX's version>/ptx."""
    given = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(given) if given else Path(os.environ.get("TMPDIR") or "/tmp") / "mlx" / mx.__version__ / "ptx"


def first_compile_notice(kernel_name: str) -> str | None:
    """What to tell a user whose call waits for NVRTC (the chain kernel takes it minutes), or None where MLX has
    the kernel compiled already: the first use on a machine, or after an upgrade changed the kernel."""
    path = ptx_cache_dir() / f"custom_kernel_{kernel_name}.ptx"
    if path.exists():
        return None
    return (f"samplec: compiling the CUDA chain kernel with NVRTC (its first use on this machine or since an upgrade: "
            f"a few minutes, once); MLX keeps it in {path.parent} (MLX_PTX_CACHE_DIR sets the folder)")


def _kernel_name(name: str, inputs: list[str], source: str, outputs: tuple, header: str) -> str:
    return f"{name}_" + hashlib.sha256("\0".join([header, source, *inputs, *outputs]).encode()).hexdigest()[:12]


def chain_kernel_name() -> str:
    """The chain kernel's name as MLX keeps it compiled (`_kernel`)."""
    return _kernel_name("samplec_chain", INPUT_NAMES, CHAIN_BODY, CHAIN_OUTPUTS, chain_header())


def _kernel(name: str, inputs: list[str], source: str, outputs: tuple = ("out",), header: str = ""):
    """MLX's CUDA kernel object for a source, made once a process. Its name carries a digest of the source: MLX
    keeps compiled kernels on disk by name alone (MLX_PTX_CACHE_DIR, else $TMPDIR/mlx/<version>/ptx), so a kernel
    an upgrade changed must not load the old one. (The name does not follow the inputs' dtypes: callers cast each
    input to the one dtype its kernel is written for: `_slot`.)"""
    if name not in _kernels:
        full = _kernel_name(name, inputs, source, outputs, header)
        notice = first_compile_notice(full) if name == "samplec_chain" else None
        if notice:
            print(notice, file=sys.stderr, flush=True)
        _kernels[name] = mx.fast.cuda_kernel(name=full, input_names=inputs,
                                             output_names=list(outputs), source=source, header=header)
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
                "top_n_sigma": 1, "epsilon": 1, "eta": 1, "typical_p": 1, "dynamic_temperature": 3,
                "top_k_rank": 1}
MAX_TEMPERATURES = 8            # gpu_chain.cu's SC_MAX_TEMPS (temperature and dynamic_temperature stages)
MAX_TYPICAL = 4                 # SC_MAX_BANDS


STAGE_TABLE = Path(__file__).with_name("stage_table.h")      # generated by scripts/gen_stage_table.py
DIALECT_HEADERS = {"cuda": Path(__file__).with_name("simt_cuda.h"), "metal": Path(__file__).with_name("simt_metal.h")}


@functools.cache
def chain_header(dialect: str = "cuda") -> str:
    """The kernel's header in `dialect` (cuda, metal): the generated stage table (codes, off rules, Threefry's
    constants), the dialect's layer (simt_cuda.h, simt_metal.h), then the one kernel source, gpu_chain.cu (NVRTC and
    Metal each get one text: no include path)."""
    return "\n".join(p.read_text() for p in (STAGE_TABLE, DIALECT_HEADERS[dialect], CHAIN_SOURCE))


def chain_supports(stages: list[str], terminal: str) -> bool:
    return all(s in CHAIN_STAGES for s in stages) and terminal in ("sample", "greedy", "argmax") and \
        stages.count("temperature") + stages.count("dynamic_temperature") <= MAX_TEMPERATURES and \
        sum(CHAIN_STAGES[s] for s in stages) <= CHAIN_FLOAT_SLOTS and \
        stages.count("xtc") + (terminal == "sample") <= CHAIN_KEY_SLOTS and \
        stages.count("typical_p") <= MAX_TYPICAL and stages.count("top_k_rank") <= 1    # (one tie rule a row)


STAGE_CODES = {name: stage_table.STAGE_CODES[name] for name in CHAIN_STAGES}    # the stage table's (sc_stages)
CHAIN_FLOAT_SLOTS = 10          # gpu_chain.cu's SC_FSLOTS: the float operands' inputs F0..F9
CHAIN_KEY_SLOTS = 2             # SC_KSLOTS: the (seed, position) inputs K0, Q0 and K1, Q1 (xtc's, the sample's)
_SLOTS = [f"F{i}" for i in range(CHAIN_FLOAT_SLOTS)] + [f"K{i}" for i in range(CHAIN_KEY_SLOTS)] + \
    [f"Q{i}" for i in range(CHAIN_KEY_SLOTS)]
# logit_bias's bias, allow's bool mask, allow's packed bits; the penalties' history, last_n, repeat, frequency and
# presence
# penalties stages' histories and their values (PV_STAGE a stage, as floats)
EDIT_SLOTS = ["EB", "EM", "EW", "PH", "PV"]
EDIT_CODES = 9                  # S's last words: logit_bias?, its stride, allow's kind, its stride, penalties
#                                 stages, the history's stride, logit_bias after them?, PV's stride, allow after them?
MAX_PENALTIES = 4               # penalties stages the kernel applies in order (gpu_chain.cu's SC_MAX_PEN)
INPUT_NAMES = ["x", *_SLOTS, *EDIT_SLOTS, "S"]


def chain_codes(stages: list[str], terminal: str, want_logprob: bool, out_x: int = 0,
                per_row: tuple = (), split: tuple[int, int] = (0, 0), edits: tuple = (0,) * EDIT_CODES,
                raw: bool = False) -> list[int]:
    """The kernel's program for one chain: [#stages, sample?, want_logprob?, #float operands, #key words, out_x (0:
    no [B, V] output, 1: the final logits, 2: their softmax), slices a row (0: one block a row), candidates a slice
    keeps, the stages' codes..., then each operand slot's stride (F0..F9, K0, K1, Q0, Q1: 1 where it holds one value
    per row, 0 for one value; per_row's flags), then the edits (_edit_slots): logit_bias? (1: EB holds it), its stride
    (1: a row each), allow's kind (0: none, 1: EM's bools, 2: EW's packed bits), its stride, penalties stages (PH: their
    history, PV: their values), the history's stride, logit_bias after the penalties? (else before them), PV's stride,
    allow after the penalties?, then raw?: the logits' maximum and log-sum-exp before the edits] (one kernel
    serves every chain: one NVRTC compile per process)."""
    nf = max(1, sum(CHAIN_STAGES[s] for s in stages))
    nu = max(1, 3 * (stages.count("xtc") + (terminal == "sample")))
    strides = [int(f) for f in per_row] + [0] * (len(_SLOTS) - len(per_row))
    return [len(stages), int(terminal == "sample"), int(want_logprob), nf, nu, out_x, *split] + \
        [STAGE_CODES[s] for s in stages] + strides + list(edits) + [int(raw)]


SMS = 132                       # multiprocessors to fill (an H100's; SAMPLEC_GPU_SMS overrides)
MAX_SLICES = 128                # gpu_chain.cu's SC_MAXNB
SLICE_HEADER = 12               # SC_WH
KEEP_A_THREAD = 4               # SC_R


def split_of(B: int, V: int, threads: int = CHAIN_THREADS, cap_total: int | None = None) -> tuple[int, int]:
    """(slices a row, candidates a slice keeps): about one block for each multiprocessor over the batch (the
    kernel's ~120 registers a thread let one block of 512 threads run on a multiprocessor at a time: sm_90's build),
    slices of at least two tokens a thread, every slice's candidates fitting the last block's shared memory
    together, and no more slices than a block has threads (the last block reads one slice's header a thread)."""
    sms = int(os.environ.get("SAMPLEC_GPU_SMS", SMS))
    nb = max(1, min(MAX_SLICES, threads, -(-sms // B), V // (2 * threads)))
    return nb, min((cap_total or SC_CAP) // nb, KEEP_A_THREAD * threads)


SC_CAP = 4096                   # simt_cuda.h's SC_CAP: candidates in shared memory
METAL_THREADS = 256             # simt_metal.h's SC_T
METAL_CAP = 2048                # simt_metal.h's SC_CAP (Metal's 32 KB of threadgroup memory)
DIALECT_THREADS = {"cuda": CHAIN_THREADS, "metal": METAL_THREADS}
DIALECT_CAP = {"cuda": SC_CAP, "metal": METAL_CAP}


# The kernel body each language's signature wraps (MLX writes the signature from the inputs and outputs): inputs x [B,
# V] f32; F0..F9 f32 (the stages' float operands in order, top_k's k as a float), K0, K1 u64 and Q0, Q1 i32 (each xtc's
# and then the sample's seed and position), each one value or one per row, unused slots one placeholder value; EB f32,
# EM bool, EW i32, PH i32, PV f32 (the edits before the stages: logit_bias's bias, allow's mask as bools or packed bits,
# each one row or one per row; the penalties stages' histories side by side [1 or B, H] -- the kernel reads its shape --
# and their values [1 or B, PV_STAGE a stage]; placeholders where absent); S (chain_codes). Outputs tok [B] i32, lp [B]
# f32, xo [B, V] f32 where S asks for the final logits or their softmax (else [B, 1], unwritten), pf [B, stages] bool
# (the penalties' checks, where S has them), rs [B, 4] f32 (the edited row's maximum, where S has edits; the logits'
# maximum and log-sum-exp and the logit at the token, where S asks for them), ws (scratch_size). The operands go in
# as the program holds them (no op gathers them first: at B = 1 a few small ops cost more than the kernel). One text
# for both languages: a dialect differs only in the fields below (its shared-state declaration, its thread and block
# indices, a check of its own), as tinygrad's CUDA and Metal renderers differ in a few fields over one renderer.
CHAIN_ENTRY = """
    {shared} ScShared sh;
    const int tx = (int){thread}, blk = (int){block};
    const int B = x_shape[0], V = x_shape[1], NB = S[6], cap = S[7];
    const int row = NB > 0 ? blk / NB : blk, slice = NB > 0 ? blk % NB : 0;{check}
    const SC_DEV int* st = S + 8 + S[0];
    const float pr[SC_FSLOTS] = {{
        sc_operand_f(F0, st[0], row), sc_operand_f(F1, st[1], row), sc_operand_f(F2, st[2], row),
        sc_operand_f(F3, st[3], row), sc_operand_f(F4, st[4], row), sc_operand_f(F5, st[5], row),
        sc_operand_f(F6, st[6], row), sc_operand_f(F7, st[7], row), sc_operand_f(F8, st[8], row),
        sc_operand_f(F9, st[9], row)}};
    const sc_u64 k0 = sc_operand_u64(K0, st[SC_FSLOTS], row), k1 = sc_operand_u64(K1, st[SC_FSLOTS + 1], row);
    const unsigned ur[3 * SC_KSLOTS] = {{
        (unsigned)(k0 >> 32), (unsigned)k0, (unsigned)sc_operand_i(Q0, st[SC_FSLOTS + 2], row),
        (unsigned)(k1 >> 32), (unsigned)k1, (unsigned)sc_operand_i(Q1, st[SC_FSLOTS + 3], row)}};
    // the edits (chain_codes' last words: logit_bias?, its stride, allow's kind -- 1: bool, 2: packed bits --, its
    // stride, penalties?, the history's stride, logit_bias after the penalties?, the penalties' operands' strides)
    const SC_DEV int* ed = st + SC_FSLOTS + 2 * SC_KSLOTS;
    ScEdits e;
    e.eb = ed[0] ? EB + (size_t)(ed[1] ? row : 0) * V : nullptr;
    e.em = ed[2] == 1 ? EM + (size_t)(ed[3] ? row : 0) * V : nullptr;
    e.ew = ed[2] == 2 ? EW + (size_t)(ed[3] ? row : 0) * ((V + 31) / 32) : nullptr;
    e.L = PH_shape[1];
    e.np = ed[4];
    e.ph = e.np ? PH + (size_t)(ed[5] ? row : 0) * e.L : nullptr;
    e.bias_after = ed[6];
    e.pv = PV + (size_t)(ed[7] ? row : 0) * (6 * e.np > 8 ? 6 * e.np : 8);    // (rows of at least eight values)
    e.allow_after = ed[8];
    e.pf = pf + (size_t)row * (e.np > 0 ? e.np : 1);
    // ws: the rows' arrival counters [B], then the slices' headers and candidates' logits (float bits), then their
    // ids, then the edited rows, then the penalties' check counts, two a stage and row, then each block's maximum of
    // its part of the edited row (scratch_size)
    SC_DEV float* wf = reinterpret_cast<SC_DEV float*>(ws + B);
    SC_DEV int* wi = ws + B + (size_t)B * NB * (SC_WH + cap);
    SC_DEV float* xe = reinterpret_cast<SC_DEV float*>(ws + B + (size_t)B * NB * (SC_WH + 2 * cap)) + (size_t)row * V;
    e.pc = ws + B + (size_t)B * NB * (SC_WH + 2 * cap) + (size_t)B * V + 2 * SC_MAX_PEN * row;
    e.rmax = rs + 4 * row;
    e.pmax = reinterpret_cast<SC_DEV float*>(ws + B + (size_t)B * NB * (SC_WH + 2 * cap) + (size_t)B * V +
                                           (size_t)B * 2 * SC_MAX_PEN) + (size_t)row * NB;
    // (then, where S asks for the logits' maximum and log-sum-exp in split mode, the slices' parts of them, three
    // a slice, after the edits' words where the chain has edits)
    const size_t edited = sc_has_edits(e) ? (size_t)B * V + (size_t)B * (2 * SC_MAX_PEN + NB) : 0;
    SC_DEV float* raw = reinterpret_cast<SC_DEV float*>(ws + B + (size_t)B * NB * (SC_WH + 2 * cap) + edited) +
                        (size_t)row * NB * 3;
    sc_chain(x + (size_t)row * V, V, pr, ur, S, sh, tx, tok + row, lp + row,
             xo + (S[5] != 0 ? (size_t)row * V : (size_t)row), slice, wf + (size_t)row * NB * (SC_WH + cap),
             wi + (size_t)row * NB * cap, ws + row, e, xe, ed[SC_EDIT_CODES] ? rs + 4 * row : nullptr, raw);
"""

# The dialects' fields. Metal's indices are the kernel's attributes (MLX declares those the body names); its check:
# the kernel's warp arithmetic is for simdgroups of 32 (Apple GPUs'), so another width answers token -2 (the first
# call's probe reads it: metal_status).
DIALECTS = {
    "cuda": {"shared": "__shared__", "thread": "threadIdx.x", "block": "blockIdx.x", "check": ""},
    "metal": {"shared": "threadgroup", "thread": "thread_position_in_threadgroup.x",
              "block": "threadgroup_position_in_grid.x",
              "check": "\n    if (threads_per_simdgroup != 32) {\n      if (tx == 0) tok[row] = -2;\n"
                       "      return;\n    }"},
}


def chain_entry(dialect: str = "cuda") -> str:
    """The chain kernel's body in `dialect` (cuda, metal): what MLX wraps in the kernel's signature."""
    return CHAIN_ENTRY.format(**DIALECTS[dialect])


CHAIN_BODY = chain_entry("cuda")

_PLACEHOLDERS: dict = {}
_CODES: dict = {}


_NP = {mx.float32: np.float32, mx.int32: np.int32, mx.uint64: np.uint64, mx.bool_: np.bool_}


def _placeholder(dtype, n: int = 1, rows: int = 0) -> mx.array:
    """An unused slot's input: n zeros (the edits' eight: Metal passes fewer in the constant address space), as
    [rows, n] where rows (the history's: the kernel reads its shape)."""
    if (dtype, n, rows) not in _PLACEHOLDERS:
        _PLACEHOLDERS[dtype, n, rows] = mx.array(np.zeros((rows, n) if rows else (n,), dtype=_NP[dtype]))
    return _PLACEHOLDERS[dtype, n, rows]


INT_BITS = 2                    # a float slot's stride word: bit 0 one value a row, bit 1 an integer's bits


def _slot(p: mx.array, B: int, dtype, ints: bool = False, bits: bool = False) -> tuple[mx.array, int] | None:
    """An operand as the kernel reads it (one value, or one a row) and its stride word (1 where it is one a row);
    None otherwise. Where a cast would be a launch a call, an int32 operand goes in as it is (`ints`: an elementwise
    kernel converts it as it reads it) or as its bits viewed as float32 (`bits`: the stride word's INT_BITS tells the
    chain kernel's float slot to convert them -- MLX writes each input's type in a kernel's signature, and keeps
    one compiled kernel a name: the slots stay float, so every chain runs one kernel, compiled once)."""
    from samplec.backend_mlx.kernels import constant_as
    if not (p.ndim <= 2 and p.size in (1, B) and (p.ndim < 2 or p.shape[-1] == 1)):
        return None
    word = int(p.size == B and B > 1)
    if bits and dtype == mx.float32 and p.dtype == mx.int32:
        return p.view(mx.float32), word | INT_BITS
    if p.dtype != dtype and not (ints and p.dtype == mx.int32):
        p = constant_as(p, dtype) or p.astype(dtype)    # (a literal's cast is a constant of the call too)
    return p, word


PV_STAGE = 6                    # PV's values a penalties stage: last_n, repeat, frequency, presence, the offset and
#                                 the length of its history in PH's row


def _penalty_values(stages, B: int) -> tuple[mx.array, bool] | None:
    """PV: each penalties stage's (last_n, repeat, frequency, presence, offset, length) as floats, [1 or B, PV_STAGE a
    stage, at least 8], and whether it holds one row each; None where an operand is neither one value nor one a row.
    One elementwise kernel packs them (each column a selection among the values by a tree of `where`s over the
    column index, an integer converted as it is read), rather than a cast of each integer and a concatenation (a
    launch each). (Integers as floats: exact below 2**24, and a window past the history's length is all of it either
    way.)"""
    from samplec.backend_mlx.kernels import constant
    ops = [_slot(v, B, mx.float32, ints=True) if isinstance(v, mx.array) else
           (constant(("pv", repr(float(v))), lambda v=v: mx.array(float(v), dtype=mx.float32)), False)
           for st in stages for v in st]
    if None in ops:
        return None
    rows = any(per_row for _, per_row in ops)
    # (at least eight values: Metal would pass fewer in the constant address space)
    vals = [v.reshape(-1, 1) for v, _ in ops] + [_placeholder(mx.float32, 1, rows=1)] * max(0, 8 - len(ops))
    n = len(vals)
    col = constant(("pv_columns", n), lambda: mx.arange(n, dtype=mx.int32)[None, :])

    def pick(lo: int, hi: int) -> mx.array:
        if hi - lo == 1:
            v = vals[lo]
            return v if v.dtype == mx.float32 else v.astype(mx.float32)
        mid = (lo + hi) // 2
        return mx.where(col < mid, pick(lo, mid), pick(mid, hi))
    pv = pick(0, n)
    return (pv if pv.shape[1] == n else mx.broadcast_to(pv, (pv.shape[0], n))), rows


def _histories(pens, B: int) -> tuple[mx.array, list[tuple[int, int]]] | None:
    """PH and each stage's (offset, length) in its row: the stages' one history as it is, or their histories side by
    side (one op: a concatenation; a shared one broadcast to every row where another has a row each); None where one
    is not i32-castable [1 or B, H >= 1]."""
    hists: list = []
    for p in pens:
        h = p[0]
        if h.ndim != 2 or h.shape[0] not in (1, B) or h.shape[1] < 1:
            return None
        if not any(h is g for g in hists):
            hists.append(h)
    at, offsets = {}, []
    for h in hists:
        at[id(h)] = (sum(g.shape[1] for g in hists[:len(at)]), h.shape[1])
    offsets = [at[id(p[0])] for p in pens]
    if len(hists) == 1:
        ph = hists[0]
    else:
        R = B if any(h.shape[0] == B for h in hists) else 1
        ph = mx.concatenate([mx.broadcast_to(h, (R, h.shape[1])) for h in hists], axis=1)
    return (ph if ph.dtype == mx.int32 else ph.astype(mx.int32)), offsets


def _edit_slots(edits, B: int, V: int) -> tuple[list[mx.array], tuple] | None:
    """EB, EM, EW, PH, PV and S's edit codes (chain_codes) from the edits before the stages, from the logits up --
    ("logit_bias", f32 [B or 1, V]), ("allow", bool [B or 1, V] or a packed int32 bitmask [B or 1, ceil(V / 32)]),
    ("penalties", (history i32 [B or 1, H], last_n, repeat, frequency, presence: each one value or one a row)) --,
    or None where one has another shape or kind. At most one logit_bias and one allow, each before or after the
    penalties (not between two of them), and up to MAX_PENALTIES penalties stages in a row (their histories side by
    side in PH where they differ). An
    allow commutes with the others (a removed token stays at -inf, and a penalty that makes NaN of it is an error the
    program's checks raise), but the penalties' checks read the row between: the kernel applies it as it first writes
    the row or after the penalties, where it stands."""
    slots = {"EB": _placeholder(mx.float32, 8), "EM": _placeholder(mx.bool_, 8), "EW": _placeholder(mx.int32, 8),
             "PH": _placeholder(mx.int32, 8, rows=1), "PV": _placeholder(mx.float32, 8)}
    codes = [0] * EDIT_CODES
    kinds = [kind for kind, _ in edits]
    pens = [a for kind, a in edits if kind == "penalties"]
    if pens:
        first = kinds.index("penalties")
        if kinds[first:first + len(pens)] != ["penalties"] * len(pens) or len(pens) > MAX_PENALTIES:
            return None
        packed = _histories(pens, B)
        pv = packed and _penalty_values([(*p[1:], *at) for p, at in zip(pens, packed[1])], B)
        if not pv:
            return None
        slots["PH"], slots["PV"] = packed[0], pv[0]
        codes[4:6] = [len(pens), int(packed[0].shape[0] == B and B > 1)]
        codes[7] = int(pv[1])
    seen_pen = False
    for kind, a in edits:
        if kind == "penalties":
            seen_pen = True
            continue
        packed = kind == "allow" and a.dtype in (mx.int32, mx.uint32)
        width = -(-V // 32) if packed else V
        if a.ndim not in (1, 2) or a.shape[-1] != width or (a.ndim == 2 and a.shape[0] not in (1, B)):
            return None
        rows = a.ndim == 2 and a.shape[0] == B and B > 1
        if kind == "logit_bias" and not codes[0]:
            slots["EB"], codes[0:2] = a.astype(mx.float32) if a.dtype != mx.float32 else a, [1, int(rows)]
            codes[6] = int(seen_pen)
        elif kind == "allow" and not codes[2] and (packed or a.dtype == mx.bool_):
            name = "EW" if packed else "EM"
            slots[name], codes[2:4] = a.astype(mx.int32) if a.dtype == mx.uint32 else a, [2 if packed else 1, int(rows)]
            codes[8] = int(seen_pen)
        else:
            return None
    return [slots[n] for n in EDIT_SLOTS], tuple(codes)


def chain_inputs(params: list[mx.array], stages: list[str], terminal: str, want_logprob: bool, out_x: int,
                 B: int, split: tuple[int, int] = (0, 0), edits: tuple = (), V: int = 0,
                 raw: bool = False) -> list[mx.array] | None:
    """The kernel's inputs after x -- F0..F9, K0, K1, Q0, Q1, EB, EM, EW, S -- from a chain's stage operands in order
    (then the sample's seed and position) and the edits before its stages (_edit_slots; V: the row's length; raw:
    the logits' maximum and log-sum-exp asked for), or
    None where one is not a scalar or one value per row. Only an operand of another dtype costs an op; S is made once
    per chain and per-row pattern."""
    edit = _edit_slots(edits, B, V)
    if edit is None:
        return None
    floats, keys, poss, it = [], [], [], iter(params)
    for s in stages + (["sample"] if terminal == "sample" else []):
        floats += [_slot(next(it), B, mx.float32, bits=True) for _ in range(CHAIN_STAGES.get(s, 0))]
        if s in ("xtc", "sample"):
            keys.append(_slot(next(it), B, mx.uint64))
            poss.append(_slot(next(it), B, mx.int32))
    groups = ((floats, CHAIN_FLOAT_SLOTS, mx.float32), (keys, CHAIN_KEY_SLOTS, mx.uint64),
              (poss, CHAIN_KEY_SLOTS, mx.int32))
    if any(o is None for got, _, _ in groups for o in got) or any(len(got) > n for got, n, _ in groups):
        return None
    slots = [o for got, n, dtype in groups for o in got + [(_placeholder(dtype), 0)] * (n - len(got))]
    per_row = tuple(flag for _, flag in slots)
    key = (tuple(stages), terminal, bool(want_logprob), out_x, per_row, split, edit[1], bool(raw))
    if key not in _CODES:
        _CODES[key] = mx.array(np.array(chain_codes(stages, terminal, want_logprob, out_x, per_row, split, edit[1],
                                                    raw), np.int32))
    return [a for a, _ in slots] + edit[0] + [_CODES[key]]


def sample_chain(x: mx.array, params: list[mx.array], stages: list[str], terminal: str,
                 want_logprob: bool, out_x: int = 0, edits: tuple = (), raw: bool = False) -> tuple[mx.array, ...] | None:
    """The chain's token [B, 1] i32 and its log-probability under the final softmax [B, 1] f32 (0 without
    want_logprob), with out_x the final logits (1) or their softmax (2) [B, V], and with a penalties stage among the
    edits their checks, bool [B, stages] (each penalties_overflow's value), and with edits the edited row's maximum
    [B, 1], and with raw the logits' maximum (NaN where one is NaN), log-sum-exp and logit at the token [B, 1]
    each, before the edits; or None where the kernel does not apply (neither a CUDA device nor an Apple GPU with the
    Metal build active -- metal_status --, a stage it does not run, operands of other shapes). edits: the logit_bias, allow and penalties before the stages, from the
    logits up, as (kind, operand) pairs (_edit_slots), applied in the kernel."""
    cuda = available()
    if not ((cuda or metal_status()[0]) and not native.switched_off("SAMPLEC_GPU_CHAIN") and x.ndim == 2 and
            x.dtype == mx.float32 and x.shape[0] >= 1 and x.shape[1] >= 1 and chain_supports(stages, terminal)):
        return None
    B, V = x.shape
    if not cuda:
        return _metal_chain(x, params, stages, terminal, want_logprob, out_x, edits, raw)
    split = split_of(B, V) if not native.switched_off("SAMPLEC_GPU_SPLIT") else (0, 0)
    inputs = chain_inputs(params, stages, terminal, want_logprob, out_x, B, split, edits, V, raw)
    if inputs is None:
        return None
    nb = split[0]
    tok, lp, xo, pf, rs, _ = _kernel("samplec_chain", INPUT_NAMES, CHAIN_BODY, CHAIN_OUTPUTS, chain_header())(
        inputs=[x, *inputs],
        output_shapes=[(B,), (B,), x.shape if out_x else (B, 1), _flags_shape(B, edits), (B, 4),
                       (scratch_size(B, split, V if edits else 0, raw),)],
        output_dtypes=[mx.int32, mx.float32, mx.float32, mx.bool_, mx.float32, mx.int32],
        grid=(B * max(nb, 1) * CHAIN_THREADS, 1, 1), threadgroup=(CHAIN_THREADS, 1, 1),
        init_value=0 if nb else None)      # (the rows' arrival counters start at zero)
    return _outputs(tok, lp, xo, pf, rs, B, out_x, edits, raw)


def _outputs(tok, lp, xo, pf, rs, B: int, out_x: int, edits, raw: bool) -> tuple[mx.array, ...]:
    """(token [B, 1], logprob [B, 1]), then the final logits or their softmax where out_x, then with edits the
    penalties' checks [B, stages] (where penalties were among them) and the edited row's maximum [B, 1], then with
    raw the logits' maximum, log-sum-exp and logit at the token [B, 1] each."""
    pen = any(kind == "penalties" for kind, _ in edits)
    return (tok.reshape(B, 1), lp.reshape(B, 1)) + ((xo,) if out_x else ()) + ((pf,) if pen else ()) + \
        ((rs[:, 0:1],) if edits else ()) + ((rs[:, 1:2], rs[:, 2:3], rs[:, 3:4]) if raw else ())


def _flags_shape(B: int, edits) -> tuple[int, int]:
    return B, max(1, sum(kind == "penalties" for kind, _ in edits))


# -- the Metal build -------------------------------------------------------------------------------------------------
#
# The same kernel source in the Metal dialect (simt_metal.h), through mx.fast.metal_kernel: one threadgroup of
# METAL_THREADS a row (no split mode: Metal's threadgroup_barrier does not order one threadgroup's device writes
# before another's reads, which the last block of a split row needs), at most METAL_CAP candidates in threadgroup
# memory. It has not run on Apple hardware (docs/performance.md, "One kernel source"): it is opt-in
# (SAMPLEC_METAL_KERNEL=1), and the first call builds it and checks one row's answer before any chain uses it.

_METAL: dict = {}


def _metal_kernel():
    if "kernel" not in _METAL:
        source, header = chain_entry("metal"), chain_header("metal")
        digest = hashlib.sha256("\0".join([header, source]).encode()).hexdigest()[:12]
        args = dict(name=f"samplec_chain_{digest}", input_names=INPUT_NAMES,
                    output_names=list(CHAIN_OUTPUTS), source=source, header=header, ensure_row_contiguous=True)
        try:        # (MLX's "safe" math mode: no fast math, as the dense definitions round)
            _METAL["kernel"] = mx.fast.metal_kernel(**args, compile_options={"math_mode": "safe"})
        except TypeError:       # (an MLX without compile_options compiles without fast math too)
            _METAL["kernel"] = mx.fast.metal_kernel(**args)
    return _METAL["kernel"]


def _metal_chain(x: mx.array, params: list[mx.array], stages: list[str], terminal: str, want_logprob: bool,
                 out_x: int, edits: tuple = (), raw: bool = False) -> tuple[mx.array, ...] | None:
    B, V = x.shape
    # (MLX would pass an input of fewer than eight elements in the constant address space; the kernel reads the
    # logits and the edits from device memory)
    if x.size < 8 or any((a[0] if kind == "penalties" else a).size < 8 for kind, a in edits):
        return None
    inputs = chain_inputs(params, stages, terminal, want_logprob, out_x, B, (0, 0), edits, V, raw)
    if inputs is None:
        return None
    inputs = [a.reshape(1) if a.ndim == 0 else a for a in inputs]     # (a 0-d input would be a reference)
    tok, lp, xo, pf, rs, _ = _metal_kernel()(
        inputs=[x, *inputs],
        output_shapes=[(B,), (B,), x.shape if out_x else (B, 1), _flags_shape(B, edits), (B, 4),
                       (scratch_size(B, (0, 0), V if edits else 0, raw),)],
        output_dtypes=[mx.int32, mx.float32, mx.float32, mx.bool_, mx.float32, mx.int32],
        grid=(B * METAL_THREADS, 1, 1), threadgroup=(METAL_THREADS, 1, 1))
    return _outputs(tok, lp, xo, pf, rs, B, out_x, edits, raw)


def _on(var: str) -> bool:
    return native.switch(var, False)


def metal_requested() -> bool:
    """The Metal build is asked for: SAMPLEC_METAL_KERNEL=1, and the GPU kernels are not switched off."""
    return _on("SAMPLEC_METAL_KERNEL") and not switched_off()


def apple_gpu() -> bool:
    try:
        return mx.default_device() == mx.gpu and bool(mx.metal.is_available())
    except AttributeError:
        return False


def metal_status() -> tuple[bool, str]:
    """Whether the Metal build of the chain kernel serves sample_chain (and top_logprobs beside it) here, and why or
    why not. Where it is asked for, the first call builds both and runs one row (greedy over 0..255: token 255; its
    three largest: 255, 254, 253), so that an MLX that refuses to build them -- a compile error, a threadgroup its
    registers do not allow -- or a wrong answer leaves Apple GPUs on the portable MLX ops, with the reason."""
    if switched_off():
        return False, f"off (SAMPLEC_GPU_KERNELS={os.environ.get('SAMPLEC_GPU_KERNELS')})"
    if not apple_gpu():
        return False, f"the default device is {mx.default_device()}, not an Apple GPU"
    if not _on("SAMPLEC_METAL_KERNEL"):
        return False, ("opt-in until it has run on Apple hardware: SAMPLEC_METAL_KERNEL=1 builds the chain kernel's "
                       "Metal dialect")
    if "status" not in _METAL:
        try:
            x = mx.arange(256, dtype=mx.float32).reshape(1, 256)
            tok, lp = _metal_chain(x, [], [], "greedy", True, 0)
            got = int(tok.item())
            # (and top_logprobs' kernel, which the Metal build's chains use beside it: the three largest of the row)
            top = _metal_top_logprobs_kernel()(
                inputs=[x, mx.array([255.0]), mx.array([0.5]), mx.array([3, 11], dtype=mx.int32)],
                output_shapes=[(1, 3), (1, 3)], output_dtypes=[mx.int32, mx.float32],
                grid=(METAL_THREADS, 1, 1), threadgroup=(METAL_THREADS, 1, 1))[0] if got == 255 else None
            top = [] if top is None else top.reshape(-1).tolist()
            _METAL["status"] = (True, "built and checked (SAMPLEC_METAL_KERNEL=1)") if top == [255, 254, 253] else \
                (False, "its simdgroups are not 32 lanes wide" if got == -2 else
                 f"its check answered token {got} where 255 is right" if got != 255 else
                 f"its top_logprobs check answered {top} where [255, 254, 253] is right")
        except Exception as e:  # noqa: BLE001 -- (MLX's compile and launch errors: the reason is reported)
            first = (str(e).splitlines() or [""])[0][:200]
            if "transformation" in first:       # (asked inside mx.compile's trace, where nothing evaluates)
                return False, "not checked yet: its first call came inside a traced function"
            _METAL["status"] = (False, f"MLX refused to build it: {type(e).__name__}: {first}")
    return _METAL["status"]


CHAIN_OUTPUTS = ("tok", "lp", "xo", "pf", "rs", "ws")


# -- top_logprobs' ids and values (gpu_top_logprobs.cu) ---------------------------------------------------------------
#
# One block (threadgroup) a row selects the k + margin largest logits by an 8-bit radix select over their
# order-preserving keys and ranks them by their log-probabilities: one launch where a sort of the row's
# log-probabilities, a slice and two gathers ran beside the chain kernel. The same dialect layer as the chain kernel;
# on Metal only where the chain kernel's Metal build serves (SAMPLEC_METAL_KERNEL=1: not run on Apple hardware).

TOP_LOGPROBS_SOURCE = Path(__file__).with_name("gpu_top_logprobs.cu")
TOP_LOGPROBS_MAX = 72           # gpu_top_logprobs.cu's TL_MAXK: k + margin (lowering.TIE_MARGIN) at most
TOP_LOGPROBS_INPUTS = ["x", "m", "lz", "K"]
TOP_LOGPROBS_ENTRY = """
    {shared} TlShared sh;
    const int tx = (int){thread}, row = (int){block};
    const int V = x_shape[1], k = K[0], kk = K[1];
    tl_top_logprobs(x + (size_t)row * V, V, m[row], lz[row], k, kk, ids + (size_t)row * k, vals + (size_t)row * k,
                    sh, tx);
"""


def top_logprobs_entry(dialect: str = "cuda") -> str:
    fields = {f: DIALECTS[dialect][f] for f in ("shared", "thread", "block")}
    return TOP_LOGPROBS_ENTRY.format(**fields)


@functools.cache
def top_logprobs_header(dialect: str = "cuda") -> str:
    """The dialect's layer, then gpu_top_logprobs.cu."""
    return "\n".join(p.read_text() for p in (DIALECT_HEADERS[dialect], TOP_LOGPROBS_SOURCE))


def top_logprobs(x: mx.array, m: mx.array, lz: mx.array, k: int, margin: int) -> tuple | None:
    """(ids [B, k] i32, values [B, k] f32): the k largest log-probabilities (x - m) - lz of each row of the logits x
    (m, lz [B, 1]: the row's maximum and log-sum-exp), descending, the lower id first among equal ones -- or None
    where the kernel does not apply (neither a CUDA GPU nor the Metal build's, k + margin past TOP_LOGPROBS_MAX)."""
    cuda = available()
    if not ((cuda or metal_status()[0]) and x.ndim == 2 and x.dtype == mx.float32 and 1 <= k <= x.shape[1]):
        return None
    B, V = x.shape
    kk = min(V, k + margin)
    if kk > TOP_LOGPROBS_MAX or m.size != B or lz.size != B or (not cuda and x.size < 8):
        return None
    args = dict(inputs=[x, m.astype(mx.float32).reshape(B), lz.astype(mx.float32).reshape(B),
                        mx.array([k, kk], dtype=mx.int32)],
                output_shapes=[(B, k), (B, k)], output_dtypes=[mx.int32, mx.float32])
    ids, vals = _one_block_a_row(TOP_LOGPROBS_KERNEL, B, cuda, **args)
    return ids, vals


# -- DRY (gpu_dry.cu) ----------------------------------------------------------------------------------------------
#
# One block a row writes the row with DRY's penalties: the history's window gathered, each position walked back while
# its tokens repeat the window's end, the penalties of the tokens that would extend a repeat -- where the definition
# runs ~30 MLX ops. One launch for the `dry` op beside the chain kernel (CUDA; on Metal where the chain kernel's Metal
# build serves).

DRY_SOURCE = Path(__file__).with_name("gpu_dry.cu")
DRY_INPUTS = ["x", "h", "mult", "base", "allowed", "last_n", "brk", "n"]
DRY_ENTRY = """
    {shared} DrShared sh;
    const int tx = (int){thread}, row = (int){block};
    const int V = x_shape[1], H = h_shape[1], rows = n[2];     // (rows: which of the four values are one a row)
    dr_dry(x + (size_t)row * V, h + (size_t)row * H, H, V, mult[rows & 1 ? row : 0], base[rows & 2 ? row : 0],
           allowed[rows & 4 ? row : 0], last_n[rows & 8 ? row : 0], brk + (size_t)row * n[1], n[0] != 0,
           out + (size_t)row * V, rep + (size_t)row * V, win + (size_t)row * H, sh, tx);
"""
_DRY_CODES: dict = {}


def dry_entry(dialect: str = "cuda") -> str:
    return DRY_ENTRY.format(**{f: DIALECTS[dialect][f] for f in ("shared", "thread", "block")})


@functools.cache
def dry_header(dialect: str = "cuda") -> str:
    """The dialect's layer, the stage table (DRY's off rule), then gpu_dry.cu."""
    return "\n".join(p.read_text() for p in (DIALECT_HEADERS[dialect], STAGE_TABLE, DRY_SOURCE))


def dry_inputs(x: mx.array, h: mx.array, mult: mx.array, base: mx.array, allowed: mx.array, last_n: mx.array,
               breakers: mx.array | None) -> list[mx.array] | None:
    """The DRY kernel's inputs (DRY_INPUTS) -- the operands as the program holds them (each value one for all rows
    or one a row, as the chain kernel's slots), the breaker flags or an unused placeholder, and n: (breakers given,
    their row stride, which values are one a row) -- or None where an operand has another shape."""
    if not (x.ndim == 2 and x.dtype == mx.float32 and min(x.shape) >= 1):
        return None
    B, V = x.shape
    if not (h.ndim == 2 and h.shape[0] == B and h.shape[1] >= 1 and h.dtype == mx.int32) or \
            breakers is not None and not (
            breakers.dtype == mx.bool_ and (breakers.shape == (V,) or breakers.shape in ((1, V), (B, V)))):
        return None
    slots = [_slot(a, B, dt) for a, dt in ((mult, mx.float32), (base, mx.float32), (allowed, mx.int32),
                                           (last_n, mx.int32))]
    if None in slots:
        return None
    rows = sum(1 << i for i, (_, per_row) in enumerate(slots) if per_row)
    stride = V if breakers is not None and breakers.ndim == 2 and breakers.shape[0] == B > 1 else 0
    key = (breakers is not None, stride, rows)
    if key not in _DRY_CODES:
        _DRY_CODES[key] = mx.array(np.array(key, np.int32))
    brk = _placeholder(mx.bool_, 8) if breakers is None else breakers
    return [x, h, *(a for a, _ in slots), brk, _DRY_CODES[key]]


def dry(x: mx.array, h: mx.array, mult: mx.array, base: mx.array, allowed: mx.array, last_n: mx.array,
        breakers: mx.array | None) -> mx.array | None:
    """The `dry` op on a GPU: the row x [B, V] float32 with DRY's penalties from the history h [B, H] int32 (ids < 0
    padding); mult, base, allowed, last_n: one value or one a row; breakers: bool [V] or [B, V], None for none. None
    where the kernel does not apply (neither a CUDA GPU nor the Metal build's, operands of other shapes)."""
    cuda = available()
    inputs = dry_inputs(x, h, mult, base, allowed, last_n, breakers) if cuda or metal_status()[0] else None
    # (MLX passes an input of fewer than 8 elements in Metal's constant space: the Metal build declines them)
    if inputs is None or not cuda and (x.shape[1] < 8 or h.size < 8):
        return None
    B, V = x.shape
    return _one_block_a_row(DRY_KERNEL, B, cuda, inputs=inputs, output_shapes=[(B, V), (B, V), (B, h.shape[1])],
                            output_dtypes=[mx.float32, mx.int32, mx.int32])[0]


# (name, inputs, outputs, entry(dialect), header(dialect)) of each kernel beside the chain kernel
TOP_LOGPROBS_KERNEL = ("top_logprobs", TOP_LOGPROBS_INPUTS, ["ids", "vals"], top_logprobs_entry, top_logprobs_header)
DRY_KERNEL = ("dry", DRY_INPUTS, ["out", "rep", "win"], dry_entry, dry_header)


def _beside_kernel(name: str, inputs: list, outputs: list, entry, header, dialect: str):
    """A kernel beside the chain kernel in `dialect`, made once: CUDA's through `_kernel`, Metal's under MLX's safe
    math mode (as the chain kernel's Metal build)."""
    if dialect == "cuda":
        return _kernel(f"samplec_{name}", inputs, entry("cuda"), tuple(outputs), header("cuda"))
    if name not in _METAL:
        source, text = entry("metal"), header("metal")
        digest = hashlib.sha256("\0".join([text, source]).encode()).hexdigest()[:12]
        args = dict(name=f"samplec_{name}_{digest}", input_names=inputs, output_names=outputs, source=source,
                    header=text, ensure_row_contiguous=True)
        try:
            _METAL[name] = mx.fast.metal_kernel(**args, compile_options={"math_mode": "safe"})
        except TypeError:
            _METAL[name] = mx.fast.metal_kernel(**args)
    return _METAL[name]


def _one_block_a_row(kernel: tuple, B: int, cuda: bool, **args):
    """A kernel beside the chain kernel launched one block (threadgroup) a row, on CUDA or in the Metal build."""
    threads = CHAIN_THREADS if cuda else METAL_THREADS
    return _beside_kernel(*kernel, "cuda" if cuda else "metal")(**args, grid=(B * threads, 1, 1),
                                                                threadgroup=(threads, 1, 1))


def _metal_top_logprobs_kernel():
    return _beside_kernel(*TOP_LOGPROBS_KERNEL, "metal")


def scratch_size(B: int, split: tuple[int, int], edited: int = 0, raw: bool = False) -> int:
    """ws's int32 words: the rows' arrival counters, the slices' headers and candidates' logits, their ids, with
    edits before the stages the edited rows (edited: V), the penalties' check counts (two a stage and row) and each
    block's maximum of its part of the edited row, and with raw each block's part of the logits' maximum and
    log-sum-exp (three words)."""
    nb, cap = split
    return B + B * nb * (SLICE_HEADER + 2 * cap) + B * (edited + (2 * MAX_PENALTIES + nb) * bool(edited)) + \
        3 * B * nb * bool(raw)


def path_report() -> str:
    """Which GPU path runs a chain here, and why (`samplec doctor`)."""
    if switched_off():
        return f"off (SAMPLEC_GPU_KERNELS={os.environ.get('SAMPLEC_GPU_KERNELS')})"
    if not available():
        if apple_gpu():
            ok, why = metal_status()
            if not ok:
                return (f"off on Metal: the chain kernel's Metal build is not used ({why}); Apple GPUs run the "
                        "portable target's MLX ops")
            return (f"Metal build of the chain kernel {why}: gpu.sample_chain runs chains of {', '.join(CHAIN_STAGES)} "
                    f"-> sample/greedy as one threadgroup of {METAL_THREADS} a row: the metal target hands it the "
                    "chains it covers (regions metal.chain), the portable MLX ops run the rest")
        return f"off (the default device is {mx.default_device()}, not a CUDA GPU or an Apple GPU)"
    if native.switched_off("SAMPLEC_GPU_CHAIN"):
        chain = "off (SAMPLEC_GPU_CHAIN=0): the stages' dense definitions"
    else:
        mode = ("one block a row (SAMPLEC_GPU_SPLIT=0)" if native.switched_off("SAMPLEC_GPU_SPLIT") else
                f"split mode: a row over up to {MAX_SLICES} blocks at small B ({split_of(1, 152064)[0]} at B = 1, "
                f"V = 152064; SAMPLEC_GPU_SMS={os.environ.get('SAMPLEC_GPU_SMS', SMS)} multiprocessors)")
        chain = f"{', '.join(CHAIN_STAGES)} -> sample/greedy, {mode}, with a logit_bias, an allow and up " \
            "to four penalties stages before them, with their checks; beside it one kernel each for " \
            "top_logprobs' selection and DRY"
    built = first_compile_notice(chain_kernel_name())
    built = f"; {built[len('samplec: '):]} at its first chain" if built else \
        f"; compiled, in {ptx_cache_dir()}"
    return f"active (CUDA): kth_largest by one radix-select block a row; the chain kernel: {chain}{built}"
