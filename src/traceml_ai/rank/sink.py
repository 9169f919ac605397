"""Where the rank SDK puts its wire items."""

from __future__ import annotations

import threading
from typing import Protocol


class ItemSink(Protocol):
    """Receives one wire item of one stream; must not block or raise.

    ``traceml_ai.transport.sender.RankSender`` is the production sink.
    """

    def put(self, stream: str, item: dict[str, object]) -> None:
        """Queue ``item`` (a wire item, see docs/dev/wire-format.md) for ``stream``."""
        ...


class RecordingSink:
    """An in-memory ``ItemSink`` that keeps every item, for tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[str, dict[str, object]]] = []

    def put(self, stream: str, item: dict[str, object]) -> None:
        """Record the item."""
        with self._lock:
            self._items.append((stream, item))

    def items(self, stream: str | None = None) -> list[dict[str, object]]:
        """The recorded items of ``stream`` (all streams when ``None``), in arrival order."""
        with self._lock:
            return [item for s, item in self._items if stream is None or s == stream]

    def streams(self) -> list[str]:
        """The stream of every recorded item, in arrival order."""
        with self._lock:
            return [s for s, _ in self._items]
