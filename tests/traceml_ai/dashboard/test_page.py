"""The dashboard page in a real browser (Debian's chromium driven by Playwright), served
by the real web server on the loopback from each real source: the live state of an
in-process monitoring fed real batches, a run folder's export files, or a fixed view."""

from __future__ import annotations

import contextlib
import html
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from playwright.sync_api import Page, expect

from tests.traceml_ai.dashboard.big_runs import big_run
from traceml_ai.analysis import PhaseFigures, RankSteps
from traceml_ai.dashboard import start_live_dashboard
from traceml_ai.dashboard._files import FilesSource
from traceml_ai.dashboard._server import DashboardServer, Views, start_server
from traceml_ai.dashboard._view import MAX_GROUP_ROWS, MAX_TABLE_ROWS, RunData
from traceml_ai.monitor import Monitoring, RunInfo, start_monitoring
from traceml_ai.monitor.metrics import Health
from traceml_ai.settings import MonitorSettings
from traceml_ai.transport.wire import ReceivedBatch

pytestmark = pytest.mark.slow  # a real browser per module (docs/testing.md)

WAIT_MS = 20_000
P = "_traceml_internal:"
BASE_NS = 10**18


# --------------------------------------------------------------------------- sources


def _timing(ms: float) -> dict[str, Any]:
    return {"cpu": {"cpu_ms": ms, "duration_ms": ms, "gpu_ms": None, "is_gpu": False, "n_calls": 1}}


def _events(step_ms: float, phases: dict[str, float]) -> dict[str, Any]:
    """A step's events as a rank sends and the export writes them (names sorted)."""
    events = {P + "step_time": _timing(step_ms)}
    events.update({name: _timing(ms) for name, ms in phases.items()})
    return dict(sorted(events.items()))


def _identity(rank: int, world: int) -> dict[str, Any]:
    return {
        "global_rank": rank,
        "local_rank": rank,
        "world_size": world,
        "local_world_size": world,
        "node_rank": 0,
        "pid": 1000 + rank,
        "hostname": "h",
    }


def _item(step: int, step_ms: float, phases: dict[str, float]) -> dict[str, Any]:
    return {
        "seq": step - 1,
        "step": step,
        "timestamp_unix_ns": BASE_NS + step * 100_000_000,
        "events": _events(step_ms, phases),
    }


@contextlib.contextmanager
def live_page(
    tmp_path: Path, steps: dict[int, list[dict[str, Any]]]
) -> Iterator[tuple[str, Monitoring]]:
    """The live dashboard of an in-process aggregator's monitoring, fed ``steps`` (rank
    -> step_time items) as real encoded batches."""
    monitoring = start_monitoring(
        MonitorSettings(dashboard=True, dashboard_port=0),
        RunInfo(run_dir=tmp_path / "run", run_name="live", host="h"),
        Health,
        sinks={"dashboard": start_live_dashboard},
        report=lambda line: None,
    )
    assert monitoring is not None
    try:
        world = len(steps)
        for rank, items in steps.items():
            body = orjson.dumps(
                {"v": 1, "token": "t", "type": "batch", "stream": "step_time",
                 "identity": _identity(rank, world), "items": items}
            )  # fmt: skip
            monitoring.submit(
                ReceivedBatch(observed_timestamp_unix_ns=1, payload=body, nbytes=len(body))
            )
        deadline = time.monotonic() + 10
        want = {r: len(items) for r, items in steps.items()}
        while {r.rank: r.steps for r in monitoring.state.ranks()} != want:
            assert time.monotonic() < deadline, "the feed did not take the steps"
            time.sleep(0.02)
        (sink,) = monitoring.sinks
        yield sink.url, monitoring  # type: ignore[attr-defined]
    finally:
        monitoring.close(2.0)


def write_run(folder: Path, steps: dict[int, list[dict[str, Any]]]) -> Path:
    """A run folder whose step_time.jsonl holds ``steps`` (rank -> items), closed."""
    lines = []
    world = len(steps)
    for rank, items in steps.items():
        for item in items:
            lines.append(
                {"stream": "step_time", "schema_version": 1,
                 "observed_timestamp_unix_ns": item["timestamp_unix_ns"], "rank": rank,
                 **{k: v for k, v in _identity(rank, world).items() if k not in ("pid", "hostname")},
                 **item}
            )  # fmt: skip
    lines.append({"stream": "step_time", "closing": True, "schema_version": 1,
                  "written_records": len(lines), "dropped_batches": 0})  # fmt: skip
    export = folder / "aggregator" / "export"
    export.mkdir(parents=True)
    (export / "step_time.jsonl").write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in lines))
    return folder


