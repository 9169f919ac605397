"""The experiment trackers' sink: TraceML's figures in TensorBoard, MLflow or W&B
(docs/trackers.md).

One sink per tracker, each an exporter of its own sink worker
(:mod:`~traceml_ai.monitor._sink_worker`: a bounded queue of points and one thread),
so that a slow or failing tracker holds up nothing: the feed thread only notes the
highest step it saw (:meth:`TrackerSink.on_steps`), the sink's thread imports the
tracker's library, builds a point from the live state every ``tracker_every_steps``
steps (:meth:`TrackerSink.on_interval`) and writes it (:meth:`TrackerSink.export`).

**Which run.** The run is opened when the first point is due and rank 0 has told the
runs its script has open (it does after its first step; after :data:`JOIN_WAIT_S`
without its word the point is logged anyway): the script's run when rank 0 told one
(``LiveState.tracker_run``, from ``rank._runtime.tracker_runs``), else a run of TraceML's
own. Points wait in the worker's queue meanwhile (:data:`MAX_PENDING_POINTS`). A script's run told later
(training began after TraceML's first point) takes the points from then on; one
that cannot be joined leaves them in TraceML's own run, said in one line. A point
whose step came after the script ended its run (MLflow says when) waits for the run
the script opens next (:meth:`TrackerSink._run_for`), so that the ended run gets no
point of the steps after its end while rank 0's word of the next one is on its way.

**At the end** the last point is logged, then the run summary (read once from the
closed export files, :class:`EndSummary`) goes to each run as fields and an artifact
(:meth:`TrackerBackend.log_summary`), and TraceML's own run is ended (the script's
own run is the script's to end). A point is
logged at step S once every rank has reported S (or, with a rank far behind, with
the ranks that have: :meth:`TrackerSink.on_interval`); points that came due while the tracker was busy
are logged when it is free, as long as their steps are still in the live state's
window of recent steps, else skipped and counted (``points_skipped``); one the tracker refused
is counted (``points_failed``), and a tracker that could not be opened counts every
point it missed (``points_not_logged``): ``stats.json`` and
``finalization_warning.json`` carry them under the tracker's name. The first failure
of each kind is one ``traceml:`` line; training and the files never notice.

Each tracker is a :class:`TrackerBackend` behind :data:`BACKENDS`, its library
imported on the sink's thread (MLflow's import alone takes seconds), the library's
own loggers and warnings kept off the training terminal.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import operator
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import attrs
import orjson

from traceml_ai._limits import END_OF_RUN_SUMMARY_MAX_BYTES
from traceml_ai.analysis import percentile
from traceml_ai.analysis.in_process import slow_stage, summary_fields
from traceml_ai.monitor import tracker_metrics as tm
from traceml_ai.monitor._sink import extra_required
from traceml_ai.monitor._sink_worker import Outcome, SinkWorker
from traceml_ai.monitor._state import WINDOW_STEPS, LiveState, StepSeen
from traceml_ai.settings import TRACKER_NAMES

if TYPE_CHECKING:
    from traceml_ai.monitor._service import Monitoring
    from traceml_ai.monitor._sink import LiveSink, RunInfo

__all__ = [
    "BACKENDS",
    "Backend",
    "EndSummary",
    "TrackerBackend",
    "TrackerSink",
    "UserRun",
    "point_figures",
    "tracker_sink",
]

_log = logging.getLogger("traceml_ai.monitor")
_STEP = operator.attrgetter("step")

JOIN_WAIT_S = 5.0
"""How long a due point waits for rank 0 to tell its tracker runs before it goes to a
run of TraceML's own (rank 0 may not be traced, or its word lost)."""

LAGGARD_WAIT_S = 2.0
"""How long a point waits for ranks that have not reached its step (or reported at
all) once the leading rank has."""

STRAGGLER_MAX_AGE_S = 1.0
"""A straggler view this recent serves a point (the trackers' points at one step share
one analysis)."""

