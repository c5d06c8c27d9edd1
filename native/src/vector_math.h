// Vector math over a row: maxima eight lanes at a time, block maxima, exp and softmax passes.
#pragma once

#include "runtime.h"

namespace {

inline bool greater_nan(float a, float b) {  // a > b, NaN above everything (it must win a maximum)
  return a > b || (std::isnan(a) && !std::isnan(b));
}

// The vectorized maxima below keep 16 running maxima (`x > m ? x : m`: vmaxps) in two 8-float vectors (AVX2 and
// AVX-512 registers) and, beside them, running sums as a NaN probe: a NaN among the values leaves its lane's sum
// NaN. A NaN probe (also reached by +inf meeting -inf, or by overflow) sends the values through the exact scalar
// loop, so the result is always MLX's: a NaN wins. Comparisons and selects (`?:`) stay at eight lanes in the hot
// loops: GCC splits sixteen-lane arithmetic into two AVX2 registers but lowers a sixteen-lane comparison or `?:`
// lane by lane through the stack (block_max_row was ten times slower so).
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

}  // namespace
