"""``python -m traceml_ai.settings [--check]``: the settings table of the docs.

Rewrites the table between the ``settings-table`` markers of ``docs/live-export.md``
from the settings table, or with ``--check`` fails (exit 1) when it is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from traceml_ai import _docs_tables
from traceml_ai.settings._derived import settings_table_markdown

DOC = Path("docs/live-export.md")


def main(argv: list[str] | None = None) -> int:
    return _docs_tables.main(
        "python -m traceml_ai.settings",
        "settings",
        DOC,
        "settings-table",
        settings_table_markdown,
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
