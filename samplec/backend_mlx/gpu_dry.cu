// DRY on a GPU (the `dry` op; its definition: samplec/frontend/expand.py's `dry`), one block (threadgroup) a row,
// beside the chain kernel: out = the row x with the penalty of every token that would extend a repeat of the
// history, where the definition runs ~30 MLX ops (a sort of the history, the repeat lengths of every position pair,
// gathers, exps, a scatter). Per row:
//   1. the history's tokens in order, padding (ids < 0) dropped, into win [H] (each thread a contiguous chunk,
//      placed by a scan of the chunks' counts), and its last L = last_n (-1: all) of them the window c [L];
//   2. rep_limit: the window's entries after its last breaker (L without one);
//   3. for each window position p >= 1, S[p] = how many of the tokens before p, walking back, equal the window's
//      last ones (at most as many as can change the penalty); rep[t] = the largest S[p] over the positions p holding
//      t (an atomic maximum a position);
//   4. out = x, and at each window token t with n = min(rep[t], rep_limit) >= allowed_length (not a breaker):
//      x[t] - multiplier * base^(n - allowed_length), in float32 as the definition computes it (the exponent capped
//      where base^e leaves float32, the product taken in halves near the cap).
// The stage table's off rule (SAMPLEC_OFF_DRY: multiplier == 0) copies the row. Written once over the SIMT dialect
// layer (simt_cuda.h, simt_metal.h); tests/test_gpu_beside.py runs both dialects on the CPU against the definition.

struct DrShared {
  int count[SC_T];          // each thread's count of history tokens in its chunk, then its chunk's first place
  int best[SC_T];           // each thread's last breaker in the window (-1: none)
  int n, limit;             // the history's tokens, and rep_limit
};

// The exponent past which the definition caps base^e (where it leaves float32), 0 for none (base near 1).
SC_INLINE int dr_max_exp(float base) { return base > 1.000001f ? (int)sc_div(88.7228391f, sc_log(base)) : 0; }

// The row's penalty of a repeat of length n (n >= allowed): multiplier * base^(n - allowed), as the definition rounds.
SC_INLINE float dr_penalty(int n, float mult, float base, int allowed) {
  const float log_base = sc_log(base);
  const int max_exp = dr_max_exp(base);
  int e = n - allowed;
  if (max_exp > 0 && e > max_exp) e = max_exp;
  const float arg = sc_mul((float)e, log_base);
  if (arg > 80.0f) {
    const float half = sc_exp(sc_mul(arg, 0.5f));
    return sc_mul(sc_mul(mult, half), half);
  }
  return sc_mul(mult, sc_exp(arg));
}

// Row x [V], history h [H]; brk: the breaker tokens' flags [V] where has_brk. out [V]; rep [V] and win [H]: scratch.
SC_FN void dr_dry(const SC_DEV float* x, const SC_DEV int* h, int H, int V, float mult, float base, int allowed,
                  int last_n, const SC_DEV bool* brk, bool has_brk, SC_DEV float* out, SC_DEV int* rep,
                  SC_DEV int* win, SC_TG DrShared& sh, const int tx) {
  if (SAMPLEC_OFF_DRY(mult)) {
    for (int t = tx; t < V; t += SC_T) out[t] = x[t];
    return;
  }
  // 1. the history's tokens in order: each thread counts its chunk, thread 0 scans the counts, each places its own
  const int chunk = (H + SC_T - 1) / SC_T, lo = sc_imin(H, tx * chunk), hi = sc_imin(H, lo + chunk);
  int mine = 0;
  for (int i = lo; i < hi; ++i) mine += h[i] >= 0;
  sh.count[tx] = mine;
  sc_barrier();
  if (tx == 0) {
    int acc = 0;
    for (int i = 0; i < SC_T; ++i) {
      const int c = sh.count[i];
      sh.count[i] = acc;
      acc += c;
    }
    sh.n = acc;
  }
  sc_barrier();
  for (int i = lo, at = sh.count[tx]; i < hi; ++i)
    if (h[i] >= 0) win[at++] = h[i];
  const int n = sh.n, L = last_n == -1 ? n : sc_imin(n, last_n);
  const SC_DEV int* c = win + (n - L);
  sc_barrier_device();                  // (the window written before any thread reads it)
  // 2. the window's last breaker
  int last = -1;
  if (has_brk)
    for (int j = tx; j < L; j += SC_T)
      if (brk[sc_imin(c[j], V - 1)]) last = j;
  sh.best[tx] = last;
  sc_barrier();
  if (tx == 0) {
    int b = -1;
    for (int i = 0; i < SC_T; ++i) b = sh.best[i] > b ? sh.best[i] : b;
    sh.limit = b >= 0 ? L - 1 - b : L;
  }
  sc_barrier();
  const int limit = sh.limit;
  for (int t = tx; t < V; t += SC_T) out[t] = x[t];
  if (!(L > allowed && limit >= allowed)) return;
  // 3. the longest repeat each window token would extend, counted no further than it can change the row: past
  //    rep_limit the definition clamps it, and past allowed + the capped exponent the penalty is the same (a history
  //    that repeats one token walks O(L x that cap), not O(L^2))
  const int max_exp = dr_max_exp(base);
  const int cap = max_exp > 0 && allowed < limit - max_exp ? allowed + max_exp : limit;
  for (int j = tx; j < L; j += SC_T) rep[sc_imin(c[j], V - 1)] = -1;
  sc_barrier_device();                  // (the -1s written before any thread raises one)
  for (int p = 1 + tx; p < L; p += SC_T) {
    int s = 0;
    while (s < p && s < cap && c[p - 1 - s] == c[L - 1 - s]) ++s;
    sc_atomic_max_global(rep + sc_imin(c[p], V - 1), s);
  }
  sc_barrier_device();                  // (every length raised, and the row copied, before the penalties)
  // 4. the penalties: every entry of a token writes the same value
  for (int j = tx; j < L; j += SC_T) {
    const int t = sc_imin(c[j], V - 1);
    const int len = sc_imin(rep[t], limit);
    if (len >= allowed && !(has_brk && brk[t])) out[t] = sc_sub(x[t], dr_penalty(len, mult, base, allowed));
  }
}
