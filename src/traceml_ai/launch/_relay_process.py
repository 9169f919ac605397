"""The node's relay of a multi-node ``traceml run``, in a process of its own: started
before the ranks, restarted on the same port if it dies while they train, stopped
(forwarding what it holds) after they exit.

The child is ``python -m traceml_ai.launch._relay_process CONFIG`` (JSON: upstream host
and port, listen host and port, stop timeout, the launcher's pid, and its node's global
ranks as ``[start, stop]`` when known); the run token comes
from ``TRACEML_RUN_TOKEN`` so it never shows in a process listing. It prints one JSON
line when it listens and reached the aggregator, or gave up waiting for it
(``{"event": "ready", "port": N}``; ``{"event": "failed", ...}`` if it cannot listen)
and one when it stopped (``{"event": "stopped", ...}`` with its counts); SIGTERM or
SIGINT make it stop. A relay of its own process: a relay killed or stuck never takes
the launcher or the ranks with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from traceml_ai.launch._child_lines import ChildLines
from traceml_ai.launch._signals import Signals, exit_description, say
from traceml_ai.transport.wire import ENV_RUN_TOKEN

READY_TIMEOUT_S = 30.0
"""Longest wait for a relay process to listen."""
MAX_RESTARTS = 3
"""Relay processes started again after one died during the run, at most."""
UPSTREAM_WAIT_S = 2.0
"""Longest wait, before it says it is ready, for the relay's first connection upstream:
its first message (which names the node's ranks) is then on its way before any rank
starts, when the aggregator can be reached."""
WATCH_S = 0.2
"""How often, while the ranks train, the launcher looks whether the relay died."""
PARENT_POLL_S = 0.5


REFUSED_TOKEN_CHECK = "is TRACEML_RUN_TOKEN that aggregator's?"
"""What to check when an aggregator refuses a relay given ``TRACEML_RUN_TOKEN``."""


def relay_losses(
    upstream: str,
    *,
    dropped_batches: int,
    dropped_messages: int,
    refused_frames: int,
    upstream_connections: int,
    pending_frames: int,
    token_check: str = REFUSED_TOKEN_CHECK,
) -> str:
    """What a stopped relay lost, for the end of its ``relay stopped`` line: ``""`` when
    nothing, else ``"; ..."`` parts saying what and where it is counted. ``token_check``:
    what to check when the aggregator refused the relay (where its token came from)."""
    lost = ""
    if dropped_batches or dropped_messages:
        if not upstream_connections:
            where = f"the aggregator at {upstream} was never reached"
        elif pending_frames:
            # What is still pending at the stop holds its last report of the drops.
            where = (
                f"the aggregator at {upstream} could not be reached at the end, so its "
                "finalization_warning.json does not count them"
            )
        else:
            where = "the aggregator counts them in its finalization_warning.json"
        lost = (
            f"; dropped {dropped_batches} batches and {dropped_messages} other messages ({where})"
        )
    if refused_frames:
        lost += (
            f"; {refused_frames} frames went out on connections {upstream} "
            f"closed as soon as they opened ({token_check}): they are lost"
        )
    return lost


def split_address(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port); ``ValueError`` if malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


class RelayProcess:
    """The relay child process, seen from ``traceml run``."""

    def __init__(
        self, upstream: str, token: str, stop_timeout_s: float, ranks: range | None = None
    ) -> None:
        """``ranks``: the node's global ranks, which the relay tells the aggregator it is
        there for (see ``Relay``); None when unknown."""
        self.upstream = upstream
        self._token = token
        self._ranks = ranks
        self._stop_timeout_s = stop_timeout_s
        self._port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines = ChildLines()
        self._restarts = 0
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> int | str:
        """Start it: the loopback port the ranks send to, or why it did not start."""
        host, port = split_address(self.upstream)
        config = {
            "upstream": [host, port],
            "port": self._port,
            "stop_timeout_s": self._stop_timeout_s,
            "parent_pid": os.getpid(),
        }
        if self._ranks is not None:
            config["ranks"] = [self._ranks.start, self._ranks.stop]
        env = dict(os.environ)
        env[ENV_RUN_TOKEN] = self._token
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "traceml_ai.launch._relay_process", json.dumps(config)],
                stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            return f"the node's relay could not start ({exc.strerror or exc})"
        self._proc = proc
        self._lines.reset()
        event = self._read_event(READY_TIMEOUT_S)
        if event is None or event.get("event") != "ready" or type(event.get("port")) is not int:
            self._kill()
            why = event.get("error") if event else None
            return f"the node's relay did not start{f' ({why})' if why else ''}"
        self._port = event["port"]
        return self._port

    def _read_event(
        self, timeout: float, give_up: Callable[[], bool] | None = None
    ) -> dict[str, Any] | None:
        proc = self._proc
        if proc is None or proc.stdout is None:
            return None
        line = self._lines.next_line(proc.stdout.fileno(), timeout, give_up)
        if line is None:
            return None
        try:
            event = json.loads(line)
        except ValueError:
            return None
        return event if isinstance(event, dict) else None

    def watch(self) -> None:
        """While the ranks train, start it again on the same port if it dies (one line
        each time; the ranks reconnect to it), at most ``MAX_RESTARTS`` times."""

        def run() -> None:
            while not self._watch_stop.wait(WATCH_S):
                with self._lock:
                    proc = self._proc
                    code = proc.poll() if proc is not None else None
                    if code is None or self._watch_stop.is_set():
                        continue
                    if self._restarts >= MAX_RESTARTS:
                        say(
                            f"the node's relay {exit_description(code)}; this node's ranks "
                            "send nothing more (the end of the run says what was lost)"
                        )
                        self._proc = None
                        return
                    self._restarts += 1
                    started = self.start()
                    if isinstance(started, str):
                        say(
                            f"the node's relay {exit_description(code)} and {started}; this "
                            "node's ranks send nothing more (the end of the run says what "
                            "was lost)"
                        )
                        self._proc = None
                        return
                    say(
                        f"the node's relay {exit_description(code)}; started again on port "
                        f"{started} (what it held is lost, and the end of the run says how much)"
                    )

        self._watcher = threading.Thread(target=run, name="traceml-relay-watch", daemon=True)
        self._watcher.start()

    def stop(self, signals: Signals | None = None) -> dict[str, Any] | None:
        """Ask it to forward what it holds and stop; wait for that (bounded), then kill.
        A first signal meanwhile only says how long this may take; a second stops it.

        Its ``stopped`` line (``forwarded_frames``, ``dropped_batches``,
        ``dropped_messages``, ``refused_frames``, ``upstream_connections``,
        ``pending_frames``), or None when it stopped without one (it was gone, or
        out of time)."""
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join()
        proc = self._proc
        if proc is None:
            return None
        stopped = None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            longest = self._stop_timeout_s + 5.0
            seen = signals.count if signals is not None else 0
            told = False

            def give_up() -> bool:
                nonlocal told
                if signals is None:
                    return False
                if signals.count > seen and not told:
                    told = True
                    say(
                        f"handing on what the node's relay holds (at most {longest:.0f} s); "
                        "press Ctrl-C again to stop it now"
                    )
                return signals.count > seen + 1

            event = self._read_event(longest, give_up)
            if event is not None and event.get("event") == "stopped":
                stopped = event
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=2.0)
        self._kill()
        return stopped

    def _kill(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _emit(out: Any, event: dict[str, Any]) -> None:
    with contextlib.suppress(OSError, ValueError):
        out.write(json.dumps(event) + "\n")
        out.flush()


def main(argv: list[str]) -> int:
    """Relay until SIGTERM/SIGINT (or the launcher is gone and no rank is connected)."""
    from traceml_ai.transport.relay import Relay

    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    try:
        config = json.loads(argv[0])
        host, port = config["upstream"]
        node_ranks = config.get("ranks")
        if node_ranks is not None:
            start, stop = node_ranks
            node_ranks = range(int(start), int(stop))
        relay = Relay(
            (str(host), int(port)),
            os.environ[ENV_RUN_TOKEN],
            port=int(config.get("port", 0)),
            ranks=node_ranks,
            on_event=lambda line: say(f"the node's relay {line}"),
        )
        stop_timeout = float(config.get("stop_timeout_s", 5.0))
        parent = int(config.get("parent_pid", 0))
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        _emit(out, {"event": "failed", "error": f"bad relay config: {exc}"})
        return 2
    stop = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        del signum, frame
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    try:
        address = relay.start()
    except OSError as exc:
        _emit(out, {"event": "failed", "error": f"cannot listen: {exc.strerror or exc}"})
        return 1
    deadline = time.monotonic() + UPSTREAM_WAIT_S
    while not relay.connected and time.monotonic() < deadline and not stop.wait(0.01):
        pass
    _emit(out, {"event": "ready", "port": address[1]})
    while not stop.wait(PARENT_POLL_S):
        if parent and os.getppid() != parent and relay.intake.connections_open == 0:
            break  # the launcher is gone and so are the ranks
    stats = relay.stop(stop_timeout)
    _emit(
        out,
        {
            "event": "stopped",
            "forwarded_frames": stats.forwarded_frames,
            "dropped_batches": stats.dropped_batches,
            "dropped_messages": stats.dropped_messages,
            "refused_frames": stats.refused_frames,
            "upstream_connections": stats.upstream_connections,
            "pending_frames": stats.pending_frames,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
