"""The bytes vLLM's OpenAI server writes, in its two flavours: ``v1`` = vLLM 0.33 (V1 engine,
``vllm serve``) and ``v0`` = vLLM 0.6.x (V0 engine, the published studies). Every shape follows
``shared/reference/vllm-openai-server.md`` (section numbers below refer to it)."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Mapping
from typing import Any

from servematrix.recipes import recipe_version


def dumps(document: Any) -> str:
    """Compact JSON, as pydantic's ``model_dump_json`` writes it."""
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False)


def sse(document: Any) -> bytes:
    return f"data: {dumps(document)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def response_id(recipe: str, header_request_id: str | None) -> str:
    """``cmpl-`` + the ``X-Request-Id`` header, else random hex (16 chars in 0.33, 32 in 0.6)."""
    if header_request_id:
        return f"cmpl-{header_request_id}"
    return "cmpl-" + secrets.token_hex(recipe_version(recipe).server.completion_id_hex_chars // 2)


def system_fingerprint(recipe: str, tensor_parallel: int, config_text: str) -> str:
    """``vllm-<version>[-tpN]-<hash8>`` (§2; the hash covers the server's configuration)."""
    tp = f"-tp{tensor_parallel}" if tensor_parallel > 1 else ""
    digest = hashlib.sha256(config_text.encode()).hexdigest()[:8]
    return f"vllm-{recipe_version(recipe).vllm_version}{tp}-{digest}"


_PATHS = (
    re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"),
    re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"),
)


def sanitize_message(message: str) -> str:
    """vLLM's V1 error responses replace file paths by ``<path>`` (its
    ``exception_handling.utils.sanitize_message``): a local model's directory included."""
    for pattern in _PATHS:
        message = pattern.sub("<path>", message)
    return message.strip()


def error_body(recipe: str, message: str, kind: str, code: int, param: str | None = None) -> str:
    """0.33 nests the error object (paths in its message sanitized); 0.6 writes it flat
    (§4, §11.1)."""
    if recipe_version(recipe).server.nested_error_body:
        message = sanitize_message(message)
        return dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})
    return dumps(
        {"object": "error", "message": message, "type": kind, "param": param, "code": code}
    )


def usage(recipe: str, prompt_tokens: int, completion_tokens: int, *, chunk: bool) -> dict:
    """Key order prompt, total, completion (§2). 0.6's continuous usage has a null
    ``prompt_tokens_details``; 0.33's chunks do not."""
    document: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if chunk and not recipe_version(recipe).server.extended_response_fields:
        document["prompt_tokens_details"] = None
    return document


def token_chunk(
    recipe: str,
    head: dict[str, Any],
    text: str,
    finish_reason: str | None,
    continuous_usage: dict | None,
    kv_transfer_params: Any = None,
    fingerprint: str | None = None,
) -> bytes:
    """One streamed delta (§2). ``head`` = id, object, created, model."""
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }
    document = dict(head)
    if recipe_version(recipe).server.extended_response_fields:
        choice.update(prompt_token_ids=None, token_ids=None, weight_versions=None)
        document["choices"] = [choice]
        if fingerprint is not None:
            document["system_fingerprint"] = fingerprint
        if continuous_usage is not None:
            document["usage"] = continuous_usage
        document["kv_transfer_params"] = kv_transfer_params
    else:
        document["choices"] = [choice]
        document["usage"] = continuous_usage
    return sse(document)


def usage_chunk(recipe: str, head: dict[str, Any], final_usage: dict, fingerprint: str) -> bytes:
    """The usage-only chunk before ``[DONE]`` (serialized without nulls)."""
    document = {**head, "choices": [], "usage": final_usage}
    if recipe_version(recipe).server.extended_response_fields:
        document["system_fingerprint"] = fingerprint
    return sse(document)


def completion(
    recipe: str,
    head: dict[str, Any],
    text: str,
    prompt_tokens: int,
    completion_tokens: int,
    kv_transfer_params: Any,
    fingerprint: str,
) -> str:
    """The non-streaming response (§3)."""
    counts = usage(recipe, prompt_tokens, completion_tokens, chunk=False)
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    if recipe_version(recipe).server.extended_response_fields:
        choice.update(
            token_ids=None,
            prompt_logprobs=None,
            prompt_token_ids=None,
            routed_experts=None,
            weight_versions=None,
        )
        counts.update(prompt_tokens_details=None, completion_tokens_details=None)
        return dumps(
            {
                **head,
                "choices": [choice],
                "service_tier": None,
                "system_fingerprint": fingerprint,
                "usage": counts,
                "kv_transfer_params": kv_transfer_params,
                "ec_transfer_params": None,
                "metrics": None,
            }
        )
    choice["prompt_logprobs"] = None
    counts["prompt_tokens_details"] = None
    return dumps({**head, "choices": [choice], "usage": counts})


