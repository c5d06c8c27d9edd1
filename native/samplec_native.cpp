// samplec-native: MLX CPU kernels for samplec: the sampler chain, log-softmax normalizers, RandomBits, selections.
//
// On MLX's CPU backend every primitive in a graph costs microseconds of dispatch however small its input, and
// MLX's `compile` fuses at most ~11 levels of elementwise ops into one kernel: Threefry's 20 dependent rounds
// become 18 kernels when written with MLX ops (samplec/backend_mlx/rng.py). Here they are one primitive, with
// exactly the same bits (tests/test_native.py checks it against the MLX-ops version and the spec's known
// answers). The primitive is CPU-only; samplec uses the MLX-ops version everywhere else.

#include <algorithm>
#include <exception>
#include <functional>
#include <type_traits>
#include <atomic>
#include <thread>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// ---- keeping MLX's CPU worker awake through a call's dispatch ---------------------------------------------------
//
// MLX runs CPU work on a worker thread that sleeps whenever its queue is empty, and on a VM a sleeping thread
// takes ~10-30 us to wake (and its waker a syscall). A call opens a hold (`hold`, evaluated first: it wakes the
// worker while the caller still prepares the call) and closes it once everything is queued (`release`). While a
// hold is open the worker polls instead of sleeping: the hold task until the first native primitive is queued,
// and each native task, when done, until another is queued after it -- so the worker starts on the first task
// at once and keeps up while the caller queues the rest. Every poll is bounded by the hold's max_us.

std::atomic<uint64_t> g_holds{0};       // holds opened
std::atomic<uint64_t> g_released{0};    // holds closed: all of them when it equals g_holds
std::atomic<uint64_t> g_queued{0};      // native tasks queued
std::atomic<double> g_hold_us{0.0};

// Poll until done() or max_us have passed; whether done() held. Each round yields the core (sched_yield: at once
// back when nothing else is runnable): on a loaded machine a poller that only paused would hold the core that
// MLX's worker -- the thread it waits for -- needs (measured: a B = 1 call 3x slower beside one busy process).
template <class F>
bool poll(F done, double max_us) {
  const auto start = std::chrono::steady_clock::now();
  while (!done()) {
    if (std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() > max_us) {
      return false;
    }
    std::this_thread::yield();
  }
  return true;
}

bool holding() {
  return g_released.load(std::memory_order_acquire) < g_holds.load(std::memory_order_acquire);
}

// On the worker: while a hold is open and no native task was queued after the `seen`-th, poll.
void linger(uint64_t seen) {
  if (holding()) {
    poll([seen] { return !holding() || g_queued.load(std::memory_order_acquire) != seen; },
         g_hold_us.load(std::memory_order_relaxed));
  }
}

// Queue a native task on MLX's CPU stream: `work`, then its linger. The count moves only once the task is in the
// queue, so a worker that sees it move finds the task there.
template <class F>
void dispatch(mx::cpu::CommandEncoder& encoder, F work) {
  const uint64_t seq = g_queued.load(std::memory_order_acquire) + 1;
  encoder.dispatch([seq, work = std::move(work)]() mutable {
    work();
    linger(seq);
  });
  g_queued.fetch_add(1, std::memory_order_acq_rel);
}

// Close every hold (the call is dispatched, or failed before its dispatch).
void release() {
  g_released.store(g_holds.load(std::memory_order_acquire), std::memory_order_release);
}

// ---- the waiting caller's help: a kernel's work in parts, run by MLX's worker and by whoever waits for it -------
//
// While a call runs, its caller polls in spin_wait for the result: a core doing nothing. A kernel hands its work
// to `split(n, part)`: parts 0..n-1, each taken by the first thread to claim it -- MLX's worker, which opened
// them, and any caller polling meanwhile (`help`, between polls). The worker returns once every part is done. A
// caller that is not there (mx.async_eval, a single core) costs nothing: the worker takes every part itself.
// Parts write disjoint outputs; a reduction keeps one partial per part and combines them in part order, so a
// result never depends on which thread ran which part (or on whether anyone helped). Inside a part `split` runs
// its parts in place (one level of parts at a time: a batch's rows, or a row's spans).

struct Parts {
  std::atomic<uint64_t> gen{0};           // odd while parts are open
  std::atomic<int> helpers{0};            // helpers that saw them open and may still be claiming
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<bool> busy{false};          // a worker owns the slot (another stream's splits run in place)
  int64_t n = 0;
  void (*call)(void*, int64_t) = nullptr;
  void* ctx = nullptr;
  std::exception_ptr error;
  std::atomic<bool> failed{false};
};
Parts g_parts;
thread_local bool t_in_part = false;
std::atomic<uint64_t> g_helped{0};        // parts a waiting caller ran (diagnostics: `helped()`)
std::atomic<double> g_parts_wait_us{0.0};  // (tests: how long a worker waits for a helper to take the first part)

// Claim and run open parts until none is left; how many this thread ran.
int64_t run_parts(Parts& p) {
  t_in_part = true;
  int64_t ran = 0;
  for (int64_t c; (c = p.next.fetch_add(1, std::memory_order_acq_rel)) < p.n; ++ran) {
    try {
      p.call(p.ctx, c);
    } catch (...) {
      if (!p.failed.exchange(true)) p.error = std::current_exception();
    }
    p.done.fetch_add(1, std::memory_order_acq_rel);
  }
  t_in_part = false;
  return ran;
}

template <class F>
void split(int64_t n, F&& part) {
  Parts& p = g_parts;
  if (n <= 1 || t_in_part || p.busy.exchange(true, std::memory_order_acquire)) {
    for (int64_t c = 0; c < n; ++c) part(c);
    return;
  }
  p.n = n;
  p.next.store(0, std::memory_order_relaxed);
  p.done.store(0, std::memory_order_relaxed);
  p.ctx = &part;
  p.call = [](void* f, int64_t c) { (*static_cast<std::remove_reference_t<F>*>(f))(c); };
  p.failed.store(false, std::memory_order_relaxed);
  p.error = nullptr;
  p.gen.fetch_add(1, std::memory_order_seq_cst);          // open
  const double wait = g_parts_wait_us.load(std::memory_order_relaxed);
  if (wait > 0) poll([&p] { return p.next.load(std::memory_order_acquire) > 0; }, wait);
  run_parts(p);
  // (a helper finishing its last part: microseconds; yielding, so that a helper preempted on a loaded machine
  // gets the core back)
  while (p.done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  p.gen.fetch_add(1, std::memory_order_seq_cst);          // closed: no helper starts claiming from here on
  while (p.helpers.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
  std::exception_ptr error = p.failed.load() ? p.error : nullptr;
  p.busy.store(false, std::memory_order_release);
  if (error) std::rethrow_exception(error);
}

// On a waiting caller: take open parts, if any; whether it ran one.
bool help() {
  Parts& p = g_parts;
  const uint64_t g = p.gen.load(std::memory_order_seq_cst);
  if (!(g & 1) || t_in_part) return false;
  p.helpers.fetch_add(1, std::memory_order_seq_cst);
  int64_t ran = 0;
  if (p.gen.load(std::memory_order_seq_cst) == g) ran = run_parts(p);   // (still the parts seen open: set)
  p.helpers.fetch_sub(1, std::memory_order_seq_cst);
  g_helped.fetch_add(ran, std::memory_order_relaxed);
  return ran > 0;
}

// Spans of a vocabulary pass: fixed (multiples of 64, so of the 64-token blocks), whoever runs them
constexpr int64_t kSpan = 16384;
inline int64_t spans(int64_t n) { return (n + kSpan - 1) / kSpan; }

// f(lo, hi) over [0, n) in spans
template <class F>
void each_span(int64_t n, F f) {
  split(spans(n), [&](int64_t c) { f(c * kSpan, std::min(n, (c + 1) * kSpan)); });
}

// f(lo, hi) for each span of [0, n), in parts: the results in span order (a reduction combines them so)
template <class T, class F>
std::vector<T> per_span(int64_t n, F f) {
  std::vector<T> out(spans(n));
  split(spans(n), [&](int64_t c) { out[c] = f(c * kSpan, std::min(n, (c + 1) * kSpan)); });
  return out;
}

// The sum of f(lo, hi) over [0, n)'s spans, in span order
template <class F>
double sum_spans(int64_t n, F f) {
  double total = 0.0;
  for (double part : per_span<double>(n, f)) total += part;
  return total;
}

constexpr uint32_t kParity = 0x1BD11BDA;
constexpr int kRotations[8] = {13, 15, 26, 6, 17, 29, 16, 24};

inline uint32_t rotl(uint32_t x, int r) {
  return (x << r) | (x >> (32 - r));
}

// The first output word of Threefry-2x32-20 for key (k0, k1) and counter (c0, c1) (Random123; spec section 4).
inline uint32_t threefry_first_word(uint32_t k0, uint32_t k1, uint32_t c0, uint32_t c1) {
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ kParity};
  uint32_t x0 = c0 + k0, x1 = c1 + k1;
  for (int i = 0; i < 5; ++i) {
    const int* rot = kRotations + (i % 2) * 4;
    for (int j = 0; j < 4; ++j) {
      x0 += x1;
      x1 = rotl(x1, rot[j]) ^ x0;
    }
    x0 += ks[(i + 1) % 3];
    x1 += ks[(i + 2) % 3] + static_cast<uint32_t>(i + 1);
  }
  return x0;
}

typedef uint32_t U8v __attribute__((vector_size(8 * sizeof(uint32_t))));

// One Threefry-2x32 round on two groups of eight lanes with its rotation R a constant
template <int R>
__attribute__((always_inline)) inline void threefry_round8x2(U8v& a0, U8v& a1, U8v& b0, U8v& b1) {
  a0 += a1;
  b0 += b1;
  a1 = ((a1 << R) | (a1 >> (32 - R))) ^ a0;
  b1 = ((b1 << R) | (b1 >> (32 - R))) ^ b0;
}

// The first Threefry-2x32-20 word for counters c0 (sixteen: a then b, eight each) and c1, in place: sixteen lanes
// as two eight-lane vectors, one AVX2 register each, side by side (two independent chains of rounds), the rounds
// unrolled with constant rotations (threefry_first_word is the scalar definition). (A sixteen-lane vector type
// cost GCC stack traffic on AVX2 for its broadcasts and key adds.)
__attribute__((always_inline)) inline void threefry8x2(uint32_t k0, uint32_t k1, U8v& a, U8v& b, uint32_t c1) {
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ kParity};
  U8v a0 = a + k0, b0 = b + k0;
  U8v a1 = U8v{} + (c1 + k1), b1 = a1;
  static_assert(kRotations[0] == 13 && kRotations[1] == 15 && kRotations[2] == 26 && kRotations[3] == 6 &&
                kRotations[4] == 17 && kRotations[5] == 29 && kRotations[6] == 16 && kRotations[7] == 24,
                "the rounds below spell out kRotations");
#pragma GCC unroll 5
  for (int i = 0; i < 5; ++i) {
    if (i % 2 == 0) {
      threefry_round8x2<13>(a0, a1, b0, b1);
      threefry_round8x2<15>(a0, a1, b0, b1);
      threefry_round8x2<26>(a0, a1, b0, b1);
      threefry_round8x2<6>(a0, a1, b0, b1);
    } else {
      threefry_round8x2<17>(a0, a1, b0, b1);
      threefry_round8x2<29>(a0, a1, b0, b1);
      threefry_round8x2<16>(a0, a1, b0, b1);
      threefry_round8x2<24>(a0, a1, b0, b1);
    }
    const uint32_t k_0 = ks[(i + 1) % 3], k_1 = ks[(i + 2) % 3] + static_cast<uint32_t>(i + 1);
    a0 += k_0;
    b0 += k_0;
    a1 += k_1;
    b1 += k_1;
  }
  a = a0;
  b = b0;
}

// lane l holds l
const U8v kIota8 = {0, 1, 2, 3, 4, 5, 6, 7};

// RandomBits over [B, C]: seed (uint64), c0, c1 (uint32), each [B, C] with any strides (broadcast views have
// zero strides), -> uint32 [B, C] row contiguous.
class ThreefryBits : public mx::Primitive {
 public:
  explicit ThreefryBits(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) {
      encoder.set_input_array(in);
    }
    encoder.set_output_array(out);
    dispatch(encoder, [seed = mx::array::unsafe_weak_copy(inputs[0]),
                      c0 = mx::array::unsafe_weak_copy(inputs[1]),
                      c1 = mx::array::unsafe_weak_copy(inputs[2]),
                      out = mx::array::unsafe_weak_copy(out)]() mutable {
      const int64_t rows = out.shape(0), cols = out.shape(1);
      const uint64_t* s = seed.data<uint64_t>();
      const uint32_t* a = reinterpret_cast<const uint32_t*>(c0.data<char>());   // int32 counters: the same bits
      const uint32_t* b = reinterpret_cast<const uint32_t*>(c1.data<char>());
      uint32_t* o = out.data<uint32_t>();
      // a dimension of size 1 broadcasts: read it with stride 0; a 1-D input [B] reads as [B, 1]
      auto st = [](const mx::array& a, int d) {
        if (d >= a.ndim()) return int64_t(0);
        return a.shape(d) == 1 ? int64_t(0) : int64_t(a.strides()[d]);
      };
      const int64_t ss[2] = {st(seed, 0), st(seed, 1)}, as[2] = {st(c0, 0), st(c0, 1)}, bs[2] = {st(c1, 0), st(c1, 1)};
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const uint64_t key = s[r * ss[0] + c * ss[1]];
          o[r * cols + c] = threefry_first_word(static_cast<uint32_t>(key >> 32), static_cast<uint32_t>(key),
                                                a[r * as[0] + c * as[1]], b[r * bs[0] + c * bs[1]]);
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("samplec_native.threefry_bits runs on the CPU only");
  }

  const char* name() const override {
    return "SamplecThreefryBits";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return true;  // no state: equal inputs give equal bits (lets MLX's compile merge duplicates)
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {threefry_shape(inputs[0], inputs[1], inputs[2])};
  }

  static mx::Shape threefry_shape(const mx::array& seed, const mx::array& c0, const mx::array& c1) {
    auto as2 = [](const mx::array& a) { return a.ndim() == 2 ? a.shape() : mx::Shape{a.shape(0), 1}; };
    return mx::broadcast_shapes(mx::broadcast_shapes(as2(seed), as2(c0)), as2(c1));
  }
};

// seed uint64 and counters uint32 or int32 (read as their uint32 cast), each [B, C] or [B] (= [B, 1]),
// broadcasting against each other
mx::array threefry_bits(const mx::array& seed, const mx::array& c0, const mx::array& c1) {
  auto counter = [](const mx::array& c) { return c.dtype() == mx::uint32 || c.dtype() == mx::int32; };
  if (seed.dtype() != mx::uint64 || !counter(c0) || !counter(c1)) {
    throw std::invalid_argument("threefry_bits: expected seed uint64, counters uint32 or int32");
  }
  for (const auto* a : {&seed, &c0, &c1}) {
    if (a->ndim() != 1 && a->ndim() != 2) {
      throw std::invalid_argument("threefry_bits: expected 1-D or 2-D arrays");
    }
  }
  mx::Shape shape = ThreefryBits::threefry_shape(seed, c0, c1);
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::uint32, std::make_shared<ThreefryBits>(stream), {seed, c0, c1});
}

// ---- candidate selection (the -O2 plan's first steps), each one primitive ------------------------------------
//
// Each class below is the C++ twin of one IR op's MLX kernel in samplec/backend_mlx/kernels.py, with the same
// results (tests/test_native.py compares them): inputs are made row contiguous by the Python side.

inline bool greater_nan(float a, float b) {  // a > b, NaN above everything (it must win a maximum)
  return a > b || (std::isnan(a) && !std::isnan(b));
}

// A primitive whose CPU work is `fn(inputs, outputs)` on row-contiguous inputs, run on MLX's CPU stream.
template <class Impl>
class RowPrimitive : public mx::Primitive {
 public:
  RowPrimitive(mx::Stream stream, Impl impl) : mx::Primitive(stream), impl_(std::move(impl)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& out : outputs) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> ins, outs;
    for (auto& in : inputs) {
      encoder.set_input_array(in);
      ins.push_back(mx::array::unsafe_weak_copy(in));
    }
    for (auto& out : outputs) {
      encoder.set_output_array(out);
      outs.push_back(mx::array::unsafe_weak_copy(out));
    }
    dispatch(encoder, [impl = impl_, ins = std::move(ins), outs = std::move(outs)]() mutable { impl(ins, outs); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string("samplec_native.") + Impl::kName + " runs on the CPU only");
  }

  const char* name() const override {
    return Impl::kName;
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const RowPrimitive<Impl>*>(&other);
    return o != nullptr && o->impl_ == impl_;
  }

 private:
  Impl impl_;
};

template <class Impl>
std::vector<mx::array> make(Impl impl, std::vector<mx::Shape> shapes, std::vector<mx::Dtype> dtypes,
                            std::vector<mx::array> inputs) {
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays(std::move(shapes), dtypes, std::make_shared<RowPrimitive<Impl>>(stream, impl),
                                inputs);
}

// A per-row parameter as the kernels read it through Rows (which broadcasts a dimension of size 1): [B, 1], [B],
// [1], [1, 1] or a scalar.
bool is_column(const mx::array& a, int B) {
  const bool rows = a.ndim() >= 1 && (a.shape(0) == B || a.shape(0) == 1);
  return a.ndim() == 0 || (a.ndim() == 1 && rows) || (a.ndim() == 2 && rows && a.shape(1) == 1);
}

void need_rows(const mx::array& a, mx::Dtype dtype, const char* what) {
  if (a.dtype() != dtype || a.ndim() != 2) {
    throw std::invalid_argument(std::string(what) + ": expected a 2-D array of the right dtype");
  }
}

// Element (r, c) of a 2-D input with any strides (MLX views: slices, broadcasts, transposes).
template <class T>
struct Rows {
  const T* p;
  int64_t s0, s1;
  // (a 1-D or 0-D array reads as a column; a dimension of size 1 broadcasts)
  explicit Rows(const mx::array& a)
      : p(a.data<T>()), s0(a.ndim() >= 1 && a.shape(0) > 1 ? a.strides()[0] : 0),
        s1(a.ndim() >= 2 && a.shape(1) > 1 ? a.strides()[1] : 0) {}
  T operator()(int64_t r, int64_t c) const { return p[r * s0 + c * s1]; }
  // Row r as a contiguous pointer: in place, or (a strided view) copied into buf.
  const T* row(int64_t r, int64_t n, std::vector<T>& buf) const {
    if (s1 == 1) return p + r * s0;
    buf.resize(n);
    for (int64_t i = 0; i < n; ++i) buf[i] = (*this)(r, i);
    return buf.data();
  }
};

// On x86-64 the vocabulary-wide loops are also compiled for AVX2 and AVX-512 and picked at load time (the build's
// baseline is SSE2).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SAMPLEC_VOCAB_LOOP __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SAMPLEC_VOCAB_LOOP
#endif

// The vectorized maxima below keep 16 running maxima (`x > m ? x : m`: vmaxps) in two 8-float vectors (AVX2 and
// AVX-512 registers) and, beside them, running sums as a NaN probe: a NaN among the values leaves its lane's sum
// NaN. A NaN probe (also reached by +inf meeting -inf, or by overflow) sends the values through the exact scalar
// loop, so the result is always MLX's: a NaN wins. Comparisons and selects (`?:`) stay at eight lanes in the hot
// loops: GCC splits sixteen-lane arithmetic into two AVX2 registers but lowers a sixteen-lane comparison or `?:`
// lane by lane through the stack (block_max_row was ten times slower so; session 17).
typedef float F8 __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t I32x8 __attribute__((vector_size(8 * sizeof(int32_t))));

// The OR of eight lanes
inline uint32_t or_lanes8(I32x8 v) {
  typedef int32_t I4 __attribute__((vector_size(4 * sizeof(int32_t))));
  I4 c, d;
  std::memcpy(&c, &v, sizeof c);
  std::memcpy(&d, reinterpret_cast<const char*>(&v) + sizeof c, sizeof d);
  c |= d;
  return static_cast<uint32_t>(c[0] | c[1] | c[2] | c[3]);
}

// Sixteen comparisons as bits (bit l: lane l), two eight-lane halves: GCC lowers a sixteen-lane comparison lane by
// lane on AVX2
const I32x8 kBit8 = {1, 2, 4, 8, 16, 32, 64, 128};
inline uint32_t bits16(I32x8 lo, I32x8 hi) { return or_lanes8((lo & kBit8) | (hi & (kBit8 << 8))); }

constexpr int kLanes = 16;
constexpr int kGroup = 16;      // segments a block maximum pass walks down at once

struct Lanes {
  F8 m0, m1, s0, s1;
  Lanes() : m0{}, m1{}, s0{}, s1{} {
    m0 -= INFINITY;
    m1 -= INFINITY;
  }
  void add(const float* p) {        // p[0..16)
    F8 a, b;
    std::memcpy(&a, p, sizeof a);
    std::memcpy(&b, p + 8, sizeof b);
    m0 = a > m0 ? a : m0;
    m1 = b > m1 ? b : m1;
    s0 += a;
    s1 += b;
  }
  void start(const float* m) {      // from maxima so far
    std::memcpy(&m0, m, sizeof m0);
    std::memcpy(&m1, m + 8, sizeof m1);
  }
  void store(float* o) const {
    std::memcpy(o, &m0, sizeof m0);
    std::memcpy(o + 8, &m1, sizeof m1);
  }
  bool probe_nan() const {
    const F8 s = s0 + s1;
    float t = 0.0f;
    for (int j = 0; j < 8; ++j) t += s[j];
    return t != t;
  }
  float max() const {
    float best = -INFINITY;
    for (int j = 0; j < 8; ++j) {
      best = m0[j] > best ? m0[j] : best;
      best = m1[j] > best ? m1[j] : best;
    }
    return best;
  }
};

// A temperature's division as the stages apply it: -inf (a removed token) stays -inf whatever t is (inf / inf
// would be NaN), and t = 1 leaves v as it is. The division is made for every v and then selected, so that the
// loops using this vectorize (with -fno-trapping-math, CMakeLists.txt)
__attribute__((always_inline)) inline float divided(float v, float t) {
  const float q = v / t;
  return (t == 1.0f) | (v == -INFINITY) ? v : q;
}

// The first i in [from, n) where hit(i), or n: sixty-four tested at a time (a count, not a flag: the
// compare-and-add vectorizes), then one by one in the chunk that holds it. Inlined into each vocabulary loop below,
// so that it is compiled for that loop's target.
template <class Hit>
__attribute__((always_inline)) inline int64_t first_hit(int64_t from, int64_t n, Hit hit) {
  int64_t i = from;
  for (; i + 64 <= n; i += 64) {
    int hits = 0;
    for (int j = 0; j < 64; ++j) hits += hit(i + j);
    if (hits) break;
  }
  while (i < n && !hit(i)) ++i;
  return i;
}

// The first i in [from, n) with v[i] not -inf (NaN included), or n (a row after a cut holds a few such values
// among -inf).
SAMPLEC_VOCAB_LOOP int64_t first_above_neg_inf(const float* v, int64_t from, int64_t n) {
  return first_hit(from, n, [v](int64_t i) { return static_cast<int>(v[i] != -INFINITY); });
}

// The largest of v[0..n), a NaN winning.
SAMPLEC_VOCAB_LOOP float max_nan(const float* v, int64_t n) {
  Lanes acc;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc.add(v + i);
  float best = acc.max();
  bool nan = acc.probe_nan();
  for (; i < n; ++i) {
    best = v[i] > best ? v[i] : best;
    nan |= v[i] != v[i];
  }
  if (nan) {
    for (int64_t t = 0; t < n; ++t) {
      if (std::isnan(v[t])) return v[t];
    }
  }
  return best;
}

// spans' maxima (max_nan's, part(c) for span c < n) combined in span order: the first NaN where there is one
template <class F>
float max_of_parts(size_t n, F part) {
  float m = part(0);
  for (size_t c = 1; c < n && m == m; ++c) m = part(c) != part(c) || part(c) > m ? part(c) : m;
  return m;
}

float max_of_spans(const std::vector<float>& part) {
  return max_of_parts(part.size(), [&part](size_t c) { return part[c]; });
}

// max_nan over a whole row, in spans (split): the first NaN's bits where there is one, as max_nan
float max_spans(const float* v, int64_t n) {
  if (spans(n) <= 1) return max_nan(v, n);
  return max_of_spans(per_span<float>(n, [v](int64_t lo, int64_t hi) { return max_nan(v + lo, hi - lo); }));
}

// The largest of eight lanes (none NaN), halving the vector
inline float max_lanes8(F8 a) {
  typedef float F4 __attribute__((vector_size(4 * sizeof(float))));
  F4 c, d;
  std::memcpy(&c, &a, sizeof c);
  std::memcpy(&d, reinterpret_cast<const char*>(&a) + sizeof c, sizeof d);
  c = c > d ? c : d;
  const float e = c[0] > c[1] ? c[0] : c[1], f = c[2] > c[3] ? c[2] : c[3];
  return e > f ? e : f;
}

// One row's block maxima: o[c] = the largest of x[c * bs .. (c + 1) * bs) (the last block may be partial), a NaN
// winning. Blocks are contiguous, so the chain gathers a chosen block's tokens from a few cache lines. A block of
// 64 is eight eight-lane loads folded by `a > m ? a : m` (vmaxps), then halved to one; beside them running sums
// are a NaN probe: where one met a NaN (or +inf met -inf, or the sum overflowed), every block goes through the exact
// scalar loop.
SAMPLEC_VOCAB_LOOP void block_max_row(const float* x, int64_t V, int64_t nb, int bs, float* o) {
  const int64_t full = bs == 64 ? V / 64 : 0;
  F8 probe = {};
  for (int64_t c = 0; c < full; ++c) {      // (eight-float vectors: GCC lowers a sixteen-float `?:` lane by lane
    const float* p = x + c * 64;           // on AVX2, ten times slower)
    F8 v0, v1, v2, v3, v4, v5, v6, v7;      // (named, not an array: GCC kept an array on the stack)
    std::memcpy(&v0, p, sizeof v0);
    std::memcpy(&v1, p + 8, sizeof v1);
    std::memcpy(&v2, p + 16, sizeof v2);
    std::memcpy(&v3, p + 24, sizeof v3);
    std::memcpy(&v4, p + 32, sizeof v4);
    std::memcpy(&v5, p + 40, sizeof v5);
    std::memcpy(&v6, p + 48, sizeof v6);
    std::memcpy(&v7, p + 56, sizeof v7);
    probe += ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7));
    v0 = v0 > v1 ? v0 : v1;
    v2 = v2 > v3 ? v2 : v3;
    v4 = v4 > v5 ? v4 : v5;
    v6 = v6 > v7 ? v6 : v7;
    v0 = v0 > v2 ? v0 : v2;
    v4 = v4 > v6 ? v4 : v6;
    o[c] = max_lanes8(v0 > v4 ? v0 : v4);
  }
  bool nan = false;
  for (int l = 0; l < 8; ++l) nan |= probe[l] != probe[l];
  const int64_t exact = nan ? 0 : full;
  for (int64_t c = exact; c < nb; ++c) {     // (a NaN met; another block size; the partial last block)
    float m = -INFINITY;
    for (int64_t i = c * bs; i < std::min<int64_t>(V, (c + 1) * bs); ++i) {
      if (greater_nan(x[i], m)) m = x[i];
    }
    o[c] = m;
  }
}

