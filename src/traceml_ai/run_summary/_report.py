"""A run summary read from the export files: step time per rank, phases, memory,
process and system figures, the straggler view and what was lost.

It reads only the files, so it works for any number of nodes (the aggregator wrote
every rank's lines) and on a run still in progress: a partial last line is a line
still being written and is ignored; a file without its closing line is reported as
unfinished. Light to import: orjson only (never torch, never pyarrow), because
``traceml run`` calls it at the end of every run with export on.

The straggler analysis is :mod:`traceml_ai.run_summary._straggler` (the rule is in its docstring
and in docs/reading-the-files.md).
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import numpy as np
import orjson

from traceml_ai.run_summary._causes import Coordinates, Layout, layout_of
from traceml_ai.run_summary._columns import (
    STEP_KEY,
    TS_KEY,
    StepColumns,
    columns_of_rows,
    is_columns,
)
from traceml_ai.run_summary._model import (
    DevicePeak,
    Environment,
    FileState,
    GpuFigures,
    LossReport,
    LossStatus,
    NodeFigures,
    PhaseFigures,
    ProcessFigures,
    RankSteps,
    RunSummary,
    StepFigures,
    StepRows,
)
from traceml_ai.run_summary._phases import (
    OP_WAIT_PREFIX,
    WAIT_PREFIX,
    mean,
    op_label,
    percentiles,
    phase_breakdown,
    phase_names,
    rounded,
    wait_component,
    waits_measured,
)
from traceml_ai.run_summary._read import (
    DataLines,
    FileRead,
    StepLines,
    Tail,
    exists,
    read_bytes,
)
from traceml_ai.run_summary._straggler import Coordinate, StragglerView
from traceml_ai.run_summary._straggler import analyze as analyze_stragglers
from traceml_records import STREAMS

MAX_PLAUSIBLE_CORES = 8192
"""Logical cores assumed when a process line does not say its host's: Linux's largest
``NR_CPUS``, so only a ``cpu_percent`` no Linux host can reach is left out."""
_T = TypeVar("_T")

STREAM_FILES = tuple(spec.name for spec in STREAMS)
"""The export's file streams, in the registry's order."""
WARNING_FILE = "finalization_warning.json"


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


# --------------------------------------------------------------------------- statistics


# --------------------------------------------------------------------------- streams


def step_figures(rows: StepRows | StepColumns) -> StepFigures:
    """Per-rank step figures, per-rank phase breakdown and the phase names, in order, of
    step columns or dict rows (rank -> step -> row)."""
    columns: StepColumns = rows if is_columns(rows) else columns_of_rows(rows)  # type: ignore[assignment,arg-type]
    with np.errstate(all="ignore"):
        return _step_figures(columns)


def _step_figures(columns: StepColumns) -> StepFigures:
    names = phase_names([c.values for c in columns.values()])
    per_rank: dict[str, RankSteps] = {}
    phases: dict[str, dict[str, PhaseFigures]] = {}
    for rank in sorted(columns):
        c = columns[rank]
        if not len(c):
            continue
        times = c.values[STEP_KEY]
        ts = c.column(TS_KEY)
        stamps = ts[ts > 0]
        span_s = float(stamps.max() - stamps.min()) / 1e9 if len(stamps) >= 2 else 0.0
        average = float(times.sum() / len(times))
        # Steps per second over the wall time between the first and last step ends
        # (includes time between steps); from the mean step time when that is unknown.
        if span_s > 0:
            rate = (len(stamps) - 1) / span_s
        else:
            rate = 1000.0 / average if average > 0 else 0.0
        p50, p90, p99 = percentiles(times, (50.0, 90.0, 99.0))
        per_rank[str(rank)] = RankSteps(
            steps=len(times),
            first_step=int(c.steps[0]),
            last_step=int(c.steps[-1]),
            p50_ms=rounded(p50),
            p90_ms=rounded(p90),
            p99_ms=rounded(p99),
            max_ms=rounded(float(times.max())),
            mean_ms=rounded(average),
            steps_per_s=rounded(rate),
        )
        phases[str(rank)] = {
            name: PhaseFigures(**figures) for name, figures in phase_breakdown(c, names).items()
        }
    return StepFigures(step_time=per_rank, phases=phases, phase_names=names)


def _straggler_view(
    columns: StepColumns, strategy: str | None, collectives: bool, layout: Layout | None
) -> StragglerView:
    """The straggler analysis (:mod:`traceml_ai.run_summary._straggler`) of the step rows."""
    nodes = {rank: c.node for rank, c in columns.items() if c.node is not None}
    return analyze_stragglers(columns, strategy, nodes, collectives, layout)


class _Waits:
    """The collectives lines' waits as they are read: per rank, one entry per line and
    wait key (``_cw:<component>`` and ``_cwop:<component>:<op>``), kept as columns."""

    def __init__(self) -> None:
        self.steps: dict[int, array[int]] = {}
        self.keys: dict[int, array[int]] = {}
        self.waits: dict[int, array[float]] = {}
        self.names: dict[str, int] = {}
        self.unmeasured: set[int] = set()
        self._ids: dict[tuple[str, str], tuple[int, int]] = {}

    def add(self, obj: Mapping[str, Any]) -> None:
        rank = obj["global_rank"]
        steps = self.steps.get(rank)
        if steps is None:
            steps = self.steps[rank] = array("q")
            self.keys[rank] = array("q")
            self.waits[rank] = array("d")
        wait = obj.get("wait_ms")
        if wait is None:
            self.unmeasured.add(rank)
            return
        component = wait_component(obj["phase"])
        if component is None:
            return
        op = op_label(obj["op"], obj.get("group"))
        ids = self._ids.get((component, op))
        if ids is None:
            ids = self._ids[(component, op)] = (
                self._id(WAIT_PREFIX + component),
                self._id(f"{OP_WAIT_PREFIX}{component}:{op}"),
            )
        step = obj["step"]
        steps.extend((step, step))
        self.keys[rank].extend(ids)
        self.waits[rank].extend((float(wait), float(wait)))

    def _id(self, key: str) -> int:
        found = self.names.get(key)
        if found is None:
            found = self.names[key] = len(self.names)
        return found


def _merge_waits(columns: StepColumns, waits: _Waits, notes: list[str]) -> bool:
    """Add the collectives file's waits to the step columns; whether every rank's were
    measured (the straggler analysis then uses them)."""
    names = {i: key for key, i in waits.names.items()}
    for rank, steps in waits.steps.items():
        mine = columns.get(rank)
        if mine is None or not steps:
            continue
        at = np.frombuffer(steps, dtype=np.int64)
        keys = np.frombuffer(waits.keys[rank], dtype=np.int64)
        values = np.frombuffer(waits.waits[rank], dtype=np.float64)
        pos = np.searchsorted(mine.steps, at)
        found = pos < len(mine.steps)
        found[found] = mine.steps[pos[found]] == at[found]
        for i in np.unique(keys[found]):
            pick = found & (keys == i)
            total = np.zeros(len(mine.steps), dtype=np.float64)
            np.add.at(total, pos[pick], values[pick])
            had = np.zeros(len(mine.steps), dtype=np.bool_)
            had[pos[pick]] = True
            key = names[int(i)]
            mine.values[key] = total
            mine.present[key] = had
    unseen = sorted(r for r in columns if r not in waits.steps)
    if len(columns) > 1 and unseen:
        shown = ", ".join(map(str, unseen[:10])) + (", ..." if len(unseen) > 10 else "")
        notes.append(
            f"collectives: none seen on rank(s) {shown} (an engine that bypasses "
            "torch.distributed's Python functions, or a built-in DDP hook registered "
            "before the first forward); the wait is inferred from phase times"
        )
    if waits.unmeasured:
        shown = ", ".join(map(str, sorted(waits.unmeasured)[:10]))
        notes.append(
            f"collectives: wait not measured on rank(s) {shown} (NCCL without "
            "TORCH_NCCL_ENABLE_TIMING=1); the wait is inferred from phase times"
        )
    return waits_measured(columns, waits.steps, waits.unmeasured)


class _MemoryPeaks:
    """rank -> device -> peaks of the step_memory lines, as they are read."""

    def __init__(self) -> None:
        self.peaks: dict[int, dict[str, dict[str, int | None]]] = {}
        self.any_figure = False

    def add(self, obj: Mapping[str, Any]) -> None:
        rank, device = obj.get("global_rank"), obj.get("device")
        if not isinstance(rank, int) or not isinstance(device, str):
            return
        slot = self.peaks.setdefault(rank, {}).setdefault(
            device, {"peak_allocated_bytes": None, "peak_reserved_bytes": None}
        )
        for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
            v = obj.get(key)
            if isinstance(v, int):
                self.any_figure = True
                old = slot[key]
                slot[key] = v if old is None else max(old, v)

    def section(self) -> dict[str, dict[str, DevicePeak]]:
        return {
            str(r): {device: DevicePeak(**figures) for device, figures in self.peaks[r].items()}
            for r in sorted(self.peaks)
        }


def _process_section(objs: Iterable[dict[str, Any]]) -> dict[str, ProcessFigures]:
    """Per rank: CPU, RSS and GPU memory figures. A ``cpu_percent`` above 100 % per
    logical core of the host cannot be (older samplers wrote such values): it is left
    out of the figures and counted in ``cpu_percent_impossible_samples``."""
    lines = list(objs)
    # The host's cores: the line's own figure, else what another line of the node said.
    node_cores: dict[Any, int] = {}
    for obj in lines:
        cores = obj.get("cpu_logical_cores")
        if isinstance(cores, int):
            node = obj.get("node_rank")
            node_cores[node] = max(node_cores.get(node, 0), cores)
    acc: dict[int, dict[str, Any]] = {}
    for obj in lines:
        rank = obj.get("global_rank")
        if not isinstance(rank, int):
            continue
        a = acc.setdefault(
            rank,
            {"cpu": [], "ram": [], "gpu_used": [], "gpu_reserved": [], "bad": 0, "cores": None},
        )
        cores = obj.get("cpu_logical_cores")
        if not isinstance(cores, int):
            cores = node_cores.get(obj.get("node_rank"))
        if cores is not None:
            a["cores"] = max(a["cores"] or 0, cores)
        cpu = obj.get("cpu_percent")
        if isinstance(cpu, (int, float)):
            if cpu > 100.0 * (cores or MAX_PLAUSIBLE_CORES):
                a["bad"] += 1
            else:
                a["cpu"].append(float(cpu))
        for key, field in (
            ("ram", "ram_used_bytes"),
            ("gpu_used", "gpu_memory_used_bytes"),
            ("gpu_reserved", "gpu_memory_reserved_bytes"),
        ):
            v = obj.get(field)
            if isinstance(v, (int, float)):
                a[key].append(float(v))
    out: dict[str, ProcessFigures] = {}
    for rank in sorted(acc):
        a = acc[rank]
        out[str(rank)] = ProcessFigures(
            samples=len(a["ram"]),
            cpu_percent_mean=rounded(mean(a["cpu"]), 1) if a["cpu"] else None,
            cpu_percent_max=rounded(max(a["cpu"]), 1) if a["cpu"] else None,
            cpu_percent_impossible_samples=a["bad"],
            cpu_logical_cores=a["cores"],
            ram_used_bytes_max=int(max(a["ram"], default=0)),
            gpu_memory_used_bytes_max=int(max(a["gpu_used"])) if a["gpu_used"] else None,
            gpu_memory_reserved_bytes_max=(
                int(max(a["gpu_reserved"])) if a["gpu_reserved"] else None
            ),
        )
    return out


def _system_section(
    sys_objs: Iterable[dict[str, Any]], gpu_objs: Iterable[dict[str, Any]] | None
) -> dict[str, NodeFigures]:
    nodes: dict[int, dict[str, Any]] = {}
    for obj in sys_objs:
        node = obj.get("node_rank")
        if not isinstance(node, int):
            continue
        n = nodes.setdefault(node, {"cpu": [], "ram": [], "ram_total": 0, "gpu_count": 0})
        cpu, ram = obj.get("cpu_percent"), obj.get("ram_used_bytes")
        if isinstance(cpu, (int, float)):
            n["cpu"].append(float(cpu))
        if isinstance(ram, int):
            n["ram"].append(ram)
        total, count = obj.get("ram_total_bytes"), obj.get("gpu_count")
        if isinstance(total, int):
            n["ram_total"] = max(n["ram_total"], total)
        if isinstance(count, int):
            n["gpu_count"] = max(n["gpu_count"], count)
    gpus: dict[int, dict[int, dict[str, list[float]]]] = {}
    for obj in gpu_objs or ():
        node, index = obj.get("node_rank"), obj.get("gpu_index")
        if not isinstance(node, int) or not isinstance(index, int):
            continue
        g = gpus.setdefault(node, {}).setdefault(
            index, {"util": [], "mem": [], "mem_total": [], "temp": [], "power": []}
        )
        for key, field in (
            ("util", "utilization_percent"),
            ("mem", "memory_used_bytes"),
            ("mem_total", "memory_total_bytes"),
            ("temp", "temperature_c"),
            ("power", "power_usage_w"),
        ):
            v = obj.get(field)
            if isinstance(v, (int, float)):
                g[key].append(float(v))
    out: dict[str, NodeFigures] = {}
    for node in sorted(set(nodes) | set(gpus)):
        n = nodes.get(node, {"cpu": [], "ram": [], "ram_total": 0, "gpu_count": 0})
        out[str(node)] = NodeFigures(
            samples=len(n["cpu"]),
            cpu_percent_mean=rounded(mean(n["cpu"]), 1),
            cpu_percent_max=rounded(max(n["cpu"], default=0.0), 1),
            ram_used_bytes_max=int(max(n["ram"], default=0)),
            ram_total_bytes=int(n["ram_total"]),
            gpu_count=int(n["gpu_count"]),
            gpus={
                str(index): GpuFigures(
                    utilization_percent_mean=rounded(mean(g["util"]), 1) if g["util"] else None,
                    memory_used_bytes_max=int(max(g["mem"])) if g["mem"] else None,
                    memory_total_bytes=int(max(g["mem_total"])) if g["mem_total"] else None,
                    temperature_c_max=rounded(max(g["temp"]), 1) if g["temp"] else None,
                    power_usage_w_max=rounded(max(g["power"]), 1) if g["power"] else None,
                )
                for index, g in sorted(gpus.get(node, {}).items())
            },
        )
    return out


# --------------------------------------------------------------------------- summary


def step_series(summary: RunSummary) -> dict[int, list[tuple[int, float]]]:
    """rank -> [(step, step time in ms)] in step order, for plots; {} without steps."""
    rows = summary.rows
    return {
        r: list(zip(c.steps.tolist(), c.values[STEP_KEY].tolist(), strict=True))
        for r, c in sorted(rows.items())
    }


def _read_warning(path: Path) -> tuple[Any, str | None]:
    """finalization_warning.json's object, or why it cannot be read."""
    data, problem = read_bytes(path)
    if data is None:
        return None, problem
    try:
        warning = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc}); what was lost is unknown"
    if not isinstance(warning, dict):
        kind = "an array" if isinstance(warning, list) else type(warning).__name__
        return None, f"not a JSON object ({kind}); what was lost is unknown"
    if not isinstance(warning.get("reason"), str) or not isinstance(warning.get("message"), str):
        return warning, "no reason or message: not a finalization warning"
    return warning, None


