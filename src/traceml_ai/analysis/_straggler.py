"""The straggler analysis: which rank(s) keep the others waiting, where, and how often.

One engine behind ``traceml summary`` (text, ``--json``, ``--short``, ``--follow``,
``--plot``), ``traceml.summary()`` and the short form at the end of ``traceml run``.
The rule, with a worked example of each case, is in docs/reading-the-files.md.

The unit is the **iteration**: on one rank, the time from the end of one step to the
end of the next (its ``timestamp_unix_ns``), that is the step itself plus everything
outside it — the DataLoader wait when the batch is fetched before the step opens, and
any work between steps. In a synchronous job every rank's iteration lasts about as
long, because the fast ranks wait for the slow one in a collective. What differs is
where each rank spends it: the slow rank in its own work, the others in the
*synchronizing phase* (backward's gradient all-reduce under DDP; forward, backward or
the optimizer under FSDP/ZeRO).

Per step and per rank, a rank's *wait* is how much longer its synchronizing phase was
than the shortest one of any rank in that step (the last rank to arrive waits for
nobody); its *own work* is its iteration minus that wait. The stragglers are the
ranks whose own work is clearly longer than the others'; the phase where their extra
work sits is the component (DataLoader wait, time between steps, forward, ...) where
they exceed the others most. A rank slow only now and then is found step by step.

Limit: a rank slow *inside* the synchronizing phase's own computation (e.g. a slow
backward before DDP's all-reduce) makes every rank's phase equally long; phase times
cannot tell such ranks apart, and the verdict says no rank differs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

from traceml_ai.analysis._causes import (
    Groups,
    Layout,
    balanced,
    data_imbalance,
    peer_excess,
    peer_level,
    replay,
    slow_stages,
    tokens_confirm,
)
from traceml_ai.analysis._columns import (
    Column,
    RankColumns,
    StepColumns,
    StepRow,
    columns_of_rows,
    is_columns,
)
from traceml_ai.analysis._phases import (
    BETWEEN,
    BUILT_IN_PHASES,
    GROUP_SEP,
    REST,
    median,
    rounded,
)

REL = 0.10
"""A difference counts when above this fraction of the reference iteration..."""
ABS_MS = 1.0
"""...and above this many milliseconds..."""
NOISE_FACTOR = 4.0
"""...and above this many times the run's step-to-step noise (robust, from the MAD)."""
CONSISTENT_SHARE = 0.75
"""A persistent straggler group is slower than the others in at least this share of steps."""
MIN_STEPS = 3
"""Steps every rank must have (with the one before) for the analysis to apply."""
INTERMITTENT_MIN_SHARE = 0.05
"""A rank is intermittently slow when slow alone in at least this share of steps..."""
INTERMITTENT_MIN_STEPS = 3
"""...and in at least this many steps..."""
STEP_ABS_MS = 4.0
"""A single step counts as slow only above this many milliseconds..."""
STEP_REL = 0.3
"""...and this fraction of the median iteration (besides the straggler threshold)."""
DOMINANCE = 3.0
"""...and at least this many times as often as the other ranks (plus one)."""

SYNC_PHASES: Mapping[str, tuple[str, ...]] = {
    "ddp": ("backward", "forward"),
    "fsdp": ("forward", "backward", "optimizer"),
    "deepspeed": ("forward", "backward", "optimizer"),
}
"""Where each strategy's collectives make the ranks wait, most likely first: DDP's
gradient all-reduce runs in backward (its buffer broadcast, when the model has
buffers, at the start of forward); FSDP and ZeRO gather and reduce in all three."""
_DEFAULT_SYNC = ("backward", "forward", "optimizer")

DATALOADER = "dataloader_wait"

DEFINITION = (
    "per step, a rank's own work is its iteration (step plus time outside it) minus its "
    "wait in the synchronizing phase (that phase's time beyond the shortest rank's); "
    f"stragglers: ranks whose median own work exceeds the others' by more than "
    f"{int(REL * 100)} % of the iteration, {ABS_MS:g} ms and {NOISE_FACTOR:g}x the "
    f"step-to-step noise, in at least {int(CONSISTENT_SHARE * 100)} % of steps"
)

DEFINITION_COLLECTIVES = (
    "per step, a rank's own work is its iteration (step plus time outside it) minus its "
    "measured wait in collectives; "
    f"stragglers: ranks whose median own work exceeds the others' by more than "
    f"{int(REL * 100)} % of the iteration, {ABS_MS:g} ms and {NOISE_FACTOR:g}x the "
    f"step-to-step noise, in at least {int(CONSISTENT_SHARE * 100)} % of steps"
)

Rows = Mapping[int, Mapping[int, StepRow]]


@attrs.frozen(kw_only=True)
class Coordinate:
    """A rank's coordinate in one parallel dimension."""

    rank: int
    size: int


@attrs.frozen(kw_only=True)
class Straggler:
    """One rank the verdict names: its own work against the others', and where the
    extra sits."""

    rank: int
    own_work_ms: float
    others_own_work_ms: float
    excess_ms: float
    excess_pct: float | None
    phase: str
    phase_excess_ms: float
    phase_description: str
    slow_steps: int
    slow_share: float
    every_n_steps: int | None = None
    """``intermittent`` only: N when the slow steps come every Nth step."""
    first_slow_steps: tuple[int, ...] | None = None
    """``intermittent`` only: the first (up to 5) slow steps."""
    parallel: Mapping[str, Coordinate] | None = None
    """Its place in the parallel layout, when the ranks said it."""


@attrs.frozen(kw_only=True)
class Waiting:
    """Where the other ranks wait for the named ones."""

    phase: str
    collective: str | None
    """The collective operation they wait in most (measured collectives), else None."""
    group: str | None = None
    """The parallel dimension that collective ran over (``dp``, ``pp``, ``tp``, ...),
    when the collectives lines said it."""
    ranks: tuple[int, ...] | None
    """The waiting ranks, up to 16 (None: more)."""
    rank_count: int
    wait_ms_per_step: float
    why: str


@attrs.frozen(kw_only=True)
class SlowNode:
    """The node(s) whose ranks are exactly the named ones."""

    nodes: tuple[int, ...]
    ranks: tuple[int, ...]


@attrs.frozen(kw_only=True)
class SlowStage:
    """A pipeline stage whose every replica does more work than its other stages."""

    stage: int
    ranks: tuple[int, ...]
    excess_ms: float
    """Per step, its work beyond the other stages' (the least over the replicas), median."""
    excess_pct: float | None
    slow_steps: int
    slow_share: float