// block_max_row in spans (blocks of 64: a span is whole blocks)
void block_max_spans(const float* x, int64_t V, int64_t nb, int bs, float* o) {
  if (bs != 64) return block_max_row(x, V, nb, bs, o);
  each_span(V, [&](int64_t lo, int64_t hi) { block_max_row(x + lo, hi - lo, (hi - lo + 63) / 64, 64, o + lo / 64); });
}

// block_max: block j of a row holds tokens j * bs .. (j + 1) * bs - 1 (NB = ceil(V / bs) blocks; the last partial).
struct BlockMax {
  static constexpr const char* kName = "SamplecBlockMax";
  int bs;
  bool operator==(const BlockMax& o) const { return bs == o.bs; }
  void operator()(std::vector<mx::array>& in, std::vector<mx::array>& out) const {
    const int64_t rows = in[0].shape(0), V = in[0].shape(1), nb = out[0].shape(1);
    const Rows<float> x(in[0]);
    float* o = out[0].data<float>();
    split(rows, [&](int64_t r) {
      thread_local std::vector<float> buf;
      block_max_spans(x.row(r, V, buf), V, nb, bs, o + r * nb);
    });
  }
};

// The k largest of v at the positions `at(0..count)` (ascending; their positions, ascending) and the (k+1)-th
// largest value (-inf when count <= k), with a min-heap of k + 1 entries. Equal values rank by position (the
// lower first), a NaN above everything.
template <class At>
void heap_select(const float* v, int64_t count, At at, int k, int32_t* top, float* next,
                 std::vector<std::pair<float, int32_t>>& heap) {
  // heap order: the smallest (value, then the larger position) on top, so ties keep the lower positions
  auto worse = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return greater_nan(a.first, b.first) || (a.first == b.first && a.second < b.second) ||
           (std::isnan(a.first) && std::isnan(b.first) && a.second < b.second);
  };
  const int64_t keep = std::min<int64_t>(count, k + 1);
  heap.clear();
  for (int64_t i = 0; i < keep; ++i) heap.emplace_back(v[at(i)], static_cast<int32_t>(at(i)));
  std::make_heap(heap.begin(), heap.end(), worse);
  for (int64_t i = keep; i < count; ++i) {
    const int64_t p = at(i);
    if (greater_nan(v[p], heap.front().first)) {
      std::pop_heap(heap.begin(), heap.end(), worse);
      heap.back() = {v[p], static_cast<int32_t>(p)};
      std::push_heap(heap.begin(), heap.end(), worse);
    }
  }
  if (count > k) {
    *next = heap.front().first;
    std::pop_heap(heap.begin(), heap.end(), worse);
    heap.pop_back();
  } else {
    *next = -INFINITY;
  }
  for (int i = 0; i < k; ++i) top[i] = heap[i].second;
  std::sort(top, top + k);
}

// Appends the positions i with v[i] >= bound (no NaN in v), ascending: sixteen values compared at a time, and
// only a group holding one is looked at one by one (a high bound: most groups hold none).
SAMPLEC_VOCAB_LOOP void positions_at_least(const float* v, int64_t n, float bound, std::vector<int32_t>& out,
                                           int64_t base = 0) {   // (positions base + i)
  const F8 b = F8{} + bound;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {           // sixteen compared at once, the hits taken by their bits
    F8 a0, a1;
    std::memcpy(&a0, v + i, sizeof a0);
    std::memcpy(&a1, v + i + 8, sizeof a1);
    for (uint32_t hits = bits16(a0 >= b, a1 >= b); hits; hits &= hits - 1) {
      out.push_back(static_cast<int32_t>(base + i + __builtin_ctz(hits)));
    }
  }
  for (; i < n; ++i) {
    if (v[i] >= bound) out.push_back(static_cast<int32_t>(base + i));
  }
}

// The k largest of v[0..n) (their positions, ascending) and the (k+1)-th largest value (-inf when n <= k).
// First a bound: the maxima of k + 1 disjoint chunks are k + 1 values at distinct positions, so the smallest of
// them is at most the (k+1)-th largest value and only the values at or above it (a few k, typically) can be among
// the k + 1 largest; the heap then sees those alone. A NaN anywhere sends the row to the heap whole.
void select_top(const float* v, int64_t n, int k, int32_t* top, float* next,
                std::vector<std::pair<float, int32_t>>& heap, std::vector<int32_t>& kept) {
  const int64_t chunks = int64_t(k) + 1;
  if (n >= 8 * chunks) {
    float bound = INFINITY;
    for (int64_t c = 0; c < chunks && bound == bound; ++c) {
      const int64_t lo = c * n / chunks, hi = (c + 1) * n / chunks;
      const float m = max_nan(v + lo, hi - lo);
      bound = m != m ? m : std::min(bound, m);
    }
    if (bound == bound) {
      kept.clear();
      positions_at_least(v, n, bound, kept);
      heap_select(v, static_cast<int64_t>(kept.size()), [&kept](int64_t i) { return int64_t(kept[i]); }, k, top,
                  next, heap);
      return;
    }
  }
  heap_select(v, n, [](int64_t i) { return i; }, k, top, next, heap);
}

// select_top on every row of a 2-D float input (rows with a stride other than 1 are copied first).
void select_top_rows(const mx::array& in, int k, int32_t* top, float* next) {
  const int64_t rows = in.shape(0), n = in.shape(1);
  const Rows<float> x(in);
  std::vector<float> buf;
  std::vector<std::pair<float, int32_t>> heap;
  std::vector<int32_t> kept;
  for (int64_t r = 0; r < rows; ++r) {
    select_top(x.row(r, n, buf), n, k, top + r * k, next + r, heap, kept);
  }
}

void gather_rows(const mx::array& a, const int32_t* pos, int64_t w, mx::array& out);

// topk_positions + kth_largest_static(k + 1): positions of the k largest (ascending) and the (k+1)-th largest
// value (-inf when k + 1 > n). Which of equal values at the k-th place is taken is unspecified (plans guard it).
// With `low`, then the smallest of the k values (reduce_min of their take_along: NaN when one is NaN). Then
// out[i] = in[1 + i] at those positions (take_along), for float32 or int32 inputs shaped like x.
struct TopKSelect {
  static constexpr const char* kName = "SamplecTopKSelect";
  int k;
  bool low;
  bool operator==(const TopKSelect& o) const { return k == o.k && low == o.low; }
  void operator()(std::vector<mx::array>& in, std::vector<mx::array>& out) const {
    int32_t* pos = out[0].data<int32_t>();
    select_top_rows(in[0], k, pos, out[1].data<float>());
    if (low) {
      const int64_t rows = in[0].shape(0);
      const Rows<float> x(in[0]);
      float* o = out[2].data<float>();
      for (int64_t r = 0; r < rows; ++r) {
        float m = INFINITY;
        for (int i = 0; i < k; ++i) {
          const float v = x(r, pos[r * k + i]);
          if (v < m || v != v) m = v;
          if (m != m) break;
        }
        o[r] = m;
      }
    }
    const size_t first = low ? 3 : 2;
    for (size_t g = 1; g < in.size(); ++g) {
      gather_rows(in[g], pos, k, out[first + g - 1]);
    }
  }
};

// top_logprobs: the ids of the k largest of log_softmax(x) = (x - max) - log Z (max and log Z [B, 1] each, as
// row_logsumexp or the chain kernel gives them), descending, the lower id first among equal log-probabilities,
// and those log-probabilities (a second output: no gather after it). The selection runs on x
// (log_softmax keeps its order) with `margin` more, and those are ordered by their log-probabilities computed as
// MLX computes them: rounding can tie logits that differ, and the lower id must then come first.
// The kk positions `top` ranked by their log-probabilities (v - m) - lz, descending, the lower id first among
// equals: the first k of them into ids and vals
void rank_logprobs(const float* v, const int32_t* top, int kk, int k, float m, float lz,
                   std::vector<std::pair<float, int32_t>>& ranked, int32_t* ids, float* vals) {
  ranked.clear();
  for (int i = 0; i < kk; ++i) ranked.emplace_back((v[top[i]] - m) - lz, top[i]);
  std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
    return greater_nan(a.first, b.first) || (a.first == b.first && a.second < b.second) ||
           (a.first != a.first && b.first != b.first && a.second < b.second);
  });
  for (int i = 0; i < k; ++i) ids[i] = ranked[i].second, vals[i] = ranked[i].first;
}

struct TopLogprobIds {
  static constexpr const char* kName = "SamplecTopLogprobIds";
  int k, margin;
  bool operator==(const TopLogprobIds& o) const { return k == o.k && margin == o.margin; }
  void operator()(std::vector<mx::array>& in, std::vector<mx::array>& out) const {
    const int64_t rows = in[0].shape(0), n = in[0].shape(1);
    const int kk = static_cast<int>(std::min<int64_t>(n, int64_t(k) + margin));
    const Rows<float> x(in[0]), mx_(in[1]), lz_(in[2]);
    int32_t* ids = out[0].data<int32_t>();
    float* vals = out[1].data<float>();
    split(rows, [&](int64_t r) {
      thread_local std::vector<float> buf;
      thread_local std::vector<int32_t> top, kept;
      thread_local std::vector<std::pair<float, int32_t>> heap, ranked;
      top.resize(kk);
      const float* v = x.row(r, n, buf);
      float next;
      select_top(v, n, kk, top.data(), &next, heap, kept);
      rank_logprobs(v, top.data(), kk, k, mx_(r, 0), lz_(r, 0), ranked, ids + r * k, vals + r * k);
    });
  }
};

// The k + margin largest of a row v[0..V) as select_top finds them, from its block maxima bm (blocks of bs): the
// (k + margin)-th largest maximum bounds the values that can be among them (that many blocks hold a value at
// least as large), so only the blocks whose maximum reaches it are looked at. Then ranked as top_logprob_ids
// ranks them. (The whole row where the blocks cannot narrow it: few blocks, a NaN.)
void top_logprobs_of_blocks(const float* v, int64_t V, const float* bm, int64_t nb, int bs, int k, int margin,
                            float m, float lz, int32_t* ids, float* vals) {
  const int kk = static_cast<int>(std::min<int64_t>(V, int64_t(k) + margin));
  thread_local std::vector<int32_t> top, kept, top_blocks;
  thread_local std::vector<std::pair<float, int32_t>> heap, ranked;
  top.resize(kk);
  float next;
  bool nan = false;
  if (nb >= 8 * int64_t(kk)) {
    top_blocks.resize(kk);
    heap_select(bm, nb, [](int64_t i) { return i; }, kk, top_blocks.data(), &next, heap);
    float bound = INFINITY;
    for (int i = 0; i < kk; ++i) {
      const float b = bm[top_blocks[i]];
      nan |= b != b;
      bound = std::min(bound, b);
    }
    if (!nan) {
      // (values at the bound rank by position: once kk of them are in, a block whose maximum is the bound holds
      // none that could be chosen -- a tied top takes a few blocks, not every one)
      kept.clear();
      int64_t at_bound = 0;
      for (int64_t c = 0; c < nb; ++c) {
        if (bm[c] > bound || (bm[c] == bound && at_bound < kk)) {
          const size_t from = kept.size();
          positions_at_least(v + c * bs, std::min<int64_t>(bs, V - c * bs), bound, kept, c * bs);
          for (size_t i = from; i < kept.size(); ++i) at_bound += v[kept[i]] == bound;
        }
      }
      heap_select(v, static_cast<int64_t>(kept.size()), [](int64_t i) { return int64_t(kept[i]); }, kk, top.data(),
                  &next, heap);
    }
  }
  if (nb < 8 * int64_t(kk) || nan) select_top(v, V, kk, top.data(), &next, heap, kept);
  rank_logprobs(v, top.data(), kk, k, m, lz, ranked, ids, vals);
}

std::vector<mx::array> top_logprob_ids(const mx::array& x, const mx::array& m, const mx::array& lz, int k,
                                       int margin) {
  need_rows(x, mx::float32, "top_logprob_ids");
  need_rows(m, mx::float32, "top_logprob_ids");
  need_rows(lz, mx::float32, "top_logprob_ids");
  if (k < 1 || k > x.shape(1) || margin < 0 || m.shape(0) != x.shape(0) || lz.shape(0) != x.shape(0) ||
      m.shape(1) != 1 || lz.shape(1) != 1) {
    throw std::invalid_argument("top_logprob_ids: x [B, n], max and log Z [B, 1], 1 <= k <= n, margin >= 0");
  }
  return make(TopLogprobIds{k, margin}, {{x.shape(0), k}, {x.shape(0), k}}, {mx::int32, mx::float32}, {x, m, lz});
}

// out = a at positions pos (rows of width w), elementwise over 4-byte values (float32 or int32)
void gather_rows(const mx::array& a, const int32_t* pos, int64_t w, mx::array& out) {
  const uint32_t* p = reinterpret_cast<const uint32_t*>(a.data<char>());
  uint32_t* o = reinterpret_cast<uint32_t*>(out.data<char>());
  const int64_t rows = out.shape(0), s0 = a.strides()[0], s1 = a.strides()[1];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < w; ++i) {
      o[r * w + i] = p[r * s0 + pos[r * w + i] * s1];
    }
  }
}

// argmax + take_along: the first position of each row's maximum (a NaN wins, the first one), as MLX's argmax,
// and in[1 + i] at it ([B, 1], or [B] when `flat`: the squeeze that follows a sampled token's gather).
// The first i with v[i] == m (m a NaN: the first NaN), scanning 64 at a time; n when there is none.
SAMPLEC_VOCAB_LOOP int64_t first_of(const float* v, int64_t n, float m) {
  if (m != m) {
    int64_t i = 0;
    while (i < n && v[i] == v[i]) ++i;
    return i;
  }
  return first_hit(0, n, [v, m](int64_t i) { return static_cast<int>(v[i] == m); });
}

// first_of(v, V, top) for top = max_nan(bm, nb), from the row's block maxima (nb blocks of bs) and one block: the
// first block holding the maximum holds its first position (a NaN: the first block holding one)
int64_t first_of_blocks(const float* v, int64_t V, const float* bm, int64_t nb, int bs, float top) {
  int64_t c = 0;
  if (top == top) {
    while (c + 1 < nb && bm[c] != top) ++c;
  } else {
    while (c + 1 < nb && bm[c] == bm[c]) ++c;
  }
  const int64_t lo = c * bs, n = std::min<int64_t>(V, lo + bs) - lo;
  return lo + std::min<int64_t>(first_of(v + lo, n, top), n - 1);
}

struct ArgmaxTake {
  static constexpr const char* kName = "SamplecArgmaxTake";
  bool flat;
  bool operator==(const ArgmaxTake& o) const { return flat == o.flat; }
  void operator()(std::vector<mx::array>& in, std::vector<mx::array>& out) const {
    const int64_t rows = in[0].shape(0), n = in[0].shape(1);
    const Rows<float> x(in[0]);
    int32_t* pos = out[0].data<int32_t>();
    split(rows, [&](int64_t r) {       // the maximum in one vectorized pass, then its first position
      thread_local std::vector<float> buf;
      const float* v = x.row(r, n, buf);
      pos[r] = static_cast<int32_t>(first_of(v, n, max_spans(v, n)));
    });
    for (size_t g = 1; g < in.size(); ++g) {
      gather_rows(in[g], pos, 1, out[g]);
    }
  }
};

// Sort a row's entries by their id (id_of(e) in [0, max_id]), stably (equal ids keep their order: a last write
// stays last): LSD radix over the id's bits, 11 at a time (two passes for a vocabulary under 2^22), or
// std::stable_sort for a few.
template <class T, class IdOf>
void sort_by_id(std::vector<T>& a, int64_t max_id, IdOf id_of) {
  if (a.size() < 256) {
    std::stable_sort(a.begin(), a.end(), [&](const T& x, const T& y) { return id_of(x) < id_of(y); });
    return;
  }
  thread_local std::vector<T> tmp;
  tmp.resize(a.size());
  for (int shift = 0; shift < 31 && (max_id >> shift) > 0; shift += 11) {
    uint32_t count[2049] = {0};
    for (const T& e : a) ++count[((id_of(e) >> shift) & 2047) + 1];
    for (int d = 0; d < 2048; ++d) count[d + 1] += count[d];
    for (const T& e : a) tmp[count[(id_of(e) >> shift) & 2047]++] = e;
    a.swap(tmp);
  }
}
constexpr auto kPairId = [](const std::pair<int32_t, float>& e) { return static_cast<uint32_t>(e.first); };

// argmax of put_along(x, ids, vals) without writing it: x with vals at ids (a repeated id: its last entry's value),
// MLX's argmax on it (the first maximum, a NaN winning). [B, 1] int32. (ids, vals: [B, H], int32 / float32.)
// Row r's edits (ids, vals) [B, h] as put_along writes them into a row of n: the last write of each id in range,
// in id order.
void last_writes(const Rows<int32_t>& ids, const Rows<float>& vals, int64_t r, int64_t n, int64_t h,
                 std::vector<std::pair<int32_t, float>>& put) {
  put.clear();
  for (int64_t j = 0; j < h; ++j) {
    const int32_t id = ids(r, j);
    if (id >= 0 && id < n) put.emplace_back(id, vals(r, j));
  }
  sort_by_id(put, n - 1, kPairId);
  size_t u = 0;
  for (size_t k = 0; k < put.size(); ++k) {
    if (k + 1 < put.size() && put[k + 1].first == put[k].first) continue;
    put[u++] = put[k];
  }
  put.resize(u);
}

struct ArgmaxPut {
  static constexpr const char* kName = "SamplecArgmaxPut";
  bool operator==(const ArgmaxPut&) const { return true; }
  void operator()(std::vector<mx::array>& in, std::vector<mx::array>& out) const {
    const int64_t rows = in[0].shape(0), n = in[0].shape(1), h = in[1].shape(1);
    const Rows<float> x(in[0]), vals(in[2]);
    const Rows<int32_t> ids(in[1]);
    int32_t* pos = out[0].data<int32_t>();
    split(rows, [&](int64_t r) {
      thread_local std::vector<std::pair<int32_t, float>> put;
      thread_local std::vector<float> buf;
      last_writes(ids, vals, r, n, h, put);
      const float* row = x.row(r, n, buf);
      // candidates in position order -- the plain stretches between written ids (their maximum in one vectorized
      // pass each) and the written values -- the first strictly greater one winning (a NaN above all); the winning
      // stretch's first position holding its maximum
      float best = 0.0f;
      int64_t at = -1, lo = 0, hi = 0;     // (at < 0: no candidate yet; [lo, hi): the winning stretch)
      auto stretch = [&](int64_t a, int64_t b) {
        if (b <= a) return;
        const float m = max_spans(row + a, b - a);
        if (at < 0 || greater_nan(m, best)) best = m, at = a, lo = a, hi = b;
      };
      size_t k = 0;
      int64_t start = 0;
      while (k < put.size()) {
        const int64_t id = put[k].first;
        stretch(start, id);
        const float v = put[k++].second;
        if (at < 0 || greater_nan(v, best)) best = v, at = id, lo = hi = 0;
        start = id + 1;
      }
      stretch(start, n);
      if (hi > lo) at = lo + first_of(row + lo, hi - lo, best);
      pos[r] = static_cast<int32_t>(at < 0 ? 0 : at);
    });
  }
};

std::vector<mx::array> argmax_put(const mx::array& x, const mx::array& ids, const mx::array& vals) {
  need_rows(x, mx::float32, "argmax_put");
  need_rows(ids, mx::int32, "argmax_put");
  need_rows(vals, mx::float32, "argmax_put");
  if (ids.shape(0) != x.shape(0) || vals.shape(0) != x.shape(0) || vals.shape(1) != ids.shape(1)) {
    throw std::invalid_argument("argmax_put: ids and vals must be [B, H] for x [B, V]");
  }
  return make(ArgmaxPut{}, {{x.shape(0), 1}}, {mx::int32}, {x, ids, vals});
}

// DRY's repeat lengths (the `dry_repeats` op, samplec/backend_mlx/kernels.py `_dry_repeats`), in O(H) per row:
// for each position p >= 1 of the window w [B, H] (-1 = padding) with w[p-1], w[p] >= 0, S[p] = the length of
// the common suffix of w[:p] and w (a padding entry matches nothing), and out[B, V] (int32, -1 elsewhere) holds
// at each token the largest S[p] over the positions holding it. S[p] = Z[H - p] of the reversed window (the
// Z-algorithm, as llama.cpp computes it), each padding entry made a value of its own so that it never matches.
// in = [w [B, H] int32, x [B, V] (its shape only)]; out = [[B, V] int32].
struct DryRepeats {
  static constexpr const char* kName = "SamplecDryRepeats";
  bool operator==(const DryRepeats&) const { return true; }
  void operator()(std::vector<mx::array>& in, std::vector<mx::array>& out) const {
    const int64_t rows = in[0].shape(0), h = in[0].shape(1), n = in[1].shape(1);
    const Rows<int32_t> w(in[0]);
    int32_t* o = out[0].data<int32_t>();
    split(rows, [&](int64_t r) {
      thread_local std::vector<int64_t> rev;
      thread_local std::vector<int64_t> z;
      int32_t* row = o + r * n;
      std::fill(row, row + n, -1);
      if (h < 2) return;
      rev.resize(h);
      z.assign(h, 0);
      for (int64_t k = 0; k < h; ++k) {
        const int32_t v = w(r, h - 1 - k);
        rev[k] = v >= 0 ? v : -(k + 2);          // (padding: a value no other entry holds)
      }
      z[0] = h;
      for (int64_t i = 1, lo = 0, hi = 0; i < h; ++i) {
        int64_t len = i < hi ? std::min(hi - i, z[i - lo]) : 0;
        while (i + len < h && rev[len] == rev[i + len]) ++len;
        z[i] = len;
        if (i + len > hi) lo = i, hi = i + len;
      }
      for (int64_t q = 1; q < h; ++q) {
        const int32_t id = w(r, q);
        if (id < 0 || w(r, q - 1) < 0) continue;
        const int64_t at = std::min<int64_t>(id, n - 1);
        row[at] = std::max<int32_t>(row[at], static_cast<int32_t>(z[h - q]));
      }
    });
  }
};

mx::array dry_repeats(const mx::array& w, const mx::array& x) {
  need_rows(w, mx::int32, "dry_repeats");
  if (x.ndim() != 2 || x.shape(0) != w.shape(0) || x.shape(1) < 1) {
    throw std::invalid_argument("dry_repeats: the window [B, H] int32 and x [B, V]");
  }
  return make(DryRepeats{}, {{x.shape(0), x.shape(1)}}, {mx::int32}, {w, x})[0];
}

// Edits of a row (penalties'), (ids int32 [B, P], values float32 [B, P]) or none: checked, then appended to ins.
// Prefix ops: allow(mask) and logit_bias(b) as a kernel reads a row, each exactly as MLX computes it -- a mask
// (bool [B, V] or [1, V]): v -> mask ? v : -inf (where); a bias (float32 [B, V] or [1, V]): v -> v + b (add).
constexpr int kPrefixMask = 0, kPrefixBias = 1;
constexpr size_t kMaxPrefix = 8;            // (a longer run of allow and logit_bias ops is not fused)

void push_prefix(std::vector<mx::array>& ins, const std::vector<int>& codes, const std::vector<mx::array>& arrays,
                 const mx::array& x, const char* what) {
  if (codes.size() != arrays.size()) throw std::invalid_argument(std::string(what) + ": one array per prefix op");
  for (size_t k = 0; k < codes.size(); ++k) {
    const auto& a = arrays[k];
    const auto dtype = codes[k] == kPrefixMask ? mx::bool_ : mx::float32;
    if ((codes[k] != kPrefixMask && codes[k] != kPrefixBias) || a.dtype() != dtype || a.ndim() != 2 ||
        a.shape(1) != x.shape(1) || (a.shape(0) != x.shape(0) && a.shape(0) != 1)) {
      throw std::invalid_argument(std::string(what) + ": a prefix op is a mask (bool) or a bias (float32), [B, V] "
                                  "or [1, V]");
    }
    ins.push_back(a);
  }
}

// One prefix op's operand row: a mask's bytes or a bias's floats
struct PrefixRow {
  int code;
  const void* row;
  float at(int64_t i, float v) const {
    return code == kPrefixMask ? (static_cast<const uint8_t*>(row)[i] ? v : -INFINITY)
                               : v + static_cast<const float*>(row)[i];
  }
  // the operand from token lo on
  PrefixRow from(int64_t lo) const {
    return {code, code == kPrefixMask ? static_cast<const void*>(static_cast<const uint8_t*>(row) + lo)
                                      : static_cast<const void*>(static_cast<const float*>(row) + lo)};
  }
};

// dst[i] = op(src[i]) for i < n, op's operand from its start (dst may be src)
SAMPLEC_VOCAB_LOOP void prefix_pass(PrefixRow op, const float* src, float* dst, int64_t n) {
  if (op.code == kPrefixMask) {
    const uint8_t* m = static_cast<const uint8_t*>(op.row);
    for (int64_t i = 0; i < n; ++i) dst[i] = m[i] ? src[i] : -INFINITY;
  } else {
    const float* b = static_cast<const float*>(op.row);
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i] + b[i];
  }
}

void push_edits(std::vector<mx::array>& ins, const std::vector<mx::array>& edits, int B, const char* what) {
  if (edits.empty()) return;
  if (edits.size() != 2 || edits[0].dtype() != mx::int32 || edits[1].dtype() != mx::float32 ||
      edits[0].ndim() != 2 || edits[0].shape() != edits[1].shape() || edits[0].shape(0) != B) {
    throw std::invalid_argument(std::string(what) + ": edits are ids int32 [B, P] and values float32 [B, P]");
  }
  ins.push_back(edits[0]);
  ins.push_back(edits[1]);
}

