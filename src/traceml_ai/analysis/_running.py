"""Running figures of the process, system and system_gpu lines, kept as each line is
read: what the summary says of them and nothing more, so what a reader holds grows
with the run's ranks, nodes and GPUs, never with its lines.

* :class:`ProcessTotals` (``process``), per rank: the samples, CPU sum, count and
  maximum, the samples above 100 % per logical core of the host (left out), the host's
  cores, the largest RSS, GPU memory used and reserved;
* :class:`SystemTotals` (``system``), per node: CPU sum, count and maximum, the largest
  RAM in use, RAM total and GPU count;
* :class:`GpuTotals` (``system_gpu``), per node and GPU: utilization sum and count, the
  largest memory used and total, temperature and power.

:meth:`ProcessTotals.figures` and :func:`node_figures` make the summary's typed
figures of them; each call sees everything added so far and changes nothing, so a followed run
can be summarized again after every read.

Light to import: the package's own modules only.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, TypeGuard

from traceml_ai.analysis._model import GpuFigures, NodeFigures, ProcessFigures
from traceml_ai.analysis._phases import rounded

MAX_PLAUSIBLE_CORES = 8192
"""Logical cores assumed when a process line does not say its host's: Linux's largest
``NR_CPUS``, so only a ``cpu_percent`` no Linux host can reach is left out."""


def _number(v: object) -> TypeGuard[int | float]:
    return isinstance(v, (int, float))


def _higher(old: float | None, v: float) -> float:
    return v if old is None or v > old else old


_NO_COUNT = 1 << 64
"""More cores than any line can say (``cpu_logical_cores`` is an int64)."""


def cores_needed(cpu: float) -> int:
    """The fewest logical cores (at least 1) whose host can reach ``cpu`` percent, as
    the figures compare them (``cpu <= 100.0 * cores``): a sample is plausible on a host
    of ``c`` cores exactly when ``c`` is at least this."""
    c = max(1, int(cpu // 100.0))
    if c < 1 << 40:
        # 100.0 * c is exact here: step to the answer from the estimate.
        while 100.0 * c < cpu:
            c += 1
        while c > 1 and 100.0 * (c - 1) >= cpu:
            c -= 1
        return c
    lo, hi = 1, _NO_COUNT
    while lo < hi:
        mid = (lo + hi) // 2
        if cpu <= 100.0 * mid:
            hi = mid
        else:
            lo = mid + 1
    return lo


class _Held:
    """CPU samples of one rank whose verdict waits for its node's core count, those
    that need the same number of cores together (count, sum in line order, maximum)."""

    __slots__ = ("count", "top", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.top: float | None = None


class _Rank:
    __slots__ = (
        "cores",
        "cpu_count",
        "cpu_max",
        "cpu_sum",
        "gpu_reserved_max",
        "gpu_used_max",
        "impossible",
        "nodes_without_cores",
        "ram_max",
        "samples",
    )

    def __init__(self) -> None:
        self.samples = 0
        """Lines with an RSS figure."""
        self.cpu_sum = 0.0
        self.cpu_count = 0
        self.cpu_max: float | None = None
        self.impossible = 0
        self.cores: int | None = None
        """The largest core count the rank's own lines said."""
        self.nodes_without_cores: set[Hashable] = set()
        """Nodes of the rank's lines without a core count (their node's count is theirs)."""
        self.ram_max: float | None = None
        self.gpu_used_max: float | None = None
        self.gpu_reserved_max: float | None = None

    def take(self, cpu: float) -> None:
        self.cpu_sum += cpu
        self.cpu_count += 1
        self.cpu_max = _higher(self.cpu_max, cpu)


