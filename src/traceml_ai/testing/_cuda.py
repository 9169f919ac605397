"""A fake ``CudaBackend`` as strict as ``torch.cuda``, for tests without a GPU."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

__all__ = ["FakeCuda", "FakeCudaEvent", "FakeCudaMisuse"]

_GIB = 1 << 30


class FakeCudaMisuse(AssertionError):
    """A call the real CUDA API would not allow (or that TraceML promises never to make).

    Raised where it happens and also kept in :attr:`FakeCuda.misuse`: code under test
    may catch it (TraceML turns its timing off after an internal error), and the list
    still shows it to the test.
    """


class FakeCudaEvent:
    """``torch.cuda.Event(enable_timing=True)`` on a fake GPU.

    It completes when the fake GPU's progress (:attr:`FakeCuda.completed`) reaches the
    stamp it was recorded with; the time between two events is the difference of their
    stamps times :attr:`FakeCuda.ms_per_tick`.
    """

    def __init__(self, gpu: FakeCuda, stamp: int, device: int) -> None:
        self.gpu = gpu
        self.stamp = stamp
        self.device = device
        self.released = False

    def query(self) -> bool:
        """Whether the work before this event completed (never blocks)."""
        if self.released:
            self.gpu._misuse("query() on an event given back with release_events()")
        return self.gpu.completed >= self.stamp

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds to ``end_event``; raises as torch does unless both completed."""
        if not isinstance(end_event, FakeCudaEvent) or end_event.gpu is not self.gpu:
            self.gpu._misuse("elapsed_time() with an event of another backend")
        if end_event.device != self.device:
            # torch raises for events of two devices too.
            raise RuntimeError("CUDA error: invalid resource handle")
        if not (self.query() and end_event.query()):
            # What torch.cuda.Event.elapsed_time raises before both events completed.
            raise RuntimeError("CUDA error: device not ready")
        override = self.gpu.elapsed_override
        if override is not None:
            return override
        return float(end_event.stamp - self.stamp) * self.gpu.ms_per_tick

    def synchronize(self) -> None:
        """Wait until the event completed, as torch does; counted in ``synchronize_calls``.

        Behind a hung collective the real call never returns: the fake waits at most
        :attr:`FakeCuda.synchronize_timeout_s` and then reports the misuse.
        """
        gpu = self.gpu
        with gpu._cond:
            gpu.synchronize_calls += 1
            done = gpu._cond.wait_for(
                lambda: gpu.completed >= self.stamp, timeout=gpu.synchronize_timeout_s
            )
        if not done:
            gpu._misuse("Event.synchronize() blocked on work that never completed")


