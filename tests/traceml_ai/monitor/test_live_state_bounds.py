"""The live state's job histograms, kept as steps arrive, are the merge of every rank's
own; and what the state holds per rank stays within its window however long the run."""

from __future__ import annotations

import math
import random

import pytest

from tests.traceml_ai.monitor.test_monitor import families_of, identity, step
from traceml_ai.monitor._state import (
    HELD_ROWS_PER_RANK,
    PHASE_BUCKETS_S,
    STEP_BUCKETS_S,
    WINDOW_STEPS,
    Histogram,
    LiveState,
)


def _assert_same(kept: Histogram, merged: Histogram) -> None:
    assert kept.bounds == merged.bounds
    assert kept.counts == merged.counts
    assert kept.n == merged.n
    # The same values added in another order: equal up to rounding.
    assert math.isclose(kept.total, merged.total, rel_tol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_job_histograms_kept_incrementally_equal_the_merge_of_every_ranks(seed: int) -> None:
    rng = random.Random(seed)
    state = LiveState()
    ranks = 70  # more than the first allocation of rows; past the per-rank series bound
    done = dict.fromkeys(range(ranks), 0)
    # Ranks' batches interleaved, of varied sizes; phases that only some ranks have.
    while any(n < 40 for n in done.values()):
        rank = rng.choice([r for r, n in done.items() if n < 40])
        batch = []
        for _ in range(min(rng.randint(1, 9), 40 - done[rank])):
            done[rank] += 1
            n = done[rank]
            phases = {"_traceml_internal:forward_time": rng.uniform(0.0, 30.0)}
            if rank % 3 == 0:
                phases["fetch"] = rng.choice([0.0, 0.5, 5.0, 7000.0])
            batch.append(step(n, rng.uniform(0.0, 90_000.0), n * 10**9, **phases))
        state.add_steps(identity(rank, world=ranks, node=rank // 8), batch)

    ranks_live = state.ranks()
    figures = state.metric_figures(rank_histograms_max_ranks=ranks)
    _assert_same(
        figures.job_step, Histogram.merged(STEP_BUCKETS_S, [r.step_hist for r in ranks_live])
    )
    assert figures.job_step.n == 40 * ranks
    labels = sorted({label for r in ranks_live for label in r.phase_hist})
    assert list(figures.job_phases) == labels == ["forward", "user:fetch"]
    for label in labels:
        hists = [r.phase_hist[label] for r in ranks_live if label in r.phase_hist]
        _assert_same(figures.job_phases[label], Histogram.merged(PHASE_BUCKETS_S, hists))
    # The exposition's job series are those histograms, and the ranks' own ones merge
    # into them as well when each rank's series are served.
    family = families_of(state, max_ranks=ranks)["traceml_job_step_time_seconds"]
    (sample,) = family.samples
    assert sample.histogram is not None and sample.histogram.counts == figures.job_step.counts
    own = families_of(state, max_ranks=ranks)["traceml_step_time_seconds"].samples
    assert len(own) == ranks
    merged = Histogram.merged(STEP_BUCKETS_S, [s.histogram for s in own if s.histogram])
    _assert_same(figures.job_step, merged)


def test_state_holds_a_window_per_rank_however_many_steps_arrive() -> None:
    """Each rank's steps, tokens and waits are kept for its last steps only: the rows
    held stop growing once the window is full, while the histograms count every step."""
    state = LiveState()
    ranks = 3
    held: list[dict[int, int]] = []
    sent = 0
    for chunk in range(12):  # 12 chunks of half a window: six windows of steps
        for rank in range(ranks):
            ident = identity(rank, world=ranks)
            steps = range(sent + 1, sent + WINDOW_STEPS // 2 + 1)
            state.add_steps(
                ident, [{**step(n, 10.0 + rank, n * 10**6), "tokens": 512} for n in steps]
            )
            # Waits for these steps and, ahead of their step lines, for the next ones;
            # an unmeasured (NCCL without timing) line for every other step.
            state.add_collectives(
                ident,
                [
                    {"step": n, "phase": "_traceml_internal:backward_time", "op": "all_reduce",
                     "wait_ms": None if n % 2 else 1.5}
                    for n in range(sent + 1, sent + WINDOW_STEPS + 1)
                ],
            )  # fmt: skip
        sent += WINDOW_STEPS // 2
        if chunk in (5, 11):  # three and six windows in
            held.append(state.held_rows())

    assert held[0] == held[1], held  # no growth from three windows to six
    assert set(held[1]) == set(range(ranks))
    assert all(0 < rows <= HELD_ROWS_PER_RANK for rows in held[1].values())
    recent = state.recent_steps()
    for rank in range(ranks):
        assert [s.step for s in recent[rank]] == list(range(sent - WINDOW_STEPS + 1, sent + 1))
    columns = state.recent_columns()
    assert all(len(c.steps) == WINDOW_STEPS for c in columns.values())
    figures = state.metric_figures(rank_histograms_max_ranks=ranks)
    assert figures.steps == [sent] * ranks
    assert figures.job_step.n == sent * ranks  # the histograms count every step


def test_past_the_rank_series_bound_only_the_jobs_histograms_are_kept() -> None:
    """A run above the bound keeps the job's histograms exactly as one within it
    does (no reader serves each rank's there), and serves no rank's."""
    from tests.traceml_ai.monitor.test_monitor import identity, step
    from traceml_ai.monitor._state import LiveState

    within, past = LiveState(), LiveState(rank_histograms_max_ranks=2)
    for state in (within, past):
        for rank in range(3):
            items = [
                step(i, 10.0 + rank + i / 7, i, **{"_traceml_internal:forward_time": 3.0 + i})
                for i in range(1, 30)
            ]
            state.add_steps(identity(rank, world=3), items)
    full, bounded = within.metric_figures(64), past.metric_figures(64)
    assert full.rank_histograms and full.step_hist is not None
    assert not bounded.rank_histograms and bounded.step_hist is None
    assert bounded.job_step == full.job_step and bounded.job_step.n == 87
    assert bounded.job_phases == full.job_phases
    assert bounded.steps == full.steps == [29, 29, 29]
