"""Collectives on this rank: per step, phase and operation, how many, how long the
rank waited in them, and when it arrived at the first and the last.

What the straggler analysis needs to see through a synchronizing collective: the rank
that arrives last waits least, so a rank's *own work* is its iteration less its wait.

Seen here:

- ``torch.distributed``'s collective functions (``all_reduce``, ``all_gather*``,
  ``reduce_scatter*``, ``broadcast``, ``barrier``, ``send``/``recv``, ...), patched on
  ``torch.distributed`` and ``torch.distributed.distributed_c10d`` so that user code,
  FSDP1 and FSDP2 (``fully_shard``) calls are timed; a call made inside another (an
  object collective's inner broadcast) counts once, as the outer one.
- DDP's gradient buckets, through a communication hook: the user's own hook is wrapped
  when registered (``DistributedDataParallel.register_comm_hook``), and a DDP model
  that reaches its first forward without one gets DDP's default all-reduce as a Python
  hook, the same arithmetic (divide by the world size, then sum); a hook registered
  after that (DDP takes one per model), or a built-in one, runs through it.

What ``wait_ms`` is, by backend:

- gloo and other host backends (``wait_measure`` ``host``): the host time the rank is
  blocked where that happens: a synchronous call's duration, a ``Work.wait()`` called
  from Python, and for DDP's buckets (waited inside DDP's C++ reducer) the time from the
  rank's last bucket to the completion of its last all-reduce (a future chained to the
  one DDP waits for, so it is noted before backward returns);
- NCCL (``device``): each collective's kernel time from its ``Work``, read once it has
  completed (``Work._get_duration()``: timing is on when ``TORCH_NCCL_ENABLE_TIMING=1``
  was set before the process group was made, which ``traceml run`` does, and the
  recorder also turns it on at the group's first collective), never by synchronizing
  the device; a Work without timing gives ``none`` and ``wait_ms`` null. A call that
  returns no Work (one that waits in C++, as DDP's parameter broadcast when the model
  is wrapped) counts its host time, ``host``. Arrival is the host issue time.

A call on another thread than the training thread, and collectives an engine issues
without these functions (a C++ ``ProcessGroup`` call, a built-in C++ hook registered
before the first forward, compiled functional collectives), are not seen; the summary says when a distributed
run's rank showed none.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

from traceml_ai.rank import _parallel
from traceml_records import events as _events

if TYPE_CHECKING:
    from traceml_ai.rank._step_timer import StepTimer
    from traceml_ai.rank.sink import ItemSink

FORWARD = _events.FORWARD_TIME
BACKWARD = _events.BACKWARD_TIME
OPTIMIZER = _events.OPTIMIZER_STEP
H2D = _events.H2D_TIME
IN_STEP = STEP_TIME_EVENT = _events.STEP_TIME
BETWEEN_STEPS = _events.BETWEEN_STEPS

OP_OF_FUNCTION: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather_coalesced": "all_gather",
    "all_gather_object": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "broadcast": "broadcast",
    "broadcast_object_list": "broadcast",
    "_broadcast_coalesced": "broadcast",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
    "send": "send",
    "isend": "send",
    "send_object_list": "send",
    "recv": "recv",
    "irecv": "recv",
    "recv_object_list": "recv",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "reduce": "reduce",
    "gather": "gather",
    "gather_object": "gather",
    "scatter": "scatter",
    "scatter_object_list": "scatter",
}
"""The torch.distributed functions timed, and the operation each one is."""

PAYLOAD_OF_FUNCTION: dict[str, str] = {
    "all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "all_gather": "tensor",
    "all_gather_single": "input_tensor",
    "all_gather_into_tensor": "input_tensor",
    "_all_gather_base": "input_tensor",
    "all_gather_coalesced": "input_tensor_list",
    "reduce_scatter": "input_list",
    "reduce_scatter_single": "input",
    "reduce_scatter_tensor": "input",
    "_reduce_scatter_base": "input",
    "broadcast": "tensor",
    "send": "tensor",
    "isend": "tensor",
    "recv": "tensor",
    "irecv": "tensor",
    "all_to_all": "input_tensor_list",
    "all_to_all_single": "input",
    "reduce": "tensor",
    "gather": "tensor",
    "scatter": "tensor",
}
"""The parameter holding the tensor(s) a function moves, whose bytes its line counts
(object collectives and barriers have none: ``bytes`` null)."""

PEER_OF_FUNCTION: dict[str, tuple[str, str]] = {
    "send": ("dst", "group_dst"),
    "isend": ("dst", "group_dst"),
    "send_object_list": ("dst", "group_dst"),
    "recv": ("src", "group_src"),
    "irecv": ("src", "group_src"),
    "recv_object_list": ("src", "group_src"),
}
"""Point-to-point functions: the parameter naming the peer's global rank, and the one
naming it as a rank of the group."""

SOURCE_DIST = "torch.distributed"
SOURCE_DDP = "ddp_comm_hook"

MAX_WAITING_STEPS = 64
"""NCCL steps whose Work timings are still running; past this many, the oldest is sent
with ``wait_ms`` null for what has not completed rather than waiting longer."""
MAX_OPEN_CALLS = 4096
"""Collectives of steps not yet ended that one rank may hold; past it (a loop that
never ends a step), the oldest are dropped and counted."""
MAX_ASYNC_WORKS = 1024
"""Async works whose Python ``wait()`` is still awaited; past it, the oldest are
forgotten (their wait counts 0)."""

_perf_ns = time.perf_counter_ns
_wall_ns = time.time_ns
_get_ident = threading.get_ident


Call: TypeAlias = list[Any]
"""One collective as issued, a list (made on every collective: cheaper than an
object): ``[step, phase, op, source, arrival_ns, wait_ns, done_ns, work, group, peer,
bytes]`` — arrival on the wall clock (``time.time_ns``, as the step ends are), the host
wait, for DDP's buckets on a host backend when the all-reduce completed, on NCCL the
Work whose duration is read once it has completed; the process group as passed (None:
the default group; classified when the step's items are built, off the training
thread), the peer of a point-to-point call (its global rank, or ``(GROUP_PEER, rank
in the group)``) and the tensor bytes (None: not known)."""
STEP, PHASE, OP, SOURCE, ARRIVAL, WAIT, DONE, WORK, GROUP, PEER, BYTES = range(11)

GROUP_PEER = "group_peer"
"""A peer named by its rank in the call's group (``group_dst``/``group_src``)."""


