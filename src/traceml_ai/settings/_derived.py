"""What is derived from the settings table: the click options of each command, the
fields of the typed settings objects and of ``TraceMLRayConfig``, and the docs' table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from traceml_ai.settings._parse import Command
from traceml_ai.settings._table import SETTINGS, SETTINGS_BY_NAME, Setting

_F = TypeVar("_F", bound=Callable[..., Any])

RAY_CONFIG_SOURCE = "TraceMLRayConfig"
"""Error messages name a Ray field as ``TraceMLRayConfig.<field>``."""


def click_options(command: Command) -> Callable[[_F], _F]:
    """One click option per setting of ``command`` in the settings table.

    Every option defaults to ``None`` (not given) and takes text: the table's parser
    checks it, so a flag, a variable and a YAML key get the same checks and messages.
    """
    import click  # the aggregator and Ray import the settings, not the command line

    def decorate(func: _F) -> _F:
        for setting in reversed(SETTINGS):
            if command not in setting.commands:
                continue
            where = f"env {setting.env}; traceml.yaml {setting.yaml_key}"
            help_text = f"{setting.help} [default: {setting.doc_default}; {where}]"
            if setting.is_switch:
                # A real on/off pair, so the command line can switch off what the
                # environment or traceml.yaml switched on.
                decl = f"{setting.flag}/--no-{setting.flag[2:]}"
                func = click.option(decl, setting.name, default=None, help=help_text)(func)
            elif setting.repeatable:
                func = click.option(
                    setting.flag,
                    setting.name,
                    type=str,
                    multiple=True,
                    default=None,
                    metavar=setting.metavar,
                    help=help_text,
                )(func)
            else:
                func = click.option(
                    setting.flag,
                    setting.name,
                    type=str,
                    default=None,
                    metavar=setting.metavar,
                    help=help_text,
                )(func)
        return func

    return decorate


# --- the typed objects' fields ---------------------------------------------------------------


class _FromTable:
    """:data:`FROM_TABLE`'s type."""

    def __repr__(self) -> str:
        return "FROM_TABLE"


FROM_TABLE: Any = _FromTable()
"""The default a field of a typed settings object or of ``TraceMLRayConfig`` is
declared with (``interval: float = FROM_TABLE``): the object's ``field_transformer``
(:func:`settings_fields`, :func:`ray_fields`) puts the setting's default and checks in.
The field's name and type are written in the class, everything else in the table."""


def _with_setting(field: attrs.Attribute[Any], setting: Setting[object], default: object) -> Any:
    return field.evolve(default=default, metadata={**field.metadata, "setting": setting.name})


def settings_fields(cls: type, fields: list[attrs.Attribute[Any]]) -> list[attrs.Attribute[Any]]:
    """The ``field_transformer`` of a typed settings object: each field declared with
    :data:`FROM_TABLE` is the setting of its name, with the table's default."""
    out = []
    for field in fields:
        if field.default is FROM_TABLE:
            if field.name not in SETTINGS_BY_NAME:
                raise TypeError(f"{cls.__name__}.{field.name}: no setting has this name")
            setting = SETTINGS_BY_NAME[field.name]
            field = _with_setting(field, setting, setting.default)
        out.append(field)
    return out


def table_settings(cls: type) -> tuple[Setting[object], ...]:
    """The settings ``cls`` (a typed settings object or ``TraceMLRayConfig``) has a
    field for, in the order of its fields."""
    return tuple(
        SETTINGS_BY_NAME[f.metadata["setting"]]
        for f in attrs.fields(cls)
        if "setting" in f.metadata
    )


def check_code_value(setting: Setting[object], value: object, where: str) -> None:
    """A value given in code (a ``TraceMLRayConfig`` field): of the setting's ``kind``
    (a bool is no number), then the table's parser (a text) or bounds (a number);
    ``None`` only where the Ray default is ``None``. Raises ``ValueError`` starting
    with ``where`` (``TraceMLRayConfig.<field>``)."""
    if value is None and setting.ray_field_default is None:
        return
    if setting.kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected a boolean, got {value!r}")
        return
    if setting.kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, {setting.expected}; got {value!r}")
        try:
            setting.read(value)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return
    assert setting.bounds is not None, f"{setting.name}: a number setting has bounds"
    numbers = (int, float) if setting.kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, numbers):
        raise ValueError(f"{where}: expected {setting.expected}, got {value!r}")
    try:
        setting.bounds.check(value, value)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _ray_validator(setting: Setting[object]) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        del instance
        check_code_value(setting, value, f"{RAY_CONFIG_SOURCE}.{attribute.name}")

    return check


def ray_settings() -> tuple[Setting[object], ...]:
    """The settings that have a ``TraceMLRayConfig`` field, in the table's order."""
    return tuple(s for s in SETTINGS if s.ray is not None)


def ray_fields(cls: type, fields: list[attrs.Attribute[Any]]) -> list[attrs.Attribute[Any]]:
    """The ``field_transformer`` of ``TraceMLRayConfig``: each field declared with
    :data:`FROM_TABLE` is the setting whose ``ray`` names it, with the table's Ray
    default and checks (:func:`check_code_value`; a ``validator`` the field declares
    replaces them, where Ray reads a value its own way). Every setting with a Ray
    field must have one, and no other field may be declared so."""
    by_ray = {s.ray: s for s in ray_settings() if s.ray is not None}
    out = []
    for field in fields:
        if field.default is FROM_TABLE:
            setting = by_ray.pop(field.name, None)
            if setting is None:
                raise TypeError(f"{cls.__name__}.{field.name}: no setting's ray field")
            validator = _ray_validator(setting) if field.validator is None else field.validator
            field = _with_setting(field, setting, setting.ray_field_default).evolve(
                validator=validator
            )
        out.append(field)
    if by_ray:
        raise TypeError(f"{cls.__name__} lacks the fields {', '.join(sorted(by_ray))}")
    return out


# --- the docs ------------------------------------------------------------------------------


def settings_table_markdown() -> str:
    """The Settings table of ``docs/live-export.md``, generated from :data:`SETTINGS`."""
    rows = [
        "| Setting (`traceml.yaml` key) | Flag | Environment variable | Default | Commands |",
        "|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        flag = f"`{s.flag}` / `--no-{s.flag[2:]}`" if s.is_switch else f"`{s.flag}`"
        if s.repeatable:
            flag += " (repeatable)"
        commands = ", ".join(s.commands)
        rows.append(f"| `{s.yaml_key}` | {flag} | `{s.env}` | {s.doc_default} | {commands} |")
    return "\n".join(rows) + "\n"
