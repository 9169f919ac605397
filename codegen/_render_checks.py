"""Render the check plans: what a valid line of each stream is, as data.

One :class:`~traceml_records._checkplan.CheckPlan` per stream, plus the closing line's
and the finalization warning's: fields in line order, each value's kind, nullness and
bounds, the stream's key and its rule names. ``$ref`` is followed here (by the model),
so no reader of the files interprets the schemas at run time; a constrained string
carries its own schema (the keywords the model read), for the full path's validator.
"""

from __future__ import annotations

from typing import Any

from codegen._model import (
    ArrayOf,
    ClassModel,
    ClassRef,
    Condition,
    FieldModel,
    FieldTest,
    MapOf,
    Scalar,
    SchemaSet,
    StreamModel,
    TypeRef,
)
from codegen._render_python import HEADER, _lit, format_python, snake
from codegen._writer import CodeWriter

CLOSING_CLASS = "ClosingLine"
WARNING_CLASS = "FinalizationWarning"


def _string_schema(s: Scalar) -> dict[str, Any] | None:
    """A string's own schema, when it constrains the string beyond its type."""
    out: dict[str, Any] = {}
    if s.has_const:
        out["const"] = s.const
    if s.enum is not None:
        out["enum"] = list(s.enum)
    if s.pattern is not None:
        out["pattern"] = s.pattern
    if s.min_length is not None:
        out["minLength"] = s.min_length
    if s.format is not None:
        out["format"] = s.format
    return {"type": "string", **out} if out else None


def _names_schema(m: MapOf) -> dict[str, Any] | None:
    """A map's ``propertyNames``, as the model read it."""
    out: dict[str, Any] = {}
    if m.key_pattern is not None:
        out["pattern"] = m.key_pattern
    if m.key_min_length is not None:
        out["minLength"] = m.key_min_length
    if m.reserved_key_pattern is not None:
        out["if"] = {"pattern": m.reserved_key_pattern}
        out["then"] = {"enum": list(m.reserved_keys)}
    return out or None


def _args(pairs: list[tuple[str, str]]) -> str:
    return ", ".join(f"{k}={v}" for k, v in pairs)


def _tuple(items: list[str]) -> str:
    if not items:
        return "()"
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _value(type_ref: TypeRef, classes: dict[str, ClassModel]) -> str:
    """A ``ValueCheck(...)`` expression."""
    if isinstance(type_ref, Scalar):
        s = type_ref
        args = [("kind", _lit(s.kind))]
        if s.nullable:
            args.append(("nullable", "True"))
        if s.minimum is not None:
            args.append(("minimum", _lit(s.minimum)))
        if s.maximum is not None:
            args.append(("maximum", _lit(s.maximum)))
        if s.has_const:
            args += [("has_const", "True"), ("const", _lit(s.const))]
        if s.enum is not None:
            args.append(("enum", _tuple([_lit(e) for e in s.enum])))
        if s.pattern is not None:
            args.append(("pattern", _lit(s.pattern)))
        if s.min_length is not None:
            args.append(("min_length", _lit(s.min_length)))
        if s.format is not None:
            args.append(("format", _lit(s.format)))
        schema = _string_schema(s) if s.kind == "string" else None
        if schema is not None:
            args.append(("schema", repr(schema)))
        return f"ValueCheck({_args(args)})"
    if isinstance(type_ref, ClassRef):
        return _object_name(type_ref.class_name)
    if isinstance(type_ref, ArrayOf):
        args = [("kind", '"array"'), ("value", _value(type_ref.item, classes))]
        if type_ref.min_items:
            args.append(("min_count", str(type_ref.min_items)))
        if type_ref.unique:
            args.append(("unique", "True"))
        return f"ValueCheck({_args(args)})"
    m = type_ref
    args = [("kind", '"map"')]
    if m.nullable:
        args.append(("nullable", "True"))
    args.append(("value", _value(m.value, classes)))
    if m.min_properties:
        args.append(("min_count", str(m.min_properties)))
    if m.required_keys:
        args.append(("required_keys", _tuple([_lit(k) for k in m.required_keys])))
    if m.key_pattern is not None:
        args.append(("key_pattern", _lit(m.key_pattern)))
    if m.key_min_length is not None:
        args.append(("key_min_length", str(m.key_min_length)))
    if m.reserved_key_pattern is not None:
        args.append(("reserved_key_pattern", _lit(m.reserved_key_pattern)))
        args.append(("reserved_keys", _tuple([_lit(k) for k in m.reserved_keys])))
    names = _names_schema(m)
    if names is not None:
        args.append(("schema", repr(names)))
    return f"ValueCheck({_args(args)})"


def _object_name(class_name: str) -> str:
    return f"_{snake(class_name).upper()}"


def _test(t: FieldTest) -> str:
    args = [("field", _lit(t.field))]
    if t.has_const:
        args += [("has_const", "True"), ("const", _lit(t.const))]
    if t.type is not None:
        args.append(("type", _lit(t.type)))
    return f"FieldTest({_args(args)})"


