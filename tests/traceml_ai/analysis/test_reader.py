"""The files reader as columns, its step rows, and reading a run as it grows.

The step columns made from the scan's columns are what ``step_row`` makes of the same
lines, with the scan's C core and with its pure-Python twin; a file read in pieces (``RunReader``) gives the summary of the same
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

from tests.traceml_ai.analysis.test_summary import closing, run_folder, step_line, write
from traceml_ai.analysis import RunReader, RunSummary, summarize_run
from traceml_ai.analysis._columns import (
    Column,
    StepColumns,
    StepRow,
    columns_of_rows,
    rank_columns,
)
from traceml_ai.analysis._phases import STEP_EVENT, is_user_phase, phase_name, step_row
from traceml_ai.analysis._read import StepLines
from traceml_records import _fastcheck, validate_line
from traceml_records import events as events_of
from traceml_records._linecheck import NOT_INT
from traceml_records.internal import PURE_PYTHON_ENV, FileScan, load_extension

P = "_traceml_internal:"
_speedups = load_extension()
needs_c = pytest.mark.skipif(_speedups is None, reason="the scan's C core was not built")


def _rows_of(summary: RunSummary) -> dict[int, list[tuple[int, StepRow]]]:
    return {r: [(int(s), c.row(i)) for i, s in enumerate(c.steps)] for r, c in summary.rows.items()}


# --------------------------------------------------------------------------- columns


def _typed(row: dict[str, float]) -> StepRow:
    """A row keyed as the files' reader keeps it, as the :class:`StepRow` it stands for."""
    fields = ("step", "_used", "_ts", "_tokens")
    return StepRow(
        row["step"],
        {k: v for k, v in row.items() if k not in fields},
        used_ms=row.get("_used"),
        end_ns=row.get("_ts"),
        tokens=row.get("_tokens"),
    )


def test_the_readers_keyed_columns_become_typed() -> None:
    """The files' reader's columns (keyed by its field names and the phases' names)
    as :class:`RankColumns`: each key to its field, the phases in their order, which
    rows had a key kept."""
    import numpy as np

    def f(*v: float) -> Any:
        return np.array(v, dtype=np.float64)

    values = {
        "step": f(10.0, 20.0),
        "user:b": f(1.0, 0.0),
        "forward": f(4.0, 5.0),
        "_used": f(5.0, 5.0),
        "_ts": f(1e9, 2e9),
        "_tokens": f(0.0, 64.0),
    }
    present = {"user:b": np.array([True, False]), "_tokens": np.array([False, True])}
    c = rank_columns(np.array([3, 4], dtype=np.int64), values, present, 7)
    assert (c.node, c.steps.tolist(), c.step_ms.tolist()) == (7, [3, 4], [10.0, 20.0])
    assert list(c.phases) == ["user:b", "forward"] and (c.waits, c.op_waits) == ({}, {})
    assert c.row(0) == _typed({k: float(v[0]) for k, v in values.items() if k != "_tokens"})
    assert c.row(1) == StepRow(20.0, {"forward": 5.0}, used_ms=5.0, end_ns=2e9, tokens=64.0)
    assert c.phase("h2d").tolist() == [0.0, 0.0] and c.ends().tolist() == [1e9, 2e9]


_names = st.sampled_from(["forward", "backward", "user:a", "user:b:c", "other"])
_ms = st.floats(0, 1e6, allow_nan=False)
_rows = st.builds(
    StepRow,
    _ms,
    st.dictionaries(_names, _ms),
    used_ms=st.none() | _ms,
    end_ns=st.none() | st.floats(0, 2e18),
    tokens=st.none() | st.integers(0, 1 << 40).map(float),
    waits=st.dictionaries(st.sampled_from(["forward", "between_steps", "user:b"]), _ms),
    op_waits=st.dictionaries(
        st.tuples(st.sampled_from(["forward", "user:a"]), st.sampled_from(["all_reduce", "x@dp"])),
        _ms,
    ),
)


