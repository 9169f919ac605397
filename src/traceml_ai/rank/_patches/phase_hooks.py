"""The torch patches and hooks that time a step's phases, and the timer they report to.

Forward (module hooks on the traced model), backward (``torch.autograd.backward``,
which ``Tensor.backward`` calls), the optimizer step (torch's global optimizer step
hooks) and the DataLoader wait (``_BaseDataLoaderIter.__next__``) are measured by
hooks and patches installed once per process. They report to the module-level
``_ACTIVE`` timer (:func:`activate`), so when TraceML is off or disabled each costs
one global lookup. With the C extension, the backward and DataLoader patches are
``hotpath.FastPatch`` objects, which read ``_ACTIVE`` from this module's globals
(``timer_core.read_active_timer_from``).

The timer does not import this module: :func:`activate` hands it :data:`HOOKS`, its
way to the hooks (a new model's forward hooked, itself released after an error).
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from traceml_ai.rank._timing.event_names import BACKWARD, DATALOADER_NEXT, FORWARD, OPTIMIZER_STEP
from traceml_ai.rank._timing.timer_core import (
    PATCH_BACKWARD,
    PATCH_DATALOADER,
    fast_patch,
    read_active_timer_from,
)

if TYPE_CHECKING:
    from traceml_ai.rank._timing.step_timer import StepTimer

_get_ident = threading.get_ident
_perf_ns = time.perf_counter_ns

_ACTIVE: StepTimer | None = None
"""The timer hooks report to (None: every hook returns at once)."""


def _never_compiling() -> bool:
    return False


# torch.compiler.is_dynamo_compiling once torch is patched (is_compiling on a torch
# without it): while dynamo traces a compiled module (model.compile() puts the hooks
# inside the compiled region) it is a constant True, so each hook returns at once and
# adds no graph break. In eager mode it is a bare ``return False``; is_compiling also
# calls torch.jit.is_scripting(), one more Python frame in every hook call.
_is_compiling: Callable[[], bool] = _never_compiling


_HOOKED: weakref.WeakSet[Any] = weakref.WeakSet()
_HOOKED_IDS: set[int] = set()
_patch_lock = threading.Lock()
_patched: set[str] = set()
# The handles of the global optimizer step hooks while torch holds them (empty while
# suspend_optimizer_hooks has them out, or before install_patches registers them).
_optimizer_hook_handles: list[Any] = []


def _phase_hooks(index: int, name: str) -> tuple[Callable[..., None], Callable[..., None]]:
    """The pre and post hooks of the phase whose slot is ``timer.hooked[index]``:
    ``timer.open(slot)`` / ``timer.close(slot, name)`` while it is timed. One template
    for the forward and the optimizer hooks; the third argument is the optimizer
    hooks' kwargs or the forward hook's output.
    """

    def pre_hook(owner: Any, args: Any, extra: Any = None) -> None:
        if _is_compiling():
            return
        timer = _ACTIVE
        if timer is None or not timer.in_step:
            return
        slot = timer.hooked[index]
        if slot.auto:
            timer.open(slot)

    def post_hook(owner: Any, args: Any, extra: Any = None) -> None:
        if _is_compiling():
            return
        timer = _ACTIVE
        if timer is None:
            return
        slot = timer.hooked[index]
        if slot.auto:
            timer.close(slot, name)

    return pre_hook, post_hook


_forward_pre_hook, _forward_hook = _phase_hooks(0, FORWARD)
_optimizer_pre_hook, _optimizer_post_hook = _phase_hooks(1, OPTIMIZER_STEP)


def forward_timed_elsewhere(model: object) -> None:
    """``model``'s forward is timed by a framework integration (Lightning brackets the
    ``training_step`` itself): never hook it. A module with hooks takes torch's slower
    ``_call_impl`` path on every call, traced or not, for a phase already measured."""
    try:
        _HOOKED.add(model)
    except TypeError:
        _HOOKED_IDS.add(id(model))


def install_model_hooks(model: object) -> None:
    """Hook the model's forward once per model object (a DDP wrapper is hooked itself)."""
    try:
        weakref.ref(model)
        weakable = True
    except TypeError:
        weakable = False
    if (model in _HOOKED) if weakable else (id(model) in _HOOKED_IDS):
        return
    pre = getattr(model, "register_forward_pre_hook", None)
    post = getattr(model, "register_forward_hook", None)
    if not callable(pre) or not callable(post):
        return
    pre(_forward_pre_hook)
    try:
        # always_call closes the phase even when forward raises.
        post(_forward_hook, always_call=True)
    except TypeError:
        post(_forward_hook)
    if weakable:
        _HOOKED.add(model)
    else:
        _HOOKED_IDS.add(id(model))


