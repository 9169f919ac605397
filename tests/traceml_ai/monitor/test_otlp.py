"""The OTLP export (traceml_ai.monitor.otlp) against real receivers.

A loopback OTLP/HTTP receiver (tests/receivers/otlp_sink.py) decodes what arrives
with the ``opentelemetry-proto`` messages; a real ``mlflow server`` ingests the traces
(tests/receivers/mlflow_server.py). Real ``traceml run`` DDP runs (gloo, CPU) check
that every traced step matches its line in step_time.jsonl, that the metrics are the
Prometheus figures, and that a receiver that is down, killed or slow costs only
counted losses: training exits 0 and the files are complete.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.e2e_helpers import (
    REPO,
    assert_valid,
    clean_env,
    data_lines,
    export_dir,
    free_port,
    run_cli,
    traceml_cmd,
    warning_file,
)
from tests.receivers.mlflow_server import MlflowServer, server_env
from tests.receivers.otlp_sink import OtlpReceiver, ReceivedSpan
from traceml_ai.analysis._phases import step_row
from traceml_ai.monitor import Monitoring, RunInfo, SinkStartError, otlp, otlp_sink
from traceml_ai.monitor._state import StepSeen
from traceml_ai.monitor.metrics import Health
from traceml_ai.monitor.otlp import StepSampler, layout_phases, start_otlp
from traceml_ai.settings import MonitorSettings
from traceml_ai.transport.wire import ReceivedBatch

pytestmark = pytest.mark.slow  # real runs, subprocesses or receivers (docs/testing.md)

SCRIPT = REPO / "tests" / "scripts" / "straggler_train.py"
P = "_traceml_internal:"
BUILT_IN = ("dataloader_wait", "h2d", "forward", "backward", "optimizer")

OTEL_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
    "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT",
    "OTEL_METRIC_EXPORT_INTERVAL",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
)


@pytest.fixture(autouse=True)
def _no_inherited_otel(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in OTEL_VARS:
        monkeypatch.delenv(var, raising=False)


# -- helpers -------------------------------------------------------------------------


def _step(rank: int, step: int, step_ms: float, **phases: float) -> StepSeen:
    return StepSeen(rank, 0, step, 10**18 + step * 10**9, step_ms, phases)


def _monitoring(sample: int = 1, reports: list[str] | None = None) -> Monitoring:
    out = reports if reports is not None else []
    return Monitoring(
        MonitorSettings(otlp=True, otlp_trace_sample=sample),
        RunInfo(run_dir=Path("."), run_name="unit", host="aggregator-host"),
        health=lambda: Health(expected_ranks=2),
        report=out.append,
    )


def _timing(ms: float) -> dict[str, Any]:
    return {"cpu": {"cpu_ms": ms, "duration_ms": ms, "gpu_ms": None, "is_gpu": False, "n_calls": 1}}


def _step_batch(rank: int, steps: Sequence[int], step_ms: float = 20.0) -> ReceivedBatch:
    """A step_time batch as a rank sends it (decoded form)."""
    items = [
        {
            "step": s,
            "timestamp_unix_ns": time.time_ns(),
            "events": {
                P + "step_time": _timing(step_ms),
                P + "forward_time": _timing(step_ms * 0.4),
                P + "backward_time": _timing(step_ms * 0.5),
            },
        }
        for s in steps
    ]
    payload = {
        "stream": "step_time",
        "identity": {"global_rank": rank, "node_rank": 0, "world_size": 2},
        "items": items,
    }
    return ReceivedBatch(time.time_ns(), payload, 100)


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(
    tmp_path: Path,
    env: Mapping[str, str],
    *,
    sample: int = 1,
    steps: int = 12,
    sleep_ms: float = 30.0,
    run_name: str = "r",
) -> tuple[Any, Path]:
    """``traceml run`` of the straggler script on 2 ranks with OTLP on."""
    res = run_cli(
        [
            "run",
            "--logs-dir",
            tmp_path / "logs",
            "--run-name",
            run_name,
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "--exporter",
            "jsonl",
            "--otlp",
            "--otlp-trace-sample",
            str(sample),
            SCRIPT,
            "--where",
            "forward",
            "--slow-ranks",
            "1",
            "--sleep-ms",
            str(sleep_ms),
            "--steps",
            str(steps),
        ],
        cwd=tmp_path,
        env=dict(env),
        timeout=180,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res, tmp_path / "logs" / run_name


def _file_steps(run_dir: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """(rank, step) -> the step_time line, from a cleanly closed file."""
    lines = data_lines(run_dir / "aggregator" / "export" / "step_time.jsonl")
    return {(line["global_rank"], line["step"]): line for line in lines}


def _stats_otlp(run_dir: Path) -> dict[str, int]:
    stats = orjson.loads((run_dir / "aggregator" / "stats.json").read_bytes())
    monitoring = stats["monitoring"]
    assert "otlp" not in monitoring["not_started"], monitoring
    by_sink: dict[str, int] = monitoring["by_sink"].get("otlp", {})
    return by_sink


def _assert_step_span(root: Any, children: Sequence[Any], line: Mapping[str, Any]) -> None:
    """A traced step (root span and phase children, any span representation with
    ``name``, ``attributes``, start/end ns) against its step_time line."""
    row = step_row(line["events"])
    assert row is not None
    start_ns, end_ns = root[1], root[2]
    assert end_ns == line["timestamp_unix_ns"]
    assert (end_ns - start_ns) / 1e6 == pytest.approx(row.step_ms, abs=1e-5)
    phases = row.phases
    got = {name: (s, e) for name, s, e in children}
    assert set(got) == set(phases), (got, phases)
    for name, ms in phases.items():
        s, e = got[name]
        assert (e - s) / 1e6 == pytest.approx(ms, abs=1e-5), name
    # Laid end to end from the step's start; dataloader_wait before it when the
    # built-in phases add up to more than the step.
    before = (
        "dataloader_wait" in phases
        and sum(phases[p] for p in BUILT_IN if p in phases) > row.step_ms
    )
    cursor = start_ns
    for name in [p for p in BUILT_IN if p in phases]:
        s, e = got[name]
        if before and name == "dataloader_wait":
            assert e == start_ns
            continue
        assert s == cursor, name
        cursor = e


# -- sampling and layout --------------------------------------------------------------


def test_sampler_one_in_n_per_rank_plus_slow_steps() -> None:
    sampler = StepSampler(5)
    picked: list[tuple[int, int, str]] = []
    for s in range(1, 101):
        batch = []
        for rank in (0, 1):
            ms = 10.0 + 0.01 * (s % 7)
            if rank == 1 and s in (3, 23, 47, 80):  # 3 comes before 8 steps were seen
                ms = 35.0
            if rank == 0 and s == 50:
                ms = 19.0  # below twice the median: not an outlier
            batch.append(_step(rank, s, ms))
        picked += [(st.rank, st.step, why) for st, why in sampler.pick(batch)]
    periodic = {(r, s) for r, s, why in picked if why == "periodic"}
    slow = {(r, s) for r, s, why in picked if why == "slow"}
    assert periodic == {(r, s) for r in (0, 1) for s in range(1, 101, 5)}
    assert slow == {(1, 23), (1, 47), (1, 80)}
    assert len(picked) == len(periodic) + len(slow) == 43
    # N = 1: every step, in order.
    every = StepSampler(1).pick([_step(0, s, 1.0) for s in range(1, 11)])
    assert [(st.step, why) for st, why in every] == [(s, "periodic") for s in range(1, 11)]


def test_sampler_slow_rule_is_the_median_of_the_last_window_steps() -> None:
    """The window kept in order picks exactly what the plain rule does (the median of
    the rank's last SLOW_WINDOW step times, sorted afresh), ties and repeats included."""
    import random
    from collections import deque

    from traceml_ai.monitor._otlp_traces import SLOW_FACTOR, SLOW_MIN_SEEN, SLOW_WINDOW

    rng = random.Random(3)
    sampler = StepSampler(7)
    recent: dict[int, deque[float]] = {}
    expected: list[tuple[int, int, str]] = []
    got: list[tuple[int, int, str]] = []
    for s in range(1, 400):
        batch = [_step(r, s, rng.choice([1.0, 2.0, 2.0, 5.0, rng.random() * 9])) for r in (0, 1)]
        got += [(st.rank, st.step, why) for st, why in sampler.pick(batch)]
        for st in batch:
            window = recent.setdefault(st.rank, deque(maxlen=SLOW_WINDOW))
            ordered = sorted(window)
            n = len(ordered)
            if (st.step - 1) % 7 == 0:
                expected.append((st.rank, st.step, "periodic"))
            elif n >= SLOW_MIN_SEEN and st.step_ms > SLOW_FACTOR * (
                (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
            ):
                expected.append((st.rank, st.step, "slow"))
            window.append(st.step_ms)
    assert got == expected
    assert sum(why == "slow" for _, _, why in got) > 10


def test_layout_in_step_order_and_dataloader_before_the_step() -> None:
    inside = _step(0, 1, 100.0, forward=30.0, backward=40.0, dataloader_wait=5.0, optimizer=10.0)
    inside = StepSeen(0, 0, 1, 10**18, 100.0, {**inside.phases, "user:loss": 4.0, "other": 1.0})
    spans = layout_phases(inside)
    start = 10**18 - 100 * 10**6
    assert [(p.name, p.start_ns - start, p.end_ns - p.start_ns) for p in spans] == [
        ("dataloader_wait", 0, 5_000_000),
        ("forward", 5_000_000, 30_000_000),
        ("backward", 35_000_000, 40_000_000),
        ("optimizer", 75_000_000, 10_000_000),
        ("user:loss", 85_000_000, 4_000_000),
        ("other", 89_000_000, 1_000_000),
    ]
    before = StepSeen(0, 0, 1, 10**18, 50.0, {"dataloader_wait": 20.0, "forward": 45.0})
    spans = layout_phases(before)
    start = 10**18 - 50 * 10**6
    assert [(p.name, p.start_ns - start, p.end_ns - start) for p in spans] == [
        ("dataloader_wait", -20_000_000, 0),
        ("forward", 0, 45_000_000),
    ]


# -- in process: the sink against the loopback receiver ----------------------------


def test_in_process_spans_metrics_and_resource(monkeypatch: pytest.MonkeyPatch) -> None:
    reports: list[str] = []
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-team=ml,authorization=Bearer%20t")
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
        monitoring = _monitoring(sample=1, reports=reports)
        monitoring.start_sinks({"otlp": otlp_sink})
        assert not monitoring.not_started, monitoring.not_started
        monitoring.feed.start()
        for rank in (0, 1):
            monitoring.submit(_step_batch(rank, range(1, 6)))
        deadline = time.monotonic() + 10
        while len(receiver.spans()) < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        loss = monitoring.close(5.0)
    assert loss.by_sink == {}, loss
    assert reports == [
        f"traceml: otlp: traces (every step) to {receiver.url}/v1/traces; "
        f"metrics every 0.2 s to {receiver.url}/v1/metrics"
    ]
    spans = receiver.spans()
    roots = [s for s in spans if s.parent_id is None]
    assert sorted((s.attributes["traceml.rank"], s.attributes["traceml.step"]) for s in roots) == [
        (r, s) for r in (0, 1) for s in range(1, 6)
    ]
    assert {s.name for s in roots} == {"traceml.step"}
    for root in roots:
        assert root.resource["service.name"] == "traceml"
        assert root.resource["traceml.run.name"] == "unit"
        assert root.resource["host.name"] == "aggregator-host"
        assert root.resource["traceml.world_size"] == 2
        assert root.resource["deployment.environment"] == "test"
        assert root.scope == "traceml_ai"
        assert root.duration_ms == pytest.approx(20.0)
        kids = [s for s in spans if s.parent_id == root.span_id]
        assert [(k.name, k.attributes) for k in sorted(kids, key=lambda k: k.start_ns)] == [
            ("forward", {"traceml.phase": "forward"}),
            ("backward", {"traceml.phase": "backward"}),
        ]
        assert all(k.trace_id == root.trace_id for k in kids)
    assert len({s.trace_id for s in roots}) == 10
    assert all(h.get("x-team") == "ml" for h in receiver.headers)
    assert all(h.get("authorization") == "Bearer t" for h in receiver.headers)
    steps = receiver.latest("traceml_steps")
    assert steps is not None and steps.kind == "sum"
    assert steps.metric.sum.is_monotonic
    assert {p.attributes[0].value.string_value: p.as_int for p in steps.metric.sum.data_points} == {
        "0": 5,
        "1": 5,
    }
    hist = receiver.latest("traceml_step_time_seconds")
    assert hist is not None and hist.metric.unit == "s"
    for point in hist.metric.histogram.data_points:
        assert point.count == 5 and sum(point.bucket_counts) == 5
        assert len(point.bucket_counts) == len(point.explicit_bounds) + 1
        assert not point.HasField("min")
    expected = receiver.latest("traceml_ranks_expected")
    assert expected is not None and expected.metric.gauge.data_points[0].as_double == 2.0


def test_service_name_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "my-training")
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
        sink = start_otlp(_monitoring())
        sink.on_steps([_step(0, 1, 5.0, forward=2.0)])
        assert sink.close(5.0) == {}
    spans = receiver.spans()
    assert len(spans) == 2
    assert {s.resource["service.name"] for s in spans} == {"my-training"}
    assert receiver.metric_requests == []


@pytest.mark.parametrize(
    ("var", "value", "says"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json", "OTEL_EXPORTER_OTLP_PROTOCOL='http/json'"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "udp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='udp'"),
        ("OTEL_METRIC_EXPORT_INTERVAL", "soon", "OTEL_METRIC_EXPORT_INTERVAL='soon'"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "not-a-url", "OTEL_EXPORTER_OTLP_ENDPOINT='not-a-url' is"),
        ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://", "METRICS_ENDPOINT='http://' has no"),
    ],
)
def test_bad_configuration_is_one_line(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, says: str
) -> None:
    monkeypatch.setenv(var, value)
    reports: list[str] = []
    monitoring = _monitoring(reports=reports)
    monitoring.start_sinks({"otlp": otlp_sink})
    assert monitoring.sinks == []
    assert says in monitoring.not_started["otlp"]
    assert len(reports) == 1 and reports[0].startswith("traceml: otlp: ")
    assert "\n" not in reports[0]


def test_grpc_without_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    # None in sys.modules makes the import fail as if the package were not installed.
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(SinkStartError, match="opentelemetry-exporter-otlp-proto-grpc"):
        start_otlp(_monitoring())


def test_grpc_exporters_are_chosen_by_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
        OTLPMetricExporter as GrpcMetricExporter,
    )
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcSpanExporter,
    )

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/protobuf")
    sink = start_otlp(_monitoring())
    try:
        assert isinstance(sink._span_exporter, GrpcSpanExporter)
        assert not isinstance(sink._metric_exporter, GrpcMetricExporter)
    finally:
        sink.close(1.0)


