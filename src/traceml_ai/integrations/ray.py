"""TraceML for Ray Train: ``TraceMLTorchTrainer`` and ``TraceMLRayConfig``.

::

    from ray.train import ScalingConfig
    from traceml_ai.integrations.ray import TraceMLRayConfig, TraceMLTorchTrainer

    trainer = TraceMLTorchTrainer(
        train_loop_per_worker,  # uses traceml.trace_step(model) as usual
        scaling_config=ScalingConfig(num_workers=2),
        traceml_config=TraceMLRayConfig(exporter="jsonl"),
    )
    result = trainer.fit()

``fit()`` runs one TraceML aggregator for the job as a Ray actor on the driver's node,
points every worker at it (on a job whose workers span several nodes, at a relay on
their own node that forwards their batches over one connection), wraps each worker's loop in ``traceml.init()`` /
``traceml.shutdown()``, runs Ray's ``TorchTrainer`` and, whether training succeeded or
not, finalizes the export (closing lines, ``finalization_warning.json``) and kills
the actor. Settings come only from ``TraceMLRayConfig``: no ``TRACEML_*`` variable
and no ``traceml.yaml`` is read.

Importing this module needs Ray Train: ``pip install 'traceml-ai[ray]'``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import shlex
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from traceml_ai.integrations._common import not_installed

# Ray is held as ``Any``: its bundled hints are partial under ``mypy --strict``, and a
# checkout without the extra sees it as ``Any`` anyway, so both type-check alike.
try:
    ray: Any = importlib.import_module("ray")
    importlib.import_module("ray.train")
    importlib.import_module("ray.util")
    TorchTrainer: Any = importlib.import_module("ray.train.torch").TorchTrainer
    NodeAffinitySchedulingStrategy: Any = importlib.import_module(
        "ray.util.scheduling_strategies"
    ).NodeAffinitySchedulingStrategy
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess test
    raise not_installed("ray", "Ray Train", "ray", _exc) from _exc

import traceml_ai as traceml
from traceml_ai import _environ
from traceml_ai._converter import unstructure
from traceml_ai._limits import END_OF_RUN_SUMMARY_MAX_BYTES
from traceml_ai.aggregator import Aggregator, AggregatorConfig, tune_gc_for_aggregator
from traceml_ai.aggregator.protocol import RayExportSummary
from traceml_ai.integrations._ray_config import TraceMLRayConfig
from traceml_ai.launch.launcher import default_run_name, report_export_off
from traceml_ai.settings import ExportSettings, MonitorSettings, parse_parallel
from traceml_ai.transport import Relay
from traceml_ai.transport.wire import (
    ENV_AGGREGATOR_ADDR,
    ENV_RUN_TOKEN,
    ENV_SAMPLER_INTERVAL,
    new_run_token,
)

__all__ = ["AggregatorEndpoint", "TraceMLRayConfig", "TraceMLRayRun", "TraceMLTorchTrainer"]

TrainLoop = Callable[[dict[str, Any]], Any]
"""A ``train_loop_per_worker`` taking Ray Train's config (TraceML 0.5.0's alias)."""

ACTOR_NAME_PREFIX = "traceml-aggregator-"
"""The aggregator actor of a run is named ``traceml-aggregator-<session_id>``."""

AGGREGATOR_START_TIMEOUT_S = 60.0
"""How long a worker waits for the aggregator actor to listen before training without it."""

RELAY_START_TIMEOUT_S = 30.0
"""How long the aggregator actor waits for a node's relay actor to listen; past it, that
node's workers send to the aggregator themselves."""

RELAY_MAX_RESTARTS = 3
"""Times Ray restarts a node's relay actor that died (its process killed or crashed):
the new one listens on the port its node's workers already send to, so they reconnect
on their own. What the dead one held is lost and reported from the ranks' counts."""

RELAY_PORT_ASK_TIMEOUT_S = 30.0
"""How long a restarted relay actor waits for the aggregator actor to name its port."""

_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
# Extra seconds, beyond the aggregator's own bounds, to wait for the actor to answer.
_ACTOR_CALL_MARGIN_S = 30.0


