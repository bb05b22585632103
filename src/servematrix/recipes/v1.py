"""Recipe ``v1``: vLLM 0.33 (V1 engine, ``vllm serve``) with the in-tree MooncakeConnector
(``shared/reference/vllm-mooncake-spec.md`` §4)."""

from __future__ import annotations

from servematrix.recipes.base import (
    HostCost,
    KvConnector,
    LinkPreset,
    Recipe,
    RecipeVersion,
    SchedulerDefaults,
    Segment,
    ServerDialect,
)

V1_API_REQUEST_MS = 4.0
"""The API server's serial work per request (V1): vLLM PR #17546 (API-server scale-out, May
2025) served Llama-3.2-1B on 2 A100s (DP 2) with ShareGPT at 120 req/s offered; with the single
API server of the time the 10,000 requests took 130.74 s, 76.5 req/s, far below what two A100s
decode for a 1B model: 13.07 ms of API-server time per request. Less its ~198 streamed tokens
(ShareGPT's mean output in vLLM's benchmark, PR #8335: 197,521 tokens for 1,000 prompts) at
``alpha2`` 45.9 us: 4.0 ms per request of input work. Derived, not fitted; the split assumes the
run was bound by the API server, which the PR's point (scale-out fixed it) implies. It is the
whole of the modelled API path: BLIS's ``alpha0`` is not used (see ``V1_HOST_COST``)."""

V1_HOST_COST = HostCost(
    step_ms=0.169,
    per_seq_ms=0.0028,
    overlapped_per_seq_ms=0.0459,
    request_ms=V1_API_REQUEST_MS,
)
"""Per-step beta7 169.4 us and per-request beta6 2.8 us (engine core, critical path) and
per-output-token alpha2 45.9 us (detokenisation and streaming in the API-server process,
beside the engine core), from BLIS's trained-physics fit, iteration 25: ``inference-sim/
inference-sim``, branch ``training`` @ 0ba6f035c69815b59c311bec6f66f854b68af4d4,
``training/iterations/iter25/inner_loop_results.json`` (copied to ``defaults.yaml`` by commit
638a7d33 "add trained-physics model (#950)" and refit since as iter29). That fit used 15
serving runs of inference-sim's own vLLM fork (journey and step tracing) on H100-80GB-HBM3
(``training/trainval_data/README.md``: Llama-2-7B, Qwen2.5-7B, Mistral-Nemo-12B, Yi-34B,
Llama-3.1-70B, Llama-4-Scout; TP 1-4), minimising RMSE of the per-run APE of mean TTFT plus
that of mean E2E; not vLLM 0.8.4 / 0.10.1 traces, as this docstring used to say.

Its ``alpha0`` (15,561.96 us, "QueueingTime", added between arrival and the engine's queue)
is not used: it was fitted together with a prefill compute term at 0.139 x the FLOP time at
peak (beta1a). For a 1,000-token prefill of a 7-8B model on an H100 BLIS's step is ~11 ms (2 ms
of compute, 6.5 ms of weight streaming, 2 ms per-layer) and its TTFT at idle ~27 ms with
alpha0; aiconfigurator's measured step alone is ~21 ms (Qwen2.5-7B, 1,024 tokens). So alpha0
stands in for prefill time BLIS's step leaves out, and adding it to a measured prefill counted
that time twice. The API path is ``V1_API_REQUEST_MS`` (idle TTFT 21 + 4 = 25 ms).
Not fitted here."""


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
