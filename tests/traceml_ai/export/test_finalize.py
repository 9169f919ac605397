"""finalization_warning.json: written only on loss, per the spec, atomically, merged with what is there."""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from traceml_ai.export._finalize import RankOutcome, write_finalization_warning
from traceml_records import ExportLoss

WARNING = "finalization_warning.json"
NOW = datetime(2026, 3, 1, 12, 30, 5, 123456, tzinfo=timezone.utc)


def _validator() -> Draft202012Validator:
    schemas = resources.files("traceml_records") / "schemas"
    registry: Registry[Any] = Registry()
    main: dict[str, Any] = {}
    for entry in schemas.iterdir():
        if not entry.name.endswith(".schema.json"):
            continue
        contents = json.loads(entry.read_text(encoding="utf-8"))
        registry = registry.with_resource(contents["$id"], Resource.from_contents(contents))
        if entry.name == "finalization_warning.schema.json":
            main = contents
    assert main, "finalization_warning.schema.json not found"
    return Draft202012Validator(main, registry=registry)


VALIDATOR = _validator()


def loss(
    *,
    written: int = 10,
    dropped: int = 0,
    failed: int = 0,
    skipped: int = 0,
    exporter_failed: bool = False,
) -> ExportLoss:
    return ExportLoss(
        written_records=written,
        dropped_batches=dropped,
        failed_records=failed,
        skipped_items=skipped,
        exporter_failed=exporter_failed,
    )


def read(path: Path) -> dict[str, Any]:
    obj = json.loads(path.read_text(encoding="utf-8"))
    assert isinstance(obj, dict)
    errors = sorted(VALIDATOR.iter_errors(obj), key=str)
    assert errors == [], errors
    return obj


def names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir())


def test_nothing_lost_writes_nothing(tmp_path: Path) -> None:
    assert write_finalization_warning(tmp_path, export_loss=None) is None
    # Counts that show no loss are no loss.
    assert write_finalization_warning(tmp_path, export_loss=loss(written=5)) is None
    every_rank = RankOutcome(expected_world_size=2, finished_ranks=(0, 1), missing_ranks=())
    assert (
        write_finalization_warning(
            tmp_path, export_loss=None, ranks=every_rank, reason_if_ranks="timeout"
        )
        is None
    )
    assert names(tmp_path) == []


def test_export_only_is_export_incomplete(tmp_path: Path) -> None:
    path = write_finalization_warning(
        tmp_path, export_loss=loss(written=7, failed=3, dropped=2, skipped=1), now=NOW
    )
    assert path == tmp_path / WARNING
    obj = read(path)
    assert list(obj) == ["status", "completed_at", "reason", "message", "export"]
    assert obj["status"] == "warning"
    assert obj["reason"] == "export_incomplete"
    assert obj["completed_at"] == "2026-03-01T12:30:05.123456+00:00"
    assert obj["export"] == {
        "written_records": 7,
        "dropped_batches": 2,
        "failed_records": 3,
        "skipped_items": 1,
        "exporter_failed": False,
    }
    message = obj["message"]
    assert "3 records failed" in message and "2 batches dropped" in message
    assert "1 item skipped" in message and message.endswith(".")
    assert "\n" in path.read_text(encoding="utf-8").strip()  # pretty-printed
    assert names(tmp_path) == [WARNING]  # no temp file left


def test_exporter_failed_alone_is_a_loss(tmp_path: Path) -> None:
    path = write_finalization_warning(tmp_path, export_loss=loss(written=0, exporter_failed=True))
    assert path is not None
    obj = read(path)
    assert obj["export"]["exporter_failed"] is True
    assert "exporter failed" in obj["message"]
    completed = datetime.fromisoformat(obj["completed_at"])
    assert completed.utcoffset() == timedelta(0)
    assert abs(datetime.now(timezone.utc) - completed) < timedelta(minutes=1)
    assert obj["completed_at"].endswith("+00:00")


