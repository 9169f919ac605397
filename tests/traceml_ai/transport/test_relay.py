"""The relay over real loopback sockets: ranks' ``RankSender`` -> ``Relay`` (one or two
chained) -> ``AggregatorServer``; exact per-rank accounting, drops counted per rank and
stream (and, through a real ``Aggregator``, in ``finalization_warning.json``),
reconnection after the aggregator restarts, garbage refused at the relay."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.e2e_helpers import free_port
from traceml_ai.aggregator import Aggregator, AggregatorConfig
from traceml_ai.settings import ExportSettings
from traceml_ai.transport import AggregatorServer, RankSender, Relay
from traceml_ai.transport.relay import _QUICK_CLOSE_S as QUICK_CLOSE_S
from traceml_ai.transport.wire import (
    FRAME_HEADER,
    RELAY_RANKS_END,
    ReceivedBatch,
    batch_prefix,
    encode_frame,
    make_batch_message,
    make_relay_message,
)

TOKEN = "relay-test-token"
WAIT_S = 10.0


def wait_until(condition: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


class Collector:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batches: list[ReceivedBatch] = []
        self.finished: list[dict[str, Any]] = []
        self.reports: list[dict[str, Any]] = []

    def on_batch(self, batch: ReceivedBatch) -> None:
        with self.lock:
            self.batches.append(batch)

    def on_finished(self, message: dict[str, Any]) -> None:
        with self.lock:
            self.finished.append(message)

    def on_relay(self, message: dict[str, Any]) -> None:
        with self.lock:
            self.reports.append(message)

    def serve(self, port: int = 0) -> AggregatorServer:
        server = AggregatorServer(
            "127.0.0.1", port, TOKEN, self.on_batch, self.on_finished, on_relay=self.on_relay
        )
        server.start()
        return server


def identity(rank: int) -> dict[str, object]:
    return {
        "global_rank": rank,
        "local_rank": rank % 4,
        "world_size": 8,
        "local_world_size": 4,
        "node_rank": rank // 4,
        "hostname": "node",
        "pid": 100 + rank,
    }


def sender(address: tuple[str, int], rank: int) -> RankSender:
    s = RankSender(address, TOKEN, identity(rank), flush_interval_s=0.02)
    s.start()
    return s


@pytest.fixture
def stack() -> Iterator[list[Any]]:
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        thing.stop()


def test_relays_forward_every_rank_as_sent(stack: list[Any]) -> None:
    collector = Collector()
    server = collector.serve()
    stack.append(server)
    assert server.address is not None
    relay = Relay(server.address, TOKEN)
    stack.append(relay)
    near = relay.start()
    # A chain: ranks 4..7 send to a relay that sends to the first one.
    outer = Relay(near, TOKEN)
    stack.append(outer)
    far = outer.start()
    senders = [sender(near if rank < 4 else far, rank) for rank in range(8)]
    for step in range(40):
        for rank, s in enumerate(senders):
            s.put("step_time", {"step": step, "rank": rank})
        time.sleep(0.002)
    for s in senders:
        s.close(WAIT_S)
    wait_until(lambda: len(collector.finished) == 8)
    outer_stats = outer.stop(WAIT_S)
    near_stats = relay.stop(WAIT_S)
    server.stop()
    sent = {rank: s.sent_batches for rank, s in enumerate(senders)}
    assert all(sent.values())
    assert server.received_batches_by_rank() == sent
    assert sum(s.dropped_batches for s in senders) == 0
    assert near_stats.dropped_batches == outer_stats.dropped_batches == 0
    # Forwarded as they are: our senders' encoded batches, still undecoded.
    prefix = batch_prefix(TOKEN)
    assert all(
        isinstance(b.payload, bytes) and b.payload.startswith(prefix) for b in collector.batches
    )
    # Each relay said who it is on its connection; both connections reached the server.
    assert {m["relay"] for m in collector.reports} == {relay.relay_id, outer.relay_id}
    assert all(m["dropped"] == {} for m in collector.reports)


def test_drops_are_counted_per_rank_and_reported_once_it_connects(stack: list[Any]) -> None:
    port = free_port()
    # Nobody listens upstream yet: frames wait, and beyond the bound they are dropped.
    relay = Relay(("127.0.0.1", port), TOKEN, max_pending_bytes=4096, report_interval_s=0.05)
    stack.append(relay)
    near = relay.start()
    senders = [sender(near, rank) for rank in range(3)]
    for step in range(60):
        for s in senders:
            s.put("step_time", {"step": step, "pad": "x" * 200})
        time.sleep(0.003)
    wait_until(
        lambda: relay.stats().dropped_batches > 0 and not any(s.pending_items for s in senders)
    )
    collector = Collector()
    server = collector.serve(port)
    stack.append(server)
    for s in senders:
        s.close(WAIT_S)
    wait_until(lambda: len(collector.finished) == 3)
    stats = relay.stop(WAIT_S)
    server.stop()
    assert stats.dropped_batches > 0
    # The relay's own count per rank: what each rank sent and never arrived.
    received = server.received_batches_by_rank()
    dropped = {rank: sum(c.values()) for rank, c in stats.dropped_by_rank.items()}
    for rank, s in enumerate(senders):
        assert received.get(rank, 0) + dropped.get(rank, 0) == s.sent_batches, rank
    # What the aggregator keeps of the reports: the largest count per rank and stream.
    # (Not the last report: one queued while the relay was cut off arrives after the
    # first message of the connection, which carries the counts as they are then.)
    told: dict[int, dict[str, int]] = {}
    for report in collector.reports:
        assert report["relay"] == relay.relay_id
        for rank, by_stream in report["dropped"].items():
            mine = told.setdefault(int(rank), {})
            for stream, count in by_stream.items():
                mine[stream] = max(mine.get(stream, 0), count)
    assert told == stats.dropped_by_rank
    assert all(set(c) == {"step_time"} for c in stats.dropped_by_rank.values())


def test_the_relay_reconnects_to_a_restarted_aggregator(stack: list[Any]) -> None:
    first = Collector()
    server = first.serve()
    assert server.address is not None
    port = server.address[1]
    relay = Relay(server.address, TOKEN)
    stack.append(relay)
    near = relay.start()
    s = sender(near, 0)
    s.put("step_time", {"step": 0})
    wait_until(lambda: len(first.batches) == 1)
    server.stop()
    wait_until(lambda: not relay.connected)
    second = Collector()
    again = second.serve(port)
    stack.append(again)
    s.put("step_time", {"step": 1})
    wait_until(lambda: len(second.batches) == 1)
    s.close(WAIT_S)
    wait_until(lambda: len(second.finished) == 1)
    stats = relay.stop(WAIT_S)
    assert stats.upstream_connections == 2
    assert stats.dropped_batches == 0
    assert second.reports and second.reports[0]["relay"] == relay.relay_id


def test_the_aggregator_closing_after_the_ranks_left_is_the_end_and_says_nothing(
    stack: list[Any],
) -> None:
    collector = Collector()
    server = collector.serve()
    assert server.address is not None
    events: list[str] = []
    relay = Relay(server.address, TOKEN, on_event=events.append)
    stack.append(relay)
    s = sender(relay.start(), 0)
    s.put("step_time", {"step": 0})
    s.close(WAIT_S)
    wait_until(lambda: len(collector.finished) == 1 and relay.intake.connections_open == 0)
    wait_until(lambda: relay.stats().pending_frames == 0)
    # What the aggregator does once every rank finished: it finalizes and closes.
    server.stop()
    wait_until(lambda: not relay.connected)
    time.sleep(0.3)  # a retry would be due after 0.1 s
    stats = relay.stop(WAIT_S)
    assert events == []
    assert stats.upstream_connections == 1
    assert stats.dropped_batches == stats.dropped_messages == 0


@pytest.mark.parametrize("connection", ["young", "old"])
def test_a_loss_while_nothing_waits_is_said_only_once_a_frame_waits(
    stack: list[Any], connection: str
) -> None:
    """The aggregator finalizing while a rank's connection here is still closing (its
    last frames forwarded) is no loss worth a line; a frame that then has to wait is.
    A connection closed as soon as it opened (young) may be a refusal: its loss is said
    once reconnecting fails."""
    collector = Collector()
    server = collector.serve()
    assert server.address is not None
    port = server.address[1]
    events: list[str] = []
    relay = Relay(server.address, TOKEN, on_event=events.append)
    stack.append(relay)
    s = sender(relay.start(), 0)
    s.put("step_time", {"step": 0})
    wait_until(lambda: len(collector.batches) == 1)
    wait_until(lambda: relay.stats().pending_frames == 0)
    if connection == "old":
        time.sleep(QUICK_CLOSE_S + 0.1)
    server.stop()
    wait_until(lambda: not relay.connected)
    time.sleep(0.3)  # a retry would be due after 0.1 s
    assert events == []
    s.put("step_time", {"step": 1})
    wait_until(lambda: len(events) == 1)
    assert events[0].startswith(f"lost its connection to the aggregator at 127.0.0.1:{port}")
    second = Collector()
    again = second.serve(port)
    stack.append(again)
    wait_until(lambda: len(second.batches) == 1)
    s.close(WAIT_S)
    wait_until(lambda: len(second.finished) == 1)
    assert events[1:] == [f"connection to the aggregator at 127.0.0.1:{port} is back"]


def test_garbage_at_the_relay_is_refused_and_the_ranks_go_on(stack: list[Any]) -> None:
    collector = Collector()
    server = collector.serve()
    stack.append(server)
    assert server.address is not None
    relay = Relay(server.address, TOKEN)
    stack.append(relay)
    near = relay.start()
    with socket.create_connection(near, timeout=WAIT_S) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(WAIT_S)
        assert sock.recv(1) == b""
    # A frame with our prefix but an unknown stream would close the relay's connection
    # upstream (every rank of the node) if it were forwarded: the relay refuses it.
    body = batch_prefix(TOKEN) + b'nope","identity":{"global_rank":1},"items":[]}'
    with socket.create_connection(near, timeout=WAIT_S) as sock:
        sock.sendall(FRAME_HEADER.pack(len(body)) + body)
        sock.settimeout(WAIT_S)
        assert sock.recv(1) == b""
    s = sender(near, 2)
    s.put("step_time", {"step": 0})
    s.close(WAIT_S)
    wait_until(lambda: len(collector.finished) == 1)
    assert len(collector.batches) == 1
    assert relay.intake.rejected_connections == 2
    assert server.rejected_connections == 0
    assert relay.stats().upstream_connections == 1


def _step_item(i: int) -> dict[str, Any]:
    timing = {"cpu_ms": 1.0, "duration_ms": 1.0, "gpu_ms": None, "is_gpu": False, "n_calls": 1}
    return {
        "timestamp_unix_ns": time.time_ns(),
        "seq": i,
        "step": i + 1,
        "events": {"_traceml_internal:step_time": {"cpu": timing}},
    }


def test_the_relays_drops_of_selected_streams_reach_the_warning(
    stack: list[Any], tmp_path: Path
) -> None:
    port = free_port()
    relay = Relay(("127.0.0.1", port), TOKEN, max_pending_bytes=6000, report_interval_s=0.05)
    stack.append(relay)
    near = relay.start()
    senders = [sender(near, rank) for rank in range(2)]
    for i in range(40):
        for s in senders:
            s.put("step_time", _step_item(i))
            # Not exported: its drops are no loss of the files.
            s.put("process", {"seq": i, "pad": "x" * 100})
        time.sleep(0.003)
    wait_until(lambda: not any(s.pending_items for s in senders))
    aggregator = Aggregator(
        AggregatorConfig(
            run_dir=tmp_path / "run",
            settings=ExportSettings("jsonl", "step_time", False),
            token=TOKEN,
            port=port,
            expected_world_size=2,
            finalize_timeout_sec=5.0,
        )
    )
    aggregator.start()
    for s in senders:
        s.close(WAIT_S)
    assert aggregator.wait_all_finished(WAIT_S)
    stats = relay.stop(WAIT_S)
    result = aggregator.finalize()
    dropped_steps = sum(c.get("step_time", 0) for c in stats.dropped_by_rank.values())
    dropped_other = sum(c.get("process", 0) for c in stats.dropped_by_rank.values())
    assert dropped_steps > 0 and dropped_other > 0
    assert result.loss is not None
    assert result.loss.dropped_batches == dropped_steps
    warning = orjson.loads((tmp_path / "run" / "finalization_warning.json").read_bytes())
    assert warning["export"]["dropped_batches"] == dropped_steps
    lines = (tmp_path / "run" / "aggregator" / "export" / "step_time.jsonl").read_bytes()
    assert warning["export"]["written_records"] == len(lines.splitlines()) - 1 > 0


def test_the_ranks_a_relay_is_there_for_are_behind_it_before_any_frame_passed(
    stack: list[Any], tmp_path: Path
) -> None:
    """A relay says it is there for ranks 0..2: rank 0 finishes through it, ranks 1 and 2
    never send a frame, and once its connection ended they are missing behind it. A
    second 'relay' claims every rank: rank 3, which sent a batch on a connection of its
    own and never finished, is still the rank's loss, and no claim makes a rank missing
    or finished."""
    aggregator = Aggregator(
        AggregatorConfig(
            run_dir=tmp_path / "run",
            settings=ExportSettings("jsonl", "step_time", False),
            token=TOKEN,
            expected_world_size=4,
            finalize_timeout_sec=5.0,
        )
    )
    address = aggregator.start()
    relay = Relay(address, TOKEN, ranks=range(0, 3))
    stack.append(relay)
    s = sender(relay.start(), 0)
    s.put("step_time", _step_item(0))
    s.close(WAIT_S)
    claims_all = make_relay_message(TOKEN, "claims-all", {}, range(0, RELAY_RANKS_END))
    own = make_batch_message(TOKEN, identity(3), "step_time", [_step_item(0)])
    for message in (claims_all, own):
        with socket.create_connection(address) as sock:
            sock.sendall(encode_frame(message))
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1)  # the aggregator read it all and closed
    wait_until(lambda: aggregator.finished_ranks == {0})
    relay.stop(WAIT_S)
    wait_until(lambda: aggregator.wait_connections_closed(0.0))
    result = aggregator.finalize()
    assert result.ranks.finished_ranks == (0,)
    assert result.ranks.missing_ranks == (1, 2, 3)
    assert result.ranks.relayed_missing_ranks == (1, 2)
    warning = orjson.loads((tmp_path / "run" / "finalization_warning.json").read_bytes())
    assert warning["reason"] == "ranks_disconnected"
    assert "(ranks 1, 2 send through a node's relay" in warning["message"], warning
