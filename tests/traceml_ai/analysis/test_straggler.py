"""The straggler analysis (traceml_ai.analysis._straggler): real DDP runs with a rank slowed in
each place a rank can be slow, and simulated synchronous runs for what a CPU cannot
show (a slow node, 1,024 ranks, noise)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.e2e_helpers import REPO, free_port, run_cli
from tests.summary_helpers import format_json, summarize_json
from traceml_ai.analysis import StepRow, StragglerView
from traceml_ai.analysis._straggler import analyze

P = "_traceml_internal:"
EVENTS = {
    "dataloader_wait": P + "dataloader_next",
    "forward": P + "forward_time",
    "backward": P + "backward_time",
    "optimizer": P + "optimizer_step",
}


def _timing(ms: float) -> dict[str, Any]:
    return {"cpu": {"cpu_ms": ms, "duration_ms": ms, "gpu_ms": None, "is_gpu": False, "n_calls": 1}}


def simulate(
    world: int,
    steps: int,
    slow: dict[int, tuple[str, float, int]] | None = None,
    *,
    nodes: int = 1,
    jitter_ms: float = 0.2,
    sync: str = "backward",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """step_time lines of a synchronous data-parallel run.

    ``slow``: rank -> (where, extra ms, every Nth step); where is a phase, "collate"
    (the DataLoader before the step) or "between" (work after the step). Every rank
    leaves the collective in ``sync`` at the same moment: the fast ones wait there.
    """
    rng = random.Random(seed)
    slow = slow or {}
    per_node = world // nodes
    clock = [10**18] * world
    lines = []
    for step in range(1, steps + 1):
        own: list[dict[str, float]] = []
        for r in range(world):
            parts = {
                "collate": 0.1,
                "forward": 2.0,
                "backward": 3.0,
                "optimizer": 0.5,
                "between": 0.1,
            }
            for key in parts:
                parts[key] += rng.uniform(0, jitter_ms)
            where, ms, every = slow.get(r, ("", 0.0, 1))
            if where and step % every == 0:
                parts[where] += ms
            own.append(parts)
        # Each rank reaches the collective after its own work before it (from the end
        # of its previous step); all leave together when the last one arrives.
        order = ["between", "collate", "forward", "backward", "optimizer"]
        cut = order.index(sync)
        step_start = [
            clock[r] + (own[r]["between"] + own[r]["collate"]) * 1e6 for r in range(world)
        ]
        arrive = [step_start[r] + sum(own[r][k] for k in order[2:cut]) * 1e6 for r in range(world)]
        leave = max(arrive) + own[0][sync] * 1e6
        for r in range(world):
            o = own[r]
            phases = {k: o[k] for k in ("forward", "backward", "optimizer")}
            phases[sync] = (leave - arrive[r]) / 1e6
            phases["dataloader_wait"] = o["collate"]
            end = leave + sum(o[k] for k in order[cut + 1 :]) * 1e6
            step_ms = (end - step_start[r]) / 1e6
            events = {P + "step_time": _timing(step_ms)}
            events.update({EVENTS[k]: _timing(v) for k, v in phases.items()})
            lines.append(
                {
                    "stream": "step_time",
                    "schema_version": 1,
                    "observed_timestamp_unix_ns": int(end),
                    "rank": r,
                    "global_rank": r,
                    "local_rank": r % per_node,
                    "world_size": world,
                    "local_world_size": per_node,
                    "node_rank": r // per_node,
                    "timestamp_unix_ns": int(end),
                    "seq": step - 1,
                    "step": step,
                    "events": dict(sorted(events.items())),
                }
            )
            clock[r] = int(end)
    return lines


def folder(tmp_path: Path, lines: list[dict[str, Any]]) -> Path:
    export = tmp_path / "run" / "aggregator" / "export"
    export.mkdir(parents=True)
    closing = {
        "stream": "step_time",
        "closing": True,
        "schema_version": 1,
        "written_records": len(lines),
        "dropped_batches": 0,
    }
    (export / "step_time.jsonl").write_bytes(
        b"".join(orjson.dumps(o) + b"\n" for o in [*lines, closing])
    )
    return tmp_path / "run"


def _view(tmp_path: Path, lines: list[dict[str, Any]]) -> dict[str, Any]:
    summary = summarize_json(folder(tmp_path, lines))
    view: dict[str, Any] = summary["straggler"]
    # The JSON form and the typed view are one value.
    typed = StragglerView.from_json(view)
    assert typed.to_json() == view
    assert "-" not in typed.line().replace("--", ""), typed.line()
    return view


def verdict_line(view: dict[str, Any]) -> str:
    return StragglerView.from_json(view).line()


# ------------------------------------------------------------------ simulated runs


@pytest.mark.parametrize(
    ("where", "phase"),
    [
        ("forward", "forward"),
        ("optimizer", "optimizer"),
        ("collate", "dataloader_wait"),
        ("between", "between_steps"),
    ],
)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_simulated_one_slow_rank(tmp_path: Path, world: int, where: str, phase: str) -> None:
    slow = world - 1
    view = _view(tmp_path, simulate(world, 40, {slow: (where, 20.0, 1)}))
    assert view["verdict"] == "straggler", verdict_line(view)
    assert [s["rank"] for s in view["stragglers"]] == [slow]
    assert view["stragglers"][0]["phase"] == phase
    assert 18.0 < view["stragglers"][0]["excess_ms"] < 22.0
    assert view["waiting"]["phase"] == "backward"
    assert view["waiting"]["rank_count"] == world - 1


def test_simulated_two_slow_ranks_of_four_and_a_slow_node(tmp_path: Path) -> None:
    two = _view(tmp_path / "a", simulate(4, 40, {1: ("forward", 15, 1), 2: ("forward", 15, 1)}))
    assert [s["rank"] for s in two["stragglers"]] == [1, 2]
    assert two["slow_node"] is None  # ranks 1 and 2 are on different nodes of one
    node = _view(
        tmp_path / "b",
        simulate(4, 40, {2: ("collate", 15, 1), 3: ("collate", 15, 1)}, nodes=2),
    )
    assert [s["rank"] for s in node["stragglers"]] == [2, 3]
    assert node["slow_node"] == {"nodes": [1], "ranks": [2, 3]}
    assert verdict_line(node).startswith("straggler: node 1 (ranks 2, 3):")


def test_simulated_every_fifth_step(tmp_path: Path) -> None:
    view = _view(tmp_path, simulate(4, 50, {3: ("forward", 25.0, 5)}))
    assert view["verdict"] == "intermittent", verdict_line(view)
    (entry,) = view["stragglers"]
    assert entry["rank"] == 3
    assert entry["every_n_steps"] == 5
    assert entry["slow_steps"] == 10  # steps 5, 10, ..., 50
    assert entry["phase"] == "forward"
    assert "every 5th step" in verdict_line(view)


def test_simulated_no_straggler_under_noise(tmp_path: Path) -> None:
    for seed in range(5):
        view = _view(tmp_path / str(seed), simulate(4, 60, jitter_ms=1.5, seed=seed))
        assert view["verdict"] == "none", verdict_line(view)
        assert view["stragglers"] == []


def test_simulated_fsdp_like_wait_in_forward(tmp_path: Path) -> None:
    """Where the strategy's first collective is in forward, the others wait there."""
    lines = simulate(2, 40, {1: ("collate", 20.0, 1)}, sync="forward")
    view = _view(tmp_path, lines)
    assert [s["rank"] for s in view["stragglers"]] == [1]
    assert view["stragglers"][0]["phase"] == "dataloader_wait"
    assert view["waiting"]["phase"] == "forward"


