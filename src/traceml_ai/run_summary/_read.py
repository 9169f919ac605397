"""The one reader behind ``traceml summary``: every export file, whatever its size.

A file is opened only when it is a regular file: a FIFO, a folder, a socket or a
symbolic link to nothing is reported as a problem and never read (a FIFO would block
the reader). A regular file is read in blocks and split into lines; each line is
parsed whole with orjson, and a data line is used only when every value is one a
valid line can hold: the types and ranges of its stream's schema (no negative
duration, no step 0, no rank outside the world...), which rules out NaN and Infinity
too (orjson does not parse them). What is left out is counted per file, never
averaged:

* ``unreadable_lines``: not a JSON object (a blank line, broken JSON, NaN);
* ``impossible_lines``: a JSON object with a value no valid line has;
* ``duplicate_keys``: a line whose key (``(global_rank, step)`` for step_time) an
  earlier line already had; the first line of a key counts;
* ``lines_after_closing`` and ``closing_lines``: data lines after the closing line,
  or a second closing line: two runs in one file; only the first is read.

Light to import: orjson and the schemas' bounds (never pyarrow).
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from traceml_ai.run_summary._columns import ColumnsBuilder
from traceml_ai.run_summary._phases import STEP_EVENT, phase_name, step_row, timing_problem
from traceml_records import STREAMS
from traceml_records.internal import BLOCK_BYTES, CHECKS, LineSplitter, is_closing

_FLOAT_MAX = 1.7976931348623157e308
_INT_MAX = (1 << 63) - 1

_INT, _NUMBER, _STRING, _BOOL = 0, 1, 2, 3
_Check = tuple[str, int, float, float, bool, bool]
"""One scalar field: name, kind, minimum, maximum, nullable, required."""


class FileRead:
    """What reading one export file found besides its data lines."""

    def __init__(self, stream: str, path: Path) -> None:
        self.stream = stream
        self.path = path
        self.problem: str | None = None
        """Why the file could not be read at all (not a regular file, an I/O error)."""
        self.size = 0
        self.data_lines = 0
        """Data lines before the (first) closing line, used or not."""
        self.closing: dict[str, Any] | None = None
        self.closing_lines = 0
        self.lines_after_closing = 0
        self.first_line_after_closing: int | None = None
        self.partial_last_line = False
        self.unreadable_lines = 0
        self.first_unreadable: int | None = None
        self.impossible_lines = 0
        self.first_impossible: tuple[int, str] | None = None
        self.duplicate_keys = 0
        self.first_duplicate: tuple[int, str] | None = None
        self.line = 0
        """The number of the line being read (1 for the first line of the file)."""

    @property
    def name(self) -> str:
        return self.path.name

    def impossible(self, why: str) -> None:
        self.impossible_lines += 1
        if self.first_impossible is None:
            self.first_impossible = (self.line, why)

    def duplicate(self, key: str) -> None:
        self.duplicate_keys += 1
        if self.first_duplicate is None:
            self.first_duplicate = (self.line, key)

    def problems(self) -> list[str]:
        """One line per kind of damage found in this file (empty when none)."""
        out: list[str] = []
        if self.problem is not None:
            return [f"{self.name}: {self.problem}"]
        if self.unreadable_lines:
            out.append(
                f"{self.name}: {self.unreadable_lines} unreadable line(s), not counted "
                f"(not a JSON object; first on line {self.first_unreadable})"
            )
        if self.first_impossible is not None:
            line, why = self.first_impossible
            out.append(
                f"{self.name}: {self.impossible_lines} line(s) with impossible values, "
                f"not counted (line {line}: {why})"
            )
        if self.first_duplicate is not None:
            line, key = self.first_duplicate
            out.append(
                f"{self.name}: {self.duplicate_keys} line(s) repeat the key of an earlier "
                f"line, not counted (line {line}: {key})"
            )
        if self.closing_lines > 1 or self.lines_after_closing:
            out.append(
                f"{self.name}: two runs in one file? {self.closing_lines} closing line(s) and "
                f"{self.lines_after_closing} data line(s) after the first closing line "
                f"(line {self.first_line_after_closing}); only the lines before it are counted"
            )
        if self.closing is not None:
            written = self.closing.get("written_records")
            if written != self.data_lines:
                out.append(
                    f"{self.name}: the closing line says {written!r} data line(s), "
                    f"the file has {self.data_lines}"
                )
        return out


# --------------------------------------------------------------------------- opening


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def exists(path: Path) -> bool:
    """Whether anything is at ``path``, a symbolic link to nothing included."""
    try:
        os.lstat(path)
    except OSError:
        return False
    return True


def open_regular(path: Path) -> tuple[BinaryIO | None, str | None]:
    """``(file, None)`` for a regular file; ``(None, why)`` for anything else there.

    Never blocks: a FIFO is opened without waiting for a writer (then refused).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        if os.path.islink(path):
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            return None, f"a symbolic link to {target}, which does not exist; not read"
        return None, "disappeared while being read"
    except OSError as exc:
        return None, f"cannot open it ({exc.strerror or exc}); not read"
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        return None, f"cannot read it ({exc.strerror or exc}); not read"
    if not stat.S_ISREG(mode):
        os.close(fd)
        return None, f"is {_kind(mode)}, not a file; not read"
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb"), None


