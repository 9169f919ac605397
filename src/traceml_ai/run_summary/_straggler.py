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
from typing import Any

import attrs

from traceml_ai.run_summary._phases import (
    BETWEEN,
    BUILT_IN_PHASES,
    OP_WAIT_PREFIX,
    REST,
    WAIT_PREFIX,
    mean,
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

Rows = Mapping[int, Mapping[int, Mapping[str, float]]]


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


@attrs.frozen(kw_only=True)
class Waiting:
    """Where the other ranks wait for the named ones."""

    phase: str
    collective: str | None
    """The collective operation they wait in most (measured collectives), else None."""
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
    """``straggler``, ``intermittent``, ``none`` or ``n/a``."""
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


def _components(row: Mapping[str, float], previous: Mapping[str, float]) -> dict[str, float]:
    """One iteration of one rank split into components (ms, never negative); "_iter" is
    the whole iteration and "_dl_outside" 1.0 when the DataLoader wait was before the
    step."""
    step = row["step"]
    gap = max(0.0, (row.get("_ts", 0.0) - previous.get("_ts", 0.0)) / 1e6 - step)
    phases = {k: v for k, v in row.items() if k != "step" and not k.startswith("_")}
    built_in = sum(phases.get(name, 0.0) for name in BUILT_IN_PHASES)
    dataloader = phases.get(DATALOADER, 0.0)
    # Built-in phases never nest; when they do not fit in the step, the batch was
    # fetched before the step opened and its wait is part of the gap.
    outside = built_in > step * 1.000001
    out = dict(phases)
    out[BETWEEN] = max(0.0, gap - dataloader) if outside else gap
    in_step = built_in - dataloader if outside else built_in
    out[REST] = max(0.0, step - in_step)
    out["_iter"] = step + gap
    out["_dl_outside"] = 1.0 if outside else 0.0
    # Measured collectives: each component keeps its own work, and the wait is said
    # per component ("_cw:<component>") and per operation ("_cwop:<component>:<op>").
    wait = 0.0
    for key, value in row.items():
        if key.startswith(WAIT_PREFIX):
            name = key[len(WAIT_PREFIX) :]
            out[name] = max(0.0, out.get(name, 0.0) - value)
            out[key] = value
            wait += value
        elif key.startswith(OP_WAIT_PREFIX):
            out[key] = value
    out["_wait"] = wait
    return out


def _table(rows: Rows, ranks: Sequence[int]) -> tuple[list[int], dict[int, list[dict[str, float]]]]:
    """(steps compared, rank -> components per compared step): the steps every rank has
    together with the step before (the iteration needs the previous step's end)."""
    usable: set[int] | None = None
    for r in ranks:
        steps = rows[r]
        mine = {s for s in steps if s - 1 in steps and steps[s].get("_ts", 0) > 0}
        mine = {s for s in mine if steps[s - 1].get("_ts", 0) > 0}
        usable = mine if usable is None else usable & mine
    compared = sorted(usable or ())
    return compared, {r: [_components(rows[r][s], rows[r][s - 1]) for s in compared] for r in ranks}


def _mad(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    mid = median(values)
    return 1.4826 * median([abs(v - mid) for v in values])


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
    rows: Rows,
    strategy: str | None = None,
    nodes: Mapping[int, int] | None = None,
    collectives: bool = False,
) -> StragglerView:
    """The straggler view of a run (see :func:`_analyze`)."""
    return StragglerView.from_json(_analyze(rows, strategy, nodes, collectives))


def _analyze(
    rows: Rows,
    strategy: str | None,
    nodes: Mapping[int, int] | None,
    collectives: bool,
) -> dict[str, Any]:
    """The straggler view of a run, as its JSON form: ``rows`` is rank -> step -> row (``step_row``'s
    figures plus ``_ts``, the step's end in ns, and with ``collectives`` the waits of
    :data:`WAIT_PREFIX` and :data:`OP_WAIT_PREFIX`); ``nodes`` is rank -> node when
    known. ``collectives``: every rank's collectives were measured (the collectives
    stream), so waits are measured, not inferred from phase times."""
    ranks = sorted(rows)
    view: dict[str, Any] = {
        "definition": DEFINITION_COLLECTIVES if collectives else DEFINITION,
        "basis": "collectives" if collectives else "phase_times",
        "ranks": len(ranks),
        "stragglers": [],
    }
    if len(ranks) < 2:
        view.update(applicable=False, verdict="n/a", reason="one rank: nothing to compare")
        return view
    steps, table = _table(rows, ranks)
    view["steps_compared"] = len(steps)
    if len(steps) < MIN_STEPS:
        view.update(
            applicable=False,
            verdict="n/a",
            reason=f"{len(steps)} step(s) that every rank has; {MIN_STEPS} needed",
        )
        return view
    view["applicable"] = True
    n = len(steps)
    iteration = median([c["_iter"] for r in ranks for c in table[r]])
    view["iteration_ms"] = rounded(iteration)

    # Per step and component, the shortest time of any rank: what a rank spends
    # beyond it is its excess there.
    names = sorted({k for r in ranks for c in table[r] for k in c if not k.startswith("_")})
    floor = {
        name: [min(table[r][i].get(name, 0.0) for r in ranks) for i in range(n)] for name in names
    }

    def excess(r: int, name: str, i: int) -> float:
        return table[r][i].get(name, 0.0) - floor[name][i]

    # The synchronizing phase: the first of the strategy's in which some rank clearly
    # waits (on average over the steps, so that waits now and then count too).
    candidates = SYNC_PHASES.get(strategy or "", _DEFAULT_SYNC)
    wait_phase: str | None = None
    if collectives:
        # Measured: a rank's own work is its iteration less its time in collectives
        # (the last to arrive at a synchronizing collective waits least).
        own = {r: [table[r][i]["_iter"] - table[r][i]["_wait"] for i in range(n)] for r in ranks}
    else:
        for name in candidates:
            if name not in floor:
                continue
            mean_wait = max(mean([excess(r, name, i) for i in range(n)]) for r in ranks)
            if mean_wait > max(ABS_MS, REL * iteration):
                wait_phase = name
                break
        own = {
            r: [
                table[r][i]["_iter"] - (excess(r, wait_phase, i) if wait_phase else 0.0)
                for i in range(n)
            ]
            for r in ranks
        }
    view["wait_phase"] = wait_phase
    # Step-to-step noise: how much a rank's own work varies around its own median
    # (robust: a rank slow now and then, or slow throughout, does not inflate it).
    noise = median([_mad(own[r]) for r in ranks])
    view["noise_ms"] = rounded(noise)
    own_median = {r: median(own[r]) for r in ranks}
    view["own_work_ms"] = {str(r): rounded(own_median[r]) for r in ranks}
    threshold = _threshold(iteration, noise)
    view["threshold_ms"] = rounded(threshold)

    # Persistent: the ranks above the largest gap in the sorted medians of own work.
    group = _slow_group(ranks, own_median, own, threshold, n)
    if group:
        view["verdict"] = "straggler"
        view["stragglers"] = _explain(group, ranks, table, own, range(n), wait_phase, floor)
        others = [r for r in ranks if r not in group]
        slow_steps = [
            i
            for i in range(n)
            if median([own[r][i] for r in group]) - median([own[r][i] for r in others]) > threshold
        ]
        for entry in view["stragglers"]:
            entry["slow_steps"] = len(slow_steps)
            entry["slow_share"] = rounded(len(slow_steps) / n, 3)
    else:
        # One step is noisier than a median over many: a stricter bar for a step.
        step_threshold = max(threshold, STEP_ABS_MS, STEP_REL * iteration)
        slow = _intermittent(ranks, own, steps, step_threshold)
        if slow:
            view["verdict"] = "intermittent"
            entries = []
            for r, indices in slow.items():
                entry = _explain([r], ranks, table, own, indices, wait_phase, floor)[0]
                entry["slow_steps"] = len(indices)
                entry["slow_share"] = rounded(len(indices) / n, 3)
                entry["every_n_steps"] = _period([steps[i] for i in indices], steps)
                entry["first_slow_steps"] = [steps[i] for i in indices[:5]]
                entries.append(entry)
            view["stragglers"] = entries
        else:
            view["verdict"] = "none"
            spread = max(own_median.values()) - min(own_median.values())
            view["spread_ms"] = rounded(spread)
            view["caveat"] = (
                None if collectives else _inside_sync_caveat(ranks, table, candidates, iteration)
            )

    view["slow_node"] = _slow_node([s["rank"] for s in view["stragglers"]], ranks, nodes)
    if view["stragglers"] and collectives:
        view["waiting"] = _measured_wait(view, ranks, table, n, strategy)
        view["wait_phase"] = view["waiting"]["phase"] if view["waiting"] else None
    elif view["stragglers"] and wait_phase is not None:
        named = {s["rank"] for s in view["stragglers"]}
        waiting = [r for r in ranks if r not in named]
        view["waiting"] = {
            "phase": wait_phase,
            "collective": None,
            "ranks": waiting if len(waiting) <= 16 else None,
            "rank_count": len(waiting),
            "wait_ms_per_step": rounded(
                mean([mean([excess(r, wait_phase, i) for i in range(n)]) for r in waiting])
            )
            if waiting
            else 0.0,
            "why": _why(strategy, wait_phase),
        }
    else:
        view["waiting"] = None
    return view


def _measured_wait(
    view: Mapping[str, Any],
    ranks: Sequence[int],
    table: Mapping[int, Sequence[Mapping[str, float]]],
    n: int,
    strategy: str | None,
) -> dict[str, Any] | None:
    """Where the other ranks wait for the named ones, from the measured collectives: the
    component (and in it the operation) where they wait most beyond the named ranks."""
    named = {s["rank"] for s in view["stragglers"]}
    waiting = [r for r in ranks if r not in named]
    if not waiting:
        return None
    keys = {k for r in ranks for c in table[r] for k in c if k.startswith(WAIT_PREFIX)}
    if not keys:
        return None

    def surplus(key: str) -> float:
        theirs = mean([mean([table[r][i].get(key, 0.0) for i in range(n)]) for r in waiting])
        mine = mean([mean([table[r][i].get(key, 0.0) for i in range(n)]) for r in named])
        return theirs - mine

    key = max(sorted(keys), key=surplus)
    if surplus(key) <= 0.0:
        return None
    component = key[len(WAIT_PREFIX) :]
    op_prefix = f"{OP_WAIT_PREFIX}{component}:"
    op_keys = {k for r in ranks for c in table[r] for k in c if k.startswith(op_prefix)}
    op = max(sorted(op_keys), key=surplus)[len(op_prefix) :] if op_keys else None

    def beyond_shortest(r: int, i: int) -> float:
        return table[r][i].get(key, 0.0) - min(table[o][i].get(key, 0.0) for o in ranks)

    return {
        "phase": component,
        "collective": op,
        "ranks": waiting if len(waiting) <= 16 else None,
        "rank_count": len(waiting),
        "wait_ms_per_step": rounded(
            mean([mean([beyond_shortest(r, i) for i in range(n)]) for r in waiting])
        ),
        "why": _why_measured(strategy, component, op),
    }


def _why_measured(strategy: str | None, phase: str, op: str | None) -> str:
    what = _COLLECTIVE_WORDS.get(op or "", op or "collectives")
    if strategy == "ddp" and phase == "backward" and op == "all_reduce":
        what = "gradient all-reduce (DDP's buckets)"
    where = {BETWEEN: "between steps", REST: "in the step, outside its timed phases"}.get(
        phase, f"in {phase}"
    )
    label = {"ddp": "DDP", "fsdp": "FSDP", "deepspeed": "DeepSpeed"}.get(strategy or "")
    prefix = f"{label}: " if label else ""
    return f"{prefix}the other ranks wait in the {what}, {where} (measured)"


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
    ranks: Sequence[int],
    own_median: Mapping[int, float],
    own: Mapping[int, Sequence[float]],
    threshold: float,
    n: int,
) -> list[int]:
    ordered = sorted(ranks, key=lambda r: own_median[r])
    gaps = [
        (own_median[ordered[k + 1]] - own_median[ordered[k]], k) for k in range(len(ordered) - 1)
    ]
    gap, at = max(gaps)
    if gap <= threshold:
        return []
    group = sorted(ordered[at + 1 :])
    others = ordered[: at + 1]
    # Slower in most steps, not in a few long ones that moved the median.
    slower = sum(
        1
        for i in range(n)
        if median([own[r][i] for r in group]) > median([own[r][i] for r in others])
    )
    return group if slower >= CONSISTENT_SHARE * n else []


