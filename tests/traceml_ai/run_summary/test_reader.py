"""The files reader as columns, its C twin, and reading a run as it grows.

The C reader (``_rowscan``) and the Python one take and refuse the same lines and give
the same rows; a file read in pieces (``RunReader``) gives the summary of the same file
read at once; a file replaced, truncated or deleted while followed is said.
"""

from __future__ import annotations

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
from traceml_ai.run_summary._columns import ColumnsBuilder, columns_of_rows
from traceml_ai.run_summary._phases import STEP_EVENT, phase_name
from traceml_ai.run_summary._read import _checks
from traceml_ai.run_summary._read import step_line as py_step_line
from traceml_records.internal import PURE_PYTHON_ENV, load_extension

P = "_traceml_internal:"
_rowscan = load_extension("traceml_ai.run_summary._rowscan")
needs_c = pytest.mark.skipif(_rowscan is None, reason="the C reader was not built")


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


@needs_c
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_c_reader_takes_and_refuses_the_lines_the_python_one_does(
    data: st.DataObject,
) -> None:
    """Valid step_time lines, one scalar bent, or one timing bent: the C ``step_line``
    says what the Python twin says (the same row, or the same refusal)."""
    from tests.strategies import consistent_json

    assert _rowscan is not None
    obj = dict(data.draw(consistent_json("step_time")))
    obj["events"] = orjson.loads(orjson.dumps(obj.get("events")))
    choice = data.draw(st.sampled_from(["as is", "scalar", "timing", "user phases"]))
    if choice == "scalar":
        field = data.draw(st.sampled_from(sorted(obj)))
        bent = st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**64), 2**64),
            st.floats(allow_nan=False),
            st.text(max_size=3),
        )
        if data.draw(st.booleans()):
            obj[field] = data.draw(bent)
        else:
            del obj[field]
    elif choice == "timing":
        _bend_timing(data.draw, obj)
    elif choice == "user phases" and isinstance(obj.get("events"), dict):
        timing = {"cpu": {"duration_ms": 1.5, "cpu_ms": 1.5, "gpu_ms": None, "n_calls": 2}}
        for name in data.draw(st.lists(st.text(min_size=1, max_size=4), max_size=4)):
            obj["events"][name] = timing
    checks = _checks("step_time")
    # A name_of that folds names together, as the live views do.
    fold = data.draw(st.booleans())

    def name_of(event: str) -> str | None:
        name = phase_name(event)
        return "other" if fold and name is not None and name.startswith("user:") else name

    want = py_step_line(obj, checks, STEP_EVENT, name_of, {})
    got = _rowscan.step_line(obj, checks, STEP_EVENT, name_of, {}, {}, set())
    assert got == want


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
