"""Samplers: process/system/runtime_environment items, the sampler thread, and GPU
access through fakes (no GPU exists in CI)."""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import traceml_ai as traceml
from tests.e2e_helpers import REPO
from traceml_ai.rank._runtime import sdk
from traceml_ai.rank.gpu import GpuReading, PynvmlBackend, TorchCudaBackend
from traceml_ai.rank.samplers import (
    DEFAULT_SAMPLER_INTERVAL,
    ProcessSampler,
    SamplerThread,
    SystemSampler,
    finite,
    sampler_interval_from_env,
)
from traceml_ai.rank.sink import RecordingSink
from traceml_ai.testing import FakeCuda, FakeNvml

WIRE_DOC = REPO / "docs" / "dev" / "wire-format.md"
ENV_VARS = (
    "TRACEML_AGGREGATOR_ADDR",
    "TRACEML_RUN_TOKEN",
    "TRACEML_SAMPLER_INTERVAL",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
)


def wire_keys(stream: str) -> tuple[set[str], set[str]]:
    """Item keys of ``stream`` from the wire-format doc's table, and the keys of its
    nested ``{...}`` object (GPU entry, phase timing), if any."""
    for line in WIRE_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] == f"`{stream}`":
            top: set[str] = set()
            nested: set[str] = set()
            for token in re.findall(r"`([^`]+)`", cells[1]):
                if token.startswith("{"):
                    nested = {k.strip() for k in token.strip("{}").split(",")}
                else:
                    top.add(token)
            return top, nested
    raise AssertionError(f"{stream} not in {WIRE_DOC}")


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    sdk.reset_for_tests()
    yield
    sdk.reset_for_tests()


def cpu_only_cuda(available: bool | None = False) -> FakeCuda:
    """A process without a GPU (``available=None``: CUDA not initialized yet)."""
    return FakeCuda(devices=0, available=available)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


# -- item shapes ---------------------------------------------------------------------


def test_process_item_matches_the_wire_format() -> None:
    keys, _ = wire_keys("process")
    sampler = ProcessSampler(cpu_only_cuda(), lambda: None)
    first = sampler.sample()
    second = sampler.sample()
    assert first is not None and second is not None
    assert set(first) == keys
    assert (first["seq"], second["seq"]) == (0, 1)
    assert isinstance(first["cpu_percent"], float) and first["cpu_percent"] >= 0
    assert isinstance(first["ram_used_bytes"], int) and first["ram_used_bytes"] > 0
    assert isinstance(first["ram_total_bytes"], int)
    assert first["ram_total_bytes"] >= first["ram_used_bytes"]
    cores = first["cpu_logical_cores"]
    assert isinstance(cores, int) and cores >= 1
    assert first["gpu_available"] is False
    for key in keys:
        if key.startswith("gpu_") and key != "gpu_available":
            assert first[key] is None, key


def test_process_gpu_fields_stay_null_while_gpu_cannot_be_probed() -> None:
    item = ProcessSampler(cpu_only_cuda(available=None), lambda: None).sample()
    assert item is not None
    assert item["gpu_available"] is None
    assert item["gpu_count"] is None and item["gpu_memory_total_bytes"] is None


def test_system_item_matches_the_wire_format() -> None:
    keys, gpu_keys = wire_keys("system")
    ok = GpuReading(
        utilization_percent=37.0,
        memory_used_bytes=5,
        memory_total_bytes=10,
        temperature_c=55.0,
        power_usage_w=80.5,
        power_limit_w=300.0,
        uuid="GPU-5",
    )
    sampler = SystemSampler(FakeNvml([ok]))
    item = sampler.sample()
    assert item is not None
    assert set(item) == keys
    assert 0.0 <= item["cpu_percent"] <= 100.0  # type: ignore[operator]
    total = item["ram_total_bytes"]
    assert isinstance(total, int) and 0 <= item["ram_used_bytes"] <= total  # type: ignore[operator]
    assert item["gpu_available"] is True
    (gpu,) = item["gpus"]  # type: ignore[misc]
    assert set(gpu) == gpu_keys
    assert gpu == {
        "gpu_index": 0,
        "utilization_percent": 37.0,
        "memory_used_bytes": 5,
        "memory_total_bytes": 10,
        "temperature_c": 55.0,
        "power_usage_w": 80.5,
        "power_limit_w": 300.0,
        "gpu_uuid": "GPU-5",
    }


