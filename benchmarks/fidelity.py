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

Usage: ``python benchmarks/fidelity.py [--table v0.2-qps ...] [--seeds K] [--csv out.csv]``.

``--seeds K`` also re-simulates every row with seeds 0..K-1 (new Poisson arrivals and step
jitter, as a re-run of the published benchmark would draw) and reports, for each ratio outside
the band at seed 0, whether the published value lies inside the range the K runs predict: such a
miss is within the run-to-run variation of one 200-request run, not a model error.

Validation rows at a finite request rate are simulated at the send times their published runs
drew (`published_sends`: the published client's code and seed, `servematrix.schedule`), not at a
fresh draw: 50 requests of one Poisson draw can arrive much more densely than another's. For
them the seeds vary only the engine's step jitter.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from servematrix import schedule
from servematrix.cell import identity
from servematrix.matrix import MODES, Cell, ModelSpec, ModeSpec, Serving, Workload
from servematrix.metrics import CellMetrics, compute
from servematrix.simulate import simulate
from servematrix.trace import to_table

PUBLISHED_CSV = Path(__file__).resolve().parent / "data" / "mooncake_published.csv"
BAND = (0.77, 1.3)
FAMILIES = ("ttft", "tpot", "itl")
STATS = ("mean", "median", "p99")
METRICS = tuple(f"{stat}_{family}_ms" for family in FAMILIES for stat in STATS)
SERVE_METRICS = (*METRICS, *(f"{stat}_e2el_ms" for stat in STATS))
"""What a simulated ``serve`` row can be compared on: Mooncake's tables publish no E2E
latency, the spot check's per-request data give it (``validation_published.csv`` header)."""

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


CHUNKED_BUDGET_V062 = 512
"""v0.1 ran vLLM 0.6.2 (mooncake-integration branch), whose chunked-prefill token budget is 512
(2048 only from vLLM PR #10544, v0.6.5): ``max_num_batched_tokens`` of the v0.1 chunked row."""

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


def predict(cell: Cell, send_times_s: Sequence[float] | None = None) -> CellMetrics:
    """Simulate one cell (at ``send_times_s`` if given) and compute the client's metrics."""
    result = simulate(cell, send_times_s=send_times_s)
    return compute(to_table(identity(cell), result.records, {}))


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


def in_band(ratio: float | None) -> bool:
    return ratio is not None and BAND[0] <= ratio <= BAND[1]


def _number(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}"


def _ratio_text(ratio: float | None) -> str:
    if ratio is None:
        return "  -  "
    return f"{ratio:5.2f}{' ' if in_band(ratio) else '!'}"


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
            predicted = _number(comparison.predicted_ms[metric])
            published = _number(row.metrics_ms[metric])
            parts.append(f" {predicted:>11} {published:>6} {_ratio_text(comparison.ratio(metric))}")
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


# --- Validation set -------------------------------------------------------------------------

VALIDATION_CSV = PUBLISHED_CSV.parent / "validation_published.csv"
QWEN2_CALIBRATION_CSV = PUBLISHED_CSV.parent / "calibration_qwen2_speed.csv"
"""Calibration rows in the validation file's format: the v0 host step cost is fitted on them."""
REGIMES = ("low", "moderate", "saturated")
THROUGHPUT_METRICS = ("speed_tokens_per_s", "request_throughput_per_s")
"""Metrics where higher is better; the ratio is still predicted / published."""
SETUP_COLUMNS = (
    "source", "row", "gpu", "model", "architecture", "quantization", "tp", "vllm", "recipe",
    "interface", "dataset", "input_len", "output_len", "num_prompts", "request_rate",
    "max_concurrency", "max_model_len", "gpu_memory_utilization", "enforce_eager",
    "prefix_caching", "regime", "note",
)  # fmt: skip


@dataclass(frozen=True)
class ValidationRun:
    """One published setup of the validation set and the values published for it."""

    source: str
    row: str
    gpu: str
    model: str
    architecture: str
    quantization: str
    tp: int
    vllm: str
    recipe: str
    interface: str  # "offline-llm" | "serve"
    dataset: str
    input_len: int
    output_len: int
    num_prompts: int
    request_rate: float | None
    max_concurrency: int | None
    max_model_len: int
    gpu_memory_utilization: float
    enforce_eager: bool
    prefix_caching: bool
    regime: str
    note: str
    published: dict[str, float]

    @property
    def label(self) -> str:
        return f"{self.source} {self.row}"

    @property
    def vllm_version(self) -> tuple[int, ...]:
        return tuple(int(part) for part in self.vllm.split("."))


def load_validation(path: Path = VALIDATION_CSV) -> list[ValidationRun]:
    """Parse the validation file (``#`` lines are the provenance header); lines with the same
    setup are one run with several published metrics."""
    with path.open(newline="") as handle:
        lines = [line for line in handle if not line.startswith("#")]
    runs: dict[tuple[str, ...], ValidationRun] = {}
    for record in csv.DictReader(lines):
        key = tuple(record[column] for column in SETUP_COLUMNS)
        if key not in runs:
            runs[key] = ValidationRun(
                source=record["source"],
                row=record["row"],
                gpu=record["gpu"],
                model=record["model"],
                architecture=record["architecture"],
                quantization=record["quantization"],
                tp=int(record["tp"]),
                vllm=record["vllm"],
                recipe=record["recipe"],
                interface=record["interface"],
                dataset=record["dataset"],
                input_len=int(record["input_len"]),
                output_len=int(record["output_len"]),
                num_prompts=int(record["num_prompts"]),
                request_rate=float(record["request_rate"]) if record["request_rate"] else None,
                max_concurrency=(
                    int(record["max_concurrency"]) if record["max_concurrency"] else None
                ),
                max_model_len=int(record["max_model_len"]),
                gpu_memory_utilization=float(record["gpu_memory_utilization"]),
                enforce_eager=record["enforce_eager"] == "true",
                prefix_caching=record["prefix_caching"] == "true",
                regime=record["regime"],
                note=record["note"],
                published={},
            )
        runs[key].published[record["metric"]] = float(record["value"])
    return list(runs.values())


def validation_unsupported(run: ValidationRun) -> str | None:
    """Why a published setup cannot be simulated as stated, or None."""
    if run.input_len + run.output_len > run.max_model_len:
        return (
            f"published max_model_len {run.max_model_len} < input {run.input_len} + output "
            f"{run.output_len}: the stated setup cannot have run (inconsistent source row)"
        )
    if run.interface not in ("offline-llm", "serve"):
        return f"unknown interface {run.interface!r}"
    return None


def _v0_chunked_budget(run: ValidationRun) -> int | None:
    """vLLM < 0.6.5 chunks prefills in 512-token pieces (PR #10544 raised it to 2048); V0
    turns chunking on by itself above max_model_len 32768."""
    if run.recipe == "v0" and run.max_model_len > 32768 and run.vllm_version < (0, 6, 5):
        return CHUNKED_BUDGET_V062
    return None


def predict_validation(run: ValidationRun, seed: int) -> dict[str, float]:
    """The simulator's value of every metric the run publishes."""
    if run.interface == "offline-llm":
        return _predict_offline(run, seed)
    return _predict_serve(run, seed)


def _offline_setup(run: ValidationRun, **overrides: Any) -> Any:
    """The engine of a validation run's one instance (``build_engine_setup`` with the run's
    model, GPU and serving settings; ``overrides`` add or replace keyword arguments)."""
    from servematrix.engine.setup import build_engine_setup

    settings = {
        "quantization": run.quantization,
        "tensor_parallel": run.tp,
        "recipe": run.recipe,
        "chunked_prefill": None,
        "max_model_len": run.max_model_len,
        "gpu_memory_utilization": run.gpu_memory_utilization,
        "gpu": run.gpu,
        "enforce_eager": run.enforce_eager,
        "prefix_caching": run.prefix_caching,
    }
    return build_engine_setup(run.architecture, **{**settings, **overrides})


def _predict_offline(run: ValidationRun, seed: int) -> dict[str, float]:
    """``LLM.generate([prompt])`` timed around the call: one request through one instance, no
    HTTP server or client in the path."""
    from servematrix.engine.scheduler import Request

    instance = _offline_setup(run, max_num_batched_tokens=_v0_chunked_budget(run)).instance(seed)
    instance.add_request(Request(0, run.input_len, run.output_len))
    elapsed_s = 0.0
    while instance.has_work():
        decodes = instance.decode_run(float("inf"))
        if decodes is not None:
            elapsed_s += decodes.step_ends_s[-1]
        else:
            elapsed_s += instance.step().duration_s
    return {"speed_tokens_per_s": run.output_len / elapsed_s}


def _predict_serve(run: ValidationRun, seed: int) -> dict[str, float]:
    """An OpenAI server and ``vllm bench serve`` (one warm-up request, then the run), with the
    client's ``--max-concurrency`` cap. A ``sharegpt`` run is simulated at its published mean
    prompt and output lengths (the row's note says so): the simulator has no ShareGPT copy."""
    model = ModelSpec(
        name=run.model.split("/")[-1],
        hf_id=run.model,
        architecture=run.architecture,
        quantization=run.quantization,
        tensor_parallel=run.tp,
        gpus=(tuple(range(run.tp)),),
    )
    workload = Workload(
        qps=run.request_rate if run.request_rate is not None else float("inf"),
        input_len=run.input_len,
        output_len=run.output_len,
        num_prompts=run.num_prompts,
        seed=seed,
        dataset="random" if run.dataset == "sharegpt" else run.dataset,
        burstiness=1.0,
        warmup_requests=1,
        max_concurrency=run.max_concurrency,
    )
    cell = Cell(
        backend="simulator",
        recipe=run.recipe,
        model=model,
        mode=MODES["single"],
        workload=workload,
        serving=Serving(
            run.max_model_len,
            run.gpu_memory_utilization,
            enforce_eager=run.enforce_eager,
            prefix_caching=run.prefix_caching,
        ),
        engine={"gpu": run.gpu},
    )
    schedules = published_sends(run)
    if schedules is None:
        runs = [predict(cell)]
    else:
        runs = [predict(cell, send_times_s=sends) for sends in schedules]
    values = {name: statistics.fmean(getattr(m, name) for m in runs) for name in SERVE_METRICS}
    values["request_throughput_per_s"] = statistics.fmean(m.request_throughput for m in runs)
    return values


PUBLISHED_CLIENT_SEEDS = {"vllm-spotcheck": (0,), "kvcached-h100": (42, 99, 7)}
"""The client's ``--seed`` of each source's finite-rate runs: the spot check ran
``benchmark_serving.py`` at its default seed, kvcached's sweep three seeds whose means it
published (``benchmarks/bench_layout/run_sweep.sh``)."""

QWEN2_TOKENIZER_VOCAB_SIZE = 151643
"""``vocab_size`` of QwQ-32B's Qwen2 tokenizer (its regular tokens, without the added special
ones), below which vLLM 0.8's random dataset draws its offsets. With it the reconstructed sends
of the spot check's 1,000/2,000 H100 run put its last request's end (send + published TTFT +
ITLs) at 47.68 s against the published duration of 47.71 s."""


def published_sends(run: ValidationRun) -> list[Sequence[float]] | None:
    """The send times each published run of a finite-rate ``serve`` row drew, from its client's
    code and seed (`servematrix.schedule`): the published input, not a fresh Poisson draw.
    None when every request goes at t = 0 (rate inf, with or without a concurrency cap).
    Raises ValueError for a finite-rate row whose client is not reconstructed."""
    if run.request_rate is None or run.request_rate == float("inf"):
        return None
    seeds = PUBLISHED_CLIENT_SEEDS.get(run.source)
    n, qps = run.num_prompts, run.request_rate
    if seeds is not None and run.vllm == "0.8.2" and run.dataset == "random":
        return [
            schedule.benchmark_serving_08_sends(
                n, qps, seed, run.input_len, run.output_len, QWEN2_TOKENIZER_VOCAB_SIZE
            )
            for seed in seeds
        ]
    if seeds is not None and run.vllm == "0.19.0" and run.dataset == "random":
        return [schedule.bench_serve_019_sends(n, qps, seed) for seed in seeds]
    raise ValueError(f"{run.label}: no reconstruction of vLLM {run.vllm}'s client schedule")


@dataclass(frozen=True)
class Point:
    """One published value and the simulator's value of it at each seed (seed 0 first)."""

    set_name: str  # "calibration" | "validation"
    source: str
    regime: str
    gpu: str
    label: str
    metric: str
    published: float
    predicted: tuple[float, ...]

    @property
    def ratio(self) -> float:
        return self.predicted[0] / self.published

    @property
    def ratio_range(self) -> tuple[float, float]:
        return min(self.predicted) / self.published, max(self.predicted) / self.published

    def in_band_at(self, seed_index: int) -> bool:
        return in_band(self.predicted[seed_index] / self.published)


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


def validation_points(
    runs: Sequence[ValidationRun], seeds: int, set_name: str = "validation"
) -> tuple[list[Point], list[tuple[ValidationRun, str]]]:
    """Simulate every supported run at seeds 0..seeds-1; also the runs left out, with why."""
    points: list[Point] = []
    skipped: list[tuple[ValidationRun, str]] = []
    for run in runs:
        why = validation_unsupported(run)
        if why is None:
            try:
                predictions = [predict_validation(run, seed) for seed in range(seeds)]
            except (ValueError, RuntimeError) as error:  # e.g. the model does not fit
                why = f"{type(error).__name__}: {error}"
        if why is not None:
            skipped.append((run, why))
            continue
        for metric, published in run.published.items():
            predicted = tuple(prediction[metric] for prediction in predictions)
            points.append(
                Point(
                    set_name,
                    run.source,
                    run.regime,
                    run.gpu,
                    run.label,
                    metric,
                    published,
                    predicted,
                )
            )
    return points, skipped


def _share(points: Sequence[Point], seed_index: int = 0) -> tuple[int, int]:
    return sum(p.in_band_at(seed_index) for p in points), len(points)


def _share_text(points: Sequence[Point], seeds: int) -> str:
    inside, total = _share(points)
    text = f"{inside:>4}/{total:<4} {100 * inside / total:5.1f} %" if total else "   -"
    if seeds > 1 and total:
        per_seed = [_share(points, k)[0] for k in range(seeds)]
        median = statistics.median(per_seed)
        text += f"  seeds {min(per_seed)}-{max(per_seed)} (median {median:g}, "
        text += f"{100 * median / total:.0f} %)"
    return text


def _regime_shares(points: Sequence[Point], seeds: int) -> list[str]:
    """The in-band share overall and per regime."""
    lines = [f"{'all':<52} {_share_text(points, seeds)}"]
    for regime in REGIMES:
        subset = [p for p in points if p.regime == regime]
        if subset:
            lines.append(f"{'  regime ' + regime:<52} {_share_text(subset, seeds)}")
    return lines


def format_breakdown(points: Sequence[Point], seeds: int, title: str) -> list[str]:
    """In-band share per source, regime and metric, and overall (seed 0; seed range with
    ``--seeds``)."""
    low, high = BAND
    lines = [f"== {title}: ratios predicted/published within {low}-{high} (seed 0)"]
    if not points:
        return [*lines, "no simulated values"]
    lines += _regime_shares(points, seeds)
    groups: dict[tuple[str, str, str], list[Point]] = {}
    for point in points:
        groups.setdefault((point.source, point.regime, point.metric), []).append(point)
    for (source, regime, metric), subset in groups.items():
        ratios = sorted(p.ratio for p in subset)
        median = statistics.median(ratios)
        name = f"  {source} / {regime} / {metric}"
        lines.append(
            f"{name:<52} {_share_text(subset, seeds)}  ratio median {median:.2f} "
            f"[{ratios[0]:.2f}-{ratios[-1]:.2f}]"
        )
    return lines


def mape_percent(points: Sequence[Point]) -> float:
    """Mean absolute percentage error of the seed-0 predictions."""
    return 100 * statistics.fmean(abs(p.ratio - 1) for p in points)


def format_mape(points: Sequence[Point], title: str) -> list[str]:
    """MAPE and in-band share per regime and GPU, overall and per metric (seed 0): the table
    the issue compares with the best published simulator's figures."""
    low, high = BAND
    lines = [
        f"== {title}: MAPE and share of ratios within {low}-{high} per regime and GPU (seed 0)"
    ]
    lines.append(
        f"{'regime':<10} {'gpu':<16} {'metric':<26} {'values':>6} {'in band':>8} {'MAPE':>8}"
    )
    groups: dict[tuple[str, str], list[Point]] = {}
    for point in points:
        groups.setdefault((point.regime, point.gpu), []).append(point)
    for (regime, gpu), subset in sorted(
        groups.items(), key=lambda item: (REGIMES.index(item[0][0]), item[0][1])
    ):
        by_metric: dict[str, list[Point]] = {"all": subset}
        for point in subset:
            by_metric.setdefault(point.metric, []).append(point)
        for metric, group in by_metric.items():
            inside, total = _share(group)
            lines.append(
                f"{regime:<10} {gpu:<16} {metric:<26} {total:>6} {100 * inside / total:>7.1f}% "
                f"{mape_percent(group):>7.1f}%"
            )
    return lines


BLIS_MEDIAN_MAPE_PERCENT = {"ttft": 17.6, "itl": 7.1, "e2el": 6.7}
"""The best published vLLM simulator's median MAPE over its 36 held-out experiments (BLIS, "how
BLIS learns latency", inference-sim), as issue 19 quotes it: its own runs, not these."""
BLIS_ISSUE_ROWS_MAPE_PERCENT = {
    "mean_ttft_ms": 15.1, "p99_ttft_ms": 47.8, "mean_tpot_ms": 8.7, "mean_e2el_ms": 7.5,
}  # fmt: skip
"""BLIS's MAPE on the held-out moderate-load vLLM 0.15 runs issue 19 was filed with (18.5 % over
all their metrics, 82 % in band): other runs again, held out from this project."""


def format_without_e2e(points: Sequence[Point]) -> list[str]:
    """The in-band counts without the E2E values: the spot check's fixed output lengths make its
    mean E2E TTFT + (output − 1) × TPOT, so those values mostly restate two counted already."""
    rest = [p for p in points if "_e2el_" not in p.metric]
    title = f"== VALIDATION without E2E latency ({len(points) - len(rest)} values left out)"
    return [title, *_regime_shares(rest, 1)]


def _percent(value: float | None, width: int) -> str:
    return f"{value:>{width - 1}.1f}%" if value is not None else f"{'-':>{width}}"


def format_vs_blis(points: Sequence[Point]) -> list[str]:
    """Per latency family and metric over the ``serve`` values: count, in-band share, MAPE, the
    median of the values' errors (one value per run and metric: BLIS's median over experiments),
    the moderate-load MAPE, and BLIS's published figures beside them. BLIS's figures are on other
    runs: a side-by-side, not a like-for-like score."""
    lines = [
        "== VALIDATION latency metrics next to the best published simulator's figures (seed 0; "
        "BLIS's are on its own held-out runs, not these)",
        f"{'metric':<16} {'values':>6} {'in band':>8} {'MAPE':>7} {'median':>7} {'moderate':>9} "
        f"{'BLIS 36 runs':>12} {'BLIS issue rows':>15}",
    ]
    for family in (*FAMILIES, "e2el"):
        metrics = [f"{stat}_{family}_ms" for stat in STATS]
        for name in (f"{family} (all)", *metrics):
            wanted = metrics if name.endswith("(all)") else [name]
            group = [p for p in points if p.metric in wanted]
            if not group:
                continue
            inside, total = _share(group)
            moderate = [p for p in group if p.regime == "moderate"]
            median = statistics.median(100 * abs(p.ratio - 1) for p in group)
            blis = BLIS_MEDIAN_MAPE_PERCENT.get(family) if name == f"mean_{family}_ms" else None
            lines.append(
                f"{name:<16} {total:>6} {100 * inside / total:>7.1f}% "
                f"{_percent(mape_percent(group), 7)} {_percent(median, 7)} "
                f"{_percent(mape_percent(moderate) if moderate else None, 9)} "
                f"{_percent(blis, 12)} {_percent(BLIS_ISSUE_ROWS_MAPE_PERCENT.get(name), 15)}"
            )
    return lines


def format_values(points: Sequence[Point], skipped, seeds: int, title: str) -> list[str]:
    """One line per value: published, predicted (seed 0), ratio, seed range."""
    lines = [
        f"== {title}: published, predicted at seed 0, ratio (! = outside band)"
        + (f", ratio range over {seeds} seeds (* = published inside it)" if seeds > 1 else "")
    ]
    width = max((len(p.label) for p in points), default=10)
    for point in points:
        low, high = point.ratio_range
        spread = ""
        if seeds > 1:
            inside = min(point.predicted) <= point.published <= max(point.predicted)
            spread = f"  [{low:.2f}-{high:.2f}]{'*' if inside else ''}"
        lines.append(
            f"{point.label:<{width}} {point.metric:<24} {_number(point.published):>7} "
            f"{_number(point.predicted[0]):>7} {_ratio_text(point.ratio)}{spread}"
        )
    for run, why in skipped:
        lines.append(f"{run.label:<{width}} not simulated ({len(run.published)} values): {why}")
    return lines


def implied_host_step_ms(run: ValidationRun) -> float:
    """The host cost per step that would make a batch-1 offline row match exactly: published
    time minus the GPU steps, over the number of steps (v0 has no per-request part)."""
    from servematrix.engine.host import host_cost
    from servematrix.engine.scheduler import Request

    instance = _offline_setup(run, jitter_cv=0.0).instance(0)
    instance.add_request(Request(0, run.input_len, run.output_len))
    elapsed_ms = 0.0
    while instance.has_work():
        elapsed_ms += instance.step().duration_s * 1e3
    cost = host_cost(run.recipe, run.enforce_eager)
    gpu_ms = elapsed_ms - instance.steps * (cost.step_ms + cost.per_seq_ms)
    published_ms = run.output_len / run.published["speed_tokens_per_s"] * 1e3
    return (published_ms - gpu_ms) / instance.steps


HOST_FIT_ROWS = ("0.5B BF16 tp1 in1", "1.5B BF16 tp1 in1", "7B BF16 tp1 in1")
"""Where the v0 host cost is fitted: bf16 (no quantized-kernel uncertainty), one GPU, the
shortest input (no attention), so the step is as well known as it gets and the rest is host."""


def format_host_fit(runs: Sequence[ValidationRun]) -> list[str]:
    """The v0 host step cost each fitting row implies, their median, and the constant in use."""
    from servematrix.engine.host import host_cost

    fits = {run.row: implied_host_step_ms(run) for run in runs if run.row in HOST_FIT_ROWS}
    lines = ["== v0 host cost per step implied by the qwen2-speed rows it is fitted on (ms)"]
    lines += [f"  {row:<20} {value:.2f}" for row, value in fits.items()]
    lines.append(
        f"  median {statistics.median(fits.values()):.2f}; in use "
        f"(servematrix.engine.host): {host_cost('v0').step_ms:.2f}"
    )
    return lines


def write_points_csv(points: Sequence[Point], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["set", "source", "regime", "row", "metric", "published", "predicted_seed0",
                         "ratio", "ratio_min", "ratio_max"])  # fmt: skip
        for p in points:
            low, high = p.ratio_range
            ratios = (f"{p.ratio:.4f}", f"{low:.4f}", f"{high:.4f}")
            writer.writerow([p.set_name, p.source, p.regime, p.label, p.metric, p.published,
                             p.predicted[0], *ratios])  # fmt: skip


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
        points += calibration
        blocks.append(format_breakdown(calibration, args.seeds, "CALIBRATION"))
        blocks.append(format_mape(calibration, "CALIBRATION"))
    if args.set in ("validation", "both"):
        validation, skipped = validation_points(load_validation(), args.seeds)
        points += validation
        blocks.append(["#### VALIDATION set: other public vLLM results (out of sample)"])
        title = "VALIDATION values (never used to fit or choose a model variant)"
        blocks.append(format_values(validation, skipped, args.seeds, title))
        blocks.append(format_breakdown(validation, args.seeds, "VALIDATION"))
        blocks.append(format_without_e2e(validation))
        blocks.append(format_mape(validation, "VALIDATION"))
        blocks.append(format_vs_blis([p for p in validation if p.metric in SERVE_METRICS]))
    print("\n\n".join("\n".join(block) for block in blocks))
    if args.csv:
        write_points_csv(points, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
