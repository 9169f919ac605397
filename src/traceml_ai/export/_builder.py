"""Turns wire batches into typed records of the selected streams.

This is the aggregator's hot path. Each item becomes the JSON-like dict its line would
have (identity from the batch, fields from the item) and goes through the generated
strict loader of its record class, which enforces types, ranges and patterns without
coercion. The cross-field rules of the Export Records page that a JSON Schema cannot
express are checked afterwards. An item that fails anything is skipped and counted;
``build`` never raises.

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
from traceml_ai.wire import FrameError, ReceivedBatch, decode_batch_body, peek_batch_stream
from traceml_records import (
    STREAMS,
    STREAMS_BY_NAME,
    PhaseTiming,
    ProcessRecord,
    RuntimeEnvironmentRecord,
    StdoutStderrRecord,
    StepMemoryRecord,
    StepTimeRecord,
    SystemGpuRecord,
    SystemRecord,
)
from traceml_records._codec import (
    BUILTIN_EVENTS,
    RESERVED_EVENT_PREFIX,
    STEP_TIME_EVENT,
    dumps_line,
    encode_items,
)
from traceml_records._generated.records import (
    ENCODER_PLANS,
    IDENTITY_FIELDS,
    ITEM_LOADERS,
    LOADERS,
)
from traceml_records._rules import (
    IDENTITY_RULES,
    LineCheck,
    duration_ok,
    identity_ok,
    line_checks,
    line_findings,
)

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

INTERNAL_PREFIX = RESERVED_EVENT_PREFIX
BUILTIN_EVENT_NAMES = BUILTIN_EVENTS
"""The reserved event names this release writes; other ``_traceml_internal:`` names are invalid."""

_INT64_MAX = 2**63 - 1
# A str of at most this many code points is at most MAX_STRING_BYTES in UTF-8 (4 bytes
# per code point), so only longer ones pay for an encode.
_SAFE_CHARS = MAX_STRING_BYTES // 4

# Which file streams each wire (batch) stream feeds; ``system`` items feed two files.
_FILE_STREAMS_OF_BATCH: dict[str, tuple[str, ...]] = {
    "step_time": ("step_time",),
    "step_memory": ("step_memory",),
    "process": ("process",),
    "system": ("system", "system_gpu"),
    "runtime_environment": ("runtime_environment",),
    "stdout_stderr": ("stdout_stderr",),
}


def _item_keys(record_class: type[Any]) -> frozenset[str]:
    """The keys of a wire item: its record's fields less the identity block (schema-derived)."""
    return frozenset(f.name for f in attrs.fields(record_class)) - IDENTITY_FIELDS


# The wire items carry the record fields a rank knows (docs/dev/wire-format.md); the
# aggregator adds the identity block. A system item carries its GPUs (one system_gpu
# record each) instead of their count, and a GPU entry shares its snapshot's
# timestamp and seq.
_STEP_TIME_KEYS = _item_keys(StepTimeRecord)
_STEP_MEMORY_KEYS = _item_keys(StepMemoryRecord)
_PROCESS_KEYS = _item_keys(ProcessRecord)
_SYSTEM_KEYS = (_item_keys(SystemRecord) - {"gpu_count"}) | {"gpus"}
_GPU_KEYS = _item_keys(SystemGpuRecord) - {"timestamp_unix_ns", "seq"}
_RUNTIME_KEYS = _item_keys(RuntimeEnvironmentRecord)
_STDOUT_KEYS = _item_keys(StdoutStderrRecord)
_GPU_NULLABLE_FLOATS = ("utilization_percent", "temperature_c", "power_usage_w", "power_limit_w")
_RUNTIME_STRINGS = ("distributed_backend", "torch_version", "python_version")

