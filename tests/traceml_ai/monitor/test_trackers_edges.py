"""The trackers where a script or a machine does what TraceML did not plan for, each
against the real receiver: a script that ends its MLflow run and opens the next one,
a script's MLflow run that is gone before or after TraceML joined it (a real ``mlflow server`` on sqlite, read back with
``MlflowClient``), a ``WANDB_DIR`` W&B cannot write (W&B offline, read back with
``wandb leet inspect``), and an import that fails without naming a module. Each case
runs in a process of its own: the tracker libraries keep their settings per process."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench.wandb_files import history, of_type, records, run_folders, wandb_env
from tests.e2e_helpers import PY, REPO, clean_env
from tests.receivers.mlflow_server import MlflowServer, server_env
from traceml_ai.monitor import tracker_metrics as tm

pytestmark = pytest.mark.slow

_PRELUDE = f"""
import json, sys, time
sys.path.insert(0, {str(REPO)!r})
sys.path.insert(0, {str(REPO / "src")!r})
from pathlib import Path
from tests.traceml_ai.monitor.test_monitor import encoded, identity, step
from traceml_ai.monitor import Monitoring, RunInfo, tracker_sink
from traceml_ai.monitor.metrics import Health
from traceml_ai.settings import MonitorSettings
"""


def _python(code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-c", _PRELUDE + code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )


def _last_json(stdout: str) -> Any:
    return json.loads(stdout.strip().splitlines()[-1])


def _mlflow_env(server: MlflowServer, experiment: str) -> dict[str, str]:
    env = clean_env(
        {k: v for k, v in server_env().items() if k.startswith(("MLFLOW_", "DO_", "NO_", "no_"))}
    )
    env["MLFLOW_TRACKING_URI"] = server.url
    env["MLFLOW_EXPERIMENT_NAME"] = experiment
    return env


_NEXT_RUN = """
from mlflow.tracking import MlflowClient
client = MlflowClient()
experiment = client.create_experiment(sys.argv[2])
url = client.tracking_uri
m = Monitoring(MonitorSettings(trackers=("mlflow",), tracker_every_steps=2),
               RunInfo(run_dir=Path(sys.argv[1]), run_name="traceml-next", host="h"), Health)
m.start_sinks({"mlflow": tracker_sink("mlflow")})
m.feed.start()

def steps(first, last):
    for i in range(first, last + 1):
        m.submit(encoded("step_time", identity(0, world=1), [step(i, 10.0, time.time_ns())]))
        time.sleep(0.02)

def logged(run_id):
    return sorted(p.step for p in client.get_metric_history(run_id, "traceml/ranks"))

def tell(run_id):  # rank 0's tracker_runs message
    m.state.note_tracker_runs(identity(0), {"mlflow": {"run_id": run_id, "tracking_uri": url}})

a = client.create_run(experiment, run_name="script-a").info.run_id
tell(a)
steps(1, 4)
deadline = time.monotonic() + 60
while logged(a) != [2, 4] and time.monotonic() < deadline:
    time.sleep(0.1)
client.set_terminated(a)  # the script ends its run ...
b = client.create_run(experiment, run_name="script-b").info.run_id  # ... and opens the next
time.sleep(0.01)
steps(5, 8)
time.sleep(1.5)  # rank 0 tells the new run once a sampling interval, after these steps
tell(b)
steps(9, 10)
time.sleep(0.5)
client.set_terminated(b)  # the script ends its last run; no other comes
time.sleep(0.01)
steps(11, 12)
loss = m.close(30.0)
print(json.dumps({"a": logged(a), "b": logged(b), "by_sink": dict(loss.by_sink),
                  "own": [r.info.run_name for r in client.search_runs([experiment])
                          if r.info.run_id not in (a, b)]}))
