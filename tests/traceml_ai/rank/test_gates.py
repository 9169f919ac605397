"""The torch patches' fast path (``hotpath.FastPatch``): each does its patch's common
case in C and hands every other call to the patch's Python wrapper, which defines the
behaviour. Runs over both timer cores (conftest): with ``python``, fast patches are off
and every call goes to the wrapper, so each behavioural test here holds the two paths to
the same outcome."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.traceml_ai.rank.conftest import needs_c
from traceml_ai.rank._patches import phase_hooks
from traceml_ai.rank._timing import event_names, step_timer
from traceml_ai.rank._timing import timer_core as timer_core_module
from traceml_ai.rank.sink import RecordingSink
from traceml_ai.testing import FakeCuda


@pytest.fixture
def timer() -> Iterator[step_timer.StepTimer]:
    phase_hooks.install_patches(torch)
    timer = step_timer.StepTimer(RecordingSink(), FakeCuda(available=False), print, print)
    phase_hooks.activate(timer)
    yield timer
    phase_hooks.activate(None)


def _events(timer: step_timer.StepTimer) -> list[dict[str, Any]]:
    return [item["events"] for item in timer._sink.items("step_time")]  # type: ignore[attr-defined]


@needs_c
def test_the_patches_are_gates_over_their_python_wrappers() -> None:
    phase_hooks.install_patches(torch)
    from traceml_ai.rank._patches import wrappers

    wrappers.install_h2d_patch(torch)
    loader_iter = torch.utils.data.dataloader._BaseDataLoaderIter
    for patched, name in (
        (torch.autograd.backward, "backward"),
        (loader_iter.__dict__["__next__"], "__next__"),
        (torch.Tensor.__dict__["to"], "to"),
        (torch.Tensor.__dict__["cuda"], "cuda"),
    ):
        assert type(patched) is timer_core_module.HOTPATH.FastPatch, name
        assert patched.__name__ == name
        assert callable(patched.slow) and patched.slow is not patched.original
        assert patched.__wrapped__ is patched.original
    assert torch.autograd.backward.__traceml_wrapped__ is True


def test_a_gate_is_a_method_of_its_class() -> None:
    phase_hooks.install_patches(torch)
    from traceml_ai.rank._patches import wrappers

    wrappers.install_h2d_patch(torch)
    t = torch.zeros(2)
    bound = t.to
    assert bound.__self__ is t
    assert bound(torch.float64).dtype == torch.float64
    assert torch.Tensor.to(t, torch.float64).dtype == torch.float64
    assert torch.Tensor.to is torch.Tensor.__dict__["to"]
    with pytest.raises((RuntimeError, TypeError)):
        t.to("no-such-device")


@needs_c
def test_dispatch_of_a_gate(timer: step_timer.StepTimer, timer_core: str) -> None:
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def original(*args: Any, **kwargs: Any) -> str:
        calls.append(("original", args, kwargs))
        return "original"

    def slow(*args: Any, **kwargs: Any) -> str:
        calls.append(("slow", args, kwargs))
        return "slow"

    gate = timer_core_module.fast_patch(timer_core_module.PATCH_OUTSIDE_STEP, original, slow)
    assert gate(1, 2, key=3) == ("slow" if timer_core == "python" else "original")
    assert calls[-1][1:] == ((1, 2), {"key": 3})  # passed on as they came
    timer.begin(None)
    assert gate(4) == "slow"  # inside a step: the wrapper decides
    timer.end()
    phase_hooks.activate(None)
    assert gate() == ("slow" if timer_core == "python" else "original")
    with pytest.raises(ValueError):
        timer_core_module.HOTPATH.FastPatch(7, original, slow)


def test_dataloader_waits_are_timed_and_the_end_of_an_epoch_is_not(
    timer: step_timer.StepTimer,
) -> None:
    loader = DataLoader(TensorDataset(torch.zeros(3, 2)), batch_size=2)
    fetched = 0
    with pytest.raises(StopIteration):
        iterator = iter(loader)
        while True:
            next(iterator)
            fetched += 1
    assert fetched == 2
    timer.begin(None)
    timer.end()
    (events,) = _events(timer)
    assert events[event_names.DATALOADER_NEXT]["cpu"]["n_calls"] == 2
    timer.auto_dataloader = False
    next(iter(loader))
    timer.begin(None)
    timer.end()
    assert event_names.DATALOADER_NEXT not in _events(timer)[1]


def test_backward_is_timed_in_steps_only_and_its_errors_propagate(
    timer: step_timer.StepTimer,
) -> None:
    w = torch.ones(2, requires_grad=True)
    (w * 2).sum().backward()  # outside a step: untimed
    timer.begin(None)
    (w * 2).sum().backward()
    torch.autograd.backward((w * 3).sum())
    with pytest.raises(RuntimeError):
        torch.zeros(1).backward()  # no grad_fn: torch's own error, unchanged
    timer.end()
    (events,) = _events(timer)
    assert events[event_names.BACKWARD]["cpu"]["n_calls"] == 3
    assert timer.bwd.depth == 0
    timer.auto_backward = False
    timer.begin(None)
    (w * 2).sum().backward()
    timer.end()
    assert event_names.BACKWARD not in _events(timer)[1]


def test_the_backward_wrapper_steps_aside_while_compiling(
    timer: step_timer.StepTimer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What torch.compile's tracer runs: the Python wrapper (it cannot trace into the
    C gate, which therefore only ever runs eagerly)."""
    monkeypatch.setattr(phase_hooks, "_is_compiling", lambda: True)
    wrapper = getattr(torch.autograd.backward, "slow", torch.autograd.backward)
    w = torch.ones(2, requires_grad=True)
    timer.begin(None)
    wrapper((w * 2).sum())
    timer.end()
    assert event_names.BACKWARD not in _events(timer)[0]


def test_h2d_on_cpu_adds_no_phase(timer: step_timer.StepTimer) -> None:
    from traceml_ai.rank._patches import wrappers

    wrappers.install_h2d_patch(torch)
    t = torch.zeros(2)
    timer.begin(None)
    assert t.to(torch.device("cpu")) is t
    assert t.to("cpu", non_blocking=True) is t
    assert t.to(torch.float64).dtype == torch.float64
    timer.end()
    assert event_names.H2D not in _events(timer)[0]
