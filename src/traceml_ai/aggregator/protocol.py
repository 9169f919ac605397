"""What ``traceml run`` and its aggregator process tell each other, one attrs class each.

Also the aggregator's ``stats.json`` (:class:`AggregatorStatsFile`).

The launcher passes an :class:`AggregatorLaunchConfig` as the JSON argument of
``python -m traceml_ai.aggregator``; the aggregator answers with event lines on its
stdout: :class:`ReadyEvent` once it listens (or :class:`FailedEvent`), then
:class:`FinalizedEvent`. Both sides go through ``traceml_ai._converter``, so a field
added on one side and not the other is an error naming it, not a silent default.
"""

from __future__ import annotations

from typing import Literal

import attrs
import orjson

from traceml_ai._converter import StructureError, dumps, loads, structure
from traceml_ai.settings import DEFAULT_FINALIZE_TIMEOUT_SEC, ExportSettings, MonitorSettings
from traceml_records import MonitoringLoss

__all__ = [
    "AggregatorEvent",
    "AggregatorLaunchConfig",
    "AggregatorStatsFile",
    "FailedEvent",
    "FinalizedEvent",
    "ReadyEvent",
    "dump_event",
    "parse_event",
]


@attrs.frozen(kw_only=True)
class AggregatorLaunchConfig:
    """The aggregator process's configuration (its one command-line argument, JSON).

    The run token is not here: it comes in ``TRACEML_RUN_TOKEN`` so that it never shows
    in a process listing.
    """

    run_dir: str
    export: ExportSettings
    """The export settings, whole: ``export_streams`` travels as its text and is parsed
    (checked) once on arrival, by ``ExportStreams.parse``."""
    bind_host: str = "127.0.0.1"
    port: int = 0
    expected_world_size: int | None = None
    finalize_timeout_sec: float = DEFAULT_FINALIZE_TIMEOUT_SEC
    monitor: MonitorSettings = attrs.field(factory=MonitorSettings)
    """The live views the aggregator serves (Prometheus, OTLP, the dashboard)."""
    parent_pid: int | None = None
    """The launcher's pid: the aggregator finalizes on its own if the launcher dies."""

    def to_json(self) -> str:
        return dumps(self).decode()

    @classmethod
    def from_json(cls, text: str) -> AggregatorLaunchConfig:
        """Raises :class:`StructureError` naming each problem and its ``$.path``."""
        return loads(text, cls, what="aggregator config")


@attrs.frozen(kw_only=True)
class ReadyEvent:
    """The aggregator listens at ``host:port``."""

    event: Literal["ready"] = "ready"
    host: str
    port: int
    pid: int


@attrs.frozen(kw_only=True)
class FailedEvent:
    """The aggregator could not start; ``error`` says why, in one line."""

    event: Literal["failed"] = "failed"
    error: str


@attrs.frozen(kw_only=True)
class FinalizedEvent:
    """The aggregator finalized the run (drained, closing lines, warning file)."""

    event: Literal["finalized"] = "finalized"
    written_records: int
    exporter_failed: bool
    warning: str | None
    """The ``finalization_warning.json`` written, or None when nothing was lost."""
    missing_ranks: tuple[int, ...]
    rejected_frames: int
    ranks_heard: bool
    """False when no rank ever sent anything (likely: no ``traceml.init()``)."""


@attrs.frozen(kw_only=True)
class RayExportSummary:
    """What the Ray aggregator actor reports when it finalized the export
    (``TraceMLTorchTrainer.traceml_run.summary``, as a plain dict)."""

    written_records: int
    written_by_stream: dict[str, int]
    dropped_batches: int
    exporter_failed: bool
    finished_ranks: list[int]
    missing_ranks: list[int]
    warning_path: str | None
    """The ``finalization_warning.json`` written, or None when nothing was lost."""


AggregatorEvent = ReadyEvent | FailedEvent | FinalizedEvent

_EVENTS: dict[str, type[AggregatorEvent]] = {
    "ready": ReadyEvent,
    "failed": FailedEvent,
    "finalized": FinalizedEvent,
}


def dump_event(event: AggregatorEvent) -> str:
    """One event line (without the newline)."""
    return dumps(event).decode()


def parse_event(line: bytes | str) -> AggregatorEvent:
    """The event of one line; :class:`StructureError` if it is not a known, whole event."""
    what = "aggregator event"
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise StructureError(what, [f"not JSON ({exc})"]) from None
    kind = obj.get("event") if type(obj) is dict else None
    cls = _EVENTS.get(kind) if type(kind) is str else None
    if cls is None:
        raise StructureError(what, [f"not a known event ({kind!r}) at $.event"])
    return structure(obj, cls, what=what)


@attrs.frozen(kw_only=True)
class AggregatorStatsFile:
    """``aggregator/stats.json``: the export counters, queue high-water marks and
    transport counts of one run (for operators and benchmarks)."""

    written_records: dict[str, int]
    failed_records: dict[str, int]
    skipped_items: int
    dropped_batches: int
    exporter_failed: bool
    queue_high_water_batches: int
    queue_high_water_bytes: int
    max_queue_batches: int | None
    """None when export is off (no queue)."""
    max_queue_bytes: int | None
    accepted_batches: int
    finished_messages: int
    rejected_frames: int
    rejected_by_reason: dict[str, int]
    connections_total: int
    held_connections: int
    rejected_connections: int
    rejected_connections_by_reason: dict[str, int]
    expected_world_size: int | None
    finished_ranks: int
    """How many ranks finished (their ranks are in ``finalization_warning.json``)."""
    missing_ranks: tuple[int, ...]
    monitoring: MonitoringLoss | None = None
    """What the live views lost (``dropped_batches``, ``by_sink``, ``not_started``); None
    when none was on."""

    def to_json(self) -> bytes:
        """The file's bytes: indented JSON and a newline."""
        return dumps(self, indent=True) + b"\n"

    @classmethod
    def from_json(cls, data: bytes) -> AggregatorStatsFile:
        """Read a stats file back (tests, tools); :class:`StructureError` if it does not fit."""
        return loads(data, cls, what="stats.json")
