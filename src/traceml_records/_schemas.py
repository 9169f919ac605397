"""The JSON Schemas shipped as package data, and validators built from them once.

The schemas live in ``traceml_records/schemas/`` (copied there by the generator) and
reference each other by ``$id`` URN, so every validator resolves ``$ref`` through a
registry built from those files: nothing is ever fetched over the network.
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Mapping
from typing import Any

import orjson

from traceml_records._errors import Path
from traceml_records._generated.registry import SCHEMA_FILES

CLOSING_SCHEMA_FILE = "closing.schema.json"
WARNING_SCHEMA_FILE = "finalization_warning.schema.json"
COMMON_SCHEMA_FILE = "common.schema.json"


@functools.cache
def schema_documents() -> Mapping[str, dict[str, Any]]:
    """Schema file name → parsed schema, read from the package data."""
    folder = importlib.resources.files("traceml_records") / "schemas"
    return {name: orjson.loads(folder.joinpath(name).read_bytes()) for name in SCHEMA_FILES}


@functools.cache
def rs_validators() -> Mapping[str, Any]:
    """Schema file name → compiled ``jsonschema_rs`` validator (built once, reused)."""
    import jsonschema_rs

    docs = schema_documents()
    registry = jsonschema_rs.Registry([(doc["$id"], doc) for doc in docs.values()])
    return {
        name: jsonschema_rs.validator_for(doc, registry=registry)
        for name, doc in docs.items()
        if name != COMMON_SCHEMA_FILE
    }


def schema_errors(validator: Any, obj: Any) -> list[tuple[Path, str]]:
    """(path, message) of each error a ``jsonschema_rs`` validator finds in ``obj``.

    A missing or unexpected key is reported at the key itself, as the generated
    loaders do, rather than at the object holding it. Repeats (one missing key
    required by several rules) are reported once.
    """
    out: list[tuple[Path, str]] = []
    for error in validator.iter_errors(obj):
        path = tuple(error.instance_path)
        kind = error.kind
        name = type(kind).__name__
        if name == "Required":
            out.append(((*path, kind.property), "required key is missing"))
        elif name == "AdditionalProperties":
            out.extend(((*path, key), "key is not allowed here") for key in kind.unexpected)
        elif name == "PropertyNames":
            out.append(((*path, kind.error.instance), f"bad key: {error.message}"))
        else:
            out.append((path, error.message))
    return list(dict.fromkeys(out))
