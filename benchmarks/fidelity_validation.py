"""The fidelity benchmark's validation set: published vLLM results no constant was fitted on.

`load_validation` reads ``benchmarks/data/validation_published.csv`` (one line per published
value; lines with the same setup are one run), `predict_validation` simulates a run the way it was
measured (``LLM.generate`` of one prompt, or an OpenAI server and ``vllm bench serve`` at the send
times its client drew, `published_sends`), and `validation_points` scores every value. The
Qwen2 calibration rows share the file format, and `format_host_fit` shows the v0 host cost fitted
on them.
"""

from __future__ import annotations

import csv
import json
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from pathlib import Path
from typing import Any

from fidelity_points import SERVE_METRICS, Point, predict

from servematrix.results.metrics import CellMetrics
from servematrix.spec.matrix import MODES, Cell, ModelSpec, Serving, Workload
from servematrix.workload import schedule
from servematrix.workload.replay import BLOCK_TOKENS

DATA = Path(__file__).resolve().parent / "data"
VALIDATION_CSV = DATA / "validation_published.csv"
QWEN2_CALIBRATION_CSV = DATA / "calibration_qwen2_speed.csv"
"""Calibration rows in the validation file's format: the v0 host step cost is fitted on them."""
THROUGHPUT_METRICS = ("speed_tokens_per_s", "request_throughput_per_s")
"""Metrics where higher is better; the ratio is still predicted / published."""
SETUP_COLUMNS = (
    "source", "row", "gpu", "model", "architecture", "quantization", "tp", "vllm", "recipe",
    "interface", "dataset", "input_len", "output_len", "num_prompts", "request_rate",
    "max_concurrency", "max_model_len", "gpu_memory_utilization", "enforce_eager",
    "prefix_caching", "regime", "note",
)  # fmt: skip
CHUNKED_BUDGET_V062 = 512
"""vLLM before 0.6.5 chunks prefills in 512-token pieces (2048 only from vLLM PR #10544): the
``max_num_batched_tokens`` of Mooncake's v0.1 chunked row (vLLM 0.6.2, mooncake-integration
branch) and of V0 validation runs that chunk (`_v0_chunked_budget`)."""


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


def v1_batch_defaults(run: ValidationRun) -> tuple[int, int] | None:
    """The API server's ``max_num_batched_tokens`` and ``max_num_seqs`` in the run's vLLM
    version where its rule is not the ``v1`` recipe's (`scheduler.scheduler_config`: vLLM >=
    0.9, where PR #17885 keeps the A100 at 2,048 and 256), else None.
    ``EngineArgs._set_default_args_v1`` (``vllm/engine/arg_utils.py``, read in the PyPI sdists):
    0.8.2 and 0.8.3 give 8,192 tokens on a GPU named H100 or H200 and 2,048 elsewhere, and 1,024
    sequences on every GPU; 0.8.4 gives the recipe's; 0.8.5 gives 8,192 and 1,024 on any GPU of
    >= 70 GiB (the A100 80 GB too), else 2,048 and 256."""
    from servematrix.engine.hardware import gpu_spec

    version = run.vllm_version
    if run.recipe != "v1" or version >= (0, 9):
        return None
    if version < (0, 8, 4):
        return (8192 if run.gpu.startswith(("H100", "H200")) else 2048, 1024)
    if version < (0, 8, 5):
        return None
    return (8192, 1024) if gpu_spec(run.gpu).memory_gib >= 70 else (2048, 256)


CUDA_CONTEXT_GIB = 0.5
"""The CUDA context's device memory per GPU (approximate; docs/engine-model.md, "KV memory and
quantization"). No recipe's vLLM counts it; vLLM 0.8.2 and 0.8.3 do (`v1_memory_utilization`)."""


