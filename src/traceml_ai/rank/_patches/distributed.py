"""The ``torch.distributed`` patches: its collective functions, ``batch_isend_irecv``
and ``Work.wait``, each handed to the active recorder of the step's collectives
(``rank._collectives.recorder``; :func:`activate`), and passed straight through while
there is none.

The functions are patched on ``torch.distributed`` and
``torch.distributed.distributed_c10d``, one wrapper per function whichever module names
it, so that user code, FSDP1 and FSDP2 (``fully_shard``) calls are timed. DDP's buckets
are timed through its communication hook (``ddp``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

from traceml_ai.rank._collectives.recorder import CallSpec, CollectiveRecorder

__all__ = ["OP_OF_FUNCTION", "activate", "active", "install"]

_perf_ns = time.perf_counter_ns

OP_OF_FUNCTION: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather_coalesced": "all_gather",
    "all_gather_object": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "broadcast": "broadcast",
    "broadcast_object_list": "broadcast",
    "_broadcast_coalesced": "broadcast",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
    "send": "send",
    "isend": "send",
    "send_object_list": "send",
    "recv": "recv",
    "irecv": "recv",
    "recv_object_list": "recv",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "reduce": "reduce",
    "gather": "gather",
    "gather_object": "gather",
    "scatter": "scatter",
    "scatter_object_list": "scatter",
}
"""The torch.distributed functions timed, and the operation each one is."""


_active: CollectiveRecorder | None = None
_installed = False


def activate(recorder: CollectiveRecorder | None) -> None:
    """Make ``recorder`` the one the patches report to (None: they only pass through)."""
    global _active
    _active = recorder


def active() -> CollectiveRecorder | None:
    """The recorder the patches report to."""
    return _active


def _timed(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    op = OP_OF_FUNCTION[name]
    spec = CallSpec(name, original)

    def collective(*args: Any, **kwargs: Any) -> Any:
        recorder = _active
        if recorder is None:
            return original(*args, **kwargs)
        return recorder.call(original, op, spec, args, kwargs)

    collective.__wrapped__ = original  # type: ignore[attr-defined]
    collective.__name__ = getattr(original, "__name__", name)
    collective.__qualname__ = getattr(original, "__qualname__", name)
    collective.__doc__ = getattr(original, "__doc__", None)
    collective.__traceml_collective__ = True  # type: ignore[attr-defined]
    return collective


def _timed_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    def batch_isend_irecv(*args: Any, **kwargs: Any) -> Any:
        recorder = _active
        if recorder is None:
            return original(*args, **kwargs)
        return recorder.batch(original, args, kwargs)

    functools.update_wrapper(batch_isend_irecv, original)
    batch_isend_irecv.__traceml_collective__ = True  # type: ignore[attr-defined]
    return batch_isend_irecv


def _timed_wait(original: Callable[..., Any]) -> Callable[..., Any]:
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        recorder = _active
        if recorder is None or not recorder.awaits_waits():
            return original(self, *args, **kwargs)
        t0 = _perf_ns()
        try:
            return original(self, *args, **kwargs)
        finally:
            recorder.waited(self, _perf_ns() - t0)

    wait.__wrapped__ = original  # type: ignore[attr-defined]
    wait.__traceml_collective__ = True  # type: ignore[attr-defined]
    return wait


def install(dist: Any) -> None:
    """Patch ``torch.distributed``'s collectives and ``Work.wait`` (once per process;
    the patches pass through without a recorder)."""
    global _installed
    if _installed:
        return
    _installed = True
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    # One wrapper per function, whichever module names it: torch compares them by
    # identity (``P2POp(dist.isend, ...)`` against distributed_c10d's ``isend``).
    made: dict[int, Callable[..., Any]] = {}
    for module in (dist, c10d):
        if module is None:
            continue
        for name in (*OP_OF_FUNCTION, "batch_isend_irecv"):
            original = getattr(module, name, None)
            if original is None or getattr(original, "__traceml_collective__", False):
                continue
            with contextlib.suppress(Exception):
                wrapper = made.get(id(original))
                if wrapper is None:
                    if name == "batch_isend_irecv":
                        wrapper = _timed_batch(original)
                    else:
                        wrapper = _timed(name, original)
                    made[id(original)] = wrapper
                setattr(module, name, wrapper)
    work_class = getattr(dist, "Work", None)
    if work_class is not None and not getattr(work_class.wait, "__traceml_collective__", False):
        with contextlib.suppress(Exception):
            work_class.wait = _timed_wait(work_class.wait)
