"""Tests of traceml_ai (src/traceml_ai/), by subpackage."""
