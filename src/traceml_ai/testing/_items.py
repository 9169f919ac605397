"""Wire items, batches and typed records built the same way everywhere.

One factory for TraceML's tests, its benchmarks and users' tests: every item is what
the rank SDK would send (docs/dev/wire-format.md), deterministic for a given ``seq``,
and valid, so the real record builder turns it into records. Records come from that
builder too, never from a second hand-written mapping.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson

from traceml_ai.export import RecordBuilder
from traceml_ai.rank.runtime_env import topology_of
from traceml_ai.transport.wire import BATCH_STREAMS, ReceivedBatch, make_batch_message
from traceml_records import STREAMS_BY_NAME
from traceml_records import events as _events

__all__ = [
    "BASE_TIMESTAMP_NS",
    "BUILTIN_PHASES",
    "OBSERVED_TIMESTAMP_NS",
    "make_batch",
    "make_batch_body",
    "make_events",
    "make_gpu_entry",
    "make_identity",
    "make_item",
    "make_phase",
    "make_record",
    "make_records",
]

BASE_TIMESTAMP_NS = 1_793_808_199_881_904_896
"""``timestamp_unix_ns`` of the item with ``seq`` 0; item ``seq`` n has this plus n."""

OBSERVED_TIMESTAMP_NS = 1_793_808_200_784_977_000
"""What the aggregator stamps on batches built here (``observed_timestamp_unix_ns``)."""

_PREFIX = _events.RESERVED_PREFIX
_DEFAULT_MS = {
    _events.DATALOADER_NEXT.removeprefix(_PREFIX): 3.7,
    _events.FORWARD_TIME.removeprefix(_PREFIX): 8.2,
    _events.BACKWARD_TIME.removeprefix(_PREFIX): 15.3,
    _events.OPTIMIZER_STEP.removeprefix(_PREFIX): 0.5,
    _events.STEP_TIME.removeprefix(_PREFIX): 27.0,
}
BUILTIN_PHASES = tuple(_DEFAULT_MS)
"""The phases the rank SDK times in every step (event names without their prefix)."""

# CPU-side phases: the SDK never records CUDA events around them.
_CPU_ONLY = frozenset(
    name.removeprefix(_PREFIX) for name in (_events.DATALOADER_NEXT, _events.STEP_TIME)
)


def make_identity(
    global_rank: int = 0,
    *,
    local_rank: int | None = None,
    world_size: int = 1,
    local_world_size: int | None = None,
    node_rank: int | None = None,
    hostname: str | None = "host-a",
    pid: int = 4242,
) -> dict[str, Any]:
    """The identity block of a wire batch (``RankIdentity.to_wire()``'s keys).

    By default one process; give ``world_size`` (and ``local_world_size``, which
    defaults to the whole world on one node) for a rank of a larger run. Local rank
    and node rank follow from the global rank when not given.
    """
    local_world = world_size if local_world_size is None else local_world_size
    return {
        "global_rank": global_rank,
        "local_rank": global_rank % local_world if local_rank is None else local_rank,
        "world_size": world_size,
        "local_world_size": local_world,
        "node_rank": global_rank // local_world if node_rank is None else node_rank,
        "hostname": hostname,
        "pid": pid,
    }


def make_phase(
    cpu_ms: float = 1.5, gpu_ms: float | None = None, n_calls: int = 1
) -> dict[str, Any]:
    """One phase timing as a rank sends it: GPU time when ``gpu_ms`` is given."""
    return {
        "cpu_ms": cpu_ms,
        "duration_ms": cpu_ms if gpu_ms is None else gpu_ms,
        "gpu_ms": gpu_ms,
        "is_gpu": gpu_ms is not None,
        "n_calls": n_calls,
    }


def make_events(
    durations: Mapping[str, float] | Iterable[str] | None = None,
    *,
    device: str = "cpu",
) -> dict[str, Any]:
    """A step's ``events`` map on one device, names sorted as the SDK sends them.

    ``durations`` maps phase names to milliseconds (a built-in phase may be named
    without its ``_traceml_internal:`` prefix; other names are user phases); an
    iterable of names takes default durations; None gives the five built-in phases.
    On a ``cuda`` device every phase but ``dataloader_next`` and ``step_time`` gets
    ``gpu_ms`` equal to its duration, as measured by CUDA events.
    """
    if durations is None:
        durations = _DEFAULT_MS
    elif not isinstance(durations, Mapping):
        durations = {name: _DEFAULT_MS.get(name, 1.5) for name in durations}
    on_gpu = device.startswith("cuda")
    events: dict[str, Any] = {}
    for name, ms in durations.items():
        short = name.removeprefix(_PREFIX)
        builtin = _PREFIX + short in _events.BUILT_IN_EVENTS
        full = _PREFIX + short if builtin else name
        gpu = ms if on_gpu and not (builtin and short in _CPU_ONLY) else None
        events[full] = {device: make_phase(ms * 0.2 if gpu is not None else ms, gpu)}
    return dict(sorted(events.items()))


def _step_time(seq: int, device: str, fields: dict[str, Any]) -> dict[str, Any]:
    # Given events are not built twice: the benchmarks make hundreds of thousands.
    events = fields.pop("events") if "events" in fields else make_events(device=device)
    return {"step": seq + 1, "events": events}


def _step_memory(seq: int, device: str) -> dict[str, Any]:
    cpu = device == "cpu"
    return {
        "step": seq + 1,
        "device": device,
        "peak_allocated_bytes": None if cpu else 1_000_000 + seq,
        "peak_reserved_bytes": None if cpu else 2_000_000 + seq,
    }


def _process(seq: int, device: str) -> dict[str, Any]:
    gpu = device.startswith("cuda")
    index = int(device.partition(":")[2] or 0) if gpu else None
    return {
        "cpu_percent": 153.5,
        "cpu_logical_cores": 16,
        "ram_used_bytes": 123_456_789,
        "ram_total_bytes": 64 * 2**30,
        "gpu_available": gpu,
        "gpu_count": max(2, (index or 0) + 1) if gpu else None,
        "gpu_device_index": index,
        "gpu_memory_used_bytes": 10**9 if gpu else None,
        "gpu_memory_reserved_bytes": 2 * 10**9 if gpu else None,
        "gpu_memory_total_bytes": 80 * 10**9 if gpu else None,
        "gpu_uuid": f"GPU-{index:08x}-1111-2222-3333-444444444444" if gpu else None,
    }


def make_gpu_entry(index: int = 0, **fields: Any) -> dict[str, Any]:
    """One entry of a system item's ``gpus`` list; ``fields`` replace its keys."""
    entry = {
        "gpu_index": index,
        "utilization_percent": 87.0,
        "memory_used_bytes": 10**9,
        "memory_total_bytes": 80 * 10**9,
        "temperature_c": 61.0,
        "power_usage_w": 250.5,
        "power_limit_w": 700.0,
        "gpu_uuid": f"GPU-{index:08x}-1111-2222-3333-444444444444",
    }
    entry.update(fields)
    return entry


def _system(gpus: int, fields: dict[str, Any]) -> dict[str, Any]:
    entries = fields.pop("gpus") if "gpus" in fields else [make_gpu_entry(i) for i in range(gpus)]
    return {
        "cpu_percent": 42.5,
        "ram_used_bytes": 10 * 2**30,
        "ram_total_bytes": 64 * 2**30,
        "gpu_available": len(entries) > 0,
        "gpus": entries,
    }


def _collectives(seq: int, device: str) -> dict[str, Any]:
    """DDP's gradient buckets of step ``seq + 1`` (NCCL timing on a CUDA device)."""
    return {
        "step": seq + 1,
        "phase": "_traceml_internal:backward_time",
        "op": "all_reduce",
        "source": "ddp_comm_hook",
        "backend": "nccl" if device.startswith("cuda") else "gloo",
        "n_calls": 2,
        "wait_ms": 1.5,
        "wait_measure": "device" if device.startswith("cuda") else "host",
        "first_arrival_ms": 4.25,
        "last_arrival_ms": 9.5,
        # DDP's buckets run over the default group: the whole job; two 25 MiB buckets
        "group": "world",
        "peer_rank": None,
        "peer_stage": None,
        "bytes": 2 * 25 * 1024 * 1024,
    }


def _runtime_environment(identity: Mapping[str, Any]) -> dict[str, Any]:
    world = int(identity["world_size"])
    distributed = world > 1
    return {
        "topology": topology_of(world, int(identity["local_world_size"])),
        "distributed_initialized": distributed,
        "distributed_backend": "nccl" if distributed else None,
        "training_strategy": "ddp" if distributed else "single_process",
        "strategy_source": "runtime_model",
        "strategy_confidence": "high",
        "torch_version": "2.13.0",
        "python_version": "3.11.7",
        "parallel": None,  # no layout declared or found
        "parallel_source": None,
    }


def make_item(
    stream: str,
    seq: int = 0,
    *,
    device: str = "cpu",
    n_gpus: int = 2,
    identity: Mapping[str, Any] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """One wire item of batch stream ``stream`` as the rank SDK sends it.

    Deterministic: ``seq`` sets ``seq``, ``timestamp_unix_ns`` (``BASE_TIMESTAMP_NS +
    seq``) and a step's ``step`` (``seq + 1``). ``device`` (``"cpu"``, ``"cuda:1"``)
    shapes step_time, step_memory and process items; ``n_gpus`` is the number of GPUs of
    a system item; ``identity`` (default: one process) sets a runtime_environment
    item's topology and distributed fields. ``fields`` replace keys of the item (a
    value that breaks the schemas makes an item the builder skips, on purpose).
    """
    head: dict[str, Any] = {"timestamp_unix_ns": BASE_TIMESTAMP_NS + seq, "seq": seq}
    if stream == "step_time":
        body = _step_time(seq, device, fields)
    elif stream == "step_memory":
        body = _step_memory(seq, device)
    elif stream == "process":
        body = _process(seq, device)
    elif stream == "system":
        body = _system(n_gpus, fields)
    elif stream == "runtime_environment":
        body = _runtime_environment(make_identity() if identity is None else identity)
    elif stream == "stdout_stderr":
        body = {"source": "stdout", "line": f"step {seq + 1}: loss 0.25"}
    elif stream == "collectives":
        body = _collectives(seq, device)
    else:
        raise ValueError(f"unknown batch stream {stream!r}; expected one of {BATCH_STREAMS}")
    head.update(body)
    head.update(fields)
    return head


def make_batch_body(
    stream: str,
    items: Sequence[Mapping[str, Any]],
    identity: Mapping[str, Any] | None = None,
    *,
    token: str = "t",
) -> bytes:
    """A ``batch`` frame body (without its length header) as a rank's sender writes it."""
    ident = make_identity() if identity is None else identity
    return orjson.dumps(make_batch_message(token, ident, stream, list(items)))


def make_batch(
    stream: str,
    items: Sequence[Any],
    identity: Any = None,
    *,
    observed: Any = OBSERVED_TIMESTAMP_NS,
    encoded: bool = False,
    nbytes: int | None = None,
) -> ReceivedBatch:
    """A batch as the aggregator's server hands it to the export worker.

    ``encoded`` keeps the payload as the frame body's bytes (what the server queues);
    otherwise it is the decoded message. ``identity`` and ``observed`` are passed as
    given (a test may break them on purpose); ``nbytes`` defaults to the encoded size.
    """
    ident = make_identity() if identity is None else identity
    message = make_batch_message("t", ident, stream, items)
    try:
        body: bytes | None = orjson.dumps(message)
    except TypeError:
        body = None  # an item orjson cannot encode, built so on purpose
    if nbytes is None:
        nbytes = len(body) if body is not None else 1024
    if encoded:
        if body is None:
            raise ValueError("the items cannot be encoded as JSON")
        return ReceivedBatch(observed_timestamp_unix_ns=observed, payload=body, nbytes=nbytes)
    return ReceivedBatch(observed_timestamp_unix_ns=observed, payload=message, nbytes=nbytes)


def make_records(
    stream: str,
    items: Sequence[Mapping[str, Any]] | None = None,
    identity: Mapping[str, Any] | None = None,
    *,
    include_hostname: bool = False,
    observed: int = OBSERVED_TIMESTAMP_NS,
) -> list[Any]:
    """Typed records of file stream ``stream``, built by the aggregator's own builder.

    ``items`` are wire items of the batch stream that feeds ``stream`` (``system``
    for ``system_gpu``); by default one item with ``seq`` 0. Raises ``ValueError`` when
    the builder skips any item, so a record made here is one a real export writes.
    """
    if stream not in STREAMS_BY_NAME:
        raise ValueError(
            f"unknown file stream {stream!r}; expected one of {tuple(STREAMS_BY_NAME)}"
        )
    batch_stream = "system" if stream == "system_gpu" else stream
    ident = make_identity() if identity is None else identity
    if items is None:
        items = [make_item(batch_stream, identity=ident)]
    builder = RecordBuilder((stream,), include_hostname)
    result = builder.build(make_batch(batch_stream, list(items), ident, observed=observed))
    if result.skipped_items:
        raise ValueError(
            f"{result.skipped_items} of {len(items)} {batch_stream} items are not valid records"
        )
    return list(result.records.get(stream, ()))


def make_record(stream: str, seq: int = 0, **item_fields: Any) -> Any:
    """One typed record of file stream ``stream`` (the first, for ``system_gpu``).

    ``item_fields`` go to :func:`make_item` (``device``, ``n_gpus``, ``identity`` and
    item keys); the identity also goes on the record.
    """
    batch_stream = "system" if stream == "system_gpu" else stream
    identity = item_fields.get("identity")
    records = make_records(stream, [make_item(batch_stream, seq, **item_fields)], identity)
    if not records:
        raise ValueError(
            f"the {batch_stream} item gave no {stream} record (a system item without GPUs?)"
        )
    return records[0]
