"""samplec: compile LLM sampler chains (`.smp`) into optimized, serializable MLX programs."""
from samplec.api import Program, SamplecError, SamplecWarning, compile, compile_file, load

__version__ = "0.1.0"
__all__ = ["compile", "compile_file", "load", "Program", "SamplecError", "SamplecWarning", "__version__"]
