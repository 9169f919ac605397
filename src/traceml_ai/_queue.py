"""One bounded queue, for every consumer in the aggregator that must not hold up its
producer.

The aggregator's receive loop hands every batch to the export worker and, when a live
view is on, to the live feed; each keeps its own :class:`BoundedBatchQueue` and one
thread that takes from it. The live sinks that send (OTLP, each tracker) queue their
items in one too, through the sink worker (``monitor/_sink_worker.py``). ``put`` must
never slow its caller down: it never blocks (beyond a briefly held lock) and never
raises; whatever it cannot take counts one dropped item (and its size).

The rank's sender keeps its own queues apart on purpose (the training thread's hot
path; see "Bounded queues: one policy, two classes" in docs/dev/architecture.md).

Locking: ``put`` takes the queue's lock itself. Every other method that changes the
queue (``take``, ``take_batch``, ``take_all``, ``clear``, ``close``) is called with
:attr:`cond` held, so that a consumer changes its own state in the same critical
section (the export worker pops a batch and records that it is building it,
atomically). The read-only figures are read without the lock: single values, possibly
a moment stale.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, Protocol, TypeVar

__all__ = ["BoundedBatchQueue", "HasNbytes"]


class HasNbytes(Protocol):
    """What the queue needs of an item: its size, an ``int >= 0`` that does not change
    while the item is queued (``ReceivedBatch.nbytes``: the wire bytes it holds; a sink
    worker's entry: its size in the sink's unit)."""

    @property
    def nbytes(self) -> int: ...


T = TypeVar("T", bound=HasNbytes)


def _size(item: HasNbytes) -> object:
    """An item's ``nbytes``, or None when it cannot be read."""
    try:
        return item.nbytes
    except Exception:
        return None


