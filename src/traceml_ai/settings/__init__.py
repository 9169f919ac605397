"""Settings resolution shared by ``traceml run``, ``traceml serve`` and the Ray config.

One table, :data:`SETTINGS`, declares every setting of the launcher: its name (which
is also its ``traceml.yaml`` key), the flag ``--<name-with-dashes>``, the environment
variable ``TRACEML_<NAME>``, the parser that turns text into a value (and checks it),
the default and the commands that take it. Each setting resolves on its own, and the
first layer that sets it wins:

1. the CLI flag (``--exporter``, ``--logs-dir``, ...),
2. the environment (``TRACEML_EXPORTER``, ``TRACEML_LOGS_DIR``, ...),
3. ``traceml.yaml`` in the current working directory (keys ``exporter``,
   ``logs_dir``, ...),
4. the default.

Every layer goes through the same parser: a YAML scalar is read as the text an
environment variable would hold (YAML's ``off`` is the boolean false, read as
``false``; ``1`` is read as ``1``). Only the winning value of each setting is
validated, so a flag can override a bad value further down, and an error names the
setting and the layer it came from. A present but broken ``traceml.yaml`` (syntax
error, not a mapping, unreadable, a key no setting has) is always an error, because
the user asked for that file to be read.

The package is split by concern: _table (the table: one entry per setting, and
the constants it names once, such as the dashboard's default port), _parse (the
parsers, and :class:`ExportStreams`, the one typed value of ``export_streams``),
_values (the typed settings objects), _load (``traceml.yaml``, the
environment, resolution) and _derived (what the table gives: the click options,
the ``TraceMLRayConfig`` fields, the docs' table). Import from
``traceml_ai.settings``; ``python -m traceml_ai.settings [--check]`` rewrites (or
checks) the docs' table.

torchrun's own options of ``traceml run`` (``--nproc-per-node``, ``--nnodes``,
``--node-rank``, ``--master-addr``, ``--master-port``) are not settings: they are
read from the command line only, as torchrun reads them.
"""

from traceml_ai._ports import DEFAULT_DASHBOARD_PORT, DEFAULT_SERVE_PORT, LOOPBACK
from traceml_ai.settings._derived import (
    FROM_TABLE,
    RAY_CONFIG_SOURCE,
    check_code_value,
    click_options,
    ray_fields,
    ray_settings,
    settings_fields,
    settings_table_markdown,
    table_settings,
)
from traceml_ai.settings._load import (
    YamlConfig,
    load_yaml_config,
    resolve_export_settings,
    resolve_launch_settings,
    settings_from_values,
)
from traceml_ai.settings._parse import (
    BOOL_FORMS,
    EXPORTER_FORMS,
    PARALLEL_FORMS,
    TRACKER_NAMES,
    Bounds,
    Command,
    ExporterKind,
    ExportStreams,
    OutOfBounds,
    SettingsError,
    exporter_kind,
    parse_bool_value,
    parse_exporter_value,
    parse_host,
    parse_parallel,
    parse_parallel_layout,
    parse_trackers,
)
from traceml_ai.settings._table import (
    AGGREGATOR_BIND_HOST,
    AGGREGATOR_HOST,
    AGGREGATOR_PORT,
    CLI_EXPORT_STREAMS,
    CLI_EXPORTER,
    CLI_EXPORTER_HOSTNAME,
    DASHBOARD,
    DASHBOARD_BIND_HOST,
    DASHBOARD_PORT,
    DEFAULT_EXPORT_STREAMS,
    DEFAULT_EXPORTER,
    DEFAULT_EXPORTER_HOSTNAME,
    DEFAULT_FINALIZE_TIMEOUT_SEC,
    ENV_EXPORT_STREAMS,
    ENV_EXPORTER,
    ENV_EXPORTER_HOSTNAME,
    EXPORT_STREAMS,
    EXPORTER,
    EXPORTER_HOSTNAME,
    FINALIZE_TIMEOUT_SEC,
    INTERVAL,
    KNOWN_YAML_KEYS,
    LOGS_DIR,
    NNODES,
    NPROC_PER_NODE,
    OTLP,
    OTLP_TRACE_SAMPLE,
    PARALLEL,
    PROMETHEUS_BIND_HOST,
    PROMETHEUS_PORT,
    RANK_SERIES_MAX_RANKS,
    RUN_NAME,
    RUN_TORCHRUN_OPTIONS,
    SETTINGS,
    SETTINGS_BY_NAME,
    TRACKER_EVERY_STEPS,
    TRACKERS,
    Setting,
)
from traceml_ai.settings._values import (
    SOURCE_DEFAULT,
    YAML_FILENAME,
    ExportSettings,
    LaunchSettings,
    MonitorSettings,
    ResolvedExportSettings,
    SettingSources,
)

__all__ = [
    "AGGREGATOR_BIND_HOST",
    "AGGREGATOR_HOST",
    "AGGREGATOR_PORT",
    "BOOL_FORMS",
    "CLI_EXPORTER",
    "CLI_EXPORTER_HOSTNAME",
    "CLI_EXPORT_STREAMS",
    "DASHBOARD",
    "DASHBOARD_BIND_HOST",
    "DASHBOARD_PORT",
    "DEFAULT_DASHBOARD_PORT",
    "DEFAULT_EXPORTER",
    "DEFAULT_EXPORTER_HOSTNAME",
    "DEFAULT_EXPORT_STREAMS",
    "DEFAULT_FINALIZE_TIMEOUT_SEC",
    "DEFAULT_SERVE_PORT",
    "ENV_EXPORTER",
    "ENV_EXPORTER_HOSTNAME",
    "ENV_EXPORT_STREAMS",
    "EXPORTER",
    "EXPORTER_FORMS",
    "EXPORTER_HOSTNAME",
    "EXPORT_STREAMS",
    "FINALIZE_TIMEOUT_SEC",
    "FROM_TABLE",
    "INTERVAL",
    "KNOWN_YAML_KEYS",
    "LOGS_DIR",
    "LOOPBACK",
    "NNODES",
    "NPROC_PER_NODE",
    "OTLP",
    "OTLP_TRACE_SAMPLE",
    "PARALLEL",
    "PARALLEL_FORMS",
    "PROMETHEUS_BIND_HOST",
    "PROMETHEUS_PORT",
    "RANK_SERIES_MAX_RANKS",
    "RAY_CONFIG_SOURCE",
    "RUN_NAME",
    "RUN_TORCHRUN_OPTIONS",
    "SETTINGS",
    "SETTINGS_BY_NAME",
    "SOURCE_DEFAULT",
    "TRACKERS",
    "TRACKER_EVERY_STEPS",
    "TRACKER_NAMES",
    "YAML_FILENAME",
    "Bounds",
    "Command",
    "ExportSettings",
    "ExportStreams",
    "ExporterKind",
    "LaunchSettings",
    "MonitorSettings",
    "OutOfBounds",
    "ResolvedExportSettings",
    "Setting",
    "SettingSources",
    "SettingsError",
    "YamlConfig",
    "check_code_value",
    "click_options",
    "exporter_kind",
    "load_yaml_config",
    "parse_bool_value",
    "parse_exporter_value",
    "parse_host",
    "parse_parallel",
    "parse_parallel_layout",
    "parse_trackers",
    "ray_fields",
    "ray_settings",
    "resolve_export_settings",
    "resolve_launch_settings",
    "settings_fields",
    "settings_from_values",
    "settings_table_markdown",
    "table_settings",
]