_load_step_time = LOADERS[StepTimeRecord]
_load_step_time_item = ITEM_LOADERS[StepTimeRecord]
_load_step_memory = LOADERS[StepMemoryRecord]
_load_step_memory_item = ITEM_LOADERS[StepMemoryRecord]
_load_process = LOADERS[ProcessRecord]
_load_process_item = ITEM_LOADERS[ProcessRecord]
_load_system = LOADERS[SystemRecord]
_load_system_gpu = LOADERS[SystemGpuRecord]
_load_runtime = LOADERS[RuntimeEnvironmentRecord]
_load_stdout = LOADERS[StdoutStderrRecord]

_NO_PATH: tuple[str | int, ...] = ()

# The rules of traceml_records._rules each stream's schema lists, less the identity
# rules (checked once per batch with identity_ok) and step_time's duration rule
# (checked on the loaded timings, the hot path, with duration_ok).
_ITEM_RULES: dict[str, tuple[LineCheck, ...]] = {
    spec.name: line_checks(
        tuple(r for r in spec.rules if r not in IDENTITY_RULES and r != "duration-matches-timing")
    )
    for spec in STREAMS
}
_RUNTIME_RULES = _ITEM_RULES["runtime_environment"]
_STDOUT_RULES = _ITEM_RULES["stdout_stderr"]
assert not _ITEM_RULES["step_time"] and not _ITEM_RULES["step_memory"]
assert not _ITEM_RULES["process"] and not _ITEM_RULES["system"]

# The C item encoder writes a step_time line as the batch's identity prefix followed
# by the item's fields, which are the record's fields from timestamp_unix_ns on.
_STEP_TIME_FIELDS = tuple(field[0] for field in ENCODER_PLANS[StepTimeRecord])
_STEP_TIME_FIRST_ITEM_FIELD = _STEP_TIME_FIELDS.index("timestamp_unix_ns")
assert set(_STEP_TIME_FIELDS[_STEP_TIME_FIRST_ITEM_FIELD:]) == _STEP_TIME_KEYS
# The C encoder's rule data: the schema's event name rules (generated MAP_KEY_RULES,
# via traceml_records._codec), the size limit, and the class whose timings get the
# duration rule.
_STEP_TIME_RULES = (
    BUILTIN_EVENTS,
    RESERVED_EVENT_PREFIX,
    STEP_TIME_EVENT,
    MAX_EVENT_ENTRIES,
    PhaseTiming,
)

_Handler = Callable[[list[Any], "_Identity", list[Any]], int]


class _Skip(Exception):
    """An item (or a whole batch) that cannot become valid records."""


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
        batch for batch, files in _FILE_STREAMS_OF_BATCH.items() if wanted.intersection(files)
    )


def _is_int(value: object, low: int) -> bool:
    # ``type(...) is int`` rejects bool (an int subclass) and int-valued floats alike.
    return type(value) is int and low <= value <= _INT64_MAX


def _str_too_big(value: str) -> bool:
    return len(value) > _SAFE_CHARS and len(value.encode("utf-8", "surrogatepass")) > (
        MAX_STRING_BYTES
    )


def _finite_or_none(value: object) -> object:
    """NaN/±Inf in a nullable float field becomes None (the line would say null)."""
    if type(value) is float and not math.isfinite(value):
        return None
    return value


def _nan_to_none_in_events(events: object) -> object:
    """A copy of a step_time ``events`` map with non-finite ``gpu_ms`` set to None.

    Only called after the strict loader refused the item, so clean items never pay
    for the walk. Malformed shapes are returned as they are for the loader to refuse.
    """
    if type(events) is not dict:
        return events
    fixed: dict[Any, Any] = {}
    for name, devices in events.items():
        if type(devices) is not dict:
            fixed[name] = devices
            continue
        fixed_devices: dict[Any, Any] = {}
        for device, timing in devices.items():
            if type(timing) is dict and "gpu_ms" in timing:
                gpu_ms = timing["gpu_ms"]
                if type(gpu_ms) is float and not math.isfinite(gpu_ms):
                    timing = {**timing, "gpu_ms": None}
            fixed_devices[device] = timing
        fixed[name] = fixed_devices
    return fixed


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


