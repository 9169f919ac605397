"""What a rank keeps of its own steps for ``traceml.summary()``, and the sink that keeps it.

:class:`StepRecorder` stands in front of the runtime's sink: every traced step's
items pass through it (as dicts through ``put``, or encoded through
``put_encoded_many``, the same call the sender takes), on their way it applies
``--trace-max-steps`` and records the steps in a :class:`StepHistory`. The history
outlives the runtime (``init`` after ``shutdown`` goes on adding to it); a recorder is
made per runtime, for that runtime's sink.

Light: never imports torch.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from traceml_ai.rank.sink import EncodedItemSink, ItemSink

RECENT_STEPS = 4096
"""Steps a rank keeps for its in-process summary (the most recent ones)."""

Events = Mapping[str, Any]


class StepHistory:
    """This rank's steps so far: how many, the last one, and the events of the most
    recent ones (``keep_events``; off when the summary is read from the exported
    files, and then only counted)."""

    def __init__(self, *, keep_events: bool = True) -> None:
        self.keep_events = keep_events
        self._lock = threading.Lock()
        # Each step's events kept encoded: thousands of nested dicts kept alive here
        # would move into the garbage collector's oldest generation, and bring on full
        # collections of the training process (docs/benchmarks.md); bytes hold nothing.
        self._recent: deque[tuple[int, bytes]] = deque(maxlen=RECENT_STEPS)
        self.total_steps = 0
        self.last_step = 0

    def record(self, steps: Sequence[int], events: Sequence[bytes] | None) -> None:
        """Count ``steps``; keep their ``events`` (encoded) when given."""
        if not steps:
            return
        with self._lock:
            if events is not None:
                self._recent.extend(zip(steps, events, strict=True))
            self._count(len(steps), max(steps))

    def count(self, n: int, last: int) -> None:
        """Count ``n`` steps, the highest numbered ``last``, keeping nothing of them."""
        with self._lock:
            self._count(n, last)

    def _count(self, n: int, last: int) -> None:
        self.total_steps += n
        if last > self.last_step:
            self.last_step = last

    def snapshot(self) -> tuple[list[tuple[int, Events]], int]:
        """(recent steps, steps recorded in all) at this moment."""
        with self._lock:
            recent, total = list(self._recent), self.total_steps
        return [(step, orjson.loads(events)) for step, events in recent], total


class StepRecorder:
    """An ``ItemSink`` and ``EncodedItemSink`` in front of ``sink``: records this rank's
    steps in ``history`` and drops the step items past ``max_steps``
    (``--trace-max-steps``).

    ``encoded`` is where encoded items go (the runtime's own sender, the same object as
    ``sink``); without one they are decoded and handed to ``sink.put``.
    """

    def __init__(
        self,
        sink: ItemSink,
        max_steps: int | None = None,
        *,
        history: StepHistory | None = None,
        encoded: EncodedItemSink | None = None,
    ) -> None:
        self.sink = sink
        self.max_steps = max_steps
        self.history = history if history is not None else StepHistory()
        self.encoded = encoded

    def put(self, stream: str, item: dict[str, object]) -> None:
        """Pass ``item`` on (none past ``max_steps``), recording a step_time item's step."""
        # Twice on every traced step's path: without --trace-max-steps a step_memory
        # item costs two comparisons before the sink's put.
        max_steps = self.max_steps
        if max_steps is not None:
            step = item.get("step")
            if isinstance(step, int) and step > max_steps:
                return
        if stream == "step_time":
            step = item.get("step")
            events = item.get("events")
            if isinstance(step, int) and isinstance(events, dict):
                kept: bytes | None = None
                if self.history.keep_events:
                    try:
                        kept = orjson.dumps(events)
                    except TypeError:
                        kept = b"{}"
                self.history.record((step,), None if kept is None else (kept,))
        self.sink.put(stream, item)

    def put_encoded_many(self, stream: str, items: Sequence[bytes]) -> None:
        """:meth:`put` of items given encoded (``wire.encode_item``), in order: passed
        on encoded, in one call."""
        history = self.history
        max_steps = self.max_steps
        steps: list[int] | None = None
        if max_steps is not None or (stream == "step_time" and history.keep_events):
            steps = [_step_of(data) for data in items]
            if max_steps is not None and any(step > max_steps for step in steps):
                kept = [i for i, step in enumerate(steps) if step <= max_steps]
                steps = [steps[i] for i in kept]
                items = [items[i] for i in kept]
                if not items:
                    return
        if stream == "step_time" and items:
            if steps is None:
                # A timer's steps come in order: the last one is the highest.
                history.count(len(items), _step_of(items[-1]))
            else:
                events = [_events_of(t) for t in items] if history.keep_events else None
                history.record(steps, events)
        encoded = self.encoded
        if encoded is not None:
            encoded.put_encoded_many(stream, items)
            return
        for data in items:
            self.sink.put(stream, orjson.loads(data))


def _step_of(item: bytes) -> int:
    """The ``step`` of an encoded step_time or step_memory item."""
    # Only integers and fixed keys come before it: the first "step": is its key.
    at = item.find(b'"step":') + 7
    return int(item[at : item.index(b",", at)])


def _events_of(step_time: bytes) -> bytes:
    """The encoded events object of an encoded step_time item."""
    # The events object closes the item; only integers and fixed keys come before it,
    # so the first "events": is its key.
    at = step_time.find(b'"events":')
    return step_time[at + 9 : -1] if at >= 0 else b"{}"
