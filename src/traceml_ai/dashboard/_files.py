"""The files source: a run's export files as a :class:`~traceml_ai.dashboard._view.RunData`.

It reads with the run summary's one reader, as ``traceml summary --follow`` does:
a :class:`~traceml_ai.analysis.RunReader` gives the typed summary, with every
figure, the straggler view, the loss report (closing lines,
``finalization_warning.json``) and the step columns behind the lines over steps.
Each refresh (at most every :data:`MIN_AGE_S`) reads only what was appended since the
last one; a run still being written is followed until it is complete. The per-rank
phase breakdown is made only for the ranks the page's tables show (:class:`RankPhases`),
never for every rank as ``traceml summary`` prints it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from traceml_ai.analysis import (
    PhaseFigures,
    RankColumns,
    RunReader,
    RunSummary,
    SummaryError,
    rank_phases,
)
from traceml_ai.dashboard._view import RunData

__all__ = ["MIN_AGE_S", "FilesSource", "RankPhases", "check_folder"]

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


class RankPhases(Mapping[str, Mapping[str, PhaseFigures]]):
    """rank (str) -> its phase breakdown, made from its step columns when first asked
    for, then kept: the page reads its tables' ranks' (at most ``MAX_TABLE_ROWS``), and
    a 1,024-rank breakdown is about 4 % of the summary's time. Any rank's is the
    summary's own (:func:`~traceml_ai.analysis.rank_phases`)."""

    def __init__(
        self, rows: Mapping[int, RankColumns], names: Sequence[str], ranks: Sequence[str]
    ) -> None:
        self._rows = rows
        self._names = list(names)
        self._ranks = list(ranks)
        self._present = set(ranks)
        self._made: dict[str, Mapping[str, PhaseFigures]] = {}

    def __getitem__(self, rank: str) -> Mapping[str, PhaseFigures]:
        made = self._made.get(rank)
        if made is None:
            if rank not in self._present:
                raise KeyError(rank)
            # Two requests may make the same rank's at once: the same figures.
            made = self._made[rank] = rank_phases(self._rows[int(rank)], self._names)
        return made

    def __iter__(self) -> Iterator[str]:
        return iter(self._ranks)

    def __len__(self) -> int:
        return len(self._ranks)


class FilesSource:
    """RunData of a run folder's export files as they grow: one :class:`RunReader`
    reads only what was appended since the last refresh."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._data: RunData | None = None
        self._reader: RunReader | None = None
        self._summary: RunSummary | None = None
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
            self._data = self._build()
            return self._data

    def _build(self) -> RunData:
        try:
            self._reader = self._reader or RunReader(self.path, phases=False)
            summary = self._reader.summary()
        except SummaryError as exc:
            return RunData(
                source="files",
                finished=False,
                status="waiting for export files",
                run_folder=str(self.path),
                waiting=str(exc),
                loss={"status": "in_progress", "lines": [], "warning": None},
            )
        if summary is not self._summary or self._data is None:
            self._summary = summary
            return from_summary(summary)
        return self._data


def from_summary(summary: RunSummary) -> RunData:
    """RunData of a run summary (:func:`summarize_run`), its step rows included; the
    phase breakdown the summary left out (``RunReader(phases=False)``) is made rank by
    rank as the page asks for it."""
    env = summary.environment
    strategy = env.training_strategy if env is not None else None
    ranks = list(summary.ranks)
    rows = summary.rows
    phases: Mapping[str, Mapping[str, PhaseFigures]] | None = summary.phases
    if not phases and summary.step_time:
        phases = RankPhases(rows, summary.phase_names, list(summary.step_time))
    nodes = {r: c.node for r, c in rows.items() if c.node is not None}
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
        window=(
            "a sample of the steps written, the same steps on every rank"
            if any(row.sampled for row in rows.values())
            else "every step written"
        ),
        ranks=ranks,
        rank_nodes=nodes,
        layout={
            int(r): {n: (c.rank, c.size) for n, c in coordinates.items()}
            for r, coordinates in (summary.coordinates or {}).items()
        },
        total_steps={r: rows[r].step_count if r in rows else 0 for r in ranks},
        step_time=summary.step_time,
        phases=phases,
        phase_names=summary.phase_names,
        straggler=summary.straggler,
        series=dict(rows),
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
