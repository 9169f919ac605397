"""The step timer: the phases of each traced step, and its step_time/step_memory items.

:class:`StepTimer` is what the torch patches (``rank._patches``) and the framework
integrations report to; its per-step and per-call methods come from ``timer_core``
(the C extension's, over the pure-Python ones of ``hotpath_py``). It imports neither
the patches nor the collectives' recorder: each reaches it through the small interface
it is given here (:class:`TimerHooks`, :class:`StepsObserver`), and reads it through
public attributes and :meth:`StepTimer.phase_now`.

On CUDA every timed call also records a pair of CUDA events. The events are read
later, when they have completed (checked with ``query()`` at the end of later
steps), so the training loop never synchronizes with the GPU; the step's
``step_time`` item is sent once its events are resolved, and at shutdown.

Off CUDA, with a builder thread (``StepTimer(wake_builder=...)``, init's own sender),
a step leaves only its numbers on the training thread (step, time, device, its
phases); the sender's thread builds the step_time and step_memory items before each
flush, in step order. The training thread builds them itself past
``MAX_ENDED_STEPS`` waiting, before a CUDA step's items, and with any other sink.
"""

from __future__ import annotations

import functools
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Protocol

from traceml_ai.rank._timing.event_names import (
    BACKWARD,
    BETWEEN_STEPS,
    FORWARD,
    H2D,
    HOST_ONLY,
    OPTIMIZER_STEP,
    STEP_TIME,
)
from traceml_ai.rank._timing.hotpath_py import PendingStep, Phase, device_of
from traceml_ai.rank._timing.timer_core import (
    Slot,
    StepContext,
    TimerCore,
)
from traceml_ai.rank._timing.timer_core import encode_host_step as _encode_host_step
from traceml_ai.rank._timing.timer_core import encode_host_steps as _encode_host_steps
from traceml_ai.rank.gpu import CudaBackend, CudaEvent
from traceml_ai.rank.sink import EncodedItemSink, ItemSink
from traceml_records.internal import PhaseTimingItem, StepMemoryItem, StepTimeItem

__all__ = ["PhaseContext", "StepContext", "StepTimer", "StepsObserver", "TimerHooks"]

_get_ident = threading.get_ident
_perf_ns = time.perf_counter_ns

# Steps whose CUDA events are still running; past this many, the oldest is sent
# with gpu_ms null for what has not completed rather than waiting for the GPU.
MAX_PENDING_STEPS = 64
# Shutdown (and summary()) polls the pending steps' events against this one
# deadline, never Event.synchronize(): behind an unjoined NCCL collective the GPU
# may never finish, and then gpu_ms is null for what did not complete.
SHUTDOWN_GPU_WAIT_S = 3.0
# Steps off CUDA ended but not yet built into items (``StepTimer.defer``): past
# ENDED_WAKE_AT the builder's thread is woken; past MAX_ENDED_STEPS (a builder thread
# that does not keep up, e.g. stuck in a send) the training thread builds them itself.
ENDED_WAKE_AT = 512
MAX_ENDED_STEPS = 4096


def _gpu_ms(phase: Phase, ends_done: bool) -> float | None:
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


def _ready(pending: PendingStep) -> bool:
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


class TimerHooks(Protocol):
    """The torch hooks a timer reports to, as the timer sees them: handed to it when it
    is made the one they report to (``rank._patches.phase_hooks.activate``)."""

    def hook_model(self, model: object) -> None:
        """Time ``model``'s forward (a model a step meets for the first time)."""

    def release(self, timer: object) -> None:
        """Report to ``timer`` no more (its internal error turned it off)."""


class StepsObserver(Protocol):
    """What follows the timer's steps (the collectives' recorder): told as each step's
    items are built, as a step is discarded, and when the last steps were sent."""

    def steps_ended(
        self, ended: Sequence[dict[str, Phase]], ended_at: Sequence[tuple[int, int, str]]
    ) -> None:
        """Steps whose items are built now: their phases, and their (step, end, device)."""

    def discard(self, step: int) -> None:
        """Step ``step`` is dropped (its body raised)."""

    def flush(self) -> None:
        """Every pending step was sent (shutdown, summary)."""


