"""A fake ``NvmlBackend`` with scripted GPUs, for tests without a GPU."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from traceml_ai.rank.gpu import GpuReading

__all__ = ["FakeNvml", "make_gpu_reading"]


def make_gpu_reading(index: int = 0, **overrides: object) -> GpuReading:
    """A busy H100-like GPU as NVML reports it; ``overrides`` replace fields."""
    fields: dict[str, object] = {
        "utilization_percent": 87.0,
        "memory_used_bytes": 10**9,
        "memory_total_bytes": 80 * 10**9,
        "temperature_c": 61.0,
        "power_usage_w": 250.5,
        "power_limit_w": 700.0,
        "uuid": f"GPU-{index:08x}-1111-2222-3333-444444444444",
    }
    fields.update(overrides)
    return GpuReading(**fields)  # type: ignore[arg-type]


class FakeNvml:
    """An ``NvmlBackend`` (``traceml_ai.rank.gpu``) over a list of scripted readings.

    ``readings[i]`` is what GPU ``i`` reports; an exception there is raised by ``read``
    (a GPU that fell off the bus). As with NVML, an index past the last GPU raises, and
    after ``close`` the library is gone: no GPUs, and ``read`` raises. ``readings`` may
    be changed between samples.
    """

    def __init__(self, readings: Sequence[GpuReading | BaseException] | int = 0) -> None:
        if isinstance(readings, int):
            readings = [make_gpu_reading(i) for i in range(readings)]
        self.readings: list[GpuReading | BaseException] = list(readings)
        self.closed = False
        self.reads: list[int] = []

    def device_count(self) -> int:
        """The number of scripted GPUs; 0 once closed."""
        return 0 if self.closed else len(self.readings)

    def read(self, index: int) -> GpuReading:
        """The scripted reading of GPU ``index`` (raised when it is an exception)."""
        self.reads.append(index)
        if self.closed:
            raise RuntimeError("NVML is not available")
        if not 0 <= index < len(self.readings):
            # nvmlDeviceGetHandleByIndex: NVML_ERROR_INVALID_ARGUMENT.
            raise RuntimeError(f"NVML: invalid GPU index {index}")
        reading = self.readings[index]
        if isinstance(reading, BaseException):
            raise reading
        return reading

    def close(self) -> None:
        """Shut the fake library down."""
        self.closed = True


if TYPE_CHECKING:
    from traceml_ai.rank.gpu import NvmlBackend

    # mypy proves the fake keeps up with the protocol as it changes.
    _backend: NvmlBackend = FakeNvml()
