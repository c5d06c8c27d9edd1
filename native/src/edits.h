// Edits of a row before the chain: DRY's repeat lengths, prefix ops (allow, logit_bias), penalties as edits, the
// history check.
#pragma once

#include "select.h"
#include "stage_table.h"

namespace {

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
constexpr int kPrefixMask = SAMPLEC_EDIT_ALLOW, kPrefixBias = SAMPLEC_EDIT_LOGIT_BIAS;   // (the stage table's codes)
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

}  // namespace
