"""The synthetic tp x dp x pp run generator (tests/parallel_cases.py): the files it
writes are what the schemas accept, its timing holds together, and removing the
injected cause makes the step shorter."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_helpers import data_lines
from tests.parallel_cases import (
    BACKWARD,
    FORWARD,
    OPTIMIZER,
    STEP,
    GroundTruth,
    Layout,
    generate,
)
from traceml_records import validate_paths

CASES: dict[str, dict[str, Any]] = {
    "none": {},
    "slow_stage": {"stage_extra_ms": {1: 6.0}},
    "slow_rank": {"slow_rank": {1: 30.0}},
    "data_imbalance": {"seq_len": (64, 256), "tokens": True},
    "tp_slow_rank": {"tp": 2, "slow_rank": {5: 10.0}},
    "1f1b_pp4": {"schedule": "1f1b", "pp": 4, "dp": 2, "stage_extra_ms": {2: 6.0}},
    "in_phases": {"p2p_phase": "phases", "dp_phase": "backward", "slow_rank": {0: 20.0}},
    "early_exit": {"slow_rank": {2: 20.0}, "exit_after": {3: 12}},
    "two_nodes": {"tp": 2, "ranks_per_node": 4, "dp_phase": "optimizer"},
}


def _export(gt: GroundTruth) -> Path:
    return gt.folder / "aggregator" / "export"


@pytest.mark.parametrize("name", list(CASES))
def test_the_files_are_valid(tmp_path: Path, name: str) -> None:
    gt = generate(tmp_path / name, steps=16, **CASES[name])
    # The new fields (runtime_environment.parallel / parallel_source, collectives
    # group / peer_rank / peer_stage / bytes, step_time.tokens) need the issue-42 schema
    # change; before it, their keys were the only problems ("key is not allowed here").
    report = validate_paths([gt.folder])
    assert report.ok, "\n".join(map(str, report.problems[:20]))
    names = {f.name for f in _export(gt).iterdir()}
    assert names == {"step_time.jsonl", "collectives.jsonl", "runtime_environment.jsonl"}
    for path in _export(gt).iterdir():
        data_lines(path)  # closed, counted, one stream


def _lines(gt: GroundTruth, stream: str) -> list[dict[str, Any]]:
    return data_lines(_export(gt) / f"{stream}.jsonl")


def _ms(line: dict[str, Any], event: str) -> float:
    timing = line["events"].get(event)
    return float(timing["cpu"]["duration_ms"]) if timing else 0.0


@pytest.mark.parametrize("name", list(CASES))
def test_every_ms_of_a_step_is_work_or_a_wait(tmp_path: Path, name: str) -> None:
    """A step is its forward, backward and optimizer plus the waits reported outside
    them (in step_time); the tp all-reduces lie inside forward and backward."""
    gt = generate(tmp_path / name, steps=12, **CASES[name])
    outside: dict[tuple[int, int], float] = defaultdict(float)
    for c in _lines(gt, "collectives"):
        if c["phase"] == STEP:
            outside[(c["global_rank"], c["step"])] += c["wait_ms"]
    for line in _lines(gt, "step_time"):
        parts = _ms(line, FORWARD) + _ms(line, BACKWARD) + _ms(line, OPTIMIZER)
        key = (line["global_rank"], line["step"])
        assert _ms(line, STEP) == pytest.approx(parts + outside[key], abs=1e-4), key


def test_layout_and_identity(tmp_path: Path) -> None:
    gt = generate(tmp_path / "r", tp=2, dp=2, pp=2, steps=4, ranks_per_node=4)
    assert gt.declared == "tp=2,dp=2,pp=2"
    envs = {e["global_rank"]: e for e in _lines(gt, "runtime_environment")}
    assert sorted(envs) == list(range(8))
    for g, env in envs.items():
        # Megatron order: tp fastest, then dp, then pp.
        want = {"tp": g % 2, "dp": (g // 2) % 2, "pp": g // 4}
        assert env["parallel"] == {k: {"rank": v, "size": 2} for k, v in sorted(want.items())}
        assert list(env["parallel"]) == ["dp", "pp", "tp"]
        assert env["parallel_source"] == "declared"
        assert gt.coords[g] == want
        assert (env["node_rank"], env["local_rank"], env["topology"]) == (
            g // 4,
            g % 4,
            "multi_node",
        )
    assert Layout(2, 2, 2).rank(1, 0, 1) == 5


def test_point_to_point_lines_name_their_peers(tmp_path: Path) -> None:
    gt = generate(tmp_path / "r", tp=2, dp=2, pp=2, steps=3)
    lay = gt.layout
    seen = set()
    for c in _lines(gt, "collectives"):
        me = lay.coords(c["global_rank"])
        if c["group"] == "pp":
            assert c["op"] in ("send", "recv")
            peer = lay.coords(c["peer_rank"])
            assert (peer["tp"], peer["dp"]) == (me["tp"], me["dp"])
            assert peer["pp"] == 1 - me["pp"] == c["peer_stage"]
            assert c["n_calls"] == 4  # one per microbatch
            assert c["bytes"] > 0
        else:
            assert c["op"] == "all_reduce"
            assert c["peer_rank"] is None and c["peer_stage"] is None
            assert c["group"] in ("dp", "tp")
        seen.add((c["group"], c["op"], c["phase"]))
    assert seen == {
        ("pp", "send", STEP),
        ("pp", "recv", STEP),
        ("dp", "all_reduce", STEP),
        ("tp", "all_reduce", FORWARD),
        ("tp", "all_reduce", BACKWARD),
    }


@pytest.mark.parametrize("name", ["slow_stage", "slow_rank", "data_imbalance", "1f1b_pp4"])
def test_removing_the_cause_makes_the_step_shorter(tmp_path: Path, name: str) -> None:
    gt = generate(tmp_path / name, **CASES[name])
    assert gt.step_ms_without_cause < gt.step_ms
    assert gt.slowdown > 1.1
    assert all(v < gt.step_ms for v in gt.step_ms_without.values())
    assert sum(gt.per_step_ms_without_cause) < sum(gt.per_step_ms)


def test_no_cause_no_slowdown(tmp_path: Path) -> None:
    gt = generate(tmp_path / "r")
    assert gt.slowdown == 1.0
    assert gt.slow_stages == gt.slow_ranks == () and not gt.data_imbalance
    assert gt.step_ms_without == {}


def test_known_answers(tmp_path: Path) -> None:
    # A rank 30 ms slower once a step delays the whole job by those 30 ms: its replica's
    # pipeline and, through the dp all-reduce, the other replica.
    rank = generate(tmp_path / "rank", slow_rank={1: 30.0})
    assert rank.slow_rank == 1 and rank.coords[1] == {"tp": 0, "dp": 1, "pp": 0}
    assert rank.step_ms - rank.step_ms_without_cause == pytest.approx(30.0, abs=0.5)
    waits: dict[int, float] = defaultdict(float)
    for c in _lines(rank, "collectives"):
        if c["group"] == "dp":
            waits[c["global_rank"]] += c["wait_ms"] / 30
    # Replica 0 (ranks 0, 2) waits in the dp all-reduce; replica 1 hardly.
    assert waits[0] > 25 and waits[2] > 25 and waits[1] < 2 and waits[3] < 2
    # The last stage doing 6 ms more per microbatch, GPipe with 4: about 4 x 6 ms more.
    stage = generate(tmp_path / "stage", stage_extra_ms={1: 6.0})
    assert stage.slow_stage == 1
    assert stage.step_ms - stage.step_ms_without_cause == pytest.approx(4 * 6.0, abs=1.0)
    plain = generate(tmp_path / "plain")

    def p2p(gt: GroundTruth) -> dict[int, float]:
        out: dict[int, float] = defaultdict(float)
        for c in _lines(gt, "collectives"):
            if c["group"] == "pp":
                out[c["global_rank"]] += c["wait_ms"] / 30
        return out

    more = {r: p2p(stage)[r] - p2p(plain)[r] for r in range(4)}
    # Stage 0 (ranks 0, 1) waits the 24 ms for stage 1: in its blocking sends while
    # stage 1 is still busy with the previous forward, in its recvs of the gradients;
    # stage 1 (ranks 2, 3) no longer than in the pipeline's own bubble.
    assert more[0] == pytest.approx(24.0, abs=1.5) and more[1] == pytest.approx(24.0, abs=1.5)
    assert max(more[2], more[3]) < 1.0


def test_data_imbalance_tokens(tmp_path: Path) -> None:
    gt = generate(tmp_path / "r", seq_len=(64, 256), tokens=True, steps=40)
    assert gt.data_imbalance
    tokens: dict[int, dict[int, int]] = defaultdict(dict)
    for line in _lines(gt, "step_time"):
        tokens[line["step"]][line["global_rank"]] = line["tokens"]
    for step, by_rank in tokens.items():
        # Both stages of a replica report the replica's tokens.
        assert by_rank[0] == by_rank[2] and by_rank[1] == by_rank[3]
        heavier = 0 if by_rank[0] >= by_rank[1] else 1
        assert gt.slowest_replica[step - 1] == heavier
    # The slowest replica changes from step to step.
    assert set(gt.slowest_replica) == {0, 1}
    plain = generate(tmp_path / "plain", steps=3)
    assert all("tokens" not in line for line in _lines(plain, "step_time"))


def test_early_exit_and_determinism(tmp_path: Path) -> None:
    a = generate(tmp_path / "a", exit_after={3: 5}, steps=10, seed=7, jitter_ms=0.5)
    b = generate(tmp_path / "b", exit_after={3: 5}, steps=10, seed=7, jitter_ms=0.5)
    steps = defaultdict(list)
    for line in _lines(a, "step_time"):
        steps[line["global_rank"]].append(line["step"])
    assert steps[3] == [1, 2, 3, 4, 5] and steps[0] == list(range(1, 11))
    assert max(c["step"] for c in _lines(a, "collectives") if c["global_rank"] == 3) == 5
    for name in ("step_time.jsonl", "collectives.jsonl", "runtime_environment.jsonl"):
        assert (_export(a) / name).read_bytes() == (_export(b) / name).read_bytes()
    c = generate(tmp_path / "c", exit_after={3: 5}, steps=10, seed=8, jitter_ms=0.5)
    assert (_export(c) / "step_time.jsonl").read_bytes() != (
        _export(a) / "step_time.jsonl"
    ).read_bytes()


def test_blocking_sends_under_1f1b_deadlock(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="deadlocks"):
        generate(tmp_path / "r", schedule="1f1b", pp=4, blocking_send=True, steps=2)
