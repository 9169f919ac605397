"""The straggler analysis of a job with more than one parallel dimension: each rank's
own work compared with the ranks that do the same work, three causes told apart, and
what each one costs.

A rank's place in the parallel layout (``runtime_environment``'s ``parallel``) splits
its coordinates in two:

- its *position*: every coordinate but the data-parallel ones (``pp``, ``tp``, ``cp``,
  ``ep``, a DeviceMesh's other dims): the ranks of one position do the same work on
  different data, one per replica;
- its *replica*: the data-parallel coordinates (``dp``, ``dp_replicate``,
  ``dp_shard``, any ``dp_*``).

The causes (docs/reading-the-files.md gives each rule with a worked example):

- ``straggler``: a rank whose own work exceeds the other ranks of its position (its
  *peers*) in most steps: one slow worker (or one tensor-parallel group, when the
  waits inside that group are not measured);
- ``slow_stage``: a pipeline stage whose every replica does more work than the
  replica's other stages in most steps; its ranks are not stragglers;
- ``data_imbalance``: one replica slower than the others across its stages within a
  step, a different one from step to step (batches of different sequence lengths);
  tokens per step, where the ranks say them, confirm it.

The cost of a cause (``slowdown``) comes from a replay of each step: the step's
measured time is the busiest rank's own work plus the time no rank works on its own
(communication, pipeline fill and drain); replayed with the cause's extra work taken
out, the busiest rank changes and so does the step. ``slowdown`` is the measured
time over the replayed one, summed over the compared steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

from traceml_ai.analysis._phases import rounded

Coordinates = Mapping[str, tuple[int, int]]
"""One rank's place: dimension -> (its coordinate, the dimension's size)."""
Layout = Mapping[int, Coordinates]
"""Global rank -> its coordinates."""

PIPELINE = "pp"
"""The pipeline dimension: ranks of one stage share its coordinate."""

CHANGES_MIN_SHARE = 0.2
"""Data imbalance: the slowest replica changes in at least this share of steps..."""
COHERENT_SHARE = 0.75
"""...and, in a median step, at least this share of its ranks are slower than their
peers (slow across its stages, not one rank)."""
STAGES_TOGETHER = 0.5
"""...and its stages go together step by step at least this much (mean correlation):
a different batch length changes every stage's work alike."""
TOKENS_CONFIRM = 0.5
"""Tokens confirm a data imbalance when they correlate with the replicas' extra work
at least this much (Pearson, over replicas and steps)."""


def is_replica_dim(name: str) -> bool:
    """Whether a dimension splits the data (its ranks do the same work on other data)."""
    return name == "dp" or name.startswith("dp_")


def layout_of(parallel: object) -> Coordinates | None:
    """A ``parallel`` value of a runtime_environment line as coordinates (None when it is
    not a well-formed layout)."""
    if not isinstance(parallel, Mapping) or not parallel:
        return None
    out: dict[str, tuple[int, int]] = {}
    for name, coord in parallel.items():
        if not isinstance(name, str) or not isinstance(coord, Mapping):
            return None
        rank, size = coord.get("rank"), coord.get("size")
        if type(rank) is not int or type(size) is not int or not 0 <= rank < size:
            return None
        out[name] = (rank, size)
    return out


