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
* Backend ``emulator``, besides: the exact peak of KV blocks in use over the cell, from each
  instance's emulator-only ``/servematrix/kv_cache`` (its peak is reset when the cell starts,
  so a cell on a warm deployment measures its own).
* Backend ``simulator`` (:func:`simulated`): the same modelled claim, and the exact peak of KV
  blocks in use (no sampling: the engine's pool records its fewest free blocks).

The result goes into the trace metadata under ``memory``; ``peak_gpu_memory_mib`` and
``peak_kv_cache_usage`` are what a summary needs. Keys:

* ``gpu_memory_source``: ``nvml``, or ``modelled (<gpu>, gpu_memory_utilization)``;
* ``peak_gpu_memory_mib``: the most memory used on any pinned GPU (MiB; vllm: NVML, else the
  modelled claim);
* ``peak_kv_cache_usage``: the most KV blocks in use at once over the pool's blocks (0..1),
  the quantity of vLLM's ``kv_cache_usage_perc``, on the busiest instance (vllm: the highest
  ``/metrics`` sample, so a peak between samples is missed; emulator and simulator: exact);
* vllm and emulator: ``sample_s``, ``gpus`` (per pinned GPU id: ``peak_used_mib`` and
  ``samples`` of [s, MiB]; one modelled sample on the emulator) and ``kv_cache_usage`` (per
  instance: samples of [s, usage]); ``gpu_memory_error`` when NVML failed;
