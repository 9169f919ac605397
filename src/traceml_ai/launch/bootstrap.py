"""How ``traceml run`` starts a rank: ``python -m traceml_ai.launch.bootstrap SCRIPT ARGS...``.

It runs SCRIPT as ``__main__`` exactly as ``python SCRIPT ARGS...`` would: the same
``sys.argv``, ``__file__`` and ``__main__`` globals (``__builtins__`` the builtins
module); ``sys.path[0]`` the folder of the script's real file (symlinks resolved); a
folder or zip application run by its ``__main__.py``, a ``.pyc`` as compiled code; an
uncaught error reported as ``python`` reports it, without this module's frames, exit
code 1 (a KeyboardInterrupt ends the process by SIGINT). Before that it installs an
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

For the launcher's last words it leaves a note when the script starts and one when the
interpreter exits normally (``ENV_RANK_STATE_DIR``), and it takes a Ctrl-C that came
while the rank was starting (``ENV_SIGINT_HELD``) by ending quietly by SIGINT.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import marshal
import os
import pkgutil
import runpy
import signal
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from traceml_ai import _environ
from traceml_ai._after_import import when_imported

ENV_ZERO_CODE = _environ.ZERO_CODE


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


def zero_code_enabled(environ: dict[str, str] | os._Environ[str]) -> bool:
    """Whether ``TRACEML_ZERO_CODE`` leaves the automatic attach on (default: on)."""
    return environ.get(ENV_ZERO_CODE, "").strip().lower() not in ("0", "false", "off", "no")


_installed = False


def install() -> None:
    """Patch each framework's Trainer module when it is imported (now, if it is)."""
    global _installed
    if _installed:
        return
    _installed = True
    for name in _TARGETS:
        when_imported(name, functools.partial(_apply, name))


ENV_RANK_STATE_DIR = _environ.RANK_STATE_DIR

ENV_SIGINT_HELD = _environ.SIGINT_HELD


def _die_by_sigint() -> None:
    """End the process by SIGINT, as ``python`` does after an uncaught KeyboardInterrupt."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


class _Rank:
    """This rank's notes for the launcher and how its interpreter is to end."""

    def __init__(self, environ: dict[str, str] | os._Environ[str]) -> None:
        self.pid = os.getpid()
        self.folder = environ.pop(ENV_RANK_STATE_DIR, "")
        self.name = f"{environ.get('RANK', 'x')}.{self.pid}"
        self.sigint_held = environ.pop(ENV_SIGINT_HELD, "") == "1"
        self.die_by_sigint = False
        # Registered before the script runs, so it runs after every atexit handler the
        # script and TraceML register (TraceML's shutdown included).
        atexit.register(self._at_exit)

    def note(self, what: str) -> None:
        if not self.folder or os.getpid() != self.pid:  # a fork of the script: not us
            return
        with (
            contextlib.suppress(OSError),
            open(os.path.join(self.folder, f"{self.name}.{what}"), "xb"),
        ):
            pass

    def _at_exit(self) -> None:
        self.note("exited")
        if self.die_by_sigint and os.getpid() == self.pid:
            _die_by_sigint()


def _abspath(path: str) -> str:
    """``path`` made absolute the way ``python`` makes its script's path (not normalized)."""
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def _cannot_open(path: str, exc: OSError) -> SystemExit:
    """``python``'s own message and exit status for a script it cannot open."""
    print(
        f"{sys.executable}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}",
        file=sys.stderr,
        flush=True,
    )
    return SystemExit(2)


