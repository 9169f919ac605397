"""A run summary read from the export files: step time per rank, phases, memory,
process and system figures, the straggler view and what was lost.

It reads only the files, so it works for any number of nodes (the aggregator wrote
every rank's lines) and on a run still in progress: a partial last line is a line
still being written and is ignored; a file without its closing line is reported as
unfinished. Light to import: orjson only (never torch, never pyarrow), because
``traceml run`` calls it at the end of every run with export on.

The straggler analysis is :mod:`traceml_ai._straggler` (the rule is in its docstring
and in docs/reading-the-files.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from traceml_ai._step_phases import (
    STEP_EVENT,
    percentile,
    phase_breakdown,
    phase_name,
    phase_names,
    step_row,
)
from traceml_ai._straggler import analyze as analyze_stragglers
from traceml_ai._straggler import verdict_line
from traceml_records import STREAMS

_ARROW_MIN_BYTES = 8 << 20
"""step_time/step_memory files from this size are read with pyarrow when installed."""

STREAM_FILES = tuple(spec.name for spec in STREAMS)
"""The export's file streams, in the registry's order."""
WARNING_FILE = "finalization_warning.json"


class SummaryError(Exception):
    """The path cannot be summarized (missing, or no export files); one line of text."""


# --------------------------------------------------------------------------- reading


def _folders(path: str | os.PathLike[str]) -> tuple[Path, Path | None]:
    """(export folder, run folder or None) for a run, aggregator or export folder."""
    p = Path(path)
    if not p.exists():
        raise SummaryError(f"{p}: no such file or folder")
    if p.is_file():
        raise SummaryError(f"{p}: give a run folder or an export folder, not a file")
    if (p / "aggregator" / "export").is_dir():
        return p / "aggregator" / "export", p
    if (p / "export").is_dir() and p.name == "aggregator":
        return p / "export", p.parent
    if any(p.glob("*.jsonl")):
        run = p.parent.parent if p.parent.name == "aggregator" else None
        return p, run
    raise SummaryError(f"{p}: no export files here (expected a run folder or an export folder)")


class _FileRead:
    """What reading one export file found besides its data lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data_lines = 0
        self.closing: dict[str, Any] | None = None
        self.partial_last_line = False
        self.bad_lines = 0
        self.lines_after_closing = 0


def _iter_objects(path: Path, info: _FileRead) -> Iterator[dict[str, Any]]:
    """The data lines of one file as dicts; the closing line goes to ``info``."""
    with open(path, "rb") as fh:
        blob = fh.read()
    lines = blob.split(b"\n")
    if lines and lines[-1]:
        # No final newline: the exporter is still writing this line.
        info.partial_last_line = True
    for raw in lines[:-1]:
        if not raw:
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            info.bad_lines += 1
            continue
        if not isinstance(obj, dict):
            info.bad_lines += 1
            continue
        if obj.get("closing") is True:
            info.closing = obj
            continue
        if info.closing is not None:
            info.lines_after_closing += 1
        info.data_lines += 1
        yield obj


# --------------------------------------------------------------------------- statistics


def _median(values: Iterable[float]) -> float:
    ordered = sorted(values)
    return percentile(ordered, 50.0) if ordered else 0.0


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _r(x: float, digits: int = 3) -> float:
    return round(float(x), digits)


# --------------------------------------------------------------------------- streams


def _step_rows(objs: Iterable[dict[str, Any]]) -> dict[int, dict[int, dict[str, float]]]:
    """rank -> step -> {"step": ms, phase name: ms, ...}; a repeated key keeps the last."""
    out: dict[int, dict[int, dict[str, float]]] = {}
    for obj in objs:
        rank, step, events = obj.get("global_rank"), obj.get("step"), obj.get("events")
        if not isinstance(rank, int) or not isinstance(step, int) or not isinstance(events, dict):
            continue
        row = step_row(events)
        if row is None:
            continue
        row["_ts"] = float(obj.get("timestamp_unix_ns") or 0)
        node = obj.get("node_rank")
        if isinstance(node, int):
            row["_node"] = float(node)
        out.setdefault(rank, {})[step] = row
    return out


def _arrow_frames() -> Any:
    """traceml_records.frames when pyarrow is installed, else None."""
    try:
        from traceml_records import frames
    except ImportError:
        return None
    return frames


