"""The validator: per-line rules, cross-line rules, folders, the CLI, and the
schema-level differential between jsonschema_rs and jsonschema."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner
from hypothesis import assume, given
from hypothesis import strategies as st

from tests.records_helpers import EXAMPLE_DATA_LINE, REFERENCE, schema_file_for
from tests.strategies import KINDS, closing_json, consistent_json, warning_json
from traceml_ai.cli import main
from traceml_records import (
    STREAMS,
    RecordError,
    ValidationReport,
    loads_line,
    validate_line,
    validate_paths,
)
from traceml_records._schemas import rs_validators

# ------------------------------------------------------------------ a good export folder

IDENTITY = {
    "observed_timestamp_unix_ns": 1_700_000_000_000_000_000,
    "rank": 0,
    "global_rank": 0,
    "local_rank": 0,
    "world_size": 2,
    "local_world_size": 2,
    "node_rank": 0,
}


def ident(rank: int, seq: int, hostname: str | None = None, **extra: Any) -> dict[str, Any]:
    d: dict[str, Any] = {**IDENTITY, "rank": rank, "global_rank": rank, "local_rank": rank}
    if hostname is not None:
        d["hostname"] = hostname
    d["timestamp_unix_ns"] = 1_700_000_000_000_000_000 + seq
    d["seq"] = seq
    d.update(extra)
    return d


def phase(ms: float) -> dict[str, Any]:
    return {"cpu_ms": ms, "duration_ms": ms, "gpu_ms": None, "is_gpu": False, "n_calls": 1}


def step_time(rank: int, step: int, seq: int, **kw: Any) -> dict[str, Any]:
    events = {
        "_traceml_internal:forward_time": {"cpu": phase(1.5)},
        "_traceml_internal:step_time": {"cpu": phase(3.0)},
        "my phase": {"cpu": phase(0.5)},
    }
    return {
        "stream": "step_time",
        "schema_version": 1,
        **ident(rank, seq, **kw),
        "step": step,
        "events": events,
    }


def step_memory(rank: int, step: int, seq: int, **kw: Any) -> dict[str, Any]:
    return {
        "stream": "step_memory", "schema_version": 1, **ident(rank, seq, **kw), "step": step,
        "device": "cpu", "peak_allocated_bytes": None, "peak_reserved_bytes": None,
    }  # fmt: skip


def process(rank: int, seq: int, **kw: Any) -> dict[str, Any]:
    return {
        "stream": "process", "schema_version": 1, **ident(rank, seq, **kw), "pid": 100 + rank,
        "cpu_percent": 150.0, "cpu_logical_cores": 8, "ram_used_bytes": 1 << 30,
        "ram_total_bytes": 1 << 34, "gpu_available": True, "gpu_count": 2,
        "gpu_device_index": rank, "gpu_memory_used_bytes": 10, "gpu_memory_reserved_bytes": 20,
        "gpu_memory_total_bytes": 1 << 33,
    }  # fmt: skip


def system(seq: int, gpus: int, **kw: Any) -> dict[str, Any]:
    return {
        "stream": "system", "schema_version": 1, **ident(0, seq, **kw), "cpu_percent": 55.5,
        "ram_used_bytes": 1, "ram_total_bytes": 2, "gpu_available": gpus > 0, "gpu_count": gpus,
    }  # fmt: skip


def system_gpu(seq: int, index: int, **kw: Any) -> dict[str, Any]:
    return {
        "stream": "system_gpu", "schema_version": 1, **ident(0, seq, **kw), "gpu_index": index,
        "utilization_percent": 90.0, "memory_used_bytes": 5, "memory_total_bytes": 10,
        "temperature_c": -3.5, "power_usage_w": None, "power_limit_w": 300.0,
    }  # fmt: skip


def runtime(rank: int, seq: int, **kw: Any) -> dict[str, Any]:
    return {
        "stream": "runtime_environment", "schema_version": 1, **ident(rank, seq, **kw),
        "pid": 100 + rank, "topology": "single_node_multi_process", "distributed_initialized": True,
        "distributed_backend": "gloo", "training_strategy": "ddp", "strategy_source": "runtime_model",
        "strategy_confidence": "high", "torch_version": "2.13.0", "python_version": "3.11.7",
    }  # fmt: skip


def collectives(rank: int, step: int, seq: int, phase: str, **kw: Any) -> dict[str, Any]:
    return {
        "stream": "collectives", "schema_version": 1, **ident(rank, seq, **kw), "step": step,
        "phase": phase, "op": "all_reduce", "source": "ddp_comm_hook", "backend": "gloo",
        "n_calls": 2, "wait_ms": 1.25, "wait_measure": "host", "first_arrival_ms": 0.5,
        "last_arrival_ms": 3.0,
    }  # fmt: skip


def good_lines(hostname: str | None = None) -> dict[str, list[dict[str, Any]]]:
    kw: dict[str, Any] = {} if hostname is None else {"hostname": hostname}
    return {
        "step_time": [step_time(r, s, s - 1, **kw) for s in (1, 2, 3) for r in (0, 1)],
        "step_memory": [step_memory(r, s, s - 1, **kw) for s in (1, 2) for r in (0, 1)],
        "process": [process(r, s, **kw) for s in (0, 1) for r in (0, 1)],
        "system": [system(0, 2, **kw), system(1, 0, **kw), system(2, 1, **kw)],
        "system_gpu": [system_gpu(0, 0, **kw), system_gpu(0, 1, **kw), system_gpu(2, 0, **kw)],
        "runtime_environment": [runtime(0, 0, **kw), runtime(1, 0, **kw), runtime(0, 1, **kw)],
        "stdout_stderr": [],
        "collectives": [
            collectives(r, s, s - 1, "_traceml_internal:backward_time", **kw)
            for s in (1, 2)
            for r in (0, 1)
        ],
    }


def closing(stream: str, count: int, dropped: int = 0) -> dict[str, Any]:
    return {
        "stream": stream,
        "closing": True,
        "schema_version": 1,
        "written_records": count,
        "dropped_batches": dropped,
    }


def write_folder(folder: Path, lines: dict[str, list[dict[str, Any]]], dropped: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for stream, objs in lines.items():
        body = b"".join(orjson.dumps(o) + b"\n" for o in objs)
        (folder / f"{stream}.jsonl").write_bytes(
            body + orjson.dumps(closing(stream, len(objs), dropped)) + b"\n"
        )
    return folder


def warning(**changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "status": "warning",
        "completed_at": "2025-06-01T10:00:00.123456+00:00",
        "reason": "ranks_disconnected",
        "message": "Rank 1 disconnected.",
        "expected_world_size": 2,
        "finished_ranks": [0],
        "missing_ranks": [1],
    }
    d.update(changes)
    return {k: v for k, v in d.items() if v is not ...}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return write_folder(tmp_path / "export", good_lines())


def problems(report: ValidationReport) -> list[str]:
    return [str(p) for p in report.problems]


# ------------------------------------------------------------------ good inputs


@pytest.mark.parametrize("hostname", [None, "node-a", ""])
def test_a_good_export_folder_is_valid(tmp_path: Path, hostname: str | None) -> None:
    folder = write_folder(tmp_path / "export", good_lines(hostname))
    report = validate_paths([folder])
    assert problems(report) == []
    assert report.ok
    assert [f.stream for f in report.files] == [s.name for s in STREAMS]
    assert all(f.closed for f in report.files)
    assert {f.stream: f.data_lines for f in report.files}["step_time"] == 6


def test_a_good_run_folder_with_its_warning_is_valid(tmp_path: Path) -> None:
    write_folder(tmp_path / "run" / "aggregator" / "export", good_lines(), dropped=3)
    export = {
        "written_records": 27,
        "dropped_batches": 3,
        "failed_records": 0,
        "skipped_items": 0,
        "exporter_failed": False,
    }
    (tmp_path / "run" / "finalization_warning.json").write_bytes(
        orjson.dumps(warning(export=export), option=orjson.OPT_INDENT_2)
    )
    report = validate_paths([tmp_path / "run"])
    assert problems(report) == []
    assert report.files[-1].file.endswith("finalization_warning.json")
    assert str(report.files[-1]).endswith("finalization warning, OK")


def test_files_given_one_by_one_are_checked_as_their_folder(folder: Path) -> None:
    files = sorted(folder.glob("*.jsonl"))
    report = validate_paths([*files, files[0]])  # a repeat is checked once
    assert report.ok and len(report.files) == len(files)


# ------------------------------------------------------------------ cross-line rules

Mutator = Callable[[Path], None]


def edit(stream: str, change: Callable[[list[bytes]], list[bytes]]) -> Mutator:
    def run(folder: Path) -> None:
        path = folder / f"{stream}.jsonl"
        lines = path.read_bytes().splitlines(keepends=True)
        path.write_bytes(b"".join(change(lines)))

    return run


def replace_obj(file_stream: str, index: int, /, **changes: Any) -> Mutator:
    def change(lines: list[bytes]) -> list[bytes]:
        d = orjson.loads(lines[index])
        d.update(changes)
        lines[index] = orjson.dumps({k: v for k, v in d.items() if v is not ...}) + b"\n"
        return lines

    return edit(file_stream, change)


# (id, mutation, file, line, pointer, message fragment)
CROSS_LINE: list[tuple[str, Mutator, str, int, str, str]] = [
    ("no_closing_line", edit("step_time", lambda ls: ls[:-1]), "step_time.jsonl", 7, "/", "no closing line"),
    ("two_closing_lines", edit("process", lambda ls: [*ls, ls[-1]]), "process.jsonl", 6, "/", "more than one closing line"),
    ("closing_not_last", edit("step_time", lambda ls: [*ls[:-1], ls[-1], ls[0]]), "step_time.jsonl", 7, "/", "closing line is not the last line"),
    ("written_records_wrong", replace_obj("step_time", -1, written_records=5), "step_time.jsonl", 7, "/written_records", "5 but the file has 6 data line(s)"),
    ("closing_stream_wrong", replace_obj("step_memory", -1, stream="process"), "step_memory.jsonl", 5, "/stream", "closes process in a step_memory file"),
    ("dropped_batches_differ", replace_obj("system", -1, dropped_batches=2), "system.jsonl", 4, "/dropped_batches", "one count per run"),
    ("duplicate_key", edit("step_time", lambda ls: [ls[0], ls[0], *ls[1:-1], replace_count(ls[-1], 7)]), "step_time.jsonl", 2, "/", "duplicate key global_rank=0, step=1 (first on line 1)"),
    ("duplicate_step_memory_key", edit("step_memory", lambda ls: [ls[0], ls[0].replace(b'"seq":0', b'"seq":1'), *ls[1:-1], replace_count(ls[-1], 5)]), "step_memory.jsonl", 2, "/", "duplicate key global_rank=0, device='cpu', step=1"),
    ("process_duplicate_key", replace_obj("process", 2, seq=0, timestamp_unix_ns=5), "process.jsonl", 3, "/", "duplicate key global_rank=0, seq=0 (first on line 1)"),
    ("seq_goes_back", replace_obj("step_time", 4, seq=0), "step_time.jsonl", 5, "/seq", "seq 0 decreases (was 1 for rank 0)"),
    ("gpu_count_mismatch", replace_obj("system", 1, gpu_count=1, gpu_available=True), "system.jsonl", 2, "/gpu_count", "1 but"),
    ("gpu_line_without_snapshot", edit("system", lambda ls: [ls[0], ls[1], replace_count(ls[3], 2)]), "system_gpu.jsonl", 3, "/", "no snapshot for node_rank 0, seq 2"),
    ("gpu_identity_differs", replace_obj("system_gpu", 1, timestamp_unix_ns=1), "system_gpu.jsonl", 2, "/", "identity differs from line 1"),
    ("gpu_identity_differs_from_snapshot", edit("system_gpu", lambda ls: [ls[0], ls[1], ls[2].replace(b'"observed_timestamp_unix_ns":1700000000000000000', b'"observed_timestamp_unix_ns":1'), ls[3]]), "system_gpu.jsonl", 3, "/", "identity differs from its snapshot"),
    ("hostname_on_some_lines", replace_obj("process", 2, hostname="h"), "process.jsonl", 3, "/hostname", "hostname must be on every line or none"),
    ("unterminated_last_line", edit("step_time", lambda ls: [*ls[:-1], ls[-1][:-1]]), "step_time.jsonl", 7, "/", "last line has no newline"),
    ("foreign_stream_line", edit("step_time", lambda ls: [ls[0], ls[0].replace(b'"stream":"step_time"', b'"stream":"step_memory"'), *ls[2:]]), "step_time.jsonl", 2, "/stream", "a step_memory line in a step_time file"),
    ("invalid_line_in_file", replace_obj("step_time", 3, rank="1"), "step_time.jsonl", 4, "/rank", 'is not of type "integer"'),
    ("cross_field_in_file", replace_obj("step_time", 3, global_rank=0), "step_time.jsonl", 4, "/rank", "rank 1 differs from global_rank 0"),
]  # fmt: skip


def replace_count(line: bytes, count: int) -> bytes:
    d = orjson.loads(line)
    if "closing" in d:
        d["written_records"] = count
    return orjson.dumps(d) + b"\n"


@pytest.mark.parametrize(
    ("mutate", "file", "line", "pointer", "fragment"),
    [c[1:] for c in CROSS_LINE],
    ids=[c[0] for c in CROSS_LINE],
)
def test_each_cross_line_violation_is_reported(
    folder: Path, mutate: Mutator, file: str, line: int, pointer: str, fragment: str
) -> None:
    mutate(folder)
    report = validate_paths([folder])
    assert not report.ok
    prefix = f"{folder / file}:{line}: {pointer}: "
    found = problems(report)
    assert any(p.startswith(prefix) and fragment in p for p in found), found


def test_runtime_environment_may_repeat_a_rank(folder: Path) -> None:
    # good_lines() already repeats rank 0 in runtime_environment.jsonl.
    lines = (folder / "runtime_environment.jsonl").read_bytes().splitlines()
    assert [orjson.loads(x)["rank"] for x in lines[:-1]] == [0, 1, 0]
    assert validate_paths([folder]).ok


def test_seq_may_repeat_but_not_go_back(tmp_path: Path) -> None:
    lines = good_lines()
    lines["step_time"] = [step_time(0, 1, 5), step_time(0, 2, 5), step_time(0, 3, 6)]
    assert validate_paths([write_folder(tmp_path / "a", lines)]).ok
    lines["step_time"] = [step_time(0, 1, 5), step_time(0, 2, 4)]
    report = validate_paths([write_folder(tmp_path / "b", lines)])
    assert any(":2: /seq: seq 4 decreases (was 5 for rank 0)" in p for p in problems(report))


def test_snapshots_are_matched_only_when_both_files_are_there(folder: Path) -> None:
    (folder / "system_gpu.jsonl").unlink()
    assert validate_paths([folder]).ok


def test_stdout_stderr_with_only_its_closing_line(folder: Path) -> None:
    assert (folder / "stdout_stderr.jsonl").read_bytes().count(b"\n") == 1
    assert validate_paths([folder / "stdout_stderr.jsonl"]).ok


def test_an_empty_file_lacks_its_closing_line(folder: Path) -> None:
    (folder / "process.jsonl").write_bytes(b"")
    report = validate_paths([folder])
    assert problems(report) == [
        f"{folder / 'process.jsonl'}:1: /: no closing line (the file did not finish cleanly)"
    ]
    summary = next(f for f in report.files if f.stream == "process")
    assert not summary.closed and summary.problems == 1


# ------------------------------------------------------------------ per-line rules


def line_of(d: dict[str, Any]) -> bytes:
    return orjson.dumps(d) + b"\n"


def assert_one(d: dict[str, Any], pointer: str, fragment: str) -> None:
    found = validate_line(line_of(d))
    assert any(p.pointer == pointer and fragment in p.message for p in found), [
        str(p) for p in found
    ]
    # Strict loads_line refuses what validate reports, at the same place.
    with pytest.raises(RecordError) as info:
        loads_line(line_of(d))
    assert info.value.pointer == pointer


def with_phase(**changes: Any) -> dict[str, Any]:
    d = step_time(0, 1, 0)
    d["events"]["_traceml_internal:step_time"]["cpu"].update(changes)
    return d


CROSS_FIELD: list[tuple[str, dict[str, Any], str, str]] = [
    ("rank_differs", {**step_time(0, 1, 0), "rank": 1}, "/rank", "differs from global_rank"),
    ("rank_beyond_world", {**step_time(0, 1, 0), "rank": 2, "global_rank": 2}, "/global_rank", "not below world_size 2"),
    ("local_rank_beyond", {**step_time(0, 1, 0), "local_rank": 2}, "/local_rank", "not below local_world_size 2"),
    ("local_world_too_big", {**step_time(0, 1, 0), "local_world_size": 3}, "/local_world_size", "exceeds world_size"),
    ("is_gpu_without_gpu_ms", with_phase(is_gpu=True), "/events/_traceml_internal:step_time/cpu/gpu_ms", ""),
    ("is_gpu_duration_not_gpu", with_phase(is_gpu=True, gpu_ms=2.0), "/events/_traceml_internal:step_time/cpu/duration_ms", "!= gpu_ms"),
    ("cpu_duration_not_cpu", with_phase(duration_ms=9.0), "/events/_traceml_internal:step_time/cpu/duration_ms", "!= cpu_ms"),
    ("events_unsorted", {**step_time(0, 1, 0), "events": {"b": {"cpu": phase(1.0)}, "_traceml_internal:step_time": {"cpu": phase(1.0)}}}, "/events", "not sorted"),
    ("devices_unsorted", {**step_time(0, 1, 0), "events": {"_traceml_internal:step_time": {"xpu:0": phase(1.0), "cpu": phase(1.0)}}}, "/events/_traceml_internal:step_time", "device keys are not sorted"),
    ("no_step_event", {**step_time(0, 1, 0), "events": {"a": {"cpu": phase(1.0)}}}, "/events/_traceml_internal:step_time", "required"),
    ("reserved_event_name", {**step_time(0, 1, 0), "events": {"_traceml_internal:mine": {"cpu": phase(1.0)}, "_traceml_internal:step_time": {"cpu": phase(1.0)}}}, "/events/_traceml_internal:mine", ""),
    ("keys_out_of_order", {"schema_version": 1, **step_time(0, 1, 0)}, "", "keys are not in schema order"),
    ("cpu_peaks_not_null", {**step_memory(0, 1, 0), "peak_allocated_bytes": 5}, "/peak_allocated_bytes", ""),
    ("process_gpu_without_gpu", {**process(0, 0), "gpu_available": None}, "/gpu_count", ""),
    ("system_not_local_rank_0", system(0, 0, local_rank=1), "/local_rank", ""),
    ("system_gpu_not_local_rank_0", system_gpu(0, 0, local_rank=1), "/local_rank", ""),
    ("system_no_gpu_but_count", {**system(0, 0), "gpu_count": 1}, "/gpu_count", ""),
    ("topology_wrong", {**runtime(0, 0), "topology": "multi_node"}, "/topology", "single_node_multi_process"),
    ("backend_without_init", {**runtime(0, 0), "distributed_initialized": False}, "/distributed_backend", ""),
    ("python_version_bad", {**runtime(0, 0), "python_version": "CPython"}, "/python_version", "platform.python_version()"),
    ("stdout_line_with_newline", {"stream": "stdout_stderr", "schema_version": 1, "observed_timestamp_unix_ns": 1, "rank": 0, "timestamp_unix_ns": 1, "seq": 0, "source": "stderr", "line": "x\n"}, "/line", "without its newline"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("d", "pointer", "fragment"), [c[1:] for c in CROSS_FIELD], ids=[c[0] for c in CROSS_FIELD]
)
def test_each_cross_field_violation_is_reported(
    d: dict[str, Any], pointer: str, fragment: str
) -> None:
    assert_one(d, pointer, fragment)


def test_stdout_line_may_be_empty_or_hold_a_carriage_return() -> None:
    base = CROSS_FIELD[-1][1]
    for text in ("", "progress\r", "\r"):
        assert validate_line(line_of({**base, "line": text})) == []


def test_runtime_topologies() -> None:
    single = {
        **runtime(0, 0),
        "world_size": 1,
        "local_world_size": 1,
        "topology": "single_process",
        "distributed_initialized": False,
        "distributed_backend": None,
    }
    assert validate_line(line_of(single)) == []
    multi = {**runtime(0, 0), "world_size": 4, "local_world_size": 2, "topology": "multi_node"}
    assert validate_line(line_of(multi)) == []


WARNING_RULES: list[tuple[str, dict[str, Any], str, str]] = [
    ("completed_at_not_utc", warning(completed_at="2025-06-01T10:00:00+02:00"), "/completed_at", "isoformat"),
    ("completed_at_z", warning(completed_at="2025-06-01T10:00:00Z"), "/completed_at", "isoformat"),
    ("completed_at_bad_date", warning(completed_at="2025-13-01T10:00:00+00:00"), "/completed_at", "isoformat"),
    ("ranks_unsorted", warning(expected_world_size=3, finished_ranks=[2, 0], missing_ranks=[1]), "/finished_ranks", "not sorted"),
    ("ranks_overlap", warning(finished_ranks=[0, 1], missing_ranks=[1]), "/missing_ranks", "also in finished_ranks"),
    ("ranks_beyond_world", warning(missing_ranks=[1, 2]), "/missing_ranks", "below expected_world_size 2"),
    ("export_without_loss", warning(export={"written_records": 5, "dropped_batches": 0, "failed_records": 0, "skipped_items": 0, "exporter_failed": False}), "/export", "shows no loss"),
    ("keys_out_of_order", {"reason": "timeout", **warning()}, "", "keys are not in schema order"),
    ("float_world", warning(expected_world_size=2.0), "/expected_world_size", "without fraction"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("d", "pointer", "fragment"), [c[1:] for c in WARNING_RULES], ids=[c[0] for c in WARNING_RULES]
)
def test_each_warning_rule_is_checked(
    tmp_path: Path, d: dict[str, Any], pointer: str, fragment: str
) -> None:
    found = validate_line(orjson.dumps(d))
    assert any(p.pointer == pointer and fragment in p.message for p in found), [
        str(p) for p in found
    ]
    path = tmp_path / "finalization_warning.json"
    path.write_bytes(orjson.dumps(d, option=orjson.OPT_INDENT_2))
    report = validate_paths([path])
    assert any(p.pointer == pointer and p.file == str(path) for p in report.problems)
    assert all(p.line is not None and p.line >= 1 for p in report.problems)


def test_warning_export_block_must_match_the_closing_lines(tmp_path: Path) -> None:
    write_folder(tmp_path / "aggregator" / "export", good_lines(), dropped=3)
    export = {
        "written_records": 99,
        "dropped_batches": 1,
        "failed_records": 0,
        "skipped_items": 0,
        "exporter_failed": False,
    }
    (tmp_path / "finalization_warning.json").write_bytes(
        orjson.dumps(warning(export=export), option=orjson.OPT_INDENT_2)
    )
    found = problems(validate_paths([tmp_path]))
    text = (tmp_path / "finalization_warning.json").read_bytes()
    line = text[: text.index(b'"export":')].count(b"\n") + 1
    assert line > 1
    where = f"{tmp_path / 'finalization_warning.json'}:{line}: "
    assert f"{where}/export/dropped_batches: 1 but closing lines show 3" in found
    assert f"{where}/export/written_records: 99 but the export files hold 27 data line(s)" in found


# ------------------------------------------------------------------ differential


def _same_verdict(schema_file: str, d: Any) -> None:
    # Python's re lets "$" match before a final newline; ECMA (jsonschema_rs) does not.
    assume(not any(k.endswith("\n") for k in _all_strings(d)))
    assert rs_validators()[schema_file].is_valid(d) == REFERENCE[schema_file].is_valid(d)


def _all_strings(d: Any) -> list[str]:
    if isinstance(d, dict):
        return [*d, *(s for v in d.values() for s in _all_strings(v))]
    if isinstance(d, list):
        return [s for v in d for s in _all_strings(v)]
    return [d] if isinstance(d, str) else []


def _any_json() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5),
        st.sampled_from(["5", "cpu", "cuda:0", "", "all", "_traceml_internal:x"]),
    )  # fmt: skip
    return st.recursive(
        scalars,
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
        max_leaves=6,
    )


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    """A valid object with one value replaced, one key dropped, or one key added."""
    d = draw(base)
    # Walk to a random object inside d.
    target: dict[str, Any] = d
    while True:
        inner = [k for k, v in target.items() if isinstance(v, dict) and v]
        if not inner or draw(st.booleans()):
            break
        target = target[draw(st.sampled_from(inner))]
    action = draw(st.sampled_from(["replace", "drop", "add"]))
    if action == "replace" or (action == "drop" and not target):
        key = draw(st.sampled_from(sorted(target))) if target else "x"
        target[key] = draw(_any_json())
    elif action == "drop":
        del target[draw(st.sampled_from(sorted(target)))]
    else:
        target[draw(st.text(max_size=6))] = draw(_any_json())
    return d


def _base(kind: str) -> st.SearchStrategy[dict[str, Any]]:
    if kind == "closing":
        return closing_json()
    if kind == "warning":
        return warning_json()
    # Schema-valid data: the schemas now state the nullness implications and event
    # names too, so the property-only strategies alone no longer fit them.
    return consistent_json(kind)


def _schema_file(kind: str) -> str:
    return {"closing": "closing.schema.json", "warning": "finalization_warning.schema.json"}.get(
        kind, f"{kind}.schema.json"
    )


@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_rs_and_reference_agree_on_property_data(kind: str, data: st.DataObject) -> None:
    d = data.draw(_base(kind))
    assert rs_validators()[_schema_file(kind)].is_valid(d)
    assert REFERENCE[_schema_file(kind)].is_valid(d)


@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_rs_and_reference_agree_on_mutated_data(kind: str, data: st.DataObject) -> None:
    d = data.draw(mutated(_base(kind)))
    _same_verdict(_schema_file(kind), d)
    # What the schema refuses, loads_line refuses and the validator reports.
    line = orjson.dumps(d)
    if not rs_validators()[_schema_file(kind)].is_valid(d) and schema_file_for(d) == _schema_file(
        kind
    ):
        with pytest.raises(RecordError):
            loads_line(line)
    try:
        loads_line(line)
    except RecordError:
        assert validate_line(line) != []


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "warning"])
@given(data=st.data())
def test_consistent_lines_pass_the_whole_validator(kind: str, data: st.DataObject) -> None:
    d = data.draw(closing_json() if kind == "closing" else consistent_json(kind))
    assert validate_line(orjson.dumps(d)) == []


# ------------------------------------------------------------------ the CLI


def test_cli_good_folder_exits_0(folder: Path) -> None:
    result = CliRunner().invoke(main, ["validate", str(folder)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == len(STREAMS)
    assert lines[0] == f"{folder / 'step_time.jsonl'}: step_time, 6 data line(s), closed, OK"


@pytest.mark.parametrize(
    ("mutate", "file", "line", "pointer", "fragment"),
    [c[1:] for c in CROSS_LINE],
    ids=[c[0] for c in CROSS_LINE],
)
def test_cli_reports_each_cross_line_violation(
    folder: Path, mutate: Mutator, file: str, line: int, pointer: str, fragment: str
) -> None:
    mutate(folder)
    result = CliRunner().invoke(main, ["validate", str(folder)])
    assert result.exit_code == 1, result.output
    prefix = f"{folder / file}:{line}: {pointer}: "
    assert any(x.startswith(prefix) and fragment in x for x in result.output.splitlines()), (
        result.output
    )
    assert "problem(s)" in result.output


def test_cli_missing_path_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "does not exist" in result.output
    assert CliRunner().invoke(main, ["validate"]).exit_code == 2


def test_cli_folder_without_export_files_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["validate", str(tmp_path)])
    assert result.exit_code == 2
    assert "no export files" in result.output


def test_cli_caps_printed_problems_per_file(folder: Path) -> None:
    path = folder / "step_time.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join([lines[0]] * 10 + [replace_count(lines[-1], 10)]))
    result = CliRunner().invoke(main, ["validate", "--max-problems", "3", str(path)])
    assert result.exit_code == 1
    assert result.output.count("duplicate key") == 3
    assert f"{path}: ... 6 more problem(s) not shown" in result.output
    assert f"{path}: step_time, 10 data line(s), closed, 9 problem(s)" in result.output


def test_progress_is_reported_and_silent_off_a_tty(folder: Path) -> None:
    calls: list[tuple[int, int]] = []
    validate_paths([folder], progress=lambda done, total: calls.append((done, total)))
    total = sum(p.stat().st_size for p in folder.glob("*.jsonl"))
    assert calls and calls[-1] == (total, total)
    assert all(a <= b for (a, _), (b, _) in itertools.pairwise(calls))
    result = CliRunner().invoke(main, ["validate", str(folder)])
    assert result.exit_code == 0 and "validating" not in result.output


def test_real_subprocess_traceml_validate(folder: Path, tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "traceml"
    assert script.exists(), "the traceml console script is not installed"
    env = dict(os.environ)
    ok = subprocess.run(
        [str(script), "validate", str(folder)], capture_output=True, text=True, env=env, timeout=60
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stderr == ""
    (folder / "step_time.jsonl").write_bytes(EXAMPLE_DATA_LINE)
    bad = subprocess.run(
        [str(script), "validate", str(folder)], capture_output=True, text=True, env=env, timeout=60
    )
    assert bad.returncode == 1
    assert f"{folder / 'step_time.jsonl'}:2: /: no closing line" in bad.stdout
    missing = subprocess.run(
        [str(script), "validate", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_cli_module_does_not_import_torch() -> None:
    code = "import sys, traceml_ai.cli; assert 'torch' not in sys.modules; assert 'jsonschema_rs' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_problems_of_a_file_come_in_line_order(folder: Path) -> None:
    replace_obj("system", 1, gpu_count=1, gpu_available=True)(folder)  # found after the scan
    replace_obj("system", 2, cpu_percent=101.0)(folder)  # found during the scan
    report = validate_paths([folder])
    lines = [p.line for p in report.problems if p.file == str(folder / "system.jsonl")]
    assert lines == [2, 3]
