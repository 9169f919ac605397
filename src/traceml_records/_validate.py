"""``traceml validate``: export files checked against the schemas and the spec's rules.

Each file is read by the one scan (``_scan.FileScan``), told every problem it finds:
a line that is no JSON object, a line its own checks reject (``_linecheck``: its JSON
Schema through a compiled ``jsonschema_rs`` validator, then what a schema cannot say:
keys in schema order, integers written as integers, sorted maps, the cross-field rules
of the Export Records page), a repeated key, a seq going back, ``hostname`` on some
lines of the folder only, a second closing line. Most lines never leave the scan's C
core, which takes the lines it can vouch for with nothing to report. Whole files and
folders then get the rest of the cross-line rules: one closing line, last, with the
right stream and count; one ``dropped_batches`` per folder; system_gpu lines matching
their snapshot. A repeated key is reported with the line of its first occurrence,
which the scan's keys do not keep: a file with repeats is scanned a second time, for
those keys only.

A run folder's ``finalization_warning.json`` is compared with its export files,
except when the warning says its run's exporter failed and wrote nothing
(``exporter_failed`` true, ``written_records`` 0) while the files hold data lines:
that run's export was off because the files already existed (``traceml serve
--run-name`` or Ray into a used folder; TraceML never appends), so they are an
earlier run's. They are still checked on their own and their summaries say so.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from operator import itemgetter
from pathlib import Path as FsPath
from typing import Any

import attrs
import orjson

from traceml_records._errors import describe
from traceml_records._generated.registry import STREAMS
from traceml_records._generated.wire import WIRE_STREAMS
from traceml_records._linecheck import Problem, check_warning
from traceml_records._scan import FileScan, Hostname

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

    # What the scan tells (``_scan.Report``).

    def problem(self, line: int, pointer: str, message: str) -> None:
        self.add(line, pointer, message)

    def repeat(self, line: int, key: tuple[Any, ...], shown: str) -> None:
        self.add_repeat(line, key, shown)

    def data(self, d: dict[str, Any], line: int) -> None:
        """A data line that passes its schema: system snapshots and their GPU lines."""
        stream = d["stream"]
        if stream == "system":
            self.snapshots.setdefault(_SNAPSHOT_KEY(d), (line, d["gpu_count"], _identity_of(d)))
        elif stream == "system_gpu":
            group = self.gpu_groups.get(_SNAPSHOT_KEY(d))
            if group is None:
                self.gpu_groups[_SNAPSHOT_KEY(d)] = [1, line, _identity_of(d)]
            else:
                group[0] += 1
                if _identity_of(d) != group[2]:
                    self.add(
                        line, "", f"identity differs from line {group[1]} of the same snapshot"
                    )


@attrs.define
class _Folder:
    """State shared by the files of one export folder (the cross-file rules)."""

    hostname: Hostname = attrs.Factory(Hostname)

    def copy(self) -> _Folder:
        folder = _Folder()
        folder.hostname.value = self.hostname.value
        return folder


def _identity_of(d: dict[str, Any]) -> tuple[Any, ...]:
    return (*(d[k] for k in _IDENTITY), d.get("hostname", ...))


def _scan_file(
    path: FsPath,
    state: _FileState,
    folder: _Folder,
    progress: Callable[[int], None] | None,
    watch: Iterable[tuple[Any, ...]] = (),
) -> Any:
    """Check every line of one file; returns the keys of its stream's lines (None when
    no line named a stream; ``watch``: keys whose first line they note)."""
    scan = FileScan(
        state.stream, hostname=folder.hostname, report=state, display=state.display, watch=watch
    )
    with open(path, "rb") as f:
        scan.read(f, progress)
    st = scan.state
    state.stream = st.stream
    state.lines = st.lines
    state.data_lines = st.written_lines
    state.closing_line = st.closing_line
    state.closing = st.closing if st.closing_ok else None
    if st.partial_last_line:
        state.add(st.lines + 1, "", "last line has no newline (still being written, or truncated)")
    if progress is not None:
        progress(os.path.getsize(path))
    _finish_file(state)
    return scan.keys


def _first_lines(path: FsPath, state: _FileState, folder: _Folder, stream: str | None) -> None:
    """Give each duplicate-key problem the line of the key's first occurrence: the
    file scanned again from its first state (``stream``: the one its name gives), its
    problems dropped, its keys noting where those keys first come (the same lines
    reach them in the same order)."""
    again = _FileState(state.display, stream, 0)
    keys = [key for _, key, _ in state.repeats]
    found_keys = _scan_file(path, again, folder.copy(), None, watch=keys)
    found = found_keys.found() if found_keys is not None else {}
    for index, key, shown in state.repeats:
        first = found.get(key)
        if index is not None and first is not None:  # always found: the same lines
            message = f"duplicate key {shown} (first on line {first})"
            state.problems[index] = attrs.evolve(state.problems[index], message=message)
    state.repeats.clear()


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
    found = check_warning(d)
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