@contextlib.contextmanager
def served(source: Callable[[], RunData]) -> Iterator[DashboardServer]:
    server = start_server(Views(source, final=lambda: False), "127.0.0.1", 0)
    try:
        yield server
    finally:
        server.stop(2.0)


def fixed_run(**changes: Any) -> RunData:
    """A small live run: 4 ranks of 3 steps each, with ``changes``."""
    ranks = [0, 1, 2, 3]
    figures = RankSteps(
        steps=3, first_step=1, last_step=3, p50_ms=10.0, p90_ms=10.0, p99_ms=10.0,
        max_ms=10.0, mean_ms=10.0, steps_per_s=10.0,
    )  # fmt: skip
    fields: dict[str, Any] = {
        "source": "live",
        "finished": False,
        "status": "training",
        "run_name": "r",
        "run_folder": "/runs/r",
        "ranks": ranks,
        "step_time": {str(r): figures for r in ranks},
        "phases": {str(r): {"forward": PhaseFigures(mean_ms=6.0, p50_ms=6.0, share=0.6),
                            "rest": PhaseFigures(mean_ms=4.0, p50_ms=4.0, share=0.4)}
                   for r in ranks},
        "phase_names": ["forward", "rest"],
        "series": {r: [(s, 10.0, float(BASE_NS + s * 10**8)) for s in (1, 2, 3)] for r in ranks},
        "loss": {"status": "in_progress", "lines": [], "warning": None},
    }  # fmt: skip
    fields.update(changes)
    return RunData(**fields)


def phase_bars(page: Page, ranks: int) -> list[tuple[str, list[float]]]:
    """The phase chart's bars as drawn: (name, mean ms per rank) of each trace (the
    name as Plotly shows it: its markup characters are given as entities)."""
    expect(page.locator("#chart-phases .main-svg").first).to_be_visible(timeout=WAIT_MS)
    page.wait_for_function(
        f"() => {{ const d = document.getElementById('chart-phases').data;"
        f" return d && d.length && d[0].y.length === {ranks}; }}",
        timeout=WAIT_MS,
    )
    bars: list[tuple[str, list[float]]] = page.evaluate(
        "() => document.getElementById('chart-phases').data.map(t => [t.name, t.y])"
    )
    return [(html.unescape(name), y) for name, y in bars]


# --------------------------------------------------------------------------- phases

USER_PHASES = [f"phase_{i:02d}" for i in range(58)]


def _many_phases(rank: int, step: int) -> dict[str, Any]:
    phases = {P + "forward_time": 10.0, P + "backward_time": 15.0 + rank}
    phases.update({name: 0.6 for name in USER_PHASES})
    return _item(step, 69.0 + rank, phases)


def test_phase_bars_add_up_to_the_step_with_other_live_and_from_files(
    page: Page, tmp_path: Path
) -> None:
    """58 user phases: the live page and the page from files fold them by the one rule
    (the first 8 to appear keep their names, the rest are ``other``), and each rank's
    bars add up to its step."""
    steps = {r: [_many_phases(r, s) for s in range(1, 6)] for r in (0, 1)}
    expected = [
        "dataloader_wait", "forward", "backward", "optimizer",
        *(f"user:{n}" for n in USER_PHASES[:8]), "other", "rest",
    ]  # fmt: skip
    drawn: dict[str, list[tuple[str, list[float]]]] = {}
    with live_page(tmp_path, steps) as (url, _):
        page.goto(url)
        drawn["live"] = phase_bars(page, 2)
        # The page says what its straggler percentage covers.
        expect(page.locator("#window")).to_contain_text("its +% over the run so far")
    folder = write_run(tmp_path / "files", steps)
    with served(FilesSource(folder)) as server:
        page.goto(server.url)
        drawn["files"] = phase_bars(page, 2)
    for where, bars in drawn.items():
        assert [name for name, _ in bars] == expected, where
        totals = [sum(y[i] for _, y in bars) for i in range(2)]
        assert totals == pytest.approx([69.0, 70.0], abs=0.01), (where, bars)
        other = dict(bars)["other"]
        assert other == pytest.approx([50 * 0.6] * 2), where