def v1_memory_utilization(run: ValidationRun) -> float:
    """The ``gpu_memory_utilization`` that gives the ``v1`` recipe's KV plan the pool of the
    run's own vLLM version. ``Worker.determine_available_memory`` of vLLM 0.8.2 and 0.8.3
    (``vllm/v1/worker/gpu_worker.py``, read in the PyPI sdists) subtracts torch's peak allocation
    in the profile run plus everything else in use on the device (``mem_get_info``'s total less
    free, less torch's allocation): the CUDA context, the NCCL and custom all-reduce buffers,
    cuBLAS workspaces. It captures the CUDA graphs after the KV cache is allocated
    (``initialize_from_config``, then ``compile_or_warm_up_model``). So it counts the context
    and, at TP > 1, the TP buffers, and not the graphs; the recipe (vLLM 0.33) counts the graphs
    and neither of the others (`kvcache.counted_reserve_gib`). The plan's budget is the card's
    memory x utilization less weights, activations and reserve, so a larger reserve is exactly a
    utilization lower by the difference over the card's memory. Other versions: the run's own."""
    from servematrix.engine.hardware import gpu_spec
    from servematrix.engine.kvcache import (
        RUNTIME_RESERVE_GIB,
        TP_RESERVE_GIB,
        counted_reserve_gib,
    )

    if run.recipe != "v1" or not (0, 8, 2) <= run.vllm_version < (0, 8, 4):
        return run.gpu_memory_utilization
    own = RUNTIME_RESERVE_GIB + CUDA_CONTEXT_GIB + (TP_RESERVE_GIB if run.tp > 1 else 0.0)
    extra_gib = own - counted_reserve_gib("v1", run.tp, run.enforce_eager)
    return run.gpu_memory_utilization - extra_gib / gpu_spec(run.gpu).memory_gib


def predict_validation(
    run: ValidationRun, seed: int, request_rate: float | None = None
) -> dict[str, float]:
    """The simulator's value of every metric the run publishes; a ``serve`` run's at another
    ``request_rate`` when given (the same prompts, priming and client, sent at that rate)."""
    if run.interface == "offline-llm":
        return _predict_offline(run, seed)
    return _predict_serve(run, seed, request_rate)


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


def _predict_serve(
    run: ValidationRun, seed: int, request_rate: float | None = None
) -> dict[str, float]:
    """An OpenAI server and ``vllm bench serve`` (one warm-up request, then the run), with the
    client's ``--max-concurrency`` cap. A ``sharegpt`` run is simulated at every request's
    published lengths where its result files give them (`request_lengths`; the warm-up request
    is the first, as the client's test prompt), at another run's lengths of the same prompts
    (`BORROWED_PROMPTS`), else at its published means (the row's note says so): the simulator
    has no ShareGPT copy. ``request_rate`` replaces the published rate of the cell and the
    send times only."""
    sent = run if request_rate is None else replace(run, request_rate=request_rate)
    borrowed = BORROWED_PROMPTS.get(run.label)
    if borrowed is None:
        return _serve_values(run, _serve_cell(sent, seed, request_lengths(run)), sent)
    with tempfile.TemporaryDirectory() as directory:
        lengths = Path(directory) / "lengths.jsonl"
        rows = borrowed_lengths(run, *borrowed)
        template = CHAT_SOURCES.get(run.source, 0)
        lines = [json.dumps({"input_len": i + template, "output_len": o}) for i, o in rows]
        lengths.write_text("\n".join(lines) + "\n")
        return _serve_values(run, _serve_cell(sent, seed, lengths), sent)


