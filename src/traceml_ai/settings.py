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

torchrun's own options of ``traceml run`` (``--nproc-per-node``, ``--nnodes``,
``--node-rank``, ``--master-addr``, ``--master-port``) are not settings: they are
read from the command line only, as torchrun reads them.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Generic, Literal, TypeVar

import attrs
import yaml

from traceml_records import SELECTION_NAMES, parse_export_streams

__all__ = [
    "AGGREGATOR_BIND_HOST",
    "AGGREGATOR_HOST",
    "AGGREGATOR_PORT",
    "BOOL_FORMS",
    "CLI_EXPORTER",
    "CLI_EXPORTER_HOSTNAME",
    "CLI_EXPORT_STREAMS",
    "DEFAULT_EXPORTER",
    "DEFAULT_EXPORTER_HOSTNAME",
    "DEFAULT_EXPORT_STREAMS",
    "ENV_EXPORTER",
    "ENV_EXPORTER_HOSTNAME",
    "ENV_EXPORT_STREAMS",
    "EXPORTER",
    "EXPORTER_FORMS",
    "EXPORTER_HOSTNAME",
    "EXPORT_STREAMS",
    "FINALIZE_TIMEOUT_SEC",
    "INTERVAL",
    "KNOWN_YAML_KEYS",
    "LOGS_DIR",
    "NNODES",
    "NPROC_PER_NODE",
    "RUN_NAME",
    "RUN_TORCHRUN_OPTIONS",
    "SETTINGS",
    "SOURCE_DEFAULT",
    "YAML_FILENAME",
    "Command",
    "ExportSettings",
    "ExporterKind",
    "LaunchSettings",
    "MonitorSettings",
    "ResolvedExportSettings",
    "Setting",
    "SettingSources",
    "SettingsError",
    "YamlConfig",
    "exporter_kind",
    "load_yaml_config",
    "parse_bool_value",
    "parse_exporter_value",
    "resolve_export_settings",
    "resolve_launch_settings",
    "settings_from_values",
    "settings_table_markdown",
]

YAML_FILENAME = "traceml.yaml"
SOURCE_DEFAULT = "default"

EXPORTER_FORMS = "'' (off), 'jsonl', or 'module.path:factory'"
BOOL_FORMS = "one of 1/0, true/false, yes/no, on/off"
PORT_FORMS = "an integer in [0, 65535] (0 picks a free port)"

_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})

