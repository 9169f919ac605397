"""The patches that tell the parallel layout (``rank._collectives.parallel_layout``) of
the objects it is read from, as the script makes them: torch's ``DeviceMesh`` and
pipelining stages, and DeepSpeed's pipeline grid. Each class's ``__init__`` is patched
when its module is imported (through the process's one import hook, at once for a
module already imported); a patch that fails to note an object leaves it made as it
would be.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from traceml_ai._after_import import when_imported
from traceml_ai.rank._collectives import parallel_layout

__all__ = ["install"]

_installed = False


def _patch_init(cls: Any, note: Callable[[object], None]) -> None:
    original = cls.__init__
    if getattr(original, "__traceml_parallel__", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        with contextlib.suppress(Exception):
            note(self)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    __init__.__traceml_parallel__ = True  # type: ignore[attr-defined]
    __init__.__doc__ = original.__doc__
    cls.__init__ = __init__


def _on_device_mesh(module: Any) -> None:
    cls = getattr(module, "DeviceMesh", None)
    if isinstance(cls, type):
        _patch_init(cls, parallel_layout.note_mesh)


def _on_pipelining_stage(module: Any) -> None:
    cls = getattr(module, "_PipelineStageBase", None) or getattr(module, "PipelineStage", None)
    if isinstance(cls, type):
        _patch_init(cls, parallel_layout.note_stage)


def _on_deepspeed_topology(module: Any) -> None:
    cls = getattr(module, "PipelineParallelGrid", None)
    if isinstance(cls, type):
        _patch_init(cls, parallel_layout.note_grid)


def install() -> None:
    """Note meshes, pipeline stages and DeepSpeed grids as the script makes them (once
    per process; at once for modules already imported)."""
    global _installed
    if _installed:
        return
    _installed = True
    when_imported("torch.distributed.device_mesh", _on_device_mesh)
    when_imported("torch.distributed.pipelining.stage", _on_pipelining_stage)
    when_imported("deepspeed.runtime.pipe.topology", _on_deepspeed_topology)
