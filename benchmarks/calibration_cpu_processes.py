"""Where real vLLM CPU spends its core under a steady stream: CPU seconds per process.

Serves the tier's tiny Qwen2 with everything of vLLM (API server, engine core and worker)
pinned to core 0 and this client to core 1, as ``calibration_cpu.py`` serves a two-instance
mode's instance, sends steady Poisson streams at a few rates
and shapes through the workflow's cell code, and reads each vLLM process's utime + stime
(``/proc/<pid>/stat``) around every stream, and the API server's own
``process_cpu_seconds_total`` from ``/metrics`` (what ``servematrix calibrate`` reads). It
prints, per stream, each process's CPU share of the core and CPU milliseconds per request,
then the API server's CPU fitted as ``a × requests + b × output tokens + c × engine steps``
over the streams (``vllm:iteration_tokens_total`` counts the steps), to compare with what
``servematrix calibrate`` fits over its probes.

Usage (from the repository root, in a private network namespace; about 3 minutes)::

    unshare -n bash -c 'ip link set lo up; .venv/bin/python benchmarks/calibration_cpu_processes.py'
"""

from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path

import numpy as np
from calibration_cpu import (
    FIT_MODEL,
    VLLM_CORE,
    HeldOut,
    measured,
    raw_config,
    run_all,
    scratch,
    served,
)

from servematrix.calibration.probes import API_CPU_SERIES, parse_metrics
from servematrix.deploy.cpupins import pin_threads, session_processes

STREAMS = (  # (rate req/s, input tokens, output tokens); rate 0: idle for STREAM_S
    (0.0, 128, 32),
    (5.0, 128, 32),
    (20.0, 128, 32),
    (40.0, 128, 32),
    (20.0, 64, 64),
    (30.0, 512, 16),
    (40.0, 128, 8),
)
STREAM_S = 15.0
TICKS_S = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_S


def core_busy_s(core: int) -> float:
    """CPU seconds core ``core`` spent on any process (``/proc/stat``: all but idle and
    iowait), to tell this deployment's share of its core from the rest of the machine's."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{core} "):
            ticks = [int(v) for v in line.split()[1:]]
            return (sum(ticks[:8]) - ticks[3] - ticks[4]) / TICKS_S
    raise SystemExit(f"no cpu{core} in /proc/stat")


def server_counters(url: str) -> tuple[float, float, float]:
    """The API server's CPU seconds, the engine's steps and the tokens they computed, from
    ``/metrics`` (``vllm:iteration_tokens_total``: one sample per engine step)."""
    root = url.removesuffix("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/metrics", timeout=10) as response:
        text = response.read().decode()
    steps = tokens = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:iteration_tokens_total_count"):
            steps += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:iteration_tokens_total_sum"):
            tokens += float(line.rsplit(" ", 1)[1])
    return parse_metrics(text)[API_CPU_SERIES], steps, tokens


def main() -> None:
    work = scratch("calibration-cpu-processes-", (FIT_MODEL,))
    print(f"load average {os.getloadavg()}", flush=True)
    rows = []
    with served(FIT_MODEL, "single", work) as plan:
        pids = {p: Path(f"/proc/{p}/comm").read_text().strip() for p in vllm_pids(plan.base_url)}
        for pid in pids:  # the API server back onto the engine's core
            pin_threads(pid, (VLLM_CORE,))
        for rate, input_len, output_len in STREAMS:
            rows.append(stream(plan.base_url, pids, rate, input_len, output_len))
    print(f"load average {os.getloadavg()}\n")
    names = [p for p in sorted(pids, key=lambda p: pids[p]) if any(r[5][p] for r in rows)]
    print(
        "rate  in  out    n  wall_s  steps  ms/step "
        + " ".join(f"{pids[p][:16]:>16}" for p in names)
        + "  API(/metrics)  others  TTFT/TPOT ms"
    )
    for rate, i, o, n, wall, used, api, steps, result, others in rows:
        cols = " ".join(
            f"{used[p] / wall:6.2f}" + (f"/{used[p] / n * 1e3:5.1f}" if n else " " * 6)
            for p in names
        )
        latency = f"{result.mean_ttft_ms:6.1f}/{result.mean_tpot_ms:5.1f}" if result else ""
        print(
            f"{rate:4.0f} {i:4d} {o:4d} {n:4d} {wall:6.1f} {steps:6.0f} {wall / steps * 1e3:8.2f} "
            f"{cols}  {api / wall:5.2f}/{api / max(n, 1) * 1e3:5.2f}  {others / wall:6.2f}  "
            f"{latency}"
        )
    print(
        "(per process: CPU share of the core / CPU ms per request; others: the share of the "
        f"core {VLLM_CORE} other processes of the machine took)"
    )
    x = np.array([[n, n * o, steps] for _, _, o, n, _, _, _, steps, *_ in rows], dtype=float)
    y = np.array([row[6] for row in rows])
    (per_request, per_token, per_step), *_ = np.linalg.lstsq(x, y, rcond=None)
    print(
        f"\nAPI server CPU (/metrics) over the streams = {per_request * 1e3:.3f} ms per request "
        f"+ {per_token * 1e3:.4f} ms per output token + {per_step * 1e3:.3f} ms per engine step"
    )


def stream(url: str, pids: dict[int, str], rate: float, input_len: int, output_len: int) -> tuple:
    """A steady Poisson stream at ``rate`` (0: idle) for about ``STREAM_S``: its row."""
    held = HeldOut(FIT_MODEL, "single", 1.0, input_len=input_len, output_len=output_len)
    raw = raw_config("external", FIT_MODEL, "single", [held], rate)
    n = round(rate * STREAM_S)
    raw["studies"]["c0"]["workload"]["num_prompts"] = n
    before = {p: cpu_s(p) for p in pids}
    busy = core_busy_s(VLLM_CORE)
    counters, start = server_counters(url), time.monotonic()
    result = None
    if rate:
        (result,) = run_all(measured(raw, url))
    else:
        time.sleep(STREAM_S)
    wall = time.monotonic() - start
    api, steps, _ = (b - a for a, b in zip(counters, server_counters(url), strict=True))
    used = {p: cpu_s(p) - before[p] for p in pids}
    others = core_busy_s(VLLM_CORE) - busy - sum(used.values())
    return rate, input_len, output_len, n, wall, used, api, max(steps, 1), result, others


def vllm_pids(base_url: str) -> list[int]:
    """The processes of the API server listening on ``base_url``'s port (its session)."""
    port = base_url.rsplit(":", 1)[1].split("/")[0]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"--port" in argv and argv[argv.index(b"--port") + 1] == port.encode():
                return list(session_processes(int(proc.name)))
    raise SystemExit(f"no vLLM server on port {port}")


if __name__ == "__main__":
    main()
