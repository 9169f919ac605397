"""The rank SDK behind ``traceml_ai.init``/``trace_step``/``trace_phase``/``shutdown``,
``summary``/``final_summary`` and the ``wrap_*`` helpers.

Process-wide state lives here. Outside ``traceml run`` (no ``TRACEML_AGGREGATOR_ADDR``
and no sink passed) ``init()`` warns once and every call is a no-op. Calling
``trace_step``/``trace_phase`` before ``init()`` initializes with the defaults
(auto-init); note that the DataLoader wait before the first step is then missed,
because it happened before TraceML was installed. ``init`` takes TraceML 0.5.0's
keywords too (docs/compat-0.5.md).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import attrs

from traceml_ai import _environ, _fork
from traceml_ai.rank import _collectives, _wrappers
from traceml_ai.rank._event_names import INTERNAL_PREFIX
from traceml_ai.rank._init_config import (
    TraceMLInitConfig,
    TraceMLWarning,
    build_config,
    disabled_config,
    env_disabled,
    forget_warnings,
    notice_unsupported,
    resolve_on_missing_aggregator,
    trace_max_steps_from_env,
    warn_once,
)
from traceml_ai.rank._lazy import torch_or_none
from traceml_ai.rank._step_recorder import StepHistory, StepRecorder
from traceml_ai.rank._step_timer import (
    SHUTDOWN_GPU_WAIT_S,
    PhaseContext,
    StepContext,
    StepTimer,
)
from traceml_ai.rank._torch_patches import activate, active, install_patches
from traceml_ai.rank.gpu import CudaBackend, NvmlBackend, PynvmlBackend, TorchCudaBackend
from traceml_ai.rank.identity import RankIdentity
from traceml_ai.rank.runtime_env import (
    environment_of,
    model_strategy,
    runtime_environment_item,
)
from traceml_ai.rank.samplers import (
    ProcessSampler,
    SamplerThread,
    SystemSampler,
    sampler_interval_from_env,
)
from traceml_ai.rank.sink import EncodedItemSink, ItemSink
from traceml_ai.transport.wire import ENV_AGGREGATOR_ADDR, ENV_RUN_TOKEN

__all__ = ["TraceMLInitConfig", "TraceMLWarning"]

# Private test knob: the sender's per-stream queue bound (tests make ranks drop with it).
_ENV_TEST_MAX_PENDING = "_TRACEML_TEST_SENDER_MAX_PENDING_ITEMS"
# Set by `traceml run` (traceml_ai.launch.launcher) for the ranks of the aggregator's node.
_ENV_SUMMARY_FILE = _environ.SUMMARY_FILE
_DEFAULT_SERVE_PORT = 29600  # `traceml serve`'s default, for init(aggregator_host=...)


class _Sender(ItemSink, EncodedItemSink, Protocol):
    """What init's own sender (``transport.sender.RankSender``) offers the runtime."""

    @property
    def pending_items(self) -> int: ...

    def start(self) -> None: ...

    def close(self, timeout: float = 2.0) -> None: ...

    def set_producer(self, producer: Callable[[], None] | None) -> None: ...

    def wake(self) -> None: ...


_NULL: AbstractContextManager[None] = contextlib.nullcontext()
_lock = threading.RLock()
_state = "new"  # new | off | disabled | on | closed ("disabled": init(mode="off") was called)
_runtime: _Runtime | None = None
_config: TraceMLInitConfig | None = None
_process_hooks_installed = False
# This rank's steps, kept across init/shutdown for summary() (in-process figures).
_history: StepHistory | None = None


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
    seq_collectives: int = 0
    sender: _Sender | None = None


_carried = _Carried()


_warn_once = warn_once


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


def _on_timer_error(exc: BaseException) -> None:
    _warn_once(
        "timer",
        f"TraceML step timing failed and is now off for this run ({exc!r}); training continues.",
    )


def _on_collectives_error(exc: BaseException) -> None:
    _warn_once(
        "collectives",
        f"TraceML collective timing failed and is now off for this run ({exc!r}); step "
        "timing and training continue.",
    )


class _Guard:
    """Runs a component's work: its first failure turns the component off for the run,
    with one warning (training goes on)."""

    def __init__(self) -> None:
        self._broken: set[str] = set()

    def run(self, component: str, fn: Callable[[], object]) -> None:
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


