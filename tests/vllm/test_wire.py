"""One wire suite, two servers: the same requests to real vLLM (CPU) and to the emulator, both
started by servematrix's deployment code from one plan; status, error text, chunk structure
and field set must agree, or be a deliberate difference listed in docs/emulator-wire.md."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from servematrix.deploy.recipes import plan
from servematrix.deploy.supervise import Deployment
from servematrix.spec import config
from tests.vllm.conftest import free_base, ports, vllm_config

DOC = Path(__file__).parents[2] / "docs" / "emulator-wire.md"
MAX_MODEL_LEN = 2048
# Deliberate differences, by case: each is in docs/emulator-wire.md with its reason.
KEYS_033 = "0.33's chunk and choice keys (kv_transfer_params, weight_versions)"
DELIBERATE = {
    "GET /version": "the emulator speaks vLLM 0.33's wire; the CPU build is 0.32",
    "stream, continuous usage": KEYS_033,
    "stream, include_usage": KEYS_033,
    "stream, no stream_options": KEYS_033,
    "prompt + max_tokens > max_model_len": KEYS_033,
    "not streamed": "0.33's choice key weight_versions",
    "text prompt": "0.33's choice key weight_versions",
    "GET /metrics histograms": "the emulator serves only the series servematrix reads (a cell's; "
    "calibrate's request histograms, as sum and count)",
}


def without_033_keys(signature: str) -> str:
    """An emulator signature with the keys 0.33 added and 0.32 lacks taken out: what must
    then equal real vLLM's for a row listed with them."""
    streamed = signature.startswith("200 token")  # 0.32's responses do have the first
    for key in ("kv_transfer_params", "weight_versions") if streamed else ("weight_versions",):
        signature = re.sub(rf"(?<=[{{,]){key},|,{key}(?=}})", "", signature)
    return signature


# The /metrics series servematrix reads while it runs cells (deploy.memory, deploy.supervise).
HARNESS_METRICS = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
)
# Series only benchmarks/real_vllm.py reads, from real vLLM.
HISTOGRAMS = (
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_bucket",
)


def _ids(n: int) -> list[int]:
    return [(7 * i) % 8000 + 1 for i in range(n)]


def _body(served: str, **fields: Any) -> dict[str, Any]:
    return {"model": served, "prompt": _ids(8), "max_tokens": 4, "ignore_eos": True, **fields}


USAGE = {"include_usage": True, "continuous_usage_stats": True}
CASES: list[tuple[str, str, str, dict[str, Any] | None]] = [
    (
        "stream, continuous usage",
        "POST",
        "/v1/completions",
        {"stream": True, "stream_options": USAGE},
    ),
    (
        "stream, include_usage",
        "POST",
        "/v1/completions",
        {"stream": True, "stream_options": {"include_usage": True}},
    ),
    ("stream, no stream_options", "POST", "/v1/completions", {"stream": True}),
    ("not streamed", "POST", "/v1/completions", {}),
    ("text prompt", "POST", "/v1/completions", {"prompt": "hello there world"}),
    ("stream_options without stream", "POST", "/v1/completions", {"stream_options": USAGE}),
    ("prompt > max_model_len", "POST", "/v1/completions", {"prompt": _ids(2999)}),
    ("prompt = max_model_len", "POST", "/v1/completions", {"prompt": _ids(MAX_MODEL_LEN)}),
    (
        "prompt + max_tokens > max_model_len",
        "POST",
        "/v1/completions",
        {"prompt": _ids(2046), "max_tokens": 10, "stream": True},
    ),
    ("max_tokens -1", "POST", "/v1/completions", {"max_tokens": -1}),
    ("max_tokens not an integer", "POST", "/v1/completions", {"max_tokens": "x"}),
    ("unknown model", "POST", "/v1/completions", {"model": "nope"}),
    ("id beyond the vocabulary", "POST", "/v1/completions", {"prompt": [1, 9999999]}),
    ("empty prompt", "POST", "/v1/completions", {"prompt": []}),
    ("GET /health", "GET", "/health", None),
    ("GET /v1/models", "GET", "/v1/models", None),
    ("GET /version", "GET", "/version", None),
    ("GET /metrics names", "GET", "/metrics", None),
    ("GET /metrics histograms", "GET", "/metrics", None),
    ("unknown route", "GET", "/nope", None),
    ("POST /reset_prefix_cache", "POST", "/reset_prefix_cache", None),
]


