"""Passes and the pass manager: named `Graph -> Graph` functions, pipelines per optimization level, and the target
pass that lowers a pipeline's result for the device it runs on."""
from samplec.passes.manager import PASSES, PIPELINES, TARGET_PASSES, run_pipeline, run_target

__all__ = ["PASSES", "PIPELINES", "TARGET_PASSES", "run_pipeline", "run_target"]
