"""Export settings resolution shared by ``traceml run``, ``traceml serve`` and the Ray config.

Each of the three export settings resolves independently, first layer that sets it wins:

1. the CLI flag (``--exporter``, ``--export-streams``, ``--exporter-hostname``),
2. the environment (``TRACEML_EXPORTER``, ``TRACEML_EXPORT_STREAMS``,
   ``TRACEML_EXPORTER_HOSTNAME``),
3. ``traceml.yaml`` in the current working directory (keys ``exporter``,
   ``export_streams``, ``exporter_hostname``),
4. the default (``""`` = off, ``"step_time"``, ``False``).

Only the winning value of each setting is validated, so a flag can override a bad value
further down. A present but broken ``traceml.yaml`` (syntax error, not a mapping,
unreadable) is always an error, because the user asked for that file to be read.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import attrs
import yaml

from traceml_records import parse_export_streams

__all__ = [
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
    "EXPORTER_FORMS",
    "KNOWN_YAML_KEYS",
    "SOURCE_DEFAULT",
    "YAML_FILENAME",
    "ExportSettings",
    "ExporterKind",
    "ResolvedExportSettings",
    "SettingSources",
    "SettingsError",
    "YamlConfig",
    "exporter_kind",
    "load_yaml_config",
    "parse_bool_value",
    "parse_exporter_value",
    "resolve_export_settings",
    "settings_from_values",
]

ENV_EXPORTER = "TRACEML_EXPORTER"
ENV_EXPORT_STREAMS = "TRACEML_EXPORT_STREAMS"
ENV_EXPORTER_HOSTNAME = "TRACEML_EXPORTER_HOSTNAME"

CLI_EXPORTER = "--exporter"
CLI_EXPORT_STREAMS = "--export-streams"
CLI_EXPORTER_HOSTNAME = "--exporter-hostname"

YAML_FILENAME = "traceml.yaml"
SOURCE_DEFAULT = "default"

DEFAULT_EXPORTER = ""
DEFAULT_EXPORT_STREAMS = "step_time"
DEFAULT_EXPORTER_HOSTNAME = False

EXPORTER_FORMS = "'' (off), 'jsonl', or 'module.path:factory'"
BOOL_FORMS = "one of 1/0, true/false, yes/no, on/off"

# Other TraceML features add their own keys here (``KNOWN_YAML_KEYS.add(...)``) so that
# they stop being reported as unknown; the file is shared by every setting.
KNOWN_YAML_KEYS: set[str] = {"exporter", "export_streams", "exporter_hostname"}

_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})

ExporterKind = Literal["off", "jsonl", "custom"]


class SettingsError(ValueError):
    """A setting has an invalid value; the message names where the value came from."""


@attrs.frozen(slots=True)
class ExportSettings:
    """The validated export settings of one run.

    ``exporter`` is normalized (trimmed); ``export_streams`` is the text as the user
    wrote it, trimmed (parse it with ``traceml_records.parse_export_streams``).
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


