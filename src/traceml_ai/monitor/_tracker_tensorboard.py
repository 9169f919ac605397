"""The TensorBoard tracker: event files written with the ``tensorboard`` package's
own record writer (the ``tensorboard`` extra).

``tensorboard.summary.writer.record_writer.RecordWriter`` frames each event as
``torch.utils.tensorboard``'s writer does; taken directly, the aggregator (which never
imports torch) needs only the package TensorBoard's reader comes in, and no second
library (tensorboardX) that re-implements the same file format. It is driven from the
sink's own thread, each point written and flushed there: the package's
``EventFileWriter`` would write from a thread of its own, whose failure (a full disk,
a folder made read-only) would print a traceback on the training terminal instead of
costing a counted point.

The event file goes into the log dir of the script's own ``SummaryWriter`` when rank 0
told one (HF's ``TensorBoardCallback``, Lightning's ``TensorBoardLogger``): TensorBoard
reads every event file of a folder as one run, so TraceML's charts sit beside the
script's. Else, and when that folder is not on the aggregator's machine, into
``<run folder>/aggregator/tensorboard/``.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from traceml_ai.monitor.tracker_metrics import SUMMARY_ARTIFACT

if TYPE_CHECKING:
    from traceml_ai.monitor._sink import RunInfo

__all__ = ["LOG_DIR_PARTS", "SUMMARY_TAG", "TensorBoardTracker", "open_tensorboard"]

LOG_DIR_PARTS = ("aggregator", "tensorboard")
"""Where, under the run folder, the event files go."""

_FILES = itertools.count()
"""Numbers the event files of this process (two in one folder within a second)."""

SUMMARY_TAG = "traceml/summary"
"""The tag of the text entry that holds the run summary's figures."""


def log_dir(run: RunInfo) -> Path:
    """The folder of the run's event files."""
    return run.run_dir.joinpath(*LOG_DIR_PARTS)


class TensorBoardTracker:
    """One event file of scalars in ``folder``."""

    def __init__(self, folder: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._event = event_pb2.Event
        self._summary = summary_pb2.Summary
        # TensorBoard's own naming, which its reader orders a folder's files by.
        now = time.time()
        host, pid, n = socket.gethostname(), os.getpid(), next(_FILES)
        name = f"events.out.tfevents.{int(now):010d}.{host}.{pid}.{n}.traceml"
        self.path = folder / name
        self._writer = RecordWriter(self.path.open("xb"))
        self._write(self._event(wall_time=now, file_version="brain.Event:2"))
        self._last_step = 0

    def _write(self, event: object) -> None:
        self._writer.write(event.SerializeToString())  # type: ignore[attr-defined]
        self._writer.flush()

    def log(self, figures: Mapping[str, float], step: int) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in figures.items()]
        event = self._event(wall_time=time.time(), step=step, summary=self._summary(value=values))
        self._write(event)
        self._last_step = step

    def log_summary(self, fields: Mapping[str, float | str], summary_json: bytes) -> None:
        """The figures as one text entry (TensorBoard's Text tab: a table), the JSON as
        a file beside the event files."""
        from tensorboard.compat.proto import tensor_pb2, types_pb2
        from tensorboard.plugins.text import metadata

        rows = ["| field | value |", "|---|---|"]
        rows.extend(
            f"| {k} | {v if isinstance(v, str) else f'{v:.6g}'} |" for k, v in fields.items()
        )
        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING, string_val=["\n".join(rows).encode()]
        )
        value = self._summary.Value(
            tag=SUMMARY_TAG,
            tensor=tensor,
            metadata=metadata.create_summary_metadata(
                display_name="TraceML run summary", description=""
            ),
        )
        event = self._event(
            wall_time=time.time(), step=self._last_step, summary=self._summary(value=[value])
        )
        self._write(event)
        (self.folder / SUMMARY_ARTIFACT).write_bytes(summary_json)

    def close(self) -> None:
        self._writer.close()


def open_tensorboard(run: RunInfo, user: Mapping[str, str] | None = None) -> TensorBoardTracker:
    """The script's log dir when it is a folder here, else the run folder's."""
    if user is not None:
        folder = Path(user.get("log_dir", ""))
        if not folder.is_absolute() or not folder.is_dir():
            raise FileNotFoundError(f"the log dir {str(folder)!r} is not a folder on this machine")
        return TensorBoardTracker(folder)
    return TensorBoardTracker(log_dir(run))
