"""TraceML 0.5.0 command lines and scripts, run as a user would: real ``traceml run``
processes of tiny CPU scripts written for these tests (see docs/compat-0.5.md). The runs
of the scripts that train start two at a time (the ``script_runs`` fixture)."""

from __future__ import annotations

import socket
import subprocess
import textwrap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.e2e_helpers import (
    RUN_TIMEOUT_S,
    clean_env,
    data_lines,
    export_dir,
    free_port,
    run_cli,
    traceml_cmd,
)
from traceml_ai.launch.commands import rendezvous_port

DDP_SCRIPT = textwrap.dedent(
    """
    # A DDP script as 0.5.0's examples write it: it relies on the torchrun environment.
    import os, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    import traceml_ai as traceml

    traceml.init()
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "GROUP_RANK")
    print("ENV " + " ".join(f"{n}={os.environ.get(n)}" for n in names), flush=True)
    dist.init_process_group("gloo")
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        with traceml.trace_step(model):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    dist.destroy_process_group()
    """
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def runtime_env_lines(logs: Path, name: str) -> list[dict[str, Any]]:
    return data_lines(export_dir(logs, name) / "runtime_environment.jsonl")


def test_one_process_run_gets_the_torchrun_environment_and_runs_a_ddp_script(
    tmp_path: Path,
) -> None:
    script = write(tmp_path, "ddp.py", DDP_SCRIPT)
    port = free_port()
    logs = tmp_path / "logs"
    res = run_cli(
        [
            "run",
            "--logs-dir",
            logs,
            "--run-name",
            "ddp1",
            "--master-port",
            str(port),
            "--exporter",
            "jsonl",
            "--export-streams",
            "all",
            script,
        ],
        cwd=tmp_path,
        # A value the user set is kept (torchrun would overwrite it; we only add).
        env={"GROUP_RANK": "0"},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert (
        f"ENV RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 "
        f"MASTER_PORT={port} GROUP_RANK=0"
    ) in res.stdout
    envs = runtime_env_lines(logs, "ddp1")
    assert envs[-1]["topology"] == "single_process"
    assert envs[-1]["training_strategy"] == "ddp"
    steps = data_lines(export_dir(logs, "ddp1") / "step_time.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert orjson.dumps(steps)  # plain JSON all through


HOLD_THE_RENDEZVOUS = textwrap.dedent(
    """
    # Sets up torch.distributed as the Hugging Face Trainer does for one process, and
    # keeps its rendezvous port bound until the other run has bound its own.
    import os, sys, time
    from pathlib import Path
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print("PORT", os.environ["MASTER_PORT"], flush=True)
    Path(sys.argv[1]).touch()
    deadline = time.monotonic() + 60
    while not Path(sys.argv[2]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.destroy_process_group()
    """
)


def test_two_one_process_runs_on_one_machine_do_not_share_a_rendezvous_port(
    tmp_path: Path,
) -> None:
    """Without --master-port a one-process run rendezvouses on a port free when it
    starts: with torchrun's fixed 29500 the second of two runs failed to bind it."""
    script = write(tmp_path, "hold.py", HOLD_THE_RENDEZVOUS)
    a, b = tmp_path / "a.bound", tmp_path / "b.bound"
    runs = [
        subprocess.Popen(
            traceml_cmd("run", "--logs-dir", tmp_path / "logs", script, mine, other),
            cwd=tmp_path,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mine, other in ((a, b), (b, a))
    ]
    outputs = [run.communicate(timeout=RUN_TIMEOUT_S) for run in runs]
    for run, (out, err) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, out + err
    ports = {
        line.split()[1]
        for out, _ in outputs
        for line in out.splitlines()
        if line.startswith("PORT")
    }
    assert len(ports) == 2, outputs


def test_the_rendezvous_port_rules() -> None:
    assert rendezvous_port(29611, nnodes=1) == 29611  # given: kept
    assert rendezvous_port(None, nnodes=2) == 29500  # every node must name the same
    port = rendezvous_port(None, nnodes=1)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", port))  # free


def test_without_a_free_port_to_ask_for_the_rendezvous_port_is_torchruns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host where binding a probe socket fails (no IPv4, a sandbox) gets 29500, as
    before, not a traceback."""

    class NoSocket(socket.socket):
        def bind(self, address: Any) -> None:
            raise PermissionError(13, "bind refused")

    monkeypatch.setattr(socket, "socket", NoSocket)
    assert rendezvous_port(None, nnodes=1) == 29500


def test_values_the_user_set_are_kept(tmp_path: Path) -> None:
    script = write(
        tmp_path,
        "env.py",
        "import os\nprint('ADDR', os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'])\n",
    )
    res = run_cli(
        ["run", "--logs-dir", tmp_path / "logs", script],
        cwd=tmp_path,
        env={"MASTER_ADDR": "localhost", "MASTER_PORT": "12345"},
    )
    assert res.returncode == 0, res.stderr
    assert "ADDR localhost 12345" in res.stdout


# -- scripts as 0.5.0's examples write them -----------------------------------------

SUMMARY_SCRIPT = textwrap.dedent(
    """
    # As 0.5.0's summary_logging_minimal example: init, a traced loop, summary().
    import json
    import torch
    from torch import nn
    import traceml_ai as traceml

    traceml.init()
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    for _ in range(4):
        with traceml.trace_step(model):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    summary = traceml.summary(print_text=True)
    full = traceml.final_summary(timeout_sec=60)
    print("SUMMARY " + json.dumps({"summary": summary, "full": full}))
    """
)

MANUAL_SCRIPT = textwrap.dedent(
    """
    # As 0.5.0's manual_custom_minimal example: mode="manual" and the wrap_* helpers.
    import sys
    import torch
    from torch import nn
    import traceml_ai as traceml

    cfg = traceml.init(mode="manual")
    assert cfg.mode == "manual" and not cfg.patch_forward, cfg

    def batches():
        for _ in range(3):
            yield torch.randn(4, 8), torch.randn(4, 1)

    model = traceml.wrap_forward(nn.Linear(8, 1))
    opt = traceml.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for x, y in traceml.wrap_dataloader_fetch(batches()):
        with traceml.trace_step(model):
            x = traceml.wrap_h2d(x).to("cpu")
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            traceml.wrap_backward(loss).backward()
            opt.step()
    print("ARGV", sys.argv[1:])
    """
)


def summary_of(res: Any) -> dict[str, Any]:
    for line in res.stdout.splitlines():
        if line.startswith("SUMMARY "):
            value = orjson.loads(line.removeprefix("SUMMARY "))
            assert isinstance(value, dict)
            return value
    raise AssertionError(res.stdout + res.stderr)


ScriptRuns = dict[str, tuple[Path, subprocess.CompletedProcess[str]]]


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory: pytest.TempPathFactory) -> ScriptRuns:
    """name -> the run's logs folder and ``traceml run``'s result, for the runs of the
    scripts above (they import torch and train), two at a time when the first test that
    reads one starts: a run is mostly its processes' start and torch's import."""
    root = tmp_path_factory.mktemp("script_runs")
    # name: (script file, source, the traceml arguments given the script and logs folder)
    Args = Callable[[Path, Path], list[str | Path]]
    runs: dict[str, tuple[str, str, Args]] = {
        "summary": ("s.py", SUMMARY_SCRIPT,
                    lambda script, logs: ["run", "--logs-dir", logs, "--run-name", "s",
                                          "--exporter", "jsonl", script]),
        "summary_export_off": ("s.py", SUMMARY_SCRIPT,
                               lambda script, logs: ["run", "--logs-dir", logs, script]),
        # 0.5.0's form: options after the script, the script's arguments after --args.
        "manual": ("m.py", MANUAL_SCRIPT,
                   lambda script, logs: ["run", script, "--logs-dir", logs, "--run-name", "m",
                                         "--exporter", "jsonl", "--args", "--lr", "0.1",
                                         "--exporter"]),
        "mode_summary": ("s.py", SUMMARY_SCRIPT,
                         lambda script, logs: ["run", "--mode", "summary", "--logs-dir", logs,
                                               "--session-id", "sid", script]),
        "trace_max_steps": ("s.py", SUMMARY_SCRIPT,
                            lambda script, logs: ["run", "--trace-max-steps", "2",
                                                  "--on-missing-aggregator", "warn",
                                                  "--logs-dir", logs, "--run-name", "t",
                                                  "--exporter", "jsonl", script]),
    }  # fmt: skip

    def one(name: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
        file, source, args = runs[name]
        folder = root / name
        folder.mkdir()
        logs = folder / "logs"
        return logs, run_cli(args(write(folder, file, source), logs), cwd=folder)

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(one, name) for name in runs}
        return {name: future.result() for name, future in futures.items()}


def test_summary_in_a_script_reads_the_export_file(script_runs: ScriptRuns) -> None:
    logs, res = script_runs["summary"]
    assert res.returncode == 0, res.stdout + res.stderr
    got = summary_of(res)
    full, flat = got["full"], got["summary"]
    assert full["source"] == "export" and full["ranks"] == [0]
    assert full["step_time"]["0"]["steps"] == 4
    assert flat["traceml/source"] == "export" and flat["traceml/steps"] == 4
    # print_text: the run's summary as `traceml summary` prints it.
    assert f"traceml: summary of {logs / 's'}" in res.stdout


def test_summary_in_a_script_with_export_off_is_in_process(script_runs: ScriptRuns) -> None:
    _, res = script_runs["summary_export_off"]
    assert res.returncode == 0, res.stdout + res.stderr
    full = summary_of(res)["full"]
    assert full["source"] == "in_process" and full["step_time"]["0"]["steps"] == 4


def test_manual_mode_script_with_0_5_args_form(script_runs: ScriptRuns) -> None:
    logs, res = script_runs["manual"]
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ARGV ['--lr', '0.1', '--exporter']" in res.stdout
    assert "warning" not in res.stderr
    steps = data_lines(export_dir(logs, "m") / "step_time.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps[1:]:
        names = set(s["events"])
        assert {
            "_traceml_internal:forward_time",
            "_traceml_internal:backward_time",
            "_traceml_internal:optimizer_step",
            "_traceml_internal:dataloader_next",
        } <= names, names


ARGV_SCRIPT = "import os, sys\nprint('ARGV', sys.argv[1:], os.environ.get('WORLD_SIZE'))\n"


def test_torchrun_form_keeps_everything_after_the_script_and_warns(tmp_path: Path) -> None:
    script = write(tmp_path, "a.py", ARGV_SCRIPT)
    res = run_cli(
        ["run", "--logs-dir", tmp_path / "logs", script, "--nproc-per-node=2", "--", "--mode"],
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert "ARGV ['--nproc-per-node=2', '--', '--mode'] 1" in res.stdout
    warnings = [line for line in res.stderr.splitlines() if "traceml: warning" in line]
    assert warnings == [
        "traceml: warning: --nproc-per-node after the script is passed to the script; for "
        "traceml, put it before the script (traceml run [OPTIONS] SCRIPT [ARGS]) or end "
        "traceml's options with --args (traceml run SCRIPT [OPTIONS] --args [ARGS])"
    ]


def test_an_unknown_option_in_the_args_form_is_an_error(tmp_path: Path) -> None:
    script = write(tmp_path, "a.py", ARGV_SCRIPT)
    res = run_cli(["run", script, "--exportr", "jsonl", "--args", "x"], cwd=tmp_path, timeout=60)
    assert res.returncode == 2
    assert (
        res.stderr.strip() == "traceml: error: no such option --exportr (did you mean --exporter?)"
    )
    assert "ARGV" not in res.stdout


def test_mode_summary_prints_the_analysis_and_exports_step_time(script_runs: ScriptRuns) -> None:
    logs, res = script_runs["mode_summary"]
    assert res.returncode == 0, res.stdout + res.stderr
    assert (export_dir(logs, "sid") / "step_time.jsonl").is_file()
    # The full summary, after the launcher's own short one.
    assert res.stderr.count(f"traceml: summary of {logs / 'sid'}") == 2, res.stderr
    assert "step time across ranks (ms, min/p50/p90/max" in res.stderr


def test_trace_max_steps_and_on_missing_aggregator(script_runs: ScriptRuns) -> None:
    logs, res = script_runs["trace_max_steps"]
    assert res.returncode == 0, res.stdout + res.stderr
    steps = data_lines(export_dir(logs, "t") / "step_time.jsonl")
    assert [s["step"] for s in steps] == [1, 2]


def test_disable_traceml_runs_the_script_untouched(tmp_path: Path) -> None:
    script = write(
        tmp_path,
        "d.py",
        "import sys\nimport traceml_ai as traceml\ntraceml.init()\n"
        "with traceml.trace_step(None):\n    pass\nprint('RAN', sys.argv[1:])\nsys.exit(3)\n",
    )
    res = run_cli(
        ["run", "--disable-traceml", "--logs-dir", tmp_path / "logs", script, "x"], cwd=tmp_path
    )
    assert res.returncode == 3
    assert "RAN ['x']" in res.stdout
    assert res.stderr == ""
    assert not (tmp_path / "logs").exists()


def test_options_without_a_feature_here_are_one_notice_each(tmp_path: Path) -> None:
    script = write(tmp_path, "a.py", ARGV_SCRIPT)
    res = run_cli(
        [
            "run",
            "--logs-dir",
            tmp_path / "logs",
            "--mode",
            "cli",
            "--enable-logging",
            "--html-report",
            "--no-history",
            "--history-retention",
            "2h",
            "--dashboard-port",
            "8765",
            "--no-dashboard-auto-open",
            "--save-training-output",
            script,
        ],
        cwd=tmp_path,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    notices = [line for line in res.stderr.splitlines() if "has no effect here" in line]
    assert notices == [
        "traceml: --enable-logging has no effect here: TraceML writes no log files; its "
        "messages go to stderr",
        "traceml: --html-report has no effect here: there is no HTML report; --mode summary "
        "prints the run summary",
        "traceml: --no-history has no effect here: TraceML keeps no history database; "
        "--exporter decides what is written",
        "traceml: --history-retention has no effect here: TraceML keeps no history database",
        "traceml: --no-dashboard-auto-open has no effect here: the dashboard never opens a "
        "browser; open the URL it prints",
        "traceml: --save-training-output has no effect here: the script's output goes to the "
        "terminal",
        "traceml: --mode cli has no effect here: there is no terminal view during the run "
        "(traceml summary --follow RUN_FOLDER gives one); --mode dashboard serves a live web "
        "page",
    ]


DDP_SUMMARY_SCRIPT = DDP_SCRIPT + textwrap.dedent(
    """
    import json
    full = traceml.final_summary(timeout_sec=60)
    print(f"RANK{os.environ['RANK']} " + json.dumps(full and full["ranks"]), flush=True)
    """
)


def test_0_5_form_with_nproc_after_the_script_runs_two_ranks_and_rank0_sums_both(
    tmp_path: Path,
) -> None:
    script = write(tmp_path, "ddp.py", DDP_SUMMARY_SCRIPT)
    logs = tmp_path / "logs"
    res = run_cli(
        [
            "run",
            script,
            "--nproc-per-node=2",
            "--master-port",
            str(free_port()),
            "--logs-dir",
            logs,
            "--exporter",
            "jsonl",
            "--args",
        ],
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("WORLD_SIZE=2 LOCAL_WORLD_SIZE=2") == 2, res.stdout
    # summary() is rank 0's; it waits for its own last step, so rank 1's may lag.
    assert "RANK1 null" in res.stdout
    line = next(x for x in res.stdout.splitlines() if x.startswith("RANK0 "))
    assert 0 in orjson.loads(line.removeprefix("RANK0 "))
