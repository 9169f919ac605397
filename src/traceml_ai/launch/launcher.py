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
import pkgutil
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any

import attrs
import orjson

from traceml_ai import _environ
from traceml_ai._converter import StructureError
from traceml_ai.aggregator.protocol import (
    AggregatorEvent,
    AggregatorLaunchConfig,
    FailedEvent,
    FinalizedEvent,
    ReadyEvent,
    parse_event,
)
from traceml_ai.launch.bootstrap import ENV_RANK_STATE_DIR, ENV_SIGINT_HELD
from traceml_ai.launch.run_folder import (
    RunFolderError,
    check_logs_dir,
    check_run_name,
    create_run_folder,
    existing_folder_message,
)
from traceml_ai.settings import DEFAULT_SERVE_PORT, MonitorSettings, ResolvedExportSettings
from traceml_ai.transport.wire import ENV_AGGREGATOR_ADDR, ENV_RUN_TOKEN, ENV_SAMPLER_INTERVAL
from traceml_records.internal import BLOCK_BYTES, LineKind, LineSplitter, classify_line

DEFAULT_MULTI_NODE_AGGREGATOR_PORT = DEFAULT_SERVE_PORT
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
    monitor: MonitorSettings = attrs.field(factory=MonitorSettings)
    trace_max_steps: int | None = None
    """``--trace-max-steps``: each rank sends the step figures of its first N steps."""
    on_missing_aggregator: str | None = None
    """``--on-missing-aggregator``: ``warn`` or ``raise`` in the ranks' ``traceml.init()``."""


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


def check_script(script: str) -> None:
    """Refuse a SCRIPT that ``python SCRIPT`` could not run; raises ``LaunchError``.

    Like ``python``: a folder or a zip file runs its ``__main__`` module, any other file
    runs as a script (a file named ``.zip`` that is no zip file too).
    """
    path = os.path.join(os.getcwd(), script)
    if not os.path.exists(path):
        raise LaunchError(f"training script not found: {script}")
    importer = pkgutil.get_importer(path)
    if importer is not None:
        kind = "folder" if os.path.isdir(path) else "zip file"
        find_spec = getattr(importer, "find_spec", None)
        if find_spec is None or find_spec("__main__") is None:
            raise LaunchError(
                f"{script} is a {kind} without __main__.py, so python cannot run it "
                "(a folder or zip file runs its __main__.py)"
            )
        return
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise LaunchError(f"cannot open the training script {script}: {exc.strerror}") from None


@attrs.frozen(kw_only=True)
class _RunPlan:
    run_dir: Path | None  # None on nodes that do not host the aggregator
    start_aggregator: bool
    bind_host: str
    connect_host: str
    port: int
    token: str
    world_size: int


def plan(options: RunOptions, environ: dict[str, str] | os._Environ[str]) -> _RunPlan:
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
    check_script(options.script)
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
        try:
            name = check_run_name(options.run_name) if options.run_name is not None else None
            check_logs_dir(options.logs_dir)
        except RunFolderError as exc:
            raise LaunchError(str(exc)) from None
        run_dir = options.logs_dir / (name or default_run_name())
        # Any entry by that name (an empty folder, a crashed or export-off run, a
        # file) is refused: a run folder holds one run, so nothing of an earlier
        # run can be mistaken for this one's.
        if os.path.lexists(run_dir):
            raise LaunchError(existing_folder_message(run_dir))
    elif options.run_name is not None:
        # No run folder on this node, but a bad name is still a mistake worth saying.
        try:
            check_run_name(options.run_name)
        except RunFolderError as exc:
            raise LaunchError(str(exc)) from None
    return _RunPlan(
        run_dir=run_dir,
        start_aggregator=start_aggregator,
        bind_host=bind_host,
        connect_host=connect_host,
        port=port,
        token=token,
        world_size=options.nnodes * options.nproc_per_node,
    )


ENV_AGGREGATOR_UNAVAILABLE = _environ.AGGREGATOR_UNAVAILABLE

