// top_logprobs' ids and values on a GPU, beside the chain kernel: the k largest of log_softmax(x) = (x - max) - log Z
// of each row (max and log Z from the chain kernel's pass over the logits), descending, the lower id first among
// equal log-probabilities -- the CPU's top_logprob_ids (native/src/select.h), one block (threadgroup) a row. The
// selection runs on x (log_softmax keeps its order: x - c rounds monotonically) with `margin` more (kk = k + margin
// in all): the kk largest keys of x (the lower ids first at the kk-th), by four rounds of an 8-bit radix select;
// then those kk are ranked by their log-probabilities, computed as MLX computes them ((x - max) - log Z), so that
// logits that differ but round to one log-probability come lower id first. (A tie group of log-probabilities reaching
// past kk would need that many logits within one rounding step of each other: gpu.TIE_MARGIN.)
//
// Written once over the SIMT dialect layer (simt_cuda.h, simt_metal.h), as gpu_chain.cu is: gpu.py wraps it in
// each language's entry (gpu.TOP_LOGPROBS_ENTRY) and tests/test_gpu_beside.py runs both dialects on the CPU.

#define TL_MAXK 72          // kk at most (gpu.TOP_LOGPROBS_MAX): the candidates ranked in shared memory

struct TlShared {
  unsigned hist[256];       // a radix round's histogram of one byte of the keys
  unsigned prefix, need;    // the kk-th largest key's bytes so far, and how many of the keys with them are chosen
  unsigned above;           // slots taken by the keys above the kk-th (an atomic counter)
  unsigned before[SC_T];    // each thread's count of keys equal to the kk-th, then the count before its ids
  float lp[TL_MAXK];        // the candidates' log-probabilities and ids
  int id[TL_MAXK];
};

// A float's key: larger floats have larger keys (-0 is +0; a NaN with the sign bit clear is above +inf).
SC_INLINE unsigned tl_key(float v) {
  const unsigned b = sc_f2u(v == 0.0f ? 0.0f : v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Row xr [V]: ids[0, k) and vals[0, k) of its k largest log-probabilities (m: the row's maximum, lz: its log Z).
SC_FN void tl_top_logprobs(const SC_DEV float* xr, int V, float m, float lz, int k, int kk, SC_DEV int* ids,
                           SC_DEV float* vals, SC_TG TlShared& sh, const int tx) {
  // the kk-th largest key: one byte a round, from the top; `need` of the keys equal to it are chosen
  unsigned prefix = 0u, need = (unsigned)kk;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tx; i < 256; i += SC_T) sh.hist[i] = 0u;
    sc_barrier();
    const unsigned himask = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
    int bin = -1;
    unsigned run = 0u;      // (a run of one bin counted in a register: a row of equal logits is one atomic a thread)
    for (int i = tx; i < V; i += SC_T) {
      const unsigned key = tl_key(xr[i]);
      if ((key & himask) != prefix) continue;
      const int b = (int)((key >> shift) & 255u);
      if (b != bin) {
        if (run) sc_atomic_add_shared(&sh.hist[bin], run);
        bin = b;
        run = 0u;
      }
      ++run;
    }
    if (run) sc_atomic_add_shared(&sh.hist[bin], run);
    sc_barrier();
    if (tx == 0) {
      unsigned acc = 0u;
      int b = 255;
      for (; b > 0; --b) {
        if (acc + sh.hist[b] >= need) break;
        acc += sh.hist[b];
      }
      sh.prefix = prefix | ((unsigned)b << shift);
      sh.need = need - acc;
      sh.above = 0u;
    }
    sc_barrier();
    prefix = sh.prefix;
    need = sh.need;
    sc_barrier();
  }
  // the candidates: every key above the kk-th (kk - need of them, in any order), then the need lowest ids of those
  // equal to it -- each thread's ids a contiguous range, so that a scan of the threads' counts orders them
  const int chunk = (V + SC_T - 1) / SC_T;
  const int lo = sc_imin(V, tx * chunk), hi = sc_imin(V, lo + chunk);
  unsigned equal = 0u;
  for (int i = lo; i < hi; ++i) {
    const unsigned key = tl_key(xr[i]);
    if (key > prefix) {
      sh.id[sc_atomic_add_shared(&sh.above, 1u)] = i;
    } else if (key == prefix) {
      ++equal;
    }
  }
  sh.before[tx] = equal;
  sc_barrier();
  if (tx == 0) {
    unsigned acc = 0u;
    for (int t = 0; t < SC_T; ++t) {
      const unsigned c = sh.before[t];
      sh.before[t] = acc;
      acc += c;
    }
  }
  sc_barrier();
  const unsigned base = (unsigned)kk - need;
  unsigned r = sh.before[tx];
  for (int i = lo; i < hi && r < need; ++i) {
    if (tl_key(xr[i]) == prefix) sh.id[base + r++] = i;
  }
  sc_barrier();
  // ranked by log-probability, descending, the lower id first among equal ones (by key: each place is one rank)
  for (int i = tx; i < kk; i += SC_T) sh.lp[i] = sc_sub(sc_sub(xr[sh.id[i]], m), lz);
  sc_barrier();
  for (int i = tx; i < kk; i += SC_T) {
    const unsigned ki = tl_key(sh.lp[i]);
    const int di = sh.id[i];
    int rank = 0;
    for (int j = 0; j < kk; ++j) {
      const unsigned kj = tl_key(sh.lp[j]);
      rank += (kj > ki || (kj == ki && sh.id[j] < di)) ? 1 : 0;
    }
    if (rank < k) {
      ids[rank] = di;
      vals[rank] = sh.lp[i];
    }
  }
}
