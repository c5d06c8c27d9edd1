// DRY's repeat lengths on a GPU (the `dry_repeats` op, kernels._dry_repeats' definition), one block (threadgroup) a
// row: out[t] = the largest S[p] over the history positions p >= 1 whose token h[p] is t (h[p] and h[p - 1] not
// padding), -1 where there is none; S[p] = the length of the common suffix of h[0, p) and h (how far back the tokens
// before p repeat the history's last ones). Each thread takes positions p and walks back from p - 1 and from the end
// while the tokens agree: O(H * the longest repeat) a row, where the MLX ops compare every pair of positions
// ([B, H - 1, H]) in ~10 launches. Written once over the SIMT dialect layer (simt_cuda.h, simt_metal.h);
// tests/test_gpu_beside.py runs both dialects on the CPU.

SC_FN void dr_repeats(const SC_DEV int* h, int H, int V, SC_DEV int* out, const int tx) {
  for (int t = tx; t < V; t += SC_T) out[t] = -1;
  sc_barrier_device();                  // (the row's -1s written before any thread raises one)
  for (int p = 1 + tx; p < H; p += SC_T) {
    const int token = h[p];
    if (token < 0 || h[p - 1] < 0) continue;
    int s = 0;
    while (s < p && h[H - 1 - s] >= 0 && h[p - 1 - s] == h[H - 1 - s]) ++s;
    sc_atomic_max_global(out + (token < V ? token : V - 1), s);    // (an id past V: V - 1, as the definition clamps)
  }
}
