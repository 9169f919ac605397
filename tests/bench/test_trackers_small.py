"""The trackers' benchmark, small: ``python -m bench.trackers`` runs JSONL alone and
JSONL with every tracker against a real aggregator, a real ``mlflow server`` (the
session's, ``--mlflow-uri``) and TensorBoard's event files, and its last line parses.

Seconds, not minutes, and no assertion on timing: the figures are the bench's
(docs/benchmarks.md).
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tests.e2e_helpers import REPO, clean_env
from tests.receivers.mlflow_server import MlflowServer
from traceml_ai.settings import TRACKER_NAMES

pytestmark = pytest.mark.slow  # real runs, subprocesses or receivers (docs/testing.md)


def test_the_bench_runs_small_and_its_last_line_parses(mlflow: MlflowServer) -> None:
    small = ["--ranks", "8", "--seconds", "2", "--rounds", "1", "--every", "5"]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.trackers", *small, "--mlflow-uri", mlflow.url],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    fields = dict(field.split("=", 1) for field in last.split())
    ratio = float(fields["trackers_cpu_ratio"])
    assert math.isfinite(ratio) and ratio > 0, last
    assert fields["trackers"] == ",".join(TRACKER_NAMES)
    assert fields["ranks"] == "8" and fields["every_steps"] == "5"
    # 20 steps at 10 steps/s, a point every 5 (and the last): each tracker holds them.
    assert int(fields["points"]) >= 4, proc.stdout