@settings(max_examples=80, deadline=None)
@given(rows=st.dictionaries(st.integers(0, 3), st.dictionaries(st.integers(1, 30), _rows)))
def test_typed_rows_round_trip_through_columns(rows: dict[int, dict[int, StepRow]]) -> None:
    """Rows with any mix of fields (phases, waits per component and per operation,
    tokens, ends, sums) in columns: each row comes back as it went in; a field some
    rows lack reads 0.0 there, and a rank without rows has no columns."""
    columns = columns_of_rows(rows)
    assert sorted(columns) == sorted(r for r, steps in rows.items() if steps)
    for rank, cols in columns.items():
        assert cols.steps.tolist() == sorted(rows[rank])
        assert [cols.row(i) for i in range(len(cols))] == [
            rows[rank][s] for s in sorted(rows[rank])
        ]
        for name, column in cols.phases.items():
            assert column.values.tolist() == [
                rows[rank][s].phases.get(name, 0.0) for s in sorted(rows[rank])
            ]
        for key, column in cols.op_waits.items():
            had = [key in rows[rank][s].op_waits for s in sorted(rows[rank])]
            assert (column.present is None) == all(had)
            if column.present is not None:
                assert column.present.tolist() == had
        if cols.tokens is None:
            assert all(r.tokens is None for r in rows[rank].values())


def test_a_step_row_is_typed() -> None:
    """step_row's row: the step, the phases by their summary names (user phases as
    ``user:NAME``, in the events' order), their sum; nothing a reader adds."""

    def timing(ms: float) -> dict[str, Any]:
        return {"cuda:0": {"duration_ms": ms, "cpu_ms": ms, "gpu_ms": None, "n_calls": 1}}

    events = {
        "loss": timing(1.5),
        STEP_EVENT: timing(10.0),
        events_of.FORWARD_TIME: timing(4.0),
    }
    row = step_row(events)
    assert row == StepRow(10.0, {"user:loss": 1.5, "forward": 4.0}, used_ms=5.5)
    assert list(row.phases) == ["user:loss", "forward"]
    assert (row.end_ns, row.tokens, row.waits, row.op_waits) == (None, None, {}, {})
    assert is_user_phase("user:loss") and not is_user_phase("forward")
    assert not hasattr(row, "__dict__")  # slotted


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
    """What ``step_row`` makes of the valid lines, first of each key (the lines given
    never repeat the key of a line that is not valid), as columns."""
    rows: dict[int, dict[int, StepRow]] = {}
    nodes: dict[int, int] = {}
    phases: dict[int, dict[str, None]] = {}  # each rank's, in the order the file has them
    cache: dict[str, str | None] = {}
    for raw in lines:
        if validate_line(raw):
            continue
        d = orjson.loads(raw)
        mine = rows.setdefault(d["global_rank"], {})
        if d["step"] in mine:
            continue
        row = step_row(d["events"], phase_name, cache)
        assert row is not None
        row.end_ns = float(d["timestamp_unix_ns"])
        if d.get("tokens") is not None:
            row.tokens = float(d["tokens"])
        mine[d["step"]] = row
        nodes[d["global_rank"]] = d["node_rank"]
        phases.setdefault(d["global_rank"], {}).update(dict.fromkeys(row.phases))
    columns = columns_of_rows(rows)
    for r, c in columns.items():
        c.node = nodes[r]
        c.phases = {name: c.phases[name] for name in phases[r]}
    return columns


def _same_column(got: Column | None, want: Column | None, where: object) -> None:
    import numpy as np

    assert (got is None) == (want is None), where
    if got is None or want is None:
        return
    assert np.array_equal(got.values, want.values), where
    assert (got.present is None) == (want.present is None), where
    if got.present is not None:
        assert np.array_equal(got.present, want.present), where


def _same_columns(got: StepColumns, want: StepColumns) -> None:
    import numpy as np

    assert list(got) == list(want)
    for r, c in want.items():
        g = got[r]
        assert g.node == c.node, r
        assert g.steps.tolist() == c.steps.tolist(), r
        assert np.array_equal(g.step_ms, c.step_ms), r
        assert list(g.phases) == list(c.phases), r  # the same phases, in the same order
        for name, col in c.phases.items():
            _same_column(g.phases[name], col, (r, name))
        _same_column(g.used_ms, c.used_ms, (r, "used"))
        _same_column(g.end_ns, c.end_ns, (r, "end"))
        _same_column(g.tokens, c.tokens, (r, "tokens"))
        assert (g.waits, g.op_waits) == ({}, {}), r


