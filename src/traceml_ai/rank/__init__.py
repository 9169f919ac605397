"""The rank side of TraceML: step timing, samplers and identity (never imports torch eagerly).

This package's names are its surface for the rest of ``traceml_ai`` (the top-level
API, the framework integrations, the testing helpers, the launcher): nothing outside
``rank`` imports one of its private modules. The GPU backends, the identity and the
sinks load with the package; the rest loads on first use (PEP 562), so that
``import traceml_ai.rank`` stays light:

* the SDK: ``init``/``start``/``shutdown``, ``trace_step``/``trace_phase``, the
  summaries, the ``wrap_*`` helpers, ``is_running`` and ``reset_for_tests``;
* 0.5.0's ``init`` arguments: ``TraceMLInitConfig``, ``TraceMLWarning``,
  ``build_config``, ``env_disabled`` (``ENV_DISABLED``), ``warn_once``;
* what the integrations build on: the step timer (``StepTimer``, ``StepContext``),
  the timer the hooks report to (``active``, ``activate``), the hooks' switches
  (``forward_timed_elsewhere``, ``suspend_optimizer_hooks``,
  ``resume_optimizer_hooks``) and the built-in event names.
"""

from __future__ import annotations

from traceml_ai._lazy_names import lazy_getattr
from traceml_ai.rank.gpu import CudaBackend, CudaEvent, GpuReading, NvmlBackend
from traceml_ai.rank.identity import RankIdentity
from traceml_ai.rank.sink import ItemSink, RecordingSink

TYPE_CHECKING = False
if TYPE_CHECKING:
    from traceml_ai.rank._init_config import (
        ENV_DISABLED,
        TraceMLInitConfig,
        TraceMLWarning,
        build_config,
        env_disabled,
        warn_once,
    )
    from traceml_ai.rank._patches.phase_hooks import (
        activate,
        active,
        forward_timed_elsewhere,
        resume_optimizer_hooks,
        suspend_optimizer_hooks,
    )
    from traceml_ai.rank._patches.wrappers import (
        wrap_backward,
        wrap_dataloader_fetch,
        wrap_forward,
        wrap_h2d,
        wrap_optimizer,
    )
    from traceml_ai.rank._runtime.sdk import (
        init,
        is_running,
        record_tokens,
        reset_for_tests,
        shutdown,
        start,
        trace_phase,
        trace_step,
    )
    from traceml_ai.rank._runtime.summaries import final_summary, summary
    from traceml_ai.rank._timing.event_names import (
        BACKWARD,
        DATALOADER_NEXT,
        FORWARD,
        OPTIMIZER_STEP,
    )
    from traceml_ai.rank._timing.step_timer import StepContext, StepTimer

_LAZY = {
    **dict.fromkeys(
        ("BACKWARD", "DATALOADER_NEXT", "FORWARD", "OPTIMIZER_STEP"),
        "traceml_ai.rank._timing.event_names",
    ),
    **dict.fromkeys(
        (
            "ENV_DISABLED",
            "TraceMLInitConfig",
            "TraceMLWarning",
            "build_config",
            "env_disabled",
            "warn_once",
        ),
        "traceml_ai.rank._init_config",
    ),
    **dict.fromkeys(
        (
            "init",
            "is_running",
            "record_tokens",
            "reset_for_tests",
            "shutdown",
            "start",
            "trace_phase",
            "trace_step",
        ),
        "traceml_ai.rank._runtime.sdk",
    ),
    **dict.fromkeys(("StepContext", "StepTimer"), "traceml_ai.rank._timing.step_timer"),
    **dict.fromkeys(("final_summary", "summary"), "traceml_ai.rank._runtime.summaries"),
    **dict.fromkeys(
        (
            "activate",
            "active",
            "forward_timed_elsewhere",
            "resume_optimizer_hooks",
            "suspend_optimizer_hooks",
        ),
        "traceml_ai.rank._patches.phase_hooks",
    ),
    **dict.fromkeys(
        (
            "wrap_backward",
            "wrap_dataloader_fetch",
            "wrap_forward",
            "wrap_h2d",
            "wrap_optimizer",
        ),
        "traceml_ai.rank._patches.wrappers",
    ),
}

__getattr__ = lazy_getattr(__name__, _LAZY, globals())

__all__ = [
    "BACKWARD",
    "DATALOADER_NEXT",
    "ENV_DISABLED",
    "FORWARD",
    "OPTIMIZER_STEP",
    "CudaBackend",
    "CudaEvent",
    "GpuReading",
    "ItemSink",
    "NvmlBackend",
    "RankIdentity",
    "RecordingSink",
    "StepContext",
    "StepTimer",
    "TraceMLInitConfig",
    "TraceMLWarning",
    "activate",
    "active",
    "build_config",
    "env_disabled",
    "final_summary",
    "forward_timed_elsewhere",
    "init",
    "is_running",
    "record_tokens",
    "reset_for_tests",
    "resume_optimizer_hooks",
    "shutdown",
    "start",
    "summary",
    "suspend_optimizer_hooks",
    "trace_phase",
    "trace_step",
    "warn_once",
    "wrap_backward",
    "wrap_dataloader_fetch",
    "wrap_forward",
    "wrap_h2d",
    "wrap_optimizer",
]
