"""The dashboard from files (``traceml dashboard FOLDER``) over real HTTP on the loopback:
the page's first view (``?charts=0``) holds every figure and table of the run summary,
and the second request adds the lines over steps; the page data's phase breakdown,
made only for the ranks the page shows."""

from __future__ import annotations

import contextlib
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from bench.bigfile import write_step_time
from traceml_ai.analysis import RunReader, summarize_run, verdict_line
from traceml_ai.dashboard import serve_folder
from traceml_ai.dashboard._files import RankPhases, from_summary
from traceml_ai.dashboard._view import HIGHLIGHT, MAX_TABLE_ROWS, build_view

RANKS = 72
"""9 nodes of 8: past the size where the page groups the ranks by node."""
STEPS = 24
CHARTS = ("step_time", "throughput")
"""The view's parts that the first view leaves out (the lines over steps)."""


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return orjson.loads(response.read())


@contextlib.contextmanager
def _serving(folder: Path) -> Iterator[str]:
    """``traceml dashboard FOLDER``'s own code on a thread; the page's URL."""
    lines: list[str] = []
    stop = threading.Event()
    done: list[int] = []
    thread = threading.Thread(
        target=lambda: done.append(serve_folder(folder, "127.0.0.1", 0, stop=stop,
                                                report=lines.append)),
    )  # fmt: skip
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not (found := re.search(r" at (http://\S+) ", " ".join(lines))):
            assert thread.is_alive() and time.monotonic() < deadline, lines
            time.sleep(0.02)
        yield found.group(1)
    finally:
        stop.set()
        thread.join(10)
    assert done == [0], lines


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    export = run / "aggregator" / "export"
    export.mkdir(parents=True)
    write_step_time(export / "step_time.jsonl", RANKS * STEPS, world=RANKS)
    return run


def test_the_first_view_has_the_summarys_figures_and_the_second_request_the_charts(
    tmp_path: Path,
) -> None:
    """A finished 72-rank run: the first view (``?charts=0``) says the summary's verdict,
    the files' state, the spread across ranks, the node table and the outlier ranks with
    the summary's own figures, the phases, with no line over steps; the next request
    (what the page asks once it is painted) is the same page with the step-time and
    throughput lines of every step."""
    run = _run(tmp_path)
    summary = summarize_run(run)
    steps = summary.step_time or {}
    with _serving(run) as url:
        first = _get(f"{url}api/view?charts=0")
        full = _get(f"{url}api/view")

    assert first["finished"] and first["status"] == "files complete"
    assert first["loss"]["status"] == "complete"
    assert first["identity"]["world_size"] == RANKS
    assert first["identity"]["ranks_reporting"] == RANKS and first["identity"]["node_count"] == 9
    assert summary.straggler is not None
    assert first["straggler"]["line"] == verdict_line(summary.straggler)
    p50s = sorted(s.p50_ms for s in steps.values())
    (spread,) = [row for row in first["spread"] if row["figure"] == "step time p50 (ms)"]
    assert (spread["min"], spread["max"]) == (p50s[0], p50s[-1])
    (nodes,) = first["groups"]
    assert nodes["by"] == "node" and nodes["count"] == 9 and len(nodes["chart"]["group"]) == 9
    assert sum(row["ranks"] for row in nodes["rows"]) == RANKS
    table = first["ranks"]
    assert len(table) == MAX_TABLE_ROWS
    for row in table:
        figures = steps[str(row["rank"])]
        assert (row["p50_ms"], row["p99_ms"], row["steps"]) == (
            figures.p50_ms, figures.p99_ms, STEPS
        )  # fmt: skip
        assert row["largest_phase"] == "backward"
    assert first["phases"]["ranks"] == [row["rank"] for row in table]
    assert {"forward", "backward", "optimizer"} <= set(first["phases"]["names"])
    assert first["throughput"]["job_steps_per_s"] is not None
    # No line over steps in the first view.
    assert first["step_time"]["deferred"] and first["step_time"]["steps"] == []
    assert first["step_time"]["lines"] == [] and first["throughput"]["steps_per_s"] == []

    # The second request fills the charts, every step a point (fewer than MAX_POINTS).
    chart = full["step_time"]
    assert "deferred" not in chart and chart["band"]
    assert chart["steps"] == list(range(1, STEPS + 1))
    assert len(chart["median"]) == len(chart["p10"]) == len(chart["p90"]) == STEPS
    assert all(low <= mid <= high for low, mid, high in
               zip(chart["p10"], chart["median"], chart["p90"], strict=True))  # fmt: skip
    assert 1 <= len(chart["lines"]) <= HIGHLIGHT
    assert all(len(line["values"]) == STEPS for line in chart["lines"])
    rate = full["throughput"]["steps_per_s"]
    assert len(rate) == STEPS and all(r is None or r > 0 for r in rate[1:]) and any(rate)
    # The rest of the page is the first view's, as it was.
    same = ("generated_unix_s", *CHARTS)
    assert {k: v for k, v in full.items() if k not in same} == {
        k: v for k, v in first.items() if k not in same
    }
    assert full["throughput"]["job_steps_per_s"] == first["throughput"]["job_steps_per_s"]