_READ_SLICE_S = 0.1
"""How often a wait for an aggregator event looks at the signals that came meanwhile."""


def _say(message: str) -> None:
    print(f"traceml: {message}", file=sys.stderr, flush=True)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _exit_description(code: int) -> str:
    return f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"


class _Signals:
    """SIGINT and SIGTERM for the whole of ``traceml run``: recorded, and forwarded to the
    ranks while they run.

    Installed before anything starts, so a Ctrl-C at any moment never raises
    KeyboardInterrupt (click would print ``Aborted!``, exit 1 and leave the aggregator
    writing into a pipe nobody reads). A handler also replaces a ``SIG_IGN`` inherited
    from ``nohup`` or ``cmd &``, and since a handled signal is reset to its default on
    exec, the ranks started meanwhile can be stopped by the signal we forward.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._ranks_pgid: int | None = None
        self._forwarded = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        for s in (signal.SIGINT, signal.SIGTERM):
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    @property
    def count(self) -> int:
        """Signals received so far."""
        return len(self.received)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self.received.append(signum)
        if self._ranks_pgid is not None:
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        assert self._ranks_pgid is not None
        self._forwarded += 1
        # First signal as sent, then SIGTERM, then SIGKILL for a run that will not stop.
        sig = (
            signum
            if self._forwarded == 1
            else (signal.SIGTERM if self._forwarded == 2 else signal.SIGKILL)
        )
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._ranks_pgid, sig)

    def ranks_started(self, pgid: int, seen_before: int) -> None:
        """Forward from now on; a signal that came while they were being started is sent now."""
        self._ranks_pgid = pgid
        if self.count > seen_before:
            self._forward(self.received[-1])

    def ranks_done(self) -> None:
        """Stop forwarding: the ranks' process group is gone."""
        self._ranks_pgid = None


class _Aggregator:
    """The aggregator child process, seen from the launcher."""

    def __init__(self, options: RunOptions, p: _RunPlan) -> None:
        assert p.run_dir is not None
        config = AggregatorLaunchConfig(
            run_dir=str(p.run_dir),
            export=options.export.settings,
            bind_host=p.bind_host,
            port=p.port,
            expected_world_size=p.world_size,
            finalize_timeout_s=options.finalize_timeout_s,
            monitor=options.monitor,
            # Lets it finalize on its own if we die without asking it to.
            parent_pid=os.getpid(),
        )
        env = dict(os.environ)
        env[ENV_RUN_TOKEN] = p.token
        self.finalize_timeout_s = options.finalize_timeout_s
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "traceml_ai.aggregator", config.to_json()],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self._buffer = b""
        self._stop_sent = False

    def _read_event(
        self, timeout: float, give_up: Callable[[], bool] | None = None
    ) -> AggregatorEvent | None:
        """The next event; None on timeout, end of stream, a bad line or ``give_up()``."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            if give_up is not None and give_up():
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], min(left, _READ_SLICE_S))
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
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

    def wait_ready(self, signals: _Signals) -> tuple[str, int] | str:
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
                return f"the aggregator {_exit_description(code)} while starting"
            return "the aggregator did not start"
        if not isinstance(event, ReadyEvent):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5.0)
            return (
                event.error if isinstance(event, FailedEvent) else "the aggregator failed to start"
            )
        return event.host, event.port

    def finalize(self, signals: _Signals) -> tuple[FinalizedEvent | None, str]:
        """Ask it to finalize and wait (bounded): (the ``finalized`` event, "") or
        (None, what happened to it instead).

        A first signal meanwhile only says how long this may take; a second stops it.
        """
        code = self.proc.poll()
        if code is not None:
            self._kill()
            return None, f"{_exit_description(code)} during the run"
        self.ask_to_finalize()
        seen = signals.count
        told = False

        def give_up() -> bool:
            nonlocal told
            if signals.count > seen and not told:
                told = True
                _say(
                    "finishing the export (at most "
                    f"{self.finalize_timeout_s + 15.0:.0f} s); press Ctrl-C again to stop it now"
                )
            return signals.count > seen + 1

        event = self._read_event(self.finalize_timeout_s + 15.0, give_up)
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
            return None, f"did not finalize within {self.finalize_timeout_s + 15.0:.0f} s"
        return None, f"{_exit_description(self.proc.returncode)} while it finalized"


TORCHRUN_SINGLE_PROCESS_ENV = (
    ("RANK", "0"),
    ("LOCAL_RANK", "0"),
    ("WORLD_SIZE", "1"),
    ("LOCAL_WORLD_SIZE", "1"),
    ("GROUP_RANK", "0"),
    ("NODE_RANK", "0"),
)
"""What ``torch.distributed.run`` gives its one worker (with MASTER_ADDR/MASTER_PORT)."""

ENV_RUN_DIR = _environ.RUN_DIR

ENV_SUMMARY_FILE = _environ.SUMMARY_FILE


def single_process_environment(options: RunOptions, env: dict[str, str]) -> dict[str, str]:
    """The environment torchrun would give a one-process run, over ``env``.

    The one process is started directly (no torch.distributed.run), but a DDP script
    must still find what torchrun sets (``init_process_group("env://")`` reads
    MASTER_ADDR/MASTER_PORT), so it runs unchanged as one process. A value the user
    already set is kept.
    """
    out = dict(env)
    for name, value in TORCHRUN_SINGLE_PROCESS_ENV:
        out.setdefault(name, value)
    out.setdefault("MASTER_ADDR", options.master_addr)
    out.setdefault("MASTER_PORT", str(options.master_port))
    return out


def step_time_export_file(options: RunOptions, run_dir: Path) -> Path | None:
    """Where the built-in exporter writes this run's step_time lines; None if it does not."""
    export = options.export
    if export.settings.exporter != "jsonl" or "step_time" not in export.selected_streams:
        return None
    return run_dir / "aggregator" / "export" / "step_time.jsonl"