def _step_rows_arrow(loaded: Any) -> tuple[dict[int, dict[int, dict[str, float]]], set[int]]:
    """The rows of :func:`_step_rows` from Arrow tables (a big file: vectorized)."""
    st = loaded.tables["step_time"]
    ph = loaded.tables["step_time_phases"]
    # One figure per (rank, step, event): the longest device, as in _phase_ms.
    agg = ph.group_by(["global_rank", "step", "event"]).aggregate([("duration_ms", "max")])
    acc: dict[tuple[int, int], dict[str, float]] = {}
    names: dict[str, str | None] = {}
    for rank, step, event, ms in zip(
        agg.column("global_rank").to_pylist(),
        agg.column("step").to_pylist(),
        agg.column("event").to_pylist(),
        agg.column("duration_ms_max").to_pylist(),
        strict=True,
    ):
        if ms is None:
            continue
        if event not in names:
            names[event] = "step" if event == STEP_EVENT else phase_name(event)
        key = names[event]
        if key is not None:
            acc.setdefault((rank, step), {})[key] = float(ms)
    stamps = dict(
        zip(
            zip(st.column("global_rank").to_pylist(), st.column("step").to_pylist(), strict=True),
            st.column("timestamp_unix_ns").to_pylist(),
            strict=True,
        )
    )
    out: dict[int, dict[int, dict[str, float]]] = {}
    for (rank, step), row in acc.items():
        if "step" in row:
            row["_ts"] = float(stamps.get((rank, step)) or 0)
            out.setdefault(rank, {})[step] = row
    world = {w for w in st.column("world_size").unique().to_pylist() if isinstance(w, int)}
    return out, world


def _memory_arrow(loaded: Any) -> tuple[dict[str, Any], bool]:
    """:func:`_memory_section` from an Arrow table."""
    agg = (
        loaded.tables["step_memory"]
        .group_by(["global_rank", "device"])
        .aggregate([("peak_allocated_bytes", "max"), ("peak_reserved_bytes", "max")])
    )
    peaks: dict[int, dict[str, dict[str, int | None]]] = {}
    any_figure = False
    for row in agg.to_pylist():
        alloc, reserved = row["peak_allocated_bytes_max"], row["peak_reserved_bytes_max"]
        any_figure = any_figure or alloc is not None or reserved is not None
        peaks.setdefault(row["global_rank"], {})[row["device"]] = {
            "peak_allocated_bytes": alloc,
            "peak_reserved_bytes": reserved,
        }
    return {str(r): dict(sorted(peaks[r].items())) for r in sorted(peaks)}, any_figure


