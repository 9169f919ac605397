"""A package's names loaded on first use (PEP 562), written once for every package
that keeps its heavy parts out of ``import`` (the top package, the aggregator, the
transport): nothing is imported here at module level."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, MutableMapping
    from typing import Any


def lazy_getattr(
    package: str,
    modules: Mapping[str, str],
    namespace: MutableMapping[str, Any],
    computed: Mapping[str, Callable[[], Any]] | None = None,
) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: a name of ``modules`` is imported
    from the module given for it, a name of ``computed`` is computed, once each (the
    value is kept in ``namespace``, the package's globals)."""

    def __getattr__(name: str) -> Any:
        if computed is not None and name in computed:
            value = computed[name]()
        elif name in modules:
            import importlib

            value = getattr(importlib.import_module(modules[name]), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    return __getattr__
