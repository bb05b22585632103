"""Checks of a loaded config that need the engine model: every architecture resolves and is
modelled, and every deployment would start (vLLM's own start-up refusals).

They live above ``config`` (which sits below the engine and imports none of it) and run, with
``config.load``, in ``servematrix.workflow.check_config``: the one check that both
``servematrix check`` and the workflow run before any job.
"""

from __future__ import annotations

from typing import Any

from servematrix.config import Config, ConfigError
from servematrix.engine.architecture import ArchitectureError, load_architecture
from servematrix.engine.hardware import DEFAULT_GPU, gpu_spec
from servematrix.engine.kvcache import ModelDoesNotFitError, plan_kv_memory
from servematrix.engine.roofline import weight_bytes
from servematrix.engine.scheduler import scheduler_config


def check(cfg: Config) -> None:
    """Raise ConfigError, naming the key path, for the first model or deployment that the
    engine cannot take."""
    _check_architectures(cfg)
    _check_engine_fits(cfg)


def _check_architectures(cfg: Config) -> None:
    """Every architecture resolves (shipped, local config.json or Hub id) and is modelled."""
    for name, spec in cfg.models.items():
        try:
            load_architecture(spec.architecture)
        except ArchitectureError as error:
            raise ConfigError(f"models.{name}.architecture", str(error)) from None


def _check_engine_fits(cfg: Config) -> None:
    """Serving flags vLLM refuses at start-up (a token budget below max_model_len without
    chunked prefill) are refused here; on the backends whose server is the engine model
    (simulator, emulator), so is a model that does not fit (weights or max_model_len beyond the
    GPU), with vLLM's reason, instead of failing the cell's job."""
    planned: set[tuple[Any, ...]] = set()
    for name, study in cfg.studies.items():
        for cell in study.cells:
            m, s = cell.model, cell.serving
            gpu = str(cell.engine.get("gpu", DEFAULT_GPU))
            key = (m, cell.recipe, cell.mode.chunked_prefill, s, gpu, cell.backend)
            if key in planned:
                continue
            planned.add(key)
            spec = gpu_spec(gpu)
            try:
                sched = scheduler_config(
                    cell.recipe,
                    cell.mode.chunked_prefill,
                    s.max_model_len,
                    spec.name,
                    s.max_num_batched_tokens,
                )
            except ValueError as error:
                in_study = "max_num_batched_tokens" in cfg.raw["studies"][name].get("workload", {})
                where = f"studies.{name}.workload" if in_study else "defaults"
                raise ConfigError(f"{where}.max_num_batched_tokens", str(error)) from None
            if cell.backend not in ("simulator", "emulator"):
                continue
            arch = load_architecture(m.architecture)
            try:
                plan_kv_memory(
                    model_label=f"{m.name} ({m.quantization})",
                    arch=arch,
                    weight_bytes=weight_bytes(arch, m.quantization),
                    gpu=spec,
                    tp=m.tensor_parallel,
                    gpu_memory_utilization=s.gpu_memory_utilization,
                    max_model_len=s.max_model_len,
                    max_num_batched_tokens=sched.max_num_batched_tokens,
                    max_num_seqs=sched.max_num_seqs,
                )
            except ModelDoesNotFitError as error:
                index = study.models.index(m.name)
                raise ConfigError(f"studies.{name}.models[{index}]", str(error)) from None
