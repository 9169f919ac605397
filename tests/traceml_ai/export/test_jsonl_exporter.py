"""The built-in JSONL exporter on real files, with real threads and real write failures.

Write failures are real kernel errors, not mocks of ``write``:
- ENOSPC: the exporter's descriptor is replaced (``os.dup2``) by one of ``/dev/full``,
  which fails every write with ENOSPC, exactly as a full disk does.
- EFBIG after a short write: ``RLIMIT_FSIZE`` is lowered for the duration of one
  ``export`` call, so the kernel writes up to the limit and then refuses (Python
  ignores SIGXFSZ, so the process is not killed).
- removal: the file is unlinked while the exporter holds it open.
"""

from __future__ import annotations

import errno
import os
import resource
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from traceml_ai.export._jsonl import (
    ExportCloseError,
    ExportStartError,
    ExportTargetExists,
    JsonlExporter,
)
from traceml_ai.export._protocol import (
    ExportContext,
    Exporter,
    ExportResult,
    ExportSummary,
    LineExporter,
    export_input_of,
)
from traceml_records import (
    STREAMS,
    STREAMS_BY_NAME,
    PhaseTiming,
    StdoutStderrRecord,
    StepMemoryRecord,
    StepTimeRecord,
)

# Every test runs with the C encoder and with the pure-Python one (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("encoder")

ALL_STREAMS = tuple(spec.name for spec in STREAMS)

STEP_TIME_KEYS = [
    "stream",
    "schema_version",
    "observed_timestamp_unix_ns",
    "rank",
    "global_rank",
    "local_rank",
    "world_size",
    "local_world_size",
    "node_rank",
    "timestamp_unix_ns",
    "seq",
    "step",
    "events",
]
CLOSING_KEYS = ["stream", "closing", "schema_version", "written_records", "dropped_batches"]


def step_time(seq: int, *, rank: int = 0, hostname: str | None = None, cpu_ms: float = 1.5) -> Any:
    timing = PhaseTiming(cpu_ms=cpu_ms, duration_ms=1.5, gpu_ms=None, is_gpu=False, n_calls=1)
    return StepTimeRecord(
        observed_timestamp_unix_ns=1_000 + seq,
        rank=rank,
        global_rank=rank,
        local_rank=rank,
        world_size=2,
        local_world_size=2,
        node_rank=0,
        hostname=hostname,
        timestamp_unix_ns=900 + seq,
        seq=seq,
        step=seq + 1,
        events={
            "_traceml_internal:step_time": {"cpu": timing},
            "_traceml_internal:forward_time": {"cpu": timing},
        },
    )


def step_memory(seq: int) -> Any:
    return StepMemoryRecord(
        observed_timestamp_unix_ns=1_000 + seq,
        rank=0,
        global_rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        timestamp_unix_ns=900 + seq,
        seq=seq,
        step=seq + 1,
        device="cpu",
        peak_allocated_bytes=None,
        peak_reserved_bytes=None,
    )


def context(tmp_path: Path, streams: tuple[str, ...], *, hostname: bool = False) -> ExportContext:
    run_dir = tmp_path / "run"
    return ExportContext(
        run_dir=run_dir,
        export_dir=run_dir / "aggregator" / "export",
        streams=streams,
        include_hostname=hostname,
    )


def summary(dropped: int = 0) -> ExportSummary:
    return ExportSummary(written_records={}, dropped_batches=dropped)


