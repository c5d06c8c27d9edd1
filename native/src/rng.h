// RandomBits (spec section 4): Threefry-2x32-20, scalar and sixteen lanes at once, its primitive, and the Gumbel-max
// draw over tokens.
#pragma once

#include "runtime.h"
#include "primitive.h"
#include "stage_table.h"

namespace {

// Threefry-2x32-20 (Random123), the generator of MLX's random::bits: its constants are the stage table's
// (stage_table.h), its rounds written once below for one counter (W = uint32_t) or eight lanes (W = U8v).
constexpr uint32_t kParity = SAMPLEC_THREEFRY_PARITY;
constexpr int kRotations[8] = {SAMPLEC_THREEFRY_ROTATIONS};

typedef uint32_t U8v __attribute__((vector_size(8 * sizeof(uint32_t))));

// One round on N independent states side by side, its rotation R a constant
template <int R, class W, int N>
__attribute__((always_inline)) inline void threefry_round(W (&x0)[N], W (&x1)[N]) {
  for (int n = 0; n < N; ++n) x0[n] += x1[n];
  for (int n = 0; n < N; ++n) x1[n] = ((x1[n] << R) | (x1[n] >> (32 - R))) ^ x0[n];
}

// Threefry-2x32-20 under key (k0, k1) for N counters (x0[n], x1[n]), in place: x0 becomes the first output word,
// x1 the second. W is uint32_t (one counter) or U8v (eight lanes, one AVX2 register); N > 1 runs independent
// chains of rounds side by side (more work in flight). The rounds are unrolled with constant rotations. (A
// sixteen-lane vector type cost GCC stack traffic on AVX2 for its broadcasts and key adds: two U8v instead.)
template <class W, int N>
__attribute__((always_inline)) inline void threefry(uint32_t k0, uint32_t k1, W (&x0)[N], W (&x1)[N]) {
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ kParity};
  for (int n = 0; n < N; ++n) x0[n] += k0, x1[n] += k1;
#pragma GCC unroll 5
  for (int i = 0; i < 5; ++i) {
    if (i % 2 == 0) {
      threefry_round<kRotations[0]>(x0, x1);
      threefry_round<kRotations[1]>(x0, x1);
      threefry_round<kRotations[2]>(x0, x1);
      threefry_round<kRotations[3]>(x0, x1);
    } else {
      threefry_round<kRotations[4]>(x0, x1);
      threefry_round<kRotations[5]>(x0, x1);
      threefry_round<kRotations[6]>(x0, x1);
      threefry_round<kRotations[7]>(x0, x1);
    }
    const uint32_t k_0 = ks[(i + 1) % 3], k_1 = ks[(i + 2) % 3] + static_cast<uint32_t>(i + 1);
    for (int n = 0; n < N; ++n) x0[n] += k_0, x1[n] += k_1;
  }
}

// Both output words for key (k0, k1) and counter (c0, c1): tests check them against spec section 4's known answers
inline void threefry_words(uint32_t k0, uint32_t k1, uint32_t c0, uint32_t c1, uint32_t out[2]) {
  uint32_t x0[1] = {c0}, x1[1] = {c1};
  threefry(k0, k1, x0, x1);
  out[0] = x0[0], out[1] = x1[0];
}

// The first output word for key (k0, k1) and counter (c0, c1): RandomBits
inline uint32_t threefry_first_word(uint32_t k0, uint32_t k1, uint32_t c0, uint32_t c1) {
  uint32_t x0[1] = {c0}, x1[1] = {c1};
  threefry(k0, k1, x0, x1);
  return x0[0];
}

// The first word for sixteen counters (a then b, eight each; c1 shared), in place
__attribute__((always_inline)) inline void threefry8x2(uint32_t k0, uint32_t k1, U8v& a, U8v& b, uint32_t c1) {
  U8v x0[2] = {a, b}, x1[2] = {U8v{} + c1, U8v{} + c1};
  threefry(k0, k1, x0, x1);
  a = x0[0];
  b = x0[1];
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

// -log(-log(u)) for the largest u the generator gives, ((2^23 - 1) + 0.5) * 2^-23, and a margin for rounding
constexpr float kGumbelMax = 16.6355323f + 1e-3f;
constexpr uint32_t kXtcCounter = SAMPLEC_XTC_COUNTER;   // the xtc coin's first counter word

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

// Both output words for key (k0, k1) and counter (c0, c1), then the first word again from each of the sixteen
// lanes of the vectorized path the draws use (threefry_ids): tests check all of them against spec section 4's
// known answers.
std::vector<uint32_t> threefry_words_checked(uint32_t k0, uint32_t k1, uint32_t c0, uint32_t c1) {
  uint32_t w[2], ids[16], bits[16];
  threefry_words(k0, k1, c0, c1, w);
  std::fill(ids, ids + 16, c0);
  threefry_ids(k0, k1, ids, 16, c1, bits);
  std::vector<uint32_t> out = {w[0], w[1]};
  out.insert(out.end(), bits, bits + 16);
  return out;
}

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

}  // namespace
