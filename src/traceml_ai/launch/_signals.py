"""``traceml run``'s signals (recorded, forwarded to the ranks) and its one-line messages."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from types import FrameType
from typing import Any


def say(message: str) -> None:
    print(f"traceml: {message}", file=sys.stderr, flush=True)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_description(code: int) -> str:
    return f"was killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"


class Signals:
    """SIGINT and SIGTERM for the whole of ``traceml run``: recorded, and forwarded to the
    ranks while they run.

    Installed before anything starts, so a Ctrl-C at any moment never raises
    KeyboardInterrupt (click would print ``Aborted!``, exit 1 and leave the aggregator
    writing into a pipe nobody reads). A handler also replaces a ``SIG_IGN`` inherited
    from ``nohup`` or ``cmd &``, and since a handled signal is reset to its default on
    exec, the ranks started meanwhile can be stopped by the signal we forward.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._ranks_pgid: int | None = None
        self._forwarded = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Signals:
        for s in (signal.SIGINT, signal.SIGTERM):
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    @property
    def count(self) -> int:
        """Signals received so far."""
        return len(self.received)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self.received.append(signum)
        if self._ranks_pgid is not None:
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        assert self._ranks_pgid is not None
        self._forwarded += 1
        # First signal as sent, then SIGTERM, then SIGKILL for a run that will not stop.
        sig = (
            signum
            if self._forwarded == 1
            else (signal.SIGTERM if self._forwarded == 2 else signal.SIGKILL)
        )
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._ranks_pgid, sig)

    def ranks_started(self, pgid: int, seen_before: int) -> None:
        """Forward from now on; a signal that came while they were being started is sent now."""
        self._ranks_pgid = pgid
        if self.count > seen_before:
            self._forward(self.received[-1])

    def ranks_done(self) -> None:
        """Stop forwarding: the ranks' process group is gone."""
        self._ranks_pgid = None
