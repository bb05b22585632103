"""The study summary from real trace files, and its three atomic outputs."""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from servematrix.results import aggregate, intervals, metrics
from servematrix.spec import trace


def identity(
    model: str = "qwen-7b", mode: str = "single", qps: float = 2.0, input_len: int = 10, seed=0
):
    return trace.CellIdentity("simulator", "v1", model, mode, "random", qps, input_len, 3, 3, seed)


def records() -> list[trace.RequestRecord]:
    """Two successes and a failure.

    request 0: sent 0.0, chunks 0.1, 0.3 (1, 2 tokens) -> TTFT 100, E2EL 300, TPOT 200/2 = 100
    request 1: sent 0.5, chunk 0.7 (1 token)            -> TTFT 200, E2EL 200
    request 2: sent 1.0, failed
    duration 0.0 -> 1.0 (the failed send is the last event) = 1.0 s
    """
    return [
        trace.RequestRecord(
            0,
            False,
            0.0,
            0.0,
            0.1,
            0.3,
            [0.1, 0.3],
            [1, 2],
            10,
            3,
            True,
            request_input_len=10,
            request_output_len=3,
        ),
        trace.RequestRecord(
            1,
            False,
            0.5,
            0.5,
            0.7,
            0.7,
            [0.7],
            [1],
            10,
            1,
            True,
            request_input_len=10,
            request_output_len=3,
        ),
        trace.RequestRecord(
            2, False, 1.0, 1.0, error="HTTP 500", request_input_len=10, request_output_len=3
        ),
    ]


def write_trace(tmp_path: Path, name: str, cell: trace.CellIdentity) -> Path:
    path = tmp_path / "cells" / f"{name}.parquet"
    trace.write(path, cell, records(), {"cell": name})
    return path


def test_summary_row_has_identity_metrics_and_path(tmp_path: Path) -> None:
    path = write_trace(tmp_path, "a", identity())

    df = aggregate.summarize([path], {"ttft": 150})

    assert df.height == 1
    row = df.row(0, named=True)
    assert {k: row[k] for k in trace.IDENTITY_COLUMNS} == asdict(identity())
    assert row["trace"] == str(path)
    assert row["completed"] == 2
    assert row["failed"] == 1
    assert row["duration_s"] == pytest.approx(1.0)
    assert row["total_output_tokens"] == 4
    assert row["mean_ttft_ms"] == pytest.approx(150.0)  # (100 + 200) / 2
    assert row["mean_tpot_ms"] == pytest.approx(100.0)  # request 1 has one token
    assert row["mean_itl_ms"] == pytest.approx(200.0)  # the one gap 0.1 -> 0.3
    assert row["request_goodput"] == pytest.approx(1.0)  # only request 0 has TTFT <= 150
    assert row["good_fraction"] == pytest.approx(1 / 3)
    expected = asdict(metrics.compute(trace.read(path), {"ttft": 150}))
    assert {k: row[k] for k in expected} == expected


def test_summary_columns_and_types(tmp_path: Path) -> None:
    df = aggregate.summarize([write_trace(tmp_path, "a", identity())])

    metric_names = [f.name for f in fields(metrics.CellMetrics)]
    workload, memory = list(aggregate.WORKLOAD_COLUMNS), list(aggregate.MEMORY_COLUMNS)
    preemption = list(aggregate.PREEMPTION_COLUMNS)
    assert df.columns == [
        *trace.IDENTITY_COLUMNS,
        *metric_names,
        *workload,
        *aggregate.SERVING_COLUMNS,
        *memory,
        *preemption,
        *aggregate.PREFIX_COLUMNS,
        *aggregate.TURN_COLUMNS,
        *aggregate.STEADY_COLUMNS,
        *intervals.INTERVAL_COLUMNS,
        "repeats",
        "trace",
    ]
    assert df.schema["preemptions_total"] == pl.Int64
    assert df.schema["qps"] == pl.Float64
    assert df.schema["input_len"] == pl.Int32
    assert df.schema["completed"] == pl.Int64
    assert df.schema["mean_ttft_ms"] == pl.Float64
    assert df.schema["steady"] == pl.Boolean
    assert df.schema["chunked_prefill"] == pl.Boolean


def _served_by(mode: dict, recipe: str = "v1", max_model_len: int = 10_000) -> dict:
    serving = {"max_model_len": max_model_len}
    return {"cell": {"recipe": recipe, "mode": mode, "serving": serving}}


