// samplec's sampler chain as one GPU block (a CUDA block, a Metal threadgroup) per row, or in split mode several:
// one SIMT source for CUDA and Metal. It is written over a thin dialect layer -- simt_cuda.h or simt_metal.h,
// which gpu.chain_header() puts before it, after the generated stage table (stage_table.h: the stage codes, off
// rules and Threefry constants) -- and names nothing of either language directly:
//   SC_FN, SC_INLINE             a device function, an inlined one
//   SC_DEV, SC_TG, SC_THR        address spaces: device (global) memory, threadgroup (shared) memory, a thread's own
//   sc_barrier, sc_device_fence  the block's barrier (sc_barrier_device: its device writes too); the fence before
//                                a block's arrival counts (split mode)
//   sc_shfl_xor, sc_shfl_up      a warp's (simdgroup's: 32 lanes) shuffles
//   sc_atomic_add_shared/_global atomics on threadgroup and device memory
//   sc_exp, sc_log, sc_div, ...  float math as the dense definitions round it; sc_f2u, sc_u2f, ... bit casts
// The thread's index in its block (`tx`) is a parameter of every function that needs it (Metal has no global thread
// index), and a pass over the tokens is the SC_EACH macro with its body inline (Metal has no lambdas).
// gpu.chain_entry(dialect) writes each language's kernel body (its parameters, its indices, the block's shared
// state) around sc_chain.
//
// A row's state after any prefix of the chain's stages is kept small: every cut these stages make keeps an upper
// set of the current logits, and the current logits are the raw ones through non-decreasing maps (divisions by
// positive temperatures), so the kept tokens are those with raw >= rho -- minus, after an xtc that fired, the
// tokens at raw >= sigma other than its survivor, after a typical_p, the tokens between its band and the row's
// maximum (raw in [glo, ghi), one such band a typical_p), after a top_k_rank, its ties at the k-th beyond the
// lowest ids -- and a kept token's current logit is its raw one divided by the
// temperatures seen so far, in order. Each stage turns a threshold on the current logits (or probabilities) into
// a new rho with one pass over the row; thresholds come from selections without sorting: a 4-bit radix select over
// the float32 values' order-preserving keys, by count (top_k) or by probability mass (top_p), its per-bin sums kept
// in registers and added in a fixed order, so a row's result does not depend on thread timing. Temperature 0 (or a
// temperature that overflows the row's maximum) keeps the argmax alone: the row is then decided.
//
// Semantics are spec section 2's dense definitions (samplec/frontend/expand.py) evaluated in float32, each
// division and subtraction rounded as the definitions round them; sums are added in another order than MLX's
// reductions, so a threshold can move only where a row sits within float rounding of a boundary (spec section 4:
// "up to float rounding at exact ties").
//
// tests/test_gpu_chain.py runs this file on the CPU in both dialects, through a thread-per-GPU-thread emulation of
// each dialect's primitives (tests/simt_emulation.h, cuda_emulation.h, metal_emulation.h), against the dense
// definitions; tests/test_cuda_compile.py compiles the CUDA dialect with NVRTC; tests/test_gpu.py runs it on a CUDA
// GPU. SC_T (threads a block, a multiple of 32) and SC_CAP (candidates in shared memory) are the dialect's.

#define SC_WARPS (SC_T / 32)
#define SC_MAX_TEMPS 8
#define SC_FSLOTS 10       // float operand slots (gpu.CHAIN_FLOAT_SLOTS), key slots (gpu.CHAIN_KEY_SLOTS)
#define SC_KSLOTS 2
#define SC_INF sc_i2f(0x7f800000)   // (no headers under NVRTC or Metal)
#define SC_NAN sc_i2f(0x7fc00000)
#define SC_R 4             // split mode: the largest logits each thread keeps of its tokens in a slice
#define SC_MAXNB 128       // split mode: slices a row at most (gpu.MAX_SLICES)
#define SC_WH 12           // split mode: a slice's header in the scratch (gpu.SLICE_HEADER)

#define SC_MAX_BANDS 4      // typical_p stages a chain (gpu.MAX_TYPICAL): each removes one range of raw logits

struct ScRow {
  float rho;               // kept: raw >= rho ...
  float sigma;             // ... and (raw < sigma or id == surv)
  float glo[SC_MAX_BANDS], ghi[SC_MAX_BANDS];   // ... and not glo[b] <= raw < ghi[b] for any of the nband bands
  int nband;
  float tlo, thi;          // ... and not (tlo <= raw <= thi and id > tid): top_k_rank's ties at its k-th
  int tid;
  int surv;
  float mraw;              // the largest kept raw logit (its current value is the row's maximum)
  int greedy;              // >= 0: the one token left (temperature 0)
  int nt;
  float temps[SC_MAX_TEMPS];
};

#define SC_NMAX (4 * SC_T)  // maxima a bound pass keeps: four a thread (ScMaxima)
static_assert(SC_NMAX <= SC_CAP, "the sorted maxima live in cand_raw");
static_assert(SC_NMAX >= 10 * SC_WARPS, "top_p's histogram counts live in tmax");

// An operand slot's value for a row (`stride` bit 0 -- 1: one value a row; 0: one value). A template over the
// pointer: MLX passes a Metal input of fewer than eight elements in the constant address space, a larger one in
// device memory. A float slot is float in the signature whatever it holds (one kernel, one compile, for every
// chain): an integer operand, top_k's k, comes as its int32 bits (a view, no cast kernel a call), which `stride`
// bit 1 flags, and converts here, rounding as MLX's cast does.
template <class P>
SC_INLINE float sc_operand_f(P p, int stride, int row) {
  const float v = p[(stride & 1) ? row : 0];
  return (stride & 2) ? (float)sc_f2i(v) : v;
}
template <class P>
SC_INLINE sc_u64 sc_operand_u64(P p, int stride, int row) { return p[stride ? row : 0]; }
template <class P>
SC_INLINE int sc_operand_i(P p, int stride, int row) { return p[stride ? row : 0]; }

// A row's aggregates over a set of tokens under the prologue's temperatures (c: a token's current logit): the
// softmax's parts (cm = the largest c, z = sum exp(c - cm), e = sum exp(c - cm) (c - cm)), Welford's count, mean
// and M2 of the finite c, the best Gumbel-perturbed c (gv at gid), and the largest raw logit (mx at mid, lowest id).
struct ScAgg {
  float cm, z, e, n, mean, m2, gv, mx;
  int gid, mid;
};

struct ScShared {
  ScRow st;
  int ncand;               // -1: the passes read the row; else they read the candidates below
  int tail;                // 1: tokens outside the candidates (raw <= beta) may still be kept (split mode)
  int agg_ok;              // 1: `agg` describes the kept set as it is now (the prologue's temperatures, no cut)
  int fallback;            // 1: a stage needed the tokens outside the candidates: rerun on the whole row
  int last;                // the block that arrived last for its row (split mode)
  float beta;              // the largest raw logit of the tokens outside the candidates (-inf: none)
  ScAgg agg;
  ScAgg aggw[SC_WARPS];
  unsigned hist[256];
  unsigned need;
  unsigned ebad, elive;    // the penalties' check over the block's part: a penalized +inf or NaN; a value > -inf
  int soff[SC_MAXNB + 1];  // each slice's first candidate (split mode)
  float bound;
  float tmax[SC_NMAX];
  int scan[SC_WARPS];
  float cand_raw[SC_CAP];
  int cand_id[SC_CAP];
  float redf[SC_WARPS];
  int redi[SC_WARPS];
  float bins[SC_WARPS][16];
  unsigned prefix;
  float above;
};

SC_INLINE bool sc_finite(float v) { return sc_fabs(v) <= 3.402823466e38f; }

