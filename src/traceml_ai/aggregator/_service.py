"""The aggregator: receives rank batches, feeds the export pipeline, tracks ranks, finalizes.

One instance serves one run. ``traceml run`` starts it in its own process (so a
stalled or killed aggregator never takes the launcher or the ranks with it),
``traceml serve`` runs it in the foreground, and tests and benchmarks use it in
process. It never imports torch.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs

from traceml_ai.aggregator.protocol import AggregatorStatsFile
from traceml_ai.export import (
    WARNING_FILE_NAME,
    ExportPipeline,
    ExportStats,
    RankOutcome,
    WarningWriteError,
    batch_streams_for,
    max_queue_bytes_for,
    monitoring_clause,
    monitoring_lost,
    start_export,
    write_finalization_warning,
)
from traceml_ai.settings import DEFAULT_FINALIZE_TIMEOUT_SEC, ExportSettings, MonitorSettings
from traceml_ai.transport.server import AggregatorServer
from traceml_ai.transport.wire import ReceivedBatch, relay_ranks
from traceml_records import ExportLoss, MonitoringLoss

if TYPE_CHECKING:
    # Loaded only when a live view is on: an aggregator without them starts as before.
    from traceml_ai.monitor import Monitoring, SinkFactory
    from traceml_ai.monitor.metrics import Health

MONITOR_CLOSE_BUDGET_S = 5.0
"""Longest wait at finalization for the live views to send their last figures."""

STATS_FILE_PARTS = ("aggregator", "stats.json")
"""Where, under the run folder, finalization writes the aggregator's counters (export on)."""


def live_sinks(settings: MonitorSettings) -> dict[str, SinkFactory]:
    """The live views ``settings`` switches on, by name, each a factory that imports its
    libraries only when called (the dashboard's web server too): monitoring is handed
    its sinks, it names none of them."""
    from traceml_ai import monitor

    sinks: dict[str, SinkFactory] = {}
    if settings.prometheus_port is not None:
        sinks["prometheus"] = monitor.prometheus_sink
    if settings.otlp:
        sinks["otlp"] = monitor.otlp_sink
    if settings.dashboard:
        from traceml_ai.dashboard import start_live_dashboard

        sinks["dashboard"] = start_live_dashboard
    for name in settings.trackers:
        sinks[name] = monitor.tracker_sink(name)
    return sinks


@attrs.frozen(kw_only=True)
class AggregatorConfig:
    """Everything an aggregator needs to serve one run."""

    run_dir: Path
    settings: ExportSettings
    token: str
    bind_host: str = "127.0.0.1"
    port: int = 0
    expected_world_size: int | None = None
    """Ranks the job should have; ``None`` takes the world size the first rank reports."""
    finalize_timeout_sec: float = DEFAULT_FINALIZE_TIMEOUT_SEC
    max_queue_batches: int | None = None
    max_queue_bytes: int | None = None
    """The export queue's byte bound; None: sized by the job (``max_queue_bytes_for`` of
    ``expected_world_size``)."""
    monitor: MonitorSettings = attrs.field(factory=MonitorSettings)
    """The live views (Prometheus, OTLP, the dashboard); all off by default."""


@attrs.frozen(kw_only=True)
class FinalizeResult:
    """What finalization found and wrote."""

    stats: ExportStats | None
    loss: ExportLoss | None
    ranks: RankOutcome
    warning_path: Path | None
    rejected_frames: int


class _Runs:
    """Runs of ranks merged, for a quick ``rank in runs`` however many runs were told."""

    def __init__(self, runs: Iterable[range]) -> None:
        merged: list[list[int]] = []
        for run in sorted(runs, key=lambda r: r.start):
            if merged and run.start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], run.stop)
            else:
                merged.append([run.start, run.stop])
        self._starts = [start for start, _ in merged]
        self._stops = [stop for _, stop in merged]

    def __contains__(self, rank: int) -> bool:
        at = bisect.bisect_right(self._starts, rank) - 1
        return at >= 0 and rank < self._stops[at]


