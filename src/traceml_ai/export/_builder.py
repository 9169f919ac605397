"""Turns wire batches into typed records of the selected streams.

This is the aggregator's hot path, and it is one table-driven loop: the generated wire
registry (``traceml_records._generated.wire``, from each schema's ``x-traceml-wire``)
says, per batch stream, the item keys, which record fields come from the batch, and
the declared fan-out (a ``system`` item's ``gpus`` become ``system_gpu`` records).
Each item becomes the JSON-like dict its line would have (fields from the batch, then
the item's) and goes through the generated strict loader of its record class, which
enforces types, ranges and patterns without coercion; then the stream's named rules
of ``traceml_records._rules`` that a JSON Schema cannot state. An item that fails
anything is skipped and counted; ``build`` never raises.

Every record of a batch shares the batch's identity block, so it is checked once: the
first record of a batch that loads goes through the full loader (identity merged in),
and the records after it through the generated item loader, which checks the item's
fields just as strictly and takes the identity block as already checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import orjson

from traceml_ai.export._encoded import EncodedLines
from traceml_ai.transport.wire import (
    FrameError,
    ReceivedBatch,
    decode_batch_body,
    peek_batch_stream,
)
from traceml_records import (
    SCHEMA_VERSION,
    STREAMS,
    STREAMS_BY_NAME,
    PhaseTiming,
    StepTimeRecord,
)
from traceml_records.events import BUILT_IN_EVENTS, RESERVED_PREFIX, STEP_TIME
from traceml_records.internal import (
    ENCODER_CONDITIONS,
    ENCODER_PLANS,
    FILE_STREAMS_OF_BATCH,
    IDENTITY_RULES,
    ITEM_LOADERS,
    LOADERS,
    WIRE_STREAMS,
    FanOut,
    Flag,
    LineCheck,
    WireStream,
    dumps_line,
    duration_ok,
    encode_batch,
    encode_items,
    identity_ok,
    line_checks,
    line_findings,
    split_batch,
)
from traceml_records.internal import FieldPath as Path

__all__ = [
    "BUILTIN_EVENT_NAMES",
    "INTERNAL_PREFIX",
    "MAX_EVENT_ENTRIES",
    "MAX_GPUS_PER_SNAPSHOT",
    "MAX_STRING_BYTES",
    "BuildResult",
    "RecordBuilder",
    "batch_streams_for",
]

MAX_STRING_BYTES = 64 * 1024
"""Longest string (UTF-8 bytes) an item may carry; longer ones make the item skipped."""

MAX_EVENT_ENTRIES = 1024
"""Most phase timings (event-device pairs) one step_time item may carry."""

MAX_GPUS_PER_SNAPSHOT = 1024
"""Most GPU entries one system item may carry."""

INTERNAL_PREFIX = RESERVED_PREFIX
BUILTIN_EVENT_NAMES = frozenset(BUILT_IN_EVENTS)
"""The reserved event names this release writes; other ``_traceml_internal:`` names are invalid."""

_INT64_MAX = 2**63 - 1
# A str of at most this many code points is at most MAX_STRING_BYTES in UTF-8 (4 bytes
# per code point), so only longer ones pay for an encode.
_SAFE_CHARS = MAX_STRING_BYTES // 4

_NO_PATH: Path = ()

_LineStart = tuple[bytes, bytes, str, tuple[tuple[int, Any], ...]]
"""A line's start around the observed timestamp (text before, text after), its file
stream, and the batch fields among the item's (``_prefix_around``)."""

_MAX_PREFIXES = 65_536
"""Most identity blocks whose line start the C encoder's mode keeps (one per rank and
stream: 16,384 ranks' three streams fit; past it the cache starts over)."""
_UNSEEN: Any = object()


class _Skip(Exception):
    """An item (or a whole batch) that cannot become valid records."""


def _limit_step_time(item: dict[str, Any]) -> None:
    """A step_time item's events map must be a map of at most MAX_EVENT_ENTRIES names."""
    events = item["events"]
    if type(events) is not dict or len(events) > MAX_EVENT_ENTRIES:
        raise _Skip


def _check_step_time(record: Any) -> None:
    _check_events(record.events)


