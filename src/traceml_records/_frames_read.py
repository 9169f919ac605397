"""Reading one stream's export file for ``frames``: where the file is, its bytes, the
one scan of it (``_scan.FileScan``) and what was wrong in it, in the scan's words.

The file is read into memory once (never memory-mapped: a file truncated or rewritten
while it is mapped kills the reader with SIGBUS), then scanned: the lines the scan
takes (valid, key new, before the first closing line) go to the tables' columns (or,
for a stream whose long table the columns cannot hold, to objects); every other
complete line is counted under one reason of :data:`~traceml_records._scan.REASONS`.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traceml_records._fastcheck import frames_layout
from traceml_records._generated.checks import CLOSING_CHECK
from traceml_records._generated.tables import TABLE_STREAM, TABLES
from traceml_records._scan import REASONS, FileScan, FileState

MAX_RAISED = 5
"""Problems named in the message of ``validate=True``'s :class:`FramesError`."""


class FramesError(ValueError):
    """The input cannot be loaded; the message is one line naming the file."""


# --------------------------------------------------------------------------- paths


def export_folder(folder: Path) -> Path:
    """The folder holding the ``<stream>.jsonl`` files of a run, export or aggregator
    folder (``folder`` itself when it is none of those)."""
    if (folder / "aggregator" / "export").is_dir():
        return folder / "aggregator" / "export"
    if folder.name == "aggregator" and (folder / "export").is_dir():
        return folder / "export"
    return folder


def stream_of(table: str) -> str:
    """The stream a table (a stream's own or a long table) comes from."""
    try:
        return TABLE_STREAM[table]
    except KeyError:
        known = ", ".join(TABLES)
        raise FramesError(f"unknown table {table!r} (known: {known})") from None


def file_for(source: str | os.PathLike[str], stream: str) -> Path:
    """The file of ``stream`` that ``source`` (a file, or a run/export folder) names."""
    p = Path(source)
    if p.is_file():
        return p  # a file given by name is read as ``stream`` whatever it is called
    if not p.exists():
        raise FramesError(f"{p}: no such file or folder")
    path = export_folder(p) / f"{stream}.jsonl"
    if not path.is_file():
        raise FramesError(f"{p}: no {stream}.jsonl here (was the {stream} stream exported?)")
    return path


def _read(path: Path) -> bytes:
    """The file's bytes, read (not mapped) at once.

    A file that is appended, truncated or rewritten while it is read gives whatever
    bytes ``read`` returned, never a signal: the scan reads them up to their last
    newline, and a line made of two versions is a bad line as any other.
    """
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise FramesError(f"{path}: cannot read ({exc.strerror or exc})") from None


# --------------------------------------------------------------------------- the scan


class _Problems:
    """Every problem the scan tells (``_scan.Report``), as ``file:line: /pointer:
    message``: what ``validate=True`` raises."""

    def __init__(self, display: str) -> None:
        self.display = display
        self.found: list[str] = []

    def problem(self, line: int, pointer: str, message: str) -> None:
        self.found.append(f"{self.display}:{line}: {pointer or '/'}: {message}")

    def repeat(self, line: int, key: tuple[Any, ...], shown: str) -> None:
        self.found.append(f"{self.display}:{line}: /: duplicate key {shown}")

    def data(self, d: dict[str, Any], line: int) -> None:
        """A valid data line: nothing more to check in one file."""


@dataclass(frozen=True)
class Scanned:
    """One file as the scan read it."""

    state: FileState
    chunks: list[Any] | None
    """The taken lines' columns, a chunk per block (``frames_layout``), or None."""
    objects: list[dict[str, Any]]
    """The taken lines' objects, where the stream has no ``frames_layout``."""


def scan(path: Path, stream: str, *, validate: bool) -> Scanned:
    """Scan ``path`` as ``stream``'s file; with ``validate``, raise :class:`FramesError`
    for any problem ``traceml validate`` finds in the file on its own (a partial last
    line and a missing closing line apart: the file may still be being written)."""
    data = _read(path)
    layout = frames_layout(stream)
    report = _Problems(str(path)) if validate else None
    fs = FileScan(stream, layout=layout, objects=layout is None, report=report, display=str(path))
    try:
        out = fs.read_bytes(data)
    except OverflowError:  # a string column past its 32-bit offsets: a line of 2 GiB
        raise FramesError(f"{path}: a line longer than an Arrow string column holds") from None
    st = fs.state
    if report is not None:
        found = [*report.found, *_closing_notes(path, stream, st, strict=True)]
        if found:
            command = shlex.join(["traceml", "validate", str(path)])
            more = f" (and more; run {command})" if len(found) > MAX_RAISED else ""
            raise FramesError("; ".join(found[:MAX_RAISED]) + more)
    if layout is None:
        return Scanned(st, None, out)
    return Scanned(st, out, [])


# ----------------------------------------------------------------- what was wrong


def closing_of(state: FileState) -> dict[str, Any] | None:
    """The first closing line's keys, in the schema's order (the closing line of the
    run whose lines are the rows)."""
    closing = state.closing
    if closing is None:
        return None
    return {k: closing[k] for k in CLOSING_CHECK.names if closing.get(k) is not None}


def problems(path: Path, stream: str, state: FileState) -> tuple[str, ...]:
    """What was wrong in the file: the first line of each reason a line was left out
    (``file:line: what (first of N line(s) left out: <REASONS>)``), then what the
    closing line says that the file does not."""
    out = []
    for reason, phrase in REASONS.items():
        n = state.bad.get(reason, 0)
        if n:
            line, what, _ = state.first[reason]
            out.append(f"{path}:{line}: {what} (first of {n} line(s) left out: {phrase})")
    out += _closing_notes(path, stream, state, strict=False)
    return tuple(out)


def _closing_notes(path: Path, stream: str, state: FileState, *, strict: bool) -> list[str]:
    """The first closing line against the file: its stream, its count and (``strict``,
    ``validate=True``) that it is the last line."""
    closing, line = state.closing, state.closing_line
    if closing is None or line is None:
        return []
    out = []
    if strict and line != state.lines:
        out.append(f"{path}:{line}: /: closing line is not the last line")
    if closing.get("stream") != stream:
        out.append(f"{path}:{line}: /stream: a closing line of {closing.get('stream')!r}")
    written = closing.get("written_records")
    if written != state.data_lines:
        out.append(
            f"{path}:{line}: /written_records: the closing line says {written!r} data "
            f"line(s), the file has {state.data_lines} before it"
        )
    return out
