// Selections: block maxima, the k largest, top_logprobs' ids, argmax, radix selection by count and by mass.
#pragma once

#include "primitive.h"
#include "vector_math.h"

namespace {

// ---- candidate selection (the -O2 plan's first steps), each one primitive ------------------------------------
//
// Each class below is the C++ twin of one IR op's MLX kernel in samplec/backend_mlx/kernels.py, with the same
// results (tests/test_native.py compares them): inputs are made row contiguous by the Python side.

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

}  // namespace