# What the aggregator adds to the schema's checks, per batch stream: size limits looked
# at before loading, and checks of the loaded record (step_time's duration rule, on the
# loaded timings: the hot path).
_LIMITS: dict[str, Callable[[dict[str, Any]], None]] = {"step_time": _limit_step_time}
_CHECKS: dict[str, Callable[[Any], None]] = {"step_time": _check_step_time}
_CHECKED_RULES = frozenset((*IDENTITY_RULES, "duration-matches-timing"))
"""Rules not checked per item by ``line_findings``: the identity rules (checked once per
batch with identity_ok) and step_time's duration rule (``_CHECKS``)."""


@attrs.frozen(slots=True)
class _FanOutPlan:
    """How the entries of an item's list become records of another stream."""

    spec: FanOut
    load: Callable[[Any, Path], Any]
    unique_fields: tuple[str, ...]
    """The fan-out stream's key fields that are not the same for every entry of an item."""


@attrs.frozen(slots=True)
class _StreamPlan:
    """How the items of one batch stream become records (from the generated WIRE_STREAMS)."""

    wire: WireStream
    keys: frozenset[str]
    required_keys: frozenset[str]
    strings: tuple[str, ...]
    load: Callable[[Any, Path], Any]
    load_item: Callable[[dict[str, Any], Any, Path], Any] | None
    """The item loader, used once the batch's identity block was checked; None when
    every item needs its whole line (line rules to check, or a fan-out)."""
    rules: tuple[LineCheck, ...]
    limit: Callable[[dict[str, Any]], None] | None
    check: Callable[[Any], None] | None
    fan_out: _FanOutPlan | None


def _plan(wire: WireStream) -> _StreamPlan:
    rules = line_checks(
        tuple(r for r in STREAMS_BY_NAME[wire.stream].rules if r not in _CHECKED_RULES)
    )
    fan_out = None
    if wire.fan_out is not None:
        fan = wire.fan_out
        key_fields = STREAMS_BY_NAME[fan.stream].key_fields
        fan_out = _FanOutPlan(
            spec=fan,
            load=LOADERS[fan.record_class],
            unique_fields=tuple(
                k for k in key_fields if k not in fan.shared_fields and k not in fan.from_batch
            ),
        )
    return _StreamPlan(
        wire=wire,
        keys=wire.item_keys,
        required_keys=wire.required_item_keys,
        strings=wire.string_fields,
        load=LOADERS[wire.record_class],
        load_item=ITEM_LOADERS[wire.record_class] if not rules and fan_out is None else None,
        rules=rules,
        limit=_LIMITS.get(wire.name),
        check=_CHECKS.get(wire.name),
        fan_out=fan_out,
    )


_PLANS: dict[str, _StreamPlan] = {name: _plan(wire) for name, wire in WIRE_STREAMS.items()}

# The C encoder's rule data for step_time, what it checks in place of _LIMITS and
# _CHECKS: the schema's event names (traceml_records.events), the size limit, and the
# class whose timings get the duration rule.
_STEP_TIME_RULES = (
    BUILTIN_EVENT_NAMES,
    RESERVED_PREFIX,
    STEP_TIME,
    MAX_EVENT_ENTRIES,
    PhaseTiming,
)
_C_RULES: dict[str, tuple[Any, ...]] = {"step_time": _STEP_TIME_RULES}


@attrs.frozen(slots=True)
class _LinePlan:
    """How the C encoder writes the lines of a batch stream from its wire items: each
    line is the batch's identity prefix followed by the record's fields from
    ``first_item_field`` on: the item's, and the batch fields placed among them."""

    wire_name: bytes
    record_class: type[Any]
    first_item_field: int
    batch_fields: tuple[tuple[int, str], ...]
    """(field index, name) of each batch field the record places among the item's
    fields (process's ``pid``): the C encoder checks the batch's value and writes it
    there in every line."""
    rules: tuple[Any, ...] | None
    conditions: tuple[Any, ...] | None
    """The record class's schema conditions, each test naming its field by index."""


def _nested_classes(record_class: type[Any]) -> set[type[Any]]:
    """The classes of the objects a record holds, at any depth."""
    found: set[type[Any]] = set()

    def visit(spec: Any) -> None:
        if spec is None:
            return
        if isinstance(spec.sub, type):
            if spec.sub not in found:
                found.add(spec.sub)
                for field in ENCODER_PLANS[spec.sub]:
                    visit(field.spec)
        else:
            visit(spec.sub)

    for field in ENCODER_PLANS[record_class]:
        visit(field.spec)
    return found


