"""The workflow's side of warm deployments: run order and the final stop."""

from __future__ import annotations

from pathlib import Path

from servematrix.spec.matrix import Cell, Config


def deployment_key(cell: Cell) -> tuple:
    """Cells with equal keys need the same deployment (same recipe and command lines)."""
    return (cell.recipe, cell.model.name, cell.mode.name, cell.serving)


def _keys(cfg: Config) -> list[tuple]:
    keys: list[tuple] = []
    for cell in cfg.all_cells():
        key = deployment_key(cell)
        if key not in keys:
            keys.append(key)
    return keys


def _cell(cfg: Config, cell_path_tail: str) -> Cell | None:
    for cell in cfg.all_cells():
        if cell.path.endswith(f"/{cell_path_tail}.parquet"):
            return cell
    return None


def deployment_priority(cfg: Config, cell_path_tail: str) -> int:
    """Snakemake priority of a cell: deployments in config order, highest first, so a run
    with free choice among ready cells finishes one deployment before it starts the next."""
    keys, cell = _keys(cfg), _cell(cfg, cell_path_tail)
    return len(keys) - keys.index(deployment_key(cell)) if cell is not None else 0


def deployment_groups(cfg: Config) -> list[str]:
    return [f"deployment{i}" for i in range(1, len(_keys(cfg)) + 1)]


def deployment_group(cfg: Config, cell_path_tail: str) -> str:
    """The Snakemake group of a cell: one per deployment (``deployment1``, ...)."""
    cell = _cell(cfg, cell_path_tail)
    return f"deployment{_keys(cfg).index(deployment_key(cell)) + 1}" if cell else "deployment0"


def pinned_gpu_count(cfg: Config, cell_path_tail: str) -> int:
    cell = _cell(cfg, cell_path_tail)
    return len({g for gpus in cell.instance_gpus for g in gpus}) if cell is not None else 0


def stop_deployments(cfg: Config, machine_wide: bool) -> None:
    """Stop every warm deployment of this workflow's backend, one that deploys (see
    `servematrix.workflow.stop_deployments`; ``machine_wide``: `warm.settings_for`)."""
    from servematrix.deploy import warm

    cells = cfg.all_cells()
    if not cells:
        return
    settings, state_dir, _ = warm.settings_for(cells[0], machine_wide)
    if Path(state_dir).is_dir():
        for fingerprint in warm.stop_all(state_dir, settings.stop_timeout_s):
            print(f"servematrix: stopped deployment {fingerprint}")
