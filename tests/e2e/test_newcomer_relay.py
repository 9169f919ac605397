"""``traceml serve --relay`` given wrong addresses, as a newcomer might: a malformed one
or its own port gets one clear line and an exit code, one where nobody listens a line
once ranks send and an honest count at the stop; never a traceback nor a relay that
sends its frames round to itself."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
from pathlib import Path
from typing import IO

import psutil
import pytest

from tests.e2e_helpers import (
    clean_env,
    free_port,
    has_data_line,
    run_cli,
    traceml_cmd,
    wait_for,
)
from traceml_ai.transport import RankSender

TIMEOUT_S = 60.0
TOKEN = "newcomer-token"
IDENTITY: dict[str, object] = {
    "global_rank": 0,
    "local_rank": 0,
    "world_size": 1,
    "local_world_size": 1,
    "node_rank": 0,
    "hostname": "node",
    "pid": 100,
}


@pytest.mark.parametrize(
    ("address", "said"),
    [
        ("10.0.0.1", "expected HOST:PORT"),
        ("10.0.0.1:notaport", "expected a port from 1 to 65535, got 'notaport'"),
        ("127.0.0.1:99999", "expected a port from 1 to 65535"),
        (":29600", "expected a host name or an IP address"),
    ],
)
def test_a_malformed_relay_address_is_one_line(tmp_path: Path, address: str, said: str) -> None:
    done = run_cli(
        ["serve", "--relay", address, "--aggregator-port", str(free_port())],
        cwd=tmp_path,
        env={"TRACEML_RUN_TOKEN": "t"},
        timeout=TIMEOUT_S,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert said in lines[0] and "--relay" in lines[0]


@pytest.mark.parametrize("upstream_host", ["127.0.0.1", "localhost"])
def test_a_relay_given_its_own_port_says_so_and_exits(tmp_path: Path, upstream_host: str) -> None:
    port = free_port()
    done = run_cli(
        ["serve", "--relay", f"{upstream_host}:{port}", "--aggregator-port", str(port)],
        cwd=tmp_path,
        env={"TRACEML_RUN_TOKEN": "t"},
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("leads back to this relay") == 1, done.stderr
    assert "relay stopped" in done.stderr


def test_a_relay_whose_aggregator_never_answers_says_so_and_what_it_dropped(
    tmp_path: Path,
) -> None:
    upstream, port = free_port(), free_port()
    relay = _relay_cli(tmp_path, upstream, port)
    try:
        assert relay.stdout is not None
        exported = relay.stdout.readline()
        assert f"TRACEML_AGGREGATOR_ADDR=127.0.0.1:{port}" in exported
        sender = RankSender(("127.0.0.1", port), TOKEN, IDENTITY, flush_interval_s=0.02)
        sender.start()
        for step in range(5):
            sender.put("step_time", {"step": step})
        # Its line comes at its next try once frames wait (backoff of at most 2 s).
        assert relay.stderr is not None
        seen: list[str] = []
        reader = threading.Thread(target=_read_until, args=(relay.stderr, seen), daemon=True)
        reader.start()
        reader.join(TIMEOUT_S)
        sender.close(5.0)
        relay.send_signal(signal.SIGINT)
        _, rest = relay.communicate(timeout=TIMEOUT_S)
        err = "".join(seen) + rest
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait()
    assert "Traceback" not in err
    assert err.count("cannot reach the aggregator") == 1, err
    stopped = [line for line in err.splitlines() if "relay stopped" in line]
    assert len(stopped) == 1, err
    # Nothing reached an aggregator: the line must not send the user to its files.
    assert "finalization_warning" not in stopped[0]
    assert f"the aggregator at 127.0.0.1:{upstream} was never reached" in stopped[0]
    assert "dropped" in stopped[0]


def test_a_second_ctrl_c_stops_a_relay_waiting_for_its_aggregator(tmp_path: Path) -> None:
    """At its stop a relay forwards what it holds for up to ``--finalize-timeout-sec``: it
    says so, and a second Ctrl-C stops it at once, saying what it held is lost (with a
    long timeout the test's own would end first otherwise)."""
    upstream, port = free_port(), free_port()
    relay = _relay_cli(tmp_path, upstream, port, finalize_timeout_s=600)
    try:
        assert relay.stdout is not None and relay.stderr is not None
        relay.stdout.readline()
        sender = RankSender(("127.0.0.1", port), TOKEN, IDENTITY, flush_interval_s=0.02)
        sender.start()
        for step in range(5):
            sender.put("step_time", {"step": step})
        seen: list[str] = []
        reader = threading.Thread(target=_read_until, args=(relay.stderr, seen), daemon=True)
        reader.start()
        reader.join(TIMEOUT_S)
        relay.send_signal(signal.SIGINT)
        asked = "press Ctrl-C again"
        reader = threading.Thread(target=_read_until, args=(relay.stderr, seen, asked))
        reader.start()
        reader.join(TIMEOUT_S)
        relay.send_signal(signal.SIGINT)
        _, rest = relay.communicate(timeout=TIMEOUT_S)
        sender.close(1.0)
        err = "".join(seen) + rest
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait()
    assert relay.returncode == 130, err
    assert "Traceback" not in err
    assert err.count(asked) == 1, err
    last = err.splitlines()[-1]
    assert last.startswith("traceml: relay stopped by a second Ctrl-C: the "), err
    assert last.endswith(" frames it held are lost"), err


def _relay_cli(
    cwd: Path, upstream: int, port: int, *, finalize_timeout_s: float = 1
) -> subprocess.Popen[str]:
    """``traceml serve --relay 127.0.0.1:UPSTREAM`` listening on ``port``, token TOKEN."""
    return subprocess.Popen(
        traceml_cmd(
            "serve",
            "--relay",
            f"127.0.0.1:{upstream}",
            "--aggregator-port",
            str(port),
            "--finalize-timeout-sec",
            str(finalize_timeout_s),
        ),
        cwd=cwd,
        env=clean_env({"TRACEML_RUN_TOKEN": TOKEN}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def _read_until(
    stream: IO[str], seen: list[str], until: str = "cannot reach the aggregator"
) -> None:
    for line in stream:
        seen.append(line)
        if until in line:
            return


def test_a_relay_refused_by_the_aggregator_calls_what_went_out_lost_not_forwarded(
    tmp_path: Path,
) -> None:
    """The relay's token is not the aggregator's: every connection is closed as soon as it
    opens. The stop line must not call the frames that went out on them forwarded."""
    from tests.traceml_ai.transport.test_relay import Collector

    collector = Collector()
    aggregator = collector.serve()  # the test's own token, not TOKEN
    assert aggregator.address is not None
    port = free_port()
    relay = _relay_cli(tmp_path, aggregator.address[1], port)
    try:
        assert relay.stdout is not None
        assert f"127.0.0.1:{port}" in relay.stdout.readline()
        sender = RankSender(("127.0.0.1", port), TOKEN, IDENTITY, flush_interval_s=0.02)
        sender.start()
        assert relay.stderr is not None
        seen: list[str] = []
        told = "closed as soon as they open"
        reader = threading.Thread(target=_read_until, args=(relay.stderr, seen, told), daemon=True)
        reader.start()
        for step in range(50):
            sender.put("step_time", {"step": step})
            if not reader.is_alive():
                break
            threading.Event().wait(0.1)
        reader.join(TIMEOUT_S)
        relay.send_signal(signal.SIGINT)
        _, rest = relay.communicate(timeout=TIMEOUT_S)
        sender.close(1.0)
        err = "".join(seen) + rest
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait()
        aggregator.stop()
    assert "Traceback" not in err
    assert collector.batches == []
    stopped = [line for line in err.splitlines() if "relay stopped" in line]
    assert len(stopped) == 1, err
    assert "closed as soon as they opened" in stopped[0] and "lost" in stopped[0], stopped
    assert "TRACEML_RUN_TOKEN" in stopped[0]
    forwarded = int(stopped[0].split("relay stopped: ")[1].split(" frames forwarded")[0])
    refused = int(stopped[0].split("; ")[-1].split(" frames went out")[0])
    assert refused >= 1 and forwarded < refused, stopped[0]


SLEEPY_RANK = """\
import sys, time
import traceml_ai as traceml

traceml.init()
for _ in range(int(sys.argv[1])):
    with traceml.trace_step():
        time.sleep(0.05)
"""


@pytest.mark.parametrize(
    ("tokens", "addresses", "check"),
    [
        pytest.param(
            ("node-0-token", "not-node-0s-token"),
            ("127.0.0.1", "127.0.0.1"),
            "is TRACEML_RUN_TOKEN that aggregator's?",
            id="another-token",
        ),
        pytest.param(
            (None, None),
            ("127.0.0.1", "localhost"),
            "run token is derived from --master-addr localhost",
            id="node-0-spelled-otherwise",
        ),
    ],
)
def test_a_node_with_another_run_token_says_so_and_what_it_lost(
    tmp_path: Path, tokens: tuple[str | None, ...], addresses: tuple[str, ...], check: str
) -> None:
    """Two nodes of ``traceml run`` on this host whose run tokens differ (one given
    another ``TRACEML_RUN_TOKEN``, or none given and node 0's address spelled otherwise,
    which the derived token depends on): node 1's relay says once that the aggregator
    refuses it, and its ``traceml run`` ends saying what the relay could not hand on
    and what to check (nothing else on node 1 would); node 0's warning names the missing
    rank. Training is untouched."""
    script = tmp_path / "rank.py"
    script.write_text(SLEEPY_RANK)
    master_port, aggregator_port = free_port(), free_port()
    procs = []
    for node_rank, (token, address) in enumerate(zip(tokens, addresses, strict=True)):
        work = tmp_path / f"node{node_rank}"
        work.mkdir()
        command = traceml_cmd(
            "run",
            "--nnodes=2",
            f"--node-rank={node_rank}",
            f"--master-addr={address}",
            f"--master-port={master_port}",
            f"--aggregator-port={aggregator_port}",
            "--run-name=r",
            "--exporter=jsonl",
            "--finalize-timeout-sec=2",
            script,
            "40",
        )
        procs.append(
            subprocess.Popen(
                command,
                cwd=work,
                env=clean_env({"TRACEML_RUN_TOKEN": token} if token else None),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240.0))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    node1 = outputs[1][1]
    ours = [line for line in node1.splitlines() if line.startswith("traceml:")]
    assert "traceml_ai/" not in node1, node1  # no frame of ours in a traceback
    refused = [line for line in ours if "are closed as soon as they open:" in line]
    assert len(refused) == 1 and "TRACEML_RUN_TOKEN" in refused[0], ours
    stopped = [line for line in ours if "the node's relay stopped" in line]
    assert len(stopped) == 1, ours
    assert "closed as soon as they opened" in stopped[0] and "they are lost" in stopped[0]
    assert check in stopped[0], stopped[0]
    assert len(ours) == 2, ours
    warning = json.loads(
        (tmp_path / "node0" / "logs" / "r" / "finalization_warning.json").read_text()
    )
    assert warning["missing_ranks"] == [1], warning


def _child_running(proc: subprocess.Popen[str], module: str) -> bool:
    """Whether ``proc`` has a child process running ``python -m MODULE``."""
    for child in psutil.Process(proc.pid).children():
        with contextlib.suppress(psutil.Error):
            if module in child.cmdline():
                return True
    return False


@pytest.mark.parametrize("presses", [0, 2], ids=["waits", "two-ctrl-c"])
def test_a_node_whose_aggregator_died_says_what_its_relay_could_not_hand_on(
    tmp_path: Path, presses: int
) -> None:
    """Two nodes of ``traceml run`` on this host; node 0's aggregator is killed while the
    ranks train. Node 1's relay then holds its ranks' last frames until its stop: its
    ``traceml run`` says they were dropped and that no warning file counts them (the
    aggregator was gone at the end). Two Ctrl-C while it waits for the aggregator stop
    that wait at once (with a long ``--finalize-timeout-sec`` the test's timeout would
    end first otherwise) and say so."""
    script = tmp_path / "rank.py"
    script.write_text(SLEEPY_RANK)
    master_port, aggregator_port = free_port(), free_port()
    procs = []
    for node_rank in range(2):
        work = tmp_path / f"node{node_rank}"
        work.mkdir()
        command = traceml_cmd(
            "run",
            "--nnodes=2",
            f"--node-rank={node_rank}",
            f"--master-port={master_port}",
            f"--aggregator-port={aggregator_port}",
            "--run-name=r",
            "--exporter=jsonl",
            f"--finalize-timeout-sec={600 if presses and node_rank == 1 else 2}",
            script,
            "100",
        )
        # Into files: a pipe nobody reads while the test waits could fill and stall it.
        with (tmp_path / f"node{node_rank}.err").open("w") as err:
            procs.append(
                subprocess.Popen(
                    command,
                    cwd=work,
                    env=clean_env(),
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    text=True,
                )
            )
    node0, node1 = procs
    step_time = tmp_path / "node0" / "logs" / "r" / "aggregator" / "export" / "step_time.jsonl"
    try:
        wait_for(lambda: has_data_line(step_time), timeout=TIMEOUT_S, what="a step_time line")
        for child in psutil.Process(node0.pid).children():
            with contextlib.suppress(psutil.Error):
                if "traceml_ai.aggregator" in child.cmdline():
                    child.kill()
        if presses:
            # The ranks are done once torchrun is: node 1 then waits on its relay.
            wait_for(
                lambda: _child_running(node1, "torch.distributed.run"),
                timeout=TIMEOUT_S,
                what="node 1's torchrun",
            )
            wait_for(
                lambda: not _child_running(node1, "torch.distributed.run"),
                timeout=TIMEOUT_S,
                what="node 1's ranks to end",
            )
            # A press before the launcher reached the relay's stop counts for the ranks:
            # press until the wait says so, then once more.
            err_file = tmp_path / "node1.err"
            for _ in range(10):
                node1.send_signal(signal.SIGINT)
                with contextlib.suppress(AssertionError):
                    wait_for(
                        lambda: "press Ctrl-C again" in err_file.read_text(),
                        timeout=2.0,
                        what="the line that asks for a second Ctrl-C",
                    )
                    break
            node1.send_signal(signal.SIGINT)
        node1.wait(timeout=TIMEOUT_S)
        node0.wait(timeout=TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    err1 = (tmp_path / "node1.err").read_text()
    assert node1.returncode == 0, err1
    assert "traceml_ai/" not in err1, err1  # no frame of ours in a traceback
    ours = [line for line in err1.splitlines() if line.startswith("traceml:")]
    if presses:
        assert sum("press Ctrl-C again to stop it now" in line for line in ours) == 1, ours
        assert ours[-1] == (
            "traceml: the node's relay was stopped by a second Ctrl-C: what it held is lost"
        ), ours
    else:
        stopped = [line for line in ours if "the node's relay stopped" in line]
        assert len(stopped) == 1, ours
        assert "could not be reached at the end" in stopped[0], stopped[0]
        assert "counts them" not in stopped[0], stopped[0]
