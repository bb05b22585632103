"""The datasets a workload draws its prompts from (``workload.dataset``): one module each behind
one interface (`base.Dataset`) and one registry, `DATASETS` (reference/vllm-mooncake-spec.md
§3.5 for vLLM's). What a dataset reads and which settings apply to it are its attributes, so
the config's checks, the path token, the identity and the simulator ask the dataset instead
of comparing its name.

Adding a dataset: a module here with a class that satisfies `base.Dataset`, its line in
`DATASETS`, and its name in the schema's ``dataset`` enum (config/schema.yaml); its prompts
then reach every backend through `servematrix.workload.build_requests`.
"""

from __future__ import annotations

from collections.abc import Callable

from servematrix.workload.datasets.base import Dataset as Dataset
from servematrix.workload.datasets.base import WorkloadError
from servematrix.workload.datasets.jsonl import Jsonl
from servematrix.workload.datasets.mooncake import MooncakeTrace
from servematrix.workload.datasets.random_ids import RandomIds
from servematrix.workload.datasets.sonnet import Sonnet

DATASETS: dict[str, Dataset] = {
    d.NAME: d for d in (RandomIds(), Sonnet(), Jsonl(), MooncakeTrace())
}


def dataset_of(name: str) -> Dataset:
    try:
        return DATASETS[name]
    except KeyError:
        raise WorkloadError(f"unknown dataset {name!r} (known: {', '.join(DATASETS)})") from None


def names(having: Callable[[Dataset], bool]) -> str:
    """The datasets with a property, spelled for a message (``random and sonnet``)."""
    chosen = [name for name, d in DATASETS.items() if having(d)]
    return ", ".join(chosen[:-1]) + (" and " if len(chosen) > 1 else "") + chosen[-1]
