"""The live dashboard of an in-process monitoring, over real HTTP on the loopback: what
its responses and its terminal lines say."""

from __future__ import annotations

import shlex
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from traceml_ai.dashboard import start_live_dashboard
from traceml_ai.monitor import start_monitoring
from traceml_ai.monitor._service import RunInfo
from traceml_ai.monitor.metrics import Health
from traceml_ai.settings import MonitorSettings
from traceml_ai.transport.wire import ReceivedBatch

ODD_FOLDER = 'it\'s my "run" $HOME'
"""A run name a shell would split, expand and choke on unless it is quoted."""


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return orjson.loads(response.read())


def _step_batch(rank: int) -> ReceivedBatch:
    timing = {"cpu": {"cpu_ms": 5.0, "duration_ms": 5.0, "gpu_ms": None, "is_gpu": False,
                      "n_calls": 1}}  # fmt: skip
    items = [{"seq": 0, "step": 1, "timestamp_unix_ns": 10**18,
              "events": {"_traceml_internal:step_time": timing}}]  # fmt: skip
    identity = {"global_rank": rank, "local_rank": rank, "world_size": 1, "local_world_size": 1,
                "node_rank": 0, "pid": 1, "hostname": "h"}  # fmt: skip
    body = orjson.dumps({"v": 1, "token": "t", "type": "batch", "stream": "step_time",
                         "identity": identity, "items": items})  # fmt: skip
    return ReceivedBatch(observed_timestamp_unix_ns=1, payload=body, nbytes=len(body))


def _command_in(line: str, start: str, end: str) -> list[str]:
    """The shell words of the command between ``start`` and ``end`` in ``line``."""
    at = line.index(start)
    return shlex.split(line[at : line.index(end, at)])


def test_commands_name_the_run_folder_quoted_for_a_shell(tmp_path: Path) -> None:
    run_dir = tmp_path / ODD_FOLDER
    (run_dir / "aggregator" / "export").mkdir(parents=True)
    lines: list[str] = []
    monitoring = start_monitoring(
        MonitorSettings(dashboard=True, dashboard_port=0),
        RunInfo(run_dir=run_dir, run_name=ODD_FOLDER, host="h"),
        Health,
        sinks={"dashboard": start_live_dashboard},
        report=lines.append,
    )
    assert monitoring is not None
    try:
        monitoring.submit(_step_batch(0))
        deadline = time.monotonic() + 5
        while not any(r.steps for r in monitoring.state.ranks()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        monitoring.finish(Health())
        (sink,) = monitoring.sinks
        view = _get(sink.url + "api/view")  # type: ignore[attr-defined]
    finally:
        monitoring.close(2.0)
    want = ["traceml", "dashboard", str(run_dir)]
    assert shlex.split(view["identity"]["files_command"]) == want
    (finalized,) = [line for line in view["loss"]["lines"] if "has finalized" in line]
    assert shlex.split(finalized[finalized.index("traceml dashboard") :]) == want
    (stopped,) = [line for line in lines if "stopped with the run" in line]
    assert _command_in(stopped, "traceml dashboard", " shows it") == want
