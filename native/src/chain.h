// The sampler chain per row: on the candidates above a block bound (chain_run), else on the whole row
// (chain_dense), and the rows a chain leaves to an argmax (greedy_row).
#pragma once

#include "stages.h"

namespace {

bool chain_run(ChainRow& row, float bound, int32_t* token, float* logprob) {
  row.divs.clear();
  if (row.cand->empty()) return false;
  CandRow cr{row, *row.cand, static_cast<int64_t>(row.cand->size())};
  cr.fb = bound;
  const auto& stages = *row.stages;
  for (size_t s = 0; s < stages.size(); ++s) {
    if (apply_stage(cr, stages[s], row.args[s], row.V) == kWholeRow) return false;
  }
  auto& c = cr.c;
  const int64_t L = cr.L;
  const bool tail = cr.tail, floored = cr.floored;
  const float fb = cr.fb;
  auto reaches = [&cr](float v) { return cr.reaches(v); };
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

void chain_dense(ChainRow& row, int64_t nb, int bs, int32_t* token, float* logprob, std::vector<float>& buf,
                 std::vector<uint8_t>& keep, std::vector<int32_t>& order) {
  row.divs.clear();
  thread_local std::vector<float> fxbuf_tls;
  thread_local std::vector<uint32_t> keys_tls;
  thread_local std::vector<double> wd_tls;
  DenseRow d(row, max_nan(row.bm->data(), nb), buf, keep, fxbuf_tls, keys_tls, wd_tls);
  const auto& stages = *row.stages;
  for (size_t s = 0; s < stages.size(); ++s) {
    d.last_stage = s + 1 == stages.size();
    apply_stage(d, stages[s], row.args[s], row.V);
  }
  const int64_t V = row.V, ns = spans(V);
  const float* fx = d.fx;
  const float fmax = d.fmax, last_t = d.last_t;
  auto& span_kept = d.span_kept;
  auto val = [&d](int64_t i) { return d.val(i); };
  int64_t at = -1;
  int64_t compact = -1;               // the draw's kept tokens compacted: their count (ids in order, values kept_vals)
  thread_local std::vector<float> kept_vals_tls;
  auto& kept_vals = kept_vals_tls;
  d.materialize();
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
    if (!d.counted) {
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
    } else if (stages[s] == kXtc && !SAMPLEC_OFF_XTC(sa.b) &&
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
    if (SAMPLEC_OFF_TEMPERATURE(row.args[s].a)) continue;
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
      if (stages[s] == kTemperature && t != 0.0f && !SAMPLEC_OFF_TEMPERATURE(t) && std::isfinite(v / t)) v = v / t;
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

}  // namespace
