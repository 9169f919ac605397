"""The one Host rule of TraceML's HTTP servers (the dashboard and ``/metrics``).

A server listening on a loopback address answers only requests whose ``Host`` header
names a loopback host (``127.0.0.1``, ``localhost``, ``[::1]`` ...). A web page
elsewhere can point a DNS name of its own at 127.0.0.1 (DNS rebinding) and have the
browser fetch from the server; the request then carries that name as its Host, and
is refused, so the page cannot read the run. A server listening elsewhere (``0.0.0.0``,
a LAN address) is meant to be reached by other names, and answers any Host.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket

__all__ = ["host_allowed", "is_loopback"]

_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address."""
    if host.lower() == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def _host_of(header: str) -> str:
    """The host part of a Host header (``[::1]:80`` -> ``[::1]``, ``a:1`` -> ``a``)."""
    if header.startswith("["):
        return header.split("]", 1)[0] + "]"
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _loopback_name(host: str) -> bool:
    host = host.lower()
    if host in _LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    return False


def host_allowed(header: str | None, *, loopback_only: bool) -> bool:
    """Whether a request with this Host header (None: none sent) is answered by a
    server for which ``loopback_only`` is ``is_loopback(its bind host)``."""
    if not loopback_only:
        return True
    return _loopback_name(_host_of(header or ""))