def lines_of(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return data.split(b"\n")[:-1]


def file_of(ctx: ExportContext, stream: str) -> Path:
    return ctx.export_dir / STREAMS_BY_NAME[stream].file_name


def fd_of(exporter: JsonlExporter, stream: str) -> int:
    # Reaching inside only to swap what the descriptor points at; the writes stay real.
    fd = exporter._files[stream].fd
    assert fd is not None
    return fd


@pytest.fixture
def dev_full() -> Iterator[int]:
    fd = os.open("/dev/full", os.O_WRONLY)
    yield fd
    os.close(fd)


# -- create ---------------------------------------------------------------------------


def test_create_makes_every_selected_file_empty(tmp_path: Path) -> None:
    ctx = context(tmp_path, ALL_STREAMS)
    exporter = JsonlExporter.create(ctx)
    assert isinstance(exporter, Exporter) and isinstance(exporter, LineExporter)
    assert export_input_of(exporter) == "encoded_lines"
    names = sorted(p.name for p in ctx.export_dir.iterdir())
    assert names == sorted(STREAMS_BY_NAME[s].file_name for s in ALL_STREAMS)
    assert len(names) == len(ALL_STREAMS) == 8
    for path in ctx.export_dir.iterdir():
        assert path.is_file() and not path.is_symlink()
        assert path.stat().st_size == 0
    assert exporter.paths == {s: file_of(ctx, s) for s in ALL_STREAMS}
    exporter.close(summary())


def test_create_selects_only_the_named_streams(tmp_path: Path) -> None:
    ctx = context(tmp_path, ("step_time",))
    JsonlExporter.create(ctx).close(summary())
    assert [p.name for p in ctx.export_dir.iterdir()] == ["step_time.jsonl"]


def test_existing_file_means_nothing_is_created(tmp_path: Path) -> None:
    ctx = context(tmp_path, ("step_time", "step_memory", "process"))
    ctx.export_dir.mkdir(parents=True)
    user_file = file_of(ctx, "step_memory")
    user_file.write_bytes(b"user data\n")
    os.utime(user_file, ns=(1_000_000_000, 2_000_000_000))
    before = user_file.stat()

    with pytest.raises(ExportTargetExists) as info:
        JsonlExporter.create(ctx)

    assert info.value.path == user_file
    assert isinstance(info.value, ExportStartError)
    assert str(user_file) in str(info.value)
    assert "export is off for this run" in str(info.value)
    assert sorted(p.name for p in ctx.export_dir.iterdir()) == ["step_memory.jsonl"]
    assert user_file.read_bytes() == b"user data\n"
    after = user_file.stat()
    assert (after.st_mtime_ns, after.st_size, after.st_ino) == (
        before.st_mtime_ns,
        before.st_size,
        before.st_ino,
    )


@pytest.mark.parametrize("dangling", [True, False])
def test_symlink_at_a_target_is_not_followed(tmp_path: Path, dangling: bool) -> None:
    ctx = context(tmp_path, ("step_time", "process"))
    ctx.export_dir.mkdir(parents=True)
    target = tmp_path / "elsewhere.txt"
    if not dangling:
        target.write_bytes(b"precious\n")
    link = file_of(ctx, "process")
    link.symlink_to(target)

    with pytest.raises(ExportTargetExists) as info:
        JsonlExporter.create(ctx)

    assert info.value.path == link
    assert link.is_symlink() and os.readlink(link) == str(target)
    if dangling:
        assert not target.exists()
    else:
        assert target.read_bytes() == b"precious\n"
    assert sorted(p.name for p in ctx.export_dir.iterdir()) == ["process.jsonl"]


def test_export_dir_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    ctx = context(tmp_path, ("step_time",))
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    ctx.export_dir.parent.mkdir(parents=True)
    ctx.export_dir.symlink_to(real_dir, target_is_directory=True)

    with pytest.raises(ExportStartError) as info:
        JsonlExporter.create(ctx)

    assert not isinstance(info.value, ExportTargetExists)
    assert "symbolic link" in str(info.value)
    assert list(real_dir.iterdir()) == []


def test_race_during_creation_removes_only_our_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process creates a selected file between the check and our creation."""
    ctx = context(tmp_path, ("step_time", "step_memory", "process"))
    racer_path = file_of(ctx, "step_memory")
    real_open = os.open

    def racing_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if path == "step_memory.jsonl":
            # The racer wins: its file lands first, so our O_EXCL create really fails.
            racer_path.write_bytes(b"racer\n")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", racing_open)
    with pytest.raises(ExportTargetExists) as info:
        JsonlExporter.create(ctx)
    monkeypatch.undo()

    assert info.value.path == racer_path
    assert isinstance(info.value.__cause__, FileExistsError)
    assert sorted(p.name for p in ctx.export_dir.iterdir()) == ["step_memory.jsonl"]
    assert racer_path.read_bytes() == b"racer\n"


def test_unknown_stream_is_a_start_error(tmp_path: Path) -> None:
    ctx = context(tmp_path, ("step_time", "bogus"))
    with pytest.raises(ExportStartError, match="bogus"):
        JsonlExporter.create(ctx)
    assert not ctx.export_dir.exists() or list(ctx.export_dir.iterdir()) == []


# -- export and close -----------------------------------------------------------------


def test_lines_are_compact_ordered_and_closed(tmp_path: Path) -> None:
    ctx = context(tmp_path, ("step_time", "step_memory"))
    exporter = JsonlExporter.create(ctx)
    assert exporter.export([step_time(0), step_time(1, rank=1)]) == ExportResult(written=2)
    assert exporter.export([step_time(2)]) == ExportResult(written=1)
    assert exporter.export([step_memory(0)]) == ExportResult(written=1)
    assert exporter.export([]) == ExportResult(written=0)
    exporter.close(summary(dropped=4))

    st_lines = lines_of(file_of(ctx, "step_time"))
    assert len(st_lines) == 4
    for seq, raw in enumerate(st_lines[:3]):
        obj = orjson.loads(raw)
        assert list(obj) == STEP_TIME_KEYS
        assert obj["seq"] == seq
        # Compact: re-encoding without spaces gives the very same bytes.
        assert orjson.dumps(obj) == raw
        assert b" " not in raw
        assert list(obj["events"]) == sorted(obj["events"])
    closing = orjson.loads(st_lines[-1])
    assert list(closing) == CLOSING_KEYS
    assert closing == {
        "stream": "step_time",
        "closing": True,
        "schema_version": 1,
        "written_records": 3,
        "dropped_batches": 4,
    }
    mem_lines = lines_of(file_of(ctx, "step_memory"))
    assert len(mem_lines) == 2
    assert orjson.loads(mem_lines[-1])["written_records"] == 1
    assert orjson.loads(mem_lines[-1])["dropped_batches"] == 4
    assert exporter.written_lines("step_time") == 3
    assert exporter.written_lines("step_memory") == 1
    assert exporter.abandoned_streams == frozenset()


@pytest.mark.parametrize("hostname", [False, True])
def test_hostname_setting(tmp_path: Path, hostname: bool) -> None:
    ctx = context(tmp_path, ("step_time",), hostname=hostname)
    exporter = JsonlExporter.create(ctx)
    exporter.export([step_time(0, hostname="node-a"), step_time(1, hostname=None)])
    exporter.close(summary())
    first, second, closing = (orjson.loads(x) for x in lines_of(file_of(ctx, "step_time")))
    if hostname:
        assert list(first)[9] == "hostname" and list(first)[8] == "node_rank"
        assert first["hostname"] == "node-a"
        assert "hostname" in second and second["hostname"] is None
    else:
        assert "hostname" not in first and "hostname" not in second
    assert "hostname" not in closing


def test_empty_run_leaves_only_closing_lines(tmp_path: Path) -> None:
    ctx = context(tmp_path, ALL_STREAMS, hostname=True)
    exporter = JsonlExporter.create(ctx)
    exporter.close(summary(dropped=2))
    for stream in ALL_STREAMS:
        (only,) = lines_of(file_of(ctx, stream))
        assert orjson.loads(only) == {
            "stream": stream,
            "closing": True,
            "schema_version": 1,
            "written_records": 0,
            "dropped_batches": 2,
        }


def test_close_is_idempotent_and_later_exports_fail(tmp_path: Path) -> None:
    ctx = context(tmp_path, ("step_time",))
    exporter = JsonlExporter.create(ctx)
    exporter.export([step_time(0)])
    exporter.close(summary(dropped=1))
    content = file_of(ctx, "step_time").read_bytes()
    exporter.close(summary(dropped=9))
    assert file_of(ctx, "step_time").read_bytes() == content
    result = exporter.export([step_time(1), step_time(2)])
    assert (result.written, result.failed, result.abandoned) == (0, 2, 0)
    assert result.problem is not None and "is closed" in result.problem
    assert file_of(ctx, "step_time").read_bytes() == content


def test_lines_are_visible_as_soon_as_export_returns(tmp_path: Path) -> None:
    ctx = context(tmp_path, ("step_time",))
    exporter = JsonlExporter.create(ctx)
    with open(file_of(ctx, "step_time"), "rb") as reader:
        exporter.export([step_time(0), step_time(1)])
        got = reader.read()
        assert got.count(b"\n") == 2 and got.endswith(b"\n")
        exporter.export([step_time(2)])
        assert orjson.loads(reader.read())["seq"] == 2
    exporter.close(summary())


def test_unserializable_records_are_skipped_and_reported(tmp_path: Path) -> None:
    ctx = context(tmp_path, ("step_time",))
    exporter = JsonlExporter.create(ctx)
    batch = [step_time(0), step_time(1, cpu_ms=float("nan")), step_time(2), step_memory(3)]
    result = exporter.export(batch)
    assert (result.written, result.failed, result.abandoned) == (2, 2, 0)
    assert result.problem == "2 of 4 step_time records could not be serialized and were not written"
    assert exporter.serialization_failures("step_time") == 2
    # The stream goes on: a partial batch is no write failure.
    exporter.export([step_time(4)])
    exporter.close(summary())
    objs = [orjson.loads(x) for x in lines_of(file_of(ctx, "step_time"))]
    assert [o.get("seq") for o in objs[:-1]] == [0, 2, 4]
    assert objs[-1]["written_records"] == 3
    assert b"NaN" not in file_of(ctx, "step_time").read_bytes()


def test_records_of_an_unselected_stream_fail_whole(tmp_path: Path) -> None:
    ctx = context(tmp_path, ("step_time",))
    exporter = JsonlExporter.create(ctx)
    stray = StdoutStderrRecord(
        observed_timestamp_unix_ns=1, rank=0, timestamp_unix_ns=1, seq=0, source="stdout", line="x"
    )
    result = exporter.export([stray, stray])
    assert result == ExportResult(
        written=0,
        failed=2,
        problem="records of stdout_stderr are not a selected export stream",
    )
    exporter.close(summary())
    assert len(lines_of(file_of(ctx, "step_time"))) == 1


def test_concurrent_tail_sees_only_whole_lines(tmp_path: Path) -> None:
    ctx = context(tmp_path, ("step_time",))
    exporter = JsonlExporter.create(ctx)
    path = file_of(ctx, "step_time")
    total, batch = 50_000, 250
    records = [step_time(i) for i in range(total)]
    seen: list[int] = []
    closing: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    done_writing = threading.Event()

    def tail() -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                pending = b""
                while True:
                    # Small reads, so chunk edges fall inside lines and the tail is partial.
                    writer_done = done_writing.is_set()
                    chunk = os.read(fd, 1000)
                    if not chunk:
                        if closing or writer_done:
                            break  # EOF after the writer finished: nothing more will come
                        time.sleep(0.0002)
                        continue
                    pending += chunk
                    *complete, pending = pending.split(b"\n")
                    for raw in complete:
                        obj = orjson.loads(raw)  # every complete line must parse
                        if obj.get("closing"):
                            closing.append(obj)
                        else:
                            seen.append(obj["seq"])
                assert pending == b""
            finally:
                os.close(fd)
        except BaseException as exc:
            errors.append(exc)

    def write() -> None:
        try:
            for start in range(0, total, batch):
                exporter.export(records[start : start + batch])
            exporter.close(summary())
        except BaseException as exc:
            errors.append(exc)
        finally:
            done_writing.set()

    reader = threading.Thread(target=tail, daemon=True)
    writer = threading.Thread(target=write, daemon=True)
    reader.start()
    writer.start()
    writer.join(timeout=120)
    reader.join(timeout=120)
    assert not reader.is_alive() and not writer.is_alive()
    assert errors == []
    assert seen == list(range(total))
    assert closing == [
        {
            "stream": "step_time",
            "closing": True,
            "schema_version": 1,
            "written_records": total,
            "dropped_batches": 0,
        }
    ]


# -- failures -------------------------------------------------------------------------


def test_a_failing_file_is_abandoned_and_the_others_go_on(tmp_path: Path, dev_full: int) -> None:
    ctx = context(tmp_path, ("step_time", "step_memory"))
    exporter = JsonlExporter.create(ctx)
    exporter.export([step_time(0), step_time(1)])
    exporter.export([step_memory(0)])

    # From here on every write to step_time.jsonl fails with ENOSPC, as on a full disk.
    os.dup2(dev_full, fd_of(exporter, "step_time"))
    result = exporter.export([step_time(2), step_time(3), step_time(4)])
    assert (result.written, result.failed, result.abandoned) == (0, 0, 3)
    assert result.problem is not None and os.strerror(errno.ENOSPC) in result.problem
    assert exporter.abandoned_streams == {"step_time"}
    reason = exporter.abandoned_reason("step_time")
    assert reason is not None and "write failed" in reason

    later = exporter.export([step_time(5)])
    assert (later.written, later.failed, later.abandoned) == (0, 0, 1)
    assert later.problem is not None and "was abandoned" in later.problem

    exporter.export([step_memory(1), step_memory(2)])
    with pytest.raises(ExportCloseError) as closed:
        exporter.close(summary(dropped=1))
    assert closed.value.streams == ("step_time",)

    st_objs = [orjson.loads(x) for x in lines_of(file_of(ctx, "step_time"))]
    assert [o["seq"] for o in st_objs] == [0, 1]
    assert not any(o.get("closing") for o in st_objs)
    assert exporter.written_lines("step_time") == 2
    mem = [orjson.loads(x) for x in lines_of(file_of(ctx, "step_memory"))]
    assert [o.get("seq") for o in mem[:-1]] == [0, 1, 2]
    assert mem[-1] == {
        "stream": "step_memory",
        "closing": True,
        "schema_version": 1,
        "written_records": 3,
        "dropped_batches": 1,
    }


def test_short_write_then_failure_counts_whole_lines(tmp_path: Path) -> None:
    ctx = context(tmp_path, ("step_time", "step_memory"))
    exporter = JsonlExporter.create(ctx)
    exporter.export([step_time(0)])
    path = file_of(ctx, "step_time")
    line_len = path.stat().st_size
    # The kernel takes the batch up to 2.5 lines past the current size, then refuses (EFBIG).
    limit = line_len + line_len * 5 // 2
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        result = exporter.export([step_time(i) for i in range(1, 6)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    assert (result.written, result.failed, result.abandoned) == (2, 0, 3)
    assert result.problem is not None and os.strerror(errno.EFBIG) in result.problem
    assert path.stat().st_size == limit
    data = path.read_bytes()
    *whole, tail = data.split(b"\n")
    assert [orjson.loads(x)["seq"] for x in whole] == [0, 1, 2]
    assert tail and not tail.endswith(b"}")  # the unterminated half line the failure left
    assert exporter.written_lines("step_time") == 3

    exporter.export([step_memory(0)])
    with pytest.raises(ExportCloseError):
        exporter.close(summary())
    assert path.read_bytes() == data  # no closing line on an abandoned file
    assert orjson.loads(lines_of(file_of(ctx, "step_memory"))[-1])["written_records"] == 1


def test_removed_file_is_detected_and_abandoned(tmp_path: Path) -> None:
    ctx = context(tmp_path, ("step_time", "step_memory"))
    exporter = JsonlExporter.create(ctx, link_check_interval_s=0.0)
    exporter.export([step_time(0)])
    file_of(ctx, "step_time").unlink()
    result = exporter.export([step_time(1)])
    assert (result.written, result.failed, result.abandoned) == (0, 0, 1)
    assert exporter.abandoned_reason("step_time") == "the file was removed"
    exporter.export([step_memory(0)])
    with pytest.raises(ExportCloseError) as closed:
        exporter.close(summary())
    assert closed.value.streams == ("step_time",)
    assert not file_of(ctx, "step_time").exists()
    assert len(lines_of(file_of(ctx, "step_memory"))) == 2


def test_removal_is_caught_at_close_even_between_checks(tmp_path: Path) -> None:
    ctx = context(tmp_path, ("step_time",))
    exporter = JsonlExporter.create(ctx, link_check_interval_s=3600.0)
    exporter.export([step_time(0)])
    file_of(ctx, "step_time").unlink()
    exporter.export([step_time(1)])  # not yet checked: the line goes to the unlinked inode
    with pytest.raises(ExportCloseError):
        exporter.close(summary())
    assert exporter.abandoned_streams == {"step_time"}
    assert not file_of(ctx, "step_time").exists()


def test_close_does_not_wait_forever_for_a_stuck_write(tmp_path: Path) -> None:
    ctx = context(tmp_path, ("step_time", "step_memory"))
    exporter = JsonlExporter.create(ctx, close_wait_s=0.05)
    stuck = exporter._files["step_time"].lock
    stuck.acquire()  # stands for a worker blocked inside a write
    try:
        with pytest.raises(ExportCloseError) as closed:
            exporter.close(summary())
    finally:
        stuck.release()
    assert closed.value.streams == ("step_time",)
    assert file_of(ctx, "step_time").read_bytes() == b""
    assert len(lines_of(file_of(ctx, "step_memory"))) == 1
