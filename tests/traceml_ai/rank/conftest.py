"""The rank suites run twice: with the step timer's C core and with its Python methods."""

from __future__ import annotations

import os

import pytest

from traceml_ai.integrations import _common
from traceml_ai.rank._runtime import sdk
from traceml_ai.rank._timing import hotpath_py, step_timer
from traceml_ai.rank._timing import timer_core as timer_core_module
from traceml_records.internal import PURE_PYTHON_ENV

CORE_METHODS = ("begin", "end", "open", "close", "restart", "add_host", "_add_host")

PURE_PYTHON = os.environ.get(PURE_PYTHON_ENV, "").strip() not in ("", "0")
needs_c = pytest.mark.skipif(PURE_PYTHON, reason=f"{PURE_PYTHON_ENV} is set: no C extension")
"""For a test of a C extension itself (it fails, rather than skips, when one was not
built: CI builds them, and a silent fallback would leave the C path untested)."""


AS_BUILT = "as-built"

once = pytest.mark.parametrize("timer_core", [AS_BUILT], indirect=True)
"""For a test that the swap of this process's timer core changes nothing for (its steps
are timed in a child process, or it times none): it runs once, with the core as built,
rather than twice the same way. On a test or as a module's ``pytestmark``."""


@pytest.fixture(params=["c", "python"], autouse=True)
def timer_core(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``c``: StepTimer as built (``hotpath.TimerCore`` under its Python methods) and
    ``hotpath.StepContext``; ``python``: its per-step and per-call methods, in-flight
    phases and step context the pure-Python twins (``hotpath_py``) and the patches'
    Python wrappers (no ``hotpath.FastPatch``), as without the extension.
    Under ``TRACEML_PURE_PYTHON=1`` only the ``python`` run takes place. A test marked
    :data:`once` runs once, ``as-built``: nothing swapped."""
    hotpath = timer_core_module.HOTPATH
    if request.param == AS_BUILT:
        return AS_BUILT
    if request.param == "c":
        if hotpath is None:
            if PURE_PYTHON:
                pytest.skip(f"{PURE_PYTHON_ENV} is set: the pure-Python run only")
            pytest.fail("traceml_ai.rank._timing.hotpath was not built")
        return "c"
    for name in CORE_METHODS:
        monkeypatch.setattr(step_timer.StepTimer, name, getattr(hotpath_py.TimerCore, name))
    monkeypatch.setattr(step_timer, "Slot", hotpath_py.Slot)
    for module in (step_timer, sdk, _common):
        monkeypatch.setattr(module, "StepContext", hotpath_py.StepContext)
    if hotpath is not None:
        # The fast patches hand every call to their Python wrappers.
        hotpath.set_fast_patches(False)
        request.addfinalizer(lambda: hotpath.set_fast_patches(True))
    return "python"
