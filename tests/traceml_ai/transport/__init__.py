"""Tests of traceml_ai.transport."""
