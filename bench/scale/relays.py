"""``--relays N``: the simulated ranks send through N relays (``traceml_ai.transport.Relay``,
the relay's own code), one per node, many per process on one event loop (a shared
``LoopRunner``: one thread per process): a machine that cannot hold a process per node
still runs every node's relay.

``--relay-processes``: one real relay process per node instead
(``python -m traceml_ai.launch._relay_process``, started and stopped by
``RelayProcess`` as ``traceml run`` does on each node)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import resource
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import psutil

from traceml_ai.launch._relay_process import RelayProcess
from traceml_ai.transport import Relay
from traceml_ai.transport.server import LoopRunner


def _host_main(
    upstream: tuple[str, int], token: str, count: int, shared: bool, conn: Connection
) -> None:
    runner = LoopRunner("scale-relays")
    relays = [
        Relay(upstream, token, expected_connections=64, loop_runner=runner if shared else None)
        for _ in range(count)
    ]
    try:
        conn.send([relay.start() for relay in relays])
    except BaseException as exc:
        conn.send(f"error: {exc!r}")
        raise
    conn.recv()  # stop
    totals = {"forwarded_frames": 0, "dropped_batches": 0, "dropped_messages": 0}
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = usage.ru_utime + usage.ru_stime
    for relay in relays:
        stats = relay.stop(300.0)
        totals["forwarded_frames"] += stats.forwarded_frames
        totals["dropped_batches"] += stats.dropped_batches
        totals["dropped_messages"] += stats.dropped_messages
    runner.stop()
    conn.send({**totals, "cpu_ms": round(cpu_s * 1000)})


class RelayHosts:
    """``relays`` relays in ``procs`` processes, on one loop per process (``shared``) or
    each on a thread and loop of its own; :meth:`route` is ``run_once``'s hook (one
    address per node, node ``i`` on relay ``i % relays``), :meth:`stop` its
    ``after_load``."""

    def __init__(self, relays: int, procs: int, shared: bool = True) -> None:
        self.relays = relays
        self.shared = shared
        self.procs = max(1, min(procs, relays))
        self._hosts: list[tuple[Any, Connection]] = []
        self.totals: dict[str, int] = {}

    def route(self, upstream: tuple[str, int], token: str, nodes: int) -> list[tuple[str, int]]:
        ctx = mp.get_context("fork")
        addresses: list[tuple[str, int]] = []
        share = [
            self.relays // self.procs + (i < self.relays % self.procs) for i in range(self.procs)
        ]
        for count in share:
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_host_main, args=(upstream, token, count, self.shared, child), daemon=True
            )
            proc.start()
            self._hosts.append((proc, parent))
        for _, conn in self._hosts:
            got = conn.recv()
            if isinstance(got, str):
                raise RuntimeError(f"relay host failed: {got}")
            addresses.extend(got)
        return [addresses[node % len(addresses)] for node in range(nodes)]

    def stop(self) -> None:
        for _, conn in self._hosts:
            conn.send("stop")
        for key in ("forwarded_frames", "dropped_batches", "dropped_messages", "cpu_ms"):
            self.totals[key] = 0
        for proc, conn in self._hosts:
            # Each relay forwards all it holds first (a starved run's backlog).
            if conn.poll(600):
                for key, value in conn.recv().items():
                    self.totals[key] += value
            proc.join(10)


class RelayProcesses:
    """One real relay process per node (what ``traceml run`` starts on each node), with
    :class:`RelayHosts`'s ``route``/``stop``/``totals``."""

    def __init__(self, stop_timeout_s: float = 60.0) -> None:
        self._stop_timeout_s = stop_timeout_s
        self._procs: list[RelayProcess] = []
        self.totals: dict[str, int] = {}

    @property
    def relays(self) -> int:
        return len(self._procs)

    def route(self, upstream: tuple[str, int], token: str, nodes: int) -> list[tuple[str, int]]:
        host, port = upstream
        self._procs = [
            RelayProcess(f"{host}:{port}", token, self._stop_timeout_s) for _ in range(nodes)
        ]
        # Started side by side: each is an interpreter starting up.
        with ThreadPoolExecutor(8) as pool:
            ports = list(pool.map(lambda relay: relay.start(), self._procs))
        for started in ports:
            if isinstance(started, str):
                self.stop()
                raise RuntimeError(started)
        return [("127.0.0.1", int(p)) for p in ports]

    def stop(self) -> None:
        # CPU of the relay processes over the load (before their stop's own work).
        cpu_s = 0.0
        for relay in self._procs:
            proc = relay._proc
            if proc is not None:
                with contextlib.suppress(psutil.Error):
                    times = psutil.Process(proc.pid).cpu_times()
                    cpu_s += times.user + times.system
        with ThreadPoolExecutor(8) as pool:
            events = list(pool.map(lambda relay: relay.stop(), self._procs))
        self.totals = {
            "forwarded_frames": 0,
            "dropped_batches": 0,
            "dropped_messages": 0,
            "stopped_without_counts": 0,
            "cpu_ms": round(cpu_s * 1000),
        }
        for event in events:
            if event is None:
                self.totals["stopped_without_counts"] += 1
                continue
            for key in ("forwarded_frames", "dropped_batches", "dropped_messages"):
                self.totals[key] += int(event.get(key, 0))
