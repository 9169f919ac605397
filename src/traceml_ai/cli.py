"""The ``traceml`` command line.

Importing this module must stay cheap and must never import torch: every command
imports what it needs inside its own function.
"""

from __future__ import annotations

import sys
from typing import Any

import click

_PROGRESS_MIN_BYTES = 64 * 1024 * 1024
"""Inputs smaller than this validate too fast to need a progress bar."""


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """TraceML: live telemetry from every rank of a PyTorch run."""


@main.command()
@click.argument(
    "paths",
    nargs=-1,
    required=True,
    type=click.Path(exists=True, dir_okay=True, file_okay=True),
)
@click.option(
    "--max-problems",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Problems printed per file (all are counted).",
)
def validate(paths: tuple[str, ...], max_problems: int) -> None:
    """Check export files, export folders or run folders against the schemas.

    Prints ``file:line: json-pointer: message`` for each problem and one summary
    line per file. Exit status: 0 when everything is valid, 1 when a problem was
    found, 2 on a usage error.
    """
    from traceml_records import validate_paths

    bar: Any = None
    shown = [0]

    def progress(done: int, total: int) -> None:
        # A progress bar only helps a person watching a big input; never in pipes.
        nonlocal bar
        if bar is None:
            if total < _PROGRESS_MIN_BYTES or not sys.stderr.isatty():
                return
            bar = click.progressbar(length=total, label="validating", file=sys.stderr)
            bar.__enter__()
        bar.update(done - shown[0])
        shown[0] = done

    try:
        report = validate_paths(paths, max_problems_per_file=max_problems, progress=progress)
    except (OSError, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    by_file: dict[str, list[str]] = {}
    for problem in report.problems:
        by_file.setdefault(problem.file or "", []).append(str(problem))
    for summary in report.files:
        for line in by_file.get(summary.file, ()):
            click.echo(line)
        if summary.problems > len(by_file.get(summary.file, ())):
            hidden = summary.problems - len(by_file.get(summary.file, ()))
            click.echo(f"{summary.file}: ... {hidden} more problem(s) not shown")
        click.echo(str(summary))
    sys.exit(0 if report.ok else 1)


def _add_launch_commands() -> None:
    from traceml_ai._cli_commands import run, serve

    main.add_command(run)
    main.add_command(serve)


_add_launch_commands()
