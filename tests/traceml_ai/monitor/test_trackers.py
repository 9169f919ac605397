"""The experiment trackers' sink: the figures of a point, the points of a run read back
with TensorBoard's own reader, the generated names table, and each fault costing one
line and counted points (real monitoring, real feed, real event files)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.custom_exporters import step_memory_item
from tests.e2e_helpers import PY, REPO, clean_env
from tests.traceml_ai.monitor.test_monitor import encoded, identity, step
from traceml_ai.analysis import StragglerView
from traceml_ai.analysis import in_process as summary_keys
from traceml_ai.monitor import Monitoring, RunInfo, tracker_sink
from traceml_ai.monitor import tracker_metrics as tm
from traceml_ai.monitor._state import LiveState
from traceml_ai.monitor.metrics import Health
from traceml_ai.monitor.trackers import BACKENDS, Backend, point_figures
from traceml_ai.settings import TRACKER_NAMES, MonitorSettings

FWD = "_traceml_internal:forward_time"
BWD = "_traceml_internal:backward_time"
BASE_NS = 10**18


def fill(state: LiveState, ranks: int, steps: int, ms: Any = None) -> None:
    """``steps`` steps of each rank, rank r taking ``10 + r`` ms (forward 4 + r ms)."""
    for r in range(ranks):
        items = [
            step(i, 10.0 + r, BASE_NS + i * 20_000_000, **{FWD: 4.0 + r, BWD: 2.0})
            for i in range(1, steps + 1)
        ]
        state.add_steps(identity(r, world=ranks), items)


def test_a_point_is_medians_maxima_and_the_ranks() -> None:
    state = LiveState()
    fill(state, ranks=3, steps=10)
    memory = {**step_memory_item(), "peak_allocated_bytes": 7e9, "peak_reserved_bytes": 9e9}
    state.add_memory(identity(2, world=3), [memory])
    figures = point_figures(state, 10, previous=5)
    assert figures[tm.STEP_TIME_MEDIAN.name] == 11.0
    assert figures[tm.STEP_TIME_MAX.name] == 12.0
    assert figures[tm.PHASE_MS.format(phase="forward")] == 5.0
    assert figures[tm.PHASE_MS.format(phase="backward")] == 2.0
    assert figures[tm.RANKS.name] == 3
    # Five steps in 100 ms of wall clock, each rank.
    assert figures[tm.THROUGHPUT_STEPS_PER_S.name] == pytest.approx(50.0)
    assert figures[tm.MEMORY_PEAK_ALLOCATED.name] == 7e9
    assert figures[tm.MEMORY_PEAK_RESERVED.name] == 9e9
    assert [figures[tm.RANK_STEP_TIME_MS.format(rank=r)] for r in range(3)] == [10.0, 11.0, 12.0]
    assert tm.STRAGGLER_EXCESS_MS.name not in figures  # no analysis yet
    assert point_figures(state, 11, previous=10) == {}  # no rank has step 11


def test_every_logged_name_is_in_the_table() -> None:
    state = LiveState()
    fill(state, ranks=2, steps=4)
    state.add_memory(identity(0), [step_memory_item()])
    state.set_straggler(_named(1, 3.0))
    templates = {m.name for m in tm.TRACKER_METRICS}
    for name in point_figures(state, 4, previous=2):
        generic = name
        for part, holder in (("phase_ms/", "<phase>"), ("rank/", "<rank>")):
            if part in name:
                head, _, tail = name.partition(part)
                rest = tail.split("/", 1)
                generic = head + part + holder + ("/" + rest[1] if len(rest) > 1 else "")
        assert generic in templates, name
    assert {m.name.split("/")[0] for m in tm.TRACKER_METRICS} == {"traceml"}


def _named(rank: int, excess_ms: float) -> StragglerView:
    data = {
        "definition": "d",
        "basis": "phase_times",
        "ranks": 2,
        "applicable": True,
        "verdict": "straggler",
        "stragglers": [
            {
                "rank": rank,
                "own_work_ms": 10.0 + excess_ms,
                "others_own_work_ms": 10.0,
                "excess_ms": excess_ms,
                "excess_pct": None,
                "phase": "forward",
                "phase_excess_ms": excess_ms,
                "phase_description": "forward",
                "slow_steps": 3,
                "slow_share": 1.0,
            }
        ],
    }
    return StragglerView.from_json({**StragglerView.from_json(_base()).to_json(), **data})


def _base() -> dict[str, Any]:
    return {
        "definition": "d",
        "basis": "phase_times",
        "ranks": 2,
        "applicable": False,
        "verdict": "n/a",
        "reason": "r",
    }


def test_per_rank_series_are_bounded_and_keep_the_straggler() -> None:
    state = LiveState()
    fill(state, ranks=40, steps=3)
    state.set_straggler(_named(37, 29.0))
    figures = point_figures(state, 3, previous=None)
    ranks = sorted(int(k.split("/")[2]) for k in figures if k.startswith("traceml/rank/"))
    assert len(ranks) == tm.TRACKER_MAX_RANKS
    assert 37 in ranks and ranks[:15] == list(range(15))
    assert figures[tm.STRAGGLER_EXCESS_MS.name] == 29.0
    assert figures[tm.STRAGGLER_RANK.name] == 37.0
    assert figures[tm.STEP_TIME_MAX.name] == 49.0


def test_backends_are_the_settings_names() -> None:
    assert tuple(BACKENDS) == TRACKER_NAMES


def test_the_docs_table_is_generated() -> None:
    result = subprocess.run(
        [PY, "-m", "traceml_ai.monitor.tracker_metrics", "--check"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert tm.tracker_metrics_markdown() in (REPO / "docs" / "trackers.md").read_text()


def _monitoring(run_dir: Path, every: int, lines: list[str]) -> Monitoring:
    settings = MonitorSettings(trackers=("tensorboard",), tracker_every_steps=every)
    run = RunInfo(run_dir=run_dir, run_name="r", host="h")
    monitoring = Monitoring(settings, run, Health, report=lines.append)
    monitoring.start_sinks({"tensorboard": tracker_sink("tensorboard")})
    monitoring.feed.start()
    return monitoring


def _feed_steps(monitoring: Monitoring, ranks: int, steps: int, *, pause_s: float = 0.0) -> None:
    for i in range(1, steps + 1):
        for r in range(ranks):
            item = step(i, 10.0 + r, BASE_NS + i * 20_000_000, **{FWD: 4.0})
            monitoring.submit(encoded("step_time", identity(r, world=ranks), [item]))
        if pause_s:
            time.sleep(pause_s)


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    reader = EventAccumulator(str(folder))
    reader.Reload()
    return {
        tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]
    }


def test_tensorboard_gets_a_point_every_n_steps_and_the_last(tmp_path: Path) -> None:
    lines: list[str] = []
    monitoring = _monitoring(tmp_path, every=5, lines=lines)
    _feed_steps(monitoring, ranks=2, steps=23, pause_s=0.005)
    loss = monitoring.close(5.0)
    assert loss.by_sink == {} and loss.not_started == {}
    assert lines == []
    read = scalars(tmp_path / "aggregator" / "tensorboard")
    assert read[tm.STEP_TIME_MEDIAN.name] == [(s, 10.5) for s in (5, 10, 15, 20, 23)]
    assert read[tm.STEP_TIME_MAX.name][-1] == (23, 11.0)
    assert read[tm.PHASE_MS.format(phase="forward")][0] == (5, 4.0)
    assert read[tm.RANK_STEP_TIME_MS.format(rank=1)][0] == (5, 11.0)


def test_a_rank_behind_holds_a_point_back_for_the_wait_only(tmp_path: Path) -> None:
    """Rank 1 stops at step 2 while rank 0 goes on to 12: the point at 5 waits for
    rank 1 (LAGGARD_WAIT_S), then is logged with rank 0 alone, while the run goes on."""
    lines: list[str] = []
    monitoring = _monitoring(tmp_path, every=5, lines=lines)
    monitoring.state.note_tracker_runs(identity(0, world=2), {})  # rank 0: no run of its own
    _feed_steps(monitoring, ranks=1, steps=2)
    late = [step(i, 30.0, BASE_NS + i * 20_000_000) for i in range(1, 3)]
    monitoring.submit(encoded("step_time", identity(1, world=2), late))
    for i in range(3, 13):  # rank 0 goes on to 12, rank 1 stays at 2
        item = step(i, 10.0, BASE_NS + i * 20_000_000)
        monitoring.submit(encoded("step_time", identity(0, world=2), [item]))
    started = time.monotonic()
    folder = tmp_path / "aggregator" / "tensorboard"
    sink = monitoring.sinks[0]
    while time.monotonic() < started + 15 and getattr(sink, "logged_points", 0) < 2:
        time.sleep(0.05)
    assert getattr(sink, "logged_points", 0) == 2  # steps 5 and 10, from rank 0 alone
    monitoring.close(5.0)
    read = scalars(folder)
    assert read[tm.RANKS.name][:2] == [(5, 1.0), (10, 1.0)]


def test_a_point_waits_for_a_rank_that_has_not_reported_yet(tmp_path: Path) -> None:
    """World 2, rank 1 not heard from yet (its first batch on its way): the point at 5
    is not logged with rank 0 alone at once; once rank 1's steps come, it has both."""
    lines: list[str] = []
    monitoring = _monitoring(tmp_path, every=5, lines=lines)
    monitoring.state.note_tracker_runs(identity(0, world=2), {})
    for i in range(1, 8):
        item = step(i, 10.0, BASE_NS + i * 20_000_000)
        monitoring.submit(encoded("step_time", identity(0, world=2), [item]))
    time.sleep(0.3)
    late = [step(i, 30.0, BASE_NS + i * 20_000_000) for i in range(1, 8)]
    monitoring.submit(encoded("step_time", identity(1, world=2), late))
    time.sleep(0.3)
    monitoring.close(5.0)
    read = scalars(tmp_path / "aggregator" / "tensorboard")
    assert read[tm.RANKS.name][0] == (5, 2.0)
    assert read[tm.STEP_TIME_MAX.name][0] == (5, 30.0)


