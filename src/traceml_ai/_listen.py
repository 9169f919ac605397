"""Listening on a host and port given by name: the first address it resolves to that
takes the socket, for the live views (the dashboard, Prometheus' ``/metrics``)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


def listen_first(
    host: str,
    port: int,
    open_at: Callable[[socket.AddressFamily, Any], _T],
    *,
    doing: str,
    error: type[Exception],
) -> _T:
    """``open_at(family, address)`` for each address ``host`` resolves to, until one
    does not raise ``OSError``; else ``error`` with one line: ``"cannot resolve ..."``
    or ``"<doing> on host:port: <why>"``."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise error(f"cannot resolve {host!r}: {exc.strerror or exc}") from None
    last: OSError | None = None
    for family, _, _, _, address in infos:
        try:
            return open_at(family, address)
        except OSError as exc:
            last = exc
    why = (last.strerror or str(last)) if last is not None else "no address"
    raise error(f"{doing} on {host}:{port}: {why}")
