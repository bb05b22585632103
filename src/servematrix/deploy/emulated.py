"""What an emulated deployment tells a cell beyond vLLM's API: the emulator-only routes of its
servers (`servematrix.emulator.server`), read after the cell's requests."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

from servematrix.deploy import memory
from servematrix.deploy.processes import Plan
from servematrix.deploy.supervise import DeployError


def preemptions(plan: Plan, prefix: str) -> dict[int, int]:
    """How often the emulator's engines preempted each request of the run (by request id),
    summed over the deployment's instances (a disaggregated request is served by both), from
    each instance's emulator-only ``GET /servematrix/requests``; a request no instance saw
    is absent. Raises ``DeployError`` naming the instance that did not answer."""
    counts: dict[int, int] = {}
    mark = f"{prefix}-"
    for name, base in memory.instances(plan).items():
        url = f"{base}/servematrix/requests?prefix={urllib.parse.quote(mark)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                logs = json.load(response)
        except (urllib.error.URLError, OSError, ValueError) as error:
            raise DeployError(f"{name}: could not read {url}: {error}") from error
        for key, entry in logs.items():
            request_id = int(key.removeprefix(mark))
            counts[request_id] = counts.get(request_id, 0) + entry["preemptions"]
    return counts
