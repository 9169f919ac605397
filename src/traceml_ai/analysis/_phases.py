"""Step rows and the phase breakdown, shared by ``traceml summary`` and ``traceml.summary()``.

A step_time line's ``events`` become a *row*, a :class:`StepRow`: the step's time and
each phase's, each figure the phase's longest device (devices run side by side),
built-in phases under their short names (``forward``, ``dataloader_wait``, ...), user
phases as ``user:<name>`` (the name every view shows). Light: imported on the rank
side, so nothing heavy here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from traceml_ai.analysis._columns import RankColumns, StepRow, columns_of_rows
from traceml_records import events

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray


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
USER_PREFIX = "user:"
"""The summary's names of user phases: ``user:<event name>``, the name the summary's
text and JSON, the Prometheus ``phase`` label, OTLP spans, the trackers and the
dashboard show (:func:`is_user_phase` tells them apart)."""
MAX_USER_PHASES = 8
"""User phases the live views and the dashboard keep under their own names."""
OTHER_PHASE = "other"
"""Where the live views and the dashboard count the user phases past
:data:`MAX_USER_PHASES` (:class:`UserPhaseFold`)."""
_ZEROS = (0.0,) * len(BUILT_IN_PHASES)
_PHASE_BY_EVENT = {event: name for name, event in PHASES}


def phase_name(event: str) -> str | None:
    """The summary's name of an event; None for a reserved name this reader does not know."""
    name = _PHASE_BY_EVENT.get(event)
    if name is None and not event.startswith(PREFIX):
        name = USER_PREFIX + event
    return name


def is_user_phase(name: str) -> bool:
    """Whether a phase (a summary name, :func:`phase_name`'s) is a user phase."""
    return name.startswith(USER_PREFIX)


class UserPhaseFold:
    """The one folding rule of the live views (Prometheus labels, OTLP spans, the live
    state) and of the dashboard page, live or from files: the first
    :data:`MAX_USER_PHASES` user phases to appear keep their names, every later one
    counts as :data:`OTHER_PHASE`; other names pass unchanged.

    "To appear": in the order a run's steps are read (a step's event names are sorted),
    which the live state sees as batches arrive and :func:`phase_names` keeps, so a
    page from the files keeps the same phases as the live page did. Call it with
    summary names (``user:NAME``); its memory is the kept names only.
    """

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: set[str] = set()

    def __call__(self, name: str) -> str:
        if not is_user_phase(name) or name in self._kept:
            return name
        if len(self._kept) < MAX_USER_PHASES:
            self._kept.add(name)
            return name
        return OTHER_PHASE


def wait_component(phase: str) -> str | None:
    """The iteration component a collectives line's ``phase`` falls in (None: a reserved
    name this reader does not know)."""
    if phase == STEP_EVENT:
        return REST
    if phase == BETWEEN_EVENT:
        return BETWEEN
    return phase_name(phase)


GROUP_SEP = "@"
"""Between an operation and its group in an operation's label: ``all_reduce@dp``."""


def op_label(op: str, group: object) -> str:
    """A collectives line's operation as the waits name it: with its group
    (``all_reduce@dp``) when the line says one, so that pipeline traffic and
    data-parallel reductions never merge."""
    if type(group) is str and group and len(group) <= 16:
        return f"{op}{GROUP_SEP}{group}"
    return op


def add_wait(
    waits: dict[str, float],
    op_waits: dict[tuple[str, str], float],
    key: tuple[str, str],
    wait_ms: float,
) -> None:
    """Add one collectives line's wait to a step's ``waits`` and ``op_waits`` (a
    :class:`StepRow`'s); ``key`` is ``(component, op)``: its phase's component
    (:func:`wait_component`, or the live views' folded label) and :func:`op_label`'s
    operation."""
    component = key[0]
    waits[component] = waits.get(component, 0.0) + wait_ms
    op_waits[key] = op_waits.get(key, 0.0) + wait_ms


def waits_measured(ranks: Iterable[int], seen: Container[int], unmeasured: Container[int]) -> bool:
    """Whether the straggler analysis rests on measured waits: more than one rank, each
    with collectives lines (``seen``), none with a wait not measured (``unmeasured``)."""
    ranks = list(ranks)
    return len(ranks) > 1 and all(r in seen and r not in unmeasured for r in ranks)


