"""Steps off CUDA whose items are built off the training thread (``StepTimer.defer``).

Under ``traceml.init`` with its own sender, a step on CPU leaves only its numbers on
the training thread; the sender's thread builds its step_time and step_memory items
before each flush. Nothing may be lost or reordered by that: every step has both
items, ``seq`` counts up with ``step``, and what ended before shutdown, a CUDA step,
a timer failure or a builder that does not keep up is still sent, in order.
"""

from __future__ import annotations

import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_helpers import data_lines, export_dir, run_cli, warning_file
from traceml_ai.rank import _timing
from traceml_ai.rank.sink import RecordingSink
from traceml_ai.testing import FakeCuda


class _Model:
    """No tensors: the step is on ``cpu`` (or on the FakeCuda's model device)."""

    def parameters(self) -> Any:
        return iter(())

    def buffers(self) -> Any:
        return iter(())


def _timer(sink: RecordingSink, cuda: Any = None) -> _timing.StepTimer:
    backend = cuda if cuda is not None else FakeCuda(available=False)
    timer = _timing.StepTimer(sink, backend, lambda model: None, lambda exc: None)
    timer.defer = True
    return timer


def _steps(timer: _timing.StepTimer, n: int, model: object) -> None:
    for _ in range(n):
        timer.add_host(_timing.DATALOADER_NEXT, 1000)
        timer.begin(model)
        timer.end()


def _check_in_order(sink: RecordingSink, steps: list[int]) -> None:
    for stream in ("step_time", "step_memory"):
        items = sink.items(stream)
        assert [item["step"] for item in items] == steps, stream
        assert [item["seq"] for item in items] == list(range(len(steps))), stream


def test_items_wait_for_the_builder_then_come_in_order() -> None:
    sink = RecordingSink()
    timer = _timer(sink)
    model = _Model()
    _steps(timer, 5, model)
    assert sink.items() == []  # nothing built on the training thread
    timer.build_ended()
    _check_in_order(sink, [1, 2, 3, 4, 5])
    line = sink.items("step_time")[0]
    assert line["events"][_timing.DATALOADER_NEXT]["cpu"]["n_calls"] == 1
    assert sink.items("step_memory")[0]["peak_allocated_bytes"] is None
    # Phases go back to the spares once built, and are reused.
    spares = len(timer._spare)
    assert spares >= 2
    _steps(timer, 1, model)
    assert len(timer._spare) < spares
    timer.poll()  # the sampler thread's call builds too
    _check_in_order(sink, [1, 2, 3, 4, 5, 6])


def test_drain_builds_what_ended() -> None:
    sink = RecordingSink()
    timer = _timer(sink)
    _steps(timer, 3, _Model())
    timer.drain(sync=True)
    _check_in_order(sink, [1, 2, 3])


def test_the_builder_is_woken_once_at_the_threshold() -> None:
    sink = RecordingSink()
    timer = _timer(sink)
    wakes: list[int] = []
    timer.wake_builder = lambda: wakes.append(len(timer._ended))
    _steps(timer, _timing.ENDED_WAKE_AT + 3, _Model())
    assert wakes == [_timing.ENDED_WAKE_AT]


def test_a_builder_that_does_not_keep_up_leaves_the_building_to_the_training_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_timing, "MAX_ENDED_STEPS", 4)
    sink = RecordingSink()
    timer = _timer(sink)
    _steps(timer, 4, _Model())
    assert sink.items() == []
    _steps(timer, 2, _Model())  # the 5th step builds the 4 waiting ones first, then itself
    _check_in_order(sink, [1, 2, 3, 4, 5])
    timer.build_ended()  # the 6th waits for the builder again
    _check_in_order(sink, [1, 2, 3, 4, 5, 6])


def test_cpu_steps_are_sent_before_a_later_cuda_step() -> None:
    sink = RecordingSink()
    cuda = FakeCuda(auto_complete=True, total_memory=333, model_device=None)
    timer = _timer(sink, cuda)
    model = _Model()
    _steps(timer, 3, model)
    assert sink.items() == []
    cuda.model_device = 0  # the model moved to the GPU
    timer._model_ref = None  # seen again at the next step
    _steps(timer, 2, model)
    timer.drain(sync=True)
    _check_in_order(sink, [1, 2, 3, 4, 5])
    devices = [item["device"] for item in sink.items("step_memory")]
    assert devices == ["cpu", "cpu", "cpu", "cuda:0", "cuda:0"]


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
        _steps(timer, 20_000, _Model())
    finally:
        stop.set()
        thread.join()
    timer.build_ended()
    _check_in_order(sink, list(range(1, 20_001)))


_FAIL_SCRIPT = textwrap.dedent(
    """
    import traceml_ai as traceml
    from traceml_ai.rank import _timing

    traceml.init()
    timer = _timing.active()
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


def test_steps_waiting_for_the_builder_reach_the_files_after_a_timer_failure(
    tmp_path: Path,
) -> None:
    script = tmp_path / "fail.py"
    script.write_text(_FAIL_SCRIPT)
    logs = tmp_path / "logs"
    options = ["--logs-dir", logs, "--run-name", "fail", "--exporter", "jsonl"]
    res = run_cli(["run", *options, "--export-streams", "all", script], cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    waiting = int(res.stdout.split("WAITING ")[1].split()[0])
    assert waiting > 0, res.stdout  # the sender had not built them yet
    assert warning_file(logs, "fail") is None
    folder = export_dir(logs, "fail")
    for stream in ("step_time", "step_memory"):
        lines = data_lines(folder / f"{stream}.jsonl")
        assert [d["step"] for d in lines] == list(range(1, 301)), stream
        assert [d["seq"] for d in lines] == list(range(300)), stream


_BUILDER_BUG_SCRIPT = textwrap.dedent(
    """
    import time
    import traceml_ai as traceml
    from traceml_ai.rank import _timing

    traceml.init()
    timer = _timing.active()

    def broken(*args):
        raise RuntimeError("builder bug")

    timer._send_host = broken  # the sender's thread builds with this
    for _ in range(50):
        with traceml.trace_step():
            pass
    time.sleep(1.0)  # a few flushes
    print("TRAINED", flush=True)
    """
)


def test_a_failure_while_building_on_the_sender_thread_is_reported_once(tmp_path: Path) -> None:
    script = tmp_path / "bug.py"
    script.write_text(_BUILDER_BUG_SCRIPT)
    options = ["--logs-dir", tmp_path / "logs", "--run-name", "bug", "--exporter", "jsonl"]
    res = run_cli(["run", *options, script], cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "TRAINED" in res.stdout
    failures = [line for line in res.stderr.splitlines() if "step timing failed" in line]
    assert len(failures) == 1 and "builder bug" in failures[0], res.stderr
    assert "Traceback" not in res.stderr, res.stderr
