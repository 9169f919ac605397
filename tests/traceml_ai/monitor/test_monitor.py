"""The live views' core: the state, its feed, the metric definitions and the
Prometheus endpoint (in process, real HTTP on the loopback)."""

from __future__ import annotations

import math
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.custom_exporters import process_item, step_memory_item, system_item
from tests.e2e_helpers import PY, REPO, clean_env
from traceml_ai.monitor import Monitoring, RunInfo, prometheus_sink, start_monitoring
from traceml_ai.monitor._feed import LiveFeed
from traceml_ai.monitor._state import (
    MAX_USER_PHASES,
    OTHER_PHASE,
    STEP_BUCKETS_S,
    LiveState,
)
from traceml_ai.monitor.metrics import (
    METRICS,
    RANK_HISTOGRAMS,
    Family,
    Health,
    collect,
    metrics_table_markdown,
    series_estimate,
    series_table_markdown,
)
from traceml_ai.monitor.prometheus import exposition
from traceml_ai.settings import MonitorSettings, resolve_launch_settings
from traceml_ai.transport.wire import ReceivedBatch

DOCS = REPO / "docs" / "monitoring.md"


def identity(rank: int, world: int = 2, node: int = 0) -> dict[str, Any]:
    return {
        "global_rank": rank,
        "local_rank": rank,
        "world_size": world,
        "local_world_size": world,
        "node_rank": node,
        "pid": 1000 + rank,
        "hostname": "h",
    }


def families_of(
    state: LiveState, health: Health | None = None, *, max_ranks: int = 64
) -> dict[str, Family]:
    found = collect(state, health or Health(), run_name="r", rank_series_max_ranks=max_ranks)
    return {f.metric.name: f for f in found}


def timing(ms: float) -> dict[str, Any]:
    """A host phase's timing as a rank's wire item carries it."""
    return {"cpu": {"duration_ms": ms, "cpu_ms": ms, "gpu_ms": None, "is_gpu": False, "n_calls": 1}}


def step(step_no: int, step_ms: float, end_ns: int, **phases: float) -> dict[str, Any]:
    events: dict[str, Any] = {"_traceml_internal:step_time": timing(step_ms)}
    for name, ms in phases.items():
        events[name] = timing(ms)
    return {"seq": step_no, "step": step_no, "timestamp_unix_ns": end_ns, "events": events}


def encoded(stream: str, ident: dict[str, Any], items: list[Any]) -> ReceivedBatch:
    body = orjson.dumps(
        {"v": 1, "token": "t", "type": "batch", "stream": stream, "identity": ident, "items": items}
    )
    return ReceivedBatch(observed_timestamp_unix_ns=time.time_ns(), payload=body, nbytes=len(body))


# -- the state ------------------------------------------------------------------------


def test_state_takes_steps_into_histograms_and_keeps_a_window() -> None:
    state = LiveState()
    items = [
        step(i, 20.0, i * 10**9, **{"_traceml_internal:forward_time": 5.0}) for i in range(1, 6)
    ]
    seen = state.add_steps(identity(1, world=4, node=1), items)
    assert [s.step for s in seen] == [1, 2, 3, 4, 5]
    (rank,) = state.ranks()
    assert (rank.rank, rank.node, rank.steps, rank.last_step) == (1, 1, 5, 5)
    assert rank.step_hist.n == 5 and math.isclose(rank.step_hist.total, 0.1)
    # 20 ms falls in the (10 ms, 25 ms] bucket.
    assert rank.step_hist.counts[STEP_BUCKETS_S.index(0.025)] == 5
    assert rank.phase_hist["forward"].n == 5
    assert state.world_size == 4
    columns = state.recent_columns()[1]
    assert columns.steps.tolist() == [1, 2, 3, 4, 5]
    row = columns.row(4)
    assert list(row.phases) == ["forward"] and row.end_ns is not None and row.used_ms is None


