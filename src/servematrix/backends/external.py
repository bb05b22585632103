"""External: a server the user already runs at ``base_url``; nothing is started."""

from __future__ import annotations

from typing import Any

from servematrix.backends import prefixstats, served
from servematrix.backends.run import BackendRun
from servematrix.spec.matrix import Cell, Config, ConfigError

NAME = "external"
MEASURED = True
ENGINE_MODEL = False
DEPLOYS = False
REAL_HARDWARE = False
SETS_FLAGS = False
CONDA_ENV = "servematrix"
REFUSED_TIMEOUT_S = 30.0
"""The schema's default of ``deploy.refused_timeout_s``."""


def preflight(cfg: Config) -> None:
    if not cfg.raw.get("base_url"):
        raise ConfigError("base_url", f"backend {NAME} needs the server's base_url")


@served.failing_as_cell_error
def run(cell: Cell) -> BackendRun:
    base_url = cell.deploy["base_url"]
    server = [base_url.rstrip("/").removesuffix("/v1")]  # its /metrics, if it is vLLM's
    before = prefixstats.scrape(server) if cell.serving.prefix_caching else None
    # A server the user runs refuses connections only when it is not there.
    refused_timeout_s = float(cell.deploy.get("refused_timeout_s", REFUSED_TIMEOUT_S))
    records, client = served.measure(cell, base_url, refused_timeout_s)
    after = prefixstats.scrape(server) if before is not None else None
    reuse = prefixstats.served(before, after)
    deployment = {"base_url": base_url, "started": "external", "prefix_cache": reuse, **client}
    return BackendRun(records, deployment)


def identity(cell: Cell) -> dict[str, Any]:
    return {"base_url": cell.deploy.get("base_url")}


def caveat(gpu: str, step_times: list[str], profile: str | None) -> str:
    return f"Caveat: measured on the {NAME} backend (one machine, one run per seed)."
