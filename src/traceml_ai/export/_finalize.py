"""``finalization_warning.json``: written in the run folder only when something was lost."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import attrs
import orjson

from traceml_ai.export._jsonl import EXPORT_FILE_MODE
from traceml_records import (
    ExportLoss,
    FinalizationWarning,
    MonitoringLoss,
    RecordError,
    dumps_warning_file,
    loads_warning_file,
)
from traceml_records.internal import LOADERS, export_shows_loss

__all__ = [
    "WARNING_FILE_NAME",
    "RankOutcome",
    "WarningWriteError",
    "write_finalization_warning",
]

WARNING_FILE_NAME = "finalization_warning.json"
"""The warning file's name inside the run folder."""

RankReason = Literal["ranks_disconnected", "timeout"]


class WarningWriteError(OSError):
    """``finalization_warning.json`` could not be written (disk full, read-only, I/O error).

    An ``OSError`` (callers that catch ``OSError`` keep working) that carries what the
    file would have held, so the loss can still be reported: ``content`` is the warning
    as one line of JSON, and ``str()`` of the error includes it.
    """

    def __init__(self, path: Path, error: OSError, content: str) -> None:
        super().__init__(error.errno, error.strerror or str(error))
        self.path = path
        self.error = error
        self.content = content

    def __str__(self) -> str:
        return f"{self.error}; its content: {self.content}"

    def report_line(self) -> str:
        """The one stderr line that stands in for the file: ``traceml: cannot write ...``."""
        return f"traceml: cannot write {self.path} ({self.error}); its content: {self.content}"


def _rank_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(set(values)))


def _check_ranks(outcome: RankOutcome, _attr: Any, _value: Any) -> None:
    n = outcome.expected_world_size
    if n < 1:
        raise ValueError(f"expected_world_size must be >= 1, got {n}")
    both = outcome.finished_ranks + outcome.missing_ranks
    if any(r < 0 or r >= n for r in both):
        raise ValueError(f"ranks must lie in [0, {n}), got {list(both)}")
    common = set(outcome.finished_ranks) & set(outcome.missing_ranks)
    if common:
        raise ValueError(f"ranks both finished and missing: {sorted(common)}")


@attrs.frozen(kw_only=True)
class RankOutcome:
    """Which global ranks finished and which did not, out of the expected world size.

    Both rank lists are stored sorted and without repeats; they must be disjoint
    and lie in ``[0, expected_world_size)``. ``missing_ranks`` may be empty (every
    rank finished), which is not a loss.
    """

    expected_world_size: int
    finished_ranks: tuple[int, ...] = attrs.field(converter=_rank_tuple)
    missing_ranks: tuple[int, ...] = attrs.field(converter=_rank_tuple, validator=_check_ranks)
    relayed_missing_ranks: tuple[int, ...] = attrs.field(default=(), converter=_rank_tuple)
    """The missing ranks behind a node's relay (their batches came through it, or it said
    it is there for them and they had no connection of their own): its connection ended
    before they finished, so the relay may have failed rather than the ranks (said so in
    the message)."""

    @property
    def lost(self) -> bool:
        """Whether some rank did not finish."""
        return bool(self.missing_ranks)


def _shows_loss(loss: ExportLoss) -> bool:
    return export_shows_loss(
        loss.dropped_batches, loss.failed_records, loss.skipped_items, loss.exporter_failed
    )


def _plural(n: int, word: str, words: str | None = None) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {words or word + 's'}"


def _export_clause(loss: ExportLoss) -> str:
    parts = []
    if loss.failed_records:
        parts.append(f"{_plural(loss.failed_records, 'record')} failed")
    if loss.dropped_batches:
        parts.append(f"{_plural(loss.dropped_batches, 'batch', 'batches')} dropped")
    if loss.skipped_items:
        parts.append(f"{_plural(loss.skipped_items, 'item')} skipped")
    if loss.exporter_failed:
        parts.append("the exporter failed")
    return (
        f"export wrote {_plural(loss.written_records, 'record')} but not all ({', '.join(parts)})"
    )


