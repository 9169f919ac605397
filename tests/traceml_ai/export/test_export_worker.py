"""ExportWorker and ExportPipeline: real threads, real files, a real fork."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.custom_exporters import (
    HangingExporter,
    RaisingExporter,
    batch,
    process_item,
    stdout_item,
    step_memory_item,
    step_time_item,
    system_item,
)
from traceml_ai.export import (
    ExportStats,
    ExportWorker,
    InMemoryExporter,
    RecordBuilder,
    capture_export,
    start_export,
)
from traceml_ai.export import _worker as export_worker
from traceml_ai.export._encoded import EncodedLines
from traceml_ai.settings import ExportSettings
from traceml_records import ExportLoss

LOAD_STREAMS = ("step_time", "step_memory", "process")
MAKERS = {
    "step_time": lambda seq: step_time_item(seq=seq, step=seq + 1),
    "step_memory": lambda seq: step_memory_item(seq=seq, step=seq + 1, device="cuda:0"),
    "process": lambda seq: process_item(seq=seq),
}


def make_worker(
    exporter: Any, streams: tuple[str, ...] = LOAD_STREAMS, **limits: Any
) -> ExportWorker:
    return ExportWorker(exporter, RecordBuilder(streams, include_hostname=False), **limits)


def wait_until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


# -- accounting under load --------------------------------------------------------------


def test_load_every_produced_record_is_accounted_for() -> None:
    """60,000 records through a bounded queue into an exporter that fails some calls: three
    bursts of 160 batches, each far past the queue's 64, and 120 batches after them."""
    exporter = RaisingExporter(fail_every=13)
    worker = make_worker(exporter, max_queue_batches=64)
    worker.start()
    per_batch = 100
    produced = dict.fromkeys(LOAD_STREAMS, 0)
    skipped_by_batch: dict[tuple[str, int], int] = {}
    batches: list[tuple[str, int, int]] = []  # (stream, first seq, valid records)
    seq = dict.fromkeys(LOAD_STREAMS, 0)
    plan = ["step_time"] * 10 + ["step_memory"] * 5 + ["process"] * 5
    total = 0
    n = 0
    while total < 60_000:
        stream = plan[n % len(plan)]
        first = seq[stream]
        items = [MAKERS[stream](first + i) for i in range(per_batch)]
        seq[stream] += per_batch
        bad = n % 3  # a few malformed items in most batches: they must count as skipped
        for j in range(bad):
            items[j * 7] = {"malformed": j}
        produced[stream] += per_batch
        total += per_batch
        skipped_by_batch[(stream, first)] = bad
        batches.append((stream, first, per_batch - bad))
        worker.submit(batch(stream, items, nbytes=10_000))
        n += 1
        if n % 160 == 0:
            # Bursts far larger than the queue make drops certain; letting the worker
            # catch up between bursts makes sure most batches are written too.
            wait_until(lambda: worker.queued_batches < 16)
    stats = worker.shutdown(timeout=30.0)

    seen: dict[str, set[int]] = {s: set() for s in LOAD_STREAMS}
    for stream, records in exporter.records.items():
        seqs = [r.seq for r in records]
        assert seqs == sorted(seqs), "records of one rank and stream keep their order"
        seen[stream].update(seqs)
    failed_seen: dict[str, set[int]] = {s: set() for s in LOAD_STREAMS}
    for stream, records in exporter.failed.items():
        failed_seen[stream].update(r.seq for r in records)

    dropped_records = dict.fromkeys(LOAD_STREAMS, 0)
    dropped_items = dict.fromkeys(LOAD_STREAMS, 0)
    dropped_batches = 0
    skipped = 0
    for stream, first, valid in batches:
        batch_seqs = set(range(first, first + per_batch))
        arrived = (seen[stream] | failed_seen[stream]) & batch_seqs
        if arrived:
            assert len(arrived) == valid, "a processed batch has all its valid records counted"
            skipped += skipped_by_batch[(stream, first)]
        else:
            dropped_batches += 1
            dropped_items[stream] += per_batch
            dropped_records[stream] += valid

    assert stats.dropped_batches == dropped_batches > 0
    assert stats.skipped_items == skipped > 0
    for stream in LOAD_STREAMS:
        written = stats.written_records[stream]
        failed = stats.failed_records[stream]
        assert written == len(exporter.records_of(stream)) > 0
        assert failed == len(exporter.failed.get(stream, [])) > 0
        skipped_here = sum(
            skipped_by_batch[(s, f)]
            for s, f, _ in batches
            if s == stream and (seen[s] | failed_seen[s]) & {f + i for i in range(per_batch)}
        )
        assert written + failed + skipped_here + dropped_items[stream] == produced[stream]
    assert stats.queue_high_water_batches == 64
    assert exporter.closed_with is not None
    assert exporter.closed_with.written_records == stats.written_records
    assert exporter.closed_with.dropped_batches == stats.dropped_batches
    assert exporter.close_calls == 1
    loss = stats.to_loss()
    assert loss == ExportLoss(
        written_records=stats.written_total,
        dropped_batches=dropped_batches,
        failed_records=stats.failed_total,
        skipped_items=skipped,
        exporter_failed=False,
    )


