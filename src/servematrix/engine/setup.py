"""Build one engine configuration from serving flags: the single builder the simulator, the
emulator, the config's pre-flight checks and the cells' memory model share, so all of them
see exactly the same engine for the same flags.

A cell's flags are `EngineFlags.of_cell` (what its deployment passes vLLM); the emulator reads
the same flags from its vLLM command line. `plan_engine` is the part that needs no step-time
model (scheduler and KV pool: what vLLM checks at start-up); `engine_setup` adds the step times.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from servematrix.engine.aic_table import (
    StepTimeChoice,
    StepTimeFallback,
    select_step_time_model,
)
from servematrix.engine.architecture import Architecture, load_architecture
from servematrix.engine.attention import WithMixedStepKvReads, rereads_decode_kv
from servematrix.engine.hardware import CPU_HOST, DEFAULT_GPU, GpuSpec, gpu_spec
from servematrix.engine.host import NO_HOST_COST, HostCost, WithHostCost
from servematrix.engine.instance import EngineInstance, Jitter
from servematrix.engine.kvcache import (
    BlockPool,
    KvMemoryPlan,
    KvOffload,
    counted_reserve_gib,
    kv_offload,
    plan_kv_memory,
)
from servematrix.engine.profile import (
    ApiServerCpu,
    ProfileError,
    ProfileStepTime,
    ProfileTerms,
    SharedCoreStepTime,
    read_profile,
    scaled_terms,
)
from servematrix.engine.roofline import (
    V0_TP_STEP_BROADCAST_MS,
    RooflineStepTime,
    eager_launch_ms,
    v1_graph_max_tokens,
    weight_bytes,
)
from servematrix.engine.scheduler import Scheduler, SchedulerConfig, scheduler_config
from servematrix.engine.steptime import StepTimeModel, WithDecodeOverhead
from servematrix.recipes import recipe_version

if TYPE_CHECKING:
    from servematrix.spec.matrix import Cell

DEFAULT_JITTER_CV = 0.03
"""Step-to-step variation of a GPU forward pass (peers §2.9: CV about 3-5 %)."""
DEFAULT_STRAGGLER_PROBABILITY = 0.005
"""Share of steps hit by a host hiccup (see ``Jitter``); approximate, docs/engine-model.md."""

logger = logging.getLogger(__name__)

_warned_fallbacks: set[tuple[str, str, int, str, str]] = set()
"""Setups whose roofline fallback this process has already logged (a study builds one setup
per cell; the warning is said once per model, GPU, TP, quantization and reason)."""


@dataclass(frozen=True)
class EngineSetup:
    """Everything an instance is made of, shared by every instance of a deployment."""

    arch: Architecture
    gpu: str
    step_time: StepTimeModel
    step_time_label: str
    step_time_fallback: StepTimeFallback | None
    """Set when the roofline stands in for aiconfigurator's measured tables (with the reason)."""
    scheduler: SchedulerConfig
    kv: KvMemoryPlan
    jitter_cv: float
    straggler_probability: float
    kv_offload: KvOffload | None = None
    """The host KV tier of ``--kv-offloading-size`` (None: off)."""

    @property
    def step_time_fallback_record(self) -> dict[str, str] | None:
        """``step_time_fallback`` as the trace metadata records it: ``{"to", "reason"}``."""
        return asdict(self.step_time_fallback) if self.step_time_fallback else None

    @property
    def host(self) -> HostCost:
        """The host-side cost the step-time model includes (none for a given model)."""
        return self.step_time.cost if isinstance(self.step_time, WithHostCost) else NO_HOST_COST

    def instance(self, seed: int, index: int = 0) -> EngineInstance:
        """A fresh instance; its jitter stream is seeded by (seed, instance index). With the
        recipe's host cost it has the API server in front (``servematrix.engine.host``)."""
        host = self.host
        return EngineInstance(
            Scheduler(
                self.scheduler,
                BlockPool(
                    self.kv.num_blocks, watermark=self.scheduler.watermark, offload=self.kv_offload
                ),
            ),
            self.step_time,
            Jitter(
                self.jitter_cv,
                np.random.SeedSequence([seed, index]),
                self.straggler_probability,
            ),
            api_request_ms=host.request_ms,
            api_token_ms=host.overlapped_per_seq_ms,
            api_step_ms=host.overlapped_step_ms,
        )


