"""The files reader as columns, its step rows, and reading a run as it grows.

The step columns made from the scan's columns are what ``step_row`` and
``ColumnsBuilder`` make of the same lines, with the scan's C core and with its
pure-Python twin; a file read in pieces (``RunReader``) gives the summary of the same
file read at once; a file replaced, truncated or deleted while followed is said.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.traceml_ai.run_summary.test_summary import closing, run_folder, step_line, write
from traceml_ai.run_summary import RunReader, RunSummary, summarize_run
from traceml_ai.run_summary._columns import ColumnsBuilder, StepColumns, columns_of_rows
from traceml_ai.run_summary._phases import phase_name, step_row
from traceml_ai.run_summary._read import StepLines
from traceml_records import _fastcheck, validate_line
from traceml_records._linecheck import NOT_INT
from traceml_records.internal import PURE_PYTHON_ENV, FileScan, load_extension

P = "_traceml_internal:"
_speedups = load_extension()
needs_c = pytest.mark.skipif(_speedups is None, reason="the scan's C core was not built")


def _rows_of(summary: RunSummary) -> dict[int, list[tuple[int, dict[str, float]]]]:
    return {r: [(int(s), c.row(i)) for i, s in enumerate(c.steps)] for r, c in summary.rows.items()}


# --------------------------------------------------------------------------- columns


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_columns_hold_exactly_the_rows_given(data: st.DataObject) -> None:
    """Rows with changing key sets, steps out of order and repeated: the columns hold
    each (rank, step)'s first row, its keys and nothing else, steps ascending."""
    keys = ["step", "forward", "backward", "user:a", "user:b", "_used", "_ts"]
    rows = data.draw(
        st.lists(
            st.tuples(
                st.integers(0, 2),
                st.integers(1, 12),
                st.dictionaries(
                    st.sampled_from(keys), st.floats(0, 1e6, allow_nan=False), min_size=1
                ),
            ),
            max_size=60,
        )
    )
    builder = ColumnsBuilder()
    expected: dict[int, dict[int, dict[str, float]]] = {}
    for rank, step, row in rows:
        added = builder.add(rank, step, row)
        mine = expected.setdefault(rank, {})
        assert added == (step not in mine)
        mine.setdefault(step, row)
    built = builder.build()
    assert sorted(built) == sorted(expected)
    for rank, cols in built.items():
        assert [int(s) for s in cols.steps] == sorted(expected[rank])
        for i, s in enumerate(cols.steps):
            assert cols.row(i) == expected[rank][int(s)]
    # The same from dict rows.
    again = columns_of_rows(expected)
    for rank, cols in again.items():
        assert [cols.row(i) for i in range(len(cols))] == [
            expected[rank][s] for s in sorted(expected[rank])
        ]


# --------------------------------------------------------------------------- C twin


def _bend_timing(draw: st.DrawFn, obj: dict[str, Any]) -> None:
    """One device timing of one event made wrong, odd or merely unusual."""
    events = obj.get("events")
    if not isinstance(events, dict) or not events:
        return
    event = draw(st.sampled_from(sorted(events)))
    devices = events[event]
    if not isinstance(devices, dict) or not devices:
        events[event] = draw(st.one_of(st.none(), st.just({}), st.integers(), st.text()))
        return
    device = draw(st.sampled_from(sorted(devices)))
    key = draw(st.sampled_from(["duration_ms", "cpu_ms", "gpu_ms", "n_calls", "extra"]))
    value = draw(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**64), 2**64),
            st.floats(allow_nan=False),
            st.text(max_size=2),
            st.just({}),
        )
    )
    if draw(st.booleans()) or not isinstance(devices[device], dict):
        if isinstance(devices[device], dict):
            devices[device][key] = value
        else:
            devices[device] = value
    else:
        devices[device].pop(key, None)


