"""The rank's collectives: what each step's ``collectives`` items say, where each
collective is attributed, and the NCCL path (a fake Work: no GPU here)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import traceml_ai as traceml
from tests.e2e_helpers import free_port, run_cli
from tests.traceml_ai.rank.conftest import once
from traceml_ai.rank import StepTimer
from traceml_ai.rank._collectives import recorder as collective_recorder
from traceml_ai.rank._patches import ddp as ddp_patches
from traceml_ai.rank._patches import distributed
from traceml_ai.rank._runtime import sdk
from traceml_ai.rank.sink import RecordingSink
from traceml_records.internal import WIRE_STREAMS

P = "_traceml_internal:"


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A real gloo process group of one rank (collectives run, and return at once)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    traceml.shutdown()


def _start() -> RecordingSink:
    sdk.reset_for_tests()  # step numbers from 1
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    dist.init_process_group("gloo", rank=0, world_size=1)
    return sink


def _items(sink: RecordingSink) -> list[dict[str, Any]]:
    items = sink.items("collectives")
    for item in items:
        assert set(item) == WIRE_STREAMS["collectives"].item_keys
    return items


def test_calls_are_attributed_to_their_phase_and_step(world_of_one: None) -> None:
    sink = _start()
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = torch.ones(3)
    dist.all_reduce(t)  # before the first step: between steps of step 1
    for _ in range(3):
        with traceml.trace_step(model):
            loss = model(torch.randn(2, 4)).sum()
            loss.backward()
            with traceml.trace_phase("sync_metrics"):
                dist.all_reduce(t)
                dist.broadcast(t, src=0)
            dist.barrier()  # inside the step, outside every timed phase
            opt.step()
            opt.zero_grad()
    traceml.shutdown()
    items = _items(sink)
    by_step: dict[int, set[tuple[str, str, int]]] = {}
    for item in items:
        by_step.setdefault(item["step"], set()).add((item["phase"], item["op"], item["n_calls"]))
        assert item["source"] == "torch.distributed"
        assert item["backend"] == "gloo"
        assert item["wait_measure"] == "host" and item["wait_ms"] >= 0.0
        assert 0.0 <= item["first_arrival_ms"] <= item["last_arrival_ms"]
    assert by_step[1] == {
        (P + "between_steps", "all_reduce", 1),
        ("sync_metrics", "all_reduce", 1),
        ("sync_metrics", "broadcast", 1),
        (P + "step_time", "barrier", 1),
    }
    assert by_step[2] == by_step[3] == by_step[1] - {(P + "between_steps", "all_reduce", 1)}
    # seq goes up by one per item.
    assert [i["seq"] for i in items] == list(range(len(items)))


def test_a_blocking_call_counts_its_time_and_arrival(world_of_one: None) -> None:
    sink = _start()
    model = nn.Linear(4, 4)
    original = distributed.OP_OF_FUNCTION  # the functions are patched on dist itself
    assert getattr(dist.all_reduce, "__traceml_collective__", False), original
    with traceml.trace_step(model):
        time.sleep(0.02)
        dist.all_reduce(torch.ones(2))
    traceml.shutdown()
    (item,) = _items(sink)
    assert item["first_arrival_ms"] >= 19.0  # 20 ms after the step began
    assert item["wait_ms"] < 20.0


def test_ddp_buckets_through_the_default_hook_and_a_users_hook(world_of_one: None) -> None:
    sink = _start()
    plain = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    hooked = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    calls: list[int] = []

    def my_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls.append(1)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    hooked.register_comm_hook(None, my_hook)
    for model in (plain, hooked):
        for _ in range(2):
            with traceml.trace_step(model):
                model(torch.randn(2, 4)).sum().backward()
    traceml.shutdown()
    items = _items(sink)
    ddp = [i for i in items if i["source"] == "ddp_comm_hook"]
    assert [i["step"] for i in ddp] == [1, 2, 3, 4]
    assert {(i["phase"], i["op"]) for i in ddp} == {(P + "backward_time", "all_reduce")}
    assert all(i["wait_measure"] == "host" and i["wait_ms"] >= 0.0 for i in ddp)
    assert len(calls) == 2  # the user's hook still runs, once per bucket
    # The default hook's arithmetic is DDP's: a world of one leaves gradients as they are.
    model = nn.Linear(4, 4)
    reference = nn.parallel.DistributedDataParallel(model)
    x = torch.randn(2, 4)
    reference(x).sum().backward()
    expected = model.weight.grad.clone()  # type: ignore[union-attr]
    model.weight.grad = None
    nn.Linear.forward(model, x).sum().backward()
    assert torch.allclose(expected, model.weight.grad)  # type: ignore[arg-type]


def test_other_threads_and_nested_calls_count_once(world_of_one: None) -> None:
    sink = _start()
    model = nn.Linear(4, 4)
    with traceml.trace_step(model):
        # all_gather_object runs an all_gather (and more) inside: one call.
        out: list[Any] = [None]
        dist.all_gather_object(out, {"a": 1})
        thread = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1)))
        thread.start()
        thread.join()
    traceml.shutdown()
    items = _items(sink)
    assert [(i["op"], i["n_calls"]) for i in items] == [("all_gather", 1)]


def test_a_discarded_step_drops_its_collectives(world_of_one: None) -> None:
    sink = _start()
    model = nn.Linear(4, 4)
    with pytest.raises(RuntimeError), traceml.trace_step(model):
        dist.all_reduce(torch.ones(1))
        raise RuntimeError("boom")
    with traceml.trace_step(model):
        dist.broadcast(torch.ones(1), src=0)
    traceml.shutdown()
    assert [(i["step"], i["op"]) for i in _items(sink)] == [(1, "broadcast")]


def test_without_traceml_the_patches_pass_through(world_of_one: None) -> None:
    _start()
    traceml.shutdown()
    assert distributed.active() is None
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0]


def _nccl_recorder() -> tuple[RecordingSink, collective_recorder.CollectiveRecorder]:
    """TraceML started, its collective timing told the backend is NCCL."""
    sdk.reset_for_tests()
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    recorder = distributed.active()
    assert recorder is not None
    recorder._backend_known = True
    recorder._backend = "nccl"
    recorder._device_timing = True
    return sink, recorder


class _FakeNcclWork:
    """A Work as NCCL's with TORCH_NCCL_ENABLE_TIMING: done later, a kernel duration."""

    def __init__(self, ms: float | None) -> None:
        self.ms = ms
        self.done = False
        self.waited = 0

    def wait(self, timeout: Any = None) -> bool:
        self.waited += 1  # NCCL's wait() makes the stream wait; the host goes on
        return True

    def is_completed(self) -> bool:
        return self.done

    def _get_duration(self) -> float:
        if self.ms is None:
            raise RuntimeError("timing is not enabled")
        return self.ms


