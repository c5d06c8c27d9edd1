// The chain's stages, each written once: its rule on the candidates (chain_run: the sorted tokens above a block
// bound, with the tail below it still alive or not) beside its rule on the whole row (chain_dense: a kept mask
// and radix selections). One dispatch serves both (apply_stage), and it applies the stage table's off rule
// (stage_table.h) before any stage runs: a stage at its off value is never entered.
#pragma once

#include "chain_row.h"

namespace {

// What a stage's rule on the candidates found: the stage is done (the next one runs), or the candidates cannot
// decide the row (its tail may matter) and the whole row runs instead.
enum Step { kNext, kWholeRow };

// chain_run's state: the candidates c[0 .. L) (sorted, descending) and what is known of the tail below them.
struct CandRow {
  ChainRow& row;
  std::vector<std::pair<float, int32_t>>& c;
  int64_t L;
  bool tail = true;                 // the tokens <= bound are still in the kept set
  bool floored = false;             // ... those of them at or above a min_p floor (see min_p)
  float fb;                         // the bound under the temperatures applied so far
  bool reaches(float v) const { return tail && fb >= v; }   // may a tail token be >= v
};

// chain_dense's state: the kept mask over the row and the current values. The mask starts as every finite token,
// written by the first pass that needs it (a first cut at a floor above -inf writes it in its own pass); the cut
// passes count the kept tokens per span as they go.
struct DenseRow {
  ChainRow& row;
  std::vector<float>& buf;           // exp(fx - max) over the kept tokens where probs() made them
  std::vector<uint8_t>& keep;
  std::vector<float>& fxbuf;         // the current values where a temperature wrote them
  std::vector<uint32_t>& keys;       // (radix selections' scratch)
  std::vector<double>& wd;
  const float* x;
  int64_t V;
  bool lazy = true;                  // keep not written yet: every finite token kept
  std::vector<int64_t> span_kept;
  bool counted = false;              // span_kept holds the kept counts
  const float* fx;                   // the current values: x with the temperatures applied so far
  float fmax;                        // the largest kept current value (cuts keep it; xtc may remove it)
  bool pristine = true;              // every finite token kept, buf untouched since full_z (if it ran)
  bool buf_from_z = false;           // probs() are full_z's exps (see ChainRow::md)
  float last_t = 1.0f;               // a temperature that is the last stage: applied where values are read
  bool last_stage = false;           // the stage being applied is the chain's last