SC_INLINE unsigned sc_key(float v) {
  const unsigned b = sc_f2u(v == 0.0f ? 0.0f : v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

SC_INLINE float sc_unkey(unsigned lo) {
  if (lo < 0x007FFFFFu) return -SC_INF;             // below -inf's key: nothing reached
  return sc_u2f(lo >= 0x80000000u ? (lo & 0x7FFFFFFFu) : ~lo);
}

// The next float above x (+inf and NaN stay): nextafterf(x, inf) from the bits (no math library on every dialect).
SC_INLINE float sc_next_up(float x) {
  if (!(x < SC_INF)) return x;
  if (x == 0.0f) return sc_u2f(1u);
  const unsigned b = sc_f2u(x);
  return sc_u2f(x > 0.0f ? b + 1u : b - 1u);
}

// A thread's copy of the row state a pass reads (the temperatures stay in shared memory).
struct ScView {
  float rho, sigma, mraw, tlo, thi;
  int surv, nt, nband, tid;
  const SC_TG float* temps;
  const SC_TG float* glo;
  const SC_TG float* ghi;
};

SC_INLINE ScView sc_view(const SC_TG ScShared& sh) {
  return ScView{sh.st.rho, sh.st.sigma, sh.st.mraw, sh.st.tlo, sh.st.thi, sh.st.surv, sh.st.nt, sh.st.nband,
                sh.st.tid, sh.st.temps, sh.st.glo, sh.st.ghi};
}

// The current logit of token i with raw logit r.
SC_INLINE float sc_cur(SC_THR const ScView& s, int i, float r) {
  if (!(r >= s.rho) || (r >= s.sigma && i != s.surv) || r == -SC_INF) return -SC_INF;
  if (r >= s.tlo && r <= s.thi && i > s.tid) return -SC_INF;
  for (int b = 0; b < s.nband; ++b)
    if (r >= s.glo[b] && r < s.ghi[b]) return -SC_INF;
  for (int j = 0; j < s.nt; ++j) r = r == -SC_INF ? r : sc_div(r, s.temps[j]);   // (-inf stays: not -inf / inf)
  return r;
}

// Threefry-2x32-20's first output word (Random123; spec section 4).
SC_INLINE unsigned sc_rotl(unsigned x, int r) { return (x << r) | (x >> (32 - r)); }

SC_INLINE unsigned sc_threefry(unsigned k0, unsigned k1, unsigned c0, unsigned c1) {
  const unsigned ks[3] = {k0, k1, k0 ^ k1 ^ SAMPLEC_THREEFRY_PARITY};
  const int rot[8] = {SAMPLEC_THREEFRY_ROTATIONS};
  unsigned x0 = c0 + k0, x1 = c1 + k1;
#pragma unroll
  for (int i = 0; i < 5; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x0 += x1;
      x1 = sc_rotl(x1, rot[(i % 2) * 4 + j]) ^ x0;
    }
    x0 += ks[(i + 1) % 3];
    x1 += ks[(i + 2) % 3] + (unsigned)(i + 1);
  }
  return x0;
}

// -log(-log(u)) for the largest u sc_uniform gives, ((2^23 - 1) + 0.5) * 2^-23, with a margin for logf's rounding
#define SC_GUMBEL_MAX (16.6355323f + 1e-3f)

SC_INLINE float sc_uniform(unsigned bits) {
  return ((float)(bits >> 9) + 0.5f) * 1.1920928955078125e-07f;     // ((bits >> 9) + 0.5) * 2**-23, exact
}

// For every token that can still be kept, each thread its tokens in a fixed order: the body with I its id and R its
// raw logit (`continue` skips to the next token) -- the candidates in shared memory once a cut has gathered them
// (every other token is removed), else the row, a float4 at a time where the row is 16-byte aligned (sc_aligned16:
// always false in the Metal dialect). A macro with the body inline: Metal has no lambdas. (Each use inlines the body
// three times: few uses keep NVRTC's compile short.)
#define SC_EACH(xr, V, sh, tx, I, R, ...)                                                                         \
  do {                                                                                                          \
    const int sc_nc_ = (sh).ncand;                                                                              \
    if (sc_nc_ >= 0) {                                                                                          \
      SC_NO_UNROLL for (int sc_c_ = (tx); sc_c_ < sc_nc_; sc_c_ += SC_T) {                                      \
        const int I = (sh).cand_id[sc_c_];                                                                      \
        const float R = (sh).cand_raw[sc_c_];                                                                   \
        __VA_ARGS__                                                                                             \
      }                                                                                                         \
    } else if (((V) & 3) == 0 && sc_aligned16(xr)) {                                                            \
      const SC_DEV float4* sc_x4_ = reinterpret_cast<const SC_DEV float4*>(xr);                                  \
      const int sc_n4_ = (V) >> 2;                                                                              \
      float4 sc_a_ = sc_x4_[(tx) < sc_n4_ ? (tx) : 0]; /* (index 0 where none: read, never used) */              \
      float4 sc_b_ = sc_x4_[(tx) + SC_T < sc_n4_ ? (tx) + SC_T : 0];                                            \
      SC_NO_UNROLL for (int sc_q_ = (tx); sc_q_ < sc_n4_; sc_q_ += SC_T) { /* (two float4 loads in flight) */   \
        const float4 sc_c4_ = sc_a_;                                                                            \
        sc_a_ = sc_b_;                                                                                          \
        if (sc_q_ + 2 * SC_T < sc_n4_) sc_b_ = sc_x4_[sc_q_ + 2 * SC_T];                                        \
        SC_NO_UNROLL for (int sc_u_ = 0; sc_u_ < 4; ++sc_u_) {                                                  \
          const int I = 4 * sc_q_ + sc_u_;                                                                      \
          const float R = sc_u_ == 0 ? sc_c4_.x : sc_u_ == 1 ? sc_c4_.y : sc_u_ == 2 ? sc_c4_.z : sc_c4_.w;     \
          __VA_ARGS__                                                                                           \
        }                                                                                                       \
      }                                                                                                         \
    } else {                                                                                                    \
      SC_NO_UNROLL for (int sc_i_ = (tx); sc_i_ < (V); sc_i_ += SC_T) {                                         \
        const int I = sc_i_;                                                                                    \
        const float R = (xr)[sc_i_];                                                                            \
        __VA_ARGS__                                                                                             \
      }                                                                                                         \
    }                                                                                                           \
  } while (0)

// The exclusive prefix sum of v over the block's threads (in thread order), and the total in *total.
SC_INLINE int sc_scan(int v, SC_TG ScShared& sh, const int tx, SC_THR int* total) {
  const int lane = tx & 31, w = tx >> 5;
  int incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int up = sc_shfl_up(incl, o);
    if (lane >= o) incl += up;
  }
  sc_barrier();
  if (lane == 31) sh.scan[w] = incl;
  sc_barrier();
  if (w == 0) {
    const int t = lane < SC_WARPS ? sh.scan[lane] : 0;
    int ti = t;
    for (int o = 1; o < 32; o <<= 1) {
      const int up = sc_shfl_up(ti, o);
      if (lane >= o) ti += up;
    }
    if (lane < SC_WARPS) sh.scan[lane] = ti - t;
    if (lane == 31) sh.redi[0] = ti;
  }
  sc_barrier();
  const int excl = sh.scan[w] + incl - v;
  *total = sh.redi[0];
  sc_barrier();
  return excl;
}

// Block-wide reductions: the same tree every time (a butterfly in each warp, then warp 0 over the warps' results),
// so every thread gets the same, reproducible value.
SC_INLINE float sc_sum(float v, SC_TG ScShared& sh, const int tx) {
  const int lane = tx & 31, w = tx >> 5;
  for (int o = 16; o > 0; o >>= 1) v += sc_shfl_xor(v, o);
  sc_barrier();
  if (lane == 0) sh.redf[w] = v;
  sc_barrier();
  if (w == 0) {
    v = lane < SC_WARPS ? sh.redf[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += sc_shfl_xor(v, o);
    if (lane == 0) sh.redf[0] = v;
  }
  sc_barrier();
  return sh.redf[0];
}

SC_INLINE float sc_min(float v, SC_TG ScShared& sh, const int tx) {
  const int lane = tx & 31, w = tx >> 5;
  for (int o = 16; o > 0; o >>= 1) v = sc_fmin(v, sc_shfl_xor(v, o));
  sc_barrier();
  if (lane == 0) sh.redf[w] = v;
  sc_barrier();
  if (w == 0) {
    v = lane < SC_WARPS ? sh.redf[lane] : SC_INF;
    for (int o = 16; o > 0; o >>= 1) v = sc_fmin(v, sc_shfl_xor(v, o));
    if (lane == 0) sh.redf[0] = v;
  }
  sc_barrier();
  return sh.redf[0];
}

// (value, id) pairs: the largest value, the lowest id among equals (sign = 1), or the smallest value, the lowest
// id among equals (sign = -1). Ids of "none" are INT_MAX.
SC_INLINE bool sc_better(float a, int ia, float b, int ib, float sign) {
  return sign * a > sign * b || (a == b && ia < ib);
}

SC_INLINE int sc_arg(float v, int id, float sign, SC_TG ScShared& sh, const int tx, SC_THR float* value) {
  const int lane = tx & 31, w = tx >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = sc_shfl_xor(v, o);
    const int i2 = sc_shfl_xor(id, o);
    if (sc_better(v2, i2, v, id, sign)) { v = v2; id = i2; }
  }
  sc_barrier();
  if (lane == 0) { sh.redf[w] = v; sh.redi[w] = id; }
  sc_barrier();
  if (w == 0) {
    v = lane < SC_WARPS ? sh.redf[lane] : (sign > 0.0f ? -SC_INF : SC_INF);
    id = lane < SC_WARPS ? sh.redi[lane] : 0x7FFFFFFF;
    for (int o = 16; o > 0; o >>= 1) {
      const float v2 = sc_shfl_xor(v, o);
      const int i2 = sc_shfl_xor(id, o);
      if (sc_better(v2, i2, v, id, sign)) { v = v2; id = i2; }
    }
    if (lane == 0) { sh.redf[0] = v; sh.redi[0] = id; }
  }
  sc_barrier();
  if (value) *value = sh.redf[0];
  return sh.redi[0];
}

// The largest value t whose upper set {key >= key(t)} has weight >= target (spec's selections: top_k by count,
// top_p by mass), or -inf if none: eight rounds of 4 key bits, as kernels._select decides them. kw(i, raw, &key,
// &w) gives a token's key and weight.
template <class KW>
SC_FN float sc_select(const SC_DEV float* xr, int V, float target, KW kw, SC_TG ScShared& sh, const int tx) {
  if (!(target > 0.0f)) {     // (an empty upper set reaches it: the row's largest key, as kernels._select clamps)
    float top = -SC_INF;
    SC_EACH(xr, V, sh, tx, i, r, {
      unsigned key;
      float wt;
      kw(i, r, &key, &wt);
      top = sc_fmax(top, sc_unkey(key));
    });
    return -sc_min(-top, sh, tx);
  }
  const int lane = tx & 31, w = tx >> 5;
  unsigned prefix = 0u;
  float above = 0.0f;
  for (int shift = 28; shift >= 0; shift -= 4) {
    float bins[16];
#pragma unroll
    for (int b = 0; b < 16; ++b) bins[b] = 0.0f;
    const unsigned himask = shift == 28 ? 0u : (0xFFFFFFFFu << (shift + 4));
    SC_EACH(xr, V, sh, tx, i, r, {
      unsigned key;
      float wt;
      kw(i, r, &key, &wt);
      if ((key & himask) == prefix) {
        const unsigned d = (key >> shift) & 15u;
        SC_UNROLL
        for (int b = 0; b < 16; ++b) bins[b] += d == (unsigned)b ? wt : 0.0f;
      }
    });
#pragma unroll
    for (int b = 0; b < 16; ++b)
      for (int o = 16; o > 0; o >>= 1) bins[b] += sc_shfl_xor(bins[b], o);
    if (lane == 0)
      for (int b = 0; b < 16; ++b) sh.bins[w][b] = bins[b];
    sc_barrier();
    if (tx == 0) {
      float acc = above;
      int digit = 0;
      for (int d = 15; d >= 1; --d) {
        float tot = 0.0f;
        for (int k = 0; k < SC_WARPS; ++k) tot += sh.bins[k][d];
        if (acc + tot >= target) { digit = d; break; }
        acc += tot;
      }
      sh.prefix = prefix | ((unsigned)digit << shift);
      sh.above = acc;
    }
    sc_barrier();
    prefix = sh.prefix;
    above = sh.above;
    sc_barrier();
  }
  return sc_unkey(prefix);
}

// A stage needs the tokens outside the candidates, which the aggregates do not describe: the chain reruns on the
// whole row (the state the stage leaves is discarded).
SC_INLINE void sc_need_row(SC_TG ScShared& sh, const int tx) {
  if (tx == 0) sh.fallback = 1;
}

// Whether a stage called sc_need_row, read by every thread before any may reset it.
SC_INLINE bool sc_fell_back(SC_TG ScShared& sh, const int tx) {
  sc_barrier();
  const bool fell = sh.fallback != 0;
  sc_barrier();
  return fell;
}

// The row's current maximum (the largest kept raw logit through the temperatures).
SC_INLINE float sc_max(SC_THR const ScView& s) { return sc_cur(s, s.surv >= 0 ? s.surv : 0, s.mraw); }

