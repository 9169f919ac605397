"""The one scan (``_scan.FileScan``): its C core and its pure-Python twin give the same
columns and the same file state, on generated and hostile files (broken and truncated
lines, bytes that are not UTF-8, repeated keys, lines after the closing line, a partial
last line, huge numbers); a file read in pieces, each read going on from the last's
offset, gives what one read of the whole file gives."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.traceml_records.test_fastcheck import export_file, mutated_line
from traceml_records import _fastcheck
from traceml_records._extensions import load as load_extension
from traceml_records._fastcheck import frames_layout
from traceml_records._scan import REASONS, FileScan, FileState
from traceml_records._scan_py import Layout, RowsLayout

_speedups = load_extension()
needs_c = pytest.mark.skipif(_speedups is None, reason="traceml_records._speedups is not built")

STREAMS = ["step_time", "step_memory", "process", "collectives", "stdout_stderr", "system"]
SUMMARY_LAYOUT = Layout(
    top=(("global_rank", "int64"), ("step", "int64"), ("tokens", "int64")),
    rows=RowsLayout(
        field="events",
        keys=((None, "int64"),),
        map_keys=("code", None),
        leaves=(("duration_ms", "float64"),),
    ),
)


@contextmanager
def core(pure: bool) -> Iterator[None]:
    """The scan with its C core (as built), or as without the C extension."""
    with pytest.MonkeyPatch.context() as mp:
        if pure:
            mp.setattr(_fastcheck, "_speedups", None)
        _fastcheck.core_for.cache_clear()
        try:
            yield
        finally:
            _fastcheck.core_for.cache_clear()


def _columns(chunks: list[Any], layout: Layout) -> dict[str, list[Any]]:
    """The chunks' columns, each as one list of values, by column."""
    kinds = [k for _, k in layout.top]
    names = [f"top.{n}" for n, _ in layout.top]
    rows = layout.rows
    row_kinds: list[str] = []
    if rows is not None:
        row_kinds = [k for _, k in rows.keys] + [k for k in rows.map_keys if k is not None]
        row_kinds += [k for _, k in rows.leaves]
    out: dict[str, list[Any]] = {n: [] for n in names}
    out.update({f"rows.{i}": [] for i in range(len(row_kinds))})
    line_base = 0
    for top, long in chunks:
        for name, kind, column in zip(names, kinds, top, strict=True):
            out[name] += _decode(column, kind)
        if long is not None:
            for i, (kind, column) in enumerate(zip(row_kinds, long, strict=True)):
                values = _decode(column, kind)
                if rows is not None and i < len(rows.keys) and rows.keys[i][0] is None:
                    values = [v + line_base for v in values]  # a line's ordinal, file-wide
                out[f"rows.{i}"] += values
        line_base += top[0][3] if top else 0
    return out


def _decode(column: Any, kind: str) -> list[Any]:
    import array

    valid, values, extra, rows, _ = column
    if kind == "code":
        codes = array.array("i", bytes(values))[:rows]
        out: list[Any] = [extra[c] for c in codes]
    elif kind == "string":
        offsets = array.array("i", bytes(extra))
        out = [bytes(values)[offsets[i] : offsets[i + 1]] for i in range(rows)]
    elif kind == "bool":
        data = bytes(values)
        out = [bool(data[i >> 3] >> (i & 7) & 1) for i in range(rows)]
    else:
        out = list(array.array("q" if kind == "int64" else "d", bytes(values)))[:rows]
    if valid is not None:
        bits = bytes(valid)
        out = [v if bits[i >> 3] >> (i & 7) & 1 else None for i, v in enumerate(out)]
    return out


def _read(
    data: bytes, stream: str, layout: Layout | None, *, pure: bool, cuts: list[int] = ()
) -> tuple[FileState, Any]:
    """The state and the columns (or objects) of ``data`` read by the scan, as one file
    read once, or appended in pieces (``cuts``) and read after each."""
    with core(pure):
        scan = FileScan(stream, layout=layout, objects=layout is None)
        out: list[Any] = []
        for cut in [*cuts, len(data)]:
            # What a reader of a growing file sees: the bytes written so far.
            out += scan.read_bytes(data[scan.state.offset : cut])
        state = attrs.evolve(scan.state)
    return state, (_columns(out, layout) if layout is not None else out)


def _same(data: bytes, stream: str, layout: Layout | None, cuts: list[int]) -> None:
    whole = _read(data, stream, layout, pure=True)
    assert set(whole[0].bad) <= set(REASONS)
    assert _read(data, stream, layout, pure=True, cuts=cuts) == whole
    if _speedups is not None:
        assert _read(data, stream, layout, pure=False) == whole
        assert _read(data, stream, layout, pure=False, cuts=cuts) == whole


