"""Read the JSON Schemas and turn them into the small model the renderers use.

Only the constructs listed in ``SUPPORTED_KEYWORDS`` are understood; anything
else is rejected with the file and JSON pointer, so a schema change can never be
silently ignored by the generated code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

# Keywords that describe a value the generated classes must represent.
_VALUE_KEYWORDS = {
    "type",
    "const",
    "enum",
    "minimum",
    "maximum",
    "pattern",
    "minLength",
    "format",
    "properties",
    "required",
    "additionalProperties",
    "propertyNames",
    "minProperties",
    "items",
    "uniqueItems",
    "minItems",
    "$ref",
}
# Keywords that only document.
_ANNOTATION_KEYWORDS = {"$schema", "$id", "$defs", "title", "description"}
# Conditional keywords. On a record or nested class they become checks in the
# generated loaders (see ``Condition``); on the top-level schemas without a stream
# (finalization warning, closing line) they are left to the JSON Schema validator.
_VALIDATION_ONLY_KEYWORDS = {"dependentRequired", "allOf", "if", "then", "else", "not"}
SUPPORTED_KEYWORDS = _VALUE_KEYWORDS | _ANNOTATION_KEYWORDS | _VALIDATION_ONLY_KEYWORDS

_EXTENSION_PREFIX = "x-traceml-"
_KNOWN_EXTENSIONS = {
    "x-traceml-stream",
    "x-traceml-file",
    "x-traceml-class",
    "x-traceml-key",
    "x-traceml-hostname",
    "x-traceml-selected-by",
    "x-traceml-order",
    "x-traceml-unit",
    "x-traceml-optional",
    "x-traceml-rules",
    "x-traceml-wire",
    "x-traceml-written",
}
_SCALAR_TYPES = {"integer", "number", "boolean", "string"}
WRITTEN_ALWAYS = "always"
"""``x-traceml-written: always`` on an optional field: this producer writes the key on
every line (``null`` when unknown where the type allows it; a non-nullable one is left
out only by a record loaded from a line that lacked it), and the rank's item always
carries it. Readers still accept lines without it (written before it existed)."""
WRITTEN_WHEN_KNOWN = "when-known"
"""``x-traceml-written: when-known`` on an optional field: the key is written only when
the value is known (left out when None), and the rank's item carries it only then."""


class SchemaError(Exception):
    """A schema uses a construct the generator does not support."""

    def __init__(self, file: str, pointer: str, message: str) -> None:
        super().__init__(f"{file}: {pointer or '/'}: {message}")
        self.file = file
        self.pointer = pointer


@attrs.frozen
class Scalar:
    """A JSON scalar: integer, number, boolean or string, possibly nullable."""

    kind: str  # "integer" | "number" | "boolean" | "string"
    nullable: bool
    const: Any = None
    has_const: bool = False
    enum: tuple[str, ...] | None = None
    minimum: int | float | None = None
    maximum: int | float | None = None
    pattern: str | None = None
    min_length: int | None = None
    format: str | None = None


@attrs.frozen
class MapOf:
    """A JSON object used as a map from string keys to values of one type."""

    value: TypeRef
    min_properties: int
    key_pattern: str | None
    key_min_length: int | None
    required_keys: tuple[str, ...] = ()
    """``required`` on the map: keys every map must have."""
    reserved_key_pattern: str | None = None
    """``propertyNames: {if: {pattern: P}, then: {enum: [...]}}``: keys matching P ..."""
    reserved_keys: tuple[str, ...] = ()
    """... must be one of these."""
    nullable: bool = False
    """``type: ["object", "null"]``: the map may be ``null``."""


@attrs.frozen
class FieldTest:
    """``properties: {field: {const: v}}`` or ``{type: t}`` inside a condition."""

    field: str
    has_const: bool
    const: Any
    type: str | None


