"""Wire items carrying the fields of issue 42, through the builder's two modes.

step_time's ``tokens`` (sent only when known; a null or a missing key writes no key)
and collectives' ``group``, ``peer_rank``, ``peer_stage`` and ``bytes`` (always sent;
an item without them, an older sender's, gets nulls): the C line encoders
(``encode_batch`` from the frame body, ``encode_items`` from parsed items) write the
lines the strict Python loaders and ``dumps_line`` write, and the records carry the
item's values; runtime_environment's ``parallel`` reaches its record.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.custom_exporters import batch, runtime_item, step_time_item
from tests.traceml_ai.export.test_encoded_lines import _modes
from traceml_ai.export import RecordBuilder
from traceml_ai.export._encoded import EncodedLines

pytestmark = pytest.mark.unit


def _collective(seq: int = 0, **extra: Any) -> dict[str, Any]:
    item: dict[str, Any] = {
        "timestamp_unix_ns": 10 + seq,
        "seq": seq,
        "step": 1 + seq,
        "phase": "_traceml_internal:backward_time",
        "op": "all_reduce",
        "source": "torch.distributed",
        "backend": "gloo",
        "n_calls": 1,
        "wait_ms": 0.25,
        "wait_measure": "host",
        "first_arrival_ms": 1.0,
        "last_arrival_ms": 1.0,
        "group": "dp",
        "peer_rank": None,
        "peer_stage": None,
        "bytes": 4096,
    }
    item.update(extra)
    return {k: v for k, v in item.items() if v is not _ABSENT}


_ABSENT = object()


def _lines(stream: str, items: list[Any]) -> list[dict[str, Any]]:
    result = RecordBuilder((stream,), False, encode_lines=True).build(batch(stream, items))
    group = result.records[stream]
    assert isinstance(group, EncodedLines)
    return [orjson.loads(line) for line in group.data.splitlines()]


@pytest.mark.parametrize("tokens", [_ABSENT, None, 0, 123456])
def test_step_time_tokens_both_modes(tokens: Any) -> None:
    items = [step_time_item(seq=i, step=i + 1) for i in range(3)]
    if tokens is not _ABSENT:
        items[1]["tokens"] = tokens
    _modes(items)
    lines = _lines("step_time", items)
    assert [line.get("tokens") for line in lines] == [
        None,
        None if tokens is _ABSENT else tokens,
        None,
    ]
    assert all("tokens" not in line for i, line in enumerate(lines) if i != 1 or tokens is None)


def test_step_time_tokens_out_of_order_keys() -> None:
    item = step_time_item()
    item = {"tokens": 7, **item}  # not the schema's order: the slow reading
    _modes([item, step_time_item(seq=1, step=2)])
    assert _lines("step_time", [item])[0]["tokens"] == 7


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"op": "send", "group": "pp", "peer_rank": 3, "peer_stage": 1, "bytes": 1 << 30},
        {"group": "world", "bytes": None},
        {"group": _ABSENT, "peer_rank": _ABSENT, "peer_stage": _ABSENT, "bytes": _ABSENT},
        {"bytes": _ABSENT},
        {"group": None},
        {"group": "mesh"},
        {"peer_rank": -1},
    ],
)
def test_collectives_new_fields_both_modes(extra: dict[str, Any]) -> None:
    items = [_collective(0), _collective(1, **extra), _collective(2)]
    _modes(items, stream="collectives")


def test_collectives_records_carry_the_item_values() -> None:
    item = _collective(op="recv", group="pp", peer_rank=2, peer_stage=0, bytes=512)
    result = RecordBuilder(("collectives",), False).build(batch("collectives", [item]))
    (record,) = result.records["collectives"]
    assert (record.group, record.peer_rank, record.peer_stage, record.bytes) == ("pp", 2, 0, 512)
    old = {k: v for k, v in item.items() if k not in ("group", "peer_rank", "peer_stage", "bytes")}
    result = RecordBuilder(("collectives",), False).build(batch("collectives", [old]))
    (record,) = result.records["collectives"]
    assert (record.group, record.peer_rank, record.peer_stage, record.bytes) == (
        None,
        None,
        None,
        None,
    )
    line = _lines("collectives", [old])[0]
    assert "group" not in line  # cannot be null: left out, as dumps_line does
    assert (line["peer_rank"], line["peer_stage"], line["bytes"]) == (None, None, None)


def test_runtime_environment_parallel_reaches_the_record() -> None:
    item = runtime_item()
    item["parallel"] = {"pp": {"rank": 1, "size": 2}, "dp": {"rank": 0, "size": 4}}
    item["parallel_source"] = "declared"
    result = RecordBuilder(("runtime_environment",), False).build(
        batch("runtime_environment", [item])
    )
    (record,) = result.records["runtime_environment"]
    assert record.parallel_source == "declared"
    assert {k: (c.rank, c.size) for k, c in record.parallel.items()} == {
        "pp": (1, 2),
        "dp": (0, 4),
    }
    bad = dict(item, parallel={"pp": {"rank": 2, "size": 2}})
    result = RecordBuilder(("runtime_environment",), False).build(
        batch("runtime_environment", [bad])
    )
    assert result.skipped_items == 1
