"""TraceML on Ray Train: ``TraceMLRayConfig`` and ``TraceMLTorchTrainer`` on a local CPU cluster.

One ``ray.init`` serves the module (Ray startup is slow); each ``fit`` trains a tiny MLP
on 2 CPU workers for a few steps. The Ray job's workers see ``TRACEML_*`` variables
and the driver's working directory has a ``traceml.yaml`` that all contradict the
configs used here, so every test also checks that Ray reads neither.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest
import ray  # the [ray] extra; CI installs it
import ray.train
from ray.train import RunConfig, ScalingConfig

import traceml_ai as traceml
from tests.e2e_helpers import REPO, free_port
from traceml_ai.integrations import ray as traceml_ray
from traceml_ai.integrations.ray import ACTOR_NAME_PREFIX, TraceMLRayConfig, TraceMLTorchTrainer
from traceml_ai.settings import ExportSettings
from traceml_ai.testing import make_item, make_phase
from traceml_ai.transport import RankSender
from traceml_ai.transport.wire import new_run_token
from traceml_records import read_jsonl, validate_paths

pytestmark = pytest.mark.slow  # real runs, subprocesses or receivers (docs/testing.md)

STEPS = 4
NUM_WORKERS = 2

# What a Ray job must ignore: if any of these were read, exports would differ.
CONTRADICTING_ENV = {
    "TRACEML_EXPORTER": "jsonl",
    "TRACEML_EXPORT_STREAMS": "all",
    "TRACEML_EXPORTER_HOSTNAME": "1",
}
CONTRADICTING_YAML = "exporter: jsonl\nexport_streams: all\nexporter_hostname: true\n"


# -- the training loops (run on Ray workers) -------------------------------------------


def tiny_mlp_loop(config: dict[str, Any]) -> dict[str, Any]:
    """A few traced steps of a tiny MLP under DDP (gloo); may raise at ``fail_at``."""
    import ray.train.torch as rtt
    import torch
    from torch import nn

    torch.manual_seed(ray.train.get_context().get_world_rank())
    model = rtt.prepare_model(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, config.get("steps", STEPS) + 1):
        x = torch.randn(16, 8)
        with traceml.trace_step(model):
            optimizer.zero_grad()
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            loss.backward()
            optimizer.step()
        if step == config.get("fail_at"):
            raise RuntimeError(f"boom at step {step} on purpose")
    # Rank 0's return value becomes Result.return_value (the wrapper passes it through).
    return {"loss": float(loss), "env_exporter": os.environ.get("TRACEML_EXPORTER")}


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """One local CPU cluster for the module, with contradicting TRACEML_* for every worker."""
    mp = pytest.MonkeyPatch()
    # Faster worker-group polling: a no-op fit drops from ~9 s to ~6 s here.
    mp.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    mp.setenv("RAY_DEDUP_LOGS", "0")
    ray.init(
        num_cpus=NUM_WORKERS,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                **CONTRADICTING_ENV,
                # Ray Train's controller unpickles the loops of this module by name
                # (tests.<...>), and the aggregator actor imports tests.custom_exporters;
                # src first, so actors import this checkout's traceml_ai, not another
                # one the environment has installed.
                "PYTHONPATH": os.pathsep.join((str(REPO / "src"), str(REPO))),
            }
        },
    )
    try:
        yield
    finally:
        ray.shutdown()
        mp.undo()


@pytest.fixture
def driver_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The driver runs in ``tmp_path``, with contradicting TRACEML_* and traceml.yaml."""
    for name, value in CONTRADICTING_ENV.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "traceml.yaml").write_text(CONTRADICTING_YAML)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def make_trainer(
    tmp_path: Path, config: TraceMLRayConfig, loop_config: dict[str, Any] | None = None
) -> TraceMLTorchTrainer:
    return TraceMLTorchTrainer(
        tiny_mlp_loop,
        train_loop_config=loop_config or {},
        traceml_config=config,
        scaling_config=ScalingConfig(num_workers=NUM_WORKERS, use_gpu=False),
        run_config=RunConfig(storage_path=str(tmp_path / "ray_results"), name="job"),
    )


def lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def assert_valid(run_dir: Path) -> None:
    report = validate_paths([run_dir])
    assert report.ok, report


def assert_actor_gone(session_id: str) -> None:
    with pytest.raises(ValueError):
        ray.get_actor(ACTOR_NAME_PREFIX + session_id)


# -- config validation (no Ray needed) ---------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"export_streams": "step_time,gpu"}, "TraceMLRayConfig.export_streams: unknown"),
        ({"export_streams": ""}, "TraceMLRayConfig.export_streams"),
        ({"exporter": "csv"}, "TraceMLRayConfig.exporter: expected '' (off), 'jsonl'"),
        ({"exporter": "pkg.mod"}, "TraceMLRayConfig.exporter"),
        ({"exporter_hostname": "yes"}, "TraceMLRayConfig.exporter_hostname"),
        ({"sampler_interval_sec": 0}, "TraceMLRayConfig.sampler_interval_sec"),
        ({"sampler_interval_sec": float("nan")}, "TraceMLRayConfig.sampler_interval_sec"),
        ({"finalize_timeout_sec": -1.0}, "TraceMLRayConfig.finalize_timeout_sec"),
        ({"stop_timeout_sec": -1.0}, "TraceMLRayConfig.stop_timeout_sec"),
        ({"port": 70000}, "TraceMLRayConfig.port"),
        ({"port": True}, "TraceMLRayConfig.port"),
        ({"bind_host": ""}, "TraceMLRayConfig.bind_host"),
        ({"logs_dir": ""}, "TraceMLRayConfig.logs_dir"),
        ({"session_id": "a/b"}, "TraceMLRayConfig.session_id"),
        ({"session_id": ".."}, "TraceMLRayConfig.session_id"),
    ],
)
def test_invalid_config_raises_before_ray_starts(kwargs: dict[str, Any], message: str) -> None:
    was_initialized = ray.is_initialized()
    with pytest.raises(ValueError, match=None) as info:
        TraceMLRayConfig(**kwargs)
    assert message in str(info.value)
    assert ray.is_initialized() == was_initialized


def test_config_errors_match_the_cli_messages() -> None:
    from traceml_ai.settings import resolve_export_settings

    for value, field, cli_flag in [
        ("step_time, nope", "export_streams", "--export-streams"),
        ("my.mod:", "exporter", "--exporter"),
    ]:
        with pytest.raises(ValueError) as ray_error:
            TraceMLRayConfig(**{field: value})
        with pytest.raises(ValueError) as cli_error:
            resolve_export_settings(
                cli_exporter=value if field == "exporter" else None,
                cli_export_streams=value if field == "export_streams" else None,
                cli_exporter_hostname=None,
                environ={},
                yaml_path=Path("/nonexistent/traceml.yaml"),
            )
        ray_text = str(ray_error.value).removeprefix(f"TraceMLRayConfig.{field}: ")
        cli_text = str(cli_error.value).removeprefix(f"{cli_flag}: ")
        assert ray_text == cli_text
    # The unknown-stream message lists the supported names.
    with pytest.raises(ValueError, match="step_memory") as info:
        TraceMLRayConfig(export_streams="bogus")
    assert "step_time" in str(info.value)


def test_config_reads_no_environment_or_yaml(driver_env: Path) -> None:
    config = TraceMLRayConfig()
    assert (config.exporter, config.export_streams, config.exporter_hostname) == (
        "",
        "step_time",
        False,
    )
    assert not config.export_enabled
    assert config.run_dir("s1") == driver_env / "logs" / "s1"
    assert TraceMLRayConfig(logs_dir=driver_env / "x").logs_dir == str(driver_env / "x")
    with pytest.raises(AttributeError):
        config.exporter = "jsonl"  # type: ignore[misc]  # frozen


