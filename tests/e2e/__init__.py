"""Whole-CLI tests: real ``traceml`` processes, as a user runs them."""