def model_list(served_names: list[str], root: str, max_model_len: int, created: int) -> str:
    """``GET /v1/models``: one card per served name (§5)."""
    cards = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": None,
            "max_model_len": max_model_len,
            "permission": [
                {
                    "id": "modelperm-" + secrets.token_hex(8),
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        for name in served_names
    ]
    return dumps({"object": "list", "data": cards})


METRIC_HELP = {
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "vllm:num_requests_swapped": ("gauge", "Number of requests swapped to CPU."),
    "vllm:gpu_cache_usage_perc": ("gauge", "GPU KV-cache usage. 1 means 100 percent usage."),
    "vllm:cpu_cache_usage_perc": ("gauge", "CPU KV-cache usage. 1 means 100 percent usage."),
    "vllm:num_preemptions": ("counter", "Cumulative number of preemption from the engine."),
    "vllm:prompt_tokens": ("counter", "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("counter", "Number of generation tokens processed."),
    "vllm:tokens": ("counter", "Number of prefill plus generation tokens processed."),
    "vllm:prefix_cache_queries": (
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "vllm:prefix_cache_hits": (
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
}
"""Each series' Prometheus type and help text, as vLLM writes them (counters get ``_total``)."""

HISTOGRAM_HELP = {
    "vllm:request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "vllm:request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "vllm:request_generation_tokens": "Number of generation tokens processed.",
}
"""The request histograms the emulator exports, as sum and count only (one ``+Inf`` bucket):
what ``servematrix calibrate`` reads of them."""


def metrics_text(
    recipe: str,
    model_name: str,
    *,
    running: int,
    waiting: int,
    kv_usage: float,
    prompt_tokens: int,
    generation_tokens: int,
    preemptions: int,
    prefix_cache: tuple[int, int] = (0, 0),
    histograms: Mapping[str, tuple[float, int]] | None = None,
) -> str:
    """Prometheus text of the series the harness reads (§6): 0.33 labels every series with
    ``model_name`` and ``engine="0"``; 0.6 with ``model_name`` only and names KV usage
    ``gpu_cache_usage_perc``. ``prefix_cache`` is (queried, hit) prompt tokens: 0.33's
    ``prefix_cache_{queries,hits}_total`` (0.6.6 exports only a hit-rate gauge, not emulated).
    ``histograms`` maps names of ``HISTOGRAM_HELP`` to (sum, count)."""
    per_engine = recipe_version(recipe).server.engine_metrics
    labels = f'model_name="{model_name}"' + (',engine="0"' if per_engine else "")
    series: list[tuple[str, float]] = [
        ("vllm:num_requests_running", running),
        ("vllm:num_requests_waiting", waiting),
    ]
    if per_engine:
        series.append(("vllm:kv_cache_usage_perc", kv_usage))
    else:
        series += [
            ("vllm:num_requests_swapped", 0),
            ("vllm:gpu_cache_usage_perc", kv_usage),
            ("vllm:cpu_cache_usage_perc", 0),
        ]
    series += [
        ("vllm:num_preemptions", preemptions),
        ("vllm:prompt_tokens", prompt_tokens),
        ("vllm:generation_tokens", generation_tokens),
    ]
    if per_engine:
        series += [
            ("vllm:prefix_cache_queries", prefix_cache[0]),
            ("vllm:prefix_cache_hits", prefix_cache[1]),
        ]
    else:
        series.append(("vllm:tokens", prompt_tokens + generation_tokens))
    lines = []
    for name, value in series:
        kind, help_text = METRIC_HELP[name]
        sample = f"{name}_total" if kind == "counter" else name
        lines.append(f"# HELP {sample} {help_text}")
        lines.append(f"# TYPE {sample} {kind}")
        lines.append(f"{sample}{{{labels}}} {float(value)!r}")
    for name, (total, count) in (histograms or {}).items():
        lines.append(f"# HELP {name} {HISTOGRAM_HELP[name]}")
        lines.append(f"# TYPE {name} histogram")
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(count)!r}')
        lines.append(f"{name}_sum{{{labels}}} {float(total)!r}")
        lines.append(f"{name}_count{{{labels}}} {float(count)!r}")
    return "\n".join(lines) + "\n"
