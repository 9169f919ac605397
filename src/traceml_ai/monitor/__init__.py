"""The aggregator's live views: what the run looks like now, for Prometheus, OTLP and
the dashboard (docs/monitoring.md).

``metrics`` defines every metric once. The rest — the state, its feed, the service
that starts the sinks — loads with the aggregator; the sinks (``prometheus``,
``otlp``, ``traceml_ai.dashboard``) load only when switched on, so a default install
never imports prometheus_client, opentelemetry or the web server.
"""

from __future__ import annotations
