"""The dashboard's web server: Starlette routes served by uvicorn on a thread of its own.

Routes: ``/`` (the page), ``/static/dashboard.js``, ``/static/dashboard.css``,
``/static/favicon.svg`` (this package's files; the icon is ``/favicon.ico`` too, which
a browser asks for by itself, the JSON view opened alone), ``/static/plotly.min.js``
(read at run time from the installed ``plotly`` Python package, never copied into
this project nor fetched from a CDN) and ``/api/view`` (the view's JSON;
``?ranks=3,17`` adds those ranks' own lines; ``?charts=0`` leaves the lines over steps out:
the page's first view, drawn before Plotly has loaded).

The socket is bound before the server starts, so a taken port is said at once (as
:class:`DashboardError`). On a loopback address only requests naming a loopback host
are answered (``traceml_ai._loopback``, the rule ``/metrics`` follows too). The
server runs until :meth:`DashboardServer.stop`; it never touches the process's signal
handlers, and uvicorn's own log lines are silenced (a malformed request would print
one each, into the training terminal).
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.resources
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson

from traceml_ai._listen import listen_first
from traceml_ai._loopback import host_allowed, is_loopback
from traceml_ai.dashboard._view import MAX_EXTRA_RANKS, RunData, build_view

__all__ = ["DashboardError", "DashboardServer", "Views", "start_server"]

_log = logging.getLogger("traceml_ai.dashboard")

_CACHED_VIEWS = 16


class DashboardError(Exception):
    """The dashboard cannot start; the message is one line."""


MIN_AGE_S = 0.8
"""A view this recent is served again rather than rebuilt (pages poll every second)..."""
COST_FACTOR = 20.0
"""...nor one younger than this many times its making took: the page costs the
aggregator at most about 5 % of a core, whatever the number of ranks and pages."""


class Views:
    """The view's JSON for each set of extra ranks; made again from the source at most
    every ``max(MIN_AGE_S, COST_FACTOR x the time it took)``, however many pages poll."""

    def __init__(self, source: Callable[[], RunData], *, final: Callable[[], bool]) -> None:
        self._source = source
        self._final = final
        self._lock = threading.Lock()
        self._built: dict[tuple[tuple[int, ...], bool], tuple[RunData, bytes, float]] = {}
        self._data: RunData | None = None
        self._data_until = 0.0
        self.served = 0
        """Views served (the live sink waits for one after the run finalized)."""
        self.last_served = 0.0

    def json(self, extra: tuple[int, ...] = (), *, charts: bool = True) -> bytes:
        with self._lock:
            now = time.monotonic()
            if self._data is None or now >= self._data_until or self._final():
                started = now
                self._data = self._source()
                self._data_until = started + max(
                    MIN_AGE_S, COST_FACTOR * (time.monotonic() - started)
                )
            data = self._data
            hit = self._built.get((extra, charts))
            if hit is not None and hit[0] is data:
                body = hit[1]
            else:
                started = time.monotonic()
                body = orjson.dumps(build_view(data, extra, charts=charts))
                took = time.monotonic() - started
                # The view's own making counts against the same budget.
                self._data_until += COST_FACTOR * took
                if len(self._built) >= _CACHED_VIEWS:
                    self._built.clear()
                self._built[(extra, charts)] = (data, body, took)
            self.served += 1
            self.last_served = time.monotonic()
            return body


def _static(name: str) -> bytes:
    return (importlib.resources.files("traceml_ai.dashboard") / "static" / name).read_bytes()


class _Plotly:
    """plotly.min.js of the installed plotly package, gzipped once on first request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._raw: bytes | None = None
        self._gz: bytes | None = None

    def check(self) -> None:
        """Raise DashboardError when the installed plotly has no plotly.min.js."""
        try:
            path = importlib.resources.files("plotly") / "package_data" / "plotly.min.js"
            ok = path.is_file()
        except (ModuleNotFoundError, OSError):
            ok = False
        if not ok:
            raise DashboardError(
                "the installed plotly package has no package_data/plotly.min.js: "
                "pip install 'traceml-ai[dashboard]'"
            )

    def get(self, gzipped: bool) -> bytes:
        with self._lock:
            if self._raw is None:
                path = importlib.resources.files("plotly") / "package_data" / "plotly.min.js"
                self._raw = path.read_bytes()
            if not gzipped:
                return self._raw
            if self._gz is None:
                self._gz = gzip.compress(self._raw, compresslevel=6)
            return self._gz


