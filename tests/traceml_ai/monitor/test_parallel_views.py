"""Every view reads the one engine's answer for a job with several parallel dimensions:
a generated run (tests/parallel_cases.py) fed to the live state as its ranks' items,
then Prometheus/OTLP's families, the trackers' points and the dashboard's page, live
and from the files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from tests.parallel_cases import GroundTruth, generate
from traceml_ai.analysis import analyze, summarize_run
from traceml_ai.dashboard._files import from_summary
from traceml_ai.dashboard._view import MAX_TABLE_ROWS, build_view
from traceml_ai.monitor import tracker_metrics as tm
from traceml_ai.monitor._state import LiveState
from traceml_ai.monitor.metrics import (
    IMBALANCE_SPREAD,
    SLOW_STAGE_EXCESS,
    SLOWDOWN,
    STRAGGLERS,
    Health,
    collect,
)
from traceml_ai.monitor.trackers import point_figures


def _lines(truth: GroundTruth, stream: str) -> list[dict[str, Any]]:
    path = truth.folder / "aggregator" / "export" / f"{stream}.jsonl"
    objs = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    return [o for o in objs if not o.get("closing")]


def _identity(line: dict[str, Any]) -> dict[str, Any]:
    keys = ("global_rank", "local_rank", "world_size", "local_world_size", "node_rank")
    return {k: line[k] for k in keys}


def _live(truth: GroundTruth) -> LiveState:
    """The live state fed as the aggregator feeds it: each rank's items, in order."""
    state = LiveState()
    for line in _lines(truth, "runtime_environment"):
        state.add_environment(_identity(line), [line])
    for line in _lines(truth, "step_time"):
        state.add_steps(_identity(line), [line])
    for line in _lines(truth, "collectives"):
        state.add_collectives(_identity(line), [line])
    return state


def _families(state: LiveState) -> dict[str, Any]:
    found = collect(state, Health(), run_name="r", rank_series_max_ranks=64)
    return {f.metric.name: f for f in found}


def test_live_views_name_the_slow_stage_and_the_imbalance(tmp_path: Path) -> None:
    truth = generate(
        tmp_path / "run",
        tp=2,
        dp=4,
        pp=4,
        seq_len=(256, 1024),
        stage_extra_ms={3: 6.0},
        tokens=True,
    )
    state = _live(truth)
    layout = state.layout()
    assert len(layout) == 32 and layout[31] == {"tp": (1, 2), "dp": (3, 4), "pp": (3, 4)}
    view = analyze(
        state.recent_columns(), None, state.rank_nodes(), state.collectives_measured(), layout
    )
    # The live answer is the files' answer.
    files = summarize_run(truth.folder).straggler
    assert files is not None
    assert view.verdict == files.verdict
    assert {c.verdict for c in (view, *view.also)} == {"slow_stage", "data_imbalance"}
    state.set_straggler(view)

    families = _families(state)
    (verdict,) = families[STRAGGLERS.name].samples
    assert verdict.labels == (view.verdict,) and verdict.value == 0  # no rank is a straggler
    slowdown = {s.labels[0]: s.value for s in families[SLOWDOWN.name].samples}
    assert set(slowdown) == {"slow_stage", "data_imbalance"} and min(slowdown.values()) > 1.0
    (stage,) = families[SLOW_STAGE_EXCESS.name].samples
    assert stage.labels == ("3",) and stage.value > 0.005
    assert families[IMBALANCE_SPREAD.name].samples[0].value > 0

    point = point_figures(state, 20, 10)
    assert point[tm.SLOW_STAGE.name] == 3.0 and point[tm.SLOWDOWN.name] > 1.0
    stages = {k: v for k, v in point.items() if k.startswith("traceml/stage/")}
    assert sorted(stages) == [tm.STAGE_STEP_TIME_MS.format(stage=s) for s in range(4)]
    assert (
        point[tm.STEP_TIME_MIN.name]
        <= point[tm.STEP_TIME_MEDIAN.name]
        <= point[tm.STEP_TIME_P90.name]
        <= point[tm.STEP_TIME_MAX.name]
    )


def test_the_page_shows_stages_and_distributions_not_a_row_per_rank(tmp_path: Path) -> None:
    truth = generate(tmp_path / "run", tp=2, dp=4, pp=4, stage_extra_ms={3: 6.0})
    page = build_view(from_summary(summarize_run(truth.folder)))
    assert len(page["ranks"]) <= MAX_TABLE_ROWS < 32
    assert [s["stage"] for s in page["stages"]] == [0, 1, 2, 3]
    assert [s["slow"] for s in page["stages"]] == [False, False, False, True]
    assert page["stages"][3]["own_work_ms"] > page["stages"][0]["own_work_ms"]
    figures = {row["figure"]: row for row in page["spread"]}
    assert {"step time p50 (ms)", "steps/s", "own work per iteration (ms)"} <= set(figures)
    row = figures["own work per iteration (ms)"]
    assert row["min"] <= row["p50"] <= row["p90"] <= row["max"]
    assert page["straggler"]["verdict"] == "slow_stage"
    assert page["straggler"]["line"].startswith("slow stage: stage 3")
    assert page["straggler"]["cost"] is None  # the line says each cause's cost itself


def test_a_hostile_layout_or_group_is_no_layout_and_no_new_key() -> None:
    """What a rank may send that no layout is: too many dimensions, a coordinate past
    its size, not an object; a group name of any length is not made a wait key."""
    state = LiveState()
    me = {"global_rank": 0, "local_rank": 0, "world_size": 2, "local_world_size": 2}
    for parallel in (
        {f"d{i}": {"rank": 0, "size": 2} for i in range(1000)},
        {"pp": {"rank": 5, "size": 2}},
        "pp=2",
        [1, 2],
    ):
        state.add_environment({**me, "node_rank": 0}, [{"parallel": parallel}])
        assert state.layout() == {}
    timing = {"cpu_ms": 5.0, "duration_ms": 5.0, "gpu_ms": None, "is_gpu": False, "n_calls": 1}
    events = {"_traceml_internal:step_time": {"cpu": timing}}
    state.add_steps({**me, "node_rank": 0}, [{"step": 1, "timestamp_unix_ns": 1, "events": events}])
    state.add_collectives(
        {**me, "node_rank": 0},
        [{"step": 1, "phase": "_traceml_internal:forward_time", "op": "all_reduce",
          "wait_ms": 1.0, "group": "x" * 10_000}],
    )  # fmt: skip
    row = state.recent_columns()[0].row(0)
    assert row.waits["forward"] == 1.0  # the wait counts, under its operation alone
    assert list(row.op_waits) == [("forward", "all_reduce")]
