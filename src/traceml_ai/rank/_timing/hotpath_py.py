"""The pure-Python twin of ``hotpath.c``: the step timer's per-step and per-call
work, and what the C extension does the same.

``hotpath`` (C, its interface in ``hotpath.pyi``) defines ``TimerCore``, ``Slot`` and
``StepContext``; this module defines the same names in Python. The C ``TimerCore``
does the common case of each method without a Python frame and hands every other case
to the methods here, so these define the behaviour either way. ``timer_core`` is the
one place that chooses between the two (``TRACEML_PURE_PYTHON=1``: these alone);
tests/traceml_ai/rank/test_hotpath.py holds them to each other.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from traceml_ai.rank._timing.event_names import STEP_TIME
from traceml_ai.rank.gpu import CudaBackend, CudaEvent

# Event pairs one phase may collect outside a step (trace_phase in a loop no step
# follows); past this, the phase keeps host time only (gpu_ms null), so the
# events cannot pile up.
MAX_OUTSIDE_PAIRS = 256

_get_ident = threading.get_ident
_perf_ns = time.perf_counter_ns


class Phase:
    """One phase of one step: host time and CUDA event pairs summed over its calls."""

    __slots__ = ("cpu_ns", "missing", "n_calls", "pairs")

    def __init__(self) -> None:
        self.cpu_ns = 0
        self.n_calls = 0
        self.pairs: list[tuple[CudaEvent, CudaEvent]] = []
        self.missing = False


class Slot:
    """An in-flight hook-timed phase; ``depth`` keeps nested calls from counting twice."""

    __slots__ = ("auto", "depth", "ev0", "t0")

    def __init__(self) -> None:
        self.depth = 0
        self.t0 = 0
        self.ev0: CudaEvent | None = None
        # Whether its hooks time it (init's mode; see StepTimer.auto_forward).
        self.auto = True


class PendingStep:
    """A step on CUDA whose items wait for its CUDA events to complete."""

    __slots__ = ("acc", "device", "done", "step", "ts")

    def __init__(self, step: int, ts: int, device: str, acc: dict[str, Phase]) -> None:
        self.step = step
        self.ts = ts
        self.device = device
        self.acc = acc
        self.done = False


def device_of(tensor: Any) -> object:
    """The device a tensor is on, cheaply: ``get_device()`` (-1 on CPU, else the CUDA index)
    builds nothing, where ``tensor.device`` builds a new ``torch.device`` each time."""
    try:
        return tensor.get_device()
    except Exception:
        device = getattr(tensor, "device", None)
        return (getattr(device, "type", None), getattr(device, "index", None))


class TimerCore:
    """The step timer's per-step and per-call methods in Python, and what they define.

    ``begin``, ``end``, ``open``, ``close``, ``restart`` and ``add_host`` run in every
    traced step. With the C extension built, StepTimer's base is ``hotpath.TimerCore``
    over this class: it does their common case in C (a step off CUDA whose model stayed
    where it was, on the training thread, a phase the step already has, its numbers
    left to the sender's thread) and hands every other case to these methods, so this
    class is the behaviour either way.
    """

    # Set by StepTimer.__init__ (in C fields with the extension).
    enabled: bool
    in_step: bool
    thread: int
    cuda_index: int | None
    _acc: dict[str, Phase]
    _cuda: CudaBackend

    step: int
    device: str
    reset_peak: bool
    defer: bool
    wake_builder: Callable[[], None] | None
    fwd: Slot
    bwd: Slot
    opt: Slot
    h2d: Slot
    _t0: int
    _model_ref: Callable[[], object] | None
    _probe: Callable[[], object] | None
    _probe_at: object
    _pending: deque[PendingStep]
    _pending_lock: threading.Lock
    _ended: deque[dict[str, Phase]]
    _ended_at: deque[tuple[int, int, str]]
    _spare_acc: list[dict[str, Phase]]
    _max_ended: int
    _wake_at: int

    if TYPE_CHECKING:
        # StepTimer's, used here.
        def fail(self, exc: BaseException) -> None: ...
        def discard(self) -> None: ...
        def _adopt(self, model: object) -> None: ...
        def _locate(self, model: object) -> None: ...
        def _current_device(self) -> None: ...
        def build_ended(self) -> None: ...
        def _build_ended(self) -> None: ...
        def _send_host(self, step: int, ts: int, device: str, acc: dict[str, Phase]) -> None: ...
        def _put_memory(
            self, step: int, ts: int, device: str, peak_alloc: int | None, peak_reserved: int | None
        ) -> None: ...
        def _emit(self, pending: PendingStep) -> None: ...
        def _drain_ready(self) -> None: ...

    def _record(self) -> CudaEvent | None:
        index = self.cuda_index
        return None if index is None else self._cuda.record_event(index)

    def _add(self, name: str, dt_ns: int, ev0: CudaEvent | None, ev1: CudaEvent | None) -> None:
        phase = self._acc.get(name)
        if phase is None:
            phase = self._acc[name] = Phase()
        elif not phase.n_calls:
            # Reused from an earlier step (host-only then): this step's starts afresh.
            phase.missing = False
        phase.cpu_ns += dt_ns
        phase.n_calls += 1
        if ev0 is not None and ev1 is not None and not phase.missing:
            pairs = phase.pairs
            if len(pairs) < MAX_OUTSIDE_PAIRS or self.in_step:
                pairs.append((ev0, ev1))
                return
        # gpu_ms is null for the whole phase now; drop its events so they do
        # not pile up (trace_phase called outside steps with no step following).
        phase.missing = True
        phase.pairs = []

    def _add_host(self, name: str, dt_ns: int) -> None:
        """``_add(name, dt_ns, None, None)`` in fewer steps: a call without CUDA events
        (every call on CPU, the DataLoader wait, the step itself), on the hot path."""
        acc = self._acc
        phase = acc.get(name)
        if phase is None:
            phase = acc[name] = Phase()
            phase.missing = True
        elif not phase.missing:
            phase.missing = True
            phase.pairs = []
        phase.cpu_ns += dt_ns
        phase.n_calls += 1

    def open(self, slot: Slot) -> None:
        """Start a hook-timed phase (forward, backward, optimizer) inside a step."""
        if not self.in_step or _get_ident() != self.thread:
            return
        try:
            if slot.depth == 0:
                # _record() inlined: this runs for every hooked call of every step.
                index = self.cuda_index
                slot.ev0 = None if index is None else self._cuda.record_event(index)
                slot.t0 = _perf_ns()
            slot.depth += 1
        except Exception as exc:
            self.fail(exc)

    def close(self, slot: Slot, name: str) -> None:
        """End a hook-timed phase; only the outermost of nested calls is counted."""
        if slot.depth == 0 or _get_ident() != self.thread:
            return
        try:
            depth = slot.depth - 1
            slot.depth = depth
            if depth == 0:
                dt = _perf_ns() - slot.t0
                ev0 = slot.ev0
                if ev0 is None:
                    if self.in_step:
                        self._add_host(name, dt)
                    return
                ev1 = self._record()
                slot.ev0 = None
                if self.in_step:
                    self._add(name, dt, ev0, ev1)
        except Exception as exc:
            self.fail(exc)

    def restart(self, slot: Slot) -> None:
        """Move an open phase's start to now (nothing when it is not open).

        Lightning runs forward and backward inside ``optimizer.step(closure)``, after
        the optimizer's pre-hook opened the phase; restarting it when the closure has
        returned keeps the optimizer phase to the update itself.
        """
        if slot.depth == 0 or _get_ident() != self.thread:
            return
        try:
            slot.ev0 = self._record() if slot.ev0 is not None else None
            slot.t0 = _perf_ns()
        except Exception as exc:
            self.fail(exc)

    def add_host(self, name: str, dt_ns: int) -> None:
        """Add one host-timed call (the DataLoader wait) to the current or next step."""
        if _get_ident() != self.thread:
            return
        try:
            self._add_host(name, dt_ns)
        except Exception as exc:
            self.fail(exc)

    def begin(self, model: object | None) -> None:
        """Start step ``self.step + 1``."""
        self.thread = _get_ident()
        if model is not None:
            ref = self._model_ref
            if ref is None or ref() is not model:
                self._adopt(model)
            elif (probe_ref := self._probe) is not None:
                # Whether the model's probe tensor changed device (or is gone) since
                # _locate, inline: every traced step asks.
                probe: Any = probe_ref()
                if probe is None:
                    self._locate(model)
                else:
                    try:
                        now: object = probe.get_device()
                    except Exception:
                        now = device_of(probe)
                    if now != self._probe_at:
                        self._locate(model)
        else:
            self._current_device()
        self.step += 1
        self.fwd.depth = self.bwd.depth = self.opt.depth = self.h2d.depth = 0
        if self.cuda_index is not None and self.reset_peak:
            self._cuda.reset_peak_memory_stats(self.cuda_index)
        self.in_step = True
        self._t0 = _perf_ns()

    def end(self) -> None:
        """Finish the current step and send its items (or leave them to the builder)."""
        dt = _perf_ns() - self._t0
        self.in_step = False
        self._add_host(STEP_TIME, dt)
        self.fwd.depth = self.bwd.depth = self.opt.depth = self.h2d.depth = 0
        acc = self._acc
        spare_acc = self._spare_acc
        self._acc = spare_acc.pop() if spare_acc else {}
        ts = time.time_ns()
        step = self.step
        device = self.device
        index = self.cuda_index
        if index is None and not self._pending:
            # Not on CUDA: no GPU time to wait for and no peak to read. Event pairs a
            # phase may still hold from an earlier CUDA step are not read off a CUDA
            # device either way (gpu_ms is null).
            ended = self._ended
            if self.defer and len(ended) < self._max_ended:
                self._ended_at.append((step, ts, device))
                ended.append(acc)
                if len(ended) == self._wake_at and self.wake_builder is not None:
                    self.wake_builder()
                return
            if ended or self.defer:
                with self._pending_lock:
                    self._build_ended()
                    self._send_host(step, ts, device, acc)
                return
            # Nothing else sends steps now (the sampler thread only sends while the
            # pending queue is not empty): the common inline path takes no lock.
            self._send_host(step, ts, device, acc)
            return
        if self._ended:
            # Earlier CPU steps first, so seq and step numbers stay in order.
            self.build_ended()
        if index is not None and self.reset_peak:
            peak_alloc = self._cuda.max_memory_allocated(index)
            peak_reserved = self._cuda.max_memory_reserved(index)
        else:
            peak_alloc = peak_reserved = None
        self._put_memory(step, ts, device, peak_alloc, peak_reserved)
        pending = PendingStep(step, ts, device, acc)
        if not self._pending and not any(p.pairs for p in acc.values()):
            # No event to wait for (CPU): sent at once. The sampler thread only
            # sends while the queue is not empty (drain pops after sending), so
            # this cannot interleave with it.
            self._emit(pending)
            return
        with self._pending_lock:
            self._pending.append(pending)
            self._drain_ready()


class StepContext:
    """``with trace_step(model):`` — one traced step; exceptions propagate unchanged."""

    __slots__ = ("_live", "_model", "_timer")

    def __init__(self, timer: TimerCore, model: object | None) -> None:
        self._timer = timer
        self._model = model
        self._live = False

    def reusable_for(self, timer: TimerCore | None, model: object | None) -> bool:
        """Whether entering this context again is ``trace_step(model)`` now: it is not
        in use, and was made for ``model`` and for ``timer``, the running timer (None
        while hooks are off: never reused then, it could be a stale runtime's)."""
        return (
            timer is not None and not self._live and self._timer is timer and self._model is model
        )

    def __enter__(self) -> None:
        timer = self._timer
        if not timer.enabled or timer.in_step:
            return  # TraceML disabled, or a nested step: the outer one is measured
        try:
            timer.begin(self._model)
            self._live = True
        except Exception as exc:
            timer.fail(exc)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._live:
            return
        self._live = False
        timer = self._timer
        if not timer.enabled:
            return
        try:
            if exc_type is not None:
                # A step whose body raised is discarded, as TraceML 0.5.0 does: its
                # partial phases would distort the figures (docs/compat-0.5.md).
                timer.discard()
                return
            timer.end()
        except Exception as error:
            timer.fail(error)
