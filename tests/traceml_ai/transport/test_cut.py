"""The batches of a relay's connection cut out of a chunk: ``_cut.c`` and its twin
``_cut_py.py`` give the same answer for any bytes, and the server hands on what a
relay's chunk holds in order, whichever of them cuts it."""

from __future__ import annotations

import importlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from traceml_ai.transport import AggregatorServer, _cut_py
from traceml_ai.transport import server as server_module
from traceml_ai.transport.wire import (
    BATCH_STREAM_TAILS,
    FRAME_HEADER,
    ReceivedBatch,
    batch_prefix,
    encode_frame,
    make_batch_message,
    make_finished_message,
    make_relay_message,
)

pytestmark = pytest.mark.unit

TOKEN = "cut-token"
PREFIX = batch_prefix(TOKEN)
C_CUT: Callable[..., tuple[list[tuple[bytes, int, int]], int, int]] = importlib.import_module(
    "traceml_ai.transport._cut"
).cut_batches
CUTTERS = {"c": C_CUT, "python": _cut_py.cut_batches}


def identity(rank: int) -> dict[str, Any]:
    return {
        "global_rank": rank,
        "local_rank": rank % 8,
        "world_size": 64,
        "local_world_size": 8,
        "node_rank": rank // 8,
        "pid": 1000 + rank,
    }


def batch_frame(rank: int, seq: int = 0, stream: str = "step_time") -> bytes:
    item = {"timestamp_unix_ns": 1, "seq": seq, "step": seq + 1, "events": {}}
    return encode_frame(make_batch_message(TOKEN, identity(rank), stream, [item]))


def raw_frame(body: bytes) -> bytes:
    return FRAME_HEADER.pack(len(body)) + body


# -- the twins ---------------------------------------------------------------------------

