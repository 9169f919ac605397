"""traceml_ai.analysis on folders made here: stragglers, DDP wait, live files, loss."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.summary_helpers import format_json, summarize_json
from traceml_ai.analysis import SummaryError

P = "_traceml_internal:"


def _timing(ms: float) -> dict[str, Any]:
    return {"cpu": {"cpu_ms": ms, "duration_ms": ms, "gpu_ms": None, "is_gpu": False, "n_calls": 1}}


def step_line(rank: int, step: int, world: int, phases: dict[str, float]) -> dict[str, Any]:
    total = phases.pop("step")
    events = {P + "step_time": _timing(total)}
    for name, ms in phases.items():
        events[name if ":" in name or name.startswith("user") else P + name] = _timing(ms)
    return {
        "stream": "step_time",
        "schema_version": 1,
        "observed_timestamp_unix_ns": 10**18 + step * 10**7,
        "rank": rank,
        "global_rank": rank,
        "local_rank": rank,
        "world_size": world,
        "local_world_size": world,
        "node_rank": 0,
        "timestamp_unix_ns": 10**18 + step * 10**7,
        "seq": step - 1,
        "step": step,
        "events": dict(sorted(events.items())),
    }


def closing(stream: str, written: int, dropped: int = 0) -> dict[str, Any]:
    return {
        "stream": stream,
        "closing": True,
        "schema_version": 1,
        "written_records": written,
        "dropped_batches": dropped,
    }


def write(path: Path, objs: list[dict[str, Any]], tail: bytes = b"") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in objs) + tail)


def run_folder(tmp_path: Path, lines: list[dict[str, Any]], *, close: bool = True) -> Path:
    run = tmp_path / "run"
    objs = [*lines, closing("step_time", len(lines))] if close else lines
    write(run / "aggregator" / "export" / "step_time.jsonl", objs)
    return run


def test_straggler_by_step_time(tmp_path: Path) -> None:
    lines = [
        step_line(r, s, 3, {"step": 30.0 if r == 2 else 10.0, "forward_time": 4.0})
        for s in range(1, 21)
        for r in range(3)
    ]
    summary = summarize_json(run_folder(tmp_path, lines))
    view = summary["straggler"]
    # Ranks that do not wait for each other: the slow rank's own work is its step.
    assert [s["rank"] for s in view["stragglers"]] == [2]
    assert view["verdict"] == "straggler"
    assert view["wait_phase"] is None
    assert view["stragglers"][0]["excess_ms"] == 20.0
    assert view["stragglers"][0]["phase"] == "rest_of_step"
    assert summary["step_time"]["2"]["p50_ms"] == 30.0
    assert summary["phases"]["0"]["rest"]["mean_ms"] == 6.0
    assert "straggler: rank 2" in format_json(summary, full=False)


def test_no_straggler_within_margin(tmp_path: Path) -> None:
    # 5 % slower: below the 10 % margin.
    lines = [
        step_line(r, s, 2, {"step": 10.5 if r == 1 else 10.0})
        for s in range(1, 11)
        for r in range(2)
    ]
    view = summarize_json(run_folder(tmp_path, lines))["straggler"]
    assert view["stragglers"] == []
    assert view["verdict"] == "none"
    assert view["waiting"] is None


def test_ddp_wait_in_backward_names_the_cause(tmp_path: Path) -> None:
    # Equal step times; rank 1 is slow in forward, rank 0 waits in backward.
    lines = []
    for s in range(1, 16):
        lines.append(step_line(0, s, 2, {"step": 22.0, "forward_time": 0.5, "backward_time": 21.0}))
        lines.append(step_line(1, s, 2, {"step": 22.2, "forward_time": 20.0, "backward_time": 1.5}))
    summary = summarize_json(run_folder(tmp_path, lines))
    view = summary["straggler"]
    assert view["waiting"]["phase"] == "backward"
    assert view["waiting"]["ranks"] == [0]
    assert [s["rank"] for s in view["stragglers"]] == [1]
    assert view["stragglers"][0]["phase"] == "forward"
    text = format_json(summary)
    assert "straggler: rank 1: +" in text and "the others wait in backward" in text
    assert all(line.startswith("traceml:") for line in text.splitlines())


def test_live_file_partial_line_and_no_closing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    lines = [step_line(0, s, 1, {"step": 5.0}) for s in range(1, 4)]
    write(run / "aggregator" / "export" / "step_time.jsonl", lines, tail=b'{"stream":"step_ti')
    summary = summarize_json(run)
    assert summary["step_time"]["0"]["steps"] == 3
    loss = summary["loss"]
    assert loss["status"] == "in_progress"
    assert loss["files"]["step_time"]["partial_last_line"] is True
    assert loss["unfinished_files"] == ["step_time"]
    assert summary["straggler"]["applicable"] is False
    assert "files: in progress or unfinished" in format_json(summary)


def test_warning_file_and_missing_streams(tmp_path: Path) -> None:
    lines = [step_line(0, s, 1, {"step": 5.0}) for s in range(1, 4)]
    run = run_folder(tmp_path, lines)
    warning = {
        "status": "warning",
        "completed_at": "2026-01-01T00:00:00+00:00",
        "reason": "export_incomplete",
        "message": "2 batches were dropped.",
        "export": {
            "written_records": 3,
            "dropped_batches": 2,
            "failed_records": 0,
            "skipped_items": 0,
            "exporter_failed": False,
        },
    }
    (run / "finalization_warning.json").write_text(json.dumps(warning, indent=2))
    summary = summarize_json(run / "aggregator" / "export")  # the export folder works too
    assert summary["run_folder"] == str(run)
    assert summary["loss"]["status"] == "lost"
    assert summary["loss"]["warning"]["reason"] == "export_incomplete"
    text = format_json(summary)
    assert "files: incomplete (export_incomplete): 2 batches were dropped." in text
    assert "note: peak memory: step_memory was not exported" in text
    assert "note: system figures: system was not exported" in text
    orjson.dumps(summary)  # JSON-able


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(SummaryError, match="no such file or folder"):
        summarize_json(tmp_path / "nope")
    with pytest.raises(SummaryError, match="no export files here"):
        summarize_json(tmp_path)


# --- the command: text, --json, --plot, --follow, and traceml run's last lines --------


def _ddp_folder(tmp_path: Path) -> Path:
    lines = []
    for s in range(1, 16):
        lines.append(step_line(0, s, 2, {"step": 22.0, "forward_time": 0.5, "backward_time": 21.0}))
        lines.append(step_line(1, s, 2, {"step": 22.2, "forward_time": 20.0, "backward_time": 1.5}))
    return run_folder(tmp_path, lines)


def test_cli_text_json_and_messages(tmp_path: Path) -> None:
    from tests.e2e_helpers import run_cli

    run = _ddp_folder(tmp_path)
    text = run_cli(["summary", run], cwd=tmp_path, timeout=60)
    assert text.returncode == 0, text.stderr
    assert all(line.startswith("traceml: ") for line in text.stdout.splitlines())
    assert "traceml: note: peak memory: step_memory was not exported" in text.stdout
    as_json = run_cli(["summary", "--json", run], cwd=tmp_path, timeout=60)
    assert as_json.returncode == 0, as_json.stderr
    obj = orjson.loads(as_json.stdout)
    assert obj == orjson.loads(orjson.dumps(summarize_json(run)))
    assert [s["rank"] for s in obj["straggler"]["stragglers"]] == [1]
    missing = run_cli(["summary", tmp_path / "nope"], cwd=tmp_path, timeout=60)
    assert missing.returncode == 1
    assert missing.stderr.strip() == f"traceml: error: {tmp_path / 'nope'}: no such file or folder"


def test_cli_plot_is_a_real_image(tmp_path: Path) -> None:
    import matplotlib.image

    from tests.e2e_helpers import run_cli

    run = _ddp_folder(tmp_path)
    out = tmp_path / "plot.png"
    res = run_cli(["summary", "--short", "--plot", out, run], cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"traceml: plot written to {out}" in res.stdout
    img = matplotlib.image.imread(str(out))
    height, width = img.shape[:2]
    assert (width, height) == (1000, 800)
    # Not blank: many distinct colours, and a good share of non-white pixels.
    rgb = img[:, :, :3].reshape(-1, 3)
    assert len({tuple(px) for px in rgb[::97].tolist()}) > 10
    assert (rgb.min(axis=1) < 0.9).mean() > 0.05


def test_cli_plot_without_step_time_says_why(tmp_path: Path) -> None:
    from tests.e2e_helpers import run_cli

    export = tmp_path / "export"
    write(export / "process.jsonl", [closing("process", 0)])
    res = run_cli(["summary", "--plot", tmp_path / "p.png", export], cwd=tmp_path, timeout=60)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == (
        "traceml: cannot plot: nothing to plot: no step times "
        "(step_time not exported, or no step yet)"
    )
    assert "note: step times: step_time was not exported" in res.stdout


def test_cli_follow_a_live_file_until_closed(tmp_path: Path) -> None:
    import subprocess
    import time

    from tests.e2e_helpers import clean_env, traceml_cmd

    run = tmp_path / "run"
    path = run / "aggregator" / "export" / "step_time.jsonl"
    lines = [step_line(0, s, 1, {"step": 5.0}) for s in range(1, 30)]
    write(path, lines[:5], tail=b'{"stream":"st')  # a line still being written
    proc = subprocess.Popen(
        traceml_cmd("summary", "--follow", "--interval", "0.2", run),
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        time.sleep(1.5)
        assert proc.poll() is None, proc.communicate()
        # Append the rest while it refreshes, then the closing line: it stops by itself.
        write(path, lines, tail=b"")
        with open(path, "ab") as fh:
            fh.write(orjson.dumps(closing("step_time", len(lines))) + b"\n")
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "traceml: files: complete" in out
    assert "29" in out  # the last refresh saw every step


def test_importing_the_cli_stays_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, traceml_ai.cli;"
        "print(sorted(m for m in ('torch','pyarrow','rich','matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_ddp_three_ranks_one_slow(tmp_path: Path) -> None:
    lines = []
    for s in range(1, 12):
        for r in range(3):
            slow = r == 2
            lines.append(
                step_line(
                    r,
                    s,
                    3,
                    {
                        "step": 31.0 + 0.1 * r,
                        "forward_time": 25.0 if slow else 2.0,
                        "backward_time": 4.0 if slow else 27.0,
                        "optimizer_step": 1.0,
                    },
                )
            )
    view = summarize_json(run_folder(tmp_path, lines))["straggler"]
    assert view["waiting"]["phase"] == "backward"
    assert view["waiting"]["ranks"] == [0, 1]
    assert [s["rank"] for s in view["stragglers"]] == [2]
    assert view["stragglers"][0]["phase"] == "forward"
    assert view["stragglers"][0]["slow_steps"] == 10  # steps 2..11 (step 1 has no start)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    data=st.data(),
    streams=st.sets(
        st.sampled_from(
            ["step_time", "step_memory", "process", "system", "system_gpu", "runtime_environment"]
        ),
        min_size=1,
    ),
    close=st.booleans(),
    partial=st.booleans(),
)
def test_hypothesis_folders(
    tmp_path_factory: pytest.TempPathFactory,
    data: st.DataObject,
    streams: set[str],
    close: bool,
    partial: bool,
) -> None:
    """Any schema-valid folder, closed or not, with or without a partial last line."""
    from tests.strategies import consistent_json, warning_json

    export = tmp_path_factory.mktemp("h") / "aggregator" / "export"
    drawn: dict[str, list[dict[str, Any]]] = {}
    for stream in sorted(streams):
        objs = data.draw(st.lists(consistent_json(stream), max_size=8), label=stream)
        drawn[stream] = objs
        body = [*objs, closing(stream, len(objs))] if close else objs
        write(export / f"{stream}.jsonl", body, tail=b'{"stream":' if partial else b"")
    if data.draw(st.booleans(), label="warning"):
        warning = data.draw(warning_json(), label="warning file")
        (export.parent.parent / "finalization_warning.json").write_bytes(orjson.dumps(warning))
    summary = summarize_json(export.parent.parent)
    # Schema-valid lines are all used; the only damage such a folder can have is a
    # key drawn twice (reported, the first line counted).
    from traceml_records import STREAMS

    repeated = []
    for spec in STREAMS:
        keys = [tuple(o[f] for f in spec.key_fields) for o in drawn.get(spec.name, [])]
        if "unique-key" in spec.rules and len(set(keys)) < len(keys):
            repeated.append(spec.name)
    assert [p.split(".jsonl:")[0] for p in summary["problems"]] == repeated
    assert all("repeat the key of an earlier line" in p for p in summary["problems"])
    if repeated:
        assert summary["loss"]["status"] in ("damaged", "lost")
    orjson.dumps(summary)  # JSON-able
    assert format_json(summary) and format_json(summary, full=False)
    expected = {
        (o["global_rank"], o["step"])
        for o in drawn.get("step_time", [])
        if P + "step_time" in o["events"]
    }
    counted = sum(s["steps"] for s in (summary["step_time"] or {}).values())
    assert counted == len(expected)
    if not close:
        assert summary["loss"]["status"] in ("in_progress", "lost", "damaged")


def test_memory_peaks_per_rank_and_device(tmp_path: Path) -> None:
    lines = [step_line(r, s, 2, {"step": 22.0}) for s in range(1, 5) for r in range(2)]
    run = run_folder(tmp_path, lines)
    mem = [
        {
            **{k: v for k, v in step_line(r, s, 2, {"step": 1.0}).items() if k != "events"},
            "stream": "step_memory",
            "device": "cuda:0",
            "peak_allocated_bytes": 100 * s + r,
            "peak_reserved_bytes": None if s == 1 else 1000,
        }
        for s in range(1, 5)
        for r in range(2)
    ]
    write(run / "aggregator" / "export" / "step_memory.jsonl", [*mem, closing("step_memory", 8)])
    summary = summarize_json(run)
    assert summary["memory"]["1"]["cuda:0"] == {
        "peak_allocated_bytes": 401,
        "peak_reserved_bytes": 1000,
    }
    assert summary["loss"]["status"] == "complete"


def test_one_reader_for_every_size(tmp_path: Path) -> None:
    """Files of any size go through the same plain reader (big ones used to go through
    pyarrow, which read NaN as a number and merged repeated keys): pyarrow is never
    imported, and a big file's figures are those of the same steps in a small one."""
    import subprocess
    import sys

    from tests.e2e_helpers import clean_env

    def lines(steps: int) -> list[dict[str, Any]]:
        return [
            step_line(r, s, 2, {"step": 20.0 + r, "forward_time": 2.0, "user_phase": 0.5})
            for s in range(1, steps + 1)
            for r in range(2)
        ]

    big = run_folder(tmp_path / "big", lines(7500))
    assert (big / "aggregator" / "export" / "step_time.jsonl").stat().st_size > 8 << 20
    small = summarize_json(run_folder(tmp_path / "small", lines(3)))
    code = (
        "import sys, orjson; from traceml_ai.analysis import summarize_run;"
        f"s = summarize_run({str(big)!r}).to_json();"
        "print(orjson.dumps([s['phases'], 'pyarrow' in sys.modules]).decode())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, check=True
    )
    phases, imported = orjson.loads(out.stdout)
    assert imported is False
    assert phases == small["phases"]


