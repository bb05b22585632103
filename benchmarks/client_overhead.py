"""Client overhead: how much the load generator's own timing adds, beside vLLM's client.

Issue 8 ("What it must show"): against the emulator and against fixed-latency servers, sweep QPS
and prompt length; per point print the client's send lag and the gap between the TTFT/ITL the
client observes and the server's own timestamps, with ``vllm bench serve`` run against the same
server in the same run and printed beside ours. Targets: send lag P99 < 2 ms at 100 QPS; our
TTFT/ITL error no worse than vLLM's client's; 500 QPS sustained on 2 cores.

Servers (each started here on a free loopback port, stopped when its points are done):

* ``emulator``: ``servematrix-emulator serve DIR``, DIR a throwaway model directory (the shipped
  ``qwen2.5-0.5b`` architecture, modelled on an H100 so the engine itself is not the bottleneck,
  and a word-level tokenizer, below). Reference: its own ``GET /servematrix/requests``, per
  ``X-Request-Id`` the ``time.monotonic()`` at which its handler started (``arrival_s``) and
  after each chunk's write (``chunk_s``); cleared (``DELETE``) before every run. Its grid stops
  at 200 QPS and 8k words: beyond, the emulator's own CPU (engine steps; counting a text
  prompt's tokens on its event loop, ~3 µs a word) saturates it and every number is its queue.
* ``fixed``: `serve_fixed` below, this file run as ``--serve-fixed PORT``: chunk k of every
  stream due at arrival + 50 ms + k * 10 ms, nearly no work per request, the emulator's
  timestamp endpoint. The cleanest reference, and light enough for 500 QPS.
* ``mock``: ``guidellm mock-server`` (a throwaway venv, default ``/tmp/guidellm-venv``), TTFT
  50 ms and ITL 10 ms without spread; the reference is that configuration. It spends ~8 ms of
  CPU per request plus ~2 ms per 1k prompt words (Faker text, a regex tokenizer), which is
  inside both clients' "error" alike, so its grid stops at 50 QPS and 16k words.

Clients, run one after the other against the same server at every point (never together), with
the same kind of prompt, so the server does the same work for both:

* ``servematrix``: the ``servematrix bench`` command line, one process per point, as a user runs
  it, with ``--dataset jsonl``: 50 distinct prompts of the point's length in random words
  ``t<i>``, repeated. (The workflow's random dataset sends token ids; vLLM's client sends text,
  which the emulator must tokenize, so ours sends text here too.) Its trace has
  ``scheduled_s``/``sent_s``/``chunk_s`` on one clock whose ``time.monotonic()`` origin is in the
  metadata (``clock.origin_monotonic_s``); its ``X-Request-Id`` is
  ``<client.request_id_prefix>-<request_id>``.
* ``vllm``: ``vllm bench serve`` (a throwaway venv, default ``/tmp/vllm-venv``; never a project
  dependency) with ``--dataset-name random --save-result --save-detailed``, ``--tokenizer`` the
  word-level tokenizer, ``--request-id-prefix`` unique per run (it sends ``x-request-id:
  <prefix><i>``, so its requests match the server's log by id; its warm-ups carry none). One
  Python of that venv runs every point (``vllm.entrypoints.cli.main.main`` per point), so vLLM's
  ~15 s import is paid once. Its ``start_times`` are ``time.perf_counter()``, on Linux the same
  clock as ``time.monotonic()``; its chunk times are ``start + ttft + cumsum(itls)``.

Per client and point (measured requests only; warm-ups excluded), in ms:

* **lag** = actual send - scheduled send (P50/P99/max). Ours: ``sent_s - scheduled_s``. vLLM
  saves no schedule: it is rebuilt from the seed as ``vllm bench serve`` 0.33 draws it
  (``np.random.seed(seed)``, one ``gamma(burstiness, 1/(rate*burstiness))`` per request,
  cumulated, rescaled to end at N/rate), and its origin, also unsaved, is put at the least-late
  request: vLLM's lags are relative to its best request (low by that request's lag).
* **rate%** = achieved / scheduled send rate over the measured requests.
* **TTFTerr** = client TTFT - server TTFT (P50/P99). Logged servers: server TTFT = first chunk
  written - handler start; the error = **up** (handler start - client send stamp: the client's
  own work after its stamp, loopback, and any wait in the server's accept queue) + the first
  chunk's **down** (client read - server write). Mock: server TTFT = the configured one.
* **ITLerr** = |client gap - server gap| per chunk gap (P50/P99): logged servers chunk k to chunk
  k (a request whose chunk counts differ is left out and counted in ``unm``); mock the configured
  ITL (vLLM's client also counts the mock's closing empty-text chunk, ours skips it as vLLM 0.6
  did; its reference gap is 0). A request answered in one chunk has no gap.
* **up p99**, **down p99**: the two halves above (logged servers only); ``down`` is the purest
  client measure: how late the client reads what the server wrote.

Targets, printed as met/missed at the end: send lag P99 < 2 ms at 100 QPS (1k words); at every
point our P99 TTFT and ITL errors no worse than vLLM's (within 10 % or 0.2 ms, the larger: the
machine is shared and noisy); 500 QPS sustained = on schedule: >= 98 % of the scheduled send
rate, send lag P99 < 10 ms, no failed request.

The word-level tokenizer (``t0`` ... ``t<V-1>`` split on whitespace, V = the architecture's
``vocab_size``) is written as the emulator's ``tokenizer.json`` and, with a
``tokenizer_config.json``, as a separate directory for vLLM's client (next to a ``config.json``
transformers swaps in the architecture's own tokenizer class). vLLM's random prompts (ids
decoded, re-encoded) then have exactly the requested length, and the emulator counts the same.

Usage (from the repository root; the whole run ~15 minutes on 2 cores, ``--quick`` ~6)::

    .venv/bin/python benchmarks/client_overhead.py
    .venv/bin/python benchmarks/client_overhead.py --quick
    .venv/bin/python benchmarks/client_overhead.py --servers fixed --duration-s 5 --keep /tmp/co
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ARCHITECTURE = ROOT / "src" / "servematrix" / "data" / "architectures" / "qwen2.5-0.5b"
EMULATOR_GPU = "H100-SXM5-80GB"
MAX_MODEL_LEN = 32768
"""qwen2.5-0.5b's max_position_embeddings: the longest prompt is 32000 so output fits."""

