"""The rank sender's socket calls in C (``traceml_ai.transport._nowait``): they never
block, whatever the socket's mode, and say what happened to the connection."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from traceml_ai.transport import sender

nowait: Any = sender._NOWAIT
pytestmark = pytest.mark.skipif(nowait is None, reason="_nowait is not built")


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_send_takes_what_fits_and_never_blocks_a_blocking_socket(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    a.setblocking(True)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    assert nowait.send_nowait(a.fileno(), b"hello") == 5
    assert b.recv(16) == b"hello"
    big = b"x" * (8 << 20)
    taken = nowait.send_nowait(a.fileno(), big)
    assert 0 < taken < len(big)  # the rest did not fit, and the call returned
    while nowait.send_nowait(a.fileno(), big) > 0:
        pass
    assert nowait.send_nowait(a.fileno(), memoryview(big)[:10]) == 0  # full: 0, not a wait


def test_a_closed_peer_is_gone_and_sending_to_it_raises(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    assert nowait.peer_gone(a.fileno()) is False
    b.close()
    assert nowait.peer_gone(a.fileno()) is True
    with pytest.raises(OSError):  # EPIPE, and no SIGPIPE
        nowait.send_nowait(a.fileno(), b"lost")


def test_a_peer_that_writes_is_gone_and_its_bytes_stay_unread(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    b.sendall(b"?")
    assert nowait.peer_gone(a.fileno()) is True
    assert a.recv(1) == b"?"  # peeked, not consumed


@pytest.mark.parametrize("fd", [-1, 2**40, "3"])
def test_bad_descriptors_raise(fd: object) -> None:
    with pytest.raises((ValueError, OverflowError, TypeError)):
        nowait.send_nowait(fd, b"x")
    with pytest.raises((ValueError, OverflowError, TypeError)):
        nowait.peer_gone(fd)


def test_a_descriptor_that_is_not_open_raises_or_is_gone() -> None:
    fd = 1_000_000  # beyond any descriptor table here: EBADF
    with pytest.raises(OSError):
        nowait.send_nowait(fd, b"x")
    assert nowait.peer_gone(fd) is True


def test_wrong_arguments_raise_type_errors() -> None:
    with pytest.raises(TypeError):
        nowait.send_nowait(1)
    with pytest.raises(TypeError):
        nowait.send_nowait(1, 12)
