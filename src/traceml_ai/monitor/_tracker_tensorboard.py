"""The TensorBoard tracker: event files written with the ``tensorboard`` package's
own writer (the ``tensorboard`` extra).

``tensorboard.summary.writer.event_file_writer.EventFileWriter`` is the writer
``torch.utils.tensorboard`` itself wraps; taken directly, the aggregator (which never
imports torch) needs only the package TensorBoard's reader comes in, and no second
library (tensorboardX) that re-implements the same file format.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from traceml_ai.monitor._service import RunInfo

__all__ = ["LOG_DIR_PARTS", "TensorBoardTracker", "open_tensorboard"]

LOG_DIR_PARTS = ("aggregator", "tensorboard")
"""Where, under the run folder, the event files go."""

FLUSH_S = 10.0
"""The writer's own flush period (it also flushes at close)."""


def log_dir(run: RunInfo) -> Path:
    """The folder of the run's event files."""
    return run.run_dir.joinpath(*LOG_DIR_PARTS)


class TensorBoardTracker:
    """One event file of scalars under ``<run folder>/aggregator/tensorboard/``."""

    def __init__(self, folder: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        folder.mkdir(parents=True, exist_ok=True)
        self._event = event_pb2.Event
        self._summary = summary_pb2.Summary
        self._writer = EventFileWriter(str(folder), flush_secs=FLUSH_S, filename_suffix=".traceml")

    def log(self, figures: Mapping[str, float], step: int) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in figures.items()]
        event = self._event(wall_time=time.time(), step=step, summary=self._summary(value=values))
        self._writer.add_event(event)

    def close(self) -> None:
        self._writer.close()


def open_tensorboard(run: RunInfo) -> TensorBoardTracker:
    return TensorBoardTracker(log_dir(run))