def _serve_cell(run: ValidationRun, seed: int, lengths: Path | None) -> Cell:
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
        input_len=run.input_len + CHAT_SOURCES.get(run.source, 0),
        output_len=run.output_len,
        num_prompts=run.num_prompts,
        seed=seed,
        dataset="random" if run.dataset == "sharegpt" else run.dataset,
        burstiness=1.0,
        warmup_requests=1,
        max_concurrency=run.max_concurrency,
    )
    if lengths is not None:
        workload = replace(workload, dataset="jsonl", dataset_path=str(lengths))
    budget, seqs = v1_batch_defaults(run) or (None, None)
    return Cell(
        backend="simulator",
        recipe=run.recipe,
        model=model,
        mode=MODES["single"],
        workload=workload,
        serving=Serving(
            run.max_model_len,
            v1_memory_utilization(run),
            max_num_batched_tokens=budget,
            enforce_eager=run.enforce_eager,
            prefix_caching=run.prefix_caching,
            max_num_seqs=seqs,
        ),
        engine={"gpu": run.gpu},
    )


def _serve_values(run: ValidationRun, cell: Cell, sent: ValidationRun) -> dict[str, float]:
    """The run's metrics, its requests sent as ``sent`` (the run, or it at another rate) was."""
    schedules = published_sends(sent)
    chat = run.source in CHAT_SOURCES
    if run.label in PRIMED_RUNS:
        runs = [_predict_primed(run, cell, schedules[0] if schedules else [0.0] * run.num_prompts)]
    elif schedules is None:
        runs = [predict(cell, chat_stream=chat)]
    else:
        runs = [predict(cell, send_times_s=sends, chat_stream=chat) for sends in schedules]
    values = {name: statistics.fmean(getattr(m, name) for m in runs) for name in SERVE_METRICS}
    values["request_throughput_per_s"] = statistics.fmean(m.request_throughput for m in runs)
    return values


CHAT_SOURCES = {"gpustack-lab": 8}
"""Sources whose client sent chat messages, with the tokens the server's chat template adds
around one user message. GPUStack's ``vllm bench serve --backend openai-chat --endpoint
/v1/chat/completions`` (``SOURCES.md``): each prompt is one user message, which vLLM renders in
Qwen3's template, ``<|im_start|>user\\n`` + prompt + ``<|im_end|>\\n<|im_start|>assistant\\n``
(no default system turn; the thinking block only when ``enable_thinking`` is false): 8 tokens of
the Qwen2 vocabulary (``<|im_start|>``, ``user``, ``\\n``, ``<|im_end|>``, ``\\n``,
``<|im_start|>``, ``assistant``, ``\\n``) that the engine prefills and the client's input count
leaves out. Their streams carry one event more per request than a completion stream
(`fidelity_points.as_chat_stream`). The other serving sources used ``--backend vllm``
(``/v1/completions``)."""

REQUEST_LENGTHS = {"llm-k8s": DATA / "llm-k8s"}
"""Sources whose result files give every request's input and output length: one ``jsonl``
dataset per run (``qps_<rate>.jsonl``, ``{"input_len": N, "output_len": M}`` in the published
order), sent at the run's send times."""


def request_lengths(run: ValidationRun) -> Path | None:
    """The per-request lengths of a run, or None where only the means are published."""
    directory = REQUEST_LENGTHS.get(run.source)
    if directory is None:
        return None
    finite = run.request_rate is not None and run.request_rate != float("inf")
    rate = f"{run.request_rate:02.0f}" if finite else "inf"
    return directory / f"qps_{rate}.jsonl"


BORROWED_PROMPTS = {
    f"gpustack-lab 8B H100 sharegpt c={concurrency}": (DATA / "llm-k8s" / "qps_01.jsonl", 23260)
    for concurrency in (1, 2, 4, 8)
}
"""ShareGPT runs whose prompts another source's result files give, with the run's published
total of input tokens (GPUStack's four concurrency caps send the same 100 prompts: the same
23,260 / 22,061 token totals). ``vllm bench serve`` 0.11 (``vllm/benchmarks/datasets.py``,
``ShareGPTDataset``) and ``benchmark_serving.py`` 0.8.3 (``benchmarks/benchmark_dataset.py``)
sample alike: the same file's conversations of two or more turns, ``random.shuffle`` at
``--seed`` (default 0 in both), then the first that pass ``is_valid_sequence`` (prompt >= 4 and
<= 1,024 tokens, prompt + reference answer <= 2,048), in order. So GPUStack's 100 prompts are
llm-k8s's first 100 (its 200 at seed 0), up to the filter counting tokens with another tokenizer
(Qwen3's there, Llama 3.3's here): their input lengths add up to 22,398 against GPUStack's
published 23,260 (0.963). The inputs are llm-k8s's, scaled to the published total; the outputs
stay at the published mean, because each run's are its own model's answers. Chosen before
the concurrency-4 run was scored with them; the other three caps were added later, read the
same way."""