def test_one_rank_and_too_few_steps() -> None:
    assert analyze({0: {1: StepRow(1.0, {}, end_ns=1.0)}}).applicable is False
    rows = {r: {s: StepRow(1.0, {}, end_ns=float(s * 10**6)) for s in (1, 2)} for r in (0, 1)}
    view = analyze(rows)
    assert view.applicable is False and view.verdict == "n/a"
    assert view.reason is not None and "step(s)" in view.reason
    assert view.line().startswith("straggler: n/a (")


def test_1024_ranks(tmp_path: Path) -> None:
    lines = simulate(1024, 8, {700: ("forward", 30.0, 1)}, nodes=128)
    view = _view(tmp_path, lines)
    assert [s["rank"] for s in view["stragglers"]] == [700]
    assert view["waiting"]["rank_count"] == 1023
    assert view["waiting"]["ranks"] is None  # too many to list


# ------------------------------------------------------------------ real runs

SCRIPT = REPO / "tests" / "scripts" / "straggler_train.py"


NO_STRAGGLER_WORK_MS = 40
"""Each rank's own work a step in the runs without a slow rank. The script's steps take
a few ms, and on a busy machine the scheduler delays one rank now and then by as much:
three such steps out of 25 read as an intermittent straggler, as they should. With 40 ms
a step, a single step counts as slow only past 0.3 x the iteration (about 13 ms), far
above those delays. The slowed runs need none: their 30 ms stand above them already."""