def test_trainer_rejects_bad_arguments_before_ray_starts() -> None:
    was_initialized = ray.is_initialized()
    with pytest.raises(TypeError, match="TraceMLRayConfig"):
        TraceMLTorchTrainer(tiny_mlp_loop, traceml_config={"exporter": "jsonl"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0 or 1 required arguments"):
        TraceMLTorchTrainer(lambda a, b: None)
    assert ray.is_initialized() == was_initialized


def test_import_without_ray_names_the_extra() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["ray"] = None  # as if Ray were not installed
        import traceml_ai.integrations  # the package itself needs no extra
        try:
            import traceml_ai.integrations.ray
        except ImportError as exc:
            print(exc)
        else:
            raise SystemExit("imported without ray")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert "pip install 'traceml-ai[ray]'" in out.stdout


def test_a_big_export_names_a_summary_command_a_shell_can_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shlex

    from traceml_ai.integrations import ray as traceml_ray

    run_dir = tmp_path / 'it\'s my "run" $HOME'
    export_dir = run_dir / "aggregator" / "export"
    export_dir.mkdir(parents=True)
    (export_dir / "step_time.jsonl").write_bytes(b"x" * 4096)
    monkeypatch.setattr(traceml_ray, "END_OF_RUN_SUMMARY_MAX_BYTES", 1024)
    traceml_ray._print_analysis(run_dir)
    (line,) = capsys.readouterr().err.splitlines()
    assert shlex.split(line.split("`")[1]) == ["traceml", "summary", str(run_dir)], line


# -- end to end on a local cluster --------------------------------------------------------


def test_jsonl_export_from_two_workers(
    ray_cluster: None, driver_env: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    port, dashboard_port = free_port(), free_port()
    config = TraceMLRayConfig(
        exporter="jsonl",
        export_streams="step_time,step_memory",
        logs_dir="runs",
        sampler_interval_sec=0.5,
        prometheus_port=port,
        mode="dashboard",
        dashboard_port=dashboard_port,
    )
    trainer = make_trainer(tmp_path, config)
    # The aggregator actor serves /metrics and the dashboard on the driver's node while
    # training runs.
    scraped: list[str] = []
    views: list[dict[str, Any]] = []
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            url = f"http://127.0.0.1:{port}/metrics"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
                scraped.append(r.read().decode())
            url = f"http://127.0.0.1:{dashboard_port}/api/view"
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(url, timeout=2) as r,
            ):
                views.append(json.loads(r.read()))
            done.wait(0.2)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    try:
        result = trainer.fit()
    finally:
        done.set()
        scraper.join(5)
    assert scraped, "the aggregator actor never served /metrics"
    assert any(f'traceml_steps_total{{rank="{NUM_WORKERS - 1}"}}' in text for text in scraped)
    assert views, "the aggregator actor never served the dashboard"
    assert max(v["identity"]["ranks_reporting"] for v in views) == NUM_WORKERS
    assert (
        f"traceml: dashboard: live at http://127.0.0.1:{dashboard_port}/" in capfd.readouterr().err
    )
    assert result.error is None
    assert result.return_value is not None and "loss" in result.return_value

    run = trainer.traceml_run
    assert run is not None and run.finalized and run.session_id
    assert run.run_dir == driver_env / "runs" / run.session_id
    export_dir = run.run_dir / "aggregator" / "export"
    assert sorted(p.name for p in export_dir.iterdir()) == ["step_memory.jsonl", "step_time.jsonl"]
    assert not (run.run_dir / "finalization_warning.json").exists()
    assert_valid(run.run_dir)
    stats = json.loads((run.run_dir / "aggregator" / "stats.json").read_text())
    assert stats["monitoring"] == {"dropped_batches": 0, "by_sink": {}, "not_started": {}}

    step_time = lines(export_dir / "step_time.jsonl")
    data, closing = step_time[:-1], step_time[-1]
    keys = [(line["global_rank"], line["step"]) for line in data]
    assert len(keys) == len(set(keys))
    assert set(keys) == {(r, s) for r in range(NUM_WORKERS) for s in range(1, STEPS + 1)}
    for line in data:
        assert line["world_size"] == NUM_WORKERS
        assert line["local_world_size"] == NUM_WORKERS
        assert line["local_rank"] == line["global_rank"]
        assert line["node_rank"] == 0
        assert "hostname" not in line
        assert "_traceml_internal:forward_time" in line["events"]
    assert closing == {
        "stream": "step_time",
        "closing": True,
        "schema_version": 1,
        "written_records": NUM_WORKERS * STEPS,
        "dropped_batches": 0,
    }

    step_memory = lines(export_dir / "step_memory.jsonl")
    assert step_memory[-1]["closing"] is True
    assert step_memory[-1]["written_records"] == len(step_memory) - 1 == NUM_WORKERS * STEPS
    assert run.summary is not None
    assert run.summary["written_records"] == 2 * NUM_WORKERS * STEPS
    assert run.summary["finished_ranks"] == list(range(NUM_WORKERS))
    # Typed read-back works too.
    records = list(read_jsonl(export_dir / "step_time.jsonl"))
    assert len(records) == NUM_WORKERS * STEPS + 1
    assert_actor_gone(run.session_id)
    # One node: every worker sent to the aggregator itself.
    assert run.relays == 0


def test_exporter_off_ignores_env_and_yaml(
    ray_cluster: None, driver_env: Path, tmp_path: Path
) -> None:
    assert os.environ["TRACEML_EXPORTER"] == "jsonl"
    trainer = make_trainer(tmp_path, TraceMLRayConfig(exporter="", logs_dir="runs"))
    result = trainer.fit()
    assert result.error is None and result.return_value is not None  # the loop ran
    assert result.return_value["env_exporter"] == "jsonl"  # workers saw it, and ignored it
    assert trainer.traceml_run is not None and trainer.traceml_run.run_dir is None
    assert not (driver_env / "runs").exists()
    assert not (driver_env / "logs").exists()
    assert not list(driver_env.rglob("*.jsonl"))


def test_failing_loop_reraises_and_finalizes_with_hostnames(
    ray_cluster: None, driver_env: Path, tmp_path: Path
) -> None:
    # One fit covers the error path, exporter_hostname=True and a wildcard bind_host.
    config = TraceMLRayConfig(
        exporter="jsonl",
        exporter_hostname=True,
        bind_host="0.0.0.0",
        logs_dir=str(tmp_path / "abs-logs"),
        session_id="failing",
    )
    trainer = make_trainer(tmp_path, config, {"fail_at": 2})
    with pytest.raises(Exception) as info:
        trainer.fit()
    assert "boom at step 2 on purpose" in str(info.value)

    run = trainer.traceml_run
    assert run is not None and run.finalized
    assert_actor_gone("failing")
    # Workers were told a routable address, never the wildcard.
    assert run.address is not None and run.address[0] not in ("0.0.0.0", "::")
    run_dir = tmp_path / "abs-logs" / "failing"
    export_dir = run_dir / "aggregator" / "export"
    assert [p.name for p in export_dir.iterdir()] == ["step_time.jsonl"]
    step_time = lines(export_dir / "step_time.jsonl")
    assert step_time[-1]["closing"] is True
    # Both workers traced steps 1 and 2 before raising; shutdown still sent them.
    assert {(line["global_rank"], line["step"]) for line in step_time[:-1]} == {
        (r, s) for r in range(NUM_WORKERS) for s in (1, 2)
    }
    assert step_time[-1]["written_records"] == 2 * NUM_WORKERS
    assert all(isinstance(line["hostname"], str) and line["hostname"] for line in step_time[:-1])
    assert_valid(run_dir)


def test_custom_exporter_receives_records(
    ray_cluster: None, driver_env: Path, tmp_path: Path
) -> None:
    # tests/custom_exporters.py, found through the PYTHONPATH the cluster fixture sets.
    config = TraceMLRayConfig(
        exporter="tests.custom_exporters:make_exporter",
        export_streams="step_time,process",
        logs_dir="runs",
        session_id="custom",
    )
    trainer = make_trainer(tmp_path, config, {"steps": 2})
    trainer.fit()
    custom_dir = driver_env / "runs" / "custom" / "custom_export"
    received = lines(custom_dir / "records.jsonl")
    close = orjson.loads((custom_dir / "close.json").read_bytes())
    by_stream: dict[str, list[dict[str, Any]]] = {}
    for entry in received:
        by_stream.setdefault(entry["stream"], []).append(entry["record"])
    assert sorted(by_stream) == ["process", "step_time"]
    assert {(r["global_rank"], r["step"]) for r in by_stream["step_time"]} == {
        (r, s) for r in range(NUM_WORKERS) for s in (1, 2)
    }
    assert {r["global_rank"] for r in by_stream["process"]} == set(range(NUM_WORKERS))
    assert close["written_records"] == {k: len(v) for k, v in by_stream.items()}
    assert sorted(close["streams"]) == ["process", "step_time"]
    assert close["include_hostname"] is False
    # A custom exporter writes no JSONL files of its own.
    assert not list((driver_env / "runs" / "custom" / "aggregator" / "export").glob("*.jsonl"))


def test_aggregator_that_cannot_start_never_fails_training(
    ray_cluster: None, driver_env: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = TraceMLRayConfig(exporter="jsonl", port=port, session_id="no-port")
        trainer = make_trainer(tmp_path, config, {"steps": 2})
        result = trainer.fit()
    assert result.error is None and result.return_value is not None
    run = trainer.traceml_run
    assert run is not None and not run.finalized and run.address is None
    assert f"cannot listen on 127.0.0.1:{port}" in capfd.readouterr().err
    assert_actor_gone("no-port")
    # As with `traceml run`: the loss is reported in the run folder.
    warning = orjson.loads(
        (driver_env / "logs" / "no-port" / "finalization_warning.json").read_bytes()
    )
    assert warning["reason"] == "export_incomplete"
    assert warning["export"]["exporter_failed"] is True
    assert f"cannot listen on 127.0.0.1:{port}" in warning["message"]


# -- a relay per node ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("node_relay", "world_size", "local_world_size", "expected"),
    [(True, 2, 2, False), (True, 1, 1, False), (True, 16, 8, True), (False, 16, 8, False)],
)
def test_only_a_job_of_several_nodes_sends_through_relays(
    node_relay: bool, world_size: int, local_world_size: int, expected: bool
) -> None:
    assert traceml_ray._uses_node_relay(node_relay, world_size, local_world_size) is expected


def _step_item(step: int) -> dict[str, Any]:
    events = {"_traceml_internal:step_time": {"cpu": make_phase(1.5)}}
    return make_item("step_time", step, step=step + 1, events=events)


def test_the_workers_of_a_node_share_its_relay_and_every_batch_arrives(
    ray_cluster: None, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Two workers of a job of two nodes, each told it is alone on its node (local
    world size 1 of 2); both nodes being this one, both get the one relay actor."""
    token = new_run_token()
    actor = (
        ray.remote(traceml_ray._AggregatorActor)
        .options(num_cpus=0)
        .remote(
            str(tmp_path / "run"),
            ExportSettings(exporter="jsonl", export_streams="step_time", exporter_hostname=False),
            token,
            "127.0.0.1",
            0,
            2,
            5.0,
        )
    )
    try:
        upstream = tuple(ray.get(actor.start.remote(), timeout=60))
        plan = traceml_ray._WorkerPlan(None, token, 1.0, aggregator=actor, node_relay=True)
        addresses = [traceml_ray._send_address(plan, upstream, 2, 1) for _ in range(2)]
        assert addresses[0] == addresses[1] and addresses[0] != upstream
        assert addresses[0][0] == "127.0.0.1"
        # node_relay=False, or one node: straight to the aggregator.
        off = attrs.evolve(plan, node_relay=False)
        assert traceml_ray._send_address(off, upstream, 2, 1) == upstream
        assert traceml_ray._send_address(plan, upstream, 2, 2) == upstream
        senders = []
        for rank in range(2):
            identity = {
                "global_rank": rank,
                "local_rank": 0,
                "world_size": 2,
                "local_world_size": 1,
                "node_rank": rank,
                "hostname": None,
                "pid": os.getpid(),
            }
            sender = RankSender(addresses[rank], token, identity, flush_interval_s=0.02)
            sender.start()
            senders.append(sender)
        for step in range(STEPS):
            for sender in senders:
                sender.put("step_time", _step_item(step))
        for sender in senders:
            sender.close(10)
        assert ray.get(actor.stop_relays.remote(5.0), timeout=60) == 1
        summary = ray.get(actor.stop.remote(5.0), timeout=60)
    finally:
        ray.kill(actor)
    assert summary["written_records"] == 2 * STEPS
    assert summary["dropped_batches"] == 0
    assert summary["finished_ranks"] == [0, 1]
    assert "relay" not in capfd.readouterr().err


def test_a_relay_that_cannot_start_costs_one_line_and_the_worker_sends_itself(
    capfd: pytest.CaptureFixture[str],
) -> None:
    class Refusing:
        class node_relay:  # an actor method's shape: .remote(...)
            @staticmethod
            def remote(node_id: str) -> Any:
                raise RuntimeError("no room on that node")

    plan = traceml_ray._WorkerPlan(None, "t", 1.0, aggregator=Refusing(), node_relay=True)
    upstream = ("10.0.0.1", 4000)
    assert traceml_ray._send_address(plan, upstream, 16, 8) == upstream
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [
        "traceml: this node's relay did not start (no room on that node); this worker "
        "sends to the aggregator itself"
    ]


def test_a_killed_relay_actor_is_restarted_and_the_run_accounts_for_every_record(
    ray_cluster: None, tmp_path: Path
) -> None:
    """The node's relay actor is killed mid-run (``ray.kill``, restart allowed): Ray
    restarts it on the same port, the workers' senders reconnect to it, both ranks
    finish through it, and every step is either in the file or counted as dropped
    (one record per batch, so the counts are exact)."""
    token = new_run_token()
    run_dir = tmp_path / "run"
    actor = (
        ray.remote(traceml_ray._AggregatorActor)
        .options(num_cpus=0)
        .remote(
            str(run_dir),
            ExportSettings(exporter="jsonl", export_streams="step_time", exporter_hostname=False),
            token,
            "127.0.0.1",
            0,
            2,
            5.0,
        )
    )
    steps = 120
    try:
        upstream = tuple(ray.get(actor.start.remote(), timeout=60))
        plan = traceml_ray._WorkerPlan(None, token, 1.0, aggregator=actor, node_relay=True)
        address = traceml_ray._send_address(plan, upstream, 2, 1)
        assert address != upstream
        node_id = str(ray.get_runtime_context().get_node_id())
        relay = ray.get(actor.relay_actor.remote(node_id), timeout=60)
        senders = []
        for rank in range(2):
            identity = {
                "global_rank": rank,
                "local_rank": 0,
                "world_size": 2,
                "local_world_size": 1,
                "node_rank": rank,
                "hostname": None,
                "pid": os.getpid(),
            }
            sender = RankSender(
                address, token, identity, flush_interval_s=0.02, max_items_per_batch=1
            )
            sender.start()
            senders.append(sender)
        for step in range(steps):
            if step == steps // 3:
                ray.kill(relay, no_restart=False)
            for sender in senders:
                sender.put("step_time", _step_item(step))
            time.sleep(0.05)
        # The restarted relay listens on the port the workers were given.
        assert ray.get(relay.start.remote(), timeout=60) == address[1]
        for sender in senders:
            sender.close(10)
        sent = [sender.sent_batches for sender in senders]
        dropped_by_senders = sum(sender.dropped_batches for sender in senders)
        assert ray.get(actor.stop_relays.remote(5.0), timeout=60) == 1
        summary = ray.get(actor.stop.remote(5.0), timeout=60)
    finally:
        ray.kill(actor)
    print(
        "relay killed mid-run:", summary, "sent:", sent, "dropped by senders:", dropped_by_senders
    )
    assert summary["finished_ranks"] == [0, 1]
    assert summary["missing_ranks"] == []
    records = lines(run_dir / "aggregator" / "export" / "step_time.jsonl")[:-1]
    keys = {(r["global_rank"], r["step"]) for r in records}
    assert len(keys) == len(records) == summary["written_records"]
    # Steps after the restart arrived: the senders reconnected.
    assert {(0, steps), (1, steps)} <= keys
    # Exact: what is missing is what the senders and the aggregator counted as lost.
    assert sum(sent) + dropped_by_senders == 2 * steps
    assert summary["written_records"] + summary["dropped_batches"] == 2 * steps
    warning_path = run_dir / "finalization_warning.json"
    if summary["dropped_batches"]:
        warning = orjson.loads(warning_path.read_bytes())
        assert warning["export"]["dropped_batches"] == summary["dropped_batches"]
    else:
        assert not warning_path.exists()