def _rank_clause(ranks: RankOutcome, reason: RankReason) -> str:
    missing = ", ".join(str(r) for r in ranks.missing_ranks)
    how = "before the timeout" if reason == "timeout" else "(disconnected)"
    relayed = [r for r in ranks.relayed_missing_ranks if r in set(ranks.missing_ranks)]
    through = ""
    if relayed and reason != "timeout":
        which = (
            "all of them send"
            if len(relayed) == len(ranks.missing_ranks)
            else f"rank {relayed[0]} sends"
            if len(relayed) == 1
            else f"ranks {', '.join(map(str, relayed))} send"
        )
        through = (
            f" ({which} through a node's relay, whose connection ended before they "
            "finished: the relay may have stopped, not the ranks)"
        )
    return (
        f"{len(ranks.missing_ranks)} of {ranks.expected_world_size} ranks did not finish "
        f"{how}: missing rank{'s' if len(ranks.missing_ranks) != 1 else ''} {missing}{through}"
    )


def monitoring_lost(loss: MonitoringLoss) -> bool:
    """Whether the live views lost anything (a drop, a failure, a view that did not start)."""
    return bool(
        loss.dropped_batches
        or any(n for counts in loss.by_sink.values() for n in counts.values())
        or loss.not_started
    )


def monitoring_clause(loss: MonitoringLoss) -> str:
    """What the live views lost, as a clause (the export files are not concerned)."""
    parts: list[str] = []
    if loss.dropped_batches:
        parts.append(f"{loss.dropped_batches} batches skipped by the live views")
    for sink, counts in sorted(loss.by_sink.items()):
        lost = ", ".join(f"{n} {what.replace('_', ' ')}" for what, n in sorted(counts.items()) if n)
        if lost:
            parts.append(f"{sink}: {lost}")
    for sink, why in sorted(loss.not_started.items()):
        parts.append(f"{sink} did not start ({why})")
    return "the live views lost data (" + "; ".join(parts) + "; the export files are unaffected)"


def _default_message(
    loss: ExportLoss | None,
    ranks: RankOutcome | None,
    reason: RankReason | None,
    live_loss: MonitoringLoss | None = None,
) -> str:
    clauses = []
    if ranks is not None and reason is not None:
        clauses.append(_rank_clause(ranks, reason))
    if loss is not None:
        clauses.append(_export_clause(loss))
    if live_loss is not None:
        clauses.append(monitoring_clause(live_loss))
    text = "; ".join(clauses)
    return text[0].upper() + text[1:] + "."


def _check_warning(w: FinalizationWarning) -> None:
    """The warning's schema and named rules, as ``traceml validate`` and
    ``loads_warning_file`` check them (traceml_records._rules); ValueError on the first
    broken one."""
    try:
        loads_warning_file(dumps_warning_file(w))
    except RecordError as exc:
        raise ValueError(str(exc)) from None


def _encode(w: FinalizationWarning) -> bytes:
    """Pretty-printed bytes of ``w``, checked by the strict loader before they are written."""
    data = dumps_warning_file(w)
    # Round-trip through the generated strict loader: what goes to disk must load back equal.
    loaded = LOADERS[FinalizationWarning](orjson.loads(data), ())
    if loaded != w:
        raise ValueError("finalization warning does not round-trip")
    _check_warning(loaded)
    return data


