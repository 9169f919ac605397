"""Transport tests: wire framing, RankSender and AggregatorServer over real loopback sockets."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.e2e_helpers import free_port
from traceml_ai.transport import AggregatorServer, RankSender
from traceml_ai.transport.wire import (
    BATCH_STREAMS,
    DEFAULT_MAX_FRAME_BYTES,
    FRAME_HEADER,
    MESSAGES,
    RELAY_RANKS_END,
    TRACKER_RUNS_BOUNDS,
    WIRE_VERSION,
    FrameError,
    ReceivedBatch,
    batch_envelope,
    batch_prefix,
    decode_batch_body,
    decode_message,
    encode_batch_frame,
    encode_frame,
    encode_item,
    make_batch_message,
    make_finished_message,
    make_relay_message,
    make_tracker_runs_message,
    new_run_token,
    relay_ranks,
)

# Every test runs with the sender's socket calls in C and in Python (conftest).
pytestmark = pytest.mark.usefixtures("socket_calls")

TOKEN = "test-token"
WAIT_S = 15.0


def identity(rank: int = 0, **extra: object) -> dict[str, object]:
    base: dict[str, object] = {
        "global_rank": rank,
        "local_rank": rank,
        "world_size": 4,
        "local_world_size": 4,
        "node_rank": 0,
        "hostname": None,
        "pid": os.getpid(),
    }
    base.update(extra)
    return base


class Collector:
    """Thread-safe record of everything the server hands to its callbacks."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.batches: list[ReceivedBatch] = []
        self.finished: list[dict[str, Any]] = []
        self.lost: list[dict[str, Any] | None] = []

    def on_batch(self, batch: ReceivedBatch) -> None:
        # The server queues our senders' batches still encoded; decode for inspection.
        assert type(batch.payload) is bytes
        assert batch.nbytes == len(batch.payload)
        batch = attrs.evolve(batch, payload=decode_batch_body(batch.payload))
        with self.cond:
            self.batches.append(batch)
            self.cond.notify_all()

    def on_finished(self, message: dict[str, Any]) -> None:
        with self.cond:
            self.finished.append(message)
            self.cond.notify_all()

    def on_lost(self, last_identity: dict[str, Any] | None) -> None:
        with self.cond:
            self.lost.append(last_identity)
            self.cond.notify_all()

    def wait(self, predicate: Callable[[Collector], bool], timeout: float = WAIT_S) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self), timeout), "event never came"

    def items(self, rank: int | None = None) -> list[dict[str, Any]]:
        with self.cond:
            return [
                item
                for batch in self.batches
                if rank is None or batch.payload["identity"]["global_rank"] == rank
                for item in batch.payload["items"]
            ]

    def item_count(self) -> int:
        return len(self.items())


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition never became true"
        time.sleep(0.01)


@pytest.fixture
def collector() -> Collector:
    return Collector()


@pytest.fixture
def server_factory() -> Iterator[Callable[..., AggregatorServer]]:
    servers: list[AggregatorServer] = []

    def make(collector: Collector, port: int = 0, **kwargs: Any) -> AggregatorServer:
        server = AggregatorServer(
            "127.0.0.1",
            port,
            TOKEN,
            collector.on_batch,
            collector.on_finished,
            on_connection_lost=collector.on_lost,
            **kwargs,
        )
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def senders() -> Iterator[list[RankSender]]:
    made: list[RankSender] = []
    yield made
    for sender in made:
        sender.close(timeout=0.5)


def raw_frame(body: bytes) -> bytes:
    return FRAME_HEADER.pack(len(body)) + body


def valid_batch(stream: str = "step_time", n: int = 1, rank: int = 0) -> dict[str, Any]:
    return make_batch_message(TOKEN, identity(rank), stream, [{"seq": i} for i in range(n)])


# ---- wire ------------------------------------------------------------------------------


def test_encode_decode_round_trip() -> None:
    message = valid_batch(n=3)
    frame = encode_frame(message)
    (length,) = FRAME_HEADER.unpack(frame[:4])
    assert length == len(frame) - 4
    assert decode_message(frame[4:], TOKEN) == message
    finished = make_finished_message(TOKEN, identity(), 5, 2)
    assert finished["type"] == "finished" and finished["v"] == WIRE_VERSION
    assert decode_message(encode_frame(finished)[4:], TOKEN) == finished
    assert DEFAULT_MAX_FRAME_BYTES == 8 * 1024 * 1024


_JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text()
_JSON_ITEMS = st.dictionaries(
    st.text(),
    st.recursive(
        _JSON_SCALARS | st.floats(allow_nan=False, allow_infinity=False),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
        max_leaves=8,
    ),
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(
    token=st.text(min_size=1),
    stream=st.sampled_from(BATCH_STREAMS),
    rank=st.integers(0, 10_000),
    items=st.lists(_JSON_ITEMS, max_size=6),
)
def test_a_frame_of_encoded_items_is_the_frame_of_the_message(
    token: str, stream: str, rank: int, items: list[dict[str, Any]]
) -> None:
    """The sender joins items it encoded at ``put`` into frames: byte for byte what
    encoding the whole message writes, so the server's prefix check still holds."""
    frame = encode_batch_frame(
        batch_envelope(token, identity(rank), stream), [encode_item(i) for i in items]
    )
    assert frame == encode_frame(make_batch_message(token, identity(rank), stream, items))
    assert frame[4:].startswith(batch_prefix(token) + stream.encode() + b'"')


def test_new_run_token_is_random_and_ascii() -> None:
    tokens = {new_run_token() for _ in range(50)}
    assert len(tokens) == 50
    assert all(len(t) >= 40 and t.isascii() for t in tokens)


def _envelope(**overrides: object) -> bytes:
    message: dict[str, object] = dict(valid_batch())
    for key, value in overrides.items():
        if value is _DELETE:
            message.pop(key)
        else:
            message[key] = value
    return orjson.dumps(message)


_DELETE = object()


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "bad json"),
        (b"", "bad json"),
        (b"\xff\xfe", "bad json"),
        (b"[1, 2]", "not an object"),
        (b'"text"', "not an object"),
        (_envelope(token="other"), "wrong token"),
        (_envelope(token=_DELETE), "wrong token"),
        (_envelope(token=12), "wrong token"),
        (_envelope(token="tëst-token"), "wrong token"),
        (_envelope(v=2), "bad version"),
        (_envelope(v=True), "bad version"),
        (_envelope(v=_DELETE), "bad version"),
        (_envelope(type="hello"), "unknown type"),
        (_envelope(type=["batch"]), "unknown type"),
        (_envelope(identity=_DELETE), "missing identity"),
        (_envelope(identity=[1]), "missing identity"),
        (_envelope(stream="system_gpu"), "stream not in BATCH_STREAMS"),
        (_envelope(stream=["step_time"]), "stream not in BATCH_STREAMS"),
        (_envelope(items={"a": 1}), "items not a list"),
        (_envelope(items=_DELETE), "items not a list"),
        (
            orjson.dumps({**make_finished_message(TOKEN, identity(), 1, 0), "sent_batches": -1}),
            "bad counts",
        ),
        (
            orjson.dumps(
                {**make_finished_message(TOKEN, identity(), 1, 0), "dropped_batches": True}
            ),
            "bad counts",
        ),
    ],
)
def test_decode_rejects_bad_envelopes(body: bytes, reason: str) -> None:
    with pytest.raises(FrameError) as info:
        decode_message(body, TOKEN)
    assert info.value.reason == reason


def test_decode_leaves_items_alone() -> None:
    # Item validation belongs to the export engine; odd items pass the envelope check.
    message = decode_message(_envelope(items=[1, None, "x", {"seq": "nope"}]), TOKEN)
    assert message["items"] == [1, None, "x", {"seq": "nope"}]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_decode_arbitrary_bytes_only_raises_frame_error(data: bytes) -> None:
    try:
        message = decode_message(data, TOKEN)
    except FrameError as exc:
        assert exc.reason
    else:
        assert message["token"] == TOKEN


# ---- sender and server together --------------------------------------------------------


def test_many_senders_round_trip_exact(
    collector: Collector,
    server_factory: Callable[..., AggregatorServer],
    senders: list[RankSender],
) -> None:
    server = server_factory(collector)
    address = server.address
    assert address is not None and address[0] == "127.0.0.1"
    n_ranks, per_stream = 4, 3_000
    streams = ("step_time", "step_memory")

    def rank_main(rank: int) -> None:
        sender = RankSender(
            address,
            TOKEN,
            identity(rank),
            flush_interval_s=0.02,
            max_items_per_batch=97,
            max_pending_items=10 * per_stream,
        )
        senders.append(sender)
        sender.start()
        for seq in range(per_stream):
            for stream in streams:
                sender.put(stream, {"seq": seq, "rank": rank})
            if seq % 500 == 0:
                time.sleep(0.001)
        sender.close(timeout=10)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    collector.wait(lambda c: len(c.finished) == n_ranks)

    for sender in senders:
        assert sender.sent_items == per_stream * len(streams)
        assert sender.dropped_items == 0 and sender.dropped_batches == 0
        assert sender.pending_items == 0 and not sender.connected
    for rank in range(n_ranks):
        items = collector.items(rank)
        assert len(items) == per_stream * len(streams)
        assert {item["rank"] for item in items} == {rank}
    for stream in streams:
        for rank in range(n_ranks):
            seqs = [
                item["seq"]
                for b in collector.batches
                if b.payload["stream"] == stream and b.payload["identity"]["global_rank"] == rank
                for item in b.payload["items"]
            ]
            assert seqs == list(range(per_stream))  # in order, no duplicates
    assert all(len(b.payload["items"]) <= 97 for b in collector.batches)
    assert server.accepted_batches == len(collector.batches) == sum(s.sent_batches for s in senders)
    assert server.rejected_frames == 0 and server.callback_errors == 0
    batch = collector.batches[0]
    assert batch.nbytes == len(orjson.dumps(batch.payload))
    assert abs(batch.observed_timestamp_unix_ns - time.time_ns()) < 600 * 10**9
    wait_until(lambda: server.connections_open == 0)
    assert server.connections_total == n_ranks


