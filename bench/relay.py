"""What a node's relay costs: 8 simulated ranks at 10 steps/s through the relay process
``traceml run`` starts on each node of a multi-node job, against the same ranks sending
straight to the aggregator, in one run.

Prints figures only; never passes or fails on time.

    python -m bench.relay                      # 8 ranks, 10 steps/s, 30 s per phase
    python -m bench.relay --ranks 8 --steps-per-s 10 --seconds 60

Two phases with the same load (``bench.scale``'s generator: what a ``RankSender`` sends
every 0.25 s, one ``step_time`` and one ``step_memory`` batch with the steps since the
last flush, ``process`` items every 2 s, an 8-GPU ``system`` snapshot from local rank 0,
``runtime_environment``, ``finished``) into a real ``traceml serve`` exporting every
stream:

- ``direct``: each rank holds its own connection to the aggregator;
- ``relay``: each rank connects to a relay process on loopback (``python -m
  traceml_ai.launch._relay_process``, as ``traceml run`` starts it), which forwards
  their frames over one connection to the aggregator.

CPU is each process's user + system time over the load window (from the first
scheduled flush to the last), as % of one core. Both phases check the files record by
record (``bench.scale``'s exact accounting).

Last line: ``ranks=<n> steps_per_s=<s> relay_cpu_pct=<x> direct_aggregator_cpu_pct=<y>
relay_aggregator_cpu_pct=<z> relay_vs_direct_aggregator=<x/y> dropped_batches=<d>
exact=<0|1>``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from traceml_ai.transport.wire import ENV_RUN_TOKEN

from .scale.aggregator import REPO, AggregatorProc
from .scale.items import LoadSpec
from .scale.run import RunResult, run_once


class _Window:
    """CPU seconds of processes over the load window [t0, t0 + seconds]."""

    def __init__(self) -> None:
        self.cpu_s: dict[str, float] = {}

    def measure(self, pids: dict[str, int], t0: float, seconds: float) -> None:
        procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        time.sleep(max(0.0, t0 - time.monotonic()))
        begin = {name: _cpu(p) for name, p in procs.items()}
        time.sleep(max(0.0, t0 + seconds - time.monotonic()))
        for name, p in procs.items():
            self.cpu_s[name] = _cpu(p) - begin[name]


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


class _RelayProcess:
    """The node's relay process, as ``traceml run`` starts it."""

    def __init__(self) -> None:
        self.popen: subprocess.Popen[bytes] | None = None
        self.stopped: dict[str, object] = {}

    def start(self, upstream: tuple[str, int], token: str) -> list[tuple[str, int]]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
        env[ENV_RUN_TOKEN] = token
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p
        )
        config = {
            "upstream": list(upstream),
            "port": 0,
            "stop_timeout_s": 30.0,
            "parent_pid": os.getpid(),
        }
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "traceml_ai.launch._relay_process", json.dumps(config)],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        assert self.popen.stdout is not None
        event = json.loads(self.popen.stdout.readline() or b"{}")
        if event.get("event") != "ready":
            self.popen.kill()
            raise RuntimeError(f"the relay did not start: {event}")
        return [("127.0.0.1", int(event["port"]))]

    def stop(self) -> None:
        popen = self.popen
        if popen is None:
            return
        popen.terminate()
        assert popen.stdout is not None
        line = popen.stdout.readline()
        self.stopped = json.loads(line) if line.strip() else {}
        popen.wait(60)


def _phase(
    name: str, spec: LoadSpec, logs_dir: Path, via_relay: bool
) -> tuple[RunResult, dict[str, float], dict[str, object]]:
    window = _Window()
    relay = _RelayProcess() if via_relay else None

    def during(agg: AggregatorProc, t0: float) -> None:
        pids = {"aggregator": agg.pid}
        if relay is not None and relay.popen is not None:
            pids["relay"] = relay.popen.pid
        window.measure(pids, t0, spec.seconds)

    try:
        r = run_once(
            spec,
            "all",
            logs_dir=logs_dir,
            run_name=name,
            procs=1,
            do_validate=False,
            during=during,
            route=relay.start if relay is not None else None,
            after_load=relay.stop if relay is not None else None,
            quiet=True,
        )
    finally:
        if relay is not None and relay.popen is not None and relay.popen.poll() is None:
            relay.popen.kill()
    pct = {k: v / spec.seconds * 100 for k, v in window.cpu_s.items()}
    return r, pct, relay.stopped if relay is not None else {}


def main(argv: list[str] | None = None) -> None:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=8, help="ranks of the node")
    parser.add_argument("--steps-per-s", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=30.0, help="load of each phase")
    args = parser.parse_args(argv)

    spec = LoadSpec(
        ranks=args.ranks,
        steps_per_s=args.steps_per_s,
        seconds=args.seconds,
        ranks_per_node=args.ranks,
    )
    print(
        f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; "
        f"load: {spec.ranks} ranks, {spec.steps_per_s:g} steps/s, {spec.seconds:g} s a phase, "
        f"streams {','.join(spec.wire_streams)}"
    )
    tmp = Path(tempfile.mkdtemp(prefix="traceml-relay-bench-"))
    try:
        direct, direct_pct, _ = _phase("direct", spec, tmp, via_relay=False)
        relayed, relay_pct, stopped = _phase("relay", spec, tmp, via_relay=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    for name, r, pct in (("direct", direct, direct_pct), ("relay", relayed, relay_pct)):
        c = r.check
        print(
            f"{name}: records written {r.written_records:,} of {r.generated_records:,}, "
            f"dropped batches {r.dropped}, accounting {'EXACT' if c.exact else 'NOT EXACT'}; "
            f"aggregator {pct['aggregator']:.2f} % of one core"
            + (f", relay {pct['relay']:.2f} % of one core" if "relay" in pct else "")
        )
    print(f"relay process at its stop: {stopped}")
    relay_cpu = relay_pct["relay"]
    agg_direct = direct_pct["aggregator"]
    agg_relay = relay_pct["aggregator"]
    ratio = relay_cpu / agg_direct if agg_direct else float("nan")
    print(
        f"relay / aggregator (direct) = {ratio:.2f}; aggregator with the relay / direct = "
        f"{agg_relay / agg_direct if agg_direct else float('nan'):.2f}"
    )
    exact = direct.check.exact and relayed.check.exact
    print(f"machine: load average {os.getloadavg()[0]:.2f} at end")
    print(
        f"ranks={spec.ranks} steps_per_s={spec.steps_per_s:g} relay_cpu_pct={relay_cpu:.2f} "
        f"direct_aggregator_cpu_pct={agg_direct:.2f} relay_aggregator_cpu_pct={agg_relay:.2f} "
        f"relay_vs_direct_aggregator={ratio:.3f} "
        f"dropped_batches={direct.dropped + relayed.dropped} exact={int(exact)}"
    )


if __name__ == "__main__":
    main()
