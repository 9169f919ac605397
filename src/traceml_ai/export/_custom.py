"""Custom exporters: ``exporter: my_pkg.my_module:make_exporter``.

The factory is imported and called once, in the aggregator, with the run's
:class:`ExportContext`; it returns an object with callable ``export(records)`` and
``close(summary)``. Anything that goes wrong on the way gives one clear message
naming the value and the problem, and the run goes on with the exporter failed (the
pipeline then counts every selected record as failed). The message is one line, also
for a failure inside the user's own code (an import error raised by their module, a
factory that raises): the exception and the file, line and function of their code
that raised it, which is what they need to find it, without a traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, cast

import attrs

from traceml_ai.export._protocol import ExportContext, Exporter, ExporterFactory

__all__ = [
    "ExporterLoadError",
    "ExporterStartFailure",
    "create_exporter",
    "load_exporter_factory",
    "report_to_stderr",
]


class ExporterLoadError(Exception):
    """A ``module:factory`` value could not give an exporter; the message says why."""


@attrs.frozen(kw_only=True)
class ExporterStartFailure:
    """Why a custom exporter could not start; ``message`` names the value and the problem."""

    value: str
    message: str


def report_to_stderr(message: str) -> None:
    """Print ``traceml: <message>`` to stderr, the way the launcher reports problems."""
    print(f"traceml: {message}", file=sys.stderr, flush=True)


_OWN_FILE = os.path.normcase(os.path.abspath(__file__))
_IMPORTLIB_DIR = os.path.normcase(os.path.dirname(os.path.abspath(importlib.__file__ or "")))


def _is_machinery(filename: str) -> bool:
    """Frames of the import system or of this loader: noise in a user's traceback."""
    if filename.startswith("<frozen importlib"):
        return True
    path = os.path.normcase(os.path.abspath(filename))
    return path == _OWN_FILE or os.path.dirname(path) == _IMPORTLIB_DIR


def _user_error(exc: BaseException) -> str:
    """``exc`` as one line: its type and message, and where in the user's code it was
    raised (the innermost frame that is not importlib's or ours).

    One line rather than a traceback: the run goes on without the exporter, and the
    message must read as one clear line among the launcher's.
    """
    te = traceback.TracebackException.from_exception(exc)
    frames = [frame for frame in te.stack if not _is_machinery(frame.filename)]
    what = "".join(te.format_exception_only()).strip().replace("\n", " ")
    if not frames:
        return what
    last = frames[-1]
    return f"{what} (at {last.filename}:{last.lineno}, in {last.name})"


def _is_missing_module(exc: ModuleNotFoundError, module: str) -> bool:
    """Whether ``exc`` says ``module`` itself (or a package above it) does not exist."""
    name = exc.name or ""
    return bool(name) and (module == name or module.startswith(name + "."))


def _import(value: str, module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if not _is_missing_module(exc, module):
            raise ExporterLoadError(
                f"exporter {value!r}: importing module {module!r} raised {_user_error(exc)}"
            ) from exc
        cwd = os.getcwd()
        if cwd in sys.path or "" in sys.path:
            raise ExporterLoadError(
                f"exporter {value!r}: cannot import module {module!r}: {exc}"
            ) from None
    except (Exception, SystemExit) as exc:
        # SystemExit too: a module that calls sys.exit() must not end the aggregator.
        raise ExporterLoadError(
            f"exporter {value!r}: importing module {module!r} raised {_user_error(exc)}"
        ) from exc
    # Console scripts (``traceml``) do not put the working directory on sys.path, but
    # a user naming ``my_pkg.exporters:make`` expects their project folder to count,
    # as ``python -m`` would. Appended, so it never shadows an installed package.
    sys.path.append(cwd)
    importlib.invalidate_caches()
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if _is_missing_module(exc, module):
            raise ExporterLoadError(
                f"exporter {value!r}: cannot import module {module!r}: {exc}"
            ) from None
        raise ExporterLoadError(
            f"exporter {value!r}: importing module {module!r} raised {_user_error(exc)}"
        ) from exc
    except (Exception, SystemExit) as exc:
        raise ExporterLoadError(
            f"exporter {value!r}: importing module {module!r} raised {_user_error(exc)}"
        ) from exc


def load_exporter_factory(value: str) -> ExporterFactory:
    """Import ``module.path:factory`` and return the factory (not called yet).

    Raises :class:`ExporterLoadError` with one message naming ``value`` when the
    value is malformed, the module cannot be imported (with the exception and where it
    was raised when that was inside the module), the attribute is missing, or it is not
    callable. If the module is not found, the working directory is added to the end
    of ``sys.path`` and the import tried once more.
    """
    module, sep, attr = value.strip().partition(":")
    if (
        not sep
        or not attr.isidentifier()
        or not all(part.isidentifier() for part in module.split("."))
    ):
        raise ExporterLoadError(
            f"exporter {value!r}: expected 'module.path:factory' (dotted module path, a colon, "
            "and the factory's name)"
        )
    mod = _import(value, module)
    try:
        factory = getattr(mod, attr)
    except AttributeError:
        raise ExporterLoadError(
            f"exporter {value!r}: module {module!r} has no attribute {attr!r}"
        ) from None
    if not callable(factory):
        raise ExporterLoadError(
            f"exporter {value!r}: {module}.{attr} is not callable "
            f"(it is {type(factory).__name__}); it must be a factory taking the export context"
        )
    return cast(ExporterFactory, factory)


def _missing_methods(obj: object) -> list[str]:
    return [name for name in ("export", "close") if not callable(getattr(obj, name, None))]


def create_exporter(
    value: str,
    context: ExportContext,
    *,
    report: Callable[[str], None] | None = report_to_stderr,
) -> Exporter | ExporterStartFailure:
    """Load the factory named by ``value``, call it once with ``context``, check the result.

    Returns the exporter, or an :class:`ExporterStartFailure` whose message names the
    value and the problem; that message is passed to ``report`` once (by default
    printed to stderr; None reports nothing). Never raises for a broken value,
    module, factory or returned object.
    """
    failure: str | None = None
    try:
        factory = load_exporter_factory(value)
    except ExporterLoadError as exc:
        failure = str(exc)
    else:
        try:
            exporter = factory(context)
        except (Exception, SystemExit) as exc:
            failure = f"exporter {value!r}: the factory raised {_user_error(exc)}"
        else:
            missing = _missing_methods(exporter)
            if not missing:
                return exporter
            failure = (
                f"exporter {value!r}: the factory returned {type(exporter).__name__}, "
                f"which has no callable {' or '.join(m + '()' for m in missing)}; "
                "an exporter needs export(records) and close(summary)"
            )
    message = f"{failure}; export is off for this run and its records count as failed"
    if report is not None:
        report(message)
    return ExporterStartFailure(value=value, message=message)
