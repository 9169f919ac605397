"""The aggregator child process of ``traceml run``, seen from the launcher: started
with its config, waited for (ready, finalized) over its event lines, stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

from traceml_ai._converter import StructureError
from traceml_ai.aggregator.protocol import (
    AggregatorEvent,
    AggregatorLaunchConfig,
    FailedEvent,
    FinalizedEvent,
    ReadyEvent,
    parse_event,
)
from traceml_ai.launch._child_lines import ChildLines
from traceml_ai.launch._plan import RunOptions, RunPlan
from traceml_ai.launch._signals import Signals, exit_description, say
from traceml_ai.transport.wire import ENV_RUN_TOKEN

AGGREGATOR_READY_TIMEOUT_S = 60.0

WATCH_S = 0.2
"""How often, while the ranks train, the launcher looks whether the aggregator died."""


class AggregatorProcess:
    """The aggregator child process, seen from the launcher."""

    def __init__(self, options: RunOptions, p: RunPlan) -> None:
        assert p.run_dir is not None
        config = AggregatorLaunchConfig(
            run_dir=str(p.run_dir),
            export=options.export.settings,
            bind_host=p.bind_host,
            port=p.port,
            expected_world_size=p.world_size,
            finalize_timeout_sec=options.finalize_timeout_sec,
            monitor=options.monitor,
            # Lets it finalize on its own if we die without asking it to.
            parent_pid=os.getpid(),
        )
        env = dict(os.environ)
        env[ENV_RUN_TOKEN] = p.token
        self.finalize_timeout_sec = options.finalize_timeout_sec
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "traceml_ai.aggregator", config.to_json()],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self._lines = ChildLines()
        self._stop_sent = False
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def _read_event(
        self, timeout: float, give_up: Callable[[], bool] | None = None
    ) -> AggregatorEvent | None:
        """The next event; None on timeout, end of stream, a bad line or ``give_up()``."""
        assert self.proc.stdout is not None
        line = self._lines.next_line(self.proc.stdout.fileno(), timeout, give_up)
        if line is None:
            return None
        try:
            return parse_event(line)
        except StructureError:
            return None

    def ask_to_finalize(self) -> None:
        """SIGTERM it once: it finalizes as soon as it can (even while still starting)."""
        if not self._stop_sent and self.proc.poll() is None:
            self._stop_sent = True
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()

    def wait_ready(self, signals: Signals) -> tuple[str, int] | str:
        """The address it listens on, or why it did not start.

        A signal while it starts asks it to finalize right after it started; a second
        one stops waiting for it.
        """
        seen = signals.count

        def give_up() -> bool:
            if signals.count > seen:
                self.ask_to_finalize()
            return signals.count > seen + 1

        event = self._read_event(AGGREGATOR_READY_TIMEOUT_S, give_up)
        if event is None:
            self._kill()
            code = self.proc.returncode
            if signals.count > seen + 1:
                return "interrupted while it started"
            if code is not None and code != 0 and code != -signal.SIGKILL:
                return f"the aggregator {exit_description(code)} while starting"
            return "the aggregator did not start"
        if not isinstance(event, ReadyEvent):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5.0)
            return (
                event.error if isinstance(event, FailedEvent) else "the aggregator failed to start"
            )
        return event.host, event.port

    def watch(self, export_on: bool) -> None:
        """Say at once, in one line, if it dies while the ranks train (they go on
        without it; the end of the run says what was lost). Stopped by :meth:`finalize`."""
        files = (
            "the export files keep what it wrote, without closing lines"
            if export_on
            else "export was off"
        )

        def run() -> None:
            while not self._watch_stop.wait(WATCH_S):
                code = self.proc.poll()
                if code is not None:
                    if self._stop_sent:  # asked to finalize (a signal while it started)
                        return
                    say(
                        f"the aggregator {exit_description(code)} during the run: training "
                        f"goes on without telemetry or live views, and nothing more is "
                        f"recorded; {files} (the end of the run says what was lost)"
                    )
                    return

        self._watcher = threading.Thread(target=run, name="traceml-aggregator-watch", daemon=True)
        self._watcher.start()

    def _stop_watching(self) -> None:
        # Joined before anything else polls the process: Popen's poll() from two threads
        # may see None while the other holds its wait lock.
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join()

    def finalize(self, signals: Signals) -> tuple[FinalizedEvent | None, str]:
        """Ask it to finalize and wait (bounded): (the ``finalized`` event, "") or
        (None, what happened to it instead).

        A first signal meanwhile only says how long this may take; a second stops it.
        """
        self._stop_watching()
        code = self.proc.poll()
        if code is not None:
            self._kill()
            return None, f"{exit_description(code)} during the run"
        self.ask_to_finalize()
        seen = signals.count
        told = False

        def give_up() -> bool:
            nonlocal told
            if signals.count > seen and not told:
                told = True
                say(
                    "finishing the export (at most "
                    f"{self.finalize_timeout_sec + 15.0:.0f} s); press Ctrl-C again to stop it now"
                )
            return signals.count > seen + 1

        event = self._read_event(self.finalize_timeout_sec + 15.0, give_up)
        if isinstance(event, FinalizedEvent):
            try:
                self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._kill()
            return event, ""
        interrupted = signals.count > seen + 1
        if not interrupted:
            # It may be writing its last lines; give it a moment before the kill.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=2.0)
        still_running = self.proc.poll() is None
        self._kill()
        if interrupted:
            return None, "was stopped by a second Ctrl-C while it finalized"
        if still_running:
            return None, f"did not finalize within {self.finalize_timeout_sec + 15.0:.0f} s"
        return None, f"{exit_description(self.proc.returncode)} while it finalized"