def _script_code(path: str) -> tuple[types.CodeType, Any]:
    """The code of the script file at ``path`` and its loader, as ``python FILE`` reads it:
    source, or compiled code when the file is a ``.pyc`` (by name or magic number)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise _cannot_open(path, exc) from None
    magic = importlib.util.MAGIC_NUMBER
    if path.endswith(".pyc") or data[:2] == magic[:2]:
        if data[:4] != magic:
            raise RuntimeError("Bad magic number in .pyc file")
        code = marshal.loads(data[16:])
        if not isinstance(code, types.CodeType):
            raise RuntimeError("Bad code object in .pyc file")
        return code, importlib.machinery.SourcelessFileLoader("__main__", path)
    nul = data.find(b"\0")
    if nul >= 0:
        # compile() would say "source code string ..." and name no line; python's reader
        # names the file and line (a file named .zip that is no zip file lands here).
        line = data[data.rfind(b"\n", 0, nul) + 1 : nul].decode("utf-8", "replace")
        where = (path, data.count(b"\n", 0, nul) + 1, None, line)
        raise SyntaxError("source code cannot contain null bytes", where)
    code = compile(data, path, "exec", dont_inherit=True)
    return code, importlib.machinery.SourceFileLoader("__main__", path)


def _new_main(**values: Any) -> types.ModuleType:
    """A fresh ``__main__`` module with what ``python`` gives its own, plus ``values``."""
    main = types.ModuleType("__main__")
    # The builtins module itself (an imported module's __builtins__ is its dict).
    given: dict[str, Any] = {"__builtins__": builtins}
    if sys.version_info < (3, 14):
        given["__annotations__"] = {}  # the interpreter's __main__ starts with one
    main.__dict__.update(given, **values)
    return main


def _set_path0(entry: str) -> None:
    """Put ``entry`` first on ``sys.path`` in place of the folder ``python -m`` put there."""
    if getattr(sys.flags, "safe_path", False):
        sys.path.insert(0, entry)  # -P / PYTHONSAFEPATH: `-m` put nothing there
    else:
        sys.path[0] = entry


class _Script:
    """What runs: a script's code in the new ``__main__``, or (``code`` None) the
    ``__main__`` module of a zip application or folder."""

    def __init__(self, rank: _Rank, code: types.CodeType | None, main: types.ModuleType) -> None:
        self.rank = rank
        self.code = code
        self.main = main


def _run(script: _Script) -> None:
    """Start the script. The frames of a traceback below this one are the script's (and
    for a zip or folder, ``runpy``'s first, as under ``python``)."""
    script.rank.note("started")
    if script.code is not None:
        exec(script.code, script.main.__dict__)
    else:
        # What the interpreter itself calls for `python FOLDER` and `python APP.zip`; it
        # runs the __main__ module found on sys.path[0] in sys.modules["__main__"].
        runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]


def _script_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The part of ``tb`` below :func:`_run`; None when the script had not started."""
    while tb is not None:
        if tb.tb_frame.f_code is _run.__code__:
            return tb.tb_next
        tb = tb.tb_next
    return None


def _print_uncaught(exc: BaseException, tb: types.TracebackType | None) -> None:
    """What ``python`` does with an exception its ``__main__`` did not catch."""
    exc = exc.with_traceback(tb)
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = exc
    try:
        sys.excepthook(type(exc), exc, tb)
    except Exception as hook_exc:
        print("Error in sys.excepthook:", file=sys.stderr)
        sys.__excepthook__(type(hook_exc), hook_exc, hook_exc.__traceback__)
        print("\nOriginal exception was:", file=sys.stderr)
        sys.__excepthook__(type(exc), exc, tb)


def _prepare(argv: Sequence[str], rank: _Rank) -> _Script:
    """Set ``sys.argv``, ``sys.path`` and ``sys.modules["__main__"]`` as ``python ARGV...``
    would for a script file, a zip application or a folder."""
    path = _abspath(argv[0])
    sys.argv = list(argv)
    # A folder or a zip file runs its __main__ module: `python` asks the same import
    # hooks whether the path is importable (a non-zip file named .zip runs as a script).
    if pkgutil.get_importer(path) is not None:
        _set_path0(path)
        main = _new_main()
        sys.modules["__main__"] = main
        return _Script(rank, None, main)
    code, loader = _script_code(path)
    if not getattr(sys.flags, "safe_path", False):
        # `python SCRIPT` puts the folder of the script's real file (symlinks resolved).
        sys.path[0] = os.path.dirname(os.path.realpath(path))
    main = _new_main(__file__=path, __cached__=None, __loader__=loader)
    # Pickling by reference (multiprocessing, DataLoader workers) finds the script's
    # classes in sys.modules["__main__"], as with a plain `python SCRIPT`.
    sys.modules["__main__"] = main
    return _Script(rank, code, main)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m traceml_ai.launch.bootstrap SCRIPT ARGS...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        _say("usage: python -m traceml_ai.launch.bootstrap SCRIPT [ARGS...]")
        raise SystemExit(2)
    rank = _Rank(os.environ)
    try:
        if rank.sigint_held:
            # A Ctrl-C that came while the interpreter started is raised here, at once.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        if zero_code_enabled(os.environ):
            try:
                install()
            except Exception as exc:
                _say(f"could not install the framework attach ({exc!r}); the script runs unpatched")
        _run(_prepare(args, rank))
    except SystemExit:
        raise
    except BaseException as exc:
        tb = _script_frames(exc.__traceback__)
        if isinstance(exc, KeyboardInterrupt):
            if tb is None:
                # Ctrl-C before the script's first line: nothing of it ran; the launcher
                # says so. The process ends as `python` ends on a Ctrl-C at its start.
                _die_by_sigint()
                raise SystemExit(128 + signal.SIGINT) from None
            rank.die_by_sigint = True
        # An error of the script (or of compiling it): python's report, none of our frames.
        _print_uncaught(exc, tb)
        raise SystemExit(128 + signal.SIGINT if rank.die_by_sigint else 1) from None


if __name__ == "__main__":
    # Run the importable copy, so the hook's classes belong to traceml_ai.launch.bootstrap
    # and not to the `__main__` that the script replaces.
    importlib.import_module("traceml_ai.launch.bootstrap").main()
