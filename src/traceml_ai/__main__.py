"""``python -m traceml_ai`` and the ``traceml`` console script."""

from __future__ import annotations

# SIGINT is held from the first line: ``_signal`` is built in, so nothing imports
# before it (``signal`` alone imports enum, functools and collections, and a Ctrl-C
# landing in them printed their traceback).
import _signal  # type: ignore[import-not-found]  # (no stub: signal re-exports it)

_HELD = hasattr(_signal, "pthread_sigmask")
if _HELD:
    _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT})

import sys  # noqa: E402  (built in, after the hold on purpose)


def entry() -> None:
    """Run the CLI; a Ctrl-C while it is still importing ends quietly, as after.

    SIGINT is held while the CLI's modules import (from this module's first line): a
    KeyboardInterrupt raised inside an extension module's initialization (orjson's,
    for one) can crash the interpreter instead of unwinding. A Ctrl-C that came
    meanwhile is taken once the imports are done."""
    if _HELD:
        _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT})
    try:
        try:
            from traceml_ai.cli import main
        finally:
            if _HELD:
                pending = _signal.SIGINT in _signal.sigpending()
                _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {_signal.SIGINT})
                # Python's own handler turns it into a KeyboardInterrupt; a SIGINT the
                # process ignores (a background job's) was held too, and stays ignored.
                if pending and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        print("traceml: interrupted", file=sys.stderr)
        sys.exit(130)
    main(prog_name="traceml")


if __name__ == "__main__":
    entry()
