"""What the files say about their completeness: each file's state (closing line,
damage), ``finalization_warning.json``, and the verdict as one sentence.

Light to import: orjson only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import orjson

from traceml_ai.analysis._model import FileState, LossReport, LossStatus, RunSummary
from traceml_ai.analysis._read import FileRead, exists, read_bytes

WARNING_FILE = "finalization_warning.json"


def _read_warning(path: Path) -> tuple[Any, str | None]:
    """finalization_warning.json's object, or why it cannot be read."""
    data, problem = read_bytes(path)
    if data is None:
        return None, problem
    try:
        warning = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc}); what was lost is unknown"
    if not isinstance(warning, dict):
        kind = "an array" if isinstance(warning, list) else type(warning).__name__
        return None, f"not a JSON object ({kind}); what was lost is unknown"
    if not isinstance(warning.get("reason"), str) or not isinstance(warning.get("message"), str):
        return warning, "no reason or message: not a finalization warning"
    return warning, None


def _file_state(info: FileRead) -> FileState:
    closing = info.closing
    written = closing.get("written_records") if closing is not None else None
    dropped = closing.get("dropped_batches") if closing is not None else None
    return FileState(
        data_lines=info.data_lines,
        closed=closing is not None,
        partial_last_line=info.partial_last_line,
        bytes=info.size,
        written_records=written if type(written) is int else None,
        dropped_batches=dropped if type(dropped) is int else None,
        mismatch=closing is not None and written != info.data_lines,
        unreadable=info.problem,
        unreadable_lines=info.unreadable_lines,
        impossible_lines=info.impossible_lines,
        duplicate_keys=info.duplicate_keys,
        lines_after_closing=info.lines_after_closing,
        closing_lines=info.closing_lines,
    )


def loss_report(
    reads: dict[str, FileRead], run_dir: Path | None, notes: list[str], problems: list[str]
) -> LossReport:
    """What the files say about their completeness; adds the warning file's problem to
    ``problems``."""
    files = {name: _file_state(info) for name, info in reads.items()}
    unfinished = sorted(
        name for name, info in reads.items() if info.closing is None and info.problem is None
    )
    dropped = {f.dropped_batches for f in files.values() if f.dropped_batches is not None}
    warning: dict[str, Any] | None = None
    warning_path = run_dir / WARNING_FILE if run_dir is not None else None
    if warning_path is not None and exists(warning_path):
        found, problem = _read_warning(warning_path)
        warning = found
        if problem is not None:
            problems.append(f"{WARNING_FILE}: {problem}")
            warning = {"unreadable": problem, **(found or {})}
    readable_warning = warning is not None and "unreadable" not in warning
    if (
        warning is not None
        and readable_warning
        and warning.get("reason") == "monitoring_incomplete"
    ):
        # Only the live views (Prometheus, OTLP, the dashboard) lost something: the
        # files are judged on their own.
        notes.append(f"{WARNING_FILE}: {warning.get('message')}")
        readable_warning = False
    status: LossStatus
    if readable_warning:
        status = "lost"
    elif problems:
        status = "damaged"
    elif unfinished:
        status = "in_progress"
    elif dropped and max(dropped) > 0:
        status = "lost"
    else:
        status = "complete"
    if unfinished:
        notes.append(
            f"no closing line yet in {', '.join(unfinished)}: "
            "the run is in progress or did not finish cleanly"
        )
    warning_file = str(warning_path) if warning is not None else None
    dropped_batches = max(dropped) if dropped else None
    return LossReport(
        status=status,
        dropped_batches=dropped_batches,
        files=files,
        unfinished_files=unfinished,
        warning=warning,
        warning_file=warning_file,
        line=_loss_line(status, unfinished, len(problems), warning, warning_file, dropped_batches),
        short_line=_loss_line(
            status, unfinished, len(problems), warning, warning_file, dropped_batches, full=False
        ),
    )


def with_problems(summary: RunSummary, extra: Sequence[str]) -> RunSummary:
    """``summary`` with more problems (a file that changed under a reader, say): the
    files are then never complete, and the loss report says so."""
    new = [p for p in extra if p not in summary.problems]
    if not new:
        return summary
    problems = [*summary.problems, *new]
    loss = summary.loss
    status: LossStatus = "damaged" if loss.status in ("complete", "in_progress") else loss.status

    def line(full: bool) -> str:
        return _loss_line(
            status,
            loss.unfinished_files,
            len(problems),
            loss.warning,
            loss.warning_file,
            loss.dropped_batches,
            full,
        )

    loss = attrs.evolve(loss, status=status, line=line(True), short_line=line(False))
    return attrs.evolve(summary, problems=problems, loss=loss)


def _loss_line(
    status: LossStatus,
    unfinished: Sequence[str],
    problems: int,
    warning: Mapping[str, Any] | None,
    warning_file: str | None,
    dropped_batches: int | None,
    full: bool = True,
) -> str:
    """The files' verdict as one sentence."""
    if status == "complete":
        return "files: complete (every file closed, nothing lost)"
    if status == "in_progress":
        return f"files: in progress or unfinished (no closing line in {', '.join(unfinished)})"
    if status == "damaged":
        return f"files: damaged, not complete ({problems} problem(s), on the lines above)"
    if warning is not None and warning.get("message"):
        if not full:
            # traceml run has just printed the warning's path; the reason is enough here.
            return f"files: incomplete ({warning.get('reason')}; see {warning_file})"
        return (
            f"files: incomplete ({warning.get('reason')}): {warning['message']} "
            f"(see {warning_file})"
        )
    return f"files: incomplete ({dropped_batches} dropped batches)"