MAX_PENDING_POINTS = 1000
"""Points waiting to be logged (while no run is open yet, or the tracker is busy);
beyond it the newest are skipped (counted)."""

NEXT_RUN_POLL_S = 0.05
"""How often a point that waits for the script's next run looks for it."""

POLL_S = 1.0
"""How often the sink's thread looks for a due point when the feed has not woken it
(a rank that stopped leaves the others' point due by their lead)."""


UserRun = Mapping[str, str]
"""The run of one tracker the training script has open, as rank 0 told it
(``rank._runtime.tracker_runs``: an MLflow ``run_id`` and ``tracking_uri``, a W&B ``id``,
``project``, ``entity``, ``mode`` and ``dir``, a TensorBoard ``log_dir``)."""


class TrackerBackend(Protocol):
    """One open tracker run: the sink's thread is its only caller."""

    def log(self, figures: Mapping[str, float], step: int) -> None:
        """Write one point (``figures`` by :mod:`tracker_metrics` name) at ``step``;
        raises when the tracker refuses it."""

    def log_summary(self, fields: Mapping[str, float | str], summary_json: bytes) -> None:
        """At the end: the run summary's figures (by :data:`tracker_metrics.SUMMARY_FIELDS`
        name) as the run's summary fields, and ``summary_json`` (what ``traceml summary
        --json`` prints) as the file :data:`tracker_metrics.SUMMARY_ARTIFACT`."""

    def close(self) -> None:
        """Flush, and end the run if it is TraceML's own."""

    # Read with getattr, when a backend has them:
    # ``notice``: a line for the user about the run just opened (W&B put its files
    # elsewhere than asked), said once as it opens.
    # ``ended_ns()``: when the script ended its run (unix ns; None while it is open).
    # ``gone()``: whether the script's run no longer takes points (deleted), asked
    # after a point it refused.


@attrs.frozen
class Backend:
    """How one tracker is reached: the extra that brings its library, a module whose
    absence means the extra is missing, the library's loggers, the function that
    imports the library and the one that opens a run."""

    extra: str
    module: str
    library_loggers: tuple[str, ...]
    load: Callable[[], object]
    open: Callable[[RunInfo, UserRun | None], TrackerBackend]


# Each tracker's library and the parts of it its run needs, imported at the sink's
# start: opening a run (with the first point, mid-training) then costs the run itself,
# not seconds of lazy imports (W&B's and MLflow's take about as long as the run).


def _load_tensorboard() -> object:
    import tensorboard
    import tensorboard.compat.proto.event_pb2
    import tensorboard.plugins.text.metadata
    import tensorboard.summary.writer.event_file_writer

    return tensorboard


def _load_mlflow() -> object:
    import mlflow
    import mlflow.entities
    import mlflow.tracking

    return mlflow


def _load_wandb() -> object:
    import wandb
    import wandb.apis.public
    import wandb.sdk.artifacts.artifact
    import wandb.sdk.wandb_init
    import wandb.sdk.wandb_run

    return wandb


def _open_tensorboard(run: RunInfo, user: UserRun | None) -> TrackerBackend:
    from traceml_ai.monitor._tracker_tensorboard import open_tensorboard

    return open_tensorboard(run, user)


def _open_mlflow(run: RunInfo, user: UserRun | None) -> TrackerBackend:
    from traceml_ai.monitor._tracker_mlflow import open_mlflow

    return open_mlflow(run, user)


def _open_wandb(run: RunInfo, user: UserRun | None) -> TrackerBackend:
    from traceml_ai.monitor._tracker_wandb import open_wandb

    return open_wandb(run, user)