@attrs.frozen(kw_only=True)
class Imbalance:
    """Replicas that take turns being slow: data (sequence-length) imbalance."""

    replicas: int
    spread_ms: float
    """Per step, the slowest replica's extra work over the fastest's, median."""
    uneven_steps: int
    """Steps where that spread is above the threshold."""
    slowest_changes: int
    """How many times the slowest replica changed from one step to the next."""
    slowest_changes_share: float
    coherence: float
    """In a median uneven step, the share of the slowest replica's ranks slower than their
    peers (1.0: slow across every stage)."""
    tokens_correlation: float | None
    """How much a replica's tokens go with its extra work; None without tokens."""
    tokens_confirm: bool | None = None


@attrs.frozen(kw_only=True)
class Slowdown:
    """What a cause costs: the measured step time over the step time without it."""

    factor: float
    step_ms: float
    without_ms: float
    method: str
    """``replay``: docs/reading-the-files.md says how."""


@attrs.frozen(kw_only=True)
class Cause:
    """One cause the analysis found, in the shape of the view's own fields."""

    verdict: str
    stragglers: tuple[Straggler, ...] = ()
    stages: tuple[SlowStage, ...] = ()
    imbalance: Imbalance | None = None
    slowdown: Slowdown | None = None
    waiting: Waiting | None = None


@attrs.frozen(kw_only=True)
class Stopped:
    """A rank whose steps ended well before the others'."""

    rank: int
    last_step: int
    others_last_step: int
    parallel: Mapping[str, Coordinate] | None = None


@attrs.frozen(kw_only=True)
class StragglerView:
    """The straggler analysis of a run: the one value every view reads (``traceml
    summary`` and its ``--json``, ``traceml.summary()``, the end of ``traceml run``, the
    dashboard, Prometheus and OTLP). :meth:`to_json` is its ``--json`` form (every key,
    null where it does not apply), :meth:`from_json` reads it back, :meth:`line` is its
    sentence."""

    definition: str
    basis: str
    """``collectives`` (measured waits) or ``phase_times`` (inferred from phases)."""
    ranks: int
    applicable: bool
    verdict: str
    """``straggler``, ``intermittent``, ``slow_stage``, ``data_imbalance``, ``none`` or
    ``n/a``: the costliest cause found."""
    stragglers: tuple[Straggler, ...] = ()
    reason: str | None = None
    """``n/a`` only: why."""
    steps_compared: int | None = None
    iteration_ms: float | None = None
    wait_phase: str | None = None
    noise_ms: float | None = None
    own_work_ms: Mapping[str, float] | None = None
    threshold_ms: float | None = None
    spread_ms: float | None = None
    """``none`` only: how far apart the ranks' own work is."""
    caveat: str | None = None
    """``none`` with inferred waits: what phase times cannot show."""
    slow_node: SlowNode | None = None
    waiting: Waiting | None = None
    layout: Mapping[str, int] | None = None
    """The parallel dimensions and their sizes, when the ranks said them."""
    stages: tuple[SlowStage, ...] = ()
    """``slow_stage`` only: the slow stages."""
    imbalance: Imbalance | None = None
    """``data_imbalance`` only."""
    slowdown: Slowdown | None = None
    """What the named cause costs."""
    also: tuple[Cause, ...] = ()
    """The other causes found, costliest first."""
    stopped: tuple[Stopped, ...] = ()
    """Ranks whose steps ended well before the others'."""

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StragglerView:
        """The view of its JSON form (the project's one converter, strict)."""
        from traceml_ai._converter import structure  # cattrs: not for every importer

        return structure(data, cls, what="straggler view")

    def to_json(self) -> dict[str, Any]:
        """The ``straggler`` block of ``traceml summary --json``."""
        from traceml_ai._converter import unstructure

        out: dict[str, Any] = unstructure(self)
        return out

    def line(self) -> str:
        """The verdict as one sentence."""
        return verdict_line(self)

    def causes(self) -> list[Cause]:
        """Every cause found, the verdict's first, then ``also`` (empty when none)."""
        if not self.applicable or self.verdict == "none":
            return []
        first = Cause(
            verdict=self.verdict,
            stragglers=self.stragglers,
            stages=self.stages,
            imbalance=self.imbalance,
            slowdown=self.slowdown,
            waiting=self.waiting,
        )
        return [first, *self.also]

    @property
    def named_ranks(self) -> list[int]:
        """The ranks the verdict names."""
        return [s.rank for s in self.stragglers]


class ExcessSoFar:
    """The percentage of a straggler's excess over the run so far, for a view computed
    again and again over the last steps (the live views).

    The percentage is the excess over the others' own work; in a synchronous job the
    others spend most of the iteration waiting, so their own work is a few ms and its
    median over a short window moves by half from one window to the next (+2251 %, then
    +1331 % for the same 30 ms). Each call adds a view's named ranks' excess and the
    others' own work to their totals since that rank was first named (under that
    verdict), and gives the view with each percentage taken from the totals: steady,
    and the same figure over the whole run that the files give. The ms figures stay
    the window's. Bounded by the ranks that were ever named.
    """

    def __init__(self) -> None:
        self._totals: dict[tuple[int, str], tuple[float, float]] = {}

    def __call__(self, view: StragglerView | None) -> StragglerView | None:
        if view is None or not view.stragglers:
            return view
        named = []
        for s in view.stragglers:
            key = (s.rank, view.verdict)
            excess, others = self._totals.get(key, (0.0, 0.0))
            excess += s.excess_ms
            others += s.others_own_work_ms
            self._totals[key] = (excess, others)
            pct = rounded(100.0 * excess / others, 1) if others > 0 else None
            named.append(attrs.evolve(s, excess_pct=pct))
        return attrs.evolve(view, stragglers=tuple(named))


_Key = TypeVar("_Key", str, tuple[str, str])


