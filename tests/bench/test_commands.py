"""The benchmark commands the docs give exist: each ``python -m bench.<name>`` is a
module of the ``bench`` package, each ``bench/...`` path is a file, and the benches
that launch workloads find them."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from bench.overhead import framework_runs, instructions, step
from tests.e2e_helpers import REPO

DOCS = [REPO / "docs" / "benchmarks.md", REPO / "docs" / "gpu-check.md", REPO / "README.md"]


def _named(pattern: str) -> set[str]:
    found: set[str] = set()
    for doc in DOCS:
        found |= set(re.findall(pattern, doc.read_text(encoding="utf-8")))
    return found


def test_every_module_command_in_the_docs_is_a_bench_module() -> None:
    modules = _named(r"python -m (bench(?:\.\w+)+)")
    assert {"bench.records", "bench.scale", "bench.overhead.step"} <= modules
    missing = sorted(m for m in modules if importlib.util.find_spec(m) is None)
    assert missing == []


def test_every_bench_path_in_the_docs_exists() -> None:
    paths = _named(r"(?<![\w/])(bench/[\w/]+\.py)\b")
    assert "bench/overhead/paired.py" in paths
    assert sorted(p for p in paths if not (REPO / p).is_file()) == []


def test_the_workloads_the_benches_launch_exist() -> None:
    scripts = [
        step.TRAIN,
        step.PAIRED_TRAIN,
        instructions.LOOP,
        *framework_runs.SCRIPTS.values(),
    ]
    assert [s for s in scripts if not s.is_file()] == []


@pytest.mark.parametrize("module", ["bench.scale", "bench.overhead.step"])
def test_a_command_runs_from_the_repository_root(module: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: ")