def test_finished_carries_counts_and_connection_lost_identity(
    collector: Collector, server_factory: Callable[..., AggregatorServer]
) -> None:
    server = server_factory(collector)
    sender = RankSender(
        server.start(), TOKEN, identity(3), flush_interval_s=0.02, max_items_per_batch=10
    )
    # Put before start so the batch split (10+10+10+5) does not depend on timing.
    for seq in range(35):
        sender.put("process", {"seq": seq})
    sender.put("no_such_stream", {"seq": 0})  # dropped and counted at put
    sender.start()
    sender.close()
    sender.close()  # idempotent
    collector.wait(lambda c: len(c.finished) == 1 and len(c.lost) == 1)
    finished = collector.finished[0]
    assert finished["identity"]["global_rank"] == 3
    assert finished["sent_batches"] == sender.sent_batches == 4
    assert finished["dropped_batches"] == sender.dropped_batches == 1
    assert sender.sent_items == 35 and sender.dropped_items == 1
    assert collector.lost == [finished["identity"]]
    assert server.finished_messages == 1


def test_bad_frame_counted_and_closes_only_its_connection(
    collector: Collector, server_factory: Callable[..., AggregatorServer]
) -> None:
    # Each invalid frame closes its connection (it used to be counted and the
    # connection went on); a healthy connection beside it is untouched.
    server = server_factory(collector)
    address = server.start()
    bad = [
        raw_frame(orjson.dumps({**valid_batch(), "token": "wrong"})),
        raw_frame(b"{malformed"),
        raw_frame(b"[1,2,3]"),
        raw_frame(orjson.dumps({**valid_batch(), "type": "hello"})),
        raw_frame(orjson.dumps({**valid_batch(), "stream": "bogus"})),
    ]
    with socket.create_connection(address) as healthy:
        healthy.sendall(encode_frame(valid_batch(n=1)))
        collector.wait(lambda c: len(c.batches) == 1)
        for frame in bad:
            with socket.create_connection(address) as sock:
                sock.sendall(frame + encode_frame(valid_batch(n=2)))
                sock.settimeout(WAIT_S)
                with contextlib.suppress(ConnectionResetError):
                    assert sock.recv(1) == b""
        healthy.sendall(encode_frame(valid_batch(n=2)))
        collector.wait(lambda c: len(c.batches) == 2)
    assert server.rejected_by_reason == {
        "wrong token": 1,
        "bad prefix": 3,
        "stream not in BATCH_STREAMS": 1,
    }
    assert server.rejected_frames == 5
    assert server.rejected_connections_by_reason == server.rejected_by_reason
    assert server.accepted_batches == 2
    assert collector.item_count() == 3
    # Batches stay encoded in the server, so the connections' identities are unknown.
    collector.wait(lambda c: c.lost == [None] * 6)


def test_oversized_frame_closes_only_that_connection(
    collector: Collector, server_factory: Callable[..., AggregatorServer]
) -> None:
    server = server_factory(collector, max_frame_bytes=1_000)
    address = server.start()
    with socket.create_connection(address) as healthy, socket.create_connection(address) as bad:
        healthy.sendall(encode_frame(valid_batch(n=1)))
        collector.wait(lambda c: len(c.batches) == 1)
        bad.sendall(FRAME_HEADER.pack(1_001) + b"x" * 1_001)
        bad.settimeout(WAIT_S)
        # The server closed it: EOF, or a reset because the body was left unread.
        with contextlib.suppress(ConnectionResetError):
            assert bad.recv(1) == b""
        healthy.sendall(encode_frame(valid_batch(n=4)))
        collector.wait(lambda c: len(c.batches) == 2)
    assert server.rejected_by_reason == {"oversized frame": 1}
    assert collector.item_count() == 5
    # A frame exactly at the limit is fine.
    body = orjson.dumps(valid_batch(n=1))
    padded = body[:-1] + b" " * (1_000 - len(body)) + b"}"
    assert len(padded) == 1_000
    with socket.create_connection(address) as sock:
        sock.sendall(raw_frame(padded))
        collector.wait(lambda c: len(c.batches) == 3)


def test_random_garbage_never_reaches_callbacks(
    collector: Collector, server_factory: Callable[..., AggregatorServer]
) -> None:
    server = server_factory(collector, max_frame_bytes=64 * 1024)
    address = server.start()
    rng = random.Random(1234)
    for _ in range(30):
        with socket.create_connection(address) as sock:
            garbage = rng.randbytes(rng.randrange(1, 4_000))
            if rng.random() < 0.5:
                # Small plausible length so the body reaches the JSON decoder.
                garbage = FRAME_HEADER.pack(len(garbage)) + garbage
            sock.sendall(garbage)
    wait_until(lambda: server.connections_total == 30 and server.connections_open == 0)
    assert server.rejected_frames >= 15
    assert server.accepted_batches == 0 and collector.batches == []
    assert collector.lost == [None] * 30
    with socket.create_connection(address) as sock:
        sock.sendall(encode_frame(valid_batch(n=3)))
        collector.wait(lambda c: c.item_count() == 3)


def test_raising_callbacks_are_counted(server_factory: Callable[..., AggregatorServer]) -> None:
    delivered: list[ReceivedBatch] = []

    def flaky_batch(batch: ReceivedBatch) -> None:
        batch = attrs.evolve(batch, payload=decode_batch_body(bytes(batch.payload)))
        if batch.payload["items"][0]["seq"] == 0:
            raise RuntimeError("boom")
        delivered.append(batch)

    def bad_finished(message: dict[str, Any]) -> None:
        raise KeyError("nope")

    server = AggregatorServer("127.0.0.1", 0, TOKEN, flaky_batch, bad_finished)
    try:
        address = server.start()
        with socket.create_connection(address) as sock:
            for seq in range(3):
                sock.sendall(
                    encode_frame(make_batch_message(TOKEN, identity(), "system", [{"seq": seq}]))
                )
            sock.sendall(encode_frame(make_finished_message(TOKEN, identity(), 3, 0)))
            wait_until(lambda: server.finished_messages == 1)
        assert server.callback_errors == 2
        assert server.accepted_batches == 3
        assert [b.payload["items"][0]["seq"] for b in delivered] == [1, 2]
    finally:
        server.stop()
        server.stop()


