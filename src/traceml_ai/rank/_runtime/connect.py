"""Where a rank sends and whether this process is a rank: the aggregator's address
(``traceml run``'s environment or ``init(aggregator_host=...)``), the rank's sender,
and the test that tells a DataLoader worker re-importing the script from a rank."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from traceml_ai import _environ
from traceml_ai._ports import DEFAULT_SERVE_PORT
from traceml_ai.rank._runtime.runtime import Sender
from traceml_ai.rank.identity import RankIdentity
from traceml_ai.transport.wire import ENV_AGGREGATOR_ADDR, ENV_RUN_TOKEN

__all__ = [
    "ENV_RANK_PID",
    "aggregator_address",
    "build_sender",
    "child_of_a_rank",
    "mark_rank_process",
    "off_message",
    "parse_address",
]

# Private test knob: the sender's per-stream queue bound (tests make ranks drop with it).
_ENV_TEST_MAX_PENDING = "_TRACEML_TEST_SENDER_MAX_PENDING_ITEMS"
# Set by a rank when its TraceML starts: processes it starts through
# multiprocessing inherit it (spawn and forkserver copy the environment).
ENV_RANK_PID = "_TRACEML_RANK_PID"


def parse_address(value: str) -> tuple[str, int]:
    """``host:port`` (``[v6addr]:port`` too) to ``(host, port)``; ValueError if malformed."""
    host, sep, port_text = value.strip().rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected host:port, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"port out of range in {value!r}")
    return host, port


def aggregator_address(host: str | None, port: int | None) -> tuple[str, str]:
    """``(address, no_token)``: where to send (``""``: nowhere), from ``traceml run``'s
    environment or else ``init``'s ``aggregator_host``/``aggregator_port``; ``no_token``
    names the address those gave when the run's token is missing (the aggregator
    refuses a rank without it, so nothing would arrive)."""
    address = os.environ.get(ENV_AGGREGATOR_ADDR, "").strip()
    if address or (host is None and port is None):
        return address, ""
    host = host or "127.0.0.1"
    port = port if port is not None else DEFAULT_SERVE_PORT
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if not os.environ.get(ENV_RUN_TOKEN, "").strip():
        return "", address
    return address, ""


def off_message(no_token: str) -> str:
    """The one warning of a rank with nowhere to send (telemetry off)."""
    # Set by `traceml run` (traceml_ai.launch.launcher) when its aggregator did not start.
    unavailable = os.environ.get(_environ.AGGREGATOR_UNAVAILABLE, "").strip()
    if no_token:
        return (
            f"traceml: init(aggregator_host/aggregator_port) names {no_token}, but "
            f"{ENV_RUN_TOKEN} is not set (`traceml serve` prints it); telemetry is off."
        )
    if unavailable:
        return (
            f"traceml: the aggregator did not start ({unavailable}); telemetry is off for this run."
        )
    return (
        "TraceML export is off: this script was not launched by `traceml run` "
        f"({ENV_AGGREGATOR_ADDR} is not set); TraceML calls do nothing."
    )


def build_sender(identity: RankIdentity, previous: Sender | None, address: str) -> Sender:
    """Start the rank's sender to ``address``; it continues ``previous``'s batch counts."""
    host, port = parse_address(address)
    token = os.environ.get(ENV_RUN_TOKEN, "")
    # Imported here: only ranks launched by traceml need the transport.
    from traceml_ai.transport.sender import RankSender

    options: dict[str, Any] = {}
    if isinstance(previous, RankSender):
        options["counts_from"] = previous
    test_bound = os.environ.get(_ENV_TEST_MAX_PENDING, "").strip()
    if test_bound:
        with contextlib.suppress(ValueError):
            options["max_pending_items"] = max(1, int(test_bound))
    sender = RankSender((host, port), token, identity.to_wire(), **options)
    sender.start()
    return sender


def child_of_a_rank() -> bool:
    """Whether this is a multiprocessing child of a TraceML rank (e.g. a DataLoader worker).

    Spawn and forkserver workers re-import the script, so a top-level
    ``traceml.init()`` runs again there; it must not start a second copy of the
    rank (a second sender, ``seq`` from 0, NVML in every worker). Neither
    ``torch.utils.data.get_worker_info()`` nor ``parent_process()`` is set yet
    while the script is re-imported (multiprocessing sets them after), so the
    test is: the environment names a rank pid other than ours (the rank set it
    before starting its workers), and multiprocessing started this process (a
    name other than MainProcess, the import flag ``_inheriting`` — the forkserver
    server imports the script with it — or a parent process). A process started
    otherwise (torchrun, Ray, subprocess) is not a worker and may be a rank.
    """
    owner = os.environ.get(ENV_RANK_PID, "").strip()
    if not owner or owner == str(os.getpid()):
        return False
    mp = sys.modules.get("multiprocessing")
    if mp is None:
        return False
    try:
        current = mp.current_process()
        return bool(
            getattr(current, "_inheriting", False)
            or current.name != "MainProcess"
            or mp.parent_process() is not None
        )
    except Exception:
        return False


def mark_rank_process() -> None:
    """This process is a started rank: the processes it starts through multiprocessing
    (DataLoader workers) know it from their environment (:func:`child_of_a_rank`)."""
    os.environ[ENV_RANK_PID] = str(os.getpid())
