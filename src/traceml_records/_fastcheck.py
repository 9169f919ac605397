"""The fast path of ``traceml validate``: lines accepted without the full check, when
they are certainly valid.

:func:`plan_for` derives, from a stream's JSON Schema (and the fast forms of its
line rules in :mod:`traceml_records._rules`), what a line must look like to be
accepted unseen by the full path: every key in schema order, every value of its
schema type and within its bounds, integers written as integers, every constrained
string accepted by that string's own sub-schema (compiled by jsonschema_rs, the
validator of the full path, verdicts cached), the schema's if/then type conditions,
sorted maps, and the line rules. A schema keyword the plan does not know makes the
stream's lines all go the full way (no plan), so the plan can only be stricter than
the schema, never looser.

A :class:`Checker` (``_speedups.Checker`` in C, or :class:`PyChecker`, its
pure-Python twin) runs a plan over whole lines of a block, and a :class:`Tracker`
(``_speedups.Tracker`` or :class:`PyTracker`) holds the keys and seqs of one file for
the cross-line rules. ``scan`` accepts lines up to the first one it cannot vouch for
(anything wrong, or only unusual: an escape in a string, white space, keys out of
order in a nested object, ``1`` where the rule compares it with ``1.0``) and returns
where it stopped; the caller checks that line the full way, recording its key and seq
in the same tracker, and scans on. tests/traceml_records/test_fastcheck.py holds both
twins to the full path: neither accepts a line it rejects.
"""

from __future__ import annotations

import functools
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import orjson

from traceml_records import _extensions
from traceml_records._generated.records import ENCODER_PLANS
from traceml_records._generated.registry import STREAMS
from traceml_records._rules import RULES
from traceml_records._schemas import schema_documents

_ANNOTATIONS = frozenset(
    {"description", "title", "$comment", "examples", "default", "$schema", "$id", "$defs"}
)
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
    """The schema says something the plan cannot: its lines go the full way."""


# --------------------------------------------------------------------------- plans


def _resolve(node: Mapping[str, Any], root: Mapping[str, Any]) -> tuple[Any, Any]:
    while "$ref" in node:
        uri, _, fragment = node["$ref"].partition("#")
        if uri:
            root = next(d for d in schema_documents().values() if d["$id"] == uri)
        target: Any = root
        for part in fragment.strip("/").split("/"):
            if part:
                target = target[part]
        if set(node) - _ANNOTATIONS - {"$ref"} - {k for k in node if k.startswith("x-")}:
            raise _NoPlan("$ref beside other keywords")
        node = target
    return node, root


def _keywords(node: Mapping[str, Any]) -> set[str]:
    return {k for k in node if k not in _ANNOTATIONS and not k.startswith("x-")}


def _types(node: Mapping[str, Any]) -> tuple[str, ...]:
    kind = node.get("type")
    if kind is None:
        values = [node["const"]] if "const" in node else list(node.get("enum", [None]))
        if all(type(v) is str for v in values):
            return ("string",)
        raise _NoPlan("an untyped value that is not a string constant")
    return (kind,) if isinstance(kind, str) else tuple(kind)


@functools.cache
def _registry() -> Any:
    import jsonschema_rs

    docs = schema_documents()
    return jsonschema_rs.Registry([(doc["$id"], doc) for doc in docs.values()])


def _verdict(node: Mapping[str, Any]) -> Callable[[str], bool]:
    """The full path's own validator of one string's sub-schema, as a predicate."""
    import jsonschema_rs

    validator = jsonschema_rs.validator_for(dict(node), registry=_registry())
    return validator.is_valid


