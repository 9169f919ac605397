"""Aggregator side of the transport: an asyncio TCP server on an event loop running in a
daemon thread: its own by default, or a :class:`LoopRunner`'s shared by many servers of
one process (the relays of a ``bench.scale`` host).

One event loop holds every rank connection. Each frame is length-checked, stamped with
``observed_timestamp_unix_ns`` on receipt, decoded with ``decode_message`` (or, for our
senders' batches, only prefix-checked) and handed to a callback on the loop thread, so
callbacks must be quick and must not block (the export worker's ``submit`` fits). Bad
input is counted and never reaches the callbacks.

Connections are ``asyncio.Protocol`` objects that cut frames out of each chunk the
transport reads (one ``recv`` of at most 256 KiB), rather than a coroutine per
connection awaiting ``readexactly`` twice per frame: with a thousand ranks sending a
few frames a second each, the per-frame cost of that coroutine machinery would be a
large share of the aggregator's CPU. Each chunk is handled whole before the loop moves on,
so one busy rank cannot starve the others, and a connection holds at most one
partial frame plus one chunk.

Order per rank across reconnections: a sender whose send timed out (the aggregator
stalled) closes its connection and opens a new one, while the old one may still hold
megabytes in kernel buffers. Read side by side, the two would interleave that rank's
records out of order (``seq`` decreasing in the files). So a connection whose first
frame names a rank that an older open connection also carries is held (not read)
until every older connection of that rank has closed, or for at most ``HOLD_MAX_S``.

Hostile or broken peers (anything can connect to the port: scanners, HTTP clients,
half-open sockets, a rank of an earlier run) must never cost the real ranks their
records. A connection is *unproven* until its first frame was accepted. Its first bytes
are screened as they arrive: a length header within ``max_frame_bytes`` and not zero,
then the prefix our senders write (``wire.batch_prefix`` or the ``finished`` message's
prefix), so garbage is refused after a few bytes and an unproven connection never makes
the server buffer more than that prefix (about a hundred bytes) before its token was
checked. The token is compared only once all of it has arrived, in constant time, so
the server's reaction never tells which leading part of a guess was right. Any invalid
frame, on any connection, closes it (a stream with one bad frame cannot be trusted to
frame the next, and one peer must not make the loop decode frame after frame). Unproven
connections are bounded in number and in time (see the constants below), all
connections in number; what is refused is counted per reason in
``rejected_connections_by_reason``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

import orjson

from traceml_ai.transport import _cut_py
from traceml_ai.transport.wire import (
    BATCH_GLOBAL_RANK,
    BATCH_RANK_SPAN,
    BATCH_STREAM_TAILS,
    DEFAULT_MAX_FRAME_BYTES,
    FRAME_HEADER,
    FrameError,
    ReceivedBatch,
    batch_prefix,
    decode_message,
    known_stream_follows,
    make_finished_message,
    make_relay_message,
    make_tracker_runs_message,
)
from traceml_records.internal import load_extension

__all__ = [
    "AggregatorServer",
    "Connection",
    "LoopRunner",
    "connection_limits",
    "raise_file_limit",
]

_T = TypeVar("_T")

_HEADER_SIZE = FRAME_HEADER.size
# The one choice of the chunk cutter: _cut.c, or its pure-Python twin (the reference).
_CUT: Any = load_extension("traceml_ai.transport._cut")
_cut_batches: Callable[..., tuple[list[tuple[bytes, int, int]], int, int]] = (
    _CUT.cut_batches if _CUT is not None else _cut_py.cut_batches
)
_CUT_NEED_MORE = _cut_py.NEED_MORE
_unpack_header = FRAME_HEADER.unpack_from


HOLD_MAX_S = 10.0
"""Longest a newer connection of a rank waits for its older connections to close."""

# Limits for connections (see the module docstring). Module attributes, read when used,
# so tests can shrink them.

MIN_CONNECTIONS = 4096
"""The least limit on open connections; a connection beyond the limit is closed at once.

The limit itself comes from the job (:func:`connection_limits`): a server never caps a
job below its size."""

MIN_UNPROVEN_CONNECTIONS = 2048
"""The least limit on open connections that have not yet had a first frame accepted.

