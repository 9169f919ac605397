"""The runtime of a started rank SDK: the step timer, the samplers and the sink, wired
together by :func:`make_runtime`, and what the next runtime of the process continues
from (:class:`Carried`).

``traceml_ai.rank._runtime.sdk`` owns the process-wide state and makes one of these per
``init``; nothing here reads that state.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import attrs

from traceml_ai.rank._collectives import parallel_layout
from traceml_ai.rank._collectives.recorder import CollectiveRecorder
from traceml_ai.rank._init_config import TraceMLInitConfig, warn_once
from traceml_ai.rank._lazy import torch_or_none
from traceml_ai.rank._patches import ddp, distributed, layout_hooks, wrappers
from traceml_ai.rank._patches.phase_hooks import activate, active, install_patches
from traceml_ai.rank._runtime.tracker_runs import TrackerRuns, watch_summary_writers
from traceml_ai.rank._timing.step_recorder import StepHistory, StepRecorder
from traceml_ai.rank._timing.step_timer import StepTimer
from traceml_ai.rank.gpu import CudaBackend, NvmlBackend, PynvmlBackend
from traceml_ai.rank.identity import RankIdentity
from traceml_ai.rank.runtime_env import (
    environment_of,
    model_strategy,
    runtime_environment_item,
)
from traceml_ai.rank.samplers import ProcessSampler, SamplerThread, SystemSampler
from traceml_ai.rank.sink import EncodedItemSink, ItemSink

__all__ = ["Carried", "EnvironmentReporter", "Guard", "Runtime", "Sender", "make_runtime"]

_warn_once = warn_once


class Sender(ItemSink, EncodedItemSink, Protocol):
    """What init's own sender (``transport.sender.RankSender``) offers the runtime."""

    @property
    def pending_items(self) -> int: ...

    def start(self) -> None: ...

    def close(self, timeout: float = 2.0) -> None: ...

    def set_producer(self, producer: Callable[[], None] | None) -> None: ...

    def wake(self) -> None: ...

    def note_tracker_runs(self, runs: Mapping[str, Mapping[str, str]]) -> None: ...


@attrs.define
class Carried:
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
    sender: Sender | None = None


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


class Guard:
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


class EnvironmentReporter:
    """Sends this rank's ``runtime_environment`` item when it changes."""

    def __init__(self, identity: RankIdentity, sink: ItemSink, guard: Guard, first_seq: int):
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

    def refresh_layout(self) -> None:
        """Send again when the parallel layout changed since the last item (a DeviceMesh
        made after it, a pipeline stage made at step 1, Megatron set up later); only
        after a first item, and never for a layout that went away (the process group
        torn down at the end of a script)."""
        last = self._last
        if last is None:
            return
        layout = parallel_layout.current_layout()
        if layout is None:
            return
        if last.get("parallel_source") == layout.source and last.get("parallel") == layout.item():
            return
        self.report()

    def on_new_model(self, model: object) -> None:
        """The step timer met ``model`` for the first time."""
        strategy = model_strategy(model)
        if strategy is not None:
            self._strategy = strategy
        self._guard.run("runtime_environment", self.report)


