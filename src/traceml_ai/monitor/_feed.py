"""The live views' own copy of the batches: a bounded queue and one thread.

The aggregator's receive loop hands every batch to :meth:`LiveFeed.submit` as it
hands it to the export; ``submit`` never blocks (a full queue drops the batch and
counts it: the export worker's :class:`~traceml_ai._queue.BoundedBatchQueue`). The feed
thread reads the batch itself (the export reads its own copy, so neither waits for the
other, and the live views work with export off), updates the :class:`LiveState` and
gives the new steps to the sinks that want them (the OTLP traces). A step_time,
collectives or step_memory batch is read by a scan (``_feedscan.c``, or its twin
``_feedscan_py``) into only the values the state keeps, without a Python object per
item or timing; a batch the scan declines, and every other stream, is decoded. Every
few seconds it runs the summary's straggler analysis on each rank's recent steps, so
the live views name the straggler in the summary's words; when every live view asks
for it when it reads it (Prometheus, OTLP, the trackers, not the dashboard), it is made
only then, at most as often as it would be every few seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from traceml_ai._queue import BoundedBatchQueue
from traceml_ai.analysis import STEP_EVENT, ExcessSoFar, analyze
from traceml_ai.monitor import _feedscan_py
from traceml_ai.monitor._state import (
    COLLECTIVE_KEYS,
    MAX_USER_PHASES,
    MEMORY_KEYS,
    OTHER_PHASE,
    LiveState,
    StepSeen,
)
from traceml_ai.transport.wire import (
    FrameError,
    ReceivedBatch,
    decode_batch_body,
    peek_batch_stream,
)
from traceml_records.internal import load_extension

__all__ = [
    "DEFAULT_MAX_BATCHES",
    "DEFAULT_MAX_BYTES",
    "STRAGGLER_PERIOD_S",
    "STRAGGLER_STEPS",
    "LiveFeed",
    "StepListener",
]

_log = logging.getLogger("traceml_ai.monitor")

DEFAULT_MAX_BATCHES = 16384
DEFAULT_MAX_BYTES = 32 * 1024 * 1024
STRAGGLER_PERIOD_S = 5.0
"""How often the straggler view is recomputed (longer when it takes long: at most
about 5 % of a core)."""
STRAGGLER_STEPS = 60
"""Recent steps of each rank the live straggler analysis looks at."""
_LINGER_S = 0.05
BACKLOG_YIELD = 0.25
"""When the export's queue is fuller than this share, the feed pauses between batches:
the files come first, and the live views' own queue drops (and counts) instead."""
_YIELD_S = 0.02
_BACKLOG_EVERY = 16
"""Batches taken between two looks at the export's backlog (each look is a call)."""

StepListener = Callable[[Sequence[StepSeen]], None]


_GAUGE_STREAMS = frozenset({"step_memory", "process", "system", "runtime_environment"})
_IDENTITY = b'"identity":'
_ITEMS = b',"items":'


_NOT_READ = ""
"""``LiveFeed._take``'s stream when its caller has not read it (no stream's name)."""


def _stream_of(batch: ReceivedBatch) -> str | None:
    """The stream of an encoded batch, read from its prefix (None: not encoded, or not
    found there)."""
    body = batch.payload
    return peek_batch_stream(body) if type(body) is bytes else None


def _gauge_key(batch: ReceivedBatch, stream: str | None) -> bytes | None:
    """(stream, identity) of an encoded batch of ``stream`` (:func:`_stream_of`), a
    stream whose latest sample is all the live views keep; None for step_time and
    anything not read cheaply."""
    body = batch.payload
    if stream not in _GAUGE_STREAMS or type(body) is not bytes:
        return None
    start = body.find(_IDENTITY, 0, 1024)
    end = body.find(_ITEMS, start, start + 4096) if start >= 0 else -1
    if end < 0:
        return None
    return stream.encode() + body[start:end]


ScanStepTime = Callable[
    [bytes, _feedscan_py.LabelMap], "_feedscan_py.StepScan | tuple[Any, ...] | None"
]
ScanItems = Callable[[bytes, str, tuple[str, ...]], "_feedscan_py.ItemsScan | None"]


def _load_scans() -> tuple[ScanStepTime, ScanItems]:
    """The batch scans: ``_feedscan.c``'s, configured, or their pure-Python twins (not
    built, ``TRACEML_PURE_PYTHON=1``, or refused)."""
    twins = (_feedscan_py.scan_step_time, _feedscan_py.scan_items)
    scan = load_extension("traceml_ai.monitor._feedscan")
    if scan is None:
        return twins
    try:
        scan.configure(STEP_EVENT)
        chosen: tuple[ScanStepTime, ScanItems] = (scan.scan_step_time, scan.scan_items)
    except Exception:
        return twins
    return chosen