class _Table:
    """The compared iterations of every rank as matrices (ranks x steps): per component
    (``m``: the phases, ``between_steps``, ``rest_of_step``), the whole iteration,
    whether the DataLoader wait was before the step, the measured waits (their sum, per
    component, per component and operation) and the tokens. A component a rank's row
    did not have reads 0.0."""

    def __init__(self, columns: StepColumns, ranks: Sequence[int]) -> None:
        import numpy as np

        self.ranks = list(ranks)
        usable: NDArray[np.int64] | None = None
        for r in ranks:
            c = columns[r]
            timed = c.steps[c.ends() > 0]  # ascending, unique
            mine = timed[_among(timed - 1, timed)]
            usable = mine if usable is None else usable[_among(usable, mine)]
        self.steps = usable if usable is not None else np.zeros(0, dtype=np.int64)
        n = len(self.steps)
        self.n = n
        parts = [_Components(columns[r], self.steps) for r in ranks]
        zeros = np.zeros(n, dtype=np.float64)

        def matrix(rows: list[NDArray[np.float64]]) -> NDArray[np.float64]:
            return np.vstack(rows) if rows else np.zeros((0, n))

        def stack(found: list[dict[_Key, NDArray[np.float64]]]) -> dict[_Key, NDArray[np.float64]]:
            keys = sorted({k for mine in found for k in mine})
            return {k: matrix([mine.get(k, zeros) for mine in found]) for k in keys}

        self.m: dict[str, NDArray[np.float64]] = stack([p.components for p in parts])
        self.iterations = matrix([p.iteration for p in parts])
        self.dl_outside = matrix([p.dl_outside for p in parts])
        """1.0 where the DataLoader wait was before the step."""
        self.wait = matrix([p.wait for p in parts])
        """Each row's measured wait, all components together."""
        self.waits: dict[str, NDArray[np.float64]] = stack([p.waits for p in parts])
        self.op_waits: dict[tuple[str, str], NDArray[np.float64]] = stack(
            [p.op_waits for p in parts]
        )
        self.names = sorted(set().union(*(p.seen for p in parts)) if parts else set())
        """The components some compared row had (phases, between, rest, waited ones)."""
        tokens = [p.tokens for p in parts if p.tokens is not None]
        self.tokens = matrix(tokens) if parts and len(tokens) == len(parts) else None
        """Tokens per rank and step, when every compared row said them."""
        self.wait_keys = sorted(set().union(*(p.seen_waits for p in parts)) if parts else set())
        """The components with a measured wait in some compared row."""
        self.op_keys = sorted(set().union(*(p.seen_ops for p in parts)) if parts else set())
        """The (component, operation)s with a measured wait in some compared row."""

    def get(self, name: str) -> NDArray[np.float64]:
        """A component's matrix (zeros when no compared row had it)."""
        import numpy as np

        found = self.m.get(name)
        return found if found is not None else np.zeros((len(self.ranks), self.n))


def _among(values: NDArray[np.int64], ascending: NDArray[np.int64]) -> NDArray[np.bool_]:
    """Which of ``values`` are in ``ascending`` (sorted, unique)."""
    import numpy as np

    if not len(ascending):
        return np.zeros(len(values), dtype=np.bool_)
    at = np.minimum(np.searchsorted(ascending, values), len(ascending) - 1)
    found: NDArray[np.bool_] = ascending[at] == values
    return found


class _Components:
    """One rank's compared iterations split into components (ms, never negative), and
    what of them some of those rows had."""

    def __init__(self, c: RankColumns, compared: NDArray[np.int64]) -> None:
        import numpy as np

        p = np.searchsorted(c.steps, compared)
        q = np.searchsorted(c.steps, compared - 1)
        n = len(compared)
        zeros = np.zeros(n, dtype=np.float64)

        def had(col: Column) -> bool:
            return bool(n) and (col.present is None or bool(col.present[p].any()))

        step = c.step_ms[p]
        ts = c.ends()
        gap = np.fmax(0.0, (ts[p] - ts[q]) / 1e6 - step)
        out = {k: col.values[p] for k, col in c.phases.items()}
        seen = {k for k, col in c.phases.items() if had(col)}
        built_in: NDArray[np.float64] | float = 0.0
        for name in BUILT_IN_PHASES:
            built_in = built_in + out.get(name, zeros)
        dataloader = out.get(DATALOADER, zeros)
        # Built-in phases never nest; when they do not fit in the step, the batch was
        # fetched before the step opened and its wait is part of the gap.
        outside = built_in > step * 1.000001
        out[BETWEEN] = np.where(outside, np.fmax(0.0, gap - dataloader), gap)
        in_step = np.where(outside, built_in - dataloader, built_in)
        out[REST] = np.fmax(0.0, step - in_step)
        seen.update((BETWEEN, REST))
        self.iteration = step + gap
        self.dl_outside = outside.astype(np.float64)
        # Measured collectives: each component keeps its own work, and the wait is said
        # per component and per operation.
        wait = zeros
        self.waits: dict[str, NDArray[np.float64]] = {}
        self.seen_waits: set[str] = set()
        for name, col in c.waits.items():
            value = col.values[p]
            out[name] = np.fmax(0.0, out.get(name, zeros) - value)
            self.waits[name] = value
            wait = wait + value
            if had(col):
                seen.add(name)
                self.seen_waits.add(name)
        self.op_waits = {key: col.values[p] for key, col in c.op_waits.items()}
        self.seen_ops = {key for key, col in c.op_waits.items() if had(col)}
        self.wait = wait
        self.components = out
        self.seen = seen
        tokens = c.tokens
        self.tokens = (
            tokens.values[p]
            if tokens is not None
            and n
            and (tokens.present is None or bool(tokens.present[p].all()))
            else None
        )
        """The rows' tokens, when every compared row said them."""


def _sorted_median(ordered: NDArray[np.float64], axis: int) -> NDArray[np.float64]:
    """:func:`median`'s figure along ``axis`` of values sorted along it."""
    import numpy as np

    n = ordered.shape[axis]
    pos = (n - 1) * 50.0 / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    a = np.take(ordered, lo, axis=axis)
    b = np.take(ordered, hi, axis=axis)
    out: NDArray[np.float64] = a + (b - a) * (pos - lo)
    return out


def _medians(values: NDArray[np.float64], axis: int) -> NDArray[np.float64]:
    """:func:`median` along ``axis`` (exactly its figure, not numpy's), by a partial
    sort of each line."""
    import numpy as np

    lines = np.ascontiguousarray(np.moveaxis(values, axis, -1))
    n = lines.shape[-1]
    pos = (n - 1) * 50.0 / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    part = np.partition(lines, sorted({lo, hi}), axis=-1)
    a, b = part[..., lo], part[..., hi]
    out: NDArray[np.float64] = a + (b - a) * (pos - lo)
    return out


def _median1(values: NDArray[np.float64]) -> float:
    """:func:`median` of all of ``values`` (0.0 of nothing)."""
    flat = values.ravel()
    return _medians(flat, 0).item() if flat.size else 0.0


def _mad(values: NDArray[np.float64]) -> float:
    if not values.size:
        return 0.0
    import numpy as np

    mid = _median1(values)
    return 1.4826 * _median1(np.abs(values - mid))


def _mean1(values: NDArray[np.float64]) -> float:
    return float(values.sum() / values.size) if values.size else 0.0


def _threshold(reference_ms: float, noise_ms: float) -> float:
    return max(ABS_MS, REL * reference_ms, NOISE_FACTOR * noise_ms)


def _describe(component: str, dl_outside: bool) -> str:
    """Where the extra work sits, as the verdict says it."""
    if component == DATALOADER:
        where = "before the step" if dl_outside else "inside the step"
        return f"in the DataLoader, {where}"
    if component == BETWEEN:
        return "between steps, outside trace_step"
    if component == REST:
        return "in the step, outside its timed phases"
    return f"in {component}"


