"""listen_first: the first address a host resolves to that takes the socket, else one
line in the caller's error."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from traceml_ai._listen import listen_first


class Refused(Exception):
    pass


def _listen(family: socket.AddressFamily, address: Any) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(address)
        sock.listen(1)
    except OSError:
        sock.close()
        raise
    return sock


def test_the_first_address_that_takes_the_socket_is_used() -> None:
    sock = listen_first("127.0.0.1", 0, _listen, doing="cannot listen", error=Refused)
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


def test_a_port_in_use_is_one_line_naming_where() -> None:
    taken = _listen(socket.AF_INET, ("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        with pytest.raises(Refused) as caught:
            listen_first("127.0.0.1", port, _listen, doing="cannot listen", error=Refused)
    finally:
        taken.close()
    assert str(caught.value) == f"cannot listen on 127.0.0.1:{port}: Address already in use"


def test_a_name_that_does_not_resolve_is_one_line() -> None:
    with pytest.raises(Refused) as caught:
        listen_first("no-such-host.invalid", 0, _listen, doing="cannot listen", error=Refused)
    message = str(caught.value)
    assert message.startswith("cannot resolve 'no-such-host.invalid': ")
    assert "\n" not in message and "Errno" not in message