@pytest.mark.parametrize(
    "bad",
    [
        "not a dict",
        {"step": "1", "timestamp_unix_ns": 1, "events": {}},
        {"step": 0, "timestamp_unix_ns": 1, "events": {}},
        {"step": 1, "timestamp_unix_ns": -5, "events": {}},
        {"step": 1, "timestamp_unix_ns": 1, "events": []},
        {"step": 1, "timestamp_unix_ns": 1, "events": {"x": {"cpu": {"duration_ms": 1.0}}}},
        step(1, math.nan, 1),
        step(1, -3.0, 1),
        step(1, True, 1),  # type: ignore[arg-type]
    ],
)
def test_state_leaves_out_malformed_steps_and_counts_them(bad: Any) -> None:
    state = LiveState()
    assert state.add_steps(identity(0), [bad]) == []
    assert state.ignored_items == 1
    assert all(r.steps == 0 for r in state.ranks())


@pytest.mark.parametrize("rank", [-1, 2**40, "0", None, 1.0])
def test_state_ignores_impossible_ranks(rank: Any) -> None:
    state = LiveState()
    ident = identity(0)
    ident["global_rank"] = rank
    state.add_steps(ident, [step(1, 5.0, 1)])
    state.add_process(ident, [process_item()])
    assert state.ranks() == [] and state.ignored_items == 1


def test_user_phase_names_are_bounded_the_rest_is_other() -> None:
    state = LiveState()
    names = {f"phase_{i}": 1.0 for i in range(MAX_USER_PHASES + 5)}
    state.add_steps(identity(0), [step(1, 50.0, 1, **names)])
    (rank,) = state.ranks()
    labels = set(rank.phase_hist)
    assert len(labels) == MAX_USER_PHASES + 1 and OTHER_PHASE in labels
    # Five names folded into one "other" observation of their sum.
    assert rank.phase_hist[OTHER_PHASE].total == pytest.approx(0.005)
    assert len(state.folded_phase_names) == 5


def test_gauges_from_memory_process_and_system() -> None:
    state = LiveState()
    state.add_memory(identity(0), [step_memory_item(device="cuda:0")])
    state.add_process(identity(0), [process_item(gpu=True)])
    state.add_system(identity(0), [system_item(gpus=2)])
    families = families_of(state)
    assert families["traceml_step_peak_allocated_bytes"].samples[0].labels == ("0", "cuda:0")
    assert families["traceml_process_resident_memory_bytes"].samples
    gpu_temps = families["traceml_gpu_temperature_celsius"].samples
    assert [s.labels for s in gpu_temps] == [("0", "0"), ("0", "1")]
    assert all(s.value == 61.0 for s in gpu_temps)


# -- the feed ---------------------------------------------------------------------------


def test_feed_never_blocks_a_full_queue_drops_and_counts() -> None:
    state = LiveState()
    feed = LiveFeed(state, max_batches=3)  # not started: nothing drains
    batch = encoded("step_time", identity(0), [step(1, 5.0, 1)])
    started = time.monotonic()
    for _ in range(10):
        feed.submit(batch)
    assert time.monotonic() - started < 1.0
    assert feed.dropped_batches == 7
    feed.stop(0.1)
    assert feed.dropped_batches == 10  # what was still queued at stop counts too


def test_feed_takes_a_read_together_in_order_as_one_by_one() -> None:
    """``submit_many`` (what the aggregator hands on per read) keeps the order and the
    bounds of ``submit``: the same state, the same drops."""
    batches = [
        encoded("step_time", identity(rank), [step(i, 5.0 + i, 10**18 + i)])
        for i in range(1, 6)
        for rank in (0, 1)
    ]
    together, alone = LiveFeed(LiveState(), max_batches=7), LiveFeed(LiveState(), max_batches=7)
    together.submit_many(batches[:4])
    together.submit_many(batches[4:])
    for batch in batches:
        alone.submit(batch)
    assert together.dropped_batches == alone.dropped_batches == 3
    for feed in (together, alone):
        feed.start()
        feed.stop(5.0)
    assert together.dropped_batches == alone.dropped_batches == 3
    assert together.state.recent_steps() == alone.state.recent_steps()
    assert [s.step for s in together.state.recent_steps()[0]] == [1, 2, 3, 4]


