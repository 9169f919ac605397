"""The rank SDK's process-wide state and its calls: ``init``/``start``/``shutdown`` and
``trace_step``/``trace_phase`` (``traceml_ai.rank`` is their surface).

Outside ``traceml run`` (no ``TRACEML_AGGREGATOR_ADDR`` and no sink passed) ``init()``
warns once and every call is a no-op. Calling ``trace_step``/``trace_phase`` before
``init()`` initializes with the defaults (auto-init); note that the DataLoader wait
before the first step is then missed, because it happened before TraceML was
installed. ``init`` takes TraceML 0.5.0's keywords too (docs/compat-0.5.md).

The rest of the SDK lives beside it: the runtime one ``init`` starts (``runtime``),
where a rank sends (``connect``), the end-of-run summaries (``summaries``); 0.5.0's
arguments are ``rank._init_config``, the ``wrap_*`` helpers ``rank._patches.wrappers``.
"""

from __future__ import annotations

import atexit
import contextlib
import operator
import os
import threading
from contextlib import AbstractContextManager
from typing import Any

from traceml_ai import _environ, _fork
from traceml_ai.rank._init_config import (
    TraceMLInitConfig,
    build_config,
    disabled_config,
    env_disabled,
    forget_warnings,
    notice_unsupported,
    reset_peak_choice,
    resolve_on_missing_aggregator,
    trace_max_steps_from_env,
    warn_once,
)
from traceml_ai.rank._patches import distributed
from traceml_ai.rank._patches.phase_hooks import activate
from traceml_ai.rank._runtime.connect import (
    ENV_RANK_PID,
    aggregator_address,
    build_sender,
    child_of_a_rank,
    mark_rank_process,
    off_message,
)
from traceml_ai.rank._runtime.runtime import Carried, Runtime, Sender, make_runtime
from traceml_ai.rank._timing.event_names import INTERNAL_PREFIX
from traceml_ai.rank._timing.step_recorder import StepHistory
from traceml_ai.rank._timing.step_timer import PhaseContext, StepContext, StepTimer
from traceml_ai.rank.gpu import CudaBackend, NvmlBackend, PynvmlBackend, TorchCudaBackend
from traceml_ai.rank.identity import RankIdentity
from traceml_ai.rank.samplers import sampler_interval_from_env
from traceml_ai.rank.sink import ItemSink

__all__ = [
    "init",
    "is_running",
    "record_tokens",
    "reset_for_tests",
    "shutdown",
    "start",
    "trace_phase",
    "trace_step",
]

# Set by `traceml run` (traceml_ai.launch.launcher) for the ranks of the aggregator's node.
_ENV_SUMMARY_FILE = _environ.SUMMARY_FILE

_NULL: AbstractContextManager[None] = contextlib.nullcontext()
_lock = threading.RLock()
_state = "new"  # new | off | disabled | on | closed ("disabled": init(mode="off") was called)
_runtime: Runtime | None = None
_config: TraceMLInitConfig | None = None
_process_hooks_installed = False
# This rank's steps, kept across init/shutdown for summary() (in-process figures).
_history: StepHistory | None = None
_carried = Carried()

_warn_once = warn_once


def is_running() -> bool:
    """Whether a runtime is started in this process (``init`` ran and exports)."""
    return _runtime is not None


def _after_fork_in_child() -> None:
    # A forked child (e.g. a DataLoader worker) must not report as this rank, nor
    # touch the parent's socket or sampler thread.
    global _runtime, _state
    _runtime = None
    _state = "closed"
    activate(None)
    distributed.activate(None)


def _install_process_hooks() -> None:
    global _process_hooks_installed
    if _process_hooks_installed:
        return
    _process_hooks_installed = True
    atexit.register(shutdown)
    _fork.on_fork_in_child(_after_fork_in_child)


