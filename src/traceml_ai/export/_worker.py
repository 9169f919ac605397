"""The export worker: a bounded queue of wire batches and one thread feeding an exporter.

``submit`` is called from the aggregator's receive loop and must never slow it down:
it puts the batch on a :class:`~traceml_ai._queue.BoundedBatchQueue` (appended under
a briefly held lock, or counted as dropped). The worker thread builds records (only
of the selected streams) and hands each per-stream group to the exporter. Every
exporter call happens on the worker thread, so a hung exporter holds only that
thread; ``shutdown`` waits for it with a deadline and gives up on it when the
deadline passes.

Fork safety: the aggregator may fork (e.g. a launcher started in-process). A child
must not inherit a lock held by a parent thread, nor write the parent's lines, so
every worker is reset in the child to a fresh, stopped one that drops everything.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from traceml_ai import _fork
from traceml_ai._queue import BoundedBatchQueue
from traceml_ai.export._builder import RecordBuilder
from traceml_ai.export._encoded import EncodedLines
from traceml_ai.export._protocol import (
    Exporter,
    ExporterError,
    ExportInput,
    ExportResult,
    ExportSummary,
    export_input_of,
)
from traceml_ai.transport.wire import ReceivedBatch
from traceml_records import ExportLoss

__all__ = [
    "CLOSE_GRACE_S",
    "DEFAULT_MAX_QUEUE_BATCHES",
    "DEFAULT_MAX_QUEUE_BYTES",
    "MAX_QUEUE_BYTES_CAP",
    "QUEUE_BYTES_PER_RANK",
    "ExportStats",
    "ExportWorker",
    "max_queue_bytes_for",
]

_log = logging.getLogger("traceml_ai.export")

DEFAULT_MAX_QUEUE_BATCHES = 262_144
"""Bounds the per-batch overhead (about 170 bytes each beyond ``nbytes``: ~45 MB at most).

The byte bound is the one that bounds memory, at any job size: this one only binds for
batches under 256 bytes on average (the smallest a rank sends, one step_memory item, is
about 400). A large job sends small batches: at 1 step/s each of 10,240 ranks sends one
item per batch, about 37,000 batches a second, so a bound of 65,536 dropped batches after
a 1.8 s stall of the worker while the queue held 43 MiB of its 64 MiB.
"""
DEFAULT_MAX_QUEUE_BYTES = 64 * 1024 * 1024
"""The byte bound of a job of up to 8,192 ranks (and of one whose size is not known)."""

QUEUE_BYTES_PER_RANK = 8 * 1024
"""A larger job's byte bound grows with it (:func:`max_queue_bytes_for`), so the queue
holds about as many seconds of its traffic: at 1 step/s with every stream a rank sends
about 2.6 kB a second, so 64 MiB hold 1.5 s of 16,384 ranks' traffic, and a stall of
the worker or the disk longer than that would drop; 128 MiB hold 3 s."""

MAX_QUEUE_BYTES_CAP = 256 * 1024 * 1024
"""The most a job's size raises the byte bound to (with the per-batch overhead, about
320 MB of queue at 32,768 ranks and beyond)."""


def max_queue_bytes_for(ranks: int | None) -> int:
    """The export queue's byte bound for a job of ``ranks`` ranks (None: not known):
    :data:`QUEUE_BYTES_PER_RANK` each, at least :data:`DEFAULT_MAX_QUEUE_BYTES`, at
    most :data:`MAX_QUEUE_BYTES_CAP`."""
    if ranks is None or ranks < 1:
        return DEFAULT_MAX_QUEUE_BYTES
    return min(MAX_QUEUE_BYTES_CAP, max(DEFAULT_MAX_QUEUE_BYTES, ranks * QUEUE_BYTES_PER_RANK))


CLOSE_GRACE_S = 0.5
"""How long past its deadline ``shutdown`` waits for the exporter's ``close``."""

_ABANDONED_CLOSE_WAIT_S = 0.25
"""How long ``close`` gets on a helper thread when the worker is stuck in ``export``."""

_LINGER_S = 0.002
"""How long the worker waits, once woken from an empty queue, before it starts."""

_TAKE_MAX_BYTES = 256 * 1024
"""Most wire bytes of queued batches the worker takes at once (always one batch at
least). Their records go to the exporter as one group per stream, so a backlog of small
batches (a large job at a low step rate sends one item per batch) costs one lock round
and one write per stream per take, not per batch."""


