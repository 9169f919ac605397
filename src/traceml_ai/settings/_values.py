"""The typed settings objects: what resolution hands the launcher, the aggregator and
Ray. Their defaults are the table's."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

from traceml_ai._converter import CONVERTER
from traceml_ai.settings._parse import Command, ExporterKind, ExportStreams, exporter_kind
from traceml_ai.settings._table import (
    DASHBOARD,
    DASHBOARD_BIND_HOST,
    DASHBOARD_PORT,
    DEFAULT_EXPORT_STREAMS,
    DEFAULT_EXPORTER,
    DEFAULT_EXPORTER_HOSTNAME,
    ENV_EXPORT_STREAMS,
    ENV_EXPORTER,
    ENV_EXPORTER_HOSTNAME,
    OTLP,
    OTLP_TRACE_SAMPLE,
    PARALLEL,
    PROMETHEUS_BIND_HOST,
    PROMETHEUS_PORT,
    RANK_HISTOGRAMS_MAX_RANKS,
    TRACKER_EVERY_STEPS,
    TRACKERS,
    default_of,
)

YAML_FILENAME = "traceml.yaml"
SOURCE_DEFAULT = "default"


def _export_streams(value: str | ExportStreams) -> ExportStreams:
    return ExportStreams.of(value)


@attrs.frozen(slots=True)
class ExportSettings:
    """The validated export settings of one run.

    ``exporter`` is normalized (trimmed, off is ``""``); ``export_streams`` is the
    parsed selection (:class:`ExportStreams`; code may give its text, which is parsed
    here). The aggregator protocol carries this object whole.
    """

    exporter: str = DEFAULT_EXPORTER
    export_streams: ExportStreams = attrs.field(
        default=DEFAULT_EXPORT_STREAMS, converter=_export_streams
    )
    exporter_hostname: bool = DEFAULT_EXPORTER_HOSTNAME

    @property
    def exporter_kind(self) -> ExporterKind:
        """Whether export is off, the built-in JSONL exporter, or a custom factory."""
        return exporter_kind(self.exporter)

    def as_environ(self) -> dict[str, str]:
        """The settings as ``TRACEML_*`` variables, for handing to a child process."""
        return {
            ENV_EXPORTER: self.exporter,
            ENV_EXPORT_STREAMS: self.export_streams.text,
            ENV_EXPORTER_HOSTNAME: "1" if self.exporter_hostname else "0",
        }


# ExportStreams crosses a boundary as its text, and is parsed (checked) on arrival.
CONVERTER.register_unstructure_hook(ExportStreams, lambda value: value.text)


def _structure_streams(value: object, _: object) -> ExportStreams:
    if type(value) is not str:
        raise TypeError(f"expected a string, got {type(value).__name__} {value!r}")
    return ExportStreams.parse(value)


CONVERTER.register_structure_hook(ExportStreams, _structure_streams)


def _names(value: Iterable[str]) -> tuple[str, ...]:
    # A list is as good as a tuple in code; the protocol's JSON carries a list.
    return tuple(value)


@attrs.frozen(kw_only=True)
class MonitorSettings:
    """Where the aggregator shows the run live, besides (or instead of) the files.

    Everything is off by default: ``prometheus_port`` None serves no ``/metrics``,
    ``otlp`` False exports nothing over OTLP, ``dashboard`` False serves no page,
    ``trackers`` empty logs to no experiment tracker.
    """

    prometheus_port: int | None = PROMETHEUS_PORT.default
    prometheus_bind_host: str = default_of(PROMETHEUS_BIND_HOST)
    rank_histograms_max_ranks: int = default_of(RANK_HISTOGRAMS_MAX_RANKS)
    otlp: bool = default_of(OTLP)
    otlp_trace_sample: int = default_of(OTLP_TRACE_SAMPLE)
    dashboard: bool = default_of(DASHBOARD)
    dashboard_port: int = default_of(DASHBOARD_PORT)
    dashboard_bind_host: str = default_of(DASHBOARD_BIND_HOST)
    trackers: tuple[str, ...] = attrs.field(default=default_of(TRACKERS), converter=_names)
    tracker_every_steps: int = default_of(TRACKER_EVERY_STEPS)

    @property
    def any_on(self) -> bool:
        """Whether any live view is on."""
        return (
            self.prometheus_port is not None or self.otlp or self.dashboard or bool(self.trackers)
        )


@attrs.frozen(slots=True)
class SettingSources:
    """Where each export setting's value came from.

    One of a CLI flag (``--export-streams``), an environment variable name
    (``TRACEML_EXPORT_STREAMS``), ``traceml.yaml (/abs/path)``, ``default``, or the
    source given to :func:`settings_from_values`.
    """

    exporter: str
    export_streams: str
    exporter_hostname: str


@attrs.frozen(slots=True)
class ResolvedExportSettings:
    """The outcome of resolution: settings, their sources and warnings."""

    settings: ExportSettings
    sources: SettingSources
    warnings: tuple[str, ...] = ()

    @property
    def selected_streams(self) -> tuple[str, ...]:
        """The file streams ``export_streams`` selects, in registry order."""
        return self.settings.export_streams.selected


@attrs.frozen(kw_only=True)
class LaunchSettings:
    """Every setting of one ``traceml run`` / ``traceml serve``, resolved and checked.

    A setting the command does not take holds its default. ``None`` means the command
    decides (a generated run name, an automatic port, ...). ``sources`` maps each
    setting's name to where its value came from.
    """

    command: Command
    logs_dir: Path
    run_name: str | None
    interval: float
    finalize_timeout_sec: float
    aggregator_host: str | None
    aggregator_port: int | None
    aggregator_bind_host: str
    nnodes: int | None
    nproc_per_node: int | None
    export: ResolvedExportSettings
    sources: Mapping[str, str]
    monitor: MonitorSettings = attrs.field(factory=MonitorSettings)
    """The live views; ``dashboard`` is set by the command (``--mode dashboard``)."""
    warnings: tuple[str, ...] = ()
    parallel: str = default_of(PARALLEL)
    """The declared parallel layout (``tp=4,dp=8``), normalized; ``""`` none. The ranks
    read it from ``TRACEML_PARALLEL``."""

    def label(self, name: str) -> str:
        """How a later message names where setting ``name`` came from.

        The flag for a flag or a default (``--logs-dir``), the variable for the
        environment (``TRACEML_LOGS_DIR``), ``traceml.yaml (/abs/path): logs_dir`` for
        the file: the same prefix resolution errors use.
        """
        source = self.sources.get(name, SOURCE_DEFAULT)
        if source == SOURCE_DEFAULT:
            return "--" + name.replace("_", "-")
        if source.startswith(f"{YAML_FILENAME} ("):
            return f"{source}: {name}"
        return source
