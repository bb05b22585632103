"""The emulator backend: an OpenAI-compatible server that accepts ``vllm serve``'s command line
and paces the simulator's engine by the wall clock (``servematrix-emulator``)."""