def read_bytes(path: Path) -> tuple[bytes | None, str | None]:
    """A small regular file's bytes, or why not (see :func:`open_regular`)."""
    fh, problem = open_regular(path)
    if fh is None:
        return None, problem
    try:
        with fh:
            return fh.read(), None
    except OSError as exc:
        return None, f"cannot read it ({exc.strerror or exc})"


# --------------------------------------------------------------------------- growing files


_HEAD_BYTES = 256
"""Bytes at the start of a file remembered to tell a file rewritten in place."""


class Tail:
    """One export file read as it grows: each :meth:`read` reads only the bytes appended
    since the last one. A file replaced (another inode), truncated (shorter than what
    was read) or rewritten (its first bytes changed) is read again from the start,
    with a fresh ``info`` and a fresh ``sink`` (from ``make_sink``)."""

    def __init__(self, stream: str, path: Path, make_sink: Callable[[], _Sink]) -> None:
        self.stream = stream
        self.path = path
        self._make_sink = make_sink
        self.restarts = 0
        """How many times the file was found replaced or truncated and read again."""
        self._start()

    def _start(self) -> None:
        self.info = FileRead(self.stream, self.path)
        self.sink = self._make_sink()
        self._lines = LineSplitter()
        self._offset = 0
        self._identity: tuple[int, int] | None = None
        self._head = b""
        self.identity: tuple[int, int, int] | None = None
        """(device, inode, size) of the file at the last read (None: not read yet)."""

    def read(self) -> bool:
        """Read what was appended; whether anything new was read (or the file restarted,
        or could not be read)."""
        fh, problem = open_regular(self.path)
        if fh is None:
            changed = self.info.problem != problem
            self._start()
            self.info.problem = problem
            return changed
        previous = self.identity
        with fh:
            try:
                st = os.fstat(fh.fileno())
                identity = (st.st_dev, st.st_ino)
                seen = (st.st_dev, st.st_ino, st.st_size)
                restarted = False
                if self._identity is not None and (
                    identity != self._identity
                    or st.st_size < self._offset
                    or (self._head and fh.read(len(self._head)) != self._head)
                ):
                    self.restarts += 1
                    self._start()
                    restarted = True
                self.identity = seen
                if not restarted and previous == seen and self.info.problem is None:
                    return False  # unchanged since the last read
                if self.info.problem is not None:
                    self._start()
                self._identity = identity
                fh.seek(self._offset)
                self.info.size = self._offset
                reader = getattr(self.sink, "read", None)
                if reader is not None:
                    reader(fh, self.info, self._lines)
                else:
                    self.sink(_objects(fh, self.info, self._lines), self.info)
                self._offset = self.info.size - len(self._lines.pending)
                # The partial last line is read again next time (it may have grown).
                self._lines.pending = b""
                if len(self._head) < _HEAD_BYTES and self._offset:
                    fh.seek(0)
                    self._head = fh.read(min(_HEAD_BYTES, self._offset))
            except OSError as exc:
                self._start()
                self.info.problem = f"cannot read it ({exc.strerror or exc}); not counted"
        return True