def test_an_unwritable_folder_is_one_line_and_counted_points(tmp_path: Path) -> None:
    (tmp_path / "aggregator").write_text("a file where the folder goes")
    lines: list[str] = []
    monitoring = _monitoring(tmp_path, every=2, lines=lines)
    _feed_steps(monitoring, ranks=2, steps=9, pause_s=0.005)
    loss = monitoring.close(5.0)
    assert len(lines) == 1, lines
    assert lines[0].startswith("traceml: tensorboard: could not open a run (")
    assert lines[0].endswith("training and the files go on")
    # Points 2, 4, 6, 8 and the last one, 9.
    assert loss.by_sink == {"tensorboard": {"points_not_logged": 5}}


class _Refusing:
    """A tracker that takes its time and then refuses each point (as a tracker's
    server that answers with errors does)."""

    def __init__(self, delay_s: float, fail_close: bool = False) -> None:
        self.delay_s = delay_s
        self.fail_close = fail_close
        self.calls = 0

    def log(self, figures: Any, step: int) -> None:
        self.calls += 1
        time.sleep(self.delay_s)
        raise RuntimeError("HTTP 500\nInternal Server Error")

    def log_summary(self, fields: Any, summary_json: bytes) -> None:
        raise RuntimeError("HTTP 500")

    def close(self) -> None:
        time.sleep(self.delay_s)
        if self.fail_close:
            raise RuntimeError("HTTP 503")