"""


def test_points_after_the_script_ended_its_run_go_to_the_run_it_opens_next(
    tmp_path: Path, mlflow: MlflowServer
) -> None:
    """The script ends its MLflow run and opens another; rank 0 tells the new one a
    sampling interval later. The points of the steps after the end wait for it and go
    into it, none into the run that ended; a run the script ends with no other after
    it keeps the points that come after its end (HF ends its run before TraceML's last
    point)."""
    experiment = f"next-{tmp_path.name}"
    env = _mlflow_env(mlflow, experiment)  # TraceML's own run would go there too
    result = _python(_NEXT_RUN, env, str(tmp_path / "run"), experiment)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
    out = _last_json(result.stdout)
    assert out["a"] == [2, 4]
    assert out["b"] == [6, 8, 10, 12]
    assert out["by_sink"] == {}
    assert out["own"] == []  # every point in the script's runs


_GONE = """
from mlflow.tracking import MlflowClient
client = MlflowClient()
experiment = client.create_experiment(sys.argv[2])
gone = sys.argv[3]
if gone == "deleted":
    gone = client.create_run(experiment, run_name="script").info.run_id
    client.delete_run(gone)
m = Monitoring(MonitorSettings(trackers=("mlflow",), tracker_every_steps=2),
               RunInfo(run_dir=Path(sys.argv[1]), run_name="traceml-fallback", host="h"), Health)
m.start_sinks({"mlflow": tracker_sink("mlflow")})
m.feed.start()
m.state.note_tracker_runs(identity(0), {"mlflow": {"run_id": gone, "tracking_uri": client.tracking_uri}})
for i in range(1, 6):
    m.submit(encoded("step_time", identity(0, world=1), [step(i, 10.0, time.time_ns())]))
    time.sleep(0.02)
loss = m.close(30.0)
(run,) = [r for r in client.search_runs([experiment]) if r.info.run_id != gone]
print(json.dumps({"name": run.info.run_name, "tag": run.data.tags.get("mlflow.runName"),
                  "dir": run.data.tags.get("traceml.run_dir"), "status": run.info.status,
                  "points": sorted(p.step for p in client.get_metric_history(run.info.run_id, "traceml/ranks")),
                  "by_sink": dict(loss.by_sink)}))
"""


@pytest.mark.parametrize("gone", ["deleted", "0123456789abcdef0123456789abcdef"])
def test_a_scripts_run_that_is_gone_leaves_the_points_in_a_run_named_after_traceml_s(
    tmp_path: Path, mlflow: MlflowServer, gone: str
) -> None:
    """The script's run was deleted, or was never on the server: one line, and TraceML's
    own run takes the points under the TraceML run's name, as docs/trackers.md says."""
    experiment = f"gone-{tmp_path.name}"
    env = _mlflow_env(mlflow, experiment)  # TraceML's own run goes there too
    result = _python(_GONE, env, str(tmp_path / "run"), experiment, gone)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        "traceml: mlflow: could not log into the run the training script has open ("
    )
    out = _last_json(result.stdout)
    assert (out["name"], out["tag"]) == ("traceml-fallback", "traceml-fallback")
    assert out["dir"] == str(tmp_path / "run")
    assert out["status"] == "FINISHED"
    assert out["points"] == [2, 4, 5]
    assert out["by_sink"] == {}


_WANDB_SINK = """
run = RunInfo(run_dir=Path(sys.argv[1]), run_name="wb-fallback", host="h")
m = Monitoring(MonitorSettings(trackers=("wandb",), tracker_every_steps=5), run, Health)
m.start_sinks({"wandb": tracker_sink("wandb")})
m.feed.start()
for i in range(1, 11):
    m.submit(encoded("step_time", identity(0, world=1), [step(i, 10.0, time.time_ns())]))
    time.sleep(0.01)
print(json.dumps({"by_sink": dict(m.close(60.0).by_sink)}))
"""


