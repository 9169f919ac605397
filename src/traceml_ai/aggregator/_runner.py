"""Run an aggregator until its ranks are done or it is told to stop, then finalize.

Shared by ``traceml serve`` (foreground) and the aggregator process that
``traceml run`` starts.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

from traceml_ai.aggregator._service import Aggregator, FinalizeResult

# After a stop signal, how long to wait for rank connections to close (their last
# frames are read before the close) before finalizing anyway.
STOP_GRACE_S = 5.0


def run_until_done(
    aggregator: Aggregator,
    *,
    stop: threading.Event,
    wait_for_ranks: bool,
    on_stop_signal: Callable[[], None] | None = None,
) -> FinalizeResult:
    """Serve until every expected rank finished (when ``wait_for_ranks``) or ``stop`` is set.

    SIGINT and SIGTERM set ``stop`` (when called from the main thread). On stop, the
    ranks' open connections get a short grace to deliver what they sent.
    """
    install_stop_handlers(stop, on_stop_signal)
    while not stop.is_set():
        if wait_for_ranks and aggregator.wait_all_finished(0.1):
            break
        stop.wait(0.1)
    else:
        aggregator.wait_connections_closed(STOP_GRACE_S)
    return aggregator.finalize()


def install_stop_handlers(
    stop: threading.Event, on_stop_signal: Callable[[], None] | None = None
) -> None:
    """Make SIGINT and SIGTERM set ``stop`` (main thread only; else nothing).

    ``traceml serve`` calls it before it starts listening, so a Ctrl-C that comes
    before ``run_until_done`` still finalizes instead of killing the process.
    """
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        del signum, frame
        if on_stop_signal is not None and not stop.is_set():
            on_stop_signal()
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
