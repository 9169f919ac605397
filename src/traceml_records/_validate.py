"""``traceml validate``: export files checked against the schemas and the spec's rules.

Each line is parsed with orjson and checked against its JSON Schema with a compiled
``jsonschema_rs`` validator (``is_valid``; the error list is built only for a bad
line). A schema-valid line then gets the checks a schema cannot express: keys in
schema order, integers written as integers, sorted maps, the cross-field rules of the
Export Records page. Whole files and folders get the cross-line rules: one closing
line, last, with the right stream and count; one ``dropped_batches`` per folder;
unique keys; ``seq`` never decreasing; system_gpu lines matching their snapshot;
``hostname`` on every line or none.

That is the full path. Files are read in blocks, and the lines of a stream with a
fast check (``_fastcheck``: derived from its schema, in C when built) are first
scanned by it: it accepts the lines it can vouch for, with nothing to report, and
stops at any other, which then takes the full path. Both record each line's key and
seq in one tracker per file (the keys compactly: an int64 a key), so the cross-line
rules see every line either way. A repeated key is reported with the line of its
first occurrence, which the tracker does not keep: a file with repeats is scanned a
second time, for those keys only.

A run folder's ``finalization_warning.json`` is compared with its export files,
except when the warning says its run's exporter failed and wrote nothing
(``exporter_failed`` true, ``written_records`` 0) while the files hold data lines:
that run's export was off because the files already existed (``traceml serve
--run-name`` or Ray into a used folder; TraceML never appends), so they are an
earlier run's. They are still checked on their own and their summaries say so.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from io import BufferedReader
from operator import itemgetter
from pathlib import Path as FsPath
from typing import Any

import attrs
import orjson

from traceml_records._checkplan import ARRAY, INTEGER, MAP, OBJECT, CheckPlan, ValueCheck
from traceml_records._codec import line_problems
from traceml_records._errors import Path, describe, json_pointer
from traceml_records._fastcheck import Checker, Tracker, checker_for, tracker_for
from traceml_records._generated.checks import CHECKS, CLOSING_CHECK, WARNING_CHECK
from traceml_records._generated.registry import STREAMS
from traceml_records._generated.wire import WIRE_STREAMS
from traceml_records._lines import is_closing
from traceml_records._schemas import (
    CLOSING_SCHEMA_FILE,
    WARNING_SCHEMA_FILE,
    rs_validators,
    schema_errors,
)

WARNING_FILE_NAME = "finalization_warning.json"
"""Name of the warning file in a run folder."""

EXPORT_SUBFOLDER = ("aggregator", "export")
"""Where a run folder keeps its export files."""

_STREAM_BY_FILE = {spec.file_name: spec for spec in STREAMS}
_FAN_OUT = next(w.fan_out for w in WIRE_STREAMS.values() if w.fan_out is not None)
_IDENTITY = (
    *(k for k in _FAN_OUT.from_batch if k != "hostname"),
    *_FAN_OUT.shared_fields,
)
"""What each system_gpu line of a snapshot copies from its system item, as the wire
registry declares it (hostname apart: it may be absent on every line)."""
_SNAPSHOT_KEY = itemgetter("node_rank", "seq")
_NOT_INT = "expected an integer written without fraction or exponent, got"
_BLOCK_BYTES = 1 << 20
"""Bytes read at a time: the fast check's per-block cost is nothing at this size, and
the memory it takes stays small whatever the file's size."""

# (pointer, message) pairs: what the per-line checks produce before a file and a
# line number are attached.
_Found = list[tuple[str, str]]


@attrs.frozen
class Problem:
    """One thing wrong: where (file, line, JSON pointer) and what."""

    file: str | None
    line: int | None
    pointer: str
    message: str

    def __str__(self) -> str:
        where = ""
        if self.file is not None:
            where = f"{self.file}:{self.line}: " if self.line is not None else f"{self.file}: "
        return f"{where}{self.pointer or '/'}: {self.message}"