def analyze(
    rows: Rows | StepColumns,
    strategy: str | None = None,
    nodes: Mapping[int, int] | None = None,
    collectives: bool = False,
    layout: Layout | None = None,
) -> StragglerView:
    """The straggler view of a run (see :func:`_analyze`): ``rows`` are the step
    columns, or dict rows (rank -> step -> row) as the live views keep them; ``layout``
    is each rank's place in the parallel layout, when the ranks said it."""
    import numpy as np

    columns = rows if is_columns(rows) else columns_of_rows(rows)  # type: ignore[arg-type]
    # Overflow to infinity is a figure like any other (as in Python's arithmetic).
    with np.errstate(all="ignore"):
        view = _analyze(columns, strategy, nodes, collectives, layout)  # type: ignore[arg-type]
    return StragglerView.from_json(view)


def _coordinates(layout: Layout | None, rank: int) -> dict[str, dict[str, int]] | None:
    found = layout.get(rank) if layout else None
    if found is None:
        return None
    return {name: {"rank": c, "size": size} for name, (c, size) in sorted(found.items())}


def _layout_sizes(layout: Layout | None, ranks: Sequence[int]) -> dict[str, int] | None:
    """The dimensions and sizes every rank says alike (None when they do not agree)."""
    if not layout or not ranks or any(r not in layout for r in ranks):
        return None
    sizes = {name: size for name, (_, size) in sorted(layout[ranks[0]].items())}
    if any({n: s for n, (_, s) in sorted(layout[r].items())} != sizes for r in ranks):
        return None
    return sizes


def _stopped(columns: StepColumns, ranks: Sequence[int], layout: Layout | None) -> list[Any]:
    """Ranks whose last step is well before the others' (a crash, an early exit)."""
    found = {r: columns[r].last_step for r in ranks}
    last = {r: s for r, s in found.items() if s is not None}
    if len(last) < 2:
        return []
    top = max(last.values())
    out = []
    for r, mine in sorted(last.items()):
        if top - mine >= max(MIN_STEPS, 0.1 * top):
            out.append(
                {
                    "rank": r,
                    "last_step": mine,
                    "others_last_step": top,
                    "parallel": _coordinates(layout, r),
                }
            )
    return out


def _analyze(
    columns: StepColumns,
    strategy: str | None,
    nodes: Mapping[int, int] | None,
    collectives: bool,
    layout: Layout | None,
) -> dict[str, Any]:
    """The straggler view of a run, as its JSON form: ``columns`` hold each rank's step
    rows (``step_row``'s figures plus the step's end, and with ``collectives`` the
    measured waits per component and operation);
    ``nodes`` is rank -> node when known. ``collectives``: every rank's collectives
    were measured (the collectives stream), so waits are measured, not inferred from
    phase times."""
    import numpy as np

    ranks = sorted(columns)
    view: dict[str, Any] = {
        "definition": DEFINITION_COLLECTIVES if collectives else DEFINITION,
        "basis": "collectives" if collectives else "phase_times",
        "ranks": len(ranks),
        "stragglers": [],
        "layout": _layout_sizes(layout, ranks),
        "stopped": _stopped(columns, ranks, layout),
    }
    if len(ranks) < 2:
        view.update(applicable=False, verdict="n/a", reason="one rank: nothing to compare")
        return view
    table = _Table(columns, ranks)
    steps = [int(s) for s in table.steps]
    view["steps_compared"] = len(steps)
    if len(steps) < MIN_STEPS:
        view.update(
            applicable=False,
            verdict="n/a",
            reason=f"{len(steps)} step(s) that every rank has; {MIN_STEPS} needed",
        )
        return view
    groups = Groups.of(ranks, layout)
    if groups is not None and groups.stage is not None and groups.stages > 1 and not collectives:
        view.update(
            applicable=False,
            verdict="n/a",
            reason="pipeline parallel: the waits between stages are measured by the "
            "collectives stream, which was not exported or not measured on every rank",
        )
        return view
    view["applicable"] = True
    n = len(steps)
    iteration = _median1(table.iterations)
    view["iteration_ms"] = rounded(iteration)

    # Per step and component, the shortest time of any rank: what a rank spends
    # beyond it is its excess there.
    floor = {name: table.get(name).min(axis=0) for name in table.names}

    def excess(name: str) -> NDArray[np.float64]:
        out: NDArray[np.float64] = table.get(name) - floor[name]
        return out

    # The synchronizing phase: the first of the strategy's in which some rank clearly
    # waits (on average over the steps, so that waits now and then count too).
    candidates = SYNC_PHASES.get(strategy or "", _DEFAULT_SYNC)
    wait_phase: str | None = None
    if collectives:
        # Measured: a rank's own work is its iteration less its time in collectives
        # (the last to arrive at a synchronizing collective waits least).
        own = table.iterations - table.wait
    else:
        for name in candidates:
            if name not in floor:
                continue
            mean_wait = float((excess(name).sum(axis=1) / n).max())
            if mean_wait > max(ABS_MS, REL * iteration):
                wait_phase = name
                break
        own = table.iterations - (excess(wait_phase) if wait_phase else 0.0)
    view["wait_phase"] = wait_phase
    own_median = _medians(own, axis=1)
    view["own_work_ms"] = {str(r): rounded(float(own_median[i])) for i, r in enumerate(ranks)}
    if groups is not None:
        _layout_verdict(view, table, own, groups, steps, iteration, wait_phase, layout, strategy)
        view["slow_node"] = None
        return view

    # Step-to-step noise: how much a rank's own work varies around its own median
    # (robust: a rank slow now and then, or slow throughout, does not inflate it).
    noise = _median1(np.array([_mad(own[i]) for i in range(len(ranks))]))
    view["noise_ms"] = rounded(noise)
    threshold = _threshold(iteration, noise)
    view["threshold_ms"] = rounded(threshold)

    # Persistent: the ranks above the largest gap in the sorted medians of own work.
    group = _slow_group(own_median, own, threshold, n)
    slow_at: dict[int, NDArray[np.int64]] = {}
    if group:
        view["verdict"] = "straggler"
        view["stragglers"] = _explain(group, table, own, np.arange(n), wait_phase, floor)
        others = [i for i in range(len(ranks)) if i not in group]
        diff = _medians(own[group], axis=0) - _medians(own[others], axis=0)
        slow_steps = int(np.count_nonzero(diff > threshold))
        for entry in view["stragglers"]:
            entry["slow_steps"] = slow_steps
            entry["slow_share"] = rounded(slow_steps / n, 3)
        slow_at = {i: np.arange(n) for i in group}
    else:
        # One step is noisier than a median over many: a stricter bar for a step.
        step_threshold = max(threshold, STEP_ABS_MS, STEP_REL * iteration)
        slow = _intermittent(own, step_threshold)
        if slow:
            view["verdict"] = "intermittent"
            entries = []
            for i, indices in slow.items():
                entry = _explain([i], table, own, np.array(indices), wait_phase, floor)[0]
                entry["slow_steps"] = len(indices)
                entry["slow_share"] = rounded(len(indices) / n, 3)
                entry["every_n_steps"] = _period([steps[k] for k in indices], steps)
                entry["first_slow_steps"] = [steps[k] for k in indices[:5]]
                entries.append(entry)
                slow_at[i] = np.array(indices, dtype=np.int64)
            view["stragglers"] = entries
        else:
            view["verdict"] = "none"
            spread = float(own_median.max() - own_median.min())
            view["spread_ms"] = rounded(spread)
            view["caveat"] = (
                None if collectives else _inside_sync_caveat(table, candidates, iteration)
            )
    for entry in view["stragglers"]:
        entry["parallel"] = _coordinates(layout, entry["rank"])
    if slow_at:
        without = own.copy()
        for i, at in slow_at.items():
            others = [j for j in range(len(ranks)) if j not in slow_at]
            level = _medians(own[others], axis=0) if others else own[i]
            without[i, at] = np.fmin(own[i, at], level[at])
        view["slowdown"] = replay(table.iterations, own, without)

    view["slow_node"] = _slow_node([s["rank"] for s in view["stragglers"]], ranks, nodes)
    if view["stragglers"] and collectives:
        view["waiting"] = _measured_wait(view, table, strategy)
        view["wait_phase"] = view["waiting"]["phase"] if view["waiting"] else None
    elif view["stragglers"] and wait_phase is not None:
        named = {s["rank"] for s in view["stragglers"]}
        waiting = [i for i, r in enumerate(ranks) if r not in named]
        view["waiting"] = {
            "phase": wait_phase,
            "collective": None,
            "group": None,
            "ranks": [ranks[i] for i in waiting] if len(waiting) <= 16 else None,
            "rank_count": len(waiting),
            "wait_ms_per_step": rounded(_mean1(excess(wait_phase)[waiting].sum(axis=1) / n))
            if waiting
            else 0.0,
            "why": _why(strategy, wait_phase),
        }
    else:
        view["waiting"] = None
    return view


