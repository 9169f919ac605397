"""The rank side of TraceML: step timing, samplers and identity (never imports torch eagerly)."""

from traceml_ai.rank.gpu import CudaBackend, CudaEvent, GpuReading, NvmlBackend
from traceml_ai.rank.identity import RankIdentity
from traceml_ai.rank.sink import ItemSink, RecordingSink

__all__ = [
    "CudaBackend",
    "CudaEvent",
    "GpuReading",
    "ItemSink",
    "NvmlBackend",
    "RankIdentity",
    "RecordingSink",
]
