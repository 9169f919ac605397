"""``python -m traceml_ai`` and the ``traceml`` console script."""

from __future__ import annotations

import sys


def entry() -> None:
    """Run the CLI; a Ctrl-C while it is still importing ends quietly, as after."""
    try:
        from traceml_ai.cli import main
    except KeyboardInterrupt:
        print("traceml: interrupted", file=sys.stderr)
        sys.exit(130)
    main(prog_name="traceml")


if __name__ == "__main__":
    entry()
