"""The declared surface between the packages: traceml_ai uses traceml_records through
its public names and ``traceml_records.internal`` only (docs/dev/architecture.md)."""

from __future__ import annotations

import ast
import re
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
    importlib.import_module("traceml_ai.analysis")
    assert callable(traceml_ai.summary)


# -- the declared surfaces between traceml_ai's own subpackages ---------------------------


def _package_of(path: Path) -> str:
    """The package a source file belongs to (``traceml_ai`` for the top-level files)."""
    return ".".join(("traceml_ai", *path.relative_to(SRC).parent.parts))


def _module_of(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(("traceml_ai", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _private_owner(name: str) -> str | None:
    """For ``traceml_ai.a._b.c``, the package whose private module it names
    (``traceml_ai.a``); None when ``name`` names no private module of traceml_ai."""
    parts = name.split(".")
    if parts[0] != "traceml_ai":
        return None
    for i, part in enumerate(parts[1:], 1):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def _may_import(package: str, owner: str) -> bool:
    """A private module is private to the package that holds it and the packages
    below it: the top-level ``_converter``, ``_environ``, ``_fork``, ``_lazy_names``,
    ``_loopback`` and ``_queue`` serve every subpackage; ``rank._runtime.sdk`` serves ``rank`` only."""
    return package == owner or package.startswith(owner + ".")


def _imported_names(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative imports: the checks below read absolute ones"
            if node.module:
                found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return found


def _cross_private_imports() -> set[str]:
    found = set()
    for path in SRC.rglob("*.py"):
        package = _package_of(path)
        for name in _imported_names(ast.parse(path.read_text(encoding="utf-8"))):
            owner = _private_owner(name)
            if owner is not None and not _may_import(package, owner):
                # Named by the private module itself (``a._b``, not ``a._b.NAME``).
                module = name.split(".")
                cut = next(i for i, p in enumerate(module) if i and p.startswith("_"))
                found.add(f"{path.relative_to(SRC)}: {'.'.join(module[: cut + 1])}")
    return found


def test_no_module_imports_a_private_module_of_another_subpackage() -> None:
    """Each subpackage's ``__init__`` (or public module) is its surface: ``from
    traceml_ai.rank import StepTimer``, never ``from traceml_ai.rank._timing.step_timer ...``."""
    found = _cross_private_imports()
    assert sorted(found) == [], "import these through their package's surface"


def test_the_check_sees_a_cross_import() -> None:
    assert _private_owner("traceml_ai.rank._runtime.sdk.init") == "traceml_ai.rank"
    assert _private_owner("traceml_ai._fork") == "traceml_ai"
    assert _private_owner("traceml_ai.monitor.otlp") is None
    assert not _may_import("traceml_ai.integrations", "traceml_ai.rank")
    assert not _may_import("traceml_ai", "traceml_ai.rank")
    assert _may_import("traceml_ai.rank", "traceml_ai.rank")
    assert _may_import("traceml_ai.monitor", "traceml_ai")
    tree = ast.parse("from traceml_ai.rank import _sdk\nimport traceml_ai.export._builder\n")
    names = _imported_names(tree)
    assert {_private_owner(n) for n in names} >= {"traceml_ai.rank", "traceml_ai.export"}


# -- no project module loaded by name ------------------------------------------------------

_IMPORT_CALLS = frozenset({"import_module", "__import__"})
# Where a module name is computed at run time, and why (none of them names one of ours):
_DYNAMIC_IMPORTS = {
    "_lazy_names.py": "the declared lazy loader: a package's _LAZY table",
    "export/_custom.py": "the user's exporter, `module:factory`",
    "integrations/lightning.py": "Lightning's two package names",
    "launch/bootstrap.py": "the integration a framework's method is patched with, imported "
    "at the method's first call (the framework may still be importing before)",
}


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _literal_prefix(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):  # an f-string: its leading text
        first = node.values[0] if node.values else None
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
        return ""
    return None


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _string_loads(path: Path, tree: ast.AST) -> list[str]:
    """How ``path`` loads modules by name, each a line that says where."""
    rel = str(path.relative_to(SRC))
    found = []
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _call_name(node) in _IMPORT_CALLS and node.args:
            prefix = _literal_prefix(node.args[0])
            if prefix is None:
                if rel not in _DYNAMIC_IMPORTS:
                    found.append(f"{rel}:{node.lineno}: a module name computed at run time")
            elif prefix.startswith("traceml_ai") and prefix != _module_of(path):
                # (A module may load itself: bootstrap's __main__ runs its importable copy.)
                found.append(f"{rel}:{node.lineno}: {prefix!r} by name; import it")
        elif isinstance(node, ast.Call) and _call_name(node) == "load_extension" and node.args:
            name = _literal_prefix(node.args[0]) or ""
            owner = _private_owner(name)
            if owner is not None and not _may_import(_package_of(path), owner):
                found.append(f"{rel}:{node.lineno}: another package's extension {name!r}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and re.fullmatch(r"traceml_ai(\.\w+)+:\w+", node.value)
        ):
            found.append(f"{rel}:{node.lineno}: {node.value!r}, a function named to be loaded")
    return found


def _lazy_tables(tree: ast.Module) -> list[ast.expr]:
    return [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)
    ]


def test_no_module_loads_a_project_module_by_name() -> None:
    """A module of ours is imported with ``import``, where every tool sees it; the one
    exception is a package's ``_LAZY`` table (``_lazy_names``), checked below."""
    found = []
    for path in SRC.rglob("*.py"):
        found += _string_loads(path, ast.parse(path.read_text(encoding="utf-8")))
    assert found == []


def test_the_string_check_sees_a_load_by_name() -> None:
    code = (
        "import importlib\n"
        'importlib.import_module("traceml_ai.dashboard")\n'
        'SINKS = {"dashboard": "traceml_ai.dashboard:start_live_dashboard"}\n'
        "def f(name):\n"
        "    return importlib.import_module(name)\n"
    )
    found = _string_loads(SRC / "monitor" / "_service.py", ast.parse(code))
    assert len(found) == 3, found


def test_every_lazy_table_names_a_surface_it_may_import() -> None:
    """The lazy tables obey the import rule (the top-level names come from
    ``traceml_ai.rank``, not its private modules) and each name resolves."""
    import importlib

    tables = 0
    for path in SRC.rglob("__init__.py"):
        package = _package_of(path)
        for table in _lazy_tables(ast.parse(path.read_text(encoding="utf-8"))):
            tables += 1
            modules = {
                n.value
                for n in ast.walk(table)
                if isinstance(n, ast.Constant)
                and isinstance(n.value, str)
                and n.value.startswith("traceml_ai")
            }
            assert modules, path
            for module in modules:
                owner = _private_owner(module)
                assert owner is None or _may_import(package, owner), f"{package}: {module}"
        if _lazy_tables(ast.parse(path.read_text(encoding="utf-8"))):
            loaded = importlib.import_module(package)
            for name in loaded.__all__:
                assert getattr(loaded, name) is not None, f"{package}.{name}"
    assert tables >= 5  # traceml_ai, rank, monitor, aggregator, transport