def _step_section(
    rows: dict[int, dict[int, dict[str, float]]],
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(per-rank step figures, per-rank phase breakdown, phase names in order)."""
    names = phase_names(row for steps in rows.values() for row in steps.values())
    per_rank: dict[str, Any] = {}
    phases: dict[str, Any] = {}
    for rank in sorted(rows):
        steps = rows[rank]
        ordered = [steps[s] for s in sorted(steps)]
        times = sorted(r["step"] for r in ordered)
        stamps = sorted(r["_ts"] for r in ordered if r["_ts"] > 0)
        span_s = (stamps[-1] - stamps[0]) / 1e9 if len(stamps) >= 2 else 0.0
        # Steps per second over the wall time between the first and last step ends
        # (includes time between steps); from the mean step time when that is unknown.
        if span_s > 0:
            rate = (len(stamps) - 1) / span_s
        else:
            mean = _mean(times)
            rate = 1000.0 / mean if mean > 0 else 0.0
        per_rank[str(rank)] = {
            "steps": len(times),
            "first_step": min(steps),
            "last_step": max(steps),
            "p50_ms": _r(percentile(times, 50)),
            "p90_ms": _r(percentile(times, 90)),
            "p99_ms": _r(percentile(times, 99)),
            "max_ms": _r(times[-1]),
            "mean_ms": _r(_mean(times)),
            "steps_per_s": _r(rate),
        }
        phases[str(rank)] = phase_breakdown(ordered, names)
    return per_rank, phases, names


def _straggler_view(
    rows: dict[int, dict[int, dict[str, float]]], phase_names: Sequence[str], strategy: str | None
) -> dict[str, Any]:
    """The straggler analysis (:mod:`traceml_ai._straggler`) of the step rows."""
    nodes = {
        rank: int(row["_node"])
        for rank, steps in rows.items()
        for row in steps.values()
        if "_node" in row
    }
    return analyze_stragglers(rows, strategy, nodes)


def _memory_section(objs: Iterable[dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """rank -> device -> peaks; and whether any device had allocator figures."""
    peaks: dict[int, dict[str, dict[str, int | None]]] = {}
    any_figure = False
    for obj in objs:
        rank, device = obj.get("global_rank"), obj.get("device")
        if not isinstance(rank, int) or not isinstance(device, str):
            continue
        slot = peaks.setdefault(rank, {}).setdefault(
            device, {"peak_allocated_bytes": None, "peak_reserved_bytes": None}
        )
        for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
            v = obj.get(key)
            if isinstance(v, int):
                any_figure = True
                old = slot[key]
                slot[key] = v if old is None else max(old, v)
    return {str(r): peaks[r] for r in sorted(peaks)}, any_figure


def _process_section(objs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    acc: dict[int, dict[str, list[float]]] = {}
    for obj in objs:
        rank = obj.get("global_rank")
        if not isinstance(rank, int):
            continue
        a = acc.setdefault(rank, {"cpu": [], "ram": [], "gpu_used": [], "gpu_reserved": []})
        for key, field in (
            ("cpu", "cpu_percent"),
            ("ram", "ram_used_bytes"),
            ("gpu_used", "gpu_memory_used_bytes"),
            ("gpu_reserved", "gpu_memory_reserved_bytes"),
        ):
            v = obj.get(field)
            if isinstance(v, (int, float)):
                a[key].append(float(v))
    out: dict[str, Any] = {}
    for rank in sorted(acc):
        a = acc[rank]
        out[str(rank)] = {
            "samples": len(a["ram"]),
            "cpu_percent_mean": _r(_mean(a["cpu"]), 1),
            "cpu_percent_max": _r(max(a["cpu"], default=0.0), 1),
            "ram_used_bytes_max": int(max(a["ram"], default=0)),
            "gpu_memory_used_bytes_max": int(max(a["gpu_used"])) if a["gpu_used"] else None,
            "gpu_memory_reserved_bytes_max": int(max(a["gpu_reserved"]))
            if a["gpu_reserved"]
            else None,
        }
    return out


def _system_section(
    sys_objs: Iterable[dict[str, Any]], gpu_objs: Iterable[dict[str, Any]] | None
) -> dict[str, Any]:
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
    out: dict[str, Any] = {}
    for node in sorted(set(nodes) | set(gpus)):
        n = nodes.get(node, {"cpu": [], "ram": [], "ram_total": 0, "gpu_count": 0})
        entry: dict[str, Any] = {
            "samples": len(n["cpu"]),
            "cpu_percent_mean": _r(_mean(n["cpu"]), 1),
            "cpu_percent_max": _r(max(n["cpu"], default=0.0), 1),
            "ram_used_bytes_max": int(max(n["ram"], default=0)),
            "ram_total_bytes": int(n["ram_total"]),
            "gpu_count": int(n["gpu_count"]),
            "gpus": {},
        }
        for index, g in sorted(gpus.get(node, {}).items()):
            entry["gpus"][str(index)] = {
                "utilization_percent_mean": _r(_mean(g["util"]), 1) if g["util"] else None,
                "memory_used_bytes_max": int(max(g["mem"])) if g["mem"] else None,
                "memory_total_bytes": int(max(g["mem_total"])) if g["mem_total"] else None,
                "temperature_c_max": _r(max(g["temp"]), 1) if g["temp"] else None,
                "power_usage_w_max": _r(max(g["power"]), 1) if g["power"] else None,
            }
        out[str(node)] = entry
    return out


# --------------------------------------------------------------------------- summary


def step_series(path: str | os.PathLike[str]) -> dict[int, list[tuple[int, float]]]:
    """rank -> [(step, step time in ms)] in step order, for plots; {} without step_time."""
    export_dir, _ = _folders(path)
    p = export_dir / "step_time.jsonl"
    if not p.is_file():
        return {}
    rows = _step_rows(_iter_objects(p, _FileRead(p)))
    return {r: [(s, rows[r][s]["step"]) for s in sorted(rows[r])] for r in sorted(rows)}


def _load_fast(name: str, path: Path) -> Any:
    """A big step_time/step_memory file through pyarrow (when installed), else None.

    Parsing a million lines one by one takes tens of seconds; pyarrow's reader takes a
    few. Small files stay on the plain reader (importing pyarrow costs more than them).
    """
    if name not in ("step_time", "step_memory"):
        return None
    try:
        if path.stat().st_size < _ARROW_MIN_BYTES:
            return None
    except OSError:
        return None
    frames = _arrow_frames()
    if frames is None:
        return None
    try:
        return frames.load(path, name)
    except (frames.FramesError, OSError):
        return None  # the plain reader counts what it cannot read


def summarize_run(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Summarize a run folder (or its export folder) as a JSON-able dict.

    Raises :class:`SummaryError` (one line of text) when ``path`` is missing or holds
    no export files. Everything else that is missing is said in ``notes``.
    """
    export_dir, run_dir = _folders(path)
    files = {name: export_dir / f"{name}.jsonl" for name in STREAM_FILES}
    present = {name: p for name, p in files.items() if p.is_file()}
    reads: dict[str, _FileRead] = {}
    objs: dict[str, list[dict[str, Any]]] = {}
    fast: dict[str, Any] = {}
    for name, p in present.items():
        info = _FileRead(p)
        reads[name] = info
        loaded = _load_fast(name, p)
        if loaded is not None:
            info.data_lines = loaded.tables[name].num_rows
            info.closing = loaded.closing
            info.partial_last_line = loaded.partial_last_line
            fast[name] = loaded
            continue
        try:
            objs[name] = list(_iter_objects(p, info))
        except OSError as exc:
            raise SummaryError(f"{p}: cannot read ({exc.strerror or exc})") from None

    notes: list[str] = []
    summary: dict[str, Any] = {
        "export_folder": str(export_dir),
        "run_folder": str(run_dir) if run_dir is not None else None,
        "streams": sorted(present, key=STREAM_FILES.index),
    }

    strategy: str | None = None
    env_rows = objs.get("runtime_environment", [])
    if env_rows:
        last: dict[int, dict[str, Any]] = {}
        for obj in env_rows:
            if isinstance(obj.get("global_rank"), int):
                last[obj["global_rank"]] = obj
        strategies = sorted({str(o.get("training_strategy")) for o in last.values()})
        strategy = strategies[0] if len(strategies) == 1 else None
        first = next(iter(last.values()), {})
        summary["environment"] = {
            "training_strategy": strategies[0] if len(strategies) == 1 else strategies,
            "distributed_backend": first.get("distributed_backend"),
            "topology": first.get("topology"),
            "world_size": first.get("world_size"),
            "torch_version": first.get("torch_version"),
        }
    else:
        summary["environment"] = None

    world: set[int] = set()
    if "step_time" in fast:
        rows, world = _step_rows_arrow(fast["step_time"])
    else:
        rows = _step_rows(objs.get("step_time", []))
        world = {
            o["world_size"]
            for o in objs.get("step_time", [])
            if isinstance(o.get("world_size"), int)
        }
    if "step_time" not in present:
        notes.append("step times: step_time was not exported")
        summary.update(ranks=[], step_time=None, phases=None, straggler=None)
    elif not rows:
        notes.append("step times: no step recorded yet")
        summary.update(ranks=[], step_time=None, phases=None, straggler=None)
    else:
        if strategy is None and world and max(world) > 1:
            notes.append(
                "training strategy unknown (runtime_environment not exported); "
                "the wait analysis does not assume DDP"
            )
        per_rank, phases, names = _step_section(rows)
        summary["ranks"] = sorted(rows)
        summary["step_time"] = per_rank
        summary["phases"] = phases
        summary["phase_names"] = names
        summary["straggler"] = _straggler_view(rows, names, strategy)
        if world:
            summary["world_size"] = max(world)
            # Count rather than list every rank: a world may be very large.
            missing = max(world) - len([r for r in rows if r < max(world)])
            if missing:
                absent = [r for r in range(min(max(world), 1 << 16)) if r not in rows][:10]
                more = ", ..." if missing > len(absent) else ""
                notes.append(
                    f"step times: no line yet from {missing} rank(s) "
                    f"({', '.join(map(str, absent))}{more})"
                )

    if "step_memory" in present:
        mem, any_figure = (
            _memory_arrow(fast["step_memory"])
            if "step_memory" in fast
            else _memory_section(objs["step_memory"])
        )
        summary["memory"] = mem
        if mem and not any_figure:
            notes.append("peak memory: no allocator figures (a CPU run: peaks are null on cpu)")
    else:
        summary["memory"] = None
        notes.append("peak memory: step_memory was not exported")

    if "process" in present:
        summary["process"] = _process_section(objs["process"])
        if summary["process"] and all(
            p["gpu_memory_used_bytes_max"] is None for p in summary["process"].values()
        ):
            notes.append("process GPU memory: none (no GPU used by the ranks)")
    else:
        summary["process"] = None
        notes.append("process figures: process was not exported")
    if "system" in present:
        summary["system"] = _system_section(objs["system"], objs.get("system_gpu"))
        if summary["system"] and all(n["gpu_count"] == 0 for n in summary["system"].values()):
            notes.append("GPU figures: no GPU on the host(s)")
    else:
        summary["system"] = None
        notes.append("system figures: system was not exported")

    summary["loss"] = _loss_report(reads, run_dir, notes)
    summary["notes"] = notes
    return summary


def _loss_report(
    reads: dict[str, _FileRead], run_dir: Path | None, notes: list[str]
) -> dict[str, Any]:
    files: dict[str, Any] = {}
    unfinished: list[str] = []
    dropped: set[int] = set()
    for name, info in reads.items():
        closing = info.closing
        entry: dict[str, Any] = {
            "data_lines": info.data_lines,
            "closed": closing is not None,
            "partial_last_line": info.partial_last_line,
        }
        if info.bad_lines:
            entry["unreadable_lines"] = info.bad_lines
        if info.lines_after_closing:
            entry["lines_after_closing"] = info.lines_after_closing
        if closing is not None:
            written = closing.get("written_records")
            entry["written_records"] = written
            entry["dropped_batches"] = closing.get("dropped_batches")
            if isinstance(closing.get("dropped_batches"), int):
                dropped.add(closing["dropped_batches"])
            if isinstance(written, int) and written != info.data_lines:
                entry["mismatch"] = True
        else:
            unfinished.append(name)
        files[name] = entry
    warning: Any = None
    if run_dir is not None and (run_dir / WARNING_FILE).is_file():
        try:
            warning = orjson.loads((run_dir / WARNING_FILE).read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            warning = {"unreadable": str(exc)}
    if warning is not None:
        status = "lost"
    elif unfinished:
        status = "in_progress"
    elif any(f.get("mismatch") or f.get("unreadable_lines") for f in files.values()):
        status = "inconsistent"
    elif dropped and max(dropped) > 0:
        status = "lost"
    else:
        status = "complete"
    if unfinished:
        notes.append(
            f"no closing line yet in {', '.join(sorted(unfinished))}: "
            "the run is in progress or did not finish cleanly"
        )
    return {
        "status": status,
        "dropped_batches": max(dropped) if dropped else None,
        "files": files,
        "unfinished_files": sorted(unfinished),
        "warning": warning,
        "warning_file": str(run_dir / WARNING_FILE) if warning is not None and run_dir else None,
    }


# --------------------------------------------------------------------------- text


def _bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def straggler_line(summary: dict[str, Any]) -> str:
    """The straggler verdict as one sentence (shared by the text and the live view)."""
    return verdict_line(summary.get("straggler"))


def _loss_line(summary: dict[str, Any], full: bool = True) -> str:
    loss = summary["loss"]
    status = loss["status"]
    if status == "complete":
        return "files: complete (every file closed, nothing lost)"
    if status == "in_progress":
        return f"files: in progress or unfinished (no closing line in {', '.join(loss['unfinished_files'])})"
    if status == "inconsistent":
        return "files: closing lines disagree with the data lines; run traceml validate"
    warning = loss.get("warning")
    if isinstance(warning, dict) and warning.get("message"):
        if not full:
            # traceml run has just printed the warning's path; the reason is enough here.
            return f"files: incomplete ({warning.get('reason')}; see {loss['warning_file']})"
        return (
            f"files: incomplete ({warning.get('reason')}): {warning['message']} "
            f"(see {loss['warning_file']})"
        )
    return f"files: incomplete ({loss.get('dropped_batches')} dropped batches)"


def format_summary(summary: dict[str, Any], full: bool = True) -> str:
    """The summary as plain text: a few lines (``full=False``) or every section."""
    out: list[str] = []
    ranks = summary.get("ranks") or []
    steps = summary.get("step_time")
    env = summary.get("environment") or {}
    head = f"traceml: summary of {summary.get('run_folder') or summary['export_folder']}"
    if env.get("training_strategy"):
        # Ranks with a step line; none yet (a run that stopped before its first step)
        # is said by the notes, not as "0 ranks" of a run whose ranks did connect.
        counted = f", {len(ranks)} rank(s)" if ranks else ""
        head += f" ({env['training_strategy']}{counted})"
    out.append(head)
    if steps:
        if full:
            out.append("step time per rank (ms):")
            out.append("  rank  steps      p50      p90      p99      max   steps/s")
            for r in ranks:
                s = steps[str(r)]
                out.append(
                    f"  {r:>4} {s['steps']:>6} {s['p50_ms']:>8.2f} {s['p90_ms']:>8.2f} "
                    f"{s['p99_ms']:>8.2f} {s['max_ms']:>8.2f} {s['steps_per_s']:>9.2f}"
                )
            names = summary["phase_names"]
            out.append("phases per rank (mean ms, share of the iteration):")
            for r in ranks:
                ph = summary["phases"][str(r)]
                cells = ", ".join(
                    f"{n} {ph[n]['mean_ms']:.2f} ({ph[n]['share'] * 100:.0f}%)" for n in names
                )
                out.append(f"  rank {r}: {cells}")
        else:
            p50 = [steps[str(r)]["p50_ms"] for r in ranks]
            out.append(
                f"step time: p50 {min(p50):.2f} to {max(p50):.2f} ms over {len(ranks)} rank(s), "
                f"{sum(steps[str(r)]['steps'] for r in ranks)} steps"
            )
            # The largest phase on average, the quickest pointer to where time goes.
            totals: dict[str, float] = {}
            for r in ranks:
                for n, v in summary["phases"][str(r)].items():
                    totals[n] = totals.get(n, 0.0) + v["share"] / len(ranks)
            top = sorted(totals.items(), key=lambda kv: -kv[1])[:3]
            out.append("phases: " + ", ".join(f"{n} {v * 100:.0f}%" for n, v in top))
        out.append(straggler_line(summary))
    mem = summary.get("memory")
    if full and mem:
        rows = [
            f"rank {r} {d}: allocated {_bytes(v['peak_allocated_bytes'])}, "
            f"reserved {_bytes(v['peak_reserved_bytes'])}"
            for r, devs in mem.items()
            for d, v in devs.items()
            if v["peak_allocated_bytes"] is not None or v["peak_reserved_bytes"] is not None
        ]
        if rows:
            out.append("peak memory per device:")
            out.extend(f"  {row}" for row in rows)
    proc = summary.get("process")
    if full and proc:
        out.append("process per rank:")
        for r, p in proc.items():
            gpu = (
                f", GPU memory max {_bytes(p['gpu_memory_used_bytes_max'])}"
                if p["gpu_memory_used_bytes_max"] is not None
                else ""
            )
            out.append(
                f"  rank {r}: CPU {p['cpu_percent_mean']:.0f}% mean, {p['cpu_percent_max']:.0f}% max; "
                f"RSS max {_bytes(p['ram_used_bytes_max'])}{gpu}"
            )
    system = summary.get("system")
    if full and system:
        out.append("system per node:")
        for node, n in system.items():
            out.append(
                f"  node {node}: CPU {n['cpu_percent_mean']:.0f}% mean, {n['cpu_percent_max']:.0f}% max; "
                f"RAM max {_bytes(n['ram_used_bytes_max'])} of {_bytes(n['ram_total_bytes'])}; "
                f"{n['gpu_count']} GPU(s)"
            )
            for index, g in n["gpus"].items():
                util = g["utilization_percent_mean"]
                out.append(
                    f"    gpu {index}: util {'n/a' if util is None else f'{util:.0f}%'} mean, "
                    f"memory max {_bytes(g['memory_used_bytes_max'])}, "
                    f"temp max {g['temperature_c_max']} C, power max {g['power_usage_w_max']} W"
                )
    out.append(_loss_line(summary, full))
    if full:
        out.extend(f"note: {n}" for n in summary.get("notes", []))
    return "\n".join(line if line.startswith("traceml:") else f"traceml: {line}" for line in out)
