"""Rank → aggregator wire format shared by the rank SDK, the transport and the export engine.

See ``docs/dev/wire-format.md``. This module never imports torch.
"""

from __future__ import annotations

import hmac
import re
import secrets
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import orjson

from traceml_ai import _environ
from traceml_records.internal import BATCH_STREAMS

__all__ = [
    "BATCH_GLOBAL_RANK",
    "BATCH_RANK_SPAN",
    "BATCH_STREAMS",
    "BATCH_STREAM_TAILS",
    "DEFAULT_MAX_FRAME_BYTES",
    "ENV_AGGREGATOR_ADDR",
    "ENV_RUN_TOKEN",
    "ENV_SAMPLER_INTERVAL",
    "FRAME_HEADER",
    "MESSAGES",
    "MESSAGE_TYPES",
    "RELAY_ID_MAX_CHARS",
    "RELAY_RANKS_END",
    "TRACKER_RUNS_BOUNDS",
    "WIRE_VERSION",
    "FrameError",
    "ReceivedBatch",
    "TrackerRunsBounds",
    "WireMessage",
    "batch_envelope",
    "batch_prefix",
    "decode_batch_body",
    "decode_message",
    "encode_batch_frame",
    "encode_frame",
    "encode_item",
    "known_stream_follows",
    "make_batch_message",
    "make_finished_message",
    "make_relay_message",
    "make_tracker_runs_message",
    "new_run_token",
    "peek_batch_stream",
    "relay_ranks",
]

WIRE_VERSION = 1

ENV_AGGREGATOR_ADDR = _environ.AGGREGATOR_ADDR
ENV_RUN_TOKEN = _environ.RUN_TOKEN
ENV_SAMPLER_INTERVAL = _environ.SAMPLER_INTERVAL

# BATCH_STREAMS (generated from the schemas' x-traceml-wire): streams a rank can send;
# ``system_gpu`` records are split out of ``system`` items.


@attrs.frozen(kw_only=True)
class WireMessage:
    """One message type, declared once: the keys it carries after ``v``, ``token`` and
    ``type``, in the order senders write them (``optional`` ones may be left out).
    The builders (``make_*_message``) write these keys in this order; ``decode_message``
    checks them (docs/dev/wire-format.md)."""

    type: str
    keys: tuple[str, ...]
    optional: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class TrackerRunsBounds:
    """How much a ``tracker_runs`` message may carry: trackers, fields per tracker, and
    characters per tracker name, field name or value (a path or a URI fits; a message
    never grows without bound)."""

    max_trackers: int
    max_fields: int
    max_chars: int

    def holds(self, runs: object) -> bool:
        """Whether ``runs`` is a map of tracker name -> map of field -> string, within
        these bounds."""
        if type(runs) is not dict or len(runs) > self.max_trackers:
            return False
        for name, fields in runs.items():
            if len(name) > self.max_chars or type(fields) is not dict:
                return False
            if len(fields) > self.max_fields:
                return False
            for key, value in fields.items():
                if type(value) is not str or max(len(key), len(value)) > self.max_chars:
                    return False
        return True


TRACKER_RUNS_BOUNDS = TrackerRunsBounds(max_trackers=8, max_fields=8, max_chars=4096)
"""The bounds of every ``tracker_runs`` message (checked by ``decode_message``)."""

MESSAGES: dict[str, WireMessage] = {
    message.type: message
    for message in (
        WireMessage(type="batch", keys=("stream", "identity", "items")),
        WireMessage(
            type="finished",
            keys=("identity", "sent_batches", "dropped_batches", "dropped_batches_by_stream"),
            optional=("dropped_batches_by_stream",),
        ),
        WireMessage(type="tracker_runs", keys=("identity", "runs")),
        WireMessage(type="relay", keys=("relay", "dropped", "ranks"), optional=("ranks",)),
    )
}
"""Every message type of the wire, by ``type``."""

MESSAGE_TYPES = tuple(MESSAGES)


