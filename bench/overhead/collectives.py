"""What timing the collectives costs a traced step: 2-rank DDP and FSDP2 on CPU (gloo).

``python -m bench.overhead.collectives [--steps N] [--rounds R]``

Each round runs ``workloads/collectives_loop.py`` under ``traceml run
--nproc-per-node 2`` once per strategy. In one process every step is traced and the
steps alternate between collective timing on and off (DDP: two identical models, one
with TraceML's communication hook, one with DDP's own C++ all-reduce; FSDP2: the
timing switched between steps; pairs in both orders), so the machine's noise hits both
alike. The cost is the median of the on-minus-off differences of neighbouring steps,
in wall time and in the training thread's CPU time (the steady figure: a gloo step's
wall time is mostly waiting for the other rank, and varies by milliseconds), as a
share of the off step and per collective.

Pairs: DDP ``hook_on`` (TraceML's hook, timing on) against ``builtin`` (DDP's own C++
all-reduce: a run without the timing), and against ``hook_off`` (the same hooked model,
timing off: the recording's own cost); FSDP2 ``on`` against ``off``.

Each round also times TraceML's own work per collective in one process (a gloo world
of one): a call through the patched function with the timing on against the function
itself, plus the step's aggregation of its calls into items, per call.

Last line: ``collectives_overhead_pct=<x> collectives_overhead_us_per_call=<y>``: the
headline pairs' wall share (the larger of the two strategies) and TraceML's own work
per collective (record + aggregate), medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "collectives_loop.py"


PAIRS = {
    "ddp": (("hook_on", "builtin"), ("hook_on", "hook_off")),
    "fsdp2": (("on", "off"),),
}
"""Per strategy: the headline pair (timing on against a run without it), then the
timing's own cost (DDP: the same hooked model with the timing off)."""


def run_once(strategy: str, steps: int, tmp: Path) -> list[dict[str, float]]:
    """One 2-rank run: per pair of :data:`PAIRS`, the figures of its paired steps."""
    out = tmp / f"{strategy}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "traceml_ai", "run",
        "--logs-dir", str(tmp / "logs"), "--nproc-per-node", "2",
        str(WORKLOAD), strategy, str(steps), str(out),
    ]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"{strategy}: traceml run failed:\n{res.stderr[-2000:]}")
    data = json.loads(out.read_text())
    calls = max(1, int(data["collectives"]))
    figures = []
    for a, b in PAIRS[strategy]:
        row: dict[str, float] = {"collectives": calls}
        for kind in ("wall", "cpu"):
            on, off = data[f"{kind}_us"][a], data[f"{kind}_us"][b]
            skip = min(20, len(off) // 5)  # warm-up
            diffs = [p - q for p, q in zip(on[skip:], off[skip:], strict=False)]
            cost, step = statistics.median(diffs), statistics.median(off[skip:])
            row[f"{kind}_step_us"] = step
            row[f"{kind}_cost_us"] = cost
            row[f"{kind}_pct"] = 100.0 * cost / step
        row["us_per_call"] = row["cpu_cost_us"] / calls
        figures.append(row)
    return figures


def direct_once(tmp: Path) -> dict[str, float]:
    """TraceML's own work per collective, in one process (see the workload's ``direct``)."""
    out = tmp / "direct.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run(
        [sys.executable, str(WORKLOAD), "direct", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if res.returncode != 0:
        raise SystemExit(f"direct: failed:\n{res.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(out.read_text())
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    worst_pct: list[float] = []
    worst_call: list[float] = []  # per round: TraceML's own work per collective
    for r in range(args.rounds):
        pcts, per_call = [], []
        with tempfile.TemporaryDirectory() as tmp:
            for strategy in ("ddp", "fsdp2"):
                rows = run_once(strategy, args.steps, Path(tmp))
                for (a, b), f in zip(PAIRS[strategy], rows, strict=True):
                    print(
                        f"round {r + 1} {strategy} {a} vs {b}: {f['collectives']:.0f} "
                        f"collectives a step; wall {f['wall_cost_us']:+.1f} us of "
                        f"{f['wall_step_us']:.0f} ({f['wall_pct']:+.2f} %); training-thread "
                        f"CPU {f['cpu_cost_us']:+.1f} us of {f['cpu_step_us']:.0f} "
                        f"({f['cpu_pct']:+.2f} %, {f['us_per_call']:+.2f} us per collective)",
                        flush=True,
                    )
                headline = rows[0]
                pcts.append(headline["wall_pct"])
                per_call.append(headline["us_per_call"])
            direct = direct_once(Path(tmp))
        print(
            f"round {r + 1} per collective, in one process: record {direct['record_us']:.2f} us "
            f"+ aggregate {direct['aggregate_us']:.2f} us (timing off, the patch passes "
            f"through: {direct['pass_through_us']:.2f} us)",
            flush=True,
        )
        worst_pct.append(max(pcts))
        worst_call.append(direct["record_us"] + direct["aggregate_us"])
    print(
        f"collectives_overhead_pct={statistics.median(worst_pct):.2f} "
        f"collectives_overhead_us_per_call={statistics.median(worst_call):.2f}"
    )


if __name__ == "__main__":
    main()
