"""TraceML's tests, a package so that helpers are imported as ``tests.<module>``.

Test modules sit in folders that mirror what they test: ``traceml_records/``,
``traceml_ai/`` and its subpackages, ``codegen/``, ``bench/``, ``gpu_check/``
(scripts/gpu_check), and ``e2e/`` for whole-CLI runs in real processes. Helpers shared
by several of them are the top-level modules here; ``scripts/`` holds the programs and
exporter modules tests start in other processes.

The repository root is on ``sys.path`` (pytest's ``pythonpath``; the subprocess
helpers set ``PYTHONPATH`` to it), so exporter names such as
``tests.custom_exporters:make_exporter`` resolve the same in process and through the
real CLI.
"""