def test_sender_started_before_server_connects_later(
    collector: Collector, server_factory: Callable[..., AggregatorServer]
) -> None:
    port = free_port()
    sender = RankSender(
        ("127.0.0.1", port), TOKEN, identity(), flush_interval_s=0.02, connect_timeout_s=0.5
    )
    sender.start()
    try:
        for seq in range(100):
            sender.put("step_time", {"seq": seq})
        time.sleep(0.3)  # several failed connection attempts
        assert not sender.connected and sender.sent_items == 0
        assert sender.pending_items == 100  # kept while disconnected
        server = server_factory(collector, port=port)
        for seq in range(100, 200):
            sender.put("step_time", {"seq": seq})
        collector.wait(lambda c: c.item_count() == 200)
        assert sender.connected
    finally:
        sender.close()
    collector.wait(lambda c: len(c.finished) == 1)
    assert [item["seq"] for item in collector.items()] == list(range(200))
    assert sender.sent_items == 200 and sender.dropped_items == 0
    assert server.accepted_batches == sender.sent_batches


def test_server_restart_on_same_port(server_factory: Callable[..., AggregatorServer]) -> None:
    first, second = Collector(), Collector()
    server = server_factory(first)
    address = server.start()
    sender = RankSender(address, TOKEN, identity(), flush_interval_s=0.02, max_pending_items=50)
    sender.start()
    put = 0
    try:
        for _ in range(40):
            sender.put("step_time", {"seq": put})
            put += 1
        first.wait(lambda c: c.item_count() == 40)
        server.stop()
        first.wait(lambda c: len(c.lost) == 1)
        wait_until(lambda: not sender.connected)
        # While the aggregator is gone, 50 stay pending and the rest are dropped.
        for _ in range(200):
            sender.put("step_time", {"seq": put})
            put += 1
        assert sender.dropped_items == 150
        restarted = server_factory(second, port=address[1])
        assert restarted.address == address
        second.wait(lambda c: c.item_count() == 50)  # what was kept pending arrives
        for _ in range(30):
            sender.put("step_time", {"seq": put})
            put += 1
        second.wait(lambda c: c.item_count() == 80)
    finally:
        sender.close(timeout=5)
    second.wait(lambda c: len(c.finished) == 1)
    received = first.items() + second.items()
    seqs = [item["seq"] for item in received]
    assert seqs == list(range(40)) + list(range(40, 90)) + list(range(240, 270))
    assert sender.sent_items == len(received)
    assert sender.sent_items + sender.dropped_items == put
    finished = second.finished[0]
    assert finished["sent_batches"] == sender.sent_batches
    assert finished["dropped_batches"] == sender.dropped_batches >= 1


def test_stalled_server_never_blocks_put_or_close() -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_never_read() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    acceptor = threading.Thread(target=accept_and_never_read, daemon=True)
    acceptor.start()
    sender = RankSender(
        listener.getsockname(), TOKEN, identity(), flush_interval_s=0.01, send_timeout_s=0.5
    )
    sender.start()
    pad = "x" * 1_000
    n = 50_000
    try:
        begin = time.monotonic()
        for seq in range(n):
            sender.put("step_time", {"seq": seq, "pad": pad})
        put_elapsed = time.monotonic() - begin
        wait_until(lambda: held != [])
        time.sleep(0.2)
        begin = time.monotonic()
        sender.close(timeout=1)
        close_elapsed = time.monotonic() - begin
    finally:
        stop.set()
        acceptor.join()
        for sock in held:
            sock.close()
        listener.close()
    assert put_elapsed < 5.0, put_elapsed
    assert close_elapsed < 2.0, close_elapsed
    assert sender.dropped_items > 0  # the stall was real
    assert sender.sent_items + sender.dropped_items == n


def test_close_with_no_aggregator_is_bounded() -> None:
    sender = RankSender(("127.0.0.1", free_port()), TOKEN, identity(), flush_interval_s=0.02)
    sender.start()
    for seq in range(10):
        sender.put("system", {"seq": seq})
    begin = time.monotonic()
    sender.close(timeout=0.5)
    assert time.monotonic() - begin < 1.5
    assert sender.sent_items == 0 and sender.dropped_items == 10
    assert sender.dropped_batches == 1
    sender.put("system", {"seq": 99})  # no-op after close
    assert sender.dropped_items == 10 and sender.pending_items == 0


def test_put_overflow_drops_newest_and_counts() -> None:
    sender = RankSender(
        ("127.0.0.1", 9), TOKEN, identity(), max_pending_items=10, max_items_per_batch=4
    )
    for seq in range(25):
        sender.put("step_memory", {"seq": seq})
    assert sender.pending_items == 10 and sender.dropped_items == 15
    sender.close()  # never started: everything pending is lost
    assert sender.dropped_items == 25
    assert sender.dropped_batches == 3 + 4  # ceil(10/4) pending + ceil(15/4) refused
    sender.start()  # no-op after close
    assert not sender.connected


