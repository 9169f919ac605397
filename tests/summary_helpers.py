"""The run summary as the tests read it: its ``--json`` object (the documented form),
and the text of a summary taken back from that object, so every test that reads a
summary also proves that its JSON form round-trips."""

from __future__ import annotations

import os
from typing import Any

from traceml_ai.analysis import RunSummary, format_summary, summarize_run


def summarize_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``traceml summary --json``'s object for ``path``."""
    return summarize_run(path).to_json()


def format_json(summary: dict[str, Any], full: bool = True, ranks: bool = False) -> str:
    """The text of the summary whose JSON form is ``summary`` (``ranks``: with the
    per-rank table)."""
    typed = RunSummary.from_json(summary)
    assert typed.to_json() == summary  # the JSON form round-trips
    return format_summary(typed, full=full, ranks=ranks)
