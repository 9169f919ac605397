"""The builder's line mode (for the JSONL exporter) against its record mode.

In line mode the C encoder writes the lines of step_time, step_memory, process and
collectives items itself (process's with the batch's pid among the item's fields): from the frame body as the server queues it (``encode_batch``, no Python
object per item) or, for a body not in our senders' plain form, from the parsed items
(``encode_items``); either leaves every item it cannot vouch for to the strict Python
loaders. Whatever the items, both modes must give the same lines (record mode's lines
are ``dumps_line`` of its records) and the same skipped count, from the decoded
message and from its bytes alike. Record mode is the oracle; its own correctness is
tested in test_export_builder.py, whose suite also runs in line mode (the
``builder_mode`` fixture): what is left here are the C line encoders' own edge cases
(fallback at a malformed item between good ones, odd but valid items, identities it
must escape or leave to Python, bodies in and out of the plain form, a hypothesis
differential over generated items).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.builder_items import BIG, MALFORMED
from tests.custom_exporters import (
    IDENTITY,
    OBSERVED_NS,
    batch,
    phase,
    process_item,
    step_memory_item,
    step_time_item,
)
from tests.e2e_helpers import REPO
from tests.strategies import consistent_json
from traceml_ai.export import RecordBuilder
from traceml_ai.export._builder import (
    _LINE_PLANS,
    MAX_EVENT_ENTRIES,
    MAX_STRING_BYTES,
    BuildResult,
)
from traceml_ai.export._encoded import EncodedLines
from traceml_ai.testing import make_item
from traceml_ai.transport.wire import (
    ReceivedBatch,
    batch_envelope,
    encode_batch_frame,
    encode_item,
    make_batch_message,
)
from traceml_records import (
    STREAMS_BY_NAME,
    ProcessRecord,
    StepTimeRecord,
    dumps_line,
    loads_line,
)
from traceml_records._codec import dumps_lines
from traceml_records._generated.records import IDENTITY_FIELDS


def _written(group: Any, include_hostname: bool, stream: str) -> tuple[bytes, int]:
    """What the JSONL exporter writes for a group: (lines, records without a line)."""
    if group is None:
        return b"", 0
    if isinstance(group, EncodedLines):
        return group.data, 0
    record_class = STREAMS_BY_NAME[stream].record_class
    lines, bad = dumps_lines(group, record_class, include_hostname=include_hostname)
    return b"".join(lines), bad


def _payloads(stream: str, items: list[Any], identity: Any) -> list[ReceivedBatch]:
    """The batch as a direct caller hands it (decoded) and as the server queues it (the
    frame body), when orjson can write it."""
    decoded = batch(stream, copy.deepcopy(items), identity=identity)
    try:
        return [decoded, batch_bytes(stream, items, identity)]
    except orjson.JSONEncodeError:
        return [decoded]


def batch_bytes(stream: str, items: list[Any], identity: Any = None) -> ReceivedBatch:
    """The frame body of a batch as our senders write it, still encoded."""
    ident = IDENTITY if identity is None else identity
    body = orjson.dumps(make_batch_message("t", ident, stream, items))
    return ReceivedBatch(OBSERVED_NS, body, len(body))


def _modes(
    items: list[Any],
    identity: Any = None,
    include_hostname: bool = False,
    stream: str = "step_time",
) -> None:
    """Build ``items`` in both modes, decoded and encoded; the same lines and counts must
    come out of each reading."""
    for received in _payloads(stream, items, identity):
        payload = received.payload
        fresh = copy.deepcopy(payload) if isinstance(payload, dict) else payload
        by_records = RecordBuilder((stream,), include_hostname).build(received)
        received = ReceivedBatch(received.observed_timestamp_unix_ns, fresh, received.nbytes)
        by_lines = RecordBuilder((stream,), include_hostname, encode_lines=True).build(received)
        assert by_lines.skipped_items == by_records.skipped_items
        records = by_records.records.get(stream)
        group = by_lines.records.get(stream)
        assert _written(group, include_hostname, stream) == _written(
            records, include_hostname, stream
        )
        assert (group is None) == (records is None)
        if isinstance(group, EncodedLines):
            assert records is not None
            assert len(group) == len(records)
            first = dumps_line(records[0], include_hostname=include_hostname)
            assert group[0] == loads_line(first)


def test_line_mode_needs_the_extension_and_takes_step_time() -> None:
    builder = RecordBuilder(("step_time",), False, encode_lines=True)
    assert builder.encodes_lines
    group = builder.build(batch("step_time", [step_time_item()])).records["step_time"]
    assert type(group) is EncodedLines
    assert not RecordBuilder(("step_time",), False).encodes_lines


LINE_STREAMS = ("step_time", "step_memory", "process", "collectives")
"""The streams whose lines the C encoder writes (``_builder._LINE_PLANS``)."""

GOOD: dict[str, Any] = {
    "step_time": lambda seq: step_time_item(seq=seq, step=seq + 1),
    "step_memory": lambda seq: step_memory_item(seq=seq, step=seq + 1),
    "process": lambda seq: process_item(seq=seq, gpu=seq % 2 == 1),
    "collectives": lambda seq: make_item("collectives", seq),
}
LINE_MALFORMED = [(stream, item) for stream, _, item in MALFORMED if stream in LINE_STREAMS]


def test_the_c_encoder_writes_these_streams() -> None:
    assert tuple(_LINE_PLANS) == LINE_STREAMS


@pytest.mark.parametrize("index", range(len(LINE_MALFORMED)))
def test_every_malformed_item_alone_and_between_good_ones(index: int) -> None:
    stream, bad = LINE_MALFORMED[index]
    good = GOOD[stream]
    _modes([bad], stream=stream)
    # between good items: the good lines must keep their places around a skip
    _modes([good(0), bad, good(2), bad, good(4)], stream=stream)


def _events(**phases: dict[str, Any]) -> dict[str, Any]:
    return {"_traceml_internal:step_time": {"cpu": phase(27.0)}, **phases}


ODD_BUT_VALID: list[dict[str, Any]] = [
    # keys out of order, at every level
    {"events": _events(), "step": 2, "seq": 1, "timestamp_unix_ns": 5},
    {
        "timestamp_unix_ns": 5,
        "seq": 1,
        "step": 2,
        "events": {"z": {"cpu": phase()}, **_events(), "a": {"cpu": phase()}},
    },
    {
        "timestamp_unix_ns": 5,
        "seq": 1,
        "step": 2,
        "events": _events(p={"cuda:1": phase(1.0, 2.0), "cpu": phase(), "cuda:0": phase(1.0, 3.0)}),
    },
    {
        "timestamp_unix_ns": 5,
        "seq": 1,
        "step": 2,
        "events": _events(
            p={
                "cpu": {
                    "n_calls": 2,
                    "is_gpu": False,
                    "gpu_ms": None,
                    "duration_ms": 1.0,
                    "cpu_ms": 1.0,
                }
            }
        ),
    },
    # ints where floats go (the loader makes floats of them)
    {"timestamp_unix_ns": 5, "seq": 1, "step": 2, "events": _events(p={"cpu": phase(3)})},
    # non-finite gpu_ms: becomes null
    {
        "timestamp_unix_ns": 5,
        "seq": 1,
        "step": 2,
        "events": _events(
            p={
                "cpu": {
                    "cpu_ms": 1.0,
                    "duration_ms": 1.0,
                    "gpu_ms": math.nan,
                    "is_gpu": False,
                    "n_calls": 1,
                }
            }
        ),
    },
    # escapes, non-ASCII, a name at the size limit, many events (past the C fast path)
    {
        "timestamp_unix_ns": 5,
        "seq": 1,
        "step": 2,
        "events": _events(**{'q"\\\n\x01é😀': {"cpu": phase()}}),
    },
    {
        "timestamp_unix_ns": 5,
        "seq": 1,
        "step": 2,
        "events": _events(**{"x" * 65536: {"cpu": phase()}}),
    },
    {"timestamp_unix_ns": 5, "seq": 1, "step": 2, "events": _events(**{BIG: {"cpu": phase()}})},
    {
        "timestamp_unix_ns": 5,
        "seq": 1,
        "step": 2,
        "events": _events(**{f"phase {i:03d}": {"cpu": phase(i + 0.25)} for i in range(100)}),
    },
    {
        "timestamp_unix_ns": 5,
        "seq": 1,
        "step": 2,
        "events": _events(**{f"p{i}": {"cpu": phase()} for i in range(MAX_EVENT_ENTRIES)}),
    },
    # extreme numbers
    {"timestamp_unix_ns": 2**63 - 1, "seq": 0, "step": 2**63 - 1, "events": _events()},
    {
        "timestamp_unix_ns": 0,
        "seq": 0,
        "step": 1,
        "events": _events(p={"cpu": phase(5e-324)}, q={"cpu": phase(1.7976931348623157e308)}),
    },
]


ODD_STEP_MEMORY: list[dict[str, Any]] = [
    {"peak_reserved_bytes": None, "peak_allocated_bytes": 0, "device": "cpu", "step": 2, "seq": 1, "timestamp_unix_ns": 5},
    {**step_memory_item(), "peak_allocated_bytes": 2**63 - 1, "timestamp_unix_ns": 2**63 - 1},
    {**step_memory_item(), "device": "xpu:12"},
]  # fmt: skip


ODD_PROCESS: list[dict[str, Any]] = [
    # keys out of order (pid's place in the line is the record's, not the item's)
    dict(reversed(list(process_item(gpu=True).items()))),
    {**process_item(gpu=True), "gpu_uuid": 'GPU-é😀"\n'},
    {**process_item(gpu=True), "gpu_uuid": None},
    {k: v for k, v in process_item(gpu=True).items() if k != "gpu_uuid"},
    {**process_item(), "cpu_percent": 0, "ram_total_bytes": None, "cpu_logical_cores": None},
    {**process_item(), "ram_used_bytes": 2**63 - 1, "timestamp_unix_ns": 2**63 - 1},
    {**process_item(), "cpu_percent": 5e-324, "gpu_available": None},
    # invalid: the strict loaders skip them
    {**process_item(), "pid": 4242},  # the batch's field in the item
    {**process_item(), "ram_used_bytes": 2**63},
    {**process_item(), "cpu_percent": math.inf},
    {**process_item(), "gpu_uuid": ""},
    {**process_item(), "gpu_uuid": "x" * (MAX_STRING_BYTES + 1)},
    {**process_item(), "gpu_uuid": "\ud800"},
    {k: v for k, v in process_item().items() if k != "gpu_count"},
]


@pytest.mark.parametrize("index", range(len(ODD_PROCESS)))
def test_odd_process_items(index: int) -> None:
    _modes([ODD_PROCESS[index]], stream="process")
    _modes([process_item(seq=0), ODD_PROCESS[index], process_item(seq=2)], stream="process")


PIDS: list[Any] = [1, 4242, 2**63 - 1, 0, -1, None, True, 1.0, 2**63, 2**64, "4242", []]


@pytest.mark.parametrize("pid", [*PIDS, "missing"])
@pytest.mark.parametrize("include_hostname", [False, True])
def test_the_batch_pid_of_process_lines(pid: Any, include_hostname: bool) -> None:
    """pid comes from the batch and sits among the item's fields in the line: every
    value the identity may hold is written, or leaves the items to Python, exactly as
    record mode does."""
    identity = {k: v for k, v in IDENTITY.items() if k != "pid"}
    if pid != "missing":
        identity["pid"] = pid
    _modes([GOOD["process"](i) for i in range(3)], identity, include_hostname, "process")


def test_the_c_encoder_writes_process_lines_with_the_batch_pid() -> None:
    """The process lines come from C (nothing left to Python) with a valid pid, and a
    pid it cannot vouch for leaves every item to Python; from the bytes alike."""
    from traceml_records._codec import encode_batch, encode_items, split_batch

    assert encode_items is not None and encode_batch is not None and split_batch is not None
    line = _LINE_PLANS["process"]
    ((pid_index, name),) = line.batch_fields
    assert name == "pid" and line.record_class is ProcessRecord
    items = [GOOD["process"](i) for i in range(4)]
    args = (ProcessRecord, line.first_item_field, b"{", MAX_STRING_BYTES, None, line.conditions)
    data, count, pending = encode_items(items, *args, ((pid_index, 77),))
    assert (count, pending) == (4, []) and data.count(b',"seq":1,"pid":77,"cpu_percent":') == 1
    body = _body(items, "process")
    parts = split_batch(body)
    assert parts is not None
    assert encode_batch(body, parts[3], *args, ((pid_index, 77),)) == (data, 4)
    all_pending = (b"", 0, [(i, 0) for i in range(4)])
    for bad in (0, None, 2**64, True):
        assert encode_items(items, *args, ((pid_index, bad),)) == all_pending
        assert encode_batch(body, parts[3], *args, ((pid_index, bad),)) is None
    with pytest.raises(ValueError):
        encode_items(items, *args, ((line.first_item_field, 77),))  # must follow an item field


@pytest.mark.parametrize("index", range(len(ODD_BUT_VALID)))
def test_odd_items(index: int) -> None:
    _modes([ODD_BUT_VALID[index]])
    _modes([step_time_item(seq=0), ODD_BUT_VALID[index], step_time_item(seq=2)])


@pytest.mark.parametrize("index", range(len(ODD_STEP_MEMORY)))
def test_odd_step_memory_items(index: int) -> None:
    _modes([ODD_STEP_MEMORY[index]], stream="step_memory")
    _modes([step_memory_item(seq=0), ODD_STEP_MEMORY[index]], stream="step_memory")


@pytest.mark.parametrize(
    "identity",
    [
        IDENTITY,
        {**IDENTITY, "hostname": None},
        {**IDENTITY, "hostname": 'h"\u00e9\n'},
        {**IDENTITY, "hostname": "\ud800"},  # unencodable: record mode decides
        {**IDENTITY, "world_size": 0},  # invalid: every item skipped
    ],
)
@pytest.mark.parametrize("include_hostname", [False, True])
@pytest.mark.parametrize("stream", LINE_STREAMS)
def test_identities(identity: Any, include_hostname: bool, stream: str) -> None:
    _modes([GOOD[stream](i) for i in range(3)], identity, include_hostname, stream)


def test_encoded_bytes_payload_as_the_server_queues_it() -> None:
    items = [step_time_item(seq=i, step=i + 1) for i in range(50)]
    received = batch_bytes("step_time", items)
    lines = RecordBuilder(("step_time",), False, encode_lines=True).build(received)
    records = RecordBuilder(("step_time",), False).build(received)
    group = lines.records["step_time"]
    assert isinstance(group, EncodedLines)
    assert group.data == b"".join(dumps_line(r) for r in records.records["step_time"])


@pytest.mark.parametrize("stream", LINE_STREAMS)
def test_a_plain_body_is_written_without_parsing_it(
    stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frames as a rank's sender cuts them (items encoded one by one, then joined) are
    written straight from their bytes: with the parser gone, the lines still come."""
    from traceml_ai.export import _builder

    items = [GOOD[stream](i) for i in range(20)]
    frame = encode_batch_frame(
        batch_envelope("t", IDENTITY, stream), [encode_item(i) for i in items]
    )
    received = ReceivedBatch(OBSERVED_NS, frame[4:], len(frame) - 4)
    expected = RecordBuilder((stream,), True).build(received)

    def no_parsing(body: bytes) -> Any:
        raise AssertionError("the body was parsed")

    monkeypatch.setattr(_builder, "decode_batch_body", no_parsing)
    built = RecordBuilder((stream,), True, encode_lines=True).build(received)
    group = built.records[stream]
    assert isinstance(group, EncodedLines) and len(group) == 20 and built.skipped_items == 0
    assert _written(group, True, stream) == _written(expected.records[stream], True, stream)


