"""GPU access for the rank SDK, behind two small interfaces.

``CudaBackend`` is what this process sees through ``torch.cuda`` (memory of this
process, CUDA events for step timing); ``NvmlBackend`` is what the host's driver
reports for every GPU (through ``pynvml``). The real implementations import their
libraries lazily and guard every call, so a missing driver or a failing device
gives ``None``/nulls rather than an exception. Tests pass fakes for both, because
no GPU exists in CI.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import threading
from typing import Any, Protocol

import attrs

from traceml_ai import _fork
from traceml_ai.rank._lazy import torch_or_none


class CudaEvent(Protocol):
    """The part of ``torch.cuda.Event`` the step timer uses."""

    def query(self) -> bool:
        """Whether the work before this event has completed (never blocks)."""
        ...

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds between this event and ``end_event``."""
        ...

    def synchronize(self) -> None:
        """Wait for the event to complete."""
        ...


class CudaBackend(Protocol):
    """Per-process CUDA access used for step timing, step memory and process samples.

    Every method returns ``None`` (or does nothing) instead of raising when CUDA
    cannot answer.
    """

    def is_available(self) -> bool | None:
        """Whether this process can use a GPU; ``None`` while it cannot be probed safely."""
        ...

    def device_count(self) -> int | None:
        """GPUs visible to this process."""
        ...

    def current_device(self) -> int | None:
        """The current CUDA device index, if CUDA is in use."""
        ...

    def device_index_of(self, model: object) -> int | None:
        """The CUDA device index the model's parameters live on; ``None`` if not on CUDA."""
        ...

    def reset_peak_memory_stats(self, index: int) -> None:
        """Start a new peak-memory window on that device."""
        ...

    def max_memory_allocated(self, index: int) -> int | None:
        """Peak bytes allocated by tensors since the last reset."""
        ...

    def max_memory_reserved(self, index: int) -> int | None:
        """Peak bytes reserved by the caching allocator since the last reset."""
        ...

    def memory_allocated(self, index: int) -> int | None:
        """Bytes allocated by this process's tensors now."""
        ...

    def memory_reserved(self, index: int) -> int | None:
        """Bytes reserved by this process's caching allocator now."""
        ...

    def total_memory(self, index: int) -> int | None:
        """The device's total memory."""
        ...

    def record_event(self, index: int) -> CudaEvent | None:
        """Record a timing event on the device's current stream; ``None`` if that failed."""
        ...

    def release_events(self, index: int, events: list[CudaEvent]) -> None:
        """Take back completed events of device ``index`` that nothing refers to any more,
        for ``record_event`` to record again (no new CUDA event per phase and step)."""
        ...

    def device_uuid(self, index: int) -> str | None:
        """The device's UUID as NVML writes it (``GPU-…``), to join process and system_gpu lines."""
        ...


def normalize_uuid(value: Any) -> str | None:
    """A GPU UUID as NVML writes it: ``GPU-`` (or ``MIG-``) and the hex digits with dashes.

    torch prints a device's UUID without the prefix; NVML returns it with one (as
    ``bytes`` in old nvidia-ml-py). Anything else unusable is ``None``.
    """
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if value is None:
        return None
    try:
        text = str(value).strip()
    except Exception:
        return None
    if not text or len(text) > 128 or not text.isprintable() or " " in text:
        return None
    if not text.startswith(("GPU-", "MIG-")):
        text = "GPU-" + text
    return text


def _nonneg_int(value: Any) -> int | None:
    try:
        result = int(value)
    except Exception:
        return None
    return result if result >= 0 else None


# Events kept for reuse per device: a few steps' worth of phases.
_MAX_FREE_EVENTS = 256
# Distinct current streams remembered (a script that creates streams without end
# gets a cleared cache now and then, not a growing one).
_MAX_CACHED_STREAMS = 64
# Bumped in every fork child: what a backend cached about CUDA in the parent is
# not this process's.
_fork_generation = 0


@_fork.on_fork_in_child
def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


