"""Recipe ``v1``: vLLM 0.33 (V1 engine, ``vllm serve``) with the in-tree MooncakeConnector
(``shared/reference/vllm-mooncake-spec.md`` §4)."""

from __future__ import annotations

from servematrix.engine.host import V1_HOST_COST
from servematrix.recipes.base import (
    KvConnector,
    LinkPreset,
    Recipe,
    RecipeVersion,
    SchedulerDefaults,
    Segment,
    ServerDialect,
)

DATASHEET = (
    "from datasheets and Mooncake's README (GPU-direct; not fitted on any measured vLLM run)"
)
"""Provenance of the v1 presets (written into the trace metadata with the link)."""

LINK_PRESETS = {
    # V1 in-tree MooncakeConnector: GPU-direct RDMA writes by the Transfer Engine. Mooncake
    # README: 87 GB/s over 4×200 Gb/s RoCE and 190 GB/s over 8×400 Gb/s, i.e. ~22-24 GB/s per
    # NIC (87-95 % of line rate); llm-d-inference-sim's table: RoCE 200G ≈ 20 GB/s. One NIC per
    # GPU (DGX/HGX). Setup 0.5-2 ms (llm-d table).
    "rdma": LinkPreset("v1-rdma", 20.0, 1.0, provenance=DATASHEET),
    # V1 over Mooncake's TCP transport. Mooncake's EFA doc measured iperf3 at 9.5 GB/s (8
    # streams) but Mooncake's own TCP transport at 0.11 GB/s ("unoptimized for throughput"); the
    # README's "RDMA 2.4× faster than TCP" implies ~9 GB/s per 200 Gb/s NIC. Pessimistic preset:
    # 1 GB/s per NIC, setup 5 ms (llm-d table: TCP 2-10 ms). Override with engine.kv_link.
    "tcp": LinkPreset("v1-tcp", 1.0, 5.0, provenance=DATASHEET),
}

COMMANDS = Recipe(
    name="v1",
    executable=("vllm", "serve"),
    args=(
        Segment(("{model}",), "model_positional"),
        Segment(("--model", "{model}"), "model_flag"),
        Segment(("--port", "{port}", "-tp", "{tp}", "--max-model-len", "{max_model_len}")),
        Segment(("--gpu-memory-utilization", "{gpu_memory_utilization}")),
        # Parity with v0: V1 turns prefix caching and chunked prefill on by default (config
        # `prefix_caching: true` asks for it in the same place).
        Segment(("--no-enable-prefix-caching",), "prefix_caching_off"),
        Segment(("--enable-prefix-caching",), "prefix_caching_on"),
        Segment(("--no-enable-chunked-prefill",), "chunked_off"),
        Segment(("--enable-chunked-prefill",), "chunked_on"),
        Segment(("--kv-transfer-config", "{kv_transfer_config}"), "disaggregated"),
    ),
    kv_transfer_config={
        role: {
            "kv_connector": "MooncakeConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"mooncake_protocol": "{protocol}"},
        }
        for role in ("kv_producer", "kv_consumer")
    },
    producer_env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "{bootstrap_port}"},
    disagg_proxy="disagg-v1",
    prefix_cache_reset_env={"VLLM_SERVER_DEV_MODE": "1"},  # the route exists in dev mode only
)

V1 = RecipeVersion(
    name="v1",
    vllm_version="0.33.0",
    vllm_series="0.33",
    chunked_prefill_by_default=True,
    auto_chunked_above_tokens=None,
    kv_offloading=True,
    clamps_max_tokens=True,
    budget_counts_tp_buffers=False,
    budget_counts_cuda_graphs=True,
    cuda_graphs_sized_by_scheduler=True,
    tp_step_broadcast=False,
    mixed_step_single_varlen=True,
    host_cost=V1_HOST_COST,
    eager_host_cost=V1_HOST_COST,
    scheduler=SchedulerDefaults(
        unchunked_policy="decode_first",
        watermark=0.0,
        preempt_blocks_admission=True,
        prefix_caching=True,
        max_num_seqs_on_cpu=128,
        large_gpu_budget_and_seqs=(8192, 1024),
    ),
    kv=KvConnector(
        name="mooncake-v1",
        lookup_buffer=False,
        sends_hidden_state=False,
        transfer_config_keys=frozenset(
            {
                "kv_connector",
                "kv_role",
                "engine_id",
                "kv_port",
                "kv_buffer_device",
                "kv_connector_extra_config",
                "kv_connector_module_path",
                "kv_load_failure_policy",
            }
        ),
        config_path_env=None,
        link_presets=LINK_PRESETS,
    ),
    server=ServerDialect(
        completion_id_hex_chars=16,
        nested_error_body=True,
        extended_response_fields=True,
        engine_metrics=True,
        json_content_type_only=True,
        model_required=False,
        unknown_model_lists_aliases=True,
        error_names_parameter=True,
        empty_stream_options_allowed=True,
        include_usage_by_default=False,
        empty_prompt_batch_error=True,
        api_server_log_prefix=True,
        startup_banner="Starting vLLM server",
        uvicorn_running_line=False,
    ),
    commands=COMMANDS,
)