def _keys(document: Any) -> str:
    return ",".join(sorted(document)) if isinstance(document, dict) else type(document).__name__


def _shape(document: dict[str, Any]) -> str:
    """Top-level keys, the first choice's keys, the usage keys."""
    choices = document.get("choices") or [{}]
    usage = document.get("usage") or {}
    return f"{{{_keys(document)}}} choice{{{_keys(choices[0])}}} usage{{{_keys(usage)}}}"


def _union(shapes: list[str]) -> str:
    """Key sets of several ``_shape`` strings merged group by group (top, choice, usage)."""
    groups: list[set[str]] = [set(), set(), set()]
    for shape in shapes:
        for i, keys in enumerate(re.findall(r"\{([^}]*)\}", shape)):
            groups[i].update(k for k in keys.split(",") if k)
    top, choice, usage = (",".join(sorted(g)) for g in groups)
    return f"{{{top}}} choice{{{choice}}} usage{{{usage}}}"


def _listed(case: str, real: str, emulated: str) -> bool:
    """A difference listed in DELIBERATE: exactly 0.33's extra keys, or (other rows) the same
    status."""
    listed = DELIBERATE.get(case)
    if listed is None:
        return False
    if listed.startswith("0.33"):
        return real == without_033_keys(emulated)
    return real[:3] == emulated[:3]


def signature(status: int, body: bytes, model: str, case: str) -> str:
    """What must agree: status, error text (model path as <m>), chunk structure, field sets."""
    text = body.decode(errors="replace").replace(model, "<m>")
    if case.startswith("GET /metrics"):
        names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
        wanted = HARNESS_METRICS if case == "GET /metrics names" else HISTOGRAMS
        missing = [name for name in wanted if name not in names]
        return f"{status} missing: {', '.join(missing) or 'none'}"
    if case == "GET /v1/models":
        card = json.loads(text)["data"][0]
        return f"{status} card{{{_keys(card)}}} permission{{{_keys(card['permission'][0])}}}"
    if text.startswith("data:"):
        events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        kinds: list[str] = []
        fields: dict[str, dict[str, None]] = {"token": {}, "usage": {}}  # key sets, in order
        for event in events:
            if event == "[DONE]":
                kinds.append("[DONE]")
                continue
            document = json.loads(event)
            kind = "token" if document.get("choices") else "usage"
            kinds.append(kind)
            fields[kind][_shape(document)] = None
        # One chunk per token, or fewer when tokens are due together (both servers merge), so
        # the field sets are each kind's union over its chunks.
        runs = re.sub(r"(token )+", "token+ ", " ".join(kinds) + " ")
        union = {kind: _union(list(shapes)) for kind, shapes in fields.items() if shapes}
        return f"{status} {runs.strip()}: " + " ; ".join(f"{k} {v}" for k, v in union.items())
    try:
        document = json.loads(text) if text else None
    except ValueError:
        return f"{status} {text[:200]}"
    if isinstance(document, dict) and isinstance(document.get("error"), dict):
        error = document["error"]
        message = re.sub(r"\s+", " ", str(error.get("message")))
        return f"{status} {error.get('type')} param={error.get('param')} {message}"
    if isinstance(document, dict) and "choices" in document:
        return f"{status} {_shape(document)}"
    return f"{status} {text[:200] if case != 'GET /version' else text}"


async def _send(base: str, method: str, path: str, body: dict | None) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, base + path, json=body) as response,
    ):
        return response.status, await response.read()


async def _abort_mid_stream(base: str, model: str) -> str:
    """Read two chunks of a long stream, drop the connection; the server must let it go."""
    body = _body(model, max_tokens=1000, stream=True)
    async with aiohttp.ClientSession() as session:
        async with session.post(base + "/v1/completions", json=body) as response:
            chunks = 0
            async for _ in response.content:
                chunks += 1
                if chunks >= 4:
                    break
            response.close()
        for _ in range(100):
            async with session.get(base + "/metrics") as response:
                text = await response.text()
            running = [
                line for line in text.splitlines() if line.startswith("vllm:num_requests_running")
            ]
            if running and float(running[0].rsplit(" ", 1)[1]) == 0:
                return "200, dropped after 2 chunks; running back to 0"
            await asyncio.sleep(0.1)
    return "200, dropped after 2 chunks; still running after 10 s"


