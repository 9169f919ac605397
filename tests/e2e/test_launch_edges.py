"""The launcher at its edges: bad names and folders, a dead aggregator, Ctrl-C at any
moment, a script without ``traceml.init()``, an aggregator that cannot start.

Real ``traceml run`` / ``traceml serve`` processes with tiny CPU scripts that do not
import torch (quick to start on a busy machine).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import orjson
import psutil
import pytest

from tests.e2e_helpers import REPO, clean_env, run_cli, start_cli, traceml_cmd, wait_for
from traceml_ai.integrations._ray_config import TraceMLRayConfig

QUICK_TIMEOUT_S = 60.0
"""A refused launch returns at once; this only bounds a test that fails by hanging."""

SCRIPT = """\
import os, sys, time
import traceml_ai as traceml

steps, sleep_s, code = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
out = sys.argv[4]
traceml.init()
open(out + ".started", "w").close()
try:
    for i in range(steps):
        with traceml.trace_step():
            time.sleep(sleep_s)
        # Replaced whole: a rank stopped by a signal mid-write leaves no empty file.
        with open(out + ".steps.tmp", "w") as fh:
            fh.write(str(i + 1))
        os.replace(out + ".steps.tmp", out + ".steps")
except KeyboardInterrupt:
    # The script's own traceback is not TraceML's output; keep stderr for ours.
    sys.exit(130)
traceml.shutdown()
open(out + ".done", "w").close()
sys.exit(code)
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "tiny_train.py"
    path.write_text(SCRIPT)
    return path


def _script_args(
    script: Path, out: Path, *, steps: int = 3, sleep_s: float = 0.0, code: int = 0
) -> list[str]:
    return [str(script), str(steps), repr(sleep_s), str(code), str(out)]