def test_a_growing_run_first_view_then_charts_then_the_new_steps(tmp_path: Path) -> None:
    """A run still being written (no closing line): the first view says so without its
    lines; the charts come with the next request; lines appended later show in both."""
    run = _run(tmp_path)
    path = run / "aggregator" / "export" / "step_time.jsonl"
    longer = tmp_path / "longer.jsonl"
    write_step_time(longer, RANKS * (STEPS + 4), world=RANKS)
    lines = longer.read_bytes().splitlines(keepends=True)[:-1]  # no closing line
    path.write_bytes(b"".join(lines[: RANKS * STEPS]))
    with _serving(run) as url:
        first = _get(f"{url}api/view?charts=0")
        assert not first["finished"] and first["loss"]["status"] == "in_progress"
        assert first["step_time"]["deferred"] and first["step_time"]["steps"] == []
        assert {row["steps"] for row in first["ranks"]} == {STEPS}
        full = _get(f"{url}api/view")
        assert full["step_time"]["steps"] == list(range(1, STEPS + 1))
        with path.open("ab") as fh:
            fh.write(b"".join(lines[RANKS * STEPS :]))
        deadline = time.monotonic() + 20
        while True:
            later = _get(f"{url}api/view")
            if later["step_time"]["steps"][-1:] == [STEPS + 4]:
                break
            assert time.monotonic() < deadline, later["step_time"]["steps"][-3:]
            time.sleep(0.2)
        assert {row["steps"] for row in later["ranks"]} == {STEPS + 4}
        again = _get(f"{url}api/view?charts=0")
        assert again["step_time"]["steps"] == [] and again["ranks"] == later["ranks"]


def test_the_phase_breakdown_is_made_for_the_ranks_asked_and_is_the_summarys(
    tmp_path: Path,
) -> None:
    """The dashboard's reader leaves the per-rank phase breakdown out; the page data
    makes a rank's when the view reads it (the tables' ranks only), the same figures as
    ``traceml summary``'s, and the page is the one every rank's breakdown gives."""
    run = _run(tmp_path)
    whole = summarize_run(run)
    assert whole.phases is not None and len(whole.phases) == RANKS
    lean = RunReader(run, phases=False).summary()
    assert lean.phases == {} and lean.step_time == whole.step_time
    data = from_summary(lean)
    assert isinstance(data.phases, RankPhases) and len(data.phases) == RANKS
    view = build_view(data)
    made = set(data.phases._made)
    assert made == {str(row["rank"]) for row in view["ranks"]} and len(made) == MAX_TABLE_ROWS
    assert dict(data.phases) == whole.phases
    assert "72" not in data.phases and data.phases.get("72") is None
    full = build_view(from_summary(whole))
    assert {**view, "generated_unix_s": 0} == {**full, "generated_unix_s": 0}