// softmax's normalizer over the current logits: sum of exp(x - max).
SC_INLINE float sc_norm(const SC_DEV float* xr, int V, float m, SC_TG ScShared& sh, const int tx) {
  if (sh.tail) {                  // (split mode before a cut: the row's normalizer from the slices' aggregates)
    if (!sh.agg_ok) sc_need_row(sh, tx);
    return sh.agg.z;
  }
  const ScView s = sc_view(sh);
  float z = 0.0f;
  SC_EACH(xr, V, sh, tx, i, r, { z += sc_exp(sc_sub(sc_cur(s, i, r), m)); });
  return sc_sum(z, sh, tx);
}

// The current softmax: prob(c) = exp(c - m) / z for a current logit c, as the dense definitions round it.
struct ScProbs {
  float m, z;
  SC_INLINE float operator()(float c) const { return sc_div(sc_exp(sc_sub(c, m)), z); }
};

// A cut's rule on a token's current logit c (sc_cut, sc_gather): c >= thr, or by_prob: its probability under
// `prob` >= thr; and with at_max every token at the row's maximum prob.m too.
struct ScKeep {
  ScProbs prob;
  float thr;
  int by_prob, at_max;
  SC_INLINE bool operator()(float c) const { return (by_prob ? prob(c) : c) >= thr || (at_max && c == prob.m); }
};

SC_INLINE ScKeep sc_keep_logit(float thr) { return ScKeep{ScProbs{0.0f, 1.0f}, thr, 0, 0}; }
SC_INLINE ScKeep sc_keep_prob(ScProbs prob, float thr) { return ScKeep{prob, thr, 1, 0}; }

// A selection's key and weight for token i with raw logit r (sc_select): by its current logit, each weighing one
// (top_k); by its probability, weighing it (top_p); by typical_p's score -|mean - d| (d = c - max), weighing its
// probability; by -id among the tokens at vk (top_k_rank's ties).
struct ScByLogit {
  ScView s;
  SC_INLINE void operator()(int i, float r, SC_THR unsigned* key, SC_THR float* w) const {
    *key = sc_key(sc_cur(s, i, r));
    *w = 1.0f;
  }
};

struct ScByProb {
  ScView s;
  ScProbs prob;
  SC_INLINE void operator()(int i, float r, SC_THR unsigned* key, SC_THR float* w) const {
    *w = prob(sc_cur(s, i, r));
    *key = sc_key(*w);
  }
};

struct ScByScore {
  ScView s;
  ScProbs prob;
  float mean;
  SC_INLINE float score(float c) const {
    return prob(c) > 0.0f ? sc_fabs(sc_sub(mean, sc_sub(c, prob.m))) : SC_INF;
  }
  SC_INLINE void operator()(int i, float r, SC_THR unsigned* key, SC_THR float* w) const {
    const float c = sc_cur(s, i, r);
    *w = prob(c);
    *key = sc_key(-score(c));
  }
};

struct ScByTieId {
  ScView s;
  float vk;
  SC_INLINE void operator()(int i, float r, SC_THR unsigned* key, SC_THR float* w) const {
    *w = sc_cur(s, i, r) == vk ? 1.0f : 0.0f;
    *key = sc_key(-(float)i);
  }
};

SC_INLINE ScProbs sc_probs(const SC_DEV float* xr, int V, SC_THR const ScView& s, SC_TG ScShared& sh, const int tx) {
  const float m = sc_max(s);
  return ScProbs{m, sc_norm(xr, V, m, sh, tx)};
}

// Where the passes still read the row and at most SC_CAP tokens pass keep(c) (c: the token's current logit, not
// -inf), gather them into shared memory: every other token is removed from then on. Each thread writes its own
// tokens in its own order at its offset in the block (`mine`: how many it has), a fixed order, so that sums over
// the candidates do not depend on timing.
template <class K>
SC_INLINE void sc_gather(const SC_DEV float* xr, int V, SC_THR const ScView& s, K keep, int mine,
                                          SC_TG ScShared& sh, const int tx) {
  if (sh.ncand >= 0) return;
  int total;
  int at = sc_scan(mine, sh, tx, &total);
  if (total > SC_CAP) return;
  SC_EACH(xr, V, sh, tx, i, r, {
    const float c = sc_cur(s, i, r);
    if (c != -SC_INF && keep(c)) { sh.cand_raw[at] = r; sh.cand_id[at] = i; ++at; }
  });
  sc_barrier();
  if (tx == 0) sh.ncand = total;
  sc_barrier();
}

// sc_gather after a pass counting each thread's tokens that pass keep(c).
template <class K>
SC_INLINE void sc_gather_passing(const SC_DEV float* xr, int V, SC_THR const ScView& s, K keep, SC_TG ScShared& sh,
                                 const int tx) {
  int mine = 0;
  SC_EACH(xr, V, sh, tx, i, r, {
    const float c = sc_cur(s, i, r);
    mine += c != -SC_INF && keep(c);
  });
  sc_gather(xr, V, s, keep, mine, sh, tx);
}

// A bound pass's running maxima: each thread keeps four, one for each of four disjoint sets of its tokens (by
// (i ^ i / SC_T) % 4: a float4's four lanes, or a scalar pass's every fourth visit), so the j largest of the
// SC_NMAX maxima are j distinct tokens (top_k's bound).
struct ScMaxima {
  float m0 = -SC_INF, m1 = -SC_INF, m2 = -SC_INF, m3 = -SC_INF;
  SC_INLINE void add(int i, float c) {
    const int u = (i ^ (i / SC_T)) & 3;
    m0 = u == 0 ? sc_fmax(m0, c) : m0;
    m1 = u == 1 ? sc_fmax(m1, c) : m1;
    m2 = u == 2 ? sc_fmax(m2, c) : m2;
    m3 = u == 3 ? sc_fmax(m3, c) : m3;
  }
};

// The maxima of every thread, sorted descending (equal ones by their place), into sh.cand_raw[0, SC_NMAX) -- free
// while the passes read the row.
SC_INLINE void sc_sort_maxima(SC_THR const ScMaxima& tm, SC_TG ScShared& sh, const int tx) {
  const int me = 4 * tx;
  const float v[4] = {tm.m0, tm.m1, tm.m2, tm.m3};
  for (int u = 0; u < 4; ++u) sh.tmax[me + u] = v[u];
  sc_barrier();
  int rank[4] = {0, 0, 0, 0};
  for (int j = 0; j < SC_NMAX; ++j) {
    const float o = sh.tmax[j];
#pragma unroll
    for (int u = 0; u < 4; ++u) rank[u] += o > v[u] || (o == v[u] && j < me + u);
  }
  for (int u = 0; u < 4; ++u) sh.cand_raw[rank[u]] = v[u];
  sc_barrier();
}

// Keep the tokens whose current logit c passes keep(c): the new rho is the smallest raw logit left. (A token at
// -inf stays removed whatever the threshold: a cut at -inf keeps the row as it is.)
template <class K>
SC_INLINE void sc_cut(const SC_DEV float* xr, int V, K keep, SC_TG ScShared& sh, const int tx) {
  const ScView s = sc_view(sh);
  const int tail = sh.tail;
  float lo = SC_INF;
  int mine = 0;
  SC_EACH(xr, V, sh, tx, i, r, {
    const float c = sc_cur(s, i, r);
    if (c != -SC_INF && keep(c)) { lo = sc_fmin(lo, r); ++mine; }
  });
  lo = sc_min(lo, sh, tx);
  sc_gather(xr, V, s, keep, mine, sh, tx);
  if (tx == 0 && lo != SC_INF) sh.st.rho = lo;
  if (tail) {       // (split mode: the cut must remove every token outside the candidates, all at raw <= beta)
    const float cb = sc_cur(s, -2, sh.beta);
    if (cb != -SC_INF && keep(cb)) sc_need_row(sh, tx);
    else if (tx == 0) sh.tail = 0;
  }
  sc_barrier();
}

SC_INLINE int sc_argmax(const SC_DEV float* xr, int V, SC_TG ScShared& sh, const int tx) {
  const ScView s = sc_view(sh);
  float best = -SC_INF;
  int id = 0x7FFFFFFF;
  SC_EACH(xr, V, sh, tx, i, r, {
    const float v = sc_cur(s, i, r);
    if (sc_better(v, i, best, id, 1.0f)) { best = v; id = i; }
  });
  const int won = sc_arg(best, id, 1.0f, sh, tx, nullptr);
  return won == 0x7FFFFFFF ? 0 : won;     // (nothing left to read: a row the checks reject)
}

// (After a temperature 0 the row holds one token; later temperatures still divide its logit, for the final
// logits a chain may output.)
SC_FN void sc_temperature(const SC_DEV float* xr, int V, float t, SC_TG ScShared& sh, const int tx) {
  if (SAMPLEC_OFF_TEMPERATURE(t)) return;
  const ScView s = sc_view(sh);
  const int g = sh.st.greedy;
  const float top = sc_div(g >= 0 ? sc_cur(s, g, xr[g]) : sc_max(s), t == 0.0f ? 1.0f : t);
  sc_barrier();                                  // (every thread has read the state thread 0 changes below)
  if (t == 0.0f || !sc_finite(top)) {
    if (g < 0) {
      const int id = sc_argmax(xr, V, sh, tx);
      if (tx == 0) sh.st.greedy = id;
    }
  } else if (tx == 0) {
    sh.st.temps[sh.st.nt++] = t;
  }
  sc_barrier();
}

SC_FN void sc_top_k(const SC_DEV float* xr, int V, float k, SC_TG ScShared& sh, const int tx) {
  if (SAMPLEC_OFF_TOP_K(k, (float)V)) return;      // (k >= V: every token -- the V-th largest is the row's least)
  const ScView s = sc_view(sh);
  const int kk = (int)sc_floor(k);
  if (sh.ncand < 0 && kk <= SC_NMAX) {
    // The kk-th largest of the threads' maxima is at most the row's kk-th largest: the tokens at or above it hold
    // the cut (usually a few times kk of them) -- gathered, the selection reads them alone.
    ScMaxima tm;
    SC_EACH(xr, V, sh, tx, i, r, { tm.add(i, sc_cur(s, i, r)); });
    sc_sort_maxima(tm, sh, tx);
    const float t0 = sh.cand_raw[kk - 1];
    if (t0 != -SC_INF) sc_gather_passing(xr, V, s, sc_keep_logit(t0), sh, tx);
  }
  const float vk = sc_select(xr, V, sc_floor(k), ScByLogit{s}, sh, tx);
  sc_cut(xr, V, sc_keep_logit(vk), sh, tx);
}

