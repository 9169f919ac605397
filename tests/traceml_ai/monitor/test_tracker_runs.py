"""What rank 0 tells the aggregator about the tracker runs its script has open
(``rank._runtime.tracker_runs``), read from the real libraries in a fresh process: an MLflow
run active in the main thread (read from another thread, as the sampler thread does),
an offline W&B run, and the folders of ``SummaryWriter``s made before and after
watching began (torch's and tensorboardX's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e_helpers import clean_env

PROBE = """
import json, threading
from traceml_ai.rank._runtime.tracker_runs import TrackerRuns, watch_summary_writers
from torch.utils.tensorboard import SummaryWriter
kept = SummaryWriter("tb_before")  # made before TraceML started watching
watch_summary_writers()
runs = TrackerRuns()
looks = []
def look():
    changed = runs.look()
    looks.append({"changed": changed, "runs": json.loads(json.dumps(runs.runs))})
def look_from_another_thread():
    thread = threading.Thread(target=look)
    thread.start()
    thread.join()
look_from_another_thread()  # nothing open yet but the writer
import mlflow, wandb
mlflow.set_tracking_uri("sqlite:///m.db")
with mlflow.start_run() as active:
    run = wandb.init(mode="offline", dir=".", project="p",
                     settings=wandb.Settings(silent=True, console="off"))
    look_from_another_thread()
    look_from_another_thread()
    from tensorboardX import SummaryWriter as XWriter
    kept_too = XWriter("tbx_after")
    look_from_another_thread()
    ids = [active.info.run_id, run.id]
    run.finish()
look_from_another_thread()  # both runs ended: still the ones told
print("OUT", json.dumps({"looks": looks, "ids": ids}))
"""


def test_the_runs_a_script_has_open_are_found(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=tmp_path,
        env=clean_env({"WANDB_SILENT": "true"}),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stderr
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("OUT ")]
    out = json.loads(line[4:])
    looks = out["looks"]
    mlflow_id, wandb_id = out["ids"]
    assert looks[0] == {
        "changed": True,
        "runs": {"tensorboard": {"log_dir": str(tmp_path / "tb_before")}},
    }
    assert looks[1]["changed"] is True
    assert looks[1]["runs"] == {
        "tensorboard": {"log_dir": str(tmp_path / "tb_before")},
        # A relative local URI made absolute: the aggregator runs in another folder.
        "mlflow": {"run_id": mlflow_id, "tracking_uri": f"sqlite:///{tmp_path / 'm.db'}"},
        "wandb": {
            "id": wandb_id,
            "project": "p",
            "entity": "",
            "mode": "offline",
            "dir": str(tmp_path),
        },
    }
    assert looks[2]["changed"] is False  # the same runs are not told again
    assert looks[3]["runs"]["tensorboard"] == {"log_dir": str(tmp_path / "tbx_after")}
    assert looks[4] == {"changed": False, "runs": looks[3]["runs"]}


def test_a_local_tracking_uri_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from traceml_ai.rank._runtime.tracker_runs import _local_uri

    monkeypatch.chdir(tmp_path)
    assert _local_uri("sqlite:///m.db") == f"sqlite:///{tmp_path}/m.db"
    assert _local_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert _local_uri("file:mlruns") == f"file:{tmp_path}/mlruns"
    assert _local_uri("file:///abs/mlruns") == "file:///abs/mlruns"
    assert _local_uri("mlruns") == f"{tmp_path}/mlruns"
    assert _local_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert _local_uri("databricks") == "databricks"
