"""The per-request trace: one Parquet file per cell, one row per request.

The column contract is the design's trace schema; every backend writes it and everything
downstream reads only it. ``request_input_len`` and ``request_output_len`` (the workload's
planned lengths per request) joined the contract with variable-length workloads: a trace
written before them fails `check` with "column is missing"; rebuild it (the workflow does, as
the cell's parameters changed too). ``preemptions`` (how often the engine preempted the
request; null where the backend cannot know, as a real server's client cannot) came later
still and is optional on reading: a trace without it reads as all null. The file's key-value
metadata holds one JSON document describing the cell (config, command lines, versions, host,
engine parameters).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from servematrix.common.files import atomic_path

METADATA_KEY = b"servematrix"

IDENTITY_COLUMNS: dict[str, pa.DataType] = {
    "backend": pa.string(),
    "recipe": pa.string(),
    "model": pa.string(),
    "mode": pa.string(),
    "dataset": pa.string(),
    "qps": pa.float64(),
    "input_len": pa.int32(),
    "output_len": pa.int32(),
    "num_prompts": pa.int32(),
    "seed": pa.int32(),
}

REQUEST_COLUMNS: dict[str, pa.DataType] = {
    "request_id": pa.int32(),
    "warmup": pa.bool_(),
    "scheduled_s": pa.float64(),
    "sent_s": pa.float64(),
    "first_token_s": pa.float64(),
    "end_s": pa.float64(),
    "chunk_s": pa.list_(pa.float64()),
    "chunk_tokens": pa.list_(pa.int32()),
    "prompt_tokens": pa.int32(),
    "completion_tokens": pa.int32(),
    "success": pa.bool_(),
    "error": pa.string(),
    "request_input_len": pa.int32(),
    "request_output_len": pa.int32(),
    "preemptions": pa.int32(),
}

SCHEMA = pa.schema(
    [pa.field(name, dtype) for name, dtype in {**IDENTITY_COLUMNS, **REQUEST_COLUMNS}.items()]
)
_POLARS_TYPES = {
    pa.string(): pl.String,
    pa.float64(): pl.Float64,
    pa.int32(): pl.Int32,
    pa.bool_(): pl.Boolean,
    pa.list_(pa.float64()): pl.List(pl.Float64),
    pa.list_(pa.int32()): pl.List(pl.Int32),
}
POLARS_SCHEMA = pl.Schema({field.name: _POLARS_TYPES[field.type] for field in SCHEMA})
NULLABLE = {"first_token_s", "end_s", "error", "preemptions"}
OPTIONAL = {"preemptions"}
"""Columns a trace written before them lacks; `read` adds them, all null."""
LIST_COLUMNS = {"chunk_s", "chunk_tokens"}


class TraceError(ValueError):
    """A trace file that violates the schema, named with the file and the column."""

    def __init__(self, path: str | os.PathLike[str], column: str | None, message: str):
        self.path = str(path)
        self.column = column
        where = f"{self.path}, column {column!r}" if column else self.path
        super().__init__(f"malformed trace {where}: {message}")


@dataclass(frozen=True)
class CellIdentity:
    backend: str
    recipe: str
    model: str
    mode: str
    dataset: str
    qps: float
    input_len: int
    output_len: int
    num_prompts: int
    seed: int


@dataclass
class RequestRecord:
    """One request as the client (or the simulator standing in for it) saw it.

    Times are seconds on one clock whose zero is the start of the benchmark; warm-up requests
    run before it and so have negative times. ``request_input_len`` and
    ``request_output_len`` are the dataset's planned lengths (``servematrix.workload``: the
    prompt's tokens and the ``max_tokens`` sent); ``prompt_tokens`` and ``completion_tokens``
    are what the server reported. ``preemptions`` is how often the engine preempted the
    request (the simulator knows; None where the backend cannot tell).
    """

    request_id: int
    warmup: bool
    scheduled_s: float
    sent_s: float
    first_token_s: float | None = None
    end_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    success: bool = False
    error: str | None = None
    request_input_len: int = field(kw_only=True)
    request_output_len: int = field(kw_only=True)
    preemptions: int | None = field(default=None, kw_only=True)


def to_table(
    identity: CellIdentity, records: Sequence[RequestRecord], metadata: Mapping[str, Any]
) -> pa.Table:
    n = len(records)
    columns = {name: _column([value] * n, name) for name, value in asdict(identity).items()}
    for name in REQUEST_COLUMNS:
        build = _list_column if name in LIST_COLUMNS else _column
        columns[name] = build([getattr(r, name) for r in records], name)
    document = json.dumps(_strict_json(metadata), default=str, allow_nan=False)
    table = pa.table(columns).cast(SCHEMA)
    return table.replace_schema_metadata({METADATA_KEY: document})


def _column(values: list[Any], name: str) -> pa.Array:
    """Built by polars: any pyarrow conversion from Python objects imports pandas, which alone
    costs a cell job half a second."""
    return pl.Series(name, values, dtype=POLARS_SCHEMA[name]).to_arrow()


def _list_column(lists: list[list[Any]], name: str) -> pa.Array:
    """A list column from its flattened values and offsets (polars builds nested Python lists
    one element at a time: most of a trace's write time)."""
    offsets = np.zeros(len(lists) + 1, dtype=np.int32)
    np.cumsum([len(values) for values in lists], out=offsets[1:])
    flat = pl.Series(name, list(chain.from_iterable(lists)), dtype=POLARS_SCHEMA[name].inner)
    return pa.ListArray.from_arrays(pl.Series(offsets).to_arrow(), flat.to_arrow())


def _strict_json(value: Any) -> Any:
    """``value`` with every non-finite float spelled as a string (``qps: inf`` gives "inf"), so
    the metadata document is JSON that any parser reads, not Python's ``Infinity``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(item) for item in value]
    return value


DICTIONARY_COLUMNS = [
    name for name, dtype in {**IDENTITY_COLUMNS, **REQUEST_COLUMNS}.items() if dtype == pa.string()
]
"""Only the text columns are dictionary-encoded: a trace's floats are nearly all distinct, and
encoding them anyway took half the write time for a larger file (a 200,000-request probe:
266 ms and 17.0 MB with every column, 106 ms and 16.0 MB with these)."""


def write(
    path: str | os.PathLike[str],
    identity: CellIdentity,
    records: Sequence[RequestRecord],
    metadata: Mapping[str, Any],
) -> pa.Table:
    """Write atomically: a temporary file renamed into place, so no half-written trace exists.

    The table is checked as ``read`` would check it, so nothing unreadable is ever written;
    it is returned, as ``read`` would return it.
    """
    table = to_table(identity, records, metadata)
    check(table, path)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, use_dictionary=DICTIONARY_COLUMNS)
    return table


def check(table: pa.Table, path: str | os.PathLike[str]) -> None:
    """Raise TraceError unless ``table`` has every schema column, typed, without stray nulls."""
    for name, dtype in {**IDENTITY_COLUMNS, **REQUEST_COLUMNS}.items():
        if name not in table.column_names:
            if name in OPTIONAL:
                continue
            raise TraceError(path, name, "column is missing")
        actual = table.schema.field(name).type
        if actual != dtype:
            raise TraceError(path, name, f"has type {actual}, expected {dtype}")
        column = table.column(name)
        if name not in NULLABLE and column.null_count:
            raise TraceError(path, name, f"has {column.null_count} null value(s)")
        if pa.types.is_list(dtype) and pc.list_flatten(column).null_count:
            raise TraceError(path, name, "has null values inside its lists")
    lengths_s = pc.list_value_length(table.column("chunk_s"))
    lengths_tokens = pc.list_value_length(table.column("chunk_tokens"))
    mismatched = pc.not_equal(lengths_s, lengths_tokens)
    if pc.any(mismatched).as_py():
        row = pc.index(mismatched, True).as_py()
        raise TraceError(
            path,
            "chunk_tokens",
            f"row {row} has {lengths_tokens[row]} chunk_tokens but {lengths_s[row]} chunk_s",
        )


def read(path: str | os.PathLike[str]) -> pa.Table:
    """Read a trace and check it against the schema; errors name the file and the column.

    Columns beyond the contract (server-side extras) are kept, after the contract's columns;
    an `OPTIONAL` column the file lacks is added, all null.
    """
    if not os.path.isfile(path):
        raise TraceError(path, None, "no such file")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as error:
        raise TraceError(path, None, f"not a readable Parquet file ({error})") from error
    check(table, path)
    for name in OPTIONAL.difference(table.column_names):
        table = table.append_column(
            SCHEMA.field(name), pa.nulls(table.num_rows, SCHEMA.field(name).type)
        )
    extras = [name for name in table.column_names if name not in SCHEMA.names]
    return table.select([*SCHEMA.names, *extras])


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as error:
        raise TraceError(path, None, f"not a readable Parquet file ({error})") from error
    return metadata_of(schema, path)


def metadata_of(schema: pa.Schema, path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata document of a trace's schema (a file's, or a table `read` returned)."""
    meta = schema.metadata or {}
    if METADATA_KEY not in meta:
        raise TraceError(path, None, "metadata document 'servematrix' is missing")
    try:
        return json.loads(meta[METADATA_KEY])
    except json.JSONDecodeError as error:
        raise TraceError(path, None, f"metadata document is not valid JSON ({error})") from error
