"""TraceML 0.5.0's ``wrap_*`` helpers and the host-to-device copy timing.

The wrappers time one object's calls into the same phases (and the same per-step
slots) as the automatic hooks, so a call that is both wrapped and hooked counts once:
unlike 0.5.0, wrapping something that is also timed automatically is harmless
instead of a ``RuntimeError``. Outside a traced step, and with TraceML off, every
wrapper passes straight through. A bad argument is one ``traceml:`` warning and the
object is returned unchanged: instrumentation never stops training.

Host-to-device time (``_traceml_internal:h2d_time``): in a traced step, a copy of a
CPU tensor to an accelerator with ``Tensor.to(...)`` or ``Tensor.cuda(...)`` is timed
(host time, and device time from CUDA events on a GPU run), as 0.5.0's ``patch_h2d``
does. Parameters are left out (``model.to(device)`` is not input movement).
"""

from __future__ import annotations

import functools
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

from traceml_ai.rank._init_config import env_disabled, warn_once
from traceml_ai.rank._patches import phase_hooks
from traceml_ai.rank._timing.event_names import (
    BACKWARD,
    DATALOADER_NEXT,
    FORWARD,
    H2D,
    OPTIMIZER_STEP,
)
from traceml_ai.rank._timing.step_timer import StepTimer
from traceml_ai.rank._timing.timer_core import PATCH_OUTSIDE_STEP, fast_patch

_perf_ns = time.perf_counter_ns

_ACCELERATORS = frozenset({"cuda", "xpu", "mps", "hpu", "npu", "xla", "privateuseone"})
"""Device types a copy to which counts as host-to-device (tests add ``meta``)."""

_h2d_lock = threading.Lock()
_h2d_installed = False
_auto_h2d = False
"""Whether the installed patch times copies now (off again under ``mode="manual"``)."""


def _device_type(value: Any) -> str | None:
    """The device type a ``.to(...)`` argument names, if it names one."""
    if isinstance(value, str):
        head = value.split(":", 1)[0].strip().lower()
        return head or None
    if isinstance(value, int) and not isinstance(value, bool):
        return "cuda"  # .to(0) is cuda:0, as torch reads it
    kind = getattr(value, "type", None)
    if isinstance(kind, str):
        return kind  # a torch.device
    device = getattr(value, "device", None)  # .to(other_tensor)
    kind = getattr(device, "type", None)
    return kind if isinstance(kind, str) else None


def _is_host_tensor(tensor: Any) -> bool:
    device = getattr(tensor, "device", None)
    if getattr(device, "type", None) != "cpu":
        return False
    # model.to(device) moves parameters; that is not the step's input movement.
    return type(tensor).__name__ != "Parameter"


_dtype_class: type | None = None
"""``torch.dtype``, once the patch is installed: ``.to(dtype)`` is answered by one type
check (a Hugging Face update makes ~35 ``.to`` calls)."""
_device_class: type | None = None
"""``torch.device``, once the patch is installed: ``.to(device)`` reads its ``type``
without another call (most of a Hugging Face update's ``.to`` calls name the
trainer's device)."""