def init(
    mode: str = "auto",
    *,
    patch_dataloader: bool | None = None,
    patch_forward: bool | None = None,
    patch_backward: bool | None = None,
    patch_h2d: bool | None = None,
    disabled: bool | None = None,
    ui_mode: str | None = None,
    interval: float | None = None,
    logs_dir: str | None = None,
    enable_logging: bool | None = None,
    session_id: str | None = None,
    aggregator_host: str | None = None,
    aggregator_port: int | None = None,
    connect_timeout_sec: float = 10.0,
    connect_retry_interval_sec: float = 0.25,
    on_missing_aggregator: str | None = None,
    sink: ItemSink | None = None,
    sampler_interval: float | None = None,
    cuda_backend: CudaBackend | None = None,
    nvml_backend: NvmlBackend | None = None,
    reset_peak_memory: bool | None = None,
) -> TraceMLInitConfig:
    """Start TraceML on this rank; returns what was set up (TraceML 0.5.0's config).

    ``mode="auto"`` times forward, backward, the optimizer step, DataLoader waits and
    host-to-device copies automatically; ``"manual"`` times nothing automatically
    (use the ``wrap_*`` helpers); ``"selective"`` (alias ``"custom"``) times what its
    ``patch_*`` choices switch on (the optimizer step only through
    ``wrap_optimizer``). ``mode="off"`` turns TraceML off silently, and a later
    ``init()`` in the same process then does nothing (an integration such as Ray's
    may turn TraceML off before the user's own ``init()`` runs). ``disabled=True`` or
    ``TRACEML_DISABLED=1`` turns everything off too.

    TraceML exports when the script was launched by ``traceml run`` (the launcher
    sets ``TRACEML_AGGREGATOR_ADDR``), when ``aggregator_host``/``aggregator_port``
    name a ``traceml serve`` (with its ``TRACEML_RUN_TOKEN`` in the environment) or
    when ``sink`` is given; otherwise it warns once and every TraceML call is a
    no-op, or raises ``RuntimeError`` with ``on_missing_aggregator="raise"`` (or
    ``TRACEML_ON_MISSING_AGGREGATOR=raise``).

    ``interval`` / ``sampler_interval`` override ``TRACEML_SAMPLER_INTERVAL``
    (seconds). ``ui_mode``, ``logs_dir``, ``enable_logging`` and ``session_id`` have no
    effect here and say so once; ``connect_timeout_sec`` and
    ``connect_retry_interval_sec`` are accepted (the sender never blocks training,
    so there is no connection wait to bound). ``cuda_backend``/``nvml_backend``
    replace the GPU access (tests pass fakes). ``reset_peak_memory=False`` (or
    ``TRACEML_RESET_PEAK_MEMORY=0``) leaves CUDA's peak-memory counters alone, so
    the script's own ``torch.cuda.max_memory_allocated()`` keeps its meaning; the
    step_memory peaks are then null. A bad ``mode`` or ``patch_*``
    combination raises ``ValueError``, as in 0.5.0. Calling ``init`` again while
    running returns the running config (with a warning if this call asked for a
    different one).
    """
    global _runtime, _state, _config, _history
    off = disabled if disabled is not None else env_disabled()
    # Checked only when on, as 0.5.0 does: a disabled run never fails on its arguments.
    config = (
        disabled_config()
        if off
        else build_config(
            mode,
            patch_dataloader=patch_dataloader,
            patch_forward=patch_forward,
            patch_backward=patch_backward,
            patch_h2d=patch_h2d,
        )
    )
    policy = resolve_on_missing_aggregator(on_missing_aggregator)
    if sampler_interval is None and interval is not None:
        sampler_interval = interval
    if sampler_interval is not None and not sampler_interval > 0:
        raise ValueError(f"sampler_interval must be positive; got {sampler_interval!r}")
    notice_unsupported(
        ui_mode=ui_mode, logs_dir=logs_dir, enable_logging=enable_logging, session_id=session_id
    )
    with _lock:
        if _runtime is not None:
            if _config is not None and not _config.same_effective_configuration(config):
                _warn_once(
                    "reinit",
                    f"traceml: init(mode={config.mode!r}) is ignored: TraceML is already "
                    f"running in this process with mode={_config.mode!r}",
                )
            return _config if _config is not None else config
        if _state == "disabled" and sink is None:
            return _config if _config is not None else disabled_config("off")
        if child_of_a_rank():
            # A DataLoader worker (spawn/forkserver) re-importing the script: the
            # rank that started it reports; this process stays off, silently
            # (one message per worker and epoch would only be noise).
            _state = "off"
            _config = disabled_config(source=config.source)
            return _config
        if config.disabled:
            _state = "disabled"
            _config = config
            return config
        address, no_token = aggregator_address(aggregator_host, aggregator_port)
        if sink is None and not address:
            _state = "off"
            _config = disabled_config(source=config.source)
            message = off_message(no_token)
            if policy == "raise":
                raise RuntimeError(message + " (on_missing_aggregator='raise')")
            _warn_once("not_launched", message)
            return _config
        identity = RankIdentity.from_env()
        interval_s = sampler_interval or sampler_interval_from_env()
        if _history is None:
            # summary() reads the run's step_time.jsonl when the launcher named it: this
            # rank's own events are then never read, and not kept.
            _history = StepHistory(keep_events=not os.environ.get(_ENV_SUMMARY_FILE, "").strip())
        sender: Sender | None = None
        try:
            if sink is None:
                sender = build_sender(identity, _carried.sender, address)
                sink = sender
            runtime = make_runtime(
                identity=identity,
                config=config,
                sink=sink,
                sender=sender,
                cuda=cuda_backend if cuda_backend is not None else TorchCudaBackend(),
                nvml=nvml_backend if nvml_backend is not None else PynvmlBackend(),
                interval=interval_s,
                carried=_carried,
                history=_history,
                max_steps=trace_max_steps_from_env(),
                reset_peak_memory=reset_peak_choice(reset_peak_memory),
            )
            runtime.start()
        except Exception as exc:
            if sender is not None:
                with contextlib.suppress(Exception):
                    sender.close(timeout=0.5)
            _state = "off"
            _config = disabled_config(source=config.source)
            message = f"TraceML could not start ({exc!r}); export is off and training continues."
            if policy == "raise":
                raise RuntimeError(message + " (on_missing_aggregator='raise')") from exc
            _warn_once("start_failed", message)
            return _config
        _runtime = runtime
        _state = "on"
        _config = config
        # Before the script starts DataLoader workers: they inherit it.
        mark_rank_process()
        _install_process_hooks()
        return config