def _body(items: list[Any], stream: str = "step_time") -> bytes:
    return orjson.dumps(make_batch_message("t", IDENTITY, stream, items))


def _same_from_bytes(body: bytes, stream: str = "step_time") -> BuildResult:
    """Line mode and record mode on the same frame body: same lines, same counts."""
    received = ReceivedBatch(OBSERVED_NS, body, len(body))
    by_records = RecordBuilder((stream,), False).build(received)
    by_lines = RecordBuilder((stream,), False, encode_lines=True).build(received)
    assert by_lines.skipped_items == by_records.skipped_items
    assert _written(by_lines.records.get(stream), False, stream) == _written(
        by_records.records.get(stream), False, stream
    )
    return by_lines


PLAIN = _body([step_time_item(seq=i, step=i + 1, device="cuda:0") for i in range(3)])
EDITS: list[tuple[bytes, bytes]] = [
    # floats in other forms than orjson's: orjson's reading and text win
    (b'"cpu_ms":8.2,', b'"cpu_ms":8.20,'),
    (b'"cpu_ms":8.2,', b'"cpu_ms":82E-1,'),
    (b'"cpu_ms":8.2,', b'"cpu_ms":8.2000000000000001,'),
    (b'"duration_ms":27.0,', b'"duration_ms":2.7e1,'),
    (b'"cpu_ms":8.2,', b'"cpu_ms":-0.0,'),
    (b'"cpu_ms":8.2,', b'"cpu_ms":1e400,'),  # beyond a double
    (b'"cpu_ms":8.2,', b'"cpu_ms":15,'),  # an int where a float goes
    (b'"n_calls":1', b'"n_calls":1.0'),
    (b'"n_calls":1', b'"n_calls":01'),  # not JSON
    (b'"n_calls":1', b'"n_calls":-0'),
    (b'"seq":1,', b'"seq":99999999999999999999,'),
    (b'"seq":1,', b'"seq":-1,'),
    # whitespace, escapes, non-ASCII: the parsed way
    (b'"seq":1,', b'"seq": 1,'),
    (b'"cuda:0"', rb'"cuda\u003a0"'),
    (b'"my_phase"', rb'"my_ph\u00e4se"'),
    (b'"my_phase"', '"my_phäse"'.encode()),
    # maps: keys out of order are sorted, a repeated key is orjson's (the last wins)
    (b'{"_traceml_internal:forward_time"', b'{"zz":{"cpu":{"cpu_ms":1.0,"duration_ms":1.0,"gpu_ms":null,"is_gpu":false,"n_calls":1}},"_traceml_internal:forward_time"'),
    (b'{"_traceml_internal:forward_time"', b'{"my_phase":{"cpu":{"cpu_ms":9.0,"duration_ms":9.0,"gpu_ms":null,"is_gpu":false,"n_calls":1}},"_traceml_internal:forward_time"'),
    (b'{"cpu_ms":8.2,', b'{"n_calls":2,"cpu_ms":8.2,'),  # a repeated object key
    (b'"is_gpu":true,"n_calls":1}', b'"n_calls":1,"is_gpu":true}'),
    (b'"is_gpu":true,"n_calls":1}', b'"is_gpu":true}'),
    (b'"is_gpu":true,"n_calls":1}', b'"is_gpu":true,"n_calls":1,"x":1}'),
    (b'{"timestamp_unix_ns"', b'{"step":1,"timestamp_unix_ns"'),
    # the envelope
    (b'{"v":1,', b'{"v":1,"x":2,'),
    (b'"identity":{', b'"identity":{"note":"a}\"]",'),
    (b'"identity":{', b'"identity":[{'),
    (b',"items":[', b',"items":{'),
    (b'}]}', b'}],"more":1}'),
    (b'}]}', b'}]} '),
    (b'}]}', b'}]'),
    (b'}]}', b'}]}}'),
]  # fmt: skip


