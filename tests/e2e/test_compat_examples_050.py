"""TraceML 0.5.0's CPU examples run unmodified under ``traceml run`` (docs/compat-0.5.md).

The scripts are 0.5.0's own, read from its published source distribution
(``traceml_ai-0.5.0.tar.gz``, which scripts/bootstrap.sh downloads into the virtual
environment's ``compat050`` folder; its sha256 is checked), written to the test's folder and run with
0.5.0's command-line form (``traceml run SCRIPT [OPTIONS] --args [ARGS]``), small
arguments, export on. Each must exit 0 without a traceback and write one valid
``step_time`` line per step it trains. The runs are started two at a time (they are
mostly imports) and checked one test each.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.e2e_helpers import assert_valid, export_dir, free_port, run_cli
from tests.integration_helpers import FORWARD, OFFLINE_ENV, calls, describe, steps_by_rank

pytestmark = pytest.mark.timeout(600)

SDIST_050 = Path(sys.prefix) / "compat050" / "traceml_ai-0.5.0.tar.gz"
SDIST_050_SHA256 = "b8b9a5831b648f7a9bcb078eff5cc8fc70555db5c2668d8457af0e6ba1fc0585"


class Example(NamedTuple):
    path: str  # under 0.5.0's examples/
    args: tuple[str, ...]  # traceml run options, then --args and the script's
    ranks: int
    steps: int | None  # step_time lines per rank (None: at least one)


EXAMPLES = [
    Example("quickstart.py", ("--args", "--steps", "4"), 1, 4),
    Example("summary_logging_minimal.py", ("--args", "--steps", "4"), 1, 4),
    Example("manual_custom_minimal.py", ("--args", "--steps", "4"), 1, 4),
    Example(
        "diagnosis/dataloader_bottleneck_demo.py",
        (
            "--args",
            "--scenario",
            "slow",
            "--sleep-ms",
            "2",
            "--num-samples",
            "128",
            "--batch-size",
            "32",
            "--epochs",
            "1",
        ),
        1,
        4,
    ),
    Example("diagnosis/incomplete_signals_demo.py", ("--args", "--steps", "4"), 1, 4),
    Example("integrations/accelerate_minimal.py", ("--args", "--steps", "4"), 1, 4),
    Example("integrations/huggingface_trainer_minimal.py", ("--args", "--steps", "4"), 1, 4),
    Example("integrations/lightning_minimal.py", ("--args", "--max-steps", "4"), 1, 4),
    Example("distributed/ddp_minimal.py", ("--nproc-per-node=2", "--args", "--steps", "3"), 2, 3),
]


def _sources() -> dict[str, bytes]:
    """Every listed example's bytes, from 0.5.0's source distribution."""
    data = SDIST_050.read_bytes()  # scripts/bootstrap.sh puts it there
    assert hashlib.sha256(data).hexdigest() == SDIST_050_SHA256
    out = {}
    with tarfile.open(SDIST_050) as tar:
        for example in EXAMPLES:
            member = tar.extractfile(f"traceml_ai-0.5.0/examples/{example.path}")
            assert member is not None, example.path
            out[example.path] = member.read()
    return out


class Ran(NamedTuple):
    folder: Path
    result: subprocess.CompletedProcess[str]
    seconds: float


def _run(example: Example, root: Path) -> Ran:
    folder = root / example.path.replace("/", "__").removesuffix(".py")
    script = folder / example.path
    script.parent.mkdir(parents=True)
    script.write_bytes(_sources()[example.path])
    options = ["--logs-dir", folder / "logs", "--run-name", "run", "--interval", "0.2",
               "--exporter", "jsonl", "--export-streams", "all"]  # fmt: skip
    if example.ranks > 1:
        options += ["--master-port", str(free_port())]
    # 0.5.0's form: the script first, traceml's options after it, then --args.
    i = example.args.index("--args")
    args = [script, *example.args[:i], *options, *example.args[i:]]
    start = time.monotonic()
    result = run_cli(["run", *args], cwd=folder, env=OFFLINE_ENV)
    return Ran(folder, result, time.monotonic() - start)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Ran]]:
    root = tmp_path_factory.mktemp("examples050")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {e.path: pool.submit(_run, e, root) for e in EXAMPLES}
        yield {path: future.result() for path, future in futures.items()}


def test_the_050_examples_come_from_the_published_sdist() -> None:
    sources = _sources()
    assert sorted(sources) == sorted(e.path for e in EXAMPLES)
    assert all(b"__main__" in source for source in sources.values())


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.path for e in EXAMPLES])
def test_a_050_example_runs_under_traceml_run(
    runs: dict[str, Ran], example: Example, tmp_path: Path
) -> None:
    ran = runs[example.path]
    res = ran.result
    assert res.returncode == 0, describe(res)
    assert "Traceback" not in res.stderr, describe(res)
    by_rank = steps_by_rank(ran.folder)
    assert sorted(by_rank) == list(range(example.ranks)), describe(res)
    for lines in by_rank.values():
        if example.steps is None:
            assert lines, describe(res)
        else:
            assert [line["step"] for line in lines] == list(range(1, example.steps + 1)), describe(
                res
            )
    if example.path != "diagnosis/incomplete_signals_demo.py":
        # (that demo calls model.forward() directly, so no forward is timed: on purpose)
        assert all(calls(line, FORWARD) >= 1 for lines in by_rank.values() for line in lines)
    assert_valid(export_dir(ran.folder / "logs", "run"), tmp_path)