def test_exporter_raising_on_every_call_counts_everything_failed() -> None:
    exporter = RaisingExporter(fail_every=1)
    worker = make_worker(exporter)
    worker.start()
    for i in range(5):
        worker.submit(batch("step_time", [step_time_item(seq=i * 2 + j) for j in range(2)]))
    stats = worker.shutdown(timeout=10.0)
    assert stats.failed_records["step_time"] == 10
    assert stats.written_total == 0 and stats.dropped_batches == 0
    assert not stats.exporter_failed
    assert exporter.close_calls == 1
    loss = stats.to_loss()
    assert loss is not None and loss.failed_records == 10


def test_system_batch_exports_two_groups_and_counts_each_stream() -> None:
    exporter = InMemoryExporter()
    worker = make_worker(exporter, streams=("system", "system_gpu"))
    worker.start()
    worker.submit(batch("system", [system_item(seq=0, gpus=2), system_item(seq=1, gpus=3)]))
    worker.submit(batch("step_time", [step_time_item()]))  # not selected: ignored
    stats = worker.shutdown(timeout=10.0)
    assert stats.written_records == {"system": 2, "system_gpu": 5}
    assert exporter.export_calls == 2
    assert stats.to_loss() is None


# -- queue bounds -----------------------------------------------------------------------


def test_queue_bounded_by_bytes_and_batches_drops_without_blocking() -> None:
    exporter = InMemoryExporter()
    worker = make_worker(exporter, max_queue_batches=3, max_queue_bytes=1000)
    # Not started: nothing drains, so the bounds decide alone.
    worker.submit(batch("step_time", [step_time_item(seq=0)], nbytes=400))
    worker.submit(batch("step_time", [step_time_item(seq=1)], nbytes=400))
    worker.submit(batch("step_time", [step_time_item(seq=2)], nbytes=400))  # 1200 > 1000
    worker.submit(batch("step_time", [step_time_item(seq=3)], nbytes=5000))  # alone too big
    worker.submit(batch("step_time", [step_time_item(seq=4)], nbytes=100))
    worker.submit(batch("step_time", [step_time_item(seq=5)], nbytes=100))  # 4th batch
    live = worker.stats()
    assert live.dropped_batches == 3 and worker.queued_batches == 3
    assert live.queue_high_water_batches == 3 and live.queue_high_water_bytes == 900
    # shutdown of a never-started worker still drains and closes.
    stats = worker.shutdown(timeout=10.0)
    assert [r.seq for r in exporter.records_of("step_time")] == [0, 1, 4]
    assert stats.dropped_batches == 3 and stats.written_records["step_time"] == 3


def test_broken_batch_object_is_dropped_not_raised() -> None:
    worker = make_worker(InMemoryExporter())
    worker.submit("not a batch")  # type: ignore[arg-type]
    worker.submit(batch("step_time", [step_time_item()], nbytes=-5))
    assert worker.stats().dropped_batches == 2
    assert worker.shutdown(timeout=5.0).dropped_batches == 2


def test_submit_after_shutdown_and_double_shutdown() -> None:
    exporter = InMemoryExporter()
    worker = make_worker(exporter)
    worker.start()
    worker.submit(batch("step_time", [step_time_item()]))
    first = worker.shutdown(timeout=5.0)
    worker.submit(batch("step_time", [step_time_item(seq=1)]))
    worker.submit(batch("step_time", [step_time_item(seq=2)]))
    assert worker.dropped_batches == 2, "submits after shutdown count as dropped batches"
    second = worker.shutdown(timeout=5.0)
    assert second is first and second.written_records["step_time"] == 1
    assert exporter.close_calls == 1
    worker.start()  # no effect after shutdown
    assert worker.queued_batches == 0


