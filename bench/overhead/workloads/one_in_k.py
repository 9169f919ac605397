"""One optimizer update in ``k`` traced under the zero-code attach, for the benches.

The framework integrations open and close a traced step per optimizer update through
``traceml_ai.integrations._common.StepDriver``. :func:`trace_one_in` changes that
class, in this process only, so that after each traced update the ``k - 1`` next ones
run untraced with TraceML's hooks off (from the end of the traced update to the end
of the last untraced one): traced and untraced updates take turns inside one
``train()``/``fit()``, and their difference is TraceML's cost, free of the drift
between separate runs. The product has no such switch; this is the bench's own.
"""

from __future__ import annotations

from typing import Any


def trace_one_in(k: int) -> None:
    """Trace one update in ``k`` (``k`` < 2: every update, nothing changed)."""
    if k < 2:
        return
    from traceml_ai.integrations._common import StepDriver
    from traceml_ai.rank._patches import phase_hooks

    if getattr(StepDriver, "_bench_one_in", None) is not None:
        StepDriver._bench_one_in = k  # type: ignore[attr-defined]
        return
    traced_begin = StepDriver.begin
    traced_end = StepDriver.end
    traced_abandon = StepDriver.abandon

    def state(driver: Any) -> dict[str, Any]:
        # Per driver: the current update runs untraced, how many more are to, and the
        # timer the end of the last traced update took off (for the last untraced one).
        found: dict[str, Any] | None = driver.__dict__.get("_bench_alternation")
        if found is None:
            found = driver.__dict__["_bench_alternation"] = {
                "untraced": False,
                "left": 0,
                "paused": None,
            }
        return found

    def resume_traced(driver: Any) -> None:
        s = state(driver)
        s["untraced"], s["left"] = False, 0
        timer, s["paused"] = s["paused"], None
        if timer is not None and timer.enabled and phase_hooks._ACTIVE is None:
            phase_hooks.activate(timer)

    def begin(self: Any, model: object | None) -> bool:
        s = state(self)
        if self.current is not None or s["untraced"]:
            return False
        if s["left"]:
            s["untraced"] = True
            return True
        return bool(traced_begin(self, model))

    def end(self: Any, exc: BaseException | None = None) -> None:
        s = state(self)
        if s["untraced"]:
            s["untraced"] = False
            s["left"] -= 1
            if s["left"] <= 0:
                resume_traced(self)
            return
        closing = self.current is not None
        traced_end(self, exc)
        if closing:
            # The next updates (their DataLoader fetches included) run with hooks off.
            s["left"] = StepDriver._bench_one_in - 1  # type: ignore[attr-defined]
            timer = phase_hooks._ACTIVE
            if timer is not None:
                s["paused"] = timer
                phase_hooks.activate(None)

    def abandon(self: Any) -> None:
        traced_abandon(self)
        if state(self)["paused"] is not None:
            resume_traced(self)

    def is_open(self: Any) -> bool:
        return self.current is not None or bool(state(self)["untraced"])

    StepDriver._bench_one_in = k  # type: ignore[attr-defined]
    StepDriver.begin = begin  # type: ignore[method-assign]
    StepDriver.end = end  # type: ignore[method-assign]
    StepDriver.abandon = abandon  # type: ignore[method-assign]
    StepDriver.open = property(is_open)  # type: ignore[method-assign,assignment]
