"""traceml_ai.transport._nowait, the C extension built from _nowait.c: its interface.

A rank sender's non-blocking socket calls, made without releasing the interpreter's
lock. Without it (not built, or ``TRACEML_PURE_PYTHON=1``) ``sender.py`` makes the same
calls through Python's ``socket`` module.
"""

def send_nowait(fd: int, data: bytes | bytearray | memoryview, /) -> int:
    """Bytes the kernel took at once, without blocking or releasing the interpreter's
    lock (0: its buffer is full)."""

def peer_gone(fd: int, /) -> bool:
    """Whether the connection's peer closed, reset or wrote."""
