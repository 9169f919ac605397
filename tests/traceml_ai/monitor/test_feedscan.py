"""The live feed's step_time scan (``_feedscan.c`` and its twin ``_feedscan_py``) gives
the state the reference path gives it (``decode_batch_body`` + ``LiveState.add_steps``),
or declines and leaves the batch to that path; for generated batches, valid and broken."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from traceml_ai.analysis import STEP_EVENT
from traceml_ai.monitor import _feed, _feedscan_py
from traceml_ai.monitor._feed import LiveFeed
from traceml_ai.monitor._state import COLLECTIVE_KEYS, MAX_RANKS, MEMORY_KEYS, LiveState
from traceml_ai.testing import make_batch_body, make_events, make_identity, make_item
from traceml_ai.transport.wire import ReceivedBatch, decode_batch_body
from traceml_records.internal import load_extension

_C: Any = load_extension("traceml_ai.monitor._feedscan")
if _C is not None:
    _C.configure(STEP_EVENT)

SCANS: list[Any] = [
    pytest.param(_feedscan_py.scan_step_time, id="python"),
    pytest.param(
        _C.scan_step_time if _C is not None else None,
        id="c",
        marks=pytest.mark.skipif(_C is None, reason="_feedscan not built"),
    ),
]

_NAMES = [
    STEP_EVENT,
    "_traceml_internal:forward_time",
    "_traceml_internal:backward_time",
    "_traceml_internal:dataloader_next",
    "_traceml_internal:not_a_phase",
    *(f"u{i}" for i in range(11)),  # past MAX_USER_PHASES: some fold into "other"
    'q"uote',  # escaped by the encoder: the C scan declines
    "naïve",  # not ASCII: the C scan declines
]
_NUMBER = st.one_of(
    st.floats(min_value=0.0, max_value=1e4),
    st.integers(min_value=0, max_value=10_000),
    st.sampled_from([0.0, -0.0, -1.0, -3, 2**53 + 1, 10**19, 1e308, 5e-324]),
)
_ODD: st.SearchStrategy[Any] = st.sampled_from([None, "1.5", True, [], {}])


@st.composite
def _timing(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 30)) == 0:
        return draw(_ODD)
    t: dict[str, Any] = {
        "cpu_ms": draw(_NUMBER),
        "duration_ms": draw(_NUMBER),
        "gpu_ms": draw(st.one_of(st.none(), _NUMBER)),
        "is_gpu": draw(st.booleans()),
        "n_calls": draw(st.sampled_from([1, 1, 1, 2, 7, 0, -1, 1.0])),
    }
    for key in draw(st.lists(st.sampled_from(sorted(t)), max_size=1)):
        if draw(st.booleans()):
            del t[key]
        else:
            t[key] = draw(_ODD)
    return t


@st.composite
def _item(draw: st.DrawFn, seq: int) -> Any:
    if draw(st.integers(0, 40)) == 0:
        return draw(_ODD)
    names = draw(st.lists(st.sampled_from(_NAMES), min_size=0, max_size=6, unique=True))
    if draw(st.integers(0, 10)) > 0:
        names = [STEP_EVENT, *(n for n in names if n != STEP_EVENT)]
    devices = st.dictionaries(
        st.sampled_from(["cpu", "cuda:0", "cuda:1"]), _timing(), min_size=1, max_size=2
    )
    events: Any = {name: draw(devices) for name in sorted(names)}
    if draw(st.integers(0, 40)) == 0:
        events = draw(_ODD)
    item: dict[str, Any] = {
        "timestamp_unix_ns": draw(st.sampled_from([1_793_808_199_881_904_896 + seq, 0, -5])),
        "seq": seq,
        "step": draw(st.sampled_from([seq + 1, seq + 1, seq + 1, 1, 0, -2, "3", 2**62])),
        "events": events,
    }
    said = draw(st.sampled_from([None, None, 512, 0, -4, 3.5, "7", 2**63 - 1]))
    if said is not None:
        item["tokens"] = said
    return item


_REWRITES: list[Callable[[bytes], bytes]] = [
    lambda b: b,
    lambda b: orjson.dumps(orjson.loads(b), option=orjson.OPT_INDENT_2),  # whitespace
    lambda b: b.replace(b'"step":', b'"step":1,"step":', 1),  # a duplicated key
    lambda b: b.replace(b'"node_rank":', b'"node_rank":0,"node_rank":', 1),
    lambda b: b[: len(b) // 2],  # cut
    lambda b: b + b" x",  # trailing garbage
    lambda b: b.replace(b'"cpu"', b'"\\u0063pu"', 1),  # an escape
]


@st.composite
def _batch(draw: st.DrawFn) -> bytes:
    rank = draw(st.sampled_from([0, 1, 2, 3, -1, "2", MAX_RANKS]))
    identity = dict(make_identity(0, world_size=4), global_rank=rank)
    identity["node_rank"] = draw(st.sampled_from([0, 1, None, 2.0]))
    start = draw(st.integers(0, 5))
    items = [draw(_item(start + k)) for k in range(draw(st.integers(0, 4)))]
    body = make_batch_body("step_time", items, identity)
    if draw(st.integers(0, 4)) == 0:
        body = draw(st.sampled_from(_REWRITES))(body)
    return body


class _Close(float):
    def __eq__(self, other: object) -> bool:
        return isinstance(other, float) and math.isclose(self, other, rel_tol=1e-9, abs_tol=1e-12)

    __hash__ = float.__hash__


def _snapshot(state: LiveState) -> dict[str, Any]:
    figures = state.metric_figures(MAX_RANKS)

    def hist(h: Any) -> tuple[Any, ...]:
        # The histograms take a scanned batch's values in bulk: the same counts, the
        # totals equal up to rounding.
        return (h.bounds, h.counts, h.n, _Close(h.total))

    return {
        "ranks": [
            (
                r.rank,
                r.node,
                r.steps,
                r.last_step,
                r.last_end_ns,
                hist(r.step_hist),
                {k: hist(h) for k, h in r.phase_hist.items()},
            )
            for r in state.ranks()
        ],
        "recent": state.recent_steps(),
        "tokens": {rank: dict(live.tokens) for rank, live in state._ranks.items()},
        "medians": figures.recent_median_ms,
        "job": hist(figures.job_step),
        "job_phases": {k: hist(h) for k, h in figures.job_phases.items()},
        "ignored": state.ignored_items,
        "world": state.world_size,
        "folded": state.folded_phase_names,
        "labels": state.scan_labels,
    }


def _reference(state: LiveState, body: bytes) -> None:
    try:
        message = decode_batch_body(body)
    except Exception:
        return
    identity, items = message.get("identity"), message.get("items")
    if type(identity) is dict and type(items) is list and message.get("stream") == "step_time":
        state.add_steps(identity, items)


@pytest.mark.parametrize("scan", SCANS)
@given(bodies=st.lists(_batch(), min_size=1, max_size=6))
def test_scan_gives_the_reference_state_or_declines(scan: Any, bodies: list[bytes]) -> None:
    reference, scanned = LiveState(), LiveState()
    feed = LiveFeed(scanned)
    old = _feed.SCAN_STEP_TIME
    _feed.SCAN_STEP_TIME = scan
    try:
        for body in bodies * 2:  # twice: the second time every name is known
            answer = scan(body, scanned.scan_labels)
            if answer is not None and scan is not _feedscan_py.scan_step_time:
                # The C scan answers only what its twin answers.
                twin = _feedscan_py.scan_step_time(body, scanned.scan_labels)
                assert twin is not None and tuple(twin) == answer
            _reference(reference, body)
            feed._take(ReceivedBatch(time.time_ns(), body, len(body)))
            assert _snapshot(scanned) == _snapshot(reference)
    finally:
        _feed.SCAN_STEP_TIME = old


def _known(state: LiveState, body: bytes) -> None:
    _reference(state, body)
    assert state.scan_labels


@pytest.mark.parametrize("scan", SCANS)
def test_plain_batches_are_scanned_and_new_names_are_left_to_the_reference(scan: Any) -> None:
    state = LiveState()
    items = [make_item("step_time", k, device="cuda:0", tokens=8) for k in range(3)]
    body = make_batch_body(
        "step_time", items, make_identity(1, world_size=2, local_world_size=1, node_rank=0)
    )
    assert scan(body, state.scan_labels) is None  # no name known yet
    _known(state, body)
    answer = scan(body, state.scan_labels)
    assert answer is not None
    rank, node, world, ignored, steps, _ends, step_ms, phases, tokens, top = answer[:10]
    assert (rank, node, world, ignored, steps, top) == (1, 0, 2, 0, [1, 2, 3], 2)
    assert tokens == [(1, 8.0), (2, 8.0), (3, 8.0)]
    assert phases[0] == {"backward": 15.3, "dataloader_wait": 3.7, "forward": 8.2, "optimizer": 0.5}
    assert step_ms == [27.0] * 3 and answer[13] == 0b1111  # four labels: ids 0 to 3
    user = [
        make_item(
            "step_time",
            3,
            events={
                STEP_EVENT: items[0]["events"][STEP_EVENT],
                "mine": items[0]["events"][STEP_EVENT],
            },
        )
    ]
    assert scan(make_batch_body("step_time", user), state.scan_labels) is None


@pytest.mark.skipif(_C is None, reason="_feedscan not built")
@pytest.mark.parametrize(
    "rewrite",
    [
        lambda b: b.replace(b'"cpu_ms"', b'"cpu_\\u006ds"', 1),
        lambda b: b.replace(b'"step":1', b'"step":1,"step":1', 1),
        lambda b: b.replace(
            b'"timestamp_unix_ns":', b'"timestamp_unix_ns":1' + b"0" * 19 + b',"x":', 1
        ),
        lambda b: b.replace(b'"seq":0', b'"seq":1e999', 1),
        lambda b: b.replace(b'"seq":0', b'"seq":"\xff"', 1),
        lambda b: b[:-1],
    ],
)
def test_the_c_scan_declines_what_is_not_the_plain_case(rewrite: Callable[[bytes], bytes]) -> None:
    state = LiveState()
    body = make_batch_body("step_time", [make_item("step_time", 0)])
    _known(state, body)
    assert _C.scan_step_time(body, state.scan_labels) is not None
    assert _C.scan_step_time(rewrite(body), state.scan_labels) is None


@pytest.mark.parametrize("scan", SCANS)
def test_histograms_taken_in_bulk_equal_the_reference_across_many_batches(
    scan: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many ranks' batches between two reads, a buffer bound crossed several times, and
    the run growing past the ranks' own histograms' bound midway."""
    import random

    from traceml_ai.monitor import _state

    monkeypatch.setattr(_state, "PENDING_VALUES", 50)
    monkeypatch.setattr(_feed, "SCAN_STEP_TIME", scan)
    rng = random.Random(3)
    reference, scanned = LiveState(8), LiveState(8)
    feed = LiveFeed(scanned)
    done = [0] * 12
    for n in range(200):
        rank = rng.randrange(12 if n > 100 else 6)
        world = 12 if n > 150 else 6  # past the bound of 8: the ranks' own ones stop
        names = rng.sample(["a", "b", "c", "_traceml_internal:forward_time"], rng.randint(0, 3))
        items = []
        for _ in range(rng.randint(1, 3)):
            ms = {STEP_EVENT: rng.uniform(1, 900), **{k: rng.uniform(0, 300) for k in names}}
            items.append(make_item("step_time", done[rank], events=make_events(ms)))
            done[rank] += 1
        body = make_batch_body("step_time", items, make_identity(rank, world_size=world))
        _reference(reference, body)
        feed._take(ReceivedBatch(time.time_ns(), body, len(body)))
        assert scanned._pending_values <= 50
    assert _snapshot(scanned) == _snapshot(reference)
    assert scanned._label_names  # the scan took batches (new names went the reference way)


