"""traceml_records.frames: typed tables generated from the schemas, read from files."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import duckdb
import orjson
import polars as pl
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e_helpers import REPO
from tests.strategies import consistent_json
from traceml_records import STREAMS, frames
from traceml_records._extensions import load as load_extension
from traceml_records._generated.tables import TABLES

P = "_traceml_internal:"


def _closing(stream: str, n: int) -> dict[str, Any]:
    return {
        "stream": stream,
        "closing": True,
        "schema_version": 1,
        "written_records": n,
        "dropped_batches": 0,
    }


def _write(path: Path, objs: list[dict[str, Any]], tail: bytes = b"") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in objs) + tail)
    return path


def _step(rank: int, step: int, events: dict[str, dict[str, float]]) -> dict[str, Any]:
    return {
        "stream": "step_time",
        "schema_version": 1,
        "observed_timestamp_unix_ns": 1000 + step,
        "rank": rank,
        "global_rank": rank,
        "local_rank": rank,
        "world_size": 2,
        "local_world_size": 2,
        "node_rank": 0,
        "timestamp_unix_ns": 900 + step,
        "seq": step - 1,
        "step": step,
        "events": {
            name: {
                dev: {
                    "cpu_ms": ms,
                    "duration_ms": ms,
                    "gpu_ms": None,
                    "is_gpu": False,
                    "n_calls": 1,
                }
                for dev, ms in sorted(devs.items())
            }
            for name, devs in sorted(events.items())
        },
    }


def test_tables_follow_the_schemas() -> None:
    """One table per stream, columns in schema order; maps are long tables."""
    for spec in STREAMS:
        schema = json.loads((REPO / "schemas" / spec.schema_file).read_text(encoding="utf-8"))
        props = [p for p in schema["properties"] if p not in ("events", "parallel")]
        assert [c[0] for c in TABLES[spec.name]] == props
        arrow = frames.arrow_schema(spec.name)
        required = set(schema["required"])
        for f in arrow:
            if f.name not in required:
                assert f.nullable, f.name
    phases = frames.arrow_schema("step_time_phases")
    assert phases.names == [
        "global_rank",
        "step",
        "event",
        "device",
        "cpu_ms",
        "duration_ms",
        "gpu_ms",
        "is_gpu",
        "n_calls",
    ]
    assert phases.field("gpu_ms").nullable and not phases.field("cpu_ms").nullable
    assert phases.field("n_calls").type == pa.int64()
    parallel = frames.arrow_schema("runtime_environment_parallel")
    assert parallel.names == ["global_rank", "dimension", "rank", "size"]


def test_generated_reference_lists_every_table() -> None:
    text = (REPO / "docs" / "reference" / "tables.md").read_text(encoding="utf-8")
    for name in TABLES:
        assert f"## `{name}`" in text


def _expected_phases(lines: list[dict[str, Any]]) -> Counter[tuple[Any, ...]]:
    return Counter(
        (
            o["global_rank"],
            o["step"],
            ev,
            dev,
            *(float(t[k]) for k in ("cpu_ms", "duration_ms")),
            None if t["gpu_ms"] is None else float(t["gpu_ms"]),
            t["is_gpu"],
            t["n_calls"],
        )
        for o in lines
        for ev, devs in o["events"].items()
        for dev, t in devs.items()
    )


def _exported(data: st.DataObject, stream: str, most: int) -> list[dict[str, Any]]:
    """Valid lines of ``stream`` as the exporter writes them: keys in schema order,
    plain values, keys unique, seq growing, hostname on all or none."""
    from tests.strategies import as_written
    from traceml_records import validate_line
    from traceml_records._generated.checks import CHECKS

    host = data.draw(st.sampled_from([None, "node-1", ...]))
    order = CHECKS[stream].names
    lines = []
    for i, d in enumerate(data.draw(st.lists(consistent_json(stream), max_size=most))):
        d.update(seq=i, **({"step": i + 1} if "step" in d else {}))
        if "hostname" in order:
            d.pop("hostname", None)
            if host is not ...:
                d["hostname"] = host
        d = {k: d[k] for k in order if k in d}
        plain = as_written(d)
        lines.append(plain if validate_line(orjson.dumps(plain)) == [] else d)
    return lines


def _rows_of(table: Any) -> Counter[tuple[Any, ...]]:
    return Counter(tuple(r.values()) for r in table.to_pylist())


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), stream=st.sampled_from([s.name for s in STREAMS]), close=st.booleans())
def test_hypothesis_files_load_typed(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, stream: str, close: bool
) -> None:
    lines = _exported(data, stream, 12)
    body = [*lines, _closing(stream, len(lines))] if close else lines
    path = _write(tmp_path_factory.mktemp("f") / f"{stream}.jsonl", body, tail=b'{"str')
    loaded = frames.load(path, stream, validate=True)
    table = loaded.tables[stream]
    assert table.schema.equals(frames.arrow_schema(stream))
    assert table.num_rows == len(lines)
    assert loaded.partial_last_line is True
    assert loaded.closing == (_closing(stream, len(lines)) if close else None)
    columns = [c[0] for c in TABLES[stream]]
    got = table.to_pylist()
    for row, line in zip(got, lines, strict=True):
        for col in columns:
            want = line.get(col)
            assert row[col] == want, (col, row[col], want)
    if stream == "step_time":
        assert _rows_of(loaded.tables["step_time_phases"]) == _expected_phases(lines)


def test_live_file_being_appended(tmp_path: Path) -> None:
    path = tmp_path / "step_time.jsonl"
    ev = {P + "step_time": {"cpu": 5.0}, P + "forward_time": {"cpu": 2.0}}
    lines = [_step(r, s, ev) for s in range(1, 6) for r in range(2)]
    raw = b"".join(orjson.dumps(o) + b"\n" for o in lines)
    cut = raw.index(b"\n", len(raw) // 2) + 20  # mid-line: the exporter is writing it
    path.write_bytes(raw[:cut])
    first = frames.load(path)
    done = raw[:cut].count(b"\n")
    assert first.tables["step_time"].num_rows == done
    assert first.tables["step_time_phases"].num_rows == 2 * done
    assert first.partial_last_line and first.closing is None
    with open(path, "ab") as fh:  # the rest arrives, then the closing line
        fh.write(raw[cut:] + orjson.dumps(_closing("step_time", len(lines))) + b"\n")
    table = frames.load_arrow(tmp_path)  # an export folder works too
    assert table.num_rows == len(lines)
    assert frames.closing_line(table) == _closing("step_time", len(lines))
    df = frames.to_pandas(tmp_path, "step_time")
    assert df.attrs["traceml"]["closing"]["written_records"] == len(lines)
    assert list(df["step"]) == [line["step"] for line in lines]


def test_duckdb_polars_pandas_agree(tmp_path: Path) -> None:
    export = tmp_path / "run" / "aggregator" / "export"
    lines = []
    for s in range(1, 11):
        lines.append(
            _step(0, s, {P + "step_time": {"cpu": 10.0}, P + "backward_time": {"cpu": 9.0}})
        )
        lines.append(
            _step(1, s, {P + "step_time": {"cpu": 10.0}, P + "forward_time": {"cpu": 8.0}})
        )
    _write(export / "step_time.jsonl", [*lines, _closing("step_time", len(lines))])
    _write(export / "process.jsonl", [_closing("process", 0)])
    con = duckdb.connect()
    found = frames.register(con, tmp_path / "run")
    assert set(found) == {"step_time", "step_time_phases", "process"}
    rows = con.execute(
        "SELECT global_rank, event, sum(duration_ms) FROM step_time_phases "
        "WHERE event <> '_traceml_internal:step_time' GROUP BY ALL ORDER BY ALL"
    ).fetchall()
    assert rows == [(0, P + "backward_time", 90.0), (1, P + "forward_time", 80.0)]
    assert con.execute("SELECT count(*) FROM step_time").fetchone() == (20,)
    assert con.execute("SELECT count(*) FROM process").fetchone() == (0,)
    pol = frames.to_polars(export, "step_time_phases")
    assert isinstance(pol, pl.DataFrame) and pol.height == 40
    assert pol.schema["duration_ms"] == pl.Float64
    pdf = frames.to_pandas(export / "step_time.jsonl")
    assert len(pdf) == 20 and str(pdf["global_rank"].dtype) == "int64"


def test_messages(tmp_path: Path) -> None:
    with pytest.raises(frames.FramesError, match="unknown table 'nope'"):
        frames.load_arrow(tmp_path, "nope")
    with pytest.raises(frames.FramesError, match=r"no process\.jsonl here"):
        frames.load_arrow(tmp_path, "process")
    with pytest.raises(frames.FramesError, match="no such file or folder"):
        frames.load_arrow(tmp_path / "missing")
    bad = _write(
        tmp_path / "step_time.jsonl",
        [_step(0, 1, {P + "step_time": {"cpu": 1.0}}), {"stream": "step_time", "step": -1}],
    )
    with pytest.raises(frames.FramesError, match=rf"{bad}:2: "):
        frames.load(bad, validate=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(frames.FramesError, match="no export files here"):
        frames.register(duckdb.connect(), tmp_path / "empty")


def test_many_bad_lines_name_a_validate_command_a_shell_can_run(tmp_path: Path) -> None:
    import shlex

    bad = _write(
        tmp_path / 'it\'s a "run"' / "step_time.jsonl",
        [{"stream": "step_time", "step": -1}] * 7,
    )
    with pytest.raises(frames.FramesError) as raised:
        frames.load(bad, validate=True)
    message = str(raised.value)
    command = message[message.index("(and more; run ") + len("(and more; run ") : -1]
    assert shlex.split(command) == ["traceml", "validate", str(bad)], message


def test_empty_and_closing_only_files(tmp_path: Path) -> None:
    empty = tmp_path / "a" / "step_time.jsonl"
    empty.parent.mkdir()
    empty.write_bytes(b"")
    loaded = frames.load(empty)
    assert loaded.tables["step_time"].num_rows == 0
    assert loaded.tables["step_time_phases"].schema.equals(frames.arrow_schema("step_time_phases"))
    only = _write(tmp_path / "b" / "system_gpu.jsonl", [_closing("system_gpu", 0)])
    t = frames.load_arrow(only, "system_gpu")
    assert t.num_rows == 0 and frames.closing_line(t) == _closing("system_gpu", 0)


def test_bench_runs_small(tmp_path: Path) -> None:
    """bench/frames.py end to end on a small file (the 1M-line figure lives in docs)."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.frames", "--lines", "2000", "--keep", str(tmp_path / "f")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("frames_vs_pandas=") and " frames_vs_pyarrow_json=" in last