def _say(message: str) -> None:
    print(f"traceml: {message}", file=sys.stderr, flush=True)


# -- the aggregator actor (runs on the driver's node) ------------------------------------


class _AggregatorActor:
    """One run's :class:`Aggregator`, hosted in a Ray actor."""

    def __init__(
        self,
        run_dir: str,
        settings: ExportSettings,
        token: str,
        bind_host: str,
        port: int,
        expected_world_size: int | None,
        finalize_timeout_sec: float,
        monitor: MonitorSettings | None = None,
    ) -> None:
        tune_gc_for_aggregator()  # the actor's process hosts the aggregator alone
        self._token = token
        self._address: tuple[str, int] | None = None
        # The nodes' relay actors by node id, their ports, and why a node's did not start.
        self._relays: dict[str, Any] = {}
        self._relay_ports: dict[str, int] = {}
        self._relay_errors: dict[str, str] = {}
        self._aggregator = Aggregator(
            AggregatorConfig(
                run_dir=Path(run_dir),
                settings=settings,
                token=token,
                bind_host=bind_host,
                port=port,
                expected_world_size=expected_world_size,
                finalize_timeout_sec=finalize_timeout_sec,
                monitor=monitor or MonitorSettings(),
            )
        )

    def start(self) -> tuple[str, int]:
        """Open the export files and listen; the address workers should connect to."""
        config = self._aggregator.config
        try:
            host, port = self._aggregator.start()
        except OSError as exc:
            raise OSError(f"cannot listen on {config.bind_host}:{config.port}: {exc}") from exc
        if host in _WILDCARD_HOSTS:
            # Listening everywhere: hand out this node's address as Ray knows it.
            host = ray.util.get_node_ip_address()
        self._address = (host, port)
        return host, port

    def node_relay(self, node_id: str) -> int:
        """The loopback port of node ``node_id``'s relay: an actor pinned to that node,
        started when the node's first worker asks (an actor runs its calls in order, so
        a node gets one). ``RuntimeError`` saying why when it cannot start; a node whose
        relay failed once is not tried again.

        Ray restarts a relay actor that dies (up to ``RELAY_MAX_RESTARTS`` times); the
        restarted one asks :meth:`relay_port` for the port its workers send to."""
        why = self._relay_errors.get(node_id)
        if why is not None:
            raise RuntimeError(why)
        port = self._relay_ports.get(node_id)
        if port is not None:
            return port
        relay = self._relays.get(node_id)
        try:
            if self._address is None:
                raise RuntimeError("the aggregator is not listening")
            if relay is None:
                relay = (
                    ray.remote(_RelayActor)
                    .options(
                        num_cpus=0,
                        max_restarts=RELAY_MAX_RESTARTS,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                    )
                    .remote(
                        self._address,
                        self._token,
                        node_id,
                        ray.get_runtime_context().current_actor,
                    )
                )
                self._relays[node_id] = relay
            port = int(ray.get(relay.start.remote(), timeout=RELAY_START_TIMEOUT_S))
            self._relay_ports[node_id] = port
            return port
        except Exception as exc:
            why = _reason(exc) or type(exc).__name__
            self._relay_errors[node_id] = why
            failed = self._relays.pop(node_id, None)
            if failed is not None:
                with contextlib.suppress(Exception):
                    ray.kill(failed)
            raise RuntimeError(why) from None

    def relay_port(self, node_id: str) -> int | None:
        """The port node ``node_id``'s relay listens on for its workers (None: none
        started); what a restarted relay actor binds again."""
        return self._relay_ports.get(node_id)

    def relay_actor(self, node_id: str) -> Any:
        """Node ``node_id``'s relay actor handle (None: none started), for a look at it
        from outside (tests kill it to see it restarted)."""
        return self._relays.get(node_id)

    def stop_relays(self, timeout: float) -> int:
        """Stop the nodes' relays (each forwards what it holds within ``timeout``
        seconds), then kill their actors; how many nodes had one."""
        relays, self._relays = self._relays, {}
        self._relay_ports = {}
        refs = []
        for relay in relays.values():
            with contextlib.suppress(Exception):
                refs.append(relay.stop.remote(timeout))
        if refs:
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=timeout + _ACTOR_CALL_MARGIN_S)
        for relay in relays.values():
            with contextlib.suppress(Exception):
                ray.kill(relay)
        return len(relays)

    def dashboard_url(self) -> tuple[str | None, str | None]:
        """(the live dashboard's URL, why it did not start); (None, None) when it is off.

        Called after :meth:`start` (an actor runs its calls in order)."""
        monitoring = self._aggregator.monitoring
        if monitoring is None:
            return None, None
        for sink in monitoring.sinks:
            if sink.name == "dashboard":
                return str(getattr(sink, "url", "")) or None, None
        return None, monitoring.not_started.get("dashboard")

    def stop(self, wait_s: float) -> dict[str, Any]:
        """Wait (bounded) for the workers' connections to close, then finalize."""
        self._aggregator.wait_connections_closed(wait_s)
        result = self._aggregator.finalize()
        stats = result.stats
        summary = RayExportSummary(
            written_records=sum(stats.written_records.values()) if stats else 0,
            written_by_stream=dict(stats.written_records) if stats else {},
            dropped_batches=stats.dropped_batches if stats else 0,
            exporter_failed=stats.exporter_failed if stats else False,
            finished_ranks=list(result.ranks.finished_ranks),
            missing_ranks=list(result.ranks.missing_ranks),
            warning_path=str(result.warning_path) if result.warning_path else None,
        )
        # A plain dict crosses the actor boundary and is what users read.
        result_dict: dict[str, Any] = unstructure(summary)
        return result_dict


