"""The fast path of ``traceml validate``: lines accepted without the full check, when
they are certainly valid.

:func:`plan_for` compiles, from a stream's generated check plan
(``_generated/checks.py``: its schema's kinds and bounds, ``$ref`` followed by
codegen) and the fast forms of its line rules in :mod:`traceml_records._rules`, what a
line must look like to be accepted unseen by the full path: every key in schema
order, every value of its schema type and within its bounds, integers written as
integers, every constrained string accepted by that string's own schema (compiled by
jsonschema_rs, the validator of the full path, verdicts cached), the schema's if/then
type conditions, sorted maps, and the line rules. A check the fast check cannot compile makes the
stream's lines all go the full way (no plan), and codegen refuses any schema keyword
it does not read, so the plan can only be stricter than the schema, never looser.

A :class:`Checker` (``_speedups.Checker``, in C) runs a plan over the whole lines of
a block, without building a Python object for a line it accepts; a :class:`Tracker`
(``_speedups.Tracker``, or :class:`PyTracker` without the extension) holds the keys
and seqs of one file for the cross-line rules. ``scan`` accepts lines up to the first
one it cannot vouch for (anything wrong, or only unusual: an escape in a string,
white space, keys out of order in a nested object, ``1`` where a rule compares it with
``1.0``) and returns where it stopped; the caller checks that line the full way,
recording its key and seq in the same tracker, and scans on.
tests/traceml_records/test_fastcheck.py holds the checker to the full path: it never
accepts a line that path rejects, and a file's report is the same either way.

Without the C extension there is no fast check: every line takes the full path. A
check in Python would cost more than that path, whose schema check runs in Rust.
"""

from __future__ import annotations

import functools
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from traceml_records import _extensions
from traceml_records._checkplan import (
    BOOLEAN,
    INTEGER,
    MAP,
    NUMBER,
    OBJECT,
    STRING,
    ConditionCheck,
    FieldCheck,
    ValueCheck,
)
from traceml_records._generated.checks import CHECKS
from traceml_records._generated.tables import LONG_TABLES, TABLE_STREAM, TABLES
from traceml_records._rules import RULES

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_CROSS_LINE_RULES = frozenset(
    {"closing-line-last", "unique-key", "last-line-wins", "seq-never-decreases",
     "hostname-all-or-none"}
)  # fmt: skip
"""Cross-line rules the scan keeps (with the tracker and the caller); a stream under
any other (system's snapshots) has no plan."""
_TYPE_NAMES = ("null", "boolean", "integer", "number", "string", "object")

Node = tuple[Any, ...]
"""A plan node, as the C checker reads it: ``("integer", nullable, min, max)``,
``("number", nullable, min | None, max | None)``, ``("boolean", nullable, const |
None)``, ``("string", nullable, verdict | None)``, ``("object", nullable, fields,
conditions, rules)`` and ``("map", nullable, key verdict | None, value node,
min_properties, required keys)``. A field is ``(key bytes, node, required)``; a
condition ``(field, const, then, else)`` where the branches are ``((field, type
names), ...)``; a rule ``(op, field indexes...)``."""
Plan = tuple[Node, tuple[int, ...], int, int, int, bool]
"""(root object node, key field indexes, rank field, seq field, hostname field or -1,
unique keys)."""


class _NoPlan(Exception):
    """The check plan says something the fast check cannot: its lines go the full way."""


# --------------------------------------------------------------------------- plans


def _verdict(schema: dict[str, Any]) -> Callable[[str], bool]:
    """The full path's own validator of one string's schema, as a predicate."""
    import jsonschema_rs

    verdict: Callable[[str], bool] = jsonschema_rs.validator_for(schema).is_valid
    return verdict