def _intermittent(
    ranks: Sequence[int],
    own: Mapping[int, Sequence[float]],
    steps: Sequence[int],
    threshold: float,
) -> dict[int, list[int]]:
    """rank -> indices of the steps where that rank alone was clearly slowest."""
    n = len(steps)
    alone: dict[int, list[int]] = {}
    by: dict[int, list[float]] = {}
    for i in range(n):
        values = sorted(((own[r][i], r) for r in ranks), reverse=True)
        top, rank = values[0]
        others = [v for v, _ in values[1:]]
        if top - median(others) > threshold:
            alone.setdefault(rank, []).append(i)
            by.setdefault(rank, []).append(top - median(others))
    need = max(INTERMITTENT_MIN_STEPS, math.ceil(INTERMITTENT_MIN_SHARE * n))
    out = {}
    for r, idx in sorted(alone.items()):
        # Noise makes every rank slowest alone now and then; a slow rank is so far
        # more often than the others, counting their steps slow by at least half as
        # much (a busy machine's blip of a few ms does not hide a 30 ms rhythm).
        bar = median(by[r]) / 2
        counts = [sum(1 for x in by.get(o, ()) if x >= bar) for o in ranks if o != r]
        usual = median(counts)
        # Its own slow steps by the same bar: a blip is not one of them.
        idx = [i for i, x in zip(idx, by[r], strict=True) if x >= bar]
        if len(idx) >= need and len(idx) >= DOMINANCE * (usual + 1):
            out[r] = idx
    return out


