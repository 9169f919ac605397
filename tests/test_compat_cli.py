"""TraceML 0.5.0 command lines and scripts, run as a user would: real ``traceml run``
processes of tiny CPU scripts written for these tests (see docs/compat-0.5.md)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import orjson

from tests.e2e_helpers import data_lines, export_dir, free_port, run_cli

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
