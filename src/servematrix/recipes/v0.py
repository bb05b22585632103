"""Recipe ``v0``: vLLM 0.6.6.post1 (V0 engine) with the Mooncake v0 connector, as the published
vLLM 0.6 studies ran it (``shared/reference/vllm-mooncake-spec.md`` §4)."""

from __future__ import annotations

from servematrix.recipes.base import (
    DEPLOYMENT_DIR,
    HostCost,
    KvConnector,
    LinkPreset,
    Recipe,
    RecipeVersion,
    SchedulerDefaults,
    Segment,
    ServerDialect,
)

V0_OUTPUT_PROCESSING_MS_PER_SEQ = 0.103
"""V0 ``LLMEngine._process_model_outputs`` (detokenise, build the request outputs, check stop
conditions): 0.2 ms at batch 1 and 3.4 ms at batch 32, Llama-3-70B FP8 on 4 H100 (vLLM RFC
#6913, the async output processor's design, July 2024), i.e. (3.4 - 0.2) / 31 ms per sequence.
vLLM 0.6.0 runs it beside the next step (PR #7049)."""

V0_HOST_COST = HostCost(
    step_ms=2.07, per_seq_ms=0.0, overlapped_per_seq_ms=V0_OUTPUT_PROCESSING_MS_PER_SEQ
)
"""``step_ms`` fitted on the calibration rows of the Qwen2 speed benchmark (vLLM 0.4.2, A100,
batch 1, bf16, input 1): 1.98 / 2.09 / 2.07 ms for the 0.5B / 1.5B / 7B models, median 2.07
(``benchmarks/fidelity.py`` prints the fit). The per-request part on the critical path is not
identified by batch-1 data and is left at 0. vLLM 0.6's asynchronous output processing moved
part of this off the critical path, so for the ``v0`` recipe (0.6.x) it is an upper bound."""

V0_EAGER_HOST_COST = HostCost(
    step_ms=V0_HOST_COST.step_ms, per_seq_ms=V0_OUTPUT_PROCESSING_MS_PER_SEQ
)
"""``--enforce-eager`` turns V0's async output processor off ("Since, enforce-eager is enabled,
async output processor cannot be used", ``ModelConfig.verify_async_output_proc``), so output
processing is back on the critical path of every step."""

AUTO_CHUNKED_ABOVE = 32768
"""vLLM 0.6 turns chunked prefill on by itself above this ``max_model_len`` (``EngineArgs``)."""

DEFAULT_WATERMARK = 0.01
"""V0 ``CacheConfig``/``BlockSpaceManager`` watermark: 1 % of blocks stay free on admission."""

A10_EXTRAPOLATED = (
    "extrapolated from A10 hosts: fitted on Mooncake's vLLM 0.6.2 tables (A10-24GB nodes, "
    "Alibaba Cloud eRDMA / TCP on a ~25 Gbit/s VPC network); the CPU copy chain dominates and "
    "was never measured on other GPUs or hosts, so on any other hardware this is an extrapolation"
)
"""Provenance of the v0 presets (written into the trace metadata with the link)."""

LINK_PRESETS = {
    # V0 MooncakePipe through CPU buffers (module docstring). Wire: Mooncake's A10 nodes used
    # Alibaba Cloud eRDMA ("device_name": "erdma_0") on a VPC network of ~25 Gbit/s per node
    # (≈3 GB/s, approximate); Mooncake published "1 NIC" and "2 NICs" rows. The CPU chain per
    # rank (D2H copy, pickle, copy into the managed buffer, copy out, unpickle, pageable H2D:
    # ~6 serial copies of the shard in one Python thread) dominates; its two rates are
    # calibrated against all five Mooncake A10 tables (docs/engine-model.md "Calibration").
    "rdma": LinkPreset(
        "v0-rdma",
        3.0,
        2.0,
        nics=1,
        rank_cpu_gb_s=0.65,
        rank_cpu_fast_gb_s=2.4,
        rank_cpu_fast_mb=16.0,
        provenance=A10_EXTRAPOLATED,
    ),
    # Mooncake TE's TCP transport over the same ~25 Gbit/s VPC network as eRDMA: the wire is
    # the same, kernel TCP reaches ~80-85 % of it. 2.5 GB/s is the rate the two saturated,
    # duration-pinned rows imply (v0.2-input TP 4, in 4096 and 8192: TCP takes 32 and 40 ms
    # more per request than 1-NIC RDMA for 4 x 88 and 4 x 176 MB, i.e. 2.4 and 2.6 GB/s);
    # it also gives TCP ≈ RDMA at TP 2/4, in 1024 (+8-9 ms per receive against 1-NIC RDMA: 5-6 ms
    # of wire, 3 of setup), as published. Same CPU chain; longer setup (llm-d table: TCP 2-10 ms).
    "tcp": LinkPreset(
        "v0-tcp",
        2.5,
        5.0,
        nics=1,
        rank_cpu_gb_s=0.65,
        rank_cpu_fast_gb_s=2.4,
        rank_cpu_fast_mb=16.0,
        provenance=A10_EXTRAPOLATED,
    ),
}

