"""``traceml run``: validate, start the aggregator, start the ranks, wait, finalize.

The aggregator runs in its own process and session: a stalled or killed
aggregator never stops training, and a Ctrl-C reaches it only through us, after
the ranks have stopped. The ranks run in their own process group so that one
Ctrl-C is forwarded to them exactly once.
"""

from __future__ import annotations

import os
from pathlib import Path

from traceml_ai import _environ
from traceml_ai.launch._aggregator_process import AggregatorProcess
from traceml_ai.launch._plan import (
    DEFAULT_MULTI_NODE_AGGREGATOR_PORT,
    LaunchError,
    RunOptions,
    RunPlan,
    check_script,
    default_run_name,
    multi_node_token,
    node_global_ranks,
    plan,
)
from traceml_ai.launch._ranks import (
    BOOTSTRAP_MODULE,
    TORCHRUN_SINGLE_PROCESS_ENV,
    RankEnds,
    rank_command,
    read_rank_notes,
    run_ranks,
    single_process_environment,
)
from traceml_ai.launch._relay_process import REFUSED_TOKEN_CHECK, RelayProcess, relay_losses
from traceml_ai.launch._report import (
    count_data_lines,
    export_tally,
    lost_what,
    report_aggregator_lost,
    report_export_off,
    report_finalized,
)
from traceml_ai.launch._signals import Signals, say, signal_name
from traceml_ai.launch.run_folder import (
    RunFolderError,
    create_run_folder,
)
from traceml_ai.transport.wire import ENV_AGGREGATOR_ADDR, ENV_RUN_TOKEN, ENV_SAMPLER_INTERVAL

__all__ = [
    "BOOTSTRAP_MODULE",
    "DEFAULT_MULTI_NODE_AGGREGATOR_PORT",
    "TORCHRUN_SINGLE_PROCESS_ENV",
    "LaunchError",
    "RankEnds",
    "RunOptions",
    "RunPlan",
    "check_script",
    "count_data_lines",
    "default_run_name",
    "export_tally",
    "lost_what",
    "multi_node_token",
    "plan",
    "rank_command",
    "read_rank_notes",
    "report_aggregator_lost",
    "report_export_off",
    "run",
    "single_process_environment",
    "step_time_export_file",
]

ENV_AGGREGATOR_UNAVAILABLE = _environ.AGGREGATOR_UNAVAILABLE

ENV_RUN_DIR = _environ.RUN_DIR

ENV_SUMMARY_FILE = _environ.SUMMARY_FILE


def step_time_export_file(options: RunOptions, run_dir: Path) -> Path | None:
    """Where the built-in exporter writes this run's step_time lines; None if it does not."""
    export = options.export
    if export.settings.exporter != "jsonl" or "step_time" not in export.selected_streams:
        return None
    return run_dir / "aggregator" / "export" / "step_time.jsonl"


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
    with Signals() as signals:
        return _run_planned(options, p, signals)


NCCL_TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"


def _start_relay(
    upstream: str, token: str, stop_timeout_s: float, ranks: range
) -> tuple[RelayProcess, str] | None:
    """This node's relay for its global ``ranks``, watched while the ranks train, and
    the address its ranks send to; None (one line said why) when it cannot start: the
    ranks then send to the aggregator themselves."""
    relay = RelayProcess(upstream, token, stop_timeout_s, ranks)
    started = relay.start()
    if isinstance(started, str):
        say(f"{started}; this node's ranks send to the aggregator themselves")
        return None
    relay.watch()
    return relay, f"127.0.0.1:{started}"


def _report_relay_stop(
    relay: RelayProcess, options: RunOptions, p: RunPlan, signals: Signals
) -> None:
    """Stop the node's relay; what it lost is said here in one line, as ``traceml serve
    --relay`` says it (on a node other than node 0 nothing else would tell it)."""
    seen = signals.count
    stopped = relay.stop(signals)
    if stopped is None:
        if signals.count > seen + 1:
            say("the node's relay was stopped by a second Ctrl-C: what it held is lost")
        return  # else gone: its watcher said so
    counts = {
        name: value if type(value := stopped.get(name)) is int else 0
        for name in (
            "forwarded_frames",
            "dropped_batches",
            "dropped_messages",
            "refused_frames",
            "upstream_connections",
            "pending_frames",
        )
    }
    token_check = REFUSED_TOKEN_CHECK
    if p.token_derived:
        # Nodes that spell node 0's address differently (a name on one, its IP on
        # another) derive different tokens: every frame of this node is refused.
        token_check = (
            f"this node's run token is derived from --master-addr {options.master_addr}, "
            f"--master-port {options.master_port} and --aggregator-port {p.port}: give "
            f"every node the same three, or the same {ENV_RUN_TOKEN}"
        )
    lost = relay_losses(
        relay.upstream,
        dropped_batches=counts["dropped_batches"],
        dropped_messages=counts["dropped_messages"],
        refused_frames=counts["refused_frames"],
        upstream_connections=counts["upstream_connections"],
        pending_frames=counts["pending_frames"],
        token_check=token_check,
    )
    if lost:
        say(f"the node's relay stopped: {counts['forwarded_frames']} frames forwarded{lost}")


def _run_planned(options: RunOptions, p: RunPlan, signals: Signals) -> int:
    aggregator: AggregatorProcess | None = None
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
    # The layout as resolved (flag > TRACEML_PARALLEL > traceml.yaml): what the ranks read.
    if options.parallel:
        env[_environ.PARALLEL] = options.parallel
    else:
        env.pop(_environ.PARALLEL, None)
    env.pop(ENV_AGGREGATOR_ADDR, None)
    env.pop(ENV_AGGREGATOR_UNAVAILABLE, None)
    env.pop(ENV_RUN_DIR, None)
    env.pop(ENV_SUMMARY_FILE, None)
    if p.start_aggregator:
        assert p.run_dir is not None
        aggregator = AggregatorProcess(options, p)
        ready = aggregator.wait_ready(signals)
        if isinstance(ready, str):
            if not signals.received:
                say(f"{ready}; training runs without TraceML telemetry")
            aggregator = None
            not_started = ready
            # The ranks say why telemetry is off instead of "not launched by traceml run".
            env[ENV_AGGREGATOR_UNAVAILABLE] = ready
        else:
            aggregator.watch(export_on)
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
        say(f"run folder {p.run_dir}")
    relay = None
    if options.nnodes > 1 and options.node_relay and ENV_AGGREGATOR_ADDR in env:
        relay = _start_relay(
            env[ENV_AGGREGATOR_ADDR],
            p.token,
            options.finalize_timeout_sec,
            node_global_ranks(options),
        )
        if relay is not None:
            env[ENV_AGGREGATOR_ADDR] = relay[1]

    interrupted_early = bool(signals.received)
    if interrupted_early:
        # Stopped before training began: start no rank, finalize what was started.
        exit_code = 128 + signals.received[0]
        say(f"interrupted ({signal_name(signals.received[0])}) before the training script started")
        ends = None
    else:
        ends = run_ranks(options, env, signals)
        exit_code = ends.exit_code
    if relay is not None:
        # Before the aggregator finalizes: what the relay holds goes first.
        _report_relay_stop(relay[0], options, p, signals)

    if not_started is not None and export_on:
        assert p.run_dir is not None
        report_export_off(p.run_dir, not_started)
    if aggregator is not None:
        assert p.run_dir is not None
        event, why = aggregator.finalize(signals)
        if event is None:
            report_aggregator_lost(p, why, exit_code, export_on=export_on)
        else:
            report_finalized(options, p, event, ends)
    return exit_code