def test_empty_run_closes_once_with_zeros() -> None:
    exporter = InMemoryExporter()
    worker = make_worker(exporter)
    worker.start()
    stats = worker.shutdown(timeout=5.0)
    assert exporter.close_calls == 1
    assert exporter.closed_with is not None
    assert exporter.closed_with.written_records == {s: 0 for s in LOAD_STREAMS}
    assert exporter.closed_with.dropped_batches == 0
    assert stats.written_records == {s: 0 for s in LOAD_STREAMS}
    assert stats.failed_records == {s: 0 for s in LOAD_STREAMS}
    assert stats.to_loss() is None and not stats.lost_anything


def test_backlog_left_at_the_deadline_counts_as_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    class Slow(InMemoryExporter):
        def export(self, records: Any) -> None:
            time.sleep(0.05)
            super().export(records)

    # One batch per take, so the backlog is still queued when the deadline comes.
    monkeypatch.setattr(export_worker, "_TAKE_MAX_BYTES", 1)
    exporter = Slow()
    worker = make_worker(exporter)
    for i in range(100):
        worker.submit(batch("step_time", [step_time_item(seq=i)]))
    worker.start()
    started = time.monotonic()
    stats = worker.shutdown(timeout=0.3)
    assert time.monotonic() - started < 0.3 + 1.0
    written = stats.written_records["step_time"]
    assert 0 < written < 100
    assert written + stats.dropped_batches == 100
    assert not stats.exporter_failed
    assert exporter.closed_with is not None
    assert exporter.closed_with.dropped_batches == stats.dropped_batches


def test_a_backlog_goes_out_as_one_group_per_stream_in_batch_order() -> None:
    """Batches queued while the worker was busy are taken together: their records reach
    the exporter as one group per stream (the C encoder's lines joined, records lists
    joined), in the order the batches came, and every count still adds up."""

    class Groups:
        export_input = "encoded_lines"

        def __init__(self) -> None:
            self.groups: list[Any] = []

        def export(self, records: Any) -> None:
            self.groups.append(records)

        def close(self, summary: Any) -> None:
            return None

    exporter = Groups()
    # stdout_stderr: a stream the C encoder does not write (its groups are records)
    makers = {**MAKERS, "stdout_stderr": lambda seq: stdout_item(seq=seq)}
    builder = RecordBuilder(tuple(makers), include_hostname=False, encode_lines=True)
    worker = ExportWorker(exporter, builder)
    for i in range(30):
        for stream, make in makers.items():
            worker.submit(batch(stream, [make(i)]))
    worker.start()
    stats = worker.shutdown(timeout=10.0)
    assert stats.written_records == dict.fromkeys(makers, 30)
    assert stats.dropped_batches == 0 and stats.skipped_items == 0
    assert len(exporter.groups) == len(makers)  # one group per stream
    kinds = {type(next(iter(group))).__name__: group for group in exporter.groups}
    assert type(kinds["StepTimeRecord"]) is EncodedLines
    assert type(kinds["StdoutStderrRecord"]) is list
    for group in exporter.groups:
        assert [record.seq for record in group] == list(range(30))


def test_joined_groups_keep_the_order_where_lines_and_records_alternate() -> None:
    lines = [
        EncodedLines("step_time", b'{"a":%d}\n' % i, 1) for i in range(2)
    ]  # only joined here, never parsed
    joined = export_worker._joined("step_time", [lines[0], lines[1], ["r2", "r3"], ["r4"]])
    assert [(stream, type(group).__name__, len(group)) for stream, group in joined] == [
        ("step_time", "EncodedLines", 2),
        ("step_time", "list", 3),
    ]
    first = joined[0][1]
    assert isinstance(first, EncodedLines) and first.data == b'{"a":0}\n{"a":1}\n'
    assert joined[1][1] == ["r2", "r3", "r4"]


# -- hung exporters -----------------------------------------------------------------------


