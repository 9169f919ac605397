"""What the aggregator knows of the run right now, for the live views.

One :class:`LiveState` per aggregator, fed by :class:`~traceml_ai.monitor._feed.LiveFeed`
(its one writer thread) and read by the Prometheus endpoint, the OTLP exporter and
the dashboard. Everything is bounded, and by the run's ranks, not its length: a
window of recent steps per rank (its last :data:`WINDOW_STEPS`, and their tokens and
collective waits: at most :data:`HELD_ROWS_PER_RANK` rows per rank, counted by
:meth:`LiveState.held_rows`), histogram bucket counts per rank and phase and the job's
(a scanned batch's values wait in a bounded buffer and are added in bulk, in numpy,
at the next read), the latest sample of each gauge, a fixed number of user
phase names (the rest fold into ``other``). Memory is O(ranks x window); the live
straggler analysis reads each rank's last ``STRAGGLER_STEPS`` of that window.

Values come from rank batches the aggregator has not validated yet (the export
validates its own copy), so every value is checked here: a field of the wrong type,
a negative or non-finite number leaves that figure out; nothing raises.
"""

from __future__ import annotations

import bisect
import math
import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs

from traceml_ai.analysis import (
    MAX_USER_PHASES,
    OTHER_PHASE,
    Coordinates,
    StepColumns,
    StragglerView,
    UserPhaseFold,
    add_wait,
    layout_of,
    op_label,
    phase_name,
    rank_columns_of,
    step_row,
    wait_component,
    waits_measured,
)
from traceml_ai.monitor._feedscan_py import MAX_LABELS

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from traceml_ai.monitor._feedscan_py import StepScan

__all__ = [
    "HELD_ROWS_PER_RANK",
    "MAX_DEVICES",
    "MAX_RANKS",
    "MAX_USER_PHASES",
    "OTHER_PHASE",
    "PHASE_BUCKETS_S",
    "PROCESS_COLUMNS",
    "STEP_BUCKETS_S",
    "WINDOW_STEPS",
    "Histogram",
    "LiveState",
    "MetricFigures",
    "RankFigures",
    "RankLive",
    "StepSeen",
]

STEP_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
"""Upper bounds (seconds) of the step time histogram: 1 ms to 60 s, then +Inf."""

PHASE_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0,
)  # fmt: skip
"""Upper bounds (seconds) of the phase histograms: fewer buckets than the step's,
because there are several phases per rank (series = ranks x phases x buckets)."""

MAX_DEVICES = 16
"""Devices of one rank whose peak memory the live state keeps."""
PROCESS_COLUMNS: tuple[str, ...] = (
    "cpu_percent",
    "ram_used_bytes",
    "gpu_memory_used_bytes",
    "gpu_memory_reserved_bytes",
)
"""The ``process`` figures :attr:`MetricFigures.process_table` holds, in its order."""
MAX_GPUS = 64
"""GPUs of one node whose figures the live state keeps."""
SYSTEM_COLUMNS: tuple[str, ...] = ("cpu_percent", "ram_used_bytes", "ram_total_bytes")
"""A node's system figures, in the order of :meth:`LiveState.node_tables`' first."""
GPU_COLUMNS: tuple[str, ...] = (
    "utilization_percent",
    "memory_used_bytes",
    "memory_total_bytes",
    "temperature_c",
    "power_usage_w",
    "power_limit_w",
)
"""A GPU's figures, in the order of :meth:`LiveState.node_tables`' second."""
MAX_DIMS = 16
"""Parallel dimensions a rank's layout may have; a larger one is not a layout."""
MAX_WAIT_KEYS = 64
"""Waits one step of one rank may hold in the live state (per component and per
component and operation, together); items past it are ignored and counted, whatever
a rank sends."""

MAX_RANKS = 65536
"""Ranks the live views track; a batch claiming a higher rank is ignored (and counted)."""

WINDOW_STEPS = 120
"""Recent steps kept per rank (for the straggler analysis, the dashboard, outliers)."""

HELD_ROWS_PER_RANK = 7 * WINDOW_STEPS
"""Rows of steps the state holds per rank at most, whatever the run's length: its
recent steps (``WINDOW_STEPS``), and keyed by step number (they may come before or
after the step's own line) tokens, waits per component and waits per operation
(``2 * WINDOW_STEPS`` each)."""

_RESERVED = "_traceml_internal:"


def _number(value: object) -> float | None:
    """A finite, non-negative number, else None (bool is not a number here)."""
    if type(value) is float:
        return value if math.isfinite(value) and value >= 0 else None
    if type(value) is int:
        return float(value) if value >= 0 else None
    return None