def start(
    *,
    mode: str = "auto",
    patch_dataloader: bool | None = None,
    patch_forward: bool | None = None,
    patch_backward: bool | None = None,
    patch_h2d: bool | None = None,
    disabled: bool | None = None,
    ui_mode: str | None = None,
    interval: float | None = None,
    logs_dir: str | None = None,
    enable_logging: bool | None = None,
    session_id: str | None = None,
    aggregator_host: str | None = None,
    aggregator_port: int | None = None,
    connect_timeout_sec: float = 10.0,
    connect_retry_interval_sec: float = 0.25,
    on_missing_aggregator: str | None = None,
) -> TraceMLInitConfig:
    """TraceML 0.5.0's alias of :func:`init` (same keywords, same result)."""
    return init(
        mode,
        patch_dataloader=patch_dataloader,
        patch_forward=patch_forward,
        patch_backward=patch_backward,
        patch_h2d=patch_h2d,
        disabled=disabled,
        ui_mode=ui_mode,
        interval=interval,
        logs_dir=logs_dir,
        enable_logging=enable_logging,
        session_id=session_id,
        aggregator_host=aggregator_host,
        aggregator_port=aggregator_port,
        connect_timeout_sec=connect_timeout_sec,
        connect_retry_interval_sec=connect_retry_interval_sec,
        on_missing_aggregator=on_missing_aggregator,
    )


def _current() -> Runtime | None:
    runtime = _runtime
    if runtime is None and _state == "new":
        init()
        runtime = _runtime
    return runtime


_LATER = object()
"""A token count on an accelerator: read when the step's item is built."""


def _token_count(n: object, what: str) -> tuple[int | object, object] | None:
    """``n`` as tokens: ``(count, None)`` for a whole number >= 0 (an int, a numpy or
    CPU 0-d tensor integer), ``(_LATER, n)`` for a 0-d tensor on an accelerator (read
    off the training thread, never synchronizing the device here), None for anything
    else (one warning, the count left out: training goes on)."""
    if not isinstance(n, bool):
        try:
            value = operator.index(n)  # type: ignore[arg-type]
        except TypeError:
            value = None
            device = getattr(getattr(n, "device", None), "type", None)
            if device not in (None, "cpu") and getattr(n, "ndim", None) == 0:
                return _LATER, n
            item = getattr(n, "item", None)
            if callable(item) and getattr(n, "ndim", 0) == 0:
                try:
                    read = item()
                except Exception:
                    read = None
                if isinstance(read, int) and not isinstance(read, bool):
                    value = read
        if value is not None and value >= 0:
            return value, None
    _warn_once(
        f"bad_tokens:{what}",
        f"traceml: {what} takes a whole number >= 0 (an int or a 0-d integer tensor); "
        f"got {type(n).__name__} {str(n)[:40]!r}: this count is left out",
    )
    return None


def _add_tokens(timer: StepTimer, found: tuple[int | object, object]) -> bool:
    count, later = found
    if count is _LATER:
        return timer.record_tokens_later(later)
    assert isinstance(count, int)
    return timer.record_tokens(count)


