"""Disk full and I/O errors at finalization (issue 10, item 3): no traceback reaches the
user, and a warning file that cannot be written is printed as one ``traceml:`` line.

The subprocess tests produce real errors on a small tmpfs (root only, else skipped): the
file system is filled up (ENOSPC) or remounted read-only (EROFS) while the aggregator
runs. The in-process test fakes the failing write (``_write_atomically`` raises ENOSPC)
so the warning's stderr line is also checked where no file system can be mounted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.e2e_helpers import PY, clean_env
from traceml_ai.aggregator import Aggregator, AggregatorConfig
from traceml_ai.export import _finalize
from traceml_ai.export._finalize import WarningWriteError
from traceml_ai.settings import ExportSettings
from traceml_ai.transport.wire import (
    ENV_RUN_TOKEN,
    encode_frame,
    make_batch_message,
    make_finished_message,
)

TOKEN = "io-errors-token"
IDENTITY: dict[str, object] = {
    "global_rank": 0,
    "local_rank": 0,
    "world_size": 1,
    "local_world_size": 1,
    "node_rank": 0,
    "hostname": None,
    "pid": 1,
}


def _step_items(first: int, n: int) -> list[dict[str, Any]]:
    timing = {"cpu_ms": 1.0, "duration_ms": 1.0, "gpu_ms": None, "is_gpu": False, "n_calls": 1}
    return [
        {
            "timestamp_unix_ns": time.time_ns(),
            "seq": i,
            "step": i + 1,
            "events": {"_traceml_internal:step_time": {"cpu": timing}},
        }
        for i in range(first, first + n)
    ]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs, unmounted afterwards; skips the test where it cannot be mounted."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root only): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def _fill(folder: Path) -> None:
    """Write a file in ``folder`` until the file system is full."""
    chunk = b"\0" * 4096
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                return
    finally:
        os.close(fd)


@pytest.mark.parametrize("fault", ["disk_full", "read_only"])
def test_aggregator_on_a_failing_disk_reports_without_traceback(
    small_fs: Path, tmp_path: Path, fault: str
) -> None:
    run_dir = small_fs / "run"
    config = {
        "run_dir": str(run_dir),
        "export": {"exporter": "jsonl", "export_streams": "step_time", "exporter_hostname": False},
        "bind_host": "127.0.0.1",
        "port": 0,
        "expected_world_size": 1,
        "finalize_timeout_sec": 5.0,
    }
    overlay: Path | None = None
    proc = subprocess.Popen(
        [PY, "-m", "traceml_ai.aggregator", orjson.dumps(config).decode()],
        cwd=tmp_path,
        env=clean_env({ENV_RUN_TOKEN: TOKEN}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = orjson.loads(proc.stdout.readline())
        assert ready["event"] == "ready", ready
        path = run_dir / "aggregator" / "export" / "step_time.jsonl"
        with socket.create_connection((ready["host"], ready["port"])) as sock:
            sock.sendall(
                encode_frame(make_batch_message(TOKEN, IDENTITY, "step_time", _step_items(0, 5)))
            )
            deadline = time.monotonic() + 60
            while not (path.exists() and path.stat().st_size > 0):
                assert time.monotonic() < deadline, "no line written"
                time.sleep(0.05)
            if fault == "disk_full":
                _fill(small_fs)
                # More than a page of lines: the file cannot take them.
                for first in range(5, 2005, 500):
                    items = _step_items(first, 500)
                    sock.sendall(
                        encode_frame(make_batch_message(TOKEN, IDENTITY, "step_time", items))
                    )
                sock.sendall(encode_frame(make_finished_message(TOKEN, IDENTITY, 5, 0, {})))
            else:
                # A read-only file system over the run folder: the open export files
                # go on (and close cleanly), every new file (warning, stats) fails.
                subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(run_dir)],
                    check=True,
                )
                overlay = run_dir
                # The rank lost 3 batches: a loss the warning must tell.
                finished = make_finished_message(TOKEN, IDENTITY, 1, 3, {"step_time": 3})
                sock.sendall(encode_frame(finished))
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        if overlay is not None:
            subprocess.run(["umount", "-l", str(overlay)], capture_output=True, check=False)
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and all(line.startswith("traceml: ") for line in lines), err
    finalized = orjson.loads(out.splitlines()[-1])
    assert finalized["event"] == "finalized" and finalized["warning"] is None, finalized
    # The warning file could not be written: its content is on stderr, one line.
    warning_path = run_dir / "finalization_warning.json"
    prefix = f"traceml: cannot write {warning_path} ("
    reported = [line for line in lines if line.startswith(prefix)]
    assert len(reported) == 1, err
    content = orjson.loads(reported[0].split("; its content: ", 1)[1])
    assert content["reason"] == "export_incomplete"
    assert not warning_path.exists()
    if fault == "disk_full":
        assert content["export"]["failed_records"] > 0
        assert content["export"]["written_records"] >= 5
        # The file that failed has no closing line: it did not finish cleanly.
        assert b'"closing"' not in path.read_bytes()
    else:
        assert content["export"]["dropped_batches"] == 3
        assert content["export"]["written_records"] == 5


def test_warning_that_cannot_be_written_is_printed_as_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_space(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_finalize, "_write_atomically", no_space)
    agg = Aggregator(
        AggregatorConfig(
            run_dir=tmp_path / "run",
            settings=ExportSettings("jsonl", "step_time", False),
            token=TOKEN,
            expected_world_size=2,
            finalize_timeout_sec=2.0,
        )
    )
    agg.start()
    result = agg.finalize()
    assert result.warning_path is None
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    path = tmp_path / "run" / "finalization_warning.json"
    assert line.startswith(f"traceml: cannot write {path} ([Errno 28] No space left on device)")
    content = orjson.loads(line.split("; its content: ", 1)[1])
    assert content["reason"] == "ranks_disconnected" and content["missing_ranks"] == [0, 1]
    with contextlib.suppress(FileNotFoundError):
        assert not path.exists()


def test_warning_write_error_is_an_oserror_with_the_content(tmp_path: Path) -> None:
    folder = tmp_path / "gone"  # no such folder: the temp file cannot be created
    loss = _finalize.ExportLoss(
        written_records=1,
        dropped_batches=2,
        failed_records=0,
        skipped_items=0,
        exporter_failed=False,
    )
    with pytest.raises(OSError) as info:
        _finalize.write_finalization_warning(folder, export_loss=loss)
    exc = info.value
    assert isinstance(exc, WarningWriteError)
    assert exc.errno == errno.ENOENT
    assert orjson.loads(exc.content)["export"]["dropped_batches"] == 2
    assert "; its content: {" in str(exc)
    assert "\n" not in exc.report_line()
