"""``python -m traceml_ai`` is the ``traceml`` command (and names itself so in messages)."""

from traceml_ai.cli import main

main(prog_name="traceml")
