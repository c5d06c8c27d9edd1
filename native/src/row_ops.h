// Row primitives over the vector math: log-sum-exp, maximum, softmax, the edited log-sum-exp.
#pragma once

#include "primitive.h"
#include "vector_math.h"

namespace {

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

}  // namespace