def _layout_verdict(
    view: dict[str, Any],
    table: _Table,
    own: NDArray[np.float64],
    groups: Groups,
    steps: Sequence[int],
    iteration: float,
    wait_phase: str | None,
    layout: Layout | None,
    strategy: str | None,
) -> None:
    """The causes of a job with several parallel dimensions (:mod:`._causes`), each
    with its cost; the costliest is the verdict, the others go in ``also``."""
    import numpy as np

    n = len(steps)
    ranks = table.ranks
    # Relative to own work, not to the iteration: a pipeline's iteration holds its
    # fill and drain, which no stage's work is compared with.
    base = max(ABS_MS, REL * _median1(own))
    peer = peer_excess(own, groups)
    has_peers = ~np.isnan(peer[:, 0])
    filled = np.where(np.isnan(peer), 0.0, peer)
    noise = _median1(np.array([_mad(filled[i]) for i in range(len(ranks)) if has_peers[i]]))
    view["noise_ms"] = rounded(noise)
    threshold = max(base, NOISE_FACTOR * noise)
    view["threshold_ms"] = rounded(threshold)
    iterations = table.iterations
    causes: list[dict[str, Any]] = []

    # One slow worker: its own work beyond its peers' by the bar in a median step, and
    # beyond them at all (by the noise-free bar) in most steps. One step against the
    # noise bar would ask a step to be 4x the noise above: a busy machine's noise
    # would then hide a rank slow by less than that in every step.
    peer_median = _medians(filled, axis=1)
    above = filled > base
    named = [
        i
        for i in range(len(ranks))
        if has_peers[i]
        and peer_median[i] > threshold
        and np.count_nonzero(above[i]) >= CONSISTENT_SHARE * n
    ]
    named = _with_tensor_mates(named, own, groups, has_peers, peer_median, above, base, threshold)
    imbalance = data_imbalance(own, groups, base, CONSISTENT_SHARE, _tokens(table))
    if named:
        entries = _explain_peers(named, table, own, groups, np.arange(n), wait_phase)
        without = own.copy()
        for i, entry in zip(named, entries, strict=True):
            entry["slow_steps"] = int(np.count_nonzero(above[i]))
            entry["slow_share"] = rounded(entry["slow_steps"] / n, 3)
            entry["parallel"] = _coordinates(layout, ranks[i])
            without[i] = np.fmin(own[i], peer_level(own, groups, i))
        causes.append(
            {
                "verdict": "straggler",
                "stragglers": entries,
                "slowdown": replay(iterations, own, without, groups),
                "waiting": _waiting_for(named, table, strategy),
            }
        )
    elif imbalance is None:
        step_threshold = max(threshold, STEP_ABS_MS, STEP_REL * iteration)
        slow = _intermittent(np.where(has_peers[:, None], filled, -np.inf), step_threshold)
        if slow:
            entries = []
            without = own.copy()
            for i, indices in slow.items():
                at = np.array(indices, dtype=np.int64)
                entry = _explain_peers([i], table, own, groups, at, wait_phase)[0]
                entry["slow_steps"] = len(indices)
                entry["slow_share"] = rounded(len(indices) / n, 3)
                entry["every_n_steps"] = _period([steps[k] for k in indices], steps)
                entry["first_slow_steps"] = [steps[k] for k in indices[:5]]
                entry["parallel"] = _coordinates(layout, ranks[i])
                entries.append(entry)
                without[i, at] = np.fmin(own[i, at], peer_level(own, groups, i)[at])
            causes.append(
                {
                    "verdict": "intermittent",
                    "stragglers": entries,
                    "slowdown": replay(iterations, own, without, groups),
                    "waiting": _waiting_for(list(slow), table, strategy),
                }
            )

    # A slow pipeline stage: every replica's stage beyond its other stages.
    stages, stage_extra = slow_stages(own, groups, base, CONSISTENT_SHARE)
    if stages:
        without = own.copy()
        for extra in stage_extra.values():
            without = np.fmax(0.0, without - extra)
        stage_ranks = [i for e in stages for i in e["ranks"]]
        for e in stages:
            e["ranks"] = [ranks[i] for i in e["ranks"]]
        causes.append(
            {
                "verdict": "slow_stage",
                "stages": stages,
                "slowdown": replay(iterations, own, without, groups),
                "waiting": _waiting_for(stage_ranks, table, strategy),
            }
        )

    # Data imbalance: the slowest replica changes from step to step.
    if imbalance is not None:
        imbalance["tokens_confirm"] = tokens_confirm(imbalance)
        causes.append(
            {
                "verdict": "data_imbalance",
                "imbalance": imbalance,
                "slowdown": replay(iterations, own, balanced(own, groups), groups),
                "waiting": None,
            }
        )

    causes.sort(key=lambda c: -float(c["slowdown"]["factor"]))
    if not causes:
        view["verdict"] = "none"
        spread = peer_median[has_peers]
        view["spread_ms"] = rounded(float(spread.max() - spread.min())) if len(spread) else 0.0
        view["caveat"] = None
        view["waiting"] = None
        return
    first, rest = causes[0], causes[1:]
    view.update(
        verdict=first["verdict"],
        stragglers=first.get("stragglers", []),
        stages=first.get("stages", []),
        imbalance=first.get("imbalance"),
        slowdown=first["slowdown"],
        waiting=first["waiting"],
    )
    if first["waiting"]:
        view["wait_phase"] = first["waiting"]["phase"]
    view["also"] = rest


