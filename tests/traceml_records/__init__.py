"""Tests of traceml_records (src/traceml_records/)."""
