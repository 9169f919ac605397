"""Throughput of the record codec (prints figures; never pass/fail).

Per stream: ``dumps_line`` and ``loads_line`` records/s, next to plain
``orjson.dumps`` / ``orjson.loads`` of the equivalent dict measured in the same run,
and their ratio; also the pure-Python ``dumps_line`` (what runs without the C
extension, or with TRACEML_PURE_PYTHON=1). The validator has its own bench,
``bench.validate``.

    python -m bench.records [--seconds 0.5]

The last line is machine-readable: ``dumps_ratio_step_time=<x>``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import orjson

from traceml_records import dumps_line, loads_line
from traceml_records._codec import SPEEDUPS, _py_dumps_line

_IDENT = (
    '"observed_timestamp_unix_ns":1793808200784977000,"rank":1,"global_rank":1,"local_rank":1,'
    '"world_size":2,"local_world_size":2,"node_rank":0,"timestamp_unix_ns":1793808199881904896,'
    '"seq":2'
)


def _phase(ms: float) -> str:
    return (
        f'{{"cpu":{{"cpu_ms":{ms},"duration_ms":{ms},"gpu_ms":null,"is_gpu":false,"n_calls":1}}}}'
    )


_EVENTS = ",".join(
    f'"_traceml_internal:{name}":{_phase(ms)}'
    for name, ms in [
        ("backward_time", 15.316009521484375),
        ("dataloader_next", 3.7009716033935547),
        ("forward_time", 8.20612907409668),
        ("optimizer_step", 0.5419254302978516),
        ("step_time", 27.03070640563965),
    ]
)

SAMPLE_LINES: dict[str, str] = {
    # The data line of the user guide (live-export.md).
    "step_time": f'{{"stream":"step_time","schema_version":1,{_IDENT},"step":1,"events":{{{_EVENTS}}}}}',
    "step_memory": f'{{"stream":"step_memory","schema_version":1,{_IDENT},"step":1,"device":"cuda:1",'
    '"peak_allocated_bytes":1234567890,"peak_reserved_bytes":2147483648}',
    "process": f'{{"stream":"process","schema_version":1,{_IDENT},"pid":4242,"cpu_percent":101.5,'
    '"cpu_logical_cores":32,"ram_used_bytes":4294967296,"ram_total_bytes":137438953472,'
    '"gpu_available":true,"gpu_count":8,"gpu_device_index":1,"gpu_memory_used_bytes":1073741824,'
    '"gpu_memory_reserved_bytes":2147483648,"gpu_memory_total_bytes":85899345920}',
    "system": '{"stream":"system","schema_version":1,"observed_timestamp_unix_ns":1,"rank":0,'
    '"global_rank":0,"local_rank":0,"world_size":2,"local_world_size":2,"node_rank":0,'
    '"timestamp_unix_ns":1,"seq":2,"cpu_percent":37.5,"ram_used_bytes":4294967296,'
    '"ram_total_bytes":137438953472,"gpu_available":true,"gpu_count":8}',
    "system_gpu": '{"stream":"system_gpu","schema_version":1,"observed_timestamp_unix_ns":1,'
    '"rank":0,"global_rank":0,"local_rank":0,"world_size":2,"local_world_size":2,"node_rank":0,'
    '"timestamp_unix_ns":1,"seq":2,"gpu_index":3,"utilization_percent":97.0,'
    '"memory_used_bytes":1073741824,"memory_total_bytes":85899345920,"temperature_c":61.0,'
    '"power_usage_w":412.5,"power_limit_w":700.0}',
    "runtime_environment": f'{{"stream":"runtime_environment","schema_version":1,{_IDENT},'
    '"pid":4242,"topology":"single_node_multi_process","distributed_initialized":true,'
    '"distributed_backend":"nccl","training_strategy":"ddp","strategy_source":"runtime_model",'
    '"strategy_confidence":"high","torch_version":"2.13.0","python_version":"3.11.7"}',
    "stdout_stderr": '{"stream":"stdout_stderr","schema_version":1,"observed_timestamp_unix_ns":1,'
    '"rank":0,"timestamp_unix_ns":1,"seq":0,"source":"stdout","line":"epoch 1: loss 0.25"}',
    "closing": '{"stream":"step_time","closing":true,"schema_version":1,"written_records":8,'
    '"dropped_batches":0}',
}


def rate(fn: Callable[[], Any], seconds: float) -> float:
    """Calls per second of ``fn`` (best of three timed runs)."""
    n = 1
    while True:  # calibrate so that one run takes about ``seconds / 3``
        start = time.perf_counter()
        for _ in range(n):
            fn()
        took = time.perf_counter() - start
        if took > seconds / 30:
            break
        n *= 4
    n = max(1, int(n * (seconds / 3) / took))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - start)
    return n / best


def bench_codec(seconds: float) -> dict[str, float]:
    """Prints one row per stream; returns dumps_line/orjson.dumps ratios."""
    ratios = {}
    print(f"{'stream':<20} {'dumps_line/s':>13} {'orjson.dumps/s':>15} {'ratio':>6}"
          f" {'pure Python/s':>14} {'loads_line/s':>13} {'orjson.loads/s':>15} {'ratio':>6}")  # fmt: skip
    for name, text in SAMPLE_LINES.items():
        data = text.encode() + b"\n"
        record = loads_line(data)
        assert dumps_line(record) == data, name  # the sample is canonical
        obj = orjson.loads(data)
        option = orjson.OPT_APPEND_NEWLINE
        dumps = rate(lambda: dumps_line(record), seconds)  # noqa: B023
        plain_dumps = rate(lambda: orjson.dumps(obj, option=option), seconds)  # noqa: B023
        py_dumps = rate(lambda: _py_dumps_line(record), seconds)  # noqa: B023
        loads = rate(lambda: loads_line(data), seconds)  # noqa: B023
        plain_loads = rate(lambda: orjson.loads(data), seconds)  # noqa: B023
        ratios[name] = dumps / plain_dumps
        print(
            f"{name:<20} {dumps:>13,.0f} {plain_dumps:>15,.0f} {dumps / plain_dumps:>6.2f}"
            f" {py_dumps:>14,.0f} {loads:>13,.0f} {plain_loads:>15,.0f} {loads / plain_loads:>6.2f}"
        )
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.6, help="time per measurement")
    args = parser.parse_args()
    print(f"dumps_line: {'C encoder (traceml_records._speedups)' if SPEEDUPS else 'pure Python'}")
    ratios = bench_codec(args.seconds)
    print(f"dumps_ratio_step_time={ratios['step_time']:.3f}")


if __name__ == "__main__":
    main()
