"""``python -m traceml_ai`` and the ``traceml`` console script."""

from __future__ import annotations

import signal
import sys


def entry() -> None:
    """Run the CLI; a Ctrl-C while it is still importing ends quietly, as after.

    SIGINT is held while the CLI's modules import: a KeyboardInterrupt raised inside
    an extension module's initialization (orjson's, for one) can crash the
    interpreter instead of unwinding. A Ctrl-C that came meanwhile is taken once the
    imports are done."""
    held = hasattr(signal, "pthread_sigmask")
    if held:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        try:
            from traceml_ai.cli import main
        finally:
            if held:
                pending = signal.SIGINT in signal.sigpending()
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
                # Python's own handler turns it into a KeyboardInterrupt; a SIGINT the
                # process ignores (a background job's) was held too, and stays ignored.
                if pending and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        print("traceml: interrupted", file=sys.stderr)
        sys.exit(130)
    main(prog_name="traceml")


if __name__ == "__main__":
    entry()
