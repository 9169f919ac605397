"""The run summary as text: ``traceml summary``, its ``--short`` form (the end of
``traceml run``) and its ``--ranks`` table.

The default text has a fixed size whatever the rank count: figures across ranks as
their distribution (min, p50, p90, max), one line per pipeline stage where there are
stages, and the ranks the straggler analysis names; ``--ranks`` adds a row per rank.
At most :data:`MAX_LISTED` problems and notes are listed; the JSON form has them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from traceml_ai.analysis._model import ProcessFigures, RunSummary
from traceml_ai.analysis._phases import percentile
from traceml_ai.analysis._straggler import cost_line, verdict_line

MAX_LISTED = 6
"""Problems, notes and named ranks the default text lists (then how many more)."""
MAX_STAGE_LINES = 8
"""Pipeline stages with a line of their own; more are said as one distribution."""


def _bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    return f"{n} B"


def _steps_text(counts: Sequence[int]) -> str:
    """How many steps the ranks have, said truthfully: ``30 steps on each of 2 ranks``."""
    if len(counts) == 1:
        return f"{counts[0]} steps on 1 rank"
    low, high = min(counts), max(counts)
    if low == high:
        return f"{low} steps on each of {len(counts)} ranks"
    return f"{low} to {high} steps per rank on {len(counts)} ranks"


def _cpu_text(p: ProcessFigures) -> str:
    if p.cpu_percent_mean is None or p.cpu_percent_max is None:
        text = "CPU n/a"
    else:
        text = f"CPU {p.cpu_percent_mean:.0f}% mean, {p.cpu_percent_max:.0f}% max"
    bad = p.cpu_percent_impossible_samples
    if bad:
        text += f" ({bad} impossible sample(s) left out)"
    return text


def _spread(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    """``min/p50/p90/max`` of ``values`` across ranks (one value: that value)."""
    ordered = sorted(values)
    if ordered[0] == ordered[-1]:
        return fmt(ordered[0])
    return "/".join(fmt(percentile(ordered, q)) for q in (0.0, 50.0, 90.0, 100.0))


def _ms(x: float) -> str:
    return f"{x:.2f}"


def _listed(kind: str, items: Sequence[str], limit: int | None) -> list[str]:
    shown = list(items) if limit is None else list(items[:limit])
    out = [f"{kind}: {item}" for item in shown]
    if len(items) > len(shown):
        out.append(f"{kind}: ... {len(items) - len(shown)} more (--json or --ranks lists all)")
    return out


def _stage_lines(summary: RunSummary) -> list[str]:
    """One line per pipeline stage (median over its ranks), when the ranks said stages."""
    coords = summary.coordinates or {}
    steps = summary.step_time or {}
    own = summary.straggler.own_work_ms if summary.straggler else None
    by_stage: dict[int, list[str]] = {}
    for rank, c in coords.items():
        pp = c.get("pp")
        if pp is not None and rank in steps:
            by_stage.setdefault(pp.rank, []).append(rank)
    if len(by_stage) < 2:
        return []
    lines = []
    figures: list[tuple[int, float, float | None, int]] = []
    for stage, ranks in sorted(by_stage.items()):
        p50 = sorted(steps[r].p50_ms for r in ranks)
        mine = sorted(own[r] for r in ranks if own and r in own)
        figures.append(
            (
                stage,
                percentile(p50, 50.0),
                percentile(mine, 50.0) if mine else None,
                len(ranks),
            )
        )
    if len(figures) <= MAX_STAGE_LINES:
        for stage, step_p50, work, count in figures:
            work_text = f", own work {work:.2f} ms" if work is not None else ""
            lines.append(f"  stage {stage} ({count} ranks): step p50 {step_p50:.2f} ms{work_text}")
        return ["per pipeline stage (median over its ranks):", *lines]
    works = [w for _, _, w, _ in figures if w is not None]
    text = f"{len(figures)} pipeline stages: step p50 {_spread([f[1] for f in figures], _ms)} ms"
    if works:
        heaviest = max(figures, key=lambda f: f[2] or 0.0)
        text += f", own work {_spread(works, _ms)} ms across stages (heaviest: stage {heaviest[0]})"
    return [text]


def _named_lines(summary: RunSummary) -> list[str]:
    view = summary.straggler
    if view is None:
        return []
    steps = summary.step_time or {}
    lines = []
    for s in view.stragglers:
        where = ""
        if s.parallel:
            where = " [" + " ".join(f"{n}={c.rank}/{c.size}" for n, c in s.parallel.items()) + "]"
        figures = steps.get(str(s.rank))
        step = f": step p50 {figures.p50_ms:.2f} ms" if figures else ""
        lines.append(
            f"rank {s.rank}{where}{step}, own work {s.own_work_ms:.2f} ms against "
            f"{s.others_own_work_ms:.2f} ms for {'its peers' if s.parallel else 'the others'}"
        )
    return _listed("named", lines, MAX_LISTED)


def _layout_line(summary: RunSummary) -> str | None:
    env = summary.environment
    if env is None or not env.parallel:
        return None
    dims = " x ".join(f"{n}={s}" for n, s in env.parallel.items())
    return f"parallel layout: {dims}" + (f" ({env.parallel_source})" if env.parallel_source else "")


def _compact(summary: RunSummary, out: list[str]) -> None:
    """The default text's figures: distributions across ranks, stages, named ranks."""
    ranks = summary.ranks
    steps = summary.step_time
    phases = summary.phases or {}
    if steps:
        keys = [str(r) for r in ranks]
        out.append(
            "step time across ranks (ms, min/p50/p90/max of each rank's figure): "
            f"p50 {_spread([steps[k].p50_ms for k in keys], _ms)}; "
            f"p99 {_spread([steps[k].p99_ms for k in keys], _ms)}; "
            f"max {_spread([steps[k].max_ms for k in keys], _ms)}"
        )
        out.append(
            f"steps/s across ranks: {_spread([steps[k].steps_per_s for k in keys], _ms)}; "
            f"{_steps_text([steps[k].steps for k in keys])}"
        )
        if summary.phase_names:
            cells = []
            for name in summary.phase_names:
                means = [phases[k][name].mean_ms for k in keys if name in phases.get(k, {})]
                shares = [phases[k][name].share for k in keys if name in phases.get(k, {})]
                if means:
                    share = percentile(sorted(shares), 50.0)
                    cells.append(f"{name} {_spread(means, _ms)} ({share * 100:.0f}%)")
            out.append("phases (mean ms across ranks, p50 share): " + ", ".join(cells))
        out.extend(_stage_lines(summary))
        out.append(verdict_line(summary.straggler))
        cost = cost_line(summary.straggler)
        if cost:
            out.append(cost)
        out.extend(_named_lines(summary))
    if summary.memory:
        allocated = [
            v.peak_allocated_bytes
            for devs in summary.memory.values()
            for v in devs.values()
            if v.peak_allocated_bytes is not None
        ]
        reserved = [
            v.peak_reserved_bytes
            for devs in summary.memory.values()
            for v in devs.values()
            if v.peak_reserved_bytes is not None
        ]
        if allocated or reserved:

            def size(x: float) -> str:
                return _bytes(int(x))

            text = "peak memory across devices (min/p50/p90/max):"
            if allocated:
                text += f" allocated {_spread([float(x) for x in allocated], size)}"
            if reserved:
                text += f"; reserved {_spread([float(x) for x in reserved], size)}"
            out.append(text)
    if summary.process:
        procs = list(summary.process.values())
        cpu = [p.cpu_percent_mean for p in procs if p.cpu_percent_mean is not None]
        rss = [float(p.ram_used_bytes_max) for p in procs]
        gpu = [
            float(p.gpu_memory_used_bytes_max)
            for p in procs
            if p.gpu_memory_used_bytes_max is not None
        ]
        text = f"process across {len(procs)} rank(s) (min/p50/p90/max):"
        text += f" CPU mean {_spread(cpu, lambda x: f'{x:.0f}%')}" if cpu else " CPU n/a"
        text += f"; RSS max {_spread(rss, lambda x: _bytes(int(x)))}"
        if gpu:
            text += f"; GPU memory max {_spread(gpu, lambda x: _bytes(int(x)))}"
        bad = sum(p.cpu_percent_impossible_samples for p in procs)
        if bad:
            text += f" ({bad} impossible CPU sample(s) left out)"
        out.append(text)
    if summary.system:
        nodes = list(summary.system.values())
        gpus = [g for n in nodes for g in n.gpus.values()]
        text = (
            f"system across {len(nodes)} node(s): CPU mean "
            f"{_spread([n.cpu_percent_mean for n in nodes], lambda x: f'{x:.0f}%')}; "
            f"RAM max {_spread([float(n.ram_used_bytes_max) for n in nodes], lambda x: _bytes(int(x)))}; "
            f"{sum(n.gpu_count for n in nodes)} GPU(s)"
        )
        util = [g.utilization_percent_mean for g in gpus if g.utilization_percent_mean is not None]
        if util:
            text += f", util mean {_spread(util, lambda x: f'{x:.0f}%')}"
        out.append(text)