def copies_to_accelerator(tensor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` copies a host tensor to an accelerator.

    The target is looked at first: it is cheaper than the tensor's device (a new
    ``torch.device`` per read), and most calls are casts that name no device.
    """
    target = kwargs.get("device") if kwargs else None
    if target is None:
        if not args:
            return False
        target = args[0]
    kind = type(target)
    if kind is _device_class:
        return target.type in _ACCELERATORS and _is_host_tensor(tensor)
    if kind is _dtype_class:
        return False
    return _device_type(target) in _ACCELERATORS and _is_host_tensor(tensor)


def _timed(timer: StepTimer, call: Callable[[], Any]) -> Any:
    slot = timer.h2d
    timer.open(slot)
    try:
        return call()
    finally:
        timer.close(slot, H2D)


def install_h2d_patch(torch: Any) -> None:
    """Wrap ``torch.Tensor.to`` and ``torch.Tensor.cuda`` once per process."""
    global _h2d_installed, _dtype_class, _device_class
    with _h2d_lock:
        if _h2d_installed:
            return
        _dtype_class = type(torch.float32)
        _device_class = torch.device
        tensor_cls = torch.Tensor
        original_to = tensor_cls.to
        original_cuda = tensor_cls.cuda

        @functools.wraps(original_to)
        def to(*args: Any, **kwargs: Any) -> Any:
            # (tensor, ...) taken as one tuple: the call passes it on as it came.
            timer = phase_hooks._ACTIVE
            if timer is None or not timer.in_step or not _auto_h2d:
                return original_to(*args, **kwargs)
            if len(args) > 1 and not kwargs:
                # copies_to_accelerator's first answers, inlined: a Hugging Face update
                # makes ~35 .to calls in its step, nearly all to the trainer's device
                # or a dtype.
                kind = type(args[1])
                if kind is _dtype_class or (
                    kind is _device_class and args[1].type not in _ACCELERATORS
                ):
                    return original_to(*args, **kwargs)
            if not args or not copies_to_accelerator(args[0], args[1:], kwargs):
                return original_to(*args, **kwargs)
            return _timed(timer, lambda: original_to(*args, **kwargs))

        @functools.wraps(original_cuda)
        def cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
            timer = phase_hooks._ACTIVE
            if timer is None or not timer.in_step or not _auto_h2d or not _is_host_tensor(self):
                return original_cuda(self, *args, **kwargs)
            return _timed(timer, lambda: original_cuda(self, *args, **kwargs))

        tensor_cls.to = fast_patch(PATCH_OUTSIDE_STEP, original_to, to)
        tensor_cls.cuda = fast_patch(PATCH_OUTSIDE_STEP, original_cuda, cuda)
        _h2d_installed = True


def set_auto_h2d(on: bool) -> None:
    """Whether the installed ``Tensor.to``/``.cuda`` patch times copies (init's config)."""
    global _auto_h2d
    _auto_h2d = on


def _bad(name: str, expected: str, obj: object) -> None:
    warn_once(
        f"wrap:{name}",
        f"traceml: {name}() expects {expected}, got {type(obj).__name__}; "
        "it is returned unchanged and not timed",
    )


# -- DataLoader fetch -------------------------------------------------------------------


def _torch_loader_iterator(iterator: object) -> bool:
    """Whether ``iterator`` is a torch DataLoader's (which the automatic patch may time)."""
    for cls in type(iterator).__mro__:
        if cls.__name__ == "_BaseDataLoaderIter" and cls.__module__.startswith("torch."):
            return True
    return False


class _FetchIterator:
    """An iterator whose ``next()`` is timed as ``_traceml_internal:dataloader_next``."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator
        self._torch = _torch_loader_iterator(iterator)

    def __iter__(self) -> _FetchIterator:
        return self

    def __next__(self) -> Any:
        timer = phase_hooks._ACTIVE
        if timer is None or (
            # Already timed by the automatic DataLoader patch: not twice.
            self._torch and timer.auto_dataloader and "dataloader" in phase_hooks._patched
        ):
            return next(self._iterator)
        t0 = _perf_ns()
        # The StopIteration that ends an epoch is not a wait for a batch: not counted.
        item = next(self._iterator)
        timer.add_host(DATALOADER_NEXT, _perf_ns() - t0)
        return item

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)


class _FetchLoader:
    """A loader whose iterators are :class:`_FetchIterator`; other attributes pass through."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __iter__(self) -> _FetchIterator:
        return _FetchIterator(iter(self._loader))

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def wrap_dataloader_fetch(obj: Any) -> Any:
    """Time each batch fetched from a loader (``__iter__``) or iterator (``__next__``).

    The wait is attributed to the traced step that follows it, like the automatic
    DataLoader timing; a torch DataLoader that is already timed automatically is not
    timed twice.
    """
    if env_disabled():
        return obj
    if hasattr(obj, "__next__"):
        return _FetchIterator(obj)
    if hasattr(obj, "__iter__"):
        return _FetchLoader(obj)
    _bad("wrap_dataloader_fetch", "a loader or an iterator", obj)
    return obj


# -- forward, backward, optimizer step --------------------------------------------------


def _wrap_method(obj: Any, attr: str, name: str, slot_of: Callable[[Any], Any]) -> bool:
    """Replace ``obj.<attr>`` by a bound method that times it into phase ``name``.

    A bound method (not a plain function) keeps ``obj.<attr>.__func__`` working: torch's
    LR schedulers rebind ``optimizer.step`` through it.
    """
    original = getattr(obj, attr)

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        timer = phase_hooks._ACTIVE
        if timer is None or not timer.in_step:
            return original(*args, **kwargs)
        slot = slot_of(timer)
        timer.open(slot)
        try:
            return original(*args, **kwargs)
        finally:
            timer.close(slot, name)

    functools.update_wrapper(timed, original)
    try:
        setattr(obj, attr, types.MethodType(timed, obj))
        setattr(obj, f"_traceml_wrapped_{attr}", True)
    except Exception:
        return False
    return True


def _is_class(name: str, obj: Any, expected: str) -> bool:
    """Whether ``obj`` is a class (``wrap_forward(MyModel)``), said once: patching the
    class would time every instance's calls, outside this model too."""
    if not isinstance(obj, type):
        return False
    warn_once(
        f"wrap:{name}:class",
        f"traceml: {name}() expects {expected}, got the class {obj.__name__}; "
        "it is returned unchanged and not timed",
    )
    return True


def wrap_forward(model: Any) -> Any:
    """Time this model's ``forward`` (in place; returns the same model)."""
    if env_disabled():
        return model
    if _is_class(
        "wrap_forward", model, "a module instance (model = MyModel(); wrap_forward(model))"
    ):
        return model
    if not callable(getattr(model, "forward", None)):
        _bad("wrap_forward", "a module with a callable forward", model)
        return model
    if getattr(model, "_traceml_wrapped_forward", False):
        return model
    if not _wrap_method(model, "forward", FORWARD, lambda t: t.fwd):
        _bad("wrap_forward", "a module whose forward can be replaced", model)
    return model


def wrap_optimizer(optimizer: Any) -> Any:
    """Time this optimizer's ``step`` (in place; returns the same optimizer)."""
    if env_disabled():
        return optimizer
    if _is_class("wrap_optimizer", optimizer, "an optimizer instance"):
        return optimizer
    if not callable(getattr(optimizer, "step", None)):
        _bad("wrap_optimizer", "an object with a callable step()", optimizer)
        return optimizer
    if getattr(optimizer, "_traceml_wrapped_step", False):
        return optimizer
    if not _wrap_method(optimizer, "step", OPTIMIZER_STEP, lambda t: t.opt):
        _bad("wrap_optimizer", "an optimizer whose step can be replaced", optimizer)
    return optimizer


class _BackwardProxy:
    """A loss whose ``backward(...)`` is timed; everything else is the loss's own."""

    def __init__(self, loss: Any) -> None:
        self._loss = loss

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        timer = phase_hooks._ACTIVE
        if timer is None or not timer.in_step:
            return self._loss.backward(*args, **kwargs)
        slot = timer.bwd
        timer.open(slot)
        try:
            return self._loss.backward(*args, **kwargs)
        finally:
            timer.close(slot, BACKWARD)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loss, name)

    def __repr__(self) -> str:
        return f"wrap_backward({self._loss!r})"


def wrap_backward(loss: Any) -> Any:
    """A proxy of ``loss`` whose ``backward(...)`` is timed."""
    if env_disabled():
        return loss
    if not callable(getattr(loss, "backward", None)):
        _bad("wrap_backward", "an object with a callable backward()", loss)
        return loss
    return _BackwardProxy(loss)


# -- host to device ---------------------------------------------------------------------


class _H2DProxy:
    """A tensor or batch whose ``.to(...)`` to an accelerator is timed."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def to(self, *args: Any, **kwargs: Any) -> Any:
        obj = self._obj
        timer = phase_hooks._ACTIVE
        if timer is None or not timer.in_step:
            return obj.to(*args, **kwargs)
        is_tensor = hasattr(obj, "device")
        if is_tensor and _auto_h2d:
            return obj.to(*args, **kwargs)  # the automatic patch times it
        target = kwargs.get("device", args[0] if args else None)
        if is_tensor:
            timed = copies_to_accelerator(obj, args, kwargs)
        else:
            # A custom batch: trust the caller that it holds host tensors.
            timed = target is not None and _device_type(target) in _ACCELERATORS
        if not timed:
            return obj.to(*args, **kwargs)
        return _timed(timer, lambda: obj.to(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._obj, name)

    def __len__(self) -> int:
        return len(self._obj)

    def __iter__(self) -> Any:
        return iter(self._obj)

    def __getitem__(self, key: Any) -> Any:
        return self._obj[key]

    def __contains__(self, item: Any) -> bool:
        return item in self._obj

    def __repr__(self) -> str:
        return f"wrap_h2d({self._obj!r})"


def wrap_h2d(obj: Any) -> Any:
    """A proxy of ``obj`` whose first ``.to(accelerator)`` is timed as host-to-device.

    ``x = traceml.wrap_h2d(x).to(device)``: the call returns the real moved object.
    """
    if env_disabled():
        return obj
    if not callable(getattr(obj, "to", None)):
        _bad("wrap_h2d", "an object with a callable .to()", obj)
        return obj
    return _H2DProxy(obj)