_KEPT_LINES = ("runtime_environment", "process", "system", "system_gpu")
"""The streams whose lines are kept whole (a few per rank a minute); the others are
kept as figures (step_time, collectives, step_memory) or only counted."""


def _sink_for(name: str) -> tuple[Callable[[Iterator[dict[str, Any]], FileRead], object], Any]:
    """(the sink that reads ``name``'s new lines, what it keeps)."""
    if name == "step_time":
        steps = StepLines()
        return steps, steps
    if name == "collectives":
        waits = _Waits()
        return DataLines(name, waits.add), waits
    if name == "step_memory":
        peaks = _MemoryPeaks()
        return DataLines(name, peaks.add), peaks
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
    text) when ``path`` is missing or holds no export files.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.export_dir, self.run_dir = export_folder_of(path)
        self._tails: dict[str, Tail] = {}
        self._kept: dict[str, Any] = {}
        self._gone: set[str] = set()
        self._problems: list[str] = []
        """Files that changed under the reader (replaced, truncated, gone), said once."""
        self._last: RunSummary | None = None
        self._warning: tuple[int, int, int] | None = None

    def _make(self, name: str) -> Callable[[], Callable[..., object]]:
        def make() -> Callable[..., object]:
            sink, kept = _sink_for(name)
            self._kept[name] = kept
            return sink

        return make

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
        figures = step_figures(rows)
        measured = "collectives" in reads and _merge_waits(rows, kept["collectives"], notes)
        straggler = _straggler_view(rows, strategy, measured, layout)
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
        peaks: _MemoryPeaks = kept["step_memory"]
        memory = peaks.section()
        if memory and not peaks.any_figure:
            notes.append("peak memory: no allocator figures (a CPU run: peaks are null on cpu)")
    else:
        notes.append("peak memory: step_memory was not exported")

    process: dict[str, ProcessFigures] | None = None
    if "process" in reads:
        process = _process_section(objs["process"])
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
        system = _system_section(objs["system"], objs.get("system_gpu"))
        if system and all(n.gpu_count == 0 for n in system.values()):
            notes.append("GPU figures: no GPU on the host(s)")
    else:
        notes.append("system figures: system was not exported")

    problems = [line for info in reads.values() for line in info.problems()]
    problems.extend(gone_problems)
    loss = _loss_report(reads, run_dir, notes, problems)
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


