"""The rank side of TraceML: step timing, samplers and identity (never imports torch eagerly).

This package's names are its surface for the rest of ``traceml_ai`` (the top-level
API, the framework integrations, the testing helpers, the launcher): nothing outside
``rank`` imports one of its private modules. Each name loads on first use (PEP 562),
so that ``import traceml_ai.rank`` stays light:

* the GPU backends (``CudaBackend``, ``CudaEvent``, ``NvmlBackend``, ``GpuReading``),
  the identity (``RankIdentity``) and the sinks (``ItemSink``, ``RecordingSink``);
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

from traceml_ai._lazy_names import lazy_surface

TYPE_CHECKING = False
if TYPE_CHECKING:  # the names of _LAZY, for mypy and editors (tests/traceml_ai/test_surfaces.py)
    from traceml_ai.rank._init_config import ENV_DISABLED as ENV_DISABLED
    from traceml_ai.rank._init_config import TraceMLInitConfig as TraceMLInitConfig
    from traceml_ai.rank._init_config import TraceMLWarning as TraceMLWarning
    from traceml_ai.rank._init_config import build_config as build_config
    from traceml_ai.rank._init_config import env_disabled as env_disabled
    from traceml_ai.rank._init_config import warn_once as warn_once
    from traceml_ai.rank._patches.phase_hooks import activate as activate
    from traceml_ai.rank._patches.phase_hooks import active as active
    from traceml_ai.rank._patches.phase_hooks import (
        forward_timed_elsewhere as forward_timed_elsewhere,
    )
    from traceml_ai.rank._patches.phase_hooks import (
        resume_optimizer_hooks as resume_optimizer_hooks,
    )
    from traceml_ai.rank._patches.phase_hooks import (
        suspend_optimizer_hooks as suspend_optimizer_hooks,
    )
    from traceml_ai.rank._patches.wrappers import wrap_backward as wrap_backward
    from traceml_ai.rank._patches.wrappers import wrap_dataloader_fetch as wrap_dataloader_fetch
    from traceml_ai.rank._patches.wrappers import wrap_forward as wrap_forward
    from traceml_ai.rank._patches.wrappers import wrap_h2d as wrap_h2d
    from traceml_ai.rank._patches.wrappers import wrap_optimizer as wrap_optimizer
    from traceml_ai.rank._runtime.sdk import init as init
    from traceml_ai.rank._runtime.sdk import is_running as is_running
    from traceml_ai.rank._runtime.sdk import record_tokens as record_tokens
    from traceml_ai.rank._runtime.sdk import reset_for_tests as reset_for_tests
    from traceml_ai.rank._runtime.sdk import shutdown as shutdown
    from traceml_ai.rank._runtime.sdk import start as start
    from traceml_ai.rank._runtime.sdk import trace_phase as trace_phase
    from traceml_ai.rank._runtime.sdk import trace_step as trace_step
    from traceml_ai.rank._runtime.summaries import final_summary as final_summary
    from traceml_ai.rank._runtime.summaries import summary as summary
    from traceml_ai.rank._timing.event_names import BACKWARD as BACKWARD
    from traceml_ai.rank._timing.event_names import DATALOADER_NEXT as DATALOADER_NEXT
    from traceml_ai.rank._timing.event_names import FORWARD as FORWARD
    from traceml_ai.rank._timing.event_names import OPTIMIZER_STEP as OPTIMIZER_STEP
    from traceml_ai.rank._timing.step_timer import StepContext as StepContext
    from traceml_ai.rank._timing.step_timer import StepTimer as StepTimer
    from traceml_ai.rank.gpu import CudaBackend as CudaBackend
    from traceml_ai.rank.gpu import CudaEvent as CudaEvent
    from traceml_ai.rank.gpu import GpuReading as GpuReading
    from traceml_ai.rank.gpu import NvmlBackend as NvmlBackend
    from traceml_ai.rank.identity import RankIdentity as RankIdentity
    from traceml_ai.rank.sink import ItemSink as ItemSink
    from traceml_ai.rank.sink import RecordingSink as RecordingSink

_LAZY = {
    "traceml_ai.rank._init_config": (
        "ENV_DISABLED",
        "TraceMLInitConfig",
        "TraceMLWarning",
        "build_config",
        "env_disabled",
        "warn_once",
    ),
    "traceml_ai.rank._patches.phase_hooks": (
        "activate",
        "active",
        "forward_timed_elsewhere",
        "resume_optimizer_hooks",
        "suspend_optimizer_hooks",
    ),
    "traceml_ai.rank._patches.wrappers": (
        "wrap_backward",
        "wrap_dataloader_fetch",
        "wrap_forward",
        "wrap_h2d",
        "wrap_optimizer",
    ),
    "traceml_ai.rank._runtime.sdk": (
        "init",
        "is_running",
        "record_tokens",
        "reset_for_tests",
        "shutdown",
        "start",
        "trace_phase",
        "trace_step",
    ),
    "traceml_ai.rank._runtime.summaries": ("final_summary", "summary"),
    "traceml_ai.rank._timing.event_names": (
        "BACKWARD",
        "DATALOADER_NEXT",
        "FORWARD",
        "OPTIMIZER_STEP",
    ),
    "traceml_ai.rank._timing.step_timer": ("StepContext", "StepTimer"),
    "traceml_ai.rank.gpu": ("CudaBackend", "CudaEvent", "GpuReading", "NvmlBackend"),
    "traceml_ai.rank.identity": ("RankIdentity",),
    "traceml_ai.rank.sink": ("ItemSink", "RecordingSink"),
}

__all__, __getattr__, __dir__ = lazy_surface(__name__, _LAZY, globals())