def _table(summary: RunSummary, out: list[str]) -> None:
    """``--ranks``: every rank's row (and every node's)."""
    ranks = summary.ranks
    steps = summary.step_time
    phases = summary.phases or {}
    coords = summary.coordinates or {}
    if steps:
        out.append("step time per rank (ms):")
        out.append("  rank  steps      p50      p90      p99      max   steps/s  place")
        for r in ranks:
            s = steps[str(r)]
            place = " ".join(f"{n}={c.rank}" for n, c in coords.get(str(r), {}).items())
            out.append(
                f"  {r:>4} {s.steps:>6} {s.p50_ms:>8.2f} {s.p90_ms:>8.2f} "
                f"{s.p99_ms:>8.2f} {s.max_ms:>8.2f} {s.steps_per_s:>9.2f}  {place}".rstrip()
            )
        out.append("phases per rank (mean ms, share of the iteration):")
        for r in ranks:
            ph = phases[str(r)]
            cells = ", ".join(
                f"{n} {ph[n].mean_ms:.2f} ({ph[n].share * 100:.0f}%)" for n in summary.phase_names
            )
            out.append(f"  rank {r}: {cells}")
    if summary.memory:
        rows = [
            f"rank {r} {d}: allocated {_bytes(v.peak_allocated_bytes)}, "
            f"reserved {_bytes(v.peak_reserved_bytes)}"
            for r, devs in summary.memory.items()
            for d, v in devs.items()
            if v.peak_allocated_bytes is not None or v.peak_reserved_bytes is not None
        ]
        if rows:
            out.append("peak memory per device:")
            out.extend(f"  {row}" for row in rows)
    if summary.process:
        out.append("process per rank:")
        for rank_name, p in summary.process.items():
            gpu = (
                f", GPU memory max {_bytes(p.gpu_memory_used_bytes_max)}"
                if p.gpu_memory_used_bytes_max is not None
                else ""
            )
            out.append(
                f"  rank {rank_name}: {_cpu_text(p)}; RSS max {_bytes(p.ram_used_bytes_max)}{gpu}"
            )
    if summary.system:
        out.append("system per node:")
        for node_name, node in summary.system.items():
            out.append(
                f"  node {node_name}: CPU {node.cpu_percent_mean:.0f}% mean, "
                f"{node.cpu_percent_max:.0f}% max; RAM max {_bytes(node.ram_used_bytes_max)} "
                f"of {_bytes(node.ram_total_bytes)}; {node.gpu_count} GPU(s)"
            )
            for index, g in node.gpus.items():
                util = g.utilization_percent_mean
                out.append(
                    f"    gpu {index}: util {'n/a' if util is None else f'{util:.0f}%'} mean, "
                    f"memory max {_bytes(g.memory_used_bytes_max)}, "
                    f"temp max {g.temperature_c_max} C, power max {g.power_usage_w_max} W"
                )


