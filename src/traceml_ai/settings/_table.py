"""The settings table: one entry per setting, from which everything else is derived.

Each :class:`Setting` names the setting once (its ``traceml.yaml`` key); the flag
(``--<name-with-dashes>``), the environment variable (``TRACEML_<NAME>``), the click
option of each command that takes it, the ``TraceMLRayConfig`` field, the defaults
of the typed settings objects and the docs' table all come from the entry.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import attrs

from traceml_ai._ports import DEFAULT_DASHBOARD_PORT, DEFAULT_SERVE_PORT, LOOPBACK
from traceml_ai.settings._parse import (
    BOOL_FORMS,
    EXPORTER_FORMS,
    MAX_SECONDS,
    PARALLEL_FORMS,
    TRACKERS_FORMS,
    Bounds,
    Command,
    ExportStreams,
    OutOfBounds,
    parse_bool_value,
    parse_exporter_value,
    parse_folder,
    parse_host,
    parse_number,
    parse_parallel,
    parse_run_name,
    parse_trackers,
    parse_whole,
)
from traceml_records import DEFAULT_EXPORT_STREAMS as _CONTRACT_DEFAULT_STREAMS
from traceml_records import SELECTION_NAMES

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class _Same:
    """``Setting.ray_default``'s marker: the Ray field's default is the setting's."""

    def __repr__(self) -> str:
        return "SAME"


SAME = _Same()


@attrs.frozen(kw_only=True)
class Setting(Generic[T_co]):
    """One launcher setting: where it is read from, how it is parsed, its default.

    ``name`` is the ``traceml.yaml`` key; the flag is ``--`` plus the name with dashes
    and the environment variable ``TRACEML_`` plus the name in capitals. ``parse``
    takes the text of any layer and raises ``ValueError`` for a malformed value.
    A number setting's ``bounds`` say its range, checked after ``parse`` in
    :meth:`read`, the one place a value is read.
    ``default`` ``None`` means the command decides (``default_doc`` says how; without
    one the docs show the default itself). ``ray`` names the ``TraceMLRayConfig`` field
    of the setting (None: Ray has none); its default is ``default`` unless
    ``ray_default`` says otherwise (a Ray job decides differently). A ``repeatable``
    setting's flag may be given several times, and names one value (its name without
    the plural ``s``).
    """

    name: str
    parse: Callable[[str], T_co]
    default: T_co | None
    help: str
    metavar: str
    commands: tuple[Command, ...]
    forms: str = ""
    """What the setting takes, as a message says it (a bounded one's comes from
    ``bounds``)."""
    bounds: Bounds | None = None
    """The range of a number setting, checked by :meth:`read`."""
    default_doc: str = ""
    ray: str | None = None
    ray_default: object = SAME
    repeatable: bool = False
    """The flag may be given several times (its values join as a comma list)."""

    @property
    def kind(self) -> type:
        """The type of a value given in code (a ``TraceMLRayConfig`` field): a switch's
        is ``bool``, a number's ``int`` or ``float`` (its bounds say which), any other
        setting's its text, ``str``."""
        if self.is_switch:
            return bool
        if self.bounds is not None:
            return int if self.bounds.whole else float
        return str

    @property
    def expected(self) -> str:
        """What the setting takes, as the docs and the messages say it."""
        return self.bounds.expected if self.bounds is not None else self.forms

    def read(self, text: str) -> T_co:
        """The value ``text`` holds: parsed, and checked against the setting's bounds.
        Raises ``ValueError`` (:class:`OutOfBounds` for a number) whose message says
        what was expected and what was got."""
        if self.bounds is None:
            return self.parse(text)
        try:
            value = self.parse(text)
        except ValueError:
            raise OutOfBounds(self.bounds.expected, text) from None
        assert isinstance(value, int | float)
        self.bounds.check(value, text)
        return value

    @property
    def flag(self) -> str:
        """The CLI flag, e.g. ``--logs-dir``; a repeatable one names one value
        (``--tracker`` for ``trackers``)."""
        name = self.name.removesuffix("s") if self.repeatable else self.name
        return "--" + name.replace("_", "-")

    @property
    def env(self) -> str:
        """The environment variable, e.g. ``TRACEML_LOGS_DIR``."""
        return "TRACEML_" + self.name.upper()

    @property
    def yaml_key(self) -> str:
        """The ``traceml.yaml`` key (the setting's name)."""
        return self.name

    @property
    def is_switch(self) -> bool:
        """An on/off setting: a ``--flag/--no-flag`` pair on the command line."""
        return self.parse is parse_bool_value

    @property
    def doc_default(self) -> str:
        """The default as the docs and ``--help`` say it."""
        if self.default_doc:
            return self.default_doc
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        return str(self.default)

    @property
    def ray_field_default(self) -> object:
        """The default of the ``TraceMLRayConfig`` field."""
        return self.default if self.ray_default is SAME else self.ray_default