// The thresholds of top_p's bound: the probabilities of the logits this far below the maximum.
#define SC_HIST 10
SC_INLINE float sc_hist_delta(int k) {
  return k == 0 ? 0.5f : k < 8 ? (float)k : k == 8 ? 8.5f : 10.0f;
}

SC_FN void sc_top_p(const SC_DEV float* xr, int V, float p, SC_TG ScShared& sh, const int tx) {
  if (SAMPLEC_OFF_TOP_P(p)) return;
  const ScView s = sc_view(sh);
  const ScProbs prob = sc_probs(xr, V, s, sh, tx);
  const float z = prob.z;
  if (sh.ncand < 0) {
    // A bound from a histogram of the probabilities (the selection's own weights): for each threshold P_k the mass
    // and the number of the tokens with p >= P_k, in one pass, added in a fixed order. The least P_k whose tokens
    // hold p (with a margin over float rounding) and number at most SC_CAP bounds the nucleus: those tokens --
    // an upper set of the weights, so every token the selection could keep -- are gathered, and the selection
    // reads them alone. (None on a flat row: the selection reads the row.)
    float pk[SC_HIST], mass[SC_HIST], cnt[SC_HIST];
#pragma unroll
    for (int k = 0; k < SC_HIST; ++k) {
      pk[k] = sc_div(sc_exp(-sc_hist_delta(k)), z);
      mass[k] = 0.0f;
      cnt[k] = 0.0f;
    }
    SC_EACH(xr, V, sh, tx, i, r, {
      const float w = prob(sc_cur(s, i, r));
      SC_UNROLL
      for (int k = 0; k < SC_HIST; ++k) {
        const bool in = w >= pk[k];
        mass[k] += in ? w : 0.0f;
        cnt[k] += in ? 1.0f : 0.0f;
      }
    });
    const int lane = tx & 31, wp = tx >> 5;
    sc_barrier();                                  // (sh.bins and sh.tmax are free)
#pragma unroll
    for (int k = 0; k < SC_HIST; ++k) {
      float mk = mass[k], ck = cnt[k];
      for (int o = 16; o > 0; o >>= 1) {
        mk += sc_shfl_xor(mk, o);
        ck += sc_shfl_xor(ck, o);
      }
      if (lane == 0) {
        sh.bins[wp][k] = mk;
        sh.tmax[wp * SC_HIST + k] = ck;
      }
    }
    sc_barrier();
    if (tx == 0) {
      const float need = p * 1.0001f + 1e-6f;     // (float sums: Metal has no double; within the margin)
      int chosen = -1;
#pragma unroll 1
      for (int k = 0; k < SC_HIST && chosen < 0; ++k) {   // (not unrolled: sm_80's build took 218 registers)
        float mk = 0.0f, ck = 0.0f;
#pragma unroll 1
        for (int w = 0; w < SC_WARPS; ++w) {
          mk += sh.bins[w][k];
          ck += sh.tmax[w * SC_HIST + k];
        }
        if (ck > (float)SC_CAP) break;                // (the counts only grow with k)
        if (mk >= need) chosen = k;
      }
      sh.bound = (float)chosen;
    }
    sc_barrier();
    const int chosen = (int)sh.bound;
    if (chosen >= 0) {
      float p0 = 0.0f, have = 0.0f;
#pragma unroll
      for (int k = 0; k < SC_HIST; ++k) {
        p0 = k == chosen ? pk[k] : p0;
        have = k == chosen ? cnt[k] : have;
      }
      sc_gather(xr, V, s, sc_keep_prob(prob, p0), (int)have, sh, tx);
    }
  }
  const float floor_p = sc_select(xr, V, p, ScByProb{s, prob}, sh, tx);
  sc_cut(xr, V, sc_keep_prob(prob, floor_p), sh, tx);
}

SC_FN void sc_top_n_sigma(const SC_DEV float* xr, int V, float n, SC_TG ScShared& sh, const int tx) {
  if (SAMPLEC_OFF_TOP_N_SIGMA(n)) return;
  const ScView s = sc_view(sh);
  const float m = sc_max(s);
  float sd;
  if (sh.tail) {                  // (split mode before a cut: the slices' Welford parts)
    if (!sh.agg_ok) sc_need_row(sh, tx);
    sd = sc_sqrt(sc_div(sh.agg.m2, sh.agg.n));
  } else {
    float cnt = 0.0f, sum = 0.0f;
    SC_EACH(xr, V, sh, tx, i, r, {
      const float c = sc_cur(s, i, r);
      if (sc_finite(c)) { cnt += 1.0f; sum += c; }
    });
    cnt = sc_sum(cnt, sh, tx);
    const float mean = sc_div(sc_sum(sum, sh, tx), cnt);
    float sq = 0.0f;
    SC_EACH(xr, V, sh, tx, i, r, {
      const float c = sc_cur(s, i, r);
      if (sc_finite(c)) { const float d = sc_sub(c, mean); sq += d * d; }
    });
    sd = sc_sqrt(sc_div(sc_sum(sq, sh, tx), cnt));
  }
  const float floor_x = sc_sub(m, sc_mul(n, sd));     // (NaN for n = inf, sd = 0: the maximum alone)
  sc_cut(xr, V, ScKeep{ScProbs{m, 1.0f}, floor_x, 0, 1}, sh, tx);
}

// epsilon (HF EpsilonLogitsWarper) and eta (EtaLogitsWarper): keep p >= cut, and every token at the maximum; eta's
// cut is sc_imin(e, sqrt(e) exp(-H)) with H the entropy of the current softmax.
SC_FN void sc_epsilon_eta(const SC_DEV float* xr, int V, float e, bool eta, SC_TG ScShared& sh, const int tx) {
  if (eta ? SAMPLEC_OFF_ETA(e) : SAMPLEC_OFF_EPSILON(e)) return;
  const ScView s = sc_view(sh);
  const ScProbs prob = sc_probs(xr, V, s, sh, tx);
  const float m = prob.m, z = prob.z;
  float cut = e;
  if (eta) {
    const float lz = sc_log(z);
    float h = 0.0f;
    if (sh.tail) {                // (split mode before a cut: H = log z - sum exp(d) d / z from the slices)
      h = sc_sub(lz, sc_div(sh.agg.e, z));
    } else {
      SC_EACH(xr, V, sh, tx, i, r, {
        const float c = sc_cur(s, i, r);
        if (c != -SC_INF) {
          const float plogp = prob(c) * sc_sub(sc_sub(c, m), lz);
          if (sc_finite(plogp)) h += plogp;
        }
      });
      h = -sc_sum(h, sh, tx);
    }
    cut = sc_fmin(e, sc_sqrt(e) * sc_exp(-h));
  }
  sc_cut(xr, V, ScKeep{prob, cut, 1, 1}, sh, tx);
}

// typical_p (spec section 2): with p the current softmax and d = x - max, the score of a token with p > 0 is
// |mean - d| (mean = sum p d; the dense definition's form, free of log Z's cancellation), else inf; keep the tokens
// whose score is at most the score where the mass in ascending score first reaches m (or, never reached, the
// largest finite score), and every token at the maximum. The score falls and then rises along the logit order, so
// the band kept is an interval: its lowest raw logit is the new rho, and the tokens between its top and the
// tokens at the maximum are removed ([glo, ghi): each typical_p adds its band to the ones before, so a band that
// later temperatures made reach the maximum stays removed).
SC_FN void sc_typical(const SC_DEV float* xr, int V, float mass, SC_TG ScShared& sh, const int tx) {
  if (SAMPLEC_OFF_TYPICAL_P(mass)) return;
  if (sh.tail) {                  // (its band may lie among the tokens outside the candidates)
    sc_need_row(sh, tx);
    sc_barrier();
    return;
  }
  const ScView s = sc_view(sh);
  const ScProbs prob = sc_probs(xr, V, s, sh, tx);
  const float m = prob.m;
  float mean = 0.0f, dlo = SC_INF;
  SC_EACH(xr, V, sh, tx, i, r, {
    const float c = sc_cur(s, i, r);
    const float p = prob(c);
    if (p > 0.0f) {
      const float d = sc_sub(c, m);
      mean += sc_mul(p, d);
      dlo = sc_fmin(dlo, d);
    }
  });
  mean = sc_sum(mean, sh, tx);
  dlo = sc_min(dlo, sh, tx);
  // (the score is monotone on each side of mean, so the largest finite one is at the least or the greatest d: 0)
  const float top_finite = sc_fmax(sc_fabs(sc_sub(mean, dlo)), sc_fabs(mean));
  const ScByScore score{s, prob, mean};
  const float t = sc_select(xr, V, mass, score, sh, tx);
  const float cutoff = sc_fmin(-t, top_finite);
  // the band's lowest and highest raw logits (below the maximum), the least raw logit at the maximum
  float lo = SC_INF, band_hi = -SC_INF, at_max = SC_INF;
  SC_EACH(xr, V, sh, tx, i, r, {
    const float c = sc_cur(s, i, r);
    if (c == -SC_INF) continue;
    if (c == m) {
      at_max = sc_fmin(at_max, r);
      lo = sc_fmin(lo, r);
    } else if (score.score(c) <= cutoff) {
      band_hi = sc_fmax(band_hi, r);
      lo = sc_fmin(lo, r);
    }
  });
  lo = sc_min(lo, sh, tx);
  band_hi = -sc_min(-band_hi, sh, tx);
  at_max = sc_min(at_max, sh, tx);
  if (tx == 0 && lo != SC_INF) {
    sh.st.rho = lo;
    if (band_hi != -SC_INF) {                       // (else rho alone leaves the tokens at the maximum)
      sh.st.glo[sh.st.nband] = sc_next_up(band_hi);
      sh.st.ghi[sh.st.nband] = at_max;
      ++sh.st.nband;
    }
  }
  sc_barrier();
}

