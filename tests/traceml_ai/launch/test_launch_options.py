"""``traceml run``'s options reach the launcher as arguments: the command never writes
``os.environ`` to pass them, and the launcher hands the ranks (other processes) what
their ``traceml.init()`` is told in their environment."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from traceml_ai import _environ
from traceml_ai.cli import main as cli_main
from traceml_ai.launch import launcher
from traceml_ai.settings import settings_from_values

_RANK_ENV = (_environ.TRACE_MAX_STEPS, _environ.ON_MISSING_AGGREGATOR)


@pytest.fixture(autouse=True)
def _no_rank_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _RANK_ENV:
        monkeypatch.delenv(name, raising=False)


def test_the_command_passes_options_as_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[launcher.RunOptions] = []

    def fake_run(options: launcher.RunOptions) -> int:
        seen.append(options)
        return 0

    monkeypatch.setattr(launcher, "run", fake_run)
    script = tmp_path / "train.py"
    script.write_text("")
    before = dict(os.environ)
    result = CliRunner().invoke(
        cli_main,
        [
            "run",
            "--trace-max-steps",
            "3",
            "--on-missing-aggregator",
            "raise",
            "--logs-dir",
            str(tmp_path / "logs"),
            str(script),
        ],
    )
    assert result.exit_code == 0, result.output
    (options,) = seen
    assert (options.trace_max_steps, options.on_missing_aggregator) == (3, "raise")
    assert dict(os.environ) == before


RANK_SCRIPT = """\
import json, os, sys
names = sys.argv[2:]
with open(sys.argv[1], "w") as fh:
    json.dump({n: os.environ.get(n) for n in names}, fh)
"""


def test_the_launcher_puts_them_in_the_ranks_environment_only(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "env.json"
    options = launcher.RunOptions(
        script=str(script),
        script_args=(str(out), *_RANK_ENV),
        logs_dir=tmp_path / "logs",
        run_name="r",
        nproc_per_node=1,
        nnodes=1,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=29555,
        aggregator_host=None,
        aggregator_port=None,
        interval=1.0,
        finalize_timeout_sec=5.0,
        export=settings_from_values(
            exporter="", export_streams="step_time", exporter_hostname=False, source="test"
        ),
        trace_max_steps=2,
        on_missing_aggregator="warn",
    )
    before = dict(os.environ)
    assert launcher.run(options) == 0
    assert orjson.loads(out.read_bytes()) == {
        _environ.TRACE_MAX_STEPS: "2",
        _environ.ON_MISSING_AGGREGATOR: "warn",
    }
    assert dict(os.environ) == before