def test_nccl_path_reads_work_durations_once_completed() -> None:
    """On NCCL a synchronous call is issued asynchronously and waited (as torch does),
    nothing synchronizes the device, and the step's items wait until its Works
    completed; a Work without timing gives wait_ms null."""
    sink, _ = _nccl_recorder()
    try:
        works = [_FakeNcclWork(4.5), _FakeNcclWork(None)]
        seen: list[dict[str, Any]] = []

        def fake_all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False):
            seen.append({"async_op": async_op})
            return works[len(seen) - 1] if async_op else None

        timed = distributed._timed("all_reduce", fake_all_reduce)
        model = nn.Linear(2, 2)
        with traceml.trace_step(model):
            assert timed(torch.ones(1)) is None  # synchronous for the caller
        with traceml.trace_step(model):
            timed(torch.ones(1), async_op=True)
        assert seen == [{"async_op": True}, {"async_op": True}]
        assert works[0].waited == 1 and works[1].waited == 0
        # Shutdown sends what waits, wait_ms null where a Work has not completed
        # (the first) or has no timing (the second).
    finally:
        traceml.shutdown()
    items = sink.items("collectives")
    assert [(i["step"], i["wait_measure"], i["wait_ms"]) for i in items] == [
        (1, "none", None),
        (2, "none", None),
    ]