@st.composite
def hostile_file(draw: st.DrawFn, stream: str) -> bytes:
    """A file of ``stream`` with damage of every kind."""
    lines = list(draw(export_file(stream)))
    for _ in range(draw(st.integers(0, 4))):
        action = draw(
            st.sampled_from(["truncate", "repeat", "mutated", "closing", "blank", "after"])
        )
        at = draw(st.integers(0, len(lines)))
        if action == "truncate" and lines:
            line = lines[min(at, len(lines) - 1)]
            lines[min(at, len(lines) - 1)] = line[: draw(st.integers(0, len(line) - 1))] + b"\n"
        elif action == "repeat" and lines:
            lines.insert(at, lines[min(at, len(lines) - 1)])
        elif action == "mutated":
            lines.insert(at, draw(mutated_line(stream)))
        elif action == "closing":
            closing = {"stream": stream, "closing": True, "schema_version": 1,
                       "written_records": at, "dropped_batches": 0}  # fmt: skip
            lines.insert(at, orjson.dumps(closing) + b"\n")
        elif action == "blank":
            lines.insert(at, draw(st.sampled_from([b"\n", b"null\n", b"[1]\n", b"{\n", b"\xff\n"])))
        elif lines:
            lines.append(lines[0])
    data = b"".join(lines)
    if draw(st.booleans()) and lines:
        data += lines[0][: draw(st.integers(1, max(1, len(lines[0]) - 1)))]  # being written
    return data


@pytest.mark.parametrize("stream", STREAMS)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_c_core_and_the_twin_give_the_same_columns_and_state(
    stream: str, data: st.DataObject
) -> None:
    body = data.draw(hostile_file(stream))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=4)))
    layout = frames_layout(stream)
    _same(body, stream, layout, cuts)
    _same(body, stream, None, cuts)  # the objects of the lines taken
    if stream == "step_time":
        _same(body, stream, SUMMARY_LAYOUT, cuts)


