"""The rank suites run twice: with the step timer's C core and with its Python methods."""

from __future__ import annotations

import pytest

from traceml_ai.rank import _timing

CORE_METHODS = ("begin", "end", "open", "close", "restart", "add_host", "_add_host")


@pytest.fixture(params=["c", "python"], autouse=True)
def timer_core(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``c``: StepTimer as built (``_hotpath.TimerCore`` under its Python methods);
    ``python``: its per-call methods and in-flight phases the pure-Python ones
    (``_PyTimerCore``, ``_PyOpen``), as without the extension."""
    if request.param == "c":
        if _timing.StepTimer.open is _timing._PyTimerCore.open:
            pytest.fail("traceml_ai.rank._hotpath was not built or is disabled")
        return "c"
    for name in CORE_METHODS:
        monkeypatch.setattr(_timing.StepTimer, name, getattr(_timing._PyTimerCore, name))
    monkeypatch.setattr(_timing, "_Open", _timing._PyOpen)
    return "python"