_FLOAT_MAX = 1.7976931348623157e308
"""The largest finite float: a timing above it is infinite."""
_MAX_CACHED_NAMES = 4096
"""Event names a caller's cache keeps at most (a hostile rank may send any number)."""


def longest_timing(devices: object) -> float | None:
    """An event's time: its longest device's ``duration_ms`` (devices run side by side);
    None when it has no device timing or any timing is not one (every device's
    ``duration_ms``, ``cpu_ms``, ``gpu_ms`` finite and not negative, ``n_calls`` at
    least 1): :func:`step_row`'s rule for one event."""
    if type(devices) is not dict:
        return None
    inf = _FLOAT_MAX
    best: float = -1.0
    for t in devices.values():
        if type(t) is not dict:
            return None
        d, c, g, n = t.get("duration_ms"), t.get("cpu_ms"), t.get("gpu_ms"), t.get("n_calls")
        # One test for the usual timing (a line's own check plan words what is wrong).
        if not (
            (type(d) is float or type(d) is int)
            and (type(c) is float or type(c) is int)
            and (g is None or type(g) is float or type(g) is int)
            and type(n) is int
            and 0.0 <= d <= inf
            and 0.0 <= c <= inf
            and (g is None or 0.0 <= g <= inf)
            and n >= 1
        ):
            return None
        if d > best:
            best = d
    return best if best >= 0.0 else None


def step_row(
    events: object,
    name_of: Callable[[str], str | None] = phase_name,
    cache: dict[str, str | None] | None = None,
) -> StepRow | None:
    """The one rule from a step's events to its row: the step's time, each phase's
    (``phases``, name -> ms) and ``used_ms``, the phases' sum; each event's time its
    longest device (devices run side by side), named by ``name_of`` (the summary's
    names; the live views fold late user phases into ``other``, and names that fold
    together add up). An event ``name_of`` names None is left out.

    None when the step cannot be read: no events object, no step time, or any timing
    that is not one (every device's ``duration_ms``, ``cpu_ms``, ``gpu_ms`` finite and
    not negative, ``n_calls`` at least 1). Every reader (the files, the live views, a
    rank's own steps) takes the step whole or not at all.
    ``cache`` (event -> name) spares ``name_of`` on the hot path.
    """
    if type(events) is not dict or STEP_EVENT not in events:
        return None
    names = cache if cache is not None else {}
    row: dict[str, float] = {}
    step_ms = 0.0
    used = 0.0
    for event, devices in events.items():
        best = longest_timing(devices)
        if best is None:
            return None
        if event == STEP_EVENT:
            step_ms = float(best)
            continue
        if event in names:
            key = names[event]
        else:
            key = name_of(event)
            if len(names) < _MAX_CACHED_NAMES:
                names[event] = key
        if key is not None:
            row[key] = row.get(key, 0.0) + best
            used += best
    return StepRow(step_ms, row, used)  # used: the phases' sum, in row order (see rest)


def percentile(sorted_values: Sequence[float] | NDArray[np.float64], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    n = len(sorted_values)
    if n == 1:
        return float(sorted_values[0])
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))


def percentiles(values: NDArray[np.float64], qs: Sequence[float]) -> list[float]:
    """:func:`percentile` of ``values`` (unsorted, not empty) at each of ``qs``: the same
    figures, by a partial sort (a million values need no full sort)."""
    import numpy as np

    n = len(values)
    spots = []
    for q in qs:
        pos = (n - 1) * q / 100.0
        lo = math.floor(pos)
        spots.append((lo, min(lo + 1, n - 1), pos - lo))
    kth = sorted({i for lo, hi, _ in spots for i in (lo, hi)})
    part = np.partition(values, kth)
    return [float(part[lo] + (part[hi] - part[lo]) * frac) for lo, hi, frac in spots]


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


def iteration(row: StepRow) -> float:
    """The time of one training iteration: the step, plus the DataLoader wait when it
    was fetched before the step opened.

    In the usual loop (``for batch in loader: with trace_step(model): ...``) the batch is
    fetched before the step opens, so ``step_time`` leaves the wait out, and shares "of
    the step" would add up past 100 %. The files do not say where the fetch was; when the
    built-in phases (which never nest in each other) do not fit inside the step, the wait
    was outside it.
    """
    step = row.step_ms
    phases = row.phases
    if sum(map(phases.get, BUILT_IN_PHASES, _ZEROS)) <= step * 1.000001:
        return step
    return step + phases.get("dataloader_wait", 0.0)


