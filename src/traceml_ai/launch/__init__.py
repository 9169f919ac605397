"""The launcher: ``traceml run`` and ``traceml serve``.

``commands`` holds the click commands; ``launcher`` plans a run (settings, run folder,
aggregator address) and runs it: the aggregator process (its protocol is
``traceml_ai.aggregator.protocol``), then the ranks, each started through
``bootstrap`` (``python -m traceml_ai.launch.bootstrap SCRIPT ARGS``: the script
run as python runs it, with TraceML's zero-code attach); ``run_folder`` checks and
creates ``<logs-dir>/<run-name>``.
"""
