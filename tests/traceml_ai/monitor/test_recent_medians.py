"""Each rank's median recent step time (``RankFigures.recent_median_ms``), taken for
every rank in one numpy pass, is the straightforward median of its recent steps."""

from __future__ import annotations

import random

import pytest

from tests.traceml_ai.monitor.test_monitor import identity, step
from traceml_ai.monitor._state import WINDOW_STEPS, LiveState
from traceml_ai.testing import make_item


def _plain_median(values: list[float]) -> float | None:
    """The median as written out: the middle value, or the mean of the two middle ones."""
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_ranks_median_is_the_plain_median_of_its_recent_steps(seed: int) -> None:
    rng = random.Random(seed)
    # 0, 1, 2 (even), odd, a full window, and past it (the window wraps); more ranks
    # than the state's first allocation, so its rows grow while steps arrive.
    counts = [
        0,
        1,
        2,
        3,
        4,
        7,
        WINDOW_STEPS - 1,
        WINDOW_STEPS,
        WINDOW_STEPS + 1,
        2 * WINDOW_STEPS + 5,
    ]
    ranks = 150
    state = LiveState()
    given: dict[int, list[float]] = {}
    for rank in rng.sample(range(ranks), ranks):
        ident = identity(rank, world=ranks)
        n = counts[rank % len(counts)] if rank < 2 * len(counts) else rng.randrange(0, 300)
        if n == 0:
            # Heard from, with no step yet.
            state.add_memory(ident, [make_item("step_memory", 0, device="cpu", step=1)])
        # Repeated values as well as distinct ones: a tie in the middle counts twice.
        times = [rng.choice([rng.uniform(0.1, 500.0), 12.5, 40.0]) for _ in range(n)]
        for start in range(0, n, 17):  # batches of several steps, as ranks send them
            chunk = times[start : start + 17]
            state.add_steps(
                ident, [step(start + i + 1, ms, start + i) for i, ms in enumerate(chunk)]
            )
        given[rank] = times

    figures = state.metric_figures(rank_histograms_max_ranks=64)
    recent = state.recent_steps()
    assert [r.rank for r in figures.ranks] == sorted(given)
    for r in figures.ranks:
        kept = [s.step_ms for s in recent[r.rank]]
        assert kept == given[r.rank][-WINDOW_STEPS:]
        want = _plain_median(kept)
        assert r.recent_median_ms == want, r.rank  # exactly, not approximately
        assert (want is None) == (len(given[r.rank]) == 0)
