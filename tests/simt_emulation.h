// A CPU emulation of a GPU block's execution, so that tests run samplec's SIMT kernel source (gpu_chain.cu in either
// dialect: cuda_emulation.h and metal_emulation.h name the primitives on top of this) without a GPU: one OS thread
// per GPU thread, a block's threads meeting at a std::barrier for the block's barrier and a warp's (simdgroup's, 32
// lanes) at another for each shuffle. Blocks run one after another (so a block's shared state can be a
// function-local static). Float arithmetic is the CPU's IEEE float32 (no fast-math: g++ -O1); expf and logf are
// glibc's, which may differ from CUDA's or Metal's in the last bit -- the tests compare tokens away from knife-edges.
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

static inline void sc_block_sync() { sc_block_barrier->arrive_and_wait(); }

template <class T>
static T sc_atomic_fetch_add(T* at, T v) { return __atomic_fetch_add(at, v, __ATOMIC_SEQ_CST); }
template <class T>
static T sc_atomic_fetch_max(T* at, T v) {
  T old = __atomic_load_n(at, __ATOMIC_SEQ_CST);
  while (old < v && !__atomic_compare_exchange_n(at, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
  return old;
}

// Runs body() for each block on `threads` threads; sc_launch(blocks, body) on SC_T (the dialect's or the test's,
// defined by the time a test launches).
template <class F>
static void sc_launch_threads(int threads, int blocks, F body) {
  std::barrier<> block(threads);
  for (int w = 0; w < threads / 32; ++w) sc_warp_barrier[w] = new std::barrier<>(32);
  sc_block_barrier = &block;
  for (int b = 0; b < blocks; ++b) {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([=] {
        threadIdx.x = t;
        blockIdx.x = b;
        sc_phase = 0;
        body();
      });
    for (auto& th : pool) th.join();
  }
  for (int w = 0; w < threads / 32; ++w) delete sc_warp_barrier[w];
}
#define sc_launch(...) sc_launch_threads(SC_T, __VA_ARGS__)
