"""The built-in JSONL exporter: one JSON Lines file per selected stream.

Files are created once, exclusively, when the exporter starts; lines go to disk
with plain ``os.write`` calls on the raw descriptor, so a reader tailing a file
sees each line as soon as ``export`` returns and never sees half a line except
at the very end while a write is in progress. A file whose write fails is
abandoned (no more lines, no closing line) while the other files go on. Every
file still healthy at ``close`` ends with exactly one closing line.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from traceml_ai.export._encoded import EncodedLines
from traceml_ai.export._protocol import ExportContext, ExporterError, ExportResult, ExportSummary
from traceml_records import STREAMS_BY_NAME, ClosingLine, dumps_line
from traceml_records.internal import STREAM_BY_CLASS, dumps_lines

__all__ = [
    "ExportCloseError",
    "ExportStartError",
    "ExportTargetExists",
    "JsonlExporter",
]

_log = logging.getLogger(__name__)

# O_EXCL refuses any existing entry, a symlink included (dangling or not), and
# O_NOFOLLOW makes that explicit; neither ever truncates nor appends.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# The export folder is opened once, without following a symlink, and every file
# is created relative to that descriptor, so swapping the folder for a symlink
# between the check and the creation cannot redirect the files.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
EXPORT_FILE_MODE = 0o644
"""Mode of every file the export writes (export files, the warning file), before the umask."""


class ExportStartError(Exception):
    """The exporter could not start; export is off for this run."""


class ExportTargetExists(ExportStartError):
    """A selected export file (or a symlink in its place) already exists.

    No file was created by this start (any that a racing start had created was
    removed again), and the existing entry was not touched.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(
            f"export file {path} already exists; TraceML never overwrites or appends "
            "to an existing export file, so export is off for this run"
        )


class ExportCloseError(ExporterError):
    """``close`` finished, but some files do not end with a closing line.

    ``streams`` names them, sorted; each was abandoned (a write failed, the file
    was removed, or it was still being written when ``close`` gave up waiting).
    """

    def __init__(self, streams: Sequence[str]) -> None:
        self.streams = tuple(sorted(streams))
        super().__init__(
            "export files without a closing line (a write failed or the file was removed): "
            + ", ".join(self.streams)
        )


class _StreamFile:
    """One export file and its counts; every field is guarded by ``lock``."""

    def __init__(self, stream: str, path: Path, fd: int) -> None:
        self.stream = stream
        self.path = path
        self.fd: int | None = fd
        self.lock = threading.Lock()
        self.written = 0
        self.serialization_failures = 0
        self.abandoned_reason: str | None = None
        self.closed = False
        self.last_link_check = time.monotonic()

    def abandon(self, reason: str) -> None:
        """Stop writing this file for good: close its descriptor, remember why."""
        if self.abandoned_reason is None:
            self.abandoned_reason = reason
            _log.warning(
                "traceml: export file %s abandoned (%s); its later records are not written",
                self.path,
                reason,
            )
        if self.fd is not None:
            fd, self.fd = self.fd, None
            # The descriptor is gone either way; the abandonment is what matters.
            with contextlib.suppress(OSError):
                os.close(fd)

    def removed(self) -> bool:
        """Whether the file was unlinked (a write to it would succeed and be lost)."""
        assert self.fd is not None
        return os.fstat(self.fd).st_nlink == 0


def _write_all(fd: int, data: bytes) -> int:
    """Write all of ``data`` to ``fd``; return the byte count. On OSError, ``.written`` is set."""
    view = memoryview(data)
    done = 0
    try:
        while done < len(data):
            n = os.write(fd, view[done:])
            if n == 0:
                # A regular file never legitimately takes zero bytes of a non-empty write;
                # looping on it would spin forever.
                raise OSError(errno.EIO, "write accepted no bytes")
            done += n
    except OSError as exc:
        exc.written = done  # type: ignore[attr-defined]
        raise
    return done


def _remove_created(dir_fd: int, created: Sequence[tuple[str, int]]) -> None:
    """Remove files this start created, and only those (same inode), then close them."""
    for name, fd in created:
        try:
            mine = os.fstat(fd)
            there = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass  # Already gone or replaced by someone else: nothing of ours to remove.
        finally:
            os.close(fd)


@functools.lru_cache(maxsize=4096)
def _all_written(n: int) -> ExportResult:
    """The result of a group written whole; results are immutable, so one per size serves
    every call (the fast path answers once per group)."""
    return ExportResult(written=n)