class BoundedBatchQueue(Generic[T]):
    """A FIFO bounded in items and in bytes (the sum of the items' ``nbytes``).

    ``put`` drops the newest: an item that would pass either bound, an item whose
    ``nbytes`` is not an ``int >= 0`` (or cannot be read), and any item after
    :meth:`close` count one drop each and are not queued. The counters (``dropped``,
    ``dropped_nbytes``, the high-water marks) only grow, until
    :meth:`after_fork_in_child`.
    """

    def __init__(self, *, max_items: int, max_bytes: int) -> None:
        if max_items < 1 or max_bytes < 1:
            raise ValueError("queue limits must be at least 1")
        self._max_items = max_items
        self._max_bytes = max_bytes
        self.cond = threading.Condition(threading.Lock())
        """The queue's lock; consumers wait on it (``put`` wakes one waiter when the
        queue stops being empty; ``close`` wakes them all) and hold it to take."""
        self._items: deque[T] = deque()
        self._empty(closed=False)

    def _empty(self, *, closed: bool) -> None:
        """Nothing queued, every counter zero."""
        self._items = deque()
        self._nbytes = 0
        self._closed = closed
        self._dropped = 0
        self._dropped_nbytes = 0
        self._hw_items = 0
        self._hw_bytes = 0

    # -- producer ---------------------------------------------------------------------

    def put(self, item: T) -> bool:
        """Queue ``item``; True if queued, False if dropped (and counted). Never blocks
        on the consumer and never raises."""
        nbytes = _size(item)
        with self.cond:
            was_empty = not self._items
            queued = self._admit(item, nbytes)
            if queued and was_empty:
                # Consumers wait only while the queue is empty.
                self.cond.notify()
            return queued

    def put_many(self, items: list[T]) -> int:
        """Queue ``items`` in order, each as :meth:`put` would, under one hold of the
        lock (one wake-up of a waiting consumer); how many were queued."""
        sizes = list(map(_size, items))
        with self.cond:
            was_empty = not self._items
            whole = self._room_for_all(sizes)
            if whole is not None:
                # Room for all of them (nearly always): what _admit would do for each.
                queue = self._items
                queue.extend(items)
                self._nbytes += whole
                self._hw_items = max(self._hw_items, len(queue))
                self._hw_bytes = max(self._hw_bytes, self._nbytes)
                if items and was_empty:
                    self.cond.notify()
                return len(items)
            queued = 0
            for item, nbytes in zip(items, sizes, strict=True):
                queued += self._admit(item, nbytes)
            if queued and was_empty:
                self.cond.notify()
            return queued

    def _room_for_all(self, sizes: list[object]) -> int | None:
        """The bytes of items of ``sizes`` when every one of them would be admitted
        (``cond`` held: open, each size an ``int >= 0``, room for all of them under both
        bounds), else None."""
        if self._closed or len(self._items) + len(sizes) > self._max_items:
            return None
        total = 0
        for n in sizes:
            if type(n) is not int or n < 0:
                return None
            total += n
        return total if self._nbytes + total <= self._max_bytes else None

    def _admit(self, item: T, nbytes: object) -> bool:
        """Append ``item`` if it fits the bounds, else count its drop (``cond`` held)."""
        if type(nbytes) is not int or nbytes < 0:
            self._dropped += 1
            return False
        items = self._items
        queued = self._nbytes + nbytes
        if self._closed or len(items) >= self._max_items or queued > self._max_bytes:
            self._dropped += 1
            self._dropped_nbytes += nbytes
            return False
        items.append(item)
        self._nbytes = queued
        n = len(items)
        if n > self._hw_items:
            self._hw_items = n
        if queued > self._hw_bytes:
            self._hw_bytes = queued
        return True

    # -- consumer (call with ``cond`` held) -----------------------------------------------

    def take(self) -> T | None:
        """The oldest item, removed; None when the queue is empty."""
        items = self._items
        if not items:
            return None
        item = items.popleft()
        self._nbytes -= item.nbytes
        return item

    def take_batch(self, max_nbytes: int) -> list[T]:
        """The oldest items, removed, as many as fit in ``max_nbytes`` together (the
        oldest one always, whatever its size); empty when the queue is."""
        items = self._items
        taken: list[T] = []
        total = 0
        while items:
            size = items[0].nbytes
            if taken and total + size > max_nbytes:
                break
            taken.append(items.popleft())
            total += size
        self._nbytes -= total
        return taken

    def take_all(self) -> list[T]:
        """Every queued item, oldest first; the queue is left empty."""
        taken = list(self._items)
        self._items.clear()
        self._nbytes = 0
        return taken

    def clear(self) -> int:
        """Drop everything queued; return how many items that was (they count in
        ``dropped``)."""
        n = len(self._items)
        self._items.clear()
        self._dropped += n
        self._dropped_nbytes += self._nbytes
        self._nbytes = 0
        return n

    def close(self) -> None:
        """Take no more items (each later ``put`` counts a drop) and wake every waiter;
        what is queued stays to be taken. Idempotent."""
        self._closed = True
        self.cond.notify_all()

    # -- figures (read without the lock) -------------------------------------------------

    def __len__(self) -> int:
        """Items queued now."""
        return len(self._items)

    @property
    def nbytes(self) -> int:
        """Bytes queued now (the sum of the queued items' ``nbytes``)."""
        return self._nbytes

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or this is a forked child's queue)."""
        return self._closed

    @property
    def max_items(self) -> int:
        """The bound in items."""
        return self._max_items

    @property
    def max_bytes(self) -> int:
        """The bound in bytes."""
        return self._max_bytes

    @property
    def dropped(self) -> int:
        """Items not queued by ``put`` plus items dropped by ``clear``."""
        return self._dropped

    @property
    def dropped_nbytes(self) -> int:
        """The sizes of the items counted in ``dropped`` (an item whose size could not
        be read adds nothing)."""
        return self._dropped_nbytes

    @property
    def high_water_items(self) -> int:
        """Most items queued at once."""
        return self._hw_items

    @property
    def high_water_bytes(self) -> int:
        """Most bytes queued at once."""
        return self._hw_bytes

    @property
    def backlog(self) -> float:
        """How full the queue is now, 0 to 1: the larger of its two bounds' shares (read
        without the lock: a hint, e.g. for the live views, which yield to the export)."""
        by_items = len(self._items) / self._max_items
        by_bytes: float = self._nbytes / self._max_bytes
        return max(by_items, by_bytes)

    # -- fork ------------------------------------------------------------------------------

    def after_fork_in_child(self) -> None:
        """In a forked child: an empty, closed queue with zeroed counters and a fresh lock.

        Only the forking thread exists in the child, so a lock another parent thread
        held is held forever here: it is replaced, never acquired. Nothing in the child
        will take from this queue, so it takes nothing more (each ``put`` counts a drop).
        The owner calls this from its own reset (the queue does not register itself
        with :mod:`traceml_ai._fork`).
        """
        self.cond = threading.Condition(threading.Lock())
        self._empty(closed=True)
