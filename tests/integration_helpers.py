"""Helpers for the framework integration tests (HF Trainer, Lightning, Accelerate).

Each test writes a small training script into its folder and runs it under a real
``traceml run`` (the zero-code path needs the launcher's bootstrap), then reads the
export files. Frameworks are slow to import, so each run checks several things, and a
module's runs start two at a time (:func:`run_two_at_a_time`, from a module fixture).
"""

from __future__ import annotations

import subprocess
import textwrap
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from tests.e2e_helpers import data_lines, export_dir, free_port, run_cli

FORWARD = "_traceml_internal:forward_time"
BACKWARD = "_traceml_internal:backward_time"
OPTIMIZER = "_traceml_internal:optimizer_step"
DATALOADER = "_traceml_internal:dataloader_next"
STEP = "_traceml_internal:step_time"

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


def ddp_teardown(*names: str) -> str:
    """The end of a well-behaved DDP script, to append to a test script's source.

    Without it, gloo's threads sometimes abort a rank at interpreter exit ("terminate
    called without an active exception"), with or without TraceML; examples/train.py
    ends the same way. ``names`` are the script's objects that hold the process group.
    """
    return (
        "import gc\n"
        "import torch.distributed as dist\n"
        "if dist.is_initialized():\n"
        f"    del {', '.join(names)}\n"
        "    gc.collect()\n"
        "    dist.barrier()\n"
        "    dist.destroy_process_group()\n"
    )


def write_script(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


def traceml_run(
    folder: Path,
    script: Path,
    *script_args: str,
    run_name: str = "run",
    nproc: int = 1,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``traceml run`` with every stream exported to ``folder/logs/run_name``."""
    options: list[str | Path] = [
        "run",
        "--logs-dir",
        folder / "logs",
        "--run-name",
        run_name,
        "--interval",
        "0.2",
        "--exporter",
        "jsonl",
        "--export-streams",
        "all",
    ]
    if nproc > 1:
        options += ["--nproc-per-node", str(nproc), "--master-port", str(free_port())]
    return run_cli([*options, script, *script_args], cwd=folder, env={**OFFLINE_ENV, **(env or {})})


class RunSpec(NamedTuple):
    """One ``traceml run`` of a test module: its script and how it is run."""

    file: str
    source: str
    args: tuple[str, ...] = ()
    nproc: int = 1
    env: Mapping[str, str] | None = None


Runs = dict[str, tuple[Path, subprocess.CompletedProcess[str]]]
"""A run's name -> its folder and ``traceml run``'s result."""


def run_two_at_a_time(root: Path, specs: Mapping[str, RunSpec]) -> Runs:
    """Run every spec under :func:`traceml_run`, each in its own folder under ``root``,
    two at a time: a run is mostly a framework's import and the processes' start, so two
    share the machine's cores well. Returns when all ended."""

    def one(name: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
        spec = specs[name]
        folder = root / name
        folder.mkdir()
        script = write_script(folder, spec.file, spec.source)
        return folder, traceml_run(folder, script, *spec.args, nproc=spec.nproc, env=spec.env)

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(one, name) for name in specs}
        return {name: future.result() for name, future in futures.items()}


def steps_by_rank(folder: Path, run_name: str = "run") -> dict[int, list[dict[str, Any]]]:
    """step_time data lines per global rank, in step order."""
    out: dict[int, list[dict[str, Any]]] = {}
    for line in data_lines(export_dir(folder / "logs", run_name) / "step_time.jsonl"):
        out.setdefault(line["global_rank"], []).append(line)
    for lines in out.values():
        lines.sort(key=lambda d: d["step"])
    return out


def calls(line: dict[str, Any], phase: str) -> int:
    """``n_calls`` of a phase in a step_time line (0 when the phase is absent)."""
    per_device = line["events"].get(phase)
    if not per_device:
        return 0
    (entry,) = per_device.values()
    return int(entry["n_calls"])


def stream_lines(folder: Path, stream: str, run_name: str = "run") -> list[dict[str, Any]]:
    return data_lines(export_dir(folder / "logs", run_name) / f"{stream}.jsonl")


def integration_failures(stderr: str) -> list[str]:
    """The ``traceml:`` lines that report an integration hook failure."""
    return [line for line in stderr.splitlines() if "integration failed in" in line]


def describe(res: subprocess.CompletedProcess[str]) -> str:
    return (
        f"exit {res.returncode}\n--- stdout\n{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-6000:]}"
    )


def assert_all_streams_closed(folder: Path, run_name: str = "run") -> None:
    """Every exported stream's file ends with its closing line."""
    for stream in ("step_time", "step_memory", "process", "system", "runtime_environment"):
        stream_lines(folder, stream, run_name)


def phases(line: dict[str, Any]) -> Sequence[str]:
    return sorted(line["events"])
