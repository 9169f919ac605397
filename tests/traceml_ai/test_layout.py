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


def test_no_subpackage_shadows_a_public_name() -> None:
    """Importing a submodule sets it as an attribute of its package: a folder named
    like a public function (``traceml.summary``) would replace that function."""
    import importlib
    import pkgutil

    import traceml_ai

    public = set(traceml_ai.__all__)
    for info in pkgutil.iter_modules(traceml_ai.__path__):
        assert info.name not in public, info.name
    importlib.import_module("traceml_ai.run_summary")
    assert callable(traceml_ai.summary)
