"""Rank side of the transport: batch telemetry items and send them from a background thread.

The training thread only encodes an item and appends it to a per-stream deque (``put``).
One daemon thread wakes every ``flush_interval_s`` (or early when a stream has a full
batch pending), joins the pending items into ``batch`` frames and writes them with a
blocking ``sendall`` under a timeout. Items wait encoded: a queue of bytes holds nothing
the garbage collector walks, where thousands of waiting dicts would survive into its
oldest generation and bring on full collections of the whole process
(docs/benchmarks.md). Nothing the aggregator does (stall, crash, restart) can block
``put``; what cannot be delivered is dropped and counted.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from itertools import repeat, starmap
from time import monotonic
from typing import Any

import orjson

from traceml_ai import _fork
from traceml_ai.transport.wire import (
    BATCH_STREAMS,
    DEFAULT_MAX_FRAME_BYTES,
    batch_envelope,
    encode_batch_frame,
    encode_frame,
    encode_item,
    make_finished_message,
    make_tracker_runs_message,
)
from traceml_records.internal import load_extension

__all__ = ["RankSender"]

# The sender's socket calls in C, which keep the interpreter's lock (_nowait.c), or
# None: Python's, which release it around each system call. Tests set it to None.
_NOWAIT: Any = load_extension("traceml_ai.transport._nowait")

_INITIAL_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 2.0
# Time a closing sender keeps back from its flush so the ``finished`` frame still fits.
_FINISH_RESERVE_S = 0.25
# Extra time ``close`` grants a sender thread stuck in a syscall after interrupting it.
_CLOSE_GRACE_S = 0.5
# Key of put-time drops for names outside BATCH_STREAMS.
_UNKNOWN_STREAM = ""


def _batches_for(items: int, per_batch: int) -> int:
    return -(-items // per_batch)


class RankSender:
    """Send a rank's telemetry items to the aggregator without ever blocking the caller.

    ``max_pending_items`` bounds each stream's queue; when a queue is full, ``put`` drops
    the *newest* item (the one being put) and counts it, so what arrives stays a
    contiguous prefix. Items dropped by ``put`` are also charged to ``dropped_batches`` as
    the batches they would have formed, so the ``finished`` message reflects them.
    Batches that fail to send (timeout, broken connection, deadline of ``close``) are
    dropped, never retried, because part of them may already have been delivered.
    """

    def __init__(
        self,
        address: tuple[str, int],
        token: str,
        identity: dict[str, object],
        *,
        flush_interval_s: float = 0.25,
        max_pending_items: int = 20_000,
        max_items_per_batch: int = 1_000,
        connect_timeout_s: float = 1.0,
        send_timeout_s: float = 2.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        counts_from: RankSender | None = None,
    ) -> None:
        """``counts_from``: a closed sender of the same rank whose batch counts this one
        continues (``init`` after ``shutdown`` in one process), so the ``finished`` message
        always reports the process's whole loss; the aggregator keeps the largest count a
        rank reports and would otherwise miss what the earlier sender dropped."""
        if flush_interval_s <= 0 or connect_timeout_s <= 0 or send_timeout_s <= 0:
            raise ValueError("intervals and timeouts must be positive")
        if max_pending_items < 1 or max_items_per_batch < 1 or max_frame_bytes < 1:
            raise ValueError("limits must be at least 1")
        # Fail here rather than on every batch in the sender thread.
        orjson.dumps(identity)
        self._address = (address[0], int(address[1]))
        self._token = token
        self._identity = dict(identity)
        self._flush_interval_s = flush_interval_s
        self._max_pending_items = max_pending_items
        self._max_items_per_batch = max_items_per_batch
        self._connect_timeout_s = connect_timeout_s
        self._send_timeout_s = send_timeout_s
        self._max_frame_bytes = max_frame_bytes
        self._wake_at = min(max_items_per_batch, max_pending_items)
        # Called on the sender thread before each flush (``set_producer``).
        self._producer: Callable[[], None] | None = None

        self._streams: tuple[tuple[str, deque[bytes]], ...] = tuple(
            (name, deque()) for name in BATCH_STREAMS
        )
        # ``put`` looks streams up here; emptied on close/fork, which turns ``put`` off.
        self._queues: dict[str, deque[bytes]] = dict(self._streams)
        self._envelopes = {
            name: batch_envelope(token, self._identity, name) for name in BATCH_STREAMS
        }

        self._drop_lock = threading.Lock()
        self._put_dropped: dict[str, int] = dict.fromkeys((*BATCH_STREAMS, _UNKNOWN_STREAM), 0)
        self._put_dropped_charged: dict[str, int] = dict(self._put_dropped)

        # Written by the sender thread only.
        self._sent_batches = 0
        self._sent_items = 0
        self._dropped_batches = 0
        self._dropped_batches_by_stream: dict[str, int] = dict.fromkeys(BATCH_STREAMS, 0)
        self._thread_dropped_items = 0
        self._thread_dropped_by_stream: dict[str, int] = dict.fromkeys(BATCH_STREAMS, 0)
        self._sock: socket.socket | None = None
        self._backoff_s = _INITIAL_BACKOFF_S
        self._retry_at = 0.0
        if counts_from is not None:
            self._sent_batches = counts_from._sent_batches
            self._dropped_batches = counts_from._dropped_batches
            for stream, count in counts_from._dropped_batches_by_stream.items():
                self._dropped_batches_by_stream[stream] += count

        self._lifecycle_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._forked = False
        self._deadline: float | None = None
        # The latest tracker_runs frame not yet sent (note_tracker_runs), and the runs
        # of the last one noted: one slot, the newest wins.
        self._tracker_runs_frame: bytes | None = None
        self._tracker_runs: object = None
        _fork.track(self)

    # ---- stats -------------------------------------------------------------------------

    @property
    def sent_batches(self) -> int:
        """Batches fully written to the socket."""
        return self._sent_batches

    @property
    def sent_items(self) -> int:
        """Items in ``sent_batches``."""
        return self._sent_items

    @property
    def dropped_batches(self) -> int:
        """Batches lost: unsendable, cut short by ``close``, or formed by dropped puts."""
        return self._dropped_batches

    @property
    def dropped_batches_by_stream(self) -> dict[str, int]:
        """:attr:`dropped_batches` split by wire stream, streams with none left out.

        ``put`` refusals of an unknown stream are in the total only: no stream owns them.
        """
        return {k: v for k, v in list(self._dropped_batches_by_stream.items()) if v}

    @property
    def dropped_items(self) -> int:
        """Items lost, whether refused by ``put`` or in a dropped batch."""
        return self._thread_dropped_items + sum(self._put_dropped.values())

    @property
    def dropped_items_by_stream(self) -> dict[str, int]:
        """:attr:`dropped_items` split by wire stream, streams with none left out (``put``
        refusals of an unknown stream are under ``""``)."""
        with self._drop_lock:
            by_stream = {k: v for k, v in self._put_dropped.items() if v}
        for stream, count in list(self._thread_dropped_by_stream.items()):
            if count:
                by_stream[stream] = by_stream.get(stream, 0) + count
        return by_stream

    @property
    def pending_items(self) -> int:
        """Items queued and not yet sent or dropped."""
        return sum(len(queue) for _, queue in self._streams)

    @property
    def connected(self) -> bool:
        """Whether the sender currently holds a connection to the aggregator."""
        return self._sock is not None

    # ---- caller side -------------------------------------------------------------------

    def start(self) -> None:
        """Start the sender thread (once; no-op after ``close`` or in a forked child)."""
        with self._lifecycle_lock:
            if self._closed or self._thread is not None:
                return
            thread = threading.Thread(target=self._run, name="traceml-sender", daemon=True)
            self._thread = thread
            thread.start()

    def put(self, stream: str, item: dict[str, Any]) -> None:
        """Encode ``item`` and queue it for ``stream``. Never blocks, never raises.

        Items put before ``start`` or while disconnected wait (within the bound) for a
        connection. An item that cannot be encoded is dropped and counted. After
        ``close``, and in a forked child, ``put`` does nothing.
        """
        try:
            data = encode_item(item)
        except Exception:
            self._enqueue(stream, (), unencodable=1)
            return
        self._enqueue(stream, (data,))

    def put_encoded(self, stream: str, data: bytes) -> None:
        """``put`` of an item its producer encoded itself: ``data`` is
        ``wire.encode_item(item)``. Never blocks, never raises."""
        self._enqueue(stream, (data,))

    def put_encoded_many(self, stream: str, items: Sequence[bytes]) -> None:
        """``put_encoded`` of several items of one stream, in order, in one call: the
        same bound, and the same refusals counted, as one by one. Never blocks, never
        raises."""
        self._enqueue(stream, items)

    def _enqueue(self, stream: str, items: Sequence[bytes], unencodable: int = 0) -> None:
        """Queue encoded items in order, as many as the bound leaves room for, and count
        every refusal: a full queue, an unknown stream, and ``unencodable`` more items
        that could not be encoded. Nothing after ``close`` and in a forked child."""
        try:
            queue = self._queues.get(stream)
            if queue is None:
                if self._queues and (items or unencodable):
                    self._count_put_drop(_UNKNOWN_STREAM, len(items) + unencodable)
                return
            before = len(queue)
            room = max(self._max_pending_items - before, 0)
            refused = unencodable
            if len(items) > room:
                refused += len(items) - room
                items = items[:room]
            if refused:
                self._count_put_drop(stream, refused)
            queue.extend(items)
            if before < self._wake_at <= before + len(items):
                self._wake.set()
        except Exception:
            pass

    def note_tracker_runs(self, runs: Mapping[str, Mapping[str, str]]) -> None:
        """Have the aggregator know the tracker runs the script has open (a
        ``tracker_runs`` message, sent with the next flush) when they differ from the
        last ones noted. Never blocks, never raises; nothing after ``close``."""
        try:
            if self._closed or runs == self._tracker_runs:
                return
            frame = encode_frame(make_tracker_runs_message(self._token, self._identity, runs))
            self._tracker_runs = {k: dict(v) for k, v in runs.items()}
            self._tracker_runs_frame = frame
            self._wake.set()
        except Exception:
            pass

    def _send_tracker_runs(self) -> None:
        frame = self._tracker_runs_frame
        sent = frame is not None and self._sock is not None and self._send_frame(frame)
        if sent and self._tracker_runs_frame is frame:
            self._tracker_runs_frame = None

    def set_producer(self, producer: Callable[[], None] | None) -> None:
        """Have the sender thread call ``producer`` before each flush, to ``put`` items
        that were left to build off the caller's thread. Not called by ``close`` (``put``
        is off from its start): build what is left before closing. An exception from it
        is swallowed: the sender thread never stops for it."""
        self._producer = producer

    def wake(self) -> None:
        """Flush now rather than at the next interval (also runs the producer)."""
        self._wake.set()

    def _produce(self) -> None:
        producer = self._producer
        if producer is not None:
            with contextlib.suppress(Exception):
                producer()

    def close(self, timeout: float = 2.0) -> None:
        """Flush within ``timeout``, send ``finished``, close and join. Idempotent, never raises."""
        try:
            with self._lifecycle_lock:
                if self._closed:
                    return
                self._closed = True
                self._queues = {}
                thread = self._thread
            if thread is None:
                # Never started: no thread will ever deliver what is pending.
                self._drop_pending()
                self._charge_put_drops()
                return
            timeout = max(0.0, timeout)
            self._deadline = monotonic() + timeout
            self._stop.set()
            self._wake.set()
            thread.join(timeout + 0.1)
            if thread.is_alive():
                # Stuck in sendall/recv: shutdown() makes the blocking call return at once.
                sock = self._sock
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                thread.join(_CLOSE_GRACE_S)
        except Exception:
            pass
        finally:
            _fork.untrack(self)

    def _count_put_drop(self, stream: str, items: int = 1) -> None:
        # Only taken when a queue is full or the stream is unknown, never on the fast path.
        with self._drop_lock:
            self._put_dropped[stream] += items

    def after_fork_in_child(self) -> None:
        """The child of a fork has the parent's queues and socket but not its thread:
        this sender goes inert there, so nothing of the parent's is sent twice."""
        self._forked = True
        self._closed = True
        self._queues = {}
        self._thread = None
        for _, queue in self._streams:
            queue.clear()
        sock, self._sock = self._sock, None
        if sock is not None:
            # Closing the child's copy of the descriptor leaves the parent's connection up;
            # shutdown() would not, so it is never called here.
            with contextlib.suppress(OSError):
                sock.close()

    # ---- sender thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait(self._flush_interval_s)
                self._wake.clear()
                if self._stop.is_set():
                    break
                self._produce()
                self._charge_put_drops()
                # Connect only with something to send: the aggregator closes a
                # connection that has not proven itself with a first frame for a
                # while, and a batch written as it does so would be lost unseen.
                if (
                    self._sock is None
                    and monotonic() >= self._retry_at
                    and (
                        any(queue for _, queue in self._streams)
                        or self._tracker_runs_frame is not None
                    )
                ):
                    self._connect(self._connect_timeout_s)
                if self._sock is not None:
                    self._check_peer()
                    self._send_tracker_runs()
                    self._flush(stop_at=None)
            self._finish()
        except Exception:
            pass
        finally:
            self._disconnect()

    def _finish(self) -> None:
        deadline = self._deadline if self._deadline is not None else monotonic()
        reserve = min(_FINISH_RESERVE_S, max(0.0, deadline - monotonic()) * 0.2)
        flush_until = deadline - reserve
        self._charge_put_drops()
        if self._sock is None:
            self._connect(min(self._connect_timeout_s, flush_until - monotonic()))
        if self._sock is not None:
            self._check_peer()
            self._send_tracker_runs()
            self._flush(stop_at=flush_until)
        self._drop_pending()
        self._charge_put_drops()
        frame = encode_frame(
            make_finished_message(
                self._token,
                self._identity,
                self._sent_batches,
                self._dropped_batches,
                self.dropped_batches_by_stream,
            )
        )
        if self._sock is None:
            self._connect(min(self._connect_timeout_s, deadline - monotonic()))
        self._send_frame(frame)

    def _charge_put_drops(self) -> None:
        for stream, dropped in list(self._put_dropped.items()):
            fresh = dropped - self._put_dropped_charged[stream]
            if fresh > 0:
                # Items refused one by one become the whole batches they would have
                # formed (rounded up): the aggregator counts batches, never items.
                self._put_dropped_charged[stream] = dropped
                self._count_dropped_batches(stream, _batches_for(fresh, self._max_items_per_batch))

    def _count_dropped_batches(self, stream: str, batches: int) -> None:
        self._dropped_batches += batches
        if stream in self._dropped_batches_by_stream:
            self._dropped_batches_by_stream[stream] += batches

    def _drop_pending(self) -> None:
        for stream, queue in self._streams:
            count = 0
            while queue:
                queue.popleft()
                count += 1
            if count:
                self._thread_dropped_items += count
                self._thread_dropped_by_stream[stream] += count
                self._count_dropped_batches(stream, _batches_for(count, self._max_items_per_batch))

    def _flush(self, stop_at: float | None) -> None:
        # Only what is pending now: a producer faster than the network cannot pin us here.
        for stream, queue in self._streams:
            remaining = len(queue)
            popleft = queue.popleft
            while remaining > 0:
                if self._sock is None or (stop_at is not None and monotonic() >= stop_at):
                    return
                take = min(remaining, self._max_items_per_batch)
                remaining -= take
                # One popleft per item (the training thread may append meanwhile);
                # starmap calls it from C.
                items = list(starmap(popleft, repeat((), take)))
                self._send_items(stream, items)

    def _send_items(self, stream: str, items: list[bytes]) -> None:
        # Frames of at most max_frame_bytes each; an item too big for any frame costs
        # only itself.
        envelope = self._envelopes[stream]
        empty = len(envelope[0]) + len(envelope[1])
        limit = self._max_frame_bytes
        if items and empty + sum(map(len, items)) + len(items) - 1 <= limit:
            # All in one frame (the usual case): what the loop below would send too.
            self._send_chunk(stream, envelope, items)
            return
        chunk: list[bytes] = []
        size = empty
        for data in items:
            if empty + len(data) > limit:
                self._drop_batch(stream, 1)
                continue
            grown = size + len(data) + (1 if chunk else 0)
            if grown > limit:
                self._send_chunk(stream, envelope, chunk)
                chunk = []
                grown = empty + len(data)
            chunk.append(data)
            size = grown
        if chunk:
            self._send_chunk(stream, envelope, chunk)

    def _send_chunk(self, stream: str, envelope: tuple[bytes, bytes], chunk: list[bytes]) -> None:
        if self._send_frame(encode_batch_frame(envelope, chunk)):
            self._sent_batches += 1
            self._sent_items += len(chunk)
        else:
            self._drop_batch(stream, len(chunk))

    def _drop_batch(self, stream: str, items: int) -> None:
        self._count_dropped_batches(stream, 1)
        self._thread_dropped_items += items
        self._thread_dropped_by_stream[stream] += items

    def _send_frame(self, frame: bytes) -> bool:
        # The socket is non-blocking (_connect): one send usually takes the whole frame,
        # in C without releasing the interpreter's lock (_NOWAIT), where sendall() with
        # a timeout released it two or three times per frame, each release a handoff
        # of the lock that costs this thread CPU and the training thread a forced
        # switch (docs/benchmarks.md).
        sock = self._sock
        if sock is None:
            return False
        if self._deadline is not None and self._deadline <= monotonic():
            return False
        try:
            if _NOWAIT is None:
                sent = sock.send(frame)
            else:
                sent = _NOWAIT.send_nowait(sock.fileno(), frame)
        except BlockingIOError:
            sent = 0
        except (OSError, ValueError):  # ValueError: a socket closed under us (fileno -1)
            self._disconnect()
            return False
        if sent < len(frame) and not self._send_rest(sock, memoryview(frame)[sent:]):
            # A timeout cut the frame short: the stream is unusable.
            self._disconnect()
            return False
        self._backoff_s = _INITIAL_BACKOFF_S
        return True

    def _send_rest(self, sock: socket.socket, rest: memoryview) -> bool:
        """Send what the kernel's buffer had no room for, waiting for room at most the
        send timeout (or until the deadline): whether all of it went."""
        until = monotonic() + self._send_timeout_s
        if self._deadline is not None:
            until = min(until, self._deadline)
        poller = select.poll()
        poller.register(sock, select.POLLOUT)
        while rest:
            left = until - monotonic()
            if left <= 0:
                return False
            try:
                if poller.poll(max(1, int(left * 1000))):
                    rest = rest[sock.send(rest) :]
            except BlockingIOError:
                continue
            except OSError:
                return False
        return True

    def _connect(self, timeout: float) -> None:
        if timeout <= 0:
            return
        try:
            sock = socket.create_connection(self._address, timeout=timeout)
        except OSError:
            self._schedule_retry()
            return
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            # Non-blocking from now on: _send_frame and _check_peer set no timeout.
            sock.setblocking(False)
        except OSError:
            sock.close()
            self._schedule_retry()
            return
        self._sock = sock

    def _check_peer(self) -> None:
        # The aggregator never writes, so a readable socket means it closed or reset:
        # reconnect now instead of losing the next batch into a dead connection.
        sock = self._sock
        if sock is None:
            return
        try:
            if _NOWAIT is None:
                sock.recv(1)  # non-blocking (_connect): data or EOF, the peer is gone
            elif not _NOWAIT.peer_gone(sock.fileno()):
                return
        except BlockingIOError:
            return
        except (OSError, ValueError):
            pass
        self._disconnect()

    def _disconnect(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        with contextlib.suppress(OSError):
            sock.close()
        self._schedule_retry()

    def _schedule_retry(self) -> None:
        self._retry_at = monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, _MAX_BACKOFF_S)
