"""W&B runs on disk read back with W&B's own tool (for the tests and
``python -m bench.trackers``): ``wandb leet inspect --json`` prints
a run's ``.wandb`` transaction log, one record a line.

:func:`wandb_env` is the environment of a W&B client that can only work offline (no
API key, no settings or credentials of the machine's: ``HOME`` under the test's
folder), :func:`records` a run's records and :func:`history` its logged rows by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["WANDB", "history", "of_type", "records", "run_folders", "wandb_env"]

WANDB = str(Path(sys.executable).with_name("wandb"))


def wandb_env(folder: Path, **extra: str) -> dict[str, str]:
    """Variables for a W&B client whose files go under ``folder`` (``WANDB_DIR``) and
    whose home is ``folder/home``: none of the machine's W&B variables, key or netrc."""
    home = folder / "home"
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(home), WANDB_DIR=str(folder), NETRC=str(home / "netrc"))
    env.update(extra)
    return env


def run_folders(folder: Path) -> list[Path]:
    """The run folders under ``folder/wandb`` (``offline-run-*``, ``run-*``), oldest first."""
    found = [p for p in (folder / "wandb").glob("*run-*") if p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: p.name.split("-", 2)[-1])


def records(run: Path) -> list[dict[str, Any]]:
    """The records of the run in folder ``run`` (or of its ``.wandb`` file)."""
    result = subprocess.run(
        [WANDB, "leet", "inspect", "--json", str(run)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def history(found: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """name -> [(``traceml/step`` or ``_step``, value)] of the history rows."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in found:
        if record["type"] != "history":
            continue
        item = record["history"]["item"]
        step = int(item.get("traceml/step", item["_step"]))
        for name, value in item.items():
            if not name.startswith("_"):
                out.setdefault(name, []).append((step, value))
    return out


def of_type(found: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The records of one type, their payloads."""
    return [r[kind] for r in found if r["type"] == kind]