// dynamic_temperature (llama.cpp's temp_ext; range != 0: the dispatcher runs range 0 as temperature(t)): over the n
// kept tokens (n <= 1: unchanged), T = max(0, t - r) + (t + r - max(0, t - r)) (H / ln n)^ex (0^0 = 1), then
// temperature(T) -- T <= 0 or NaN keeps the argmax alone.
SC_FN void sc_dynamic_temperature(const SC_DEV float* xr, int V, float t, float r, float ex, SC_TG ScShared& sh,
                                  const int tx) {
  float n, h;
  if (sh.tail) {                  // (split mode before a cut: the slices' count and entropy parts)
    if (!sh.agg_ok) sc_need_row(sh, tx);
    n = sh.agg.n;
    h = sc_sub(sc_log(sh.agg.z), sc_div(sh.agg.e, sh.agg.z));
  } else {
    const ScView s = sc_view(sh);
    const ScProbs prob = sc_probs(xr, V, s, sh, tx);
    const float m = prob.m, lz = sc_log(prob.z);
    float cnt = 0.0f;
    h = 0.0f;
    SC_EACH(xr, V, sh, tx, i, raw, {
      const float c = sc_cur(s, i, raw);
      if (sc_finite(c)) cnt += 1.0f;
      if (c != -SC_INF) {
        const float plogp = prob(c) * sc_sub(sc_sub(c, m), lz);
        if (sc_finite(plogp)) h += plogp;
      }
    });
    n = sc_sum(cnt, sh, tx);
    h = -sc_sum(h, sh, tx);
  }
  if (tx == 0) sh.agg_ok = 0;     // (the softmax changes under T)
  sc_barrier();
  if (n <= 1.0f) return;
  const float norm = sc_div(h, sc_log(n));
  const float powed = ex == 0.0f ? 1.0f : sc_exp(ex * sc_log(norm));
  const float lo = sc_fmax(0.0f, sc_sub(t, r));
  const float dyn = sc_add(lo, sc_sub(sc_add(t, r), lo) * powed);
  sc_temperature(xr, V, dyn > 0.0f ? dyn : 0.0f, sh, tx);
}

// top_k_rank: the k largest by rank -- every token above the k-th largest value vk, and of those at vk the lowest
// ids, as many as the k places leave: the need-th lowest id among them by a selection on -id.
SC_FN void sc_top_k_rank(const SC_DEV float* xr, int V, float k, SC_TG ScShared& sh, const int tx) {
  if (SAMPLEC_OFF_TOP_K_RANK(k, (float)V)) return;
  sc_top_k(xr, V, k, sh, tx);           // (keeps c >= vk: the ties at vk are still all there)
  if (sh.fallback) return;
  const ScView s = sc_view(sh);
  const float vk = sc_select(xr, V, sc_floor(k), ScByLogit{s}, sh, tx);
  float above = 0.0f, tlo = SC_INF, thi = -SC_INF;
  SC_EACH(xr, V, sh, tx, i, r, {
    const float c = sc_cur(s, i, r);
    above += c > vk ? 1.0f : 0.0f;
    if (c == vk) { tlo = sc_fmin(tlo, r); thi = sc_fmax(thi, r); }
  });
  above = sc_sum(above, sh, tx);
  tlo = sc_min(tlo, sh, tx);
  thi = -sc_min(-thi, sh, tx);
  const float idl = sc_select(xr, V, sc_floor(k) - above, ScByTieId{s, vk}, sh, tx);
  if (tx == 0 && vk != -SC_INF) {   // (ids are exact in float32 below 2^24)
    sh.st.tlo = tlo;
    sh.st.thi = thi;
    sh.st.tid = (int)(-idl);
  }
  sc_barrier();
}

SC_FN void sc_min_p(const SC_DEV float* xr, int V, float mp, SC_TG ScShared& sh, const int tx) {
  if (SAMPLEC_OFF_MIN_P(mp)) return;
  const ScView s = sc_view(sh);
  const float floor_x = sc_add(sc_max(s), sc_log(mp));
  sc_cut(xr, V, sc_keep_logit(floor_x), sh, tx);
}

SC_FN void sc_xtc(const SC_DEV float* xr, int V, float thr, float prob_fire, unsigned k0, unsigned k1, unsigned pos,
                       SC_TG ScShared& sh, const int tx) {
  if (SAMPLEC_OFF_XTC(prob_fire)) return;
  if (!(sc_uniform(sc_threefry(k0, k1, SAMPLEC_XTC_COUNTER, pos)) < prob_fire)) return;
  if (sh.tail) {                  // (fired before a cut: the aggregates would no longer describe the row)
    sc_need_row(sh, tx);
    sc_barrier();
    return;
  }
  const ScView s = sc_view(sh);
  const ScProbs prob = sc_probs(xr, V, s, sh, tx);
  float least = SC_INF, lo = SC_INF, n = 0.0f;
  int id = 0x7FFFFFFF;
  SC_EACH(xr, V, sh, tx, i, r, {
    const float x = sc_cur(s, i, r);
    const float p = prob(x);
    if (p >= thr && sc_finite(x)) {
      n += 1.0f;
      lo = sc_fmin(lo, r);
      if (sc_better(p, i, least, id, -1.0f)) { least = p; id = i; }
    }
  });
  n = sc_sum(n, sh, tx);
  lo = sc_min(lo, sh, tx);
  id = sc_arg(least, id, -1.0f, sh, tx, nullptr);
  if (n >= 2.0f && tx == 0) {
    sh.st.sigma = lo;
    sh.st.surv = id;
    sh.st.mraw = xr[id];
  }
  sc_barrier();
}

SC_FN int sc_sample(const SC_DEV float* xr, int V, unsigned k0, unsigned k1, unsigned pos, SC_TG ScShared& sh,
                    const int tx) {
  if (sh.tail) {                  // (split mode, no cut: the slices' best perturbed logits, the row's draw)
    if (!sh.agg_ok || sh.agg.gid == 0x7FFFFFFF) {
      sc_need_row(sh, tx);
      return 0;                   // (unread: the chain reruns on the whole row)
    }
    return sh.agg.gid;
  }
  const ScView s = sc_view(sh);
  float best = -SC_INF;
  int id = 0x7FFFFFFF;
  SC_EACH(xr, V, sh, tx, i, r, {
    const float x = sc_cur(s, i, r);
    // (a token whose logit plus the largest noise the generator gives stays below this thread's best cannot win:
    // its Threefry is skipped -- most of a real row's tail, whose logits lie tens below its maximum)
    if (x == -SC_INF || sc_add(x, SC_GUMBEL_MAX) < best) continue;
    const float u = sc_uniform(sc_threefry(k0, k1, (unsigned)i, pos));
    const float v = sc_add(x, -sc_log(-sc_log(u)));
    if (sc_better(v, i, best, id, 1.0f)) { best = v; id = i; }
  });
  const int won = sc_arg(best, id, 1.0f, sh, tx, nullptr);
  return won == 0x7FFFFFFF ? 0 : won;     // (a row with no finite logit -- an error the checks raise -- reads token 0)
}

SC_FN void sc_begin(const SC_DEV float* xr, int V, SC_TG ScShared& sh, const int tx) {
  if (tx == 0) {
    sh.ncand = -1;
    sh.tail = 0;
    sh.agg_ok = 0;
    sh.fallback = 0;
  }
  sc_barrier();
  float m = -SC_INF;
  SC_EACH(xr, V, sh, tx, i, r, { m = sc_fmax(m, r); });
  m = -sc_min(-m, sh, tx);
  if (tx == 0) {
    sh.st.rho = -SC_INF;
    sh.st.sigma = SC_INF;
    sh.st.nband = 0;
    sh.st.tlo = SC_INF;
    sh.st.thi = -SC_INF;
    sh.st.tid = 0x7FFFFFFF;
    sh.st.surv = -1;
    sh.st.mraw = m;
    sh.st.greedy = -1;
    sh.st.nt = 0;
  }
  sc_barrier();
}

// -- split mode: a row over many blocks ------------------------------------------------------------------------
//
// At small B one block a row leaves most of the GPU idle. In split mode each of a row's NB blocks reads a slice of it
// once: it keeps its largest logits (each thread its SC_R largest, then the block's `cap` largest of those: a radix
// select over the keys in shared memory) and the slice's aggregates under the prologue's temperatures (ScAgg), and
// writes them to a scratch buffer; the block that arrives last for the row (a counter per row) runs the chain over
// the candidates the blocks gathered. Every token outside them has raw <= beta (the largest of the slices' left-out
// logits), so the candidates are exact once a cut's threshold lies above beta; before that, a stage that needs the
// tokens outside (a cut at or below beta, typical_p, an xtc that fires, a later temperature's normalizer) sends the
// row back to the whole-row passes (sc_need_row), so the result never depends on the split.

SC_INLINE ScAgg sc_agg_none() {
  return ScAgg{-SC_INF, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, -SC_INF, -SC_INF, 0x7FFFFFFF, 0x7FFFFFFF};
}

// Adds a token's current logit c (-inf: removed) to the softmax parts (online: rescaled when the maximum grows)
// and Welford's parts.
SC_INLINE void sc_agg_add(SC_THR ScAgg& a, float c) {
  if (!(c > -SC_INF)) return;
  if (a.z == 0.0f) {
    a.cm = c;
    a.z = 1.0f;
    a.e = 0.0f;
  } else if (c > a.cm) {
    const float d = sc_sub(a.cm, c), w = sc_exp(d);
    a.e = w * (a.e + d * a.z);
    a.z = w * a.z + 1.0f;
    a.cm = c;
  } else {
    const float d = sc_sub(c, a.cm), w = sc_exp(d);
    a.z += w;
    a.e += w * d;
  }
  if (sc_finite(c)) {
    a.n += 1.0f;
    const float d = c - a.mean;
    a.mean += d / a.n;
    a.m2 += d * (c - a.mean);
  }
}

// a <- a merged with b, a's tokens before b's (ties in the maxima: the lower id; both reductions' orders are fixed).
SC_INLINE void sc_agg_merge(SC_THR ScAgg& a, SC_THR const ScAgg& b) {
  if (b.z > 0.0f) {
    if (a.z == 0.0f) {
      a.cm = b.cm;
      a.z = b.z;
      a.e = b.e;
    } else {
      const float m = sc_fmax(a.cm, b.cm), da = sc_sub(a.cm, m), db = sc_sub(b.cm, m);
      const float wa = sc_exp(da), wb = sc_exp(db);
      a.e = wa * (a.e + da * a.z) + wb * (b.e + db * b.z);
      a.z = wa * a.z + wb * b.z;
      a.cm = m;
    }
  }
  if (b.n > 0.0f) {
    const float n = a.n + b.n, d = b.mean - a.mean;
    a.mean = a.n == 0.0f ? b.mean : a.mean + d * (b.n / n);
    a.m2 = a.n == 0.0f ? b.m2 : a.m2 + b.m2 + d * d * (a.n * (b.n / n));
    a.n = n;
  }
  if (sc_better(b.gv, b.gid, a.gv, a.gid, 1.0f)) { a.gv = b.gv; a.gid = b.gid; }
  if (sc_better(b.mx, b.mid, a.mx, a.mid, 1.0f)) { a.mx = b.mx; a.mid = b.mid; }
}