@settings(deadline=None, suppress_health_check=list(HealthCheck))  # examples: the profile's
@given(data=st.data())
def test_the_step_columns_are_what_step_row_makes_of_the_lines(data: st.DataObject) -> None:
    """Valid step_time lines of a few ranks, steps out of order and repeated, user phases
    now and then, some lines with one scalar or one timing bent: the summary's step
    columns (from the scan's columns, in numpy) are ``step_row``'s rows line by line,
    with the C core and with its twin."""
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
    from traceml_ai.dashboard._view import MAX_POINTS, RunData, _series, _step_series

    ranks = data.draw(st.integers(1, 4))
    rows: dict[int, dict[int, StepRow]] = {}
    for r in range(ranks):
        steps = data.draw(
            st.lists(st.integers(1, 3 * MAX_POINTS), min_size=1, max_size=60, unique=True)
        )
        ts = 0.0
        mine = {}
        for s in sorted(steps):
            ts += data.draw(st.floats(0, 5e7, allow_nan=False))
            mine[s] = StepRow(data.draw(st.floats(0, 100, allow_nan=False)), {}, end_ns=ts)
        rows[r] = mine
    columns = columns_of_rows(rows)
    tuples = {
        r: [(s, row.step_ms, row.end_ns) for s, row in sorted(m.items())] for r, m in rows.items()
    }
    highlight = list(range(ranks))
    by_columns = RunData(source="files", finished=True, status="", series=dict(columns))
    by_tuples = RunData(source="files", finished=True, status="", series=tuples)
    as_columns = _series(by_columns, _step_series(by_columns), highlight, [])
    as_tuples = _series(by_tuples, _step_series(by_tuples), highlight, [])
    assert as_columns == as_tuples


