"""Large runs for the dashboard's tests, made directly as the view's input (a
:class:`RunData` in the shape the live source gives: every rank's steps as flat
columns, every rank's median, the step figures of the table's ranks only), so that a
10,240-rank page is made in well under a second."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from traceml_ai.analysis import Coordinates, PhaseFigures, RankSteps
from traceml_ai.dashboard._view import RunData, StepSeries, outlier_ranks, rank_medians

BASE_MS = 30.0
"""Every rank's step time before the factors below (each step jittered by up to 1 ms)."""


def layout_of(ranks: int, *, tp: int, pp: int) -> dict[int, Coordinates]:
    """Megatron's order: tensor-parallel ranks next to each other, then data-parallel
    groups, the pipeline stage outermost."""
    dp = ranks // (tp * pp)
    return {
        r: {"tp": (r % tp, tp), "dp": ((r // tp) % dp, dp), "pp": (r // (tp * dp), pp)}
        for r in range(ranks)
    }


def big_run(
    ranks: int,
    *,
    per_node: int = 8,
    steps: int = 120,
    slower: Mapping[int, float] | None = None,
    layout: Mapping[int, Coordinates] | None = None,
    gpus_per_node: int = 8,
) -> RunData:
    """A live run of ``ranks`` ranks (``per_node`` a node) with ``steps`` steps each;
    rank -> factor in ``slower`` multiplies that rank's step times."""
    rng = np.random.default_rng(0)
    factor = np.ones(ranks)
    for r, k in (slower or {}).items():
        factor[r] = k
    ms = (BASE_MS + rng.uniform(-1.0, 1.0, size=(ranks, steps))) * factor[:, None]
    ends = 10**18 + np.cumsum(ms * 1e6 + 1e5, axis=1)
    series = StepSeries(
        rank=np.repeat(np.arange(ranks, dtype=np.int64), steps),
        step=np.tile(np.arange(1, steps + 1, dtype=np.int64), ranks),
        step_ms=ms.ravel(),
        end_ns=ends.ravel(),
    )
    p50 = rank_medians(series)
    shown = outlier_ranks(list(range(ranks)), [], p50)
    step_time: dict[str, RankSteps] = {}
    phases: dict[str, dict[str, PhaseFigures]] = {}
    for r in shown:
        p50_ms, p90_ms, p99_ms = np.percentile(ms[r], (50.0, 90.0, 99.0)).tolist()
        step_time[str(r)] = RankSteps(
            steps=steps, first_step=1, last_step=steps, p50_ms=p50_ms, p90_ms=p90_ms,
            p99_ms=p99_ms, max_ms=float(ms[r].max()), mean_ms=float(ms[r].mean()),
            steps_per_s=1000.0 / float(ms[r].mean()),
        )  # fmt: skip
        mean = float(ms[r].mean())
        phases[str(r)] = {
            "forward": PhaseFigures(mean_ms=mean * 0.4, p50_ms=mean * 0.4, share=0.4),
            "backward": PhaseFigures(mean_ms=mean * 0.6, p50_ms=mean * 0.6, share=0.6),
        }
    nodes = (ranks + per_node - 1) // per_node
    system: list[dict[str, Any]] = [
        {
            "node": n,
            "cpu_percent": 50.0 + n % 7,
            "ram_used_bytes": 2**35,
            "ram_total_bytes": 2**40,
            "gpus": [
                {
                    "index": i,
                    "utilization_percent": 90.0,
                    "memory_used_bytes": 2**34,
                    "memory_total_bytes": 2**36,
                }
                for i in range(gpus_per_node)
            ],
        }
        for n in range(nodes)
    ]
    return RunData(
        source="live",
        finished=False,
        status="training",
        run_name="big",
        run_folder="/runs/big",
        world_size=ranks,
        ranks=list(range(ranks)),
        rank_nodes={r: r // per_node for r in range(ranks)},
        layout=dict(layout or {}),
        total_steps={r: steps for r in range(ranks)},
        step_time=step_time,
        phases=phases,
        phase_names=["forward", "backward"],
        series=series,
        rank_p50_ms=p50,
        memory=[
            {
                "rank": r,
                "device": f"cuda:{r % per_node}",
                "peak_allocated_bytes": 2**33,
                "peak_reserved_bytes": 2**34,
            }
            for r in range(ranks)
        ],
        process=[{"rank": r, "cpu_percent": 100.0, "ram_used_bytes": 2**32} for r in range(ranks)],
        system=system,
        loss={"status": "in_progress", "lines": [], "warning": None},
    )
