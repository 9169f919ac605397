"""Real-world GPU setups on CPU: CUDA and NVML through fakes as strict as the real APIs.

``traceml_ai.testing.FakeCuda`` behaves as ``torch.cuda`` does where forgiving fakes
did not: ``current_device()`` answers per thread (0 on a thread that never called
``set_device``), ``Event.elapsed_time`` raises until both events completed,
``Event.synchronize()`` blocks while the GPU is busy (behind an unjoined NCCL
collective it would never return), events given back for reuse must have completed,
and peaks are per device since the last reset.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import torch

import traceml_ai as traceml
from tests import e2e_helpers as e2e
from tests.traceml_ai.rank.conftest import once
from traceml_ai.rank import gpu
from traceml_ai.rank._patches import phase_hooks
from traceml_ai.rank._runtime import sdk
from traceml_ai.rank._timing import hotpath_py, step_timer
from traceml_ai.rank.gpu import GpuReading, TorchCudaBackend, normalize_uuid
from traceml_ai.rank.samplers import ProcessSampler
from traceml_ai.rank.sink import RecordingSink
from traceml_ai.testing import FakeCuda

pytestmark = pytest.mark.slow  # real runs, subprocesses or receivers (docs/testing.md)

FWD = "_traceml_internal:forward_time"
ENV_VARS = (
    "TRACEML_AGGREGATOR_ADDR",
    "TRACEML_RUN_TOKEN",
    "TRACEML_RESET_PEAK_MEMORY",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    sdk.reset_for_tests()
    yield
    sdk.reset_for_tests()


def _device(kind: str, index: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(type=kind, index=index)


class FakeTensor:
    """A parameter whose device a test changes (model.to('cuda') keeps the object)."""

    def __init__(self, device: SimpleNamespace) -> None:
        self.device = device


class FakeModel:
    """Parameters only: no forward hooks (the timer leaves such a model's forward alone)."""

    def __init__(self, *devices: SimpleNamespace) -> None:
        self.params = [FakeTensor(d) for d in devices]

    def parameters(self) -> Iterator[FakeTensor]:
        return iter(self.params)

    def buffers(self) -> Iterator[FakeTensor]:
        return iter(())

    def to(self, device: SimpleNamespace) -> FakeModel:
        for p in self.params:
            p.device = device
        return self


def step_items(sink: RecordingSink) -> list[dict[str, Any]]:
    return sink.items("step_time")


def one_step(model: object | None, cuda: FakeCuda) -> None:
    with traceml.trace_step(model), traceml.trace_phase("work"):
        pass


# -- shutdown ---------------------------------------------------------------------------


def test_shutdown_polls_one_deadline_and_never_synchronizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(step_timer, "SHUTDOWN_GPU_WAIT_S", 0.3)
    sink = RecordingSink()
    cuda = FakeCuda(devices=2)
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    model = FakeModel(_device("cuda", 0))
    for _ in range(5):
        one_step(model, cuda)
    cuda.completed = 2  # the first step's pair completed; the GPU hangs after it
    t0 = time.monotonic()
    traceml.shutdown()
    took = time.monotonic() - t0
    assert cuda.synchronize_calls == 0 and cuda.misuse == []
    # One deadline for all five pending steps, not one per step.
    assert 0.25 <= took < 1.5, took
    items = step_items(sink)
    assert [i["step"] for i in items] == [1, 2, 3, 4, 5]
    works = [i["events"]["work"]["cuda:0"] for i in items]
    assert works[0]["gpu_ms"] == 1.0 and works[0]["is_gpu"] is True
    for work in works[1:]:
        assert work["gpu_ms"] is None and work["is_gpu"] is False
        assert work["duration_ms"] == work["cpu_ms"]


def test_shutdown_returns_as_soon_as_the_gpu_finished() -> None:
    sink = RecordingSink()
    cuda = FakeCuda(devices=2)
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    model = FakeModel(_device("cuda", 0))
    for _ in range(3):
        one_step(model, cuda)
    threading.Timer(0.1, cuda.finish_all).start()
    t0 = time.monotonic()
    traceml.shutdown()
    assert time.monotonic() - t0 < 1.0
    assert [i["events"]["work"]["cuda:0"]["gpu_ms"] for i in step_items(sink)] == [1.0] * 3


def test_last_step_is_sent_when_its_events_complete_without_a_next_step() -> None:
    sink = RecordingSink()
    cuda = FakeCuda(devices=2)
    traceml.init(sink=sink, sampler_interval=0.05, cuda_backend=cuda)
    one_step(FakeModel(_device("cuda", 0)), cuda)
    time.sleep(0.2)
    assert step_items(sink) == []  # still running on the GPU
    cuda.finish_all()
    deadline = time.monotonic() + 5
    while not step_items(sink) and time.monotonic() < deadline:
        time.sleep(0.02)
    (item,) = step_items(sink)
    assert item["events"]["work"]["cuda:0"]["gpu_ms"] == 1.0
    traceml.shutdown()
    assert len(step_items(sink)) == 1


# -- event pairs outside steps, CUDA graph capture --------------------------------------


def test_trace_phase_outside_steps_keeps_a_bounded_number_of_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The last step's events never complete: shutdown gives up on them after this wait.
    monkeypatch.setattr(step_timer, "SHUTDOWN_GPU_WAIT_S", 0.3)
    sink = RecordingSink()
    cuda = FakeCuda(devices=2)
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    one_step(FakeModel(_device("cuda", 0)), cuda)  # the device is known from here on
    timer = phase_hooks.active()
    assert timer is not None
    for _ in range(hotpath_py.MAX_OUTSIDE_PAIRS * 3):
        with traceml.trace_phase("eval"):
            pass
    phase = timer._acc["eval"]
    assert len(phase.pairs) == 0 and phase.missing
    assert phase.n_calls == hotpath_py.MAX_OUTSIDE_PAIRS * 3
    cuda.finish_all()
    one_step(FakeModel(_device("cuda", 0)), cuda)
    traceml.shutdown()
    evals = step_items(sink)[-1]["events"]["eval"]["cuda:0"]
    assert evals["n_calls"] == hotpath_py.MAX_OUTSIDE_PAIRS * 3 and evals["gpu_ms"] is None


def test_no_events_inside_a_cuda_graph_capture() -> None:
    sink = RecordingSink()
    cuda = FakeCuda(devices=2)
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    cuda.capturing = True
    one_step(FakeModel(_device("cuda", 0)), cuda)
    cuda.capturing = False
    traceml.shutdown()
    work = step_items(sink)[0]["events"]["work"]["cuda:0"]
    assert work["gpu_ms"] is None and work["n_calls"] == 1


# -- peak memory ------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["env", "keyword"])
def test_peak_reset_opt_out_leaves_the_users_peak_alone(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    sink = RecordingSink()
    cuda = FakeCuda(devices=2)
    if how == "env":
        monkeypatch.setenv("TRACEML_RESET_PEAK_MEMORY", "0")
        traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    else:
        traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda, reset_peak_memory=False)
    model = FakeModel(_device("cuda", 0))
    for _ in range(3):
        one_step(model, cuda)
    cuda.finish_all()
    traceml.shutdown()
    assert cuda.resets == []
    memory = sink.items("step_memory")
    assert [(m["device"], m["peak_allocated_bytes"]) for m in memory] == [("cuda:0", None)] * 3


def test_peak_is_reset_per_step_by_default() -> None:
    sink = RecordingSink()
    cuda = FakeCuda(devices=2)
    cuda.allocate(1, 1001)
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    model = FakeModel(_device("cuda", 1))
    for _ in range(2):
        one_step(model, cuda)
        cuda.allocate(1, 500)  # a peak of 1501 between steps: the next reset forgets it
        cuda.allocate(1, -500)
    cuda.finish_all()
    traceml.shutdown()
    assert cuda.resets == [1, 1]
    assert [m["peak_allocated_bytes"] for m in sink.items("step_memory")] == [1001, 1001]


# -- device detection -------------------------------------------------------------------


def test_parameters_offloaded_to_cpu_do_not_make_the_run_cpu() -> None:
    sink = RecordingSink()
    cuda = FakeCuda(devices=2)
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    # Embeddings offloaded to CPU come first; the rest trains on cuda:1.
    one_step(FakeModel(_device("cpu"), _device("cuda", 1), _device("cuda", 1)), cuda)
    cuda.finish_all()
    traceml.shutdown()
    assert list(step_items(sink)[0]["events"]["work"]) == ["cuda:1"]
    assert cuda.record_devices and set(cuda.record_devices) == {1}


def test_model_moved_to_the_gpu_after_step_one_is_followed() -> None:
    sink = RecordingSink()
    cuda = FakeCuda(devices=2)
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    model = FakeModel(_device("cpu"), _device("cpu"))
    one_step(model, cuda)
    model.to(_device("cuda", 1))
    one_step(model, cuda)
    one_step(model, cuda)
    cuda.finish_all()
    traceml.shutdown()
    devices = [next(iter(i["events"]["work"])) for i in step_items(sink)]
    assert devices == ["cpu", "cuda:1", "cuda:1"]
    assert [m["device"] for m in sink.items("step_memory")] == devices


def test_trace_step_none_follows_the_training_threads_device() -> None:
    sink = RecordingSink()
    cuda = FakeCuda(devices=2)
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    one_step(None, cuda)
    cuda.set_device(1)  # a later set_device on the training thread is followed
    one_step(None, cuda)
    cuda.finish_all()
    traceml.shutdown()
    assert [next(iter(i["events"]["work"])) for i in step_items(sink)] == ["cuda:0", "cuda:1"]


def test_trace_step_none_without_set_device_does_not_time_cuda0_on_local_rank_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    sink = RecordingSink()
    cuda = FakeCuda(devices=2)
    cuda.allocate(1, 4096)  # the script put its tensors on cuda:LOCAL_RANK
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    one_step(None, cuda)
    one_step(None, cuda)
    cuda.finish_all()
    traceml.shutdown()
    assert [next(iter(i["events"]["work"])) for i in step_items(sink)] == ["cuda:1", "cuda:1"]
    assert set(cuda.record_devices) == {1}


# -- the process sampler's device --------------------------------------------------------


def test_process_sampler_reports_the_ranks_device_not_its_own_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    sink = RecordingSink()
    cuda = FakeCuda(devices=2)
    cuda.allocate(1, 4096)
    cuda.set_device(1)  # on the training thread; the sampler thread still answers 0
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    # Before the first step: the rank's device from LOCAL_RANK.
    deadline = time.monotonic() + 5
    while not sink.items("process") and time.monotonic() < deadline:
        time.sleep(0.02)
    first = sink.items("process")[0]
    assert first["gpu_device_index"] == 1 and first["gpu_memory_used_bytes"] == 4096
    one_step(None, cuda)
    cuda.finish_all()
    traceml.shutdown()
    last = sink.items("process")[-1]
    assert last["gpu_device_index"] == 1 and last["gpu_memory_used_bytes"] == 4096


def test_process_sampler_alone_on_another_thread() -> None:
    cuda = FakeCuda(devices=2)
    cuda.set_device(1)
    sampler = ProcessSampler(cuda, lambda: None, local_rank=1)
    result: list[dict[str, object] | None] = []
    thread = threading.Thread(target=lambda: result.append(sampler.sample()))
    thread.start()
    thread.join()
    assert result[0] is not None and result[0]["gpu_device_index"] == 1


# -- torch.compile ----------------------------------------------------------------------


def test_compiled_model_fullgraph_with_trace_step_has_no_graph_break() -> None:
    dynamo = pytest.importorskip("torch._dynamo")
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dynamo.reset()
    model.compile(fullgraph=True, backend="eager")
    x = torch.randn(4, 8)
    for _ in range(3):
        with traceml.trace_step(model):
            loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    # The hooks stepped aside while dynamo traced: one graph, no break.
    explained = dynamo.explain(model._compiled_call_impl)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    traceml.shutdown()
    items = step_items(sink)
    assert [i["step"] for i in items] == [1, 2, 3]
    for item in items:
        # Backward and the optimizer run eagerly and are timed; forward is inside
        # the compiled region (docs/live-export.md, GPU notes).
        assert "_traceml_internal:backward_time" in item["events"]
        assert "_traceml_internal:optimizer_step" in item["events"]


# -- DataLoader workers started with spawn / forkserver ---------------------------------

_WORKER_SCRIPT = """
import sys

import torch
from torch.utils.data import DataLoader, Dataset

import traceml_ai as traceml

# Top level: spawn and forkserver workers re-import this script and run it again.
traceml.init()


class Data(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        # A phase inside a worker would auto-init a second copy of the rank there.
        with traceml.trace_phase("load"):
            return torch.randn(8), torch.randn(1)


def main():
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Data(), batch_size=4, num_workers=2, multiprocessing_context=sys.argv[1])
    for x, y in loader:
        with traceml.trace_step(model):
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()


if __name__ == "__main__":
    main()
"""


@once  # the steps are timed in the child
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawn_and_forkserver_workers_stay_off(tmp_path: Path, context: str) -> None:
    script = tmp_path / "train_workers.py"
    script.write_text(_WORKER_SCRIPT)
    logs = tmp_path / "logs"
    res = e2e.run_cli(
        [
            "run",
            "--logs-dir",
            logs,
            "--run-name",
            "w",
            "--interval",
            "0.2",
            "--exporter",
            "jsonl",
            "--export-streams",
            "all",
            script,
            context,
        ],
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    folder = e2e.export_dir(logs, "w")
    steps = e2e.data_lines(folder / "step_time.jsonl")
    # One sender: seq never restarts, the steps are the rank's 8.
    assert [s["seq"] for s in steps] == list(range(8))
    assert [s["step"] for s in steps] == list(range(1, 9))
    assert all("load" not in s["events"] for s in steps)
    process = e2e.data_lines(folder / "process.jsonl")
    assert len({p["pid"] for p in process}) == 1, {p["pid"] for p in process}
    assert [p["seq"] for p in process] == list(range(len(process)))
    system = e2e.data_lines(folder / "system.jsonl")
    assert [s["seq"] for s in system] == list(range(len(system)))
    envs = e2e.data_lines(folder / "runtime_environment.jsonl")
    assert len({e["pid"] for e in envs}) == 1
    e2e.assert_valid(folder, tmp_path)


# -- NVML missing --------------------------------------------------------------------------


def test_missing_nvidia_ml_py_warns_once_when_cuda_is_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As on a host without nvidia-ml-py: `import pynvml` raises ImportError.
    monkeypatch.setitem(sys.modules, "pynvml", None)
    sink = RecordingSink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traceml.init(sink=sink, sampler_interval=0.05, cuda_backend=FakeCuda())
        deadline = time.monotonic() + 5
        while len(sink.items("system")) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        traceml.shutdown()
    assert sink.items("system")[0]["gpus"] == []
    messages = [str(w.message) for w in caught if "NVML" in str(w.message)]
    assert len(messages) == 1, messages
    assert messages[0].startswith("traceml: CUDA is available but NVML could not be loaded")
    assert "nvidia-ml-py" in messages[0]


def test_missing_nvidia_ml_py_is_silent_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    sink = RecordingSink()
    cuda = FakeCuda(devices=2)
    monkeypatch.setattr(cuda, "is_available", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
        traceml.shutdown()
    assert not [w for w in caught if "NVML" in str(w.message)]


def test_nvidia_ml_py_is_a_linux_dependency() -> None:
    text = (e2e.REPO / "pyproject.toml").read_text()
    deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "\"nvidia-ml-py>=12; sys_platform == 'linux'\"" in deps


# -- GPU UUIDs ----------------------------------------------------------------------------


def test_uuids_are_written_as_nvml_writes_them() -> None:
    # torch prints the UUID bare; NVML prefixes it (bytes in old nvidia-ml-py).
    bare = "2b5f3f3c-9d1e-4c1a-8f00-0123456789ab"
    assert normalize_uuid(bare) == "GPU-" + bare
    assert normalize_uuid(("GPU-" + bare).encode()) == "GPU-" + bare
    assert normalize_uuid("MIG-" + bare) == "MIG-" + bare
    assert normalize_uuid(None) is None
    assert normalize_uuid("") is None
    assert normalize_uuid(b"\xff") is None
    assert normalize_uuid("x" * 200) is None


def test_torch_backend_reads_the_uuid_from_device_properties(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bare = "2b5f3f3c-9d1e-4c1a-8f00-0123456789ab"
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=bare))
    assert TorchCudaBackend().device_uuid(0) == "GPU-" + bare


class UuidNvml:
    """An ``NvmlBackend`` fake: NVML numbers the host's GPUs its own way (PCI order)."""

    def __init__(self, uuids: list[str]) -> None:
        self.uuids = uuids

    def device_count(self) -> int:
        return len(self.uuids)

    def read(self, index: int) -> GpuReading:
        return GpuReading(memory_used_bytes=1, memory_total_bytes=2, uuid=self.uuids[index])

    def close(self) -> None:
        pass


def test_process_and_system_gpu_lines_join_on_gpu_uuid() -> None:
    cuda = FakeCuda(devices=2)
    # Torch's cuda:1 is NVML's GPU 0 (CUDA_VISIBLE_DEVICES / CUDA's device order).
    nvml = UuidNvml([cuda.device_uuid(1) or "", cuda.device_uuid(0) or ""])
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda, nvml_backend=nvml)
    one_step(FakeModel(_device("cuda", 1)), cuda)
    cuda.finish_all()
    traceml.shutdown()
    process = sink.items("process")[-1]
    assert process["gpu_device_index"] == 1
    gpus = {g["gpu_uuid"]: g["gpu_index"] for g in sink.items("system")[-1]["gpus"]}
    assert gpus[process["gpu_uuid"]] == 0


def test_lines_with_and_without_gpu_uuid_are_valid() -> None:
    from traceml_records import dumps_line, loads_line
    from traceml_records._generated.records import ProcessRecord, SystemGpuRecord

    identity: dict[str, Any] = {
        "schema_version": 1,
        "observed_timestamp_unix_ns": 1,
        "rank": 0,
        "global_rank": 0,
        "local_rank": 0,
        "world_size": 1,
        "local_world_size": 1,
        "node_rank": 0,
        "timestamp_unix_ns": 1,
        "seq": 0,
    }
    base = ProcessRecord(
        stream="process",
        **identity,
        pid=7,
        cpu_percent=1.0,
        cpu_logical_cores=2,
        ram_used_bytes=1,
        ram_total_bytes=2,
        gpu_available=True,
        gpu_count=2,
        gpu_device_index=1,
        gpu_memory_used_bytes=1,
        gpu_memory_reserved_bytes=1,
        gpu_memory_total_bytes=2,
    )
    # A line of the release before gpu_uuid (no key) loads as before.
    old = dumps_line(base)
    assert b"gpu_uuid" not in old
    assert loads_line(old).gpu_uuid is None  # type: ignore[union-attr]
    uuid = "GPU-00000001-1111-2222-3333-444444444444"
    new = dumps_line(attrs.evolve(base, gpu_uuid=uuid))
    assert new.endswith(b'"gpu_uuid":"' + uuid.encode() + b'"}\n')
    assert loads_line(new).gpu_uuid == uuid  # type: ignore[union-attr]
    gpu = SystemGpuRecord(
        stream="system_gpu",
        **identity,
        gpu_index=0,
        utilization_percent=None,
        memory_used_bytes=None,
        memory_total_bytes=None,
        temperature_c=None,
        power_usage_w=None,
        power_limit_w=None,
        gpu_uuid=uuid,
    )
    assert loads_line(dumps_line(gpu)).gpu_uuid == uuid  # type: ignore[union-attr]


def test_gpu_uuid_null_is_refused_as_validate_refuses_it() -> None:
    import orjson

    from traceml_records import loads_line, validate_line
    from traceml_records._errors import RecordError

    good = {
        "stream": "system_gpu",
        "schema_version": 1,
        "observed_timestamp_unix_ns": 1,
        "rank": 0,
        "global_rank": 0,
        "local_rank": 0,
        "world_size": 1,
        "local_world_size": 1,
        "node_rank": 0,
        "timestamp_unix_ns": 1,
        "seq": 0,
        "gpu_index": 0,
        "utilization_percent": None,
        "memory_used_bytes": None,
        "memory_total_bytes": None,
        "temperature_c": None,
        "power_usage_w": None,
        "power_limit_w": None,
    }
    assert not validate_line(orjson.dumps(good) + b"\n")
    # Absent when unknown, never null: both readers refuse a null at the same place.
    line = orjson.dumps({**good, "gpu_uuid": None}) + b"\n"
    assert [p.pointer for p in validate_line(line)] == ["/gpu_uuid"]
    with pytest.raises(RecordError) as refused:
        loads_line(line)
    assert refused.value.pointer == "/gpu_uuid"


def test_step_peaks_cost_one_allocator_statistics_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def nested(i: int) -> dict[str, Any]:
        calls.append(i)
        return {
            "allocated_bytes": {"all": {"peak": 10 + len(calls)}},
            "reserved_bytes": {"all": {"peak": 20 + len(calls)}},
        }

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", nested)
    backend = TorchCudaBackend()
    assert (backend.max_memory_allocated(0), backend.max_memory_reserved(0)) == (11, 21)
    assert calls == [0]
    # Alone, or for another device, reserved reads its own statistics.
    assert backend.max_memory_reserved(0) == 22
    backend.max_memory_allocated(0)
    assert backend.max_memory_reserved(1) == 24
    assert calls == [0, 0, 0, 1]


# -- event reuse --------------------------------------------------------------------------


def test_completed_events_are_recorded_again_and_every_gpu_ms_stays_exact() -> None:
    sink = RecordingSink()
    cuda = FakeCuda(devices=2)
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    model = FakeModel(_device("cuda", 0))
    for _ in range(50):
        one_step(model, cuda)
        cuda.completed = cuda.clock  # the GPU keeps up: each step completes
    traceml.shutdown()
    works = [i["events"]["work"]["cuda:0"] for i in step_items(sink)]
    assert len(works) == 50
    # StrictEvent refuses a query after its release: a stale pair would fail here.
    assert all(w["gpu_ms"] == 1.0 and w["is_gpu"] for w in works)
    # 100 recordings, a handful of CUDA events: each step's pair is recorded again.
    assert len(cuda.record_devices) == 100
    assert cuda.created <= 6, cuda.created
    assert cuda.misuse == []


def test_events_of_steps_still_running_are_never_reused() -> None:
    sink = RecordingSink()
    cuda = FakeCuda(devices=2)
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    model = FakeModel(_device("cuda", 0))
    for _ in range(10):
        one_step(model, cuda)  # the GPU completes nothing
    assert cuda.created == 20 and not cuda.free_events
    cuda.finish_all()
    traceml.shutdown()
    assert [i["events"]["work"]["cuda:0"]["gpu_ms"] for i in step_items(sink)] == [1.0] * 10
    assert cuda.misuse == []


class _TorchEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.streams: list[object] = []

    def record(self, stream: object) -> None:
        self.streams.append(stream)


def _fake_torch_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    calls: dict[str, list[Any]] = {"current_stream": [], "events": []}
    current = {"id": 7}

    def event(enable_timing: bool = False) -> _TorchEvent:
        calls["events"].append(1)
        return _TorchEvent(enable_timing)

    def current_stream(index: int) -> tuple[str, int, int]:
        calls["current_stream"].append(index)
        return ("stream", current["id"], index)

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(
        torch._C, "_cuda_getCurrentStream", lambda i: (current["id"], i, 1), raising=False
    )
    calls["switch"] = [lambda new: current.__setitem__("id", new)]
    return calls


def test_torch_backend_records_given_back_events_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_torch_cuda(monkeypatch)
    backend = TorchCudaBackend()
    first = backend.record_event(0)
    second = backend.record_event(0)
    assert first is not None and second is not None and first is not second
    backend.release_events(0, [first, second])
    again = backend.record_event(0)
    assert again is second or again is first
    # Events of one device are never recorded on another.
    other = backend.record_event(1)
    assert other is not first and other is not second
    assert len(calls["events"]) == 3
    # At most _MAX_FREE_EVENTS kept per device.
    many: list[Any] = [backend.record_event(0) for _ in range(gpu._MAX_FREE_EVENTS + 10)]
    backend.release_events(0, many)
    assert len(backend._free_events[0]) == gpu._MAX_FREE_EVENTS


def test_torch_backend_records_on_the_current_stream_as_it_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _fake_torch_cuda(monkeypatch)
    backend = TorchCudaBackend()
    events = [backend.record_event(0) for _ in range(3)]
    calls["switch"][0](9)  # `with torch.cuda.stream(side):`
    events += [backend.record_event(0) for _ in range(2)]
    calls["switch"][0](7)
    events.append(backend.record_event(0))
    streams = [e.streams[-1] for e in events]  # type: ignore[union-attr]
    assert [s[1] for s in streams] == [7, 7, 7, 9, 9, 7]
    # One Stream object per distinct stream, not one per event.
    assert calls["current_stream"] == [0, 0]


def test_torch_backend_forgets_cached_cuda_state_in_a_fork_child(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_torch_cuda(monkeypatch)
    backend = TorchCudaBackend()
    event = backend.record_event(0)
    assert event is not None
    backend.release_events(0, [event])
    monkeypatch.setattr(gpu, "_fork_generation", gpu._fork_generation + 1)
    # A fork child's CUDA is unusable: torch says so through is_initialized().
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert backend.record_event(0) is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert backend.record_event(0) is not event  # the parent's pool is not reused