def _assert_one_error_line(res: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("traceml: error: "), res.stderr
    assert "Traceback" not in res.stderr
    for needle in needles:
        # "a|b": either wording (settings resolution may refuse a value first).
        assert any(n in lines[0] for n in needle.split("|")), (needle, lines[0])


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# ------------------------------------------------------------------ item 6: run names

BAD_NAMES = [
    pytest.param("../escape", "is a path", id="dotdot"),
    pytest.param("a/../../b", "is a path", id="nested-dotdot"),
    pytest.param("ABS", "is a path", id="absolute"),
    pytest.param(".", "not a folder name", id="dot"),
    pytest.param("..", "not a folder name", id="dotdot-alone"),
    pytest.param("", "is empty|expected a folder name", id="empty"),
    pytest.param("x" * 300, "300 bytes", id="too-long"),
    pytest.param("é" * 128, "256 bytes", id="too-long-utf8"),
    pytest.param("a\tb", "control character", id="tab"),
    pytest.param("a\x1bb", "control character", id="escape"),
]


@pytest.mark.parametrize(("name", "why"), BAD_NAMES)
@pytest.mark.parametrize("command", ["run", "serve"])
def test_bad_run_name_is_refused_and_creates_nothing(
    tmp_path: Path, script: Path, command: str, name: str, why: str
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    if name == "ABS":
        name = str(tmp_path / "absolute-run")
    before = _tree(tmp_path)
    args: list[str | Path] = [command, "--logs-dir", work / "logs", "--run-name", name]
    if command == "run":
        args += _script_args(script, tmp_path / "marker")
    else:
        args += ["--aggregator-port", "0"]
    res = run_cli(args, cwd=work, timeout=QUICK_TIMEOUT_S)
    _assert_one_error_line(res, "--run-name", why)
    assert _tree(tmp_path) == before, "something was created"


@pytest.mark.parametrize(
    ("session_id", "why"),
    [
        ("x" * 300, "300 bytes"),
        ("a\tb", "control character"),
        ("a\nb", "control character"),
        ("../b", "is a path"),
        ("/abs", "is a path"),
        ("..", "not a folder name"),
    ],
)
def test_ray_session_id_is_checked_like_run_name(session_id: str, why: str) -> None:
    with pytest.raises(ValueError, match=r"TraceMLRayConfig\.session_id") as info:
        TraceMLRayConfig(session_id=session_id)
    assert why in str(info.value)
    assert "\n" not in str(info.value)


def test_ray_session_id_accepts_a_plain_name() -> None:
    assert TraceMLRayConfig(session_id="run-2026.11_a").session_id == "run-2026.11_a"


@pytest.mark.parametrize(
    ("options", "why"),
    [
        pytest.param(["--nnodes", "2", "--master-addr", ""], "--master-addr", id="empty-addr"),
        pytest.param(["--master-port", "70000"], "--master-port must be in [0, 65535]", id="big"),
        pytest.param(
            ["--nnodes", "2", "--master-port", "0"],
            "--master-port must be in [1, 65535] on a job of several nodes",
            id="free-port-across-nodes",
        ),
        pytest.param(
            ["--nnodes", "2", "--node-rank", "1", "--aggregator-port", "0"],
            "--aggregator-port 0 picks a free port, which the other nodes cannot know",
            id="free-aggregator-port-across-nodes",
        ),
    ],
)
def test_a_rendezvous_option_no_node_can_use_is_one_line(
    tmp_path: Path, script: Path, options: list[str], why: str
) -> None:
    """Refused before anything starts: torchrun would end in a traceback of its own, a
    relay given an empty host in one of ours, a node given port 0 would wait forever."""
    res = run_cli(
        ["run", "--run-name", "r1", *options, *_script_args(script, tmp_path / "marker")],
        cwd=tmp_path,
        timeout=QUICK_TIMEOUT_S,
    )
    _assert_one_error_line(res, why)
    assert not (tmp_path / "logs").exists()
    assert not (tmp_path / "marker.started").exists()


# ------------------------------------------------------------------ item 7: logs dir


@contextlib.contextmanager
def _read_only_folder(path: Path) -> Iterator[None]:
    """``path`` as a folder nobody can write in: a read-only mount as root (chmod does
    not stop root), else permission bits."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr!r}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=False)


@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize("case", ["file", "under-a-file", "read-only", "under-read-only"])
def test_unusable_logs_dir_is_one_line(
    tmp_path: Path, script: Path, command: str, case: str
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    blocker = work / "blocker"
    with contextlib.ExitStack() as stack:
        if case == "file":
            blocker.write_text("not a folder\n")
            logs, why = blocker, "is not a folder"
        elif case == "under-a-file":
            blocker.write_text("not a folder\n")
            logs, why = blocker / "logs", "is not a folder"
        else:
            stack.enter_context(_read_only_folder(blocker))
            logs = blocker if case == "read-only" else blocker / "logs"
            why = "is not writable"
        args: list[str | Path] = [command, "--logs-dir", logs, "--run-name", "r1"]
        if command == "run":
            args += _script_args(script, tmp_path / "marker")
        else:
            args += ["--aggregator-port", "0"]
        res = run_cli(args, cwd=work, timeout=QUICK_TIMEOUT_S)
        _assert_one_error_line(res, "--logs-dir", why)
        assert "cannot listen" not in res.stderr
    assert not (tmp_path / "marker.started").exists()


# ------------------------------------------------------------ item 8: existing folders


@pytest.mark.parametrize("case", ["empty", "export-off-run", "crashed-run", "dangling-symlink"])
def test_run_refuses_any_existing_run_folder(tmp_path: Path, script: Path, case: str) -> None:
    logs = tmp_path / "logs"
    run_dir = logs / "r1"
    logs.mkdir()
    if case == "dangling-symlink":
        run_dir.symlink_to(tmp_path / "nowhere")
    else:
        run_dir.mkdir()
    if case == "export-off-run":
        (run_dir / "notes.txt").write_text("an earlier run without export\n")
    elif case == "crashed-run":
        export = run_dir / "aggregator" / "export"
        export.mkdir(parents=True)
        (export / "step_time.jsonl").write_bytes(b'{"stream":"step_time"}\n')
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    res = run_cli(
        [
            "run",
            "--logs-dir",
            logs,
            "--run-name",
            "r1",
            "--exporter",
            "jsonl",
            *_script_args(script, tmp_path / "marker"),
        ],
        cwd=tmp_path,
        timeout=QUICK_TIMEOUT_S,
    )
    _assert_one_error_line(res, str(run_dir), "already exists", "pick a new --run-name")
    assert not (tmp_path / "marker.started").exists(), "the script was launched"
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def _serve_until_env_line(args: Sequence[str | Path], cwd: Path) -> subprocess.Popen[str]:
    proc = start_cli(args, cwd=cwd, new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("export TRACEML_AGGREGATOR_ADDR="), line
    return proc


def test_serve_into_a_used_run_folder_keeps_the_earlier_run(tmp_path: Path, script: Path) -> None:
    logs = tmp_path / "logs"
    first = run_cli(
        [
            "run",
            "--logs-dir",
            logs,
            "--run-name",
            "r1",
            "--exporter",
            "jsonl",
            *_script_args(script, tmp_path / "marker"),
        ],
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr
    run_dir = logs / "r1"
    # Stand-in for an earlier run that left a warning of its own.
    from traceml_ai.export._finalize import RankOutcome, write_finalization_warning

    write_finalization_warning(
        run_dir,
        export_loss=None,
        ranks=RankOutcome(expected_world_size=2, finished_ranks=(0,), missing_ranks=(1,)),
        reason_if_ranks="ranks_disconnected",
    )
    earlier = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert run_dir / "aggregator" / "stats.json" in earlier

    proc = _serve_until_env_line(
        [
            "serve",
            "--logs-dir",
            logs,
            "--run-name",
            "r1",
            "--exporter",
            "jsonl",
            "--aggregator-port",
            "0",
        ],
        tmp_path,
    )
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=QUICK_TIMEOUT_S)
    assert proc.returncode == 0, err
    assert "Traceback" not in err

    # No file of the earlier run was replaced or appended to.
    for path, data in earlier.items():
        if path.name == "finalization_warning.json":
            continue
        assert path.read_bytes() == data, path
    assert (run_dir / "finalization_warning.earlier.json").read_bytes() == earlier[
        run_dir / "finalization_warning.json"
    ]
    # This run's own stats and warning: export off, exporter_failed.
    stats = orjson.loads((run_dir / "aggregator" / "stats.1.json").read_bytes())
    assert stats["exporter_failed"] is True
    warning = orjson.loads((run_dir / "finalization_warning.json").read_bytes())
    assert warning["export"]["exporter_failed"] is True
    assert warning["export"]["written_records"] == 0
    # validate tells the earlier run's export files apart from this run's warning.
    res = run_cli(["validate", run_dir], cwd=tmp_path, timeout=QUICK_TIMEOUT_S)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "earlier run" in res.stdout


# ------------------------------------------------------------ item 2: aggregator dies


def _aggregator_of(launcher: psutil.Process) -> psutil.Process:
    for child in launcher.children():
        with contextlib.suppress(psutil.Error):
            if "traceml_ai.aggregator" in child.cmdline():
                return child
    raise AssertionError("no aggregator child")


@pytest.mark.parametrize("code", [0, 3])
def test_killed_aggregator_leaves_a_warning_and_spares_the_ranks(
    tmp_path: Path, script: Path, code: int
) -> None:
    logs = tmp_path / "logs"
    marker = tmp_path / "marker"
    steps = 60
    err_path = tmp_path / "run.err"
    with err_path.open("w") as err_file:
        proc = subprocess.Popen(
            traceml_cmd(
                "run",
                "--logs-dir",
                logs,
                "--run-name",
                "r1",
                "--exporter",
                "jsonl",
                "--interval",
                "0.2",
                *_script_args(script, marker, steps=steps, sleep_s=0.1, code=code),
            ),
            cwd=tmp_path,
            env=clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            stdin=subprocess.DEVNULL,
            text=True,
        )
    step_time = logs / "r1" / "aggregator" / "export" / "step_time.jsonl"
    try:
        wait_for(
            lambda: step_time.exists() and step_time.read_bytes().count(b"\n") >= 2,
            timeout=90,
            what="two step_time lines",
        )
        _aggregator_of(psutil.Process(proc.pid)).kill()
        # Said at once, while the script still trains (it has seconds of steps left).
        wait_for(
            lambda: "during the run: training goes on" in err_path.read_text(),
            timeout=30,
            what="the launcher's line on the dead aggregator",
        )
        assert not (tmp_path / "marker.done").exists()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err_path.read_text()
    assert proc.returncode == code, err
    assert "Traceback" not in err
    # The ranks were not hurt: every step ran and the script ended normally.
    assert (tmp_path / "marker.steps").read_text() == str(steps)
    assert (tmp_path / "marker.done").exists()
    lines = [ln for ln in err.splitlines() if "the aggregator" in ln]
    assert len(lines) == 2, err
    assert lines[0] == (
        "traceml: the aggregator was killed by SIGKILL during the run: training goes on "
        "without telemetry or live views, and nothing more is recorded; the export files "
        "keep what it wrote, without closing lines (the end of the run says what was lost)"
    ), err
    assert lines[1].startswith("traceml: the aggregator was killed by SIGKILL"), err
    assert "finalization_warning.json" in lines[1]
    data = step_time.read_bytes()
    assert b'"closing"' not in data, "the files must stay as they are"
    warning = orjson.loads((logs / "r1" / "finalization_warning.json").read_bytes())
    assert warning["export"]["exporter_failed"] is True
    assert warning["export"]["written_records"] == data.count(b"\n")
    assert "aggregator" in warning["message"]
    if code == 0:
        assert warning["reason"] == "export_incomplete"
    else:
        assert warning["reason"] == "ranks_disconnected"
    res = run_cli(["validate", logs / "r1"], cwd=tmp_path, timeout=QUICK_TIMEOUT_S)
    # The file without its closing line is reported, the warning itself is valid.
    assert "no closing line" in res.stdout
    assert "finalization_warning.json: finalization warning, OK" in res.stdout


# ------------------------------------------------------- item 10: no traceml.init()


def test_script_without_init_names_the_likely_cause(tmp_path: Path) -> None:
    script = tmp_path / "no_init.py"
    script.write_text("print('training without traceml')\n")
    res = run_cli(
        ["run", "--logs-dir", tmp_path / "logs", "--run-name", "r1", "--exporter", "jsonl", script],
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert "no rank connected to the aggregator" in res.stderr
    assert "traceml.init()" in res.stderr
    assert "something was lost" not in res.stderr
    warning = orjson.loads((tmp_path / "logs" / "r1" / "finalization_warning.json").read_bytes())
    assert warning["reason"] == "ranks_disconnected"
    assert warning["missing_ranks"] == [0]


# ------------------------------------------------ item 12: aggregator cannot start


def test_ranks_say_the_aggregator_did_not_start(tmp_path: Path, script: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = run_cli(
            [
                "run",
                "--logs-dir",
                tmp_path / "logs",
                "--run-name",
                "r1",
                "--exporter",
                "jsonl",
                "--aggregator-port",
                str(port),
                *_script_args(script, tmp_path / "marker"),
            ],
            cwd=tmp_path,
        )
    assert res.returncode == 0, res.stderr
    assert "not launched by" not in res.stderr
    assert "traceml: the aggregator did not start (cannot listen on" in res.stderr
    assert "telemetry is off for this run" in res.stderr


# ----------------------------------------------------------------- item 11: Ctrl-C

BAD_OUTPUT = ("Traceback", "Aborted!", "BrokenPipeError")


def _launch(
    args: Sequence[str | Path], cwd: Path, *, ignore_sigint: bool = False
) -> subprocess.Popen[str]:
    def preexec() -> None:
        os.setsid()
        if ignore_sigint:
            # What `cmd &` in a non-interactive shell (or nohup for SIGHUP) hands down.
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    return subprocess.Popen(
        traceml_cmd(*args),
        cwd=cwd,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        preexec_fn=preexec,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        raise AssertionError(f"launcher did not stop: {err}") from None
    for bad in BAD_OUTPUT:
        assert bad not in err, err
    return err


def _no_process_left(tmp_path: Path) -> None:
    """No process of this test's run (aggregator, ranks: their command lines name
    ``tmp_path``) is still alive after the launcher."""

    def none_left() -> bool:
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if any(str(tmp_path) in part for part in p.info["cmdline"] or ()):
                    return False
        return True

    wait_for(none_left, timeout=30, what=f"processes of {tmp_path} to end")


def test_ctrl_c_while_the_aggregator_starts(tmp_path: Path, script: Path) -> None:
    logs = tmp_path / "logs"
    proc = _launch(
        [
            "run",
            "--logs-dir",
            logs,
            "--run-name",
            "r1",
            "--exporter",
            "tests.launch_edge_exporters:make_slow_start",
            *_script_args(script, tmp_path / "marker"),
        ],
        REPO,
    )
    wait_for(lambda: (logs / "r1").is_dir(), timeout=60, what="the run folder")
    time.sleep(1.0)  # the factory sleeps 4 s: the aggregator is still starting
    os.killpg(proc.pid, signal.SIGINT)
    err = _finish(proc)
    assert proc.returncode == 130, err
    assert not (tmp_path / "marker.started").exists(), "ranks started after Ctrl-C"
    assert "interrupted (SIGINT) before the training script started" in err
    _no_process_left(tmp_path)


@pytest.mark.parametrize("ignore_sigint", [False, True], ids=["plain", "sigint-ignored"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_training_stops_the_ranks(
    tmp_path: Path, script: Path, ignore_sigint: bool, sig: signal.Signals
) -> None:
    logs = tmp_path / "logs"
    marker = tmp_path / "marker"
    proc = _launch(
        [
            "run",
            "--logs-dir",
            logs,
            "--run-name",
            "r1",
            "--exporter",
            "jsonl",
            *_script_args(script, marker, steps=600, sleep_s=0.1),
        ],
        tmp_path,
        ignore_sigint=ignore_sigint,
    )
    wait_for(lambda: (tmp_path / "marker.steps").exists(), timeout=90, what="training")
    # To the launcher alone, as `kill -INT <pid>` would; a terminal's Ctrl-C reaches
    # the same process group (the ranks have their own).
    os.kill(proc.pid, sig)
    err = _finish(proc, timeout=60)
    assert proc.returncode == 128 + sig, err
    assert not (tmp_path / "marker.done").exists()
    assert int((tmp_path / "marker.steps").read_text()) < 600
    _no_process_left(tmp_path)


def test_sigterm_to_torchrun_ranks_names_the_signal_not_a_crash(
    tmp_path: Path, script: Path
) -> None:
    """torchrun passes the SIGTERM on to its workers, which end without their exit
    handlers: the end of the run says so, rather than blaming os._exit() or a crash."""
    logs = tmp_path / "logs"
    marker = tmp_path / "marker"
    proc = _launch(
        [
            "run",
            "--nproc-per-node",
            "2",
            "--logs-dir",
            logs,
            "--run-name",
            "r1",
            "--exporter",
            "jsonl",
            *_script_args(script, marker, steps=600, sleep_s=0.1),
        ],
        tmp_path,
    )
    wait_for(lambda: (tmp_path / "marker.steps").exists(), timeout=120, what="training")
    os.kill(proc.pid, signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # (torchrun's own SignalException traceback is above ours: torch's, not TraceML's.)
    abrupt = [line for line in err.splitlines() if "without shutting down TraceML" in line]
    assert len(abrupt) == 1, err
    assert "stopped after the SIGTERM passed on to the ranks" in abrupt[0], abrupt[0]
    assert "os._exit() or a crash" not in abrupt[0], abrupt[0]
    _no_process_left(tmp_path)


def _rank_alive(launcher_pid: int) -> bool:
    """Whether a rank process (the bootstrap) of this launcher still runs."""
    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.Error:
        return False
    for child in children:
        with contextlib.suppress(psutil.Error):
            if "traceml_ai.launch.bootstrap" in " ".join(child.cmdline()):
                return True
    return False


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_during_finalization(tmp_path: Path, script: Path, presses: int) -> None:
    logs = tmp_path / "logs"
    marker = tmp_path / "marker"
    proc = _launch(
        [
            "run",
            "--logs-dir",
            logs,
            "--run-name",
            "r1",
            "--interval",
            "0.1",
            "--finalize-timeout-sec",
            "6",
            "--exporter",
            "tests.launch_edge_exporters:make_slow_export",
            "--export-streams",
            "all",
            *_script_args(script, marker, steps=40, sleep_s=0.02),
        ],
        REPO,
    )
    wait_for(lambda: (tmp_path / "marker.done").exists(), timeout=90, what="training to end")
    # The launcher waits for the slow drain once the rank has exited (a busy machine
    # may take a while between the script's last line and the rank's exit).
    wait_for(lambda: not _rank_alive(proc.pid), timeout=60, what="the rank to exit")
    time.sleep(0.5)
    for _ in range(presses):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.3)
    err = _finish(proc)
    assert proc.returncode == 0, err  # the script's own code
    assert "traceml: finishing the export" in err
    if presses == 2:
        assert "the aggregator was stopped by a second Ctrl-C" in err
    _no_process_left(tmp_path)


def test_launcher_killed_leaves_no_broken_pipe(tmp_path: Path, script: Path) -> None:
    """SIGKILL the launcher: its aggregator still finalizes, silently, into a closed pipe."""
    logs = tmp_path / "logs"
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen(
            traceml_cmd(
                "run",
                "--logs-dir",
                logs,
                "--run-name",
                "r1",
                "--exporter",
                "jsonl",
                *_script_args(script, tmp_path / "marker", steps=20, sleep_s=0.05),
            ),
            cwd=tmp_path,
            env=clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            stdin=subprocess.DEVNULL,
        )
        wait_for(lambda: (tmp_path / "marker.started").exists(), timeout=90, what="training")
        proc.kill()
        proc.wait()
        # The ranks and the aggregator outlive the launcher; wait for all to end.
        _no_process_left(tmp_path)
    err = err_path.read_text()
    for bad in BAD_OUTPUT:
        assert bad not in err, err
    step_time = logs / "r1" / "aggregator" / "export" / "step_time.jsonl"
    assert b'"closing":true' in step_time.read_bytes()
