"""The cold-path boundary classes and the one converter (traceml_ai._converter).

Launcher <-> aggregator config and events round-trip through the converter; unknown
keys and values of the wrong kind are refused with one readable message that names
each problem and its ``$.path``; an aggregator process given a config it cannot read
says so as a ``failed`` event instead of a traceback.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import attrs
import orjson
import pytest

from traceml_ai._converter import StructureError, dumps, loads, structure, unstructure
from traceml_ai.aggregator.protocol import (
    AggregatorLaunchConfig,
    FailedEvent,
    FinalizedEvent,
    ReadyEvent,
    dump_event,
    parse_event,
)
from traceml_ai.settings import ExportSettings


def _config(**changes: Any) -> dict[str, Any]:
    base = AggregatorLaunchConfig(
        run_dir="/tmp/run",
        export=ExportSettings(exporter="jsonl", export_streams="step_time"),
        expected_world_size=2,
        parent_pid=123,
    )
    return {**unstructure(base), **changes}


def test_config_round_trips() -> None:
    config = AggregatorLaunchConfig.from_json(orjson.dumps(_config()).decode())
    assert AggregatorLaunchConfig.from_json(config.to_json()) == config
    assert orjson.loads(config.to_json())["finalize_timeout_sec"] == 10.0


def test_config_defaults_fill_what_the_launcher_leaves_out() -> None:
    minimal = {
        "run_dir": "/r",
        "export": {"exporter": "", "export_streams": "all", "exporter_hostname": True},
    }
    config = AggregatorLaunchConfig.from_json(orjson.dumps(minimal).decode())
    assert (config.bind_host, config.port, config.parent_pid) == ("127.0.0.1", 0, None)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"prot": 1}, "unknown key 'prot' at $.prot; known keys: run_dir, export,"),
        ({"port": "29500"}, "expected an integer, got str '29500' at $.port"),
        ({"port": True}, "expected an integer, got bool True at $.port"),
        (
            {"export": {"exporter": "", "export_streams": "all", "exporter_hostname": "false"}},
            "expected a boolean, got str 'false' at $.export.exporter_hostname",
        ),
        (
            {"finalize_timeout_sec": None},
            "expected a number, got NoneType None at $.finalize_timeout_sec",
        ),
    ],
)
def test_config_refuses_with_the_path(changes: dict[str, Any], problem: str) -> None:
    with pytest.raises(StructureError) as info:
        AggregatorLaunchConfig.from_json(orjson.dumps(_config(**changes)).decode())
    message = str(info.value)
    assert message.startswith("aggregator config: ") and problem in message
    assert "\n" not in message


def test_a_missing_key_and_a_bad_value_are_both_named() -> None:
    raw = _config(port=1.5)
    del raw["run_dir"]
    with pytest.raises(StructureError) as info:
        AggregatorLaunchConfig.from_json(orjson.dumps(raw).decode())
    assert info.value.problems == (
        "required key missing at $.run_dir",
        "expected an integer, got float 1.5 at $.port",
    )


@pytest.mark.parametrize(
    "event",
    [
        ReadyEvent(host="127.0.0.1", port=29600, pid=42),
        FailedEvent(error="cannot listen on 0.0.0.0:1: denied"),
        FinalizedEvent(
            written_records=7,
            exporter_failed=False,
            warning=None,
            missing_ranks=(1, 3),
            rejected_frames=0,
            ranks_heard=True,
        ),
    ],
)
def test_events_round_trip(event: Any) -> None:
    line = dump_event(event)
    assert "\n" not in line and orjson.loads(line)["event"] == event.event
    assert parse_event(line) == event
    assert parse_event(line.encode()) == event


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (b"not json", "not JSON"),
        (b"[1]", "not a known event (None) at $.event"),
        (b'{"event": "bogus"}', "not a known event ('bogus') at $.event"),
        (b'{"event": "ready", "host": "h", "port": 1}', "required key missing at $.pid"),
        (b'{"event": "ready", "host": "h", "port": 1, "pid": 2, "x": 0}', "unknown key 'x' at $.x"),
    ],
)
def test_bad_event_lines_are_refused(line: bytes, problem: str) -> None:
    with pytest.raises(StructureError) as info:
        parse_event(line)
    assert problem in str(info.value)


@attrs.frozen(kw_only=True)
class Inner:
    n: int


@attrs.frozen(kw_only=True)
class Outer:
    inner: Inner
    items: tuple[int, ...] = ()


def test_nested_paths_and_top_level_shape() -> None:
    assert structure({"inner": {"n": 1}, "items": [2]}, Outer, what="x") == Outer(
        inner=Inner(n=1), items=(2,)
    )
    with pytest.raises(StructureError, match=r"unknown key 'm' at \$\.inner\.m; known keys: n"):
        structure({"inner": {"n": 1, "m": 2}}, Outer, what="x")
    with pytest.raises(StructureError, match=r"got str 'a' at \$\.items\[1\]"):
        structure({"inner": {"n": 1}, "items": [1, "a"]}, Outer, what="x")
    with pytest.raises(StructureError, match=r"^x: expected a mapping, got a list at \$$"):
        structure([], Outer, what="x")
    with pytest.raises(StructureError, match="not JSON"):
        loads(b"{", Outer, what="x")
    assert orjson.loads(dumps(Outer(inner=Inner(n=1)), indent=True)) == {
        "inner": {"n": 1},
        "items": [],
    }


def test_the_aggregator_reports_a_config_it_cannot_read_as_a_failed_event() -> None:
    bad = orjson.dumps(_config(prot=1)).decode()
    res = subprocess.run(
        [sys.executable, "-m", "traceml_ai.aggregator", bad],
        env={"TRACEML_RUN_TOKEN": "t", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    event = parse_event(res.stdout.splitlines()[0])
    assert isinstance(event, FailedEvent)
    assert "unknown key 'prot' at $.prot" in event.error
    assert b"Traceback" not in res.stderr


def test_stats_json_reads_back_as_its_class(tmp_path: Any) -> None:
    from traceml_ai.aggregator import Aggregator, AggregatorConfig
    from traceml_ai.aggregator.protocol import AggregatorStatsFile
    from traceml_ai.settings import ExportSettings

    run_dir = tmp_path / "run"
    aggregator = Aggregator(
        AggregatorConfig(run_dir=run_dir, settings=ExportSettings("jsonl", "all", False), token="t")
    )
    aggregator.start()
    aggregator.finalize()
    data = (run_dir / "aggregator" / "stats.json").read_bytes()
    stats = AggregatorStatsFile.from_json(data)  # every key of the file is declared
    assert stats.written_records["step_time"] == 0 and not stats.exporter_failed
    assert stats.to_json() == data


def test_ray_config_from_plain_data() -> None:
    from traceml_ai.integrations._ray_config import TraceMLRayConfig

    config = TraceMLRayConfig.from_mapping({"exporter": "jsonl", "port": 29600})
    assert config == TraceMLRayConfig(exporter="jsonl", port=29600)
    assert TraceMLRayConfig.from_mapping(config.to_mapping()) == config
    with pytest.raises(ValueError) as info:
        TraceMLRayConfig.from_mapping({"exporter": "jsonl", "exporter_hostnme": True})
    # The known keys are the config's fields, in their order.
    known = ", ".join(f.name for f in attrs.fields(TraceMLRayConfig))
    assert known.startswith("exporter, export_streams, exporter_hostname, logs_dir, ")
    assert str(info.value) == (
        "TraceMLRayConfig: unknown key 'exporter_hostnme' at $.exporter_hostnme; known keys: "
        + known
    )
    with pytest.raises(ValueError, match=r"expected an integer, got str '8' at \$\.port"):
        TraceMLRayConfig.from_mapping({"port": "8"})
    # The field validators still speak for the values themselves.
    with pytest.raises(ValueError, match=r"TraceMLRayConfig\.port: expected an integer in"):
        TraceMLRayConfig.from_mapping({"port": 70000})
    with pytest.raises(ValueError, match="unknown stream"):
        TraceMLRayConfig.from_mapping({"export_streams": "bogus"})


def test_ray_export_summary_is_the_dict_users_read() -> None:
    from traceml_ai._converter import structure, unstructure
    from traceml_ai.aggregator.protocol import RayExportSummary

    summary = RayExportSummary(
        written_records=12,
        written_by_stream={"step_time": 10, "process": 2},
        dropped_batches=0,
        exporter_failed=False,
        finished_ranks=[0, 1],
        missing_ranks=[],
        warning_path=None,
    )
    plain = unstructure(summary)
    assert plain["written_records"] == 12 and plain["finished_ranks"] == [0, 1]
    assert structure(plain, RayExportSummary, what="summary") == summary
    with pytest.raises(ValueError, match="written_records"):
        structure({**plain, "written_records": "12"}, RayExportSummary, what="summary")