# -- in process: faults ----------------------------------------------------------------


def test_receiver_down_costs_counted_losses_and_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "100")
    reports: list[str] = []
    sink = start_otlp(_monitoring(reports=reports))
    sink.on_steps([_step(r, s, 5.0, forward=2.0) for s in range(1, 4) for r in (0, 1)])
    deadline = time.monotonic() + 10
    while len(reports) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    lost = sink.close(2.0)
    assert time.monotonic() - started < 3.0
    assert lost["metric_exports_failed"] >= 1
    assert lost.get("spans_failed", 0) + lost.get("spans_dropped", 0) == 12
    assert set(lost) <= {"spans_failed", "spans_dropped", "metric_exports_failed"}
    failures = [r for r in reports if "failed" in r]
    assert len(failures) == 1, reports
    assert "connection refused" in failures[0] and "\n" not in failures[0]


def test_slow_receiver_and_a_full_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver answers after 5 s; the exporter's timeout is 3 s: the export thread
    is stuck, the feed thread is not, the queue drops the newest steps, and close()
    keeps its budget by leaving the stuck thread behind."""
    with OtlpReceiver(delay_s=5.0) as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "3")
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
        monkeypatch.setattr(otlp, "TRACE_FLUSH_S", 0.05)
        reports: list[str] = []
        sink = start_otlp(_monitoring(reports=reports))
        sink.on_steps([_step(0, 1, 5.0, forward=2.0)])
        deadline = time.monotonic() + 5
        while receiver.requests < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert receiver.requests == 1
        per_step = 2
        n_steps = otlp.MAX_QUEUED_SPANS // per_step + 1000
        started = time.monotonic()
        sink.on_steps([_step(0, s, 5.0, forward=2.0) for s in range(2, n_steps + 2)])
        assert time.monotonic() - started < 2.0  # the feed thread did not wait
        started = time.monotonic()
        lost = sink.close(1.0)
        assert time.monotonic() - started < 1.5
    assert lost == {"spans_dropped": (n_steps + 1) * per_step}
    assert reports[1:] == [
        "traceml: otlp: an export was still waiting on the receiver after 1.0 s; training "
        "and the files go on, and what the live export loses is counted in "
        "aggregator/stats.json"
    ]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_of_the_aggregator_sends_nothing_of_the_parents(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real fork while sampled steps wait in the sink worker's queue: the child's
    worker is empty with a fresh, unstarted thread, its close sends nothing and loses
    nothing; the parent's steps reach the receiver once."""
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
        monkeypatch.setattr(otlp, "TRACE_FLUSH_S", 600.0)  # the steps stay queued
        sink = start_otlp(_monitoring())
        try:
            time.sleep(0.2)  # the worker waits on its flush time
            sink.on_steps([_step(0, s, 5.0, forward=2.0) for s in (1, 2, 3)])
            assert len(sink.worker) == 3
            parent_thread = sink.worker.thread
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    started = time.monotonic()
                    seen = {
                        "queued": len(sink.worker),
                        "fresh": sink.worker.thread is not parent_thread,
                        "alive": sink.worker.thread.is_alive(),
                        "lost": dict(sink.close(2.0)),
                        "close_s": time.monotonic() - started,
                    }
                    os.write(write_end, orjson.dumps(seen))
                finally:
                    os._exit(0)
            os.close(write_end)
            with os.fdopen(read_end, "rb") as child_out:
                seen = orjson.loads(child_out.read())
            os.waitpid(pid, 0)
            assert seen["queued"] == 0 and seen["fresh"] and not seen["alive"]
            assert seen["lost"] == {} and seen["close_s"] < 0.5
            assert receiver.spans() == []
        finally:
            lost = sink.close(5.0)
    assert lost == {}
    assert sorted(
        sp.attributes["traceml.step"] for sp in receiver.spans() if sp.name == "traceml.step"
    ) == [1, 2, 3]