BACKENDS: Mapping[str, Backend] = {
    "tensorboard": Backend(
        "tensorboard", "tensorboard", ("tensorboard",), _load_tensorboard, _open_tensorboard
    ),
    "mlflow": Backend(
        "mlflow", "mlflow", ("mlflow", "alembic", "urllib3"), _load_mlflow, _open_mlflow
    ),
    "wandb": Backend("wandb", "wandb", ("wandb",), _load_wandb, _open_wandb),
}
"""Every tracker of ``settings.TRACKER_NAMES``, by name."""
assert tuple(BACKENDS) == TRACKER_NAMES


class EndSummary:
    """The run summary for the trackers, read once from the closed export files by
    the first sink that asks (each tracker's thread asks at the end)."""

    def __init__(self, run_dir: Path) -> None:
        self._run_dir = run_dir
        self._lock = threading.Lock()
        self._read = False
        self._value: tuple[dict[str, float | str], bytes] | None = None

    def get(self) -> tuple[dict[str, float | str], bytes] | None:
        """(fields, summary JSON), or None without JSONL export files (another
        exporter, or none) or above :data:`END_OF_RUN_SUMMARY_MAX_BYTES`; raises what the reader
        raised otherwise (each asker gets it)."""
        with self._lock:
            if not self._read:
                self._read = True
                self._value = self._summary()
            return self._value

    def _summary(self) -> tuple[dict[str, float | str], bytes] | None:
        from traceml_ai.analysis import SummaryError, export_folder_of, summarize_run

        try:
            export, _ = export_folder_of(self._run_dir)
            if sum(f.stat().st_size for f in export.glob("*.jsonl")) > END_OF_RUN_SUMMARY_MAX_BYTES:
                return None
            summary = summarize_run(self._run_dir)
        except SummaryError:
            return None
        fields = {  # the backends take numbers as floats
            k: v if isinstance(v, str) else float(v) for k, v in summary_fields(summary).items()
        }
        return fields, orjson.dumps(summary.to_json())


_END_SUMMARIES: weakref.WeakKeyDictionary[LiveState, EndSummary] = weakref.WeakKeyDictionary()
"""One :class:`EndSummary` per aggregator (by its live state), shared by its trackers."""


def tracker_sink(name: str) -> Callable[[Monitoring], LiveSink]:
    """The sink factory of tracker ``name``: refuses (one line naming the extra) when
    its library is not installed, else starts the sink, whose thread opens the run."""
    backend = BACKENDS[name]

    def start(monitoring: Monitoring) -> LiveSink:
        with extra_required(backend.extra):
            if importlib.util.find_spec(backend.module) is None:
                raise ModuleNotFoundError(name=backend.module)
        end_summary = _END_SUMMARIES.get(monitoring.state)
        if end_summary is None:
            end_summary = _END_SUMMARIES[monitoring.state] = EndSummary(monitoring.run.run_dir)
        sink = TrackerSink(
            name,
            backend,
            monitoring.state,
            monitoring.run,
            every=monitoring.settings.tracker_every_steps,
            report=monitoring.report,
            end_summary=end_summary,
            refresh_straggler=lambda: monitoring.feed.straggler_now(STRAGGLER_MAX_AGE_S),
        )
        sink.start()
        return sink

    return start


def _median(values: list[float]) -> float:
    values.sort()
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2.0