// penalties' edits, one primitive for the whole stage: the history window's ids and the penalized logits there,
// as the stage's dense definition (samplec/frontend/expand.py `penalties`) computes them, and whether one of those
// overflows float32 (+inf). Entry j of row r counts when hist[r, j] >= 0 and it lies in the last last_n entries
// (last_n == -1: all); an entry that does not count reads token 0 (ids[r, j] = 0), as the dense definition's
// gather does, and carries token 0's value. A token's count is the number of counted entries holding it; where it
// is > 0 its logit v becomes (v > 0 ? v / repeat : v * repeat) - (count * frequency + presence), in float32 step
// by step (this function is compiled without FMA: no contraction). Optional prior edits (ids, vals) [B, P] are
// read first (a penalty after a penalty reads the first one's result; a later entry wins) and lead the output:
// the result is every edit so far, with no concatenation after it, and a prior entry for an id this stage writes
// carries the new value (all entries of an id agree, so a put_along of them all needs no order).
// in = [x [B, V], hist [B, H], last_n, repeat, frequency, presence (columns: [B, 1], [B], [1] or scalars; last_n
// i32, the others f32), (prior ids, prior vals)]; out = [ids [B, P + H] i32, vals [B, P + H] f32, overflow [B]].
struct PenaltyEdits {
  static constexpr const char* kName = "SamplecPenaltyEdits";
  std::vector<int> pre;       // prefix ops below the penalties (their arrays last in `in`): x is read through them
  bool operator==(const PenaltyEdits& o) const { return pre == o.pre; }
  void operator()(std::vector<mx::array>& in, std::vector<mx::array>& out) const {
    const int64_t rows = in[0].shape(0), n = in[0].shape(1), h = in[1].shape(1);
    const Rows<float> rep(in[3]), freq(in[4]), pres(in[5]);
    const Rows<int32_t> hist(in[1]), last_n(in[2]);
    const size_t at_pre = in.size() - pre.size();
    const bool prior = at_pre == 8;
    std::vector<Rows<uint8_t>> masks;       // (the prefix ops' operands, read as they apply: a mask or a bias)
    std::vector<Rows<float>> biases;
    for (size_t k = 0; k < pre.size(); ++k) {
      if (pre[k] == kPrefixMask) masks.emplace_back(in[at_pre + k]); else biases.emplace_back(in[at_pre + k]);
    }
    auto x = [&, raw = Rows<float>(in[0])](int64_t r, int64_t i) {
      float v = raw(r, i);
      for (size_t k = 0, m = 0, b = 0; k < pre.size(); ++k) {
        if (pre[k] == kPrefixMask) {
          v = masks[m++](r, i) ? v : -INFINITY;
        } else {
          v = v + biases[b++](r, i);
        }
      }
      return v;
    };
    const int64_t p = prior ? in[6].shape(1) : 0, w = p + h;     // (output rows: the prior edits, then these)
    int32_t* out_ids = out[0].data<int32_t>();
    float* out_vals = out[1].data<float>();
    bool* over = out[2].data<bool>();
    auto clamp = [n](int64_t i) { return static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(i, 0), n - 1)); };
    split(rows, [&](int64_t r) {       // (rows in parts: MLX's worker and a waiting caller share them)
      thread_local std::vector<uint64_t> order;          // (id << 32 | j) of the counted entries, by id
      thread_local std::vector<int32_t> seen;            // the counted ids, rising, once each
      thread_local std::vector<float> now;               // their values after this stage (seen's order)
      thread_local std::vector<std::pair<int32_t, float>> put;   // the prior edits by id (stable: the last wins)
      const int64_t ln = last_n(r, 0);
      int32_t* ids = out_ids + r * w + p - r * h;     // (ids[r * h + j] is this row's j-th new edit)
      float* vals = out_vals + r * w + p - r * h;
      order.clear();
      for (int64_t j = 0; j < h; ++j) {
        const int32_t id = hist(r, j);
        const bool valid = id >= 0 && (ln == -1 || j >= h - ln);
        ids[r * h + j] = valid ? clamp(id) : 0;
        if (valid) order.push_back(static_cast<uint64_t>(ids[r * h + j]) << 32 | static_cast<uint64_t>(j));
      }
      sort_by_id(order, n - 1, [](uint64_t k) { return static_cast<uint32_t>(k >> 32); });
      put.clear();
      if (prior) {
        const Rows<int32_t> pid(in[6]);
        const Rows<float> pval(in[7]);
        for (int64_t j = 0; j < p; ++j) {
          put.emplace_back(clamp(pid(r, j)), pval(r, j));
          out_ids[r * w + j] = pid(r, j);
          out_vals[r * w + j] = pval(r, j);
        }
        sort_by_id(put, n - 1, kPairId);
      }
      size_t q = 0;                                    // (put walked along the ids, which rise)
      auto base = [&](int32_t id) {                    // x at id through the prefix ops, or its last prior edit
        float v = x(r, id);
        while (q < put.size() && put[q].first < id) ++q;
        while (q < put.size() && put[q].first == id) v = put[q++].second;
        return v;
      };
      const float rr = rep(r, 0), ff = freq(r, 0), pp = pres(r, 0);
      bool overflow = false;
      seen.clear();
      now.clear();
      // each counted id once, in rising order (the logits read front to back): its penalized value goes to every
      // entry holding it
      const Rows<float> raw(in[0]);
      for (size_t a = 0; a < order.size();) {
        if (a + 32 < order.size()) {     // (the reads are scattered over the row: fetch ahead, several in flight)
          __builtin_prefetch(raw.p + r * raw.s0 + static_cast<int64_t>(order[a + 32] >> 32) * raw.s1);
        }
        const int32_t id = static_cast<int32_t>(order[a] >> 32);
        size_t b = a + 1;
        while (b < order.size() && static_cast<int32_t>(order[b] >> 32) == id) ++b;
        const float v = base(id);
        const float count = static_cast<float>(b - a);
        const float scaled = v > 0.0f ? v / rr : v * rr;
        const float spent = count * ff;
        const float penalty = spent + pp;
        const float pen = scaled - penalty;
        for (size_t k = a; k < b; ++k) vals[r * h + static_cast<int64_t>(order[k] & 0xFFFFFFFFu)] = pen;
        overflow |= pen == INFINITY || pen != pen;     // (+inf, or NaN: -inf minus a count's -inf)
        seen.push_back(id);
        now.push_back(pen);
        a = b;
      }
      // an entry that does not count reads token 0: its value after this stage
      if (static_cast<int64_t>(order.size()) < h) {
        q = 0;
        const float v0 = !seen.empty() && seen[0] == 0 ? now[0] : base(0);
        for (int64_t j = 0; j < h; ++j) {
          if (!(hist(r, j) >= 0 && (ln == -1 || j >= h - ln))) vals[r * h + j] = v0;
        }
        overflow |= v0 == INFINITY || v0 != v0;       // (the dense check reads these entries too)
      }
      // the row left with nothing but -inf (a penalty overflowing on its last kept tokens) is flagged too, as the
      // dense check reads it (reduce_max == -inf): where every written value is -inf, one that is not among the
      // tokens this stage leaves as they were (the first of a row usually)
      bool left = false;
      for (int64_t j = 0; j < h && !left; ++j) left = vals[r * h + j] != -INFINITY;
      // (seen and put are thread_local: named in the lambdas, not captured -- a capture must be automatic)
      auto written = [&](int32_t id) { return std::binary_search(seen.begin(), seen.end(), id); };
      auto edited = [&](int32_t id) {
        auto it = std::lower_bound(put.begin(), put.end(), id, [](const auto& e, int32_t v) { return e.first < v; });
        return it != put.end() && it->first == id;
      };
      for (size_t a = 0; a < put.size() && !left;) {      // an id with prior edits: its last one
        size_t b = a + 1;
        while (b < put.size() && put[b].first == put[a].first) ++b;
        left = !written(put[a].first) && put[b - 1].second != -INFINITY;
        a = b;
      }
      // the others read the row (through the prefix ops): the scan skips to its values above -inf (after a cut, a
      // few: the whole row in vectorized chunks). A -inf below the prefix ops stays -inf through them (a mask keeps
      // it or writes -inf; a bias is finite or -inf, +inf and NaN being refused at binding), so the skip reads the
      // row below them.
      const float* contiguous = raw.s1 == 1 ? raw.p + r * raw.s0 : nullptr;
      for (int64_t i = 0; i < n && !left; ++i) {
        if (contiguous) {
          i = first_above_neg_inf(contiguous, i, n);
          if (i == n) break;
        }
        if ((!contiguous || !pre.empty()) && x(r, i) == -INFINITY) continue;
        const int32_t id = static_cast<int32_t>(i);
        left = !written(id) && !edited(id);
      }
      over[r] = overflow || !left;
      if (prior) {     // a prior entry for an id this stage writes carries its new value: every entry of an id
                       // then holds the same one, and a put_along of the whole in any order gives the row
        for (int64_t j = 0; j < p; ++j) {
          const int32_t id = clamp(out_ids[r * w + j]);
          auto it = std::lower_bound(seen.begin(), seen.end(), id);
          if (it != seen.end() && *it == id) out_vals[r * w + j] = now[it - seen.begin()];
        }
      }
    });
  }
};

std::vector<mx::array> penalty_edits(const mx::array& x, const mx::array& hist, const mx::array& last_n,
                                     const mx::array& repeat, const mx::array& frequency, const mx::array& presence,
                                     const std::vector<mx::array>& prior, const std::vector<int>& pre,
                                     const std::vector<mx::array>& pre_arrays) {
  need_rows(x, mx::float32, "penalty_edits");
  need_rows(hist, mx::int32, "penalty_edits");
  const int B = x.shape(0), H = hist.shape(1);
  if (hist.shape(0) != B || x.shape(1) < 1) throw std::invalid_argument("penalty_edits: x [B, V], history [B, H]");
  for (const auto* a : {&last_n, &repeat, &frequency, &presence}) {
    if (!is_column(*a, B) || a->dtype() != (a == &last_n ? mx::int32 : mx::float32)) {
      throw std::invalid_argument("penalty_edits: last_n int32, the others float32, each [B, 1], [B], [1] or scalar");
    }
  }
  std::vector<mx::array> ins = {x, hist, last_n, repeat, frequency, presence};
  push_edits(ins, prior, B, "penalty_edits");
  push_prefix(ins, pre, pre_arrays, x, "penalty_edits");
  const int W = H + (prior.empty() ? 0 : prior[0].shape(1));
  return make(PenaltyEdits{pre}, {{B, W}, {B, W}, {B}}, {mx::int32, mx::float32, mx::bool_}, ins);
}

// A token history's input check: ids [B, H] int32 with each id >= V read as padding (-1), and a flag [B] per row
// holding one -- the call's error names those rows (program.py). One primitive for what would be four MLX ops.
struct HistoryCheck {
  static constexpr const char* kName = "SamplecHistoryCheck";
  int64_t V;
  bool operator==(const HistoryCheck& o) const { return V == o.V; }
  void operator()(std::vector<mx::array>& in, std::vector<mx::array>& out) const {
    const int64_t rows = out[0].shape(0), h = out[0].shape(1);
    const Rows<int32_t> ids(in[0]);
    int32_t* o = out[0].data<int32_t>();
    bool* flag = out[1].data<bool>();
    for (int64_t r = 0; r < rows; ++r) {
      bool over = false;
      for (int64_t j = 0; j < h; ++j) {
        const int32_t id = ids(r, j);
        over |= id >= V;
        o[r * h + j] = id >= V ? -1 : id;
      }
      flag[r] = over;
    }
  }
};

std::vector<mx::array> history_check(const mx::array& ids, int64_t V) {
  need_rows(ids, mx::int32, "history_check");
  return make(HistoryCheck{V}, {ids.shape(), {ids.shape(0)}}, {mx::int32, mx::bool_}, {ids});
}

mx::array block_max(const mx::array& x, int bs) {
  need_rows(x, mx::float32, "block_max");
  const int64_t nb = (x.shape(1) + bs - 1) / bs;
  return make(BlockMax{bs}, {{x.shape(0), static_cast<int>(nb)}}, {mx::float32}, {x})[0];
}

template <class Impl>
std::vector<mx::array> make_gathering(Impl impl, const mx::array& x, const std::vector<mx::array>& gathers,
                                      std::vector<mx::Shape> shapes, std::vector<mx::Dtype> dtypes,
                                      const mx::Shape& gathered, const char* what) {
  std::vector<mx::array> inputs = {x};
  for (const auto& g : gathers) {
    if ((g.dtype() != mx::float32 && g.dtype() != mx::int32) || g.shape() != x.shape()) {
      throw std::invalid_argument(std::string(what) + ": gathered arrays must be float32 or int32 shaped like x");
    }
    shapes.push_back(gathered);
    dtypes.push_back(g.dtype());
    inputs.push_back(g);
  }
  return make(impl, std::move(shapes), std::move(dtypes), std::move(inputs));
}

std::vector<mx::array> topk_select(const mx::array& x, int k, const std::vector<mx::array>& gathers, bool low) {
  need_rows(x, mx::float32, "topk_select");
  if (k < 1 || k > x.shape(1)) {
    throw std::invalid_argument("topk_select: need 1 <= k <= n");
  }
  const int rows = x.shape(0);
  std::vector<mx::Shape> shapes = {{rows, k}, {rows, 1}};
  std::vector<mx::Dtype> dtypes = {mx::int32, mx::float32};
  if (low) {
    shapes.push_back({rows, 1});
    dtypes.push_back(mx::float32);
  }
  return make_gathering(TopKSelect{k, low}, x, gathers, shapes, dtypes, {rows, k}, "topk_select");
}

std::vector<mx::array> argmax_take(const mx::array& x, const std::vector<mx::array>& gathers, bool flat) {
  need_rows(x, mx::float32, "argmax_take");
  if (x.shape(1) < 1) {
    throw std::invalid_argument("argmax_take: empty rows");
  }
  const int rows = x.shape(0);
  return make_gathering(ArgmaxTake{flat}, x, gathers, {{rows, 1}}, {mx::int32},
                        flat ? mx::Shape{rows} : mx::Shape{rows, 1}, "argmax_take");
}

// The hold (above): an array whose evaluation polls while the hold is open and no native task was queued after
// it.
class Hold : public mx::Primitive {
 public:
  Hold(mx::Stream stream, uint64_t seen) : mx::Primitive(stream), seen_(seen) {}

  void eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_output_array(out);
    encoder.dispatch([seen = seen_, out = mx::array::unsafe_weak_copy(out)]() mutable {
      linger(seen);
      *out.data<uint32_t>() = 0;
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("samplec_native.hold runs on the CPU only");
  }

  const char* name() const override {
    return "SamplecHold";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return false;
  }

 private:
  uint64_t seen_;
};

mx::array hold(double max_us) {
  auto stream = mx::default_stream(mx::Device::cpu);
  g_hold_us.store(max_us, std::memory_order_relaxed);
  g_holds.fetch_add(1, std::memory_order_acq_rel);
  return mx::array({}, mx::uint32, std::make_shared<Hold>(stream, g_queued.load(std::memory_order_acquire)), {});
}

// Wait for arrays being evaluated (mx.async_eval) by polling for up to `spin_us` microseconds before blocking.
// Meanwhile it takes the kernels' open parts (`help`); the time it helped does not count as polling.
void spin_wait(const std::vector<mx::array>& arrays, double spin_us) {
  auto start = std::chrono::steady_clock::now();
  for (const auto& a : arrays) {
    while (true) {
      const double spent =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
      bool helped = false;
      poll([&a, &helped] { return (helped = help()) || a.is_available(); }, spin_us - spent);
      if (!helped) break;
      start = std::chrono::steady_clock::now();
    }
    const_cast<mx::array&>(a).wait();
  }
}

// A call's start and end in one step each: open a hold and queue it; queue the call's arrays, close the hold and
// wait (polling first).
void wake(double max_us) {
  mx::async_eval({hold(max_us)});
}

void evaluate(const std::vector<mx::array>& arrays, double spin_us) {
  try {
    mx::async_eval(arrays);
  } catch (...) {
    release();
    throw;
  }
  release();
  spin_wait(arrays, spin_us);
}

// ---- exp over a row, eight lanes at a time -------------------------------------------------------------------------
//
// exp(v) for v <= 0 by the Cephes scheme: v = n ln 2 + r with |r| <= ln 2 / 2, a degree-6 polynomial for e^r, and
// 2^n put into the exponent bits; below -87.3 (where float32 e^v is subnormal or 0, and for -inf) it gives 0.
// Relative error ~2e-7 against the correctly rounded value: a normalizer Z summed from it (in double, per block)
// differs from float32 sums in other orders by less than their own rounding.
// (FV: eight float lanes, an AVX2 register: GCC lowers sixteen-lane comparisons and selects lane by lane there)
// (always inlined: a vector argument passed between a target_clones clone and a function compiled for the
// baseline has no common calling convention)
template <class FV, class IV>
__attribute__((always_inline)) inline FV exp_nonpos(FV v) {
  const FV lo = FV{} - 87.3f;
  const auto tiny = v < lo;
  v = tiny ? lo : v;
  const FV n = __builtin_convertvector(__builtin_convertvector(v * 1.44269504088896341f + (FV{} - 0.5f), IV), FV);
  // (v * log2e - 0.5 truncated toward zero is floor(v * log2e + 0.5) for v <= 0 ... up to the boundary; exact
  // rounding is not needed: |r| stays below ln 2)
  const FV r = v - n * 0.693359375f + n * 2.12194440e-4f;
  FV p = FV{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const IV e = (__builtin_convertvector(n, IV) + 127) << 23;
  FV scale;
  std::memcpy(&scale, &e, sizeof scale);
  const FV out = p * scale;
  return tiny ? FV{} : out;
}

__attribute__((always_inline)) inline F8 exp8_nonpos(F8 v) { return exp_nonpos<F8, I32x8>(v); }

typedef float F8 __attribute__((vector_size(8 * sizeof(float))));
typedef double D4 __attribute__((vector_size(4 * sizeof(double))));
typedef float F4h __attribute__((vector_size(4 * sizeof(float))));
// Eight doubles as two four-double vectors (one AVX2 register each): GCC lowers an eight-double vector type, and
// the conversion of eight floats to it, through the stack on AVX2 (a lane-for-lane equal sum, a third of the time)
struct D8 {
  D4 lo{}, hi{};
  D8() = default;
  __attribute__((always_inline)) D8(D4 l, D4 h) : lo(l), hi(h) {}
  __attribute__((always_inline)) double operator[](int l) const { return l < 4 ? lo[l] : hi[l - 4]; }
  __attribute__((always_inline)) D8& operator+=(const D8& o) {
    lo += o.lo;
    hi += o.hi;
    return *this;
  }
  __attribute__((always_inline)) friend D8 operator*(const D8& a, const D8& b) { return {a.lo * b.lo, a.hi * b.hi}; }
};
__attribute__((always_inline)) inline D8 widen(F8 v) {      // eight floats as eight doubles, lane for lane
  const F4h l = __builtin_shufflevector(v, v, 0, 1, 2, 3), h = __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return {__builtin_convertvector(l, D4), __builtin_convertvector(h, D4)};
}

// Up to eight floats from p (n of them; none for n <= 0) as a vector, the missing lanes -inf (their exp: 0). The
// last partial block of a row goes through the same vectorized exp as the others: a scalar exp there rounds some
// values differently, and tied logits on both sides of the block boundary would then get different probabilities
// (a top_p cut between them: the spec keeps a tie group together).
__attribute__((always_inline)) inline F8 tail8(const float* p, int64_t n) {
  F8 a = F8{} - INFINITY;
  if (n > 0) std::memcpy(&a, p, std::min<int64_t>(8, n) * sizeof(float));
  return a;
}

// Sixteen running sums in double, one per lane, added to once per block of floats (a sum across the lanes per
// block would be a chain of sixteen dependent scalar adds); summed across the lanes at the end.
struct DoubleLanes {
  D8 a{}, b{};
  __attribute__((always_inline)) void add(F8 v) { a += widen(v); }
  __attribute__((always_inline)) void add(F8 lo, F8 hi) {      // (lanes 0-7 and 8-15 of a sixteen-float group)
    a += widen(lo);
    b += widen(hi);
  }
  double sum() const {
    double s = 0.0;
    for (int l = 0; l < 8; ++l) s += a[l];
    for (int l = 0; l < 8; ++l) s += b[l];
    return s;
  }
};

typedef uint8_t U8x8 __attribute__((vector_size(8)));

// Eight lanes of v[i] / t - c (Div; else v[i] - c) where keep[i] (keep == nullptr: where v[i] is finite), -inf
// elsewhere
template <bool Div>
__attribute__((always_inline)) inline F8 kept_lanes8(const uint8_t* keep, F8 v, const uint8_t* k, float t, float c) {
  const F8 ninf = F8{} - INFINITY;
  const F8 d = Div ? v / t - c : v - c;
  if (keep == nullptr) return v > ninf ? d : ninf;
  U8x8 kb;
  std::memcpy(&kb, k, sizeof kb);
  return __builtin_convertvector(kb, I32x8) != 0 ? d : ninf;
}

// exp_kept's loop, compiled into each target clone of it (always inlined), eight lanes at a time: GCC lowers a
// sixteen-lane `?:` lane by lane, through the stack, where the registers hold eight (AVX2) -- a third of this
// loop's time went there
template <bool Div>
__attribute__((always_inline)) inline double exp_kept_loop(float* out, const uint8_t* keep, const float* v,
                                                           int64_t n, float t, float c) {
  DoubleLanes total;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    F8 acc{};
    for (int j = 0; j < 64; j += 8) {
      F8 a;
      std::memcpy(&a, v + i + j, sizeof a);
      a = exp8_nonpos(kept_lanes8<Div>(keep, a, keep + i + j, t, c));
      if (out != nullptr) std::memcpy(out + i + j, &a, sizeof a);
      acc += a;
    }
    total.add(acc);
  }
  for (; i < n; i += 8) {
    const int64_t m = std::min<int64_t>(8, n - i);
    uint8_t kt[8] = {};
    if (keep != nullptr) std::memcpy(kt, keep + i, m);
    const F8 a = exp8_nonpos(kept_lanes8<Div>(keep == nullptr ? nullptr : kt, tail8(v + i, m), kt, t, c));
    if (out != nullptr) std::memcpy(out + i, &a, m * sizeof(float));
    total.add(a);
  }
  return total.sum();
}

// out[i] = exp(v[i] / t - c) where kept (keep == nullptr: every finite v[i]), 0 elsewhere, and their sum (in
// double per lane); out == nullptr: the sum alone. One pass (t = 1: no division, x / 1 being x).
SAMPLEC_VOCAB_LOOP double exp_kept(float* out, const uint8_t* keep, const float* v, int64_t n, float t, float c) {
  return t == 1.0f ? exp_kept_loop<false>(out, keep, v, n, t, c) : exp_kept_loop<true>(out, keep, v, n, t, c);
}

// sum of exp(v[i] - c) over v[0..n), every v[i] <= c (or -inf): exp_kept's sum, in double per lane
inline double sum_exp(const float* v, int64_t n, float c) { return exp_kept(nullptr, nullptr, v, n, 1.0f, c); }

// v[i] = exp(v[i]) in place for v[i] <= 0 (or -inf: 0); their sum -- for v = x - c the very sum sum_exp(x, c)
// gives
inline double exp_inplace(float* v, int64_t n) { return exp_kept(v, nullptr, v, n, 1.0f, 0.0f); }

// sum_exp over a whole row in spans (split), their sums added in span order: every kernel's normalizer of a row
// is this sum (the same double whichever kernel computes it, whoever runs its spans)
double sum_exp_spans(const float* v, int64_t n, float c) {
  return sum_spans(n, [&](int64_t lo, int64_t hi) { return sum_exp(v + lo, hi - lo, c); });
}


// A primitive applying Op::row(v, n, out) to each row v of a 2-D float32 input, writing Op::width(n) floats per
// row of its one output (the per-row reductions and maps below share everything else).
template <class Op>
struct Rowwise {
  static constexpr const char* kName = Op::kName;
  bool operator==(const Rowwise&) const { return true; }
  void operator()(std::vector<mx::array>& in, std::vector<mx::array>& out) const {
    const int64_t rows = in[0].shape(0), n = in[0].shape(1);
    const Rows<float> x(in[0]);
    float* o = out[0].data<float>();
    split(rows, [&](int64_t r) {
      thread_local std::vector<float> buf;
      Op::row(x.row(r, n, buf), n, o + r * Op::width(n));
    });
  }
};

// [row max, log sum exp(x - max)] of each row, as one [B, 2] output (one output: MLX's compile fuses the
// subtractions that read it)
struct LogSumExpRow {
  static constexpr const char* kName = "SamplecRowLogSumExp";
  static int64_t width(int64_t) { return 2; }
  static void row(const float* v, int64_t n, float* o) {
    const float m = max_spans(v, n);
    o[0] = m;
    o[1] = std::isfinite(m) ? static_cast<float>(std::log(sum_exp_spans(v, n, m))) : (m != m ? m : 0.0f);
  }
};

std::vector<mx::array> row_logsumexp(const mx::array& x) {
  need_rows(x, mx::float32, "row_logsumexp");
  const int B = x.shape(0);
  return make(Rowwise<LogSumExpRow>{}, {{B, 2}}, {mx::float32}, {x});
}

// the maximum of each row (MLX's max: a NaN wins), vectorized: [B, 1]
struct MaxRow {
  static constexpr const char* kName = "SamplecRowMax";
  static int64_t width(int64_t) { return 1; }
  static void row(const float* v, int64_t n, float* o) { o[0] = max_spans(v, n); }
};

std::vector<mx::array> row_max(const mx::array& x) {
  need_rows(x, mx::float32, "row_max");
  return make(Rowwise<MaxRow>{}, {{x.shape(0), 1}}, {mx::float32}, {x});
}

// softmax_inplace's passes over a span: o <- exp(o - m) and its sum (in double); o <- o / z
SAMPLEC_VOCAB_LOOP double softmax_exps(float* o, int64_t n, float m) {
  double total = 0.0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    bool removed = true;
    for (int j = 0; j < 64; ++j) removed &= o[i + j] == -INFINITY;
    if (removed) {
      std::fill(o + i, o + i + 64, 0.0f);
      continue;
    }
    for (int j = 0; j < 64; ++j) o[i + j] -= m;
    total += exp_inplace(o + i, 64);
  }
  for (int64_t j = i; j < n; ++j) o[j] -= m;
  if (i < n) total += exp_inplace(o + i, n - i);    // (the same vectorized exp as the blocks)
  return total;
}

SAMPLEC_VOCAB_LOOP void softmax_scale(float* o, int64_t n, float z) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    bool zero = true;
    for (int j = 0; j < 64; ++j) zero &= o[i + j] == 0.0f;
    if (zero) continue;
    for (int j = 0; j < 64; ++j) o[i + j] /= z;
  }
  for (; i < n; ++i) o[i] /= z;
}

