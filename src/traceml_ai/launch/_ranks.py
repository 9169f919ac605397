"""Starting and supervising the ranks of ``traceml run``: one process directly, several
through ``torch.distributed.run``; how they ended.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import attrs

from traceml_ai.launch._plan import RunOptions
from traceml_ai.launch._signals import Signals
from traceml_ai.launch.bootstrap import ENV_RANK_STATE_DIR, ENV_SIGINT_HELD

TORCHRUN_SINGLE_PROCESS_ENV = (
    ("RANK", "0"),
    ("LOCAL_RANK", "0"),
    ("WORLD_SIZE", "1"),
    ("LOCAL_WORLD_SIZE", "1"),
    ("GROUP_RANK", "0"),
    ("NODE_RANK", "0"),
)
"""What ``torch.distributed.run`` gives its one worker (with MASTER_ADDR/MASTER_PORT)."""


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


def run_ranks(options: RunOptions, env: dict[str, str], signals: Signals) -> RankEnds:
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
