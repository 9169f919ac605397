"""The live dashboard: one web page for a run of any number of nodes (docs/dashboard.md).

Two ways to serve it, one page:

* ``traceml run --mode dashboard`` (and ``traceml serve --dashboard``, Ray's
  ``mode="dashboard"``): the aggregator's live sink, :func:`start_live_dashboard`,
  serves the page from what the aggregator already holds, from the start of the run
  until it has finalized;
* ``traceml dashboard FOLDER``: :func:`serve_folder` serves it from a run's export
  files, following them while the run writes.

Both build the page's JSON with the one view builder (:mod:`._view`). The web server
(Starlette, uvicorn) and Plotly come with the ``dashboard`` extra and are imported only
here, when a page is served: importing this package imports none of them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from traceml_ai.dashboard._server import DashboardServer, Views
    from traceml_ai.monitor import Monitoring, StepSeen

__all__ = ["LiveDashboard", "missing_extra", "serve_folder", "start_live_dashboard"]

FINAL_VIEW_WAIT_S = 2.0
"""After the run finalized, how long an open page is given to fetch the final view."""
_PAGE_OPEN_S = 5.0
"""A page that fetched a view this recently is taken to be open."""


def missing_extra() -> str | None:
    """What to install when the dashboard's libraries are missing (one line), or None."""
    import importlib.util

    missing = [m for m in ("starlette", "uvicorn", "plotly") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (
        f"the dashboard needs {', '.join(missing)} (the 'dashboard' extra): "
        "pip install 'traceml-ai[dashboard]'"
    )


def _remote_warning(host: str, port: int) -> str:
    return (
        f"traceml: dashboard: warning: listening on {host}:{port}, not a loopback address: "
        "anyone who can reach this port sees the run (the page has no login); the default "
        f"127.0.0.1 with an SSH tunnel (ssh -L {port}:127.0.0.1:{port} HOST) keeps it private"
    )


class LiveDashboard:
    """The aggregator's dashboard sink: serves the page until the run has finalized."""

    name = "dashboard"

    def __init__(
        self, server: DashboardServer, views: Views, report: Callable[[str], None], run_dir: str
    ) -> None:
        self._server = server
        self._views = views
        self._report = report
        self._run_dir = run_dir

    @property
    def url(self) -> str:
        return self._server.url

    def on_steps(self, steps: Sequence[StepSeen]) -> None:
        """Nothing to do: a page's request reads the state."""

    def close(self, timeout_s: float) -> Mapping[str, int]:
        deadline = time.monotonic() + timeout_s
        views = self._views
        # An open page polls every second: give it the final view (finalized, the
        # last straggler verdict, the final health) before the server goes.
        if time.monotonic() - views.last_served < _PAGE_OPEN_S:
            served = views.served
            wait_until = min(deadline - 0.5, time.monotonic() + FINAL_VIEW_WAIT_S)
            while views.served == served and time.monotonic() < wait_until:
                time.sleep(0.05)
        failed = self._server.failed is not None or not self._server.running
        self._server.stop(max(0.1, deadline - time.monotonic()))
        files = os.path.isdir(os.path.join(self._run_dir, "aggregator", "export"))
        from traceml_ai.dashboard._view import files_command

        self._report(
            "traceml: dashboard: stopped with the run"
            + (f"; {files_command(self._run_dir)} shows it from its files" if files else "")
        )
        return {"server_failed": 1} if failed else {}


def start_live_dashboard(monitoring: Monitoring) -> LiveDashboard:
    """The dashboard sink of an aggregator, a :data:`~traceml_ai.monitor.SinkFactory`
    (the aggregator hands it to monitoring; the web server is imported when it is called).

    Raises :class:`~traceml_ai.monitor.SinkStartError` (one line) when it cannot
    start: the extra is missing, the port is taken. Training goes on.
    """
    from traceml_ai.monitor import SinkStartError

    why = missing_extra()
    if why is not None:
        raise SinkStartError(why.removeprefix("the dashboard "))
    from traceml_ai._loopback import is_loopback
    from traceml_ai.dashboard._live import LiveSource
    from traceml_ai.dashboard._server import DashboardError, Views, start_server

    settings = monitoring.settings
    host, port = settings.dashboard_bind_host, settings.dashboard_port
    # Once the run has finalized, every request gets the final figures at once.
    views = Views(LiveSource(monitoring), final=monitoring.finished.is_set)
    try:
        server = start_server(views, host, port)
    except DashboardError as exc:
        raise SinkStartError(str(exc)) from None
    sink = LiveDashboard(server, views, monitoring.report, str(monitoring.run.run_dir))
    if not is_loopback(host):
        monitoring.report(_remote_warning(host, server.port))
    monitoring.report(f"traceml: dashboard: live at {server.url} (until the run has finalized)")
    return sink


def serve_folder(
    path: str | os.PathLike[str],
    host: str,
    port: int,
    *,
    stop: threading.Event | None = None,
    report: Callable[[str], None] | None = None,
) -> int:
    """``traceml dashboard FOLDER``: serve the page from the folder's files until
    Ctrl-C (or ``stop``); returns the exit status (0, or 1 when it cannot serve)."""
    say = report or (lambda line: print(line, file=sys.stderr, flush=True))
    why = missing_extra()
    if why is not None:
        say(f"traceml: error: {why}")
        return 1
    from traceml_ai._loopback import is_loopback
    from traceml_ai.dashboard._files import FilesSource, check_folder
    from traceml_ai.dashboard._server import DashboardError, Views, start_server

    problem = check_folder(path)
    if problem is not None:
        say(f"traceml: error: {problem}")
        return 1
    # SIGTERM stops the page from here on, also while the server starts.
    done = stop or threading.Event()
    previous: Any = None
    if stop is None and threading.current_thread() is threading.main_thread():

        def on_signal(signum: int, frame: Any) -> None:
            done.set()

        previous = signal.signal(signal.SIGTERM, on_signal)
    source = FilesSource(path)
    views = Views(source, final=lambda: False)
    try:
        server = start_server(views, host, port)
    except DashboardError as exc:
        say(f"traceml: error: dashboard: {exc}")
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        return 1
    if not is_loopback(host):
        say(_remote_warning(host, server.port))
    data = source()
    if data.waiting and data.source == "files" and data.export_folder is None:
        say(f"traceml: dashboard: {data.waiting}; the page waits for them")
    say(f"traceml: dashboard of {path} at {server.url} (Ctrl-C to stop)")
    try:
        while not done.wait(0.5):
            if not server.running:
                say("traceml: error: dashboard: the web server stopped")
                return 1
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(2.0)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0
