"""Step rows as columns: what the summary keeps of a step_time file, whatever its size.

A rank's rows (:class:`StepRow`) are kept as one typed
:class:`RankColumns`: a float64 column per field (the step time, each phase, the
phases' sum, the step's end, the tokens, each collectives wait), about 8 bytes per
value per step line, never an object per line. A value a row does not have reads
0.0, and a :class:`Column`'s ``present`` says which rows had it where some did not (a
phase seen in some steps only).

:func:`rank_columns` makes the files' reader's columns (keyed by its field names and
the phases' names) typed; :func:`columns_of_rows` turns rows (a rank's own, the
dashboard's live window) and :func:`rank_columns_of` the live state's steps into the
same columns, so every view runs the one analysis.
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

STEP_KEY = "step"
"""The files' reader's column of the step time (:func:`rank_columns`' keys)..."""
TS_KEY = "_ts"
"""...of the step's end (ns)..."""
USED_KEY = "_used"
"""...of the phases' sum..."""
TOKENS_KEY = "_tokens"
"""...and of the step's tokens; every other key of its rows is a phase's name."""
_FIELDS = (STEP_KEY, TS_KEY, USED_KEY, TOKENS_KEY)

_NONE: Mapping[Any, float] = types.MappingProxyType({})
"""No waits: the default of every row without them (read-only, so shared)."""


@attrs.define(slots=True)
class StepRow:
    """One step's row: what :func:`~traceml_ai.analysis._phases.step_row` makes of a step_time line's events, and
    what a reader knows besides (the step's end, its tokens, its collectives' waits).
    Its mappings are read, never changed: rows may share them."""

    step_ms: float
    """The step's time (``step_time``'s longest device)."""
    phases: Mapping[str, float]
    """Phase (its summary name: ``forward``, ``user:NAME``, ``other`` in the live
    views) -> ms, in the order of the step's events."""
    used_ms: float | None = None
    """The phases' sum, added in that order; None when not summed (then
    :func:`~traceml_ai.analysis._phases.rest` adds ``phases`` itself)."""
    end_ns: float | None = None
    """The step's end (``timestamp_unix_ns``), when the reader knows it."""
    tokens: float | None = None
    """The step's tokens, when the rank said them."""
    waits: Mapping[str, float] = _NONE
    """Iteration component (a phase, ``between_steps``, ``rest_of_step``) -> ms waited
    in collectives there (measured; empty without the collectives stream)."""
    op_waits: Mapping[tuple[str, str], float] = _NONE
    """(component, operation :func:`~traceml_ai.analysis._phases.op_label`) -> ms waited there in that operation."""


class Column:
    """One value per step (0.0 where the step's row did not have it)."""

    __slots__ = ("present", "values")

    def __init__(self, values: NDArray[np.float64], present: NDArray[np.bool_] | None) -> None:
        self.values = values
        self.present = present
        """Which steps' rows had it; None: every one."""

    def had(self, i: int) -> bool:
        """Whether row ``i`` had it."""
        return self.present is None or bool(self.present[i])


class RankTotals:
    """Exact figures of every step a rank wrote, kept as the lines are read, when its
    columns hold only a sample of its steps (the files' reader past its window)."""

    __slots__ = (
        "ends",
        "first_end",
        "first_step",
        "iteration_sum",
        "last_end",
        "last_step",
        "max_ms",
        "phase_sums",
        "rest_sum",
        "step_sum",
        "steps",
    )

    def __init__(self) -> None:
        self.steps = 0
        """Steps (lines) of the rank."""
        self.first_step = 0
        self.last_step = 0
        self.step_sum = 0.0
        """The step times' sum (ms)."""
        self.max_ms = 0.0
        """The longest step time (ms)."""
        self.ends = 0
        """Steps whose end is known."""
        self.first_end = 0.0
        self.last_end = 0.0
        """The earliest and latest step end (ns)."""
        self.phase_sums: dict[str, float] = {}
        """Phase name -> its times' sum (ms), in the order the phases first appear."""
        self.iteration_sum = 0.0
        """The iterations' sum (:func:`~traceml_ai.analysis._phases.iteration`, ms)."""
        self.rest_sum = 0.0
        """The sum of each iteration's time outside its phases (ms)."""

    def add(self, other: RankTotals) -> None:
        """Add the figures of later steps."""
        if not other.steps:
            return
        if not self.steps:
            self.first_step, self.last_step = other.first_step, other.last_step
            self.max_ms = other.max_ms
        else:
            self.first_step = min(self.first_step, other.first_step)
            self.last_step = max(self.last_step, other.last_step)
            self.max_ms = max(self.max_ms, other.max_ms)
        if other.ends:
            if self.ends:
                self.first_end = min(self.first_end, other.first_end)
                self.last_end = max(self.last_end, other.last_end)
            else:
                self.first_end, self.last_end = other.first_end, other.last_end
        self.steps += other.steps
        self.ends += other.ends
        self.step_sum += other.step_sum
        self.iteration_sum += other.iteration_sum
        self.rest_sum += other.rest_sum
        sums = self.phase_sums
        for name, value in other.phase_sums.items():
            sums[name] = sums.get(name, 0.0) + value


class RankColumns:
    """One rank's steps, ascending, and their rows' fields as columns: every step the
    rank wrote, or (``totals`` set, :attr:`sampled`) a sample of them, the same step
    numbers on every rank, with the exact figures of all of them in ``totals``."""

    __slots__ = (
        "end_ns",
        "node",
        "op_waits",
        "phases",
        "step_ms",
        "steps",
        "tokens",
        "totals",
        "used_ms",
        "waits",
    )

    def __init__(
        self,
        steps: NDArray[np.int64],
        step_ms: NDArray[np.float64],
        phases: dict[str, Column],
        *,
        used_ms: Column | None = None,
        end_ns: Column | None = None,
        tokens: Column | None = None,
        waits: dict[str, Column] | None = None,
        op_waits: dict[tuple[str, str], Column] | None = None,
        node: int | None = None,
        totals: RankTotals | None = None,
    ) -> None:
        self.steps = steps
        self.step_ms = step_ms
        """Each step's time (ms)."""
        self.phases = phases
        """Phase name -> its times, in the order the phases first appear in the rows
        (user phases by their summary names, ``user:NAME``)."""
        self.used_ms = used_ms
        """The phases' sum as the reader added it (None: no row had it)."""
        self.end_ns = end_ns
        """The steps' ends, ns (None: no row said it)."""
        self.tokens = tokens
        """The steps' tokens (None: no row said them)."""
        self.waits = waits if waits is not None else {}
        """Iteration component -> the measured collectives wait in it (ms)."""
        self.op_waits = op_waits if op_waits is not None else {}
        """(component, operation) -> the measured wait in that operation there (ms)."""
        self.node = node
        """The node the rank ran on (its last line's ``node_rank``), when known."""
        self.totals = totals
        """The exact figures of every step the rank wrote (None: the columns hold
        every step, and are their own totals)."""

    @property
    def sampled(self) -> bool:
        """Whether the columns hold only some of the rank's steps."""
        return self.totals is not None and self.totals.steps > len(self)

    @property
    def step_count(self) -> int:
        """How many steps the rank wrote (its columns may hold a sample of them)."""
        return self.totals.steps if self.totals is not None else len(self)

    @property
    def last_step(self) -> int | None:
        """The rank's last step (None: none)."""
        if self.totals is not None and self.totals.steps:
            return self.totals.last_step
        return int(self.steps[-1]) if len(self) else None

    def __len__(self) -> int:
        return int(self.steps.shape[0])

    def zeros(self) -> NDArray[np.float64]:
        import numpy as np

        return np.zeros(len(self), dtype=np.float64)

    def phase(self, name: str) -> NDArray[np.float64]:
        """The phase's times (zeros when no row had it)."""
        found = self.phases.get(name)
        return found.values if found is not None else self.zeros()

    def ends(self) -> NDArray[np.float64]:
        """The steps' ends, ns (0.0 where not known)."""
        return self.end_ns.values if self.end_ns is not None else self.zeros()

    def row(self, i: int) -> StepRow:
        """Row ``i`` (the fields it had)."""

        def one(c: Column | None) -> float | None:
            return float(c.values[i]) if c is not None and c.had(i) else None

        def some(cols: Mapping[Any, Column]) -> dict[Any, float]:
            return {k: float(c.values[i]) for k, c in cols.items() if c.had(i)}

        return StepRow(
            float(self.step_ms[i]),
            some(self.phases),
            used_ms=one(self.used_ms),
            end_ns=one(self.end_ns),
            tokens=one(self.tokens),
            waits=some(self.waits),
            op_waits=some(self.op_waits),
        )


StepColumns = dict[int, RankColumns]
"""rank -> its step columns."""


def rank_columns(
    steps: NDArray[np.int64],
    values: Mapping[str, NDArray[np.float64]],
    present: Mapping[str, NDArray[np.bool_]],
    node: int | None,
    totals: RankTotals | None = None,
) -> RankColumns:
    """The files' reader's columns of one rank as :class:`RankColumns`: ``values`` keyed
    as its rows are (:data:`STEP_KEY`, :data:`USED_KEY`, :data:`TS_KEY`,
    :data:`TOKENS_KEY`, every other key a phase's name, in the order the keys first
    appear), ``present`` for the keys some row lacked."""

    def column(key: str) -> Column | None:
        found = values.get(key)
        return None if found is None else Column(found, present.get(key))

    import numpy as np

    step = values.get(STEP_KEY)
    phases = {k: Column(v, present.get(k)) for k, v in values.items() if k not in _FIELDS}
    return RankColumns(
        steps,
        step if step is not None else np.zeros(len(steps), dtype=np.float64),
        phases,
        used_ms=column(USED_KEY),
        end_ns=column(TS_KEY),
        tokens=column(TOKENS_KEY),
        node=node,
        totals=totals,
    )


_K = TypeVar("_K")


def _gather(maps: Sequence[Mapping[_K, float]]) -> dict[_K, Column]:
    """Per key of ``maps`` (in the order the keys first appear): its column."""
    import numpy as np

    if not maps:
        return {}
    shape = tuple(maps[0])
    if all(map(shape.__eq__, map(tuple, maps))):
        # Every row has the same keys in the same order (nearly always: a rank's phases
        # and waits do not change from step to step): each key's column read straight
        # from the maps, without a presence mask.
        n = len(maps)
        return {
            key: Column(np.fromiter(map(itemgetter(key), maps), np.float64, n), None)
            for key in shape
        }
    keys: dict[_K, object] = {}
    for m in maps:
        keys.update(m)  # C speed, first appearance kept
    out: dict[_K, Column] = {}
    for key in keys:
        values = np.array([m.get(key, 0.0) for m in maps], dtype=np.float64)
        had = [key in m for m in maps]
        out[key] = Column(values, None if all(had) else np.array(had, dtype=np.bool_))
    return out


def _optional(found: Sequence[float | None]) -> Column | None:
    """The column of an optional field (None when no row has it)."""
    import numpy as np

    if all(v is None for v in found):
        return None
    values = np.array([0.0 if v is None else v for v in found], dtype=np.float64)
    had = [v is not None for v in found]
    return Column(values, None if all(had) else np.array(had, dtype=np.bool_))


def rank_columns_of(
    steps: Sequence[int],
    step_ms: Sequence[float],
    phases: Sequence[Mapping[str, float]],
    *,
    used_ms: Sequence[float | None] = (),
    end_ns: Sequence[float | None] = (),
    tokens: Sequence[float | None] = (),
    waits: Sequence[Mapping[str, float]] = (),
    op_waits: Sequence[Mapping[tuple[str, str], float]] = (),
) -> RankColumns:
    """One rank's columns of its rows' fields, one entry per row (``steps`` ascending,
    unique; an empty sequence: no row has that field): what :func:`columns_of_rows`
    makes of :class:`StepRow`s, and the live state of the steps it keeps, without a
    row object per step."""
    import numpy as np

    return RankColumns(
        np.array(steps, dtype=np.int64),
        np.array(step_ms, dtype=np.float64),
        _gather(phases),
        used_ms=_optional(used_ms) if used_ms else None,
        end_ns=_optional(end_ns) if end_ns else None,
        tokens=_optional(tokens) if tokens else None,
        waits=_gather(waits),
        op_waits=_gather(op_waits),
    )


def columns_of_rows(rows: Mapping[int, Mapping[int, StepRow]]) -> StepColumns:
    """The columns of rows (rank -> step -> row), steps in order; a rank without rows
    has none."""
    out: StepColumns = {}
    for rank in sorted(rows):
        steps = rows[rank]
        if not steps:
            continue
        order = sorted(steps)
        kept = [steps[s] for s in order]
        out[rank] = rank_columns_of(
            order,
            [r.step_ms for r in kept],
            [r.phases for r in kept],
            used_ms=[r.used_ms for r in kept],
            end_ns=[r.end_ns for r in kept],
            tokens=[r.tokens for r in kept],
            waits=[r.waits for r in kept],
            op_waits=[r.op_waits for r in kept],
        )
    return out


def is_columns(rows: Mapping[int, Any]) -> bool:
    """Whether ``rows`` are columns (else rows)."""
    return all(isinstance(v, RankColumns) for v in rows.values())


__all__ = [
    "STEP_KEY",
    "TOKENS_KEY",
    "TS_KEY",
    "USED_KEY",
    "Column",
    "RankColumns",
    "RankTotals",
    "StepColumns",
    "columns_of_rows",
    "is_columns",
    "rank_columns",
    "rank_columns_of",
]