def test_exporter_hanging_in_export_cannot_hold_shutdown() -> None:
    exporter = HangingExporter("export", hang_after=1)
    worker = make_worker(exporter)
    worker.start()
    try:
        worker.submit(batch("step_time", [step_time_item(seq=0)]))
        # Its own group (batches queued together would be exported as one).
        wait_until(lambda: worker.stats().written_records["step_time"] == 1)
        worker.submit(batch("step_time", [step_time_item(seq=1), step_time_item(seq=2)]))
        assert exporter.entered.wait(10.0)
        for i in range(3, 8):
            worker.submit(batch("step_time", [step_time_item(seq=i)]))
        started = time.monotonic()
        stats = worker.shutdown(timeout=0.5)
        elapsed = time.monotonic() - started
        assert elapsed < 0.5 + 1.0
        assert stats.exporter_failed
        assert stats.written_records["step_time"] == 1
        assert stats.failed_records["step_time"] == 2  # the group stuck in export()
        assert stats.dropped_batches == 5
        # close() still got its chance, on a helper thread, with the final counts.
        wait_until(lambda: exporter.closed_with is not None, timeout=5.0)
        assert exporter.closed_with is not None
        assert exporter.closed_with.dropped_batches == 5
    finally:
        exporter.release.set()
    # The stuck call returning later changes nothing.
    time.sleep(0.1)
    assert worker.stats() == stats
    assert worker.stats().to_loss() == ExportLoss(
        written_records=1,
        dropped_batches=5,
        failed_records=2,
        skipped_items=0,
        exporter_failed=True,
    )


def test_exporter_hanging_in_close_cannot_hold_shutdown() -> None:
    exporter = HangingExporter("close")
    worker = make_worker(exporter)
    worker.start()
    try:
        worker.submit(batch("step_time", [step_time_item(seq=0), step_time_item(seq=1)]))
        started = time.monotonic()
        stats = worker.shutdown(timeout=0.5)
        elapsed = time.monotonic() - started
        assert exporter.entered.is_set()
        assert elapsed < 0.5 + 1.0
        assert stats.exporter_failed
        assert stats.written_records["step_time"] == 2 and stats.dropped_batches == 0
    finally:
        exporter.release.set()


def test_exporter_whose_close_raises_is_marked_failed() -> None:
    class BadClose(InMemoryExporter):
        def close(self, summary: Any) -> None:
            raise OSError("disk gone")

    worker = make_worker(BadClose())
    worker.start()
    worker.submit(batch("step_time", [step_time_item()]))
    stats = worker.shutdown(timeout=5.0)
    assert stats.exporter_failed and stats.written_records["step_time"] == 1
    assert stats.to_loss() is not None


# -- fork ---------------------------------------------------------------------------------


def test_fork_while_worker_runs_gives_child_a_stopped_dropping_worker() -> None:
    exporter = InMemoryExporter()
    worker = make_worker(exporter)
    worker.start()
    worker.submit(batch("step_time", [step_time_item(seq=0)]))
    wait_until(lambda: exporter.export_calls == 1)

    # Another parent thread holds the worker's lock at the moment of the fork: a child
    # that inherited it as is would deadlock on its first submit.
    holding = threading.Event()
    release = threading.Event()

    def hold_lock() -> None:
        with worker._queue.cond:
            holding.set()
            release.wait()

    holder = threading.Thread(target=hold_lock)
    holder.start()
    assert holding.wait(5.0)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            os.close(read_fd)
            calls_before = exporter.export_calls
            worker.submit(batch("step_time", [step_time_item(seq=99)]))
            stats = worker.shutdown(timeout=1.0)
            report = {
                "dropped": stats.dropped_batches,
                "written": stats.written_total,
                "exports": exporter.export_calls - calls_before,
                "closed": exporter.close_calls,
            }
            os.write(write_fd, orjson.dumps(report))
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    release.set()
    holder.join(5.0)
    status = _wait_child(pid, timeout=10.0)
    data = os.read(read_fd, 4096)
    os.close(read_fd)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert orjson.loads(data) == {"dropped": 1, "written": 0, "exports": 0, "closed": 0}

    # The parent's worker is unaffected.
    worker.submit(batch("step_time", [step_time_item(seq=1)]))
    stats = worker.shutdown(timeout=5.0)
    assert [r.seq for r in exporter.records_of("step_time")] == [0, 1]
    assert stats.dropped_batches == 0 and exporter.close_calls == 1