class _EnvironmentReporter:
    """Sends this rank's ``runtime_environment`` item when it changes."""

    def __init__(self, identity: RankIdentity, sink: ItemSink, guard: _Guard, first_seq: int):
        self._identity = identity
        self._sink = sink
        self._guard = guard
        self._lock = threading.Lock()
        self._last: dict[str, object] | None = None
        self.next_seq = first_seq
        self._strategy: str | None = None

    @property
    def sent(self) -> bool:
        """Whether an item was sent."""
        return self._last is not None

    def report(self) -> None:
        """Send a ``runtime_environment`` item if it differs from the last one sent.

        Called when a traced step meets a model it has not seen (the strategy may
        change), and at shutdown only when nothing was sent yet: tearing down the
        process group at the end of a script is not a new environment.
        """
        with self._lock:
            item = runtime_environment_item(
                self._identity,
                self._strategy,
                timestamp_unix_ns=time.time_ns(),
                seq=self.next_seq,
            )
            environment = environment_of(item)
            if environment == self._last:
                return
            self._last = environment
            self.next_seq += 1
            self._sink.put("runtime_environment", item)

    def on_new_model(self, model: object) -> None:
        """The step timer met ``model`` for the first time."""
        strategy = model_strategy(model)
        if strategy is not None:
            self._strategy = strategy
        self._guard.run("runtime_environment", self.report)


class _Runtime:
    """Everything a running rank SDK owns: the step timer, samplers and the sink.

    Made by :func:`_make_runtime` with its collaborators; :meth:`start` installs the
    patches, makes its timer the active one and starts the sampler thread.
    """

    def __init__(
        self,
        *,
        identity: RankIdentity,
        config: TraceMLInitConfig,
        sink: ItemSink,
        sender: _Sender | None,
        timer: StepTimer,
        environment: _EnvironmentReporter,
        process: ProcessSampler,
        system: SystemSampler | None,
        guard: _Guard,
        cuda: CudaBackend,
        nvml: NvmlBackend,
        interval: float,
        carried_seq_system: int,
    ) -> None:
        self.identity = identity
        self.config = config
        self.sink = sink
        # init's own sender (None: a sink given to init), closed with the runtime.
        self.sender = sender
        self.timer = timer
        self.environment = environment
        self._process = process
        # Only local rank 0 reports the host, so a node's snapshot is sent once.
        self._system = system
        self._guard = guard
        self._cuda = cuda
        self._nvml = nvml
        self.interval = interval
        self._carried_seq_system = carried_seq_system
        self._thread = SamplerThread(interval, self._tick)

    def start(self) -> None:
        """Install what the config times, report to this runtime's timer, start sampling."""
        config = self.config
        torch = torch_or_none()
        if torch is not None:
            install_patches(
                torch,
                backward=config.patch_backward,
                optimizer=config.patch_optimizer,
                dataloader=config.patch_dataloader,
            )
            if config.patch_h2d:
                _wrappers.install_h2d_patch(torch)
            self._guard.run("collectives", self._install_collectives)
        _wrappers.set_auto_h2d(config.patch_h2d)
        if self.sender is not None:
            # The sender's thread builds the items of steps off CUDA (StepTimer.defer).
            self.sender.set_producer(self._build_steps)
        # runtime_environment is first sent when the first traced step begins: by
        # then the script has set up torch.distributed and wrapped its model, so a
        # rank usually sends exactly one line (see _EnvironmentReporter.report).
        activate(self.timer)
        _collectives.activate(self.timer.collectives)
        self._thread.start()

    def _install_collectives(self) -> None:
        import torch.distributed as dist

        if dist.is_available():
            _collectives.install(dist)

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
                if not item["gpus"]:
                    self._check_nvml()

    def _check_nvml(self) -> None:
        # A GPU host without nvidia-ml-py would silently report gpu_available false.
        # (Only the built-in backend loads a library; a backend given to init does not.)
        nvml = self._nvml
        error = nvml.load_error if isinstance(nvml, PynvmlBackend) else None
        if error and self._cuda.is_available():
            _warn_once(
                "nvml_missing",
                f"traceml: CUDA is available but NVML could not be loaded ({error}); "
                "system and system_gpu lines report no GPU. It needs nvidia-ml-py "
                "(`pip install nvidia-ml-py`; a dependency of traceml-ai on Linux) and "
                "the driver's libnvidia-ml.so.1 on the library path.",
            )

    def _build_steps(self) -> None:
        # On the sender's thread, even after a failure: steps that ended before it
        # still have their items. A failure here is reported once, as the timer's.
        timer = self.timer
        try:
            timer.build_ended()
        except Exception as exc:
            timer.fail(exc)

    def _poll_steps(self) -> None:
        timer = self.timer
        if timer.enabled:
            try:
                timer.poll()
            except Exception as exc:
                timer.fail(exc)

    def _tick(self) -> None:
        # The last step's line is sent once its CUDA events completed, within one
        # interval, not when (if ever) a next step ends.
        self._poll_steps()
        self._guard.run("process", self._sample_process)
        self._guard.run("system", self._sample_system)

    # -- shutdown -------------------------------------------------------------

    def counters(self) -> _Carried:
        """Where the counters stand, for the next runtime of this process (after close)."""
        return _Carried(
            step=self.timer.step,
            seq_step_time=self.timer.next_seq_time,
            seq_step_memory=self.timer.next_seq_mem,
            seq_process=self._process.next_seq,
            seq_system=(
                self._system.next_seq if self._system is not None else self._carried_seq_system
            ),
            seq_runtime_environment=self.environment.next_seq,
            seq_collectives=(
                self.timer.collectives.next_seq if self.timer.collectives is not None else 0
            ),
            sender=self.sender,
        )

    def close(self) -> None:
        """Flush pending steps, take final samples and close the sender."""
        if active() is self.timer:
            activate(None)
        if _collectives.active() is self.timer.collectives:
            _collectives.activate(None)
        timer = self.timer
        if timer.enabled:
            try:
                # The only wait for the GPU TraceML ever does: resolve the last
                # steps' CUDA events so their step_time items are not lost.
                timer.drain(sync=True)
            except Exception as exc:
                timer.fail(exc)
        else:
            self._build_steps()
        if timer.collectives is not None:
            with contextlib.suppress(Exception):
                timer.collectives.flush()
        timer.enabled = False
        if self._thread.stop(timeout=max(2.0, self.interval)):
            # One more sample so that even a short run has process/system lines;
            # only when the thread has ended, so seq stays monotonic.
            self._tick()
        if not self.environment.sent:
            self._guard.run("runtime_environment", self.environment.report)
        with contextlib.suppress(Exception):
            self._nvml.close()
        if self.sender is not None:
            try:
                self.sender.close(timeout=2.0)
            except Exception as exc:
                _warn_once("sender", f"TraceML could not close its sender cleanly ({exc!r}).")


