"""A cell's identity: every input of its result, as one canonical JSON string.

A trace's path spells what a person chooses per cell (recipe, model, mode, workload). Everything
else its numbers depend on is here: the engine and hardware settings (simulator and emulator),
the serving flags, the model's architecture as the engine reads it (the content, not the name
of its ``config.json``), the dataset file's content, and, on the backends that start servers,
the fingerprint of the deployment's command lines, environment and files (the recipe's options
and the server command). The cell rule passes it as a parameter, which Snakemake compares with
the last run's: a changed setting reruns exactly the cells it changes. What does not change a
result stays out (GPU pins and the deploy timeouts on the simulator, figure and SLO settings
everywhere), so editing it reruns no cell.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from servematrix.backends import backend_of
from servematrix.spec.matrix import Cell
from servematrix.workload.datasets import dataset_of


@functools.lru_cache(maxsize=256)
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:
    del mtime_ns, size  # the cache key: a rewritten file is hashed again
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes (hashed once per content version in a process)."""
    stat = Path(path).stat()
    return _file_sha256(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=256)
def _architecture(name: str, mtime_ns: int) -> dict[str, Any]:
    from servematrix.engine.architecture import load_architecture

    del mtime_ns  # the cache key
    return asdict(load_architecture(name))


def architecture_content(name: str) -> dict[str, Any]:
    """What the engine reads from a model's ``config.json``: a changed dimension changes it,
    a key the engine ignores does not."""
    from servematrix.engine.architecture import resolve_config_json

    path = resolve_config_json(name)
    return _architecture(name, path.stat().st_mtime_ns)


def identity_document(cell: Cell) -> dict[str, Any]:
    """Every input of the cell's result, with what its backend adds (see the module
    docstring)."""
    workload = asdict(cell.workload)
    if cell.workload.dataset_path is not None:
        workload["dataset_sha256"] = file_sha256(cell.workload.dataset_path)
    model: dict[str, Any] = {
        "quantization": cell.model.quantization,
        "tensor_parallel": cell.model.tensor_parallel,
        "architecture": architecture_content(cell.model.architecture),
    }
    backend = backend_of(cell.backend)
    if backend.MEASURED or dataset_of(cell.workload.dataset).READS_FILE:
        # What is served, and whose tokenizer counts a file's text prompts; drawn ids need none.
        model["hf_id"] = cell.model.hf_id
    return {
        "backend": cell.backend,
        "recipe": cell.recipe,
        "mode": asdict(cell.mode),
        "model": model,
        "workload": workload,
        "serving": asdict(cell.serving),
        **backend.identity(cell),
    }


def cell_identity(cell: Cell) -> str:
    """The identity as canonical JSON (sorted keys, no spaces): equal inputs, equal strings."""
    return json.dumps(identity_document(cell), sort_keys=True, separators=(",", ":"))
