"""The scan's C core, compiled from the check plans: what a line must be to be taken
without the full check, and which columns its values go to.

:func:`plan_for` compiles, from a stream's generated check plan
(``_generated/checks.py``: its schema's kinds and bounds, ``$ref`` followed by
codegen) and the fast forms of its line rules in :mod:`traceml_records._rules`, what a
line must look like to be taken unseen by the full path: every key in schema order,
every value of its schema type and within its bounds, integers written as integers,
every constrained string accepted by that string's own schema (compiled by
jsonschema_rs, the validator of the full path, verdicts cached), the schema's if/then
type conditions, sorted maps, and the line rules. A check the C core cannot compile
makes the stream's lines all go to the pure-Python twin (no plan), and codegen refuses
any schema keyword it does not read, so the plan can only be stricter than the
schema, never looser.

:func:`core_for` gives the core of one stream (``_speedups.Checker``, in C, or
``_scan_py.Checker``, its pure-Python twin; ``_extensions.load`` chooses), which takes
the whole lines of a block up to the first one it cannot vouch for (anything wrong, or
only unusual: an escape in a string, white space, keys out of order in a nested
object, ``1`` where a rule compares it with ``1.0``); the scan (``_scan``) sorts that
line itself and goes on. :func:`keys_for` gives the keys and seqs of one file
(``_speedups.KeysAndSeqs`` or its twin), :func:`frames_layout` the columns of a
stream's Arrow tables. tests/traceml_records/test_fastcheck.py holds the C core to the
full path: it never takes a line that path rejects, and a file's report is the same
either way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from traceml_records import _extensions, _scan_py
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
from traceml_records._scan_py import LINE, Column, Layout, RowsLayout

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


# ------------------------------------------------------------------ the scan's core


class KeysAndSeqs(Protocol):
    """The keys and each rank's last seq of one file's lines
    (``_speedups.KeysAndSeqs`` or its twin ``_scan_py.KeysAndSeqs``)."""

    def add(self, key: tuple[Any, ...], line: int, /) -> bool: ...
    def seq(self, rank: Any, seq: Any, /) -> Any: ...
    def watch(self, keys: Iterable[tuple[Any, ...]], /) -> None: ...
    def found(self) -> dict[tuple[Any, ...], int]: ...
    @property
    def nbytes(self) -> int: ...


class Core(Protocol):
    """One stream's scan core (``_speedups.Checker`` or its twin ``_scan_py.Checker``)."""

    def scan(
        self, data: bytes | bytearray, pos: int, end: int, keys: Any, hostname: int, /
    ) -> tuple[int, int]:
        """The lines of ``data[pos:end]`` (whole lines) taken from ``pos`` on:
        ``(pos, lines)``, ``pos`` where the first line not taken starts (or ``end``).
        ``hostname``: whether lines carry it (0, 1), -1 when the stream has none. The
        taken lines' keys and seqs are recorded in ``keys``."""
        ...

    def extract(
        self, data: bytes | bytearray, pos: int, end: int, keys: Any, hostname: int, /
    ) -> tuple[int, int, tuple[Column, ...], tuple[Column, ...] | None]:
        """As :meth:`scan`, and the taken lines' values: the layout's columns of the
        stream table and of its long table (or None)."""
        ...


_speedups = _extensions.load()


def _c_layout(stream: str, layout: Layout) -> tuple[Any, ...]:
    """A layout as the C core reads it: fields as their indexes in the check plan."""
    names = list(CHECKS[stream].names)
    top = tuple((names.index(name), kind) for name, kind in layout.top)
    rows = layout.rows
    if rows is None:
        return (top, None)
    timing = CHECKS[stream].field(rows.field).check
    assert timing.value is not None and timing.value.value is not None
    leaf_names = [f.name for f in timing.value.value.fields]
    keys = tuple((-1 if name is LINE else names.index(name), kind) for name, kind in rows.keys)
    leaves = tuple((leaf_names.index(name), kind) for name, kind in rows.leaves)
    return (top, (names.index(rows.field), keys, rows.map_keys, leaves))


@functools.cache
def core_for(stream: str, layout: Layout | None = None) -> Core:
    """The scan's core for ``stream``'s lines (``layout``: the columns ``extract``
    fills): the C checker when the extension is there (not ``TRACEML_PURE_PYTHON``)
    and the stream has a plan, else the pure-Python twin."""
    plan = plan_for(stream)
    if plan is None or _speedups is None:
        return _scan_py.Checker(stream, layout)
    if layout is None:
        return _speedups.Checker(plan)  # type: ignore[no-any-return]
    return _speedups.Checker(plan, _c_layout(stream, layout))  # type: ignore[no-any-return]


def keys_for(stream: str) -> KeysAndSeqs:
    """Fresh keys and seqs for one file of ``stream`` (the C core's or the twin's).

    Keys are kept as runs of one integer component per group of the others: the
    component that grows line after line, ``seq`` or ``step`` where the key has one
    (marked ``I`` in the shape), else its last integer. system_gpu's key (node_rank,
    seq, gpu_index) so keeps a group per node and GPU, not one per snapshot."""
    shape = _run_marked(CHECKS[stream].key_fields, CHECKS[stream].key_shape)
    if _speedups is not None and plan_for(stream) is not None:
        return _speedups.KeysAndSeqs(shape)  # type: ignore[no-any-return]
    return _scan_py.KeysAndSeqs(shape)


def frames_layout(stream: str) -> Layout | None:
    """The columns of ``stream``'s tables (``TABLES``: the stream table and its long
    table), or None when the scan cannot fill them (a long table that is not a map of
    maps of objects)."""
    if any(t not in ("int64", "float64", "bool", "string") for _, t, _ in TABLES[stream]):
        return None
    top = tuple((name, t) for name, t, _ in TABLES[stream])
    longs = [name for name in LONG_TABLES if TABLE_STREAM[name] == stream]
    if not longs:
        return Layout(top=top)
    if len(longs) > 1:
        return None
    source, key_names = LONG_TABLES[longs[0]]
    columns = TABLES[longs[0]]
    names = [c[0] for c in columns]
    at = names.index(key_names[0])
    if len(key_names) != 2 or names[at : at + 2] != list(key_names):
        return None
    outer = CHECKS[stream].field(source).check
    if outer.value is None or outer.value.kind != MAP or outer.value.value is None:
        return None
    if outer.value.value.kind != OBJECT:
        return None
    rows = RowsLayout(
        field=source,
        keys=tuple((name, t) for name, t, _ in columns[:at]),
        map_keys=("string", "string"),
        leaves=tuple((name, t) for name, t, _ in columns[at + 2 :]),
    )
    return Layout(top=top, rows=rows)


def _run_marked(fields: tuple[str, ...], shape: str) -> str:
    """``shape`` with its ``seq`` (else ``step``) integer component marked ``I``."""
    for name in ("seq", "step"):
        if name in fields:
            at = fields.index(name)
            if shape[at] == "i":
                return shape[:at] + "I" + shape[at + 1 :]
    return shape
