"""The Prometheus endpoint scraped by a real Prometheus server during a real run.

A 2-rank DDP run (gloo, CPU) with rank 1 slowed in its forward pass serves
``/metrics`` from its aggregator; Debian's Prometheus (tests/receivers/
prometheus_server.py) scrapes it every half second. After the run the test asks the
server, through its HTTP API, what it stored and compares it with the run's own
step_time.jsonl: the same steps in the same histogram buckets, the quantiles in the
file's buckets, where the fast rank waits, the straggler named, the export's health.
The Grafana dashboard's queries run against the same data.

The docs' pieces are checked too, without a server: every metric the Grafana
dashboard queries is one the endpoint serves, and the OpenTelemetry Collector
configuration is one.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e_helpers import REPO, clean_env, closing_line, data_lines, free_port, traceml_cmd
from tests.receivers.prometheus_server import PrometheusServer, prometheus_server
from tests.traceml_ai.monitor.test_monitor import families_of, identity, job_state
from traceml_ai.analysis import Cause, Imbalance, Slowdown, SlowStage, Straggler, StragglerView
from traceml_ai.monitor._state import WINDOW_STEPS
from traceml_ai.monitor.metrics import METRICS, Health, traceml_version
from traceml_ai.monitor.prometheus import exposition

SCRIPT = REPO / "tests" / "scripts" / "straggler_train.py"
DASHBOARD = REPO / "docs" / "grafana" / "traceml-dashboard.json"
COLLECTOR = REPO / "docs" / "otel-collector.yaml"

RUN = 'r "one" é'
"""The run's name: a quote and a non-ASCII letter, which its info label must carry."""
STEPS = 200
"""About 7 s of steps at ~36 ms each (rank 1 sleeps 30 ms in forward): a dozen and
more scrapes, and at least one pass of the live straggler analysis (every 5 s) over
a good part of them."""
SLEEP_MS = 30
STEP_EVENT = "_traceml_internal:step_time"
PHASE_EVENTS = {
    "forward": "_traceml_internal:forward_time",
    "backward": "_traceml_internal:backward_time",
}

# Grafana's variables, as the dashboard's queries would receive them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$job": "traceml", "$rank": ".*"}


def _ms(events: dict[str, Any], event: str) -> float:
    """An event's time in a step (its longest device), in ms."""
    return max(float(t["duration_ms"]) for t in events[event].values())


def _buckets(values_s: list[float], bounds: list[float]) -> list[int]:
    """Cumulative counts at each upper bound (Prometheus' ``le``: value <= bound)."""
    return [sum(1 for v in values_s if v <= bound) for bound in bounds]


def _quantile_bucket(values_s: list[float], bounds: list[float], q: float) -> tuple[float, float]:
    """The bucket (lower, upper] ``histogram_quantile(q)`` interpolates in for these
    values: the first whose cumulative count reaches q x count, i.e. the bucket of the
    file's own nearest-rank quantile (the median for q = 0.5)."""
    ordered = sorted(values_s)
    nearest_rank = ordered[max(0, math.ceil(q * len(ordered)) - 1)]
    lower = 0.0
    for bound in bounds:
        if nearest_rank <= bound:
            return lower, bound
        lower = bound
    raise AssertionError(f"{nearest_rank} s beyond the last finite bucket")


def _by_rank(series: list[dict[str, Any]]) -> dict[int, float]:
    return {int(s["metric"]["rank"]): float(s["value"][1]) for s in series}


def _at(prom: PrometheusServer, expr: str, at: float) -> list[dict[str, Any]]:
    return prom.query(expr, at=at)


def _dashboard() -> dict[str, Any]:
    obj = json.loads(DASHBOARD.read_text())
    assert isinstance(obj, dict)
    return obj


