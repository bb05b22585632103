"""The workflow's side of warm deployments: run order and the final stop."""

from __future__ import annotations

from pathlib import Path

from servematrix.config import Cell, Config


def deployment_key(cell: Cell) -> tuple:
    """Cells with equal keys need the same deployment (same recipe and command lines)."""
    return (cell.recipe, cell.model.name, cell.mode.name, cell.serving)


def deployment_priority(cfg: Config, cell_path_tail: str) -> int:
    """Snakemake priority of a cell: deployments in config order, highest first, so a run
    with free choice among ready cells finishes one deployment before it starts the next."""
    keys: list[tuple] = []
    mine = None
    for cell in cfg.all_cells():
        key = deployment_key(cell)
        if key not in keys:
            keys.append(key)
        if mine is None and cell.path.endswith(f"/{cell_path_tail}.parquet"):
            mine = key
    return len(keys) - keys.index(mine) if mine is not None else 0


def stop_deployments(cfg: Config) -> None:
    """Stop every warm deployment of this workflow's backend (onsuccess / onerror)."""
    if cfg.backend not in ("vllm", "emulator"):
        return
    from servematrix.deploy import warm

    cells = cfg.all_cells()
    if not cells:
        return
    settings, state_dir, _ = warm.settings_for(cells[0])
    if Path(state_dir).is_dir():
        for fingerprint in warm.stop_all(state_dir, settings.stop_timeout_s):
            print(f"servematrix: stopped deployment {fingerprint}")
