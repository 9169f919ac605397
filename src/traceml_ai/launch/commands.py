"""``traceml run`` and ``traceml serve``: options, validation before launch, exit codes."""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import click

from traceml_ai import _environ
from traceml_ai.settings import (
    DEFAULT_SERVE_PORT,
    SOURCE_DEFAULT,
    Command,
    LaunchSettings,
    SettingsError,
    click_options,
    resolve_launch_settings,
)

if TYPE_CHECKING:
    from traceml_ai.transport.relay import Relay, RelayStats

_F = TypeVar("_F", bound=Callable[..., Any])


# -- TraceML 0.5.0's command line (docs/compat-0.5.md) ----------------------------------

ARGS_MARKER = "--args"
"""0.5.0's end of traceml's options: what follows it is the script's."""

_NO_EFFECT = {
    "enable_logging": "--enable-logging has no effect here: TraceML writes no log files; "
    "its messages go to stderr",
    "html_report": "--html-report has no effect here: there is no HTML report; "
    "--mode summary prints the run summary",
    "no_history": "--no-history has no effect here: TraceML keeps no history database; "
    "--exporter decides what is written",
    "history_retention": "--history-retention has no effect here: TraceML keeps no history "
    "database",
    "no_dashboard_auto_open": "--no-dashboard-auto-open has no effect here: the dashboard never "
    "opens a browser; open the URL it prints",
}