_ITEM_SCANS: list[Any] = [
    pytest.param(_feedscan_py.scan_items, id="python"),
    pytest.param(
        _C.scan_items if _C is not None else None,
        id="c",
        marks=pytest.mark.skipif(_C is None, reason="_feedscan not built"),
    ),
]
_VALUE: st.SearchStrategy[Any] = st.one_of(
    st.sampled_from([None, True, 0, -1, 3, 2**63 + 5, 1.5, -0.0, "x", 'q"', "é", [], {"a": 1}]),
    st.floats(min_value=0.0, max_value=1e3),
    st.sampled_from(["cuda:0", "cpu", "_traceml_internal:backward_time", "fwd", "all_reduce"]),
)


@st.composite
def _row_batch(draw: st.DrawFn) -> bytes:
    stream = draw(st.sampled_from(["collectives", "step_memory"]))
    items: list[Any] = []
    for k in range(draw(st.integers(0, 4))):
        item: Any = make_item(stream, draw(st.integers(0, 300)) + k)
        if draw(st.booleans()):
            keys = ["step", "phase", "op", "wait_ms", "group", "device", "peak_allocated_bytes"]
            for key in draw(st.lists(st.sampled_from(keys), max_size=2)):
                if draw(st.integers(0, 3)) == 0:
                    item.pop(key, None)
                else:
                    item[key] = draw(_VALUE)
        if draw(st.integers(0, 30)) == 0:
            item = draw(_VALUE)
        items.append(item)
    rank = draw(st.sampled_from([0, 1, -1, "1"]))
    body = make_batch_body(stream, items, dict(make_identity(0, world_size=2), global_rank=rank))
    if draw(st.integers(0, 4)) == 0:
        body = draw(st.sampled_from(_REWRITES))(body)
    return body


