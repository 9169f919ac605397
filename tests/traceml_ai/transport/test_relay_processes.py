"""A node's relay as ``traceml run`` starts it (its own process, watched), killed while
real rank processes send through it: the launcher starts it again on the same port, the
ranks reconnect and exit 0 without a traceback, and the aggregator's count of dropped
batches is exactly what the ranks sent and it never received."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson
import pytest

from traceml_ai.aggregator import Aggregator, AggregatorConfig
from traceml_ai.launch import _relay_process as relay_process
from traceml_ai.launch._relay_process import RelayProcess
from traceml_ai.settings import ExportSettings

pytestmark = pytest.mark.slow  # real processes (docs/testing.md)

TOKEN = "relay-process-token"
RANKS = 3

RANK_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from traceml_ai.transport.sender import RankSender

    rank, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    WORLD, TOKEN = int(sys.argv[4]), sys.argv[5]
    identity = {"global_rank": rank, "local_rank": rank, "world_size": WORLD,
                "local_world_size": WORLD, "node_rank": 0, "hostname": None, "pid": 1}
    sender = RankSender((host, port), TOKEN, identity, flush_interval_s=0.05)
    sender.start()
    timing = {"cpu_ms": 1.0, "duration_ms": 1.0, "gpu_ms": None, "is_gpu": False, "n_calls": 1}
    for i in range(60):
        sender.put("step_time", {"timestamp_unix_ns": time.time_ns(), "seq": i, "step": i + 1,
                                 "events": {"_traceml_internal:step_time": {"cpu": timing}}})
        time.sleep(0.05)
    sender.close(5.0)
    print(sender.sent_batches, sender.dropped_batches)
    """
)


def _relayed_run(
    tmp_path: Path, finalize_timeout_sec: float
) -> tuple[Aggregator, RelayProcess, list[subprocess.Popen[bytes]]]:
    """An aggregator, a node's relay process before it (watched) and RANKS real rank
    processes sending through it."""
    aggregator = Aggregator(
        AggregatorConfig(
            run_dir=tmp_path / "run",
            settings=ExportSettings("jsonl", "step_time", False),
            token=TOKEN,
            expected_world_size=RANKS,
            finalize_timeout_sec=finalize_timeout_sec,
        )
    )
    host, port = aggregator.start()
    relay = RelayProcess(f"{host}:{port}", TOKEN, 5.0, range(RANKS))
    started = relay.start()
    assert isinstance(started, int), started
    relay.watch()
    return aggregator, relay, _start_ranks(tmp_path, started)


