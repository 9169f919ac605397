"""Shared test setup: hypothesis profiles.

``ci`` (few examples) is loaded when the ``CI`` or ``FAST`` environment variable is
set; otherwise ``thorough``. ``HYPOTHESIS_PROFILE`` picks one explicitly.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

# tests/strategies.py is imported as a plain module by the test files.
sys.path.insert(0, str(Path(__file__).parent))

settings.register_profile(
    "ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
_default = "ci" if os.environ.get("CI") or os.environ.get("FAST") else "thorough"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default))
