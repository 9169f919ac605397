"""The aggregator process that ``traceml run`` starts: ``python -m traceml_ai.aggregator CONFIG``.

CONFIG is an :class:`AggregatorLaunchConfig` as JSON (run_dir, settings, bind_host,
port, expected_world_size, finalize_timeout_sec, parent_pid); the run token comes from
``TRACEML_RUN_TOKEN`` so it never shows in a process listing. It prints one event line
when it listens (:class:`ReadyEvent`, or :class:`FailedEvent`) and one when it has
finalized (:class:`FinalizedEvent`), and exits 0; SIGTERM or SIGINT make it finalize.
Config and events are attrs classes of ``traceml_ai.aggregator.protocol``, shared with the
launcher through one converter.

Those event lines go to the stdout it was started with, and only they do: anything
else written to stdout in this process (a custom exporter's ``print``) is sent to
stderr, so it can neither break the protocol nor fill a pipe nobody reads. If the
launcher (``parent_pid`` in CONFIG) dies without asking it to finalize, it finalizes
once the ranks have finished or disconnected, instead of serving forever.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path
from typing import TextIO

from traceml_ai._converter import StructureError
from traceml_ai.aggregator._process import tune_gc_for_aggregator
from traceml_ai.aggregator._runner import install_stop_handlers, run_until_done
from traceml_ai.aggregator._service import Aggregator, AggregatorConfig
from traceml_ai.aggregator.protocol import (
    AggregatorEvent,
    AggregatorLaunchConfig,
    FailedEvent,
    FinalizedEvent,
    ReadyEvent,
    dump_event,
)
from traceml_ai.transport.wire import ENV_RUN_TOKEN

PARENT_POLL_S = 0.5


def _protocol_stream() -> TextIO:
    """A private copy of stdout for the event lines; fd 1 becomes stderr for all else."""
    sys.stdout.flush()
    events = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    return events


def _emit(out: TextIO, event: AggregatorEvent) -> None:
    try:
        out.write(dump_event(event) + "\n")
        out.flush()
    except (BrokenPipeError, ValueError):
        # The launcher is gone (killed) and nobody reads the events: that is no
        # error of ours, and a traceback here would land on the user's terminal
        # after their prompt returned. Point the stream at nothing so its final
        # flush at exit cannot fail again.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, out.fileno())
            os.close(devnull)


def _watch_parent(parent_pid: int, aggregator: Aggregator, stop: threading.Event) -> None:
    """Set ``stop`` once the launcher is gone and its ranks finished or disconnected."""
    while not stop.wait(PARENT_POLL_S):
        if os.getppid() == parent_pid:
            continue
        # The launcher was killed: the ranks (in their own session) may still run;
        # serve them until they finish or disconnect, then finalize.
        while not stop.is_set():
            if aggregator.wait_all_finished(PARENT_POLL_S) or aggregator.wait_connections_closed(
                0.0
            ):
                break
        stop.set()
        return


def main(argv: list[str]) -> int:
    """Serve one run as configured by ``argv[0]`` (JSON)."""
    tune_gc_for_aggregator()
    out = _protocol_stream()
    try:
        raw = AggregatorLaunchConfig.from_json(argv[0] if argv else "")
    except StructureError as exc:
        # A launcher of another version, or a hand-made call: say what does not fit.
        _emit(out, FailedEvent(error=str(exc)))
        return 2
    config = AggregatorConfig(
        run_dir=Path(raw.run_dir),
        settings=raw.export,
        token=os.environ[ENV_RUN_TOKEN],
        bind_host=raw.bind_host,
        port=raw.port,
        expected_world_size=raw.expected_world_size,
        finalize_timeout_sec=raw.finalize_timeout_sec,
        monitor=raw.monitor,
    )
    aggregator = Aggregator(config)
    # Before starting (a custom exporter's factory may take a while): a SIGTERM from
    # the launcher, interrupted while we start, then finalizes as soon as we listen.
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        host, port = aggregator.start()
    except OSError as exc:
        _emit(out, FailedEvent(error=f"cannot listen on {config.bind_host}:{config.port}: {exc}"))
        return 1
    _emit(out, ReadyEvent(host=host, port=port, pid=os.getpid()))
    parent_pid = raw.parent_pid
    if parent_pid is not None:
        threading.Thread(
            target=_watch_parent,
            args=(parent_pid, aggregator, stop),
            name="traceml-parent-watch",
            daemon=True,
        ).start()
    result = run_until_done(aggregator, stop=stop, wait_for_ranks=False)
    stats = result.stats
    _emit(
        out,
        FinalizedEvent(
            written_records=stats.written_total if stats else 0,
            exporter_failed=stats.exporter_failed if stats else False,
            warning=str(result.warning_path) if result.warning_path else None,
            missing_ranks=tuple(result.ranks.missing_ranks),
            rejected_frames=result.rejected_frames,
            # False when no rank ever sent anything: the launcher then names the likely
            # cause (no traceml.init()) instead of a bare "something was lost".
            ranks_heard=aggregator.heard_from_ranks,
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
