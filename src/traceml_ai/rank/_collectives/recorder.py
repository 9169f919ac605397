"""The recorder of this rank's collectives: per step, phase and operation, how many,
how long the rank waited in them, and when it arrived at the first and the last.

What the straggler analysis needs to see through a synchronizing collective: the rank
that arrives last waits least, so a rank's *own work* is its iteration less its wait.

Seen through the patches of ``rank._patches`` (``distributed``, ``ddp``), which hand
each call to the active recorder (``distributed.activate``):

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
before the first forward, compiled functional collectives), are not seen; the summary
says when a distributed run's rank showed none.

The recorder reads the step timer through :class:`StepClock` alone (whether it is on,
its training thread, the step and phase a call made now belongs to), and the timer
tells it of ended steps through ``step_timer.StepsObserver``: neither imports the other.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from traceml_ai.rank._collectives import parallel_layout
from traceml_records import events as _events

if TYPE_CHECKING:
    from traceml_ai.rank.sink import ItemSink

STEP_TIME = _events.STEP_TIME
BETWEEN_STEPS = _events.BETWEEN_STEPS

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


class StepClock(Protocol):
    """The step timer as the recorder reads it."""

    enabled: bool
    """False after the timer's internal error: nothing is measured."""
    thread: int
    """The training thread's ident."""

    def phase_now(self) -> tuple[int, str]:
        """The step and phase a call made now on the training thread belongs to."""
        ...


class CallSpec:
    """Where a timed function's arguments are: ``async_op``, ``group``, the tensor(s)
    it moves and, point-to-point, its peer (positions from its signature); one per
    patched function."""

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
    spec: CallSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Any, int | None]:
    """A call's process group, peer and tensor bytes, from its arguments.

    On the training thread at every collective: one tensor (the usual payload) takes
    one attribute read, and only a list of tensors or anything else goes through
    :func:`_nbytes`; the peer is looked for only for point-to-point functions."""
    n = len(args)
    index = spec.group_index
    group = args[index] if index is not None and index < n else kwargs.get("group")
    index = spec.payload_index
    if index is not None and index < n:
        payload = args[index]
    else:
        name = spec.payload_name
        payload = kwargs.get(name) if name else None
    if payload is None:
        nbytes = None
    else:
        nbytes = getattr(payload, "nbytes", None)
        if type(nbytes) is not int:
            nbytes = _nbytes(payload)
    name = spec.peer_name
    if name is None:
        return group, None, nbytes
    index = spec.peer_index
    peer = args[index] if index is not None and index < n else kwargs.get(name)
    if peer is None:
        local = kwargs.get(spec.group_peer_name or "")
        if local is not None:
            peer = (GROUP_PEER, local)
    return group, peer, nbytes


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
        timer: StepClock,
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

    @property
    def times_on_device(self) -> bool:
        """Whether collectives are timed from their Works (NCCL)."""
        return self._device_timing

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
            step, phase = timer.phase_now()
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
        spec: CallSpec,
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
        # The common case (a host backend, the training thread): begin() inlined (a
        # method call would add a fifth to what a collective costs here;
        # bench/overhead/collectives.py).
        try:
            step, phase = timer.phase_now()
            group, peer, nbytes = _details(spec, args, kwargs)
        except Exception as exc:
            self.fail(exc)
            return original(*args, **kwargs)
        calls = self._calls
        if len(calls) >= MAX_OPEN_CALLS:
            self._drop_oldest()
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
        spec: CallSpec,
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

    def awaits_waits(self) -> bool:
        """Whether a ``Work.wait()`` called now is timed: an asynchronous call on the
        host waits for it, and it is not one made inside a collective."""
        return not self._busy and bool(self._async)

    def waited(self, work: Any, dt_ns: int) -> None:
        """``Work.wait()`` returned after ``dt_ns`` (counted on the training thread)."""
        if _get_ident() != self._timer.thread:
            return
        call = self._async.pop(id(work), None)
        if call is not None:
            call[WAIT] += dt_ns

    def bucket(self, hook: Callable[..., Any], state: Any, bucket: Any, group: Any) -> Any:
        """Run DDP's communication hook ``hook`` on ``bucket`` (``group``: the model's
        process group, None for the default one) and time its all-reduce: on NCCL the
        hook's own torch.distributed call, from its Work; on a host backend from the
        bucket's issue to its future's completion."""
        if self._device_timing:
            self._ddp_source = True
            try:
                return hook(state, bucket)
            finally:
                self._ddp_source = False
        call = self.begin("all_reduce", SOURCE_DDP)
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
                self._busy = False
        if call is None:
            return future

        def done(fut: Any) -> Any:
            # Chained, not a done-callback: DDP waits for this future, so the
            # completion is noted before backward returns.
            call[DONE] = _wall_ns()
            return fut.value()

        return future.then(done)

    def discard(self, step: int) -> None:
        """A step whose body raised is dropped: so are its collectives."""
        with self._lock:
            self._calls = deque(c for c in self._calls if c[STEP] != step)

    # -- the builder's thread -----------------------------------------------------

    def steps_ended(
        self, ended: Sequence[dict[str, Any]], ended_at: Sequence[tuple[int, int, str]]
    ) -> None:
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
            phase = acc.get(STEP_TIME)
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
        layout = parallel_layout.current_layout() if calls else None
        has_pp = layout is not None and "pp" in layout.dims
        # Between steps, arrivals count from the previous step's end (the first step:
        # from its first collective).
        between = previous
        if between is None:
            between = min((c[ARRIVAL] for c in calls if c[PHASE] == BETWEEN_STEPS), default=0)
        for (
            _step, phase, op, source, arrival, wait_ns, done_ns, work, pg, peer, nbytes
        ) in calls:  # fmt: skip
            label = parallel_layout.group_label(pg, layout)
            if peer is not None:
                peer = _global_peer(pg, peer)
                if label == "world" and peer is not None:
                    # A send or receive on the default group runs over the dimension
                    # in which this rank and its peer differ (a pipeline's next stage).
                    label = parallel_layout.pair_label(layout, peer)
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