def test_encoded_items_are_sent_and_refused_as_put_items_are(
    collector: Collector, server_factory: Callable[..., AggregatorServer]
) -> None:
    """``put_encoded`` (an item its producer encoded): same queue, same bound, same
    drop counts, and the items arrive as if ``put``."""
    server = server_factory(collector)
    sender = RankSender(server.start(), TOKEN, identity(), max_pending_items=6)
    for seq in range(4):
        sender.put("step_time", {"seq": seq})
        sender.put_encoded("step_time", encode_item({"seq": seq, "encoded": True}))
    sender.put_encoded("no_such_stream", b"{}")
    assert sender.pending_items == 6
    assert sender.dropped_items_by_stream == {"step_time": 2, "": 1}
    sender.start()
    sender.close()
    collector.wait(lambda c: len(c.finished) == 1)
    assert [(item["seq"], "encoded" in item) for item in collector.items()] == [
        (0, False), (0, True), (1, False), (1, True), (2, False), (2, True)
    ]  # fmt: skip
    sender.put_encoded("step_time", b"{}")  # a no-op after close
    assert sender.pending_items == 0 and sender.dropped_items == 3


def test_encoded_items_put_many_at_once_are_queued_and_refused_as_one_by_one(
    collector: Collector, server_factory: Callable[..., AggregatorServer]
) -> None:
    """``put_encoded_many``: the items in order, as many as the bound leaves room for,
    the rest refused and counted per item as ``put_encoded`` counts them; an unknown
    stream refuses them all; nothing after close."""
    server = server_factory(collector)
    sender = RankSender(server.start(), TOKEN, identity(), max_pending_items=5)
    sender.put_encoded("step_time", encode_item({"seq": 0}))
    sender.put_encoded_many("step_time", [encode_item({"seq": s}) for s in range(1, 4)])
    sender.put_encoded_many("step_time", [encode_item({"seq": s}) for s in range(4, 8)])
    sender.put_encoded_many("step_time", [])
    sender.put_encoded_many("no_such_stream", [b"{}", b"{}"])
    assert sender.pending_items == 5
    assert sender.dropped_items_by_stream == {"step_time": 3, "": 2}
    sender.start()
    sender.close()
    collector.wait(lambda c: len(c.finished) == 1)
    assert [item["seq"] for item in collector.items()] == [0, 1, 2, 3, 4]
    assert collector.finished[0]["dropped_batches"] == sender.dropped_batches == 2
    sender.put_encoded_many("step_time", [b"{}"])  # a no-op after close
    assert sender.pending_items == 0 and sender.dropped_items == 5


def test_encoded_items_put_many_at_once_wake_the_sender_at_a_batch() -> None:
    """Crossing the wake mark (a batch's worth pending) in one call wakes the thread."""
    sender = RankSender(("127.0.0.1", 9), TOKEN, identity(), max_items_per_batch=4)
    sender.put_encoded_many("step_time", [b"{}"] * 3)
    assert not sender._wake.is_set()
    sender.put_encoded_many("step_time", [b"{}"] * 2)
    assert sender._wake.is_set()
    sender.close()


def test_unencodable_and_oversized_items_cost_only_themselves(
    collector: Collector, server_factory: Callable[..., AggregatorServer]
) -> None:
    server = server_factory(collector)
    sender = RankSender(
        server.start(), TOKEN, identity(), flush_interval_s=0.02, max_frame_bytes=4_000
    )
    for seq in range(20):
        sender.put("step_time", {"seq": seq})
    sender.put("step_time", {"seq": 20, "bad": object()})
    sender.put("step_time", {"seq": 21, "big": "y" * 5_000})
    for seq in range(22, 30):
        sender.put("step_time", {"seq": seq})
    sender.start()
    sender.close()
    collector.wait(lambda c: len(c.finished) == 1)
    assert [item["seq"] for item in collector.items()] == [*range(20), *range(22, 30)]
    assert sender.dropped_items == 2 and sender.sent_items == 28
    assert all(b.nbytes <= 4_000 for b in collector.batches)


def test_forked_child_never_sends(
    collector: Collector, server_factory: Callable[..., AggregatorServer]
) -> None:
    server = server_factory(collector)
    sender = RankSender(server.start(), TOKEN, identity(), flush_interval_s=0.02)
    sender.start()
    sender.put("step_time", {"seq": 0, "from": "parent"})
    collector.wait(lambda c: c.item_count() == 1)
    # Pending in the parent at fork time: the child must not send these.
    for seq in range(1, 50):
        sender.put("step_time", {"seq": seq, "from": "parent"})
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if sender.pending_items != 0:
                code = 2
            for seq in range(1_000):
                sender.put("step_time", {"seq": seq, "from": "child"})
            if sender.pending_items != 0 or sender.connected:
                code = 3
            sender.start()
            sender.close(timeout=0.2)
            time.sleep(0.1)
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert sender.connected  # the child's exit left the parent's connection alone
    for seq in range(50, 80):
        sender.put("step_time", {"seq": seq, "from": "parent"})
    sender.close()
    collector.wait(lambda c: len(c.finished) == 1)
    items = collector.items()
    assert [item["seq"] for item in items] == list(range(80))
    assert {item["from"] for item in items} == {"parent"}
    assert server.connections_total == 1
    assert sender.dropped_items == 0


