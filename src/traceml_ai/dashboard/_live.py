"""The live source: the aggregator's :class:`~traceml_ai.monitor.LiveState` as
a :class:`~traceml_ai.dashboard._view.RunData`.

Reads only what the aggregator already holds (each rank's recent steps, the latest
samples, the straggler view the feed computes, the aggregator's health); nothing is
asked of the ranks. How often it is built is :class:`~._server.Views`' choice.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from traceml_ai.analysis import (
    PhaseFigures,
    RankSteps,
    StepRow,
    StepRows,
    step_figures,
)
from traceml_ai.dashboard._view import (
    LazySeries,
    RunData,
    StepSeries,
    files_command,
    outlier_ranks,
)
from traceml_ai.monitor import STRAGGLER_PERIOD_S, STRAGGLER_STEPS, WINDOW_STEPS

if TYPE_CHECKING:
    from traceml_ai.monitor import Monitoring, StepSeen

__all__ = ["LiveSource"]


_STEP = attrgetter("step")
_STEP_MS = attrgetter("step_ms")
_END_NS = attrgetter("end_ns")


def _step_series(recent: dict[int, list[StepSeen]]) -> StepSeries:
    """Every rank's recent steps as the view's flat columns (each column read by one
    ``map`` in C, not a Python step per step)."""
    order = sorted(recent)
    flat = list(chain.from_iterable(recent[r] for r in order))
    if not flat:
        return StepSeries.empty()
    return StepSeries(
        rank=np.repeat(np.array(order, dtype=np.int64), [len(recent[r]) for r in order]),
        step=np.fromiter(map(_STEP, flat), dtype=np.int64, count=len(flat)),
        step_ms=np.fromiter(map(_STEP_MS, flat), dtype=np.float64, count=len(flat)),
        end_ns=np.fromiter(map(_END_NS, flat), dtype=np.float64, count=len(flat)),
    )


def _shown_rows(recent: dict[int, list[StepSeen]], shown: list[int]) -> StepRows:
    """The step rows (as the summary reads them) of the ranks the page's tables show."""
    rows: StepRows = {}
    for r in shown:
        rows[r] = {s.step: StepRow(s.step_ms, s.phases, end_ns=float(s.end_ns)) for s in recent[r]}
    return rows


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