def _file_state(info: FileRead) -> FileState:
    closing = info.closing
    written = closing.get("written_records") if closing is not None else None
    dropped = closing.get("dropped_batches") if closing is not None else None
    return FileState(
        data_lines=info.data_lines,
        closed=closing is not None,
        partial_last_line=info.partial_last_line,
        bytes=info.size,
        written_records=written if type(written) is int else None,
        dropped_batches=dropped if type(dropped) is int else None,
        mismatch=closing is not None and written != info.data_lines,
        unreadable=info.problem,
        unreadable_lines=info.unreadable_lines,
        impossible_lines=info.impossible_lines,
        duplicate_keys=info.duplicate_keys,
        lines_after_closing=info.lines_after_closing,
        closing_lines=info.closing_lines,
    )


def _loss_report(
    reads: dict[str, FileRead], run_dir: Path | None, notes: list[str], problems: list[str]
) -> LossReport:
    """What the files say about their completeness; adds the warning file's problem to
    ``problems``."""
    files = {name: _file_state(info) for name, info in reads.items()}
    unfinished = sorted(
        name for name, info in reads.items() if info.closing is None and info.problem is None
    )
    dropped = {f.dropped_batches for f in files.values() if f.dropped_batches is not None}
    warning: dict[str, Any] | None = None
    warning_path = run_dir / WARNING_FILE if run_dir is not None else None
    if warning_path is not None and exists(warning_path):
        found, problem = _read_warning(warning_path)
        warning = found
        if problem is not None:
            problems.append(f"{WARNING_FILE}: {problem}")
            warning = {"unreadable": problem, **(found or {})}
    readable_warning = warning is not None and "unreadable" not in warning
    if (
        warning is not None
        and readable_warning
        and warning.get("reason") == "monitoring_incomplete"
    ):
        # Only the live views (Prometheus, OTLP, the dashboard) lost something: the
        # files are judged on their own.
        notes.append(f"{WARNING_FILE}: {warning.get('message')}")
        readable_warning = False
    status: LossStatus
    if readable_warning:
        status = "lost"
    elif problems:
        status = "damaged"
    elif unfinished:
        status = "in_progress"
    elif dropped and max(dropped) > 0:
        status = "lost"
    else:
        status = "complete"
    if unfinished:
        notes.append(
            f"no closing line yet in {', '.join(unfinished)}: "
            "the run is in progress or did not finish cleanly"
        )
    warning_file = str(warning_path) if warning is not None else None
    dropped_batches = max(dropped) if dropped else None
    return LossReport(
        status=status,
        dropped_batches=dropped_batches,
        files=files,
        unfinished_files=unfinished,
        warning=warning,
        warning_file=warning_file,
        line=_loss_line(status, unfinished, len(problems), warning, warning_file, dropped_batches),
        short_line=_loss_line(
            status, unfinished, len(problems), warning, warning_file, dropped_batches, full=False
        ),
    )