class Groups:
    """The compared ranks (by index) grouped by the layout: positions, replicas, stages."""

    def __init__(self, ranks: Sequence[int], layout: Layout) -> None:
        first = layout[ranks[0]]
        self.sizes = {name: size for name, (_, size) in sorted(first.items())}
        replica_dims = [n for n in self.sizes if is_replica_dim(n)]
        position_dims = [n for n in self.sizes if not is_replica_dim(n)]
        positions: dict[tuple[int, ...], int] = {}
        replicas: dict[tuple[int, ...], int] = {}
        self.position: list[int] = []
        self.replica: list[int] = []
        self.stage: list[int] | None = [] if PIPELINE in self.sizes else None
        for r in ranks:
            c = layout[r]
            p = tuple(c[n][0] for n in position_dims)
            q = tuple(c[n][0] for n in replica_dims)
            self.position.append(positions.setdefault(p, len(positions)))
            self.replica.append(replicas.setdefault(q, len(replicas)))
            if self.stage is not None:
                self.stage.append(c[PIPELINE][0])
        self.replicas = len(replicas)
        self.positions = len(positions)
        self.stages = len(set(self.stage)) if self.stage is not None else 1
        members: dict[int, list[int]] = {}
        for i, at in enumerate(self.position):
            members.setdefault(at, []).append(i)
        self.members = members
        """position -> the rank indices at it (one per replica)."""
        self.cells = self._cells()
        """replica x stage x k: the rank indices of each replica's stage (its tensor
        positions), when every cell has as many; None otherwise."""

    def _cells(self) -> NDArray[np.int64] | None:
        import numpy as np

        stages = sorted(set(self.stage)) if self.stage is not None else [0]
        at = {s: j for j, s in enumerate(stages)}
        cells: list[list[list[int]]] = [[[] for _ in stages] for _ in range(self.replicas)]
        for i, q in enumerate(self.replica):
            s = self.stage[i] if self.stage is not None else 0
            cells[q][at[s]].append(i)
        sizes = {len(c) for row in cells for c in row}
        if len(sizes) != 1 or 0 in sizes:
            return None
        out: NDArray[np.int64] = np.asarray(cells, dtype=np.int64)
        return out

    @classmethod
    def of(cls, ranks: Sequence[int], layout: Layout | None) -> Groups | None:
        """The groups, when every rank has coordinates in the same dimensions and more
        than one dimension has more than one rank; None otherwise (a one-dimension job
        is compared as a whole, as data parallelism always was)."""
        if not layout or not ranks or any(r not in layout for r in ranks):
            return None
        dims = {name: size for name, (_, size) in layout[ranks[0]].items()}
        if any({n: s for n, (_, s) in layout[r].items()} != dims for r in ranks):
            return None
        if sum(1 for size in dims.values() if size > 1) < 2:
            return None
        seen = {tuple(sorted((n, c) for n, (c, _) in layout[r].items())) for r in ranks}
        if len(seen) != len(ranks):
            return None  # two ranks at one place: not a layout
        return cls(ranks, layout)

    def tensor_mates(self, i: int) -> list[int]:
        """The other ranks of rank ``i``'s replica and stage (its tensor-parallel
        group, with any other position dimension): they meet in the collectives
        inside each layer."""
        stage = self.stage
        return [
            j
            for j, q in enumerate(self.replica)
            if j != i and q == self.replica[i] and (stage is None or stage[j] == stage[i])
        ]

    def peers(self, i: int) -> list[int]:
        """The ranks that do rank ``i``'s work, itself left out: its position's other
        ranks; without any (one replica), its stage's other ranks."""
        mine = [j for j in self.members[self.position[i]] if j != i]
        if mine or self.stage is None:
            return mine
        return [j for j, s in enumerate(self.stage) if s == self.stage[i] and j != i]


def peer_excess(own: NDArray[np.float64], groups: Groups) -> NDArray[np.float64]:
    """Per rank and step, its own work beyond the median of its peers' (NaN for a rank
    with no peer)."""
    import numpy as np

    out = np.full_like(own, np.nan)
    for members in groups.members.values():
        if len(members) > 1:
            out[members] = own[members] - _others_median(own[members])
        else:  # one replica: its stage's other ranks, when it has any
            (i,) = members
            peers = groups.peers(i)
            if peers:
                out[i] = own[i] - np.median(own[peers], axis=0)
    return out


def _others_median(values: NDArray[np.float64]) -> NDArray[np.float64]:
    """Per row and column, the median of the column's other rows (``np.median``'s
    figure), from one sort per column: the others' sorted values are the column's with
    that row's taken out, so each median is one or two of its neighbours."""
    import numpy as np

    m = values.shape[0]
    order = np.argsort(values, axis=0, kind="stable")
    ordered = np.take_along_axis(values, order, axis=0)
    place = np.empty_like(order)
    np.put_along_axis(place, order, np.arange(m)[:, None], axis=0)
    k = m - 1  # the others
    lo, hi = (k - 1) // 2, k // 2

    def nth(t: int) -> NDArray[np.float64]:
        # The others' t-th smallest: the column's t-th, or its (t+1)-th from that row on.
        below = ordered[t][None, :]
        above = ordered[min(t + 1, m - 1)][None, :]
        picked: NDArray[np.float64] = np.where(t < place, below, above)
        return picked

    out: NDArray[np.float64] = (nth(lo) + nth(hi)) / 2.0
    return out


