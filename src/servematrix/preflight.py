"""Checks of a loaded config that need the engine model: every architecture resolves and is
modelled, and every deployment would start (vLLM's own start-up refusals).

They live above ``config`` (which sits below the engine and imports none of it) and run, with
``config.load``, in ``servematrix.workflow.check_config``: the one check that both
``servematrix check`` and the workflow run before any job.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from servematrix.backends import backend_of
from servematrix.engine.admission import kv_capacity_message
from servematrix.engine.architecture import (
    ArchitectureError,
    load_architecture,
    max_model_len_refusal,
    max_position_embeddings,
)
from servematrix.engine.hardware import DEFAULT_GPU, gpu_spec
from servematrix.engine.kvcache import BLOCK_SIZE_TOKENS, KvMemoryPlan, ModelDoesNotFitError
from servematrix.engine.profile import ProfileError
from servematrix.engine.setup import (
    EngineFlags,
    plan_engine,
    profile_step_time,
    step_time_model,
    warn_fallback,
)
from servematrix.recipes import recipe_version, recipes_that
from servematrix.spec.matrix import Cell, Config, ConfigError
from servematrix.workload import WorkloadError, check_dataset
from servematrix.workload.datasets import dataset_of


def check(cfg: Config) -> None:
    """Raise ConfigError, naming the key path, for the first model or deployment that the
    engine cannot take."""
    _check_architectures(cfg)
    _check_datasets(cfg)
    _check_context(cfg)
    _check_plain_prefill(cfg)
    _check_engine_fits(cfg)
    _check_profiles(cfg)


def _check_architectures(cfg: Config) -> None:
    """Every architecture resolves (shipped, local config.json or Hub id) and is modelled."""
    for name, spec in cfg.models.items():
        try:
            load_architecture(spec.architecture)
        except ArchitectureError as error:
            raise ConfigError(f"models.{name}.architecture", str(error)) from None


def _where(cfg: Config, study: str, key: str) -> str:
    """The key path where a study's workload setting was made: its own, or ``defaults``."""
    in_study = key in cfg.raw["studies"][study].get("workload", {})
    return f"studies.{study}.workload.{key}" if in_study else f"defaults.{key}"


def _check_datasets(cfg: Config) -> None:
    """A dataset file a cell could not read (a malformed jsonl line, ``output_len: 0``)."""
    checked: set[tuple[str, str, int]] = set()
    for name, study in cfg.studies.items():
        for cell in study.cells:
            w = cell.workload
            key = (w.dataset, w.dataset_path or "", w.output_len)
            if w.dataset_path is None or key in checked:
                continue
            checked.add(key)
            try:
                check_dataset(w)
            except WorkloadError as error:
                raise ConfigError(_where(cfg, name, "dataset_path"), str(error)) from None


def _check_context(cfg: Config) -> None:
    """A ``max_model_len`` beyond the model's context, which vLLM (and so the emulator and the
    simulator, which model it) refuses at start-up; an external server is the user's own."""
    context: dict[str, int | None] = {}
    for name, study in cfg.studies.items():
        for cell in study.cells:
            if not backend_of(cell.backend).SETS_FLAGS:
                continue
            arch = cell.model.architecture
            if arch not in context:
                context[arch] = max_position_embeddings(arch)
            derived = context[arch]
            if derived is None:
                continue
            refusal = max_model_len_refusal(cell.serving.max_model_len, derived)
            if refusal is not None:
                where = _where(cfg, name, "max_model_len")
                raise ConfigError(where, f"{cell.model.name}: {refusal}")


def _check_plain_prefill(cfg: Config) -> None:
    """A plain-prefill mode on v0 with a max_model_len above 32768: vLLM 0.6 chunks prefills by
    itself there, and the v0 recipe (the published command lines) passes no flag against it, so
    the cell would not run the mode it is named after (an external server is the user's own)."""
    for name, study in cfg.studies.items():
        for cell in study.cells:
            mode, max_model_len = cell.mode, cell.serving.max_model_len
            if not backend_of(cell.backend).SETS_FLAGS or mode.chunked_prefill is not False:
                continue
            version = recipe_version(cell.recipe)
            above = version.auto_chunked_above_tokens
            if above is not None and max_model_len > above:
                raise ConfigError(
                    f"studies.{name}.modes[{study.modes.index(mode.name)}]",
                    f"mode {mode.name!r} is plain prefill, but vLLM {version.vllm_series} (recipe "
                    f"{cell.recipe}) chunks prefills by itself above max_model_len {above} (here "
                    f"{max_model_len}): lower max_model_len, or use recipe "
                    f"{recipes_that(lambda v: v.auto_chunked_above_tokens is None)}",
                )


def _check_profiles(cfg: Config) -> None:
    """An ``engine.profile`` is read, and must be of each simulated model's GPU, TP and
    quantization (or scale to its architecture), before any job runs."""
    calibrated = _calibrated_profile(cfg)
    seen: set[tuple[Any, ...]] = set()
    for cell in cfg.all_cells():
        if not backend_of(cell.backend).ENGINE_MODEL or not cell.engine.get("profile"):
            continue
        if calibrated and not Path(calibrated).exists():
            return  # the workflow's calibrate rule writes it before any cell runs
        flags = EngineFlags.of_cell(cell)
        key = (cell.model.architecture, flags.gpu, flags.tensor_parallel, flags.quantization)
        if key in seen:
            continue
        seen.add(key)
        try:
            profile_step_time(load_architecture(cell.model.architecture), flags)
        except ProfileError as error:
            raise ConfigError("engine.profile", f"{cell.model.name}: {error}") from None


