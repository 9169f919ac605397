"""Background samplers: ``process`` (every rank) and ``system`` (local rank 0) items.

Items follow docs/dev/wire-format.md. Each sampler owns the ``seq`` counter of its
stream, so sequence numbers are monotonic per rank and stream. A measurement that
is not a finite number becomes ``None`` where the field is nullable; where it is
not, the whole item is skipped, so no NaN or Infinity ever leaves the rank.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import psutil

from traceml_ai.rank.gpu import CudaBackend, GpuReading, NvmlBackend
from traceml_ai.transport.wire import ENV_SAMPLER_INTERVAL
from traceml_records.internal import ProcessItem, SystemGpuItem, SystemItem

DEFAULT_SAMPLER_INTERVAL = 2.0


def sampler_interval_from_env(env: Mapping[str, str] | None = None) -> float:
    """``TRACEML_SAMPLER_INTERVAL`` in seconds; the default (2) when unset or not a positive number."""
    env = os.environ if env is None else env
    raw = env.get(ENV_SAMPLER_INTERVAL, "").strip()
    if not raw:
        return DEFAULT_SAMPLER_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_SAMPLER_INTERVAL
    return value if math.isfinite(value) and value > 0 else DEFAULT_SAMPLER_INTERVAL


def finite(value: Any, low: float | None = None, high: float | None = None) -> float | None:
    """``float(value)`` if it is finite and inside ``[low, high]``, else ``None``."""
    try:
        result = float(value)
    except Exception:
        return None
    if not math.isfinite(result):
        return None
    if low is not None and result < low:
        return None
    if high is not None and result > high:
        return None
    return result


def nonneg_int(value: Any) -> int | None:
    """``int(value)`` if it is a non-negative integer, else ``None``."""
    if value is None or isinstance(value, bool):
        return None
    try:
        result = int(value)
    except Exception:
        return None
    return result if result >= 0 else None


class _Sequenced:
    """The ``seq`` counter of one sampler's stream."""

    _seq: int

    @property
    def next_seq(self) -> int:
        """The ``seq`` the next item gets."""
        return self._seq

    def _take_seq(self) -> int:
        seq = self._seq
        self._seq = seq + 1
        return seq


class ProcessSampler(_Sequenced):
    """Builds ``process`` items: this process's CPU and RSS, host RAM, and its GPU memory."""

    def __init__(
        self,
        cuda: CudaBackend,
        device_index: Callable[[], int | None],
        *,
        first_seq: int = 0,
        local_rank: int = 0,
    ) -> None:
        self._cuda = cuda
        # The device the training thread uses (the step timer's); asking
        # torch.cuda.current_device() here would answer for the sampler thread,
        # which is 0 on every rank.
        self._device_index = device_index
        self._local_rank = local_rank
        # A device's UUID never changes: asked once per index.
        self._uuids: dict[int, str | None] = {}
        self._proc = psutil.Process()
        # psutil measures CPU between calls; the first call only starts the window.
        self._proc.cpu_percent(None)
        self._cores = psutil.cpu_count(logical=True)
        self._cpu_ceiling = 100.0 * max(1, self._cores or os.cpu_count() or 1)
        """``cpu_percent`` never exceeds 100 times the logical cores."""
        # ``first_seq`` > 0 continues an earlier sampler of this process (init again).
        self._seq = first_seq

    def sample(self) -> ProcessItem | None:
        """One ``process`` item, or ``None`` when a non-nullable figure is unusable."""
        with self._proc.oneshot():
            cpu = finite(self._proc.cpu_percent(None), low=0.0)
            rss = nonneg_int(self._proc.memory_info().rss)
        if cpu is not None:
            # psutil divides CPU time, counted in clock ticks, by the wall time since the
            # previous call: over a short window (the first sample, just after __init__)
            # one tick reads as thousands of percent. No process uses more than every
            # logical core.
            cpu = min(cpu, self._cpu_ceiling)
        if cpu is None or rss is None:
            return None
        ram_total = nonneg_int(psutil.virtual_memory().total)
        gpu_available = self._cuda.is_available()
        gpu_count = gpu_index = gpu_used = gpu_reserved = gpu_total = None
        gpu_uuid: str | None = None
        if gpu_available:
            gpu_count = self._cuda.device_count()
            gpu_index = self._device_index()
            if gpu_index is None:
                gpu_index = self._rank_device(gpu_count)
            if gpu_index is not None:
                gpu_used = self._cuda.memory_allocated(gpu_index)
                gpu_reserved = self._cuda.memory_reserved(gpu_index)
                gpu_total = self._cuda.total_memory(gpu_index)
                if gpu_index not in self._uuids:
                    self._uuids[gpu_index] = self._cuda.device_uuid(gpu_index)
                gpu_uuid = self._uuids[gpu_index]
        return {
            "timestamp_unix_ns": time.time_ns(),
            "seq": self._take_seq(),
            "cpu_percent": cpu,
            "cpu_logical_cores": self._cores if self._cores and self._cores >= 1 else None,
            "ram_used_bytes": rss,
            "ram_total_bytes": ram_total,
            "gpu_available": gpu_available,
            "gpu_count": nonneg_int(gpu_count),
            "gpu_device_index": nonneg_int(gpu_index),
            "gpu_memory_used_bytes": nonneg_int(gpu_used),
            "gpu_memory_reserved_bytes": nonneg_int(gpu_reserved),
            "gpu_memory_total_bytes": nonneg_int(gpu_total),
            # Joins system_gpu.gpu_uuid: torch's and NVML's indices differ.
            "gpu_uuid": gpu_uuid if gpu_available else None,
        }

    def _rank_device(self, count: int | None) -> int | None:
        """Before the first step: one visible GPU is the rank's; else cuda:LOCAL_RANK
        (torchrun's convention), when that many are visible."""
        if count is None or count < 1:
            return None
        if count == 1:
            return 0
        return self._local_rank if self._local_rank < count else None


