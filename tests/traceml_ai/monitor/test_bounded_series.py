"""The bounded set of series above ``rank_series_max_ranks``: at 10,240 simulated ranks
the scrape stays under 2,000 series, names the slowest ranks and the stragglers, and
its distributions are the figures put in."""

from __future__ import annotations

import numpy as np
import pytest

from tests.custom_exporters import process_item, system_item
from tests.traceml_ai.monitor.test_monitor import _series, families_of, identity, step
from traceml_ai.analysis import Straggler, StragglerView
from traceml_ai.monitor._state import LiveState
from traceml_ai.monitor.metrics import (
    MAX_NAMED,
    NODE_STEP_TIME,
    RANK_HISTOGRAMS,
    STAGE_STEP_TIME,
    TOP_K,
    Family,
    Health,
    series_estimate,
)

RANKS, PER_NODE, STAGES = 10_240, 8, 4
SLOW = {5000 + i: 200.0 + i for i in range(12)}
"""Ranks with a longer step (ms) than every other: the top-k are the last TOP_K."""


def _step_ms(rank: int) -> float:
    return SLOW.get(rank, 10.0 + rank / 1000.0)


def _straggler(rank: int) -> Straggler:
    return Straggler(
        rank=rank, own_work_ms=40.0, others_own_work_ms=10.0, excess_ms=float(rank % 97),
        excess_pct=300.0, phase="forward", phase_excess_ms=30.0, phase_description="",
        slow_steps=3, slow_share=1.0,
    )  # fmt: skip


def _view(named: list[int]) -> StragglerView:
    stragglers = tuple(_straggler(rank) for rank in named)
    return StragglerView(
        definition="", basis="phase_times", ranks=RANKS, applicable=True,
        verdict="straggler", stragglers=stragglers,
    )  # fmt: skip


@pytest.fixture(scope="module")
def big() -> LiveState:
    """10,240 ranks, 8 per node with 8 GPUs each, 4 pipeline stages, one step each."""
    state = LiveState()
    for rank in range(RANKS):
        ident = identity(rank, world=RANKS, node=rank // PER_NODE)
        state.add_steps(ident, [step(1, _step_ms(rank), 1)])
        state.add_process(ident, [process_item(gpu=True)])
        stage = rank * STAGES // RANKS
        state.add_environment(ident, [{"parallel": {"pp": {"rank": stage, "size": STAGES}}}])
        if rank % PER_NODE == 0:
            state.add_system(ident, [system_item(gpus=PER_NODE)])
    return state


def _values(family: Family) -> dict[tuple[str, ...], float]:
    return {s.labels: s.value for s in family.samples}


def test_ten_thousand_ranks_scrape_a_bounded_set(big: LiveState) -> None:
    named = [3, 77, 9000]  # ranks the analysis names, not among the slowest
    big.set_straggler(_view(named))
    try:
        families = families_of(big, Health(expected_ranks=RANKS))
    finally:
        big.set_straggler(None)
    assert _series(families) <= 2000
    assert all(not families[m.name].samples for m in RANK_HISTOGRAMS)
    assert not families["traceml_system_cpu_ratio"].samples  # per node: distributions only
    slowest = sorted(SLOW, key=SLOW.__getitem__)[-TOP_K:]
    medians = _values(families["traceml_rank_step_time_median_seconds"])
    assert sorted(int(rank) for rank, _ in medians) == sorted([*slowest, *named])
    assert medians[("5011", str(5011 // PER_NODE))] == pytest.approx(0.211)
    assert {s.labels[0] for s in families["traceml_straggler_excess_seconds"].samples} == {
        str(r) for r in named
    }
    assert {s.labels[0] for s in families["traceml_steps_total"].samples} == {
        str(r) for r in [*slowest, *named]
    }
    # Each node and each stage: the median over its ranks.
    nodes = _values(families[NODE_STEP_TIME.name])
    assert len(nodes) == RANKS // PER_NODE
    assert nodes[("0",)] == pytest.approx(np.median([_step_ms(r) for r in range(8)]) / 1000)
    assert nodes[(str(5000 // PER_NODE),)] == pytest.approx(0.2035)
    stages = _values(families[STAGE_STEP_TIME.name])
    per_stage = RANKS // STAGES
    for stage in range(STAGES):
        ranks = range(stage * per_stage, (stage + 1) * per_stage)
        expected = np.median([_step_ms(r) for r in ranks]) / 1000
        assert stages[(str(stage),)] == pytest.approx(expected)


def test_the_distributions_are_the_figures_put_in(big: LiveState) -> None:
    families = families_of(big)
    put_in = np.array([_step_ms(r) / 1000 for r in range(RANKS)])
    spread = _values(families["traceml_ranks_step_time_median_seconds"])
    for stat, q in (("min", 0), ("p50", 50), ("p90", 90), ("max", 100)):
        assert spread[(stat,)] == pytest.approx(np.percentile(put_in, q)), stat
    assert _values(families["traceml_ranks_steps"]) == {
        (s,): 1.0 for s in ("min", "p50", "p90", "max")
    }
    cpu = process_item(gpu=True)["cpu_percent"] / 100
    assert _values(families["traceml_ranks_process_cpu_cores"])[("max",)] == pytest.approx(cpu)
    gpus = _values(families["traceml_gpus_utilization_ratio"])
    utils = [g["utilization_percent"] / 100 for g in system_item(gpus=PER_NODE)["gpus"]]
    assert gpus[("min",)] == pytest.approx(min(utils))
    assert gpus[("max",)] == pytest.approx(max(utils))


def test_named_stragglers_are_capped_to_the_largest_excess(big: LiveState) -> None:
    named = list(range(100, 100 + 3 * MAX_NAMED))
    big.set_straggler(_view(named))
    try:
        families = families_of(big)
    finally:
        big.set_straggler(None)
    kept = {int(s.labels[0]) for s in families["traceml_straggler_excess_seconds"].samples}
    assert kept == set(sorted(named, key=lambda r: r % 97)[-MAX_NAMED:])
    assert _series(families) <= 2000


def test_the_estimate_stays_bounded_at_any_rank_count() -> None:
    for ranks in (10_240, 16_384, 65_536):
        nodes = ranks // 8
        assert series_estimate(ranks, nodes, 8, 8, stages=64) <= 2000, ranks
    # At the bound every rank's series, as before: small jobs keep what they had.
    assert series_estimate(64, 8, 0, 8) > 64 * 83
