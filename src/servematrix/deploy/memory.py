"""Memory where it lives, sampled while a cell runs: GPU memory per pinned GPU and each
instance's KV-cache usage.

* Backend ``vllm``: GPU memory from NVML (``nvidia-ml-py``), per pinned GPU id; a host without
  NVML records why instead of numbers.
* Backend ``emulator``: the modelled GPU memory. vLLM claims ``gpu_memory_utilization`` of
  each GPU at start and holds it (weights + activations + the KV pool it sizes to fill the
  rest), which is what NVML then shows; the emulator reports the same figure for the GPU it
  models.
* Both: KV-cache usage over time from each instance's Prometheus ``/metrics``
  (``vllm:kv_cache_usage_perc`` in V1, ``vllm:gpu_cache_usage_perc`` in 0.6; 0..1).

The result goes into the trace metadata under ``memory``; ``peak_gpu_memory_mib`` and
``peak_kv_cache_usage`` are what a summary needs.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from servematrix.deploy.recipes import Plan

SAMPLE_S = 0.5
KV_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
MIB = 1024 * 1024


def kv_cache_usage(base: str) -> float | None:
    """An instance's KV-cache usage (0..1) from its /metrics; None when it has none."""
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
            text = response.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    for line in text.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] in KV_USAGE_METRICS:
            return float(line.rsplit(" ", 1)[1])
    return None


class _Nvml:
    """Used memory of GPU ids, by NVML index (the host's numbering, as the pins are)."""

    def __init__(self, gpus: tuple[int, ...]):
        import pynvml

        self.pynvml = pynvml
        pynvml.nvmlInit()
        self.handles = {gpu: pynvml.nvmlDeviceGetHandleByIndex(gpu) for gpu in gpus}

    def used_mib(self) -> dict[int, float]:
        return {
            gpu: self.pynvml.nvmlDeviceGetMemoryInfo(handle).used / MIB
            for gpu, handle in self.handles.items()
        }

    def close(self) -> None:
        self.pynvml.nvmlShutdown()


def modelled_gpu_mib(gpu: str, gpu_memory_utilization: float) -> float:
    from servematrix.engine.hardware import gpu_spec

    return gpu_spec(gpu).memory_bytes * gpu_memory_utilization / MIB


@contextmanager
def sampled(
    plan: Plan, backend: str, modelled_gpu: str, gpu_memory_utilization: float
) -> Iterator[dict[str, Any]]:
    """Sample in a thread while the block runs; the yielded dict is filled in at the end."""
    instances = {p.name: p.health.url.rsplit("/", 1)[0] for p in plan.processes if p.gpus}
    result: dict[str, Any] = {"sample_s": SAMPLE_S}
    kv: dict[str, list[list[float]]] = {name: [] for name in instances}
    gpu_samples: dict[int, list[list[float]]] = {gpu: [] for gpu in plan.gpus}
    nvml = None
    if backend == "vllm":
        result["gpu_memory_source"] = "nvml"
        try:
            nvml = _Nvml(plan.gpus)
        except Exception as error:  # NVML missing or failing: say why, measure the rest
            result["gpu_memory_error"] = f"{type(error).__name__}: {error}"
    else:
        result["gpu_memory_source"] = f"modelled ({modelled_gpu}, gpu_memory_utilization)"
    stop = threading.Event()
    began = time.monotonic()

    def sample() -> None:
        while True:
            t = round(time.monotonic() - began, 3)
            for name, base in instances.items():
                usage = kv_cache_usage(base)
                if usage is not None:
                    kv[name].append([t, usage])
            if nvml is not None:
                for gpu, used in nvml.used_mib().items():
                    gpu_samples[gpu].append([t, round(used, 1)])
            if stop.wait(SAMPLE_S):
                return

    thread = threading.Thread(target=sample, name="memory-sampler", daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        if nvml is not None:
            nvml.close()
        if backend != "vllm":
            modelled = round(modelled_gpu_mib(modelled_gpu, gpu_memory_utilization), 1)
            gpu_samples = {gpu: [[0.0, modelled]] for gpu in plan.gpus}
        result["gpus"] = {
            str(gpu): {
                "peak_used_mib": max((v for _, v in s), default=None),
                "samples": s,
            }
            for gpu, s in gpu_samples.items()
        }
        result["kv_cache_usage"] = kv
        peaks = [v for s in gpu_samples.values() for _, v in s]
        usages = [v for s in kv.values() for _, v in s]
        result["peak_gpu_memory_mib"] = max(peaks) if peaks else None
        result["peak_kv_cache_usage"] = max(usages) if usages else None