def peer_level(own: NDArray[np.float64], groups: Groups, i: int) -> NDArray[np.float64]:
    """Per step, the median own work of rank ``i``'s peers (its own without any)."""
    import numpy as np

    peers = groups.peers(i)
    out: NDArray[np.float64] = np.median(own[peers], axis=0) if peers else own[i]
    return out


def slow_stages(
    own: NDArray[np.float64], groups: Groups, threshold: float, consistent: float
) -> tuple[list[dict[str, Any]], dict[int, NDArray[np.float64]]]:
    """The pipeline stages whose every replica does more work than the replica's other
    stages in most steps: their entries (rank indices), and per slow stage its extra
    work per rank index and step (what the replay takes out)."""
    import numpy as np

    if groups.stage is None or groups.stages < 2:
        return [], {}
    stage = np.asarray(groups.stage)
    replica = np.asarray(groups.replica)
    n = own.shape[1]
    stage_ids = sorted(set(groups.stage))
    # Per replica and stage, the median own work of its ranks (tensor positions).
    work: dict[tuple[int, int], NDArray[np.float64]] = {}
    for q in range(groups.replicas):
        for s in stage_ids:
            idx = np.flatnonzero((replica == q) & (stage == s))
            if len(idx):
                work[(q, s)] = np.median(own[idx], axis=0)
    entries: list[dict[str, Any]] = []
    extra_by_stage: dict[int, NDArray[np.float64]] = {}
    for s in stage_ids:
        beyond: list[NDArray[np.float64]] = []
        levels: list[NDArray[np.float64]] = []
        replicas: list[int] = []
        for q in range(groups.replicas):
            others = [work[(q, t)] for t in stage_ids if t != s and (q, t) in work]
            if (q, s) not in work or not others:
                continue
            level = np.median(np.vstack(others), axis=0)
            beyond.append(work[(q, s)] - level)
            levels.append(level)
            replicas.append(q)
        if not beyond:
            continue
        per_replica = np.vstack(beyond)  # replicas x steps
        # Every replica, persistently: each replica's median extra is above the bar.
        if float(np.median(per_replica, axis=1).min()) <= threshold:
            continue
        typical_by_step = np.median(per_replica, axis=0)
        above = int(np.count_nonzero(typical_by_step > threshold))
        if above < consistent * n:
            continue
        typical = float(np.median(typical_by_step))
        others_work = float(np.median(np.vstack(levels)))
        extra = np.zeros_like(own)
        for q, row in zip(replicas, beyond, strict=True):
            idx = np.flatnonzero((replica == q) & (stage == s))
            extra[idx] = np.fmax(0.0, row)
        extra_by_stage[s] = extra
        entries.append(
            {
                "stage": int(s),
                "ranks": [int(r) for r in np.flatnonzero(stage == s)],
                "excess_ms": rounded(typical),
                "excess_pct": rounded(100.0 * typical / others_work, 1)
                if others_work > 0
                else None,
                "slow_steps": above,
                "slow_share": rounded(above / n, 3),
            }
        )
    entries.sort(key=lambda e: -float(e["excess_ms"]))
    return entries, extra_by_stage


