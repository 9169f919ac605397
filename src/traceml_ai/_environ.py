"""The environment variables between the launcher and its ranks, named once.

``traceml run`` (and ``traceml serve``, the Ray integration) sets them for each rank;
the rank side (``traceml.init()``, the bootstrap) reads them. User-facing settings
(``TRACEML_INTERVAL``, ``TRACEML_EXPORTER`` ...) are ``traceml_ai.settings``'s, named
after their setting; ``TRACEML_PURE_PYTHON`` is ``traceml_records.internal``'s.
"""

from __future__ import annotations

AGGREGATOR_ADDR = "TRACEML_AGGREGATOR_ADDR"
"""``host:port`` of the aggregator the rank sends to."""
RUN_TOKEN = "TRACEML_RUN_TOKEN"
"""The run's token, which the aggregator checks on every connection."""
SAMPLER_INTERVAL = "TRACEML_SAMPLER_INTERVAL"
"""Seconds between process/system samples."""
AGGREGATOR_UNAVAILABLE = "TRACEML_AGGREGATOR_UNAVAILABLE"
"""Set when the aggregator did not start: why; ``traceml.init()`` shows it."""
RUN_DIR = "TRACEML_RUN_DIR"
"""The run folder, for the ranks of the node that hosts the aggregator."""
SUMMARY_FILE = "TRACEML_SUMMARY_STEP_TIME_FILE"
"""The ``step_time.jsonl`` this run exports, when it exports one (``traceml.summary()``)."""
DISABLED = "TRACEML_DISABLED"
"""``1``: TraceML off in the rank (``init()`` does nothing; ``--disable-traceml``)."""
ON_MISSING_AGGREGATOR = "TRACEML_ON_MISSING_AGGREGATOR"
"""``warn`` or ``raise`` when ``init()`` finds no aggregator to send to."""
TRACE_MAX_STEPS = "TRACEML_TRACE_MAX_STEPS"
"""Steps after which the rank stops sending step items (``--trace-max-steps``)."""
RESET_PEAK_MEMORY = "TRACEML_RESET_PEAK_MEMORY"
"""``0``: keep the CUDA peak across steps instead of resetting it at each step."""
ZERO_CODE = "TRACEML_ZERO_CODE"
"""``0``/``false``/``off``: do not attach to Trainer/Lightning automatically."""
RANK_STATE_DIR = "TRACEML_RANK_STATE_DIR"
"""A private folder where the bootstrap leaves ``<rank>.<pid>.started`` just before the
script's first line and ``<rank>.<pid>.exited`` when the interpreter exits normally
(after TraceML's own ``atexit`` shutdown): a rank with the first file and not the
second ended by ``os._exit()``, a signal or a crash, and the launcher says so."""
SIGINT_HELD = "TRACEML_SIGINT_HELD"
"""``1`` when the rank was started with SIGINT blocked: a Ctrl-C during the
interpreter's start and TraceML's imports waits until the bootstrap can take it."""
PARALLEL = "TRACEML_PARALLEL"
"""The declared parallel layout (the ``parallel`` setting's variable, as
``traceml_ai.settings.PARALLEL.env`` names it): ``traceml run`` and Ray set it for the
ranks from the flag, ``traceml.yaml`` or the config; the rank reads it
(``rank._collectives.parallel_layout``)."""
