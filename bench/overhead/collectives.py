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

``--relay``: each round also runs each strategy with its ranks sending through relays,
as on a job of several nodes: two ``traceml run --nnodes 2 --nproc-per-node 1
--node-relay`` on this host (node 0 hosts the aggregator; each node's rank sends to its
node's relay process on loopback, which forwards to the aggregator), alternating with
the direct runs in the round, so the machine's noise hits both alike.

Last line: ``collectives_overhead_pct=<x> collectives_overhead_us_per_call=<y>``: the
headline pairs' wall share (the larger of the two strategies) and TraceML's own work
per collective (record + aggregate), medians over rounds; with ``--relay``, then
``relay_collectives_overhead_pct=<z> relay_fsdp2_pct=<f> direct_fsdp2_pct=<g>
relay_fsdp2_us_per_collective=<u> direct_fsdp2_us_per_collective=<v>`` (the same
share through relays; FSDP2's wall share and training-thread CPU per collective of
the on/off pair, each transport; medians over rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(strategy: str, steps: int, tmp: Path, out: Path, relay: bool) -> None:
    """Run the workload's 2 ranks: one ``traceml run --nproc-per-node 2``, or (``relay``)
    two single-rank nodes on this host, each rank sending through its node's relay."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    env["OMP_NUM_THREADS"] = "1"
    workload = [str(WORKLOAD), strategy, str(steps), str(out)]
    if not relay:
        cmd = [
            sys.executable, "-m", "traceml_ai", "run",
            "--logs-dir", str(tmp / "logs"), "--nproc-per-node", "2", *workload,
        ]  # fmt: skip
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            raise SystemExit(f"{strategy}: traceml run failed:\n{res.stderr[-2000:]}")
        return
    port = _free_port()
    procs = []
    for node in range(2):
        cmd = [
            sys.executable, "-m", "traceml_ai", "run",
            "--logs-dir", str(tmp / f"logs-node{node}"), "--nnodes", "2",
            "--nproc-per-node", "1", "--node-rank", str(node), "--node-relay",
            "--master-addr", "127.0.0.1", "--master-port", str(port), *workload,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [proc.communicate(timeout=900)[0] for proc in procs]
    for node, proc in enumerate(procs):
        if proc.returncode != 0:
            raise SystemExit(
                f"{strategy} (relay): traceml run of node {node} failed:\n{outputs[node][-2000:]}"
            )
        if "send to the aggregator themselves" in outputs[node]:
            raise SystemExit(f"{strategy} (relay): node {node}'s relay did not start")


def run_once(strategy: str, steps: int, tmp: Path, relay: bool = False) -> list[dict[str, float]]:
    """One 2-rank run: per pair of :data:`PAIRS`, the figures of its paired steps."""
    out = tmp / f"{strategy}{'-relay' if relay else ''}.json"
    _launch(strategy, steps, tmp, out, relay)
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


def _row(label: str, f: dict[str, float]) -> str:
    return (
        f"{label}: {f['collectives']:.0f} collectives a step; wall {f['wall_cost_us']:+.1f} us "
        f"of {f['wall_step_us']:.0f} ({f['wall_pct']:+.2f} %); training-thread CPU "
        f"{f['cpu_cost_us']:+.1f} us of {f['cpu_step_us']:.0f} ({f['cpu_pct']:+.2f} %, "
        f"{f['us_per_call']:+.2f} us per collective)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--relay",
        action="store_true",
        help="also run each strategy with the ranks sending through relays (two nodes here)",
    )
    args = parser.parse_args()
    transports = (False, True) if args.relay else (False,)
    worst_pct: dict[bool, list[float]] = {t: [] for t in transports}
    fsdp2_pct: dict[bool, list[float]] = {t: [] for t in transports}
    fsdp2_call: dict[bool, list[float]] = {t: [] for t in transports}
    worst_call: list[float] = []  # per round: TraceML's own work per collective
    for r in range(args.rounds):
        pcts: dict[bool, list[float]] = {t: [] for t in transports}
        with tempfile.TemporaryDirectory() as tmp:
            for strategy in ("ddp", "fsdp2"):
                # Alternate which transport goes first, round by round.
                order = transports if r % 2 == 0 else transports[::-1]
                for relay in order:
                    rows = run_once(strategy, args.steps, Path(tmp), relay=relay)
                    via = " via relays" if relay else ""
                    for (a, b), f in zip(PAIRS[strategy], rows, strict=True):
                        print(_row(f"round {r + 1} {strategy}{via} {a} vs {b}", f), flush=True)
                    headline = rows[0]
                    pcts[relay].append(headline["wall_pct"])
                    if strategy == "fsdp2":
                        fsdp2_pct[relay].append(headline["wall_pct"])
                        fsdp2_call[relay].append(headline["us_per_call"])
            direct = direct_once(Path(tmp))
        print(
            f"round {r + 1} per collective, in one process: record {direct['record_us']:.2f} us "
            f"+ aggregate {direct['aggregate_us']:.2f} us (timing off, the patch passes "
            f"through: {direct['pass_through_us']:.2f} us)",
            flush=True,
        )
        for relay in transports:
            worst_pct[relay].append(max(pcts[relay]))
        worst_call.append(direct["record_us"] + direct["aggregate_us"])
    last = (
        f"collectives_overhead_pct={statistics.median(worst_pct[False]):.2f} "
        f"collectives_overhead_us_per_call={statistics.median(worst_call):.2f}"
    )
    if args.relay:
        med = statistics.median
        last += (
            f" relay_collectives_overhead_pct={med(worst_pct[True]):.2f}"
            f" relay_fsdp2_pct={med(fsdp2_pct[True]):.2f}"
            f" direct_fsdp2_pct={med(fsdp2_pct[False]):.2f}"
            f" relay_fsdp2_us_per_collective={med(fsdp2_call[True]):.2f}"
            f" direct_fsdp2_us_per_collective={med(fsdp2_call[False]):.2f}"
        )
    print(last)


if __name__ == "__main__":
    main()