SERVERS = ("emulator", "fixed", "mock")
BASE_LENGTH = 1024
QPS_AT_LENGTHS = 5
"""The emulator counts a text prompt's tokens on its event loop (~3 µs a word): at 32k words
and 10 QPS that alone is a whole core, so the length sweep runs at 5 QPS."""
GRIDS = {
    # server: (QPS swept at BASE_LENGTH, lengths swept at QPS_AT_LENGTHS)
    "emulator": ((2, 10, 50, 100, 200), (8192,)),
    "fixed": ((2, 10, 50, 100, 200, 500), (8192, 32000)),
    # Where each server stops being the bottleneck on 2 shared cores (see the docstring).
    "mock": ((2, 10, 50), (8192, 16384)),
}
QUICK_GRIDS = {
    "emulator": ((10, 100), (8192,)),
    "fixed": ((10, 100, 500), (32000,)),
    "mock": ((10,), ()),
}
OUTPUT_LEN = 16
WARMUPS = 3
MIN_REQUESTS = 20
DISTINCT_PROMPTS = 50
"""Text prompts per length in our client's jsonl file, repeated from the top as needed."""
MOCK_TTFT_MS = 50.0
MOCK_ITL_MS = 10.0
FIXED_TTFT_MS = 50.0
FIXED_ITL_MS = 10.0

SEND_LAG_TARGET_MS = 2.0
SEND_LAG_TARGET_QPS = 100
SUSTAINED_QPS = 500
SUSTAINED_RATE_FRACTION = 0.98
SUSTAINED_LAG_P99_MS = 10.0
"""Sustained = on schedule: >= 98 % of the scheduled send rate and send lag P99 < 10 ms."""
ERROR_TOLERANCE = (0.10, 0.2)
"""Ours counts as no worse than vLLM's when within 10 % or 0.2 ms of it (the larger)."""

PACING_PROBE = """\
import asyncio, json, random, sys, time
async def main(rate, duration_s):
    rng, t, deadlines = random.Random(0), 0.0, []
    while t < duration_s:
        t += rng.expovariate(rate)
        deadlines.append(t)
    origin, lags = time.monotonic(), []
    for deadline in deadlines:
        delay = origin + deadline - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        lags.append((time.monotonic() - origin - deadline) * 1e3)
    print(json.dumps(lags))
asyncio.run(main(float(sys.argv[1]), float(sys.argv[2])))
"""
"""The machine's floor for send lag: a bare asyncio loop sleeping to Poisson deadlines, no I/O."""