@dataclass(frozen=True)
class EngineFlags:
    """The serving flags an engine is built from (vLLM's, plus the modelled GPU and jitter).

    ``chunked_prefill`` None keeps the recipe's default; ``max_num_seqs`` and
    ``max_num_batched_tokens`` None keep vLLM's defaults; ``kv_offloading_gib`` is
    ``--kv-offloading-size`` (native CPU offloading; None: off); ``prefix_caching`` is
    ``--[no-]enable-prefix-caching`` (None: the recipe's default, on in V1, off in 0.6);
    ``model_label`` names the model in start-up errors (default: the architecture and
    quantization)."""

    quantization: str
    tensor_parallel: int
    recipe: str
    chunked_prefill: bool | None
    max_model_len: int
    gpu_memory_utilization: float
    gpu: str = DEFAULT_GPU
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    kv_offloading_gib: float | None = None
    enforce_eager: bool = False
    prefix_caching: bool | None = None
    jitter_cv: float = DEFAULT_JITTER_CV
    straggler_probability: float = DEFAULT_STRAGGLER_PROBABILITY
    model_label: str | None = None
    step_time_profile: str | None = None
    """A hardware profile file (``engine.profile``, ``servematrix.engine.profile``) whose terms
    replace the tables, the roofline and the recipe's host cost."""
    api_server_apart: bool | None = None
    """A CPU node's API server on cores of its own, not the engine's (``engine.api_server_apart``;
    None: where it ran when the profile was fitted)."""

    @classmethod
    def of_cell(cls, cell: Cell) -> EngineFlags:
        """What the cell's deployment runs (the recipes pass vLLM the same flags)."""
        serving, engine = cell.serving, cell.engine
        return cls(
            quantization=cell.model.quantization,
            tensor_parallel=cell.model.tensor_parallel,
            recipe=cell.recipe,
            chunked_prefill=cell.mode.chunked_prefill,
            max_model_len=serving.max_model_len,
            gpu_memory_utilization=serving.gpu_memory_utilization,
            gpu=engine.get("gpu", DEFAULT_GPU),
            max_num_batched_tokens=serving.max_num_batched_tokens,
            max_num_seqs=serving.max_num_seqs,
            kv_offloading_gib=serving.kv_offloading_gib,
            enforce_eager=serving.enforce_eager,
            prefix_caching=serving.prefix_caching,  # as the recipes' --[no-]enable-prefix-caching
            jitter_cv=float(engine.get("jitter_cv", DEFAULT_JITTER_CV)),
            straggler_probability=float(
                engine.get("straggler_probability", DEFAULT_STRAGGLER_PROBABILITY)
            ),
            model_label=f"{cell.model.name} ({cell.model.quantization})",
            step_time_profile=engine.get("profile"),
            api_server_apart=engine.get("api_server_apart"),
        )

    def scheduler(self) -> SchedulerConfig:
        """vLLM's scheduler for these flags; ValueError for flags vLLM refuses at start-up."""
        sched = scheduler_config(
            self.recipe,
            self.chunked_prefill,
            self.max_model_len,
            gpu_spec(self.gpu).name,
            self.max_num_batched_tokens,
        )
        if self.max_num_seqs is not None:
            sched = replace(sched, max_num_seqs=self.max_num_seqs)
        if self.prefix_caching is not None:
            sched = replace(sched, prefix_caching=self.prefix_caching)
        return sched


@dataclass(frozen=True)
class EnginePlan:
    """What vLLM decides at start-up, before a step runs: the scheduler and the KV pool."""

    arch: Architecture
    gpu: GpuSpec
    scheduler: SchedulerConfig
    kv: KvMemoryPlan


def plan_engine(architecture: str | Architecture, flags: EngineFlags) -> EnginePlan:
    """The scheduler and KV pool of ``flags`` on ``architecture`` (a shipped architecture's
    name or one already loaded, e.g. a user's ``config.json``). Raises ValueError for flags
    vLLM refuses and ``ModelDoesNotFitError`` for a model the GPU cannot hold."""
    arch = load_architecture(architecture) if isinstance(architecture, str) else architecture
    spec = gpu_spec(flags.gpu)
    sched = flags.scheduler()
    kv = plan_kv_memory(
        model_label=flags.model_label or f"{arch.name} ({flags.quantization})",
        arch=arch,
        weight_bytes=weight_bytes(arch, flags.quantization),
        gpu=spec,
        tp=flags.tensor_parallel,
        gpu_memory_utilization=flags.gpu_memory_utilization,
        max_model_len=flags.max_model_len,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs,
        reserve_gib=counted_reserve_gib(flags.recipe, flags.tensor_parallel, flags.enforce_eager),
    )
    return EnginePlan(arch, spec, sched, kv)


