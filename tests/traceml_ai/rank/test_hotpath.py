"""The step timer's C core (``traceml_ai.rank._timing.hotpath``) against its Python methods.

``TimerCore`` does the common case of ``open``/``close``/``restart``/``add_host`` in C
and hands every other case to ``hotpath_py.TimerCore``, which defines the behaviour.
Here both take the same calls and must end in the same state; the rest of the rank
suites run over both (conftest.py).
"""

from __future__ import annotations

import ast
import gc
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.traceml_ai.rank.conftest import CORE_METHODS, PURE_PYTHON, once
from traceml_ai.rank._timing import event_names, hotpath_py, step_timer
from traceml_ai.rank._timing import timer_core as timer_core_module
from traceml_ai.rank.sink import RecordingSink
from traceml_ai.testing import FakeCuda


@pytest.fixture
def timer_core() -> str:
    """This module compares the two cores itself (no run per core)."""
    if PURE_PYTHON:
        pytest.skip("TRACEML_PURE_PYTHON is set: there is no C core to compare")
    return "c"


class _PythonTimer(step_timer.StepTimer):
    """A StepTimer on the pure-Python methods and phases, as without the extension."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.fwd, self.bwd, self.opt, self.h2d = (hotpath_py.Slot() for _ in range(4))
        self.hooked = (self.fwd, self.opt)


for _name in CORE_METHODS:
    setattr(_PythonTimer, _name, getattr(hotpath_py.TimerCore, _name))


def _pair(cuda: Any = None, defer: bool = False) -> list[step_timer.StepTimer]:
    timers: list[step_timer.StepTimer] = []
    for cls in (step_timer.StepTimer, _PythonTimer):
        backend = cuda() if cuda is not None else FakeCuda(available=False)
        timer = cls(RecordingSink(), backend, lambda m: None, lambda e: None)
        timer.defer = defer
        timers.append(timer)
    return timers


class _Tensor:
    """A model's tensor whose device the test moves (``get_device``: -1 on CPU)."""

    def __init__(self) -> None:
        self.device = SimpleNamespace(type="cpu", index=None)

    def get_device(self) -> int:
        return -1 if self.device.type == "cpu" else 0


class _Model:
    def __init__(self, tensors: int) -> None:
        self.tensors = [_Tensor() for _ in range(tensors)]

    def parameters(self) -> Any:
        return iter(self.tensors)

    def buffers(self) -> Any:
        return iter(())


def _models() -> list[Any]:
    return [None, _Model(0), _Model(1), _Model(2)]


def test_the_core_is_built_and_used() -> None:
    timer = _pair()[0]
    assert type(timer.fwd).__name__ == "Slot"
    assert step_timer.StepTimer.open is not hotpath_py.TimerCore.open
    slot = step_timer.Slot()
    assert (slot.depth, slot.t0, slot.ev0, slot.auto) == (0, 0, None, True)
    with pytest.raises(TypeError):
        slot.auto = 1  # type: ignore[assignment]  # a bool, as the timer's setters give
    timer.auto_forward = 0  # type: ignore[assignment]
    assert timer.fwd.auto is False


def _state(timer: step_timer.StepTimer) -> tuple[Any, ...]:
    phases = {name: (p.n_calls, p.missing, len(p.pairs)) for name, p in timer._acc.items()}
    depths = tuple(s.depth for s in (timer.fwd, timer.bwd, timer.opt, timer.h2d))
    ended = [(step, device) for step, _, device in timer._ended_at]
    return (
        timer.in_step, timer.enabled, timer.step, timer.device, timer.cuda_index, depths,
        phases, ended, len(timer._spare_acc), len(timer._pending),
    )  # fmt: skip


def _items(timer: step_timer.StepTimer) -> list[Any]:
    sink = timer._sink
    assert isinstance(sink, RecordingSink)
    out = []
    for stream, item in zip(sink.streams(), sink.items(), strict=True):
        if stream == "step_time":
            events: Any = item["events"]
            item = {
                **item,
                "events": {
                    k: {d: (t["n_calls"], t["is_gpu"]) for d, t in v.items()}
                    for k, v in events.items()
                },
            }
        out.append((stream, {k: v for k, v in item.items() if k != "timestamp_unix_ns"}))
    return out


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("begin"), st.integers(0, 3)),
        st.tuples(st.just("move"), st.integers(2, 3)),
        st.tuples(st.just("build")),
        st.tuples(st.just("end")),
        st.tuples(st.sampled_from(["open", "restart"]), st.integers(0, 3)),
        st.tuples(st.just("close"), st.integers(0, 3), st.sampled_from(["a", "b", "fwd"])),
        st.tuples(
            st.just("add_host"),
            st.sampled_from(["a", "dl", event_names.STEP_TIME]),
            st.one_of(st.integers(0, 10**6), st.just(2**64), st.just(-5)),
        ),
        st.tuples(st.just("other_thread"), st.integers(0, 3)),
    ),
    max_size=40,
)