def _node(raw: Mapping[str, Any], root: Mapping[str, Any]) -> Node:
    """The plan node of one schema node (``$ref``s followed from ``root``)."""
    node, root = _resolve(raw, root)
    types = _types(node)
    if not set(types) <= set(_TYPE_NAMES):
        raise _NoPlan(f"type {types}")
    nullable = "null" in types
    kinds = [t for t in types if t != "null"]
    if len(kinds) != 1:
        raise _NoPlan(f"type {types}")
    kind = kinds[0]
    words = _keywords(node) - {"type"}
    if kind == "string":
        # Every keyword of a string (const, enum, pattern, minLength, if/then on
        # the text) is left to the schema's validator, run on the string alone.
        return ("string", nullable, _verdict(node) if words else None)
    if kind == "integer":
        if words - {"minimum", "maximum", "const"}:
            raise _NoPlan(f"integer keywords {words}")
        low, high = node.get("minimum", _INT64_MIN), node.get("maximum", _INT64_MAX)
        if not all(type(v) is int for v in (low, high, node.get("const", 0))):
            raise _NoPlan("integer bounds that are not integers")
        if "const" in node:
            if not low <= node["const"] <= high:
                raise _NoPlan("a constant out of its bounds")
            low = high = node["const"]
        return ("integer", nullable, max(low, _INT64_MIN), min(high, _INT64_MAX))
    if kind == "number":
        if words - {"minimum", "maximum"}:
            raise _NoPlan(f"number keywords {words}")
        low, high = node.get("minimum"), node.get("maximum")
        return ("number", nullable, _float(low), _float(high))
    if kind == "boolean":
        if words - {"const"}:
            raise _NoPlan(f"boolean keywords {words}")
        const = node.get("const")
        if const is not None and type(const) is not bool:
            raise _NoPlan("a boolean constant that is not a boolean")
        return ("boolean", nullable, const)
    if "properties" in node:
        return _object(node, root, nullable)
    return _map(node, root, nullable)


def _object(node: Mapping[str, Any], root: Mapping[str, Any], nullable: bool) -> Node:
    words = _keywords(node) - {"type", "properties", "required", "if", "then", "else"}
    if words != {"additionalProperties"} or node["additionalProperties"] is not False:
        raise _NoPlan(f"object keywords {words}")
    props: dict[str, Any] = node["properties"]
    names = list(props)
    required = set(node.get("required", ()))
    if not required <= set(names):
        raise _NoPlan("a required key that is no property")
    fields = tuple(
        (name.encode(), _node(sub, root), name in required) for name, sub in props.items()
    )
    conds: tuple[Any, ...] = ()
    if "if" in node:
        conds = (_condition(node, names),)
    elif "then" in node or "else" in node:
        raise _NoPlan("then or else without if")
    return ("object", nullable, fields, conds, ())


def _condition(node: Mapping[str, Any], names: list[str]) -> tuple[Any, ...]:
    """``if: {properties: {k: {const: v}}}`` with branches that only name types."""
    test = node["if"]
    if _keywords(test) != {"properties"} or len(test["properties"]) != 1:
        raise _NoPlan("an if other than one property's constant")
    ((name, sub),) = test["properties"].items()
    if _keywords(sub) != {"const"} or name not in names:
        raise _NoPlan("an if other than one property's constant")
    value = sub["const"]
    if type(value) is str:
        value = value.encode()
        if not value.isascii():
            raise _NoPlan("a constant the scan does not compare")
    elif value is not None and type(value) not in (bool, int):
        raise _NoPlan("a constant the scan does not compare")
    branches = []
    for which in ("then", "else"):
        branch = node.get(which, {"properties": {}})
        if _keywords(branch) != {"properties"}:
            raise _NoPlan(f"a {which} other than property types")
        pairs = []
        for key, types in branch["properties"].items():
            if _keywords(types) != {"type"} or key not in names:
                raise _NoPlan(f"a {which} other than property types")
            if not set(_types(types)) <= set(_TYPE_NAMES):
                raise _NoPlan(f"a {which} naming a type the scan does not tell")
            pairs.append((names.index(key), _types(types)))
        branches.append(tuple(pairs))
    return (names.index(name), value, branches[0], branches[1])


