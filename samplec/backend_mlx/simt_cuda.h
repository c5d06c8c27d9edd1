// The CUDA dialect of samplec's SIMT kernel source (gpu_chain.cu's layer; simt_metal.h is the Metal one): a block of
// SC_T threads in warps of 32, shared memory, warp shuffles, atomics, and float math rounded as the dense
// definitions round it (the _rn intrinsics: no contraction into fused multiply-adds). Compiled by NVRTC through
// `mx.fast.cuda_kernel` (no headers), and by the CPU emulation in the tests (tests/cuda_emulation.h).
#ifndef SAMPLEC_SIMT_DIALECT
#define SAMPLEC_SIMT_DIALECT 1      // (1: CUDA, 2: Metal)

#ifndef SC_T
#define SC_T 512                    // threads a block (gpu.CHAIN_THREADS): ~120 registers a thread left
#endif
#ifndef SC_CAP
#define SC_CAP 4096                 // candidates in shared memory (gpu.SC_CAP): ~45 KB of shared state in all
#endif

#define SC_FN __device__
#define SC_INLINE __device__ __forceinline__
#define SC_DEV                      // address spaces: CUDA's pointers are generic
#define SC_TG
#define SC_THR
#define SC_UNROLL _Pragma("unroll")
#define SC_NO_UNROLL _Pragma("unroll 1")

#define sc_barrier() __syncthreads()
#define sc_barrier_device() __syncthreads()     // (it orders the block's global memory writes too)
#define sc_device_fence() __threadfence()
#define sc_shfl_xor(v, o) __shfl_xor_sync(0xFFFFFFFFu, (v), (o))
#define sc_shfl_up(v, d) __shfl_up_sync(0xFFFFFFFFu, (v), (d))

SC_INLINE unsigned sc_atomic_add_shared(unsigned* at, unsigned v) { return atomicAdd(at, v); }
SC_INLINE int sc_atomic_add_global(int* at, int v) { return atomicAdd(at, v); }
SC_INLINE int sc_atomic_max_global(int* at, int v) { return atomicMax(at, v); }

SC_INLINE unsigned sc_f2u(float f) { return __float_as_uint(f); }
SC_INLINE float sc_u2f(unsigned u) { return __uint_as_float(u); }
SC_INLINE float sc_i2f(int i) { return __int_as_float(i); }
SC_INLINE int sc_f2i(float f) { return __float_as_int(f); }
SC_INLINE float sc_div(float a, float b) { return __fdiv_rn(a, b); }
SC_INLINE float sc_add(float a, float b) { return __fadd_rn(a, b); }
SC_INLINE float sc_sub(float a, float b) { return __fsub_rn(a, b); }
SC_INLINE float sc_mul(float a, float b) { return __fmul_rn(a, b); }
SC_INLINE float sc_exp(float x) { return expf(x); }
SC_INLINE float sc_log(float x) { return logf(x); }
SC_INLINE float sc_sqrt(float x) { return sqrtf(x); }
SC_INLINE float sc_fabs(float x) { return fabsf(x); }
SC_INLINE float sc_fmin(float a, float b) { return fminf(a, b); }
SC_INLINE float sc_fmax(float a, float b) { return fmaxf(a, b); }
SC_INLINE float sc_floor(float x) { return floorf(x); }
SC_INLINE int sc_imin(int a, int b) { return min(a, b); }
SC_INLINE bool sc_aligned16(const float* p) { return (reinterpret_cast<size_t>(p) & 15) == 0; }

typedef unsigned long long sc_u64;

#endif