def _node(check: ValueCheck) -> Node:
    """The C checker's node of one value's check plan."""
    kind, nullable = check.kind, check.nullable
    if kind == STRING:
        # Every constraint of a string (const, enum, pattern, minLength, format) is
        # left to the schema's validator, run on the string alone.
        return ("string", nullable, _verdict(check.schema) if check.schema else None)
    if kind == INTEGER:
        low = _INT64_MIN if check.minimum is None else check.minimum
        high = _INT64_MAX if check.maximum is None else check.maximum
        if not all(type(v) is int for v in (low, high, check.const if check.has_const else 0)):
            raise _NoPlan("integer bounds that are not integers")
        if check.has_const:
            if not low <= check.const <= high:
                raise _NoPlan("a constant out of its bounds")
            low = high = check.const
        return ("integer", nullable, max(low, _INT64_MIN), min(high, _INT64_MAX))
    if kind == NUMBER:
        if check.has_const:
            raise _NoPlan("a number constant")
        return ("number", nullable, _float(check.minimum), _float(check.maximum))
    if kind == BOOLEAN:
        const = check.const if check.has_const else None
        if const is not None and type(const) is not bool:
            raise _NoPlan("a boolean constant that is not a boolean")
        return ("boolean", nullable, const)
    if kind == OBJECT:
        return _object(check.fields, check.conditions, nullable)
    if kind == MAP:
        assert check.value is not None
        return (
            "map",
            nullable,
            _verdict(check.schema) if check.schema else None,
            _node(check.value),
            check.min_count,
            tuple(k.encode() for k in check.required_keys),
        )
    raise _NoPlan(f"a value of kind {kind}")


def _object(
    fields: tuple[FieldCheck, ...], conditions: tuple[ConditionCheck, ...], nullable: bool
) -> Node:
    names = [f.name for f in fields]
    out = tuple((f.name.encode(), _node(f.check), f.required) for f in fields)
    return ("object", nullable, out, tuple(_condition(c, names) for c in conditions), ())


def _condition(cond: ConditionCheck, names: list[str]) -> tuple[Any, ...]:
    """``if: {properties: {k: {const: v}}}`` with branches that only name types."""
    if cond.when is None or len(cond.when) != 1 or not cond.when[0].has_const:
        raise _NoPlan("an if other than one property's constant")
    test = cond.when[0]
    value = test.const
    if type(value) is str:
        value = value.encode()
        if not value.isascii():
            raise _NoPlan("a constant the scan does not compare")
    elif value is not None and type(value) not in (bool, int):
        raise _NoPlan("a constant the scan does not compare")
    branches = []
    for branch in (cond.then, cond.otherwise):
        pairs = []
        for t in branch:
            if t.has_const or t.type is None or t.type not in _TYPE_NAMES:
                raise _NoPlan("a branch other than property types")
            pairs.append((names.index(t.field), (t.type,)))
        branches.append(tuple(pairs))
    return (names.index(test.field), value, branches[0], branches[1])


def _float(value: Any) -> float | None:
    if value is None:
        return None
    if type(value) not in (int, float):
        raise _NoPlan("a bound that is not a number")
    return float(value)


def _field(
    fields: tuple[Any, ...], name: str, kinds: tuple[str, ...], nullable: bool = False
) -> int:
    names = [f[0].decode() for f in fields]
    if name not in names:
        raise _NoPlan(f"no field {name}")
    index = names.index(name)
    node = fields[index][1]
    if node[0] not in kinds or (node[1] and not nullable):
        raise _NoPlan(f"{name} is not a {'/'.join(kinds)}")
    return index


def _with_rule(root: Node, form: tuple[str, ...]) -> Node:
    """``root`` with the fast form of one line rule attached where it applies."""
    kind, nullable, fields, conds, rules = root
    op = form[0]
    if op in ("==", "<", "<="):
        pair = (op, _field(fields, form[1], ("integer",)), _field(fields, form[2], ("integer",)))
        return (kind, nullable, fields, conds, (*rules, pair))
    if op == "no-newline":
        return (kind, nullable, fields, conds, (*rules, (op, _field(fields, form[1], ("string",)))))
    if op == "duration":
        index = _field(fields, form[1], ("map",))
        outer = fields[index][1]
        inner = outer[3]
        timing = inner[3] if inner[0] == "map" else None
        if timing is None or timing[0] != "object":
            raise _NoPlan("duration on something else than a map of maps of objects")
        t_kind, t_null, t_fields, t_conds, t_rules = timing
        at = tuple(_field(t_fields, name, ("boolean", "number"), True) for name in form[2:6])
        timing = (t_kind, t_null, t_fields, t_conds, (*t_rules, ("duration", *at)))
        inner = (*inner[:3], timing, *inner[4:])
        outer = (*outer[:3], inner, *outer[4:])
        key, _, required = fields[index]
        new_fields = (*fields[:index], (key, outer, required), *fields[index + 1 :])
        return (kind, nullable, new_fields, conds, rules)
    raise _NoPlan(f"fast form {op}")