def _make_runtime(
    *,
    identity: RankIdentity,
    config: TraceMLInitConfig,
    sink: ItemSink,
    sender: _Sender | None,
    cuda: CudaBackend,
    nvml: NvmlBackend,
    interval: float,
    carried: _Carried,
    history: StepHistory,
    max_steps: int | None,
    reset_peak_memory: bool,
) -> _Runtime:
    """A runtime and its collaborators, each given what it works with.

    Step items go through a recorder (summary() reads this rank's steps from
    ``history``). Steps off CUDA reach init's own sender encoded, built on its thread
    (the timer's ``encoded_sink`` and ``wake_builder``); a sink given to init gets
    dicts, as its ``put`` is documented to.
    """
    guard = _Guard()
    environment = _EnvironmentReporter(
        identity, sink, guard, first_seq=carried.seq_runtime_environment
    )
    recorder = StepRecorder(sink, max_steps, history=history, encoded=sender)
    timer = StepTimer(
        recorder,
        cuda,
        environment.on_new_model,
        _on_timer_error,
        auto_forward=config.patch_forward,
        auto_backward=config.patch_backward,
        auto_optimizer=config.patch_optimizer,
        auto_dataloader=config.patch_dataloader,
        local_rank=identity.local_rank,
        reset_peak=reset_peak_memory,
        encoded_sink=recorder if sender is not None else None,
        wake_builder=sender.wake if sender is not None else None,
        step=carried.step,
        seq_time=carried.seq_step_time,
        seq_mem=carried.seq_step_memory,
    )
    timer.collectives = _collectives.CollectiveRecorder(
        timer,
        recorder,
        first_seq=carried.seq_collectives,
        on_error=_on_collectives_error,
        on_drop=lambda line: _warn_once("collectives_dropped", line),
    )
    process = ProcessSampler(
        cuda,
        lambda: timer.cuda_index,
        first_seq=carried.seq_process,
        local_rank=identity.local_rank,
    )
    system = SystemSampler(nvml, first_seq=carried.seq_system) if identity.local_rank == 0 else None
    return _Runtime(
        identity=identity,
        config=config,
        sink=sink,
        sender=sender,
        timer=timer,
        environment=environment,
        process=process,
        system=system,
        guard=guard,
        cuda=cuda,
        nvml=nvml,
        interval=interval,
        carried_seq_system=carried.seq_system,
    )


