// The chain kernel's row: its stage codes (the stage table's), operands and state, and the passes its stages
// share (exps, sums, block candidates, the kept mask).
#pragma once

#include "rng.h"
#include "select.h"
#include "stage_table.h"

namespace {

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
// The codes of the stage table (samplec/stage_table.py, generated into stage_table.h): the stage list's
enum ChainStage {
  kTemperature = SAMPLEC_STAGE_TEMPERATURE, kTopK = SAMPLEC_STAGE_TOP_K, kTopP = SAMPLEC_STAGE_TOP_P,
  kMinP = SAMPLEC_STAGE_MIN_P, kTopNSigma = SAMPLEC_STAGE_TOP_N_SIGMA, kTypicalP = SAMPLEC_STAGE_TYPICAL_P,
  kXtc = SAMPLEC_STAGE_XTC, kEpsilon = SAMPLEC_STAGE_EPSILON, kEta = SAMPLEC_STAGE_ETA,
  kDynTemp = SAMPLEC_STAGE_DYNAMIC_TEMPERATURE, kTopKRank = SAMPLEC_STAGE_TOP_K_RANK
};
// ... and the terminal's
enum ChainTerminal { kGreedy = SAMPLEC_TERMINAL_GREEDY, kSample = SAMPLEC_TERMINAL_SAMPLE };

// The operands a stage takes after x (its values a, b, c, then xtc's seed and position)
inline int stage_arity(int kind) { return SAMPLEC_STAGE_OPERANDS(kind); }

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
    const int code = stages[s];
    if (code == kDynTemp) return 1.0;   // (its temperature comes from the kept set: no shortcut)
    if (SAMPLEC_STAGE_OFF(code, sa.a, sa.b, sa.c, static_cast<double>(row.V))) continue;
    if (code == kTemperature) {
      if (sa.a == 0.0) return 1.0;
      divs.push_back(static_cast<float>(sa.a));
      continue;
    }
    return code == kTopP ? static_cast<float>(sa.a) : 1.0;   // (another cut first: 1)
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

// Whether stage s of the row removes no token: a map (temperature), or a cut at its off value (the stage table's
// rule)
bool stage_off(const ChainRow& row, size_t s) {
  const StageArgs& sa = row.args[s];
  return SAMPLEC_STAGE_KEEPS_ALL((*row.stages)[s], sa.a, sa.b, sa.c, static_cast<double>(row.V));
}

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

}  // namespace