@attrs.frozen(slots=True)
class SettingSources:
    """Where each setting's value came from.

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


def parse_exporter_value(text: str) -> str:
    """Validate and normalize an exporter value.

    Accepts ``""`` (off), ``jsonl``, or ``module.path:factory`` where the module path is
    one or more dot-separated Python identifiers and the factory one identifier, with
    exactly one colon. Surrounding whitespace is trimmed. Raises ``ValueError``
    otherwise.
    """
    value = text.strip()
    if value in ("", "jsonl"):
        return value
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
    file counts as an empty mapping.
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
    """``a boolean False``-style text for type errors."""
    if value is None:
        return "None"
    return f"{_yaml_type_name(value)} {value!r}"


def _unknown_key_warnings(config: YamlConfig) -> list[str]:
    warnings: list[str] = []
    known = sorted(KNOWN_YAML_KEYS)
    for key in config.data:
        if isinstance(key, str) and key in KNOWN_YAML_KEYS:
            continue
        hint = ""
        if isinstance(key, str):
            close = difflib.get_close_matches(key, known, n=1)
            if close:
                hint = f" (did you mean {close[0]!r}?)"
        warnings.append(f"{config.source}: unknown key {key!r} ignored{hint}")
    return warnings


@attrs.frozen(slots=True)
class _Candidate:
    """The winning raw value of one setting; ``label`` prefixes error messages."""

    value: object
    source: str
    label: str


def _pick(
    *,
    cli_value: object | None,
    cli_flag: str,
    environ: Mapping[str, str],
    env_name: str,
    yaml_config: YamlConfig | None,
    yaml_key: str,
    default: object,
) -> _Candidate:
    if cli_value is not None:
        return _Candidate(cli_value, cli_flag, cli_flag)
    if env_name in environ:
        return _Candidate(environ[env_name], env_name, env_name)
    if yaml_config is not None:
        value = yaml_config.data.get(yaml_key)
        if value is not None:
            return _Candidate(value, yaml_config.source, f"{yaml_config.source}: {yaml_key}")
    return _Candidate(default, SOURCE_DEFAULT, SOURCE_DEFAULT)


def _check_exporter(candidate: _Candidate) -> str:
    if not isinstance(candidate.value, str):
        raise SettingsError(
            f"{candidate.label}: expected a string, {EXPORTER_FORMS}; "
            f"got {_describe(candidate.value)}"
        )
    try:
        return parse_exporter_value(candidate.value)
    except ValueError as exc:
        raise SettingsError(f"{candidate.label}: {exc}") from exc


def _check_streams(candidate: _Candidate) -> tuple[str, tuple[str, ...]]:
    if not isinstance(candidate.value, str):
        raise SettingsError(
            f"{candidate.label}: expected a string of comma-separated stream names; "
            f"got {_describe(candidate.value)}"
        )
    try:
        selected = parse_export_streams(candidate.value)
    except ValueError as exc:
        raise SettingsError(f"{candidate.label}: {exc}") from exc
    return candidate.value.strip(), selected


def _check_hostname(candidate: _Candidate, *, allow_text: bool) -> bool:
    value = candidate.value
    if isinstance(value, bool):
        return value
    if allow_text and isinstance(value, str):
        try:
            return parse_bool_value(value)
        except ValueError as exc:
            raise SettingsError(f"{candidate.label}: {exc}") from exc
    expected = f"a boolean or a string, {BOOL_FORMS};" if allow_text else "a boolean,"
    raise SettingsError(f"{candidate.label}: expected {expected} got {_describe(value)}")


def resolve_export_settings(
    *,
    cli_exporter: str | None,
    cli_export_streams: str | None,
    cli_exporter_hostname: bool | None,
    environ: Mapping[str, str] | None = None,
    yaml_path: Path | None = None,
) -> ResolvedExportSettings:
    """Resolve and validate the export settings for ``traceml run`` / ``traceml serve``.

    A CLI argument of ``None`` means the flag was not given. ``environ`` defaults to
    ``os.environ`` and ``yaml_path`` to ``traceml.yaml`` in the current directory.

    An environment variable counts as set whenever it is present, even when empty:
    ``TRACEML_EXPORTER=""`` explicitly switches export off (overriding
    ``traceml.yaml``), while an empty ``TRACEML_EXPORT_STREAMS`` or
    ``TRACEML_EXPORTER_HOSTNAME`` is an error. A YAML value of ``null`` counts as not
    set. ``export_streams`` is validated even when export is off.

    Raises :class:`SettingsError` whose message starts with the value's source.
    """
    env = os.environ if environ is None else environ
    path = Path.cwd() / YAML_FILENAME if yaml_path is None else yaml_path
    yaml_config = load_yaml_config(path)
    warnings = _unknown_key_warnings(yaml_config) if yaml_config is not None else []

    exporter_c = _pick(
        cli_value=cli_exporter,
        cli_flag=CLI_EXPORTER,
        environ=env,
        env_name=ENV_EXPORTER,
        yaml_config=yaml_config,
        yaml_key="exporter",
        default=DEFAULT_EXPORTER,
    )
    streams_c = _pick(
        cli_value=cli_export_streams,
        cli_flag=CLI_EXPORT_STREAMS,
        environ=env,
        env_name=ENV_EXPORT_STREAMS,
        yaml_config=yaml_config,
        yaml_key="export_streams",
        default=DEFAULT_EXPORT_STREAMS,
    )
    hostname_c = _pick(
        cli_value=cli_exporter_hostname,
        cli_flag=CLI_EXPORTER_HOSTNAME,
        environ=env,
        env_name=ENV_EXPORTER_HOSTNAME,
        yaml_config=yaml_config,
        yaml_key="exporter_hostname",
        default=DEFAULT_EXPORTER_HOSTNAME,
    )

    exporter = _check_exporter(exporter_c)
    streams_text, selected = _check_streams(streams_c)
    hostname = _check_hostname(hostname_c, allow_text=True)
    return ResolvedExportSettings(
        settings=ExportSettings(exporter, streams_text, hostname),
        sources=SettingSources(exporter_c.source, streams_c.source, hostname_c.source),
        selected_streams=selected,
        warnings=tuple(warnings),
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
    ``TraceMLRayConfig.export_streams: unknown stream ...``. ``exporter_hostname`` must
    be a real ``bool`` here.
    """
    exporter_c = _Candidate(exporter, source, f"{source}.exporter")
    streams_c = _Candidate(export_streams, source, f"{source}.export_streams")
    hostname_c = _Candidate(exporter_hostname, source, f"{source}.exporter_hostname")
    normalized = _check_exporter(exporter_c)
    streams_text, selected = _check_streams(streams_c)
    hostname = _check_hostname(hostname_c, allow_text=False)
    return ResolvedExportSettings(
        settings=ExportSettings(normalized, streams_text, hostname),
        sources=SettingSources(source, source, source),
        selected_streams=selected,
    )
