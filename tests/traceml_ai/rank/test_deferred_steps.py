"""Steps off CUDA whose items are built off the training thread (``StepTimer.defer``).

Under ``traceml.init`` with its own sender, a step on CPU leaves only its numbers on
the training thread; the sender's thread builds its step_time and step_memory items
before each flush. Nothing may be lost or reordered by that: every step has both
items, ``seq`` counts up with ``step``, and what ended before shutdown, a CUDA step,
a timer failure or a builder that does not keep up is still sent, in order.
"""

from __future__ import annotations

import subprocess
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_helpers import data_lines, export_dir, run_cli, warning_file
from tests.rank_helpers import TensorlessModel, timer_steps
from tests.traceml_ai.rank.conftest import once
from traceml_ai.rank._timing import event_names, step_timer
from traceml_ai.rank.sink import RecordingSink
from traceml_ai.testing import FakeCuda

# The timer's tests run three times: steps built as dicts for the sink's put; steps
# encoded in C for its put_encoded_many (the runtime's path to its sender); and that
# path without the C encoder (``TRACEML_PURE_PYTHON``), which builds dicts again.
_ENCODED = False


@pytest.fixture(params=["dicts", "encoded-c", "encoded-python"])
def step_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.param != "dicts":
        monkeypatch.setitem(globals(), "_ENCODED", True)
    if request.param == "encoded-python":
        monkeypatch.setattr(step_timer, "_encode_host_step", None)


def _timer(sink: RecordingSink, cuda: Any = None) -> step_timer.StepTimer:
    backend = cuda if cuda is not None else FakeCuda(available=False)
    timer = step_timer.StepTimer(sink, backend, lambda model: None, lambda exc: None)
    timer.defer = True
    if _ENCODED:
        timer.encoded_sink = sink
    return timer


def _check_in_order(sink: RecordingSink, steps: list[int]) -> None:
    for stream in ("step_time", "step_memory"):
        items = sink.items(stream)
        assert [item["step"] for item in items] == steps, stream
        assert [item["seq"] for item in items] == list(range(len(steps))), stream


@pytest.mark.usefixtures("step_path")
def test_items_wait_for_the_builder_then_come_in_order() -> None:
    sink = RecordingSink()
    timer = _timer(sink)
    model = TensorlessModel()
    timer_steps(timer, 5, model)
    assert sink.items() == []  # nothing built on the training thread
    timer.build_ended()
    _check_in_order(sink, [1, 2, 3, 4, 5])
    line = sink.items("step_time")[0]
    assert line["events"][event_names.DATALOADER_NEXT]["cpu"]["n_calls"] == 1
    assert sink.items("step_memory")[0]["peak_allocated_bytes"] is None
    # The phase dicts go back, zeroed, once built, and are reused with their phases.
    spares = list(timer._spare_acc)
    assert len(spares) == 5
    assert all(p.n_calls == 0 and p.cpu_ns == 0 for acc in spares for p in acc.values())
    timer_steps(timer, 1, model)
    assert len(timer._spare_acc) == 4  # the step's end took one for the next step
    reused = timer._acc
    assert any(reused is acc for acc in spares)
    phase = reused[event_names.DATALOADER_NEXT]
    timer_steps(timer, 1, model)  # this step's calls go into the reused phases
    timer.poll()  # the sampler thread's call builds too
    _check_in_order(sink, [1, 2, 3, 4, 5, 6, 7])
    assert phase.n_calls == 0  # zeroed again once built
    assert sink.items("step_time")[6]["events"][event_names.DATALOADER_NEXT]["cpu"]["n_calls"] == 1


