"""A relay given a wrong upstream address, over real loopback sockets.

Leading back to itself (its own port, or a chain that closes on itself): it says so in
one line, stops connecting, and counts what it holds as dropped at its stop, instead of
sending its frames round forever. Where nobody listens: one line once ranks send, one
when the aggregator comes up, and what waited is forwarded."""

from __future__ import annotations

import time
from collections.abc import Callable

from tests.e2e_helpers import free_port
from tests.traceml_ai.transport.test_relay import TOKEN, Collector
from traceml_ai.transport import RankSender, Relay

WAIT_S = 10.0


def wait_until(condition: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def identity(rank: int) -> dict[str, object]:
    return {
        "global_rank": rank,
        "local_rank": rank,
        "world_size": 2,
        "local_world_size": 2,
        "node_rank": 0,
        "hostname": "node",
        "pid": 100 + rank,
    }


def test_a_relay_forwarding_to_its_own_port_says_so_once_and_forwards_nothing() -> None:
    port = free_port()
    lines: list[str] = []
    relay = Relay(("127.0.0.1", port), TOKEN, port=port, on_event=lines.append)
    relay.start()
    try:
        wait_until(lambda: relay.loop_found)
        sender = RankSender(("127.0.0.1", port), TOKEN, identity(0), flush_interval_s=0.02)
        sender.start()
        for step in range(5):
            sender.put("step_time", {"step": step, "rank": 0})
        sender.close(2.0)
        # Given the time to go round, a loop would forward frames without end.
        time.sleep(0.5)
        forwarded = relay.stats().forwarded_frames
    finally:
        stats = relay.stop(1.0)
    assert relay.loop_found
    assert forwarded <= 1, forwarded  # its first relay message, nothing more
    assert stats.upstream_connections == 1
    assert len(lines) == 1, lines
    assert f"127.0.0.1:{port}" in lines[0] and "leads back to this relay" in lines[0]


def test_two_relays_forwarding_to_each_other_find_the_loop() -> None:
    port_a, port_b = free_port(), free_port()
    lines: list[str] = []
    a = Relay(("127.0.0.1", port_b), TOKEN, port=port_a, on_event=lines.append)
    b = Relay(("127.0.0.1", port_a), TOKEN, port=port_b, on_event=lines.append)
    a.start()
    b.start()
    try:
        wait_until(lambda: a.loop_found or b.loop_found)
        time.sleep(0.5)
        forwarded = a.stats().forwarded_frames + b.stats().forwarded_frames
    finally:
        a.stop(1.0)
        b.stop(1.0)
    assert forwarded < 10, forwarded
    assert any("leads back to this relay" in line for line in lines), lines


def test_an_unreachable_aggregator_is_said_once_and_what_waited_is_forwarded() -> None:
    upstream = free_port()
    lines: list[str] = []
    relay = Relay(("127.0.0.1", upstream), TOKEN, on_event=lines.append)
    address = relay.start()
    collector = Collector()
    server = None
    try:
        sender = RankSender(address, TOKEN, identity(0), flush_interval_s=0.02)
        sender.start()
        for step in range(5):
            sender.put("step_time", {"step": step, "rank": 0})
        wait_until(lambda: any("cannot reach" in line for line in lines))
        # Several retries go by, and it is still said once.
        time.sleep(0.5)
        server = collector.serve(upstream)
        sender.close(WAIT_S)
        wait_until(lambda: len(collector.finished) == 1)
    finally:
        stats = relay.stop(2.0)
        if server is not None:
            server.stop()
    unreachable = [line for line in lines if "cannot reach" in line]
    assert len(unreachable) == 1, lines
    assert f"127.0.0.1:{upstream}" in unreachable[0] and "Connection refused" in unreachable[0]
    assert any(line.endswith("is back") for line in lines), lines
    assert stats.dropped_batches == 0
    assert len(collector.batches) == sender.sent_batches >= 1


def test_an_aggregator_refusing_the_relays_token_is_said_once_not_at_each_try() -> None:
    collector = Collector()
    server = collector.serve()
    upstream = server.address
    assert upstream is not None
    lines: list[str] = []
    relay = Relay(upstream, "not-the-aggregators-token", on_event=lines.append)
    address = relay.start()
    try:
        sender = RankSender(
            address, "not-the-aggregators-token", identity(0), flush_interval_s=0.02
        )
        sender.start()
        for step in range(5):
            sender.put("step_time", {"step": step, "rank": 0})
        wait_until(lambda: any("closed as soon as they open" in line for line in lines))
        # Further refusals go by without a line each.
        time.sleep(1.5)
        sender.close(1.0)
    finally:
        stats = relay.stop(0.5)
        server.stop()
    # What went out on the refused connections is not called forwarded.
    assert stats.refused_frames >= 1
    assert stats.forwarded_frames < stats.refused_frames
    told = [line for line in lines if "closed as soon as they open" in line]
    assert len(told) == 1, lines
    assert "TRACEML_RUN_TOKEN" in told[0]
    assert len(told) == len(lines), lines  # the one line, no lost-and-back pair before it
    assert collector.batches == []