PLAIN_PROCESS = _body([GOOD["process"](i) for i in range(3)], "process")
PROCESS_EDITS: list[tuple[bytes, bytes]] = [
    # the batch's pid, which every line carries among the item's fields
    (b'"pid":4242', b'"pid":1'),
    (b'"pid":4242', b'"pid":0'),
    (b'"pid":4242', b'"pid":-1'),
    (b'"pid":4242', b'"pid":4242.0'),
    (b'"pid":4242', b'"pid":9223372036854775808'),
    (b'"pid":4242', b'"pid":null'),
    (b'"pid":4242', b'"pid":"4242"'),
    (b',"pid":4242', b''),
    (b'"hostname":"host-a","pid":4242', b'"pid":4242,"hostname":"host-a"'),
    # an item holding the batch's field, in order or not
    (b'"seq":1,', b'"seq":1,"pid":4242,'),
    (b'{"timestamp_unix_ns"', b'{"pid":4242,"timestamp_unix_ns"'),
    (b',"gpu_uuid":null}', b',"gpu_uuid":null,"pid":4242}'),
    # the item's keys out of order, optional ones left out
    (b'"seq":0,"cpu_percent":153.5,', b'"cpu_percent":153.5,"seq":0,'),
    (b'{"timestamp_unix_ns":1793808199881904896,', b'{"gpu_uuid":null,"timestamp_unix_ns":1793808199881904896,'),
    (b',"gpu_uuid":null}', b'}'),
    (b',"gpu_uuid":null}', b',"gpu_uuid":""}'),
    (b'"cpu_percent":153.5', b'"cpu_percent":153.50'),
    (b'"cpu_percent":153.5', b'"cpu_percent":153'),
    (b'"gpu_available":false', b'"gpu_available":true'),
    (b'"gpu_count":null', b'"gpu_count":1'),
]  # fmt: skip


