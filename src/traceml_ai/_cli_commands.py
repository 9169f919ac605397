"""``traceml run`` and ``traceml serve``: options, validation before launch, exit codes."""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import click

from traceml_ai.settings import (
    SETTINGS,
    Command,
    LaunchSettings,
    SettingsError,
    resolve_launch_settings,
)

_F = TypeVar("_F", bound=Callable[..., Any])


def _setting_options(command: Command) -> Callable[[_F], _F]:
    """One click option per setting of ``command`` in the settings table.

    Every option defaults to ``None`` (not given) and takes text: the table's parser
    checks it, so a flag, a variable and a YAML key get the same checks and messages.
    """

    def decorate(func: _F) -> _F:
        for setting in reversed(SETTINGS):
            if command not in setting.commands:
                continue
            where = f"env {setting.env}; traceml.yaml {setting.yaml_key}"
            help_text = f"{setting.help} [default: {setting.default_doc}; {where}]"
            if setting.is_switch:
                # A real on/off pair, so the command line can switch off what the
                # environment or traceml.yaml switched on.
                decl = f"{setting.flag}/--no-{setting.flag[2:]}"
                func = click.option(decl, setting.name, default=None, help=help_text)(func)
            else:
                func = click.option(
                    setting.flag,
                    setting.name,
                    type=str,
                    default=None,
                    metavar=setting.metavar,
                    help=help_text,
                )(func)
        return func

    return decorate


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
    # Options end at the script: whatever follows it is the script's, even --help.
    # An unknown option before it is an error (with a did-you-mean), never the script.
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
    default=29500,
    show_default=True,
    help="Port of the rendezvous on node 0.",
)
@_setting_options("run")
@click.argument("script", type=str)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def run(
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    script: str,
    script_args: tuple[str, ...],
    **cli: Any,
) -> None:
    """Run SCRIPT [ARGS]... under TraceML and exit with its exit code.

    Options go before SCRIPT; everything after it is passed to the script. One
    process runs the script directly; with --nproc-per-node or --nnodes above 1 the
    ranks are started by torch.distributed.run, and the rendezvous options mean what
    torchrun users expect. The aggregator runs on node 0 and writes
    <logs-dir>/<run-name>/aggregator/export/*.jsonl when the exporter is jsonl.

    Each TraceML setting is read from its flag, else its TRACEML_* variable, else
    traceml.yaml in the current folder, else its default.
    """
    from traceml_ai._launch import LaunchError, RunOptions
    from traceml_ai._launch import run as launch

    settings = _resolve("run", cli)
    options = RunOptions(
        script=script,
        script_args=script_args,
        logs_dir=settings.logs_dir,
        run_name=settings.run_name,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        aggregator_host=settings.aggregator_host,
        aggregator_port=settings.aggregator_port,
        interval=settings.interval,
        finalize_timeout_s=settings.finalize_timeout_sec,
        export=settings.export,
    )
    try:
        code = launch(options)
    except LaunchError as exc:
        click.echo(f"traceml: error: {exc}", err=True)
        sys.exit(2)
    sys.exit(code)


@click.command()
@_setting_options("serve")
def serve(**cli: Any) -> None:
    """Run the aggregator alone, for ranks launched elsewhere (torchrun, SLURM, another node).

    It finalizes when every expected rank has finished, or on Ctrl-C / SIGTERM, and
    prints the environment the ranks need (TRACEML_AGGREGATOR_ADDR, TRACEML_RUN_TOKEN).
    """
    from traceml_ai._launch import default_run_name
    from traceml_ai.aggregator import (
        Aggregator,
        AggregatorConfig,
        install_stop_handlers,
        run_until_done,
        tune_gc_for_aggregator,
    )
    from traceml_ai.wire import ENV_RUN_TOKEN

    settings = _resolve("serve", cli)
    resolved = settings.export
    logs_dir = settings.logs_dir
    run_name = settings.run_name
    finalize_timeout_sec = settings.finalize_timeout_sec
    aggregator_bind_host = settings.aggregator_bind_host
    aggregator_port = 29600 if settings.aggregator_port is None else settings.aggregator_port
    nnodes = settings.nnodes
    nproc_per_node = settings.nproc_per_node
    from traceml_ai._run_folder import RunFolderError, check_logs_dir, create_run_folder

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
            finalize_timeout_s=finalize_timeout_sec,
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
    click.echo(f"export TRACEML_AGGREGATOR_ADDR={connect_host}:{port} TRACEML_RUN_TOKEN={token}")
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
        click.echo(f"traceml: something was lost; see {result.warning_path}", err=True)
    click.echo(f"traceml: run folder {run_dir}", err=True)