def _straggler_run(
    tmp_path: Path, ranks: int, strategy: str, where: str, slowed: str, every: int
) -> Any:
    """``traceml run`` of the straggler script (25 steps, a 30 ms sleep), every stream;
    without a slow rank (``where`` none), every rank works NO_STRAGGLER_WORK_MS a step."""
    work_ms = NO_STRAGGLER_WORK_MS if where == "none" else 0
    return run_cli(
        [
            *("run", "--logs-dir", tmp_path / "logs", "--run-name", "r"),
            *("--nproc-per-node", str(ranks), "--master-port", str(free_port())),
            *("--exporter", "jsonl", "--export-streams", "all", SCRIPT),
            *("--strategy", strategy, "--where", where, "--slow-ranks", slowed),
            *("--every", str(every), "--steps", "25", "--sleep-ms", "30"),
            *("--work-ms", str(work_ms)),
        ],
        cwd=tmp_path,
    )


CASES = [
    # (ranks, where, slowed ranks, every Nth step, expected phase, verdict)
    (2, "forward", "1", 1, "forward", "straggler"),
    (2, "optimizer", "1", 1, "optimizer", "straggler"),
    (2, "collate", "1", 1, "dataloader_wait", "straggler"),
    (2, "dataloader_in_step", "0", 1, "dataloader_wait", "straggler"),
    (2, "between", "1", 1, "between_steps", "straggler"),
    (2, "forward", "1", 5, "forward", "intermittent"),
    (2, "backward", "1", 1, "backward", "straggler"),
    (2, "none", "", 1, None, "none"),
    (4, "forward", "2", 1, "forward", "straggler"),
    (4, "optimizer", "1", 1, "optimizer", "straggler"),
    (4, "collate", "3", 1, "dataloader_wait", "straggler"),
    (4, "dataloader_in_step", "2", 1, "dataloader_wait", "straggler"),
    (4, "between", "0", 1, "between_steps", "straggler"),
    (4, "collate", "3", 5, "dataloader_wait", "intermittent"),
    (4, "forward", "1,2", 1, "forward", "straggler"),
    (4, "none", "", 1, None, "none"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "where", "slowed", "every", "phase", "verdict"),
    CASES,
    ids=[f"{c[0]}ranks-{c[1]}-slow{c[2] or 'none'}-every{c[3]}" for c in CASES],
)
def test_real_ddp_run(
    tmp_path: Path, ranks: int, where: str, slowed: str, every: int, phase: str | None, verdict: str
) -> None:
    res = _straggler_run(tmp_path, ranks, "ddp", where, slowed, every)
    assert res.returncode == 0, res.stderr
    summary = summarize_json(tmp_path / "logs" / "r")
    view = summary["straggler"]
    why = format_json(summary) + "\n" + res.stderr
    assert summary["loss"]["status"] == "complete", why
    assert summary["environment"]["training_strategy"] == "ddp", why
    # A CPU run: said so instead of empty GPU figures; traceml run ends with the
    # short form.
    assert any("no allocator figures" in n for n in summary["notes"]), why
    assert "traceml: files: complete" in res.stderr, why
    assert view["verdict"] == verdict, why
    # DDP's gradient buckets are measured: the verdict rests on them, without a caveat.
    assert view["basis"] == "collectives", why
    if verdict == "none":
        assert view["stragglers"] == [], why
        assert view["caveat"] is None, why
        assert "traceml: straggler: none" in res.stderr, why
        return
    expected = [int(r) for r in slowed.split(",")]
    assert [s["rank"] for s in view["stragglers"]] == expected, why
    assert {s["phase"] for s in view["stragglers"]} == {phase}, why
    for entry in view["stragglers"]:
        # The sleep is 30 ms; the excess is that, give or take the machine's noise.
        assert 20.0 < entry["excess_ms"] < 45.0, why
        if where == "collate":
            assert entry["phase_description"] == "in the DataLoader, before the step", why
        if where == "dataloader_in_step":
            assert entry["phase_description"] == "in the DataLoader, inside the step", why
    assert view["waiting"]["phase"] == "backward", why
    assert view["waiting"]["collective"] == "all_reduce", why
    assert view["waiting"]["rank_count"] == ranks - len(expected), why
    if verdict == "intermittent":
        assert view["stragglers"][0]["every_n_steps"] == every, why
    named = ", ".join(map(str, expected))
    line = f"traceml: straggler: rank{'s' if len(expected) > 1 else ''} {named}"
    assert line in res.stderr, why