class ProcessTotals:
    """Per rank, the running figures of the process lines (:meth:`figures`).

    A ``cpu_percent`` above 100 % per logical core of the host cannot be (older samplers
    wrote such values) and is left out. A line without ``cpu_logical_cores`` takes the
    largest count any line of its node says, in the whole file: its sample is taken as
    soon as a count known so far allows it (counts only grow), and until then it is held
    with those of the rank and node that need as many cores (a count, a sum and a
    maximum each), so the verdict on each sample is the one the whole file gives.
    """

    __slots__ = ("_held", "_node_cores", "_ranks")

    def __init__(self) -> None:
        self._ranks: dict[int, _Rank] = {}
        self._node_cores: dict[Hashable, int] = {}
        self._held: dict[Hashable, dict[int, dict[int, _Held]]] = {}
        """node -> rank -> cores needed -> the samples waiting for the node's count."""

    def add(self, obj: Mapping[str, Any]) -> None:
        said = obj.get("cpu_logical_cores")
        node = obj.get("node_rank")
        own = isinstance(said, int)
        cores = said if isinstance(said, int) else 0
        if own:
            known = self._node_cores.get(node)
            if known is None or cores > known:
                self._node_cores[node] = cores
                self._release(node)
        rank = obj.get("global_rank")
        if not isinstance(rank, int):
            return
        r = self._ranks.get(rank)
        if r is None:
            r = self._ranks[rank] = _Rank()
        if own:
            r.cores = cores if r.cores is None else max(r.cores, cores)
        else:
            r.nodes_without_cores.add(node)
        cpu = obj.get("cpu_percent")
        if _number(cpu):
            if own:
                if cpu > 100.0 * (cores or MAX_PLAUSIBLE_CORES):
                    r.impossible += 1
                else:
                    r.take(float(cpu))
            else:
                known = self._node_cores.get(node)
                if known and cpu <= 100.0 * known:
                    r.take(float(cpu))
                else:
                    by_cores = self._held.setdefault(node, {}).setdefault(rank, {})
                    need = cores_needed(cpu)
                    held = by_cores.get(need)
                    if held is None:
                        held = by_cores[need] = _Held()
                    held.count += 1
                    held.total += float(cpu)
                    held.top = _higher(held.top, float(cpu))
        ram = obj.get("ram_used_bytes")
        if _number(ram):
            r.samples += 1
            r.ram_max = _higher(r.ram_max, float(ram))
        used = obj.get("gpu_memory_used_bytes")
        if _number(used):
            r.gpu_used_max = _higher(r.gpu_used_max, float(used))
        reserved = obj.get("gpu_memory_reserved_bytes")
        if _number(reserved):
            r.gpu_reserved_max = _higher(r.gpu_reserved_max, float(reserved))

    def _release(self, node: Hashable) -> None:
        """Take the held samples of ``node`` that its core count now allows."""
        limit = self._node_cores.get(node)
        ranks = self._held.get(node)
        if not limit or not ranks:
            return
        for rank, by_cores in list(ranks.items()):
            r = self._ranks[rank]
            for need in sorted(n for n in by_cores if n <= limit):
                held = by_cores.pop(need)
                r.cpu_sum += held.total
                r.cpu_count += held.count
                if held.top is not None:
                    r.cpu_max = _higher(r.cpu_max, held.top)
            if not by_cores:
                del ranks[rank]
        if not ranks:
            del self._held[node]

    def __len__(self) -> int:
        """The ranks seen."""
        return len(self._ranks)

    def held(self) -> int:
        """The held groups of samples (see the class)."""
        return sum(len(by) for ranks in self._held.values() for by in ranks.values())

    def figures(self) -> dict[str, ProcessFigures]:
        """Per rank: CPU (mean, max, the impossible samples left out), the host's cores,
        the largest RSS and GPU memory."""
        out: dict[str, ProcessFigures] = {}
        for rank in sorted(self._ranks):
            r = self._ranks[rank]
            total, count, top, bad = r.cpu_sum, r.cpu_count, r.cpu_max, r.impossible
            cores = r.cores
            for node in sorted(r.nodes_without_cores, key=repr):
                theirs = self._node_cores.get(node)
                if theirs is not None:
                    cores = theirs if cores is None else max(cores, theirs)
                # Still held: above the node's count, or its node never said one.
                limit = theirs or MAX_PLAUSIBLE_CORES
                for need, held in sorted(self._held.get(node, {}).get(rank, {}).items()):
                    if need <= limit:
                        total += held.total
                        count += held.count
                        if held.top is not None:
                            top = _higher(top, held.top)
                    else:
                        bad += held.count
            out[str(rank)] = ProcessFigures(
                samples=r.samples,
                cpu_percent_mean=rounded(total / count, 1) if count else None,
                cpu_percent_max=rounded(top, 1) if top is not None else None,
                cpu_percent_impossible_samples=bad,
                cpu_logical_cores=cores,
                ram_used_bytes_max=int(r.ram_max) if r.ram_max is not None else 0,
                gpu_memory_used_bytes_max=(
                    int(r.gpu_used_max) if r.gpu_used_max is not None else None
                ),
                gpu_memory_reserved_bytes_max=(
                    int(r.gpu_reserved_max) if r.gpu_reserved_max is not None else None
                ),
            )
        return out


