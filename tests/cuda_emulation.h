// The CUDA names samplec's kernels use (simt_cuda.h's layer, the selection kernel), over the CPU emulation of a
// block (simt_emulation.h), so that tests compile the CUDA dialect of the kernel source with g++ and run it.
#pragma once
#include "simt_emulation.h"

#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads() sc_block_sync()

template <class T>
static T __shfl_xor_sync(unsigned, T v, int m) { return sc_shuffle(v, static_cast<int>(threadIdx.x & 31) ^ m); }

template <class T>
static T __shfl_up_sync(unsigned, T v, int d) { return sc_shuffle(v, static_cast<int>(threadIdx.x & 31) - d); }

struct alignas(16) float4 { float x, y, z, w; };
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
using std::max;
using std::min;

// Atomics on shared or global memory (blocks run one after another: the fence has nothing to order here).
template <class T>
static T atomicAdd(T* at, T v) { return sc_atomic_fetch_add(at, v); }
template <class T>
static T atomicMax(T* at, T v) { return sc_atomic_fetch_max(at, v); }
static inline void __threadfence() {}
