"""The trace file: round trip, schema violations named by file and column, atomic writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from servematrix.spec import trace

IDENTITY = trace.CellIdentity(
    backend="simulator",
    recipe="v1",
    model="qwen2.5-7b",
    mode="single",
    dataset="random",
    qps=2.0,
    input_len=1024,
    output_len=3,
    num_prompts=2,
    seed=0,
)
METADATA = {"cell": {"qps": 2.0}, "versions": {"servematrix": "0.1.0"}, "host": "box"}


def records() -> list[trace.RequestRecord]:
    return [
        trace.RequestRecord(
            request_id=0,
            warmup=True,
            scheduled_s=-1.0,
            sent_s=-1.0,
            first_token_s=-0.9,
            end_s=-0.9,
            chunk_s=[-0.9],
            chunk_tokens=[1],
            prompt_tokens=1024,
            completion_tokens=1,
            success=True,
            request_input_len=1024,
            request_output_len=1,
        ),
        trace.RequestRecord(
            request_id=1,
            warmup=False,
            scheduled_s=0.0,
            sent_s=0.001,
            first_token_s=0.1,
            end_s=0.3,
            chunk_s=[0.1, 0.3],
            chunk_tokens=[1, 2],
            prompt_tokens=1024,
            completion_tokens=3,
            success=True,
            request_input_len=1024,
            request_output_len=3,
        ),
        trace.RequestRecord(
            request_id=2,
            warmup=False,
            scheduled_s=0.5,
            sent_s=0.5,
            error="HTTP 503: Service Unavailable",
            request_input_len=1024,
            request_output_len=3,
        ),
    ]


def write_table(path: Path, table: pa.Table) -> Path:
    pq.write_table(table, path)
    return path


def good_table() -> pa.Table:
    return trace.to_table(IDENTITY, records(), METADATA)


def test_round_trip_keeps_rows_and_metadata(tmp_path: Path) -> None:
    path = tmp_path / "cells" / "cell.parquet"
    trace.write(path, IDENTITY, records(), METADATA)

    table = trace.read(path)

    assert table.schema.names == trace.SCHEMA.names
    rows = table.to_pylist()
    assert len(rows) == 3
    for row, record in zip(rows, records(), strict=True):
        assert {name: row[name] for name in trace.REQUEST_COLUMNS} == vars(record)
        assert {name: row[name] for name in trace.IDENTITY_COLUMNS} == vars(IDENTITY)
    assert trace.read_metadata(path) == METADATA


def test_write_returns_the_table_read_returns(tmp_path: Path) -> None:
    """A capacity probe summarizes the table `write` returned instead of reading it back."""
    for rows in (records(), []):
        path = tmp_path / f"cell{len(rows)}.parquet"
        written = trace.write(path, IDENTITY, rows, METADATA)
        assert written.equals(trace.read(path))
        assert trace.metadata_of(written.schema, path) == METADATA


def test_read_missing_column_names_file_and_column(tmp_path: Path) -> None:
    path = write_table(tmp_path / "t.parquet", good_table().drop_columns(["sent_s"]))

    with pytest.raises(trace.TraceError, match=r"column 'sent_s'.*missing") as error:
        trace.read(path)

    assert error.value.path == str(path)
    assert error.value.column == "sent_s"
    assert str(path) in str(error.value)


def test_read_wrong_type_names_file_and_column(tmp_path: Path) -> None:
    table = good_table()
    index = table.schema.get_field_index("prompt_tokens")
    as_float = table.column("prompt_tokens").cast(pa.float64())
    path = write_table(tmp_path / "t.parquet", table.set_column(index, "prompt_tokens", as_float))

    with pytest.raises(trace.TraceError, match="has type double, expected int32") as error:
        trace.read(path)

    assert error.value.column == "prompt_tokens"
    assert str(path) in str(error.value)


def test_read_unequal_list_lengths_names_file_and_column(tmp_path: Path) -> None:
    table = good_table()
    index = table.schema.get_field_index("chunk_tokens")
    tokens = pa.array([[1], [1, 2], [7]], type=pa.list_(pa.int32()))
    path = write_table(tmp_path / "t.parquet", table.set_column(index, "chunk_tokens", tokens))

    with pytest.raises(trace.TraceError, match="row 2 has 1 chunk_tokens but 0 chunk_s") as error:
        trace.read(path)

    assert error.value.column == "chunk_tokens"
    assert str(path) in str(error.value)


def test_read_null_in_non_nullable_column_names_file_and_column(tmp_path: Path) -> None:
    table = good_table()
    index = table.schema.get_field_index("sent_s")
    sent = pa.array([-1.0, None, 0.5], type=pa.float64())
    path = write_table(tmp_path / "t.parquet", table.set_column(index, "sent_s", sent))

    with pytest.raises(trace.TraceError, match="1 null value") as error:
        trace.read(path)

    assert error.value.column == "sent_s"
    assert str(path) in str(error.value)


def test_read_nulls_allowed_in_nullable_columns(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    trace.write(path, IDENTITY, records(), METADATA)

    table = trace.read(path)

    assert table.column("first_token_s").null_count == 1
    assert table.column("error").null_count == 2


def test_preemptions_round_trip_and_default_to_null(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    rows = records()
    rows[1].preemptions = 2  # the simulator knows; the others stay None (a client cannot)
    trace.write(path, IDENTITY, rows, METADATA)

    assert trace.read(path).column("preemptions").to_pylist() == [None, 2, None]


def test_a_trace_written_before_preemptions_reads_with_them_null(tmp_path: Path) -> None:
    older = good_table().drop_columns(["preemptions"])
    path = write_table(tmp_path / "t.parquet", older.replace_schema_metadata(None))

    table = trace.read(path)

    assert table.schema.names == trace.SCHEMA.names
    assert table.schema.field("preemptions").type == pa.int32()
    assert table.column("preemptions").to_pylist() == [None, None, None]


def test_read_not_parquet_names_file(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    path.write_text("backend,recipe\nsimulator,v1\n")

    with pytest.raises(trace.TraceError, match="not a readable Parquet file") as error:
        trace.read(path)

    assert error.value.path == str(path)
    assert error.value.column is None
    assert str(path) in str(error.value)


def test_read_missing_file_names_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.parquet"

    with pytest.raises(trace.TraceError, match="no such file") as error:
        trace.read(path)

    assert error.value.path == str(path)


def test_read_metadata_missing_document_names_file(tmp_path: Path) -> None:
    path = write_table(tmp_path / "t.parquet", good_table().replace_schema_metadata({}))

    with pytest.raises(trace.TraceError, match="metadata document") as error:
        trace.read_metadata(path)

    assert str(path) in str(error.value)


def test_write_rejects_unequal_lists_and_leaves_nothing(tmp_path: Path) -> None:
    bad = records()
    bad[1].chunk_tokens = [1]
    path = tmp_path / "t.parquet"

    with pytest.raises(trace.TraceError, match="row 1 has 1 chunk_tokens but 2 chunk_s") as error:
        trace.write(path, IDENTITY, bad, METADATA)

    assert str(path) in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_write_failure_leaves_no_temp_file_and_keeps_old_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.parquet"
    trace.write(path, IDENTITY, records(), METADATA)
    before = path.read_bytes()

    def write_half_then_fail(table: pa.Table, where: str, **options: object) -> None:
        Path(where).write_bytes(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        trace.write(path, IDENTITY, records()[:1], {"other": True})

    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]
    assert path.read_bytes() == before


def test_write_failure_on_new_path_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(table: pa.Table, where: str, **options: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", fail)
    with pytest.raises(OSError, match="disk full"):
        trace.write(tmp_path / "t.parquet", IDENTITY, records(), METADATA)

    assert list(tmp_path.iterdir()) == []


def test_read_null_inside_a_list_names_the_column(tmp_path: Path) -> None:
    table = good_table()
    index = table.schema.get_field_index("chunk_s")
    chunks = pa.array([[0.1, None]] * table.num_rows, type=pa.list_(pa.float64()))
    tokens = pa.array([[1, 1]] * table.num_rows, type=pa.list_(pa.int32()))
    table = table.set_column(index, "chunk_s", chunks)
    table = table.set_column(table.schema.get_field_index("chunk_tokens"), "chunk_tokens", tokens)
    path = write_table(tmp_path / "t.parquet", table)
    with pytest.raises(trace.TraceError, match=r"column 'chunk_s': has null values inside"):
        trace.read(path)


def test_write_rejects_a_null_in_a_required_column(tmp_path: Path) -> None:
    bad = records()
    bad[0].sent_s = None
    target = tmp_path / "t.parquet"
    with pytest.raises(trace.TraceError, match=r"column 'sent_s'"):
        trace.write(target, IDENTITY, bad, {})
    assert list(tmp_path.iterdir()) == []


def test_read_keeps_extra_columns_after_the_contract(tmp_path: Path) -> None:
    table = good_table()
    table = table.append_column("server_queue_ms", pa.array([1.5] * table.num_rows))
    path = write_table(tmp_path / "t.parquet", table)
    read = trace.read(path)
    assert read.column_names[-1] == "server_queue_ms"
    assert read.column_names[: len(trace.SCHEMA.names)] == trace.SCHEMA.names


def test_read_metadata_of_a_non_parquet_file_names_it(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    path.write_text("not parquet")
    with pytest.raises(trace.TraceError, match=r"t\.parquet"):
        trace.read_metadata(path)


def test_written_trace_is_readable_by_others(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    trace.write(path, IDENTITY, records(), {})
    assert path.stat().st_mode & 0o044 == 0o044


def test_metadata_is_strict_json_with_an_infinite_qps(tmp_path: Path) -> None:
    """``qps: inf`` must not write Python's ``Infinity``, which strict JSON parsers refuse."""
    path = tmp_path / "t.parquet"
    trace.write(path, IDENTITY, records(), {"cell": {"workload": {"qps": math.inf}}, "n": [1.5]})
    document = pq.read_schema(path).metadata[trace.METADATA_KEY].decode()
    assert "Infinity" not in document
    assert json.loads(document, parse_constant=pytest.fail) == {
        "cell": {"workload": {"qps": "inf"}},
        "n": [1.5],
    }


def test_only_text_columns_are_dictionary_encoded(tmp_path):
    """The floats of a trace are nearly all distinct: only its text columns get a dictionary."""
    path = tmp_path / "cell.parquet"
    trace.write(path, IDENTITY, records(), {})
    meta = pq.ParquetFile(path).metadata
    encoded = {
        meta.schema.column(i).path.split(".")[0]
        for i in range(meta.num_columns)
        if "RLE_DICTIONARY" in meta.row_group(0).column(i).encodings
        or "PLAIN_DICTIONARY" in meta.row_group(0).column(i).encodings
    }
    assert encoded == {"backend", "recipe", "model", "mode", "dataset", "error"}
