"""traceml_ai.testing: the fakes behave like the real APIs where TraceML depends on
them, the capture sees what a real export writes, reset gives a fresh TraceML, and the
item factory makes what the builder, the reader and the validator all accept."""

from __future__ import annotations

import inspect
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

import traceml_ai as traceml
from tests.e2e_helpers import REPO
from traceml_ai.export import RecordBuilder, start_export
from traceml_ai.rank.gpu import CudaBackend, NvmlBackend, PynvmlBackend, TorchCudaBackend
from traceml_ai.rank.identity import RankIdentity
from traceml_ai.rank.samplers import SystemSampler
from traceml_ai.settings import ExportSettings
from traceml_ai.testing import (
    BASE_TIMESTAMP_NS,
    ExportCapture,
    FakeCuda,
    FakeCudaMisuse,
    FakeNvml,
    InMemoryExporter,
    make_batch,
    make_gpu_reading,
    make_identity,
    make_item,
    make_record,
    make_records,
    reset,
)
from traceml_ai.transport.wire import BATCH_STREAMS
from traceml_records import STREAMS_BY_NAME, dumps_line, loads_line, validate_line

ENV_VARS = ("TRACEML_AGGREGATOR_ADDR", "TRACEML_RUN_TOKEN", "RANK", "LOCAL_RANK", "WORLD_SIZE")


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    reset()
    yield
    reset()


def _protocol_methods(protocol: type[Any]) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(protocol).items()
        if callable(fn) and not name.startswith("_")
    }


@pytest.mark.parametrize(
    ("protocol", "real", "fake"),
    [(CudaBackend, TorchCudaBackend, FakeCuda), (NvmlBackend, PynvmlBackend, FakeNvml)],
)
def test_fakes_have_every_method_of_the_protocol_with_its_parameters(
    protocol: type[Any], real: type[Any], fake: type[Any]
) -> None:
    methods = _protocol_methods(protocol)
    assert methods, protocol
    for name, signature in methods.items():
        for cls in (real, fake):
            own = inspect.signature(getattr(cls, name))
            assert list(own.parameters) == list(signature.parameters), (cls, name)


# -- FakeCuda -----------------------------------------------------------------------------


def test_current_device_is_per_thread_as_in_torch() -> None:
    cuda = FakeCuda(devices=2)
    cuda.set_device(1)
    seen: list[int | None] = []
    thread = threading.Thread(target=lambda: seen.append(cuda.current_device()))
    thread.start()
    thread.join()
    assert cuda.current_device() == 1 and seen == [0]
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        cuda.set_device(2)


def test_elapsed_time_raises_until_both_events_completed() -> None:
    cuda = FakeCuda()
    start, end = cuda.record_event(0), cuda.record_event(0)
    assert start is not None and end is not None
    assert not start.query() and not end.query()
    with pytest.raises(RuntimeError, match="not ready"):
        start.elapsed_time(end)
    cuda.complete(start.stamp)  # the GPU got past the first event only
    assert start.query() and not end.query()
    with pytest.raises(RuntimeError, match="not ready"):
        start.elapsed_time(end)
    cuda.ms_per_tick = 2.5
    cuda.finish_all()
    assert start.elapsed_time(end) == 2.5
    with pytest.raises(ValueError, match="cannot go back"):
        cuda.completed = 0
    assert cuda.synchronize_calls == 0 and cuda.misuse == []


def test_auto_complete_is_a_gpu_that_keeps_up() -> None:
    cuda = FakeCuda(auto_complete=True)
    start, end = cuda.record_event(0), cuda.record_event(0)
    assert start is not None and end is not None and start.elapsed_time(end) == 1.0


def test_synchronize_waits_for_the_gpu_and_reports_a_hang() -> None:
    cuda = FakeCuda()
    event = cuda.record_event(0)
    assert event is not None
    threading.Timer(0.1, cuda.finish_all).start()
    t0 = time.monotonic()
    event.synchronize()
    assert 0.05 < time.monotonic() - t0 < 5
    hung = cuda.record_event(0)
    assert hung is not None
    cuda.synchronize_timeout_s = 0.05
    with pytest.raises(FakeCudaMisuse, match="synchronize"):
        hung.synchronize()
    assert cuda.synchronize_calls == 2 and len(cuda.misuse) == 1