def test_two_gpus_one_failing_keeps_both_entries() -> None:
    good = GpuReading(utilization_percent=100.0, memory_used_bytes=1, memory_total_bytes=2)
    item = SystemSampler(FakeNvml([good, RuntimeError("GPU lost")])).sample()
    assert item is not None
    assert item["gpu_available"] is True
    gpus = item["gpus"]
    assert isinstance(gpus, list) and len(gpus) == 2
    assert [g["gpu_index"] for g in gpus] == [0, 1]
    assert gpus[0]["utilization_percent"] == 100.0 and gpus[0]["memory_total_bytes"] == 2
    assert all(v is None for k, v in gpus[1].items() if k != "gpu_index")


def test_out_of_range_and_non_finite_gpu_values_become_null() -> None:
    odd = GpuReading(
        utilization_percent=150.0,
        memory_used_bytes=-1,
        memory_total_bytes=4,
        temperature_c=float("nan"),
        power_usage_w=float("inf"),
        power_limit_w=-3.0,
    )
    item = SystemSampler(FakeNvml([odd])).sample()
    assert item is not None
    (gpu,) = item["gpus"]  # type: ignore[misc]
    assert gpu["memory_total_bytes"] == 4
    for key in (
        "utilization_percent",
        "memory_used_bytes",
        "temperature_c",
        "power_usage_w",
        "power_limit_w",
    ):
        assert gpu[key] is None, key


def test_no_gpu_on_the_host_gives_an_empty_list() -> None:
    item = SystemSampler(FakeNvml([])).sample()
    assert item is not None
    assert item["gpu_available"] is False and item["gpus"] == []


def test_real_backends_answer_without_raising() -> None:
    nvml = PynvmlBackend()
    count = nvml.device_count()
    item = SystemSampler(nvml).sample()
    nvml.close()
    assert item is not None
    assert item["gpu_available"] is (count > 0)
    assert len(item["gpus"]) == count  # type: ignore[arg-type]
    cuda = TorchCudaBackend()
    model = torch.nn.Linear(2, 2)
    assert cuda.device_index_of(model) is None
    if torch.version.cuda is None:
        # This CPU build can never reach a GPU.
        assert cuda.is_available() is False
        assert cuda.record_event(0) is None
        assert cuda.max_memory_allocated(0) is None
        assert cuda.total_memory(0) is None


def test_finite_guard() -> None:
    assert finite(1) == 1.0
    assert finite(float("nan")) is None
    assert finite(float("-inf")) is None
    assert finite("x") is None
    assert finite(101.0, 0.0, 100.0) is None
    assert finite(-0.5, low=0.0) is None


def test_sampler_interval_from_env() -> None:
    assert sampler_interval_from_env({}) == DEFAULT_SAMPLER_INTERVAL == 2.0
    assert sampler_interval_from_env({"TRACEML_SAMPLER_INTERVAL": "0.5"}) == 0.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        assert sampler_interval_from_env({"TRACEML_SAMPLER_INTERVAL": bad}) == 2.0


# -- the thread and the SDK --------------------------------------------------------


def test_sampler_thread_ticks_at_once_then_periodically_and_stops() -> None:
    ticks: list[float] = []
    thread = SamplerThread(0.01, lambda: ticks.append(time.monotonic()))
    thread.start()
    assert wait_for(lambda: len(ticks) >= 3)
    assert thread.stop(timeout=5.0)
    count = len(ticks)
    time.sleep(0.05)
    assert len(ticks) == count


