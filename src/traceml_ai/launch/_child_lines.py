"""Lines a child process (the aggregator, a node's relay) writes on its stdout, read
one at a time within a deadline, never blocking past it."""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable

_READ_SLICE_S = 0.1
"""How often a wait for a line looks at ``give_up`` (the launcher: the signals that came
meanwhile)."""


class ChildLines:
    """The complete lines read from one file descriptor; what follows the last newline
    waits for the next read."""

    def __init__(self) -> None:
        self._buffer = b""

    def reset(self) -> None:
        """Forget what was read (a new child on a new pipe)."""
        self._buffer = b""

    def next_line(
        self, fd: int, timeout: float, give_up: Callable[[], bool] | None = None
    ) -> bytes | None:
        """The next line without its newline; None on timeout, end of stream or
        ``give_up()``."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            if give_up is not None and give_up():
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], min(left, _READ_SLICE_S))
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line
