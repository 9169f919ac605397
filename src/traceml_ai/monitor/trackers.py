"""The experiment trackers' sink: TraceML's figures in TensorBoard or MLflow
(docs/trackers.md).

One sink per tracker, each with its own thread, so that a slow or failing tracker
holds up nothing: the feed thread only notes the highest step it saw
(:meth:`TrackerSink.on_steps`), the sink's thread opens the tracker, builds a point
from the live state every ``tracker_every_steps`` steps and writes it. A point is
logged at step S once every rank has reported S (or, with a rank a whole interval
behind, with the ranks that have); points that came due while the tracker was busy
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
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs

from traceml_ai.monitor import tracker_metrics as tm
from traceml_ai.monitor._state import LiveState, StepSeen
from traceml_ai.settings import TRACKER_NAMES

if TYPE_CHECKING:
    from traceml_ai.monitor._service import LiveSink, Monitoring, RunInfo

__all__ = [
    "BACKENDS",
    "Backend",
    "TrackerBackend",
    "TrackerSink",
    "point_figures",
    "tracker_sink",
]

_log = logging.getLogger("traceml_ai.monitor")

POLL_S = 1.0
"""How often the sink's thread looks for a due point when the feed has not woken it
(a rank that stopped leaves the others' point due by their lead)."""


class TrackerBackend(Protocol):
    """One open tracker run: the sink's thread is its only caller."""

    def log(self, figures: Mapping[str, float], step: int) -> None:
        """Write one point (``figures`` by :mod:`tracker_metrics` name) at ``step``;
        raises when the tracker refuses it."""

    def close(self) -> None:
        """Flush and end the run."""


@attrs.frozen
class Backend:
    """How one tracker is reached: the extra that brings its library, a module whose
    absence means the extra is missing, the library's loggers, the function that
    imports the library and the one that opens a run."""

    extra: str
    module: str
    library_loggers: tuple[str, ...]
    load: Callable[[], object]
    open: Callable[[RunInfo], TrackerBackend]


def _load_tensorboard() -> object:
    import tensorboard

    return tensorboard


def _load_mlflow() -> object:
    import mlflow

    return mlflow


def _load_wandb() -> object:
    import wandb

    return wandb


def _open_tensorboard(run: RunInfo) -> TrackerBackend:
    from traceml_ai.monitor._tracker_tensorboard import open_tensorboard

    return open_tensorboard(run)


def _open_mlflow(run: RunInfo) -> TrackerBackend:
    from traceml_ai.monitor._tracker_mlflow import open_mlflow

    return open_mlflow(run)


def _open_wandb(run: RunInfo, user_run: Mapping[str, str] | None = None) -> TrackerBackend:
    from traceml_ai.monitor._tracker_wandb import open_wandb

    return open_wandb(run, user_run)


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


def tracker_sink(name: str) -> Callable[[Monitoring], LiveSink]:
    """The sink factory of tracker ``name``: refuses (one line naming the extra) when
    its library is not installed, else starts the sink, whose thread opens the run."""
    from traceml_ai.monitor._service import extra_required

    backend = BACKENDS[name]

    def start(monitoring: Monitoring) -> LiveSink:
        with extra_required(backend.extra):
            if importlib.util.find_spec(backend.module) is None:
                raise ImportError(name=backend.module)
        sink = TrackerSink(
            name,
            backend,
            monitoring.state,
            monitoring.run,
            every=monitoring.settings.tracker_every_steps,
            report=monitoring.report,
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
    step_ms = [s.step_ms for s in at.values()]
    figures: dict[str, float] = {
        tm.STEP_TIME_MEDIAN.name: _median(list(step_ms)),
        tm.STEP_TIME_MAX.name: max(step_ms),
        tm.RANKS.name: float(len(at)),
    }
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


class TrackerSink:
    """One tracker's sink (see the module's docstring)."""

    def __init__(
        self,
        name: str,
        backend: Backend,
        state: LiveState,
        run: RunInfo,
        *,
        every: int,
        report: Callable[[str], None],
    ) -> None:
        self.name = name
        self._backend = backend
        self._state = state
        self._run = run
        self._every = every
        self._report = report
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._seen_step = 0
        self._next_due = every
        self._logged: int | None = None
        self._tracker: TrackerBackend | None = None
        self._open_failed = False
        self._said: set[str] = set()
        self.lost: dict[str, int] = {"points_skipped": 0, "points_failed": 0}
        self.logged_points = 0
        self._thread = threading.Thread(
            target=self._run_thread, name=f"traceml-{name}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    # -- the feed thread -------------------------------------------------------------

    def on_steps(self, steps: Sequence[StepSeen]) -> None:
        """Note the highest step; wake the sink's thread when a point may be due."""
        high = max((s.step for s in steps), default=0)
        if high > self._seen_step:
            self._seen_step = high
            if high >= self._next_due:
                self._wake.set()

    # -- the sink's thread -----------------------------------------------------------

    def _say(self, kind: str, line: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            self._report(f"traceml: {self.name}: {line}; training and the files go on")

    def _open(self) -> None:
        try:
            # The library first, on its own: MLflow sets handlers of its own when
            # imported, which are replaced before the run is opened (its store logs).
            self._backend.load()
            _quiet(self._backend.library_loggers)
            self._tracker = self._backend.open(self._run)
        except Exception as exc:
            self._open_failed = True
            _log.debug("tracker %s failed to open", self.name, exc_info=True)
            self._say("open", f"could not open a run ({type(exc).__name__}: {_short(exc)})")

    def _log_due(self, final: bool) -> None:
        """Log each point that is due now: every multiple of ``every`` that all ranks
        have reached (or that the leading rank passed a whole interval ago), and at the
        end the step all ranks reached."""
        last = self._state.last_steps()
        if not last:
            return
        low, high = min(last.values()), max(last.values())
        every = self._every
        # A rank a whole interval behind does not hold the others' points back.
        reached = max(low, high - every)
        while self._next_due <= reached:
            self._log_point(self._next_due)
            self._next_due += every
        if final and low > 0 and (self._logged is None or low > self._logged):
            self._log_point(low)  # the run's last figures, where they stand

    def _log_point(self, step: int) -> None:
        figures = point_figures(self._state, step, self._logged)
        if not figures:
            # Out of the live state's window of recent steps: the tracker was too slow.
            self.lost["points_skipped"] += 1
            return
        self._logged = step
        if self._tracker is None:
            self.lost["points_not_logged"] = self.lost.get("points_not_logged", 0) + 1
            return
        try:
            self._tracker.log(figures, step)
        except Exception as exc:
            self.lost["points_failed"] += 1
            _log.debug("tracker %s failed to log", self.name, exc_info=True)
            self._say("log", f"a point was not logged ({type(exc).__name__}: {_short(exc)})")
            return
        self.logged_points += 1

    def _run_thread(self) -> None:
        try:
            self._open()
            while not self._stopping.is_set():
                self._wake.wait(POLL_S)
                self._wake.clear()
                if not self._stopping.is_set():
                    self._log_due(final=False)
            self._log_due(final=True)
            if self._tracker is not None:
                try:
                    self._tracker.close()
                except Exception as exc:
                    self.lost["close_failed"] = 1
                    self._say(
                        "close", f"closing its run failed ({type(exc).__name__}: {_short(exc)})"
                    )
        except Exception:  # a bug of ours: said once, never raised into the aggregator
            _log.exception("traceml: %s: the tracker sink failed", self.name)
            self.lost["sink_failed"] = 1

    def close(self, timeout_s: float) -> Mapping[str, int]:
        """Log the last point, end the run, within ``timeout_s``; what was lost."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout_s)
        lost = dict(self.lost)
        if self._thread.is_alive():
            lost["close_timed_out"] = 1
            self._say("close", f"still busy after {timeout_s:.1f} s; its last points are lost")
        return {k: v for k, v in lost.items() if v}


def _short(exc: BaseException) -> str:
    """An exception's message on one line, bounded (a library may raise pages)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."
