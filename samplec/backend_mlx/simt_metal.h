// The Metal dialect of samplec's SIMT kernel source (gpu_chain.cu's layer; simt_cuda.h is the CUDA one): a
// threadgroup of SC_T threads in simdgroups of 32 (Apple GPUs'; the kernel checks threads_per_simdgroup), threadgroup
// memory, simdgroup shuffles, atomics, and explicit address spaces (device, threadgroup, thread). Compiled through
// `mx.fast.metal_kernel` (MLX puts <metal_stdlib> first and compiles in its "safe" math mode: no fast math), and
// by the CPU emulation in the tests (tests/metal_emulation.h). Not yet run on Apple hardware: see docs/performance.md.
#ifndef SAMPLEC_SIMT_DIALECT
#define SAMPLEC_SIMT_DIALECT 2

#ifndef SC_T
#define SC_T 256                    // threads a threadgroup (gpu.METAL_THREADS)
#endif
#ifndef SC_CAP
#define SC_CAP 2048                 // candidates in threadgroup memory: ~23 KB of shared state (Metal allows 32 KB)
#endif

#define SC_FN
#define SC_INLINE inline
#ifndef SC_DEV                      // (the emulation's syntax check gives these address spaces of its own)
#define SC_DEV device
#define SC_TG threadgroup
#define SC_THR thread
#endif
#define SC_UNROLL _Pragma("unroll")
#define SC_NO_UNROLL _Pragma("unroll 1")

#define sc_barrier() metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup)
#define sc_barrier_device() metal::threadgroup_barrier(metal::mem_flags::mem_device)   // (the block's device writes)
// (orders this threadgroup's device writes only: split mode, which needs them ordered before another threadgroup's
// reads, stays off on Metal -- gpu.py runs one threadgroup a row)
#define sc_device_fence() metal::threadgroup_barrier(metal::mem_flags::mem_device)
#define sc_shfl_xor(v, o) metal::simd_shuffle_xor((v), (ushort)(o))
#define sc_shfl_up(v, d) metal::simd_shuffle_up((v), (ushort)(d))

inline unsigned sc_atomic_add_shared(SC_TG unsigned* at, unsigned v) {
  return metal::atomic_fetch_add_explicit(reinterpret_cast<SC_TG metal::atomic_uint*>(at), v,
                                          metal::memory_order_relaxed);
}
inline int sc_atomic_add_global(SC_DEV int* at, int v) {
  return metal::atomic_fetch_add_explicit(reinterpret_cast<SC_DEV metal::atomic_int*>(at), v,
                                          metal::memory_order_relaxed);
}
inline int sc_atomic_max_global(SC_DEV int* at, int v) {
  return metal::atomic_fetch_max_explicit(reinterpret_cast<SC_DEV metal::atomic_int*>(at), v,
                                          metal::memory_order_relaxed);
}

inline unsigned sc_f2u(float f) { return as_type<unsigned>(f); }
inline float sc_u2f(unsigned u) { return as_type<float>(u); }
inline float sc_i2f(int i) { return as_type<float>(i); }
inline int sc_f2i(float f) { return as_type<int>(f); }
inline float sc_div(float a, float b) { return a / b; }
inline float sc_add(float a, float b) { return a + b; }
inline float sc_sub(float a, float b) { return a - b; }
inline float sc_mul(float a, float b) { return a * b; }
inline float sc_exp(float x) { return metal::precise::exp(x); }
inline float sc_log(float x) { return metal::precise::log(x); }
inline float sc_sqrt(float x) { return metal::precise::sqrt(x); }
inline float sc_fabs(float x) { return metal::fabs(x); }
inline float sc_fmin(float a, float b) { return metal::fmin(a, b); }
inline float sc_fmax(float a, float b) { return metal::fmax(a, b); }
inline float sc_floor(float x) { return metal::floor(x); }
inline int sc_imin(int a, int b) { return metal::min(a, b); }
// (the float4 loads stay off: a device pointer's address is not an integer in Metal)
inline bool sc_aligned16(const SC_DEV float*) { return false; }

typedef ulong sc_u64;

#endif
