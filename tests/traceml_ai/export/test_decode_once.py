"""With the live views on, the export worker decodes each batch once and hands the
decoded message to the live views (``ExportWorker.on_built``): the files are the same
bytes as without them, and the live views see every batch, whatever the views do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from tests.custom_exporters import process_item, step_memory_item, step_time_item
from traceml_ai.export import (
    ExportPipeline,
    ExportWorker,
    InMemoryExporter,
    RecordBuilder,
    start_export,
)
from traceml_ai.monitor._feed import LiveFeed
from traceml_ai.monitor._state import LiveState
from traceml_ai.settings import ExportSettings
from traceml_ai.transport.wire import ReceivedBatch, make_batch_message

STREAMS = "step_time,step_memory,process"


def _identity(rank: int) -> dict[str, Any]:
    return {
        "global_rank": rank,
        "local_rank": rank,
        "world_size": 4,
        "local_world_size": 4,
        "node_rank": 0,
        "pid": 100 + rank,
        "hostname": "h",
    }


def _encoded(stream: str, items: list[Any], rank: int, observed: int) -> ReceivedBatch:
    """A batch as the server queues it: the frame body our senders write, still encoded."""
    body = orjson.dumps(make_batch_message("t", _identity(rank), stream, items))
    return ReceivedBatch(observed, body, len(body))


def _batches() -> list[ReceivedBatch]:
    out: list[ReceivedBatch] = []
    observed = 1_700_000_000_000_000_000
    for n in range(1, 7):
        for rank in range(4):
            observed += 1000
            steps = [step_time_item(seq=2 * n + k, step=2 * n + k) for k in (0, 1)]
            out.append(_encoded("step_time", steps, rank, observed))
            memory = [step_memory_item(seq=n, step=2 * n + 1, device="cuda:0")]
            out.append(_encoded("step_memory", memory, rank, observed))
            out.append(_encoded("process", [process_item(seq=n)], rank, observed))
    # A stream the export does not select, and a body that passed the server's prefix
    # check but is not JSON further in.
    wait = {"step": 2, "phase": "_traceml_internal:backward_time", "op": "all_reduce"}
    out.append(_encoded("collectives", [{**wait, "wait_ms": 1.0}], 0, observed + 1))
    broken = _encoded("step_time", [], 0, observed + 2).payload
    assert type(broken) is bytes
    out.append(ReceivedBatch(observed + 2, broken[:-3] + b"[}", len(broken)))
    return out


def _export(run_dir: Path, hand: Any = None) -> tuple[ExportPipeline, dict[str, bytes]]:
    pipeline = start_export(ExportSettings(exporter="jsonl", export_streams=STREAMS), run_dir)
    assert pipeline is not None
    pipeline.worker.on_built = hand
    for received in _batches():
        pipeline.submit(received)
    pipeline.finalize(timeout=10.0)
    folder = run_dir / "aggregator" / "export"
    return pipeline, {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_files_are_the_same_bytes_and_the_views_see_each_batch_decoded_once(
    tmp_path: Path,
) -> None:
    _, alone = _export(tmp_path / "alone")
    state = LiveState()
    feed = LiveFeed(state)
    handed: list[str] = []

    def hand(received: ReceivedBatch) -> None:
        payload = received.payload
        handed.append(type(payload).__name__ if type(payload) is not dict else payload["stream"])
        feed.submit(received)

    feed.start()
    with_views, files = _export(tmp_path / "views", hand)
    feed.stop(5.0)

    assert files == alone  # byte for byte, closing lines included
    assert sorted(files) == ["process.jsonl", "step_memory.jsonl", "step_time.jsonl"]
    assert with_views.loss() is not None  # the broken body, counted as the export counts it
    # Every selected batch came decoded (parsed once, by the worker); the unselected
    # stream's and the broken body's bytes came as they were, for the feed to read.
    assert handed.count("step_time") == 24 and handed.count("process") == 24
    assert handed.count("step_memory") == 24 and handed.count("bytes") == 2
    assert len(handed) == len(_batches())
    assert feed.dropped_batches == 0 and feed.bad_batches == 1  # the broken body
    assert [(r.rank, r.steps, r.last_step) for r in state.ranks()] == [
        (rank, 12, 13) for rank in range(4)
    ]
    assert all(r.peak_memory and r.process for r in state.ranks())
    assert state.recent_columns()[0].row(0).waits  # the unselected stream's batch counts


def test_a_failing_live_view_costs_the_files_nothing(tmp_path: Path) -> None:
    _, alone = _export(tmp_path / "alone")
    calls = [0]

    def broken_view(received: ReceivedBatch) -> None:
        calls[0] += 1
        raise RuntimeError("a bug in the live views")

    pipeline, files = _export(tmp_path / "views", broken_view)
    assert files == alone
    assert calls[0] == len(_batches())
    assert pipeline.stats().written_records == {"step_time": 48, "step_memory": 24, "process": 24}


def test_a_decoded_batch_weighs_more_in_the_feeds_queue() -> None:
    """The feed's byte bound counts a decoded batch at DECODED_WEIGHT times its wire
    size (its parsed objects take more memory than its bytes)."""
    from traceml_ai.monitor._feed import DECODED_WEIGHT

    received = _encoded("step_time", [step_time_item(seq=1, step=1)], 0, 1)
    size = received.nbytes
    # Room for 2 encoded batches: 2 decoded ones go over it when the weight is 2 or more.
    feed = LiveFeed(LiveState(), max_bytes=2 * size)
    feed.submit(received)
    feed.submit(received)
    assert feed.dropped_batches == 0
    body = received.payload
    assert type(body) is bytes
    decoded = ReceivedBatch(1, orjson.loads(body), size)
    feed = LiveFeed(LiveState(), max_bytes=2 * size)
    feed.submit(decoded)
    feed.submit(decoded)
    assert DECODED_WEIGHT >= 2 and feed.dropped_batches == 1


def test_a_worker_behind_builds_from_the_bytes_and_hands_them_on() -> None:
    """Above SHARE_DECODE_UP_TO of its queue the worker does not decode for the live
    views (a decode and a build from objects cost the files more than the C encoder's
    read of the bytes); at or below it, it does."""
    from traceml_ai.export._worker import SHARE_DECODE_UP_TO

    worker = ExportWorker(
        InMemoryExporter(), RecordBuilder(["step_time"], include_hostname=False),
        max_queue_batches=8,
    )  # fmt: skip
    worker.on_built = lambda received: None
    received = _encoded("step_time", [step_time_item(seq=1, step=1)], 0, 1)
    assert type(worker._decoded(received).payload) is dict  # an empty queue: shared
    for _ in range(int(8 * SHARE_DECODE_UP_TO) + 1):  # not started: the batches stay
        worker.submit(received)
    assert worker.backlog > SHARE_DECODE_UP_TO
    assert worker._decoded(received) is received  # behind: the bytes, as they came
    worker.shutdown(timeout=1.0)
