"""Loading the layers (the environment, ``traceml.yaml``) and resolving each setting
from them: flag > ``TRACEML_*`` > ``traceml.yaml`` > default."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import yaml

from traceml_ai.settings._derived import table_settings
from traceml_ai.settings._parse import Command, OutOfBounds, SettingsError
from traceml_ai.settings._table import (
    KNOWN_YAML_KEYS,
    RUN_TORCHRUN_OPTIONS,
    SETTINGS,
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

T = TypeVar("T")


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
    """Parse one layer's value; errors start with ``label`` (the setting and layer).
    A repeatable setting takes a YAML list of scalars too, as its comma list."""
    if setting.repeatable and isinstance(value, list):
        parts = [_scalar_text(v) for v in value]
        if all(p is not None for p in parts):
            value = ",".join(p for p in parts if p is not None)
    text = _scalar_text(value)
    if text is None:
        raise SettingsError(f"{label}: expected {setting.expected}, got {_describe(value)}")
    try:
        return setting.read(text)
    except ValueError as exc:
        if isinstance(value, str):
            raise SettingsError(f"{label}: {exc}") from exc
        # Say what YAML read (a boolean True), not the text it was turned into.
        expected = exc.expected if isinstance(exc, OutOfBounds) else setting.expected
        raise SettingsError(f"{label}: expected {expected}, got {_describe(value)}") from exc


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

    A CLI value of ``None`` means the flag was not given; a repeatable flag's values
    (a sequence, empty when not given) join as a comma list. An environment variable
    counts as set whenever it is present, even when empty.
    """
    if isinstance(cli_value, (tuple, list)):
        cli_value = ",".join(str(v) for v in cli_value) if cli_value else None
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


def _export_result(values: Mapping[str, Any], sources: Mapping[str, str]) -> ResolvedExportSettings:
    """The export settings of the resolved ``values`` (setting name -> value, every
    export setting's), with where each came from."""
    names = [s.name for s in table_settings(ExportSettings)]
    return ResolvedExportSettings(
        settings=ExportSettings(**{name: values[name] for name in names}),
        sources=SettingSources(**{name: sources[name] for name in names}),
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
    cli: dict[str, object] = {"exporter": cli_exporter, "export_streams": cli_export_streams}
    cli["exporter_hostname"] = cli_exporter_hostname
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in table_settings(ExportSettings):
        values[setting.name], sources[setting.name] = _resolve_one(
            setting, cli[setting.name], layers
        )
    return _export_result(values, sources)


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
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in SETTINGS:
        if command in setting.commands:
            value, source = _resolve_one(setting, cli.get(setting.name), layers)
        else:
            value, source = setting.default, SOURCE_DEFAULT
        values[setting.name], sources[setting.name] = value, source

    def fields_of(cls: type) -> dict[str, Any]:
        return {s.name: values[s.name] for s in table_settings(cls)}

    return LaunchSettings(
        command=command,
        export=_export_result(values, sources),
        sources=sources,
        monitor=MonitorSettings(**fields_of(MonitorSettings)),
        warnings=tuple(_ignored_torchrun_settings(command, layers)),
        **fields_of(LaunchSettings),
    )


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
    given = {"exporter": exporter, "export_streams": export_streams}
    given["exporter_hostname"] = exporter_hostname
    values: dict[str, Any] = {}
    for setting in table_settings(ExportSettings):
        value, where = given[setting.name], f"{source}.{setting.name}"
        if not isinstance(value, setting.kind):
            expected = "a boolean," if setting.kind is bool else f"a string, {setting.expected};"
            raise SettingsError(f"{where}: expected {expected} got {_describe(value)}")
        values[setting.name] = _parse_value(setting, value, where)
    return _export_result(values, dict.fromkeys(given, source))
