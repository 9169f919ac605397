"""Runs every check of the GPU check in its own process, in two lanes, and writes the report.

    python -m scripts.gpu_check [--lanes default,pure] [--only NAME,...] [--out DIR]
                                [--budget-s S] [--cpu]

Run from the repository root (scripts/gpu-check.sh does): the root is then first on
``sys.path``, so ``scripts.gpu_check`` and the benches' estimator, ``bench.overhead.paired``,
import as packages. Two lanes, one after the other, each with every check:

- ``default``: TraceML as a default install runs it, the C extensions compiled
  (``setup.py build_ext`` on a copy of ``src/`` in the scratch folder, as ``pip
  install`` builds them). When they do not build or do not load, the lane is not run
  and one line says why;
- ``pure``: ``TRACEML_PURE_PYTHON=1``, the pure-Python paths.

Each check runs its workload under ``traceml run --exporter jsonl --export-streams
all`` in a child process group with a timeout, validates the files with ``traceml
validate``, then judges the lines against what the workload measured itself
(``judge``). A check that crashes or times out is a FAIL with its one-line reason; the
others still run. Prints one line ``[lane] PASS|FAIL|SKIP name: figures`` per check,
``gpu_check [lane]: <n> passed, <m> failed, <k> skipped`` per lane, and last
``gpu_check: default <...>; pure <...>``. Exit status: 0 when no check failed, 1 when
one did, 3 without a CUDA device, 4 when the wheels did not install, 5 when the C
extensions did not build (the pure lane still runs).

``--cpu`` is for developing the check on a machine without a GPU: every workload runs
on the CPU, so the harness (launch, files, judging, report) is exercised; its verdicts
mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import judge
from .judge import BACKWARD, FORWARD, H2D, OPTIMIZER, LaneResult, Verdict

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCENARIO = HERE / "scenario.py"
SPAWN = HERE / "spawn_train.py"
TRAIN = REPO / "examples" / "train.py"

BUDGET_S = 450.0
"""Wall time of both lanes together, the build included; a check whose turn comes past
its lane's share is SKIPped. With the probe and the wheels, the whole run takes at most
about 8 minutes."""
PURE_LANE_S = 180.0
"""Of ``BUDGET_S``, what the default lane leaves for the pure lane that follows it."""
BUILD_TIMEOUT_S = 120.0
NO_CUDA_EXIT = 3
NO_CUDA_MESSAGE = "gpu_check: no CUDA device: nothing to check"
WHEELS_EXIT = 4
LANES = ("default", "pure")
"""``default``: the C extensions built, as a default install runs TraceML; ``pure``:
``TRACEML_PURE_PYTHON=1``."""
RANK_EXTENSIONS = (
    "traceml_records._speedups",
    "traceml_ai.rank._timing.hotpath",
    "traceml_ai.transport._nowait",
)
"""The C extensions a rank loads: each check's workload must have run with them."""
AGGREGATOR_EXTENSIONS = ("traceml_ai.transport._cut", "traceml_ai.monitor._feedscan")
"""The C extensions of setup.py that only the aggregator loads: checked built and
loaded by the build's import, not looked for in a rank (a check's workload is a rank)."""
EXTENSIONS = (*RANK_EXTENSIONS, *AGGREGATOR_EXTENSIONS)
"""Every C extension of setup.py: the default lane must build and load each."""

_print_lock = threading.Lock()


def say(text: str) -> None:
    with _print_lock:
        print(text, flush=True)


@dataclass
class Run:
    """One ``traceml run`` of a workload: how it ended, its output, its export folder."""

    name: str
    rc: int | None
    timed_out: bool
    seconds: float
    log: str
    export: Path
    result: dict[str, Any] | None
    timeout: float

    def failure(self, need_result: bool = True) -> str | None:
        """Why the run itself failed, or None."""
        if self.timed_out:
            return f"timed out after {self.timeout:.0f} s: {self.tail()}"
        if self.rc != 0:
            return f"exit code {self.rc}: {self.tail()}"
        if need_result and self.result is None:
            return f"the workload wrote no result: {self.tail()}"
        return None

    def tail(self) -> str:
        """The last meaningful line of the output (an exception's line if there is one)."""
        lines = [ln.strip() for ln in self.log.splitlines() if ln.strip()]
        for line in reversed(lines[-40:]):
            if "Error" in line or "Exception" in line or "error:" in line:
                return judge.one_line(line, 240)
        return judge.one_line(lines[-1], 240) if lines else "(no output)"

    def read(self, stream: str) -> list[dict[str, Any]]:
        """The data lines of ``stream``'s export file (the closing line left out)."""
        path = self.export / f"{stream}.jsonl"
        if not path.is_file():
            return []
        rows = []
        for raw in path.read_bytes().splitlines():
            if raw.strip():
                obj = json.loads(raw)
                if isinstance(obj, dict) and not obj.get("closing"):
                    rows.append(obj)
        return rows


@dataclass
class Ctx:
    """What every check shares: folders, the interpreter, the device, the deadline."""

    work: Path
    python: str
    cpu: bool
    probe: dict[str, Any]
    deadline: float
    env: dict[str, str]
    lane: str = "pure"
    build_src: Path | None = None
    """The default lane's built copy of src/ (its extensions must be the ones loaded)."""
    runs: dict[str, Run] = field(default_factory=dict)

    def device(self, index: int = 0) -> str:
        return "cpu" if self.cpu else f"cuda:{index}"

    @property
    def time_key(self) -> str:
        """The timing compared with the manual pairs: gpu_ms, cpu_ms in the CPU dry run."""
        return "cpu_ms" if self.cpu else "gpu_ms"

    def gpu_count(self) -> int:
        return int(self.probe.get("count") or 0)


