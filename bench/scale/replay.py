"""``--replay-parts K``: the aggregator alone under the traffic of a job too large for
this machine to simulate and receive at once.

At 16,384 ranks behind 2,048 relays the simulated ranks (about 0.2 cores per 2,048)
and the relays' own code (about 0.1 cores per 2,048) would take most of a 2-core
machine before the aggregator got any. So the run has two phases:

1. **Capture**, in ``K`` parts of the nodes one after the other: each part's ranks
   send, as in any run, through their nodes' relays (``transport.Relay``, the relay's
   own code, ``--relays / K`` of them); the relays' upstream is a capture server that
   keeps, per connection, every chunk it read and when (relative to the part's start of
   load). Each part's generators log what every rank sent, as always.
2. **Replay**: a real ``traceml serve`` for the whole job (same token), one connection
   per captured relay connection, each sending its chunks at the times they were read,
   all parts at once from one start: the aggregator gets the bytes of every relay of the
   job at the job's pace, and is measured as in any run. A chunk is sent when due; what
   the aggregator does not take yet waits in the replayer (its lag is reported as the
   generator's).

The accounting is the usual one: the files against every rank's log from the capture.
"""

from __future__ import annotations

import contextlib
import heapq
import multiprocessing as mp
import os
import pickle
import selectors
import shutil
import socket
import struct
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from traceml_records import parse_export_streams

from .aggregator import QueueBounds, start_aggregator
from .generator import generator_main
from .items import LoadSpec
from .relays import RelayHosts
from .run import (
    Child,
    RunResult,
    await_aggregator,
    finish_run,
    kill_all,
    results_of,
    spans,
    start_children,
    wait_connected,
)

_READ_BUFFER = 64 * 1024
"""The replay's read buffer per captured connection."""

_CHUNK = struct.Struct("<qI")
"""A captured chunk's header: when it was read (ns after the part's start of load; before
it, negative: the relay's hello), and its length."""


# -- capture ------------------------------------------------------------------------------


def _capture_main(out_dir: str, part: int, conn: Connection) -> None:
    """Accept the relays' connections; write each one's chunks to a file of its own,
    until told the part's start (``t0``, monotonic) and then to stop once every
    connection has closed."""
    server = socket.create_server(("127.0.0.1", 0), backlog=4096)
    server.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ, None)
    conn.send(server.getsockname()[1])
    t0_ns = 0
    stopping = False
    open_connections = 0
    files: list[BinaryIO] = []
    chunks = received = 0
    clock = time.monotonic_ns
    with contextlib.ExitStack() as stack:
        while not (stopping and open_connections == 0):
            if conn.poll():
                message = conn.recv()
                if message == "stop":
                    stopping = True
                else:
                    t0_ns = int(message * 1e9)
            for key, _ in selector.select(0.05):
                if key.data is None:
                    sock, _ = server.accept()
                    sock.setblocking(False)
                    out = stack.enter_context(
                        open(Path(out_dir) / f"p{part}c{len(files)}.bin", "wb", buffering=1 << 20)
                    )
                    files.append(out)
                    selector.register(sock, selectors.EVENT_READ, (sock, out))
                    open_connections += 1
                    continue
                sock, out = key.data
                try:
                    data = sock.recv(1 << 20)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    selector.unregister(sock)
                    sock.close()
                    out.close()
                    open_connections -= 1
                    continue
                # Before the part's start the offset is taken at replay as 0 (sent first).
                out.write(_CHUNK.pack(clock() - t0_ns if t0_ns else -1, len(data)))
                out.write(data)
                chunks += 1
                received += len(data)
    server.close()
    conn.send({"connections": len(files), "chunks": chunks, "bytes": received})


@dataclass
class Capture:
    """What the capture phase left: the chunk files, every rank's log, the load's cost."""

    spec: LoadSpec
    folder: Path
    results: list[dict[str, Any]]
    """The generators' results (each rank's log of what it sent), all parts."""
    connections: int
    chunks: int
    bytes: int
    relay_totals: dict[str, int]
    gen_cpu_cores: float
    """Per part, on average: the simulated ranks' own cost."""
    relay_cpu_cores: float