COMMANDS = Recipe(
    name="v0",
    executable=("python3", "-m", "vllm.entrypoints.openai.api_server"),
    args=(
        Segment(("--model", "{model}"), "model_flag"),
        Segment(("{model}",), "model_positional"),
        Segment(("--port", "{port}", "-tp", "{tp}", "--max-model-len", "{max_model_len}")),
        # The published aggregated launches silence the per-request logs; the Mooncake doc's
        # disaggregated launches do not (spec §1.1 vs §2.2).
        Segment(("--disable-log-stats", "--disable-log-requests"), "aggregated"),
        Segment(("--enable-chunked-prefill",), "chunked_on"),
        Segment(("--gpu-memory-utilization", "{gpu_memory_utilization}")),
        Segment(("--kv-transfer-config", "{kv_transfer_config}"), "disaggregated"),
        # Config `prefix_caching: true` (off by default in 0.6), after the published line.
        Segment(("--enable-prefix-caching",), "prefix_caching_on"),
    ),
    kv_transfer_config={
        "kv_producer": {
            "kv_connector": "MooncakeConnector",
            "kv_role": "kv_producer",
            "kv_rank": 0,
            "kv_parallel_size": 2,
            "kv_buffer_size": "{kv_buffer_size}",
        },
        "kv_consumer": {
            "kv_connector": "MooncakeConnector",
            "kv_role": "kv_consumer",
            "kv_rank": 1,
            "kv_parallel_size": 2,
            "kv_buffer_size": "{kv_buffer_size}",
        },
    },
    disaggregated_env={"MOONCAKE_CONFIG_PATH": f"{DEPLOYMENT_DIR}/mooncake.json"},
    etcd=True,
    disagg_proxy="disagg-v0",
)

V0 = RecipeVersion(
    name="v0",
    vllm_version="0.6.6.post1",
    vllm_series="0.6",
    chunked_prefill_by_default=False,
    auto_chunked_above_tokens=AUTO_CHUNKED_ABOVE,
    kv_offloading=False,
    clamps_max_tokens=False,
    budget_counts_tp_buffers=True,
    budget_counts_cuda_graphs=False,
    cuda_graphs_sized_by_scheduler=False,
    tp_step_broadcast=True,
    mixed_step_single_varlen=False,
    host_cost=V0_HOST_COST,
    eager_host_cost=V0_EAGER_HOST_COST,
    scheduler=SchedulerDefaults(
        unchunked_policy="prefill_first",
        watermark=DEFAULT_WATERMARK,
        preempt_blocks_admission=False,
        prefix_caching=False,
        max_num_seqs_on_cpu=256,
        large_gpu_budget_and_seqs=None,
    ),
    kv=KvConnector(
        name="mooncake-v0",
        lookup_buffer=True,
        sends_hidden_state=True,
        transfer_config_keys=frozenset(
            {
                "kv_connector",
                "kv_buffer_device",
                "kv_buffer_size",
                "kv_role",
                "kv_rank",
                "kv_parallel_size",
                "kv_ip",
                "kv_port",
            }
        ),
        config_path_env="MOONCAKE_CONFIG_PATH",
        link_presets=LINK_PRESETS,
    ),
    server=ServerDialect(
        completion_id_hex_chars=32,
        nested_error_body=False,
        extended_response_fields=False,
        engine_metrics=False,
        json_content_type_only=False,
        model_required=True,
        unknown_model_lists_aliases=False,
        error_names_parameter=False,
        empty_stream_options_allowed=False,
        include_usage_by_default=True,
        empty_prompt_batch_error=False,
        api_server_log_prefix=False,
        startup_banner="Starting vLLM API server",
        uvicorn_running_line=True,
    ),
    commands=COMMANDS,
)