def _calibrated_profile(cfg: Config) -> str | None:
    """The profile the workflow's calibrate rule writes (``calibration:``), which
    ``engine.profile`` must name; None without ``calibration:``."""
    if not cfg.raw.get("calibration"):
        return None
    profile = cfg.raw.get("engine", {}).get("profile")
    if not profile:
        raise ConfigError("calibration", "set engine.profile: the file calibration writes")
    return str(profile)


def _check_engine_fits(cfg: Config) -> None:
    """Serving flags vLLM refuses at start-up (a token budget below max_model_len without
    chunked prefill) are refused here; on the backends whose server is the engine model
    (simulator, emulator), so is a model that does not fit (weights or max_model_len beyond the
    GPU), with vLLM's reason, and a workload none of whose requests its KV cache can hold,
    instead of failing the cell's job."""
    planned: dict[tuple[Any, ...], tuple[KvMemoryPlan, float] | None] = {}
    for name, study in cfg.studies.items():
        for cell in study.cells:
            flags = EngineFlags.of_cell(cell)
            key = (cell.model.architecture, flags, cell.backend)
            if key not in planned:
                planned[key] = _plan(cfg, name, study.models.index(cell.model.name), cell, flags)
            if planned[key] is not None:
                _check_one_request_fits(cfg, name, cell, *planned[key])


def _plan(
    cfg: Config, name: str, index: int, cell: Cell, flags: EngineFlags
) -> tuple[KvMemoryPlan, float] | None:
    """The KV pool and admission watermark of a deployment on the engine model's backends
    (None on the others), or the ConfigError vLLM's start-up checks would give."""
    try:
        flags.scheduler()
    except ValueError as error:
        in_study = "max_num_batched_tokens" in cfg.raw["studies"][name].get("workload", {})
        where = f"studies.{name}.workload" if in_study else "defaults"
        raise ConfigError(f"{where}.max_num_batched_tokens", str(error)) from None
    if not backend_of(cell.backend).ENGINE_MODEL:
        return None
    try:
        plan = plan_engine(cell.model.architecture, flags)
    except ModelDoesNotFitError as error:
        raise ConfigError(f"studies.{name}.models[{index}]", str(error)) from None
    return plan.kv, plan.scheduler.watermark


def _check_one_request_fits(
    cfg: Config, study: str, cell: Cell, kv: KvMemoryPlan, watermark: float
) -> None:
    """A pool of at least ``max_model_len`` tokens (vLLM's start-up check, above) holds any
    request that fits the context, except in V0: its block manager admits a prompt only into
    the blocks above the watermark (1 % of the pool) and ignores, without a token, one that
    could never fit there. When even the workload's shortest prompt is such a one (known
    before the job for the random dataset), no request of the cell could be served."""
    w = cell.workload
    reserved = int(watermark * kv.num_blocks)
    if not reserved or not dataset_of(w.dataset).DRAWS_LENGTHS:
        return
    shortest = max(1, math.floor(w.input_len * (1 - w.range_ratio)))
    admissible = kv.num_blocks - reserved
    if math.ceil(shortest / BLOCK_SIZE_TOKENS) <= admissible:
        return
    in_study = "input_len" in cfg.raw["studies"][study]
    where = f"studies.{study}.input_len" if in_study else "defaults.input_len"
    raise ConfigError(
        where,
        f"no request of {cell.model.name} at input {w.input_len} can be served: the KV cache "
        f"holds {kv.num_blocks} blocks of {BLOCK_SIZE_TOKENS} tokens and {cell.recipe} admits "
        f"a prompt into the {admissible} above its watermark, so vLLM ignores every one "
        f"({kv_capacity_message(shortest)}); lower input_len or max_model_len, or raise "
        "gpu_memory_utilization",
    )


def warn_step_time_fallbacks(cfg: Config) -> None:
    """Log, as a cell would (``engine.setup.warn_fallback``), each setup of the config whose
    step times fall back to the roofline's estimate, on the backends that run the engine model
    (the first use of a setup builds its measured table, then it is cached)."""
    seen: set[tuple[Any, ...]] = set()
    for cell in cfg.all_cells():
        if not backend_of(cell.backend).ENGINE_MODEL:
            continue
        m = cell.model
        gpu = gpu_spec(str(cell.engine.get("gpu", DEFAULT_GPU))).name
        key = (m.architecture, gpu, m.tensor_parallel, m.quantization, cell.recipe)
        if key in seen:
            continue
        seen.add(key)
        arch = load_architecture(m.architecture)
        flags = EngineFlags.of_cell(cell)
        choice = step_time_model(arch, flags, flags.scheduler())
        if choice.fallback is not None:
            warn_fallback(m.hf_id, gpu, m.tensor_parallel, m.quantization, choice.fallback)