def test_a_refusing_tracker_is_one_line_and_each_point_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusing = _Refusing(0.0, fail_close=True)
    backend = Backend("tensorboard", "tensorboard", (), object, lambda run, user: refusing)
    monkeypatch.setitem(BACKENDS, "tensorboard", backend)  # type: ignore[index]
    lines: list[str] = []
    monitoring = _monitoring(tmp_path, every=3, lines=lines)
    _feed_steps(monitoring, ranks=2, steps=9, pause_s=0.005)
    loss = monitoring.close(5.0)
    assert lines == [
        "traceml: tensorboard: a point was not logged (RuntimeError: HTTP 500 Internal "
        "Server Error); training and the files go on"
    ]
    # Its end failing too is counted, not said again: one line per tracker.
    assert loss.by_sink == {"tensorboard": {"points_failed": refusing.calls, "close_failed": 1}}
    assert refusing.calls == 3


def test_a_hung_tracker_costs_the_close_budget_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stuck = _Refusing(60.0)
    backend = Backend("tensorboard", "tensorboard", (), object, lambda run, user: stuck)
    monkeypatch.setitem(BACKENDS, "tensorboard", backend)  # type: ignore[index]
    lines: list[str] = []
    monitoring = _monitoring(tmp_path, every=1, lines=lines)
    started = time.monotonic()
    _feed_steps(monitoring, ranks=1, steps=50)  # the feed never waits for the tracker
    assert time.monotonic() - started < 2.0
    loss = monitoring.close(1.5)
    assert time.monotonic() - started < 5.0
    assert loss.by_sink["tensorboard"]["close_timed_out"] == 1
    # Every point it did not log is counted, the one it hangs on included.
    assert loss.by_sink["tensorboard"]["points_not_logged"] == 50
    assert len(lines) == 1, lines
    assert lines[0].startswith("traceml: tensorboard: still busy after ")
    assert lines[0].endswith("s; its last points are lost; training and the files go on")


