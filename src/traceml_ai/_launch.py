"""``traceml run``: validate, start the aggregator, start the ranks, wait, finalize.

The aggregator runs in its own process and session: a stalled or killed
aggregator never stops training, and a Ctrl-C reaches it only through us, after
the ranks have stopped. The ranks run in their own process group so that one
Ctrl-C is forwarded to them exactly once.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType

import attrs
import orjson

from traceml_ai.settings import ResolvedExportSettings
from traceml_ai.wire import ENV_AGGREGATOR_ADDR, ENV_RUN_TOKEN, ENV_SAMPLER_INTERVAL

DEFAULT_MULTI_NODE_AGGREGATOR_PORT = 29600
AGGREGATOR_READY_TIMEOUT_S = 60.0


class LaunchError(Exception):
    """A setting or precondition that stops ``traceml run`` before anything launches."""


@attrs.frozen(kw_only=True)
class RunOptions:
    """Everything ``traceml run`` was asked to do."""

    script: str
    script_args: tuple[str, ...]
    logs_dir: Path
    run_name: str | None
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    aggregator_host: str | None
    aggregator_port: int | None
    interval: float
    finalize_timeout_s: float
    export: ResolvedExportSettings


def default_run_name() -> str:
    """A sortable, unique-enough name: UTC time plus a short random suffix."""
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def multi_node_token(master_addr: str, master_port: int, aggregator_port: int) -> str:
    """The run token every node derives alike when none is given.

    It identifies the run (frames from another job's ranks are refused) but is no
    secret; set ``TRACEML_RUN_TOKEN`` to the same secret on every node for that.
    """
    seed = f"traceml-run:{master_addr}:{master_port}:{aggregator_port}".encode()
    return hashlib.sha256(seed).hexdigest()[:32]


@attrs.frozen(kw_only=True)
class _Plan:
    run_dir: Path | None  # None on nodes that do not host the aggregator
    start_aggregator: bool
    bind_host: str
    connect_host: str
    port: int
    token: str
    world_size: int


def plan(options: RunOptions, environ: dict[str, str] | os._Environ[str]) -> _Plan:
    """Check every option and decide where things run; raises ``LaunchError``."""
    if options.nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node must be at least 1, got {options.nproc_per_node}")
    if options.nnodes < 1:
        raise LaunchError(f"--nnodes must be at least 1, got {options.nnodes}")
    if not 0 <= options.node_rank < options.nnodes:
        raise LaunchError(f"--node-rank must be in [0, {options.nnodes}), got {options.node_rank}")
    if not options.interval > 0:
        raise LaunchError(f"--interval must be positive, got {options.interval}")
    if not options.finalize_timeout_s > 0:
        raise LaunchError(
            f"--finalize-timeout-sec must be positive, got {options.finalize_timeout_s}"
        )
    if not Path(options.script).is_file():
        raise LaunchError(f"training script not found: {options.script}")
    port = options.aggregator_port
    if port is not None and not 0 <= port <= 65535:
        raise LaunchError(f"--aggregator-port must be in [0, 65535], got {port}")
    multi_node = options.nnodes > 1
    external = options.aggregator_host is not None
    if port is None:
        port = DEFAULT_MULTI_NODE_AGGREGATOR_PORT if (multi_node or external) else 0
    if external and port == 0:
        raise LaunchError(
            "--aggregator-host needs --aggregator-port (the port `traceml serve` listens on)"
        )
    start_aggregator = not external and options.node_rank == 0
    token = environ.get(ENV_RUN_TOKEN, "").strip()
    if not token:
        if external:
            raise LaunchError(
                f"--aggregator-host needs the run token of that aggregator in {ENV_RUN_TOKEN} "
                "(`traceml serve` prints it)"
            )
        token = (
            multi_node_token(options.master_addr, options.master_port, port)
            if multi_node
            else secrets.token_urlsafe(24)
        )
    if multi_node:
        connect_host = options.aggregator_host or options.master_addr
        bind_host = connect_host
    else:
        connect_host = options.aggregator_host or "127.0.0.1"
        bind_host = "127.0.0.1"
    run_dir = None
    if start_aggregator:
        run_dir = options.logs_dir / (options.run_name or default_run_name())
        if run_dir.exists():
            raise LaunchError(f"run folder already exists: {run_dir} (pick another --run-name)")
    return _Plan(
        run_dir=run_dir,
        start_aggregator=start_aggregator,
        bind_host=bind_host,
        connect_host=connect_host,
        port=port,
        token=token,
        world_size=options.nnodes * options.nproc_per_node,
    )


def _say(message: str) -> None:
    print(f"traceml: {message}", file=sys.stderr, flush=True)


class _Aggregator:
    """The aggregator child process, seen from the launcher."""

    def __init__(self, options: RunOptions, p: _Plan) -> None:
        assert p.run_dir is not None
        config = {
            "run_dir": str(p.run_dir),
            "exporter": options.export.settings.exporter,
            "export_streams": options.export.settings.export_streams,
            "exporter_hostname": options.export.settings.exporter_hostname,
            "bind_host": p.bind_host,
            "port": p.port,
            "expected_world_size": p.world_size,
            "finalize_timeout_s": options.finalize_timeout_s,
            # Lets it finalize on its own if we die without asking it to.
            "parent_pid": os.getpid(),
        }
        env = dict(os.environ)
        env[ENV_RUN_TOKEN] = p.token
        self.finalize_timeout_s = options.finalize_timeout_s
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "traceml_ai.aggregator", orjson.dumps(config).decode()],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self._buffer = b""

    def _read_event(self, timeout: float) -> dict[str, object] | None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            return None
        return event if isinstance(event, dict) else None

    def wait_ready(self) -> tuple[str, int] | str:
        """The address it listens on, or why it did not start."""
        event = self._read_event(AGGREGATOR_READY_TIMEOUT_S)
        if event is None:
            self.proc.kill()
            return "the aggregator did not start"
        if event.get("event") != "ready":
            return str(event.get("error", "the aggregator failed to start"))
        return str(event["host"]), int(event["port"])  # type: ignore[call-overload]

    def finalize(self) -> dict[str, object] | None:
        """Ask it to finalize and wait (bounded); the ``finalized`` event, if it came."""
        if self.proc.poll() is not None:
            return None
        self.proc.send_signal(signal.SIGTERM)
        event = self._read_event(self.finalize_timeout_s + 15.0)
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return event


def rank_command(options: RunOptions) -> list[str]:
    """One process runs the script directly; more go through ``torch.distributed.run``."""
    if options.nproc_per_node == 1 and options.nnodes == 1:
        return [sys.executable, options.script, *options.script_args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={options.nproc_per_node}",
        f"--nnodes={options.nnodes}",
        f"--node-rank={options.node_rank}",
        f"--master-addr={options.master_addr}",
        f"--master-port={options.master_port}",
        options.script,
        *options.script_args,
    ]


def run(options: RunOptions) -> int:
    """Run the training script under TraceML; return its exit code."""
    p = plan(options, os.environ)
    aggregator: _Aggregator | None = None
    not_started: str | None = None
    env = dict(os.environ)
    env[ENV_SAMPLER_INTERVAL] = repr(options.interval)
    env.pop(ENV_AGGREGATOR_ADDR, None)
    if p.start_aggregator:
        assert p.run_dir is not None
        p.run_dir.mkdir(parents=True)
        aggregator = _Aggregator(options, p)
        ready = aggregator.wait_ready()
        if isinstance(ready, str):
            _say(f"{ready}; training runs without TraceML telemetry")
            aggregator = None
            not_started = ready
        else:
            env[ENV_AGGREGATOR_ADDR] = f"{p.connect_host}:{ready[1]}"
            env[ENV_RUN_TOKEN] = p.token
    else:
        env[ENV_AGGREGATOR_ADDR] = f"{p.connect_host}:{p.port}"
        env[ENV_RUN_TOKEN] = p.token
    if p.run_dir is not None:
        _say(f"run folder {p.run_dir}")

    exit_code = _run_ranks(options, env)

    if not_started is not None and options.export.settings.exporter:
        assert p.run_dir is not None
        _report_export_off(p.run_dir, not_started)
    if aggregator is not None:
        event = aggregator.finalize()
        if event is None or event.get("event") != "finalized":
            _say(
                "the aggregator stopped before finalizing; export files may lack their closing lines"
            )
        else:
            if options.export.settings.exporter:
                assert p.run_dir is not None
                # A custom exporter writes where it likes: name the folder only if it exists.
                export_dir = p.run_dir / "aggregator" / "export"
                where = (
                    f"in {export_dir}"
                    if export_dir.is_dir()
                    else f"passed to {options.export.settings.exporter}"
                )
                _say(f"export: {event.get('written_records')} records {where}")
            if event.get("warning"):
                _say(f"something was lost; see {event['warning']}")
    return exit_code


def _report_export_off(run_dir: Path, why: str) -> None:
    """The aggregator never started, so nothing was exported: say so in the warning file."""
    from traceml_ai.export._finalize import write_finalization_warning
    from traceml_records import ExportLoss

    loss = ExportLoss(
        written_records=0,
        dropped_batches=0,
        failed_records=0,
        skipped_items=0,
        exporter_failed=True,
    )
    try:
        path = write_finalization_warning(
            run_dir,
            export_loss=loss,
            message=f"Export was off for this run because the aggregator did not start ({why}).",
        )
    except (OSError, ValueError) as exc:
        _say(f"cannot write {run_dir / 'finalization_warning.json'}: {exc}")
        return
    if path is not None:
        _say(f"something was lost; see {path}")


def _run_ranks(options: RunOptions, env: dict[str, str]) -> int:
    # A session of their own: the terminal's Ctrl-C reaches the ranks once, through us.
    proc = subprocess.Popen(rank_command(options), env=env, start_new_session=True)
    signals_seen = 0

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal signals_seen
        del frame
        signals_seen += 1
        # First signal as sent, then SIGTERM, then SIGKILL for a run that will not stop.
        sig = (
            signum
            if signals_seen == 1
            else (signal.SIGTERM if signals_seen == 2 else signal.SIGKILL)
        )
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code: int = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    # A negative code means killed by a signal; report it the way shells do.
    return code if code >= 0 else 128 + (-code)
