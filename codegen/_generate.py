"""Produce every generated file from the schemas, as a mapping path → content."""

from __future__ import annotations

from pathlib import Path

from codegen._model import load_schemas
from codegen._render_arrow import render_arrow_tables, render_tables_reference
from codegen._render_checks import render_checks
from codegen._render_docs import render_reference, render_stream_keys
from codegen._render_events import render_events
from codegen._render_python import render_plan_header, render_records, render_registry
from codegen._render_wire import render_wire, render_wire_table, splice_wire_table

PACKAGE = Path("src/traceml_records")
WIRE_DOC = Path("docs/dev/wire-format.md")


def generate(root: Path) -> dict[Path, bytes]:
    """Every generated file, relative to the repository ``root``."""
    schema_set = load_schemas(root / "schemas")
    files: dict[Path, bytes] = {
        PACKAGE
        / "_generated"
        / "__init__.py": b'"""Generated code: do not edit (see codegen/)."""\n',
        PACKAGE / "_generated" / "records.py": render_records(schema_set).encode(),
        PACKAGE / "_generated" / "registry.py": render_registry(schema_set).encode(),
        PACKAGE / "_generated" / "wire.py": render_wire(schema_set).encode(),
        PACKAGE / "_plan_codes.h": render_plan_header().encode(),
        Path("docs/reference/export-records.md"): render_reference(schema_set).encode(),
        Path("docs/reference/stream-keys.md"): render_stream_keys(schema_set).encode(),
        PACKAGE / "_generated" / "tables.py": render_arrow_tables(schema_set).encode(),
        PACKAGE / "_generated" / "checks.py": render_checks(schema_set).encode(),
        Path("docs/reference/tables.md"): render_tables_reference(schema_set).encode(),
    }
    events = render_events(schema_set)
    if events is not None:
        files[PACKAGE / "_generated" / "events.py"] = events.encode()
    wire_doc = root / WIRE_DOC
    if wire_doc.exists():
        # A hand-written page with one generated section (the item table).
        files[WIRE_DOC] = splice_wire_table(
            wire_doc.read_text(encoding="utf-8"), render_wire_table(schema_set)
        ).encode()
    # The schemas travel as package data, byte for byte.
    for name, data in schema_set.schema_files:
        files[PACKAGE / "schemas" / name] = data
    return files


def generated_dirs() -> tuple[Path, ...]:
    """Folders that hold only generated files (stale files there are reported)."""
    return (PACKAGE / "_generated", PACKAGE / "schemas")