// o[0..n) <- softmax(o) given its maximum m (finite): exp(o - m) in one vectorized pass (the sum in double, span by
// span), then one scaling pass, each in spans (split: a waiting caller takes some). Blocks of 64 that are all -inf
// (a final distribution after cuts is mostly -inf) are zeros without an exp or a division.
void softmax_inplace(float* o, int64_t n, float m) {
  const float z =
      static_cast<float>(sum_spans(n, [&](int64_t lo, int64_t hi) { return softmax_exps(o + lo, hi - lo, m); }));
  each_span(n, [&](int64_t lo, int64_t hi) { softmax_scale(o + lo, hi - lo, z); });
}

// out[i] = exp(d[i]) for d[i] <= 0 by the vectorized exp of sum_exp (the same clone on a given machine, so the
// same floats sum_exp adds)
SAMPLEC_VOCAB_LOOP void exp_terms(const float* d, int64_t n, float* out) {
  auto group = [&](int64_t i, int64_t w) __attribute__((always_inline)) {     // (see kept_sums)
    const F8 r = exp8_nonpos(tail8(d + i, w));
    std::memcpy(out + i, &r, w * sizeof(float));
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) group(i, 8);
  if (i < n) group(i, n - i);
}

// The number of v[i] equal to x
SAMPLEC_VOCAB_LOOP int64_t count_equal(const float* v, int64_t n, float x) {
  int64_t total = 0;
  for (int64_t i0 = 0; i0 < n; i0 += 65536) {
    uint32_t part = 0;
    const int64_t end = std::min<int64_t>(n, i0 + 65536);
    for (int64_t i = i0; i < end; ++i) part += v[i] == x;
    total += part;
  }
  return total;
}

// The largest v[i] below x (-inf where there is none; NaN is never below), eight lanes at a time in two vectors
SAMPLEC_VOCAB_LOOP float max_below(const float* v, int64_t n, float x) {
  F8 m0 = {}, m1 = {}, lim = {}, none = {};
  m0 -= INFINITY;
  m1 -= INFINITY;
  none -= INFINITY;
  lim += x;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    F8 a, b;
    std::memcpy(&a, v + i, sizeof a);
    std::memcpy(&b, v + i + 8, sizeof b);
    a = a < lim ? a : none;
    b = b < lim ? b : none;
    m0 = a > m0 ? a : m0;
    m1 = b > m1 ? b : m1;
  }
  m0 = m1 > m0 ? m1 : m0;
  float m = -INFINITY;
  for (int l = 0; l < 8; ++l) m = m0[l] > m ? m0[l] : m;
  for (; i < n; ++i) m = v[i] < x && v[i] > m ? v[i] : m;
  return m;
}

// Log-probabilities at idx ([B, 1], clipped into the row) under a row and under the row with edits written in
// (put_along(x, ids, vals), a later write of an id winning), from one exp pass over the row: four [B, 1] outputs,
// (x'[idx] - max x') - log sum exp(x' - max x'), the same of x, then x's max and log sum exp (row_logsumexp's,
// bit for bit: a log_softmax of x reads them). The edited sum is the row's (relative to its max) less the edited
// tokens' terms -- each the very float the pass added -- plus their new ones; where that would not hold (a new
// value above the row's maximum, every token at the maximum edited, a sum that cancels to nearly nothing,
// non-finite maxima) the edited row is written out and summed directly. (Greedy after penalties with `logprob`
// and `raw_logprob`: one primitive, no [B, V] write, one exp pass.)
struct EditedLogSumExp {
  static constexpr const char* kName = "SamplecEditedLogSumExp";
  bool operator==(const EditedLogSumExp&) const { return true; }
  void operator()(std::vector<mx::array>& in, std::vector<mx::array>& out) const {
    const int64_t rows = in[0].shape(0), n = in[0].shape(1), h = in[1].shape(1);
    const Rows<float> x(in[0]), vals(in[2]);
    const Rows<int32_t> ids(in[1]), idx(in[3]);
    float *lp = out[0].data<float>(), *raw_lp = out[1].data<float>(), *om = out[2].data<float>(),
          *olz = out[3].data<float>();
    split(rows, [&](int64_t r) {
      thread_local std::vector<std::pair<int32_t, float>> put;
      thread_local std::vector<float> buf, scratch, d, e;
      last_writes(ids, vals, r, n, h, put);
      const float* row = x.row(r, n, buf);
      const float m = max_spans(row, n);
      const double z = std::isfinite(m) ? sum_exp_spans(row, n, m) : 0.0;
      const float lz = std::isfinite(m) ? static_cast<float>(std::log(z)) : (m != m ? m : 0.0f);
      om[r] = m;
      olz[r] = lz;
      int64_t at = idx(r, 0);
      at = at < 0 ? 0 : at >= n ? n - 1 : at;
      raw_lp[r] = (row[at] - m) - lz;
      float v_at = row[at];
      for (const auto& [id, v] : put) {
        if (id == at) v_at = v;
      }
      // the edited maximum: the new values', and the row's where some token at it keeps its value
      float mn = -INFINITY;
      bool top_kept = true, nan = false;
      for (const auto& [id, v] : put) {
        mn = greater_nan(v, mn) ? v : mn;
        nan |= v != v;
        top_kept &= row[id] != m;
      }
      bool direct = !std::isfinite(m) || nan || greater_nan(mn, m);
      float m2 = m;
      double z2 = z;
      if (!direct) {
        if (!top_kept && count_equal(row, n, m) == static_cast<int64_t>(
                             std::count_if(put.begin(), put.end(), [&](const auto& e) { return row[e.first] == m; }))) {
          direct = true;                   // (every token at the maximum was edited)
        } else {
          // (an untouched token holds m, and no new value exceeds it) each edited token's term as sum_exp added
          // it -- the same vectorized exp -- and the new one
          d.clear();
          for (const auto& [id, v] : put) d.push_back(v - m), d.push_back(row[id] - m);
          e.resize(d.size());
          exp_terms(d.data(), static_cast<int64_t>(d.size()), e.data());
          for (size_t k = 0; k < put.size(); ++k) z2 += double(e[2 * k]) - double(e[2 * k + 1]);
          direct = !(z2 > 1e-6 * z);
        }
      }
      if (direct) {
        scratch.assign(row, row + n);
        for (const auto& [id, v] : put) scratch[id] = v;
        m2 = max_spans(scratch.data(), n);
        z2 = std::isfinite(m2) ? sum_exp_spans(scratch.data(), n, m2) : 0.0;
      }
      const float lz2 = std::isfinite(m2) ? static_cast<float>(std::log(z2)) : (m2 != m2 ? m2 : 0.0f);
      lp[r] = (v_at - m2) - lz2;
    });
  }
};

std::vector<mx::array> edited_logsumexp(const mx::array& x, const mx::array& ids, const mx::array& vals,
                                        const mx::array& idx) {
  need_rows(x, mx::float32, "edited_logsumexp");
  need_rows(ids, mx::int32, "edited_logsumexp");
  need_rows(vals, mx::float32, "edited_logsumexp");
  need_rows(idx, mx::int32, "edited_logsumexp");
  const int B = x.shape(0);
  if (ids.shape(0) != B || vals.shape(0) != B || vals.shape(1) != ids.shape(1) || idx.shape(0) != B ||
      idx.shape(1) != 1 || x.shape(1) < 1) {
    throw std::invalid_argument("edited_logsumexp: x [B, V], ids and vals [B, H], idx [B, 1]");
  }
  return make(EditedLogSumExp{}, {{B, 1}, {B, 1}, {B, 1}, {B, 1}}, {mx::float32, mx::float32, mx::float32, mx::float32},
              {x, ids, vals, idx});
}


// softmax along each row. A row whose maximum is not finite (NaN, +inf, or nothing but -inf) is NaN, as
// exp(x - max) / sum is there.
struct SoftmaxRow {
  static constexpr const char* kName = "SamplecRowSoftmax";
  static int64_t width(int64_t n) { return n; }
  static void row(const float* v, int64_t n, float* o) {
    const float m = max_spans(v, n);
    if (!std::isfinite(m)) {
      std::fill(o, o + n, NAN);
      return;
    }
    std::copy(v, v + n, o);
    softmax_inplace(o, n, m);
  }
};

std::vector<mx::array> row_softmax(const mx::array& x) {
  need_rows(x, mx::float32, "row_softmax");
  return make(Rowwise<SoftmaxRow>{}, {x.shape()}, {mx::float32}, {x});
}

// ---- the sampler chain: its stages and the terminal draw, per row, in one primitive ----------------------------
//
// The chain's stages are cuts on the logit order (top_k, top_p, min_p, top_n_sigma: keep every token at or above
// a threshold), temperature (a monotone map; t = 0 keeps the argmax alone), typical_p and xtc. While only cuts
// and temperatures have run, the kept set is an upper set of the logit order, so the chain can run on the tokens
// above a bound: C = {i : x_i > bound}, sorted, where every other token is <= bound. The bound is the (m+1)-th
// largest block maximum (block c holds tokens c * 64 .. c * 64 + 63), so C comes from one vectorized pass and a
// selection over the block maxima. Each stage checks that its cut ends inside C (the tail, everything <= bound,
// is provably out); where it cannot tell -- and for a typical_p that is on or an xtc whose coin fires -- the row
// runs on the whole row instead (`chain_dense`), which finds every threshold by radix selection, without a sort.
// The draw is Gumbel-max over the kept tokens with RandomBits at (token id, position) (spec section 4). Every
// decision is made here, per row: a call never returns to the host to re-run a row.
enum ChainStage {
  kTemperature = 0, kTopK = 1, kTopP = 2, kMinP = 3, kTopNSigma = 4, kTypicalP = 5, kXtc = 6, kEpsilon = 7, kEta = 8,
  kDynTemp = 9, kTopKRank = 10
};
enum ChainTerminal { kGreedy = 0, kSample = 1 };

inline int stage_arity(int kind) { return kind == kXtc ? 4 : kind == kDynTemp ? 3 : 1; }

// -log(-log(u)) for the largest u the generator gives, ((2^23 - 1) + 0.5) * 2^-23, and a margin for rounding
constexpr float kGumbelMax = 16.6355323f + 1e-3f;
constexpr uint32_t kXtcCounter = 0xFFFFFFFFu;

inline float uniform_of(uint32_t bits) { return (static_cast<float>(bits >> 9) + 0.5f) * 0x1p-23f; }
inline float gumbel_of(uint32_t bits) { return -std::log(-std::log(uniform_of(bits))); }

// The least `bits >> 9` with which a token of value v may still beat the score `best`: v + g > best needs
// u > exp(-exp(-(best - v))), so a token below it is rejected on its RandomBits alone (2 ulps of margin for the
// rounding of u and of the logs).
inline uint32_t win_threshold(float best, float v) {
  const double u = std::exp(-std::exp(-(double(best) - double(v))));
  const double q = std::floor(u * 8388608.0 - 0.5) - 2.0;
  return q <= 0 ? 0u : q >= 8388607.0 ? 8388607u : static_cast<uint32_t>(q);
}

// win_threshold(best, fm) for a block's largest value fm taken up to the next sixteenth: the need of a value at
// least fm, so no lower than a token of the block needs (a sound rejection, a few percent more tokens let through),
// and cached per sixteenth while `best` stays -- a flat row's thousands of blocks (or gumbel_max16's groups) then
// take a few dozen of its exps, not two each
struct NeedCache {
  float best[64], fq[64];
  uint32_t need[64];
  float last_b = NAN, last_fm = NAN;   // (the last call's arguments: runs of equal maxima skip the rounding)
  uint32_t last_need = 0;
  NeedCache() { std::fill(best, best + 64, NAN); }
  uint32_t operator()(float b, float fm) {
    if (b == last_b && fm == last_fm) return last_need;
    last_b = b, last_fm = fm;
    const float q = std::ceil(fm * 16.0f) * 0.0625f;
    if (!(std::fabs(q) < 1e6f)) return last_need = win_threshold(b, fm);
    const int slot = static_cast<int>(static_cast<int64_t>(q * 16.0f) & 63);
    if (!(best[slot] == b && fq[slot] == q)) best[slot] = b, fq[slot] = q, need[slot] = win_threshold(b, q);
    return last_need = need[slot];
  }
};

// out[t] = the first word for counters (ids[t], c1), t < n (n a multiple of 16), vectorized.
SAMPLEC_VOCAB_LOOP void threefry_ids(uint32_t k0, uint32_t k1, const uint32_t* ids, int n, uint32_t c1,
                                     uint32_t* out) {
  for (int t0 = 0; t0 < n; t0 += 16) {
    U8v a, b;
    std::memcpy(&a, ids + t0, sizeof a);
    std::memcpy(&b, ids + t0 + 8, sizeof b);
    threefry8x2(k0, k1, a, b, c1);
    std::memcpy(out + t0, &a, sizeof a);
    std::memcpy(out + t0 + 8, &b, sizeof b);
  }
}

// Gumbel-max over tokens i < n (id(i), value(i)) in groups of sixteen: `best` and `at` (an index, -1 before the
// first) carry the winner. A group whose largest value plus the largest noise stays below `best` is skipped (with
// `sorted` values, descending, so is every later one); a token is rejected on its bits alone where they cannot
// lift it above `best`. The groups' RandomBits come in batches of 1, 2, 4, ... 16 groups (a confident row ends
// in its first group; a row of thousands of equal values takes them 256 at a time, vectorized). Equal scores go
// to the lower id, so the winner does not depend on the order.
template <class Id, class Value>
void gumbel_max16(int64_t begin, int64_t n, Id id, Value value, bool sorted, uint32_t k0, uint32_t k1, uint32_t pos,
                  float& best, int64_t& at) {
  uint32_t ids[256], bits[256];
  float gms[16];
  int64_t starts[16];
  int batch = 1;
  NeedCache need_of;                   // (groups of near or equal maxima share a need)
  auto threshold = [&](float gm) { return need_of(best, gm); };
  for (int64_t g = begin; g < n;) {
    int live = 0;
    bool stop = false;
    for (int q = 0; q < batch && g < n; ++q, g += 16) {
      const int lanes = static_cast<int>(std::min<int64_t>(16, n - g));
      float gm = -INFINITY;
      for (int l = 0; l < lanes; ++l) gm = value(g + l) > gm ? value(g + l) : gm;
      if (at >= 0 && gm + kGumbelMax < best) {
        if (sorted) {
          stop = true;
          break;
        }
        continue;
      }
      for (int l = 0; l < 16; ++l) ids[live * 16 + l] = static_cast<uint32_t>(id(g + (l < lanes ? l : 0)));
      gms[live] = gm;
      starts[live++] = g;
    }
    if (live > 0) threefry_ids(k0, k1, ids, live * 16, pos, bits);
    for (int q = 0; q < live; ++q) {
      const int64_t g0 = starts[q];
      const float gm = gms[q];
      if (at >= 0 && gm + kGumbelMax < best) continue;      // (the best rose within the batch)
      const int lanes = static_cast<int>(std::min<int64_t>(16, n - g0));
      uint32_t need = at >= 0 ? threshold(gm) : 0u;
      for (int l = 0; l < lanes; ++l) {
        if ((bits[q * 16 + l] >> 9) < need) continue;
        const float sc = value(g0 + l) + gumbel_of(bits[q * 16 + l]);
        if (at < 0 || sc > best || (sc == best && id(g0 + l) < id(at))) {
          best = sc;
          at = g0 + l;
          need = threshold(gm);
        }
      }
    }
    if (stop) return;
    batch = std::min(batch * 2, 16);
  }
}

struct StageArgs {
  double a = 0, b = 0, c = 0;     // the stage's value (xtc: threshold, probability; dynamic_temperature: t, range,
                                  // exponent)
  uint32_t k0 = 0, k1 = 0, pos = 0;   // xtc's coin
};

struct ChainRow {
  const float* x;
  int64_t V;
  const std::vector<int>* stages;
  std::vector<StageArgs> args;
  int terminal;
  bool want_logprob;
  float* x_out;                   // the final logits (want_x) or their softmax (want_probs), or nullptr
  bool probs_out = false;         // x_out receives softmax(final logits)
  uint32_t k0, k1, pos;           // the draw's key and position
  std::vector<float>* zbuf = nullptr;   // where full_z leaves exp(f(x) - vmax) (the row's probabilities up to z),
  bool z_in_buf = false;          // ... when it did: chain_dense's top_p reads them instead of making them again
  std::vector<float>* bm;         // block maxima
  int64_t nb = 0;                 // ... their count (blocks of 64)
  std::vector<std::pair<float, int32_t>>* cand;
  std::vector<std::pair<float, int32_t>>* at_bound;   // (scratch: candidates at the bound, see chain_candidates)
  std::vector<float> divs;        // temperatures applied so far (while the tail is alive)
  // the whole row's sum of exp(f(x) - vmax) for the divs and vmax it was computed with (a row's attempts on
  // more candidates see the same ones): computed once per row
  double covered = 1.0;           // the share of top_p's nucleus mass the last candidates held, when they fell short
  std::vector<float> z_divs;
  float z_vmax = NAN;
  double z = 0.0;
  // typical_p's mean(d) over the whole row as chain_run computed it from full_z's exps in zbuf, for md_divs and
  // md_vmax (NaN: none): chain_dense reads it where its probs() are those same exps (a row whose candidates fell
  // short)
  float md = NAN, md_vmax = NAN;
  std::vector<float> md_divs;

  float f(float v) const {        // the temperatures applied so far, in order, as the stages apply them
    for (float t : divs) v = divided(v, t);
    return v;
  }
};

// Tokens lo..end of x above `bound` appended to `above`, those at it to `at` (when `at` is given), and the largest
// value below it folded into `below`: sixteen compared at once, each comparison turned into a bit mask by an AND
// with the lanes' bits and an OR across lanes, the hits then taken by their bits (no branch per token: ties at
// the bound can be every eighth token).
SAMPLEC_VOCAB_LOOP void gather_block(const float* x, int64_t lo, int64_t end, float bound,
                                     std::vector<std::pair<float, int32_t>>& above,
                                     std::vector<std::pair<float, int32_t>>* at, float& below) {
  // (eight lanes at a time: GCC lowers sixteen-lane comparisons and `?:` lane by lane on AVX2)
  const I32x8 bit0 = {1, 2, 4, 8, 16, 32, 64, 128}, bit1 = bit0 << 8, eq0 = bit0 << 16, eq1 = bit0 << 24;
  const F8 b8 = F8{} + bound, ninf = F8{} - INFINITY;
  F8 under0 = ninf, under1 = ninf;
  int64_t t0 = lo;
  for (; t0 + 16 <= end; t0 += 16) {
    F8 v0, v1;
    std::memcpy(&v0, x + t0, sizeof v0);
    std::memcpy(&v1, x + t0 + 8, sizeof v1);
    const uint32_t hits = or_lanes8(((v0 > b8) & bit0) | ((v1 > b8) & bit1) | ((v0 == b8) & eq0) | ((v1 == b8) & eq1));
    const F8 lt0 = v0 < b8 ? v0 : ninf, lt1 = v1 < b8 ? v1 : ninf;
    under0 = lt0 > under0 ? lt0 : under0;
    under1 = lt1 > under1 ? lt1 : under1;
    uint32_t ma = hits & 0xFFFFu, me = at ? hits >> 16 : 0;
    // (the hits' room made once per sixteen: a tied top puts thousands at the bound)
    auto take = [&](std::vector<std::pair<float, int32_t>>& out, uint32_t m) {
      const size_t o = out.size();
      out.resize(o + __builtin_popcount(m));
      auto* p = out.data() + o;
      for (; m; m &= m - 1) {
        const int64_t tok = t0 + __builtin_ctz(m);
        *p++ = {x[tok], static_cast<int32_t>(tok)};
      }
    };
    if (ma) take(above, ma);
    if (me) take(*at, me);
  }
  for (; t0 < end; ++t0) {
    if (x[t0] > bound) above.emplace_back(x[t0], static_cast<int32_t>(t0));
    else if (x[t0] == bound && at) at->emplace_back(x[t0], static_cast<int32_t>(t0));
    else if (x[t0] < bound && x[t0] > below) below = x[t0];
  }
  for (int l = 0; l < 8; ++l) {
    below = under0[l] > below ? under0[l] : below;
    below = under1[l] > below ? under1[l] : below;
  }
}