@attrs.frozen(kw_only=True)
class ExportStats:
    """Counts of one export worker (a live snapshot, or the final figures of ``shutdown``).

    ``written_records`` and ``failed_records`` have every selected stream as a key.
    """

    written_records: Mapping[str, int]
    """Records of each stream that the exporter accepted."""
    failed_records: Mapping[str, int]
    """Records of each stream that were built but not written (exporter raised, hung or is off)."""
    skipped_items: int
    """Items of selected streams that could not become valid records."""
    dropped_batches: int
    """Whole wire batches dropped: by this worker (full queue, submitted after shutdown, left
    at the deadline) plus those the ranks' senders reported dropping (see
    :meth:`ExportWorker.set_rank_dropped_batches`)."""
    exporter_failed: bool
    """The exporter could not start, hung, or failed to close."""
    queue_high_water_batches: int
    """Most batches queued at once."""
    queue_high_water_bytes: int
    """Most bytes (sum of ``ReceivedBatch.nbytes``) queued at once."""

    @property
    def written_total(self) -> int:
        """Records written over all streams."""
        return sum(self.written_records.values())

    @property
    def failed_total(self) -> int:
        """Records failed over all streams."""
        return sum(self.failed_records.values())

    @property
    def lost_anything(self) -> bool:
        """Whether any selected record or batch was lost, or the exporter failed."""
        return bool(
            self.dropped_batches or self.failed_total or self.skipped_items or self.exporter_failed
        )

    def to_loss(self) -> ExportLoss | None:
        """The ``export`` block of ``finalization_warning.json``, or None when nothing was lost."""
        if not self.lost_anything:
            return None
        return ExportLoss(
            written_records=self.written_total,
            dropped_batches=self.dropped_batches,
            failed_records=self.failed_total,
            skipped_items=self.skipped_items,
            exporter_failed=self.exporter_failed,
        )