def _device_key(device: Any) -> str:
    kind = getattr(device, "type", None)
    if not isinstance(kind, str) or not kind.isalpha() or not kind.islower() or kind == "meta":
        return "cpu"
    if kind in ("cpu", "mps"):
        return kind
    index = getattr(device, "index", None)
    return f"{kind}:{index if isinstance(index, int) and index >= 0 else 0}"


class StepTimer(TimerCore):
    """Measures traced steps and puts their ``step_time``/``step_memory`` items into a sink.

    Only the thread that runs the traced steps is measured; calls from other
    threads (e.g. ``DataParallel`` replicas) are ignored.

    ``on_new_model`` is called with each model a step meets for the first time,
    ``on_error`` with an internal error (the timer is off from then on). The keywords:
    what is timed automatically (``auto_*``: init's mode; the rest only through
    ``traceml.wrap_*``), the rank's ``local_rank``, whether the CUDA peak is reset each
    step (``reset_peak``), where a step off CUDA goes encoded (``encoded_sink``), the
    builder thread's wake-up (``wake_builder``: given, steps off CUDA are built there),
    and the ``step`` number and ``seq`` counters to go on from (an earlier timer of the
    process: they are part of a record's key).
    """

    def __init__(
        self,
        sink: ItemSink,
        cuda: CudaBackend,
        on_new_model: Callable[[object], None],
        on_error: Callable[[BaseException], None],
        *,
        auto_forward: bool = True,
        auto_backward: bool = True,
        auto_optimizer: bool = True,
        auto_dataloader: bool = True,
        local_rank: int = 0,
        reset_peak: bool = True,
        encoded_sink: EncodedItemSink | None = None,
        wake_builder: Callable[[], None] | None = None,
        step: int = 0,
        seq_time: int = 0,
        seq_mem: int = 0,
    ) -> None:
        self._sink = sink
        self._cuda = cuda
        self._on_new_model = on_new_model
        self._on_error = on_error
        self.enabled = True
        self.in_step = False
        self.thread = _get_ident()
        self.step = step
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
        self.local_rank = local_rank
        # False: never reset the CUDA peak (TRACEML_RESET_PEAK_MEMORY=0), so the
        # user's own max_memory_allocated() keeps its meaning; step peaks are null.
        self.reset_peak = reset_peak
        # Guards the pending steps and the step_time seq: the sampler thread sends a
        # last step whose events completed without waiting for the next step.
        self._pending_lock = threading.Lock()
        # Calls outside a step (DataLoader waits, user phases) collect here and
        # belong to the next step that begins.
        self._acc: dict[str, Phase] = {}
        self._t0 = 0
        self.fwd = Slot()
        self.bwd = Slot()
        self.opt = Slot()
        self.h2d = Slot()
        # What init's mode times automatically; the rest only through traceml.wrap_*
        # (mode="manual"/"selective"). Hooks installed by an earlier init of the
        # process read these, so they time nothing a later config left out.
        # (auto_forward and auto_optimizer are their slots' ``auto``.)
        self.fwd.auto = auto_forward
        self.opt.auto = auto_optimizer
        self.auto_backward = auto_backward
        self.auto_dataloader = auto_dataloader
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
        self._pending: deque[PendingStep] = deque()
        self._seq_time = seq_time
        self._seq_mem = seq_mem
        # True when a background thread calls ``build_ended`` (the sender's, before
        # each flush): a step off CUDA then leaves only its numbers here, and its
        # items are built there, off the training thread, where building and sending
        # them would be a large part of what a traced step costs.
        self.defer = wake_builder is not None
        # Where a step off CUDA goes as its two items already encoded (in C, skipping
        # the dicts, which are most of what building a step costs), when the sink
        # takes them.
        self.encoded_sink = encoded_sink
        self.wake_builder = wake_builder
        # A waiting step is its phases (``_ended``) and its (step, time, device)
        # (``_ended_at``, appended first, so a builder that sees the one finds the other).
        # Kept apart, and the phase dicts reused (``_spare_acc``), so that a step
        # leaves no new container behind on the training thread: thousands of them
        # waiting for the builder would move into the garbage collector's oldest
        # generation and bring on full collections of the whole process (long pauses
        # under Lightning; docs/benchmarks.md). A tuple of numbers and a str is
        # untracked at its first collection.
        self._ended: deque[dict[str, Phase]] = deque()
        self._ended_at: deque[tuple[int, int, str]] = deque()
        # Phase dicts of CPU steps already sent, with their phases zeroed (n_calls 0,
        # host-only): a step's phases are then there from its first call, which
        # takes the common case of close() and add_host() (the C core's), and no
        # Phase is made. Phases with no call are left out of the items.
        self._spare_acc: list[dict[str, Phase]] = []
        # MAX_ENDED_STEPS and ENDED_WAKE_AT, read when the timer is made.
        self._max_ended = MAX_ENDED_STEPS
        self._wake_at = ENDED_WAKE_AT
        # The collectives of each step, told when a step's items are built (init's
        # runtime gives one; a timer made on its own has none).
        self.collectives: StepsObserver | None = None
        # The torch hooks that report to this timer (given by their ``activate``).
        self.hooks: TimerHooks | None = None
        # The user phases open now (trace_phase), innermost last: where a collective
        # issued outside the built-in phases is attributed.
        self.user_phases: list[str] = []
        # Tokens of the steps that said theirs (trace_step(tokens=), record_tokens),
        # by step number; taken when the step's item is built. Empty for a run that
        # never says tokens: its steps take the paths they always took.
        # A value is an int, or a list of an int and 0-d tensors (record_batch_tokens on
        # an accelerator: read on the builder's thread, never synchronizing the step).
        self._tokens: dict[int, Any] = {}

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

    # -- tokens ---------------------------------------------------------------

    def record_tokens(self, n: int) -> bool:
        """Add ``n`` tokens to the open step (the training thread's); False outside
        one (nothing is kept)."""
        if not self.in_step or _get_ident() != self.thread:
            return False
        step = self.step
        tokens = self._tokens
        held = tokens.get(step, 0)
        if type(held) is list:
            held[0] += n
        else:
            tokens[step] = held + n
        return True

    def record_tokens_later(self, count: Any) -> bool:
        """Add a 0-d tensor's value to the open step's tokens, read when the step's item
        is built (off the training thread, after the step's work): a count on the GPU is
        never waited for here. False outside a step."""
        if not self.in_step or _get_ident() != self.thread:
            return False
        step = self.step
        tokens = self._tokens
        held = tokens.get(step, 0)
        if type(held) is list:
            held.append(count)
        else:
            tokens[step] = [held, count]
        return True

    def _take_tokens(self, step: int) -> int | None:
        """The tokens of ``step`` (None: it said none), forgotten."""
        held = self._tokens.pop(step, None)
        if held is None or type(held) is int:
            return held
        total = 0
        for part in held:
            try:
                total += int(part)
            except Exception:
                return None
        return total if total >= 0 else None

    # -- failure --------------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        """Stop measuring after an internal error; training goes on."""
        self.enabled = False
        self.in_step = False
        if self.hooks is not None:
            self.hooks.release(self)
        self._on_error(exc)

    # -- where a call made now belongs ------------------------------------------

    def phase_now(self) -> tuple[int, str]:
        """The step and the phase a call made now on the training thread belongs to:
        the innermost open phase (optimizer, backward, forward, host-to-device, then the
        user's), the step itself, or between steps (counted with the next step)."""
        if not self.in_step:
            return self.step + 1, BETWEEN_STEPS
        step = self.step
        if self.opt.depth:
            return step, OPTIMIZER_STEP
        if self.bwd.depth:
            return step, BACKWARD
        if self.fwd.depth:
            return step, FORWARD
        if self.h2d.depth:
            return step, H2D
        phases = self.user_phases
        return step, phases[-1] if phases else STEP_TIME

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
        if self.auto_forward and self.hooks is not None:
            self.hooks.hook_model(model)
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
            self._probe_at = device_of(probe)
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

    def _encoding_sink(self) -> EncodedItemSink | None:
        """Where steps go encoded in C, or None: as dicts, to the sink's ``put``."""
        if _encode_host_step is None or _encode_host_steps is None:
            return None
        return self.encoded_sink

    def _send_host(self, step: int, ts: int, device: str, acc: dict[str, Phase]) -> None:
        """Both items of a step off CUDA, then its phases zeroed for a later step."""
        if self._encoding_sink() is None:
            if self.collectives is not None:
                self.collectives.steps_ended((acc,), ((step, ts, device),))
            self._send_host_items(step, ts, device, acc)
        else:
            self._send_hosts(deque((acc,)), deque(((step, ts, device),)))

    def _send_hosts(
        self, ended: deque[dict[str, Phase]], ended_at: deque[tuple[int, int, str]]
    ) -> None:
        """:meth:`_send_host` of each step of ``ended`` (its phases) and ``ended_at``
        (its step, time and device), taken off both in order: encoded in C and handed
        to the encoded sink in one ``put_encoded_many`` call per stream (a call per step
        through the recorder and the sender's queues would cost the sender's thread
        more than the encoding); a step the encoder leaves to Python, or every step
        without an encoded sink, as dicts to the sink's ``put``."""
        collectives = self.collectives
        if collectives is not None:
            collectives.steps_ended(ended, ended_at)
        encoded_sink = self._encoding_sink()
        if encoded_sink is None or _encode_host_steps is None:
            while ended:
                acc = ended.popleft()
                step, ts, device = ended_at.popleft()
                self._send_host_items(step, ts, device, acc)
            return
        tokens = self._tokens
        if not tokens:
            self._encode_hosts(encoded_sink, ended, ended_at)
            return
        # A step with tokens is built as dicts (the C encoder writes no tokens); the
        # steps between them go encoded, in order.
        while ended:
            if ended_at[0][0] in tokens:
                acc = ended.popleft()
                step, ts, device = ended_at.popleft()
                self._send_host_items(step, ts, device, acc)
                continue
            run: deque[dict[str, Phase]] = deque()
            run_at: deque[tuple[int, int, str]] = deque()
            while ended and ended_at[0][0] not in tokens:
                run.append(ended.popleft())
                run_at.append(ended_at.popleft())
            self._encode_hosts(encoded_sink, run, run_at)

    def _encode_hosts(
        self,
        encoded_sink: EncodedItemSink,
        ended: deque[dict[str, Phase]],
        ended_at: deque[tuple[int, int, str]],
    ) -> None:
        """The C encoder's loop over ``ended`` (steps without tokens)."""
        assert _encode_host_steps is not None
        while ended:
            steps, memories, times, self._seq_time, self._seq_mem, stop = _encode_host_steps(
                _encode_host_step, ended, ended_at, self._spare_acc, self._seq_time, self._seq_mem
            )
            # What was built goes out even when a later step raised.
            if steps:
                encoded_sink.put_encoded_many("step_memory", memories)
                encoded_sink.put_encoded_many("step_time", times)
            if isinstance(stop, BaseException):
                raise stop
            if stop is not None:
                # The ones before it went first: seq and step stay in order.
                self._send_host_items(*stop)

    def _send_host_items(self, step: int, ts: int, device: str, acc: dict[str, Phase]) -> None:
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
        if self.collectives is not None:
            self.collectives.discard(self.step)
        self._tokens.pop(self.step, None)
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
        if self.collectives is not None:
            self.collectives.flush()

    def _emit_host(self, step: int, ts: int, device: str, acc: dict[str, Phase]) -> None:
        """``_emit`` for a step off CUDA (host time only), each event built in one go.

        A plain loop, not a dict comprehension: on Python 3.11 the comprehension
        builds a function and a frame per step.
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
        if self._tokens:
            tokens = self._take_tokens(step)
            if tokens is not None:
                item["tokens"] = tokens
        self._sink.put("step_time", item)

    def _emit(self, pending: PendingStep) -> None:
        collectives = self.collectives
        if collectives is not None:
            collectives.steps_ended((pending.acc,), ((pending.step, pending.ts, pending.device),))
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
            gpu_ms = None if not cuda or name in HOST_ONLY else _gpu_ms(phase, done)
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
        if self._tokens:
            tokens = self._take_tokens(pending.step)
            if tokens is not None:
                item["tokens"] = tokens
        self._sink.put("step_time", item)
        if measured:
            # Both events of every pair read completed, and the step is dropped with
            # ``pending``: nothing reads them again before they are recorded again.
            self._cuda.release_events(int(device[5:]), measured)


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
            timer.user_phases.append(self._name)
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
        phases = timer.user_phases
        if phases and phases[-1] == self._name:
            phases.pop()
        if not timer.enabled:
            return
        try:
            timer.user_phase_end(self._name, self._t0, self._ev0)
        except Exception as error:
            timer.fail(error)
