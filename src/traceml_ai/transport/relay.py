"""A relay: the ranks of one node send to it, and it forwards their frames, as they are,
over one connection to the job's aggregator (or to the next relay of a chain).

Its receiving side is the aggregator's own server (``AggregatorServer``: the same
first-frame screening, token check, unproven-connection bounds and per-rank order
across reconnections), whose frames are queued still encoded instead of handed to an
export. Its sending side runs on the same event loop: one non-blocking connection,
written with ``sendmsg`` of as many queued frames as the kernel takes, never a copy
of a frame beyond the one that joins its length header to its body.

Every connection it opens starts with a ``relay`` message (docs/dev/wire-format.md)
that names the relay, carries what it dropped so far, per rank and stream, and the
ranks it is there for when it was told them (a node's, from ``traceml run``); it is
sent again whenever what it dropped grows (and before a rank's ``finished`` goes on).
The aggregator tallies a relay connection's batches per rank from their identities, so
that the ranks' ``sent_batches`` still tell it what never arrived, and counts the
relay's drops of selected streams as dropped batches (docs/live-export.md: "When
something was lost").

What it keeps and what it drops:

- A frame is forwarded once the kernel took all of it. A connection lost with a frame
  half written sends that frame again, whole, on the next connection (the aggregator
  never accepts a frame cut short, so nothing arrives twice); frames the kernel had
  taken on a lost connection may be lost unseen, and the ranks' counts reveal them.
- While the aggregator cannot be reached or is slow, frames wait, up to
  ``max_pending_bytes``; a batch beyond it is dropped (the newest, so what arrives of
  a rank stays a contiguous prefix) and counted. ``finished``, ``tracker_runs`` and
  ``relay`` messages wait up to twice the bound, since a rank's ``finished`` carries
  its own counts.
- :meth:`Relay.stop` forwards what is pending within its timeout and drops the rest,
  counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import islice
from typing import Any

import attrs

from traceml_ai.transport.server import AggregatorServer, Connection, LoopRunner
from traceml_ai.transport.wire import (
    BATCH_GLOBAL_RANK,
    BATCH_RANK_SPAN,
    DEFAULT_MAX_FRAME_BYTES,
    FRAME_HEADER,
    FrameError,
    batch_prefix,
    encode_frame,
    make_relay_message,
    peek_batch_stream,
)

__all__ = ["Relay", "RelayStats", "new_relay_id"]

DEFAULT_MAX_PENDING_BYTES = 64 * 1024 * 1024
"""Bytes of frames a relay holds for the aggregator at most (batches beyond are dropped)."""

_INITIAL_BACKOFF_S = 0.1
# The aggregator closing this many connections in a row, each within _QUICK_CLOSE_S of
# its opening, is said once as a refusal; the closes before it say nothing (each would be
# a lost-and-back pair of lines about one refusal).
_QUICK_CLOSES_TOLD = 3
_QUICK_CLOSE_S = 1.0
_MAX_BACKOFF_S = 2.0
# Buffers handed to one sendmsg (IOV_MAX is 1024 on Linux).
_SENDMSG_BATCH = 512
# Time stop() waits for the ranks' connections to close (their last frames read).
_RANKS_GRACE_S = 2.0
# Time stop() gives a connection to take the final relay message after its deadline.
_FINAL_GRACE_S = 0.5


def new_relay_id() -> str:
    """A relay id: this host's name and a random suffix (unique per relay process)."""
    host = socket.gethostname()[:64] or "relay"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


@attrs.frozen(kw_only=True)
class RelayStats:
    """What a relay did: frames forwarded, batches it dropped (per rank and stream)."""

    relay_id: str
    forwarded_frames: int
    dropped_batches: int
    dropped_by_rank: dict[int, dict[str, int]]
    dropped_messages: int
    """``finished``/``tracker_runs``/``relay`` messages dropped (twice the bound full, or
    pending at the stop's deadline)."""
    upstream_connections: int
    """Connections it opened to the aggregator (more than one: it reconnected)."""
    pending_frames: int
    refused_frames: int = 0
    """Frames the kernel took on connections the aggregator closed as soon as they
    opened (another run's token, most often): sent, but not forwarded (the aggregator
    refuses such a connection's frames), so not in ``forwarded_frames``."""