def test_a_wandb_dir_w_and_b_cannot_write_is_one_line_naming_where_the_run_went(
    tmp_path: Path,
) -> None:
    """``WANDB_DIR`` under a file: W&B puts the run in the system's temporary folder, as
    it would the script's, and one line says so and names the run's folder."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = wandb_env(tmp_path, WANDB_MODE="offline", TMPDIR=str(temporary))
    env["WANDB_DIR"] = str(blocker / "wandb-dir")
    result = _python(_WANDB_SINK, env, str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    (folder,) = run_folders(temporary)
    assert _last_json(result.stdout)["by_sink"] == {}
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"traceml: wandb: W&B cannot write WANDB_DIR {str(blocker / 'wandb-dir')!r}: "
        f"the run's files are in {str(folder)!r}"
    ], result.stderr
    found = records(folder)
    assert of_type(found, "run")[0]["display_name"] == "wb-fallback"
    assert [s for s, _ in history(found)[tm.STEP_TIME_MEDIAN.name]] == [5, 10]


_BROKEN_IMPORT = """
import importlib.abc
class Broken(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "wandb":
            raise ImportError(*json.loads(sys.argv[2]), **json.loads(sys.argv[3]))
        return None
sys.meta_path.insert(0, Broken())
m = Monitoring(MonitorSettings(trackers=("wandb",)),
               RunInfo(run_dir=Path(sys.argv[1]), run_name="r", host="h"), Health)
m.start_sinks({"wandb": tracker_sink("wandb")})
print(json.dumps(dict(m.close(2.0).not_started)))
"""


@pytest.mark.parametrize(
    ("args", "kwargs", "why"),
    [
        (["No module named 'wandb'"], {}, "ImportError: No module named 'wandb'"),
        (
            ["cannot import name 'Run' from 'wandb'"],
            {"name": "wandb"},
            "ImportError: cannot import name 'Run' from 'wandb'",
        ),
        ([], {}, "ImportError"),
    ],
)
def test_an_import_that_fails_without_naming_a_missing_module_is_said_as_it_is(
    tmp_path: Path, args: list[str], kwargs: dict[str, str], why: str
) -> None:
    """An ``ImportError`` that names no module, or one of a module that is installed,
    is not "X is not installed": the line gives the error itself."""
    result = _python(
        _BROKEN_IMPORT, clean_env(), str(tmp_path), json.dumps(args), json.dumps(kwargs)
    )
    assert result.returncode == 0, result.stderr
    said = f"needs the 'wandb' extra ({why}): pip install 'traceml-ai[wandb]'"
    assert _last_json(result.stdout) == {"wandb": said}
    assert result.stderr.strip().splitlines() == [
        f"traceml: wandb: {said}; training and the files go on without it"
    ]


_DELETED_AFTER_JOINING = """
from mlflow.tracking import MlflowClient
client = MlflowClient()
experiment = client.create_experiment(sys.argv[2])
m = Monitoring(MonitorSettings(trackers=("mlflow",), tracker_every_steps=2),
               RunInfo(run_dir=Path(sys.argv[1]), run_name="traceml-after", host="h"), Health)
m.start_sinks({"mlflow": tracker_sink("mlflow")})
m.feed.start()

def steps(first, last):
    for i in range(first, last + 1):
        m.submit(encoded("step_time", identity(0, world=1), [step(i, 10.0, time.time_ns())]))
        time.sleep(0.02)

def logged(run_id):
    return sorted(p.step for p in client.get_metric_history(run_id, "traceml/ranks"))

script = client.create_run(experiment, run_name="script").info.run_id
m.state.note_tracker_runs(identity(0), {"mlflow": {"run_id": script, "tracking_uri": client.tracking_uri}})
steps(1, 4)
deadline = time.monotonic() + 60
while logged(script) != [2, 4] and time.monotonic() < deadline:
    time.sleep(0.1)
client.delete_run(script)  # someone deletes the script's run while it trains
steps(5, 8)
loss = m.close(30.0)
own = [r for r in client.search_runs([experiment]) if r.info.run_id != script]
print(json.dumps({"own": [(r.info.run_name, r.info.status, r.data.tags.get("traceml.run_dir"),
                           logged(r.info.run_id)) for r in own],
                  "by_sink": dict(loss.by_sink)}))
"""


def test_a_scripts_run_deleted_after_joining_sends_the_later_points_to_traceml_s_own(
    tmp_path: Path, mlflow: MlflowServer
) -> None:
    """The script's run is deleted while TraceML logs into it: one line, and the points
    from then on (and the summary) go to a run of TraceML's own, none lost."""
    experiment = f"deleted-{tmp_path.name}"
    env = _mlflow_env(mlflow, experiment)
    result = _python(_DELETED_AFTER_JOINING, env, str(tmp_path / "run"), experiment)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("traceml: mlflow: the run the training script has open is gone (")
    out = _last_json(result.stdout)
    assert out["own"] == [["traceml-after", "FINISHED", str(tmp_path / "run"), [6, 8]]]
    assert out["by_sink"] == {}
