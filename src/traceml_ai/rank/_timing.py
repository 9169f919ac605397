"""Step timing: the phases of each traced step, and the step_time/step_memory items.

Forward, backward, optimizer step and DataLoader waits are measured by hooks and
patches installed once per process. They report to the module-level ``_ACTIVE``
timer, so when TraceML is off or disabled each costs one global lookup.

On CUDA every timed call also records a pair of CUDA events. The events are read
later, when they have completed (checked with ``query()`` at the end of later
steps), so the training loop never synchronizes with the GPU; the step's
``step_time`` item is sent once its events are resolved, and at shutdown.

Off CUDA, under ``init``'s own sender (``StepTimer.defer``), a step leaves only its
numbers on the training thread (step, time, device, its phases); the sender's thread
builds the step_time and step_memory items before each flush, in step order. The
training thread builds them itself past ``MAX_ENDED_STEPS`` waiting, before a CUDA
step's items, and with any other sink.
"""

from __future__ import annotations

import functools
import importlib
import math
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import orjson

from traceml_ai.rank.gpu import CudaBackend, CudaEvent
from traceml_ai.rank.sink import EncodedStepSink, ItemSink
from traceml_records import events as _events
from traceml_records import internal as _records
from traceml_records.internal import PhaseTimingItem, StepMemoryItem, StepTimeItem

# The built-in event names, as the schema defines them (traceml_records.events).
INTERNAL_PREFIX = _events.RESERVED_PREFIX
DATALOADER_NEXT = _events.DATALOADER_NEXT
FORWARD = _events.FORWARD_TIME
BACKWARD = _events.BACKWARD_TIME
OPTIMIZER_STEP = _events.OPTIMIZER_STEP
H2D = _events.H2D_TIME
STEP_TIME = _events.STEP_TIME

# Phases that always report host time (spec: the step and the DataLoader wait).
_HOST_ONLY = frozenset({DATALOADER_NEXT, STEP_TIME})

# Steps whose CUDA events are still running; past this many, the oldest is sent
# with gpu_ms null for what has not completed rather than waiting for the GPU.
MAX_PENDING_STEPS = 64
# Event pairs one phase may collect outside a step (trace_phase in a loop no step
# follows); past this, the phase keeps host time only (gpu_ms null), so the
# events cannot pile up.
MAX_OUTSIDE_PAIRS = 256
# Shutdown (and summary()) polls the pending steps' events against this one
# deadline, never Event.synchronize(): behind an unjoined NCCL collective the GPU
# may never finish, and then gpu_ms is null for what did not complete.
SHUTDOWN_GPU_WAIT_S = 3.0
# Steps off CUDA ended but not yet built into items (``StepTimer.defer``): past
# ENDED_WAKE_AT the builder's thread is woken; past MAX_ENDED_STEPS (a builder thread
# that does not keep up, e.g. stuck in a send) the training thread builds them itself.
ENDED_WAKE_AT = 512
MAX_ENDED_STEPS = 4096

_get_ident = threading.get_ident
_perf_ns = time.perf_counter_ns

_ACTIVE: StepTimer | None = None


def _never_compiling() -> bool:
    return False


# torch.compiler.is_dynamo_compiling once torch is patched (is_compiling on a torch
# without it): while dynamo traces a compiled module (model.compile() puts the hooks
# inside the compiled region) it is a constant True, so each hook returns at once and
# adds no graph break. In eager mode it is a bare ``return False``; is_compiling also
# calls torch.jit.is_scripting(), one more Python frame in every hook call.
_is_compiling: Callable[[], bool] = _never_compiling


def _set_active(timer: StepTimer | None) -> None:
    global _ACTIVE
    _ACTIVE = timer


class _Phase:
    """One phase of one step: host time and CUDA event pairs summed over its calls."""

    __slots__ = ("cpu_ns", "missing", "n_calls", "pairs")

    def __init__(self) -> None:
        self.cpu_ns = 0
        self.n_calls = 0
        self.pairs: list[tuple[CudaEvent, CudaEvent]] = []
        self.missing = False


def _load_host_step_encoders() -> tuple[Callable[..., Any] | None, Callable[..., Any] | None]:
    """The C encoder of a host-timed step's two items and its loop over the ended
    steps (their signatures: traceml_records/_speedups.pyi), or (None, None): pure
    Python."""
    native = _records.load_extension()
    if native is None:
        return None, None
    try:
        native.configure_host_step(_Phase, orjson.dumps)
        encode: Callable[..., Any] = native.encode_host_step
        encode_run: Callable[..., Any] = native.encode_host_steps
    except Exception:  # an extension built from other sources: Python's path
        return None, None
    return encode, encode_run


# encode_host_step(acc, step, ts, device, seq_time, seq_mem): the bytes
# wire.encode_item gives for the two items StepTimer._send_host builds (None: a case
# it leaves to Python), with the phases zeroed as _send_host zeroes them.
# encode_host_steps(encode, ended, ended_at, spare, seq_time, seq_mem): the builder's
# loop over the ended steps, calling ``encode`` for each (in C: the Python loop was
# half of the builder's work per step, docs/benchmarks.md).
_encode_host_step, _encode_host_steps = _load_host_step_encoders()


