"""A package's surface declared once, its names loaded on first use (PEP 562), for every
package that keeps its heavy parts out of ``import`` (the top package, the aggregator,
the transport, the rank SDK, the live views): nothing is imported here at module level.

A lazy package declares its surface in one table, ``_LAZY`` (module -> the names it
gives), and makes its ``__all__``, ``__getattr__`` and ``__dir__`` of it with
:func:`lazy_surface`. Its ``if TYPE_CHECKING:`` block imports the same names
(``from module import name as name``) for mypy and the editors, which never run the
table; ``tests/traceml_ai/test_surfaces.py`` holds the block to the table. A package
whose import is cheap imports its names eagerly and lists them in ``__all__``, which
ruff holds to the imports (F401, F822).
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, MutableMapping
    from typing import Any


def lazy_surface(
    package: str,
    modules: Mapping[str, tuple[str, ...]],
    namespace: MutableMapping[str, Any],
    *,
    eager: Iterable[str] = (),
    computed: Mapping[str, Callable[[], Any]] | None = None,
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__all__``, ``__getattr__`` and ``__dir__`` of ``package``.

    ``modules`` maps each module to the names it gives the package: a name is imported
    from its module on first use. ``computed`` names are computed on first use;
    ``eager`` names are already in ``namespace`` (the package's globals), imported with
    the package. Each value is kept in ``namespace``, so it is looked up once.
    ``__all__`` is the eager, lazy and computed names, sorted.
    """
    origin = {name: module for module, names in modules.items() for name in names}
    extra = {} if computed is None else dict(computed)
    public = sorted({*eager, *origin, *extra})

    def __getattr__(name: str) -> Any:
        if name in extra:
            value = extra[name]()
        elif name in origin:
            import importlib

            value = getattr(importlib.import_module(origin[name]), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *public})

    return public, __getattr__, __dir__