@attrs.frozen
class Condition:
    """One ``if``/``then``/``else`` (``when`` None: ``then`` always holds).

    Only tests of one field each are supported (``const`` or a single ``type``),
    which says every nullness implication of the contract and stays cheap to check.
    """

    when: tuple[FieldTest, ...] | None
    then: tuple[FieldTest, ...]
    otherwise: tuple[FieldTest, ...]
    pointer: str


@attrs.frozen
class ArrayOf:
    """A JSON array of one item type."""

    item: TypeRef
    unique: bool
    min_items: int


@attrs.frozen
class ClassRef:
    """A nested object rendered as its own record class."""

    class_name: str


TypeRef = Scalar | MapOf | ArrayOf | ClassRef


@attrs.frozen
class FieldModel:
    """One property of a record, in schema order."""

    name: str
    type: TypeRef
    required: bool
    description: str
    unit: str | None
    pointer: str
    written: str | None = None
    """``x-traceml-written`` of an optional field (WRITTEN_ALWAYS, WRITTEN_WHEN_KNOWN), or
    None: an optional field left out when None, sent by ranks as None when unknown."""

    @property
    def always_written(self) -> bool:
        """Optional on read, but on every line this producer writes."""
        return self.written == WRITTEN_ALWAYS

    @property
    def item_required(self) -> bool:
        """Whether the rank's item must carry the key (the TypedDict's key is required)."""
        return self.written != WRITTEN_WHEN_KNOWN


@attrs.frozen
class ClassModel:
    """One generated attrs class."""

    class_name: str
    title: str
    description: str
    fields: tuple[FieldModel, ...]
    schema_file: str
    schema_id: str
    pointer: str
    conditions: tuple[Condition, ...] = ()
    rules: tuple[str, ...] = ()
    """x-traceml-rules of a top-level schema (named rules of traceml_records._rules)."""


@attrs.frozen
class FanOutModel:
    """``x-traceml-wire/fan-out``: a list in each item of a batch stream that becomes records
    of another stream, one per entry."""

    stream: str
    """The stream whose records the entries become."""
    item_key: str
    """The item key that holds the entries (a list of objects)."""
    count_field: str
    """The field of the item's own record that gets the number of entries."""
    shared_fields: tuple[str, ...]
    """Fields of each entry's record taken from the item's own record."""
    max_entries: int
    """Most entries one item may carry."""


@attrs.frozen
class WireModel:
    """``x-traceml-wire``: how the rank's wire items become records of a stream."""

    batch_stream: str
    """The wire (batch) stream whose items carry this stream's records."""
    from_batch: tuple[str, ...]
    """Record fields the aggregator fills from the batch, not the item:
    ``observed_timestamp_unix_ns`` (the time it received the batch), ``rank`` (the
    identity's ``global_rank``) and identity fields of the same name."""
    fan_out: FanOutModel | None = None
    fan_out_of: str | None = None
    """The stream whose items carry this stream's records as fan-out entries."""


@attrs.frozen
class StreamModel:
    """Stream-level annotations of a record schema."""

    name: str
    file_name: str
    class_name: str
    key_fields: tuple[str, ...]
    carries_hostname: bool
    selected_by: tuple[str, ...]
    order: int
    schema_file: str
    schema_id: str
    rules: tuple[str, ...] = ()
    """Names of the rules of ``traceml_records._rules`` that apply (x-traceml-rules)."""
    wire: WireModel | None = None
    """How wire items become records of this stream (x-traceml-wire)."""


@attrs.frozen
class SchemaSet:
    """Everything the renderers need, in a deterministic order."""

    classes: tuple[ClassModel, ...]
    streams: tuple[StreamModel, ...]
    schema_files: tuple[tuple[str, bytes], ...]