class _Node:
    __slots__ = ("cpu_count", "cpu_max", "cpu_sum", "gpu_count", "ram_max", "ram_total")

    def __init__(self) -> None:
        self.cpu_sum = 0.0
        self.cpu_count = 0
        self.cpu_max: float | None = None
        self.ram_max: int | None = None
        self.ram_total = 0
        self.gpu_count = 0


class SystemTotals:
    """Per node, the running figures of the system lines."""

    __slots__ = ("nodes",)

    def __init__(self) -> None:
        self.nodes: dict[int, _Node] = {}

    def add(self, obj: Mapping[str, Any]) -> None:
        node = obj.get("node_rank")
        if not isinstance(node, int):
            return
        n = self.nodes.get(node)
        if n is None:
            n = self.nodes[node] = _Node()
        cpu, ram = obj.get("cpu_percent"), obj.get("ram_used_bytes")
        if _number(cpu):
            n.cpu_sum += float(cpu)
            n.cpu_count += 1
            n.cpu_max = _higher(n.cpu_max, float(cpu))
        if isinstance(ram, int):
            n.ram_max = ram if n.ram_max is None else max(n.ram_max, ram)
        total, count = obj.get("ram_total_bytes"), obj.get("gpu_count")
        if isinstance(total, int):
            n.ram_total = max(n.ram_total, total)
        if isinstance(count, int):
            n.gpu_count = max(n.gpu_count, count)


class _Gpu:
    __slots__ = ("mem_max", "mem_total", "power_max", "temp_max", "util_count", "util_sum")

    def __init__(self) -> None:
        self.util_sum = 0.0
        self.util_count = 0
        self.mem_max: float | None = None
        self.mem_total: float | None = None
        self.temp_max: float | None = None
        self.power_max: float | None = None


class GpuTotals:
    """Per node and GPU index, the running figures of the system_gpu lines (a GPU absent
    from some snapshots has the figures of those it is in)."""

    __slots__ = ("nodes",)

    def __init__(self) -> None:
        self.nodes: dict[int, dict[int, _Gpu]] = {}

    def add(self, obj: Mapping[str, Any]) -> None:
        node, index = obj.get("node_rank"), obj.get("gpu_index")
        if not isinstance(node, int) or not isinstance(index, int):
            return
        gpus = self.nodes.get(node)
        if gpus is None:
            gpus = self.nodes[node] = {}
        g = gpus.get(index)
        if g is None:
            g = gpus[index] = _Gpu()
        util = obj.get("utilization_percent")
        if _number(util):
            g.util_sum += float(util)
            g.util_count += 1
        v = obj.get("memory_used_bytes")
        if _number(v):
            g.mem_max = _higher(g.mem_max, float(v))
        v = obj.get("memory_total_bytes")
        if _number(v):
            g.mem_total = _higher(g.mem_total, float(v))
        v = obj.get("temperature_c")
        if _number(v):
            g.temp_max = _higher(g.temp_max, float(v))
        v = obj.get("power_usage_w")
        if _number(v):
            g.power_max = _higher(g.power_max, float(v))


def _gpu_figures(g: _Gpu) -> GpuFigures:
    return GpuFigures(
        utilization_percent_mean=rounded(g.util_sum / g.util_count, 1) if g.util_count else None,
        memory_used_bytes_max=int(g.mem_max) if g.mem_max is not None else None,
        memory_total_bytes=int(g.mem_total) if g.mem_total is not None else None,
        temperature_c_max=rounded(g.temp_max, 1) if g.temp_max is not None else None,
        power_usage_w_max=rounded(g.power_max, 1) if g.power_max is not None else None,
    )


def node_figures(system: SystemTotals, gpus: GpuTotals | None) -> dict[str, NodeFigures]:
    """Per node: CPU (mean, max), the largest RAM in use, RAM total, GPU count and its
    GPUs' figures (a node only system_gpu names has zeros for the system figures)."""
    by_gpu = gpus.nodes if gpus is not None else {}
    out: dict[str, NodeFigures] = {}
    for node in sorted(set(system.nodes) | set(by_gpu)):
        n = system.nodes.get(node) or _Node()
        out[str(node)] = NodeFigures(
            samples=n.cpu_count,
            cpu_percent_mean=rounded(n.cpu_sum / n.cpu_count if n.cpu_count else 0.0, 1),
            cpu_percent_max=rounded(n.cpu_max if n.cpu_max is not None else 0.0, 1),
            ram_used_bytes_max=n.ram_max if n.ram_max is not None else 0,
            ram_total_bytes=n.ram_total,
            gpu_count=n.gpu_count,
            gpus={str(i): _gpu_figures(g) for i, g in sorted(by_gpu.get(node, {}).items())},
        )
    return out