// out[i] = v[i] / t, -inf staying -inf (t = inf would make it NaN)
SAMPLEC_VOCAB_LOOP void divide_by(float* out, const float* v, int64_t n, float t) {   // (in place too)
  if (t == 1.0f) {
    if (out != v) std::memcpy(out, v, n * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = divided(v[i], t);
}

double full_z(ChainRow& row, float vmax);

// The row's current values while the tail lives: x with the temperatures so far applied in order (divide_by's
// floats, as chain_dense's), or x itself; a scratch row per thread, valid until the next call on this thread
const float* current_values(const ChainRow& row) {
  if (row.divs.empty()) return row.x;
  thread_local std::vector<float> fx_tls;
  auto& fxb = fx_tls;                   // (bound here: a helper thread naming fx_tls would get its own)
  fxb.resize(row.V);
  const float* fx = row.x;
  for (float t : row.divs) {
    const float* from = fx;
    each_span(row.V, [&](int64_t lo, int64_t hi) { divide_by(fxb.data() + lo, from + lo, hi - lo, t); });
    fx = fxb.data();
  }
  return fx;
}

// top_n_sigma's moments over the kept values of v[0..n) (keep == nullptr: the finite ones), branch-free sixteen
// lanes at a time (a mask of kept tokens scattered over the row costs no mispredicted branches): kept_sums gives
// their count and sum (in double per lane), kept_dev the sum of (v - mean)^2 with v - mean and its square in
// float32 (as the dense definition takes them: past ~1.8e19 the square is inf, below ~1e-19 it is 0), summed in
// double.
// (eight lanes a half, so that comparisons and selects stay at eight lanes -- GCC lowers sixteen-lane ones lane by
// lane on AVX2 -- the halves feeding the same per-lane double sums as one sixteen-lane vector would)
struct KeptHalves {
  F8 a[2];
  I32x8 k[2];
  __attribute__((always_inline)) KeptHalves(const uint8_t* keep, const float* v, int64_t m) {   // m <= 16 values
    a[0] = tail8(v, m);
    a[1] = tail8(v + 8, m - 8);
    if (keep == nullptr) {
      for (int h = 0; h < 2; ++h) k[h] = a[h] > (F8{} - INFINITY);
      return;
    }
    uint8_t kt[16] = {};
    std::memcpy(kt, keep, m);
    for (int h = 0; h < 2; ++h) {
      U8x8 kb;
      std::memcpy(&kb, kt + 8 * h, sizeof kb);
      k[h] = __builtin_convertvector(kb, I32x8) != 0;
    }
  }
};

// (each pass: its groups of sixteen with m = 16 a constant -- the copies into lanes become loads -- then the last,
// shorter group: a group of a length known only at run time copies through memcpy calls)
SAMPLEC_VOCAB_LOOP void kept_sums(const uint8_t* keep, const float* v, int64_t n, double& count, double& sum) {
  DoubleLanes s, c;
  auto group = [&](int64_t i, int64_t m) __attribute__((always_inline)) {
    const KeptHalves g(keep == nullptr ? nullptr : keep + i, v + i, m);
    s.add(g.k[0] ? g.a[0] : F8{}, g.k[1] ? g.a[1] : F8{});
    c.add(g.k[0] ? F8{} + 1.0f : F8{}, g.k[1] ? F8{} + 1.0f : F8{});
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) group(i, 16);
  if (i < n) group(i, n - i);
  count = c.sum();
  sum = s.sum();
}

SAMPLEC_VOCAB_LOOP double kept_dev(const uint8_t* keep, const float* v, int64_t n, float mean) {
  D8 acc[2] = {};
  auto group = [&](int64_t i, int64_t m) __attribute__((always_inline)) {
    const KeptHalves g(keep == nullptr ? nullptr : keep + i, v + i, m);
    for (int h = 0; h < 2; ++h) {
      const F8 d = g.k[h] ? g.a[h] - mean : F8{};
      acc[h] += widen(d * d);               // (float32 squares, as the dense definition's: past ~1.8e19, inf)
    }
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) group(i, 16);
  if (i < n) group(i, n - i);
  double out = 0.0;
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 8; ++l) out += acc[h][l];
  return out;
}

// The standard deviation from the float32 squares' sum (in double) over count values: the float32 variance's
// float32 root, as the dense definition takes it; a sum past float32 -- where the dense definition's float32 sum
// overflows (a spread of logits beyond ~1.8e19) -- is inf, as there (and in llama.cpp's float loop): std inf, the
// floor -inf, every token kept
inline float sigma_of(double dev, double count) {
  return dev > std::numeric_limits<float>::max() ? INFINITY : std::sqrt(static_cast<float>(dev / count));
}

// The mean of count values summing to `sum` (in double) as the dense definition's float32: +-inf where its float32
// sum overflows
inline float mean_of(double sum, double count) {
  return std::fabs(sum) > std::numeric_limits<float>::max() ? static_cast<float>(sum)
                                                            : static_cast<float>(sum / count);
}

// top_n_sigma's floor max - n * std over the kept values of v (keep == nullptr: the finite ones) in spans, their
// sums combined in span order -- the same floats whichever path (the candidates' or the whole row's) asks. A floor
// that is not at most vmax (n * std NaN: n = inf, std = 0) is vmax: the top alone stays, as the stage says.
float sigma_floor(const uint8_t* keep, const float* v, int64_t n, float vmax, float nsig) {
  auto parts = per_span<std::pair<double, double>>(n, [&](int64_t lo, int64_t hi) {
    std::pair<double, double> cs;
    kept_sums(keep == nullptr ? nullptr : keep + lo, v + lo, hi - lo, cs.first, cs.second);
    return cs;
  });
  double count = 0.0, sum = 0.0;
  for (const auto& cs : parts) count += cs.first, sum += cs.second;
  const float mean = mean_of(sum, count);
  const double dev = sum_spans(n, [&](int64_t lo, int64_t hi) {
    return kept_dev(keep == nullptr ? nullptr : keep + lo, v + lo, hi - lo, mean);
  });
  const float floor = vmax - nsig * sigma_of(dev, count);
  return floor <= vmax ? floor : vmax;
}


// p when the row's first cut is a top_p after temperatures alone (every other stage before it off), those
// temperatures in `divs`; 1 otherwise.
double leading_top_p(const ChainRow& row, std::vector<float>& divs) {
  const auto& stages = *row.stages;
  divs.clear();
  for (size_t s = 0; s < stages.size(); ++s) {
    const StageArgs& sa = row.args[s];
    switch (stages[s]) {
      case kTemperature:
        if (sa.a == 1.0) break;
        if (sa.a == 0.0) return 1.0;
        divs.push_back(static_cast<float>(sa.a));
        break;
      case kTopP:
        if (static_cast<float>(sa.a) >= 1.0f) break;
        return static_cast<float>(sa.a);
      case kTopK:
        if (sa.a <= 0 || sa.a >= static_cast<double>(row.V)) break;
        return 1.0;
      case kMinP:
        if (static_cast<float>(sa.a) == 0.0f) break;
        return 1.0;
      case kTopNSigma:
        if (static_cast<float>(sa.a) <= 0.0f) break;
        return 1.0;
      case kTypicalP:
        if (sa.a >= 1.0) break;
        return 1.0;
      case kXtc:
        if (sa.b == 0.0) break;
        return 1.0;
      case kEpsilon:
      case kEta:
        if (static_cast<float>(sa.a) == 0.0f) break;
        return 1.0;
      case kDynTemp:                      // (its temperature comes from the kept set: no shortcut)
        return 1.0;
      case kTopKRank:
        if (sa.a <= 0 || sa.a >= static_cast<double>(row.V)) break;
        return 1.0;
    }
  }
  return 1.0;
}

// Whether the row's first cut is a top_p (leading_top_p) whose nucleus reaches below the tokens above a bound
// ("the candidates", the largest `top`), which hold `mass(f, f(top))` (their sum of exp(f(v) - f(top)), f the
// temperatures): less than p of the row's mass (full_z: the exp pass chain_run's top_p would make, and keeps
// for it). Then the candidates cannot decide the row, and need not be sorted (or gathered) to find that out;
// `row.covered` gets their share of the nucleus. Only a shortcut: whatever it answers, the token is the same.
template <class Mass>
bool nucleus_beyond(ChainRow& row, float top, Mass mass) {
  std::vector<float> divs;
  const double p = leading_top_p(row, divs);
  if (p >= 1.0) return false;
  auto f = [&divs](float v) {
    for (float t : divs) v = divided(v, t);
    return v;
  };
  const float fmax = f(top);
  if (!std::isfinite(fmax)) return false;
  row.divs = divs;
  const double need = p * full_z(row, fmax), mc = mass(f, fmax);
  if (!(mc < need)) return false;
  row.covered = mc / need;
  return true;
}

// Whether a leading top_p's nucleus needs more mass than `tokens` tokens can hold (each at most the top's
// probability: exp(f(v) - f(top)) <= 1) -- the mass of the candidates in m blocks of 64, before they are gathered:
// then nucleus_beyond would say so of any candidates there. (A flat row: the exp pass runs, as it would for
// nucleus_beyond, and the row goes to the whole-row path without a gather and thousands of scalar exps.)
bool nucleus_exceeds(ChainRow& row, int64_t tokens, float top) {
  std::vector<float> divs;
  const double p = leading_top_p(row, divs);
  if (p >= 1.0) return false;
  float fmax = top;
  for (float t : divs) fmax = fmax == -INFINITY ? fmax : fmax / t;
  if (!std::isfinite(fmax)) return false;
  row.divs = divs;
  return double(tokens) < p * full_z(row, fmax);
}

bool stage_off(const ChainRow& row, size_t s);

// Whether the tokens tied at a row's top (more blocks than the candidates' attempts gather) may hold the chain:
// false where chain_run would give up on them -- a top_k past the tokens at the top, or a min_p that keeps the
// largest value below the top (after the temperatures before it) followed by a cut that needs the whole row
// (top_p, top_n_sigma, typical_p) or by the chain's end (a draw the tail may win, a logprob or the final logits
// over the tail) -- so gathering the tied tokens would be for nothing. True where it cannot tell: the attempt
// decides. Either answer gives the same tokens; this only picks the path.
bool tie_may_hold(const ChainRow& row, float top) {
  const auto& stages = *row.stages;
  double t = 1.0;
  bool open = false;                    // a min_p keeps tokens below the top: the tail lives on (chain_run's floored)
  float below = NAN;                    // the largest value below the top, once a min_p needs it
  for (size_t s = 0; s < stages.size(); ++s) {
    const double a = row.args[s].a;
    const int kind = stages[s];
    if (kind == kTemperature) {
      if (a == 0.0) return true;
      t *= a;
    } else if (kind == kDynTemp) {
      return true;                        // (its temperature comes from the kept set)
    } else if (stage_off(row, s)) {
      continue;
    } else if (kind == kTopK || kind == kTopKRank) {
      return static_cast<double>(count_equal(row.x, row.V, top)) >= a;
    } else if (kind == kMinP) {           // (a later min_p may end the tail again)
      if (!(below == below)) {
        const auto part = per_span<float>(row.V, [&](int64_t lo, int64_t hi) {
          return max_below(row.x + lo, hi - lo, top);
        });
        below = max_of_spans(part);
      }
      if (!(below > -INFINITY && (double(below) - double(top)) / t > std::log(a) + 1e-6)) return true;
      open = true;
    } else {
      return !(open && (kind == kTopP || kind == kTopNSigma || kind == kTypicalP));
    }
  }
  return !open || (row.terminal == kGreedy && !row.want_logprob && row.x_out == nullptr);
}

// nucleus_beyond for the gathered candidates (row.cand, unsorted)
bool candidates_beyond(ChainRow& row) {
  const auto& c = *row.cand;
  std::vector<float> divs;
  if (c.empty() || leading_top_p(row, divs) >= 1.0) return false;     // (before a scan of thousands of candidates)
  float top = -INFINITY;
  for (const auto& e : c) top = e.first > top ? e.first : top;
  return nucleus_beyond(row, top, [&c](auto f, float fmax) {
    double mc = 0.0;
    for (size_t i = 0, j; i < c.size(); i = j) {    // (tokens at the bound come in a run of equal values)
      for (j = i + 1; j < c.size() && c[j].first == c[i].first;) ++j;
      mc += double(std::exp(f(c[i].first) - fmax)) * double(j - i);
    }
    return mc;
  });
}

// Candidates above the (m+1)-th largest block maximum (nth_element over a copy of the maxima; at most m blocks
// hold a token above it), sorted by value descending, then id ascending; returns the bound, every other token
// being at most it. `inclusive`: the tokens at the bound too (after the others, in id order: their order
// already) -- for a top tied across more than m blocks, where no token lies above the bound -- and returns the
// largest value below it (-inf if none), every other token being at most that.
// `beyond` (when given): set when candidates_beyond says the candidates cannot decide the row (left unsorted then).
float chain_candidates(ChainRow& row, int64_t nb, int bs, int64_t m, std::vector<float>& scratch,
                       bool inclusive = false, bool* beyond = nullptr) {
  auto& cand = *row.cand;
  cand.clear();
  const std::vector<float>& bm = *row.bm;
  scratch.assign(bm.begin(), bm.begin() + nb);
  std::nth_element(scratch.begin(), scratch.begin() + m, scratch.end(), std::greater<float>());
  const float bound = scratch[m];
  auto& at_bound = *row.at_bound;
  at_bound.clear();
  float below = -INFINITY;                            // (inclusive: the largest value below the bound)
  auto gather = [&](int64_t c0, int64_t c1, std::vector<std::pair<float, int32_t>>& above,
                    std::vector<std::pair<float, int32_t>>* at, float& under) {
    for (int64_t c = c0; c < c1; ++c) {
      if (!(bm[c] > bound || (inclusive && bm[c] == bound))) {
        under = bm[c] > under ? bm[c] : under;
        continue;
      }
      const int64_t lo = c * bs, end = std::min<int64_t>(row.V, lo + bs);
      gather_block(row.x, lo, end, bound, above, at, under);
    }
  };
  if (!inclusive || bs * nb < 2 * kSpan) {
    gather(0, nb, cand, inclusive ? &at_bound : nullptr, below);
  } else {
    // a top tied across more than m blocks: every block may hold tokens at the bound, in parts (split), joined in
    // block order
    const int64_t per = kSpan / bs, parts = (nb + per - 1) / per;
    std::vector<std::vector<std::pair<float, int32_t>>> above_p(parts), at_p(parts);
    std::vector<float> below_p(parts, -INFINITY);
    split(parts, [&](int64_t q) { gather(q * per, std::min(nb, (q + 1) * per), above_p[q], &at_p[q], below_p[q]); });
    for (int64_t q = 0; q < parts; ++q) {
      cand.insert(cand.end(), above_p[q].begin(), above_p[q].end());
      at_bound.insert(at_bound.end(), at_p[q].begin(), at_p[q].end());
      below = below_p[q] > below ? below_p[q] : below;
    }
  }
  const size_t above = cand.size();
  cand.insert(cand.end(), at_bound.begin(), at_bound.end());
  const float tail = inclusive ? below : bound;
  if (beyond != nullptr && (*beyond = candidates_beyond(row))) return tail;
  std::sort(cand.begin(), cand.begin() + above, [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  return tail;
}

// how many of the n block maxima equal v
inline int64_t blocks_at(const float* bm, int64_t n, float v) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += bm[i] == v;
  return c;
}

// sum over the whole row of exp(f(x) - vmax), in double; once per row for given temperatures and vmax
double full_z(ChainRow& row, float vmax) {
  if (row.z_vmax == vmax && row.z_divs == row.divs) return row.z;
  double z;
  row.z_in_buf = false;
  if (row.zbuf != nullptr && row.divs.size() <= 1) {
    // the exps themselves into zbuf, as chain_dense's probs() makes them (the same floats and sum): a row that
    // goes on to the whole row reuses them for a leading top_p
    auto& buf = *row.zbuf;
    buf.resize(row.V);
    const float* x = row.x;
    const float t = row.divs.empty() ? 1.0f : row.divs[0];
    z = sum_spans(row.V, [&](int64_t lo, int64_t hi) { return exp_kept(buf.data() + lo, nullptr, x + lo, hi - lo, t, vmax); });
    row.z_in_buf = true;
  } else if (row.divs.empty()) {
    z = sum_exp_spans(row.x, row.V, vmax);
  } else if (row.divs.size() == 1) {
    const float t = row.divs[0];
    z = sum_spans(row.V, [&](int64_t lo, int64_t hi) { return exp_kept(nullptr, nullptr, row.x + lo, hi - lo, t, vmax); });
  } else {
    thread_local std::vector<float> fx;
    fx.resize(row.V);
    for (int64_t i = 0; i < row.V; ++i) fx[i] = row.f(row.x[i]);
    z = sum_exp_spans(fx.data(), row.V, vmax);
  }
  row.z_divs = row.divs;
  row.z_vmax = vmax;
  row.z = z;
  return z;
}

// sum of exp(c[i].first - vmax) over i < L, in double, for candidates sorted by value: a run of equal values (ties:
// thousands of tokens may share a value) takes one exp
inline double run_sum_exp(const std::vector<std::pair<float, int32_t>>& c, int64_t L, float vmax) {
  double zd = 0.0;
  for (int64_t i = 0, j; i < L; i = j) {
    for (j = i + 1; j < L && c[j].first == c[i].first;) ++j;
    zd += std::exp(static_cast<double>(c[i].first - vmax)) * double(j - i);
  }
  return zd;
}

// typical_p's passes over the row (e: the kept tokens' exp(x - max), 0 where removed; d = x - max):
// sum of (e / z) * d over the live tokens (e > 0): sum of e * d in double per lane, divided by z once
SAMPLEC_VOCAB_LOOP double typical_mean(const float* e, const float* v, int64_t n, float z, float vmax) {
  D8 lo{}, hi{};
  auto group = [&](int64_t i, int64_t m) __attribute__((always_inline)) {     // (see kept_sums)
    float ab[16] = {}, xb[16] = {};
    std::memcpy(ab, e + i, m * sizeof(float));
    std::memcpy(xb, v + i, m * sizeof(float));
    for (int h = 0; h < 2; ++h) {            // (eight lanes at a time: see KeptHalves)
      F8 a, x;
      std::memcpy(&a, ab + 8 * h, sizeof a);
      std::memcpy(&x, xb + 8 * h, sizeof x);
      const F8 d = a > F8{} ? x - vmax : F8{};
      (h == 0 ? lo : hi) += widen(a) * widen(d);
    }
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) group(i, 16);
  if (i < n) group(i, n - i);
  double out = 0.0;
  for (int l = 0; l < 8; ++l) out += lo[l];
  for (int l = 0; l < 8; ++l) out += hi[l];
  return out / double(z);
}

// score[i] = |md - (v[i] - vmax)| for the live tokens, +inf for the others; the live scores' least and largest
// (+inf and -inf where none is live)
SAMPLEC_VOCAB_LOOP std::pair<float, float> typical_scores(float* __restrict score, const float* __restrict e,
                                                          const float* __restrict v, int64_t n, float md, float vmax) {
  F8 mn = F8{} + INFINITY, mx = F8{} - INFINITY;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {           // (eight lanes: see KeptHalves)
    F8 a, x;
    std::memcpy(&a, e + i, sizeof a);
    std::memcpy(&x, v + i, sizeof x);
    const F8 d = md - (x - vmax);
    const F8 ad = (d < F8{} ? -d : d) + 0.0f;   // (+0.0f: -0 becomes +0, the keys stay non-negative floats)
    const F8 sc = a > F8{} ? ad : F8{} + INFINITY;
    std::memcpy(score + i, &sc, sizeof sc);
    mn = sc < mn ? sc : mn;
    const F8 live = a > F8{} ? ad : F8{} - INFINITY;
    mx = live > mx ? live : mx;
  }
  float lo = INFINITY, hi = -INFINITY;
  for (int l = 0; l < 8; ++l) lo = mn[l] < lo ? mn[l] : lo, hi = mx[l] > hi ? mx[l] : hi;
  for (; i < n; ++i) {
    score[i] = e[i] > 0.0f ? std::fabs(md - (v[i] - vmax)) : INFINITY;
    if (e[i] > 0.0f) lo = std::min(lo, score[i]), hi = std::max(hi, score[i]);
  }
  return {lo, hi};
}

// keep[i] &= score[i] <= cut or v[i] is the top
SAMPLEC_VOCAB_LOOP void keep_typical(uint8_t* __restrict keep, const float* __restrict score,
                                     const float* __restrict v, int64_t n, float cut, float vmax) {
  for (int64_t i = 0; i < n; ++i) keep[i] &= static_cast<uint8_t>((score[i] <= cut) | (v[i] == vmax));
}

// eta's probability floor min(e, sqrt(e) * exp(-H)) from the kept set's normalizer z and sum p d (d = x - max):
// H = log z - sum p d, in double, then float32 as the dense definition computes the floor
inline float eta_cut(float e, double z, double pd) {
  const float h = static_cast<float>(std::log(z) - pd);
  return std::min(e, std::sqrt(e) * std::exp(-h));
}

// dynamic_temperature's T (llama.cpp temp_ext) from the kept set's count n (> 1), normalizer z and sum p d (d = x -
// max): H = log z - sum p d in double, then float32 as the dense definition computes T = max(0, t - range) +
// (t + range - max(0, t - range)) * (H / ln n)^exponent (0^0 = 1); a T that is not > 0 (NaN too) is 0
inline float dyn_temperature(const StageArgs& sa, double n, double z, double pd) {
  const float t = static_cast<float>(sa.a), r = static_cast<float>(sa.b), ex = static_cast<float>(sa.c);
  const float h = static_cast<float>(std::log(z) - pd);
  const float norm = h / std::log(static_cast<float>(n));
  const float powed = ex == 0.0f ? 1.0f : std::exp(ex * std::log(norm));
  const float lo = std::max(0.0f, t - r);
  const float dyn = lo + ((t + r) - lo) * powed;
  return dyn > 0.0f ? dyn : 0.0f;
}

// the number of finite values of v[0..n) (keep: of those kept), as the dense definition's count of kept tokens
SAMPLEC_VOCAB_LOOP int64_t count_finite(const uint8_t* keep, const float* v, int64_t n) {
  int64_t total = 0;
  for (int64_t i0 = 0; i0 < n; i0 += 65536) {     // (uint32 lanes: vectorizes)
    uint32_t part = 0;
    const int64_t end = std::min<int64_t>(n, i0 + 65536);
    if (keep == nullptr) {
      for (int64_t i = i0; i < end; ++i) part += v[i] > -INFINITY;
    } else {
      for (int64_t i = i0; i < end; ++i) part += keep[i] & (v[i] > -INFINITY);
    }
    total += part;
  }
  return total;
}

// keep[i] &= e[i] / z >= cut or v[i] is the top (epsilon's and eta's cut: p as the kept tokens' exp over their sum)
SAMPLEC_VOCAB_LOOP void keep_prob_at_least(uint8_t* __restrict keep, const float* __restrict e,
                                           const float* __restrict v, int64_t n, float z, float cut, float vmax) {
  for (int64_t i = 0; i < n; ++i) keep[i] &= static_cast<uint8_t>((e[i] / z >= cut) | (v[i] == vmax));
}

// The candidates' values c[0..L) into v and their exps exp(v - vmax) into e (chain_dense's vectorized exp: the same
// floats), per thread; their sum
double candidate_exps(const std::vector<std::pair<float, int32_t>>& c, int64_t L, float vmax, std::vector<float>& v,
                      std::vector<float>& e) {
  v.resize(L);
  e.resize(L);
  for (int64_t i = 0; i < L; ++i) v[i] = c[i].first;
  return exp_kept(e.data(), nullptr, v.data(), L, 1.0f, vmax);
}

// The whole row's entropy parts while the tail lives (every finite token kept): the normalizer z and sum p d
// (d = x - max) of its current values (the temperatures so far), as chain_dense's exps and sums make them
std::pair<double, double> row_entropy_parts(const ChainRow& row, float vmax) {
  thread_local std::vector<float> fe_tls;
  auto& feb = fe_tls;                   // (bound here: a helper thread naming fe_tls would get its own)
  const float* fx = current_values(row);
  feb.resize(row.V);
  const double z = sum_spans(row.V, [&](int64_t lo, int64_t hi) {
    return exp_kept(feb.data() + lo, nullptr, fx + lo, hi - lo, 1.0f, vmax);
  });
  const double pd = sum_spans(row.V, [&](int64_t lo, int64_t hi) {
    return typical_mean(feb.data() + lo, fx + lo, hi - lo, static_cast<float>(z), vmax);
  });
  return {z, pd};
}

// Run the chain on the sorted candidates above `bound`; false when a cut (or the draw) may reach below the bound,
// or a stage needs the whole row.
bool chain_run(ChainRow& row, float bound, int32_t* token, float* logprob) {
  auto& c = *row.cand;
  int64_t L = static_cast<int64_t>(c.size());
  bool tail = true;                       // the tokens <= bound are still in the kept set
  bool floored = false;                   // ... those of them at or above a min_p floor (see kMinP)
  float fb = bound;
  auto reaches = [&](float v) { return tail && fb >= v; };   // may a tail token be >= v
  row.divs.clear();
  if (L == 0) return false;
  const auto& stages = *row.stages;
  for (size_t s = 0; s < stages.size(); ++s) {
    const StageArgs& sa = row.args[s];
    const double a = sa.a;
    switch (stages[s]) {
      case kTemperature:
      case kDynTemp: {
        float t = static_cast<float>(a);
        if (stages[s] == kDynTemp && static_cast<float>(sa.b) != 0.0f) {
          // llama.cpp temp_ext: temperature(T), T from the kept set's entropy -- the candidates', or the whole
          // row's while the tail lives (its finite tokens: no cut has ended yet); n <= 1 kept: nothing changes
          if (tail && floored) return false;
          const float vmax = c[0].first;
          double n = 0.0, z = 0.0, pd = 0.0;
          if (!tail) {
            thread_local std::vector<float> dv_tls, de_tls;
            auto &dv = dv_tls, &de = de_tls;
            for (int64_t i = 0; i < L; ++i) n += c[i].first > -INFINITY;
            if (n <= 1.0) break;
            z = candidate_exps(c, L, vmax, dv, de);
            pd = typical_mean(de.data(), dv.data(), L, static_cast<float>(z), vmax);
          } else {
            const float* fx = current_values(row);
            n = sum_spans(row.V, [&](int64_t lo, int64_t hi) {
              return static_cast<double>(count_finite(nullptr, fx + lo, hi - lo));
            });
            if (n <= 1.0) break;
            std::tie(z, pd) = row_entropy_parts(row, vmax);
          }
          t = dyn_temperature(sa, n, z, pd);
        }
        if (t == 1.0f) break;
        // t = 0, or the top divided by t leaves the float32 range: the argmax alone (lowest id among equals)
        if (t == 0.0f || !std::isfinite(c[0].first / t)) {
          if (reaches(c[0].first)) return false;
          int64_t best = 0;
          for (int64_t i = 1; i < L && c[i].first == c[0].first; ++i) {
            if (c[i].second < c[best].second) best = i;
          }
          std::swap(c[0], c[best]);
          L = 1;
          tail = false;
          break;
        }
        for (int64_t i = 0; i < L; ++i) c[i].first = c[i].first / t;   // (candidates are finite)
        if (tail) {
          fb = fb / t;
          row.divs.push_back(t);
        }
        break;
      }
      case kTopK:
      case kTopKRank: {
        if (a <= 0 || a >= static_cast<double>(row.V)) break;
        const int64_t k = static_cast<int64_t>(a);
        if (k > L) {
          if (tail) return false;         // the k-th largest lies below the bound
          break;                          // fewer than k tokens left: all stay
        }
        const float vk = c[k - 1].first;
        if (reaches(vk)) return false;
        int64_t i1 = k;                   // (past the values equal to the k-th)
        while (i1 < L && c[i1].first >= vk) ++i1;
        if (stages[s] == kTopKRank) {
          // the k largest by rank: the first k, where the values equal to the k-th (a run: temperatures keep the
          // order, and may round neighbours together) give their places to their lowest ids
          int64_t i0 = k - 1;
          while (i0 > 0 && c[i0 - 1].first == vk) --i0;
          if (i1 - i0 > 1) {
            std::sort(c.begin() + i0, c.begin() + i1, [](const auto& u, const auto& v) { return u.second < v.second; });
          }
          i1 = k;
        }
        L = i1;
        tail = false;
        break;
      }
      case kMinP: {
        const float m = static_cast<float>(a);
        if (m == 0.0f) break;
        const float floor = c[0].first + std::log(m);
        if (reaches(floor)) {
          // every candidate stays, and so do the tail's tokens at or above the floor: the tail lives on, no
          // longer every token below the bound (`floored`) -- a later cut by count or a draw can still end
          // above the bound, what needs the tail's mass falls back to the whole row
          floored = true;
          break;
        }
        int64_t n = 1;
        while (n < L && c[n].first >= floor) ++n;
        L = n;
        tail = false;
        break;
      }
      case kTopP: {
        const float p = static_cast<float>(a);
        if (p >= 1.0f) break;
        if (tail && floored) return false;
        const float vmax = c[0].first;
        double zd = 0.0;
        if (tail) {
          zd = full_z(row, vmax);
        } else {
          zd = run_sum_exp(c, L, vmax);
        }
        // groups of equal probability -- the float32 exp(v - max) / Z, as the contract's p (a division that can
        // round neighbouring exps together on a near-flat row) -- in descending order: kept while the mass
        // strictly above is below p (a run of equal values, one exp)
        const double need = static_cast<double>(p) * zd;
        const float zf = static_cast<float>(zd);
        double before = 0.0;
        float prev = NAN;
        int64_t n = L;
        bool stopped = false;
        for (int64_t i = 0, j; i < L; i = j) {
          for (j = i + 1; j < L && c[j].first == c[i].first;) ++j;
          const float e = std::exp(c[i].first - vmax);
          if (e / zf != prev && !(before < need)) {
            n = i;
            stopped = true;
            break;
          }
          prev = e / zf;
          before += double(e) * double(j - i);
        }
        if (!stopped) {
          // the candidates reach the mass and the tail's largest probability lies below their last group's: every
          // tail token would start a group of its own past the nucleus -- the cut ends at the bound (a tied top
          // gathered whole, a top group that holds the nucleus alone)
          if (tail && !(before < need) && std::exp(fb - vmax) / zf < prev) {
            tail = false;
            break;
          }
          if (tail) {
            row.covered = before / need;  // (how much of the nucleus the candidates held: see the retry)
            return false;
          }
          break;
        }
        L = n;
        tail = false;
        break;
      }
      case kTopNSigma: {
        const float nsig = static_cast<float>(a);
        if (nsig <= 0.0f) break;
        if (tail) {
          // the moments of the whole row: every finite token is still kept (no cut has ended yet; a min_p floor
          // inside the tail would leave a part of it -- the whole-row path). The cut ends among the candidates
          // where its floor lies above the bound.
          if (floored) return false;
          const float floor = sigma_floor(nullptr, current_values(row), row.V, c[0].first, nsig);
          if (reaches(floor)) return false;
          int64_t n = 1;
          while (n < L && c[n].first >= floor) ++n;
          L = n;
          tail = false;
          break;
        }
        double sum = 0.0, dev = 0.0;
        for (int64_t i = 0; i < L; ++i) sum += c[i].first;
        const float mean = mean_of(sum, static_cast<double>(L));
        for (int64_t i = 0; i < L; ++i) {
          const float d = c[i].first - mean;
          dev += double(d * d);
        }
        const float top = c[0].first;
        const float floor = top - nsig * sigma_of(dev, static_cast<double>(L));
        int64_t n = 1;
        while (n < L && (c[n].first >= floor || c[n].first == top)) ++n;
        L = n;
        break;
      }
      case kTypicalP: {
        if (a >= 1.0) break;
        if (tail && floored) return false;
        // chain_dense's arithmetic (its exps, the same floats): z and mean(d) over the kept set -- the candidates,
        // or the whole row while the tail lives -- then the score cutoff by mass in ascending score, a group of
        // equal scores at a time, on the candidates. A tail token's score is at least md - (fb - max) where that is
        // positive: the cut ends among the candidates when they reach the mass below it (else the whole row).
        // typical_p is not a cut on the logit order: the kept candidates stay in their order, no longer an upper
        // set (no tail is left to need one)
        thread_local std::vector<float> tv_tls, te_tls, ts_tls, fe_tls;
        thread_local std::vector<int32_t> to_tls;
        auto &tv = tv_tls, &te = te_tls, &ts = ts_tls, &feb = fe_tls;
        auto& order = to_tls;
        ts.resize(L);
        const float vmax = c[0].first;
        double z = candidate_exps(c, L, vmax, tv, te);
        float md, limit = INFINITY;       // (limit: the least score a tail token can have)
        if (!tail) {
          double mean_d = 0.0;
          for (int64_t i = 0; i < L; ++i) {
            if (te[i] > 0.0f) mean_d += double(te[i] / static_cast<float>(z)) * double(tv[i] - vmax);
          }
          md = static_cast<float>(mean_d);
        } else {
          // (full_z: its exps stay for the whole-row path where this one ends there; candidates holding less
          // than the mass cannot decide the row)
          const double candidates = z;
          z = full_z(row, vmax);
          if (candidates < a * z) return false;
          const float* fx = current_values(row);
          const float* ex = row.z_in_buf ? row.zbuf->data() : nullptr;
          if (ex == nullptr) {
            feb.resize(row.V);
            each_span(row.V, [&](int64_t lo, int64_t hi) {
              exp_kept(feb.data() + lo, nullptr, fx + lo, hi - lo, 1.0f, vmax);
            });
            ex = feb.data();
          }
          md = static_cast<float>(sum_spans(row.V, [&](int64_t lo, int64_t hi) {
            return typical_mean(ex + lo, fx + lo, hi - lo, static_cast<float>(z), vmax);
          }));
          row.md = md;
          row.md_divs = row.divs;
          row.md_vmax = row.z_in_buf ? vmax : NAN;
          if (!(fb - vmax < md)) return false;
          limit = md - (fb - vmax);
        }
        // (the walk stops at the limit: only scores below it are sorted -- a tied top above it, none)
        order.clear();
        for (int64_t i = 0; i < L; ++i) {
          ts[i] = std::fabs(md - (tv[i] - vmax));
          if (te[i] > 0.0f && ts[i] < limit) order.push_back(static_cast<int32_t>(i));
        }
        if (tail && order.empty()) return false;
        std::sort(order.begin(), order.end(), [&ts](int32_t u, int32_t v) { return ts[u] < ts[v]; });
        const double need = a * z;
        float cut = order.empty() ? -INFINITY : ts[order.back()];   // (never reached: the largest score)
        double mass = 0.0;
        bool reached = false;
        for (size_t i = 0, j; i < order.size() && ts[order[i]] < limit; i = j) {
          for (j = i; j < order.size() && ts[order[j]] == ts[order[i]]; ++j) mass += te[order[j]];
          if (mass >= need) {
            cut = ts[order[i]];
            reached = true;
            break;
          }
        }
        if (tail && !reached) return false;
        int64_t n = 0;
        for (int64_t i = 0; i < L; ++i) {
          if ((te[i] > 0.0f && ts[i] <= cut) || tv[i] == vmax) c[n++] = c[i];
        }
        L = n;
        tail = false;
        break;
      }
      case kEpsilon:
      case kEta: {
        const float e = static_cast<float>(a);
        if (e == 0.0f) break;
        if (tail && floored) return false;
        // p = exp(v - max) / z over the kept set, each exp chain_dense's (the same vectorized exp, the same floats);
        // the kept candidates are a prefix (p falls with v), and the tail is out where its largest p is below the
        // floor
        const float vmax = c[0].first;
        thread_local std::vector<float> ev_tls, ee_tls;
        auto &ev = ev_tls, &ee = ee_tls;
        double z = candidate_exps(c, L, vmax, ev, ee), pd = 0.0;
        if (!tail) {
          if (stages[s] == kEta) pd = typical_mean(ee.data(), ev.data(), L, static_cast<float>(z), vmax);
        } else if (stages[s] == kEpsilon) {
          z = full_z(row, vmax);
        } else {
          std::tie(z, pd) = row_entropy_parts(row, vmax);     // (the whole row's entropy)
        }
        const float zf = static_cast<float>(z);
        const float cut = stages[s] == kEta ? eta_cut(e, z, pd) : e;
        if (tail) {
          float top_tail;
          exp_kept(&top_tail, nullptr, &fb, 1, 1.0f, vmax);
          // (a tail token at the maximum stays whatever its p: a temperature of inf makes every value 0)
          if (fb > -INFINITY && (fb == vmax || !(top_tail / zf < cut))) return false;
        }
        int64_t n = 1;
        while (n < L && ee[n] / zf >= cut) ++n;
        while (n < L && c[n].first == vmax) ++n;
        L = n;
        tail = false;
        break;
      }
      case kXtc: {
        if (sa.b == 0.0) break;
        if (!(uniform_of(threefry_first_word(sa.k0, sa.k1, kXtcCounter, sa.pos)) < static_cast<float>(sa.b))) break;
        if (tail) return false;           // the coin fires while the tail lives: the whole row
        // the coin fires after a cut that ended among the candidates (llama.cpp's order: top_k first): p over them
        // with chain_dense's exps and normalizer; with two or more finite tokens at p >= threshold, all of those go
        // but the least probable (the lowest id among equal p), and the others stay in their (value) order
        thread_local std::vector<float> xv_tls, xe_tls;
        auto &xv = xv_tls, &xe = xe_tls;
        const float zf = static_cast<float>(candidate_exps(c, L, c[0].first, xv, xe));
        const float thr = static_cast<float>(a);
        auto top = [&](int64_t i) { return xv[i] > -INFINITY && xe[i] / zf >= thr; };
        int64_t n_top = 0, surv = -1;
        for (int64_t i = 0; i < L; ++i) {
          if (!top(i)) continue;
          ++n_top;
          const float p = xe[i] / zf;
          if (surv < 0 || p < xe[surv] / zf || (p == xe[surv] / zf && c[i].second < c[surv].second)) surv = i;
        }
        if (n_top < 2) break;
        int64_t n = 0;
        for (int64_t i = 0; i < L; ++i) {
          if (i == surv || !top(i)) c[n++] = c[i];
        }
        L = n;
        break;
      }
    }
  }
  // the terminal
  const float vmax = c[0].first;
  int64_t at = 0;
  if (row.terminal == kGreedy) {
    if (reaches(vmax)) return false;
    for (int64_t i = 1; i < L && c[i].first == vmax; ++i) {
      if (c[i].second < c[at].second) at = i;
    }
  } else {
    float best = -INFINITY;
    at = -1;
    auto id = [&c](int64_t i) { return c[i].second; };
    auto value = [&c](int64_t i) { return c[i].first; };
    // the first kPart first (a confident row ends there); thousands more that its best cannot rule out (a tied
    // top) in parts (split), each from that best, the best of them winning (the lower id on equal scores)
    constexpr int64_t kPart = 4096;
    gumbel_max16(0, std::min(L, kPart), id, value, true, row.k0, row.k1, row.pos, best, at);
    if (L > kPart && !(value(kPart) + kGumbelMax < best)) {
      const int64_t parts = (L - kPart + kPart - 1) / kPart;
      std::vector<std::pair<float, int64_t>> wins(parts, {best, at});
      split(parts, [&](int64_t q) {
        gumbel_max16(kPart * (q + 1), std::min(L, kPart * (q + 2)), id, value, true, row.k0, row.k1, row.pos,
                     wins[q].first, wins[q].second);
      });
      for (const auto& [b, a] : wins) {
        if (b > best || (b == best && id(a) < id(at))) best = b, at = a;
      }
    }
    if (tail && fb + kGumbelMax >= best) return false;
  }
  if (tail && floored && (row.want_logprob || row.x_out != nullptr)) return false;
  *token = c[at].second;
  if (row.want_logprob) {
    double zd = 0.0;
    if (tail) {
      zd = full_z(row, vmax);
    } else {
      zd = run_sum_exp(c, L, vmax);
    }
    *logprob = (c[at].first - vmax) - static_cast<float>(std::log(zd));
  }
  if (row.x_out != nullptr) {
    float* o = row.x_out;
    if (tail) {
      if (row.divs.empty()) {
        std::copy(row.x, row.x + row.V, o);
      } else {
        each_span(row.V, [&](int64_t lo, int64_t hi) {     // (row.f: the temperatures in order)
          divide_by(o + lo, row.x + lo, hi - lo, row.divs[0]);
          for (size_t d = 1; d < row.divs.size(); ++d) divide_by(o + lo, o + lo, hi - lo, row.divs[d]);
        });
      }
      if (row.probs_out) softmax_inplace(o, row.V, vmax);
    } else if (row.probs_out) {
      std::fill(o, o + row.V, 0.0f);
      const float z = static_cast<float>(run_sum_exp(c, L, vmax));
      for (int64_t i = 0, j; i < L; i = j) {      // (a run of equal values: one exp)
        const float q = std::exp(c[i].first - vmax) / z;
        for (j = i; j < L && c[j].first == c[i].first; ++j) o[c[j].second] = q;
      }
    } else {
      std::fill(o, o + row.V, -INFINITY);
      for (int64_t i = 0; i < L; ++i) o[c[i].second] = c[i].first;
    }
  }
  return true;
}

// ---- the chain on the whole row, without sorting it: thresholds by radix selection -----------------------------
//
// The kept set is a mask over the row, and every stage a pass or a few over it: top_k finds the k-th largest
// current value by a radix selection on counts; top_p the smallest kept probability by a radix selection on mass
// (three levels of 11, 11 and 10 bits of the float32 value: at the last level a bucket is one value, a group of
// equal probabilities, decided as the spec says -- kept iff the mass strictly above it is below p); typical_p its
// score cutoff by a radix selection on mass in ascending score; min_p, top_n_sigma and xtc from reductions. The
// draw walks the blocks in descending order of their maxima; a token whose RandomBits cannot lift it above the
// best score so far is rejected on its bits alone.
// out[t] = the first word for counters (first + t * stride, c1), t < n (n a multiple of 16), vectorized.
SAMPLEC_VOCAB_LOOP void threefry_strided(uint32_t k0, uint32_t k1, uint32_t first, uint32_t stride, int n,
                                         uint32_t c1, uint32_t* out) {
  for (int t0 = 0; t0 < n; t0 += 16) {
    U8v a = kIota8 * stride + (first + static_cast<uint32_t>(t0) * stride);
    U8v b = a + 8 * stride;
    threefry8x2(k0, k1, a, b, c1);
    std::memcpy(out + t0, &a, sizeof a);
    std::memcpy(out + t0 + 8, &b, sizeof b);
  }
}

inline uint32_t order_key(float v) {        // ascending uint32 keys in the order of the floats (no NaN here)
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

inline float key_value(uint32_t k) {
  const uint32_t u = (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k;
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// The largest key k such that `base` plus the weight of the keys >= k reaches `need` (the highest key where `base`
// already does, the lowest where none does; `base`: the weight of keys above these, already counted).
// `keys` (and `ws`, their weights; empty: 1 each) are consumed. Each level histograms the next (up to) 11 bits
// below the bits the remaining keys share -- so a row whose values crowd into a narrow range (a flat row: every
// probability within a factor of two) is split by its first level as finely as a spread one -- and keeps only
// the boundary bucket's items: the later levels see a few.
template <class W>
uint32_t radix_select(std::vector<uint32_t>& keys, std::vector<W>& ws, W need, W base = W(0)) {
  constexpr int kDigit = 11;
  std::vector<W> hist;
  const bool unit = ws.empty();
  uint32_t lo = UINT32_MAX, hi = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    lo = keys[i] < lo ? keys[i] : lo;
    hi = keys[i] > hi ? keys[i] : hi;
  }
  if (keys.empty()) return 0;
  if (base >= need) return hi;                     // (every key reaches: the highest, never an empty bucket above it)
  while (true) {
    const uint32_t diff = lo ^ hi;
    if (diff == 0) return lo;                      // (one key value left, or none: lo)
    const int varying = 32 - __builtin_clz(diff);  // the low bits in which the remaining keys differ
    const int shift = varying > kDigit ? varying - kDigit : 0;
    const uint32_t mask = (1u << (varying - shift)) - 1u;
    const uint32_t common = varying == 32 ? 0u : lo & ~((1u << varying) - 1u);
    hist.assign(mask + 1, W(0));
    const size_t n = keys.size();
    for (size_t i = 0; i < n; ++i) hist[(keys[i] >> shift) & mask] += unit ? W(1) : ws[i];
    int64_t b = mask;
    for (; b > 0; --b) {
      if (base + hist[b] >= need) break;
      base += hist[b];
    }
    const uint32_t bucket = common | (static_cast<uint32_t>(b) << shift);
    // the boundary bucket's items, compacted without a branch (a bucket holding every eighth item would
    // mispredict most of them); its range is the bucket's, narrowed below by the next level's lo/hi pass
    size_t m = 0;
    const uint32_t want = static_cast<uint32_t>(b);
    if (unit) {
      for (size_t i = 0; i < n; ++i) {
        const uint32_t k = keys[i];
        keys[m] = k;
        m += ((k >> shift) & mask) == want;
      }
    } else {
      for (size_t i = 0; i < n; ++i) {
        const uint32_t k = keys[i];
        const W w = ws[i];
        keys[m] = k;
        ws[m] = w;
        m += ((k >> shift) & mask) == want;
      }
    }
    keys.resize(m);
    if (!unit) ws.resize(m);
    lo = UINT32_MAX, hi = 0;
    for (size_t i = 0; i < m; ++i) {
      lo = keys[i] < lo ? keys[i] : lo;
      hi = keys[i] > hi ? keys[i] : hi;
    }
    if (shift == 0 || m == 0) return bucket;
  }
}

// The least and the largest positive value of e[0..n) (lo = +inf, hi = 0 when none), eight lanes at a time
SAMPLEC_VOCAB_LOOP void positive_range(const float* e, int64_t n, float& lo, float& hi) {
  const F8 inf = F8{} + INFINITY, zero = F8{};
  F8 a = inf, b = zero;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    F8 v;
    std::memcpy(&v, e + i, sizeof v);
    const F8 w = v > zero ? v : inf;
    a = w < a ? w : a;
    b = v > b ? v : b;
  }
  lo = INFINITY, hi = 0.0f;
  for (int l = 0; l < 8; ++l) lo = a[l] < lo ? a[l] : lo, hi = b[l] > hi ? b[l] : hi;
  for (; i < n; ++i) {
    if (e[i] > 0.0f && e[i] < lo) lo = e[i];
    if (e[i] > hi) hi = e[i];
  }
}

// mass_select's buckets (below). out[i] = (order_key(v[i]) >> sh) & mk for v[i] >= 0: the key's low bits are the
// float's own (the sign bit it sets lies above the mask: lo and hi share it)
SAMPLEC_VOCAB_LOOP void bucket_ids(const float* v, int64_t n, int sh, uint32_t mk, uint32_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, v + i, sizeof u);
    out[i] = (u >> sh) & mk;
  }
}

void mass_histogram(const float* e, const float* wt, int64_t n, uint32_t lo, uint32_t hi, int& shift,
                    uint32_t& mask, std::vector<double>& hist) {
  constexpr int kDigit = 11;
  const int varying = 32 - __builtin_clz(lo ^ hi);
  shift = varying > kDigit ? varying - kDigit : 0;
  mask = (1u << (varying - shift)) - 1u;
  const int sh = shift;
  const uint32_t mk = mask;
  // in two halves (split: the waiting caller takes one), each four histograms over alternate tokens, then all
  // added in a fixed order (a tied row sends every token to a few buckets: one histogram would chain each add on
  // the last one's store)
  const size_t w = mask + 1;
  hist.assign(8 * w, 0.0);
  const int64_t half = std::min<int64_t>(n, (n / 2 + 63) / 64 * 64);
  split(2, [&](int64_t part) {
    double* h = hist.data() + part * 4 * w;
    const float* v = e + (part ? half : 0);
    const float* wv = wt + (part ? half : 0);
    const int64_t m = part ? n - half : std::min(n, half);
    uint32_t idx[1024];
    for (int64_t i0 = 0; i0 < m; i0 += 1024) {       // the buckets sixteen at a time, then the adds
      const int64_t c = std::min<int64_t>(1024, m - i0);
      bucket_ids(v + i0, c, sh, mk, idx);
      const float* u = wv + i0;
      int64_t i = 0;
      for (; i + 4 <= c; i += 4) {
        for (int j = 0; j < 4; ++j) h[j * w + idx[i + j]] += u[i + j];
      }
      for (; i < c; ++i) h[idx[i]] += u[i];
    }
  });
  double* h = hist.data();
  for (size_t b = 0; b < w; ++b) {
    h[b] = ((h[b] + h[w + b]) + (h[2 * w + b] + h[3 * w + b])) +
           ((h[4 * w + b] + h[5 * w + b]) + (h[6 * w + b] + h[7 * w + b]));
  }
  hist.resize(w);
}

// The keys of the e[i] in [lo, hi] (lo >= 0; ~ the keys where `flip`) and their weights wt[i], in index order,
// and the least and largest of those e (vlo > vhi when none); false (the keys cut short) where there are more than
// `cap`: sixteen compared at once, the hits taken by their bits (no branch per token: a tied row puts every eighth
// token in the range).
SAMPLEC_VOCAB_LOOP bool collect_range(const float* e, const float* wt, bool flip, int64_t n, float lo, float hi,
                                      std::vector<uint32_t>& keys, std::vector<double>& wd, size_t cap, float& vlo,
                                      float& vhi) {
  keys.clear();
  wd.clear();
  const F8 a = F8{} + lo, b = F8{} + hi, inf = F8{} + INFINITY, ninf = F8{} - INFINITY;
  F8 mn[2] = {inf, inf}, mx[2] = {ninf, ninf};
  bool whole = true;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    F8 v[2];
    std::memcpy(&v[0], e + i, sizeof v[0]);
    std::memcpy(&v[1], e + i + 8, sizeof v[1]);
    // (eight lanes, one comparison per select, two masks: GCC turns sixteen-lane comparisons, and a select on two
    // comparisons ANDed, into scalar code)
    for (int h = 0; h < 2; ++h) {
      const F8 u0 = v[h] >= a ? v[h] : inf, w0 = v[h] <= b ? v[h] : ninf;
      const F8 u = u0 <= b ? u0 : inf, w = w0 >= a ? w0 : ninf;
      mn[h] = u < mn[h] ? u : mn[h];
      mx[h] = w > mx[h] ? w : mx[h];
    }
    if (!whole) continue;
    uint32_t hits = bits16(v[0] >= a, v[1] >= a) & bits16(v[0] <= b, v[1] <= b);
    for (; hits; hits &= hits - 1) {
      const int64_t at = i + __builtin_ctz(hits);
      keys.push_back(flip ? ~order_key(e[at]) : order_key(e[at]));
      wd.push_back(wt[at]);
    }
    whole = keys.size() <= cap;
  }
  vlo = INFINITY, vhi = -INFINITY;
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 8; ++l) vlo = mn[h][l] < vlo ? mn[h][l] : vlo, vhi = mx[h][l] > vhi ? mx[h][l] : vhi;
  for (; i < n; ++i) {
    if (e[i] >= lo && e[i] <= hi) {
      vlo = e[i] < vlo ? e[i] : vlo, vhi = e[i] > vhi ? e[i] : vhi;
      if (whole) keys.push_back(flip ? ~order_key(e[i]) : order_key(e[i])), wd.push_back(wt[i]);
    }
  }
  return whole && keys.size() <= cap;
}