ExporterKind = Literal["off", "jsonl", "custom"]
Command = Literal["run", "serve"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class SettingsError(ValueError):
    """A setting has an invalid value; the message names where the value came from."""


# --- parsers: the text of a flag, a variable or a YAML scalar -> a checked value ------


def parse_exporter_value(text: str) -> str:
    """Validate and normalize an exporter value.

    Accepts ``""`` (off), ``jsonl``, or ``module.path:factory`` where the module path is
    one or more dot-separated Python identifiers and the factory one identifier, with
    exactly one colon. ``off``, ``false``, ``no`` and ``0`` (any case) also mean off
    and normalize to ``""``: YAML reads ``exporter: off`` as the boolean false, and
    a user who writes it means off. Surrounding whitespace is trimmed. Raises
    ``ValueError`` otherwise.
    """
    value = text.strip()
    if value in ("", "jsonl"):
        return value
    if value.lower() in _FALSE_WORDS:
        return ""
    module, sep, factory = value.partition(":")
    if sep and factory.isidentifier() and all(part.isidentifier() for part in module.split(".")):
        return value
    raise ValueError(f"expected {EXPORTER_FORMS}, got {text!r}")


def exporter_kind(value: str) -> ExporterKind:
    """Classify an exporter value; raises ``ValueError`` if it is malformed."""
    normalized = parse_exporter_value(value)
    if normalized == "":
        return "off"
    if normalized == "jsonl":
        return "jsonl"
    return "custom"


def parse_bool_value(text: str) -> bool:
    """Parse 1/0, true/false, yes/no, on/off (any case, trimmed); else ``ValueError``."""
    word = text.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ValueError(f"expected {BOOL_FORMS}, got {text!r}")


def _parse_streams(text: str) -> str:
    # Kept as written (trimmed): the aggregator and the child processes parse it again.
    parse_export_streams(text)
    return text.strip()


def _parse_seconds(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"expected a positive number of seconds, got {text!r}")
    return value


def _parse_int(text: str, low: int, high: int | None, forms: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"expected {forms}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise ValueError(f"expected {forms}, got {text!r}")
    return value


def _parse_port(text: str) -> int:
    return _parse_int(text, 0, 65535, PORT_FORMS)


def _parse_count(text: str) -> int:
    return _parse_int(text, 1, None, "a whole number of at least 1")


def _parse_host(text: str) -> str:
    value = text.strip()
    if not value or any(c.isspace() for c in value):
        raise ValueError(f"expected a host name or an IP address, got {text!r}")
    return value


def _parse_folder(text: str) -> Path:
    # Whether the folder can be created is checked where it is created.
    if not text or "\x00" in text:
        raise ValueError(f"expected a folder path, got {text!r}")
    return Path(text)


def _parse_run_name(text: str) -> str:
    # What a folder name may hold is checked by the launcher, with the folder.
    if not text:
        raise ValueError(f"expected a folder name, got {text!r}")
    return text


# --- the table -----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Setting(Generic[T_co]):
    """One launcher setting: where it is read from, how it is parsed, its default.

    ``name`` is the ``traceml.yaml`` key; the flag is ``--`` plus the name with dashes
    and the environment variable ``TRACEML_`` plus the name in capitals. ``parse``
    takes the text of any layer and raises ``ValueError`` for a malformed value.
    ``default`` ``None`` means the command decides (``default_doc`` says how).
    """

    name: str
    parse: Callable[[str], T_co]
    default: T_co | None
    default_doc: str
    expected: str
    help: str
    metavar: str
    commands: tuple[Command, ...]

    @property
    def flag(self) -> str:
        """The CLI flag, e.g. ``--logs-dir``."""
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        """The environment variable, e.g. ``TRACEML_LOGS_DIR``."""
        return "TRACEML_" + self.name.upper()

    @property
    def yaml_key(self) -> str:
        """The ``traceml.yaml`` key (the setting's name)."""
        return self.name

    @property
    def is_switch(self) -> bool:
        """An on/off setting: a ``--flag/--no-flag`` pair on the command line."""
        return self.parse is parse_bool_value


_BOTH: tuple[Command, ...] = ("run", "serve")

EXPORTER: Setting[str] = Setting(
    name="exporter",
    parse=parse_exporter_value,
    default="",
    default_doc="off",
    expected=EXPORTER_FORMS,
    help="Exporter: '' or off, 'jsonl', or 'module.path:factory'.",
    metavar="EXPORTER",
    commands=_BOTH,
)
EXPORT_STREAMS: Setting[str] = Setting(
    name="export_streams",
    parse=_parse_streams,
    default="step_time",
    default_doc="step_time",
    expected="comma-separated stream names from " + ", ".join(SELECTION_NAMES),
    help="Streams to export, comma-separated: " + ", ".join(SELECTION_NAMES) + ".",
    metavar="NAMES",
    commands=_BOTH,
)
EXPORTER_HOSTNAME: Setting[bool] = Setting(
    name="exporter_hostname",
    parse=parse_bool_value,
    default=False,
    default_doc="off",
    expected=BOOL_FORMS,
    help="Include hostname on the lines that carry it.",
    metavar="",
    commands=_BOTH,
)
LOGS_DIR: Setting[Path] = Setting(
    name="logs_dir",
    parse=_parse_folder,
    default=Path("logs"),
    default_doc="logs",
    expected="a folder path",
    help="Where run folders are created.",
    metavar="DIR",
    commands=_BOTH,
)
RUN_NAME: Setting[str] = Setting(
    name="run_name",
    parse=_parse_run_name,
    default=None,
    default_doc="UTC timestamp plus a random suffix",
    expected="a folder name",
    help="Run folder name.",
    metavar="NAME",
    commands=_BOTH,
)
INTERVAL: Setting[float] = Setting(
    name="interval",
    parse=_parse_seconds,
    default=2.0,
    default_doc="2.0",
    expected="a positive number of seconds",
    help="Seconds between process/system samples.",
    metavar="SECONDS",
    commands=("run",),
)
FINALIZE_TIMEOUT_SEC: Setting[float] = Setting(
    name="finalize_timeout_sec",
    parse=_parse_seconds,
    default=10.0,
    default_doc="10.0",
    expected="a positive number of seconds",
    help="Longest wait for pending records at shutdown.",
    metavar="SECONDS",
    commands=_BOTH,
)
AGGREGATOR_HOST: Setting[str] = Setting(
    name="aggregator_host",
    parse=_parse_host,
    default=None,
    default_doc="start one on node 0",
    expected="a host name or an IP address",
    help="Send to an aggregator already running there (e.g. `traceml serve`) "
    "instead of starting one on node 0.",
    metavar="HOST",
    commands=("run",),
)
AGGREGATOR_PORT: Setting[int] = Setting(
    name="aggregator_port",
    parse=_parse_port,
    default=None,
    default_doc="run: a free port on one node, 29600 across nodes; serve: 29600",
    expected=PORT_FORMS,
    help="Aggregator port (0 picks a free one).",
    metavar="PORT",
    commands=_BOTH,
)
AGGREGATOR_BIND_HOST: Setting[str] = Setting(
    name="aggregator_bind_host",
    parse=_parse_host,
    default="127.0.0.1",
    default_doc="127.0.0.1",
    expected="a host name or an IP address",
    help="Address to listen on (0.0.0.0 for ranks on other hosts).",
    metavar="HOST",
    commands=("serve",),
)
NNODES: Setting[int] = Setting(
    name="nnodes",
    parse=_parse_count,
    default=None,
    default_doc="1 with --nproc-per-node",
    expected="a whole number of at least 1",
    help="Nodes in the job (with --nproc-per-node gives the world size).",
    metavar="N",
    commands=("serve",),
)
NPROC_PER_NODE: Setting[int] = Setting(
    name="nproc_per_node",
    parse=_parse_count,
    default=None,
    default_doc="the world size the first rank reports",
    expected="a whole number of at least 1",
    help="Ranks per node; without it, the world size the first rank reports is expected.",
    metavar="N",
    commands=("serve",),
)

PROMETHEUS_PORT: Setting[int] = Setting(
    name="prometheus_port",
    parse=_parse_port,
    default=None,
    default_doc="off",
    expected=PORT_FORMS,
    help="Serve Prometheus metrics at http://HOST:PORT/metrics from the aggregator "
    "(needs the 'prometheus' extra; 0 picks a free port).",
    metavar="PORT",
    commands=_BOTH,
)
PROMETHEUS_BIND_HOST: Setting[str] = Setting(
    name="prometheus_bind_host",
    parse=_parse_host,
    default="127.0.0.1",
    default_doc="127.0.0.1",
    expected="a host name or an IP address",
    help="Address the /metrics endpoint listens on (0.0.0.0 to be scraped from other hosts).",
    metavar="HOST",
    commands=_BOTH,
)
OTLP: Setting[bool] = Setting(
    name="otlp",
    parse=parse_bool_value,
    default=False,
    default_doc="off",
    expected=BOOL_FORMS,
    help="Export metrics and step traces with OpenTelemetry (OTLP) from the aggregator, "
    "to where the OTEL_EXPORTER_OTLP_* variables say (needs the 'otel' extra).",
    metavar="",
    commands=_BOTH,
)
OTLP_TRACE_SAMPLE: Setting[int] = Setting(
    name="otlp_trace_sample",
    parse=_parse_count,
    default=100,
    default_doc="100",
    expected="a whole number of at least 1",
    help="Trace one step in N per rank (plus every step far above its rank's recent "
    "median); 1 traces every step.",
    metavar="N",
    commands=_BOTH,
)
DASHBOARD: Setting[bool] = Setting(
    name="dashboard",
    parse=parse_bool_value,
    default=False,
    default_doc="off",
    expected=BOOL_FORMS,
    help="Serve the live dashboard from the aggregator (needs the 'dashboard' extra); "
    "traceml run --mode dashboard sets it.",
    metavar="",
    commands=_BOTH,
)
DASHBOARD_PORT: Setting[int] = Setting(
    name="dashboard_port",
    parse=_parse_port,
    default=8765,
    default_doc="8765",
    expected=PORT_FORMS,
    help="Port of the live dashboard (--mode dashboard; 0 picks a free port).",
    metavar="PORT",
    commands=_BOTH,
)
DASHBOARD_BIND_HOST: Setting[str] = Setting(
    name="dashboard_bind_host",
    parse=_parse_host,
    default="127.0.0.1",
    default_doc="127.0.0.1",
    expected="a host name or an IP address",
    help="Address the dashboard listens on.",
    metavar="HOST",
    commands=_BOTH,
)

SETTINGS: tuple[Setting[object], ...] = (
    EXPORTER,
    EXPORT_STREAMS,
    EXPORTER_HOSTNAME,
    LOGS_DIR,
    RUN_NAME,
    INTERVAL,
    FINALIZE_TIMEOUT_SEC,
    AGGREGATOR_HOST,
    AGGREGATOR_PORT,
    AGGREGATOR_BIND_HOST,
    NNODES,
    NPROC_PER_NODE,
    PROMETHEUS_PORT,
    PROMETHEUS_BIND_HOST,
    OTLP,
    OTLP_TRACE_SAMPLE,
    DASHBOARD,
    DASHBOARD_PORT,
    DASHBOARD_BIND_HOST,
)
"""Every setting of ``traceml run`` and ``traceml serve``, in the order of the docs."""

RUN_TORCHRUN_OPTIONS = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port")
"""``traceml run``'s torchrun options: command line only, never from env or YAML."""

# Other TraceML features may add their own keys here (``KNOWN_YAML_KEYS.add(...)``) so
# that they stop being reported as unknown; the file is shared by every setting.
KNOWN_YAML_KEYS: set[str] = {s.yaml_key for s in SETTINGS}

ENV_EXPORTER = EXPORTER.env
ENV_EXPORT_STREAMS = EXPORT_STREAMS.env
ENV_EXPORTER_HOSTNAME = EXPORTER_HOSTNAME.env
CLI_EXPORTER = EXPORTER.flag
CLI_EXPORT_STREAMS = EXPORT_STREAMS.flag
CLI_EXPORTER_HOSTNAME = EXPORTER_HOSTNAME.flag
DEFAULT_EXPORTER = ""
DEFAULT_EXPORT_STREAMS = "step_time"
DEFAULT_EXPORTER_HOSTNAME = False


# --- results -------------------------------------------------------------------------


@attrs.frozen(slots=True)
class ExportSettings:
    """The validated export settings of one run.

    ``exporter`` is normalized (trimmed, off is ``""``); ``export_streams`` is the text
    as the user wrote it, trimmed (parse it with
    ``traceml_records.parse_export_streams``).
    """

    exporter: str = DEFAULT_EXPORTER
    export_streams: str = DEFAULT_EXPORT_STREAMS
    exporter_hostname: bool = DEFAULT_EXPORTER_HOSTNAME

    @property
    def exporter_kind(self) -> ExporterKind:
        """Whether export is off, the built-in JSONL exporter, or a custom factory."""
        return exporter_kind(self.exporter)

    def as_environ(self) -> dict[str, str]:
        """The settings as ``TRACEML_*`` variables, for handing to a child process."""
        return {
            ENV_EXPORTER: self.exporter,
            ENV_EXPORT_STREAMS: self.export_streams,
            ENV_EXPORTER_HOSTNAME: "1" if self.exporter_hostname else "0",
        }


@attrs.frozen(kw_only=True)
class MonitorSettings:
    """Where the aggregator shows the run live, besides (or instead of) the files.

    Everything is off by default: ``prometheus_port`` None serves no ``/metrics``,
    ``otlp`` False exports nothing over OTLP, ``dashboard`` False serves no page.
    """

    prometheus_port: int | None = None
    prometheus_bind_host: str = "127.0.0.1"
    otlp: bool = False
    otlp_trace_sample: int = 100
    dashboard: bool = False
    dashboard_port: int = 8765
    dashboard_bind_host: str = "127.0.0.1"

    @property
    def any_on(self) -> bool:
        """Whether any live view is on."""
        return self.prometheus_port is not None or self.otlp or self.dashboard


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
    """The outcome of resolution: settings, their sources, parsed streams and warnings."""

    settings: ExportSettings
    sources: SettingSources
    selected_streams: tuple[str, ...]
    warnings: tuple[str, ...] = ()


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


# --- traceml.yaml --------------------------------------------------------------------


@attrs.frozen(slots=True)
class YamlConfig:
    """The top-level mapping of a ``traceml.yaml`` file and its source label."""

    path: Path
    source: str
    data: Mapping[object, object]


def load_yaml_config(path: Path) -> YamlConfig | None:
    """Read ``traceml.yaml`` at ``path``; ``None`` when the file does not exist.

    Raises :class:`SettingsError` naming the file for an unreadable file, a YAML syntax
    error (with its line and column) or a top level that is not a mapping. An empty
    file counts as an empty mapping. Keys are not checked here (see
    :data:`KNOWN_YAML_KEYS`).
    """
    abs_path = path.absolute()
    source = f"{YAML_FILENAME} ({abs_path})"
    try:
        text = abs_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as exc:
        raise SettingsError(f"{source}: not valid UTF-8 ({exc.reason})") from exc
    except OSError as exc:
        raise SettingsError(f"{source}: cannot read file: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown line"
        problem = exc.problem or exc.context or "syntax error"
        raise SettingsError(f"{source}: invalid YAML at {where}: {problem}") from exc
    except yaml.YAMLError as exc:
        raise SettingsError(f"{source}: invalid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SettingsError(
            f"{source}: expected a mapping of setting names to values at the top level, "
            f"got {_yaml_type_name(data)}"
        )
    return YamlConfig(path=abs_path, source=source, data=data)


def _yaml_type_name(value: object) -> str:
    names: dict[type, str] = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }
    return names.get(type(value), type(value).__name__)


def _describe(value: object) -> str:
    """``a boolean True``-style text for type errors."""
    if value is None:
        return "None"
    return f"{_yaml_type_name(value)} {value!r}"


def _check_yaml_keys(config: YamlConfig) -> None:
    """An unknown key is an error that lists the known ones (likely a typo).

    Checked here rather than by the cattrs converter: the known keys are an open set
    (:data:`KNOWN_YAML_KEYS`) and each value is parsed by its setting, in its layer.
    """
    known = sorted(KNOWN_YAML_KEYS)
    unknown: list[str] = []
    for key in config.data:
        if isinstance(key, str) and key in KNOWN_YAML_KEYS:
            continue
        hint = ""
        if isinstance(key, str):
            close = difflib.get_close_matches(key, known, n=1)
            if close:
                hint = f" (did you mean {close[0]!r}?)"
        # The key's path in the document, as the converter's messages write it.
        path = f"$.{key}" if isinstance(key, str) and key.isidentifier() else f"$[{key!r}]"
        unknown.append(f"{key!r} at {path}{hint}")
    if unknown:
        noun = "key" if len(unknown) == 1 else "keys"
        raise SettingsError(
            f"{config.source}: unknown {noun} {', '.join(unknown)}; known keys: {', '.join(known)}"
        )


# --- resolution ----------------------------------------------------------------------


def _scalar_text(value: object) -> str | None:
    """A YAML scalar as the text an environment variable would hold; None if not one."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    return None


def _parse_value(setting: Setting[T], value: object, label: str) -> T:
    """Parse one layer's value; errors start with ``label`` (the setting and layer)."""
    text = _scalar_text(value)
    if text is None:
        raise SettingsError(f"{label}: expected {setting.expected}, got {_describe(value)}")
    try:
        return setting.parse(text)
    except ValueError as exc:
        if isinstance(value, str):
            raise SettingsError(f"{label}: {exc}") from exc
        # Say what YAML read (a boolean True), not the text it was turned into.
        raise SettingsError(
            f"{label}: expected {setting.expected}, got {_describe(value)}"
        ) from exc


@attrs.frozen(slots=True)
class _Layers:
    environ: Mapping[str, str]
    yaml: YamlConfig | None


def _load_layers(environ: Mapping[str, str] | None, yaml_path: Path | None) -> _Layers:
    env = os.environ if environ is None else environ
    path = Path.cwd() / YAML_FILENAME if yaml_path is None else yaml_path
    config = load_yaml_config(path)
    if config is not None:
        _check_yaml_keys(config)
    return _Layers(env, config)


def _resolve_one(setting: Setting[T], cli_value: object, layers: _Layers) -> tuple[T | None, str]:
    """The winning layer's value of one setting, parsed, and that layer's name.

    A CLI value of ``None`` means the flag was not given. An environment variable
    counts as set whenever it is present, even when empty.
    """
    if cli_value is not None:
        return _parse_value(setting, cli_value, setting.flag), setting.flag
    if setting.env in layers.environ:
        return _parse_value(setting, layers.environ[setting.env], setting.env), setting.env
    if layers.yaml is not None:
        value = layers.yaml.data.get(setting.yaml_key)
        if value is not None:  # YAML null (``key:`` or ``key: ~``) counts as not set
            label = f"{layers.yaml.source}: {setting.yaml_key}"
            return _parse_value(setting, value, label), layers.yaml.source
    return setting.default, SOURCE_DEFAULT


def _export_result(
    exporter: tuple[str | None, str],
    streams: tuple[str | None, str],
    hostname: tuple[bool | None, str],
) -> ResolvedExportSettings:
    settings = ExportSettings(
        DEFAULT_EXPORTER if exporter[0] is None else exporter[0],
        DEFAULT_EXPORT_STREAMS if streams[0] is None else streams[0],
        DEFAULT_EXPORTER_HOSTNAME if hostname[0] is None else hostname[0],
    )
    return ResolvedExportSettings(
        settings=settings,
        sources=SettingSources(exporter[1], streams[1], hostname[1]),
        selected_streams=parse_export_streams(settings.export_streams),
    )


def resolve_export_settings(
    *,
    cli_exporter: str | None,
    cli_export_streams: str | None,
    cli_exporter_hostname: bool | None,
    environ: Mapping[str, str] | None = None,
    yaml_path: Path | None = None,
) -> ResolvedExportSettings:
    """Resolve and validate the three export settings (see :func:`resolve_launch_settings`).

    A CLI argument of ``None`` means the flag was not given. ``environ`` defaults to
    ``os.environ`` and ``yaml_path`` to ``traceml.yaml`` in the current directory.

    An environment variable counts as set whenever it is present, even when empty:
    ``TRACEML_EXPORTER=""`` explicitly switches export off (overriding
    ``traceml.yaml``), while an empty ``TRACEML_EXPORT_STREAMS`` or
    ``TRACEML_EXPORTER_HOSTNAME`` is an error. A YAML value of ``null`` counts as not
    set. ``export_streams`` is validated even when export is off.

    Raises :class:`SettingsError` whose message starts with the value's source.
    """
    layers = _load_layers(environ, yaml_path)
    return _export_result(
        _resolve_one(EXPORTER, cli_exporter, layers),
        _resolve_one(EXPORT_STREAMS, cli_export_streams, layers),
        _resolve_one(EXPORTER_HOSTNAME, cli_exporter_hostname, layers),
    )


def resolve_launch_settings(
    command: Command,
    cli: Mapping[str, object],
    *,
    environ: Mapping[str, str] | None = None,
    yaml_path: Path | None = None,
) -> LaunchSettings:
    """Resolve and validate every setting ``command`` takes, from :data:`SETTINGS`.

    ``cli`` maps a setting's name to its flag's value (text, or a bool for an on/off
    flag); a missing name or ``None`` means the flag was not given. Settings of other
    commands are not read and keep their defaults. Raises :class:`SettingsError` with
    one line naming the setting and its layer, e.g. ``TRACEML_INTERVAL: expected a
    positive number of seconds, got 'x'``.
    """
    layers = _load_layers(environ, yaml_path)
    sources: dict[str, str] = {}

    def get(setting: Setting[T]) -> T | None:
        if command not in setting.commands:
            sources[setting.name] = SOURCE_DEFAULT
            return setting.default
        value, source = _resolve_one(setting, cli.get(setting.name), layers)
        sources[setting.name] = source
        return value

    export = _export_result(
        (get(EXPORTER), sources[EXPORTER.name]),
        (get(EXPORT_STREAMS), sources[EXPORT_STREAMS.name]),
        (get(EXPORTER_HOSTNAME), sources[EXPORTER_HOSTNAME.name]),
    )
    logs_dir = get(LOGS_DIR)
    interval = get(INTERVAL)
    finalize_timeout_sec = get(FINALIZE_TIMEOUT_SEC)
    bind_host = get(AGGREGATOR_BIND_HOST)
    # These four have a default, so only a parser bug could leave them unset.
    assert logs_dir is not None and interval is not None
    assert finalize_timeout_sec is not None and bind_host is not None
    return LaunchSettings(
        command=command,
        logs_dir=logs_dir,
        run_name=get(RUN_NAME),
        interval=interval,
        finalize_timeout_sec=finalize_timeout_sec,
        aggregator_host=get(AGGREGATOR_HOST),
        aggregator_port=get(AGGREGATOR_PORT),
        aggregator_bind_host=bind_host,
        nnodes=get(NNODES),
        nproc_per_node=get(NPROC_PER_NODE),
        export=export,
        sources=sources,
        monitor=MonitorSettings(
            prometheus_port=get(PROMETHEUS_PORT),
            prometheus_bind_host=_given(get(PROMETHEUS_BIND_HOST), PROMETHEUS_BIND_HOST),
            otlp=_given(get(OTLP), OTLP),
            otlp_trace_sample=_given(get(OTLP_TRACE_SAMPLE), OTLP_TRACE_SAMPLE),
            dashboard=_given(get(DASHBOARD), DASHBOARD),
            dashboard_port=_given(get(DASHBOARD_PORT), DASHBOARD_PORT),
            dashboard_bind_host=_given(get(DASHBOARD_BIND_HOST), DASHBOARD_BIND_HOST),
        ),
        warnings=tuple(_ignored_torchrun_settings(command, layers)),
    )


def _given(value: T | None, setting: Setting[T]) -> T:
    """A setting with a default always resolves to a value."""
    result = setting.default if value is None else value
    assert result is not None
    return result


def _ignored_torchrun_settings(command: Command, layers: _Layers) -> Iterable[str]:
    """Serve's nnodes/nproc_per_node set in env or YAML do nothing for ``run``: say so."""
    if command != "run":
        return
    for setting in SETTINGS:
        if setting.name not in RUN_TORCHRUN_OPTIONS:
            continue
        where = None
        if setting.env in layers.environ:
            where = setting.env
        elif layers.yaml is not None and layers.yaml.data.get(setting.yaml_key) is not None:
            where = f"{layers.yaml.source}: {setting.yaml_key}"
        if where is not None:
            yield (
                f"{where} is read by `traceml serve` only; `traceml run` takes "
                f"{setting.flag} on its command line, as torchrun does"
            )


def settings_from_values(
    *,
    exporter: object,
    export_streams: object,
    exporter_hostname: object,
    source: str,
) -> ResolvedExportSettings:
    """Validate settings given directly in code (e.g. ``TraceMLRayConfig`` fields).

    No environment or file is consulted. Errors name ``f"{source}.{field}"``, e.g.
    ``TraceMLRayConfig.export_streams: unknown stream ...``. ``exporter`` and
    ``export_streams`` must be strings and ``exporter_hostname`` a real ``bool``
    here: code has types, so no text stands in for them.
    """
    for setting, value, kind in (
        (EXPORTER, exporter, str),
        (EXPORT_STREAMS, export_streams, str),
        (EXPORTER_HOSTNAME, exporter_hostname, bool),
    ):
        if not isinstance(value, kind):
            expected = "a boolean," if kind is bool else f"a string, {setting.expected};"
            raise SettingsError(
                f"{source}.{setting.name}: expected {expected} got {_describe(value)}"
            )
    return _export_result(
        (_parse_value(EXPORTER, exporter, f"{source}.exporter"), source),
        (_parse_value(EXPORT_STREAMS, export_streams, f"{source}.export_streams"), source),
        (_parse_value(EXPORTER_HOSTNAME, exporter_hostname, f"{source}.exporter_hostname"), source),
    )


# --- documentation -------------------------------------------------------------------


def settings_table_markdown() -> str:
    """The Settings table of ``docs/live-export.md``, generated from :data:`SETTINGS`."""
    rows = [
        "| Setting (`traceml.yaml` key) | Flag | Environment variable | Default | Commands |",
        "|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        flag = f"`{s.flag}` / `--no-{s.flag[2:]}`" if s.is_switch else f"`{s.flag}`"
        commands = ", ".join(s.commands)
        rows.append(f"| `{s.yaml_key}` | {flag} | `{s.env}` | {s.default_doc} | {commands} |")
    return "\n".join(rows) + "\n"