class _TokensStep:
    """``trace_step(model, tokens=N)``: the step, and its ``N`` tokens once it began."""

    __slots__ = ("_step", "_timer", "_tokens")

    def __init__(
        self,
        step: AbstractContextManager[None],
        timer: StepTimer,
        tokens: tuple[int | object, object],
    ) -> None:
        self._step = step
        self._timer = timer
        self._tokens = tokens

    def __enter__(self) -> None:
        self._step.__enter__()
        timer = self._timer
        if timer.enabled:
            try:
                _add_tokens(timer, self._tokens)
            except Exception as exc:
                timer.fail(exc)

    def __exit__(self, *exc: Any) -> None:
        self._step.__exit__(*exc)


def trace_step(
    model: object | None = None, *, tokens: int | None = None
) -> AbstractContextManager[None]:
    """Context manager around one training step.

    Inside it, the model's forward (hooks on ``model``; a DDP wrapper or its
    ``.module`` both work), ``backward()`` and ``optimizer.step()`` are timed, and
    the DataLoader wait since the previous step is attributed to this step. The
    step is numbered from 1. An exception raised inside the block propagates
    unchanged, and that step is discarded (not sent, not counted) as TraceML 0.5.0
    does: the next step gets its number, so step numbers stay consecutive.

    ``tokens``: the tokens (or sequence elements) the step processes, a whole number
    >= 0 or a 0-d integer tensor (on a GPU it is read after the step, never waited
    for); the step's ``step_time`` line carries it (``record_tokens`` adds to it from
    inside the step). Anything else is one warning and no count.
    """
    # Every step: the running runtime without the call into _current() (auto-init).
    runtime = _runtime
    if runtime is None:
        runtime = _current()
        if runtime is None:
            return _NULL
    if tokens is not None:
        found = _token_count(tokens, "trace_step(tokens=...)")
        if found is not None:
            return _TokensStep(StepContext(runtime.timer, model), runtime.timer, found)
    return StepContext(runtime.timer, model)


def record_tokens(n: int) -> None:
    """Add ``n`` tokens to the traced step open now (for when the batch is known only
    inside the step); its ``step_time`` line carries the step's total. Outside a traced
    step (or without TraceML) nothing is kept."""
    runtime = _runtime
    if runtime is None:
        return
    timer = runtime.timer
    if not timer.enabled:
        return
    found = _token_count(n, "record_tokens(n)")
    if found is None:
        return
    try:
        kept = _add_tokens(timer, found)
    except Exception as exc:
        timer.fail(exc)
        return
    if not kept:
        _warn_once(
            "record_tokens_outside",
            "traceml: record_tokens() outside a traced step (or on another thread than "
            "the step's) is not counted; call it inside `with traceml.trace_step(...)`",
        )


def trace_phase(name: str) -> AbstractContextManager[None]:
    """Context manager timing a user-named phase.

    Inside a traced step it is part of that step; outside one it counts toward
    the next step that begins. ``name`` must be non-empty and must not start with
    ``_traceml_internal:`` (ValueError).
    """
    if not isinstance(name, str):
        raise TypeError(f"phase name must be a str; got {type(name).__name__}")
    if not name or name.startswith(INTERNAL_PREFIX):
        raise ValueError(f"phase name must be non-empty and not start with {INTERNAL_PREFIX!r}")
    runtime = _current()
    if runtime is None:
        return _NULL
    return PhaseContext(runtime.timer, name)


def shutdown() -> None:
    """Send what is pending, take final samples and close the connection; idempotent.

    Registered with ``atexit`` by ``init``. Afterwards every call is a no-op until
    ``init`` is called again, which continues the step numbers and ``seq`` counters.
    """
    global _runtime, _state, _carried
    with _lock:
        runtime = _runtime
        _runtime = None
        _state = "closed"
        if runtime is None:
            return
        # Under the lock: an ``init`` racing this shutdown must start from the final
        # counters, which are known only once the last steps and samples are sent.
        try:
            runtime.close()
        finally:
            _carried = runtime.counters()


def reset_for_tests() -> None:
    """Shut down and forget all process-wide state, including warn-once flags."""
    global _state, _carried, _config, _history
    shutdown()
    with _lock:
        _state = "new"
        _carried = Carried()
        _config = None
        _history = None
        forget_warnings()
        os.environ.pop(ENV_RANK_PID, None)
