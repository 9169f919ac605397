"""Aggregator at scale: N simulated ranks over the real transport and wire format.

The command is ``python -m bench.scale`` from the repository root; ``cli`` documents
its modes and accounting. Modules:

- ``items``: what a simulated rank sends, and ``LoadSpec``, the load of one run;
- ``generator``: generator processes, one TCP connection per simulated rank;
- ``aggregator``: the ``traceml serve`` subprocess under load, and its queue bounds;
- ``check``: exact accounting of every record in the files, ``traceml validate``;
- ``run``: one run end to end and its report; ``modes``: --find-max, --soak,
  --overload; ``pause``: --pause with real ``RankSender``s; ``pyspy``: profiles;
- ``relays``: --relays (many relays per process) and --relay-processes (one real relay
  process per node); ``replay``: --replay-parts (the load through relays in parts,
  replayed at once into the aggregator).
"""

from .aggregator import QueueBounds
from .cli import main
from .items import LoadSpec
from .pause import run_pause
from .relays import RelayHosts, RelayProcesses
from .replay import run_replay
from .run import RunResult, run_once

__all__ = [
    "LoadSpec",
    "QueueBounds",
    "RelayHosts",
    "RelayProcesses",
    "RunResult",
    "main",
    "run_once",
    "run_pause",
    "run_replay",
]
