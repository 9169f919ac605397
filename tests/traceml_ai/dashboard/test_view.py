"""The view builder (``traceml_ai.dashboard._view``): its fixed choices, and the page of
a large job: bounded by groups, never a row per rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest

from tests.traceml_ai.dashboard.big_runs import BASE_MS, big_run, layout_of
from traceml_ai.analysis import BUILT_IN_PHASES, MAX_USER_PHASES, OTHER_PHASE, percentile
from traceml_ai.dashboard._live import LiveSource
from traceml_ai.dashboard._view import (
    GROUPS_FROM,
    HIGHLIGHT,
    MAX_GROUP_ROWS,
    MAX_TABLE_ROWS,
    PHASE_COLOURS,
    USER_PHASE_COLOURS,
    LazySeries,
    StepSeries,
    build_view,
    outlier_ranks,
    rank_medians,
)
from traceml_ai.monitor import Monitoring, RunInfo
from traceml_ai.monitor.metrics import Health
from traceml_ai.settings import MonitorSettings


def test_every_phase_the_page_draws_has_a_colour_of_its_own() -> None:
    """Fixed colours for every phase a run may have; enough others for the user phases
    the page keeps (the rest are ``other``), none of them a fixed one."""
    assert set(PHASE_COLOURS) == {*BUILT_IN_PHASES, OTHER_PHASE, "rest"}
    assert len(USER_PHASE_COLOURS) >= MAX_USER_PHASES
    every = [*PHASE_COLOURS.values(), *USER_PHASE_COLOURS]
    assert len({c.lower() for c in every}) == len(every)


# --------------------------------------------------------------------------- many ranks


def _bytes_without_charts(view: dict[str, Any]) -> int:
    """The view's JSON size less the group charts (one figure triple per group)."""
    groups = [{**g, "chart": None} for g in view["groups"]]
    return len(orjson.dumps({**view, "groups": groups, "generated_unix_s": 0}))


def test_the_view_of_10240_ranks_is_bounded_by_groups_not_ranks() -> None:
    """At 10,240 ranks (1,280 nodes of 8 ranks and 8 GPUs) every per-rank part of the
    page is bounded (table rows, lines, memory and process rows, system rows) and the
    JSON is as large as at 1,024 ranks but for the node chart's figures."""
    views = {n: build_view(big_run(n)) for n in (1024, 10240)}
    view = views[10240]
    assert len(view["ranks"]) == MAX_TABLE_ROWS
    assert view["ranks_total"] == 10240 and view["rank_ranges"] == [[0, 10239]]
    assert len(view["step_time"]["lines"]) <= HIGHLIGHT and view["step_time"]["band"]
    assert len(view["phases"]["ranks"]) == MAX_TABLE_ROWS
    assert len(view["memory"]) == len(view["process"]) == MAX_TABLE_ROWS
    assert len(view["system"]) <= MAX_GROUP_ROWS
    assert view["system_note"].startswith(f"{len(view['system'])} of 1,280 nodes")
    assert {r["figure"] for r in view["system_spread"]} >= {"CPU %", "GPU utilization %"}
    (nodes,) = view["groups"]  # no layout: by node only
    assert nodes["by"] == "node" and nodes["count"] == 1280
    assert len(nodes["rows"]) == MAX_GROUP_ROWS and "16 of 1,280 nodes" in nodes["rows_note"]
    assert len(nodes["chart"]["p50_ms"]) == 1280 and all(r["ranks"] == 8 for r in nodes["rows"])
    assert view["identity"]["node_count"] == 1280
    small, large = (_bytes_without_charts(views[n]) for n in (1024, 10240))
    assert large <= small + 200, (small, large)  # a few more digits, nothing per rank
    assert len(orjson.dumps(view)) < 100_000