* vllm on a CPU node (config ``node.kind: cpu``): no ``gpus`` and ``peak_gpu_memory_mib`` None;
  instead ``instances_rss`` (per instance: ``peak_rss_mib`` and ``samples`` of [s, MiB], the
  resident memory of the instance's whole process tree: API server, EngineCore, Worker) and
  ``peak_rss_mib``, the largest of them; the KV cache is part of that memory
  (``VLLM_CPU_KVCACHE_SPACE``), its usage is ``kv_cache_usage`` as on GPUs;
* emulator and simulator (:func:`modelled_layout`, what ``servematrix.engine.kvcache`` sizes
  per GPU of every instance): ``weights_mib_per_gpu`` (the GPU's tensor-parallel shard of the
  weights), ``kv_pool_mib_per_gpu`` (the KV pool), ``kv_pool_blocks`` (blocks per instance) and
  ``kv_block_size_tokens``;
* emulator and simulator: ``peak_kv_blocks``, the most blocks in use per instance (instance
  order; prefill then decode when disaggregated);
* vllm and emulator: ``server_tokens``, per instance, how much its ``/metrics`` token counters
  (``generation_tokens``, ``prompt_tokens``) grew over the cell, warm-ups included: the
  server's own count beside the trace's usage;
* emulator: ``peak_kv_error`` instead when an instance could not say its peak (then
  ``peak_kv_cache_usage`` is the highest sample, as on vllm).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from servematrix.deploy import cpupins
from servematrix.deploy.processes import Plan

if TYPE_CHECKING:
    from servematrix.engine.kvcache import KvMemoryPlan

SAMPLE_S = 0.5
KV_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
MIB = 1024 * 1024


def _emulator_kv_cache(base: str, reset: bool = False) -> dict[str, Any]:
    """An emulator instance's ``/servematrix/kv_cache`` (blocks), after starting a new peak
    when ``reset``."""
    if reset:
        url = urllib.request.Request(
            base + "/servematrix/kv_cache/reset_peak", data=b"", method="POST"
        )
    else:
        url = urllib.request.Request(base + "/servematrix/kv_cache")
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def instances(plan: Plan) -> dict[str, str]:
    """The serving instances of a deployment (its processes pinned to GPUs; not etcd or the
    proxy), in plan order, by name: their base URLs."""
    return {p.name: p.health.url.rsplit("/", 1)[0] for p in plan.processes if p.gpus}


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


def modelled_layout(kv: KvMemoryPlan) -> dict[str, Any]:
    """The modelled per-GPU split of one instance's memory (the module docstring's keys)."""
    return {
        "weights_mib_per_gpu": round(kv.weights_gib * 1024, 1),
        "kv_pool_mib_per_gpu": round(kv.kv_cache_gib * 1024, 1),
        "kv_pool_blocks": kv.num_blocks,
        "kv_block_size_tokens": kv.block_size_tokens,
    }


def simulated(
    gpu: str, gpu_memory_utilization: float, kv: KvMemoryPlan, peak_kv_blocks: list[int]
) -> dict[str, Any]:
    """The simulator's ``memory``: the modelled claim and layout, and its exact KV peak."""
    return {
        "gpu_memory_source": f"modelled ({gpu}, gpu_memory_utilization)",
        **modelled_layout(kv),
        "peak_kv_blocks": peak_kv_blocks,
        "peak_gpu_memory_mib": round(modelled_gpu_mib(gpu, gpu_memory_utilization), 1),
        "peak_kv_cache_usage": max(peak_kv_blocks) / kv.num_blocks,
    }


TOKEN_COUNTERS = {
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
}
COUNTER_SETTLE_S = 0.5


def token_counters(base: str) -> dict[str, float]:
    """An instance's token counters from its ``/metrics`` (absent ones are left out)."""
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
            text = response.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        key = TOKEN_COUNTERS.get(line.split("{", 1)[0].split(" ", 1)[0])
        if key is not None:
            counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def _settled_counters(bases: dict[str, str], timeout_s: float = 5.0) -> dict[str, dict]:
    """Every instance's counters once two reads ``COUNTER_SETTLE_S`` apart agree: vLLM counts a
    request's tokens just after it sends them."""
    deadline = time.monotonic() + timeout_s
    last = {name: token_counters(base) for name, base in bases.items()}
    while time.monotonic() < deadline:
        time.sleep(COUNTER_SETTLE_S)
        now = {name: token_counters(base) for name, base in bases.items()}
        if now == last:
            break
        last = now
    return last


def process_groups(state: dict[str, Any]) -> dict[str, int]:
    """A deployment's process groups by process name, from its ``state.json``."""
    return {name: pgid for name, pgid in state.get("groups", [])}


def tree_rss_mib(session: int) -> float:
    """Resident memory (MiB) of every process in a session: a deployment's process runs in
    its own, so this is the instance's whole tree (vLLM's API server, EngineCore, Worker)."""
    pages = sum(int(fields[21]) for fields in cpupins.session_processes(session).values())
    return pages * os.sysconf("SC_PAGE_SIZE") / MIB


class _Sampler:
    """The samples one cell takes every ``SAMPLE_S``: KV usage per instance; GPU memory per
    pinned GPU (NVML) on a GPU node, resident memory per instance tree on a CPU node."""

    def __init__(self, plan: Plan, nvml: _Nvml | None, sessions: dict[str, int]):
        self.bases = instances(plan)
        self.nvml = nvml
        self.sessions = sessions
        self.kv: dict[str, list[list[float]]] = {name: [] for name in self.bases}
        self.gpus: dict[int, list[list[float]]] = {gpu: [] for gpu in plan.gpus}
        self.rss: dict[str, list[list[float]]] = {name: [] for name in sessions}
        self.began = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            t = round(time.monotonic() - self.began, 3)
            for name, base in self.bases.items():
                usage = kv_cache_usage(base)
                if usage is not None:
                    self.kv[name].append([t, usage])
            if self.nvml is not None:
                for gpu, used in self.nvml.used_mib().items():
                    self.gpus[gpu].append([t, round(used, 1)])
            for name, session in self.sessions.items():
                self.rss[name].append([t, round(tree_rss_mib(session), 1)])
            if self.stop.wait(SAMPLE_S):
                return

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()
        if self.nvml is not None:
            self.nvml.close()


def _peaks(samples: dict[Any, list[list[float]]], key: str) -> dict[str, Any]:
    return {
        str(name): {key: max((v for _, v in s), default=None), "samples": s}
        for name, s in samples.items()
    }


def _emulator_peaks(bases: dict[str, str], result: dict[str, Any]) -> None:
    """The exact KV peak of every emulator instance since the cell started."""
    try:
        pools = [_emulator_kv_cache(base) for base in bases.values()]
    except (urllib.error.URLError, OSError, ValueError) as error:
        result["peak_kv_error"] = f"{type(error).__name__}: {error}"
        return
    result["peak_kv_blocks"] = [pool["peak_used_blocks"] for pool in pools]
    result["peak_kv_cache_usage"] = max(
        pool["peak_used_blocks"] / pool["num_blocks"] for pool in pools
    )


@contextmanager
def sampled(
    plan: Plan,
    real_gpus: bool,
    modelled_gpu: str,
    gpu_memory_utilization: float,
    layout: dict[str, Any] | None = None,
    node_kind: str = "gpu",
    groups: dict[str, int] | None = None,
) -> Iterator[dict[str, Any]]:
    """Sample in a thread while the block runs; the yielded dict is filled in at the end.

    ``real_gpus``: the servers are vLLM on the node's own GPUs (NVML) or cores (resident
    memory); else they are emulators, whose GPU memory is the modelled GPU's and whose exact KV
    peaks their own route reports.

    ``layout`` (emulator: :func:`modelled_layout` of the engine it runs) goes in as it is;
    ``groups`` (process name -> its process group, :func:`process_groups`) are the trees whose
    resident memory is sampled on a CPU node."""
    bases = instances(plan)
    result: dict[str, Any] = {"sample_s": SAMPLE_S, **(layout or {})}
    cpu = real_gpus and node_kind == "cpu"
    nvml = None
    if cpu:
        result["gpu_memory_source"] = "none (cpu node: resident memory per instance)"
    elif real_gpus:
        result["gpu_memory_source"] = "nvml"
        try:
            nvml = _Nvml(plan.gpus)
        except Exception as error:  # NVML missing or failing: say why, measure the rest
            result["gpu_memory_error"] = f"{type(error).__name__}: {error}"
    else:
        result["gpu_memory_source"] = f"modelled ({modelled_gpu}, gpu_memory_utilization)"
    exact = not real_gpus
    try:
        if exact:
            for base in bases.values():
                _emulator_kv_cache(base, reset=True)
    except (urllib.error.URLError, OSError, ValueError) as error:
        result["peak_kv_error"] = f"{type(error).__name__}: {error}"
        exact = False
    sessions = {n: g for n, g in (groups or {}).items() if n in bases} if cpu else {}
    counted = {name: token_counters(base) for name, base in bases.items()}
    sampler = _Sampler(plan, nvml, sessions)
    sampler.thread.start()
    try:
        yield result
    finally:
        sampler.finish()
        after = _settled_counters(bases)
        result["server_tokens"] = {
            name: {k: after[name][k] - counted[name][k] for k in after[name] if k in counted[name]}
            for name in bases
        }
        _fill(result, sampler, real_gpus, cpu, modelled_gpu, gpu_memory_utilization)
        if exact:
            _emulator_peaks(bases, result)


def _fill(
    result: dict[str, Any],
    sampler: _Sampler,
    real_gpus: bool,
    cpu: bool,
    modelled_gpu: str,
    gpu_memory_utilization: float,
) -> None:
    gpu_samples = sampler.gpus
    if not real_gpus:
        modelled = round(modelled_gpu_mib(modelled_gpu, gpu_memory_utilization), 1)
        gpu_samples = {gpu: [[0.0, modelled]] for gpu in gpu_samples}
    if not cpu:
        result["gpus"] = _peaks(gpu_samples, "peak_used_mib")
    result["kv_cache_usage"] = sampler.kv
    peaks = [v for s in gpu_samples.values() for _, v in s] if not cpu else []
    usages = [v for s in sampler.kv.values() for _, v in s]
    result["peak_gpu_memory_mib"] = max(peaks) if peaks else None
    result["peak_kv_cache_usage"] = max(usages) if usages else None
    if cpu:
        result["instances_rss"] = _peaks(sampler.rss, "peak_rss_mib")
        rss = [v for s in sampler.rss.values() for _, v in s]
        result["peak_rss_mib"] = max(rss) if rss else None
