"""The framework examples (examples/hf_trainer.py, lightning_fit.py,
accelerate_loop.py) run as their docstrings say: under ``traceml run``, one step_time
line per optimizer update with the update's micro-batches folded in, valid files;
under plain ``python``, training runs untraced (TraceML warns once at most) instead
of failing. The six runs start two at a time when the module starts (mostly the
frameworks' imports)."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
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


Ran = dict[tuple[str, str], tuple[Path, subprocess.CompletedProcess[str]]]


def _plain_python(folder: Path, name: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, REPO / "examples" / name, *args],
        cwd=folder,
        env=clean_env(OFFLINE_ENV),
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """(how, example) -> its folder and result, for how in ("traceml", "python")."""
    root = tmp_path_factory.mktemp("examples")

    def one(how: str, name: str, args: list[str]) -> tuple[Path, subprocess.CompletedProcess[str]]:
        folder = root / f"{how}-{name.removesuffix('.py')}"
        folder.mkdir()
        if how == "traceml":
            return folder, traceml_run(folder, REPO / "examples" / name, *args)
        return folder, _plain_python(folder, name, args)

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            (how, name): pool.submit(one, how, name, args)
            for how in ("traceml", "python")
            for name, args in EXAMPLES
        }
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize(("name", "args"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_an_example_runs_under_traceml_run(
    ran: Ran, name: str, args: list[str], tmp_path: Path
) -> None:
    folder, res = ran["traceml", name]
    assert res.returncode == 0, describe(res)
    (lines,) = steps_by_rank(folder).values()
    assert lines, describe(res)
    if name != "accelerate_loop.py":  # its step count follows the data, not --steps
        assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(calls(line, FORWARD) == 2 for line in lines), lines
    assert_valid(export_dir(folder / "logs", "run"), tmp_path)


@pytest.mark.parametrize(("name", "args"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_an_example_runs_under_plain_python(ran: Ran, name: str, args: list[str]) -> None:
    _, res = ran["python", name]
    assert res.returncode == 0, describe(res)
    assert "Traceback" not in res.stderr, describe(res)
    assert res.stderr.count("TraceML export is off") <= 1, describe(res)