def _line_plan(plan: _StreamPlan) -> _LinePlan | None:
    """The C encoder's plan for a batch stream, or None where its items need Python: a
    line rule, a fan-out, a check in Python only, record fields that do not start with
    the batch's fields (each batch field after them must be one written always, which
    the C encoder checks and places among the item's), a condition on a batch field or
    on a float's value, or a nested object's condition the C rules do not cover
    (step_time's phase timings: the duration rule). Optional item keys are the C
    encoder's too: one written only with a value (flag OMIT_NONE) is left out when
    missing or None, and an item without an always-written one (an older sender's) is
    handed to Python, which writes null."""
    wire = plan.wire
    rules = _C_RULES.get(wire.name)
    if plan.load_item is None or ((plan.limit or plan.check) and rules is None):
        return None
    fields = ENCODER_PLANS[wire.record_class]
    from_batch = ("stream", "schema_version", *wire.from_batch)
    first = next((i for i, f in enumerate(fields) if f.name not in from_batch), len(fields))
    tail = fields[first:]
    among = tuple((first + i, f.name) for i, f in enumerate(tail) if f.name in from_batch)
    among_names = {name for _, name in among}
    head = tuple(name for name in from_batch if name not in among_names)
    if "observed_timestamp_unix_ns" not in head:
        return None  # the line start is cached per identity around this field
    if (
        tuple(field.name for field in fields[:first]) != head
        or {field.name for field in tail} != wire.item_keys | among_names
        or wire.item_keys & among_names
        or not wire.required_item_keys <= wire.item_keys
        # written always, or only with a value (no hostname); a batch field always
        or any(field.flag not in (Flag.ALWAYS, Flag.OMIT_NONE) for field in tail)
        or any(fields[i].flag is not Flag.ALWAYS for i, _ in among)
    ):
        return None
    covered = {rules[-1]} if rules is not None else set()  # the phase class
    if any(cls in ENCODER_CONDITIONS for cls in _nested_classes(wire.record_class) - covered):
        return None
    index = {field.name: i for i, field in enumerate(fields)}
    conditions = []
    for when, then, otherwise in ENCODER_CONDITIONS.get(wire.record_class, ()):
        tests = [*(when or ()), *then, *otherwise]
        if any(index[name] < first or name in among_names for name, _ in tests) or any(
            text is not None and text != b"null" and fields[index[name]].spec.kind == 1
            for name, text in tests
        ):  # a batch field, or a float const (its text is orjson's only once written)
            return None

        def by_index(group: tuple[tuple[str, bytes | None], ...]) -> tuple[Any, ...]:
            return tuple((index[name], text) for name, text in group)

        conditions.append(
            (None if when is None else by_index(when), by_index(then), by_index(otherwise))
        )
    return _LinePlan(
        wire.name.encode(), wire.record_class, first, among, rules, tuple(conditions) or None
    )


_LINE_PLANS: dict[str, _LinePlan] = {
    name: line for name, plan in _PLANS.items() if (line := _line_plan(plan)) is not None
}
assert "step_time" in _LINE_PLANS and _LINE_PLANS["step_time"].record_class is StepTimeRecord


@attrs.frozen(slots=True)
class BuildResult:
    """The records built from one batch, and how many of its items were skipped.

    ``records`` maps a file stream name to its records in item order; streams appear
    in registry order (``system`` before ``system_gpu``) and only when they got a record.
    With ``encode_lines``, a step_time group is an :class:`EncodedLines`.
    """

    records: Mapping[str, Sequence[Any]]
    skipped_items: int

    @property
    def record_count(self) -> int:
        """Records over all streams."""
        return sum(len(group) for group in self.records.values())


_EMPTY = BuildResult(records={}, skipped_items=0)


def batch_streams_for(file_streams: Iterable[str]) -> frozenset[str]:
    """Wire (batch) streams whose items feed at least one of ``file_streams``."""
    wanted = set(file_streams)
    return frozenset(
        batch for batch, files in FILE_STREAMS_OF_BATCH.items() if wanted.intersection(files)
    )


def _is_int(value: object, low: int) -> bool:
    # ``type(...) is int`` rejects bool (an int subclass) and int-valued floats alike.
    return type(value) is int and low <= value <= _INT64_MAX


def _str_too_big(value: str) -> bool:
    return len(value) > _SAFE_CHARS and len(value.encode("utf-8", "surrogatepass")) > (
        MAX_STRING_BYTES
    )


