"""Rank → aggregator transport: framed JSON over TCP (see ``docs/dev/wire-format.md``).

``wire`` is the format both ends speak (frames, batch envelopes, the ``finished``
message); ``sender`` is the rank's end, ``server`` the aggregator's. The two ends load
on first use: a rank never imports the server, nor the aggregator the sender.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from traceml_ai._lazy_names import lazy_getattr

if TYPE_CHECKING:
    from traceml_ai.transport.sender import RankSender
    from traceml_ai.transport.server import AggregatorServer

_LAZY = {
    "RankSender": "traceml_ai.transport.sender",
    "AggregatorServer": "traceml_ai.transport.server",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


__all__ = ["AggregatorServer", "RankSender"]