def test_nccl_items_wait_for_their_works() -> None:
    sink, recorder = _nccl_recorder()
    try:
        work = _FakeNcclWork(2.25)
        timed = distributed._timed(
            "all_reduce", lambda tensor, op=None, group=None, async_op=False: work
        )
        model = nn.Linear(2, 2)
        with traceml.trace_step(model):
            timed(torch.ones(1), async_op=True)
        with traceml.trace_step(model):
            pass
        recorder._timer.build_ended()
        assert sink.items("collectives") == []  # its Work is still running
        work.done = True
        with traceml.trace_step(model):
            pass
        recorder._timer.build_ended()
    finally:
        traceml.shutdown()
    (item,) = sink.items("collectives")
    assert (item["step"], item["wait_measure"], item["wait_ms"]) == (1, "device", 2.25)


@once  # a child's environment
def test_traceml_run_turns_nccl_timing_on_unless_set(tmp_path: Any) -> None:
    script = tmp_path / "env.py"
    script.write_text(
        "import os, sys\n"
        "open(sys.argv[1], 'w').write(os.environ.get('TORCH_NCCL_ENABLE_TIMING', '-'))\n"
    )
    for preset, expected in ((None, "1"), ("0", "0")):
        out = tmp_path / "seen.txt"
        env = {"TORCH_NCCL_ENABLE_TIMING": preset} if preset is not None else None
        res = run_cli(["run", "--logs-dir", tmp_path / "logs", script, out], cwd=tmp_path, env=env)
        assert res.returncode == 0, res.stderr
        assert out.read_text() == expected


def test_a_hook_registered_after_the_first_forward_still_runs(world_of_one: None) -> None:
    """DDP takes one hook per model, and TraceML's went in at the first forward: a hook
    the script registers later (DDP alone would raise) runs from then on, timed; a
    built-in one runs as its Python twin."""
    sink = _start()
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    with traceml.trace_step(model):
        model(torch.randn(2, 4)).sum().backward()
    calls: list[int] = []

    def late_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls.append(state)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model.register_comm_hook(7, late_hook)
    with traceml.trace_step(model):
        model(torch.randn(2, 4)).sum().backward()
    assert calls == [7]
    other = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    other(torch.randn(2, 4))  # TraceML's hook goes in
    other._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    with traceml.trace_step(other):
        other(torch.randn(2, 4)).sum().backward()
    assert other.module.weight.grad is not None
    traceml.shutdown()
    ddp = [(i["step"], i["source"]) for i in _items(sink) if i["op"] == "all_reduce"]
    assert ddp == [(1, "ddp_comm_hook"), (2, "ddp_comm_hook"), (3, "ddp_comm_hook")]


