"""The built-in event names of step_time, generated from the schema.

``STEP_TIME`` (the whole traced step), ``DATALOADER_NEXT``, ``H2D_TIME``,
``FORWARD_TIME``, ``BACKWARD_TIME``, ``OPTIMIZER_STEP``; ``RESERVED_PREFIX`` starts each
of them, and no user phase name; ``BUILT_IN_EVENTS`` lists them sorted.
``BETWEEN_STEPS`` is the collectives stream's phase outside every step;
``COLLECTIVE_PHASES`` lists that stream's reserved phases.
"""

from traceml_records._generated.events import (
    BACKWARD_TIME,
    BETWEEN_STEPS,
    BUILT_IN_EVENTS,
    COLLECTIVE_PHASES,
    DATALOADER_NEXT,
    FORWARD_TIME,
    H2D_TIME,
    OPTIMIZER_STEP,
    RESERVED_PREFIX,
    STEP_TIME,
)

__all__ = [
    "BACKWARD_TIME",
    "BETWEEN_STEPS",
    "BUILT_IN_EVENTS",
    "COLLECTIVE_PHASES",
    "DATALOADER_NEXT",
    "FORWARD_TIME",
    "H2D_TIME",
    "OPTIMIZER_STEP",
    "RESERVED_PREFIX",
    "STEP_TIME",
]
