"""Good wire items of every file stream, and malformed ones the builder must skip.

Shared by the builder's record-mode tests and its line-mode parity tests, which must
see the very same cases.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

from tests.custom_exporters import (
    gpu_entry,
    phase,
    process_item,
    runtime_item,
    stdout_item,
    step_memory_item,
    step_time_item,
    system_item,
)
from traceml_ai.export._builder import MAX_EVENT_ENTRIES, MAX_STRING_BYTES

ITEM_MAKERS: dict[str, Callable[[int], dict[str, Any]]] = {
    "step_time": lambda i: step_time_item(seq=i, step=i + 1),
    "step_memory": lambda i: step_memory_item(seq=i, step=i + 1, device="cuda:1"),
    "process": lambda i: process_item(seq=i, gpu=True),
    "system": lambda i: system_item(seq=i),
    "runtime_environment": lambda i: runtime_item(seq=i),
    "stdout_stderr": lambda i: stdout_item(seq=i),
}


def mutate(stream: str, fn: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    item = copy.deepcopy(ITEM_MAKERS[stream](1))
    fn(item)
    return item


def mutate_st(fn: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    return mutate("step_time", fn)


def set_timing(item: dict[str, Any], **changes: Any) -> None:
    item["events"]["my_phase"]["cpu"].update(changes)


BIG = "x" * (MAX_STRING_BYTES + 1)

MALFORMED: list[tuple[str, str, Any]] = [
    # step_time
    ("step_time", "missing step", mutate_st(lambda i: i.pop("step"))),
    ("step_time", "extra key", mutate_st(lambda i: i.update(extra=1))),
    ("step_time", "step is a string", mutate_st(lambda i: i.update(step="5"))),
    ("step_time", "step is a float", mutate_st(lambda i: i.update(step=1.5))),
    ("step_time", "step is a bool", mutate_st(lambda i: i.update(step=True))),
    ("step_time", "step 0", mutate_st(lambda i: i.update(step=0))),
    ("step_time", "negative seq", mutate_st(lambda i: i.update(seq=-1))),
    ("step_time", "seq beyond int64", mutate_st(lambda i: i.update(seq=2**63))),
    ("step_time", "empty events", mutate_st(lambda i: i.update(events={}))),
    ("step_time", "events not a map", mutate_st(lambda i: i.update(events=[1]))),
    ("step_time", "empty device map", mutate_st(lambda i: i["events"].update(other={}))),
    (
        "step_time",
        "bad device key",
        mutate_st(lambda i: i["events"].update(other={"GPU0": phase()})),
    ),
    (
        "step_time",
        "huge device key",
        mutate_st(lambda i: i["events"].update(other={"a" * 70000: phase()})),
    ),
    (
        "step_time",
        "empty event name",
        mutate_st(lambda i: i["events"].update({"": {"cpu": phase()}})),
    ),
    (
        "step_time",
        "huge event name",
        mutate_st(lambda i: i["events"].update({BIG: {"cpu": phase()}})),
    ),
    (
        "step_time",
        "unknown reserved name",
        mutate_st(lambda i: i["events"].update({"_traceml_internal:nope": {"cpu": phase()}})),
    ),
    (
        "step_time",
        "no step_time event",
        mutate_st(lambda i: i["events"].pop("_traceml_internal:step_time")),
    ),
    (
        "step_time",
        "too many events",
        mutate_st(
            lambda i: i["events"].update(
                {f"p{n}": {"cpu": phase()} for n in range(MAX_EVENT_ENTRIES)}
            )
        ),
    ),
    (
        "step_time",
        "too many device entries",
        mutate_st(
            lambda i: i["events"].update(
                {f"p{n}": {f"x:{d}": phase() for d in range(100)} for n in range(11)}
            )
        ),
    ),
    (
        "step_time",
        "NaN cpu_ms",
        mutate_st(lambda i: set_timing(i, cpu_ms=math.nan, duration_ms=math.nan)),
    ),
    ("step_time", "inf duration_ms", mutate_st(lambda i: set_timing(i, duration_ms=math.inf))),
    ("step_time", "null cpu_ms", mutate_st(lambda i: set_timing(i, cpu_ms=None))),
    (
        "step_time",
        "negative cpu_ms",
        mutate_st(lambda i: set_timing(i, cpu_ms=-1.0, duration_ms=-1.0)),
    ),
    ("step_time", "string cpu_ms", mutate_st(lambda i: set_timing(i, cpu_ms="1.0"))),
    ("step_time", "n_calls 0", mutate_st(lambda i: set_timing(i, n_calls=0))),
    ("step_time", "n_calls float", mutate_st(lambda i: set_timing(i, n_calls=1.0))),
    ("step_time", "is_gpu int", mutate_st(lambda i: set_timing(i, is_gpu=1))),
    (
        "step_time",
        "is_gpu without gpu_ms",
        mutate_st(lambda i: set_timing(i, is_gpu=True, gpu_ms=None)),
    ),
    (
        "step_time",
        "is_gpu with NaN gpu_ms",
        mutate_st(lambda i: set_timing(i, is_gpu=True, gpu_ms=math.nan)),
    ),
    (
        "step_time",
        "is_gpu duration != gpu",
        mutate_st(lambda i: set_timing(i, is_gpu=True, gpu_ms=9.0)),
    ),
    ("step_time", "host duration != cpu", mutate_st(lambda i: set_timing(i, duration_ms=99.0))),
    ("step_time", "timing extra key", mutate_st(lambda i: set_timing(i, extra=1))),
    ("step_time", "item not a dict", [1, 2]),
    ("step_time", "item None", None),
    # step_memory
    (
        "step_memory",
        "cpu with peaks",
        mutate("step_memory", lambda i: i.update(device="cpu")),
    ),
    ("step_memory", "bad device", mutate("step_memory", lambda i: i.update(device="cuda0"))),
    ("step_memory", "huge device", mutate("step_memory", lambda i: i.update(device="a" * 70000))),
    (
        "step_memory",
        "negative peak",
        mutate("step_memory", lambda i: i.update(peak_allocated_bytes=-1)),
    ),
    (
        "step_memory",
        "float peak",
        mutate("step_memory", lambda i: i.update(peak_reserved_bytes=1.0)),
    ),
    ("step_memory", "missing peak", mutate("step_memory", lambda i: i.pop("peak_reserved_bytes"))),
    # process
    ("process", "NaN cpu_percent", mutate("process", lambda i: i.update(cpu_percent=math.nan))),
    ("process", "string cpu_percent", mutate("process", lambda i: i.update(cpu_percent="5"))),
    ("process", "negative ram", mutate("process", lambda i: i.update(ram_used_bytes=-1))),
    ("process", "zero cores", mutate("process", lambda i: i.update(cpu_logical_cores=0))),
    (
        "process",
        "gpu fields without gpu",
        mutate("process", lambda i: i.update(gpu_available=False)),
    ),
    (
        "process",
        "gpu fields while unknown",
        mutate("process", lambda i: i.update(gpu_available=None)),
    ),
    ("process", "gpu_available int", mutate("process", lambda i: i.update(gpu_available=1))),
    # system
    ("system", "cpu over 100", mutate("system", lambda i: i.update(cpu_percent=100.5))),
    ("system", "cpu negative", mutate("system", lambda i: i.update(cpu_percent=-0.5))),
    ("system", "cpu inf", mutate("system", lambda i: i.update(cpu_percent=math.inf))),
    (
        "system",
        "gpus without gpu_available",
        mutate("system", lambda i: i.update(gpu_available=False)),
    ),
    ("system", "gpus not a list", mutate("system", lambda i: i.update(gpus={"0": gpu_entry(0)}))),
    (
        "system",
        "too many gpus",
        mutate("system", lambda i: i.update(gpus=[gpu_entry(n) for n in range(1025)])),
    ),
    (
        "system",
        "gpu utilization 150",
        mutate("system", lambda i: i["gpus"][1].update(utilization_percent=150)),
    ),
    (
        "system",
        "gpu memory float",
        mutate("system", lambda i: i["gpus"][0].update(memory_used_bytes=1.0)),
    ),
    ("system", "gpu missing key", mutate("system", lambda i: i["gpus"][1].pop("power_limit_w"))),
    ("system", "gpu not a dict", mutate("system", lambda i: i["gpus"].append(3))),
    (
        "system",
        "duplicate gpu index",
        mutate("system", lambda i: i["gpus"][1].update(gpu_index=0)),
    ),
    ("system", "given gpu_count", mutate("system", lambda i: i.update(gpu_count=2))),
    # runtime_environment
    (
        "runtime_environment",
        "topology mismatch",
        mutate("runtime_environment", lambda i: i.update(topology="single_process")),
    ),
    (
        "runtime_environment",
        "backend while not initialized",
        mutate("runtime_environment", lambda i: i.update(distributed_initialized=False)),
    ),
    (
        "runtime_environment",
        "no backend while initialized",
        mutate("runtime_environment", lambda i: i.update(distributed_backend=None)),
    ),
    (
        "runtime_environment",
        "bad strategy",
        mutate("runtime_environment", lambda i: i.update(training_strategy="zero")),
    ),
    (
        "runtime_environment",
        "torch_version int",
        mutate("runtime_environment", lambda i: i.update(torch_version=2)),
    ),
    (
        "runtime_environment",
        "huge python_version",
        mutate("runtime_environment", lambda i: i.update(python_version=BIG)),
    ),
    (
        "runtime_environment",
        "python_version not a version",
        mutate("runtime_environment", lambda i: i.update(python_version="CPython")),
    ),
    # stdout_stderr
    (
        "stdout_stderr",
        "line with newline",
        mutate("stdout_stderr", lambda i: i.update(line="a\nb")),
    ),
    ("stdout_stderr", "bad source", mutate("stdout_stderr", lambda i: i.update(source="both"))),
    ("stdout_stderr", "line not a string", mutate("stdout_stderr", lambda i: i.update(line=5))),
    ("stdout_stderr", "huge line", mutate("stdout_stderr", lambda i: i.update(line="é" * 40000))),
]