_Sink = Callable[[Iterator[dict[str, Any]], FileRead], object]
"""What takes a file's new data lines (and counts into its ``FileRead``)."""


# --------------------------------------------------------------------------- lines


def _objects(fh: BinaryIO, info: FileRead, lines: LineSplitter) -> Iterator[dict[str, Any]]:
    """The data lines (dicts) before the closing line, from where ``fh`` stands; the rest
    is counted in ``info`` (lines, the partial last line and closing lines as the one
    line scanner, ``traceml_records``, defines them). ``lines`` carries the line
    numbers and a partial last line over from an earlier read of the same file."""
    loads = orjson.loads
    while True:
        block = fh.read(BLOCK_BYTES)
        if not block:
            break
        info.size += len(block)
        complete = lines.feed(block)
        for number, raw in enumerate(complete, lines.number - len(complete) + 1):
            try:
                obj = loads(raw)
            except orjson.JSONDecodeError:
                obj = None
            if _data_line(obj, number, info):
                yield obj
    # No final newline: the exporter is still writing this line.
    info.partial_last_line = lines.partial_last_line


def _data_line(obj: Any, number: int, info: FileRead) -> bool:
    """Whether line ``number``'s parsed ``obj`` (None: no JSON) is a data line to use;
    counts it in ``info`` either way."""
    if type(obj) is not dict:
        info.unreadable_lines += 1
        if info.first_unreadable is None:
            info.first_unreadable = number
        return False
    if obj.get("closing") is not None and is_closing(obj):
        info.closing_lines += 1
        if info.closing is None:
            info.closing = obj
        elif info.first_line_after_closing is None:
            info.first_line_after_closing = number
        return False
    if info.closing is not None:
        info.lines_after_closing += 1
        if info.first_line_after_closing is None:
            info.first_line_after_closing = number
        return False
    info.data_lines += 1
    info.line = number
    return True


_KINDS = {"integer": _INT, "number": _NUMBER, "string": _STRING, "boolean": _BOOL}


@functools.cache
def _checks(stream: str) -> tuple[_Check, ...]:
    """The scalar fields of ``stream``'s check plan with their kinds and bounds."""
    out: list[_Check] = []
    for f in CHECKS[stream].fields:
        kind = _KINDS.get(f.check.kind)
        if kind is None:
            continue  # objects (events) are checked by their reader
        # Integer bounds stay integers: 2**63 - 1 is not a float.
        num = int if kind == _INT else float
        low, high = f.check.minimum, f.check.maximum
        low = num(low if low is not None else (-_INT_MAX - 1 if kind == _INT else -_FLOAT_MAX))
        high = num(high if high is not None else (_INT_MAX if kind == _INT else _FLOAT_MAX))
        out.append((f.name, kind, low, high, f.check.nullable, f.required))
    return tuple(out)