def _explain(
    group: Sequence[int],
    ranks: Sequence[int],
    table: Mapping[int, Sequence[Mapping[str, float]]],
    own: Mapping[int, Sequence[float]],
    indices: Sequence[int] | range,
    wait_phase: str | None,
    floor: Mapping[str, Sequence[float]],
) -> list[dict[str, Any]]:
    """Per slow rank: its own work against the others' over ``indices``, and the
    component where the extra sits."""
    others = [r for r in ranks if r not in group]
    out = []
    idx = list(indices)
    for r in group:
        mine = [own[r][i] for i in idx]
        theirs = [median([own[o][i] for o in others]) for i in idx]
        extra = median([a - b for a, b in zip(mine, theirs, strict=True)])
        reference = median(theirs)
        by_component: dict[str, float] = {}
        for name in floor:
            if name == wait_phase:
                continue
            diffs = [
                table[r][i].get(name, 0.0) - median([table[o][i].get(name, 0.0) for o in others])
                for i in idx
            ]
            by_component[name] = median(diffs)
        where = max(by_component, key=lambda k: by_component[k])
        dl_outside = median([table[r][i]["_dl_outside"] for i in idx]) >= 0.5
        out.append(
            {
                "rank": r,
                "own_work_ms": rounded(median(mine)),
                "others_own_work_ms": rounded(reference),
                "excess_ms": rounded(max(0.0, extra)),
                "excess_pct": rounded(100.0 * max(0.0, extra) / reference, 1)
                if reference > 0
                else None,
                "phase": where,
                "phase_excess_ms": rounded(max(0.0, by_component[where])),
                "phase_description": _describe(where, dl_outside),
            }
        )
    return out


