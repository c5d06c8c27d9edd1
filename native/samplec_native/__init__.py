"""MLX CPU primitives for samplec's kernels. `samplec.backend_mlx.native` decides when to use them."""
from samplec_native._ext import (argmax_take, block_candidates, block_ids, block_max, block_max_top,  # noqa: F401
                                 block_tokens, block_top, evaluate, hold, mass_above, release, row_logsumexp, spin_wait,
                                 sample_chain, take_tokens, threefry_bits, topk_select, wake)

__all__ = ["threefry_bits", "block_max", "block_top", "block_ids", "take_tokens", "topk_select", "mass_above",
           "argmax_take", "block_candidates", "block_max_top", "block_tokens", "spin_wait", "hold", "release",
           "wake", "evaluate", "sample_chain", "row_logsumexp"]