SC_INLINE ScAgg sc_agg_shfl(SC_THR const ScAgg& a, int o) {
  return ScAgg{sc_shfl_xor(a.cm, o), sc_shfl_xor(a.z, o),
               sc_shfl_xor(a.e, o), sc_shfl_xor(a.n, o),
               sc_shfl_xor(a.mean, o), sc_shfl_xor(a.m2, o),
               sc_shfl_xor(a.gv, o), sc_shfl_xor(a.mx, o),
               sc_shfl_xor(a.gid, o), sc_shfl_xor(a.mid, o)};
}

// A butterfly over the warp: every lane merges (lower lanes' tokens, higher lanes') in the same order.
SC_INLINE void sc_agg_warp(SC_THR ScAgg& a, const int tx) {
  const int lane = tx & 31;
  for (int o = 16; o > 0; o >>= 1) {
    const ScAgg b = sc_agg_shfl(a, o);
    if (lane & o) {
      ScAgg t = b;
      sc_agg_merge(t, a);
      a = t;
    } else {
      sc_agg_merge(a, b);
    }
  }
}

// An aggregate into and out of threadgroup memory, field by field (a struct's implicit copy is a thread's).
SC_INLINE void sc_agg_store(SC_TG ScAgg& to, SC_THR const ScAgg& a) {
  to.cm = a.cm; to.z = a.z; to.e = a.e; to.n = a.n; to.mean = a.mean; to.m2 = a.m2; to.gv = a.gv; to.mx = a.mx;
  to.gid = a.gid; to.mid = a.mid;
}

SC_INLINE ScAgg sc_agg_load(const SC_TG ScAgg& a) {
  return ScAgg{a.cm, a.z, a.e, a.n, a.mean, a.m2, a.gv, a.mx, a.gid, a.mid};
}

// The block's aggregates (threads in order) into sh.agg.
SC_INLINE void sc_agg_block(ScAgg a, SC_TG ScShared& sh, const int tx) {
  const int lane = tx & 31, w = tx >> 5;
  sc_agg_warp(a, tx);
  sc_barrier();
  if (lane == 0) sc_agg_store(sh.aggw[w], a);
  sc_barrier();
  if (w == 0) {
    a = lane < SC_WARPS ? sc_agg_load(sh.aggw[lane]) : sc_agg_none();
    sc_agg_warp(a, tx);
    if (lane == 0) sc_agg_store(sh.agg, a);
  }
  sc_barrier();
}

// A stage's float operands (its numeric ones: top_k's k goes in as a float) and key words (a key: its seed's two
// words and the position).
SC_INLINE int sc_nf(int op) { return SAMPLEC_STAGE_NUMBERS(op); }
SC_INLINE int sc_nu(int op) { return 3 * SAMPLEC_STAGE_KEYS(op); }
SC_INLINE float sc_at(SC_THR const float* pr, int f) { return f < SC_FSLOTS ? pr[f] : 0.0f; }
// A map that is a plain temperature: temperature, or dynamic_temperature with range 0 (its definition's).
SC_INLINE bool sc_plain_temperature(int op, SC_THR const float* pr, int f) {
  return op == SAMPLEC_STAGE_TEMPERATURE || (op == SAMPLEC_STAGE_DYNAMIC_TEMPERATURE && sc_at(pr, f + 1) == 0.0f);
}

// The prologue of a row's chain: the stages from the first, while each is off for this row or a temperature (t > 0):
// the index of the first stage that is neither (n: every one), and the temperatures met on the way (t = 1 skipped,
// as sc_temperature skips it). The slices' aggregates are taken under them.
SC_FN int sc_prologue(const SC_DEV int* S, SC_THR const float* pr, SC_THR const unsigned* ur, int V,
                      SC_THR float* temps, SC_THR int* nt) {
  const int n = S[0];
  const SC_DEV int* ops = S + 8;
  int f = 0, u = 0;
  *nt = 0;
  for (int j = 0; j < n; ++j) {
    const int op = ops[j];
    const float a = pr[f];
    const bool temp = sc_plain_temperature(op, pr, f);
    // (an xtc whose coin does not fire for this row changes nothing in it either)
    const bool off = SAMPLEC_STAGE_OFF(op, a, sc_at(pr, f + 1), sc_at(pr, f + 2), (float)V) ||
                     (op == SAMPLEC_STAGE_XTC &&
                      !(sc_uniform(sc_threefry(ur[u], ur[u + 1], SAMPLEC_XTC_COUNTER, ur[u + 2])) < sc_at(pr, f + 1)));
    if (temp) {
      if (!(a > 0.0f) || *nt == SC_MAX_TEMPS) return j;
      if (a != 1.0f) temps[(*nt)++] = a;
    } else if (!off) {
      return j;
    }
    f += sc_nf(op);
    u += sc_nu(op);
  }
  return n;
}

// One block's slice [lo, hi) of a row: its candidates and aggregates into the scratch (wf: the header, then the
// candidates' raw logits; wi: their ids). With `gumbel` (a sample after the prologue alone) the slice's best
// perturbed logit too.
SC_FN void sc_slice(const SC_DEV float* xr, int lo, int hi, SC_THR const float* temps, int nt, bool gumbel, unsigned k0,
                         unsigned k1, unsigned pos, int cap, SC_TG ScShared& sh, const int tx, SC_DEV float* wf,
                         SC_DEV int* wi) {
  float tv[SC_R];
  int ti[SC_R];
#pragma unroll
  for (int k = 0; k < SC_R; ++k) { tv[k] = -SC_INF; ti[k] = 0x7FFFFFFF; }
  float left = -SC_INF;           // the largest of this thread's tokens it did not keep
  ScAgg a = sc_agg_none();
#pragma unroll 1
  for (int i = lo + (int)tx; i < hi; i += SC_T) {
    const float v = xr[i];
    if (v > tv[SC_R - 1]) {       // (ids ascend: an equal value stays behind the one kept first)
      left = sc_fmax(left, tv[SC_R - 1]);
      float cv = v;
      int ci = i;
#pragma unroll
      for (int k = 0; k < SC_R; ++k) {
        if (cv > tv[k]) {
          const float tvk = tv[k];
          const int tik = ti[k];
          tv[k] = cv;
          ti[k] = ci;
          cv = tvk;
          ci = tik;
        }
      }
    } else {
      left = sc_fmax(left, v);
    }
    float c = v;
    for (int j = 0; j < nt; ++j) c = c == -SC_INF ? c : sc_div(c, temps[j]);
    sc_agg_add(a, c);
    if (gumbel && c > -SC_INF && !(sc_add(c, SC_GUMBEL_MAX) < a.gv)) {
      const float g = sc_add(c, -sc_log(-sc_log(sc_uniform(sc_threefry(k0, k1, (unsigned)i, pos)))));
      if (sc_better(g, i, a.gv, a.gid, 1.0f)) { a.gv = g; a.gid = i; }
    }
  }
  a.mx = tv[0];
  a.mid = ti[0];
  sc_agg_block(a, sh, tx);
  // the block's cap largest of the threads' kept logits: the cap-th largest key by four 8-bit radix rounds
  const int me = (int)tx * SC_R;
  int fin = 0;
#pragma unroll
  for (int k = 0; k < SC_R; ++k) {
    sh.cand_raw[me + k] = tv[k];
    sh.cand_id[me + k] = ti[k];
    fin += tv[k] > -SC_INF;
  }
  int total;
  sc_scan(fin, sh, tx, &total);
  unsigned kth = 0u;              // 0: list every finite one
  if (total > cap) {
    unsigned prefix = 0u, need = (unsigned)cap;
    const int lane = tx & 31;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = tx; b < 256; b += SC_T) sh.hist[b] = 0u;
      sc_barrier();
      const unsigned himask = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
#pragma unroll
      for (int k = 0; k < SC_R; ++k) {
        const unsigned key = sc_key(tv[k]);
        if (tv[k] > -SC_INF && (key & himask) == prefix) sc_atomic_add_shared(&sh.hist[(key >> shift) & 255u], 1u);
      }
      sc_barrier();
      if (tx < 32) {       // (bins 255 - 8 lane - j: this lane's eight from the top; a suffix scan)
        unsigned cnt[8], mine = 0u;
        for (int j = 0; j < 8; ++j) { cnt[j] = sh.hist[255 - 8 * lane - j]; mine += cnt[j]; }
        unsigned incl = mine;
        for (int o = 1; o < 32; o <<= 1) {
          const unsigned up = sc_shfl_up(incl, o);
          if (lane >= o) incl += up;
        }
        const unsigned excl = incl - mine;
        if (incl >= need && excl < need) {
          unsigned acc = excl;
          int j = 0;
          for (; j < 7; ++j) { if (acc + cnt[j] >= need) break; acc += cnt[j]; }
          sh.prefix = prefix | ((unsigned)(255 - 8 * lane - j) << shift);
          sh.need = need - acc;
        }
      }
      sc_barrier();
      prefix = sh.prefix;
      need = sh.need;
      sc_barrier();
    }
    kth = prefix;
    int ge = 0;
#pragma unroll
    for (int k = 0; k < SC_R; ++k) ge += tv[k] > -SC_INF && sc_key(tv[k]) >= kth;
    sc_scan(ge, sh, tx, &total);
    if (total > cap) kth += 1u;     // (the ties at the cap-th would overflow: list the ones above it)
  }
  int mine = 0;
  float out = left;
#pragma unroll
  for (int k = 0; k < SC_R; ++k) {
    const bool in = tv[k] > -SC_INF && sc_key(tv[k]) >= kth;
    mine += in;
    if (!in) out = sc_fmax(out, tv[k]);
  }
  int at = sc_scan(mine, sh, tx, &total);
  const float beta = -sc_min(-out, sh, tx);
#pragma unroll
  for (int k = 0; k < SC_R; ++k) {
    if (tv[k] > -SC_INF && sc_key(tv[k]) >= kth) {
      wf[SC_WH + at] = tv[k];
      wi[at] = ti[k];
      ++at;
    }
  }
  if (tx == 0) {
    const SC_TG ScAgg& g = sh.agg;
    wf[0] = sc_i2f(total);
    wf[1] = beta;
    wf[2] = g.cm; wf[3] = g.z; wf[4] = g.e; wf[5] = g.n; wf[6] = g.mean; wf[7] = g.m2; wf[8] = g.gv; wf[9] = g.mx;
    wf[10] = sc_i2f(g.gid);
    wf[11] = sc_i2f(g.mid);
  }
}