class TorchCudaBackend:
    """``CudaBackend`` over ``torch.cuda``; never initializes CUDA on its own."""

    def __init__(self) -> None:
        # The allocator statistics read for max_memory_allocated, kept for the
        # max_memory_reserved that follows it at the end of a step: one C call
        # (and one dict built) per step instead of two.
        self._stats: tuple[int, Any] | None = None
        # torch.cuda once this process initialized CUDA, which it cannot undo; the
        # fork generation it was found in (a fork child may not use the parent's CUDA).
        self._ready: Any = None
        self._ready_fork = -1
        # Completed events given back by the step timer, per device: recording one
        # again costs half of creating (and later destroying) a new one.
        self._free_events: dict[int, list[Any]] = {}
        # Stream objects by torch's (stream id, device index, device type) triple:
        # torch.cuda.current_stream(index) builds a new Python object per call.
        self._streams: dict[tuple[int, int, int], Any] = {}
        self._get_current_stream: Any = None

    def _cuda(self) -> Any:
        ready = self._ready
        if ready is not None and self._ready_fork == _fork_generation:
            return ready
        torch = torch_or_none()
        if torch is None:
            return None
        try:
            if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
                return None
            # Probing before the training code initialized CUDA would start the
            # driver in this process, which breaks a later fork; wait for the user.
            if not torch.cuda.is_initialized():
                return None
        except Exception:
            return None
        if self._ready_fork != _fork_generation:
            self._free_events = {}
            self._streams = {}
        self._ready = torch.cuda
        self._ready_fork = _fork_generation
        self._get_current_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
        return torch.cuda

    def is_available(self) -> bool | None:
        """False on a CPU-only torch build; ``None`` until the process initialized CUDA."""
        torch = torch_or_none()
        if torch is None:
            return False
        try:
            if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
                return False
            if not torch.cuda.is_initialized():
                return None
            return bool(torch.cuda.device_count() > 0)
        except Exception:
            return None

    def device_count(self) -> int | None:
        """GPUs visible to this process, once CUDA is initialized."""
        cuda = self._cuda()
        if cuda is None:
            return None
        try:
            return _nonneg_int(cuda.device_count())
        except Exception:
            return None

    def current_device(self) -> int | None:
        """``torch.cuda.current_device()`` once CUDA is initialized."""
        cuda = self._cuda()
        if cuda is None:
            return None
        try:
            return _nonneg_int(cuda.current_device())
        except Exception:
            return None

    def device_index_of(self, model: object) -> int | None:
        """The index of the CUDA device holding the model's first CUDA parameter or buffer.

        Every tensor is looked at (once per model, not per step): a model with its
        first parameters offloaded to CPU still trains on its GPU.
        """
        for attr in ("parameters", "buffers"):
            getter = getattr(model, attr, None)
            if not callable(getter):
                continue
            try:
                for tensor in getter():
                    device = getattr(tensor, "device", None)
                    if getattr(device, "type", None) == "cuda":
                        index = getattr(device, "index", None)
                        return index if isinstance(index, int) else self.current_device()
            except Exception:
                continue
        return None

    def reset_peak_memory_stats(self, index: int) -> None:
        """``torch.cuda.reset_peak_memory_stats(index)``, errors ignored."""
        cuda = self._cuda()
        if cuda is None:
            return
        with contextlib.suppress(Exception):
            cuda.reset_peak_memory_stats(index)

    def _call_int(self, name: str, index: int) -> int | None:
        cuda = self._cuda()
        if cuda is None:
            return None
        try:
            return _nonneg_int(getattr(cuda, name)(index))
        except Exception:
            return None

    def _peak(self, index: int, stat: str, stats: Any = None) -> int | None:
        # torch.cuda.max_memory_allocated() goes through memory_stats(), which
        # flattens and sorts every allocator statistic (~0.4 ms a step on the
        # training thread); the nested dict is the same C call without that.
        try:
            if stats is None:
                cuda = self._cuda()
                if cuda is None:
                    return None
                stats = cuda.memory_stats_as_nested_dict(index)
                self._stats = (index, stats)
            return _nonneg_int(stats[stat]["all"]["peak"])
        except Exception:
            return None

    def max_memory_allocated(self, index: int) -> int | None:
        """Peak ``allocated_bytes`` (what ``torch.cuda.max_memory_allocated(index)`` reports)."""
        self._stats = None
        return self._peak(index, "allocated_bytes")

    def max_memory_reserved(self, index: int) -> int | None:
        """Peak ``reserved_bytes`` (what ``torch.cuda.max_memory_reserved(index)`` reports);
        from the statistics ``max_memory_allocated`` just read, when it did."""
        cached = self._stats
        self._stats = None
        stats = cached[1] if cached is not None and cached[0] == index else None
        return self._peak(index, "reserved_bytes", stats)

    def memory_allocated(self, index: int) -> int | None:
        """``torch.cuda.memory_allocated(index)``."""
        return self._call_int("memory_allocated", index)

    def memory_reserved(self, index: int) -> int | None:
        """``torch.cuda.memory_reserved(index)``."""
        return self._call_int("memory_reserved", index)

    def total_memory(self, index: int) -> int | None:
        """Total memory from the device properties."""
        cuda = self._cuda()
        if cuda is None:
            return None
        try:
            return _nonneg_int(cuda.get_device_properties(index).total_memory)
        except Exception:
            return None

    def device_uuid(self, index: int) -> str | None:
        """``torch.cuda.get_device_properties(index).uuid``, with NVML's ``GPU-`` prefix."""
        cuda = self._cuda()
        if cuda is None:
            return None
        try:
            return normalize_uuid(getattr(cuda.get_device_properties(index), "uuid", None))
        except Exception:
            return None

    def record_event(self, index: int) -> CudaEvent | None:
        """A timing ``torch.cuda.Event`` recorded on the device's current stream."""
        cuda = self._cuda()
        if cuda is None:
            return None
        try:
            # Recording an event inside a CUDA graph capture would put it into the
            # graph (or fail the capture): no event then, and gpu_ms is null.
            if cuda.is_current_stream_capturing():
                return None
            stream = self._current_stream(cuda, index)
            free = self._free_events.get(index)
            event = free.pop() if free else cuda.Event(enable_timing=True)
            event.record(stream)
        except Exception:
            return None
        return event  # type: ignore[no-any-return]

    def _current_stream(self, cuda: Any, index: int) -> Any:
        get = self._get_current_stream
        if get is None:
            return cuda.current_stream(index)
        key = get(index)
        stream = self._streams.get(key)
        if stream is None:
            if len(self._streams) >= _MAX_CACHED_STREAMS:
                self._streams.clear()
            stream = self._streams[key] = cuda.current_stream(index)
        return stream

    def release_events(self, index: int, events: list[CudaEvent]) -> None:
        """Keep up to ``_MAX_FREE_EVENTS`` completed events per device for reuse."""
        free = self._free_events.get(index)
        if free is None:
            free = self._free_events.setdefault(index, [])
        room = _MAX_FREE_EVENTS - len(free)
        if room > 0:
            free.extend(events[:room])


