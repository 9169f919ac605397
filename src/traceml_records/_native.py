"""The optional C extension, ``traceml_records._speedups``: loaded here, for every user.

The aggregator's line and item encoders (``_codec``) and a rank's step encoder
(``traceml_ai.rank._timing``) use it when it was built. Each has a pure-Python path
that writes the same bytes, taken without the extension or with
``TRACEML_PURE_PYTHON`` set (to anything but ``0``).
"""

from __future__ import annotations

import os
from types import ModuleType


def load() -> ModuleType | None:
    """``traceml_records._speedups``, or None (not built, or ``TRACEML_PURE_PYTHON`` set)."""
    if os.environ.get("TRACEML_PURE_PYTHON", "").strip() not in ("", "0"):
        return None
    try:
        from traceml_records import _speedups
    except ImportError:
        return None
    return _speedups
