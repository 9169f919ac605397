"""The generator, on small fixture schemas: output shape, strictness and stability.

The generated loaders are compared against an independent oracle, jsonschema's
Draft202012Validator, on hypothesis-generated documents.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import attrs
import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st
from referencing import Registry, Resource

from codegen.__main__ import main as codegen_main
from codegen._generate import generate
from codegen._model import SchemaError, load_schemas
from tests.e2e_helpers import REPO
from traceml_records import RecordError

FIXTURES = Path(__file__).parent / "fixtures"


def _fixture_root(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURES, tmp_path / "schemas")
    return tmp_path


def _import_records(tmp_path: Path) -> types.ModuleType:
    root = _fixture_root(tmp_path)
    files = generate(root)
    target = root / "gen_records.py"
    target.write_bytes(files[Path("src/traceml_records/_generated/records.py")])
    spec = importlib.util.spec_from_file_location("gen_records_fixture", target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen(tmp_path_factory: pytest.TempPathFactory) -> types.ModuleType:
    return _import_records(tmp_path_factory.mktemp("gen"))


def _validator() -> jsonschema.Draft202012Validator:
    docs = [json.loads(p.read_text()) for p in sorted(FIXTURES.glob("*.schema.json"))]
    registry: Registry[Any] = Registry().with_resources(
        (d["$id"], Resource.from_contents(d)) for d in docs
    )
    widget = next(d for d in docs if d["$id"] == "urn:test:widget")
    return jsonschema.Draft202012Validator(widget, registry=registry)


def test_classes_are_frozen_slotted_keyword_only_in_schema_order(gen: types.ModuleType) -> None:
    cls = gen.WidgetRecord
    assert [f.name for f in attrs.fields(cls)] == [
        "stream", "id", "hostname", "size", "kind", "label", "leaves", "tags",
    ]  # fmt: skip
    assert all(f.kw_only for f in attrs.fields(cls))
    assert "__slots__" in cls.__dict__
    leaf = gen.Leaf(value=None, flag=True)
    record = cls(id=1, size=2.0, kind="a", leaves={"x": leaf}, tags=(1, 2))
    assert record.stream == "widget" and record.hostname is None and record.label is None
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        record.id = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        cls(1, 2.0, "a", {}, ())  # positional arguments are refused


def test_annotations_follow_the_schema(gen: types.ModuleType) -> None:
    hints = typing.get_type_hints(gen.WidgetRecord)
    assert hints["stream"] == Literal["widget"]
    assert hints["kind"] == Literal["a", "b"]
    assert hints["hostname"] == str | None
    assert hints["label"] == str | None
    assert hints["leaves"] == dict[str, gen.Leaf]
    assert hints["tags"] == tuple[int, ...]
    assert typing.get_type_hints(gen.Leaf)["value"] == float | None


def test_dump_orders_keys_sorts_maps_and_places_hostname(gen: types.ModuleType) -> None:
    leaf = gen.Leaf(value=1.0, flag=False)
    record = gen.WidgetRecord(
        id=3, hostname="h", size=1.0, kind="b", leaves={"z": leaf, "a": leaf}, tags=(3,)
    )
    dump = gen.DUMPERS[gen.WidgetRecord]
    without = dump(record, False)
    assert list(without) == ["stream", "id", "size", "kind", "leaves", "tags"]
    assert list(without["leaves"]) == ["a", "z"]
    assert list(dump(record, True)) == [
        "stream",
        "id",
        "hostname",
        "size",
        "kind",
        "leaves",
        "tags",
    ]
    labelled = attrs.evolve(record, label="ab")
    assert list(dump(labelled, False))[4] == "label"


@pytest.mark.parametrize(
    ("change", "pointer"),
    [
        ({"id": "5"}, "/id"),
        ({"id": True}, "/id"),
        ({"id": -1}, "/id"),
        ({"id": 1001}, "/id"),
        ({"size": 100}, "/size"),
        ({"size": "1"}, "/size"),
        ({"kind": "c"}, "/kind"),
        ({"stream": "other"}, "/stream"),
        ({"label": "A"}, "/label"),
        ({"leaves": {}}, "/leaves"),
        ({"leaves": {"BAD": {"value": 1, "flag": True}}}, "/leaves/BAD"),
        ({"leaves": {"x": {"value": -1, "flag": True}}}, "/leaves/x/value"),
        ({"leaves": {"x": {"value": 1, "flag": 1}}}, "/leaves/x/flag"),
        ({"leaves": {"x": {"value": 1}}}, "/leaves/x/flag"),
        ({"tags": [1, 1]}, "/tags"),
        ({"tags": [1, "2"]}, "/tags/1"),
        # if/then/else, const, propertyNames if/then (a reserved key prefix)
        ({"kind": "b"}, "/id"),
        ({"kind": "b", "id": 7}, "/size"),
        ({"leaves": {"x": {"value": 1.0, "flag": False}}}, "/leaves/x/value"),
        ({"leaves": {"ax": {"value": None, "flag": True}}}, "/leaves/ax"),
        ({"extra": 1}, "/extra"),
    ],
)
def test_loader_rejects_with_json_pointer(
    gen: types.ModuleType, change: dict[str, Any], pointer: str
) -> None:
    doc: dict[str, Any] = {
        "stream": "widget",
        "id": 1,
        "size": 1.5,
        "kind": "a",
        "leaves": {"x": {"value": None, "flag": True}},
        "tags": [],
    }
    doc.update(change)
    assert not _validator().is_valid(doc)  # the oracle agrees it is invalid
    with pytest.raises(RecordError) as info:
        gen.LOADERS[gen.WidgetRecord](doc, ())
    assert info.value.pointer == pointer
    assert str(info.value).startswith(pointer + ":")


def test_integral_float_is_not_an_integer(gen: types.ModuleType) -> None:
    # JSON Schema counts 1.0 as an integer; the line format writes integers without a
    # fraction, so the strict loader refuses it (the validator reports both views).
    doc = {"stream": "widget", "id": 1.0, "size": 1.0, "kind": "a", "tags": [],
           "leaves": {"cpu": {"value": None, "flag": True}}}  # fmt: skip
    assert _validator().is_valid(doc)
    with pytest.raises(RecordError) as info:
        gen.LOADERS[gen.WidgetRecord](doc, ())
    assert info.value.pointer == "/id"


def test_missing_key_is_reported(gen: types.ModuleType) -> None:
    with pytest.raises(RecordError) as info:
        gen.LOADERS[gen.WidgetRecord]({"stream": "widget"}, ())
    assert "required" in str(info.value)


def test_patterns_use_ecma_end_anchor(gen: types.ModuleType) -> None:
    # Python's "$" also matches before a final newline; JSON Schema's does not.
    doc = {"stream": "widget", "id": 1, "size": 1.0, "kind": "a", "tags": [],
           "leaves": {"cpu\n": {"value": None, "flag": True}}}  # fmt: skip
    with pytest.raises(RecordError):
        gen.LOADERS[gen.WidgetRecord](doc, ())


_leaf_keys = st.from_regex(r"\A[a-z]{1,4}(:[0-9]{1,2})?\Z") | st.text(max_size=3).filter(
    lambda s: not s.endswith("\n")
)
# Integral floats are left out: JSON Schema calls 1.0 an integer, the line format does
# not (see test_integral_float_is_not_an_integer).
_fraction = st.floats(-3, 120, allow_nan=False).filter(lambda f: not f.is_integer())
_any_scalar = st.none() | st.booleans() | st.integers(-5, 2000) | _fraction | st.text(max_size=3)
_leaf = st.fixed_dictionaries(
    {
        "value": st.none() | st.floats(-1, 5, allow_nan=False) | st.integers(-1, 5) | _any_scalar,
        "flag": st.booleans() | _any_scalar,
    },
    optional={"junk": _any_scalar},
)
_widget = st.fixed_dictionaries(
    {
        "stream": st.sampled_from(["widget", "widget", "other"]),
        "id": st.integers(-2, 1002) | _any_scalar,
        "size": _fraction
        | st.floats(-2, 100, allow_nan=False)
        | st.integers(-2, 100)
        | _any_scalar,
        "kind": st.sampled_from(["a", "b", "c"]) | _any_scalar,
        "leaves": st.dictionaries(_leaf_keys, _leaf, max_size=3),
        "tags": st.lists(st.integers(-1, 5) | _any_scalar, max_size=3),
    },
    optional={
        "hostname": st.none() | st.text(max_size=3) | st.integers(),
        "label": st.from_regex(r"\A[a-z]{0,3}\Z") | _any_scalar,
        "unexpected": _any_scalar,
    },
)


@given(_widget)
def test_loader_agrees_with_jsonschema_oracle(gen: types.ModuleType, doc: dict[str, Any]) -> None:
    oracle_ok = _validator().is_valid(doc)
    try:
        record = gen.LOADERS[gen.WidgetRecord](doc, ())
    except RecordError:
        assert not oracle_ok, doc
        return
    assert oracle_ok, doc
    # An accepted document dumps back to an equal JSON object (label omitted when absent).
    dumped = gen.DUMPERS[gen.WidgetRecord](record, "hostname" in doc)
    expected = {k: v for k, v in doc.items() if not (k == "label" and v is None)}
    assert json.loads(json.dumps(dumped)) == json.loads(json.dumps(expected))


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (
            lambda s: s["properties"].update(x={"oneOf": [], "description": "d"}),
            "/properties/x/oneOf",
        ),
        (
            lambda s: s["properties"].update(x={"type": ["integer", "string"], "description": "d"}),
            "/properties/x/type",
        ),
        (lambda s: s["properties"].update(x={"type": "integer"}), "/properties/x"),
        (
            lambda s: s["properties"].update(
                x={"type": "object", "properties": {}, "description": "d"}
            ),
            "/properties/x",
        ),
        (lambda s: s.update({"x-traceml-colour": 1}), "/x-traceml-colour"),
        (lambda s: s.pop("$id"), "/$id"),
        (lambda s: s.update({"x-traceml-key": ["nope"]}), "/x-traceml-key"),
        (lambda s: s.update({"additionalProperties": True}), "/additionalProperties"),
        (lambda s: s["x-traceml-wire"].update({"from-batch": ["size"]}), "/x-traceml-wire"),
        (lambda s: s["x-traceml-wire"].update({"batch-stream": "nope"}), "/x-traceml-wire"),
    ],
)
def test_unsupported_constructs_name_file_and_pointer(
    tmp_path: Path, mutate: Any, fragment: str
) -> None:
    root = _fixture_root(tmp_path)
    path = root / "schemas" / "widget.schema.json"
    schema = json.loads(path.read_text())
    mutate(schema)
    path.write_text(json.dumps(schema))
    with pytest.raises(SchemaError) as info:
        load_schemas(root / "schemas")
    assert "widget.schema.json" in str(info.value)
    assert fragment in str(info.value)


def test_output_is_deterministic_and_marked_generated(tmp_path: Path) -> None:
    root = _fixture_root(tmp_path)
    first, second = generate(root), generate(root)
    assert first == second
    for rel, content in first.items():
        if rel.suffix in (".py", ".md") and rel.name != "__init__.py":
            assert b"AUTO-GENERATED" in content.split(b"\n", 2)[0], rel
            assert b"20" + b"26-" not in content  # no dates


def test_check_mode_passes_on_the_repository() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "codegen", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_mode_reports_a_stale_file_with_a_diff(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _fixture_root(tmp_path)
    assert codegen_main(["--root", str(root)]) == 0
    assert codegen_main(["--root", str(root), "--check"]) == 0
    stale = root / "src/traceml_records/_generated/records.py"
    stale.write_text(stale.read_text().replace("A widget line.", "Edited by hand."))
    capsys.readouterr()
    assert codegen_main(["--root", str(root), "--check"]) == 1
    out = capsys.readouterr().out
    assert '-    """Edited by hand.' in out and '+    """A widget line.' in out
    assert stale.read_text().count("Edited by hand.") == 1  # --check writes nothing


def test_check_mode_reports_a_leftover_generated_file(tmp_path: Path) -> None:
    root = _fixture_root(tmp_path)
    assert codegen_main(["--root", str(root)]) == 0
    (root / "src/traceml_records/_generated/orphan.py").write_text("x = 1\n")
    assert codegen_main(["--root", str(root), "--check"]) == 1


def test_registry_and_docs_for_the_fixture(tmp_path: Path) -> None:
    files = generate(_fixture_root(tmp_path))
    registry = files[Path("src/traceml_records/_generated/registry.py")].decode()
    assert 'key_fields=("id",)' in registry and 'selected_by=("widget", "all")' in registry
    reference = files[Path("docs/reference/export-records.md")].decode()
    assert "| `size` | float -1.5 to 99 | no | mm | Size. |" in reference
    keys = files[Path("docs/reference/stream-keys.md")].decode()
    assert "| `widget` | `widget.jsonl` | `(id)` | yes | `widget`, `all` |" in keys


def test_encoder_plans_describe_the_schema(gen: types.ModuleType) -> None:
    """ENCODER_PLANS (what the C encoder walks) say what the schema says, in line order."""
    plan = {name: (spec, flag) for name, spec, flag in gen.ENCODER_PLANS[gen.WidgetRecord]}
    assert [name for name, _, _ in gen.ENCODER_PLANS[gen.WidgetRecord]] == [
        f.name for f in attrs.fields(gen.WidgetRecord)
    ]
    assert plan["stream"] == ((3, False, None, None, None, 0, frozenset({"widget"})), 0)
    assert plan["id"] == ((0, False, None, 0, 1000, 0, None), 0)
    assert plan["hostname"] == ((3, True, None, None, None, 0, None), 1)  # only when asked
    assert plan["size"] == ((1, False, None, -1.5, 99, 0, None), 0)
    assert plan["kind"][0][6] == frozenset({"a", "b"})
    label, flag = plan["label"]
    # a pattern: the compiled pattern itself; the C encoder remembers matches in a set
    # of its own, never the loaders' (no mutable cache shared between them)
    assert (label[0], label[5], flag) == (3, 2, 2) and isinstance(label[6], re.Pattern)
    leaves, _ = plan["leaves"]
    assert leaves[:2] == (5, False) and leaves[2] == (4, False, gen.Leaf, None, None, 0, None)
    assert leaves[5] == 1 and isinstance(leaves[6], re.Pattern)  # minProperties, key pattern
    assert plan["tags"] == ((6, False, (0, False, None, 0, None, 0, None), None, None, 0, False), 0)
    assert gen.ENCODER_PLANS[gen.Leaf] == (
        ("value", (1, True, None, 0, None, 0, None), 0),
        ("flag", (2, False, None, None, None, 0, None), 0),
    )
    # the plans hold the patterns the generated loaders match against
    assert label[6].search("ab") and not label[6].search("AB")
    assert leaves[6].search("x")


def test_wire_contract_is_generated_from_x_traceml_wire(tmp_path: Path) -> None:
    """x-traceml-wire gives the wire registry, the item TypedDict and the doc table."""
    root = _fixture_root(tmp_path)
    doc = root / "docs" / "dev" / "wire-format.md"
    doc.parent.mkdir(parents=True)
    doc.write_text(
        "# Wire\n\n<!-- BEGIN generated by `python -m codegen`: wire items -->\n"
        "<!-- END generated: wire items -->\n\nafter\n"
    )
    files = generate(root)
    wire = files[Path("src/traceml_records/_generated/wire.py")].decode()
    assert 'BATCH_STREAMS: tuple[str, ...] = ("widget",)' in wire
    assert "class WidgetItem(TypedDict):" in wire
    # hostname comes from the batch; stream is the stream's constant.
    assert 'item_keys=frozenset({"id", "size", "kind", "label", "leaves", "tags"})' in wire
    assert "    leaves: dict[str, LeafItem]\n" in wire
    assert "    label: str | None\n" in wire  # optional in the record: sent as None
    page = files[Path("docs/dev/wire-format.md")].decode()
    assert "| `widget` | `id`, `size`, `kind`, `label`, `leaves` (name → `{value, flag}`)" in page
    assert page.startswith("# Wire\n") and page.endswith("\nafter\n")