@pytest.mark.parametrize(
    ("plain", "old", "new", "stream"),
    [(PLAIN, old, new, "step_time") for old, new in EDITS]
    + [(PLAIN_PROCESS, old, new, "process") for old, new in PROCESS_EDITS],
)
def test_bodies_off_the_plain_form(plain: bytes, old: bytes, new: bytes, stream: str) -> None:
    assert old in plain
    _same_from_bytes(plain.replace(old, new, 1), stream)
    _same_from_bytes(plain.replace(old, new), stream)


def test_unsorted_events_and_odd_floats_are_read_from_the_bytes() -> None:
    from traceml_records._codec import encode_batch, split_batch

    assert encode_batch is not None and split_batch is not None
    body = PLAIN.replace(b'"cpu_ms":8.2,', b'"cpu_ms":8.20,').replace(
        b'{"_traceml_internal:forward_time"',
        b'{"zz":{"cpu":{"cpu_ms":1.25,"duration_ms":1.25,"gpu_ms":null,"is_gpu":false,"n_calls":1}},'
        b'"_traceml_internal:forward_time"',
    )
    parts = split_batch(body)
    assert parts is not None
    line = _LINE_PLANS["step_time"]
    encoded = encode_batch(
        body, parts[3], line.record_class, line.first_item_field, b"{", MAX_STRING_BYTES,
        line.rules, None, (),
    )  # fmt: skip
    assert encoded is not None and encoded[1] == 3
    assert b"8.20" not in encoded[0] and encoded[0].count(b'"zz":') == 3
    built = _same_from_bytes(body)
    assert built.records["step_time"][0].events["zz"]["cpu"].cpu_ms == 1.25


