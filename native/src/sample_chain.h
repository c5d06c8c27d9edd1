// The chain as one MLX primitive (sample_chain): rows split between MLX's worker and a waiting caller.
#pragma once

#include "chain.h"
#include "edits.h"
#include "row_ops.h"

namespace {

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
    if (s < 0 || s >= SAMPLEC_STAGE_COUNT) throw std::invalid_argument("sample_chain: unknown stage code");
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
