"""How rank wire items become records, as the generated wire registry lists it.

The schemas declare it (``x-traceml-wire``); codegen writes one :class:`WireStream`
per batch stream in ``traceml_records._generated.wire``.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class FanOut:
    """Entries of a list in each item that become records of another stream, one each."""

    stream: str
    """The file stream of the entries' records (e.g. ``system_gpu``)."""
    record_class: type[Any]
    item_key: str
    """The item key holding the entries (a list of objects)."""
    count_field: str
    """The field of the item's own record that gets the number of entries."""
    shared_fields: tuple[str, ...]
    """Fields of each entry's record taken from the item's own record."""
    from_batch: tuple[str, ...]
    """Fields of each entry's record taken from the batch (see ``WireStream.from_batch``)."""
    entry_keys: frozenset[str]
    """The keys of one entry (None where the record omits the field)."""
    required_entry_keys: frozenset[str]
    """The keys an entry cannot lack (``entry_keys`` less optional record fields)."""
    max_entries: int
    """Most entries one item may carry; an item with more is skipped."""


@attrs.frozen(kw_only=True)
class WireStream:
    """One batch stream: which records its items become, and from what."""

    name: str
    """The batch (wire) stream name."""
    stream: str
    """The file stream of the item's own record (same name as the batch stream)."""
    record_class: type[Any]
    from_batch: tuple[str, ...]
    """Record fields filled from the batch, not the item: ``observed_timestamp_unix_ns``
    (when the aggregator received the batch), ``rank`` (the identity's ``global_rank``)
    and the identity fields of the same name (``hostname`` only when asked for)."""
    item_keys: frozenset[str]
    """The keys of one item; the rank sends every one (None where the record omits it)."""
    required_item_keys: frozenset[str]
    """The keys an item cannot lack: ``item_keys`` less the record's optional fields
    (fields added after release 1, which items of older ranks lack)."""
    string_fields: tuple[str, ...]
    """Item fields holding strings, checked against the aggregator's string size limit."""
    fan_out: FanOut | None = None

    @property
    def file_streams(self) -> tuple[str, ...]:
        """The file streams this batch stream feeds, its own first."""
        return (self.stream,) if self.fan_out is None else (self.stream, self.fan_out.stream)