@pytest.mark.parametrize(("plain", "stream"), [(PLAIN, "step_time"), (PLAIN_PROCESS, "process")])
@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300)
@given(
    data=st.data(),
    byte=st.sampled_from(list(b'{}[]",:0123456789.eE-+ \\atrufnl\x00\xc3')),
    how=st.sampled_from(["replace", "insert", "delete", "truncate"]),
)
def test_hostile_bytes_are_read_as_orjson_reads_them(
    plain: bytes, stream: str, data: st.DataObject, byte: int, how: str
) -> None:
    """Any damage to a body: line mode reads it as record mode does (never raises)."""
    body = bytearray(plain)
    at = data.draw(st.integers(min_value=0, max_value=len(plain) - 1))
    if how == "replace":
        body[at] = byte
    elif how == "insert":
        body.insert(at, byte)
    elif how == "delete":
        del body[at]
    else:
        del body[at:]
    _same_from_bytes(bytes(body), stream)


def _item_from_record(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in IDENTITY_FIELDS | {"stream", "schema_version"}}


MUTATIONS = st.sampled_from(
    [
        lambda i: None,
        lambda i: i.update(step=0),
        lambda i: i.update(seq=True),
        lambda i: i["events"].update({"_traceml_internal:nope": {"cpu": phase()}}),
        lambda i: i["events"].pop("_traceml_internal:step_time", None),
        lambda i: i.update(events=dict(reversed(list(i["events"].items())))),
        lambda i: [t.update(duration_ms=t["cpu_ms"] + 1.0) for d in i["events"].values() for t in d.values()],
        lambda i: [t.update(is_gpu=not t["is_gpu"]) for d in i["events"].values() for t in d.values()],
        lambda i: i.pop("seq"),
    ]
)  # fmt: skip


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    records=st.lists(consistent_json("step_time"), min_size=1, max_size=6),
    mutations=st.lists(MUTATIONS, min_size=6, max_size=6),
    include_hostname=st.booleans(),
)
def test_generated_items(
    records: list[dict[str, Any]], mutations: list[Any], include_hostname: bool
) -> None:
    items = [_item_from_record(r) for r in records]
    for item, mutate in zip(items, mutations, strict=False):
        mutate(item)
    _modes(items, include_hostname=include_hostname)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    stream=st.sampled_from(["step_memory", "process", "collectives"]),
    data=st.data(),
    include_hostname=st.booleans(),
)
def test_generated_items_of_the_other_streams(
    stream: str, data: st.DataObject, include_hostname: bool
) -> None:
    records = data.draw(st.lists(consistent_json(stream), min_size=1, max_size=6))
    items = [_item_from_record(r) for r in records]
    for item in items:
        if data.draw(st.booleans()):
            key = data.draw(st.sampled_from(sorted(item)))
            item[key] = data.draw(st.sampled_from([None, -1, 1.5, "x", True, 2**64]))
    _modes(items, include_hostname=include_hostname, stream=stream)


