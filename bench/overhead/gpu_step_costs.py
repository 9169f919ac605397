"""What a traced GPU step spends, primitive by primitive (needs a CUDA device).

Run under ``traceml run`` on a GPU machine::

    python -m traceml_ai run bench/overhead/gpu_step_costs.py

Prints, for each ``torch.cuda`` call the step timer makes, its median cost in µs
and that cost as a share of one untraced step of the gpu-check's small MLP
(measured in the same process), then a profile of traced steps (the functions
with the largest own time). Without CUDA it prints one line and exits 3.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import traceml_ai as traceml
from traceml_ai.rank._runtime import sdk
from traceml_ai.rank.gpu import TorchCudaBackend


def _median_us(fn: Callable[[], object], n: int = 2000) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1000.0


def _model(device: str) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(256, 1)).to(device)
    x = torch.randn(64, 256, device=device)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), x


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).square().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _sync(cpu: bool) -> None:
    if not cpu:
        torch.cuda.synchronize()


def _primitives(step_us: float) -> None:
    """Each torch.cuda call the step timer makes, alone: median µs and share of a step."""
    backend = TorchCudaBackend()
    cuda = torch.cuda
    done0 = cuda.Event(enable_timing=True)
    done1 = cuda.Event(enable_timing=True)
    done0.record()
    done1.record()
    torch.cuda.synchronize()
    reused = cuda.Event(enable_timing=True)
    reused.record()
    stream = cuda.current_stream(0)
    costs: dict[str, Callable[[], object]] = {
        "torch.cuda.is_initialized()": cuda.is_initialized,
        "torch.cuda.current_stream(0)": lambda: cuda.current_stream(0),
        "torch.cuda.current_stream()": cuda.current_stream,
        "torch.cuda.is_current_stream_capturing()": cuda.is_current_stream_capturing,
        "Event(enable_timing=True)": lambda: cuda.Event(enable_timing=True),
        "Event() + record(stream)": lambda: cuda.Event(enable_timing=True).record(stream),
        "reused event .record(stream)": lambda: reused.record(stream),
        "reused event .record()": reused.record,
        "backend.record_event(0), new event": lambda: backend.record_event(0),
        "backend.record_event(0), reused": lambda: backend.release_events(
            0,
            [backend.record_event(0)],  # type: ignore[list-item]
        ),
        "completed event .query()": done1.query,
        "elapsed_time (completed)": lambda: done0.elapsed_time(done1),
        "reset_peak_memory_stats(0)": lambda: cuda.reset_peak_memory_stats(0),
        "torch._C._cuda_resetPeakMemoryStats(0)": lambda: torch._C._cuda_resetPeakMemoryStats(0),
        "memory_stats_as_nested_dict(0)": lambda: cuda.memory_stats_as_nested_dict(0),
        "torch._C._cuda_memoryStats(0)": lambda: torch._C._cuda_memoryStats(0),
        "torch.cuda.max_memory_allocated(0)": lambda: cuda.max_memory_allocated(0),
        "backend peaks (allocated + reserved)": lambda: (
            backend.max_memory_allocated(0),
            backend.max_memory_reserved(0),
        ),
        "torch.cuda.memory_allocated(0)": lambda: cuda.memory_allocated(0),
        "torch.cuda.current_device()": cuda.current_device,
    }
    print(f"gpu_step_costs: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"untraced step: {step_us:.1f} µs")
    for name, fn in costs.items():
        us = _median_us(fn)
        print(f"{name:45s} {us:8.2f} µs  {us / step_us:7.2%} of a step")


def main() -> int:
    # --cpu: the paired variants alone, on the CPU (to try the script without a GPU).
    cpu = "--cpu" in sys.argv[1:]
    if not cpu and not torch.cuda.is_available():
        print("gpu_step_costs: no CUDA device")
        return 3
    traceml.init()
    model, opt, x = _model("cpu" if cpu else "cuda")
    for _ in range(50):
        _step(model, opt, x)
    _sync(cpu)
    step_us = _median_us(lambda: _step(model, opt, x), 1000)
    if not cpu:
        _primitives(step_us)
    _sync(cpu)

    def paired(label: str, n: int = 1500) -> float:
        diffs = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            with traceml.trace_step(model):
                _step(model, opt, x)
            t1 = time.perf_counter_ns()
            _step(model, opt, x)
            t2 = time.perf_counter_ns()
            diffs.append((t1 - t0) - (t2 - t1))
        us = statistics.median(diffs) / 1000
        print(f"paired {label:40s} {us:8.1f} µs")
        return us

    # Where a traced step's cost goes: the same pairs with one part taken out, each
    # variant in three rounds taking turns (drift hits all alike), median of rounds.
    timer = sdk._runtime.timer  # type: ignore[union-attr]
    timed = timer._cuda
    record, release, get_stream = (
        timed.record_event,
        timed.release_events,
        timed._get_current_stream,
    )
    drain = timer._drain_ready

    def shipped() -> None:
        timer.reset_peak = True
        timed.record_event, timed.release_events = record, release
        timed._get_current_stream = get_stream
        timer._drain_ready = drain

    def no_peak() -> None:
        timer.reset_peak = False

    def no_events() -> None:
        timed.record_event = lambda index: None

    def no_reuse() -> None:
        timed.release_events = lambda index, events: None
        timed._get_current_stream = None

    def no_end_query() -> None:
        timer._drain_ready = lambda: None

    variants = {
        "as shipped": shipped,
        "new event per record, no stream cache": no_reuse,
        "without the per-step peak (reset + read)": no_peak,
        "without CUDA events": no_events,
        "events not queried at step end": no_end_query,
    }
    paired("warm-up", 300)
    rounds: dict[str, list[float]] = {label: [] for label in variants}
    for _ in range(3):
        for label, setup in variants.items():
            shipped()
            setup()
            rounds[label].append(paired(label, 500))
            shipped()
            with timer._pending_lock:
                timer._drain_ready()
    for label, figures in rounds.items():
        print(f"median of rounds: {label:40s} {statistics.median(figures):8.1f} µs")
    full = statistics.median(rounds["as shipped"])
    print(f"paired_overhead_us={full:.1f} step_us={step_us:.0f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(1000):
        with traceml.trace_step(model):
            _step(model, opt, x)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats("traceml", 25)
    print(out.getvalue())
    _sync(cpu)
    traceml.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