class _Spec:
    """Where a timed function's arguments are: ``async_op``, ``group``, the tensor(s)
    it moves and, point-to-point, its peer (positions from its signature)."""

    __slots__ = (
        "async_index",
        "group_index",
        "group_peer_name",
        "payload_index",
        "payload_name",
        "peer_index",
        "peer_name",
    )

    def __init__(self, name: str, function: Callable[..., Any]) -> None:
        try:
            names = list(inspect.signature(function).parameters)
        except (TypeError, ValueError):
            names = []
        self.async_index = names.index("async_op") if "async_op" in names else None
        self.group_index = names.index("group") if "group" in names else None
        self.payload_name = PAYLOAD_OF_FUNCTION.get(name)
        self.payload_index = names.index(self.payload_name) if self.payload_name in names else None
        peer = PEER_OF_FUNCTION.get(name)
        self.peer_name = peer[0] if peer is not None else None
        self.group_peer_name = peer[1] if peer is not None else None
        self.peer_index = names.index(self.peer_name) if self.peer_name in names else None


def _nbytes(payload: Any) -> int | None:
    """The bytes of a tensor, or of a list of tensors (None: not tensors)."""
    if payload is None:
        return None
    if isinstance(payload, (list, tuple)):
        total = 0
        for tensor in payload:
            n = getattr(tensor, "nbytes", None)
            if type(n) is not int:
                return None
            total += n
        return total
    n = getattr(payload, "nbytes", None)
    return n if type(n) is int else None


def _details(
    spec: _Spec, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Any, int | None]:
    """A call's process group, peer and tensor bytes, from its arguments."""
    n = len(args)
    index = spec.group_index
    group = args[index] if index is not None and index < n else kwargs.get("group")
    index = spec.payload_index
    name = spec.payload_name
    payload = (
        args[index] if index is not None and index < n else (kwargs.get(name) if name else None)
    )
    peer: Any = None
    name = spec.peer_name
    if name is not None:
        index = spec.peer_index
        peer = args[index] if index is not None and index < n else kwargs.get(name)
        if peer is None:
            local = kwargs.get(spec.group_peer_name or "")
            if local is not None:
                peer = (GROUP_PEER, local)
    return group, peer, _nbytes(payload)


