"""What a training loop would export, captured in memory for a test to assert on."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from traceml_ai.export import RecordBuilder
from traceml_ai.rank.identity import RankIdentity
from traceml_ai.transport.wire import ReceivedBatch, make_batch_message
from traceml_records import STREAMS_BY_NAME, dumps_line

__all__ = ["ExportCapture"]


class ExportCapture:
    """An item sink for ``traceml_ai.init(sink=...)`` that shows what an export would write.

    It keeps every wire item the rank SDK puts (as ``RecordingSink`` does) and, when
    asked, turns them into typed records with the aggregator's own record builder:
    the same records, skipped items and lines (``dumps_line``) a ``traceml run`` with
    every stream selected would give, except ``observed_timestamp_unix_ns``, which is
    the time of the ``put`` here. ``identity`` defaults to this process's rank identity
    read from the environment when the capture is made, as ``init`` reads it.
    """

    def __init__(
        self, identity: RankIdentity | None = None, *, include_hostname: bool = False
    ) -> None:
        self.identity = RankIdentity.from_env() if identity is None else identity
        self.include_hostname = include_hostname
        self._lock = threading.Lock()
        self._items: list[tuple[str, dict[str, object], int]] = []

    def put(self, stream: str, item: dict[str, object]) -> None:
        """Keep ``item`` of wire stream ``stream``; never blocks nor raises."""
        observed = time.time_ns()
        with self._lock:
            self._items.append((stream, item, observed))

    def items(self, stream: str | None = None) -> list[dict[str, object]]:
        """The wire items of ``stream`` (every stream when None), in the order put."""
        with self._lock:
            return [item for s, item, _ in self._items if stream is None or s == stream]

    def clear(self) -> None:
        """Forget everything captured so far."""
        with self._lock:
            self._items.clear()

    def _build(self, streams: Iterable[str]) -> tuple[dict[str, list[Any]], int]:
        builder = RecordBuilder(streams, self.include_hostname)
        identity = self.identity.to_wire()
        records: dict[str, list[Any]] = {}
        skipped = 0
        with self._lock:
            captured = list(self._items)
        # One batch per item: each gets the observed time of its own put, and a bad item
        # is skipped alone, as in a real export where it would rarely share a batch.
        for stream, item, observed in captured:
            message = make_batch_message("capture", identity, stream, [item])
            result = builder.build(ReceivedBatch(observed, message, 0))
            skipped += result.skipped_items
            for name, group in result.records.items():
                records.setdefault(name, []).extend(group)
        return records, skipped

    def records(self, stream: str) -> list[Any]:
        """Typed records of file stream ``stream`` (``traceml_records`` names), in order."""
        if stream not in STREAMS_BY_NAME:
            raise ValueError(f"unknown stream {stream!r}; expected one of {tuple(STREAMS_BY_NAME)}")
        return self._build((stream,))[0].get(stream, [])

    def lines(self, stream: str) -> list[bytes]:
        """The lines the JSONL exporter would write for ``stream`` (closing line aside)."""
        return [dumps_line(r, include_hostname=self.include_hostname) for r in self.records(stream)]

    @property
    def skipped_items(self) -> int:
        """Items an export of every stream would skip as invalid (0 for a correct rank)."""
        return self._build(STREAMS_BY_NAME)[1]
