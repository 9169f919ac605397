"""The end of ``traceml run``: what it says about the export, the ranks and what was
lost, and the warning file it writes when the aggregator could not.
"""

from __future__ import annotations

import os
import shlex
import sys
import zipfile
from pathlib import Path

import orjson

from traceml_ai._limits import END_OF_RUN_SUMMARY_MAX_BYTES
from traceml_ai.aggregator.protocol import (
    FinalizedEvent,
)
from traceml_ai.launch._plan import RunOptions, RunPlan
from traceml_ai.launch._ranks import RankEnds
from traceml_ai.launch._signals import exit_description, say, signal_name
from traceml_records.internal import FileScan


def _print_short_summary(run_dir: Path, export_dir: Path) -> None:
    """The short run summary on stderr; a courtesy that never fails or stalls the run."""
    try:
        size = sum(f.stat().st_size for f in export_dir.glob("*.jsonl"))
        if size > END_OF_RUN_SUMMARY_MAX_BYTES:
            say(
                f"summary: {size / 2**20:.0f} MiB of export files; "
                f"`{shlex.join(['traceml', 'summary', str(run_dir)])}` gives it"
            )
            return
        from traceml_ai.analysis import format_summary, summarize_run

        text = format_summary(summarize_run(run_dir), full=False)
        print(text, file=sys.stderr, flush=True)
    except Exception as exc:
        say(f"summary unavailable: {type(exc).__name__}: {exc}")


def report_finalized(
    options: RunOptions, p: RunPlan, event: FinalizedEvent, ends: RankEnds | None
) -> None:
    """The end of a run whose aggregator finalized; ``ends`` None: no rank was started."""
    assert p.run_dir is not None
    if options.export.settings.exporter:
        # A custom exporter writes where it likes: name the folder only if it exists.
        export_dir = p.run_dir / "aggregator" / "export"
        where = f"in {export_dir}" if export_dir.is_dir() else "passed to the custom exporter"
        failed = "; the exporter failed" if event.exporter_failed else ""
        say(f"export: {event.written_records} records {where}{failed}")
        if export_dir.is_dir():
            _print_short_summary(p.run_dir, export_dir)
    warning = event.warning
    see = f"; see {warning}" if warning else ""
    if ends is not None and not event.ranks_heard:
        say(f"no rank connected to the aggregator: {_why_no_rank(options, ends)}{see}")
    elif ends is not None and ends.abrupt:
        say(
            f"{_ranks_text(ends.abrupt)} ended without shutting down TraceML "
            f"({_abrupt_how(ends)}): the connection closed without a goodbye, so the last "
            f"steps may be missing{see}"
        )
    elif warning:
        say(f"{lost_what(Path(warning))}; see {warning}")


def lost_what(warning: Path) -> str:
    """What a warning file says was lost, in a few words: only the live views' data (the
    files are complete then), or something of the run."""
    try:
        reason = orjson.loads(warning.read_bytes()).get("reason")
    except (OSError, ValueError, AttributeError):
        reason = None
    if reason == "monitoring_incomplete":
        return "the live views lost data (the files are complete)"
    return "something was lost"