# Collectives hide the straggler from phase times: under FSDP2 every phase ends in one,
# and a script's own all_reduce sits between backward and the optimizer.
COLLECTIVE_CASES = [
    # (ranks, strategy, where, slowed, every, phase, verdict, waiting phases, collectives)
    (2, "fsdp2", "forward", "1", 1, "forward", "straggler", {"forward"}, {"all_gather"}),
    (
        2,
        "fsdp2",
        "backward",
        "1",
        1,
        "backward",
        "straggler",
        {"backward"},
        {"all_gather", "reduce_scatter"},
    ),
    (
        2,
        "fsdp2",
        "optimizer",
        "1",
        1,
        "optimizer",
        "straggler",
        {"rest_of_step", "forward"},
        {"all_gather"},
    ),
    (
        2,
        "fsdp2",
        "collate",
        "1",
        1,
        "dataloader_wait",
        "straggler",
        {"rest_of_step", "forward"},
        {"all_gather"},
    ),
    (4, "fsdp2", "forward", "1,2", 1, "forward", "straggler", {"forward"}, {"all_gather"}),
    (2, "fsdp2", "forward", "1", 5, "forward", "intermittent", {"forward"}, {"all_gather"}),
    (2, "fsdp2", "none", "", 1, None, "none", set(), set()),
    (2, "allreduce", "backward", "1", 1, "backward", "straggler", {"rest_of_step"}, {"all_reduce"}),
    (4, "ddp", "backward", "3", 1, "backward", "straggler", {"backward"}, {"all_reduce"}),
]


