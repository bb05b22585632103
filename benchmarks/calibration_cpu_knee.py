"""Real vLLM CPU, mode ``single``: what fills the API server's core as the rate nears the knee.

``calibration_cpu.py`` serves mode ``single`` with the engine (engine core, worker) on core 0
and the API server on core 1, beside this client: two cores leave the client no core of its
own. This script serves the same deployment and sends steady Poisson streams (128 tokens in, 32
out, about 15 s each) at rising rates. Per stream it prints the engine's steps (``/metrics``),
wall time per step, mean TTFT and TPOT, and the CPU share of the wall time each takes: the API
server's processes, this client (the load generator runs in this process), and each core busy
over all (``/proc/stat``, every process of the machine).

If the knee a measured search finds there is where core 1 fills, it is the API server's and the
client's together, which no prediction of the server alone can place.

Usage (from the repository root, in a private network namespace; about 2 minutes)::

    unshare -n bash -c 'ip link set lo up; .venv/bin/python benchmarks/calibration_cpu_knee.py'
    ... calibration_cpu_knee.py 50 150 250       # other rates, req/s
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from calibration_cpu import CLIENT_CORE, FIT_MODEL, VLLM_CORE, scratch, served
from calibration_cpu_processes import core_busy_s, stream, vllm_pids

RATES = (50.0, 100.0, 150.0, 190.0, 220.0, 240.0)


def main() -> None:
    rates = [float(r) for r in sys.argv[1:]] or RATES
    work = scratch("calibration-cpu-knee-", (FIT_MODEL,))
    print(f"load average {os.getloadavg()}", flush=True)
    print(
        "rate  steps  ms/step  TTFT ms  TPOT ms  API server  client  "
        f"core {CLIENT_CORE} busy  core {VLLM_CORE} busy"
    )
    with served(FIT_MODEL, "single", work) as plan:
        pids = {p: Path(f"/proc/{p}/comm").read_text().strip() for p in vllm_pids(plan.base_url)}
        api = [p for p, name in pids.items() if not name.startswith("VLLM::")]
        for rate in rates:
            cores = [core_busy_s(CLIENT_CORE), core_busy_s(VLLM_CORE)]
            client = sum(os.times()[:2])
            _, _, _, _, wall, used, _, steps, result, _ = stream(plan.base_url, pids, rate, 128, 32)
            client = sum(os.times()[:2]) - client
            busy = [core_busy_s(CLIENT_CORE) - cores[0], core_busy_s(VLLM_CORE) - cores[1]]
            print(
                f"{rate:4.0f} {steps:6.0f} {wall / steps * 1e3:8.2f} {result.mean_ttft_ms:8.1f} "
                f"{result.mean_tpot_ms:8.2f} {sum(used[p] for p in api) / wall:11.2f} "
                f"{client / wall:7.2f} {busy[0] / wall:12.2f} {busy[1] / wall:12.2f}",
                flush=True,
            )
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