@pytest.mark.parametrize("reason", ["ranks_disconnected", "timeout"])
def test_missing_ranks_carry_the_rank_reason(tmp_path: Path, reason: Any) -> None:
    ranks = RankOutcome(expected_world_size=4, finished_ranks=[2, 0, 2], missing_ranks=[3, 1, 3])
    assert ranks.finished_ranks == (0, 2) and ranks.missing_ranks == (1, 3)
    path = write_finalization_warning(
        tmp_path, export_loss=loss(written=3), ranks=ranks, reason_if_ranks=reason, now=NOW
    )
    assert path is not None
    obj = read(path)
    assert obj["reason"] == reason
    assert obj["expected_world_size"] == 4
    assert obj["finished_ranks"] == [0, 2]
    assert obj["missing_ranks"] == [1, 3]
    assert "export" not in obj  # the export lost nothing
    assert "2 of 4 ranks" in obj["message"] and "1, 3" in obj["message"]


@pytest.mark.parametrize(
    ("relayed", "said"),
    [
        ([1, 2, 3], "(all of them send through a node's relay"),
        ([2], "(rank 2 sends through a node's relay"),
        ([1, 3], "(ranks 1, 3 send through a node's relay"),
        ([], None),
    ],
)
def test_missing_ranks_behind_a_relay_are_said_to_be(
    tmp_path: Path, relayed: list[int], said: str | None
) -> None:
    ranks = RankOutcome(
        expected_world_size=4,
        finished_ranks=[0],
        missing_ranks=[1, 2, 3],
        relayed_missing_ranks=relayed,
    )
    for reason in ("ranks_disconnected", "timeout"):
        (tmp_path / reason).mkdir()
        path = write_finalization_warning(
            tmp_path / reason, export_loss=None, ranks=ranks, reason_if_ranks=reason
        )
        assert path is not None
        message = read(path)["message"]
        assert "missing ranks 1, 2, 3" in message
        # Out of time, a relay's connection was still open: it did not end first.
        if said is not None and reason == "ranks_disconnected":
            assert said in message, message
        else:
            assert "relay" not in message, message


def test_missing_ranks_and_export_loss_together(tmp_path: Path) -> None:
    ranks = RankOutcome(expected_world_size=2, finished_ranks=[0], missing_ranks=[1])
    path = write_finalization_warning(
        tmp_path,
        export_loss=loss(failed=4),
        ranks=ranks,
        reason_if_ranks="timeout",
        message="Rank 1 timed out and 4 records were not exported.",
    )
    assert path is not None
    obj = read(path)
    assert obj["reason"] == "timeout"
    assert obj["missing_ranks"] == [1]
    assert obj["export"]["failed_records"] == 4
    assert obj["message"] == "Rank 1 timed out and 4 records were not exported."


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    ranks = RankOutcome(expected_world_size=2, finished_ranks=[0], missing_ranks=[1])
    with pytest.raises(ValueError, match="reason_if_ranks"):
        write_finalization_warning(tmp_path, export_loss=None, ranks=ranks)
    with pytest.raises(ValueError, match="aware"):
        write_finalization_warning(
            tmp_path, export_loss=loss(failed=1), now=datetime(2026, 1, 1, 0, 0)
        )
    with pytest.raises(ValueError, match="blank"):
        write_finalization_warning(tmp_path, export_loss=loss(failed=1), message="  ")
    assert names(tmp_path) == []


@pytest.mark.parametrize(
    ("world", "finished", "missing"),
    [(2, [0, 1], [1]), (2, [0], [2]), (0, [], [0]), (3, [-1], [0])],
)
def test_rank_outcome_is_checked(world: int, finished: list[int], missing: list[int]) -> None:
    with pytest.raises(ValueError):
        RankOutcome(expected_world_size=world, finished_ranks=finished, missing_ranks=missing)


def test_existing_warning_gets_the_export_block_and_keeps_its_content(tmp_path: Path) -> None:
    ranks = RankOutcome(expected_world_size=3, finished_ranks=[0], missing_ranks=[1, 2])
    first = write_finalization_warning(
        tmp_path,
        export_loss=None,
        ranks=ranks,
        reason_if_ranks="ranks_disconnected",
        message="Ranks 1 and 2 disconnected.",
        now=NOW,
    )
    assert first is not None
    before = read(first)
    later = NOW + timedelta(seconds=3)

    second = write_finalization_warning(
        tmp_path, export_loss=loss(written=50, dropped=5), now=later
    )

    assert second == first
    after = read(second)
    assert after["export"] == {
        "written_records": 50,
        "dropped_batches": 5,
        "failed_records": 0,
        "skipped_items": 0,
        "exporter_failed": False,
    }
    for key in ("status", "reason", "message", "expected_world_size", "finished_ranks"):
        assert after[key] == before[key]
    assert after["missing_ranks"] == [1, 2]
    assert after["completed_at"] == later.isoformat()
    assert list(after) == [
        "status",
        "completed_at",
        "reason",
        "message",
        "expected_world_size",
        "finished_ranks",
        "missing_ranks",
        "export",
    ]
    assert names(tmp_path) == [WARNING]


