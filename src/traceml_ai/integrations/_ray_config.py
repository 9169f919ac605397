"""``TraceMLRayConfig``: the settings of a traced Ray Train job (never imports Ray).

Every field is set in code. Unlike ``traceml run``, a Ray job reads no ``TRACEML_*``
environment variable and no ``traceml.yaml``: a config is the whole story, so
``exporter=""`` always means export off.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from traceml_ai._converter import structure, unstructure
from traceml_ai.launch.run_folder import run_name_problem
from traceml_ai.rank import build_config, warn_once
from traceml_ai.settings import (
    FINALIZE_TIMEOUT_SEC,
    FROM_TABLE,
    RAY_CONFIG_SOURCE,
    ExportSettings,
    MonitorSettings,
    ResolvedExportSettings,
    check_code_value,
    ray_fields,
    settings_from_values,
    table_settings,
)

__all__ = ["CONFIG_SOURCE", "TraceMLRayConfig"]

CONFIG_SOURCE = RAY_CONFIG_SOURCE
"""Error messages name a field as ``TraceMLRayConfig.<field>``."""


def _fspath(value: Any) -> Any:
    # Accept a pathlib.Path for logs_dir; anything else is left for the validator.
    return os.fspath(value) if isinstance(value, os.PathLike) else value


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


RAY_MODES = ("summary", "cli", "dashboard")
"""TraceML 0.5.0's display modes (``mode``); only ``summary`` means something here."""

PROFILES = ("run", "watch")
"""TraceML 0.5.0's sampler profiles (``profile``); ``run`` is what a Ray job does here."""


def _one_of(choices: tuple[str, ...]) -> Any:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        del instance
        if value is not None and value not in choices:
            raise ValueError(
                f"{CONFIG_SOURCE}.{attribute.name}: expected one of "
                f"{', '.join(repr(c) for c in choices)}, got {value!r}"
            )

    return check


def _optional_bool(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    del instance
    if value is not None and not isinstance(value, bool):
        raise ValueError(
            f"{CONFIG_SOURCE}.{attribute.name}: expected True, False or None, got {value!r}"
        )


def _rows(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    del instance
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(
            f"{CONFIG_SOURCE}.{attribute.name}: expected a positive integer, got {value!r}"
        )


def _retention(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    del instance
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float, str))):
        raise ValueError(
            f"{CONFIG_SOURCE}.{attribute.name}: expected seconds or a duration such as "
            f"'30m', got {value!r}"
        )


def _notice(field: str, value: Any, why: str) -> None:
    """One ``TraceMLWarning`` per field and process, blamed on the line that made the
    config (past this module and attrs' generated ``__init__``)."""
    warn_once(
        f"ray_config:{field}",
        f"traceml: {CONFIG_SOURCE}({field}={value!r}) has no effect here: {why}",
        stacklevel=_caller_level() + 1,
    )


def _caller_level() -> int:
    """How many frames above its caller the line that made the config is (past this
    module and attrs' generated ``__init__``)."""
    level = 1
    frame = sys._getframe(2)
    while frame.f_back is not None and (
        frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith("<attrs")
    ):
        frame = frame.f_back
        level += 1
    return level


def _deprecated_stop_timeout_sec(value: object) -> None:
    """One ``DeprecationWarning`` per process for ``stop_timeout_sec``, blamed on the
    line that made the config."""
    global _warned_stop_timeout_sec
    if _warned_stop_timeout_sec:
        return
    _warned_stop_timeout_sec = True
    warnings.warn(
        f"traceml: {CONFIG_SOURCE}(stop_timeout_sec={value!r}) is deprecated: the field is "
        f"finalize_timeout_sec, as traceml run's --finalize-timeout-sec",
        DeprecationWarning,
        stacklevel=_caller_level() + 1,
    )


_warned_stop_timeout_sec = False