def _app(views: Views, loopback_only: bool) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    plotly = _Plotly()
    plotly.check()
    no_cache = {"Cache-Control": "no-store"}
    files = {
        "dashboard.js": ("text/javascript; charset=utf-8", _static("dashboard.js")),
        "dashboard.css": ("text/css; charset=utf-8", _static("dashboard.css")),
        "favicon.svg": ("image/svg+xml", _static("favicon.svg")),
    }
    page = _static("index.html")

    def guard(request: Request) -> Response | None:
        if host_allowed(request.headers.get("host"), loopback_only=loopback_only):
            return None
        return PlainTextResponse(
            "traceml dashboard: this page answers only requests to a loopback address "
            "(127.0.0.1, localhost)",
            status_code=403,
        )

    def index(request: Request) -> Response:
        return guard(request) or Response(page, media_type="text/html", headers=no_cache)

    def static(request: Request) -> Response:
        refused = guard(request)
        if refused is not None:
            return refused
        name = request.path_params["name"]
        if name == "plotly.min.js":
            gz = "gzip" in request.headers.get("accept-encoding", "")
            headers = {"Cache-Control": "max-age=3600"}
            if gz:
                headers["Content-Encoding"] = "gzip"
            return Response(plotly.get(gz), media_type="text/javascript", headers=headers)
        if name not in files:
            return PlainTextResponse("not found", status_code=404)
        kind, body = files[name]
        return Response(body, media_type=kind, headers=no_cache)

    def icon(request: Request) -> Response:
        kind, body = files["favicon.svg"]
        return guard(request) or Response(body, media_type=kind, headers=no_cache)

    def view(request: Request) -> Response:
        refused = guard(request)
        if refused is not None:
            return refused
        extra: list[int] = []
        for part in request.query_params.get("ranks", "").split(","):
            part = part.strip()
            if part.isdigit() and len(extra) < MAX_EXTRA_RANKS:
                extra.append(int(part))
        try:
            charts = request.query_params.get("charts") != "0"
            body = views.json(tuple(sorted(set(extra))), charts=charts)
        except Exception as exc:  # a bug shows on the page; the server and the run go on
            _log.debug("the dashboard view failed", exc_info=True)
            return JSONResponse(
                {"error": f"{type(exc).__name__}: {exc}"}, status_code=500, headers=no_cache
            )
        return Response(body, media_type="application/json", headers=no_cache)

    return Starlette(
        routes=[
            Route("/", index),
            Route("/static/{name}", static),
            Route("/favicon.ico", icon),
            Route("/api/view", view),
        ]
    )


def _listening_socket(family: socket.AddressFamily, address: Any) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def _bind(host: str, port: int) -> socket.socket:
    return listen_first(host, port, _listening_socket, doing="cannot listen", error=DashboardError)


class DashboardServer:
    """uvicorn serving the dashboard on a daemon thread."""

    def __init__(self, server: Any, sock: socket.socket, host: str) -> None:
        self._server = server
        self._sock = sock
        self.host = host
        self.port = int(sock.getsockname()[1])
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="traceml-dashboard", daemon=True)

    @property
    def url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # never propagates into the process
            self.failed = exc
            _log.debug("the dashboard server stopped", exc_info=True)

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started and self._thread.is_alive():
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        if not self._server.started:
            self.stop(1.0)
            why = f"{type(self.failed).__name__}: {self.failed}" if self.failed else "timed out"
            raise DashboardError(f"the web server did not start ({why})")

    def stop(self, timeout_s: float) -> bool:
        """Stop serving within about ``timeout_s``; whether the thread ended."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(max(0.1, timeout_s))
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(0.5)
        with contextlib.suppress(OSError):
            self._sock.close()
        return not self._thread.is_alive()


def start_server(views: Views, host: str, port: int) -> DashboardServer:
    """Bind ``host:port`` and serve the page from ``views``; raises DashboardError."""
    import uvicorn

    # uvicorn logs each malformed request ("Invalid HTTP request received.") as a
    # warning; anyone who can reach the port could fill the training terminal with
    # them. The page's own problems are reported by the dashboard, in one line.
    quiet = logging.getLogger("uvicorn")
    if not any(isinstance(h, logging.NullHandler) for h in quiet.handlers):
        quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    loopback_only = is_loopback(host)
    app = _app(views, loopback_only)
    sock = _bind(host, port)
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level="critical",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=1,
        server_header=False,
    )
    server = DashboardServer(uvicorn.Server(config), sock, host)
    server.start()
    return server
