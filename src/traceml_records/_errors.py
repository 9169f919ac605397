"""The error raised for a record or line that breaks its schema."""

from __future__ import annotations

from typing import Any

Path = tuple[str | int, ...]
"""A location inside a JSON document, as the keys and indexes leading to it."""


def json_pointer(path: Path) -> str:
    """RFC 6901 pointer for ``path`` (``""`` for the whole document)."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def describe(value: Any) -> str:
    """A short description of a JSON value's type (and value, when small) for messages."""
    if value is None:
        return "null"
    if value is True or value is False:
        return f"boolean {'true' if value else 'false'}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"number {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"string {shown!r}"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


class RecordError(ValueError):
    """A line or record does not match its schema; ``pointer`` says where."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{json_pointer(path) or '/'}: {reason}")

    @property
    def pointer(self) -> str:
        """JSON pointer to the offending value."""
        return json_pointer(self.path)


def _key_error(keys: Any, required: frozenset[str], allowed: frozenset[str], path: Path) -> None:
    missing = sorted(required - set(keys))
    if missing:
        raise RecordError((*path, missing[0]), "required key is missing")
    extra = sorted(set(keys) - allowed)
    raise RecordError((*path, extra[0]), "key is not allowed here")