def test_release_events_takes_back_completed_events_only() -> None:
    cuda = FakeCuda(devices=2)
    first, second = cuda.record_event(0), cuda.record_event(0)
    assert first is not None and second is not None
    with pytest.raises(FakeCudaMisuse, match="not completed"):
        cuda.release_events(0, [first])
    cuda.finish_all()
    with pytest.raises(FakeCudaMisuse, match="device 0"):
        cuda.release_events(1, [first])
    cuda.release_events(0, [first, second])
    with pytest.raises(FakeCudaMisuse, match="given back already"):
        cuda.release_events(0, [first])
    with pytest.raises(FakeCudaMisuse, match="given back"):
        first.query()
    # Given-back events are recorded again, with a new stamp.
    again = cuda.record_event(0)
    assert again is second and again.stamp == 3 and not again.query()
    assert cuda.created == 2 and cuda.released == 2
    assert len(cuda.misuse) == 4


def test_peaks_are_per_device_since_the_last_reset() -> None:
    cuda = FakeCuda(devices=2)
    cuda.allocate(0, 1000)
    cuda.allocate(0, -600)
    cuda.allocate(1, 50)
    assert (cuda.max_memory_allocated(0), cuda.memory_allocated(0)) == (1000, 400)
    cuda.reset_peak_memory_stats(0)
    assert cuda.max_memory_allocated(0) == 400
    assert cuda.max_memory_reserved(0) == 1000  # the caching allocator keeps it
    assert cuda.max_memory_allocated(1) == 50 and cuda.resets == [0]


def test_capturing_and_failing_records_give_no_event() -> None:
    cuda = FakeCuda()
    cuda.capturing = True
    assert cuda.record_event(0) is None
    cuda.capturing = False
    cuda.failing_records = {cuda.record_calls + 2}
    assert cuda.record_event(0) is not None and cuda.record_event(0) is None
    assert cuda.device_index_of(torch.nn.Linear(2, 2)) is None
    # A CPU model standing in for a GPU one.
    assert FakeCuda(devices=2, model_device=1).device_index_of(torch.nn.Linear(2, 2)) == 1


# -- FakeNvml -------------------------------------------------------------------------------


def test_fake_nvml_through_the_real_system_sampler() -> None:
    nvml = FakeNvml([make_gpu_reading(0), RuntimeError("GPU lost")])
    item = SystemSampler(nvml).sample()
    assert item is not None and item["gpu_available"] is True
    gpus: Any = item["gpus"]
    assert [g["gpu_index"] for g in gpus] == [0, 1]
    assert gpus[0]["gpu_uuid"] == make_gpu_reading(0).uuid and gpus[1]["gpu_uuid"] is None
    with pytest.raises(RuntimeError, match="invalid GPU index"):
        nvml.read(2)
    nvml.close()
    # As PynvmlBackend after close: no GPU, and reading raises.
    assert nvml.device_count() == 0
    with pytest.raises(RuntimeError):
        nvml.read(0)


# -- the SDK with the fakes, captured ------------------------------------------------------


def _train(steps: int, cuda: FakeCuda) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        # trace_step(None): the training thread's CUDA device, cuda:0 here.
        with traceml.trace_step(None):
            loss = model(torch.randn(2, 4)).sum()
            with traceml.trace_phase("loss_backward"):
                loss.backward()
            opt.step()
            opt.zero_grad()
        cuda.finish_all()


def test_capture_gives_the_records_and_lines_of_a_real_export(tmp_path: Path) -> None:
    capture = ExportCapture(RankIdentity(hostname="host-a", pid=4242))
    cuda = FakeCuda(devices=1)
    cuda.allocate(0, 4096)
    traceml.init(sink=capture, sampler_interval=60, cuda_backend=cuda, nvml_backend=FakeNvml(2))
    _train(3, cuda)
    traceml.shutdown()
    assert cuda.misuse == [] and cuda.synchronize_calls == 0
    assert capture.skipped_items == 0
    steps = capture.records("step_time")
    assert [r.step for r in steps] == [1, 2, 3]
    assert all(r.events["loss_backward"]["cuda:0"].is_gpu for r in steps)
    assert [r.peak_allocated_bytes for r in capture.records("step_memory")] == [4096] * 3
    assert len(capture.records("system_gpu")) == 2 * len(capture.records("system")) > 0

    # The same items through the real pipeline and JSONL exporter: the same lines.
    identity = capture.identity.to_wire()
    pipeline = start_export(
        ExportSettings(exporter="jsonl", export_streams="all"), tmp_path / "run", report=None
    )
    assert pipeline is not None and pipeline.failure is None
    for stream in BATCH_STREAMS:
        for item in capture.items(stream):
            pipeline.submit(make_batch(stream, [item], identity, observed=1))
    stats = pipeline.finalize(timeout=30)
    assert stats.skipped_items == 0
    for stream in STREAMS_BY_NAME:
        written = (tmp_path / "run" / "aggregator" / "export" / f"{stream}.jsonl").read_bytes()
        data = [orjson.loads(line) for line in written.splitlines()[:-1]]
        captured = [orjson.loads(line) for line in capture.lines(stream)]
        for line in data + captured:
            line.pop("observed_timestamp_unix_ns")
        assert data == captured, stream
        assert len(data) == stats.written_records[stream]


