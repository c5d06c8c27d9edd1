"""samplec's fuzzers: one module per target, each `fuzz(seconds, seed) -> Counts` (see run.py)."""