def _step_time_record(base: dict[str, Any], item: Any, identity_checked: bool) -> StepTimeRecord:
    """The record of one step_time item, or an exception (the item is skipped).

    ``identity_checked``: a record of the same batch already loaded, so the item
    loader (which takes ``base`` as checked) suffices.
    """
    if type(item) is not dict or item.keys() != _STEP_TIME_KEYS:
        raise _Skip
    events = item["events"]
    if type(events) is not dict or len(events) > MAX_EVENT_ENTRIES:
        raise _Skip
    try:
        record = _load_step_time_with(base, item, identity_checked)
    except ValueError:
        # Retry once with non-finite gpu_ms as null; clean items never get here.
        fixed = {**item, "events": _nan_to_none_in_events(events)}
        record = _load_step_time_with(base, fixed, identity_checked)
    _check_events(record.events)
    return record


def _load_step_time_with(
    base: dict[str, Any], item: dict[str, Any], identity_checked: bool
) -> StepTimeRecord:
    if identity_checked:
        return _load_step_time_item(base, item, _NO_PATH)  # type: ignore[no-any-return]
    d = base.copy()
    d.update(item)
    return _load_step_time(d, _NO_PATH)  # type: ignore[no-any-return]


@attrs.frozen(slots=True)
class _Identity:
    """The validated identity of one batch."""

    base: dict[str, Any]
    """Identity block of a line (stream and schema_version not included)."""
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    pid: object
    """Unchecked: only process and runtime_environment need it; they check it."""


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
        self._want_system = "system" in selected
        self._want_system_gpu = "system_gpu" in selected
        handlers: dict[str, _Handler] = {
            "step_time": self._step_time,
            "step_memory": self._step_memory,
            "process": self._process,
            "system": self._system,
            "runtime_environment": self._runtime_environment,
            "stdout_stderr": self._stdout_stderr,
        }
        wanted = batch_streams_for(self._streams)
        self._handlers = {name: fn for name, fn in handlers.items() if name in wanted}
        self._encode_items = encode_items if encode_lines else None

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
            return stream is None or stream in self._handlers
        return type(payload) is dict and payload.get("stream") in self._handlers

    def build(self, batch: ReceivedBatch) -> BuildResult:
        """Records of the selected streams in ``batch``; never raises.

        Every item of a selected stream becomes its record(s) or counts once in
        ``skipped_items``. A bad identity or timestamp skips every item of the batch.
        """
        payload: Any = batch.payload
        if type(payload) is bytes:
            peeked = peek_batch_stream(payload)
            if peeked is not None and peeked not in self._handlers:
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
        handler = self._handlers.get(stream) if type(stream) is str else None
        if handler is None:
            return _EMPTY
        items = payload.get("items")
        if type(items) is not list:
            # The transport refuses such frames; a direct caller's broken batch still
            # counts as lost rather than vanishing.
            return BuildResult(records={}, skipped_items=1)
        identity = self._identity(payload.get("identity"), batch.observed_timestamp_unix_ns)
        if identity is None:
            return BuildResult(records={}, skipped_items=len(items))
        outs: list[Any] = [[], []]
        try:
            skipped = handler(items, identity, outs)
            out, gpu_out = outs
        except _Skip:
            # A batch-level rule (e.g. pid, or system from a local rank other than 0).
            return BuildResult(records={}, skipped_items=len(items))
        records: dict[str, Sequence[Any]] = {}
        if stream == "system":
            if out and self._want_system:
                records["system"] = out
            if gpu_out and self._want_system_gpu:
                records["system_gpu"] = gpu_out
        elif out:
            records[str(stream)] = out
        return BuildResult(records=records, skipped_items=skipped)

    # -- identity --------------------------------------------------------------------

    def _identity(self, raw: object, observed: object) -> _Identity | None:
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
        base: dict[str, Any] = {
            "observed_timestamp_unix_ns": observed,
            "rank": rank,
            "global_rank": rank,
            "local_rank": local_rank,
            "world_size": world_size,
            "local_world_size": local_world_size,
            "node_rank": node_rank,
        }
        if self._include_hostname:
            hostname = raw.get("hostname")
            # Hostname is decoration: a malformed one is dropped, not the whole batch.
            base["hostname"] = (
                hostname if type(hostname) is str and not _str_too_big(hostname) else None
            )
        return _Identity(
            base=base,
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            pid=raw.get("pid"),
        )

    # -- per wire stream -------------------------------------------------------------
    # Each handler appends records to ``outs[0]`` (and system_gpu records to
    # ``outs[1]``), returns the number of skipped items, and raises _Skip for a
    # batch-level problem.

    def _step_time(self, items: list[Any], identity: _Identity, outs: list[Any]) -> int:
        base = {"stream": "step_time", "schema_version": 1, **identity.base}
        if self._encode_items is not None:
            encoded = self._step_time_lines(items, base)
            if encoded is not None:
                lines, skipped = encoded
                if len(lines):
                    outs[0] = lines
                return skipped
        out = outs[0]
        skipped = 0
        identity_checked = False  # True once a record loaded with the identity checked
        for item in items:
            try:
                record = _step_time_record(base, item, identity_checked)
            except Exception:
                skipped += 1
                continue
            identity_checked = True
            out.append(record)
        return skipped

    def _step_time_lines(
        self, items: list[Any], base: dict[str, Any]
    ) -> tuple[EncodedLines, int] | None:
        """(the lines of a step_time batch, skipped items), or None to build records.

        The C encoder writes the line of every plainly valid item; each item it leaves
        goes through the same strict loader and rules as in record mode, on its own,
        and is skipped or written from its record at its place.
        """
        assert self._encode_items is not None
        try:
            # The identity block, as the line writes it: everything up to the item's fields.
            prefix = orjson.dumps(base)[:-1]
        except orjson.JSONEncodeError:
            return None  # e.g. a surrogate in a hostname: record mode reports it
        data, count, pending = self._encode_items(
            items, StepTimeRecord, _STEP_TIME_FIRST_ITEM_FIELD, prefix, MAX_STRING_BYTES,
            _STEP_TIME_RULES,
        )  # fmt: skip
        if not pending:
            return EncodedLines("step_time", data, count), 0
        parts: list[bytes] = []
        start = 0
        skipped = 0
        for index, at in pending:
            parts.append(data[start:at])
            start = at
            try:
                record = _step_time_record(base, items[index], identity_checked=False)
                parts.append(dumps_line(record, include_hostname=self._include_hostname))
                count += 1
            except Exception:
                skipped += 1
        parts.append(data[start:])
        return EncodedLines("step_time", b"".join(parts), count), skipped

    def _step_memory(self, items: list[Any], identity: _Identity, outs: list[Any]) -> int:
        out = outs[0]
        base = {"stream": "step_memory", "schema_version": 1, **identity.base}
        skipped = 0
        load_item = None  # set once a record loaded with the identity checked
        for item in items:
            try:
                if type(item) is not dict or item.keys() != _STEP_MEMORY_KEYS:
                    raise _Skip
                device = item["device"]
                if type(device) is str and len(device) > MAX_STRING_BYTES:
                    raise _Skip
                if load_item is not None:
                    record = load_item(base, item, _NO_PATH)
                else:
                    d = base.copy()
                    d.update(item)
                    record = _load_step_memory(d, _NO_PATH)
                    load_item = _load_step_memory_item
            except Exception:
                skipped += 1
                continue
            out.append(record)
        return skipped

    def _process(self, items: list[Any], identity: _Identity, outs: list[Any]) -> int:
        if not _is_int(identity.pid, 1):
            raise _Skip
        out = outs[0]
        base = {"stream": "process", "schema_version": 1, **identity.base, "pid": identity.pid}
        skipped = 0
        load_item = None  # set once a record loaded with the identity checked
        for item in items:
            try:
                if type(item) is not dict or item.keys() != _PROCESS_KEYS:
                    raise _Skip
                if load_item is not None:
                    record = load_item(base, item, _NO_PATH)
                else:
                    d = base.copy()
                    d.update(item)
                    record = _load_process(d, _NO_PATH)
                    load_item = _load_process_item
            except Exception:
                skipped += 1
                continue
            out.append(record)
        return skipped

    def _system(self, items: list[Any], identity: _Identity, outs: list[Any]) -> int:
        # local_rank 0 and gpu_available false ⇒ no GPUs are schema rules: the loaders
        # of system and system_gpu refuse such items.
        out, gpu_out = outs
        base = {"stream": "system", "schema_version": 1, **identity.base}
        gpu_base = {"stream": "system_gpu", "schema_version": 1, **identity.base}
        skipped = 0
        for item in items:
            try:
                if type(item) is not dict or item.keys() != _SYSTEM_KEYS:
                    raise _Skip
                gpus = item["gpus"]
                if type(gpus) is not list or len(gpus) > MAX_GPUS_PER_SNAPSHOT:
                    raise _Skip
                d = base.copy()
                d.update(item)
                del d["gpus"]
                d["gpu_count"] = len(gpus)
                record = _load_system(d, _NO_PATH)
                # The whole snapshot or nothing: system_gpu lines must match gpu_count.
                gpu_records: list[Any] = []
                seen: set[int] = set()
                for gpu in gpus:
                    if type(gpu) is not dict or gpu.keys() != _GPU_KEYS:
                        raise _Skip
                    g = gpu_base.copy()
                    g["timestamp_unix_ns"] = record.timestamp_unix_ns
                    g["seq"] = record.seq
                    g.update(gpu)
                    for name in _GPU_NULLABLE_FLOATS:
                        g[name] = _finite_or_none(g[name])
                    gpu_record = _load_system_gpu(g, _NO_PATH)
                    if gpu_record.gpu_index in seen:
                        raise _Skip  # (node_rank, seq, gpu_index) must be unique
                    seen.add(gpu_record.gpu_index)
                    gpu_records.append(gpu_record)
            except Exception:
                skipped += 1
                continue
            out.append(record)
            gpu_out.extend(gpu_records)
        return skipped

    def _runtime_environment(self, items: list[Any], identity: _Identity, outs: list[Any]) -> int:
        if not _is_int(identity.pid, 1):
            raise _Skip
        out = outs[0]
        base = {
            "stream": "runtime_environment",
            "schema_version": 1,
            **identity.base,
            "pid": identity.pid,
        }
        skipped = 0
        for item in items:
            try:
                if type(item) is not dict or item.keys() != _RUNTIME_KEYS:
                    raise _Skip
                for name in _RUNTIME_STRINGS:
                    value = item[name]
                    if type(value) is str and _str_too_big(value):
                        raise _Skip
                d = base.copy()
                d.update(item)
                record = _load_runtime(d, _NO_PATH)
                if line_findings(_RUNTIME_RULES, d):
                    raise _Skip
            except Exception:
                skipped += 1
                continue
            out.append(record)
        return skipped

    def _stdout_stderr(self, items: list[Any], identity: _Identity, outs: list[Any]) -> int:
        out = outs[0]
        # No identity block beyond ``rank`` on this stream, and never a hostname.
        base = {
            "stream": "stdout_stderr",
            "schema_version": 1,
            "observed_timestamp_unix_ns": identity.base["observed_timestamp_unix_ns"],
            "rank": identity.rank,
        }
        skipped = 0
        for item in items:
            try:
                if type(item) is not dict or item.keys() != _STDOUT_KEYS:
                    raise _Skip
                line = item["line"]
                if type(line) is str and _str_too_big(line):
                    raise _Skip
                d = base.copy()
                d.update(item)
                record = _load_stdout(d, _NO_PATH)
                if line_findings(_STDOUT_RULES, d):
                    raise _Skip
            except Exception:
                skipped += 1
                continue
            out.append(record)
        return skipped
