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
        props = [p for p in schema["properties"] if p != "events"]
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


def _rows_of(table: Any) -> Counter[tuple[Any, ...]]:
    return Counter(tuple(r.values()) for r in table.to_pylist())


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), stream=st.sampled_from([s.name for s in STREAMS]), close=st.booleans())
def test_hypothesis_files_load_typed(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, stream: str, close: bool
) -> None:
    lines = data.draw(st.lists(consistent_json(stream), max_size=12), label="lines")
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
        [sys.executable, str(REPO / "bench" / "frames.py"), "--lines", "2000"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("frames_vs_pandas=") and " frames_vs_pyarrow_json=" in last
