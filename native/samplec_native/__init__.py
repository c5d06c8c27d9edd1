"""MLX CPU primitives for samplec's -O2 plans. `samplec.backend_mlx.native` decides when to use them."""
from samplec_native._ext import (block_ids, block_max, block_top, mass_above, take_tokens,  # noqa: F401
                                 threefry_bits, topk_select)

__all__ = ["threefry_bits", "block_max", "block_top", "block_ids", "take_tokens", "topk_select", "mass_above"]