def borrowed_lengths(run: ValidationRun, path: Path, input_total: int) -> list[tuple[int, int]]:
    """The first ``run.num_prompts`` input lengths of ``path`` scaled to ``input_total`` (largest
    remainders rounded up, so they add up to it exactly), each with ``run.output_len``."""
    inputs = [length for length, _ in _read_lengths(path)[: run.num_prompts]]
    exact = [length * input_total / sum(inputs) for length in inputs]
    scaled = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda k: scaled[k] - exact[k])
    for k in by_remainder[: input_total - sum(scaled)]:
        scaled[k] += 1
    return [(length, run.output_len) for length in scaled]


PRIMED_RUNS = {
    f"llm-k8s 70B A100-40GB tp8 sharegpt rate={rate}": ("qps_01.jsonl", 1.0)
    for rate in ("4", "16", "inf")
}
"""Runs whose server had already served their prompts, and the run that did (its lengths file and
rate). llm-k8s sent the same 200 ShareGPT prompts (seed 0: identical input lengths in all four
result files) at rates 1, 4, 16 and inf, one after another within three minutes, to one server
with ``--enable-prefix-caching`` and room for all of them, so the later runs found them cached.
The rate-inf run shows it: its 42,659 prompt tokens on a 70B model are >= 6.0 PFLOP, >= 2.4 s of
eight A100s at their dense peak, yet every first token came within 0.45 s (P99). Found after the
four runs were first scored as cold runs (`benchmarks/data/SOURCES.md` has those counts)."""

PRIMING_GAP_S = 60.0
"""Between the priming run's last send and the run's first: the cache holds every prompt with
room to spare, so nothing is evicted meanwhile and the gap's length does not matter."""