_KILLED_RANK = """
import sys, time
from traceml_ai.transport import RankSender
sender = RankSender(("127.0.0.1", int(sys.argv[1])), sys.argv[2],
                    {"global_rank": 7, "pid": 0}, flush_interval_s=0.02)
sender.start()
for seq in range(25):
    sender.put("process", {"seq": seq})
while sender.sent_items < 25:
    time.sleep(0.01)
print("sent", flush=True)
time.sleep(60)
"""


def test_killed_rank_reports_connection_lost(
    collector: Collector, server_factory: Callable[..., AggregatorServer]
) -> None:
    server = server_factory(collector)
    _, port = server.start()
    with subprocess.Popen(
        [sys.executable, "-c", _KILLED_RANK, str(port), TOKEN],
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "sent"
            collector.wait(lambda c: c.item_count() == 25)
            assert collector.lost == []
            proc.kill()
            collector.wait(lambda c: len(c.lost) == 1)
        finally:
            proc.kill()
    assert collector.lost[0] is None  # its batches stayed encoded: identity unknown
    assert collector.finished == []
    assert server.connections_open == 0


def test_server_lifecycle() -> None:
    server = AggregatorServer("127.0.0.1", 0, TOKEN, lambda b: None, lambda m: None)
    server.stop()  # before start: nothing to do
    with pytest.raises(RuntimeError):
        server.start()
    busy = AggregatorServer("127.0.0.1", 0, TOKEN, lambda b: None, lambda m: None)
    address = busy.start()
    assert busy.start() == address
    clash = AggregatorServer("127.0.0.1", address[1], TOKEN, lambda b: None, lambda m: None)
    with pytest.raises(OSError):
        clash.start()
    busy.stop()
    busy.stop()
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=1).close()


def test_batch_streams_all_accepted(
    collector: Collector, server_factory: Callable[..., AggregatorServer]
) -> None:
    server = server_factory(collector)
    sender = RankSender(server.start(), TOKEN, identity(), flush_interval_s=0.02)
    sender.start()
    for stream in BATCH_STREAMS:
        sender.put(stream, {"seq": 0})
    sender.close()
    collector.wait(lambda c: len(c.finished) == 1)
    assert sorted(b.payload["stream"] for b in collector.batches) == sorted(BATCH_STREAMS)


def test_stop_from_a_callback(collector: Collector) -> None:
    holder: list[AggregatorServer] = []

    def stop_when_finished(message: dict[str, Any]) -> None:
        collector.on_finished(message)
        holder[0].stop()

    server = AggregatorServer("127.0.0.1", 0, TOKEN, collector.on_batch, stop_when_finished)
    holder.append(server)
    address = server.start()
    sender = RankSender(address, TOKEN, identity(), flush_interval_s=0.02)
    sender.put("step_time", {"seq": 0})
    sender.start()
    sender.close()
    collector.wait(lambda c: len(c.finished) == 1)
    wait_until(lambda: server._thread is not None and not server._thread.is_alive())
    assert server.accepted_batches == 1 and server.callback_errors == 0
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=1).close()


def test_dropped_items_are_split_by_stream() -> None:
    # Nothing listens on this port: every flushed batch is dropped after the timeout.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sender = RankSender(("127.0.0.1", port), TOKEN, identity(0), connect_timeout_s=0.05)
    sender.start()
    sender.put("step_time", {"seq": 0})
    sender.put("step_time", {"seq": 1})
    sender.put("process", {"seq": 0})
    sender.put("nope", {"seq": 0})
    sender.close(timeout=0.5)
    assert sender.dropped_items_by_stream == {"step_time": 2, "process": 1, "": 1}
    assert sum(sender.dropped_items_by_stream.values()) == sender.dropped_items == 4


def test_sender_connects_only_with_something_to_send(
    collector: Collector, server_factory: Callable[..., AggregatorServer]
) -> None:
    # The server closes connections that send no first frame for a while; a sender
    # idling on an open connection could lose its first batch to that close.
    server = server_factory(collector)
    address = server.start()
    sender = RankSender(address, TOKEN, identity(), flush_interval_s=0.02)
    sender.start()
    try:
        time.sleep(0.3)
        assert server.connections_total == 0 and not sender.connected
        sender.put("step_time", {"seq": 0})
        collector.wait(lambda c: c.item_count() == 1)
        assert server.connections_total == 1
    finally:
        sender.close()
    collector.wait(lambda c: len(c.finished) == 1)


def test_received_batches_are_tallied_per_rank(
    collector: Collector, server_factory: Callable[..., AggregatorServer]
) -> None:
    server = server_factory(collector)
    address = server.start()
    senders = [
        RankSender(address, TOKEN, identity(rank), flush_interval_s=0.02, max_items_per_batch=3)
        for rank in (0, 1)
    ]
    for rank, sender in enumerate(senders):
        sender.start()
        for seq in range(10 * (rank + 1)):
            sender.put("step_time", {"seq": seq})
    collector.wait(lambda c: c.item_count() == 30)
    for sender in senders:
        sender.close()
    collector.wait(lambda c: len(c.finished) == 2)
    server.stop()
    assert server.received_batches_by_rank() == {
        0: senders[0].sent_batches,
        1: senders[1].sent_batches,
    }
    assert senders[1].sent_batches >= 7