def test_summary_says_whether_prefill_was_chunked(tmp_path: Path) -> None:
    """The mode's choice, else the recipe's default (V1 on; 0.6 off, on above 32768 tokens);
    null where servematrix did not start the server (external, `servematrix bench`)."""
    cases = {
        2.0: ("simulator", _served_by({"chunked_prefill": None})),
        3.0: ("simulator", _served_by({"chunked_prefill": None}, "v0")),
        4.0: ("emulator", _served_by({"chunked_prefill": None}, "v0", 40_000)),
        5.0: ("vllm", _served_by({"chunked_prefill": False})),
        6.0: ("vllm", _served_by({"chunked_prefill": True}, "v0")),
        7.0: ("external", _served_by({"chunked_prefill": True})),
        8.0: ("simulator", {"workload": {"max_concurrency": 2}}),
    }
    paths = []
    for qps, (backend, metadata) in cases.items():
        path = tmp_path / f"{qps}.parquet"
        cell = trace.CellIdentity(backend, "v1", "m", "single", "random", qps, 10, 3, 3, 0)
        trace.write(path, cell, records(), metadata)
        paths.append(path)

    df = aggregate.summarize(paths)

    assert df["chunked_prefill"].to_list() == [True, False, True, False, True, None, None]
    page = aggregate.render_html(df, "t")
    assert "<th>chunked prefill</th>" in page and "<td>on</td>" in page
    assert "<td>off</td>" in page


def test_html_leaves_out_chunked_prefill_when_no_cell_says(tmp_path: Path) -> None:
    df = aggregate.summarize([write_trace(tmp_path, "a", identity())])
    assert "chunked prefill" not in aggregate.render_html(df, "t")


def test_summary_reads_the_concurrency_cap_from_the_metadata(tmp_path: Path) -> None:
    """A workflow cell's config, or `servematrix bench`'s workload; null when neither says."""
    capped = tmp_path / "capped.parquet"
    capped_cell = {"cell": {"workload": {"max_concurrency": 4}}}
    trace.write(capped, identity(qps=4.0), records(), capped_cell)
    bench = tmp_path / "bench.parquet"
    trace.write(bench, identity(qps=8.0), records(), {"workload": {"max_concurrency": 2}})
    plain = write_trace(tmp_path, "plain", identity(qps=2.0))

    df = aggregate.summarize([capped, bench, plain])

    assert dict(zip(df["qps"], df["max_concurrency"], strict=True)) == {2.0: None, 4.0: 4, 8.0: 2}


def preempted_records(counts: list[int | None]) -> list[trace.RequestRecord]:
    """A warm-up (preempted 5 times: not counted), then one request per count, request k taking
    (k + 1) * 100 ms end to end; the last one failed."""
    rows = [
        trace.RequestRecord(
            0,
            True,
            -9.0,
            -9.0,
            -8.0,
            -8.0,
            [-8.0],
            [1],
            10,
            1,
            True,
            request_input_len=10,
            request_output_len=1,
            preemptions=5,
        )
    ]
    for k, count in enumerate(counts, start=1):
        end = k * 0.1
        rows.append(
            trace.RequestRecord(
                k,
                False,
                0.0,
                0.0,
                end,
                end,
                [end],
                [1],
                10,
                1,
                True,
                request_input_len=10,
                request_output_len=1,
                preemptions=count,
            )
        )
    rows[-1] = trace.RequestRecord(
        len(counts),
        False,
        0.0,
        0.0,
        error="HTTP 500",
        request_input_len=10,
        request_output_len=1,
        preemptions=counts[-1],
    )
    return rows


def test_summary_totals_preemptions_of_the_measured_requests(tmp_path: Path) -> None:
    # Requests 1..200 served, request k in k * 100 ms; request 201 failed. Preempted: 10 (once),
    # 198 (twice), 200 (3 times, the slowest) and the failed 201 (4 times). The slowest 1 % are
    # ceil(2.0) = 2 requests: 200 (preempted) and 199 (not).
    counts = [0] * 201
    counts[9], counts[197], counts[199], counts[200] = 1, 2, 3, 4
    path = tmp_path / "p.parquet"
    trace.write(path, identity(), preempted_records(counts), {})

    row = aggregate.summarize([path]).row(0, named=True)

    assert row["preemptions_total"] == 10  # the warm-up's 5 are not counted
    assert row["preempted_requests"] == 4
    assert row["slowest_preempted_share"] == pytest.approx(0.5)
    assert row["preempted_median_e2el_ms"] == pytest.approx(19800.0)  # of 1000, 19800, 20000
    rest = [100.0 * k for k in range(1, 201) if k not in (10, 198, 200)]
    assert row["unpreempted_median_e2el_ms"] == pytest.approx(float(np.median(rest)))


