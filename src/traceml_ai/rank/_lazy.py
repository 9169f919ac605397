"""Lazy torch access: ``import traceml_ai`` must never import torch."""

from __future__ import annotations

import importlib
from typing import Any

_torch: Any = None
_tried = False


def torch_or_none() -> Any:
    """Return the ``torch`` module, importing it on first use; ``None`` if it is not installed."""
    global _torch, _tried
    if not _tried:
        try:
            _torch = importlib.import_module("torch")
        except Exception:
            _torch = None
        _tried = True
    return _torch