class _RelayActor:
    """One node's relay, in an actor pinned to that node: the node's workers send to it
    on loopback, and it forwards their frames as they are over one connection to the
    aggregator (docs/live-export.md, "Relays").

    Restarted by Ray after it died (``RELAY_MAX_RESTARTS``), it listens at once on the
    port the first one had, which ``aggregator`` (the aggregator actor) names: the
    node's workers' senders reconnect to it with their usual backoff. The frames the
    dead one held are lost; each rank's ``sent_batches`` counts them, so the aggregator
    reports them as dropped."""

    def __init__(
        self,
        upstream: tuple[str, int],
        token: str,
        node_id: str | None = None,
        aggregator: Any = None,
    ) -> None:
        self._upstream = upstream
        self._token = token
        self._relay: Relay | None = None
        self._port: int | None = None
        if aggregator is None or not ray.get_runtime_context().was_current_actor_reconstructed:
            return
        try:
            port = ray.get(aggregator.relay_port.remote(node_id), timeout=RELAY_PORT_ASK_TIMEOUT_S)
        except Exception as exc:
            _say(f"the node's relay restarted but cannot learn its port ({_reason(exc)})")
            return
        if port is None:
            return  # it died before it first listened: start() will be called
        try:
            self._port = self._listen(int(port))
        except OSError as exc:
            _say(f"the node's relay restarted but cannot listen on port {port} ({exc})")
            return
        _say(f"the node's relay restarted on port {port}; the node's workers reconnect to it")

    def _listen(self, port: int) -> int:
        relay = Relay(
            self._upstream,
            self._token,
            port=port,
            on_event=lambda line: _say(f"the node's relay {line}"),
        )
        bound = relay.start()[1]
        self._relay = relay
        return bound

    def start(self) -> int:
        """Listen on loopback (once); the port."""
        if self._port is None:
            self._port = self._listen(0)
        return self._port

    def stop(self, timeout: float) -> dict[str, int]:
        """Forward what it holds within ``timeout`` seconds, then close; its counts
        (those of this incarnation of the actor)."""
        if self._relay is None:
            return {"forwarded_frames": 0, "dropped_batches": 0, "dropped_messages": 0}
        stats = self._relay.stop(timeout)
        return {
            "forwarded_frames": stats.forwarded_frames,
            "dropped_batches": stats.dropped_batches,
            "dropped_messages": stats.dropped_messages,
        }