def _predict_primed(run: ValidationRun, cell: Cell, sends: Sequence[float]) -> CellMetrics:
    """The priming run's requests at their send times, then the run's, on one engine, as one
    Mooncake trace in which the two requests of a prompt have the same hash ids (so the second
    finds the first's blocks cached); only the run's own requests are measured."""
    priming_file, priming_rate = PRIMED_RUNS[run.label]
    lengths = request_lengths(run)
    assert lengths is not None
    priming = _read_lengths(lengths.parent / priming_file)
    measured = _read_lengths(lengths)
    n = len(priming)
    primed = schedule.benchmark_serving_08_sharegpt_sends(n, priming_rate, 0)
    start = primed[-1] + PRIMING_GAP_S
    blocks = [-(-inputs // BLOCK_TOKENS) for inputs, _ in priming]
    first_id = [0, *accumulate(blocks)]
    with tempfile.TemporaryDirectory() as directory:
        trace = Path(directory) / "primed.jsonl"
        lines = [
            json.dumps({"timestamp": k, "input_length": inputs, "output_length": outputs,
                        "hash_ids": list(range(first_id[k % n], first_id[k % n] + blocks[k % n]))})
            for k, (inputs, outputs) in enumerate([*priming, *measured])
        ]  # fmt: skip
        trace.write_text("\n".join(lines) + "\n")
        workload = replace(
            cell.workload,
            num_prompts=2 * n,
            input_len=run.max_model_len,
            output_len=run.max_model_len,
            dataset="mooncake",
            dataset_path=str(trace),
            trace_timing="qps",
            warmup_requests=0,
        )
        all_sends = [*primed, *(start + s for s in sends)]
        return predict(replace(cell, workload=workload), send_times_s=all_sends, measured_from=n)


def _read_lengths(path: Path) -> list[tuple[int, int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(row["input_len"], row["output_len"]) for row in rows]


PUBLISHED_CLIENT_SEEDS = {"vllm-spotcheck": (0,), "kvcached-h100": (42, 99, 7), "llm-k8s": (0,)}
"""The client's ``--seed`` of each source's finite-rate runs: the spot check and llm-k8s ran
``benchmark_serving.py`` at its default seed, kvcached's sweep three seeds whose means it
published (``benchmarks/bench_layout/run_sweep.sh``)."""

QWEN2_TOKENIZER_VOCAB_SIZE = 151643
"""``vocab_size`` of QwQ-32B's Qwen2 tokenizer (its regular tokens, without the added special
ones), below which vLLM 0.8's random dataset draws its offsets. With it the reconstructed sends
of the spot check's 1,000/2,000 H100 run put its last request's end (send + published TTFT +
ITLs) at 47.68 s against the published duration of 47.71 s."""


def published_sends(run: ValidationRun) -> list[Sequence[float]] | None:
    """The send times each published run of a finite-rate ``serve`` row drew, from its client's
    code and seed (`servematrix.workload.schedule`): the published input, not a fresh Poisson draw.
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
    if seeds is not None and run.vllm.startswith("0.8.") and run.dataset == "sharegpt":
        return [schedule.benchmark_serving_08_sharegpt_sends(n, qps, seed) for seed in seeds]
    if seeds is not None and run.vllm == "0.19.0" and run.dataset == "random":
        return [schedule.bench_serve_019_sends(n, qps, seed) for seed in seeds]
    raise ValueError(f"{run.label}: no reconstruction of vLLM {run.vllm}'s client schedule")


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


def implied_host_step_ms(run: ValidationRun) -> float:
    """The host cost per step that would make a batch-1 offline row match exactly: published
    time minus the GPU steps, over the number of steps (v0 has no per-request part)."""
    from servematrix.engine.scheduler import Request
    from servematrix.recipes import recipe_version

    instance = _offline_setup(run, jitter_cv=0.0).instance(0)
    instance.add_request(Request(0, run.input_len, run.output_len))
    elapsed_ms = 0.0
    while instance.has_work():
        elapsed_ms += instance.step().duration_s * 1e3
    cost = recipe_version(run.recipe).host_cost_with(run.enforce_eager)
    gpu_ms = elapsed_ms - instance.steps * (cost.step_ms + cost.per_seq_ms)
    published_ms = run.output_len / run.published["speed_tokens_per_s"] * 1e3
    return (published_ms - gpu_ms) / instance.steps


HOST_FIT_ROWS = ("0.5B BF16 tp1 in1", "1.5B BF16 tp1 in1", "7B BF16 tp1 in1")
"""Where the v0 host cost is fitted: bf16 (no quantized-kernel uncertainty), one GPU, the
shortest input (no attention), so the step is as well known as it gets and the rest is host."""


def format_host_fit(runs: Sequence[ValidationRun]) -> list[str]:
    """The v0 host step cost each fitting row implies, their median, and the constant in use."""
    from servematrix.recipes import recipe_version

    fits = {run.row: implied_host_step_ms(run) for run in runs if run.row in HOST_FIT_ROWS}
    lines = ["== v0 host cost per step implied by the qwen2-speed rows it is fitted on (ms)"]
    lines += [f"  {row:<20} {value:.2f}" for row, value in fits.items()]
    lines.append(
        f"  median {statistics.median(fits.values()):.2f}; in use "
        f"(servematrix.engine.host): {recipe_version('v0').host_cost.step_ms:.2f}"
    )
    return lines
