"""The W&B tracker against real W&B, offline (no server here), read back with W&B's own
``wandb leet inspect``: TraceML's own run with its points, summary and artifact; the
run TraceML opens next to a training script's offline run; and a run that needs a
server it cannot have failing fast, as one line and counted points. Each case runs in
a process of its own: W&B keeps a session per process, started from the environment."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from bench.wandb_files import history, of_type, records, run_folders, wandb_env
from tests.e2e_helpers import PY, REPO, free_port
from traceml_ai.monitor import tracker_metrics as tm
from traceml_ai.monitor._tracker_wandb import (
    RUN_DIR_KEY,
    STEP_METRIC,
    SUMMARY_ARTIFACT_TYPE,
    USER_RUN_KEY,
)

_PRELUDE = f"""
import json, sys, time
sys.path.insert(0, {str(REPO)!r})
sys.path.insert(0, {str(REPO / "src")!r})
from pathlib import Path
from tests.traceml_ai.monitor.test_monitor import encoded, identity, step
from traceml_ai.monitor import Monitoring, RunInfo, tracker_sink
from traceml_ai.monitor.metrics import Health
from traceml_ai.monitor._tracker_wandb import open_wandb
from traceml_ai.settings import MonitorSettings
"""

_SINK = """
run = RunInfo(run_dir=Path(sys.argv[1]), run_name="wb-run", host="h")
m = Monitoring(MonitorSettings(trackers=("wandb",), tracker_every_steps=5), run, Health)
m.start_sinks({"wandb": tracker_sink("wandb")})
m.feed.start()
started = time.monotonic()
for i in range(1, 13):
    for r in range(2):
        item = step(i, 10.0 + r, 10**18 + i * 20_000_000, **{"_traceml_internal:forward_time": 4.0})
        m.submit(encoded("step_time", identity(r, world=2), [item]))
    time.sleep(0.01)
loss = m.close(30.0)
print(json.dumps({"by_sink": dict(loss.by_sink), "s": time.monotonic() - started}))
"""


def _python(code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-c", _PRELUDE + code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def _last_json(stdout: str) -> Any:
    return json.loads(stdout.strip().splitlines()[-1])


def test_the_sink_logs_its_points_into_a_run_of_its_own(tmp_path: Path) -> None:
    env = wandb_env(tmp_path, WANDB_MODE="offline", WANDB_PROJECT="proj-a")
    result = _python(_SINK, env, str(tmp_path / "traceml-run"))
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr  # nothing of W&B's on the terminal
    assert _last_json(result.stdout)["by_sink"] == {}
    (folder,) = run_folders(tmp_path)
    found = records(folder)
    (opened,) = of_type(found, "run")
    assert opened["display_name"] == "wb-run"
    assert opened["project"] == "proj-a"  # W&B's own setting, as the script's run
    assert opened["config"]["update"][RUN_DIR_KEY] == str(tmp_path / "traceml-run")
    read = history(found)
    assert read[tm.STEP_TIME_MEDIAN.name] == [(5, 10.5), (10, 10.5), (12, 10.5)]
    assert read[tm.STEP_TIME_MAX.name][-1] == (12, 11.0)
    assert read[tm.RANK_STEP_TIME_MS.format(rank=1)][0] == (5, 11.0)
    assert read[tm.PHASE_MS.format(phase="forward")][0] == (5, 4.0)
    # Its own run: W&B's step is the training step too.
    steps = [r["history"]["step"]["num"] for r in found if r["type"] == "history"]
    assert steps == [5, 10, 12]
    metrics = of_type(found, "metric")
    assert {"glob_name": "traceml/*", "step_metric": STEP_METRIC} in [
        {k: m.get(k) for k in ("glob_name", "step_metric")} for m in metrics
    ]
    assert of_type(found, "stats") == []  # no sampling of the aggregator's machine
    assert of_type(found, "exit")[0]["exit_code"] == 0


def test_the_summary_is_the_runs_summary_fields_and_an_artifact(tmp_path: Path) -> None:
    code = """
