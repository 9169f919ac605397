"""Loss accounting: what a rank's sender drops shows in the closing lines, the warning's
export block and stats.json (issue 10, item 1).

The in-process tests drive a real :class:`Aggregator` over loopback with hand-written
frames or a real :class:`RankSender`; the end-to-end test freezes the aggregator process
of a real ``traceml run`` so that real ranks drop.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from tests.e2e_helpers import (
    clean_env,
    closing_line,
    data_lines,
    export_dir,
    has_data_line,
    read_lines,
    traceml_cmd,
    wait_for,
    warning_file,
)
from traceml_ai.aggregator import Aggregator, AggregatorConfig
from traceml_ai.settings import ExportSettings
from traceml_ai.transport.sender import RankSender
from traceml_ai.transport.wire import (
    FrameError,
    decode_message,
    encode_frame,
    make_batch_message,
    make_finished_message,
)

pytestmark = pytest.mark.slow  # real runs, subprocesses or receivers (docs/testing.md)

TOKEN = "loss-accounting-token"


def _identity(rank: int = 0, world: int = 1) -> dict[str, object]:
    return {
        "global_rank": rank,
        "local_rank": rank,
        "world_size": world,
        "local_world_size": world,
        "node_rank": 0,
        "hostname": None,
        "pid": os.getpid(),
    }


def _step_item(i: int) -> dict[str, Any]:
    timing = {"cpu_ms": 1.0, "duration_ms": 1.0, "gpu_ms": None, "is_gpu": False, "n_calls": 1}
    return {
        "timestamp_unix_ns": time.time_ns(),
        "seq": i,
        "step": i + 1,
        "events": {"_traceml_internal:step_time": {"cpu": timing}},
    }


def _start(tmp_path: Path, streams: str = "step_time", world: int = 1) -> Aggregator:
    agg = Aggregator(
        AggregatorConfig(
            run_dir=tmp_path / "run",
            settings=ExportSettings("jsonl", streams, False),
            token=TOKEN,
            expected_world_size=world,
            finalize_timeout_sec=5.0,
        )
    )
    agg.start()
    return agg


def _send(agg: Aggregator, *messages: dict[str, Any]) -> None:
    address = agg.address
    assert address is not None
    server = agg._server
    assert server is not None
    expected = server.finished_messages + sum(m["type"] == "finished" for m in messages)
    with socket.create_connection(address) as sock:
        for message in messages:
            sock.sendall(encode_frame(message))
    deadline = time.monotonic() + 10.0
    while server.finished_messages < expected:
        assert time.monotonic() < deadline, "the aggregator did not read every frame"
        time.sleep(0.01)


def _closing_dropped(run_dir: Path) -> set[int]:
    values = set()
    for path in (run_dir / "aggregator" / "export").glob("*.jsonl"):
        last = orjson.loads(path.read_bytes().splitlines()[-1])
        assert last.get("closing") is True, path
        values.add(last["dropped_batches"])
    return values


def _warning(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "finalization_warning.json"
    return orjson.loads(path.read_bytes()) if path.exists() else None


def _stats(run_dir: Path) -> dict[str, Any]:
    return orjson.loads((run_dir / "aggregator" / "stats.json").read_bytes())


def test_finished_drops_show_in_closing_lines_warning_and_stats(tmp_path: Path) -> None:
    agg = _start(tmp_path)
    ident = _identity()
    _send(
        agg,
        make_batch_message(TOKEN, ident, "step_time", [_step_item(i) for i in range(5)]),
        make_finished_message(TOKEN, ident, 1, 3, {"step_time": 3}),
    )
    assert agg.wait_all_finished(10.0)
    result = agg.finalize()
    run_dir = tmp_path / "run"
    assert _closing_dropped(run_dir) == {3}
    warning = _warning(run_dir)
    assert warning is not None and warning["reason"] == "export_incomplete"
    assert warning["export"]["dropped_batches"] == 3
    assert warning["export"]["written_records"] == 5
    assert _stats(run_dir)["dropped_batches"] == 3
    assert result.stats is not None and result.stats.dropped_batches == 3


def test_batches_a_rank_sent_that_never_arrived_are_counted(tmp_path: Path) -> None:
    # The rank's socket took 4 batches (sent_batches 4) but only 2 reached the
    # aggregator (a connection that died with two unread): 2 dropped, not silence.
    agg = _start(tmp_path)
    ident = _identity()
    _send(
        agg,
        make_batch_message(TOKEN, ident, "step_time", [_step_item(0)]),
        make_batch_message(TOKEN, ident, "step_time", [_step_item(1)]),
        make_finished_message(TOKEN, ident, 4, 0, {}),
    )
    assert agg.wait_all_finished(10.0)
    agg.finalize()
    run_dir = tmp_path / "run"
    assert _closing_dropped(run_dir) == {2}
    warning = _warning(run_dir)
    assert warning is not None and warning["export"]["dropped_batches"] == 2


def test_every_batch_sent_arrived_is_no_loss(tmp_path: Path) -> None:
    agg = _start(tmp_path)
    ident = _identity()
    _send(
        agg,
        make_batch_message(TOKEN, ident, "step_time", [_step_item(0)]),
        make_batch_message(TOKEN, ident, "step_time", [_step_item(1)]),
        make_finished_message(TOKEN, ident, 2, 0, {}),
    )
    assert agg.wait_all_finished(10.0)
    agg.finalize()
    assert _closing_dropped(tmp_path / "run") == {0}
    assert _warning(tmp_path / "run") is None


def test_drops_of_streams_not_selected_are_no_loss(tmp_path: Path) -> None:
    agg = _start(tmp_path, streams="step_time")
    ident = _identity()
    _send(
        agg,
        make_batch_message(TOKEN, ident, "step_time", [_step_item(0)]),
        make_finished_message(TOKEN, ident, 1, 2, {"stdout_stderr": 1, "process": 1}),
    )
    agg.finalize()
    run_dir = tmp_path / "run"
    assert _closing_dropped(run_dir) == {0}
    assert _warning(run_dir) is None


def test_system_selects_the_system_batch_stream(tmp_path: Path) -> None:
    # Selecting ``system`` selects the system and system_gpu files, both built from
    # ``system`` batches.
    agg = _start(tmp_path, streams="system")
    ident = _identity()
    _send(agg, make_finished_message(TOKEN, ident, 0, 4, {"system": 2, "step_time": 2}))
    agg.finalize()
    assert _closing_dropped(tmp_path / "run") == {2}


def test_repeated_finished_of_a_rank_counts_its_drops_once(tmp_path: Path) -> None:
    agg = _start(tmp_path, world=2)
    # Rank 0 reports twice (reconnected, or init again after shutdown: counts only
    # grow); rank 1 reports once. Per rank the largest count stands: 5 + 2.
    _send(
        agg,
        make_finished_message(TOKEN, _identity(0, 2), 0, 4, {"step_time": 4}),
        make_finished_message(TOKEN, _identity(0, 2), 0, 5, {"step_time": 5}),
        make_finished_message(TOKEN, _identity(1, 2), 0, 2, {"step_time": 2}),
        make_finished_message(TOKEN, _identity(0, 2), 0, 5, {"step_time": 5}),
    )
    agg.finalize()
    run_dir = tmp_path / "run"
    assert _closing_dropped(run_dir) == {7}
    warning = _warning(run_dir)
    assert warning is not None and warning["export"]["dropped_batches"] == 7


def test_finished_without_split_counts_every_drop(tmp_path: Path) -> None:
    # A sender that does not split its drops by stream: all of them may be selected.
    agg = _start(tmp_path)
    _send(agg, make_finished_message(TOKEN, _identity(), 0, 6))
    agg.finalize()
    assert _closing_dropped(tmp_path / "run") == {6}


def test_real_sender_put_drops_become_whole_batches(tmp_path: Path) -> None:
    """A sender whose queue holds 5 items, fed 50 step_time items while it is not started:
    45 are refused one by one by ``put`` and count as whole dropped batches."""
    agg = _start(tmp_path)
    address = agg.address
    assert address is not None
    sender = RankSender(address, TOKEN, _identity(), max_pending_items=5, max_items_per_batch=10)
    for i in range(50):
        sender.put("step_time", _step_item(i))
    sender.start()
    sender.close(timeout=5.0)
    assert agg.wait_all_finished(10.0)
    agg.finalize()
    run_dir = tmp_path / "run"
    lines = (run_dir / "aggregator" / "export" / "step_time.jsonl").read_bytes().splitlines()
    assert len(lines) == 6  # 5 data lines and the closing line
    # 45 items refused at once, 10 to a batch: 5 whole batches.
    assert sender.dropped_batches == sender.dropped_batches_by_stream["step_time"] == 5
    assert _closing_dropped(run_dir) == {5}
    warning = _warning(run_dir)
    assert warning is not None and warning["export"]["dropped_batches"] == 5
    assert _stats(run_dir)["dropped_batches"] == 5


def test_decode_checks_the_split_counts() -> None:
    ident = _identity()
    ok = make_finished_message(TOKEN, ident, 1, 3, {"step_time": 2, "system": 1})
    assert decode_message(orjson.dumps(ok), TOKEN)["dropped_batches_by_stream"] == {
        "step_time": 2,
        "system": 1,
    }
    for bad in (
        {"step_time": 4},  # more than the total
        {"nope": 1},
        {"step_time": -1},
        {"step_time": True},
        [1],
    ):
        message = {**make_finished_message(TOKEN, ident, 1, 3), "dropped_batches_by_stream": bad}
        with pytest.raises(FrameError):
            decode_message(orjson.dumps(message), TOKEN)


# --------------------------------------------------------------------------- end to end

_FAST_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import traceml_ai as traceml
    from traceml_ai.rank._runtime import sdk

    stop, out = Path(sys.argv[1]), Path(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    traceml.init()
    sender = sdk._runtime.sender
    dropped = out / f"dropped.{rank}"
    steps = 0
    deadline = time.monotonic() + 150
    while not stop.exists() and time.monotonic() < deadline:
        for _ in range(100):
            with traceml.trace_step():
                pass
            steps += 1
        # Tell the test once this rank's sender has dropped (the freeze did its work).
        if not dropped.exists() and (sender.dropped_batches or sender.dropped_items):
            dropped.touch()
    traceml.shutdown()
    (out / f"steps.{rank}").write_text(str(steps))
    """
)


