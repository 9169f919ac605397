"""The batches of a relay's connection, cut out of a received chunk: the pure-Python
twin of ``_cut.c``, and the reference for its rules.

A relay forwards the frames of many ranks over one connection, so the aggregator reads
several frames per chunk. :func:`cut_batches` takes the frames of a chunk from ``pos``
as long as each is complete and one of our senders' batches (its body starts with the
run's :func:`~traceml_ai.transport.wire.batch_prefix` and a known stream, and its
identity names a ``global_rank``), and says why it stopped; the server handles the
frame it stopped at (any other message, a batch written otherwise, an invalid frame)
the general way.
"""

from __future__ import annotations

from traceml_ai.transport.wire import BATCH_GLOBAL_RANK, BATCH_RANK_SPAN, FRAME_HEADER

NEED_MORE = 0
"""No complete frame at ``pos``: the rest is the start of one (or nothing)."""
PYTHON = 1
"""The frame at ``pos`` is not a plain batch: the server reads it the general way."""
OVERSIZED = 2
"""The frame at ``pos`` says it is longer than ``max_frame_bytes``."""

_HEADER = FRAME_HEADER.size
_unpack = FRAME_HEADER.unpack_from


def cut_batches(
    data: bytes, pos: int, prefix: bytes, streams: tuple[bytes, ...], max_frame_bytes: int, /
) -> tuple[list[tuple[bytes, int, int]], int, int]:
    """``(batches, pos, status)``: each plain batch frame from ``pos`` on as ``(body,
    length, rank)``, where the next frame starts, and why it stopped there
    (:data:`NEED_MORE`, :data:`PYTHON`, :data:`OVERSIZED`). ``streams``: each known
    stream's name with its closing quote (``wire.BATCH_STREAM_TAILS``)."""
    if not 0 <= pos <= len(data):
        raise ValueError("pos outside data")
    batches: list[tuple[bytes, int, int]] = []
    size = len(data)
    head = len(prefix)
    while size - pos >= _HEADER:
        (length,) = _unpack(data, pos)
        if length > max_frame_bytes:
            return batches, pos, OVERSIZED
        end = pos + _HEADER + length
        if end > size:
            break
        body = data[pos + _HEADER : end]
        match = (
            BATCH_GLOBAL_RANK.search(body, 0, BATCH_RANK_SPAN)
            if body.startswith(prefix) and body.startswith(streams, head)
            else None
        )
        if match is None:
            return batches, pos, PYTHON
        batches.append((body, length, int(match.group(1))))
        pos = end
    return batches, pos, NEED_MORE
