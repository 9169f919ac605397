"""The built-in event names the rank times, short names for the schema's
(``traceml_records.events``, generated from the schemas)."""

from __future__ import annotations

from traceml_records import events as _events

INTERNAL_PREFIX = _events.RESERVED_PREFIX
DATALOADER_NEXT = _events.DATALOADER_NEXT
FORWARD = _events.FORWARD_TIME
BACKWARD = _events.BACKWARD_TIME
OPTIMIZER_STEP = _events.OPTIMIZER_STEP
H2D = _events.H2D_TIME
STEP_TIME = _events.STEP_TIME
BETWEEN_STEPS = _events.BETWEEN_STEPS

HOST_ONLY = frozenset({DATALOADER_NEXT, STEP_TIME})
"""Phases that always report host time (spec: the step and the DataLoader wait)."""