def _inside_sync_caveat(
    ranks: Sequence[int],
    table: Mapping[int, Sequence[Mapping[str, float]]],
    candidates: Sequence[str],
    iteration: float,
) -> str | None:
    """When a synchronizing phase takes most of every rank's iteration, a rank slow
    inside it would look like the others: say so instead of implying there is none."""
    for name in candidates:
        share = median([c.get(name, 0.0) for r in ranks for c in table[r]]) / iteration
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
    best: tuple[int, int] | None = None
    for n in range(2, max(2, len(steps) // 2) + 1):
        counts: dict[int, int] = {}
        for s in slow_steps:
            counts[s % n] = counts.get(s % n, 0) + 1
        residue, hits = max(counts.items(), key=lambda kv: kv[1])
        size = sum(1 for s in steps if s % n == residue)
        clear = hits >= 3 and hits >= 0.8 * len(slow_steps) and hits >= 0.8 * size
        if clear and (best is None or hits > best[1]):
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
    """The verdict as one sentence, every figure non-negative."""
    if view is None:
        return "straggler: no step times"
    if not view.applicable:
        return f"straggler: n/a ({view.reason})"
    found = view.stragglers
    if view.verdict == "none" or not found:
        text = (
            f"straggler: none (own work per iteration within {view.spread_ms or 0.0:.2f} ms "
            f"across ranks; a difference needs {view.threshold_ms or 0.0:.2f} ms)"
        )
        if view.caveat:
            text += f"; {view.caveat}"
        return text
    node = view.slow_node
    who = _ranks_text([s.rank for s in found])
    if node:
        names = ", ".join(map(str, node.nodes))
        who = f"node {names} ({who})" if len(node.nodes) == 1 else f"nodes {names} ({who})"
    first = found[0]
    same_place = all(s.phase == first.phase for s in found)
    where = first.phase_description if same_place else "in several places"
    excess = max(s.excess_ms for s in found)
    pct = first.excess_pct
    if view.verdict == "intermittent":
        every = first.every_n_steps
        how_often = f"every {every}th step" if every else f"{first.slow_share * 100:.0f}% of steps"
        text = (
            f"straggler: {who}, now and then: slow in {first.slow_steps} of "
            f"{view.steps_compared} steps ({how_often}), +{excess:.2f} ms in those steps, "
            f"{where}"
        )
    else:
        text = (
            f"straggler: {who}: +{excess:.2f} ms of own work per iteration"
            + (f" (+{pct:.0f}%)" if pct is not None and len(found) == 1 else "")
            + f", {where}"
        )
    waiting = view.waiting
    if waiting and waiting.rank_count:
        op = waiting.collective
        at = f"{waiting.phase}'s {op}" if op else waiting.phase
        text += f"; the others wait in {at} ({waiting.wait_ms_per_step:.2f} ms per step)"
    return text
