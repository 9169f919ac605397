"""The one scan of the export files: a file, from where the last read stopped, to the
values of its valid lines and one :class:`FileState`.

Every reader of the export files reads them with it: ``traceml validate``, ``frames``,
the run summary (``traceml summary``, ``--follow``, the dashboard from files) and the
launcher's tally. A :class:`FileScan` reads a file in blocks from ``state.offset`` (a
file may still be growing: the bytes after its last newline are a line still being
written, read again next time) and sorts every complete line, numbered from 1:

* a data line that holds a valid line's values (``_linecheck.data_line``: its schema
  and the rules on its values; how it is written aside: key order, maps' order, an
  integer written ``1.0``), whose key is new (where keys are unique) and that comes
  before the closing line is taken: its values go to the columns of a :class:`~._scan_py.Layout`,
  or its object to a list, or it is only counted;
* a closing line (``is_closing``: an object whose ``closing`` is ``true``) closes the
  file; any other line is a bad line, counted under one reason of :data:`REASONS`,
  the one vocabulary of what is wrong in every report.

Most lines never reach Python: the scan's core (``_fastcheck.core_for``: the C checker
of ``_speedups``, or its pure-Python twin ``_scan_py.Checker``) takes the lines it can
vouch for in one call and stops at the first other one, which the scan's own step
(:meth:`FileScan._line`) parses, sorts and, when it is valid after all (written with
white space, say), takes as the core would have. Without the C extension (or with
``TRACEML_PURE_PYTHON=1``) the twin takes every valid line; the columns and the state
are the same either way (tests/traceml_records/test_scan.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO, Protocol

import attrs
import orjson

from traceml_records._errors import describe
from traceml_records._fastcheck import core_for, keys_for
from traceml_records._generated.checks import CHECKS
from traceml_records._linecheck import check_closing, closing_valid, data_line, said
from traceml_records._lines import CLOSING_KEY, closing_of, is_closing
from traceml_records._scan_py import Checker as TwinChecker
from traceml_records._scan_py import Columns, Layout

REASONS: dict[str, str] = {
    "not_json": "not a JSON object",
    "invalid": "impossible values",
    "repeated_key": "repeat the key of an earlier line",
    "after_closing": "after the first closing line",
    "extra_closing": "more than one closing line",
}
"""Why a complete line is not taken, by name: the one vocabulary of every report.
``not_json``: not one JSON object (broken JSON, NaN or Infinity, which orjson does
not parse, an array, a blank line); ``invalid``: an object with a value or a key no
valid line of the stream has (``traceml validate`` says which); ``repeated_key``: a
data line whose key an earlier taken line has; ``after_closing``: a data line after
the first closing line (two runs in one file); ``extra_closing``: a second closing
line."""

BLOCK_BYTES = 1 << 20
"""Bytes read from a file at a time: the core's per-call cost is nothing at this size,
the block stays in the processor's cache between its read and its scan, and the
memory stays small whatever the file's size (a longer line gets a bigger block)."""

CHUNK_BYTES = 64 << 20
"""Bytes of lines of a file already in memory (:meth:`FileScan.read_bytes`) made into
one chunk of columns: few chunks, and no string column near its 32-bit offsets."""