@attrs.frozen
class FileSummary:
    """The outcome for one file; ``stream`` is None for finalization_warning.json."""

    file: str
    stream: str | None
    data_lines: int
    closed: bool
    problems: int
    earlier_run: bool = False
    """The file belongs to an earlier run than the folder's finalization warning
    (that run's export was off because this file already existed)."""

    def __str__(self) -> str:
        verdict = "OK" if self.problems == 0 else f"{self.problems} problem(s)"
        if self.stream is None and self.file.endswith(WARNING_FILE_NAME):
            return f"{self.file}: finalization warning, {verdict}"
        closed = "closed" if self.closed else "not closed"
        earlier = (
            " (an earlier run's file: the finalization warning is of a later run whose "
            "export was off)"
            if self.earlier_run
            else ""
        )
        return (
            f"{self.file}: {self.stream or 'unknown stream'}, {self.data_lines} data line(s), "
            f"{closed}, {verdict}{earlier}"
        )


@attrs.frozen
class ValidationReport:
    """Every file checked, and the problems found (capped per file when asked)."""

    files: tuple[FileSummary, ...]
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        """True when no file has a problem."""
        return all(f.problems == 0 for f in self.files)


# --------------------------------------------------------------------------- plans


def _float_ints(value: Any, check: ValueCheck, path: Path, out: _Found) -> None:
    """Report floats where the check plan wants integers (JSON Schema accepts ``1.0``)."""
    if type(value) is float:
        if check.kind == INTEGER:
            out.append((json_pointer(path), f"{_NOT_INT} {describe(value)}"))
    elif type(value) is dict:
        if check.kind == OBJECT:
            fields = {f.name: f.check for f in check.fields}
            for key, item in value.items():
                sub = fields.get(key)
                if sub is not None:
                    _float_ints(item, sub, (*path, key), out)
        elif check.kind == MAP and check.value is not None:
            for key, item in value.items():
                _float_ints(item, check.value, (*path, key), out)
    elif type(value) is list and check.kind == ARRAY and check.value is not None:
        for index, item in enumerate(value):
            _float_ints(item, check.value, (*path, index), out)


def _as_object(plan: CheckPlan) -> ValueCheck:
    return ValueCheck(kind=OBJECT, fields=plan.fields)


_CLOSING_OBJECT = _as_object(CLOSING_CHECK)
_WARNING_OBJECT = _as_object(WARNING_CHECK)


def _schema_problems(validator: Any, obj: Any) -> _Found:
    return [(json_pointer(path), message) for path, message in schema_errors(validator, obj)]


# ------------------------------------------------------------------ per-line checks
# A schema-valid line then gets what the schema cannot say, from the one place that
# says it for the codec too (``line_problems``: key order, sorted maps and the named
# rules of ``traceml_records._rules``), so ``traceml validate`` and strict
# ``loads_line`` report the same lines.


def _event_int_floats(d: dict[str, Any], out: _Found) -> None:
    """``n_calls`` written as a float (JSON Schema's integer accepts ``1.0``)."""
    for name, devices in d["events"].items():
        for device, t in devices.items():
            if type(t["n_calls"]) is float:
                at = json_pointer(("events", name, device, "n_calls"))
                out.append((at, f"{_NOT_INT} {describe(t['n_calls'])}"))


@attrs.frozen
class _Kind:
    """What the per-line checks of one stream need, derived from its schema once."""

    stream: str
    validator: Any
    order: tuple[str, ...]
    order_without_hostname: tuple[str, ...]
    int_keys: tuple[str, ...]
    key_fields: tuple[str, ...]
    key_shape: str
    """Per key field, ``i`` (an integer) or ``s`` (a string): the tracker's keys."""
    unique_keys: bool
    carries_hostname: bool

    def check(self, d: dict[str, Any]) -> tuple[bool, _Found]:
        """Whether the line passes its schema, and its problems (schema, then the rest)."""
        if not self.validator.is_valid(d):
            return False, _schema_problems(self.validator, d)
        out: _Found = []
        for key in self.int_keys:
            if type(d.get(key)) is float:
                out.append((f"/{key}", f"{_NOT_INT} {describe(d[key])}"))
        if "events" in d:
            _event_int_floats(d, out)
        out.extend((json_pointer(path), message) for path, message in line_problems(d))
        return True, out