@pytest.mark.usefixtures("step_path")
def test_a_reused_phase_the_step_did_not_call_is_left_out() -> None:
    """Phase dicts are reused with their phases zeroed: a phase of an earlier step
    that this step never called is not in its item (nor counted as a call)."""
    sink = RecordingSink()
    timer = _timer(sink)
    model = TensorlessModel()
    timer.begin(model)
    timer.add_host("wait_for_weights", 5_000_000)
    timer.end()
    timer.build_ended()
    for _ in range(3):
        timer.begin(model)
        timer.end()
    timer.build_ended()
    events = [item["events"] for item in sink.items("step_time")]
    assert "wait_for_weights" in events[0]
    assert all(set(e) == {event_names.STEP_TIME} for e in events[1:])
    assert all(e[event_names.STEP_TIME]["cpu"]["n_calls"] == 1 for e in events)


@pytest.mark.usefixtures("step_path")
def test_drain_builds_what_ended() -> None:
    sink = RecordingSink()
    timer = _timer(sink)
    timer_steps(timer, 3, TensorlessModel())
    timer.drain(sync=True)
    _check_in_order(sink, [1, 2, 3])


@pytest.mark.usefixtures("step_path")
def test_the_builder_is_woken_once_at_the_threshold() -> None:
    sink = RecordingSink()
    timer = _timer(sink)
    wakes: list[int] = []
    timer.wake_builder = lambda: wakes.append(len(timer._ended))
    timer_steps(timer, step_timer.ENDED_WAKE_AT + 3, TensorlessModel())
    assert wakes == [step_timer.ENDED_WAKE_AT]


@pytest.mark.usefixtures("step_path")
def test_a_builder_that_does_not_keep_up_leaves_the_building_to_the_training_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(step_timer, "MAX_ENDED_STEPS", 4)
    sink = RecordingSink()
    timer = _timer(sink)
    timer_steps(timer, 4, TensorlessModel())
    assert sink.items() == []
    timer_steps(
        timer, 2, TensorlessModel()
    )  # the 5th step builds the 4 waiting ones first, then itself
    _check_in_order(sink, [1, 2, 3, 4, 5])
    timer.build_ended()  # the 6th waits for the builder again
    _check_in_order(sink, [1, 2, 3, 4, 5, 6])


@pytest.mark.usefixtures("step_path")
def test_cpu_steps_are_sent_before_a_later_cuda_step() -> None:
    sink = RecordingSink()
    cuda = FakeCuda(auto_complete=True, total_memory=333, model_device=None)
    timer = _timer(sink, cuda)
    model = TensorlessModel()
    timer_steps(timer, 3, model)
    assert sink.items() == []
    cuda.model_device = 0  # the model moved to the GPU
    timer._model_ref = None  # seen again at the next step
    timer_steps(timer, 2, model)
    timer.drain(sync=True)
    _check_in_order(sink, [1, 2, 3, 4, 5])
    devices = [item["device"] for item in sink.items("step_memory")]
    assert devices == ["cpu", "cpu", "cpu", "cuda:0", "cuda:0"]


@pytest.mark.usefixtures("step_path")
def test_a_cuda_step_in_a_reused_phase_dict_has_its_gpu_time() -> None:
    """A phase reused from a CPU step (host-only then) measures GPU time again."""
    sink = RecordingSink()
    cuda = FakeCuda(auto_complete=True, total_memory=333, model_device=None)
    timer = _timer(sink, cuda)
    model = TensorlessModel()

    def step() -> None:
        timer.begin(model)
        timer.open(timer.opt)
        timer.close(timer.opt, event_names.OPTIMIZER_STEP)
        timer.end()

    for _ in range(3):
        step()
    timer.build_ended()
    step()  # its end takes a reused dict for the next step
    assert timer._spare_acc and event_names.OPTIMIZER_STEP in timer._acc  # reused
    cuda.model_device = 0
    timer._model_ref = None
    step()
    timer.drain(sync=True)
    cpu_line, cuda_line = sink.items("step_time")[3:]
    assert cpu_line["events"][event_names.OPTIMIZER_STEP]["cpu"]["gpu_ms"] is None
    optimizer = cuda_line["events"][event_names.OPTIMIZER_STEP]["cuda:0"]
    assert optimizer["is_gpu"] and optimizer["gpu_ms"] is not None and optimizer["n_calls"] == 1


