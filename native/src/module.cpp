// samplec-native's Python module: MLX CPU kernels for samplec (the sampler chain, log-softmax normalizers,
// RandomBits, selections), compiled as one translation unit from the headers beside this file.

#include "runtime.h"
#include "rng.h"
#include "select.h"
#include "edits.h"
#include "row_ops.h"
#include "sample_chain.h"

NB_MODULE(_ext, m) {
  m.doc() = "MLX CPU kernels for samplec";
  m.attr("chain_stages") = SAMPLEC_STAGE_COUNT;   // the stage codes sample_chain knows: 0 .. chain_stages - 1
  m.def("threefry_bits", &threefry_bits, nb::arg("seed"), nb::arg("c0"), nb::arg("c1"),
        "First word of Threefry-2x32-20(key(seed), (c0, c1)): seed uint64, counters uint32 or int32 (their "
        "uint32 bits), each [B, C] or [B] (read as [B, 1]), broadcasting: one MLX primitive on the CPU.");
  m.def("threefry_words", &threefry_words_checked, nb::arg("k0"), nb::arg("k1"), nb::arg("c0"), nb::arg("c1"),
        "[both output words of Threefry-2x32-20 for key (k0, k1) and counter (c0, c1), then the first word from "
        "each of the sixteen lanes of the draws' vectorized path] (for tests against the known answers).");
  m.def("block_max", &block_max, nb::arg("x"), nb::arg("block_size"));
  m.def("topk_select", &topk_select, nb::arg("x"), nb::arg("k"), nb::arg("gathers") = std::vector<mx::array>{},
        nb::arg("low") = false,
        "[positions of the k largest ascending, the (k+1)-th largest, (with low: the smallest of the k), then each "
        "gathered array at the positions].");
  m.def("argmax_take", &argmax_take, nb::arg("x"), nb::arg("gathers") = std::vector<mx::array>{},
        nb::arg("flat") = false, "[argmax [B, 1], then each gathered array there, [B, 1] or (flat) [B]].");
  m.def("sample_chain", &sample_chain, nb::arg("x"), nb::arg("params"), nb::arg("stages"), nb::arg("terminal"),
        nb::arg("want_logprob"), nb::arg("want_x") = false, nb::arg("want_probs") = false,
        nb::arg("edits") = std::vector<mx::array>{}, nb::arg("want_top") = false, nb::arg("want_raw") = false,
        nb::arg("top_n") = 0, nb::arg("margin") = 0, nb::arg("prefix") = std::vector<int>{},
        nb::arg("prefix_arrays") = std::vector<mx::array>{}, nb::arg("prefix_max") = std::vector<bool>{},
        nb::arg("n_pre") = 0,
        "The sampler chain (stage and terminal codes: the stage table's, samplec/stage_table.py) on each row of "
        "x: [token [B, 1], logprob [B, 1], (want_x) the final logits [B, V] or (want_probs) their softmax, "
        "(want_top) MLX's argmax of x and x there ([B, 1]) and the logits checks' flags there (NaN or +inf; "
        "-inf: [B] bool), (want_raw) x's max, log-sum-exp and the token's log-probability under softmax(x), each "
        "[B, 1], (top_n > 0, with want_raw) top_logprob_ids(x, max, log-sum-exp, top_n, margin): ids [B, top_n] "
        "and values [B, top_n], then for each prefix op with prefix_max its result's maximum [B, 1]]. `prefix` "
        "(the stage table's edit codes of allow and logit_bias) with `prefix_arrays` (bool or f32, [B, V] or "
        "[1, V]): allow and logit_bias ops in order, the first n_pre below the edits "
        "(penalty_edits read x through them), the others above.");
  m.def("penalty_edits", &penalty_edits, nb::arg("x"), nb::arg("hist"), nb::arg("last_n"), nb::arg("repeat"),
        nb::arg("frequency"), nb::arg("presence"), nb::arg("prior") = std::vector<mx::array>{},
        nb::arg("pre") = std::vector<int>{}, nb::arg("pre_arrays") = std::vector<mx::array>{},
        "penalties' edits: [ids [B, P + H] int32, penalized values [B, P + H] float32, overflow [B] bool] (the "
        "prior edits, P of them, then the window's ids, 0 where an entry does not count; the logits there "
        "penalized; whether one is +inf). `pre` (codes: 0 a mask, 1 a bias) with `pre_arrays`: ops the logits "
        "pass through first, in order (allow and logit_bias below the penalties).");
  m.def("edited_logsumexp", &edited_logsumexp, nb::arg("x"), nb::arg("ids"), nb::arg("vals"), nb::arg("idx"),
        "Log-probabilities at idx under put_along(x, ids, vals) and under x, then x's max and log-sum-exp.");
  m.def("history_check", &history_check, nb::arg("ids"), nb::arg("V"),
        "(ids with each id >= V replaced by -1, a flag [B] per row that held one): a history's input check.");
  m.def("dry_repeats", &dry_repeats, nb::arg("w"), nb::arg("x"),
        "DRY's repeat lengths: [B, V] int32, at each token the longest common suffix of the window before one of "
        "its positions and the whole window (-1: none), from the Z-algorithm over the reversed window.");
  m.def("argmax_put", &argmax_put, nb::arg("x"), nb::arg("ids"), nb::arg("vals"),
        "argmax of put_along(x, ids, vals) along the rows, without writing it: [B, 1] int32.");
  m.def("row_logsumexp", &row_logsumexp, nb::arg("x"),
        "[B, 2]: each row's maximum and the log of the sum of exp(x - maximum) (x 2-D float32).");
  m.def("top_logprob_ids", &top_logprob_ids, nb::arg("x"), nb::arg("m"), nb::arg("lz"), nb::arg("k"), nb::arg("margin"),
        "[ids [B, k] int32, values [B, k]]: the k largest (x - max) - log Z (m, lz: [B, 1]), descending, lower "
        "id first on ties; selected on x with `margin` more.");
  m.def("row_max", &row_max, nb::arg("x"), "[B, 1]: the maximum of each row of a 2-D float32 array (a NaN wins).");
  m.def("row_softmax", &row_softmax, nb::arg("x"),
        "softmax along the rows of a 2-D float32 array: exp(x - max) / sum, the exps vectorized, the sum in double.");
  m.def("hold", &hold, nb::arg("max_us"));
  m.def("wake", &wake, nb::arg("max_us"), "Open a hold and queue it (mx.async_eval(hold(max_us))).");
  m.def("evaluate", &evaluate, nb::arg("arrays"), nb::arg("spin_us"), nb::call_guard<nb::gil_scoped_release>(),
        "mx.async_eval(arrays), release(), then spin_wait(arrays, spin_us).");
  m.def("release", &release);
  m.def("helped", [] { return g_helped.load(); },
        "How many parts of the kernels' work waiting callers have run in this process (see `split`).");
  m.def("set_parts_wait", [](double us) { g_parts_wait_us.store(us); }, nb::arg("us"),
        "Tests: MLX's worker waits up to `us` for a waiting caller to take a kernel's first part (0: it does not).");
  m.def("spin_wait", &spin_wait, nb::arg("arrays"), nb::arg("spin_us"), nb::call_guard<nb::gil_scoped_release>());
}
