"""The typed settings objects: what resolution hands the launcher, the aggregator and
Ray. Each field declared ``= FROM_TABLE`` is the setting of its name: its default is
the table's, and resolution fills it (``settings_fields``, ``table_settings``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

from traceml_ai._converter import CONVERTER
from traceml_ai.settings._derived import FROM_TABLE, settings_fields
from traceml_ai.settings._parse import Command, ExporterKind, ExportStreams, exporter_kind
from traceml_ai.settings._table import ENV_EXPORT_STREAMS, ENV_EXPORTER, ENV_EXPORTER_HOSTNAME

YAML_FILENAME = "traceml.yaml"
SOURCE_DEFAULT = "default"


def _export_streams(value: str | ExportStreams) -> ExportStreams:
    return ExportStreams.of(value)


@attrs.frozen(slots=True, field_transformer=settings_fields)
class ExportSettings:
    """The validated export settings of one run.

    ``exporter`` is normalized (trimmed, off is ``""``); ``export_streams`` is the
    parsed selection (:class:`ExportStreams`; code may give its text, which is parsed
    here). The aggregator protocol carries this object whole.
    """

    exporter: str = FROM_TABLE
    export_streams: ExportStreams = attrs.field(default=FROM_TABLE, converter=_export_streams)
    exporter_hostname: bool = FROM_TABLE

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


@attrs.frozen(kw_only=True, field_transformer=settings_fields)
class MonitorSettings:
    """Where the aggregator shows the run live, besides (or instead of) the files.

    Everything is off by default: ``prometheus_port`` None serves no ``/metrics``,
    ``otlp`` False exports nothing over OTLP, ``dashboard`` False serves no page,
    ``trackers`` empty logs to no experiment tracker.
    """

    prometheus_port: int | None = FROM_TABLE
    prometheus_bind_host: str = FROM_TABLE
    rank_series_max_ranks: int = FROM_TABLE
    otlp: bool = FROM_TABLE
    otlp_trace_sample: int = FROM_TABLE
    dashboard: bool = FROM_TABLE
    dashboard_port: int = FROM_TABLE
    dashboard_bind_host: str = FROM_TABLE
    trackers: tuple[str, ...] = attrs.field(default=FROM_TABLE, converter=_names)
    tracker_every_steps: int = FROM_TABLE

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


@attrs.frozen(kw_only=True, field_transformer=settings_fields)
class LaunchSettings:
    """Every setting of one ``traceml run`` / ``traceml serve``, resolved and checked.

    A setting the command does not take holds its default. ``None`` means the command
    decides (a generated run name, an automatic port, ...). ``sources`` maps each
    setting's name to where its value came from.
    """

    command: Command
    export: ResolvedExportSettings
    sources: Mapping[str, str]
    monitor: MonitorSettings = attrs.field(factory=MonitorSettings)
    """The live views; ``dashboard`` is set by the command (``--mode dashboard``)."""
    warnings: tuple[str, ...] = ()
    logs_dir: Path = FROM_TABLE
    run_name: str | None = FROM_TABLE
    interval: float = FROM_TABLE
    finalize_timeout_sec: float = FROM_TABLE
    aggregator_host: str | None = FROM_TABLE
    aggregator_port: int | None = FROM_TABLE
    aggregator_bind_host: str = FROM_TABLE
    nnodes: int | None = FROM_TABLE
    nproc_per_node: int | None = FROM_TABLE
    node_relay: bool = FROM_TABLE
    relay: str | None = FROM_TABLE
    """``traceml serve --relay HOST:PORT``: relay to there instead of serving the run."""
    parallel: str = FROM_TABLE
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
