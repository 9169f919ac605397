"""Each package surface is declared once (``traceml_ai._lazy_names``): a lazy package
by its ``_LAZY`` table, from which ``lazy_surface`` makes ``__all__``; an eager one by
its imports, which ruff holds to its ``__all__``. The one copy a lazy table has, the
``if TYPE_CHECKING:`` imports mypy and editors read, is held to the table here."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "traceml_ai"
INITS = sorted(SRC.rglob("__init__.py"))


def _package(path: Path) -> str:
    return ".".join(("traceml_ai", *path.relative_to(SRC).parent.parts))


def _assigned(tree: ast.Module, name: str) -> list[ast.Assign]:
    """The module-level assignments to ``name`` (alone or in a tuple of targets)."""
    found = []
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            names = target.elts if isinstance(target, ast.Tuple) else [target]
            if any(isinstance(n, ast.Name) and n.id == name for n in names):
                found.append(node)
    return found


def _type_checking_imports(tree: ast.Module) -> dict[str, tuple[str, ...]]:
    """The ``if TYPE_CHECKING:`` block's imports, module -> names, each imported as
    itself (``from m import x as x``, what mypy takes for a re-export)."""
    found: dict[str, list[str]] = {}
    for node in tree.body:
        if not (isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"):
            continue
        for inner in node.body:
            if isinstance(inner, ast.ImportFrom) and inner.module:
                for alias in inner.names:
                    assert alias.asname == alias.name, (
                        f"{inner.module}: import {alias.name} as itself"
                    )
                    found.setdefault(inner.module, []).append(alias.name)
    return {module: tuple(names) for module, names in found.items()}


def _lazy_table(tree: ast.Module) -> dict[str, tuple[str, ...]] | None:
    tables = _assigned(tree, "_LAZY")
    if not tables:
        return None
    assert len(tables) == 1
    table = ast.literal_eval(tables[0].value)
    assert isinstance(table, dict)
    return {module: tuple(names) for module, names in table.items()}


@pytest.mark.parametrize("path", INITS, ids=lambda p: _package(p))
def test_each_surface_is_declared_once(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    table = _lazy_table(tree)
    alls = _assigned(tree, "__all__")
    if table is None:
        # Eager: the imports and definitions are the surface; ruff holds __all__ to them.
        assert _assigned(tree, "__getattr__") == [], "a lazy package declares _LAZY"
        assert all(isinstance(a.value, ast.List) for a in alls), "an eager __all__ is a list"
        return
    # Lazy: __all__ comes from the table, and the typing imports are the table's.
    assert len(alls) == 1, "one __all__"
    call = alls[0].value
    assert isinstance(call, ast.Call) and ast.unparse(call.func) == "lazy_surface"
    assert ast.unparse(alls[0].targets[0]) == "(__all__, __getattr__, __dir__)"
    typing = _type_checking_imports(tree)
    assert {m: sorted(n) for m, n in typing.items()} == {m: sorted(n) for m, n in table.items()}, (
        "the TYPE_CHECKING imports are the _LAZY table's names, module by module"
    )
    package = importlib.import_module(_package(path))
    lazy_names = {name for names in table.values() for name in names}
    assert lazy_names <= set(package.__all__)
    assert package.__all__ == sorted(package.__all__)


def test_the_checks_see_a_surface_declared_twice() -> None:
    code = (
        "TYPE_CHECKING = False\n"
        "if TYPE_CHECKING:\n"
        "    from m import a as a\n"
        "    from m import b as b\n"
        '_LAZY = {"m": ("a",)}\n'
    )
    tree = ast.parse(code)
    assert _type_checking_imports(tree) == {"m": ("a", "b")}
    assert _lazy_table(tree) == {"m": ("a",)}
    with pytest.raises(AssertionError, match="as itself"):
        _type_checking_imports(ast.parse("if TYPE_CHECKING:\n    from m import a\n"))


def test_a_lazy_surface_loads_nothing_until_asked() -> None:
    import subprocess
    import sys

    code = (
        "import sys, traceml_ai, traceml_ai.aggregator, traceml_ai.transport\n"
        "assert 'traceml_ai.rank' not in sys.modules\n"
        "assert 'traceml_ai.aggregator._service' not in sys.modules\n"
        "assert 'traceml_ai.transport.server' not in sys.modules\n"
        "assert 'init' in traceml_ai.__all__ and 'init' in dir(traceml_ai)\n"
        "traceml_ai.init\n"
        "assert 'traceml_ai.rank' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