@pytest.mark.parametrize("seed", range(3))
def test_step_columns_made_a_batch_at_a_time_are_those_made_at_once(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big read is made into step columns a few lines at a time, each batch appended
    to the columns of the earlier ones: the same columns as made at once."""
    from traceml_ai.analysis import _read
    from traceml_records import _scan

    body = b"".join(raw + b"\n" for raw in _messy_lines(seed))
    whole = _step_columns(body, pure=False)
    monkeypatch.setattr(_read, "_BUILD_LINES", 3)
    monkeypatch.setattr(_scan, "CHUNK_BYTES", 4000)  # a chunk of columns every few lines
    _same_columns(_step_columns(body, pure=False), whole)
    _same_columns(_step_columns(body, pure=True), whole)


# --------------------------------------------------------------------------- the window


def _long_run(ranks: int, steps: int, seed: int) -> list[dict[str, Any]]:
    """Step lines whose times are multiples of 1/8 ms (sums exact in any order), rank
    2 slower on every step, a user phase on some steps only."""
    rnd = random.Random(seed)
    out = []
    for s in range(1, steps + 1):
        for r in range(ranks):
            phases = {
                "step": (60.0 if r == 2 else 40.0) + rnd.randrange(16) / 8,
                "forward_time": 10.0 + rnd.randrange(16) / 8,
                "backward_time": 12.0 + rnd.randrange(16) / 8,
                "dataloader_next": 1.0 + rnd.randrange(8) / 8,
            }
            if s % 7 == 0:
                phases["user_clip"] = 0.5
            out.append(step_line(r, s, ranks, phases))
    return out


def test_past_its_window_the_reader_keeps_a_sample_and_exact_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank keeps at most its window of steps however many it wrote (a sample, the
    same steps on every rank, each with the step before it); the step counts, first and
    last steps, means, shares, the longest step and the rate stay those of every step,
    and the summary says it saw a sample."""
    from traceml_ai.analysis import _read

    ranks, steps = 4, 900
    lines = _long_run(ranks, steps, seed=1)
    whole = summarize_run(run_folder(tmp_path / "whole", lines))  # the default window
    assert not any(c.sampled for c in whole.rows.values())

    monkeypatch.setattr(_read, "STEP_ROWS", 64)  # 16 steps per rank...
    monkeypatch.setattr(_read, "MIN_WINDOW", 8)
    monkeypatch.setattr(_read, "_BUILD_LINES", 37)  # ...and many batches
    run = run_folder(tmp_path / "grown", lines[:200], close=False)
    path = run / "aggregator" / "export" / "step_time.jsonl"
    reader = RunReader(run)
    held = []
    for end in (200, 1000, 2400, len(lines)):
        write(path, lines[:end] if end < len(lines) else [*lines, closing("step_time", end)])
        summary = reader.summary()
        counts = {len(c) for c in summary.rows.values()}
        held.append(max(counts))
        assert max(counts) <= 16, counts
        kept = [c.steps.tolist() for c in summary.rows.values()]
        assert all(k == kept[0] for k in kept)  # the same steps on every rank
        chosen = set(kept[0])
        for s in kept[0]:
            assert s - 1 in chosen or s + 1 in chosen  # pairs: an iteration each
        assert summary.step_time is not None
        assert {f.steps for f in summary.step_time.values()} == {end // ranks}
    assert held[-1] < steps  # a sample past the window
    final = summary
    assert all(c.sampled for c in final.rows.values())
    assert final.step_time is not None and whole.step_time is not None
    exact = ("steps", "first_step", "last_step", "mean_ms", "max_ms", "steps_per_s")
    for rank, figures in final.step_time.items():
        mine = whole.step_time[rank]
        assert {k: getattr(figures, k) for k in exact} == {k: getattr(mine, k) for k in exact}
    assert final.phases is not None and whole.phases is not None
    assert final.phase_names == whole.phase_names
    for rank, phases in final.phases.items():
        for name, figures in phases.items():
            mine = whole.phases[rank][name]
            assert (figures.mean_ms, figures.share) == (mine.mean_ms, mine.share), (rank, name)
    note = next(n for n in final.notes if n.startswith("step analysis: from "))
    assert f"of {ranks * steps:,} steps" in note
    # The dashboard from files says so too, and counts every step.
    from traceml_ai.dashboard._files import from_summary

    page, whole_page = from_summary(final), from_summary(whole)
    assert page.window.startswith("a sample of the steps written")
    assert whole_page.window == "every step written"
    assert page.total_steps == whole_page.total_steps == dict.fromkeys(range(ranks), steps)
    assert final.loss.status == whole.loss.status == "complete"
    # The straggler analysis of the sample names the rank every step names.
    assert final.straggler is not None and whole.straggler is not None
    assert [s.rank for s in final.straggler.stragglers] == [2]
    assert [s.rank for s in whole.straggler.stragglers] == [2]


def test_the_sample_of_a_larger_stride_is_part_of_the_smaller_ones() -> None:
    """Halving the sample drops steps and never takes new ones; every stride keeps
    about 2 steps in ``stride`` (a chosen step and the one before it, one chosen in
    ``stride`` at random: ``2 - 1 / stride`` on average)."""
    import numpy as np

    from traceml_ai.analysis._read import kept_steps

    steps = np.arange(1, 1_000_001, dtype=np.int64)
    before = np.ones(len(steps), dtype=np.bool_)
    for stride in (2, 4, 8, 64, 256):
        kept = kept_steps(steps, stride)
        assert not bool((kept & ~before).any())
        share = kept.mean() * stride
        assert abs(share - (2 - 1 / stride)) < 0.1, (stride, share)
        before = kept


def _waits_run(ranks: int, steps: int, seed: int) -> tuple[list[dict[str, Any]], list[Any]]:
    """(step lines, collectives lines) of a DDP run whose phase times are alike on
    every rank, but rank 2 computes 20 ms longer in backward, where the others wait as
    long for it in the all-reduce (only the waits show it); a broadcast between steps on
    every third step (two waits in those steps)."""
    rnd = random.Random(seed)
    steps_out: list[dict[str, Any]] = []
    waits: list[Any] = []
    for s in range(1, steps + 1):
        for r in range(ranks):
            phases = {
                "step": 60.0 + rnd.randrange(16) / 8,
                "forward_time": 10.0 + rnd.randrange(16) / 8,
                "backward_time": 32.0 + rnd.randrange(16) / 8,
            }
            steps_out.append(step_line(r, s, ranks, phases))
            wait = (0.5 if r == 2 else 20.5) + rnd.randrange(8) / 8
            line = _collectives_line(r, s, ranks, "backward_time", "all_reduce", wait)
            waits.append(line)
            if s % 3 == 0:
                waits.append(_collectives_line(r, s, ranks, "between_steps", "broadcast", 0.25))
    return steps_out, waits


def _collectives_line(
    rank: int, step: int, world: int, phase: str, op: str, wait: float
) -> dict[str, Any]:
    return {
        "stream": "collectives",
        "schema_version": 1,
        "observed_timestamp_unix_ns": 10**18 + step * 10**7,
        "rank": rank,
        "global_rank": rank,
        "local_rank": rank,
        "world_size": world,
        "local_world_size": world,
        "node_rank": 0,
        "timestamp_unix_ns": 10**18 + step * 10**7,
        "seq": step,
        "step": step,
        "phase": "_traceml_internal:" + phase,
        "op": op,
        "source": "ddp_comm_hook",
        "backend": "gloo",
        "n_calls": 1,
        "wait_ms": wait,
        "wait_measure": "host",
        "first_arrival_ms": 1.0,
        "last_arrival_ms": 1.0,
    }


def test_past_its_window_the_reader_keeps_the_waits_of_the_sampled_steps_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The collectives' waits are kept for the steps step_time's sample keeps (at most
    twice the window of steps per rank, however many lines were written, the file
    followed as it grows), and the straggler found in the waits is the one every step's
    waits name."""
    from traceml_ai.analysis import _read

    ranks, steps = 4, 600
    step_lines, wait_lines = _waits_run(ranks, steps, seed=3)

    def files(folder: Path, end: int, close: bool) -> Path:
        waits = [w for w in wait_lines if w["step"] <= end // ranks]
        run = run_folder(folder, step_lines[:end], close=close)
        export = run / "aggregator" / "export"
        write(
            export / "collectives.jsonl",
            [*waits, closing("collectives", len(waits))][: len(waits) + close],
        )
        return run

    whole = summarize_run(files(tmp_path / "whole", len(step_lines), True))
    assert not any(c.sampled for c in whole.rows.values())
    assert whole.straggler is not None and whole.straggler.basis == "collectives"
    assert [s.rank for s in whole.straggler.stragglers] == [2]

    monkeypatch.setattr(_read, "STEP_ROWS", 64)  # 16 steps per rank...
    monkeypatch.setattr(_read, "MIN_WINDOW", 8)
    monkeypatch.setattr(_read, "_BUILD_LINES", 37)  # ...and many batches
    run = files(tmp_path / "grown", 200, False)
    reader = RunReader(run)
    for end in (200, 1000, 2400):
        if end > 200:
            files(tmp_path / "grown", end, end == len(step_lines))
        summary = reader.summary()
        held: _read.WaitLines = reader._kept["collectives"]
        assert held.window == 32
        per_rank = {r: len(set(s.tolist())) for r, (s, _, _) in held.by_rank().items()}
        assert set(per_rank) == set(range(ranks))
        assert max(per_rank.values()) <= held.window, per_rank
        assert held.held <= ranks * held.window * 2  # at most two lines a step here
        # Every step the step columns keep has its waits.
        for rank, c in summary.rows.items():
            assert bool(c.waits["backward"].present.all()), rank
    final = summary
    assert all(c.sampled for c in final.rows.values())
    assert held.held < len(wait_lines) / 4  # a sample of the waits, not every line
    assert final.straggler is not None
    for field in ("basis", "verdict", "wait_phase"):
        assert getattr(final.straggler, field) == getattr(whole.straggler, field), field
    assert [s.rank for s in final.straggler.stragglers] == [2]
    assert final.straggler.waiting is not None and whole.straggler.waiting is not None
    assert final.straggler.waiting.collective == whole.straggler.waiting.collective
    assert not any(n.startswith("collectives:") for n in final.notes), final.notes