@attrs.frozen(kw_only=True, field_transformer=ray_fields)
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
    - ``finalize_timeout_sec``: after training, how long to wait for the workers' last
      telemetry, and then how long the export may take to drain (``traceml run``'s
      ``--finalize-timeout-sec``). ``stop_timeout_sec``, its former name, is still taken
      and says so once with a ``DeprecationWarning``; giving both with different values
      is an error.
    - ``prometheus_port``, ``prometheus_bind_host``, ``rank_series_max_ranks``,
      ``otlp``, ``otlp_trace_sample``: the live views, as ``traceml run``'s flags of the
      same names (docs/monitoring.md); the aggregator actor serves ``/metrics`` on the
      driver's node.
    - ``dashboard_port`` (``--dashboard-port``'s default; 0 picks a free one),
      ``dashboard_bind_host`` (``127.0.0.1``): where the aggregator actor serves the live dashboard with
      ``mode="dashboard"``, on the driver's node (docs/dashboard.md); the driver prints
      its URL. Another than a loopback address is said in a warning.
    - ``trackers`` (comma-separated: ``"tensorboard,wandb"``; ``""`` none),
      ``tracker_every_steps``: the experiment trackers the aggregator actor logs to,
      as ``--tracker`` and ``--tracker-every-steps`` (docs/trackers.md).
    - ``parallel``: the job's declared parallel layout (``"tp=4,dp=8"``; ``""`` none),
      as ``--parallel``: each worker's place in it is exported, and each collective's
      group named by it; a layout the script makes (a DeviceMesh ...) wins.
    - ``node_relay`` (``True``): on a job whose workers span several nodes, the workers
      of each node send through one relay on their node (an actor the aggregator
      actor starts there when the node's first worker asks), which forwards their
      batches over one connection to the aggregator, as ``traceml run``'s
      ``--node-relay``; ``False``: every worker connects to the aggregator itself. A
      job on one node has no relay.

    TraceML 0.5.0's fields (docs/compat-0.5.md):

    - ``mode``: ``"summary"`` switches export on (``jsonl``, when ``exporter`` is
      ``""``) and prints the run's summary after training, as ``traceml run --mode
      summary`` does; ``"dashboard"`` switches export on the same way and serves the
      live dashboard while the job trains, as ``traceml run --mode dashboard``;
      ``"cli"`` says once that there is no terminal view here. ``None`` (the
      default): none of these.
    - ``init_mode`` and ``patch_dataloader``/``patch_forward``/``patch_backward``/
      ``patch_h2d``: what each worker's ``traceml.init()`` is given (``mode`` and
      ``patch_*``), checked when the config is made, with init's rules.
    - ``profile`` (``"run"``), ``summary_window_rows`` and ``history_retention``:
      accepted; each says once that it has no effect here (``profile="run"`` says
      nothing: it is what a Ray job does).
    """

    # The launcher's settings (traceml_ai.settings.SETTINGS): each field declared
    # FROM_TABLE is the setting whose `ray` names it, with its default and checks; the
    # three export settings are checked together, with traceml run's messages, in
    # __attrs_post_init__.
    exporter: str = attrs.field(default=FROM_TABLE, validator=())
    export_streams: str = attrs.field(default=FROM_TABLE, validator=())
    exporter_hostname: bool = attrs.field(default=FROM_TABLE, validator=())
    logs_dir: str = attrs.field(default=FROM_TABLE, converter=_fspath)
    session_id: str = attrs.field(default=FROM_TABLE, validator=_session_id)
    sampler_interval_sec: float = FROM_TABLE
    bind_host: str = FROM_TABLE
    port: int = FROM_TABLE
    finalize_timeout_sec: float = FROM_TABLE
    # The live views (docs/monitoring.md), served by the aggregator actor.
    prometheus_port: int | None = FROM_TABLE
    prometheus_bind_host: str = FROM_TABLE
    rank_series_max_ranks: int = FROM_TABLE
    otlp: bool = FROM_TABLE
    otlp_trace_sample: int = FROM_TABLE
    dashboard_port: int = FROM_TABLE
    dashboard_bind_host: str = FROM_TABLE
    trackers: str = FROM_TABLE
    tracker_every_steps: int = FROM_TABLE
    parallel: str = FROM_TABLE
    node_relay: bool = FROM_TABLE
    # TraceML 0.5.0's fields.
    mode: str | None = attrs.field(default=None, validator=_one_of(RAY_MODES))
    profile: str | None = attrs.field(default=None, validator=_one_of(PROFILES))
    init_mode: str = "auto"
    patch_dataloader: bool | None = attrs.field(default=None, validator=_optional_bool)
    patch_forward: bool | None = attrs.field(default=None, validator=_optional_bool)
    patch_backward: bool | None = attrs.field(default=None, validator=_optional_bool)
    patch_h2d: bool | None = attrs.field(default=None, validator=_optional_bool)
    summary_window_rows: int | None = attrs.field(default=None, validator=_rows)
    history_retention: float | str | None = attrs.field(default=None, validator=_retention)
    _stop_timeout_sec: float | None = attrs.field(default=None, repr=False, eq=False)
    """``stop_timeout_sec``: ``finalize_timeout_sec``'s former name, still taken (with a
    ``DeprecationWarning``); it sets ``finalize_timeout_sec`` and is None after."""

    def __attrs_post_init__(self) -> None:
        if self._stop_timeout_sec is not None:
            self._take_stop_timeout_sec(self._stop_timeout_sec)
        # Same checks and messages as `traceml run`, with TraceMLRayConfig.<field>
        # in place of the flag; no environment variable or traceml.yaml is read. Parsed
        # once, here: the properties below hand out these values.
        _ = self._export, self._monitor
        try:
            build_config(self.init_mode, **self.init_patches())
        except ValueError as exc:
            raise ValueError(f"{CONFIG_SOURCE}.init_mode: {exc}") from None
        notices = {
            "mode": "there is no terminal view; mode='dashboard' serves a live web page, "
            "mode='summary' prints the run's summary after training",
            "profile": "every worker's steps are traced",
            "summary_window_rows": "the summary covers every step written",
            "history_retention": "there is no history database; the export files keep every line",
        }
        for field, why in notices.items():
            value = getattr(self, field)
            if value is not None and value not in ("summary", "dashboard", "run"):
                _notice(field, value, why)

    def init_patches(self) -> dict[str, bool | None]:
        """The ``patch_*`` keywords each worker's ``traceml.init()`` gets."""
        return {
            "patch_dataloader": self.patch_dataloader,
            "patch_forward": self.patch_forward,
            "patch_backward": self.patch_backward,
            "patch_h2d": self.patch_h2d,
        }

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> TraceMLRayConfig:
        """A config from plain data (a job's JSON or YAML config section).

        An unknown key raises :class:`~traceml_ai._converter.StructureError` (a
        ``ValueError``) naming it with its ``$.key`` path and listing the known keys; a
        value of the wrong kind is named the same way (``"8"`` is no port); the rest is
        checked as when the config is made in code.
        """
        plain = dict(data)
        if "stop_timeout_sec" in plain:
            plain["_stop_timeout_sec"] = plain.pop("stop_timeout_sec")
        return structure(plain, cls, what=CONFIG_SOURCE)

    def to_mapping(self) -> dict[str, Any]:
        """The config as plain data; :meth:`from_mapping` reads it back."""
        data: dict[str, Any] = unstructure(self)
        del data["_stop_timeout_sec"]  # None once made: its value is finalize_timeout_sec
        return data

    def _take_stop_timeout_sec(self, value: object) -> None:
        """``stop_timeout_sec=``: checked as ``finalize_timeout_sec``, then its value."""
        default = FINALIZE_TIMEOUT_SEC.default
        if self.finalize_timeout_sec != default and self.finalize_timeout_sec != value:
            raise ValueError(
                f"{CONFIG_SOURCE}: stop_timeout_sec is finalize_timeout_sec's former name; "
                "give finalize_timeout_sec only"
            )
        check_code_value(FINALIZE_TIMEOUT_SEC, value, f"{CONFIG_SOURCE}.stop_timeout_sec")
        _deprecated_stop_timeout_sec(value)
        object.__setattr__(self, "finalize_timeout_sec", value)
        object.__setattr__(self, "_stop_timeout_sec", None)

    @property
    def stop_timeout_sec(self) -> float:
        """``finalize_timeout_sec`` by its former name."""
        return self.finalize_timeout_sec

    @functools.cached_property
    def _export(self) -> ResolvedExportSettings:
        return settings_from_values(
            exporter=self.exporter or ("jsonl" if self.mode in ("summary", "dashboard") else ""),
            export_streams=self.export_streams,
            exporter_hostname=self.exporter_hostname,
            source=CONFIG_SOURCE,
        )

    @functools.cached_property
    def _monitor(self) -> MonitorSettings:
        # Each live view's setting from its Ray field (a text one, trackers, parsed by
        # the table); the dashboard is served with mode="dashboard".
        values: dict[str, Any] = {"dashboard": self.mode == "dashboard"}
        for setting in table_settings(MonitorSettings):
            if setting.ray is not None:
                value = getattr(self, setting.ray)
                values[setting.name] = setting.read(value) if setting.kind is str else value
        return MonitorSettings(**values)

    def resolved_settings(self) -> ResolvedExportSettings:
        """The validated export settings, with the selected stream names."""
        return self._export

    @property
    def monitor_settings(self) -> MonitorSettings:
        """The live views the aggregator actor serves."""
        return self._monitor

    @property
    def export_settings(self) -> ExportSettings:
        """The normalized settings the aggregator runs with."""
        return self._export.settings

    @property
    def export_enabled(self) -> bool:
        """Whether an exporter is set (``exporter`` is not ``""``, or ``mode`` is
        ``"summary"`` or ``"dashboard"``)."""
        return self.export_settings.exporter_kind != "off"

    def run_dir(self, session_id: str) -> Path:
        """``<logs_dir>/<session_id>`` as an absolute path, resolved on the driver."""
        return Path(self.logs_dir).expanduser().absolute() / session_id
