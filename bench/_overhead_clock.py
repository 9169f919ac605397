"""The update clock of the framework overhead scripts (bench/overhead_frameworks.py)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any


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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.thread_time())
        self.traced.append(self._active() is not None)
        return self._call(*args, **kwargs)

    def result(self) -> dict[str, list[float] | list[bool] | float]:
        """Per update (between consecutive starts): wall seconds, CPU seconds, traced;
        and ``background_cpu``: the CPU seconds TraceML's own threads used so far."""
        return {
            "durations": [b - a for a, b in itertools.pairwise(self.ends)],
            "cpu": [b - a for a, b in itertools.pairwise(self.cpu_ends)],
            "traced": self.traced[:-1],
            "background_cpu": background_cpu_s(),
        }


def background_cpu_s() -> float:
    """CPU seconds of the threads TraceML started in this process (``traceml-*``: the
    sender, which builds and encodes the step items, and the sampler), read from each
    thread's CPU clock (Linux, macOS)."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith("traceml-") and thread.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (OSError, AttributeError):
                continue
    return total
