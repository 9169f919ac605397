"""The ``runtime_environment`` item: topology, torch.distributed state, training strategy."""

from __future__ import annotations

import platform
from typing import Any

from traceml_ai.rank._collectives import parallel_layout
from traceml_ai.rank._lazy import torch_or_none
from traceml_ai.rank.identity import RankIdentity
from traceml_records.internal import RuntimeEnvironmentItem
from traceml_records.internal import topology_of as _topology_of

# Class names are matched instead of importing the wrapper classes, so detection
# never imports torch.distributed.fsdp or deepspeed just to ask.
_DDP_NAMES = frozenset({"DistributedDataParallel"})
_FSDP_NAMES = frozenset({"FullyShardedDataParallel", "FSDPModule"})
_DEEPSPEED_NAMES = frozenset({"DeepSpeedEngine"})


# The contract's rule (traceml_records._rules, "topology-from-world-sizes"), so the
# rank sends the topology the builder and the validator expect.
topology_of = _topology_of


def model_strategy(model: object) -> str | None:
    """``ddp``, ``fsdp`` or ``deepspeed`` when the model is such a wrapper, else ``None``."""
    for cls in type(model).__mro__:
        name = cls.__name__
        module = cls.__module__ or ""
        if name in _DDP_NAMES and module.startswith("torch."):
            return "ddp"
        if name in _FSDP_NAMES and module.startswith("torch."):
            return "fsdp"
        if name in _DEEPSPEED_NAMES and module.startswith("deepspeed"):
            return "deepspeed"
    return None


def distributed_state() -> tuple[bool, str | None]:
    """``(torch.distributed.is_initialized(), backend name or None)``; never raises."""
    torch = torch_or_none()
    if torch is None:
        return False, None
    try:
        dist: Any = torch.distributed
        if not dist.is_available() or not dist.is_initialized():
            return False, None
        backend = dist.get_backend()
    except Exception:
        return False, None
    return True, str(backend) if backend is not None else "unknown"


def torch_version() -> str | None:
    """``torch.__version__``, or ``None`` without torch."""
    torch = torch_or_none()
    if torch is None:
        return None
    try:
        return str(torch.__version__)
    except Exception:
        return None


_CHANGING = ("timestamp_unix_ns", "seq")
"""Item fields that differ on every item; the rest tells whether the environment changed."""


def runtime_environment_item(
    identity: RankIdentity, strategy_from_model: str | None, *, timestamp_unix_ns: int, seq: int
) -> RuntimeEnvironmentItem:
    """The ``runtime_environment`` item of the environment now (typed from the schema)."""
    initialized, backend = distributed_state()
    topology = topology_of(identity.world_size, identity.local_world_size)
    if strategy_from_model is not None:
        strategy, source, confidence = strategy_from_model, "runtime_model", "high"
    elif initialized:
        strategy, source, confidence = "distributed_unknown", "runtime_distributed", "low"
    elif topology == "single_process":
        strategy, source, confidence = "single_process", "topology", "high"
    else:
        # Several ranks but torch.distributed not (yet) up and no wrapper seen.
        strategy, source, confidence = "distributed_unknown", "topology", "low"
    layout = parallel_layout.current_layout()
    return {
        "timestamp_unix_ns": timestamp_unix_ns,
        "seq": seq,
        "topology": topology,
        "distributed_initialized": initialized,
        "distributed_backend": backend,
        "training_strategy": strategy,
        "strategy_source": source,
        "strategy_confidence": confidence,
        "torch_version": torch_version(),
        "python_version": platform.python_version(),
        # This rank's place in the parallel layout (rank._collectives.parallel_layout): null when unknown.
        "parallel": layout.item() if layout is not None else None,
        "parallel_source": layout.source if layout is not None else None,
    }


def environment_of(item: RuntimeEnvironmentItem) -> dict[str, object]:
    """The item without the fields that change on every item."""
    return {k: v for k, v in item.items() if k not in _CHANGING}
