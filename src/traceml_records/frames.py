"""Typed tables from the export files: Arrow, pandas, polars and DuckDB.

The column layouts are generated from the JSON Schemas (``_generated/tables.py``,
documented in docs/reference/tables.md): one table per stream, and
``step_time_phases``, the ``events`` map of step_time flattened to one row per rank,
step, event and device.

Every file is read by the one scan of the export files (``traceml_records._scan``, as
``traceml validate`` and the run summary read them): its rows are the lines the scan
takes (valid, a key no earlier line has, before the first closing line), in file
order, a line's phase rows in its event and device order. Every other complete line
is left out and counted under one reason of the scan's vocabulary (``not_json``,
``invalid``, ``repeated_key``, ``after_closing``, ``extra_closing``:
:attr:`Loaded.bad`, with the first line of each in :attr:`Loaded.problems`). A last
line without its newline is left out (the exporter is writing it); the closing line
is never a row (the first one is reported: :attr:`Loaded.closing`, the table's
metadata, ``DataFrame.attrs``). With ``validate=True``, any problem ``traceml
validate`` finds in the file raises :class:`FramesError` instead.

pyarrow is needed (the ``frames`` extra); pandas, polars and duckdb only for their
own functions.

Speed: the scan's C core takes a file as the exporter writes it straight into the
tables' columns, in one pass and no Python object per line; the columns become Arrow
arrays without a copy. bench/frames.py compares it with ``pandas.read_json`` and the
untyped ``pyarrow.json.read_json``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

try:
    import pyarrow  # noqa: F401  (the extra's message before any module needs it)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "traceml_records.frames needs pyarrow: pip install 'traceml-ai[frames]'"
    ) from exc

from traceml_records._frames_read import (
    FramesError,
    closing_of,
    export_folder,
    file_for,
    problems,
    scan,
    stream_of,
)
from traceml_records._frames_tables import arrow_schema, from_columns, from_objects
from traceml_records._generated.tables import TABLE_STREAM, TABLES
from traceml_records._scan import REASONS

__all__ = [
    "REASONS",
    "TABLE_NAMES",
    "FramesError",
    "Loaded",
    "arrow_schema",
    "closing_line",
    "load",
    "load_arrow",
    "register",
    "to_pandas",
    "to_polars",
]

TABLE_NAMES: tuple[str, ...] = tuple(TABLES)
"""Every table: one per stream, plus the long tables (``step_time_phases``)."""

_META_CLOSING = b"traceml.closing"
_META_PARTIAL = b"traceml.partial_last_line"
_META_FILE = b"traceml.file"
_META_INFO = b"traceml.info"


@dataclass(frozen=True)
class Loaded:
    """What loading one stream's file gave: its tables and what was left out."""

    path: Path
    stream: str
    tables: dict[str, Any]
    """Table name -> ``pyarrow.Table`` (the stream's own and its long tables)."""
    closing: dict[str, Any] | None
    """The (first) closing line, left out of the rows; None while the file is being
    written."""
    partial_last_line: bool
    """A last line without its newline was left out (the exporter is writing it)."""
    data_lines: int = field(default=0)
    """Data lines before the closing line (what it counts), left out ones included."""
    bad: dict[str, int] = field(default_factory=dict)
    """Complete lines left out of the rows, by reason (:data:`REASONS`)."""
    bad_lines: int = field(default=0)
    """Complete lines left out of the rows, every reason: the sum of :attr:`bad`."""
    problems: tuple[str, ...] = field(default=())
    """The first line of each reason in :attr:`bad` (``file:line: what (first of N
    line(s) left out: reason)``), then what the closing line says that the file does
    not (its stream, its count)."""
    duplicate_keys: int = field(default=0)
    """Lines left out because an earlier row has their key (``bad["repeated_key"]``)."""
    earlier_closings: tuple[dict[str, Any], ...] = field(default=())
    """The closing line when more lines follow it (``{"line": n, "closing": {...}}``):
    the rows are the lines before it."""
    runs_concatenated: bool = field(default=False)
    """Lines follow the closing line (``after_closing`` or ``extra_closing``): the
    file holds more than one run, or a run went on after its closing line."""

    def info(self) -> dict[str, Any]:
        """What was left out, as JSON-able data (also in each table's metadata)."""
        return {
            "file": str(self.path),
            "closing": self.closing,
            "partial_last_line": self.partial_last_line,
            "data_lines": self.data_lines,
            "bad": dict(self.bad),
            "bad_lines": self.bad_lines,
            "problems": list(self.problems),
            "duplicate_keys": self.duplicate_keys,
            "earlier_closings": list(self.earlier_closings),
            "runs_concatenated": self.runs_concatenated,
        }