PROCESS_MUTATIONS = st.sampled_from(
    [
        lambda i: None,
        lambda i: i.update(pid=7),
        lambda i: i.pop("gpu_uuid", None),
        lambda i: i.pop("seq"),
        lambda i: i.update(gpu_available=not i["gpu_available"]),
        lambda i: i.update(cpu_percent=math.nan),
        lambda i: i.update(cpu_percent=3),
        lambda i: i.update(ram_total_bytes=2**64),
        lambda i: i.update(gpu_uuid="é" * 3),
        lambda i: i.update(dict(reversed(list(i.items())))),
    ]
)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    records=st.lists(consistent_json("process"), min_size=1, max_size=5),
    mutations=st.lists(PROCESS_MUTATIONS, min_size=5, max_size=5),
    pid=st.one_of(
        st.integers(min_value=1, max_value=2**63 - 1), st.sampled_from([*PIDS, "missing"])
    ),
    include_hostname=st.booleans(),
)
def test_generated_process_items(
    records: list[dict[str, Any]], mutations: list[Any], pid: Any, include_hostname: bool
) -> None:
    """Generated process items (and the batch's pid) in both modes: same lines."""
    items = [_item_from_record(r) for r in records]
    for item, mutate in zip(items, mutations, strict=False):
        mutate(item)
    identity = {k: v for k, v in IDENTITY.items() if k != "pid"}
    if pid != "missing":
        identity["pid"] = pid
    _modes(items, identity, include_hostname, "process")


