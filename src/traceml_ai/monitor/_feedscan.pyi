"""traceml_ai.monitor._feedscan, the C extension built from _feedscan.c: its interface.

The live feed's reader of step_time batches; ``_feedscan_py`` is its pure-Python twin
(the same answers; the C one declines more: see ``_feedscan.c``). Without it (not
built, or ``TRACEML_PURE_PYTHON=1``) the feed uses the twin.
"""

from traceml_ai.monitor._feedscan_py import LabelMap

def configure(step_event: str, /) -> None:
    """The whole-step event's name (``analysis.STEP_EVENT``); before any scan."""

def scan_step_time(
    body: bytes, labels: LabelMap, /
) -> (
    tuple[
        int | None,
        int | None,
        int | None,
        int,
        list[int],
        list[int],
        list[float],
        list[dict[str, float]],
        list[tuple[int, float]],
        int,
        bytes,
        bytes,
        bytes,
        int,
    ]
    | None
):
    """``_feedscan_py.scan_step_time``'s fields as a plain tuple, or None."""

def scan_items(
    body: bytes, stream: str, keys: tuple[str, ...], /
) -> tuple[int | None, int | None, int | None, list[tuple[object, ...]]] | None:
    """``_feedscan_py.scan_items``: each item's values of ``keys``, or None."""