_NULL_GPU = GpuReading()


class SystemSampler(_Sequenced):
    """Builds ``system`` items: host CPU and RAM, and every GPU NVML reports."""

    def __init__(self, nvml: NvmlBackend, *, first_seq: int = 0) -> None:
        self._nvml = nvml
        psutil.cpu_percent(None)
        # ``first_seq`` > 0 continues an earlier sampler of this process (init again).
        self._seq = first_seq

    def _gpu(self, index: int) -> SystemGpuItem:
        try:
            reading = self._nvml.read(index)
        except Exception:
            # A GPU that could not be read keeps its entry, with nulls.
            reading = _NULL_GPU
        return {
            "gpu_index": index,
            "utilization_percent": finite(reading.utilization_percent, 0.0, 100.0),
            "memory_used_bytes": nonneg_int(reading.memory_used_bytes),
            "memory_total_bytes": nonneg_int(reading.memory_total_bytes),
            "temperature_c": finite(reading.temperature_c),
            "power_usage_w": finite(reading.power_usage_w, low=0.0),
            "power_limit_w": finite(reading.power_limit_w, low=0.0),
            "gpu_uuid": reading.uuid,
        }

    def sample(self) -> SystemItem | None:
        """One ``system`` item, or ``None`` when a non-nullable figure is unusable."""
        cpu = finite(psutil.cpu_percent(None))
        vm = psutil.virtual_memory()
        total = nonneg_int(vm.total)
        available = nonneg_int(vm.available)
        if cpu is None or total is None or available is None:
            return None
        try:
            count = self._nvml.device_count()
        except Exception:
            count = 0
        gpus = [self._gpu(i) for i in range(max(0, count))]
        return {
            "timestamp_unix_ns": time.time_ns(),
            "seq": self._take_seq(),
            "cpu_percent": min(100.0, max(0.0, cpu)),
            "ram_used_bytes": max(0, total - available),
            "ram_total_bytes": total,
            "gpu_available": bool(gpus),
            "gpus": gpus,
        }


class SamplerThread:
    """Calls ``tick`` at once and then every ``interval`` seconds on one daemon thread."""

    def __init__(self, interval: float, tick: Callable[[], None]) -> None:
        self._interval = interval
        self._tick = tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traceml-sampler", daemon=True)

    def start(self) -> None:
        """Start sampling."""
        self._thread.start()

    def stop(self, timeout: float) -> bool:
        """Ask the thread to stop and wait up to ``timeout``; ``True`` once it has ended."""
        self._stop.set()
        if self._thread.ident is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._tick()
            if self._stop.wait(self._interval):
                return