def _with_tensor_mates(
    named: Sequence[int],
    own: NDArray[np.float64],
    groups: Groups,
    has_peers: NDArray[np.bool_],
    peer_median: NDArray[np.float64],
    above: NDArray[np.bool_],
    base: float,
    threshold: float,
) -> list[int]:
    """The named rank indices, each with the other ranks of its replica's stage (its
    tensor-parallel group) that the evidence cannot tell from it: above their own peers
    (by ``base`` in a median step and in most steps) and not below the named rank by
    the bar (``threshold``) in a median step.

    A wait inside a tensor-parallel group that is not measured (DTensor's functional
    collectives) is own work on the ranks that wait: the group's fast ranks then look
    as slow as its slow one, each by that one's extra plus its own noise. Which of them
    clears the bar is then chance; the group is what the evidence names."""
    import numpy as np

    n = own.shape[1]
    out = set(named)
    for i in named:
        for j in groups.tensor_mates(i):
            if j in out or not has_peers[j]:
                continue
            if peer_median[j] <= base or np.count_nonzero(above[j]) < CONSISTENT_SHARE * n:
                continue
            if _median1(own[i] - own[j]) <= threshold:
                out.add(j)
    return sorted(out)


def _tokens(table: _Table) -> NDArray[np.float64] | None:
    """Tokens per rank and step, when every compared rank said them in every step."""
    return table.tokens


def _waiting_for(
    named: Sequence[int], table: _Table, strategy: str | None
) -> dict[str, Any] | None:
    """Where the other ranks wait for the named rank indices (measured collectives)."""
    if not table.wait_keys:
        return None
    return _measured_wait(
        {"stragglers": [{"rank": table.ranks[i]} for i in named]}, table, strategy
    )


def _explain_peers(
    named: Sequence[int],
    table: _Table,
    own: NDArray[np.float64],
    groups: Groups,
    indices: NDArray[np.int64],
    wait_phase: str | None,
) -> list[dict[str, Any]]:
    """Per named rank index: its own work against its peers' over ``indices``, and the
    component where the extra sits."""
    import numpy as np

    out = []
    names = [k for k in table.names if k != wait_phase]
    for i in named:
        peers = groups.peers(i)
        mine = own[i, indices]
        theirs = np.median(own[peers][:, indices], axis=0) if peers else mine
        extra = _median1(mine - theirs)
        reference = _median1(theirs)
        by_component = {}
        for name in names:
            m = table.get(name)[:, indices]
            level = np.median(m[peers], axis=0) if peers else m[i]
            by_component[name] = _median1(m[i] - level)
        where = max(by_component, key=lambda k: by_component[k]) if by_component else REST
        dl_outside = _median1(table.dl_outside[i, indices]) >= 0.5
        out.append(
            _entry(
                table.ranks[i],
                _median1(mine),
                reference,
                extra,
                where,
                by_component.get(where, 0.0),
                dl_outside,
            )
        )
    return out


def _measured_wait(
    view: Mapping[str, Any], table: _Table, strategy: str | None
) -> dict[str, Any] | None:
    """Where the other ranks wait for the named ones, from the measured collectives: the
    component (and in it the operation) where they wait most beyond the named ranks."""
    ranks = table.ranks
    named_ranks = {s["rank"] for s in view["stragglers"]}
    waiting = [i for i, r in enumerate(ranks) if r not in named_ranks]
    named = [i for i, r in enumerate(ranks) if r in named_ranks]
    if not waiting:
        return None
    if not table.wait_keys:
        return None
    n = table.n

    def surplus(m: NDArray[np.float64]) -> float:
        theirs = _mean1(m[waiting].sum(axis=1) / n)
        mine = _mean1(m[named].sum(axis=1) / n)
        return theirs - mine

    component = max(table.wait_keys, key=lambda k: surplus(table.waits[k]))
    if surplus(table.waits[component]) <= 0.0:
        return None
    op_keys = [k for k in table.op_keys if k[0] == component]
    op = max(op_keys, key=lambda k: surplus(table.op_waits[k]))[1] if op_keys else None
    group: str | None = None
    if op is not None and GROUP_SEP in op:
        op, group = op.split(GROUP_SEP, 1)
    m = table.waits[component]
    beyond = m - m.min(axis=0)
    return {
        "phase": component,
        "collective": op,
        "group": group,
        "ranks": [ranks[i] for i in waiting] if len(waiting) <= 16 else None,
        "rank_count": len(waiting),
        "wait_ms_per_step": rounded(_mean1(beyond[waiting].sum(axis=1) / n)),
        "why": _why_measured(strategy, component, op, group),
    }


def _why_measured(strategy: str | None, phase: str, op: str | None, group: str | None) -> str:
    what = _COLLECTIVE_WORDS.get(op or "", op or "collectives")
    if strategy == "ddp" and phase == "backward" and op == "all_reduce":
        what = "gradient all-reduce (DDP's buckets)"
    where = {BETWEEN: "between steps", REST: "in the step, outside its timed phases"}.get(
        phase, f"in {phase}"
    )
    label = {"ddp": "DDP", "fsdp": "FSDP", "deepspeed": "DeepSpeed"}.get(strategy or "")
    prefix = f"{label}: " if label else ""
    return f"{prefix}the other ranks wait in the {what}{_group_words(group)}, {where} (measured)"


def _group_words(group: str | None) -> str:
    return f" over {group}" if group and group not in ("world", "other") else ""


_COLLECTIVE_WORDS = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "broadcast": "broadcast",
    "barrier": "barrier",
    "all_to_all": "all-to-all",
    "send": "send",
    "recv": "receive",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
}


