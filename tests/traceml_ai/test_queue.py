"""traceml_ai._queue: the bounded queue the export worker and the live feed share."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from traceml_ai._queue import BoundedBatchQueue


@attrs.frozen
class Item:
    name: str
    nbytes: int = 10


class _Broken:
    """An item whose size cannot be read."""

    @property
    def nbytes(self) -> int:
        raise RuntimeError("no size")


def _queue(max_items: int = 100, max_bytes: int = 10_000) -> BoundedBatchQueue[Item]:
    return BoundedBatchQueue(max_items=max_items, max_bytes=max_bytes)


def _take_all(q: BoundedBatchQueue[Item]) -> list[str]:
    with q.cond:
        return [item.name for item in q.take_all()]


# -- bounds and drops ----------------------------------------------------------------------


def test_limits_below_one_are_refused() -> None:
    with pytest.raises(ValueError):
        BoundedBatchQueue(max_items=0, max_bytes=1)
    with pytest.raises(ValueError):
        BoundedBatchQueue(max_items=1, max_bytes=0)


def test_the_count_bound_drops_the_newest_and_counts_each() -> None:
    q = _queue(max_items=3)
    results = [q.put(Item(f"i{k}", nbytes=1)) for k in range(5)]
    assert results == [True, True, True, False, False]
    assert len(q) == 3 and q.dropped == 2 and q.nbytes == 3
    assert _take_all(q) == ["i0", "i1", "i2"]


def test_the_byte_bound_is_inclusive_and_a_smaller_item_still_fits() -> None:
    q = _queue(max_bytes=100)
    assert q.put(Item("a", nbytes=60))
    assert not q.put(Item("b", nbytes=41))  # 101 > 100
    assert q.put(Item("c", nbytes=40))  # exactly 100 fits
    assert not q.put(Item("d", nbytes=1))
    assert q.put(Item("empty", nbytes=0)) is True  # no bytes: only the count bounds it
    assert q.nbytes == 100 and q.dropped == 2
    assert _take_all(q) == ["a", "c", "empty"]


def test_an_item_larger_than_the_byte_bound_is_dropped_even_when_empty() -> None:
    q = _queue(max_bytes=100)
    assert not q.put(Item("huge", nbytes=101))
    assert len(q) == 0 and q.nbytes == 0 and q.dropped == 1
    assert q.high_water_bytes == 0


@pytest.mark.parametrize("nbytes", [-1, 1.5, "10", None, True])
def test_an_item_with_a_bad_size_counts_one_drop(nbytes: object) -> None:
    q = _queue()
    assert not q.put(Item("bad", nbytes=nbytes))  # type: ignore[arg-type]
    assert len(q) == 0 and q.nbytes == 0 and q.dropped == 1


def test_an_item_whose_size_raises_counts_one_drop_and_the_queue_goes_on() -> None:
    q = _queue()
    assert not q.put(_Broken())  # type: ignore[arg-type]
    assert q.dropped == 1
    assert q.put(Item("next"))
    assert _take_all(q) == ["next"]


# -- counters ------------------------------------------------------------------------------


def test_high_water_marks_keep_the_peak_of_each_bound_separately() -> None:
    q = _queue()
    for k in range(4):
        q.put(Item(f"s{k}", nbytes=1))  # 4 items, 4 bytes
    with q.cond:
        q.take_all()
    q.put(Item("big", nbytes=500))  # 1 item, 500 bytes
    assert q.high_water_items == 4
    assert q.high_water_bytes == 500
    with q.cond:
        q.clear()
    assert q.high_water_items == 4 and q.high_water_bytes == 500  # marks never go down


def test_backlog_is_the_larger_share_of_the_two_bounds() -> None:
    q = _queue(max_items=10, max_bytes=1000)
    assert q.backlog == 0.0
    q.put(Item("a", nbytes=100))
    assert q.backlog == pytest.approx(0.1)  # 1/10 items, 100/1000 bytes
    q.put(Item("b", nbytes=700))
    assert q.backlog == pytest.approx(0.8)  # bytes lead
    for k in range(8):
        q.put(Item(f"c{k}", nbytes=0))
    assert q.backlog == pytest.approx(1.0)  # 10/10 items
    with q.cond:
        q.take()
    assert q.backlog == pytest.approx(0.9)  # 9/10 items; the first item's bytes left too
    assert q.nbytes == 700


# -- taking, clearing, closing -------------------------------------------------------------


def test_take_is_fifo_and_returns_none_when_empty() -> None:
    q = _queue()
    for name in ("a", "b", "c"):
        q.put(Item(name, nbytes=5))
    with q.cond:
        first = q.take()
        assert first is not None and first.name == "a"
        assert q.nbytes == 10
        rest = [q.take(), q.take()]
        assert [i.name for i in rest if i is not None] == ["b", "c"]
        assert q.take() is None
    assert q.nbytes == 0 and q.dropped == 0


def test_take_all_returns_everything_in_order_and_empties_the_queue() -> None:
    q = _queue()
    for k in range(5):
        q.put(Item(f"i{k}", nbytes=3))
    with q.cond:
        first = q.take()
    assert first is not None and first.name == "i0"
    assert _take_all(q) == ["i1", "i2", "i3", "i4"]
    assert len(q) == 0 and q.nbytes == 0 and q.dropped == 0
    assert _take_all(q) == []
    assert q.put(Item("again"))  # room again after taking


def test_clear_returns_and_counts_what_it_dropped() -> None:
    q = _queue()
    for k in range(3):
        q.put(Item(f"i{k}"))
    q.put(Item("too big", nbytes=10**9))
    with q.cond:
        assert q.clear() == 3
        assert q.clear() == 0
    assert len(q) == 0 and q.nbytes == 0 and q.dropped == 4


def test_a_closed_queue_takes_nothing_more_but_keeps_what_it_holds() -> None:
    q = _queue()
    q.put(Item("before"))
    assert not q.closed
    with q.cond:
        q.close()
        q.close()  # idempotent
    assert q.closed
    assert not q.put(Item("after"))
    assert q.dropped == 1
    assert _take_all(q) == ["before"]


def test_put_wakes_a_consumer_waiting_on_an_empty_queue_and_close_wakes_them_all() -> None:
    q = _queue()
    woke: list[str] = []

    def consume(name: str) -> None:
        with q.cond:
            while not q and not q.closed:
                q.cond.wait(30.0)  # longer than the joins below: only a wake-up helps
            woke.append(name if q.take() is not None else f"{name}:closed")

    first = threading.Thread(target=consume, args=("first",), daemon=True)
    first.start()
    time.sleep(0.05)
    started = time.monotonic()
    q.put(Item("x"))
    first.join(5.0)
    assert woke == ["first"] and time.monotonic() - started < 5.0

    waiters = [threading.Thread(target=consume, args=(f"w{k}",), daemon=True) for k in range(3)]
    for t in waiters:
        t.start()
    time.sleep(0.05)
    with q.cond:
        q.close()
    deadline = time.monotonic() + 5.0
    for t in waiters:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in waiters)
    assert sorted(woke[1:]) == ["w0:closed", "w1:closed", "w2:closed"]


def _figures(q: BoundedBatchQueue[Any]) -> tuple[Any, ...]:
    with q.cond:
        names = [getattr(item, "name", "?") for item in q.take_all()]
    return (names, q.dropped, q.dropped_nbytes, q.high_water_items, q.high_water_bytes)


_SIZES = st.one_of(st.integers(0, 40), st.sampled_from([-1, None, "3", 1.5, "broken"]))


@given(
    st.lists(st.lists(_SIZES, max_size=6), max_size=6),
    st.integers(0, 5),
    st.integers(1, 8),
    st.integers(1, 90),
)
def test_put_many_is_put_of_each_in_order(
    groups: list[list[Any]], close_after: int, max_items: int, max_bytes: int
) -> None:
    one, many = _queue(max_items, max_bytes), _queue(max_items, max_bytes)
    for g, sizes in enumerate(groups):
        if g == close_after:
            for q in (one, many):
                with q.cond:
                    q.close()
        items: list[Any] = [
            _Broken() if size == "broken" else Item(f"g{g}i{k}", nbytes=size)
            for k, size in enumerate(sizes)
        ]
        queued = many.put_many(items)
        assert queued == sum(one.put(item) for item in items)
    assert _figures(many) == _figures(one)


def test_put_many_wakes_a_consumer_waiting_on_an_empty_queue() -> None:
    q = _queue()
    woke: list[list[str]] = []

    def consume() -> None:
        with q.cond:
            while not q:
                q.cond.wait(30.0)  # longer than the join below: only a wake-up helps
            woke.append([item.name for item in q.take_all()])

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    time.sleep(0.05)
    assert q.put_many([Item("a"), Item("b", nbytes=10**9), Item("c")]) == 2
    consumer.join(5.0)
    assert woke == [["a", "c"]] and q.dropped == 1


# -- concurrency ---------------------------------------------------------------------------


@pytest.fixture
def often_switching() -> Iterator[None]:
    """Switch threads every few bytecodes, so that puts interleave inside the queue."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@pytest.mark.usefixtures("often_switching")