def check_fields(obj: dict[str, Any], checks: tuple[_Check, ...]) -> str | None:
    """Why ``obj`` cannot be a valid line (the first wrong scalar field), or None."""
    for name, kind, low, high, nullable, required in checks:
        v = obj.get(name)
        if v is None:
            if nullable and name in obj:
                continue
            if name not in obj:
                if required:
                    return f"{name} missing"
                continue
            return f"{name} is null"
        t = type(v)
        if kind == _STRING:
            if t is not str:
                return f"{name} {v!r} is not a string"
            continue
        if kind == _BOOL:
            if t is not bool:
                return f"{name} {v!r} is not true or false"
            continue
        if t is not int and (t is not float or kind == _INT):
            return f"{name} {v!r} is not {'an integer' if kind == _INT else 'a number'}"
        if not low <= v <= high:
            if v < low:
                return f"{name} {v!r} is below {low:g}"
            if v > high:
                return f"{name} {v!r} is above {high:g}"
            return f"{name} {v!r} is not finite"
    if "world_size" in obj and not obj.get("global_rank", 0) < obj["world_size"]:
        return (
            f"global_rank {obj.get('global_rank')!r} is not below world_size {obj['world_size']!r}"
        )
    return None


@functools.cache
def _fast_check(stream: str) -> Callable[[dict[str, Any]], bool]:
    """``obj -> ok``: :func:`check_fields` of ``stream``'s checks found nothing."""
    checks = _checks(stream)
    return lambda obj: check_fields(obj, checks) is None


class DataLines:
    """The usable data lines of one (non step_time) file as it grows: checked, first of
    each key (the keys seen stay between reads), each handed to ``keep``."""

    def __init__(self, stream: str, keep: Callable[[dict[str, Any]], object]) -> None:
        self._keep = keep
        spec = next(s for s in STREAMS if s.name == stream)
        self._checks = _checks(stream)
        self._ok = _fast_check(stream)
        self._unique = "unique-key" in spec.rules
        self._fields = spec.key_fields
        self._seen: set[tuple[Any, ...]] = set()

    def __call__(self, objs: Iterable[dict[str, Any]], info: FileRead) -> None:
        keep = self._keep
        ok, checks, unique, fields, seen = (
            self._ok,
            self._checks,
            self._unique,
            self._fields,
            self._seen,
        )
        for obj in objs:
            if not ok(obj):
                info.impossible(check_fields(obj, checks) or "a value out of range")
                continue
            if unique:
                key = tuple(obj.get(f) for f in fields)
                if key in seen:
                    info.duplicate(
                        ", ".join(f"{f}={v!r}" for f, v in zip(fields, key, strict=True))
                    )
                    continue
                seen.add(key)
            keep(obj)


# --------------------------------------------------------------------------- step_time


def _step_problem(events: Any) -> str:
    """Why :func:`step_row` took no row of a line's events."""
    if type(events) is not dict or STEP_EVENT not in events:
        return f"events without {STEP_EVENT}"
    for event, devices in events.items():
        problem = timing_problem(event, devices)
        if problem is not None:
            return problem
    return "events: bad timing"


_BAD_FIELDS, _BAD_EVENTS = 1, 2


def step_line(
    obj: dict[str, Any],
    checks: tuple[_Check, ...],
    step_event: str,
    name_of: Callable[[str], str | None],
    cache: dict[str, str | None],
    ranks: object = None,
    worlds: object = None,
) -> tuple[int, int, int, int, dict[str, float]] | int | None:
    """One step_time line's ``(global_rank, step, world_size, node_rank, row)`` (the row
    with ``_ts``, the step's end, and ``_tokens`` when the line has tokens), or 1 when a scalar field cannot be a valid line's, 2
    when its events cannot (:func:`check_fields` and :func:`_step_problem` say why).
    The pure-Python twin of ``_rowscan.step_line``, which also appends the common row to
    its rank's builder in ``ranks`` itself (and then returns None); this one leaves
    every row to the caller."""
    if not _fast_check("step_time")(obj):
        return _BAD_FIELDS
    row = step_row(obj.get("events"), name_of, cache)
    if row is None:
        return _BAD_EVENTS
    row["_ts"] = float(obj["timestamp_unix_ns"])
    tokens = obj.get("tokens")
    if tokens is not None:  # the step's tokens, when the line has them
        row["_tokens"] = float(tokens)
    return obj["global_rank"], obj["step"], obj["world_size"], obj["node_rank"], row