def test_capture_counts_what_an_export_would_skip() -> None:
    capture = ExportCapture()
    capture.put("step_time", make_item("step_time", 0))
    capture.put("step_time", make_item("step_time", 1, step=0))  # steps start at 1
    assert [r.seq for r in capture.records("step_time")] == [0]
    assert capture.skipped_items == 1
    with pytest.raises(ValueError, match="unknown stream"):
        capture.records("steps")


# -- reset ----------------------------------------------------------------------------------


def test_reset_gives_a_fresh_traceml_between_tests() -> None:
    first = ExportCapture()
    traceml.init(sink=first, sampler_interval=60)
    with traceml.trace_step(None):
        pass
    reset()
    # Stopped: nothing more reaches the old sink.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with traceml.trace_step(None):
            pass
    assert len(first.items("step_time")) == 1
    # A new init is a new run: its first step is 1 again and its seq starts at 0, and
    # the warn-once warning of a missing launcher shows again.
    second = ExportCapture()
    traceml.init(sink=second, sampler_interval=60)
    with traceml.trace_step(None):
        pass
    traceml.shutdown()
    (item,) = second.items("step_time")
    assert (item["step"], item["seq"]) == (1, 0)
    assert any("traceml" in str(w.message).lower() for w in caught)
    reset()
    reset()  # idempotent, and fine with nothing started


# -- the item factory -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", list(STREAMS_BY_NAME))
@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
def test_made_records_round_trip_and_validate(stream: str, device: str) -> None:
    identity = make_identity(3, world_size=4, local_world_size=2)
    if stream in ("system", "system_gpu"):
        identity = make_identity(2, world_size=4, local_world_size=2)  # local rank 0
    record = make_record(stream, 5, device=device, identity=identity)
    line = dumps_line(record)
    assert validate_line(line) == []
    assert loads_line(line) == record
    assert record.rank == identity["global_rank"]
    assert record.timestamp_unix_ns == BASE_TIMESTAMP_NS + 5


def test_items_are_deterministic_and_overridable() -> None:
    assert make_item("step_time", 7) == make_item("step_time", 7)
    assert make_item("step_time", 7) != make_item("step_time", 8)
    assert make_item("process", cpu_percent=1.0)["cpu_percent"] == 1.0
    assert len(make_records("system_gpu", [make_item("system", n_gpus=3)])) == 3
    with pytest.raises(ValueError, match="not valid records"):
        make_records("step_memory", [make_item("step_memory", step=-1)])
    with pytest.raises(ValueError, match="unknown batch stream"):
        make_item("system_gpu")


def test_made_batches_build_the_same_encoded_or_decoded() -> None:
    items = [make_item("step_time", seq, device="cuda:0") for seq in range(3)]
    exporter = InMemoryExporter()
    builder = RecordBuilder(("step_time",), include_hostname=False)
    decoded = make_batch("step_time", items)
    encoded = make_batch("step_time", items, encoded=True)
    assert isinstance(encoded.payload, bytes) and encoded.nbytes == len(encoded.payload)
    assert decoded.nbytes == encoded.nbytes
    for batch in (decoded, encoded):
        exporter.export(builder.build(batch).records["step_time"])
    first, second = exporter.records_of("step_time")[:3], exporter.records_of("step_time")[3:]
    assert first == second == make_records("step_time", items)
    assert [r.seq for r in first] == [0, 1, 2]


# -- the user guide's examples run as written ---------------------------------------------

DOC = REPO / "docs" / "testing.md"


def _doc_blocks() -> list[str]:
    text = DOC.read_text()
    blocks = [part.split("```", 1)[0] for part in text.split("```python\n")[1:]]
    assert len(blocks) == 2, "docs/testing.md's examples changed: update this test"
    return blocks


@pytest.mark.parametrize("index", [0, 1])
def test_docs_examples_pass(index: int) -> None:
    namespace: dict[str, Any] = {"__name__": f"docs_testing_example_{index}"}
    exec(compile(_doc_blocks()[index], f"{DOC}:block{index}", "exec"), namespace)
    tests = [fn for name, fn in namespace.items() if name.startswith("test_")]
    assert tests
    for test in tests:
        reset()
        test()


def test_importing_the_testing_module_does_not_import_torch() -> None:
    # A user's exporter tests may run where torch is not installed.
    code = "import sys, traceml_ai.testing; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
