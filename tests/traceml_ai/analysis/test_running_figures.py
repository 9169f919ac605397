"""The process, system and system_gpu figures are running figures: the summary of a run
with many such lines (several ranks, nodes and GPUs, nulls where the schema allows
them, a GPU absent from some snapshots, samples above the host's cores) says what the
lines say, computed here from the lines themselves; what the reader holds does not
grow with the lines; a followed file sees only its new lines, and one rewritten is
read again from its start with fresh figures.
"""

from __future__ import annotations

import gc
import math
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from tests.traceml_ai.analysis.test_summary import closing, step_line, write
from traceml_ai.analysis import RunReader, format_summary, summarize_run
from traceml_ai.analysis._running import (
    MAX_PLAUSIBLE_CORES,
    GpuTotals,
    ProcessTotals,
    SystemTotals,
    cores_needed,
)
from traceml_ai.dashboard._files import FilesSource

WORLD, PER_NODE = 8, 4
NODES = WORLD // PER_NODE
GPUS = 3
GiB = 1 << 30


def _ident(stream: str, rank: int, seq: int) -> dict[str, Any]:
    return {
        "stream": stream,
        "schema_version": 1,
        "observed_timestamp_unix_ns": 10**18 + seq * 10**9 + rank,
        "rank": rank,
        "global_rank": rank,
        "local_rank": rank % PER_NODE,
        "world_size": WORLD,
        "local_world_size": PER_NODE,
        "node_rank": rank // PER_NODE,
        "timestamp_unix_ns": 10**18 + seq * 10**9 + rank,
        "seq": seq,
    }


def _process_lines(seqs: range, rnd: random.Random) -> Iterator[dict[str, Any]]:
    """Rank 0 says its cores in a few lines only (node 0's others say 16), rank 5 never
    (node 1's others say 8 from seq 40 on: its samples wait for that), rank 7's GPU
    figures are null; some samples are above what the host's cores allow."""
    for seq in seqs:
        for rank in range(WORLD):
            node = rank // PER_NODE
            cores: int | None = 16 if node == 0 else (8 if seq >= 40 else None)
            if (rank == 0 and seq % 7) or rank == 5:
                cores = None
            cpu = round(rnd.uniform(0.0, 780.0), 2)
            if rnd.random() < 0.03:
                cpu = rnd.choice((1700.0, 2500.5, 9000.0))  # above 16 cores
            if rnd.random() < 0.005:
                cpu = 2e9  # above any host
            gpu = rank != 7
            yield {
                **_ident("process", rank, seq),
                "pid": 1000 + rank,
                "cpu_percent": cpu,
                "cpu_logical_cores": cores,
                "ram_used_bytes": rnd.randrange(1 << 28, 3 << 30),
                "ram_total_bytes": 64 * GiB if seq % 3 else None,
                "gpu_available": gpu,
                "gpu_count": GPUS if gpu else None,
                "gpu_device_index": rank % PER_NODE if gpu else None,
                "gpu_memory_used_bytes": rnd.randrange(1 << 30, 40 * GiB) if gpu else None,
                "gpu_memory_reserved_bytes": (
                    rnd.randrange(1 << 30, 70 * GiB) if gpu and seq % 5 else None
                ),
                "gpu_memory_total_bytes": 80 * GiB if gpu else None,
            }