def _apply(timer: step_timer.StepTimer, op: tuple[Any, ...], models: list[Any]) -> None:
    slots = (timer.fwd, timer.bwd, timer.opt, timer.h2d)
    kind = op[0]
    if kind == "begin":
        if not timer.in_step:
            timer.begin(models[op[1]])
    elif kind == "move":  # the model's first tensor goes to the other device
        device = models[op[1]].tensors[0].device
        device.type = "cuda" if device.type == "cpu" else "cpu"
    elif kind == "build":
        timer.build_ended()
    elif kind == "end":
        if timer.in_step:
            timer.end()
    elif kind == "open":
        timer.open(slots[op[1]])
    elif kind == "restart":
        timer.restart(slots[op[1]])
    elif kind == "close":
        timer.close(slots[op[1]], op[2])
    elif kind == "add_host":
        timer.add_host(op[1], op[2])
    else:  # calls from another thread are ignored
        thread = threading.Thread(target=timer.open, args=(slots[op[1]],))
        thread.start()
        thread.join()
        thread = threading.Thread(target=timer.add_host, args=("a", 1))
        thread.start()
        thread.join()


# The C fast paths: a model's later steps, left to the builder; a model whose tensor
# moved between two steps (its device is found again).
_MOVED = [("begin", 2), ("end",), ("move", 2), ("begin", 2), ("end",), ("build",)]


@given(ops=OPS, cuda=st.booleans(), defer=st.booleans())
@example(ops=[("begin", 1), ("open", 0), ("close", 0, "a"), ("end",)] * 3, cuda=False, defer=True)
@example(ops=_MOVED, cuda=False, defer=True)
@example(ops=_MOVED, cuda=True, defer=False)
def test_c_and_python_cores_end_in_the_same_state(
    ops: list[tuple[Any, ...]], cuda: bool, defer: bool
) -> None:
    """The same calls, off CUDA and on a (fake) CUDA device, steps built inline or
    left to a builder, models that stay or move: the C core hands every case but the
    common one to Python, so both end alike."""
    pair = _pair((lambda: FakeCuda(1, auto_complete=True)) if cuda else None, defer)
    models = [_models() for _ in pair]
    for timer in pair:
        timer._current_device()
    for op in ops:
        for timer, own in zip(pair, models, strict=True):
            _apply(timer, op, own)
        assert _state(pair[0]) == _state(pair[1]), op
    for timer in pair:
        timer.drain(sync=True)
    assert _items(pair[0]) == _items(pair[1])


def test_an_error_in_a_handed_over_case_stops_the_timer_once() -> None:
    """A failure inside the work of close/add_host (here a phase dict that raises) is
    what the Python method does with it: fail(exc), training goes on."""

    class Broken(dict[str, Any]):
        def get(self, *args: Any) -> Any:
            raise RuntimeError("broken phases")

    for timer in _pair():
        errors: list[BaseException] = []
        timer._on_error = errors.append
        timer.begin(None)
        timer._acc = Broken()
        timer.open(timer.fwd)
        timer.close(timer.fwd, "forward")  # returns; the timer is off
        assert not timer.enabled and len(errors) == 1
        assert isinstance(errors[0], RuntimeError)
        timer.add_host("a", 1)  # on the thread still; off, raises nothing
        assert len(errors) <= 2


def test_counts_past_64_bits_go_on_in_python() -> None:
    for timer in _pair():
        timer.add_host("a", 2**63 - 1)
        timer.add_host("a", 10)
        timer.add_host("a", 2**70)
        assert timer._acc["a"].cpu_ns == 2**63 - 1 + 10 + 2**70
        assert timer._acc["a"].n_calls == 3


def test_a_timer_in_a_reference_cycle_is_collected() -> None:
    timer = _pair()[0]
    timer.cycle = timer  # type: ignore[attr-defined]
    timer._acc["a"] = hotpath_py.Phase()
    ref = weakref.ref(timer)
    del timer
    gc.collect()
    assert ref() is None