  DenseRow(ChainRow& r, float top, std::vector<float>& b, std::vector<uint8_t>& k, std::vector<float>& fb,
           std::vector<uint32_t>& ky, std::vector<double>& w)
      : row(r), buf(b), keep(k), fxbuf(fb), keys(ky), wd(w), x(r.x), V(r.V), span_kept(spans(r.V), 0), fx(r.x),
        fmax(top) {
    keep.resize(V);
  }
  void materialize() {
    if (!lazy) return;
    each_span(V, [&](int64_t lo, int64_t hi) { keep_finite(keep.data() + lo, x + lo, hi - lo); });
    lazy = false;
  }
  void recompute_max() {
    float m = -INFINITY;
    for (int64_t i = 0; i < V; ++i) {
      if (keep[i] && fx[i] > m) m = fx[i];
    }
    fmax = m;
  }
  double probs() {                   // buf = exp(fx - max) over the kept tokens (0 elsewhere); their sum
    if (pristine && row.z_in_buf && row.zbuf == &buf && row.z_divs == row.divs && row.z_vmax == fmax) {
      pristine = false;
      buf_from_z = true;
      return row.z;                  // (full_z left exactly these in buf)
    }
    buf_from_z = false;
    pristine = false;
    buf.resize(V);
    return sum_spans(V, [&](int64_t lo, int64_t hi) {
      return exp_kept(buf.data() + lo, lazy ? nullptr : keep.data() + lo, fx + lo, hi - lo, 1.0f, fmax);
    });
  }
  // keep[i] &= v[i] >= floor, where a -inf token's v is `removed` (-inf in fx, 0 in the exps)
  void keep_from(const float* v, float floor, float removed) {
    const bool assign = lazy && floor > removed;        // (the first cut writes the mask: -inf tokens fail it)
    if (!assign) materialize();
    each_span(V, [&](int64_t lo, int64_t hi) {
      span_kept[lo / kSpan] = keep_at_least(keep.data() + lo, v + lo, hi - lo, floor, assign);
    });
    lazy = false;
    counted = true;
  }
  void touch() {                     // before a stage that reads or writes the mask element by element
    materialize();
    counted = false;
  }
  float val(int64_t i) const { return divided(fx[i], last_t); }   // token i's current value (divide_by's float)
};

// ---- temperature(t) and dynamic_temperature(t, range, exponent): x / t (the dynamic one's t from the kept set's
// entropy); t = 0, or a t the largest value overflows under, keeps the argmax alone

Step temperature(CandRow& cr, const StageArgs& sa, int code) {
  auto& row = cr.row;
  auto& c = cr.c;
  int64_t& L = cr.L;
  bool& tail = cr.tail;
  bool& floored = cr.floored;
  float& fb = cr.fb;
  auto reaches = [&cr](float v) { return cr.reaches(v); };
  const double a = sa.a;
  float t = static_cast<float>(a);
  if (code == kDynTemp && static_cast<float>(sa.b) != 0.0f) {
    // llama.cpp temp_ext: temperature(T), T from the kept set's entropy -- the candidates', or the whole
    // row's while the tail lives (its finite tokens: no cut has ended yet); n <= 1 kept: nothing changes
    if (tail && floored) return kWholeRow;
    const float vmax = c[0].first;
    double n = 0.0, z = 0.0, pd = 0.0;
    if (!tail) {
      thread_local std::vector<float> dv_tls, de_tls;
      auto &dv = dv_tls, &de = de_tls;
      for (int64_t i = 0; i < L; ++i) n += c[i].first > -INFINITY;
      if (n <= 1.0) return kNext;
      z = candidate_exps(c, L, vmax, dv, de);
      pd = typical_mean(de.data(), dv.data(), L, static_cast<float>(z), vmax);
    } else {
      const float* fx = current_values(row);
      n = sum_spans(row.V, [&](int64_t lo, int64_t hi) {
        return static_cast<double>(count_finite(nullptr, fx + lo, hi - lo));
      });
      if (n <= 1.0) return kNext;
      std::tie(z, pd) = row_entropy_parts(row, vmax);
    }
    t = dyn_temperature(sa, n, z, pd);
  }
  if (SAMPLEC_OFF_TEMPERATURE(t)) return kNext;   // (the dynamic one's T)
  // t = 0, or the top divided by t leaves the float32 range: the argmax alone (lowest id among equals)
  if (t == 0.0f || !std::isfinite(c[0].first / t)) {
    if (reaches(c[0].first)) return kWholeRow;
    int64_t best = 0;
    for (int64_t i = 1; i < L && c[i].first == c[0].first; ++i) {
      if (c[i].second < c[best].second) best = i;
    }
    std::swap(c[0], c[best]);
    L = 1;
    tail = false;
    return kNext;
  }
  for (int64_t i = 0; i < L; ++i) c[i].first = c[i].first / t;   // (candidates are finite)
  if (tail) {
    fb = fb / t;
    row.divs.push_back(t);
  }
  return kNext;
}

Step temperature(DenseRow& d, const StageArgs& sa, int code) {
  auto& row = d.row;
  const int64_t V = d.V;
  auto& keep = d.keep;
  auto& buf = d.buf;
  const float*& fx = d.fx;
  float& fmax = d.fmax;
  bool& lazy = d.lazy;
  bool& pristine = d.pristine;
  auto& fxbuf = d.fxbuf;
  float& last_t = d.last_t;
  const double a = sa.a;
  float t = static_cast<float>(a);
  if (code == kDynTemp && static_cast<float>(sa.b) != 0.0f) {
    // temperature(T), T from the kept tokens' count and entropy (their exps: d.probs())
    const double n = sum_spans(V, [&](int64_t lo, int64_t hi) {
      return static_cast<double>(count_finite(lazy ? nullptr : keep.data() + lo, fx + lo, hi - lo));
    });
    if (n <= 1.0) return kNext;
    const double z = d.probs();
    const float zf = static_cast<float>(z);
    t = dyn_temperature(sa, n, z, sum_spans(V, [&](int64_t lo, int64_t hi) {
                          return typical_mean(buf.data() + lo, fx + lo, hi - lo, zf, fmax);
                        }));
  }
  if (SAMPLEC_OFF_TEMPERATURE(t)) return kNext;   // (the dynamic one's T)
  if (t == 0.0f || !std::isfinite(fmax / t)) {     // (the limit: see chain_run)
    pristine = false;
    d.touch();
    bool found = false;
    for (int64_t i = 0; i < V; ++i) {
      const bool win = !found && keep[i] && fx[i] == fmax;
      found |= win;
      keep[i] = win;
    }
    return kNext;
  }
  fmax = fmax == -INFINITY ? fmax : fmax / t;
  row.divs.push_back(t);
  if (d.last_stage) {   // the last stage: the draw and the outputs divide the values they read
    last_t = t;
    return kNext;
  }
  fxbuf.resize(V);
  const float* from = fx;
  each_span(V, [&](int64_t lo, int64_t hi) { divide_by(fxbuf.data() + lo, from + lo, hi - lo, t); });
  fx = fxbuf.data();
  return kNext;
}

// ---- top_k(k): keep x >= the k-th largest; top_k_rank(k): the k largest by rank (the lowest ids first among the
// values equal to the k-th)

Step top_k(CandRow& cr, const StageArgs& sa, int code) {
  auto& c = cr.c;
  int64_t& L = cr.L;
  bool& tail = cr.tail;
  auto reaches = [&cr](float v) { return cr.reaches(v); };
  const double a = sa.a;
  const int64_t k = static_cast<int64_t>(a);
  if (k > L) {
    if (tail) return kWholeRow;         // the k-th largest lies below the bound
    return kNext;                          // fewer than k tokens left: all stay
  }
  const float vk = c[k - 1].first;
  if (reaches(vk)) return kWholeRow;
  int64_t i1 = k;                   // (past the values equal to the k-th)
  while (i1 < L && c[i1].first >= vk) ++i1;
  if (code == kTopKRank) {
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
  return kNext;
}

Step top_k(DenseRow& d, const StageArgs& sa, int code) {
  const int64_t V = d.V;
  auto& keep = d.keep;
  const float*& fx = d.fx;
  bool& pristine = d.pristine;
  auto& keys = d.keys;
  const double a = sa.a;
  const int64_t k = static_cast<int64_t>(a);
  d.materialize();
  keys.resize(V);
  size_t n = 0;
  for (int64_t i = 0; i < V; ++i) {
    keys[n] = order_key(fx[i]);
    n += keep[i];
  }
  keys.resize(n);
  if (k >= static_cast<int64_t>(keys.size())) return kNext;
  std::vector<int64_t> unit;
  const float vk = key_value(radix_select(keys, unit, k));
  d.keep_from(fx, vk, -INFINITY);
  pristine = false;
  if (code == kTopKRank) {         // the values at the k-th: as many as the k places leave, lowest ids first
    d.touch();
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
  return kNext;
}

// ---- min_p(m): keep x >= max + ln m

Step min_p(CandRow& cr, const StageArgs& sa) {
  auto& c = cr.c;
  int64_t& L = cr.L;
  bool& tail = cr.tail;
  bool& floored = cr.floored;
  auto reaches = [&cr](float v) { return cr.reaches(v); };
  const double a = sa.a;
  const float m = static_cast<float>(a);
  const float floor = c[0].first + std::log(m);
  if (reaches(floor)) {
    // every candidate stays, and so do the tail's tokens at or above the floor: the tail lives on, no
    // longer every token below the bound (`floored`) -- a later cut by count or a draw can still end
    // above the bound, what needs the tail's mass falls back to the whole row
    floored = true;
    return kNext;
  }
  int64_t n = 1;
  while (n < L && c[n].first >= floor) ++n;
  L = n;
  tail = false;
  return kNext;
}

Step min_p(DenseRow& d, const StageArgs& sa) {
  const float*& fx = d.fx;
  float& fmax = d.fmax;
  bool& pristine = d.pristine;
  const double a = sa.a;
  const float m = static_cast<float>(a);
  const float floor = fmax + std::log(m);
  d.keep_from(fx, floor, -INFINITY);
  pristine = false;
  return kNext;
}

// ---- top_p(p): keep i iff the mass strictly above p_i is below p

Step top_p(CandRow& cr, const StageArgs& sa) {
  auto& row = cr.row;
  auto& c = cr.c;
  int64_t& L = cr.L;
  bool& tail = cr.tail;
  bool& floored = cr.floored;
  float& fb = cr.fb;
  const double a = sa.a;
  const float p = static_cast<float>(a);
  if (tail && floored) return kWholeRow;
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
      return kNext;
    }
    if (tail) {
      row.covered = before / need;  // (how much of the nucleus the candidates held: see the retry)
      return kWholeRow;
    }
    return kNext;
  }
  L = n;
  tail = false;
  return kNext;
}

Step top_p(DenseRow& d, const StageArgs& sa) {
  const int64_t V = d.V;
  auto& buf = d.buf;
  auto& keys = d.keys;
  auto& wd = d.wd;
  const double a = sa.a;
  const float p = static_cast<float>(a);
  const double z = d.probs();
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
  d.keep_from(buf.data(), e_min, 0.0f);
  return kNext;
}

// ---- top_n_sigma(n): keep x >= max - n * std over the kept tokens

Step top_n_sigma(CandRow& cr, const StageArgs& sa) {
  auto& row = cr.row;
  auto& c = cr.c;
  int64_t& L = cr.L;
  bool& tail = cr.tail;
  bool& floored = cr.floored;
  auto reaches = [&cr](float v) { return cr.reaches(v); };
  const double a = sa.a;
  const float nsig = static_cast<float>(a);
  if (tail) {
    // the moments of the whole row: every finite token is still kept (no cut has ended yet; a min_p floor
    // inside the tail would leave a part of it -- the whole-row path). The cut ends among the candidates
    // where its floor lies above the bound.
    if (floored) return kWholeRow;
    const float floor = sigma_floor(nullptr, current_values(row), row.V, c[0].first, nsig);
    if (reaches(floor)) return kWholeRow;
    int64_t n = 1;
    while (n < L && c[n].first >= floor) ++n;
    L = n;
    tail = false;
    return kNext;
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
  return kNext;
}

Step top_n_sigma(DenseRow& d, const StageArgs& sa) {
  const int64_t V = d.V;
  auto& keep = d.keep;
  const float*& fx = d.fx;
  float& fmax = d.fmax;
  bool& lazy = d.lazy;
  bool& pristine = d.pristine;
  const double a = sa.a;
  const float nsig = static_cast<float>(a);
  d.keep_from(fx, sigma_floor(lazy ? nullptr : keep.data(), fx, V, fmax, nsig), -INFINITY);
  pristine = false;
  return kNext;
}

// ---- typical_p(m): keep the scores |-log p - H| up to where their ascending mass reaches m

Step typical_p(CandRow& cr, const StageArgs& sa) {
  auto& row = cr.row;
  auto& c = cr.c;
  int64_t& L = cr.L;
  bool& tail = cr.tail;
  bool& floored = cr.floored;
  float& fb = cr.fb;
  const double a = sa.a;
  if (tail && floored) return kWholeRow;
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
    if (candidates < a * z) return kWholeRow;
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
    if (!(fb - vmax < md)) return kWholeRow;
    limit = md - (fb - vmax);
  }
  // (the walk stops at the limit: only scores below it are sorted -- a tied top above it, none)
  order.clear();
  for (int64_t i = 0; i < L; ++i) {
    ts[i] = std::fabs(md - (tv[i] - vmax));
    if (te[i] > 0.0f && ts[i] < limit) order.push_back(static_cast<int32_t>(i));
  }
  if (tail && order.empty()) return kWholeRow;
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
  if (tail && !reached) return kWholeRow;
  int64_t n = 0;
  for (int64_t i = 0; i < L; ++i) {
    if ((te[i] > 0.0f && ts[i] <= cut) || tv[i] == vmax) c[n++] = c[i];
  }
  L = n;
  tail = false;
  return kNext;
}

Step typical_p(DenseRow& d, const StageArgs& sa) {
  auto& row = d.row;
  const int64_t V = d.V;
  auto& keep = d.keep;
  auto& buf = d.buf;
  const float*& fx = d.fx;
  float& fmax = d.fmax;
  bool& buf_from_z = d.buf_from_z;
  auto& keys = d.keys;
  auto& wd = d.wd;
  const double a = sa.a;
  // score = |mean(d) - d_i| with d = x - max (-log p_i - H with log Z cancelled), over the live tokens
  const double z = d.probs();
  d.touch();
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
  return kNext;
}

// ---- epsilon(e): keep p >= e; eta(e): keep p >= min(e, sqrt(e) exp(-H)); both keep every token at the maximum

Step epsilon_eta(CandRow& cr, const StageArgs& sa, int code) {
  auto& row = cr.row;
  auto& c = cr.c;
  int64_t& L = cr.L;
  bool& tail = cr.tail;
  bool& floored = cr.floored;
  float& fb = cr.fb;
  const double a = sa.a;
  const float e = static_cast<float>(a);
  if (tail && floored) return kWholeRow;
  // p = exp(v - max) / z over the kept set, each exp chain_dense's (the same vectorized exp, the same floats);
  // the kept candidates are a prefix (p falls with v), and the tail is out where its largest p is below the
  // floor
  const float vmax = c[0].first;
  thread_local std::vector<float> ev_tls, ee_tls;
  auto &ev = ev_tls, &ee = ee_tls;
  double z = candidate_exps(c, L, vmax, ev, ee), pd = 0.0;
  if (!tail) {
    if (code == kEta) pd = typical_mean(ee.data(), ev.data(), L, static_cast<float>(z), vmax);
  } else if (code == kEpsilon) {
    z = full_z(row, vmax);
  } else {
    std::tie(z, pd) = row_entropy_parts(row, vmax);     // (the whole row's entropy)
  }
  const float zf = static_cast<float>(z);
  const float cut = code == kEta ? eta_cut(e, z, pd) : e;
  if (tail) {
    float top_tail;
    exp_kept(&top_tail, nullptr, &fb, 1, 1.0f, vmax);
    // (a tail token at the maximum stays whatever its p: a temperature of inf makes every value 0)
    if (fb > -INFINITY && (fb == vmax || !(top_tail / zf < cut))) return kWholeRow;
  }
  int64_t n = 1;
  while (n < L && ee[n] / zf >= cut) ++n;
  while (n < L && c[n].first == vmax) ++n;
  L = n;
  tail = false;
  return kNext;
}

Step epsilon_eta(DenseRow& d, const StageArgs& sa, int code) {
  const int64_t V = d.V;
  auto& keep = d.keep;
  auto& buf = d.buf;
  const float*& fx = d.fx;
  float& fmax = d.fmax;
  const double a = sa.a;
  const float e = static_cast<float>(a);
  // p = the kept tokens' exp over their sum; eta's floor from their entropy (log z - sum p d)
  const double z = d.probs();
  const float zf = static_cast<float>(z);
  float cut = e;
  if (code == kEta) {
    cut = eta_cut(e, z, sum_spans(V, [&](int64_t lo, int64_t hi) {
      return typical_mean(buf.data() + lo, fx + lo, hi - lo, zf, fmax);
    }));
  }
  d.touch();
  each_span(V, [&](int64_t lo, int64_t hi) {
    keep_prob_at_least(keep.data() + lo, buf.data() + lo, fx + lo, hi - lo, zf, cut, fmax);
  });
  return kNext;
}

// ---- xtc(threshold, probability): with chance probability, of two or more tokens with p >= threshold remove all
// but the least probable

Step xtc(CandRow& cr, const StageArgs& sa) {
  auto& c = cr.c;
  int64_t& L = cr.L;
  bool& tail = cr.tail;
  const double a = sa.a;
  if (!(uniform_of(threefry_first_word(sa.k0, sa.k1, kXtcCounter, sa.pos)) < static_cast<float>(sa.b))) return kNext;
  if (tail) return kWholeRow;           // the coin fires while the tail lives: the whole row
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
  if (n_top < 2) return kNext;
  int64_t n = 0;
  for (int64_t i = 0; i < L; ++i) {
    if (i == surv || !top(i)) c[n++] = c[i];
  }
  L = n;
  return kNext;
}

Step xtc(DenseRow& d, const StageArgs& sa) {
  const int64_t V = d.V;
  auto& keep = d.keep;
  auto& buf = d.buf;
  const double a = sa.a;
  if (!(uniform_of(threefry_first_word(sa.k0, sa.k1, kXtcCounter, sa.pos)) < static_cast<float>(sa.b))) return kNext;
  const double z = d.probs();
  d.touch();
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
  if (n_top < 2) return kNext;
  for (int64_t i = 0; i < V; ++i) {
    if (keep[i] && buf[i] / zf >= thr && i != survivor) keep[i] = 0;
  }
  d.recompute_max();
  return kNext;
}

// Stage `code` (the stage table's) with its operands sa on either state: nothing where the table's off rule
// holds, else the stage's rule.
template <class State>
Step apply_stage(State& st, int code, const StageArgs& sa, int64_t V) {
  if (SAMPLEC_STAGE_OFF(code, sa.a, sa.b, sa.c, V)) return kNext;
  switch (code) {
    case kTemperature:
    case kDynTemp: return temperature(st, sa, code);
    case kTopK:
    case kTopKRank: return top_k(st, sa, code);
    case kTopP: return top_p(st, sa);
    case kMinP: return min_p(st, sa);
    case kTopNSigma: return top_n_sigma(st, sa);
    case kTypicalP: return typical_p(st, sa);
    case kXtc: return xtc(st, sa);
    case kEpsilon:
    case kEta: return epsilon_eta(st, sa, code);
  }
  return kNext;
}

}  // namespace
