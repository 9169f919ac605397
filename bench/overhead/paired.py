"""The estimator of the overhead benches: one traced step in ``k``, in one process.

A traced step costs more than its own time. The steps after it are slower too, and
come down one after another: on this project's 2-core VM, with one step in 4 traced
on a ~700 µs CPU step, the three untraced steps after a traced one took +10, +3 and
+0 µs over the last of them (caches and the allocator refilled after TraceML's work,
the sender thread encoding the step's items meanwhile). So the old figure, (traced -
the next untraced step) with the two kinds alternating, read what the untraced
neighbour also paid as if it were free, and in an A/A run (nothing traced, steps
flagged in turns) it read +5 µs where nothing differed, because a step after any slow
one is slower.

Here the steps are placed by their position after the last traced step, ``0`` (the
traced one) to ``k - 1``. The cost of a traced step is what positions ``0 .. k - 2``
take over position ``k - 1``, the step furthest from it: its own extra time plus what
spills into the next steps. An A/A run (``null``: TraceML never started, steps
placed by their index) shows the estimator reads about 0 when nothing differs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import NamedTuple


class Cycle(NamedTuple):
    """Medians by position after the last traced step (``by_position[0]``: the traced
    steps), in the unit of the values; ``own``: position 0 over the last position;
    ``spill``: what positions 1 .. k - 2 take over it; ``cost``: own + spill."""

    by_position: tuple[float, ...]
    own: float
    spill: float
    cost: float


def positions(traced: Sequence[bool]) -> list[int | None]:
    """Each step's position after the last traced step (``None`` before the first)."""
    out: list[int | None] = []
    last: int | None = None
    for i, flag in enumerate(traced):
        if flag:
            last = i
        out.append(None if last is None else i - last)
    return out


def cycle(values: Sequence[float], where: Sequence[int | None], k: int, skip: int = 0) -> Cycle:
    """The figures of one run: ``where`` from :func:`positions` (or ``i % k`` for an A/A
    run); ``skip``: warm-up steps left out at the start."""
    if k < 2:
        raise ValueError("k must be at least 2")
    by_position = []
    for p in range(k):
        at = [v for v, w in zip(values[skip:], where[skip:], strict=True) if w == p]
        if not at:
            raise ValueError(f"no step at position {p} after a traced one")
        by_position.append(statistics.median(at))
    last = by_position[-1]
    own = by_position[0] - last
    spill = sum(by_position[1:-1]) - (k - 2) * last
    return Cycle(tuple(by_position), own, spill, own + spill)