def _step_line() -> Callable[..., tuple[int, int, int, int, dict[str, float]] | int | None]:
    """The C ``step_line`` when built (and not turned off), else the Python twin."""
    module = _rowscan()
    found: Callable[..., tuple[int, int, int, int, dict[str, float]] | int | None] = (
        module.step_line if module is not None else step_line
    )
    return found


class StepLines:
    """The step rows of one step_time file as it grows, kept as columns, and the world
    sizes its lines name.

    Minimal work per line: the scalar fields against the schema, every phase timing
    (finite, not negative, at least one call), the key; a row per usable line.
    """

    def __init__(self) -> None:
        self.columns = ColumnsBuilder()
        self.worlds: set[int] = set()
        self._names: dict[str, str | None] = {}
        self.lines = 0
        """Rows taken so far (a caller sees whether anything changed)."""

    def __call__(self, objs: Iterable[dict[str, Any]], info: FileRead) -> None:
        checks = _checks("step_time")
        scan = _step_line()
        names = self._names
        ranks = self.columns.ranks
        worlds = self.worlds
        for obj in objs:
            found = scan(obj, checks, STEP_EVENT, phase_name, names, ranks, worlds)
            self._take(found, obj, info, checks)

    def _take(self, found: Any, obj: dict[str, Any], info: FileRead, checks: Any) -> None:
        """Count or add what ``step_line`` found of ``obj``."""
        if found is None:  # appended by the C reader
            self.lines += 1
            return
        if type(found) is int:
            if found == _BAD_FIELDS:
                info.impossible(check_fields(obj, checks) or "a value out of range")
            else:
                info.impossible(_step_problem(obj.get("events")))
            return
        rank, step, world, node, row = found
        columns = self.columns
        mine = columns.ranks.get(rank)
        if mine is None:
            columns.add(rank, step, row)
            mine = columns.ranks[rank]
        elif not mine.add(step, row):
            info.duplicate(f"global_rank={rank}, step={step}")
            return
        mine.node = node
        self.worlds.add(world)
        self.lines += 1

    def read(self, fh: BinaryIO, info: FileRead, lines: LineSplitter) -> None:
        """Read ``fh`` from where it stands (as ``self(_objects(fh, info, lines), info)``):
        with the C reader, a block's usual lines are parsed and appended in one call,
        and only the others come back here one by one."""
        module = _rowscan()
        if module is None:
            self(_objects(fh, info, lines), info)
            return
        scan_lines, step_line = module.scan_lines, module.step_line
        loads = orjson.loads
        checks = _checks("step_time")
        names, ranks, worlds = self._names, self.columns.ranks, self.worlds
        while block := fh.read(BLOCK_BYTES):
            info.size += len(block)
            complete = lines.feed(block)
            first = lines.number - len(complete) + 1
            i, end = 0, len(complete)
            while i < end:
                if info.closing is not None:
                    j, obj = i, _parsed(complete[i])  # after the closing line: counted
                else:
                    j, obj = scan_lines(
                        complete, i, loads, checks, STEP_EVENT, phase_name, names, ranks, worlds
                    )
                    if j > i:
                        info.data_lines += j - i
                        info.line = first + j - 1
                        self.lines += j - i
                    if j == end:
                        break
                if _data_line(obj, first + j, info):
                    found = step_line(obj, checks, STEP_EVENT, phase_name, names, ranks, worlds)
                    self._take(found, obj, info, checks)
                i = j + 1
        info.partial_last_line = lines.partial_last_line


def _parsed(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _rowscan() -> Any:
    """The C reader module when built (and not turned off), else None."""
    from traceml_records.internal import load_extension

    return load_extension("traceml_ai.run_summary._rowscan")