def test_live_view_with_many_ranks_shows_the_straggler(tmp_path: Path) -> None:
    from rich.console import Console

    from traceml_ai.analysis import summarize_run
    from traceml_ai.analysis.follow_files import _render

    lines = [
        step_line(r, s, 40, {"step": 30.0 if r == 7 else 10.0 + r * 0.01})
        for s in range(1, 5)
        for r in range(40)
    ]
    console = Console(width=160, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(_render(summarize_run(run_folder(tmp_path, lines)), None))
    text = console.export_text()
    assert "32 of 40 ranks: the stragglers, then the slowest p50" in text
    assert any(line.startswith(" 7 *      4   30.00") for line in text.splitlines()), text
    assert "traceml: straggler: rank 7: +19.80 ms of own work per iteration (+194%)" in text


def test_short_form_names_the_warning_file(tmp_path: Path) -> None:
    run = run_folder(tmp_path, [step_line(0, 1, 1, {"step": 5.0})])
    warning = {
        "status": "warning",
        "completed_at": "2026-01-01T00:00:00+00:00",
        "reason": "ranks_disconnected",
        "message": "rank 1 never finished.",
        "expected_world_size": 2,
        "finished_ranks": [0],
        "missing_ranks": [1],
    }
    (run / "finalization_warning.json").write_text(json.dumps(warning))
    short = format_json(summarize_json(run), full=False)
    assert short.splitlines()[-1] == (
        f"traceml: files: incomplete (ranks_disconnected; see {run / 'finalization_warning.json'})"
    )


def test_end_of_analysis_skips_big_exports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A long run's files would hold the prompt back for minutes: the launcher points
    # to `traceml summary` instead of reading them.
    from traceml_ai.launch import _report as _launch

    export_dir = tmp_path / "run" / "aggregator" / "export"
    export_dir.mkdir(parents=True)
    (export_dir / "step_time.jsonl").write_bytes(b"x" * 4096)
    monkeypatch.setattr(_launch, "END_OF_RUN_SUMMARY_MAX_BYTES", 1024)
    _launch._print_short_summary(tmp_path / "run", export_dir)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("traceml: summary: ")
    assert f"traceml summary {tmp_path / 'run'}" in err[0]


def test_phase_shares_count_a_wait_before_the_step_once() -> None:
    # The usual loop fetches the batch before `with trace_step(...)`: step_time leaves
    # the wait out, so shares of the step alone would add up past 100 %.
    from traceml_ai.analysis._columns import StepRow
    from traceml_ai.analysis._phases import iteration as _iteration
    from traceml_ai.analysis._phases import rest as _rest

    phases = {"dataloader_wait": 3.0, "forward": 0.4, "backward": 0.5}
    outside = StepRow(1.0, phases)
    assert _iteration(outside) == 4.0
    assert abs(_rest(outside) - 0.1) < 1e-9
    inside = StepRow(4.0, phases)
    assert _iteration(inside) == 4.0
    assert abs(_rest(inside) - 0.1) < 1e-9


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_run_with_no_step_yet_counts_no_ranks_in_its_head(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """Ranks connected (runtime_environment) but none wrote a step (stopped before its
    first): the head names the strategy and says no "0 rank(s)"; the notes say why."""
    from tests.strategies import consistent_json

    export = tmp_path_factory.mktemp("nostep") / "aggregator" / "export"
    environment = data.draw(st.lists(consistent_json("runtime_environment"), min_size=1))
    write(export / "runtime_environment.jsonl", environment)
    write(export / "step_time.jsonl", [closing("step_time", 0)])
    summary = summarize_json(export.parent.parent)
    text = format_json(summary)
    head = text.splitlines()[0]
    assert "rank(s)" not in head, text
    assert "no step recorded yet" in text, text


def test_the_summary_is_one_typed_value_whose_json_has_every_key(tmp_path: Path) -> None:
    from traceml_ai._converter import StructureError
    from traceml_ai.analysis import RunSummary, summarize_run

    lines = [
        step_line(r, s, 2, {"step": 10.0, "forward_time": 4.0}) for s in (1, 2) for r in (0, 1)
    ]
    summary = summarize_run(run_folder(tmp_path, lines))
    assert isinstance(summary, RunSummary)
    assert summary.step_time is not None and summary.step_time["1"].steps == 2
    assert summary.loss.status == "complete" and summary.loss.line.startswith("files: complete")
    data = summary.to_json()
    assert set(data) == {
        "export_folder", "run_folder", "streams", "environment", "ranks", "world_size",
        "step_time", "phases", "phase_names", "straggler", "memory", "process", "system",
        "loss", "problems", "notes", "coordinates",
    }  # fmt: skip
    assert "rows" not in data  # the step rows travel with the value, never into the JSON
    assert set(data["loss"]["files"]["step_time"]) == {
        "data_lines", "closed", "partial_last_line", "bytes", "written_records",
        "dropped_batches", "mismatch", "unreadable", "unreadable_lines", "impossible_lines",
        "duplicate_keys", "lines_after_closing", "closing_lines",
    }  # fmt: skip
    back = RunSummary.from_json(orjson.loads(orjson.dumps(data)))
    assert back == summary and back.to_json() == data
    with pytest.raises(StructureError, match=r"unknown key 'extra' at \$\.extra"):
        RunSummary.from_json({**data, "extra": 1})
    with pytest.raises(StructureError, match=r"\$\.loss\.status"):
        RunSummary.from_json({**data, "loss": {**data["loss"], "status": "fine"}})


def test_one_rule_for_a_steps_phases_in_the_files_the_live_views_and_a_ranks_own_steps(
    tmp_path: Path,
) -> None:
    """A step whose one phase timing is impossible (no call) is left out whole by every
    reader: the summary counts it, the live state ignores it, a rank's own figures skip
    it; the good steps give the same figures everywhere."""
    from traceml_ai.analysis import in_process, summarize_run
    from traceml_ai.monitor import LiveState

    good = [step_line(0, s, 1, {"step": 10.0, "forward_time": 4.0, "user_a": 1.0}) for s in (1, 2)]
    bad = step_line(0, 3, 1, {"step": 10.0, "forward_time": 4.0, "user_a": 1.0})
    bad["events"]["user_a"]["cpu"]["n_calls"] = 0
    summary = summarize_run(run_folder(tmp_path, [*good, bad]))
    assert summary.step_time is not None and summary.step_time["0"].steps == 2
    assert summary.loss.files["step_time"].impossible_lines == 1
    assert any(
        "/events/user_a/cpu/n_calls: 0 is less than the minimum" in p for p in summary.problems
    )

    state = LiveState()
    identity = {k: bad[k] for k in ("rank", "global_rank", "local_rank", "world_size",
                                    "local_world_size", "node_rank")}  # fmt: skip
    items = [{k: v for k, v in line.items() if k in ("seq", "step", "timestamp_unix_ns", "events")}
             for line in [*good, bad]]  # fmt: skip
    seen = state.add_steps({**identity, "pid": 1, "hostname": "h"}, items)
    assert [s.step for s in seen] == [1, 2] and state.ignored_items == 1
    assert seen[0].phases == {"forward": 4.0, "user:user_a": 1.0}

    own = in_process.figures({0: {line["step"]: line["events"] for line in [*good, bad]}})
    assert own.step_time["0"].steps == 2
    assert own.phases == summary.phases
