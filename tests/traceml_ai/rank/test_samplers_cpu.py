"""The process sampler's CPU figure, measured for real: never above every core's worth.

psutil divides the CPU time of the process (counted in clock ticks) by the wall time
since its previous call; the first sample comes right after the sampler starts its
window, so one tick over a few microseconds read as thousands of percent.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator

import pytest

from tests.traceml_ai.rank.conftest import once
from traceml_ai.rank.samplers import ProcessSampler
from traceml_ai.testing import FakeCuda

# The process sampler times no step: the timer's core does not matter here.
pytestmark = once

CEILING = 100.0 * (os.cpu_count() or 1)


@pytest.fixture
def busy() -> Iterator[None]:
    """Threads that keep every core busy (hashing releases the interpreter's lock)."""
    stop = threading.Event()
    block = os.urandom(1 << 20)

    def spin() -> None:
        while not stop.is_set():
            hashlib.sha256(block).digest()

    threads = [threading.Thread(target=spin, daemon=True) for _ in range(os.cpu_count() or 1)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(5)


def _cpu(sampler: ProcessSampler) -> float:
    item = sampler.sample()
    assert item is not None
    assert item["cpu_logical_cores"] == os.cpu_count()
    return item["cpu_percent"]


@pytest.mark.usefixtures("busy")
def test_no_sample_exceeds_every_core_first_samples_included() -> None:
    first: list[float] = []
    later: list[float] = []
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        sampler = ProcessSampler(FakeCuda(devices=0, available=False), lambda: None)
        first.append(_cpu(sampler))  # the first interval: microseconds long
        later.append(_cpu(sampler))
    steady = ProcessSampler(FakeCuda(devices=0, available=False), lambda: None)
    for _ in range(5):
        time.sleep(0.05)
        later.append(_cpu(steady))
    assert len(first) >= 100
    assert max(first) <= CEILING, sorted(first)[-5:]
    assert max(later) <= CEILING, sorted(later)[-5:]
    assert min(first + later) >= 0.0
    # The samples are real: the busy threads show (how much depends on the host's load).
    assert sum(later[-5:]) > 0.0