def _rows_snapshot(state: LiveState) -> dict[Any, Any]:
    return {
        rank: (live.waits, live.op_waits, live.waits_unmeasured, live.peak_memory)
        for rank, live in state._ranks.items()
    } | {
        "ignored": state.ignored_items,
        "peaks": state.metric_figures(MAX_RANKS).peak_table.tobytes(),
    }


def _reference_rows(state: LiveState, body: bytes) -> None:
    try:
        message = decode_batch_body(body)
    except Exception:
        return
    identity, items, stream = message["identity"], message["items"], message["stream"]
    if stream == "collectives":
        state.add_collectives(identity, items)
    elif stream == "step_memory":
        state.add_memory(identity, items)


@pytest.mark.parametrize("scan", _ITEM_SCANS)
@given(bodies=st.lists(_row_batch(), min_size=1, max_size=6))
def test_item_scan_gives_the_reference_state_or_declines(scan: Any, bodies: list[bytes]) -> None:
    reference, scanned = LiveState(), LiveState()
    feed = LiveFeed(scanned)
    old = _feed.SCAN_ITEMS
    _feed.SCAN_ITEMS = scan
    try:
        for body in bodies:
            for stream, keys in (("collectives", COLLECTIVE_KEYS), ("step_memory", MEMORY_KEYS)):
                answer = scan(body, stream, keys)
                if answer is not None and scan is not _feedscan_py.scan_items:
                    assert _feedscan_py.scan_items(body, stream, keys) == answer
            _reference_rows(reference, body)
            feed._take(ReceivedBatch(time.time_ns(), body, len(body)))
            assert _rows_snapshot(scanned) == _rows_snapshot(reference)
    finally:
        _feed.SCAN_ITEMS = old