def _start_ranks(tmp_path: Path, port: int) -> list[subprocess.Popen[bytes]]:
    """RANKS real rank processes sending to ``port`` on loopback."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    return [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), "127.0.0.1", str(port), str(RANKS), TOKEN],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(RANKS)
    ]


@pytest.mark.timeout(90)
def test_a_relay_killed_mid_run_is_restarted_and_its_loss_counted(tmp_path: Path) -> None:
    aggregator, relay, ranks = _relayed_run(tmp_path, 5.0)
    time.sleep(1.0)
    first = relay._proc
    assert first is not None
    os.kill(first.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20.0
    while relay._proc is first or relay._proc is None:
        assert time.monotonic() < deadline, "the relay was not started again"
        time.sleep(0.05)
    outputs = [proc.communicate(timeout=60) for proc in ranks]
    relay.stop()
    assert aggregator.wait_all_finished(10.0)
    server = aggregator._server
    assert server is not None
    result = aggregator.finalize()
    for proc, (_, err) in zip(ranks, outputs, strict=True):
        assert proc.returncode == 0, err.decode()
        assert b"Traceback" not in err
    counts = [tuple(map(int, out.split())) for out, _ in outputs]
    received = server.received_batches_by_rank()
    unseen = sum(max(0, sent - received.get(rank, 0)) for rank, (sent, _) in enumerate(counts))
    own = sum(dropped for _, dropped in counts)
    assert result.ranks.missing_ranks == ()
    assert result.stats is not None
    assert result.stats.dropped_batches == unseen + own
    warning = tmp_path / "run" / "finalization_warning.json"
    assert warning.exists() == bool(unseen + own)


def _step_keys(run_dir: Path) -> list[tuple[int, int]]:
    path = run_dir / "aggregator" / "export" / "step_time.jsonl"
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    return [(x["global_rank"], x["step"]) for x in lines if not x.get("closing")]


@pytest.mark.timeout(90)
def test_an_aggregator_restarted_mid_run_gets_the_rest_through_the_relay(tmp_path: Path) -> None:
    """The aggregator finalizes while real ranks send through a node's relay process, and
    a new one listens on the same port: the relay reconnects (the same process), the
    ranks exit 0 without a traceback, no step is written twice across the two runs, and
    the second aggregator's dropped count is exactly what the ranks sent and it never
    received."""

    def aggregator(name: str, port: int) -> Aggregator:
        return Aggregator(
            AggregatorConfig(
                run_dir=tmp_path / name,
                settings=ExportSettings("jsonl", "step_time", False),
                token=TOKEN,
                port=port,
                expected_world_size=RANKS,
                finalize_timeout_sec=5.0,
            )
        )

    first = aggregator("run1", 0)
    host, port = first.start()
    relay = RelayProcess(f"{host}:{port}", TOKEN, 5.0)
    started = relay.start()
    assert isinstance(started, int), started
    relay.watch()
    process = relay._proc
    ranks = _start_ranks(tmp_path, started)
    server = first._server
    assert server is not None
    # Mid-run: once every rank's batches reach the first aggregator (a rank's interpreter
    # takes a while to start on a loaded machine), not after a fixed time.
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline and not all(
        server.received_batches_by_rank().get(rank) for rank in range(RANKS)
    ):
        time.sleep(0.05)
    first.finalize()
    received_first = server.received_batches_by_rank()
    second = aggregator("run2", port)
    second.start()
    outputs = [proc.communicate(timeout=60) for proc in ranks]
    relay.stop()
    assert second.wait_all_finished(10.0)
    server = second._server
    assert server is not None
    result = second.finalize()
    for proc, (_, err) in zip(ranks, outputs, strict=True):
        assert proc.returncode == 0, err.decode()
        assert b"Traceback" not in err
    assert relay._proc is None or relay._proc is process  # reconnected, never restarted
    counts = [tuple(map(int, out.split())) for out, _ in outputs]
    received = server.received_batches_by_rank()
    assert all(received_first.get(rank) for rank in range(RANKS))
    assert all(received.get(rank) for rank in range(RANKS))
    unseen = sum(max(0, sent - received.get(rank, 0)) for rank, (sent, _) in enumerate(counts))
    own = sum(dropped for _, dropped in counts)
    assert result.ranks.missing_ranks == ()
    assert result.stats is not None
    assert result.stats.dropped_batches == unseen + own
    # What reached either aggregator was written once, and no more than was sent.
    keys = _step_keys(tmp_path / "run1") + _step_keys(tmp_path / "run2")
    assert len(keys) == len(set(keys))
    for rank, (sent, _) in enumerate(counts):
        assert received_first.get(rank, 0) + received.get(rank, 0) <= sent


@pytest.mark.timeout(90)
def test_a_relay_gone_for_good_is_named_in_the_warning_not_only_its_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed past its restarts, the node's relay stays gone: its ranks cannot finish. The
    warning names them missing and says they send through a relay whose connection
    ended first, rather than only blaming the ranks (those whose frames never passed
    too: the relay told the aggregator its node's ranks)."""
    monkeypatch.setattr(relay_process, "MAX_RESTARTS", 0)
    aggregator, relay, ranks = _relayed_run(tmp_path, 2.0)
    time.sleep(1.0)
    first = relay._proc
    assert first is not None
    os.kill(first.pid, signal.SIGKILL)
    outputs = [proc.communicate(timeout=60) for proc in ranks]
    relay.stop()
    result = aggregator.finalize()
    for proc, (_, err) in zip(ranks, outputs, strict=True):
        assert proc.returncode == 0, err.decode()
        assert b"Traceback" not in err
    assert result.ranks.missing_ranks == tuple(range(RANKS))
    assert result.ranks.relayed_missing_ranks == tuple(range(RANKS))
    warning = orjson.loads((tmp_path / "run" / "finalization_warning.json").read_bytes())
    assert warning["reason"] == "ranks_disconnected"
    assert "all of them send through a node's relay" in warning["message"], warning


@pytest.mark.timeout(90)
def test_a_relay_gone_before_any_rank_sent_still_stands_for_its_nodes_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's relay dies for good before any of its ranks' frames passed (a slow
    node: the ranks' interpreters still start). The aggregator knows the node's ranks
    from the relay's first message, so the warning still says all of them send through
    a relay whose connection ended, not only that they are missing."""
    monkeypatch.setattr(relay_process, "MAX_RESTARTS", 0)
    aggregator = Aggregator(
        AggregatorConfig(
            run_dir=tmp_path / "run",
            settings=ExportSettings("jsonl", "step_time", False),
            token=TOKEN,
            expected_world_size=RANKS,
            finalize_timeout_sec=2.0,
        )
    )
    host, port = aggregator.start()
    relay = RelayProcess(f"{host}:{port}", TOKEN, 5.0, range(RANKS))
    started = relay.start()
    assert isinstance(started, int), started
    relay.watch()
    # Its first message reached the aggregator: the relay is known, none of its ranks.
    deadline = time.monotonic() + 30.0
    while not aggregator._relay_ranks:
        assert time.monotonic() < deadline, "the relay's first message did not arrive"
        time.sleep(0.02)
    first = relay._proc
    assert first is not None
    os.kill(first.pid, signal.SIGKILL)
    ranks = _start_ranks(tmp_path, started)
    outputs = [proc.communicate(timeout=60) for proc in ranks]
    relay.stop()
    server = aggregator._server
    assert server is not None
    result = aggregator.finalize()
    for proc, (_, err) in zip(ranks, outputs, strict=True):
        assert proc.returncode == 0, err.decode()
        assert b"Traceback" not in err
    assert server.received_batches_by_rank() == {}
    assert result.ranks.missing_ranks == tuple(range(RANKS))
    assert result.ranks.relayed_missing_ranks == tuple(range(RANKS))
    warning = orjson.loads((tmp_path / "run" / "finalization_warning.json").read_bytes())
    assert warning["reason"] == "ranks_disconnected"
    assert "all of them send through a node's relay" in warning["message"], warning
