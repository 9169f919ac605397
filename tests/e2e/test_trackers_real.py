"""TraceML's figures in real experiment trackers during a real run.

A 2-rank DDP run (gloo, CPU) with rank 1 slowed in its forward pass runs under
``traceml run --tracker ...``: the TensorBoard event files are read back with
TensorBoard's own ``EventAccumulator``, the W&B offline run (the same run, both
trackers on) with ``wandb leet inspect``, the MLflow run with ``MlflowClient`` from a
real ``mlflow server`` on sqlite, and each compared with the run's own
step_time.jsonl. A tracker that is down costs one line and counted points in
stats.json and finalization_warning.json; the files are whole.

A script with its own tracker run gets TraceML's figures in that run: an HF
``Trainer(report_to=["mlflow"])`` on 2 ranks (one MLflow run holds the loss and
TraceML's figures), a Lightning ``TensorBoardLogger`` (its log dir holds both).
"""

from __future__ import annotations

import json
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bench.wandb_files import history, of_type, records, run_folders, wandb_env
from tests.e2e_helpers import REPO, data_lines, free_port, run_cli, warning_file
from tests.receivers.mlflow_server import MlflowServer, server_env
from traceml_ai.analysis import in_process as summary_keys
from traceml_ai.monitor import tracker_metrics as tm
from traceml_ai.monitor._tracker_tensorboard import SUMMARY_TAG