@attrs.define
class FileState:
    """What the scan of one file found so far."""

    offset: int = 0
    """Bytes read: up to the end of the last complete line (the next read starts here)."""
    lines: int = 0
    """Complete lines read."""
    data_lines: int = 0
    """Data lines (JSON objects, not closing lines) before the first closing line, taken
    or not."""
    taken: int = 0
    """Lines taken (valid, key new, before the closing line)."""
    closing_lines: int = 0
    closing: dict[str, Any] | None = None
    """The first closing line's object."""
    closing_line: int | None = None
    closing_ok: bool = False
    """The first closing line passes its schema."""
    last_closing: bool = False
    """The last complete line is a closing line."""
    partial_last_line: bool = False
    """The file ends inside a line (one still being written, or cut)."""
    bad: dict[str, int] = attrs.Factory(dict)
    """Reason (:data:`REASONS`) -> lines."""
    first: dict[str, tuple[int, str, Any]] = attrs.Factory(dict)
    """Reason -> (line, what is wrong, the line's object or None) of its first line."""
    seq_back: int = 0
    """Taken lines whose seq is below their rank's previous one."""
    written_otherwise: int = 0
    """Taken lines written otherwise than the exporter writes them (keys out of order,
    maps not sorted, an integer written ``1.0``): ``traceml validate`` reports them."""
    stream: str | None = None
    """The file's stream (known from its name, or from its first data line)."""

    @property
    def written_lines(self) -> int:
        """Complete lines that are not closing lines: what a closing line counts."""
        return self.lines - self.closing_lines

    @property
    def bad_lines(self) -> int:
        return sum(self.bad.values())

    def count(self, reason: str, line: int, what: str, obj: Any = None) -> None:
        """One bad line (its first of each reason is kept)."""
        self.bad[reason] = self.bad.get(reason, 0) + 1
        if reason not in self.first:
            self.first[reason] = (line, what, obj)


class Hostname:
    """Whether the lines carry ``hostname`` (all or none, per folder): set by the first
    data line that tells, with where it is."""

    def __init__(self) -> None:
        self.value: tuple[bool, str] | None = None


class Report(Protocol):
    """What ``traceml validate`` is told besides the counts (each of its problems)."""

    def problem(self, line: int, pointer: str, message: str) -> None: ...
    def repeat(self, line: int, key: tuple[Any, ...], shown: str) -> None: ...
    def data(self, d: dict[str, Any], line: int) -> None: ...


def shown_key(fields: tuple[str, ...], key: tuple[Any, ...]) -> str:
    """A key as every report writes it: ``global_rank=0, step=1``."""
    return ", ".join(f"{f}={v!r}" for f, v in zip(fields, key, strict=True))