def load(
    source: str | os.PathLike[str], stream: str = "step_time", *, validate: bool = False
) -> Loaded:
    """Read one stream's file (or a run/export folder's file of that stream).

    ``stream`` may also be a long table's name (``step_time_phases``); the result
    holds every table of the stream either way. Lines the scan does not take are left
    out and counted (:attr:`Loaded.bad`). Raises :class:`FramesError` for a file that
    cannot be read, and with ``validate=True`` for any problem ``traceml validate``
    finds in the file on its own (a partial last line and a missing closing line
    apart).
    """
    stream = stream_of(stream)
    path = file_for(source, stream)
    scanned = scan(path, stream, validate=validate)
    st = scanned.state
    if scanned.chunks is not None:
        tables = from_columns(stream, scanned.chunks)
    else:
        tables = from_objects(stream, scanned.objects)
    closing = closing_of(st)
    follows = st.closing_line is not None and st.closing_line != st.lines
    earlier = ({"line": st.closing_line, "closing": closing},) if follows else ()
    loaded = Loaded(
        path,
        stream,
        tables,
        closing,
        st.partial_last_line,
        data_lines=st.data_lines,
        bad=dict(st.bad),
        bad_lines=st.bad_lines,
        problems=problems(path, stream, st),
        duplicate_keys=st.bad.get("repeated_key", 0),
        earlier_closings=earlier,
        runs_concatenated=follows,
    )
    return _finish(loaded)


def _finish(loaded: Loaded) -> Loaded:
    """The tables with what was left out in their schema metadata."""
    meta = {
        _META_CLOSING: orjson.dumps(loaded.closing),
        _META_PARTIAL: b"true" if loaded.partial_last_line else b"false",
        _META_FILE: os.fsencode(loaded.path),
        _META_INFO: orjson.dumps(loaded.info()),
    }
    for name, table in loaded.tables.items():
        loaded.tables[name] = table.replace_schema_metadata(meta)
    return loaded


def load_arrow(
    source: str | os.PathLike[str], stream: str = "step_time", *, validate: bool = False
) -> Any:
    """One table as a ``pyarrow.Table``; the closing line is in its schema metadata
    (read it back with :func:`closing_line`)."""
    return load(source, stream, validate=validate).tables[stream]


def closing_line(table: Any) -> dict[str, Any] | None:
    """The closing line left out of a table from :func:`load_arrow` (None while the
    file is still being written)."""
    meta = table.schema.metadata or {}
    raw = meta.get(_META_CLOSING)
    value = orjson.loads(raw) if raw else None
    return value if isinstance(value, dict) else None


def to_pandas(
    source: str | os.PathLike[str], stream: str = "step_time", *, validate: bool = False
) -> Any:
    """One table as a pandas DataFrame; ``df.attrs["traceml"]`` holds what was left out."""
    loaded = load(source, stream, validate=validate)
    df = loaded.tables[stream].to_pandas()
    df.attrs["traceml"] = loaded.info()
    return df


def to_polars(
    source: str | os.PathLike[str], stream: str = "step_time", *, validate: bool = False
) -> Any:
    """One table as a polars DataFrame (closing line: use :func:`load` to see it)."""
    try:
        import polars as pl
    except ImportError:
        raise ImportError("to_polars needs polars: pip install polars") from None
    return pl.from_arrow(load_arrow(source, stream, validate=validate))


def register(
    connection: Any, folder: str | os.PathLike[str], *, validate: bool = False
) -> dict[str, dict[str, Any]]:
    """Register one DuckDB view per exported stream, and ``step_time_phases``.

    Returns table name -> what was left out (closing line, partial last line), for
    the tables registered; streams not exported are not registered.
    """
    p = Path(folder)
    if not p.is_dir():
        raise FramesError(f"{p}: not a folder (give a run folder or an export folder)")
    export = export_folder(p)
    found: dict[str, dict[str, Any]] = {}
    for stream in dict.fromkeys(TABLE_STREAM.values()):
        if not (export / f"{stream}.jsonl").is_file():
            continue
        loaded = load(export, stream, validate=validate)
        for name, table in loaded.tables.items():
            connection.register(name, table)
            found[name] = loaded.info()
    if not found:
        raise FramesError(f"{p}: no export files here")
    return found
