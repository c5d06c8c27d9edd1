"""Passes and the pass manager: named `Graph -> Graph` functions, pipelines per optimization level."""
from samplec.passes.manager import PASSES, PIPELINES, run_pipeline

__all__ = ["PASSES", "PIPELINES", "run_pipeline"]
