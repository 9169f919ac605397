"""What timing the collectives costs a traced step: 2-rank DDP and FSDP2 on CPU (gloo).

``python -m bench.overhead.collectives [--steps N] [--rounds R]``

Each round runs ``workloads/collectives_loop.py`` under ``traceml run
--nproc-per-node 2`` once per strategy. In one process every step is traced and the
steps alternate between collective timing on and off (DDP: two identical models, one
with TraceML's communication hook, one with DDP's own C++ all-reduce; FSDP2: the
timing switched between steps), so the machine's noise hits both alike. The cost is
the median of the on-minus-off differences of neighbouring steps, as a share of the
off step and per collective.

Last line: ``collectives_overhead_pct=<x> collectives_overhead_us_per_call=<y>``
(the larger of the two strategies, median over rounds).
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


def run_once(strategy: str, steps: int, tmp: Path) -> dict[str, float]:
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
    on, off = data["on_us"], data["off_us"]
    skip = min(20, len(off) // 5)  # warm-up
    diffs = [a - b for a, b in zip(on[skip:], off[skip:], strict=False)]
    cost = statistics.median(diffs)
    step = statistics.median(off[skip:])
    calls = max(1, int(data["collectives"]))
    return {
        "step_us": step,
        "cost_us": cost,
        "pct": 100.0 * cost / step,
        "collectives": calls,
        "us_per_call": cost / calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    worst_pct: list[float] = []
    worst_call: list[float] = []
    for r in range(args.rounds):
        pcts, per_call = [], []
        with tempfile.TemporaryDirectory() as tmp:
            for strategy in ("ddp", "fsdp2"):
                f = run_once(strategy, args.steps, Path(tmp))
                print(
                    f"round {r + 1} {strategy}: step {f['step_us']:.0f} us, "
                    f"{f['collectives']} collectives, timing +{f['cost_us']:.1f} us "
                    f"({f['pct']:.2f} %, {f['us_per_call']:.2f} us per collective)",
                    flush=True,
                )
                pcts.append(f["pct"])
                per_call.append(f["us_per_call"])
        worst_pct.append(max(pcts))
        worst_call.append(max(per_call))
    print(
        f"collectives_overhead_pct={statistics.median(worst_pct):.2f} "
        f"collectives_overhead_us_per_call={statistics.median(worst_call):.2f}"
    )


if __name__ == "__main__":
    main()