@pytest.mark.parametrize("scan", _ITEM_SCANS)
def test_item_scan_reads_each_items_fields(scan: Any) -> None:
    items = [make_item("collectives", k) for k in range(2)]
    body = make_batch_body("collectives", items, make_identity(3, world_size=4))
    rank, node, world, rows = scan(body, "collectives", COLLECTIVE_KEYS)
    assert (rank, node, world) == (3, 0, 4)
    assert rows == [tuple(item.get(k) for k in COLLECTIVE_KEYS) for item in items]
    assert scan(body, "step_memory", MEMORY_KEYS) is None  # another stream
    nested = make_batch_body("collectives", [dict(items[0], op=["x"])])
    assert scan(nested, "collectives", COLLECTIVE_KEYS) is None


def test_recent_columns_take_the_latest_of_each_step_in_order() -> None:
    """Steps in order (the usual case, read by maps) and out of order or repeated (a
    rank restarted): the columns hold each step number once, its latest, ascending."""
    state = LiveState()
    ms = {STEP_EVENT: 10.0, "_traceml_internal:forward_time": 4.0}
    in_order = [make_item("step_time", k, events=make_events(ms)) for k in range(3)]
    state.add_steps(make_identity(0, world_size=2), in_order)
    again = dict(ms, **{STEP_EVENT: 30.0})
    late = [make_item("step_time", k, events=make_events(again)) for k in (1, 0)]
    state.add_steps(make_identity(1, world_size=2), in_order + late)
    columns = state.recent_columns()
    assert columns[0].steps.tolist() == [1, 2, 3]
    assert columns[0].step_ms.tolist() == [10.0, 10.0, 10.0]
    assert columns[1].steps.tolist() == [1, 2, 3]
    assert columns[1].step_ms.tolist() == [30.0, 30.0, 10.0]
    assert columns[1].phases["forward"].values.tolist() == [4.0, 4.0, 4.0]


_NUMBER_TEXT = r"-?(0|[1-9][0-9]{0,21})(\.[0-9]{1,24})?([eE][+-]?[0-9]{1,3})?"


@pytest.mark.skipif(_C is None, reason="_feedscan not built")
@given(
    text=st.one_of(
        st.from_regex(_NUMBER_TEXT, fullmatch=True),
        st.floats(allow_nan=False, allow_infinity=False).map(repr),
    )
)
def test_the_c_scan_reads_a_number_as_orjson_does(text: str) -> None:
    """Every number the C scan reads (its own fast path or strtod) is the double orjson
    and Python read from the same text, or the scan declines."""
    body = make_batch_body("collectives", [make_item("collectives", 0, wait_ms=None)])
    marked = body.replace(b'"wait_ms":null', b'"wait_ms":' + text.encode(), 1)
    assert marked != body
    answer = _C.scan_items(marked, "collectives", COLLECTIVE_KEYS)
    try:
        expected = orjson.loads(marked)["items"][0]["wait_ms"]
    except orjson.JSONDecodeError:
        assert answer is None
        return
    if answer is not None:
        (read,) = [row[3] for row in answer[3]]
        assert type(read) is type(expected) and read == expected
        if type(read) is float:
            assert math.copysign(1.0, read) == math.copysign(1.0, expected)
            assert read == float(text)