BOOTSTRAP_MODULE = "traceml_ai.launch.bootstrap"
"""Each rank runs ``python -m traceml_ai.launch.bootstrap SCRIPT ARGS``: the script as
``__main__``, after a hook that attaches TraceML to HF/Lightning Trainers it imports."""


def rank_command(options: RunOptions) -> list[str]:
    """One process runs the script directly; more go through ``torch.distributed.run``."""
    if options.nproc_per_node == 1 and options.nnodes == 1:
        return [sys.executable, "-m", BOOTSTRAP_MODULE, options.script, *options.script_args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={options.nproc_per_node}",
        f"--nnodes={options.nnodes}",
        f"--node-rank={options.node_rank}",
        f"--master-addr={options.master_addr}",
        f"--master-port={options.master_port}",
        # torchrun's -m: every worker runs `python -m BOOTSTRAP_MODULE SCRIPT ARGS`.
        "-m",
        BOOTSTRAP_MODULE,
        options.script,
        *options.script_args,
    ]


def run(options: RunOptions) -> int:
    """Run the training script under TraceML; return its exit code.

    Raises ``LaunchError`` (nothing launched, nothing created) for a bad option.
    A SIGINT or SIGTERM before the ranks start returns ``128 + signal``.
    """
    p = plan(options, os.environ)
    if p.run_dir is not None:
        try:
            create_run_folder(options.logs_dir, p.run_dir.name, exist_ok=False)
        except RunFolderError as exc:
            raise LaunchError(str(exc)) from None
    with _Signals() as signals:
        return _run_planned(options, p, signals)


NCCL_TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"