def test_an_internal_error_stops_the_timing_and_never_the_collective(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = _start()

    def broken(self: Any) -> tuple[int, str]:
        raise RuntimeError("boom")

    monkeypatch.setattr(StepTimer, "phase_now", broken)
    model = nn.Linear(2, 2)
    t = torch.ones(3)
    failed = r"collective timing failed .*boom.*training continue"
    with pytest.warns(Warning, match=failed), traceml.trace_step(model):
        dist.all_reduce(t)  # the first call learns the backend: the slow path
    assert t.tolist() == [1.0, 1.0, 1.0]
    recorder = distributed.active()
    assert recorder is not None and recorder.enabled is False
    with traceml.trace_step(model):
        dist.all_reduce(t)
    traceml.shutdown()
    assert _items(sink) == []
    # The steps were still timed.
    assert [i["step"] for i in sink.items("step_time")] == [1, 2]


def test_collectives_with_no_step_ending_are_bounded_and_said_once(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop of collectives outside any traced step keeps the newest few, and says so
    once, instead of holding every one until a step ends."""
    monkeypatch.setattr(collective_recorder, "MAX_OPEN_CALLS", 4)
    sink = _start()
    t = torch.ones(1)
    with pytest.warns(Warning, match="more than 4 collectives issued while no traced step"):
        for _ in range(10):
            dist.all_reduce(t)
    recorder = distributed.active()
    assert recorder is not None and recorder.dropped == 6
    with traceml.trace_step(nn.Linear(1, 1)):
        pass
    traceml.shutdown()
    (item,) = _items(sink)
    assert (item["step"], item["phase"], item["n_calls"]) == (1, P + "between_steps", 4)


def test_fake_nccl_work_names_what_torch_work_has() -> None:
    """The NCCL fake above reads the duration by the name torch's Work has: a fake
    with a name torch lacks would pass here and read nothing on a GPU."""
    import torch.distributed as dist

    fake = {name for name in vars(_FakeNcclWork) if not name.startswith("__")} - {"ms"}
    assert fake <= set(dir(dist.Work)), fake - set(dir(dist.Work))
    assert collective_recorder._device_ms(_completed_fake(2.5)) == 2.5


def _completed_fake(ms: float) -> _FakeNcclWork:
    work = _FakeNcclWork(ms)
    work.done = True
    return work


def _bucket_hook_on_another_thread(model: nn.Module) -> list[Any]:
    """One step whose backward runs DDP's traced hook on a second thread, as CUDA's
    autograd engine does on its device thread while the training thread waits."""

    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        result = dist.all_reduce(torch.ones(1), async_op=True)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(torch.ones(1))
        return fut if result is None else result.get_future()

    traced = ddp_patches._wrap_hook(hook)
    done: list[Any] = []

    def on_grad(grad: torch.Tensor) -> torch.Tensor:
        thread = threading.Thread(target=lambda: done.append(traced(None, None).wait()))
        thread.start()
        thread.join()
        return grad

    with traceml.trace_step(model):
        out = model(torch.randn(2, 4))
        out.register_hook(on_grad)
        out.sum().backward()
    return done


def test_ddp_bucket_on_autograds_thread_counts(world_of_one: None) -> None:
    sink = _start()
    model = nn.Linear(4, 4)
    assert len(_bucket_hook_on_another_thread(model)) == 1
    traceml.shutdown()
    (item,) = _items(sink)
    assert (item["phase"], item["op"], item["source"]) == (
        P + "backward_time",
        "all_reduce",
        "ddp_comm_hook",
    )
    assert item["wait_measure"] == "host" and item["wait_ms"] is not None


def test_nccl_ddp_bucket_on_autograds_thread_counts(world_of_one: None) -> None:
    sink, _ = _nccl_recorder()
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        assert len(_bucket_hook_on_another_thread(nn.Linear(4, 4))) == 1
    finally:
        traceml.shutdown()
    (item,) = sink.items("collectives")
    assert (item["phase"], item["op"], item["source"]) == (
        P + "backward_time",
        "all_reduce",
        "ddp_comm_hook",
    )


def test_nccl_call_without_a_work_counts_host_time() -> None:
    """A collective that waits in C++ and returns no Work (DDP's parameter broadcast
    when a model is wrapped), and one called with async_op=False, on NCCL."""
    sink, _ = _nccl_recorder()
    try:
        work = _FakeNcclWork(1.5)
        work.done = True
        asked: list[bool] = []

        def fake_all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False):
            asked.append(async_op)
            return work if async_op else None

        def fake_broadcast_coalesced(group: Any, tensors: Any, size: int, src: int = 0) -> None:
            time.sleep(0.005)

        reduce = distributed._timed("all_reduce", fake_all_reduce)
        coalesced = distributed._timed("_broadcast_coalesced", fake_broadcast_coalesced)
        model = nn.Linear(2, 2)
        with traceml.trace_step(model):
            coalesced(None, [], 1)
            assert reduce(torch.ones(1), async_op=False) is None
    finally:
        traceml.shutdown()
    assert asked == [True]  # issued asynchronously, then waited
    got = {i["op"]: (i["wait_measure"], i["wait_ms"]) for i in sink.items("collectives")}
    assert got["all_reduce"] == ("device", 1.5)
    measure, ms = got["broadcast"]
    assert measure == "host" and ms >= 4.0