def _map(node: Mapping[str, Any], root: Mapping[str, Any], nullable: bool) -> Node:
    words = _keywords(node) - {"type", "propertyNames", "minProperties", "required"}
    value = node.get("additionalProperties")
    if words != {"additionalProperties"} or not isinstance(value, dict):
        raise _NoPlan(f"map keywords {words}")
    names = node.get("propertyNames")
    verdict = _verdict(names) if names is not None else None
    required = tuple(k.encode() for k in node.get("required", ()))
    return (
        "map",
        nullable,
        verdict,
        _node(value, root),
        node.get("minProperties", 0),
        required,
    )


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
    spec = next(s for s in STREAMS if s.name == stream)
    schema = schema_documents()[spec.schema_file]
    try:
        for name in spec.rules:
            rule = RULES[name]
            if rule.check is None and name not in _CROSS_LINE_RULES:
                raise _NoPlan(f"cross-line rule {name}")
            if rule.check is not None and rule.fast is None:
                raise _NoPlan(f"line rule {name}")
        root = _node(schema, schema)
        if root[0] != "object":
            raise _NoPlan("a line is an object")
        # The top-level key order is a line rule: a key may be absent only where the
        # schema and the line's key orders (the encoder plan's optional keys) both
        # allow it, and a key the encoder leaves out when unknown is never null.
        plan_fields = ENCODER_PLANS[spec.record_class]
        if [f[0] for f in plan_fields] != [f[0].decode() for f in root[2]]:
            raise _NoPlan("the schema's key order is not the encoder's")
        fields = tuple(
            (key, node if flag != 2 else (node[0], False, *node[2:]), required or flag == 0)
            for (key, node, required), (_, _, flag) in zip(root[2], plan_fields, strict=True)
        )
        root = (*root[:2], fields, *root[3:])
        for name in spec.rules:
            form = RULES[name].fast
            if form is not None:
                root = _with_rule(root, form)
        keys = tuple(_field(fields, k, ("integer", "string")) for k in spec.key_fields)
        hostname = [f[0] for f in fields].index(b"hostname") if spec.carries_hostname else -1
        rank = _field(fields, "rank", ("integer",))
        seq = _field(fields, "seq", ("integer",))
    except _NoPlan:
        return None
    unique = "unique-key" in spec.rules
    return (root, keys, rank, seq, hostname, unique)


def key_shape(plan: Plan) -> str:
    """The tracker's key shape: ``i`` (integer) or ``s`` (string) per key field."""
    fields = plan[0][2]
    return "".join("s" if fields[i][1][0] == "string" else "i" for i in plan[1])


# ------------------------------------------------------------- the pure-Python twin


class Tracker(Protocol):
    """The keys and seqs of one file's lines (``_speedups.Tracker`` or :class:`PyTracker`)."""

    def add(self, key: tuple[Any, ...], line: int, /) -> bool: ...
    def seq(self, rank: Any, seq: Any, /) -> Any: ...
    def watch(self, keys: Iterable[tuple[Any, ...]], /) -> None: ...
    def found(self) -> dict[tuple[Any, ...], int]: ...
    @property
    def nbytes(self) -> int: ...


class Checker(Protocol):
    """One stream's fast check (``_speedups.Checker`` or :class:`PyChecker`)."""

    def scan(
        self, data: bytes, pos: int, end: int, tracker: Any, hostname: int, /
    ) -> tuple[int, int]: ...