def _run_planned(options: RunOptions, p: _RunPlan, signals: _Signals) -> int:
    aggregator: _Aggregator | None = None
    not_started: str | None = None
    export_on = bool(options.export.settings.exporter)
    env = dict(os.environ)
    env[ENV_SAMPLER_INTERVAL] = repr(options.interval)
    # NCCL records each collective's duration only with this on (before the process
    # group is made); the collectives stream reads it from the Work, never by
    # synchronizing the device. A value the user set is kept.
    env.setdefault(NCCL_TIMING_ENV, "1")
    # The ranks are other processes: what their init() is told goes in their environment.
    if options.trace_max_steps is not None:
        env[_environ.TRACE_MAX_STEPS] = str(options.trace_max_steps)
    if options.on_missing_aggregator is not None:
        env[_environ.ON_MISSING_AGGREGATOR] = options.on_missing_aggregator
    env.pop(ENV_AGGREGATOR_ADDR, None)
    env.pop(ENV_AGGREGATOR_UNAVAILABLE, None)
    env.pop(ENV_RUN_DIR, None)
    env.pop(ENV_SUMMARY_FILE, None)
    if p.start_aggregator:
        assert p.run_dir is not None
        aggregator = _Aggregator(options, p)
        ready = aggregator.wait_ready(signals)
        if isinstance(ready, str):
            if not signals.received:
                _say(f"{ready}; training runs without TraceML telemetry")
            aggregator = None
            not_started = ready
            # The ranks say why telemetry is off instead of "not launched by traceml run".
            env[ENV_AGGREGATOR_UNAVAILABLE] = ready
        else:
            env[ENV_AGGREGATOR_ADDR] = f"{p.connect_host}:{ready[1]}"
            env[ENV_RUN_TOKEN] = p.token
            env[ENV_RUN_DIR] = str(p.run_dir)
            summary_file = step_time_export_file(options, p.run_dir)
            if summary_file is not None:
                env[ENV_SUMMARY_FILE] = str(summary_file)
    else:
        env[ENV_AGGREGATOR_ADDR] = f"{p.connect_host}:{p.port}"
        env[ENV_RUN_TOKEN] = p.token
    if p.run_dir is not None:
        _say(f"run folder {p.run_dir}")

    interrupted_early = bool(signals.received)
    if interrupted_early:
        # Stopped before training began: start no rank, finalize what was started.
        exit_code = 128 + signals.received[0]
        _say(
            f"interrupted ({_signal_name(signals.received[0])}) before the training script started"
        )
        ends = None
    else:
        ends = _run_ranks(options, env, signals)
        exit_code = ends.exit_code

    if not_started is not None and export_on:
        assert p.run_dir is not None
        report_export_off(p.run_dir, not_started)
    if aggregator is not None:
        assert p.run_dir is not None
        event, why = aggregator.finalize(signals)
        if event is None:
            _report_aggregator_lost(p, why, exit_code, export_on=export_on)
        else:
            _report_finalized(options, p, event, ends)
    return exit_code


END_OF_RUN_SUMMARY_MAX_BYTES = 64 * 1024 * 1024
"""Export files larger than this get no summary at the end of ``traceml run``.

The summary reads every line; on a long run that would hold the prompt back for
minutes after training ended. ``traceml summary RUN_FOLDER`` gives it on demand."""


def _print_short_summary(run_dir: Path, export_dir: Path) -> None:
    """The short run summary on stderr; a courtesy that never fails or stalls the run."""
    try:
        size = sum(f.stat().st_size for f in export_dir.glob("*.jsonl"))
        if size > END_OF_RUN_SUMMARY_MAX_BYTES:
            _say(
                f"summary: {size / 2**20:.0f} MiB of export files; "
                f"`traceml summary {run_dir}` gives it"
            )
            return
        from traceml_ai.run_summary import format_summary, summarize_run

        text = format_summary(summarize_run(run_dir), full=False)
        print(text, file=sys.stderr, flush=True)
    except Exception as exc:
        _say(f"summary unavailable: {type(exc).__name__}: {exc}")


