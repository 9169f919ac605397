"""``traceml summary`` on damaged input: every figure plausible or flagged, one clear
line per thing it could not read, never ``files: complete`` then, exit status 1.

Real files, folders, FIFOs and symbolic links; real ``traceml summary`` processes where
the command line is involved.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e_helpers import clean_env, run_cli, traceml_cmd
from tests.summary_helpers import format_json, summarize_json
from tests.traceml_ai.analysis.test_summary import closing, run_folder, step_line, write
from traceml_ai.analysis import RunSummary, SummaryError

P = "_traceml_internal:"


def _export(run: Path) -> Path:
    return run / "aggregator" / "export"


def _two_ranks(steps: int = 30) -> list[dict[str, Any]]:
    return [
        step_line(r, s, 2, {"step": 10.0 + r, "forward_time": 2.0, "backward_time": 5.0})
        for s in range(1, steps + 1)
        for r in range(2)
    ]


def _process_line(seq: int, cpu: float, cores: int | None, ram: int = 1 << 20) -> dict[str, Any]:
    ident = {k: v for k, v in step_line(0, seq + 1, 1, {"step": 1.0}).items() if k != "events"}
    del ident["step"]
    return {
        **ident,
        "stream": "process",
        "pid": 4242,
        "cpu_percent": cpu,
        "cpu_logical_cores": cores,
        "ram_used_bytes": ram,
        "ram_total_bytes": 1 << 30,
        "gpu_available": False,
        "gpu_count": None,
        "gpu_device_index": None,
        "gpu_memory_used_bytes": None,
        "gpu_memory_reserved_bytes": None,
        "gpu_memory_total_bytes": None,
    }


def _not_complete(summary: dict[str, Any]) -> str:
    text = format_json(summary)
    assert summary["loss"]["status"] != "complete", text
    assert "files: complete" not in text
    assert "files: complete" not in format_json(summary, full=False)
    return text


# --------------------------------------------------------------- item 3: figures


def test_a_negative_phase_duration_is_a_bad_line_never_averaged(tmp_path: Path) -> None:
    lines = [step_line(0, s, 1, {"step": 10.0, "forward_time": 1.0}) for s in range(1, 4)]
    lines[1]["events"][P + "forward_time"]["cpu"]["duration_ms"] = -0.1
    summary = summarize_json(run_folder(tmp_path, lines))
    entry = summary["loss"]["files"]["step_time"]
    assert entry["impossible_lines"] == 1
    assert summary["step_time"]["0"]["steps"] == 2
    assert summary["phases"]["0"]["forward"]["mean_ms"] == 1.0
    text = _not_complete(summary)
    assert summary["loss"]["status"] == "damaged"
    assert (
        "traceml: problem: step_time.jsonl: 1 line(s) with impossible values, not counted "
        "(line 2: /events/_traceml_internal:forward_time/cpu/duration_ms: -0.1 is less than "
        "the minimum of 0)"
    ) in text
    assert "-0.10" not in text


@pytest.mark.parametrize(
    ("where", "value", "why"),
    [
        ("n_calls", 0, "/cpu/n_calls: 0 is less than the minimum of 1"),
        ("cpu_ms", -3.0, "/cpu/cpu_ms: -3.0 is less than the minimum of 0"),
        ("step", 0, "/step: 0 is less than the minimum of 1"),
        ("global_rank", 5, "/rank: rank 0 differs from global_rank 5"),
        ("world_size", 0, "/world_size: 0 is less than the minimum of 1"),
        ("timestamp_unix_ns", -1, "/timestamp_unix_ns: -1 is less than the minimum of 0"),
    ],
)
def test_impossible_counts_in_step_time(tmp_path: Path, where: str, value: Any, why: str) -> None:
    lines = [step_line(0, s, 1, {"step": 10.0, "forward_time": 1.0}) for s in range(1, 4)]
    if where in ("n_calls", "cpu_ms"):
        lines[2]["events"][P + "forward_time"]["cpu"][where] = value
    else:
        lines[2][where] = value
    summary = summarize_json(run_folder(tmp_path, lines))
    assert summary["loss"]["files"]["step_time"]["impossible_lines"] == 1
    assert summary["step_time"]["0"]["steps"] == 2
    assert why in _not_complete(summary)


def test_impossible_values_in_other_streams(tmp_path: Path) -> None:
    run = run_folder(tmp_path, [step_line(0, 1, 1, {"step": 5.0})])
    bad_ram = _process_line(1, 10.0, 4, ram=-5)
    write(
        _export(run) / "process.jsonl",
        [_process_line(0, 10.0, 4), bad_ram, closing("process", 2)],
    )
    summary = summarize_json(run)
    assert summary["loss"]["files"]["process"]["impossible_lines"] == 1
    assert summary["process"]["0"]["samples"] == 1
    assert "/ram_used_bytes: -5 is less than the minimum of 0" in _not_complete(summary)


def test_nan_infinity_and_repeated_keys_in_a_big_file(tmp_path: Path) -> None:
    """A file past the old 8 MiB pyarrow threshold reads as a small one does: NaN and
    Infinity are unreadable lines (pyarrow took them as numbers) and a repeated
    (rank, step) is reported, its first line counted (pyarrow merged both)."""
    lines = _two_ranks(7000)
    lines.append(step_line(1, 7000, 2, {"step": 99.0, "optimizer_step": 50.0}))  # repeat
    body = b"".join(orjson.dumps(o) + b"\n" for o in lines)
    nan = orjson.dumps(step_line(0, 7001, 2, {"step": 1.0})).replace(b"1.0", b"NaN", 1)
    inf = orjson.dumps(step_line(1, 7001, 2, {"step": 1.0})).replace(b"1.0", b"Infinity", 1)
    path = _export(tmp_path / "run") / "step_time.jsonl"
    path.parent.mkdir(parents=True)
    closing_line = orjson.dumps(closing("step_time", len(lines) + 2)) + b"\n"
    path.write_bytes(body + nan + b"\n" + inf + b"\n" + closing_line)
    assert path.stat().st_size > 8 << 20
    summary = summarize_json(tmp_path / "run")
    entry = summary["loss"]["files"]["step_time"]
    assert entry["unreadable_lines"] == 2
    assert entry["duplicate_keys"] == 1
    assert summary["step_time"]["1"]["steps"] == 7000
    assert summary["step_time"]["1"]["max_ms"] == 11.0  # the repeat's 99 ms is not used
    assert "optimizer" in summary["phases"]["1"]
    assert summary["phases"]["1"]["optimizer"]["mean_ms"] == 0.0
    text = _not_complete(summary)
    assert "2 unreadable line(s), not counted (not a JSON object; first on line 14002)" in text
    assert (
        "1 line(s) repeat the key of an earlier line, not counted "
        "(line 14001: global_rank=1, step=7000)"
    ) in text


def test_duplicate_keys_are_reported_not_merged(tmp_path: Path) -> None:
    lines = _two_ranks(3)
    lines.append(step_line(0, 2, 2, {"step": 500.0}))
    summary = summarize_json(run_folder(tmp_path, lines))
    assert summary["loss"]["files"]["step_time"]["duplicate_keys"] == 1
    assert summary["step_time"]["0"]["max_ms"] == 10.0
    assert "line 7: global_rank=0, step=2" in _not_complete(summary)
    assert summary["problems"]


def test_two_runs_in_one_file(tmp_path: Path) -> None:
    first = [step_line(0, s, 1, {"step": 5.0}) for s in range(1, 4)]
    second = [step_line(0, s, 1, {"step": 50.0}) for s in range(1, 3)]
    path = _export(tmp_path / "run") / "step_time.jsonl"
    write(path, [*first, closing("step_time", 3), *second, closing("step_time", 2)])
    summary = summarize_json(tmp_path / "run")
    entry = summary["loss"]["files"]["step_time"]
    assert entry["closing_lines"] == 2
    assert entry["lines_after_closing"] == 2
    assert entry["written_records"] == 3 and entry["data_lines"] == 3
    assert summary["step_time"]["0"]["steps"] == 3
    assert summary["step_time"]["0"]["max_ms"] == 5.0
    assert (
        "step_time.jsonl: two runs in one file? 2 closing line(s) and 2 data line(s) after "
        "the first closing line (line 5); only the lines before it are counted"
    ) in _not_complete(summary)


def test_a_second_closing_line_alone_is_reported(tmp_path: Path) -> None:
    lines = [step_line(0, 1, 1, {"step": 5.0})]
    path = _export(tmp_path / "run") / "step_time.jsonl"
    write(path, [*lines, closing("step_time", 1), closing("step_time", 1)])
    summary = summarize_json(tmp_path / "run")
    assert summary["loss"]["files"]["step_time"]["closing_lines"] == 2
    assert "two runs in one file?" in _not_complete(summary)


def test_short_form_counts_steps_per_rank(tmp_path: Path) -> None:
    short = format_json(summarize_json(run_folder(tmp_path / "a", _two_ranks(30))), full=False)
    assert "; 30 steps on each of 2 ranks" in short
    assert "60 steps" not in short
    uneven = [line for line in _two_ranks(30) if not (line["rank"] == 1 and line["step"] > 28)]
    short = format_json(summarize_json(run_folder(tmp_path / "b", uneven)), full=False)
    assert "; 28 to 30 steps per rank on 2 ranks" in short
    one = [step_line(0, s, 1, {"step": 5.0}) for s in range(1, 8)]
    short = format_json(summarize_json(run_folder(tmp_path / "c", one)), full=False)
    assert "step time: p50 5.00 ms; 7 steps on 1 rank" in short


def test_process_cpu_above_the_host_cores_is_left_out(tmp_path: Path) -> None:
    run = run_folder(tmp_path, [step_line(0, 1, 1, {"step": 5.0})])
    # 2 logical cores: 200 % at most. The third line has no core count: the node's
    # other lines give it.
    objs = [_process_line(0, 50.0, 2), _process_line(1, 190.0, 2), _process_line(2, 5000.0, None)]
    write(_export(run) / "process.jsonl", [*objs, closing("process", 3)])
    summary = summarize_json(run)
    proc = summary["process"]["0"]
    assert proc["cpu_percent_max"] == 190.0
    assert proc["cpu_percent_mean"] == 120.0
    assert proc["cpu_percent_impossible_samples"] == 1
    assert proc["cpu_logical_cores"] == 2
    text = format_json(summary, ranks=True)
    assert "rank 0: CPU 120% mean, 190% max (1 impossible sample(s) left out)" in text
    assert "(1 impossible CPU sample(s) left out)" in format_json(summary)
    assert "5000" not in text
    assert "note: process CPU: rank 0 1 sample(s) above 100 % per logical core" in text


def test_process_cpu_without_a_core_count(tmp_path: Path) -> None:
    """No core count anywhere: only what no Linux host can reach is left out."""
    run = run_folder(tmp_path, [step_line(0, 1, 1, {"step": 5.0})])
    objs = [_process_line(0, 350.0, None), _process_line(1, 1e9, None)]
    write(_export(run) / "process.jsonl", [*objs, closing("process", 2)])
    proc = summarize_json(run)["process"]["0"]
    assert proc["cpu_percent_max"] == 350.0
    assert proc["cpu_percent_impossible_samples"] == 1
    assert proc["cpu_logical_cores"] is None


# --------------------------------------------------------------- item 4: damaged input


def test_an_empty_export_folder_is_an_error(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _export(run).mkdir(parents=True)
    with pytest.raises(SummaryError, match="no export files here"):
        summarize_json(run)
    res = run_cli(["summary", run], cwd=tmp_path, timeout=60)
    assert res.returncode == 1
    assert res.stdout == ""
    assert res.stderr.strip() == (
        f"traceml: error: {_export(run)}: no export files here (the export folder holds none)"
    )


def _make(kind: str, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
        return "is a FIFO (named pipe), not a file; not read"
    if kind == "folder":
        path.mkdir()
        return "is a folder, not a file; not read"
    os.symlink(path.parent / "gone.jsonl", path)
    return f"a symbolic link to {path.parent / 'gone.jsonl'}, which does not exist; not read"


@pytest.mark.skipif(sys.platform == "win32", reason="FIFOs and symbolic links")
@pytest.mark.parametrize("kind", ["fifo", "folder", "dangling symlink"])
def test_a_step_time_that_is_not_a_file(tmp_path: Path, kind: str) -> None:
    run = tmp_path / "run"
    why = _make(kind, _export(run) / "step_time.jsonl")
    write(_export(run) / "process.jsonl", [_process_line(0, 10.0, 4), closing("process", 1)])
    res = run_cli(["summary", run], cwd=tmp_path, timeout=60)  # a FIFO must not hang it
    assert res.returncode == 1, res.stdout + res.stderr
    problems = [line for line in res.stdout.splitlines() if "problem:" in line]
    assert problems == [f"traceml: problem: step_time.jsonl: {why}"]
    assert "files: complete" not in res.stdout
    assert "files: damaged, not complete (1 problem(s), on the lines above)" in res.stdout
    assert "step_time was not exported" not in res.stdout
    summary = summarize_json(run)
    assert summary["loss"]["files"]["step_time"]["unreadable"] == why


@pytest.mark.skipif(sys.platform == "win32", reason="FIFOs")
@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("folder", "is a folder, not a file; not read"),
        ("fifo", "is a FIFO (named pipe), not a file; not read"),
        (b'{"status": "warn', "not valid JSON ("),
        (b"[1, 2]", "not a JSON object (an array); what was lost is unknown"),
        (b'{"status": "warning"}', "no reason or message: not a finalization warning"),
    ],
)
def test_a_damaged_warning_file(tmp_path: Path, content: str | bytes, why: str) -> None:
    run = run_folder(tmp_path, [step_line(0, 1, 1, {"step": 5.0})])
    warning = run / "finalization_warning.json"
    if isinstance(content, bytes):
        warning.write_bytes(content)
    elif content == "folder":
        warning.mkdir()
    else:
        os.mkfifo(warning)
    summary = summarize_json(run)
    assert summary["loss"]["status"] == "damaged"
    assert len(summary["problems"]) == 1
    assert summary["problems"][0].startswith(f"finalization_warning.json: {why}")
    text = _not_complete(summary)
    assert sum(line.startswith("traceml: problem:") for line in text.splitlines()) == 1
    if content == "fifo":
        res = run_cli(["summary", "--short", run], cwd=tmp_path, timeout=60)
        assert res.returncode == 1
        assert f"traceml: problem: finalization_warning.json: {why}" in res.stdout


def test_cli_plot_to_an_unsupported_format_is_one_line(tmp_path: Path) -> None:
    run = run_folder(tmp_path, _two_ranks(3))
    res = run_cli(["summary", "--plot", tmp_path / "out.txt", run], cwd=tmp_path, timeout=60)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(
        f"traceml: cannot plot: {tmp_path / 'out.txt'}: matplotlib cannot write .txt images "
        "(use one of: "
    )
    assert not (tmp_path / "out.txt").exists()


def test_cli_plot_says_the_path_it_wrote(tmp_path: Path) -> None:
    run = run_folder(tmp_path, _two_ranks(3))
    res = run_cli(
        ["summary", "--short", "--plot", tmp_path / "plot", run], cwd=tmp_path, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert f"traceml: plot written to {tmp_path / 'plot.png'}" in res.stdout
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "plot").exists()
    svg = run_cli(
        ["summary", "--json", "--plot", tmp_path / "p.SVG", run], cwd=tmp_path, timeout=120
    )
    assert svg.returncode == 0, svg.stderr
    assert f"traceml: plot written to {tmp_path / 'p.SVG'}" in svg.stderr
    assert b"<svg" in (tmp_path / "p.SVG").read_bytes()[:400]


def test_cli_follow_json_keeps_stdout_parseable(tmp_path: Path) -> None:
    run = run_folder(tmp_path, _two_ranks(5))
    res = run_cli(["summary", "--follow", "--json", "--interval", "0.1", run], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    obj = orjson.loads(res.stdout)
    assert obj["loss"]["status"] == "complete"
    assert obj["step_time"]["1"]["steps"] == 5
    assert "traceml: files: complete" in res.stderr  # the live view went to stderr


def test_cli_follow_honours_short_and_80_columns(tmp_path: Path) -> None:
    lines = [
        step_line(
            r,
            s,
            3,
            {
                "step": 30.0,
                "dataloader_next": 1.0,
                "h2d_time": 0.5,
                "forward_time": 5.0,
                "backward_time": 20.0,
                "optimizer_step": 2.0,
                "user:augmentation_of_the_batch": 1.0,
                "user:loss": 0.2,
            },
        )
        for s in range(1, 6)
        for r in range(3)
    ]
    run = run_folder(tmp_path, lines)
    env = {"COLUMNS": "80", "LINES": "50"}
    full = run_cli(["summary", "--follow", "--interval", "0.1", run], cwd=tmp_path, env=env)
    assert full.returncode == 0, full.stderr
    out = full.stdout.splitlines()
    assert max(len(line) for line in out) <= 80, full.stdout
    assert "…" not in full.stdout, full.stdout  # no cell cut short
    assert any("67% backward" in line for line in out), full.stdout
    short = run_cli(
        ["summary", "--follow", "--short", "--interval", "0.1", run], cwd=tmp_path, env=env
    )
    assert short.returncode == 0, short.stderr
    assert "5 steps on each of 3 ranks" in short.stdout
    assert "p99 ms" not in short.stdout and "note:" not in short.stdout


def test_live_view_fits_80_columns() -> None:
    import io

    from rich.console import Console

    from traceml_ai.analysis.follow_files import _render

    steps = {str(r): {"steps": 123456, "first_step": 1, "last_step": 123456, "p50_ms": 12345.67,
                      "p90_ms": 1.0, "p99_ms": 99999.99, "max_ms": 123456.78, "mean_ms": 1.0,
                      "steps_per_s": 1234.56} for r in range(4)}  # fmt: skip
    names = [
        "dataloader_wait",
        "forward",
        "backward",
        "optimizer",
        "user:a_long_phase_name",
        "rest",
    ]
    phases = {
        r: {
            n: {"mean_ms": 1.0, "p50_ms": 1.0, "share": 0.9 if n.startswith("user") else 0.02}
            for n in names
        }
        for r in steps
    }
    ok = "files: complete (every file closed, nothing lost)"
    summary = RunSummary.from_json(
        {
            "export_folder": "/logs/run/aggregator/export",
            "run_folder": "/logs/run",
            "streams": ["step_time"],
            "environment": None,
            "ranks": [0, 1, 2, 3],
            "world_size": 4,
            "step_time": steps,
            "phases": phases,
            "phase_names": names,
            "straggler": None,
            "memory": None,
            "process": None,
            "system": None,
            "problems": [],
            "notes": [],
            "loss": {
                "status": "complete",
                "dropped_batches": 0,
                "files": {},
                "unfinished_files": [],
                "warning": None,
                "warning_file": None,
                "line": ok,
                "short_line": ok,
            },
        }
    )
    buf = io.StringIO()
    console = Console(width=80, file=buf, record=True)
    console.print(_render(summary, None))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "12345.67" in text and "123456.78" in text and "1234.56" in text
    assert "90% user:a_long_phase" in text


def test_cli_follow_reports_a_file_truncated_under_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    path = _export(run) / "step_time.jsonl"
    lines = [step_line(0, s, 1, {"step": 5.0}) for s in range(1, 30)]
    write(path, lines[:20])
    proc = subprocess.Popen(
        traceml_cmd("summary", "--follow", "--interval", "0.1", run),
        cwd=tmp_path,
        env=clean_env({"COLUMNS": "200"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        time.sleep(1.5)  # its first refreshes see 20 lines
        os.truncate(path, 100)  # rewritten under it: a partial first line
        time.sleep(1.0)
        assert proc.poll() is None, proc.communicate()
        write(path, [*lines, closing("step_time", len(lines))])
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out + err
    assert "traceml: problem: step_time.jsonl: truncated or rewritten while followed" in out
    assert "files: complete" not in out


def test_json_reports_every_problem_field(tmp_path: Path) -> None:
    """The JSON carries the per-file counts and the problem lines."""
    lines = _two_ranks(2)
    lines[0]["events"][P + "step_time"]["cpu"]["duration_ms"] = -1.0
    lines.append(lines[1])
    summary = summarize_json(run_folder(tmp_path, lines))
    loaded = json.loads(orjson.dumps(summary))
    assert loaded["loss"]["files"]["step_time"]["impossible_lines"] == 1
    assert loaded["loss"]["files"]["step_time"]["duplicate_keys"] == 1
    assert len(loaded["problems"]) == 2


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_what_the_summary_says_of_a_bad_line_is_what_validate_says(
    data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A line with one field bent is left out of the summary exactly when ``traceml
    validate`` finds its values wrong, and the summary words it as validate does (one
    vocabulary: the JSON pointer, then what is wrong)."""
    from tests.strategies import consistent_json
    from traceml_records import validate_line
    from traceml_records._linecheck import NOT_INT

    stream = "process"
    obj = dict(data.draw(consistent_json(stream)))
    obj.update(rank=0, global_rank=0, local_rank=0, world_size=1, local_world_size=1, seq=1)
    field = data.draw(st.sampled_from(sorted(obj)))
    bent = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=3),
    )
    if data.draw(st.booleans()):
        obj[field] = data.draw(bent)
    else:
        del obj[field]
    if obj.get("stream") != stream or "closing" in obj:
        return  # another stream's line, or a closing line: not a bad data line
    raw = orjson.dumps(obj)
    run = run_folder(tmp_path_factory.mktemp("run"), [step_line(0, 1, 1, {"step": 5.0})])
    (_export(run) / "process.jsonl").write_bytes(raw + b"\n")
    summary = summarize_json(run)
    # An integer written ``1.0`` is how a line is written, not a wrong value.
    problems = [p for p in validate_line(raw) if not p.message.startswith(NOT_INT)]
    impossible = summary["loss"]["files"]["process"]["impossible_lines"]
    if not problems:
        assert impossible == 0
    elif impossible:
        assert str(problems[0]) in format_json(summary)
