"""The GPU check (scripts/gpu-check.sh): real-CUDA checks of what TraceML writes.

``judge`` holds the pure comparisons (standard library only, unit-tested on CPU by
tests/gpu_check/test_gpu_check.py), ``driver`` runs each check in its own process and
writes
the report, ``scenario`` and ``spawn_train`` are the workloads run under
``traceml run``. docs/gpu-check.md says how to run it and what each check proves.
"""
