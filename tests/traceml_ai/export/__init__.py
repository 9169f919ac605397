"""Tests of traceml_ai.export: builder, exporters, worker, finalization."""