def default_of(setting: Setting[T]) -> T:
    """The default of a setting that has one (typed, for the settings objects)."""
    assert setting.default is not None, setting.name
    return setting.default


_BOTH: tuple[Command, ...] = ("run", "serve")

# The ranges of the number settings.
SECONDS = Bounds(0, MAX_SECONDS, whole=False)
"""A wait or an interval: more than 0 seconds, at most a year."""
COUNT = Bounds(1)
"""A whole number of at least 1 (at most ``MAX_COUNT``)."""
BOUND = Bounds(0)
"""A whole number of at least 0: a bound where 0 means none."""
PORT = Bounds(0, 65535, note="0 picks a free port")
"""A TCP port."""

EXPORTER: Setting[str] = Setting(
    name="exporter",
    parse=parse_exporter_value,
    default="",
    default_doc="off",
    forms=EXPORTER_FORMS,
    help="Exporter: '' or off, 'jsonl', or 'module.path:factory'.",
    metavar="EXPORTER",
    commands=_BOTH,
    ray="exporter",
)
EXPORT_STREAMS: Setting[ExportStreams] = Setting(
    name="export_streams",
    parse=ExportStreams.parse,
    default=ExportStreams.parse(_CONTRACT_DEFAULT_STREAMS),
    forms="comma-separated stream names from " + ", ".join(SELECTION_NAMES),
    help="Streams to export, comma-separated: " + ", ".join(SELECTION_NAMES) + ".",
    metavar="NAMES",
    commands=_BOTH,
    ray="export_streams",
    ray_default=_CONTRACT_DEFAULT_STREAMS,  # the field holds the text; the config parses it
)
EXPORTER_HOSTNAME: Setting[bool] = Setting(
    name="exporter_hostname",
    parse=parse_bool_value,
    default=False,
    forms=BOOL_FORMS,
    help="Include hostname on the lines that carry it.",
    metavar="",
    commands=_BOTH,
    ray="exporter_hostname",
)
LOGS_DIR: Setting[Path] = Setting(
    name="logs_dir",
    parse=parse_folder,
    default=Path("logs"),
    forms="a folder path",
    help="Where run folders are created.",
    metavar="DIR",
    commands=_BOTH,
    ray="logs_dir",
    ray_default="./logs",
)
RUN_NAME: Setting[str] = Setting(
    name="run_name",
    parse=parse_run_name,
    default=None,
    default_doc="UTC timestamp plus a random suffix",
    forms="a folder name",
    help="Run folder name.",
    metavar="NAME",
    commands=_BOTH,
    ray="session_id",
    ray_default="",  # a fresh id for every fit()
)
INTERVAL: Setting[float] = Setting(
    name="interval",
    parse=parse_number,
    default=2.0,
    bounds=SECONDS,
    help="Seconds between process/system samples.",
    metavar="SECONDS",
    commands=("run",),
    ray="sampler_interval_sec",
)
FINALIZE_TIMEOUT_SEC: Setting[float] = Setting(
    name="finalize_timeout_sec",
    parse=parse_number,
    default=10.0,
    bounds=SECONDS,
    help="Longest wait for pending records at shutdown.",
    metavar="SECONDS",
    commands=_BOTH,
    ray="finalize_timeout_sec",
)
AGGREGATOR_HOST: Setting[str] = Setting(
    name="aggregator_host",
    parse=parse_host,
    default=None,
    default_doc="start one on node 0",
    forms="a host name or an IP address",
    help="Send to an aggregator already running there (e.g. `traceml serve`) "
    "instead of starting one on node 0.",
    metavar="HOST",
    commands=("run",),
)
AGGREGATOR_PORT: Setting[int] = Setting(
    name="aggregator_port",
    parse=parse_whole,
    default=None,
    default_doc=f"run: a free port on one node, {DEFAULT_SERVE_PORT} across nodes; "
    f"serve: {DEFAULT_SERVE_PORT}",
    bounds=PORT,
    help="Aggregator port (0 picks a free one).",
    metavar="PORT",
    commands=_BOTH,
    ray="port",
    ray_default=0,  # a free port on the driver's node
)
AGGREGATOR_BIND_HOST: Setting[str] = Setting(
    name="aggregator_bind_host",
    parse=parse_host,
    default=LOOPBACK,
    forms="a host name or an IP address",
    help="Address to listen on (0.0.0.0 for ranks on other hosts).",
    metavar="HOST",
    commands=("serve",),
    ray="bind_host",
)
NNODES: Setting[int] = Setting(
    name="nnodes",
    parse=parse_whole,
    default=None,
    default_doc="1 with --nproc-per-node",
    bounds=COUNT,
    help="Nodes in the job (with --nproc-per-node gives the world size).",
    metavar="N",
    commands=("serve",),
)
NPROC_PER_NODE: Setting[int] = Setting(
    name="nproc_per_node",
    parse=parse_whole,
    default=None,
    default_doc="the world size the first rank reports",
    bounds=COUNT,
    help="Ranks per node; without it, the world size the first rank reports is expected.",
    metavar="N",
    commands=("serve",),
)
NODE_RELAY: Setting[bool] = Setting(
    name="node_relay",
    parse=parse_bool_value,
    default=True,
    forms=BOOL_FORMS,
    help="On a job of several nodes, the ranks of each node send through one relay on "
    "their node, which forwards their batches over one connection to the aggregator "
    "(--no-node-relay: each rank connects to the aggregator itself). One node: no relay.",
    metavar="",
    commands=("run",),
    ray="node_relay",
)