def engine_setup(
    architecture: str | Architecture, flags: EngineFlags, step_time: StepTimeModel | None = None
) -> EngineSetup:
    """The engine vLLM would run for ``flags`` (`plan_engine`, then the step-time model;
    ``step_time`` replaces the model, for tests)."""
    plan = plan_engine(architecture, flags)
    arch, gpu, tp, quantization = (
        plan.arch,
        plan.gpu.name,
        flags.tensor_parallel,
        flags.quantization,
    )
    if step_time is not None:
        choice = StepTimeChoice(step_time, f"given ({type(step_time).__name__})")
    else:
        choice = step_time_model(arch, flags, plan.scheduler)
        if choice.fallback is not None:
            warn_fallback(flags.model_label or arch.name, gpu, tp, quantization, choice.fallback)
    return EngineSetup(
        arch,
        gpu,
        choice.model,
        choice.label,
        choice.fallback,
        plan.scheduler,
        plan.kv,
        float(flags.jitter_cv),
        float(flags.straggler_probability),
        kv_offload(plan.kv, plan.gpu, tp, flags.kv_offloading_gib)
        if flags.kv_offloading_gib
        else None,
    )


def build_engine_setup(
    architecture: str | Architecture, *, step_time: StepTimeModel | None = None, **flags: Any
) -> EngineSetup:
    """`engine_setup` with the flags as keywords (``EngineFlags``' fields)."""
    return engine_setup(architecture, EngineFlags(**flags), step_time)


def cell_engine_setup(cell: Cell, step_time: StepTimeModel | None = None) -> EngineSetup:
    """The engine every instance of the cell runs (the emulator builds the same one from the
    vLLM flags the cell's deployment passes it)."""
    return engine_setup(cell.model.architecture, EngineFlags.of_cell(cell), step_time)


def role_engine_setups(
    cell: Cell, setup: EngineSetup, step_time: StepTimeModel | None = None
) -> list[EngineSetup]:
    """Each role's engine in topology order: ``setup`` (the cell's own) at the model's TP,
    else the model at the role's TP."""
    return [
        setup
        if role.tp == cell.model.tensor_parallel
        else cell_engine_setup(
            replace(cell, model=replace(cell.model, tensor_parallel=role.tp)), step_time
        )
        for role in cell.topology.roles
    ]


def warn_fallback(
    model: str, gpu: str, tp: int, quantization: str, fallback: StepTimeFallback
) -> None:
    """A WARNING, once per setup in this process: the step times are the roofline's estimate,
    not aiconfigurator's measured tables (the trace metadata and the report say so too)."""
    key = (model, gpu, tp, quantization, fallback.reason)
    if key in _warned_fallbacks:
        return
    _warned_fallbacks.add(key)
    logger.warning(
        "step times of %s on %s, TP %d, %s: aiconfigurator's measured tables do not cover this "
        "setup (%s); falling back to the %s model, an estimate (docs/engine-model.md)",
        model,
        gpu,
        tp,
        quantization,
        fallback.reason,
        fallback.to,
    )