@functools.cache
def _kinds() -> dict[str, _Kind]:
    validators = rs_validators()
    kinds = {}
    for spec in STREAMS:
        plan = CHECKS[spec.name]
        order = plan.names
        kinds[spec.name] = _Kind(
            stream=spec.name,
            validator=validators[spec.schema_file],
            order=order,
            order_without_hostname=tuple(k for k in order if k != "hostname"),
            int_keys=tuple(f.name for f in plan.fields if f.check.kind == INTEGER),
            key_fields=plan.key_fields,
            key_shape=plan.key_shape,
            # A stream without it (runtime_environment: last-line-wins) may repeat a key.
            unique_keys=plan.unique_keys,
            carries_hostname=plan.carries_hostname,
        )
    return kinds


def _check_closing(d: dict[str, Any]) -> _Found:
    validator = rs_validators()[CLOSING_SCHEMA_FILE]
    if not validator.is_valid(d):
        return _schema_problems(validator, d)
    out: _Found = []
    if tuple(d) != CLOSING_CHECK.names:
        out.append(("", f"keys are not in schema order ({', '.join(CLOSING_CHECK.names)})"))
    _float_ints(d, _CLOSING_OBJECT, (), out)
    return out


def _check_warning(d: Any) -> _Found:
    """Schema, integers written as integers, then key order and the named rules
    (``line_problems``, as strict loading and finalize check them)."""
    validator = rs_validators()[WARNING_SCHEMA_FILE]
    if not validator.is_valid(d):
        return _schema_problems(validator, d)
    out: _Found = []
    _float_ints(d, _WARNING_OBJECT, (), out)
    out.extend((json_pointer(path), message) for path, message in line_problems(d))
    return out


def validate_line(data: bytes | str) -> list[Problem]:
    """Problems of one line on its own: JSON, schema and cross-field rules.

    The line may be a data line of any stream, a closing line or the warning object.
    Cross-line rules need the whole file; see :func:`validate_paths`.
    """
    try:
        d = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        return [Problem(None, None, "", f"invalid JSON: {exc}")]
    return [Problem(None, None, p, m) for p, m in _check_object(d)]


def _check_object(d: Any) -> _Found:
    if type(d) is not dict:
        return [("", f"expected object, got {describe(d)}")]
    if "closing" in d:
        if d["closing"] is not True:
            return [_closing_not_true(d)]
        return _check_closing(d)
    if "status" in d:
        return _check_warning(d)
    stream = d.get("stream")
    kind = _kinds().get(stream) if type(stream) is str else None
    if kind is None:
        return [_unknown_stream(d)]
    return kind.check(d)[1]


def _closing_not_true(d: dict[str, Any]) -> tuple[str, str]:
    return (
        "/closing",
        f"expected true (data lines never carry closing), got {describe(d['closing'])}",
    )


def _unknown_stream(d: dict[str, Any]) -> tuple[str, str]:
    if "stream" not in d:
        return ("/stream", "required key is missing")
    names = ", ".join(spec.name for spec in STREAMS)
    return ("/stream", f"unknown stream {describe(d['stream'])}; expected one of {names}")


# ------------------------------------------------------------------ files and folders


@attrs.define
class _FileState:
    """Mutable bookkeeping of one file while its folder is checked."""

    display: str
    stream: str | None
    cap: int | None
    problems: list[Problem] = attrs.Factory(list)
    count: int = 0
    lines: int = 0
    data_lines: int = 0
    closing: dict[str, Any] | None = None
    closing_line: int | None = None
    closed: bool = False
    earlier_run: bool = False
    # system: (node_rank, seq) → (line, gpu_count, identity)
    snapshots: dict[Any, tuple[int, int, tuple[Any, ...]]] = attrs.Factory(dict)
    # system_gpu: (node_rank, seq) → [lines, first line, identity]
    gpu_groups: dict[Any, list[Any]] = attrs.Factory(dict)
    # finalization_warning.json: its bytes, to give problems a line number.
    text: bytes = b""
    # Repeated keys whose first line is still to be found: (index in problems or
    # None when over the cap, key, the key as shown).
    repeats: list[tuple[int | None, tuple[Any, ...], str]] = attrs.Factory(list)

    def add(self, line: int | None, pointer: str, message: str) -> None:
        self.count += 1
        if self.cap is None or len(self.problems) < self.cap:
            self.problems.append(Problem(self.display, line, pointer, message))

    def add_repeat(self, line: int, key: tuple[Any, ...], shown: str) -> None:
        """A duplicate key; its message gets the first line after the scan."""
        kept = self.cap is None or len(self.problems) < self.cap
        self.add(line, "", f"duplicate key {shown}")
        self.repeats.append((len(self.problems) - 1 if kept else None, key, shown))

    def summary(self) -> FileSummary:
        return FileSummary(
            self.display, self.stream, self.data_lines, self.closed, self.count, self.earlier_run
        )