@pytest.mark.parametrize(
    "token",
    [b"1e400", b"-1e400", b"18446744073709551616", b"99999999999999999999", b"1E2", b"-0.0",
     b"9223372036854775807", b"5e-324", b"1.7976931348623157e308"],
)  # fmt: skip
def test_huge_numbers_read_alike(token: bytes, tmp_path: Path) -> None:
    import re

    from bench.bigfile import write_step_time

    path = tmp_path / "step_time.jsonl"
    write_step_time(path, 30, world=8)
    lines = path.read_bytes().splitlines(keepends=True)
    for i, key in ((3, b"duration_ms"), (5, b"step"), (7, b"cpu_ms"), (9, b"timestamp_unix_ns")):
        at = re.compile(b'"' + key + rb'":-?[0-9.eE+-]+')
        lines[i] = at.sub(b'"' + key + b'":' + token, lines[i], count=1)
    data = b"".join(lines)
    for layout in (frames_layout("step_time"), SUMMARY_LAYOUT, None):
        _same(data, "step_time", layout, [len(data) // 3, len(data) // 2])


@needs_c
def test_a_realistic_export_is_taken_by_the_c_core_whole(tmp_path: Path) -> None:
    """An exported file: every line taken, no bad line, the closing line last; read in
    pieces cut anywhere, the same."""
    from bench.bigfile import write_step_time

    path = tmp_path / "step_time.jsonl"
    write_step_time(path, 2000, world=16)
    data = path.read_bytes()
    stepped: list[int] = []
    real = FileScan._line

    def line(self: FileScan, raw: bytes, number: int) -> None:
        stepped.append(number)
        real(self, raw, number)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FileScan, "_line", line)
        state, columns = _read(data, "step_time", SUMMARY_LAYOUT, pure=False)
    # Only the first line (it tells whether lines carry hostname) and the closing line
    # are the scan's own step's.
    assert stepped == [1, 2001]
    assert state.taken == 2000 and not state.bad and state.last_closing
    assert state.closing_line == state.lines == 2001 and state.closing_ok
    cuts = sorted(random.Random(3).sample(range(len(data)), 20))
    assert _read(data, "step_time", SUMMARY_LAYOUT, pure=False, cuts=cuts) == (state, columns)


def test_every_reason_is_counted_with_its_first_line() -> None:
    from tests.traceml_records.test_frames import _closing, _lines, _step

    ev = {"_traceml_internal:step_time": {"cpu": 5.0}}
    bad = _step(0, 2, ev)
    bad["step"] = 0
    data = _lines(
        [_step(0, 1, ev), b"{not json\n", bad, _step(0, 1, ev), _closing("step_time", 4),
         _step(0, 3, ev), _closing("step_time", 5)]
    )  # fmt: skip
    for pure in (True, False):
        state, _ = _read(data, "step_time", None, pure=pure)
        assert state.bad == {
            "not_json": 1, "invalid": 1, "repeated_key": 1, "after_closing": 1,
            "extra_closing": 1,
        }  # fmt: skip
        assert {r: f[0] for r, f in state.first.items()} == {
            "not_json": 2, "invalid": 3, "repeated_key": 4, "after_closing": 6,
            "extra_closing": 7,
        }  # fmt: skip
        assert state.taken == 1 and state.data_lines == 3 and state.closing_line == 5
        assert state.written_lines == 5 and state.closing_lines == 2


def _hostile_lines() -> list[bytes]:
    """Lines no exporter writes, each one complete line: what a damaged or hostile file
    may hold."""
    from tests.traceml_records.test_frames import _step

    ev = {"_traceml_internal:step_time": {"cpu": 5.0}}
    good = orjson.dumps(_step(0, 1, ev))
    deep_array = b"[" * 100_000 + b"]" * 100_000
    deep_in_line = good.replace(
        b'"events":{', b'"events":{"x":' + b"[" * 5000 + b"]" * 5000 + b",", 1
    )
    return [
        good.replace(b'"step":1', b'"step":NaN', 1),
        good.replace(b'"step":1', b'"step":Infinity', 1),
        good.replace(b'"duration_ms":5.0', b'"duration_ms":-Infinity', 1),
        good.replace(b'"step":1', b'"step":' + b"9" * 5000, 1),
        good.replace(b'"duration_ms":5.0', b'"duration_ms":1' + b"0" * 400, 1),
        deep_array,
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        deep_in_line,
        bytes(random.Random(7).randrange(256) for _ in range(3000)).replace(b"\n", b" "),
        b"\x00" * 100,
        b"\xef\xbb\xbf" + good,  # a byte order mark
        good + b"\r",  # a line ending CR LF
        good[:-1] + b',"step":0}',  # a key twice in one object, the last one wrong
        good.replace(b'"cpu"', b'"\xff\xfe"', 1),  # not UTF-8
    ]


@pytest.mark.parametrize("index", range(14))
def test_a_hostile_line_is_one_bad_line_with_one_reason(index: int) -> None:
    """Each hostile line, between two valid lines, is one bad line under one reason, the
    same with the C core and the twin; the valid lines around it are taken; read in
    pieces cut inside it, the same; never an exception."""
    from tests.traceml_records.test_frames import _step

    ev = {"_traceml_internal:step_time": {"cpu": 5.0}}
    hostile = _hostile_lines()[index]
    data = b"".join(
        [
            orjson.dumps(_step(0, 1, ev)) + b"\n",
            hostile + b"\n",
            orjson.dumps(_step(0, 2, ev)) + b"\n",
        ]
    )
    first = len(data) - len(hostile) - 1
    cuts = [first // 2, first + len(hostile) // 2]
    for layout in (frames_layout("step_time"), SUMMARY_LAYOUT, None):
        _same(data, "step_time", layout, cuts)
    state, _ = _read(data, "step_time", None, pure=True)
    assert state.lines == 3 and state.bad_lines == 1, state
    assert state.taken == 2
    (reason,) = state.bad
    assert reason in ("not_json", "invalid", "repeated_key")
    assert state.first[reason][0] == 2


def test_a_partial_last_line_is_taken_once_it_is_complete() -> None:
    from tests.traceml_records.test_frames import _step

    ev = {"_traceml_internal:step_time": {"cpu": 5.0}}
    one, two = (orjson.dumps(_step(0, s, ev)) + b"\n" for s in (1, 2))
    for pure in (True, False):
        with core(pure):
            scan = FileScan("step_time", objects=True)
            assert len(scan.read_bytes(one + two[:10])) == 1
            assert scan.state.partial_last_line and scan.state.offset == len(one)
            assert scan.read_bytes(two[:-1]) == []  # still no newline
            got = scan.read_bytes(two)
            assert [d["step"] for d in got] == [2]
            assert not scan.state.partial_last_line and scan.state.lines == 2
            assert scan.state.offset == len(one + two) and not scan.state.bad


def test_following_a_growing_file_reads_only_what_was_appended(tmp_path: Path) -> None:
    """Each read starts at the scan's offset: the bytes read over a follow are the file's
    bytes once (plus a partial last line read again), whatever the file's size."""
    from tests.traceml_records.test_frames import _step

    ev = {"_traceml_internal:step_time": {"cpu": 5.0}}
    path = tmp_path / "step_time.jsonl"
    path.write_bytes(b"")
    scan = FileScan("step_time", objects=True)
    read = 0
    with open(path, "ab") as out:
        for step in range(1, 301):
            line = orjson.dumps(_step(0, step, ev)) + b"\n"
            out.write(line[:-7])
            out.flush()
            with open(path, "rb") as fh:
                before = scan.state.offset
                assert scan.read(fh) == []
                read += fh.tell() - before
            out.write(line[-7:])
            out.flush()
            with open(path, "rb") as fh:
                before = scan.state.offset
                taken = scan.read(fh)
                read += fh.tell() - before
            assert [d["step"] for d in taken] == [step]
    assert scan.state.taken == 300 and not scan.state.bad
    assert read <= 2 * path.stat().st_size
