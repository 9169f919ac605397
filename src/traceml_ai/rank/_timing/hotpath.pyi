"""traceml_ai.rank._timing.hotpath, the C extension built from hotpath.c: its interface.

hotpath_py.py defines the same classes in Python (the behaviour: the C methods hand
every case but the common one to it); timer_core.py chooses between the two.
tests/traceml_ai/rank/test_hotpath.py reads this file to hold the two to the same
public methods.
"""

from collections.abc import Callable
from types import TracebackType
from typing import Any

class Slot:
    """An in-flight hook-timed phase; ``depth`` keeps nested calls from counting twice."""

    depth: int
    t0: int
    ev0: Any
    auto: bool
    def __init__(self) -> None: ...

class TimerCore:
    """The step timer's per-step and per-call methods; the base of ``StepTimer``."""

    in_step: bool
    enabled: bool
    defer: bool
    auto_backward: bool
    auto_dataloader: bool
    bracket: bool
    bracket_optimizer: bool
    thread: int
    step: int
    cuda_index: int | None
    fwd: Slot
    bwd: Slot
    opt: Slot
    h2d: Slot
    device: str
    wake_builder: Callable[[], None] | None
    def open(self, slot: Slot) -> None: ...
    def close(self, slot: Slot, name: str) -> None: ...
    def restart(self, slot: Slot) -> None: ...
    def add_host(self, name: str, dt_ns: int) -> None: ...
    def begin(self, model: object | None) -> None: ...
    def end(self) -> None: ...
    def _add_host(self, name: str, dt_ns: int) -> None: ...

class StepContext:
    """``with trace_step(model):`` — one traced step; exceptions propagate unchanged."""

    def __init__(self, timer: TimerCore, model: object | None) -> None: ...
    def reusable_for(self, timer: TimerCore | None, model: object | None) -> bool: ...
    def __enter__(self) -> None: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

class FastPatch:
    """``FastPatch(kind, original, slow)``: what a torch patch puts in place of
    ``original``; its common case (by ``kind``) in C, every other call to ``slow``, the
    patch's Python wrapper. A method of the class it is put in, as ``original`` was."""

    original: Callable[..., Any]
    slow: Callable[..., Any]
    kind: int
    def __init__(
        self, kind: int, original: Callable[..., Any], slow: Callable[..., Any]
    ) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

def configure(py_core_class: type, phase_class: type, step_time_name: str, /) -> None:
    """The Python methods every case but the common one is handed to, the phase class
    whose counts are added to, and the name of the step's own phase."""

def configure_fast_patches(
    active_namespace: dict[str, Any], dataloader: str, forward: str, backward: str, /
) -> None:
    """Where the fast patches read the active timer (``active_namespace["_ACTIVE"]``),
    and the names of the phases they time."""

def set_fast_patches(on: bool, /) -> None:
    """False hands every fast patch's call to its Python wrapper (tests)."""