SCAN_STEP_TIME, SCAN_ITEMS = _load_scans()
"""The one place the feed's scans are chosen (C or their twins)."""
_ROW_KEYS = {"collectives": COLLECTIVE_KEYS, "step_memory": MEMORY_KEYS}


def _backlog(read: Callable[[], float]) -> float:
    try:
        return read()
    except Exception:
        return 0.0


class LiveFeed:
    """Feeds a :class:`LiveState` from received batches, off the receive loop."""

    def __init__(
        self,
        state: LiveState,
        *,
        max_batches: int = DEFAULT_MAX_BATCHES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        straggler_period_s: float = STRAGGLER_PERIOD_S,
        export_backlog: Callable[[], float] | None = None,
    ) -> None:
        self.state = state
        # Closed once stop() began: the feed thread takes what is left, then ends.
        self._queue: BoundedBatchQueue[ReceivedBatch] = BoundedBatchQueue(
            max_items=max_batches, max_bytes=max_bytes
        )
        self._thread: threading.Thread | None = None
        self._listeners: list[StepListener] = []
        self.bad_batches = 0
        """Batches that could not be parsed (the export counts its own copy's loss)."""
        self._straggler_period_s = straggler_period_s
        self._next_straggler = time.monotonic() + straggler_period_s
        self._straggler_dirty = False
        self._straggler_lock = threading.Lock()
        self._straggler_at = 0.0
        self._straggler_gap_s = straggler_period_s
        """The least time between two analyses: the period, or 20 times the last
        analysis's time when that is longer (at most about 5 % of a core)."""
        self.straggler_on_demand = False
        """Whether the straggler view is made only when asked (:meth:`straggler_now`),
        not every period: set when every sink asks for it when it needs it (the
        trackers, once a point; Prometheus at a scrape and OTLP at a metric export,
        :meth:`straggler_for_read`), so that no analysis runs that nothing reads."""
        self._excess_so_far = ExcessSoFar()
        self.export_backlog = export_backlog
        """How full the export's queue is (0 to 1); None when export is off."""
        self.report: Callable[[str], None] | None = None
        """Where the feed's one-time notices go (the monitoring's ``report``)."""
        self._folding_said = False

    @property
    def dropped_batches(self) -> int:
        """Batches not taken: the queue was full (or stopping), or still queued at stop."""
        return self._queue.dropped

    def add_listener(self, listener: StepListener) -> None:
        """Call ``listener`` with each batch's new steps, on the feed thread (before start)."""
        self._listeners.append(listener)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="traceml-live-feed", daemon=True)
        self._thread.start()

    def submit(self, batch: ReceivedBatch) -> None:
        """Queue a batch; never blocks, never raises (a full queue, a batch without a
        usable ``nbytes`` or a submit after stop drops and counts it)."""
        self._queue.put(batch)

    def submit_many(self, batches: list[ReceivedBatch]) -> None:
        """:meth:`submit` of each, in order, under one hold of the queue's lock (one
        wake-up of the feed thread for what one read of a connection brought)."""
        self._queue.put_many(batches)

    def stop(self, timeout_s: float) -> None:
        """Take what is queued (for at most ``timeout_s``), then stop; what is left is
        counted as dropped."""
        queue = self._queue
        with queue.cond:
            queue.close()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with queue.cond:
            queue.clear()
        self._update_straggler()

    # -- the feed thread ---------------------------------------------------------------

    def _run(self) -> None:
        queue = self._queue
        cond = queue.cond
        while True:
            with cond:
                while not queue and not queue.closed:
                    cond.wait(self._straggler_period_s)
                    if not queue:
                        break
                if not queue and queue.closed:
                    return
                batches = queue.take_all()
            backlog = self.export_backlog
            streams = list(map(_stream_of, batches))
            # Only a pass of several batches can hold two samples of one rank's gauges.
            keys = list(map(_gauge_key, batches, streams)) if len(batches) > 1 else [None]
            latest = {key: i for i, key in enumerate(keys) if key is not None}
            for index, batch in enumerate(batches):
                key = keys[index]
                if key is not None and latest[key] != index:
                    # A later sample of the same rank's gauges is in this pop: the live
                    # views keep the latest only, so under load the feed skips unread.
                    continue
                if backlog is not None and index % _BACKLOG_EVERY == 0 and not queue.closed:
                    # The aggregator process has one GIL: when the export falls behind,
                    # the live views wait (their own queue bounds what they hold).
                    while _backlog(backlog) > BACKLOG_YIELD and not queue.closed:
                        time.sleep(_YIELD_S)
                try:
                    self._take(batch, streams[index])
                except Exception:
                    # The state checks every value; this is a bug, not bad input.
                    _log.exception("traceml: live views: a batch could not be read")
                    self.bad_batches += 1
            if (
                self._straggler_dirty
                and not self.straggler_on_demand
                and time.monotonic() >= self._next_straggler
            ):
                self._update_straggler()
            if not queue.closed:
                time.sleep(_LINGER_S)

    def _take(self, batch: ReceivedBatch, stream: str | None = _NOT_READ) -> None:
        """Take one batch (``stream``: its :func:`_stream_of`, when already read)."""
        payload = batch.payload
        state = self.state
        if type(payload) is bytes:
            if stream is _NOT_READ:
                stream = peek_batch_stream(payload)
            if stream == "step_time":
                scan = SCAN_STEP_TIME(payload, state.scan_labels)
                if scan is not None:
                    self._took_steps(state.add_scan(scan))
                    return
            elif stream in _ROW_KEYS:
                rows = SCAN_ITEMS(payload, stream, _ROW_KEYS[stream])
                if rows is not None:
                    if stream == "collectives":
                        state.add_collective_rows(*rows)
                    else:
                        state.add_memory_rows(*rows)
                    return
            try:
                message = decode_batch_body(payload)
            except FrameError:
                self.bad_batches += 1
                return
        elif type(payload) is dict:
            message = payload
        else:
            return
        identity = message.get("identity")
        items = message.get("items")
        if type(identity) is not dict or type(items) is not list:
            self.bad_batches += 1
            return
        stream = message.get("stream")
        if stream == "step_time":
            self._took_steps(state.add_steps(identity, items))
        elif stream == "step_memory":
            state.add_memory(identity, items)
        elif stream == "process":
            state.add_process(identity, items)
        elif stream == "system":
            state.add_system(identity, items)
        elif stream == "runtime_environment":
            state.add_environment(identity, items)
        elif stream == "collectives":
            state.add_collectives(identity, items)

    def _took_steps(self, seen: list[StepSeen]) -> None:
        """After a step_time batch: the folding notice, the listeners."""
        if self.state.folded_phase_names and not self._folding_said:
            self._say_folding()
        if seen:
            self._straggler_dirty = True
            for listener in self._listeners:
                try:
                    listener(seen)
                except Exception:
                    _log.exception("traceml: live views: a step listener failed")

    def _say_folding(self) -> None:
        """Once per run: user phase names beyond the bound count as ``other``."""
        self._folding_said = True
        names = ", ".join(repr(n) for n in sorted(self.state.folded_phase_names)[:3])
        line = (
            f"traceml: live views: more than {MAX_USER_PHASES} user phase names; {names} and any "
            f"later ones count as '{OTHER_PHASE}' in the metrics (the files keep every name)"
        )
        if self.report is not None:
            self.report(line)

    def straggler_now(self, max_age_s: float) -> None:
        """Make the straggler view again, from any thread, unless it is at most
        ``max_age_s`` old or no step came since (several trackers at one point share
        one analysis)."""
        if self._straggler_dirty and time.monotonic() - self._straggler_at >= max_age_s:
            self._update_straggler()

    def straggler_for_read(self) -> None:
        """A view about to read the straggler view (a scrape, an OTLP export): made
        again, on the reader's thread, when it is older than the feed's period (or the
        20-times budget) and steps came since; so a view that only these read is made
        as often as it is read, not every period. The view a reader gets is at most
        about as old as a periodic one would be."""
        self.straggler_now(self._straggler_gap_s)

    def _update_straggler(self) -> None:
        """Recompute the straggler view; the next run waits at least 20 times as long as
        this one took, so a large world costs at most about 5 % of a core."""
        with self._straggler_lock:
            self._analyze_straggler()

    def _analyze_straggler(self) -> None:
        started = time.monotonic()
        try:
            columns = self.state.recent_columns(STRAGGLER_STEPS)
            nodes = self.state.rank_nodes()  # every rank heard from, with steps or not
            measured = self.state.collectives_measured()
            layout = self.state.layout()
            strategy = self.state.strategy()
            view = analyze(columns, strategy, nodes, measured, layout) if nodes else None
            view = self._excess_so_far(view)
        except Exception:
            _log.exception("traceml: live views: the straggler analysis failed")
            view = None
        self.state.set_straggler(view)
        took = time.monotonic() - started
        self._straggler_at = started
        self._straggler_dirty = False
        self._straggler_gap_s = max(self._straggler_period_s, 20 * took)
        self._next_straggler = time.monotonic() + self._straggler_gap_s
