"""``traceml.init()`` again after ``shutdown()`` in one process (issue 10, item 4): step
numbers and every stream's ``seq`` go on, so no key repeats and ``traceml validate``
accepts the project's own output."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import orjson
import pytest

import traceml_ai as traceml
from tests.e2e_helpers import (
    clean_env,
    data_lines,
    export_dir,
    run_cli,
    traceml_cmd,
    warning_file,
)
from tests.traceml_ai.rank.conftest import once
from traceml_ai.rank._runtime import sdk

pytestmark = pytest.mark.slow  # real runs, subprocesses or receivers (docs/testing.md)

_REINIT_SCRIPT = textwrap.dedent(
    """
    import time
    import traceml_ai as traceml

    for _ in range(3):
        traceml.init()
        for _ in range(4):
            with traceml.trace_step():
                time.sleep(0.06)
        traceml.shutdown()
    """
)


@once  # the ranks are children
def test_init_after_shutdown_goes_on_counting(tmp_path: Path) -> None:
    script = tmp_path / "reinit.py"
    script.write_text(_REINIT_SCRIPT)
    logs = tmp_path / "logs"
    args = [
        "run",
        "--logs-dir",
        logs,
        "--run-name",
        "reinit",
        "--interval",
        "0.1",
        "--exporter",
        "jsonl",
        "--export-streams",
        "all",
        "--nproc-per-node",
        "2",
        script,
    ]
    res = subprocess.run(
        traceml_cmd(*args),
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert warning_file(logs, "reinit") is None
    folder = export_dir(logs, "reinit")
    steps = data_lines(folder / "step_time.jsonl")
    for rank in (0, 1):
        mine = [d["step"] for d in steps if d["global_rank"] == rank]
        assert sorted(mine) == list(range(1, 13)), (rank, mine)
    memory = data_lines(folder / "step_memory.jsonl")
    assert len({(d["global_rank"], d["step"], d["device"]) for d in memory}) == len(memory) == 24
    for stream in ("step_time", "step_memory", "process"):
        seqs: dict[int, list[int]] = {}
        for d in data_lines(folder / f"{stream}.jsonl"):
            seqs.setdefault(d["global_rank"], []).append(d["seq"])
        for rank, values in seqs.items():
            # In file order, and without a repeat, across the three runtimes.
            assert values == sorted(set(values)), (stream, rank, values)
    # Three runtimes each took samples: the system sampler (local rank 0) went on too.
    system = data_lines(folder / "system.jsonl")
    system_seqs = [d["seq"] for d in system]
    assert system_seqs == sorted(set(system_seqs)) and len(system_seqs) >= 3
    check = run_cli(["validate", logs / "reinit"], cwd=tmp_path, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


class _ListSink:
    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, object]]] = []

    def put(self, stream: str, item: dict[str, object]) -> None:
        self.items.append((stream, item))


def test_counters_continue_in_process() -> None:
    sdk.reset_for_tests()
    try:
        first, second = _ListSink(), _ListSink()
        traceml.init(sink=first, sampler_interval=60)
        for _ in range(2):
            with traceml.trace_step():
                pass
        traceml.shutdown()
        traceml.init(sink=second, sampler_interval=60)
        with traceml.trace_step():
            pass
        traceml.shutdown()
        for stream in ("step_time", "step_memory", "process", "runtime_environment"):
            a = [i["seq"] for s, i in first.items if s == stream]
            b = [i["seq"] for s, i in second.items if s == stream]
            assert a and b, stream
            assert b[0] == a[-1] + 1, (stream, a, b)
        assert [i["step"] for s, i in second.items if s == "step_time"] == [3]
        assert orjson.dumps([i for _, i in second.items])
    finally:
        sdk.reset_for_tests()