@pytest.mark.slow
def test_real_ddp_run_whose_slow_rank_exits_early(tmp_path: Path) -> None:
    """Rank 1, 30 ms slow in forward, calls os._exit(0) after its 10th step (rank 0
    then fails in the next all-reduce): the verdict names it, and says its steps end
    early, instead of finding no straggler."""
    res = run_cli(
        [
            *("run", "--logs-dir", tmp_path / "logs", "--run-name", "r"),
            *("--nproc-per-node", "2", "--master-port", str(free_port())),
            *("--exporter", "jsonl", "--export-streams", "all", SCRIPT),
            *("--where", "forward", "--slow-ranks", "1", "--steps", "40"),
            *("--sleep-ms", "30", "--exit-after", "10"),
        ],
        cwd=tmp_path,
    )
    assert res.returncode != 0  # rank 0's script fails once its peer is gone
    summary = summarize_json(tmp_path / "logs" / "r")
    view = summary["straggler"]
    why = format_json(summary) + "\n" + res.stderr
    # How many of its steps reach the files depends on what its sender had not sent
    # yet when it exited (on a busy machine, most): with enough steps in common the
    # verdict names it; with fewer it says it cannot judge, and why.
    if view["verdict"] == "n/a":
        assert "step(s) that every rank has" in view["reason"], why
        assert [s["rank"] for s in view["stopped"]] == [1], why
    else:
        assert view["verdict"] == "straggler", why
        assert [s["rank"] for s in view["stragglers"]] == [1], why
        assert [s["rank"] for s in view["stopped"]] in ([], [1]), why
    if view["stopped"]:
        assert "rank 1: steps end at step" in verdict_line(view), why
    assert "missing rank 1" in summary["loss"]["line"], why


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "strategy", "where", "slowed", "every", "phase", "verdict", "waits", "ops"),
    COLLECTIVE_CASES,
    ids=[f"{c[0]}ranks-{c[1]}-{c[2]}-slow{c[3] or 'none'}-every{c[4]}" for c in COLLECTIVE_CASES],
)
def test_real_run_through_collectives(
    tmp_path: Path,
    ranks: int,
    strategy: str,
    where: str,
    slowed: str,
    every: int,
    phase: str | None,
    verdict: str,
    waits: set[str],
    ops: set[str],
) -> None:
    res = _straggler_run(tmp_path, ranks, strategy, where, slowed, every)
    assert res.returncode == 0, res.stderr
    folder = tmp_path / "logs" / "r"
    summary = summarize_json(folder)
    view = summary["straggler"]
    why = format_json(summary) + "\n" + res.stderr
    assert summary["loss"]["status"] == "complete", why
    assert view["basis"] == "collectives", why
    assert view["verdict"] == verdict, why
    # The --json form carries the same view.
    cli = run_cli(["summary", "--json", folder], cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    assert orjson.loads(cli.stdout)["straggler"] == orjson.loads(orjson.dumps(view)), why
    if verdict == "none":
        assert view["stragglers"] == [] and view["caveat"] is None, why
        assert "traceml: straggler: none" in res.stderr and "would not show" not in res.stderr
        return
    expected = [int(r) for r in slowed.split(",")]
    assert [s["rank"] for s in view["stragglers"]] == expected, why
    assert {s["phase"] for s in view["stragglers"]} == {phase}, why
    for entry in view["stragglers"]:
        assert 20.0 < entry["excess_ms"] < 45.0, why
    assert view["waiting"]["phase"] in waits, why
    assert view["waiting"]["collective"] in ops, why
    assert view["waiting"]["rank_count"] == ranks - len(expected), why
    # Per step, over every step compared (a fifth of them slow when intermittent).
    assert view["waiting"]["wait_ms_per_step"] > (15.0 if verdict == "straggler" else 3.0), why
    if verdict == "intermittent":
        assert view["stragglers"][0]["every_n_steps"] == every, why
    named = ", ".join(map(str, expected))
    line = f"traceml: straggler: rank{'s' if len(expected) > 1 else ''} {named}"
    assert line in res.stderr, why
    assert f"the others wait in {view['waiting']['phase']}'s" in res.stderr, why


def _collectives_line(rank: int, step: int, wait: float | None) -> dict[str, Any]:
    return {
        "stream": "collectives",
        "schema_version": 1,
        "observed_timestamp_unix_ns": 1,
        "rank": rank,
        "global_rank": rank,
        "local_rank": rank,
        "world_size": 2,
        "local_world_size": 2,
        "node_rank": 0,
        "timestamp_unix_ns": 1,
        "seq": step,
        "step": step,
        "phase": P + "backward_time",
        "op": "all_reduce",
        "source": "ddp_comm_hook",
        "backend": "gloo",
        "n_calls": 1,
        "wait_ms": wait,
        "wait_measure": "host" if wait is not None else "none",
        "first_arrival_ms": 1.0,
        "last_arrival_ms": 1.0,
    }


def _with_collectives(run: Path, lines: list[dict[str, Any]]) -> None:
    closing = {
        "stream": "collectives",
        "closing": True,
        "schema_version": 1,
        "written_records": len(lines),
        "dropped_batches": 0,
    }
    (run / "aggregator" / "export" / "collectives.jsonl").write_bytes(
        b"".join(orjson.dumps(o) + b"\n" for o in [*lines, closing])
    )


def test_measured_waits_see_a_rank_slow_inside_the_synchronizing_phase(tmp_path: Path) -> None:
    """Phase times alike on both ranks (rank 1 computes 20 ms longer in backward, rank 0
    waits as long there): inferred, none with a caveat; measured, rank 1 in backward."""
    lines = simulate(2, 30, sync="backward")
    for line in lines:
        backward = line["events"][EVENTS["backward"]]["cpu"]
        for key in ("cpu_ms", "duration_ms"):
            backward[key] += 20.0
        line["events"][P + "step_time"]["cpu"]["cpu_ms"] += 20.0
        line["events"][P + "step_time"]["cpu"]["duration_ms"] += 20.0
    run = folder(tmp_path, lines)
    inferred = summarize_json(run)["straggler"]
    assert inferred["basis"] == "phase_times" and inferred["verdict"] == "none"
    _with_collectives(
        run,
        [_collectives_line(r, s, 20.5 if r == 0 else 0.5) for s in range(1, 31) for r in (0, 1)],
    )
    summary = summarize_json(run)
    view = summary["straggler"]
    assert view["basis"] == "collectives"
    assert view["verdict"] == "straggler", verdict_line(view)
    assert [s["rank"] for s in view["stragglers"]] == [1]
    assert view["stragglers"][0]["phase"] == "backward"
    assert (view["waiting"]["phase"], view["waiting"]["collective"]) == ("backward", "all_reduce")
    assert 19.0 < view["waiting"]["wait_ms_per_step"] < 21.0
    assert summary["loss"]["status"] == "complete"


@pytest.mark.parametrize(
    ("lines", "note"),
    [
        # Rank 1 sent no collectives line: an engine TraceML does not see.
        ([_collectives_line(0, s, 1.0) for s in range(1, 31)], "none seen on rank(s) 1"),
        # NCCL without timing: waits not measured.
        (
            [_collectives_line(r, s, None) for s in range(1, 31) for r in (0, 1)],
            "wait not measured on rank(s) 0, 1",
        ),
    ],
)
def test_unseen_collectives_fall_back_to_phase_times_and_say_so(
    tmp_path: Path, lines: list[dict[str, Any]], note: str
) -> None:
    run = folder(tmp_path, simulate(2, 30, {1: ("forward", 20.0, 1)}))
    _with_collectives(run, lines)
    summary = summarize_json(run)
    assert summary["straggler"]["basis"] == "phase_times"
    assert summary["straggler"]["verdict"] == "straggler"  # still found, from phase times
    assert any(n.startswith("collectives: ") and note in n for n in summary["notes"]), summary[
        "notes"
    ]


def test_a_blip_neither_hides_nor_joins_a_rhythm() -> None:
    """A rank slow by 30 ms every 5th step, with two 3 ms blips of its own and one of
    another rank (a busy machine): its slow steps are the five of the rhythm."""
    from traceml_ai.analysis import _straggler

    steps = list(range(2, 26))
    own = {r: [1.0] * len(steps) for r in range(4)}
    for i, step in enumerate(steps):
        if step % 5 == 0:
            own[3][i] = 31.0
    own[3][steps.index(9)] = own[3][steps.index(18)] = 4.2
    own[0][steps.index(7)] = 3.5
    import numpy as np

    slow = _straggler._intermittent(np.array([own[r] for r in range(4)]), 2.0)
    assert list(slow) == [3]  # rank 3's index
    assert [steps[i] for i in slow[3]] == [5, 10, 15, 20, 25]
    assert _straggler._period([steps[i] for i in slow[3]], steps) == 5


FIXTURES = Path(__file__).parent / "fixtures"


def test_real_runs_on_a_busy_machine() -> None:
    """Two real 4-rank DDP runs (gloo) on 2 busy cores, kept as files: with no rank
    slowed, the scheduler delayed rank 0 by 3-4 ms in 4 of 24 steps, which is no
    straggler; with rank 3's collate_fn sleeping 30 ms every
    5th step, rank 3 is intermittent, every 5th step, in the DataLoader."""
    from traceml_ai.analysis import summarize_run

    quiet = summarize_run(FIXTURES / "busy_four_ranks_no_straggler").straggler
    assert quiet is not None and quiet.verdict == "none", quiet and quiet.line()
    slow = summarize_run(FIXTURES / "busy_four_ranks_rank3_every_5th").straggler
    assert slow is not None and slow.verdict == "intermittent", slow and slow.line()
    (entry,) = slow.stragglers
    assert (entry.rank, entry.every_n_steps, entry.phase) == (3, 5, "dataloader_wait")