def test_a_slower_node_and_rank_lead_the_node_table_and_the_outliers() -> None:
    """Node 77's ranks are 1.5 times slower, rank 4242 (node 530) 3 times: node 77 is
    the slowest node by its p50, node 530 by its max with 4242 its slowest rank, and
    the outlier table holds 4242 and node 77's ranks, slowest first."""
    slower = {r: 1.5 for r in range(77 * 8, 78 * 8)}
    slower[4242] = 3.0
    view = build_view(big_run(10240, slower=slower))
    (nodes,) = view["groups"]
    rows = {row["group"]: row for row in nodes["rows"]}
    assert {77, 530} <= set(rows)
    assert rows[77]["p50_ms"] > 1.4 * BASE_MS and rows[77]["ranks"] == 8
    assert rows[530]["slowest_rank"] == 4242 and rows[530]["max_ms"] > 2.8 * BASE_MS
    assert rows[530]["p50_ms"] < 1.1 * BASE_MS  # one slow rank: the node's median is not
    chart = nodes["chart"]
    by_p50 = max(range(len(chart["group"])), key=lambda i: chart["p50_ms"][i])
    assert chart["group"][by_p50] == 77
    table = [row["rank"] for row in view["ranks"]]
    assert {4242, *range(616, 624)} <= set(table)
    assert view["step_time"]["lines"][0]["rank"] in {4242, *range(616, 624)}
    assert 4242 in {line["rank"] for line in view["step_time"]["lines"]}


