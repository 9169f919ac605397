"""The step timer's core, in C or in Python: the one place in the rank that chooses.

Two C extensions serve the rank's hot path, each loaded through
``traceml_records.internal.load_extension`` (``TRACEML_PURE_PYTHON=1`` refuses them):

- ``traceml_ai.rank._timing.hotpath`` (``hotpath.c``, interface ``hotpath.pyi``): the step
  timer's per-call methods (``TimerCore``), its in-flight phases (``Slot``), the step
  context (``StepContext``) and the torch patches' common case (``FastPatch``). Its
  pure-Python twin is ``hotpath_py``, which defines the behaviour.
- ``traceml_records._speedups``: the encoder of a host-timed step's two wire items,
  which :class:`~traceml_ai.rank._timing.step_timer.StepTimer` otherwise builds as dicts.

An extension that is not built, or built from other sources than these modules (its
``configure`` refuses them), leaves everything in Python.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import orjson

from traceml_ai.rank._timing import hotpath_py
from traceml_ai.rank._timing.event_names import BACKWARD, DATALOADER_NEXT, FORWARD, STEP_TIME
from traceml_records import internal as _records


def _load_hotpath() -> ModuleType | None:
    """``traceml_ai.rank._timing.hotpath``, configured, or None: not built, disabled, or built
    from other sources than ``hotpath_py`` (then everything runs in Python)."""
    hotpath = _records.load_extension("traceml_ai.rank._timing.hotpath")
    if hotpath is None:
        return None
    try:
        hotpath.configure(hotpath_py.TimerCore, hotpath_py.Phase, STEP_TIME)
        for name in ("TimerCore", "Slot", "StepContext", "FastPatch"):
            getattr(hotpath, name)
    except Exception:
        return None
    return hotpath


HOTPATH = _load_hotpath()
"""The C extension, configured, or None (the pure-Python twin alone)."""


def _chosen_classes() -> tuple[type[hotpath_py.TimerCore], type[Any], type[Any]]:
    if HOTPATH is None:
        return hotpath_py.TimerCore, hotpath_py.Slot, hotpath_py.StepContext
    # The C methods first; the Python ones are what they hand other cases to.
    core = type("TimerCore", (HOTPATH.TimerCore, hotpath_py.TimerCore), {})
    return core, HOTPATH.Slot, HOTPATH.StepContext


if TYPE_CHECKING:
    TimerCore = hotpath_py.TimerCore
    Slot = hotpath_py.Slot
    StepContext = hotpath_py.StepContext
else:
    TimerCore, Slot, StepContext = _chosen_classes()


# -- the torch patches' common case ------------------------------------------------

# The kinds of FastPatch: what a patch does in C before it hands a call to its Python
# wrapper (see hotpath.c).
PATCH_OUTSIDE_STEP = 0
PATCH_DATALOADER = 1
PATCH_BACKWARD = 2

_fast_patch: Callable[..., Any] | None = None


def read_active_timer_from(namespace: dict[str, Any]) -> None:
    """Where fast patches read the timer hooks report to: ``namespace["_ACTIVE"]``, the
    torch patches' module globals (a dict read, as the Python hooks read it). Until
    this is called, or without the extension, a patch is its Python wrapper."""
    global _fast_patch
    if HOTPATH is None:
        return
    try:
        HOTPATH.configure_fast_patches(namespace, DATALOADER_NEXT, FORWARD, BACKWARD)
    except Exception:
        return
    _fast_patch = HOTPATH.FastPatch


def fast_patch(kind: int, original: Callable[..., Any], slow: Callable[..., Any]) -> Any:
    """What a patch puts in place of ``original``: ``slow``, its Python wrapper, which
    defines what it does; with the extension, a ``hotpath.FastPatch`` that does the
    common case of ``kind`` in C (no frame, the call's arguments passed on as they
    came) and hands every other call to ``slow``. A method of the class it is put in,
    as ``original`` was."""
    make = _fast_patch
    if make is None:
        return slow
    patch = make(kind, original, slow)
    functools.update_wrapper(patch, original)
    return patch


# -- a host-timed step's items, encoded --------------------------------------------


def _load_host_step_encoders() -> tuple[Callable[..., Any] | None, Callable[..., Any] | None]:
    """The C encoder of a host-timed step's two items and its loop over the ended
    steps (their signatures: traceml_records/_speedups.pyi), or (None, None): Python
    builds the items as dicts."""
    speedups = _records.load_extension()
    if speedups is None:
        return None, None
    try:
        speedups.configure_host_step(hotpath_py.Phase, orjson.dumps)
        encode: Callable[..., Any] = speedups.encode_host_step
        encode_run: Callable[..., Any] = speedups.encode_host_steps
    except Exception:  # an extension built from other sources: Python's path
        return None, None
    return encode, encode_run


# encode_host_step(acc, step, ts, device, seq_time, seq_mem): the bytes
# wire.encode_item gives for the two items StepTimer._send_host_items builds (None: a
# case it leaves to Python), with the phases zeroed as _send_host_items zeroes them.
# encode_host_steps(encode, ended, ended_at, spare, seq_time, seq_mem): the builder's
# loop over the ended steps, calling ``encode`` for each (in C: the loop is a large
# part of the builder's work per step).
encode_host_step, encode_host_steps = _load_host_step_encoders()