class _PyOpen:
    """An in-flight hook-timed phase; ``depth`` keeps nested calls from counting twice
    (``_Open``: this, or ``_hotpath.Slot`` with the C extension)."""

    __slots__ = ("auto", "depth", "ev0", "t0")

    def __init__(self) -> None:
        self.depth = 0
        self.t0 = 0
        self.ev0: CudaEvent | None = None
        # Whether its hooks time it (init's mode; see StepTimer.auto_forward).
        self.auto = True


class _PendingStep:
    __slots__ = ("acc", "device", "done", "step", "ts")

    def __init__(self, step: int, ts: int, device: str, acc: dict[str, _Phase]) -> None:
        self.step = step
        self.ts = ts
        self.device = device
        self.acc = acc
        self.done = False


def _gpu_ms(phase: _Phase, ends_done: bool) -> float | None:
    """Summed device time, or ``None`` when any call lacks a usable measurement.

    ``elapsed_time`` is only asked once both events completed (it raises
    otherwise). ``ends_done``: every end event was seen completed (``_ready``), so
    only the starts are asked; a start may sit on another stream than its end
    (the current stream changed inside the phase), so it is asked too.
    """
    pairs = phase.pairs
    if phase.missing or len(pairs) != phase.n_calls:
        return None
    total = 0.0
    for start, end in pairs:
        try:
            if not (ends_done or end.query()) or not start.query():
                return None
            ms = float(start.elapsed_time(end))
        except Exception:
            return None
        if not math.isfinite(ms) or ms < 0:
            return None
        total += ms
    return total


def _ready(pending: _PendingStep) -> bool:
    """Whether every end event of the step completed (remembered once true)."""
    if pending.done:
        return True
    for phase in pending.acc.values():
        for _, end in phase.pairs:
            try:
                if not end.query():
                    return False
            except Exception:
                continue
    pending.done = True
    return True


def _probe_tensor(model: object) -> Any:
    """The model's first CUDA parameter or buffer, else its first tensor (or ``None``).

    A model with some parameters offloaded to CPU still runs on its GPU: the first
    parameter alone does not tell the device.
    """
    first = None
    for attr in ("parameters", "buffers"):
        getter = getattr(model, attr, None)
        if not callable(getter):
            continue
        try:
            for tensor in getter():
                if first is None:
                    first = tensor
                if getattr(getattr(tensor, "device", None), "type", None) == "cuda":
                    return tensor
        except Exception:
            continue
    return first


def _where(tensor: Any) -> object:
    """Where a tensor is, cheaply: ``get_device()`` (-1 on CPU, else the CUDA index)
    is ~40 ns where building ``tensor.device`` costs ~0.5 µs a step."""
    try:
        return tensor.get_device()
    except Exception:
        device = getattr(tensor, "device", None)
        return (getattr(device, "type", None), getattr(device, "index", None))


def _device_key(device: Any) -> str:
    kind = getattr(device, "type", None)
    if not isinstance(kind, str) or not kind.isalpha() or not kind.islower() or kind == "meta":
        return "cpu"
    if kind in ("cpu", "mps"):
        return kind
    index = getattr(device, "index", None)
    return f"{kind}:{index if isinstance(index, int) and index >= 0 else 0}"


