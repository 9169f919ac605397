"""Rank SDK: step timing on real tiny CPU training, DDP on a one-process gloo group,
CUDA timing through a fake backend (no GPU exists in CI), identity and no-op mode."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, TensorDataset

import traceml_ai as traceml
from tests.e2e_helpers import REPO
from tests.rank_helpers import ENV_VARS, make_loader, make_model, step_items
from tests.traceml_ai.rank.conftest import once
from traceml_ai.rank._patches import phase_hooks
from traceml_ai.rank._runtime import connect, sdk
from traceml_ai.rank._timing import step_timer
from traceml_ai.rank.identity import RankIdentity
from traceml_ai.rank.runtime_env import model_strategy, runtime_environment_item, topology_of
from traceml_ai.rank.sink import RecordingSink
from traceml_ai.testing import FakeCuda

INTERNAL = (
    "_traceml_internal:backward_time",
    "_traceml_internal:dataloader_next",
    "_traceml_internal:forward_time",
    "_traceml_internal:optimizer_step",
    "_traceml_internal:step_time",
)
FWD, BWD, OPT, DL, STEP = (
    "_traceml_internal:forward_time",
    "_traceml_internal:backward_time",
    "_traceml_internal:optimizer_step",
    "_traceml_internal:dataloader_next",
    "_traceml_internal:step_time",
)
WIRE_DOC = REPO / "docs" / "dev" / "wire-format.md"


def wire_keys(stream: str) -> tuple[set[str], list[str]]:
    """Item keys of ``stream`` from the wire-format doc's table, and its nested ``{...}`` keys."""
    for line in WIRE_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] == f"`{stream}`":
            tokens = re.findall(r"`([^`]+)`", cells[1])
            nested = [t for t in tokens if t.startswith("{")]
            inner = [k.strip() for k in nested[0].strip("{}").split(",")] if nested else []
            return {t for t in tokens if not t.startswith("{")}, inner
    raise AssertionError(f"{stream} not in {WIRE_DOC}")


STEP_TIME_KEYS, TIMING_KEYS = wire_keys("step_time")
STEP_MEMORY_KEYS, _ = wire_keys("step_memory")
RUNTIME_ENV_KEYS, _ = wire_keys("runtime_environment")


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    sdk.reset_for_tests()
    yield
    sdk.reset_for_tests()