SCRIPT = REPO / "tests" / "scripts" / "straggler_train.py"
FRAMEWORKS = REPO / "tests" / "scripts" / "tracker_frameworks.py"
FRAMEWORK_STEPS = 40
FRAMEWORK_EVERY = 10
STEPS = 240
"""About 6 s of steps (rank 1 sleeps 20 ms in forward): the live straggler analysis
(every 5 s) has run before the last points."""
EVERY = 40
DOWN_STEPS = 2 * EVERY
"""The run with a tracker down: two points are enough to count (no straggler analysis
is read), and a third of the steps."""
STEP_EVENT = "_traceml_internal:step_time"
FORWARD_EVENT = "_traceml_internal:forward_time"
_CLIENT_VARIABLES = {"MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "NO_PROXY"}


def _ms(events: dict[str, Any], event: str) -> float:
    """An event's time in a step (its longest device), in ms."""
    return max(float(t["duration_ms"]) for t in events[event].values())


def _run(
    tmp_path: Path,
    run: str,
    *options: str,
    env: dict[str, str] | None = None,
    steps: int = STEPS,
) -> Any:
    return run_cli(
        [
            "run",
            "--logs-dir",
            tmp_path / "logs",
            "--run-name",
            run,
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "--exporter",
            "jsonl",
            "--tracker-every-steps",
            str(EVERY),
            *options,
            SCRIPT,
            "--where",
            "forward",
            "--slow-ranks",
            "1",
            "--sleep-ms",
            "20",
            "--steps",
            str(steps),
        ],
        cwd=tmp_path,
        env=env,
        timeout=180,
    )


def _expected(export: Path) -> dict[int, dict[str, float]]:
    """step -> the figures the tracker should hold at it, from step_time.jsonl."""
    by_step: dict[int, dict[int, dict[str, Any]]] = {}
    for line in data_lines(export / "step_time.jsonl"):
        by_step.setdefault(line["step"], {})[line["global_rank"]] = line["events"]
    out: dict[int, dict[str, float]] = {}
    for step, ranks in by_step.items():
        assert sorted(ranks) == [0, 1]
        times = [_ms(ranks[r], STEP_EVENT) for r in (0, 1)]
        out[step] = {
            tm.STEP_TIME_MEDIAN.name: statistics.median(times),
            tm.STEP_TIME_MAX.name: max(times),
            tm.PHASE_MS.format(phase="forward"): statistics.median(
                _ms(ranks[r], FORWARD_EVENT) for r in (0, 1)
            ),
            tm.RANK_STEP_TIME_MS.format(rank=0): times[0],
            tm.RANK_STEP_TIME_MS.format(rank=1): times[1],
        }
    return out


def _tracker_lines(stderr: str, name: str) -> list[str]:
    """The tracker's lines on the terminal: ours about it; nothing else may be there (the
    tracker library's own output stays off the training terminal)."""
    lines = stderr.strip().splitlines()
    assert all(line.startswith("traceml: ") for line in lines), stderr
    return [line for line in lines if line.startswith(f"traceml: {name}")]


def _framework_run(
    tmp_path: Path, run: str, tracker: str, *script_args: str, env: dict[str, str] | None = None
) -> Any:
    return run_cli(
        [
            "run",
            "--logs-dir",
            tmp_path / "logs",
            "--run-name",
            run,
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "--exporter",
            "jsonl",
            "--tracker",
            tracker,
            "--tracker-every-steps",
            str(FRAMEWORK_EVERY),
            FRAMEWORKS,
            *script_args,
        ],
        cwd=tmp_path,
        env=env,
        timeout=240,
    )


def _step_medians(export: Path) -> dict[int, float]:
    """step -> the median over both ranks of its step time, from step_time.jsonl."""
    by_step: dict[int, list[float]] = {}
    for line in data_lines(export / "step_time.jsonl"):
        by_step.setdefault(line["step"], []).append(_ms(line["events"], STEP_EVENT))
    return {step: statistics.median(times) for step, times in by_step.items() if len(times) == 2}


Ran = dict[str, tuple[Path, Any]]


def _hf_run(folder: Path, mlflow: MlflowServer) -> Any:
    """An HF Trainer on 2 ranks reporting to MLflow (the session's server, an experiment
    named after ``folder``) and W&B (offline, under ``folder``)."""
    env = {k: v for k, v in server_env().items() if k.upper() in _CLIENT_VARIABLES}
    env.update(wandb_env(folder / "wb", WANDB_MODE="offline", WANDB_PROJECT="hf"))
    env["MLFLOW_TRACKING_URI"] = mlflow.url
    env["MLFLOW_EXPERIMENT_NAME"] = f"hf-{folder.name}"  # the session's server is shared
    return _framework_run(
        folder, "hf-run", "mlflow,wandb", "hf", str(FRAMEWORK_STEPS), "mlflow,wandb", env=env
    )


@pytest.fixture(scope="module")
def together(tmp_path_factory: pytest.TempPathFactory, mlflow_started: MlflowServer) -> Ran:
    """The runs read for their figures, never for their timings, two at a time (each is
    mostly its processes' start and imports): Lightning with TensorBoard, a tracker
    down, and HF reporting to MLflow and W&B once the session's MLflow server is up:
    name -> folder, result."""
    lit, down = tmp_path_factory.mktemp("lit"), tmp_path_factory.mktemp("down")
    hf = tmp_path_factory.mktemp("hf")
    with ThreadPoolExecutor(max_workers=2) as pool:
        lit_run = pool.submit(
            _framework_run,
            lit,
            "lit-run",
            "tensorboard",
            "lightning-tensorboard",
            str(FRAMEWORK_STEPS),
            str(lit / "tb"),
        )
        env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"}  # nothing listens
        down_run = pool.submit(
            _run, down, "down", "--tracker", "mlflow,tensorboard", env=env, steps=DOWN_STEPS
        )
        mlflow_started.wait_ready()  # it starts with the module (tests/conftest.py)
        hf_run = pool.submit(_hf_run, hf, mlflow_started)
        return {
            "lit": (lit, lit_run.result()),
            "down": (down, down_run.result()),
            "hf": (hf, hf_run.result()),
        }


def test_a_lightning_tensorboard_logger_gets_the_figures_in_its_log_dir(together: Ran) -> None:
    """Lightning's TensorBoardLogger writes on rank 0 into lit/version_0; TraceML's
    event file goes there too, so TensorBoard shows one run with both."""
    folder, res = together["lit"]
    assert res.returncode == 0, res.stderr
    assert "DONE" in res.stdout
    log_dir = folder / "tb" / "lit" / "version_0"
    reader = EventAccumulator(str(log_dir))
    reader.Reload()
    scalars = reader.Tags()["scalars"]
    assert "loss" in scalars  # Lightning's own
    expected = _step_medians(folder / "logs" / "lit-run" / "aggregator" / "export")
    medians = {e.step: e.value for e in reader.Scalars(tm.STEP_TIME_MEDIAN.name)}
    assert sorted(medians) == list(range(FRAMEWORK_EVERY, FRAMEWORK_STEPS + 1, FRAMEWORK_EVERY))
    for step, value in medians.items():
        assert value == pytest.approx(expected[step], rel=1e-6), step
    assert reader.Tensors(SUMMARY_TAG)
    assert json.loads((log_dir / tm.SUMMARY_ARTIFACT).read_text())["ranks"] == [0, 1]
    # Nothing went to TraceML's own folder.
    assert not (folder / "logs" / "lit-run" / "aggregator" / "tensorboard").exists()


def test_a_tracker_that_is_down_costs_one_line_and_counted_points(together: Ran) -> None:
    folder, res = together["down"]  # MLflow's URI: a port nothing listens on
    assert res.returncode == 0, res.stderr
    lines = _tracker_lines(res.stderr, "mlflow")
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("traceml: mlflow: could not open a run ("), res.stderr
    assert "Traceback" not in res.stderr
    aggregator = folder / "logs" / "down" / "aggregator"
    assert len(_expected(aggregator / "export")) == DOWN_STEPS  # the files are whole
    points = DOWN_STEPS // EVERY
    stats = json.loads((aggregator / "stats.json").read_text())
    assert stats["monitoring"]["by_sink"] == {"mlflow": {"points_not_logged": points}}
    assert f"mlflow: {points} points not logged" in res.stderr  # the end of run says it
    warning = warning_file(folder / "logs", "down")
    assert warning is not None
    assert warning["reason"] == "monitoring_incomplete"
    assert warning["monitoring"]["by_sink"] == {"mlflow": {"points_not_logged": points}}
    # The other tracker is not held back by the one that is down.
    reader = EventAccumulator(str(aggregator / "tensorboard"))
    reader.Reload()
    assert len(reader.Scalars(tm.STEP_TIME_MEDIAN.name)) == points


# -- MLflow (last: the session's server (tests/conftest.py) starts with the module) ----


def test_a_plain_loop_gets_a_run_of_traceml_s_own_in_each_tracker(
    tmp_path: Path, mlflow: MlflowServer
) -> None:
    """No tracker run open in the script: TensorBoard's files in the run folder, a W&B
    offline run and an MLflow run named after the TraceML run, each with the same
    points as step_time.jsonl and the run summary at the end."""
    from mlflow.tracking import MlflowClient

    experiment_name = f"traceml-e2e-{tmp_path.name}"  # the session's server is shared
    # W&B offline, its files under tmp_path, none of the machine's W&B settings;
    # MLflow's own settings for the client (no telemetry, no proxy), not the rest
    # of the test's environment: clean_env keeps this checkout first on the path.
    env = wandb_env(tmp_path / "wb", WANDB_MODE="offline", WANDB_PROJECT="traceml-e2e")
    env = {k: v for k, v in env.items() if k.startswith(("WANDB_", "HOME", "NETRC"))}
    env.update({k: v for k, v in server_env().items() if k.upper() in _CLIENT_VARIABLES})
    env["MLFLOW_TRACKING_URI"] = mlflow.url
    env["MLFLOW_EXPERIMENT_NAME"] = experiment_name
    res = _run(tmp_path, "tb", "--tracker", "tensorboard,wandb,mlflow", env=env)
    assert res.returncode == 0, res.stderr
    for name in ("tensorboard", "wandb", "mlflow"):
        assert _tracker_lines(res.stderr, name) == [], res.stderr  # nothing of its own
    assert "wandb:" not in res.stdout + res.stderr  # W&B's own lines stay off the terminal
    client = MlflowClient(tracking_uri=mlflow.url)
    experiment = client.get_experiment_by_name(experiment_name)
    assert experiment is not None
    (run,) = client.search_runs(
        [experiment.experiment_id], filter_string="attributes.run_name = 'tb'"
    )
    histories = {
        name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        for name in (tm.STEP_TIME_MEDIAN.name, tm.RANK_STEP_TIME_MS.format(rank=1))
    }
    artifact = _artifact_json(client, run.info.run_id, tmp_path)
    folder = tmp_path / "logs" / "tb" / "aggregator"
    expected = _expected(folder / "export")
    reader = EventAccumulator(str(folder / "tensorboard"))
    reader.Reload()
    read = {tag: {e.step: e.value for e in reader.Scalars(tag)} for tag in reader.Tags()["scalars"]}
    medians = read[tm.STEP_TIME_MEDIAN.name]
    assert sorted(medians) == list(range(EVERY, STEPS + 1, EVERY))
    for step in medians:
        for name, value in expected[step].items():
            # Event files hold float32.
            assert read[name][step] == pytest.approx(value, rel=1e-6), (name, step)
    assert read[tm.RANKS.name][STEPS] == 2
    # Rank 1 sleeps 20 ms in forward: the straggler, by about that much.
    assert read[tm.STRAGGLER_RANK.name][STEPS] == 1
    assert read[tm.STRAGGLER_EXCESS_MS.name][STEPS] == pytest.approx(20.0, abs=8.0)
    # EVERY steps over the wall clock between two points, as the file's timestamps say.
    ends = {
        line["step"]: line["timestamp_unix_ns"]
        for line in data_lines(folder / "export" / "step_time.jsonl")
        if line["global_rank"] == 0
    }
    rate = EVERY / ((ends[STEPS] - ends[STEPS - EVERY]) / 1e9)
    assert read[tm.THROUGHPUT_STEPS_PER_S.name][STEPS] == pytest.approx(rate, rel=0.3)
    # The run summary at the end: a text entry, and the JSON beside the event files.
    (text,) = reader.Tensors(SUMMARY_TAG)
    table = text.tensor_proto.string_val[0].decode()
    assert f"| {summary_keys.SUMMARY_VERDICT.name} | straggler |" in table
    assert f"| {summary_keys.SUMMARY_STRAGGLER_RANK.name} | 1 |" in table
    summary = json.loads((folder / "tensorboard" / tm.SUMMARY_ARTIFACT).read_text())
    assert summary["straggler"]["stragglers"][0]["rank"] == 1
    assert summary["ranks"] == [0, 1]
    # The same points in W&B, at full precision.
    (wb_run,) = run_folders(tmp_path / "wb")
    found = records(wb_run)
    (opened,) = of_type(found, "run")
    assert opened["display_name"] == "tb" and opened["project"] == "traceml-e2e"
    assert opened["config"]["update"]["traceml.run_dir"] == str(tmp_path / "logs" / "tb")
    wb = history(found)
    assert [s for s, _ in wb[tm.STEP_TIME_MEDIAN.name]] == list(range(EVERY, STEPS + 1, EVERY))
    for name in (tm.STEP_TIME_MEDIAN.name, tm.RANK_STEP_TIME_MS.format(rank=1)):
        for step, value in wb[name]:
            assert value == pytest.approx(expected[step][name], rel=1e-9), (name, step)
    assert of_type(found, "exit")[0]["exit_code"] == 0
    # MLflow: the same points, the summary as tags and an artifact.
    assert run.info.status == "FINISHED"
    assert run.data.tags["traceml.run_dir"] == str(tmp_path / "logs" / "tb")
    for name, history_ml in histories.items():
        assert sorted(history_ml) == list(range(EVERY, STEPS + 1, EVERY))
        for step, value in history_ml.items():
            assert value == pytest.approx(expected[step][name], rel=1e-9), (name, step)
    tags = run.data.tags
    assert tags[summary_keys.SUMMARY_VERDICT.name] == "straggler"
    assert tags[summary_keys.SUMMARY_STRAGGLER_RANK.name] == "1"
    assert tags[tm.RANKS.name] == "2"
    assert tags[summary_keys.SUMMARY_STEPS.name] == str(STEPS)
    assert artifact["straggler"]["stragglers"][0]["rank"] == 1


def _artifact_json(client: Any, run_id: str, tmp_path: Path) -> Any:
    assert [a.path for a in client.list_artifacts(run_id)] == [tm.SUMMARY_ARTIFACT]
    local = client.download_artifacts(run_id, tm.SUMMARY_ARTIFACT, str(tmp_path))
    return json.loads(Path(local).read_text())


def test_an_hf_trainer_reporting_to_mlflow_and_wandb_gets_the_figures_in_its_runs(
    together: Ran, mlflow: MlflowServer, tmp_path: Path
) -> None:
    """HF's MLflowCallback and WandbCallback open their runs on rank 0. TraceML logs
    into the MLflow run itself (no second run), beside the loss, and leaves ending it
    to HF; the W&B run is offline, so TraceML's is an offline run of its own that
    names the script's."""
    from mlflow.tracking import MlflowClient

    folder, res = together["hf"]
    experiment_name = f"hf-{folder.name}"
    assert res.returncode == 0, res.stderr
    assert "DONE" in res.stdout
    assert "Traceback" not in res.stderr
    client = MlflowClient(tracking_uri=mlflow.url)
    experiment = client.get_experiment_by_name(experiment_name)
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])  # HF's, and no other
    run_id = run.info.run_id
    assert run.data.tags["traceml.run_dir"] == str(folder / "logs" / "hf-run")
    assert client.get_metric_history(run_id, "loss")  # HF's own metric
    expected = _step_medians(folder / "logs" / "hf-run" / "aggregator" / "export")
    history_ml = {
        m.step: m.value for m in client.get_metric_history(run_id, tm.STEP_TIME_MEDIAN.name)
    }
    due = list(range(FRAMEWORK_EVERY, FRAMEWORK_STEPS + 1, FRAMEWORK_EVERY))
    assert sorted(history_ml) == due
    for step, value in history_ml.items():
        assert value == pytest.approx(expected[step], rel=1e-9), step
    assert run.data.tags[tm.RANKS.name] == "2"
    assert _artifact_json(client, run_id, tmp_path)["ranks"] == [0, 1]
    # W&B: the script's offline run and TraceML's, which names it.
    by_name = {}
    for wb_folder in run_folders(folder / "wb"):
        found = records(wb_folder)
        (opened,) = of_type(found, "run")
        by_name[opened.get("display_name", "")] = (opened, found)
    script = next(v for k, v in by_name.items() if k != "hf-run")
    ours, found = by_name["hf-run"]
    assert ours["config"]["update"]["traceml.user_run_id"] == script[0]["run_id"]
    assert "loss" in history(script[1]) or "train/loss" in history(script[1])
    wb = history(found)
    assert [s for s, _ in wb[tm.STEP_TIME_MEDIAN.name]] == due