// A selection by mass over keys k[0..n) (non-negative floats; their weights w, 0 where removed, and a removed
// token's key outside [flo, fhi], the range of the others) -- W(>= c): the weight of the keys >= c:
//   descending: the largest c with W(>= c) >= need (top_p: the fewest tokens from the top); flo where nothing
//               reaches need (every key), fhi where need <= 0
//   ascending:  the least c with W(<= c) >= need (typical_p: the fewest scores from the least); fhi where nothing
//               reaches need, flo where need <= 0
// The first level of radix_select straight over the row, without
// compacting it into keys first: the histogram of the bits below those every key in range shares, then only the
// boundary bucket's tokens go on to radix_select. The same buckets as radix_select over the keys; their sums in
// another order (four accumulators), so only a mass within rounding of the target can land on the other side (the
// contract's "up to float rounding").
float mass_select(const float* k, const float* w, int64_t n, double need, float flo, float fhi, bool ascending,
                  std::vector<uint32_t>& keys, std::vector<double>& wd) {
  // (no key in range -- a row the checks reject, +inf or NaN in it: NaN, which no key reaches)
  if (!(flo <= fhi)) return NAN;
  const uint32_t lo = order_key(flo), hi = order_key(fhi);
  if (lo == hi) return fhi;
  thread_local std::vector<double> hist_tls;
  auto& hist = hist_tls;
  int shift;
  uint32_t mask;
  mass_histogram(k, w, n, lo, hi, shift, mask, hist);
  // the walk from lo's bucket up (ascending) or hi's down, ending at the other's: the buckets outside hold nothing
  // (a need of 0 ends at once, in a bucket that holds a key)
  const int64_t b_lo = (lo >> shift) & mask, b_hi = (hi >> shift) & mask, step = ascending ? 1 : -1;
  double base = 0.0;
  int64_t b = ascending ? b_lo : b_hi;
  for (; b != (ascending ? b_hi : b_lo); b += step) {
    if (base + hist[b] >= need) break;
    base += hist[b];
  }
  const uint32_t want = static_cast<uint32_t>(b);
  const int varying = 32 - __builtin_clz(lo ^ hi);
  const uint32_t common = varying == 32 ? 0u : lo & ~((1u << varying) - 1u);
  const uint32_t first = common | (want << shift);
  if (shift == 0) return key_value(first);
  // the bucket's keys are the floats from key_value(first) to key_value(first + 2^shift - 1)
  const float blo = std::max(key_value(first), flo), bhi = std::min(key_value(first + ((1u << shift) - 1u)), fhi);
  // the bucket's tokens span by span (joined in span order), and the least and largest of them: a span that
  // holds more than kCap (256) of them keeps only those two (a tied row's bucket: one value, thousands of tokens), and
  // where the bucket holds more than one value all of them are collected again
  constexpr size_t kCap = 256;
  const int64_t s = spans(n);
  thread_local std::vector<std::vector<uint32_t>> keys_s;
  thread_local std::vector<std::vector<double>> wd_s;
  keys_s.resize(std::max<size_t>(keys_s.size(), s));
  wd_s.resize(std::max<size_t>(wd_s.size(), s));
  auto& ks = keys_s;
  auto& ws = wd_s;
  std::vector<float> lo_s(s), hi_s(s);
  std::vector<uint8_t> full(s);
  each_span(n, [&](int64_t lo, int64_t hi) {
    const int64_t c = lo / kSpan;
    full[c] = !collect_range(k + lo, w + lo, ascending, hi - lo, blo, bhi, ks[c], ws[c], kCap, lo_s[c], hi_s[c]);
  });
  float vlo = INFINITY, vhi = -INFINITY;
  bool capped = false;
  for (int64_t c = 0; c < s; ++c) vlo = std::min(vlo, lo_s[c]), vhi = std::max(vhi, hi_s[c]), capped |= full[c];
  if (vlo == vhi) return vlo;             // (one value in the bucket -- a tied row's: the cut, as radix_select finds)
  if (vlo > vhi) return key_value(first);
  if (capped) {
    each_span(n, [&](int64_t lo, int64_t hi) {
      float a, b;
      collect_range(k + lo, w + lo, ascending, hi - lo, blo, bhi, ks[lo / kSpan], ws[lo / kSpan], SIZE_MAX, a, b);
    });
  }
  keys.clear();
  wd.clear();
  for (int64_t c = 0; c < s; ++c) {
    keys.insert(keys.end(), ks[c].begin(), ks[c].end());
    wd.insert(wd.end(), ws[c].begin(), ws[c].end());
  }
  const uint32_t key = radix_select(keys, wd, need, base);
  return key_value(ascending ? ~key : key);
}

// The largest probability e_min such that the mass of e >= e_min reaches `need` (a descending mass_select over the
// positive e; the least positive e where nothing reaches it).
float mass_cut(const float* e, int64_t n, double need, std::vector<uint32_t>& keys, std::vector<double>& wd) {
  float flo = INFINITY, fhi = 0.0f;
  for (const auto& [a, b] : per_span<std::pair<float, float>>(n, [e](int64_t lo, int64_t hi) {
         std::pair<float, float> r;
         positive_range(e + lo, hi - lo, r.first, r.second);
         return r;
       })) {
    flo = std::min(flo, a), fhi = std::max(fhi, b);
  }
  if (!(fhi > 0.0f)) return fhi;
  return mass_select(e, e, n, need, flo, fhi, false, keys, wd);
}

// The number of kept tokens (keep: 0/1 bytes)
SAMPLEC_VOCAB_LOOP int64_t count_kept(const uint8_t* keep, int64_t n) {
  int64_t total = 0;
  for (int64_t i0 = 0; i0 < n; i0 += 65536) {     // (uint32 lanes: vectorizes)
    uint32_t part = 0;
    const int64_t end = std::min<int64_t>(n, i0 + 65536);
    for (int64_t i = i0; i < end; ++i) part += keep[i];
    total += part;
  }
  return total;
}

// The ids (base + i) of the kept tokens, ascending, into out; their count. Eight flags at a time: an all-zero word is
// skipped, the others' ids compacted without a branch per token (a row that keeps most of its tokens, or every
// other one, would mispredict a loop over their bits) into eight slots, then stored: all eight while out has room
// for them (`cap`: the span's kept count, its own part of out -- spans write side by side; the slots past the kept
// ones are written over by the next group's), the kept ones alone in the last groups.
int64_t kept_ids(const uint8_t* keep, int64_t n, int64_t base, int32_t* out, int64_t cap) {
  int64_t m = 0, i = 0;
  int32_t slot[8] = {};
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, keep + i, sizeof w);
    if (w == 0) continue;
    int c = 0;
    for (int j = 0; j < 8; ++j) {
      slot[c] = static_cast<int32_t>(base + i + j);
      c += keep[i + j];
    }
    if (m + 8 <= cap) {
      std::memcpy(out + m, slot, sizeof slot);
    } else {
      std::memcpy(out + m, slot, sizeof(int32_t) * c);
    }
    m += c;
  }
  for (; i < n; ++i) {
    if (keep[i]) out[m++] = static_cast<int32_t>(base + i);    // (never past its own: spans write side by side)
  }
  return m;
}