def _panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(panel title, its PromQL expressions) of every panel (rows' panels included)."""
    out: list[tuple[str, list[str]]] = []
    panels = list(dashboard["panels"])
    while panels:
        panel = panels.pop(0)
        panels.extend(panel.get("panels", []))
        if panel.get("type") == "row":
            continue
        exprs = [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
        out.append((panel["title"], exprs))
    return out


def _grafana_to_promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"an unknown Grafana variable in {expr}"
    return expr


# ------------------------------------------------------------------ the real run


def test_prometheus_scrapes_a_real_two_rank_run(tmp_path: Path) -> None:
    port = free_port()
    logs = tmp_path / "logs"
    with prometheus_server(
        [f"127.0.0.1:{port}"], job="traceml", scrape_interval_s=0.5, folder=tmp_path / "prom"
    ) as prom:
        # The server picks up its targets a few seconds after it starts; the run's
        # own start (two ranks importing torch) covers that.
        res = subprocess.run(
            traceml_cmd(
                "run",
                "--logs-dir",
                logs,
                "--run-name",
                RUN,
                "--nproc-per-node",
                "2",
                "--master-port",
                str(free_port()),
                "--exporter",
                "jsonl",
                "--prometheus-port",
                str(port),
                SCRIPT,
                "--where",
                "forward",
                "--slow-ranks",
                "1",
                "--sleep-ms",
                str(SLEEP_MS),
                "--steps",
                str(STEPS),
            ),
            cwd=tmp_path,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        why = res.stderr + "\nprometheus:\n" + prom.log_tail()
        assert res.returncode == 0, why
        assert f"traceml: prometheus: metrics at http://127.0.0.1:{port}/metrics" in res.stderr
        _check_stored(prom, logs / RUN / "aggregator" / "export", why)


def _check_stored(prom: PrometheusServer, export: Path, why: str) -> None:
    lines = data_lines(export / "step_time.jsonl")
    steps: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for line in sorted(lines, key=lambda d: (d["global_rank"], d["seq"])):
        steps[line["global_rank"]].append(line["events"])
    assert [len(steps[0]), len(steps[1])] == [STEPS, STEPS], why

    # Every scrape of the endpoint: up 1 while the aggregator lived.
    (up,) = prom.samples('up{job="traceml"}')
    good = [float(t) for t, v in up["values"] if v == "1"]
    assert len(good) >= 5, (up, why)
    last = max(good)  # the last scrape that reached the aggregator: the run's last values

    # Scraped while the steps went on: the step counts grow from scrape to scrape.
    counts = {
        int(s["metric"]["rank"]): [float(v) for _, v in s["values"]]
        for s in prom.samples('traceml_steps_total{job="traceml"}')
    }
    assert set(counts) == {0, 1}, counts
    for rank, seen in counts.items():
        assert seen == sorted(seen), (rank, seen)
        assert any(0 < n < STEPS for n in seen), (rank, seen, why)

    # The step counts at the last scrape: the file's (or a few fewer, the last steps
    # arriving after it).
    final = _by_rank(_at(prom, 'traceml_steps_total{job="traceml"}', last))
    assert set(final) == {0, 1}, final
    for rank, n in final.items():
        assert STEPS - 30 <= n <= STEPS, (rank, n, why)
    taken = {rank: int(n) for rank, n in final.items()}

    # The step time histogram: at the last scrape, each rank's buckets hold exactly
    # the file's first steps of that rank (as many as it had counted).
    stored: dict[int, dict[float, float]] = {0: {}, 1: {}}
    for s in _at(prom, 'traceml_step_time_seconds_bucket{job="traceml"}', last):
        stored[int(s["metric"]["rank"])][float(s["metric"]["le"])] = float(s["value"][1])
        assert s["metric"]["node"] == "0", s
    bounds = sorted(b for b in stored[0] if math.isfinite(b))
    assert len(bounds) >= 5, stored
    step_s = {r: [_ms(e, STEP_EVENT) / 1000.0 for e in steps[r]] for r in (0, 1)}
    for rank in (0, 1):
        first = step_s[rank][: taken[rank]]
        assert [stored[rank][b] for b in bounds] == _buckets(first, bounds), (rank, why)
        assert stored[rank][math.inf] == taken[rank]
        total = _by_rank(_at(prom, 'traceml_step_time_seconds_sum{job="traceml"}', last))
        assert total[rank] == pytest.approx(sum(first), rel=1e-9)

    # The job's histogram: every rank's steps, in the same buckets.
    job: dict[float, float] = {
        float(s["metric"]["le"]): float(s["value"][1])
        for s in _at(prom, 'traceml_job_step_time_seconds_bucket{job="traceml"}', last)
    }
    every = [v for rank in (0, 1) for v in step_s[rank][: taken[rank]]]
    assert [job[b] for b in bounds] == _buckets(every, bounds), why
    assert job[math.inf] == sum(taken.values())

    # Each rank's median over its recent steps: the file's median of those steps.
    medians = _by_rank(_at(prom, 'traceml_rank_step_time_median_seconds{job="traceml"}', last))
    for rank in (0, 1):
        recent = step_s[rank][: taken[rank]][-WINDOW_STEPS:]
        assert medians[rank] == pytest.approx(statistics.median(recent), rel=1e-9), rank

    # The run's name and TraceML's version, on one series.
    (info,) = _at(prom, 'traceml_run_info{job="traceml"}', last)
    assert info["metric"]["run"] == RUN and info["metric"]["version"] == traceml_version()
    assert float(info["value"][1]) == 1.0

    # Per-rank quantiles: in the bucket of the file's own quantile.
    for q in (0.5, 0.95):
        got = _by_rank(
            _at(
                prom,
                f"histogram_quantile({q}, sum by (rank, le) "
                f'(traceml_step_time_seconds_bucket{{job="traceml"}}))',
                last,
            )
        )
        for rank in (0, 1):
            lower, upper = _quantile_bucket(step_s[rank][: taken[rank]], bounds, q)
            assert lower <= got[rank] <= upper, (q, rank, got, lower, upper, why)
            # Over the whole file too (the few steps after the last scrape change nothing).
            assert _quantile_bucket(step_s[rank], bounds, q) == (lower, upper), (q, rank)

    # Where the ranks spend the step: rank 1 sleeps in forward; rank 0 waits for it in
    # backward (DDP's all-reduce). The sums are the file's phase times.
    phase_sums: dict[str, dict[int, float]] = {}
    for phase, event in PHASE_EVENTS.items():
        got = _by_rank(
            _at(prom, f'traceml_phase_time_seconds_sum{{job="traceml",phase="{phase}"}}', last)
        )
        for rank in (0, 1):
            expected = sum(_ms(e, event) / 1000.0 for e in steps[rank][: taken[rank]])
            assert got[rank] == pytest.approx(expected, rel=1e-9), (phase, rank)
        phase_sums[phase] = got
    waited = min(taken.values()) * SLEEP_MS / 1000.0
    assert phase_sums["backward"][0] > phase_sums["backward"][1] + 0.5 * waited, (phase_sums, why)
    assert phase_sums["forward"][1] > phase_sums["forward"][0] + 0.5 * waited, (phase_sums, why)

    # The straggler: rank 1, in forward, by about the 30 ms it sleeps.
    verdicts = {
        s["metric"]["verdict"]: float(s["value"][1])
        for s in _at(prom, 'traceml_stragglers{job="traceml"}', last)
    }
    assert verdicts == {"straggler": 1.0}, (verdicts, why)
    excess = _at(prom, 'traceml_straggler_excess_seconds{job="traceml"}', last)
    assert [(s["metric"]["rank"], s["metric"]["phase"]) for s in excess] == [("1", "forward")]
    assert 0.020 < float(excess[0]["value"][1]) < 0.045, (excess, why)

    # The export's health: the records written so far, nothing failed or lost, every
    # rank reporting.
    closing = closing_line(export / "step_time.jsonl")
    written = prom.value('traceml_export_records_total{job="traceml",stream="step_time"}', last)
    assert written is not None and sum(taken.values()) <= written <= closing["written_records"]
    for expr, expected in (
        ('sum(traceml_export_failed_records_total{job="traceml"})', 0.0),
        ('traceml_export_dropped_batches_total{job="traceml"}', 0.0),
        ('traceml_live_dropped_batches_total{job="traceml"}', 0.0),
        ('traceml_ranks_expected{job="traceml"}', 2.0),
        ('traceml_ranks_reporting{job="traceml"}', 2.0),
        ('traceml_ranks_missing{job="traceml"}', 0.0),
    ):
        assert prom.value(expr, last) == expected, (expr, why)

    # The Grafana dashboard's queries: valid PromQL that finds the run (every panel
    # shows something at the last scrape; GPU figures are absent on a CPU run).
    for title, exprs in _panel_queries(_dashboard()):
        found = [bool(_at(prom, _grafana_to_promql(e), last)) for e in exprs]
        assert any(found), (title, exprs)


# ------------------------------------------------------------------ the docs' pieces

_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _metric_names(expr: str) -> set[str]:
    """The TraceML metric names a PromQL expression selects (histogram series named by
    their family)."""
    known = {m.name: m for m in METRICS}
    names = set()
    for token in re.findall(r"\btraceml_[a-z0-9_]+", expr):
        name = token
        for suffix in _HISTOGRAM_SUFFIXES:
            base = token.removesuffix(suffix)
            if base != token and base in known and known[base].kind == "histogram":
                name = base
        names.add(name)
    return names


def _served_names() -> set[str]:
    """The sample names the endpoint serves for a run with every figure: steps, memory,
    process and system samples, a straggler named, the export's counts."""
    state = job_state(8, per_node=4)
    for rank in range(8):  # two pipeline stages, one per node
        ident = identity(rank, world=8, node=rank // 4)
        state.add_environment(ident, [{"parallel": {"pp": {"rank": rank // 4, "size": 2}}}])
    straggler = Straggler(
        rank=1, own_work_ms=40.0, others_own_work_ms=10.0, excess_ms=30.0, excess_pct=300.0,
        phase="forward", phase_excess_ms=30.0, phase_description="", slow_steps=3,
        slow_share=1.0,
    )  # fmt: skip
    slowdown = Slowdown(factor=1.5, step_ms=30.0, without_ms=20.0, method="replay")
    stage = SlowStage(
        stage=1, ranks=(4, 5, 6, 7), excess_ms=5.0, excess_pct=50.0, slow_steps=3,
        slow_share=1.0,
    )  # fmt: skip
    imbalance = Imbalance(
        replicas=4, spread_ms=3.0, uneven_steps=3, slowest_changes=2,
        slowest_changes_share=1.0, coherence=1.0, tokens_correlation=None,
    )  # fmt: skip
    view = StragglerView(
        definition="", basis="phase_times", ranks=8, applicable=True, verdict="straggler",
        stragglers=(straggler,), slowdown=slowdown,
        also=(
            Cause(verdict="slow_stage", stages=(stage,), slowdown=slowdown),
            Cause(verdict="data_imbalance", imbalance=imbalance, slowdown=slowdown),
        ),
    )  # fmt: skip
    state.set_straggler(view)
    health = Health(
        written_records={"step_time": 1}, failed_records={"step_time": 0}, expected_ranks=8
    )
    text = exposition(list(families_of(state, health).values()))
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[0] != "#"}


def test_every_metric_the_grafana_dashboard_queries_is_served() -> None:
    served = _served_names()
    assert {m.name for m in METRICS} <= {n.removesuffix("_bucket") for n in served}
    for title, exprs in _panel_queries(_dashboard()):
        for expr in exprs:
            queried = set(re.findall(r"\btraceml_[a-z0-9_]+", expr))
            assert queried and queried <= served, (title, expr, queried - served)
    templating = json.dumps(_dashboard()["templating"])
    assert set(re.findall(r"\btraceml_[a-z0-9_]+", templating)) <= served


def test_grafana_dashboard_names_only_known_metrics() -> None:
    dashboard = _dashboard()
    known = {m.name for m in METRICS}
    # Importable: the data source is an input the import asks for.
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["schemaVersion"] >= 36
    queries = _panel_queries(dashboard)
    assert len(queries) >= 6
    used: set[str] = set()
    for title, exprs in queries:
        assert exprs, f"panel {title!r} has no query"
        for expr in exprs:
            names = _metric_names(expr)
            assert names, (title, expr)
            assert names <= known, (title, expr, names - known)
            used |= names
    # The panels the docs promise.
    for name in (
        "traceml_job_step_time_seconds",
        "traceml_job_phase_time_seconds",
        "traceml_rank_step_time_median_seconds",
        "traceml_run_info",
        "traceml_step_time_seconds",
        "traceml_phase_time_seconds",
        "traceml_stragglers",
        "traceml_straggler_excess_seconds",
        "traceml_steps_total",
        "traceml_export_records_total",
        "traceml_process_resident_memory_bytes",
    ):
        assert name in used, name
    # Every panel queries the dashboard's data source.
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
    assert len({p["id"] for p in panels}) == len(panels)


def test_dashboard_metric_names_check_is_strict() -> None:
    assert _metric_names("rate(traceml_step_time_seconds_bucket[1m])") == {
        "traceml_step_time_seconds"
    }
    # A counter's _sum or a made-up name stays as written, so the check above fails.
    assert _metric_names("traceml_steps_total_sum + traceml_step_seconds") == {
        "traceml_steps_total_sum",
        "traceml_step_seconds",
    }


def test_otel_collector_config_is_a_collector_config() -> None:
    config = yaml.safe_load(COLLECTOR.read_text())
    otlp = config["receivers"]["otlp"]["protocols"]
    assert otlp["grpc"]["endpoint"].endswith(":4317")
    assert otlp["http"]["endpoint"].endswith(":4318")
    exporters = config["exporters"]
    assert {"debug", "prometheusremotewrite"} <= set(exporters)
    assert any(name == "otlp" or name.startswith("otlp/") for name in exporters)
    processors = set(config.get("processors") or {})
    pipelines = config["service"]["pipelines"]
    assert {"traces", "metrics"} <= set(pipelines)
    for name, pipeline in pipelines.items():
        # Every component a pipeline names is defined (the collector refuses otherwise).
        assert set(pipeline["receivers"]) <= set(config["receivers"]), name
        assert set(pipeline.get("processors", [])) <= processors, name
        assert set(pipeline["exporters"]) <= set(exporters), name
        assert "otlp" in pipeline["receivers"], name
    assert "prometheusremotewrite" in pipelines["metrics"]["exporters"]
    assert any(e.startswith("otlp") for e in pipelines["traces"]["exporters"])