class PyTracker:
    """The pure-Python twin of ``_speedups.Tracker``: per key prefix, a sorted array
    of the last integer component of the keys that came in order, a set for the rest."""

    def __init__(self, shape: str) -> None:
        if not (1 <= len(shape) <= 5 and set(shape) <= {"i", "s"} and "i" in shape):
            raise ValueError("the key's shape: 1 to 5 of 'i' and 's', one 'i' at least")
        self._last = shape.rindex("i")
        self._groups: dict[tuple[Any, ...], array[int]] = {}
        self._extra: set[tuple[tuple[Any, ...], int]] = set()
        self._seqs: dict[Any, Any] = {}
        self._watch: set[tuple[tuple[Any, ...], int]] = set()
        self._found: dict[tuple[Any, ...], int] = {}

    def _split(self, key: tuple[Any, ...]) -> tuple[tuple[Any, ...], int]:
        return key[: self._last] + key[self._last + 1 :], int(key[self._last])

    def seen(self, prefix: tuple[Any, ...], last: int) -> bool:
        values = self._groups.get(prefix)
        if not values or last > values[-1]:
            return False
        at = bisect_left(values, last)
        return (at < len(values) and values[at] == last) or (prefix, last) in self._extra

    def record(self, prefix: tuple[Any, ...], last: int) -> None:
        values = self._groups.get(prefix)
        if values is None:
            values = self._groups[prefix] = array("q")
        if not values or last > values[-1]:
            values.append(last)
        else:
            self._extra.add((prefix, last))

    def add(self, key: tuple[Any, ...], line: int) -> bool:
        prefix, last = self._split(key)
        if self.seen(prefix, last):
            return False
        if (prefix, last) in self._watch:
            self._found[key] = line
        self.record(prefix, last)
        return True

    def seq(self, rank: Any, seq: Any) -> Any:
        previous = self._seqs.get(rank)
        self._seqs[rank] = seq
        return previous

    def last_seq(self, rank: Any) -> Any:
        return self._seqs.get(rank)

    def watch(self, keys: Iterable[tuple[Any, ...]]) -> None:
        self._watch.update(self._split(k) for k in keys)

    def watched(self, prefix: tuple[Any, ...], last: int) -> bool:
        return bool(self._watch) and (prefix, last) in self._watch

    def found(self) -> dict[tuple[Any, ...], int]:
        return dict(self._found)

    @property
    def nbytes(self) -> int:
        return sum(8 * len(v) for v in self._groups.values()) + 100 * len(self._extra)


_PY_TYPES: dict[str, tuple[type, ...]] = {
    "null": (type(None),),
    "boolean": (bool,),
    "integer": (int,),
    "number": (int, float),
    "string": (str,),
    "object": (dict,),
}

_Check = Callable[[Any], bool]


def _cached(verdict: Callable[[str], bool] | None) -> Callable[[str], bool] | None:
    if verdict is None:
        return None
    accepted: set[str] = set()

    def check(text: str) -> bool:
        if text in accepted:
            return True
        if not verdict(text):
            return False
        if len(accepted) < 512 and len(text) <= 256:
            accepted.add(text)
        return True

    return check


def _compile(node: Node) -> _Check:
    """A predicate over a parsed value: True only when the value is certainly valid."""
    kind, nullable = node[0], node[1]
    check: _Check
    if kind == "integer":
        low, high = node[2], node[3]

        def check(v: Any) -> bool:
            return type(v) is int and low <= v <= high

    elif kind == "number":
        low_f, high_f = node[2], node[3]

        def check(v: Any) -> bool:
            return (
                type(v) in (int, float)
                and (low_f is None or v >= low_f)
                and (high_f is None or v <= high_f)
            )

    elif kind == "boolean":
        const = node[2]

        def check(v: Any) -> bool:
            return type(v) is bool and (const is None or v is const)

    elif kind == "string":
        verdict = _cached(node[2])

        def check(v: Any) -> bool:
            return type(v) is str and (verdict is None or verdict(v))

    elif kind == "object":
        check = _compile_object(node)
    else:
        check = _compile_map(node)
    if not nullable:
        return check
    inner = check
    return lambda v: v is None or inner(v)


def _compile_object(node: Node) -> _Check:
    _, _, fields, conds, rules = node
    names = [f[0].decode() for f in fields]
    checks = [_compile(f[1]) for f in fields]
    required = [f[2] for f in fields]
    n = len(fields)

    def test(cond: tuple[Any, ...], d: dict[str, Any]) -> bool | None:
        """Whether the if holds; None when only the full path can say."""
        name = names[cond[0]]
        if name not in d:
            return True
        v, const = d[name], cond[1]
        if type(const) is bytes:
            return type(v) is str and v.encode() == const
        if const is None:
            return v is None
        if type(const) is bool:
            return v is const
        if type(v) is float:
            return None
        return type(v) is int and v == const

    def check(d: Any) -> bool:
        if type(d) is not dict:
            return False
        at = 0
        for key, value in d.items():
            while at < n and names[at] != key:
                if required[at]:
                    return False
                at += 1
            if at == n or not checks[at](value):
                return False
            at += 1
        if any(required[at:]):
            return False
        for cond in conds:
            holds = test(cond, d)
            if holds is None:
                return False
            for index, types in cond[2] if holds else cond[3]:
                name = names[index]
                if name in d and not _type_ok(d[name], types):
                    return False
        return all(_rule_ok(rule, names, d) for rule in rules)

    return check