def test_receiver_killed_mid_run(monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = OtlpReceiver().start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "100")
    monkeypatch.setattr(otlp, "TRACE_FLUSH_S", 0.05)
    reports: list[str] = []
    sink = start_otlp(_monitoring(reports=reports))
    sink.on_steps([_step(0, 1, 5.0, forward=2.0)])
    deadline = time.monotonic() + 5
    while not (receiver.spans() and receiver.metric_requests) and time.monotonic() < deadline:
        time.sleep(0.02)
    receiver.stop()
    sink.on_steps([_step(0, s, 5.0, forward=2.0) for s in range(2, 5)])
    lost = sink.close(3.0)
    assert len(receiver.spans()) == 2
    assert lost.get("spans_failed", 0) + lost.get("spans_dropped", 0) == 6
    assert lost["metric_exports_failed"] >= 1
    assert len([r for r in reports if "failed" in r]) == 1


# -- real runs -------------------------------------------------------------------------


def _by_root(
    spans: Sequence[ReceivedSpan],
) -> dict[tuple[int, int], tuple[ReceivedSpan, list[ReceivedSpan]]]:
    roots = {s.span_id: s for s in spans if s.parent_id is None}
    out: dict[tuple[int, int], tuple[ReceivedSpan, list[ReceivedSpan]]] = {}
    for root in roots.values():
        key = (root.attributes["traceml.rank"], root.attributes["traceml.step"])
        assert key not in out, f"two traces of {key}"
        out[key] = (root, [s for s in spans if s.parent_id == root.span_id])
    assert sum(1 + len(kids) for _, kids in out.values()) == len(spans)
    return out


