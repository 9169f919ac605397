"""What each of the step timer's entry points costs when the caches do not hold it.

    python -m bench.overhead.timer_cold [--evict-kib 1024] [--calls 3000] [--steps 4000]

Inside a framework's training loop, torch's and the framework's work between two of
TraceML's calls evicts TraceML's objects from the caches, so a call pays for every
cache line it touches rather than for its instructions. This bench times each entry
point of a ``StepTimer`` off CUDA (begin, end, open, close, restart, add_host, in the
order of a Lightning update: the DataLoader add, begin, forward, backward with the
bracket's forward close and optimizer restart, the optimizer phase, end) alone, right
after copying a buffer of ``--evict-kib`` KiB (1 MiB evicts L2), and the same calls
with nothing evicted. Baseline, measured in the same run: an empty call timed the
same way (the floor of the measurement).

Second part: the sender thread's work per step, in a tight loop: ``--steps`` deferred
steps built at once (``StepTimer.build_ended``) through the real ``StepRecorder`` and
an unstarted ``RankSender`` (its queues only); then with a sink that takes the items
and does nothing; then the C encoder of the two items alone. Baseline:
``orjson.dumps`` of the step_time item as a dict, per step.

Third part: the sender's flush, per step: a flush's worth of steps (``--flush-steps``,
~a flush interval of a small model's updates) encoded by the builder and waiting in
a ``RankSender`` connected to a socket on loopback that a thread drains, taken off the
queues, framed and sent (``RankSender._flush``), after a 1 MiB copy (the training
loop has run between two flushes). Same baseline.

Last line: ``cold_begin_ns=<x> cold_end_ns=<y> cold_op_ns=<z> cold_floor_ns=<f>
sender_step_ns=<s> sender_step_ratio=<s / orjson baseline> flush_step_ns=<f>
flush_step_ratio=<f / orjson baseline>`` (``cold_op_ns``: the median of the opens,
closes, restart and add). Figures only; no pass/fail.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence

import orjson
import torch

from traceml_ai.rank._patches import phase_hooks
from traceml_ai.rank._timing import event_names, step_timer
from traceml_ai.rank._timing.step_recorder import StepHistory, StepRecorder
from traceml_ai.rank.sink import RecordingSink
from traceml_ai.testing import FakeCuda
from traceml_ai.transport.sender import RankSender

FORWARD, BACKWARD = event_names.FORWARD, event_names.BACKWARD
OPTIMIZER, DATALOADER = event_names.OPTIMIZER_STEP, event_names.DATALOADER_NEXT


def _timer() -> step_timer.StepTimer:
    timer = step_timer.StepTimer(RecordingSink(), FakeCuda(available=False), _quiet, _quiet)
    timer.defer = True
    timer.bracket = True
    return timer


def _quiet(_: object) -> None:
    pass


def _update(
    timer: step_timer.StepTimer, model: torch.nn.Module
) -> list[tuple[str, Callable[[], None]]]:
    """One Lightning update's calls, by name, in order."""
    return [
        ("add_host", lambda: timer.add_host(DATALOADER, 1_000)),
        ("begin", lambda: timer.begin(model)),
        ("open", lambda: timer.open(timer.fwd)),  # the batch starts
        ("open", lambda: timer.open(timer.opt)),  # the optimizer's pre-hook
        ("close", lambda: timer.close(timer.fwd, FORWARD)),  # backward begins
        ("open", lambda: timer.open(timer.bwd)),
        ("close", lambda: timer.close(timer.bwd, BACKWARD)),
        ("restart", lambda: timer.restart(timer.opt)),  # backward ended
        ("close", lambda: timer.close(timer.opt, OPTIMIZER)),  # the post-hook
        ("end", timer.end),
        ("floor", lambda: None),
    ]


