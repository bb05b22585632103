"""What differs between recipe versions, named for what it means.

A recipe version is one vLLM release line as servematrix runs it: its engine (scheduler
defaults, what its memory budget counts, host-side cost), its OpenAI server's bytes (what the
emulator writes), its KV connector and its command lines. Code outside ``servematrix.recipes``
reads these fields; it never compares a recipe's name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import astuple, dataclass, field
from typing import Any

DEPLOYMENT_DIR = "@DEPLOYMENT_DIR@"
"""Placeholder for the deployment's own directory (mooncake.json, etcd data): filled in after
the fingerprint is taken, so the fingerprint depends on the commands, not on where they run."""


@dataclass(frozen=True)
class HostCost:
    """CPU time per engine step: ``step_ms`` + ``per_seq_ms`` × requests on the critical path,
    and ``overlapped_per_seq_ms`` × requests of work beside it that the step cannot be shorter
    than."""

    step_ms: float
    per_seq_ms: float
    overlapped_per_seq_ms: float = 0.0
    request_ms: float = 0.0
    """The API server's serial work per request before the engine sees it (parse, validate,
    tokenise, hand over); ``EngineInstance`` queues requests through it."""
    overlapped_step_ms: float = 0.0
    """Work beside each step whatever its size (a CPU node's API server takes in the step's one
    output message): with ``overlapped_per_seq_ms`` × requests, what the step cannot be shorter
    than."""
    request_latency_ms: float = 0.0
    """Time on a request's path that occupies no process's turn (the HTTP exchange, the hand-offs
    between the API server and the engine): added to the path, never queued behind other
    requests. A profile's measured API path less its API server's CPU (``engine.setup``)."""

    def __post_init__(self) -> None:
        if min(astuple(self)) < 0:
            raise ValueError(f"host cost must be >= 0, got {self}")

    @property
    def label(self) -> str:
        """How the cost reads in a step-time source label."""
        parts = [f"{self.step_ms:.3g} ms/step"]
        if self.per_seq_ms:
            parts.append(f"{self.per_seq_ms * 1e3:.3g} us/request")
        if self.overlapped_per_seq_ms or self.overlapped_step_ms:
            beside = f"{self.overlapped_per_seq_ms * 1e3:.3g} us/request"
            if self.overlapped_step_ms:
                beside = f"{self.overlapped_step_ms:.3g} ms + {beside}"
            parts.append(f"step >= {beside} beside it")
        if self.request_ms:
            parts.append(f"API server {self.request_ms:.3g} ms/request")
        if self.request_latency_ms:
            parts.append(f"request path {self.request_latency_ms:.3g} ms")
        return ", ".join(parts)


@dataclass(frozen=True)
class Segment:
    """Argv tokens kept when ``when`` holds (None = always); ``{name}`` is filled per instance."""

    tokens: tuple[str, ...]
    when: str | None = None


@dataclass(frozen=True)
class Recipe:
    """A version's command lines as data (``servematrix.deploy.recipes`` builds them)."""

    name: str
    executable: tuple[str, ...]
    args: tuple[Segment, ...]
    kv_transfer_config: Mapping[str, Mapping[str, Any]]
    """``--kv-transfer-config`` per role (``kv_producer``, ``kv_consumer``), ``{...}`` filled."""
    producer_env: Mapping[str, str] = field(default_factory=dict)
    disaggregated_env: Mapping[str, str] = field(default_factory=dict)
    etcd: bool = False
    """Mooncake modes need an etcd server and a ``mooncake.json`` (v0 only)."""
    disagg_proxy: str = "disagg-v1"
    prefix_cache_reset_env: Mapping[str, str] | None = None
    """With prefix caching on, the environment that gives each server ``POST
    /reset_prefix_cache``, so a warm deployment starts a cell with an empty cache; None: the
    version has no such route, and a deployment that caches prefixes starts fresh per cell."""


@dataclass(frozen=True)
class LinkPreset:
    """A KV path: wire bandwidth per NIC (GB/s, decimal), setup latency (ms), the default NIC
    count (None = one NIC per TP rank, as on GPU nodes with a NIC per GPU) and, for the v0 CPU
    path, the per-rank rate of its serialise/copy chain (None = GPU-direct, no CPU chain): the
    first ``rank_cpu_fast_mb`` of a rank's shard at ``rank_cpu_fast_gb_s``, the rest at
    ``rank_cpu_gb_s`` (docs/engine-model.md "Calibration")."""

    name: str
    nic_gb_s: float
    setup_ms: float
    nics: int | None = None
    rank_cpu_gb_s: float | None = None
    rank_cpu_fast_gb_s: float | None = None
    rank_cpu_fast_mb: float = 0.0
    provenance: str = ""


