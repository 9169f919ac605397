"""The optional C extensions, loaded here for every user.

``traceml_records._speedups`` (the aggregator's line and item encoders in ``_codec``,
a rank's step encoder) and ``traceml_ai.rank._hotpath`` (the step timer's per-call
methods) are used when they were built. Each has a pure-Python path that behaves the
same, taken without the extension or with ``TRACEML_PURE_PYTHON`` set (to anything
but ``0``).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def load(name: str = "traceml_records._speedups") -> ModuleType | None:
    """The extension module ``name``, or None (not built, or ``TRACEML_PURE_PYTHON`` set)."""
    if os.environ.get("TRACEML_PURE_PYTHON", "").strip() not in ("", "0"):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
