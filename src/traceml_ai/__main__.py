"""``python -m traceml_ai`` is the ``traceml`` command."""

from traceml_ai.cli import main

main()
