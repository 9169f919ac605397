"""How ``traceml run`` starts a rank: ``python -m traceml_ai._bootstrap SCRIPT ARGS...``.

It runs SCRIPT as ``__main__`` exactly as ``python SCRIPT ARGS...`` would (same
``sys.argv``, ``sys.path[0]`` the script's folder, ``__file__``), after installing an
import hook that attaches TraceML to the training frameworks the script imports:

- ``transformers.Trainer``: ``train()`` gets ``TraceMLTrainerCallback``;
- ``lightning.pytorch.Trainer`` (and ``pytorch_lightning.Trainer``): the first
  trainer wraps Lightning's training-batch, backward, optimizer-closure, epoch and
  evaluation-loop methods and ``Trainer.fit`` once per process
  (``traceml_ai.integrations.lightning``; no callback, so no per-hook dispatch cost).

A framework is patched only if and when the script imports it, so a script that
uses neither pays nothing. Only ranks started by ``traceml run`` run this module, so
nothing is patched outside it; ``TRACEML_ZERO_CODE=0`` turns the attach off. A
failure to patch is one ``traceml:`` line and the script runs unpatched.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

ENV_ZERO_CODE = "TRACEML_ZERO_CODE"
"""``0``/``false``/``off``: do not attach to Trainer/Lightning automatically."""


def _lazy_wrap(cls: Any, name: str, integration: str, factory: str) -> None:
    """Replace ``cls.name`` by a wrapper that builds TraceML's wrapper at its first call.

    The integration module is imported then, not while the framework's module is
    being imported: the script may be importing that integration itself (explicit
    form), and it imports the framework, so importing it here could meet it half
    initialized.
    """
    original = getattr(cls, name, None)
    if not callable(original) or getattr(original, "__traceml_wrapped__", False):
        return
    built: list[Callable[..., Any]] = []

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not built:
            try:
                built.append(getattr(importlib.import_module(integration), factory)(original))
            except Exception as exc:
                built.append(original)
                _say(
                    f"could not attach to {cls.__module__}.{cls.__qualname__}.{name} ({exc!r}); "
                    "this run's training steps are not traced"
                )
        return built[0](self, *args, **kwargs)

    method.__traceml_wrapped__ = True  # type: ignore[attr-defined]
    setattr(cls, name, method)


_HF = "traceml_ai.integrations.huggingface"
_LIGHTNING = "traceml_ai.integrations.lightning"


def _patch_transformers(module: types.ModuleType) -> None:
    trainer = module.Trainer
    _lazy_wrap(trainer, "train", _HF, "_wrap_train")
    _lazy_wrap(trainer, "evaluate", _HF, "_wrap_loop")
    _lazy_wrap(trainer, "predict", _HF, "_wrap_loop")


def _patch_lightning(module: types.ModuleType) -> None:
    _lazy_wrap(module.Trainer, "__init__", _LIGHTNING, "_wrap_init")


# The module that defines each Trainer class; patched right after it has executed.
_TARGETS: dict[str, Callable[[types.ModuleType], None]] = {
    "transformers.trainer": _patch_transformers,
    "lightning.pytorch.trainer.trainer": _patch_lightning,
    "pytorch_lightning.trainer.trainer": _patch_lightning,
}


def _say(message: str) -> None:
    print(f"traceml: {message}", file=sys.stderr, flush=True)


def _apply(name: str, module: types.ModuleType) -> None:
    try:
        _TARGETS[name](module)
    except Exception as exc:
        _say(f"could not attach to {name} ({exc!r}); this run's training steps are not traced")


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then patches the module it executed."""

    def __init__(self, name: str, loader: Any) -> None:
        self._name = name
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _apply(self._name, module)

    def __getattr__(self, name: str) -> Any:
        # get_resource_reader, get_source, is_package...: the real loader's.
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the Trainer modules other finders find."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _PatchingLoader(fullname, spec.loader)
            return spec
        return None


def zero_code_enabled(environ: dict[str, str] | os._Environ[str]) -> bool:
    """Whether ``TRACEML_ZERO_CODE`` leaves the automatic attach on (default: on)."""
    return environ.get(ENV_ZERO_CODE, "").strip().lower() not in ("0", "false", "off", "no")


def install() -> None:
    """Install the import hook; patch now what is already imported."""
    if any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
    for name in _TARGETS:
        module = sys.modules.get(name)
        if module is not None:
            _apply(name, module)


def run_script(argv: Sequence[str]) -> None:
    """Run ``argv[0]`` as ``__main__`` with ``argv`` as ``sys.argv``, like ``python``."""
    script = argv[0]
    path = os.path.abspath(script)
    with open(path, "rb") as fh:
        source = fh.read()
    code = compile(source, path, "exec", dont_inherit=True)
    sys.argv = list(argv)
    # `python -m` put the working directory first; `python SCRIPT` puts its folder.
    sys.path[0] = os.path.dirname(path)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        {
            "__file__": path,
            "__builtins__": __builtins__,
            "__cached__": None,
            "__loader__": importlib.machinery.SourceFileLoader("__main__", path),
        }
    )
    # Pickling by reference (multiprocessing, DataLoader workers) finds the script's
    # classes in sys.modules["__main__"], as with a plain `python SCRIPT`.
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m traceml_ai._bootstrap SCRIPT ARGS...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        _say("usage: python -m traceml_ai._bootstrap SCRIPT [ARGS...]")
        raise SystemExit(2)
    if zero_code_enabled(os.environ):
        try:
            install()
        except Exception as exc:
            _say(f"could not install the framework attach ({exc!r}); the script runs unpatched")
    run_script(args)


if __name__ == "__main__":
    # Run the importable copy, so the hook's classes belong to traceml_ai._bootstrap
    # and not to the `__main__` that the script replaces.
    importlib.import_module("traceml_ai._bootstrap").main()
