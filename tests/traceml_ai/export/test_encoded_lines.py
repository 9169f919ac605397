"""The builder's line mode (for the JSONL exporter) against its record mode.

In line mode the C encoder writes step_time lines straight from the wire items and
leaves every item it cannot vouch for to the strict Python loaders. Whatever the
items, both modes must give the same lines (record mode's lines are
``dumps_line`` of its records) and the same skipped count. Record mode is the oracle;
its own correctness is tested in test_export_builder.py, whose suite also runs in line
mode (the ``builder_mode`` fixture): what is left here are the C line encoder's own
edge cases (fallback at a malformed item between good ones, odd but valid items,
identities it must escape or leave to Python, the server's payload, a hypothesis
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
from tests.custom_exporters import IDENTITY, batch, phase, step_time_item
from tests.e2e_helpers import REPO
from tests.strategies import consistent_json
from traceml_ai.export import RecordBuilder
from traceml_ai.export._builder import MAX_EVENT_ENTRIES
from traceml_ai.export._encoded import EncodedLines
from traceml_ai.transport.wire import ReceivedBatch
from traceml_records import StepTimeRecord, dumps_line, loads_line
from traceml_records._codec import dumps_lines
from traceml_records._generated.records import IDENTITY_FIELDS


def _written(group: Any, include_hostname: bool) -> tuple[bytes, int]:
    """What the JSONL exporter writes for a group: (lines, records without a line)."""
    if group is None:
        return b"", 0
    if isinstance(group, EncodedLines):
        return group.data, 0
    lines, bad = dumps_lines(group, StepTimeRecord, include_hostname=include_hostname)
    return b"".join(lines), bad


def _modes(items: list[Any], identity: Any = None, include_hostname: bool = False) -> None:
    """Build ``items`` in both modes; the same lines and counts must come out."""
    received = batch("step_time", copy.deepcopy(items), identity=identity)
    by_records = RecordBuilder(("step_time",), include_hostname).build(received)
    received = batch("step_time", copy.deepcopy(items), identity=identity)
    by_lines = RecordBuilder(("step_time",), include_hostname, encode_lines=True).build(received)
    assert by_lines.skipped_items == by_records.skipped_items
    records = by_records.records.get("step_time")
    group = by_lines.records.get("step_time")
    assert _written(group, include_hostname) == _written(records, include_hostname)
    assert (group is None) == (records is None)
    if isinstance(group, EncodedLines):
        assert records is not None
        assert len(group) == len(records)
        assert group[0] == loads_line(dumps_line(records[0], include_hostname=include_hostname))


def test_line_mode_needs_the_extension_and_takes_step_time() -> None:
    builder = RecordBuilder(("step_time",), False, encode_lines=True)
    assert builder.encodes_lines
    group = builder.build(batch("step_time", [step_time_item()])).records["step_time"]
    assert type(group) is EncodedLines
    assert not RecordBuilder(("step_time",), False).encodes_lines


STEP_TIME_MALFORMED = [item for stream, _, item in MALFORMED if stream == "step_time"]


@pytest.mark.parametrize("index", range(len(STEP_TIME_MALFORMED)))
def test_every_malformed_item_alone_and_between_good_ones(index: int) -> None:
    bad = STEP_TIME_MALFORMED[index]
    _modes([bad])
    # between good items: the good lines must keep their places around a skip
    _modes([step_time_item(seq=0), bad, step_time_item(seq=2), bad, step_time_item(seq=4)])


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


@pytest.mark.parametrize("index", range(len(ODD_BUT_VALID)))
def test_odd_items(index: int) -> None:
    _modes([ODD_BUT_VALID[index]])
    _modes([step_time_item(seq=0), ODD_BUT_VALID[index], step_time_item(seq=2)])


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
def test_identities(identity: Any, include_hostname: bool) -> None:
    _modes([step_time_item(seq=i) for i in range(3)], identity, include_hostname)


def test_encoded_bytes_payload_as_the_server_queues_it() -> None:
    items = [step_time_item(seq=i, step=i + 1) for i in range(50)]
    body = orjson.dumps(
        {
            "v": 1,
            "token": "t",
            "type": "batch",
            "stream": "step_time",
            "identity": IDENTITY,
            "items": items,
        }
    )
    lines = RecordBuilder(("step_time",), False, encode_lines=True).build(
        ReceivedBatch(7, body, len(body))
    )
    records = RecordBuilder(("step_time",), False).build(ReceivedBatch(7, body, len(body)))
    group = lines.records["step_time"]
    assert isinstance(group, EncodedLines)
    assert group.data == b"".join(dumps_line(r) for r in records.records["step_time"])


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


def test_the_c_encoder_takes_plainly_valid_items_itself() -> None:
    from traceml_ai.export._builder import (
        _STEP_TIME_FIRST_ITEM_FIELD,
        _STEP_TIME_RULES,
        MAX_STRING_BYTES,
    )
    from traceml_records._codec import encode_items

    assert encode_items is not None
    builder = RecordBuilder(("step_time",), False, encode_lines=True)
    builder.build(batch("step_time", [step_time_item()]))  # the loader learns "cpu" matches
    items = [step_time_item(seq=i, step=i + 1) for i in range(10)]
    items[3] = {**items[3], "step": 0}  # invalid: left to Python
    data, count, pending = encode_items(
        items, StepTimeRecord, _STEP_TIME_FIRST_ITEM_FIELD, b"{", MAX_STRING_BYTES,
        _STEP_TIME_RULES,
    )  # fmt: skip
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