def test_local_rank_zero_sends_process_system_and_runtime_items(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRACEML_SAMPLER_INTERVAL", "0.01")
    sink = RecordingSink()
    nvml = FakeNvml([GpuReading(), GpuReading(utilization_percent=3.0)])
    traceml.init(sink=sink, nvml_backend=nvml, cuda_backend=cpu_only_cuda())
    assert wait_for(lambda: len(sink.items("system")) >= 3)
    traceml.shutdown()
    assert nvml.closed
    for stream in ("process", "system"):
        seqs = [i["seq"] for i in sink.items(stream)]
        assert seqs == list(range(len(seqs))), stream
    for item in sink.items("system"):
        assert [g["gpu_index"] for g in item["gpus"]] == [0, 1]  # type: ignore[attr-defined]
    envs = sink.items("runtime_environment")
    assert len(envs) == 1  # unchanged values are not sent again
    env_keys, _ = wire_keys("runtime_environment")
    assert set(envs[0]) == env_keys
    assert envs[0]["topology"] == "single_process"
    assert envs[0]["training_strategy"] == "single_process"
    assert envs[0]["python_version"] == __import__("platform").python_version()


def test_even_a_short_run_has_start_and_shutdown_samples() -> None:
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=3600, nvml_backend=FakeNvml([]))
    traceml.shutdown()
    assert len(sink.items("process")) == 2
    assert len(sink.items("system")) == 2
    traceml.shutdown()  # idempotent
    assert len(sink.items("process")) == 2


def test_local_rank_one_sends_no_system_items(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(name, value)
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=0.01, nvml_backend=FakeNvml([GpuReading()]))
    assert wait_for(lambda: len(sink.items("process")) >= 3)
    traceml.shutdown()
    assert sink.items("system") == []
    (env,) = sink.items("runtime_environment")
    assert env["topology"] == "single_node_multi_process"
    assert env["training_strategy"] == "distributed_unknown"


def test_runtime_environment_is_sent_once_at_the_first_step(tmp_path: Path) -> None:
    # Sent when the first traced step begins, after the script set up torch.distributed;
    # the teardown at the end of the script is not reported as a new environment.
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=0.01, nvml_backend=FakeNvml([]))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    assert wait_for(lambda: len(sink.items("process")) >= 2)
    assert sink.items("runtime_environment") == []
    model = torch.nn.Linear(2, 1)
    try:
        with traceml.trace_step(model):
            model(torch.ones(1, 2)).sum().backward()
    finally:
        dist.destroy_process_group()
        traceml.shutdown()
    (env,) = sink.items("runtime_environment")
    assert env["seq"] == 0
    assert env["distributed_initialized"] is True
    assert env["distributed_backend"] == "gloo"
    assert (env["training_strategy"], env["strategy_source"]) == (
        "distributed_unknown",
        "runtime_distributed",
    )
    assert env["strategy_confidence"] == "low"


def test_runtime_environment_is_sent_again_when_a_new_model_changes_it(tmp_path: Path) -> None:
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=0.01, nvml_backend=FakeNvml([]))
    plain = torch.nn.Linear(2, 1)
    with traceml.trace_step(plain):
        plain(torch.ones(1, 2))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        with traceml.trace_step(ddp):
            ddp(torch.ones(1, 2)).sum().backward()
    finally:
        dist.destroy_process_group()
        traceml.shutdown()
    before, after = sink.items("runtime_environment")
    assert (before["seq"], after["seq"]) == (0, 1)
    assert before["distributed_initialized"] is False
    assert (after["training_strategy"], after["distributed_backend"]) == ("ddp", "gloo")


class _BrokenNvml(FakeNvml):
    def device_count(self) -> int:
        raise RuntimeError("driver went away")


def test_sampler_items_never_carry_non_finite_numbers() -> None:
    sink = RecordingSink()
    nvml = FakeNvml([GpuReading(temperature_c=float("nan"), power_usage_w=float("inf"))])
    traceml.init(sink=sink, sampler_interval=3600, nvml_backend=nvml)
    traceml.shutdown()

    def numbers(value: Any) -> Iterator[float]:
        if isinstance(value, float):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from numbers(v)
        elif isinstance(value, list):
            for v in value:
                yield from numbers(v)

    items = sink.items()
    assert items
    assert all(math.isfinite(x) for item in items for x in numbers(item))


def test_a_failing_nvml_count_means_no_gpus() -> None:
    item = SystemSampler(_BrokenNvml([])).sample()
    assert item is not None
    assert item["gpu_available"] is False and item["gpus"] == []


