"""End to end: the real ``traceml`` CLI, real CPU torch training, real files.

Each test starts ``traceml run`` / ``traceml serve`` (and ``torchrun``) as
subprocesses with an explicit environment (no inherited ``TRACEML_*``), in a
temporary working directory, with logs under ``tmp_path``. Runs are kept short
(a few steps, ``--interval 0.2``); nothing asserts on timing, and every process
has a timeout. The plain runs of examples/train.py start two at a time when the module
starts (the ``train_runs`` fixture), each read by its test.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from tests.e2e_helpers import (
    ALL_FILES,
    INTERNAL_PHASES,
    PY,
    RUN_TIMEOUT_S,
    TRAIN,
    assert_valid,
    clean_env,
    closing_line,
    data_lines,
    export_dir,
    export_files,
    free_port,
    has_data_line,
    read_lines,
    run_cli,
    traceml_cmd,
    train_run_args,
    wait_for,
    warning_file,
)
from traceml_records import SELECTION_NAMES, loads_line

ALL_JSONL = {f"{s}.jsonl" for s in ALL_FILES}
HOSTNAME_STREAMS = set(ALL_FILES) - {"stdout_stderr"}


def _ok(res: subprocess.CompletedProcess[str], code: int = 0) -> None:
    assert res.returncode == code, f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"


def _check_step_time(lines: list[dict[str, object]], steps: int, ranks: int) -> None:
    assert len(lines) == steps * ranks
    keys = {(d["global_rank"], d["step"]) for d in lines}
    assert keys == {(r, s) for r in range(ranks) for s in range(1, steps + 1)}
    for d in lines:
        events = d["events"]
        assert isinstance(events, dict)
        for phase in INTERNAL_PHASES:
            assert phase in events, (phase, sorted(events))
            assert set(events[phase]) == {"cpu"}
            timing = events[phase]["cpu"]
            assert timing["gpu_ms"] is None and timing["is_gpu"] is False
        # Typed reading agrees with the raw line.
        loads_line(orjson.dumps(d))


# --------------------------------------------------------------------------- runs

TrainRuns = dict[str, tuple[Path, subprocess.CompletedProcess[str]]]


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory: pytest.TempPathFactory) -> TrainRuns:
    """run name -> its logs folder and ``traceml run``'s result: examples/train.py runs,
    two at a time (a run is mostly its processes' start and torch's import)."""
    root = tmp_path_factory.mktemp("train_runs")
    options: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
        "one": (("--exporter", "jsonl"), {"steps": 5}),
        "ddp": (
            ("--nproc-per-node", "2", "--master-port", str(free_port()),
             "--exporter", "jsonl", "--export-streams", "all"),
            {"steps": 4},
        ),
        "host": (("--exporter", "jsonl", "--export-streams", "all", "--exporter-hostname"), {}),
        "fail": (
            ("--exporter", "jsonl", "--export-streams", "step_time,step_memory"),
            {"steps": 6, "script_args": ["--fail-at-step", "3"]},
        ),
    }  # fmt: skip

    def one(name: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
        folder = root / name
        folder.mkdir()
        flags, keywords = options[name]
        logs = folder / "logs"
        return logs, run_cli(train_run_args(logs, name, *flags, **keywords), cwd=folder)

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(one, name) for name in options}
        return {name: future.result() for name, future in futures.items()}


def test_one_rank_default_streams(train_runs: TrainRuns, tmp_path: Path) -> None:
    logs, res = train_runs["one"]
    _ok(res)
    assert export_files(logs, "one") == {"step_time.jsonl"}
    path = export_dir(logs, "one") / "step_time.jsonl"
    lines = data_lines(path)
    _check_step_time(lines, steps=5, ranks=1)
    for d in lines:
        assert "hostname" not in d
        assert (d["rank"], d["world_size"], d["local_world_size"], d["node_rank"]) == (0, 1, 1, 0)
    assert closing_line(path)["dropped_batches"] == 0
    assert warning_file(logs, "one") is None
    assert_valid(path, tmp_path)
    assert_valid(logs / "one", tmp_path)


def test_two_ranks_ddp_all_streams(train_runs: TrainRuns, tmp_path: Path) -> None:
    logs, res = train_runs["ddp"]
    steps = 4
    _ok(res)
    folder = export_dir(logs, "ddp")
    assert export_files(logs, "ddp") == ALL_JSONL
    data = {s: data_lines(folder / f"{s}.jsonl") for s in ALL_FILES}

    _check_step_time(data["step_time"], steps=steps, ranks=2)
    mem_keys = [(d["global_rank"], d["device"], d["step"]) for d in data["step_memory"]]
    assert len(mem_keys) == len(set(mem_keys))
    assert set(mem_keys) == {(r, "cpu", s) for r in range(2) for s in range(1, steps + 1)}
    assert {d["global_rank"] for d in data["process"]} == {0, 1}
    assert data["system"], "local rank 0 sends system snapshots"
    assert {(d["global_rank"], d["local_rank"]) for d in data["system"]} == {(0, 0)}
    # One system_gpu line per GPU of each snapshot: none on a host without GPUs.
    assert len(data["system_gpu"]) == sum(d["gpu_count"] for d in data["system"])
    if not Path("/dev/nvidia0").exists():
        assert data["system_gpu"] == []
    env_lines = data["runtime_environment"]
    assert sorted(d["global_rank"] for d in env_lines) == [0, 1]
    for d in env_lines:
        assert d["training_strategy"] == "ddp"
        assert d["distributed_backend"] == "gloo"
        assert d["distributed_initialized"] is True
        assert d["topology"] == "single_node_multi_process"
        assert d["world_size"] == 2
    assert data["stdout_stderr"] == []
    # DDP's gradient buckets, every step of each rank, through TraceML's hook.
    buckets = {
        (d["global_rank"], d["step"])
        for d in data["collectives"]
        if (d["phase"], d["op"], d["source"])
        == ("_traceml_internal:backward_time", "all_reduce", "ddp_comm_hook")
    }
    assert buckets == {(r, s) for r in range(2) for s in range(1, steps + 1)}
    assert all(d["wait_measure"] == "host" and d["wait_ms"] >= 0 for d in data["collectives"])
    for d in (line for lines in data.values() for line in lines):
        assert "hostname" not in d
        if d["stream"] != "stdout_stderr":
            assert d["world_size"] == 2
    dropped = {closing_line(folder / f"{s}.jsonl")["dropped_batches"] for s in ALL_FILES}
    assert dropped == {0}
    assert warning_file(logs, "ddp") is None
    assert_valid(logs / "ddp", tmp_path)


def test_exporter_hostname_on_every_line_but_stdout_stderr(
    train_runs: TrainRuns, tmp_path: Path
) -> None:
    logs, res = train_runs["host"]
    _ok(res)
    folder = export_dir(logs, "host")
    assert export_files(logs, "host") == ALL_JSONL
    for stream in ALL_FILES:
        lines = read_lines(folder / f"{stream}.jsonl")
        closing = lines[-1]
        assert closing.get("closing") is True and "hostname" not in closing
        for d in data_lines(folder / f"{stream}.jsonl"):
            if stream in HOSTNAME_STREAMS:
                assert d["hostname"] == socket.gethostname(), (stream, d)
                # Right after the identity block's node_rank, before timestamp_unix_ns.
                keys = list(d)
                assert keys[keys.index("node_rank") + 1] == "hostname"
            else:
                assert "hostname" not in d
    # Every hostname-carrying stream this CPU run fills had lines to check.
    for stream in ("step_time", "step_memory", "process", "system", "runtime_environment"):
        assert data_lines(folder / f"{stream}.jsonl"), stream
    assert_valid(logs / "host", tmp_path)


def test_script_failure_exit_code_and_closed_files(train_runs: TrainRuns, tmp_path: Path) -> None:
    logs, res = train_runs["fail"]
    _ok(res, 1)
    assert "failing on purpose at step 3" in res.stderr
    folder = export_dir(logs, "fail")
    assert export_files(logs, "fail") == {"step_time.jsonl", "step_memory.jsonl"}
    _check_step_time(data_lines(folder / "step_time.jsonl"), steps=3, ranks=1)
    assert len(data_lines(folder / "step_memory.jsonl")) == 3
    assert_valid(logs / "fail", tmp_path)


# --------------------------------------------------------------------------- settings


def _yaml(tmp_path: Path, text: str) -> None:
    (tmp_path / "traceml.yaml").write_text(textwrap.dedent(text))


@pytest.mark.parametrize(
    ("yaml_text", "env", "flags", "files", "hostname"),
    [
        # exporter: yaml > default; export_streams: flag > env; hostname: env > yaml.
        (
            "exporter: jsonl\nexport_streams: step_memory\nexporter_hostname: false\n",
            {"TRACEML_EXPORT_STREAMS": "step_time,process", "TRACEML_EXPORTER_HOSTNAME": "1"},
            ["--export-streams", "step_time"],
            {"step_time.jsonl"},
            True,
        ),
        # exporter: env > yaml; export_streams: yaml > default; hostname: flag > env.
        (
            "exporter: nonexistent_mod:make\nexport_streams: step_memory\nexporter_hostname: true\n",
            {"TRACEML_EXPORTER": "jsonl", "TRACEML_EXPORTER_HOSTNAME": "0"},
            ["--exporter-hostname"],
            {"step_memory.jsonl"},
            True,
        ),
        # exporter: flag > env; export_streams: env > yaml; hostname: yaml > default.
        (
            "export_streams: step_memory\nexporter_hostname: true\n",
            {"TRACEML_EXPORTER": "nonexistent_mod:make", "TRACEML_EXPORT_STREAMS": "process"},
            ["--exporter", "jsonl"],
            {"process.jsonl"},
            True,
        ),
        # An empty TRACEML_EXPORTER switches export off over the yaml; hostname: yaml false.
        (
            "exporter: jsonl\nexport_streams: all\nexporter_hostname: false\n",
            {"TRACEML_EXPORTER": ""},
            [],
            set(),
            False,
        ),
        # Nothing set anywhere: export is off by default.
        (None, {}, [], set(), False),
    ],
    ids=[
        "flag-streams_env-host",
        "env-exporter_flag-host",
        "flag-exporter_env-streams",
        "env-off",
        "default-off",
    ],
)
def test_settings_precedence_through_cli(
    tmp_path: Path,
    yaml_text: str | None,
    env: dict[str, str],
    flags: list[str],
    files: set[str],
    hostname: bool,
) -> None:
    if yaml_text is not None:
        _yaml(tmp_path, yaml_text)
    logs = tmp_path / "logs"
    res = run_cli(train_run_args(logs, "prec", *flags, steps=3), cwd=tmp_path, env=env)
    _ok(res)
    assert (logs / "prec").is_dir()
    assert export_files(logs, "prec") == files
    # A losing custom exporter value was never loaded: nothing failed.
    assert warning_file(logs, "prec") is None
    assert "nonexistent_mod" not in res.stderr
    for name in files:
        lines = data_lines(export_dir(logs, "prec") / name)
        assert lines
        for d in lines:
            assert ("hostname" in d) is hostname
    if files:
        assert_valid(logs / "prec", tmp_path)


@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize("source", ["flag", "env", "yaml"])
@pytest.mark.parametrize("exporter", ["jsonl", ""])
def test_unknown_stream_stops_before_launch(
    tmp_path: Path, command: str, source: str, exporter: str
) -> None:
    logs = tmp_path / "logs"
    marker = tmp_path / "launched"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    args: list[str | Path] = [command, "--logs-dir", logs, "--run-name", "bad"]
    env = {"TRACEML_EXPORTER": exporter}
    if source == "flag":
        args += ["--export-streams", "step_time,gpu_temperature"]
    elif source == "env":
        env["TRACEML_EXPORT_STREAMS"] = "step_time,gpu_temperature"
    else:
        _yaml(tmp_path, "export_streams: step_time, gpu_temperature\n")
    if command == "serve":
        args += ["--aggregator-port", "0", "--nproc-per-node", "1"]
    else:
        args += [script]
    res = run_cli(args, cwd=tmp_path, env=env, timeout=60)
    _ok(res, 2)
    assert "gpu_temperature" in res.stderr
    for name in SELECTION_NAMES:
        assert name in res.stderr, (name, res.stderr)
    assert "TRACEML_AGGREGATOR_ADDR" not in res.stdout
    assert not logs.exists()
    assert not marker.exists()


def test_existing_run_folder_and_bad_numbers_exit_2(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    marker = tmp_path / "launched"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    existing = logs / "taken"
    existing.mkdir(parents=True)
    (existing / "notes.txt").write_bytes(b"mine\n")

    res = run_cli(
        ["run", "--logs-dir", logs, "--run-name", "taken", "--exporter", "jsonl", script],
        cwd=tmp_path,
    )
    _ok(res, 2)
    assert "already exists" in res.stderr
    assert not marker.exists()
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]

    bad_options = [
        ["--nproc-per-node", "0"],
        ["--nnodes", "0"],
        ["--node-rank", "1"],
        ["--interval", "0"],
        ["--finalize-timeout-sec", "-1"],
        ["--aggregator-port", "70000"],
    ]
    for i, option in enumerate(bad_options):
        name = f"bad{i}"
        res = run_cli(
            ["run", "--logs-dir", logs, "--run-name", name, "--exporter", "jsonl", *option, script],
            cwd=tmp_path,
            timeout=60,
        )
        _ok(res, 2)
        assert option[0] in res.stderr, res.stderr
        assert not (logs / name).exists(), option
        assert not marker.exists(), option
    for option in (["--nproc-per-node", "0"], ["--finalize-timeout-sec", "0"]):
        res = run_cli(
            ["serve", "--logs-dir", logs, "--run-name", "srv", "--aggregator-port", "0", *option],
            cwd=tmp_path,
            timeout=60,
        )
        _ok(res, 2)
        assert not (logs / "srv").exists(), option


# --------------------------------------------------------------------------- serve


def _start_serve(tmp_path: Path, *args: str | Path) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """Start ``traceml serve ARGS`` and read the environment line it prints."""
    proc = subprocess.Popen(
        traceml_cmd("serve", "--aggregator-port", "0", *args),
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    # readline blocks until serve prints; serve is bounded by the overall test timeout.
    line = proc.stdout.readline().strip()
    if not line.startswith("export "):
        proc.kill()
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"serve printed {line!r}\n{out}\n{err}")
    env = dict(item.split("=", 1) for item in line.removeprefix("export ").split())
    assert set(env) == {"TRACEML_AGGREGATOR_ADDR", "TRACEML_RUN_TOKEN"}
    return proc, env


def _torchrun(
    tmp_path: Path, env: dict[str, str], nproc: int, steps: int
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            PY,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
            str(TRAIN),
            "--steps",
            str(steps),
        ],
        cwd=tmp_path,
        env=clean_env({**env, "TRACEML_SAMPLER_INTERVAL": "0.2"}),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=30)
        raise
    return proc.returncode, err


def test_serve_torchrun_two_ranks(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    serve, env = _start_serve(
        tmp_path,
        "--logs-dir",
        logs,
        "--run-name",
        "srv",
        "--nproc-per-node",
        "2",
        "--exporter",
        "jsonl",
        "--export-streams",
        "all",
    )
    try:
        train = _torchrun(tmp_path, env, nproc=2, steps=4)
    except BaseException:
        serve.kill()
        raise
    assert train.returncode == 0, train.stderr
    # serve finalizes by itself once both ranks finished: no signal is sent to it.
    code, err = _finish(serve)
    assert code == 0, err
    folder = export_dir(logs, "srv")
    assert export_files(logs, "srv") == ALL_JSONL
    _check_step_time(data_lines(folder / "step_time.jsonl"), steps=4, ranks=2)
    env_lines = data_lines(folder / "runtime_environment.jsonl")
    assert sorted(d["global_rank"] for d in env_lines) == [0, 1]
    assert {d["training_strategy"] for d in env_lines} == {"ddp"}
    for stream in ALL_FILES:
        data_lines(folder / f"{stream}.jsonl")
    assert warning_file(logs, "srv") is None
    assert_valid(logs / "srv", tmp_path)


def test_serve_existing_export_file_turns_export_off(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    folder = export_dir(logs, "mine")
    folder.mkdir(parents=True)
    user_bytes = b'{"my":"own data"}\nnot even json\n'
    (folder / "step_time.jsonl").write_bytes(user_bytes)
    serve, env = _start_serve(
        tmp_path,
        "--logs-dir",
        logs,
        "--run-name",
        "mine",
        "--nproc-per-node",
        "1",
        "--exporter",
        "jsonl",
    )
    try:
        train = _torchrun(tmp_path, env, nproc=1, steps=4)
    except BaseException:
        serve.kill()
        raise
    assert train.returncode == 0, train.stderr
    code, err = _finish(serve)
    assert code == 0, err
    assert (folder / "step_time.jsonl").read_bytes() == user_bytes
    assert sorted(p.name for p in folder.iterdir()) == ["step_time.jsonl"]
    warning = warning_file(logs, "mine")
    assert warning is not None, err
    assert warning["reason"] == "export_incomplete"
    assert warning["export"]["exporter_failed"] is True
    assert warning["export"]["failed_records"] >= 4
    assert warning["export"]["written_records"] == 0
    assert "finalization_warning.json" in err
    assert_valid(logs / "mine" / "finalization_warning.json", tmp_path)


def test_serve_busy_port_leaves_no_export_file_and_retry_exports(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = run_cli(
            [
                "serve",
                "--logs-dir",
                logs,
                "--run-name",
                "retry",
                "--aggregator-port",
                str(port),
                "--exporter",
                "jsonl",
            ],
            cwd=tmp_path,
            timeout=60,
        )
    _ok(res, 1)
    assert "cannot listen" in res.stderr
    assert export_files(logs, "retry") == set()
    # The same run folder again, on a free port: export is on (no leftover file).
    serve, _ = _start_serve(
        tmp_path, "--logs-dir", logs, "--run-name", "retry", "--exporter", "jsonl"
    )
    serve.send_signal(signal.SIGINT)
    code, err = _finish(serve)
    assert code == 0, err
    assert data_lines(export_dir(logs, "retry") / "step_time.jsonl") == []
    warning = warning_file(logs, "retry")
    assert warning is None or "export" not in warning, warning


def test_run_aggregator_cannot_listen_training_goes_on_loss_reported(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = run_cli(
            train_run_args(
                logs, "nolisten", "--aggregator-port", str(port), "--exporter", "jsonl", steps=2
            ),
            cwd=tmp_path,
        )
    _ok(res)
    assert "cannot listen" in res.stderr
    assert export_files(logs, "nolisten") == set()
    warning = warning_file(logs, "nolisten")
    assert warning is not None, res.stderr
    assert warning["reason"] == "export_incomplete"
    assert warning["export"]["exporter_failed"] is True
    assert_valid(logs / "nolisten", tmp_path)


# --------------------------------------------------------------------------- signals


def _popen_run(tmp_path: Path, args: list[str | Path]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        traceml_cmd(*args),
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def test_sigint_is_forwarded_and_run_finalizes(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = _popen_run(
        tmp_path,
        train_run_args(
            logs,
            "int",
            "--exporter",
            "jsonl",
            "--export-streams",
            "step_time,process",
            steps=400,
            script_args=["--sleep-ms", "200"],
        ),
    )
    path = export_dir(logs, "int") / "step_time.jsonl"
    try:
        wait_for(lambda: has_data_line(path), timeout=120, what="the first step_time line")
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        code, err = _finish(proc, timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code != 0, err
    assert "KeyboardInterrupt" in err
    lines = data_lines(path)
    assert 1 <= len(lines) < 400
    data_lines(path.with_name("process.jsonl"))
    assert_valid(logs / "int", tmp_path)


def test_aggregator_killed_training_goes_on(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = _popen_run(
        tmp_path,
        train_run_args(
            logs,
            "kill",
            "--exporter",
            "jsonl",
            "--export-streams",
            "step_time,process,system",
            steps=30,
            script_args=["--sleep-ms", "100"],
        ),
    )
    path = export_dir(logs, "kill") / "step_time.jsonl"
    try:
        wait_for(lambda: has_data_line(path), timeout=120, what="the first step_time line")
        children = psutil.Process(proc.pid).children()
        aggregators = [c for c in children if "traceml_ai.aggregator" in " ".join(c.cmdline())]
        assert len(aggregators) == 1, [c.cmdline() for c in children]
        aggregators[0].kill()
        code, err = _finish(proc, timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, err
    assert "the aggregator was killed by SIGKILL during the run" in err
    assert "Traceback" not in err
    # Training went on to its last step after the aggregator died; export files end
    # without closing lines because the aggregator never finalized.
    assert b'"closing"' not in path.read_bytes()
    assert has_data_line(path)


def test_launcher_killed_aggregator_finalizes_on_its_own(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = _popen_run(
        tmp_path,
        train_run_args(
            logs,
            "orphan",
            "--exporter",
            "jsonl",
            steps=12,
            script_args=["--sleep-ms", "100"],
        ),
    )
    path = export_dir(logs, "orphan") / "step_time.jsonl"
    leftovers: list[psutil.Process] = []
    try:
        wait_for(lambda: has_data_line(path), timeout=120, what="the first step_time line")
        leftovers = psutil.Process(proc.pid).children()
        assert any("traceml_ai.aggregator" in " ".join(c.cmdline()) for c in leftovers)
        assert any(str(TRAIN) in c.cmdline() for c in leftovers)
        proc.kill()
        proc.communicate(timeout=30)
        # The rank (own session) trains on; then the aggregator finalizes and exits
        # by itself instead of serving forever.
        _, alive = psutil.wait_procs(leftovers, timeout=180)
        assert not alive, [c.cmdline() for c in alive]
    finally:
        for child in leftovers:
            with contextlib.suppress(psutil.Error):
                child.kill()
    _check_step_time(data_lines(path), steps=12, ranks=1)
    assert_valid(logs / "orphan", tmp_path)


# --------------------------------------------------------------------------- custom exporters


def test_custom_exporter_gets_typed_records_of_selected_streams(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    res = run_cli(
        train_run_args(
            logs,
            "custom",
            "--exporter",
            "tests.custom_exporters:make_exporter",
            "--export-streams",
            "step_time,process",
            "--exporter-hostname",
            steps=4,
        ),
        cwd=tmp_path,
    )
    _ok(res)
    out = logs / "custom" / "custom_export"
    received = [orjson.loads(line) for line in (out / "records.jsonl").read_bytes().splitlines()]
    by_stream: dict[str, list[dict[str, object]]] = {}
    for item in received:
        by_stream.setdefault(item["stream"], []).append(item)
    assert set(by_stream) == {"step_time", "process"}
    assert {i["class"] for i in by_stream["step_time"]} == {"StepTimeRecord"}
    assert {i["class"] for i in by_stream["process"]} == {"ProcessRecord"}
    _check_step_time([i["record"] for i in by_stream["step_time"]], steps=4, ranks=1)
    for item in received:
        assert item["record"]["hostname"] == socket.gethostname()
    close = orjson.loads((out / "close.json").read_bytes())
    assert close["streams"] == ["step_time", "process"]
    assert close["include_hostname"] is True
    assert close["written_records"] == {
        "step_time": len(by_stream["step_time"]),
        "process": len(by_stream["process"]),
    }
    assert close["dropped_batches"] == 0
    # The built-in JSONL exporter did not run alongside.
    assert not any(export_dir(logs, "custom").glob("*.jsonl"))
    assert warning_file(logs, "custom") is None


def test_bad_custom_exporter_run_goes_on(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    value = "nonexistent.module:make"
    res = run_cli(train_run_args(logs, "badcustom", "--exporter", value, steps=3), cwd=tmp_path)
    _ok(res)
    naming = [line for line in res.stderr.splitlines() if value in line]
    assert len(naming) == 1, res.stderr
    warning = warning_file(logs, "badcustom")
    assert warning is not None, res.stderr
    assert warning["export"]["exporter_failed"] is True
    assert warning["reason"] == "export_incomplete"
    assert_valid(logs / "badcustom" / "finalization_warning.json", tmp_path)


def test_custom_exporter_printing_to_stdout_does_not_break_launch(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    res = run_cli(
        train_run_args(
            logs, "noisy", "--exporter", "tests.scripts.noisy_exporter:make_exporter", steps=3
        ),
        cwd=tmp_path,
    )
    _ok(res)
    assert "hello from a noisy exporter factory" in res.stderr
    assert "did not start" not in res.stderr
    out = logs / "noisy" / "custom_export"
    close = orjson.loads((out / "close.json").read_bytes())
    assert close["written_records"] == {"step_time": 3}
    assert warning_file(logs, "noisy") is None


def test_serve_env_line_comes_first_even_with_a_printing_exporter(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    serve, env = _start_serve(
        tmp_path,
        "--logs-dir",
        logs,
        "--run-name",
        "noisy",
        "--exporter",
        "tests.scripts.noisy_exporter:make_exporter",
    )
    assert env["TRACEML_AGGREGATOR_ADDR"].startswith("127.0.0.1:")
    serve.send_signal(signal.SIGINT)
    code, err = _finish(serve)
    assert code == 0, err
    assert "hello from a noisy exporter factory" in err
    close = orjson.loads((logs / "noisy" / "custom_export" / "close.json").read_bytes())
    assert close["written_records"] == {"step_time": 0}


# --------------------------------------------------------------------------- startup


def test_cli_aggregator_and_validate_never_import_torch(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import sys, threading
        from pathlib import Path
        import traceml_ai.cli, traceml_ai.aggregator, traceml_records
        import traceml_ai.aggregator.__main__
        from traceml_ai.cli import main
        for argv in (["--help"], ["run", "--help"], ["serve", "--help"]):
            try:
                main(argv, prog_name="traceml")
            except SystemExit as exc:
                assert exc.code == 0, (argv, exc.code)
        from traceml_ai.aggregator import Aggregator, AggregatorConfig
        from traceml_ai.settings import ExportSettings
        run_dir = Path(sys.argv[1]) / "run"
        agg = Aggregator(AggregatorConfig(
            run_dir=run_dir, settings=ExportSettings("jsonl", "all", True), token="t"))
        agg.start()
        agg.finalize()
        try:
            main(["validate", str(run_dir)], prog_name="traceml")
        except SystemExit as exc:
            assert exc.code == 0, exc.code
        bad = [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
        assert not bad, bad[:5]
        print("NO-TORCH-OK")
        """
    )
    res = subprocess.run(
        [PY, "-c", code, str(tmp_path)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "NO-TORCH-OK" in res.stdout
    assert "Usage: traceml" in res.stdout
    assert len(list((tmp_path / "run" / "aggregator" / "export").glob("*.jsonl"))) == len(ALL_FILES)
