"""The rank suites run twice: with the step timer's C core and with its Python methods."""

from __future__ import annotations

import pytest

from traceml_ai.integrations import _common
from traceml_ai.rank import _sdk, _timing

CORE_METHODS = ("begin", "end", "open", "close", "restart", "add_host", "_add_host")


@pytest.fixture(params=["c", "python"], autouse=True)
def timer_core(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``c``: StepTimer as built (``_hotpath.TimerCore`` under its Python methods) and
    ``_hotpath.StepContext``; ``python``: its per-step and per-call methods, in-flight
    phases and step context the pure-Python ones (``_PyTimerCore``, ``_PyOpen``,
    ``_PyStepContext``) and the patches' Python wrappers (no ``_hotpath.Gate``), as
    without the extension."""
    if request.param == "c":
        if _timing.StepContext is _timing._PyStepContext:
            pytest.fail("traceml_ai.rank._hotpath was not built or is disabled")
        return "c"
    for name in CORE_METHODS:
        monkeypatch.setattr(_timing.StepTimer, name, getattr(_timing._PyTimerCore, name))
    monkeypatch.setattr(_timing, "_Open", _timing._PyOpen)
    for module in (_timing, _sdk, _common):
        monkeypatch.setattr(module, "StepContext", _timing._PyStepContext)
    # The patches' gates hand every call to their Python wrappers.
    _timing._HOTPATH.set_gates(False)
    request.addfinalizer(lambda: _timing._HOTPATH.set_gates(True))
    return "python"
