"""Tests of the code generator (codegen/)."""
