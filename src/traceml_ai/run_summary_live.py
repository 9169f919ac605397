"""``traceml summary --follow``: a rich terminal view refreshed while the run writes.

It re-reads the aggregator's export files on every refresh, so it shows every rank
of every node, and stops by itself when every file has its closing line.
"""

from __future__ import annotations

import os
import time
from typing import Any

from traceml_ai.run_summary import SummaryError, format_summary, straggler_line, summarize_run

_MAX_ROWS = 32
"""Rows of the live table; more ranks show the stragglers and the slowest."""


def _render(summary: dict[str, Any] | None, waiting: str | None) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if summary is None:
        return Text(f"traceml: {waiting} (waiting; Ctrl-C to stop)")
    parts: list[Any] = []
    title = f"traceml: {summary.get('run_folder') or summary['export_folder']}"
    steps = summary.get("step_time")
    if steps:
        table = Table(title=title, title_justify="left")
        for col in ("rank", "steps", "p50 ms", "p90 ms", "p99 ms", "max ms", "steps/s"):
            table.add_column(col, justify="right")
        names = summary["phase_names"]
        for name in names:
            table.add_column(f"{name} ms", justify="right")
        stragglers = {s["rank"] for s in summary["straggler"].get("stragglers", [])}
        ranks = summary["ranks"]
        if len(ranks) > _MAX_ROWS:
            # Many ranks: the stragglers and the slowest by p50 fit on a screen.
            by_p50 = sorted(ranks, key=lambda r: -steps[str(r)]["p50_ms"])
            order = [*sorted(stragglers), *(r for r in by_p50 if r not in stragglers)]
            shown = sorted(order[:_MAX_ROWS])
            table.caption = (
                f"{len(shown)} of {len(ranks)} ranks: the stragglers, then the slowest p50"
            )
        else:
            shown = ranks
        for r in shown:
            s = steps[str(r)]
            ph = summary["phases"][str(r)]
            table.add_row(
                f"{r}{' *' if r in stragglers else ''}",
                str(s["steps"]),
                f"{s['p50_ms']:.2f}",
                f"{s['p90_ms']:.2f}",
                f"{s['p99_ms']:.2f}",
                f"{s['max_ms']:.2f}",
                f"{s['steps_per_s']:.2f}",
                *(f"{ph[n]['mean_ms']:.2f}" for n in names),
                style="bold red" if r in stragglers else None,
            )
        parts.append(table)
        parts.append(Text(f"traceml: {straggler_line(summary)}"))
    else:
        parts.append(Text(title))
    # The last lines of the plain text: export status and what cannot be shown.
    tail = [
        line
        for line in format_summary(summary).splitlines()
        if line.startswith(("traceml: files:", "traceml: note:"))
    ]
    parts.extend(Text(line) for line in tail)
    return Group(*parts)


def follow(path: str | os.PathLike[str], interval: float = 1.0) -> dict[str, Any] | None:
    """Refresh the view every ``interval`` seconds until every file is closed.

    Returns the last summary (None if the folder never appeared). Ctrl-C stops the
    view and returns what was shown.
    """
    from rich.console import Console
    from rich.live import Live

    console = Console()
    summary: dict[str, Any] | None = None
    with Live(_render(None, f"{os.fspath(path)}: no export files yet"), console=console) as live:
        try:
            while True:
                try:
                    summary = summarize_run(path)
                    live.update(_render(summary, None))
                except SummaryError as exc:
                    live.update(_render(None, str(exc)))
                if summary is not None and summary["loss"]["status"] != "in_progress":
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
    return summary