@pytest.mark.usefixtures("step_path")
def test_a_thread_building_while_steps_end_loses_and_reorders_nothing() -> None:
    sink = RecordingSink()
    timer = _timer(sink)
    stop = threading.Event()

    def builder() -> None:
        while not stop.is_set():
            timer.build_ended()

    thread = threading.Thread(target=builder)
    thread.start()
    try:
        timer_steps(timer, 20_000, TensorlessModel())
    finally:
        stop.set()
        thread.join()
    timer.build_ended()
    _check_in_order(sink, list(range(1, 20_001)))


_FAIL_SCRIPT = textwrap.dedent(
    """
    import traceml_ai as traceml
    from traceml_ai.rank._patches import phase_hooks
    from traceml_ai.rank._timing import event_names, step_timer

    traceml.init()
    timer = phase_hooks.active()
    assert timer is not None and timer.defer, "steps off CUDA are built by the sender"
    for _ in range(300):
        with traceml.trace_step():
            pass
    waiting = len(timer._ended)
    # An internal failure with steps still waiting for the builder: they are sent.
    timer.fail(RuntimeError("injected"))
    print(f"WAITING {waiting}", flush=True)
    """
)


_BUILDER_BUG_SCRIPT = textwrap.dedent(
    """
    import time
    import traceml_ai as traceml
    from traceml_ai.rank._patches import phase_hooks
    from traceml_ai.rank._timing import event_names, step_timer

    traceml.init()
    timer = phase_hooks.active()

    def broken(*args):
        raise RuntimeError("builder bug")

    timer._build_ended = broken  # the sender's thread builds with this
    for _ in range(50):
        with traceml.trace_step():
            pass
    time.sleep(1.0)  # a few flushes
    print("TRAINED", flush=True)
    """
)


CliRuns = dict[str, tuple[Path, subprocess.CompletedProcess[str]]]
"""A run's name -> its logs folder and ``traceml run``'s result."""


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> CliRuns:
    """The module's two ``traceml run``s, started together: each is mostly its
    processes' start, and neither is read for its timings."""

    def run(name: str, source: str, *options: str) -> tuple[Path, Any]:
        folder = tmp_path_factory.mktemp(name)
        script = folder / f"{name}.py"
        script.write_text(source)
        logs = folder / "logs"
        args = ["run", "--logs-dir", logs, "--run-name", name, "--exporter", "jsonl", *options]
        return logs, run_cli([*args, script], cwd=folder, timeout=120)

    with ThreadPoolExecutor(max_workers=2) as pool:
        fail = pool.submit(run, "fail", _FAIL_SCRIPT, "--export-streams", "all")
        bug = pool.submit(run, "bug", _BUILDER_BUG_SCRIPT)
        return {"fail": fail.result(), "bug": bug.result()}


@once  # the steps are timed in the child
def test_steps_waiting_for_the_builder_reach_the_files_after_a_timer_failure(
    cli_runs: CliRuns,
) -> None:
    logs, res = cli_runs["fail"]
    assert res.returncode == 0, res.stdout + res.stderr
    waiting = int(res.stdout.split("WAITING ")[1].split()[0])
    assert waiting > 0, res.stdout  # the sender had not built them yet
    assert warning_file(logs, "fail") is None
    folder = export_dir(logs, "fail")
    for stream in ("step_time", "step_memory"):
        lines = data_lines(folder / f"{stream}.jsonl")
        assert [d["step"] for d in lines] == list(range(1, 301)), stream
        assert [d["seq"] for d in lines] == list(range(300)), stream


@once  # the steps are timed in the child
def test_a_failure_while_building_on_the_sender_thread_is_reported_once(
    cli_runs: CliRuns,
) -> None:
    _, res = cli_runs["bug"]
    assert res.returncode == 0, res.stdout + res.stderr
    assert "TRAINED" in res.stdout
    failures = [line for line in res.stderr.splitlines() if "step timing failed" in line]
    assert len(failures) == 1 and "builder bug" in failures[0], res.stderr
    assert "Traceback" not in res.stderr, res.stderr
