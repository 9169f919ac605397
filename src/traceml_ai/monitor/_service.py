"""The live views of one aggregator: the feed, the state and the sinks that serve it.

:func:`start_monitoring` starts the sinks its caller hands it, by name: each a
:data:`SinkFactory` that imports its libraries only when called, so that a default
install never imports opentelemetry or the web server. This module imports no sink:
the package's own factories are in ``_factories`` (:func:`prometheus_sink`,
:func:`otlp_sink`) and ``trackers``; the aggregator adds the dashboard's and chooses
from what :class:`~traceml_ai.settings.MonitorSettings` asks for. A sink that cannot
start (its extra is not installed, its port is taken, a bad OTEL_* variable) is
reported in one ``traceml:`` line and the others, the files and training go on.
:meth:`Monitoring.close` stops them within a budget and returns what they lost, for
``stats.json`` and ``finalization_warning.json``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

import attrs

from traceml_ai.monitor._feed import LiveFeed
from traceml_ai.monitor._sink import LiveSink, RunInfo, SinkStartError, report_to_stderr
from traceml_ai.monitor._state import LiveState
from traceml_ai.monitor.metrics import Family, Health, collect
from traceml_ai.settings import MonitorSettings
from traceml_ai.transport.wire import ReceivedBatch
from traceml_records import MonitoringLoss

__all__ = ["Monitoring", "SinkFactory", "start_monitoring"]

_log = logging.getLogger("traceml_ai.monitor")


SinkFactory = Callable[["Monitoring"], LiveSink]
"""Starts one sink for a :class:`Monitoring` (raises :class:`SinkStartError`, one line,
when it cannot); imports its libraries when called, never before."""


class Monitoring:
    """The running live views of one aggregator."""

    def __init__(
        self,
        settings: MonitorSettings,
        run: RunInfo,
        health: Callable[[], Health],
        *,
        report: Callable[[str], None] = report_to_stderr,
    ) -> None:
        self.settings = settings
        self.run = run
        self.state = LiveState(rank_histograms_max_ranks=settings.rank_series_max_ranks)
        self.feed = LiveFeed(self.state)
        self.feed.report = report
        self._health = health
        self.report = report
        self.sinks: list[LiveSink] = []
        self.not_started: dict[str, str] = {}
        self.finished = threading.Event()
        """Set once the aggregator has finalized (the dashboard shows it)."""
        self.final_health: Health | None = None
        self._loss: MonitoringLoss | None = None

    def health(self) -> Health:
        """The aggregator's own figures now, with the live views' drops."""
        if self.final_health is not None:
            base = self.final_health
        else:
            try:
                base = self._health()
            except Exception:
                base = Health()
        return attrs.evolve(base, live_dropped_batches=self.feed.dropped_batches)

    def families(self) -> list[Family]:
        """Every metric's series now, as both Prometheus and OTLP serve them."""
        return collect(
            self.state,
            self.health(),
            run_name=self.run.run_name,
            rank_series_max_ranks=self.settings.rank_series_max_ranks,
        )

    def submit(self, batch: ReceivedBatch) -> None:
        """Hand a received batch to the live views; never blocks, never raises."""
        self.feed.submit(batch)

    def submit_many(self, batches: list[ReceivedBatch]) -> None:
        """Hand what one read brought to the live views together; never blocks, never
        raises."""
        self.feed.submit_many(batches)

    def start_sinks(self, factories: Mapping[str, SinkFactory]) -> None:
        """Start each sink (by its name); one that cannot is said in one line."""
        for name, factory in factories.items():
            try:
                sink = factory(self)
            except SinkStartError as exc:
                self.not_started[name] = str(exc)
                self.report(f"traceml: {name}: {exc}; training and the files go on without it")
                continue
            except Exception as exc:
                self.not_started[name] = f"{type(exc).__name__}: {exc}"
                _log.debug("sink %s failed to start", name, exc_info=True)
                self.report(
                    f"traceml: {name} could not start ({type(exc).__name__}: {exc}); "
                    "training and the files go on without it"
                )
                continue
            self.sinks.append(sink)
            self.feed.add_listener(sink.on_steps)
        self.feed.straggler_on_demand = bool(self.sinks) and all(
            getattr(sink, "straggler_on_demand", False) for sink in self.sinks
        )

    def finish(self, health: Health) -> None:
        """The aggregator finalized: the live views show the final figures from now on."""
        self.final_health = health
        self.finished.set()

    def close(self, timeout_s: float) -> MonitoringLoss:
        """Stop the feed and every sink within about ``timeout_s``; idempotent."""
        if self._loss is not None:
            return self._loss
        deadline = time.monotonic() + timeout_s
        self.feed.stop(max(0.1, min(2.0, timeout_s / 3)))
        by_sink: dict[str, Mapping[str, int]] = {}
        for sink in self.sinks:
            left = max(0.1, deadline - time.monotonic())
            try:
                lost = sink.close(left)
            except Exception as exc:
                _log.debug("sink %s failed to close", sink.name, exc_info=True)
                lost = {"close_failed": 1}
                self.report(f"traceml: {sink.name}: stopping failed ({type(exc).__name__}: {exc})")
            if lost:
                by_sink[sink.name] = dict(lost)
        self._loss = MonitoringLoss(
            dropped_batches=self.feed.dropped_batches,
            by_sink={k: dict(v) for k, v in by_sink.items()},
            not_started=dict(self.not_started),
        )
        return self._loss


def start_monitoring(
    settings: MonitorSettings,
    run: RunInfo,
    health: Callable[[], Health],
    *,
    sinks: Mapping[str, SinkFactory],
    report: Callable[[str], None] = report_to_stderr,
) -> Monitoring | None:
    """Start the live views with ``sinks`` (name: factory, in order; ``settings`` says
    their ports and options); None when there is none."""
    if not sinks:
        return None
    monitoring = Monitoring(settings, run, health, report=report)
    monitoring.start_sinks(sinks)
    monitoring.feed.start()
    return monitoring