def test_feed_sees_a_straggler_inside_backward_through_collectives() -> None:
    """Both ranks' backward lasts as long (rank 1 computes 30 ms longer, rank 0 waits
    that long in DDP's all-reduce): phase times say none, the measured waits name rank 1
    in backward, and /metrics says the same."""
    state = LiveState()
    feed = LiveFeed(state, straggler_period_s=0.05)
    feed.start()
    base = 10**18
    for rank in (0, 1):
        steps, waits = [], []
        for i in range(1, 21):
            steps.append(
                step(
                    i,
                    40.0,
                    base + i * 45_000_000,
                    **{
                        "_traceml_internal:forward_time": 4.0,
                        "_traceml_internal:backward_time": 35.0,
                    },
                )
            )
            waits.append(
                {
                    "timestamp_unix_ns": base + i * 45_000_000,
                    "seq": i - 1,
                    "step": i,
                    "phase": "_traceml_internal:backward_time",
                    "op": "all_reduce",
                    "source": "ddp_comm_hook",
                    "backend": "gloo",
                    "n_calls": 1,
                    "wait_ms": 31.0 if rank == 0 else 1.0,
                    "wait_measure": "host",
                    "first_arrival_ms": 4.0 if rank == 0 else 34.0,
                    "last_arrival_ms": 4.0 if rank == 0 else 34.0,
                }
            )
        feed.submit(encoded("step_time", identity(rank), steps))
        feed.submit(encoded("collectives", identity(rank), [*waits, {"step": "bad"}]))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (state.straggler and state.straggler.stragglers):
        time.sleep(0.05)
    feed.stop(1.0)
    view = state.straggler
    assert view is not None and view.basis == "collectives"
    assert view.named_ranks == [1] and view.stragglers[0].phase == "backward"
    assert view.waiting is not None
    assert (view.waiting.phase, view.waiting.collective) == ("backward", "all_reduce")
    assert state.ignored_items == 2  # the malformed item of each rank
    families = families_of(state)
    (excess,) = families["traceml_straggler_excess_seconds"].samples
    assert excess.labels == ("1", "backward") and excess.value == pytest.approx(0.030, abs=0.002)


def test_the_live_straggler_percentage_is_over_the_run_so_far() -> None:
    """Rank 1 works 30 ms more every step while the others' own work (the percentage's
    base) is 20 ms in one window and 10 ms in the next: each window alone says +150 %,
    then +300 %; the live view's percentage is over every verdict so far, and steady."""
    from traceml_ai.analysis import analyze
    from traceml_ai.monitor._feed import STRAGGLER_STEPS

    state = LiveState()
    feed = LiveFeed(state)
    end = {0: 10**18, 1: 10**18}
    step_no = 0
    live: list[float] = []
    window: list[float] = []
    totals = [0.0, 0.0]
    for iteration in [50.0, 40.0] * 4:
        items: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
        for _ in range(STRAGGLER_STEPS):
            step_no += 1
            for rank in (0, 1):
                end[rank] += int(iteration * 1e6)
                fwd, bwd = (32.0, 3.0) if rank == 1 else (2.0, 33.0)
                items[rank].append(
                    step(step_no, iteration - 5.0, end[rank],
                         **{"_traceml_internal:forward_time": fwd,
                            "_traceml_internal:backward_time": bwd})
                )  # fmt: skip
        for rank in (0, 1):
            state.add_steps(identity(rank), items[rank])
        alone = analyze(state.recent_columns(STRAGGLER_STEPS))
        (mine,) = alone.stragglers
        window.append(mine.excess_pct or 0.0)
        totals[0] += mine.excess_ms
        totals[1] += mine.others_own_work_ms
        feed._update_straggler()
        view = state.straggler
        assert view is not None and view.named_ranks == [1]
        live.append(view.stragglers[0].excess_pct or 0.0)
    assert window[:2] == [pytest.approx(150.0, abs=2), pytest.approx(300.0, abs=2)]
    assert live[-1] == pytest.approx(100.0 * totals[0] / totals[1], abs=0.1)
    later = live[3:]
    assert max(later) - min(later) < 0.1 * min(later), live
    assert max(window) - min(window) > 0.5 * min(window), window


def test_collectives_items_are_checked_and_bounded() -> None:
    """Malformed collectives items are counted; a rank sending endless distinct
    operations cannot grow one step's waits past the bound."""
    from traceml_ai.monitor._state import MAX_WAIT_KEYS

    state = LiveState()
    item = {"step": 1, "phase": "_traceml_internal:backward_time", "wait_ms": 1.0}
    hostile = [{**item, "op": f"op{i}"} for i in range(500)]
    bad = [{**item, "op": "all_reduce", "wait_ms": -1.0}, {**item, "op": 3}, "x"]
    state.add_collectives(identity(0), [*hostile, *bad])
    live = state._ranks[0]
    ((step, waits),) = live.waits.items()
    assert len(waits) + len(live.op_waits[step]) == MAX_WAIT_KEYS
    assert state.ignored_items == 500 - (MAX_WAIT_KEYS - 1) + 3


