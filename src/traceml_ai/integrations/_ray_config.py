"""``TraceMLRayConfig``: the settings of a traced Ray Train job (never imports Ray).

Every field is set in code. Unlike ``traceml run``, a Ray job reads no ``TRACEML_*``
environment variable and no ``traceml.yaml``: a config is the whole story, so
``exporter=""`` always means export off.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from traceml_ai._converter import structure, unstructure
from traceml_ai._run_folder import run_name_problem
from traceml_ai.settings import ExportSettings, ResolvedExportSettings, settings_from_values

__all__ = ["CONFIG_SOURCE", "TraceMLRayConfig"]

CONFIG_SOURCE = "TraceMLRayConfig"
"""Error messages name a field as ``TraceMLRayConfig.<field>``."""


def _fspath(value: Any) -> Any:
    # Accept a pathlib.Path for logs_dir; anything else is left for the validator.
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _positive_seconds(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    del instance
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"{CONFIG_SOURCE}.{attribute.name}: expected a positive number of seconds, "
            f"got {value!r}"
        )


def _port(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    del instance
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(
            f"{CONFIG_SOURCE}.{attribute.name}: expected an integer in [0, 65535] "
            f"(0 picks a free port), got {value!r}"
        )


def _non_empty_str(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    del instance
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"{CONFIG_SOURCE}.{attribute.name}: expected a non-empty string, got {value!r}"
        )


def _session_id(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    del instance
    if not isinstance(value, str):
        raise ValueError(f"{CONFIG_SOURCE}.{attribute.name}: expected a string, got {value!r}")
    if value == "":
        return
    # The same rule as `traceml run --run-name`: one plain folder name under logs_dir.
    problem = run_name_problem(value)
    if problem is None and value != value.strip():
        problem = f"{value!r} has leading or trailing spaces"
    if problem is not None:
        raise ValueError(
            f"{CONFIG_SOURCE}.{attribute.name} {problem}; expected '' (a fresh id per fit) "
            "or a plain folder name"
        )


@attrs.frozen(kw_only=True)
class TraceMLRayConfig:
    """TraceML settings of a Ray Train job run by ``TraceMLTorchTrainer``.

    Values are checked when the config is made; a bad one raises ``ValueError`` whose
    message names the field, e.g. ``TraceMLRayConfig.export_streams: unknown stream
    ...`` with the same text ``traceml run`` prints for the same value.

    - ``exporter``: ``""`` (off, the default), ``"jsonl"``, or ``"module.path:factory"``.
    - ``export_streams``: comma-separated stream names (``step_time`` by default).
    - ``exporter_hostname``: put ``hostname`` on the records that have it.
    - ``logs_dir``: the run folder is ``<logs_dir>/<session_id>/``, on the driver's
      node (where the aggregator actor runs); a relative path is taken from the
      driver's working directory.
    - ``session_id``: the run folder's name; ``""`` makes a fresh, sortable
      timestamp-based id for every ``fit()``.
    - ``sampler_interval_sec``: seconds between process/system samples on each worker.
    - ``bind_host``: where the aggregator listens. ``127.0.0.1`` serves a one-node
      cluster; use ``0.0.0.0`` on a multi-node cluster (workers then connect to the
      driver node's IP as Ray knows it).
    - ``port``: the aggregator's TCP port; ``0`` picks a free one.
    - ``stop_timeout_sec``: after training, how long to wait for the workers' last
      telemetry, and then how long the export may take to drain.
    """

    exporter: str = ""
    export_streams: str = "step_time"
    exporter_hostname: bool = False
    logs_dir: str = attrs.field(default="./logs", converter=_fspath, validator=_non_empty_str)
    session_id: str = attrs.field(default="", validator=_session_id)
    sampler_interval_sec: float = attrs.field(default=2.0, validator=_positive_seconds)
    bind_host: str = attrs.field(default="127.0.0.1", validator=_non_empty_str)
    port: int = attrs.field(default=0, validator=_port)
    stop_timeout_sec: float = attrs.field(default=10.0, validator=_positive_seconds)

    def __attrs_post_init__(self) -> None:
        # Same checks and messages as `traceml run`, with TraceMLRayConfig.<field>
        # in place of the flag; no environment variable or traceml.yaml is read.
        self.resolved_settings()

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> TraceMLRayConfig:
        """A config from plain data (a job's JSON or YAML config section).

        An unknown key raises :class:`~traceml_ai._converter.StructureError` (a
        ``ValueError``) naming it with its ``$.key`` path and listing the known keys; a
        value of the wrong kind is named the same way (``"8"`` is no port); the rest is
        checked as when the config is made in code.
        """
        return structure(dict(data), cls, what=CONFIG_SOURCE)

    def to_mapping(self) -> dict[str, Any]:
        """The config as plain data; :meth:`from_mapping` reads it back."""
        data: dict[str, Any] = unstructure(self)
        return data

    def resolved_settings(self) -> ResolvedExportSettings:
        """The validated export settings, with the selected stream names."""
        return settings_from_values(
            exporter=self.exporter,
            export_streams=self.export_streams,
            exporter_hostname=self.exporter_hostname,
            source=CONFIG_SOURCE,
        )

    @property
    def export_settings(self) -> ExportSettings:
        """The normalized settings the aggregator runs with."""
        return self.resolved_settings().settings

    @property
    def export_enabled(self) -> bool:
        """Whether an exporter is set (``exporter`` is not ``""``)."""
        return self.export_settings.exporter_kind != "off"

    def run_dir(self, session_id: str) -> Path:
        """``<logs_dir>/<session_id>`` as an absolute path, resolved on the driver."""
        return Path(self.logs_dir).expanduser().absolute() / session_id