def test_run_traces_every_step_and_exports_the_metrics(tmp_path: Path) -> None:
    with OtlpReceiver() as receiver:
        res, run_dir = _run(
            tmp_path,
            {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_METRIC_EXPORT_INTERVAL": "500"},
        )
    assert "traceml: otlp: traces (every step)" in res.stderr
    assert "traceml: otlp: export to" not in res.stderr
    lines = _file_steps(run_dir)
    assert len(lines) == 24
    traced = _by_root(receiver.spans())
    assert set(traced) == set(lines)
    for key, (root, kids) in traced.items():
        assert root.name == "traceml.step"
        assert root.attributes["traceml.node"] == 0
        assert root.resource["traceml.run.name"] == "r"
        assert root.resource["traceml.world_size"] == 2
        assert all(k.attributes["traceml.phase"] == k.name for k in kids)
        _assert_step_span(
            (root.name, root.start_ns, root.end_ns),
            [(k.name, k.start_ns, k.end_ns) for k in kids],
            lines[key],
        )
    # The metrics: the final export has the file's counts.
    hist = receiver.latest("traceml_step_time_seconds")
    assert hist is not None
    counts = {
        {a.key: a.value.string_value for a in p.attributes}["rank"]: p.count
        for p in hist.metric.histogram.data_points
    }
    assert counts == {"0": 12, "1": 12}
    steps = receiver.latest("traceml_steps")
    assert steps is not None
    assert {p.attributes[0].value.string_value: p.as_int for p in steps.metric.sum.data_points} == {
        "0": 12,
        "1": 12,
    }
    last = receiver.latest("traceml_last_step")
    assert last is not None
    assert {p.as_double for p in last.metric.gauge.data_points} == {12.0}
    written = receiver.latest("traceml_export_records")
    assert written is not None
    assert {
        p.attributes[0].value.string_value: p.as_int for p in written.metric.sum.data_points
    }.get("step_time") == 24
    assert len(receiver.metric_requests) >= 2
    assert _stats_otlp(run_dir) == {}
    assert warning_file(tmp_path / "logs", "r") is None


@contextlib.contextmanager
def _env(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _spans(run_dir: Path) -> int:
    """Spans of every step of the run: the step and each of its phases."""
    rows = [step_row(line["events"]) for line in _file_steps(run_dir).values()]
    return sum(1 + len(row.phases) for row in rows if row is not None)


def _assert_files_complete(tmp_path: Path, run_dir: Path, steps: int) -> None:
    lines = _file_steps(run_dir)
    assert len(lines) == 2 * steps
    assert_valid(export_dir(tmp_path / "logs", run_dir.name), tmp_path)


def test_run_with_traces_receiver_killed_and_metrics_receiver_slow(tmp_path: Path) -> None:
    """Traces go to a receiver killed once the first traces arrived; metrics to one that
    answers after 3 s when the exporter waits 1 s."""
    with OtlpReceiver() as traces_receiver, OtlpReceiver(delay_s=3.0) as metrics_receiver:
        steps = 40
        env = clean_env(
            {
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": traces_receiver.url + "/v1/traces",
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": metrics_receiver.url + "/v1/metrics",
                "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
                "OTEL_METRIC_EXPORT_INTERVAL": "200",
            }
        )
        process = subprocess.Popen(
            traceml_cmd(
                "run",
                "--logs-dir",
                tmp_path / "logs",
                "--run-name",
                "r",
                "--nproc-per-node",
                "2",
                "--master-port",
                str(free_port()),
                "--exporter",
                "jsonl",
                "--otlp",
                "--otlp-trace-sample",
                "1",
                SCRIPT,
                "--where",
                "forward",
                "--slow-ranks",
                "1",
                "--sleep-ms",
                "40",
                "--steps",
                str(steps),
            ),
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        try:
            deadline = time.monotonic() + 120
            while not traces_receiver.spans() and process.poll() is None:
                assert time.monotonic() < deadline, "no traces arrived"
                time.sleep(0.05)
            traces_receiver.stop()
            out, err = process.communicate(timeout=180)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 0, out + err
    run_dir = tmp_path / "logs" / "r"
    _assert_files_complete(tmp_path, run_dir, steps)
    assert err.count("traceml: otlp: export to") == 1, err
    assert "Traceback" not in err
    received = _by_root(traces_receiver.spans())
    lines = _file_steps(run_dir)
    assert received and set(received) < set(lines)
    lost = _stats_otlp(run_dir)
    assert lost["metric_exports_failed"] >= 1
    sent = sum(1 + len(kids) for _, kids in received.values())
    assert lost.get("spans_failed", 0) + lost.get("spans_dropped", 0) == _spans(run_dir) - sent
    warning = warning_file(tmp_path / "logs", "r")
    assert warning is not None
    assert warning["monitoring"]["by_sink"]["otlp"] == lost


# -- MLflow (last: the session's server (tests/conftest.py) starts with the module) ----


def test_run_traces_in_mlflow_with_the_metrics_receiver_down(
    tmp_path: Path, mlflow: MlflowServer
) -> None:
    """Traces (one step in 4 per rank, and slow steps) go to a real MLflow server; the
    metrics to a port nothing listens on, from the start to the end of the run."""
    from mlflow import MlflowClient

    with _env(server_env()):
        client = MlflowClient(tracking_uri=mlflow.url)
        experiment = client.create_experiment(f"traceml-{tmp_path.name}")
    res, run_dir = _run(
        tmp_path,
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": mlflow.traces_endpoint,
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"x-mlflow-experiment-id={experiment}",
            # MLflow takes traces only.
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": f"http://127.0.0.1:{_closed_port()}/v1/metrics",
            "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "1",
            "OTEL_METRIC_EXPORT_INTERVAL": "300",
            "NO_PROXY": "127.0.0.1",
        },
        sample=4,
    )
    _assert_files_complete(tmp_path, run_dir, 12)
    assert res.stderr.count("traceml: otlp: export to") == 1, res.stderr
    assert "/v1/metrics failed (connection refused)" in res.stderr
    assert "Traceback" not in res.stderr
    assert "Transient error" not in res.stderr and "Failed to export" not in res.stderr
    lost = _stats_otlp(run_dir)
    assert set(lost) == {"metric_exports_failed"}, lost
    warning = warning_file(tmp_path / "logs", "r")
    assert warning is not None
    assert warning["monitoring"]["by_sink"]["otlp"] == lost
    lines = _file_steps(run_dir)
    # What the sampler picks from the file's steps, each rank in step order.
    sampler = StepSampler(4)
    expected: dict[tuple[int, int], str] = {}
    for key in sorted(lines, key=lambda k: (k[1], k[0])):
        line = lines[key]
        row = step_row(line["events"])
        assert row is not None
        seen = StepSeen(key[0], 0, key[1], line["timestamp_unix_ns"], row.step_ms, {})
        for step, why in sampler.pick([seen]):
            expected[(step.rank, step.step)] = why
    assert {(r, s) for r, s in expected if expected[(r, s)] == "periodic"} == {
        (r, s) for r in (0, 1) for s in (1, 5, 9)
    }
    with _env(server_env()):
        traces = client.search_traces(locations=[experiment], max_results=500)
    got: dict[tuple[int, int], Any] = {}
    for trace in traces:
        spans = trace.data.spans
        roots = [s for s in spans if s.parent_id is None]
        assert len(roots) == 1, trace.info.trace_id
        root = roots[0]
        assert root.name == "traceml.step"
        key = (int(root.attributes["traceml.rank"]), int(root.attributes["traceml.step"]))
        assert key not in got
        got[key] = trace
        assert root.attributes["traceml.sample_reason"] == expected.get(key)
        kids = [s for s in spans if s.parent_id == root.span_id]
        assert len(kids) == len(spans) - 1
        assert all(k.attributes["traceml.phase"] == k.name for k in kids)
        _assert_step_span(
            (root.name, root.start_time_ns, root.end_time_ns),
            [(k.name, k.start_time_ns, k.end_time_ns) for k in kids],
            lines[key],
        )
        assert trace.info.tags.get("traceml.run.name") == "r"
    assert set(got) == set(expected)
