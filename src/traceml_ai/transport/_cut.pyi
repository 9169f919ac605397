"""traceml_ai.transport._cut, the C extension built from _cut.c: its interface.

The batches of a relay's connection cut out of a received chunk in one call. Without it
(not built, or ``TRACEML_PURE_PYTHON=1``) the server takes ``_cut_py.cut_batches``,
which has the same rules.
"""

def cut_batches(
    data: bytes, pos: int, prefix: bytes, streams: tuple[bytes, ...], max_frame_bytes: int, /
) -> tuple[list[tuple[bytes, int, int]], int, int]:
    """``(batches, pos, status)``: each plain batch frame from ``pos`` as ``(body,
    length, rank)``, where the next frame starts, and why it stopped there (0: no
    complete frame, 1: a frame to read the general way, 2: a frame over the bound)."""