@attrs.frozen(kw_only=True)
class TraceMLRayRun:
    """What the last ``fit()`` did with TraceML (``TraceMLTorchTrainer.traceml_run``)."""

    session_id: str | None
    """The run folder's name; ``None`` when export was off."""
    run_dir: Path | None
    """``<logs_dir>/<session_id>``; ``None`` when export was off."""
    address: tuple[str, int] | None
    """Where workers sent telemetry; ``None`` when the aggregator did not start."""
    finalized: bool
    """The aggregator finalized (closing lines written) before its actor was killed."""
    summary: Mapping[str, Any] | None
    """Counts from finalization, the fields of ``traceml_ai.aggregator.protocol.RayExportSummary``:
    ``written_records``, ``written_by_stream``, ``dropped_batches``, ``exporter_failed``,
    ``finished_ranks``, ``missing_ranks``, ``warning_path``."""
    relays: int = 0
    """Nodes whose workers sent through a relay on their node (0: one node, or
    ``node_relay=False``)."""


@attrs.frozen
class AggregatorEndpoint:
    """Where the last ``fit()``'s workers sent telemetry (``last_endpoint``, TraceML
    0.5.0's name)."""

    host: str
    port: int
    session_id: str


# -- the worker side --------------------------------------------------------------------


@attrs.frozen
class _WorkerPlan:
    """What each worker needs to reach the aggregator (captured by the wrapped loop).

    ``address_ref`` is the ``ObjectRef`` of the actor's ``start()``: the aggregator
    starts while Ray brings the worker group up, and each worker waits for it.
    """

    address_ref: Any
    token: str
    sampler_interval: float
    init_mode: str = "auto"
    """``traceml.init``'s ``mode`` and ``patch_*`` (TraceMLRayConfig.init_mode & co.)."""
    init_patches: Mapping[str, bool | None] = attrs.field(factory=dict)
    parallel: str = ""
    """TraceMLRayConfig.parallel, normalized: the workers' ``TRACEML_PARALLEL``."""
    aggregator: Any = None
    """The aggregator actor's handle: a worker asks it for its node's relay."""
    node_relay: bool = False
    """TraceMLRayConfig.node_relay."""


def _required_positional_params(fn: Callable[..., Any]) -> int:
    # Ray Train calls a loop with one required parameter as fn(config), else fn().
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
    }
    return sum(
        1
        for p in inspect.signature(fn).parameters.values()
        if p.default is inspect.Parameter.empty and p.kind in kinds
    )


