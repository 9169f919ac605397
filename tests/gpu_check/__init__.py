"""Tests of the GPU check (scripts/gpu_check/) on CPU."""