def data_imbalance(
    own: NDArray[np.float64],
    groups: Groups,
    threshold: float,
    consistent: float,
    tokens: NDArray[np.float64] | None,
) -> dict[str, Any] | None:
    """One replica slow across its stages within a step, another one in another step:
    the imbalance's figures, or None."""
    import numpy as np

    if groups.replicas < 2:
        return None
    n = own.shape[1]
    centered = np.zeros_like(own)
    counted = np.zeros(own.shape[0], dtype=np.bool_)
    for members in groups.members.values():
        if len(members) < 2:
            continue
        centered[members] = own[members] - np.median(own[members], axis=0)
        counted[members] = True
    replica = np.asarray(groups.replica)
    rows = []
    for q in range(groups.replicas):
        idx = np.flatnonzero((replica == q) & counted)
        if not len(idx):
            return None
        rows.append(centered[idx].mean(axis=0))
    # Each replica's own level taken out: what stays is what changes from step to
    # step (a replica slow throughout is a straggler's case, judged on its own).
    per_replica = np.vstack(rows)  # replicas x steps
    per_replica = per_replica - np.median(per_replica, axis=1, keepdims=True)
    slowest = np.argmax(per_replica, axis=0)
    spread = per_replica.max(axis=0) - per_replica.min(axis=0)
    typical = float(np.median(spread))
    if typical <= threshold:
        return None
    uneven = spread > threshold
    steps_uneven = int(np.count_nonzero(uneven))
    if steps_uneven < 3:
        return None
    tops = np.bincount(slowest[uneven], minlength=groups.replicas)
    if int(tops.max()) >= consistent * steps_uneven:
        return None  # the same replica throughout: a straggler's case, not the data's
    changes = int(np.count_nonzero(slowest[1:] != slowest[:-1]))
    if n < 2 or changes < CHANGES_MIN_SHARE * (n - 1):
        return None
    coherent = []
    for k in np.flatnonzero(uneven):
        idx = np.flatnonzero((replica == slowest[k]) & counted)
        coherent.append(float(np.mean(centered[idx, k] > 0.0)))
    coherence = float(np.median(coherent))
    if coherence < COHERENT_SHARE:
        return None
    correlation = _tokens_correlation(per_replica, tokens, replica, counted)
    if groups.stage is not None and groups.stages > 1:
        # Slow across its stages: a replica's stages gain and lose work together
        # (noise on each rank would not).
        together = _stages_together(centered, groups, counted)
        if together is None or together < STAGES_TOGETHER:
            return None
    elif correlation is None or correlation < TOKENS_CONFIRM:
        return None  # no stages to agree: only tokens can tell the data from noise
    return {
        "replicas": groups.replicas,
        "spread_ms": rounded(typical),
        "uneven_steps": steps_uneven,
        "slowest_changes": changes,
        "slowest_changes_share": rounded(changes / max(1, n - 1), 3),
        "coherence": rounded(coherence, 3),
        "tokens_correlation": correlation,
    }


def _stages_together(
    centered: NDArray[np.float64], groups: Groups, counted: NDArray[np.bool_]
) -> float | None:
    """How much one replica's stages go together step by step: the mean over replicas
    and pairs of stages of the correlation of their work beyond their peers' (None
    when it cannot be told)."""
    import numpy as np

    assert groups.stage is not None
    stage = np.asarray(groups.stage)
    replica = np.asarray(groups.replica)
    found = []
    for q in range(groups.replicas):
        series = []
        for s in np.unique(stage):
            idx = np.flatnonzero((replica == q) & (stage == s) & counted)
            if len(idx):
                series.append(centered[idx].mean(axis=0))
        for a in range(len(series)):
            for b in range(a + 1, len(series)):
                x = series[a] - series[a].mean()
                y = series[b] - series[b].mean()
                denom = math.sqrt(float((x * x).sum()) * float((y * y).sum()))
                if denom > 0:
                    found.append(float((x * y).sum()) / denom)
    return float(np.mean(found)) if found else None


def _tokens_correlation(
    per_replica: NDArray[np.float64],
    tokens: NDArray[np.float64] | None,
    replica: NDArray[np.int64],
    counted: NDArray[np.bool_],
) -> float | None:
    """How much a replica's tokens in a step go with its extra work (Pearson, both taken
    against the step's mean over replicas); None without tokens on every rank."""
    import numpy as np

    if tokens is None:
        return None
    rows = []
    for q in range(per_replica.shape[0]):
        idx = np.flatnonzero((replica == q) & counted)
        rows.append(tokens[idx].max(axis=0))
    t = np.vstack(rows)
    t = t - t.mean(axis=0)
    w = per_replica - per_replica.mean(axis=0)
    a, b = t.ravel(), w.ravel()
    denom = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    if denom <= 0:
        return None
    return rounded(float((a * b).sum()) / denom, 3)


