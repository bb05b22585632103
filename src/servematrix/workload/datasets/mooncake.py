"""The ``mooncake`` dataset: a Mooncake trace (``servematrix.workload.replay``): ``num_prompts``
requests from ``trace_start_s``, each sent as token ids whose 512-token blocks are equal exactly
where the trace's hash ids are; ``input_len`` caps the input (longer requests dropped or truncated,
as ``input_overflow`` says) and ``output_len`` the output (``max_tokens`` is the trace's output
length, at most ``output_len``). They are sent at the trace's timestamps scaled so the window's
mean rate is the cell's ``qps`` (``trace_timing: timestamps``) or at the seeded schedule of the
other datasets (``trace_timing: qps``)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from servematrix.workload import replay
from servematrix.workload.datasets.base import Entry, WorkloadError, dataset_file

if TYPE_CHECKING:
    from servematrix.workload import TokenCounter
    from servematrix.workload.definition import Workload


class MooncakeTrace:
    NAME = "mooncake"
    READS_FILE = True
    TOKENIZED = False
    DRAWS_LENGTHS = False
    SHARES_PREFIX = False
    GROUPS_PREFIXES = False
    REPLAYS_TRACE = True

    def entries(
        self, w: Workload, count: int, counter: TokenCounter | None, vocab_size: int | None
    ) -> list[Entry]:
        requests = trace_window(w).requests
        outputs = [min(r.output_len, w.output_len) for r in requests]
        if vocab_size is None:
            return [Entry(None, r.input_len, o) for r, o in zip(requests, outputs, strict=True)]
        built = replay.prompts(requests, w.seed, vocab_size)
        return [Entry(p, len(p), o) for p, o in zip(built, outputs, strict=True)]

    def shared_prefix_tokens(self, w: Workload, counter: TokenCounter) -> int:
        return 0

    def check(self, w: Workload) -> None:
        """The trace is read by the config's own check (`servematrix.spec.config`)."""


def trace_window(workload: Workload) -> replay.TraceWindow:
    """The trace's window for the workload (errors as `WorkloadError`); it has no warm-ups,
    which would change the window's cache state (the config refuses them too)."""
    w = workload
    if w.warmup_requests:
        raise WorkloadError("the mooncake dataset replays no warm-up requests (set them to 0)")
    try:
        return replay.window(
            _read_trace(_file_key(dataset_file(w))),
            w.trace_start_s,
            w.num_prompts,
            w.input_len,
            w.input_overflow,
            where=f"trace file {w.dataset_path}",
        )
    except replay.TraceError as error:
        raise WorkloadError(str(error)) from error


def _file_key(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path), stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=2)
def _read_trace(key: tuple[str, int, int]) -> list[replay.TraceRequest]:
    """A trace file's requests, read once per process and version of the file (the simulator
    asks for a cell's lengths and its send times)."""
    return replay.read_trace(key[0])