def _type_ok(v: Any, types: tuple[str, ...]) -> bool:
    if type(v) is float and "integer" in types and "number" not in types:
        return False  # 1.0 is an integer in JSON Schema: the full path says
    return any(type(v) in _PY_TYPES[t] for t in types)


def _rule_ok(rule: tuple[Any, ...], names: list[str], d: dict[str, Any]) -> bool:
    op = rule[0]
    values = [d.get(names[i]) for i in rule[1:]]
    if op == "no-newline":
        return type(values[0]) is str and "\n" not in values[0]
    if op == "duration":
        is_gpu, cpu, duration, gpu = values
        used = gpu if is_gpu is True else cpu if is_gpu is False else None
        return type(used) in (int, float) and type(duration) in (int, float) and duration == used
    a, b = values
    if type(a) is not int or type(b) is not int:
        return False
    return a == b if op == "==" else a < b if op == "<" else a <= b


def _compile_map(node: Node) -> _Check:
    _, _, verdict_raw, value_node, min_props, required_raw = node
    verdict = _cached(verdict_raw)
    value_ok = _compile(value_node)
    required = {k.decode() for k in required_raw}

    def check(d: Any) -> bool:
        if type(d) is not dict or len(d) < min_props or not required <= d.keys():
            return False
        previous = None
        for key, value in d.items():
            if previous is not None and not previous < key:
                return False
            previous = key
            if verdict is not None and not verdict(key):
                return False
            if not value_ok(value):
                return False
        return True

    return check


class PyChecker:
    """The pure-Python twin of ``_speedups.Checker``: each line parsed, then the plan."""

    def __init__(self, plan: Plan) -> None:
        root, keys, rank, seq, hostname, unique = plan
        names = [f[0].decode() for f in root[2]]
        self._check = _compile(root)
        self._keys = [names[i] for i in keys]
        self._rank, self._seq = names[rank], names[seq]
        self._hostname = names[hostname] if hostname >= 0 else None
        self._unique = unique

    def scan(
        self, data: bytes, pos: int, end: int, tracker: PyTracker, hostname: int
    ) -> tuple[int, int]:
        if not 0 <= pos <= end <= len(data):
            raise ValueError("pos and end must lie within data")
        loads, check = orjson.loads, self._check
        lines = 0
        while pos < end:
            nl = data.find(b"\n", pos, end)
            if nl < 0:
                break
            try:
                d = loads(data[pos:nl])
            except orjson.JSONDecodeError:
                break
            if not check(d):
                break
            if self._hostname is not None and (self._hostname in d) != bool(hostname):
                break
            if self._unique:
                prefix, last = tracker._split(tuple(d[k] for k in self._keys))
                if tracker.seen(prefix, last) or tracker.watched(prefix, last):
                    break
            previous = tracker.last_seq(d[self._rank])
            if previous is not None and d[self._seq] < previous:
                break
            if self._unique:
                tracker.record(prefix, last)
            tracker.seq(d[self._rank], d[self._seq])
            pos = nl + 1
            lines += 1
        return pos, lines


_speedups = _extensions.load()


@functools.cache
def checker_for(stream: str) -> Checker | None:
    """The fast check of ``stream`` (in C when built), or None: no plan."""
    plan = plan_for(stream)
    if plan is None:
        return None
    if _speedups is not None:
        return _speedups.Checker(plan)  # type: ignore[no-any-return]
    return PyChecker(plan)


def tracker_for(stream: str, shape: str) -> Tracker:
    """A fresh tracker for one file of ``stream``, the kind its checker takes."""
    if _speedups is not None and plan_for(stream) is not None:
        return _speedups.Tracker(shape)  # type: ignore[no-any-return]
    return PyTracker(shape)
