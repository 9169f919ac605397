"""Tests of the benchmarks (bench/)."""
