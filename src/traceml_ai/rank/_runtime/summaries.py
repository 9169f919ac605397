"""TraceML 0.5.0's end-of-run summaries, ``final_summary()`` and ``summary()``: this
rank's finished steps sent, then the run's figures read back (the export file when
the launcher names it, else this rank's own recent steps)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from traceml_ai import _environ
from traceml_ai.rank._init_config import warn_once
from traceml_ai.rank._runtime import sdk
from traceml_ai.rank._runtime.runtime import Runtime
from traceml_ai.rank._timing.step_timer import SHUTDOWN_GPU_WAIT_S
from traceml_ai.rank.identity import RankIdentity

__all__ = ["final_summary", "summary"]

_warn_once = warn_once
# Set by `traceml run` (traceml_ai.launch.launcher) for the ranks of the aggregator's node.
_ENV_SUMMARY_FILE = _environ.SUMMARY_FILE


def _flush_for_summary(runtime: Runtime, deadline: float) -> None:
    """Send this rank's finished steps now: resolve pending CUDA events, empty the sender."""
    timer = runtime.timer
    with sdk._lock:
        if timer.enabled and not timer.in_step:
            try:
                timer.drain(
                    sync=True, deadline=min(deadline, time.monotonic() + SHUTDOWN_GPU_WAIT_S)
                )
            except Exception as exc:
                timer.fail(exc)
    sender = runtime.sender
    if sender is None:
        return
    # The sender sends what is queued within its flush interval (a fraction of a second).
    while time.monotonic() < deadline and sender.pending_items > 0:
        time.sleep(0.02)


def final_summary(
    *,
    timeout_sec: float = 30.0,
    poll_interval_sec: float = 0.1,
    print_text: bool = False,
    rank0_only: bool = True,
) -> dict[str, Any] | None:
    """The run's summary so far: per-rank step time and phase figures, as a dict.

    ``None`` on ranks other than 0 when ``rank0_only`` (the default), and when
    TraceML is off in this process. Under ``traceml run`` with the jsonl exporter
    writing ``step_time``, it reads the run's ``step_time.jsonl`` (every rank): it
    sends this rank's finished steps and polls the file until its own last step is
    there, for at most ``timeout_sec`` (then the figures cover what was written, and
    ``complete`` is false). Other ranks may still be behind, so the final figures of
    a run are those read after it ended (the files' closing lines). With export off
    there are no files: the figures are this rank's own recent steps, and
    ``source`` says ``in_process``. ``print_text`` prints a few ``traceml:`` lines.
    Never raises for a missing aggregator or file: it says so once and returns what
    it has.
    """
    runtime = sdk._runtime
    identity = runtime.identity if runtime is not None else RankIdentity.from_env()
    if rank0_only and identity.global_rank != 0:
        return None
    history = sdk._history
    if history is None or (runtime is None and history.total_steps == 0):
        why = (
            "TraceML is disabled (disabled=True or TRACEML_DISABLED=1)"
            if sdk._state == "disabled"
            else "TraceML did not run in this process"
        )
        _warn_once("summary_off", f"traceml: summary(): {why}; there is no summary")
        return None
    deadline = time.monotonic() + max(0.0, float(timeout_sec))
    if runtime is not None:
        _flush_for_summary(runtime, deadline)
    # The summary engine loads here, not with the rank SDK: most runs never ask.
    from traceml_ai.analysis import in_process

    recent, total = history.snapshot()
    file_text = os.environ.get(_ENV_SUMMARY_FILE, "").strip()
    if file_text:
        reader, reached = in_process.wait_for_file(
            Path(file_text),
            identity.global_rank,
            history.last_step,
            deadline - time.monotonic(),
            float(poll_interval_sec),
        )
        notes: list[str] = []
        if not reached:
            notes.append(
                f"timed out after {timeout_sec:g} s waiting for rank {identity.global_rank}'s "
                f"step {history.last_step} in {file_text}; figures cover the steps written"
            )
            _warn_once("summary_timeout", f"traceml: summary(): {notes[-1]}")
        result = in_process.full_analysis(Path(file_text), complete=reader.closed, notes=notes)
        if result is None:
            result = in_process.build_summary(
                reader.steps,
                source="export",
                complete=reader.closed,
                notes=notes,
                file=file_text,
            )
    else:
        steps = {identity.global_rank: dict(recent)}
        notes = [
            f"export of step_time is off: figures are rank {identity.global_rank}'s own "
            f"last {len(recent)} of {total} steps, measured in this process"
        ]
        result = in_process.build_summary(
            steps, source="in_process", complete=runtime is None, notes=notes
        )
    if print_text:
        print(in_process.text(result), flush=True)
    return result


def summary(
    *,
    timeout_sec: float = 30.0,
    poll_interval_sec: float = 0.1,
    print_text: bool = False,
    rank0_only: bool = True,
) -> dict[str, Any] | None:
    """:func:`final_summary` as a flat dict for experiment trackers (W&B, MLflow).

    Keys as TraceML 0.5.0 names them where the figure is the same
    (``traceml/step_time/step_time_ms``, ``.../forward_ms``, ``.../input_wait_ms``,
    ...): each is the mean over ranks of each rank's mean per step. ``None`` where
    :func:`final_summary` is ``None``.
    """
    from traceml_ai.analysis import in_process

    return in_process.compact(
        final_summary(
            timeout_sec=timeout_sec,
            poll_interval_sec=poll_interval_sec,
            print_text=print_text,
            rank0_only=rank0_only,
        )
    )