@dataclass(frozen=True)
class SchedulerDefaults:
    """The scheduler vLLM's API server builds when the command line sets nothing
    (``servematrix.engine.scheduler``). A chunked scheduler always runs decodes first."""

    unchunked_policy: str
    """``prefill_first`` (V0: a waiting prompt goes before the running decodes) or
    ``decode_first``."""
    watermark: float
    """Share of KV blocks kept free when admitting a request."""
    preempt_blocks_admission: bool
    """Whether a preemption in a step stops further admissions in that step (V1)."""
    prefix_caching: bool
    """Automatic prefix caching on unless the command line turns it off."""
    max_num_seqs_on_cpu: int
    large_gpu_budget_and_seqs: tuple[int, int] | None
    """``(max_num_batched_tokens, max_num_seqs)`` on H100/H200; None: the small-GPU values."""


@dataclass(frozen=True)
class KvConnector:
    """The version's Mooncake integration (``servematrix.engine.transfer``)."""

    name: str
    """Which implementation plays it in the simulator and the emulator."""
    lookup_buffer: bool
    """The producer inserts each request's KV into a lookup buffer and the consumer pulls it
    inside its own step (V0 ``MooncakePipe``): one producer and one consumer instance, no
    transfer beside the steps. False: GPU-direct transfers beside the steps, xPyD topologies."""
    sends_hidden_state: bool
    """Every rank also sends the prompt's last hidden state (V0)."""
    transfer_config_keys: frozenset[str]
    """The keys ``--kv-transfer-config`` accepts."""
    config_path_env: str | None
    """An environment variable naming the connector's JSON config, required to start."""
    link_presets: Mapping[str, LinkPreset]
    """The modelled link per ``kv_protocol``."""


@dataclass(frozen=True)
class ServerDialect:
    """How the version's OpenAI server writes and checks what the emulator plays
    (``shared/reference/vllm-openai-server.md``)."""

    completion_id_hex_chars: int
    """Random hex characters after ``cmpl-`` when no ``X-Request-Id`` is given."""
    nested_error_body: bool
    """``{"error": {...}}`` with file paths sanitized (0.33), else flat (0.6)."""
    extended_response_fields: bool
    """0.33's response fields: token ids in each choice, ``system_fingerprint``,
    ``kv_transfer_params`` and the usage details; 0.6 writes usage null in every chunk and a null
    ``prompt_tokens_details`` in continuous usage."""
    engine_metrics: bool
    """0.33's Prometheus series (``engine`` label, ``kv_cache_usage_perc``, prefix-cache
    counters); else 0.6's (GPU/CPU cache usage, swapped requests, ``tokens_total``)."""
    json_content_type_only: bool
    model_required: bool
    """A request without ``model`` is a validation error."""
    unknown_model_lists_aliases: bool
    error_names_parameter: bool
    """Validation messages end in ``(parameter=...)`` and carry the parameter."""
    empty_stream_options_allowed: bool
    """``stream_options: {}`` without ``stream`` passes (only a non-empty one is refused)."""
    include_usage_by_default: bool
    """``stream_options`` without ``include_usage`` includes the usage chunk."""
    empty_prompt_batch_error: bool
    """``prompt: []`` gets "You must pass at least one prompt"."""
    api_server_log_prefix: bool
    """Log lines start with ``(APIServer pid=N)``."""
    startup_banner: str
    uvicorn_running_line: bool


@dataclass(frozen=True)
class RecipeVersion:
    """One recipe version: every behaviour in which it differs from the others."""

    name: str
    vllm_version: str
    """What ``GET /version`` answers."""
    vllm_series: str
    """The release line, as messages name it (``vLLM 0.6``)."""
    chunked_prefill_by_default: bool
    auto_chunked_above_tokens: int | None
    """``max_model_len`` above which vLLM chunks prefills by itself (None: never)."""
    kv_offloading: bool
    """``--kv-offloading-size`` exists."""
    clamps_max_tokens: bool
    """``max_tokens`` beyond the context is clamped to what the prompt leaves (0.33); else any
    prompt + max_tokens beyond ``max_model_len`` is an error (0.6)."""
    budget_counts_tp_buffers: bool
    """The KV budget's memory snapshot counts NCCL/all-reduce buffers (taken before init)."""
    budget_counts_cuda_graphs: bool
    """The KV budget subtracts the CUDA graphs' estimate (captured after sizing otherwise)."""
    cuda_graphs_sized_by_scheduler: bool
    """The largest step under CUDA graphs follows the scheduler's seats and token budget."""
    tp_step_broadcast: bool
    """Each step broadcasts its inputs to the TP workers from the driver (V0)."""
    mixed_step_single_varlen: bool
    """A mixed prefill/decode step is one varlen attention call (V1)."""
    host_cost: HostCost
    eager_host_cost: HostCost
    """The host-side cost under ``--enforce-eager``."""
    scheduler: SchedulerDefaults
    kv: KvConnector
    server: ServerDialect
    commands: Recipe

    def host_cost_with(self, enforce_eager: bool) -> HostCost:
        """The host-side cost of the engine's steps, with or without ``--enforce-eager``."""
        return self.eager_host_cost if enforce_eager else self.host_cost
