"""Rank → aggregator transport: framed JSON over TCP (see ``docs/dev/wire-format.md``)."""

from traceml_ai.transport.sender import RankSender
from traceml_ai.transport.server import AggregatorServer

__all__ = ["AggregatorServer", "RankSender"]