def _report_finalized(
    options: RunOptions, p: _RunPlan, event: FinalizedEvent, ends: RankEnds | None
) -> None:
    """The end of a run whose aggregator finalized; ``ends`` None: no rank was started."""
    assert p.run_dir is not None
    if options.export.settings.exporter:
        # A custom exporter writes where it likes: name the folder only if it exists.
        export_dir = p.run_dir / "aggregator" / "export"
        where = f"in {export_dir}" if export_dir.is_dir() else "passed to the custom exporter"
        failed = "; the exporter failed" if event.exporter_failed else ""
        _say(f"export: {event.written_records} records {where}{failed}")
        if export_dir.is_dir():
            _print_short_summary(p.run_dir, export_dir)
    warning = event.warning
    see = f"; see {warning}" if warning else ""
    if ends is not None and not event.ranks_heard:
        _say(f"no rank connected to the aggregator: {_why_no_rank(options, ends)}{see}")
    elif ends is not None and ends.abrupt:
        _say(
            f"{_ranks_text(ends.abrupt)} ended without shutting down TraceML "
            f"({_abrupt_how(ends)}): the connection closed without a goodbye, so the last "
            f"steps may be missing{see}"
        )
    elif warning:
        _say(f"{lost_what(Path(warning))}; see {warning}")


def lost_what(warning: Path) -> str:
    """What a warning file says was lost, in a few words: only the live views' data (the
    files are complete then), or something of the run."""
    try:
        reason = orjson.loads(warning.read_bytes()).get("reason")
    except (OSError, ValueError, AttributeError):
        reason = None
    if reason == "monitoring_incomplete":
        return "the live views lost data (the files are complete)"
    return "something was lost"