def _nan_to_none(value: Any) -> Any:
    """A copy of ``value`` with every non-finite float set to None (the line says null).

    Only called after the strict loader refused an item, so clean items never pay for
    the walk; where the field is not nullable the loader refuses the None in turn.
    """
    if type(value) is float:
        return value if math.isfinite(value) else None
    if type(value) is dict:
        return {k: _nan_to_none(v) for k, v in value.items()}
    if type(value) is list:
        return [_nan_to_none(v) for v in value]
    return value


def _check_events(events: Mapping[str, Mapping[str, Any]]) -> None:
    """The duration rule and the size limits of a loaded step_time ``events`` map.

    (Reserved names, the required step event and ``is_gpu`` ⇒ ``gpu_ms`` are schema
    rules: the loader checked them.)
    """
    entries = 0
    for name, devices in events.items():
        # Built-in names (the usual case) are short.
        if name not in BUILTIN_EVENT_NAMES and len(name) > _SAFE_CHARS and _str_too_big(name):
            raise _Skip
        entries += len(devices)
        for device, timing in devices.items():
            # Device keys match ^[a-z]+(:[0-9]+)?$ (ASCII), so len() is their byte size.
            if len(device) > MAX_STRING_BYTES:
                raise _Skip
            if not duration_ok(timing.is_gpu, timing.cpu_ms, timing.duration_ms, timing.gpu_ms):
                raise _Skip
    if entries > MAX_EVENT_ENTRIES:
        raise _Skip


_NO_FAN_OUT: list[Any] = []


def _record(
    plan: _StreamPlan, bases: tuple[dict[str, Any], dict[str, Any]], item: Any, trusted: bool
) -> tuple[Any, list[Any]]:
    """The record of one item and its fan-out records, or an exception (item skipped).

    ``trusted``: a record of the same batch already loaded, so the item loader (which
    takes the identity block as checked) suffices where the stream has one.
    """
    if type(item) is not dict:
        raise _Skip
    keys = item.keys()
    if keys != plan.keys and not (plan.required_keys <= keys <= plan.keys):
        raise _Skip  # an older rank's item may lack an optional field
    for name in plan.strings:
        value = item.get(name)  # an optional string field may be missing
        if type(value) is str and _str_too_big(value):
            raise _Skip
    if plan.limit is not None:
        plan.limit(item)
    load_item = plan.load_item
    if trusted and load_item is not None:  # the hot path
        try:
            record = load_item(bases[0], item, _NO_PATH)
        except ValueError:
            # Retry once with non-finite floats as null; clean items never get here.
            record = load_item(bases[0], _nan_to_none(item), _NO_PATH)
        if plan.check is not None:
            plan.check(record)
        return record, _NO_FAN_OUT
    try:
        return _load(plan, bases, item)
    except ValueError:
        return _load(plan, bases, _nan_to_none(item))


def _load(
    plan: _StreamPlan, bases: tuple[dict[str, Any], dict[str, Any]], item: dict[str, Any]
) -> tuple[Any, list[Any]]:
    """The full load of one item: its whole line, the line rules, the fan-out."""
    d = bases[0].copy()
    d.update(item)
    fan = plan.fan_out
    entries: Any = None
    if fan is not None:
        entries = d.pop(fan.spec.item_key)
        if type(entries) is not list or len(entries) > fan.spec.max_entries:
            raise _Skip
        d[fan.spec.count_field] = len(entries)
    record = plan.load(d, _NO_PATH)
    if plan.rules and line_findings(plan.rules, d):
        raise _Skip
    if plan.check is not None:
        plan.check(record)
    if fan is None:
        return record, _NO_FAN_OUT
    return record, _fan_out(fan, bases[1], record, entries)


def _fan_out(fan: _FanOutPlan, base: dict[str, Any], record: Any, entries: list[Any]) -> list[Any]:
    """The records of an item's entries: all of them or none (an exception)."""
    spec = fan.spec
    shared = {name: getattr(record, name) for name in spec.shared_fields}
    out: list[Any] = []
    seen: set[tuple[Any, ...]] = set()
    for entry in entries:
        if type(entry) is not dict:
            raise _Skip
        keys = entry.keys()
        if keys != spec.entry_keys and not (spec.required_entry_keys <= keys <= spec.entry_keys):
            raise _Skip
        d = base.copy()
        d.update(shared)
        d.update(entry)
        entry_record = fan.load(d, _NO_PATH)
        key = tuple(getattr(entry_record, name) for name in fan.unique_fields)
        if key in seen:
            raise _Skip  # the fan-out stream's key must be unique
        seen.add(key)
        out.append(entry_record)
    return out


