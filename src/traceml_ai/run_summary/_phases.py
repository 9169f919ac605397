"""Step rows and the phase breakdown, shared by ``traceml summary`` and ``traceml.summary()``.

A step_time line's ``events`` become a *row*: ``{"step": ms, "<phase>": ms, ...}``,
each figure the phase's longest device (devices run side by side), built-in phases
under their short names (``forward``, ``dataloader_wait``, ...), user phases as
``user:<name>``. Light: imported on the rank side, so nothing heavy here.
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

from traceml_records import events

PREFIX = events.RESERVED_PREFIX
STEP_EVENT = events.STEP_TIME
PHASES: tuple[tuple[str, str], ...] = (
    ("dataloader_wait", events.DATALOADER_NEXT),
    ("h2d", events.H2D_TIME),
    ("forward", events.FORWARD_TIME),
    ("backward", events.BACKWARD_TIME),
    ("optimizer", events.OPTIMIZER_STEP),
)
"""Summary name and event name of each built-in phase, in step order."""
BUILT_IN_PHASES = tuple(name for name, _ in PHASES)
BETWEEN = "between_steps"
"""The component of an iteration outside the step (after the previous one ended)."""
REST = "rest_of_step"
"""The component of a step outside its timed phases."""
BETWEEN_EVENT = events.BETWEEN_STEPS
"""The collectives stream's phase for a collective issued outside any step."""
WAIT_PREFIX = "_cw:"
"""A row's key for the time it waited in collectives in one component (ms)."""
OP_WAIT_PREFIX = "_cwop:"
"""...and per component and operation: ``_cwop:<component>:<op>``."""
_ZEROS = (0.0,) * len(BUILT_IN_PHASES)
_PHASE_BY_EVENT = {event: name for name, event in PHASES}


def phase_ms(devices: Any) -> float | None:
    """One phase's time in a step: its longest device (devices run side by side)."""
    if not isinstance(devices, dict):
        return None
    best: float | None = None
    for timing in devices.values():
        if isinstance(timing, dict):
            d = timing.get("duration_ms")
            if isinstance(d, (int, float)) and math.isfinite(d) and (best is None or d > best):
                best = float(d)
    return best


def phase_name(event: str) -> str | None:
    """The summary's name of an event; None for a reserved name this reader does not know."""
    name = _PHASE_BY_EVENT.get(event)
    if name is None and not event.startswith(PREFIX):
        name = f"user:{event}"
    return name


def wait_component(phase: str) -> str | None:
    """The iteration component a collectives line's ``phase`` falls in (None: a reserved
    name this reader does not know)."""
    if phase == STEP_EVENT:
        return REST
    if phase == BETWEEN_EVENT:
        return BETWEEN
    return phase_name(phase)


def add_wait(waits: dict[str, float], component: str, op: str, wait_ms: float) -> None:
    """Add one collectives line's wait to ``waits`` (a row's wait keys); ``component``
    is its phase's (:func:`wait_component`, or the live views' folded label)."""
    key = WAIT_PREFIX + component
    waits[key] = waits.get(key, 0.0) + wait_ms
    key = f"{OP_WAIT_PREFIX}{component}:{op}"
    waits[key] = waits.get(key, 0.0) + wait_ms


def waits_measured(ranks: Iterable[int], seen: Container[int], unmeasured: Container[int]) -> bool:
    """Whether the straggler analysis rests on measured waits: more than one rank, each
    with collectives lines (``seen``), none with a wait not measured (``unmeasured``)."""
    ranks = list(ranks)
    return len(ranks) > 1 and all(r in seen and r not in unmeasured for r in ranks)


def step_row(events: Mapping[str, Any]) -> dict[str, float] | None:
    """The row of one step's events; None without a usable step time."""
    total = phase_ms(events.get(STEP_EVENT))
    if total is None:
        return None
    row = {"step": total}
    for event, devices in events.items():
        if event == STEP_EVENT:
            continue
        ms = phase_ms(devices)
        if ms is None:
            continue
        name = phase_name(event)
        if name is not None:
            row[name] = ms
    return row


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    n = len(sorted_values)
    if n == 1:
        return float(sorted_values[0])
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))


def median(values: Iterable[float]) -> float:
    """The median (0.0 of nothing)."""
    ordered = sorted(values)
    return percentile(ordered, 50.0) if ordered else 0.0


def mean(values: Sequence[float]) -> float:
    """The mean (0.0 of nothing)."""
    return sum(values) / len(values) if values else 0.0


def rounded(x: float, digits: int = 3) -> float:
    """A figure as the summary prints it."""
    return round(float(x), digits)


def _is_phase(key: str) -> bool:
    # Rows may carry bookkeeping of their reader under "_"-keys (a timestamp).
    return key != "step" and not key.startswith("_")


def iteration(row: Mapping[str, float]) -> float:
    """The time of one training iteration: the step, plus the DataLoader wait when it
    was fetched before the step opened.

    In the usual loop (``for batch in loader: with trace_step(model): ...``) the batch is
    fetched before the step opens, so ``step_time`` leaves the wait out, and shares "of
    the step" would add up past 100 %. The files do not say where the fetch was; when the
    built-in phases (which never nest in each other) do not fit inside the step, the wait
    was outside it.
    """
    step = row["step"]
    if sum(map(row.get, BUILT_IN_PHASES, _ZEROS)) <= step * 1.000001:
        return step
    return step + row.get("dataloader_wait", 0.0)


def rest(row: Mapping[str, float]) -> float:
    """The iteration's time outside every measured phase (never below 0: phases may nest,
    a user phase inside forward)."""
    return max(0.0, iteration(row) - _used(row))


def _used(row: Mapping[str, float]) -> float:
    """The sum of a row's phases (as :func:`_is_phase` picks them); a reader may have
    summed them already, in the same order, under ``"_used"``."""
    used = row.get("_used")
    if used is not None:
        return used
    total = 0.0  # added one by one, as the reader does (sum() compensates from 3.12)
    for k, v in row.items():
        if k != "step" and k[:1] != "_":
            total += v
    return total


def phase_names(rows: Iterable[Mapping[str, float]]) -> list[str]:
    """The breakdown's phases in step order: the core ones always, h2d and user phases
    when some row has them, then ``rest``."""
    keys: set[str] = set()
    for row in rows:
        keys.update(row)  # C speed; the filter runs once per distinct key
    seen = {k for k in keys if _is_phase(k)}
    return [
        "dataloader_wait",
        *(["h2d"] if "h2d" in seen else []),
        "forward",
        "backward",
        "optimizer",
        *sorted(k for k in seen if k.startswith("user:")),
        "rest",
    ]


def phase_breakdown(
    rows: Sequence[Mapping[str, float]], names: Sequence[str]
) -> dict[str, dict[str, float]]:
    """Per phase of ``names``: mean and median ms over ``rows`` (one rank's steps, not
    empty), and the mean's share of the mean iteration."""
    # One pass per phase over plain lists: a rank may have a million steps.
    iterations = [iteration(r) for r in rows]
    mean_iteration = sum(iterations) / len(rows)
    out: dict[str, dict[str, float]] = {}
    for name in names:
        if name == "rest":
            values = [max(0.0, it - _used(r)) for r, it in zip(rows, iterations, strict=True)]
        else:
            values = [r.get(name, 0.0) for r in rows]
        mean = sum(values) / len(values)
        values.sort()
        out[name] = {
            "mean_ms": round(mean, 3),
            "p50_ms": round(percentile(values, 50.0), 3),
            "share": round(mean / mean_iteration if mean_iteration > 0 else 0.0, 4),
        }
    return out
