"""``traceml run`` on two nodes (two network namespaces), two ranks each, export of every stream.

Node 0 hosts the aggregator, bound on the master address; each node's ranks send to
their node's relay, which forwards to it (node 1's across the veth pair). One set of files on node 0, none on node 1; every rank's
steps, system lines from local rank 0 of each node only, identity right everywhere.

Needs root and iproute2 (``ip netns``); it fails, not skips, where they are missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_helpers import ALL_FILES, REPO
from tests.netns import NetnsUnavailable, Node, kill_processes, two_nodes
from traceml_records import validate_paths

SCRIPT = REPO / "examples" / "train.py"
STEPS = 5
NPROC = 2
NNODES = 2
WORLD = NPROC * NNODES
RUN_TIMEOUT_S = 120.0
EXPECTED_FILES = {f"{name}.jsonl" for name in ALL_FILES}


@pytest.fixture
def nodes() -> Iterator[tuple[Node, Node]]:
    with contextlib.ExitStack() as stack:
        reason = ""
        try:
            pair = stack.enter_context(two_nodes())
        except NetnsUnavailable as exc:
            reason = str(exc)
        if reason:
            pytest.fail(
                f"two-node test cannot run on this machine: {reason}. "
                "Run the tests as root with iproute2 installed (apt-get install -y iproute2).",
                pytrace=False,
            )
        yield pair


def _data_lines(path: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert lines and lines[-1].get("closing") is True, f"{path.name} has no closing line"
    return lines[:-1]


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(encoding="utf-8", errors="replace")[-n:] if path.exists() else ""


@pytest.mark.timeout(240)
def test_two_nodes_two_ranks_each(nodes: tuple[Node, Node], tmp_path: Path) -> None:
    node0 = nodes[0]
    # Each namespace starts with no listeners, so any port is free there.
    master_port = random.randint(20000, 29000)
    run_name = "two-nodes"
    logs = [tmp_path / "node0-logs", tmp_path / "node1-logs"]
    outputs = [tmp_path / "node0.out", tmp_path / "node1.out"]
    procs: list[subprocess.Popen[bytes]] = []
    for node_rank, node in enumerate(nodes):
        env = dict(os.environ)
        env.pop("TRACEML_RUN_TOKEN", None)
        env.pop("TRACEML_AGGREGATOR_ADDR", None)
        # Gloo (and tensorpipe) must use the veth end, the only route to the other node.
        env["GLOO_SOCKET_IFNAME"] = node.ifname
        env["TP_SOCKET_IFNAME"] = node.ifname
        env["OMP_NUM_THREADS"] = "1"
        command = [
            *node.exec_prefix(),
            sys.executable,
            "-m",
            "traceml_ai",
            "run",
            f"--nnodes={NNODES}",
            f"--nproc-per-node={NPROC}",
            f"--node-rank={node_rank}",
            f"--master-addr={node0.address}",
            f"--master-port={master_port}",
            f"--logs-dir={logs[node_rank]}",
            f"--run-name={run_name}",
            "--exporter=jsonl",
            "--export-streams=all",
            "--interval=0.2",
            str(SCRIPT),
            f"--steps={STEPS}",
        ]
        with outputs[node_rank].open("wb") as out:
            procs.append(
                subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
            )

    deadline = time.monotonic() + RUN_TIMEOUT_S
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            codes.append(None)
    if None in codes:
        for node in nodes:
            kill_processes(node.netns)
        for proc in procs:
            proc.wait()
    states = ["timed out" if c is None else f"exit {c}" for c in codes]
    report = "\n".join(f"--- node {i} ({states[i]}):\n{_tail(outputs[i])}" for i in range(NNODES))
    assert codes == [0, 0], f"traceml run did not exit 0 on both nodes\n{report}"

    # One set of files, on node 0; node 1 hosts no aggregator and makes no run folder.
    assert not logs[1].exists() or not any(logs[1].iterdir()), (
        f"node 1 created {sorted(p.name for p in logs[1].iterdir())}\n{report}"
    )
    assert sorted(p.name for p in logs[0].iterdir()) == [run_name]
    run_dir = logs[0] / run_name
    export = run_dir / "aggregator" / "export"
    assert {p.name for p in export.iterdir()} == EXPECTED_FILES
    warnings = list(tmp_path.rglob("finalization_warning.json"))
    assert not warnings, f"{warnings[0]}: {warnings[0].read_text()}"

    # Each node's ranks sent through its relay: one connection per node reached the
    # aggregator, not one per rank, and the accounting above is exact all the same.
    stats = json.loads((run_dir / "aggregator" / "stats.json").read_text())
    assert stats["connections_total"] < WORLD, stats

    validation = validate_paths([run_dir])
    assert validation.ok, "\n".join(str(p) for p in validation.problems)

    # Identity on every data line that carries it (stdout_stderr has none; it is empty).
    for name in sorted(EXPECTED_FILES - {"stdout_stderr.jsonl"}):
        for line in _data_lines(export / name):
            rank = line["global_rank"]
            assert 0 <= rank < WORLD, (name, line)
            assert line["rank"] == rank, (name, line)
            assert line["local_rank"] == rank % NPROC, (name, line)
            assert line["node_rank"] == rank // NPROC, (name, line)
            assert line["local_world_size"] == NPROC, (name, line)
            assert line["world_size"] == WORLD, (name, line)
    assert _data_lines(export / "stdout_stderr.jsonl") == []

    step_keys = [(d["global_rank"], d["step"]) for d in _data_lines(export / "step_time.jsonl")]
    assert len(step_keys) == STEPS * WORLD
    assert set(step_keys) == {(r, s) for r in range(WORLD) for s in range(1, STEPS + 1)}

    system = _data_lines(export / "system.jsonl")
    senders = {(d["global_rank"], d["local_rank"], d["node_rank"]) for d in system}
    # Local rank 0 of each node, and no other rank.
    assert senders == {(0, 0, 0), (2, 0, 1)}
    for d in _data_lines(export / "system_gpu.jsonl"):
        assert (d["global_rank"], d["local_rank"]) in {(0, 0), (2, 0)}

    runtime = {d["global_rank"]: d for d in _data_lines(export / "runtime_environment.jsonl")}
    assert sorted(runtime) == list(range(WORLD))
    assert {d["topology"] for d in runtime.values()} == {"multi_node"}
    assert {d["distributed_backend"] for d in runtime.values()} == {"gloo"}
