"""Rank → aggregator transport: framed JSON over TCP (see ``docs/dev/wire-format.md``).

``wire`` is the format both ends speak (frames, batch envelopes, the ``finished``
message); ``sender`` is the rank's end, ``server`` the aggregator's. The two ends load
on first use: a rank never imports the server, nor the aggregator the sender.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from traceml_ai.transport.sender import RankSender
    from traceml_ai.transport.server import AggregatorServer

_LAZY = {
    "RankSender": "traceml_ai.transport.sender",
    "AggregatorServer": "traceml_ai.transport.server",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'traceml_ai.transport' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["AggregatorServer", "RankSender"]
