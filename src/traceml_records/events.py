"""The built-in event names of step_time, generated from the schema.

``STEP_TIME`` (the whole traced step), ``DATALOADER_NEXT``, ``H2D_TIME``,
``FORWARD_TIME``, ``BACKWARD_TIME``, ``OPTIMIZER_STEP``; ``RESERVED_PREFIX`` starts each
of them, and no user phase name; ``BUILT_IN_EVENTS`` lists them sorted.
"""

from traceml_records._generated.events import (
    BACKWARD_TIME,
    BUILT_IN_EVENTS,
    DATALOADER_NEXT,
    FORWARD_TIME,
    H2D_TIME,
    OPTIMIZER_STEP,
    RESERVED_PREFIX,
    STEP_TIME,
)

__all__ = [
    "BACKWARD_TIME",
    "BUILT_IN_EVENTS",
    "DATALOADER_NEXT",
    "FORWARD_TIME",
    "H2D_TIME",
    "OPTIMIZER_STEP",
    "RESERVED_PREFIX",
    "STEP_TIME",
]