def test_concurrent_puts_lose_nothing_that_fit_while_a_consumer_takes() -> None:
    threads, per_thread = 4, 5_000
    q = _queue(max_items=threads * per_thread, max_bytes=threads * per_thread * 10)
    taken: list[Item] = []

    def consume() -> None:
        while True:
            with q.cond:
                while not q and not q.closed:
                    q.cond.wait(0.1)
                if not q and q.closed:
                    return
                taken.extend(q.take_all())

    def produce(t: int) -> None:
        for k in range(per_thread):
            assert q.put(Item(f"{t}:{k}"))

    consumer = threading.Thread(target=consume)
    consumer.start()
    producers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
    for p in producers:
        p.start()
    for p in producers:
        p.join()
    with q.cond:
        q.close()
    consumer.join(10.0)
    assert not consumer.is_alive()
    assert q.dropped == 0 and len(q) == 0 and q.nbytes == 0
    assert len(taken) == threads * per_thread
    # Each producer's items arrive once each, in the order it put them.
    for t in range(threads):
        mine = [int(i.name.split(":")[1]) for i in taken if i.name.startswith(f"{t}:")]
        assert mine == list(range(per_thread))


@pytest.mark.usefixtures("often_switching")
def test_concurrent_puts_into_a_full_queue_count_every_drop() -> None:
    threads, per_thread = 4, 3_000
    q = _queue(max_items=1_000, max_bytes=7_000)  # the byte bound (700 items) binds first
    barrier = threading.Barrier(threads)
    accepted = [0] * threads

    def produce(t: int) -> None:
        barrier.wait()
        for k in range(per_thread):
            if q.put(Item(f"{t}:{k}")):
                accepted[t] += 1

    producers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
    for p in producers:
        p.start()
    for p in producers:
        p.join()
    assert sum(accepted) == len(q) == 700
    assert q.nbytes == 7_000 == q.high_water_bytes
    assert q.high_water_items == 700
    assert q.dropped == threads * per_thread - 700
    with q.cond:
        names = [i.name for i in q.take_all()]
    assert len(set(names)) == 700


