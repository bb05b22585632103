"""Do aiconfigurator's H100/H200 operator tables depend on the vLLM version they were measured with?

The simulator's H100 and H200 step times come from aiconfigurator-core 0.12.0's tables, measured
with vLLM 0.24.0; the validation runs on those GPUs used vLLM 0.8.2, 0.11 and 0.19, and run
1.2-1.8x faster in the simulator than as published (``fidelity.py``). Earlier aiconfigurator
releases on PyPI ship the same tables measured with older vLLM versions: ``aiconfigurator``
0.4.0 (vLLM 0.11.0, the version of GPUStack's runs) and 0.10.0 (0.14.0 and 0.19.0;
its 0.22.0 directories hold no H100/H200 tables). This downloads
those two wheels once into ``<cache>/aiconfigurator-wheels/`` (about 90 MB, through pip), and
prints, per GPU, op and older version, the median ratio of the older table's latency to 0.24.0's
over the shapes both measured (dense GEMMs in bf16/fp16, grouped by token count ``m``; decode and
prefill attention at head size 128 and a bf16/fp16 KV cache, grouped by the context tokens
they read), with the device
name each table records. A ratio near 1 means that version's kernels ran as fast.

Usage (from the repository root)::

    .venv/bin/python benchmarks/aic_versions.py
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import polars as pl

from servematrix.common.files import cache_root
from servematrix.engine.hardware import gpu_spec

WHEELS = {"0.4.0": "aiconfigurator-0.4.0-py3-none-any.whl",
          "0.10.0": "aiconfigurator-0.10.0-cp310-abi3-manylinux_2_28_x86_64.whl"}  # fmt: skip
OLDER = {  # (system, vLLM version) -> the aiconfigurator release that ships its tables
    ("h100_sxm", "0.11.0"): "0.4.0",
    ("h100_sxm", "0.14.0"): "0.10.0",
    ("h100_sxm", "0.19.0"): "0.10.0",
    ("h200_sxm", "0.11.0"): "0.4.0",
    ("h200_sxm", "0.14.0"): "0.10.0",
    ("h200_sxm", "0.19.0"): "0.10.0",
}
CURRENT = "0.24.0"
GPUS = {"h100_sxm": "H100-SXM5-80GB", "h200_sxm": "H200-SXM-141GB"}
TABLES = {  # table file -> the current release's sub-directory, the columns a shape is, its size
    "gemm_perf": ("gemm", ("m", "n", "k"), pl.col("m")),
    "generation_attention_perf": ("attention", ("batch_size", "step", "num_heads",
        "num_key_value_heads"), pl.col("batch_size") * pl.col("step")),
    "context_attention_perf": ("attention", ("batch_size", "isl", "num_heads",
        "num_key_value_heads"), pl.col("batch_size") * pl.col("isl")),
}  # fmt: skip
"""A shape's size is what its work grows with: a GEMM's tokens ``m``; the context tokens an
attention call reads, summed over its batch."""
BUCKETS = {"gemm_perf": (16, 256, 2048), "generation_attention_perf": (16_384, 262_144),
           "context_attention_perf": (16_384, 262_144)}  # fmt: skip


def wheel(release: str) -> Path:
    """The ``aiconfigurator`` wheel of ``release``, downloaded once into the cache."""
    directory = cache_root() / "aiconfigurator-wheels"
    path = directory / WHEELS[release]
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--python-version", "3.11", "--dest", str(directory),
                   f"aiconfigurator=={release}"]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return path


def older_table(system: str, version: str, table: str) -> pl.DataFrame | None:
    """One table of an older release, read from its wheel (``.txt`` CSV or ``.parquet``)."""
    with zipfile.ZipFile(wheel(OLDER[(system, version)])) as archive:
        stem = f"aiconfigurator/systems/data/{system}/vllm/{version}/{table}"
        for suffix, read in ((".parquet", pl.read_parquet), (".txt", pl.read_csv)):
            if f"{stem}{suffix}" in archive.namelist():
                return read(archive.read(f"{stem}{suffix}"))
    return None


def current_table(system: str, table: str) -> pl.DataFrame:
    directory, _, _ = TABLES[table]
    root = files("aiconfigurator_core") / "systems" / "data" / system / directory / "vllm"
    return pl.read_parquet(str(root / CURRENT / f"{table}.parquet"))


def dense(frame: pl.DataFrame, table: str) -> pl.DataFrame:
    """The rows comparable across versions: bf16/fp16 GEMMs; attention at head size 128 with a
    bf16/fp16 KV cache and no sliding window; the fastest kernel per shape."""
    half = ["bfloat16", "float16"]
    if table == "gemm_perf":
        frame = frame.filter(pl.col("gemm_dtype").is_in(half))
    else:
        frame = frame.filter(pl.col("kv_cache_dtype").is_in(half), pl.col("head_dim") == 128)
        if "window_size" in frame.columns:
            frame = frame.filter(pl.col("window_size") == 0)
    _, shape, _ = TABLES[table]
    return frame.group_by(shape).agg(pl.col("latency").min(), pl.col("device").first())


def _bucket(value: int, bounds: Sequence[int]) -> str:
    for bound in bounds:
        if value <= bound:
            return f"<= {bound:,}"
    return f"> {bounds[-1]:,}"


@dataclass(frozen=True)
class Comparison:
    """One group of shapes both tables measured."""

    device: str  # the older table's, as it records it
    bucket: str
    median_ratio: float  # older / current latency
    shapes: int
    below_peak_older: float | None  # share of shapes faster than the dense bf16 peak allows
    below_peak_current: float | None


def _below_peak(latency: pl.Expr, peak_tflops: float) -> pl.Expr:
    """Causal prefill attention of ``isl`` tokens costs 2 x batch x heads x head_dim x isl^2
    FLOPs (QK^T and PV, half the square each, a multiply-add each): faster than that at the
    dense bf16 peak is not a possible measurement of it."""
    isl = pl.col("isl").cast(pl.Float64)
    flops = 2.0 * pl.col("batch_size") * pl.col("num_heads") * 128 * isl * isl
    return latency * 1e-3 < flops / (peak_tflops * 1e12)


def compare(system: str, version: str, table: str) -> list[Comparison]:
    """The older table against the current one, per group of shape sizes."""
    older = older_table(system, version, table)
    if older is None:
        return []
    _, shape, size = TABLES[table]
    joined = dense(older, table).join(dense(current_table(system, table), table), on=shape,
                                      suffix="_current")  # fmt: skip
    if joined.is_empty():
        return []
    peak = gpu_spec(GPUS[system]).bf16_dense_tflops
    bounds = BUCKETS[table]
    attention = table == "context_attention_perf"
    joined = joined.with_columns(
        ratio=pl.col("latency") / pl.col("latency_current"),
        bucket=size.map_elements(lambda v: _bucket(v, bounds), return_dtype=pl.String),
        size=size,
        below_older=_below_peak(pl.col("latency"), peak) if attention else pl.lit(None),
        below_current=_below_peak(pl.col("latency_current"), peak) if attention else pl.lit(None),
    )
    summary = joined.group_by("bucket").agg(
        pl.col("ratio").median(), pl.len(), pl.col("size").min(),
        pl.col("below_older").cast(pl.Float64).mean(),
        pl.col("below_current").cast(pl.Float64).mean(),
    ).sort("size")  # fmt: skip
    device = joined["device"][0]
    return [
        Comparison(
            device,
            row["bucket"],
            row["ratio"],
            row["len"],
            row["below_older"],
            row["below_current"],
        )
        for row in summary.iter_rows(named=True)
    ]


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def main() -> int:
    print(f"median latency of an older vLLM version's table / vLLM {CURRENT}'s "
          "(aiconfigurator-core 0.12.0) over the shapes both measured; for prefill attention,"
          " the share of shapes faster than the bf16 peak allows, older / current")  # fmt: skip
    print(f"{'system':<9} {'vLLM':<7} {'table':<26} {'size (tokens)':<14} {'older/current':>13} "
          f"{'shapes':>6} {'below peak':>14}  device of the older table")  # fmt: skip
    for system, version in OLDER:
        for table in TABLES:
            for row in compare(system, version, table):
                below = f"{_share(row.below_peak_older)} / {_share(row.below_peak_current)}"
                line = f"{system:<9} {version:<7} {table:<26} {row.bucket:<14} "
                line += f"{row.median_ratio:>13.3f} {row.shapes:>6} {below:>14}  {row.device}"
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