// The last block of a row: the slices' aggregates merged (slices in order) and, where the stages read them (copy),
// their candidates into shared memory -- each thread eight of them at a time, their loads issued before any is
// used (the slices' scratch is read at the latency of the GPU's L2, once rather than once a slice); without copy
// the row stays in row mode (ncand -1) for readers other than the aggregates'.
SC_FN void sc_gathered(int NB, int cap, bool copy, SC_TG ScShared& sh, const int tx, const volatile SC_DEV float* wf,
                       const volatile SC_DEV int* wi) {
  const int t = tx;
  ScAgg a = sc_agg_none();
  int n = 0;
  float beta = -SC_INF;
  if (t < NB) {
    const volatile SC_DEV float* h = wf + (size_t)t * (SC_WH + cap);
    n = sc_f2i(h[0]);
    beta = h[1];
    a = ScAgg{h[2], h[3], h[4], h[5], h[6], h[7], h[8], h[9], sc_f2i(h[10]), sc_f2i(h[11])};
  }
  int total;
  const int at = sc_scan(n, sh, tx, &total);
  if (t < NB) sh.soff[t] = at;
  if (t == 0) sh.soff[NB] = total;
  beta = -sc_min(-beta, sh, tx);        // (its barriers publish soff)
  sc_agg_block(a, sh, tx);
  for (int base = t; copy && base < total; base += 8 * SC_T) {
    float rv[8];
    int iv[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int f = base + k * SC_T;
      if (f < total) {              // (its slice: the last q with soff[q] <= f -- empty slices share their soff)
        int lo = 0, hi = NB;
        while (hi - lo > 1) {
          const int mid = (lo + hi) >> 1;
          if (sh.soff[mid] <= f) lo = mid;
          else hi = mid;
        }
        const int o = f - sh.soff[lo];
        rv[k] = wf[(size_t)lo * (SC_WH + cap) + SC_WH + o];
        iv[k] = wi[(size_t)lo * cap + o];
      }
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int f = base + k * SC_T;
      if (f < total) {
        sh.cand_raw[f] = rv[k];
        sh.cand_id[f] = iv[k];
      }
    }
  }
  if (t == 0) {
    sh.ncand = copy ? total : -1;
    sh.beta = beta;
    sh.tail = beta > -SC_INF;
    sh.agg_ok = 1;
    sh.fallback = 0;
    sh.st.rho = -SC_INF;
    sh.st.sigma = SC_INF;
    sh.st.nband = 0;
    sh.st.tlo = SC_INF;
    sh.st.thi = -SC_INF;
    sh.st.tid = 0x7FFFFFFF;
    sh.st.surv = -1;
    sh.st.mraw = sh.agg.mx;
    sh.st.greedy = -1;
    sh.st.nt = 0;
  }
  sc_barrier();
}

// The token's log-probability under the final softmax (0 for a row a temperature 0 decided).
SC_FN float sc_token_lp(const SC_DEV float* xr, int V, int token, SC_TG ScShared& sh, const int tx) {
  if (sh.st.greedy >= 0) return 0.0f;
  const ScView s = sc_view(sh);
  const float m = sc_max(s);
  const float z = sc_norm(xr, V, m, sh, tx);
  return sc_sub(sc_sub(sc_cur(s, token, xr[token]), m), sc_log(z));
}

// The chain's final logits (mode 1) or their softmax (mode 2) for every token of the row, into xo (m, z: the
// softmax's maximum and normalizer).
SC_FN void sc_write(const SC_DEV float* xr, int V, int mode, float m, float z, SC_TG ScShared& sh, const int tx,
                    SC_DEV float* xo) {
  const ScView s = sc_view(sh);
  const int g = sh.st.greedy;
  for (int i = tx; i < V; i += SC_T) {
    const float c = g >= 0 && i != g ? -SC_INF : sc_cur(s, i, xr[i]);
    xo[i] = mode == 1 ? c : g >= 0 ? (i == g ? 1.0f : 0.0f) : sc_div(sc_exp(sc_sub(c, m)), z);
  }
}

// The stages in order; false where one needed the whole row (split mode).
SC_FN bool sc_stages(const SC_DEV float* xr, int V, SC_THR const float* pr, SC_THR const unsigned* ur,
                     const SC_DEV int* S, int jpro,
                          SC_TG ScShared& sh, const int tx) {
  const int n = S[0];
  int f = 0, u = 0;
  for (int j = 0; j < n; ++j) {
    const int op = S[8 + j];
    if (sc_plain_temperature(op, pr, f)) {
      // (after the prologue a temperature changes the softmax the aggregates were taken under)
      if (tx == 0 && j >= jpro && !SAMPLEC_OFF_TEMPERATURE(pr[f])) sh.agg_ok = 0;
      sc_temperature(xr, V, pr[f], sh, tx);
    } else if (sh.st.greedy < 0) {
      switch (op) {
        case SAMPLEC_STAGE_TOP_K: sc_top_k(xr, V, pr[f], sh, tx); break;
        case SAMPLEC_STAGE_TOP_P: sc_top_p(xr, V, pr[f], sh, tx); break;
        case SAMPLEC_STAGE_MIN_P: sc_min_p(xr, V, pr[f], sh, tx); break;
        case SAMPLEC_STAGE_XTC: sc_xtc(xr, V, pr[f], pr[f + 1], ur[u], ur[u + 1], ur[u + 2], sh, tx); break;
        case SAMPLEC_STAGE_TOP_N_SIGMA: sc_top_n_sigma(xr, V, pr[f], sh, tx); break;
        case SAMPLEC_STAGE_TYPICAL_P: sc_typical(xr, V, pr[f], sh, tx); break;
        case SAMPLEC_STAGE_EPSILON: sc_epsilon_eta(xr, V, pr[f], false, sh, tx); break;
        case SAMPLEC_STAGE_ETA: sc_epsilon_eta(xr, V, pr[f], true, sh, tx); break;
        case SAMPLEC_STAGE_DYNAMIC_TEMPERATURE:
          sc_dynamic_temperature(xr, V, pr[f], pr[f + 1], pr[f + 2], sh, tx); break;
        case SAMPLEC_STAGE_TOP_K_RANK: sc_top_k_rank(xr, V, pr[f], sh, tx); break;
        default: break;
      }
    }
    f += sc_nf(op);
    u += sc_nu(op);
    if (sc_fell_back(sh, tx)) return false;
  }
  return true;
}

// The row's edits before the stages, from the logits up: logit_bias (eb: x + b), allow (em: a bool per token, or ew:
// packed bits, bit j of word w for token 32 w + j; false: -inf) and up to SC_MAX_PEN penalties stages (ph: the row of
// their histories side by side, padding < 0; pv: each stage's last_n, repeat, frequency, presence and its history's
// offset and length in ph; np stages, 0: none), the bias and the allow each before or after the penalties (bias_after,
// allow_after). With the penalties the kernel also gives each stage's check (pf[j]: a logit it penalized to +inf or
// NaN, or its row left with no value above -inf), the parts counted over the row's blocks in pc (two a stage).
#define SC_MAX_PEN 4       // gpu.MAX_PENALTIES
#define SC_EDIT_CODES 9    // gpu.EDIT_CODES: S's words for the edits (chain_codes); the raw? word follows them

struct ScEdits {
  const SC_DEV float* eb;
  const SC_DEV bool* em;
  const SC_DEV int* ew;
  const SC_DEV int* ph;
  const SC_DEV float* pv;
  int L, np, bias_after, allow_after;
  SC_DEV bool* pf;         // the row's check flags, one a stage
  SC_DEV int* pc;          // split mode: the row's counts (blocks with a bad value, blocks with a live one), a stage
  SC_DEV float* rmax;      // the edited row's maximum (the top edit's checks read it)
  SC_DEV float* pmax;      // split mode: each block's maximum of its part
};

SC_INLINE bool sc_has_edits(ScEdits e) { return e.eb || e.em || e.ew || e.np > 0; }

SC_INLINE bool sc_removed(ScEdits e, int i) {
  return (e.em && !e.em[i]) || (e.ew && ((e.ew[i >> 5] >> (i & 31)) & 1) == 0);
}

SC_INLINE int sc_window_at(const SC_DEV int* h, SC_TG ScShared& sh, bool shared, int w0, int k) {
  return shared ? sh.cand_id[k - w0] : h[k];
}

// Penalties stage j (spec section 2) on the tokens [lo, hi) of the edited row xe: c = a token's count in the last
// last_n history entries (-1: all); where c > 0, x <- (x > 0 ? x / repeat : x * repeat) - (c * frequency +
// presence), each operation rounded as the dense definition rounds it. A token's first entry in the window counts it
// (an entry a thread: each scans the window, from shared memory where the window fits the candidates' arrays, which
// the stages fill only later), so each penalized token is written once. Whether it wrote a +inf or NaN.
SC_FN bool sc_penalize(ScEdits e, int j, int lo, int hi, SC_DEV float* xe, SC_TG ScShared& sh, const int tx) {
  SC_DEV const float* v6 = e.pv + 6 * j;     // (last_n, repeat, frequency, presence, offset, length)
  const int last_n = (int)v6[0], L = (int)v6[5];
  const float rep = v6[1], freq = v6[2], pres = v6[3];
  const SC_DEV int* h = e.ph + (int)v6[4];
  const int w0 = last_n < 0 ? 0 : (last_n >= L ? 0 : L - last_n);
  const bool shared = L - w0 <= SC_CAP;
  sc_barrier();                     // (a previous stage's readers of the window are done)
  if (shared) {
    for (int k = w0 + tx; k < L; k += SC_T) sh.cand_id[k - w0] = h[k];
  }
  sc_barrier();
  bool bad = false;
  for (int i = w0 + tx; i < L; i += SC_T) {
    const int t = sc_window_at(h, sh, shared, w0, i);
    if (t < lo || t >= hi) continue;          // (padding, < 0, and other slices' tokens)
    bool first = true;
    for (int k = w0; k < i && first; ++k) first = sc_window_at(h, sh, shared, w0, k) != t;
    if (!first) continue;
    int c = 1;
    for (int k = i + 1; k < L; ++k) c += sc_window_at(h, sh, shared, w0, k) == t ? 1 : 0;
    float v = xe[t];
    v = v > 0.0f ? sc_div(v, rep) : sc_mul(v, rep);
    v = sc_sub(v, sc_add(sc_mul((float)c, freq), pres));
    xe[t] = v;
    if (v != v || v == SC_INF) bad = true;
  }
  sc_barrier_device();
  return bad;
}

