"""Tables of the docs made from the code: the one way to write or check one.

A generated table sits between two HTML comments in a Markdown file
(``<!-- NAME:start -->`` and ``<!-- NAME:end -->``); :func:`main` rewrites it there, or
with ``--check`` fails (exit 1) when it is stale. Each table's own module is its
command (``python -m traceml_ai.settings``, ``python -m traceml_ai.monitor.tracker_metrics``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

__all__ = ["main", "splice"]


def splice(text: str, name: str, table: str) -> str:
    """``text`` with ``table`` between its ``name`` markers."""
    start_marker = f"<!-- {name}:start -->\n"
    start = text.index(start_marker) + len(start_marker)
    end = text.index(f"<!-- {name}:end -->", start)
    return text[:start] + table + text[end:]


def main(
    prog: str,
    what: str,
    doc: Path,
    name: str,
    table: Callable[[], str],
    argv: list[str] | None = None,
) -> int:
    """Rewrite ``doc``'s ``name`` table (from ``table()``), or with ``--check`` fail
    when it is stale. ``what`` starts each line said."""
    parser = argparse.ArgumentParser(prog=prog, description=f"The {what} table of {doc}.")
    parser.add_argument("--check", action="store_true", help="fail if the docs' table is stale")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="repository root")
    args = parser.parse_args(argv)
    path: Path = args.root / doc
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        print(
            f"{what}: cannot read {path} ({exc.strerror}); run from the repository's root or give --root"
        )
        return 2
    new = splice(text, name, table())
    if new == text:
        print(f"{what}: {doc} is up to date")
        return 0
    if args.check:
        print(f"{what}: {doc}'s table is stale; run `{prog}`")
        return 1
    path.write_text(new, encoding="utf-8")
    print(f"{what}: wrote {doc}")
    return 0