class Runtime:
    """Everything a running rank SDK owns: the step timer, samplers and the sink.

    Made by :func:`make_runtime` with its collaborators; :meth:`start` installs the
    patches, makes its timer the active one and starts the sampler thread.
    """

    def __init__(
        self,
        *,
        identity: RankIdentity,
        config: TraceMLInitConfig,
        sink: ItemSink,
        sender: Sender | None,
        timer: StepTimer,
        collectives: CollectiveRecorder,
        environment: EnvironmentReporter,
        process: ProcessSampler,
        system: SystemSampler | None,
        guard: Guard,
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
        # The collectives of each step: told of the timer's steps (timer.collectives),
        # reported to by the torch.distributed patches while this runtime runs.
        self.collectives = collectives
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
        # Rank 0 of a run with an aggregator tells it the tracker runs the script has
        # open, so that TraceML's figures go into the user's own run.
        self._tracker_runs = (
            TrackerRuns() if sender is not None and identity.global_rank == 0 else None
        )
        self._tracker_runs_told = False

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
                wrappers.install_h2d_patch(torch)
            self._guard.run("collectives", self._install_collectives)
            self._guard.run("parallel", layout_hooks.install)
        wrappers.set_auto_h2d(config.patch_h2d)
        if self._tracker_runs is not None:
            self._guard.run("tracker_runs", watch_summary_writers)
        if self.sender is not None:
            # The sender's thread builds the items of steps off CUDA (StepTimer.defer).
            self.sender.set_producer(self._build_steps)
        # runtime_environment is first sent when the first traced step begins: by
        # then the script has set up torch.distributed and wrapped its model, so a
        # rank usually sends exactly one line (see EnvironmentReporter.report).
        activate(self.timer)
        distributed.activate(self.collectives)
        self._thread.start()

    def _install_collectives(self) -> None:
        import torch.distributed as dist

        if dist.is_available():
            distributed.install(dist)
            ddp.install()

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
        self._guard.run("runtime_environment", self.environment.refresh_layout)
        if self._tracker_runs is not None:
            self._guard.run("tracker_runs", self._report_tracker_runs)

    def _report_tracker_runs(self) -> None:
        runs, sender = self._tracker_runs, self.sender
        if runs is None or sender is None:
            return
        # Told once after the first step even when there is no run: the aggregator
        # waits for this word before opening a run of TraceML's own (a script opens
        # its run before its first step).
        if runs.look() or (not self._tracker_runs_told and self.timer.step > 0):
            self._tracker_runs_told = True
            sender.note_tracker_runs(runs.runs)

    # -- shutdown -------------------------------------------------------------

    def counters(self) -> Carried:
        """Where the counters stand, for the next runtime of this process (after close)."""
        return Carried(
            step=self.timer.step,
            seq_step_time=self.timer.next_seq_time,
            seq_step_memory=self.timer.next_seq_mem,
            seq_process=self._process.next_seq,
            seq_system=(
                self._system.next_seq if self._system is not None else self._carried_seq_system
            ),
            seq_runtime_environment=self.environment.next_seq,
            seq_collectives=self.collectives.next_seq,
            sender=self.sender,
        )

    def close(self) -> None:
        """Flush pending steps, take final samples and close the sender."""
        if active() is self.timer:
            activate(None)
        if distributed.active() is self.collectives:
            distributed.activate(None)
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
        with contextlib.suppress(Exception):
            self.collectives.flush()
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


def make_runtime(
    *,
    identity: RankIdentity,
    config: TraceMLInitConfig,
    sink: ItemSink,
    sender: Sender | None,
    cuda: CudaBackend,
    nvml: NvmlBackend,
    interval: float,
    carried: Carried,
    history: StepHistory,
    max_steps: int | None,
    reset_peak_memory: bool,
) -> Runtime:
    """A runtime and its collaborators, each given what it works with.

    Step items go through a recorder (summary() reads this rank's steps from
    ``history``). Steps off CUDA reach init's own sender encoded, built on its thread
    (the timer's ``encoded_sink`` and ``wake_builder``); a sink given to init gets
    dicts, as its ``put`` is documented to.
    """
    guard = Guard()
    environment = EnvironmentReporter(
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
    collectives = CollectiveRecorder(
        timer,
        recorder,
        first_seq=carried.seq_collectives,
        on_error=_on_collectives_error,
        on_drop=lambda line: _warn_once("collectives_dropped", line),
    )
    timer.collectives = collectives
    process = ProcessSampler(
        cuda,
        lambda: timer.cuda_index,
        first_seq=carried.seq_process,
        local_rank=identity.local_rank,
    )
    system = SystemSampler(nvml, first_seq=carried.seq_system) if identity.local_rank == 0 else None
    return Runtime(
        identity=identity,
        config=config,
        sink=sink,
        sender=sender,
        timer=timer,
        collectives=collectives,
        environment=environment,
        process=process,
        system=system,
        guard=guard,
        cuda=cuda,
        nvml=nvml,
        interval=interval,
        carried_seq_system=carried.seq_system,
    )