@attrs.define
class _Folder:
    """State shared by the files of one export folder (the cross-file rules)."""

    hostname: tuple[bool, str] | None = None


def _identity_of(d: dict[str, Any]) -> tuple[Any, ...]:
    return (*(d[k] for k in _IDENTITY), d.get("hostname", ...))


def _scan_file(
    path: FsPath,
    state: _FileState,
    folder: _Folder,
    progress: Callable[[int], None] | None,
    watch: Iterable[tuple[Any, ...]] = (),
) -> Tracker | None:
    """Check every line of one file; returns the tracker of its stream's lines, if
    any reached one (``watch``: keys whose first line the tracker notes)."""
    kinds = _kinds()
    trackers: dict[str, Tracker] = {}
    number = 0

    def tracker(stream: str) -> Tracker:
        found = trackers.get(stream)
        if found is None:
            found = trackers[stream] = tracker_for(kinds[stream].key_shape)
            found.watch(watch)
        return found

    with open(path, "rb") as f:
        blocks = _Blocks(f)
        for end in blocks:
            data = blocks.buffer
            pos = 0
            while pos < end:
                fast = _fast_path(state, folder, kinds)
                if fast is not None:
                    checker, hostname = fast
                    pos, n = checker.scan(data, pos, end, tracker(state.stream or ""), hostname)
                    if n:
                        number += n
                        state.lines = number
                        state.data_lines += n
                    if pos >= end:
                        break
                nl = data.index(b"\n", pos, end)
                number += 1
                state.lines = number
                raw = bytes(memoryview(data)[pos : nl + 1])
                _check_line(raw, number, state, folder, kinds, tracker)
                pos = nl + 1
            if progress is not None:
                progress(f.tell())
        if blocks.partial:
            state.add(
                number + 1, "", "last line has no newline (still being written, or truncated)"
            )
    if progress is not None:
        progress(os.path.getsize(path))
    _finish_file(state)
    return trackers.get(state.stream or "")


class _Blocks:
    """The complete lines of a file, a block at a time, in one buffer reused for every
    block (no fresh memory per block): iterating gives ``end``, the lines being
    ``buffer[:end]``; what follows the last newline is kept for the next block."""

    def __init__(self, f: BufferedReader) -> None:
        self._f = f
        self.buffer = bytearray(_BLOCK_BYTES)
        self._kept = 0

    def __iter__(self) -> Iterator[int]:
        buffer = self.buffer
        while True:
            with memoryview(buffer) as view:
                n = self._f.readinto(view[self._kept :])
            if not n:
                return
            size = self._kept + n
            end = buffer.rfind(b"\n", 0, size) + 1
            yield end
            self._kept = size - end
            buffer[: self._kept] = buffer[end:size]
            if self._kept == len(buffer):  # a line longer than the buffer
                buffer.extend(bytes(len(buffer)))

    @property
    def partial(self) -> bool:
        """Whether the file ended inside a line (one still being written)."""
        return self._kept > 0


def _fast_path(
    state: _FileState, folder: _Folder, kinds: dict[str, _Kind]
) -> tuple[Checker, int] | None:
    """The fast check for the next lines and what it takes of hostname, or None:
    the next line goes the full way (the file's stream or the folder's hostname
    not known yet, or no fast check for the stream)."""
    if state.stream is None:
        return None
    checker = checker_for(state.stream)
    if checker is None:
        return None
    if not kinds[state.stream].carries_hostname:
        return checker, -1
    if folder.hostname is None:
        return None
    return checker, int(folder.hostname[0])