class FakeCuda:
    """A ``CudaBackend`` (``traceml_ai.rank.gpu``) for tests on machines without a GPU.

    Strict where ``torch.cuda`` is strict:

    - ``current_device()`` answers per thread: 0 on a thread that never called
      :meth:`set_device`, as ``torch.cuda.current_device()`` does;
    - events complete only when the test says the GPU got that far (:meth:`complete`,
      :meth:`finish_all`, or ``auto_complete=True`` for a GPU that always keeps up);
      ``elapsed_time`` raises ``RuntimeError`` until both events completed;
    - ``release_events`` takes back only completed events of that device that were
      not given back already, and an event given back must not be queried again;
    - peaks are per device: the highest allocation since the last
      ``reset_peak_memory_stats`` (which sets the peak to what is allocated now).

    Misuse raises :class:`FakeCudaMisuse` and is kept in :attr:`misuse`. The counters
    (``created``, ``record_devices``, ``synchronize_calls``, ``resets``, ``released``)
    let a test assert what TraceML asked of CUDA.
    """

    def __init__(
        self,
        devices: int = 1,
        *,
        auto_complete: bool = False,
        total_memory: int = 80 * _GIB,
        available: bool | None = True,
        model_device: int | None = None,
    ) -> None:
        self.devices = devices
        self.model_device = model_device
        """When set, every model counts as living on this device: a real CPU model in a
        test then goes through TraceML's GPU paths (events, peaks) as it would on CUDA."""
        self.auto_complete = auto_complete
        self.available = available
        self.total_memory_bytes = total_memory
        self.ms_per_tick = 1.0
        """Milliseconds of GPU time between two consecutive recordings."""
        self.elapsed_override: float | None = None
        """When set, what every ``elapsed_time`` returns (e.g. NaN, to test guards)."""
        self.capturing = False
        """True while a CUDA graph is being captured: ``record_event`` gives None."""
        self.failing_records: set[int] = set()
        """1-based numbers of ``record_event`` calls that fail (return None)."""
        self.synchronize_timeout_s = 30.0
        self.clock = 0
        self._completed = 0
        self._cond = threading.Condition()
        self._local = threading.local()
        self.allocated: dict[int, int] = {}
        self.reserved: dict[int, int] = {}
        self._peak_allocated: dict[int, int] = {}
        self._peak_reserved: dict[int, int] = {}
        self.free_events: dict[int, list[FakeCudaEvent]] = {}
        self.record_calls = 0
        self.record_devices: list[int] = []
        self.record_threads: set[int] = set()
        self.created = 0
        self.released = 0
        self.resets: list[int] = []
        self.synchronize_calls = 0
        self.misuse: list[str] = []

    # -- what the test drives ------------------------------------------------------------

    def _misuse(self, what: str) -> None:
        self.misuse.append(what)
        raise FakeCudaMisuse(what)

    @property
    def completed(self) -> int:
        """The stamp up to which the fake GPU finished its work (events at or below it
        completed). It only moves forward, as a GPU's progress does."""
        return self._completed

    @completed.setter
    def completed(self, stamp: int) -> None:
        self.complete(stamp)

    def complete(self, through: int | None = None) -> None:
        """Let the GPU finish its work up to stamp ``through`` (all recorded work if None)."""
        with self._cond:
            target = self.clock if through is None else through
            if target < self._completed:
                raise ValueError(f"the GPU cannot go back from {self._completed} to {target}")
            self._completed = target
            self._cond.notify_all()

    def finish_all(self) -> None:
        """Complete every event recorded so far."""
        self.complete()

    def set_device(self, index: int) -> None:
        """``torch.cuda.set_device(index)``: for the calling thread only."""
        if not 0 <= index < self.devices:
            raise RuntimeError("CUDA error: invalid device ordinal")
        self._local.device = index

    def allocate(self, index: int, nbytes: int) -> None:
        """Tensors of ``nbytes`` allocated on device ``index`` (negative frees)."""
        now = self.allocated.get(index, 0) + nbytes
        if now < 0:
            raise ValueError("freed more than was allocated")
        self.allocated[index] = now
        # The caching allocator keeps what it reserved.
        self.reserved[index] = max(self.reserved.get(index, 0), now)
        self._peak_allocated[index] = max(self._peak_allocated.get(index, 0), now)
        self._peak_reserved[index] = max(self._peak_reserved.get(index, 0), self.reserved[index])

    # -- CudaBackend -------------------------------------------------------------------

    def is_available(self) -> bool | None:
        """``available`` as given (None: CUDA not initialized yet)."""
        return self.available

    def device_count(self) -> int | None:
        """The number of fake devices."""
        return self.devices

    def current_device(self) -> int | None:
        """The calling thread's device: 0 until that thread called :meth:`set_device`."""
        return int(getattr(self._local, "device", 0))

    def device_index_of(self, model: object) -> int | None:
        """The index of the first parameter or buffer whose ``device.type`` is ``cuda``
        (``model_device`` instead, when set)."""
        if self.model_device is not None:
            return self.model_device
        for attr in ("parameters", "buffers"):
            getter = getattr(model, attr, None)
            if not callable(getter):
                continue
            for tensor in getter():
                device = getattr(tensor, "device", None)
                if getattr(device, "type", None) == "cuda":
                    index = getattr(device, "index", None)
                    return index if isinstance(index, int) else self.current_device()
        return None

    def reset_peak_memory_stats(self, index: int) -> None:
        """Start a new peak window on ``index`` at what is allocated and reserved now."""
        self.resets.append(index)
        self._peak_allocated[index] = self.allocated.get(index, 0)
        self._peak_reserved[index] = self.reserved.get(index, 0)

    def max_memory_allocated(self, index: int) -> int | None:
        """Peak bytes allocated on ``index`` since the last reset."""
        return self._peak_allocated.get(index, 0)

    def max_memory_reserved(self, index: int) -> int | None:
        """Peak bytes reserved on ``index`` since the last reset."""
        return self._peak_reserved.get(index, 0)

    def memory_allocated(self, index: int) -> int | None:
        """Bytes allocated on ``index`` now."""
        return self.allocated.get(index, 0)

    def memory_reserved(self, index: int) -> int | None:
        """Bytes reserved on ``index`` now."""
        return self.reserved.get(index, 0)

    def total_memory(self, index: int) -> int | None:
        """The ``total_memory`` given at construction."""
        return self.total_memory_bytes

    def device_uuid(self, index: int) -> str | None:
        """A stable UUID per index, written as NVML writes it (``GPU-…``)."""
        return f"GPU-{index:08x}-1111-2222-3333-444444444444"

    def record_event(self, index: int) -> FakeCudaEvent | None:
        """An event stamped one tick after the previous one; None while capturing a CUDA
        graph or for a call listed in ``failing_records``. Reuses given-back events."""
        with self._cond:
            self.record_calls += 1
            if self.capturing or self.record_calls in self.failing_records:
                return None
            self.record_devices.append(index)
            self.record_threads.add(threading.get_ident())
            self.clock += 1
            if self.auto_complete:
                self._completed = self.clock
                self._cond.notify_all()
            free = self.free_events.get(index)
            if free:
                event = free.pop()
                event.stamp, event.released = self.clock, False
                return event
            self.created += 1
            return FakeCudaEvent(self, self.clock, index)

    def release_events(self, index: int, events: list[Any]) -> None:
        """Take back completed events of ``index`` for ``record_event`` to record again."""
        for event in events:
            if not isinstance(event, FakeCudaEvent) or event.gpu is not self:
                self._misuse("release_events() with an event this backend did not record")
            if event.released:
                self._misuse("release_events() with an event given back already")
            if event.device != index:
                self._misuse(f"release_events({index}) with an event of device {event.device}")
            if event.stamp > self.completed:
                # Recording it again while the GPU still works on it would change the
                # timing of the step that owns it.
                self._misuse("release_events() with an event that has not completed")
        with self._cond:
            for event in events:
                event.released = True
            self.released += len(events)
            self.free_events.setdefault(index, []).extend(events)


if TYPE_CHECKING:
    from traceml_ai.rank.gpu import CudaBackend, CudaEvent

    # mypy proves the fakes keep up with the protocols as they change.
    _backend: CudaBackend = FakeCuda()
    _event: CudaEvent = FakeCudaEvent(FakeCuda(), 0, 0)
