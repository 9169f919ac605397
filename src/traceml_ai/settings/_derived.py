"""What is derived from the settings table: the click options of each command, the
``TraceMLRayConfig`` fields and the docs' table."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from traceml_ai.settings._parse import Command
from traceml_ai.settings._table import SETTINGS, Setting

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


# --- TraceMLRayConfig's fields -----------------------------------------------------------


def _ray_refusal(attribute: attrs.Attribute[Any], expected: str, value: object) -> ValueError:
    return ValueError(f"{RAY_CONFIG_SOURCE}.{attribute.name}: expected {expected}, got {value!r}")


def _ray_validator(setting: Setting[object]) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """A value given in code: of the setting's ``kind`` (a bool is no number), then
    the table's parser on its text; a ``None`` default makes ``None`` allowed."""
    optional = setting.ray_field_default is None

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        del instance
        if value is None and optional:
            return
        if setting.kind is bool:
            if not isinstance(value, bool):
                raise _ray_refusal(attribute, "a boolean", value)
            return
        if setting.kind is str:
            if not isinstance(value, str) or not value.strip():
                raise _ray_refusal(attribute, "a non-empty string", value)
            try:
                setting.parse(value)
            except ValueError as exc:
                raise ValueError(f"{RAY_CONFIG_SOURCE}.{attribute.name}: {exc}") from None
            return
        numbers = (int, float) if setting.kind is float else (int,)
        ok = not isinstance(value, bool) and isinstance(value, numbers)
        if ok and isinstance(value, float) and not math.isfinite(value):
            ok = False
        if ok:
            try:
                setting.parse(str(value))
            except ValueError:
                ok = False
        if not ok:
            raise _ray_refusal(attribute, setting.expected, value)

    return check


def ray_field(setting: Setting[object], *, validator: Any = None, **field_args: Any) -> Any:
    """The ``TraceMLRayConfig`` field of ``setting``: the table's Ray default and the
    table's checks (``validator`` replaces them where Ray reads a value its own way).

    Declared as ``sampler_interval_sec: float = ray_field(INTERVAL)``: the field's name
    and type are Ray's, everything else is the table's.
    """
    assert setting.ray is not None, f"{setting.name} has no Ray field"
    return attrs.field(
        default=setting.ray_field_default,
        validator=_ray_validator(setting) if validator is None else validator,
        metadata={"setting": setting.name},
        **field_args,
    )


def ray_settings() -> tuple[Setting[object], ...]:
    """The settings that have a ``TraceMLRayConfig`` field, in the table's order."""
    return tuple(s for s in SETTINGS if s.ray is not None)


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