def _dumps(obj: Any) -> bytes:
    """A line's bytes; an integer past 64 bits (which orjson does not write) as the
    standard library writes it."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _step_columns(data: bytes, *, pure: bool) -> StepColumns:
    """The summary's step columns of a step_time file's bytes, read by the scan with its
    C core or with its pure-Python twin."""
    with pytest.MonkeyPatch.context() as mp:
        if pure:
            mp.setattr(_fastcheck, "_speedups", None)
        _fastcheck.core_for.cache_clear()
        try:
            sink = StepLines()
            scan = FileScan("step_time", layout=sink.layout)
            sink(scan.read_bytes(data), None)  # type: ignore[arg-type]
            return sink.columns.build()
        finally:
            _fastcheck.core_for.cache_clear()


def _step_rows_of(lines: list[bytes]) -> StepColumns:
    """What ``step_row`` and ``ColumnsBuilder`` make of the valid lines, first of each
    key (the lines given never repeat the key of a line that is not valid)."""
    builder = ColumnsBuilder()
    seen: set[tuple[int, int]] = set()
    cache: dict[str, str | None] = {}
    for raw in lines:
        if validate_line(raw):
            continue
        d = orjson.loads(raw)
        key = (d["global_rank"], d["step"])
        if key in seen:
            continue
        seen.add(key)
        row = step_row(d["events"], phase_name, cache)
        assert row is not None
        row["_ts"] = float(d["timestamp_unix_ns"])
        if d.get("tokens") is not None:
            row["_tokens"] = float(d["tokens"])
        builder.add(d["global_rank"], d["step"], row)
        builder.set_node(d["global_rank"], d["node_rank"])
    return builder.build()


def _same_columns(got: StepColumns, want: StepColumns) -> None:
    import numpy as np

    assert list(got) == list(want)
    for r, c in want.items():
        g = got[r]
        assert g.node == c.node, r
        assert g.steps.tolist() == c.steps.tolist(), r
        assert list(g.values) == list(c.values), r  # the same keys, in the same order
        for key, col in c.values.items():
            assert np.array_equal(g.values[key], col), (r, key)
        assert sorted(g.present) == sorted(c.present), r
        for key, mask in c.present.items():
            assert np.array_equal(g.present[key], mask), (r, key)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_step_columns_are_what_step_row_makes_of_the_lines(data: st.DataObject) -> None:
    """Valid step_time lines of a few ranks, steps out of order and repeated, user phases
    now and then, some lines with one scalar or one timing bent: the summary's step
    columns (from the scan's columns, in numpy) are ``step_row`` and ``ColumnsBuilder``
    line by line, with the C core and with its twin."""
    from tests.strategies import as_written, consistent_json

    lines: list[bytes] = []
    for i in range(data.draw(st.integers(0, 14))):
        obj = dict(data.draw(consistent_json("step_time")))
        rank = data.draw(st.integers(0, 2))
        obj.update(rank=rank, global_rank=rank, local_rank=rank, world_size=3, local_world_size=3)
        obj["seq"] = i
        obj["step"] = data.draw(st.integers(1, 6))
        if data.draw(st.integers(0, 4)) == 0:
            timing = {
                "cpu_ms": 1.5,
                "duration_ms": 1.5,
                "gpu_ms": None,
                "is_gpu": False,
                "n_calls": 2,
            }
            for name in data.draw(st.lists(st.text("abc_", min_size=1, max_size=3), max_size=3)):
                obj["events"][name] = {"cpu": timing}
            obj["events"] = dict(sorted(obj["events"].items()))
        choice = data.draw(st.sampled_from(["as is", "as is", "scalar", "timing"]))
        if choice != "as is":
            obj["step"] = 1000 + i  # a key of its own: a bad line's key is never reused
            if choice == "scalar":
                field = data.draw(st.sampled_from(sorted(obj)))
                obj[field] = data.draw(
                    st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=2))
                )
            else:
                _bend_timing(data.draw, obj)
        plain = as_written(obj)
        raw = _dumps(plain if validate_line(_dumps(plain)) == [] else obj)
        problems = validate_line(raw)
        if problems and all(p.message.startswith(NOT_INT) for p in problems):
            continue  # valid values written otherwise (``1.0`` for 1): taken, not a step row
        lines.append(raw)
    body = b"".join(raw + b"\n" for raw in lines)
    want = _step_rows_of(lines)
    _same_columns(_step_columns(body, pure=True), want)
    if _speedups is not None:
        _same_columns(_step_columns(body, pure=False), want)


def _messy_lines(seed: int) -> list[bytes]:
    """A step_time file's lines with every kind of damage, some phases only now and
    then, steps out of order and repeated."""
    rnd = random.Random(seed)
    out: list[bytes] = []
    for s in range(1, 40):
        for r in range(3):
            phases: dict[str, float] = {"step": 10.0 + rnd.random(), "forward_time": 3.0}
            if rnd.random() < 0.3:
                phases["user_a"] = rnd.random()
            if rnd.random() < 0.2:
                phases["backward_time"] = rnd.random()
            step = s if rnd.random() > 0.05 else max(1, s - rnd.randrange(1, 5))
            obj = step_line(r, step, 3, phases)
            if rnd.random() < 0.03:
                obj["events"][P + "forward_time"]["cpu"]["duration_ms"] = -1.0
            if rnd.random() < 0.03:
                obj["global_rank"] = 7
            out.append(orjson.dumps(obj))
            if rnd.random() < 0.02:
                out.append(rnd.choice([b"{not json", b"[1, 2]", b"", b"null", b'{"closing": 1}']))
    return out


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_the_c_and_python_readers_give_the_same_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """A damaged file read both ways: the same JSON, the same rows."""
    lines = _messy_lines(seed)
    path = tmp_path / "run" / "aggregator" / "export" / "step_time.jsonl"
    path.parent.mkdir(parents=True)
    closing_line = orjson.dumps(closing("step_time", len(lines)))
    path.write_bytes(b"\n".join([*lines, closing_line, lines[0]]) + b"\n")
    fast = summarize_run(tmp_path / "run")
    monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    slow = summarize_run(tmp_path / "run")
    assert fast.to_json() == slow.to_json()
    assert _rows_of(fast) == _rows_of(slow)
    files = fast.loss.files["step_time"]
    assert files.impossible_lines > 0 and files.duplicate_keys > 0
    assert files.lines_after_closing == 1


# --------------------------------------------------------------------------- growing


@pytest.mark.parametrize("pure", [False, True])
def test_a_file_read_in_pieces_gives_the_summary_of_the_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pure: bool
) -> None:
    """Appended in uneven pieces, a piece ending inside a line: each refresh reads only
    what is new, and the last gives what reading the whole file at once gives."""
    if pure:
        monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    lines = _messy_lines(7)
    data = b"\n".join([*lines, orjson.dumps(closing("step_time", len(lines)))]) + b"\n"
    run = tmp_path / "run"
    path = run / "aggregator" / "export" / "step_time.jsonl"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    reader = RunReader(run)
    cuts = sorted(random.Random(1).sample(range(1, len(data)), 12))
    start = 0
    for cut in [*cuts, len(data)]:
        with open(path, "ab") as fh:
            fh.write(data[start:cut])
        start = cut
        summary = reader.summary()
        assert summary.loss.files["step_time"].bytes == cut
    assert reader.summary() is summary  # nothing new: nothing read, the same value
    whole = summarize_run(run)
    assert summary.to_json() == whole.to_json()
    assert _rows_of(summary) == _rows_of(whole)
    assert summary.loss.files["step_time"].partial_last_line is False


def _steps(ranks: int, steps: range) -> list[dict[str, Any]]:
    return [
        step_line(r, s, ranks, {"step": 10.0, "forward_time": 3.0})
        for s in steps
        for r in range(ranks)
    ]


def test_a_file_truncated_replaced_or_rewritten_is_read_again_and_said(tmp_path: Path) -> None:
    run = run_folder(tmp_path, _steps(2, range(1, 11)), close=False)
    path = run / "aggregator" / "export" / "step_time.jsonl"
    reader = RunReader(run)
    assert reader.summary().step_time is not None
    # Truncated and written anew (fewer steps): read from its start, and said.
    write(path, _steps(2, range(1, 4)))
    summary = reader.summary()
    assert summary.step_time is not None and summary.step_time["0"].steps == 3
    assert any("truncated or rewritten while followed" in p for p in summary.problems)
    assert summary.loss.status == "damaged"
    # Replaced by another file (another inode) with more steps.
    other = path.with_suffix(".new")
    write(other, _steps(2, range(1, 21)))
    os.replace(other, path)
    summary = reader.summary()
    assert summary.step_time is not None and summary.step_time["0"].steps == 20
    assert any("replaced by another file while followed" in p for p in summary.problems)
    # Rewritten in place, as long or longer, other first bytes.
    lines = _steps(2, range(1, 31))
    lines[0]["observed_timestamp_unix_ns"] += 1
    with open(path, "r+b") as fh:
        fh.write(b"".join(orjson.dumps(o) + b"\n" for o in lines))
    summary = reader.summary()
    assert summary.step_time is not None and summary.step_time["0"].steps == 30
    assert any(p.endswith("rewritten while followed") for p in summary.problems)


def test_a_file_deleted_while_followed_is_never_complete(tmp_path: Path) -> None:
    """Deleting step_time.jsonl under a follower: a problem, never "files complete" nor
    "step_time was not exported"."""
    lines = _steps(2, range(1, 6))
    run = run_folder(tmp_path, lines)
    reader = RunReader(run)
    assert reader.summary().loss.status == "complete"
    (run / "aggregator" / "export" / "step_time.jsonl").unlink()
    write(run / "aggregator" / "export" / "process.jsonl", [closing("process", 0)])
    summary = reader.summary()
    assert summary.loss.status == "damaged"
    assert "step_time.jsonl: disappeared while followed" in summary.problems
    assert not any("step_time was not exported" in n for n in summary.notes)


def test_the_dashboard_from_files_says_a_deleted_step_time(tmp_path: Path) -> None:
    """``traceml dashboard FOLDER``: step_time.jsonl deleted while shown is damage, not
    "files complete" with "step_time was not exported"."""
    from traceml_ai.dashboard._files import FilesSource

    run = run_folder(tmp_path, _steps(2, range(1, 6)))
    write(run / "aggregator" / "export" / "process.jsonl", [closing("process", 0)])
    source = FilesSource(run)
    assert source().status == "files complete"
    (run / "aggregator" / "export" / "step_time.jsonl").unlink()
    source._at = 0.0  # the next look is due
    data = source()
    assert data.status != "files complete"
    assert any("disappeared" in line for line in data.loss["lines"] + data.problems)
    assert not any("step_time was not exported" in n for n in data.notes)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_page_bins_step_columns_as_it_bins_step_tuples(data: st.DataObject) -> None:
    """The dashboard from files hands the page its step columns (numpy bins them); the
    live window hands it (step, ms, end) tuples: the same steps give the same chart."""
    from traceml_ai.dashboard._view import MAX_POINTS, RunData, _series

    ranks = data.draw(st.integers(1, 4))
    rows: dict[int, dict[int, dict[str, float]]] = {}
    for r in range(ranks):
        steps = data.draw(
            st.lists(st.integers(1, 3 * MAX_POINTS), min_size=1, max_size=60, unique=True)
        )
        ts = 0.0
        mine = {}
        for s in sorted(steps):
            ts += data.draw(st.floats(0, 5e7, allow_nan=False))
            mine[s] = {"step": data.draw(st.floats(0, 100, allow_nan=False)), "_ts": ts}
        rows[r] = mine
    columns = columns_of_rows(rows)
    tuples = {
        r: [(s, row["step"], row["_ts"]) for s, row in sorted(m.items())] for r, m in rows.items()
    }
    highlight = list(range(ranks))
    as_columns = _series(
        RunData(source="files", finished=True, status="", series=dict(columns)), highlight, []
    )
    as_tuples = _series(
        RunData(source="files", finished=True, status="", series=tuples), highlight, []
    )
    assert as_columns == as_tuples


@pytest.mark.parametrize("seed", range(3))
def test_step_columns_made_a_batch_at_a_time_are_those_made_at_once(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big read is made into step columns a few lines at a time, each batch appended
    to the columns of the earlier ones: the same columns as made at once."""
    from traceml_ai.run_summary import _read
    from traceml_records import _scan

    body = b"".join(raw + b"\n" for raw in _messy_lines(seed))
    whole = _step_columns(body, pure=False)
    monkeypatch.setattr(_read, "_BUILD_LINES", 3)
    monkeypatch.setattr(_scan, "CHUNK_BYTES", 4000)  # a chunk of columns every few lines
    _same_columns(_step_columns(body, pure=False), whole)
    _same_columns(_step_columns(body, pure=True), whole)
