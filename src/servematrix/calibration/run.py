"""Run the probe set against a live OpenAI-compatible server and collect its observations.

Every prompt is fresh random token ids (seeded), so no probe finds another's prefix in the
server's cache; a warm-up request goes first, unmeasured. The set runs ``repeats`` rounds, every
probe once a round in the round's own shuffled order (`run_order`), one run at a time, and
``/metrics`` is read around each run (`probes.server_observations`, and the API server's CPU over
the run, `probes.api_cpu_observation`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from servematrix.calibration.probes import (
    ApiCpuObservation,
    Observation,
    Probe,
    Stream,
    api_cpu_observation,
    observations,
    parse_metrics,
    server_observations,
)
from servematrix.client.senders import AiohttpSender, client_session
from servematrix.client.sse import HTTPStatusError, StreamParser

PROMPT_ID_FIRST = 1000
"""Prompt ids are drawn from here up to the vocabulary's end (special and byte tokens below)."""
MIXED_LATE_AFTER_TOKENS = 4
"""A mixed probe's newcomer is sent once every decoder has streamed this many tokens."""


class CalibrationError(RuntimeError):
    """The server could not be probed (one line, for the command line)."""


@dataclass(frozen=True)
class ServerInfo:
    version: str
    metrics: bool
    """Whether ``/metrics`` exports vLLM's request histograms."""


@dataclass(frozen=True)
class Settings:
    base_url: str
    """``http://host:port`` (no ``/v1``)."""
    model: str
    vocab_size: int
    """The model's vocabulary: a prompt id beyond it is refused (vLLM: "out of vocabulary")."""
    repeats: int = 3
    seed: int = 0
    request_timeout_s: float = 300.0


class _Client:
    def __init__(self, settings: Settings, session: aiohttp.ClientSession):
        self.settings = settings
        self.session = session
        self.sender = AiohttpSender(session, f"{settings.base_url}/v1")
        self.rng = random.Random(settings.seed)

    def body(self, prompt_tokens: int, output_tokens: int) -> bytes:
        vocab = self.settings.vocab_size
        first = min(PROMPT_ID_FIRST, vocab // 2)
        prompt = [self.rng.randrange(first, vocab) for _ in range(prompt_tokens)]
        return json.dumps(
            {
                "model": self.settings.model,
                "prompt": prompt,
                "max_tokens": output_tokens,
                "temperature": 0.0,
                "stream": True,
                "ignore_eos": True,
            }
        ).encode()

    async def stream(self, prompt_tokens: int, output_tokens: int, out: StreamParser) -> Stream:
        body = self.body(prompt_tokens, output_tokens)
        out.sent = time.monotonic()
        try:
            async with asyncio.timeout(self.settings.request_timeout_s):
                await self.sender(body, {"Content-Type": "application/json"}, out)
        except (TimeoutError, HTTPStatusError, aiohttp.ClientError, OSError) as error:
            raise CalibrationError(
                f"a probe request failed: {error or type(error).__name__}"
            ) from None
        out.finish()
        if out.error:
            raise CalibrationError(f"a probe request failed: {out.error}")
        return Stream(out.sent, tuple(out.chunk_s))

    async def metrics(self) -> dict[str, float]:
        try:
            async with self.session.get(f"{self.settings.base_url}/metrics") as response:
                return parse_metrics(await response.text()) if response.status == 200 else {}
        except aiohttp.ClientError:
            return {}

    async def run(self, probe: Probe) -> tuple[list[Stream], Stream | None]:
        outs = [StreamParser() for _ in range(probe.concurrency)]
        tasks = [
            asyncio.create_task(self.stream(probe.prompt_tokens, probe.output_tokens, out))
            for out in outs
        ]
        late = None
        if probe.late_prompt_tokens:
            while not all(len(o.chunk_s) >= MIXED_LATE_AFTER_TOKENS for o in outs):
                if any(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.001)
            late = await self.stream(probe.late_prompt_tokens, 2, StreamParser())
        return list(await asyncio.gather(*tasks)), late


async def server_info(settings: Settings, session: aiohttp.ClientSession) -> ServerInfo:
    """The server's version, and that it serves ``settings.model``; CalibrationError if not."""
    url = settings.base_url
    try:
        async with session.get(f"{url}/v1/models") as response:
            served = [m.get("id") for m in (await response.json()).get("data", [])]
        version = ""
        async with session.get(f"{url}/version") as response:
            if response.status == 200:
                version = str((await response.json()).get("version", ""))
    except (aiohttp.ClientError, OSError, ValueError) as error:
        raise CalibrationError(f"no OpenAI-compatible server at {url}: {error}") from None
    if settings.model not in served:
        raise CalibrationError(
            f"{url} serves {', '.join(map(str, served))}, not {settings.model!r}"
        )
    metrics = await _Client(settings, session).metrics()
    return ServerInfo(version, "vllm:request_prefill_time_seconds_count" in metrics)


def run_order(probes: list[Probe], repeats: int, seed: int) -> list[tuple[int, Probe]]:
    """(round, probe) in the order they run: ``repeats`` rounds of every probe, each round
    shuffled by its own seed. A machine whose speed drifts during a calibration (this project's
    2-core VM: 8 % between two fits five minutes apart) then shifts every term's probes alike;
    each probe's runs back to back, kind after kind, would put the drift on the terms whose
    probes ran while it lasted."""
    order = []
    for round_index in range(repeats):
        shuffled = list(probes)
        random.Random(f"{seed}-{round_index}").shuffle(shuffled)
        order += [(round_index, probe) for probe in shuffled]
    return order


async def probe_server(
    settings: Settings, probes: list[Probe], progress: Callable[[str], None]
) -> tuple[ServerInfo, list[Observation], list[ApiCpuObservation]]:
    """Every probe ``settings.repeats`` times; the observations of all runs, and the API
    server's CPU over each run where ``/metrics`` gives it."""
    async with client_session(max(p.concurrency for p in probes) + 1) as session:
        info = await server_info(settings, session)
        client = _Client(settings, session)
        await client.stream(16, 2, StreamParser())  # warm-up, unmeasured
        rows: list[Observation] = []
        api_rows: list[ApiCpuObservation] = []
        for position, (round_index, probe) in enumerate(
            run_order(probes, settings.repeats, settings.seed), start=1
        ):
            before = await client.metrics()
            streams, late = await client.run(probe)
            after = await client.metrics()
            measured = observations(probe, streams, late)
            kv = measured[-1].kv_tokens_read if measured else 0.0
            rows += measured + server_observations(probe, before, after, kv)
            api = api_cpu_observation(probe, before, after)
            api_rows += [api] if api else []
            if position % len(probes) == 0:
                progress(f"round {round_index + 1} of {settings.repeats}: {len(probes)} probes")
        return info, rows, api_rows
