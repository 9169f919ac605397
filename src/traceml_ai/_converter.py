"""The one cattrs converter for structured data that crosses a boundary on a cold path.

The launcher's config for the aggregator and the aggregator's event lines,
``aggregator/stats.json``, the Ray config: each is an attrs class, turned into JSON and
back by this converter (``cattrs.preconf.orjson``), so the two sides of a boundary
share one definition instead of two hand-written dict layouts. The hot path (wire
items to records) does not come here: it keeps the loaders generated from the schemas.

Structuring is strict, unlike cattrs' defaults: an unknown key is refused
(``forbid_extra_keys``), and ``int``/``float``/``bool``/``str`` fields take only JSON
values of that kind (cattrs would turn ``"5"`` into 5 and ``"false"`` into True).
Every problem comes back as one :class:`StructureError` whose message lists each
problem with its ``$.path``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import attrs
import cattrs
import orjson
from cattrs.errors import ForbiddenExtraKeysError
from cattrs.preconf.orjson import OrjsonConverter, make_converter

__all__ = ["CONVERTER", "StructureError", "dumps", "loads", "structure", "unstructure"]

T = TypeVar("T")


class StructureError(ValueError):
    """Data that does not fit its class; ``problems`` lists each one with its ``$.path``."""

    def __init__(self, what: str, problems: Sequence[str]) -> None:
        self.what = what
        self.problems = tuple(problems)
        super().__init__(f"{what}: {'; '.join(self.problems)}")


def _strict(kind: type[Any], name: str) -> Any:
    def check(value: object, _: object) -> Any:
        # type() rather than isinstance: bool is an int, and JSON true is no count.
        if type(value) is kind:
            return value
        if kind is float and type(value) is int:
            return float(value)  # JSON has one number type: 2 is a fine float
        raise TypeError(f"expected {name}, got {type(value).__name__} {value!r}")

    return check


def _make() -> OrjsonConverter:
    converter = make_converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _strict(int, "an integer"))
    converter.register_structure_hook(float, _strict(float, "a number"))
    converter.register_structure_hook(bool, _strict(bool, "a boolean"))
    converter.register_structure_hook(str, _strict(str, "a string"))
    return converter


CONVERTER: OrjsonConverter = _make()
"""The converter every cold-path boundary uses."""


_EXTRA = "\x00extra\x00"
"""Marks the formatted unknown-key problem so :func:`_problems` can put each key's path in."""


def _format(exc: BaseException, type_: type | None) -> str:
    if isinstance(exc, ForbiddenExtraKeysError):
        known = ", ".join(f.name for f in attrs.fields(exc.cl)) if attrs.has(exc.cl) else ""
        return _EXTRA + "\x00".join([known, *sorted(exc.extra_fields)])
    if isinstance(exc, KeyError):
        return "required key missing"
    if isinstance(exc, AttributeError):
        return "expected a mapping"
    if isinstance(exc, TypeError | ValueError) and str(exc):
        return str(exc)
    return cattrs.v.format_exception(exc, type_)


def _problems(exc: BaseException) -> list[str]:
    """Each problem of a cattrs error as ``<what> at $.path``; an unknown key is at
    ``$.key`` and its message lists the known keys."""
    out = []
    for line in cattrs.transform_error(exc, path="$", format_exception=_format):
        message, _, path = line.rpartition(" @ ")
        if message.startswith(_EXTRA):
            known, *keys = message[len(_EXTRA) :].split("\x00")
            noun = "key" if len(keys) == 1 else "keys"
            where = ", ".join(f"{key!r} at {path}.{key}" for key in keys)
            out.append(f"unknown {noun} {where}; known keys: {known}")
        else:
            out.append(f"{message} at {path}")
    return out


def _type_name(value: object) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _own_refusal(exc: cattrs.BaseValidationError) -> ValueError | None:
    """The ``ValueError`` of the class's own validators, when that is the only problem.

    cattrs notes the field on every error of its own; a bare ``ValueError`` came from the
    class's ``__init__`` (an attrs validator), whose message already names the field.
    """
    if len(exc.exceptions) != 1:
        return None
    (only,) = exc.exceptions
    if (
        isinstance(only, ValueError)
        and not isinstance(only, cattrs.BaseValidationError)
        and not getattr(only, "__notes__", None)
    ):
        return only
    return None


def structure(data: object, cls: type[T], *, what: str) -> T:
    """``data`` (JSON-like) as a ``cls``; :class:`StructureError` naming ``what`` if it
    does not fit. A ``ValueError`` of the class's own validators is raised as it is."""
    if attrs.has(cls) and type(data) is not dict:
        raise StructureError(what, [f"expected a mapping, got {_type_name(data)} at $"])
    try:
        return CONVERTER.structure(data, cls)
    except cattrs.BaseValidationError as exc:
        own = _own_refusal(exc)
        if own is not None:
            raise own from None
        raise StructureError(what, _problems(exc)) from None
    except StructureError:
        raise
    except ValueError:
        # The class's own validators refused a value: their message already names it.
        raise
    except (TypeError, KeyError, AttributeError) as exc:
        raise StructureError(what, [f"{_format(exc, None)} at $"]) from None


def loads(data: bytes | str, cls: type[T], *, what: str) -> T:
    """One JSON document as a ``cls`` (see :func:`structure`)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise StructureError(what, [f"not JSON ({exc})"]) from None
    return structure(obj, cls, what=what)


def unstructure(obj: object) -> Any:
    """``obj`` as plain JSON-like data (dicts, lists, scalars)."""
    return CONVERTER.unstructure(obj)


def dumps(obj: object, *, indent: bool = False) -> bytes:
    """``obj`` as compact JSON bytes (two-space indented with ``indent``), no newline."""
    option = orjson.OPT_INDENT_2 if indent else 0
    return orjson.dumps(CONVERTER.unstructure(obj), option=option)
