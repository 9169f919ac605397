"""The declared surface between the packages: traceml_ai uses traceml_records through
its public names and ``traceml_records.internal`` only (docs/dev/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "traceml_ai"


def _records_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [n for n in names if n.startswith("traceml_records.")]
            if node.module == "traceml_records":
                found += [f"traceml_records.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("traceml_records.")]
    return found


def test_traceml_ai_imports_no_private_module_of_traceml_records() -> None:
    private = {
        f"{path.relative_to(SRC)}: {name}"
        for path in SRC.rglob("*.py")
        for name in _records_imports(path)
        if any(part.startswith("_") for part in name.split(".")[1:2])
    }
    assert sorted(private) == []