@contextlib.contextmanager
def _patched_environ(values: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def _aggregator_address(plan: _WorkerPlan) -> tuple[str, int] | None:
    """(host, port) of the aggregator, or ``None`` (with a warning) when it did not start."""
    try:
        host, port = ray.get(plan.address_ref, timeout=AGGREGATOR_START_TIMEOUT_S)
    except Exception as exc:
        warnings.warn(
            f"TraceML's aggregator did not start ({exc!r}); this worker trains without "
            "TraceML telemetry.",
            traceml.TraceMLWarning,
            stacklevel=2,
        )
        return None
    return str(host), int(port)


def _uses_node_relay(node_relay: bool, world_size: int, local_world_size: int) -> bool:
    """Whether a worker sends through a relay on its node: ``node_relay`` is on and the
    job's workers span several nodes (fewer of them on this node than in the job)."""
    return node_relay and 0 < local_world_size < world_size


def _send_address(
    plan: _WorkerPlan, upstream: tuple[str, int], world_size: int, local_world_size: int
) -> tuple[str, int]:
    """Where a worker sends: its node's relay on loopback on a job of several nodes,
    else the aggregator. A relay that cannot start costs one line, and the worker sends
    to the aggregator itself."""
    if plan.aggregator is None or not _uses_node_relay(
        plan.node_relay, world_size, local_world_size
    ):
        return upstream
    try:
        node_id = str(ray.get_runtime_context().get_node_id())
        port = ray.get(
            plan.aggregator.node_relay.remote(node_id),
            timeout=RELAY_START_TIMEOUT_S + _ACTOR_CALL_MARGIN_S,
        )
        return "127.0.0.1", int(port)
    except Exception as exc:
        _say(
            f"this node's relay did not start ({_reason(exc) or type(exc).__name__}); "
            "this worker sends to the aggregator itself"
        )
        return upstream


def _worker_environ(plan: _WorkerPlan, address: tuple[str, int]) -> dict[str, str]:
    context = ray.train.get_context()
    host, port = address
    return {
        "RANK": str(context.get_world_rank()),
        "LOCAL_RANK": str(context.get_local_rank()),
        "WORLD_SIZE": str(context.get_world_size()),
        "LOCAL_WORLD_SIZE": str(context.get_local_world_size()),
        "GROUP_RANK": str(context.get_node_rank()),
        ENV_AGGREGATOR_ADDR: f"{_url_host(host)}:{port}",
        ENV_RUN_TOKEN: plan.token,
        ENV_SAMPLER_INTERVAL: repr(plan.sampler_interval),
        _environ.PARALLEL: plan.parallel,
    }


def _shutdown_quietly() -> None:
    # Never let TraceML's shutdown replace the loop's own result or exception.
    try:
        traceml.shutdown()
    except Exception as exc:
        warnings.warn(
            f"TraceML could not shut down cleanly on this worker ({exc!r}).",
            traceml.TraceMLWarning,
            stacklevel=2,
        )


def _run_traced(plan: _WorkerPlan | None, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Run the user's loop between ``traceml.init()`` and ``traceml.shutdown()``."""
    address = _aggregator_address(plan) if plan is not None else None
    if plan is None or address is None:
        # Export off (or no aggregator): trace_step & co. stay silent no-ops.
        traceml.init(mode="off")
        try:
            return fn(*args)
        finally:
            _shutdown_quietly()
    context = ray.train.get_context()
    address = _send_address(plan, address, context.get_world_size(), context.get_local_world_size())
    with _patched_environ(_worker_environ(plan, address)):
        patches = plan.init_patches
        traceml.init(
            plan.init_mode,
            patch_dataloader=patches.get("patch_dataloader"),
            patch_forward=patches.get("patch_forward"),
            patch_backward=patches.get("patch_backward"),
            patch_h2d=patches.get("patch_h2d"),
        )
        try:
            return fn(*args)
        finally:
            _shutdown_quietly()


def _wrap_loop(fn: Callable[..., Any], plan: _WorkerPlan | None) -> Callable[..., Any]:
    """The user's loop with TraceML around it, taking the same arguments as ``fn``."""
    if _required_positional_params(fn) == 1:

        @functools.wraps(fn)
        def loop_with_config(config: Any) -> Any:
            return _run_traced(plan, fn, (config,))

        return loop_with_config

    @functools.wraps(fn)
    def loop() -> Any:
        return _run_traced(plan, fn, ())

    return loop


# -- the driver side --------------------------------------------------------------------


class TraceMLTorchTrainer:
    """Ray Train's ``TorchTrainer`` with TraceML telemetry from every worker.

    Takes what ``ray.train.torch.TorchTrainer`` takes, plus ``traceml_config``
    (a :class:`TraceMLRayConfig`; the default has export off). Inside
    ``train_loop_per_worker``, use ``traceml.trace_step(model)`` as in any TraceML
    script; ``traceml.init()`` and ``traceml.shutdown()`` are called for you.

    With ``exporter=""`` no aggregator starts and no run folder is made: the loop runs
    unchanged and TraceML calls in it do nothing.
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        traceml_config: TraceMLRayConfig | None = None,
        **torch_trainer_kwargs: Any,
    ) -> None:
        if traceml_config is None:
            traceml_config = TraceMLRayConfig()
        if not isinstance(traceml_config, TraceMLRayConfig):
            raise TypeError(
                f"traceml_config must be a TraceMLRayConfig, got {type(traceml_config).__name__}"
            )
        if not callable(train_loop_per_worker):
            raise TypeError("train_loop_per_worker must be callable")
        required = _required_positional_params(train_loop_per_worker)
        if required > 1:
            raise ValueError(
                "train_loop_per_worker should take in 0 or 1 required arguments, but it "
                f"accepts {required} required arguments instead."
            )
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = train_loop_config
        self.traceml_config = traceml_config
        self.torch_trainer_kwargs = torch_trainer_kwargs
        self.traceml_run: TraceMLRayRun | None = None
        """What the last ``fit()`` did with TraceML (set even when it raised)."""

    @property
    def last_endpoint(self) -> AggregatorEndpoint | None:
        """The aggregator the last ``fit()`` used; ``None`` with export off or when it
        did not start (TraceML 0.5.0's property; ``traceml_run`` says more)."""
        run = self.traceml_run
        if run is None or run.address is None or run.session_id is None:
            return None
        return AggregatorEndpoint(run.address[0], run.address[1], run.session_id)

    def _expected_world_size(self) -> int | None:
        scaling = self.torch_trainer_kwargs.get("scaling_config")
        workers = getattr(scaling, "num_workers", None)
        return workers if type(workers) is int and workers >= 1 else None

    def _torch_trainer(self, plan: _WorkerPlan | None) -> Any:
        return TorchTrainer(
            _wrap_loop(self.train_loop_per_worker, plan),
            train_loop_config=self.train_loop_config,
            **self.torch_trainer_kwargs,
        )

    def fit(self) -> Any:
        """Run training with TraceML; returns (and raises) what ``TorchTrainer.fit()`` does."""
        config = self.traceml_config
        # The aggregator actor runs when export or a live view (Prometheus, OTLP, the
        # dashboard) is on.
        if not config.export_enabled and not config.monitor_settings.any_on:
            self.traceml_run = TraceMLRayRun(
                session_id=None, run_dir=None, address=None, finalized=False, summary=None
            )
            return self._torch_trainer(None).fit()

        session_id = config.session_id or _fresh_session_id(config)
        run_dir = config.run_dir(session_id)
        token = new_run_token()
        self.traceml_run = TraceMLRayRun(
            session_id=session_id, run_dir=run_dir, address=None, finalized=False, summary=None
        )
        actor, address_ref = self._launch_actor(session_id, run_dir, token)
        plan = None
        if address_ref is not None:
            _say(f"run folder {run_dir}")
            if config.mode == "dashboard":
                _say_dashboard_url(actor)
            plan = _WorkerPlan(
                address_ref,
                token,
                config.sampler_interval_sec,
                config.init_mode,
                config.init_patches(),
                parse_parallel(config.parallel),
                aggregator=actor,
                node_relay=config.node_relay,
            )
        try:
            return self._torch_trainer(plan).fit()
        finally:
            if actor is not None:
                self._stop_actor(actor, address_ref)

    def _launch_actor(self, session_id: str, run_dir: Path, token: str) -> tuple[Any, Any]:
        """Create the aggregator actor and ask it to start, without waiting for either."""
        config = self.traceml_config
        if not ray.is_initialized():
            ray.init()
        options: dict[str, Any] = {
            "num_cpus": 0,
            "name": ACTOR_NAME_PREFIX + session_id,
            "max_restarts": 0,
        }
        # The run folder is on the driver's node, so the aggregator runs there too.
        node_id = _driver_node_id()
        if node_id is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        actor = None
        try:
            actor = (
                ray.remote(_AggregatorActor)
                .options(**options)
                .remote(
                    str(run_dir),
                    config.export_settings,
                    token,
                    config.bind_host,
                    config.port,
                    self._expected_world_size(),
                    config.finalize_timeout_sec,
                    config.monitor_settings,
                )
            )
            return actor, actor.start.remote()
        except Exception as exc:
            _say(f"the aggregator did not start ({exc}); training runs without TraceML telemetry")
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            return None, None

    def _stop_actor(self, actor: Any, address_ref: Any) -> None:
        """Finalize the aggregator (bounded), then kill its actor, whatever happened."""
        config = self.traceml_config
        try:
            try:
                host, port = ray.get(address_ref, timeout=AGGREGATOR_START_TIMEOUT_S)
            except Exception as exc:
                why = _reason(exc)
                _say(
                    f"the aggregator did not start ({why}); training ran without TraceML telemetry"
                )
                if self.traceml_run is not None and self.traceml_run.run_dir is not None:
                    report_export_off(self.traceml_run.run_dir, why)
                return
            run = self.traceml_run
            if run is not None:
                self.traceml_run = run = attrs.evolve(run, address=(str(host), int(port)))
            # The nodes' relays first: what they hold reaches the aggregator before it
            # finalizes.
            try:
                relays = ray.get(
                    actor.stop_relays.remote(config.finalize_timeout_sec),
                    timeout=config.finalize_timeout_sec + 2 * _ACTOR_CALL_MARGIN_S,
                )
                if run is not None and relays:
                    self.traceml_run = run = attrs.evolve(run, relays=int(relays))
            except Exception as exc:
                _say(f"the nodes' relays did not stop ({_reason(exc)}); finalizing without them")
            try:
                summary = ray.get(
                    actor.stop.remote(config.finalize_timeout_sec),
                    timeout=2 * config.finalize_timeout_sec + _ACTOR_CALL_MARGIN_S,
                )
            except Exception as exc:
                _say(
                    f"the aggregator did not finalize ({exc}); "
                    "export files may lack their closing lines"
                )
                return
            if run is not None:
                self.traceml_run = attrs.evolve(run, finalized=True, summary=summary)
                export_dir = run.run_dir / "aggregator" / "export" if run.run_dir else None
                _say(f"export: {summary['written_records']} records in {export_dir}")
            if summary.get("warning_path"):
                _say(f"something was lost; see {summary['warning_path']}")
            if config.mode == "summary" and run is not None and run.run_dir is not None:
                _print_analysis(run.run_dir)
        finally:
            with contextlib.suppress(Exception):
                ray.kill(actor)


def _print_analysis(run_dir: Path) -> None:
    """The run's summary on stderr (``mode="summary"``); never fails or stalls ``fit()``."""
    try:
        export_dir = run_dir / "aggregator" / "export"
        if not export_dir.is_dir():
            return
        size = sum(f.stat().st_size for f in export_dir.glob("*.jsonl"))
        if size > END_OF_RUN_SUMMARY_MAX_BYTES:
            command = shlex.join(["traceml", "summary", str(run_dir)])
            _say(f"summary: {size / 2**20:.0f} MiB of export files; `{command}`")
            return
        from traceml_ai.analysis import format_summary, summarize_run

        print(format_summary(summarize_run(run_dir)), file=sys.stderr, flush=True)
    except Exception as exc:
        _say(f"summary unavailable: {type(exc).__name__}: {exc}")


def _say_dashboard_url(actor: Any) -> None:
    """Print the dashboard's URL on the driver once the actor has started (on a thread
    of its own: ``fit()`` never waits for it)."""

    def wait_and_say() -> None:
        try:
            url, why = ray.get(actor.dashboard_url.remote(), timeout=AGGREGATOR_START_TIMEOUT_S)
        except Exception as exc:
            _say(f"dashboard: its URL is unknown ({_reason(exc)})")
            return
        if url:
            _say(f"dashboard: live at {url} (until the run has finalized)")
        elif why:
            _say(f"dashboard: did not start ({why}); training and the files go on without it")

    threading.Thread(target=wait_and_say, name="traceml-dashboard-url", daemon=True).start()


def _reason(exc: BaseException) -> str:
    """The short reason of a failed actor call (Ray wraps the actor's exception)."""
    cause = getattr(exc, "cause", None)
    return str(cause if isinstance(cause, BaseException) else exc)


def _fresh_session_id(config: TraceMLRayConfig) -> str:
    """A sortable, timestamp-based id whose run folder does not exist yet."""
    while True:
        session_id = default_run_name()
        if not config.run_dir(session_id).exists():
            return session_id


def _driver_node_id() -> str | None:
    try:
        node_id = ray.get_runtime_context().get_node_id()
    except Exception:
        return None
    return str(node_id) if node_id else None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