class _Group:
    __slots__ = ("bytes", "first", "last", "measure", "n", "wait_ms")

    def __init__(self) -> None:
        self.n = 0
        self.wait_ms: float | None = 0.0
        self.measure = "host"
        self.first = 0.0
        self.last = 0.0
        self.bytes: int | None = None
        """The known calls' tensor bytes (an object collective's size is not known)."""


class CollectiveRecorder:
    """Collects this rank's collectives and sends one ``collectives`` item per step,
    phase and operation once the step ended (``step_ended``, from the step timer's
    builder)."""

    def __init__(
        self,
        timer: StepTimer,
        sink: ItemSink,
        *,
        first_seq: int = 0,
        on_error: Callable[[BaseException], None] | None = None,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        self._timer = timer
        self._sink = sink
        self._on_error = on_error
        self._on_drop = on_drop
        self.next_seq = first_seq
        self._busy = False
        self._ddp_source = False
        self._backend: str | None = None
        self._backend_known = False
        self._device_timing = False
        self._calls: deque[Call] = deque()
        self._async: dict[int, Call] = {}
        # Ended steps whose items wait (NCCL: for their Works): (step, its start and
        # end, the previous step's end or None, its calls).
        self._waiting: deque[tuple[int, int, int, int | None, list[Call]]] = deque()
        self._last_end_ns: int | None = None
        self._last_step = -1
        self._lock = threading.Lock()
        self.dropped = 0
        self.enabled = True

    # -- the training thread ------------------------------------------------------

    def _where(self) -> tuple[int, str]:
        timer = self._timer
        if not timer.in_step:
            return timer.step + 1, BETWEEN_STEPS
        if timer.opt.depth:
            return timer.step, OPTIMIZER
        if timer.bwd.depth:
            return timer.step, BACKWARD
        if timer.fwd.depth:
            return timer.step, FORWARD
        if timer.h2d.depth:
            return timer.step, H2D
        phases = timer.user_phases
        return timer.step, phases[-1] if phases else IN_STEP

    def _learn_backend(self) -> None:
        self._backend_known = True
        try:
            import torch.distributed as dist

            self._backend = str(dist.get_backend())
        except Exception:
            self._backend = None
        self._device_timing = self._backend == "nccl"
        if self._device_timing:
            _enable_nccl_timing()

    def begin(self, op: str, source: str) -> Call | None:
        """A collective begins on this thread; None when it is not measured (another
        thread than the training thread, except DDP's hook on autograd's thread;
        inside another collective; TraceML off)."""
        if self._busy or not self.enabled:
            return None
        timer = self._timer
        if not timer.enabled:
            return None
        if _get_ident() != timer.thread and source != SOURCE_DDP and not self._ddp_source:
            # DDP's hook runs where autograd runs backward: on CUDA, the engine's
            # device thread while the training thread waits in backward().
            return None
        try:
            if not self._backend_known:
                self._learn_backend()
            step, phase = self._where()
        except Exception as exc:
            self.fail(exc)
            return None
        if self._ddp_source:
            source = SOURCE_DDP
        call: Call = [step, phase, op, source, _wall_ns(), 0, 0, None, None, None, None]
        calls = self._calls
        if len(calls) >= MAX_OPEN_CALLS:
            self._drop_oldest()
        calls.append(call)
        self._busy = True
        return call

    def _drop_oldest(self) -> None:
        """More than MAX_OPEN_CALLS collectives and no step ended (a loop of collectives
        outside any traced step): the oldest goes, said once, and counted."""
        self._calls.popleft()
        self.dropped += 1
        if self.dropped == 1 and self._on_drop is not None:
            self._on_drop(
                f"traceml: more than {MAX_OPEN_CALLS} collectives issued while no traced "
                "step ended; the oldest are left out of the collectives stream"
            )

    def fail(self, exc: BaseException) -> None:
        """Stop measuring collectives after an internal error (said once through
        ``on_error``); step timing and training go on."""
        self.enabled = False
        self._busy = False
        if self._on_error is not None:
            self._on_error(exc)

    def call(
        self,
        original: Callable[..., Any],
        op: str,
        spec: _Spec,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run a torch.distributed function, timing it as ``op`` (``spec``: where its
        ``async_op``, ``group``, tensors and peer are)."""
        timer = self._timer
        if (
            self._busy
            or self._device_timing
            or not self._backend_known
            or not self.enabled
            or not timer.enabled
            or _get_ident() != timer.thread
        ):
            return self._call(original, op, spec, args, kwargs)
        # The common case (a host backend, the training thread) without a call:
        # _where() and begin() inlined (a method call each would add a fifth to what a
        # collective costs here; bench/overhead/collectives.py).
        if not timer.in_step:
            step, phase = timer.step + 1, BETWEEN_STEPS
        else:
            step = timer.step
            if timer.opt.depth:
                phase = OPTIMIZER
            elif timer.bwd.depth:
                phase = BACKWARD
            elif timer.fwd.depth:
                phase = FORWARD
            elif timer.h2d.depth:
                phase = H2D
            else:
                phases = timer.user_phases
                phase = phases[-1] if phases else IN_STEP
        calls = self._calls
        if len(calls) >= MAX_OPEN_CALLS:
            self._drop_oldest()
        group, peer, nbytes = _details(spec, args, kwargs)
        self._busy = True
        t0 = _wall_ns()
        try:
            result = original(*args, **kwargs)
        finally:
            self._busy = False
        if result is None:
            calls.append(
                [step, phase, op, SOURCE_DIST, t0, _wall_ns() - t0, 0, None, group, peer, nbytes]
            )
            return result
        call: Call = [step, phase, op, SOURCE_DIST, t0, 0, 0, None, group, peer, nbytes]
        calls.append(call)
        if _is_work(result):
            self._await(result, call)
        else:
            call[WAIT] = _wall_ns() - t0
        return result

    def _await(self, work: Any, call: Call) -> None:
        """An asynchronous call on the host: its wait is where Python waits for it."""
        asynchronous = self._async
        if len(asynchronous) >= MAX_ASYNC_WORKS:
            asynchronous.pop(next(iter(asynchronous)))
        asynchronous[id(work)] = call

    def _call(
        self,
        original: Callable[..., Any],
        op: str,
        spec: _Spec,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """:meth:`call` in every other case: not measured, or on NCCL."""
        call = self.begin(op, SOURCE_DIST)
        if call is None:
            return original(*args, **kwargs)
        try:
            call[GROUP], call[PEER], call[BYTES] = _details(spec, args, kwargs)
        except Exception as exc:
            self._busy = False
            self.fail(exc)
            return original(*args, **kwargs)
        async_index = spec.async_index
        device = self._device_timing
        forced = False
        try:
            if (
                device
                and async_index is not None
                and kwargs.get("async_op") is not True
                and len(args) <= async_index
            ):
                # NCCL: the synchronous form is the asynchronous one and a wait(); the
                # Work then gives the kernel's duration once it has completed.
                kwargs = dict(kwargs, async_op=True)
                forced = True
            result = original(*args, **kwargs)
            t1 = _wall_ns()
        finally:
            self._busy = False
        work = result if _is_work(result) else None
        if device and work is not None:
            call[WORK] = work
            if forced:
                self._busy = True
                try:
                    work.wait()
                finally:
                    self._busy = False
                return None
            return result
        if work is None:
            call[WAIT] = t1 - call[ARRIVAL]
        else:
            self._await(work, call)
        return result

    def batch(
        self, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run ``batch_isend_irecv``: each ``P2POp`` counts as a ``send`` or ``recv`` with
        its peer and bytes (the isend/irecv it issues inside count as these)."""
        ops: Any = args[0] if args else kwargs.get("p2p_op_list")
        first = self.begin("send", SOURCE_DIST) if ops else None
        if first is None:
            return original(*args, **kwargs)
        calls: list[Call] = []
        try:
            self._calls.pop()  # begin() appended it; each op is appended below
            for p2p in ops:
                kind = getattr(getattr(p2p, "op", None), "__name__", "")
                call = list(first)
                call[OP] = "recv" if kind == "irecv" else "send"
                peer: Any = getattr(p2p, "peer", None)
                if peer is None and getattr(p2p, "group_peer", None) is not None:
                    peer = (GROUP_PEER, p2p.group_peer)
                call[GROUP] = getattr(p2p, "group", None)
                call[PEER] = peer
                call[BYTES] = _nbytes(getattr(p2p, "tensor", None))
                calls.append(call)
        except Exception as exc:
            self._busy = False
            self.fail(exc)
            return original(*args, **kwargs)
        try:
            result = original(*args, **kwargs)
            t1 = _wall_ns()
        finally:
            self._busy = False
        for call in calls:
            if len(self._calls) >= MAX_OPEN_CALLS:
                self._drop_oldest()
            self._calls.append(call)
        works = [w for w in (result or ()) if _is_work(w)]
        if len(works) == len(calls):
            for call, work in zip(calls, works, strict=True):
                if self._device_timing:
                    call[WORK] = work
                else:
                    self._await(work, call)
        elif works and self._device_timing:
            calls[0][WORK] = works[0]  # one coalesced Work: its time counts once
        else:
            calls[0][WAIT] = t1 - calls[0][ARRIVAL]
            for work in works:
                self._await(work, calls[0])
        return result

    def waited(self, work: Any, dt_ns: int) -> None:
        """``Work.wait()`` returned after ``dt_ns`` on this thread."""
        call = self._async.pop(id(work), None)
        if call is not None:
            call[WAIT] += dt_ns

    def bucket_done(self, call: Call) -> None:
        """A DDP bucket's all-reduce completed (any thread)."""
        call[DONE] = _wall_ns()

    def discard(self, step: int) -> None:
        """A step whose body raised is dropped: so are its collectives."""
        with self._lock:
            self._calls = deque(c for c in self._calls if c[STEP] != step)

    # -- the builder's thread -----------------------------------------------------

    def steps_ended(self, ended: Any, ended_at: Any) -> None:
        """:meth:`step_ended` of each step the timer builds now (``ended``: their phases,
        ``ended_at``: their (step, end, device)); one test when no collective waits,
        as in every step of a single-process run."""
        if not self._calls and not self._waiting:
            if ended_at:
                step, end_ns, _ = ended_at[-1]
                if step > self._last_step:
                    self._last_step = step
                    self._last_end_ns = end_ns
            return
        for acc, (step, end_ns, _) in zip(ended, ended_at, strict=False):
            phase = acc.get(STEP_TIME_EVENT)
            self.step_ended(step, end_ns, phase.cpu_ns if phase is not None else 0)

    def step_ended(self, step: int, end_ns: int, step_ns: int) -> None:
        """Step ``step`` ended at ``end_ns`` (wall) after ``step_ns``: send its items
        (NCCL: once its Works completed)."""
        with self._lock:
            if step <= self._last_step:
                return
            self._last_step = step
            calls = self._calls
            mine: list[Call] = []
            while calls and calls[0][STEP] <= step:
                mine.append(calls.popleft())
            previous = self._last_end_ns
            self._last_end_ns = end_ns
            if mine:
                self._waiting.append((step, end_ns - step_ns, end_ns, previous, mine))
            self._send_ready(final=False)

    def flush(self) -> None:
        """Send every step still waiting for NCCL timings (shutdown, summary)."""
        with self._lock:
            self._send_ready(final=True)

    def _send_ready(self, final: bool) -> None:
        waiting = self._waiting
        while waiting:
            calls = waiting[0][-1]
            if not final and len(waiting) <= MAX_WAITING_STEPS and not _completed(calls):
                return
            self._send(*waiting.popleft())

    def _send(
        self, step: int, start_ns: int, end_ns: int, previous: int | None, calls: list[Call]
    ) -> None:
        groups: dict[tuple[str, str, str, str, int | None], _Group] = {}
        ddp_done: dict[tuple[str, str, str, str, int | None], tuple[int, int]] = {}
        layout = _parallel.current_layout() if calls else None
        has_pp = layout is not None and "pp" in layout.dims
        # Between steps, arrivals count from the previous step's end (the first step:
        # from its first collective).
        between = previous
        if between is None:
            between = min((c[ARRIVAL] for c in calls if c[PHASE] == BETWEEN_STEPS), default=0)
        for (
            _step, phase, op, source, arrival, wait_ns, done_ns, work, pg, peer, nbytes
        ) in calls:  # fmt: skip
            label = _parallel.group_label(pg, layout)
            if peer is not None:
                peer = _global_peer(pg, peer)
                if label == "world" and peer is not None:
                    # A send or receive on the default group runs over the dimension
                    # in which this rank and its peer differ (a pipeline's next stage).
                    label = _parallel.pair_label(layout, peer)
            key = (phase, op, source, label, peer)
            group = groups.get(key)
            if group is None:
                group = groups[key] = _Group()
            if nbytes is not None:
                group.bytes = nbytes if group.bytes is None else group.bytes + nbytes
            origin = between if phase == BETWEEN_STEPS else start_ns
            at = max(0.0, (arrival - origin) / 1e6)
            if group.n == 0:
                group.first = at
            group.last = max(group.last, at)
            group.n += 1
            if work is not None:
                group.measure = "device"
                ms = _device_ms(work)
                if ms is None or group.wait_ms is None:
                    group.wait_ms = None
                else:
                    group.wait_ms += ms
            elif source == SOURCE_DDP:
                if done_ns <= 0:
                    group.wait_ms = None
                    continue
                last_arrival, last_done = ddp_done.get(key, (0, 0))
                ddp_done[key] = (max(last_arrival, arrival), max(last_done, done_ns))
            elif group.wait_ms is not None:
                group.wait_ms += wait_ns / 1e6
        for key, (last_arrival, last_done) in ddp_done.items():
            group = groups[key]
            if group.wait_ms is not None:
                # DDP waits for its buckets in C++ at the end of backward: the rank is
                # blocked from its last bucket until its last all-reduce completed.
                group.wait_ms = max(0.0, (last_done - last_arrival) / 1e6)
        backend = self._backend
        sink = self._sink
        for (phase, op, source, label, peer), group in sorted(
            groups.items(), key=lambda kv: kv[1].first
        ):
            peer_stage = None
            if peer is not None and has_pp and layout is not None:
                peer_stage = layout.coordinate(peer, "pp")
            seq = self.next_seq
            self.next_seq = seq + 1
            wait = group.wait_ms
            sink.put(
                "collectives",
                {
                    "timestamp_unix_ns": end_ns,
                    "seq": seq,
                    "step": step,
                    "phase": phase,
                    "op": op,
                    "source": source,
                    "backend": backend,
                    "n_calls": group.n,
                    "wait_ms": wait,
                    "wait_measure": "none" if wait is None else group.measure,
                    "first_arrival_ms": group.first,
                    "last_arrival_ms": group.last,
                    "group": label,
                    "peer_rank": peer,
                    "peer_stage": peer_stage,
                    "bytes": group.bytes,
                },
            )


def _global_peer(group: Any, peer: Any) -> int | None:
    """A point-to-point call's peer as a global rank (None: not known)."""
    if type(peer) is int:
        return peer if peer >= 0 else None
    if isinstance(peer, tuple) and len(peer) == 2 and peer[0] == GROUP_PEER:
        try:
            import torch.distributed as dist

            if group is None:
                return int(peer[1])
            return int(dist.get_global_rank(group, int(peer[1])))
        except Exception:
            return None
    try:
        value = int(peer)
    except Exception:
        return None
    return value if value >= 0 else None


def _enable_nccl_timing() -> None:
    """Ask the default NCCL group to time its collectives from now on, as
    ``TORCH_NCCL_ENABLE_TIMING=1`` does from its start (``traceml run`` sets that; a
    run started otherwise gets its Works timed from its first collective on)."""
    with contextlib.suppress(Exception):
        from torch.distributed import distributed_c10d

        group: Any = distributed_c10d._get_default_group()
        group._enable_collectives_timing()  # not in torch's stubs; there since 2.4


def _completed(calls: list[Call]) -> bool:
    for call in calls:
        work = call[WORK]
        if work is not None:
            try:
                if not work.is_completed():
                    return False
            except Exception:
                continue
    return True


def _device_ms(work: Any) -> float | None:
    if work is None:
        return None
    try:
        if not work.is_completed():
            return None
        # torch names it ``_get_duration`` (2.4 to 2.13 at least); a later public name
        # is taken when it appears.
        duration = getattr(work, "get_duration", None) or work._get_duration
        ms = float(duration())
    except Exception:
        return None
    return ms if ms >= 0.0 and ms == ms else None


def _is_work(value: object) -> bool:
    return value is not None and hasattr(value, "wait") and hasattr(value, "is_completed")


# --------------------------------------------------------------------------- patches

_active: CollectiveRecorder | None = None
_installed = False


def activate(recorder: CollectiveRecorder | None) -> None:
    """Make ``recorder`` the one the patches report to (None: they only pass through)."""
    global _active
    _active = recorder


def active() -> CollectiveRecorder | None:
    """The recorder the patches report to."""
    return _active


def _timed(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    op = OP_OF_FUNCTION[name]
    spec = _Spec(name, original)

    def collective(*args: Any, **kwargs: Any) -> Any:
        recorder = _active
        if recorder is None:
            return original(*args, **kwargs)
        return recorder.call(original, op, spec, args, kwargs)

    collective.__wrapped__ = original  # type: ignore[attr-defined]
    collective.__name__ = getattr(original, "__name__", name)
    collective.__qualname__ = getattr(original, "__qualname__", name)
    collective.__doc__ = getattr(original, "__doc__", None)
    collective.__traceml_collective__ = True  # type: ignore[attr-defined]
    return collective


def _timed_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    def batch_isend_irecv(*args: Any, **kwargs: Any) -> Any:
        recorder = _active
        if recorder is None:
            return original(*args, **kwargs)
        return recorder.batch(original, args, kwargs)

    functools.update_wrapper(batch_isend_irecv, original)
    batch_isend_irecv.__traceml_collective__ = True  # type: ignore[attr-defined]
    return batch_isend_irecv


def _timed_wait(original: Callable[..., Any]) -> Callable[..., Any]:
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        recorder = _active
        if recorder is None or recorder._busy or not recorder._async:
            return original(self, *args, **kwargs)
        t0 = _perf_ns()
        try:
            return original(self, *args, **kwargs)
        finally:
            if _get_ident() == recorder._timer.thread:
                recorder.waited(self, _perf_ns() - t0)

    wait.__wrapped__ = original  # type: ignore[attr-defined]
    wait.__traceml_collective__ = True  # type: ignore[attr-defined]
    return wait


def install(dist: Any) -> None:
    """Patch ``torch.distributed``'s collectives, ``Work.wait`` and DDP's hook
    registration (once per process; the patches pass through without a recorder)."""
    global _installed
    if _installed:
        return
    _installed = True
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    # One wrapper per function, whichever module names it: torch compares them by
    # identity (``P2POp(dist.isend, ...)`` against distributed_c10d's ``isend``).
    made: dict[int, Callable[..., Any]] = {}
    for module in (dist, c10d):
        if module is None:
            continue
        for name in (*OP_OF_FUNCTION, "batch_isend_irecv"):
            original = getattr(module, name, None)
            if original is None or getattr(original, "__traceml_collective__", False):
                continue
            with contextlib.suppress(Exception):
                wrapper = made.get(id(original))
                if wrapper is None:
                    if name == "batch_isend_irecv":
                        wrapper = _timed_batch(original)
                    else:
                        wrapper = _timed(name, original)
                    made[id(original)] = wrapper
                setattr(module, name, wrapper)
    work_class = getattr(dist, "Work", None)
    if work_class is not None and not getattr(work_class.wait, "__traceml_collective__", False):
        with contextlib.suppress(Exception):
            work_class.wait = _timed_wait(work_class.wait)
    with contextlib.suppress(Exception):
        from torch.nn.parallel import DistributedDataParallel

        _patch_ddp(DistributedDataParallel)


# --------------------------------------------------------------------------- DDP


def _wrap_hook(hook: Callable[..., Any], group: Any = None) -> Callable[..., Any]:
    """A DDP communication hook that reports each bucket, around ``hook`` (``group``:
    the DDP model's process group, None for the default one)."""

    def traced_hook(state: Any, bucket: Any) -> Any:
        recorder = _active
        if recorder is None:
            return hook(state, bucket)
        if recorder._device_timing:
            # NCCL: the hook's own torch.distributed call is timed from its Work.
            recorder._ddp_source = True
            try:
                return hook(state, bucket)
            finally:
                recorder._ddp_source = False
        call = recorder.begin("all_reduce", SOURCE_DDP)
        if call is not None:
            call[GROUP] = group
            try:
                call[BYTES] = _nbytes(bucket.buffer())
            except Exception:
                call[BYTES] = None
        try:
            future = hook(state, bucket)
        finally:
            if call is not None:
                recorder._busy = False
        if call is None:
            return future

        def done(fut: Any) -> Any:
            # Chained, not a done-callback: DDP waits for this future, so the
            # completion is noted before backward returns.
            recorder.bucket_done(call)
            return fut.value()

        return future.then(done)

    # DDP checks a hook's annotations against dist.GradBucket and Future; none is
    # what it accepts from any hook.
    traced_hook.__annotations__ = {}
    traced_hook.__traceml_collective__ = True  # type: ignore[attr-defined]
    return traced_hook


def _default_hook(process_group: Any, bucket: Any) -> Any:
    """DDP's default reduction as a Python hook: divide by the world size, then sum."""
    import torch.distributed as dist

    group: Any = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(group.size())
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


_default_hook.__annotations__ = {}


def _patch_ddp(ddp_class: Any) -> None:
    original = ddp_class.register_comm_hook
    if getattr(original, "__traceml_collective__", False):
        return

    def register_comm_hook(self: Any, state: object, hook: Callable[..., Any]) -> None:
        if self.__dict__.get("_traceml_hooked"):
            # TraceML's hook went in at the first forward: it runs this one from now on
            # (DDP takes one hook per model, and it was taken).
            self.__dict__["_traceml_user_hook"] = (state, hook)
            return
        if not getattr(hook, "__traceml_collective__", False):
            hook = _wrap_hook(hook, getattr(self, "process_group", None))
        original(self, state, hook)

    register_comm_hook.__wrapped__ = original  # type: ignore[attr-defined]
    register_comm_hook.__traceml_collective__ = True  # type: ignore[attr-defined]
    register_comm_hook.__doc__ = original.__doc__
    ddp_class.register_comm_hook = register_comm_hook

    builtin = getattr(ddp_class, "_register_builtin_comm_hook", None)
    if builtin is not None:

        def register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
            if self.__dict__.get("_traceml_hooked"):
                replacement = _python_twin(self, comm_hook_type)
                if replacement is not None:
                    self.__dict__["_traceml_user_hook"] = replacement
                    return
            builtin(self, comm_hook_type)

        register_builtin_comm_hook.__wrapped__ = builtin  # type: ignore[attr-defined]
        register_builtin_comm_hook.__doc__ = builtin.__doc__
        ddp_class._register_builtin_comm_hook = register_builtin_comm_hook

    forward = ddp_class.forward

    def traced_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Before DDP's first backward: the buckets of a model without a hook of its
        # own are then timed (DDP takes a hook until its first iteration).
        if _active is not None and "_traceml_seen" not in self.__dict__:
            self.__dict__["_traceml_seen"] = True
            adopt_model(self)
        return forward(self, *args, **kwargs)

    traced_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    traced_forward.__traceml_collective__ = True  # type: ignore[attr-defined]
    traced_forward.__doc__ = forward.__doc__
    ddp_class.forward = traced_forward


def adopt_model(model: object) -> None:
    """A traced step met ``model``: a DDP model with no communication hook gets DDP's
    default all-reduce as a timed Python hook (a built-in C++ hook is left alone, and
    its buckets are not seen)."""
    if _active is None:
        return
    ddp_class = _ddp_class()
    if ddp_class is None or not isinstance(model, ddp_class):
        return
    if getattr(model, "_comm_hooks", None):
        return  # the user's hook, wrapped when it was registered
    if getattr(model, "reducer", None) is None or getattr(model, "_traceml_hooked", False):
        return
    with contextlib.suppress(Exception):
        model.register_comm_hook(getattr(model, "process_group", None), _ModelHook(model))
        model._traceml_hooked = True


class _ModelHook:
    """The hook TraceML gives a DDP model without one: DDP's default all-reduce, or the
    hook the user registers later (``register_comm_hook`` after the first forward,
    which DDP alone would refuse)."""

    def __init__(self, model: object) -> None:
        self._model = weakref.ref(model)

    def __call__(self, state: Any, bucket: Any) -> Any:
        model = self._model()
        user = model.__dict__.get("_traceml_user_hook") if model is not None else None
        if user is not None:
            return user[1](user[0], bucket)
        return _default_hook(state, bucket)


def _python_twin(model: Any, comm_hook_type: Any) -> tuple[Any, Callable[..., Any]] | None:
    """A built-in C++ hook as its Python twin from torch (None: none known)."""
    try:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        kinds: Any = getattr(dist, "BuiltinCommHookType")  # noqa: B009 (not in its stubs)
        group = getattr(model, "process_group", None)
        if comm_hook_type == kinds.ALLREDUCE:
            return (group, _default_hook)
        if comm_hook_type == kinds.FP16_COMPRESS:
            return (group, default_hooks.fp16_compress_hook)
    except Exception:
        return None
    return None


def _ddp_class() -> Any:
    module = sys.modules.get("torch.nn.parallel.distributed")
    return getattr(module, "DistributedDataParallel", None) if module is not None else None