def _ranks_text(ranks: tuple[str, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(ranks)


def _abrupt_how(ends: RankEnds) -> str:
    """How ranks ended that never reached the interpreter's exit (where TraceML's
    ``atexit`` shutdown sends its last steps and a goodbye)."""
    if ends.single and ends.raw_code < 0:
        return f"it {_exit_description(ends.raw_code)}"
    code = f"; exit code {ends.exit_code}" if ends.single else ""
    return f"os._exit() or a crash skipped the interpreter's normal exit{code}"


def _why_no_rank(options: RunOptions, ends: RankEnds) -> str:
    """What happened in a run whose ranks sent nothing at all, as far as we know it."""
    from traceml_ai.rank._init_config import ENV_DISABLED, env_disabled

    if env_disabled():
        return (
            f"{ENV_DISABLED}={os.environ.get(ENV_DISABLED, '').strip()} is set, so TraceML was "
            "off in the ranks and traceml.init() did nothing (unset it to trace this run, or "
            "use --disable-traceml to run without an aggregator)"
        )
    if ends.known and not ends.started:
        if ends.interrupted is not None:
            return (
                f"interrupted ({_signal_name(ends.interrupted)}) before the training script started"
            )
        zip_note = ""
        if options.script.endswith((".zip", ".pyz")) and not zipfile.is_zipfile(options.script):
            zip_note = f"; {options.script} is not a zip file, so python read it as a script"
        return (
            f"{options.script} did not start (exit code {ends.exit_code}; python's error "
            f"is above{zip_note})"
        )
    if ends.abrupt:
        return (
            f"{_ranks_text(ends.abrupt)} ended without shutting down TraceML "
            f"({_abrupt_how(ends)}), so nothing it traced was sent"
        )
    if ends.interrupted is not None:
        signal_name = _signal_name(ends.interrupted)
        return f"the training script was stopped by {signal_name} before it sent anything"
    if ends.exit_code != 0:
        return f"the training script exited with code {ends.exit_code} before it sent anything"
    # The usual cause is a script without traceml.init(): say that, not "lost".
    return f"{options.script} may not call traceml.init() (or it exited before calling it)"


def count_data_lines(export_dir: Path) -> int:
    """Data lines in the ``*.jsonl`` files of ``export_dir``: complete lines that are
    not a closing line (the export files' one line scanner, ``traceml_records``)."""
    return export_tally(export_dir)[0]


def export_tally(export_dir: Path) -> tuple[int, bool]:
    """(data lines in the ``*.jsonl`` files of ``export_dir``, whether there is at least
    one file and every file ends with its closing line)."""
    total = 0
    closed = True
    files = 0
    for path in sorted(export_dir.glob("*.jsonl")):
        files += 1
        lines = LineSplitter()
        last_closing = False
        try:
            with open(path, "rb") as fh:
                while block := fh.read(BLOCK_BYTES):
                    # Only a closing line holds this key: lines completed by a block
                    # without it (nor in the line it continues) count whole, unparsed.
                    has_key = b'"closing"' in block or b'"closing"' in lines.pending + block[:9]
                    complete = lines.feed(block)
                    total += len(complete)
                    if complete:
                        last_closing = False
                    if has_key:
                        for raw in complete:
                            if b'"closing"' in raw and classify_line(raw)[0] is LineKind.CLOSING:
                                total -= 1
                        last_closing = bool(complete) and (
                            b'"closing"' in complete[-1]
                            and classify_line(complete[-1])[0] is LineKind.CLOSING
                        )
        except OSError:
            closed = False
            continue
        if not last_closing or lines.pending:
            closed = False
    return total, closed and files > 0


def _report_aggregator_lost(p: _RunPlan, why: str, exit_code: int, *, export_on: bool) -> None:
    """The aggregator is gone without finalizing: we outlived it, so we write the warning.

    The export files stay exactly as they are; without a closing line they say that
    the aggregator did not finish cleanly.
    """
    assert p.run_dir is not None
    if not export_on:
        _say(f"the aggregator {why}; export was off, so no file is affected")
        return
    from traceml_ai.export._finalize import RankOutcome, write_finalization_warning
    from traceml_records import ExportLoss

    export_dir = p.run_dir / "aggregator" / "export"
    counted = export_dir.is_dir()
    written, all_closed = export_tally(export_dir) if counted else (0, False)
    if all_closed:
        # It went after closing every file (while stopping its live views or writing
        # stats.json): the files are complete, and only what it did after is unknown.
        _say(
            f"the aggregator {why} after the export files were closed: the files are "
            f"complete ({written} records); aggregator/stats.json may be missing"
        )
        if exit_code == 0:
            return
    written_text = (
        f"{written} records were written (counted from the export files' data lines)"
        if counted
        else "the records written by the custom exporter are not counted (0 in the export block)"
    )
    message = (
        f"The aggregator process {why}, so the export did not finish: the export files "
        f"end without closing lines and {written_text}; the training script exited with "
        f"code {exit_code}."
    )
    loss = (
        None
        if all_closed
        else ExportLoss(
            written_records=written,
            dropped_batches=0,
            failed_records=0,
            skipped_items=0,
            exporter_failed=True,
        )
    )
    if all_closed:
        message = (
            f"The aggregator process {why} after the export files were closed; the "
            f"training script exited with code {exit_code}, and which ranks finished is "
            "not known."
        )
    ranks = None
    if exit_code != 0:
        # The aggregator kept the record of which ranks finished; with it gone, none is known.
        ranks = RankOutcome(
            expected_world_size=p.world_size,
            finished_ranks=(),
            missing_ranks=tuple(range(p.world_size)),
        )
    try:
        path = write_finalization_warning(
            p.run_dir,
            export_loss=loss,
            ranks=ranks,
            reason_if_ranks="ranks_disconnected" if ranks is not None else None,
            message=message,
        )
    except (OSError, ValueError) as exc:
        _say(
            f"the aggregator {why}; export files lack closing lines, and "
            f"{p.run_dir / 'finalization_warning.json'} could not be written ({exc})"
        )
        return
    if not all_closed:
        _say(f"the aggregator {why}; export files lack closing lines; see {path}")
    elif path is not None:
        _say(f"see {path}")


def report_export_off(run_dir: Path, why: str) -> None:
    """The aggregator never started, so nothing was exported: say so in the warning file
    (``traceml run``, ``traceml serve`` and the Ray integration alike)."""
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
        run_dir.mkdir(parents=True, exist_ok=True)
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


@attrs.frozen(kw_only=True)
class RankEnds:
    """How the ranks of this node ended, from their exit code and their bootstraps' notes
    (``traceml_ai.launch.bootstrap.ENV_RANK_STATE_DIR``)."""

    exit_code: int
    """The ranks' process's exit code the way shells give it (128 + N for signal N);
    torch.distributed.run's when there are several ranks."""
    raw_code: int
    """That process's return code (negative: killed by that signal)."""
    single: bool
    """One rank, started directly: ``exit_code`` is the rank's own."""
    interrupted: int | None
    """The first signal forwarded to the ranks, if any."""
    known: bool
    """Whether the notes were kept (their folder could be made)."""
    started: tuple[str, ...] = ()
    """The ranks (``RANK``) whose script started."""
    abrupt: tuple[str, ...] = ()
    """The ranks whose script started and whose interpreter never exited normally
    (``os._exit()``, a signal, a crash): TraceML's shutdown did not run there."""


def read_rank_notes(folder: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(ranks whose script started, those of them without a normal exit) from the
    ``<rank>.<pid>.started`` and ``<rank>.<pid>.exited`` files of ``folder``."""
    started: dict[str, str] = {}
    exited: set[str] = set()
    with contextlib.suppress(OSError):
        for entry in os.listdir(folder):
            name, _, what = entry.rpartition(".")
            if what == "started":
                started[name] = name.split(".", 1)[0]
            elif what == "exited":
                exited.add(name)

    def order(rank: str) -> tuple[int, str]:
        return (int(rank), "") if rank.isdigit() else (-1, rank)

    abrupt = {rank for name, rank in started.items() if name not in exited}
    return tuple(sorted(set(started.values()), key=order)), tuple(sorted(abrupt, key=order))


def _run_ranks(options: RunOptions, env: dict[str, str], signals: _Signals) -> RankEnds:
    seen = signals.count
    single = options.nproc_per_node == 1 and options.nnodes == 1
    if single:
        env = single_process_environment(options, env)
    env = dict(env)
    env.pop(ENV_SIGINT_HELD, None)
    try:
        notes: str | None = tempfile.mkdtemp(prefix="traceml-ranks-")
    except OSError:
        notes = None
    if notes is not None:
        env[ENV_RANK_STATE_DIR] = notes
    else:
        env.pop(ENV_RANK_STATE_DIR, None)
    # One rank started directly gets SIGINT blocked, and its bootstrap unblocks it once
    # it can take it: a Ctrl-C while its interpreter starts and imports TraceML is then
    # one quiet end by SIGINT, not a traceback out of an import. (Not through torchrun,
    # which must take a Ctrl-C itself at any time.)
    hold = single and hasattr(signal, "pthread_sigmask")
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if hold else set()
    if hold and signal.SIGINT not in before:
        env[ENV_SIGINT_HELD] = "1"
    try:
        # A session of their own: the terminal's Ctrl-C reaches the ranks once, through us.
        proc = subprocess.Popen(rank_command(options), env=env, start_new_session=True)
    except BaseException:
        if notes is not None:
            shutil.rmtree(notes, ignore_errors=True)
        raise
    finally:
        if hold:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
    signals.ranks_started(proc.pid, seen)
    try:
        code: int = proc.wait()
    finally:
        signals.ranks_done()
    started: tuple[str, ...] = ()
    abrupt: tuple[str, ...] = ()
    if notes is not None:
        started, abrupt = read_rank_notes(notes)
        shutil.rmtree(notes, ignore_errors=True)
    return RankEnds(
        # A negative code means killed by a signal; report it the way shells do.
        exit_code=code if code >= 0 else 128 + (-code),
        raw_code=code,
        single=single,
        interrupted=signals.received[seen] if signals.count > seen else None,
        known=notes is not None,
        started=started,
        abrupt=abrupt,
    )