def _timed_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> Any:
        timer = _ACTIVE
        if timer is None or not timer.in_step or not timer.auto_backward or _is_compiling():
            return original(*args, **kwargs)
        if _get_ident() != timer.thread:
            # Another thread's backward (the timer ignores it): no phase of the
            # training thread's step is touched either.
            return original(*args, **kwargs)
        slot = timer.bwd
        if slot.depth:
            # Already open (a backward inside a backward hook): open/close of a nested
            # call would only count depth up and down again.
            return original(*args, **kwargs)
        bracket = timer.bracket
        if bracket and timer.fwd.depth:
            # Inner forward hooks close their own levels; one that did not (a forward
            # that raised without always_call) must not keep the phase open.
            timer.fwd.depth = 1
            timer.close(timer.fwd, FORWARD)
        timer.open(slot)
        try:
            return original(*args, **kwargs)
        finally:
            timer.close(slot, BACKWARD)
            if bracket:
                opt = timer.opt
                if timer.bracket_optimizer and not opt.depth and opt.auto:
                    timer.open(opt)
                else:
                    timer.restart(opt)

    gate: Callable[..., Any] = fast_patch(PATCH_BACKWARD, original, backward)
    gate.__traceml_wrapped__ = True  # type: ignore[attr-defined]
    return gate


def install_patches(
    torch: Any, *, backward: bool = True, optimizer: bool = True, dataloader: bool = True
) -> None:
    """Wrap ``torch.autograd.backward`` (which ``Tensor.backward`` calls) and the DataLoader iterator,
    and register global optimizer step hooks; each once per process.

    The keywords leave a patch out (``traceml.init(mode="manual"/"selective")``); one
    installed by an earlier ``init`` of the process stays.
    """
    global _is_compiling
    with _patch_lock:
        compiler = getattr(torch, "compiler", None)
        check = getattr(compiler, "is_dynamo_compiling", None)
        if not callable(check):
            check = getattr(compiler, "is_compiling", None)
        if callable(check):
            _is_compiling = check
        wanted = {
            name
            for name, on in (
                ("backward", backward),
                ("optimizer", optimizer),
                ("dataloader", dataloader),
            )
            if on and name not in _patched
        }
        if not wanted:
            return
        # Import every submodule first, so a failure leaves nothing half-installed.
        optim = importlib.import_module("torch.optim.optimizer")
        loader_module = importlib.import_module("torch.utils.data.dataloader")
        base = loader_module._BaseDataLoaderIter
        original_next = base.__next__
        _patched.update(wanted)

        if "backward" in wanted:
            # Tensor.backward calls torch.autograd.backward (looked up at each call),
            # so wrapping that one function times both, one Python call fewer a step.
            original = torch.autograd.backward
            if not getattr(original, "__traceml_wrapped__", False):
                torch.autograd.backward = _timed_backward(original)

        if "optimizer" in wanted:
            _register_optimizer_hooks(optim)

        if "dataloader" not in wanted:
            return

        @functools.wraps(original_next)
        def __next__(self: Any) -> Any:
            timer = _ACTIVE
            if timer is None or not timer.auto_dataloader:
                return original_next(self)
            t0 = _perf_ns()
            # Only fetches that returned a batch count; the StopIteration that
            # ends an epoch is not a wait for a batch.
            batch = original_next(self)
            timer.add_host(DATALOADER_NEXT, _perf_ns() - t0)
            return batch

        base.__next__ = fast_patch(PATCH_DATALOADER, original_next, __next__)


def _register_optimizer_hooks(optim: Any) -> None:
    # Caller holds _patch_lock.
    _optimizer_hook_handles.append(optim.register_optimizer_step_pre_hook(_optimizer_pre_hook))
    _optimizer_hook_handles.append(optim.register_optimizer_step_post_hook(_optimizer_post_hook))


def suspend_optimizer_hooks() -> bool:
    """Take the global optimizer step hooks out of torch, for a framework that times the
    optimizer phase itself (``StepTimer.bracket_optimizer``): torch then calls two
    Python functions fewer per update. Whether they were in (and are now out: undo
    with :func:`resume_optimizer_hooks`)."""
    with _patch_lock:
        if not _optimizer_hook_handles:
            return False
        for handle in _optimizer_hook_handles:
            handle.remove()
        _optimizer_hook_handles.clear()
        return True


def resume_optimizer_hooks() -> None:
    """Put back the hooks :func:`suspend_optimizer_hooks` took out (nothing if they are in)."""
    with _patch_lock:
        optim = sys.modules.get("torch.optim.optimizer")
        if _optimizer_hook_handles or "optimizer" not in _patched or optim is None:
            return
        _register_optimizer_hooks(optim)


class _Hooks:
    """These hooks as a timer sees them (``step_timer.TimerHooks``)."""

    def hook_model(self, model: object) -> None:
        install_model_hooks(model)

    def release(self, timer: object) -> None:
        if _ACTIVE is timer:
            activate(None)


HOOKS = _Hooks()
"""What :func:`activate` hands the timer: its way to these hooks."""


def activate(timer: StepTimer | None) -> None:
    """Make ``timer`` the one hooks report to (``None``: hooks do nothing)."""
    global _ACTIVE
    if timer is not None:
        timer.hooks = HOOKS
    _ACTIVE = timer


def active() -> StepTimer | None:
    """The timer hooks report to, if any."""
    return _ACTIVE


# The fast patches read _ACTIVE from here.
read_active_timer_from(globals())
