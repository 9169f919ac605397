"""Tests of traceml_ai.rank: the SDK, samplers, GPU access."""