@attrs.frozen(slots=True, kw_only=True)
class GpuReading:
    """One host GPU as NVML reported it; a field it could not read is ``None``."""

    utilization_percent: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: float | None = None
    power_usage_w: float | None = None
    power_limit_w: float | None = None
    uuid: str | None = None


class NvmlBackend(Protocol):
    """Host-wide GPU access for system samples."""

    def device_count(self) -> int:
        """GPUs on the host; 0 when there is no driver or no GPU."""
        ...

    def read(self, index: int) -> GpuReading:
        """Read one GPU; may raise, and the sampler then keeps the GPU with nulls."""
        ...

    def close(self) -> None:
        """Release the library."""
        ...


def _finite_float(value: Any, scale: float = 1.0) -> float | None:
    try:
        result = float(value) * scale
    except Exception:
        return None
    return result if math.isfinite(result) else None


class PynvmlBackend:
    """``NvmlBackend`` over ``pynvml`` (nvidia-ml-py); initializes NVML on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._tried = False
        # Why NVML could not be loaded (no nvidia-ml-py, no driver), for the rank's
        # one warning when CUDA works but system lines would report no GPU.
        self.load_error: str | None = None

    def _lib(self) -> Any:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    nvml = importlib.import_module("pynvml")
                    nvml.nvmlInit()
                    self._nvml = nvml
                except Exception as exc:
                    # No library, no driver or no GPU: report none, and do not retry
                    # every interval.
                    self._nvml = None
                    self.load_error = repr(exc)
            return self._nvml

    def device_count(self) -> int:
        """``nvmlDeviceGetCount()``, or 0 without a driver."""
        nvml = self._lib()
        if nvml is None:
            return 0
        try:
            return max(0, int(nvml.nvmlDeviceGetCount()))
        except Exception:
            return 0

    def read(self, index: int) -> GpuReading:
        """Read utilization, memory, temperature and power; each field guarded on its own."""
        nvml = self._lib()
        if nvml is None:
            raise RuntimeError("NVML is not available")
        handle = nvml.nvmlDeviceGetHandleByIndex(index)

        def attempt(fn: Any, *args: Any) -> Any:
            try:
                return fn(*args)
            except Exception:
                return None

        util = attempt(nvml.nvmlDeviceGetUtilizationRates, handle)
        mem = attempt(nvml.nvmlDeviceGetMemoryInfo, handle)
        temp = attempt(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
        power = attempt(nvml.nvmlDeviceGetPowerUsage, handle)
        limit = attempt(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        # Looked up guarded too: a stand-in module may lack it.
        uuid = attempt(getattr(nvml, "nvmlDeviceGetUUID", None), handle)
        return GpuReading(
            utilization_percent=None if util is None else _finite_float(util.gpu),
            memory_used_bytes=None if mem is None else _nonneg_int(mem.used),
            memory_total_bytes=None if mem is None else _nonneg_int(mem.total),
            temperature_c=None if temp is None else _finite_float(temp),
            # NVML reports milliwatts.
            power_usage_w=None if power is None else _finite_float(power, 1e-3),
            power_limit_w=None if limit is None else _finite_float(limit, 1e-3),
            uuid=normalize_uuid(uuid),
        )

    def close(self) -> None:
        """``nvmlShutdown()`` if NVML was initialized."""
        with self._lock:
            if self._nvml is not None:
                with contextlib.suppress(Exception):
                    self._nvml.nvmlShutdown()
                self._nvml = None