class RecordBuilder:
    """Builds typed records of the selected file streams from received wire batches.

    ``streams`` are file stream names (``traceml_records.STREAMS_BY_NAME``); a batch
    whose wire stream feeds none of them is returned empty without a look at its
    items, so unselected items are never built nor counted. ``include_hostname``
    puts the rank's hostname on the records (otherwise ``hostname`` stays None, so
    custom exporters cannot leak it either).
    """

    def __init__(
        self, streams: Iterable[str], include_hostname: bool, *, encode_lines: bool = False
    ) -> None:
        selected = set(streams)
        unknown = selected.difference(STREAMS_BY_NAME)
        if unknown:
            raise ValueError(f"unknown export streams: {', '.join(sorted(unknown))}")
        self._streams = tuple(spec.name for spec in STREAMS if spec.name in selected)
        self._include_hostname = include_hostname
        self._selected = frozenset(self._streams)
        wanted = batch_streams_for(self._streams)
        self._plans = {name: plan for name, plan in _PLANS.items() if name in wanted}
        self._encode_items = encode_items if encode_lines else None
        # Line mode: the streams the C encoder writes, and its reading of a batch's
        # bytes (both None without the extension).
        self._line_plans = (
            {name: line for name, line in _LINE_PLANS.items() if name in wanted}
            if self._encode_items is not None
            else {}
        )
        self._encode_batch = encode_batch if self._encode_items is not None else None
        self._split_batch = split_batch if self._encode_items is not None else None
        self._line_plans_by_name = {plan.wire_name: plan for plan in self._line_plans.values()}
        # (wire stream, identity block bytes) -> a line's start around the timestamp.
        self._prefixes: dict[tuple[bytes, bytes], _LineStart | None] = {}

    @property
    def streams(self) -> tuple[str, ...]:
        """The selected file streams, in registry order."""
        return self._streams

    @property
    def encodes_lines(self) -> bool:
        """Whether step_time groups come as :class:`EncodedLines` (for the JSONL exporter).

        Asked for with ``encode_lines=True``; needs the C encoder of ``traceml_records``
        (without it, groups are typed records as usual).
        """
        return self._encode_items is not None

    @property
    def include_hostname(self) -> bool:
        """Whether built records carry the rank's hostname."""
        return self._include_hostname

    def wants(self, batch: ReceivedBatch) -> bool:
        """Whether ``batch`` feeds a selected stream (looks at its stream name only)."""
        payload = batch.payload
        if type(payload) is bytes:
            stream = peek_batch_stream(payload)
            return stream is None or stream in self._plans
        return type(payload) is dict and payload.get("stream") in self._plans

    def build(self, batch: ReceivedBatch) -> BuildResult:
        """Records of the selected streams in ``batch``; never raises.

        Every item of a selected stream becomes its record(s) or counts once in
        ``skipped_items``. A bad identity or timestamp skips every item of the batch.
        """
        payload: Any = batch.payload
        if type(payload) is bytes:
            if self._split_batch is not None:
                # A stream the C encoder writes is known from the split alone.
                parts = self._split_batch(payload)
                line_plan = None if parts is None else self._line_plans_by_name.get(parts[0])
                if line_plan is not None:
                    assert parts is not None
                    built = self._body_lines(line_plan, payload, batch, parts)
                    if built is not None:
                        return built
            peeked = peek_batch_stream(payload)
            if peeked is not None and peeked not in self._plans:
                return _EMPTY  # an unselected stream is never parsed nor counted
            try:
                payload = decode_batch_body(payload)
            except FrameError:
                # Passed the server's prefix check but broken further in: count it as
                # lost rather than let it vanish.
                return BuildResult(records={}, skipped_items=1)
        if type(payload) is not dict:
            return _EMPTY
        stream = payload.get("stream")
        plan = self._plans.get(stream) if type(stream) is str else None
        if plan is None:
            return _EMPTY
        items = payload.get("items")
        if type(items) is not list:
            # The transport refuses such frames; a direct caller's broken batch still
            # counts as lost rather than vanishing.
            return BuildResult(records={}, skipped_items=1)
        batch_fields = self._batch_fields(payload.get("identity"), batch.observed_timestamp_unix_ns)
        if batch_fields is None:
            return BuildResult(records={}, skipped_items=len(items))
        wire = plan.wire
        base = _base(wire.stream, wire.from_batch, batch_fields)
        line_plan = self._line_plans.get(wire.name)
        if line_plan is not None:
            encoded = self._item_lines(plan, line_plan, items, base)
            if encoded is not None:
                lines, skipped = encoded
                return BuildResult(
                    records={wire.stream: lines} if len(lines) else {}, skipped_items=skipped
                )
        fan = plan.fan_out
        bases = (
            base,
            base if fan is None else _base(fan.spec.stream, fan.spec.from_batch, batch_fields),
        )
        out: list[Any] = []
        fan_records: list[Any] = []
        skipped = 0
        trusted = False  # True once a record loaded with the identity checked
        for item in items:
            try:
                record, entries = _record(plan, bases, item, trusted)
            except Exception:
                skipped += 1
                continue
            trusted = True
            out.append(record)
            if entries:
                fan_records.extend(entries)
        records: dict[str, Sequence[Any]] = {}
        if out and wire.stream in self._selected:
            records[wire.stream] = out
        if fan_records and fan is not None and fan.spec.stream in self._selected:
            records[fan.spec.stream] = fan_records
        return BuildResult(records=records, skipped_items=skipped)

    # -- identity --------------------------------------------------------------------

    def _batch_fields(self, raw: object, observed: object) -> dict[str, Any] | None:
        """The record fields a batch gives (x-traceml-wire/from-batch), or None if bad."""
        if type(raw) is not dict or not _is_int(observed, 0):
            return None
        rank = raw.get("global_rank")
        local_rank = raw.get("local_rank")
        world_size = raw.get("world_size")
        local_world_size = raw.get("local_world_size")
        node_rank = raw.get("node_rank")
        if not (
            _is_int(rank, 0)
            and _is_int(local_rank, 0)
            and _is_int(world_size, 1)
            and _is_int(local_world_size, 1)
            and _is_int(node_rank, 0)
        ):
            return None
        assert type(rank) is int and type(local_rank) is int  # narrowed by _is_int
        assert type(world_size) is int and type(local_world_size) is int
        if not identity_ok(rank, rank, local_rank, world_size, local_world_size):
            return None
        fields: dict[str, Any] = {
            "observed_timestamp_unix_ns": observed,
            "rank": rank,
            "global_rank": rank,
            "local_rank": local_rank,
            "world_size": world_size,
            "local_world_size": local_world_size,
            "node_rank": node_rank,
            # Unchecked here: the loaders of the streams that take it check it.
            "pid": raw.get("pid"),
        }
        if self._include_hostname:
            hostname = raw.get("hostname")
            # Hostname is decoration: a malformed one is dropped, not the whole batch.
            fields["hostname"] = (
                hostname if type(hostname) is str and not _str_too_big(hostname) else None
            )
        return fields

    # -- the C encoder's mode ----------------------------------------------------------

    def _body_lines(
        self,
        line_plan: _LinePlan,
        body: bytes,
        batch: ReceivedBatch,
        parts: tuple[bytes, int, int, int],
    ) -> BuildResult | None:
        """The lines of an encoded batch read straight from its bytes, or None to parse it.

        Only a batch whose every item the C encoder writes comes back here; anything
        else (an item for the strict loaders, a bad identity, a body not in the form our
        senders write) goes the parsed way, which counts and reports it.
        """
        assert self._encode_batch is not None
        _, identity_start, identity_end, items_start = parts
        observed = batch.observed_timestamp_unix_ns
        if not _is_int(observed, 0):
            return None
        key = (line_plan.wire_name, body[identity_start:identity_end])
        around = self._prefixes.get(key, _UNSEEN)
        if around is _UNSEEN:
            around = self._prefix_around(line_plan, key[1])
            if len(self._prefixes) >= _MAX_PREFIXES:
                self._prefixes.clear()
            self._prefixes[key] = around
        if around is None:
            return None
        head, tail, stream, batch_values = around
        prefix = b"%s%d%s" % (head, observed, tail)
        encoded = self._encode_batch(
            body, items_start, line_plan.record_class, line_plan.first_item_field, prefix,
            MAX_STRING_BYTES, line_plan.rules, line_plan.conditions, batch_values,
        )  # fmt: skip
        if encoded is None:
            return None
        data, count = encoded
        if not count:
            return _EMPTY
        return BuildResult(records={stream: EncodedLines(stream, data, count)}, skipped_items=0)

    def _prefix_around(self, line_plan: _LinePlan, identity_bytes: bytes) -> _LineStart | None:
        """A line's start for a batch with this identity block, as the text before and
        after the observed timestamp (the one field that differs between a rank's
        batches), the file stream the lines go to, and the values of the batch fields
        among the item's; None when the identity is bad or cannot be written (the
        parsed way counts and reports it)."""
        try:
            identity = orjson.loads(identity_bytes)
        except orjson.JSONDecodeError:
            return None
        batch_fields = self._batch_fields(identity, 0)
        if batch_fields is None:
            return None
        wire = self._plans[line_plan.wire_name.decode()].wire
        base, batch_values = _line_parts(
            line_plan, _base(wire.stream, wire.from_batch, batch_fields)
        )
        names = list(base)
        at = names.index("observed_timestamp_unix_ns")
        head = _line_prefix({name: base[name] for name in names[:at]})
        after = _line_prefix({name: base[name] for name in names[at + 1 :]})
        if head is None or after is None:
            return None
        tail = b"," + after[1:] if len(after) > 1 else b""
        return head + b',"observed_timestamp_unix_ns":', tail, wire.stream, batch_values

    def _item_lines(
        self, plan: _StreamPlan, line_plan: _LinePlan, items: list[Any], base: dict[str, Any]
    ) -> tuple[EncodedLines, int] | None:
        """(the lines of a batch's items, skipped items), or None to build records.

        The C encoder writes the line of every plainly valid item; each item it leaves
        goes through the same strict loader and rules as in record mode, on its own,
        and is skipped or written from its record at its place (a record that has no
        line makes the whole batch records, for the exporter to count as in record
        mode).
        """
        assert self._encode_items is not None
        line_start, batch_values = _line_parts(line_plan, base)
        prefix = _line_prefix(line_start)
        if prefix is None:
            return None
        data, count, pending = self._encode_items(
            items, line_plan.record_class, line_plan.first_item_field, prefix,
            MAX_STRING_BYTES, line_plan.rules, line_plan.conditions, batch_values,
        )  # fmt: skip
        stream = plan.wire.stream
        if not pending:
            return EncodedLines(stream, data, count), 0
        parts: list[bytes] = []
        start = 0
        skipped = 0
        bases = (base, base)
        for index, at in pending:
            parts.append(data[start:at])
            start = at
            try:
                record, _ = _record(plan, bases, items[index], trusted=False)
            except Exception:
                skipped += 1
                continue
            try:
                parts.append(dumps_line(record, include_hostname=self._include_hostname))
            except (ValueError, TypeError):
                # A record with no line (a lone surrogate in a string): record mode
                # hands it on, and the exporter counts it as not serialized.
                return None
            count += 1
        parts.append(data[start:])
        return EncodedLines(stream, b"".join(parts), count), skipped


def _line_parts(
    line_plan: _LinePlan, base: dict[str, Any]
) -> tuple[dict[str, Any], tuple[tuple[int, Any], ...]]:
    """A line's start (``base`` but the batch fields placed among the item's), and the
    (field index, value) of each of those for the C encoder to check and write."""
    if not line_plan.batch_fields:
        return base, ()
    start = base.copy()
    return start, tuple((index, start.pop(name)) for index, name in line_plan.batch_fields)


def _line_prefix(base: dict[str, Any]) -> bytes | None:
    """The identity block as a line writes it: everything up to the item's fields; None
    when orjson cannot write it (e.g. a surrogate in a hostname: record mode reports it)."""
    try:
        return orjson.dumps(base)[:-1]
    except orjson.JSONEncodeError:
        return None


def _base(stream: str, from_batch: tuple[str, ...], batch_fields: dict[str, Any]) -> dict[str, Any]:
    """The start of a line of ``stream``: its constants, then the fields from the batch."""
    base: dict[str, Any] = {"stream": stream, "schema_version": SCHEMA_VERSION}
    for name in from_batch:
        if name in batch_fields:
            base[name] = batch_fields[name]
    return base
