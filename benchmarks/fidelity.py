"""Simulator fidelity: Mooncake's published vLLM tables (A10) against the simulator's predictions.

Every row of ``benchmarks/data/mooncake_published.csv`` (Mooncake's v0.1 and v0.2 vLLM benchmark
tables) is configured as a servematrix cell, simulated through the package API, and printed next
to the published TTFT, TPOT and ITL (mean, median, P99) with the ratio predicted / published.
The closing lines count the ratios inside the target band 0.77-1.3 (issue 3).

Setup of every row, as the published runs had it (reference/vllm-mooncake-spec.md §2, §5):

* model Qwen2.5-7B-Instruct-GPTQ-Int4 on A10-24GB GPUs, recipe ``v0`` (vLLM 0.6.x, V0 engine);
* input length = the published mean prompt length (total input tokens / 200; sonnet prompts of
  ``--sonnet-input-len 1024`` average 1011.6 tokens in v0.1 and 1010.0 in v0.2), output 6,
  200 prompts, seed 0, Poisson arrivals, one warm-up request (the client's test prompt);
* v0.1 non-disaggregated rows ran ONE instance (Mooncake issue #5), with and without
  ``--enable-chunked-prefill``; ``--gpu-memory-utilization 0.95`` (v0.1 doc commands);
* disaggregated rows: one prefill and one decode instance of the row's TP, one per node, KV over
  Mooncake's Transfer Engine (RDMA or TCP); ``--gpu-memory-utilization 0.8`` in v0.2.
* serving knobs: the v0.1 chunked row uses vLLM 0.6.2's 512-token budget
  (``max_num_batched_tokens``), v0.2 rows with TP > 1 ``enforce_eager`` (the Dec 2024 doc
  required ``--enforce-eager`` with TP), 2-NIC rows ``engine.kv_link.nics = 2``.

The calibration set also holds the Qwen2 speed tables (``calibration_qwen2_speed.csv``, the v0
host cost is fitted on them) and BLIS's H100 serving runs (`fidelity_blis`, the V1 host
constants were fitted on them); every calibration count below includes both.

Usage: ``python benchmarks/fidelity.py [--table v0.2-qps ...] [--seeds K] [--csv out.csv]``.

``--seeds K`` also re-simulates every row with seeds 0..K-1 (new Poisson arrivals and step
jitter, as a re-run of the published benchmark would draw) and reports, for each ratio outside
the band at seed 0, whether the published value lies inside the range the K runs predict: such a
miss is within the run-to-run variation of one 200-request run, not a model error.

Validation rows at a finite request rate are simulated at the send times their published runs
drew (`published_sends`: the published client's code and seed, `servematrix.workload.schedule`),
not at a fresh draw: 50 requests of one Poisson draw can arrive much more densely than another's.
For them the seeds vary only the engine's step jitter.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from fidelity_blis import blis_points, load_blis_runs
from fidelity_cross_gpu import cross_gpu_ratios, format_cross_gpu
from fidelity_knee import Sweep, format_knees, knee, validation_sweeps
from fidelity_points import (
    BAND,
    FAMILIES,
    METRICS,
    SERVE_METRICS,
    STATS,
    Point,
    format_breakdown,
    format_goals,
    format_mape,
    format_values,
    format_vs_blis,
    format_without_e2e,
    in_band,
    number,
    predict,
    ratio_text,
    write_points_csv,
)
from fidelity_tails import format_tails, spreads
from fidelity_validation import (
    CHUNKED_BUDGET_V062,
    QWEN2_CALIBRATION_CSV,
    format_host_fit,
    load_validation,
    validation_points,
)

from servematrix.results.metrics import CellMetrics
from servematrix.spec.matrix import MODES, Cell, ModelSpec, ModeSpec, Serving, Workload

PUBLISHED_CSV = Path(__file__).resolve().parent / "data" / "mooncake_published.csv"
MODEL = ModelSpec(
    name="Qwen2.5-7B-Instruct-GPTQ-Int4",
    hf_id="Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
    architecture="qwen2.5-7b",
    quantization="gptq-int4",
    tensor_parallel=1,
    gpus=((0,),),
)
GPU = "A10-24GB"
RECIPE = "v0"
OUTPUT_LEN = 6
SEED = 0
MAX_MODEL_LEN = 10000
GPU_MEMORY_UTILIZATION = {"v0.1": 0.95, "v0.2": 0.8}
"""``--gpu-memory-utilization`` of the doc commands each table was measured with."""

SINGLE_CHUNKED = ModeSpec("single-chunked", 1, False, True)
"""One instance with ``--enable-chunked-prefill``: the v0.1 chunked row (no stock mode has it)."""


@dataclass(frozen=True)
class PublishedRow:
    """One row of a published table; ``metrics_ms`` maps ``mean_ttft_ms``... to its value."""

    doc: str
    table: str
    setting: str
    nics: int | None
    tp: int
    qps: float
    input_len: int
    completed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    total_token_throughput: float
    metrics_ms: dict[str, float]

    @property
    def label(self) -> str:
        link = {"rdma": f"rdma{self.nics}nic", "tcp": "tcp"}.get(self.setting, self.setting)
        return f"{self.table} {link} tp{self.tp} q{self.qps:g} in{self.input_len}"

    @property
    def mean_input_len(self) -> int:
        """The prompt length the simulator uses: the published mean (sonnet lengths vary)."""
        return round(self.total_input_tokens / self.completed)


@dataclass(frozen=True)
class Setup:
    """How a published row is simulated. ``cell`` is None when the engine cannot express it
    (``unsupported`` says why); ``approximations`` name what is simulated only approximately."""

    row: PublishedRow
    cell: Cell | None
    approximations: tuple[str, ...] = ()
    unsupported: str | None = None


@dataclass(frozen=True)
class Comparison:
    setup: Setup
    predicted_ms: dict[str, float] = field(default_factory=dict)
    predicted_duration_s: float | None = None

    def ratio(self, metric: str) -> float | None:
        published = self.setup.row.metrics_ms[metric]
        if metric not in self.predicted_ms or published <= 0:
            return None
        return self.predicted_ms[metric] / published


def load_published(path: Path = PUBLISHED_CSV) -> list[PublishedRow]:
    """Parse the published-numbers file (``#`` lines are the provenance header)."""
    with path.open(newline="") as handle:
        lines = [line for line in handle if not line.startswith("#")]
    return [_row(record) for record in csv.DictReader(lines)]


def _row(record: dict[str, str]) -> PublishedRow:
    return PublishedRow(
        doc=record["doc"],
        table=record["table"],
        setting=record["setting"],
        nics=int(record["nics"]) if record["nics"] else None,
        tp=int(record["tp"]),
        qps=float(record["qps"]),
        input_len=int(record["input_len"]),
        completed=int(record["completed"]),
        duration_s=float(record["duration_s"]),
        total_input_tokens=int(record["total_input_tokens"]),
        total_output_tokens=int(record["total_output_tokens"]),
        request_throughput=float(record["request_throughput"]),
        total_token_throughput=float(record["total_token_throughput"]),
        metrics_ms={name: float(record[name]) for name in METRICS},
    )


def _mode(row: PublishedRow) -> ModeSpec:
    modes = {
        "nondisagg": MODES["single"],
        "chunked": SINGLE_CHUNKED,
        "rdma": MODES["mooncake-rdma"],
        "tcp": MODES["mooncake-tcp"],
    }
    try:
        return modes[row.setting]
    except KeyError:
        raise ValueError(f"{row.label}: unknown setting {row.setting!r}") from None


def _gpus(tp: int, instances: int) -> tuple[tuple[int, ...], ...]:
    """One GPU group per instance. Disaggregated instances ran on two nodes; distinct ids here
    only keep the pins distinct (the simulator does not use them)."""
    return tuple(tuple(range(i * tp, (i + 1) * tp)) for i in range(instances))


APPROXIMATIONS = {
    "2nic": "2 RDMA NICs: engine.kv_link.nics = 2 doubles the wire bandwidth; the per-rank CPU "
    "chain of the v0 connector, which dominates, is unchanged (docs/engine-model.md)",
}
"""Codes (printed per row) of what a setup can only approximate, and what each means."""


def _approximations(row: PublishedRow) -> tuple[str, ...]:
    return ("2nic",) if row.nics == 2 else ()


def _serving(row: PublishedRow) -> Serving:
    """The doc commands' flags: the Dec 2024 v0.2 doc required ``--enforce-eager`` with TP
    (spec §2.2), and v0.1's chunked row ran vLLM 0.6.2's 512-token budget."""
    budget = CHUNKED_BUDGET_V062 if row.doc == "v0.1" and row.setting == "chunked" else None
    return Serving(
        MAX_MODEL_LEN,
        GPU_MEMORY_UTILIZATION[row.doc],
        max_num_batched_tokens=budget,
        enforce_eager=row.doc == "v0.2" and row.tp > 1,
    )


def _engine(row: PublishedRow) -> dict[str, object]:
    engine: dict[str, object] = {"gpu": GPU}
    if row.nics == 2:
        engine["kv_link"] = {"nics": 2}
    return engine


def setup_for(row: PublishedRow) -> Setup:
    """The servematrix cell of one published row."""
    mode = _mode(row)
    model = ModelSpec(
        name=MODEL.name,
        hf_id=MODEL.hf_id,
        architecture=MODEL.architecture,
        quantization=MODEL.quantization,
        tensor_parallel=row.tp,
        gpus=_gpus(row.tp, mode.instances),
    )
    workload = Workload(
        qps=row.qps,
        input_len=row.mean_input_len,
        output_len=OUTPUT_LEN,
        num_prompts=row.completed,
        seed=SEED,
        # Sonnet prompts of the published mean length: fixed-length token prompts are the same
        # load for a V0 engine without prefix caching (no sonnet text is needed).
        dataset="random",
        burstiness=1.0,
        warmup_requests=1,
    )
    cell = Cell(
        backend="simulator",
        recipe=RECIPE,
        model=model,
        mode=mode,
        workload=workload,
        serving=_serving(row),
        engine=_engine(row),
    )
    return Setup(row, cell, _approximations(row))


def compare(setups: Iterable[Setup]) -> list[Comparison]:
    """Simulate every configurable setup once (identical cells share one simulation)."""
    cache: dict[str, CellMetrics] = {}
    comparisons = []
    for setup in setups:
        if setup.cell is None:
            comparisons.append(Comparison(setup))
            continue
        key = json.dumps(setup.cell.to_dict(), sort_keys=True)
        if key not in cache:
            cache[key] = predict(setup.cell)
        metrics = cache[key]
        predicted = {name: getattr(metrics, name) for name in METRICS}
        comparisons.append(Comparison(setup, predicted, metrics.duration_s))
    return comparisons


def reseeded(setups: Sequence[Setup], seed: int) -> list[Setup]:
    """The simulated setups with the workload's seed replaced (new arrivals and step jitter)."""
    return [
        replace(s, cell=replace(s.cell, workload=replace(s.cell.workload, seed=seed)))
        for s in setups
        if s.cell is not None
    ]


Ranges = dict[str, dict[str, tuple[float, float]]]
"""Per row label and metric: the (lowest, highest) prediction over several runs."""


def prediction_range(runs: Sequence[Sequence[Comparison]]) -> Ranges:
    """Per row label and metric: the (lowest, highest) prediction over several runs."""
    ranges: Ranges = {}
    for run in runs:
        for comparison in run:
            row_ranges = ranges.setdefault(comparison.setup.row.label, {})
            for metric, value in comparison.predicted_ms.items():
                low, high = row_ranges.get(metric, (value, value))
                row_ranges[metric] = (min(low, value), max(high, value))
    return ranges


def format_family(comparisons: Sequence[Comparison], family: str) -> list[str]:
    """One line per published row: predicted, published and ratio of mean/median/P99."""
    width = max(len(c.setup.row.label) for c in comparisons)
    head = f"{'row':<{width}} |" + "|".join(f" {stat:>6} pred {'publ':>6} ratio " for stat in STATS)
    lines = [f"== {family.upper()} (ms): predicted, published, ratio (! = outside band)", head]
    for comparison in comparisons:
        row = comparison.setup.row
        if comparison.setup.cell is None:
            lines.append(f"{row.label:<{width}} | not simulated: {comparison.setup.unsupported}")
            continue
        parts = []
        for stat in STATS:
            metric = f"{stat}_{family}_ms"
            predicted = number(comparison.predicted_ms[metric])
            published = number(row.metrics_ms[metric])
            parts.append(f" {predicted:>11} {published:>6} {ratio_text(comparison.ratio(metric))}")
        mark = " ~" if comparison.setup.approximations else ""
        lines.append(f"{row.label:<{width}} |" + "|".join(parts) + mark)
    return lines


def format_setups(comparisons: Sequence[Comparison]) -> list[str]:
    """The configured cell of each row, with the benchmark duration as a saturation check."""
    width = max(len(c.setup.row.label) for c in comparisons)
    lines = [
        "== Setups (Qwen2.5-7B-Instruct-GPTQ-Int4, A10-24GB, recipe v0, out 6, 200 prompts, "
        "seed 0); duration s predicted / published",
        f"{'row':<{width}} | {'mode':<14} inst  tp   in  gmu  {'dur pred/publ':>14}  notes",
    ]
    for comparison in comparisons:
        setup, row = comparison.setup, comparison.setup.row
        if setup.cell is None:
            lines.append(f"{row.label:<{width}} | not simulated: {setup.unsupported}")
            continue
        cell = setup.cell
        duration = f"{comparison.predicted_duration_s:.1f}/{row.duration_s:.1f}"
        lines.append(
            f"{row.label:<{width}} | {cell.mode.name:<14} {cell.mode.instances:>4} "
            f"{cell.model.tensor_parallel:>3} {cell.workload.input_len:>4} "
            f"{cell.serving.gpu_memory_utilization:>4} {duration:>14}  "
            + ",".join(setup.approximations)
        )
    lines += [f"  ~{code}: {text}" for code, text in APPROXIMATIONS.items()]
    return lines


def format_counts(comparisons: Sequence[Comparison]) -> list[str]:
    """How many ratios fall in the band: overall, per metric, and on exactly-configured rows."""
    simulated = [c for c in comparisons if c.setup.cell is not None]
    exact = [c for c in simulated if not c.setup.approximations]

    def count(subset: Sequence[Comparison], metrics: Sequence[str]) -> str:
        ratios = [c.ratio(m) for c in subset for m in metrics]
        ratios = [r for r in ratios if r is not None]
        inside = sum(in_band(r) for r in ratios)
        share = 100 * inside / len(ratios) if ratios else 0.0
        return f"{inside}/{len(ratios)} ({share:.0f} %)"

    low, high = BAND
    lines = [
        f"== Ratios predicted/published within {low}-{high}",
        f"all {len(simulated)} simulated rows: {count(simulated, METRICS)}",
        f"{len(exact)} rows without approximations (~): {count(exact, METRICS)}",
        f"not simulated: {len(comparisons) - len(simulated)} rows",
    ]
    for metric in METRICS:
        lines.append(f"  {metric:<16} {count(simulated, [metric])}")
    for table in dict.fromkeys(c.setup.row.table for c in simulated):
        rows = [c for c in simulated if c.setup.row.table == table]
        lines.append(f"  table {table:<12} {count(rows, METRICS)}")
    return lines


def count_in_band(comparisons: Sequence[Comparison]) -> int:
    return sum(in_band(c.ratio(metric)) for c in comparisons for metric in METRICS)


def format_spread(runs: Sequence[Sequence[Comparison]]) -> list[str]:
    """Each ratio outside the band in the first run (seed 0), with its range over all runs; ``*``
    marks a published value inside the predicted range (a miss within run-to-run variation)."""
    comparisons, seeds = runs[0], len(runs)
    spread = prediction_range(runs)
    width = max(len(c.setup.row.label) for c in comparisons)
    lines = [
        f"== Run-to-run spread over seeds 0..{seeds - 1}: ratios outside the band at seed 0, "
        "with their range over the seeds (* = published value inside the predicted range)"
    ]
    misses = within = 0
    for comparison in comparisons:
        row = comparison.setup.row
        parts = []
        for metric in METRICS:
            ratio = comparison.ratio(metric)
            if ratio is None or in_band(ratio):
                continue
            low, high = spread[row.label][metric]
            published = row.metrics_ms[metric]
            inside = low <= published <= high
            misses += 1
            within += inside
            parts.append(
                f"{metric.removesuffix('_ms')} {ratio:.2f} "
                f"[{low / published:.2f}-{high / published:.2f}]{'*' if inside else ''}"
            )
        if parts:
            lines.append(f"{row.label:<{width}} | " + ", ".join(parts))
    counts = [count_in_band(run) for run in runs]
    lines += [
        f"outside the band at seed 0: {misses}; published value inside the range of "
        f"{seeds} seeds: {within}",
        f"ratios in band per seed: {', '.join(map(str, counts))} "
        f"(median {statistics.median(counts):g} of {len(METRICS) * len(comparisons)})",
    ]
    return lines


def calibration_regime(row: PublishedRow) -> str:
    """Saturated when the published run outlasted its arrivals by more than 10 % (the queue
    drained after the last send), else moderate."""
    return "saturated" if row.duration_s > 1.1 * row.completed / row.qps else "moderate"


def calibration_points(runs: Sequence[Sequence[Comparison]]) -> list[Point]:
    points = []
    for index, comparison in enumerate(runs[0]):
        row = comparison.setup.row
        if comparison.setup.cell is None:
            continue
        for metric in METRICS:
            predicted = tuple(run[index].predicted_ms[metric] for run in runs)
            points.append(
                Point(
                    "calibration",
                    f"mooncake-{row.doc}",
                    calibration_regime(row),
                    GPU,
                    row.label,
                    metric,
                    row.metrics_ms[metric],
                    predicted,
                )
            )
    return points


def mooncake_sweeps(rows: Sequence[PublishedRow]) -> list[Sweep]:
    """The published rows of one table and setting at several request rates (v0.1-in256 and
    v0.2-qps), each rate simulated as the row of the highest rate at or below it."""
    groups: dict[tuple[object, ...], list[PublishedRow]] = {}
    for row in rows:
        key = (row.table, row.setting, row.nics, row.tp, row.input_len)
        groups.setdefault(key, []).append(row)
    sweeps = []
    for group in groups.values():
        group.sort(key=lambda row: row.qps)
        if len({row.qps for row in group}) < 2:
            continue
        label = f"mooncake-{group[0].doc} {group[0].label.rsplit(' q', 1)[0]}"
        rates = tuple(row.qps for row in group)
        ttft = tuple(row.metrics_ms["mean_ttft_ms"] for row in group)
        sweeps.append(Sweep("calibration", label, rates, ttft, partial(_mooncake_ttft, group)))
    return sweeps


def _mooncake_ttft(group: Sequence[PublishedRow], rate: float) -> float:
    template = [row for row in group if row.qps <= rate][-1]
    return predict(setup_for(replace(template, qps=rate)).cell).mean_ttft_ms


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--set",
        choices=("calibration", "validation", "both"),
        default="both",
        help="which published set to compare (default both, reported separately)",
    )
    parser.add_argument("--table", action="append", help="only this calibration table (repeatable)")
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        metavar="K",
        help="also simulate seeds 0..K-1 and report run-to-run spread of the misses",
    )
    parser.add_argument("--csv", type=Path, help="also write the comparison here (long format)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    blocks: list[list[str]] = []
    points: list[Point] = []
    if args.set in ("calibration", "both"):
        rows = load_published()
        if args.table:
            unknown = set(args.table) - {row.table for row in rows}
            if unknown:
                parser.error(f"unknown table(s) {sorted(unknown)}")
            rows = [row for row in rows if row.table in args.table]
        setups = [setup_for(row) for row in rows]
        comparisons = compare(setups)
        blocks.append(["#### CALIBRATION set: Mooncake's A10 tables (the v0 KV-chain constants "
                       "were fitted on these)"])  # fmt: skip
        blocks.append(format_setups(comparisons))
        blocks += [format_family(comparisons, family) for family in FAMILIES]
        blocks.append(format_counts(comparisons))
        runs = [comparisons]
        if args.seeds > 1:
            runs += [compare(reseeded(setups, seed)) for seed in range(1, args.seeds)]
            blocks.append(format_spread(runs))
        calibration = calibration_points(runs)
        qwen2_runs = [] if args.table else load_validation(QWEN2_CALIBRATION_CSV)
        qwen2, qwen2_skipped = validation_points(qwen2_runs, args.seeds, "calibration")
        if qwen2_runs:
            blocks.append(
                format_values(qwen2, qwen2_skipped, args.seeds, "CALIBRATION qwen2-speed")
            )
            blocks.append(format_host_fit(qwen2_runs))
        calibration += qwen2
        blis_runs = [] if args.table else load_blis_runs()
        blis, blis_skipped = blis_points(blis_runs, args.seeds)
        if blis_runs:
            title = "CALIBRATION blis-h100 (the V1 host constants were fitted on these)"
            blocks.append(format_values(blis, blis_skipped, args.seeds, title))
        calibration += blis
        points += calibration
        blocks.append(format_breakdown(calibration, args.seeds, "CALIBRATION"))
        blocks.append(format_mape(calibration, "CALIBRATION"))
        blocks.append(format_knees([knee(sweep) for sweep in mooncake_sweeps(rows)]))
        blocks.append(format_tails(spreads(calibration), args.seeds))
    if args.set in ("validation", "both"):
        runs = load_validation()
        validation, skipped = validation_points(runs, args.seeds)
        points += validation
        blocks.append(["#### VALIDATION set: other public vLLM results (out of sample)"])
        title = "VALIDATION values (never used to fit or choose a model variant)"
        blocks.append(format_values(validation, skipped, args.seeds, title))
        blocks.append(format_breakdown(validation, args.seeds, "VALIDATION"))
        blocks.append(format_without_e2e(validation))
        blocks.append(format_mape(validation, "VALIDATION"))
        blocks.append(format_knees([knee(sweep) for sweep in validation_sweeps(runs)]))
        blocks.append(format_tails(spreads(validation), args.seeds))
        blocks.append(format_vs_blis([p for p in validation if p.metric in SERVE_METRICS]))
        blocks.append(format_goals(validation))
        blocks.append(format_cross_gpu(cross_gpu_ratios(runs, validation)))
    print("\n\n".join("\n".join(block) for block in blocks))
    if args.csv:
        write_points_csv(points, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