def format_summary(summary: RunSummary, full: bool = True, ranks: bool = False) -> str:
    """The summary as plain text: a few lines (``full=False``), every section as
    distributions across ranks (the default), or with a row per rank too (``ranks``)."""
    out: list[str] = []
    env = summary.environment
    head = f"traceml: summary of {summary.title}"
    if env is not None and env.training_strategy:
        # Ranks with a step line; none yet (a run that stopped before its first step)
        # is said by the notes, not as "0 ranks" of a run whose ranks did connect.
        counted = f", {len(summary.ranks)} rank(s)" if summary.ranks else ""
        head += f" ({env.training_strategy}{counted})"
    out.append(head)
    layout = _layout_line(summary)
    if layout and full:
        out.append(layout)
    steps = summary.step_time
    if not full:
        if steps:
            _short_steps(summary, out)
            out.append(verdict_line(summary.straggler))
    else:
        _compact(summary, out)
        if ranks:
            _table(summary, out)
    limit = None if ranks else MAX_LISTED
    out.extend(_listed("problem", summary.problems, limit))
    out.append(summary.loss.line if full else summary.loss.short_line)
    if full:
        out.extend(_listed("note", summary.notes, limit))
    return "\n".join(line if line.startswith("traceml:") else f"traceml: {line}" for line in out)


def _short_steps(summary: RunSummary, out: list[str]) -> None:
    """``--short``'s step and phase lines (the end of ``traceml run``)."""
    ranks = summary.ranks
    figures = summary.step_time or {}
    phases = summary.phases or {}
    p50 = [figures[str(r)].p50_ms for r in ranks]
    spread = f"{p50[0]:.2f} ms" if min(p50) == max(p50) else f"{min(p50):.2f} to {max(p50):.2f} ms"
    out.append(f"step time: p50 {spread}; {_steps_text([figures[str(r)].steps for r in ranks])}")
    # The largest phase on average, the quickest pointer to where time goes.
    totals: dict[str, float] = {}
    for r in ranks:
        for n, v in phases[str(r)].items():
            totals[n] = totals.get(n, 0.0) + v.share / len(ranks)
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:3]
    out.append("phases: " + ", ".join(f"{n} {v * 100:.0f}%" for n, v in top))