@once  # a child without the extension
def test_without_the_extension_the_timer_is_pure_python() -> None:
    code = (
        "from traceml_ai.rank._timing import hotpath_py as py, step_timer as t, timer_core as c;"
        "assert c.HOTPATH is None and c.fast_patch(0, len, print) is print;"
        "assert t.StepTimer.__mro__[1] is py.TimerCore and t.Slot is py.Slot;"
        "assert t.StepContext is py.StepContext and t._encode_host_step is None;"
        "from traceml_ai.rank.sink import RecordingSink;"
        "from traceml_ai.testing import FakeCuda;"
        "s = RecordingSink(); tm = t.StepTimer(s, FakeCuda(available=False), print, print);"
        "tm.begin(None); tm.open(tm.fwd); tm.close(tm.fwd, 'f'); tm.end();"
        "print(sorted(s.items('step_time')[0]['events']))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TRACEML_PURE_PYTHON": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == str(sorted(["f", event_names.STEP_TIME]))


CONTEXTS = [step_timer.StepContext, hotpath_py.StepContext]


@pytest.mark.parametrize("context", CONTEXTS, ids=["c", "python"])
def test_a_step_context_begins_ends_and_discards(context: Any) -> None:
    timer = _pair()[0]
    with context(timer, None):
        assert timer.in_step
        with context(timer, None):  # nested: the outer step is measured
            pass
        assert timer.in_step
    assert not timer.in_step and timer.step == 1
    with pytest.raises(ZeroDivisionError), context(timer, None):
        1 / 0  # noqa: B018 - the body's exception propagates; the step is discarded
    assert timer.step == 1 and not timer.in_step
    assert [item["step"] for item in timer._sink.items("step_time")] == [1]  # type: ignore[attr-defined]
    step = context(timer, None)
    assert step.reusable_for(timer, None) and not step.reusable_for(None, None)
    assert not step.reusable_for(timer, object())
    with step:
        assert not step.reusable_for(timer, None)  # in use


@pytest.mark.parametrize("context", CONTEXTS, ids=["c", "python"])
@pytest.mark.parametrize("where", ["begin", "end", "discard"])
def test_a_step_context_whose_timer_raises_stops_the_timer(context: Any, where: str) -> None:
    timer = _pair()[0]
    errors: list[BaseException] = []
    timer._on_error = errors.append

    def broken(*args: Any) -> None:
        raise RuntimeError(where)

    setattr(timer, where, broken)
    body_ran = False
    try:
        with context(timer, None):
            body_ran = True
            if where == "discard":
                raise KeyError("the body's own")
    except KeyError:
        assert where == "discard"  # still the body's exception, unchanged
    assert body_ran and not timer.enabled
    assert [str(e) for e in errors] == [where]
    with context(timer, None):  # off now: a no-op
        pass
    assert len(errors) == 1


@pytest.mark.parametrize("context", CONTEXTS, ids=["c", "python"])
def test_a_keyboard_interrupt_in_the_timer_propagates(context: Any) -> None:
    timer = _pair()[0]

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    timer.begin = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt), context(timer, None):
        pass
    assert timer.enabled


def test_an_extension_built_from_other_sources_leaves_everything_in_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stale build whose configure() refuses this module's classes: the timer
    runs in Python rather than failing at import."""

    class Stale:
        TimerCore = Slot = StepContext = object

        @staticmethod
        def configure(*args: Any) -> None:
            raise TypeError("the phase class has no slot cpu_ns")

    monkeypatch.setattr(timer_core_module._records, "load_extension", lambda name="": Stale)
    assert timer_core_module._load_hotpath() is None


def _stub_classes() -> dict[str, set[str]]:
    """Each class of ``hotpath.pyi`` and the public methods it declares."""
    tree = ast.parse((Path(timer_core_module.__file__).parent / "hotpath.pyi").read_text())
    return {
        node.name: {
            item.name
            for item in node.body
            if isinstance(item, ast.FunctionDef)
            and (not item.name.startswith("_") or item.name in ("__enter__", "__exit__"))
        }
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }


def test_the_pure_twin_and_the_c_core_offer_the_methods_of_the_stub() -> None:
    """``hotpath.pyi`` is the interface of both: every class it declares that the twin
    defines has the same public methods in C and in ``hotpath_py`` (in Python a
    ``FastPatch`` is its slow wrapper itself, so the twin has no such class)."""
    stubs = _stub_classes()
    assert {"TimerCore", "Slot", "StepContext", "FastPatch"} <= set(stubs)
    hotpath = timer_core_module.HOTPATH
    assert hotpath is not None, "traceml_ai.rank._timing.hotpath was not built"
    twins = {name for name in stubs if hasattr(hotpath_py, name)}
    assert twins == set(stubs) - {"FastPatch"}
    for name, methods in stubs.items():
        built = getattr(hotpath, name)
        public = {m for m in dir(built) if not m.startswith("_")}
        assert methods - {"__enter__", "__exit__"} <= public, name
        assert all(callable(getattr(built, m)) for m in methods), name
        if name not in twins:
            continue
        twin = getattr(hotpath_py, name)
        defined = {
            m
            for m, value in vars(twin).items()
            if callable(value) and (not m.startswith("_") or m in ("__enter__", "__exit__"))
        }
        assert defined == methods, name
        # Nothing public of the C class that the stub does not declare (data aside).
        c_methods = {m for m in public if callable(getattr(built, m, None))}
        assert c_methods == {m for m in methods if not m.startswith("_")}, name
    for function in ("configure", "configure_fast_patches", "set_fast_patches"):
        assert callable(getattr(hotpath, function))