def _tests(tests: tuple[FieldTest, ...]) -> str:
    return _tuple([_test(t) for t in tests])


def _condition(c: Condition) -> str:
    when = "None" if c.when is None else _tests(c.when)
    return f"ConditionCheck(when={when}, then={_tests(c.then)}, otherwise={_tests(c.otherwise)})"


def _fields(model: ClassModel, classes: dict[str, ClassModel]) -> str:
    return _tuple([_field(f, classes) for f in model.fields])


def _field(f: FieldModel, classes: dict[str, ClassModel]) -> str:
    args = [
        ("name", _lit(f.name)),
        ("check", _value(f.type, classes)),
        ("required", _lit(f.required)),
    ]
    if f.written is not None:
        args.append(("written", _lit(f.written)))
    return f"FieldCheck({_args(args)})"


def _key_shape(model: ClassModel, stream: StreamModel) -> str:
    """Per key field, ``i``, ``n`` or ``s`` (see ``CheckPlan.key_shape``)."""
    by_name = {f.name: f for f in model.fields}
    letters = []
    for key in stream.key_fields:
        f = by_name[key]
        t = f.type
        assert isinstance(t, Scalar), key
        if t.kind == "string":
            letters.append("s")
        elif t.nullable or not f.required:
            letters.append("n")
        else:
            letters.append("i")
    return "".join(letters)


def _line_check(
    name: str, model: ClassModel, classes: dict[str, ClassModel], stream: StreamModel | None
) -> str:
    args = [("name", _lit(name)), ("fields", _fields(model, classes))]
    if model.conditions:
        args.append(("conditions", _tuple([_condition(c) for c in model.conditions])))
    if stream is not None:
        args += [
            ("key_fields", _tuple([_lit(k) for k in stream.key_fields])),
            ("key_shape", _lit(_key_shape(model, stream))),
            ("unique_keys", _lit("unique-key" in stream.rules)),
            ("carries_hostname", _lit(stream.carries_hostname)),
        ]
    if model.rules:
        args.append(("rules", _tuple([_lit(r) for r in model.rules])))
    return f"CheckPlan({_args(args)})"


def _nested(schema_set: SchemaSet) -> list[ClassModel]:
    """Nested classes (objects inside a line), each after the classes it holds."""
    by_name = {c.class_name: c for c in schema_set.classes}
    order: list[str] = []

    def visit(type_ref: TypeRef) -> None:
        if isinstance(type_ref, ClassRef):
            model = by_name[type_ref.class_name]
            for f in model.fields:
                visit(f.type)
            if type_ref.class_name not in order:
                order.append(type_ref.class_name)
        elif isinstance(type_ref, MapOf):
            visit(type_ref.value)
        elif isinstance(type_ref, ArrayOf):
            visit(type_ref.item)

    for model in schema_set.classes:
        if not model.pointer:
            for f in model.fields:
                visit(f.type)
    return [by_name[n] for n in order]


def render_checks(schema_set: SchemaSet) -> str:
    """The ``_generated/checks.py`` module."""
    classes = {c.class_name: c for c in schema_set.classes}
    w = CodeWriter()
    w.line(HEADER)
    w.line('"""Check plans: what a valid line of each stream is, as data (see _checkplan)."""')
    w.line()
    w.line("from __future__ import annotations")
    w.line()
    w.line(
        "from traceml_records._checkplan import "
        "CheckPlan, ConditionCheck, FieldCheck, FieldTest, ValueCheck"
    )
    w.line()
    for model in _nested(schema_set):
        args = [("kind", '"object"'), ("fields", _fields(model, classes))]
        if model.conditions:
            args.append(("conditions", _tuple([_condition(c) for c in model.conditions])))
        w.line(f"{_object_name(model.class_name)} = ValueCheck({_args(args)})")
        w.line(f'"""{model.class_name} ({model.schema_file}{model.pointer})."""')
        w.line()
    w.line("CHECKS: dict[str, CheckPlan] = {")
    for stream in schema_set.streams:
        model = classes[stream.class_name]
        w.line(f"    {_lit(stream.name)}: {_line_check(stream.name, model, classes, stream)},")
    w.line("}")
    w.line('"""Stream -> the check plan of its data lines, in file order."""')
    w.line()
    # The closing line and the warning file (absent from a schema set without them).
    for class_name, const, name, doc in (
        (CLOSING_CLASS, "CLOSING_CHECK", "closing", "The closing line's check plan."),
        (WARNING_CLASS, "WARNING_CHECK", "finalization_warning", "finalization_warning.json's."),
    ):
        if class_name in classes:
            w.line()
            w.line(f"{const} = {_line_check(name, classes[class_name], classes, None)}")
            w.line(f'"""{doc}"""')
    return format_python(w.render())