// One stage's check over the block's part: its counts (split mode: into pc for the row's last block) or its flag.
SC_INLINE void sc_check_part(ScEdits e, int j, bool bad, bool live, SC_TG ScShared& sh, const int tx, int NB) {
  if (tx == 0) sh.ebad = sh.elive = 0u;
  sc_barrier();
  if (bad) sc_atomic_add_shared(&sh.ebad, 1u);
  if (live) sc_atomic_add_shared(&sh.elive, 1u);
  sc_barrier();
  if (tx == 0) {
    if (NB > 0) {                   // (the row's last block reads the counts: sc_edit_check)
      if (sh.ebad) sc_atomic_add_global(e.pc + 2 * j, 1);
      if (sh.elive) sc_atomic_add_global(e.pc + 2 * j + 1, 1);
    } else {
      e.pf[j] = sh.ebad != 0u || sh.elive == 0u;
    }
  }
}

// The edits for tokens [lo, hi) into xe, which the chain reads from then on; with the penalties, their checks; and
// the edited row's maximum (block `slice`'s part of it in split mode).
SC_FN void sc_edit(const SC_DEV float* xr, int lo, int hi, ScEdits e, SC_DEV float* xe, SC_TG ScShared& sh,
                   const int tx, int NB, int slice) {
  const bool pen = e.np > 0;
  const bool bias_first = e.eb && !(pen && e.bias_after), mask_first = !(pen && e.allow_after);
  float top = -SC_INF;
  for (int i = lo + tx; i < hi; i += SC_T) {
    float v = xr[i];
    if (bias_first) v = sc_add(v, e.eb[i]);
    if (mask_first && sc_removed(e, i)) v = -SC_INF;
    xe[i] = v;
    top = sc_fmax(top, v);
  }
  sc_barrier_device();              // (the block's writes to xe visible to the block)
  for (int j = 0; j < e.np; ++j) {
    const bool bad = sc_penalize(e, j, lo, hi, xe, sh, tx);
    const bool last = j == e.np - 1;
    bool live = false;
    if (last) top = -SC_INF;
    for (int i = lo + tx; i < hi; i += SC_T) {
      float v = xe[i];
      live = live || v != -SC_INF;
      if (!last) continue;
      if (e.eb && e.bias_after) v = sc_add(v, e.eb[i]);
      if (!mask_first && sc_removed(e, i)) v = -SC_INF;
      xe[i] = v;
      top = sc_fmax(top, v);
    }
    sc_check_part(e, j, bad, live, sh, tx, NB);
    sc_barrier_device();
  }
  top = -sc_min(-top, sh, tx);
  if (tx == 0) {
    if (NB > 0) e.pmax[slice] = top;      // (the row's last block takes the largest: sc_edit_check)
    else *e.rmax = top;
  }
}

// Split mode, in the row's last block (every block's parts in): the penalties' checks and the edited row's maximum.
SC_INLINE void sc_edit_check(ScEdits e, int NB, const int tx) {
  if (tx != 0) return;
  for (int j = 0; j < e.np; ++j) e.pf[j] = e.pc[2 * j] != 0 || e.pc[2 * j + 1] == 0;
  float top = -SC_INF;
  for (int b = 0; b < NB; ++b) top = sc_fmax(top, e.pmax[b]);
  *e.rmax = top;
}

// The logits' own maximum and log-sum-exp, before any edit: the logits checks' maximum (NaN where a logit is NaN, as
// MLX's reduction gives it) and raw_logprob's and top_logprobs' normalizer, log(sum(exp(x - maximum))). The block
// takes its tokens [lo, hi): one block a row writes rs[1] (the maximum) and rs[2] (the log-sum-exp); in split mode
// each block leaves its part -- (maximum, sum of exp(x - maximum), NaNs seen) -- in part, and the row's last block
// combines them (sc_raw_combine).
SC_FN void sc_raw_stats(const SC_DEV float* xr, int lo, int hi, SC_TG ScShared& sh, const int tx, SC_DEV float* rs,
                        SC_DEV float* part) {
  float m = -SC_INF, nan = 0.0f;
  for (int i = lo + tx; i < hi; i += SC_T) {
    const float v = xr[i];
    if (v != v) nan = 1.0f;
    else m = sc_fmax(m, v);
  }
  m = -sc_min(-m, sh, tx);
  nan = sc_sum(nan, sh, tx);
  float z = 0.0f;
  for (int i = lo + tx; i < hi; i += SC_T) z += sc_exp(sc_sub(xr[i], m));
  z = sc_sum(z, sh, tx);
  if (tx != 0) return;
  if (part) {
    part[0] = m;
    part[1] = z;
    part[2] = nan;
  } else {
    rs[1] = nan > 0.0f ? SC_NAN : m;
    rs[2] = sc_log(z);
  }
}

// Split mode, in the row's last block: the slices' parts of the logits' maximum and log-sum-exp (sc_raw_stats).
SC_INLINE void sc_raw_combine(int NB, const SC_DEV float* part, SC_DEV float* rs, const int tx) {
  if (tx != 0) return;
  float m = -SC_INF, nan = 0.0f, z = 0.0f;
  for (int b = 0; b < NB; ++b) {
    m = sc_fmax(m, part[3 * b]);
    nan += part[3 * b + 2];
  }
  for (int b = 0; b < NB; ++b) {
    const float mb = part[3 * b];
    if (mb != -SC_INF) z += sc_mul(part[3 * b + 1], sc_exp(sc_sub(mb, m)));
  }
  rs[1] = nan > 0.0f ? SC_NAN : m;
  rs[2] = sc_log(z);
}

// One row's chain. S: gpu.chain_codes' [#stages, sample?, want_logprob?, #float operands, #key words, output mode
// (0: none, 1: the final logits, 2: their softmax), NB (slices a row; 0: one block a row), cap (candidates a slice
// keeps), stage codes..., then the operand slots' strides, then the edits'] with the stage table's codes
// (stage_table.h, generated from samplec/stage_table.py; gpu.chain_header puts it first).
// pr: the row's float operands in order; ur: each xtc's and the sample's key words and position, in order; e: the
// row's edits (sc_edit), xe: the edited row's scratch. In split mode (NB > 0) the block
// is slice `slice` of the row; wf, wi: the row's scratch; cnt: the row's arrival counter (zero before the launch).
// rs: where the row's logits' maximum and log-sum-exp go (rs[1], rs[2]; nullptr: not asked for), and the logit at
// the token (rs[3]: raw_logprob's), raw: in split mode, the row's slices' parts of them.
SC_FN void sc_chain(const SC_DEV float* xr, int V, SC_THR const float* pr, SC_THR const unsigned* ur,
                    const SC_DEV int* S, SC_TG ScShared& sh, const int tx, SC_DEV int* tok, SC_DEV float* lp,
                    SC_DEV float* xo, int slice, SC_DEV float* wf, SC_DEV int* wi, SC_DEV int* cnt,
                    ScEdits e, SC_DEV float* xe, SC_DEV float* rs, SC_DEV float* raw) {
  const int n = S[0], NB = S[6], cap = S[7];
  int f = 0, u = 0;
  for (int j = 0; j < n; ++j) { f += sc_nf(S[8 + j]); u += sc_nu(S[8 + j]); }
  const int len = NB > 0 ? ((V + NB - 1) / NB + 3) & ~3 : V;
  const int lo = NB > 0 ? sc_imin(V, slice * len) : 0, hi = sc_imin(V, lo + len);
  const SC_DEV float* x0 = xr;      // (the logits as the model gave them: rs[3] reads the token's)
  if (rs) sc_raw_stats(xr, lo, hi, sh, tx, rs, NB > 0 ? raw + 3 * slice : nullptr);
  if (sc_has_edits(e)) {            // (split mode: each block its slice, all before the last block reads the row)
    sc_edit(xr, lo, hi, e, xe, sh, tx, NB, slice);
    xr = xe;
  }
  int jpro = 0;
  if (NB > 0) {
    float temps[SC_MAX_TEMPS];
    int nt;
    jpro = sc_prologue(S, pr, ur, V, temps, &nt);
    sc_slice(xr, lo, hi, temps, nt, S[1] != 0 && jpro == n, ur[u], ur[u + 1], ur[u + 2], cap, sh, tx,
             wf + (size_t)slice * (SC_WH + cap), wi + (size_t)slice * cap);
    sc_device_fence();                // (this block's scratch visible before its arrival counts)
    sc_barrier();
    if (tx == 0) sh.last = sc_atomic_add_global(cnt, 1) == NB - 1;
    sc_barrier();
    if (!sh.last) return;
    sc_device_fence();
    if (sc_has_edits(e)) sc_edit_check(e, NB, tx);
    if (rs) sc_raw_combine(NB, raw, rs, tx);
    // (a draw right after the prologue reads the slices' best perturbed logits alone: no candidate is copied)
    sc_gathered(NB, cap, !(S[1] != 0 && jpro == n), sh, tx, wf, wi);
  }
  for (int attempt = NB > 0 ? 0 : 1; attempt < 2; ++attempt) {
#ifdef SC_SPLIT_ONLY                // (tests: a row the candidates did not settle reads token -1)
    if (attempt == 1 && NB > 0) {
      if (tx == 0) *tok = -1;
      return;
    }
#endif
    if (attempt == 1) sc_begin(xr, V, sh, tx);
    if (!sc_stages(xr, V, pr, ur, S, jpro, sh, tx)) continue;
    const int token = sh.st.greedy >= 0 ? sh.st.greedy
                      : S[1] ? sc_sample(xr, V, ur[u], ur[u + 1], ur[u + 2], sh, tx) : sc_argmax(xr, V, sh, tx);
    if (sc_fell_back(sh, tx)) continue;
    const float l = S[2] ? sc_token_lp(xr, V, token, sh, tx) : 0.0f;
    float m = 0.0f, z = 1.0f;
    if (S[5] == 2 && sh.st.greedy < 0) {
      m = sc_max(sc_view(sh));
      z = sc_norm(xr, V, m, sh, tx);
    }
    if (sc_fell_back(sh, tx)) continue;
    if (tx == 0) {
      *tok = token;
      *lp = l;
      if (rs) rs[3] = token >= 0 && token < V ? x0[token] : SC_NAN;     // (raw_logprob's logit)
    }
    if (S[5] != 0) sc_write(xr, V, S[5], m, z, sh, tx, xo);
    return;
  }
}