def parse_relay_upstream(text: str) -> str:
    """``HOST:PORT`` of the aggregator (or relay) a relay forwards to, normalized; else
    ``ValueError``."""
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if not port.isdigit():
        raise ValueError(f"expected a port from 1 to 65535, got {port!r}")
    number = parse_whole(port)
    if not 1 <= number <= 65535:
        raise ValueError(f"expected a port from 1 to 65535, got {port!r}")
    return f"{parse_host(host)}:{number}"


RELAY: Setting[str] = Setting(
    name="relay",
    parse=parse_relay_upstream,
    default=None,
    default_doc="off (serve the run)",
    forms="HOST:PORT",
    help="Run a relay instead of an aggregator: ranks (or relays) send to it, and it "
    "forwards their batches as they are over one connection to the aggregator (or relay) "
    "at HOST:PORT, with the run token of TRACEML_RUN_TOKEN.",
    metavar="HOST:PORT",
    commands=("serve",),
)
PROMETHEUS_PORT: Setting[int] = Setting(
    name="prometheus_port",
    parse=parse_whole,
    default=None,
    default_doc="off",
    bounds=PORT,
    help="Serve Prometheus metrics at http://HOST:PORT/metrics from the aggregator "
    "(0 picks a free port).",
    metavar="PORT",
    commands=_BOTH,
    ray="prometheus_port",
)
PROMETHEUS_BIND_HOST: Setting[str] = Setting(
    name="prometheus_bind_host",
    parse=parse_host,
    default=LOOPBACK,
    forms="a host name or an IP address",
    help="Address the /metrics endpoint listens on (0.0.0.0 to be scraped from other hosts).",
    metavar="HOST",
    commands=_BOTH,
    ray="prometheus_bind_host",
)
RANK_SERIES_MAX_RANKS: Setting[int] = Setting(
    name="rank_series_max_ranks",
    parse=parse_whole,
    default=64,
    bounds=BOUND,
    help="Serve every rank's own series (its gauges, step and phase histograms; each node's "
    "system and GPU figures) on Prometheus and OTLP while the run has at most N ranks; "
    "above it, a bounded set: the distributions across ranks, nodes and GPUs, each node's "
    "and stage's step time, the 8 slowest ranks and the named stragglers (0: always the "
    "bounded set).",
    metavar="N",
    commands=_BOTH,
    ray="rank_series_max_ranks",
)
OTLP: Setting[bool] = Setting(
    name="otlp",
    parse=parse_bool_value,
    default=False,
    forms=BOOL_FORMS,
    help="Export metrics and step traces with OpenTelemetry (OTLP) from the aggregator, "
    "to where the OTEL_EXPORTER_OTLP_* variables say (needs the 'otel' extra).",
    metavar="",
    commands=_BOTH,
    ray="otlp",
)
OTLP_TRACE_SAMPLE: Setting[int] = Setting(
    name="otlp_trace_sample",
    parse=parse_whole,
    default=100,
    bounds=COUNT,
    help="Trace one step in N per rank (plus every step far above its rank's recent "
    "median); 1 traces every step.",
    metavar="N",
    commands=_BOTH,
    ray="otlp_trace_sample",
)
DASHBOARD: Setting[bool] = Setting(
    name="dashboard",
    parse=parse_bool_value,
    default=False,
    forms=BOOL_FORMS,
    help="Serve the live dashboard from the aggregator (needs the 'dashboard' extra); "
    "traceml run --mode dashboard sets it.",
    metavar="",
    commands=_BOTH,
)
DASHBOARD_PORT: Setting[int] = Setting(
    name="dashboard_port",
    parse=parse_whole,
    default=DEFAULT_DASHBOARD_PORT,
    bounds=PORT,
    help="Port of the live dashboard (--mode dashboard; 0 picks a free port).",
    metavar="PORT",
    commands=_BOTH,
    ray="dashboard_port",
)
DASHBOARD_BIND_HOST: Setting[str] = Setting(
    name="dashboard_bind_host",
    parse=parse_host,
    default=LOOPBACK,
    forms="a host name or an IP address",
    help="Address the dashboard listens on.",
    metavar="HOST",
    commands=_BOTH,
    ray="dashboard_bind_host",
)
TRACKERS: Setting[tuple[str, ...]] = Setting(
    name="trackers",
    parse=parse_trackers,
    default=(),
    default_doc="off",
    forms=TRACKERS_FORMS,
    help="Log TraceML's figures to these experiment trackers from the aggregator "
    "(docs/trackers.md; each needs its extra): repeat the flag or give a comma list.",
    metavar="NAME",
    commands=_BOTH,
    ray="trackers",
    ray_default="",  # the field holds the text; the config parses it
    repeatable=True,
)
TRACKER_EVERY_STEPS: Setting[int] = Setting(
    name="tracker_every_steps",
    parse=parse_whole,
    # One point per 100 steps: at 1,024 ranks a point is one pass over the ranks'
    # latest steps (medians, the maximum) and one write of a bounded set of values,
    # so the aggregator's cost stays far below the export's and a tracker's chart
    # still gets hundreds of points over a run of tens of thousands of steps.
    default=100,
    bounds=COUNT,
    help="Log to the trackers every N training steps (the step all ranks have reached).",
    metavar="N",
    commands=_BOTH,
    ray="tracker_every_steps",
)
PARALLEL: Setting[str] = Setting(
    name="parallel",
    parse=parse_parallel,
    default="",
    default_doc="none (found from the script's DeviceMesh, pipelining, Megatron, DeepSpeed)",
    forms=PARALLEL_FORMS,
    help="The job's parallel layout, e.g. tp=4,cp=1,dp=8,pp=4 (Megatron's order: the first "
    "dimension varies fastest with the rank); each rank's place in it is exported, and "
    "each collective's group named by it. A layout the script makes (a DeviceMesh, "
    "torch pipelining, Megatron, DeepSpeed) wins.",
    metavar="LAYOUT",
    commands=_BOTH,
    ray="parallel",
)