class _PyTimerCore:
    """The step timer's per-step and per-call methods in Python, and what they define.

    ``begin``, ``end``, ``open``, ``close``, ``restart`` and ``add_host`` run in every
    traced step. With the C extension built, StepTimer's base is
    ``_hotpath.TimerCore``, which does their common case in C (a step off CUDA whose
    model stayed where it was, on the training thread, a phase the step already has,
    its numbers left to the sender's thread) and hands every other case to these
    methods, so this class is the behaviour either way (TRACEML_PURE_PYTHON=1: these
    alone).
    """

    # Set by StepTimer.__init__ (in C fields with the extension).
    in_step: bool
    thread: int
    cuda_index: int | None
    _acc: dict[str, _Phase]
    _cuda: CudaBackend

    step: int
    device: str
    reset_peak: bool
    defer: bool
    wake_builder: Callable[[], None] | None
    fwd: _Open
    bwd: _Open
    opt: _Open
    h2d: _Open
    _t0: int
    _model_ref: Callable[[], object] | None
    _probe: Callable[[], object] | None
    _probe_at: object
    _pending: deque[_PendingStep]
    _pending_lock: threading.Lock
    _ended: deque[dict[str, _Phase]]
    _ended_at: deque[tuple[int, int, str]]
    _spare_acc: list[dict[str, _Phase]]
    _max_ended: int
    _wake_at: int

    if TYPE_CHECKING:
        # StepTimer's, used here.
        def fail(self, exc: BaseException) -> None: ...
        def _adopt(self, model: object) -> None: ...
        def _locate(self, model: object) -> None: ...
        def _current_device(self) -> None: ...
        def build_ended(self) -> None: ...
        def _build_ended(self) -> None: ...
        def _send_host(self, step: int, ts: int, device: str, acc: dict[str, _Phase]) -> None: ...
        def _put_memory(
            self, step: int, ts: int, device: str, peak_alloc: int | None, peak_reserved: int | None
        ) -> None: ...
        def _emit(self, pending: _PendingStep) -> None: ...
        def _drain_ready(self) -> None: ...

    def _record(self) -> CudaEvent | None:
        index = self.cuda_index
        return None if index is None else self._cuda.record_event(index)

    def _add(self, name: str, dt_ns: int, ev0: CudaEvent | None, ev1: CudaEvent | None) -> None:
        phase = self._acc.get(name)
        if phase is None:
            phase = self._acc[name] = _Phase()
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
            phase = acc[name] = _Phase()
            phase.missing = True
        elif not phase.missing:
            phase.missing = True
            phase.pairs = []
        phase.cpu_ns += dt_ns
        phase.n_calls += 1

    def open(self, slot: _Open) -> None:
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

    def close(self, slot: _Open, name: str) -> None:
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

    def restart(self, slot: _Open) -> None:
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
                        where: object = probe.get_device()
                    except Exception:
                        where = _where(probe)
                    if where != self._probe_at:
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
        pending = _PendingStep(step, ts, device, acc)
        if not self._pending and not any(p.pairs for p in acc.values()):
            # No event to wait for (CPU): sent at once. The sampler thread only
            # sends while the queue is not empty (drain pops after sending), so
            # this cannot interleave with it.
            self._emit(pending)
            return
        with self._pending_lock:
            self._pending.append(pending)
            self._drain_ready()


def _load_hotpath() -> Any:
    """``traceml_ai.rank._hotpath``, configured, or None: not built, disabled, or
    built from other sources than this module's (then everything runs in Python)."""
    hotpath = _records.load_extension("traceml_ai.rank._hotpath")
    if hotpath is None:
        return None
    try:
        hotpath.configure(_PyTimerCore, _Phase, STEP_TIME)
        hotpath.configure_gates(globals(), DATALOADER_NEXT, FORWARD, BACKWARD)
        for name in ("TimerCore", "Slot", "StepContext", "Gate"):
            getattr(hotpath, name)
    except Exception:
        return None
    return hotpath


_HOTPATH = _load_hotpath()

# The kinds of _hotpath.Gate: what a patch does in C before it hands a call to its
# Python wrapper (_gated).
GATE_OUTSIDE_STEP = 0
GATE_DATALOADER = 1
GATE_BACKWARD = 2


def _gated(kind: int, original: Callable[..., Any], slow: Callable[..., Any]) -> Any:
    """What a patch puts in place of ``original``: ``slow``, its Python wrapper, which
    defines what it does; with the extension, a ``_hotpath.Gate`` that does the common
    case of ``kind`` in C (no frame, the call's arguments passed on as they came) and
    hands every other call to ``slow``. A method of the class it is put in, as
    ``original`` was."""
    if _HOTPATH is None:
        return slow
    gate = _HOTPATH.Gate(kind, original, slow)
    functools.update_wrapper(gate, original)
    return gate


def _core_classes() -> tuple[type[_PyTimerCore], type[_PyOpen]]:
    """StepTimer's base and the in-flight phase class: in C when the extension is built."""
    if _HOTPATH is None:
        return _PyTimerCore, _PyOpen
    # The C methods first; the Python ones are what they hand other cases to.
    base = type("_TimerCore", (_HOTPATH.TimerCore, _PyTimerCore), {})
    return base, _HOTPATH.Slot


if TYPE_CHECKING:
    _TimerCore = _PyTimerCore
    _Open = _PyOpen
else:
    _TimerCore, _Open = _core_classes()