def _check_line(
    raw: bytes,
    number: int,
    state: _FileState,
    folder: _Folder,
    kinds: dict[str, _Kind],
    tracker: Callable[[str], Tracker],
) -> None:
    """The full path of one complete line (``raw`` ends with its newline)."""
    add = state.add
    try:
        d = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        state.data_lines += 1
        add(number, "", f"invalid JSON: {exc}")
        return
    if is_closing(d):
        _closing_line(state, number, d)
        return
    state.data_lines += 1
    if type(d) is not dict:
        add(number, "", f"expected object, got {describe(d)}")
        return
    if "closing" in d:
        add(number, *_closing_not_true(d))
        return
    stream = d.get("stream")
    kind = kinds.get(stream) if type(stream) is str else None
    if kind is None:
        if "status" in d:
            add(number, "", "a finalization warning object is not an export line")
        else:
            add(number, *_unknown_stream(d))
        return
    if state.stream is None:
        state.stream = stream
    elif stream != state.stream:
        add(number, "/stream", f"a {stream} line in a {state.stream} file")
        return
    valid, found = kind.check(d)
    for pointer, message in found:
        add(number, pointer, message)
    if not valid:
        return  # values may have any type: no cross-line checks
    _cross_line(state, folder, kind, d, number, tracker(kind.stream))


def _first_lines(path: FsPath, state: _FileState, folder: _Folder, stream: str | None) -> None:
    """Give each duplicate-key problem the line of the key's first occurrence: the
    file scanned again from its first state (``stream``: the one its name gives), its
    problems dropped, its tracker noting where those keys first come (the same lines
    reach it in the same order)."""
    again = _FileState(state.display, stream, 0)
    keys = [key for _, key, _ in state.repeats]
    tracker = _scan_file(path, again, attrs.evolve(folder), None, watch=keys)
    found = tracker.found() if tracker is not None else {}
    for index, key, shown in state.repeats:
        first = found.get(key)
        if index is not None and first is not None:  # always found: the same lines
            message = f"duplicate key {shown} (first on line {first})"
            state.problems[index] = attrs.evolve(state.problems[index], message=message)
    state.repeats.clear()


def _closing_line(state: _FileState, number: int, d: dict[str, Any]) -> None:
    if state.closing_line is not None:
        state.add(
            number, "", f"more than one closing line (the first is line {state.closing_line})"
        )
        return
    state.closing_line = number
    for pointer, message in _check_closing(d):
        state.add(number, pointer, message)
    if rs_validators()[CLOSING_SCHEMA_FILE].is_valid(d):
        state.closing = d


def _cross_line(
    state: _FileState,
    folder: _Folder,
    kind: _Kind,
    d: dict[str, Any],
    number: int,
    tracker: Tracker,
) -> None:
    if kind.unique_keys:
        key = tuple(d.get(f) for f in kind.key_fields)  # an optional key field: None
        if not tracker.add(key, number):
            shown = ", ".join(f"{f}={d.get(f)!r}" for f in kind.key_fields)
            state.add_repeat(number, key, shown)
    rank, seq = d["rank"], d["seq"]
    previous = tracker.seq(rank, seq)
    if previous is not None and seq < previous:
        state.add(number, "/seq", f"seq {seq} decreases (was {previous} for rank {rank})")
    if kind.carries_hostname:
        has = "hostname" in d
        if folder.hostname is None:
            folder.hostname = (has, f"{state.display}:{number}")
        elif folder.hostname[0] is not has:
            other = "absent" if has else "present"
            state.add(
                number,
                "/hostname",
                f"hostname must be on every line or none; it is {other} on {folder.hostname[1]}",
            )
    if kind.stream == "system":
        state.snapshots.setdefault(_SNAPSHOT_KEY(d), (number, d["gpu_count"], _identity_of(d)))
    elif kind.stream == "system_gpu":
        group = state.gpu_groups.get(_SNAPSHOT_KEY(d))
        if group is None:
            state.gpu_groups[_SNAPSHOT_KEY(d)] = [1, number, _identity_of(d)]
        else:
            group[0] += 1
            if _identity_of(d) != group[2]:
                state.add(number, "", f"identity differs from line {group[1]} of the same snapshot")


