"""``--relays N``: the simulated ranks send through N relays (``traceml_ai.transport.Relay``,
the relay's own code), one per node, many per process on one event loop (a shared
``LoopRunner``: one thread per process): a machine that cannot hold a process per node
still runs every node's relay."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any

from traceml_ai.transport import Relay
from traceml_ai.transport.server import LoopRunner


def _host_main(upstream: tuple[str, int], token: str, count: int, conn: Connection) -> None:
    runner = LoopRunner("scale-relays")
    relays = [
        Relay(upstream, token, expected_connections=64, loop_runner=runner) for _ in range(count)
    ]
    try:
        conn.send([relay.start() for relay in relays])
    except BaseException as exc:
        conn.send(f"error: {exc!r}")
        raise
    conn.recv()  # stop
    totals = {"forwarded_frames": 0, "dropped_batches": 0, "dropped_messages": 0}
    for relay in relays:
        stats = relay.stop(60.0)
        totals["forwarded_frames"] += stats.forwarded_frames
        totals["dropped_batches"] += stats.dropped_batches
        totals["dropped_messages"] += stats.dropped_messages
    runner.stop()
    conn.send(totals)


class RelayHosts:
    """``relays`` relays in ``procs`` processes; :meth:`route` is ``run_once``'s hook
    (one address per node, node ``i`` on relay ``i % relays``), :meth:`stop` its
    ``after_load``."""

    def __init__(self, relays: int, procs: int) -> None:
        self.relays = relays
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
            proc = ctx.Process(target=_host_main, args=(upstream, token, count, child), daemon=True)
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
        for key in ("forwarded_frames", "dropped_batches", "dropped_messages"):
            self.totals[key] = 0
        for proc, conn in self._hosts:
            if conn.poll(120):
                for key, value in conn.recv().items():
                    self.totals[key] += value
            proc.join(10)