def test_export_only_warning_becomes_a_rank_warning_when_ranks_are_missing(
    tmp_path: Path,
) -> None:
    write_finalization_warning(tmp_path, export_loss=loss(failed=2), now=NOW)
    ranks = RankOutcome(expected_world_size=2, finished_ranks=[1], missing_ranks=[0])
    path = write_finalization_warning(
        tmp_path, export_loss=None, ranks=ranks, reason_if_ranks="timeout", now=NOW
    )
    assert path is not None
    obj = read(path)
    assert obj["reason"] == "timeout"
    assert obj["missing_ranks"] == [0]
    assert obj["export"]["failed_records"] == 2  # kept from the file
    assert "2 records failed" in obj["message"] and "1 of 2 ranks" in obj["message"]


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'{"status": "warning"}', b"", b'{"user": "notes"}\n'],
)
def test_unusable_existing_file_is_kept_aside(tmp_path: Path, content: bytes) -> None:
    (tmp_path / WARNING).write_bytes(content)
    (tmp_path / f"{WARNING}.invalid").write_bytes(b"an older backup")

    path = write_finalization_warning(tmp_path, export_loss=loss(skipped=9), now=NOW)

    assert path is not None
    assert read(path)["export"]["skipped_items"] == 9
    assert (tmp_path / f"{WARNING}.invalid").read_bytes() == b"an older backup"
    assert (tmp_path / f"{WARNING}.invalid.1").read_bytes() == content
    assert names(tmp_path) == [WARNING, f"{WARNING}.invalid", f"{WARNING}.invalid.1"]


def test_symlink_in_place_of_the_file_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "user.json"
    target.write_bytes(b"precious")
    (tmp_path / WARNING).symlink_to(target)

    path = write_finalization_warning(tmp_path, export_loss=loss(failed=1), now=NOW)

    assert path is not None and not path.is_symlink()
    assert read(path)["reason"] == "export_incomplete"
    assert target.read_bytes() == b"precious"
    backup = tmp_path / f"{WARNING}.invalid"
    assert backup.is_symlink() and os.readlink(backup) == str(target)


def test_failed_write_leaves_no_temp_file_and_the_old_file_intact(tmp_path: Path) -> None:
    write_finalization_warning(tmp_path, export_loss=loss(failed=1), now=NOW)
    original = (tmp_path / WARNING).read_bytes()
    # A folder in the file's place can neither be read, kept aside (no hard link to a
    # folder) nor replaced: the call fails for real, leaving everything as it was.
    run_dir = tmp_path / "other"
    (run_dir / WARNING).mkdir(parents=True)
    with pytest.raises(OSError):
        write_finalization_warning(run_dir, export_loss=loss(failed=1), now=NOW)
    assert names(run_dir) == [WARNING]
    assert (tmp_path / WARNING).read_bytes() == original
    assert names(tmp_path) == [WARNING, "other"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_warning_file_gets_the_export_files_mode(tmp_path: Path, umask: int) -> None:
    from traceml_ai.export._jsonl import EXPORT_FILE_MODE

    old = os.umask(umask)
    try:
        path = write_finalization_warning(
            tmp_path,
            export_loss=ExportLoss(
                written_records=1,
                dropped_batches=1,
                failed_records=0,
                skipped_items=0,
                exporter_failed=False,
            ),
            now=NOW,
        )
        probe = tmp_path / "probe.jsonl"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, EXPORT_FILE_MODE))
    finally:
        os.umask(old)
    assert path is not None
    assert path.stat().st_mode & 0o777 == EXPORT_FILE_MODE & ~umask
    assert path.stat().st_mode & 0o777 == probe.stat().st_mode & 0o777