class _Intake(AggregatorServer):
    """The relay's receiving side: the aggregator's server, whose valid frames are
    queued for the upstream connection still encoded."""

    def __init__(self, relay: Relay, host: str, port: int, token: str, **kwargs: Any) -> None:
        super().__init__(host, port, token, _ignore, _ignore, **kwargs)
        self._relay = relay

    def _frame(self, connection: Connection, body: bytes, length: int, observed: int) -> None:
        # What the aggregator checks of a relay connection's frames is checked here too:
        # a frame it would refuse would close the connection of every rank of the node.
        rank, message = self._read_frame(body)
        if rank is not None:
            self._accepted_batches += 1
            self._relay._put_batch(FRAME_HEADER.pack(length) + body)
            return
        assert message is not None
        kind = message["type"]
        if kind == "finished":
            self._finished_messages += 1
        elif kind == "relay" and message.get("relay") == self._relay.relay_id:
            # Its own connection came back to it: the upstream address leads here. Every
            # frame would go round forever and none would reach the aggregator.
            self._relay._looped()
            raise FrameError("relay loop")
        self._relay._put_message(FRAME_HEADER.pack(length) + body)

    # A relay below this one: its frames are forwarded all the same.
    _relayed_frame = _frame

    def _take_relayed(self, batches: list[tuple[bytes, int, int]], observed: int) -> None:
        # The plain batches of a relay below this one, cut out of its chunk together.
        put = self._relay._put_batch
        for body, length, _ in batches:
            put(FRAME_HEADER.pack(length) + body)
        self._accepted_batches += len(batches)


def _ignore(_: Any) -> None:
    return None