# ---------------------------------------------------------------- robustness (issue 26)

EV = {P + "step_time": {"cpu": 5.0}, P + "forward_time": {"cpu": 2.0}}


def _lines(objs: list[dict[str, Any] | bytes]) -> bytes:
    return b"".join(o if isinstance(o, bytes) else orjson.dumps(o) + b"\n" for o in objs)


def test_closing_line_in_the_middle_is_never_a_row(tmp_path: Path) -> None:
    """Two runs in one file: the rows are the first run's, the lines after its closing
    line are left out and counted under the scan's reasons."""
    run = [_step(0, 1, EV), _step(1, 1, EV)]
    later = [_step(0, 2, EV), _step(1, 2, EV), _step(0, 3, EV)]
    path = tmp_path / "step_time.jsonl"
    path.write_bytes(_lines([*run, _closing("step_time", 2), *later, _closing("step_time", 3)]))
    loaded = frames.load(path)
    table = loaded.tables["step_time"]
    assert table.num_rows == 2
    assert table.column("stream").to_pylist() == ["step_time"] * 2
    assert table.column("step").to_pylist() == [1, 1]
    assert loaded.tables["step_time_phases"].num_rows == 4
    assert loaded.closing == _closing("step_time", 2)
    assert loaded.bad == {"after_closing": 3, "extra_closing": 1} and loaded.bad_lines == 4
    assert loaded.runs_concatenated is True
    assert loaded.earlier_closings == ({"line": 3, "closing": _closing("step_time", 2)},)
    assert loaded.data_lines == 2
    after = frames.REASONS["after_closing"]
    assert (
        f"{path}:4: a data line after the closing line (first of 3 line(s) left out: {after})"
        in loaded.problems
    )
    extra = frames.REASONS["extra_closing"]
    assert (
        f"{path}:7: the first is line 3 (first of 1 line(s) left out: {extra})" in loaded.problems
    )
    attrs = frames.to_pandas(path, "step_time").attrs["traceml"]
    assert attrs["runs_concatenated"] is True and attrs["earlier_closings"][0]["line"] == 3
    assert attrs["bad"] == {"after_closing": 3, "extra_closing": 1}
    arrow = frames.load_arrow(path)
    assert orjson.loads(arrow.schema.metadata[b"traceml.info"])["runs_concatenated"] is True
    with pytest.raises(frames.FramesError, match=rf"{path}:3: /: closing line is not the last"):
        frames.load(path, validate=True)
    # A closing line followed by data lines while a run is still writing: the same.
    path.write_bytes(_lines([*run, _closing("step_time", 2), _step(0, 2, EV)]))
    live = frames.load(path)
    assert live.tables["step_time"].num_rows == 2 and live.closing == _closing("step_time", 2)
    assert live.runs_concatenated and live.earlier_closings[0]["line"] == 3
    assert live.bad == {"after_closing": 1}


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"cpu":{"cpu_ms":2.0', b'"cp\xff":{"cpu_ms":2.0'),  # a device key
        (b'"_traceml_internal:forward_time"', b'"forward\xe9"'),  # an event name
        (b'"step":1', b'"step":1,"\xc3\x28":1'),  # an unknown top-level key
        (b'"node_rank":0', b'"node_rank":0,"hostname":"h\xe9"'),  # a string value
        (b'"node_rank":0', b'"node_rank":0,"hostname":"\xed\xa0\x80"'),  # a surrogate
    ],
)
def test_bytes_that_are_not_utf8_are_lines_left_out(tmp_path: Path, old: bytes, new: bytes) -> None:
    path = tmp_path / "step_time.jsonl"
    line = orjson.dumps(_step(0, 1, EV))
    assert old in line
    path.write_bytes(_lines([_step(0, 2, EV), line.replace(old, new) + b"\n"]))
    loaded = frames.load(path)
    assert loaded.tables["step_time"].column("step").to_pylist() == [2]
    assert loaded.bad == {"not_json": 1}
    assert loaded.problems[0].startswith(f"{path}:2: invalid JSON: ")
    assert loaded.problems[0].endswith(f"left out: {frames.REASONS['not_json']})")
    with pytest.raises(frames.FramesError, match=rf"^{path}:2: "):
        frames.load(path, validate=True)
    # The exporter may have written half of a character of the last line: no error.
    path.write_bytes(_lines([_step(0, 2, EV)]) + line[:40] + b"\xc3")
    loaded = frames.load(path)
    assert loaded.tables["step_time"].num_rows == 1 and loaded.partial_last_line
    assert loaded.bad == {}