VLLM_DRIVER = """\
import json, sys
from vllm.entrypoints.cli.main import main
for line in sys.stdin:
    sys.argv = ["vllm", *json.loads(line)]
    code = 0
    try:
        main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException as error:
        print(f"driver: {error!r}", file=sys.stderr, flush=True)
        code = 1
    print(f"@@DONE {code}", flush=True)
"""
"""Runs ``vllm <argv>`` once per stdin line in one process, so vLLM is imported once."""


# --- records --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    server: str
    input_len: int
    qps: float
    num_prompts: int
    seed: int


@dataclass
class Observed:
    """One measured request as a client saw it; absolute ``time.monotonic()`` seconds."""

    key: str  # the X-Request-Id the server logged it under
    scheduled_s: float
    sent_s: float
    chunk_s: list[float]
    success: bool


@dataclass
class ClientRun:
    """One client's run at one point, reduced to the table's numbers (ms unless named)."""

    client: str
    requests: int = 0
    failed: int = 0
    unmatched: int = 0
    rate_fraction: float | None = None
    send_lag_ms: list[float] = field(default_factory=list)
    ttft_error_ms: list[float] = field(default_factory=list)
    itl_error_ms: list[float] = field(default_factory=list)
    up_ms: list[float] = field(default_factory=list)  # server arrival - client sent
    down_ms: list[float] = field(default_factory=list)  # client read - server write, per chunk
    problem: str | None = None  # the run did not happen or produced nothing usable

    def p(self, values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None


@dataclass
class Reference:
    """What the server itself says: per key (arrival, chunk writes), or fixed latencies."""

    logs: dict[str, tuple[float, list[float]]] | None = None
    ttft_ms: float | None = None
    itl_ms: float | None = None


# --- processes ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http(method: str, url: str, timeout_s: float = 30.0) -> bytes:
    request = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return response.read()


class Server:
    """A server process in its own process group, ready when ``GET ready_path`` answers 200."""

    def __init__(self, name: str, argv: list[str], port: int, model: str, log: Path):
        self.name, self.argv, self.port, self.model, self.log_path = name, argv, port, model, log
        self.root = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_path: str, timeout_s: float = 180.0) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} server exited with {self.proc.returncode} at start-up; "
                    f"see {self.log_path}"
                )
            try:
                http("GET", self.root + ready_path, timeout_s=2.0)
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"{self.name} server not ready within {timeout_s:g} s; see {self.log_path}"
        )

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class VllmClient:
    """One long-lived Python of the vLLM venv that runs ``vllm bench serve`` per point."""

    def __init__(self, python: Path, workdir: Path):
        self.workdir = workdir
        driver = workdir / "vllm_driver.py"
        driver.write_text(VLLM_DRIVER)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("VLLM_USE_RUST_BENCH", None)
        self.log = open(workdir / "vllm_client.log", "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [str(python), str(driver)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=workdir,
            start_new_session=True,
        )

    def run(self, argv: list[str], timeout_s: float) -> int:
        """Run one ``vllm`` command; its stdout goes to the log. Kills the driver on timeout."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        timer = threading.Timer(timeout_s, lambda: os.killpg(self.proc.pid, signal.SIGKILL))
        timer.start()
        try:
            for line in self.proc.stdout:
                if line.startswith("@@DONE"):
                    return int(line.split()[1])
                self.log.write(line)
            raise RuntimeError(
                f"vLLM client process ended (timed out after {timeout_s:g} s?); see {self.log.name}"
            )
        finally:
            timer.cancel()
            self.log.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# --- the fixed-latency server with timestamps ----------------------------------------------------


def serve_fixed(port: int, ttft_ms: float, itl_ms: float) -> None:
    """A minimal OpenAI completions server: chunk k of every stream is due at arrival + TTFT +
    k * ITL (absolute deadlines, so lateness never accumulates), one token per chunk, vLLM
    0.33's stream shape with continuous usage. Like the emulator it logs, per ``X-Request-Id``,
    its own ``time.monotonic()`` at the handler's start and after each chunk's write, at
    ``GET /servematrix/requests``; per request it does almost nothing else (no tokenizer, no
    text generation), so what a client sees beyond these times is the client and the loopback.
    """
    import asyncio

    from aiohttp import web

    logs: dict[str, dict[str, object]] = {}
    ttft_s, itl_s = ttft_ms / 1e3, itl_ms / 1e3

    async def sleep_until(deadline: float) -> None:
        delay = deadline - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    async def completions(request: web.Request) -> web.StreamResponse:
        arrival_s = time.monotonic()
        chunk_s: list[float] = []
        key = request.headers.get("X-Request-Id") or f"anonymous-{len(logs)}"
        logs[key] = {"arrival_s": arrival_s, "chunk_s": chunk_s, "status": 200}
        body = json.loads(await request.read())
        prompt = body.get("prompt")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        tokens = int(body.get("max_tokens") or 16)
        options = body.get("stream_options") or {}
        usage = options.get("include_usage")
        continuous = usage and options.get("continuous_usage_stats")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for k in range(tokens):
            await sleep_until(arrival_s + ttft_s + k * itl_s)
            counts = (
                f'{{"prompt_tokens":{prompt_tokens},"total_tokens":{prompt_tokens + k + 1},'
                f'"completion_tokens":{k + 1}}}'
                if continuous
                else "null"
            )
            finish = '"length"' if k == tokens - 1 else "null"
            await response.write(
                b"data: "
                + (
                    '{"id":"cmpl-fixed","object":"text_completion","created":0,"model":"fixed",'
                    f'"choices":[{{"index":0,"text":" t{k}","logprobs":null,'
                    f'"finish_reason":{finish},"stop_reason":null}}],"usage":{counts}}}'
                ).encode()
                + b"\n\n"
            )
            chunk_s.append(time.monotonic())
        if usage:
            total = (
                f'{{"prompt_tokens":{prompt_tokens},"total_tokens":{prompt_tokens + tokens},'
                f'"completion_tokens":{tokens}}}'
            )
            await response.write(
                b'data: {"id":"cmpl-fixed","object":"text_completion","created":0,'
                + f'"model":"fixed","choices":[],"usage":{total}}}\n\n'.encode()
            )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fixed", "object": "model"}]})

    async def request_log(request: web.Request) -> web.Response:
        return web.json_response(logs)

    async def clear_log(request: web.Request) -> web.Response:
        logs.clear()
        return web.json_response({})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", ok)
    app.router.add_get("/v1/models", ok)
    app.router.add_get("/servematrix/requests", request_log)
    app.router.add_delete("/servematrix/requests", clear_log)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- the throwaway model directory ----------------------------------------------------------------

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def write_tokenizer(directory: Path, vocab_size: int, config: bool) -> None:
    """A word-level tokenizer: ``t<i>`` split on whitespace, decoded with spaces (WordPiece's
    decoder), so decode -> encode of any id list is the identity and a prompt of N words is N
    tokens for vLLM's client, our TokenCounter and the emulator alike."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    added = [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    if config:
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": "<unk>",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "model_max_length": 1 << 20,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def make_model(workdir: Path) -> tuple[Path, Path, int]:
    """The emulator's model directory and vLLM's tokenizer directory; returns their vocab."""
    config = json.loads((ARCHITECTURE / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    model = workdir / "model"
    write_tokenizer(model, vocab_size, config=False)
    (model / "config.json").write_text(json.dumps(config))
    tokenizer = workdir / "tokenizer"
    write_tokenizer(tokenizer, vocab_size, config=True)
    return model, tokenizer, vocab_size


def text_prompts(path: Path, words: int, count: int, vocab_size: int, seed: int) -> None:
    """A jsonl dataset of ``count`` text prompts of ``words`` random ``t<i>`` words each."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as out:
        for _ in range(count):
            ids = rng.integers(len(SPECIAL_TOKENS), vocab_size, words)
            out.write(json.dumps({"prompt": " ".join(f"t{i}" for i in ids)}) + "\n")


# --- running the clients -------------------------------------------------------------------------


def run_ours(
    point: Point, server: Server, workdir: Path, dataset: Path, timeout_s: float
) -> tuple[list[Observed], str | None]:
    trace_path = workdir / f"ours-{point.server}-{point.input_len}-{point.qps:g}.parquet"
    argv = [
        str(BIN / "servematrix"),
        "bench",
        "--base-url",
        server.root,
        "--model",
        server.model,
        "--qps",
        f"{point.qps:g}",
        "--input-len",
        str(point.input_len),
        "--output-len",
        str(OUTPUT_LEN),
        "--num-prompts",
        str(point.num_prompts),
        "--seed",
        str(point.seed),
        "--warmup-requests",
        str(WARMUPS),
        "--dataset",
        "jsonl",
        "--dataset-path",
        str(dataset),
        "-o",
        str(trace_path),
    ]
    log = workdir / (trace_path.stem + ".log")
    try:
        with open(log, "wb") as out:
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [], f"timed out after {timeout_s:g} s ({log})"
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:]
        return [], f"exit {done.returncode}: {' '.join(tail)}"
    from servematrix.spec.trace import read, read_metadata

    metadata = read_metadata(trace_path)
    origin = float(metadata["clock"]["origin_monotonic_s"])
    prefix = metadata["client"]["request_id_prefix"]
    rows = read(trace_path).select(
        ["request_id", "warmup", "scheduled_s", "sent_s", "chunk_s", "success"]
    )
    observed = [
        Observed(
            key=f"{prefix}-{row['request_id']}",
            scheduled_s=origin + row["scheduled_s"],
            sent_s=origin + row["sent_s"],
            chunk_s=[origin + t for t in row["chunk_s"]],
            success=row["success"],
        )
        for row in rows.to_pylist()
        if not row["warmup"]
    ]
    return observed, None


def vllm_schedule(num_prompts: int, qps: float, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """The send offsets ``vllm bench serve`` (0.33, ``get_request``) draws for these settings."""
    rng = np.random.RandomState(seed)  # = np.random.seed(seed) then the global legacy draws
    theta = 1.0 / (qps * burstiness)
    delays = np.cumsum([rng.gamma(shape=burstiness, scale=theta) for _ in range(num_prompts)])
    return delays * (num_prompts / qps / delays[-1])


def run_vllm(
    point: Point,
    server: Server,
    client: VllmClient,
    tokenizer: Path,
    workdir: Path,
    timeout_s: float,
) -> tuple[list[Observed], str | None]:
    prefix = f"vllm{point.seed}x{time.monotonic_ns() % 10**9}-"
    result = f"vllm-{point.server}-{point.input_len}-{point.qps:g}.json"
    argv = [
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        server.root,
        "--model",
        server.model,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(point.input_len),
        "--random-output-len",
        str(OUTPUT_LEN),
        "--num-prompts",
        str(point.num_prompts),
        "--request-rate",
        f"{point.qps:g}",
        "--seed",
        str(point.seed),
        "--num-warmups",
        str(WARMUPS),
        "--ignore-eos",
        "--temperature",
        "0",
        "--request-id-prefix",
        prefix,
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(workdir),
        "--result-filename",
        result,
        "--disable-tqdm",
    ]
    try:
        code = client.run(argv, timeout_s)
    except RuntimeError as error:
        return [], str(error)
    if code != 0:
        return [], f"vllm bench serve exited {code} (see {client.log.name})"
    data = json.loads((workdir / result).read_text())
    offsets = vllm_schedule(point.num_prompts, point.qps, point.seed)
    starts = np.asarray(data["start_times"], dtype=float)
    origin = float(np.min(starts - offsets))  # vLLM does not save its schedule's origin
    observed = []
    for i, (start, ttft, itls, error) in enumerate(
        zip(data["start_times"], data["ttfts"], data["itls"], data["errors"], strict=True)
    ):
        success = not error and ttft is not None and ttft > 0
        chunks = list(start + ttft + np.cumsum([0.0, *itls])) if success else []
        observed.append(Observed(f"{prefix}{i}", origin + offsets[i], start, chunks, success))
    return observed, None


# --- reducing ------------------------------------------------------------------------------------


def logged_reference(server: Server) -> Reference:
    logs = json.loads(http("GET", server.root + "/servematrix/requests", timeout_s=120.0))
    return Reference(
        logs={
            key: (entry["arrival_s"], entry["chunk_s"])
            for key, entry in logs.items()
            if entry.get("status") == 200 and entry.get("chunk_s")
        }
    )


def reduce(client: str, observed: list[Observed], reference: Reference) -> ClientRun:
    run = ClientRun(client, requests=len(observed))
    ok = [o for o in observed if o.success and o.chunk_s]
    run.failed = len(observed) - len(ok)
    run.send_lag_ms = [(o.sent_s - o.scheduled_s) * 1e3 for o in observed]
    by_schedule = sorted(observed, key=lambda o: o.scheduled_s)
    if len(by_schedule) > 1:
        scheduled = by_schedule[-1].scheduled_s - by_schedule[0].scheduled_s
        sent = max(o.sent_s for o in observed) - min(o.sent_s for o in observed)
        run.rate_fraction = scheduled / sent if sent > 0 else None
    for o in ok:
        gaps = np.diff(o.chunk_s)
        if reference.logs is not None:
            logged = reference.logs.get(o.key)
            if logged is None:
                run.unmatched += 1
                continue
            arrival_s, server_chunks = logged
            ttft_ms = (server_chunks[0] - arrival_s) * 1e3
            run.up_ms.append((arrival_s - o.sent_s) * 1e3)
            if len(server_chunks) != len(o.chunk_s):
                run.unmatched += 1
                server_gaps = None
            else:
                server_gaps = np.diff(server_chunks)
                run.down_ms.extend((np.asarray(o.chunk_s) - server_chunks) * 1e3)
        else:
            assert reference.ttft_ms is not None and reference.itl_ms is not None
            ttft_ms = reference.ttft_ms
            server_gaps = np.full(len(gaps), reference.itl_ms / 1e3)
            if len(o.chunk_s) == OUTPUT_LEN + 1:  # the closing empty-text chunk: sent at once
                server_gaps[-1] = 0.0
        run.ttft_error_ms.append((o.chunk_s[0] - o.sent_s) * 1e3 - ttft_ms)
        if server_gaps is not None:
            run.itl_error_ms.extend(np.abs(gaps - server_gaps) * 1e3)
    return run


# --- the table ------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


HEADER = (
    f"{'server':<8} {'input':>6} {'qps':>5} {'client':<11} {'n':>5} {'fail':>4} {'unm':>4} "
    f"{'rate%':>6} | {'lag p50':>7} {'p99':>7} {'max':>7} | {'TTFTerr p50':>11} {'p99':>7} | "
    f"{'ITLerr p50':>10} {'p99':>7} | {'up p99':>7} {'down p99':>8}"
)


def row(point: Point, run: ClientRun) -> str:
    head = f"{point.server:<8} {point.input_len:>6} {point.qps:>5g} {run.client:<11}"
    if run.problem:
        return f"{head} {run.problem}"
    rate = "-" if run.rate_fraction is None else f"{100 * run.rate_fraction:.1f}"
    lag = run.send_lag_ms
    return (
        f"{head} {run.requests:>5} {run.failed:>4} {run.unmatched:>4} {rate:>6} | "
        f"{_ms(run.p(lag, 50)):>7} {_ms(run.p(lag, 99)):>7} {_ms(max(lag) if lag else None):>7} | "
        f"{_ms(run.p(run.ttft_error_ms, 50)):>11} {_ms(run.p(run.ttft_error_ms, 99)):>7} | "
        f"{_ms(run.p(run.itl_error_ms, 50)):>10} {_ms(run.p(run.itl_error_ms, 99)):>7} | "
        f"{_ms(run.p(run.up_ms, 99)):>7} {_ms(run.p(run.down_ms, 99)):>8}"
    )


def no_worse(ours: float | None, theirs: float | None) -> bool | None:
    if ours is None or theirs is None:
        return None
    relative, absolute = ERROR_TOLERANCE
    return ours <= theirs + max(relative * abs(theirs), absolute)


def verdicts(results: list[tuple[Point, ClientRun, ClientRun | None]]) -> list[str]:
    lines = ["Targets:"]

    def mark(ok: bool | None) -> str:
        return {True: "met", False: "MISSED", None: "not measured"}[ok]

    for point, ours, _ in results:
        if point.qps == SEND_LAG_TARGET_QPS and point.input_len == BASE_LENGTH:
            p99 = ours.p(ours.send_lag_ms, 99)
            ok = None if p99 is None else p99 < SEND_LAG_TARGET_MS
            lines.append(
                f"  send lag P99 < {SEND_LAG_TARGET_MS:g} ms at {SEND_LAG_TARGET_QPS} QPS "
                f"({point.server}): {_ms(p99)} ms -> {mark(ok)}"
            )
    for point, ours, _ in results:
        if point.qps == SUSTAINED_QPS:
            fraction = ours.rate_fraction
            lag_p99 = ours.p(ours.send_lag_ms, 99)
            ok = None
            if fraction is not None and lag_p99 is not None and not ours.problem:
                ok = (
                    fraction >= SUSTAINED_RATE_FRACTION
                    and lag_p99 < SUSTAINED_LAG_P99_MS
                    and ours.failed == 0
                )
            shown = "-" if fraction is None else f"{100 * fraction:.1f} %"
            lines.append(
                f"  {SUSTAINED_QPS} QPS sustained ({point.server}, input {point.input_len}): "
                f"send rate {shown} of scheduled, send lag P99 {_ms(lag_p99)} ms, "
                f"{ours.failed} failed -> {mark(ok)}"
            )
    for q in (50, 99):
        misses, compared = [], 0
        for point, ours, theirs in results:
            if theirs is None or theirs.problem or ours.problem:
                continue
            for name, mine, other in (
                ("TTFT", ours.ttft_error_ms, theirs.ttft_error_ms),
                ("ITL", ours.itl_error_ms, theirs.itl_error_ms),
            ):
                ok = no_worse(ours.p(mine, q), theirs.p(other, q))
                if ok is None:
                    continue
                compared += 1
                if not ok:
                    misses.append(
                        f"{point.server} {point.input_len}/{point.qps:g} {name} "
                        f"{_ms(ours.p(mine, q))} vs {_ms(theirs.p(other, q))}"
                    )
        verdict = mark(None if not compared else not misses)
        lines.append(
            f"  P{q} TTFT/ITL error no worse than vLLM's client: "
            f"{compared - len(misses)}/{compared} points x metrics -> {verdict}"
        )
        lines += [f"    worse: {miss}" for miss in misses]
    return lines


# --- main -----------------------------------------------------------------------------------------


def points_for(server: str, quick: bool, duration_s: float) -> list[Point]:
    qps_sweep, lengths = (QUICK_GRIDS if quick else GRIDS)[server]
    grid = [(BASE_LENGTH, float(q)) for q in qps_sweep]
    grid += [(length, float(QPS_AT_LENGTHS)) for length in lengths]
    return [
        Point(server, length, qps, max(MIN_REQUESTS, round(qps * duration_s)), seed)
        for seed, (length, qps) in enumerate(grid)
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer points, 5 s of load each")
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma list of servers")
    parser.add_argument("--duration-s", type=float, help="seconds of load per point (default 10)")
    parser.add_argument("--vllm-python", type=Path, default=Path("/tmp/vllm-venv/bin/python"))
    parser.add_argument("--guidellm", type=Path, default=Path("/tmp/guidellm-venv/bin/guidellm"))
    parser.add_argument("--no-vllm", action="store_true", help="our client only")
    parser.add_argument("--keep", type=Path, help="keep traces, results and logs in this folder")
    args = parser.parse_args(argv)
    if args.duration_s is None:
        args.duration_s = 5.0 if args.quick else 10.0
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = set(args.servers) - set(SERVERS)
    if unknown:
        parser.error(
            f"--servers: unknown {', '.join(sorted(unknown))} (known: {', '.join(SERVERS)})"
        )
    return args


def start_server(name: str, workdir: Path, model_dir: Path, guidellm: Path) -> Server:
    port = free_port()
    if name == "emulator":
        argv = [
            str(BIN / "servematrix-emulator"),
            "serve",
            str(model_dir),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--gpu",
            EMULATOR_GPU,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--no-enable-prefix-caching",
        ]
        server = Server(name, argv, port, str(model_dir), workdir / "emulator.log")
        server.start("/health")
    elif name == "fixed":
        argv = [sys.executable, __file__, "--serve-fixed", str(port)]
        server = Server(name, argv, port, "fixed", workdir / "fixed.log")
        server.start("/health")
    else:
        argv = [
            str(guidellm),
            "mock-server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model",
            "mock",
            "--ttft-ms",
            f"{MOCK_TTFT_MS:g}",
            "--itl-ms",
            f"{MOCK_ITL_MS:g}",
            "--output-tokens",
            "1000000",  # max_tokens decides, as with ignore_eos
        ]
        server = Server(name, argv, port, "mock", workdir / "mock.log")
        server.start("/v1/models")
    return server


def header_lines(args: argparse.Namespace, vllm_version: str | None) -> list[str]:
    load = os.getloadavg()
    usable = len(os.sched_getaffinity(0))
    return [
        f"client overhead: {platform.platform()}, Python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs ({usable} usable), load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        f"  servers: {', '.join(args.servers)}; emulator: qwen2.5-0.5b on {EMULATOR_GPU}; "
        f"fixed: TTFT {FIXED_TTFT_MS:g} ms, ITL {FIXED_ITL_MS:g} ms; mock: guidellm mock-server "
        f"TTFT {MOCK_TTFT_MS:g} ms, ITL {MOCK_ITL_MS:g} ms",
        f"  output {OUTPUT_LEN} tokens, {WARMUPS} warm-ups, ~{args.duration_s:g} s of Poisson "
        f"arrivals per point (at least {MIN_REQUESTS} requests); vLLM client: "
        f"{vllm_version or 'not run'}",
        "  lag = sent - scheduled; TTFTerr = client TTFT - server TTFT; ITLerr = |client gap - "
        "server gap|; all ms; rate% = achieved / scheduled send rate; unm = requests whose "
        "chunks could not be matched to the server's",
    ]


def pacing_floor(rate: float, duration_s: float) -> str:
    """Send lag of a process that does nothing but wake on time: what the machine allows."""
    done = subprocess.run(
        [sys.executable, "-c", PACING_PROBE, str(rate), str(duration_s)],
        capture_output=True,
        text=True,
        check=True,
    )
    lags = json.loads(done.stdout)
    p50, p99 = np.percentile(lags, [50, 99])
    return (
        f"  machine floor: a bare asyncio loop waking at {rate:g}/s (Poisson) for "
        f"{duration_s:g} s is late by P50 {p50:.2f} / P99 {p99:.2f} / max {max(lags):.2f} ms"
    )


def vllm_version(python: Path) -> str | None:
    try:
        done = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return f"vllm {done.stdout.strip()}" if done.returncode == 0 else None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    version = None if args.no_vllm else vllm_version(args.vllm_python)
    if not args.no_vllm and version is None:
        print(f"vLLM client unavailable at {args.vllm_python}: running ours only", file=sys.stderr)
    if "mock" in args.servers and not args.guidellm.exists():
        print(f"no guidellm at {args.guidellm}: skipping the mock server", file=sys.stderr)
        args.servers.remove("mock")
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="client-overhead-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir, tokenizer_dir, vocab_size = make_model(workdir)
    print("\n".join(header_lines(args, version)), flush=True)
    print(pacing_floor(SEND_LAG_TARGET_QPS, args.duration_s), flush=True)
    vllm = VllmClient(args.vllm_python, workdir) if version else None
    results: list[tuple[Point, ClientRun, ClientRun | None]] = []
    try:
        for name in args.servers:
            server = start_server(name, workdir, model_dir, args.guidellm)
            try:
                print(f"\n{HEADER}", flush=True)
                for point in points_for(name, args.quick, args.duration_s):
                    results.append(
                        measure(point, server, vllm, tokenizer_dir, workdir, vocab_size, args)
                    )
            finally:
                server.stop()
    finally:
        if vllm is not None:
            vllm.close()
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(pacing_floor(SEND_LAG_TARGET_QPS, args.duration_s))
    print("\n".join(verdicts(results)))
    return 0


def measure(
    point: Point,
    server: Server,
    vllm: VllmClient | None,
    tokenizer_dir: Path,
    workdir: Path,
    vocab_size: int,
    args: argparse.Namespace,
) -> tuple[Point, ClientRun, ClientRun | None]:
    """Run both clients at one point, print their two rows, return them."""
    # Generous: the run itself, the drain of a saturated server, and process start-up.
    timeout_s = 3 * point.num_prompts / point.qps + 120
    reference = Reference(ttft_ms=MOCK_TTFT_MS, itl_ms=MOCK_ITL_MS)  # the mock's; else logged
    dataset = workdir / f"prompts-{point.input_len}.jsonl"
    if not dataset.exists():
        text_prompts(dataset, point.input_len, DISTINCT_PROMPTS, vocab_size, seed=point.input_len)
    runs: list[ClientRun | None] = []
    for client in ("servematrix", "vllm"):
        if client == "vllm" and vllm is None:
            runs.append(None)
            continue
        if point.server != "mock":
            http("DELETE", server.root + "/servematrix/requests")
        if client == "servematrix":
            observed, problem = run_ours(point, server, workdir, dataset, timeout_s)
        else:
            assert vllm is not None
            observed, problem = run_vllm(point, server, vllm, tokenizer_dir, workdir, timeout_s)
        if problem is None and point.server != "mock":
            reference = logged_reference(server)
        run = reduce(client, observed, reference) if problem is None else ClientRun(client)
        run.problem = problem
        print(row(point, run), flush=True)
        runs.append(run)
    ours, theirs = runs
    assert ours is not None
    return point, ours, theirs


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-fixed"]:
        serve_fixed(int(sys.argv[2]), FIXED_TTFT_MS, FIXED_ITL_MS)
    else:
        sys.exit(main())