class _FakePynvml:
    """Stands in for the ``pynvml`` module: no NVIDIA driver exists in CI."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index == 1:
            raise self.NVMLError("GPU is lost")
        return index

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return type("Util", (), {"gpu": 42, "memory": 7})()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return type("Mem", (), {"used": 1 << 30, "total": 80 << 30, "free": 79 << 30})()

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return 61

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return 123_456  # milliwatts

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:
        raise self.NVMLError("not supported")

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        # Old nvidia-ml-py returns bytes; the UUID is written as text.
        return b"GPU-2b5f3f3c-0000-1111-2222-333344445555"


def test_pynvml_backend_maps_nvml_readings(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakePynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    nvml = PynvmlBackend()
    item = SystemSampler(nvml).sample()
    nvml.close()
    assert fake.shutdowns == 1
    assert item is not None and item["gpu_available"] is True
    first, second = item["gpus"]  # type: ignore[misc]
    assert first == {
        "gpu_index": 0,
        "utilization_percent": 42.0,
        "memory_used_bytes": 1 << 30,
        "memory_total_bytes": 80 << 30,
        "temperature_c": 61.0,
        "power_usage_w": 123.456,
        "power_limit_w": None,  # this reading failed alone; the others stay
        "gpu_uuid": "GPU-2b5f3f3c-0000-1111-2222-333344445555",
    }
    assert second["gpu_index"] == 1
    assert all(v is None for k, v in second.items() if k != "gpu_index")


def test_pynvml_backend_without_a_driver_reports_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakePynvml()

    def no_driver() -> None:
        raise fake.NVMLError("NVML Shared Library Not Found")

    monkeypatch.setattr(fake, "nvmlInit", no_driver)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    nvml = PynvmlBackend()
    assert nvml.device_count() == 0
    with pytest.raises(RuntimeError):
        nvml.read(0)


class _FakeTorchEvent:
    """Stands in for ``torch.cuda.Event``: no GPU exists in CI."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.stream: Any = None

    def record(self, stream: Any = None) -> None:
        self.stream = stream


def test_torch_cuda_backend_calls_torch_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.cuda
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(cuda, "is_initialized", lambda: False)
    backend = TorchCudaBackend()
    # Not yet initialized by the training code: no probing, no figures.
    assert backend.is_available() is None
    assert backend.record_event(0) is None
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "current_device", lambda: 1)
    monkeypatch.setattr(cuda, "Event", _FakeTorchEvent)
    monkeypatch.setattr(cuda, "current_stream", lambda i: f"stream{i}")
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda i: calls.append(("reset", i)))
    capturing = [False]
    monkeypatch.setattr(cuda, "is_current_stream_capturing", lambda: capturing[0])

    def flattening(i: int) -> Any:
        raise AssertionError("memory_stats() flattens and sorts: not on the training thread")

    monkeypatch.setattr(cuda, "memory_stats", flattening)
    monkeypatch.setattr(cuda, "max_memory_allocated", flattening)
    monkeypatch.setattr(
        cuda,
        "memory_stats_as_nested_dict",
        lambda i: {
            "allocated_bytes": {"all": {"peak": 10 + i, "current": 1}},
            "reserved_bytes": {"all": {"peak": 20 + i, "current": 2}},
        },
    )
    monkeypatch.setattr(cuda, "memory_allocated", lambda i: -5)  # nonsense becomes None

    def no_props(i: int) -> Any:
        raise RuntimeError("CUDA error: device-side assert")

    monkeypatch.setattr(cuda, "get_device_properties", no_props)
    assert backend.is_available() is True
    assert (backend.device_count(), backend.current_device()) == (2, 1)
    event = backend.record_event(1)
    assert isinstance(event, _FakeTorchEvent) and event.stream == "stream1"
    # Inside a CUDA graph capture no event is recorded (it would join the graph).
    capturing[0] = True
    assert backend.record_event(1) is None
    capturing[0] = False
    backend.reset_peak_memory_stats(1)
    assert calls == [("reset", 1)]
    assert (backend.max_memory_allocated(1), backend.max_memory_reserved(1)) == (11, 21)
    assert backend.memory_allocated(1) is None
    assert backend.total_memory(1) is None
