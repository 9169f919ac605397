"""Workloads of the GPU check, each run under ``traceml run`` by gpu_check.driver.

    traceml run --exporter jsonl --export-streams all ... scenario.py NAME RESULT_JSON [--cpu]

Each scenario trains or runs GPU work inside ``trace_step``/``trace_phase`` and writes
one JSON object to RESULT_JSON with what it measured itself (manual CUDA event pairs
around the same work, torch's memory figures, host times), for the driver to compare
with the export files. Self-contained: torch, traceml_ai and the standard library.

``--cpu`` (development only) runs the same code on the CPU, host timers standing in for
CUDA events, to prove the harness without a GPU; its figures mean nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import traceml_ai as traceml

Result = dict[str, Any]


class _HostEvent:
    """A stand-in for ``torch.cuda.Event`` on CPU (``--cpu``): host time at creation."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.t - self.t) * 1e3


class Dev:
    """The device a scenario runs on, and the few CUDA calls it needs, CPU stand-ins included."""

    def __init__(self, cpu: bool, index: int = 0) -> None:
        self.cuda = not cpu
        self.index = index
        self.device = torch.device("cuda", index) if self.cuda else torch.device("cpu")
        self.key = f"cuda:{index}" if self.cuda else "cpu"
        self.cycles_per_ms = 1.0e6
        if self.cuda:
            torch.cuda.set_device(self.device)
            torch.empty(1, device=self.device)  # initialize CUDA before the first step

    def event(self) -> Any:
        """An event recorded now on the current stream."""
        if not self.cuda:
            return _HostEvent()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def calibrate(self) -> None:
        """Cycles of ``torch.cuda._sleep`` per millisecond, measured now.

        Measured twice, the second time kept: the first spin brings the clocks up from
        idle. Judgements use measured durations, never this estimate.
        """
        if not self.cuda:
            return
        cycles = 200_000_000
        for _ in range(2):
            e0 = self.event()
            torch.cuda._sleep(cycles)
            e1 = self.event()
            self.sync()
            self.cycles_per_ms = cycles / max(1e-3, e0.elapsed_time(e1))

    def gpu_sleep_ms(self, ms: float) -> None:
        """Queue about ``ms`` of GPU work (``torch.cuda._sleep``); CPU: sleep a twentieth."""
        if self.cuda:
            torch.cuda._sleep(int(ms * self.cycles_per_ms))
        else:
            time.sleep(ms / 20_000)

    def stream(self) -> Any:
        return torch.cuda.Stream(device=self.device) if self.cuda else None

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def wait(self, waiter: Any, waited: Any) -> None:
        """``waiter`` waits for ``waited`` (None: the current stream)."""
        if self.cuda:
            w = waiter if waiter is not None else torch.cuda.current_stream(self.device)
            d = waited if waited is not None else torch.cuda.current_stream(self.device)
            w.wait_stream(d)

    def mem(self, name: str) -> int | None:
        """``torch.cuda.<name>(device)`` (memory_allocated, max_memory_reserved, ...)."""
        return int(getattr(torch.cuda, name)(self.device)) if self.cuda else None


def mlp(width: int, layers: int) -> nn.Module:
    parts: list[nn.Module] = []
    for _ in range(layers):
        parts += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*parts, nn.Linear(width, 1))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()
    opt.step()


def _small(dev: Dev) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    model = mlp(256, 2).to(dev.device)
    return (
        model,
        torch.optim.SGD(model.parameters(), lr=1e-3),
        torch.randn(64, 256, device=dev.device),
    )


def _ms(pairs: dict[int, tuple[Any, Any]]) -> dict[str, float]:
    return {str(step): float(a.elapsed_time(b)) for step, (a, b) in pairs.items()}


# -- scenarios ------------------------------------------------------------------------------