def step_time_model(
    arch: Architecture, flags: EngineFlags, scheduler: SchedulerConfig
) -> StepTimeChoice:
    """The GPU step (below), V1's FlashAttention-2 rereads in mixed steps
    (``servematrix.engine.attention``) and the recipe's host-side cost per step
    (``servematrix.engine.host``), for ``flags`` and the scheduler vLLM runs with them (V1's
    largest step under CUDA graphs follows from its seats and token budget)."""
    if flags.step_time_profile:
        return profile_step_time(arch, flags)
    if flags.gpu == CPU_HOST:
        raise ValueError(
            f"engine.gpu {CPU_HOST}: a CPU host's step times come only from a profile calibrated "
            "on it (servematrix calibrate --gpu cpu; engine: {profile: FILE})"
        )
    version = recipe_version(flags.recipe)
    graph_max = (
        v1_graph_max_tokens(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
        if version.cuda_graphs_sized_by_scheduler
        else None
    )
    choice = _gpu_step_time_model(arch, flags, graph_max)
    gpu = gpu_spec(flags.gpu)
    if rereads_decode_kv(gpu, arch, flags.recipe):
        rereads = WithMixedStepKvReads(choice.model, arch, gpu, flags.tensor_parallel)
        choice = replace(choice, model=rereads, label=f"{choice.label} + {rereads.label}")
    cost = version.host_cost_with(flags.enforce_eager)
    if cost == NO_HOST_COST:
        return choice
    label = f"{choice.label} + {flags.recipe} host ({cost.label})"
    return replace(choice, model=WithHostCost(choice.model, cost), label=label)


def profile_step_time(arch: Architecture, flags: EngineFlags) -> StepTimeChoice:
    """The step times of ``flags.step_time_profile``: its terms (scaled to ``arch`` when it was
    fitted on another architecture), with its API-server cost per request in front. The host's
    per-step costs are inside its measured terms. ProfileError for a profile of another GPU,
    TP or quantization: its terms do not carry across those."""
    path = str(flags.step_time_profile)
    profile = read_profile(path)
    source = profile.provenance
    for field, fitted, wanted in (
        ("gpu", source.gpu, gpu_spec(flags.gpu).name),
        ("tensor_parallel", source.tensor_parallel, flags.tensor_parallel),
        ("quantization", source.quantization, flags.quantization),
    ):
        if fitted != wanted:
            raise ProfileError(
                path,
                f"provenance.{field}",
                f"the profile is of {fitted}, the engine runs {wanted} (a profile's terms do "
                "not carry across GPUs, TP degrees or quantizations)",
            )
    terms, scaling = scaled_terms(profile, arch, path)
    label = f"profile {path} ({source.method} on {source.host or source.gpu}, {source.model}, "
    label += source.date
    label += f"; {scaling})" if scaling else ")"
    api = profile.api_server_cpu
    cost = api_path(terms, api)
    apart = source.api_server_apart if flags.api_server_apart is None else flags.api_server_apart
    if flags.gpu == CPU_HOST and not apart:
        label += ", the API server on the engine's cores"
        if api is None:
            return StepTimeChoice(SharedCoreStepTime(terms), label)
        label += " (its measured CPU in the steps)"
        return StepTimeChoice(WithHostCost(SharedCoreStepTime(terms, api), cost), label)
    if flags.gpu == CPU_HOST:
        label += ", the API server on cores of its own"
        if api is not None:
            # It takes in every step's output and streams its tokens beside the engine: what
            # its core has left goes to new requests, and past its core it paces the steps.
            cost = replace(
                cost,
                overlapped_step_ms=api.per_step_s * 1e3,
                overlapped_per_seq_ms=api.per_output_token_s * 1e3,
            )
    return StepTimeChoice(WithHostCost(ProfileStepTime(terms), cost), label)


def api_path(terms: ProfileTerms, api: ApiServerCpu | None) -> HostCost:
    """A profile's API path (``per_request_api_s``: how much longer the probes' first tokens
    took than the engine's steps). With the API server's CPU measured, only that CPU per
    request is serial work, queued request after request; the rest is latency beside it (the
    HTTP exchange, the hand-offs to and from the engine), which delays each request but
    occupies no turn of the API server. Without it (an older profile), all of it is serial."""
    path_ms = terms.per_request_api_s * 1e3
    if api is None:
        return HostCost(0.0, 0.0, request_ms=path_ms)
    serial_ms = min(api.per_request_s * 1e3, path_ms)
    return HostCost(0.0, 0.0, request_ms=serial_ms, request_latency_ms=path_ms - serial_ms)


def _gpu_step_time_model(
    arch: Architecture, flags: EngineFlags, graph_max_tokens: int | None
) -> StepTimeChoice:
    """aiconfigurator's measured table where it covers the setup, else the roofline; both with
    the serving flags (``--enforce-eager``; ``graph_max_tokens``: V1's largest step under CUDA
    graphs, `roofline.v1_graph_max_tokens`, None: V0's rule) and V0's per-step TP broadcast."""
    enforce_eager, tp = flags.enforce_eager, flags.tensor_parallel
    gpu, quantization = gpu_spec(flags.gpu).name, flags.quantization
    tp_step_broadcast = recipe_version(flags.recipe).tp_step_broadcast

    def roofline(arch: Architecture, gpu_name: str, tp_: int, quantization: str) -> StepTimeModel:
        return RooflineStepTime(
            arch,
            gpu_spec(gpu_name),
            tp_,
            quantization,
            enforce_eager=enforce_eager,
            tp_step_broadcast=tp_step_broadcast,
            graph_max_tokens=graph_max_tokens,
        )

    choice = select_step_time_model(arch, gpu, tp, quantization, roofline=roofline)
    if choice.fallback is not None:
        return choice
    eager = eager_launch_ms(arch, tp) if enforce_eager else 0.0
    any_step = V0_TP_STEP_BROADCAST_MS if tp_step_broadcast and tp > 1 else 0.0
    if eager or any_step:
        extras = ["enforce_eager"] if enforce_eager else []
        extras += ["V0 TP broadcast"] if any_step else []
        return StepTimeChoice(
            WithDecodeOverhead(choice.model, eager, any_step),
            f"{choice.label} + {', '.join(extras)}",
        )
    return choice
