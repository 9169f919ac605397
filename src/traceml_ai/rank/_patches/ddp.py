"""DDP's gradient buckets, timed through a communication hook reported to the active
recorder of the step's collectives (``distributed.active()``).

The user's own hook is wrapped when registered
(``DistributedDataParallel.register_comm_hook``), and a DDP model that reaches its
first forward without one gets DDP's default all-reduce as a Python hook, the same
arithmetic (divide by the world size, then sum); a hook registered after that (DDP
takes one per model), or a built-in one, runs through it.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable
from typing import Any

from traceml_ai.rank._patches import distributed

__all__ = ["adopt_model", "install"]


def install() -> None:
    """Patch DDP's hook registration and forward (once per class; nothing when torch
    has no DDP)."""
    with contextlib.suppress(Exception):
        from torch.nn.parallel import DistributedDataParallel

        _patch_ddp(DistributedDataParallel)


def _wrap_hook(hook: Callable[..., Any], group: Any = None) -> Callable[..., Any]:
    """A DDP communication hook that reports each bucket, around ``hook`` (``group``:
    the DDP model's process group, None for the default one)."""

    def traced_hook(state: Any, bucket: Any) -> Any:
        recorder = distributed.active()
        if recorder is None:
            return hook(state, bucket)
        return recorder.bucket(hook, state, bucket, group)

    # DDP checks a hook's annotations against dist.GradBucket and Future; none is
    # what it accepts from any hook.
    traced_hook.__annotations__ = {}
    traced_hook.__traceml_collective__ = True  # type: ignore[attr-defined]
    return traced_hook


def _default_hook(process_group: Any, bucket: Any) -> Any:
    """DDP's default reduction as a Python hook: divide by the world size, then sum."""
    import torch.distributed as dist

    group: Any = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(group.size())
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


_default_hook.__annotations__ = {}


def _patch_ddp(ddp_class: Any) -> None:
    original = ddp_class.register_comm_hook
    if getattr(original, "__traceml_collective__", False):
        return

    def register_comm_hook(self: Any, state: object, hook: Callable[..., Any]) -> None:
        if self.__dict__.get("_traceml_hooked"):
            # TraceML's hook went in at the first forward: it runs this one from now on
            # (DDP takes one hook per model, and it was taken).
            self.__dict__["_traceml_user_hook"] = (state, hook)
            return
        if not getattr(hook, "__traceml_collective__", False):
            hook = _wrap_hook(hook, getattr(self, "process_group", None))
        original(self, state, hook)

    register_comm_hook.__wrapped__ = original  # type: ignore[attr-defined]
    register_comm_hook.__traceml_collective__ = True  # type: ignore[attr-defined]
    register_comm_hook.__doc__ = original.__doc__
    ddp_class.register_comm_hook = register_comm_hook

    builtin = getattr(ddp_class, "_register_builtin_comm_hook", None)
    if builtin is not None:

        def register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
            if self.__dict__.get("_traceml_hooked"):
                replacement = _python_twin(self, comm_hook_type)
                if replacement is not None:
                    self.__dict__["_traceml_user_hook"] = replacement
                    return
            builtin(self, comm_hook_type)

        register_builtin_comm_hook.__wrapped__ = builtin  # type: ignore[attr-defined]
        register_builtin_comm_hook.__doc__ = builtin.__doc__
        ddp_class._register_builtin_comm_hook = register_builtin_comm_hook

    forward = ddp_class.forward

    def traced_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Before DDP's first backward: the buckets of a model without a hook of its
        # own are then timed (DDP takes a hook until its first iteration).
        if distributed.active() is not None and "_traceml_seen" not in self.__dict__:
            self.__dict__["_traceml_seen"] = True
            adopt_model(self)
        return forward(self, *args, **kwargs)

    traced_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    traced_forward.__traceml_collective__ = True  # type: ignore[attr-defined]
    traced_forward.__doc__ = forward.__doc__
    ddp_class.forward = traced_forward


def adopt_model(model: object) -> None:
    """A traced step met ``model``: a DDP model with no communication hook gets DDP's
    default all-reduce as a timed Python hook (a built-in C++ hook is left alone, and
    its buckets are not seen)."""
    if distributed.active() is None:
        return
    ddp_class = _ddp_class()
    if ddp_class is None or not isinstance(model, ddp_class):
        return
    if getattr(model, "_comm_hooks", None):
        return  # the user's hook, wrapped when it was registered
    if getattr(model, "reducer", None) is None or getattr(model, "_traceml_hooked", False):
        return
    with contextlib.suppress(Exception):
        model.register_comm_hook(getattr(model, "process_group", None), _ModelHook(model))
        model._traceml_hooked = True


class _ModelHook:
    """The hook TraceML gives a DDP model without one: DDP's default all-reduce, or the
    hook the user registers later (``register_comm_hook`` after the first forward,
    which DDP alone would refuse)."""

    def __init__(self, model: object) -> None:
        self._model = weakref.ref(model)

    def __call__(self, state: Any, bucket: Any) -> Any:
        model = self._model()
        user = model.__dict__.get("_traceml_user_hook") if model is not None else None
        if user is not None:
            return user[1](user[0], bucket)
        return _default_hook(state, bucket)


def _python_twin(model: Any, comm_hook_type: Any) -> tuple[Any, Callable[..., Any]] | None:
    """A built-in C++ hook as its Python twin from torch (None: none known)."""
    try:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        kinds: Any = getattr(dist, "BuiltinCommHookType")  # noqa: B009 (not in its stubs)
        group = getattr(model, "process_group", None)
        if comm_hook_type == kinds.ALLREDUCE:
            return (group, _default_hook)
        if comm_hook_type == kinds.FP16_COMPRESS:
            return (group, default_hooks.fp16_compress_hook)
    except Exception:
        return None
    return None


def _ddp_class() -> Any:
    module = sys.modules.get("torch.nn.parallel.distributed")
    return getattr(module, "DistributedDataParallel", None) if module is not None else None
