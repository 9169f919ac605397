"""``python -m traceml_ai.settings [--check]``: the settings table of the docs.

Rewrites the table between the ``settings-table`` markers of ``docs/live-export.md``
from the settings table, or with ``--check`` fails (exit 1) when it is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from traceml_ai.settings._derived import settings_table_markdown

DOC = Path("docs/live-export.md")
START = "<!-- settings-table:start -->\n"
END = "<!-- settings-table:end -->"


def splice(text: str) -> str:
    """``text`` with the generated table between its markers."""
    start = text.index(START) + len(START)
    end = text.index(END, start)
    return text[:start] + settings_table_markdown() + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m traceml_ai.settings", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the docs' table is stale")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="repository root")
    args = parser.parse_args(argv)
    path: Path = args.root / DOC
    text = path.read_text(encoding="utf-8")
    new = splice(text)
    if new == text:
        print(f"settings: {DOC} is up to date")
        return 0
    if args.check:
        print(f"settings: {DOC}'s table is stale; run `python -m traceml_ai.settings`")
        return 1
    path.write_text(new, encoding="utf-8")
    print(f"settings: wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