def train(model: torch.nn.Module, steps: int, *, phase: bool = True) -> None:
    """A real training loop over a real DataLoader, each step traced."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in make_loader(steps):
        with traceml.trace_step(model):
            if phase:
                with traceml.trace_phase("loss"):
                    loss = torch.nn.functional.mse_loss(model(x), y)
            else:
                loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()


def check_timing(timing: dict[str, Any], *, gpu: bool = False) -> None:
    assert list(timing) == TIMING_KEYS == ["cpu_ms", "duration_ms", "gpu_ms", "is_gpu", "n_calls"]
    assert isinstance(timing["cpu_ms"], float) and timing["cpu_ms"] >= 0
    assert math.isfinite(timing["cpu_ms"]) and math.isfinite(timing["duration_ms"])
    assert isinstance(timing["n_calls"], int) and timing["n_calls"] >= 1
    if timing["is_gpu"]:
        assert gpu
        assert timing["duration_ms"] == timing["gpu_ms"]
    else:
        assert timing["duration_ms"] == timing["cpu_ms"]
        if not gpu:
            assert timing["gpu_ms"] is None


# -- CPU training -----------------------------------------------------------------


def test_cpu_training_records_every_step_with_all_phases() -> None:
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    train(make_model(), 5)
    traceml.shutdown()

    items = step_items(sink)
    assert [i["step"] for i in items] == [1, 2, 3, 4, 5]
    assert [i["seq"] for i in items] == [0, 1, 2, 3, 4]
    for item in items:
        # ``tokens`` only on the lines of steps that said theirs (none here).
        assert set(item) == STEP_TIME_KEYS - {"tokens"}
        events = item["events"]
        assert list(events) == sorted(events)
        assert set(events) == {*INTERNAL, "loss"}
        for name, per_device in events.items():
            assert list(per_device) == ["cpu"], name
            check_timing(per_device["cpu"])
        # One batch was fetched before each step, one forward/backward/optimizer step in it.
        for name in (DL, FWD, BWD, OPT, STEP, "loss"):
            assert events[name]["cpu"]["n_calls"] == 1, name
        # The step contains its phases (the DataLoader wait came before the block).
        inner = sum(events[n]["cpu"]["cpu_ms"] for n in (BWD, OPT, "loss"))
        assert events[STEP]["cpu"]["cpu_ms"] >= inner

    memory = sink.items("step_memory")
    assert [m["step"] for m in memory] == [1, 2, 3, 4, 5]
    assert [m["seq"] for m in memory] == [0, 1, 2, 3, 4]
    for m in memory:
        assert set(m) == STEP_MEMORY_KEYS
        assert m["device"] == "cpu"
        assert m["peak_allocated_bytes"] is None and m["peak_reserved_bytes"] is None
    assert [m["timestamp_unix_ns"] for m in memory] == [i["timestamp_unix_ns"] for i in items]


class _SlowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int, slow_index: int, delay_s: float) -> None:
        self.x = torch.randn(n, 8)
        self.y = torch.randn(n, 1)
        self.slow_index = slow_index
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.slow_index:
            time.sleep(self.delay_s)
        return self.x[i], self.y[i]


def test_dataloader_wait_goes_to_the_step_that_follows_it() -> None:
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    model = make_model()
    # Batches: 0 before step 1, 1 before step 2, 2 inside step 2, 3 before step 3
    # (it holds the slow item 6), 4 and 5 before step 4.
    loader = DataLoader(_SlowDataset(12, slow_index=6, delay_s=0.05), batch_size=2)
    it = iter(loader)
    for step in range(1, 5):
        x, _ = next(it)
        if step == 4:
            next(it)  # a skipped batch: two waits before step 4
        with traceml.trace_step(model):
            model(x).sum().backward()
            if step == 2:
                next(it)  # fetched inside a step: belongs to that step
    traceml.shutdown()

    events = {i["step"]: i["events"] for i in step_items(sink)}
    assert [events[s][DL]["cpu"]["n_calls"] for s in (1, 2, 3, 4)] == [1, 2, 1, 2]
    # sleep() guarantees at least this long, so this bound cannot flake.
    assert events[3][DL]["cpu"]["cpu_ms"] >= 50.0
    assert OPT not in events[1]  # no optimizer in this loop


def test_worker_process_dataloader_is_timed() -> None:
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    model = make_model()
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(12, 8), torch.randn(12, 1))
    loader = DataLoader(data, batch_size=4, num_workers=1)
    for x, _ in loader:
        with traceml.trace_step(model):
            model(x).sum().backward()
    traceml.shutdown()
    items = step_items(sink)
    assert [i["step"] for i in items] == [1, 2, 3]
    assert all(i["events"][DL]["cpu"]["n_calls"] == 1 for i in items)


def test_a_forked_child_turns_traceml_off_in_itself() -> None:
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only
        ok = sdk._runtime is None and phase_hooks.active() is None
        with traceml.trace_step(None):
            pass
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert phase_hooks.active() is not None  # the parent is unaffected


def test_user_phase_outside_a_step_counts_toward_the_next_step() -> None:
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    model = make_model()
    with traceml.trace_phase("prep"):
        pass
    with traceml.trace_phase("prep"):
        pass
    with traceml.trace_step(model):
        model(torch.randn(2, 8))
    with traceml.trace_step(model):
        model(torch.randn(2, 8))
    traceml.shutdown()
    first, second = step_items(sink)
    assert first["events"]["prep"]["cpu"]["n_calls"] == 2
    assert "prep" not in second["events"]
    assert set(second["events"]) == {FWD, STEP}


def test_trace_phase_rejects_reserved_and_empty_names() -> None:
    # Validated whether or not TraceML is on, so a script fails the same way everywhere.
    with pytest.raises(ValueError):
        traceml.trace_phase("")
    with pytest.raises(ValueError):
        traceml.trace_phase("_traceml_internal:forward_time")
    with pytest.raises(TypeError):
        traceml.trace_phase(3)  # type: ignore[arg-type]
    traceml.init(sink=RecordingSink(), sampler_interval=60)
    with pytest.raises(ValueError):
        traceml.trace_phase("_traceml_internal:mine")


def test_forward_called_twice_counts_two_calls_and_hooks_install_once() -> None:
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    model = make_model()
    for _ in range(3):
        with traceml.trace_step(model):
            model(torch.randn(2, 8))
            model(torch.randn(2, 8))
    traceml.shutdown()
    assert len(model._forward_pre_hooks) == 1
    assert len(model._forward_hooks) == 1
    for item in step_items(sink):
        assert item["events"][FWD]["cpu"]["n_calls"] == 2


def test_forward_outside_a_step_is_not_counted() -> None:
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    model = make_model()
    with traceml.trace_step(model):
        model(torch.randn(2, 8))
    model(torch.randn(2, 8)).sum().backward()  # e.g. evaluation outside the traced step
    with traceml.trace_step(model):
        pass
    traceml.shutdown()
    second = step_items(sink)[1]
    assert set(second["events"]) == {STEP}


def test_nested_trace_step_is_measured_once() -> None:
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    model = make_model()
    with traceml.trace_step(model), traceml.trace_step(model):
        model(torch.randn(2, 8))
    traceml.shutdown()
    (item,) = step_items(sink)
    assert item["step"] == 1
    assert item["events"][STEP]["cpu"]["n_calls"] == 1


class _Boom(Exception):
    pass


def test_exception_in_a_step_propagates_and_the_step_is_discarded() -> None:
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    model = make_model()
    error = _Boom("user code failed")
    with pytest.raises(_Boom) as raised, traceml.trace_step(model):
        model(torch.randn(2, 8))
        raise error
    assert raised.value is error
    with traceml.trace_step(model):
        model(torch.randn(2, 8)).sum().backward()
    traceml.shutdown()
    # As in TraceML 0.5.0 the failed step is not counted; its number goes to the next.
    (only,) = step_items(sink)
    assert only["step"] == 1 and set(only["events"]) == {FWD, BWD, STEP}
    assert [m["step"] for m in sink.items("step_memory")] == [1]


def test_exception_in_forward_closes_the_forward_phase() -> None:
    class Failing(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise _Boom("bad forward")

    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    model = Failing()
    with pytest.raises(_Boom), traceml.trace_step(model):
        model(torch.randn(2, 8))
    with pytest.raises(_Boom), traceml.trace_step(model):
        model(torch.randn(2, 8))
    good = make_model()
    with traceml.trace_step(good):
        good(torch.randn(2, 8))
    traceml.shutdown()
    (item,) = step_items(sink)
    # always_call hooks close the phase; depth does not leak into the next step.
    assert item["step"] == 1 and item["events"][FWD]["cpu"]["n_calls"] == 1


class _FailingSink(RecordingSink):
    def put(self, stream: str, item: dict[str, object]) -> None:
        if stream == "step_time":
            raise RuntimeError("sink broke")
        super().put(stream, item)


def test_internal_failure_warns_once_disables_timing_and_training_goes_on() -> None:
    sink = _FailingSink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traceml.init(sink=sink, sampler_interval=60)
        model = make_model()
        train(model, 4)
        traceml.shutdown()
    ours = [w for w in caught if issubclass(w.category, traceml.TraceMLWarning)]
    assert len(ours) == 1
    assert "step timing failed" in str(ours[0].message)
    # The failing put came after step 1's step_memory; nothing after that.
    assert [m["step"] for m in sink.items("step_memory")] == [1]
    assert phase_hooks.active() is None


# -- DDP on a one-process gloo group ---------------------------------------------


@pytest.fixture
def gloo_group(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_model_gives_the_same_events_and_a_ddp_runtime_environment(gloo_group: None) -> None:
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    ddp = DistributedDataParallel(make_model())
    train(ddp, 3)
    traceml.shutdown()

    items = step_items(sink)
    assert [i["step"] for i in items] == [1, 2, 3]
    for item in items:
        assert set(item["events"]) == {*INTERNAL, "loss"}
        assert item["events"][FWD]["cpu"]["n_calls"] == 1
        for per_device in item["events"].values():
            check_timing(per_device["cpu"])
    envs = sink.items("runtime_environment")
    assert all(set(e) == RUNTIME_ENV_KEYS for e in envs)
    assert [e["seq"] for e in envs] == list(range(len(envs)))
    last = envs[-1]
    assert last["training_strategy"] == "ddp"
    assert last["strategy_source"] == "runtime_model"
    assert last["strategy_confidence"] == "high"
    assert last["distributed_initialized"] is True
    assert last["distributed_backend"] == "gloo"
    assert last["topology"] == "single_process"


def test_ddp_inner_module_can_be_traced(gloo_group: None) -> None:
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    ddp = DistributedDataParallel(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for x, y in make_loader(3):
        with traceml.trace_step(ddp.module):
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    # Tracing the wrapper too must not count the nested forward twice.
    with traceml.trace_step(ddp):
        ddp(torch.randn(2, 8))
    traceml.shutdown()
    items = step_items(sink)
    assert len(items) == 4
    for item in items[:3]:
        assert set(item["events"]) == set(INTERNAL)
    for item in items:
        assert item["events"][FWD]["cpu"]["n_calls"] == 1
    # The plain inner module does not tell the strategy; the initialized group does.
    assert sink.items("runtime_environment")[-1]["training_strategy"] == "ddp"


# -- CUDA through a fake backend ---------------------------------------------------


def fake_cuda(*, gpu_keeps_up: bool = True) -> FakeCuda:
    """One GPU whose memory grows by one byte per forward (so each step has its own
    peak); the models are on CPU but count as on cuda:0 (no GPU in CI)."""
    return FakeCuda(auto_complete=gpu_keeps_up, total_memory=333, model_device=0)


def grow_memory_per_forward(model: torch.nn.Module, cuda: FakeCuda) -> None:
    cuda.allocate(0, 1000)
    model.register_forward_hook(lambda *_: cuda.allocate(0, 1))


def test_fake_cuda_gives_cuda_events_with_gpu_time() -> None:
    sink = RecordingSink()
    cuda = fake_cuda()
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    model = make_model()
    grow_memory_per_forward(model, cuda)
    train(model, 3)
    traceml.shutdown()

    items = step_items(sink)
    assert [i["step"] for i in items] == [1, 2, 3]
    for item in items:
        events = item["events"]
        assert set(events) == {*INTERNAL, "loss"}
        for name, per_device in events.items():
            assert list(per_device) == ["cuda:0"]
            timing = per_device["cuda:0"]
            check_timing(timing, gpu=True)
            if name in (DL, STEP):
                assert timing["is_gpu"] is False and timing["gpu_ms"] is None
            else:
                # Each start/end pair is one fake clock tick apart; "loss" encloses
                # the forward's two events, so it spans three.
                assert timing["is_gpu"] is True, name
                assert timing["gpu_ms"] == (3.0 if name == "loss" else 1.0), name
    assert cuda.resets == [0, 0, 0]
    memory = sink.items("step_memory")
    # Peaks since each step's reset: one more byte per step (reserved follows them up).
    assert [(m["device"], m["peak_allocated_bytes"], m["peak_reserved_bytes"]) for m in memory] == [
        ("cuda:0", 1001, 1001),
        ("cuda:0", 1002, 1002),
        ("cuda:0", 1003, 1003),
    ]
    # Resolved without waiting: nothing was synchronized.
    assert cuda.synchronize_calls == 0 and cuda.misuse == []
    proc = sink.items("process")[-1]
    assert proc["gpu_available"] is True
    assert (proc["gpu_count"], proc["gpu_device_index"]) == (1, 0)
    assert (proc["gpu_memory_used_bytes"], proc["gpu_memory_reserved_bytes"]) == (1003, 1003)
    assert proc["gpu_memory_total_bytes"] == 333


def test_fake_cuda_gpu_ms_is_null_when_one_call_lacked_a_measurement() -> None:
    sink = RecordingSink()
    cuda = fake_cuda()
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    model = make_model()
    with traceml.trace_step(model):
        model(torch.randn(2, 8))
        cuda.failing_records = {cuda.record_calls + 1}  # the next forward's start event fails
        model(torch.randn(2, 8))
        with traceml.trace_phase("tail"):
            pass
    traceml.shutdown()
    (item,) = step_items(sink)
    forward = item["events"][FWD]["cuda:0"]
    assert forward["n_calls"] == 2
    assert forward["gpu_ms"] is None and forward["is_gpu"] is False
    assert forward["duration_ms"] == forward["cpu_ms"]
    tail = item["events"]["tail"]["cuda:0"]
    assert tail["is_gpu"] is True and tail["gpu_ms"] == 1.0


def test_fake_cuda_non_finite_elapsed_time_becomes_null() -> None:
    sink = RecordingSink()
    cuda = fake_cuda()
    cuda.elapsed_override = float("nan")
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    model = make_model()
    with traceml.trace_step(model):
        model(torch.randn(2, 8))
    traceml.shutdown()
    forward = step_items(sink)[0]["events"][FWD]["cuda:0"]
    assert forward["gpu_ms"] is None and forward["is_gpu"] is False


def test_fake_cuda_steps_wait_for_their_events_without_blocking() -> None:
    sink = RecordingSink()
    cuda = fake_cuda(gpu_keeps_up=False)  # the GPU is "still running"
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    model = make_model()
    for _ in range(3):
        with traceml.trace_step(model):
            model(torch.randn(2, 8))
    # step_memory goes out at once; step_time waits for its events.
    assert [m["step"] for m in sink.items("step_memory")] == [1, 2, 3]
    assert step_items(sink) == []
    cuda.auto_complete = True
    cuda.finish_all()
    with traceml.trace_step(model):
        model(torch.randn(2, 8))
    assert [i["step"] for i in step_items(sink)] == [1, 2, 3, 4]
    cuda.auto_complete = False
    with traceml.trace_step(model):
        model(torch.randn(2, 8))
    assert len(step_items(sink)) == 4
    # Shutdown is the one place that waits for the GPU: it polls (never
    # Event.synchronize()) until the work completes, within one deadline.
    threading.Timer(0.2, cuda.finish_all).start()
    traceml.shutdown()
    items = step_items(sink)
    assert [i["step"] for i in items] == [1, 2, 3, 4, 5]
    assert [i["seq"] for i in items] == [0, 1, 2, 3, 4]
    assert items[-1]["events"][FWD]["cuda:0"]["gpu_ms"] == 1.0
    assert cuda.synchronize_calls == 0


def test_fake_cuda_backlog_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # This GPU never catches up: shutdown gives up on it after this wait, not 3 s.
    monkeypatch.setattr(step_timer, "SHUTDOWN_GPU_WAIT_S", 0.3)
    sink = RecordingSink()
    cuda = fake_cuda(gpu_keeps_up=False)
    traceml.init(sink=sink, sampler_interval=60, cuda_backend=cuda)
    model = make_model()
    total = step_timer.MAX_PENDING_STEPS + 5
    for _ in range(total):
        with traceml.trace_step(model):
            model(torch.randn(2, 8))
    items = step_items(sink)
    # Past the bound the oldest steps go out with gpu_ms null instead of waiting.
    assert [i["step"] for i in items] == [1, 2, 3, 4, 5]
    assert all(i["events"][FWD]["cuda:0"]["gpu_ms"] is None for i in items)
    traceml.shutdown()
    assert len(step_items(sink)) == total


# -- off mode, auto-init, transport -------------------------------------------------


def test_without_launcher_init_warns_once_and_every_call_is_a_no_op() -> None:
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # trace_step before init: auto-init, which finds no launcher.
        with traceml.trace_step(model):
            model(torch.randn(2, 8))
        traceml.init()
        traceml.init()
        for _ in range(3):
            with traceml.trace_step(model), traceml.trace_phase("x"):
                model(torch.randn(2, 8)).sum().backward()
        traceml.shutdown()
    ours = [w for w in caught if issubclass(w.category, traceml.TraceMLWarning)]
    assert len(ours) == 1
    assert "not launched by `traceml run`" in str(ours[0].message)
    assert sdk._runtime is None
    assert phase_hooks.active() is None
    assert len(model._forward_pre_hooks) == 0


def test_mode_off_is_silent_and_bad_mode_is_rejected() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traceml.init("off")
        with traceml.trace_step(None):
            pass
    assert not [w for w in caught if issubclass(w.category, traceml.TraceMLWarning)]
    assert sdk._runtime is None
    with pytest.raises(ValueError):
        traceml.init("sometimes")


@once  # the steps are timed in the child
def test_plain_python_script_runs_with_one_warning(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import traceml_ai as traceml

            traceml.init()
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                with traceml.trace_step(model):
                    with traceml.trace_phase("fwd"):
                        loss = model(torch.randn(2, 4)).sum()
                    loss.backward()
                    opt.step()
            traceml.shutdown()
            print("done")
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"
    assert result.stderr.count("TraceMLWarning") == 1, result.stderr
    assert "not launched by `traceml run`" in result.stderr


@once  # a child's imports
def test_import_does_not_import_torch() -> None:
    code = "import sys, traceml_ai; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_auto_init_under_traceml_run_sends_over_the_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from traceml_ai.transport.server import AggregatorServer

    received: list[Any] = []
    finished: list[dict[str, Any]] = []
    lock = threading.Lock()

    def on_batch(batch: Any) -> None:
        with lock:
            received.append(batch)

    server = AggregatorServer("127.0.0.1", 0, "tok", on_batch, finished.append)
    host, port = server.start()
    try:
        monkeypatch.setenv("TRACEML_AGGREGATOR_ADDR", f"{host}:{port}")
        monkeypatch.setenv("TRACEML_RUN_TOKEN", "tok")
        monkeypatch.setenv("TRACEML_SAMPLER_INTERVAL", "60")
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("NODE_RANK", "3")
        train(make_model(), 3)  # no init(): trace_step initializes
        traceml.shutdown()
        deadline = time.monotonic() + 10
        while not finished and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        server.stop()
    with lock:
        payloads = [
            orjson.loads(b.payload) if isinstance(b.payload, bytes) else b.payload for b in received
        ]
    steps = [i["step"] for p in payloads if p["stream"] == "step_time" for i in p["items"]]
    assert steps == [1, 2, 3]
    identity = payloads[0]["identity"]
    assert identity["node_rank"] == 3 and identity["global_rank"] == 0
    assert identity["pid"] == os.getpid()
    streams = {p["stream"] for p in payloads}
    assert {"step_time", "step_memory", "process", "system", "runtime_environment"} <= streams


def test_bad_aggregator_address_turns_export_off_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRACEML_AGGREGATOR_ADDR", "no-port-here")
    with pytest.warns(traceml.TraceMLWarning, match="could not start"):
        traceml.init()
    assert sdk._runtime is None
    with traceml.trace_step(None):
        pass


def test_parse_address() -> None:
    assert connect.parse_address("127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert connect.parse_address("[::1]:7") == ("::1", 7)
    for bad in ("host", ":80", "h:0", "h:70000", "h:x"):
        with pytest.raises(ValueError):
            connect.parse_address(bad)


# -- identity and runtime environment ---------------------------------------------


def test_identity_defaults_to_a_single_process() -> None:
    ident = RankIdentity.from_env({})
    wire = ident.to_wire()
    assert list(wire) == [
        "global_rank",
        "local_rank",
        "world_size",
        "local_world_size",
        "node_rank",
        "hostname",
        "pid",
    ]
    assert (wire["global_rank"], wire["local_rank"], wire["world_size"]) == (0, 0, 1)
    assert (wire["local_world_size"], wire["node_rank"]) == (1, 0)
    assert wire["pid"] == os.getpid()
    assert isinstance(wire["hostname"], str)


def test_identity_reads_torchrun_variables() -> None:
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "NODE_RANK": "9",
    }
    ident = RankIdentity.from_env(env)
    assert (ident.global_rank, ident.local_rank, ident.world_size) == (5, 1, 8)
    assert (ident.local_world_size, ident.node_rank) == (4, 1)
    del env["GROUP_RANK"]
    assert RankIdentity.from_env(env).node_rank == 9
    assert RankIdentity.from_env({"WORLD_SIZE": "zero", "RANK": "-1"}).world_size == 1
    assert RankIdentity.from_env({"RANK": "-1"}).global_rank == 0


def test_topology_and_strategy_rules() -> None:
    assert topology_of(1, 1) == "single_process"
    assert topology_of(4, 4) == "single_node_multi_process"
    assert topology_of(8, 4) == "multi_node"

    class FullyShardedDataParallel(torch.nn.Module):
        pass

    FullyShardedDataParallel.__module__ = "torch.distributed.fsdp.fully_sharded_data_parallel"
    assert model_strategy(FullyShardedDataParallel()) == "fsdp"
    assert model_strategy(make_model()) is None

    multi = RankIdentity(world_size=2, local_world_size=2, local_rank=1, global_rank=1)
    fields = runtime_environment_item(multi, None, timestamp_unix_ns=1, seq=0)
    assert fields["topology"] == "single_node_multi_process"
    assert fields["distributed_initialized"] is False and fields["distributed_backend"] is None
    assert (fields["training_strategy"], fields["strategy_confidence"]) == (
        "distributed_unknown",
        "low",
    )
    single = runtime_environment_item(RankIdentity(), None, timestamp_unix_ns=1, seq=0)
    assert (single["training_strategy"], single["strategy_source"]) == (
        "single_process",
        "topology",
    )
    assert single["torch_version"] == torch.__version__
    fsdp = runtime_environment_item(multi, "fsdp", timestamp_unix_ns=1, seq=0)
    assert (fsdp["training_strategy"], fsdp["strategy_source"]) == ("fsdp", "runtime_model")


def test_init_after_mode_off_stays_off_without_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    # An integration (Ray's trainer) turns TraceML off before the user's own init().
    monkeypatch.delenv("TRACEML_AGGREGATOR_ADDR", raising=False)
    traceml.init(mode="off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        traceml.init()
        with traceml.trace_step(None):
            pass
    traceml.shutdown()
