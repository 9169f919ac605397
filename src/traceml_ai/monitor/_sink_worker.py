"""One worker for every live sink that sends somewhere: a bounded queue, one thread, an
exporter behind a small protocol.

The OTLP export and each experiment tracker are :class:`SinkExporter`\\ s run by a
:class:`SinkWorker`; a next sink that sends plugs in the same way. The feed thread
only queues (:meth:`SinkWorker.put`, never blocking, never raising) or wakes the
worker (:meth:`SinkWorker.wake`); every call into the exporter (the receiver's
client, the tracker's library) happens on the worker's thread, so a receiver that is
down, slow or gone holds that thread only.

**The queue** is a :class:`~traceml_ai._queue.BoundedBatchQueue` bounded in items
and in a size of the sink's own (``size_of``: spans for OTLP, one per point for a
tracker). Its one policy: **drop the newest**. An item that would pass either bound,
or that comes after :meth:`SinkWorker.close` began, is not queued and counts in
``dropped`` (by its size); what is queued stays in arrival order. Items come from the
feed thread (:meth:`SinkWorker.put`) or from the exporter itself
(:meth:`SinkExporter.on_interval` returns the items it made: a tracker's due points).

**Results are values.** :meth:`SinkExporter.export` returns an :class:`Outcome`: how
much of the batch the receiver did not take, and why. An exporter that raises
instead counts its whole batch as failed. The first failure of either kind is handed
to the sink's ``report_failure`` (its one line); the worker goes on with the next
batch.

**Closing within a budget.** :meth:`SinkWorker.close` closes the queue; the thread
exports what is queued, calls :meth:`SinkExporter.on_interval` once with
``final=True`` and :meth:`SinkExporter.finish`. When that is not done as the budget
ends, the worker calls :meth:`SinkExporter.abort` (which ends the exporter's waits),
gives the thread a last moment, then leaves it behind: what is still queued and the
batch in the exporter's hands count as ``abandoned``, and nothing the thread does
later is counted.

**Fork.** A forked child inherits the worker but not its thread: the child's worker
(:mod:`traceml_ai._fork`) is an empty, closed queue with zeroed counts and a fresh
lock, and a fresh thread that is never started, so the child sends nothing of the
parent's and :meth:`SinkWorker.close` returns at once there.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import attrs

from traceml_ai import _fork
from traceml_ai._queue import BoundedBatchQueue

__all__ = ["SENT", "Outcome", "SinkExporter", "SinkWorker", "WorkerCounts"]

_log = logging.getLogger("traceml_ai.monitor")

T = TypeVar("T")


@attrs.frozen
class Outcome:
    """What one :meth:`SinkExporter.export` call did with its batch."""

    failed: int = 0
    """How much of the batch (in the queue's size) the receiver did not take."""
    reason: str | None = None
    """Why, in a few words, for the sink's one line (the first failure only)."""


SENT = Outcome()
"""The whole batch was taken."""


class SinkExporter(Protocol[T]):
    """What a sink does on its worker's thread (every method is called there, except
    :meth:`abort`)."""

    def begin(self) -> None:
        """First, once: what must be ready before anything is exported (a library's
        import)."""

    def on_interval(self, final: bool) -> Sequence[T]:
        """Every ``interval_s``, when woken (:meth:`SinkWorker.wake`), and once with
        ``final`` after the last batch: work that is not a queued item (a metric
        export); returns the items it made, to be queued (the points that came due)."""
        ...

    def ready(self, final: bool) -> bool:
        """Whether queued items may be exported now (else they wait, bounded)."""
        ...

    def export(self, batch: Sequence[T]) -> Outcome:
        """Send ``batch`` (oldest first); may wait on the receiver, up to its own
        timeout."""
        ...

    def finish(self) -> None:
        """Last, once: flush and let go of the receiver (end a run, shut a client down)."""

    def abort(self) -> None:
        """The close budget is spent (called from the closing thread, at most once): end
        what the worker's thread waits on, so that it can return soon."""


@attrs.frozen
class WorkerCounts:
    """A worker's counts, in the queue's size unit (spans, points)."""

    exported: int
    """Taken by the receiver."""
    failed: int
    """Exported but not taken (an :class:`Outcome`'s ``failed``, or a batch whose export
    raised)."""
    dropped: int
    """Never exported: the queue was full, or the item came after close began."""
    abandoned: int
    """Still queued, or in the exporter's hands, when the close budget ran out."""
    timed_out: bool
    """Whether the close budget ran out before the thread was done."""


@attrs.define
class _Entry(Generic[T]):
    """An item with its size against the queue's bound."""

    item: T
    nbytes: int


class SinkWorker(Generic[T]):
    """A bounded queue of ``T`` and the thread that hands it to ``exporter`` in
    batches (see the module's docstring).

    A batch goes out when ``batch_size`` is queued, ``flush_s`` after the previous one
    went (0: at once), and at close. ``interval_s`` (None: never) paces
    :meth:`SinkExporter.on_interval`.
    """

    def __init__(
        self,
        name: str,
        exporter: SinkExporter[T],
        *,
        max_items: int,
        max_size: int,
        batch_size: int,
        flush_s: float = 0.0,
        interval_s: float | None = None,
        size_of: Callable[[T], int] | None = None,
        report_failure: Callable[[str], None],
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.name = name
        self._exporter = exporter
        self._batch_size = batch_size
        self._flush_s = flush_s
        self._interval_s = interval_s
        self._report_failure = report_failure
        self._size_of = size_of
        self._queue: BoundedBatchQueue[_Entry[T]] = BoundedBatchQueue(
            max_items=max_items, max_bytes=max_size
        )
        self._woken = False
        self._stopping = False
        self._abandoned = False
        self._failure_said = False
        self._in_hand = 0
        self._late_dropped = 0
        self._exported = 0
        self._failed = 0
        self._abandoned_size = 0
        self._timed_out = False
        self._counts: WorkerCounts | None = None
        self._thread = self._new_thread()
        _fork.track(self)

    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, name=f"traceml-{self.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------

    def put(self, item: T) -> bool:
        """Queue ``item``; False when it was dropped (and counted). Never blocks on the
        exporter, never raises."""
        size = self._size(item)
        if self._stopping:
            with self._queue.cond:
                self._late_dropped += max(size, 0)
            return False
        return self._queue.put(_Entry(item, size))

    def _size(self, item: T) -> int:
        if self._size_of is None:
            return 1
        try:
            return self._size_of(item)
        except Exception:
            return -1  # the queue drops it (a size it cannot read)

    def wake(self) -> None:
        """Call :meth:`SinkExporter.on_interval` soon (the feed saw something due)."""
        cond = self._queue.cond
        with cond:
            self._woken = True
            cond.notify()

    def __len__(self) -> int:
        """Items queued now."""
        return len(self._queue)

    @property
    def queued_size(self) -> int:
        """The size queued now."""
        return self._queue.nbytes

    @property
    def thread(self) -> threading.Thread:
        """The worker's thread (a fresh, never started one in a fork's child)."""
        return self._thread

    def counts(self) -> WorkerCounts:
        """The counts now (final once :meth:`close` returned)."""
        if self._counts is not None:
            return self._counts
        queue = self._queue
        return WorkerCounts(
            exported=self._exported,
            failed=self._failed,
            dropped=queue.dropped_nbytes + self._late_dropped,
            abandoned=self._abandoned_size,
            timed_out=self._timed_out,
        )

    def close(self, timeout_s: float) -> WorkerCounts:
        """Export what is queued, then the exporter's final work, within ``timeout_s``;
        the final counts. Idempotent."""
        if self._counts is not None:
            return self._counts
        started = time.monotonic()
        margin = min(0.5, timeout_s * 0.2)
        queue = self._queue
        with queue.cond:
            self._stopping = True
            queue.cond.notify_all()
        thread = self._thread
        if thread.is_alive():
            thread.join(max(0.0, timeout_s - margin))
            if thread.is_alive():
                try:
                    self._exporter.abort()
                except Exception:
                    _log.debug("%s: abort failed", self.name, exc_info=True)
                left = timeout_s - (time.monotonic() - started)
                thread.join(max(0.0, min(margin / 2, left)))
        with queue.cond:
            if thread.is_alive():
                self._timed_out = True
            self._abandoned = True
            queue.close()
            left_size = queue.nbytes
            queue.take_all()
            self._abandoned_size = left_size + self._in_hand
            self._in_hand = 0
            self._counts = WorkerCounts(
                exported=self._exported,
                failed=self._failed,
                dropped=queue.dropped_nbytes + self._late_dropped,
                abandoned=self._abandoned_size,
                timed_out=self._timed_out,
            )
        _fork.untrack(self)
        return self._counts

    # -- the worker's thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:
            # A bug of the sink's, not the receiver: said once, never raised further.
            _log.debug("%s: the worker thread failed", self.name, exc_info=True)
            self._say(f"the {self.name} thread stopped: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        exporter = self._exporter
        exporter.begin()
        queue = self._queue
        cond = queue.cond
        interval = self._interval_s
        next_interval = math.inf if interval is None else time.monotonic() + interval
        next_flush = time.monotonic() + self._flush_s
        held = False  # the exporter was not ready: the queue waits for the next interval
        while True:
            with cond:
                while not self._stopping:
                    now = time.monotonic()
                    if self._woken or now >= next_interval:
                        break
                    due = next_interval
                    if queue and not held:
                        if queue.nbytes >= self._batch_size:
                            break
                        due = min(due, next_flush)
                        if now >= due:
                            break
                    cond.wait(None if math.isinf(due) else due - now)
                stopping = self._stopping
                interval_due = self._woken or time.monotonic() >= next_interval
                self._woken = False
            if stopping:
                break
            if interval_due:
                self._interval(final=False)
                held = False
                if interval is not None:
                    next_interval = time.monotonic() + interval
            if (
                queue
                and not held
                and (queue.nbytes >= self._batch_size or time.monotonic() >= next_flush)
            ):
                held = not self._export_queued(final=False)
                next_flush = time.monotonic() + self._flush_s
        self._export_queued(final=True)
        if self._abandoned:
            return
        self._interval(final=True)
        self._export_queued(final=True)
        if self._abandoned:
            return
        try:
            exporter.finish()
        except Exception as exc:
            _log.debug("%s: finish raised", self.name, exc_info=True)
            self._say(f"{type(exc).__name__}: {_short(exc)}")

    def _interval(self, *, final: bool) -> None:
        """The exporter's interval work; the items it made are queued."""
        try:
            made = self._exporter.on_interval(final)
        except Exception as exc:
            _log.debug("%s: on_interval raised", self.name, exc_info=True)
            self._say(f"{type(exc).__name__}: {_short(exc)}")
            return
        queue = self._queue
        for item in made:
            queue.put(_Entry(item, self._size(item)))

    def _export_queued(self, *, final: bool) -> bool:
        """Export what is queued now, a batch at a time; False when the exporter was not
        ready for it (it stays queued)."""
        queue = self._queue
        exporter = self._exporter
        while queue:
            try:
                if not exporter.ready(final):
                    return False
            except Exception as exc:
                self._say(f"{type(exc).__name__}: {_short(exc)}")
                return False
            with queue.cond:
                if self._abandoned:
                    return True
                entries = queue.take_batch(self._batch_size)
                if not entries:
                    return True
                size = sum(e.nbytes for e in entries)
                self._in_hand = size
            try:
                outcome = exporter.export([e.item for e in entries])
            except Exception as exc:
                _log.debug("%s: export raised", self.name, exc_info=True)
                outcome = Outcome(size, f"{type(exc).__name__}: {_short(exc)}")
            failed = min(max(outcome.failed, 0), size)
            with queue.cond:
                if self._abandoned:
                    return True
                self._in_hand = 0
                self._exported += size - failed
                self._failed += failed
            if failed and outcome.reason is not None:
                self._say(outcome.reason)
        return True

    def _say(self, reason: str) -> None:
        """The first failure, to the sink's one line; later ones are only counted."""
        with self._queue.cond:
            if self._failure_said or self._abandoned:
                return
            self._failure_said = True
        try:
            self._report_failure(reason)
        except Exception:
            _log.debug("%s: reporting a failure failed", self.name, exc_info=True)

    # -- fork -------------------------------------------------------------------------

    def after_fork_in_child(self) -> None:
        """An inert worker in a fork's child: an empty, closed queue, zeroed counts, a
        fresh lock and a fresh thread that never starts."""
        self._queue.after_fork_in_child()
        self._stopping = True
        self._woken = False
        self._abandoned = True
        self._in_hand = 0
        self._exported = self._failed = self._abandoned_size = self._late_dropped = 0
        self._timed_out = False
        self._counts = None
        self._thread = self._new_thread()


def _short(exc: BaseException) -> str:
    """An exception's message on one line, bounded (a library may raise pages)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."