def _medians(rows: NDArray[Any], counts: Sequence[int]) -> list[float | None]:
    """Each row's median of its ``counts[i]`` values (None of none): the middle value,
    or the mean of the two middle values. The rest of a row holds +inf, so one sort of
    every row puts its values first, in order. ``rows`` is sorted in place (the
    caller's own copy). A sort, not a partition: numpy's row-wise partition takes
    several times as long as its sort of short rows."""
    import numpy as np

    n = np.asarray(counts, dtype=np.intp)
    rows.sort(axis=1)
    ordered = rows
    lines = np.arange(len(n))
    lo = ordered[lines, np.maximum(n - 1, 0) // 2]
    hi = ordered[lines, n // 2]
    # An odd count takes its middle value as is ((a + a) / 2 would overflow near max).
    with np.errstate(over="ignore"):  # the even branch near max: not the one taken
        mids = np.where(n % 2 == 1, lo, (lo + hi) / 2.0).tolist()
    return [mid if count else None for mid, count in zip(mids, counts, strict=True)]


_new_tuple = tuple.__new__
"""``tuple.__new__(StepSeen, fields)``: a named tuple made without its Python
``__new__`` (the scan's steps are made by ``map``, no Python frame per step)."""

_bucket = bisect.bisect_left
"""A value's bucket of a histogram's bounds (``Histogram.observe``'s search)."""


def _count(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


@attrs.define(slots=True)
class Histogram:
    """Bucket counts (not cumulative; the last bucket is +Inf), sum and count."""

    bounds: tuple[float, ...]
    counts: list[int]
    total: float = 0.0
    n: int = 0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> Histogram:
        return cls(bounds, [0] * (len(bounds) + 1))

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def observe_twice(self, also: Histogram, value: float) -> None:
        """Observe ``value`` here and in ``also`` (same bounds): one bucket search for
        a rank's histogram and the job's."""
        index = bisect.bisect_left(self.bounds, value)
        self.counts[index] += 1
        self.total += value
        self.n += 1
        also.counts[index] += 1
        also.total += value
        also.n += 1

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total, self.n)

    @classmethod
    def merged(cls, bounds: tuple[float, ...], hists: Sequence[Histogram]) -> Histogram:
        """One histogram holding every observation of ``hists`` (all with ``bounds``)."""
        if not hists:
            return cls.empty(bounds)
        # zip(*...) adds bucket by bucket in C, not one Python step per rank and bucket.
        counts = [sum(bucket) for bucket in zip(*(h.counts for h in hists), strict=True)]
        return cls(bounds, counts, sum(h.total for h in hists), sum(h.n for h in hists))


class StepSeen(NamedTuple):
    """One step of one rank as the live views use it (times in ms, ``end_ns`` its end).

    A named tuple: one is made per step on the feed's hot path."""

    rank: int
    node: int
    step: int
    end_ns: int
    step_ms: float
    phases: Mapping[str, float]
    """Phase name (``forward``, ``dataloader_wait``, ``user:NAME`` ...) -> ms."""


_MAX_WAIT_KEY_OBJECTS = 4096
"""(component, operation) key objects kept for reuse at most (whatever ranks send)."""
_NO_KEY: tuple[str, str] = ("", "")
"""The wait key of a collectives line whose phase names no component (compared by id)."""
_STEP_OF = operator.itemgetter(2)
_END_OF = operator.itemgetter(3)
_MS_OF = operator.itemgetter(4)
_PHASES_OF = operator.itemgetter(5)
"""A ``StepSeen``'s step, end_ns, step_ms and phases, read in C."""
_NO_WAITS: dict[str, float] = {}
_NO_OP_WAITS: dict[tuple[str, str], float] = {}
"""A step's waits when it has none (read, never changed)."""


@attrs.define(slots=True)
class RankLive:
    """One rank's live figures."""

    rank: int
    node: int = 0
    steps: int = 0
    last_step: int = 0
    last_end_ns: int = 0
    step_hist: Histogram = attrs.field(factory=lambda: Histogram.empty(STEP_BUCKETS_S))
    phase_hist: dict[str, Histogram] = attrs.field(factory=dict)
    recent: deque[StepSeen] = attrs.field(factory=lambda: deque(maxlen=WINDOW_STEPS))
    slot: int = -1
    """Its row of the state's recent step times (-1 in copies, which have none)."""
    phase_pairs: dict[str, tuple[Histogram, Histogram]] = attrs.field(factory=dict)
    """label -> (its ``phase_hist``, the job's of the label): the feed's lookup (empty
    in copies)."""
    label_mask: int = 0
    """The label ids (bits) of the scanned batches ``phase_pairs`` has."""
    peak_memory: dict[str, tuple[float | None, float | None]] = attrs.field(factory=dict)
    """device -> (peak allocated, peak reserved) bytes of the last step that reported it."""
    process: dict[str, float] = attrs.field(factory=dict)
    strategy: str | None = None
    waits: dict[int, dict[str, float]] = attrs.field(factory=dict)
    """step -> its measured waits per component (``analysis.add_wait``), the
    recent steps only..."""
    op_waits: dict[int, dict[tuple[str, str], float]] = attrs.field(factory=dict)
    """...and per (component, operation); the same steps."""
    waits_unmeasured: bool = False
    """A collectives line of this rank had no measured wait (NCCL without timing)."""
    tokens: dict[int, float] = attrs.field(factory=dict)
    """step -> the tokens the rank said for it, the recent steps only."""
    parallel: Coordinates | None = None
    """Its place in the parallel layout (its last runtime_environment's ``parallel``)."""


class RankFigures(NamedTuple):
    """One rank's figures as the metrics read them (copies, taken under the lock)."""

    rank: int
    node: int
    steps: int
    last_step: int
    last_end_ns: int
    recent_median_ms: float | None
    """The median time of the rank's recent steps (at most ``WINDOW_STEPS``)."""
    peak_memory: dict[str, tuple[float | None, float | None]]
    process: dict[str, float]
    step_hist: Histogram | None
    """The rank's own histograms: None unless ``MetricFigures.rank_histograms``."""
    phase_hist: dict[str, Histogram] | None


@attrs.frozen
class MetricFigures:
    """What the metrics read from the state at one scrape or export: each rank's
    figures as columns (one list per figure, the ranks in order; copies taken under
    the lock), so that a figure across 10,240 ranks is one list, not 10,240 reads."""

    rank: list[int]
    node: list[int]
    steps: list[int]
    last_step: list[int]
    last_end_ns: list[int]
    recent_median_ms: list[float | None]
    """The median time of each rank's recent steps (at most ``WINDOW_STEPS``)."""
    peak_memory: list[dict[str, tuple[float | None, float | None]]]
    """Each rank's devices' peaks (shared with the state, which replaces them whole)."""
    process: list[dict[str, float]]
    """Each rank's process figures (shared, replaced whole too)."""
    step_hist: list[Histogram] | None
    """Each rank's own histograms (copies): None unless ``rank_histograms``."""
    phase_hist: list[dict[str, Histogram]] | None
    process_table: NDArray[Any]
    """Each rank's ``process`` figures as a row of :data:`PROCESS_COLUMNS` (NaN: not
    reported)."""
    peak_table: NDArray[Any]
    """Each rank's devices' (peak allocated, peak reserved) bytes: ranks x
    :data:`MAX_DEVICES` x 2 (NaN: no such device, or not reported)."""
    rank_count: int
    """The run's ranks: the world size the ranks report, or the ranks heard from if more."""
    rank_histograms: bool
    """Whether each rank's own histograms are included (``rank_count`` is at most the
    bound the caller gave)."""
    job_step: Histogram
    """Every rank's step times in one histogram."""
    job_phases: dict[str, Histogram]
    """Every rank's times of each phase, one histogram per phase (sorted by name)."""

    def rank_figures(self, indices: Iterable[int] | None = None) -> list[RankFigures]:
        """The ranks at ``indices`` (positions in the columns; every rank by default),
        one :class:`RankFigures` each."""
        positions = range(len(self.rank)) if indices is None else indices
        hists, phases = self.step_hist, self.phase_hist
        return [
            RankFigures(
                self.rank[i],
                self.node[i],
                self.steps[i],
                self.last_step[i],
                self.last_end_ns[i],
                self.recent_median_ms[i],
                self.peak_memory[i],
                self.process[i],
                hists[i] if hists is not None else None,
                phases[i] if phases is not None else None,
            )
            for i in positions
        ]

    @property
    def ranks(self) -> list[RankFigures]:
        """Every rank's figures, in rank order."""
        return self.rank_figures()


@attrs.define(slots=True)
class NodeLive:
    """One node's latest system sample."""

    node: int
    system: dict[str, float] = attrs.field(factory=dict)
    gpus: dict[int, dict[str, float]] = attrs.field(factory=dict)
    slot: int = -1
    """Its row of the state's node tables (-1 in copies, which have none)."""


_PROCESS_FIELDS = (
    "cpu_percent",
    "ram_used_bytes",
    "gpu_memory_used_bytes",
    "gpu_memory_reserved_bytes",
    "gpu_memory_total_bytes",
)
_SYSTEM_FIELDS = ("cpu_percent", "ram_used_bytes", "ram_total_bytes")
_GPU_FIELDS = (
    "utilization_percent",
    "memory_used_bytes",
    "memory_total_bytes",
    "power_usage_w",
    "power_limit_w",
)


_FIGURES = operator.attrgetter(
    "rank", "node", "steps", "last_step", "last_end_ns", "peak_memory", "process"
)
"""A rank's figures the metrics read as columns (``MetricFigures``' first seven)."""


def _nan_table(*shape: int) -> NDArray[Any]:
    import numpy as np

    return np.full(shape, np.nan)


def _grown(table: NDArray[Any], unused: float) -> NDArray[Any]:
    """``table`` with twice the rows, the new ones filled with ``unused``."""
    import numpy as np

    grown = np.full((2 * len(table), *table.shape[1:]), unused)
    grown[: len(table)] = table
    return grown


def _empty_rows(n: int) -> NDArray[Any]:
    """``n`` ranks' rows of recent step times, none used yet."""
    import numpy as np

    return np.full((n, WINDOW_STEPS), np.inf)


MEMORY_KEYS = ("device", "peak_allocated_bytes", "peak_reserved_bytes")
"""The fields of a step_memory item the state reads (``add_memory_rows``' columns)."""
COLLECTIVE_KEYS = ("step", "phase", "op", "wait_ms", "group")
"""The fields of a collectives item the state reads (``add_collective_rows``' columns)."""

PENDING_VALUES = 1 << 14
"""Values the state holds for its histograms before it adds them in (it does at every
read too): the buffer's bound, whatever the run (at most this many batches' packed
values, a few MB; adding them in takes a few milliseconds)."""


def _fold_into(
    values: NDArray[Any],
    bounds: tuple[float, ...],
    slots: NDArray[Any],
    own: NDArray[Any],
    keys: NDArray[Any],
    job_of: Callable[[int], Histogram],
    hist_of: Callable[[int, int], Histogram],
) -> None:
    """Add ``values`` to the job's histogram of each key (``job_of``) and, where
    ``own``, to its rank's (``hist_of(slot, key)``): the bucket search and the counts
    in numpy, then one update per histogram, not per value. Each total adds its
    values in order."""
    import numpy as np

    width = len(bounds) + 1
    cells = np.searchsorted(np.array(bounds), values, side="left")
    nkeys = int(keys.max(initial=0)) + 1
    counts = np.bincount(keys * width + cells, minlength=nkeys * width).reshape(nkeys, width)
    sums = np.bincount(keys, weights=values, minlength=nkeys)
    for k in np.flatnonzero(counts.sum(axis=1)).tolist():
        _add(job_of(k), counts[k], float(sums[k]))
    if not own.any():
        return
    values, slots, keys, cells = values[own], slots[own], keys[own], cells[own]
    found, inverse = np.unique(slots * nkeys + keys, return_inverse=True)
    counts = np.bincount(inverse * width + cells, minlength=len(found) * width)
    counts = counts.reshape(len(found), width)
    sums = np.bincount(inverse, weights=values, minlength=len(found))
    for g, (slot, key) in enumerate(
        zip((found // nkeys).tolist(), (found % nkeys).tolist(), strict=True)
    ):
        _add(hist_of(slot, key), counts[g], float(sums[g]))


def _add(hist: Histogram, counts: NDArray[Any], total: float) -> None:
    """Bucket counts and their values' sum added to ``hist`` (in place: the state's
    lookups hold it)."""
    added = counts.tolist()
    hist.counts[:] = [a + b for a, b in zip(hist.counts, added, strict=True)]
    hist.total += total
    hist.n += sum(added)


class LiveState:
    """The run as the aggregator sees it now; thread-safe (one lock, short holds).

    The feed thread calls the ``add_*`` methods; readers take copies with
    :meth:`ranks`, :meth:`nodes` and :meth:`recent_columns`.
    """

    def __init__(self, rank_histograms_max_ranks: int = MAX_RANKS) -> None:
        self._lock = threading.Lock()
        self.rank_histograms_max_ranks = rank_histograms_max_ranks
        """The most ranks a run may have for each rank's own histograms to be kept (the
        metrics' ``rank_series_max_ranks``): past it no reader serves them, so the feed
        keeps only the job's (the run's ranks never go down)."""
        self._rank_hists = True
        """Whether the run is still within ``rank_histograms_max_ranks``."""
        self._ranks: dict[int, RankLive] = {}
        self._order: tuple[list[RankLive], list[int]] | None = None
        """The ranks in rank order and their slots, made again when a rank is added."""
        self._nodes: dict[int, NodeLive] = {}
        self._fold = UserPhaseFold()
        self._labels: dict[str, str | None] = {}
        self.scan_labels: dict[str, tuple[str, int] | None] = {}
        """``_labels`` with each label's id, as the step_time scan takes it
        (``_feedscan_py.LabelMap``; a label past ``MAX_LABELS`` ids is left out, so a
        batch naming it is read the reference way)."""
        self._label_ids: dict[str, int] = {}
        self._label_names: list[str] = []
        """Label id -> label (``_label_ids`` the other way)."""
        self._pending: list[tuple[RankLive, bool, bytes, bytes, bytes]] = []
        """Scanned batches whose values the histograms have not taken yet: (rank,
        whether its own histograms take them, step times, phase times, label ids)."""
        self._pending_values = 0
        self._peaks_dirty: dict[int, RankLive] = {}
        """slot -> the rank whose ``peak_memory`` its ``_peak_table`` row does not show yet."""
        self._wait_keys: dict[tuple[str, str], tuple[str, str]] = {}
        self._line_keys: dict[tuple[str, str, str | None], tuple[str, str]] = {}
        """A collectives line's (phase, op, group) -> its wait key (``_NO_KEY``: none)."""
        self._job_step = Histogram.empty(STEP_BUCKETS_S)
        self._job_phases: dict[str, Histogram] = {}
        """Every rank's step and phase times, kept as the steps arrive (the sum of the
        ranks' own histograms): a scrape copies these, not a merge of every rank's."""
        self._recent_ms: NDArray[Any] = _empty_rows(64)
        self._process_table: NDArray[Any] = _nan_table(64, len(PROCESS_COLUMNS))
        """Row ``RankLive.slot``: that rank's ``process`` figures of
        :data:`PROCESS_COLUMNS` (NaN: not reported)..."""
        self._system_table: NDArray[Any] = _nan_table(16, len(SYSTEM_COLUMNS))
        """Row ``NodeLive.slot``: that node's system figures of :data:`SYSTEM_COLUMNS`
        (NaN: not reported)..."""
        self._gpu_table: NDArray[Any] = _nan_table(16, MAX_GPUS, len(GPU_COLUMNS))
        """...and its GPUs' figures of :data:`GPU_COLUMNS` (a row per GPU, NaN after
        the last): the distributions across nodes and GPUs read columns."""
        self._peak_table: NDArray[Any] = _nan_table(64, MAX_DEVICES, 2)
        """...and its devices' (peak allocated, peak reserved) bytes, in ``peak_memory``'s
        order: a distribution across 10,240 ranks is a column, not 10,240 dict reads."""
        """Row ``RankLive.slot``: the step times of that rank's ``recent`` steps, in a
        ring (step ``k`` of the rank at ``(k - 1) % WINDOW_STEPS``; unused cells +inf):
        a scrape's medians copy one array and sort it in numpy, not a list per rank."""
        """(component, operation) -> the one key object of it the waits use."""
        """event name -> its label (None: a reserved name this release does not write)."""
        self.world_size: int | None = None
        self.started_unix_s = time.time()
        self.ignored_items = 0
        """Items left out because they were malformed or claimed an impossible rank."""
        self.folded_phase_names: set[str] = set()
        """User phase names counted as ``other`` (bounded: only the first few are kept)."""
        self.straggler: StragglerView | None = None
        """The latest straggler view (``analysis._straggler.analyze``), when computed."""
        self._tracker_runs: dict[str, tuple[int, dict[str, str]]] = {}
        """tracker -> (rank, its fields): the run the lowest rank that told one has open."""
        self.tracker_runs_told = False
        """Whether rank 0 told its tracker runs (it does once after its first step, even
        with none): a tracker then knows whether to join the script's run."""

    # -- writing (the feed thread) --------------------------------------------------

    def _rank(self, identity: Mapping[str, Any]) -> RankLive | None:
        return self._rank_of(
            identity.get("global_rank"), identity.get("node_rank"), identity.get("world_size")
        )

    def _rank_of(self, rank: object, node: object, world: object) -> RankLive | None:
        """The rank's state (made when new) from its identity's three fields; None for
        a rank the state does not track."""
        if type(rank) is not int or not 0 <= rank < MAX_RANKS:
            return None
        if (
            type(world) is int
            and rank < world <= MAX_RANKS
            and (self.world_size is None or world > self.world_size)
        ):
            self.world_size = world
        live = self._ranks.get(rank)
        if live is None:
            slot = len(self._ranks)
            if slot == len(self._recent_ms):
                self._recent_ms = _grown(self._recent_ms, math.inf)
                self._process_table = _grown(self._process_table, math.nan)
                self._peak_table = _grown(self._peak_table, math.nan)
            live = self._ranks[rank] = RankLive(rank, slot=slot)
        if self._rank_hists and (
            max(self.world_size or 0, len(self._ranks)) > self.rank_histograms_max_ranks
        ):
            self._rank_hists = False
        if type(node) is int and 0 <= node < MAX_RANKS:
            live.node = node
        return live

    def _phase_label(self, event: str) -> str | None:
        """An event's label: the summary's name, folded by the one rule
        (:class:`~traceml_ai.analysis.UserPhaseFold`); None for no phase."""
        name = phase_name(event) if event else None
        if name is None:
            return None
        label = self._fold(name)
        if label == OTHER_PHASE and len(self.folded_phase_names) < 64:
            self.folded_phase_names.add(event)
        return label

    def add_steps(self, identity: Mapping[str, Any], items: Sequence[Any]) -> list[StepSeen]:
        """Take a step_time batch's items; returns the steps taken (for the traces)."""
        seen: list[StepSeen] = []
        with self._lock:
            live = self._rank(identity)
            if live is None:
                self.ignored_items += len(items)
                return seen
            for item in items:
                step_seen = self._step(live, item)
                if step_seen is None:
                    self.ignored_items += 1
                else:
                    seen.append(step_seen)
            if len(self._labels) != len(self.scan_labels):
                self._relabel()
        return seen

    def _relabel(self) -> None:
        """``scan_labels`` made again from ``_labels`` (names only ever get added)."""
        ids = self._label_ids
        out: dict[str, tuple[str, int] | None] = {}
        for event, label in self._labels.items():
            if label is None:
                out[event] = None
                continue
            label_id = ids.get(label)
            if label_id is None:
                label_id = ids[label] = len(ids)
                self._label_names.append(label)
            if label_id < MAX_LABELS:
                out[event] = (label, label_id)
        self.scan_labels = out

    def add_scan(self, scan: StepScan | tuple[Any, ...]) -> list[StepSeen]:
        """Take a step_time batch read by the scan (``_feedscan``): what
        :meth:`add_steps` does with the same batch decoded."""
        rank, node, world, ignored, steps, ends, step_ms, phases, tokens, top = scan[:10]
        with self._lock:
            live = self._rank_of(rank, node, world)
            if live is None:
                self.ignored_items += ignored + len(steps)
                return []
            self.ignored_items += ignored
            if not steps:
                return []
            seen = list(
                map(
                    _new_tuple,
                    repeat(StepSeen),
                    zip(repeat(live.rank), repeat(live.node), steps, ends, step_ms, phases),
                )
            )
            first = live.steps
            live.steps += len(steps)
            if steps[top] >= live.last_step:
                live.last_step = steps[top]
                live.last_end_ns = ends[top]
            for step, count in tokens:
                live.tokens[step] = count
                if len(live.tokens) > 2 * WINDOW_STEPS:
                    del live.tokens[next(iter(live.tokens))]
            live.recent.extend(seen)
            row = self._recent_ms[live.slot]
            for i, ms in enumerate(
                step_ms[-WINDOW_STEPS:], first + max(len(steps) - WINDOW_STEPS, 0)
            ):
                row[i % WINDOW_STEPS] = ms
            mask = scan[13]
            if mask & ~live.label_mask:
                # A label new to this rank: its histograms made in the order the
                # labels appear, as the reference path makes them.
                pairs = live.phase_pairs
                for row in phases:
                    for label in row:
                        if label not in pairs:
                            pairs[label] = self._phase_pair(live, label)
                live.label_mask |= mask
            # The histograms take the batch's values later, in bulk (_fold).
            self._pending.append((live, self._rank_hists, scan[10], scan[11], scan[12]))
            self._pending_values += len(steps) + (len(scan[12]) >> 2)
            if self._pending_values > PENDING_VALUES:
                self._fold_pending()
        return seen

    def _fold_pending(self) -> None:
        """The values of the scanned batches not yet in the histograms added to them in
        bulk (numpy: a bucket search and a count per histogram, not a Python step per
        value); under the lock, before any histogram is read."""
        pending = self._pending
        if not pending:
            return
        import numpy as np

        self._pending = []
        self._pending_values = 0
        by_slot = {p[0].slot: p[0] for p in pending}
        slots = np.array([p[0].slot for p in pending], dtype=np.intp)
        own = np.array([p[1] for p in pending], dtype=bool)
        step_packed = [p[2] for p in pending]
        ids_packed = [p[4] for p in pending]
        step_n = np.array([len(b) >> 3 for b in step_packed], dtype=np.intp)
        phase_n = np.array([len(b) >> 2 for b in ids_packed], dtype=np.intp)
        values = np.frombuffer(b"".join(step_packed), dtype=np.float64) / 1000.0
        _fold_into(
            values,
            STEP_BUCKETS_S,
            np.repeat(slots, step_n),
            np.repeat(own, step_n),
            np.zeros(len(values), dtype=np.intp),
            lambda k: self._job_step,
            lambda slot, k: by_slot[slot].step_hist,
        )
        if phase_n.any():
            values = np.frombuffer(b"".join(p[3] for p in pending), dtype=np.float64) / 1000.0
            names = self._label_names
            _fold_into(
                values,
                PHASE_BUCKETS_S,
                np.repeat(slots, phase_n),
                np.repeat(own, phase_n),
                np.frombuffer(b"".join(ids_packed), dtype=np.int32).astype(np.intp),
                lambda k: self._job_phases[names[k]],
                lambda slot, k: by_slot[slot].phase_pairs[names[k]][0],
            )

    def _step(self, live: RankLive, item: Any) -> StepSeen | None:
        if type(item) is not dict:
            return None
        step = item.get("step")
        end_ns = item.get("timestamp_unix_ns")
        events = item.get("events")
        if type(step) is not int or step < 1 or type(end_ns) is not int or end_ns < 0:
            return None
        if type(events) is not dict:
            return None
        row = step_row(events, self._phase_label, self._labels)
        if row is None:
            return None
        step_ms = row.step_ms
        phases = row.phases  # the phases' names, folded: user phases past the limit are "other"
        live.steps += 1
        if step >= live.last_step:
            live.last_step = step
            live.last_end_ns = end_ns
        # Histogram.observe_twice written out: one bucket search per value for the
        # rank's histogram and the job's, without a call per phase (every step of
        # every rank passes here).
        value = step_ms / 1000.0
        index = _bucket(STEP_BUCKETS_S, value)
        # Past rank_histograms_max_ranks only the job's: no reader serves the rank's.
        both = self._rank_hists
        hist, job = live.step_hist, self._job_step
        if both:
            hist.counts[index] += 1
            hist.total += value
            hist.n += 1
        job.counts[index] += 1
        job.total += value
        job.n += 1
        pairs = live.phase_pairs
        for label, ms in phases.items():
            pair = pairs.get(label)
            if pair is None:
                pair = pairs[label] = self._phase_pair(live, label)
            hist, job = pair
            value = ms / 1000.0
            index = _bucket(PHASE_BUCKETS_S, value)
            if both:
                hist.counts[index] += 1
                hist.total += value
                hist.n += 1
            job.counts[index] += 1
            job.total += value
            job.n += 1
        seen = StepSeen(live.rank, live.node, step, end_ns, step_ms, phases)
        tokens = item.get("tokens")
        if type(tokens) is int and tokens >= 0:
            live.tokens[step] = float(tokens)
            if len(live.tokens) > 2 * WINDOW_STEPS:
                del live.tokens[next(iter(live.tokens))]
        live.recent.append(seen)
        self._recent_ms[live.slot, (live.steps - 1) % WINDOW_STEPS] = step_ms
        return seen

    def _phase_pair(self, live: RankLive, label: str) -> tuple[Histogram, Histogram]:
        """The rank's histogram of phase ``label`` and the job's (made when new)."""
        hist = live.phase_hist.get(label)
        if hist is None:
            hist = live.phase_hist[label] = Histogram.empty(PHASE_BUCKETS_S)
        job = self._job_phases.get(label)
        if job is None:
            job = self._job_phases[label] = Histogram.empty(PHASE_BUCKETS_S)
        return hist, job

    def add_memory(self, identity: Mapping[str, Any], items: Iterable[Any]) -> None:
        rows = [tuple(map(i.get, MEMORY_KEYS)) if type(i) is dict else None for i in items]
        self.add_memory_rows(
            identity.get("global_rank"), identity.get("node_rank"), identity.get("world_size"), rows
        )

    def add_memory_rows(
        self, rank: object, node: object, world: object, rows: Iterable[tuple[Any, ...] | None]
    ) -> None:
        """A step_memory batch: its identity's three fields and each item's values of
        :data:`MEMORY_KEYS` (None: an item that is not an object)."""
        with self._lock:
            live = self._rank_of(rank, node, world)
            if live is None:
                return
            # A new dict, never one a reader holds changed: the scrape shares it.
            peaks = dict(live.peak_memory)
            for row in rows:
                if row is None or type(row[0]) is not str:
                    self.ignored_items += 1
                    continue
                device = row[0][:32]
                if device not in peaks and len(peaks) >= MAX_DEVICES:
                    continue
                peaks[device] = (_number(row[1]), _number(row[2]))
            live.peak_memory = peaks
            # Its table row is written when read (_write_peaks): once a read, not once
            # a batch (a rank sends one every flush).
            self._peaks_dirty[live.slot] = live

    def _write_peaks(self) -> None:
        """The peak table rows of the ranks whose peaks changed since the last read."""
        nan = math.nan
        table = self._peak_table
        for slot, live in self._peaks_dirty.items():
            peaks = live.peak_memory
            if peaks:
                # Devices are only ever added, in order: the rows after them stay NaN.
                table[slot, : len(peaks)] = [
                    (nan if a is None else a, nan if r is None else r) for a, r in peaks.values()
                ]
        self._peaks_dirty.clear()

    def add_process(self, identity: Mapping[str, Any], items: Sequence[Any]) -> None:
        with self._lock:
            live = self._rank(identity)
            if live is None or not items:
                return
            item = items[-1]
            if type(item) is not dict:
                self.ignored_items += 1
                return
            figures = {k: v for k in _PROCESS_FIELDS if (v := _number(item.get(k))) is not None}
            cores = _count(item.get("cpu_logical_cores"))
            if "cpu_percent" in figures and cores:
                # As the sampler clamps: a process cannot use more than every core.
                figures["cpu_percent"] = min(figures["cpu_percent"], 100.0 * cores)
            live.process = figures
            nan = math.nan
            self._process_table[live.slot] = [figures.get(k, nan) for k in PROCESS_COLUMNS]

    def add_system(self, identity: Mapping[str, Any], items: Sequence[Any]) -> None:
        node = identity.get("node_rank")
        if type(node) is not int or not 0 <= node < MAX_RANKS or not items:
            return
        item = items[-1]
        if type(item) is not dict:
            return
        with self._lock:
            live = self._nodes.get(node)
            if live is None:
                slot = len(self._nodes)
                if slot == len(self._system_table):
                    self._system_table = _grown(self._system_table, math.nan)
                    self._gpu_table = _grown(self._gpu_table, math.nan)
                live = self._nodes[node] = NodeLive(node, slot=slot)
            live.system = {k: v for k in _SYSTEM_FIELDS if (v := _number(item.get(k))) is not None}
            gpus: dict[int, dict[str, float]] = {}
            entries = item.get("gpus")
            if type(entries) is list:
                for gpu in entries[:MAX_GPUS]:
                    if type(gpu) is not dict:
                        continue
                    index = _count(gpu.get("gpu_index"))
                    if index is None:
                        continue
                    figures = {k: v for k in _GPU_FIELDS if (v := _number(gpu.get(k))) is not None}
                    temperature = gpu.get("temperature_c")
                    if (
                        isinstance(temperature, (int, float))
                        and type(temperature) is not bool
                        and math.isfinite(temperature)
                    ):
                        figures["temperature_c"] = float(temperature)
                    gpus[index] = figures
            live.gpus = gpus
            nan = math.nan
            self._system_table[live.slot] = [live.system.get(k, nan) for k in SYSTEM_COLUMNS]
            table = self._gpu_table[live.slot]
            table.fill(nan)
            if gpus:
                table[: len(gpus)] = [[g.get(k, nan) for k in GPU_COLUMNS] for g in gpus.values()]

    def add_environment(self, identity: Mapping[str, Any], items: Sequence[Any]) -> None:
        with self._lock:
            live = self._rank(identity)
            if live is None or not items or type(items[-1]) is not dict:
                return
            strategy = items[-1].get("training_strategy")
            if type(strategy) is str and len(strategy) <= 64:
                live.strategy = strategy
            parallel = items[-1].get("parallel")
            if parallel is None or (type(parallel) is dict and len(parallel) <= MAX_DIMS):
                live.parallel = layout_of(parallel)

    def note_tracker_runs(
        self, identity: Mapping[str, Any], runs: Mapping[str, Mapping[str, str]]
    ) -> None:
        """A rank's ``tracker_runs`` message (checked by the wire): each tracker's run,
        kept from the lowest rank that told one (rank 0 in practice). A run stays once
        told: the script ending it does not take TraceML's last figures out of it."""
        rank = identity.get("global_rank")
        if type(rank) is not int or not 0 <= rank < MAX_RANKS:
            return
        with self._lock:
            if rank == 0:
                self.tracker_runs_told = True
            for name, fields in runs.items():
                known = self._tracker_runs.get(name)
                if known is None or rank <= known[0]:
                    self._tracker_runs[name] = (rank, dict(fields))

    def tracker_run(self, name: str) -> dict[str, str] | None:
        """The run of tracker ``name`` the training script has open, if it told one."""
        with self._lock:
            known = self._tracker_runs.get(name)
        return dict(known[1]) if known is not None else None

    def add_collectives(self, identity: Mapping[str, Any], items: Sequence[Any]) -> None:
        """A batch of ``collectives`` items: each step's wait per component and op."""
        rows = [tuple(map(i.get, COLLECTIVE_KEYS)) if type(i) is dict else None for i in items]
        self.add_collective_rows(
            identity.get("global_rank"), identity.get("node_rank"), identity.get("world_size"), rows
        )

    def add_collective_rows(
        self, rank: object, node: object, world: object, rows: Sequence[tuple[Any, ...] | None]
    ) -> None:
        """A collectives batch: its identity's three fields and each item's values of
        :data:`COLLECTIVE_KEYS` (None: an item that is not an object)."""
        with self._lock:
            live = self._rank_of(rank, node, world)
            if live is None:
                self.ignored_items += len(rows)
                return
            waits, op_waits = live.waits, live.op_waits
            line_keys = self._line_keys
            for row in rows:
                if row is None:
                    self.ignored_items += 1
                    continue
                step, phase, op, wait, group = row
                if (
                    type(step) is not int
                    or step < 1
                    or type(phase) is not str
                    or type(op) is not str
                ):
                    self.ignored_items += 1
                    continue
                if wait is None:
                    live.waits_unmeasured = True
                    if step not in waits:
                        waits[step], op_waits[step] = {}, {}
                    continue
                ms = _number(wait)
                if ms is None or ms < 0.0:
                    self.ignored_items += 1
                    continue
                # The (component, operation) key of a line's (phase, op, group), looked
                # up once: the collectives of every step of every rank pass here.
                # (A group of another type names no group: op_label leaves it out.)
                line = (phase, op, group if type(group) is str else None)
                key = line_keys.get(line)
                if key is None:
                    key = self._wait_key(phase, op, group)
                    if len(line_keys) < _MAX_WAIT_KEY_OBJECTS:
                        line_keys[line] = key
                by_component = waits.get(step)
                if by_component is None:
                    by_component = waits[step] = {}
                    by_op = op_waits[step] = {}
                else:
                    by_op = op_waits[step]
                if key is _NO_KEY or len(by_component) + len(by_op) >= MAX_WAIT_KEYS:
                    self.ignored_items += 1
                    continue
                add_wait(by_component, by_op, key, ms)
            while len(waits) > 2 * WINDOW_STEPS:
                oldest = next(iter(waits))
                del waits[oldest]
                op_waits.pop(oldest, None)

    def _wait_key(self, phase: str, op: str, group: object) -> tuple[str, str]:
        """The (component, operation) key of a collectives line (``_NO_KEY``: a reserved
        phase this release does not know); one key object per pair."""
        # A user phase folds as its step_time label does (``other`` past the bound), so
        # a wait lands on the component the rows have.
        component = (
            wait_component(phase) if phase.startswith(_RESERVED) else self._phase_label(phase)
        )
        if component is None:
            return _NO_KEY
        label = op_label(op, group)
        keys = self._wait_keys
        key = keys.get((component, label))
        if key is None:
            key = (component, label)
            if len(keys) < _MAX_WAIT_KEY_OBJECTS:
                keys[key] = key
        return key

    def collectives_measured(self) -> bool:
        """Whether every rank's collectives were measured (``waits_measured``)."""
        with self._lock:
            ranks = list(self._ranks.values())
        return waits_measured(
            [r.rank for r in ranks],
            {r.rank for r in ranks if r.waits},
            {r.rank for r in ranks if r.waits_unmeasured},
        )

    def held_rows(self) -> dict[int, int]:
        """rank -> the rows of steps the state holds for it now (recent steps, tokens,
        waits per component and per operation): at most :data:`HELD_ROWS_PER_RANK`."""
        with self._lock:
            return {
                rank: len(r.recent) + len(r.tokens) + len(r.waits) + len(r.op_waits)
                for rank, r in self._ranks.items()
            }

    def set_straggler(self, view: StragglerView | None) -> None:
        with self._lock:
            self.straggler = view

    # -- reading --------------------------------------------------------------------

    def ranks(self) -> list[RankLive]:
        """A copy of every rank's figures (histograms copied; ``recent`` left empty)."""
        with self._lock:
            self._fold_pending()
            return [
                RankLive(
                    rank=r.rank,
                    node=r.node,
                    steps=r.steps,
                    last_step=r.last_step,
                    last_end_ns=r.last_end_ns,
                    step_hist=r.step_hist.copy(),
                    phase_hist={k: h.copy() for k, h in r.phase_hist.items()},
                    peak_memory=dict(r.peak_memory),
                    process=dict(r.process),
                    strategy=r.strategy,
                )
                for _, r in sorted(self._ranks.items())
            ]

    def metric_figures(self, rank_histograms_max_ranks: int) -> MetricFigures:
        """The figures the metrics serve: each rank's gauges, the job's histograms, and
        each rank's own histograms while the run has at most
        ``rank_histograms_max_ranks`` ranks (and at most the state's own
        ``rank_histograms_max_ranks``, past which it keeps none). Only copies are made
        under the lock."""
        with self._lock:
            self._fold_pending()
            order = self._order
            if order is None or len(order[0]) != len(self._ranks):
                live = [r for _, r in sorted(self._ranks.items())]
                order = self._order = (live, [r.slot for r in live])
            live, slots = order
            rank_count = max(self.world_size or 0, len(live))
            # The ranks' own histograms are complete only within the state's bound.
            detail = rank_count <= min(rank_histograms_max_ranks, self.rank_histograms_max_ranks)
            job_step = self._job_step.copy()
            job_phases = {label: h.copy() for label, h in sorted(self._job_phases.items())}
            recent_ms = self._recent_ms[slots]  # copies
            process_table = self._process_table[slots]
            if self._peaks_dirty:
                self._write_peaks()
            peak_table = self._peak_table[slots]
            # One pass over the ranks, then transposed: a tuple of scalars and of the
            # dicts the state replaces whole (never changes in place) per rank.
            columns = list(zip(*map(_FIGURES, live), strict=True)) or [()] * 7
            step_hist = [r.step_hist.copy() for r in live] if detail else None
            phase_hist = (
                [{k: h.copy() for k, h in r.phase_hist.items()} for r in live] if detail else None
            )
        rank, node, steps, last_step, last_end_ns, peak_memory, process = map(list, columns)
        # The medians outside the lock: the feed thread waits only for the copies.
        medians = _medians(recent_ms, [min(n, WINDOW_STEPS) for n in steps])
        return MetricFigures(
            rank, node, steps, last_step, last_end_ns, medians, peak_memory, process,
            step_hist, phase_hist, process_table, peak_table, rank_count, detail, job_step,
            job_phases,
        )  # fmt: skip

    def nodes(self) -> list[NodeLive]:
        """A copy of every node's latest system sample."""
        with self._lock:
            return [
                NodeLive(n.node, dict(n.system), {i: dict(g) for i, g in n.gpus.items()})
                for _, n in sorted(self._nodes.items())
            ]

    def node_figures(self) -> list[NodeLive]:
        """Every node's latest system sample, sharing the state's dicts (read only: the
        state replaces them whole): what a scrape reads, without a copy per GPU."""
        with self._lock:
            return [NodeLive(n.node, n.system, n.gpus) for _, n in sorted(self._nodes.items())]

    def node_tables(self) -> tuple[NDArray[Any], NDArray[Any]]:
        """Copies of every node's latest system figures (nodes x :data:`SYSTEM_COLUMNS`)
        and its GPUs' (nodes x :data:`MAX_GPUS` x :data:`GPU_COLUMNS`); NaN where none
        was reported. Rows in no particular order: for the distributions."""
        with self._lock:
            n = len(self._nodes)
            return self._system_table[:n].copy(), self._gpu_table[:n].copy()

    def recent_steps(self, last: int | None = None) -> dict[int, list[StepSeen]]:
        """rank -> its most recent steps, oldest first (at most ``last`` of each)."""
        with self._lock:
            out: dict[int, list[StepSeen]] = {}
            for rank, live in self._ranks.items():
                steps = list(live.recent)
                out[rank] = steps[-last:] if last else steps
            return out

    def last_steps(self) -> dict[int, int]:
        """rank -> the highest step it has reported, for every rank that reported one."""
        with self._lock:
            return {rank: live.last_step for rank, live in self._ranks.items() if live.steps}

    def steps_at(self, wanted: Sequence[int]) -> dict[int, list[StepSeen | None]]:
        """rank -> its recent step of each ``wanted`` step number (None: not among its
        recent steps). Looked up by position first (steps usually come in order), so
        the lock is held for a few lookups per rank, not a scan of the window."""
        out: dict[int, list[StepSeen | None]] = {}
        with self._lock:
            for rank, live in self._ranks.items():
                recent = live.recent
                found: list[StepSeen | None] = []
                for step in wanted:
                    index = len(recent) - 1 - (live.last_step - step)
                    hit = recent[index] if 0 <= index < len(recent) else None
                    if hit is None or hit.step != step:
                        hit = next((s for s in recent if s.step == step), None)
                    found.append(hit)
                out[rank] = found
        return out

    def peak_memory(self) -> tuple[float | None, float | None]:
        """The highest peak allocated and peak reserved bytes any rank's device reported
        at its last report (None: none reported)."""
        allocated: float | None = None
        reserved: float | None = None
        with self._lock:
            for live in self._ranks.values():
                for a, r in live.peak_memory.values():
                    if a is not None and (allocated is None or a > allocated):
                        allocated = a
                    if r is not None and (reserved is None or r > reserved):
                        reserved = r
        return allocated, reserved

    def layout(self) -> dict[int, Coordinates]:
        """rank -> its place in the parallel layout, for every rank that said one."""
        with self._lock:
            return {
                rank: live.parallel
                for rank, live in self._ranks.items()
                if live.parallel is not None
            }

    def rank_nodes(self) -> dict[int, int]:
        """rank -> node of every rank heard from."""
        with self._lock:
            return {rank: live.node for rank, live in self._ranks.items()}

    def strategy(self) -> str | None:
        """The strategy the ranks reported (the first rank's), when any did."""
        with self._lock:
            for _, live in sorted(self._ranks.items()):
                if live.strategy is not None:
                    return live.strategy
        return None

    def recent_columns(self, last: int | None = None) -> StepColumns:
        """The recent steps as the straggler analysis takes them: rank -> its steps'
        columns (the latest of a step number; a rank without steps has none)."""
        columns: StepColumns = {}
        with self._lock:
            waits = {
                rank: (dict(live.waits), dict(live.op_waits)) for rank, live in self._ranks.items()
            }
            tokens = {rank: dict(live.tokens) for rank, live in self._ranks.items()}
        for rank, steps in sorted(self.recent_steps(last).items()):
            if not steps:
                continue
            order = list(map(_STEP_OF, steps))
            # Steps come in order, each once, nearly always: then the window is its own
            # columns, read by C-level maps (the straggler analysis reads every rank's).
            if not all(map(operator.lt, order, order[1:])):
                by_step = {s.step: s for s in steps}
                order = sorted(by_step)
                steps = [by_step[step] for step in order]
            theirs, their_ops = waits.get(rank, ({}, {}))
            said = tokens.get(rank, {})
            columns[rank] = rank_columns_of(
                order,
                list(map(_MS_OF, steps)),
                list(map(_PHASES_OF, steps)),
                end_ns=list(map(float, map(_END_OF, steps))),
                tokens=list(map(said.get, order)),
                waits=list(map(theirs.get, order, repeat(_NO_WAITS))),
                op_waits=list(map(their_ops.get, order, repeat(_NO_OP_WAITS))),
            )
        return columns