A new connection beyond the limit closes the oldest unproven one whose token was not
seen and that is older than ``UNPROVEN_MIN_AGE_S``; if there is none, the new one is
closed."""

FILE_RESERVE = 256
"""Descriptors of the process kept out of the connection limit: the export files, the
live views' sockets, the run folder's files."""

MAX_FILE_LIMIT = 1 << 20
"""The highest open-file limit a server asks for (one descriptor per connection)."""


def connection_limits(expected_connections: int | None) -> tuple[int, int]:
    """(open connections at most, unproven connections at most) for a server that
    expects ``expected_connections`` peers (a job's ranks, or its relays; None: unknown).

    Every rank may hold two connections for a moment (a new one while its old one
    drains after a send timeout), and all of them may connect at the same moment (each
    is unproven until its first frame is read, one loop turn later), with a quarter
    more for room. A job of unknown size gets the least limits; :meth:`AggregatorServer.start`
    raises them to what the process's open-file limit holds.
    """
    peers = max(0, expected_connections or 0)
    unproven = max(MIN_UNPROVEN_CONNECTIONS, peers + peers // 4)
    return max(MIN_CONNECTIONS, 2 * peers + unproven), unproven


def raise_file_limit(needed: int) -> tuple[int, int]:
    """Raise the process's soft open-file limit (RLIMIT_NOFILE) to ``needed`` when it is
    lower, as far as the hard limit allows; return (soft, hard) in force afterwards.
    Never raises (a platform without the limit gives ``(needed, needed)``)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return needed, needed
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        unlimited = resource.RLIM_INFINITY
        if soft != unlimited and soft < needed:
            target = needed if hard == unlimited else min(needed, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        return (
            needed if soft == unlimited else soft,
            max(needed, soft) if hard == unlimited else hard,
        )
    except (OSError, ValueError):
        return needed, needed


UNPROVEN_MIN_AGE_S = 1.0
"""An unproven connection younger than this is never closed to make room: a real rank's
first frame may be waiting in the kernel for the loop to read it, and closing the
connection then would lose a batch its sender counts as sent."""

FIRST_FRAME_TIMEOUT_S = 10.0
"""Time from a connection's first byte to its first complete frame.

Our sender writes a frame with one ``sendall`` under a 2 s timeout and drops the
connection when that fails, so a first frame still incomplete after 10 s is not ours
(or was given up); the peer is trickling bytes to hold the connection."""

IDLE_UNPROVEN_TIMEOUT_S = 60.0
"""Time a connection that has sent nothing at all may stay open.

Longer than the first-frame bound on purpose: a sender (ours connects only with a
batch to write, but other clients may connect first) must not be closed just as it
writes its first batch. Such a batch would be counted on the rank as sent; the
aggregator would still count it as dropped from the difference between the rank's
``sent_batches`` and :meth:`AggregatorServer.received_batches_by_rank`. Silent
connections cost only a descriptor, and their number is bounded by
the unproven-connection limit."""

SWEEP_INTERVAL_S = 0.5
"""How often the time bounds above are checked."""

LISTEN_BACKLOG = 2048
"""Pending connections the kernel queues for us: a flood of connections (or a large
job starting) must not fill the queue so that a real rank's connect times out."""


class LoopRunner:
    """An asyncio event loop running on its own daemon thread, for servers to share.

    A server given none makes its own (one thread per server, the default); many
    servers of one process (a host of relays, ``bench.scale --relays``) can share one
    runner, so that a thousand relays cost one thread and one loop rather than a
    thousand. :meth:`start` starts the thread (idempotent); :meth:`stop` stops the loop,
    cancels what still runs on it and joins the thread. The servers on it are stopped
    one by one with their own ``stop``, which leaves the loop running for the others.
    """

    def __init__(self, name: str = "traceml-loop") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop, once started."""
        return self._loop

    @property
    def thread(self) -> threading.Thread | None:
        """The thread running the loop, once started."""
        return self._thread

    def start(self) -> asyncio.AbstractEventLoop:
        """Start the loop's thread if it is not running; the loop. ``RuntimeError`` once
        stopped."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("LoopRunner cannot be restarted after stop()")
            if self._loop is not None:
                return self._loop
            loop = asyncio.new_event_loop()
            ready = threading.Event()
            thread = threading.Thread(
                target=self._run, args=(loop, ready), name=self._name, daemon=True
            )
            self._loop, self._thread = loop, thread
            thread.start()
            ready.wait()
            return loop

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        """Run ``coro`` on the loop and wait for its result (not from the loop's thread)."""
        loop = self.start()
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the loop and join its thread (within ``timeout``). Idempotent; from the
        loop's own thread it only asks the loop to stop."""
        with self._lock:
            self._stopped = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        # RuntimeError: the loop already closed.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.stop)
        if threading.current_thread() is not thread:
            thread.join(max(0.0, timeout))

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
        finally:
            ready.set()
            try:
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            except Exception:
                pass
            finally:
                loop.close()


class _PortGuard:
    """What guards the port: the first-frame check, the unproven connections, and the
    counts of connections refused.

    A first frame must start with ``head + token_json + tail``, ``tail`` being what our
    senders write after the token for a batch or for a finished message.

    One attribute of ``AggregatorServer`` rather than several: past 28 or so instance
    attributes, CPython stops sharing the instance dict's keys and every attribute
    access on the receive path gets slower (about 10% of the fast path, measured).
    """

    def __init__(self, token: str, max_frame_bytes: int, expected_connections: int | None) -> None:
        prefix = batch_prefix(token)
        token_json = orjson.dumps(token)
        head_end = prefix.index(token_json)
        token_end = head_end + len(token_json)
        tails = [prefix[token_end:]]
        for other, key in (
            (orjson.dumps(make_finished_message(token, {}, 0, 0)), b'"identity":'),
            (orjson.dumps(make_tracker_runs_message(token, {}, {})), b'"identity":'),
            (orjson.dumps(make_relay_message(token, "-", {})), b'"relay":'),
        ):
            if other[:token_end] != prefix[:token_end]:
                raise AssertionError("every message type must start alike")
            key_at = other.index(key, token_end)
            tails.append(other[token_end : key_at + len(key)])
        self.max_frame_bytes = max_frame_bytes
        self.head = prefix[:head_end]
        self.token_json = token_json
        self.token_end = token_end
        self.tails = tuple(tails)
        self.screen_bytes = token_end + max(len(tail) for tail in self.tails)
        # Unproven open connections, oldest first (a dict keeps insertion order).
        self.unproven: dict[Connection, None] = {}
        # Connections the server closed, per reason.
        self.rejected: dict[str, int] = {}
        # Batch frames accepted per global rank: from rank connections that have closed,
        # and every one a relay's connection carried.
        self.batches_by_rank: dict[int, int] = {}
        # Global ranks that opened a connection of their own (not a relay's).
        self.direct_ranks: set[int] = set()
        self.expected_connections = expected_connections
        self.max_connections, self.max_unproven = connection_limits(expected_connections)
        self.on_relay: Callable[[dict[str, Any]], None] | None = None

    def check(self, data: bytes) -> str | None:
        """Check the start of a connection's first frame (its bytes so far).

        Returns ``None`` while more bytes are needed, ``""`` once the prefix (token
        included) is right, else the reason to refuse. Only the public parts are
        compared as they arrive; the token waits until all of it is here.
        """
        if len(data) < _HEADER_SIZE:
            return None
        (length,) = _unpack_header(data, 0)
        if length > self.max_frame_bytes:
            return "oversized frame"
        if length == 0:
            return "empty frame"
        body = data[_HEADER_SIZE : _HEADER_SIZE + min(length, self.screen_bytes)]
        head = self.head
        if not head.startswith(body[: len(head)]):
            return "bad prefix"
        token_end = self.token_end
        # Says no more about the token than its length, which is not secret.
        if length < token_end:
            return "bad prefix"
        if len(body) < token_end:
            return None
        if not hmac.compare_digest(body[len(head) : token_end], self.token_json):
            return "wrong token"
        rest = body[token_end:]
        wait = False
        for tail in self.tails:
            if rest.startswith(tail):
                return ""
            if tail.startswith(rest) and length >= token_end + len(tail):
                wait = True
        return None if wait else "bad prefix"


class Connection(asyncio.Protocol):
    """One rank connection: frames are cut out of the received chunks as they complete."""

    def __init__(self, server: AggregatorServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        # Bytes of the frame in progress (header included), when a chunk ended inside one.
        self._pending = bytearray()
        self._refused = False
        # Whether the first frame's prefix (and so the token) checked out, and whether a
        # first frame was accepted (the connection left the unproven set).
        self._trusted = False
        self._proven = False
        self.accepted_at = time.monotonic()
        self.first_byte_at: float | None = None
        self.last_identity: dict[str, Any] | None = None
        self.order = server._next_order()
        # What its first accepted frame named (None before it, or if none): a global
        # rank, or ``"relay:<id>"`` for a relay's connection, which carries many ranks.
        self.rank: int | str | None = None
        # How each frame after the first is handled: a rank's own connection or a relay's.
        self.handle = server._frame
        self.relayed = False
        # Batch frames accepted on it, added to its rank's tally when it closes.
        self.batches = 0
        # While held behind an older connection of the same rank: the unread bytes.
        self._held: bytes | None = None
        self._held_rank: int | str = -1
        self._hold_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        server = self._server
        server._connections.add(self)
        server._connections_total += 1
        server._connections_open += 1
        reason = server._admit(self)
        if reason is not None:
            server._reject_connection(reason)
            self._refuse()
        else:
            server._gate.unproven[self] = None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        server = self._server
        pending = self._pending
        if not self._trusted:
            # Before the token was seen, only the first frame's prefix is kept.
            if self.first_byte_at is None:
                self.first_byte_at = time.monotonic()
            if pending:
                pending += data
                data = bytes(pending)
                pending.clear()
            verdict = server._gate.check(data)
            if verdict is None:
                pending += data  # shorter than the prefix: a hundred bytes at most
                return
            if verdict:
                self.refuse_frame(verdict)
                return
            self._trusted = True
        elif pending:
            pending += data
            if len(pending) < _HEADER_SIZE:
                return
            (length,) = _unpack_header(pending, 0)
            if length <= server._max_frame_bytes and len(pending) < _HEADER_SIZE + length:
                return  # still inside the frame: no copy until it is complete
            data = bytes(pending)
            pending.clear()
        try:
            self._frames(data, server, pending)
        finally:
            if server._received:
                server._hand_on()

    def _frames(self, data: bytes, server: AggregatorServer, pending: bytearray) -> None:
        """Handle the complete frames of ``data``; keep the rest in ``pending``."""
        size = len(data)
        pos = 0
        observed = time.time_ns()
        while size - pos >= _HEADER_SIZE:
            if self.relayed:
                # A relay's frames, many a chunk: the plain batches in one call; the
                # frame it stops at (any other message, an invalid frame) goes below.
                batches, pos, status = _cut_batches(
                    data, pos, server._batch_prefix, BATCH_STREAM_TAILS, server._max_frame_bytes
                )
                if batches:
                    server._take_relayed(batches, observed)
                if status == _CUT_NEED_MORE:
                    break
            (length,) = _unpack_header(data, pos)
            if length > server._max_frame_bytes:
                # Its length header cannot be trusted to find the next frame.
                self.refuse_frame("oversized frame")
                return
            end = pos + _HEADER_SIZE + length
            if end > size:
                break
            body = data[pos + _HEADER_SIZE : end]
            if self.rank is None:
                if self._first_frames(body, data, pos, observed):
                    return
            else:
                # The fast path: no per-frame check beyond _frame's (a try costs nothing
                # until it raises).
                try:
                    self.handle(self, body, length, observed)
                except FrameError as exc:
                    self.refuse_frame(exc.reason)
                    return
            pos = end
            if server._stopped:
                return
        if pos < size:
            pending += memoryview(data)[pos:]

    def _first_frames(self, body: bytes, data: bytes, pos: int, observed: int) -> bool:
        """A frame while no rank is known (the first frames); True to stop reading."""
        server = self._server
        rank = server._rank_of(body)
        if rank is not None:
            # _rank_of found a valid frame: our senders' batch prefix or a whole valid
            # message, so the connection has proved itself.
            self._prove()
            if server._must_wait(self, rank):
                self._hold(rank, data[pos:])
                return True
            server._register(self, rank)
            if type(rank) is str:
                self.handle = server._relayed_frame
                self.relayed = True
        try:
            server._frame(self, body, len(body), observed)
        except FrameError as exc:
            self.refuse_frame(exc.reason)
            return True
        if not self._proven:
            self._prove()
        return False

    def _hold(self, rank: int | str, data: bytes) -> None:
        """Stop reading until the older connections of ``rank`` are gone (bounded)."""
        self._held = data
        self._held_rank = rank
        self._server._held.setdefault(rank, []).append(self)
        self._server._held_connections += 1
        if self._transport is not None:
            self._transport.pause_reading()
        self._hold_timer = asyncio.get_running_loop().call_later(HOLD_MAX_S, self.release)

    def release(self) -> None:
        """Read again: the held bytes first, then the socket."""
        data = self._held
        if data is None:
            return
        self._held = None
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        server = self._server
        waiting = server._held.get(self._held_rank, [])
        if self in waiting:
            waiting.remove(self)
        server._register(self, self._held_rank)
        if type(self._held_rank) is str:
            self.handle = server._relayed_frame
            self.relayed = True
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.resume_reading()
            self.data_received(data)

    def _prove(self) -> None:
        self._proven = True
        self._trusted = True
        self._server._gate.unproven.pop(self, None)

    def refuse_frame(self, reason: str) -> None:
        """Count an invalid frame and close the connection it came on."""
        self._server._reject(reason)
        self._server._reject_connection(reason)
        self._refuse()

    def refuse(self, reason: str) -> None:
        """Close the connection for a reason other than a frame (a limit); count it."""
        self._server._reject_connection(reason)
        self._refuse()

    def _refuse(self) -> None:
        self._refused = True
        self._pending.clear()
        self._server._gate.unproven.pop(self, None)
        self.close()

    @property
    def evictable(self) -> bool:
        """Unproven, its token never seen, and old enough to be closed to make room."""
        return not self._trusted and time.monotonic() - self.accepted_at >= UNPROVEN_MIN_AGE_S

    def eof_received(self) -> bool | None:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        server = self._server
        if self._pending and not self._refused:
            server._reject("truncated frame")
        self._pending.clear()
        if self._held is not None:
            # Closed while held (the server stops): what it held was never read.
            self._held = None
            if self._hold_timer is not None:
                self._hold_timer.cancel()
            waiting = server._held.get(self._held_rank, [])
            if self in waiting:
                waiting.remove(self)
        server._connections.discard(self)
        server._gate.unproven.pop(self, None)
        server._connections_open -= 1
        if self.rank is not None:
            if self.batches and type(self.rank) is int:
                tally = server._gate.batches_by_rank
                tally[self.rank] = tally.get(self.rank, 0) + self.batches
                self.batches = 0
            server._unregister(self, self.rank)
        if server._on_connection_lost is not None:
            server._call(server._on_connection_lost, self.last_identity)


class AggregatorServer:
    """Receive rank frames over TCP and hand valid messages to callbacks.

    ``on_batch`` gets a ``ReceivedBatch`` for each valid ``batch`` frame; with
    ``on_batches``, that gets instead the batches of each read of a connection together,
    in order, before any other message of the read is handled. ``on_finished``
    gets the whole decoded ``finished`` message (``identity``, ``sent_batches``,
    ``dropped_batches``). ``on_tracker_runs`` gets each valid ``tracker_runs`` message
    (the tracker runs a rank's script has open). ``on_connection_lost`` gets the
    identity of the last decoded batch or ``finished`` message a closed connection
    carried, or ``None`` if it carried none (our senders' batches are passed on still
    encoded, so usually only ``finished`` counts). All callbacks run
    on the server's event-loop thread; an exception in one is counted in
    ``callback_errors`` and the connection goes on.

    Every invalid frame is counted under its reason (``rejected_by_reason``) and
    closes its connection: a frame longer than ``max_frame_bytes`` (``"oversized
    frame"``), a bad envelope (its ``FrameError`` reason), and for a connection's first
    frame an empty one (``"empty frame"``), a prefix that is not our senders'
    (``"bad prefix"``) or another token (``"wrong token"``), refused as soon as its first
    bytes show it. Connections the server closes are counted per reason in
    ``rejected_connections_by_reason``: those frame reasons, plus ``"first frame
    timeout"``, ``"idle timeout"``, ``"too many unproven connections"`` and ``"too many
    connections"`` (see the limits above). A connection that ends inside a frame counts
    a ``"truncated frame"`` (the peer closed it, so no connection is counted).
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        on_batch: Callable[[ReceivedBatch], None],
        on_finished: Callable[[dict[str, Any]], None],
        *,
        on_batches: Callable[[list[ReceivedBatch]], None] | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        on_connection_lost: Callable[[dict[str, Any] | None], None] | None = None,
        on_tracker_runs: Callable[[dict[str, Any]], None] | None = None,
        on_relay: Callable[[dict[str, Any]], None] | None = None,
        expected_connections: int | None = None,
        max_connections: int | None = None,
        max_unproven_connections: int | None = None,
        loop_runner: LoopRunner | None = None,
    ) -> None:
        self._host = host
        self._port = port
        self._token = token
        self._on_batch = on_batch
        self._on_batches = on_batches
        # The batches of the chunk being read, handed on together when it is done (or
        # before any other message of it, so that order holds). Loop thread only.
        self._received: list[ReceivedBatch] = []
        self._on_finished = on_finished
        self._on_connection_lost = on_connection_lost
        self._on_tracker_runs = on_tracker_runs
        self._max_frame_bytes = max_frame_bytes
        self._batch_prefix = batch_prefix(token)
        self._gate = _PortGuard(token, max_frame_bytes, expected_connections)
        self._gate.on_relay = on_relay
        if max_connections is not None or max_unproven_connections is not None:
            # Limits given outright (tests, a relay told its node's size) are kept as given.
            self._gate.expected_connections = self._gate.max_connections
            if max_connections is not None:
                self._gate.max_connections = max_connections
                self._gate.expected_connections = max_connections
            if max_unproven_connections is not None:
                self._gate.max_unproven = max_unproven_connections

        self._lifecycle_lock = threading.Lock()
        # Whether the runner is this server's own (stopped with it) or shared.
        self._own_runner = loop_runner is None
        self._runner = (
            loop_runner if loop_runner is not None else LoopRunner("traceml-aggregator-server")
        )
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._address: tuple[str, int] | None = None
        self._stopped = False
        self._connections: set[Connection] = set()
        # Per global rank: open connections that carried it, and connections held
        # behind them (see the module docstring). Loop thread only.
        self._by_rank: dict[int | str, set[Connection]] = {}
        self._held: dict[int | str, list[Connection]] = {}
        self._orders = 0
        self._held_connections = 0

        # Written on the loop thread only.
        self._accepted_batches = 0
        self._relayed_ranks: set[int] = set()
        self._finished_messages = 0
        self._rejected_frames = 0
        self._rejected_by_reason: dict[str, int] = {}
        self._callback_errors = 0
        self._connections_total = 0
        self._connections_open = 0

    # ---- counters ----------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int] | None:
        """The bound ``(host, port)`` once started."""
        return self._address

    @property
    def accepted_batches(self) -> int:
        """Valid ``batch`` frames handed to ``on_batch``."""
        return self._accepted_batches

    @property
    def relayed_ranks(self) -> frozenset[int]:
        """Ranks whose batches came through a relay's connection."""
        return frozenset(self._relayed_ranks)

    @property
    def direct_ranks(self) -> frozenset[int]:
        """Ranks that opened a connection of their own (a first frame was accepted)."""
        return frozenset(self._gate.direct_ranks)

    @property
    def finished_messages(self) -> int:
        """Valid ``finished`` frames handed to ``on_finished``."""
        return self._finished_messages

    @property
    def rejected_frames(self) -> int:
        """Frames refused for any reason."""
        return self._rejected_frames

    @property
    def rejected_by_reason(self) -> dict[str, int]:
        """A copy of the rejected-frame counts per reason."""
        return dict(self._rejected_by_reason)

    @property
    def rejected_connections(self) -> int:
        """Connections the server closed: an invalid frame, a time bound or a limit."""
        return sum(self._gate.rejected.values())

    @property
    def rejected_connections_by_reason(self) -> dict[str, int]:
        """A copy of the rejected-connection counts per reason."""
        return dict(self._gate.rejected)

    @property
    def callback_errors(self) -> int:
        """Exceptions raised by the callbacks."""
        return self._callback_errors

    @property
    def connections_total(self) -> int:
        """Connections accepted since start."""
        return self._connections_total

    def received_batches_by_rank(self) -> dict[int, int]:
        """Batch frames accepted per global rank, over all of its connections.

        Exact once the server has stopped (every connection is then closed); while it
        runs, a snapshot. Compared with the ``sent_batches`` a rank reports, it shows
        batches a rank wrote that never arrived.
        """
        tally = dict(self._gate.batches_by_rank)
        for connection in list(self._connections):
            rank = connection.rank
            if type(rank) is int and connection.batches:
                tally[rank] = tally.get(rank, 0) + connection.batches
        return tally

    @property
    def held_connections(self) -> int:
        """Connections held back behind an older open connection of the same rank."""
        return self._held_connections

    @property
    def connections_open(self) -> int:
        """Connections open now."""
        return self._connections_open

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> tuple[str, int]:
        """Bind and start serving; return the bound address. Raises ``OSError`` if bind fails.

        Serves on the loop runner it was given (not to be called from that runner's
        thread), else on a thread of its own."""
        with self._lifecycle_lock:
            if self._address is not None:
                return self._address
            if self._stopped:
                raise RuntimeError("AggregatorServer cannot be restarted after stop()")
            self._fit_file_limit()
            runner = self._runner
            self._loop = runner.start()
            self._thread = runner.thread
            try:
                self._address = runner.run(self._open())
            except BaseException:
                if self._own_runner:
                    # A start that failed (the port taken) may be tried again.
                    runner.stop()
                    self._runner = LoopRunner(runner._name)
                    self._loop = self._thread = None
                raise
            return self._address

    def stop(self, timeout: float = 2.0) -> None:
        """Close the listener and every connection, then (its own runner) stop the loop
        and join its thread; a shared runner's loop goes on for its other servers.
        Idempotent.

        Called from a callback (the loop thread itself), it schedules the shutdown and
        returns at once, since waiting there would wait on itself.
        """
        with self._lifecycle_lock:
            if self._stopped:
                return
            self._stopped = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        runner = self._runner
        if threading.current_thread() is thread:
            task = loop.create_task(self._shutdown())
            if self._own_runner:
                task.add_done_callback(lambda _: runner.stop())
            return
        deadline = time.monotonic() + max(0.0, timeout)
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(max(0.0, timeout))
        if self._own_runner:
            runner.stop(max(0.1, deadline - time.monotonic()))

    @property
    def max_connections(self) -> int:
        """Open connections at most (from the job's size and the open-file limit)."""
        return self._gate.max_connections

    @property
    def max_unproven_connections(self) -> int:
        """Open connections without an accepted first frame, at most."""
        return self._gate.max_unproven

    def _fit_file_limit(self) -> None:
        """Raise the open-file limit to hold the connection limit (one descriptor each,
        plus ``FILE_RESERVE``); where the hard limit is lower, hold what it allows and
        say so in one line. A job of unknown size takes all the hard limit allows."""
        gate = self._gate
        expected = gate.expected_connections
        wanted = gate.max_connections + FILE_RESERVE
        soft, hard = raise_file_limit(wanted if expected else max(wanted, MAX_FILE_LIMIT))
        room = soft - FILE_RESERVE
        if expected is None:
            gate.max_connections = max(gate.max_connections, room)
            gate.max_unproven = max(gate.max_unproven, gate.max_connections // 4)
            return
        if room >= gate.max_connections:
            return
        gate.max_connections = max(room, 1)
        gate.max_unproven = min(gate.max_unproven, gate.max_connections)
        with contextlib.suppress(Exception):
            print(
                f"traceml: the open-file limit (soft {soft}, hard {hard}) holds "
                f"{gate.max_connections} connections, fewer than the {wanted - FILE_RESERVE} "
                "this job's ranks may open: raise it (ulimit -n) or send through relays",
                file=sys.stderr,
                flush=True,
            )

    async def _open(self) -> tuple[str, int]:
        """Bind the listener on the running loop and start the sweep; the bound address."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: Connection(self), self._host, self._port, backlog=LISTEN_BACKLOG
        )
        self._server = server
        sockname = server.sockets[0].getsockname()
        loop.call_later(SWEEP_INTERVAL_S, self._sweep)
        return str(sockname[0]), int(sockname[1])

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close()
        # Closed transports report connection_lost on the next loop iterations.
        for _ in range(3):
            if not self._connections:
                break
            await asyncio.sleep(0)

    # ---- connections -------------------------------------------------------------------

    def _frame(self, connection: Connection, body: bytes, length: int, observed: int) -> None:
        """Handle one complete frame body (on the loop thread); raise ``FrameError`` if invalid."""
        if body.startswith(self._batch_prefix) and known_stream_follows(
            body, len(self._batch_prefix)
        ):
            # Our senders' batches: right version, token and type. They are queued
            # still encoded and parsed by the export worker, off this loop (its parse
            # checks the rest of the envelope).
            self._accepted_batches += 1
            connection.batches += 1
            self._received.append(ReceivedBatch(observed, body, length))
            return
        message = decode_message(body, self._token)
        if message["type"] != "batch" and self._received:
            self._hand_on()
        if message["type"] == "tracker_runs":
            # Not a batch nor a goodbye: it says nothing of how the connection ends.
            if self._on_tracker_runs is not None:
                self._call(self._on_tracker_runs, message)
            return
        if message["type"] == "relay":
            self._relay_report(message)
            return
        connection.last_identity = message["identity"]
        if message["type"] == "batch":
            self._accepted_batches += 1
            connection.batches += 1
            self._received.append(ReceivedBatch(observed, message, length))
        else:
            self._finished_messages += 1
            self._call(self._on_finished, message)

    def _relayed_frame(
        self, connection: Connection, body: bytes, length: int, observed: int
    ) -> None:
        """Handle one frame of a relay's connection, which carries the frames of many
        ranks as they sent them; raise ``FrameError`` if invalid.

        As :meth:`_frame`, and each batch is tallied under the rank its identity names
        (the connection has no one rank)."""
        rank, message = self._read_frame(body)
        if rank is not None:
            self._accepted_batches += 1
            self._relayed_ranks.add(rank)
            tally = self._gate.batches_by_rank
            tally[rank] = tally.get(rank, 0) + 1
            item = body if message is None else message
            self._received.append(ReceivedBatch(observed, item, length))
            return
        assert message is not None
        if self._received:
            self._hand_on()
        kind = message["type"]
        if kind == "finished":
            self._finished_messages += 1
            self._call(self._on_finished, message)
        elif kind == "tracker_runs":
            if self._on_tracker_runs is not None:
                self._call(self._on_tracker_runs, message)
        else:
            self._relay_report(message)

    def _take_relayed(self, batches: list[tuple[bytes, int, int]], observed: int) -> None:
        """The plain batches a relay's chunk held (``_cut_batches``'s): each tallied
        under the rank its identity names, as :meth:`_relayed_frame` does."""
        received = self._received
        relayed = self._relayed_ranks
        tally = self._gate.batches_by_rank
        for body, length, rank in batches:
            relayed.add(rank)
            tally[rank] = tally.get(rank, 0) + 1
            received.append(ReceivedBatch(observed, body, length))
        self._accepted_batches += len(batches)

    def _hand_on(self) -> None:
        """Hand the batches received so far to ``on_batches`` (all at once) or
        ``on_batch`` (one by one), in the order they came."""
        batches = self._received
        self._received = []
        if self._on_batches is not None:
            self._call(self._on_batches, batches)
            return
        for batch in batches:
            self._call(self._on_batch, batch)

    def _relay_report(self, message: dict[str, Any]) -> None:
        """A relay's ``relay`` message: what it dropped, per rank (the callback's)."""
        on_relay = self._gate.on_relay
        if on_relay is not None:
            self._call(on_relay, message)

    def _admit(self, connection: Connection) -> str | None:
        """Make room for a new connection; the reason to refuse it if there is none."""
        gate = self._gate
        if self._connections_open > gate.max_connections:
            return "too many connections"
        unproven = gate.unproven
        if len(unproven) < gate.max_unproven:
            return None
        # The oldest first: it has had the longest to prove itself.
        for candidate in unproven:
            if candidate.evictable:
                candidate.refuse("too many unproven connections")
                return None
            if not candidate._trusted:
                break  # every later one is younger
        return "too many unproven connections"

    def _sweep(self) -> None:
        """Close unproven connections past their time bound; runs every SWEEP_INTERVAL_S."""
        if self._stopped or self._loop is None:
            return
        now = time.monotonic()
        for connection in list(self._gate.unproven):
            started = connection.first_byte_at
            if started is not None:
                if now - started > FIRST_FRAME_TIMEOUT_S:
                    connection.refuse("first frame timeout")
            elif now - connection.accepted_at > IDLE_UNPROVEN_TIMEOUT_S:
                connection.refuse("idle timeout")
        self._loop.call_later(SWEEP_INTERVAL_S, self._sweep)

    def _next_order(self) -> int:
        self._orders += 1
        return self._orders

    def _read_frame(self, body: bytes) -> tuple[int | None, dict[str, Any] | None]:
        """What a frame of a relay's connection is: ``(rank, None)`` for a batch in our
        senders' plain form (left encoded), ``(rank, message)`` for a batch written
        otherwise, ``(None, message)`` for any other message; ``FrameError`` when it is
        not a valid frame (a batch without a rank among them)."""
        if body.startswith(self._batch_prefix) and known_stream_follows(
            body, len(self._batch_prefix)
        ):
            match = BATCH_GLOBAL_RANK.search(body, 0, BATCH_RANK_SPAN)
            if match is None:
                raise FrameError("missing identity")
            return int(match.group(1)), None
        message = decode_message(body, self._token)
        if message["type"] != "batch":
            return None, message
        rank = message["identity"].get("global_rank")
        if type(rank) is not int or rank < 0:
            raise FrameError("missing identity")
        return rank, message

    def _rank_of(self, body: bytes) -> int | str | None:
        """The global rank a valid frame's identity names, or ``"relay:<id>"`` for a
        relay's ``relay`` message (first frames only)."""
        if body.startswith(self._batch_prefix) and known_stream_follows(
            body, len(self._batch_prefix)
        ):
            match = BATCH_GLOBAL_RANK.search(body, 0, BATCH_RANK_SPAN)
            return int(match.group(1)) if match else None
        try:
            message = decode_message(body, self._token)
        except FrameError:
            return None
        if message["type"] == "relay":
            return f"relay:{message['relay']}"
        rank = message["identity"].get("global_rank")
        return rank if type(rank) is int and rank >= 0 else None

    def _must_wait(self, connection: Connection, rank: int | str) -> bool:
        order = connection.order
        return any(c.order < order for c in self._by_rank.get(rank, ())) or any(
            c.order < order for c in self._held.get(rank, ())
        )

    def _register(self, connection: Connection, rank: int | str) -> None:
        connection.rank = rank
        if type(rank) is int:
            self._gate.direct_ranks.add(rank)
        self._by_rank.setdefault(rank, set()).add(connection)

    def _unregister(self, connection: Connection, rank: int | str) -> None:
        carriers = self._by_rank.get(rank)
        if carriers is not None:
            carriers.discard(connection)
            if not carriers:
                del self._by_rank[rank]
        for waiting in sorted(self._held.get(rank, ()), key=lambda c: c.order):
            if not self._must_wait(waiting, rank):
                waiting.release()
        if not self._held.get(rank, True):
            del self._held[rank]

    def _reject(self, reason: str) -> None:
        self._rejected_frames += 1
        self._rejected_by_reason[reason] = self._rejected_by_reason.get(reason, 0) + 1

    def _reject_connection(self, reason: str) -> None:
        by_reason = self._gate.rejected
        by_reason[reason] = by_reason.get(reason, 0) + 1

    def _call(self, callback: Callable[[_T], None], argument: _T) -> None:
        try:
            callback(argument)
        except Exception:
            self._callback_errors += 1
