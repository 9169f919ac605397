"""Pure judgements of the GPU check: export lines and own measurements in, verdicts out.

Standard library only (and the benches' estimator, ``bench.overhead.paired``, itself
standard library only), no torch, no CUDA: tests/gpu_check/test_gpu_check.py runs all
of it on CPU with made-up lines, so the logic that decides PASS or FAIL on a GPU is
tested before any GPU runs it. Each ``*_problems`` function returns a list of one-line
problems (empty when the figures are right); ``verdict`` turns them into one line.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.overhead.paired import cycle, positions

PASS = "PASS"
FAIL = "FAIL"
SKIP = "SKIP"

Record = Mapping[str, Any]

_PREFIX = "_traceml_internal:"
FORWARD = _PREFIX + "forward_time"
BACKWARD = _PREFIX + "backward_time"
OPTIMIZER = _PREFIX + "optimizer_step"
DATALOADER = _PREFIX + "dataloader_next"
H2D = _PREFIX + "h2d_time"
STEP = _PREFIX + "step_time"
HOST_ONLY = (DATALOADER, STEP)
"""Phases that report host time even on a GPU (gpu_ms null, duration_ms == cpu_ms)."""

AGREEMENT_TOL = 0.20
"""Traced gpu_ms against a manual CUDA event pair around the same work: ±20 %."""
EXIT_LIMIT_MS = 50.0
"""A step's (or phase's) exit with ~1 s of GPU work queued must return within this."""
TEMPERATURE_TOL_C = 10.0
HOST_OVERHEAD_LIMIT_US = 100.0
"""Ceiling for what a traced GPU step adds beyond measuring the same step by hand.

Both are cycle figures from one process (bench/overhead/paired.py): what a traced step, and a
by-hand step, cost over the third untraced step after them, their own time and what
spills into the next steps. The by-hand step makes the CUDA calls TraceML makes
(event pairs around each phase, read a step later; the peak reset and read) and
nothing else. What the driver charges for those calls differs several-fold between
machines (and under gVisor); what TraceML adds on top should not. The CPU step's
figure is ~15 to 20 µs (python -m bench.overhead.step --paired); 100 µs leaves room for the
pending-step bookkeeping and a slower host. The issue sets no GPU target."""
MAX_LISTED = 3
"""Problems of one kind listed in a verdict line before '... and N more'."""


@dataclass(frozen=True)
class Verdict:
    """One check's outcome: ``PASS``/``FAIL``/``SKIP``, its figures, and data for the report."""

    name: str
    status: str
    figures: str
    data: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        """``STATUS name: figures`` on one line."""
        return f"{self.status} {self.name}: {one_line(self.figures)}"


