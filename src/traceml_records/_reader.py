"""A typed reader for one export file, optionally following it while it is written."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import BinaryIO

from traceml_records._codec import AnyRecord, loads_line
from traceml_records._errors import Path, RecordError, json_pointer
from traceml_records._generated.records import ClosingLine
from traceml_records._lines import BLOCK_BYTES, LineSplitter


class LineError(RecordError):
    """A :class:`RecordError` on one line of a file; the message starts ``file:line:``."""

    def __init__(self, file: str, line: int, path: Path, reason: str) -> None:
        super().__init__(path, reason)
        self.file = file
        self.line = line
        self.args = (f"{file}:{line}: {json_pointer(path) or '/'}: {reason}",)


def _open_when_present(
    path: str, follow: bool, poll_interval: float, deadline: float | None
) -> BinaryIO:
    # The exporter creates every file at start; a follower may still come first.
    while True:
        try:
            return open(path, "rb")
        except FileNotFoundError:
            if not follow:
                raise
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{path}: file did not appear before the timeout") from None
            time.sleep(poll_interval)


def read_jsonl(
    path: str | os.PathLike[str],
    follow: bool = False,
    poll_interval: float = 0.2,
    timeout: float | None = None,
    strict: bool = True,
) -> Iterator[AnyRecord]:
    """Yield the typed records of one export file, its closing line included.

    Lines are parsed with :func:`loads_line`; a bad line raises :class:`LineError`
    (a :class:`RecordError`) naming ``file:line``, and so does a line after the
    closing line. An unterminated last line is a line still being written and is not
    yielded.

    ``strict`` is on by default, so the reader refuses exactly the lines ``traceml
    validate`` reports on their own (schema, key order, sorted maps and the named
    rules such as ``rank == global_rank``): what it yields is what the writer may
    write. ``strict=False`` checks the schema only, to read the values of another
    producer's lines that break a cross-field rule (cross-line rules such as unique
    keys are ``traceml validate``'s in either case).

    With ``follow=True`` the reader keeps polling every ``poll_interval`` seconds as
    the file grows (waiting for it to appear if needed) and stops after the closing
    line. ``timeout`` bounds the whole read in seconds; when it passes before the
    closing line, :class:`TimeoutError` is raised.
    """
    name = os.fspath(path)
    deadline = None if timeout is None else time.monotonic() + timeout
    with _open_when_present(name, follow, poll_interval, deadline) as f:
        lines = LineSplitter()
        closed = False
        while True:
            chunk = f.read(BLOCK_BYTES)
            if not chunk:
                if not follow or closed:
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{name}: no closing line after {timeout} s ({lines.number} lines read)"
                    )
                time.sleep(poll_interval)
                continue
            complete = lines.feed(chunk)
            for number, raw in enumerate(complete, lines.number - len(complete) + 1):
                if closed:
                    raise LineError(name, number, (), "line after the closing line")
                try:
                    record = loads_line(raw, strict)
                except RecordError as exc:
                    raise LineError(name, number, exc.path, exc.reason) from None
                if type(record) is ClosingLine:
                    closed = True
                yield record
            if closed and follow:
                return
