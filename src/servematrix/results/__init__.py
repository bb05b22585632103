"""From traces to numbers: vLLM's metrics, intervals, steady state, the study summary."""
