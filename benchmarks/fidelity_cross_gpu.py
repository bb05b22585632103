"""The validation runs that a source published on two GPUs, same model and workload: how much
faster the second GPU was, as published, as simulated, and as the datasheets bound it.

This is how ``fidelity.py`` gives a reason with numbers where a goal is missed on one GPU of a
source while the other GPU's run is in band. The simulator takes each GPU's step times from
aiconfigurator's operator tables, measured on that GPU; so where it gets one GPU right and the
other not, the published ratio between the two is what the tables would have to give, and the
datasheets bound what any model could: a run's speed-up lies between the ratio of the cards' HBM
bandwidth (all memory-bound) and that of their dense bf16 peaks (all compute-bound), except where
a larger KV pool changes how the run is scheduled (more requests running at once, fewer
preemptions). The published counts are the source's, the simulated ones seed 0's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fidelity_points import Point, in_band
from fidelity_validation import ValidationRun

from servematrix.engine.hardware import gpu_spec

METRICS = ("request_throughput_per_s", "mean_tpot_ms")
"""What the ratio is taken on: throughput (the second GPU's over the first's) and the mean time
per output token (the first's over the second's), so that above 1 reads as "faster"."""


@dataclass(frozen=True)
class CrossGpuRatio:
    """One workload a source ran on two GPUs, and one metric's speed-up from ``gpu_a`` to
    ``gpu_b``."""

    source: str
    workload: str
    gpu_a: str
    gpu_b: str
    metric: str
    published: float
    simulated: float
    in_band_a: bool
    in_band_b: bool

    @property
    def hbm_ratio(self) -> float:
        return gpu_spec(self.gpu_b).hbm_bandwidth_tb_s / gpu_spec(self.gpu_a).hbm_bandwidth_tb_s

    @property
    def compute_ratio(self) -> float:
        return gpu_spec(self.gpu_b).bf16_dense_tflops / gpu_spec(self.gpu_a).bf16_dense_tflops


def _workload_key(run: ValidationRun) -> tuple:
    return (
        run.source, run.model, run.tp, run.quantization, run.dataset, run.input_len,
        run.output_len, run.num_prompts, run.request_rate, run.max_concurrency,
    )  # fmt: skip


def _workload_text(run: ValidationRun) -> str:
    rate = "inf" if run.request_rate is None else f"{run.request_rate:g}"
    return (
        f"{run.model.split('/')[-1]} tp{run.tp} {run.dataset} "
        f"{run.input_len}/{run.output_len} x{run.num_prompts} rate={rate}"
    )


def _speed_up(metric: str, value_a: float, value_b: float) -> float:
    return value_b / value_a if metric == "request_throughput_per_s" else value_a / value_b


def cross_gpu_ratios(runs: Sequence[ValidationRun], points: Sequence[Point]) -> list[CrossGpuRatio]:
    """Every pair of simulated runs of one source with the same model and workload on two GPUs
    (ordered by the first GPU's bf16 peak, then by name), for each of `METRICS` both published."""
    by_value = {(p.label, p.metric): p for p in points}
    groups: dict[tuple, list[ValidationRun]] = {}
    for run in runs:
        groups.setdefault(_workload_key(run), []).append(run)
    ratios = []
    for group in groups.values():
        ordered = sorted(group, key=lambda r: (gpu_spec(r.gpu).bf16_dense_tflops, r.gpu))
        for index, run_a in enumerate(ordered):
            for run_b in ordered[index + 1 :]:
                for metric in METRICS:
                    a = by_value.get((run_a.label, metric))
                    b = by_value.get((run_b.label, metric))
                    if a is None or b is None:
                        continue
                    ratios.append(
                        CrossGpuRatio(
                            source=run_a.source,
                            workload=_workload_text(run_a),
                            gpu_a=run_a.gpu,
                            gpu_b=run_b.gpu,
                            metric=metric,
                            published=_speed_up(metric, a.published, b.published),
                            simulated=_speed_up(metric, a.predicted[0], b.predicted[0]),
                            in_band_a=in_band(a.ratio),
                            in_band_b=in_band(b.ratio),
                        )
                    )
    return ratios


def format_cross_gpu(ratios: Sequence[CrossGpuRatio]) -> list[str]:
    """One line per workload and metric: the speed-up published, simulated, and the datasheets'
    memory-bound and compute-bound ratios; whether each GPU's own value is in band."""
    lines = [
        "== VALIDATION runs a source published on two GPUs: speed-up from the first GPU to the"
        " second (throughput b/a, mean TPOT a/b), seed 0",
        f"{'source':<15} {'workload':<44} {'GPU a -> GPU b':<32} {'metric':<9} "
        f"{'published':>9} {'simulated':>9} {'HBM':>5} {'bf16':>5}  in band a/b",
    ]
    for ratio in ratios:
        metric = "req/s" if ratio.metric == "request_throughput_per_s" else "TPOT"
        gpus = f"{ratio.gpu_a} -> {ratio.gpu_b}"
        marks = f"{'yes' if ratio.in_band_a else 'no'}/{'yes' if ratio.in_band_b else 'no'}"
        lines.append(
            f"{ratio.source:<15} {ratio.workload:<44} {gpus:<32} {metric:<9} "
            f"{ratio.published:>9.2f} {ratio.simulated:>9.2f} {ratio.hbm_ratio:>5.2f} "
            f"{ratio.compute_ratio:>5.2f}  {marks}"
        )
    return lines
