"""Process-level settings of an aggregator process (tune_gc_for_aggregator)."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator

import pytest

from traceml_ai.aggregator import tune_gc_for_aggregator
from traceml_ai.aggregator._process import AGGREGATOR_GC_GEN0_THRESHOLD


@pytest.fixture
def restore_gc() -> Iterator[None]:
    saved = gc.get_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*saved)


def test_raises_a_lower_young_threshold_only(restore_gc: None) -> None:
    gc.set_threshold(700, 10, 10)
    tune_gc_for_aggregator()
    assert gc.get_threshold() == (AGGREGATOR_GC_GEN0_THRESHOLD, 10, 10)
    gc.set_threshold(50_000, 5, 7)
    tune_gc_for_aggregator()
    assert gc.get_threshold() == (50_000, 5, 7)
    gc.set_threshold(0, 10, 10)  # automatic collection off: the user's choice
    tune_gc_for_aggregator()
    assert gc.get_threshold() == (0, 10, 10)


def test_a_library_import_changes_nothing() -> None:
    # Only the aggregator entry points tune; importing the package must not.
    code = (
        "import gc; before = gc.get_threshold()\n"
        "import traceml_ai.aggregator, traceml_ai.export, traceml_ai.integrations.ray\n"
        "assert gc.get_threshold() == before, (before, gc.get_threshold())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
