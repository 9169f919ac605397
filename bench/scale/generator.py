"""Generator processes: many simulated ranks per process, one TCP connection each."""

from __future__ import annotations

import array
import heapq
import pickle
import re
import resource
import selectors
import socket
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import orjson

from traceml_ai.transport.wire import (
    FRAME_HEADER,
    encode_frame,
    make_batch_message,
    make_finished_message,
)

from .items import (
    LoadSpec,
    collectives_item,
    process_item,
    runtime_item,
    step_events,
    system_item,
)

# -- generator processes ----------------------------------------------------------------

# A one-item batch's varying numbers, written in its template as these sentinels: the
# timestamp, the seq k, the step k + 1 and step_memory's peak 20e9 + k.
_SENT = (9_100_000_001, 9_100_000_000_000_000_001)  # (k, ts) as _item takes them
_SENTINELS = re.compile(rb"(9100000000000000001|29100000001|9100000001|9100000002)")
_SLOT_OF = {b"9100000000000000001": 0, b"9100000001": 1, b"9100000002": 2, b"29100000001": 3}
Template = tuple[bytes, tuple[int, ...]]
"""A one-item batch body as a ``%d`` format, and which number goes in each slot."""


class _Log:
    """The batches of one (rank, wire stream): first seq, item count, 1 if dropped here."""

    __slots__ = ("dropped", "sizes", "starts")

    def __init__(self) -> None:
        self.starts = array.array("q")
        self.sizes = array.array("i")
        self.dropped = array.array("b")