class JsonlExporter:
    """Writes each selected stream to ``<export_dir>/<stream>.jsonl``.

    Build it with :meth:`create`. ``export`` is called from one worker thread;
    ``close`` may come from another thread and waits at most
    ``close_wait_s`` per file for a write in progress.

    It declares ``export_input = "encoded_lines"``: the pipeline then lets the builder
    write step_time lines straight from the wire items (typed records are taken too).
    """

    export_input: Literal["encoded_lines"] = "encoded_lines"

    def __init__(
        self,
        context: ExportContext,
        files: Mapping[str, _StreamFile],
        *,
        link_check_interval_s: float,
        close_wait_s: float,
    ) -> None:
        """Use :meth:`create`; this only wires already-created files together."""
        self._context = context
        self._files = dict(files)
        self._link_check_interval_s = link_check_interval_s
        self._close_wait_s = close_wait_s
        self._close_lock = threading.Lock()
        self._closed = False

    @classmethod
    def create(
        cls,
        context: ExportContext,
        *,
        link_check_interval_s: float = 1.0,
        close_wait_s: float = 5.0,
    ) -> JsonlExporter:
        """Create the export folder and every selected file, empty, and return the exporter.

        The folder is created with its parents; if the folder path itself is a
        symlink, nothing is created and ``ExportStartError`` is raised. If any
        selected file already exists (a symlink too, dangling or not), no file
        is created and ``ExportTargetExists`` names it. Should a creation fail
        midway (another process racing), the files this call created are
        removed again, never anyone else's. Any other failure raises
        ``ExportStartError``. Existing files are never truncated or appended to.

        ``link_check_interval_s``: how often, at most, each file is checked for
        having been removed (a write to an unlinked file succeeds but is lost).
        ``close_wait_s``: how long ``close`` waits for a write in progress.
        """
        export_dir = Path(context.export_dir)
        names: dict[str, str] = {}
        for stream in context.streams:
            spec = STREAMS_BY_NAME.get(stream)
            if spec is None:
                raise ExportStartError(f"unknown export stream {stream!r}; export is off")
            names[stream] = spec.file_name

        try:
            is_link = stat.S_ISLNK(os.lstat(export_dir).st_mode)
        except FileNotFoundError:
            is_link = False
        except OSError as exc:
            raise ExportStartError(f"cannot inspect export folder {export_dir}: {exc}") from exc
        if is_link:
            raise ExportStartError(
                f"export folder {export_dir} is a symbolic link; TraceML does not "
                "follow it, so export is off for this run"
            )
        try:
            os.makedirs(export_dir, exist_ok=True)
            dir_fd = os.open(export_dir, _DIR_FLAGS)
        except OSError as exc:
            raise ExportStartError(
                f"cannot create export folder {export_dir} ({exc}); export is off for this run"
            ) from exc

        try:
            # Check every name before creating any, so an existing file leaves no
            # half-created set behind.
            for name in names.values():
                try:
                    os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise ExportStartError(
                        f"cannot inspect export file {export_dir / name} ({exc}); "
                        "export is off for this run"
                    ) from exc
                raise ExportTargetExists(export_dir / name)

            created: list[tuple[str, int]] = []
            try:
                for name in names.values():
                    fd = os.open(name, _CREATE_FLAGS, EXPORT_FILE_MODE, dir_fd=dir_fd)
                    created.append((name, fd))
            except BaseException as exc:
                _remove_created(dir_fd, created)
                if isinstance(exc, OSError):
                    path = export_dir / name
                    if isinstance(exc, FileExistsError) or exc.errno == errno.ELOOP:
                        raise ExportTargetExists(path) from exc
                    raise ExportStartError(
                        f"cannot create export file {path} ({exc}); export is off for this run"
                    ) from exc
                raise
        finally:
            os.close(dir_fd)

        files = {
            stream: _StreamFile(stream, export_dir / name, fd)
            for (stream, name), (_, fd) in zip(names.items(), created, strict=True)
        }
        return cls(
            context,
            files,
            link_check_interval_s=link_check_interval_s,
            close_wait_s=close_wait_s,
        )

    # -- queries ------------------------------------------------------------

    @property
    def paths(self) -> Mapping[str, Path]:
        """Selected stream → its file."""
        return {stream: f.path for stream, f in self._files.items()}

    @property
    def abandoned_streams(self) -> frozenset[str]:
        """Streams whose file was abandoned (it has no closing line)."""
        return frozenset(s for s, f in self._files.items() if f.abandoned_reason is not None)

    def abandoned_reason(self, stream: str) -> str | None:
        """Why ``stream``'s file was abandoned, or None while it is healthy."""
        return self._files[stream].abandoned_reason

    def written_lines(self, stream: str) -> int:
        """Data lines written whole to ``stream``'s file (the closing line not counted)."""
        return self._files[stream].written

    def serialization_failures(self, stream: str) -> int:
        """Records of ``stream`` that were not written because they had no valid line."""
        return self._files[stream].serialization_failures

    # -- protocol -----------------------------------------------------------

    def export(self, records: Sequence[Any]) -> ExportResult:
        """Write ``records`` (all of one stream) to that stream's file, one line each.

        ``records`` is a sequence of typed records or an :class:`EncodedLines` group
        (lines the builder already wrote). All lines of the group go out in one loop of
        ``os.write`` calls on the raw descriptor (short writes are continued), so they
        are visible to a reader as soon as this returns. Never raises for a failed
        write: the returned :class:`ExportResult` counts every record of THIS group
        once, with ``problem`` saying why some were not written:

        - ``written``: records written as whole lines (before a failure too);
        - ``failed``: records without a valid line (``RecordError``/``ValueError``/
          ``TypeError``, e.g. a non-finite float in a non-nullable field; the others
          are written and the stream goes on), records of no selected stream, or
          records exported after :meth:`close`;
        - ``abandoned``: records not written because the stream's file failed (a write
          raised ``OSError`` such as ENOSPC or EIO, or the file was found removed)
          during this group or before; the file takes no more lines.
        """
        n = len(records)
        if n == 0:
            return ExportResult(written=0)
        encoded = records if type(records) is EncodedLines else None
        if encoded is not None:
            spec = STREAMS_BY_NAME.get(encoded.stream)
        else:
            spec = STREAM_BY_CLASS.get(type(records[0]))
        stream_file = self._files.get(spec.name) if spec is not None else None
        if spec is None or stream_file is None:
            name = spec.name if spec is not None else type(records[0]).__name__
            return ExportResult(
                written=0, failed=n, problem=f"records of {name} are not a selected export stream"
            )
        f = stream_file
        with f.lock:
            if f.abandoned_reason is not None:
                return self._abandoned(f, n)
            if f.closed or f.fd is None:
                return ExportResult(written=0, failed=n, problem=f"export file {f.path} is closed")
            now = time.monotonic()
            if now - f.last_link_check >= self._link_check_interval_s:
                f.last_link_check = now
                try:
                    gone = f.removed()
                except OSError as exc:
                    f.abandon(f"cannot stat the file: {exc}")
                    gone = False
                if gone:
                    f.abandon("the file was removed")
                if f.abandoned_reason is not None:
                    return self._abandoned(f, n)

            # A stray record of another stream never goes into this file; neither does
            # one without a valid line (RecordError, ValueError, TypeError).
            if encoded is not None:
                # Written by the builder from the wire items (same bytes as dumps_line).
                data, bad = encoded.data, 0
            else:
                lines, bad = dumps_lines(
                    records, spec.record_class, include_hostname=self._context.include_hostname
                )
                data = b"".join(lines)
            f.serialization_failures += bad

            assert f.fd is not None
            try:
                _write_all(f.fd, data)
            except OSError as exc:
                done: int = getattr(exc, "written", 0)
                whole = data.count(b"\n", 0, done)
                f.written += whole
                f.abandon(f"write failed: {exc}")
                return ExportResult(
                    written=whole,
                    failed=bad,
                    abandoned=n - bad - whole,
                    problem=f"writing export file {f.path} failed ({exc}); the file is abandoned",
                )
            f.written += n - bad
            if bad:
                return ExportResult(
                    written=n - bad,
                    failed=bad,
                    problem=(
                        f"{bad} of {n} {f.stream} records could not be serialized "
                        "and were not written"
                    ),
                )
            return _all_written(n)

    @staticmethod
    def _abandoned(f: _StreamFile, n: int) -> ExportResult:
        return ExportResult(
            written=0,
            abandoned=n,
            problem=f"export file {f.path} was abandoned ({f.abandoned_reason})",
        )

    def close(self, summary: ExportSummary) -> None:
        """Write one closing line to every healthy file, fsync it, and close every file.

        Each closing line counts the data lines this exporter wrote to that file
        and carries ``summary.dropped_batches``. A file that fails now (closing
        line write, fsync, found removed) or whose write in progress outlasts
        ``close_wait_s`` is abandoned. Idempotent: later calls do nothing. After
        all files are handled, raises :class:`ExportCloseError` if any file
        (abandoned now or earlier) lacks a closing line.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for f in self._files.values():
            if not f.lock.acquire(timeout=self._close_wait_s):
                # The worker is stuck in a write: leave its descriptor alone (closing it
                # under a running write could hand the number to another file).
                if f.abandoned_reason is None:
                    f.abandoned_reason = "still being written when the exporter closed"
                continue
            try:
                self._close_one(f, summary.dropped_batches)
            finally:
                f.lock.release()
        not_clean = self.abandoned_streams
        if not_clean:
            raise ExportCloseError(sorted(not_clean))

    def _close_one(self, f: _StreamFile, dropped_batches: int) -> None:
        f.closed = True
        if f.fd is None:
            return
        try:
            if f.removed():
                f.abandon("the file was removed")
                return
            closing = ClosingLine(
                stream=f.stream,  # type: ignore[arg-type]
                written_records=f.written,
                dropped_batches=dropped_batches,
            )
            _write_all(f.fd, dumps_line(closing))
            os.fsync(f.fd)
        except OSError as exc:
            f.abandon(f"closing the file failed: {exc}")
            return
        fd, f.fd = f.fd, None
        # The closing line is written and fsynced: an error of close() itself (EIO on
        # some network file systems) cannot take it back, and must not raise out of here.
        with contextlib.suppress(OSError):
            os.close(fd)