def capture(
    spec: LoadSpec,
    token: str,
    parts: int,
    relays: int,
    relay_procs: int,
    procs: int,
    folder: Path,
) -> Capture:
    """Run the job's load in ``parts`` parts of its nodes, each through its share of
    ``relays`` relays into a capture server (see the module's docstring), its chunks
    kept in ``folder``."""
    ctx = mp.get_context("fork")
    node_edges = np.linspace(0, spec.nodes, parts + 1).astype(int)
    results: list[dict[str, Any]] = []
    totals: dict[str, int] = {}
    connections = chunks = received = 0
    gen_cpu = relay_cpu = 0.0
    for part in range(parts):
        first_node, end_node = int(node_edges[part]), int(node_edges[part + 1])
        nodes = end_node - first_node
        parent, child = ctx.Pipe()
        server = ctx.Process(target=_capture_main, args=(str(folder), part, child), daemon=True)
        server.start()
        port = parent.recv()
        hosts = RelayHosts(max(1, relays * nodes // spec.nodes), relay_procs)
        routed = hosts.route(("127.0.0.1", port), token, nodes)
        # One address per node of the job; only this part's nodes are used.
        addresses = [routed[0]] * spec.nodes
        addresses[first_node:end_node] = routed
        first, end = first_node * spec.ranks_per_node, end_node * spec.ranks_per_node
        workdir = Path(tempfile.mkdtemp(prefix="scale-gen-"))
        gens = start_children(ctx, generator_main, [
            (spec, token, addresses, a, b) for a, b in spans(first, end, procs)
        ], workdir, "gen")  # fmt: skip
        wait_connected(gens, "generator")
        time.sleep(0.5)
        t0 = time.monotonic() + 0.2
        parent.send(t0)
        for _, gen_conn, _ in gens:
            gen_conn.send(t0)
        done = results_of(gens, spec.seconds + 600, "generator")
        results.extend(done)
        gen_cpu += sum(r["cpu_s"] for r in done)
        lag = max(r["max_lag_s"] for r in done)
        shutil.rmtree(workdir, ignore_errors=True)
        hosts.stop()  # each relay forwards what it holds, then closes its connection
        for key, value in hosts.totals.items():
            totals[key] = totals.get(key, 0) + value
        relay_cpu += hosts.totals.get("cpu_ms", 0) / 1000
        parent.send("stop")
        if not parent.poll(120):
            raise RuntimeError("capture server did not stop")
        stats = parent.recv()
        server.join(10)
        connections += stats["connections"]
        chunks += stats["chunks"]
        received += stats["bytes"]
        print(
            f"  captured part {part + 1} of {parts}: ranks {first}-{end - 1}, "
            f"{stats['connections']} relay connections, {stats['chunks']:,} chunks, "
            f"{stats['bytes'] / 2**20:,.0f} MiB; the ranks' max lag {lag * 1000:.0f} ms",
            flush=True,
        )
    return Capture(
        spec,
        folder,
        results,
        connections,
        chunks,
        received,
        totals,
        gen_cpu / parts / spec.seconds,
        relay_cpu / parts / spec.seconds,
    )


# -- replay -------------------------------------------------------------------------------


class _Stream:
    """One captured connection being sent again: its file, its next chunk, what waits."""

    __slots__ = ("due_ns", "file", "length", "pending", "sock")

    def __init__(self, file: BinaryIO, address: tuple[str, int]) -> None:
        self.file = file
        self.sock = socket.create_connection(address, timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.pending = bytearray()
        self.due_ns = 0
        self.length = 0

    def advance(self) -> bool:
        """Read the next chunk's header; False at the end of the file."""
        header = self.file.read(_CHUNK.size)
        if len(header) < _CHUNK.size:
            return False
        offset, self.length = _CHUNK.unpack(header)
        self.due_ns = max(offset, 0)
        return True


def _replay_main(
    paths: list[str], address: tuple[str, int], conn: Connection, out_path: str
) -> None:
    """Send each captured connection's chunks at their times after the start (``t0``)."""
    try:
        with contextlib.ExitStack() as stack:
            # A small buffer each: a thousand files' first reads of 1 MiB would be a
            # gigabyte read at the start, and the replay late by seconds.
            streams = [
                _Stream(stack.enter_context(open(p, "rb", buffering=_READ_BUFFER)), address)
                for p in paths
            ]
            ready = [s.advance() for s in streams]  # each first chunk's header, read now
            conn.send("connected")
            figures = _play(streams, ready, conn.recv())
        Path(out_path).write_bytes(pickle.dumps(figures))
        conn.send("done")
    except BaseException as exc:
        conn.send(f"error: {exc!r}")
        raise


def _play(streams: list[_Stream], ready: list[bool], t0: float) -> dict[str, float]:
    """Every stream's chunks (``ready``: whether it has one, its header read), each sent
    once due (what the socket does not take waits in its ``pending``); then the rest,
    and the connections closed."""
    started = time.monotonic()
    t0_ns = int(t0 * 1e9)
    heap = [(s.due_ns, i) for i, s in enumerate(streams) if ready[i]]
    heapq.heapify(heap)
    selector = selectors.DefaultSelector()
    waiting: set[int] = set()
    max_lag_ns = max_pending = sends = 0
    clock = time.monotonic_ns

    def send(i: int) -> None:
        nonlocal max_pending, sends
        s = streams[i]
        try:
            n = s.sock.send(s.pending)
        except BlockingIOError:
            n = 0
        sends += 1
        if n:
            del s.pending[:n]
        max_pending = max(max_pending, len(s.pending))
        if s.pending and i not in waiting:
            waiting.add(i)
            selector.register(s.sock, selectors.EVENT_WRITE, i)
        elif not s.pending and i in waiting:
            waiting.discard(i)
            selector.unregister(s.sock)

    while heap:
        due, i = heap[0]
        now = clock() - t0_ns
        if due > now:
            timeout = min((due - now) / 1e9, 0.02)
            if waiting:
                for key, _ in selector.select(timeout):
                    send(key.data)
            else:
                time.sleep(timeout)
            continue
        heapq.heappop(heap)
        max_lag_ns = max(max_lag_ns, now - due)
        s = streams[i]
        s.pending += s.file.read(s.length)
        if s.advance():
            heapq.heappush(heap, (s.due_ns, i))
        send(i)
    for i, s in enumerate(streams):
        if i in waiting:
            selector.unregister(s.sock)
        s.sock.setblocking(True)
        s.sock.settimeout(300)
        s.sock.sendall(bytes(s.pending))
        s.sock.close()
    usage = os.times()
    return {
        "cpu_s": usage.user + usage.system,
        "max_lag_s": max_lag_ns / 1e9,
        "max_pending_bytes": max_pending,
        "sends": sends,
        "seconds": time.monotonic() - started,
    }


def run_replay(
    spec: LoadSpec,
    export_streams: str,
    *,
    logs_dir: Path,
    run_name: str,
    parts: int,
    relays: int,
    relay_procs: int = 2,
    procs: int = 2,
    do_validate: bool,
    quiet: bool = False,
    bounds: QueueBounds | None = None,
    capture_dir: Path | None = None,
) -> RunResult:
    """Capture the job's traffic through its relays in ``parts`` parts, then replay all of
    it at once into a real aggregator (see the module's docstring). With
    ``capture_dir``, the capture is kept there, or taken from there when it holds one of
    the same load (so that two aggregators can take the same traffic in turn)."""
    files = parse_export_streams(export_streams)
    saved = capture_dir / "capture.pkl" if capture_dir is not None else None
    if saved is not None and saved.exists():
        token, captured = pickle.loads(saved.read_bytes())
        if captured.spec != spec:
            raise RuntimeError(f"{capture_dir} holds the capture of another load: {captured.spec}")
        print(f"capture: the one in {capture_dir}", flush=True)
    else:
        token = f"scale-{os.getpid()}-{time.monotonic_ns()}"
        folder = capture_dir or Path(tempfile.mkdtemp(prefix="scale-capture-"))
        folder.mkdir(parents=True, exist_ok=True)
        captured = capture(spec, token, parts, relays, relay_procs, procs, folder)
        if saved is not None:
            saved.write_bytes(pickle.dumps((token, captured)))
    paths = sorted(str(p) for p in captured.folder.glob("*.bin"))
    print(
        f"captured: {captured.connections} relay connections, {captured.chunks:,} chunks, "
        f"{captured.bytes / 2**20:,.0f} MiB; per part, ranks {captured.gen_cpu_cores:.2f} "
        f"cores, relays {captured.relay_cpu_cores:.2f} cores; relays: {captured.relay_totals}",
        flush=True,
    )
    agg = start_aggregator(logs_dir, run_name, spec, export_streams, token, bounds)
    ctx = mp.get_context("fork")
    workdir = Path(tempfile.mkdtemp(prefix="scale-replay-"))
    players: list[Child] = []
    try:
        players = start_children(ctx, _replay_main, [
            ([paths[i] for i in range(a, b)], agg.address) for a, b in spans(0, len(paths), procs)
        ], workdir, "replay")  # fmt: skip
        wait_connected(players, "replay")
        time.sleep(0.5)
        idle = agg.sample_now()
        assert idle is not None
        agg.sample_every(0.25)
        t0 = time.monotonic() + 0.2
        for _, conn, _ in players:
            conn.send(t0)
        played = results_of(players, spec.seconds + 600, "replay")
        gen_done = time.monotonic()
        await_aggregator(agg, spec)
    except BaseException:
        kill_all(players, agg)
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if capture_dir is None:
            shutil.rmtree(captured.folder, ignore_errors=True)
    print(
        f"replay: {sum(r['sends'] for r in played):,} sends in {procs} processes, "
        f"{sum(r['cpu_s'] for r in played) / spec.seconds:.2f} cores, max lag "
        f"{max(r['max_lag_s'] for r in played) * 1000:.0f} ms, max unsent "
        f"{max(r['max_pending_bytes'] for r in played) / 1024:.0f} KiB per connection",
        flush=True,
    )
    # The generators' figures (lag, flushes) are the replay's: what the aggregator saw.
    results = [
        {**r, "max_lag_s": 0.0, "max_flush_s": 0.0, "max_pending_bytes": 0}
        for r in captured.results
    ]
    results[0]["max_lag_s"] = max(r["max_lag_s"] for r in played)
    results[0]["max_pending_bytes"] = max(r["max_pending_bytes"] for r in played)
    return finish_run(spec, agg, files, results, idle, t0, gen_done, do_validate, quiet)