def test_a_missing_library_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    code = f"""
import sys
sys.modules["tensorboard"] = None  # as if the extra were not installed
from pathlib import Path
from traceml_ai.monitor import Monitoring, RunInfo, tracker_sink
from traceml_ai.monitor.metrics import Health
from traceml_ai.settings import MonitorSettings
m = Monitoring(MonitorSettings(trackers=("tensorboard",)), RunInfo(run_dir=Path({str(tmp_path)!r}), run_name="r", host="h"), Health)
m.start_sinks({{"tensorboard": tracker_sink("tensorboard")}})
print(dict(m.close(2.0).not_started))
"""
    result = subprocess.run(
        [PY, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "traceml: tensorboard: needs the 'tensorboard' extra" in lines[0]
    assert "pip install 'traceml-ai[tensorboard]'" in lines[0]
    assert "'tensorboard': \"needs the 'tensorboard' extra" in result.stdout


@pytest.mark.slow
def test_a_tracker_server_that_never_answers_holds_nothing(tmp_path: Path) -> None:
    """MLflow pointed at a socket that accepts and never answers: the sink's thread
    waits, the feed and close do not."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    port = listener.getsockname()[1]
    code = f"""
import os, sys, time
os.environ["MLFLOW_TRACKING_URI"] = "http://127.0.0.1:{port}"
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from tests.traceml_ai.monitor.test_monitor import encoded, identity, step
from traceml_ai.monitor import Monitoring, RunInfo, tracker_sink
from traceml_ai.monitor.metrics import Health
from traceml_ai.settings import MonitorSettings
m = Monitoring(MonitorSettings(trackers=("mlflow",), tracker_every_steps=2), RunInfo(run_dir=Path({str(tmp_path)!r}), run_name="r", host="h"), Health)
m.start_sinks({{"mlflow": tracker_sink("mlflow")}})
m.feed.start()
t = time.monotonic()
for i in range(1, 11):
    m.submit(encoded("step_time", identity(0, world=1), [step(i, 10.0, 10**18 + i * 10**7)]))
fed = time.monotonic() - t
loss = m.close(2.0)
print(round(fed, 2), round(time.monotonic() - t, 2), dict(loss.by_sink))
"""
    try:
        result = subprocess.run(
            [PY, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120
        )
    finally:
        listener.close()
        for conn in held:
            conn.close()
    assert result.returncode == 0, result.stderr
    fed, total, by_sink = result.stdout.split(" ", 2)
    assert float(fed) < 1.0
    assert float(total) < 6.0
    assert "'close_timed_out': 1" in by_sink
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # nothing of MLflow's own
    assert lines[0].startswith("traceml: mlflow: still busy after "), result.stderr


def test_the_tracker_librarys_logging_stays_off_the_terminal(tmp_path: Path) -> None:
    """What the library logs (through its loggers, as MLflow's and TensorBoard's do)
    never reaches the aggregator's stderr, the training terminal."""
    code = f"""
import logging, sys
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from tests.traceml_ai.monitor.test_monitor import encoded, identity, step
from traceml_ai.monitor import Monitoring, RunInfo, tracker_sink
from traceml_ai.monitor.metrics import Health
from traceml_ai.monitor.trackers import BACKENDS, Backend
from traceml_ai.settings import MonitorSettings

class Noisy:
    def log(self, figures, step):
        logging.getLogger("tensorboard.summary").warning("library noise at %s", step)
    def close(self):
        logging.getLogger("tensorboard").error("library noise at close")

BACKENDS["tensorboard"] = Backend("tensorboard", "tensorboard", ("tensorboard",), BACKENDS["tensorboard"].load, lambda run, user: Noisy())
m = Monitoring(MonitorSettings(trackers=("tensorboard",), tracker_every_steps=1), RunInfo(run_dir=Path({str(tmp_path)!r}), run_name="r", host="h"), Health)
m.start_sinks({{"tensorboard": tracker_sink("tensorboard")}})
m.feed.start()
for i in range(1, 4):
    m.submit(encoded("step_time", identity(0, world=1), [step(i, 10.0, 10**18 + i * 10**7)]))
print(m.close(5.0), m.sinks[0].logged_points)
"""
    result = subprocess.run(
        [PY, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(" 3"), result.stdout  # every point logged
    assert "noise" not in result.stderr, result.stderr


@pytest.mark.slow
def test_mlflows_own_logging_stays_off_the_terminal(tmp_path: Path) -> None:
    """MLflow sets a stderr handler of its own when imported (and its sqlite store
    logs its migrations): after the sink opened a run, none of it reaches stderr."""
    code = f"""
import logging, os, sys
os.environ["MLFLOW_TRACKING_URI"] = "sqlite:///{tmp_path}/mlflow.db"
os.environ["MLFLOW_EXPERIMENT_NAME"] = "e"
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from tests.traceml_ai.monitor.test_monitor import encoded, identity, step
from traceml_ai.monitor import Monitoring, RunInfo, tracker_sink
from traceml_ai.monitor.metrics import Health
from traceml_ai.settings import MonitorSettings
m = Monitoring(MonitorSettings(trackers=("mlflow",), tracker_every_steps=2), RunInfo(run_dir=Path({str(tmp_path)!r}), run_name="quiet-run", host="h"), Health)
m.start_sinks({{"mlflow": tracker_sink("mlflow")}})
m.feed.start()
for i in range(1, 5):
    m.submit(encoded("step_time", identity(0, world=1), [step(i, 10.0, 10**18 + i * 10**7)]))
loss = m.close(30.0)
logging.getLogger("mlflow.tracking").warning("library noise after the run")
from mlflow.tracking import MlflowClient
client = MlflowClient()
(run,) = client.search_runs([client.get_experiment_by_name("e").experiment_id])
print(run.info.run_name, sorted(m.step for m in client.get_metric_history(run.info.run_id, "traceml/step_time_ms/median")), dict(loss.by_sink))
"""
    result = subprocess.run(
        [PY, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "quiet-run [2, 4] {}", result.stdout + result.stderr
    assert result.stderr == "", result.stderr


class _Recording:
    """A tracker run that keeps what it was given."""

    def __init__(self, user: Any) -> None:
        self.user = user
        self.points: list[int] = []
        self.summary: Any = None
        self.closed = False

    def log(self, figures: Any, step: int) -> None:
        self.points.append(step)

    def log_summary(self, fields: Any, summary_json: bytes) -> None:
        self.summary = (dict(fields), summary_json)

    def close(self) -> None:
        self.closed = True


def _recording_backend(opened: list[_Recording], refuse: Any = None) -> Backend:
    def open_run(run: Any, user: Any) -> _Recording:
        if user is not None and user == refuse:
            raise ConnectionError("the script's server is out of reach")
        opened.append(_Recording(user))
        return opened[-1]

    return Backend("tensorboard", "tensorboard", (), object, open_run)


def test_points_wait_for_rank_0_and_go_into_the_scripts_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 tells its script's run after the first point is due: the point waited,
    and the script's run has every point; a run told later takes the points from
    then on, and the one before is closed."""
    opened: list[_Recording] = []
    monkeypatch.setitem(BACKENDS, "tensorboard", _recording_backend(opened))  # type: ignore[index]
    lines: list[str] = []
    monitoring = _monitoring(tmp_path, every=2, lines=lines)
    _feed_steps(monitoring, ranks=2, steps=4)
    time.sleep(1.5)  # the points at 2 and 4 are due: they wait for rank 0's word
    assert opened == []
    first = {"log_dir": "/runs/a"}
    monitoring.state.note_tracker_runs(identity(0), {"tensorboard": first})
    _feed_steps(monitoring, ranks=2, steps=6)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (opened and opened[0].points == [2, 4, 6]):
        time.sleep(0.05)
    assert [r.user for r in opened] == [first] and opened[0].points == [2, 4, 6]
    second = {"log_dir": "/runs/b"}
    monitoring.state.note_tracker_runs(identity(0), {"tensorboard": second})
    monitoring.state.note_tracker_runs(identity(1), {"tensorboard": {"log_dir": "/rank1"}})
    for i in range(7, 9):
        for r in range(2):
            item = step(i, 10.0, BASE_NS + i * 20_000_000)
            monitoring.submit(encoded("step_time", identity(r), [item]))
    loss = monitoring.close(5.0)
    assert loss.by_sink == {} and lines == []
    assert [r.user for r in opened] == [first, second]  # rank 0's run, never rank 1's
    assert opened[0].closed and opened[0].summary is None
    assert opened[1].points == [8] and opened[1].closed


def test_a_scripts_run_out_of_reach_is_one_line_and_the_points_go_to_traceml_s_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    told = {"log_dir": "/elsewhere"}
    opened: list[_Recording] = []
    monkeypatch.setitem(BACKENDS, "tensorboard", _recording_backend(opened, refuse=told))  # type: ignore[index]
    lines: list[str] = []
    monitoring = _monitoring(tmp_path, every=2, lines=lines)
    monitoring.state.note_tracker_runs(identity(0), {"tensorboard": told})
    _feed_steps(monitoring, ranks=2, steps=5)
    loss = monitoring.close(5.0)
    assert loss.by_sink == {}
    assert lines == [
        "traceml: tensorboard: could not log into the run the training script has open "
        "(ConnectionError: the script's server is out of reach); its figures go to a run "
        "of TraceML's own; training and the files go on"
    ]
    assert [r.user for r in opened] == [None]
    assert opened[0].points == [2, 4, 5]


def test_without_rank_0_s_word_the_points_wait_5_s_at_most(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[_Recording] = []
    monkeypatch.setitem(BACKENDS, "tensorboard", _recording_backend(opened))  # type: ignore[index]
    monitoring = _monitoring(tmp_path, every=2, lines=[])
    _feed_steps(monitoring, ranks=1, steps=2)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not opened:
        time.sleep(0.05)
    assert [r.user for r in opened] == [None] and opened[0].points == [2]
    monitoring.close(5.0)


def test_each_run_gets_the_summary_of_the_closed_files(tmp_path: Path) -> None:
    """The real TensorBoard tracker at the end of a run whose export files exist: the
    summary's figures as a text entry and the summary JSON beside the event files,
    the same JSON `traceml summary --json` prints."""
    from bench.bigfile import write_step_time
    from traceml_ai.analysis import summarize_run

    export = tmp_path / "aggregator" / "export"
    export.mkdir(parents=True)
    write_step_time(export / "step_time.jsonl", 24, world=2, ranks_per_node=2)
    lines: list[str] = []
    monitoring = _monitoring(tmp_path, every=5, lines=lines)
    _feed_steps(monitoring, ranks=2, steps=12)
    loss = monitoring.close(5.0)
    assert loss.by_sink == {} and lines == []
    folder = tmp_path / "aggregator" / "tensorboard"
    written = (folder / tm.SUMMARY_ARTIFACT).read_bytes()
    assert orjson.loads(written) == summarize_run(tmp_path).to_json()
    reader = EventAccumulator(str(folder))
    reader.Reload()
    (text,) = reader.Tensors("traceml/summary")
    table = text.tensor_proto.string_val[0].decode()
    assert f"| {tm.RANKS.name} | 2 |" in table
    assert f"| {summary_keys.SUMMARY_STEPS.name} | 12 |" in table
    assert f"| {summary_keys.SUMMARY_FILES.name} | complete |" in table


def test_with_trackers_only_the_straggler_view_is_made_when_a_point_needs_it(
    tmp_path: Path,
) -> None:
    """No periodic analysis that nothing reads: the feed makes none, the point asks
    for one (and gets the straggler); with another live view the feed makes them."""
    monitoring = _monitoring(tmp_path, every=40, lines=[])
    assert monitoring.feed.straggler_on_demand is True
    for i in range(1, 41):
        for r in range(2):
            # As under DDP: rank 1 is 25 ms slower in forward, rank 0 waits in backward.
            forward, backward = (30.0, 2.0) if r == 1 else (5.0, 27.0)
            item = step(i, 55.0, BASE_NS + i * 60_000_000, **{FWD: forward, BWD: backward})
            monitoring.submit(encoded("step_time", identity(r), [item]))
    time.sleep(1.0)
    assert monitoring.state.straggler is None or monitoring.state.straggler.ranks == 2
    monitoring.state.note_tracker_runs(identity(0), {})
    monitoring.close(5.0)
    read = scalars(tmp_path / "aggregator" / "tensorboard")
    assert read[tm.STRAGGLER_RANK.name] == [(40, 1.0)]
    assert read[tm.STRAGGLER_EXCESS_MS.name][0][1] == pytest.approx(25.0, abs=1.0)

    other = Monitoring(
        MonitorSettings(trackers=("tensorboard",), tracker_every_steps=5),
        RunInfo(run_dir=tmp_path / "other", run_name="r", host="h"),
        Health,
        report=[].append,
    )
    other.start_sinks({"tensorboard": tracker_sink("tensorboard"), "view": _View})
    assert other.feed.straggler_on_demand is False
    other.close(1.0)


class _View:
    """A live view that reads the state's straggler view whenever it likes."""

    def __init__(self, monitoring: Any) -> None:
        pass

    def on_steps(self, steps: Any) -> None:
        pass

    def close(self, timeout_s: float) -> dict[str, int]:
        return {}


def test_an_event_file_that_cannot_be_written_is_one_line_and_counted_points(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A full disk under the real TensorBoard tracker: written from the sink's thread,
    so each refused point is counted and said once, never a thread's traceback."""
    from traceml_ai.monitor._tracker_tensorboard import TensorBoardTracker

    class FullDisk:
        closed = False

        def write(self, data: bytes) -> None:
            raise OSError(28, "No space left on device")

        def flush(self) -> None:
            pass

        def close(self) -> None:
            pass

    opened: list[TensorBoardTracker] = []

    def open_run(run: Any, user: Any) -> TensorBoardTracker:
        tracker = TensorBoardTracker(tmp_path / "tb")
        tracker._writer._writer = FullDisk()  # the disk fills up after the file's start
        opened.append(tracker)
        return tracker

    lines: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(
            BACKENDS, "tensorboard", Backend("tensorboard", "tensorboard", (), object, open_run)
        )  # type: ignore[index]
        monitoring = _monitoring(tmp_path, every=2, lines=lines)
        monitoring.state.note_tracker_runs(identity(0), {})
        _feed_steps(monitoring, ranks=2, steps=6, pause_s=0.01)
        loss = monitoring.close(5.0)
    assert loss.by_sink == {"tensorboard": {"points_failed": 3}}
    assert lines == [
        "traceml: tensorboard: a point was not logged (OSError: [Errno 28] No space left on "
        "device); training and the files go on"
    ]
    assert "Traceback" not in capfd.readouterr().err


def test_the_table_check_outside_the_repository_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert tm.main(["--check", "--root", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"tracker metrics: cannot read {tmp_path / 'docs' / 'trackers.md'} (")
    assert tm.main(["--check", "--root", str(REPO)]) == 0


def test_a_log_dir_not_on_this_machine_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """Rank 0's log dir of a multi-node run may be another machine's path: refused (the
    sink then says one line and uses TraceML's own folder), nothing created."""
    from traceml_ai.monitor._tracker_tensorboard import open_tensorboard

    run = RunInfo(run_dir=tmp_path / "run", run_name="r", host="h")
    elsewhere = tmp_path / "not" / "here"
    with pytest.raises(FileNotFoundError, match="is not a folder on this machine"):
        open_tensorboard(run, {"log_dir": str(elsewhere)})
    with pytest.raises(FileNotFoundError):
        open_tensorboard(run, {"log_dir": "relative/tb"})
    assert not elsewhere.exists() and not (tmp_path / "run").exists()
    joined = open_tensorboard(run, {"log_dir": str(tmp_path)})
    joined.close()
    assert joined.path.parent == tmp_path and joined.path.name.endswith(".traceml")


def test_traceml_summary_and_the_trackers_name_the_summary_figures_alike(tmp_path: Path) -> None:
    """One key set: ``traceml.summary()``'s flat dict of a run's files and the fields
    each tracker run gets at the end hold the same figures under the same names, every
    name one of ``SUMMARY_FIELDS`` (0.5.0's step keys among them)."""
    from bench.bigfile import write_step_time
    from traceml_ai.analysis import summarize_run

    export = tmp_path / "aggregator" / "export"
    export.mkdir(parents=True)
    write_step_time(export / "step_time.jsonl", 24, world=2, ranks_per_node=2)
    summary = summarize_run(tmp_path)
    fields = summary_keys.summary_fields(summary)
    flat = summary_keys.compact(
        {"source": "export", "complete": True, "file": "x", **summary.to_json()}
    )
    assert flat is not None
    assert flat == {**fields, "traceml/complete": True}
    phase = summary_keys.SUMMARY_PHASE_MS.name.split("<")[0]
    names = {f.name for f in summary_keys.SUMMARY_FIELDS}
    assert all(k in names or k.startswith(phase) for k in flat), set(flat) - names
    for key in ("step_time_ms", "forward_ms", "backward_ms", "optimizer_ms"):
        assert isinstance(flat[f"traceml/step_time/{key}"], float), key  # 0.5.0's keys
    assert flat[tm.RANKS.name] == 2 and flat[summary_keys.SUMMARY_STEPS.name] == 12
    assert not any(k.startswith("traceml/summary/step_time") for k in flat)
    # In process (export off): the step figures only, by the same names.
    own = summary_keys.build_summary({0: {1: {}, 2: {}}}, source="in_process", complete=False)
    assert set(summary_keys.compact(own) or {}) <= names | {"traceml/source"}