SETTINGS: tuple[Setting[object], ...] = (
    EXPORTER,
    EXPORT_STREAMS,
    EXPORTER_HOSTNAME,
    LOGS_DIR,
    RUN_NAME,
    INTERVAL,
    FINALIZE_TIMEOUT_SEC,
    AGGREGATOR_HOST,
    AGGREGATOR_PORT,
    AGGREGATOR_BIND_HOST,
    NNODES,
    NPROC_PER_NODE,
    NODE_RELAY,
    RELAY,
    PROMETHEUS_PORT,
    PROMETHEUS_BIND_HOST,
    RANK_SERIES_MAX_RANKS,
    OTLP,
    OTLP_TRACE_SAMPLE,
    DASHBOARD,
    DASHBOARD_PORT,
    DASHBOARD_BIND_HOST,
    TRACKERS,
    TRACKER_EVERY_STEPS,
    PARALLEL,
)
"""Every setting of ``traceml run`` and ``traceml serve``, in the order of the docs."""

SETTINGS_BY_NAME: dict[str, Setting[object]] = {s.name: s for s in SETTINGS}

RUN_TORCHRUN_OPTIONS = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port")
"""``traceml run``'s torchrun options: command line only, never from env or YAML."""

# Other TraceML features may add their own keys here (``KNOWN_YAML_KEYS.add(...)``) so
# that they stop being reported as unknown; the file is shared by every setting.
KNOWN_YAML_KEYS: set[str] = {s.yaml_key for s in SETTINGS}

ENV_EXPORTER = EXPORTER.env
ENV_EXPORT_STREAMS = EXPORT_STREAMS.env
ENV_EXPORTER_HOSTNAME = EXPORTER_HOSTNAME.env
CLI_EXPORTER = EXPORTER.flag
CLI_EXPORT_STREAMS = EXPORT_STREAMS.flag
CLI_EXPORTER_HOSTNAME = EXPORTER_HOSTNAME.flag
DEFAULT_EXPORTER = default_of(EXPORTER)
DEFAULT_EXPORT_STREAMS = default_of(EXPORT_STREAMS)
DEFAULT_EXPORTER_HOSTNAME = default_of(EXPORTER_HOSTNAME)
DEFAULT_FINALIZE_TIMEOUT_SEC = default_of(FINALIZE_TIMEOUT_SEC)
