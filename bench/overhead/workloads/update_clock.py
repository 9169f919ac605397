"""The update clock of the framework workloads (hf_trainer.py, lightning_fit.py), and
the one-in-k switch they set (one_in_k.py)."""

from __future__ import annotations

import collections
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import orjson

THREADS_FROM = 100
"""The update from which TraceML's threads' CPU time is counted: their start-up work
(connecting, the first samples, the runtime environment) is not a per-update cost."""


LINE_WINDOW = "BENCH_LINE_WINDOW"
"""``FIRST,LAST,PATH`` (``bench.overhead.lines``): count the Python the
training thread runs from the start of update FIRST to the start of update LAST
(``sys.settrace``: each call and each line executed count one), by function, into
PATH as JSON ``[[file, function, first line, count], ...]``."""


class _LineWindow:
    def __init__(self, spec: str) -> None:
        first, last, self.path = spec.split(",", 2)
        self.first, self.last = int(first), int(last)
        self.counts: collections.Counter[tuple[str, str, int]] = collections.Counter()

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        key = (code.co_filename, code.co_name, code.co_firstlineno)
        counts = self.counts
        counts[key] += 1

        def line(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line":
                counts[key] += 1
            return line

        return line

    def at(self, update: int) -> None:
        if update == self.first:
            sys.settrace(self._call)
        elif update == self.last:
            sys.settrace(None)
            rows = [[*key, count] for key, count in self.counts.items()]
            with open(self.path, "wb") as f:
                f.write(orjson.dumps(rows))


class StartClock:
    """Wraps the call that starts each update (HF: the batch fetch; Lightning: the epoch
    loop's ``advance``): the time it starts, in wall and the training thread's CPU
    time, and whether TraceML traces that update."""

    def __init__(self, starts_update: Callable[..., Any]) -> None:
        from traceml_ai.rank._patches import phase_hooks

        self._active = phase_hooks.active
        self._call = starts_update
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []
        self.traced: list[bool] = []
        self._threads_from: dict[str, float] = {}
        spec = os.environ.get(LINE_WINDOW)
        self._lines = _LineWindow(spec) if spec else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._lines is not None:
            self._lines.at(len(self.ends))
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


def trace_one_update_in(k: int) -> None:
    """Trace one optimizer update in ``k`` under the zero-code attach, the ``k - 1``
    after it untraced with TraceML's hooks off (1: every update, as in real use);
    ``one_in_k.trace_one_in``, the bench's own switch."""
    from one_in_k import trace_one_in

    trace_one_in(k)