class Relay:
    """Forward the frames of the ranks that connect to ``host:port`` over one connection
    to ``upstream`` (the aggregator, or another relay), with the run ``token``.

    :meth:`start` listens (the bound address is returned) and connects upstream in the
    background, reconnecting with backoff whenever the connection is lost; nothing a
    rank or the aggregator does can make it raise. :meth:`stop` forwards what is
    pending within its timeout and returns :class:`RelayStats`.
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        token: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        relay_id: str | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        connect_timeout_s: float = 1.0,
        report_interval_s: float = 0.5,
        expected_connections: int | None = None,
        ranks: range | None = None,
        on_event: Callable[[str], None] | None = None,
        loop_runner: LoopRunner | None = None,
    ) -> None:
        """``ranks``: the global ranks it is there for, told the aggregator on every
        connection, so that a rank whose frames never passed (the relay died first) is
        still known to be behind it (None: unknown; ``ValueError`` if not a nonempty
        run). ``on_event`` gets a line for each change of the upstream connection worth
        telling (lost, back); it is called on the relay's loop thread. ``loop_runner``:
        the loop to run on, shared with other relays of the process (default: a thread
        and loop of its own)."""
        if max_pending_bytes < 1 or connect_timeout_s <= 0 or report_interval_s <= 0:
            raise ValueError("bounds and timeouts must be positive")
        self.relay_id = relay_id or new_relay_id()
        self._ranks = ranks
        # Refused here rather than on the loop thread, at each connection.
        make_relay_message(token, self.relay_id, {}, ranks)
        self._upstream = (upstream[0], int(upstream[1]))
        self._token = token
        self._max_pending_bytes = max_pending_bytes
        self._connect_timeout_s = connect_timeout_s
        self._report_interval_s = report_interval_s
        self._on_event = on_event
        self._batch_head = FRAME_HEADER.size + len(batch_prefix(token))
        self._intake = _Intake(
            self,
            host,
            port,
            token,
            max_frame_bytes=max_frame_bytes,
            expected_connections=expected_connections,
            loop_runner=loop_runner,
        )
        # Loop thread only from start() on.
        self._queue: deque[bytes] = deque()
        self._queued_bytes = 0
        self._head_sent = 0  # bytes of _queue[0] the kernel already took
        self._sock: socket.socket | None = None
        self._connecting = False
        self._writing = False
        self._pump_soon = False
        self._backoff_s = _INITIAL_BACKOFF_S
        self._retry: asyncio.TimerHandle | None = None
        self._report_due: asyncio.TimerHandle | None = None
        self._report_dirty = False
        self._stopping = False
        self._closed = False  # stop() closed the upstream side: no connection after it
        self._loop_found = False  # the upstream address leads back to this relay
        self._flushed: asyncio.Event | None = None
        self._was_connected = False
        self._said_unreachable = False
        # A line said the upstream was unreachable or lost: its coming back is said too.
        self._said_down = False
        # Why the connection was lost while nothing waited; said once a frame waits.
        self._untold_loss: str | None = None
        self._connected_at = 0.0
        self._sent_on_connection = 0  # frames the kernel took on the current connection
        self._refused = 0
        self._quick_closes = 0  # connections in a row the aggregator closed at once
        self._dropped: dict[int, dict[str, int]] = {}
        self._dropped_batches = 0
        self._dropped_messages = 0
        self._forwarded = 0
        self._connections = 0
        self._lock = threading.Lock()
        self._stats: RelayStats | None = None

    # ---- lifecycle ---------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int] | None:
        """Where ranks connect, once started."""
        return self._intake.address

    @property
    def intake(self) -> AggregatorServer:
        """The receiving side (its counters: connections, rejected frames)."""
        return self._intake

    def start(self) -> tuple[str, int]:
        """Listen for ranks and connect upstream; the bound address. ``OSError`` if the
        address cannot be bound."""
        address = self._intake.start()
        loop = self._intake._loop
        assert loop is not None
        loop.call_soon_threadsafe(self._connect_soon)
        return address

    def stop(self, timeout: float = 5.0) -> RelayStats:
        """Stop taking ranks, forward what is pending within ``timeout`` seconds, count
        what is left as dropped, close. Idempotent; never raises."""
        with self._lock:
            if self._stats is not None:
                return self._stats
            deadline = time.monotonic() + max(0.0, timeout)
            loop = self._intake._loop
            if loop is not None and loop.is_running():
                # The ranks' last frames may still be unread in the kernel: read them
                # while their connections close (they have usually exited by now).
                until = min(deadline, time.monotonic() + _RANKS_GRACE_S)
                while self._intake.connections_open and time.monotonic() < until:
                    time.sleep(0.02)
                future = asyncio.run_coroutine_threadsafe(self._drain(deadline), loop)
                try:
                    future.result(max(0.1, deadline - time.monotonic() + 2 * _FINAL_GRACE_S))
                except Exception:
                    future.cancel()
                # On the loop: a loop shared with other relays goes on, and must not keep
                # this relay's socket or timers.
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(self._close_on_loop(), loop).result(1.0)
            self._intake.stop()
            self._close_upstream()
            self._stats = self.stats()
            return self._stats

    def stats(self) -> RelayStats:
        """A snapshot of the counters (exact after :meth:`stop`)."""
        return RelayStats(
            relay_id=self.relay_id,
            forwarded_frames=self._forwarded,
            dropped_batches=self._dropped_batches,
            dropped_by_rank={rank: dict(c) for rank, c in list(self._dropped.items())},
            dropped_messages=self._dropped_messages,
            upstream_connections=self._connections,
            pending_frames=len(self._queue),
            refused_frames=self._refused,
        )

    @property
    def loop_found(self) -> bool:
        """Whether its upstream address led back to itself (it then forwards nothing)."""
        return self._loop_found

    @property
    def connected(self) -> bool:
        """Whether it holds a connection upstream now."""
        return self._sock is not None

    # ---- frames in (loop thread) -------------------------------------------------------

    def _put_batch(self, frame: bytes) -> None:
        if self._stopping or self._queued_bytes + len(frame) > self._max_pending_bytes:
            self._drop_batch(frame)
            return
        self._enqueue(frame)

    def _put_message(self, frame: bytes) -> None:
        if self._report_dirty:
            # What the relay dropped of a rank goes before that rank's goodbye.
            self._queue_report()
        if self._queued_bytes + len(frame) > 2 * self._max_pending_bytes:
            self._dropped_messages += 1
            return
        self._enqueue(frame)

    def _enqueue(self, frame: bytes) -> None:
        self._queue.append(frame)
        self._queued_bytes += len(frame)
        if (
            self._sock is None
            and self._untold_loss is not None
            and not self._quick_closes
            and not self._stopping
        ):
            self._say_lost(self._untold_loss)
        if self._sock is not None:
            if not self._pump_soon and not self._writing:
                # Once per loop turn: the frames of one received chunk go in one sendmsg.
                self._pump_soon = True
                asyncio.get_running_loop().call_soon(self._pump)
        elif not self._connecting and self._retry is None:
            self._connect_soon()

    def _drop_batch(self, frame: bytes) -> None:
        """Count a batch frame (header included) the relay will not forward."""
        self._dropped_batches += 1
        match = BATCH_GLOBAL_RANK.search(
            frame, FRAME_HEADER.size, self._batch_head + BATCH_RANK_SPAN
        )
        stream = peek_batch_stream(frame[FRAME_HEADER.size : self._batch_head + 64])
        if match is not None and stream is not None:
            by_stream = self._dropped.setdefault(int(match.group(1)), {})
            by_stream[stream] = by_stream.get(stream, 0) + 1
            self._report_dirty = True
            if self._report_due is None and not self._stopping:
                loop = asyncio.get_running_loop()
                self._report_due = loop.call_later(self._report_interval_s, self._queue_report)

    def _report_frame(self) -> bytes:
        return encode_frame(
            make_relay_message(self._token, self.relay_id, self._dropped, self._ranks)
        )

    def _queue_report(self) -> None:
        if self._report_due is not None:
            self._report_due.cancel()
            self._report_due = None
        if self._report_dirty:
            self._report_dirty = False
            self._enqueue(self._report_frame())

    # ---- the upstream connection (loop thread) -----------------------------------------

    def _connect_soon(self) -> None:
        self._retry = None
        if (
            self._sock is None
            and not self._connecting
            and not self._intake._stopped
            and not self._closed
        ):
            self._connecting = True
            asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        sock: socket.socket | None = None
        try:
            host, port = self._upstream
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), self._connect_timeout_s
            )
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, address), self._connect_timeout_s)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, asyncio.TimeoutError, IndexError) as exc:
            if sock is not None:
                sock.close()
            self._connecting = False
            if self._queue and not self._was_connected and not self._said_unreachable:
                # Ranks send and the aggregator was never reached: a wrong address, or
                # one not up yet. Said once; the lost-connection line covers later losses.
                self._said_unreachable = True
                self._said_down = True
                why = (
                    "timed out"
                    if isinstance(exc, asyncio.TimeoutError)
                    else os.strerror(exc.errno)
                    if isinstance(exc, OSError) and exc.errno
                    else str(exc) or type(exc).__name__
                )
                self._say(
                    f"cannot reach the aggregator at {self._address_text()} ({why}); "
                    "frames wait meanwhile, and it keeps trying"
                )
            elif self._queue and self._untold_loss is not None and not self._stopping:
                # Lost, and not back: what waits is worth the line now.
                self._say_lost(self._untold_loss)
            self._schedule_retry()
            return
        self._connecting = False
        if self._closed or (self._intake._stopped and not self._stopping):
            sock.close()
            return
        self._sock = sock
        self._connections += 1
        self._connected_at = time.monotonic()
        self._sent_on_connection = 0
        self._untold_loss = None  # back before anything waited: nothing was worth saying
        if self._said_down and self._quick_closes < _QUICK_CLOSES_TOLD:
            self._said_down = False
            self._say(f"connection to the aggregator at {self._address_text()} is back")
        self._was_connected = True
        # Every connection starts with the relay message: it names the relay (the
        # aggregator then reads the connection as many ranks') and its drops so far.
        self._queue.appendleft(self._report_frame())
        self._queued_bytes += len(self._queue[0])
        self._report_dirty = False
        # The aggregator never writes: a readable socket means it closed or reset.
        loop.add_reader(sock, self._on_readable)
        self._pump()

    def _schedule_retry(self) -> None:
        if self._retry is None and not self._intake._stopped and not self._closed:
            loop = asyncio.get_running_loop()
            self._retry = loop.call_later(self._backoff_s, self._connect_soon)
            self._backoff_s = min(self._backoff_s * 2, _MAX_BACKOFF_S)

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            if sock.recv(4096):
                return  # nothing the aggregator sends means anything; keep reading
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._lost("closed by the aggregator")

    def _pump(self) -> None:
        self._pump_soon = False
        sock = self._sock
        queue = self._queue
        while sock is not None and queue:
            buffers: list[bytes | memoryview] = list(islice(queue, _SENDMSG_BATCH))
            offered = sum(map(len, buffers)) - self._head_sent
            if self._head_sent:
                buffers[0] = memoryview(buffers[0])[self._head_sent :]
            try:
                sent = sock.sendmsg(buffers)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._lost(exc.strerror or type(exc).__name__)
                return
            full = sent < offered
            sent += self._head_sent
            while queue and sent >= len(queue[0]):
                frame = queue.popleft()
                sent -= len(frame)
                self._queued_bytes -= len(frame)
                self._forwarded += 1
                self._sent_on_connection += 1
            self._head_sent = sent
            if full:
                # The kernel's buffer is full: go on when it has room.
                self._wait_writable(sock)
                return
        if self._writing and sock is not None:
            asyncio.get_running_loop().remove_writer(sock)
            self._writing = False
        if not queue and self._flushed is not None:
            self._flushed.set()

    def _wait_writable(self, sock: socket.socket) -> None:
        if not self._writing:
            asyncio.get_running_loop().add_writer(sock, self._pump)
            self._writing = True

    def _lost(self, why: str) -> None:
        """The upstream connection is gone: close it; what the kernel did not take is
        sent again, whole, on the next connection."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):
            loop.remove_reader(sock)
        if self._writing:
            with contextlib.suppress(Exception):
                loop.remove_writer(sock)
            self._writing = False
        with contextlib.suppress(OSError):
            sock.close()
        self._head_sent = 0
        sent, self._sent_on_connection = self._sent_on_connection, 0
        run_ended = not self._queue and self._intake.connections_open == 0
        if time.monotonic() - self._connected_at < _QUICK_CLOSE_S:
            # Closed as soon as opened: the aggregator refuses this relay (another run
            # token, most often). Backing off keeps the tries from spinning. Unless the
            # run ended (every rank gone, everything sent), what it took was refused,
            # not forwarded.
            self._quick_closes += 1
            if not run_ended:
                self._forwarded -= sent
                self._refused += sent
        else:
            self._quick_closes = 0
            self._backoff_s = _INITIAL_BACKOFF_S
        if run_ended:
            # The ranks are gone and everything was forwarded: the aggregator closing
            # now is the run's end (it finalizes once every rank finished). Nothing to
            # say; a frame that still comes connects again.
            return
        if self._quick_closes == _QUICK_CLOSES_TOLD and not self._stopping:
            self._say_down(
                f"connections to the aggregator at {self._address_text()} are closed as "
                "soon as they open: is TRACEML_RUN_TOKEN that aggregator's? It keeps "
                "trying; frames wait meanwhile"
            )
        elif not self._stopping and not self._loop_found:
            if self._queue and not self._quick_closes:
                self._say_lost(why)
            else:
                # Said if the connection does not come back: a close as soon as it opened
                # may be a refusal (said above once it repeats), and with nothing waiting
                # the aggregator may be finalizing the run, whose last frames went out,
                # while a rank's connection here is still closing.
                self._untold_loss = why
        self._schedule_retry()

    def _say_lost(self, why: str) -> None:
        self._untold_loss = None
        self._say_down(
            f"lost its connection to the aggregator at {self._address_text()} ({why}); "
            "reconnecting, frames wait meanwhile"
        )

    def _say_down(self, line: str) -> None:
        self._said_down = True
        self._say(line)

    async def _close_on_loop(self) -> None:
        """stop(), on the loop: cancel the timers, close the upstream socket."""
        self._closed = True
        self._stopping = True
        for timer in (self._retry, self._report_due):
            if timer is not None:
                timer.cancel()
        self._retry = self._report_due = None
        sock, self._sock = self._sock, None
        if sock is not None:
            loop = asyncio.get_running_loop()
            with contextlib.suppress(Exception):
                loop.remove_reader(sock)
            with contextlib.suppress(Exception):
                loop.remove_writer(sock)
            self._writing = False
            # close() still sends what the kernel holds (no SO_LINGER of zero).
            with contextlib.suppress(OSError):
                sock.close()

    def _close_upstream(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            # close() still sends what the kernel holds (no SO_LINGER of zero).
            with contextlib.suppress(OSError):
                sock.close()

    async def _drain(self, deadline: float) -> None:
        """stop(): no more ranks; forward what is pending until ``deadline``, then count
        the rest as dropped and send the final relay message (briefly)."""
        loop = asyncio.get_running_loop()
        if self._loop_found:
            deadline = time.monotonic()  # nowhere to forward to: count what it holds now
        intake = self._intake
        if intake._server is not None:
            intake._server.close()
        for connection in list(intake._connections):
            connection.close()
        self._stopping = True
        self._queue_report()
        self._flushed = asyncio.Event()
        if self._queue:
            if self._sock is not None:
                self._pump()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._flushed.wait(), max(0.0, deadline - time.monotonic()))
        if self._queue:
            # Out of time: the frame half written goes on (cutting it would lose the
            # connection's framing), the rest is dropped, then the final counts.
            head = self._queue[0] if self._head_sent else None
            for frame in list(self._queue)[1 if head is not None else 0 :]:
                self._count_unsent(frame)
            self._queue.clear()
            self._queued_bytes = 0
            if head is not None:
                self._queue.append(head)
                self._queued_bytes = len(head)
            self._flushed.clear()
            self._enqueue(self._report_frame())
            if self._sock is not None:
                self._pump()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._flushed.wait(), _FINAL_GRACE_S)
            for frame in self._queue:
                self._count_unsent(frame)
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(Exception):
                loop.remove_reader(sock)
            if self._writing:
                with contextlib.suppress(Exception):
                    loop.remove_writer(sock)
                self._writing = False

    def _count_unsent(self, frame: bytes) -> None:
        """Count a frame the stop leaves unsent: a batch per rank and stream, any other
        message as a message."""
        if peek_batch_stream(frame[FRAME_HEADER.size : self._batch_head + 64]) is not None:
            self._drop_batch(frame)
        else:
            self._dropped_messages += 1

    def _looped(self) -> None:
        """Its own connection arrived at its intake: connect upstream no more (frames
        wait, within the bound, and are counted as dropped at the stop); say it once."""
        if self._loop_found:
            return
        self._loop_found = True
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._say(
            f"forwards to {self._address_text()}, which leads back to this relay: nothing "
            "reaches the aggregator (give the aggregator's address)"
        )

    def _address_text(self) -> str:
        host, port = self._upstream
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _say(self, line: str) -> None:
        if self._on_event is not None:
            with contextlib.suppress(Exception):
                self._on_event(line)
