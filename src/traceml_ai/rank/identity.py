"""Who this rank is: read once from the launcher's environment."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import attrs


def _env_int(env: Mapping[str, str], names: tuple[str, ...], default: int, minimum: int) -> int:
    # A malformed or out-of-range value falls back to the default rather than
    # failing the training script at import or init time.
    for name in names:
        raw = env.get(name)
        if raw is None or not raw.strip():
            continue
        try:
            value = int(raw.strip())
        except ValueError:
            continue
        if value >= minimum:
            return value
    return default


@attrs.frozen(slots=True, kw_only=True)
class RankIdentity:
    """The identity block a rank sends with every wire batch."""

    global_rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    hostname: str | None = None
    pid: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RankIdentity:
        """Read ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``/``NODE_RANK``.

        Missing variables give a single process: rank 0 of world 1 on node 0.
        """
        env = os.environ if env is None else env
        world_size = _env_int(env, ("WORLD_SIZE",), 1, 1)
        global_rank = _env_int(env, ("RANK",), 0, 0)
        local_rank = _env_int(env, ("LOCAL_RANK",), 0, 0)
        local_world_size = _env_int(env, ("LOCAL_WORLD_SIZE",), 1, 1)
        node_rank = _env_int(env, ("GROUP_RANK", "NODE_RANK"), 0, 0)
        try:
            hostname: str | None = socket.gethostname()
        except OSError:
            hostname = None
        return cls(
            global_rank=global_rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=node_rank,
            hostname=hostname,
            pid=os.getpid(),
        )

    def to_wire(self) -> dict[str, object]:
        """The ``identity`` object of a wire message (see docs/dev/wire-format.md)."""
        return {
            "global_rank": self.global_rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "node_rank": self.node_rank,
            "hostname": self.hostname,
            "pid": self.pid,
        }