def test_summary_preemptions_are_null_where_the_backend_cannot_know(tmp_path: Path) -> None:
    unknown = tmp_path / "unknown.parquet"  # what the load generator writes
    trace.write(unknown, identity(qps=2.0), records(), {})
    older = tmp_path / "older.parquet"  # a trace from before the column
    table = trace.to_table(identity(qps=4.0), records(), {}).drop_columns(["preemptions"])
    pq.write_table(table, older)
    none = tmp_path / "none.parquet"  # known, and none preempted
    trace.write(none, identity(qps=8.0), preempted_records([0, 0, 0]), {})

    df = aggregate.summarize([unknown, older, none])

    columns = list(aggregate.PREEMPTION_COLUMNS)
    assert df.filter(pl.col("qps") < 8).select(columns).null_count().row(0) == (2,) * 5
    row = df.filter(pl.col("qps") == 8).row(0, named=True)
    assert (row["preemptions_total"], row["preempted_requests"]) == (0, 0)
    assert row["slowest_preempted_share"] == 0.0 and row["preempted_median_e2el_ms"] is None
    assert row["unpreempted_median_e2el_ms"] == pytest.approx(150.0)


def test_summary_takes_the_modelled_memory_split_from_the_metadata(tmp_path: Path) -> None:
    path = tmp_path / "m.parquet"
    memory = {
        "peak_gpu_memory_mib": 65536.0,
        "peak_kv_cache_usage": 0.25,
        "weights_mib_per_gpu": 5000.0,
        "kv_pool_mib_per_gpu": 55000.0,
    }
    trace.write(path, identity(), records(), {"memory": memory})

    row = aggregate.summarize([path]).row(0, named=True)

    assert {name: row[name] for name in aggregate.MEMORY_COLUMNS} == memory


def test_summary_sorted_by_model_mode_input_len_qps(tmp_path: Path) -> None:
    cells = [
        identity("qwen-7b", "single", 8.0, 10),
        identity("qwen-7b", "single", 2.0, 20),
        identity("qwen-7b", "single", 4.0, 10),
        identity("command-r", "single", 2.0, 10),
        identity("qwen-7b", "chunked", 2.0, 10),
    ]
    paths = [write_trace(tmp_path, str(i), cell) for i, cell in enumerate(cells)]

    df = aggregate.summarize(paths)

    assert df.select("model", "mode", "input_len", "qps").rows() == [
        ("command-r", "single", 10, 2.0),
        ("qwen-7b", "chunked", 10, 2.0),
        ("qwen-7b", "single", 10, 4.0),
        ("qwen-7b", "single", 10, 8.0),
        ("qwen-7b", "single", 20, 2.0),
    ]


def test_no_traces_gives_an_empty_summary_with_all_columns() -> None:
    df = aggregate.summarize([])

    assert df.height == 0
    assert df.columns[-1] == "trace"
    assert "p99_itl_ms" in df.columns


def test_malformed_trace_error_names_the_file(tmp_path: Path) -> None:
    good = write_trace(tmp_path, "good", identity())
    bad = tmp_path / "bad.parquet"
    pq.write_table(trace.read(good).drop_columns(["end_s"]), bad)

    with pytest.raises(trace.TraceError, match="end_s") as error:
        aggregate.summarize([good, bad])

    assert str(bad) in str(error.value)


def test_all_failed_trace_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "failed.parquet"
    failed = trace.RequestRecord(
        0, False, 0.0, 0.0, error="refused", request_input_len=10, request_output_len=3
    )
    trace.write(path, identity(), [failed], {})

    with pytest.raises(metrics.MetricsError, match="all 1 measured requests failed") as error:
        aggregate.summarize([path])

    assert str(path) in str(error.value)
    assert "refused" in str(error.value)


def test_trace_with_two_cells_error_names_file_and_column(tmp_path: Path) -> None:
    first = trace.to_table(identity(qps=2.0), records(), {})
    second = trace.to_table(identity(qps=4.0), records(), {})
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.concat_tables([first, second]), path)

    with pytest.raises(trace.TraceError, match=r"column 'qps'.*2 distinct values") as error:
        aggregate.summarize([path])

    assert str(path) in str(error.value)


def outputs(tmp_path: Path) -> tuple[Path, Path, Path]:
    out = tmp_path / "summary"
    return out / "study.parquet", out / "study.csv", out / "study.html"


