// A CPU emulation of the CUDA features samplec/backend_mlx/gpu_chain.cu uses, so that tests run the kernel's own
// source without a GPU: one OS thread per CUDA thread, a block's threads meeting at a std::barrier for
// __syncthreads and a warp's at another for each shuffle. Blocks run one after another (so `__shared__` can be a
// function-local static). Float arithmetic is the CPU's IEEE float32 (no fast-math: g++ -O1); expf and logf are
// glibc's, which may differ from CUDA's in the last bit -- the tests compare tokens away from knife-edges.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

struct sc_dim3 { unsigned x = 0, y = 0, z = 0; };
static thread_local sc_dim3 threadIdx, blockIdx;
static std::barrier<>* sc_block_barrier = nullptr;
static std::barrier<>* sc_warp_barrier[32];
static unsigned long long sc_warp_buf[2][32][32];
static thread_local int sc_phase = 0;

#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads() sc_block_barrier->arrive_and_wait()

// One barrier per shuffle: each lane posts v in its phase's buffer and reads lane `from`'s (its own v where `from`
// is outside the warp); a lane reuses a phase only after the next shuffle's barrier, which every lane reaches after
// its read.
template <class T>
static T sc_shuffle(T v, int from) {
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, ph = sc_phase;
  sc_phase ^= 1;
  std::memcpy(&sc_warp_buf[ph][w][l], &v, sizeof(T));
  sc_warp_barrier[w]->arrive_and_wait();
  T r = v;
  if (from >= 0 && from < 32) std::memcpy(&r, &sc_warp_buf[ph][w][from], sizeof(T));
  return r;
}

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
static T atomicAdd(T* at, T v) { return __atomic_fetch_add(at, v, __ATOMIC_SEQ_CST); }
static inline void __threadfence() {}

// Runs body(block) for each block on SC_T threads.
template <class F>
static void sc_launch(int blocks, F body) {
  std::barrier<> block(SC_T);
  std::vector<std::barrier<>*> warps;
  for (int w = 0; w < SC_T / 32; ++w) sc_warp_barrier[w] = new std::barrier<>(32);
  sc_block_barrier = &block;
  for (int b = 0; b < blocks; ++b) {
    std::vector<std::thread> threads;
    for (int t = 0; t < SC_T; ++t)
      threads.emplace_back([=] {
        threadIdx.x = t;
        blockIdx.x = b;
        sc_phase = 0;
        body();
      });
    for (auto& th : threads) th.join();
  }
  for (int w = 0; w < SC_T / 32; ++w) delete sc_warp_barrier[w];
}
