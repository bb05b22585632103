"""Simulator speed: wall time to simulate each study and the whole config, requests per second.

What is measured (issue 3, "What it must show"), all with ``time.perf_counter`` in one process on
one thread (``OMP/OPENBLAS/MKL_NUM_THREADS=1`` are set before numpy is imported; the simulator
itself is single-threaded Python):

1. **Imports**: ``import numpy``, ``servematrix.spec.config``, ``servematrix.simulate`` (cold, as
   the first cell of a fresh process pays them).
2. **Warm-up**: the first pass of ``servematrix.simulate.simulate`` over every distinct cell of the
   selected studies, as configured (200 requests per cell by default). It pays whatever is built
   once per process: step-time tables (built, or loaded from their disk cache), architectures, GPU
   specs. This is the number the target "whole default config in under 10 s on one core after
   imports" is checked against, because it is what a fresh run pays.
3. **Steady, as configured**: per study (every cell of the study, shared cells included) and for
   the whole config (every distinct cell once, as the workflow runs them), best and median of
   ``--repeat`` passes after the warm-up.
4. **Large cells** (skipped by ``--quick``): ``num_prompts`` replaced by ``--large`` (default
   100,000) with ``dataclasses.replace`` on the cell's workload. By default one representative cell
   per (study, mode): the heaviest load of that mode in the study (highest QPS, then longest
   input, then the first model in the study's order); ``--large-scope study`` simulates every
   cell of the study instead (slow: minutes per study at 100,000). One pass each, after the
   warm-up; a cell that exceeds ``--cell-timeout`` seconds is reported as timed out, not waited for.
   Target: at least 50,000 simulated requests per second of wall time on a large cell.

"Requests" are the measured requests of a cell (``num_prompts``); the cell's warm-up requests
(one per cell by default) are simulated too but not counted. The records a cell returns are
built (they are part of ``simulate``); nothing is written to disk. The cyclic garbage collector is
paused by ``simulate`` itself, in the workflow as here.

``--fingerprints PATH`` writes a SHA-256 of every simulated cell's per-request columns (all of
``RequestRecord``), its KV peaks and engine parameters to a JSON file, keyed by cell (the large
cells by study, mode and size): two trees that simulate the same results write the same file,
which checks that a speed-only change left every trace as it was. Hashing is not timed.

Usage (from the repository root)::

    .venv/bin/python benchmarks/simulator_speed.py                 # everything, 20 s-2 min
    .venv/bin/python benchmarks/simulator_speed.py --quick         # 200-request part only
    .venv/bin/python benchmarks/simulator_speed.py --studies mooncake,quantization --large 20000
    .venv/bin/python benchmarks/simulator_speed.py --repeat 1 --fingerprints /tmp/after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)
for _variable in THREAD_VARIABLES:  # before numpy is imported (it is, lazily, in _import_package)
    os.environ[_variable] = "1"

if TYPE_CHECKING:
    from servematrix.spec.matrix import Cell, Config

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "config" / "config.yaml"
DEFAULT_LARGE = 100_000
WHOLE_CONFIG_TARGET_S = 10.0
"""Issue 3: the whole default config in under 10 s on one core after imports."""
LARGE_CELL_TARGET_RPS = 50_000.0
"""Issue 3: at least 50,000 simulated requests per second of wall time on a large cell."""

Simulate = Callable[["Cell"], Any]


@dataclass(frozen=True)
class Machine:
    """Where the numbers were taken: they mean little without it."""

    platform: str
    python: str
    cpu_count: int | None
    usable_cpus: int | None
    load_average: tuple[float, float, float] | None

    @classmethod
    def current(cls) -> Machine:
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        load = os.getloadavg() if hasattr(os, "getloadavg") else None
        return cls(platform.platform(), sys.version.split()[0], os.cpu_count(), usable, load)


@dataclass
class Imports:
    """Wall time of the cold imports, and the two functions the benchmark calls."""

    seconds: dict[str, float]
    load_file: Callable[[Path], Config]
    simulate: Simulate

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


@dataclass
class PassTiming:
    """Repeated passes of ``simulate`` over a set of cells: wall seconds of each pass."""

    label: str
    cells: int
    requests: int
    seconds: list[float] = field(default_factory=list)

    @property
    def best_s(self) -> float:
        return min(self.seconds)

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.best_s


@dataclass
class LargeRow:
    """One large-cell measurement (or one whole study at ``--large-scope study``)."""

    study: str
    mode: str
    what: str
    cells: int
    requests: int
    seconds: float | None
    """None when the cell timed out."""

    @property
    def requests_per_s(self) -> float | None:
        return None if self.seconds is None else self.requests / self.seconds


class CellTimeout(Exception):
    """A simulation ran past ``--cell-timeout``."""


# --- measuring ------------------------------------------------------------------------------------


def _import_package() -> Imports:
    """Import numpy and the two servematrix modules cold, timing each."""
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    import numpy  # noqa: F401

    seconds["numpy"] = time.perf_counter() - start
    start = time.perf_counter()
    from servematrix.spec.config import load_file

    seconds["servematrix.spec.config"] = time.perf_counter() - start
    start = time.perf_counter()
    from servematrix.simulate import simulate

    seconds["servematrix.simulate"] = time.perf_counter() - start
    return Imports(seconds, load_file, simulate)


def _requests(cells: Sequence[Cell]) -> int:
    return sum(cell.workload.num_prompts for cell in cells)


Fingerprints = dict[str, str]
"""Cell label -> SHA-256 of what the simulator made of it (``--fingerprints``)."""


def fingerprint(result: Any) -> str:
    """SHA-256 of a ``SimulationResult``: every record's fields in order (floats by ``repr``,
    exact), the KV peaks and the engine parameters."""
    digest = hashlib.sha256()
    for record in result.records:
        digest.update(repr(tuple(vars(record).values())).encode())
    digest.update(repr(result.peak_kv_blocks).encode())
    digest.update(json.dumps(result.engine_parameters, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _one_pass(
    simulate: Simulate,
    cells: Sequence[Cell],
    fingerprints: Fingerprints | None = None,
    labels: Sequence[str] | None = None,
) -> float:
    """Wall seconds of ``simulate`` over ``cells``; with ``fingerprints``, each result's
    fingerprint under its label (``labels``, else the cell's path), hashed off the clock."""
    if fingerprints is None:
        start = time.perf_counter()
        for cell in cells:
            simulate(cell)
        return time.perf_counter() - start
    seconds = 0.0
    for index, cell in enumerate(cells):
        start = time.perf_counter()
        result = simulate(cell)
        seconds += time.perf_counter() - start
        fingerprints[labels[index] if labels else cell.path] = fingerprint(result)
    return seconds


def _timed_passes(
    simulate: Simulate,
    label: str,
    cells: Sequence[Cell],
    repeat: int,
    fingerprints: Fingerprints | None = None,
) -> PassTiming:
    """``repeat`` passes; the first one fingerprints the cells when asked to."""
    timing = PassTiming(label, len(cells), _requests(cells))
    timing.seconds = [
        _one_pass(simulate, cells, fingerprints if index == 0 else None) for index in range(repeat)
    ]
    return timing


@contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`CellTimeout` after ``seconds`` of wall time (no limit without SIGALRM)."""
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    def _expire(signum: int, frame: FrameType | None) -> None:
        raise CellTimeout

    previous = signal.signal(signal.SIGALRM, _expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _with_prompts(cell: Cell, num_prompts: int) -> Cell:
    return replace(cell, workload=replace(cell.workload, num_prompts=num_prompts))


def representative_cells(cells: Sequence[Cell]) -> dict[str, Cell]:
    """Per mode, the heaviest load: highest QPS, then longest input, then the first model."""
    chosen: dict[str, Cell] = {}
    for cell in cells:
        best = chosen.get(cell.mode.name)
        load = (cell.workload.qps, cell.workload.input_len)
        if best is None or load > (best.workload.qps, best.workload.input_len):
            chosen[cell.mode.name] = cell
    return chosen


def _cell_label(cell: Cell) -> str:
    w = cell.workload
    return f"{cell.model.name} qps {w.qps:g} in {w.input_len}"


def _large_row(
    simulate: Simulate,
    study: str,
    mode: str,
    what: str,
    cells: Sequence[Cell],
    timeout: float,
    fingerprints: Fingerprints | None = None,
) -> LargeRow:
    requests = _requests(cells)
    labels = [f"large/{study}/{mode}/{cell.workload.num_prompts}/{cell.path}" for cell in cells]
    try:
        with _time_limit(timeout):
            seconds: float | None = _one_pass(simulate, cells, fingerprints, labels)
    except CellTimeout:
        seconds = None
    row = LargeRow(study, mode, what, len(cells), requests, seconds)
    done = "timed out" if seconds is None else f"{seconds:.2f} s"
    print(f"  large: {study} / {mode} / {what}: {done}", file=sys.stderr, flush=True)
    return row


def measure_large(
    simulate: Simulate,
    studies: dict[str, Sequence[Cell]],
    num_prompts: int,
    scope: str,
    timeout: float,
    fingerprints: Fingerprints | None = None,
) -> list[LargeRow]:
    """Large cells: one per (study, mode), or every cell of each study."""
    rows = []
    for name, cells in studies.items():
        if scope == "study":
            large = [_with_prompts(cell, num_prompts) for cell in cells]
            modes = ",".join(sorted({cell.mode.name for cell in cells}))
            rows.append(
                _large_row(simulate, name, modes, "whole study", large, timeout, fingerprints)
            )
            continue
        for mode, cell in representative_cells(cells).items():
            large = [_with_prompts(cell, num_prompts)]
            what = _cell_label(cell)
            rows.append(_large_row(simulate, name, mode, what, large, timeout, fingerprints))
    return rows


# --- printing -------------------------------------------------------------------------------------


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows, strict=True)]

    def line(values: Sequence[str]) -> str:
        cells = [
            v.rjust(w) if i in right else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def header_lines(machine: Machine, imports: Imports, config: Path) -> list[str]:
    load = (
        "n/a"
        if machine.load_average is None
        else " ".join(f"{x:.2f}" for x in machine.load_average)
    )
    parts = ", ".join(f"{name} {s:.3f} s" for name, s in imports.seconds.items())
    return [
        f"servematrix simulator speed  ({datetime.now(UTC).isoformat(timespec='seconds')})",
        f"machine: {machine.platform}; python {machine.python}; os.cpu_count() "
        f"{machine.cpu_count}, usable {machine.usable_cpus}; load average {load}",
        f"threads: {'/'.join(v.split('_')[0] for v in THREAD_VARIABLES)} threads = 1; "
        "the simulator itself runs on one thread",
        f"config: {_shown(config)}",
        f"imports (cold): {imports.total_s:.3f} s ({parts})",
    ]


def _pass_row(timing: PassTiming, target: str = "") -> list[str]:
    median = f"{timing.median_s:.3f}" if len(timing.seconds) > 1 else ""
    return [
        timing.label,
        str(timing.cells),
        f"{timing.requests:,}",
        f"{timing.best_s:.3f}",
        median,
        f"{timing.requests_per_s:,.0f}",
        target,
    ]


def configured_table(
    warmup: PassTiming, studies: list[PassTiming], whole: PassTiming, whole_config: bool
) -> str:
    """Per-study rows, then the whole config cold (with the 10 s target) and steady."""
    headers = ["scope", "cells", "requests", "best s", "median s", "sim req/s", "target"]
    met = _verdict(warmup.best_s < WHOLE_CONFIG_TARGET_S)
    target = f"< {WHOLE_CONFIG_TARGET_S:g} s: {met}" if whole_config else "(whole config only)"
    rows = [*(_pass_row(t) for t in studies), _pass_row(warmup, target), _pass_row(whole)]
    return "\n".join(
        [
            f"Requests per cell as configured. Studies and steady rows: best / median of "
            f"{len(whole.seconds)} passes after the warm-up; the first pass (cold: step-time "
            "tables and other per-process setup, imports excluded) carries the 10 s target.",
            _table(headers, rows, right={1, 2, 3, 4, 5}),
        ]
    )


def large_table(rows: list[LargeRow], num_prompts: int, scope: str, timeout: float) -> str:
    """Large-cell rows with the 50,000 req/s target next to each."""
    what = (
        "the whole study (every cell)"
        if scope == "study"
        else "one representative cell per mode (highest QPS, then longest input, then first model)"
    )
    headers = ["study", "mode", "cell", "requests", "wall s", "sim req/s", "target"]
    body = []
    for row in rows:
        rate = row.requests_per_s
        body.append(
            [
                row.study,
                row.mode,
                row.what,
                f"{row.requests:,}",
                f"timed out > {timeout:g}" if row.seconds is None else f"{row.seconds:.2f}",
                "" if rate is None else f"{rate:,.0f}",
                f">= {LARGE_CELL_TARGET_RPS:,.0f}/s: "
                + _verdict(rate is not None and rate >= LARGE_CELL_TARGET_RPS),
            ]
        )
    rates = [r.requests_per_s for r in rows if r.requests_per_s is not None]
    best = f"{max(rates):,.0f}" if rates else "n/a"
    return "\n".join(
        [
            f"{num_prompts:,} requests per cell, {what}; one pass each after the warm-up:",
            _table(headers, body, right={3, 4, 5}),
            f"best large-cell rate: {best} simulated requests/s (target >= "
            f"{LARGE_CELL_TARGET_RPS:,.0f})",
            *_timeout_note(rows, timeout),
        ]
    )


def _timeout_note(rows: list[LargeRow], timeout: float) -> list[str]:
    timed_out = [row for row in rows if row.seconds is None]
    if not timed_out:
        return []
    return [
        f"timed out: abandoned after --cell-timeout {timeout:g} s (under "
        f"{timed_out[0].requests / timeout:,.0f} req/s, or stuck); --cell-timeout 0 waits"
    ]


# --- command line ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="config YAML")
    parser.add_argument("--quick", action="store_true", help="the 200-request part only")
    parser.add_argument("--studies", help="comma-separated study names (default: all)")
    parser.add_argument(
        "--large", type=int, default=DEFAULT_LARGE, help="requests per large cell (100000)"
    )
    parser.add_argument(
        "--large-scope",
        choices=("cell", "study"),
        default="cell",
        help="cell: one representative cell per (study, mode) (default); study: every cell",
    )
    parser.add_argument("--repeat", type=int, default=3, help="steady passes (default 3)")
    parser.add_argument(
        "--cell-timeout",
        type=float,
        default=30.0,
        help="seconds before a large cell (or study) is abandoned (default 30; 0: none)",
    )
    parser.add_argument(
        "--fingerprints",
        type=Path,
        help="write a SHA-256 of each simulated cell's records to this JSON file",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.large < 1:
        parser.error("--repeat and --large must be >= 1")
    return args


def _select_studies(config: Config, names: str | None) -> dict[str, Sequence[Cell]]:
    if not names:
        return {name: study.cells for name, study in config.studies.items()}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in config.studies]
    if unknown:
        raise SystemExit(
            f"unknown studies: {', '.join(unknown)} (config has {', '.join(config.studies)})"
        )
    return {name: config.studies[name].cells for name in wanted}


def _distinct(studies: dict[str, Sequence[Cell]]) -> list[Cell]:
    seen: dict[str, Cell] = {}
    for cells in studies.values():
        for cell in cells:
            seen.setdefault(cell.path, cell)
    return list(seen.values())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    imports = _import_package()
    config = imports.load_file(args.config)
    studies = _select_studies(config, args.studies)
    whole_label = "whole config" if not args.studies else "selected studies"
    distinct = _distinct(studies)
    simulate = imports.simulate

    print("\n".join(header_lines(Machine.current(), imports, args.config)), flush=True)
    fingerprints: Fingerprints | None = None if args.fingerprints is None else {}
    warmup = _timed_passes(simulate, f"{whole_label}, first pass (cold)", distinct, 1, fingerprints)
    per_study = [
        _timed_passes(simulate, name, cells, args.repeat) for name, cells in studies.items()
    ]
    whole = _timed_passes(simulate, f"{whole_label} (steady)", distinct, args.repeat)
    print()
    print(configured_table(warmup, per_study, whole, not args.studies), flush=True)
    if not args.quick:
        rows = measure_large(
            simulate, studies, args.large, args.large_scope, args.cell_timeout, fingerprints
        )
        print()
        print(large_table(rows, args.large, args.large_scope, args.cell_timeout))
    if fingerprints is not None:
        args.fingerprints.write_text(json.dumps(fingerprints, indent=1, sort_keys=True) + "\n")
        print(f"\nfingerprints of {len(fingerprints)} cells: {args.fingerprints}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
