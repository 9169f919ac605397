"""The files source: a run's export files as a :class:`~traceml_ai.dashboard._view.RunData`.

It reads with the run summary's one reader, as ``traceml summary --follow`` does:
:func:`~traceml_ai.run_summary.summarize_run` for every figure, the straggler view and
the loss report (closing lines, ``finalization_warning.json``), and the same reader's
step rows (:func:`traceml_ai.run_summary._read.step_rows`) for the lines over steps.
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
    SummaryError,
    format_summary,
    straggler_view,
)
from traceml_ai.run_summary._read import FileRead, exists, step_rows
from traceml_ai.run_summary._report import _folders, _read, summarize_run

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
        export, run = _folders(path)
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
        export_dir = Path(summary["export_folder"])
        info = FileRead("step_time", export_dir / "step_time.jsonl")
        rows: dict[int, dict[int, dict[str, float]]] = {}
        if exists(info.path):
            rows = (_read(info, lambda fh: step_rows(fh, info)) or ({}, set()))[0]
        return from_summary(summary, rows)


def from_summary(summary: dict[str, Any], rows: dict[int, dict[int, dict[str, float]]]) -> RunData:
    """RunData of a run summary (:func:`summarize_run`'s dict) and its step rows."""
    env = summary.get("environment") or {}
    strategy = env.get("training_strategy")
    ranks: list[int] = list(summary.get("ranks") or [])
    rows = {r: steps for r, steps in rows.items() if r in set(ranks)}
    nodes = {
        r: int(row["_node"])
        for r, steps in rows.items()
        for row in list(steps.values())[:1]
        if "_node" in row
    }
    memory = None
    if summary.get("memory") is not None:
        memory = [
            {"rank": int(r), "device": d, **figures}
            for r, devs in summary["memory"].items()
            for d, figures in devs.items()
        ]
    process = None
    if summary.get("process") is not None:
        process = [
            {
                "rank": int(r),
                "cpu_percent": p.get("cpu_percent_mean"),
                "ram_used_bytes": p.get("ram_used_bytes_max"),
                "gpu_memory_used_bytes": p.get("gpu_memory_used_bytes_max"),
                "gpu_memory_reserved_bytes": p.get("gpu_memory_reserved_bytes_max"),
            }
            for r, p in summary["process"].items()
        ]
    system = None
    if summary.get("system") is not None:
        system = [
            {
                "node": int(node),
                "cpu_percent": n.get("cpu_percent_mean"),
                "ram_used_bytes": n.get("ram_used_bytes_max"),
                "ram_total_bytes": n.get("ram_total_bytes"),
                "gpus": [
                    {
                        "index": int(i),
                        "utilization_percent": g.get("utilization_percent_mean"),
                        "memory_used_bytes": g.get("memory_used_bytes_max"),
                        "memory_total_bytes": g.get("memory_total_bytes"),
                        "temperature_c": g.get("temperature_c_max"),
                        "power_usage_w": g.get("power_usage_w_max"),
                    }
                    for i, g in n.get("gpus", {}).items()
                ],
            }
            for node, n in summary["system"].items()
        ]
    loss = summary["loss"]
    text = format_summary(summary)
    lines = [
        line.removeprefix("traceml: ")
        for line in text.splitlines()
        if line.startswith(("traceml: files:", "traceml: problem:"))
    ]
    for name, entry in sorted(loss["files"].items()):
        closed = "closed" if entry.get("closed") else "no closing line yet"
        written = entry.get("written_records")
        lines.append(
            f"{name}.jsonl: {entry['data_lines']:,} lines, {closed}"
            + (f" (closing line: {written:,} written)" if isinstance(written, int) else "")
            + (
                f", {entry['dropped_batches']:,} dropped batches"
                if entry.get("dropped_batches")
                else ""
            )
        )
    finished = not loss["unfinished_files"]
    status = {
        "complete": "files complete",
        "in_progress": "run in progress (files being written)",
        "lost": "files closed, something was lost",
        "damaged": "files damaged",
    }.get(loss["status"], str(loss["status"]))
    world = summary.get("world_size") or env.get("world_size")
    run_folder = summary.get("run_folder")
    return RunData(
        source="files",
        finished=finished,
        status=status,
        run_name=Path(run_folder).name if run_folder else None,
        run_folder=run_folder,
        export_folder=summary["export_folder"],
        world_size=world if isinstance(world, int) else None,
        strategy=strategy if isinstance(strategy, str) else None,
        window="every step written",
        ranks=ranks,
        rank_nodes=nodes,
        total_steps={r: len(rows.get(r, {})) for r in ranks},
        step_time=summary.get("step_time"),
        phases=summary.get("phases"),
        phase_names=summary.get("phase_names") or [],
        straggler=straggler_view(summary),
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
            "status": loss["status"],
            "lines": lines,
            "warning": loss.get("warning"),
            "warning_file": loss.get("warning_file"),
        },
        notes=list(summary.get("notes") or []),
        problems=list(summary.get("problems") or []),
        waiting=None if ranks else "no step written yet",
    )
