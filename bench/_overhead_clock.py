"""The update clock of the framework overhead scripts (bench/overhead_frameworks.py)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

THREADS_FROM = 100
"""The update from which TraceML's threads' CPU time is counted: their start-up work
(connecting, the first samples, the runtime environment) is not a per-update cost."""


class StartClock:
    """Wraps the call that starts each update (HF: the batch fetch; Lightning: the epoch
    loop's ``advance``): the time it starts, in wall and the training thread's CPU
    time, and whether TraceML traces that update."""

    def __init__(self, starts_update: Callable[..., Any]) -> None:
        from traceml_ai.rank import _timing

        self._active = _timing.active
        self._call = starts_update
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []
        self.traced: list[bool] = []
        self._threads_from: dict[str, float] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.thread_time())
        self.traced.append(self._active() is not None)
        if len(self.ends) == THREADS_FROM + 1:
            self._threads_from = threads_cpu_s()
        return self._call(*args, **kwargs)

    def result(self) -> dict[str, list[float] | list[bool] | dict[str, float]]:
        """Per update (between consecutive starts): wall seconds, CPU seconds, traced;
        and ``threads_cpu``: the CPU seconds each of TraceML's threads used from the
        start of update ``THREADS_FROM`` on."""
        now = threads_cpu_s()
        return {
            "durations": [b - a for a, b in itertools.pairwise(self.ends)],
            "cpu": [b - a for a, b in itertools.pairwise(self.cpu_ends)],
            "traced": self.traced[:-1],
            "threads_cpu": {k: v - self._threads_from.get(k, 0.0) for k, v in now.items()},
        }


def threads_cpu_s() -> dict[str, float]:
    """CPU seconds of each thread TraceML started in this process, by name
    (``traceml-sender``: builds, encodes and sends the items; ``traceml-sampler``:
    the process and system samples, once per interval), from each thread's CPU clock
    (Linux, macOS)."""
    out: dict[str, float] = {}
    for thread in threading.enumerate():
        if thread.name.startswith("traceml-") and thread.ident is not None:
            try:
                clock = time.pthread_getcpuclockid(thread.ident)
                out[thread.name] = out.get(thread.name, 0.0) + time.clock_gettime(clock)
            except (OSError, AttributeError):
                continue
    return out
