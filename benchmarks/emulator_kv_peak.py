"""What the emulator backend's cell records about the KV cache, against the simulator's.

For Qwen2.5-7B-Instruct-GPTQ-Int4 (TP 1, modelled A100, mode ``single``) on both recipes, each
case below runs the cell twice, as the workflow does: on backend ``emulator``
(``servematrix.backends.cell.run_cell``: a fresh deployment, the load generator, the trace) and on
backend ``simulator``. It prints, per cell:

* the exact peak of KV blocks in use, from the emulator's ``/servematrix/kv_cache`` (the
  trace metadata's ``memory.peak_kv_blocks``) and from the simulator's engine;
* the highest ``/metrics`` sample of the emulator's KV usage (every 0.5 s, as on vllm), in
  blocks, and how many samples there were: what a sampler sees of the same peak;
* the trace's preemptions in total on each backend, and the requests whose count differs.

Cases: the mooncake study's shape (input 1024, output 6) at QPS 2 and 8, where a request lives
for a fraction of a sampling interval; longer outputs (1024/64) at QPS 4 and 16; and a pool of
814 blocks (``gpu_memory_utilization`` 0.13736 on v0, 0.14368 on v1, ``max_num_batched_tokens``
32768) overfilled by 1536/128 requests, where the engine preempts.

Usage (from the repository root)::

    .venv/bin/python benchmarks/emulator_kv_peak.py        # about 4 minutes
    .venv/bin/python benchmarks/emulator_kv_peak.py --quick   # the small pool only, v1
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
from emulator_harness import cell_for, table

from servematrix.backends.cell import run_cell
from servematrix.spec import trace
from servematrix.spec.matrix import Serving

MODEL = "Qwen2.5-7B-Instruct-GPTQ-Int4"
DEFAULT = Serving(10_000, 0.8)
SMALL = {"v0": Serving(4096, 0.13736, 32768), "v1": Serving(4096, 0.14368, 32768)}
"""814 blocks on either recipe (v1 counts the CUDA graphs, v0 does not: 0.5 GiB apart)."""
CASES = [  # (serving, input, output, prompts, QPS); None: the recipe's small pool
    (DEFAULT, 1024, 6, 100, 2.0),
    (DEFAULT, 1024, 6, 100, 8.0),
    (DEFAULT, 1024, 64, 100, 4.0),
    (DEFAULT, 1024, 64, 100, 16.0),
    (None, 1536, 128, 32, 8.0),
]


def run(cell, path: Path) -> tuple[dict, dict[int, int | None]]:
    """The cell's trace metadata's ``memory`` and each request's preemptions."""
    run_cell(cell, path)
    memory_use = json.loads(pq.read_schema(path).metadata[trace.METADATA_KEY])["memory"]
    rows = trace.read(path).to_pylist()
    return memory_use, {r["request_id"]: r["preemptions"] for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the preempting case on v1 only")
    args = parser.parse_args()
    recipes, cases = (("v1",), CASES[-1:]) if args.quick else (("v0", "v1"), CASES)
    rows = []
    with tempfile.TemporaryDirectory(prefix="servematrix-kv-peak-") as tmp:
        os.chdir(tmp)  # the cell writes its logs under results/
        for recipe in recipes:
            for case_serving, input_len, output_len, prompts, qps in cases:
                serving = case_serving or SMALL[recipe]
                base = cell_for(MODEL, recipe, "single", qps, prompts)
                workload = replace(
                    base.workload, input_len=input_len, output_len=output_len, warmup_requests=0
                )
                deploy = {**base.deploy, "state_dir": f"{tmp}/state", "warm": False}
                cell = replace(base, workload=workload, serving=serving, deploy=deploy)
                emu, emu_preempted = run(cell, Path(tmp) / "emulator.parquet")
                sim, sim_preempted = run(
                    replace(cell, backend="simulator", deploy={}), Path(tmp) / "simulator.parquet"
                )
                samples = [u for s in emu["kv_cache_usage"].values() for _, u in s]
                pool = emu["kv_pool_blocks"]
                differ = sum(emu_preempted[k] != sim_preempted[k] for k in sim_preempted)
                rows.append(
                    [
                        recipe,
                        f"{serving.gpu_memory_utilization:g}",
                        f"{input_len}/{output_len}",
                        f"{qps:g}",
                        str(pool),
                        str(emu["peak_kv_blocks"][0]),
                        str(sim["peak_kv_blocks"][0]),
                        f"{round(max(samples, default=0.0) * pool)} ({len(samples)})",
                        str(sum(emu_preempted.values())),
                        str(sum(sim_preempted.values())),
                        str(differ),
                    ]
                )
    header = [
        "recipe",
        "util",
        "in/out",
        "QPS",
        "pool blocks",
        "peak emulator",
        "peak simulator",
        "highest sample (samples)",
        "preemptions emulator",
        "preemptions simulator",
        "requests differing",
    ]
    table("KV cache: exact peak (blocks) and preemptions, emulator vs simulator", header, rows)


if __name__ == "__main__":
    main()
