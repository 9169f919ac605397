"""Where the rank SDK puts its wire items."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import orjson


class ItemSink(Protocol):
    """Receives one wire item of one stream; must not block or raise.

    ``traceml_ai.transport.sender.RankSender`` is the production sink.
    """

    # ``item`` is Any so that sinks typed ``dict[str, object]`` still fit; the checking
    # happens where producers build an item, as its generated TypedDict.
    def put(self, stream: str, item: Any) -> None:
        """Queue ``item`` (a wire item, see docs/dev/wire-format.md) for ``stream``.

        Producers build items as the TypedDicts of ``traceml_records._generated.wire``
        (generated from the schemas), so mypy checks them against the contract.
        """
        ...


class EncodedItemSink(Protocol):
    """Receives wire items already encoded; must not block or raise.

    ``traceml_ai.transport.sender.RankSender`` is the production one; the step timer
    hands a builder's worth of steps off CUDA over this way (their items encoded in C).
    """

    def put_encoded_many(self, stream: str, items: Sequence[bytes]) -> None:
        """Queue ``items`` of ``stream``, in order: each the bytes ``wire.encode_item``
        gives for a wire item."""
        ...


class RecordingSink:
    """An in-memory ``ItemSink`` that keeps every item, for tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[str, dict[str, object]]] = []

    def put(self, stream: str, item: Mapping[str, object]) -> None:
        """Record the item."""
        with self._lock:
            # Items are plain dicts (the generated TypedDicts of traceml_records are dicts).
            self._items.append((stream, cast("dict[str, object]", item)))

    def put_encoded_many(self, stream: str, items: Sequence[bytes]) -> None:
        """Record items given encoded (``EncodedItemSink``), decoded as the aggregator
        decodes them."""
        with self._lock:
            for data in items:
                self._items.append((stream, orjson.loads(data)))

    def items(self, stream: str | None = None) -> list[dict[str, object]]:
        """The recorded items of ``stream`` (all streams when ``None``), in arrival order."""
        with self._lock:
            return [item for s, item in self._items if stream is None or s == stream]

    def streams(self) -> list[str]:
        """The stream of every recorded item, in arrival order."""
        with self._lock:
            return [s for s, _ in self._items]
