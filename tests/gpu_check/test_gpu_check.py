"""The GPU check (scripts/gpu-check.sh) on a machine without a GPU.

What can be checked here: the script's no-CUDA exit, the pure judgements that decide
PASS or FAIL on a GPU (scripts/gpu_check/judge.py, fed made-up lines), and the
harness end to end in its CPU dry run on one quick check, in both lanes: the default
lane's C extensions built (and, with a compiler that fails, one line saying so while
the pure lane still runs) and the pure-Python lane.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from scripts.gpu_check import driver, judge
from tests.e2e_helpers import REPO

pytestmark = pytest.mark.slow  # real runs, subprocesses or receivers (docs/testing.md)

SCRIPT = REPO / "scripts" / "gpu-check.sh"

FWD = judge.FORWARD
BWD = judge.BACKWARD
OPT = judge.OPTIMIZER
STEP = judge.STEP
DL = judge.DATALOADER


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACEML_", "OUT"))}
    env.update(extra)
    return env


def gpu(ms: float, **over: Any) -> dict[str, Any]:
    t = {"cpu_ms": 0.05, "duration_ms": ms, "gpu_ms": ms, "is_gpu": True, "n_calls": 1}
    t.update(over)
    return t


def host(ms: float) -> dict[str, Any]:
    return {"cpu_ms": ms, "duration_ms": ms, "gpu_ms": None, "is_gpu": False, "n_calls": 1}


def step_line(
    step: int, phases: dict[str, dict[str, Any]], device: str = "cuda:0"
) -> dict[str, Any]:
    events = {name: {device: t} for name, t in phases.items()}
    return {"step": step, "global_rank": 0, "seq": step - 1, "events": events}


def good_step(step: int, fwd: float = 5.0) -> dict[str, Any]:
    return step_line(step, {FWD: gpu(fwd), BWD: gpu(10.0), OPT: gpu(1.0), STEP: host(20.0)})


# -- the script --------------------------------------------------------------------------


def test_no_cuda_exits_3_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "no-wheels")],
        env=_env(GPU_CHECK_PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="", OUT=str(out)),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout == "gpu_check: no CUDA device: nothing to check\n"
    assert not out.exists()


def _dry_run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m scripts.gpu_check --cpu`` from the repository root, as the script runs it."""
    return subprocess.run(
        [
            *(sys.executable, "-m", "scripts.gpu_check", "--cpu", "--only", "amp_skipped_steps"),
            *("--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *args),
        ],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def test_cpu_dry_run_of_one_check_in_both_lanes_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _dry_run(tmp_path)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert lines[0].startswith("gpu_check: cpu; torch ") and "lanes default, pure" in lines[0]
    # The default lane first: the C extensions built into the scratch copy of src/.
    assert lines[1].startswith("gpu_check [default]: TraceML C extensions built in ")
    assert lines[2].startswith("[default] PASS amp_skipped_steps: 8 steps, skipped [3, 6]")
    assert lines[3] == "gpu_check [default]: 1 passed, 0 failed, 0 skipped"
    assert lines[4].startswith("gpu_check [pure]: TraceML pure Python (TRACEML_PURE_PYTHON=1)")
    assert lines[5].startswith("[pure] PASS amp_skipped_steps: 8 steps, skipped [3, 6]")
    assert lines[6] == "gpu_check [pure]: 1 passed, 0 failed, 0 skipped"
    assert lines[7] == (
        "gpu_check: default 1 passed, 0 failed, 0 skipped; pure 1 passed, 0 failed, 0 skipped"
    )
    assert len(lines) == 8
    # Each lane's rank ran the code it meant to: the build's extensions, or none.
    build_src = (tmp_path / "work" / "build" / "src").resolve()
    for lane, expected in (("default", set(driver.RANK_EXTENSIONS)), ("pure", set())):
        result = json.loads(
            (tmp_path / "work" / lane / "amp_skipped_steps.result.json").read_text()
        )
        assert set(result["extensions"]) == expected, lane
        assert all(path.startswith(str(build_src)) for path in result["extensions"].values())
    report = json.loads((out / "gpu-check.json").read_text())
    assert [lane["lane"] for lane in report["lanes"]] == ["default", "pure"]
    assert all(lane["passed"] == 1 and lane["not_run"] is None for lane in report["lanes"])
    assert report["lanes"][0]["checks"][0]["name"] == "amp_skipped_steps"
    assert report["summary"] == lines[-1] and report["exit_code"] == 0
    assert (out / "gpu-check.txt").read_text().splitlines()[-1] == lines[-1]
    assert (out / "gpu-check-logs.tar.gz").stat().st_size > 0


def test_extensions_that_do_not_build_fail_the_default_lane_in_one_line(tmp_path: Path) -> None:
    """A compiler that fails (setup.py's extensions are optional, so the build itself
    exits 0): one line says the default lane did not run and why, the pure lane runs,
    and the exit status is 5."""
    proc = _dry_run(tmp_path, CC="/bin/false")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert lines[1].startswith(
        "gpu_check [default]: not run: the C extensions did not build: "
        "traceml_records._speedups does not load"
    ), lines[1]
    assert "failed" in lines[1] and "\n" not in lines[1]
    assert lines[2].startswith("gpu_check [pure]: TraceML pure Python")
    assert lines[3].startswith("[pure] PASS amp_skipped_steps:")
    assert lines[-1] == "gpu_check: default not run; pure 1 passed, 0 failed, 0 skipped"
    report = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert report["exit_code"] == 5 and report["lanes"][0]["checks"] == []


def test_lanes_option() -> None:
    with pytest.raises(SystemExit):
        driver.main(["--cpu", "--lanes", "default,fast"])
    with pytest.raises(SystemExit):
        driver.main(["--cpu", "--lanes", "pure,pure"])


# -- verdicts and report -------------------------------------------------------------------


def test_verdict_lines_summary_and_exit_code() -> None:
    ok = judge.verdict("a", [], "1.0 ms")
    bad = judge.verdict("b", ["p1", "p2", "p3", "p4"], "figs")
    skip = judge.skipped("c", "needs 2 GPUs")
    crash = judge.crashed("d", "Traceback\n  ValueError: boom")
    assert ok.line() == "PASS a: 1.0 ms"
    assert bad.line() == "FAIL b: p1; p2; p3 (and 1 more) | figs"
    assert skip.line() == "SKIP c: needs 2 GPUs"
    assert crash.line() == "FAIL d: crashed: Traceback ValueError: boom"
    assert "\n" not in judge.verdict("e", ["a\nb"], "x\ny").line()
    everything = [ok, bad, skip, crash]
    assert judge.summary_line(everything) == "gpu_check: 1 passed, 2 failed, 1 skipped"
    assert judge.exit_code(everything) == 1
    assert judge.exit_code([ok, skip]) == 0
    assert judge.one_line("x" * 500, 10) == "xxxxxxx..."


def test_lanes_report_separately() -> None:
    ok = judge.verdict("a", [], "1.0 ms")
    bad = judge.verdict("b", ["p1", "p2", "p3", "p4"], "figs")
    skip = judge.skipped("c", "needs 2 GPUs")
    default = judge.LaneResult("default", [ok, bad], "C extensions built")
    pure = judge.LaneResult("pure", [ok, skip], "pure Python")
    assert default.summary() == "gpu_check [default]: 1 passed, 1 failed, 0 skipped"
    assert judge.final_line([default, pure]) == (
        "gpu_check: default 1 passed, 1 failed, 0 skipped; pure 1 passed, 0 failed, 1 skipped"
    )
    assert judge.lanes_exit_code([default, pure]) == 1
    assert judge.lanes_exit_code([pure]) == 0
    text = judge.report_text([default, pure], ["# device: H200"])
    assert text.splitlines() == [
        "# device: H200",
        "# lane default: C extensions built",
        "[default] PASS a: 1.0 ms",
        "[default] FAIL b: p1; p2; p3 (and 1 more) | figs",
        "gpu_check [default]: 1 passed, 1 failed, 0 skipped",
        "# lane pure: pure Python",
        "[pure] PASS a: 1.0 ms",
        "[pure] SKIP c: needs 2 GPUs",
        "gpu_check [pure]: 1 passed, 0 failed, 1 skipped",
        "gpu_check: default 1 passed, 1 failed, 0 skipped; pure 1 passed, 0 failed, 1 skipped",
    ]
    doc = json.loads(judge.report_json([default, pure], {"device": "H200"}))
    assert doc["lanes"][0]["failed"] == 1 and doc["lanes"][1]["skipped"] == 1
    assert doc["lanes"][0]["checks"][1]["data"]["problems"][3] == "p4"
    assert doc["exit_code"] == 1
    broken = judge.LaneResult("default", [], "C extensions: did not build", "no\ncompiler")
    assert broken.summary() == "gpu_check [default]: not run: no compiler"
    assert judge.final_line([broken, pure]).startswith("gpu_check: default not run; pure 1")
    # A lane that did not run decides the exit status, whatever the other lane gave.
    assert judge.lanes_exit_code([broken, pure]) == judge.NOT_RUN_EXIT == 5


def test_each_lane_runs_its_own_extensions() -> None:
    build = "/tmp/w/build/src"
    mine = {n: f"{build}/{n.replace('.', '/')}.cpython-312-x86_64-linux-gnu.so" for n in
            driver.RANK_EXTENSIONS}  # fmt: skip
    assert judge.extension_problems(mine, driver.RANK_EXTENSIONS, build) == []
    assert judge.extension_problems(mine, driver.RANK_EXTENSIONS, build + "/") == []
    partial = {k: v for k, v in mine.items() if "_nowait" not in k}
    assert judge.extension_problems(partial, driver.RANK_EXTENSIONS, build) == [
        "the rank did not load the C extension traceml_ai.transport._nowait"
    ]
    elsewhere = {
        **mine,
        "traceml_ai.rank._timing.hotpath": "/site/traceml_ai/rank/_timing/hotpath.so",
    }
    assert judge.extension_problems(elsewhere, driver.RANK_EXTENSIONS, "/tmp/w/build/src") == [
        "the rank loaded traceml_ai.rank._timing.hotpath from /site/traceml_ai/rank/_timing/hotpath.so, "
        "not from the lane's build"
    ]
    assert judge.extension_problems({}, driver.RANK_EXTENSIONS, None) == []
    assert judge.extension_problems(partial, driver.RANK_EXTENSIONS, None) == [
        f"TRACEML_PURE_PYTHON=1, yet the rank loaded {name}" for name in sorted(partial)
    ]


def test_build_failure_names_the_compiler_error() -> None:
    log = (
        "running build_ext\nbuilding 'traceml_records._speedups' extension\n"
        "src/traceml_records/_speedups.c:1:10: fatal error: Python.h: No such file or directory\n"
        'warning: build_ext: building extension "traceml_records._speedups" failed: ...\n'
    )
    assert driver.build_failure(log) == (
        "src/traceml_records/_speedups.c:1:10: fatal error: Python.h: No such file or directory"
    )
    assert driver.build_failure("a\nwarning: building extension x failed: y\nb\n") == (
        "warning: building extension x failed: y"
    )
    assert driver.build_failure("") == "(no output)"


def test_tolerances() -> None:
    assert judge.within_rel(1.2, 1.0, 0.2)
    assert not judge.within_rel(1.21, 1.0, 0.2)
    assert judge.within_rel(0.8, 1.0, 0.2)
    assert not judge.within_rel(None, 1.0, 0.2)
    assert not judge.within_rel(float("nan"), 1.0, 0.2)
    assert judge.within_rel(0.0, 0.0, 0.0)
    assert not judge.within_rel(1.0, 0.0, 0.5)
    assert judge.within_abs(40.0, 49.5, 10.0)
    assert not judge.within_abs(40.0, 50.5, 10.0)
    assert not judge.within_abs(None, 1.0, 10.0)


# -- step_time -------------------------------------------------------------------------------


def test_gpu_phases_pass_when_every_gpu_phase_has_device_time() -> None:
    lines = [good_step(s) for s in range(1, 4)]
    assert judge.gpu_phase_problems(lines, "cuda:0", (FWD, BWD, OPT)) == []
    assert judge.step_count_problems(lines, 3) == []
    assert judge.seq_problems(lines, "step_time") == []


@pytest.mark.parametrize(
    ("timing", "expected"),
    [
        (gpu(5.0, gpu_ms=None, duration_ms=0.05, is_gpu=False), "forward_time gpu_ms null"),
        (gpu(0.0), "forward_time gpu_ms 0.0 not > 0"),
        (gpu(5.0, duration_ms=0.05), "forward_time duration_ms 0.05 != gpu_ms 5.0"),
        (gpu(5.0, is_gpu=False), "forward_time is_gpu False"),
    ],
)
def test_gpu_phase_faults_are_named(timing: dict[str, Any], expected: str) -> None:
    lines = [good_step(1), step_line(2, {FWD: timing, BWD: gpu(1.0), OPT: gpu(1.0)})]
    assert judge.gpu_phase_problems(lines, "cuda:0", (FWD, BWD, OPT)) == [
        f"{expected} in 1 step(s), first step 2"
    ]


def test_gpu_phase_missing_wrong_device_and_host_only() -> None:
    lines = [
        step_line(1, {BWD: gpu(1.0), OPT: gpu(1.0)}),
        step_line(2, {FWD: gpu(1.0), BWD: gpu(1.0), OPT: gpu(1.0)}, device="cuda:1"),
        step_line(3, {FWD: gpu(1.0), BWD: gpu(1.0), OPT: gpu(1.0), DL: gpu(2.0)}),
    ]
    problems = judge.gpu_phase_problems(lines, "cuda:0", (FWD, BWD, OPT))
    assert "forward_time missing in 1 step(s), first step 1" in problems
    assert any("has device keys ['cuda:1'], not cuda:0" in p for p in problems)
    assert any(p.startswith("dataloader_next gpu_ms 2.0 (host-only phase)") for p in problems)
    # An optional phase is judged only where present; the CPU dry run judges host time.
    assert judge.gpu_phase_problems(lines[2:], "cuda:0", (FWD,), optional=("work",)) != []
    cpu_line = step_line(1, {FWD: host(1.0)}, device="cpu")
    assert judge.gpu_phase_problems([cpu_line], "cpu", (FWD,), host=True) == []
    assert judge.gpu_phase_problems([cpu_line], "cpu", (FWD,)) != []


def test_step_counts_and_seq() -> None:
    lines = [good_step(1), good_step(2), good_step(2)]
    assert judge.step_count_problems(lines, 3) == [
        "rank 0: 3 step lines (1 repeated), expected steps 1..3"
    ]
    lines[2]["seq"] = 0
    assert judge.seq_problems(lines, "process") != []


def test_agreement_within_and_outside_tolerance() -> None:
    manual = {1: 50.0, 2: 5.0, 3: 5.0, 4: 5.0}
    traced: dict[int, float | None] = {1: 1.0, 2: 1.0, 3: 4.5, 4: 5.9}
    problems, figures = judge.agreement_problems(traced, manual, "forward")
    assert problems == []
    assert figures["n"] == 2 and figures["median_ratio"] == pytest.approx(1.04)
    assert figures["worst_ratio"] == pytest.approx(1.18)
    traced[4] = 6.5
    traced[3] = None
    problems, _ = judge.agreement_problems(traced, manual, "forward")
    assert problems[0] == "forward step 3: traced gpu_ms missing or null"
    assert problems[1].startswith("forward step 4: traced 6.5 ms vs manual 5 ms (ratio 1.3")
    assert judge.agreement_problems({}, {1: 1.0}, "x")[0] == ["x: no step to compare"]


def test_traced_gpu_ms_and_median() -> None:
    lines = [good_step(1, 4.0), good_step(2, 6.0), step_line(3, {FWD: host(1.0)})]
    assert judge.traced_gpu_ms(lines, FWD, "cuda:0") == {1: 4.0, 2: 6.0, 3: None}
    assert judge.traced_gpu_ms(lines, FWD, "cuda:0", "cpu_ms")[3] == 1.0
    assert judge.median_gpu_ms(lines, FWD, "cuda:0") == 5.0
    assert judge.median_gpu_ms([], FWD, "cuda:0") is None


def test_phase_presence() -> None:
    lines = [good_step(1), step_line(2, {FWD: gpu(1.0)}), good_step(3)]
    assert judge.phase_presence_problems(lines, OPT, [1, 3], [2]) == []
    assert judge.phase_presence_problems(lines, OPT, [2], [3]) == [
        "step 2: optimizer_step missing",
        "step 3: optimizer_step present, but that step did not run it",
    ]


# -- step_memory ------------------------------------------------------------------------------

GIB = 1 << 30


def mem_line(
    step: int, alloc: int | None, reserved: int | None = None, device: str = "cuda:0"
) -> dict[str, Any]:
    return {
        "step": step,
        "global_rank": 0,
        "device": device,
        "peak_allocated_bytes": alloc,
        "peak_reserved_bytes": alloc if reserved is None else reserved,
    }


def test_alternating_peaks() -> None:
    lines = [mem_line(s, (GIB if s % 2 else 0) + 50_000_000) for s in range(1, 7)]
    torch_peaks = {int(x["step"]): [x["peak_allocated_bytes"]] * 2 for x in lines}
    assert judge.alternating_peak_problems(lines, "cuda:0", [1, 3, 5], GIB, torch_peaks) == []
    # Peaks that never reset (the run's maximum every step) are caught.
    flat = [mem_line(s, GIB + 50_000_000) for s in range(1, 5)]
    assert judge.alternating_peak_problems(flat, "cuda:0", [1, 3], GIB) == [
        "step 2 allocated little but its peak is 1123741824 B",
        "step 4 allocated little but its peak is 1123741824 B",
    ]
    torch_peaks[2] = [1, 2]
    problems = judge.alternating_peak_problems(lines, "cuda:0", [1, 3, 5], GIB, torch_peaks)
    assert problems == [
        "step 2: peak_allocated_bytes 50000000 != torch.cuda.max_memory_allocated 1",
        "step 2: peak_reserved_bytes 50000000 != torch.cuda.max_memory_reserved 2",
    ]
    nulls = [mem_line(1, None), mem_line(2, 5, device="cpu")]
    assert judge.alternating_peak_problems(nulls, "cuda:0", [1], GIB) == [
        "step 1: peak_allocated_bytes None",
        "step 2: device 'cpu', expected cuda:0",
    ]
    assert judge.alternating_peak_problems([], "cuda:0", [1], GIB) == ["no step_memory lines"]


def test_step_memory_lines() -> None:
    assert judge.step_memory_problems([mem_line(1, 10), mem_line(2, 20)], "cuda:0", 2) == []
    problems = judge.step_memory_problems([mem_line(1, None)], "cuda:0", 1)
    assert problems == [
        "rank 0: 1 step_memory line(s) wrong, first step 1: device 'cuda:0', peaks None/None "
        "(expected cuda:0, > 0)"
    ]


# -- process ----------------------------------------------------------------------------------


def proc_line(ts: int, seq: int, **over: Any) -> dict[str, Any]:
    line = {
        "timestamp_unix_ns": ts,
        "seq": seq,
        "global_rank": 0,
        "gpu_available": True,
        "gpu_count": 1,
        "gpu_device_index": 0,
        "gpu_memory_total_bytes": 100,
        "gpu_memory_used_bytes": 10,
        "gpu_memory_reserved_bytes": 20,
    }
    line.update(over)
    return line


def test_process_fields_inside_steady_windows() -> None:
    windows = [
        {"t0_ns": 100, "t1_ns": 200, "allocated": 10, "reserved": 20},
        {"t0_ns": 300, "t1_ns": 400, "allocated": 30, "reserved": 40},
    ]
    lines = [
        proc_line(50, 0, gpu_memory_used_bytes=999),  # outside every window: not judged
        proc_line(150, 1),
        proc_line(350, 2, gpu_memory_used_bytes=30, gpu_memory_reserved_bytes=40),
    ]
    assert judge.process_field_problems(lines, windows, 0, 1, 100) == ([], 2)
    lines[2]["gpu_device_index"] = 1
    problems, compared = judge.process_field_problems(lines, windows, 0, 1, 100)
    assert compared == 2 and problems == ["window 1 seq 2: gpu_device_index 1 != 0"]
    problems, _ = judge.process_field_problems(lines[:2], windows, 0, 1, 100)
    assert problems == ["window 1: no process line taken inside it"]


def test_device_index_of_each_rank() -> None:
    lines = [proc_line(10, 0), proc_line(20, 1, global_rank=1), proc_line(30, 2, global_rank=1)]
    assert judge.device_index_problems(lines, 1, 1, 15) == [
        "rank 1: 2 process line(s) say gpu_device_index 0, its device is cuda:1"
    ]
    assert judge.device_index_problems(lines, 0, 0, 0) == []


# -- system_gpu vs nvidia-smi -----------------------------------------------------------------

SMI = "0, 143771, 600, 35, 120.5, 700.00, 3\n1, 143771, [N/A], 36, 110.0, 700.00, 0\n"


def sys_gpu(index: int, seq: int = 5, **over: Any) -> dict[str, Any]:
    line = {
        "node_rank": 0,
        "seq": seq,
        "gpu_index": index,
        "utilization_percent": 4.0,
        "memory_used_bytes": 600 * 2**20,
        "memory_total_bytes": 143771 * 2**20,
        "temperature_c": 33.0,
        "power_usage_w": 118.2,
        "power_limit_w": 700.0,
    }
    line.update(over)
    return line


def test_parse_nvidia_smi() -> None:
    rows = judge.parse_nvidia_smi(SMI)
    assert rows[0]["memory.total"] == 143771.0 and rows[0]["enforced.power.limit"] == 700.0
    assert rows[1]["memory.used"] is None and rows[1]["index"] == 1.0
    with pytest.raises(ValueError, match="2 cells"):
        judge.parse_nvidia_smi("1, 2\n")


def test_system_gpu_against_nvidia_smi() -> None:
    smi = judge.parse_nvidia_smi(SMI)
    lines = [sys_gpu(0, seq=4, temperature_c=99.0), sys_gpu(0), sys_gpu(1)]
    snapshot = judge.last_snapshot(lines)
    assert [x["seq"] for x in snapshot] == [5, 5]
    assert judge.system_gpu_problems(snapshot, smi) == []
    wrong = [
        sys_gpu(0, power_limit_w=700_000.0, power_usage_w=118_200.0),  # milliwatts
        sys_gpu(1, memory_total_bytes=143771 * 1024, temperature_c=50.0),  # KiB; 14 °C off
    ]
    problems = judge.system_gpu_problems(wrong, smi)
    assert problems == [
        "gpu 0: power_limit_w 700000.0 vs nvidia-smi 700.0 W",
        "gpu 0: power_usage_w 118200.0 outside 0..840 W",
        f"gpu 1: memory_total_bytes {143771 * 1024} vs nvidia-smi 143771.0 MiB",
        f"gpu 1: memory_used_bytes {600 * 2**20} (total {143771 * 1024})",
        "gpu 1: temperature_c 50.0 vs nvidia-smi 36.0 °C",
    ]
    assert judge.system_gpu_problems(snapshot[:1], smi)[0] == (
        "1 GPU line(s) in the snapshot, nvidia-smi lists 2"
    )


# -- host timings -------------------------------------------------------------------------------


def test_exit_times() -> None:
    assert judge.exit_time_problems([0.1, 49.9], "step __exit__") == []
    assert judge.exit_time_problems([0.1, 980.0], "step __exit__") == [
        "step __exit__ of step 2 took 980.0 ms with GPU work queued (limit 50 ms)"
    ]
    assert judge.exit_time_problems([], "x") == ["x: nothing measured"]


def test_paired_overhead_counts_own_time_and_what_spills_into_the_next_steps() -> None:
    # traced, plain x3, by-hand, plain x3: each kind's cost over the third step after it.
    kinds = ["traced", "plain", "plain", "plain", "by_hand", "plain", "plain", "plain"] * 6
    own = {"traced": 30e-6, "by_hand": 50e-6}
    durations = []
    for i, kind in enumerate(kinds):
        after = kinds[i - 1] if i else "plain"  # the step right after a marked one pays 10 µs
        durations.append(0.001 + own.get(kind, 0.0) + (10e-6 if after in own else 0.0))
    durations[16] = 1.0  # one outlier does not move the median
    traced = [k == "traced" for k in kinds]
    by_hand = [k == "by_hand" for k in kinds]
    med, step_us, count = judge.paired_overhead_us(traced, durations, warmup=0)
    assert count == 6 and med == pytest.approx(40.0) and step_us == pytest.approx(1000.0)
    hand, _, _ = judge.paired_overhead_us(by_hand, durations, warmup=0)
    assert hand == pytest.approx(60.0)
    assert judge.paired_overhead_us([True], [0.1], warmup=0) == (None, None, 0)


def test_shutdown_and_warnings() -> None:
    assert judge.shutdown_problems(2.0, 24.0) == []
    assert judge.shutdown_problems(23.9, 24.0) == [
        "shutdown took 23.9 s with 24 s of GPU work queued (limit 12 s): it waits for the GPU"
    ]
    log = (
        "step 1\nUserWarning: TraceML step timing failed and is now off for this run "
        "(RuntimeError('x')); training continues.\nTraceML process sampling failed\n"
    )
    assert len(judge.warning_problems(log)) == 2
    assert judge.warning_problems("all fine\n") == []


def test_run_tail_names_the_exception() -> None:
    run = driver.Run(
        "x",
        1,
        False,
        1.0,
        "Traceback (most recent call last):\n  File a\nRuntimeError: CUDA error\ntraceml: rank 0 exited 1\n",
        Path("/nonexistent"),
        None,
        10.0,
    )
    assert run.failure() == "exit code 1: RuntimeError: CUDA error"
    assert run.read("step_time") == []
    timed_out = driver.Run("x", None, True, 10.0, "", Path("/x"), {}, 10.0)
    assert timed_out.failure() == "timed out after 10 s: (no output)"


def test_cpu_dry_run_of_the_collectives_check(tmp_path: Path) -> None:
    """The NCCL collectives check, dry on gloo: DDP's bucket, the script's all_reduce and
    all_gather each step, waits measured, no synchronize."""
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "scripts.gpu_check", "--cpu", "--only", "collectives_nccl"),
            *("--lanes", "pure", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w")),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[pure] PASS collectives_nccl: gloo: " in proc.stdout
    assert "0 synchronize calls" in proc.stdout


def test_collectives_judge_names_what_is_wrong() -> None:
    def line(step: int, op: str, source: str, **kw: Any) -> dict[str, Any]:
        base = {
            "step": step,
            "op": op,
            "source": source,
            "wait_ms": 1.0,
            "wait_measure": "device",
            "first_arrival_ms": 1.0,
            "last_arrival_ms": 2.0,
        }
        return {**base, **kw}

    good = [
        line(1, "all_reduce", "ddp_comm_hook"),
        line(1, "all_reduce", "torch.distributed"),
        line(1, "all_gather", "torch.distributed"),
    ]
    assert judge.collectives_problems(good, 1, device=True) == []
    unmeasured = [{**good[0], "wait_ms": None, "wait_measure": "none"}, *good[1:]]
    found = judge.collectives_problems(unmeasured, 1, device=True)
    assert any("wait_measure 'none'" in p for p in found)
    assert any("wait_ms None" in p for p in found)
    assert judge.collectives_problems(good[:2], 1, device=True) == [
        "step 1: collectives [('ddp_comm_hook', 'all_reduce'), ('torch.distributed', 'all_reduce')]"
    ]


def test_collectives_judge_takes_ddps_construction_broadcast_as_host_time() -> None:
    """On NCCL, DDP's parameter broadcast when the model is wrapped returns no Work:
    its host time is what the rank can say (a real H200 run wrote it so)."""
    lines = [
        {
            "step": step,
            "op": op,
            "source": source,
            "wait_ms": 0.5,
            "wait_measure": measure,
            "first_arrival_ms": 0.0,
            "last_arrival_ms": 0.0,
        }
        for step, op, source, measure in (
            (1, "broadcast", "torch.distributed", "host"),
            (1, "all_reduce", "ddp_comm_hook", "device"),
            (1, "all_reduce", "torch.distributed", "device"),
            (1, "all_gather", "torch.distributed", "device"),
        )
    ]
    assert judge.collectives_problems(lines, 1, device=True) == []
    device_broadcast = [{**lines[0], "wait_measure": "device"}, *lines[1:]]
    assert judge.collectives_problems(device_broadcast, 1, device=True) == [
        "step 1 broadcast: wait_measure 'device'"
    ]