def _build_sender(identity: RankIdentity, previous: _Sender | None, address: str) -> _Sender:
    host, port = parse_address(address)
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
    sender: _Sender = module.RankSender((host, port), token, identity.to_wire(), **options)
    sender.start()
    return sender


_ENV_RESET_PEAK = _environ.RESET_PEAK_MEMORY
# Set by a rank when its TraceML starts: processes it starts through
# multiprocessing inherit it (spawn and forkserver copy the environment).
_ENV_RANK_PID = "_TRACEML_RANK_PID"


def _child_of_a_rank() -> bool:
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
    owner = os.environ.get(_ENV_RANK_PID, "").strip()
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


def _reset_peak_choice(keyword: bool | None) -> bool:
    """The init keyword, else ``TRACEML_RESET_PEAK_MEMORY`` (0/false/no/off: keep the peak)."""
    if keyword is not None:
        return bool(keyword)
    raw = os.environ.get(_ENV_RESET_PEAK, "").strip().lower()
    return raw not in ("0", "false", "no", "off")


def _after_fork_in_child() -> None:
    # A forked child (e.g. a DataLoader worker) must not report as this rank, nor
    # touch the parent's socket or sampler thread.
    global _runtime, _state
    _runtime = None
    _state = "closed"
    activate(None)
    _collectives.activate(None)


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
        if _child_of_a_rank():
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
        address = os.environ.get(ENV_AGGREGATOR_ADDR, "").strip()
        no_token = ""
        if not address and (aggregator_host is not None or aggregator_port is not None):
            host = aggregator_host or "127.0.0.1"
            port = aggregator_port if aggregator_port is not None else _DEFAULT_SERVE_PORT
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            if not os.environ.get(ENV_RUN_TOKEN, "").strip():
                # The aggregator refuses a rank without its token: nothing would arrive.
                no_token = address
                address = ""
        if sink is None and not address:
            _state = "off"
            _config = disabled_config(source=config.source)
            # Set by `traceml run` (traceml_ai.launch.launcher) when its aggregator did not start.
            unavailable = os.environ.get(_environ.AGGREGATOR_UNAVAILABLE, "").strip()
            if no_token:
                message = (
                    f"traceml: init(aggregator_host/aggregator_port) names {no_token}, but "
                    f"{ENV_RUN_TOKEN} is not set (`traceml serve` prints it); telemetry is off."
                )
            elif unavailable:
                message = (
                    f"traceml: the aggregator did not start ({unavailable}); "
                    "telemetry is off for this run."
                )
            else:
                message = (
                    "TraceML export is off: this script was not launched by `traceml run` "
                    f"({ENV_AGGREGATOR_ADDR} is not set); TraceML calls do nothing."
                )
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
        sender: _Sender | None = None
        try:
            if sink is None:
                sender = _build_sender(identity, _carried.sender, address)
                sink = sender
            runtime = _make_runtime(
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
                reset_peak_memory=_reset_peak_choice(reset_peak_memory),
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
        os.environ[_ENV_RANK_PID] = str(os.getpid())
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
    unchanged, and that step is discarded (not sent, not counted) as TraceML 0.5.0
    does: the next step gets its number, so step numbers stay consecutive.
    """
    # Every step: the running runtime without the call into _current() (auto-init).
    runtime = _runtime
    if runtime is None:
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
    global _state, _carried, _config, _history
    shutdown()
    with _lock:
        _state = "new"
        _carried = _Carried()
        _config = None
        _history = None
        forget_warnings()
        os.environ.pop(_ENV_RANK_PID, None)


# -- TraceML 0.5.0's end-of-run summaries -------------------------------------------------


def _flush_for_summary(runtime: _Runtime, deadline: float) -> None:
    """Send this rank's finished steps now: resolve pending CUDA events, empty the sender."""
    timer = runtime.timer
    with _lock:
        if timer.enabled and not timer.in_step:
            try:
                timer.drain(
                    sync=True, deadline=min(deadline, time.monotonic() + SHUTDOWN_GPU_WAIT_S)
                )
            except Exception as exc:
                timer.fail(exc)
    sender = runtime.sender
    if sender is None:
        return
    # The sender sends what is queued within its flush interval (a fraction of a second).
    while time.monotonic() < deadline and sender.pending_items > 0:
        time.sleep(0.02)


def final_summary(
    *,
    timeout_sec: float = 30.0,
    poll_interval_sec: float = 0.1,
    print_text: bool = False,
    rank0_only: bool = True,
) -> dict[str, Any] | None:
    """The run's summary so far: per-rank step time and phase figures, as a dict.

    ``None`` on ranks other than 0 when ``rank0_only`` (the default), and when
    TraceML is off in this process. Under ``traceml run`` with the jsonl exporter
    writing ``step_time``, it reads the run's ``step_time.jsonl`` (every rank): it
    sends this rank's finished steps and polls the file until its own last step is
    there, for at most ``timeout_sec`` (then the figures cover what was written, and
    ``complete`` is false). Other ranks may still be behind, so the final figures of
    a run are those read after it ended (the files' closing lines). With export off
    there are no files: the figures are this rank's own recent steps, and
    ``source`` says ``in_process``. ``print_text`` prints a few ``traceml:`` lines.
    Never raises for a missing aggregator or file: it says so once and returns what
    it has.
    """
    runtime = _runtime
    identity = runtime.identity if runtime is not None else RankIdentity.from_env()
    if rank0_only and identity.global_rank != 0:
        return None
    history = _history
    if history is None or (runtime is None and history.total_steps == 0):
        why = (
            "TraceML is disabled (disabled=True or TRACEML_DISABLED=1)"
            if _state == "disabled"
            else "TraceML did not run in this process"
        )
        _warn_once("summary_off", f"traceml: summary(): {why}; there is no summary")
        return None
    deadline = time.monotonic() + max(0.0, float(timeout_sec))
    if runtime is not None:
        _flush_for_summary(runtime, deadline)
    # The summary engine loads here, not with the rank SDK: most runs never ask.
    from traceml_ai.run_summary import in_process

    recent, total = history.snapshot()
    file_text = os.environ.get(_ENV_SUMMARY_FILE, "").strip()
    if file_text:
        reader, reached = in_process.wait_for_file(
            Path(file_text),
            identity.global_rank,
            history.last_step,
            deadline - time.monotonic(),
            float(poll_interval_sec),
        )
        notes: list[str] = []
        if not reached:
            notes.append(
                f"timed out after {timeout_sec:g} s waiting for rank {identity.global_rank}'s "
                f"step {history.last_step} in {file_text}; figures cover the steps written"
            )
            _warn_once("summary_timeout", f"traceml: summary(): {notes[-1]}")
        result = in_process.full_run_summary(Path(file_text), complete=reader.closed, notes=notes)
        if result is None:
            result = in_process.build_summary(
                reader.steps,
                source="export",
                complete=reader.closed,
                notes=notes,
                file=file_text,
            )
    else:
        steps = {identity.global_rank: dict(recent)}
        notes = [
            f"export of step_time is off: figures are rank {identity.global_rank}'s own "
            f"last {len(recent)} of {total} steps, measured in this process"
        ]
        result = in_process.build_summary(
            steps, source="in_process", complete=runtime is None, notes=notes
        )
    if print_text:
        print(in_process.text(result), flush=True)
    return result


def summary(
    *,
    timeout_sec: float = 30.0,
    poll_interval_sec: float = 0.1,
    print_text: bool = False,
    rank0_only: bool = True,
) -> dict[str, Any] | None:
    """:func:`final_summary` as a flat dict for experiment trackers (W&B, MLflow).

    Keys as TraceML 0.5.0 names them where the figure is the same
    (``traceml/step_time/step_time_ms``, ``.../forward_ms``, ``.../input_wait_ms``,
    ...): each is the mean over ranks of each rank's mean per step. ``None`` where
    :func:`final_summary` is ``None``.
    """
    from traceml_ai.run_summary import in_process

    return in_process.compact(
        final_summary(
            timeout_sec=timeout_sec,
            poll_interval_sec=poll_interval_sec,
            print_text=print_text,
            rank0_only=rank0_only,
        )
    )