def _finish_file(state: _FileState) -> None:
    if state.closing_line is None:
        state.add(state.lines + 1, "", "no closing line (the file did not finish cleanly)")
        return
    if state.closing_line != state.lines:
        after = state.lines - state.closing_line
        state.add(state.closing_line, "", f"closing line is not the last line ({after} follow)")
    closing = state.closing
    if closing is None:
        return
    state.closed = state.closing_line == state.lines
    if state.stream is None:
        state.stream = closing["stream"]
    elif closing["stream"] != state.stream:
        state.add(
            state.closing_line, "/stream", f"closes {closing['stream']} in a {state.stream} file"
        )
    if closing["written_records"] != state.data_lines:
        state.add(
            state.closing_line,
            "/written_records",
            f"{closing['written_records']} but the file has {state.data_lines} data line(s)",
        )


def _finish_folder(states: list[_FileState], warning: tuple[_FileState, Any] | None) -> None:
    closings = [s for s in states if s.closing is not None]
    if closings:
        first = closings[0]
        dropped = first.closing["dropped_batches"]  # type: ignore[index]
        for s in closings[1:]:
            value = s.closing["dropped_batches"]  # type: ignore[index]
            if value != dropped:
                s.add(
                    s.closing_line,
                    "/dropped_batches",
                    f"{value} but {first.display} shows {dropped}; one count per run",
                )
    by_stream: dict[str, list[_FileState]] = {}
    for s in states:
        if s.stream is not None:
            by_stream.setdefault(s.stream, []).append(s)
    systems, gpus = by_stream.get("system", []), by_stream.get("system_gpu", [])
    if len(systems) == 1 and len(gpus) == 1:
        _match_snapshots(systems[0], gpus[0])
    if warning is not None:
        _match_warning(warning[0], warning[1], states)


def _match_snapshots(system: _FileState, gpu: _FileState) -> None:
    for key, (line, count, identity) in system.snapshots.items():
        group = gpu.gpu_groups.get(key)
        lines = 0 if group is None else group[0]
        if lines != count:
            system.add(
                line,
                "/gpu_count",
                f"{count} but {gpu.display} has {lines} line(s) for node_rank {key[0]}, seq {key[1]}",
            )
        elif group is not None and group[2] != identity:
            gpu.add(group[1], "", f"identity differs from its snapshot on {system.display}:{line}")
    for key, (_, first, _) in gpu.gpu_groups.items():
        if key not in system.snapshots:
            gpu.add(
                first,
                "",
                f"no snapshot for node_rank {key[0]}, seq {key[1]} in {system.display}",
            )


def _match_warning(state: _FileState, d: dict[str, Any], states: list[_FileState]) -> None:
    export = d.get("export")
    if export is None or not states:
        return
    if (
        export["exporter_failed"]
        and export["written_records"] == 0
        and any(s.data_lines > 0 for s in states)
    ):
        # The warning's run wrote no data line, yet the folder holds some: its exporter
        # did not start because these files already existed (`traceml serve --run-name`
        # or Ray into a used folder; TraceML never appends). They are an earlier run's,
        # checked on their own, and not compared with this warning's counts.
        for s in states:
            s.earlier_run = True
        return
    if any(not s.closed for s in states):
        return
    dropped = states[0].closing["dropped_batches"]  # type: ignore[index]
    if export["dropped_batches"] != dropped:
        state.add(
            _line_of(state.text, "/export"),
            "/export/dropped_batches",
            f"{export['dropped_batches']} but closing lines show {dropped}",
        )
    written = sum(s.data_lines for s in states)
    if export["written_records"] != written:
        state.add(
            _line_of(state.text, "/export"),
            "/export/written_records",
            f"{export['written_records']} but the export files hold {written} data line(s)",
        )


def _scan_warning(path: FsPath, state: _FileState) -> Any:
    """Check finalization_warning.json; returns the parsed object when it is valid."""
    data = state.text = path.read_bytes()
    try:
        d = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        state.add(1, "", f"invalid JSON: {exc}")
        return None
    if type(d) is not dict:
        state.add(1, "", f"expected object, got {describe(d)}")
        return None
    found = _check_warning(d)
    for pointer, message in found:
        state.add(_line_of(data, pointer), pointer, message)
    state.closed = True
    return None if found else d


