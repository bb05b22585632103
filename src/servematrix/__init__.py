"""servematrix: benchmark LLM serving configurations with one reproducible workflow."""

__version__ = "0.1.0"
