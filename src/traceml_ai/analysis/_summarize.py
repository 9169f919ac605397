"""A run summary read from the export files: :class:`RunReader` follows the files and
puts together what :mod:`._figures` and :mod:`._loss` make of them.

It reads only the files, so it works for any number of nodes (the aggregator wrote
every rank's lines) and on a run still in progress: a partial last line is a line
still being written and is ignored; a file without its closing line is reported as
unfinished. Light to import: orjson only (never torch, never pyarrow), because
``traceml run`` calls it at the end of every run with export on.

The straggler analysis is :mod:`traceml_ai.analysis._straggler` (the rule is in its docstring
and in docs/reading-the-files.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from traceml_ai.analysis._causes import Coordinates, layout_of
from traceml_ai.analysis._columns import StepColumns
from traceml_ai.analysis._figures import (
    MemoryPeaks,
    merge_waits,
    step_figures,
    straggler_view,
)
from traceml_ai.analysis._loss import WARNING_FILE, loss_report
from traceml_ai.analysis._model import (
    DevicePeak,
    Environment,
    NodeFigures,
    ProcessFigures,
    RunSummary,
    StepFigures,
)
from traceml_ai.analysis._read import DataLines, FileRead, StepLines, Tail, WaitLines, exists
from traceml_ai.analysis._running import GpuTotals, ProcessTotals, SystemTotals, node_figures
from traceml_ai.analysis._straggler import Coordinate, StragglerView
from traceml_records import STREAMS

STREAM_FILES = tuple(spec.name for spec in STREAMS)
"""The export's file streams, in the registry's order."""


class SummaryError(Exception):
    """The path cannot be summarized (missing, or no export files); one line of text."""


# --------------------------------------------------------------------------- reading


def export_folder_of(path: str | os.PathLike[str]) -> tuple[Path, Path | None]:
    """(export folder, run folder or None) for a run, aggregator or export folder;
    :class:`SummaryError` when ``path`` is none of them."""
    p = Path(path)
    run: Path | None
    if not p.exists():
        raise SummaryError(f"{p}: no such file or folder")
    if not p.is_dir():
        raise SummaryError(f"{p}: give a run folder or an export folder, not a file")
    if (p / "aggregator" / "export").is_dir():
        export, run = p / "aggregator" / "export", p
    elif (p / "export").is_dir() and p.name == "aggregator":
        export, run = p / "export", p.parent
    elif any(p.glob("*.jsonl")):
        export, run = p, (p.parent.parent if p.parent.name == "aggregator" else None)
    else:
        raise SummaryError(f"{p}: no export files here (expected a run folder or an export folder)")
    if not any(exists(export / f"{name}.jsonl") for name in STREAM_FILES):
        raise SummaryError(f"{export}: no export files here (the export folder holds none)")
    return export, run


_KEPT_LINES = ("runtime_environment",)
"""The streams whose lines are kept whole (one per rank, again only when its values
change); the others are kept as figures (step_time, collectives and step_memory as
figures and a window of steps; process, system and system_gpu as running figures per
rank, node and GPU: :mod:`._running`) or only counted."""

_RUNNING: dict[str, type[ProcessTotals | SystemTotals | GpuTotals]] = {
    "process": ProcessTotals,
    "system": SystemTotals,
    "system_gpu": GpuTotals,
}


def _sink_for(
    name: str, step_stride: Callable[[], int] | None = None
) -> tuple[Callable[[list[Any], FileRead], object], Any]:
    """(the sink that reads ``name``'s new lines, what it keeps); the collectives'
    waits are kept for the steps step_time's sample keeps (``step_stride``)."""
    if name == "step_time":
        steps = StepLines()
        return steps, steps
    if name == "collectives":
        waits = WaitLines(step_stride)
        return DataLines(name, waits.add), waits
    if name == "step_memory":
        peaks = MemoryPeaks()
        return DataLines(name, peaks.add), peaks
    running = _RUNNING.get(name)
    if running is not None:
        totals = running()
        return DataLines(name, totals.add), totals
    if name in _KEPT_LINES:
        kept: list[dict[str, Any]] = []
        return DataLines(name, kept.append), kept
    return DataLines(name, _ignore), None


def _ignore(obj: object) -> None:
    """Lines read only for what their file's ``FileRead`` counts (closing line, damage)."""


class RunReader:
    """A run's export files, read as they grow: each :meth:`summary` reads only what was
    appended since the last one and returns the run summary of everything read so far.
    A file replaced, truncated or rewritten is read again from its start, and that it
    changed, or disappeared, stays a problem of every later summary (the files are then
    never called complete).

    ``traceml summary --follow`` and the dashboard from files keep one; a one-off
    :func:`summarize_run` uses one once. Raises :class:`SummaryError` (one line of
    text) when ``path`` is missing or holds no export files. Without ``phases`` the
    summaries' per-rank phase breakdown is left empty (the dashboard from files makes
    its tables' ranks' own with :func:`~traceml_ai.analysis._figures.rank_phases`).
    """

    def __init__(self, path: str | os.PathLike[str], *, phases: bool = True) -> None:
        self.export_dir, self.run_dir = export_folder_of(path)
        self.phases = phases
        self._tails: dict[str, Tail] = {}
        self._kept: dict[str, Any] = {}
        self._gone: set[str] = set()
        self._problems: list[str] = []
        """Files that changed under the reader (replaced, truncated, gone), said once."""
        self._last: RunSummary | None = None
        self._warning: tuple[int, int, int] | None = None

    def _make(self, name: str) -> Callable[[], Callable[..., object]]:
        def make() -> Callable[..., object]:
            sink, kept = _sink_for(name, self._step_stride)
            self._kept[name] = kept
            return sink

        return make

    def _step_stride(self) -> int:
        """The stride of step_time's sample (1: every step kept, or no step_time)."""
        steps = self._kept.get("step_time")
        return steps.columns.stride if isinstance(steps, StepLines) else 1

    def summary(self) -> RunSummary:
        """The run summary of the files as they are now."""
        changed = self._last is None
        for name in STREAM_FILES:
            file = f"{name}.jsonl"
            path = self.export_dir / file
            tail = self._tails.get(name)
            if not exists(path):
                if tail is not None:
                    # A file read before is gone: said, never taken for "not exported".
                    del self._tails[name]
                    self._problem(f"{file}: disappeared while followed")
                    self._gone.add(name)
                    changed = True
                continue
            if tail is None:
                tail = self._tails[name] = Tail(name, path, self._make(name))
                changed = True
            restarts, before = tail.restarts, tail.identity
            changed = tail.read() or changed
            if tail.restarts != restarts and before is not None:
                now = tail.identity
                if now is not None and now[:2] != before[:2]:
                    self._problem(f"{file}: replaced by another file while followed")
                elif now is not None and now[2] < before[2]:
                    self._problem(
                        f"{file}: truncated or rewritten while followed "
                        f"({before[2]} bytes, then {now[2]})"
                    )
                else:
                    self._problem(f"{file}: rewritten while followed")
        warning = _signature(self.run_dir / WARNING_FILE) if self.run_dir is not None else None
        if warning != self._warning:
            self._warning = warning
            changed = True
        if not changed and self._last is not None:
            return self._last
        self._last = self._summarize()
        return self._last

    def _problem(self, line: str) -> None:
        if line not in self._problems:
            self._problems.append(line)

    def _summarize(self) -> RunSummary:
        reads = {name: self._tails[name].info for name in STREAM_FILES if name in self._tails}
        kept = self._kept
        objs = {name: kept[name] for name in _KEPT_LINES if name in reads}
        notes: list[str] = []
        return _summary_of(self, reads, objs, notes, list(self._problems))


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def summarize_run(path: str | os.PathLike[str]) -> RunSummary:
    """Summarize a run folder (or its export folder).

    Raises :class:`SummaryError` (one line of text) when ``path`` is missing or holds
    no export files. What could not be read (a file that is not a regular file, lines
    with impossible values, repeated keys, two runs in one file, a damaged warning
    file) is said in ``problems``, one line each, and the files are then never called
    complete; everything else that is missing is said in ``notes``.
    """
    return RunReader(path).summary()


def _summary_of(
    reader: RunReader,
    reads: dict[str, FileRead],
    objs: dict[str, list[dict[str, Any]]],
    notes: list[str],
    gone_problems: list[str],
) -> RunSummary:
    export_dir, run_dir = reader.export_dir, reader.run_dir
    kept = reader._kept
    strategy: str | None = None
    environment: Environment | None = None
    env_rows = objs.get("runtime_environment", [])
    layout: dict[int, Coordinates] = {}
    if env_rows:
        last: dict[int, dict[str, Any]] = {}
        for obj in env_rows:
            last[obj["global_rank"]] = obj
        for rank, obj in last.items():
            coordinates = layout_of(obj.get("parallel"))
            if coordinates is not None:
                layout[rank] = coordinates
        strategies = sorted({str(o.get("training_strategy")) for o in last.values()})
        strategy = strategies[0] if len(strategies) == 1 else None
        first = next(iter(last.values()), {})
        sources = sorted({str(o.get("parallel_source")) for o in last.values() if layout})
        environment = Environment(
            training_strategy=strategies[0] if len(strategies) == 1 else strategies,
            distributed_backend=first.get("distributed_backend"),
            topology=first.get("topology"),
            world_size=first.get("world_size"),
            torch_version=first.get("torch_version"),
            parallel=_sizes(layout),
            parallel_source=sources[0] if sources and sources[0] != "None" else None,
        )

    rows: StepColumns = {}
    world: set[int] = set()
    figures: StepFigures | None = None
    straggler: StragglerView | None = None
    if "step_time" in reads:
        steps: StepLines = kept["step_time"]
        rows = steps.columns.build() if steps.columns else {}
        world = set(steps.worlds)
    if "step_time" not in reads:
        if "step_time" not in reader._gone:
            notes.append("step times: step_time was not exported")
    elif not rows:
        if reads["step_time"].problem is None:
            notes.append("step times: no step recorded yet")
    else:
        if strategy is None and world and max(world) > 1:
            notes.append(
                "training strategy unknown (runtime_environment not exported); "
                "the wait analysis does not assume DDP"
            )
        figures = step_figures(rows, phases=reader.phases)
        measured = "collectives" in reads and merge_waits(rows, kept["collectives"], notes)
        straggler = straggler_view(rows, strategy, measured, layout)
        if any(c.sampled for c in rows.values()):
            held = sum(len(c) for c in rows.values())
            total = sum(c.step_count for c in rows.values())
            notes.append(
                f"step analysis: from {held:,} of {total:,} steps (each rank keeps at most "
                f"{steps.columns.window:,} steps, the same ones on every rank; the straggler "
                "analysis and the percentiles are of those, the step counts, means, shares "
                "and the longest step of every step)"
            )
        if world:
            # Count rather than list every rank: a world may be very large.
            missing = max(world) - len([r for r in rows if r < max(world)])
            if missing:
                absent = [r for r in range(min(max(world), 1 << 16)) if r not in rows][:10]
                more = ", ..." if missing > len(absent) else ""
                notes.append(
                    f"step times: no line yet from {missing} rank(s) "
                    f"({', '.join(map(str, absent))}{more})"
                )

    memory: dict[str, dict[str, DevicePeak]] | None = None
    if "step_memory" in reads:
        peaks: MemoryPeaks = kept["step_memory"]
        memory = peaks.section()
        if memory and not peaks.any_figure:
            notes.append("peak memory: no allocator figures (a CPU run: peaks are null on cpu)")
    else:
        notes.append("peak memory: step_memory was not exported")

    process: dict[str, ProcessFigures] | None = None
    if "process" in reads:
        totals: ProcessTotals = kept["process"]
        process = totals.figures()
        if process and all(p.gpu_memory_used_bytes_max is None for p in process.values()):
            notes.append("process GPU memory: none (no GPU used by the ranks)")
        impossible = {
            r: p.cpu_percent_impossible_samples
            for r, p in process.items()
            if p.cpu_percent_impossible_samples
        }
        if impossible:
            notes.append(
                "process CPU: "
                + ", ".join(f"rank {r} {n}" for r, n in impossible.items())
                + " sample(s) above 100 % per logical core of the host, left out of the "
                "figures (older samplers wrote such values)"
            )
    else:
        notes.append("process figures: process was not exported")
    system: dict[str, NodeFigures] | None = None
    if "system" in reads:
        system = node_figures(kept["system"], kept.get("system_gpu"))
        if system and all(n.gpu_count == 0 for n in system.values()):
            notes.append("GPU figures: no GPU on the host(s)")
    else:
        notes.append("system figures: system was not exported")

    problems = [line for info in reads.values() for line in info.problems()]
    problems.extend(gone_problems)
    loss = loss_report(reads, run_dir, notes, problems)
    return RunSummary(
        export_folder=str(export_dir),
        run_folder=str(run_dir) if run_dir is not None else None,
        streams=list(reads),
        environment=environment,
        ranks=sorted(rows),
        world_size=max(world) if world and rows else None,
        step_time=figures.step_time if figures else None,
        phases=figures.phases if figures else None,
        phase_names=figures.phase_names if figures else [],
        straggler=straggler,
        memory=memory,
        process=process,
        system=system,
        loss=loss,
        problems=problems,
        notes=notes,
        coordinates={
            str(r): {n: Coordinate(rank=c, size=size) for n, (c, size) in sorted(co.items())}
            for r, co in sorted(layout.items())
        }
        or None,
        rows=rows,
    )


def _sizes(layout: Mapping[int, Coordinates]) -> dict[str, int] | None:
    """The dimensions and sizes, when every rank with coordinates says the same ones."""
    found = {tuple(sorted((n, s) for n, (_, s) in co.items())) for co in layout.values()}
    return dict(next(iter(found))) if len(found) == 1 else None
