"""``traceml run`` and ``traceml serve``: options, validation before launch, exit codes."""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import threading
from pathlib import Path
from typing import Any

import click

from traceml_ai.settings import (
    ResolvedExportSettings,
    SettingsError,
    resolve_export_settings,
)

_EXPORT_HELP = "Exporter: '' (off), 'jsonl', or 'module.path:factory'. [env: TRACEML_EXPORTER]"
_STREAMS_HELP = (
    "Streams to export, comma-separated: step_time, step_memory, process, system, all "
    "(default step_time). [env: TRACEML_EXPORT_STREAMS]"
)
_HOSTNAME_HELP = "Include hostname on the lines that carry it. [env: TRACEML_EXPORTER_HOSTNAME]"


def _export_options(func: Any) -> Any:
    func = click.option(
        "--exporter-hostname", "exporter_hostname", is_flag=True, default=None, help=_HOSTNAME_HELP
    )(func)
    func = click.option(
        "--export-streams", "export_streams", default=None, metavar="NAMES", help=_STREAMS_HELP
    )(func)
    func = click.option(
        "--exporter", "exporter", default=None, metavar="EXPORTER", help=_EXPORT_HELP
    )(func)
    return func


def _run_folder_options(func: Any) -> Any:
    func = click.option(
        "--run-name",
        default=None,
        help="Run folder name (default: UTC timestamp plus a random suffix).",
    )(func)
    func = click.option(
        "--logs-dir",
        type=click.Path(path_type=Path),
        default=Path("logs"),
        show_default=True,
        help="Where run folders are created.",
    )(func)
    return func


_finalize_option = click.option(
    "--finalize-timeout-sec",
    type=float,
    default=10.0,
    show_default=True,
    help="Longest wait for pending records at shutdown.",
)


def _resolve(
    exporter: str | None, export_streams: str | None, exporter_hostname: bool | None
) -> ResolvedExportSettings:
    """Resolve the export settings or exit 2 with the message, before anything launches."""
    try:
        resolved = resolve_export_settings(
            cli_exporter=exporter,
            cli_export_streams=export_streams,
            cli_exporter_hostname=exporter_hostname,
        )
    except SettingsError as exc:
        click.echo(f"traceml: error: {exc}", err=True)
        sys.exit(2)
    for warning in resolved.warnings:
        click.echo(f"traceml: warning: {warning}", err=True)
    return resolved


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@_run_folder_options
@click.option(
    "--nproc-per-node",
    type=int,
    default=1,
    show_default=True,
    help="Rank processes on this node (more than 1 uses torch.distributed.run).",
)
@click.option("--nnodes", type=int, default=1, show_default=True, help="Nodes in the job.")
@click.option("--node-rank", type=int, default=0, show_default=True, help="This node's index.")
@click.option(
    "--master-addr",
    default="127.0.0.1",
    show_default=True,
    help="Address of node 0 (torch.distributed rendezvous).",
)
@click.option(
    "--master-port",
    type=int,
    default=29500,
    show_default=True,
    help="Port of the rendezvous on node 0.",
)
@click.option(
    "--aggregator-host",
    default=None,
    help="Send to an aggregator already running there (e.g. `traceml serve`) instead of starting one on node 0.",
)
@click.option(
    "--aggregator-port",
    type=int,
    default=None,
    help="Aggregator port (default: any free port on one node; 29600 across nodes).",
)
@click.option(
    "--interval",
    type=float,
    default=2.0,
    show_default=True,
    help="Seconds between process/system samples.",
)
@_finalize_option
@_export_options
@click.argument("script", type=str)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def run(
    logs_dir: Path,
    run_name: str | None,
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    aggregator_host: str | None,
    aggregator_port: int | None,
    interval: float,
    finalize_timeout_sec: float,
    exporter: str | None,
    export_streams: str | None,
    exporter_hostname: bool | None,
    script: str,
    script_args: tuple[str, ...],
) -> None:
    """Run SCRIPT [ARGS]... under TraceML and exit with its exit code.

    One process runs the script directly; with --nproc-per-node or --nnodes above 1
    the ranks are started by torch.distributed.run, and the rendezvous options mean
    what torchrun users expect. The aggregator runs on node 0 and writes
    <logs-dir>/<run-name>/aggregator/export/*.jsonl when an exporter is set.
    """
    from traceml_ai._launch import LaunchError, RunOptions
    from traceml_ai._launch import run as launch

    resolved = _resolve(exporter, export_streams, exporter_hostname)
    options = RunOptions(
        script=script,
        script_args=script_args,
        logs_dir=logs_dir,
        run_name=run_name,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        aggregator_host=aggregator_host,
        aggregator_port=aggregator_port,
        interval=interval,
        finalize_timeout_s=finalize_timeout_sec,
        export=resolved,
    )
    try:
        code = launch(options)
    except LaunchError as exc:
        click.echo(f"traceml: error: {exc}", err=True)
        sys.exit(2)
    sys.exit(code)


@click.command()
@_run_folder_options
@click.option(
    "--aggregator-bind-host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (0.0.0.0 for ranks on other hosts).",
)
@click.option(
    "--aggregator-port",
    type=click.IntRange(0, 65535),
    default=29600,
    show_default=True,
    help="Port to listen on (0 picks a free one).",
)
@click.option(
    "--nnodes",
    type=click.IntRange(min=1),
    default=None,
    help="Nodes in the job (with --nproc-per-node gives the world size).",
)
@click.option(
    "--nproc-per-node",
    type=click.IntRange(min=1),
    default=None,
    help="Ranks per node; without it, the world size the first rank reports is expected.",
)
@_finalize_option
@_export_options
def serve(
    logs_dir: Path,
    run_name: str | None,
    aggregator_bind_host: str,
    aggregator_port: int,
    nnodes: int | None,
    nproc_per_node: int | None,
    finalize_timeout_sec: float,
    exporter: str | None,
    export_streams: str | None,
    exporter_hostname: bool | None,
) -> None:
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

    resolved = _resolve(exporter, export_streams, exporter_hostname)
    if not finalize_timeout_sec > 0:
        click.echo("traceml: error: --finalize-timeout-sec must be positive", err=True)
        sys.exit(2)
    run_dir = logs_dir / (run_name or default_run_name())
    if run_dir.exists() and not run_name:
        click.echo(f"traceml: error: run folder already exists: {run_dir}", err=True)
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
        click.echo(
            f"traceml: export: {written} records in {run_dir / 'aggregator' / 'export'}", err=True
        )
    if result.warning_path is not None:
        click.echo(f"traceml: something was lost; see {result.warning_path}", err=True)
    click.echo(f"traceml: run folder {run_dir}", err=True)
