"""Checking the files: every record accounted for, and ``traceml validate``."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from .items import LoadSpec

# -- checking the files -----------------------------------------------------------------


@dataclass
class Check:
    """What the files say, against what the generator logged."""

    generated_records: int = 0
    written_records: int = 0
    sender_dropped_batches: int = 0
    sender_dropped_records: int = 0
    sender_dropped_selected_batches: int = 0
    """Generator-dropped batches of wire streams that feed a selected file: the aggregator
    counts them in its ``dropped_batches`` too (the generator reports them in ``finished``)."""
    missing_batches: int = 0
    missing_records: int = 0
    partial_batches: int = 0
    duplicates: int = 0
    unexpected: int = 0
    agg_dropped_batches: int = -1
    closing_ok: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return (
            not self.problems
            and self.partial_batches == 0
            and self.duplicates == 0
            and self.unexpected == 0
            and self.closing_ok
            and self.missing_batches
            == self.agg_dropped_batches - self.sender_dropped_selected_batches
            and self.written_records + self.missing_records + self.sender_dropped_records
            == self.generated_records
        )


def _records_per_item(wire: str, files: set[str], gpus: int) -> int:
    if wire == "system":
        return ("system" in files) + gpus * ("system_gpu" in files)
    return 1 if wire in files else 0


def read_keys(path: Path, fields: Sequence[str]) -> tuple[list[list[int]], dict[str, Any] | None]:
    """Columns of ``fields`` over the data lines of ``path``, and its closing line."""
    cols: list[list[int]] = [[] for _ in fields]
    appends = [c.append for c in cols]
    closing = None
    loads = orjson.loads
    with open(path, "rb") as f:
        for line in f:
            obj = loads(line)
            if obj.get("closing") is True:
                closing = obj
                continue
            for append, name in zip(appends, fields, strict=True):
                append(obj[name])
    return cols, closing


def check_files(
    run_dir: Path, spec: LoadSpec, files: tuple[str, ...], logs: dict[int, dict[str, Any]]
) -> Check:
    """Count every record of the files by key against the generator's batch logs."""
    out = Check()
    export = run_dir / "aggregator" / "export"
    fileset = set(files)
    n, g = spec.ranks, spec.gpus
    # Count arrays per wire stream, indexed [rank, seq] (system_gpu adds a gpu axis).
    max_seq = {s: 1 for s in spec.wire_streams}
    for per_rank in logs.values():
        for s, (starts, sizes, _) in per_rank.items():
            if starts:
                st = np.frombuffer(starts, dtype=np.int64)
                sz = np.frombuffer(sizes, dtype=np.int32)
                max_seq[s] = max(max_seq[s], int(st[-1] + sz[-1]))
    counts: dict[str, np.ndarray] = {}
    closings: dict[str, dict[str, Any] | None] = {}
    plan = {
        "step_time": ("step_time", ("global_rank", "seq", "step")),
        "step_memory": ("step_memory", ("global_rank", "seq", "step")),
        "process": ("process", ("global_rank", "seq")),
        "system": ("system", ("node_rank", "seq")),
        "system_gpu": ("system", ("node_rank", "seq", "gpu_index")),
        "runtime_environment": ("runtime_environment", ("global_rank", "seq")),
        "stdout_stderr": ("stdout_stderr", ("rank", "seq")),
        "collectives": ("collectives", ("global_rank", "seq", "step")),
    }
    for stream in files:
        wire, fields = plan[stream]
        path = export / f"{stream}.jsonl"
        if not path.exists():
            out.problems.append(f"{stream}.jsonl missing")
            continue
        cols, closings[stream] = read_keys(path, fields)
        out.written_records += len(cols[0])
        if wire not in spec.wire_streams:
            out.unexpected += len(cols[0])
            continue
        a = np.asarray(cols[0], dtype=np.int64)
        seq = np.asarray(cols[1], dtype=np.int64)
        if stream in ("system", "system_gpu"):
            a = a * spec.ranks_per_node  # node_rank -> its local rank 0
        steps_ok = stream not in ("step_time", "step_memory", "collectives") or np.array_equal(
            np.asarray(cols[-1], dtype=np.int64), seq + 1
        )
        if not steps_ok:
            out.problems.append(f"{stream}: step != seq + 1")
        width = max_seq[wire]
        ok = (a >= 0) & (a < n) & (seq >= 0) & (seq < width)
        if stream == "system_gpu":
            gi = np.asarray(cols[2], dtype=np.int64)
            ok &= (gi >= 0) & (gi < g)
            c = np.zeros((n, width, g), dtype=np.int32)
            np.add.at(c, (a[ok], seq[ok], gi[ok]), 1)
        else:
            c = np.zeros((n, width), dtype=np.int32)
            np.add.at(c, (a[ok], seq[ok]), 1)
        out.unexpected += int((~ok).sum())
        out.duplicates += int((c > 1).sum())
        counts[stream] = c

    # Records each wire item became, per item: system items feed two files.
    per_item: dict[str, np.ndarray] = {}
    for wire in spec.wire_streams:
        shape = (n, max_seq[wire])
        total = np.zeros(shape, dtype=np.int32)
        for stream, (w, _) in plan.items():
            if w == wire and stream in counts:
                c = counts[stream]
                total += c.sum(axis=2) if c.ndim == 3 else c
        per_item[wire] = total
    for rank, per_rank in logs.items():
        for wire, (starts_b, sizes_b, dropped_b) in per_rank.items():
            if not starts_b:
                continue
            starts = np.frombuffer(starts_b, dtype=np.int64)
            sizes = np.frombuffer(sizes_b, dtype=np.int32).astype(np.int64)
            dropped = np.frombuffer(dropped_b, dtype=np.int8).astype(bool)
            r = _records_per_item(wire, fileset, g)
            row = per_item[wire][rank]
            got = np.add.reduceat(row[: int(starts[-1] + sizes[-1])], starts)
            want = sizes * r
            out.generated_records += int(want.sum())
            out.sender_dropped_batches += int(dropped.sum())
            out.sender_dropped_records += int(want[dropped].sum())
            if r == 0:
                continue
            out.sender_dropped_selected_batches += int(dropped.sum())
            if int(got[dropped].sum()):
                out.problems.append(
                    f"rank {rank} {wire}: a batch dropped by the sender was written"
                )
            sent = ~dropped
            whole = got[sent] == want[sent]
            none = got[sent] == 0
            out.partial_batches += int((~whole & ~none).sum())
            out.missing_batches += int(none.sum())
            out.missing_records += int(want[sent][none].sum())
    dropped_seen = {c.get("dropped_batches") for c in closings.values() if c}
    written_ok = all(
        c is not None and c.get("written_records") == int(counts[s].sum())
        for s, c in closings.items()
        if s in counts
    )
    out.closing_ok = len(dropped_seen) == 1 and written_ok and len(closings) == len(files)
    if dropped_seen:
        out.agg_dropped_batches = int(min(x for x in dropped_seen if x is not None))
    return out


def validate(run_dir: Path) -> tuple[bool, float, str]:
    """``traceml validate`` on the run folder: (ok, seconds, last output line)."""
    begin = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "traceml_ai", "validate", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=run_dir,
    )
    lines = (res.stdout + res.stderr).strip().splitlines()
    ok_files = sum(1 for line in lines if line.endswith(", OK"))
    summary = (
        f"{ok_files} of {len(lines)} files OK" if res.returncode == 0 else "\n".join(lines[-5:])
    )
    return res.returncode == 0, time.monotonic() - begin, summary