def point_figures(state: LiveState, step: int, previous: int | None) -> dict[str, float]:
    """The figures of the point at ``step`` (empty when no rank has it), throughput
    measured since step ``previous``."""
    wanted = [step] if previous is None else [step, previous]
    found = state.steps_at(wanted)
    at: dict[int, StepSeen] = {}
    rates: list[float] = []
    for rank, seen in found.items():
        now = seen[0]
        if now is None:
            continue
        at[rank] = now
        before = seen[1] if len(seen) > 1 else None
        if before is not None and now.end_ns > before.end_ns:
            rates.append((now.step - before.step) / ((now.end_ns - before.end_ns) / 1e9))
    if not at:
        return {}
    step_ms = sorted(s.step_ms for s in at.values())
    figures: dict[str, float] = {
        tm.STEP_TIME_MIN.name: step_ms[0],
        tm.STEP_TIME_MEDIAN.name: _median(list(step_ms)),
        tm.STEP_TIME_P90.name: percentile(step_ms, 90.0),
        tm.STEP_TIME_MAX.name: step_ms[-1],
        tm.RANKS.name: float(len(at)),
    }
    by_stage: dict[int, list[float]] = {}
    for rank, coordinates in state.layout().items():
        place = coordinates.get("pp")
        if place is not None and rank in at:
            by_stage.setdefault(place[0], []).append(at[rank].step_ms)
    if len(by_stage) > 1:
        for stage, values in sorted(by_stage.items())[: tm.MAX_STAGES]:
            figures[tm.STAGE_STEP_TIME_MS.format(stage=stage)] = _median(values)
    by_phase: dict[str, list[float]] = {}
    for s in at.values():
        for phase, ms in s.phases.items():
            by_phase.setdefault(phase, []).append(ms)
    for phase, values in sorted(by_phase.items()):
        figures[tm.PHASE_MS.format(phase=phase)] = _median(values)
    if rates:
        figures[tm.THROUGHPUT_STEPS_PER_S.name] = _median(rates)
    allocated, reserved = state.peak_memory()
    if allocated is not None:
        figures[tm.MEMORY_PEAK_ALLOCATED.name] = allocated
    if reserved is not None:
        figures[tm.MEMORY_PEAK_RESERVED.name] = reserved
    view = state.straggler
    named: list[int] = []
    if view is not None and view.applicable:
        ranked = sorted(view.stragglers, key=lambda s: -s.excess_ms)
        named = [s.rank for s in ranked]
        figures[tm.STRAGGLER_EXCESS_MS.name] = ranked[0].excess_ms if ranked else 0.0
        figures[tm.STRAGGLER_RANK.name] = float(ranked[0].rank) if ranked else -1.0
        figures[tm.SLOWDOWN.name] = view.slowdown.factor if view.slowdown else 1.0
        figures[tm.SLOW_STAGE.name] = float(slow_stage(view))
    chosen = [r for r in named if r in at][: tm.TRACKER_MAX_RANKS]
    for rank in sorted(at):
        if len(chosen) >= tm.TRACKER_MAX_RANKS:
            break
        if rank not in chosen:
            chosen.append(rank)
    for rank in chosen:
        figures[tm.RANK_STEP_TIME_MS.format(rank=rank)] = at[rank].step_ms
    return {k: v for k, v in figures.items() if math.isfinite(v)}


def _quiet(loggers: Sequence[str]) -> None:
    """Keep a tracker library's logging and warnings off the training terminal (the
    aggregator's stderr is the user's): its failures reach the user as our one line.
    Called once the library is imported (MLflow sets handlers of its own then)."""
    for name in loggers:
        logger = logging.getLogger(name)
        logger.handlers = [logging.NullHandler()]  # replaces a handler of the library's own
        logger.propagate = False
        warnings.filterwarnings("ignore", module=rf"{name}(\.|$)")


Point = tuple[int, dict[str, float], int | None]
"""A point: its step, its figures by :mod:`tracker_metrics` name, and when its step
ended (unix ns: rank 0's, else the earliest rank's; None when unknown)."""