@functools.cache
def plan_for(stream: str) -> Plan | None:
    """The fast check of ``stream``'s lines, or None when they all go the full way."""
    check = CHECKS[stream]
    try:
        for name in check.rules:
            rule = RULES[name]
            if rule.check is None and name not in _CROSS_LINE_RULES:
                raise _NoPlan(f"cross-line rule {name}")
            if rule.check is not None and rule.fast is None:
                raise _NoPlan(f"line rule {name}")
        root = _object(check.fields, check.conditions, False)
        for name in check.rules:
            form = RULES[name].fast
            if form is not None:
                root = _with_rule(root, form)
        fields = root[2]
        # A key field may be optional or null (collectives' group, peer_rank): the
        # trackers give a missing or null component a value of its own.
        keys = tuple(_field(fields, k, ("integer", "string"), True) for k in check.key_fields)
        names = [f[0] for f in fields]
        if check.carries_hostname and b"hostname" not in names:
            raise _NoPlan("a stream that carries hostname without the field")
        hostname = names.index(b"hostname") if check.carries_hostname else -1
        rank = _field(fields, "rank", ("integer",))
        seq = _field(fields, "seq", ("integer",))
    except _NoPlan:
        return None
    return (root, keys, rank, seq, hostname, check.unique_keys)


def key_shape(stream: str) -> str:
    """A tracker's key shape for ``stream``: per key field, ``i`` (an integer), ``n`` (an
    integer that may be null or missing) or ``s`` (a string, or null or missing where the
    schema allows), as its check plan says. The last ``i`` is the component a tracker
    keeps in sorted arrays per group of the others, so a nullable integer is never it."""
    return CHECKS[stream].key_shape


# ------------------------------------------------------------- checker and tracker


class Tracker(Protocol):
    """The keys and seqs of one file's lines (``_speedups.Tracker`` or :class:`PyTracker`)."""

    def add(self, key: tuple[Any, ...], line: int, /) -> bool: ...
    def seq(self, rank: Any, seq: Any, /) -> Any: ...
    def watch(self, keys: Iterable[tuple[Any, ...]], /) -> None: ...
    def found(self) -> dict[tuple[Any, ...], int]: ...
    @property
    def nbytes(self) -> int: ...


class Checker(Protocol):
    """One stream's fast check (``_speedups.Checker``)."""

    def scan(
        self, data: bytes | bytearray, pos: int, end: int, tracker: Any, hostname: int, /
    ) -> tuple[int, int]:
        """The lines of ``data[pos:end]`` (whole lines) accepted from ``pos`` on:
        ``(pos, lines)``, ``pos`` where the first line left to the full path starts (or
        ``end``). ``hostname``: whether lines carry it (0, 1), -1 when the stream has
        none. Accepted lines' keys and seqs are recorded in ``tracker``."""
        ...


