"""The rank SDK behind ``traceml_ai.init``/``trace_step``/``trace_phase``/``shutdown``.

Process-wide state lives here. Outside ``traceml run`` (no ``TRACEML_AGGREGATOR_ADDR``
and no sink passed) ``init()`` warns once and every call is a no-op. Calling
``trace_step``/``trace_phase`` before ``init()`` initializes with the defaults
(auto-init); note that the DataLoader wait before the first step is then missed,
because it happened before TraceML was installed.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import sys
import threading
import time
import warnings
from contextlib import AbstractContextManager
from types import FrameType
from typing import Any, Protocol

import attrs

from traceml_ai.rank._lazy import torch_or_none
from traceml_ai.rank._timing import (
    INTERNAL_PREFIX,
    PhaseContext,
    StepContext,
    StepTimer,
    activate,
    active,
    install_patches,
)
from traceml_ai.rank.gpu import CudaBackend, NvmlBackend, PynvmlBackend, TorchCudaBackend
from traceml_ai.rank.identity import RankIdentity
from traceml_ai.rank.runtime_env import model_strategy, runtime_environment_fields
from traceml_ai.rank.samplers import (
    ProcessSampler,
    SamplerThread,
    SystemSampler,
    sampler_interval_from_env,
)
from traceml_ai.rank.sink import ItemSink
from traceml_ai.wire import ENV_AGGREGATOR_ADDR, ENV_RUN_TOKEN

MODES = ("auto", "off")

# Private test knob: the sender's per-stream queue bound (tests make ranks drop with it).
_ENV_TEST_MAX_PENDING = "_TRACEML_TEST_SENDER_MAX_PENDING_ITEMS"


class TraceMLWarning(RuntimeWarning):
    """Category of every warning the rank SDK emits (filterable by users)."""


class _ClosableSink(ItemSink, Protocol):
    def start(self) -> None: ...

    def close(self, timeout: float = 2.0) -> None: ...


_NULL: AbstractContextManager[None] = contextlib.nullcontext()
_lock = threading.RLock()
_state = "new"  # new | off | disabled | on | closed ("disabled": init(mode="off") was called)
_runtime: _Runtime | None = None
_warned: set[str] = set()
_process_hooks_installed = False


@attrs.define
class _Carried:
    """What the next runtime of this process continues from after ``shutdown``.

    Step numbers and every stream's ``seq`` are part of record keys, so an ``init``
    after ``shutdown`` goes on counting instead of repeating keys (or letting ``seq``
    go back); the new sender continues the closed one's batch counts, so its
    ``finished`` message covers the drops of both.
    """

    step: int = 0
    seq_step_time: int = 0
    seq_step_memory: int = 0
    seq_process: int = 0
    seq_system: int = 0
    seq_runtime_environment: int = 0
    sender: Any = None


_carried = _Carried()


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside traceml_ai."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    # Blame the user's line (init/trace_step call or the hooked torch call), not ours.
    warnings.warn(message, TraceMLWarning, stacklevel=_user_stacklevel())


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


class _Runtime:
    """Everything a running rank SDK owns: the step timer, samplers and the sink."""

    def __init__(
        self,
        identity: RankIdentity,
        sink: ItemSink,
        owned: _ClosableSink | None,
        cuda: CudaBackend,
        nvml: NvmlBackend,
        interval: float,
        carried: _Carried,
    ) -> None:
        self.identity = identity
        self.sink = sink
        self._owned = owned
        self._cuda = cuda
        self._nvml = nvml
        self.interval = interval
        self._env_lock = threading.Lock()
        self._env_last: dict[str, object] | None = None
        self._env_seq = carried.seq_runtime_environment
        self._strategy: str | None = None
        self._broken: set[str] = set()
        self.timer = StepTimer(sink, cuda, self._on_new_model, self._on_timer_error)
        self.timer.continue_counts(carried.step, carried.seq_step_time, carried.seq_step_memory)
        self._seq_system = carried.seq_system
        torch = torch_or_none()
        if torch is not None:
            install_patches(torch)
        self._process = ProcessSampler(
            cuda, lambda: self.timer.cuda_index, first_seq=carried.seq_process
        )
        # Only local rank 0 reports the host, so a node's snapshot is sent once.
        self._system = (
            SystemSampler(nvml, first_seq=carried.seq_system) if identity.local_rank == 0 else None
        )
        # runtime_environment is first sent when the first traced step begins: by
        # then the script has set up torch.distributed and wrapped its model, so a
        # rank usually sends exactly one line (see report_runtime_environment).
        activate(self.timer)
        self._thread = SamplerThread(interval, self._tick)
        self._thread.start()

    # -- errors ---------------------------------------------------------------

    def _on_timer_error(self, exc: BaseException) -> None:
        _warn_once(
            "timer",
            f"TraceML step timing failed and is now off for this run ({exc!r}); training continues.",
        )

    def _guarded(self, component: str, fn: Any) -> None:
        if component in self._broken:
            return
        try:
            fn()
        except Exception as exc:
            self._broken.add(component)
            _warn_once(
                component,
                f"TraceML {component} sampling failed and is now off for this run ({exc!r}).",
            )

    # -- samplers -------------------------------------------------------------

    def _sample_process(self) -> None:
        item = self._process.sample()
        if item is not None:
            self.sink.put("process", item)

    def _sample_system(self) -> None:
        if self._system is not None:
            item = self._system.sample()
            if item is not None:
                self.sink.put("system", item)

    def _tick(self) -> None:
        self._guarded("process", self._sample_process)
        self._guarded("system", self._sample_system)

    def report_runtime_environment(self) -> None:
        """Send a ``runtime_environment`` item if it differs from the last one sent.

        Called when a traced step meets a model it has not seen (the strategy may
        change), and at shutdown only when nothing was sent yet: tearing down the
        process group at the end of a script is not a new environment.
        """
        with self._env_lock:
            fields = runtime_environment_fields(self.identity, self._strategy)
            if fields == self._env_last:
                return
            self._env_last = fields
            seq = self._env_seq
            self._env_seq = seq + 1
            self.sink.put(
                "runtime_environment", {"timestamp_unix_ns": time.time_ns(), "seq": seq, **fields}
            )

    def _on_new_model(self, model: object) -> None:
        strategy = model_strategy(model)
        if strategy is not None:
            self._strategy = strategy
        self._guarded("runtime_environment", self.report_runtime_environment)

    # -- shutdown -------------------------------------------------------------

    def counters(self) -> _Carried:
        """Where the counters stand, for the next runtime of this process (after close)."""
        return _Carried(
            step=self.timer.step,
            seq_step_time=self.timer.next_seq_time,
            seq_step_memory=self.timer.next_seq_mem,
            seq_process=self._process.next_seq,
            seq_system=self._system.next_seq if self._system is not None else self._seq_system,
            seq_runtime_environment=self._env_seq,
            sender=self._owned,
        )

    def close(self) -> None:
        """Flush pending steps, take final samples and close the sender."""
        if active() is self.timer:
            activate(None)
        timer = self.timer
        if timer.enabled:
            try:
                # The only wait for the GPU TraceML ever does: resolve the last
                # steps' CUDA events so their step_time items are not lost.
                timer.drain(sync=True)
            except Exception as exc:
                timer.fail(exc)
        timer.enabled = False
        if self._thread.stop(timeout=max(2.0, self.interval)):
            # One more sample so that even a short run has process/system lines;
            # only when the thread has ended, so seq stays monotonic.
            self._tick()
        if self._env_last is None:
            self._guarded("runtime_environment", self.report_runtime_environment)
        with contextlib.suppress(Exception):
            self._nvml.close()
        if self._owned is not None:
            try:
                self._owned.close(timeout=2.0)
            except Exception as exc:
                _warn_once("sender", f"TraceML could not close its sender cleanly ({exc!r}).")


def _build_sender(identity: RankIdentity, previous: Any) -> _ClosableSink:
    host, port = parse_address(os.environ[ENV_AGGREGATOR_ADDR])
    token = os.environ.get(ENV_RUN_TOKEN, "")
    # Imported here: only ranks launched by traceml need the transport.
    module: Any = importlib.import_module("traceml_ai.transport.sender")
    options: dict[str, Any] = {}
    if isinstance(previous, module.RankSender):
        options["counts_from"] = previous
    test_bound = os.environ.get(_ENV_TEST_MAX_PENDING, "").strip()
    if test_bound:
        with contextlib.suppress(ValueError):
            options["max_pending_items"] = max(1, int(test_bound))
    sender: _ClosableSink = module.RankSender((host, port), token, identity.to_wire(), **options)
    sender.start()
    return sender


def _after_fork_in_child() -> None:
    # A forked child (e.g. a DataLoader worker) must not report as this rank, nor
    # touch the parent's socket or sampler thread.
    global _runtime, _state
    _runtime = None
    _state = "closed"
    activate(None)


def _install_process_hooks() -> None:
    global _process_hooks_installed
    if _process_hooks_installed:
        return
    _process_hooks_installed = True
    atexit.register(shutdown)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)


def init(
    mode: str = "auto",
    *,
    sink: ItemSink | None = None,
    sampler_interval: float | None = None,
    cuda_backend: CudaBackend | None = None,
    nvml_backend: NvmlBackend | None = None,
) -> None:
    """Start TraceML on this rank.

    ``mode="auto"`` exports when the script was launched by ``traceml run`` (the
    launcher sets ``TRACEML_AGGREGATOR_ADDR``) or when ``sink`` is given; otherwise
    it warns once and every TraceML call is a no-op. ``mode="off"`` turns TraceML
    off silently, and a later ``init()`` in the same process then does nothing (an
    integration such as Ray's may turn TraceML off before the user's own ``init()``
    runs). ``sampler_interval`` overrides ``TRACEML_SAMPLER_INTERVAL`` (seconds).
    ``cuda_backend``/``nvml_backend`` replace the GPU access (tests pass fakes).
    Calling ``init`` again while running does nothing.
    """
    global _runtime, _state
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if sampler_interval is not None and not sampler_interval > 0:
        raise ValueError(f"sampler_interval must be positive; got {sampler_interval!r}")
    with _lock:
        if _runtime is not None or (_state == "disabled" and sink is None):
            return
        if mode == "off":
            _state = "disabled"
            return
        if sink is None and not os.environ.get(ENV_AGGREGATOR_ADDR, "").strip():
            _state = "off"
            # Set by `traceml run` (traceml_ai._launch) when its aggregator did not start.
            unavailable = os.environ.get("TRACEML_AGGREGATOR_UNAVAILABLE", "").strip()
            if unavailable:
                _warn_once(
                    "not_launched",
                    f"traceml: the aggregator did not start ({unavailable}); "
                    "telemetry is off for this run.",
                )
                return
            _warn_once(
                "not_launched",
                "TraceML export is off: this script was not launched by `traceml run` "
                f"({ENV_AGGREGATOR_ADDR} is not set); TraceML calls do nothing.",
            )
            return
        identity = RankIdentity.from_env()
        interval = sampler_interval or sampler_interval_from_env()
        owned: _ClosableSink | None = None
        try:
            if sink is None:
                owned = _build_sender(identity, _carried.sender)
                sink = owned
            runtime = _Runtime(
                identity,
                sink,
                owned,
                cuda_backend if cuda_backend is not None else TorchCudaBackend(),
                nvml_backend if nvml_backend is not None else PynvmlBackend(),
                interval,
                _carried,
            )
        except Exception as exc:
            if owned is not None:
                with contextlib.suppress(Exception):
                    owned.close(timeout=0.5)
            _state = "off"
            _warn_once(
                "start_failed",
                f"TraceML could not start ({exc!r}); export is off and training continues.",
            )
            return
        _runtime = runtime
        _state = "on"
        _install_process_hooks()


def _current() -> _Runtime | None:
    runtime = _runtime
    if runtime is None and _state == "new":
        init()
        runtime = _runtime
    return runtime


def trace_step(model: object | None = None) -> AbstractContextManager[None]:
    """Context manager around one training step.

    Inside it, the model's forward (hooks on ``model``; a DDP wrapper or its
    ``.module`` both work), ``backward()`` and ``optimizer.step()`` are timed, and
    the DataLoader wait since the previous step is attributed to this step. The
    step is numbered from 1. An exception raised inside the block propagates
    unchanged; the step is still recorded with the phases that completed.
    """
    runtime = _current()
    if runtime is None:
        return _NULL
    return StepContext(runtime.timer, model)


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


def _reset_for_tests() -> None:
    """Shut down and forget all process-wide state, including warn-once flags."""
    global _state, _carried
    shutdown()
    with _lock:
        _state = "new"
        _carried = _Carried()
        _warned.clear()