def _system_lines(
    seqs: range, rnd: random.Random
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Node 1 has no GPU 2 in every third snapshot; GPU 1's figures are null at times;
    node 1's system lines start at seq 10 (its first GPU snapshots have no system line)."""
    system: list[dict[str, Any]] = []
    gpus: list[dict[str, Any]] = []
    for seq in seqs:
        for node in range(NODES):
            ident = _ident("system", node * PER_NODE, seq)
            present = [i for i in range(GPUS) if not (node == 1 and i == 2 and seq % 3 == 0)]
            if not (node == 1 and seq < 10):
                system.append(
                    {
                        **ident,
                        "cpu_percent": round(rnd.uniform(0.0, 100.0), 2),
                        "ram_used_bytes": rnd.randrange(8 * GiB, 60 * GiB),
                        "ram_total_bytes": 64 * GiB + node + (3 if seq == 11 else 0),
                        "gpu_available": True,
                        "gpu_count": len(present),
                    }
                )
            for i in present:
                blank = i == 1 and seq % 4 == 0
                gpus.append(
                    {
                        **ident,
                        "stream": "system_gpu",
                        "gpu_index": i,
                        "utilization_percent": None if blank else round(rnd.uniform(0, 100), 1),
                        "memory_used_bytes": None if blank else rnd.randrange(1 << 30, 80 * GiB),
                        "memory_total_bytes": None if blank else 80 * GiB,
                        "temperature_c": None if blank else round(rnd.uniform(30, 90), 1),
                        "power_usage_w": None if blank else round(rnd.uniform(50, 700), 2),
                        "power_limit_w": None if blank else 700.0,
                    }
                )
    return system, gpus


# ------------------------------------------------------------- the figures, by hand


def _mean(values: list[float]) -> float:
    return round(math.fsum(values) / len(values), 1)


def _expected_process(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each rank's figures from all its lines at once (a line without a core count takes
    the largest its node's lines say anywhere in the file)."""
    node_cores: dict[int, int] = {}
    for o in lines:
        if o["cpu_logical_cores"] is not None:
            node = o["node_rank"]
            node_cores[node] = max(node_cores.get(node, 0), o["cpu_logical_cores"])
    out: dict[str, dict[str, Any]] = {}
    for rank in sorted({o["global_rank"] for o in lines}):
        mine = [o for o in lines if o["global_rank"] == rank]
        counts = [o["cpu_logical_cores"] or node_cores.get(o["node_rank"]) for o in mine]
        good = [
            o["cpu_percent"]
            for o, c in zip(mine, counts, strict=True)
            if o["cpu_percent"] <= 100 * (c or MAX_PLAUSIBLE_CORES)
        ]
        used = [o["gpu_memory_used_bytes"] for o in mine if o["gpu_memory_used_bytes"] is not None]
        held = [o["gpu_memory_reserved_bytes"] for o in mine]
        reserved = [v for v in held if v is not None]
        known = [c for c in counts if c is not None]
        out[str(rank)] = {
            "samples": len(mine),
            "cpu_percent_mean": _mean(good) if good else None,
            "cpu_percent_max": round(max(good), 1) if good else None,
            "cpu_percent_impossible_samples": len(mine) - len(good),
            "cpu_logical_cores": max(known) if known else None,
            "ram_used_bytes_max": max(o["ram_used_bytes"] for o in mine),
            "gpu_memory_used_bytes_max": max(used) if used else None,
            "gpu_memory_reserved_bytes_max": max(reserved) if reserved else None,
        }
    return out


def _top(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _expected_system(
    system: list[dict[str, Any]], gpus: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for node in sorted({o["node_rank"] for o in system} | {o["node_rank"] for o in gpus}):
        mine = [o for o in system if o["node_rank"] == node]
        cpu = [o["cpu_percent"] for o in mine]
        by_index: dict[str, dict[str, Any]] = {}
        for i in sorted({o["gpu_index"] for o in gpus if o["node_rank"] == node}):
            g = [o for o in gpus if o["node_rank"] == node and o["gpu_index"] == i]
            util = [o["utilization_percent"] for o in g if o["utilization_percent"] is not None]
            temp, power = (
                _top([o["temperature_c"] for o in g]),
                _top([o["power_usage_w"] for o in g]),
            )
            by_index[str(i)] = {
                "utilization_percent_mean": _mean(util) if util else None,
                "memory_used_bytes_max": _top([o["memory_used_bytes"] for o in g]),
                "memory_total_bytes": _top([o["memory_total_bytes"] for o in g]),
                "temperature_c_max": None if temp is None else round(temp, 1),
                "power_usage_w_max": None if power is None else round(power, 1),
            }
        out[str(node)] = {
            "samples": len(mine),
            "cpu_percent_mean": _mean(cpu) if cpu else 0.0,
            "cpu_percent_max": round(max(cpu, default=0.0), 1),
            "ram_used_bytes_max": max((o["ram_used_bytes"] for o in mine), default=0),
            "ram_total_bytes": max((o["ram_total_bytes"] for o in mine), default=0),
            "gpu_count": max((o["gpu_count"] for o in mine), default=0),
            "gpus": by_index,
        }
    return out


def _run(tmp_path: Path, seqs: range, seed: int = 1, close: bool = True) -> Path:
    rnd = random.Random(seed)
    run = tmp_path / "run"
    export = run / "aggregator" / "export"
    steps = [step_line(r, s, WORLD, {"step": 10.0}) for s in range(1, 4) for r in range(WORLD)]
    for r in range(WORLD):
        for line in steps:
            if line["global_rank"] == r:
                line.update(local_rank=r % PER_NODE, local_world_size=PER_NODE)
                line["node_rank"] = r // PER_NODE
    process = list(_process_lines(seqs, rnd))
    system, gpus = _system_lines(seqs, rnd)
    for name, objs in (
        ("step_time", steps),
        ("process", process),
        ("system", system),
        ("system_gpu", gpus),
    ):
        write(export / f"{name}.jsonl", [*objs, closing(name, len(objs))] if close else objs)
    return run


def _lines(run: Path, name: str) -> list[dict[str, Any]]:
    raw = (run / "aggregator" / "export" / f"{name}.jsonl").read_bytes().splitlines()
    objs = [orjson.loads(line) for line in raw]
    return [o for o in objs if not o.get("closing")]


# ------------------------------------------------------------------------ the tests


def test_the_summary_says_what_the_lines_say(tmp_path: Path) -> None:
    run = _run(tmp_path, range(120))
    summary = summarize_run(run)
    assert summary.loss.status == "complete", summary.problems
    process = _lines(run, "process")
    want_process = _expected_process(process)
    got = summary.to_json()
    assert got["process"] == want_process
    # The data has what the figures are about: samples left out, a rank whose cores
    # come from its node, a rank without GPU figures.
    assert want_process["0"]["cpu_percent_impossible_samples"] > 0
    assert want_process["5"]["cpu_logical_cores"] == 8
    assert want_process["7"]["gpu_memory_used_bytes_max"] is None
    want_system = _expected_system(_lines(run, "system"), _lines(run, "system_gpu"))
    assert got["system"] == want_system
    assert want_system["1"]["gpus"]["2"]["utilization_percent_mean"] is not None
    assert want_system["1"]["gpu_count"] == GPUS

    # The printed text: the per-rank and per-node rows carry those figures.
    text = format_summary(summary, full=True, ranks=True)
    for rank, p in want_process.items():
        cpu = f"CPU {p['cpu_percent_mean']:.0f}% mean, {p['cpu_percent_max']:.0f}% max"
        assert f"  rank {rank}: {cpu}" in text
    bad = sum(p["cpu_percent_impossible_samples"] for p in want_process.values())
    assert f"({bad} impossible CPU sample(s) left out)" in text
    for node, n in want_system.items():
        assert (
            f"  node {node}: CPU {n['cpu_percent_mean']:.0f}% mean, "
            f"{n['cpu_percent_max']:.0f}% max;" in text
        )
        for i, g in n["gpus"].items():
            assert (
                f"temp max {g['temperature_c_max']} C, power max {g['power_usage_w_max']} W"
                in (text.split(f"  node {node}:")[1].split(f"    gpu {i}:")[1].splitlines()[0])
            )
    assert "system across 2 node(s)" in text and f"{2 * GPUS} GPU(s)" in text

    # The dashboard from files shows the same figures.
    data = FilesSource(run)()
    assert data.process == [
        {
            "rank": int(r),
            "cpu_percent": p["cpu_percent_mean"],
            "ram_used_bytes": p["ram_used_bytes_max"],
            "gpu_memory_used_bytes": p["gpu_memory_used_bytes_max"],
            "gpu_memory_reserved_bytes": p["gpu_memory_reserved_bytes_max"],
        }
        for r, p in want_process.items()
    ]
    assert data.system is not None
    assert [(n["node"], n["cpu_percent"], len(n["gpus"])) for n in data.system] == [
        (int(k), v["cpu_percent_mean"], len(v["gpus"])) for k, v in want_system.items()
    ]


def test_a_sample_waits_for_its_nodes_core_count() -> None:
    """A line without a core count: its sample's verdict is what the node's largest count
    says, even one said later in the file, by another rank."""
    totals = ProcessTotals()

    def line(rank: int, cpu: float, cores: int | None) -> dict[str, Any]:
        return {
            **_ident("process", rank, 0),
            "cpu_percent": cpu,
            "cpu_logical_cores": cores,
            "ram_used_bytes": 1,
        }

    totals.add(line(1, 350.0, None))  # unknown yet: held
    totals.add(line(1, 50.0, None))
    assert totals.held() == 2
    one = totals.figures()["1"]
    assert (one.cpu_percent_mean, one.cpu_percent_impossible_samples) == (200.0, 0)
    totals.add(line(2, 10.0, 2))  # node 0 has 2 cores: 50 % taken, 350 % still waits
    assert totals.held() == 1
    one = totals.figures()["1"]
    assert (one.cpu_percent_mean, one.cpu_percent_max) == (50.0, 50.0)
    assert (one.cpu_percent_impossible_samples, one.cpu_logical_cores) == (1, 2)
    totals.add(line(3, 10.0, 4))  # now 4: 350 % is plausible after all
    assert totals.held() == 0
    one = totals.figures()["1"]
    assert (one.cpu_percent_mean, one.cpu_percent_max) == (200.0, 350.0)
    assert (one.cpu_percent_impossible_samples, one.cpu_logical_cores) == (0, 4)
    # A node that never says its count: what a host of MAX_PLAUSIBLE_CORES can reach.
    limit = 100.0 * MAX_PLAUSIBLE_CORES
    totals.add(line(5, limit, None))
    totals.add(line(5, limit + 0.5, None))
    five = totals.figures()["5"]
    assert (five.cpu_percent_max, five.cpu_percent_impossible_samples) == (limit, 1)
    assert five.cpu_logical_cores is None


def test_the_cores_a_sample_needs() -> None:
    for cpu, need in [(0.0, 1), (100.0, 1), (100.01, 2), (350, 4), (800.0, 8), (1700.0, 17)]:
        assert cores_needed(cpu) == need, cpu
    for cpu in [3.7e17, 1.1e21, 123456789.5]:
        need = cores_needed(cpu)
        assert cpu <= 100.0 * need and (need == 1 or cpu > 100.0 * (need - 1))
    # Beyond what any count (an int64) allows: more cores than any line can say.
    assert cores_needed(1e22) > (1 << 63) - 1


def _count(obj: object) -> int:
    """The objects reachable from ``obj``, each counted where it is held (so two equal
    small ints count twice, as two large ones would), types and functions left out."""
    if isinstance(obj, (type, staticmethod, classmethod)) or callable(obj):
        return 0
    return 1 + sum(_count(child) for child in gc.get_referents(obj))


def _fed(lines: int) -> tuple[ProcessTotals, SystemTotals, GpuTotals]:
    rnd = random.Random(3)
    seqs = range(lines // WORLD)
    process, system, gpus = ProcessTotals(), SystemTotals(), GpuTotals()
    for obj in _process_lines(seqs, rnd):
        process.add(obj)
    sys_lines, gpu_lines = _system_lines(seqs, rnd)
    for obj in sys_lines:
        system.add(obj)
    for obj in gpu_lines:
        gpus.add(obj)
    return process, system, gpus


def test_what_is_held_does_not_grow_with_the_lines() -> None:
    """10,000 then 60,000 process lines (and system, system_gpu lines of as many
    snapshots) of the same ranks, nodes and GPUs: as many objects held."""
    small, large = _fed(10_000), _fed(60_000)
    assert [_count(t) for t in small] == [_count(t) for t in large]
    assert len(small[0]) == len(large[0]) == WORLD
    # The held CPU samples are groups by the cores they need (a few), not samples.
    assert large[0].held() == small[0].held() <= 4 * WORLD


def test_a_followed_run_sees_only_new_lines_and_a_rewritten_file_afresh(tmp_path: Path) -> None:
    run = _run(tmp_path, range(60), close=False)
    export = run / "aggregator" / "export"
    reader = RunReader(run)
    first = reader.summary()
    assert first.process is not None and first.process["3"].samples == 60
    # Appended lines: counted once, the figures those of every line.
    more = list(_process_lines(range(60, 90), random.Random(9)))
    with open(export / "process.jsonl", "ab") as fh:
        fh.write(b"".join(orjson.dumps(o) + b"\n" for o in more))
    again = reader.summary()
    assert again.to_json()["process"] == _expected_process(_lines(run, "process"))
    assert again.process is not None and again.process["3"].samples == 90
    # Truncated and written anew with fewer, smaller lines: figures of those alone.
    fresh = list(_process_lines(range(5), random.Random(4)))
    for o in fresh:
        o["ram_used_bytes"] = 1000 + o["global_rank"]
    write(export / "process.jsonl", fresh)
    after = reader.summary()
    assert after.to_json()["process"] == _expected_process(fresh)
    assert after.process is not None and after.process["3"].ram_used_bytes_max == 1003
    assert any("process.jsonl: truncated or rewritten while followed" in p for p in after.problems)
    # system_gpu replaced by another file: its GPUs' figures are the new file's alone.
    system = _lines(run, "system")
    gpus = [o for o in _lines(run, "system_gpu") if o["seq"] < 3 and o["gpu_index"] == 0]
    other = export / "system_gpu.new"
    write(other, gpus)
    os.replace(other, export / "system_gpu.jsonl")
    replaced = reader.summary()
    assert replaced.to_json()["system"] == _expected_system(system, gpus)
    assert replaced.system is not None and list(replaced.system["1"].gpus) == ["0"]
