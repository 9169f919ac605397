"""The generated ITEM_LOADERS (the aggregator's per-item fast path) agree with LOADERS.

ITEM_LOADERS check every field of an item as strictly as LOADERS do and take the
identity block from a dict the caller already checked; on the same values they must
build the same record and refuse the same items.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import consistent_json
from traceml_records import STREAMS, RecordError
from traceml_records._generated.records import IDENTITY_FIELDS, ITEM_LOADERS, LOADERS

STREAM_NAMES = [spec.name for spec in STREAMS]


def _split(cls: type[Any], line: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    names = {f.name for f in attrs.fields(cls)}
    full = dict(line)
    if "hostname" in names:
        full.setdefault("hostname", None)
    identity = {k: v for k, v in full.items() if k in IDENTITY_FIELDS}
    item = {k: v for k, v in full.items() if k not in IDENTITY_FIELDS}
    return identity, item


@pytest.mark.parametrize("stream", STREAM_NAMES)
@given(data=st.data())
def test_item_loader_builds_the_same_record(stream: str, data: st.DataObject) -> None:
    cls = next(spec.record_class for spec in STREAMS if spec.name == stream)
    line = data.draw(consistent_json(stream))
    identity, item = _split(cls, line)
    expected = LOADERS[cls]({**identity, **item}, ())
    assert ITEM_LOADERS[cls](identity, item, ()) == expected


@pytest.mark.parametrize("stream", STREAM_NAMES)
@given(data=st.data())
def test_item_loader_refuses_what_loaders_refuse(stream: str, data: st.DataObject) -> None:
    cls = next(spec.record_class for spec in STREAMS if spec.name == stream)
    identity, item = _split(cls, data.draw(consistent_json(stream)))
    key = data.draw(st.sampled_from(sorted(item)))
    bad = data.draw(st.sampled_from(["5", -1, 1.5, None, [], {}, True]))
    broken = {**item, key: bad}
    try:
        LOADERS[cls]({**identity, **broken}, ())
    except RecordError as exc:
        with pytest.raises(RecordError) as info:
            ITEM_LOADERS[cls](identity, broken, ())
        assert info.value.pointer == exc.pointer
    else:
        assert ITEM_LOADERS[cls](identity, broken, ()) == LOADERS[cls]({**identity, **broken}, ())
    extra = {**item, "unexpected": 1}
    with pytest.raises(RecordError):
        ITEM_LOADERS[cls](identity, extra, ())
