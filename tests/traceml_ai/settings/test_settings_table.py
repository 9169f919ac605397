"""What the settings table gives: each entry's click option, variable, YAML key, Ray
field and docs row, the dashboard's one default port, and ``export_streams`` as one
typed value that crosses the aggregator protocol whole."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import attrs
import click
import orjson
import pytest

from traceml_ai import settings
from traceml_ai._converter import StructureError
from traceml_ai.aggregator.protocol import AggregatorLaunchConfig
from traceml_ai.cli import main as cli_main
from traceml_ai.integrations._ray_config import TraceMLRayConfig
from traceml_ai.launch.commands import run as run_command
from traceml_ai.launch.commands import serve as serve_command
from traceml_ai.settings import (
    DEFAULT_DASHBOARD_PORT,
    DEFAULT_SERVE_PORT,
    SETTINGS,
    ExportSettings,
    ExportStreams,
    MonitorSettings,
    Setting,
    resolve_launch_settings,
)
from traceml_ai.settings.__main__ import main as docs_main

REPO = Path(__file__).resolve().parents[3]

# A good value (as text) and a bad one of every setting, by kind of parser.
GOOD_TEXT: dict[str, str] = {
    "exporter": "jsonl",
    "export_streams": "process, step_time",
    "exporter_hostname": "yes",
    "logs_dir": "some/where",
    "run_name": "my-run",
    "interval": "0.5",
    "finalize_timeout_sec": "3",
    "aggregator_host": "10.0.0.2",
    "aggregator_port": "4242",
    "aggregator_bind_host": "0.0.0.0",
    "nnodes": "2",
    "nproc_per_node": "4",
    "node_relay": "off",
    "relay": "10.0.0.1:29600",
    "prometheus_port": "9100",
    "prometheus_bind_host": "0.0.0.0",
    "rank_series_max_ranks": "0",
    "otlp": "on",
    "otlp_trace_sample": "7",
    "dashboard": "1",
    "dashboard_port": "9999",
    "dashboard_bind_host": "0.0.0.0",
    "trackers": "TensorBoard, mlflow",
    "tracker_every_steps": "10",
    "parallel": "tp=2, dp=4",
}
BAD_TEXT: dict[str, str] = {
    "exporter": "csv",
    "export_streams": "gpu",
    "exporter_hostname": "maybe",
    "logs_dir": "",
    "run_name": "",
    "interval": "0",
    "finalize_timeout_sec": "-1",
    "aggregator_host": "a b",
    "aggregator_port": "70000",
    "aggregator_bind_host": "",
    "nnodes": "0",
    "nproc_per_node": "x",
    "node_relay": "sometimes",
    "relay": "10.0.0.1",
    "prometheus_port": "-5",
    "prometheus_bind_host": " ",
    "rank_series_max_ranks": "-1",
    "otlp": "2",
    "otlp_trace_sample": "0",
    "dashboard": "nope",
    "dashboard_port": "65536",
    "dashboard_bind_host": "",
    "trackers": "tensorboard,neptune",
    "tracker_every_steps": "0",
    "parallel": "tp=0",
}


def test_every_setting_has_test_values() -> None:
    assert set(GOOD_TEXT) == set(BAD_TEXT) == {s.name for s in SETTINGS}


def _options(command: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in command.params if isinstance(p, click.Option) and p.name}


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_each_setting_is_a_click_option_of_its_commands(setting: Setting[object]) -> None:
    for name, command in (("run", run_command), ("serve", serve_command)):
        if name not in setting.commands:
            if name == "serve":  # run has torchrun's own --nnodes, --nproc-per-node
                assert setting.name not in _options(command)
            continue
        option = _options(command)[setting.name]
        assert option.default is None  # not given: the lower layers decide
        assert setting.flag in option.opts
        if setting.is_switch:
            assert option.secondary_opts == ["--no-" + setting.flag[2:]]
        else:
            assert option.metavar == setting.metavar
        assert option.help is not None
        assert setting.env in option.help and setting.yaml_key in option.help
        assert f"default: {setting.doc_default};" in option.help


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
@pytest.mark.parametrize("layer", ["flag", "env", "yaml"])
def test_each_setting_is_read_from_each_layer(
    tmp_path: Path, setting: Setting[object], layer: str
) -> None:
    command = setting.commands[-1]
    good, bad = GOOD_TEXT[setting.name], BAD_TEXT[setting.name]
    yaml_path = tmp_path / "traceml.yaml"
    yaml_path.write_text("{}\n")

    def resolve(text: str) -> settings.LaunchSettings:
        cli: dict[str, object] = {}
        environ: dict[str, str] = {}
        if layer == "flag":
            cli[setting.name] = text
        elif layer == "env":
            environ[setting.env] = text
        else:
            yaml_path.write_text(f"{setting.yaml_key}: {orjson.dumps(text).decode()}\n")
        return resolve_launch_settings(command, cli, environ=environ, yaml_path=yaml_path)

    resolved = resolve(good)
    expected_source = {"flag": setting.flag, "env": setting.env}.get(layer)
    source = resolved.sources[setting.name]
    assert source == expected_source if expected_source else source.startswith("traceml.yaml (")
    assert resolved.sources[setting.name] != settings.SOURCE_DEFAULT
    with pytest.raises(settings.SettingsError) as info:
        resolve(bad)
    label = {"flag": setting.flag, "env": setting.env}.get(layer, f": {setting.yaml_key}")
    assert label in str(info.value)


def test_defaults_of_the_typed_objects_are_the_table() -> None:
    by_name = settings.SETTINGS_BY_NAME
    for field in attrs.fields(MonitorSettings):
        assert field.default == by_name[field.name].default, field.name
    for field in attrs.fields(ExportSettings):
        assert field.default == by_name[field.name].default, field.name
    launch = resolve_launch_settings("serve", {}, environ={}, yaml_path=Path("/nonexistent"))
    assert launch.logs_dir == settings.LOGS_DIR.default
    assert launch.interval == settings.INTERVAL.default
    assert launch.finalize_timeout_sec == settings.FINALIZE_TIMEOUT_SEC.default
    assert launch.aggregator_bind_host == settings.AGGREGATOR_BIND_HOST.default


# --- TraceMLRayConfig ---------------------------------------------------------------------


def _ray_fields() -> dict[str, attrs.Attribute[Any]]:
    return {f.name: f for f in attrs.fields(TraceMLRayConfig)}


@pytest.mark.parametrize("setting", settings.ray_settings(), ids=lambda s: s.name)
def test_each_ray_setting_is_a_ray_field_with_the_tables_default(setting: Setting[object]) -> None:
    assert setting.ray is not None
    field = _ray_fields()[setting.ray]
    assert field.metadata["setting"] == setting.name
    assert field.default == setting.ray_field_default
    assert getattr(TraceMLRayConfig(), setting.ray) == setting.ray_field_default


def test_every_ray_field_of_a_setting_is_in_the_table() -> None:
    from_table = {s.ray for s in settings.ray_settings()}
    tagged = {name for name, f in _ray_fields().items() if "setting" in f.metadata}
    assert tagged == from_table
    # A field the table does not know (0.5.0's, Ray's own) carries no setting.
    assert {"mode", "profile", "init_mode"} <= set(_ray_fields()) - from_table


# A value of the right kind that the table's parser refuses, and one of another kind.
RAY_BAD: dict[str, tuple[object, object]] = {
    "logs_dir": ("", 3),
    "sampler_interval_sec": (0.0, "2"),
    "finalize_timeout_sec": (float("inf"), True),
    "bind_host": ("a b", None),
    "port": (70000, 1.5),
    "prometheus_port": (-1, "9100"),
    "prometheus_bind_host": (" ", 0),
    "rank_series_max_ranks": (-1, "64"),
    "otlp": ("yes", 1),
    "otlp_trace_sample": (0, True),
    "dashboard_port": (65536, "8765"),
    "dashboard_bind_host": ("", None),
    "trackers": ("neptune", ["mlflow"]),
    "tracker_every_steps": (0, "100"),
    "parallel": ("tp=2,tp=2", 4),
}


@pytest.mark.parametrize("field", sorted(RAY_BAD))
def test_ray_fields_are_checked_by_the_table(field: str) -> None:
    for value in RAY_BAD[field]:
        with pytest.raises(ValueError) as info:
            TraceMLRayConfig(**{field: value})
        assert str(info.value).startswith(f"TraceMLRayConfig.{field}: "), info.value
    ray_names = {s.ray for s in settings.ray_settings()}
    assert field in ray_names


def test_ray_fields_keep_their_messages() -> None:
    with pytest.raises(ValueError) as info:
        TraceMLRayConfig(port=70000)
    assert str(info.value) == (
        "TraceMLRayConfig.port: expected an integer in [0, 65535] (0 picks a free port), got 70000"
    )
    with pytest.raises(ValueError) as info:
        TraceMLRayConfig(otlp="yes")  # type: ignore[arg-type]
    assert str(info.value) == "TraceMLRayConfig.otlp: expected a boolean, got 'yes'"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "tracker_every_steps",
            99999999999999999999999,
            "expected a whole number from 1 to 2147483647, got 99999999999999999999999",
        ),
        (
            "finalize_timeout_sec",
            1e300,
            "expected a positive number of seconds up to a year (31536000), got 1e+300",
        ),
        (
            "sampler_interval_sec",
            float("nan"),
            "expected a positive number of seconds, got nan",
        ),
    ],
)
def test_a_ray_value_past_its_bound_is_one_error_naming_it(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError) as info:
        TraceMLRayConfig(**{field: value})
    assert str(info.value) == f"TraceMLRayConfig.{field}: {message}"


def test_the_ray_config_parses_its_settings_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from traceml_ai.settings import _parse

    calls: list[object] = []
    parse = _parse.parse_export_streams

    def counting(text: object) -> tuple[str, ...]:
        calls.append(text)
        return parse(text)

    monkeypatch.setattr(_parse, "parse_export_streams", counting)
    config = TraceMLRayConfig(exporter="jsonl", export_streams="step_time,process")
    made = len(calls)
    assert made >= 1
    for _ in range(3):
        assert config.export_settings.export_streams.selected == ("step_time", "process")
        assert config.export_enabled
        assert config.resolved_settings().selected_streams == ("step_time", "process")
        assert config.monitor_settings.tracker_every_steps == 100
    assert len(calls) == made
    assert config.monitor_settings is config.monitor_settings


def test_stop_timeout_sec_is_finalize_timeout_secs_former_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import warnings

    from traceml_ai.integrations import _ray_config

    monkeypatch.setattr(_ray_config, "_warned_stop_timeout_sec", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = TraceMLRayConfig(stop_timeout_sec=5.0)  # type: ignore[call-arg]
        again = TraceMLRayConfig(stop_timeout_sec=5.0)  # type: ignore[call-arg]
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in caught]
    assert "finalize_timeout_sec" in str(deprecations[0].message)
    assert deprecations[0].filename == __file__
    assert config.finalize_timeout_sec == 5.0 == config.stop_timeout_sec
    assert config == again == TraceMLRayConfig(finalize_timeout_sec=5.0)
    assert "stop_timeout_sec" not in config.to_mapping()
    assert "_stop_timeout_sec" not in config.to_mapping()
    assert config.to_mapping()["finalize_timeout_sec"] == 5.0
    assert TraceMLRayConfig.from_mapping({"stop_timeout_sec": 3.0}).finalize_timeout_sec == 3.0
    with pytest.raises(ValueError, match=r"^TraceMLRayConfig.stop_timeout_sec: expected a pos"):
        TraceMLRayConfig(stop_timeout_sec=-1.0)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="give finalize_timeout_sec only"):
        TraceMLRayConfig(finalize_timeout_sec=3.0, stop_timeout_sec=5.0)  # type: ignore[call-arg]


# --- one default dashboard port -------------------------------------------------------------


@pytest.mark.parametrize("port", [DEFAULT_DASHBOARD_PORT, DEFAULT_SERVE_PORT])
def test_the_default_ports_are_spelled_once(port: int) -> None:
    spelled = [
        path.relative_to(REPO).as_posix()
        for path in (REPO / "src" / "traceml_ai").rglob("*.py")
        if re.search(rf"\b{port}\b", path.read_text(encoding="utf-8"))
    ]
    assert spelled == ["src/traceml_ai/_ports.py"]
    dashboard = cli_main.commands["dashboard"]
    assert _options(dashboard)["port"].default == DEFAULT_DASHBOARD_PORT
    assert MonitorSettings().dashboard_port == DEFAULT_DASHBOARD_PORT
    assert TraceMLRayConfig().dashboard_port == DEFAULT_DASHBOARD_PORT


# --- the docs --------------------------------------------------------------------------------


def test_docs_table_check_and_rewrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert docs_main(["--check", "--root", str(REPO)]) == 0
    doc = tmp_path / "docs" / "live-export.md"
    doc.parent.mkdir()
    shutil.copy(REPO / "docs" / "live-export.md", doc)
    doc.write_text(doc.read_text().replace("| `otlp` |", "| `otlp_old` |"))
    assert docs_main(["--check", "--root", str(tmp_path)]) == 1
    assert "stale" in capsys.readouterr().out
    assert docs_main(["--root", str(tmp_path)]) == 0
    assert doc.read_text() == (REPO / "docs" / "live-export.md").read_text()


# --- export_streams: one typed value, whole across the protocol ------------------------------


def test_export_streams_is_parsed_into_one_typed_value() -> None:
    value = ExportStreams.parse(" system, step_time ")
    assert value.text == "system, step_time"
    assert value.selected == ("step_time", "system", "system_gpu")
    assert value == ExportStreams.parse("step_time,system")  # the same selection
    assert ExportSettings(export_streams="all").export_streams.selected[-1] == "collectives"
    with pytest.raises(ValueError, match="unknown stream 'gpu'; supported: "):
        ExportSettings(export_streams="gpu")


def test_export_settings_cross_the_aggregator_protocol_whole() -> None:
    export = ExportSettings("jsonl", "system, step_time", True)
    config = AggregatorLaunchConfig(run_dir="/r", export=export)
    data = orjson.loads(config.to_json())
    assert data["export"] == {
        "exporter": "jsonl",
        "export_streams": "system, step_time",
        "exporter_hostname": True,
    }
    assert not {"exporter", "export_streams", "exporter_hostname"} & set(data)
    back = AggregatorLaunchConfig.from_json(config.to_json())
    assert back == config
    assert back.export.export_streams.selected == ("step_time", "system", "system_gpu")
    assert isinstance(back.export.export_streams, ExportStreams)


@pytest.mark.parametrize(
    ("streams", "problem"),
    [
        ("step_time,gpu", "unknown stream 'gpu'; supported: "),
        (["step_time"], "expected a string, got list"),
    ],
)
def test_the_aggregator_refuses_bad_streams_with_the_path(streams: object, problem: str) -> None:
    data = {"run_dir": "/r", "export": {"exporter": "", "export_streams": streams}}
    with pytest.raises(StructureError) as info:
        AggregatorLaunchConfig.from_json(orjson.dumps(data).decode())
    assert problem in str(info.value)
    assert "at $.export.export_streams" in str(info.value)