class _Loader:
    def __init__(self, schema_dir: Path) -> None:
        self.schema_dir = schema_dir
        self.documents: dict[str, tuple[str, dict[str, Any]]] = {}
        self.classes: dict[str, ClassModel] = {}
        self.class_order: list[str] = []

    def load_all(self) -> SchemaSet:
        files = sorted(self.schema_dir.glob("*.schema.json"))
        if not files:
            raise SchemaError(str(self.schema_dir), "", "no *.schema.json files")
        raw: list[tuple[str, bytes]] = []
        for path in files:
            data = path.read_bytes()
            raw.append((path.name, data))
            try:
                doc = json.loads(data)
            except json.JSONDecodeError as exc:
                raise SchemaError(path.name, "", f"invalid JSON: {exc}") from exc
            if not isinstance(doc, dict):
                raise SchemaError(path.name, "", "top level must be an object")
            if doc.get("$schema") != JSON_SCHEMA_DIALECT:
                raise SchemaError(path.name, "/$schema", f"must be {JSON_SCHEMA_DIALECT}")
            schema_id = doc.get("$id")
            if not isinstance(schema_id, str) or not schema_id:
                raise SchemaError(path.name, "/$id", "every schema needs a stable $id")
            if schema_id in self.documents:
                raise SchemaError(path.name, "/$id", f"duplicate $id {schema_id!r}")
            self.documents[schema_id] = (path.name, doc)
        for schema_id, (name, doc) in self.documents.items():
            self._check_keywords(name, "", doc)
            del schema_id
        streams: list[StreamModel] = []
        for schema_id, (name, doc) in self.documents.items():
            if "properties" in doc:
                self._object_class(name, schema_id, "", doc)
            if "x-traceml-stream" in doc:
                streams.append(self._stream(name, schema_id, doc))
        streams.sort(key=lambda s: s.order)
        _check_wire(streams)
        return SchemaSet(
            classes=tuple(self.classes[c] for c in self.class_order),
            streams=tuple(streams),
            schema_files=tuple(raw),
        )

    # -- checks ---------------------------------------------------------------

    def _check_keywords(self, file: str, pointer: str, node: Any) -> None:
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            here = f"{pointer}/{_escape(key)}"
            if key.startswith(_EXTENSION_PREFIX):
                if key not in _KNOWN_EXTENSIONS:
                    raise SchemaError(file, here, f"unknown annotation {key!r}")
                continue
            if key not in SUPPORTED_KEYWORDS:
                raise SchemaError(file, here, f"unsupported keyword {key!r}")
            if key in ("properties", "$defs", "dependentRequired"):
                for sub_key, sub in value.items():
                    self._check_keywords(file, f"{here}/{_escape(sub_key)}", sub)
            elif key == "allOf":
                for index, sub in enumerate(value):
                    self._check_keywords(file, f"{here}/{index}", sub)
            elif key in (
                "additionalProperties",
                "items",
                "propertyNames",
                "if",
                "then",
                "else",
                "not",
            ):
                self._check_keywords(file, here, value)

    # -- resolution -----------------------------------------------------------

    def _resolve(
        self, file: str, schema_id: str, pointer: str, node: dict[str, Any]
    ) -> tuple[str, str, str, dict[str, Any]]:
        """Follow ``$ref`` chains; return (file, id, pointer, node) of the target."""
        seen = 0
        while "$ref" in node:
            ref = node["$ref"]
            seen += 1
            if seen > 16 or not isinstance(ref, str):
                raise SchemaError(file, pointer + "/$ref", "unresolvable $ref")
            base, _, fragment = ref.partition("#")
            target_id = base or schema_id
            if target_id not in self.documents:
                raise SchemaError(file, pointer + "/$ref", f"unknown schema {target_id!r}")
            file, doc = self.documents[target_id]
            schema_id = target_id
            pointer = fragment
            node = _walk(doc, fragment, file)
        return file, schema_id, pointer, node

    def _type(
        self, file: str, schema_id: str, pointer: str, node: dict[str, Any]
    ) -> tuple[TypeRef, str, str | None]:
        """The type of a property, with its description and unit (the nearest wins)."""
        description = node.get("description")
        unit = node.get("x-traceml-unit")
        file, schema_id, pointer, target = self._resolve(file, schema_id, pointer, node)
        description = description or target.get("description") or ""
        unit = unit or target.get("x-traceml-unit")
        if "x-traceml-class" in target:
            return (
                ClassRef(self._object_class(file, schema_id, pointer, target).class_name),
                description,
                unit,
            )
        json_type = target.get("type")
        if json_type == "object" or (
            isinstance(json_type, list) and sorted(json_type) == ["null", "object"]
        ):
            return self._map(file, schema_id, pointer, target), description, unit
        if json_type == "array":
            item_node = target.get("items")
            if not isinstance(item_node, dict):
                raise SchemaError(file, pointer + "/items", "arrays need an items schema")
            item, _, _ = self._type(file, schema_id, pointer + "/items", item_node)
            return (
                ArrayOf(
                    item, bool(target.get("uniqueItems", False)), int(target.get("minItems", 0))
                ),
                description,
                unit,
            )
        return self._scalar(file, pointer, target), description, unit

    def _scalar(self, file: str, pointer: str, node: dict[str, Any]) -> Scalar:
        json_type = node.get("type")
        nullable = False
        if isinstance(json_type, list):
            kinds = [t for t in json_type if t != "null"]
            if len(kinds) != 1 or len(json_type) != 2 or "null" not in json_type:
                raise SchemaError(file, pointer + "/type", "only [T, 'null'] unions are supported")
            nullable = True
            json_type = kinds[0]
        if json_type not in _SCALAR_TYPES:
            raise SchemaError(file, pointer + "/type", f"unsupported type {json_type!r}")
        enum = node.get("enum")
        if enum is not None and nullable:
            # JSON Schema checks enum beside type: a nullable enum lists null too.
            if None not in enum:
                raise SchemaError(file, pointer + "/enum", "a nullable enum must list null")
            enum = [e for e in enum if e is not None]
        if enum is not None and (
            json_type != "string" or not all(isinstance(e, str) for e in enum)
        ):
            raise SchemaError(file, pointer + "/enum", "only string enums are supported")
        for key in ("properties", "items", "additionalProperties"):
            if key in node:
                raise SchemaError(file, f"{pointer}/{key}", f"{key!r} on a {json_type}")
        return Scalar(
            kind=json_type,
            nullable=nullable,
            const=node.get("const"),
            has_const="const" in node,
            enum=tuple(enum) if enum is not None else None,
            minimum=node.get("minimum"),
            maximum=node.get("maximum"),
            pattern=node.get("pattern"),
            min_length=node.get("minLength"),
            format=node.get("format"),
        )

    def _map(self, file: str, schema_id: str, pointer: str, node: dict[str, Any]) -> MapOf:
        if "properties" in node:
            raise SchemaError(file, pointer, "objects with properties need an x-traceml-class name")
        value_node = node.get("additionalProperties")
        if not isinstance(value_node, dict):
            raise SchemaError(file, pointer + "/additionalProperties", "maps need a value schema")
        value, _, _ = self._type(file, schema_id, pointer + "/additionalProperties", value_node)
        names = node.get("propertyNames", {})
        for key in names:
            if key not in ("pattern", "minLength", "if", "then"):
                raise SchemaError(
                    file, f"{pointer}/propertyNames/{key}", f"unsupported keyword {key!r}"
                )
        reserved_pattern: str | None = None
        reserved: tuple[str, ...] = ()
        if "if" in names or "then" in names:
            when, then = names.get("if"), names.get("then")
            if (
                not isinstance(when, dict)
                or set(when) != {"pattern"}
                or not isinstance(then, dict)
                or set(then) != {"enum"}
                or not all(isinstance(e, str) for e in then["enum"])
            ):
                raise SchemaError(
                    file,
                    f"{pointer}/propertyNames",
                    "only if: {pattern} then: {enum of strings} is supported",
                )
            reserved_pattern = when["pattern"]
            reserved = tuple(then["enum"])
        required = node.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(file, f"{pointer}/required", "a list of key names")
        return MapOf(
            nullable=isinstance(node.get("type"), list),
            value=value,
            min_properties=int(node.get("minProperties", 0)),
            key_pattern=names.get("pattern"),
            key_min_length=names.get("minLength"),
            required_keys=tuple(required),
            reserved_key_pattern=reserved_pattern,
            reserved_keys=reserved,
        )

    def _object_class(
        self, file: str, schema_id: str, pointer: str, node: dict[str, Any]
    ) -> ClassModel:
        class_name = node.get("x-traceml-class")
        if not isinstance(class_name, str) or not class_name.isidentifier():
            raise SchemaError(
                file, pointer + "/x-traceml-class", "object schemas need a class name"
            )
        if class_name in self.classes:
            existing = self.classes[class_name]
            if (existing.schema_id, existing.pointer) != (schema_id, pointer):
                raise SchemaError(file, pointer, f"class name {class_name!r} used twice")
            return existing
        if node.get("type") != "object":
            raise SchemaError(file, pointer + "/type", "record schemas must have type 'object'")
        if node.get("additionalProperties") is not False:
            raise SchemaError(
                file, pointer + "/additionalProperties", "record schemas must set false"
            )
        properties = node.get("properties")
        if not isinstance(properties, dict) or not properties:
            raise SchemaError(file, pointer + "/properties", "record schemas need properties")
        required = node.get("required", [])
        unknown_required = [r for r in required if r not in properties]
        if unknown_required:
            raise SchemaError(file, pointer + "/required", f"not properties: {unknown_required}")
        fields: list[FieldModel] = []
        for name, prop in properties.items():
            if not name.isidentifier():
                raise SchemaError(
                    file, f"{pointer}/properties/{_escape(name)}", "not a Python identifier"
                )
            here = f"{pointer}/properties/{_escape(name)}"
            type_ref, description, unit = self._type(file, schema_id, here, prop)
            if not description:
                raise SchemaError(file, here, "every field needs a description")
            written = prop.get("x-traceml-written")
            if written is not None and (
                written not in (WRITTEN_ALWAYS, WRITTEN_WHEN_KNOWN) or name in required
            ):
                raise SchemaError(
                    file,
                    here + "/x-traceml-written",
                    f"{WRITTEN_ALWAYS!r} or {WRITTEN_WHEN_KNOWN!r}, on an optional field",
                )
            fields.append(
                FieldModel(name, type_ref, name in required, description, unit, here, written)
            )
        # Top-level schemas without a stream (the warning file, the closing line) keep
        # their conditionals for the JSON Schema validator; records get loader checks.
        conditions: tuple[Condition, ...] = ()
        if pointer or "x-traceml-stream" in node:
            by_name = {f.name: f for f in fields}
            conditions = self._conditions(file, pointer, node, by_name)
        model = ClassModel(
            class_name=class_name,
            title=str(node.get("title", class_name)),
            description=str(node.get("description", "")),
            fields=tuple(fields),
            schema_file=file,
            schema_id=schema_id,
            pointer=pointer,
            conditions=conditions,
            rules=tuple(node.get("x-traceml-rules", [])),
        )
        self.classes[class_name] = model
        self.class_order.append(class_name)
        return model

    def _conditions(
        self, file: str, pointer: str, node: dict[str, Any], fields: dict[str, FieldModel]
    ) -> tuple[Condition, ...]:
        entries: list[tuple[str, dict[str, Any]]] = []
        if any(k in node for k in ("if", "then", "else")):
            entries.append((pointer, node))
        for index, sub in enumerate(node.get("allOf", [])):
            entries.append((f"{pointer}/allOf/{index}", sub))
        for key in ("dependentRequired", "not"):
            if key in node:
                raise SchemaError(file, f"{pointer}/{key}", "not supported on a record")
        out: list[Condition] = []
        for here, entry in entries:
            if "if" in entry:
                if "then" not in entry and "else" not in entry:
                    raise SchemaError(file, here, "if needs then or else")
                out.append(
                    Condition(
                        when=self._tests(file, f"{here}/if", entry["if"], fields),
                        then=self._tests(file, f"{here}/then", entry.get("then", {}), fields),
                        otherwise=self._tests(file, f"{here}/else", entry.get("else", {}), fields),
                        pointer=here,
                    )
                )
            else:
                if "then" in entry or "else" in entry:
                    raise SchemaError(file, here, "then/else without if")
                out.append(Condition(None, self._tests(file, here, entry, fields), (), here))
        return tuple(out)

    def _tests(
        self, file: str, pointer: str, node: Any, fields: dict[str, FieldModel]
    ) -> tuple[FieldTest, ...]:
        if not isinstance(node, dict) or set(node) - {"properties"}:
            raise SchemaError(file, pointer, "conditions may only hold properties")
        tests = []
        for name, test in node.get("properties", {}).items():
            here = f"{pointer}/properties/{_escape(name)}"
            field = fields.get(name)
            if field is None or not isinstance(field.type, Scalar) or not field.required:
                raise SchemaError(file, here, "conditions test required scalar fields only")
            if not isinstance(test, dict) or len(test) != 1 or not set(test) <= {"const", "type"}:
                raise SchemaError(file, here, "a field test is one const or one type")
            json_type = test.get("type")
            if json_type is not None and json_type not in ("null", field.type.kind):
                raise SchemaError(file, here, f"type must be 'null' or {field.type.kind!r}")
            tests.append(FieldTest(name, "const" in test, test.get("const"), json_type))
        return tuple(tests)

    def _stream(self, file: str, schema_id: str, doc: dict[str, Any]) -> StreamModel:
        def need(key: str, kind: type) -> Any:
            value = doc.get(key)
            if not isinstance(value, kind):
                raise SchemaError(file, f"/{key}", f"stream schemas need {key} ({kind.__name__})")
            return value

        name = need("x-traceml-stream", str)
        key_fields = tuple(need("x-traceml-key", list))
        properties = doc["properties"]
        for key in key_fields:
            if key not in properties:
                raise SchemaError(file, "/x-traceml-key", f"key field {key!r} is not a property")
        carries_hostname = need("x-traceml-hostname", bool)
        if carries_hostname != ("hostname" in properties):
            raise SchemaError(
                file, "/x-traceml-hostname", "must match whether 'hostname' is a property"
            )
        if "hostname" in doc.get("required", []):
            raise SchemaError(file, "/required", "'hostname' is optional on every stream")
        stream_const = properties.get("stream", {}).get("const")
        if stream_const != name:
            raise SchemaError(file, "/properties/stream/const", f"must be {name!r}")
        return StreamModel(
            name=name,
            file_name=need("x-traceml-file", str),
            class_name=need("x-traceml-class", str),
            key_fields=key_fields,
            carries_hostname=carries_hostname,
            selected_by=tuple(need("x-traceml-selected-by", list)),
            order=need("x-traceml-order", int),
            schema_file=file,
            schema_id=schema_id,
            rules=tuple(doc.get("x-traceml-rules", [])),
            wire=self._wire(file, doc),
        )

    def _wire(self, file: str, doc: dict[str, Any]) -> WireModel | None:
        raw = doc.get("x-traceml-wire")
        if raw is None:
            return None
        here = "/x-traceml-wire"
        known = {"batch-stream", "from-batch", "fan-out", "fan-out-of"}
        if not isinstance(raw, dict) or not set(raw) <= known:
            raise SchemaError(file, here, f"an object with keys among {sorted(known)}")
        batch = raw.get("batch-stream")
        if not isinstance(batch, str) or not batch.isidentifier():
            raise SchemaError(file, here + "/batch-stream", "a stream name")
        properties = doc["properties"]
        from_batch = raw.get("from-batch", [])
        if not isinstance(from_batch, list) or not all(
            isinstance(f, str) and f in properties and f in WIRE_BATCH_FIELDS for f in from_batch
        ):
            raise SchemaError(
                file,
                here + "/from-batch",
                f"a list of the record's fields among {list(WIRE_BATCH_FIELDS)}",
            )
        fan_out: FanOutModel | None = None
        spec = raw.get("fan-out")
        if spec is not None:
            fan_keys = {"stream", "item-key", "count-field", "shared-fields", "max-entries"}
            if not isinstance(spec, dict) or set(spec) != fan_keys:
                raise SchemaError(
                    file, here + "/fan-out", f"an object with keys {sorted(fan_keys)}"
                )
            count_field = spec["count-field"]
            if count_field not in properties:
                raise SchemaError(file, here + "/fan-out/count-field", "not a property")
            shared = spec["shared-fields"]
            if not isinstance(shared, list) or not all(f in properties for f in shared):
                raise SchemaError(file, here + "/fan-out/shared-fields", "properties only")
            if type(spec["max-entries"]) is not int or spec["max-entries"] < 1:
                raise SchemaError(file, here + "/fan-out/max-entries", "a positive integer")
            fan_out = FanOutModel(
                stream=str(spec["stream"]),
                item_key=str(spec["item-key"]),
                count_field=str(count_field),
                shared_fields=tuple(shared),
                max_entries=spec["max-entries"],
            )
        fan_out_of = raw.get("fan-out-of")
        if fan_out_of is not None and fan_out_of != batch:
            raise SchemaError(file, here + "/fan-out-of", "must be the batch stream")
        return WireModel(
            batch_stream=batch,
            from_batch=tuple(from_batch),
            fan_out=fan_out,
            fan_out_of=fan_out_of,
        )


