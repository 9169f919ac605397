"""Tests of traceml_ai.aggregator."""