def test_write_summary_writes_parquet_csv_and_html(tmp_path: Path) -> None:
    df = aggregate.summarize(
        [
            write_trace(tmp_path, "a", identity("qwen<b>&", qps=2.0)),
            write_trace(tmp_path, "b", identity("qwen<b>&", qps=4.0)),
        ]
    )
    parquet, csv, html = outputs(tmp_path)

    aggregate.write_summary(df, parquet, csv, html, "Study <A> & B")

    assert pl.read_parquet(parquet).equals(df)
    rounded = df.with_columns(pl.selectors.float().round(aggregate.CSV_DECIMALS))
    assert pl.read_csv(csv, schema=df.schema).equals(rounded)
    assert not pl.read_parquet(parquet).equals(rounded)  # the Parquet keeps full precision
    text = pl.read_csv(csv, infer_schema=False)
    floats = [c for c, t in df.schema.items() if t.is_float()]
    assert all(len(v.partition(".")[2]) <= 3 for c in floats for v in text[c].drop_nulls())
    page = html.read_text(encoding="utf-8")
    assert "<title>Study &lt;A&gt; &amp; B</title>" in page
    assert "qwen&lt;b&gt;&amp;" in page and "qwen<b>" not in page
    assert page.count("<tr>") == 3  # header + two cells
    assert '<td class="num">150.00</td>' in page  # mean TTFT
    assert '<td class="num">2.00</td>' in page  # QPS
    assert '<td class="num">1</td>' in page  # failed, an integer
    for external in ("<script", "<link", "http://", "https://", "src="):
        assert external not in page
    assert sorted(p.name for p in parquet.parent.iterdir()) == [
        "study.csv",
        "study.html",
        "study.parquet",
    ]


def test_write_summary_failure_leaves_no_target_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    df = aggregate.summarize([write_trace(tmp_path, "a", identity())])
    parquet, csv, html = outputs(tmp_path)

    def fail(self: pl.DataFrame, file: Path) -> None:
        Path(file).write_text("half,a,csv")
        raise OSError("disk full")

    monkeypatch.setattr(pl.DataFrame, "write_csv", fail)
    with pytest.raises(OSError, match="disk full"):
        aggregate.write_summary(df, parquet, csv, html, "t")

    assert list(parquet.parent.iterdir()) == []


def test_write_summary_failure_keeps_previous_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    df = aggregate.summarize([write_trace(tmp_path, "a", identity())])
    parquet, csv, html = outputs(tmp_path)
    aggregate.write_summary(df, parquet, csv, html, "old")
    before = {p: p.read_bytes() for p in (parquet, csv, html)}

    def fail(self: pl.DataFrame, file: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(pl.DataFrame, "write_csv", fail)
    with pytest.raises(OSError, match="disk full"):
        aggregate.write_summary(df.head(0), parquet, csv, html, "new")

    assert {p: p.read_bytes() for p in (parquet, csv, html)} == before
    assert len(list(parquet.parent.iterdir())) == 3


def test_repeats_merge_into_one_row_with_a_t_interval(tmp_path: Path) -> None:
    paths = [write_trace(tmp_path, f"s{seed}", identity(seed=seed)) for seed in (0, 1, 2)]
    df = aggregate.summarize(paths)
    assert df.height == 1
    row = df.row(0, named=True)
    assert row["repeats"] == 3 and row["seed"] == 0
    # Three identical traces: the mean is theirs and the interval has no width.
    assert row["mean_ttft_ms_lo"] == row["mean_ttft_ms"] == row["mean_ttft_ms_hi"]


def test_one_seed_gets_a_reproducible_bootstrap_interval(tmp_path: Path) -> None:
    path = write_trace(tmp_path, "a", identity())
    first = aggregate.summarize([path]).row(0, named=True)
    assert first["repeats"] == 1
    # TTFTs 100 and 200 ms: resampled means lie between them.
    assert 100.0 <= first["mean_ttft_ms_lo"] < first["mean_ttft_ms_hi"] <= 200.0
    assert first == aggregate.summarize([path]).row(0, named=True)


def test_bootstrap_statistics_from_sorted_resamples_are_numpys_to_the_last_bit():
    """The bootstrap reads the median and the P99 from sorted resamples: the same floats as
    NumPy's median and linear percentile, at every sample size, infinities included."""
    rng = np.random.default_rng(3)
    for n in (*range(1, 260), 999, 1000, 1001):
        resamples = rng.lognormal(0, 1, (5, n))
        resamples[rng.random(resamples.shape) < 0.02] = np.inf
        ordered = np.sort(resamples, axis=1)
        with np.errstate(invalid="ignore"):  # inf - inf between two infinities: NaN
            numpy_values = (
                ("mean", resamples.mean(axis=1)),
                ("median", np.median(resamples, axis=1)),
                ("p99", np.percentile(resamples, 99, axis=1)),
            )
        for name, numpy_value in numpy_values:
            got = intervals._statistic(resamples, ordered, name)
            assert np.array_equal(got, numpy_value, equal_nan=True), (name, n)
