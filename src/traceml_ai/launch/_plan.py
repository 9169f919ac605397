"""``traceml run``'s plan: the options it was given, checked, and where things run."""

from __future__ import annotations

import hashlib
import os
import pkgutil
import secrets
from datetime import datetime, timezone
from pathlib import Path

import attrs

from traceml_ai.launch.run_folder import (
    RunFolderError,
    check_logs_dir,
    check_run_name,
    existing_folder_message,
)
from traceml_ai.settings import (
    AGGREGATOR_PORT,
    DEFAULT_SERVE_PORT,
    FINALIZE_TIMEOUT_SEC,
    INTERVAL,
    MonitorSettings,
    ResolvedExportSettings,
    check_code_value,
    parse_host,
)
from traceml_ai.transport.wire import ENV_RUN_TOKEN

DEFAULT_MULTI_NODE_AGGREGATOR_PORT = DEFAULT_SERVE_PORT


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
    finalize_timeout_sec: float
    export: ResolvedExportSettings
    monitor: MonitorSettings = attrs.field(factory=MonitorSettings)
    trace_max_steps: int | None = None
    """``--trace-max-steps``: each rank sends the step figures of its first N steps."""
    on_missing_aggregator: str | None = None
    """``--on-missing-aggregator``: ``warn`` or ``raise`` in the ranks' ``traceml.init()``."""
    parallel: str = ""
    """``--parallel``: the declared layout (normalized), for the ranks' environment."""
    node_relay: bool = True
    """``--node-relay``: on a job of several nodes, this node's ranks send through a relay."""


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
class RunPlan:
    run_dir: Path | None  # None on nodes that do not host the aggregator
    start_aggregator: bool
    bind_host: str
    connect_host: str
    port: int
    token: str
    world_size: int
    token_derived: bool = False
    """No ``TRACEML_RUN_TOKEN`` on a job of several nodes: the token was derived from the
    rendezvous options (``multi_node_token``)."""


def node_global_ranks(options: RunOptions) -> range:
    """The global ranks of this node's workers. ``rank_command`` runs
    ``torch.distributed.run`` with ``--node-rank`` and its default static rendezvous,
    whose group rank is the node rank, and every node has ``nproc_per_node`` workers
    (``RunPlan.world_size``): node N's ranks follow the N nodes before it."""
    first = options.node_rank * options.nproc_per_node
    return range(first, first + options.nproc_per_node)


def plan(options: RunOptions, environ: dict[str, str] | os._Environ[str]) -> RunPlan:
    """Check every option and decide where things run; raises ``LaunchError``."""
    if options.nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node must be at least 1, got {options.nproc_per_node}")
    if options.nnodes < 1:
        raise LaunchError(f"--nnodes must be at least 1, got {options.nnodes}")
    if not 0 <= options.node_rank < options.nnodes:
        raise LaunchError(f"--node-rank must be in [0, {options.nnodes}), got {options.node_rank}")
    # The settings' bounds, from the table (options made in code skip the resolution).
    for setting, value in (
        (INTERVAL, options.interval),
        (FINALIZE_TIMEOUT_SEC, options.finalize_timeout_sec),
        (AGGREGATOR_PORT, options.aggregator_port),
    ):
        if value is not None:
            try:
                check_code_value(setting, value, setting.flag)
            except ValueError as exc:
                raise LaunchError(str(exc)) from None
    try:
        parse_host(options.master_addr)
    except ValueError as exc:
        raise LaunchError(f"--master-addr: {exc}") from None
    multi_node = options.nnodes > 1
    # torchrun would end in a traceback of its own; across nodes each node must name
    # node 0's rendezvous port, so 0 (a free port) cannot be it.
    lowest = 1 if multi_node else 0
    if not lowest <= options.master_port <= 65535:
        across = " on a job of several nodes" if multi_node else ""
        raise LaunchError(
            f"--master-port must be in [{lowest}, 65535]{across}, got {options.master_port}"
        )
    if multi_node and options.aggregator_port == 0:
        raise LaunchError(
            "--aggregator-port 0 picks a free port, which the other nodes cannot know; on a "
            f"job of several nodes give the same port on every node (default "
            f"{DEFAULT_MULTI_NODE_AGGREGATOR_PORT})"
        )
    check_script(options.script)
    port = options.aggregator_port
    external = options.aggregator_host is not None
    if port is None:
        port = DEFAULT_MULTI_NODE_AGGREGATOR_PORT if (multi_node or external) else 0
    if external and port == 0:
        raise LaunchError(
            "--aggregator-host needs --aggregator-port (the port `traceml serve` listens on)"
        )
    start_aggregator = not external and options.node_rank == 0
    token = environ.get(ENV_RUN_TOKEN, "").strip()
    token_derived = not token and multi_node and not external
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
    return RunPlan(
        run_dir=run_dir,
        start_aggregator=start_aggregator,
        bind_host=bind_host,
        connect_host=connect_host,
        port=port,
        token=token,
        token_derived=token_derived,
        world_size=options.nnodes * options.nproc_per_node,
    )
