"""Where TraceML listens by default, named once for the settings and the rank.

A module of its own, without imports: the rank side (``traceml_ai.rank``) needs the
serve port and must not import the settings package (click, cattrs, YAML).
"""

DEFAULT_DASHBOARD_PORT = 8765
"""The live dashboard's port (``--dashboard-port``, ``traceml dashboard --port``, Ray)."""

DEFAULT_SERVE_PORT = 29600
"""The aggregator's port of ``traceml serve``, and of ``traceml run`` across nodes."""

LOOPBACK = "127.0.0.1"
"""Where the aggregator and the live views listen unless told otherwise."""
