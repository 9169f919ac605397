"""``traceml summary --follow``: a rich terminal view refreshed while the run writes.

It reads the aggregator's export files, so it shows every rank of every node, and
stops by itself when every file it can read has its closing line. Each refresh reads
only what was appended since the last one (:class:`RunReader`).
The view fits an 80-column terminal (one column for the largest phase, not one per
phase); ``short=True`` shows the few lines of ``--short`` instead of the table.

Files change under it only by growing: a file that shrinks, is replaced, rewritten or
disappears while followed is read again from its start (or dropped) and said on a
``problem:`` line of every later refresh and of the returned summary (so ``traceml summary`` exits non-zero), never skipped silently; a
refresh that fails is shown as an error line and the view goes on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from traceml_ai.analysis._model import PhaseFigures, RunSummary
from traceml_ai.analysis._straggler import verdict_line
from traceml_ai.analysis._summarize import RunReader, SummaryError
from traceml_ai.analysis._text import format_summary

_MAX_ROWS = 32
"""Rows of the live table; more ranks show the stragglers and the slowest."""


def _largest_phase(phases: Mapping[str, PhaseFigures], names: list[str]) -> str:
    name = max(names, key=lambda n: phases[n].share)
    # The share first: a long user phase name is what gets cut at the column's end.
    return f"{phases[name].share * 100:.0f}% {name}"


def _tail(summary: RunSummary, short: bool) -> list[str]:
    """The last lines: problems, the files' verdict, and (not short) the notes."""
    lines = [*(f"problem: {p}" for p in summary.problems), summary.loss.line]
    if not short:
        lines.extend(f"note: {n}" for n in summary.notes)
    return [f"traceml: {line}" for line in lines]


def _render(summary: RunSummary | None, waiting: str | None, short: bool = False) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if summary is None:
        return Text(f"traceml: {waiting} (waiting; Ctrl-C to stop)")
    parts: list[Any] = []
    if waiting:
        parts.append(Text(f"traceml: {waiting}"))
    if short:
        parts.extend(Text(line) for line in format_summary(summary, full=False).splitlines())
        return Group(*parts)
    title = f"traceml: {summary.title}"
    steps = summary.step_time
    if steps and summary.phases:
        # No borders, two spaces between columns: seven columns of figures fit 80.
        table = Table(
            title=title,
            title_justify="left",
            box=None,
            padding=(0, 1),
            pad_edge=False,
            header_style="bold",
        )
        for col in ("rank", "steps", "p50 ms", "p99 ms", "max ms", "steps/s"):
            table.add_column(col, justify="right", no_wrap=True)
        table.add_column("largest phase", overflow="ellipsis", no_wrap=True, max_width=22)
        names = summary.phase_names
        stragglers = set(summary.straggler.named_ranks if summary.straggler else ())
        ranks = summary.ranks
        if len(ranks) > _MAX_ROWS:
            # Many ranks: the stragglers and the slowest by p50 fit on a screen.
            by_p50 = sorted(ranks, key=lambda r: -steps[str(r)].p50_ms)
            order = [*sorted(stragglers), *(r for r in by_p50 if r not in stragglers)]
            shown = sorted(order[:_MAX_ROWS])
            table.caption = (
                f"{len(shown)} of {len(ranks)} ranks: the stragglers, then the slowest p50"
            )
        else:
            shown = ranks
        for r in shown:
            s = steps[str(r)]
            table.add_row(
                f"{r}{' *' if r in stragglers else ''}",
                str(s.steps),
                f"{s.p50_ms:.2f}",
                f"{s.p99_ms:.2f}",
                f"{s.max_ms:.2f}",
                f"{s.steps_per_s:.2f}",
                _largest_phase(summary.phases[str(r)], names),
                style="bold red" if r in stragglers else None,
            )
        parts.append(table)
        parts.append(Text(f"traceml: {verdict_line(summary.straggler)}"))
    else:
        parts.append(Text(title))
    parts.extend(Text(line) for line in _tail(summary, short))
    return Group(*parts)


def follow(
    path: str | os.PathLike[str],
    interval: float = 1.0,
    *,
    short: bool = False,
    stderr: bool = False,
) -> RunSummary | None:
    """Refresh the view every ``interval`` seconds until every readable file is closed.

    The view goes to stdout, or to stderr with ``stderr=True`` (``--json`` keeps stdout
    for the JSON). Returns the last summary (None if the folder never held export
    files); Ctrl-C stops the view and returns what was shown.
    """
    from rich.console import Console
    from rich.live import Live

    console = Console(stderr=stderr)
    summary: RunSummary | None = None
    reader: RunReader | None = None
    waiting = f"{os.fspath(path)}: no export files yet"
    with Live(_render(None, waiting), console=console) as live:
        try:
            while True:
                done = False
                try:
                    # One reader for the whole view: each refresh reads what was
                    # appended since the last one.
                    reader = reader or RunReader(path)
                    summary = reader.summary()
                    done = summary.loss.finished
                    live.update(_render(summary, None, short))
                except SummaryError as exc:
                    live.update(_render(summary, str(exc), short))
                except Exception as exc:  # a bug must show, not end the view silently
                    error = f"error: refresh failed: {type(exc).__name__}: {exc}"
                    live.update(_render(summary, error, short))
                if done:
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
    return summary
