"""The types of the generated check plans (``_generated/checks.py``).

A check plan says what a valid line of one stream is, as data: its fields in line
order, each value's kind and bounds (``$ref`` already followed: codegen resolves the
schemas, nobody else does), the stream's key and the names of its rules. Every reader
that needs a kind or a bound (the scan's C core, compiled by ``_fastcheck``, and its
pure-Python twin; ``traceml validate``) reads it here instead of interpreting
the JSON Schemas at run time.
"""

from __future__ import annotations

from typing import Any

import attrs

INTEGER, NUMBER, BOOLEAN, STRING = "integer", "number", "boolean", "string"
OBJECT, MAP, ARRAY = "object", "map", "array"
SCALARS = (INTEGER, NUMBER, BOOLEAN, STRING)


@attrs.frozen(kw_only=True)
class FieldTest:
    """One field's test in a condition: its constant (``has_const``) or its one type."""

    field: str
    has_const: bool = False
    const: Any = None
    type: str | None = None


@attrs.frozen(kw_only=True)
class ConditionCheck:
    """``if``/``then``/``else`` of an object (``when`` None: ``then`` always holds)."""

    when: tuple[FieldTest, ...] | None
    then: tuple[FieldTest, ...]
    otherwise: tuple[FieldTest, ...]


@attrs.frozen(kw_only=True)
class ValueCheck:
    """What one value may be: its kind, nullness and the bounds its schema sets."""

    kind: str
    """``integer``, ``number``, ``boolean``, ``string``, ``object``, ``map`` or ``array``."""
    nullable: bool = False
    minimum: int | float | None = None
    maximum: int | float | None = None
    has_const: bool = False
    const: Any = None
    enum: tuple[str, ...] | None = None
    pattern: str | None = None
    min_length: int | None = None
    format: str | None = None
    schema: dict[str, Any] | None = None
    """A string's own JSON Schema when it constrains it (const, enum, pattern,
    minLength, format); a map's key names' (``propertyNames``). What the full path's
    validator says of a string is asked of this, never restated."""
    fields: tuple[FieldCheck, ...] = ()
    """An object's fields, in line order."""
    conditions: tuple[ConditionCheck, ...] = ()
    value: ValueCheck | None = None
    """A map's value, an array's item."""
    min_count: int = 0
    """A map's least entries, an array's least items."""
    required_keys: tuple[str, ...] = ()
    """Keys every map must have."""
    key_pattern: str | None = None
    key_min_length: int | None = None
    reserved_key_pattern: str | None = None
    """Map keys matching this pattern must be one of ``reserved_keys``."""
    reserved_keys: tuple[str, ...] = ()
    unique: bool = False
    """An array's items are unique."""

    @property
    def constrained(self) -> bool:
        """Whether a string's value is constrained beyond its type."""
        return self.schema is not None and self.kind == STRING


@attrs.frozen(kw_only=True)
class FieldCheck:
    """One field of an object, in line order."""

    name: str
    check: ValueCheck
    required: bool
    written: str | None = None
    """``x-traceml-written`` (``always``, ``when-known``) of an optional field."""


@attrs.frozen(kw_only=True)
class CheckPlan:
    """The check plan of one line: a stream's data line, the closing line or the
    finalization warning."""

    name: str
    """The stream, or ``closing`` / ``finalization_warning``."""
    fields: tuple[FieldCheck, ...]
    conditions: tuple[ConditionCheck, ...] = ()
    key_fields: tuple[str, ...] = ()
    key_shape: str = ""
    """Per key field: ``i`` (an integer), ``n`` (an integer that may be null or
    missing) or ``s`` (a string, or null or missing where the schema allows)."""
    unique_keys: bool = False
    """No two data lines share the key (the ``unique-key`` rule)."""
    carries_hostname: bool = False
    rules: tuple[str, ...] = ()
    """Names of the rules of ``traceml_records._rules`` that apply."""

    def field(self, name: str) -> FieldCheck:
        """The field called ``name`` (KeyError when there is none)."""
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        """The field names, in line order."""
        return tuple(f.name for f in self.fields)

    @property
    def required(self) -> frozenset[str]:
        """The names of the required fields."""
        return frozenset(f.name for f in self.fields if f.required)