def test_phase_colours_never_repeat_and_built_ins_keep_theirs(page: Page) -> None:
    """Built-in phases have fixed colours; the user phases (8 at most) take theirs from a
    palette without them: every bar of the chart has a colour of its own."""
    names = ["dataloader_wait", "h2d", "forward", "backward", "optimizer",
             *(f"user:u{i}" for i in range(8)), "other", "rest"]  # fmt: skip
    share = 1.0 / len(names)
    phases = {n: PhaseFigures(mean_ms=1.0, p50_ms=1.0, share=share) for n in names}

    def colours(data: RunData) -> dict[str, str]:
        with served(lambda: data) as server:
            page.goto(server.url)
            phase_bars(page, 4)
            out: dict[str, str] = page.evaluate(
                "() => Object.fromEntries(document.getElementById('chart-phases')._fullData"
                ".map(t => [t.name, t.marker.color]))"
            )
        return out

    many = colours(fixed_run(phases={str(r): phases for r in range(4)}, phase_names=names))
    assert len(set(many.values())) == len(names), many
    few = colours(fixed_run())
    # A built-in phase is drawn in the same colour whatever else the chart holds.
    assert few["forward"] == many["forward"] and few["rest"] == many["rest"]


# --------------------------------------------------------------------------- user strings

HOSTILE = "<b>x</b>&amp;<br>"


def test_user_strings_are_shown_as_written_never_as_markup(page: Page, tmp_path: Path) -> None:
    """A phase named like markup is drawn as its name (Plotly interprets a subset of HTML
    in trace names); the run name, host and folder are text too."""
    steps = {r: [_item(s, 20.0, {P + "forward_time": 5.0, HOSTILE: 3.0}) for s in range(1, 5)]
             for r in (0, 1)}  # fmt: skip
    folder = write_run(tmp_path / "files", steps)
    with served(FilesSource(folder)) as server:
        page.goto(server.url)
        names = [name for name, _ in phase_bars(page, 2)]
        assert f"user:{HOSTILE}" in names
        legend = page.locator("#chart-phases .legendtext").all_text_contents()
        assert f"user:{HOSTILE}" in legend, legend
    data = fixed_run(run_name=HOSTILE, host=f"<i>{HOSTILE}", run_folder=f"/r/{HOSTILE}")
    with served(lambda: data) as server:
        page.goto(server.url)
        expect(page.locator("#run-name")).to_have_text(HOSTILE, timeout=WAIT_MS)
        expect(page.locator("#identity")).to_contain_text(f"aggregator on <i>{HOSTILE}")


# --------------------------------------------------------------------------- show rank


def test_show_rank_refuses_ranks_that_do_not_exist(page: Page) -> None:
    data = fixed_run()
    with served(lambda: data) as server:
        page.goto(server.url)
        expect(page.locator("#ranks-table tr[data-rank='3']")).to_be_visible(timeout=WAIT_MS)
        page.fill("#rank-input", "2, 9, x, -1")
        page.click("#rank-add")
        refused = page.locator("#rank-refused")
        expect(refused).to_be_visible()
        expect(refused).to_contain_text("9")
        expect(refused).to_contain_text("x")
        expect(refused).to_contain_text("-1")
        expect(refused).to_contain_text("ranks with steps: 0-3")
        expect(page.locator("#rank-picked")).to_have_text("also shown: 2")
        with page.expect_request(lambda r: "/api/view" in r.url, timeout=WAIT_MS) as asked:
            pass
        assert asked.value.url.endswith("/api/view?ranks=2"), asked.value.url
        # A good rank alone clears the refusal.
        page.fill("#rank-input", "1")
        page.click("#rank-add")
        expect(refused).to_be_hidden()
        expect(page.locator("#rank-picked")).to_have_text("also shown: 1, 2")


# --------------------------------------------------------------------------- favicon


def test_loading_the_page_asks_for_nothing_it_lacks(page: Page) -> None:
    """No request of a page load fails (browsers ask for /favicon.ico unless the page
    names an icon), and /favicon.ico itself is served."""
    failed: list[str] = []
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    data = fixed_run()
    with served(lambda: data) as server:
        page.goto(server.url)
        expect(page.locator("#ranks-table tr[data-rank='3']")).to_be_visible(timeout=WAIT_MS)
        page.wait_for_timeout(1500)  # a second poll, and the icon's request if any
        with urllib.request.urlopen(server.url + "favicon.ico", timeout=5) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("image/")
            assert response.read().startswith(b"<svg")
    assert failed == []
    assert page.locator("link[rel='icon']").count() == 1


# --------------------------------------------------------------------------- commands