def _read_existing(path: Path) -> tuple[bool, FinalizationWarning | None]:
    """(whether anything is at ``path``, the warning it holds if valid)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False, None
    except OSError:
        # A symlink (ELOOP), a folder or an unreadable file: something is there, not usable.
        return os.path.lexists(path), None
    try:
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read()
        loaded = LOADERS[FinalizationWarning](orjson.loads(raw), ())
        assert isinstance(loaded, FinalizationWarning)
        _check_warning(loaded)
    except (OSError, ValueError, RecordError):
        return True, None
    return True, loaded


def _keep_aside(path: Path) -> Path:
    """Hard-link the unusable entry at ``path`` to a free ``<name>.invalid[.N]`` and return it.

    A hard link (never a copy or a rename) keeps the old bytes reachable at every
    instant, and ``os.link`` refuses an existing name, so no earlier backup is lost.
    """
    for i in range(1000):
        backup = path.with_name(f"{path.name}.invalid" + (f".{i}" if i else ""))
        try:
            os.link(path, backup, follow_symlinks=False)
        except FileExistsError:
            continue
        return backup
    raise FileExistsError(f"no free name to keep {path} aside")


def _create_temp(path: Path) -> tuple[int, str]:
    """A new temp file beside ``path`` with the export files' mode (umask applied).

    ``tempfile.mkstemp`` would make it 0600, so the warning file would be the one
    file of the run folder that a reader of the export files cannot open.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, EXPORT_FILE_MODE), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temp name beside {path}")


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # Make the rename itself durable; a folder that cannot be fsynced is no reason to fail.
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def write_finalization_warning(
    run_dir: Path,
    *,
    export_loss: ExportLoss | None,
    ranks: RankOutcome | None = None,
    reason_if_ranks: RankReason | None = None,
    message: str | None = None,
    monitoring_loss: MonitoringLoss | None = None,
    now: datetime | None = None,
) -> Path | None:
    """Write ``<run_dir>/finalization_warning.json`` if something was lost; return its path.

    Something was lost when ``export_loss`` shows a loss (dropped batches, failed
    records, skipped items or ``exporter_failed``; counts that show none are not
    written) or when ``ranks`` has missing ranks. Nothing lost: nothing is
    written or touched, and None is returned.

    ``reason`` is ``export_incomplete`` only when export is the only problem;
    with missing ranks it is ``reason_if_ranks`` (required then, else
    ValueError) and the rank fields are written. ``message`` (one sentence,
    non-blank) defaults to one naming what was lost. ``completed_at`` is
    ``now`` (an aware datetime; default the current time) in UTC ISO-8601.

    If the file already exists and holds a valid warning (another warning
    started it), the export block is added to it (replacing an export block it
    had) and everything else it had is kept: its reason, message and rank
    fields; only ``completed_at`` moves to now. Rank fields of ours are added
    only if it had none, and then ``reason`` and ``message`` become ours, since
    ``export_incomplete`` would no longer be true. If what exists cannot be
    read as a valid warning, it is kept, byte for byte, under
    ``finalization_warning.json.invalid`` (or ``.invalid.N``, the first free
    name) and a fresh warning is written. The file is written atomically (temp
    file in the same folder, fsync, rename) and validated with the generated
    strict loader before it is written. When it cannot be written (an ``OSError``:
    disk full, read-only folder, I/O error), :class:`WarningWriteError` is raised with
    the content; nothing half-written is left under the warning's name.
    """
    loss = export_loss if export_loss is not None and _shows_loss(export_loss) else None
    rank_loss = ranks if ranks is not None and ranks.lost else None
    live_loss = (
        monitoring_loss
        if monitoring_loss is not None and monitoring_lost(monitoring_loss)
        else None
    )
    if loss is None and rank_loss is None and live_loss is None:
        return None
    reason: Literal[
        "export_incomplete", "monitoring_incomplete", "ranks_disconnected", "timeout"
    ] = "export_incomplete" if loss is not None else "monitoring_incomplete"
    if rank_loss is not None:
        if reason_if_ranks is None:
            raise ValueError("reason_if_ranks is required when ranks are missing")
        reason = reason_if_ranks
    if message is not None and not message.strip():
        raise ValueError("message must not be blank")
    when = now if now is not None else datetime.now(timezone.utc)
    if when.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    completed_at = when.astimezone(timezone.utc).isoformat()

    path = Path(run_dir) / WARNING_FILE_NAME
    exists, old = _read_existing(path)

    fresh = FinalizationWarning(
        completed_at=completed_at,
        reason=reason,
        message=message
        if message is not None
        else _default_message(loss, rank_loss, reason_if_ranks, live_loss),
        expected_world_size=rank_loss.expected_world_size if rank_loss else None,
        finished_ranks=rank_loss.finished_ranks if rank_loss else None,
        missing_ranks=rank_loss.missing_ranks if rank_loss else None,
        export=loss,
        monitoring=live_loss,
    )
    if old is None:
        new = fresh
    elif old.missing_ranks is not None or rank_loss is None:
        # Its reason, message and rank fields stand; our export block joins them.
        new = attrs.evolve(
            old, completed_at=completed_at, export=loss if loss is not None else old.export
        )
    else:
        # It said export was the only problem; ranks are missing too, so our
        # reason and message (which name both) replace its own.
        new = attrs.evolve(fresh, export=loss if loss is not None else old.export)
        if loss is None and message is None:
            new = attrs.evolve(
                new, message=_default_message(old.export, rank_loss, reason_if_ranks)
            )

    if live_loss is not None and new.monitoring is None:
        new = attrs.evolve(new, monitoring=live_loss)
    data = _encode(new)
    try:
        if exists and old is None:
            _keep_aside(path)
        _write_atomically(path, data)
    except OSError as exc:
        content = orjson.dumps(orjson.loads(data)).decode()
        raise WarningWriteError(path, exc, content) from exc
    return path