class FileScan:
    """One file, read as it grows (see the module's docstring).

    ``stream``: the file's stream (None: its first data line says it; ``validate``
    only). ``layout``: the columns to fill; ``objects``: keep the taken lines' objects
    instead; neither: only count. ``check=False`` only tells data lines from closing
    lines (the launcher's tally: nothing is parsed but what may be a closing line).
    ``hostname``: shared by the files of a folder (validate), else one per file.
    ``report``: told every problem (validate); ``watch``: keys whose first line the
    keys note (validate's second look at a file with repeated keys).
    """

    def __init__(
        self,
        stream: str | None,
        *,
        layout: Layout | None = None,
        objects: bool = False,
        check: bool = True,
        hostname: Hostname | None = None,
        report: Report | None = None,
        display: str = "",
        watch: Iterable[tuple[Any, ...]] = (),
    ) -> None:
        self.state = FileState(stream=stream)
        self.layout = layout
        self.objects = objects
        self.check = check
        self.hostname = hostname if hostname is not None else Hostname()
        self.report = report
        self.display = display
        self._keys: Any = None
        self._core: Any = None
        self._columns: Columns | None = None
        self._out: list[Any] = []
        self._watch = tuple(watch)
        if stream is not None:
            self._set_stream(stream)

    def _set_stream(self, stream: str) -> None:
        self.state.stream = stream
        plan = CHECKS[stream]
        self._plan = plan
        self._keys = keys_for(stream)
        if self._watch:
            self._keys.watch(self._watch)
        core = core_for(stream, self.layout)
        # Told every line (system snapshots), validate takes the C core's lines only.
        self._core = None if self.report is not None and isinstance(core, TwinChecker) else core
        if self.layout is not None:
            self._columns = Columns(self.layout)

    @property
    def keys(self) -> Any:
        """The keys and seqs of the taken lines (None before the stream is known)."""
        return self._keys

    # ------------------------------------------------------------------ reading

    def read(
        self,
        fh: BinaryIO,
        progress: Callable[[int], None] | None = None,
        each: Callable[[list[Any]], object] | None = None,
    ) -> list[Any]:
        """Read ``fh`` from ``state.offset`` to its end: the chunks of columns (a
        layout) or the objects (``objects``) of the lines taken by this read. With
        ``each``, they are handed to it a block at a time as they are made (a big file
        is never all in memory at once), and what is returned is empty."""
        st = self.state
        fh.seek(st.offset)
        # Columns come a chunk per block: with a layout, bigger blocks, fewer chunks. A
        # follow's few new lines get a block of their size.
        block = BLOCK_BYTES if self.layout is None else 8 * BLOCK_BYTES
        try:
            left = os.fstat(fh.fileno()).st_size - st.offset
        except (OSError, AttributeError, ValueError):  # not a file: whatever it holds
            left = block
        buffer = bytearray(max(min(block, left + 1), 4096))
        kept = 0
        while True:
            with memoryview(buffer) as view:
                n = fh.readinto(view[kept:])  # type: ignore[attr-defined]
            if not n:
                break
            size = kept + n
            end = buffer.rfind(b"\n", 0, size) + 1
            if end:
                self._block(buffer, 0, end)
                st.offset += end
            kept = size - end
            buffer[:kept] = buffer[end:size]
            if kept == len(buffer):  # a line longer than the buffer
                buffer.extend(bytes(len(buffer)))
            if progress is not None:
                progress(st.offset)
            if each is not None:
                self._flush()
                if self._out:
                    out, self._out = self._out, []
                    each(out)
        st.partial_last_line = kept > 0
        self._flush()
        out, self._out = self._out, []
        if each is not None:
            if out:
                each(out)
            return []
        return out

    def read_bytes(self, data: bytes) -> list[Any]:
        """As :meth:`read`, for the whole of a file already in memory (``data``: its
        bytes from ``state.offset``), in chunks of :data:`CHUNK_BYTES` (so that no
        string column outgrows its 32-bit offsets)."""
        st = self.state
        end = data.rfind(b"\n") + 1
        pos = 0
        while pos < end:
            stop = data.find(b"\n", min(pos + CHUNK_BYTES, end) - 1, end) + 1
            self._block(data, pos, stop)
            self._flush()
            pos = stop
        st.offset += end
        st.partial_last_line = end < len(data)
        out, self._out = self._out, []
        return out

    def _flush(self) -> None:
        columns = self._columns
        if columns is not None and columns.lines:
            self._out.append(columns.take())

    def _block(self, data: bytes | bytearray, start: int, end: int) -> None:
        """The complete lines ``data[start:end]``."""
        if not self.check:
            self._count_block(data, start, end)
            return
        st = self.state
        pos = start
        while pos < end:
            hostname = self._fast_hostname()
            if hostname is not None:
                start = pos
                if self.layout is not None:
                    pos, n, top, rows = self._core.extract(data, pos, end, self._keys, hostname)
                    if n:
                        self._flush()
                        self._out.append((top, rows))
                else:
                    pos, n = self._core.scan(data, pos, end, self._keys, hostname)
                    if n and self.objects:
                        loads = orjson.loads
                        self._out.extend(map(loads, bytes(data[start:pos]).split(b"\n")[:-1]))
                if n:
                    st.lines += n
                    st.data_lines += n
                    st.taken += n
                    st.last_closing = False
                if pos >= end:
                    break
            nl = data.index(b"\n", pos, end)
            st.lines += 1
            self._line(bytes(data[pos : nl + 1]), st.lines)
            pos = nl + 1

    def _fast_hostname(self) -> int | None:
        """What the core is told of hostname, or None: the next line is the step's
        (the stream or, where lines carry it, hostname not known yet, or a closing
        line seen)."""
        st = self.state
        if self._core is None or st.closing_line is not None:
            return None
        if not self._plan.carries_hostname:
            return -1
        value = self.hostname.value
        return None if value is None else int(value[0])

    def _count_block(self, data: bytes | bytearray, start: int, end: int) -> None:
        """``check=False``: data lines told from closing lines, nothing else parsed."""
        st = self.state
        if data.find(CLOSING_KEY, start, end) < 0:
            n = data.count(b"\n", start, end)
            st.lines += n
            if st.closing_line is None:
                st.data_lines += n
            st.last_closing = False
            return
        for raw in bytes(data[start:end]).split(b"\n")[:-1]:
            st.lines += 1
            closing = closing_of(raw)
            if closing is not None:
                self._closing(closing, st.lines)
            else:
                st.last_closing = False
                if st.closing_line is None:
                    st.data_lines += 1

    # ------------------------------------------------------------------ one line

    def _problem(self, line: int, pointer: str, message: str) -> None:
        if self.report is not None:
            self.report.problem(line, pointer, message)

    def _line(self, raw: bytes, number: int) -> None:
        """One complete line the core did not take (``raw`` ends with its newline)."""
        st = self.state
        try:
            d = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            d, why = None, f"invalid JSON: {exc}"
        else:
            why = "" if type(d) is dict else f"expected object, got {describe(d)}"
        if why:
            st.last_closing = False
            st.count("not_json", number, why)
            self._problem(number, "", why)
            return
        if is_closing(d):
            self._closing(d, number)
            return
        st.last_closing = False
        after = st.closing_line is not None
        if not after:
            st.data_lines += 1
        name, valid, found, wrong = data_line(d, st.stream)
        for pointer, message in found:
            self._problem(number, pointer, message)
        if st.stream is None and name is not None:
            self._set_stream(name)
        if not valid:
            st.count("after_closing" if after else "invalid", number, said(*found[0]), d)
            return
        repeated = self._cross_line(d, number)
        if after:
            st.count("after_closing", number, "a data line after the closing line", d)
        elif wrong is not None:
            st.count("invalid", number, said(*wrong), d)
        elif repeated is not None:
            st.count("repeated_key", number, repeated, d)
        else:
            if found:
                st.written_otherwise += 1
            self._take(d)

    def _cross_line(self, d: dict[str, Any], number: int) -> str | None:
        """The cross-line rules of a line that passes its schema: its key (the key as
        shown when an earlier line has it), its rank's seq, hostname on all or none."""
        plan, keys = self._plan, self._keys
        repeated = None
        if plan.unique_keys:
            key = tuple(d.get(f) for f in plan.key_fields)  # an optional key field: None
            if not keys.add(key, number):
                repeated = shown_key(plan.key_fields, key)
                if self.report is not None:
                    self.report.repeat(number, key, repeated)
        rank, seq = d["rank"], d["seq"]
        previous = keys.seq(rank, seq)
        if previous is not None and seq < previous:
            self.state.seq_back += 1
            self._problem(number, "/seq", f"seq {seq} decreases (was {previous} for rank {rank})")
        if plan.carries_hostname:
            has = "hostname" in d
            value = self.hostname.value
            if value is None:
                self.hostname.value = (has, f"{self.display}:{number}")
            elif value[0] is not has:
                other = "absent" if has else "present"
                self._problem(
                    number,
                    "/hostname",
                    f"hostname must be on every line or none; it is {other} on {value[1]}",
                )
        if self.report is not None:
            self.report.data(d, number)
        return repeated

    def _take(self, d: dict[str, Any]) -> None:
        self.state.taken += 1
        if self._columns is not None:
            self._columns.push(d)
        elif self.objects:
            self._out.append(d)

    def _closing(self, d: dict[str, Any], number: int) -> None:
        st = self.state
        st.closing_lines += 1
        st.last_closing = True
        if st.closing_line is not None:
            st.count("extra_closing", number, f"the first is line {st.closing_line}")
            self._problem(
                number, "", f"{REASONS['extra_closing']} (the first is line {st.closing_line})"
            )
            return
        st.closing_line = number
        st.closing = d
        if not self.check:
            return
        for pointer, message in check_closing(d):
            self._problem(number, pointer, message)
        st.closing_ok = closing_valid(d)