t = open_wandb(RunInfo(run_dir=Path(sys.argv[1]), run_name="wb-sum", host="h"), None)
t.log({"traceml/step_time_ms/median": 12.5}, 40)
t.log_summary({"traceml/summary/step_time_ms/median": 12.0, "traceml/summary/verdict": "balanced"},
              b'{"schema": "traceml.summary", "steps": 40}')
t.close()
print(json.dumps({"dir": t.run_dir}))
"""
    env = wandb_env(tmp_path, WANDB_MODE="offline")
    result = _python(code, env, str(tmp_path / "traceml-run"))
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
    found = records(Path(_last_json(result.stdout)["dir"]))
    assert of_type(found, "run")[0]["project"] == "traceml"  # no WANDB_PROJECT
    summary: dict[str, Any] = {}
    for update in of_type(found, "summary"):
        summary.update(update.get("update", {}))
    assert summary["traceml/summary/step_time_ms/median"] == 12.0
    assert summary["traceml/summary/verdict"] == "balanced"
    (artifact,) = of_type(found, "artifact")
    assert artifact["type"] == SUMMARY_ARTIFACT_TYPE
    assert artifact["name"].startswith("traceml-summary-")
    (entry,) = artifact["manifest"]["contents"]
    assert entry["path"] == tm.SUMMARY_ARTIFACT
    # Staged on disk until `wandb sync` uploads it: the bytes given.
    assert Path(entry["local_path"]).read_bytes() == b'{"schema": "traceml.summary", "steps": 40}'


def test_next_to_a_training_scripts_offline_run(tmp_path: Path) -> None:
    """The script's run is offline: TraceML's is an offline run of its own in the same
    project and folder, naming the script's run in its config."""
    user = """
import wandb
run = wandb.init(project="user-proj", mode="offline", settings=wandb.Settings(silent=True))
run.log({"loss": 1.0})
run.finish()
print(json.dumps({"id": run.id, "project": run.project, "entity": run.entity or "",
                  "mode": run.settings.mode, "dir": run.settings.root_dir}))
"""
    user_dir = tmp_path / "script"
    user_dir.mkdir()
    result = _python(user, wandb_env(user_dir))
    assert result.returncode == 0, result.stderr
    user_run = _last_json(result.stdout)
    assert user_run["mode"] == "offline" and user_run["dir"] == str(user_dir)
    traceml = """
user_run = json.loads(sys.argv[2])
t = open_wandb(RunInfo(run_dir=Path(sys.argv[1]), run_name="wb-next", host="h"), user_run)
t.log({"traceml/step_time_ms/median": 9.0}, 100)
t.close()
print(json.dumps({"dir": t.run_dir, "joined": t.joined}))
"""
    # The aggregator's own W&B variables point elsewhere: the script's run decides.
    env = wandb_env(tmp_path / "aggregator", WANDB_MODE="online", WANDB_PROJECT="other")
    result = _python(traceml, env, str(tmp_path / "traceml-run"), json.dumps(user_run))
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
    opened = _last_json(result.stdout)
    assert opened["joined"] is False
    folders = run_folders(user_dir)
    assert len(folders) == 2 and Path(opened["dir"]) in folders  # one `wandb sync` for both
    found = records(Path(opened["dir"]))
    (run,) = of_type(found, "run")
    assert run["project"] == "user-proj"
    assert run["display_name"] == "wb-next"
    assert run["run_id"] != user_run["id"]
    assert run["config"]["update"][USER_RUN_KEY] == user_run["id"]
    assert history(found)[tm.STEP_TIME_MEDIAN.name] == [(100, 9.0)]