def _wait_child(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("forked child hung (deadlocked on an inherited lock?)")
        time.sleep(0.01)


# -- pipeline -------------------------------------------------------------------------------


def test_start_export_off_returns_none(tmp_path: Path) -> None:
    assert start_export(ExportSettings(exporter=""), tmp_path) is None
    assert not (tmp_path / "aggregator").exists()


def test_pipeline_with_in_memory_exporter(tmp_path: Path) -> None:
    settings = ExportSettings(
        exporter="traceml_ai.export:make_in_memory_exporter",
        export_streams="step_time,system",
        exporter_hostname=True,
    )
    with capture_export() as exporters:
        pipeline = start_export(settings, tmp_path)
    assert pipeline is not None and pipeline.failure is None
    (exporter,) = exporters
    assert exporter.context is not None
    assert exporter.context.streams == ("step_time", "system", "system_gpu")
    assert exporter.context.export_dir == tmp_path / "aggregator" / "export"
    assert exporter.context.include_hostname
    pipeline.submit(batch("step_time", [step_time_item(seq=0), step_time_item(seq=1)]))
    pipeline.submit(batch("system", [system_item(gpus=1)]))
    pipeline.submit(batch("process", [process_item()]))  # unselected
    stats = pipeline.finalize(timeout=5.0)
    assert stats.written_records == {"step_time": 2, "system": 1, "system_gpu": 1}
    assert pipeline.loss() is None
    assert exporter.records_of("step_time")[0].hostname == "host-a"
    assert pipeline.finalize(timeout=5.0) is stats


def test_pipeline_reports_loss_of_skipped_items(tmp_path: Path) -> None:
    settings = ExportSettings(exporter="traceml_ai.export:make_in_memory_exporter")
    pipeline = start_export(settings, tmp_path, max_queue_batches=5)
    assert pipeline is not None
    pipeline.submit(batch("step_time", [step_time_item(), {"bad": True}]))
    pipeline.finalize(timeout=5.0)
    assert pipeline.loss() == ExportLoss(
        written_records=1,
        dropped_batches=0,
        failed_records=0,
        skipped_items=1,
        exporter_failed=False,
    )


def _read_lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_pipeline_jsonl_end_to_end(tmp_path: Path) -> None:
    """Integration with the built-in JsonlExporter: lines, closing lines, no loss."""
    settings = ExportSettings(exporter="jsonl", export_streams="step_time,process")
    pipeline = start_export(settings, tmp_path)
    assert pipeline is not None and pipeline.failure is None
    export_dir = tmp_path / "aggregator" / "export"
    assert sorted(p.name for p in export_dir.iterdir()) == ["process.jsonl", "step_time.jsonl"]
    pipeline.submit(batch("step_time", [step_time_item(seq=i, step=i + 1) for i in range(3)]))
    pipeline.submit(batch("process", [process_item(seq=0)]))
    pipeline.submit(batch("step_memory", [step_memory_item()]))  # unselected
    stats = pipeline.finalize(timeout=10.0)
    assert stats.written_records == {"step_time": 3, "process": 1}
    assert pipeline.loss() is None
    lines = _read_lines(export_dir / "step_time.jsonl")
    assert [d.get("step") for d in lines[:3]] == [1, 2, 3]
    assert all("hostname" not in d for d in lines)
    assert lines[-1] == {
        "stream": "step_time",
        "closing": True,
        "schema_version": 1,
        "written_records": 3,
        "dropped_batches": 0,
    }
    assert _read_lines(export_dir / "process.jsonl")[-1]["written_records"] == 1


def test_pipeline_jsonl_existing_file_counts_records_as_failed(tmp_path: Path) -> None:
    export_dir = tmp_path / "aggregator" / "export"
    export_dir.mkdir(parents=True)
    (export_dir / "step_time.jsonl").write_bytes(b"keep me\n")
    messages: list[str] = []
    pipeline = start_export(ExportSettings(exporter="jsonl"), tmp_path, report=messages.append)
    assert pipeline is not None and pipeline.failure is not None
    assert len(messages) == 1 and "already exists" in messages[0]
    pipeline.submit(batch("step_time", [step_time_item(seq=0), step_time_item(seq=1)]))
    pipeline.submit(batch("step_time", [step_time_item(seq=2), {"bad": 1}]))
    stats = pipeline.finalize(timeout=5.0)
    assert stats.exporter_failed
    assert stats.failed_records == {"step_time": 3} and stats.written_total == 0
    assert pipeline.loss() == ExportLoss(
        written_records=0,
        dropped_batches=0,
        failed_records=3,
        skipped_items=1,
        exporter_failed=True,
    )
    assert (export_dir / "step_time.jsonl").read_bytes() == b"keep me\n"
    assert len(messages) == 1, "the failure is reported once, not per batch"


def test_stats_type_is_frozen() -> None:
    stats = make_worker(InMemoryExporter()).shutdown(timeout=1.0)
    assert isinstance(stats, ExportStats)
    with pytest.raises(AttributeError):
        stats.dropped_batches = 3  # type: ignore[misc]
