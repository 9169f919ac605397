"""Example lines and reference schema validators shared by the record tests."""

from __future__ import annotations

from typing import Any

import jsonschema
from referencing import Registry, Resource

from traceml_records._schemas import COMMON_SCHEMA_FILE, schema_documents

EXAMPLE_DATA_LINE = b'{"stream":"step_time","schema_version":1,"observed_timestamp_unix_ns":1793808200784977000,"rank":1,"global_rank":1,"local_rank":1,"world_size":2,"local_world_size":2,"node_rank":0,"timestamp_unix_ns":1793808199881904896,"seq":2,"step":1,"events":{"_traceml_internal:backward_time":{"cpu":{"cpu_ms":15.316009521484375,"duration_ms":15.316009521484375,"gpu_ms":null,"is_gpu":false,"n_calls":1}},"_traceml_internal:dataloader_next":{"cpu":{"cpu_ms":3.7009716033935547,"duration_ms":3.7009716033935547,"gpu_ms":null,"is_gpu":false,"n_calls":1}},"_traceml_internal:forward_time":{"cpu":{"cpu_ms":8.20612907409668,"duration_ms":8.20612907409668,"gpu_ms":null,"is_gpu":false,"n_calls":1}},"_traceml_internal:optimizer_step":{"cpu":{"cpu_ms":0.5419254302978516,"duration_ms":0.5419254302978516,"gpu_ms":null,"is_gpu":false,"n_calls":1}},"_traceml_internal:step_time":{"cpu":{"cpu_ms":27.03070640563965,"duration_ms":27.03070640563965,"gpu_ms":null,"is_gpu":false,"n_calls":1}}}}\n'
EXAMPLE_CLOSING_LINE = b'{"stream":"step_time","closing":true,"schema_version":1,"written_records":8,"dropped_batches":0}\n'
"""The two example lines of live-export.md ("The files"), byte for byte."""


def reference_validator(schema_file: str) -> jsonschema.Draft202012Validator:
    """jsonschema's Draft 2020-12 validator, ``$ref``s resolved from the shipped files."""
    docs = schema_documents()
    registry: Registry[Any] = Registry().with_resources(
        (d["$id"], Resource.from_contents(d)) for d in docs.values()
    )
    return jsonschema.Draft202012Validator(docs[schema_file], registry=registry)


REFERENCE = {
    name: reference_validator(name) for name in schema_documents() if name != COMMON_SCHEMA_FILE
}
"""The reference implementation (not the fast validator ``traceml validate`` uses), per
schema file."""


def schema_file_for(d: Any) -> str | None:
    """The schema file a parsed line claims to follow, or None when it names none."""
    if type(d) is not dict:
        return None
    if "closing" in d:
        return "closing.schema.json"
    if "status" in d:
        return "finalization_warning.schema.json"
    stream = d.get("stream")
    return f"{stream}.schema.json" if f"{stream}.schema.json" in REFERENCE else None