class _Rank:
    __slots__ = (
        "device",
        "dropped_batches",
        "dropped_by_stream",
        "events",
        "identity",
        "local_rank",
        "logs",
        "next_env",
        "next_proc",
        "next_step",
        "next_sys",
        "pending",
        "rank",
        "sent_batches",
        "sock",
        "templates",
    )

    def __init__(self, spec: LoadSpec, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.identity = spec.identity(rank)
        self.local_rank = rank % spec.ranks_per_node
        self.device = f"cuda:{self.local_rank}"
        self.events = step_events(self.device)
        self.sock = sock
        self.pending = bytearray()
        self.next_step = 0
        self.next_proc = 0
        self.next_sys = 0
        self.next_env = 0
        self.sent_batches = 0
        self.dropped_batches = 0
        self.dropped_by_stream: dict[str, int] = {}
        self.logs = {stream: _Log() for stream in spec.wire_streams}
        self.templates: dict[str, Template | tuple[()]] = {}


class _Generator:
    """Simulates ranks ``[first, last)`` on one connection each, from one process, to
    ``addresses``: one for every rank, or one per node (its relay)."""

    def __init__(
        self,
        spec: LoadSpec,
        token: str,
        addresses: Sequence[tuple[str, int]],
        ranks: range,
    ):
        self.spec = spec
        self.token = token
        self.ranks: list[_Rank] = []
        per_node = len(addresses) > 1
        for rank in ranks:
            address = addresses[rank // spec.ranks_per_node] if per_node else addresses[0]
            sock = socket.create_connection(address, timeout=30)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            self.ranks.append(_Rank(spec, rank, sock))
        self.selector = selectors.DefaultSelector()
        self.waiting: set[int] = set()
        self.max_lag_s = 0.0
        self.max_flush_s = 0.0
        self.max_pending = 0
        self.items = 0

    def run(self, t0: float) -> None:
        spec = self.spec
        period = 1.0 / spec.flush_hz
        end = t0 + spec.seconds
        n = len(self.ranks)
        # Flushes are spread evenly over the period, as independent ranks would be.
        heap = [(t0 + period * ((i * 0.618033988749895) % 1.0), i) for i in range(n)]
        heapq.heapify(heap)
        clock = time.monotonic
        while heap:
            due, i = heap[0]
            now = clock()
            if due > now:
                self._wait(min(due - now, 0.02))
                continue
            heapq.heappop(heap)
            self.max_lag_s = max(self.max_lag_s, now - due)
            final = due >= end
            begin = time.perf_counter()
            self._flush(self.ranks[i], min(now, end) - t0, final)
            self.max_flush_s = max(self.max_flush_s, time.perf_counter() - begin)
            if not final:
                heapq.heappush(heap, (min(due + period, end), i))
        self._drain()

    def _flush(self, r: _Rank, elapsed: float, final: bool) -> None:
        spec = self.spec
        ts = time.time_ns()
        streams = spec.wire_streams
        if "runtime_environment" in streams and r.next_env == 0:
            item = runtime_item(ts, spec.ranks, spec.ranks_per_node)
            self._batch(r, "runtime_environment", 0, [item])
            r.next_env = 1
        steps = (
            spec.total_steps if final else min(spec.total_steps, int(elapsed * spec.steps_per_s))
        )
        a = r.next_step
        if steps > a:
            r.next_step = steps
            for stream in ("step_time", "step_memory", "collectives"):
                if stream in streams:
                    self._items(r, stream, a, steps, ts)
        samples = (
            spec.total_samples
            if final
            else min(spec.total_samples, int(elapsed / spec.sampler_interval_s) + 1)
        )
        if "process" in streams and samples > r.next_proc:
            a, r.next_proc = r.next_proc, samples
            self._items(r, "process", a, samples, ts)
        if "system" in streams and r.local_rank == 0 and samples > r.next_sys:
            a, r.next_sys = r.next_sys, samples
            self._items(r, "system", a, samples, ts)
        self._send(r)

    def _item(self, r: _Rank, stream: str, k: int, ts: int) -> dict[str, Any]:
        """Item ``k`` of ``stream`` as the rank sends it."""
        if stream == "step_time":
            return {"timestamp_unix_ns": ts, "seq": k, "step": k + 1, "events": r.events}
        if stream == "step_memory":
            return {
                "timestamp_unix_ns": ts,
                "seq": k,
                "step": k + 1,
                "device": r.device,
                "peak_allocated_bytes": 20_000_000_000 + k,
                "peak_reserved_bytes": 24_000_000_000,
            }
        if stream == "collectives":
            return collectives_item(k, ts)
        if stream == "process":
            return process_item(k, ts, r.local_rank)
        return system_item(k, ts, self.spec.gpus)

    def _items(self, r: _Rank, stream: str, a: int, b: int, ts: int) -> None:
        """The batch of items ``a`` to ``b - 1``; a one-item batch from the rank's
        template of the stream (the same bytes, without a dict and an orjson call)."""
        if b - a == 1:
            template = r.templates.get(stream)
            if template is None:
                template = r.templates[stream] = self._template(r, stream)
            if template:
                fmt, slots = template
                numbers = (ts, a, a + 1, 20_000_000_000 + a)
                body = fmt % tuple(numbers[slot] for slot in slots)
                self._queue(r, stream, a, 1, FRAME_HEADER.pack(len(body)) + body)
                return
        self._batch(r, stream, a, [self._item(r, stream, k, ts) for k in range(a, b)])

    def _template(self, r: _Rank, stream: str) -> Template | tuple[()]:
        """The rank's one-item batch body of ``stream`` as a ``%d`` format (one slot per
        place of the timestamp, the seq, the step and the memory peak), or nothing when
        rendering it would not give orjson's bytes (checked once here): ``()`` then."""
        body = orjson.dumps(
            make_batch_message(self.token, r.identity, stream, [self._item(r, stream, *_SENT)])
        )
        pieces = _SENTINELS.split(body)
        fmt = pieces[0].replace(b"%", b"%%")
        slots = []
        for found, rest in zip(pieces[1::2], pieces[2::2], strict=True):
            slots.append(_SLOT_OF[found])
            fmt += b"%d" + rest.replace(b"%", b"%%")
        k, ts = 5, 1_700_000_000_123_456_789
        real = orjson.dumps(
            make_batch_message(self.token, r.identity, stream, [self._item(r, stream, k, ts)])
        )
        rendered = fmt % tuple((ts, k, k + 1, 20_000_000_000 + k)[slot] for slot in slots)
        return (fmt, tuple(slots)) if rendered == real else ()

    def _batch(self, r: _Rank, stream: str, first: int, items: list[dict[str, Any]]) -> None:
        frame = encode_frame(make_batch_message(self.token, r.identity, stream, items))
        self._queue(r, stream, first, len(items), frame)

    def _queue(self, r: _Rank, stream: str, first: int, n: int, frame: bytes) -> None:
        log = r.logs[stream]
        log.starts.append(first)
        log.sizes.append(n)
        self.items += n
        if len(r.pending) + len(frame) > self.spec.sender_buffer_bytes:
            log.dropped.append(1)
            r.dropped_batches += 1
            r.dropped_by_stream[stream] = r.dropped_by_stream.get(stream, 0) + 1
            return
        log.dropped.append(0)
        r.sent_batches += 1
        r.pending += frame

    def _send(self, r: _Rank) -> None:
        if not r.pending:
            return
        try:
            n = r.sock.send(r.pending)
        except BlockingIOError:
            n = 0
        if n:
            del r.pending[:n]
        self.max_pending = max(self.max_pending, len(r.pending))
        if r.pending and r.rank not in self.waiting:
            self.waiting.add(r.rank)
            self.selector.register(r.sock, selectors.EVENT_WRITE, r)
        elif not r.pending and r.rank in self.waiting:
            self.waiting.discard(r.rank)
            self.selector.unregister(r.sock)

    def _wait(self, timeout: float) -> None:
        if not self.waiting:
            time.sleep(timeout)
            return
        for key, _ in self.selector.select(timeout):
            self._send(key.data)

    def _drain(self) -> None:
        """After the load: send what is left (blocking, bounded), then ``finished``."""
        for r in self.ranks:
            if r.rank in self.waiting:
                self.selector.unregister(r.sock)
            r.sock.setblocking(True)
            r.sock.settimeout(120)
            finished = make_finished_message(
                self.token, r.identity, r.sent_batches, r.dropped_batches, r.dropped_by_stream
            )
            r.sock.sendall(bytes(r.pending) + encode_frame(finished))
            r.pending.clear()
        self.waiting.clear()
        for r in self.ranks:
            r.sock.close()

    def result(self) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "logs": {
                r.rank: {
                    s: (log.starts.tobytes(), log.sizes.tobytes(), log.dropped.tobytes())
                    for s, log in r.logs.items()
                }
                for r in self.ranks
            },
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "max_lag_s": self.max_lag_s,
            "max_flush_s": self.max_flush_s,
            "max_pending_bytes": self.max_pending,
            "items": self.items,
            "sender_dropped_batches": sum(r.dropped_batches for r in self.ranks),
        }


def generator_main(
    spec: LoadSpec,
    token: str,
    addresses: Sequence[tuple[str, int]],
    first: int,
    last: int,
    conn: Connection,
    out_path: str,
) -> None:
    try:
        gen = _Generator(spec, token, addresses, range(first, last))
        conn.send("connected")
        t0 = conn.recv()
        gen.run(t0)
        Path(out_path).write_bytes(pickle.dumps(gen.result()))
        conn.send("done")
    except BaseException as exc:
        conn.send(f"error: {exc!r}")
        raise
