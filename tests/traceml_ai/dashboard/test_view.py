"""The view builder (``traceml_ai.dashboard._view``): its fixed choices, and the page of
a large job: bounded by groups, never a row per rank."""

from __future__ import annotations

from typing import Any

import orjson

from tests.traceml_ai.dashboard.big_runs import BASE_MS, big_run, layout_of
from traceml_ai.analysis import BUILT_IN_PHASES, MAX_USER_PHASES, OTHER_PHASE, percentile
from traceml_ai.dashboard._view import (
    GROUPS_FROM,
    HIGHLIGHT,
    MAX_GROUP_ROWS,
    MAX_TABLE_ROWS,
    PHASE_COLOURS,
    USER_PHASE_COLOURS,
    StepSeries,
    build_view,
    outlier_ranks,
    rank_medians,
)


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
