"""Run a function on a module right after it is imported, or at once when it already
is: the one import hook of a TraceML process.

``traceml run``'s bootstrap attaches TraceML to the training frameworks this way
(``launch.bootstrap``), and rank 0 notes the folder of each TensorBoard
``SummaryWriter`` (``rank._runtime.tracker_runs``). One finder, first on ``sys.meta_path``,
finds nothing itself: for a module some function waits for, it asks the other finders
and wraps the loader they found, so that the module executes as it would, then the
functions run. A function that raises is the caller's to report: the import goes on.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["when_imported"]

Hook = Callable[[types.ModuleType], object]

_lock = threading.Lock()
_hooks: dict[str, list[Hook]] = {}


def _run(name: str, module: types.ModuleType) -> None:
    with _lock:
        hooks = list(_hooks.get(name, ()))
    for hook in hooks:
        with contextlib.suppress(Exception):
            hook(module)


class _Loader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the module's functions."""

    def __init__(self, name: str, loader: Any) -> None:
        self._name = name
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _run(self._name, module)

    def __getattr__(self, name: str) -> Any:
        # get_resource_reader, get_source, is_package...: the real loader's.
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the modules functions wait for."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Loader(fullname, spec.loader)
            return spec
        return None


def when_imported(name: str, hook: Hook) -> None:
    """Call ``hook(module)`` once module ``name`` has executed: now, if it already has."""
    with _lock:
        _hooks.setdefault(name, []).append(hook)
        if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
    module = sys.modules.get(name)
    if module is not None:
        with contextlib.suppress(Exception):
            hook(module)