// out[i] = v[i] divided by t where kept, -inf elsewhere
SAMPLEC_VOCAB_LOOP void write_kept(float* __restrict out, const uint8_t* __restrict keep, const float* __restrict v,
                                   int64_t n, float t) {
  if (t == 1.0f) {                       // (the vectorized division is made for every token: none at t = 1)
    for (int64_t i = 0; i < n; ++i) {
      const float x = v[i];
      out[i] = keep[i] ? x : -INFINITY;
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float d = divided(v[i], t);      // (read for every token: a load under the `?:` stays scalar)
    out[i] = keep[i] ? d : -INFINITY;
  }
}

// The first kept i in [0, n) whose value divided by t is top, or n
SAMPLEC_VOCAB_LOOP int64_t first_kept_at(const uint8_t* keep, const float* v, int64_t n, float t, float top) {
  if (t == 1.0f) {                       // (the vectorized division is made for every token: none at t = 1)
    return first_hit(0, n, [=](int64_t i) {
      return static_cast<int>(keep[i] != 0) & static_cast<int>(v[i] == top);
    });
  }
  return first_hit(0, n, [=](int64_t i) {
    return static_cast<int>(keep[i] != 0) & static_cast<int>(divided(v[i], t) == top);
  });
}

// out[i] = v[ids[i]] divided by t, branch-free (gathers)
SAMPLEC_VOCAB_LOOP void gather_divided(float* __restrict out, const float* __restrict v, const int32_t* __restrict ids,
                                       int64_t n, float t) {
  if (t == 1.0f) {
    for (int64_t i = 0; i < n; ++i) out[i] = v[ids[i]];
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = divided(v[ids[i]], t);
  }
}

// The dense chain's passes over the row, branch-free so that they vectorize (`keep` is a 0/1 byte per token).
SAMPLEC_VOCAB_LOOP void keep_finite(uint8_t* __restrict keep, const float* __restrict v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) keep[i] = static_cast<uint8_t>(v[i] > -INFINITY);
}

// keep[i] &= v[i] >= floor (assign: keep[i] = v[i] >= floor, for a mask that held every finite value and a floor
// above -inf); the kept count after it
SAMPLEC_VOCAB_LOOP int64_t keep_at_least(uint8_t* __restrict keep, const float* __restrict v, int64_t n, float floor,
                                         bool assign) {
  uint32_t count = 0;               // (n <= a span: no overflow)
  if (assign) {
    for (int64_t i = 0; i < n; ++i) count += keep[i] = static_cast<uint8_t>(v[i] >= floor);
  } else {
    for (int64_t i = 0; i < n; ++i) count += keep[i] &= static_cast<uint8_t>(v[i] >= floor);
  }
  return count;
}

// whether any l < n has (bits[l] >> 9) >= need and keep[l] (a reduction that vectorizes)
SAMPLEC_VOCAB_LOOP bool any_live(const uint32_t* __restrict bits, const uint8_t* __restrict keep, int n,
                                 uint32_t need) {
  uint32_t any = 0;
  for (int l = 0; l < n; ++l) any |= static_cast<uint32_t>((bits[l] >> 9) >= need) & keep[l];
  return any != 0;
}

void chain_dense(ChainRow& row, int64_t nb, int bs, int32_t* token, float* logprob, std::vector<float>& buf,
                 std::vector<uint8_t>& keep, std::vector<int32_t>& order) {
  const float* x = row.x;
  const int64_t V = row.V;
  row.divs.clear();
  keep.resize(V);
  // the mask starts as every finite token, written by the first pass that needs it (a first cut at a floor above
  // -inf writes it in its own pass); the cut passes count the kept tokens per span as they go
  bool lazy = true;
  const int64_t ns = spans(V);
  std::vector<int64_t> span_kept(ns, 0);
  bool counted = false;
  auto materialize = [&]() {
    if (!lazy) return;
    each_span(V, [&](int64_t lo, int64_t hi) { keep_finite(keep.data() + lo, x + lo, hi - lo); });
    lazy = false;
  };
  thread_local std::vector<float> fxbuf_tls;
  thread_local std::vector<uint32_t> keys_tls;
  thread_local std::vector<double> wd_tls;
  auto& fxbuf = fxbuf_tls;            // (bound once: each thread_local access is a TLS lookup)
  auto& keys = keys_tls;
  auto& wd = wd_tls;
  const float* fx = x;                // the current values: x with the temperatures applied so far
  float fmax = max_nan(row.bm->data(), nb);   // the largest kept current value (cuts keep it; xtc may remove it)
  auto recompute_max = [&]() {
    float m = -INFINITY;
    for (int64_t i = 0; i < V; ++i) {
      if (keep[i] && fx[i] > m) m = fx[i];
    }
    fmax = m;
  };
  bool pristine = true;               // every finite token kept, buf untouched since full_z (if it ran)
  bool buf_from_z = false;            // probs() are full_z's exps (see ChainRow::md)
  auto probs = [&]() {                // buf = exp(fx - max) over the kept tokens (0 elsewhere); their sum
    if (pristine && row.z_in_buf && row.zbuf == &buf && row.z_divs == row.divs && row.z_vmax == fmax) {
      pristine = false;
      buf_from_z = true;
      return row.z;                   // (full_z left exactly these in buf)
    }
    buf_from_z = false;
    pristine = false;
    buf.resize(V);
    return sum_spans(V, [&](int64_t lo, int64_t hi) {
      return exp_kept(buf.data() + lo, lazy ? nullptr : keep.data() + lo, fx + lo, hi - lo, 1.0f, fmax);
    });
  };
  // keep[i] &= v[i] >= floor, where a -inf token's v is `removed` (-inf in fx, 0 in the exps)
  auto keep_from = [&](const float* v, float floor, float removed) {
    const bool assign = lazy && floor > removed;        // (the first cut writes the mask: -inf tokens fail it)
    if (!assign) materialize();
    each_span(V, [&](int64_t lo, int64_t hi) {
      span_kept[lo / kSpan] = keep_at_least(keep.data() + lo, v + lo, hi - lo, floor, assign);
    });
    lazy = false;
    counted = true;
  };
  auto touch = [&]() {                // before a stage that reads or writes the mask element by element
    materialize();
    counted = false;
  };
  float last_t = 1.0f;                // a temperature that is the last stage: applied where values are read
  auto val = [&](int64_t i) {         // the current value of token i (divide_by's float)
    const float v = fx[i];
    return divided(v, last_t);
  };
  const auto& stages = *row.stages;
  for (size_t s = 0; s < stages.size(); ++s) {
    const StageArgs& sa = row.args[s];
    const double a = sa.a;
    switch (stages[s]) {
      case kTemperature:
      case kDynTemp: {
        float t = static_cast<float>(a);
        if (stages[s] == kDynTemp && static_cast<float>(sa.b) != 0.0f) {
          // temperature(T), T from the kept tokens' count and entropy (their exps: probs())
          const double n = sum_spans(V, [&](int64_t lo, int64_t hi) {
            return static_cast<double>(count_finite(lazy ? nullptr : keep.data() + lo, fx + lo, hi - lo));
          });
          if (n <= 1.0) break;
          const double z = probs();
          const float zf = static_cast<float>(z);
          t = dyn_temperature(sa, n, z, sum_spans(V, [&](int64_t lo, int64_t hi) {
                                return typical_mean(buf.data() + lo, fx + lo, hi - lo, zf, fmax);
                              }));
        }
        if (t == 1.0f) break;
        if (t == 0.0f || !std::isfinite(fmax / t)) {     // (the limit: see chain_run)
          pristine = false;
          touch();
          bool found = false;
          for (int64_t i = 0; i < V; ++i) {
            const bool win = !found && keep[i] && fx[i] == fmax;
            found |= win;
            keep[i] = win;
          }
          break;
        }
        fmax = fmax == -INFINITY ? fmax : fmax / t;
        row.divs.push_back(t);
        if (s + 1 == stages.size()) {   // the last stage: the draw and the outputs divide the values they read
          last_t = t;
          break;
        }
        fxbuf.resize(V);
        const float* from = fx;
        each_span(V, [&](int64_t lo, int64_t hi) { divide_by(fxbuf.data() + lo, from + lo, hi - lo, t); });
        fx = fxbuf.data();
        break;
      }
      case kTopK:
      case kTopKRank: {
        if (a <= 0 || a >= static_cast<double>(V)) break;
        const int64_t k = static_cast<int64_t>(a);
        materialize();
        keys.resize(V);
        size_t n = 0;
        for (int64_t i = 0; i < V; ++i) {
          keys[n] = order_key(fx[i]);
          n += keep[i];
        }
        keys.resize(n);
        if (k >= static_cast<int64_t>(keys.size())) break;
        std::vector<int64_t> unit;
        const float vk = key_value(radix_select(keys, unit, k));
        keep_from(fx, vk, -INFINITY);
        pristine = false;
        if (stages[s] == kTopKRank) {         // the values at the k-th: as many as the k places leave, lowest ids first
          touch();
          int64_t left = k;
          for (int64_t i = 0; i < V; ++i) left -= keep[i] & (fx[i] > vk);
          for (int64_t i = 0; i < V; ++i) {
            if (keep[i] && fx[i] == vk) {
              if (left > 0) {
                --left;
              } else {
                keep[i] = 0;
              }
            }
          }
        }
        break;
      }
      case kMinP: {
        const float m = static_cast<float>(a);
        if (m == 0.0f) break;
        const float floor = fmax + std::log(m);
        keep_from(fx, floor, -INFINITY);
        pristine = false;
        break;
      }
      case kTopP: {
        const float p = static_cast<float>(a);
        if (p >= 1.0f) break;
        const double z = probs();
        // the smallest kept exp, then down to the least exp whose probability (the float32 e / Z, as the contract
        // computes p) is that one's: a division that rounds neighbouring exps together makes them one group (a
        // float32 quotient holds one or two exps where it is normal: the cut's mass keeps it there, Z <= V)
        float e_min = mass_cut(buf.data(), V, static_cast<double>(p) * z, keys, wd);
        const float zf = static_cast<float>(z), q = e_min / zf;
        float lower = std::nextafter(e_min, 0.0f);
        for (int step = 0; step < 4096 && lower > 0.0f && lower / zf == q; ++step) {   // (a few: see below)
          e_min = lower;
          lower = std::nextafter(lower, 0.0f);
        }
        keep_from(buf.data(), e_min, 0.0f);
        break;
      }
      case kTopNSigma: {
        const float nsig = static_cast<float>(a);
        if (nsig <= 0.0f) break;
        keep_from(fx, sigma_floor(lazy ? nullptr : keep.data(), fx, V, fmax, nsig), -INFINITY);
        pristine = false;
        break;
      }
      case kTypicalP: {
        if (a >= 1.0) break;
        // score = |mean(d) - d_i| with d = x - max (-log p_i - H with log Z cancelled), over the live tokens
        const double z = probs();
        touch();
        const float zf = static_cast<float>(z);
        // (the same exps, values and z as chain_run's whole-row mean: its float again)
        const bool known = buf_from_z && row.md_vmax == fmax && row.md_divs == row.divs;
        const float md = known ? row.md : static_cast<float>(sum_spans(V, [&](int64_t lo, int64_t hi) {
          return typical_mean(buf.data() + lo, fx + lo, hi - lo, zf, fmax);
        }));
        thread_local std::vector<float> score_tls;
        auto& score = score_tls;
        score.resize(V);
        float slo = INFINITY, shi = -INFINITY;
        for (const auto& [l, h] : per_span<std::pair<float, float>>(V, [&](int64_t lo, int64_t hi) {
               return typical_scores(score.data() + lo, buf.data() + lo, fx + lo, hi - lo, md, fmax);
             })) {
          slo = std::min(slo, l), shi = std::max(shi, h);
        }
        // the smallest score whose cumulative mass (ascending score) reaches m (no live score -- a row holding
        // +inf, which the checks reject: a NaN cut, and only the top stays)
        const float cut = mass_select(score.data(), buf.data(), V, a * z, slo, shi, true, keys, wd);
        each_span(V, [&](int64_t lo, int64_t hi) {
          keep_typical(keep.data() + lo, score.data() + lo, fx + lo, hi - lo, cut, fmax);
        });
        break;
      }
      case kEpsilon:
      case kEta: {
        const float e = static_cast<float>(a);
        if (e == 0.0f) break;
        // p = the kept tokens' exp over their sum; eta's floor from their entropy (log z - sum p d)
        const double z = probs();
        const float zf = static_cast<float>(z);
        float cut = e;
        if (stages[s] == kEta) {
          cut = eta_cut(e, z, sum_spans(V, [&](int64_t lo, int64_t hi) {
            return typical_mean(buf.data() + lo, fx + lo, hi - lo, zf, fmax);
          }));
        }
        touch();
        each_span(V, [&](int64_t lo, int64_t hi) {
          keep_prob_at_least(keep.data() + lo, buf.data() + lo, fx + lo, hi - lo, zf, cut, fmax);
        });
        break;
      }
      case kXtc: {
        if (sa.b == 0.0) break;
        if (!(uniform_of(threefry_first_word(sa.k0, sa.k1, kXtcCounter, sa.pos)) < static_cast<float>(sa.b))) break;
        const double z = probs();
        touch();
        const float zf = static_cast<float>(z), thr = static_cast<float>(a);
        int64_t n_top = 0, survivor = -1;
        float least = INFINITY;
        for (int64_t i = 0; i < V; ++i) {
          const float p = buf[i] / zf;
          if (keep[i] && p >= thr) {
            ++n_top;
            if (p < least) least = p, survivor = i;
          }
        }
        if (n_top < 2) break;
        for (int64_t i = 0; i < V; ++i) {
          if (keep[i] && buf[i] / zf >= thr && i != survivor) keep[i] = 0;
        }
        recompute_max();
        break;
      }
    }
  }
  int64_t at = -1;
  int64_t compact = -1;               // the draw's kept tokens compacted: their count (ids in order, values kept_vals)
  thread_local std::vector<float> kept_vals_tls;
  auto& kept_vals = kept_vals_tls;
  materialize();
  if (row.terminal == kGreedy) {
    const int64_t i = first_kept_at(keep.data(), fx, V, last_t, fmax);
    if (i < V) at = i;
  } else {
    const auto& bm = *row.bm;
    // A draw in parts (split) keeps a winner per part, each started from the same best score; the winner is
    // the best of them, the lower id on equal scores -- the same token as one walk over everything.
    struct Win {
      float best;
      int64_t at;
    };
    auto better = [](const Win& a, const Win& b, auto id) {    // whether a beats b
      return a.at >= 0 && (b.at < 0 || a.best > b.best || (a.best == b.best && id(a.at) < id(b.at)));
    };
    // Under half the row kept, spread over it (a cut at a value thousands of tokens share: every block's maximum
    // is at the cut, so no block can be skipped; typical_p's band): their ids compacted, then their RandomBits
    // sixteen at a time, a group skipped when its largest value plus the largest noise stays below the best
    // score, a token rejected on its bits alone as in the block walk -- Threefry for the kept tokens only. (From
    // half the row on, the block walk's Threefry for every token costs less than compacting them: a flat row's
    // typical_p(0.7) 1.06 -> 0.88 ms, top_p(0.6) 0.81 -> 0.68 ms against a threshold of three quarters.)
    const int64_t s = ns;
    if (!counted) {
      each_span(V, [&](int64_t lo, int64_t hi) { span_kept[lo / kSpan] = count_kept(keep.data() + lo, hi - lo); });
    }
    std::vector<int64_t> kept_s(s + 1, 0);
    for (int64_t c = 0; c < s; ++c) kept_s[c + 1] = kept_s[c] + span_kept[c];
    if (kept_s[s] * 2 < V) {
      // (their current values beside them, contiguous: the draw and the normalizer read those)
      order.resize(V);
      kept_vals.resize(V);
      each_span(V, [&](int64_t lo, int64_t hi) {
        const int64_t at0 = kept_s[lo / kSpan];
        const int64_t n = kept_ids(keep.data() + lo, hi - lo, lo, order.data() + at0, span_kept[lo / kSpan]);
        gather_divided(kept_vals.data() + at0, fx, order.data() + at0, n, last_t);
      });
      const int64_t m = kept_s[s];
      compact = m;
      int64_t first = 0;                          // the best score starts at a largest value's
      while (first < m && kept_vals[first] != fmax) ++first;
      Win start{-INFINITY, -1};
      if (first < m) {
        start = {fmax + gumbel_of(threefry_first_word(row.k0, row.k1, static_cast<uint32_t>(order[first]), row.pos)),
                 first};
      }
      constexpr int64_t kPart = 8192;            // (ids per part: a multiple of sixteen)
      const int64_t parts = (m + kPart - 1) / kPart;
      std::vector<Win> wins(parts, start);
      auto id = [&order](int64_t i) { return order[i]; };
      split(parts, [&](int64_t c) {
        gumbel_max16(c * kPart, std::min(m, (c + 1) * kPart), id, [&](int64_t i) { return kept_vals[i]; }, false,
                     row.k0, row.k1, row.pos, wins[c].best, wins[c].at);
      });
      Win w = start;
      for (const Win& c : wins) w = better(c, w, id) ? c : w;
      at = w.at < 0 ? -1 : order[w.at];
    } else {
      // The winner is the same whatever the order the blocks are visited in (equal scores: the lower id), so the
      // order only decides how early the bound `best` is high: the top blocks by maximum first, in descending order
      // (a confident row ends there), then the rest as they lie, in parts, each block skipped when its maximum
      // plus the largest Gumbel noise stays below the best score so far -- no heap over every block.
      // false: this block, and every block whose maximum is not above its own, cannot hold the winner
      auto visit = [&](int64_t c, Win& w, NeedCache& threshold) -> bool {
        if (bm[c] == -INFINITY) return false;
        const float fm = row.f(bm[c]);                  // (f: the temperatures)
        if (w.at >= 0 && fm + kGumbelMax < w.best) return false;
        uint32_t need = w.at >= 0 ? threshold(w.best, fm) : 0u;
        uint32_t bits[64];
        threefry_strided(row.k0, row.k1, static_cast<uint32_t>(c * bs), 1u, bs, row.pos, bits);
        const int64_t lo = c * bs;
        const int n = static_cast<int>(std::min<int64_t>(bs, V - lo));
        // most blocks of a flat row hold no kept token whose bits pass the need: one vectorized test skips them
        if (w.at >= 0 && !any_live(bits, keep.data() + lo, n, need)) return true;
        for (int l = 0; l < n; ++l) {
          const int64_t tok = lo + l;
          if ((bits[l] >> 9) < need || !keep[tok]) continue;
          const float sc = val(tok) + gumbel_of(bits[l]);
          if (w.at < 0 || sc > w.best || (sc == w.best && tok < w.at)) {
            w = {sc, tok};
            need = threshold(w.best, fm);
          }
        }
        return true;
      };
      order.resize(nb);
      for (int64_t i = 0; i < nb; ++i) order[i] = static_cast<int32_t>(i);
      auto above = [&bm](int32_t a, int32_t b) { return bm[a] > bm[b] || (bm[a] == bm[b] && a < b); };
      const int64_t head = std::min<int64_t>(nb, 32);
      std::nth_element(order.begin(), order.begin() + (head - 1), order.end(), above);
      std::sort(order.begin(), order.begin() + head, above);
      // the first 8 in order on this thread (a confident row ends there: a block that cannot hold the winner
      // rules out every later one), then the rest in parts from the best score so far
      Win w{-INFINITY, -1};
      bool done = false;
      NeedCache cache;
      const int64_t first = std::min<int64_t>(head, 8);
      for (int64_t i = 0; i < first && !done; ++i) done = !visit(order[i], w, cache);
      if (!done) {
        constexpr int64_t kPart = 256;           // (blocks per part)
        const int64_t parts = (nb - first + kPart - 1) / kPart;
        std::vector<Win> wins(parts, w);
        split(parts, [&](int64_t c) {
          NeedCache part_cache;
          for (int64_t i = first + c * kPart; i < std::min(nb, first + (c + 1) * kPart); ++i) {
            visit(order[i], wins[c], part_cache);
          }
        });
        for (const Win& c : wins) w = better(c, w, [](int64_t t) { return t; }) ? c : w;
      }
      at = w.at;
    }
  }
  if (at < 0) at = 0;
  *token = static_cast<int32_t>(at);
  if (row.want_logprob) {     // (the kept tokens' values compacted: a pass over those alone, the same terms)
    const double z = compact >= 0 ? sum_spans(compact, [&](int64_t lo, int64_t hi) {
                                      return exp_kept(nullptr, nullptr, kept_vals.data() + lo, hi - lo, 1.0f, fmax);
                                    })
                                  : sum_spans(V, [&](int64_t lo, int64_t hi) {
                                      return exp_kept(nullptr, keep.data() + lo, fx + lo, hi - lo, last_t, fmax);
                                    });
    *logprob = (val(at) - fmax) - static_cast<float>(std::log(z));
  }
  if (row.x_out != nullptr) {
    each_span(V, [&](int64_t lo, int64_t hi) {
      write_kept(row.x_out + lo, keep.data() + lo, fx + lo, hi - lo, last_t);
    });
    if (row.probs_out) softmax_inplace(row.x_out, V, fmax);
  }
}

// Whether stage s of the row removes nothing: a temperature (a monotone map), or a cut at its off value.
bool stage_off(const ChainRow& row, size_t s) {
  const double a = row.args[s].a;
  switch ((*row.stages)[s]) {
    case kTemperature: return true;
    case kTopK: return a <= 0 || a >= static_cast<double>(row.V);
    case kTopP: return a >= 1.0;
    case kMinP: return a == 0.0;
    case kTopNSigma: return a <= 0.0;
    case kTypicalP: return a >= 1.0;
    case kXtc: return row.args[s].b == 0.0;
    case kEpsilon:
    case kEta: return static_cast<float>(a) == 0.0f;
    case kDynTemp: return true;         // (a temperature: T from the kept set)
    case kTopKRank: return a <= 0 || a >= static_cast<double>(row.V);
  }
  return false;
}

// The number of finite values of x[0..n) below `top` that the divisions by `divs`, in order, round onto top's
// (a reduction that vectorizes, in spans)
SAMPLEC_VOCAB_LOOP int64_t rounded_onto(const float* x, int64_t n, float top, float ftop, const float* divs,
                                        size_t nd) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i];
    for (size_t d = 0; d < nd; ++d) v = v / divs[d];
    count += (x[i] < top) & (x[i] > -INFINITY) & (v == ftop);
  }
  return count;
}

int64_t count_rounded_onto(const float* x, int64_t V, float top, const std::vector<float>& divs) {
  float ftop = top;
  for (float t : divs) ftop = ftop / t;
  return static_cast<int64_t>(sum_spans(V, [&](int64_t lo, int64_t hi) {
    return static_cast<double>(rounded_onto(x + lo, hi - lo, top, ftop, divs.data(), divs.size()));
  }));
}

// A row whose chain reaches temperature 0 through stages that all keep the largest current value (cuts, positive
// temperatures, an xtc whose coin does not fire) keeps that value's lowest id alone: every later stage leaves a
// single token as it is, and the draw returns it. A greedy draw asked for its token alone is the same point at the
// chain's end. Every cut keeps the whole group at the largest value, so the token is the lowest id at the top
// unless a temperature rounds a lower value onto it (then a cut may have removed that one: the chain decides).
// One pass over the row (two with temperatures after a cut), none of the cuts' work (a server batch's greedy
// requests cost an argmax). False (nothing written) where the row needs the chain. `bm` (nb blocks of bs): the
// row's block maxima where they are made already (a row written through edits or prefix ops): the top and its first
// token come from them and one block, not two passes over the row.
bool greedy_row(ChainRow& row, int32_t* token, const float* bm = nullptr, int64_t nb = 0, int bs = 64) {
  const auto& stages = *row.stages;
  size_t zero = stages.size();
  for (int kind : stages) {
    if (kind == kDynTemp || kind == kTopKRank) return false;   // (the chain decides: a temperature from the kept
                                                               // set, places among equal values)
  }
  for (size_t s = 0; s < stages.size() && zero == stages.size(); ++s) {
    const StageArgs& sa = row.args[s];
    if (stages[s] == kTemperature && sa.a == 0.0) {
      zero = s;
    } else if (stages[s] == kXtc && sa.b != 0.0 &&
               uniform_of(threefry_first_word(sa.k0, sa.k1, kXtcCounter, sa.pos)) < static_cast<float>(sa.b)) {
      return false;                       // xtc may remove the largest value
    }
  }
  if (zero == stages.size() && (row.terminal != kGreedy || row.want_logprob || row.x_out != nullptr)) return false;
  const float* x = row.x;
  const int64_t V = row.V;
  const float top = bm != nullptr ? max_nan(bm, nb) : max_spans(x, V);
  if (!(top > -INFINITY)) return false;   // NaN or nothing finite: the program's checks report the row
  std::vector<float> before;              // the positive temperatures applied before the zero, in order
  float ftop = top;
  bool cut = false;                       // a stage before them removed tokens
  bool rounded = false;                   // ... and a temperature after it
  for (size_t s = 0; s < zero; ++s) {
    if (stages[s] != kTemperature) {
      cut |= !stage_off(row, s);
      continue;
    }
    if (row.args[s].a == 1.0) continue;
    const float t = static_cast<float>(row.args[s].a);
    if (!std::isfinite(ftop / t)) break;  // the top / t leaves the float32 range: this one keeps the argmax
    // a division after a cut may round a removed token onto the top (x / inf, underflow): checked below
    rounded |= cut;
    ftop = ftop / t;
    before.push_back(t);
  }
  auto f = [&before](float v) {
    for (float t : before) v = v / t;
    return v;
  };
  int64_t at = bm != nullptr ? first_of_blocks(x, V, bm, nb, bs, top) : first_of(x, V, top);
  // a division may round a lower value onto the top: then the first token whose f(x) is the top's (and where a cut
  // came before the division, it may have removed that one or not: the chain decides)
  if (!before.empty() && count_rounded_onto(x, V, top, before) > 0) {
    if (rounded) return false;
    at = 0;
    while (x[at] == -INFINITY || f(x[at]) != ftop) ++at;
  }
  *token = static_cast<int32_t>(at);
  if (row.x_out != nullptr) {             // the kept token's value: every positive temperature, in order, but
    float v = x[at];                      // one that would take it out of the float32 range (it keeps it as is)
    for (size_t s = 0; s < stages.size(); ++s) {
      const float t = static_cast<float>(row.args[s].a);
      if (stages[s] == kTemperature && t != 0.0f && t != 1.0f && std::isfinite(v / t)) v = v / t;
    }
    std::fill(row.x_out, row.x_out + V, row.probs_out ? 0.0f : -INFINITY);
    row.x_out[at] = row.probs_out ? 1.0f : v;
  }
  return true;
}

// Whether every stage of the row is a temperature or at its off value (spec section 2), so that nothing is cut.
bool row_temps_only(const ChainRow& row) {
  for (size_t s = 0; s < row.stages->size(); ++s) {
    if (!stage_off(row, s)) return false;
  }
  return true;
}

