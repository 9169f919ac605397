"""The scale load generator, small: simulated ranks over the real transport into a real
aggregator process, and exact accounting of every record sent (the ``bench/scale/``
package, ``python -m bench.scale``).

Seconds, not minutes, and no assertion on timing: the figures are ``bench.scale``'s.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

# The bench/scale/ package, imported by name (the repository root is on sys.path for
# the tests): python -m bench.scale runs the same code.
from bench import scale

pytestmark = pytest.mark.slow  # real runs, subprocesses or receivers (docs/testing.md)

SPEC = scale.LoadSpec(ranks=16, steps_per_s=20.0, seconds=3.0)


def test_small_load_through_traceml_serve_is_written_exactly_once(tmp_path: Path) -> None:
    """16 ranks (2 nodes x 8) x 20 steps/s x 3 s, every stream: each record once, valid."""
    result = scale.run_once(
        SPEC, "all", logs_dir=tmp_path, run_name="small", procs=2, do_validate=True, quiet=True
    )
    check = result.check
    assert check.exact, check
    assert result.dropped == 0 and check.missing_batches == 0
    # Every step of every rank, three times (step_time, step_memory, collectives), plus
    # the samplers.
    steps = SPEC.ranks * SPEC.total_steps * 3
    samples = SPEC.total_samples * (SPEC.ranks + SPEC.nodes * (1 + SPEC.gpus))
    assert check.written_records == check.generated_records == steps + samples + SPEC.ranks
    assert result.valid is not None and result.valid[0], result.valid
    stats = orjson.loads((tmp_path / "small" / "aggregator" / "stats.json").read_bytes())
    assert sum(stats["written_records"].values()) == check.written_records
    assert stats["dropped_batches"] == 0 and stats["finished_ranks"] == SPEC.ranks
    assert 1 <= stats["queue_high_water_batches"] <= stats["max_queue_batches"]
    assert 0 < stats["queue_high_water_bytes"] <= stats["max_queue_bytes"]
    assert stats["connections_total"] == SPEC.ranks and stats["rejected_frames"] == 0


def test_dropped_batches_are_accounted_for_exactly(tmp_path: Path) -> None:
    """A byte bound smaller than a step_time batch: those batches are all dropped at the
    aggregator, and written + records in dropped batches = records generated."""
    result = scale.run_once(
        SPEC,
        "all",
        logs_dir=tmp_path,
        run_name="drops",
        procs=1,
        do_validate=True,
        quiet=True,
        bounds=scale.QueueBounds(bytes=2_000),
    )
    check = result.check
    assert check.exact, check
    # At 20 steps/s and 4 flushes/s, a step_time batch (about 5 steps) is over 2,000 bytes.
    assert check.missing_batches == check.agg_dropped_batches == result.agg_dropped_batches > 0
    assert check.written_records + check.missing_records == check.generated_records
    assert check.duplicates == 0 and check.partial_batches == 0
    assert result.valid is not None and result.valid[0], result.valid
    warning = orjson.loads((tmp_path / "drops" / "finalization_warning.json").read_bytes())
    assert warning["export"]["dropped_batches"] == result.agg_dropped_batches
    assert warning["export"]["written_records"] == check.written_records


def test_paused_aggregator_real_senders_reconnect_and_files_stay_valid(tmp_path: Path) -> None:
    """SIGSTOP the aggregator 5 s under two real RankSenders sending fast enough to fill
    their socket buffers (a send times out, the sender reconnects while its old connection
    still holds data): whatever the senders drop is counted, the rest is written once, and
    each rank's records stay in seq order across its reconnections."""
    spec = scale.LoadSpec(ranks=2, steps_per_s=2000.0, seconds=9.0, ranks_per_node=2)
    r = scale.run_pause(
        spec,
        "step_time,step_memory",
        logs_dir=tmp_path,
        pause_at=1.5,
        pause_s=5.0,
        do_validate=True,
    )
    assert r["exact"], {k: v for k, v in r.items() if k not in ("results", "windows")}
    assert r["duplicates"] == 0 and r["out_of_order"] == 0
    assert r["missing_items"] == r["sender_dropped_exported_items"]
    assert r["valid"] is not None and r["valid"][0], r["valid"]
    assert r["written"] + r["missing_items"] == sum(
        x["put"]["step_time"] + x["put"]["step_memory"] for x in r["results"]
    )


def test_ranks_through_real_relay_processes_are_accounted_for_exactly(tmp_path: Path) -> None:
    """4 nodes x 2 ranks, each node's ranks through a real relay process (what ``traceml
    run`` starts per node): every record once, the relays forwarded every frame and
    dropped none, and the aggregator held one connection per relay."""
    spec = scale.LoadSpec(ranks=8, steps_per_s=20.0, seconds=3.0, ranks_per_node=2)
    relays = scale.RelayProcesses(stop_timeout_s=10.0)
    result = scale.run_once(
        spec,
        "all",
        logs_dir=tmp_path,
        run_name="relayed",
        procs=1,
        do_validate=True,
        quiet=True,
        route=lambda address, token: relays.route(address, token, spec.nodes),
        after_load=relays.stop,
    )
    check = result.check
    assert check.exact, check
    assert result.dropped == 0 and check.missing_batches == 0
    assert check.written_records == check.generated_records > 0
    assert relays.relays == spec.nodes == 4
    assert relays.totals["stopped_without_counts"] == 0, relays.totals
    assert relays.totals["dropped_batches"] == relays.totals["dropped_messages"] == 0
    # Every batch and finished message of every rank, and at least one relay message each.
    stats = orjson.loads((tmp_path / "relayed" / "aggregator" / "stats.json").read_bytes())
    assert relays.totals["forwarded_frames"] >= stats["accepted_batches"] + spec.ranks + 4
    assert stats["connections_total"] == spec.nodes and stats["finished_ranks"] == spec.ranks
    assert result.valid is not None and result.valid[0], result.valid


def test_a_job_captured_in_parts_and_replayed_at_once_is_accounted_for_exactly(
    tmp_path: Path,
) -> None:
    """4 nodes x 4 ranks through 4 relays, captured in 2 parts of 2 nodes, then replayed
    at once into one aggregator: every rank of both parts, every record once, one
    aggregator connection per captured relay connection; the kept capture replays again
    into a second aggregator with the same outcome."""
    spec = scale.LoadSpec(ranks=16, steps_per_s=20.0, seconds=2.0, ranks_per_node=4)
    kept = tmp_path / "capture"
    for run in ("replayed", "again"):
        result = scale.run_replay(
            spec, "all", logs_dir=tmp_path, run_name=run, parts=2, relays=4, procs=1,
            do_validate=True, quiet=True, capture_dir=kept,
        )  # fmt: skip
        check = result.check
        assert check.exact, check
        assert result.dropped == 0 and check.missing_batches == 0
        assert check.written_records == check.generated_records > 0
        stats = orjson.loads((tmp_path / run / "aggregator" / "stats.json").read_bytes())
        assert stats["finished_ranks"] == spec.ranks
        assert stats["connections_total"] == 4
        ranks = {
            orjson.loads(line)["global_rank"]
            for line in (tmp_path / run / "aggregator" / "export" / "step_time.jsonl")
            .read_bytes()
            .splitlines()
            if b'"closing"' not in line
        }
        assert ranks == set(range(spec.ranks))
        assert result.valid is not None and result.valid[0], result.valid
    assert len(list(kept.glob("*.bin"))) == 4