def _slow_group(
    own_median: NDArray[np.float64], own: NDArray[np.float64], threshold: float, n: int
) -> list[int]:
    """The rank indices above the largest gap in the sorted medians of own work, when
    that gap is clear and they are slower in most steps."""
    import numpy as np

    ordered = [int(i) for i in np.argsort(own_median, kind="stable")]
    gaps = [
        (float(own_median[ordered[k + 1]] - own_median[ordered[k]]), k)
        for k in range(len(ordered) - 1)
    ]
    gap, at = max(gaps)
    if gap <= threshold:
        return []
    group = sorted(ordered[at + 1 :])
    others = sorted(ordered[: at + 1])
    # Slower in most steps, not in a few long ones that moved the median.
    slower = int(np.count_nonzero(_medians(own[group], axis=0) > _medians(own[others], axis=0)))
    return group if slower >= CONSISTENT_SHARE * n else []


def _intermittent(own: NDArray[np.float64], threshold: float) -> dict[int, list[int]]:
    """rank index -> indices of the steps where that rank alone was clearly slowest."""
    import numpy as np

    count, n = own.shape
    # Per step the slowest rank (the highest rank of equals) against the median of the
    # others (every value but one copy of the largest).
    top = count - 1 - np.argmax(own[::-1], axis=0)
    ordered = np.sort(own, axis=0)
    beyond = ordered[-1] - _sorted_median(ordered[:-1], 0)  # sorted: one sort serves both
    slow = beyond > threshold
    alone: dict[int, list[int]] = {}
    by: dict[int, list[float]] = {}
    for i in np.flatnonzero(slow):
        rank = int(top[i])
        alone.setdefault(rank, []).append(int(i))
        by.setdefault(rank, []).append(float(beyond[i]))
    need = max(INTERMITTENT_MIN_STEPS, math.ceil(INTERMITTENT_MIN_SHARE * n))
    out = {}
    for r, idx in sorted(alone.items()):
        # Noise makes every rank slowest alone now and then; a slow rank is so far
        # more often than the others, counting their steps slow by at least half as
        # much (a busy machine's blip of a few ms does not hide a 30 ms rhythm).
        bar = median(by[r]) / 2
        counts = [sum(1 for x in by.get(o, ()) if x >= bar) for o in range(count) if o != r]
        usual = median(counts)
        # Its own slow steps by the same bar: a blip is not one of them.
        idx = [i for i, x in zip(idx, by[r], strict=True) if x >= bar]
        if len(idx) >= need and len(idx) >= DOMINANCE * (usual + 1):
            out[r] = idx
    return out


def _explain(
    group: Sequence[int],
    table: _Table,
    own: NDArray[np.float64],
    indices: NDArray[np.int64],
    wait_phase: str | None,
    floor: Mapping[str, NDArray[np.float64]],
) -> list[dict[str, Any]]:
    """Per slow rank (index): its own work against the others' over ``indices``, and
    the component where the extra sits."""
    others = [i for i in range(len(table.ranks)) if i not in group]
    out = []
    theirs = _medians(own[others][:, indices], axis=0)
    reference = _median1(theirs)
    by_name = {
        name: (table.get(name)[:, indices], _medians(table.get(name)[others][:, indices], axis=0))
        for name in floor
        if name != wait_phase
    }
    for r in group:
        mine = own[r, indices]
        extra = _median1(mine - theirs)
        by_component = {name: _median1(m[r] - med) for name, (m, med) in by_name.items()}
        where = max(by_component, key=lambda k: by_component[k])
        dl_outside = _median1(table.dl_outside[r, indices]) >= 0.5
        out.append(
            _entry(
                table.ranks[r],
                _median1(mine),
                reference,
                extra,
                where,
                by_component[where],
                dl_outside,
            )
        )
    return out


def _entry(
    rank: int,
    own_ms: float,
    reference: float,
    extra: float,
    where: str,
    where_extra: float,
    dl_outside: bool,
) -> dict[str, Any]:
    """One named rank's JSON entry: its own work against ``reference`` (the others' or
    its peers'), and the component ``where`` its extra sits."""
    return {
        "rank": rank,
        "own_work_ms": rounded(own_ms),
        "others_own_work_ms": rounded(reference),
        "excess_ms": rounded(max(0.0, extra)),
        "excess_pct": rounded(100.0 * max(0.0, extra) / reference, 1) if reference > 0 else None,
        "phase": where,
        "phase_excess_ms": rounded(max(0.0, where_extra)),
        "phase_description": _describe(where, dl_outside),
    }


def _inside_sync_caveat(table: _Table, candidates: Sequence[str], iteration: float) -> str | None:
    """When a synchronizing phase takes most of every rank's iteration, a rank slow
    inside it would look like the others: say so instead of implying there is none."""
    for name in candidates:
        share = _median1(table.get(name)) / iteration
        if iteration > 0 and share >= 0.5:
            return (
                f"{name} is {share * 100:.0f}% of each iteration: a rank slow inside "
                f"{name} would not show (the others wait for it there)"
            )
    return None