def test_feed_reads_batches_and_names_the_straggler() -> None:
    state = LiveState()
    feed = LiveFeed(state, straggler_period_s=0.05)
    feed.start()
    base = 10**18
    for rank in (0, 1):
        items = []
        for i in range(1, 21):
            # Rank 1 spends 30 ms more in forward; rank 0 waits that long in backward.
            fwd, bwd = (35.0, 5.0) if rank == 1 else (5.0, 35.0)
            items.append(
                step(
                    i,
                    45.0,
                    base + i * 50_000_000,
                    **{
                        "_traceml_internal:forward_time": fwd,
                        "_traceml_internal:backward_time": bwd,
                    },
                )
            )
        feed.submit(encoded("step_time", identity(rank), items))
    feed.submit(encoded("step_time", identity(0), ["garbage"]))
    feed.submit(ReceivedBatch(observed_timestamp_unix_ns=1, payload=b"{broken", nbytes=7))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (state.straggler and state.straggler.stragglers):
        time.sleep(0.05)
    feed.stop(1.0)
    view = state.straggler
    assert view is not None and view.verdict == "straggler"
    assert view.named_ranks == [1]
    assert feed.bad_batches == 1 and state.ignored_items == 1
    families = families_of(state)
    assert [(s.labels, s.value) for s in families["traceml_stragglers"].samples] == [
        (("straggler",), 1.0)
    ]
    (excess,) = families["traceml_straggler_excess_seconds"].samples
    assert excess.labels == ("1", "forward") and excess.value == pytest.approx(0.030, abs=0.002)


# -- the metric definitions -------------------------------------------------------------


def test_metric_names_follow_the_conventions() -> None:
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    for m in METRICS:
        assert m.name.startswith("traceml_")
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        if m.unit == "s":
            assert m.name.endswith("_seconds"), m.name
        if m.unit == "By":
            assert m.name.endswith("_bytes"), m.name
        assert "step" not in m.labels  # never one series per step


def test_the_docs_table_is_generated_from_the_definitions() -> None:
    assert metrics_table_markdown() in DOCS.read_text(encoding="utf-8"), (
        "docs/monitoring.md's metric table is out of date: paste "
        "traceml_ai.monitor.metrics.metrics_table_markdown()"
    )


BUILT_IN_EVENTS = ("dataloader_next", "h2d_time", "forward_time", "backward_time", "optimizer_step")


