"""The view builder's fixed choices (``traceml_ai.dashboard._view``)."""

from __future__ import annotations

from traceml_ai.analysis import BUILT_IN_PHASES, MAX_USER_PHASES, OTHER_PHASE
from traceml_ai.dashboard._view import PHASE_COLOURS, USER_PHASE_COLOURS


def test_every_phase_the_page_draws_has_a_colour_of_its_own() -> None:
    """Fixed colours for every phase a run may have; enough others for the user phases
    the page keeps (the rest are ``other``), none of them a fixed one."""
    assert set(PHASE_COLOURS) == {*BUILT_IN_PHASES, OTHER_PHASE, "rest"}
    assert len(USER_PHASE_COLOURS) >= MAX_USER_PHASES
    every = [*PHASE_COLOURS.values(), *USER_PHASE_COLOURS]
    assert len({c.lower() for c in every}) == len(every)