class Aggregator:
    """One run's aggregator: a TCP server, the export pipeline and rank bookkeeping."""

    def __init__(self, config: AggregatorConfig) -> None:
        self.config = config
        self._selected = config.settings.export_streams.selected
        self._lock = threading.Lock()
        self._seen_ranks: set[int] = set()
        self._finished_ranks: set[int] = set()
        # What each rank's sender reported losing, per rank (see ``_note_rank_drops``).
        self._rank_drops: dict[int, _RankDrops] = {}
        # The selected streams' share of those and of the relays' drops, kept as they
        # change: every ``finished`` and ``relay`` message hands the sum on, and adding
        # it up anew each time costs O(ranks) a message, O(ranks^2) a run.
        self._rank_drop_sum = 0
        self._relay_drop_sum = 0
        # What each relay reported dropping: relay id -> rank -> batch stream -> count.
        self._relay_drops: dict[str, dict[int, dict[str, int]]] = {}
        # The runs of ranks relays said they are there for (a relay's every connection
        # repeats its run, and a restarted relay its node's).
        self._relay_ranks: set[range] = set()
        self._selected_wire = batch_streams_for(self._selected)
        self._reported_world_size: int | None = None
        self._all_finished = threading.Event()
        self._finalized: FinalizeResult | None = None
        self._pipeline: ExportPipeline | None = None
        # Batches that arrive between listening and the export's start, in order.
        self._export_started = False
        self._early_batches: list[ReceivedBatch] = []
        self._server: AggregatorServer | None = None
        self._monitoring: Monitoring | None = None
        self._monitoring_loss: MonitoringLoss | None = None
        # (device, inode) of a finalization_warning.json an earlier run left in the run
        # folder (``traceml serve --run-name`` into an existing folder), if any.
        self._earlier_warning: tuple[int, int] | None = None

    @property
    def address(self) -> tuple[str, int] | None:
        """The bound ``(host, port)`` once started."""
        return self._server.address if self._server else None

    @property
    def monitoring(self) -> Monitoring | None:
        """The live views, when any is on (the Ray driver asks it for the dashboard's URL)."""
        return self._monitoring

    @property
    def expected_world_size(self) -> int | None:
        """The configured world size, else the one the first rank reported."""
        return self.config.expected_world_size or self._reported_world_size

    @property
    def finished_ranks(self) -> frozenset[int]:
        """Global ranks that sent their ``finished`` message."""
        with self._lock:
            return frozenset(self._finished_ranks)

    @property
    def heard_from_ranks(self) -> bool:
        """Whether any rank sent a batch or its ``finished`` message; a script that never
        calls ``traceml.init()`` sends neither."""
        server = self._server
        return server is not None and (server.accepted_batches > 0 or server.finished_messages > 0)

    def start(self) -> tuple[str, int]:
        """Start listening, then open the export files (when export is on).

        Listening comes first so that a port that cannot be bound (``OSError``) leaves
        no export file behind: a file left there would turn export off when the run is
        retried in the same run folder. Ranks learn the address only once this returns;
        a batch that still comes earlier (a rank retrying a fixed port) is held and
        handed to the export as soon as it starts.
        """
        queue_limits: dict[str, Any] = {}
        if self.config.max_queue_batches is not None:
            queue_limits["max_queue_batches"] = self.config.max_queue_batches
        # Unless set, the byte bound grows with the job (max_queue_bytes_for).
        queue_limits["max_queue_bytes"] = (
            self.config.max_queue_bytes
            if self.config.max_queue_bytes is not None
            else max_queue_bytes_for(self.config.expected_world_size)
        )
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        self._earlier_warning = _file_identity(self.config.run_dir / WARNING_FILE_NAME)
        self._monitoring = self._start_monitoring()
        self._server = AggregatorServer(
            self.config.bind_host,
            self.config.port,
            self.config.token,
            on_batch=lambda batch: self._on_batches([batch]),
            on_batches=self._on_batches,
            on_finished=self._on_finished,
            on_tracker_runs=self._on_tracker_runs,
            on_relay=self._on_relay,
            expected_connections=self.config.expected_world_size,
        )
        try:
            address = self._server.start()
        except BaseException:
            if self._monitoring is not None:
                self._monitoring.close(1.0)
            raise
        try:
            pipeline = start_export(
                self.config.settings,
                self.config.run_dir,
                selected_streams=self._selected,
                **queue_limits,
            )
        except BaseException:
            self._server.stop()
            if self._monitoring is not None:
                self._monitoring.close(1.0)
            raise
        if pipeline is not None and self._monitoring is not None:
            worker = pipeline.worker
            self._monitoring.feed.export_backlog = lambda: worker.backlog
        with self._lock:
            self._pipeline = pipeline
            if pipeline is not None:
                for batch in self._early_batches:
                    pipeline.submit(batch)
            self._early_batches.clear()
            self._export_started = True
        return address

    def _start_monitoring(self) -> Monitoring | None:
        """The live views the settings ask for; None when all are off. Never raises:
        the run goes on without a live view that cannot start."""
        if not self.config.monitor.any_on:
            return None
        try:
            from traceml_ai.monitor import RunInfo, start_monitoring

            run = RunInfo(
                run_dir=self.config.run_dir,
                run_name=self.config.run_dir.name,
                host=socket.gethostname(),
            )
            return start_monitoring(
                self.config.monitor, run, self._health, sinks=live_sinks(self.config.monitor)
            )
        except Exception as exc:
            with contextlib.suppress(Exception):
                print(
                    f"traceml: live views could not start ({type(exc).__name__}: {exc}); "
                    "training and the files go on without them",
                    file=sys.stderr,
                    flush=True,
                )
            return None

    def _health(self) -> Health:
        """The aggregator's own figures now, for the live views."""
        from traceml_ai.monitor.metrics import Health

        pipeline, server, monitoring = self._pipeline, self._server, self._monitoring
        stats = pipeline.stats() if pipeline is not None else None
        reporting = len(monitoring.state.rank_nodes()) if monitoring is not None else 0
        with self._lock:
            finished = len(self._finished_ranks)
            reporting = max(reporting, len(self._seen_ranks))
        expected = self.expected_world_size
        return Health(
            written_records=dict(stats.written_records) if stats else {},
            failed_records=dict(stats.failed_records) if stats else {},
            dropped_batches=stats.dropped_batches if stats else 0,
            rejected_connections=server.rejected_connections if server else 0,
            expected_ranks=expected,
            reporting_ranks=reporting,
            finished_ranks=finished,
            missing_ranks=max(0, expected - reporting) if expected is not None else 0,
        )

    # Runs on the server's event-loop thread: must stay quick and never block. The
    # batch is usually still encoded (the export worker parses it), so ranks are
    # tracked from their ``finished`` messages and open connections, not from here.
    def _on_batches(self, batches: list[ReceivedBatch]) -> None:
        """What one read of a connection brought: handed on together (one lock round
        of the export's queue, not one per batch)."""
        monitoring = self._monitoring
        if monitoring is not None:
            monitoring.submit_many(batches)
        if not self._export_started:
            with self._lock:
                if not self._export_started:
                    self._early_batches.extend(batches)
                    return
        if self._pipeline is not None:
            self._pipeline.submit_many(batches)

    def _on_finished(self, message: dict[str, Any]) -> None:
        rank = self._note_identity(message.get("identity"))
        if rank is None:
            return
        with self._lock:
            self._finished_ranks.add(rank)
            self._note_rank_drops(rank, message)
            dropped = self._rank_dropped_batches()
            if self._pipeline is not None:
                self._pipeline.set_rank_dropped_batches(dropped)
            expected = self.expected_world_size
            finished = self._finished_ranks
            # Looked at rank by rank only once as many ranks finished as expected (and
            # then up to the first one missing), not a set of every rank per message.
            if (
                expected is not None
                and len(finished) >= expected
                and all(r in finished for r in range(expected))
            ):
                self._all_finished.set()

    def _on_relay(self, message: dict[str, Any]) -> None:
        """A relay's report: the batches it dropped so far, per rank and stream, and the
        ranks it is there for. Its counts only grow, so the largest of each is kept (a
        report that comes again on a new connection repeats them)."""
        ranks = relay_ranks(message)
        with self._lock:
            if ranks is not None:
                self._relay_ranks.add(ranks)
            drops = self._relay_drops.setdefault(message["relay"], {})
            selected = self._selected_wire
            for key, by_stream in message["dropped"].items():
                mine = drops.setdefault(int(key), {})
                for stream, count in by_stream.items():
                    before = mine.get(stream, 0)
                    if count > before:
                        mine[stream] = count
                        if stream in selected:
                            self._relay_drop_sum += count - before
            if self._pipeline is not None:
                self._pipeline.set_rank_dropped_batches(self._rank_dropped_batches())

    def _behind_relays(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        """Those of ``ranks`` behind a relay: their batches came through one, or a relay
        said it is there for them (their frames may never have passed: it died first)
        and they never had a connection of their own. A relay's word never outweighs a
        rank seen on its own connection, whose loss is its own; it only changes what the
        warning says of ranks missing anyway (call after the server stopped)."""
        server = self._server
        if server is None:
            return ()
        relayed = server.relayed_ranks
        direct = server.direct_ranks
        with self._lock:
            claimed = _Runs(self._relay_ranks)
        return tuple(r for r in ranks if r in relayed or (r not in direct and r in claimed))

    def _relay_dropped(self) -> dict[int, dict[str, int]]:
        """The relays' drops per rank and stream, summed over relays (call with the lock)."""
        total: dict[int, dict[str, int]] = {}
        for drops in self._relay_drops.values():
            for rank, by_stream in drops.items():
                mine = total.setdefault(rank, {})
                for stream, count in by_stream.items():
                    mine[stream] = mine.get(stream, 0) + count
        return total

    def _on_tracker_runs(self, message: dict[str, Any]) -> None:
        monitoring = self._monitoring
        identity = message.get("identity")
        if monitoring is not None and isinstance(identity, dict):
            monitoring.state.note_tracker_runs(identity, message["runs"])

    def _note_rank_drops(self, rank: int, message: dict[str, Any]) -> None:
        """Merge a ``finished`` message's drop counts into ``rank``'s (call with the lock).

        A sender's counts only grow over its life and the rank SDK carries them over a
        re-``init`` in the same process, so a second ``finished`` of a rank (a sender
        that reconnected, an ``init`` after ``shutdown``, a duplicated rank id) repeats
        earlier drops rather than adding to them: the maximum per rank and stream is
        kept, never the sum.
        """
        total = message.get("dropped_batches")
        by_stream = message.get("dropped_batches_by_stream")
        sent = message.get("sent_batches")
        if type(total) is not int or total < 0:
            return
        drops = self._rank_drops.setdefault(rank, _RankDrops())
        before = self._selected_drops(drops)
        drops.total = max(drops.total, total)
        if type(sent) is int and sent > drops.sent:
            drops.sent = sent
        if isinstance(by_stream, dict):
            for stream, count in by_stream.items():
                if type(count) is int and count > drops.by_stream.get(stream, 0):
                    drops.by_stream[stream] = count
        else:
            # An older sender that does not split its drops: all of them may be ours.
            drops.split = False
        self._rank_drop_sum += self._selected_drops(drops) - before

    def _selected_drops(self, drops: _RankDrops) -> int:
        """A rank's lost batches that could have held records of a selected stream.

        Drops of streams the run does not export are no loss (their records are never
        built); a rank that did not split its drops by stream is counted in full.
        """
        if not drops.split:
            return drops.total
        selected = self._selected_wire
        return sum(n for s, n in drops.by_stream.items() if s in selected)

    def _rank_dropped_batches(self) -> int:
        """Batches the ranks lost that could have held records of a selected stream
        (:meth:`_selected_drops` of each), and the relays' drops of selected streams
        (``relay`` messages): kept up to date by the messages (call with the lock)."""
        return self._rank_drop_sum + self._relay_drop_sum

    def _unseen_batches(self) -> int:
        """Batches the finished ranks wrote to their sockets that never arrived here.

        A rank counts a batch as sent once its socket took it; if the connection then
        died with the batch unread, neither side would report it. The server tallies
        the batch frames it accepted per rank, so the difference is the loss. (Which
        streams those batches held is unknown, so they count whatever the selection.)
        Call with the lock, after the server stopped (its tally is then final).
        """
        if self._server is None:
            return 0
        received = self._server.received_batches_by_rank()
        # Batches a relay reported dropping never arrived either; they are counted (by
        # stream) in _rank_dropped_batches.
        relayed = {rank: sum(c.values()) for rank, c in self._relay_dropped().items()}
        return sum(
            max(0, d.sent - received.get(rank, 0) - relayed.get(rank, 0))
            for rank, d in self._rank_drops.items()
        )

    def _note_identity(self, identity: Any) -> int | None:
        rank = _rank_of(identity)
        if rank is None:
            return None
        if rank not in self._seen_ranks:
            world = identity.get("world_size")
            with self._lock:
                self._seen_ranks.add(rank)
                if self._reported_world_size is None and type(world) is int and world >= 1:
                    self._reported_world_size = world
        return rank

    def wait_all_finished(self, timeout: float | None) -> bool:
        """Block until every expected rank finished (True) or ``timeout`` passes (False)."""
        return self._all_finished.wait(timeout)

    def wait_connections_closed(self, timeout: float) -> bool:
        """Block until no rank connection is open (their last frames are then read)."""
        deadline = time.monotonic() + timeout
        while self._server is not None and self._server.connections_open > 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def finalize(self) -> FinalizeResult:
        """Stop listening, drain the export, write closing lines and the warning file.

        Ranks that did not finish are reported as ``timeout`` when a rank connection
        was still open as finalization began (we stopped waiting for it), else as
        ``ranks_disconnected``. Idempotent: a second call returns the first result.
        """
        if self._finalized is not None:
            return self._finalized
        rejected = 0
        still_connected = self._server is not None and self._server.connections_open > 0
        if self._server is not None:
            rejected = self._server.rejected_frames
            self._server.stop()
        stats = None
        loss = None
        if self._pipeline is not None:
            # Every ``finished`` that will ever come has come: the ranks' own drops must be
            # in the worker's count before it writes the closing lines.
            with self._lock:
                self._pipeline.set_rank_dropped_batches(
                    self._rank_dropped_batches() + self._unseen_batches()
                )
            stats = self._pipeline.finalize(self.config.finalize_timeout_sec)
            loss = self._pipeline.loss()
        with self._lock:
            expected = self.expected_world_size or len(self._seen_ranks)
            finished = tuple(sorted(r for r in self._finished_ranks if r < expected))
            missing = tuple(r for r in range(expected) if r not in self._finished_ranks)
        ranks = RankOutcome(
            expected_world_size=max(expected, 1),
            finished_ranks=finished,
            missing_ranks=missing,
            relayed_missing_ranks=self._behind_relays(missing),
        )
        if self._monitoring is not None:
            self._monitoring_loss = self._close_monitoring(self._monitoring, stats, ranks)
        reason: Literal["ranks_disconnected", "timeout"] = (
            "timeout" if still_connected else "ranks_disconnected"
        )
        live_loss = self._monitoring_loss
        if live_loss is not None and not monitoring_lost(live_loss):
            live_loss = None
        if loss is not None or missing or live_loss is not None:
            _set_aside_earlier_warning(self.config.run_dir, self._earlier_warning)
        warning_path: Path | None = None
        try:
            warning_path = write_finalization_warning(
                self.config.run_dir,
                export_loss=loss,
                ranks=ranks if missing else None,
                reason_if_ranks=reason if missing else None,
                monitoring_loss=live_loss,
            )
        except WarningWriteError as exc:
            # Disk full or read-only: the loss must still be told, so what the file
            # would have held goes to stderr as one line.
            with contextlib.suppress(Exception):
                print(exc.report_line(), file=sys.stderr, flush=True)
        self._finalized = FinalizeResult(
            stats=stats, loss=loss, ranks=ranks, warning_path=warning_path, rejected_frames=rejected
        )
        if stats is not None or self._monitoring_loss is not None:
            self._write_stats(stats or _NO_EXPORT, ranks)
        return self._finalized

    def _close_monitoring(
        self, monitoring: Monitoring, stats: ExportStats | None, ranks: RankOutcome
    ) -> MonitoringLoss:
        """Show the final figures, then stop the live views within their budget."""
        health = self._health()
        monitoring.finish(
            attrs.evolve(
                health,
                written_records=dict(stats.written_records) if stats else {},
                failed_records=dict(stats.failed_records) if stats else {},
                dropped_batches=stats.dropped_batches if stats else 0,
                finished_ranks=len(ranks.finished_ranks),
                missing_ranks=len(ranks.missing_ranks),
            )
        )
        loss = monitoring.close(
            max(1.0, min(MONITOR_CLOSE_BUDGET_S, self.config.finalize_timeout_sec))
        )
        # A view that did not start was said when it failed; drops are told here.
        if monitoring_lost(attrs.evolve(loss, not_started={})):
            with contextlib.suppress(Exception):
                print(f"traceml: {monitoring_clause(loss)}", file=sys.stderr, flush=True)
        return loss

    def _write_stats(self, stats: ExportStats, ranks: RankOutcome) -> None:
        """Write ``aggregator/stats.json``: the export counters, queue high-water marks and
        transport counts of this run (for operators and benchmarks; never fails the run)."""
        server, pipeline = self._server, self._pipeline
        content = AggregatorStatsFile(
            written_records=dict(stats.written_records),
            failed_records=dict(stats.failed_records),
            skipped_items=stats.skipped_items,
            dropped_batches=stats.dropped_batches,
            exporter_failed=stats.exporter_failed,
            queue_high_water_batches=stats.queue_high_water_batches,
            queue_high_water_bytes=stats.queue_high_water_bytes,
            max_queue_batches=pipeline.worker.max_queue_batches if pipeline else None,
            max_queue_bytes=pipeline.worker.max_queue_bytes if pipeline else None,
            accepted_batches=server.accepted_batches if server else 0,
            finished_messages=server.finished_messages if server else 0,
            rejected_frames=server.rejected_frames if server else 0,
            rejected_by_reason=server.rejected_by_reason if server else {},
            connections_total=server.connections_total if server else 0,
            held_connections=server.held_connections if server else 0,
            rejected_connections=server.rejected_connections if server else 0,
            rejected_connections_by_reason=(
                server.rejected_connections_by_reason if server else {}
            ),
            expected_world_size=ranks.expected_world_size,
            finished_ranks=len(ranks.finished_ranks),
            missing_ranks=tuple(ranks.missing_ranks),
            monitoring=self._monitoring_loss,
        )
        path = self.config.run_dir.joinpath(*STATS_FILE_PARTS)
        _write_new_file(path, content.to_json())


_NO_EXPORT = ExportStats(
    written_records={},
    failed_records={},
    skipped_items=0,
    dropped_batches=0,
    exporter_failed=False,
    queue_high_water_batches=0,
    queue_high_water_bytes=0,
)
"""The export counters of a run with export off (stats.json still tells the live views')."""


@attrs.define
class _RankDrops:
    """The largest drop counts one rank's ``finished`` messages reported."""

    total: int = 0
    sent: int = 0
    """The largest ``sent_batches`` it reported."""
    by_stream: dict[str, int] = attrs.field(factory=dict)
    split: bool = True
    """Every message of the rank split its drops by stream."""


def _file_identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _set_aside_earlier_warning(run_dir: Path, earlier: tuple[int, int] | None) -> None:
    """Keep an earlier run's warning file as ``finalization_warning.earlier[.N].json``.

    Our warning must not be merged into another run's (that would rewrite its file and
    mix two runs' counts). The earlier file is hard-linked under the first free name
    (its bytes stay reachable at every instant) and only then unlinked from the warning
    name, so ours is written fresh. A warning this run wrote itself is left alone.
    """
    path = run_dir / WARNING_FILE_NAME
    if earlier is None or _file_identity(path) != earlier:
        return
    for i in range(1000):
        aside = run_dir / (f"finalization_warning.earlier{f'.{i}' if i else ''}.json")
        try:
            os.link(path, aside, follow_symlinks=False)
        except FileExistsError:
            continue
        except OSError:
            return
        with contextlib.suppress(OSError):
            os.unlink(path)
        return


def _write_new_file(path: Path, data: bytes) -> Path | None:
    """Write ``data`` to ``path``, or to ``<stem>.1<suffix>``, ``.2``... when it exists.

    Never replaces a file: a run folder served again (``traceml serve --run-name``)
    keeps the earlier run's ``stats.json``. The bytes go to a temp file first and are
    hard-linked under the first free name (``os.link`` refuses an existing one), so a
    reader never sees a half-written file. Returns the path, or None on OSError.
    """
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        # mkstemp makes 0600; stats.json is as readable as the export files.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        for i in range(1000):
            target = path if i == 0 else path.with_name(f"{path.stem}.{i}{path.suffix}")
            try:
                os.link(tmp, target)
            except FileExistsError:
                continue
            return target
        return None
    except OSError:
        return None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _rank_of(identity: Any) -> int | None:
    if not isinstance(identity, dict):
        return None
    rank = identity.get("global_rank")
    if type(rank) is not int or rank < 0:
        return None
    return rank