_REWRITER = """
import sys, threading, time
from traceml_records import frames

src, path = sys.argv[1], sys.argv[2]
data = open(src, "rb").read()
open(path, "wb").write(data)
stop = threading.Event()

def rewrite() -> None:
    n = 0
    while not stop.is_set():
        n += 1
        with open(path, "r+b") as fh:  # in place: truncate, then write again
            fh.truncate(0 if n % 2 else len(data) // 4)
            fh.seek(0 if n % 2 else len(data) // 4)
            fh.write(data if n % 2 else data[len(data) // 4 :])

threading.Thread(target=rewrite, daemon=True).start()
loads = errors = 0
deadline = time.monotonic() + float(sys.argv[3])
while loads < 40 and time.monotonic() < deadline:
    loads += 1
    try:
        frames.load(path)
    except frames.FramesError:
        errors += 1
stop.set()
print(loads, errors)
"""


def test_file_rewritten_while_loading_never_kills_the_process(tmp_path: Path) -> None:
    """A file truncated and rewritten in place during loads: at most a FramesError.

    (Memory-mapped, such a file killed the reader with SIGBUS in most loads.) The
    loads run in a subprocess so that a signal shows as its exit status.
    """
    src = tmp_path / "source.jsonl"
    lines = [_step(r, s, EV) for s in range(1, 2501) for r in range(2)]
    src.write_bytes(_lines([*lines, _closing("step_time", len(lines))]))
    out = subprocess.run(
        [sys.executable, "-c", _REWRITER, str(src), str(tmp_path / "step_time.jsonl"), "6"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    loads, _errors = map(int, out.stdout.split())
    assert loads >= 5


def test_line_longer_than_a_block(tmp_path: Path) -> None:
    """A valid line of more than the scan's block loads."""
    big = _step(0, 2, EV)
    big["hostname"] = "h" * (17 << 20)
    small = _step(0, 1, EV)
    small["hostname"] = "a"
    path = tmp_path / "step_time.jsonl"
    path.write_bytes(_lines([small, big, _closing("step_time", 2)]))
    loaded = frames.load(path)
    table = loaded.tables["step_time"]
    assert table.column("step").to_pylist() == [1, 2]
    assert len(table.column("hostname")[1].as_py()) == 17 << 20
    assert loaded.closing == _closing("step_time", 2) and loaded.bad_lines == 0


def _bad_step_lines() -> list[dict[str, Any] | bytes]:
    """step_time lines, one per step; the even steps from 2 on break one rule each."""
    lines: list[dict[str, Any] | bytes] = [_step(0, 1, EV)]

    def timing(step: int, event: str, **values: Any) -> dict[str, Any]:
        line = _step(0, step, EV)
        line["events"][P + event]["cpu"].update(values)
        return line

    lines.append(timing(2, "step_time", cpu_ms=-1.0, duration_ms=-1.0))  # negative
    lines.append(_step(0, 3, EV))
    lines.append(timing(4, "forward_time", n_calls=0))  # an impossible count
    lines.append(_step(0, 5, EV))
    nan = orjson.dumps(_step(0, 6, EV)).replace(
        b'"cpu_ms":2.0,"duration_ms":2.0', b'"cpu_ms":NaN,"duration_ms":NaN'
    )
    lines.append(nan + b"\n")
    lines.append(_step(0, 7, EV))
    inf = orjson.dumps(_step(0, 8, EV)).replace(b'"duration_ms":5.0', b'"duration_ms":Infinity')
    lines.append(inf + b"\n")
    lines.append(_step(0, 9, EV))
    lines.append(timing(10, "step_time", duration_ms=4.0))  # duration is not cpu_ms
    lines.append(_step(0, 11, EV))
    line = _step(0, 12, EV)
    line["world_size"] = 0  # an impossible world
    lines.append(line)
    lines.append(_step(0, 13, EV))
    line = _step(0, 14, EV)
    del line["seq"]  # a required key missing
    lines.append(line)
    lines.append(_step(0, 15, EV))
    lines.append(timing(16, "step_time", is_gpu=True))  # is_gpu with a null gpu_ms
    lines.append(_step(0, 17, EV))
    line = _step(0, 18, EV)
    line["events"] = {P + "forward_time": line["events"][P + "forward_time"]}  # no step_time
    lines.append(line)
    lines.append(_step(0, 19, EV))
    return lines


def test_bad_values_are_the_lines_the_validator_rejects(tmp_path: Path) -> None:
    """NaN, Infinity, negative durations, impossible counts: left out and counted, and
    exactly the lines ``traceml validate`` reports; validate=True raises."""
    from traceml_records._validate import validate_paths

    lines = _bad_step_lines()
    path = tmp_path / "step_time.jsonl"
    path.write_bytes(_lines([*lines, _closing("step_time", len(lines))]))
    report = validate_paths([path])
    rejected = {p.line for p in report.problems}
    assert rejected == set(range(2, 20, 2)), report.problems
    loaded = frames.load(path)
    assert loaded.bad_lines == len(rejected)
    # NaN and Infinity are not JSON (orjson, as validate, does not parse them).
    assert loaded.bad == {"invalid": 7, "not_json": 2}
    assert loaded.data_lines == 17  # JSON objects before the closing line
    assert loaded.tables["step_time"].column("step").to_pylist() == list(range(1, 20, 2))
    assert set(loaded.tables["step_time_phases"].column("step").to_pylist()) == set(range(1, 20, 2))
    assert loaded.closing == _closing("step_time", 19)
    invalid, not_json = frames.REASONS["invalid"], frames.REASONS["not_json"]
    assert loaded.problems[:2] == (
        f"{path}:6: invalid JSON: unexpected character, expected a JSON value: line 1 "
        f"column 267 (char 266) (first of 2 line(s) left out: {not_json})",
        f"{path}:2: /events/{P}step_time/cpu/cpu_ms: -1.0 is less than the minimum of 0 "
        f"(first of 7 line(s) left out: {invalid})",
    )
    df = frames.to_pandas(path, "step_time")
    assert df.attrs["traceml"]["bad_lines"] == 9 and len(df) == 10
    with pytest.raises(frames.FramesError, match=rf"^{path}:2: "):
        frames.load(path, validate=True)


def _identity(stream: str, seq: int) -> dict[str, Any]:
    return {
        "stream": stream,
        "schema_version": 1,
        "observed_timestamp_unix_ns": 1000 + seq,
        "rank": 0,
        "global_rank": 0,
        "local_rank": 0,
        "world_size": 1,
        "local_world_size": 1,
        "node_rank": 0,
        "timestamp_unix_ns": 900 + seq,
        "seq": seq,
    }


def _process(seq: int, **values: Any) -> dict[str, Any]:
    line = _identity("process", seq)
    line.update(
        pid=7,
        cpu_percent=50.0,
        cpu_logical_cores=2,
        ram_used_bytes=1 << 20,
        ram_total_bytes=1 << 30,
        gpu_available=False,
        gpu_count=None,
        gpu_device_index=None,
        gpu_memory_used_bytes=None,
        gpu_memory_reserved_bytes=None,
        gpu_memory_total_bytes=None,
    )
    line.update(values)
    return line


def _gpu(seq: int, **values: Any) -> dict[str, Any]:
    line = _identity("system_gpu", seq)
    line.update(
        gpu_index=0,
        utilization_percent=10.0,
        memory_used_bytes=1,
        memory_total_bytes=2,
        temperature_c=40.0,
        power_usage_w=50.0,
        power_limit_w=300.0,
    )
    line.update(values)
    return line


@pytest.mark.parametrize(
    ("stream", "lines"),
    [
        (
            "process",
            [
                _process(0),
                _process(
                    1,
                    gpu_available=True,
                    gpu_count=-1,
                    gpu_device_index=0,
                    gpu_memory_used_bytes=1,
                    gpu_memory_reserved_bytes=1,
                    gpu_memory_total_bytes=2,
                ),
                _process(2, ram_used_bytes=-5),
                _process(3, cpu_percent=-1.0),
                _process(4, pid=0),
                _process(5, rank=3),
                _process(6),
            ],
        ),
        (
            "system_gpu",
            [
                _gpu(0),
                _gpu(1, utilization_percent=101.0),
                _gpu(2, power_usage_w=-1.0),
                _gpu(3, memory_total_bytes=-2),
                _gpu(4, stream="process"),
                _gpu(5),
            ],
        ),
    ],
)
def test_bad_values_of_other_streams(
    tmp_path: Path, stream: str, lines: list[dict[str, Any]]
) -> None:
    """Impossible counts and percentages: the lines ``traceml validate`` rejects."""
    from traceml_records._validate import validate_paths

    path = tmp_path / f"{stream}.jsonl"
    path.write_bytes(_lines([*lines, _closing(stream, len(lines))]))
    rejected = {p.line for p in validate_paths([path]).problems}
    assert rejected == set(range(2, len(lines))), validate_paths([path]).problems
    loaded = frames.load(path, stream)
    assert loaded.bad_lines == len(rejected)
    assert loaded.tables[stream].column("seq").to_pylist() == [0, len(lines) - 1]


def test_repeated_keys_are_left_out_and_counted(tmp_path: Path) -> None:
    """A line whose key an earlier line has is left out (the first is the row), as
    validate and the run summary count it."""
    lines = [_step(0, 1, EV), _step(1, 1, EV), _step(0, 2, EV), _step(0, 1, EV), _step(0, 1, EV)]
    path = tmp_path / "step_time.jsonl"
    path.write_bytes(_lines([*lines, _closing("step_time", 5)]))
    loaded = frames.load(path)
    assert loaded.tables["step_time"].column("global_rank").to_pylist() == [0, 1, 0]
    assert loaded.bad == {"repeated_key": 2} and loaded.duplicate_keys == 2
    assert loaded.data_lines == 5 and loaded.problems == (
        f"{path}:4: global_rank=0, step=1 (first of 2 line(s) left out: "
        f"{frames.REASONS['repeated_key']})",
    )
    assert frames.to_pandas(path).attrs["traceml"]["duplicate_keys"] == 2
    with pytest.raises(frames.FramesError, match=rf"{path}:4: /: duplicate key global_rank=0"):
        frames.load(path, validate=True)


def test_hostile_lines_are_counted_under_the_scans_reasons(tmp_path: Path) -> None:
    """Lines that are not JSON objects, impossible values, repeated keys, a line after
    the closing line and a second closing line: the rows are the good lines before the
    closing line, the rest counted in the words of validate and the run summary."""
    good = [_step(0, s, EV) for s in (1, 2, 3)]
    impossible = _step(0, 4, EV)
    impossible["world_size"] = 0
    path = tmp_path / "step_time.jsonl"
    hostile = [b"\n", b"[1, 2]\n", b'{"stream": \n']
    body = [good[0], *hostile, good[1], impossible, good[0], good[2], _closing("step_time", 5)]
    body += [_step(0, 9, EV), _closing("step_time", 1)]
    path.write_bytes(_lines(body) + b'{"stream":"step_ti')
    loaded = frames.load(path)
    assert loaded.tables["step_time"].column("step").to_pylist() == [1, 2, 3]
    assert loaded.bad == {
        "not_json": 3, "invalid": 1, "repeated_key": 1, "after_closing": 1, "extra_closing": 1
    }  # fmt: skip
    assert loaded.bad_lines == 7 and loaded.duplicate_keys == 1 and loaded.partial_last_line
    assert loaded.data_lines == 5 and loaded.closing == _closing("step_time", 5)
    text = "\n".join(loaded.problems)
    for reason, phrase in frames.REASONS.items():
        n = loaded.bad[reason]
        assert f"(first of {n} line(s) left out: {phrase})" in text, reason
    assert f"{path}:2: invalid JSON: input data is empty" in text
    assert f"{path}:11: the first is line 9" in text
    assert f"{path}:6: /world_size: 0 is less than the minimum of 1" in text
    assert f"{path}:7: global_rank=0, step=1" in text
    assert loaded.tables["step_time_phases"].num_rows == 6
    with pytest.raises(frames.FramesError, match=rf"^{path}:2: /: invalid JSON"):
        frames.load(path, validate=True)


# ---------------------------------------------------------------- the fast reader

needs_c = pytest.mark.skipif(
    load_extension() is None, reason="traceml_records._speedups is not built"
)


def _both_cores(path: Path, stream: str) -> tuple[Any, Any]:
    """(loaded with the scan's C core, loaded with its pure-Python twin); a FramesError
    is returned as its message."""
    from tests.traceml_records.test_scan import core

    def load() -> Any:
        try:
            return frames.load(path, stream)
        except frames.FramesError as exc:
            return str(exc)

    with core(pure=False):
        fast = load()
    with core(pure=True):
        twin = load()
    return fast, twin


def _same_load(fast: Any, general: Any) -> None:
    """Equal results; the long tables' rows may come in another order."""
    if isinstance(general, str) or isinstance(fast, str):
        assert fast == general  # the same FramesError
        return
    assert fast.info() == general.info()
    assert fast.tables.keys() == general.tables.keys()
    for name, table in fast.tables.items():
        other = general.tables[name]
        assert table.schema == other.schema, name
        assert table.to_pylist() == other.to_pylist(), name


@needs_c
def test_a_realistic_export_is_read_alike_by_both_cores(tmp_path: Path) -> None:
    from bench.bigfile import write_step_time

    path = tmp_path / "step_time.jsonl"
    write_step_time(path, 3000, world=64)
    with open(path, "ab") as fh:
        fh.write(b'{"stream":"step_ti')  # and the exporter is writing the next line
    fast, twin = _both_cores(path, "step_time")
    _same_load(fast, twin)
    assert fast.tables["step_time_phases"].num_rows == 8 * 3000
    assert fast.partial_last_line and fast.closing == _closing("step_time", 3000)
    steps = fast.tables["step_time"].column("step").to_pylist()
    assert steps == [orjson.loads(x)["step"] for x in path.read_bytes().splitlines()[:3000]]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    data=st.data(),
    stream=st.sampled_from([s.name for s in STREAMS]),
    close=st.sampled_from(["right", "wrong", "none", "middle"]),
)
def test_both_cores_give_the_same_load(
    tmp_path_factory: pytest.TempPathFactory,
    data: st.DataObject,
    stream: str,
    close: str,
) -> None:
    lines = _exported(data, stream, 10)
    body: list[dict[str, Any]] = list(lines)
    if close == "right":
        body.append(_closing(stream, len(lines)))
    elif close == "wrong":
        body.append(_closing(stream, len(lines) + 1))
    elif close == "middle" and lines:
        body.insert(len(lines) // 2, _closing(stream, len(lines) // 2))
    path = _write(tmp_path_factory.mktemp("f") / f"{stream}.jsonl", body)
    fast, twin = _both_cores(path, stream)
    _same_load(fast, twin)
    assert not isinstance(fast, str)


@needs_c
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), stream=st.sampled_from([s.name for s in STREAMS]))
def test_both_cores_give_the_same_load_of_a_hostile_file(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, stream: str
) -> None:
    from tests.traceml_records.test_scan import hostile_file

    path = tmp_path_factory.mktemp("f") / f"{stream}.jsonl"
    path.write_bytes(data.draw(hostile_file(stream)))
    fast, twin = _both_cores(path, stream)
    _same_load(fast, twin)


