"""The Arrow tables of ``frames``: their schemas (from the generated column layouts,
``_generated/tables.py``) and the tables made from what the scan took.

A stream with a ``frames_layout`` comes as the scan's columns, a chunk per block,
which become Arrow arrays over the same buffers (no copy, no Python object per value);
a stream without one (``runtime_environment``, whose ``parallel`` map has one level)
comes as the taken lines' objects, which are few.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from traceml_records._frames_read import FramesError
from traceml_records._generated.tables import LONG_TABLES, TABLE_STREAM, TABLES
from traceml_records._scan_py import Column

_TYPES: dict[str, Any] = {
    "int64": pa.int64(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "string": pa.string(),
}


def arrow_schema(table: str) -> Any:
    """The ``pyarrow.Schema`` of ``table`` (a stream name or ``step_time_phases``)."""
    try:
        columns = TABLES[table]
    except KeyError:
        known = ", ".join(TABLES)
        raise FramesError(f"unknown table {table!r} (known: {known})") from None
    return pa.schema([pa.field(n, _type(t), nullable=null) for n, t, null in columns])


def _type(name: str) -> Any:
    """An Arrow type from its generated name: int64, float64, bool, string, list<T>."""
    if name.startswith("list<") and name.endswith(">"):
        return pa.list_(_type(name[5:-1]))
    return _TYPES[name]


def long_tables(stream: str) -> list[str]:
    """The long tables of ``stream`` (``step_time_phases`` for step_time)."""
    return [name for name in LONG_TABLES if TABLE_STREAM[name] == stream]


def from_columns(stream: str, chunks: list[Any]) -> dict[str, Any]:
    """Every table of ``stream`` from the scan's chunks of columns."""
    tables = {stream: _table(arrow_schema(stream), [top for top, _ in chunks])}
    for name in long_tables(stream):
        tables[name] = _table(arrow_schema(name), [rows for _, rows in chunks if rows])
    return tables


def _table(schema: Any, chunks: list[tuple[Column, ...]]) -> Any:
    """A table of ``schema`` from the scan's columns, a chunk per block."""
    columns = []
    for i, fld in enumerate(schema):
        arrays = []
        for chunk in chunks:
            valid, values, offsets, length, nulls = chunk[i]
            buffers = [None if valid is None else pa.py_buffer(valid)]
            if offsets is not None:
                buffers.append(pa.py_buffer(offsets))
            buffers.append(pa.py_buffer(values))
            arrays.append(pa.Array.from_buffers(fld.type, length, buffers, null_count=nulls))
        columns.append(pa.chunked_array(arrays, type=fld.type))
    return pa.Table.from_arrays(columns, schema=schema)


def from_objects(stream: str, objects: list[dict[str, Any]]) -> dict[str, Any]:
    """Every table of ``stream`` from the taken lines' objects (valid lines: each
    value has its column's kind, an integer written ``1.0`` aside)."""
    names = [name for name, _, _ in TABLES[stream]]
    tables = {
        stream: _rows_table(arrow_schema(stream), [[d.get(n) for n in names] for d in objects])
    }
    for table in long_tables(stream):
        source, key_names = LONG_TABLES[table]
        schema = arrow_schema(table)
        at = schema.names.index(key_names[0])
        keys = schema.names[:at]
        leaves = schema.names[at + len(key_names) :]
        rows: list[list[Any]] = []
        for d in objects:
            head = [d.get(k) for k in keys]
            for path, leaf in _entries(d.get(source), len(key_names)):
                rows.append([*head, *path, *(leaf.get(name) for name in leaves)])
        tables[table] = _rows_table(schema, rows)
    return tables


def _entries(value: Any, depth: int) -> list[tuple[list[str], dict[str, Any]]]:
    """(the keys on the way, the object) of each object ``depth`` map levels down
    (none where a nullable map is null), in the line's order."""
    if not isinstance(value, dict):
        return []
    if depth == 0:
        return [([], value)]
    return [
        ([key, *path], leaf)
        for key, inner in value.items()
        for path, leaf in _entries(inner, depth - 1)
    ]


def _rows_table(schema: Any, rows: list[list[Any]]) -> Any:
    """A table of ``schema`` from rows of values in its columns' order."""
    arrays = []
    for i, fld in enumerate(schema):
        values = [row[i] for row in rows]
        if fld.type == pa.int64():
            values = [None if v is None else int(v) for v in values]
        arrays.append(pa.array(values, fld.type))
    return pa.Table.from_arrays(arrays, schema=schema)