class LiveSource:
    """RunData of the running aggregator, as it is now."""

    def __init__(self, monitoring: Monitoring) -> None:
        self._monitoring = monitoring

    def __call__(self) -> RunData:
        return self._build()

    def _build(self) -> RunData:
        m = self._monitoring
        state = m.state
        finished = m.finished.is_set()
        health = m.health()
        # Each rank's figures without its histograms, and the median of its recent steps
        # (one numpy sort in the state): no Python step per step and rank.
        live_ranks = state.metric_figures(0).ranks
        recent = {r: steps for r, steps in state.recent_steps().items() if steps}
        notes: list[str] = []
        step_time: dict[str, RankSteps] | None = None
        phases: dict[str, dict[str, PhaseFigures]] | None = None
        names: list[str] = []
        straggler = state.straggler
        p50 = {
            r.rank: r.recent_median_ms
            for r in live_ranks
            if r.recent_median_ms is not None and r.rank in recent
        }
        if recent:
            # The summary's figures of the ranks the page's tables show (all, up to the
            # table's rows; else the stragglers and the slowest), which bounds the cost.
            named = straggler.named_ranks if straggler else []
            shown = outlier_ranks(sorted(recent), named, p50)
            figures = step_figures(_shown_rows(recent, shown))
            step_time, phases, names = figures.step_time, figures.phases, figures.phase_names
        else:
            notes.append("step times: no step received yet")
        nodes = state.rank_nodes()

        memory: list[dict[str, Any]] = []
        for r in live_ranks:
            for device, (allocated, reserved) in sorted(r.peak_memory.items()):
                memory.append(
                    {
                        "rank": r.rank,
                        "device": device,
                        "peak_allocated_bytes": allocated,
                        "peak_reserved_bytes": reserved,
                    }
                )
        if memory and all(
            m["peak_allocated_bytes"] is None and m["peak_reserved_bytes"] is None for m in memory
        ):
            notes.append("peak memory: no allocator figures (a CPU run: peaks are null on cpu)")

        process = [{"rank": r.rank, **r.process} for r in live_ranks if r.process]
        if not process:
            notes.append("process figures: no process sample received yet")
        elif all("gpu_memory_used_bytes" not in p for p in process):
            notes.append("process GPU memory: none (no GPU used by the ranks)")

        system: list[dict[str, Any]] = []
        for n in state.nodes():
            system.append(
                {
                    "node": n.node,
                    **n.system,
                    "gpus": [{"index": i, **g} for i, g in sorted(n.gpus.items())],
                }
            )
        if not system:
            notes.append("system figures: no system sample received yet")
        elif all(not n["gpus"] for n in system):
            notes.append("GPU figures: no GPU on the host(s)")

        world = state.world_size or health.expected_ranks
        run = m.run
        export_dir = run.run_dir / "aggregator" / "export"
        written = sum(health.written_records.values())
        lines: list[str] = []
        if health.written_records or export_dir.is_dir():
            per_stream = ", ".join(
                f"{s} {n:,}" for s, n in sorted(health.written_records.items()) if n
            )
            lines.append(
                f"export: {_plural(written, 'record')} written"
                + (f" ({per_stream})" if per_stream else "")
                + ("" if finished else " so far")
            )
        else:
            lines.append("export: off (the live views only; no file is written)")
        expected = health.expected_ranks
        lines.append(
            f"ranks: {health.reporting_ranks} reporting"
            + (f" of {expected} expected" if expected is not None else "")
            + f", {health.finished_ranks} finished"
            + (f", {health.missing_ranks} missing" if health.missing_ranks else "")
        )
        lost = False
        if health.dropped_batches:
            lost = True
            lines.append(f"dropped before export: {_plural(health.dropped_batches, 'batch')}")
        if sum(health.failed_records.values()):
            lost = True
            lines.append(
                f"failed to write: {_plural(sum(health.failed_records.values()), 'record')}"
            )
        if health.rejected_connections:
            lines.append(f"rejected connections: {health.rejected_connections}")
        if health.live_dropped_batches:
            lines.append(
                f"live views skipped {_plural(health.live_dropped_batches, 'batch')} "
                "(the files are unaffected)"
            )
        if finished:
            if health.missing_ranks:
                lost = True
            lines.append(
                "the run has finalized (closing lines written); the full loss report, with "
                f"finalization_warning.json: {files_command(str(run.run_dir))}"
            )
        status = "finalized" if finished else ("training" if recent else "waiting for ranks")
        return RunData(
            source="live",
            finished=finished,
            status=status,
            run_name=run.run_name,
            run_folder=str(run.run_dir),
            export_folder=str(export_dir) if export_dir.is_dir() else None,
            host=run.host,
            world_size=world,
            strategy=state.strategy(),
            window=(
                f"step figures: the last {WINDOW_STEPS} steps of each rank (as received); "
                f"the straggler verdict: each rank's last {STRAGGLER_STEPS} steps, every "
                f"{STRAGGLER_PERIOD_S:g} s, its +% over the run so far (the excess over "
                "the others' own work, summed over every verdict that named the rank)"
            ),
            ranks=sorted(recent),
            rank_nodes=nodes,
            layout=state.layout(),
            total_steps={r.rank: r.steps for r in live_ranks},
            step_time=step_time,
            phases=phases,
            phase_names=names,
            straggler=straggler,
            series=LazySeries(lambda: _step_series(recent)),
            rank_p50_ms=p50,
            memory=memory,
            memory_basis="the peak of each rank's latest step",
            process=process,
            process_basis="the latest sample",
            system=system,
            system_basis="the latest sample",
            loss={
                "status": ("lost" if lost else "complete")
                if finished
                else ("lost" if lost else "in_progress"),
                "lines": lines,
                "warning": None,
            },
            notes=notes,
            waiting=None if recent else "no step received yet",
        )
