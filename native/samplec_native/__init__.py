"""MLX CPU kernels for samplec. `samplec.backend_mlx.native` decides when to use them."""
from samplec_native._ext import (chain_stages, argmax_put, argmax_take, block_max, dry_repeats, edited_logsumexp, evaluate, helped, hold, release, set_parts_wait,  # noqa: F401
                                 history_check, row_logsumexp,
                                 penalty_edits, row_max, row_softmax, sample_chain, top_logprob_ids, spin_wait, threefry_bits, threefry_words,
                                 topk_select, wake)

__all__ = ["chain_stages", "threefry_bits", "threefry_words", "block_max", "topk_select", "argmax_take", "spin_wait", "hold", "release", "wake",
           "evaluate", "sample_chain", "row_logsumexp", "row_max", "row_softmax", "argmax_put", "penalty_edits",
           "top_logprob_ids", "edited_logsumexp", "history_check", "helped", "set_parts_wait", "dry_repeats"]