class ExportWorker:
    """A bounded queue of wire batches and the thread that exports them.

    ``submit`` never blocks and never raises; a full queue (``max_queue_batches`` or
    ``max_queue_bytes`` of ``ReceivedBatch.nbytes``) or a submit after shutdown began
    counts one dropped batch. ``shutdown(timeout)`` drains until the deadline, counts
    what is left as dropped, closes the exporter and returns the final
    :class:`ExportStats`; it returns within ``timeout + CLOSE_GRACE_S`` plus a quarter
    second even when the exporter hangs.

    ``exporter_failed=True`` starts the worker in the failed state (the exporter could
    not be created): records are still built and counted, as failed, and no failure is
    logged again.

    The builder's mode must match what the exporter declares (``export_input``): a
    builder that writes lines only feeds an exporter that takes encoded lines.
    """

    def __init__(
        self,
        exporter: Exporter,
        builder: RecordBuilder,
        *,
        max_queue_batches: int = DEFAULT_MAX_QUEUE_BATCHES,
        max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
        exporter_failed: bool = False,
    ) -> None:
        if max_queue_batches < 1 or max_queue_bytes < 1:
            raise ValueError("queue limits must be at least 1")
        self._export_input: ExportInput = export_input_of(exporter)
        if builder.encodes_lines and self._export_input != "encoded_lines":
            raise ValueError(
                "the builder writes encoded lines but the exporter takes typed records "
                "(it does not declare export_input = 'encoded_lines')"
            )
        self._exporter = exporter
        self._builder = builder
        streams = builder.streams
        self._written: dict[str, int] = dict.fromkeys(streams, 0)
        self._failed: dict[str, int] = dict.fromkeys(streams, 0)
        self._skipped = 0
        # Batches lost past the queue (a builder that raised, a batch in hand when shutdown
        # gave up); the queue counts its own (full, closed, left at the deadline).
        self._dropped = 0
        # Batches the ranks' senders lost before they reached us (set by the aggregator).
        self._rank_dropped = 0
        # Once close() got its summary, the counts it wrote into the closing lines must
        # stay the counts reported everywhere else: later rank reports are ignored.
        self._counts_frozen = False
        self._exporter_failed = exporter_failed
        # An exporter that never started has been reported already; don't log per batch.
        self._logged_export_error = exporter_failed
        # Its condition guards the worker's own state too (phase, in-hand groups, counts),
        # so a batch leaves the queue and becomes "in hand" in one critical section. A
        # closed queue means stopping: shutdown began (or this is a forked child).
        self._queue: BoundedBatchQueue[ReceivedBatch] = BoundedBatchQueue(
            max_items=max_queue_batches, max_bytes=max_queue_bytes
        )
        self._thread: threading.Thread | None = None
        self._drain_deadline = float("inf")
        # Set by shutdown when it gives up on a stuck worker: the worker counts nothing more.
        self._abandoned = False
        # What the worker thread is doing: "idle", "build", "export" or "close"; and the
        # groups of the batch in hand (still to be counted if the worker is abandoned).
        self._phase = "idle"
        self._in_hand: list[tuple[str, int]] = []
        self._building = 0  # batches taken from the queue and not built yet
        self._forked_child = False
        self._final: ExportStats | None = None
        self._shutdown_lock = threading.Lock()
        _fork.track(self)

    # -- public API -----------------------------------------------------------------

    @property
    def streams(self) -> tuple[str, ...]:
        """The selected file streams."""
        return self._builder.streams

    @property
    def export_input(self) -> ExportInput:
        """What the exporter declared it takes (``export_input``)."""
        return self._export_input

    @property
    def encodes_lines(self) -> bool:
        """Whether the builder hands the exporter encoded lines (the JSONL fast path)."""
        return self._builder.encodes_lines

    def start(self) -> None:
        """Start the worker thread (idempotent; a no-op in a forked child or after shutdown)."""
        with self._queue.cond:
            if self._thread is not None or self._forked_child or self._queue.closed:
                return
            self._thread = threading.Thread(
                target=self._run, name="traceml-export-worker", daemon=True
            )
            self._thread.start()

    def submit(self, batch: ReceivedBatch) -> None:
        """Queue ``batch`` for export; never blocks and never raises.

        A full queue, a batch larger than the byte bound, a batch without a usable
        ``nbytes``, or a submit after shutdown began counts one dropped batch.
        """
        self._queue.put(batch)

    def submit_many(self, batches: list[ReceivedBatch]) -> None:
        """Queue ``batches`` in order, each as :meth:`submit` would (one lock round)."""
        self._queue.put_many(batches)

    @property
    def max_queue_batches(self) -> int:
        """The queue's bound in batches."""
        return self._queue.max_items

    @property
    def max_queue_bytes(self) -> int:
        """The queue's bound in bytes (sum of ``ReceivedBatch.nbytes``)."""
        return self._queue.max_bytes

    @property
    def dropped_batches(self) -> int:
        """Batches dropped so far, the ranks' reported drops included (live)."""
        return self._queue.dropped + self._dropped + self._rank_dropped

    def set_rank_dropped_batches(self, batches: int) -> None:
        """Set how many batches the ranks' senders reported dropping (a total, not a delta).

        They join ``dropped_batches`` in the closing lines, the summary and the stats, so
        call it before :meth:`shutdown` with every rank report received. Once the
        exporter's ``close`` has its summary the figure is frozen and this does nothing,
        so the closing lines and the returned stats always agree.
        """
        if type(batches) is not int or batches < 0:
            raise ValueError(f"dropped batches must be an int >= 0; got {batches!r}")
        with self._queue.cond:
            if not self._counts_frozen and self._final is None:
                self._rank_dropped = batches

    @property
    def queued_batches(self) -> int:
        """Batches waiting in the queue now (live)."""
        return len(self._queue)

    @property
    def backlog(self) -> float:
        """How full the queue is now, 0 to 1 (the larger of its two bounds' shares; read
        without the lock: a hint for the live views, which yield to the export)."""
        return self._queue.backlog

    def stats(self) -> ExportStats:
        """A consistent snapshot of the counters (the final figures after shutdown)."""
        if self._final is not None:
            return self._final
        with self._queue.cond:
            return self._snapshot()

    def shutdown(self, timeout: float) -> ExportStats:
        """Stop accepting, drain for at most ``timeout`` seconds, close the exporter.

        Idempotent: later calls return the same figures. Batches still queued at the
        deadline count as dropped. If the exporter is stuck in ``export`` past the
        deadline, the rest is counted as dropped, the records in hand as failed,
        ``exporter_failed`` becomes true and ``close`` is tried on a helper thread
        for a short bounded time; if it is stuck in ``close``, ``exporter_failed``
        becomes true and shutdown returns anyway. In a forked child nothing is
        exported or closed.
        """
        with self._shutdown_lock:
            if self._final is not None:
                return self._final
            self._final = self._shutdown(max(0.0, timeout))
            return self._final

    # -- shutdown -------------------------------------------------------------------

    def _shutdown(self, timeout: float) -> ExportStats:
        deadline = time.monotonic() + timeout
        with self._queue.cond:
            if self._forked_child:
                self._queue.clear()
                return self._snapshot()
            self._drain_deadline = deadline
            self._queue.close()
            thread = self._thread
            if thread is None:
                # Never started: the thread still drains and closes, within the deadline.
                thread = self._thread = threading.Thread(
                    target=self._run, name="traceml-export-worker", daemon=True
                )
                thread.start()
        thread.join(max(0.0, deadline + CLOSE_GRACE_S - time.monotonic()))
        if not thread.is_alive():
            with self._queue.cond:
                return self._snapshot()
        with self._queue.cond:
            if not thread.is_alive():
                return self._snapshot()
            self._abandoned = True
            self._exporter_failed = True
            if self._phase == "close":
                _log.error(
                    "traceml: export: the exporter did not finish close() in time; giving up on it"
                )
                return self._snapshot()
            # Stuck in export (or still building): what is in hand failed, the rest is dropped.
            if self._phase == "build":
                self._dropped += self._building  # taken from the queue, not built yet
            for stream, count in self._in_hand:
                self._failed[stream] = self._failed.get(stream, 0) + count
            self._in_hand = []
            self._queue.clear()
            summary = self._summary()
            final = self._snapshot()
        _log.error(
            "traceml: export: the exporter did not return from export() in time; giving up on it"
        )
        self._close_on_helper(summary)
        return final

    def _close_on_helper(self, summary: ExportSummary) -> None:
        """Try ``close`` on a daemon thread for a short bounded time (the worker is stuck)."""
        helper = threading.Thread(
            target=self._call_close,
            args=(summary,),
            name="traceml-export-close",
            daemon=True,
        )
        helper.start()
        helper.join(_ABANDONED_CLOSE_WAIT_S)

    def _call_close(self, summary: ExportSummary) -> bool:
        try:
            self._exporter.close(summary)
        except (ExporterError, OSError) as exc:
            # Disk full, read-only folder, I/O error: the files say it (no closing line)
            # and so does the warning; one line, no traceback.
            _log.error("traceml: export: closing the exporter failed: %s", exc)
            return False
        except Exception:
            # Anything else is a bug in a custom exporter: its author needs the traceback.
            _log.exception("traceml: export: the exporter's close() raised")
            return False
        return True

    # -- worker thread ----------------------------------------------------------------

    def _run(self) -> None:
        queue = self._queue
        cond = queue.cond
        while True:
            linger = False
            with cond:
                if not queue and not queue.closed:
                    while not queue and not queue.closed:
                        cond.wait()
                    linger = not queue.closed
            if linger:
                # Woken by the first batch of a quiet spell: give the next ones a moment
                # to arrive, so a steady trickle costs one wake-up per few batches rather
                # than one per batch (each wake-up also takes the GIL from the receive
                # loop).
                time.sleep(_LINGER_S)
            with cond:
                if self._abandoned:
                    return
                if queue.closed and time.monotonic() >= self._drain_deadline:
                    break
                batches = queue.take_batch(_TAKE_MAX_BYTES)
                if not batches:
                    break
                self._phase = "build"
                self._building = len(batches)
            if not self._process(batches):
                return
        with cond:
            if self._abandoned:
                return
            queue.clear()
            summary = self._summary()
            self._phase = "close"
        ok = self._call_close(summary)
        with cond:
            if not ok:
                self._exporter_failed = True
            self._phase = "idle"

    def _process(self, batches: list[ReceivedBatch]) -> bool:
        """Build the batches taken together and export their records, one group per
        stream (in batch order); False when shutdown gave up on this thread."""
        build = self._builder.build
        parts: dict[str, list[Sequence[Any]]] = {}
        skipped = 0
        failed_builds = 0
        for batch in batches:
            try:
                result = build(batch)
            except Exception:
                # The builder is written never to raise; if it does, lose the batch, not
                # the thread.
                _log.exception("traceml: export: building records from a batch failed")
                failed_builds += 1
                continue
            skipped += result.skipped_items
            for stream, records in result.records.items():
                if records:
                    parts.setdefault(stream, []).append(records)
        groups = [group for stream, found in parts.items() for group in _joined(stream, found)]
        with self._queue.cond:
            if self._abandoned:
                return False
            self._dropped += failed_builds
            self._skipped += skipped
            self._building = 0
            self._in_hand = [(stream, len(records)) for stream, records in groups]
            self._phase = "export"
        for stream, records in groups:
            written, failed = self._export(records)
            with self._queue.cond:
                if self._abandoned:
                    return False
                self._written[stream] = self._written.get(stream, 0) + written
                if failed:
                    self._failed[stream] = self._failed.get(stream, 0) + failed
                self._in_hand.pop(0)
        with self._queue.cond:
            self._phase = "idle"
        return True

    def _export(self, records: Sequence[Any]) -> tuple[int, int]:
        """Hand one group to the exporter; return (written, failed) record counts.

        The exporter's answer is a value: None (every record written) or an
        :class:`ExportResult` that counts the group. Raising means the group failed.
        """
        n = len(records)
        try:
            result = self._exporter.export(records)
        except Exception as exc:
            self._log_export_problem(
                "the exporter raised; its records count as failed: %s",
                exc,
                # An I/O error or an exporter's own error explains itself; anything else
                # (a custom exporter's bug) gets its traceback.
                traceback=not isinstance(exc, (ExporterError, OSError)),
            )
            return 0, n
        if not isinstance(result, ExportResult):
            # The plain protocol: returning means written (whatever a custom exporter returns).
            return n, 0
        written = result.written
        if type(written) is int and written == n and result.failed == 0 and result.abandoned == 0:
            # The usual answer, checked first: this runs once per group on the fast path.
            return n, 0
        if (
            type(written) is not int
            or type(result.failed) is not int
            or type(result.abandoned) is not int
            or min(written, result.failed, result.abandoned) < 0
            or result.total != n
        ):
            # A result that does not account for the group cannot be trusted: none written.
            self._log_export_problem(
                "the exporter returned %s for a group of %d records; they count as failed",
                result,
                n,
            )
            return 0, n
        if result.problem is not None or written != n:
            self._log_export_problem(
                "%s (%d of %d records of the group count as failed)",
                result.problem or "the exporter did not write every record",
                n - written,
                n,
            )
        return written, n - written

    def _log_export_problem(self, message: str, *args: object, traceback: bool = False) -> None:
        """Log the first export problem of this worker (a broken exporter would log every
        batch); the counts and finalization_warning.json say the rest."""
        if self._logged_export_error:
            return
        self._logged_export_error = True
        _log.error("traceml: export: " + message, *args, exc_info=traceback)

    # -- helpers (call with the lock held) ------------------------------------------

    def _summary(self) -> ExportSummary:
        self._counts_frozen = True
        return ExportSummary(
            written_records=dict(self._written), dropped_batches=self.dropped_batches
        )

    def _snapshot(self) -> ExportStats:
        return ExportStats(
            written_records=dict(self._written),
            failed_records=dict(self._failed),
            skipped_items=self._skipped,
            dropped_batches=self.dropped_batches,
            exporter_failed=self._exporter_failed,
            queue_high_water_batches=self._queue.high_water_items,
            queue_high_water_bytes=self._queue.high_water_bytes,
        )

    def after_fork_in_child(self) -> None:
        """In a forked child: a fresh, stopped worker; the parent's lines stay the parent's.

        Only the forking thread exists in the child, so any lock another parent thread
        held is held forever here: every lock is replaced, never acquired.
        """
        self._queue.after_fork_in_child()  # a fresh lock; empty, closed, counters zeroed
        self._shutdown_lock = threading.Lock()
        self._thread = None
        self._forked_child = True
        self._abandoned = False
        self._phase = "idle"
        self._in_hand = []
        self._building = 0
        self._final = None
        self._written = dict.fromkeys(self._written, 0)
        self._failed = dict.fromkeys(self._failed, 0)
        self._skipped = 0
        self._dropped = 0
        self._rank_dropped = 0
        self._counts_frozen = False


def _joined(stream: str, found: list[Sequence[Any]]) -> list[tuple[str, Sequence[Any]]]:
    """The groups of one stream from the batches taken together, joined where they are of
    one kind: consecutive :class:`EncodedLines` into one, consecutive record lists into
    one; the batch order stays."""
    if len(found) == 1:
        return [(stream, found[0])]
    joined: list[tuple[str, Sequence[Any]]] = []
    run: list[Sequence[Any]] = []
    for group in found:
        if run and (type(group) is EncodedLines) != (type(run[0]) is EncodedLines):
            joined.append((stream, _join_run(stream, run)))
            run = []
        run.append(group)
    joined.append((stream, _join_run(stream, run)))
    return joined


def _join_run(stream: str, run: list[Sequence[Any]]) -> Sequence[Any]:
    if len(run) == 1:
        return run[0]
    if type(run[0]) is EncodedLines:
        encoded: list[EncodedLines] = run  # type: ignore[assignment]
        return EncodedLines(
            stream, b"".join(g.data for g in encoded), sum(g.line_count for g in encoded)
        )
    records: list[Any] = []
    for group in run:
        records.extend(group)
    return records
