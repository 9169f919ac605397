"""Many relays on one shared event loop (``LoopRunner``): each forwards its ranks' frames
exactly as a relay on its own thread does, and stopping one leaves the others (and the
loop) running."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.traceml_ai.transport.test_relay import TOKEN, WAIT_S, Collector, sender, wait_until
from traceml_ai.transport import RankSender, Relay
from traceml_ai.transport.server import LoopRunner


@pytest.fixture
def runner() -> Iterator[LoopRunner]:
    shared = LoopRunner("test-relays")
    yield shared
    shared.stop()


def _loop_threads() -> int:
    """Threads running, less the loop's executor workers (its getaddrinfo calls)."""
    return sum(1 for t in threading.enumerate() if not t.name.startswith("asyncio_"))


def _send(senders: list[RankSender], steps: int) -> None:
    for step in range(steps):
        for rank, s in enumerate(senders):
            s.put("step_time", {"step": step, "rank": rank})
        time.sleep(0.002)


def test_several_relays_on_one_loop_forward_every_rank_exactly(runner: LoopRunner) -> None:
    collector = Collector()
    server = collector.serve()
    assert server.address is not None
    threads_before = _loop_threads()
    relays = [Relay(server.address, TOKEN, loop_runner=runner) for _ in range(4)]
    addresses = [relay.start() for relay in relays]
    # One loop thread for all four relays (a relay of its own would start one each).
    assert _loop_threads() == threads_before + 1
    assert {relay.intake._thread for relay in relays} == {runner.thread}
    senders = [sender(addresses[rank % 4], rank) for rank in range(8)]
    try:
        _send(senders, 30)
        for s in senders:
            s.close(WAIT_S)
        wait_until(lambda: len(collector.finished) == 8)
        stats = [relay.stop(WAIT_S) for relay in relays]
    finally:
        for relay in relays:
            relay.stop(WAIT_S)
        server.stop()
    sent = {rank: s.sent_batches for rank, s in enumerate(senders)}
    assert all(sent.values()) and sum(s.dropped_batches for s in senders) == 0
    assert server.received_batches_by_rank() == sent
    assert all(st.dropped_batches == 0 and st.pending_frames == 0 for st in stats)
    # Each relay forwarded its own ranks' frames (and its relay messages), no one else's.
    assert sum(st.forwarded_frames for st in stats) >= sum(sent.values()) + 8
    assert {m["relay"] for m in collector.reports} == {relay.relay_id for relay in relays}
    # The relays are stopped, the shared loop is not: it is the runner's to stop.
    assert runner.thread is not None and runner.thread.is_alive()


def test_stopping_one_relay_leaves_the_others_on_the_loop_forwarding(
    runner: LoopRunner,
) -> None:
    collector = Collector()
    server = collector.serve()
    assert server.address is not None
    first, second = (Relay(server.address, TOKEN, loop_runner=runner) for _ in range(2))
    near_first, near_second = first.start(), second.start()
    gone = sender(near_first, 0)
    stays = sender(near_second, 1)
    try:
        _send([gone, stays], 10)
        gone.close(WAIT_S)
        wait_until(lambda: len(collector.finished) == 1)
        first_stats = first.stop(WAIT_S)
        assert first.address is not None
        # The stopped relay's port is closed; the loop and the other relay go on.
        with pytest.raises(OSError):
            socket.create_connection(near_first, timeout=1).close()
        assert runner.thread is not None and runner.thread.is_alive()
        _send([stays], 20)
        stays.close(WAIT_S)
        wait_until(lambda: len(collector.finished) == 2)
        second_stats = second.stop(WAIT_S)
    finally:
        first.stop(WAIT_S)
        second.stop(WAIT_S)
        server.stop()
    assert server.received_batches_by_rank() == {0: gone.sent_batches, 1: stays.sent_batches}
    assert first_stats.dropped_batches == second_stats.dropped_batches == 0
    assert not first.connected and not second.connected
    assert gone.dropped_batches == stays.dropped_batches == 0


def test_the_runner_stops_its_loop_and_a_relay_on_it_still_stops_cleanly() -> None:
    runner = LoopRunner("test-relays")
    collector = Collector()
    server = collector.serve()
    assert server.address is not None
    relay = Relay(server.address, TOKEN, loop_runner=runner)
    relay.start()
    wait_until(lambda: relay.connected)
    runner.stop()
    assert runner.thread is not None and not runner.thread.is_alive()
    stats = relay.stop(1.0)  # its loop is gone: nothing to forward, nothing raised
    server.stop()
    assert stats.dropped_batches == 0
    with pytest.raises(RuntimeError):
        runner.start()
