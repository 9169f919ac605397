"""A custom exporter factory that prints to stdout (as user code may) before delegating.

``tests.scripts.noisy_exporter:make_exporter``: the aggregator process must keep
its own protocol with the launcher whatever user code writes to stdout.
"""

from __future__ import annotations

import sys
from typing import Any

from tests.custom_exporters import make_exporter as _make_recording_exporter
from traceml_ai.export import ExportContext


def make_exporter(context: ExportContext) -> Any:
    print("hello from a noisy exporter factory")
    print("{not json either")
    sys.stdout.flush()
    return _make_recording_exporter(context)
