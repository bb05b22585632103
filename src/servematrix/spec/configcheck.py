"""A config's checks beyond the schema that need no engine model (those are in
``servematrix.preflight``): each names the key path, so a typo costs one line of error before
any job (issue 11). `servematrix check` and the workflow both run them in ``config.load``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from servematrix.spec.matrix import ConfigError, Study

CELL_MEMORY_CEILING_BYTES = 4 * 2**30
"""Largest estimated memory of one cell; a bigger cell is refused before it runs."""
BYTES_PER_REQUEST = 4096
BYTES_PER_INPUT_TOKEN = 48
BYTES_PER_OUTPUT_TOKEN = 128
"""Per request: its trace row and engine state, one streamed chunk (time, token count) per
output token and, on the backends that send prompts, the prompt's token ids (a Python int
each, and the request body). Above what ``benchmarks/cell_memory.py`` measures: about 3 kB per
request and 80 B per output token in a simulated cell, 41 B per prompt token in the request
list the client sends."""
DEFAULT_NODE_GPUS = 8


def cell_memory_bytes(
    requests: int, input_len: int, output_len: int, sends_prompts: bool = True
) -> int:
    """Estimated memory of a cell of ``requests`` requests (warm-ups included); the simulator
    replays lengths and holds no prompt (``sends_prompts`` False)."""
    prompt = BYTES_PER_INPUT_TOKEN * input_len if sends_prompts else 0
    return requests * (BYTES_PER_REQUEST + prompt + BYTES_PER_OUTPUT_TOKEN * output_len)


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:,.1f} GiB"


def _check_lists(data: Mapping[str, Any]) -> None:
    """A value twice in a study's list would measure one cell twice (duplicate summary rows)."""
    for name, study in data["studies"].items():
        for key in ("models", "modes", "qps", "input_len", "tp"):
            first: dict[Any, int] = {}
            for i, value in enumerate(study.get(key, ())):
                j = first.setdefault(value, i)
                if j != i:
                    raise ConfigError(
                        f"studies.{name}.{key}[{i}]",
                        f"{value!r} is already {key}[{j}]: each value once",
                    )


def _check_gpu_pins(data: Mapping[str, Any]) -> None:
    if data.get("node", {}).get("kind") == "cpu":
        return  # pins name cores: checked on the node against the cores it may use
    node_gpus = data.get("node", {}).get("gpus", DEFAULT_NODE_GPUS)
    for name, model in data["models"].items():
        for i, gpus in enumerate(model["gpus"]):
            beyond = sorted(g for g in gpus if g >= node_gpus)
            if beyond:
                raise ConfigError(
                    f"models.{name}.gpus[{i}]",
                    f"pins GPU {beyond[0]} but the node has {node_gpus} GPUs "
                    f"(ids 0-{node_gpus - 1}; set node.gpus for a bigger node)",
                )


def _check_cell_memory(data: Mapping[str, Any], studies: Mapping[str, Study]) -> None:
    for name, study in studies.items():
        for cell in study.cells:
            w = cell.workload
            requests = w.num_prompts + w.warmup_requests
            sizes = (w.input_len, w.output_len, cell.backend != "simulator")
            needed = cell_memory_bytes(requests, *sizes)
            if needed <= CELL_MEMORY_CEILING_BYTES:
                continue
            fits = CELL_MEMORY_CEILING_BYTES // cell_memory_bytes(1, *sizes)
            in_study = "num_prompts" in data["studies"][name].get("workload", {})
            key = f"studies.{name}.workload.num_prompts" if in_study else "defaults.num_prompts"
            if fits < 1 + w.warmup_requests:
                key = f"studies.{name}.input_len"
            raise ConfigError(
                key,
                f"{requests:,} requests of input {w.input_len} and output {w.output_len} tokens "
                f"need about {_gib(needed)} in one cell, above the ceiling of "
                f"{_gib(CELL_MEMORY_CEILING_BYTES)} (at most {fits:,} requests of these lengths)",
            )


def check_input(data: Mapping[str, Any], studies: Mapping[str, Study]) -> None:
    """The checks the schema cannot express that need no engine model (those are in
    ``servematrix.preflight``), in the order a reader would fix them."""
    _check_lists(data)
    _check_gpu_pins(data)
    _check_cell_memory(data, studies)