def _identity(rank: int, step: int, **extra: Any) -> dict[str, Any]:
    return {
        "schema_version": 1, "observed_timestamp_unix_ns": 10**18 + step, "rank": rank,
        "global_rank": rank, "local_rank": rank, "world_size": 4, "local_world_size": 4,
        "node_rank": 0, **extra, "timestamp_unix_ns": 10**18 + step - 5, "seq": step - 1,
        "step": step,
    }  # fmt: skip


@needs_c
@pytest.mark.parametrize("hostname", [{}, {"hostname": "node-7"}, {"hostname": None}])
def test_step_memory_and_collectives_are_read_fast(
    tmp_path: Path, hostname: dict[str, Any]
) -> None:
    memory = [
        {"stream": "step_memory", **_identity(r, s, **hostname), "device": device,
         "peak_allocated_bytes": None if device == "cpu" else 5 * s,
         "peak_reserved_bytes": None if device == "cpu" else 8 * s}
        for s in (1, 2, 3) for r in range(4) for device in ("cpu", f"cuda:{r}")
    ]  # fmt: skip
    collectives = [
        {"stream": "collectives", **_identity(r, s, **hostname), "phase": phase,
         "op": "all_reduce", "source": "ddp_comm_hook", "backend": "nccl", "n_calls": 3,
         "wait_ms": None if r == 2 else 1.25 * s, "wait_measure": "none" if r == 2 else "device",
         "first_arrival_ms": 0.5, "last_arrival_ms": 7.0}
        for s in (1, 2) for r in range(4) for phase in (P + "backward_time", "my phase")
    ]  # fmt: skip
    for stream, lines in (("step_memory", memory), ("collectives", collectives)):
        path = _write(tmp_path / f"{stream}.jsonl", [*lines, _closing(stream, len(lines))])
        fast, twin = _both_cores(path, stream)
        _same_load(fast, twin)
        assert fast.bad == {}, stream
        assert fast.tables[stream].num_rows == len(lines)