class PyTracker:
    """The pure-Python twin of ``_speedups.Tracker``, for the full path without the C
    extension: per key prefix, a sorted array of the last integer component of the
    keys that came in order (8 bytes a key), a set for the rest."""

    def __init__(self, shape: str) -> None:
        if not (1 <= len(shape) <= 6 and set(shape) <= {"i", "n", "s"} and "i" in shape):
            raise ValueError("the key's shape: 1 to 6 of 'i', 'n' and 's', one 'i' at least")
        self._last = shape.rindex("i")
        self._groups: dict[tuple[Any, ...], array[int]] = {}
        self._extra: set[tuple[tuple[Any, ...], int]] = set()
        self._seqs: dict[Any, Any] = {}
        self._watch: set[tuple[tuple[Any, ...], int]] = set()
        self._found: dict[tuple[Any, ...], int] = {}

    def _split(self, key: tuple[Any, ...]) -> tuple[tuple[Any, ...], int]:
        return key[: self._last] + key[self._last + 1 :], int(key[self._last])

    def add(self, key: tuple[Any, ...], line: int) -> bool:
        """True when the key is new (then recorded); ``line`` is where it is."""
        prefix, last = self._split(key)
        values = self._groups.get(prefix)
        if values is None:
            values = self._groups[prefix] = array("q")
        if values and last <= values[-1]:
            at = bisect_left(values, last)
            if (at < len(values) and values[at] == last) or (prefix, last) in self._extra:
                return False
        if (prefix, last) in self._watch:
            self._found[key] = line
        if not values or last > values[-1]:
            values.append(last)
        else:
            self._extra.add((prefix, last))
        return True

    def seq(self, rank: Any, seq: Any) -> Any:
        """The rank's previous seq, or None; ``seq`` becomes its last."""
        previous = self._seqs.get(rank)
        self._seqs[rank] = seq
        return previous

    def watch(self, keys: Iterable[tuple[Any, ...]]) -> None:
        """Note the line where each of these keys is first added."""
        self._watch.update(self._split(k) for k in keys)

    def found(self) -> dict[tuple[Any, ...], int]:
        """Watched key -> the line where it was first added."""
        return dict(self._found)

    @property
    def nbytes(self) -> int:
        return sum(8 * len(v) for v in self._groups.values()) + 100 * len(self._extra)


_speedups = _extensions.load()


@functools.cache
def checker_for(stream: str) -> Checker | None:
    """The fast check of ``stream``, or None: no plan, or no C extension (then every
    line takes the full path; a check in Python would be slower than that path, whose
    schema check runs in Rust)."""
    plan = plan_for(stream)
    if plan is None or _speedups is None:
        return None
    return _speedups.Checker(plan)  # type: ignore[no-any-return]


Column = tuple[bytes | None, bytes, bytes | None, int, int]
"""One column of :meth:`Extractor.extract`: (validity bitmap or None, values, string
offsets or None, length, nulls), the buffers of an Arrow array."""


class Extractor(Checker, Protocol):
    """A fast check that also reads the lines it accepts into the stream's tables."""

    def extract(
        self, data: bytes | bytearray, pos: int, end: int, tracker: Any, hostname: int, /
    ) -> tuple[int, int, tuple[Column, ...], tuple[Column, ...] | None]:
        """As :meth:`Checker.scan`, and the accepted lines' values: the stream table's
        columns (``TABLES[stream]``) and its long table's (or None)."""
        ...


def layout_for(stream: str) -> tuple[Any, ...] | None:
    """Where each column of ``stream``'s tables comes from in a line, for
    :class:`Extractor`, or None when the extractor cannot fill them."""
    plan = plan_for(stream)
    if plan is None:
        return None
    fields = [f[0].decode() for f in plan[0][2]]
    if any(t not in ("int64", "float64", "bool", "string") for _, t, _ in TABLES[stream]):
        return None
    top = tuple((fields.index(name), t) for name, t, _ in TABLES[stream])
    longs = [name for name in LONG_TABLES if TABLE_STREAM[name] == stream]
    if not longs:
        return (top, None)
    if len(longs) > 1:
        return None
    source, key_names = LONG_TABLES[longs[0]]
    columns = TABLES[longs[0]]
    names = [c[0] for c in columns]
    at = names.index(key_names[0])
    if len(key_names) != 2 or names[at : at + 2] != list(key_names):
        return None
    timing = plan[0][2][fields.index(source)][1][3][3]
    leaf_names = [f[0].decode() for f in timing[2]]
    keys = tuple((fields.index(name), t) for name, t, _ in columns[:at])
    leaves = tuple((leaf_names.index(name), t) for name, t, _ in columns[at + 2 :])
    return (top, (fields.index(source), keys, leaves))


@functools.cache
def extractor_for(stream: str) -> Extractor | None:
    """The fast check of ``stream`` that reads lines into its tables (frames), or None."""
    layout = layout_for(stream)
    if layout is None or _speedups is None:
        return None
    return _speedups.Checker(plan_for(stream), layout)  # type: ignore[no-any-return]


def tracker_for(shape: str) -> Tracker:
    """A fresh tracker for the keys of one file (``shape``: see :func:`key_shape`)."""
    if _speedups is not None:
        return _speedups.Tracker(shape)  # type: ignore[no-any-return]
    return PyTracker(shape)