def _period(slow_steps: Sequence[int], steps: Sequence[int]) -> int | None:
    """N when the slow steps come every Nth step: one class of step numbers modulo N
    holds at least 80 % of the slow steps, and at least 80 % of its steps were slow
    (a stray slow step from noise does not hide the rhythm)."""
    if len(slow_steps) < 3:
        return None
    import numpy as np

    all_steps = np.asarray(steps, dtype=np.int64)
    best: tuple[int, int] | None = None
    for n in range(2, max(2, len(steps) // 2) + 1):
        counts: dict[int, int] = {}
        for s in slow_steps:
            counts[s % n] = counts.get(s % n, 0) + 1
        residue, hits = max(counts.items(), key=lambda kv: kv[1])
        if hits < 3 or hits < 0.8 * len(slow_steps):
            continue
        size = int(np.count_nonzero(all_steps % n == residue))
        if hits >= 0.8 * size and (best is None or hits > best[1]):
            best = (n, hits)
    return best[0] if best else None


def _slow_node(
    named: Sequence[int], ranks: Sequence[int], nodes: Mapping[int, int] | None
) -> dict[str, Any] | None:
    """The node(s) whose ranks are exactly the named ones, when more than one node ran."""
    if not named or not nodes or any(r not in nodes for r in ranks):
        return None
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(nodes[r], []).append(r)
    if len(by_node) < 2:
        return None
    slow = {nodes[r] for r in named}
    if sorted(r for node in slow for r in by_node[node]) != sorted(named):
        return None
    if len(slow) == len(by_node):
        return None
    return {"nodes": sorted(slow), "ranks": sorted(named)}


def _why(strategy: str | None, phase: str) -> str:
    if strategy == "ddp" and phase == "backward":
        return "DDP: the other ranks wait in backward's gradient all-reduce"
    if strategy == "ddp" and phase == "forward":
        return "DDP: the other ranks wait in forward's buffer broadcast"
    if strategy in ("fsdp", "deepspeed"):
        return f"{strategy}: the other ranks wait in {phase}'s collectives"
    return f"the other ranks wait in {phase}"


def _ranks_text(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    return f"ranks {shown}"


def verdict_line(view: StragglerView | None) -> str:
    """The verdict as one sentence, every figure non-negative: the costliest cause, the
    others after ``also:``, and the ranks that stopped early."""
    if view is None:
        return "straggler: no step times"
    if not view.applicable:
        return f"straggler: n/a ({view.reason})" + _stopped_text(view)
    if view.verdict == "none" or not (view.stragglers or view.stages or view.imbalance):
        text = (
            f"straggler: none (own work per iteration within {view.spread_ms or 0.0:.2f} ms "
            f"across ranks; a difference needs {view.threshold_ms or 0.0:.2f} ms)"
        )
        if view.caveat:
            text += f"; {view.caveat}"
        return text + _stopped_text(view)
    first, *also = view.causes()
    text = _cause_text(first, view, first=True)
    if also:
        text += "; also: " + "; ".join(_cause_text(c, view, first=False) for c in also)
    return text + _stopped_text(view)


def _stopped_text(view: StragglerView) -> str:
    if not view.stopped:
        return ""
    first = view.stopped[0]
    who = _ranks_text([s.rank for s in view.stopped])
    return (
        f"; {who}: steps end at step {first.last_step}"
        + (" (and later)" if len({s.last_step for s in view.stopped}) > 1 else "")
        + f" while the others' reach step {first.others_last_step} (stopped early, "
        "or its last steps were lost)"
    )


def _where_text(parallel: Mapping[str, Coordinate] | None) -> str:
    if not parallel:
        return ""
    return " [" + " ".join(f"{n}={c.rank}" for n, c in parallel.items()) + "]"


def _one_tensor_group(found: Sequence[Straggler]) -> bool:
    """Whether the named ranks are exactly one tensor-parallel group: every ``tp``
    coordinate once, every other coordinate the same."""
    places = [s.parallel for s in found]
    if len(places) < 2 or any(not p or "tp" not in p for p in places):
        return False
    first = places[0]
    assert first is not None
    size = first["tp"].size
    if len(places) != size or {p["tp"].rank for p in places if p} != set(range(size)):
        return False
    rest = {n: c.rank for n, c in first.items() if n != "tp"}
    return all({n: c.rank for n, c in p.items() if n != "tp"} == rest for p in places if p)


def _cause_text(cause: Cause, view: StragglerView, first: bool) -> str:
    """One cause in words; the first one with the straggler verdict's exact wording of a
    data-parallel job, so one-dimension runs read as they always did."""
    layout = view.layout is not None and sum(1 for s in view.layout.values() if s > 1) > 1
    cost = ""
    if layout and cause.slowdown is not None:
        sd = cause.slowdown
        cost = (
            f"; slowdown {sd.factor:.2f}x ({sd.step_ms:.2f} ms a step, "
            f"{sd.without_ms:.2f} ms without it)"
        )
    if cause.verdict == "slow_stage":
        parts = []
        for st in cause.stages:
            pct = f" (+{st.excess_pct:.0f}%)" if st.excess_pct is not None else ""
            parts.append(
                f"stage {st.stage} ({_ranks_text(list(st.ranks))}): +{st.excess_ms:.2f} ms "
                f"of own work per iteration{pct} over the other stages, on every replica"
            )
        return "slow stage: " + "; ".join(parts) + " (rebalance the stages)" + cost
    if cause.verdict == "data_imbalance" and cause.imbalance is not None:
        im = cause.imbalance
        tokens = ""
        if im.tokens_confirm is True:
            tokens = f"; tokens per step confirm it (r={im.tokens_correlation:.2f})"
        elif im.tokens_confirm is False:
            tokens = f"; tokens per step do not follow it (r={im.tokens_correlation:.2f})"
        return (
            f"data imbalance: one of {im.replicas} replicas is slower across its stages in "
            f"{im.uneven_steps} steps, by {im.spread_ms:.2f} ms (median), and the slowest "
            f"replica changed {im.slowest_changes} times{tokens}" + cost
        )
    found = cause.stragglers
    if not found:
        return cause.verdict
    node = view.slow_node if first else None
    who = _ranks_text([s.rank for s in found])
    if layout:
        who += "".join(_where_text(s.parallel) for s in found[:4])
        if _one_tensor_group(found):
            who += " (one tensor-parallel group)"
    if node:
        names = ", ".join(map(str, node.nodes))
        who = f"node {names} ({who})" if len(node.nodes) == 1 else f"nodes {names} ({who})"
    head = found[0]
    same_place = all(s.phase == head.phase for s in found)
    where = head.phase_description if same_place else "in several places"
    excess = max(s.excess_ms for s in found)
    share = head.excess_pct
    if cause.verdict == "intermittent":
        every = head.every_n_steps
        how_often = f"every {every}th step" if every else f"{head.slow_share * 100:.0f}% of steps"
        text = (
            f"straggler: {who}, now and then: slow in {head.slow_steps} of "
            f"{view.steps_compared} steps ({how_often}), +{excess:.2f} ms in those steps, "
            f"{where}"
        )
    else:
        text = (
            f"straggler: {who}: +{excess:.2f} ms of own work per iteration"
            + (f" (+{share:.0f}%)" if share is not None and len(found) == 1 else "")
            + f", {where}"
        )
    waiting = cause.waiting
    if waiting and waiting.rank_count:
        op = waiting.collective
        if op and layout and waiting.group:
            op = f"{op} over {waiting.group}"
        at = f"{waiting.phase}'s {op}" if op else waiting.phase
        text += f"; the others wait in {at} ({waiting.wait_ms_per_step:.2f} ms per step)"
    return text + cost


def cost_line(view: StragglerView | None) -> str | None:
    """What the named cause costs, as the summary's line under the verdict (None when
    nothing is named)."""
    if view is None or view.slowdown is None:
        return None
    if view.layout is not None and sum(1 for size in view.layout.values() if size > 1) > 1:
        return None  # the verdict's own sentence says each cause's cost
    sd = view.slowdown
    return (
        f"cost: {sd.factor:.2f}x slowdown: {sd.step_ms:.2f} ms a step (median), "
        f"{sd.without_ms:.2f} ms without the {view.verdict.replace('_', ' ')} "
        f"(replayed from each step's own work and waits)"
    )
