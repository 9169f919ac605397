"""Tests of traceml_ai.integrations (Hugging Face, Lightning, Accelerate, Ray)."""
