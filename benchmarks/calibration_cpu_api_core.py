"""Real vLLM CPU: does the API server on the engine's core cost the engine more than its CPU?

Serves the tier's tiny Qwen2 (engine core and worker pinned to core 0, this client to core 1)
and sends steady Poisson streams (128 tokens in, 32 out) at 30 and 60 req/s, twice in each of
two arrangements, alternating: ``shared`` (the API server on core 0 too, as
``calibration_cpu.py`` serves a two-instance mode's instances) and ``api-on-core1`` (the API
server on the client's core, the engine core and worker alone on core 0, as
``calibration_cpu.py`` serves mode ``single``). Per stream it prints the
engine's steps (``/metrics``), wall time per step, mean TTFT and TPOT, the API server's CPU as a
share of the wall time (its ``process_cpu_seconds_total``) and the engine processes' shares.

If the API server only took its CPU from the engine, moving it would shorten a step by about
its share of the core; a larger change means sharing the core costs the engine more than that.

Usage (from the repository root, in a private network namespace; about 4 minutes)::

    unshare -n bash -c 'ip link set lo up; .venv/bin/python benchmarks/calibration_cpu_api_core.py'
"""

from __future__ import annotations

import os
from pathlib import Path

from calibration_cpu import CLIENT_CORE, FIT_MODEL, VLLM_CORE, scratch, served
from calibration_cpu_processes import stream, vllm_pids

from servematrix.deploy.cpupins import pin_threads

RATES = (30.0, 60.0)
ARRANGEMENTS = ("shared", "api-on-core1", "shared", "api-on-core1")


def main() -> None:
    work = scratch("calibration-cpu-api-core-", (FIT_MODEL,))
    print(f"load average {os.getloadavg()}", flush=True)
    print("arrangement    rate  steps  ms/step  TTFT ms  TPOT ms  API CPU  EngineCore  Worker")
    with served(FIT_MODEL, "single", work) as plan:
        pids = {p: Path(f"/proc/{p}/comm").read_text().strip() for p in vllm_pids(plan.base_url)}
        api = [p for p, name in pids.items() if not name.startswith("VLLM::")]
        engine = {name: p for p, name in pids.items() if name.startswith("VLLM::")}
        for arrangement in ARRANGEMENTS:
            for pid in api:
                pin_threads(pid, (CLIENT_CORE if arrangement == "api-on-core1" else VLLM_CORE,))
            for rate in RATES:
                _, _, _, _, wall, used, api_s, steps, result, _ = stream(
                    plan.base_url, pids, rate, 128, 32
                )
                shares = [used[engine[name]] / wall for name in ("VLLM::EngineCor", "VLLM::Worker")]
                print(
                    f"{arrangement:<13} {rate:5.0f} {steps:6.0f} {wall / steps * 1e3:8.2f} "
                    f"{result.mean_ttft_ms:8.1f} {result.mean_tpot_ms:8.1f} {api_s / wall:8.2f} "
                    f"{shares[0]:11.2f} {shares[1]:7.2f}",
                    flush=True,
                )
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
