"""The dashboard in a real browser: Debian's chromium driven by Playwright.

Real ``traceml run --mode dashboard`` runs (CPU torch, gloo), the page loaded while
they train: both ranks, a chart, the straggler verdict naming the slowed rank, the
page changing without a reload, the final view once the run finalized; then
``traceml dashboard FOLDER`` on the finished run; a two-node run (node 0's
aggregator sees both nodes); one rank; and what a bad input or a taken port says.

With ``TRACEML_DASHBOARD_SCREENSHOTS=DIR`` the live and the folder page are written
to ``DIR/dashboard-live.png`` and ``DIR/dashboard-folder.png`` (docs/images/ holds
the ones docs/dashboard.md shows).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e_helpers import REPO, TRAIN, clean_env, free_port, run_cli, traceml_cmd

STRAGGLER = REPO / "tests" / "scripts" / "straggler_train.py"
SCREENSHOTS = os.environ.get("TRACEML_DASHBOARD_SCREENSHOTS")
URL_LINE = re.compile(r"traceml: dashboard(?: of .*)?:? (?:live )?at (http://\S+)")
WAIT_MS = 60_000
SLOW_RANK_1 = ["--where", "backward", "--slow-ranks", "1", "--sleep-ms", "30"]
"""Rank 1 slow inside backward's computation, before DDP's all-reduce: every rank's
backward lasts as long, and only the measured collectives tell who waits."""


class _Proc:
    """A ``traceml`` process with its stderr in a file (read while it runs)."""

    def __init__(self, args: list[str | Path], cwd: Path, name: str, env: dict[str, str]):
        self.err_path = cwd / f"{name}.err"
        self._err = self.err_path.open("w")
        self.popen = subprocess.Popen(
            traceml_cmd(*args),
            cwd=cwd,
            env=clean_env(env),
            stdout=subprocess.PIPE,
            stderr=self._err,
            stdin=subprocess.DEVNULL,
            text=True,
        )

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def url(self, timeout: float = 90.0) -> str:
        """The page's URL from the process's ``traceml: dashboard`` line."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = URL_LINE.search(self.stderr)
            if found:
                return found.group(1)
            if self.popen.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no dashboard URL printed:\n{self.stderr}")

    def wait(self, timeout: float = 180.0) -> int:
        try:
            return self.popen.wait(timeout)
        finally:
            self._err.close()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()
        self.popen.wait(30)
        self._err.close()


@contextlib.contextmanager
def _started(args: list[str | Path], cwd: Path, name: str, **env: str) -> Iterator[_Proc]:
    proc = _Proc(args, cwd, name, env)
    try:
        yield proc
    finally:
        if proc.popen.poll() is None:
            proc.kill()


def _dashboard_run(
    logs: Path, name: str, *options: str | Path, script: Path, script_args: list[str]
) -> list[str | Path]:
    return [
        "run",
        "--logs-dir",
        logs,
        "--run-name",
        name,
        "--interval",
        "0.5",
        "--mode",
        "dashboard",
        "--dashboard-port",
        "0",
        "--export-streams",
        "all",
        *options,
        script,
        *script_args,
    ]


def _scrape_until(url: str, needle: str, timeout: float = 60.0) -> str:
    """GET ``url`` until its body holds ``needle``; the last body."""
    deadline = time.monotonic() + timeout
    body = ""
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=5) as response:
                body = response.read().decode()
            if needle in body:
                return body
        time.sleep(0.5)
    raise AssertionError(f"{needle} not in {url} within {timeout} s:\n{body[-3000:]}")


def _rank_steps(page: Page, rank: int) -> str:
    return page.locator(f"#ranks-table tr[data-rank='{rank}'] td").nth(2).inner_text()


def _shot(page: Page, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SCREENSHOTS) / name), full_page=True)


def _expect_page_basics(page: Page, ranks: list[int]) -> None:
    for rank in ranks:
        expect(page.locator(f"#ranks-table tr[data-rank='{rank}']")).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#chart-steps .main-svg").first).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#chart-phases .main-svg").first).to_be_visible(timeout=WAIT_MS)


# --------------------------------------------------------------------------- two ranks