def _start_all(deployments: list[Deployment]) -> None:
    errors: list[BaseException] = []

    def start(deployment: Deployment) -> None:
        try:
            deployment.start()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=start, args=(d,)) for d in deployments]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for deployment in deployments:
            deployment.stop()
        raise errors[0]


@pytest.fixture(scope="module")
def servers(vllm_cpu, tmp_path_factory):
    """Real vLLM and the emulator, each with and without VLLM_SERVER_DEV_MODE (prefix caching
    on turns it on), one core each for the two vLLM servers."""
    _, model = vllm_cpu
    root = tmp_path_factory.mktemp("wire")
    started: dict[tuple[str, bool], tuple[str, Deployment]] = {}
    bases: list[int] = []
    while len(bases) < 2:  # two distinct port blocks (nothing is bound until both start)
        base = free_base()
        if base not in bases:
            bases.append(base)
    for dev in (False, True):
        cfg = vllm_config(model, ["single"], [4])
        cfg["ports"] = ports(bases[dev])
        cfg["defaults"]["prefix_caching"] = dev
        cell = config.load(cfg).all_cells()[0]
        if dev:  # the second vLLM server on the second core
            cell = dataclasses.replace(cell, model=dataclasses.replace(cell.model, gpus=((1,),)))
        for backend in ("vllm", "emulator"):
            p = plan(cell, backend)
            if backend == "emulator":  # its own port
                port = p.processes[0].port + 1
                process = p.processes[0]
                argv = tuple(str(port) if a == str(process.port) else a for a in process.argv)
                health = dataclasses.replace(
                    process.health, url=process.health.url.replace(str(process.port), str(port))
                )
                p = dataclasses.replace(
                    p,
                    processes=(dataclasses.replace(process, argv=argv, port=port, health=health),),
                )
            where = root / f"{backend}-{dev}"
            deployment = Deployment(p, where, where / "logs", "127.0.0.1", 300, 20)
            started[(backend, dev)] = (p.processes[0].health.url.rsplit("/", 1)[0], deployment)
    _start_all([d for _, d in started.values()])
    try:
        yield {key: base for key, (base, _) in started.items()}, str(model)
    finally:
        for _, deployment in started.values():
            deployment.stop()


def _run_suite(base_no_dev: str, base_dev: str, model: str) -> dict[str, str]:
    out = {}
    for case, method, path, fields in CASES:
        body = None if fields is None else _body(model, **fields)
        base = base_dev if case == "POST /reset_prefix_cache" else base_no_dev
        status, raw = asyncio.run(_send(base, method, path, body))
        out[case] = signature(status, raw, model, case)
        if case == "POST /reset_prefix_cache":
            status, raw = asyncio.run(_send(base_no_dev, method, path, body))
            out[f"{case} (no dev mode)"] = signature(status, raw, model, case)
    out["abort mid-stream"] = asyncio.run(_abort_mid_stream(base_no_dev, model))
    return out


def test_real_vllm_and_the_emulator_agree_on_the_wire(servers):
    bases, model = servers
    real = _run_suite(bases[("vllm", False)], bases[("vllm", True)], model)
    emulated = _run_suite(bases[("emulator", False)], bases[("emulator", True)], model)
    rows, different = [], []
    for case in real:
        if real[case] == emulated[case]:
            verdict = "same"
        elif _listed(case, real[case], emulated[case]):
            verdict = f"listed: {DELIBERATE[case]}"
        else:
            verdict = "DIFFERENT"
            different.append(case)
        rows.append(f"| {case} | {real[case]} | {emulated[case]} | {verdict} |")
    table = "\n".join(
        ["| case | real vLLM 0.32 (CPU) | emulator (v1) | verdict |", "|---|---|---|---|", *rows]
    )
    print("\n" + table)
    assert different == [], table
    documented = DOC.read_text()
    assert all(f"`{case}`" in documented for case in DELIBERATE), (
        "every listed difference is documented"
    )
