"""Lookups over the generated stream registry, and parsing of ``export_streams``."""

from __future__ import annotations

from traceml_records._generated.registry import SELECTION_NAMES, STREAMS
from traceml_records._stream_spec import StreamSpec

STREAMS_BY_NAME: dict[str, StreamSpec] = {spec.name: spec for spec in STREAMS}
"""Stream name → its spec."""

STREAM_BY_CLASS: dict[type[object], StreamSpec] = {spec.record_class: spec for spec in STREAMS}
"""Record class → its stream's spec."""

DEFAULT_EXPORT_STREAMS = "step_time"
"""The ``export_streams`` value used when nothing else is set."""

_SUPPORTED = ", ".join(SELECTION_NAMES)


def stream_spec(name: str) -> StreamSpec:
    """The spec of the stream called ``name`` (KeyError if there is none)."""
    return STREAMS_BY_NAME[name]


def streams_selected_by(name: str) -> tuple[str, ...]:
    """File streams that the ``export_streams`` name ``name`` selects, in registry order."""
    if name not in SELECTION_NAMES:
        raise ValueError(f"unknown stream {name!r}; supported: {_SUPPORTED}")
    return tuple(spec.name for spec in STREAMS if name in spec.selected_by)


def parse_export_streams(text: str) -> tuple[str, ...]:
    """Parse an ``export_streams`` value into the file streams it selects.

    The value is a comma-separated list of names from ``SELECTION_NAMES``. Spaces
    around names are ignored, a repeated name is harmless, and the order does not
    matter: the result is always in registry order. ``system`` selects ``system``
    and ``system_gpu``; ``all`` selects every stream. An empty value, an empty item
    or an unknown name raises ``ValueError`` naming the problem and listing the
    supported names.
    """
    if not isinstance(text, str):
        raise ValueError(
            f"expected a comma-separated string, got {type(text).__name__}; supported: {_SUPPORTED}"
        )
    if not text.strip():
        raise ValueError(f"no stream named (empty value); supported: {_SUPPORTED}")
    selected: set[str] = set()
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            raise ValueError(f"empty stream name in {text!r}; supported: {_SUPPORTED}")
        selected.update(streams_selected_by(name))
    return tuple(spec.name for spec in STREAMS if spec.name in selected)
