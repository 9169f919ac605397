"""Rank → aggregator wire format shared by the rank SDK, the transport and the export engine.

See ``docs/dev/wire-format.md``. This module never imports torch.
"""

from __future__ import annotations

from typing import Any

import attrs

WIRE_VERSION = 1

ENV_AGGREGATOR_ADDR = "TRACEML_AGGREGATOR_ADDR"
ENV_RUN_TOKEN = "TRACEML_RUN_TOKEN"
ENV_SAMPLER_INTERVAL = "TRACEML_SAMPLER_INTERVAL"

# Streams a rank can send; ``system_gpu`` records are split out of ``system`` items.
BATCH_STREAMS = (
    "step_time",
    "step_memory",
    "process",
    "system",
    "runtime_environment",
    "stdout_stderr",
)


@attrs.frozen(slots=True)
class ReceivedBatch:
    """A decoded ``batch`` message as the aggregator received it."""

    observed_timestamp_unix_ns: int
    payload: dict[str, Any]
    nbytes: int