def _check_wire(streams: list[StreamModel]) -> None:
    """Fan-out streams and their parents name each other; batch streams are record streams."""
    by_name = {s.name: s for s in streams}
    for s in streams:
        if s.wire is None:
            continue
        here = "/x-traceml-wire"
        parent = by_name.get(s.wire.batch_stream)
        if parent is None or parent.wire is None or parent.wire.fan_out_of is not None:
            raise SchemaError(s.schema_file, here + "/batch-stream", "not a batch stream")
        if s.wire.fan_out_of is None and s.wire.batch_stream != s.name:
            raise SchemaError(
                s.schema_file, here, "a stream fed by another's batches needs fan-out-of"
            )
        if s.wire.fan_out_of is not None and (
            parent.wire.fan_out is None or parent.wire.fan_out.stream != s.name
        ):
            raise SchemaError(
                s.schema_file, here + "/fan-out-of", f"{parent.name} declares no fan-out to it"
            )
        fan = s.wire.fan_out
        if fan is not None:
            entry = by_name.get(fan.stream)
            if entry is None or entry.wire is None or entry.wire.fan_out_of != s.name:
                raise SchemaError(
                    s.schema_file, here + "/fan-out/stream", "needs a stream with fan-out-of"
                )


WIRE_BATCH_FIELDS = (
    "observed_timestamp_unix_ns",
    "rank",
    "global_rank",
    "local_rank",
    "world_size",
    "local_world_size",
    "node_rank",
    "hostname",
    "pid",
)
"""Record fields a stream may take from its batch (x-traceml-wire/from-batch)."""


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _walk(doc: dict[str, Any], fragment: str, file: str) -> dict[str, Any]:
    node: Any = doc
    if fragment:
        for raw in fragment.lstrip("/").split("/"):
            token = raw.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or token not in node:
                raise SchemaError(file, fragment, "$ref target does not exist")
            node = node[token]
    if not isinstance(node, dict):
        raise SchemaError(file, fragment, "$ref target is not a schema object")
    return node


def load_schemas(schema_dir: Path) -> SchemaSet:
    """Load and check every ``*.schema.json`` in ``schema_dir``."""
    return _Loader(schema_dir).load_all()
