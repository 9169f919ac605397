"""Rank → aggregator transport: framed JSON over TCP (see ``docs/dev/wire-format.md``).

``wire`` is the format both ends speak (frames, batch envelopes, the ``finished``
message); ``sender`` is the rank's end, ``server`` the aggregator's, ``relay`` the
node's relay between them (a server whose frames go on, as they are, over one
connection). The two ends load
on first use: a rank never imports the server, nor the aggregator the sender.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from traceml_ai._lazy_names import lazy_surface

if TYPE_CHECKING:  # the names of _LAZY, for mypy and editors (tests/traceml_ai/test_surfaces.py)
    from traceml_ai.transport.relay import Relay as Relay
    from traceml_ai.transport.relay import RelayStats as RelayStats
    from traceml_ai.transport.sender import RankSender as RankSender
    from traceml_ai.transport.server import AggregatorServer as AggregatorServer

_LAZY = {
    "traceml_ai.transport.relay": ("Relay", "RelayStats"),
    "traceml_ai.transport.sender": ("RankSender",),
    "traceml_ai.transport.server": ("AggregatorServer",),
}

__all__, __getattr__, __dir__ = lazy_surface(__name__, _LAZY, globals())