class StepTimer(_TimerCore):
    """Measures traced steps and puts their ``step_time``/``step_memory`` items into a sink.

    Only the thread that runs the traced steps is measured; calls from other
    threads (e.g. ``DataParallel`` replicas) are ignored.
    """

    def __init__(
        self,
        sink: ItemSink,
        cuda: CudaBackend,
        on_new_model: Callable[[object], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self._sink = sink
        self._cuda = cuda
        self._on_new_model = on_new_model
        self._on_error = on_error
        self.enabled = True
        self.in_step = False
        self.thread = _get_ident()
        self.step = 0
        self.device = "cpu"
        self.cuda_index: int | None = None
        self._device_known = False
        self._model_ref: Callable[[], object] | None = None
        # A tensor of the traced model and the (type, index) it was on: read again
        # every step (one attribute), so a model moved to the GPU after step 1 is seen.
        self._probe: Callable[[], object] | None = None
        self._probe_at: object = None
        # trace_step(None): the training thread's current CUDA device, last answer.
        self._raw_current: int | None = None
        self._no_cuda = False
        # The rank's LOCAL_RANK, for trace_step(None) without torch.cuda.set_device.
        self.local_rank = 0
        # False: never reset the CUDA peak (TRACEML_RESET_PEAK_MEMORY=0), so the
        # user's own max_memory_allocated() keeps its meaning; step peaks are null.
        self.reset_peak = True
        # Guards the pending steps and the step_time seq: the sampler thread sends a
        # last step whose events completed without waiting for the next step.
        self._pending_lock = threading.Lock()
        # Calls outside a step (DataLoader waits, user phases) collect here and
        # belong to the next step that begins.
        self._acc: dict[str, _Phase] = {}
        self._t0 = 0
        self.fwd = _Open()
        self.bwd = _Open()
        self.opt = _Open()
        self.h2d = _Open()
        # What init's mode times automatically; the rest only through traceml.wrap_*
        # (mode="manual"/"selective"). Hooks installed by an earlier init of the
        # process read these, so they time nothing a later config left out.
        # (auto_forward and auto_optimizer are their slots' ``auto``.)
        self.auto_backward = True
        self.auto_dataloader = True
        # A framework that brackets forward from the batch's start (Lightning's
        # zero-code attach): the backward patch ends that forward phase where backward
        # begins, and restarts an open optimizer phase where backward ends (Lightning
        # runs forward and backward inside ``optimizer.step(closure)``, after the
        # optimizer's pre-hook opened the phase).
        self.bracket = False
        # With the bracket, no optimizer hooks either (Lightning's automatic
        # optimization: they are taken out of torch while its fit runs): backward's
        # end opens the optimizer phase, and the framework's batch end closes it.
        self.bracket_optimizer = False
        # The slots of the phases torch's hooks time, by the index _phase_hooks uses.
        self.hooked = (self.fwd, self.opt)
        self._pending: deque[_PendingStep] = deque()
        self._seq_time = 0
        self._seq_mem = 0
        # True when a background thread calls ``build_ended`` (the sender's, before
        # each flush): a step off CUDA then leaves only its numbers here, and its
        # items are built there. Building and sending them was about half of what a
        # traced CPU step cost the training thread (docs/benchmarks.md).
        self.defer = False
        # Where a step off CUDA goes as its two items already encoded (in C, skipping
        # the dicts: most of what building a step cost), when the sink takes them.
        self.encoded_sink: EncodedStepSink | None = None
        self.wake_builder: Callable[[], None] | None = None
        # A waiting step is its phases (``_ended``) and its (step, time, device)
        # (``_ended_at``, appended first, so a builder that sees the one finds the other).
        # Kept apart, and the phase dicts reused (``_spare_acc``), so that a step
        # leaves no new container behind on the training thread: thousands of them
        # waiting for the builder moved into the garbage collector's oldest generation
        # and brought on full collections of the process (~0.2 s each under
        # Lightning; docs/benchmarks.md). A tuple of numbers and a str is untracked at
        # its first collection.
        self._ended: deque[dict[str, _Phase]] = deque()
        self._ended_at: deque[tuple[int, int, str]] = deque()
        # Phase dicts of CPU steps already sent, with their phases zeroed (n_calls 0,
        # host-only): a step's phases are then there from its first call, which
        # takes the common case of close() and add_host() (the C core's), and no
        # _Phase is made. Phases with no call are left out of the items.
        self._spare_acc: list[dict[str, _Phase]] = []
        # MAX_ENDED_STEPS and ENDED_WAKE_AT, read when the timer is made.
        self._max_ended = MAX_ENDED_STEPS
        self._wake_at = ENDED_WAKE_AT

    @property
    def auto_forward(self) -> bool:
        """Whether the forward hooks time the forward phase."""
        return self.fwd.auto

    @auto_forward.setter
    def auto_forward(self, on: bool) -> None:
        self.fwd.auto = bool(on)

    @property
    def auto_optimizer(self) -> bool:
        """Whether the optimizer step hooks time the optimizer phase."""
        return self.opt.auto

    @auto_optimizer.setter
    def auto_optimizer(self, on: bool) -> None:
        self.opt.auto = bool(on)

    # -- counters -------------------------------------------------------------

    @property
    def next_seq_time(self) -> int:
        """The ``seq`` the next step_time item gets."""
        return self._seq_time

    @property
    def next_seq_mem(self) -> int:
        """The ``seq`` the next step_memory item gets."""
        return self._seq_mem

    def continue_counts(self, step: int, seq_time: int, seq_mem: int) -> None:
        """Go on from an earlier timer of this process (``init`` after ``shutdown``).

        Step numbers and ``seq`` are part of a record's key: starting again from 0
        would repeat keys the earlier timer already sent.
        """
        self.step = step
        self._seq_time = seq_time
        self._seq_mem = seq_mem

    # -- failure --------------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        """Stop measuring after an internal error; training goes on."""
        self.enabled = False
        self.in_step = False
        if _ACTIVE is self:
            _set_active(None)
        self._on_error(exc)

    # -- phases ---------------------------------------------------------------

    def discard_outside(self, name: str) -> None:
        """Forget what ``name`` collected since the last step ended (not yet in a step).

        An evaluation loop between two training steps fetches batches too; those
        waits are not the next training step's.
        """
        if not self.in_step:
            self._acc.pop(name, None)

    def user_phase_begin(self) -> tuple[int, CudaEvent | None]:
        """Start a user phase; returns what ``user_phase_end`` needs."""
        ev0 = self._record()
        return _perf_ns(), ev0

    def user_phase_end(self, name: str, t0: int, ev0: CudaEvent | None) -> None:
        """End a user phase and add it to the current step, or to the next one outside a step."""
        dt = _perf_ns() - t0
        ev1 = self._record() if ev0 is not None else None
        if _get_ident() == self.thread:
            self._add(name, dt, ev0, ev1)

    # -- steps ----------------------------------------------------------------

    def _adopt(self, model: object) -> None:
        try:
            ref: Callable[[], object] = weakref.ref(model)
        except TypeError:
            ref = functools.partial(lambda m: m, model)
        self._model_ref = ref
        if self.auto_forward:
            _install_model_hooks(model)
        self._locate(model)
        self._on_new_model(model)

    def _locate(self, model: object) -> None:
        """Set the step's device from where the model's tensors are now."""
        probe = _probe_tensor(model)
        index = self._cuda.device_index_of(model)
        if index is not None:
            self.device, self.cuda_index = f"cuda:{index}", index
        else:
            device = None if probe is None else getattr(probe, "device", None)
            self.device, self.cuda_index = _device_key(device), None
        self._probe = None
        self._probe_at = None
        if probe is not None:
            try:
                self._probe = weakref.ref(probe)
            except TypeError:
                self._probe = functools.partial(lambda t: t, probe)
            self._probe_at = _where(probe)
        self._device_known = True

    def _current_device(self) -> None:
        """trace_step(None): time the training thread's current CUDA device.

        Asked every step (cheap), so a later ``torch.cuda.set_device`` is followed.
        Current device 0 on a non-zero local rank that allocated memory only on
        cuda:LOCAL_RANK means ``set_device`` was never called: that rank's device
        is LOCAL_RANK, and timing cuda:0 would time (and use) another rank's GPU.
        """
        if self._no_cuda:
            return
        cuda = self._cuda
        available = cuda.is_available()
        if not available:
            # False is final (no CUDA build/GPU); None: not initialized yet, ask again.
            self._no_cuda = available is False
            return
        raw = cuda.current_device()
        if raw is None or (raw == self._raw_current and self.cuda_index is not None):
            return
        self._raw_current = raw
        index = raw
        local = self.local_rank
        if raw == 0 and local > 0:
            count = cuda.device_count() or 0
            if (
                local < count
                and (cuda.memory_allocated(local) or 0) > 0
                and not cuda.memory_allocated(0)
            ):
                index = local
        self.device, self.cuda_index = f"cuda:{index}", index

    def _put_memory(
        self, step: int, ts: int, device: str, peak_alloc: int | None, peak_reserved: int | None
    ) -> None:
        seq_mem = self._seq_mem
        self._seq_mem = seq_mem + 1
        memory_item: StepMemoryItem = {
            "timestamp_unix_ns": ts,
            "seq": seq_mem,
            "step": step,
            "device": device,
            "peak_allocated_bytes": peak_alloc,
            "peak_reserved_bytes": peak_reserved,
        }
        self._sink.put("step_memory", memory_item)

    def _encoding_sink(self) -> EncodedStepSink | None:
        """Where steps go encoded in C, or None: as dicts, to the sink's ``put``."""
        if _encode_host_step is None or _encode_host_steps is None:
            return None
        return self.encoded_sink

    def _send_host(self, step: int, ts: int, device: str, acc: dict[str, _Phase]) -> None:
        """Both items of a step off CUDA, then its phases zeroed for a later step."""
        if self._encoding_sink() is None:
            self._send_host_items(step, ts, device, acc)
        else:
            self._send_hosts(deque((acc,)), deque(((step, ts, device),)))

    def _send_hosts(
        self, ended: deque[dict[str, _Phase]], ended_at: deque[tuple[int, int, str]]
    ) -> None:
        """:meth:`_send_host` of each step of ``ended`` (its phases) and ``ended_at``
        (its step, time and device), taken off both in order: encoded in C and handed
        to the encoded sink in one call (per-step calls through the recorder and the
        sender's queues were a third of the sender thread's work per step,
        docs/benchmarks.md); a step the encoder leaves to Python, or every step
        without an encoded sink, as dicts to the sink's ``put``."""
        encoded_sink = self._encoding_sink()
        if encoded_sink is None or _encode_host_steps is None:
            while ended:
                acc = ended.popleft()
                step, ts, device = ended_at.popleft()
                self._send_host_items(step, ts, device, acc)
            return
        while ended:
            steps, memories, times, self._seq_time, self._seq_mem, stop = _encode_host_steps(
                _encode_host_step, ended, ended_at, self._spare_acc, self._seq_time, self._seq_mem
            )
            # What was built goes out even when a later step raised.
            if steps:
                encoded_sink.put_encoded_steps(steps, memories, times)
            if isinstance(stop, BaseException):
                raise stop
            if stop is not None:
                # The ones before it went first: seq and step stay in order.
                self._send_host_items(*stop)

    def _send_host_items(self, step: int, ts: int, device: str, acc: dict[str, _Phase]) -> None:
        """A step's host items as dicts, to the sink's ``put``."""
        self._put_memory(step, ts, device, None, None)
        self._emit_host(step, ts, device, acc)
        for phase in acc.values():
            phase.cpu_ns = 0
            phase.n_calls = 0
            if not phase.missing:
                # Events of an earlier CUDA step: never read off CUDA (gpu_ms null).
                phase.missing = True
                phase.pairs = []
        self._spare_acc.append(acc)

    def _build_ended(self) -> None:
        # Caller holds _pending_lock.
        self._send_hosts(self._ended, self._ended_at)

    def build_ended(self) -> None:
        """Build and send the items of steps that ``defer`` left (any thread)."""
        if self._ended:
            with self._pending_lock:
                self._build_ended()

    def leave_out(self, dt_ns: int) -> None:
        """Leave ``dt_ns`` out of the open step's duration: an evaluation loop ran inside
        it, between the batches of an accumulating update, its hooks paused. Nothing
        outside a step."""
        if self.in_step and dt_ns > 0:
            self._t0 += dt_ns

    def discard(self) -> None:
        """Drop the current step: its body raised (TraceML 0.5.0 does not count it).

        Nothing of it is sent, and its number is given to the next step, so step
        numbers stay consecutive. What it had collected (a DataLoader wait before it
        included) goes with it.
        """
        self.in_step = False
        self.fwd.depth = self.bwd.depth = self.opt.depth = self.h2d.depth = 0
        self._acc = {}
        self.step -= 1

    def _drain_ready(self) -> None:
        # Caller holds _pending_lock. The head is popped only after it was sent.
        queue = self._pending
        while queue:
            head = queue[0]
            if len(queue) <= MAX_PENDING_STEPS and not _ready(head):
                return
            self._emit(head)
            queue.popleft()

    def poll(self) -> None:
        """Send steps whose CUDA events completed (sampler thread: the last step's
        line does not wait for a next step that may never come)."""
        self.build_ended()
        if self._pending:
            with self._pending_lock:
                self._drain_ready()

    def drain(self, sync: bool, deadline: float | None = None) -> None:
        """Send steps whose CUDA events completed; with ``sync`` (shutdown, summary)
        poll every pending step until all completed or ``deadline`` (monotonic;
        default ``SHUTDOWN_GPU_WAIT_S`` from now), then send them all, ``gpu_ms``
        null for what did not complete. Never ``Event.synchronize()``.
        """
        if not sync:
            self.poll()
            return
        self.build_ended()
        if deadline is None:
            deadline = time.monotonic() + SHUTDOWN_GPU_WAIT_S
        pause = 0.0005
        while self._pending and not all(_ready(p) for p in list(self._pending)):
            if time.monotonic() >= deadline:
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        with self._pending_lock:
            queue = self._pending
            while queue:
                self._emit(queue[0])
                queue.popleft()

    def _emit_host(self, step: int, ts: int, device: str, acc: dict[str, _Phase]) -> None:
        """``_emit`` for a step off CUDA (host time only), each event built in one go.

        A plain loop, not a dict comprehension: on Python 3.11 the comprehension
        builds a function and a frame per step (~20 % more instructions here).
        """
        events: dict[str, dict[str, PhaseTimingItem]] = {}
        for name in sorted(acc):
            phase = acc[name]
            if not phase.n_calls:
                continue
            ms = phase.cpu_ns / 1e6
            events[name] = {
                device: {
                    "cpu_ms": ms,
                    "duration_ms": ms,
                    "gpu_ms": None,
                    "is_gpu": False,
                    "n_calls": phase.n_calls,
                }
            }
        seq = self._seq_time
        self._seq_time = seq + 1
        item: StepTimeItem = {"timestamp_unix_ns": ts, "seq": seq, "step": step, "events": events}
        self._sink.put("step_time", item)

    def _emit(self, pending: _PendingStep) -> None:
        device = pending.device
        cuda = device.startswith("cuda:")
        done = pending.done
        events: dict[str, dict[str, PhaseTimingItem]] = {}
        measured: list[CudaEvent] = []
        for name in sorted(pending.acc):
            phase = pending.acc[name]
            if not phase.n_calls:
                continue  # a reused phase this step did not call
            cpu_ms = phase.cpu_ns / 1e6
            gpu_ms = None if not cuda or name in _HOST_ONLY else _gpu_ms(phase, done)
            if gpu_ms is not None:
                for start, end in phase.pairs:
                    measured += (start, end)
            is_gpu = gpu_ms is not None
            events[name] = {
                device: {
                    "cpu_ms": cpu_ms,
                    "duration_ms": gpu_ms if gpu_ms is not None else cpu_ms,
                    "gpu_ms": gpu_ms,
                    "is_gpu": is_gpu,
                    "n_calls": phase.n_calls,
                }
            }
        seq = self._seq_time
        self._seq_time = seq + 1
        item: StepTimeItem = {
            "timestamp_unix_ns": pending.ts,
            "seq": seq,
            "step": pending.step,
            "events": events,
        }
        self._sink.put("step_time", item)
        if measured:
            # Both events of every pair read completed, and the step is dropped with
            # ``pending``: nothing reads them again before they are recorded again.
            self._cuda.release_events(int(device[5:]), measured)


class _PyStepContext:
    """``with trace_step(model):`` — one traced step; exceptions propagate unchanged.

    (``StepContext``: this, or ``_hotpath.StepContext``, the same in C, with the
    extension.)
    """

    __slots__ = ("_live", "_model", "_timer")

    def __init__(self, timer: StepTimer, model: object | None) -> None:
        self._timer = timer
        self._model = model
        self._live = False

    def reusable_for(self, timer: StepTimer | None, model: object | None) -> bool:
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


def _step_context_class() -> type[_PyStepContext]:
    return _PyStepContext if _HOTPATH is None else _HOTPATH.StepContext


if TYPE_CHECKING:
    StepContext = _PyStepContext
else:
    StepContext = _step_context_class()


class PhaseContext:
    """``with trace_phase(name):`` — a user-named phase of the current (or next) step."""

    __slots__ = ("_ev0", "_live", "_name", "_t0", "_timer")

    def __init__(self, timer: StepTimer, name: str) -> None:
        self._timer = timer
        self._name = name
        self._live = False
        self._t0 = 0
        self._ev0: CudaEvent | None = None

    def __enter__(self) -> None:
        timer = self._timer
        if not timer.enabled:
            return
        try:
            self._t0, self._ev0 = timer.user_phase_begin()
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
            timer.user_phase_end(self._name, self._t0, self._ev0)
        except Exception as error:
            timer.fail(error)


# -- hooks and patches, installed once per process ----------------------------

_HOOKED: weakref.WeakSet[Any] = weakref.WeakSet()
_HOOKED_IDS: set[int] = set()
_patch_lock = threading.Lock()
_patched: set[str] = set()
# The handles of the global optimizer step hooks while torch holds them (empty while
# suspend_optimizer_hooks has them out, or before install_patches registers them).
_optimizer_hook_handles: list[Any] = []


def _phase_hooks(index: int, name: str) -> tuple[Callable[..., None], Callable[..., None]]:
    """The pre and post hooks of the phase whose slot is ``timer.hooked[index]``:
    ``timer.open(slot)`` / ``timer.close(slot, name)`` while it is timed. One template
    for the forward and the optimizer hooks; the third argument is the optimizer
    hooks' kwargs or the forward hook's output.
    """

    def pre_hook(owner: Any, args: Any, extra: Any = None) -> None:
        if _is_compiling():
            return
        timer = _ACTIVE
        if timer is None or not timer.in_step:
            return
        slot = timer.hooked[index]
        if slot.auto:
            timer.open(slot)

    def post_hook(owner: Any, args: Any, extra: Any = None) -> None:
        if _is_compiling():
            return
        timer = _ACTIVE
        if timer is None:
            return
        slot = timer.hooked[index]
        if slot.auto:
            timer.close(slot, name)

    return pre_hook, post_hook


_forward_pre_hook, _forward_hook = _phase_hooks(0, FORWARD)
_optimizer_pre_hook, _optimizer_post_hook = _phase_hooks(1, OPTIMIZER_STEP)


def forward_timed_elsewhere(model: object) -> None:
    """``model``'s forward is timed by a framework integration (Lightning brackets the
    ``training_step`` itself): never hook it. A module with hooks takes torch's slower
    ``_call_impl`` path on every call, traced or not, for a phase already measured."""
    try:
        _HOOKED.add(model)
    except TypeError:
        _HOOKED_IDS.add(id(model))


def _install_model_hooks(model: object) -> None:
    """Hook the model's forward once per model object (a DDP wrapper is hooked itself)."""
    try:
        weakref.ref(model)
        weakable = True
    except TypeError:
        weakable = False
    if (model in _HOOKED) if weakable else (id(model) in _HOOKED_IDS):
        return
    pre = getattr(model, "register_forward_pre_hook", None)
    post = getattr(model, "register_forward_hook", None)
    if not callable(pre) or not callable(post):
        return
    pre(_forward_pre_hook)
    try:
        # always_call closes the phase even when forward raises.
        post(_forward_hook, always_call=True)
    except TypeError:
        post(_forward_hook)
    if weakable:
        _HOOKED.add(model)
    else:
        _HOOKED_IDS.add(id(model))


def _timed_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> Any:
        timer = _ACTIVE
        if timer is None or not timer.in_step or not timer.auto_backward or _is_compiling():
            return original(*args, **kwargs)
        if _get_ident() != timer.thread:
            # Another thread's backward (the timer ignores it): no phase of the
            # training thread's step is touched either.
            return original(*args, **kwargs)
        slot = timer.bwd
        if slot.depth:
            # Already open (a backward inside a backward hook): open/close of a nested
            # call would only count depth up and down again.
            return original(*args, **kwargs)
        bracket = timer.bracket
        if bracket and timer.fwd.depth:
            # Inner forward hooks close their own levels; one that did not (a forward
            # that raised without always_call) must not keep the phase open.
            timer.fwd.depth = 1
            timer.close(timer.fwd, FORWARD)
        timer.open(slot)
        try:
            return original(*args, **kwargs)
        finally:
            timer.close(slot, BACKWARD)
            if bracket:
                opt = timer.opt
                if timer.bracket_optimizer and not opt.depth and opt.auto:
                    timer.open(opt)
                else:
                    timer.restart(opt)

    gate: Callable[..., Any] = _gated(GATE_BACKWARD, original, backward)
    gate.__traceml_wrapped__ = True  # type: ignore[attr-defined]
    return gate


def install_patches(
    torch: Any, *, backward: bool = True, optimizer: bool = True, dataloader: bool = True
) -> None:
    """Wrap ``torch.autograd.backward`` (which ``Tensor.backward`` calls) and the DataLoader iterator,
    and register global optimizer step hooks; each once per process.

    The keywords leave a patch out (``traceml.init(mode="manual"/"selective")``); one
    installed by an earlier ``init`` of the process stays.
    """
    global _is_compiling
    with _patch_lock:
        compiler = getattr(torch, "compiler", None)
        check = getattr(compiler, "is_dynamo_compiling", None)
        if not callable(check):
            check = getattr(compiler, "is_compiling", None)
        if callable(check):
            _is_compiling = check
        wanted = {
            name
            for name, on in (
                ("backward", backward),
                ("optimizer", optimizer),
                ("dataloader", dataloader),
            )
            if on and name not in _patched
        }
        if not wanted:
            return
        # Import every submodule first, so a failure leaves nothing half-installed.
        optim = importlib.import_module("torch.optim.optimizer")
        loader_module = importlib.import_module("torch.utils.data.dataloader")
        base = loader_module._BaseDataLoaderIter
        original_next = base.__next__
        _patched.update(wanted)

        if "backward" in wanted:
            # Tensor.backward calls torch.autograd.backward (looked up at each call),
            # so wrapping that one function times both, one Python call fewer a step.
            original = torch.autograd.backward
            if not getattr(original, "__traceml_wrapped__", False):
                torch.autograd.backward = _timed_backward(original)

        if "optimizer" in wanted:
            _register_optimizer_hooks(optim)

        if "dataloader" not in wanted:
            return

        @functools.wraps(original_next)
        def __next__(self: Any) -> Any:
            timer = _ACTIVE
            if timer is None or not timer.auto_dataloader:
                return original_next(self)
            t0 = _perf_ns()
            # Only fetches that returned a batch count; the StopIteration that
            # ends an epoch is not a wait for a batch.
            batch = original_next(self)
            timer.add_host(DATALOADER_NEXT, _perf_ns() - t0)
            return batch

        base.__next__ = _gated(GATE_DATALOADER, original_next, __next__)


def _register_optimizer_hooks(optim: Any) -> None:
    # Caller holds _patch_lock.
    _optimizer_hook_handles.append(optim.register_optimizer_step_pre_hook(_optimizer_pre_hook))
    _optimizer_hook_handles.append(optim.register_optimizer_step_post_hook(_optimizer_post_hook))


def suspend_optimizer_hooks() -> bool:
    """Take the global optimizer step hooks out of torch, for a framework that times the
    optimizer phase itself (``StepTimer.bracket_optimizer``): torch then calls two
    Python functions fewer per update. Whether they were in (and are now out: undo
    with :func:`resume_optimizer_hooks`)."""
    with _patch_lock:
        if not _optimizer_hook_handles:
            return False
        for handle in _optimizer_hook_handles:
            handle.remove()
        _optimizer_hook_handles.clear()
        return True


def resume_optimizer_hooks() -> None:
    """Put back the hooks :func:`suspend_optimizer_hooks` took out (nothing if they are in)."""
    with _patch_lock:
        optim = sys.modules.get("torch.optim.optimizer")
        if _optimizer_hook_handles or "optimizer" not in _patched or optim is None:
            return
        _register_optimizer_hooks(optim)


def activate(timer: StepTimer | None) -> None:
    """Make ``timer`` the one hooks report to (``None``: hooks do nothing)."""
    _set_active(timer)


def active() -> StepTimer | None:
    """The timer hooks report to, if any."""
    return _ACTIVE
