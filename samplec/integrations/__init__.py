"""Adapters that plug compiled samplec programs into other inference stacks (optional dependencies).

- `samplec.integrations.mlx_lm`: `Sampler`, usable as `sampler=` / `logits_processors=` in mlx-lm's
  `generate_step`, `generate` and `stream_generate` (needs mlx-lm: `pip install -e ".[mlx-lm]"` in a checkout).
"""