def child_env(cpu: bool, src: Path = REPO / "src", pure: bool = True) -> dict[str, str]:
    """The environment of a lane's children: no inherited TRACEML_*, TraceML from
    ``src``, and ``TRACEML_PURE_PYTHON=1`` when ``pure``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    if pure:
        env["TRACEML_PURE_PYTHON"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_process(
    cmd: Sequence[str], env: dict[str, str], timeout: float, log_path: Path, cwd: Path
) -> tuple[int | None, bool, float]:
    """Run ``cmd`` in its own process group, output to ``log_path``; kill the group on timeout."""
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=max(1.0, timeout))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = None
        # Whatever it left behind (aggregator, ranks, DataLoader workers) goes too.
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                continue
            if not timed_out:
                break
    return rc, timed_out, time.monotonic() - t0


def run_traceml(
    ctx: Ctx,
    name: str,
    script: Path,
    args: Sequence[str],
    timeout: float,
    options: Sequence[str] = (),
) -> Run:
    """``traceml run --exporter jsonl --export-streams all ... SCRIPT ARGS`` with a timeout."""
    logs = ctx.work / "logs"
    result_path = ctx.work / f"{name}.result.json"
    result_path.unlink(missing_ok=True)
    shutil.rmtree(logs / name, ignore_errors=True)
    cmd = [
        ctx.python, "-m", "traceml_ai", "run",
        "--logs-dir", str(logs), "--run-name", name,
        "--exporter", "jsonl", "--export-streams", "all", "--interval", "0.2",
        *options, str(script), *(str(result_path) if a == "{result}" else a for a in args),
    ]  # fmt: skip
    log_path = ctx.work / f"{name}.log"
    rc, timed_out, seconds = run_process(cmd, ctx.env, timeout, log_path, ctx.work)
    result = None
    if result_path.is_file():
        try:
            result = json.loads(result_path.read_text(encoding="utf-8"))
        except ValueError:
            result = None
    log = log_path.read_text(encoding="utf-8", errors="replace")
    run = Run(
        name, rc, timed_out, seconds, log, logs / name / "aggregator" / "export", result, timeout
    )
    ctx.runs[name] = run
    return run


def run_scenario(ctx: Ctx, name: str, timeout: float, options: Sequence[str] = ()) -> Run:
    args = [name, "{result}", *(["--cpu"] if ctx.cpu else [])]
    return run_traceml(ctx, name, SCENARIO, args, timeout, options)


def validate_problems(ctx: Ctx, run: Run) -> list[str]:
    """``traceml validate`` on the run's export folder."""
    if not run.export.is_dir():
        return [f"no export folder {run.export}"]
    proc = subprocess.run(
        [ctx.python, "-m", "traceml_ai", "validate", str(run.export)],
        env=ctx.env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode == 0:
        return []
    lines = [ln.replace(f"{run.export}/", "") for ln in (proc.stdout + proc.stderr).splitlines()]
    bad = [ln for ln in lines if re.search(r"\.jsonl:\d+: ", ln)]
    first = bad[0] if bad else next((ln for ln in lines if ln.strip() and "OK" not in ln), "")
    more = f" ({len(bad)} problem lines)" if len(bad) > 1 else ""
    return [f"traceml validate: exit {proc.returncode}: {judge.one_line(first, 200)}{more}"]


def base_problems(ctx: Ctx, run: Run, need_result: bool = True) -> list[str]:
    """The run ended well, its files validate, and TraceML warned of no failure."""
    problems: list[str] = []
    why = run.failure(need_result)
    if why is not None:
        problems.append(why)
    problems += validate_problems(ctx, run)
    problems += judge.warning_problems(run.log)
    if run.result is not None and "extensions" in run.result:
        build = None if ctx.build_src is None else str(ctx.build_src)
        problems += judge.extension_problems(run.result["extensions"], RANK_EXTENSIONS, build)
    return problems


def _int_keys(mapping: dict[str, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in mapping.items()}


# -- checks -------------------------------------------------------------------------------


def check_train_cuda_1proc(ctx: Ctx, timeout: float) -> Verdict:
    name = "train_cuda_1proc"
    steps = 200
    dev = ctx.device()
    run = run_traceml(
        ctx,
        name,
        TRAIN,
        ["--device", "cpu" if ctx.cpu else "cuda", "--steps", str(steps), "--sleep-ms", "5"],
        timeout,
    )
    problems = base_problems(ctx, run, need_result=False)
    st = run.read("step_time")
    problems += judge.step_count_problems(st, steps)
    problems += judge.gpu_phase_problems(
        st,
        dev,
        required=(FORWARD, BACKWARD, OPTIMIZER, "extra_work"),
        optional=(H2D,),
        host=ctx.cpu,
    )
    if not ctx.cpu:
        problems += judge.step_memory_problems(run.read("step_memory"), dev, steps)
    proc = run.read("process")
    if not ctx.cpu and not any(r.get("gpu_available") is True for r in proc):
        problems.append("no process line says gpu_available true")
    first_ts = min((int(r["timestamp_unix_ns"]) for r in st), default=0)
    problems += judge.device_index_problems(proc, 0, 0, first_ts)
    fwd = judge.median_gpu_ms(st, FORWARD, dev, ctx.time_key)
    bwd = judge.median_gpu_ms(st, BACKWARD, dev, ctx.time_key)
    figures = (
        f"{len(st)} steps on {dev}, median gpu_ms forward {judge.fmt(fwd)} backward "
        f"{judge.fmt(bwd)}, {len(proc)} process lines, validate ok, {run.seconds:.1f} s"
    )
    return judge.verdict(name, problems, figures)


def nvidia_smi() -> tuple[list[dict[str, float | None]] | None, str]:
    """nvidia-smi's rows for judge.SMI_FIELDS (power.limit if enforced.power.limit is unknown)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi not found"
    for fields in (judge.SMI_FIELDS, tuple(f.replace("enforced.", "") for f in judge.SMI_FIELDS)):
        proc = subprocess.run(
            [exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if proc.returncode == 0:
            rows = judge.parse_nvidia_smi(proc.stdout, fields)
            for row in rows:
                row.setdefault("enforced.power.limit", row.get("power.limit"))
            return rows, proc.stdout.strip()
    return None, f"nvidia-smi exit {proc.returncode}: {judge.one_line(proc.stdout + proc.stderr)}"


def check_system_gpu(ctx: Ctx, timeout: float) -> Verdict:
    name = "system_gpu_vs_nvidia_smi"
    run = ctx.runs.get("train_cuda_1proc")
    smi, raw = nvidia_smi()
    if smi is None:
        return judge.skipped(name, raw) if ctx.cpu else judge.verdict(name, [raw], "")
    if run is None or not run.export.is_dir():
        return judge.verdict(name, ["no export of train_cuda_1proc to compare"], "")
    if not smi:
        return judge.verdict(name, ["nvidia-smi listed no GPU"], "", nvidia_smi=raw)
    snapshot = judge.last_snapshot(run.read("system_gpu"))
    problems = [] if snapshot else ["no system_gpu lines in train_cuda_1proc's export"]
    problems += judge.system_gpu_problems(snapshot, smi)
    first = snapshot[0] if snapshot else {}
    figures = (
        f"{len(snapshot)} GPU(s); gpu 0: {judge.fmt(first.get('temperature_c'))} °C "
        f"(nvidia-smi {judge.fmt(smi[0].get('temperature.gpu'))}), power limit "
        f"{judge.fmt(first.get('power_limit_w'))} W ({judge.fmt(smi[0].get('enforced.power.limit'))}), "
        f"memory total {judge.fmt((first.get('memory_total_bytes') or 0) / 2**20, 6)} MiB "
        f"({judge.fmt(smi[0].get('memory.total'), 6)})"
    )
    return judge.verdict(name, problems, figures, nvidia_smi=raw)


def check_train_cuda_2proc_nccl(ctx: Ctx, timeout: float) -> Verdict:
    name = "train_cuda_2proc_nccl"
    if not ctx.cpu and ctx.gpu_count() < 2:
        return judge.skipped(name, f"needs 2 GPUs, this machine has {ctx.gpu_count()}")
    steps = 100
    backend = "gloo" if ctx.cpu else "nccl"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = run_traceml(
        ctx,
        name,
        TRAIN,
        ["--device", "cpu" if ctx.cpu else "cuda", "--steps", str(steps)],
        timeout,
        options=["--nproc-per-node", "2", "--master-port", str(port)],
    )
    problems = base_problems(ctx, run, need_result=False)
    st = run.read("step_time")
    proc = run.read("process")
    for rank in (0, 1):
        mine = [r for r in st if r.get("global_rank") == rank]
        problems += judge.step_count_problems(mine, steps, rank)
        problems += [
            f"rank {rank}: {p}"
            for p in judge.gpu_phase_problems(
                mine,
                ctx.device(rank),
                (FORWARD, BACKWARD, OPTIMIZER),
                optional=(H2D,),
                host=ctx.cpu,
            )
        ]
        if not ctx.cpu:
            problems += judge.step_memory_problems(
                run.read("step_memory"), ctx.device(rank), steps, rank
            )
        first_ts = min((int(r["timestamp_unix_ns"]) for r in mine), default=0)
        problems += judge.device_index_problems(proc, rank, rank, first_ts)
    backends = {r.get("distributed_backend") for r in run.read("runtime_environment")}
    if backends != {backend}:
        problems.append(f"runtime_environment distributed_backend {sorted(map(str, backends))}")
    figures = f"2 ranks x {steps} steps, {backend}, {run.seconds:.1f} s"
    return judge.verdict(name, problems, figures)


def _agreement(
    ctx: Ctx,
    st: list[dict[str, Any]],
    manual: dict[str, Any],
    phases: dict[str, str],
    dev: str,
    skip: int,
) -> tuple[list[str], list[str]]:
    problems: list[str] = []
    parts: list[str] = []
    for label, phase in phases.items():
        ref = {k: float(v) for k, v in _int_keys(manual[label]).items()}
        found, figs = judge.agreement_problems(
            judge.traced_gpu_ms(st, phase, dev, ctx.time_key), ref, label, skip_first=skip
        )
        problems += found
        parts.append(
            f"{label} ratio median {judge.fmt(figs.get('median_ratio'))} "
            f"worst {judge.fmt(figs.get('worst_ratio'))}"
        )
    return problems, parts


def check_phase_agreement(ctx: Ctx, timeout: float) -> Verdict:
    name = "phase_agreement"
    run = run_scenario(ctx, name, timeout)
    problems = base_problems(ctx, run)
    if run.result is None:
        return judge.verdict(name, problems, "")
    dev = run.result["device"]
    st = run.read("step_time")
    problems += judge.step_count_problems(st, run.result["steps"])
    problems += judge.gpu_phase_problems(
        st, dev, (FORWARD, BACKWARD, OPTIMIZER, "work"), host=ctx.cpu
    )
    phases = {"forward": FORWARD, "backward": BACKWARD, "work": "work"}
    found, parts = _agreement(ctx, st, run.result["manual"], phases, dev, skip=2)
    figures = "traced/manual " + ", ".join(parts) + f" (±{judge.AGREEMENT_TOL:.0%})"
    return judge.verdict(name, problems + found, figures)


def check_exit_no_wait(ctx: Ctx, timeout: float) -> Verdict:
    name = "exit_no_wait"
    run = run_scenario(ctx, name, timeout)
    problems = base_problems(ctx, run)
    r = run.result
    if r is None:
        return judge.verdict(name, problems, "")
    dev = r["device"]
    st = run.read("step_time")
    problems += judge.exit_time_problems(r["step_exit_ms"], "step __exit__")
    problems += judge.exit_time_problems(r["phase_exit_ms"], "phase __exit__")
    queued_s = sum(float(v) for v in r["manual"]["sleep"].values()) / 1e3
    if not ctx.cpu and r["sync_wait_s"] < queued_s / 2:
        problems.append(
            f"only {r['sync_wait_s']:.2f} s of the {queued_s:.2f} s of GPU work was still queued "
            "after the loop: something in the loop waited for the GPU"
        )
    problems += judge.step_count_problems(st, r["steps"])
    problems += judge.gpu_phase_problems(
        st, dev, ("sleep", FORWARD, BACKWARD, OPTIMIZER), host=ctx.cpu
    )
    found, parts = _agreement(ctx, st, r["manual"], {"sleep": "sleep"}, dev, skip=0)
    figures = (
        f"step exit max {max(r['step_exit_ms']):.2f} ms, phase exit max "
        f"{max(r['phase_exit_ms']):.2f} ms (limit {judge.EXIT_LIMIT_MS:g}), loop "
        f"{r['host_loop_s']:.2f} s then {r['sync_wait_s']:.2f} s of queued GPU work; "
        + ", ".join(parts)
    )
    return judge.verdict(name, problems + found, figures)


def check_step_memory_peaks(ctx: Ctx, timeout: float) -> Verdict:
    name = "step_memory_peaks"
    run = run_scenario(ctx, name, timeout)
    problems = base_problems(ctx, run)
    r = run.result
    if r is None:
        return judge.verdict(name, problems, "")
    lines = run.read("step_memory")
    problems += judge.step_count_problems(lines, r["steps"])
    if ctx.cpu and not problems:
        return judge.skipped(name, "CPU dry run: the workload ran; no allocator statistics")
    peaks = _int_keys(r["torch_peaks"])
    problems += judge.alternating_peak_problems(
        lines, r["device"], r["big_steps"], r["big_bytes"], peaks
    )
    shown = [
        f"{int(x['step'])}:{(x.get('peak_allocated_bytes') or 0) / 2**20:.0f}"
        for x in sorted(lines, key=lambda x: int(x["step"]))
    ]
    figures = "peak MiB per step " + " ".join(shown) + " (odd steps allocate 1 GiB)"
    return judge.verdict(name, problems, figures)


def check_process_gpu_fields(ctx: Ctx, timeout: float) -> Verdict:
    name = "process_gpu_fields"
    run = run_scenario(ctx, name, timeout)
    problems = base_problems(ctx, run)
    r = run.result
    if r is None:
        return judge.verdict(name, problems, "")
    windows = r["windows"]
    if ctx.cpu and not problems:
        return judge.skipped(name, "CPU dry run: the workload ran; no GPU memory figures")
    problems += [
        f"window {i}: memory moved during it" for i, w in enumerate(windows) if not w["steady"]
    ]
    found, compared = judge.process_field_problems(
        run.read("process"), windows, r["device_index"], r["device_count"], r["total_memory"]
    )
    figures = (
        f"{compared} process lines compared on cuda:{r['device_index']} "
        f"(allocated {[w['allocated'] for w in windows]}, reserved {[w['reserved'] for w in windows]})"
    )
    return judge.verdict(name, problems + found, figures)


def check_side_stream(ctx: Ctx, timeout: float) -> Verdict:
    name = "side_stream"
    run = run_scenario(ctx, name, timeout)
    problems = base_problems(ctx, run)
    r = run.result
    if r is None:
        return judge.verdict(name, problems, "")
    st = run.read("step_time")
    problems += judge.step_count_problems(st, r["steps"])
    problems += judge.gpu_phase_problems(
        st, r["device"], ("side_wait", "side_inside", FORWARD, BACKWARD, OPTIMIZER), host=ctx.cpu
    )
    phases = {"side_wait": "side_wait", "side_inside": "side_inside"}
    found, parts = _agreement(ctx, st, r["manual"], phases, r["device"], skip=2)
    return judge.verdict(name, problems + found, "traced/manual " + ", ".join(parts))


def check_amp_skipped_steps(ctx: Ctx, timeout: float) -> Verdict:
    name = "amp_skipped_steps"
    run = run_scenario(ctx, name, timeout)
    problems = base_problems(ctx, run)
    r = run.result
    if r is None:
        return judge.verdict(name, problems, "")
    st = run.read("step_time")
    steps = r["steps"]
    skipped = r["skipped"]
    if skipped != r["poisoned"]:
        problems.append(
            f"GradScaler skipped steps {skipped}, the workload poisoned {r['poisoned']}"
        )
    problems += judge.step_count_problems(st, steps)
    problems += judge.gpu_phase_problems(
        st, r["device"], (FORWARD, BACKWARD), optional=(OPTIMIZER,), host=ctx.cpu
    )
    ran = [s for s in range(1, steps + 1) if s not in skipped]
    problems += judge.phase_presence_problems(st, OPTIMIZER, ran, skipped)
    figures = f"{len(st)} steps, skipped {skipped} (no optimizer phase), autocast float16"
    return judge.verdict(name, problems, figures)


def check_paired_overhead(ctx: Ctx, timeout: float) -> Verdict:
    name = "paired_overhead"
    run = run_scenario(ctx, name, timeout)
    problems = base_problems(ctx, run)
    r = run.result
    if r is None:
        return judge.verdict(name, problems, "")
    traced, by_hand, durations = r["traced"], r["by_hand"], r["durations"]
    med, step_us, pairs = judge.paired_overhead_us(traced, durations)
    hand, _, _ = judge.paired_overhead_us(by_hand, durations)
    problems += judge.step_count_problems(run.read("step_time"), sum(map(bool, traced)))
    beyond = None if med is None or hand is None else med - hand
    if beyond is None:
        problems.append("no traced or by-hand step measured with three untraced after it")
    elif beyond > judge.HOST_OVERHEAD_LIMIT_US:
        problems.append(
            f"a traced step costs {med:.1f} µs, {beyond:.1f} µs more than measuring it by "
            f"hand ({hand:.1f} µs; limit {judge.HOST_OVERHEAD_LIMIT_US:g} µs)"
        )
    figures = (
        f"paired_overhead_us={judge.fmt(med)} by_hand_us={judge.fmt(hand)} "
        f"beyond_by_hand_us={judge.fmt(beyond)} step_us={judge.fmt(step_us)} traced={pairs}"
    )
    return judge.verdict(
        name, problems, figures, paired_overhead_us=med, by_hand_us=hand, step_us=step_us
    )


def check_spawn_workers(ctx: Ctx, timeout: float) -> Verdict:
    name = "spawn_workers"
    args = ["{result}", *(["--cpu"] if ctx.cpu else [])]
    run = run_traceml(ctx, name, SPAWN, args, timeout)
    problems = base_problems(ctx, run)
    r = run.result
    if r is None:
        return judge.verdict(name, problems, "")
    st = run.read("step_time")
    problems += judge.step_count_problems(st, r["steps"])
    problems += judge.seq_problems(st, "step_time")
    proc = run.read("process")
    problems += judge.seq_problems(proc, "process")
    for stream, rows in (
        ("process", proc),
        ("runtime_environment", run.read("runtime_environment")),
    ):
        pids = sorted({int(x["pid"]) for x in rows})
        if pids != [r["pid"]]:
            problems.append(f"{stream} lines come from pids {pids}, the rank is {r['pid']}")
    problems += judge.gpu_phase_problems(
        st, ctx.device(), (FORWARD, BACKWARD, OPTIMIZER), optional=(H2D,), host=ctx.cpu
    )
    figures = f"{len(st)} steps with 2 spawn workers, rank pid {r['pid']}, {run.seconds:.1f} s"
    return judge.verdict(name, problems, figures)


def check_bounded_shutdown(ctx: Ctx, timeout: float) -> Verdict:
    name = "bounded_shutdown"
    run = run_scenario(ctx, name, timeout)
    problems = base_problems(ctx, run)
    r = run.result
    if r is None:
        return judge.verdict(name, problems, "")
    dev = r["device"]
    st = run.read("step_time")
    problems += judge.step_count_problems(st, r["steps"])
    early = [x for x in st if int(x["step"]) < r["steps"]]
    problems += judge.gpu_phase_problems(early, dev, (FORWARD, BACKWARD, OPTIMIZER), host=ctx.cpu)
    bounded = judge.shutdown_problems(r["shutdown_s"], r["queued_s"])
    problems += bounded
    last = next((x for x in st if int(x["step"]) == r["steps"]), None)
    queued = None if last is None else judge.timing(last, "queued", dev)
    if not bounded and not ctx.cpu and queued is not None and queued.get("gpu_ms") is not None:
        problems.append(f"the unfinished phase has gpu_ms {queued.get('gpu_ms')!r}, expected null")
    figures = (
        f"shutdown {r['shutdown_s']:.2f} s with {r['queued_s']:.0f} s of GPU work queued, "
        f"unfinished phase gpu_ms {None if queued is None else queued.get('gpu_ms')}, "
        f"run {run.seconds:.1f} s"
    )
    return judge.verdict(name, problems, figures)


def check_collectives_nccl(ctx: Ctx, timeout: float) -> Verdict:
    name = "collectives_nccl"
    run = run_scenario(ctx, name, timeout)
    problems = base_problems(ctx, run)
    r = run.result
    if r is None:
        return judge.verdict(name, problems, "")
    lines = run.read("collectives")
    problems += judge.collectives_problems(lines, r["steps"], device=not ctx.cpu)
    if r["syncs_during_steps"]:
        problems.append(f"{r['syncs_during_steps']} device synchronize call(s) during the steps")
    if not ctx.cpu and r["nccl_timing_env"] != "1":
        problems.append(f"TORCH_NCCL_ENABLE_TIMING is {r['nccl_timing_env']!r} under traceml run")
    waits = [x["wait_ms"] for x in lines if x.get("wait_ms") is not None]
    figures = (
        f"{r['backend']}: {len(lines)} collectives lines over {r['steps']} steps, "
        f"{sum(int(x['n_calls']) for x in lines)} calls, wait_ms "
        f"{judge.fmt(min(waits, default=None))}..{judge.fmt(max(waits, default=None))}, "
        f"measure {sorted({x['wait_measure'] for x in lines})}, "
        f"{r['syncs_during_steps']} synchronize calls"
    )
    return judge.verdict(name, problems, figures)


def _check_compile(ctx: Ctx, name: str, timeout: float) -> Verdict:
    run = run_scenario(ctx, name, timeout)
    problems = base_problems(ctx, run)
    r = run.result
    if r is None:
        return judge.verdict(name, problems, "")
    if r["error"]:
        problems.append(f"training raised {judge.one_line(r['error'], 200)}")
    st = run.read("step_time")
    problems += judge.step_count_problems(st, r["steps"])
    if r["graph_breaks"]:
        problems.append(f"{r['graph_breaks']} graph break(s): {r['graph_break_reasons']}")
    problems += judge.gpu_phase_problems(
        st, r["device"], (BACKWARD, OPTIMIZER), optional=(FORWARD, H2D), host=ctx.cpu
    )
    timed = sorted({p.removeprefix("_traceml_internal:") for x in st for p in x["events"]})
    figures = (
        f"model.compile({', '.join(f'{k}={v!r}' for k, v in r['options'].items())}): "
        f"{r['steps_done']}/{r['steps']} steps in {r['seconds']:.1f} s, phases {timed}, "
        f"graph breaks {r['graph_breaks']}"
    )
    return judge.verdict(name, problems, figures)


def check_compile_default(ctx: Ctx, timeout: float) -> Verdict:
    return _check_compile(ctx, "compile_default", timeout)


def check_compile_reduce_overhead(ctx: Ctx, timeout: float) -> Verdict:
    return _check_compile(ctx, "compile_reduce_overhead", timeout)


def check_compile_fullgraph(ctx: Ctx, timeout: float) -> Verdict:
    return _check_compile(ctx, "compile_fullgraph", timeout)


@dataclass(frozen=True)
class Check:
    """A check; ``track`` ``compile`` runs beside the ``main`` track, once the host
    timings are done."""

    name: str
    fn: Callable[[Ctx, float], Verdict]
    timeout: float
    track: str = "main"


CHECKS: tuple[Check, ...] = (
    # Host timings first, before the compile lane loads the CPUs.
    Check("paired_overhead", check_paired_overhead, 45),
    Check("train_cuda_1proc", check_train_cuda_1proc, 60),
    Check("system_gpu_vs_nvidia_smi", check_system_gpu, 30),
    Check("phase_agreement", check_phase_agreement, 45),
    Check("exit_no_wait", check_exit_no_wait, 45),
    Check("step_memory_peaks", check_step_memory_peaks, 45),
    Check("process_gpu_fields", check_process_gpu_fields, 45),
    Check("side_stream", check_side_stream, 45),
    Check("amp_skipped_steps", check_amp_skipped_steps, 45),
    Check("spawn_workers", check_spawn_workers, 60),
    Check("bounded_shutdown", check_bounded_shutdown, 70),
    Check("collectives_nccl", check_collectives_nccl, 60),
    Check("train_cuda_2proc_nccl", check_train_cuda_2proc_nccl, 90),
    Check("compile_default", check_compile_default, 100, track="compile"),
    Check("compile_reduce_overhead", check_compile_reduce_overhead, 100, track="compile"),
    Check("compile_fullgraph", check_compile_fullgraph, 100, track="compile"),
)


def run_check(ctx: Ctx, check: Check) -> Verdict:
    """One check within its timeout and the overall deadline; a crash is a FAIL."""
    left = ctx.deadline - time.monotonic() - 5.0
    if left < 15.0:
        return judge.skipped(check.name, "not run: this lane's share of the time budget is spent")
    timeout = min(check.timeout, left)
    t0 = time.monotonic()
    try:
        result = check.fn(ctx, timeout)
    except Exception as exc:
        result = judge.crashed(check.name, f"{type(exc).__name__}: {exc}")
    result.data.setdefault("seconds", round(time.monotonic() - t0, 2))
    say(f"[{ctx.lane}] {result.line()}")
    return result


def run_lane(ctx: Ctx, checks: Sequence[Check]) -> list[Verdict]:
    """Every check of one lane: the main track in order, the compile track in a thread
    beside it once the host timings are measured. Returns the verdicts in CHECKS order."""
    results: dict[str, Verdict] = {}
    main_track = [c for c in checks if c.track == "main"]
    side_track = [c for c in checks if c.track != "main"]
    host_timings_done = threading.Event()

    def run_side() -> None:
        host_timings_done.wait(timeout=120)
        for check in side_track:
            results[check.name] = run_check(ctx, check)

    side = threading.Thread(target=run_side, name=f"gpu-check-{ctx.lane}-compile", daemon=True)
    side.start()
    for check in main_track:
        results[check.name] = run_check(ctx, check)
        if check.name == "paired_overhead":
            host_timings_done.set()
    host_timings_done.set()
    # Each check's timeout ends by the deadline; its process group's kill takes <= 5 s.
    side.join(max(1.0, ctx.deadline + 15 - time.monotonic()))
    return [results.get(c.name) or judge.crashed(c.name, "did not finish in time") for c in checks]


_IMPORT_CHECK = """
import importlib, os, sys
src = os.path.realpath(sys.argv[1])
problems = []
for name in sys.argv[2:]:
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        problems.append(f"{name} does not load ({exc})")
        continue
    path = os.path.realpath(getattr(module, "__file__", None) or "")
    if not path.startswith(src + os.sep) or path.endswith(".py"):
        problems.append(f"{name} is not the compiled one ({path or 'no file'})")
print("\\n".join(problems))
"""


def build_extensions(
    python: str, env: dict[str, str], build: Path, timeout: float
) -> tuple[Path | None, str]:
    """Compile the C extensions as ``pip install`` does (``setup.py build_ext``), into a
    copy of ``src/`` under ``build``, and check that each loads from there.

    The copy keeps the checkout as it is; setup.py runs without pyproject.toml beside
    it, so a setuptools too old for the project's metadata still builds them (only the
    extensions are built). Returns (that src folder, a line on the build) or (None, why
    they did not build, in one line).
    """
    shutil.rmtree(build, ignore_errors=True)
    src = build / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", "*.egg-info")
    shutil.copytree(REPO / "src", src, ignore=ignore)
    shutil.copy2(REPO / "setup.py", build / "setup.py")
    log_path = build / "build.log"
    cmd = [
        python, "setup.py", "build_ext", "--build-lib", str(src),
        "--build-temp", str(build / "temp"), "--parallel", "3",
    ]  # fmt: skip
    rc, timed_out, seconds = run_process(cmd, env, timeout, log_path, build)
    log = log_path.read_text(encoding="utf-8", errors="replace")
    if timed_out or rc != 0:
        why = f"timed out after {timeout:.0f} s" if timed_out else f"exit code {rc}"
        return None, f"setup.py build_ext: {why}: {build_failure(log)}"
    check_env = {
        **env,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")])),
    }
    check_env.pop("TRACEML_PURE_PYTHON", None)
    proc = subprocess.run(
        [python, "-c", _IMPORT_CHECK, str(src), *EXTENSIONS],
        env=check_env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    problems = proc.stdout.split("\n") if proc.returncode == 0 else [proc.stderr[-300:]]
    problems = [p.strip() for p in problems if p.strip()]
    if problems:
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        why = f"{judge.one_line(problems[0], 160)}{more}; the build said: {build_failure(log)}"
        return None, judge.one_line(why, 400)
    built = ", ".join(EXTENSIONS)
    return src, f"C extensions built in {seconds:.1f} s ({built})"


def build_failure(log: str) -> str:
    """The line of a build's output that says what went wrong: the compiler's first
    error, else setuptools' first failure, else the last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for pattern in (r"\berror\b", r"failed|Error"):
        for line in lines:
            if re.search(pattern, line):
                return judge.one_line(line, 240)
    return judge.one_line(lines[-1], 240) if lines else "(no output)"


def probe(python: str, env: dict[str, str]) -> dict[str, Any]:
    """What torch sees, asked in a child process (this one never imports torch)."""
    code = (
        "import json, torch\n"
        "ok = torch.cuda.is_available() and torch.cuda.device_count() > 0\n"
        "n = torch.cuda.device_count() if ok else 0\n"
        "print(json.dumps({'available': bool(ok), 'count': n, 'torch': torch.__version__,"
        " 'cuda': torch.version.cuda,"
        " 'names': [torch.cuda.get_device_name(i) for i in range(n)],"
        " 'total_memory': [torch.cuda.get_device_properties(i).total_memory for i in range(n)]}))\n"
    )
    try:
        proc = subprocess.run(
            [python, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"available": False, "why": repr(exc)}
    if proc.returncode != 0:
        return {"available": False, "why": judge.one_line(proc.stderr[-300:])}
    info: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return info


def install_wheels(python: str, wheels: Path, site: Path) -> tuple[list[str], str | None]:
    """pip-install the wheels of ``wheels`` into ``site``.

    Returns (the folders to put on the children's path, why it failed or None); nothing
    to do when the folder has no wheel.
    """
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return [], None
    cmd = [
        python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, found),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return [], f"installing {len(found)} wheel(s) from {wheels} failed: " + judge.one_line(
            proc.stderr[-300:] or proc.stdout[-300:]
        )
    return [str(site)], None


def with_paths(env: dict[str, str], paths: Sequence[str]) -> dict[str, str]:
    """``env`` with ``paths`` after the folders already on its PYTHONPATH."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [env.get("PYTHONPATH"), *paths]))}


def run_one_lane(
    lane: str,
    python: str,
    cpu: bool,
    info: dict[str, Any],
    deadline: float,
    paths: Sequence[str],
    work: Path,
    checks: Sequence[Check],
) -> LaneResult:
    """One lane: for ``default``, build the C extensions first (the lane does not run
    when they do not build or load); then every check, with TraceML from that build
    (``default``) or from ``src/`` in pure Python (``pure``)."""
    if lane == "default":
        build_env = with_paths(child_env(cpu, pure=False), paths)
        timeout = min(BUILD_TIMEOUT_S, max(10.0, deadline - time.monotonic() - 30.0))
        src, note = build_extensions(python, build_env, work / "build", timeout)
        if src is None:
            return LaneResult(
                lane, [], "C extensions: did not build", f"the C extensions did not build: {note}"
            )
    else:
        src, note = REPO / "src", "pure Python (TRACEML_PURE_PYTHON=1)"
    say(f"gpu_check [{lane}]: TraceML {note}; {max(0.0, deadline - time.monotonic()):.0f} s left")
    env = with_paths(child_env(cpu, src, pure=lane == "pure"), paths)
    lane_work = work / lane
    lane_work.mkdir(parents=True, exist_ok=True)
    build_src = src if lane == "default" else None
    ctx = Ctx(lane_work, python, cpu, info, deadline, env, lane, build_src)
    return LaneResult(lane, run_lane(ctx, checks), note)


def write_report(out: Path, work: Path, lanes: Sequence[LaneResult], meta: dict[str, Any]) -> None:
    """gpu-check.json, gpu-check.txt and gpu-check-logs.tar.gz (logs, results, exports,
    the build's log; not the build's copy of src/) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    header = [f"# {k}: {v}" for k, v in meta.items()]
    (out / "gpu-check.txt").write_text(judge.report_text(lanes, header), encoding="utf-8")
    (out / "gpu-check.json").write_text(judge.report_json(lanes, meta), encoding="utf-8")
    skip = {work / "build" / "src", work / "build" / "temp"}

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        path = work / Path(info.name).relative_to("gpu-check-work")
        return None if path in skip else info

    with tarfile.open(out / "gpu-check-logs.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="gpu-check-work", filter=keep)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.gpu_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="report folder ($OUT or ./gpu-check-out)"
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="scratch folder (a new temp folder)"
    )
    parser.add_argument("--only", default="", help="comma-separated check names")
    parser.add_argument(
        "--lanes", default=",".join(LANES), help="comma-separated, in order: default, pure"
    )
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="both lanes together")
    parser.add_argument("--cpu", action="store_true", help="development: run on the CPU")
    parser.add_argument(
        "--wheels", type=Path, default=None, help="install the *.whl in this folder first"
    )
    parser.add_argument("--site", type=Path, default=Path("/tmp/gpu-check-site"))
    args = parser.parse_args(argv)
    lanes = [name for name in args.lanes.split(",") if name]
    if not lanes or set(lanes) - set(LANES) or len(set(lanes)) != len(lanes):
        parser.error(f"--lanes: one or more of {', '.join(LANES)}, each once")
    wanted = {n for n in args.only.split(",") if n}
    unknown = wanted - {c.name for c in CHECKS}
    if unknown:
        parser.error(f"unknown check(s): {sorted(unknown)}")
    if "system_gpu_vs_nvidia_smi" in wanted:
        wanted.add("train_cuda_1proc")  # its export is what nvidia-smi is compared with
    checks = [c for c in CHECKS if not wanted or c.name in wanted]
    started = time.monotonic()
    python = sys.executable
    info = probe(python, child_env(args.cpu))
    if not args.cpu and not info.get("available"):
        print(NO_CUDA_MESSAGE, flush=True)
        return NO_CUDA_EXIT
    paths: list[str] = []
    if args.wheels is not None:
        paths, why = install_wheels(python, args.wheels, args.site)
        if why is not None:
            print(f"gpu_check: {why}", flush=True)
            return WHEELS_EXIT
    out = args.out or Path(os.environ.get("OUT") or Path.cwd() / "gpu-check-out")
    work = (args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    names = ", ".join(info.get("names") or ["cpu"])
    say(
        f"gpu_check: {names}; torch {info.get('torch')}, CUDA {info.get('cuda')}; lanes "
        f"{', '.join(lanes)}; budget {args.budget_s:.0f} s{'; CPU DRY RUN' if args.cpu else ''}"
    )
    deadline = started + args.budget_s
    # What a lane leaves for each lane after it.
    reserve = min(PURE_LANE_S, args.budget_s / len(lanes))
    results: list[LaneResult] = []
    for i, lane in enumerate(lanes):
        lane_deadline = deadline - reserve * (len(lanes) - 1 - i)
        result = run_one_lane(lane, python, args.cpu, info, lane_deadline, paths, work, checks)
        results.append(result)
        say(result.summary())
    meta = {
        "device": names,
        "torch": info.get("torch"),
        "cuda": info.get("cuda"),
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_dry_run": args.cpu,
        "lanes": ", ".join(lanes),
        "seconds": round(time.monotonic() - started, 1),
        "work": str(work),
    }
    try:
        write_report(out, work, results, meta)
    except OSError as exc:
        say(f"gpu_check: could not write the report in {out}: {exc}")
    say(judge.final_line(results))
    return judge.lanes_exit_code(results)