def _ranks_text(ranks: tuple[str, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(ranks)


def _abrupt_how(ends: RankEnds) -> str:
    """How ranks ended that never reached the interpreter's exit (where TraceML's
    ``atexit`` shutdown sends its last steps and a goodbye)."""
    if ends.single and ends.raw_code < 0:
        return f"it {exit_description(ends.raw_code)}"
    if not ends.single and ends.interrupted is not None:
        # torchrun passes a signal on to its workers: SIGTERM (and a SIGKILL after it)
        # ends a Python process without its exit handlers.
        return (
            f"stopped after the {signal_name(ends.interrupted)} passed on to the ranks; "
            "a rank ended by SIGTERM or SIGKILL skips the interpreter's normal exit"
        )
    code = f"; exit code {ends.exit_code}" if ends.single else ""
    return f"os._exit() or a crash skipped the interpreter's normal exit{code}"


def _why_no_rank(options: RunOptions, ends: RankEnds) -> str:
    """What happened in a run whose ranks sent nothing at all, as far as we know it."""
    from traceml_ai.rank import ENV_DISABLED, env_disabled

    if env_disabled():
        return (
            f"{ENV_DISABLED}={os.environ.get(ENV_DISABLED, '').strip()} is set, so TraceML was "
            "off in the ranks and traceml.init() did nothing (unset it to trace this run, or "
            "use --disable-traceml to run without an aggregator)"
        )
    if ends.known and not ends.started:
        if ends.interrupted is not None:
            return (
                f"interrupted ({signal_name(ends.interrupted)}) before the training script started"
            )
        zip_note = ""
        if options.script.endswith((".zip", ".pyz")) and not zipfile.is_zipfile(options.script):
            zip_note = f"; {options.script} is not a zip file, so python read it as a script"
        return (
            f"{options.script} did not start (exit code {ends.exit_code}; python's error "
            f"is above{zip_note})"
        )
    if ends.abrupt:
        return (
            f"{_ranks_text(ends.abrupt)} ended without shutting down TraceML "
            f"({_abrupt_how(ends)}), so nothing it traced was sent"
        )
    if ends.interrupted is not None:
        name = signal_name(ends.interrupted)
        return f"the training script was stopped by {name} before it sent anything"
    if ends.exit_code != 0:
        return f"the training script exited with code {ends.exit_code} before it sent anything"
    # The usual cause is a script without traceml.init(): say that, not "lost".
    return f"{options.script} may not call traceml.init() (or it exited before calling it)"


def count_data_lines(export_dir: Path) -> int:
    """Data lines in the ``*.jsonl`` files of ``export_dir``: complete lines that are
    not a closing line (as the one scan of the export files, ``traceml_records``, counts
    them)."""
    return export_tally(export_dir)[0]


def export_tally(export_dir: Path) -> tuple[int, bool]:
    """(data lines in the ``*.jsonl`` files of ``export_dir``, whether there is at least
    one file and every file ends with its closing line). The scan only tells data lines
    from closing lines here: a line that may be a closing line is the only one parsed."""
    total = 0
    closed = True
    files = 0
    for path in sorted(export_dir.glob("*.jsonl")):
        files += 1
        scan = FileScan(None, check=False)
        try:
            with open(path, "rb") as fh:
                scan.read(fh)
        except OSError:
            closed = False
            continue
        state = scan.state
        total += state.written_lines
        if not state.last_closing or state.partial_last_line:
            closed = False
    return total, closed and files > 0


def report_aggregator_lost(p: RunPlan, why: str, exit_code: int, *, export_on: bool) -> None:
    """The aggregator is gone without finalizing: we outlived it, so we write the warning.

    The export files stay exactly as they are; without a closing line they say that
    the aggregator did not finish cleanly.
    """
    assert p.run_dir is not None
    if not export_on:
        say(f"the aggregator {why}; export was off, so no file is affected")
        return
    from traceml_ai.export import RankOutcome, write_finalization_warning
    from traceml_records import ExportLoss

    export_dir = p.run_dir / "aggregator" / "export"
    counted = export_dir.is_dir()
    written, all_closed = export_tally(export_dir) if counted else (0, False)
    if all_closed:
        # It went after closing every file (while stopping its live views or writing
        # stats.json): the files are complete, and only what it did after is unknown.
        say(
            f"the aggregator {why} after the export files were closed: the files are "
            f"complete ({written} records); aggregator/stats.json may be missing"
        )
        if exit_code == 0:
            return
    written_text = (
        f"{written} records were written (counted from the export files' data lines)"
        if counted
        else "the records written by the custom exporter are not counted (0 in the export block)"
    )
    message = (
        f"The aggregator process {why}, so the export did not finish: the export files "
        f"end without closing lines and {written_text}; the training script exited with "
        f"code {exit_code}."
    )
    loss = (
        None
        if all_closed
        else ExportLoss(
            written_records=written,
            dropped_batches=0,
            failed_records=0,
            skipped_items=0,
            exporter_failed=True,
        )
    )
    if all_closed:
        message = (
            f"The aggregator process {why} after the export files were closed; the "
            f"training script exited with code {exit_code}, and which ranks finished is "
            "not known."
        )
    ranks = None
    if exit_code != 0:
        # The aggregator kept the record of which ranks finished; with it gone, none is known.
        ranks = RankOutcome(
            expected_world_size=p.world_size,
            finished_ranks=(),
            missing_ranks=tuple(range(p.world_size)),
        )
    try:
        path = write_finalization_warning(
            p.run_dir,
            export_loss=loss,
            ranks=ranks,
            reason_if_ranks="ranks_disconnected" if ranks is not None else None,
            message=message,
        )
    except (OSError, ValueError) as exc:
        say(
            f"the aggregator {why}; export files lack closing lines, and "
            f"{p.run_dir / 'finalization_warning.json'} could not be written ({exc})"
        )
        return
    if not all_closed:
        say(f"the aggregator {why}; export files lack closing lines; see {path}")
    elif path is not None:
        say(f"see {path}")


def report_export_off(run_dir: Path, why: str) -> None:
    """The aggregator never started, so nothing was exported: say so in the warning file
    (``traceml run``, ``traceml serve`` and the Ray integration alike)."""
    from traceml_ai.export import write_finalization_warning
    from traceml_records import ExportLoss

    loss = ExportLoss(
        written_records=0,
        dropped_batches=0,
        failed_records=0,
        skipped_items=0,
        exporter_failed=True,
    )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = write_finalization_warning(
            run_dir,
            export_loss=loss,
            message=f"Export was off for this run because the aggregator did not start ({why}).",
        )
    except (OSError, ValueError) as exc:
        say(f"cannot write {run_dir / 'finalization_warning.json'}: {exc}")
        return
    if path is not None:
        say(f"something was lost; see {path}")
