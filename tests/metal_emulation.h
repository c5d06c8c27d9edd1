// The Metal names samplec's kernel source uses (simt_metal.h's layer and the kernel signature MLX's metal_kernel
// writes), over the CPU emulation of a block (simt_emulation.h), so that tests compile the Metal dialect of the
// kernel source as C++ and run it. The address spaces are empty here (C++ has one), except under
// SC_CHECK_ADDRESS_SPACES, where clang's address_space attributes stand for device (1), constant (2) and threadgroup
// (3) memory: a pointer or reference that names the wrong one, or none where Metal needs one (a device or
// threadgroup object through a plain pointer), fails to compile, as it would in Metal (a syntax check: that build
// does not run).
#pragma once
#include "simt_emulation.h"

namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
static inline void threadgroup_barrier(mem_flags) { sc_block_sync(); }

template <class T>
static T simd_shuffle_xor(T v, unsigned short m) { return sc_shuffle(v, static_cast<int>(threadIdx.x & 31) ^ m); }
template <class T>
static T simd_shuffle_up(T v, unsigned short d) { return sc_shuffle(v, static_cast<int>(threadIdx.x & 31) - d); }

using atomic_uint = unsigned;
using atomic_int = int;
enum memory_order { memory_order_relaxed };
template <class P, class T>
static T atomic_fetch_add_explicit(P at, T v, memory_order) { return __atomic_fetch_add(at, v, __ATOMIC_RELAXED); }
template <class P, class T>
static T atomic_fetch_max_explicit(P at, T v, memory_order) {
  T old = __atomic_load_n(at, __ATOMIC_RELAXED);
  while (old < v && !__atomic_compare_exchange_n(at, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
  return old;
}

namespace precise {
static inline float exp(float x) { return std::exp(x); }
static inline float log(float x) { return std::log(x); }
static inline float sqrt(float x) { return std::sqrt(x); }
}  // namespace precise
static inline float fabs(float x) { return std::fabs(x); }
static inline float fmin(float a, float b) { return std::fmin(a, b); }
static inline float fmax(float a, float b) { return std::fmax(a, b); }
static inline float floor(float x) { return std::floor(x); }
static inline int min(int a, int b) { return std::min(a, b); }
}  // namespace metal

template <class T, class U>
static T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type keeps the size");
  T t;
  std::memcpy(&t, &u, sizeof(T));
  return t;
}

typedef unsigned long ulong;
typedef unsigned short ushort;
typedef unsigned int uint;
#ifdef SC_CHECK_ADDRESS_SPACES        // (a vector, as Metal's: it copies out of any address space)
typedef float float4 __attribute__((ext_vector_type(4)));
#else
struct alignas(16) float4 { float x, y, z, w; };
#endif
struct uint3 { uint x, y, z; };

// (after the runtime above, which names std::thread: `thread` is a Metal keyword from here on)
#ifdef SC_CHECK_ADDRESS_SPACES
#define SC_DEV __attribute__((address_space(1)))
#define SC_TG __attribute__((address_space(3)))
#define SC_THR
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup extern __attribute__((address_space(3)))   // (declared: no constructor runs)
#else
#define SC_DEV
#define SC_TG
#define SC_THR
#define device
#define constant
#define threadgroup static
#endif
#define thread