def phase_agreement(dev: Dev) -> Result:
    """Forward, backward and a user phase of ms-scale GPU work, each inside a manual pair."""
    width = 4096 if dev.cuda else 64
    model = mlp(width, 4).to(dev.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(2048 if dev.cuda else 16, width, device=dev.device)
    a = torch.randn(width, width, device=dev.device)
    manual: dict[str, dict[int, tuple[Any, Any]]] = {"forward": {}, "backward": {}, "work": {}}
    steps = 12
    for step in range(1, steps + 1):
        with traceml.trace_step(model):
            opt.zero_grad(set_to_none=True)
            e0 = dev.event()
            out = model(x)
            e1 = dev.event()
            loss = out.float().pow(2).mean()
            e2 = dev.event()
            loss.backward()
            e3 = dev.event()
            opt.step()
            with traceml.trace_phase("work"):
                e4 = dev.event()
                b = a
                for _ in range(3):
                    b = b @ a
                e5 = dev.event()
        manual["forward"][step] = (e0, e1)
        manual["backward"][step] = (e2, e3)
        manual["work"][step] = (e4, e5)
    dev.sync()
    return {"steps": steps, "device": dev.key, "manual": {k: _ms(v) for k, v in manual.items()}}


def exit_no_wait(dev: Dev) -> Result:
    """A phase with ~1 s of GPU work (``torch.cuda._sleep``): phase and step exits do not wait."""
    dev.calibrate()
    model, opt, x = _small(dev)
    steps = 3
    step_exit: list[float] = []
    phase_exit: list[float] = []
    pairs: dict[int, tuple[Any, Any]] = {}
    loop_t0 = time.perf_counter()
    for step in range(1, steps + 1):
        with traceml.trace_step(model):
            _train_step(model, opt, x)
            with traceml.trace_phase("sleep"):
                e0 = dev.event()
                dev.gpu_sleep_ms(1000)
                e1 = dev.event()
                t0 = time.perf_counter()
            t1 = time.perf_counter()
        t2 = time.perf_counter()
        phase_exit.append((t1 - t0) * 1e3)
        step_exit.append((t2 - t1) * 1e3)
        pairs[step] = (e0, e1)
    t3 = time.perf_counter()
    dev.sync()
    return {
        "steps": steps,
        "device": dev.key,
        "step_exit_ms": step_exit,
        "phase_exit_ms": phase_exit,
        "host_loop_s": t3 - loop_t0,
        "sync_wait_s": time.perf_counter() - t3,
        "cycles_per_ms": dev.cycles_per_ms,
        "manual": {"sleep": _ms(pairs)},
    }


def step_memory_peaks(dev: Dev) -> Result:
    """Odd steps allocate 1 GiB, even steps 16 MiB: per-step peaks must alternate."""
    model, opt, x = _small(dev)
    big = (1 << 30) if dev.cuda else (1 << 24)
    small = 16 << 20 if dev.cuda else 1 << 16
    steps = 8
    peaks: dict[str, list[int | None]] = {}
    for step in range(1, steps + 1):
        with traceml.trace_step(model):
            _train_step(model, opt, x)
            t = torch.empty(big if step % 2 else small, dtype=torch.uint8, device=dev.device)
            t.fill_(1)
            del t
        peaks[str(step)] = [dev.mem("max_memory_allocated"), dev.mem("max_memory_reserved")]
    dev.sync()
    return {
        "steps": steps,
        "device": dev.key,
        "big_steps": [s for s in range(1, steps + 1) if s % 2],
        "big_bytes": big,
        "torch_peaks": peaks,
    }


def process_gpu_fields(dev: Dev) -> Result:
    """Steady memory for two windows (a second GPU's if there is one): samples equal torch's."""
    model, opt, x = _small(dev)
    with traceml.trace_step(model):
        _train_step(model, opt, x)
    windows: list[dict[str, Any]] = []
    keep: list[torch.Tensor] = []
    for extra in (0, 256 << 20):
        if extra:
            keep.append(torch.empty(extra, dtype=torch.uint8, device=dev.device))
        dev.sync()
        t0 = time.time_ns()
        alloc, reserved = dev.mem("memory_allocated"), dev.mem("memory_reserved")
        time.sleep(1.2)
        steady = (alloc, reserved) == (dev.mem("memory_allocated"), dev.mem("memory_reserved"))
        windows.append(
            {
                "t0_ns": t0,
                "t1_ns": time.time_ns(),
                "allocated": alloc,
                "reserved": reserved,
                "steady": steady,
            }
        )
    return {
        "device": dev.key,
        "device_index": dev.index,
        "device_count": torch.cuda.device_count() if dev.cuda else 0,
        "total_memory": torch.cuda.get_device_properties(dev.index).total_memory if dev.cuda else 0,
        "windows": windows,
    }


def side_stream(dev: Dev) -> Result:
    """GPU work on a side stream: a phase the main stream waits in, and one opened on the side stream."""
    model, opt, x = _small(dev)
    n = 4096 if dev.cuda else 64
    a = torch.randn(n, n, device=dev.device)
    side = dev.stream()
    manual: dict[str, dict[int, tuple[Any, Any]]] = {"side_wait": {}, "side_inside": {}}
    steps = 8
    for step in range(1, steps + 1):
        with traceml.trace_step(model):
            _train_step(model, opt, x)
            with traceml.trace_phase("side_wait"):
                m0 = dev.event()
                dev.wait(side, None)
                with dev.on(side):
                    b = a
                    for _ in range(3):
                        b = b @ a
                dev.wait(None, side)
                m1 = dev.event()
            with dev.on(side), traceml.trace_phase("side_inside"):
                s0 = dev.event()
                b = a
                for _ in range(3):
                    b = b @ a
                s1 = dev.event()
            dev.wait(None, side)
        manual["side_wait"][step] = (m0, m1)
        manual["side_inside"][step] = (s0, s1)
    dev.sync()
    return {"steps": steps, "device": dev.key, "manual": {k: _ms(v) for k, v in manual.items()}}


def amp_skipped_steps(dev: Dev) -> Result:
    """Autocast and GradScaler; steps 3 and 6 get inf gradients, so the scaler skips them."""
    width = 1024 if dev.cuda else 64
    model = mlp(width, 2).to(dev.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(256, width, device=dev.device)
    scaler = torch.amp.GradScaler("cuda" if dev.cuda else "cpu", init_scale=1024.0)
    dtype = torch.float16 if dev.cuda else torch.bfloat16
    steps = 8
    poisoned = {3, 6}
    skipped: list[int] = []
    for step in range(1, steps + 1):
        scale = scaler.get_scale()
        with traceml.trace_step(model):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type=dev.device.type, dtype=dtype):
                loss = model(x).float().pow(2).mean()
            if step in poisoned:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if scaler.get_scale() < scale:
            skipped.append(step)
    dev.sync()
    return {"steps": steps, "device": dev.key, "poisoned": sorted(poisoned), "skipped": skipped}


class _ByHand:
    """What measuring a step by hand costs: the same CUDA calls TraceML makes, no more.

    Event pairs around H2D, forward, backward and the optimizer (double-buffered, read
    one step later once completed: a careful user's loop never synchronizes), the peak
    reset and the allocator statistics read. On CPU (``--cpu``) only the step runs.
    """

    def __init__(self, dev: Dev) -> None:
        self.dev = dev
        if dev.cuda:
            make = lambda: [torch.cuda.Event(enable_timing=True) for _ in range(8)]  # noqa: E731
            self.sets = [make(), make()]
        self.turn = 0
        self.steps = 0
        self.read_ms = 0.0

    def step(self, model: nn.Module, opt: torch.optim.Optimizer, xb: torch.Tensor) -> None:
        if not self.dev.cuda:
            _train_step(model, opt, xb.to(self.dev.device))
            return
        ev = self.sets[self.turn]
        self.turn ^= 1
        torch.cuda.reset_peak_memory_stats(self.dev.device)
        ev[0].record()
        xb = xb.to(self.dev.device, non_blocking=True)
        ev[1].record()
        opt.zero_grad(set_to_none=True)
        ev[2].record()
        out = model(xb)
        ev[3].record()
        loss = out.float().pow(2).mean()
        ev[4].record()
        loss.backward()
        ev[5].record()
        ev[6].record()
        opt.step()
        ev[7].record()
        torch.cuda.memory_stats_as_nested_dict(self.dev.device)
        last = self.sets[self.turn]  # the step before: read once it completed
        self.steps += 1
        for i in range(0, 8 if self.steps > 1 else 0, 2):
            if last[i + 1].query() and last[i].query():
                self.read_ms += last[i].elapsed_time(last[i + 1])


def paired_overhead(dev: Dev) -> Result:
    """Traced, by-hand and untraced GPU steps in turn in one process, with a DataLoader fetch.

    Each traced or by-hand step is followed by three untraced ones, so the judge takes
    the same cycle figure for both (bench/overhead/paired.py): TraceML's cost, and the cost of
    the same CUDA calls made by hand, measured alike on the same machine at the same
    time.
    """
    from torch.utils.data import DataLoader, TensorDataset

    model, opt, _ = _small(dev)
    # 63 batches an epoch: an epoch's slow first batch is not always the same kind.
    data = TensorDataset(torch.randn(4032, 256), torch.randn(4032, 1))
    loader = DataLoader(data, batch_size=64, shuffle=True, drop_last=True)

    def batches() -> Iterator[Any]:
        while True:
            yield from loader

    it = batches()
    untraced = contextlib.nullcontext()
    by_hand = _ByHand(dev)
    cycle = ("traced", "plain", "plain", "plain", "by_hand", "plain", "plain", "plain")
    kinds: list[str] = []
    durations: list[float] = []
    seconds = 6.0 if dev.cuda else 3.0
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        kind = cycle[i % len(cycle)]
        t0 = time.perf_counter()
        xb, _yb = next(it)
        if kind == "by_hand":
            by_hand.step(model, opt, xb)
        else:
            with traceml.trace_step(model) if kind == "traced" else untraced:
                xb = xb.to(dev.device, non_blocking=True)
                _train_step(model, opt, xb)
        durations.append(time.perf_counter() - t0)
        kinds.append(kind)
        i += 1
    dev.sync()
    return {
        "device": dev.key,
        "traced": [k == "traced" for k in kinds],
        "by_hand": [k == "by_hand" for k in kinds],
        "durations": durations,
    }


def bounded_shutdown(dev: Dev) -> Result:
    """Shutdown right after a step that queued ~24 s of GPU work: it must not wait for it."""
    dev.calibrate()
    model, opt, x = _small(dev)
    for _ in range(2):
        with traceml.trace_step(model):
            _train_step(model, opt, x)
    dev.sync()
    target_s = 24.0
    with traceml.trace_step(model):
        _train_step(model, opt, x)
        with traceml.trace_phase("queued"):
            t_launch = time.perf_counter()
            dev.gpu_sleep_ms(target_s * 1000)
    t0 = time.perf_counter()
    traceml.shutdown()
    shutdown_s = time.perf_counter() - t0
    # How long the queued work really took (the clock estimate may be off): wait for it.
    dev.sync()
    queued_s = time.perf_counter() - t_launch if dev.cuda else target_s
    return {"device": dev.key, "queued_s": queued_s, "shutdown_s": shutdown_s, "steps": 3}


def _compile(dev: Dev, **options: Any) -> Result:
    """``model.compile(**options)`` under ``trace_step(model)``: trains, no graph break."""
    from torch._dynamo.utils import counters

    model, opt, x = _small(dev)
    model.compile(**options)
    steps = 8
    done = 0
    error = None
    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", None)
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            if mark is not None and options.get("mode") == "reduce-overhead":
                mark()
            with traceml.trace_step(model):
                _train_step(model, opt, x)
            done += 1
        dev.sync()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {
        "device": dev.key,
        "options": options,
        "steps": steps,
        "steps_done": done,
        "error": error,
        "seconds": time.perf_counter() - t0,
        "graph_breaks": sum(counters["graph_break"].values()),
        "graph_break_reasons": sorted({" ".join(r.split())[:200] for r in counters["graph_break"]})[
            :5
        ],
    }


def compile_default(dev: Dev) -> Result:
    return _compile(dev)


def compile_reduce_overhead(dev: Dev) -> Result:
    return _compile(dev, mode="reduce-overhead")


def compile_fullgraph(dev: Dev) -> Result:
    return _compile(dev, fullgraph=True)


def collectives_nccl(dev: Dev) -> Result:
    """A world of one rank on NCCL (gloo with ``--cpu``): DDP's buckets, a synchronous
    all_reduce and an asynchronous all_gather_into_tensor each step. The collective
    timing must read each Work's duration without synchronizing the device: every
    synchronize TraceML could call is counted while the steps run."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "nccl" if dev.cuda else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    model = nn.parallel.DistributedDataParallel(
        mlp(256, 3).to(dev.device), device_ids=[dev.index] if dev.cuda else None
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device=dev.device)
    syncs = {"n": 0}
    patched: list[tuple[Any, str, Any]] = []
    if dev.cuda:
        for owner, attr in (
            (torch.cuda, "synchronize"),
            (torch.cuda.Event, "synchronize"),
            (torch.cuda.Stream, "synchronize"),
        ):
            original = getattr(owner, attr)

            def counted(*a: Any, _o: Any = original, **k: Any) -> Any:
                syncs["n"] += 1
                return _o(*a, **k)

            patched.append((owner, attr, original))
            setattr(owner, attr, counted)
    steps = 6
    t = torch.ones(1 << 16, device=dev.device)
    out = torch.empty(1 << 16, device=dev.device)
    try:
        for _ in range(steps):
            with traceml.trace_step(model):
                _train_step(model, opt, x)
                dist.all_reduce(t)
                work = dist.all_gather_into_tensor(out, t, async_op=True)
                assert work is not None
                work.wait()
    finally:
        for owner, attr, original in patched:
            setattr(owner, attr, original)
    dev.sync()
    traceml.shutdown()  # sends the steps whose Works completed
    dist.destroy_process_group()
    return {
        "device": dev.key,
        "backend": backend,
        "steps": steps,
        "syncs_during_steps": syncs["n"],
        "nccl_timing_env": os.environ.get("TORCH_NCCL_ENABLE_TIMING"),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


SCENARIOS: dict[str, Callable[[Dev], Result]] = {
    f.__name__: f
    for f in (
        phase_agreement,
        exit_no_wait,
        step_memory_peaks,
        process_gpu_fields,
        side_stream,
        amp_skipped_steps,
        paired_overhead,
        bounded_shutdown,
        collectives_nccl,
        compile_default,
        compile_reduce_overhead,
        compile_fullgraph,
    )
}


def compiled_extensions() -> dict[str, str]:
    """TraceML's C extensions this process loaded, and the file of each: the driver
    checks the lane ran the code it meant to (the build's, or none in pure Python)."""
    return {
        name: str(getattr(module, "__file__", ""))
        for name, module in list(sys.modules.items())
        if name.startswith(("traceml_ai.", "traceml_records."))
        and str(getattr(module, "__file__", "")).endswith((".so", ".pyd"))
    }


def main(argv: list[str]) -> int:
    name, result_path = argv[0], argv[1]
    cpu = "--cpu" in argv[2:]
    traceml.init()
    index = 0
    if name == "process_gpu_fields" and not cpu and torch.cuda.device_count() > 1:
        index = 1  # the rank's own GPU, not the sampler thread's current device (0)
    dev = Dev(cpu, index)
    result = SCENARIOS[name](dev)
    result["pid"] = os.getpid()
    result["extensions"] = compiled_extensions()
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    traceml.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
