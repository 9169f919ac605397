"""What the framework benches share (``frameworks``, ``lines``, ``sampled``): the tiny
models' scripts, and how one runs under ``traceml run`` with every stream exported."""

from __future__ import annotations

import os
import sys
from pathlib import Path

WORKLOADS = Path(__file__).resolve().parent / "workloads"
# examples/hf_trainer.py's 2-layer GPT-2 and examples/lightning_fit.py's MLP, each
# timing its updates with the clock of workloads/update_clock.py.
SCRIPTS = {
    "hf": WORKLOADS / "hf_trainer.py",
    "lightning": WORKLOADS / "lightning_fit.py",
}


def env(traced: bool) -> dict[str, str]:
    """The run's environment: no TraceML setting of the caller's, one intra-op thread,
    no download, and the zero-code attach on (``traced``) or off (the null run)."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    out.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out["TRACEML_ZERO_CODE"] = "1" if traced else "0"
    return out


def command(
    framework: str, logs_dir: Path, run_name: str, clock_out: Path, updates: int, one_in: int
) -> list[str]:
    """``traceml run`` of the framework's script: ``updates`` updates, one in ``one_in``
    traced, the update clock's figures written to ``clock_out``."""
    return [
        sys.executable, "-m", "traceml_ai", "run",
        "--logs-dir", str(logs_dir), "--run-name", run_name,
        "--exporter", "jsonl", "--export-streams", "all",
        str(SCRIPTS[framework]), str(clock_out), str(updates), str(one_in),
    ]  # fmt: skip