def job_state(ranks: int, per_node: int = 8, steps: int = 3) -> LiveState:
    """A job of ``ranks`` ranks, ``per_node`` per node, each with its steps (every
    built-in phase), its memory and process figures, and each node's system sample."""
    state = LiveState()
    for rank in range(ranks):
        ident = identity(rank, world=ranks, node=rank // per_node)
        events = {f"_traceml_internal:{e}": 1.0 + rank % 7 for e in BUILT_IN_EVENTS}
        items = [step(n, 30.0 + rank % 50, n, **events) for n in range(1, steps + 1)]
        state.add_steps(ident, items)
        state.add_memory(ident, [step_memory_item(device="cuda:0")])
        state.add_process(ident, [process_item(gpu=True)])
        if rank % per_node == 0:
            state.add_system(ident, [system_item(gpus=per_node)])
    return state


def _series(families: dict[str, Family]) -> int:
    """Series the Prometheus endpoint serves for these families."""
    text = exposition(list(families.values()))
    return sum(1 for line in text.splitlines() if not line.startswith("#"))


HEALTH_1024 = Health(
    written_records={"step_time": 1}, failed_records={"step_time": 0}, expected_ranks=1024
)


def test_series_at_1024_ranks_are_the_estimate_and_bounded() -> None:
    state = job_state(1024)
    bounded = families_of(state, HEALTH_1024)
    assert all(not bounded[m.name].samples for m in RANK_HISTOGRAMS)
    assert _series(bounded) == series_estimate(1024, 128, gpus_per_node=8)
    detailed = families_of(state, HEALTH_1024, max_ranks=1024)
    assert _series(detailed) == series_estimate(1024, 128, gpus_per_node=8, max_ranks=1024)
    # Above the bound, more ranks on the same nodes add no series.
    assert series_estimate(2048, 128, gpus_per_node=8) == series_estimate(
        1024, 128, gpus_per_node=8
    )


def test_rank_histograms_follow_the_bound_on_the_world_size() -> None:
    state = job_state(8, per_node=4)
    for bound, shown in ((8, True), (7, False), (0, False)):
        families = families_of(state, max_ranks=bound)
        assert bool(families["traceml_step_time_seconds"].samples) == shown, bound
        assert bool(families["traceml_phase_time_seconds"].samples) == shown, bound
    # The world size counts, not only the ranks heard from yet.
    state.add_steps(identity(0, world=16), [step(9, 5.0, 9)])
    assert not families_of(state, max_ranks=8)["traceml_step_time_seconds"].samples


def test_job_histograms_hold_every_ranks_steps() -> None:
    state = job_state(6, per_node=3, steps=4)
    families = families_of(state)
    (job,) = families["traceml_job_step_time_seconds"].samples
    ranks = [s.histogram for s in families["traceml_step_time_seconds"].samples]
    assert job.histogram is not None and job.histogram.n == 24 and len(ranks) == 6
    counts = [r.counts for r in ranks if r is not None]
    assert job.histogram.counts == [sum(c) for c in zip(*counts, strict=True)]
    assert job.histogram.total == pytest.approx(sum(r.total for r in ranks if r is not None))
    phases = {s.labels[0]: s.histogram for s in families["traceml_job_phase_time_seconds"].samples}
    assert sorted(phases) == ["backward", "dataloader_wait", "forward", "h2d", "optimizer"]
    assert all(h is not None and h.n == 24 for h in phases.values())


def test_each_rank_has_its_median_step_time() -> None:
    state = LiveState()
    times = [30.0, 10.0, 500.0, 20.0]  # one slow step does not move the median
    state.add_steps(identity(3, world=4), [step(i, ms, i) for i, ms in enumerate(times, 1)])
    (sample,) = families_of(state)["traceml_rank_step_time_median_seconds"].samples
    assert sample.labels == ("3", "0") and sample.value == pytest.approx(0.025)


def test_the_docs_series_table_is_generated() -> None:
    assert series_table_markdown() in DOCS.read_text(encoding="utf-8"), (
        "docs/monitoring.md's series table is out of date: paste "
        "traceml_ai.monitor.metrics.series_table_markdown()"
    )


# -- the Prometheus endpoint ------------------------------------------------------------


def scrape(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_prometheus_endpoint_serves_the_state(tmp_path: Path) -> None:
    lines: list[str] = []
    monitoring = start_monitoring(
        MonitorSettings(prometheus_port=0),
        RunInfo(run_dir=tmp_path, run_name="r", host="h"),
        lambda: Health(written_records={"step_time": 7}, expected_ranks=2, reporting_ranks=2),
        sinks={"prometheus": prometheus_sink},
        report=lines.append,
    )
    assert monitoring is not None
    (sink,) = monitoring.sinks
    url = f"http://127.0.0.1:{sink.port}/metrics"  # type: ignore[attr-defined]
    assert lines == [f"traceml: prometheus: metrics at {url}"]
    items = [step(i, 12.0, i, **{"_traceml_internal:backward_time": 4.0}) for i in range(1, 8)]
    monitoring.submit(encoded("step_time", identity(1), items))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(r.steps for r in monitoring.state.ranks()):
        time.sleep(0.02)
    families = scrape(url)
    assert monitoring.close(2.0).not_started == {}
    step_time = families["traceml_step_time_seconds"]
    by_name = {(s.name, s.labels.get("le")): s.value for s in step_time.samples}
    assert by_name[("traceml_step_time_seconds_count", None)] == 7
    assert by_name[("traceml_step_time_seconds_bucket", "0.01")] == 0
    assert by_name[("traceml_step_time_seconds_bucket", "0.025")] == 7
    assert by_name[("traceml_step_time_seconds_bucket", "+Inf")] == 7
    phase = families["traceml_phase_time_seconds"]
    assert {s.labels["phase"] for s in phase.samples} == {"backward"}
    records = families["traceml_export_records"]  # the parser drops _total from the family
    assert records.type == "counter" and records.samples[0].value == 7
    assert families["traceml_ranks_expected"].samples[0].value == 2
    served = set(families)
    declared = {m.name.removesuffix("_total") for m in METRICS}
    assert served <= declared
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)  # closed with the monitoring


def test_a_taken_port_is_one_line_and_the_rest_goes_on(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        lines: list[str] = []
        monitoring = Monitoring(
            MonitorSettings(prometheus_port=port),
            RunInfo(run_dir=tmp_path, run_name="r", host="h"),
            Health,
            report=lines.append,
        )
        monitoring.start_sinks({"prometheus": prometheus_sink})
    assert len(lines) == 1 and "Address already in use" in lines[0], lines
    assert lines[0].startswith("traceml: prometheus: cannot serve /metrics")
    loss = monitoring.close(1.0)
    assert "prometheus" in loss.not_started


def test_a_missing_extra_is_one_line_naming_it_and_metrics_need_none(tmp_path: Path) -> None:
    code = f"""
import sys
for name in ("prometheus_client", "opentelemetry"):
    sys.modules[name] = None  # as if the extras were not installed
from pathlib import Path
from traceml_ai.monitor import Monitoring, RunInfo, otlp_sink, prometheus_sink
from traceml_ai.monitor.metrics import Health
from traceml_ai.settings import MonitorSettings
m = Monitoring(MonitorSettings(prometheus_port=0), RunInfo(run_dir=Path({str(tmp_path)!r}), run_name="r", host="h"), Health)
m.start_sinks({{"prometheus": prometheus_sink, "otlp": otlp_sink}})
m.close(2.0)
"""
    result = subprocess.run(
        [PY, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith("traceml: prometheus: metrics at http://127.0.0.1:")
    assert "needs the 'otel' extra" in lines[1]
    assert "pip install 'traceml-ai[otel]'" in lines[1]


def test_the_default_install_never_imports_the_extras() -> None:
    code = """
import sys
import traceml_ai.aggregator._service, traceml_ai.launch.commands, traceml_ai.monitor.metrics
import traceml_ai.monitor._service
from traceml_ai.settings import MonitorSettings
# Every live view switched on: the caller names its sinks, none is imported until started.
sinks = traceml_ai.aggregator._service.live_sinks(
    MonitorSettings(prometheus_port=0, otlp=True, dashboard=True, trackers=("tensorboard", "mlflow", "wandb"))
)
assert list(sinks) == ["prometheus", "otlp", "dashboard", "tensorboard", "mlflow", "wandb"], sinks
assert traceml_ai.aggregator._service.live_sinks(MonitorSettings()) == {}
extras = ("prometheus_client", "opentelemetry", "starlette", "uvicorn", "plotly", "tensorboard", "mlflow", "wandb")
loaded = [m for m in extras if m in sys.modules]
print(",".join(loaded))
"""
    result = subprocess.run(
        [PY, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


# -- settings ---------------------------------------------------------------------------


def test_monitor_settings_resolve_from_flag_env_and_yaml(tmp_path: Path) -> None:
    yaml_path = tmp_path / "traceml.yaml"
    yaml_path.write_text("prometheus_port: 9100\notlp: on\notlp_trace_sample: 7\n")
    s = resolve_launch_settings("run", {}, environ={}, yaml_path=yaml_path)
    assert s.monitor == MonitorSettings(prometheus_port=9100, otlp=True, otlp_trace_sample=7)
    s = resolve_launch_settings(
        "serve",
        {"prometheus_port": "9200", "otlp": False},
        environ={"TRACEML_PROMETHEUS_BIND_HOST": "0.0.0.0", "TRACEML_OTLP_TRACE_SAMPLE": "3"},
        yaml_path=yaml_path,
    )
    assert s.monitor.prometheus_port == 9200 and s.monitor.otlp is False
    assert s.monitor.prometheus_bind_host == "0.0.0.0" and s.monitor.otlp_trace_sample == 3
    assert s.sources["prometheus_port"] == "--prometheus-port"
    assert resolve_launch_settings("run", {}, environ={}, yaml_path=tmp_path / "none").monitor == (
        MonitorSettings()
    )


@pytest.mark.parametrize(
    ("cli", "message"),
    [
        ({"prometheus_port": "99999"}, "--prometheus-port: expected an integer in [0, 65535]"),
        ({"otlp_trace_sample": "0"}, "--otlp-trace-sample: expected a whole number of at least 1"),
        ({"otlp": "maybe"}, "--otlp: expected one of 1/0"),
    ],
)
def test_bad_monitor_settings_are_one_clear_error(cli: dict[str, str], message: str) -> None:
    from traceml_ai.settings import SettingsError

    with pytest.raises(SettingsError) as caught:
        resolve_launch_settings("run", cli, environ={}, yaml_path=Path("/nonexistent/x.yaml"))
    assert str(caught.value).startswith(message)


def test_cli_flag_errors_are_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [PY, "-m", "traceml_ai", "run", "--prometheus-port", "http", "x.py"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("traceml: error: --prometheus-port")
    assert "Traceback" not in result.stderr


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))


def test_feed_keeps_the_latest_gauge_batch_of_a_rank_and_every_step() -> None:
    state = LiveState()
    feed = LiveFeed(state)
    for n in range(1, 6):
        item = step_memory_item(step=n, device="cuda:0")
        item["peak_allocated_bytes"] = n * 1000
        feed.submit(encoded("step_memory", identity(0), [item]))
        feed.submit(encoded("step_time", identity(0), [step(n, 5.0, n)]))
    feed.start()  # one pop holds all ten batches
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(r.steps == 5 for r in state.ranks()):
        time.sleep(0.02)
    feed.stop(1.0)
    (rank,) = state.ranks()
    assert rank.steps == 5  # every step counts
    assert rank.peak_memory["cuda:0"][0] == 5000  # the latest sample is what shows
    assert feed.dropped_batches == 0


def test_feed_waits_while_the_export_is_behind() -> None:
    state = LiveState()
    behind = [True]
    feed = LiveFeed(state, max_batches=4, export_backlog=lambda: 0.9 if behind[0] else 0.0)
    feed.start()
    feed.submit(encoded("step_time", identity(0), [step(1, 5.0, 1)]))
    time.sleep(0.3)
    assert all(r.steps == 0 for r in state.ranks())  # yielding to the export
    for n in range(2, 12):
        feed.submit(encoded("step_time", identity(0), [step(n, 5.0, n)]))
    assert feed.dropped_batches == 6  # its own bound, counted; never the export's
    behind[0] = False
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(r.steps == 5 for r in state.ranks()):
        time.sleep(0.02)
    feed.stop(1.0)
    assert [r.steps for r in state.ranks()] == [5]


def test_folding_user_phases_is_said_once(tmp_path: Path) -> None:
    lines: list[str] = []
    monitoring = Monitoring(
        MonitorSettings(), RunInfo(run_dir=tmp_path, run_name="r", host="h"), Health,
        report=lines.append,
    )  # fmt: skip
    monitoring.feed.start()
    names = {f"phase_{i:02d}": 1.0 for i in range(MAX_USER_PHASES + 3)}
    for n in (1, 2):
        monitoring.submit(encoded("step_time", identity(0), [step(n, 50.0, n, **names)]))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(r.steps == 2 for r in monitoring.state.ranks()):
        time.sleep(0.02)
    monitoring.close(1.0)
    assert len(lines) == 1, lines
    assert f"more than {MAX_USER_PHASES} user phase names" in lines[0]
    assert "'phase_08'" in lines[0] and "count as 'other'" in lines[0]


def test_a_scraper_that_never_reads_does_not_hold_the_run(tmp_path: Path) -> None:
    import socket

    monitoring = start_monitoring(
        MonitorSettings(prometheus_port=0),
        RunInfo(run_dir=tmp_path, run_name="r", host="h"),
        Health,
        sinks={"prometheus": prometheus_sink},
        report=lambda line: None,
    )
    assert monitoring is not None
    port = monitoring.sinks[0].port  # type: ignore[attr-defined]
    stuck = socket.create_connection(("127.0.0.1", port))
    stuck.sendall(b"GET /metrics HTTP/1.1\r\n")  # never finishes its request
    try:
        started = time.monotonic()
        loss = monitoring.close(2.0)
        assert time.monotonic() - started < 3.0
        assert loss.not_started == {} and loss.by_sink == {}
    finally:
        stuck.close()
