"""The overhead benches' estimator (``bench/overhead/paired.py``) on made-up step times.

A traced step that slows the steps after it, and steps that come down one after
another after every slow one (what this machine's steps do): the estimator must
count the first, and read 0 on the second when nothing is traced.
"""

from __future__ import annotations

import random

import pytest

from bench.overhead.paired import cycle, positions

K = 4


def _steps(n: int, own: float, after: tuple[float, ...], seed: int = 0) -> list[float]:
    """Step times: 700 + noise, a traced step (i % K == 0) adding ``own`` and the next
    ones ``after``, and now and then a slow step whose effect fades over the next 3."""
    rng = random.Random(seed)
    out: list[float] = []
    fade = 0.0
    for i in range(n):
        t = 700.0 + rng.gauss(0, 2)
        p = i % K
        t += own if p == 0 else (after[p - 1] if p - 1 < len(after) else 0.0)
        t += fade
        fade *= 0.3
        if rng.random() < 0.08:
            spike = rng.uniform(20, 80)
            t += spike
            fade = spike * 0.4
        out.append(t)
    return out


def test_counts_own_time_and_what_spills_into_the_next_steps() -> None:
    values = _steps(40_000, own=18.0, after=(10.0, 3.0))
    flags = [i % K == 0 for i in range(len(values))]
    figures = cycle(values, positions(flags), K, skip=100)
    assert figures.own == pytest.approx(18.0, abs=1.0)
    assert figures.spill == pytest.approx(13.0, abs=1.5)
    assert figures.cost == pytest.approx(31.0, abs=2.0)


def test_reads_about_zero_when_nothing_is_traced() -> None:
    values = _steps(40_000, own=0.0, after=())
    figures = cycle(values, [i % K for i in range(len(values))], K, skip=100)
    assert abs(figures.cost) < 1.0, figures


def test_next_untraced_difference_is_what_it_got_wrong() -> None:
    """The old figure, median(traced - the next untraced) with the kinds alternating,
    misses what the next step pays (and reads > 0 on an A/A run with fading spikes)."""
    values = _steps(40_000, own=0.0, after=())
    old = sorted(values[i] - values[i + 1] for i in range(100, len(values) - 1, 2))
    assert old[len(old) // 2] > 0.3


def test_positions_and_refusals() -> None:
    assert positions([False, True, False, False, True, False]) == [None, 0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="at least 2"):
        cycle([1.0, 2.0], [0, 1], 1)
    with pytest.raises(ValueError, match="position 1"):
        cycle([1.0, 2.0], [0, 0], 2)