def rest(row: StepRow) -> float:
    """The iteration's time outside every measured phase (never below 0: phases may nest,
    a user phase inside forward)."""
    return max(0.0, iteration(row) - _used(row))


def _used(row: StepRow) -> float:
    """The sum of a row's phases: ``used_ms`` when a reader summed them already, in the
    same order."""
    if row.used_ms is not None:
        return row.used_ms
    total = 0.0  # added one by one, as the reader does (sum() compensates from 3.12)
    for v in row.phases.values():
        total += v
    return total


def phase_names(rows: Iterable[Mapping[str, object]]) -> list[str]:
    """The breakdown's phases in step order: the core ones always, h2d and user phases
    when some row's phases (or some rank's phase columns: their names) have them (in
    the order they first appear in ``rows``: the order :class:`UserPhaseFold` keeps
    them by), :data:`OTHER_PHASE` when some row has it (the live views' rows), then
    ``rest``. ``rows``: each a mapping keyed by phase names."""
    keys: dict[str, object] = {}
    for row in rows:
        keys.update(row)  # C speed, first appearance kept; the filter runs once per key
    return [
        "dataloader_wait",
        *(["h2d"] if "h2d" in keys else []),
        "forward",
        "backward",
        "optimizer",
        *(k for k in keys if is_user_phase(k)),
        *([OTHER_PHASE] if OTHER_PHASE in keys else []),
        "rest",
    ]


def phase_breakdown(
    rows: RankColumns | Sequence[StepRow], names: Sequence[str]
) -> dict[str, dict[str, float]]:
    """Per phase of ``names``: mean and median ms over ``rows`` (one rank's steps, as
    columns or rows, not empty), and the mean's share of the mean iteration."""
    import numpy as np

    if not isinstance(rows, RankColumns):
        rows = columns_of_rows({0: dict(enumerate(rows))})[0]
    # Overflow to infinity is a figure like any other (as in Python's arithmetic).
    with np.errstate(all="ignore"):
        return _breakdown(rows, names)


def _breakdown(c: RankColumns, names: Sequence[str]) -> dict[str, dict[str, float]]:
    import numpy as np

    step = c.step_ms
    # iteration(): the step, plus the DataLoader wait when the built-in phases (which
    # never nest) do not fit in it; added one by one, as sum() does.
    built_in: Any = 0.0
    for name in BUILT_IN_PHASES:
        built_in = built_in + c.phase(name)
    outside = built_in > step * 1.000001
    iterations = np.where(outside, step + c.phase("dataloader_wait"), step)
    t = c.totals
    sampled = len(step) > 0
    if t is not None and t.steps:
        # The means from every step's totals, the medians from the sample the rank keeps.
        count = t.steps
        mean_iteration = t.iteration_sum / count
    else:
        count = len(step)
        mean_iteration = float(iterations.sum()) / count
    out: dict[str, dict[str, float]] = {}
    for name in names:
        rest = name == "rest"
        values = np.fmax(0.0, iterations - _used_column(c)) if rest else c.phase(name)
        if t is not None and t.steps:
            total = t.rest_sum if rest else t.phase_sums.get(name, 0.0)
        else:
            total = float(values.sum())
        average = total / count
        out[name] = {
            "mean_ms": round(average, 3),
            "p50_ms": round(percentiles(values, (50.0,))[0] if sampled else average, 3),
            "share": round(average / mean_iteration if mean_iteration > 0 else 0.0, 4),
        }
    return out


def _used_column(c: RankColumns) -> Any:
    """Each row's sum of phases: ``used_ms`` where the reader kept it, else the phases
    added one by one in their order (:func:`_used`)."""
    import numpy as np

    total: Any = np.zeros(len(c), dtype=np.float64)
    for column in c.phases.values():
        total = total + column.values
    if c.used_ms is None:
        return total
    if c.used_ms.present is None:
        return c.used_ms.values
    return np.where(c.used_ms.present, c.used_ms.values, total)