class TrackerSink:
    """One tracker's sink (see the module's docstring): an exporter of the live views'
    one sink worker (:mod:`~traceml_ai.monitor._sink_worker`), whose interval work
    builds the points that came due and whose batches are points to log."""

    straggler_on_demand = True
    """It asks for the straggler view when it builds a point (``refresh_straggler``):
    with trackers only, the feed runs no analysis that nothing reads."""

    def __init__(
        self,
        name: str,
        backend: Backend,
        state: LiveState,
        run: RunInfo,
        *,
        every: int,
        report: Callable[[str], None],
        end_summary: EndSummary | None = None,
        refresh_straggler: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self._backend = backend
        self._state = state
        self._run = run
        self._every = every
        self._report = report
        self._seen_step = 0
        self._next_due = every
        self._logged: int | None = None
        self._end_summary = end_summary
        self._refresh_straggler = refresh_straggler
        self._tracker: TrackerBackend | None = None
        self._load_failed = False
        self._own_failed = False
        self._tried: UserRun | None = None
        """The script's run last tried (each is tried once)."""
        self._waited_on: TrackerBackend | None = None
        """The script's ended run whose next run was waited for (once per run)."""
        self._closing = False
        self._lead_step = 0
        self._lead_at = 0.0
        """When the leading rank was first seen at the next due step (the wait for the
        ranks behind it starts then)."""
        self._waiting_since: float | None = None
        self._said: set[str] = set()
        self.lost: dict[str, int] = {"points_skipped": 0}
        self.logged_points = 0
        self.worker: SinkWorker[Point] = SinkWorker(
            name,
            self,
            max_items=MAX_PENDING_POINTS,
            max_size=MAX_PENDING_POINTS,
            batch_size=1,
            interval_s=POLL_S,
            report_failure=lambda what: self._say("log", what),
        )

    def start(self) -> None:
        self.worker.start()

    # -- the feed thread -------------------------------------------------------------

    def on_steps(self, steps: Sequence[StepSeen]) -> None:
        """Note the highest step; wake the sink's thread when a point may be due."""
        high = max(map(_STEP, steps), default=0)
        if high > self._seen_step:
            self._seen_step = high
            if high >= self._next_due:
                self.worker.wake()

    # -- the exporter, on the worker's thread ------------------------------------------

    def _say(self, kind: str, line: str) -> None:
        """One line per tracker for the whole run (its first fault); what follows is
        counted, and the end of the run says the counts."""
        if not self._said:
            self._said.add(kind)
            self._report(f"traceml: {self.name}: {line}; training and the files go on")

    def begin(self) -> None:
        """Import the tracker's library (at start, not with the first point: MLflow's
        import alone takes seconds); its own handlers, set when imported, are replaced
        before any run is opened."""
        try:
            self._backend.load()
            _quiet(self._backend.library_loggers)
        except Exception as exc:
            self._load_failed = True
            _log.debug("tracker %s failed to load", self.name, exc_info=True)
            self._say("open", f"could not open a run ({type(exc).__name__}: {_short(exc)})")

    def _open(self, user: UserRun | None) -> TrackerBackend | None:
        try:
            tracker = self._backend.open(self._run, user)
            notice = getattr(tracker, "notice", None)
            if isinstance(notice, str) and notice:
                self._report(f"traceml: {self.name}: {notice}")
            return tracker
        except Exception as exc:
            _log.debug("tracker %s failed to open", self.name, exc_info=True)
            why = f"{type(exc).__name__}: {_short(exc)}"
            if user is None:
                self._say("open", f"could not open a run ({why})")
            else:
                self._say(
                    "join",
                    f"could not log into the run the training script has open ({why}); "
                    "its figures go to a run of TraceML's own",
                )
            return None

    def _ensure_open(self) -> None:
        """Log into the script's run once it is told (each told run tried once), else
        into a run of TraceML's own."""
        if self._load_failed:
            return
        user = self._state.tracker_run(self.name)
        if user is not None and user != self._tried:
            self._tried = user
            tracker = self._open(user)
            if tracker is not None:
                previous, self._tracker = self._tracker, tracker
                if previous is not None:
                    self._close(previous)
                return
        if self._tracker is None and not self._own_failed:
            self._tracker = self._open(None)
            self._own_failed = self._tracker is None

    def _close(self, tracker: TrackerBackend) -> None:
        try:
            tracker.close()
        except Exception as exc:
            self.lost["close_failed"] = 1
            self._say("close", f"closing its run failed ({type(exc).__name__}: {_short(exc)})")

    def _log_summary(self, tracker: TrackerBackend) -> None:
        if self._end_summary is None:
            return
        try:
            summary = self._end_summary.get()
            if summary is not None:
                tracker.log_summary(*summary)
        except Exception as exc:
            self.lost["summary_failed"] = 1
            _log.debug("tracker %s failed to log the summary", self.name, exc_info=True)
            self._say(
                "summary", f"the run summary was not logged ({type(exc).__name__}: {_short(exc)})"
            )

    def on_interval(self, final: bool) -> list[Point]:
        """The points due now: every multiple of ``every`` that all ranks have reached,
        or that the leading rank reached :data:`LAGGARD_WAIT_S` ago or passed by half
        the live state's window (a rank behind does not hold the others' points back:
        the point holds the ranks that have it), and at the end the step all ranks
        reached."""
        points: list[Point] = []
        last = self._state.last_steps()
        if not last:
            return points
        low, high = min(last.values()), max(last.values())
        world = self._state.world_size
        if not final and world is not None and len(last) < world:
            # A rank of the world that has not reported yet (it starts late, or its
            # first batch is on its way) is at step 0: the point waits for it as for
            # any rank behind.
            low = 0
        every = self._every
        reached = max(low, high - WINDOW_STEPS // 2)
        if reached < self._next_due <= high:
            now = time.monotonic()
            if self._lead_step != self._next_due:
                self._lead_step, self._lead_at = self._next_due, now
            elif now - self._lead_at >= LAGGARD_WAIT_S:
                reached = high
        while self._next_due <= reached:
            self._point(self._next_due, points)
            self._next_due += every
        if final and low > 0 and (self._logged is None or low > self._logged):
            self._point(low, points)  # the run's last figures, where they stand
        return points

    def _point(self, step: int, points: list[Point]) -> None:
        if self._refresh_straggler is not None:
            self._refresh_straggler()
        figures = point_figures(self._state, step, self._logged)
        if not figures:
            # Out of the live state's window of recent steps: the tracker was too slow.
            self.lost["points_skipped"] += 1
            return
        self._logged = step
        points.append((step, figures, self._ended_ns(step)))

    def _ended_ns(self, step: int) -> int | None:
        """When ``step`` ended: on rank 0 (whose script has the runs), else on the
        earliest rank that has it."""
        found = self._state.steps_at([step])
        zero = found.get(0, [None])[0]
        if zero is not None:
            return zero.end_ns
        ends = [seen[0].end_ns for seen in found.values() if seen[0] is not None]
        return min(ends, default=None)

    def ready(self, final: bool) -> bool:
        """Whether the waiting points may go to a run now (see the module's docstring)."""
        if final or self._tracker is not None or self._state.tracker_runs_told:
            return True
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        return now - self._waiting_since >= JOIN_WAIT_S

    def _run_for(self, ended_ns: int | None) -> TrackerBackend | None:
        """The run a point whose step ended at ``ended_ns`` goes to: the one
        :meth:`_ensure_open` chooses, unless the script ended that run before the
        step (a backend that can tell, ``ended_ns()``): then the run the script opens
        next, which rank 0 tells a sampling interval later; the point waits
        :data:`JOIN_WAIT_S` for it (once per ended run, never while closing), and
        stays in the ended run when none comes (a script that trains on after ending
        its run). A point of a step before the end stays in that run: HF ends its run
        after its last step, before TraceML's last point and the summary."""
        self._ensure_open()
        tracker = self._tracker
        ended = getattr(tracker, "ended_ns", None)
        if tracker is None or ended is None or ended_ns is None or self._closing:
            return tracker
        if tracker is self._waited_on:
            return tracker
        try:
            end = ended()
        except Exception:
            _log.debug("tracker %s: whether its run ended is unknown", self.name, exc_info=True)
            return tracker
        if not isinstance(end, int) or ended_ns <= end:
            return tracker
        deadline = time.monotonic() + JOIN_WAIT_S
        while not self._closing and time.monotonic() < deadline:
            told = self._state.tracker_run(self.name)
            if told is not None and told != self._tried:
                self._ensure_open()
                break
            time.sleep(NEXT_RUN_POLL_S)
        if self._tracker is tracker:
            self._waited_on = tracker
        return self._tracker

    def export(self, batch: Sequence[Point]) -> Outcome:
        """Log ``batch``, each point into the run :meth:`_run_for` chooses."""
        failed = 0
        why: str | None = None
        for step, figures, ended_ns in batch:
            tracker = self._run_for(ended_ns)
            if tracker is None:
                self.lost["points_not_logged"] = self.lost.get("points_not_logged", 0) + 1
                continue
            try:
                try:
                    tracker.log(figures, step)
                except Exception as exc:
                    own = self._instead_of_gone(tracker, exc)
                    if own is None:
                        raise
                    own.log(figures, step)
                self.logged_points += 1
            except Exception as exc:
                failed += 1
                _log.debug("tracker %s failed to log", self.name, exc_info=True)
                why = why or f"a point was not logged ({type(exc).__name__}: {_short(exc)})"
        return Outcome(failed, why)

    def _instead_of_gone(self, tracker: TrackerBackend, exc: Exception) -> TrackerBackend | None:
        """TraceML's own run, opened now, when ``tracker`` (the script's run) refused a
        point because it is gone (deleted while the script trains): one line, and the
        points from then on and the summary go there. None when the run is not gone
        (a refusal of another kind is counted as such)."""
        gone = getattr(tracker, "gone", None)
        if tracker is not self._tracker or gone is None:
            return None
        try:
            if not gone():
                return None
        except Exception:
            _log.debug("tracker %s: whether its run is gone is unknown", self.name, exc_info=True)
            return None
        self._say(
            "join",
            f"the run the training script has open is gone ({type(exc).__name__}: "
            f"{_short(exc)}); its figures go to a run of TraceML's own",
        )
        self._tracker = None
        self._ensure_open()  # the script's run was tried: TraceML's own opens
        return self._tracker

    def finish(self) -> None:
        """The run summary into the run, then the run ended (TraceML's own)."""
        tracker = self._tracker
        if tracker is not None:
            self._log_summary(tracker)
            self._close(tracker)

    def abort(self) -> None:
        """Nothing ends a tracker library's wait from outside: its thread is left behind."""

    # -- stopping --------------------------------------------------------------------

    def close(self, timeout_s: float) -> Mapping[str, int]:
        """Log the last point, end the run, within ``timeout_s``; what was lost."""
        self._closing = True  # no point waits for a next run any more
        counts = self.worker.close(timeout_s)
        lost = dict(self.lost)
        lost["points_skipped"] += counts.dropped
        lost["points_failed"] = counts.failed
        if counts.timed_out:
            lost["close_timed_out"] = 1
            # The points it would still have logged: the one it hangs on, those waiting,
            # and those due since (its thread hangs in the tracker, so they were never
            # counted).
            lost["points_not_logged"] = (
                lost.get("points_not_logged", 0) + counts.abandoned + self._not_yet_due()
            )
            self._say("close", f"still busy after {timeout_s:.1f} s; its last points are lost")
            self._said.add("closed")  # nothing more from its thread, whatever it does
        return {k: v for k, v in lost.items() if v}

    def _not_yet_due(self) -> int:
        """Points the sink's thread has not reached: each multiple of ``every`` from
        the next due one to the highest step, and the last step when it is none."""
        last = self._state.last_steps()
        if not last:
            return 0
        high, every = max(last.values()), self._every
        due = max(0, high // every - (self._next_due - 1) // every)
        return due + (1 if high % every and high >= self._next_due - every else 0)


def _short(exc: BaseException) -> str:
    """An exception's message on one line, bounded (a library may raise pages)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."
