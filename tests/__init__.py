"""TraceML's tests, a package so that helpers are imported as ``tests.<module>``.

The repository root is on ``sys.path`` (pytest's ``pythonpath``; the subprocess
helpers set ``PYTHONPATH`` to it), so exporter names such as
``tests.custom_exporters:make_exporter`` resolve the same in process and through the
real CLI.
"""