_RANK_TEXT = st.one_of(
    st.integers(0, 10**19).map(str),
    st.sampled_from(["0", "00", "01", "-1", "1.5", "", "99999999999999999999", "1e3", '"3"']),
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """Frame bodies near the plain batch: the prefix or not, a known stream or not, a
    global_rank key with any text after it, or found late, or not at all."""
    head = draw(st.sampled_from([PREFIX, PREFIX[:-3], b'{"v":1,"type":"batch"', b""]))
    stream = draw(st.sampled_from([*BATCH_STREAM_TAILS, b"nope_stream", b"step_tim", b""]))
    filler = b"x" * draw(st.one_of(st.sampled_from([0, 10, 5000]), st.integers(4000, 4100)))
    key = draw(st.sampled_from([b'"global_rank":', b'"global_rank": ', b'"globalrank":', b""]))
    rank = draw(_RANK_TEXT).encode()
    end = draw(st.sampled_from([b",", b"}", b"]", b""]))
    tail = draw(st.binary(max_size=40))
    return head + stream + b',"identity":{' + filler + key + rank + end + tail


@st.composite
def chunks(draw: st.DrawFn) -> tuple[bytes, int]:
    parts = [
        draw(
            st.one_of(
                bodies().map(raw_frame),
                st.integers(0, 30).map(lambda r: batch_frame(r)),
                st.binary(max_size=12),
            )
        )
        for _ in range(draw(st.integers(0, 6)))
    ]
    data = b"".join(parts)
    return data, draw(st.integers(0, len(data)))


@given(chunks(), st.sampled_from([64, 4096, 1 << 20]))
def test_the_c_cutter_and_its_twin_agree_on_any_bytes(
    chunk: tuple[bytes, int], max_frame_bytes: int
) -> None:
    data, pos = chunk
    args = (data, pos, PREFIX, BATCH_STREAM_TAILS, max_frame_bytes)
    assert C_CUT(*args) == _cut_py.cut_batches(*args)


@pytest.mark.parametrize("cut", CUTTERS.values(), ids=list(CUTTERS))
def test_the_rank_is_read_only_when_it_ends_within_the_span(cut: Callable[..., Any]) -> None:
    head = PREFIX + b'step_time","identity":{'
    for ends_at, found in [(4095, True), (4096, True), (4097, False)]:
        # The rank's text, its comma included, ends at byte ``ends_at`` of the body.
        rank = b'"global_rank":12,'
        body = head + b"x" * (ends_at - len(head) - len(rank)) + rank + b'"items":[]}'
        batches, _, status = cut(raw_frame(body), 0, PREFIX, BATCH_STREAM_TAILS, 1 << 20)
        assert (status == _cut_py.NEED_MORE, [r for _, _, r in batches]) == (
            (True, [12]) if found else (False, [])
        )


@pytest.mark.parametrize("cut", CUTTERS.values(), ids=list(CUTTERS))
def test_a_chunk_is_cut_until_a_frame_needs_reading(cut: Callable[..., Any]) -> None:
    plain = [batch_frame(3), batch_frame(5, stream="collectives"), batch_frame(0)]
    finished = encode_frame(make_finished_message(TOKEN, identity(3), 1, 0))
    data = b"".join(plain) + finished + batch_frame(7)[:20]
    batches, pos, status = cut(data, 0, PREFIX, BATCH_STREAM_TAILS, 1 << 20)
    assert [(rank, length) for _, length, rank in batches] == [
        (3, len(plain[0]) - 4),
        (5, len(plain[1]) - 4),
        (0, len(plain[2]) - 4),
    ]
    assert [body for body, _, _ in batches] == [frame[4:] for frame in plain]
    assert (pos, status) == (sum(map(len, plain)), _cut_py.PYTHON)
    # From the finished message on: it is the Python reader's, then an incomplete frame.
    after = pos + len(finished)
    assert cut(data, after, PREFIX, BATCH_STREAM_TAILS, 1 << 20) == ([], after, _cut_py.NEED_MORE)
    assert cut(data, 0, PREFIX, BATCH_STREAM_TAILS, 100) == ([], 0, _cut_py.OVERSIZED)
    with pytest.raises(ValueError):
        cut(data, len(data) + 1, PREFIX, BATCH_STREAM_TAILS, 1 << 20)


# -- the server ----------------------------------------------------------------------------


class Received:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, Any]] = []

    def on_batch(self, batch: ReceivedBatch) -> None:
        with self.lock:
            self.events.append(("batch", batch))

    def on_batches(self, batches: list[ReceivedBatch]) -> None:
        with self.lock:
            self.events.extend(("batch", b) for b in batches)

    def on_finished(self, message: dict[str, Any]) -> None:
        with self.lock:
            self.events.append(("finished", message["identity"]["global_rank"]))

    def ranks(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        with self.lock:
            for kind, value in self.events:
                if kind == "batch":
                    payload = value.payload
                    if type(payload) is bytes:
                        payload = orjson.loads(payload)
                    value = payload["identity"]["global_rank"]
                out.append((kind, value))
        return out


@pytest.fixture(params=["c", "python", "one-by-one"])
def served(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[AggregatorServer, Received]]:
    cutter = C_CUT if request.param == "c" else _cut_py.cut_batches
    monkeypatch.setattr(server_module, "_cut_batches", cutter)
    received = Received()
    many = {} if request.param == "one-by-one" else {"on_batches": received.on_batches}
    server = AggregatorServer(
        "127.0.0.1",
        0,
        TOKEN,
        received.on_batch,
        received.on_finished,
        max_frame_bytes=4096,
        on_relay=lambda message: None,
        **many,
    )
    server.start()
    yield server, received
    server.stop()


def _send(server: AggregatorServer, data: bytes) -> socket.socket:
    assert server.address is not None
    sock = socket.create_connection(server.address)
    sock.sendall(encode_frame(make_relay_message(TOKEN, "node-1", {})) + data)
    return sock


def _wait(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.01)


def test_a_relays_chunk_keeps_its_order_and_each_ranks_tally(
    served: tuple[AggregatorServer, Received],
) -> None:
    server, received = served
    other_encoder = encode_frame(
        {"identity": identity(7), "items": [], "stream": "process", "token": TOKEN}
        | {"v": 1, "type": "batch"}
    )
    data = b"".join(
        [
            batch_frame(3),
            other_encoder,
            batch_frame(5),
            encode_frame(make_finished_message(TOKEN, identity(3), 1, 0)),
            batch_frame(5, 1),
        ]
    )
    # One chunk, then the rest of a frame split across two sends.
    last = batch_frame(9)
    with _send(server, data + last[:7]) as sock:
        _wait(lambda: len(received.ranks()) == 5)
        sock.sendall(last[7:])
        _wait(lambda: len(received.ranks()) == 6)
        assert received.ranks() == [
            ("batch", 3),
            ("batch", 7),
            ("batch", 5),
            ("finished", 3),
            ("batch", 5),
            ("batch", 9),
        ]
        assert server.received_batches_by_rank() == {3: 1, 5: 2, 7: 1, 9: 1}
        assert server.relayed_ranks == {3, 5, 7, 9}
        assert server.accepted_batches == 5
        assert server.rejected_frames == 0


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (raw_frame(PREFIX + b'step_time","identity":{"rank":1},"items":[]}'), "missing identity"),
        (FRAME_HEADER.pack(5000) + b"x" * 10, "oversized frame"),
    ],
    ids=["no-rank", "oversized"],
)
def test_a_bad_frame_closes_the_relays_connection_after_the_batches_before_it(
    served: tuple[AggregatorServer, Received], bad: bytes, reason: str
) -> None:
    server, received = served
    with _send(server, batch_frame(1) + batch_frame(2) + bad + batch_frame(4)) as sock:
        _wait(lambda: server.rejected_frames == 1)
        sock.settimeout(5)
        assert sock.recv(10) == b""  # closed by the server
    assert received.ranks() == [("batch", 1), ("batch", 2)]
    assert server.rejected_by_reason == {reason: 1}
    assert server.received_batches_by_rank() == {1: 1, 2: 1}