struct SampleChain {
  static constexpr const char* kName = "SamplecSampleChain";
  std::vector<int> stages;
  int terminal;
  bool want_logprob, want_x, want_probs, edited, want_top, want_raw;
  int top_n = 0, margin = 0;          // top_logprobs(top_n) of the raw logits (with want_raw), and its tie margin
  // prefix ops (allow, logit_bias: kPrefixMask, kPrefixBias), the first n_pre of them below the edits (their
  // values read through them: penalty_edits' `pre`), the others above; with prefix_max[k], op k's result's
  // maximum is an output ([B, 1], after the others, in op order)
  std::vector<int> prefix;
  std::vector<uint8_t> prefix_max;
  int n_pre = 0;
  bool operator==(const SampleChain& o) const {
    return stages == o.stages && terminal == o.terminal && want_logprob == o.want_logprob && want_x == o.want_x &&
           want_probs == o.want_probs && edited == o.edited && want_top == o.want_top && want_raw == o.want_raw &&
           top_n == o.top_n && margin == o.margin && prefix == o.prefix && prefix_max == o.prefix_max &&
           n_pre == o.n_pre;
  }
  // the stages read another row than x's
  bool rewritten() const { return edited || !prefix.empty(); }
  // in = [x, each stage's operands after x as [B, 1] (top_k int32; xtc f32, f32, u64 seed, u32 position; others
  // f32), then (sample) seed u64 and position u32, then each prefix op's array, then (edited) ids int32 [B, H] and
  // values f32 [B, H]: the chain runs on the prefix ops below the edits applied to x, put_along(., ids, values)
  // (penalties' edits: a repeated id carries equal values) and the ops above, each row written into a scratch
  // row, not a [B, V] array]
  void operator()(std::vector<mx::array>& in, std::vector<mx::array>& out) const {
    const int64_t rows = in[0].shape(0), V = in[0].shape(1);
    constexpr int bs = 64;
    const int64_t nb = (V + bs - 1) / bs;
    const Rows<float> xs(in[0]);
    int32_t* token = out[0].data<int32_t>();
    float* logprob = out[1].data<float>();
    // (scratch kept by each thread from call to call: a row-sized buffer allocated anew each call is fresh pages,
    // which the kernel zeroes on first touch, ~0.1 ms a call at V = 152064)
    // a batch's rows in parts (split): each thread its own scratch
    split(rows, [&](int64_t r) {
      thread_local Scratch tls;
      one_row(r, V, nb, bs, xs, tls, in, out);
    });
    if (want_top) {       // the logits checks on the value at MLX's argmax (a NaN wins it, else a +inf)
      const size_t at = 2 + (want_x || want_probs);
      const float* top = out[at + 1].data<float>();
      bool *bad = out[at + 2].data<bool>(), *ninf = out[at + 3].data<bool>();
      for (int64_t r = 0; r < rows; ++r) {
        bad[r] = std::isnan(top[r]) || top[r] == INFINITY;
        ninf[r] = top[r] == -INFINITY;
      }
    }
  }

  struct Scratch {
    std::vector<float> buf, bm, ebuf, scratch, scratch_bm, raw_bm;
    std::vector<std::vector<float>> bias_bufs;
    std::vector<std::vector<uint8_t>> mask_bufs;
    std::vector<PrefixRow> ops;
    std::vector<float> op_max;
    std::vector<uint8_t> keep;
    std::vector<std::pair<float, int32_t>> cand, at_bound;
    std::vector<int32_t> order;
  };

  void one_row(int64_t r, int64_t V, int64_t nb, int bs, const Rows<float>& xs, Scratch& sc,
               std::vector<mx::array>& in, std::vector<mx::array>& out) const {
    int32_t* token = out[0].data<int32_t>();
    float* logprob = out[1].data<float>();
    auto& [buf, bm, ebuf, scratch, scratch_bm, raw_bm, bias_bufs, mask_bufs, ops, op_max, keep, cand, at_bound,
           order] = sc;
    bm.resize(nb);
    std::pair<float, double> raw_z{NAN, 0.0};       // (max, sum) the row's chain computed
    op_max.assign(prefix.size(), NAN);              // (prefix_max: each op's result's maximum)
    bool blocks_ready = false;                      // bm holds row.x's block maxima
    [&] {
      ChainRow row;
      row.x = xs.row(r, V, buf);
      // (want_top: MLX's argmax of the input row and the value there -- the logits checks' pass, shared; with
      // edits, of the row before them: its block maxima first, then those of the few blocks the edits touch)
      const size_t top_at = 2 + (want_x || want_probs);
      int32_t* top_pos = want_top ? out[top_at].data<int32_t>() + r : nullptr;
      float* top_val = want_top ? out[top_at + 1].data<float>() + r : nullptr;
      auto top_from_blocks = [&](const float* v) {
        const int64_t at = first_of_blocks(v, V, bm.data(), nb, bs, max_nan(bm.data(), nb));
        *top_pos = static_cast<int32_t>(at);
        *top_val = v[at];
      };
      if (rewritten()) {
        // the row the stages start from, written into scratch: the prefix ops below the edits, the edits put (each
        // id's value), the ops above -- MLX's where, add and put_along, the same floats. Span by span (a span's
        // operands stay in cache): the logits' own block maxima (their argmax, top_logprobs), each op, the result's
        // block maxima; an op's maximum its checks read is its span maxima's, or the row's from the block maxima
        scratch.resize(V);
        float* const sx = scratch.data();
        const size_t n_ops = prefix.size(), at_ops = in.size() - n_ops - (edited ? 2 : 0);
        ops.resize(n_ops);
        bias_bufs.resize(n_ops);
        mask_bufs.resize(n_ops);
        for (size_t k = 0; k < n_ops; ++k) {
          ops[k] = {prefix[k], prefix[k] == kPrefixMask
                                   ? static_cast<const void*>(Rows<uint8_t>(in[at_ops + k]).row(r, V, mask_bufs[k]))
                                   : static_cast<const void*>(Rows<float>(in[at_ops + k]).row(r, V, bias_bufs[k]))};
        }
        const bool raw_blocks = want_top || top_n > 0;
        if (raw_blocks) raw_bm.resize(nb);
        // ops [k0, k1) over the row from `from` into scratch (a copy where there is none); with `fuse`, op k1 too,
        // without its maximum; the result's block maxima into bm; op k's span maxima where prefix_max[k] and
        // `last_from_blocks` is not k (the last op of the row: its maximum is bm's)
        auto passes = [&](const float* from, size_t k0, size_t k1, bool fuse, bool raw, int64_t last_from_blocks) {
          const auto part = per_span<std::array<float, kMaxPrefix>>(V, [&](int64_t lo, int64_t hi) {
            std::array<float, kMaxPrefix> m;
            const int64_t n = hi - lo, b0 = lo / bs, nbs = (n + bs - 1) / bs;
            if (raw) block_max_row(row.x + lo, n, nbs, bs, raw_bm.data() + b0);
            const float* src = from + lo;
            // (the span's maximum of the op the block maxima read -- the last, where none is fused -- is theirs)
            auto wants_max = [&](size_t k) {
              return k < k1 && prefix_max[k] && static_cast<int64_t>(k) != last_from_blocks;
            };
            for (size_t k = k0; k < k1 + fuse; ++k, src = sx + lo) {
              prefix_pass(ops[k].from(lo), src, sx + lo, n);
              if (wants_max(k) && (fuse || k + 1 < k1)) m[k] = max_nan(sx + lo, n);
            }
            if (src != sx + lo) {           // (no op: a copy, whose block maxima are its source's)
              std::memcpy(sx + lo, src, n * sizeof(float));
              if (raw && src == row.x + lo) {
                std::memcpy(bm.data() + b0, raw_bm.data() + b0, nbs * sizeof(float));
                return m;
              }
            }
            block_max_row(sx + lo, n, nbs, bs, bm.data() + b0);
            if (!fuse && k1 > k0 && wants_max(k1 - 1)) m[k1 - 1] = max_nan(bm.data() + b0, nbs);
            return m;
          });
          for (size_t k = k0; k < k1; ++k) {
            if (!prefix_max[k] || static_cast<int64_t>(k) == last_from_blocks) continue;
            op_max[k] = max_of_parts(part.size(), [&part, k](size_t c) { return part[c][k]; });
          }
        };
        const int64_t last = static_cast<int64_t>(n_ops) - 1;
        if (!edited) {
          passes(row.x, 0, n_ops, false, raw_blocks, last);
          if (prefix_max[last]) op_max[last] = max_nan(bm.data(), nb);
        } else {
          const size_t below = static_cast<size_t>(n_pre);
          const bool fuse = below < n_ops;      // (the first op above the edits in the same pass: they get it too)
          passes(row.x, 0, below, fuse, raw_blocks, -1);
          const Rows<int32_t> ids(in[in.size() - 2]);
          const Rows<float> vals(in[in.size() - 1]);
          const int64_t h = in.back().shape(1);
          for (int64_t j = 0; j < h; ++j) {
            const int32_t id = ids(r, j);
            if (id >= 0 && id < V) sx[id] = fuse ? ops[below].at(id, vals(r, j)) : vals(r, j);
          }
          for (int64_t j = 0; j < h; ++j) {     // (the edited blocks' maxima again)
            const int32_t id = ids(r, j);
            if (id < 0 || id >= V) continue;
            const int64_t c = id / bs, lo = c * bs;
            block_max_row(sx + lo, std::min<int64_t>(V - lo, bs), 1, bs, bm.data() + c);
          }
          if (fuse && prefix_max[below]) op_max[below] = below + 1 < n_ops ? max_spans(sx, V) : max_nan(bm.data(), nb);
          if (below + 1 < n_ops) {
            passes(sx, below + 1, n_ops, false, false, last);
            if (prefix_max[last]) op_max[last] = max_nan(bm.data(), nb);
          }
        }
        blocks_ready = true;
        if (want_top) {             // (from the logits' own block maxima)
          std::swap(bm, raw_bm);
          top_from_blocks(row.x);
          std::swap(bm, raw_bm);
        }
        row.x = sx;
      }
      row.V = V;
      row.stages = &stages;
      row.terminal = terminal;
      row.want_logprob = want_logprob;
      row.x_out = want_x || want_probs ? out[2].data<float>() + r * V : nullptr;
      row.probs_out = want_probs;
      row.bm = &bm;
      row.nb = nb;
      row.zbuf = &ebuf;
      row.cand = &cand;
      row.at_bound = &at_bound;
      bool has_zero = false;
      size_t at = 1;
      for (int kind : stages) {
        StageArgs sa;
        const auto& a = in[at];
        sa.a = a.dtype() == mx::int32 ? double(Rows<int32_t>(a)(r, 0)) : double(Rows<float>(a)(r, 0));
        if (kind == kDynTemp) {
          sa.b = double(Rows<float>(in[at + 1])(r, 0));
          sa.c = double(Rows<float>(in[at + 2])(r, 0));
        }
        if (kind == kXtc) {
          sa.b = double(Rows<float>(in[at + 1])(r, 0));
          const uint64_t seed = Rows<uint64_t>(in[at + 2])(r, 0);
          sa.k0 = static_cast<uint32_t>(seed >> 32);
          sa.k1 = static_cast<uint32_t>(seed & 0xFFFFFFFFu);
          sa.pos = Rows<uint32_t>(in[at + 3])(r, 0);
        }
        has_zero |= kind == kTemperature && sa.a == 0.0;
        row.args.push_back(sa);
        at += stage_arity(kind);
      }
      row.k0 = row.k1 = row.pos = 0;
      if (terminal == kSample) {
        const uint64_t seed = Rows<uint64_t>(in[at])(r, 0);
        row.k0 = static_cast<uint32_t>(seed >> 32);
        row.k1 = static_cast<uint32_t>(seed & 0xFFFFFFFFu);
        row.pos = Rows<uint32_t>(in[at + 1])(r, 0);
      }
      if (greedy_row(row, token + r, blocks_ready ? bm.data() : nullptr, nb, bs)) {
        logprob[r] = 0.0f;
        if (want_top && !rewritten()) {
          *top_pos = static_cast<int32_t>(first_of(row.x, V, max_spans(row.x, V)));
          *top_val = row.x[*top_pos];
        }
        return;
      }
      if (!blocks_ready) block_max_spans(row.x, V, nb, bs, bm.data());
      blocks_ready = true;
      logprob[r] = 0.0f;
      if (want_top && !rewritten()) top_from_blocks(row.x);
      if (std::isnan(max_nan(bm.data(), nb))) {   // NaN logits: the program's checks report the row
        token[r] = 0;
        logprob[r] = NAN;
        if (row.x_out != nullptr) std::fill(row.x_out, row.x_out + V, NAN);
        return;
      }
      bool done = false;
      if (!(terminal == kSample && row_temps_only(row) && !has_zero)) {   // (temperatures alone, every other stage
                                            // at its off value: every token may win; straight to the row)
        // m blocks above the bound hold at least m tokens above it: a top_k(k) needs m >= k to end inside them
        int64_t first = 32;
        for (size_t s = 0; s < stages.size(); ++s) {
          const double k = row.args[s].a;
          if ((stages[s] == kTopK || stages[s] == kTopKRank) && k > 0 && k < static_cast<double>(V)) {
            first = std::max<int64_t>(first, std::min<int64_t>(static_cast<int64_t>(k) + 8, 512));
          }
        }
        const float top = max_nan(bm.data(), nb);
        for (int64_t m : {first, int64_t(512)}) {
          if (m >= nb || (m == 512 && first == 512)) break;
          if (nucleus_exceeds(row, m * bs, top)) continue;     // (no gather: m blocks cannot hold the nucleus)
          bool beyond = false;
          const float bound = chain_candidates(row, nb, bs, m, scratch_bm, false, &beyond);
          if (!beyond && (done = chain_run(row, bound, token + r, logprob + r))) break;
          if (cand.empty()) {
            // no candidate above the bound: the top is tied across more than m blocks (more blocks will not
            // help); the tokens at the bound join the candidates, the tail is what lies below it
            // (a leading top_p the tied top cannot fill -- its n tokens' mass is n -- goes to the whole row
            // without gathering them)
            if (bound > -INFINITY && tie_may_hold(row, bound) &&
                !nucleus_beyond(row, bound, [&](auto, float) { return double(count_equal(row.x, V, bound)); })) {
              const float below = chain_candidates(row, nb, bs, m, scratch_bm, true, &beyond);
              done = !beyond && chain_run(row, below, token + r, logprob + r);
            }
            break;
          }
          if (m == first && bound > -INFINITY && blocks_at(bm.data(), nb, bound) > 512 - m) {
            // the bound tied across more blocks than the next attempt adds (a tied row under a few biased or
            // penalized tokens): a larger m finds the same bound, so the tokens at it join the candidates now
            // (not a bound of -inf: a masked row's removed tokens are no candidates)
            const float below = chain_candidates(row, nb, bs, m, scratch_bm, true, &beyond);
            done = !beyond && chain_run(row, below, token + r, logprob + r);
            break;
          }
          // a top_p nucleus the first candidates held a small part of (a flat row) will not end in 16 times as
          // many blocks either: straight to the whole row, without the second attempt's gather and sort
          if (row.covered < 1.0 / 16) break;
        }
      }
      if (!done) chain_dense(row, nb, bs, token + r, logprob + r, ebuf, keep, order);
      if (want_raw && !rewritten() && row.z_divs.empty()) raw_z = {row.z_vmax, row.z};   // (see below)
    }();
    if (want_raw) {       // the logits' own normalizer and the token's log-probability under it (row_logsumexp's;
                          // a row whose chain summed exp(x - max x) for a leading top_p reuses that sum)
      const size_t at = 2 + (want_x || want_probs) + (want_top ? 4 : 0);
      const float* raw = xs.row(r, V, buf);
      const float m = want_top ? out[at - 3].data<float>()[r] : max_spans(raw, V);
      const double z = raw_z.first == m ? raw_z.second : std::isfinite(m) ? sum_exp_spans(raw, V, m) : 0.0;
      const float lz = std::isfinite(m) ? static_cast<float>(std::log(z)) : (m != m ? m : 0.0f);
      out[at].data<float>()[r] = m;
      out[at + 1].data<float>()[r] = lz;
      out[at + 2].data<float>()[r] = (raw[token[r]] - m) - lz;
      if (top_n > 0) {    // top_logprobs: from the raw row's block maxima (kept aside where edits or a bias
                          // changed the row's)
        // (edits or a bias: the logits' own maxima were kept aside; else bm is theirs, unless a greedy row
        // returned before making them)
        if (!rewritten() && !blocks_ready) block_max_spans(raw, V, nb, bs, bm.data());
        const float* rbm = rewritten() ? raw_bm.data() : bm.data();
        top_logprobs_of_blocks(raw, V, rbm, nb, bs, top_n, margin, m, lz,
                               out[at + 3].data<int32_t>() + r * top_n, out[at + 4].data<float>() + r * top_n);
      }
    }
    size_t at_max = out.size();      // the prefix ops' maxima (a NaN winning), last
    for (uint8_t w : prefix_max) at_max -= w;
    for (size_t k = 0; k < prefix.size(); ++k) {
      if (prefix_max[k]) out[at_max++].data<float>()[r] = op_max[k];
    }
  }
};

std::vector<mx::array> sample_chain(const mx::array& x, const std::vector<mx::array>& params,
                                    const std::vector<int>& stages, int terminal, bool want_logprob, bool want_x,
                                    bool want_probs, const std::vector<mx::array>& edits, bool want_top,
                                    bool want_raw, int top_n, int margin, const std::vector<int>& prefix,
                                    const std::vector<mx::array>& prefix_arrays, const std::vector<bool>& prefix_max,
                                    int n_pre) {
  need_rows(x, mx::float32, "sample_chain");
  size_t arity = terminal == kSample ? 2 : 0;
  for (int s : stages) {
    if (s < kTemperature || s > kTopKRank) throw std::invalid_argument("sample_chain: unknown stage code");
    arity += stage_arity(s);
  }
  if (params.size() != arity || (terminal != kGreedy && terminal != kSample)) {
    throw std::invalid_argument("sample_chain: each stage's operands, then seed and position for sample");
  }
  const int B = x.shape(0);
  std::vector<mx::array> ins{x};
  for (const auto& p : params) {
    if (!is_column(p, B)) throw std::invalid_argument("sample_chain: parameters must be [B, 1], [B], [1] or scalars");
    ins.push_back(p);
  }
  if (prefix.size() > kMaxPrefix) throw std::invalid_argument("sample_chain: at most 8 prefix ops");
  push_prefix(ins, prefix, prefix_arrays, x, "sample_chain");
  if (prefix_max.size() != prefix.size() || n_pre < 0 || static_cast<size_t>(n_pre) > prefix.size()) {
    throw std::invalid_argument("sample_chain: prefix_max one per prefix op, 0 <= n_pre <= their number");
  }
  push_edits(ins, edits, B, "sample_chain");
  std::vector<mx::Shape> shapes{{B, 1}, {B, 1}};
  std::vector<mx::Dtype> dtypes{mx::int32, mx::float32};
  if (want_x && want_probs) throw std::invalid_argument("sample_chain: the final logits or their softmax, not both");
  if (want_x || want_probs) {
    shapes.push_back({B, x.shape(1)});
    dtypes.push_back(mx::float32);
  }
  if (want_top) {
    shapes.push_back({B, 1});
    dtypes.push_back(mx::int32);
    shapes.push_back({B, 1});
    dtypes.push_back(mx::float32);
    shapes.push_back({B});                 // the logits checks' flags: NaN or +inf, every entry -inf
    dtypes.push_back(mx::bool_);
    shapes.push_back({B});
    dtypes.push_back(mx::bool_);
  }
  for (int i = 0; want_raw && i < 3; ++i) {
    shapes.push_back({B, 1});
    dtypes.push_back(mx::float32);
  }
  if (top_n < 0 || margin < 0 || (top_n > 0 && (!want_raw || top_n > x.shape(1)))) {
    throw std::invalid_argument("sample_chain: top_n needs want_raw and 0 <= top_n <= n, margin >= 0");
  }
  if (top_n > 0) {
    shapes.push_back({B, top_n});
    dtypes.push_back(mx::int32);
    shapes.push_back({B, top_n});
    dtypes.push_back(mx::float32);
  }
  for (bool w : prefix_max) {
    if (!w) continue;
    shapes.push_back({B, 1});
    dtypes.push_back(mx::float32);
  }
  return make(SampleChain{stages, terminal, want_logprob, want_x, want_probs, !edits.empty(), want_top, want_raw,
                          top_n, margin, prefix, std::vector<uint8_t>(prefix_max.begin(), prefix_max.end()), n_pre},
              shapes, dtypes, ins);
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "MLX CPU kernels for samplec";
  m.attr("chain_stages") = static_cast<int>(kTopKRank) + 1;   // the stage codes sample_chain knows: 0 .. chain_stages - 1
  m.def("threefry_bits", &threefry_bits, nb::arg("seed"), nb::arg("c0"), nb::arg("c1"),
        "First word of Threefry-2x32-20(key(seed), (c0, c1)): seed uint64, counters uint32 or int32 (their "
        "uint32 bits), each [B, C] or [B] (read as [B, 1]), broadcasting: one MLX primitive on the CPU.");
  m.def("block_max", &block_max, nb::arg("x"), nb::arg("block_size"));
  m.def("topk_select", &topk_select, nb::arg("x"), nb::arg("k"), nb::arg("gathers") = std::vector<mx::array>{},
        nb::arg("low") = false,
        "[positions of the k largest ascending, the (k+1)-th largest, (with low: the smallest of the k), then each "
        "gathered array at the positions].");
  m.def("argmax_take", &argmax_take, nb::arg("x"), nb::arg("gathers") = std::vector<mx::array>{},
        nb::arg("flat") = false, "[argmax [B, 1], then each gathered array there, [B, 1] or (flat) [B]].");
  m.def("sample_chain", &sample_chain, nb::arg("x"), nb::arg("params"), nb::arg("stages"), nb::arg("terminal"),
        nb::arg("want_logprob"), nb::arg("want_x") = false, nb::arg("want_probs") = false,
        nb::arg("edits") = std::vector<mx::array>{}, nb::arg("want_top") = false, nb::arg("want_raw") = false,
        nb::arg("top_n") = 0, nb::arg("margin") = 0, nb::arg("prefix") = std::vector<int>{},
        nb::arg("prefix_arrays") = std::vector<mx::array>{}, nb::arg("prefix_max") = std::vector<bool>{},
        nb::arg("n_pre") = 0,
        "The sampler chain (stage codes: 0 temperature, 1 top_k, 2 top_p, 3 min_p, 4 top_n_sigma, 5 typical_p, "
        "6 xtc, 7 epsilon, 8 eta; terminal 0 greedy, 1 sample) on each row of x: [token [B, 1], logprob [B, 1], (want_x) the final "
        "logits [B, V] or (want_probs) their softmax, (want_top) MLX's argmax of x and x there ([B, 1]) and the "
        "logits checks' flags there (NaN or +inf; -inf: [B] bool), (want_raw) x's max, log-sum-exp and the "
        "token's log-probability under softmax(x), each [B, 1], (top_n > 0, with want_raw) top_logprob_ids(x, max, "
        "log-sum-exp, top_n, margin): ids [B, top_n] and values [B, top_n], then for each prefix op with "
        "prefix_max its result's maximum [B, 1]]. `prefix` (codes: 0 a mask, 1 a bias) with `prefix_arrays` "
        "(bool or f32, [B, V] or [1, V]): allow and logit_bias ops in order, the first n_pre below the edits "
        "(penalty_edits read x through them), the others above.");
  m.def("penalty_edits", &penalty_edits, nb::arg("x"), nb::arg("hist"), nb::arg("last_n"), nb::arg("repeat"),
        nb::arg("frequency"), nb::arg("presence"), nb::arg("prior") = std::vector<mx::array>{},
        nb::arg("pre") = std::vector<int>{}, nb::arg("pre_arrays") = std::vector<mx::array>{},
        "penalties' edits: [ids [B, P + H] int32, penalized values [B, P + H] float32, overflow [B] bool] (the "
        "prior edits, P of them, then the window's ids, 0 where an entry does not count; the logits there "
        "penalized; whether one is +inf). `pre` (codes: 0 a mask, 1 a bias) with `pre_arrays`: ops the logits "
        "pass through first, in order (allow and logit_bias below the penalties).");
  m.def("edited_logsumexp", &edited_logsumexp, nb::arg("x"), nb::arg("ids"), nb::arg("vals"), nb::arg("idx"),
        "Log-probabilities at idx under put_along(x, ids, vals) and under x, then x's max and log-sum-exp.");
  m.def("history_check", &history_check, nb::arg("ids"), nb::arg("V"),
        "(ids with each id >= V replaced by -1, a flag [B] per row that held one): a history's input check.");
  m.def("dry_repeats", &dry_repeats, nb::arg("w"), nb::arg("x"),
        "DRY's repeat lengths: [B, V] int32, at each token the longest common suffix of the window before one of "
        "its positions and the whole window (-1: none), from the Z-algorithm over the reversed window.");
  m.def("argmax_put", &argmax_put, nb::arg("x"), nb::arg("ids"), nb::arg("vals"),
        "argmax of put_along(x, ids, vals) along the rows, without writing it: [B, 1] int32.");
  m.def("row_logsumexp", &row_logsumexp, nb::arg("x"),
        "[B, 2]: each row's maximum and the log of the sum of exp(x - maximum) (x 2-D float32).");
  m.def("top_logprob_ids", &top_logprob_ids, nb::arg("x"), nb::arg("m"), nb::arg("lz"), nb::arg("k"), nb::arg("margin"),
        "[ids [B, k] int32, values [B, k]]: the k largest (x - max) - log Z (m, lz: [B, 1]), descending, lower "
        "id first on ties; selected on x with `margin` more.");
  m.def("row_max", &row_max, nb::arg("x"), "[B, 1]: the maximum of each row of a 2-D float32 array (a NaN wins).");
  m.def("row_softmax", &row_softmax, nb::arg("x"),
        "softmax along the rows of a 2-D float32 array: exp(x - max) / sum, the exps vectorized, the sum in double.");
  m.def("hold", &hold, nb::arg("max_us"));
  m.def("wake", &wake, nb::arg("max_us"), "Open a hold and queue it (mx.async_eval(hold(max_us))).");
  m.def("evaluate", &evaluate, nb::arg("arrays"), nb::arg("spin_us"), nb::call_guard<nb::gil_scoped_release>(),
        "mx.async_eval(arrays), release(), then spin_wait(arrays, spin_us).");
  m.def("release", &release);
  m.def("helped", [] { return g_helped.load(); },
        "How many parts of the kernels' work waiting callers have run in this process (see `split`).");
  m.def("set_parts_wait", [](double us) { g_parts_wait_us.store(us); }, nb::arg("us"),
        "Tests: MLX's worker waits up to `us` for a waiting caller to take a kernel's first part (0: it does not).");
  m.def("spin_wait", &spin_wait, nb::arg("arrays"), nb::arg("spin_us"), nb::call_guard<nb::gil_scoped_release>());
}