def test_stages_and_data_parallel_groups_show_a_heavier_stage() -> None:
    """A 3D-parallel job (tp 8, dp 4, pp 4: 128 ranks on 16 nodes) whose stage 2 is
    1.3 times heavier: grouped by node, by stage and by data-parallel group; stage 2
    is the slowest stage and its nodes the slowest nodes; every data-parallel group
    holds a quarter of stage 2, so all have the same spread."""
    layout = layout_of(128, tp=8, pp=4)
    heavy = {r: 1.3 for r, c in layout.items() if c["pp"][0] == 2}
    view = build_view(big_run(128, slower=heavy, layout=layout))
    groups = {g["by"]: g for g in view["groups"]}
    assert list(groups) == ["node", "pp", "dp"]
    stages = {row["group"]: row for row in groups["pp"]["rows"]}
    assert sorted(stages) == [0, 1, 2, 3] and all(s["ranks"] == 32 for s in stages.values())
    assert max(stages, key=lambda s: stages[s]["p50_ms"]) == 2
    assert stages[2]["p50_ms"] > 1.25 * stages[0]["p50_ms"]
    nodes = {row["group"]: row for row in groups["node"]["rows"]}
    heavy_nodes = {r // 8 for r in heavy}
    assert heavy_nodes == {8, 9, 10, 11}
    assert all(nodes[n]["p50_ms"] > 1.25 * BASE_MS for n in heavy_nodes)
    assert all(nodes[n]["p50_ms"] < 1.1 * BASE_MS for n in set(nodes) - heavy_nodes)
    dp = groups["dp"]
    assert dp["count"] == 4 and all(row["ranks"] == 32 for row in dp["rows"])
    assert all(row["max_ms"] > 1.25 * BASE_MS for row in dp["rows"])
    # The outliers are stage 2's ranks.
    assert all(layout[row["rank"]]["pp"][0] == 2 for row in view["ranks"])


def test_a_small_job_keeps_its_per_rank_view() -> None:
    """Up to GROUPS_FROM - 1 ranks: no groups; up to MAX_TABLE_ROWS every rank has its
    row; up to MAX_GROUP_ROWS nodes every node its system row."""
    view = build_view(big_run(GROUPS_FROM - 1))
    assert view["groups"] == [] and view["ranks_shown_note"] is not None
    assert len(view["system"]) == (GROUPS_FROM - 1) // 8 and view["system_note"] is None
    few = build_view(big_run(MAX_TABLE_ROWS))
    assert [row["rank"] for row in few["ranks"]] == list(range(MAX_TABLE_ROWS))
    assert few["ranks_shown_note"] is None and few["memory"] and len(few["memory"]) == 16
    assert build_view(big_run(GROUPS_FROM))["groups"][0]["by"] == "node"


def test_outliers_are_the_named_then_the_slowest_never_more_than_the_table() -> None:
    ranks = list(range(10240))
    p50 = {r: float(r % 97) for r in ranks}
    named = list(range(0, 400, 20))  # 20 named ranks, more than the table
    shown = outlier_ranks(ranks, named, p50)
    assert len(shown) == MAX_TABLE_ROWS and shown == sorted(shown)
    assert set(shown) & set(named) == set(named[: MAX_TABLE_ROWS - HIGHLIGHT])
    slowest = [r for r in shown if r not in named]
    assert len(slowest) == HIGHLIGHT and all(p50[r] == 96.0 for r in slowest)
    assert outlier_ranks([5, 3], [3], p50) == [3, 5]


def test_the_series_columns_and_medians_match_the_summary_percentile() -> None:
    """rank_medians and StepSeries.of give what the summary's percentile gives."""
    series = StepSeries.of(
        {4: [(1, 5.0, 1e9), (2, 1.0, 2e9), (3, 3.0, 3e9), (5, 2.0, 5e9)], 9: [(1, 7.0, 1e9)]}
    )
    assert series.ranks() == [4, 9]
    assert rank_medians(series) == {4: percentile([1.0, 2.0, 3.0, 5.0], 50.0), 9: 7.0}
    steps, index = series.step_index()
    assert steps.tolist() == [1, 2, 3, 5] and index.tolist() == [0, 1, 2, 3, 0]


def test_the_first_view_leaves_the_lines_out_and_reads_no_step() -> None:
    """``charts=False`` (the page's first view): the same groups and tables, no lines
    over steps, and the lazy step columns never made; a full view makes them once."""
    data = big_run(10240)

    def refuse() -> StepSeries:
        raise AssertionError("the first view read every rank's steps")

    first = build_view(attrs.evolve(data, series=LazySeries(refuse)), charts=False)
    full = build_view(data)
    assert first["step_time"]["deferred"] and first["step_time"]["steps"] == []
    assert first["throughput"]["steps_per_s"] == []
    assert first["groups"] == full["groups"] and first["ranks"] == full["ranks"]
    made: list[int] = []

    def make() -> StepSeries:
        made.append(1)
        assert isinstance(data.series, StepSeries)
        return data.series

    lazy = attrs.evolve(data, series=LazySeries(make))
    assert [build_view(lazy)["step_time"] for _ in range(2)] == [full["step_time"]] * 2
    assert made == [1]


def _timing(ms: float) -> dict[str, Any]:
    return {"cpu": {"cpu_ms": ms, "duration_ms": ms, "gpu_ms": None, "is_gpu": False,
                    "n_calls": 1}}  # fmt: skip


def test_the_live_source_groups_a_slower_node_by_the_states_medians() -> None:
    """72 ranks (9 nodes of 8) fed to a real live state, node 4's ranks twice as slow:
    the live view's node table puts node 4 first by p50, and each table rank's p50
    (the summary's figures) is the state's median the groups use."""
    monitoring = Monitoring(
        MonitorSettings(prometheus_port=0),
        RunInfo(run_dir=Path("."), run_name="live", host="h"),
        Health,
    )
    state = monitoring.state
    for rank in range(72):
        identity = {"global_rank": rank, "local_rank": rank % 8, "world_size": 72,
                    "local_world_size": 8, "node_rank": rank // 8}  # fmt: skip
        slow = 2.0 if rank // 8 == 4 else 1.0
        items = [
            {"seq": n, "step": n, "timestamp_unix_ns": 10**18 + n * 10**8,
             "events": {"_traceml_internal:step_time": _timing(slow * (20.0 + (rank + n) % 5))}}
            for n in range(1, 41)
        ]  # fmt: skip
        state.add_steps(identity, items)
    data = LiveSource(monitoring)()
    view = build_view(data)
    (nodes,) = view["groups"]
    assert nodes["count"] == 9
    top = max(nodes["rows"], key=lambda row: row["p50_ms"])
    assert top["group"] == 4 and top["p50_ms"] > 1.8 * min(r["p50_ms"] for r in nodes["rows"])
    assert data.rank_p50_ms is not None and len(data.rank_p50_ms) == 72
    for row in view["ranks"]:
        assert row["p50_ms"] == pytest.approx(data.rank_p50_ms[row["rank"]])
    assert {row["rank"] for row in view["ranks"]} >= set(range(32, 40))
    assert view["step_time"]["band"] and len(view["step_time"]["median"]) == 40