def _message(kind: str, token: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """A message of type ``kind``: the envelope, then its declared keys in their order
    (an optional one only when ``values`` has it)."""
    message: dict[str, Any] = {"v": WIRE_VERSION, "token": token, "type": kind}
    spec = MESSAGES[kind]
    for key in spec.keys:
        if key in values or key not in spec.optional:
            message[key] = values[key]
    return message


DEFAULT_MAX_FRAME_BYTES = 8 * 1024 * 1024

# 4-byte big-endian unsigned length that precedes every frame body.
FRAME_HEADER = struct.Struct(">I")


@attrs.frozen(slots=True)
class ReceivedBatch:
    """A ``batch`` message as the aggregator received it.

    ``payload`` is normally the frame body, still encoded: the server checks the
    envelope prefix (version, token, type, stream) without parsing the JSON, and the
    export worker parses it off the receive loop, only for selected streams. Queued
    memory is then exactly ``nbytes`` per batch. A decoded ``dict`` is accepted too
    (frames a different encoder wrote, and direct callers such as tests).
    """

    observed_timestamp_unix_ns: int
    payload: dict[str, Any] | bytes
    nbytes: int


class FrameError(ValueError):
    """A frame whose envelope is not a valid wire message; ``reason`` is a short label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def new_run_token() -> str:
    """Return a fresh random run token (URL-safe text, 256 bits)."""
    return secrets.token_urlsafe(32)


def encode_frame(message: Mapping[str, Any]) -> bytes:
    """Serialize ``message`` with orjson and prefix it with its 4-byte big-endian length.

    Raises ``orjson.JSONEncodeError`` (a ``TypeError``) for values orjson cannot encode.
    """
    body = orjson.dumps(message)
    return FRAME_HEADER.pack(len(body)) + body


def make_batch_message(
    token: str, identity: Mapping[str, Any], stream: str, items: Sequence[Any]
) -> dict[str, Any]:
    """Build a ``batch`` message carrying ``items`` of one ``stream``."""
    # Key order matters: the aggregator recognises a batch by its encoded prefix
    # (see ``batch_prefix``) and reads the stream name without parsing the body.
    return _message("batch", token, {"stream": stream, "identity": identity, "items": items})


def encode_item(item: Mapping[str, Any]) -> bytes:
    """One item as it appears inside a batch frame (for ``encode_batch_frame``).

    Raises ``orjson.JSONEncodeError`` (a ``TypeError``) for values orjson cannot encode.
    """
    return orjson.dumps(item)


def batch_envelope(token: str, identity: Mapping[str, Any], stream: str) -> tuple[bytes, bytes]:
    """The bytes of a ``batch`` body before its first item and after its last.

    Cut from ``make_batch_message`` with no items encoded, so a frame built from them
    is the one ``encode_frame(make_batch_message(...))`` writes (``items`` comes last).
    """
    empty = orjson.dumps(make_batch_message(token, identity, stream, []))
    if not empty.endswith(b"[]}"):
        raise ValueError("the batch message must end with its items")
    return empty[:-2], b"]}"


def encode_batch_frame(envelope: tuple[bytes, bytes], items: Sequence[bytes]) -> bytes:
    """A ``batch`` frame of items already encoded with ``encode_item``.

    Byte for byte ``encode_frame(make_batch_message(...))`` of the decoded items: a
    sender keeps items encoded while they wait (bytes hold no references, so a queue
    of them adds nothing for the garbage collector to walk) and joins them here.
    """
    head, tail = envelope
    body = b"".join((head, b",".join(items), tail))
    return FRAME_HEADER.pack(len(body)) + body


def make_finished_message(
    token: str,
    identity: Mapping[str, Any],
    sent_batches: int,
    dropped_batches: int,
    dropped_batches_by_stream: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Build the ``finished`` message a rank sends last, with its batch counts.

    ``dropped_batches_by_stream`` (batch stream → dropped batches, streams with none
    may be left out) lets the aggregator count only the drops of selected streams;
    ``dropped_batches`` stays the total, which also covers items of no known stream.
    """
    values: dict[str, Any] = {
        "identity": identity,
        "sent_batches": sent_batches,
        "dropped_batches": dropped_batches,
    }
    if dropped_batches_by_stream is not None:
        values["dropped_batches_by_stream"] = dict(dropped_batches_by_stream)
    return _message("finished", token, values)


def make_tracker_runs_message(
    token: str, identity: Mapping[str, Any], runs: Mapping[str, Mapping[str, str]]
) -> dict[str, Any]:
    """Build a ``tracker_runs`` message: the experiment-tracker runs the training script
    has open (tracker name -> its fields: an MLflow run id, a W&B run id, a TensorBoard
    log dir; ``traceml_ai.rank._runtime.tracker_runs``), sent when they change, so that the
    aggregator logs into the user's own run. Not exported: it only chooses the run."""
    runs_copy = {name: dict(fields) for name, fields in runs.items()}
    return _message("tracker_runs", token, {"identity": identity, "runs": runs_copy})


RELAY_ID_MAX_CHARS = 128
"""The longest relay id a ``relay`` message may carry."""
RELAY_RANKS_END = 10**19
"""Past the last global rank a ``relay`` message's ``ranks`` may name (a rank key of its
``dropped`` has at most 19 digits too)."""


def make_relay_message(
    token: str,
    relay_id: str,
    dropped: Mapping[int, Mapping[str, int]],
    ranks: range | None = None,
) -> dict[str, Any]:
    """Build a ``relay`` message: the first frame of each connection a relay opens to the
    aggregator (or to the next relay), and again whenever its drops grow.

    ``dropped`` maps a global rank to the batches of each stream the relay ``relay_id``
    dropped of that rank since it started (counts only grow, so the receiver keeps the
    largest it saw). Rank keys are written as decimal text (JSON object keys).
    ``ranks``: the global ranks the relay is there for (its node's, when the launcher
    knows them), so that the aggregator knows them behind it before their first frame
    passes; left out when unknown.
    """
    counts = {str(rank): dict(by_stream) for rank, by_stream in sorted(dropped.items())}
    values: dict[str, Any] = {"relay": relay_id, "dropped": counts}
    if ranks is not None:
        if ranks.step != 1 or not 0 <= ranks.start < ranks.stop <= RELAY_RANKS_END:
            raise ValueError(f"a relay's ranks are a nonempty run of global ranks, got {ranks}")
        values["ranks"] = {"first": ranks.start, "count": ranks.stop - ranks.start}
    return _message("relay", token, values)


def relay_ranks(message: Mapping[str, Any]) -> range | None:
    """The global ranks a valid ``relay`` message says the relay is there for (None when
    it does not say)."""
    ranks = message.get("ranks")
    if ranks is None:
        return None
    return range(ranks["first"], ranks["first"] + ranks["count"])


def batch_prefix(token: str) -> bytes:
    """The first bytes of every ``batch`` frame body our senders write for ``token``.

    A body that starts with it has the right version, token and type; the server then
    queues it still encoded. Anything else goes through ``decode_message``.
    """
    return b'{"v":%d,"token":%s,"type":"batch","stream":"' % (WIRE_VERSION, orjson.dumps(token))


BATCH_STREAM_TAILS = tuple(f'{name}"'.encode() for name in BATCH_STREAMS)
"""Each batch stream's name and its closing quote: what follows :func:`batch_prefix`."""


def known_stream_follows(body: bytes, offset: int) -> bool:
    """Whether a known batch stream's name and its closing quote start at ``offset``
    (just after :func:`batch_prefix`)."""
    return body.startswith(BATCH_STREAM_TAILS, offset)


# The identity precedes the items, and a key's opening quote cannot occur unescaped
# inside a JSON string, so the first match in a batch body is the identity's global_rank.
BATCH_GLOBAL_RANK = re.compile(rb'"global_rank":(0|[1-9][0-9]{0,18})[,}]')
"""The sending rank's ``global_rank`` in a batch body our senders wrote (group 1),
looked for in its first :data:`BATCH_RANK_SPAN` bytes."""
BATCH_RANK_SPAN = 4096
"""Where in a batch body its identity's ``global_rank`` is looked for."""

_STREAM_MARKER = b'"type":"batch","stream":"'
_STREAM_NAMES = {name.encode(): name for name in BATCH_STREAMS}


def peek_batch_stream(body: bytes) -> str | None:
    """The stream of an encoded batch body, read from its prefix; None if not found there."""
    start = body.find(_STREAM_MARKER, 0, 512)
    if start < 0:
        return None
    start += len(_STREAM_MARKER)
    end = body.find(b'"', start, start + 64)
    return _STREAM_NAMES.get(body[start:end]) if end > 0 else None


def decode_batch_body(body: bytes) -> dict[str, Any]:
    """Parse an encoded batch body whose prefix the server already checked.

    Checks the rest of the envelope (identity, stream, items); raises ``FrameError``.
    """
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise FrameError("bad json") from None
    if not isinstance(message, dict):
        raise FrameError("not an object")
    if not isinstance(message.get("identity"), dict):
        raise FrameError("missing identity")
    if message.get("stream") not in BATCH_STREAMS:
        raise FrameError("stream not in BATCH_STREAMS")
    if not isinstance(message.get("items"), list):
        raise FrameError("items not a list")
    return message


def _is_count(value: object) -> bool:
    # bool is an int subclass; a count of ``true`` is a malformed message.
    return type(value) is int and value >= 0


def decode_message(data: bytes, token: str) -> dict[str, Any]:
    """Parse one frame body and check its envelope; raise ``FrameError`` when it is invalid.

    Only the envelope is checked (version, token, type, identity, stream, items list,
    finished counts). Items are the export engine's business.
    """
    try:
        message = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise FrameError("bad json") from None
    if not isinstance(message, dict):
        raise FrameError("not an object")
    sent_token = message.get("token")
    # Constant-time comparison on bytes: compare_digest refuses non-ASCII str.
    if not isinstance(sent_token, str) or not hmac.compare_digest(
        sent_token.encode("utf-8"), token.encode("utf-8")
    ):
        raise FrameError("wrong token")
    version = message.get("v")
    if type(version) is not int or version != WIRE_VERSION:
        raise FrameError("bad version")
    kind = message.get("type")
    if kind not in MESSAGE_TYPES:
        raise FrameError("unknown type")
    if kind == "relay":
        if not _valid_relay(message):
            raise FrameError("bad relay report")
        return message
    if not isinstance(message.get("identity"), dict):
        raise FrameError("missing identity")
    if kind == "batch":
        stream = message.get("stream")
        if not isinstance(stream, str) or stream not in BATCH_STREAMS:
            raise FrameError("stream not in BATCH_STREAMS")
        if not isinstance(message.get("items"), list):
            raise FrameError("items not a list")
    elif kind == "tracker_runs":
        if not TRACKER_RUNS_BOUNDS.holds(message.get("runs")):
            raise FrameError("bad tracker runs")
    elif not _valid_counts(message):
        raise FrameError("bad counts")
    return message


_RANK_KEY = re.compile(r"(0|[1-9][0-9]{0,18})")


def _valid_relay(message: Mapping[str, Any]) -> bool:
    """A ``relay`` message: a relay id, batch drops per rank and known stream, and
    optionally the run of ranks it is there for."""
    relay_id = message.get("relay")
    if type(relay_id) is not str or not 0 < len(relay_id) <= RELAY_ID_MAX_CHARS:
        return False
    dropped = message.get("dropped")
    if type(dropped) is not dict:
        return False
    for rank, by_stream in dropped.items():
        if _RANK_KEY.fullmatch(rank) is None or type(by_stream) is not dict:
            return False
        if not all(k in BATCH_STREAMS and _is_count(v) for k, v in by_stream.items()):
            return False
    ranks = message.get("ranks")
    if ranks is None:
        return "ranks" not in message
    if type(ranks) is not dict or ranks.keys() != {"first", "count"}:
        return False
    first, count = ranks["first"], ranks["count"]
    return _is_count(first) and _is_count(count) and count > 0 and first + count <= RELAY_RANKS_END


def _valid_counts(message: Mapping[str, Any]) -> bool:
    """The counts of a ``finished`` message, ``dropped_batches_by_stream`` included."""
    total = message.get("dropped_batches")
    if not (_is_count(message.get("sent_batches")) and type(total) is int and total >= 0):
        return False
    # Optional (older senders omit it). Its counts are part of ``dropped_batches``, so a
    # map that claims more than the total is malformed, not a bigger loss.
    by_stream = message.get("dropped_batches_by_stream", {})
    if not isinstance(by_stream, dict):
        return False
    if not all(k in BATCH_STREAMS and _is_count(v) for k, v in by_stream.items()):
        return False
    return sum(by_stream.values()) <= total
