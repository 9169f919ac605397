"""``trackers`` and ``tracker_every_steps``: every layer, the repeatable flag, a YAML
list, the aggregator protocol, and a bad value as one line of the real command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from traceml_ai.aggregator.protocol import AggregatorLaunchConfig
from traceml_ai.integrations._ray_config import TraceMLRayConfig
from traceml_ai.launch.commands import run as run_command
from traceml_ai.settings import (
    TRACKER_NAMES,
    ExportSettings,
    MonitorSettings,
    SettingsError,
    parse_trackers,
    resolve_launch_settings,
)

REPO = Path(__file__).resolve().parents[3]


def test_off_by_default(tmp_path: Path) -> None:
    launch = resolve_launch_settings("run", {}, environ={}, yaml_path=tmp_path / "none.yaml")
    assert launch.monitor.trackers == ()
    assert launch.monitor.tracker_every_steps == 100
    assert not launch.monitor.any_on
    assert TraceMLRayConfig().monitor_settings.trackers == ()


def test_parse_trackers_forms() -> None:
    assert parse_trackers("") == parse_trackers("off") == ()
    assert parse_trackers(" MLflow , tensorboard,mlflow,") == ("mlflow", "tensorboard")
    with pytest.raises(ValueError, match=r"unknown 'neptune'"):
        parse_trackers("tensorboard,neptune")
    assert TRACKER_NAMES == ("tensorboard", "mlflow", "wandb")


def test_the_flag_repeats_and_takes_a_comma_list(tmp_path: Path) -> None:
    argv = ["--tracker", "mlflow", "--tracker", "tensorboard,mlflow", "train.py"]
    params = run_command.make_context("run", argv).params
    assert params["trackers"] == ("mlflow", "tensorboard,mlflow")
    launch = resolve_launch_settings(
        "run", params, environ={"TRACEML_TRACKERS": "off"}, yaml_path=tmp_path / "n.yaml"
    )
    assert launch.monitor.trackers == ("mlflow", "tensorboard")  # the flag wins
    assert launch.sources["trackers"] == "--tracker"
    assert launch.monitor.any_on


def test_an_absent_flag_leaves_the_lower_layers(tmp_path: Path) -> None:
    params = run_command.make_context("run", ["train.py"]).params
    yaml_path = tmp_path / "traceml.yaml"
    yaml_path.write_text("trackers: [tensorboard, mlflow]\ntracker_every_steps: 7\n")
    launch = resolve_launch_settings("run", params, environ={}, yaml_path=yaml_path)
    assert launch.monitor.trackers == ("tensorboard", "mlflow")
    assert launch.monitor.tracker_every_steps == 7
    launch = resolve_launch_settings(
        "run", params, environ={"TRACEML_TRACKERS": "mlflow"}, yaml_path=yaml_path
    )
    assert launch.monitor.trackers == ("mlflow",)


def test_a_yaml_list_of_no_names_is_refused(tmp_path: Path) -> None:
    yaml_path = tmp_path / "traceml.yaml"
    yaml_path.write_text("trackers: [tensorboard, {a: 1}]\n")
    with pytest.raises(SettingsError, match=r"traceml.yaml .*: trackers: expected tracker names"):
        resolve_launch_settings("run", {}, environ={}, yaml_path=yaml_path)


def test_the_trackers_cross_the_aggregator_protocol() -> None:
    monitor = MonitorSettings(trackers=("mlflow",), tracker_every_steps=5)
    config = AggregatorLaunchConfig(run_dir="/r", export=ExportSettings(), monitor=monitor)
    back = AggregatorLaunchConfig.from_json(config.to_json())
    assert back.monitor == monitor
    assert orjson.loads(config.to_json())["monitor"]["trackers"] == ["mlflow"]


def test_ray_config_field() -> None:
    config = TraceMLRayConfig(trackers="tensorboard, mlflow", tracker_every_steps=10)
    assert config.monitor_settings.trackers == ("tensorboard", "mlflow")
    assert config.monitor_settings.tracker_every_steps == 10


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--tracker", "neptune"], {}, "traceml: error: --tracker: expected tracker names"),
        (
            [],
            {"TRACEML_TRACKERS": "comet"},
            "traceml: error: TRACEML_TRACKERS: expected tracker names",
        ),
        (
            ["--tracker-every-steps", "0"],
            {},
            "traceml: error: --tracker-every-steps: expected a whole number of at least 1",
        ),
    ],
)
def test_a_bad_value_is_one_line_of_the_command(
    tmp_path: Path, args: list[str], env: dict[str, str], expected: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "traceml_ai", "run", *args, str(script)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(expected), proc.stderr
    assert "Traceback" not in proc.stderr
    assert "must not run" not in proc.stdout + proc.stderr
