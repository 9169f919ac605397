"""The ``traceml`` command line.

Importing this module must stay cheap and must never import torch: every command
imports what it needs inside its own function.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import click

from traceml_ai.settings import DEFAULT_DASHBOARD_PORT

_PROGRESS_MIN_BYTES = 64 * 1024 * 1024
"""Inputs smaller than this validate too fast to need a progress bar."""


def _usage_message(exc: click.ClickException) -> str:
    """click's error as one lower-case line, the way every other traceml error reads."""
    if isinstance(exc, click.NoSuchOption):
        # click sorts the close matches best first; one suggestion reads best.
        hint = f" (did you mean {exc.possibilities[0]}?)" if exc.possibilities else ""
        return f"no such option {exc.option_name}{hint}"
    # click >= 8.4 has NoSuchCommand (this project accepts 8.1, where it is a UsageError).
    command_name = getattr(exc, "command_name", None)
    if isinstance(command_name, str):
        possibilities = getattr(exc, "possibilities", None) or []
        hint = f" (did you mean {possibilities[0]}?)" if possibilities else ""
        return f"no such command {command_name}{hint}"
    text = " ".join(exc.format_message().split())
    if text.endswith("."):
        text = text[:-1]
    if text[:2].istitle():  # "Missing argument" but not "SCRIPT ..."
        text = text[0].lower() + text[1:]
    return text


class _TraceMLGroup(click.Group):
    """A click group whose errors are one ``traceml: error: ...`` line on stderr.

    click's own report is a usage block, a hint and an ``Error:`` line; every other
    message of the launcher is one line starting with ``traceml:``, so its usage
    errors read that way too. The exit status stays click's (2 for usage errors).
    """

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except click.ClickException as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":
                # A bare `traceml` (or `traceml run`) asks for the help text, not an error.
                exc.show()
            else:
                click.echo(f"traceml: error: {_usage_message(exc)}", err=True)
            sys.exit(exc.exit_code)
        except (click.Abort, KeyboardInterrupt):
            # Ctrl-C before a command took over the signals: the shell's code, no
            # "Aborted!" and no traceback.
            click.echo("traceml: interrupted", err=True)
            sys.exit(130)
        # Without standalone mode click returns the code of an explicit exit (--help).
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_TraceMLGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(
    package_name="traceml-ai", prog_name="traceml", message="%(prog)s %(version)s"
)
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

    Prints one line per problem, FILE:LINE: JSON-POINTER: MESSAGE, and one summary
    line per file.

    \b
    Exit status:
      0  everything is valid
      1  a problem was found
      2  a usage error
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


@main.command()
@click.argument("path", metavar="RUN_FOLDER_OR_EXPORT_FOLDER", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.option("--short", is_flag=True, help="Only the few lines traceml run prints at the end.")
@click.option(
    "--ranks",
    "per_rank",
    is_flag=True,
    help="Also list every rank (and node): the full table. By default figures across "
    "ranks are given as their distribution, whatever the rank count.",
)
@click.option(
    "--follow",
    is_flag=True,
    help="Refresh a terminal view while the run writes its files (on stderr with --json).",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes with --follow.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help=(
        "Also draw step time per rank and the phase breakdown into this image "
        "(.png, .svg, .pdf...; .png is added to a name without a suffix)."
    ),
)
def summary(
    path: str,
    as_json: bool,
    short: bool,
    per_rank: bool,
    follow: bool,
    interval: float,
    plot_path: str | None,
) -> None:
    """Summarize a run from its export files: step time per rank, phases, memory,
    process and system figures, the straggler, and what was lost.

    Works on a run still in progress (a partial last line is ignored).

    \b
    Exit status:
      0  the summary was made from everything there
      1  something could not be read (one "traceml: problem:" line each),
         no export files, or the plot could not be drawn
    """
    import orjson

    from traceml_ai.analysis import SummaryError, format_summary, summarize_run

    target: str | None = None
    if plot_path is not None:
        from traceml_ai.analysis.plot import PlotUnavailable, plot_target

        try:  # an unusable --plot is said before a long run is read
            target, _ = plot_target(plot_path)
        except PlotUnavailable as exc:
            click.echo(f"traceml: cannot plot: {exc}", err=True)
            sys.exit(1)
    try:
        if follow:
            from traceml_ai.analysis.follow_files import follow as follow_view

            # With --json, stdout holds the JSON alone: the live view goes to stderr.
            result = follow_view(path, interval, short=short, stderr=as_json)
            if result is None:
                click.echo(f"traceml: error: {path}: no export files seen", err=True)
                sys.exit(1)
        else:
            result = summarize_run(path)
    except SummaryError as exc:
        click.echo(f"traceml: error: {exc}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(orjson.dumps(result.to_json()).decode())
    elif not follow:
        click.echo(format_summary(result, full=not short, ranks=per_rank))
    if plot_path is not None:
        from traceml_ai.analysis.plot import PlotUnavailable, plot_summary

        try:
            target = plot_summary(path, plot_path, result)
        except PlotUnavailable as exc:
            click.echo(f"traceml: cannot plot: {exc}", err=True)
            sys.exit(1)
        except OSError as exc:
            click.echo(f"traceml: cannot write {target}: {exc.strerror or exc}", err=True)
            sys.exit(1)
        click.echo(f"traceml: plot written to {target}", err=as_json)
    if result.problems:
        sys.exit(1)


@main.command()
@click.argument("path", metavar="RUN_FOLDER_OR_EXPORT_FOLDER", type=click.Path())
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=DEFAULT_DASHBOARD_PORT,
    show_default=True,
    help="Port of the page (0 picks a free one).",
)
@click.option(
    "--bind-host",
    default="127.0.0.1",
    show_default=True,
    metavar="HOST",
    help="Address to listen on. Another than a loopback address makes the run visible "
    "to anyone who can reach the port (a warning says so); prefer an SSH tunnel.",
)
def dashboard(path: str, port: int, bind_host: str) -> None:
    """Serve the live dashboard of a run from its export files, running or finished.

    The page (step time per rank, phases, the straggler, memory, process and system
    figures, the loss report) follows the files while the run writes them, as
    `traceml summary --follow` does. Needs the 'dashboard' extra. Ctrl-C stops it.
    """
    from traceml_ai.dashboard import serve_folder

    sys.exit(serve_folder(path, bind_host, port))


def _add_launch_commands() -> None:
    from traceml_ai.launch.commands import run, serve

    main.add_command(run)
    main.add_command(serve)


_add_launch_commands()
