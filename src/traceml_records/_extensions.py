"""The one place that chooses a C extension or its pure-Python twin.

Every optional C extension of the two packages (``traceml_records._speedups``,
``traceml_ai.rank._timing.hotpath``, ``traceml_ai.transport._nowait``,
``traceml_ai.transport._cut`` and ``traceml_ai.monitor._feedscan``) is loaded
through :func:`load`: the module when it was built, else None, and then its caller takes
the pure-Python path that behaves the same. ``TRACEML_PURE_PYTHON`` set (to anything
but ``0``) makes every caller take the pure-Python path.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

PURE_PYTHON_ENV = "TRACEML_PURE_PYTHON"


def load(name: str = "traceml_records._speedups") -> ModuleType | None:
    """The extension module ``name``, or None (not built, or ``TRACEML_PURE_PYTHON`` set)."""
    if os.environ.get(PURE_PYTHON_ENV, "").strip() not in ("", "0"):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