def tokens_confirm(imbalance: Mapping[str, Any]) -> bool | None:
    """Whether tokens confirm a data imbalance (None: no tokens)."""
    corr = imbalance.get("tokens_correlation")
    return None if corr is None else bool(corr >= TOKENS_CONFIRM)


def balanced(own: NDArray[np.float64], groups: Groups) -> NDArray[np.float64]:
    """Own work with every replica brought down to its position's median, step by step
    (the replay of a run without data imbalance)."""
    import numpy as np

    out: NDArray[np.float64] = own.copy()
    for members in groups.members.values():
        if len(members) > 1:
            out[members] = np.fmin(own[members], np.median(own[members], axis=0))
    return out


def _replica_time(
    own: NDArray[np.float64], groups: Groups | None, share: float
) -> NDArray[np.float64]:
    """Per step, the busiest replica's time to do its work: its slowest stage's work
    (the ranks of one stage wait for each other) plus ``share`` of the other stages'
    (a pipeline's fill and drain: 1/M of them with M microbatches)."""
    import numpy as np

    if groups is None:
        out: NDArray[np.float64] = own.max(axis=0)
        return out
    if groups.cells is not None:
        # One gather: replica x stage x steps, each stage its slowest tensor position.
        w = own[groups.cells].max(axis=2)
        top = w.max(axis=1)
        grid: NDArray[np.float64] = (top + share * (w.sum(axis=1) - top)).max(axis=0)
        return grid
    stage = np.asarray(groups.stage) if groups.stage is not None else np.zeros(own.shape[0])
    replica = np.asarray(groups.replica)
    times = []
    for q in range(groups.replicas):
        per_stage = []
        for s in np.unique(stage):
            idx = np.flatnonzero((replica == q) & (stage == s))
            if len(idx):
                per_stage.append(own[idx].max(axis=0))
        w = np.vstack(per_stage)
        top = w.max(axis=0)
        times.append(top + share * (w.sum(axis=0) - top))
    result: NDArray[np.float64] = np.vstack(times).max(axis=0)
    return result


FILL_SHARES = tuple(i / 20 for i in range(21))
"""The shares of the other stages' work a replay may take a pipeline's fill and drain
to be (1/M with M microbatches; 0 without a pipeline)."""


def replay(
    iteration: NDArray[np.float64],
    own: NDArray[np.float64],
    without: NDArray[np.float64],
    groups: Groups | None = None,
) -> dict[str, Any]:
    """The slowdown of a cause. Each step's measured time (the median rank's
    iteration) is modelled as the busiest replica's time (:func:`_replica_time`) plus
    a remainder that no rank's own work explains (communication); with a pipeline,
    the share of the other stages' work in the fill and drain is the one that fits the
    steps best (least squares over the steps) without explaining more than was
    measured. Replayed with ``without`` (own work
    less the cause), the remainder stays and the busiest replica is taken again."""
    import numpy as np

    measured = np.median(iteration, axis=0)
    share = 0.0
    if groups is not None and groups.stage is not None and groups.stages > 1:
        best = math.inf
        for candidate in FILL_SHARES:
            fitted = _replica_time(own, groups, candidate)
            residual = measured - fitted
            if float(np.median(residual)) < 0.0:
                break  # the model says more than was measured: larger shares do too
            cost = float(((residual - residual.mean()) ** 2).sum())
            if cost < best - 1e-9:
                best, share = cost, candidate
    remainder = np.fmax(0.0, measured - _replica_time(own, groups, share))
    replayed = _replica_time(without, groups, share) + remainder
    total, total_without = float(measured.sum()), float(replayed.sum())
    factor = total / total_without if total_without > 0 else 1.0
    return {
        "factor": rounded(max(1.0, factor), 3),
        "step_ms": rounded(float(np.median(measured))),
        "without_ms": rounded(float(np.median(replayed))),
        "method": "replay",
    }