def one_line(text: str, limit: int = 400) -> str:
    """``text`` with whitespace runs collapsed to one space, cut to ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def verdict(name: str, problems: Sequence[str], figures: str, **data: Any) -> Verdict:
    """PASS with ``figures`` when there is no problem, else FAIL naming the first ones."""
    if not problems:
        return Verdict(name, PASS, figures, dict(data))
    shown = "; ".join(problems[:MAX_LISTED])
    more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
    text = f"{shown}{more}" + (f" | {figures}" if figures else "")
    return Verdict(name, FAIL, text, {**data, "problems": list(problems)})


def skipped(name: str, why: str, **data: Any) -> Verdict:
    """A check that was not judged, and why."""
    return Verdict(name, SKIP, why, dict(data))


def crashed(name: str, why: str, **data: Any) -> Verdict:
    """A check whose workload or judgement broke: a FAIL with its one-line reason."""
    return Verdict(name, FAIL, f"crashed: {one_line(why, 300)}", dict(data))


def summary_line(verdicts: Iterable[Verdict]) -> str:
    """``gpu_check: <n> passed, <m> failed, <k> skipped``."""
    items = list(verdicts)
    counts = {s: sum(1 for v in items if v.status == s) for s in (PASS, FAIL, SKIP)}
    return f"gpu_check: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped"


def exit_code(verdicts: Iterable[Verdict]) -> int:
    """0 when no check failed, else 1."""
    return 1 if any(v.status == FAIL for v in verdicts) else 0


NOT_RUN_EXIT = 5
"""Exit status when a lane could not run (the default lane's C extensions did not build)."""


@dataclass(frozen=True)
class LaneResult:
    """One lane's verdicts, how TraceML ran in it, or why the lane did not run."""

    lane: str
    verdicts: Sequence[Verdict]
    traceml: str
    not_run: str | None = None

    def lines(self) -> list[str]:
        """``[lane] STATUS name: figures`` per check."""
        return [f"[{self.lane}] {v.line()}" for v in self.verdicts]

    def counts(self) -> str:
        if self.not_run is not None:
            return f"not run: {one_line(self.not_run)}"
        return summary_line(self.verdicts).removeprefix("gpu_check: ")

    def summary(self) -> str:
        """``gpu_check [lane]: <n> passed, <m> failed, <k> skipped`` (or ``not run: why``)."""
        return f"gpu_check [{self.lane}]: {self.counts()}"


def final_line(lanes: Sequence[LaneResult]) -> str:
    """``gpu_check: default <n> passed, ...; pure <n> passed, ...`` (``not run`` for a
    lane that did not run)."""
    parts = [
        f"{lane.lane} not run" if lane.not_run is not None else f"{lane.lane} {lane.counts()}"
        for lane in lanes
    ]
    return "gpu_check: " + "; ".join(parts)


def lanes_exit_code(lanes: Sequence[LaneResult]) -> int:
    """5 when a lane did not run, else 1 when a check failed, else 0."""
    if any(lane.not_run is not None for lane in lanes):
        return NOT_RUN_EXIT
    return exit_code(v for lane in lanes for v in lane.verdicts)


def report_text(lanes: Sequence[LaneResult], header: Sequence[str] = ()) -> str:
    """The text report: header lines; per lane, how TraceML ran, one line per check and
    its summary; the final line."""
    lines = list(header)
    for lane in lanes:
        lines += [f"# lane {lane.lane}: {lane.traceml}", *lane.lines(), lane.summary()]
    lines.append(final_line(lanes))
    return "\n".join(lines) + "\n"


def report_json(lanes: Sequence[LaneResult], meta: Mapping[str, Any]) -> str:
    """The JSON report: ``meta``; per lane, every verdict with its data and the counts."""
    doc = {
        "meta": dict(meta),
        "lanes": [
            {
                "lane": lane.lane,
                "traceml": lane.traceml,
                "not_run": lane.not_run,
                "checks": [
                    {"name": v.name, "status": v.status, "figures": v.figures, "data": v.data}
                    for v in lane.verdicts
                ],
                "summary": lane.summary(),
                "passed": sum(1 for v in lane.verdicts if v.status == PASS),
                "failed": sum(1 for v in lane.verdicts if v.status == FAIL),
                "skipped": sum(1 for v in lane.verdicts if v.status == SKIP),
            }
            for lane in lanes
        ],
        "summary": final_line(lanes),
        "exit_code": lanes_exit_code(lanes),
    }
    return json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n"


# -- numbers ------------------------------------------------------------------------------


def rel_diff(value: float, reference: float) -> float:
    """``|value - reference| / |reference|``; 0 when both are 0, infinity when only reference is."""
    if reference == 0:
        return 0.0 if value == 0 else math.inf
    return abs(value - reference) / abs(reference)


def within_rel(value: float | None, reference: float | None, tol: float) -> bool:
    """Whether ``value`` is within ``tol`` (a fraction) of ``reference``; False for a missing one."""
    if value is None or reference is None:
        return False
    if not (math.isfinite(value) and math.isfinite(reference)):
        return False
    return rel_diff(value, reference) <= tol


def within_abs(value: float | None, reference: float | None, tol: float) -> bool:
    """Whether ``|value - reference| <= tol``; False for a missing one."""
    if value is None or reference is None:
        return False
    if not (math.isfinite(value) and math.isfinite(reference)):
        return False
    return abs(value - reference) <= tol


def fmt(value: float | None, digits: int = 3) -> str:
    """A figure for a verdict line; ``null`` for None."""
    if value is None:
        return "null"
    return f"{value:.{digits}g}"


# -- step_time ----------------------------------------------------------------------------


def steps_of(lines: Iterable[Record], rank: int = 0) -> dict[int, Record]:
    """step number -> step_time (or step_memory) line of one rank."""
    return {int(r["step"]): r for r in lines if int(r.get("global_rank", 0)) == rank}


def timing(line: Record, phase: str, device: str) -> Record | None:
    """The timing object of ``phase`` on ``device`` in a step_time line, or None."""
    events = line.get("events") or {}
    entry = events.get(phase)
    if not isinstance(entry, Mapping):
        return None
    result = entry.get(device)
    return result if isinstance(result, Mapping) else None


def gpu_timing_problem(t: Record) -> str | None:
    """Why a GPU phase's timing is wrong, or None: gpu_ms > 0, is_gpu, duration_ms == gpu_ms."""
    gpu = t.get("gpu_ms")
    if gpu is None:
        return "gpu_ms null"
    if not isinstance(gpu, (int, float)) or not gpu > 0:
        return f"gpu_ms {gpu!r} not > 0"
    if t.get("is_gpu") is not True:
        return f"is_gpu {t.get('is_gpu')!r}"
    if t.get("duration_ms") != gpu:
        return f"duration_ms {t.get('duration_ms')!r} != gpu_ms {gpu!r}"
    return None


def host_timing_problem(t: Record) -> str | None:
    """Why a host-only phase's timing is wrong, or None: gpu_ms null, duration_ms == cpu_ms."""
    if t.get("gpu_ms") is not None:
        return f"gpu_ms {t.get('gpu_ms')!r} (host-only phase)"
    if t.get("is_gpu") is not False:
        return f"is_gpu {t.get('is_gpu')!r} (host-only phase)"
    if t.get("duration_ms") != t.get("cpu_ms"):
        return "duration_ms != cpu_ms (host-only phase)"
    return None


def _short(phase: str) -> str:
    return phase.removeprefix(_PREFIX)


def gpu_phase_problems(
    lines: Iterable[Record],
    device: str,
    required: Sequence[str],
    optional: Sequence[str] = (),
    skip_steps: Iterable[int] = (),
    host: bool = False,
) -> list[str]:
    """Every GPU phase of every step has gpu_ms > 0 and duration_ms == gpu_ms on ``device``.

    ``required`` phases must be in every step (except ``skip_steps``); ``optional`` ones
    are judged where present. Host-only phases present are judged as host time. Problems
    of one kind are folded into one line with a count and the first step. ``host``
    (the check's CPU dry run) judges every phase as host time instead.
    """
    skip = set(skip_steps)
    found: dict[str, list[int]] = {}
    for line in sorted(lines, key=lambda r: int(r["step"])):
        step = int(line["step"])
        events = line.get("events") or {}
        for phase in (*required, *optional):
            if phase not in events:
                if phase in required and step not in skip:
                    found.setdefault(f"{_short(phase)} missing", []).append(step)
                continue
            t = timing(line, phase, device)
            if t is None:
                keys = sorted(events[phase])
                found.setdefault(f"{_short(phase)} has device keys {keys}, not {device}", [])
                found[f"{_short(phase)} has device keys {keys}, not {device}"].append(step)
                continue
            why = host_timing_problem(t) if host else gpu_timing_problem(t)
            if why is not None:
                found.setdefault(f"{_short(phase)} {why}", []).append(step)
        for phase in HOST_ONLY:
            t = timing(line, phase, device) if phase in events else None
            if t is not None:
                why = host_timing_problem(t)
                if why is not None:
                    found.setdefault(f"{_short(phase)} {why}", []).append(step)
    return [
        f"{what} in {len(steps)} step(s), first step {steps[0]}" for what, steps in found.items()
    ]


def step_count_problems(lines: Iterable[Record], expected: int, rank: int = 0) -> list[str]:
    """The rank reported steps 1..expected, each once."""
    steps = sorted(int(r["step"]) for r in lines if int(r.get("global_rank", 0)) == rank)
    if steps == list(range(1, expected + 1)):
        return []
    dupes = len(steps) - len(set(steps))
    return [
        f"rank {rank}: {len(steps)} step lines ({dupes} repeated), expected steps 1..{expected}"
    ]


def seq_problems(lines: Iterable[Record], stream: str, rank: int = 0) -> list[str]:
    """``seq`` of one rank's lines of one stream is 0, 1, 2, ... with no repeat."""
    seqs = [int(r["seq"]) for r in lines if int(r.get("global_rank", 0)) == rank]
    if sorted(seqs) == list(range(len(seqs))):
        return []
    return [f"{stream} seq of rank {rank} is not 0..{len(seqs) - 1} once each (a second sender?)"]


def agreement_problems(
    traced: Mapping[int, float | None],
    manual: Mapping[int, float],
    label: str,
    tol: float = AGREEMENT_TOL,
    skip_first: int = 2,
) -> tuple[list[str], dict[str, float]]:
    """Traced gpu_ms of each step against the manual event pair's ms, within ``tol``.

    The first ``skip_first`` steps (warm-up) are left out. Returns the problems and
    figures: ``n``, ``median_ratio``, ``worst_ratio`` (traced / manual).
    """
    steps = sorted(s for s in manual if s > skip_first)
    problems: list[str] = []
    ratios: list[float] = []
    for step in steps:
        ref = manual[step]
        got = traced.get(step)
        if got is None:
            problems.append(f"{label} step {step}: traced gpu_ms missing or null")
            continue
        ratio = got / ref if ref else math.inf
        ratios.append(ratio)
        if not within_rel(got, ref, tol):
            problems.append(
                f"{label} step {step}: traced {fmt(got)} ms vs manual {fmt(ref)} ms "
                f"(ratio {fmt(ratio)}, allowed ±{tol:.0%})"
            )
    if not steps:
        problems.append(f"{label}: no step to compare")
    figures: dict[str, float] = {"n": float(len(ratios))}
    if ratios:
        figures["median_ratio"] = statistics.median(ratios)
        figures["worst_ratio"] = max(ratios, key=lambda r: abs(r - 1))
    return problems, figures


def traced_gpu_ms(
    lines: Iterable[Record], phase: str, device: str, key: str = "gpu_ms"
) -> dict[int, float | None]:
    """step -> gpu_ms (or ``key``) of ``phase`` on ``device`` (None where missing or null)."""
    result: dict[int, float | None] = {}
    for line in lines:
        t = timing(line, phase, device)
        gpu = None if t is None else t.get(key)
        result[int(line["step"])] = float(gpu) if isinstance(gpu, (int, float)) else None
    return result


# -- step_memory --------------------------------------------------------------------------


def alternating_peak_problems(
    lines: Iterable[Record],
    device: str,
    big_steps: Iterable[int],
    big_bytes: int,
    torch_peaks: Mapping[int, Sequence[int | None]] | None = None,
) -> list[str]:
    """Per-step peaks follow the allocations: big steps reach ``big_bytes``, the others not.

    ``big_steps`` allocated ``big_bytes`` inside the step; every other step allocated far
    less. With ``torch_peaks`` (step -> (max_memory_allocated, max_memory_reserved) read
    right after the step), each line's peaks must equal torch's.
    """
    big = set(big_steps)
    problems: list[str] = []
    rows = sorted(lines, key=lambda r: int(r["step"]))
    if not rows:
        return ["no step_memory lines"]
    for line in rows:
        step = int(line["step"])
        if line.get("device") != device:
            problems.append(f"step {step}: device {line.get('device')!r}, expected {device}")
            continue
        peak = line.get("peak_allocated_bytes")
        if not isinstance(peak, int):
            problems.append(f"step {step}: peak_allocated_bytes {peak!r}")
            continue
        if step in big and peak < big_bytes:
            problems.append(f"step {step} allocated {big_bytes} B but its peak is {peak} B")
        if step not in big and peak >= big_bytes:
            problems.append(f"step {step} allocated little but its peak is {peak} B")
        if torch_peaks is not None and step in torch_peaks:
            alloc, reserved = torch_peaks[step][0], torch_peaks[step][1]
            if peak != alloc:
                problems.append(
                    f"step {step}: peak_allocated_bytes {peak} != torch.cuda.max_memory_allocated {alloc}"
                )
            if line.get("peak_reserved_bytes") != reserved:
                problems.append(
                    f"step {step}: peak_reserved_bytes {line.get('peak_reserved_bytes')} "
                    f"!= torch.cuda.max_memory_reserved {reserved}"
                )
    return problems


# -- process ------------------------------------------------------------------------------


def process_field_problems(
    lines: Iterable[Record],
    windows: Sequence[Mapping[str, Any]],
    device_index: int,
    device_count: int,
    total_memory: int,
    rank: int = 0,
) -> tuple[list[str], int]:
    """Process lines taken while memory was steady equal torch's figures.

    ``windows``: ``t0_ns``, ``t1_ns``, ``allocated``, ``reserved`` (torch's
    ``memory_allocated``/``memory_reserved`` of the device, unchanged from t0 to t1).
    Every line of the rank inside a window must say gpu_available true, gpu_count,
    gpu_device_index, the device's total memory and exactly those bytes. Returns the
    problems and how many lines were compared.
    """
    problems: list[str] = []
    compared = 0
    mine = [r for r in lines if int(r.get("global_rank", 0)) == rank]
    for w_index, w in enumerate(windows):
        inside = [r for r in mine if w["t0_ns"] < int(r["timestamp_unix_ns"]) < w["t1_ns"]]
        if not inside:
            problems.append(f"window {w_index}: no process line taken inside it")
        for r in inside:
            compared += 1
            expected = {
                "gpu_available": True,
                "gpu_count": device_count,
                "gpu_device_index": device_index,
                "gpu_memory_total_bytes": total_memory,
                "gpu_memory_used_bytes": w["allocated"],
                "gpu_memory_reserved_bytes": w["reserved"],
            }
            for key, want in expected.items():
                if r.get(key) != want:
                    problems.append(
                        f"window {w_index} seq {r.get('seq')}: {key} {r.get(key)!r} != {want!r}"
                    )
    return problems, compared


def device_index_problems(
    lines: Iterable[Record], rank: int, expected_index: int, after_ns: int
) -> list[str]:
    """A rank's process lines after ``after_ns`` name its own GPU."""
    wrong = [
        r
        for r in lines
        if int(r.get("global_rank", 0)) == rank
        and int(r["timestamp_unix_ns"]) > after_ns
        and r.get("gpu_available") is True
        and r.get("gpu_device_index") != expected_index
    ]
    if not wrong:
        return []
    return [
        f"rank {rank}: {len(wrong)} process line(s) say gpu_device_index "
        f"{wrong[0].get('gpu_device_index')!r}, its device is cuda:{expected_index}"
    ]


# -- system_gpu vs nvidia-smi -------------------------------------------------------------

SMI_FIELDS = (
    "index",
    "memory.total",
    "memory.used",
    "temperature.gpu",
    "power.draw",
    "enforced.power.limit",
    "utilization.gpu",
)
"""``nvidia-smi --query-gpu=... --format=csv,noheader,nounits``: MiB, °C, W, %."""


def parse_nvidia_smi(
    text: str, fields: Sequence[str] = SMI_FIELDS
) -> list[dict[str, float | None]]:
    """Rows of ``nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits``.

    ``[N/A]``, ``N/A`` and other non-numbers become None.
    """
    rows: list[dict[str, float | None]] = []
    for raw in text.splitlines():
        if not raw.strip():
            continue
        cells = [c.strip() for c in raw.split(",")]
        if len(cells) != len(fields):
            raise ValueError(
                f"nvidia-smi row has {len(cells)} cells, expected {len(fields)}: {raw!r}"
            )
        row: dict[str, float | None] = {}
        for name, cell in zip(fields, cells, strict=True):
            try:
                value: float | None = float(cell)
            except ValueError:
                value = None
            row[name] = value if value is None or math.isfinite(value) else None
        rows.append(row)
    return rows


def last_snapshot(lines: Iterable[Record]) -> list[Record]:
    """The system_gpu lines of the last (node_rank 0) snapshot: the highest ``seq``."""
    rows = [r for r in lines if int(r.get("node_rank", 0)) == 0]
    if not rows:
        return []
    top = max(int(r["seq"]) for r in rows)
    return sorted((r for r in rows if int(r["seq"]) == top), key=lambda r: int(r["gpu_index"]))


def system_gpu_problems(
    snapshot: Sequence[Record],
    smi: Sequence[Mapping[str, float | None]],
    temperature_tol: float = TEMPERATURE_TOL_C,
) -> list[str]:
    """One system snapshot's GPUs against nvidia-smi read just after: count, units, ranges.

    Memory total within 1 % (bytes vs MiB), power limit within 2 % or 5 W (W vs mW),
    temperature within ``temperature_tol`` °C, power draw between 0 and 1.2 x the limit,
    utilization 0-100, memory used at most the total.
    """
    problems: list[str] = []
    if len(snapshot) != len(smi):
        problems.append(f"{len(snapshot)} GPU line(s) in the snapshot, nvidia-smi lists {len(smi)}")
    by_index = {int(row["index"] or 0): row for row in smi if row.get("index") is not None}
    for line in snapshot:
        i = int(line["gpu_index"])
        row = by_index.get(i)
        if row is None:
            problems.append(f"gpu {i}: not in nvidia-smi's list")
            continue
        total = line.get("memory_total_bytes")
        smi_total = row.get("memory.total")
        if smi_total is not None and not within_rel(
            None if total is None else total / 2**20, smi_total, 0.01
        ):
            problems.append(f"gpu {i}: memory_total_bytes {total!r} vs nvidia-smi {smi_total} MiB")
        used = line.get("memory_used_bytes")
        if used is None or (total is not None and not 0 <= used <= total):
            problems.append(f"gpu {i}: memory_used_bytes {used!r} (total {total!r})")
        temp = line.get("temperature_c")
        smi_temp = row.get("temperature.gpu")
        if smi_temp is not None and not within_abs(temp, smi_temp, temperature_tol):
            problems.append(f"gpu {i}: temperature_c {temp!r} vs nvidia-smi {smi_temp} °C")
        limit = line.get("power_limit_w")
        smi_limit = row.get("enforced.power.limit")
        if smi_limit is not None and not (
            within_rel(limit, smi_limit, 0.02) or within_abs(limit, smi_limit, 5.0)
        ):
            problems.append(f"gpu {i}: power_limit_w {limit!r} vs nvidia-smi {smi_limit} W")
        draw = line.get("power_usage_w")
        cap = 1.2 * (smi_limit or limit or 0.0)
        if row.get("power.draw") is not None and (draw is None or not 0 <= draw <= cap):
            problems.append(f"gpu {i}: power_usage_w {draw!r} outside 0..{cap:.0f} W")
        util = line.get("utilization_percent")
        if row.get("utilization.gpu") is not None and (util is None or not 0 <= util <= 100):
            problems.append(f"gpu {i}: utilization_percent {util!r}")
    return problems


# -- host timings -------------------------------------------------------------------------


def exit_time_problems(
    exit_ms: Sequence[float], label: str, limit_ms: float = EXIT_LIMIT_MS
) -> list[str]:
    """Every exit took under ``limit_ms``."""
    slow = [(i + 1, ms) for i, ms in enumerate(exit_ms) if not ms < limit_ms]
    if not exit_ms:
        return [f"{label}: nothing measured"]
    return [
        f"{label} of step {step} took {ms:.1f} ms with GPU work queued (limit {limit_ms:g} ms)"
        for step, ms in slow
    ]


CYCLE = 4
"""Steps from one traced (or by-hand) step to the next step of any marked kind."""


def paired_overhead_us(
    marked: Sequence[bool], durations_s: Sequence[float], warmup: int = 20
) -> tuple[float | None, float | None, int]:
    """What a ``marked`` step costs in µs (bench/overhead/paired.py's cycle estimator: its own
    time and what spills into the next steps, over the third step after it), that
    reference step's median in µs, and how many marked steps were measured.

    The three steps after a marked one must be unmarked (the scenario's kinds go
    traced, plain x3, by-hand, plain x3). The first ``warmup`` steps are left out.
    """
    where = positions(marked)
    count = sum(1 for i in range(warmup, len(marked)) if marked[i])
    try:
        figures = cycle([d * 1e6 for d in durations_s], where, CYCLE, warmup)
    except ValueError:
        return None, None, 0
    return figures.cost, figures.by_position[-1], count


def shutdown_problems(shutdown_s: float, queued_s: float) -> list[str]:
    """Shutdown with ``queued_s`` of GPU work pending returned in under half of it."""
    if shutdown_s < queued_s / 2:
        return []
    return [
        f"shutdown took {shutdown_s:.1f} s with {queued_s:.0f} s of GPU work queued "
        f"(limit {queued_s / 2:.0f} s): it waits for the GPU"
    ]


def extension_problems(
    loaded: Mapping[str, str], expected: Sequence[str], build_src: str | None
) -> list[str]:
    """The C extensions a workload loaded (name -> file) are the lane's: each of
    ``expected``, from the ``build_src`` folder (the default lane), or none at all
    (``build_src`` None: the pure lane)."""
    if build_src is None:
        return [f"TRACEML_PURE_PYTHON=1, yet the rank loaded {name}" for name in sorted(loaded)]
    problems = []
    for name in expected:
        path = loaded.get(name)
        if path is None:
            problems.append(f"the rank did not load the C extension {name}")
        elif not path.startswith(build_src.rstrip("/") + "/"):
            problems.append(f"the rank loaded {name} from {path}, not from the lane's build")
    return problems


WARNING_MARKS = ("step timing failed", "sampling failed", "could not start")
"""Text of TraceML's own failure warnings; in a check's log, each is a problem."""


def warning_problems(log: str) -> list[str]:
    """TraceML warnings (timing or sampling switched off) found in a run's output."""
    found = []
    for raw in log.splitlines():
        if any(mark in raw for mark in WARNING_MARKS) and "TraceML" in raw:
            found.append(f"warning in the run: {one_line(raw, 200)}")
    return found[:MAX_LISTED]


def step_memory_problems(
    lines: Iterable[Record], device: str, expected: int, rank: int = 0
) -> list[str]:
    """One step_memory line per step 1..expected on ``device`` with peaks > 0 (a GPU has them)."""
    mine = [r for r in lines if int(r.get("global_rank", 0)) == rank]
    problems = step_count_problems(mine, expected, rank)
    bad = [
        r
        for r in mine
        if r.get("device") != device
        or not isinstance(r.get("peak_allocated_bytes"), int)
        or not isinstance(r.get("peak_reserved_bytes"), int)
        or not r["peak_allocated_bytes"] > 0
    ]
    if bad:
        r = bad[0]
        problems.append(
            f"rank {rank}: {len(bad)} step_memory line(s) wrong, first step {r.get('step')}: "
            f"device {r.get('device')!r}, peaks {r.get('peak_allocated_bytes')!r}/"
            f"{r.get('peak_reserved_bytes')!r} (expected {device}, > 0)"
        )
    return problems


def phase_presence_problems(
    lines: Iterable[Record], phase: str, present: Iterable[int], absent: Iterable[int]
) -> list[str]:
    """``phase`` is in the ``present`` steps and not in the ``absent`` ones."""
    by_step = {int(r["step"]): (r.get("events") or {}) for r in lines}
    problems = [
        f"step {s}: {_short(phase)} missing" for s in present if phase not in by_step.get(s, {})
    ]
    problems += [
        f"step {s}: {_short(phase)} present, but that step did not run it"
        for s in absent
        if phase in by_step.get(s, {})
    ]
    return problems


def median_gpu_ms(
    lines: Iterable[Record], phase: str, device: str, key: str = "gpu_ms"
) -> float | None:
    """Median gpu_ms (or ``key``) of ``phase`` over the steps that have one."""
    values = [v for v in traced_gpu_ms(lines, phase, device, key).values() if v is not None]
    return statistics.median(values) if values else None


def collectives_problems(lines: Sequence[Record], steps: int, device: bool) -> list[str]:
    """Each step has its three kinds of collective (DDP's bucket all-reduce through the
    hook, the script's all_reduce and all_gather), counted once each, with a
    non-negative wait of the backend's measure and arrivals in order."""
    problems: list[str] = []
    want = {
        ("ddp_comm_hook", "all_reduce"),
        ("torch.distributed", "all_reduce"),
        ("torch.distributed", "all_gather"),
    }
    by_step: dict[int, set[tuple[str, str]]] = {}
    for x in lines:
        by_step.setdefault(int(x["step"]), set()).add((str(x["source"]), str(x["op"])))
        measure = x.get("wait_measure")
        expected = "device" if device else "host"
        if x["source"] == "torch.distributed" and x["op"] == "broadcast" and x["step"] == 1:
            # DDP's parameter broadcast when the model is wrapped is a C++ call that
            # returns no Work: its host time, on every backend.
            expected = "host"
        if measure != expected:
            problems.append(f"step {x['step']} {x['op']}: wait_measure {measure!r}")
        wait = x.get("wait_ms")
        if wait is None or not wait >= 0.0:
            problems.append(f"step {x['step']} {x['op']}: wait_ms {wait!r}")
        if not 0.0 <= x["first_arrival_ms"] <= x["last_arrival_ms"]:
            problems.append(f"step {x['step']} {x['op']}: arrivals out of order")
    for step in range(1, steps + 1):
        seen = by_step.get(step, set())
        if step == 1:
            # DDP broadcasts the parameters when it is made, before the first step.
            seen = seen - {("torch.distributed", "broadcast")}
        if seen != want:
            problems.append(f"step {step}: collectives {sorted(by_step.get(step, set()))}")
    return problems[:8]