def entry_points(evict_kib: int, calls: int) -> dict[str, float]:
    """Median ns per call of each kind (opens, closes, ... pooled), ``evict_kib`` KiB
    copied before each call (0: nothing evicted)."""
    timer = _timer()
    phase_hooks.activate(timer)
    try:
        model = torch.nn.Linear(4, 4)
        source, target = bytearray(evict_kib << 10), bytearray(evict_kib << 10)
        update = _update(timer, model)
        clock = time.perf_counter_ns
        times: dict[str, list[int]] = {name: [] for name, _ in update}
        for i in range(calls):
            for name, call in update:
                if evict_kib:
                    target[:] = source
                t0 = clock()
                call()
                times[name].append(clock() - t0)
            if i % 256 == 255:
                timer.build_ended()
        skip = calls // 10
        return {name: statistics.median(v[skip * len(v) // calls :]) for name, v in times.items()}
    finally:
        phase_hooks.activate(None)


class _NoSink:
    def put_encoded_many(self, stream: str, items: Sequence[bytes]) -> None:
        pass


def _ended_steps(steps: int, encoded_sink: object) -> step_timer.StepTimer:
    timer = _timer()
    timer.encoded_sink = encoded_sink  # type: ignore[assignment]
    timer._max_ended = timer._wake_at = steps + 1
    model = torch.nn.Linear(4, 4)
    phase_hooks.activate(timer)
    try:
        for _ in range(steps):
            for _, call in _update(timer, model)[:-1]:
                call()
    finally:
        phase_hooks.activate(None)
    return timer


def _orjson_baseline(acc: dict[str, object], steps: int, clock: Callable[[], int]) -> float:
    """ns per ``orjson.dumps`` of a step_time item with ``acc``'s phases, as a dict."""
    item = {
        "timestamp_unix_ns": 1_700_000_000_000_000_000, "seq": 1, "step": 1,
        "events": {name: {"cpu": {"cpu_ms": 0.123456, "duration_ms": 0.123456,
                                  "gpu_ms": None, "is_gpu": False, "n_calls": 1}}
                   for name in sorted(acc)},
    }  # fmt: skip
    t0 = clock()
    for _ in range(steps):
        orjson.dumps(item)
    return (clock() - t0) / steps


def sender_per_step(steps: int, rounds: int = 5) -> dict[str, float]:
    """ns per step on the sender's thread: built through the recorder and a sender's
    queues, built into a no-op sink, the encoder alone, and the orjson baseline."""
    out: dict[str, list[float]] = {"recorder": [], "no_sink": [], "encoder": [], "orjson": []}
    clock = time.perf_counter_ns
    for _ in range(rounds):
        queued = RankSender(("127.0.0.1", 9), "t" * 32, {"rank": 0},
                            max_pending_items=4 * steps)  # fmt: skip
        recorder = StepRecorder(queued, history=StepHistory(keep_events=False), encoded=queued)
        for kind, sink in (("recorder", recorder), ("no_sink", _NoSink())):
            timer = _ended_steps(steps, sink)
            t0 = clock()
            timer.build_ended()
            out[kind].append((clock() - t0) / steps)
        acc = timer._spare_acc[0]
        encode = step_timer._encode_host_step
        if encode is not None:
            t0 = clock()
            for i in range(steps):
                for phase in acc.values():
                    phase.n_calls = 1
                encode(acc, i, 1_700_000_000_000_000_000, "cpu", i, i)
            out["encoder"].append((clock() - t0) / steps)
        out["orjson"].append(_orjson_baseline(acc, steps, clock))
    return {k: statistics.median(v) if v else float("nan") for k, v in out.items()}


def _draining_server() -> tuple[str, int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def drain() -> None:
        conn, _ = server.accept()
        while conn.recv(1 << 20):
            pass

    threading.Thread(target=drain, daemon=True).start()
    host, port = server.getsockname()
    return host, port


def flush_per_step(steps: int, rounds: int = 60) -> dict[str, float]:
    """ns per step of the sender's flush of ``steps`` built steps, and the baseline."""
    sender = RankSender(_draining_server(), "t" * 32, {"rank": 0})
    sender._connect(1.0)
    recorder = StepRecorder(sender, history=StepHistory(keep_events=False), encoded=sender)
    evict = bytearray(1 << 20)
    flush: list[float] = []
    base: list[float] = []
    clock = time.thread_time_ns
    for _ in range(rounds):
        timer = _ended_steps(steps, recorder)
        timer.build_ended()
        evict[:] = bytes(len(evict))
        t0 = clock()
        sender._flush(None)
        flush.append((clock() - t0) / steps)
        if sender.pending_items or not sender.connected:
            raise RuntimeError("the flush did not send every item")
        base.append(_orjson_baseline(next(iter(timer._spare_acc), {}), steps, clock))
    sender.close(0.5)
    skip = rounds // 10
    return {"flush": statistics.median(flush[skip:]), "orjson": statistics.median(base[skip:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evict-kib", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--flush-steps", type=int, default=180)
    args = parser.parse_args()
    torch.set_num_threads(1)
    figures = {
        "warm": entry_points(0, args.calls),
        "cold": entry_points(args.evict_kib, args.calls),
    }
    names = list(figures["cold"])
    print("ns per call   " + "".join(f"{n:>10s}" for n in names))
    for kind, by_name in figures.items():
        print(f"{kind:14s}" + "".join(f"{by_name[n]:10.0f}" for n in names))
    cold = figures["cold"]
    floor = cold["floor"]
    ops = statistics.median([cold[n] for n in ("open", "close", "restart", "add_host")])
    print(f"cold, over the floor: begin {cold['begin'] - floor:.0f} ns, end "
          f"{cold['end'] - floor:.0f} ns, other calls {ops - floor:.0f} ns")  # fmt: skip
    sender = sender_per_step(args.steps)
    print(
        f"sender's thread per step: {sender['recorder']:.0f} ns through the recorder and "
        f"a sender's queues, {sender['no_sink']:.0f} ns into a no-op sink, the encoder "
        f"alone {sender['encoder']:.0f} ns; baseline orjson.dumps of the step_time item "
        f"{sender['orjson']:.0f} ns"
    )
    flush = flush_per_step(args.flush_steps)
    print(
        f"sender's flush per step ({args.flush_steps} steps a flush, sent on loopback): "
        f"{flush['flush']:.0f} ns; baseline orjson.dumps of the step_time item "
        f"{flush['orjson']:.0f} ns"
    )
    print(
        f"cold_begin_ns={cold['begin']:.0f} cold_end_ns={cold['end']:.0f} "
        f"cold_op_ns={ops:.0f} cold_floor_ns={floor:.0f} "
        f"sender_step_ns={sender['recorder']:.0f} "
        f"sender_step_ratio={sender['recorder'] / sender['orjson']:.2f} "
        f"flush_step_ns={flush['flush']:.0f} "
        f"flush_step_ratio={flush['flush'] / flush['orjson']:.2f}"
    )


if __name__ == "__main__":
    main()