def _compat_options(func: _F) -> _F:
    """TraceML 0.5.0's ``traceml run`` options that are not settings of this project."""
    options = [
        click.option(
            "--mode",
            "mode",
            type=click.Choice(["cli", "dashboard", "summary"]),
            default=None,
            help="dashboard serves a live web page from the aggregator while the run goes "
            "(needs the 'dashboard' extra; see --dashboard-port); summary prints the run "
            "summary at the end. Both switch the jsonl exporter on unless an exporter is set. "
            "TraceML 0.5.0's cli has no effect here.",
        ),
        click.option(
            "--session-id",
            "session_id",
            default=None,
            metavar="NAME",
            help="TraceML 0.5.0's alias of --run-name.",
        ),
        click.option(
            "--disable-traceml",
            "--disable_traceml",
            "disable_traceml",
            is_flag=True,
            default=False,
            help="Run the script untouched: no aggregator, no run folder, TRACEML_DISABLED=1.",
        ),
        click.option(
            "--trace-max-steps",
            "trace_max_steps",
            type=click.IntRange(min=0),
            default=None,
            metavar="N",
            help="Send the step figures of the first N traced steps only; training goes on.",
        ),
        click.option(
            "--on-missing-aggregator",
            "on_missing_aggregator",
            type=click.Choice(["raise", "warn"]),
            default=None,
            help="When the aggregator did not start: warn (default here: training runs "
            "without telemetry) or raise (traceml.init() in the script raises).",
        ),
        click.option(
            "--enable-logging",
            "enable_logging",
            is_flag=True,
            default=False,
            help="TraceML 0.5.0; no effect here.",
        ),
        click.option(
            "--html-report",
            "html_report",
            is_flag=True,
            default=False,
            help="TraceML 0.5.0; no effect here.",
        ),
        click.option(
            "--no-history",
            "no_history",
            is_flag=True,
            default=False,
            help="TraceML 0.5.0; no effect here.",
        ),
        click.option(
            "--history-retention",
            "history_retention",
            default=None,
            metavar="DURATION",
            help="TraceML 0.5.0; no effect here.",
        ),
        click.option(
            "--no-dashboard-auto-open",
            "no_dashboard_auto_open",
            is_flag=True,
            default=False,
            help="TraceML 0.5.0; no effect here.",
        ),
        click.option(
            "--save-training-output/--no-save-training-output",
            "save_training_output",
            default=None,
            help="TraceML 0.5.0: the script's output goes to the terminal here "
            "(--no-save-training-output's behaviour).",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


class _RunCommand(click.Command):
    """``traceml run`` in both forms: torchrun's and TraceML 0.5.0's ``--args``.

    Without ``--args`` options end at the script and everything after it is the
    script's (an unknown option before it is an error with a did-you-mean). With
    ``--args`` (before any ``--``), options may also stand after the script, and what
    follows ``--args`` is the script's.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        cut = args.index("--") if "--" in args else len(args)
        if ARGS_MARKER in args[:cut]:
            i = args.index(ARGS_MARKER)
            # Options and the script in any order, then the script's arguments verbatim.
            ctx.allow_interspersed_args = True
            args = [*args[:i], "--", *args[i + 1 :]]
            ctx.meta["traceml_args_form"] = True
        return super().parse_args(ctx, args)

    def own_option_names(self) -> set[str]:
        """Every spelling of ``traceml run``'s own options."""
        names: set[str] = set()
        for param in self.params:
            if isinstance(param, click.Option):
                names.update(param.opts)
                names.update(param.secondary_opts)
        return names


def _warn_options_after_script(command: _RunCommand, script_args: tuple[str, ...]) -> None:
    """One line when the script's arguments hold one of ``traceml run``'s own options."""
    cut = script_args.index("--") if "--" in script_args else len(script_args)
    own = command.own_option_names()
    found = [a.split("=", 1)[0] for a in script_args[:cut] if a.split("=", 1)[0] in own]
    if not found:
        return
    names = ", ".join(dict.fromkeys(found))
    click.echo(
        f"traceml: warning: {names} after the script is passed to the script; for traceml, "
        "put it before the script (traceml run [OPTIONS] SCRIPT [ARGS]) or end traceml's "
        "options with --args (traceml run SCRIPT [OPTIONS] --args [ARGS])",
        err=True,
    )


DEFAULT_MASTER_PORT = 29500
"""torchrun's rendezvous port, the default when the ranks span several nodes."""


def rendezvous_port(given: int | None, nnodes: int) -> int:
    """``--master-port``: the port given; else torchrun's 29500 when the ranks span
    nodes (each node's command must name the same); else, on one node, a port free
    now. A fixed 29500 on one machine made the second of two concurrent runs (a
    sweep, a test beside a job) fail to bind it as soon as its script set up
    ``torch.distributed`` (the Hugging Face Trainer does, even for one process)."""
    if given is not None:
        return given
    if nnodes > 1:
        return DEFAULT_MASTER_PORT
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            return int(probe.getsockname()[1])
    except OSError:
        return DEFAULT_MASTER_PORT  # no port to ask for: torchrun's default, as before


def _run_untouched(
    script: str,
    script_args: tuple[str, ...],
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
) -> int:
    """``--disable-traceml``: the script alone, as torchrun would start it; its exit code."""
    from traceml_ai.launch.launcher import TORCHRUN_SINGLE_PROCESS_ENV, LaunchError, check_script

    try:
        check_script(script)  # a folder or zip application runs as under `python`
    except LaunchError as exc:
        click.echo(f"traceml: error: {exc}", err=True)
        sys.exit(2)
    env = dict(os.environ)
    env[_environ.DISABLED] = "1"  # a traceml.init() in the script does nothing
    if nproc_per_node == 1 and nnodes == 1:
        for name, value in TORCHRUN_SINGLE_PROCESS_ENV:
            env.setdefault(name, value)
        env.setdefault("MASTER_ADDR", master_addr)
        env.setdefault("MASTER_PORT", str(master_port))
        cmd = [sys.executable, script, *script_args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc_per_node}",
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            f"--master-addr={master_addr}",
            f"--master-port={master_port}",
            script,
            *script_args,
        ]
    proc = subprocess.Popen(cmd, env=env)
    # The terminal's Ctrl-C reaches the script itself (same process group); we wait.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    return code if code >= 0 else 128 + (-code)


def _print_analysis(run_dir: Path) -> None:
    """``--mode summary``: the run's step figures from its step_time.jsonl."""
    from traceml_ai.analysis import in_process

    path = run_dir / "aggregator" / "export" / "step_time.jsonl"
    if not path.is_file():
        click.echo(f"traceml: --mode summary: no {path} to summarize", err=True)
        return
    reader = in_process.StepTimeFile(path)
    reader.read_new()
    summary = in_process.full_analysis(path, complete=reader.closed, notes=())
    if summary is None:
        summary = in_process.build_summary(
            reader.steps, source="export", complete=reader.closed, file=str(path)
        )
    click.echo(in_process.text(summary), err=True)


def _resolve(command: Command, cli: dict[str, Any]) -> LaunchSettings:
    """Resolve every setting or exit 2 with the message, before anything launches."""
    try:
        launch = resolve_launch_settings(command, cli)
    except SettingsError as exc:
        click.echo(f"traceml: error: {exc}", err=True)
        sys.exit(2)
    for warning in launch.warnings:
        click.echo(f"traceml: warning: {warning}", err=True)
    return launch


@click.command(
    cls=_RunCommand,
    # Options end at the script: whatever follows it is the script's, even --help.
    # An unknown option before it is an error (with a did-you-mean), never the script.
    # TraceML 0.5.0's --args form is handled by _RunCommand.
    context_settings={"allow_interspersed_args": False},
)
# torchrun's options, spelled as torchrun accepts them (dashes or underscores), read from
# the command line only, as torchrun reads them.
@click.option(
    "--nproc-per-node",
    "--nproc_per_node",
    "nproc_per_node",
    type=int,
    default=1,
    show_default=True,
    help="Rank processes on this node (more than 1 uses torch.distributed.run).",
)
@click.option(
    "--nnodes", "nnodes", type=int, default=1, show_default=True, help="Nodes in the job."
)
@click.option(
    "--node-rank",
    "--node_rank",
    "node_rank",
    type=int,
    default=0,
    show_default=True,
    help="This node's index.",
)
@click.option(
    "--master-addr",
    "--master_addr",
    "master_addr",
    default="127.0.0.1",
    show_default=True,
    help="Address of node 0 (torch.distributed rendezvous).",
)
@click.option(
    "--master-port",
    "--master_port",
    "master_port",
    type=int,
    default=None,
    help=(
        "Port of the rendezvous on node 0. Default: 29500 with --nnodes above 1 (every "
        "node names the same); on one node, a port free when the run starts."
    ),
)
@click_options("run")
@_compat_options
@click.argument("script", type=str)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def run(
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int | None,
    script: str,
    script_args: tuple[str, ...],
    mode: str | None,
    session_id: str | None,
    disable_traceml: bool,
    trace_max_steps: int | None,
    on_missing_aggregator: str | None,
    save_training_output: bool | None,
    **cli: Any,
) -> None:
    """Run SCRIPT [ARGS]... under TraceML and exit with its exit code.

    Options go before SCRIPT; everything after it is passed to the script. TraceML
    0.5.0's form works too: traceml run SCRIPT [OPTIONS] --args [ARGS]. One process
    runs the script directly, with the environment torchrun gives its worker (RANK,
    WORLD_SIZE, MASTER_ADDR, ...); with --nproc-per-node or --nnodes above 1 the
    ranks are started by torch.distributed.run, and the rendezvous options mean what
    torchrun users expect. The aggregator runs on node 0 and writes
    <logs-dir>/<run-name>/aggregator/export/*.jsonl when the exporter is jsonl.

    Each TraceML setting is read from its flag, else its TRACEML_* variable, else
    traceml.yaml in the current folder, else its default.
    """
    from traceml_ai.launch.launcher import LaunchError, RunOptions, default_run_name
    from traceml_ai.launch.launcher import run as launch

    ctx = click.get_current_context()
    if not ctx.meta.get("traceml_args_form") and isinstance(ctx.command, _RunCommand):
        _warn_options_after_script(ctx.command, script_args)
    for name, message in _NO_EFFECT.items():
        if cli.pop(name, None):
            click.echo(f"traceml: {message}", err=True)
    if save_training_output:
        click.echo(
            "traceml: --save-training-output has no effect here: the script's output goes "
            "to the terminal",
            err=True,
        )
    if mode == "cli":
        click.echo(
            "traceml: --mode cli has no effect here: there is no terminal view during the run "
            "(traceml summary --follow RUN_FOLDER gives one); --mode dashboard serves a live "
            "web page",
            err=True,
        )
    port = rendezvous_port(master_port, nnodes)
    if disable_traceml:
        sys.exit(
            _run_untouched(
                script, script_args, nproc_per_node, nnodes, node_rank, master_addr, port
            )
        )
    if session_id is not None:
        if cli.get("run_name") is not None and cli["run_name"] != session_id:
            click.echo(
                "traceml: error: --session-id (an alias of --run-name) and --run-name disagree",
                err=True,
            )
            sys.exit(2)
        cli["run_name"] = session_id
    settings = _resolve("run", cli)
    exporter_unset = settings.sources.get("exporter", SOURCE_DEFAULT) == SOURCE_DEFAULT
    if (mode in ("summary", "dashboard") or settings.monitor.dashboard) and exporter_unset:
        # 0.5.0's summary mode always has its figures: export step_time for it. The
        # dashboard's page is shown from the files after the run (traceml dashboard).
        settings = _resolve("run", {**cli, "exporter": "jsonl"})
    dashboard = settings.monitor.dashboard or mode == "dashboard"
    if dashboard and (settings.aggregator_host is not None or node_rank != 0):
        click.echo(
            "traceml: --mode dashboard: this node hosts no aggregator; the page is served "
            "where the aggregator runs (node 0's traceml run, or traceml serve)",
            err=True,
        )
    if (
        mode == "summary"
        and settings.run_name is None
        and settings.aggregator_host is None
        and node_rank == 0
    ):
        settings = attrs.evolve(settings, run_name=default_run_name())
    options = RunOptions(
        script=script,
        script_args=script_args,
        logs_dir=settings.logs_dir,
        run_name=settings.run_name,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=port,
        aggregator_host=settings.aggregator_host,
        aggregator_port=settings.aggregator_port,
        interval=settings.interval,
        finalize_timeout_sec=settings.finalize_timeout_sec,
        export=settings.export,
        monitor=attrs.evolve(settings.monitor, dashboard=dashboard),
        trace_max_steps=trace_max_steps,
        on_missing_aggregator=on_missing_aggregator,
        parallel=settings.parallel,
        node_relay=settings.node_relay,
    )
    try:
        code = launch(options)
    except LaunchError as exc:
        click.echo(f"traceml: error: {exc}", err=True)
        sys.exit(2)
    # The run folder is on node 0, where the aggregator ran.
    here = settings.aggregator_host is None and node_rank == 0
    if mode == "summary" and here and settings.run_name is not None:
        _print_analysis(settings.logs_dir / settings.run_name)
    sys.exit(code)


@click.command()
@click_options("serve")
def serve(**cli: Any) -> None:
    """Run the aggregator alone, for ranks launched elsewhere (torchrun, SLURM, another node).

    It finalizes when every expected rank has finished, or on Ctrl-C / SIGTERM, and
    prints the environment the ranks need (TRACEML_AGGREGATOR_ADDR, TRACEML_RUN_TOKEN).
    """
    from traceml_ai.aggregator import (
        Aggregator,
        AggregatorConfig,
        install_stop_handlers,
        run_until_done,
        tune_gc_for_aggregator,
    )
    from traceml_ai.launch.launcher import default_run_name
    from traceml_ai.transport.wire import ENV_RUN_TOKEN

    settings = _resolve("serve", cli)
    if settings.relay is not None:
        sys.exit(_serve_relay(settings))
    resolved = settings.export
    logs_dir = settings.logs_dir
    run_name = settings.run_name
    finalize_timeout_sec = settings.finalize_timeout_sec
    aggregator_bind_host = settings.aggregator_bind_host
    aggregator_port = (
        DEFAULT_SERVE_PORT if settings.aggregator_port is None else settings.aggregator_port
    )
    nnodes = settings.nnodes
    nproc_per_node = settings.nproc_per_node
    from traceml_ai.launch.run_folder import RunFolderError, check_logs_dir, create_run_folder

    try:
        check_logs_dir(logs_dir)
        # A name given on purpose may be an existing run folder (the spec's case: export
        # is then off if it holds a selected export file); a generated one is always new.
        run_dir = create_run_folder(
            logs_dir,
            run_name if run_name is not None else default_run_name(),
            exist_ok=run_name is not None,
        )
    except RunFolderError as exc:
        click.echo(f"traceml: error: {exc}", err=True)
        sys.exit(2)
    expected = None
    if nproc_per_node is not None:
        expected = (nnodes or 1) * nproc_per_node
    token = os.environ.get(ENV_RUN_TOKEN, "").strip() or secrets.token_urlsafe(24)
    tune_gc_for_aggregator()  # this process serves the run and nothing else
    aggregator = Aggregator(
        AggregatorConfig(
            run_dir=run_dir,
            settings=resolved.settings,
            token=token,
            bind_host=aggregator_bind_host,
            port=aggregator_port,
            expected_world_size=expected,
            finalize_timeout_sec=finalize_timeout_sec,
            monitor=settings.monitor,
        )
    )
    # From here on a Ctrl-C or SIGTERM finalizes the run (closing lines), never aborts.
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        # The environment line below is the first thing on stdout, whatever a custom
        # exporter's factory prints while the aggregator starts.
        with contextlib.redirect_stdout(sys.stderr):
            host, port = aggregator.start()
    except OSError as exc:
        click.echo(
            f"traceml: error: cannot listen on {aggregator_bind_host}:{aggregator_port}: {exc}",
            err=True,
        )
        sys.exit(1)
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    click.echo(f"traceml: aggregator listening on {host}:{port}; run folder {run_dir}", err=True)
    click.echo("traceml: start the ranks with:", err=True)
    # A line to paste into a shell: a token set by hand may hold any character.
    address = shlex.quote(f"{connect_host}:{port}")
    layout = f" {_environ.PARALLEL}={shlex.quote(settings.parallel)}" if settings.parallel else ""
    click.echo(
        f"export TRACEML_AGGREGATOR_ADDR={address} TRACEML_RUN_TOKEN={shlex.quote(token)}{layout}"
    )
    sys.stdout.flush()
    result = run_until_done(aggregator, stop=stop, wait_for_ranks=True)
    if resolved.settings.exporter:
        written = result.stats.written_total if result.stats else 0
        export_dir = run_dir / "aggregator" / "export"
        # A custom exporter writes where it likes: name the folder only if it exists.
        where = f"in {export_dir}" if export_dir.is_dir() else "passed to the custom exporter"
        failed = "; the exporter failed" if result.stats and result.stats.exporter_failed else ""
        click.echo(f"traceml: export: {written} records {where}{failed}", err=True)
    if result.warning_path is not None:
        from traceml_ai.launch.launcher import lost_what

        click.echo(
            f"traceml: {lost_what(result.warning_path)}; see {result.warning_path}", err=True
        )
    click.echo(f"traceml: run folder {run_dir}", err=True)


def _stop_relay(relay: Relay, timeout: float) -> RelayStats | None:
    """Stop ``relay``, forwarding what it holds within ``timeout``; the first signal
    started this, a second one gives up at once (None, one line said what was lost)."""
    from traceml_ai.aggregator import install_stop_handlers

    again = threading.Event()
    install_stop_handlers(again)
    pending = relay.stats().pending_frames
    if pending and not relay.loop_found:
        click.echo(
            f"traceml: relay stopping: forwarding the {pending} frames it holds (at most "
            f"{timeout:.0f} s); press Ctrl-C again to stop it now",
            err=True,
        )
    stopped: list[RelayStats] = []
    # A thread of its own: the wait can be cut short, which stop() itself cannot be.
    stopper = threading.Thread(
        target=lambda: stopped.append(relay.stop(timeout)), name="traceml-relay-stop", daemon=True
    )
    stopper.start()
    while stopper.is_alive() and not again.wait(0.1):
        pass
    stopper.join(0.0 if stopper.is_alive() and again.is_set() else None)
    if stopped:
        return stopped[0]
    click.echo(
        f"traceml: relay stopped by a second Ctrl-C: the {relay.stats().pending_frames} "
        "frames it held are lost",
        err=True,
    )
    return None


def _serve_relay(settings: LaunchSettings) -> int:
    """``traceml serve --relay HOST:PORT``: relay the ranks (or relays) that send here to
    the aggregator at HOST:PORT until Ctrl-C / SIGTERM; the exit code."""
    from traceml_ai.aggregator import install_stop_handlers
    from traceml_ai.launch._relay_process import relay_losses, split_address
    from traceml_ai.transport.relay import Relay
    from traceml_ai.transport.wire import ENV_RUN_TOKEN

    assert settings.relay is not None
    token = os.environ.get(ENV_RUN_TOKEN, "").strip()
    if not token:
        click.echo(
            f"traceml: error: --relay needs the run token of that aggregator in {ENV_RUN_TOKEN} "
            "(`traceml serve` prints it)",
            err=True,
        )
        return 2
    bind_host = settings.aggregator_bind_host
    port = DEFAULT_SERVE_PORT if settings.aggregator_port is None else settings.aggregator_port
    relay = Relay(
        split_address(settings.relay),
        token,
        host=bind_host,
        port=port,
        on_event=lambda line: click.echo(f"traceml: relay {line}", err=True),
    )
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        host, bound = relay.start()
    except OSError as exc:
        click.echo(f"traceml: error: cannot listen on {bind_host}:{port}: {exc}", err=True)
        return 1
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    click.echo(
        f"traceml: relay listening on {host}:{bound}, forwarding to {settings.relay}", err=True
    )
    click.echo("traceml: start the ranks with:", err=True)
    address = shlex.quote(f"{connect_host}:{bound}")
    click.echo(f"export TRACEML_AGGREGATOR_ADDR={address} TRACEML_RUN_TOKEN={shlex.quote(token)}")
    sys.stdout.flush()
    while not stop.wait(0.5):
        if relay.loop_found:
            break  # it said why in one line; relaying to itself forwards nothing
    stats = _stop_relay(relay, settings.finalize_timeout_sec)
    if stats is None:
        return 128 + signal.SIGINT
    lost = relay_losses(
        settings.relay,
        dropped_batches=stats.dropped_batches,
        dropped_messages=stats.dropped_messages,
        refused_frames=stats.refused_frames,
        upstream_connections=stats.upstream_connections,
        pending_frames=stats.pending_frames,
    )
    click.echo(f"traceml: relay stopped: {stats.forwarded_frames} frames forwarded{lost}", err=True)
    return 1 if relay.loop_found else 0
