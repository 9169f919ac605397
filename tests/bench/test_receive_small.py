"""``bench.receive`` measures the path it names: every frame it feeds is a batch queued."""

from __future__ import annotations

import pytest

from bench import receive

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("frames", [1, 5, 8])
def test_every_frame_fed_is_queued_and_timed(frames: int) -> None:
    assert receive.measure(frames, reads=50, repeat=2) > 0.0
