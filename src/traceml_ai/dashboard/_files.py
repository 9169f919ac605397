"""The files source: a run's export files as a :class:`~traceml_ai.dashboard._view.RunData`.

It reads with the run summary's one reader, as ``traceml summary --follow`` does:
:func:`~traceml_ai.run_summary.summarize_run` gives the typed summary, with every
figure, the straggler view, the loss report (closing lines,
``finalization_warning.json``) and the step rows behind the lines over steps.
The files are read again only when one of them changed (size, inode or time), at most
every :data:`MIN_AGE_S`; a run still being written is followed until it is complete.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from traceml_ai.dashboard._view import RunData
from traceml_ai.run_summary import (
    STREAM_FILES,
    WARNING_FILE,
    RunSummary,
    SummaryError,
    export_folder_of,
    summarize_run,
)

__all__ = ["MIN_AGE_S", "FilesSource", "check_folder"]

MIN_AGE_S = 1.0
"""The files are looked at again at most this often."""


def check_folder(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be a run or export folder (one line), or None."""
    p = Path(path)
    if not p.exists():
        return f"{p}: no such file or folder"
    if not p.is_dir():
        return f"{p}: give a run folder or an export folder, not a file"
    return None


def _signature(path: Path) -> tuple[Any, ...]:
    """What changes when any file the view reads changes."""
    try:
        export, run = export_folder_of(path)
    except SummaryError as exc:
        return ("error", str(exc))
    out: list[Any] = [str(export)]
    names = [export / f"{n}.jsonl" for n in STREAM_FILES]
    if run is not None:
        names.append(run / WARNING_FILE)
    for f in names:
        try:
            st = os.stat(f)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class FilesSource:
    """RunData of a run folder's export files, read again when they change."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._data: RunData | None = None
        self._signature: tuple[Any, ...] | None = None
        self._at = 0.0

    @property
    def finished(self) -> bool:
        data = self._data
        return data is not None and data.finished

    def __call__(self) -> RunData:
        with self._lock:
            now = time.monotonic()
            if self._data is not None and now - self._at < MIN_AGE_S:
                return self._data
            self._at = now
            signature = _signature(self.path)
            if self._data is None or signature != self._signature:
                self._data = self._build()
                self._signature = signature
            return self._data

    def _build(self) -> RunData:
        try:
            summary = summarize_run(self.path)
        except SummaryError as exc:
            return RunData(
                source="files",
                finished=False,
                status="waiting for export files",
                run_folder=str(self.path),
                waiting=str(exc),
                loss={"status": "in_progress", "lines": [], "warning": None},
            )
        return from_summary(summary)


def from_summary(summary: RunSummary) -> RunData:
    """RunData of a run summary (:func:`summarize_run`), its step rows included."""
    env = summary.environment
    strategy = env.training_strategy if env is not None else None
    ranks = list(summary.ranks)
    rows = summary.rows
    nodes = {
        r: int(row["_node"])
        for r, steps in rows.items()
        for row in list(steps.values())[:1]
        if "_node" in row
    }
    memory = None
    if summary.memory is not None:
        memory = [
            {
                "rank": int(r),
                "device": d,
                "peak_allocated_bytes": peak.peak_allocated_bytes,
                "peak_reserved_bytes": peak.peak_reserved_bytes,
            }
            for r, devs in summary.memory.items()
            for d, peak in devs.items()
        ]
    process = None
    if summary.process is not None:
        process = [
            {
                "rank": int(r),
                "cpu_percent": p.cpu_percent_mean,
                "ram_used_bytes": p.ram_used_bytes_max,
                "gpu_memory_used_bytes": p.gpu_memory_used_bytes_max,
                "gpu_memory_reserved_bytes": p.gpu_memory_reserved_bytes_max,
            }
            for r, p in summary.process.items()
        ]
    system = None
    if summary.system is not None:
        system = [
            {
                "node": int(node),
                "cpu_percent": n.cpu_percent_mean,
                "ram_used_bytes": n.ram_used_bytes_max,
                "ram_total_bytes": n.ram_total_bytes,
                "gpus": [
                    {
                        "index": int(i),
                        "utilization_percent": g.utilization_percent_mean,
                        "memory_used_bytes": g.memory_used_bytes_max,
                        "memory_total_bytes": g.memory_total_bytes,
                        "temperature_c": g.temperature_c_max,
                        "power_usage_w": g.power_usage_w_max,
                    }
                    for i, g in n.gpus.items()
                ],
            }
            for node, n in summary.system.items()
        ]
    loss = summary.loss
    lines = [
        *(f"problem: {p}" for p in summary.problems),
        loss.line,
        *(loss.files[name].line(name) for name in sorted(loss.files)),
    ]
    status = {
        "complete": "files complete",
        "in_progress": "run in progress (files being written)",
        "lost": "files closed, something was lost",
        "damaged": "files damaged",
    }[loss.status]
    world = summary.world_size or (env.world_size if env is not None else None)
    run_folder = summary.run_folder
    return RunData(
        source="files",
        finished=loss.finished,
        status=status,
        run_name=Path(run_folder).name if run_folder else None,
        run_folder=run_folder,
        export_folder=summary.export_folder,
        world_size=world,
        strategy=strategy if isinstance(strategy, str) else None,
        window="every step written",
        ranks=ranks,
        rank_nodes=nodes,
        total_steps={r: len(rows.get(r, {})) for r in ranks},
        step_time=summary.step_time,
        phases=summary.phases,
        phase_names=summary.phase_names,
        straggler=summary.straggler,
        series={
            r: [(st, row["step"], row.get("_ts", 0.0)) for st, row in sorted(steps.items())]
            for r, steps in rows.items()
        },
        memory=memory,
        memory_basis="the largest peak over the run",
        process=process,
        process_basis="CPU: mean over the run; memory: the largest sample",
        system=system,
        system_basis="CPU and GPU use: mean over the run; memory, temperature, power: the largest",
        loss={
            "status": loss.status,
            "lines": lines,
            "warning": loss.warning,
            "warning_file": loss.warning_file,
        },
        notes=list(summary.notes),
        problems=list(summary.problems),
        waiting=None if ranks else "no step written yet",
    )