def with_problems(summary: RunSummary, extra: Sequence[str]) -> RunSummary:
    """``summary`` with more problems (a file that changed under a reader, say): the
    files are then never complete, and the loss report says so."""
    new = [p for p in extra if p not in summary.problems]
    if not new:
        return summary
    problems = [*summary.problems, *new]
    loss = summary.loss
    status: LossStatus = "damaged" if loss.status in ("complete", "in_progress") else loss.status

    def line(full: bool) -> str:
        return _loss_line(
            status,
            loss.unfinished_files,
            len(problems),
            loss.warning,
            loss.warning_file,
            loss.dropped_batches,
            full,
        )

    loss = attrs.evolve(loss, status=status, line=line(True), short_line=line(False))
    return attrs.evolve(summary, problems=problems, loss=loss)


def _loss_line(
    status: LossStatus,
    unfinished: Sequence[str],
    problems: int,
    warning: Mapping[str, Any] | None,
    warning_file: str | None,
    dropped_batches: int | None,
    full: bool = True,
) -> str:
    """The files' verdict as one sentence."""
    if status == "complete":
        return "files: complete (every file closed, nothing lost)"
    if status == "in_progress":
        return f"files: in progress or unfinished (no closing line in {', '.join(unfinished)})"
    if status == "damaged":
        return f"files: damaged, not complete ({problems} problem(s), on the lines above)"
    if warning is not None and warning.get("message"):
        if not full:
            # traceml run has just printed the warning's path; the reason is enough here.
            return f"files: incomplete ({warning.get('reason')}; see {warning_file})"
        return (
            f"files: incomplete ({warning.get('reason')}): {warning['message']} "
            f"(see {warning_file})"
        )
    return f"files: incomplete ({dropped_batches} dropped batches)"