def test_online_without_a_key_is_one_line_and_counted_points(tmp_path: Path) -> None:
    env = wandb_env(tmp_path, WANDB_MODE="online")
    result = _python(_SINK, env, str(tmp_path / "traceml-run"))
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("traceml: wandb: could not open a run (RuntimeError: no W&B API key")
    assert lines[0].endswith("training and the files go on")
    out = _last_json(result.stdout)
    assert out["by_sink"] == {"wandb": {"points_not_logged": 3}}  # 5, 10 and the last, 12
    assert out["s"] < 20.0
    assert not (tmp_path / "wandb").exists() or run_folders(tmp_path) == []


@pytest.mark.slow
def test_joining_a_run_on_a_server_that_is_down_gives_up_in_time(tmp_path: Path) -> None:
    """A key, but the server refuses: joining the script's run (shared mode) fails
    within ``WANDB_INIT_TIMEOUT``, as an exception (the sink's one line), silently."""
    code = """
user_run = {"id": "abcd1234", "project": "p", "entity": "", "mode": "online", "dir": ""}
started = time.monotonic()
try:
    open_wandb(RunInfo(run_dir=Path(sys.argv[1]), run_name="r", host="h"), user_run)
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "s": time.monotonic() - started}))
"""
    env = wandb_env(
        tmp_path,
        WANDB_API_KEY="a" * 40,
        WANDB_BASE_URL=f"http://127.0.0.1:{free_port()}",  # nothing listens
        WANDB_INIT_TIMEOUT="3",
    )
    started = time.monotonic()
    result = _python(code, env, str(tmp_path / "traceml-run"))
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
    out = _last_json(result.stdout)
    assert out["error"] == "CommError"
    assert out["s"] < 30.0
    assert time.monotonic() - started < 60.0  # W&B's service did not hold the exit


class _FakeRun:
    """What the tracker uses of a W&B run, recorded (joining needs a W&B server)."""

    def __init__(self) -> None:
        self.id = "abcd1234"
        self.logged: list[tuple[dict[str, Any], int | None]] = []
        self.metrics: list[tuple[str, dict[str, Any]]] = []

    def define_metric(self, name: str, **options: Any) -> None:
        self.metrics.append((name, options))

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        self.logged.append((data, step))


def test_a_training_scripts_online_run_is_joined_as_a_second_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calls only (no server here): W&B's documented settings of a second writer,
    and points that leave the script's own ``_step`` alone."""
    import wandb

    from traceml_ai.monitor import RunInfo
    from traceml_ai.monitor._tracker_wandb import CLIENT_DEFAULTS, LABEL, open_wandb

    for key in (*CLIENT_DEFAULTS, "WANDB_SILENT"):  # set by the tracker, restored after
        monkeypatch.delenv(key, raising=False)
    calls: list[dict[str, Any]] = []
    run = _FakeRun()

    def init(**kwargs: Any) -> _FakeRun:
        calls.append(kwargs)
        return run

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(wandb, "login", lambda **kwargs: True)
    user_run = {"id": "abcd1234", "project": "p", "entity": "team", "mode": "online", "dir": ""}
    tracker = open_wandb(RunInfo(run_dir=tmp_path, run_name="r", host="h"), user_run)
    assert tracker.joined
    (call,) = calls
    assert (call["id"], call["project"], call["entity"], call["dir"]) == (
        "abcd1234",
        "p",
        "team",
        None,
    )
    assert "name" not in call  # the script's run keeps its name
    settings = call["settings"]
    assert settings["mode"] == "shared" and settings["x_primary"] is False
    assert settings["x_label"] == LABEL and settings["x_update_finish_state"] is False
    assert settings["silent"] is True and settings["console"] == "off"
    assert call["config"] == {RUN_DIR_KEY: str(tmp_path)}
    assert ("traceml/*", {"step_metric": STEP_METRIC}) in run.metrics
    tracker.log({"traceml/ranks": 2.0}, 300)
    assert run.logged == [({"traceml/ranks": 2.0, STEP_METRIC: 300}, None)]
