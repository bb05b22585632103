"""Does the capacity hold? One deployment's capacity however it is asked, and long runs at it.

The deployment of issue 40: Qwen2.5-7B-Instruct, TP 1, two instances behind the round-robin
proxy (mode ``chunked``), vLLM V1, H100, 2,000 input / 200 output tokens, SLO P99 TTFT 1 s,
P99 TPOT 50 ms, attainment 0.9, on the simulator. Prints, in a scratch directory (nothing
cached):

1. the capacity per GPU and output tokens/s per GPU the search reports when the study's cells
   send 50, 200 and 2,000 requests (the later searches reuse the first one's probes: a
   probe does not depend on the study's ``num_prompts``), and with probes twice as long
   (``min_duration_s`` and ``tail_requests`` doubled);
2. long runs (``--long-s`` of arrivals, 1,200 s by default) at 0.9× and 1.2× the capacity:
   requests, whether the run was steady, and whether it met the SLO (and what broke).

Usage (from the repository root)::

    .venv/bin/python benchmarks/capacity_holds.py
    .venv/bin/python benchmarks/capacity_holds.py --long-s 2400
    .venv/bin/python benchmarks/capacity_holds.py --check-rps 52   # an older answer's rate
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time

from servematrix.capacity import run as capacity_run
from servematrix.results import steady
from servematrix.workflow import check_config

CONFIG = {
    "backend": "simulator",
    "defaults": {"output_len": 200, "seed": 0},
    "engine": {"gpu": "H100-SXM5-80GB"},
    "slo": {
        "ttft": {"statistic": "p99", "max_ms": 1000},
        "tpot": {"statistic": "p99", "max_ms": 50},
        "attainment": 0.9,
    },
    "models": {
        "Qwen2.5-7B-Instruct": {
            "hf_id": "Qwen/Qwen2.5-7B-Instruct",
            "architecture": "qwen2.5-7b",
            "tensor_parallel": 1,
            "gpus": [[0], [1]],
        }
    },
    "studies": {
        "holds": {
            "recipe": "v1",
            "models": ["Qwen2.5-7B-Instruct"],
            "modes": ["chunked"],
            "qps": [2, 8],
            "input_len": [2000],
        }
    },
}


def search(num_prompts: int, longer: bool = False) -> dict:
    """The deployment's capacity document when its study's cells send ``num_prompts``; with
    ``longer``, probes twice as long (``min_duration_s`` and ``tail_requests`` doubled)."""
    raw = copy.deepcopy(CONFIG)
    raw["defaults"]["num_prompts"] = num_prompts
    if longer:
        raw["capacity"] = {"min_duration_s": 1200, "tail_requests": 128}
    cfg = check_config(raw)
    (cells,) = capacity_run.deployments(cfg.studies["holds"].cells).values()
    return capacity_run.search_deployment(cells, cfg.slo, dict(cfg.raw["capacity"])), cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long-s", type=float, default=1200.0)
    parser.add_argument(
        "--check-rps", type=float, nargs="*", default=[], help="also long runs at these rates"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="servematrix-holds-") as scratch:
        os.chdir(scratch)
        print(f"{'cells send':<26} {'capacity/GPU':>12} {'out tok/s/GPU':>13} "
              f"{'probes':>6} {'requests':>8} {'wall s':>7}")  # fmt: skip
        for label, n, longer in (
            ("50 requests", 50, False),
            ("200 requests", 200, False),
            ("2,000 requests", 2000, False),
            ("200, probes twice as long", 200, True),
        ):
            started = time.perf_counter()
            doc, cfg = search(n, longer)
            print(f"{label:<26} {doc['capacity_per_gpu']:>12.2f} "
                  f"{doc['output_tokens_per_s_per_gpu']:>13,.0f} {doc['probes']:>6} "
                  f"{doc['probe_requests']:>8} {time.perf_counter() - started:>7.1f}")  # fmt: skip
        doc, cfg = search(200)
        (cells,) = capacity_run.deployments(cfg.studies["holds"].cells).values()
        print(f"\nlong runs of {args.long_s:g} s at the capacity of {doc['capacity']:g} req/s")
        print(f"{'rate':<12} {'req/s':>7} {'requests':>8} {'SLO':<40}")
        rates = [(f"{f:.1f} x", doc["capacity"] * f) for f in (0.9, 1.2)]
        rates += [("given", rate) for rate in args.check_rps]
        long = {"min_duration_s": args.long_s, "tail_requests": steady.TAIL_REQUESTS}
        for label, rate in rates:
            probe = capacity_run.probe_at(cells[0], rate, cfg.slo, long)
            met = "met" if probe.met else "broken: " + ", ".join(probe.broken)
            print(f"{label:<12} {rate:>7.2f} {probe.requests:>8} {met:<40}")  # fmt: skip


if __name__ == "__main__":
    main()
