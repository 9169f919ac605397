"""The framework examples (examples/hf_trainer.py, lightning_fit.py,
accelerate_loop.py) run as their docstrings say: under ``traceml run``, one step_time
line per optimizer update with the update's micro-batches folded in, valid files;
under plain ``python``, training runs untraced (TraceML warns once at most) instead
of failing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.e2e_helpers import PY, REPO, assert_valid, clean_env, export_dir
from tests.integration_helpers import (
    FORWARD,
    OFFLINE_ENV,
    calls,
    describe,
    steps_by_rank,
    traceml_run,
)

pytestmark = pytest.mark.timeout(600)

# (script, its arguments for 3 updates of 2 micro-batches); CI installs the extras
# they need (hf, lightning).
EXAMPLES = [
    ("hf_trainer.py", ["--steps", "3", "--grad-accum", "2", "--eval-every", "2"]),
    ("lightning_fit.py", ["--steps", "3", "--accumulate", "2"]),
    ("accelerate_loop.py", ["--epochs", "1", "--grad-accum", "2"]),
]


@pytest.mark.parametrize(("name", "args"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_an_example_runs_under_traceml_run(tmp_path: Path, name: str, args: list[str]) -> None:
    res = traceml_run(tmp_path, REPO / "examples" / name, *args)
    assert res.returncode == 0, describe(res)
    (lines,) = steps_by_rank(tmp_path).values()
    assert lines, describe(res)
    if name != "accelerate_loop.py":  # its step count follows the data, not --steps
        assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(calls(line, FORWARD) == 2 for line in lines), lines
    assert_valid(export_dir(tmp_path / "logs", "run"), tmp_path)


@pytest.mark.parametrize(("name", "args"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_an_example_runs_under_plain_python(tmp_path: Path, name: str, args: list[str]) -> None:
    res = subprocess.run(
        [PY, REPO / "examples" / name, *args],
        cwd=tmp_path,
        env=clean_env(OFFLINE_ENV),
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, describe(res)
    assert "Traceback" not in res.stderr, describe(res)
    assert res.stderr.count("TraceML export is off") <= 1, describe(res)
