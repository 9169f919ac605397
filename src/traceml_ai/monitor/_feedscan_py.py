"""The live feed's reader of step_time batches, in Python: the twin of ``_feedscan.c``.

:func:`scan_step_time` reads an encoded ``step_time`` batch body into what
:meth:`~traceml_ai.monitor._state.LiveState.add_scan` takes: per step its number, end,
time, phases (labelled by the caller's label map and summed by label:
``analysis.step_row``'s rule) and tokens, the same values packed for the state's
histogram buffers, and the identity fields the state reads. None when the body is
not a plain step_time batch whose every event name the label map already has: the
caller then reads it the reference way (``decode_batch_body`` and
:meth:`~traceml_ai.monitor._state.LiveState.add_steps`), which names new events and
folds them in order. The C extension answers what this module answers, or None where
it declines more (escapes, bytes outside ASCII, duplicated keys, integers it does not
hold exactly).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeGuard

import orjson

from traceml_ai.analysis import STEP_EVENT, longest_timing
from traceml_ai.transport.wire import peek_batch_stream

__all__ = ["MAX_LABELS", "ItemsScan", "LabelMap", "StepScan", "scan_items", "scan_step_time"]

MAX_LABELS = 64
"""Label ids the scan takes (one bit each of ``StepScan.mask``)."""

LabelMap = Mapping[str, "tuple[str, int] | None"]
"""event name -> (its label, the label's id below :data:`MAX_LABELS`), or None: an
event that is no phase."""


class StepScan(NamedTuple):
    """A step_time batch as the live state takes it (the C scan gives a plain tuple of
    the same fields)."""

    global_rank: int | None
    """The identity's ``global_rank`` when an int, else None (so ``node_rank``,
    ``world_size``)."""
    node_rank: int | None
    world_size: int | None
    ignored: int
    """Items that give no step (``LiveState.add_steps`` counts them as ignored)."""
    steps: list[int]
    ends: list[int]
    """Each step's ``timestamp_unix_ns``."""
    step_ms: list[float]
    phases: list[dict[str, float]]
    """Each step's phases: label -> ms (``StepRow.phases``)."""
    tokens: list[tuple[int, float]]
    """(step, tokens) of the steps that said a count."""
    top: int
    """The index of the last step with the highest step number (-1: no step)."""
    step_packed: bytes
    """``step_ms`` as native doubles."""
    phase_packed: bytes
    """Each step's phase times in order, as native doubles..."""
    ids_packed: bytes
    """...and their label ids, as native 32-bit ints."""
    mask: int
    """One bit per label id present."""


def _count(value: object) -> TypeGuard[int]:
    return type(value) is int and value >= 0


class _Decline(Exception):
    pass


def _row(
    events: dict[str, object], labels: LabelMap
) -> tuple[float, dict[str, float], list[int]] | None:
    """The step's time, its phases and their label ids; None: no row. Raises
    ``_Decline`` for an event name ``labels`` lacks."""
    step_ms: float | None = None
    row: dict[str, float] = {}
    ids: dict[str, int] = {}
    ok = True
    for event, devices in events.items():
        best = longest_timing(devices)
        if best is None:
            ok = False
        if event == STEP_EVENT:
            step_ms = None if best is None else float(best)
            continue
        if event not in labels:
            raise _Decline
        entry = labels[event]
        if entry is None or best is None:
            continue
        label, label_id = entry
        row[label] = row.get(label, 0.0) + best
        ids[label] = label_id
    if not ok or step_ms is None:
        return None
    return step_ms, row, [ids[label] for label in row]


def scan_step_time(body: bytes, labels: LabelMap) -> StepScan | None:
    """The steps of the encoded step_time batch ``body``, or None (read it the
    reference way)."""
    stream = peek_batch_stream(body)
    if stream is not None and stream != "step_time":
        return None  # the usual other batch, told from its prefix without a parse
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if type(message) is not dict or message.get("stream") != "step_time":
        return None
    identity, items = message.get("identity"), message.get("items")
    if type(identity) is not dict or type(items) is not list:
        return None
    fields = [identity.get(k) for k in ("global_rank", "node_rank", "world_size")]
    rank, node, world = (v if type(v) is int else None for v in fields)
    steps: list[int] = []
    ends: list[int] = []
    step_ms: list[float] = []
    phases: list[dict[str, float]] = []
    tokens: list[tuple[int, float]] = []
    phase_ms: list[float] = []
    ids: list[int] = []
    ignored = 0
    top = -1
    mask = 0
    try:
        for item in items:
            row = None
            if type(item) is dict:
                events = item.get("events")
                if type(events) is dict:
                    row = _row(events, labels)
            step = item.get("step") if type(item) is dict else None
            end_ns = item.get("timestamp_unix_ns") if type(item) is dict else None
            if row is None or not _count(step) or step < 1 or not _count(end_ns):
                ignored += 1
                continue
            ms, phase_row, row_ids = row
            if top < 0 or step >= steps[top]:
                top = len(steps)
            steps.append(step)
            ends.append(end_ns)
            step_ms.append(ms)
            phases.append(phase_row)
            phase_ms.extend(phase_row.values())
            ids.extend(row_ids)
            for label_id in row_ids:
                mask |= 1 << label_id
            said = item.get("tokens")
            if _count(said):
                tokens.append((step, float(said)))
    except _Decline:
        return None
    return StepScan(
        rank, node, world, ignored, steps, ends, step_ms, phases, tokens, top,
        array("d", step_ms).tobytes(), array("d", phase_ms).tobytes(), array("i", ids).tobytes(),
        mask,
    )  # fmt: skip


ItemsScan = tuple[int | None, int | None, int | None, list[tuple[Any, ...]]]
"""(global_rank, node_rank, world_size, each item's values of the keys asked for)."""


def scan_items(body: bytes, stream: str, keys: tuple[str, ...]) -> ItemsScan | None:
    """The items of the encoded ``stream`` batch ``body``, each as the tuple of its
    values of ``keys`` (``item.get(key)`` for each), and the identity's three fields;
    None when an item is not an object or a value asked for is an object or an array
    (the caller then reads the batch the reference way)."""
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if type(message) is not dict or message.get("stream") != stream:
        return None
    identity, items = message.get("identity"), message.get("items")
    if type(identity) is not dict or type(items) is not list:
        return None
    rows: list[tuple[Any, ...]] = []
    for item in items:
        if type(item) is not dict:
            return None
        row = tuple(item.get(key) for key in keys)
        if any(type(v) is dict or type(v) is list for v in row):
            return None
        rows.append(row)
    fields = [identity.get(k) for k in ("global_rank", "node_rank", "world_size")]
    rank, node, world = (v if type(v) is int else None for v in fields)
    return rank, node, world, rows