def test_the_stopped_page_names_a_command_that_works_in_a_shell(page: Page) -> None:
    """A finalized live page whose server went names ``traceml dashboard`` with the run
    folder quoted for a shell (a quote and spaces in it)."""
    import shlex

    folder = "/runs/it's my run"
    data = fixed_run(finished=True, status="finalized", run_folder=folder)
    with served(lambda: data) as server:
        page.goto(server.url)
        expect(page.locator("#status")).to_have_attribute("data-finished", "true", timeout=WAIT_MS)
    error = page.locator("#error")
    expect(error).to_contain_text("traceml dashboard", timeout=WAIT_MS)
    text = error.inner_text()
    command = text[text.index("traceml dashboard") :].removesuffix(" shows it from its files.")
    assert shlex.split(command) == ["traceml", "dashboard", folder], text


# --------------------------------------------------------------------------- many ranks


def test_the_page_of_10240_ranks_shows_nodes_and_outliers_not_a_row_per_rank(
    page: Page,
) -> None:
    """10,240 ranks on 1,280 nodes, node 77's ranks slower and rank 4242 (node 530)
    much slower: the page's first paint has the node table (those two nodes in it)
    and the outlier ranks (4242 among them), bounded; the node chart then draws every
    node once Plotly has loaded."""
    slower = {r: 1.5 for r in range(77 * 8, 78 * 8)}
    slower[4242] = 3.0
    data = big_run(10240, slower=slower)
    with served(lambda: data) as server:
        page.goto(server.url)
        page.wait_for_function(
            "() => document.documentElement.dataset.ready === '1'", timeout=WAIT_MS
        )
        assert page.evaluate("() => window.tracemlFirstPaintMs") > 0
        expect(page.get_by_test_id("groups")).to_be_visible()
        nodes = page.locator("#groups table[data-by='node'] tbody tr")
        expect(nodes).to_have_count(MAX_GROUP_ROWS)
        first_cells = nodes.locator("td:first-child").all_text_contents()
        assert {"77", "530"} <= set(first_cells), first_cells
        expect(page.locator("#group-node h3")).to_contain_text("1,280 nodes")
        expect(page.locator("#ranks-table tbody tr")).to_have_count(MAX_TABLE_ROWS)
        expect(page.locator("#ranks-table tr[data-rank='4242']")).to_be_visible()
        expect(page.locator("#identity")).to_contain_text("1,280 node(s)")
        expect(page.locator("#system-caption")).to_contain_text("of 1,280 nodes")
        # Tables of 16 rows (the GPUs of 16 nodes: 128), never a row per rank or node.
        assert page.locator("tr").count() < 400
        page.wait_for_function(
            "() => { const d = document.getElementById('chart-group-node').data;"
            " return d && d.length === 3 && d[0].x.length === 1280; }",
            timeout=WAIT_MS,
        )


def test_the_page_from_files_paints_its_tables_then_draws_every_chart(
    page: Page, tmp_path: Path
) -> None:
    """A 72-rank run folder (9 nodes) served from its files: the first paint has the
    verdict, the node table, the outlier ranks and their phase bars' data; the step-time,
    throughput and phase charts are then drawn, the step-time chart with every step."""
    from bench.bigfile import write_step_time

    steps = 16
    run = tmp_path / "run"
    export = run / "aggregator" / "export"
    export.mkdir(parents=True)
    write_step_time(export / "step_time.jsonl", 72 * steps, world=72)
    views: list[str] = []
    page.on("request", lambda r: views.append(r.url) if "/api/view" in r.url else None)
    with served(FilesSource(run)) as server:
        page.goto(server.url)
        page.wait_for_function(
            "() => document.documentElement.dataset.ready === '1'", timeout=WAIT_MS
        )
        expect(page.locator("#status")).to_contain_text("from files: files complete")
        expect(page.get_by_test_id("verdict")).to_contain_text("straggler: none")
        expect(page.locator("#groups table[data-by='node'] tbody tr")).to_have_count(9)
        expect(page.locator("#ranks-table tbody tr")).to_have_count(MAX_TABLE_ROWS)
        for chart in ("steps", "throughput", "phases"):
            expect(page.locator(f"#chart-{chart} .main-svg").first).to_be_visible(timeout=WAIT_MS)
        page.wait_for_function(
            "() => { const d = document.getElementById('chart-steps').data;"
            f" return d && d.some(t => t.x && t.x.length === {steps}); }}",
            timeout=WAIT_MS,
        )
        bars = phase_bars(page, MAX_TABLE_ROWS)
        assert {"forward", "backward"} <= {name for name, _ in bars}
    assert views[0].endswith("?charts=0") and not views[1].endswith("charts=0"), views
