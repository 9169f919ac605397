"""The description of one export stream, as the generated registry lists it."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class StreamSpec:
    """One export stream: its file, record class, key, hostname flag and selection names."""

    name: str
    file_name: str
    record_class: type[Any]
    key_fields: tuple[str, ...]
    carries_hostname: bool
    selected_by: tuple[str, ...]
    schema_id: str
    schema_file: str
    rules: tuple[str, ...] = ()
    """Names of the rules in ``traceml_records._rules`` that apply (x-traceml-rules)."""