@pytest.mark.timeout(240)
def test_live_page_names_the_straggler_then_the_folder_page_shows_the_run(
    page: Page, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    metrics_port = free_port()
    args = _dashboard_run(
        logs,
        "ddp-straggler",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "--prometheus-port",
        str(metrics_port),
        script=STRAGGLER,
        script_args=[*SLOW_RANK_1, "--steps", "450"],
    )
    with _started(args, tmp_path, "run") as run:
        url = run.url()
        assert url.startswith("http://127.0.0.1:"), url
        page.goto(url)
        page.evaluate("window.__sameDocument = true")
        _expect_page_basics(page, [0, 1])
        expect(page.locator("#status")).to_contain_text("live", timeout=WAIT_MS)
        # The verdict in traceml summary's words, naming rank 1 and the slowed place.
        expect(page.get_by_test_id("verdict")).to_contain_text(
            re.compile(
                r"straggler: rank 1: \+[\d.]+ ms of own work per iteration.*in backward; "
                r"the others wait in backward's all_reduce"
            ),
            timeout=WAIT_MS,
        )
        expect(page.locator("#ranks-table tr.straggler[data-rank='1']")).to_be_visible()
        # /metrics names the same rank and phase, from the same analysis.
        metrics = _scrape_until(
            f"http://127.0.0.1:{metrics_port}/metrics",
            'traceml_straggler_excess_seconds{phase="backward",rank="1"}',
        )
        stragglers = {f.name: f for f in text_string_to_metric_families(metrics)}
        (verdict,) = stragglers["traceml_stragglers"].samples
        assert verdict.labels == {"verdict": "straggler"} and verdict.value == 1
        expect(page.locator("#identity")).to_contain_text("world size 2")
        expect(page.locator("#identity")).to_contain_text("strategy ddp")
        # The page changes while training runs, without a reload.
        before = _rank_steps(page, 0)
        expect(page.locator("#ranks-table tr[data-rank='0'] td").nth(2)).not_to_have_text(
            before, timeout=WAIT_MS
        )
        _shot(page, "dashboard-live.png")
        # A CPU run: the page says what it cannot show.
        expect(page.locator("#notes")).to_contain_text("no GPU on the host(s)")
        code = run.wait()
        assert code == 0, run.stderr
        # The open page got the final view before the server went.
        expect(page.locator("#status")).to_have_attribute("data-finished", "true", timeout=WAIT_MS)
        assert page.evaluate("window.__sameDocument") is True
        expect(page.locator("#error")).to_contain_text("traceml dashboard", timeout=WAIT_MS)
    assert "traceml: dashboard: stopped with the run" in run.stderr, run.stderr

    run_dir = logs / "ddp-straggler"
    with _started(["dashboard", run_dir, "--port", "0"], tmp_path, "folder") as folder:
        page.goto(folder.url())
        _expect_page_basics(page, [0, 1])
        expect(page.locator("#status")).to_contain_text("from files: files complete")
        expect(page.get_by_test_id("verdict")).to_contain_text("straggler: rank 1:")
        expect(page.locator("#loss")).to_contain_text("files: complete")
        expect(page.locator("#loss")).to_contain_text("step_time.jsonl: 900 lines, closed")
        expect(page.locator("#process table")).to_be_visible()
        _shot(page, "dashboard-folder.png")
        folder.popen.terminate()
        assert folder.wait(30) == 0, folder.stderr


# --------------------------------------------------------------------------- two nodes


@pytest.mark.timeout(240)
def test_two_nodes_one_page_sees_both(page: Page, tmp_path: Path) -> None:
    """Two nodes (one rank each, on this host) sending to one aggregator: the page
    shows both ranks and both nodes."""
    logs = tmp_path / "logs"
    master = str(free_port())
    aggregator_port = str(free_port())
    node_args = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1"]
    node_args += ["--master-port", master]
    script = [TRAIN, "--steps", "150", "--sleep-ms", "25"]
    with contextlib.ExitStack() as stack:
        env: dict[str, str] = {}
        # traceml serve hosts the aggregator and the page; both nodes send to it.
        serve = stack.enter_context(
            _started(
                [
                    *("serve", "--logs-dir", logs, "--run-name", "nodes", "--nnodes", "2"),
                    *("--nproc-per-node", "1", "--aggregator-port", aggregator_port),
                    *("--dashboard", "--dashboard-port", "0"),
                ],
                tmp_path,
                "serve",
            )
        )
        url = serve.url()
        assert serve.popen.stdout is not None
        line = serve.popen.stdout.readline()
        env["TRACEML_RUN_TOKEN"] = line.split("TRACEML_RUN_TOKEN=")[1].split()[0]
        hosts = [["--aggregator-host", "127.0.0.1"], ["--aggregator-host", "127.0.0.1"]]
        nodes = [
            stack.enter_context(
                _started(
                    ["run", "--logs-dir", logs, "--run-name", "nodes", "--interval", "0.5"]
                    + ["--aggregator-port", aggregator_port, "--node-rank", str(rank)]
                    + ["--export-streams", "all", *node_args, *hosts[rank]]
                    + [str(a) for a in script],
                    tmp_path,
                    f"node{rank}",
                    **env,
                )
            )
            for rank in range(2)
        ]
        page.goto(url)
        _expect_page_basics(page, [0, 1])
        expect(page.locator("#identity")).to_contain_text("2 node(s)", timeout=WAIT_MS)
        expect(page.locator("#identity")).to_contain_text("world size 2")
        expect(page.locator("#system table").first).to_contain_text("1", timeout=WAIT_MS)
        for node in nodes:
            assert node.wait() == 0, node.stderr
        assert serve.wait(60) == 0, serve.stderr
        expect(page.locator("#status")).to_have_attribute("data-finished", "true", timeout=WAIT_MS)


# --------------------------------------------------------------------------- one rank


@pytest.mark.timeout(180)
def test_one_rank(page: Page, tmp_path: Path) -> None:
    args = _dashboard_run(
        tmp_path / "logs", "one", script=TRAIN, script_args=["--steps", "200", "--sleep-ms", "25"]
    )
    with _started(args, tmp_path, "run") as run:
        page.goto(run.url())
        _expect_page_basics(page, [0])
        expect(page.get_by_test_id("verdict")).to_contain_text(
            "straggler: n/a (one rank: nothing to compare)", timeout=WAIT_MS
        )
        expect(page.locator("#chart-throughput .main-svg").first).to_be_visible()
        assert run.wait() == 0, run.stderr


# --------------------------------------------------------------------------- aggregator gone

TINY = """\
import os, sys, time
import traceml_ai as traceml

traceml.init()
for i in range(int(sys.argv[1])):
    if os.path.exists(sys.argv[3]):
        break
    with traceml.trace_step():
        time.sleep(0.05)
open(sys.argv[2], "w").close()
"""
"""A training script without torch (quick to start on a busy machine): ARGV[1] steps
at most, ARGV[2] written at its end, and it ends early once ARGV[3] exists (the test
has seen what it waited for while training went on)."""


@pytest.mark.timeout(180)
def test_a_killed_aggregator_is_said_at_once_on_the_page_and_in_the_terminal(
    page: Page, tmp_path: Path
) -> None:
    import psutil

    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    done, stop = tmp_path / "done", tmp_path / "stop"
    args = _dashboard_run(
        tmp_path / "logs", "gone", script=script, script_args=["400", str(done), str(stop)]
    )
    with _started(args, tmp_path, "run") as run:
        page.goto(run.url())
        expect(page.locator("#ranks-table tr[data-rank='0']")).to_be_visible(timeout=WAIT_MS)
        expect(page.locator("#status")).to_have_text("live: training")
        (aggregator,) = [
            child
            for child in psutil.Process(run.popen.pid).children()
            if "traceml_ai.aggregator" in child.cmdline()
        ]
        aggregator.kill()
        # The page says what happened and what it means for the files ...
        expect(page.locator("#status")).to_have_text("live: aggregator gone", timeout=10_000)
        expect(page.locator("#loss-status")).to_have_text("aggregator gone")
        error = page.locator("#error")
        expect(error).to_contain_text("The aggregator does not answer")
        expect(error).to_contain_text(
            "the export files keep what it had written, without closing lines"
        )
        expect(error).to_contain_text(f"traceml dashboard {tmp_path / 'logs' / 'gone'}")
        # ... and so does the terminal, while training goes on.
        deadline = time.monotonic() + 10
        while "during the run: training goes on" not in run.stderr:
            assert time.monotonic() < deadline, run.stderr
            time.sleep(0.1)
        assert not done.exists()
        # Training went on after the kill: it may end now, and ends well.
        stop.touch()
        assert run.wait() == 0, run.stderr
    assert done.exists()


# --------------------------------------------------------------------------- bad input


def test_folder_command_bad_input_is_one_line(tmp_path: Path) -> None:
    res = run_cli(["dashboard", tmp_path / "missing"], cwd=tmp_path, timeout=60)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        f"traceml: error: {tmp_path / 'missing'}: no such file or folder"
    ]
    (tmp_path / "folder").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_cli(
            ["dashboard", tmp_path / "folder", "--port", str(port)], cwd=tmp_path, timeout=60
        )
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        f"traceml: error: dashboard: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


@pytest.mark.timeout(180)
def test_a_taken_port_leaves_the_run_alone(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_cli(
            [
                "run",
                "--logs-dir",
                tmp_path / "logs",
                "--run-name",
                "taken",
                "--mode",
                "dashboard",
                "--dashboard-port",
                str(port),
                TRAIN,
                "--steps",
                "3",
            ],
            cwd=tmp_path,
        )
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stderr.splitlines() if "dashboard" in line]
    assert lines[0] == (
        f"traceml: dashboard: cannot listen on 127.0.0.1:{port}: Address already in use; "
        "training and the files go on without it"
    ), res.stderr
    # The files are written as ever; the warning says the live view did not start.
    assert (tmp_path / "logs" / "taken" / "aggregator" / "export" / "step_time.jsonl").is_file()