def test_producer_runs_on_the_sender_thread_and_its_exception_stops_nothing(
    collector: Collector, server_factory: Callable[..., AggregatorServer]
) -> None:
    """``set_producer``: called before each flush (the rank's steps off CUDA are built
    there); one that raises is swallowed, and what it put before raising is sent."""
    server = server_factory(collector)
    address = server.address
    assert address is not None
    sender = RankSender(address, TOKEN, identity(), flush_interval_s=0.02)
    calls: list[int] = []
    threads: set[int] = set()

    def producer() -> None:
        threads.add(threading.get_ident())
        n = len(calls)
        calls.append(n)
        if n < 5:
            sender.put("step_time", {"seq": n})
        if n % 2:
            raise RuntimeError("a producer bug")

    sender.set_producer(producer)
    sender.start()
    try:
        collector.wait(lambda c: c.item_count() == 5)
        sender.wake()
        wait_until(lambda: len(calls) >= 8)
    finally:
        sender.close()
    collector.wait(lambda c: len(c.finished) == 1)
    assert [item["seq"] for item in collector.items()] == list(range(5))
    assert threads and threading.get_ident() not in threads
    assert sender.dropped_items == 0


@pytest.mark.parametrize("short_by", [0, 1])
def test_a_flush_that_just_fits_one_frame_goes_as_one_and_one_byte_more_as_two(
    collector: Collector, server_factory: Callable[..., AggregatorServer], short_by: int
) -> None:
    """The flush's one-frame shortcut sends what splitting item by item would."""
    items = [orjson.dumps({"seq": seq}) for seq in range(10)]
    head, tail = RankSender(("127.0.0.1", 9), TOKEN, identity())._envelopes["step_time"]
    exact = len(head) + len(tail) + sum(map(len, items)) + len(items) - 1
    server = server_factory(collector)
    sender = RankSender(
        server.start(), TOKEN, identity(), flush_interval_s=0.02, max_frame_bytes=exact - short_by
    )
    sender.put_encoded_many("step_time", items)
    sender.start()
    sender.close()
    collector.wait(lambda c: len(c.finished) == 1)
    assert [item["seq"] for item in collector.items()] == list(range(10))
    assert len(collector.batches) == 1 + short_by
    assert all(b.nbytes <= exact - short_by for b in collector.batches)
    assert sender.dropped_items == 0


def test_frames_bigger_than_the_socket_buffers_go_whole_to_a_slow_reader(
    server_factory: Callable[..., AggregatorServer],
) -> None:
    """A frame the kernel takes in parts (a few MB against a reader that sleeps between
    batches) is sent to its end, and counted once."""
    collector = Collector()
    on_batch = collector.on_batch

    def slow(batch: ReceivedBatch) -> None:
        time.sleep(0.05)
        on_batch(batch)

    collector.on_batch = slow  # type: ignore[method-assign]
    server = server_factory(collector)
    sender = RankSender(
        server.address, TOKEN, identity(), flush_interval_s=0.01, send_timeout_s=20,
        max_items_per_batch=200,
    )  # fmt: skip
    sender.start()
    pad = "y" * 20_000
    n = 600  # 12 MB: frames of ~4 MB, 3 of them
    try:
        for seq in range(n):
            sender.put("step_time", {"seq": seq, "pad": pad})
        collector.wait(lambda c: c.item_count() == n, timeout=60)
    finally:
        sender.close(timeout=10)
    collector.wait(lambda c: len(c.finished) == 1)
    assert [item["seq"] for item in collector.items()] == list(range(n))
    assert sender.sent_items == n and sender.dropped_items == 0
    # At least 600 / 200 batches (more when a flush came while the puts went on, on a
    # busy machine); each one counted once, by the sender and by the aggregator.
    assert collector.finished[0]["sent_batches"] == sender.sent_batches >= 3


