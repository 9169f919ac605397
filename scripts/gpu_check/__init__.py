"""The GPU check (scripts/gpu-check.sh, or ``python -m scripts.gpu_check`` from the
repository root): real-CUDA checks of what TraceML writes, in two lanes (the C
extensions built, then pure Python).

``judge`` holds the pure comparisons (unit-tested on CPU by
tests/gpu_check/test_gpu_check.py), ``driver`` builds the C extensions, runs each check
in its own process and writes the report, ``scenario`` and ``spawn_train`` are the
workloads run under ``traceml run``. docs/gpu-check.md says how to run it and what each
check proves.
"""