def _aggregator_of(launcher: subprocess.Popen[str]) -> psutil.Process:
    children = psutil.Process(launcher.pid).children()
    found = [c for c in children if "traceml_ai.aggregator" in " ".join(c.cmdline())]
    assert len(found) == 1, [c.cmdline() for c in children]
    return found[0]


def test_frozen_aggregator_rank_drops_are_reported(tmp_path: Path) -> None:
    """Two fast ranks, the aggregator frozen (SIGSTOP) long enough that their senders
    drop (send timed out, queue full), then resumed. No warning must mean that every
    step of every rank is in step_time.jsonl; a missing line must be counted in the
    closing lines and in the warning's export block."""
    script = tmp_path / "fast.py"
    script.write_text(_FAST_SCRIPT)
    stop = tmp_path / "stop"
    logs = tmp_path / "logs"
    args = [
        "run",
        "--logs-dir",
        logs,
        "--run-name",
        "frozen",
        "--exporter",
        "jsonl",
        "--export-streams",
        "step_time",
        "--nproc-per-node",
        "2",
        script,
        stop,
        tmp_path,
    ]
    # A small sender queue: a rank blocked on a full socket drops within a second.
    env = clean_env({"_TRACEML_TEST_SENDER_MAX_PENDING_ITEMS": "200"})
    proc = subprocess.Popen(
        traceml_cmd(*args),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    path = export_dir(logs, "frozen") / "step_time.jsonl"
    aggregator: psutil.Process | None = None
    try:
        wait_for(lambda: has_data_line(path), timeout=180, what="the first step_time line")
        aggregator = _aggregator_of(proc)
        aggregator.send_signal(signal.SIGSTOP)
        # Frozen until both ranks' senders dropped (a send timed out after 2 s, or the
        # queue was full), as each rank says: not a fixed wait.
        wait_for(
            lambda: all((tmp_path / f"dropped.{r}").exists() for r in range(2)),
            timeout=120,
            what="both ranks' senders to drop",
        )
        aggregator.send_signal(signal.SIGCONT)
        aggregator = None
        stop.touch()
        _, err = proc.communicate(timeout=240)
    finally:
        if aggregator is not None:
            aggregator.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    steps = {r: int((tmp_path / f"steps.{r}").read_text()) for r in range(2)}
    lines = data_lines(path)
    keys = [(d["global_rank"], d["step"]) for d in lines]
    assert len(keys) == len(set(keys)), "a step was written twice"
    expected = {(r, s) for r, n in steps.items() for s in range(1, n + 1)}
    assert set(keys) <= expected
    missing = expected - set(keys)
    warning = warning_file(logs, "frozen")
    closing = closing_line(path)
    if warning is None:
        assert not missing, f"{len(missing)} steps missing and no warning"
        assert closing["dropped_batches"] == 0
    if missing:
        assert closing["dropped_batches"] > 0, (len(missing), closing)
        assert warning is not None and "export" in warning, warning
        assert warning["export"]["dropped_batches"] == closing["dropped_batches"]
        assert warning["export"]["written_records"] == len(lines)
    # The freeze must have made the ranks drop, or this test proved nothing.
    assert missing, steps
    assert read_lines(path)[-1] == closing
