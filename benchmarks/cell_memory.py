"""Memory of one cell against its size: the basis of the per-cell ceiling in config.py.

Each measurement runs one simulated cell (the default config's Qwen2.5-7B-Instruct, mode
``single``, recipe ``v0``, QPS 8) end to end in a fresh subprocess, as a workflow job does:
build the cell, simulate it, write its Parquet trace. The subprocess reports its peak resident
set size (``ru_maxrss``). The bytes per request are the difference between two sizes divided
by the difference in requests, so the fixed cost of the imports and step-time tables cancels.

The backends that send prompts (emulator, vllm, external) also hold the request list the client
sends: its size per prompt token is measured with ``tracemalloc`` around
``servematrix.workload.build_requests``.

``servematrix.spec.configcheck.cell_memory_bytes`` must stay above what this prints (it is the
estimate the config check compares with ``CELL_MEMORY_CEILING_BYTES``).

Usage (from the repository root)::

    .venv/bin/python benchmarks/cell_memory.py            # about a minute
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

import yaml

from servematrix import workload
from servematrix.spec import config
from servematrix.spec.configcheck import CELL_MEMORY_CEILING_BYTES, cell_memory_bytes

CHILD = """
import dataclasses, json, resource, sys
from pathlib import Path
import yaml
from servematrix.spec import config
from servematrix.backends.cell import run_cell
n, input_len, output_len, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
raw = yaml.safe_load(Path("config/config.yaml").read_text())
raw["studies"] = {"m": {"recipe": "v0", "models": ["Qwen2.5-7B-Instruct"], "modes": ["single"],
                        "qps": [8], "input_len": [input_len],
                        "workload": {"num_prompts": n, "output_len": output_len}}}
cell = config.load(raw).all_cells()[0]
run_cell(cell, out)
print(json.dumps({"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""

SIZES = [  # (input_len, output_len): each measured at two request counts
    (1024, 6),
    (128, 6),
    (1024, 128),
]
COUNTS = (2_000, 20_000)


def peak_kib(n: int, input_len: int, output_len: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run(
            [sys.executable, "-c", CHILD, *map(str, (n, input_len, output_len)), f"{tmp}/t"],
            capture_output=True,
            text=True,
            check=True,
        )
    return json.loads(run.stdout.strip().splitlines()[-1])["maxrss_kib"]


def prompt_bytes_per_token(input_len: int, n: int = 1000) -> float:
    raw = yaml.safe_load(Path("config/config.yaml").read_text())
    cell = config.load(raw).all_cells()[0]
    w = dataclasses.replace(cell.workload, num_prompts=n, input_len=input_len)
    tracemalloc.start()
    requests = workload.build_requests(w, 152064)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(requests) >= n
    return held / n / input_len


def main() -> None:
    print(f"ceiling {CELL_MEMORY_CEILING_BYTES / 2**30:g} GiB per cell (estimated)")
    print(f"{'input':>6} {'output':>6} {'requests':>9} {'peak MiB':>9} {'B/req':>7} {'est.':>7}")
    for input_len, output_len in SIZES:
        low, high = (peak_kib(n, input_len, output_len) for n in COUNTS)
        per_request = (high - low) * 1024 / (COUNTS[1] - COUNTS[0])
        estimate = cell_memory_bytes(1, input_len, output_len, sends_prompts=False)
        print(
            f"{input_len:>6} {output_len:>6} {COUNTS[1]:>9} {high / 1024:>9.0f} "
            f"{per_request:>7.0f} {estimate:>7}"
        )
    print("request list of the backends that send prompts (est. B/prompt token: 48)")
    for input_len in (128, 1024, 4096):
        print(f"  input {input_len:>5}: {prompt_bytes_per_token(input_len):5.1f} B/prompt token")


if __name__ == "__main__":
    main()