# -- fork ----------------------------------------------------------------------------------


def test_the_fork_reset_gives_an_empty_closed_queue_with_a_fresh_lock() -> None:
    q = _queue()
    q.put(Item("a"))
    q.put(Item("too big", nbytes=10**9))
    old = q.cond
    old.acquire()  # as if a parent thread held it at the fork
    try:
        q.after_fork_in_child()
        assert q.cond is not old
        assert len(q) == 0 and q.nbytes == 0 and q.closed
        assert q.dropped == 0 and q.high_water_items == 0 and q.high_water_bytes == 0
        assert not q.put(Item("in the child"))  # takes the new lock; no deadlock
        assert q.dropped == 1
    finally:
        old.release()


@pytest.mark.skipif(sys.platform == "win32", reason="no fork")
def test_a_real_fork_while_another_thread_holds_the_lock() -> None:
    q = _queue()
    q.put(Item("parent's"))
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with q.cond:
            holding.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(5.0)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            os.close(read_fd)
            q.after_fork_in_child()
            put = q.put(Item("child's"))
            with q.cond:
                left = len(q.take_all())
            report = {"put": put, "dropped": q.dropped, "left": left}
            os.write(write_fd, json.dumps(report).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb") as f:
            report = json.loads(f.read() or b"{}")
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        holder.join(5.0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert report == {"put": False, "dropped": 1, "left": 0}
    assert _take_all(q) == ["parent's"]  # the parent's queue is untouched