def test_a_sender_whose_socket_was_closed_under_it_disconnects_and_stays_up() -> None:
    """A closed socket object (fileno -1) in the sender's hands: the send and the peer
    check treat it as a broken connection (a retry follows), never as an error that
    would stop the sender's thread."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    sender = RankSender(listener.getsockname(), TOKEN, identity(), flush_interval_s=60)
    try:
        sender._connect(2.0)
        accepted, _ = listener.accept()
        sock = sender._sock
        assert sock is not None
        sock.close()
        sender._check_peer()
        assert sender._sock is None
        sender._sock = sock
        assert sender._send_frame(b"frame") is False
        assert sender._sock is None
        accepted.close()
    finally:
        listener.close()


# ---- tracker_runs ------------------------------------------------------------------------


def _tracker_runs_body(runs: object) -> bytes:
    message = make_tracker_runs_message(TOKEN, identity(0), {})
    message["runs"] = runs
    return orjson.dumps(message)


def test_tracker_runs_decode_within_their_bounds() -> None:
    runs = {"mlflow": {"run_id": "abc", "tracking_uri": "http://127.0.0.1:5000"}}
    assert decode_message(_tracker_runs_body(runs), TOKEN)["runs"] == runs
    assert decode_message(_tracker_runs_body({}), TOKEN)["runs"] == {}
    long = "x" * (TRACKER_RUNS_BOUNDS.max_chars + 1)
    for bad in (
        None,
        [],
        {"mlflow": "abc"},
        {"mlflow": {"run_id": 3}},
        {"mlflow": {"run_id": long}},
        {"mlflow": {long: "a"}},
        {long: {}},
        {f"t{i}": {} for i in range(TRACKER_RUNS_BOUNDS.max_trackers + 1)},
        {"mlflow": {f"k{i}": "v" for i in range(TRACKER_RUNS_BOUNDS.max_fields + 1)}},
    ):
        with pytest.raises(FrameError, match="bad tracker runs"):
            decode_message(_tracker_runs_body(bad), TOKEN)


def test_every_message_is_built_with_its_declared_keys_in_order() -> None:
    built = {
        "batch": make_batch_message(TOKEN, identity(0), "step_time", []),
        "finished": make_finished_message(TOKEN, identity(0), 3, 1, {"step_time": 1}),
        "tracker_runs": make_tracker_runs_message(TOKEN, identity(0), {"wandb": {"id": "x"}}),
        "relay": make_relay_message(TOKEN, "node-1", {3: {"step_time": 2}}, range(4, 8)),
    }
    assert set(built) == set(MESSAGES)
    for kind, message in built.items():
        assert list(message) == ["v", "token", "type", *MESSAGES[kind].keys], kind
        assert decode_message(orjson.dumps(message), TOKEN)["type"] == kind
    short = make_finished_message(TOKEN, identity(0), 3, 1)
    assert "dropped_batches_by_stream" not in short
    assert "ranks" not in make_relay_message(TOKEN, "node-1", {})


def _relay_body(ranks: object) -> bytes:
    message = make_relay_message(TOKEN, "node-1", {})
    message["ranks"] = ranks
    return orjson.dumps(message)


def test_a_relays_run_of_ranks_decodes_and_a_malformed_one_is_refused() -> None:
    message = make_relay_message(TOKEN, "node-1", {}, range(8, 16))
    assert message["ranks"] == {"first": 8, "count": 8}
    assert relay_ranks(decode_message(orjson.dumps(message), TOKEN)) == range(8, 16)
    assert relay_ranks(make_relay_message(TOKEN, "node-1", {})) is None
    for bad in (
        None,
        [8, 8],
        {"first": 8},
        {"first": 8, "count": 0},
        {"first": -1, "count": 2},
        {"first": 8, "count": True},
        {"first": 8.0, "count": 2},
        {"first": 8, "count": 2, "more": 1},
        {"first": RELAY_RANKS_END - 1, "count": 2},
    ):
        with pytest.raises(FrameError, match="bad relay report"):
            decode_message(_relay_body(bad), TOKEN)
    for unfit in (range(0), range(3, 2), range(0, 8, 2), range(-1, 2), range(RELAY_RANKS_END + 1)):
        with pytest.raises(ValueError):
            make_relay_message(TOKEN, "node-1", {}, unfit)


def test_wire_format_md_documents_every_message_and_the_tracker_runs_bounds() -> None:
    """docs/dev/wire-format.md says what the declaration says: each message's keys and
    the bounds of tracker_runs."""
    doc = (Path(__file__).resolve().parents[3] / "docs" / "dev" / "wire-format.md").read_text()
    for kind, spec in MESSAGES.items():
        assert f'"type":"{kind}"' in doc, kind
        for key in spec.keys:
            assert f'"{key}"' in doc, (kind, key)
    bounds = TRACKER_RUNS_BOUNDS
    assert f"at most {bounds.max_trackers} trackers" in doc
    assert f"at most {bounds.max_fields} fields" in doc
    assert f"at most {bounds.max_chars} characters" in doc


def test_tracker_runs_reach_their_callback_once_per_change_and_say_nothing_of_the_end(
    collector: Collector,
) -> None:
    """A rank's first frame may be its tracker_runs (the gate knows its prefix); the
    same runs noted again are not sent again; the connection's end still carries the
    identity of its batches and goodbye, not of a tracker_runs message."""
    told: list[dict[str, Any]] = []
    server = AggregatorServer(
        "127.0.0.1",
        0,
        TOKEN,
        collector.on_batch,
        collector.on_finished,
        on_connection_lost=collector.on_lost,
        on_tracker_runs=told.append,
    )
    address = server.start()
    try:
        sender = RankSender(address, TOKEN, identity(0), flush_interval_s=0.02)
        sender.start()
        runs = {"tensorboard": {"log_dir": "/tmp/tb"}}
        sender.note_tracker_runs(runs)
        wait_until(lambda: len(told) == 1)
        sender.note_tracker_runs({"tensorboard": {"log_dir": "/tmp/tb"}})  # the same
        sender.put("process", {"seq": 0})
        collector.wait(lambda c: c.item_count() == 1)
        changed = {**runs, "mlflow": {"run_id": "r1", "tracking_uri": ""}}
        sender.note_tracker_runs(changed)
        sender.close()
        collector.wait(lambda c: len(c.finished) == 1 and len(c.lost) == 1)
        assert [m["runs"] for m in told] == [runs, changed]
        assert told[0]["identity"]["global_rank"] == 0
        assert server.rejected_frames == 0
    finally:
        server.stop()


def test_a_server_without_the_callback_takes_tracker_runs_quietly(
    collector: Collector, server_factory: Callable[..., AggregatorServer]
) -> None:
    server = server_factory(collector)
    sender = RankSender(server.start(), TOKEN, identity(0), flush_interval_s=0.02)
    sender.start()
    sender.note_tracker_runs({"wandb": {"id": "x"}})
    sender.put("process", {"seq": 0})
    sender.close()
    collector.wait(lambda c: len(c.finished) == 1)
    assert collector.item_count() == 1 and server.rejected_frames == 0