def _line_of(data: bytes, pointer: str) -> int:
    """Line of a top-level key in the pretty-printed warning file (1 when not found)."""
    top = pointer.split("/")[1] if pointer.count("/") else ""
    at = data.find(b'"' + top.encode() + b'":') if top else -1
    return data.count(b"\n", 0, at) + 1 if at >= 0 else 1


@attrs.frozen
class _Group:
    """Files of one folder, checked together."""

    files: tuple[FsPath, ...]
    warning: FsPath | None


def _expand(paths: Iterable[str | os.PathLike[str]]) -> list[_Group]:
    groups: dict[FsPath, tuple[list[FsPath], list[FsPath]]] = {}
    done: set[FsPath] = set()

    def put(folder: FsPath, file: FsPath, is_warning: bool) -> None:
        real = file.resolve()
        if real in done:
            return
        done.add(real)
        entry = groups.setdefault(folder.resolve(), ([], []))
        entry[1 if is_warning else 0].append(file)

    for raw in paths:
        path = FsPath(raw)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or folder")
        if path.is_file():
            put(path.parent, path, path.name == WARNING_FILE_NAME)
            continue
        export = path.joinpath(*EXPORT_SUBFOLDER)
        folder = export if export.is_dir() else path
        files = _export_files(folder)
        warning = path / WARNING_FILE_NAME
        if not files and not warning.is_file():
            raise ValueError(f"{path}: no export files (*.jsonl) and no {WARNING_FILE_NAME}")
        for file in files:
            put(folder, file, False)
        if warning.is_file():
            # A run folder's warning is checked with its export folder's files.
            put(folder, warning, True)
    out = []
    for files, warnings in groups.values():
        for extra in warnings[1:]:
            out.append(_Group((), extra))
        out.append(_Group(tuple(files), warnings[0] if warnings else None))
    return out


def _export_files(folder: FsPath) -> list[FsPath]:
    order = {spec.file_name: i for i, spec in enumerate(STREAMS)}
    files = [p for p in folder.glob("*.jsonl") if p.is_file()]
    return sorted(files, key=lambda p: (order.get(p.name, len(order)), p.name))


def validate_paths(
    paths: Iterable[str | os.PathLike[str]],
    *,
    max_problems_per_file: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ValidationReport:
    """Check export files, export folders and run folders.

    A folder is a run folder when it has ``aggregator/export/`` (its export files and
    its ``finalization_warning.json`` are checked), else an export folder (its
    ``*.jsonl`` files). Files given one by one are grouped by folder for the
    cross-file rules. ``progress(done_bytes, total_bytes)`` is called now and then.
    Raises FileNotFoundError for a missing path and ValueError for a folder with
    nothing to check.
    """
    groups = _expand(paths)
    total = sum(p.stat().st_size for g in groups for p in (*g.files, *filter(None, [g.warning])))
    done = 0
    states_out: list[_FileState] = []
    for group in groups:
        folder = _Folder()
        states = []
        for path in group.files:
            name = path.name
            spec = _STREAM_BY_FILE.get(name)
            state = _FileState(str(path), spec.name if spec else None, max_problems_per_file)
            on_bytes = None
            if progress is not None:
                base = done

                def on_bytes(n: int, base: int = base) -> None:
                    progress(base + n, total)

            _scan_file(path, state, folder, on_bytes)
            if state.repeats:
                _first_lines(path, state, folder, spec.name if spec else None)
            done += path.stat().st_size
            states.append(state)
        warning = None
        wstate = None
        if group.warning is not None:
            wstate = _FileState(str(group.warning), None, max_problems_per_file)
            parsed = _scan_warning(group.warning, wstate)
            warning = (wstate, parsed) if parsed is not None else None
        _finish_folder(states, warning)
        states_out.extend(states)
        if wstate is not None:
            states_out.append(wstate)
    # Folder-level rules report after the scan; show each file's problems in line order.
    problems = [p for s in states_out for p in sorted(s.problems, key=lambda p: p.line or 0)]
    return ValidationReport(tuple(s.summary() for s in states_out), tuple(problems))