def test_the_c_encoder_takes_plainly_valid_items_itself() -> None:
    from traceml_records._codec import encode_items

    assert encode_items is not None
    builder = RecordBuilder(("step_time",), False, encode_lines=True)
    builder.build(batch("step_time", [step_time_item()]))  # the loader learns "cpu" matches
    items = [step_time_item(seq=i, step=i + 1) for i in range(10)]
    items[3] = {**items[3], "step": 0}  # invalid: left to Python
    line = _LINE_PLANS["step_time"]
    data, count, pending = encode_items(
        items, StepTimeRecord, line.first_item_field, b"{", MAX_STRING_BYTES, line.rules, None, ()
    )
    assert count == 9
    assert [index for index, _ in pending] == [3]
    (offset,) = [at for _, at in pending]
    assert data[:offset].count(b"\n") == 3


def test_without_the_extension_line_mode_builds_records() -> None:
    import os
    import subprocess
    import sys

    code = (
        "from tests.custom_exporters import batch, step_time_item\n"
        "from traceml_ai.export import RecordBuilder\n"
        "builder = RecordBuilder(('step_time',), False, encode_lines=True)\n"
        "assert not builder.encodes_lines\n"
        "group = builder.build(batch('step_time', [step_time_item()])).records['step_time']\n"
        "print(type(group).__name__, len(group))\n"
    )
    env = {**os.environ, "TRACEML_PURE_PYTHON": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["list", "1"]


def test_the_c_encoder_keeps_its_own_pattern_matches() -> None:
    from traceml_records._generated import records as generated

    # A device key never seen before: C matches it against the schema's pattern itself
    # and writes the line, without the loaders' memo (no cache shared with C) ...
    generated._MATCHED_0.clear()
    item = step_time_item(device="xpu:7")
    received = batch("step_time", [item])
    built = RecordBuilder(("step_time",), False, encode_lines=True).build(received)
    group = built.records.get("step_time")
    assert isinstance(group, EncodedLines) and b'"xpu:7"' in group.data
    assert "xpu:7" not in generated._MATCHED_0
    # ... and a key the pattern refuses still goes to the strict loaders, which skip it.
    bad = step_time_item(seq=1, step=2, device="XPU:7")
    built = RecordBuilder(("step_time",), False, encode_lines=True).build(batch("step_time", [bad]))
    assert built.skipped_items == 1 and built.records.get("step_time") is None
    _modes([item, bad])


@pytest.mark.parametrize("max_prefixes", [2, 65_536])
def test_one_builder_reused_across_ranks_and_times(
    max_prefixes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line mode keeps each identity block's line start (around the observed
    timestamp) from one batch to the next: a builder that sees the same ranks again at
    other times, a bad identity among them, and more identities than it keeps, writes
    what a fresh record-mode build writes, batch by batch."""
    from traceml_ai.export import _builder

    monkeypatch.setattr(_builder, "_MAX_PREFIXES", max_prefixes)
    identities = [
        {
            **IDENTITY,
            "global_rank": rank,
            "local_rank": rank % 2,
            "hostname": f"n{rank}",
            "pid": 100 + rank,
        }
        for rank in range(4)
    ] + [
        {**IDENTITY, "world_size": 0},
        {**IDENTITY, "hostname": "\ud800"},
        {**IDENTITY, "pid": 0},
    ]
    for include_hostname in (False, True):
        reused = RecordBuilder(LINE_STREAMS, include_hostname, encode_lines=True)
        for round_ in range(3):
            for n, identity in enumerate(identities):
                for stream in LINE_STREAMS:
                    items = [GOOD[stream](round_ * 10 + i) for i in range(2)]
                    try:
                        body = orjson.dumps(make_batch_message("t", identity, stream, items))
                    except orjson.JSONEncodeError:
                        continue
                    observed = OBSERVED_NS + round_ * 1_000_003 + n
                    received = ReceivedBatch(observed, body, len(body))
                    by_lines = reused.build(received)
                    by_records = RecordBuilder((stream,), include_hostname).build(received)
                    assert by_lines.skipped_items == by_records.skipped_items
                    assert _written(
                        by_lines.records.get(stream), include_hostname, stream
                    ) == _written(by_records.records.get(stream), include_hostname, stream)
        assert len(reused._prefixes) <= max_prefixes
